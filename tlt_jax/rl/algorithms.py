"""GRPO-family RL math: advantages, loss aggregation, clipped policy loss, KL, entropy.

Every function here is a small pure `jnp` function. Variants live in plain dict registries
(`ADVANTAGE_ESTIMATORS`, `LOSS_AGGREGATIONS`, `KL_ESTIMATORS`) keyed by the string held in a
typed `AlgorithmConfig` field. Registry lookups happen in Python on static strings, outside the
traced math, so every function is jittable with the string arguments marked static.

Dimension legend:
  P  prompts in the batch
  G  group size (completions sampled per prompt)
  B  sequences, B = P * G (row b belongs to prompt b // G)
  T  response tokens (padded; `mask_BxT` marks the real ones)
  V  vocabulary

Conventions: `mask_BxT` is 1 on response tokens that count and 0 on padding (any numeric or
bool dtype). Values at masked positions are never trusted: they are replaced with 0 via
`jnp.where` before any reduction, so NaN/inf in padding cannot leak into losses or gradients.
"""

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

# ---------------------------------------------------------------------------------------------
# Advantage estimators: fn(rewards_PxG, eps) -> advantages_PxG.
# ---------------------------------------------------------------------------------------------


def _centered(rewards_PxG: jax.Array) -> jax.Array:
    """`r - mean(r)` within each group, exactly 0 for a group whose rewards are all equal.

    The float32 mean of G equal rewards can be an ulp off (eight 0.1s average to 0.1 + 7e-9),
    and GRPO's division by a std of ~1e-8 + eps turns that ulp into advantages of ~-0.007 for
    a group with no signal. Shifting by the group's first reward first makes an all-equal group
    exactly zero before the mean is taken (and is the textbook shifted-data variance trick).
    """
    shifted_PxG = rewards_PxG - rewards_PxG[..., :1]
    return shifted_PxG - jnp.mean(shifted_PxG, axis=-1, keepdims=True)


def grpo_advantages(rewards_PxG: jax.Array, eps: float = 1e-6) -> jax.Array:
    """GRPO group-normalised advantages, `(r - mean) / (std + eps)` within each group.

    The std is the *sample* std (Bessel-corrected, ddof=1), matching verl
    (`torch.std`) and tunix (`ddof=1`). A group whose rewards are all equal has zero
    deviation, so its advantages are exactly 0 (not NaN, nor an ulp of rounding blown up by
    the division; see `_centered`). With G == 1 the std is taken
    as 0, and the advantage is 0.

    Args:
      rewards_PxG: scalar reward per completion, grouped by prompt.
      eps: added to the std so the division stays finite (0: pure std scaling; a group of
        equal rewards still gets exactly 0).

    Returns:
      advantages_PxG, float32.
    """
    rewards_PxG = jnp.asarray(rewards_PxG, jnp.float32)
    group_size = rewards_PxG.shape[-1]
    centered_PxG = _centered(rewards_PxG)
    variance_Px1 = jnp.sum(jnp.square(centered_PxG), axis=-1, keepdims=True) / max(
        group_size - 1, 1
    )
    # With eps = 0 an all-equal group would divide 0 by 0: its advantages stay exactly 0.
    std_Px1 = jnp.sqrt(variance_Px1) + eps
    return jnp.where(std_Px1 > 0, centered_PxG / jnp.where(std_Px1 > 0, std_Px1, 1.0), 0.0)


def dr_grpo_advantages(rewards_PxG: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Dr. GRPO advantages, `r - mean` within each group (no std scaling).

    A group whose rewards are all equal gets exactly 0.

    Args:
      rewards_PxG: scalar reward per completion, grouped by prompt.
      eps: unused; kept so every estimator has the same signature.

    Returns:
      advantages_PxG, float32.
    """
    del eps
    return _centered(jnp.asarray(rewards_PxG, jnp.float32))


def rloo_advantages(rewards_PxG: jax.Array, eps: float = 1e-6) -> jax.Array:
    """REINFORCE leave-one-out advantages, `r_i - mean_{j != i} r_j`.

    Equal to `G / (G - 1) * (r_i - mean)`, computed that way (from `_centered`), so a group whose
    rewards are all equal gets exactly 0. With G == 1 there is no other sample to form a
    baseline, and the advantages are 0.

    Args:
      rewards_PxG: scalar reward per completion, grouped by prompt.
      eps: unused; kept so every estimator has the same signature.

    Returns:
      advantages_PxG, float32.
    """
    del eps
    rewards_PxG = jnp.asarray(rewards_PxG, jnp.float32)
    group_size = rewards_PxG.shape[-1]
    if group_size < 2:
        return jnp.zeros_like(rewards_PxG)
    return _centered(rewards_PxG) * (group_size / (group_size - 1))


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., jax.Array]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}

# ---------------------------------------------------------------------------------------------
# Loss aggregations: fn(loss_BxT, mask_BxT) -> scalar (`aggregator` binds a constant).
# ---------------------------------------------------------------------------------------------


def _masked(values_BxT: jax.Array, mask_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Returns (values with padding zeroed, float32 mask)."""
    mask_BxT = jnp.asarray(mask_BxT).astype(jnp.float32)
    values_BxT = jnp.where(mask_BxT > 0, jnp.asarray(values_BxT, jnp.float32), 0.0)
    return values_BxT * mask_BxT, mask_BxT


def token_mean(loss_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """Sum over every real token in the batch / number of real tokens (DAPO).

    Returns 0 for an all-padding batch.
    """
    loss_BxT, mask_BxT = _masked(loss_BxT, mask_BxT)
    return jnp.sum(loss_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1.0)


def _mean_over_sequences(per_sequence_B: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    # Rows with no real token (batch padding) are left out of the mean, so padding a batch
    # to a fixed shape does not change the loss.
    has_tokens_B = (jnp.sum(mask_BxT, axis=-1) > 0).astype(jnp.float32)
    return jnp.sum(per_sequence_B * has_tokens_B) / jnp.maximum(jnp.sum(has_tokens_B), 1.0)


def seq_mean_token_sum(loss_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """Per-sequence token sum, then mean over sequences that have at least one token."""
    loss_BxT, mask_BxT = _masked(loss_BxT, mask_BxT)
    return _mean_over_sequences(jnp.sum(loss_BxT, axis=-1), mask_BxT)


def seq_mean_token_mean(loss_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """Per-sequence token mean, then mean over sequences that have at least one token (GRPO)."""
    loss_BxT, mask_BxT = _masked(loss_BxT, mask_BxT)
    lengths_B = jnp.maximum(jnp.sum(mask_BxT, axis=-1), 1.0)
    return _mean_over_sequences(jnp.sum(loss_BxT, axis=-1) / lengths_B, mask_BxT)


def seq_mean_token_sum_norm(loss_BxT: jax.Array, mask_BxT: jax.Array, *,
                            norm_tokens: int) -> jax.Array:  # fmt: skip
    """Per-sequence token sum / a constant `norm_tokens`, then mean over sequences that have
    at least one token (Dr. GRPO: the generation budget, so no sequence's length scales its
    tokens, and the loss keeps `token_mean`'s size where `seq_mean_token_sum`'s grows with the
    lengths, which decides what a gradient-norm clip does)."""
    return seq_mean_token_sum(loss_BxT, mask_BxT) / norm_tokens


# The aggregations that take `norm_tokens` (`aggregator`).
NORMED_AGGREGATIONS = ("seq_mean_token_sum_norm",)

LOSS_AGGREGATIONS: dict[str, Callable[..., jax.Array]] = {
    "token_mean": token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
}


def _check_norm_tokens(aggregation: str, norm_tokens: int | None) -> None:
    if aggregation in NORMED_AGGREGATIONS and (
        not isinstance(norm_tokens, int) or isinstance(norm_tokens, bool) or norm_tokens < 1
    ):
        raise ValueError(f"rl.loss_aggregation={aggregation!r} needs rl.loss_norm_tokens, a "
                         f"positive integer (e.g. the rollout's max_new_tokens); got "
                         f"{norm_tokens!r}")  # fmt: skip


def aggregator(aggregation: str, norm_tokens: int | None = None
               ) -> Callable[[jax.Array, jax.Array], jax.Array]:  # fmt: skip
    """`fn(loss_BxT, mask_BxT) -> scalar` of `aggregation`, with its constant bound."""
    fn = _lookup(LOSS_AGGREGATIONS, "loss_aggregation", aggregation)
    _check_norm_tokens(aggregation, norm_tokens)
    if aggregation in NORMED_AGGREGATIONS:
        return functools.partial(fn, norm_tokens=norm_tokens)
    return fn


def token_weights(aggregation: str, lengths: Sequence[int],
                  norm_tokens: int | None = None) -> np.ndarray:  # fmt: skip
    """Per-token weights w_b of each sequence such that `aggregate(x) == sum_b,t w_b * x_bt`.

    Host-side (numpy) and computed over a whole mini-batch, so any split of its sequences
    into micro-batches, padded or packed, sums to exactly the mini-batch's aggregate: each
    micro-batch contributes `sum(w * x)` over its own tokens. Sequences with no token get 0.

    Args:
      aggregation: a key of `LOSS_AGGREGATIONS`.
      lengths: real token count of every sequence in the mini-batch.
      norm_tokens: the constant of the `NORMED_AGGREGATIONS` (unused by the others).

    Returns:
      float64 [len(lengths)], the weight of each of that sequence's tokens.
    """
    _lookup(LOSS_AGGREGATIONS, "loss_aggregation", aggregation)
    _check_norm_tokens(aggregation, norm_tokens)
    lengths = np.asarray(lengths, np.float64)
    has_tokens = lengths > 0
    sequences = max(float(has_tokens.sum()), 1.0)
    if aggregation == "token_mean":
        weights = np.full_like(lengths, 1.0 / max(float(lengths.sum()), 1.0))
    elif aggregation == "seq_mean_token_sum":
        weights = np.full_like(lengths, 1.0 / sequences)
    elif aggregation == "seq_mean_token_sum_norm":
        weights = np.full_like(lengths, 1.0 / (sequences * norm_tokens))
    else:  # seq_mean_token_mean
        weights = 1.0 / (np.maximum(lengths, 1.0) * sequences)
    return np.where(has_tokens, weights, 0.0)


# ---------------------------------------------------------------------------------------------
# KL estimators against a frozen reference: fn(logprobs_BxT, ref_logprobs_BxT) -> kl_BxT.
# Samples come from the current policy, so each one's value estimates KL(policy || reference).
# As a loss term (the samples are data: no score-function term) their gradients differ
# (Tang & Munos 2025, "On a few pitfalls in KL divergence gradient estimation for RL"):
# k2's expected gradient is that of KL(policy || reference); k3's (GRPO's) that of
# KL(reference || policy); k1's is zero, so `AlgorithmConfig` refuses k1 with kl_coef > 0.
# `tests/test_algorithms.py` checks all three against exact gradients on a small vocabulary.
# ---------------------------------------------------------------------------------------------


def kl_k1(logprobs_BxT: jax.Array, ref_logprobs_BxT: jax.Array) -> jax.Array:
    """Unbiased, high-variance, can be negative per token: `logp - ref_logp`."""
    return logprobs_BxT - ref_logprobs_BxT


def kl_k2(logprobs_BxT: jax.Array, ref_logprobs_BxT: jax.Array) -> jax.Array:
    """Biased, low-variance, always >= 0: `(logp - ref_logp)^2 / 2`; as a loss, its expected
    gradient is exactly that of KL(policy || reference)."""
    return 0.5 * jnp.square(logprobs_BxT - ref_logprobs_BxT)


def kl_k3(logprobs_BxT: jax.Array, ref_logprobs_BxT: jax.Array) -> jax.Array:
    """Unbiased, low-variance, always >= 0: `exp(ref - logp) - (ref - logp) - 1`."""
    log_ratio_BxT = ref_logprobs_BxT - logprobs_BxT
    return jnp.exp(log_ratio_BxT) - log_ratio_BxT - 1.0


KL_ESTIMATORS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}


def _lookup(registry: dict, field: str, value: str) -> Callable:
    if value not in registry:
        raise ValueError(f"rl.{field}={value!r} is not one of {sorted(registry)}")
    return registry[value]


# ---------------------------------------------------------------------------------------------
# Policy loss.
# ---------------------------------------------------------------------------------------------


def _clipped_surrogate(logprobs, old_logprobs, advantages, is_token, epsilon: float,
                       epsilon_high: float):  # fmt: skip
    """Per-token (log_ratio, ratio, unclipped, clipped) PPO terms; the loss is
    `max(unclipped, clipped)`. `advantages` broadcasts against the tokens."""
    # Zero the log-ratio on padding so exp() there cannot overflow into NaN gradients.
    log_ratio = jnp.where(is_token, logprobs - jnp.asarray(old_logprobs, jnp.float32), 0.0)
    ratio = jnp.exp(log_ratio)
    unclipped = -ratio * advantages
    clipped = -jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon_high) * advantages
    return log_ratio, ratio, unclipped, clipped


def policy_loss(
    logprobs_BxT: jax.Array,
    old_logprobs_BxT: jax.Array,
    advantages_B: jax.Array,
    mask_BxT: jax.Array,
    *,
    epsilon: float,
    epsilon_high: float,
    aggregation: str,
    ref_logprobs_BxT: jax.Array | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    norm_tokens: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped surrogate with DAPO clip-higher and an optional KL penalty.

    Per token: `ratio = exp(logp - old_logp)` and
    `pg = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)`.
    The loss is `aggregate(pg) + kl_coef * aggregate(kl)` with the same aggregation for both.

    Under `jax.jit`, mark `epsilon`, `epsilon_high`, `aggregation`, `kl_coef` and
    `kl_estimator` static (or close over them): `kl_coef == 0` is decided in Python.

    Args:
      logprobs_BxT: log-probabilities of the sampled tokens under the policy being trained.
      old_logprobs_BxT: the same under the policy that sampled them (no gradient expected).
      advantages_B: one advantage per sequence, broadcast over its tokens.
      mask_BxT: 1 on response tokens that count, 0 on padding.
      epsilon: lower clip range, ratio >= 1 - epsilon.
      epsilon_high: upper clip range, ratio <= 1 + epsilon_high.
      aggregation: a key of `LOSS_AGGREGATIONS`.
      ref_logprobs_BxT: reference-policy log-probabilities; required when kl_coef != 0.
      kl_coef: weight of the KL penalty; 0 turns it off (no KL is computed).
      kl_estimator: a key of `KL_ESTIMATORS`.
      norm_tokens: the constant of the `NORMED_AGGREGATIONS`.

    Returns:
      (loss, metrics). metrics holds scalars: `pg_loss` (aggregated surrogate), `kl`
      (aggregated KL to the reference, 0 when off, so `loss == pg_loss + kl_coef * kl`),
      `clip_fraction` (share of real tokens where the clipped term was selected, i.e. the
      token gets no gradient), `ratio_mean` (token mean of the ratio) and `approx_kl_old`
      (token mean of the k3 estimate of KL(old || new), `(ratio - 1) - log(ratio)`, >= 0).
    """
    aggregate = aggregator(aggregation, norm_tokens)
    use_kl = not (isinstance(kl_coef, int | float) and kl_coef == 0.0)
    kl_fn = _lookup(KL_ESTIMATORS, "kl_estimator", kl_estimator) if use_kl else None
    if use_kl and ref_logprobs_BxT is None:
        raise ValueError(f"{kl_coef=} needs ref_logprobs_BxT; pass it or set kl_coef=0")

    logprobs_BxT = jnp.asarray(logprobs_BxT, jnp.float32)
    log_ratio_BxT, ratio_BxT, unclipped_BxT, clipped_BxT = _clipped_surrogate(
        logprobs_BxT, old_logprobs_BxT, jnp.asarray(advantages_B, jnp.float32)[:, None],
        jnp.asarray(mask_BxT) > 0, epsilon, epsilon_high,
    )  # fmt: skip
    pg_loss = aggregate(jnp.maximum(unclipped_BxT, clipped_BxT), mask_BxT)

    if use_kl:
        kl_BxT = kl_fn(logprobs_BxT, jnp.asarray(ref_logprobs_BxT, jnp.float32))
        kl = aggregate(kl_BxT, mask_BxT)
        loss = pg_loss + kl_coef * kl
    else:
        kl = jnp.zeros((), jnp.float32)
        loss = pg_loss

    metrics = {
        "pg_loss": pg_loss,
        "kl": kl,
        "clip_fraction": token_mean((clipped_BxT > unclipped_BxT).astype(jnp.float32), mask_BxT),
        "ratio_mean": token_mean(ratio_BxT, mask_BxT),
        "approx_kl_old": token_mean((ratio_BxT - 1.0) - log_ratio_BxT, mask_BxT),
    }
    metrics = jax.tree.map(jax.lax.stop_gradient, metrics)
    return loss, metrics


def weighted_policy_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    loss_weights: jax.Array,
    metric_weights: jax.Array,
    *,
    epsilon: float,
    epsilon_high: float,
    ref_logprobs: jax.Array | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`policy_loss` with the aggregation given as per-token weights (any token layout).

    Every argument is per token, in the same (any) shape: padded [B, T] rows or packed rows
    holding several sequences. With `loss_weights` from `token_weights` over a mini-batch and
    `metric_weights` = 1 / (the mini-batch's real tokens), summing this function's outputs
    over the micro-batches of that mini-batch gives `policy_loss` of the whole mini-batch for
    `loss`, `pg_loss` and `kl`; the token-mean metrics (`clip_fraction`, `ratio_mean`,
    `approx_kl_old`) come out multiplied by `weight`, the sum of `metric_weights` (1 over a
    whole mini-batch), so they are divided by the summed `weight` at the end.

    Padding carries weight 0 in both weight arrays and never reaches a value (its log-ratio
    is zeroed before `exp`).

    Returns:
      (loss, metrics) with `pg_loss`, `kl`, `clip_fraction`, `ratio_mean`, `approx_kl_old`
      (weighted sums as above) and `weight`.
    """
    use_kl = not (isinstance(kl_coef, int | float) and kl_coef == 0.0)
    kl_fn = _lookup(KL_ESTIMATORS, "kl_estimator", kl_estimator) if use_kl else None
    if use_kl and ref_logprobs is None:
        raise ValueError(f"{kl_coef=} needs ref_logprobs; pass it or set kl_coef=0")
    w = jnp.asarray(loss_weights, jnp.float32)
    u = jnp.asarray(metric_weights, jnp.float32)
    counts = (w > 0) | (u > 0)
    logprobs = jnp.asarray(logprobs, jnp.float32)
    log_ratio, ratio, unclipped, clipped = _clipped_surrogate(
        logprobs, old_logprobs, jnp.asarray(advantages, jnp.float32), counts, epsilon,
        epsilon_high,
    )  # fmt: skip

    def weighted(values, weights):
        return jnp.sum(jnp.where(counts, values, 0.0) * weights)

    pg_loss = weighted(jnp.maximum(unclipped, clipped), w)
    if use_kl:
        safe_ref = jnp.where(counts, jnp.asarray(ref_logprobs, jnp.float32), logprobs)
        kl = weighted(kl_fn(logprobs, safe_ref), w)
        loss = pg_loss + kl_coef * kl
    else:
        kl = jnp.zeros((), jnp.float32)
        loss = pg_loss
    metrics = {
        "pg_loss": pg_loss,
        "kl": kl,
        "clip_fraction": weighted((clipped > unclipped).astype(jnp.float32), u),
        "ratio_mean": weighted(ratio, u),
        "approx_kl_old": weighted((ratio - 1.0) - log_ratio, u),
        "weight": jnp.sum(jnp.where(counts, u, 0.0)),
    }
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


# ---------------------------------------------------------------------------------------------
# Logit helpers.
# ---------------------------------------------------------------------------------------------


def token_logprobs(
    logits_BxTxV: jax.Array, tokens_BxT: jax.Array, temperature: float = 1.0
) -> jax.Array:
    """Log-probabilities of `tokens_BxT` under `softmax(logits / temperature)`, in float32.

    Args:
      logits_BxTxV: logits at each position, already aligned with the tokens they predict.
      tokens_BxT: token ids, int.
      temperature: the sampling temperature, so the logprobs match what the sampler drew from.

    Returns:
      logprobs_BxT, float32.
    """
    logprobs_BxTxV = jax.nn.log_softmax(jnp.asarray(logits_BxTxV, jnp.float32) / temperature)
    return jnp.take_along_axis(logprobs_BxTxV, tokens_BxT[..., None].astype(jnp.int32), -1)[..., 0]


def entropy_from_logits(logits_BxTxV: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """Token-mean entropy (nats) of `softmax(logits)` over the real tokens.

    Computed from `log_softmax` in float32; probability-0 entries (logit -inf) count as 0.

    Args:
      logits_BxTxV: logits.
      mask_BxT: 1 on tokens that count, 0 on padding.

    Returns:
      scalar mean entropy.
    """
    return token_mean(token_entropy(logits_BxTxV), mask_BxT)


def token_entropy(logits_BxTxV: jax.Array) -> jax.Array:
    """Entropy (nats) of `softmax(logits)` at every position, float32 [B, T].

    Computed from `log_softmax`; probability-0 entries (logit -inf) count as 0.
    """
    logprobs_BxTxV = jax.nn.log_softmax(jnp.asarray(logits_BxTxV, jnp.float32))
    probs_BxTxV = jnp.exp(logprobs_BxTxV)
    # 0 * log 0 = 0; substitute before multiplying so the gradient stays finite too.
    safe_logprobs_BxTxV = jnp.where(probs_BxTxV > 0, logprobs_BxTxV, 0.0)
    return -jnp.sum(probs_BxTxV * safe_logprobs_BxTxV, axis=-1)


# ---------------------------------------------------------------------------------------------
# Typed config and dispatch.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AlgorithmConfig:
    """The `rl` config group: which estimator/aggregation/KL to use and their constants.

    Attributes:
      advantage_estimator: key of `ADVANTAGE_ESTIMATORS`.
      loss_aggregation: key of `LOSS_AGGREGATIONS`.
      epsilon: lower clip range (ratio >= 1 - epsilon).
      epsilon_high: upper clip range (ratio <= 1 + epsilon_high); None means `epsilon`.
        DAPO's clip-higher uses e.g. 0.28 with epsilon 0.2.
      kl_coef: weight of the KL penalty to the reference; 0 disables it.
      kl_estimator: key of `KL_ESTIMATORS` (k1 only with kl_coef 0: see the KL section).
      advantage_eps: added to the group std by `grpo`.
      loss_norm_tokens: the constant `seq_mean_token_sum_norm` divides each sequence's token
        sum by (Dr. GRPO's generation budget); `TrainConfig` sets it to the rollout's
        `max_new_tokens` when left None.
    """

    advantage_estimator: str = "grpo"
    loss_aggregation: str = "token_mean"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    advantage_eps: float = 1e-6
    loss_norm_tokens: int | None = None

    def __post_init__(self):
        _lookup(ADVANTAGE_ESTIMATORS, "advantage_estimator", self.advantage_estimator)
        _lookup(LOSS_AGGREGATIONS, "loss_aggregation", self.loss_aggregation)
        _lookup(KL_ESTIMATORS, "kl_estimator", self.kl_estimator)
        if self.epsilon_high is None:
            object.__setattr__(self, "epsilon_high", self.epsilon)
        for field in ("epsilon", "epsilon_high", "kl_coef", "advantage_eps"):
            value = getattr(self, field)
            if (not isinstance(value, int | float) or isinstance(value, bool)
                    or not math.isfinite(value) or value < 0):  # fmt: skip
                raise ValueError(f"rl.{field}={value!r} must be a finite number >= 0")
        norm = self.loss_norm_tokens
        if norm is not None and (not isinstance(norm, int) or isinstance(norm, bool) or norm < 1):
            raise ValueError(f"rl.loss_norm_tokens={norm!r} must be a positive integer (the "
                             f"budget {NORMED_AGGREGATIONS[0]!r} divides by) or None")  # fmt: skip
        if self.epsilon >= 1.0:
            raise ValueError(f"rl.epsilon={self.epsilon!r} must be < 1 (ratio floor 1 - epsilon)")
        if self.kl_estimator == "k1" and self.kl_coef > 0:
            raise ValueError(
                f"rl.kl_estimator='k1' with rl.kl_coef={self.kl_coef!r}: k1 as a loss term has "
                "zero expected gradient on the policy's own samples, so the penalty would pull "
                "nowhere; use 'k2' (the gradient of KL(policy || reference)) or 'k3' (GRPO's)"
            )


def compute_advantages(config: AlgorithmConfig, rewards_PxG: jax.Array) -> jax.Array:
    """Advantages with the estimator named by `config.advantage_estimator`.

    Args:
      config: the algorithm config.
      rewards_PxG: scalar reward per completion, grouped by prompt.

    Returns:
      advantages_PxG, float32. Reshape to B (row-major) for `compute_loss`.
    """
    estimator = ADVANTAGE_ESTIMATORS[config.advantage_estimator]
    return estimator(rewards_PxG, eps=config.advantage_eps)


def compute_loss(
    config: AlgorithmConfig,
    logprobs_BxT: jax.Array,
    old_logprobs_BxT: jax.Array,
    advantages_B: jax.Array,
    mask_BxT: jax.Array,
    ref_logprobs_BxT: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`policy_loss` with every hyper-parameter taken from `config`.

    The config is a frozen, hashable dataclass, so it can be a static argument under jit.

    Returns:
      (loss, metrics), as `policy_loss`.
    """
    return policy_loss(
        logprobs_BxT,
        old_logprobs_BxT,
        advantages_B,
        mask_BxT,
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_high,
        aggregation=config.loss_aggregation,
        ref_logprobs_BxT=ref_logprobs_BxT,
        kl_coef=config.kl_coef,
        kl_estimator=config.kl_estimator,
        norm_tokens=config.loss_norm_tokens,
    )
