"""Sampling parameters and the token-choice math shared by plain and speculative decoding.

Dimension legend: B batch, V vocab.

Reported logprobs are `log_softmax(logits / temperature)` at the emitted token (temperature 1
for greedy rows), i.e. the policy's own distribution before top-k / top-p truncation: that is
what the RL trainer recomputes, so old and new logprobs compare like for like.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy; top_k 0 and top_p 1 disable them."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0 disables it)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_logits(
    logits_BxV: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array
) -> jax.Array:
    """logits / temperature with tokens outside top-k and the top-p nucleus set to -inf.

    Ties at a threshold keep every tied token (a superset of at most a few tokens).
    """
    temperature = jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None]
    scaled = logits_BxV.astype(jnp.float32) / temperature
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
    # Number of tokens needed to reach top_p mass (at least one).
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    n_keep = jnp.maximum(jnp.sum(mass_before < top_p_B[:, None], axis=-1), 1)
    pth = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)
    keep = (scaled >= kth) & (scaled >= pth)
    return jnp.where(keep, scaled, -jnp.inf)


def choose_tokens(
    logits_BxV: jax.Array,
    temperature_B: jax.Array,
    top_k_B: jax.Array,
    top_p_B: jax.Array,
    keys_B: jax.Array,
    *,
    greedy_only: bool,
) -> tuple[jax.Array, jax.Array]:
    """Next token per row and its logprob.

    Args:
      logits_BxV: float32 logits.
      temperature_B / top_k_B / top_p_B: per-row sampling parameters.
      keys_B: one typed PRNG key per row (ignored by greedy rows).
      greedy_only: static; skips the sort when every row is greedy.

    Returns:
      (tokens_B int32, logprobs_B float32).
    """
    logits_BxV = logits_BxV.astype(jnp.float32)
    argmax_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    if greedy_only:
        tokens_B = argmax_B
        logprobs_BxV = jax.nn.log_softmax(logits_BxV, axis=-1)
    else:
        masked = filtered_logits(logits_BxV, temperature_B, top_k_B, top_p_B)
        sampled_B = jax.vmap(jax.random.categorical)(keys_B, masked).astype(jnp.int32)
        tokens_B = jnp.where(temperature_B > 0, sampled_B, argmax_B)
        temperature = jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None]
        logprobs_BxV = jax.nn.log_softmax(logits_BxV / temperature, axis=-1)
    logprobs_B = jnp.take_along_axis(logprobs_BxV, tokens_B[:, None], axis=-1)[:, 0]
    return tokens_B, logprobs_B
