"""The RL step's device programs: log-prob recompute, gradient accumulation, optimizer update.

Dimension legend (as in `algorithms.py`): P prompts in a micro-batch, G group size,
B = P * G sequences, S padded prompt length, T padded response length, R packed rows,
L packed row length, D model, V vocab.

Two token layouts, one loss (`rl.update_layout`):
- **padded** (`SequenceBatch`): a micro-batch holds whole groups. The prompt runs once
  (`[P, S]`), its keys/values are repeated G times as the KV cache of the response forward
  (`[B, T]`, positions continuing after each prompt). Every response pads to the micro-batch's
  longest, so one long-tail straggler makes its micro-batch pay its length on every row.
- **packed** (`PackedBatch`, built by `rl/packing.py`): rows of L tokens hold pieces, each one
  prompt followed by some of its group's responses. A response attends to its piece's prompt
  and causally to itself (`packed_mask`), never to a sibling or another piece, with positions
  continuing after the prompt: the same math as one forward per `prompt + response`, on
  about the real tokens only.
Both are the math of a forward over every `prompt + response` row (parity tests check it);
gradients flow through the prompt keys and values. The log-prob of response token t comes
from the feature before it: the prompt's last feature for t = 0, the response's t - 1 after.

The loss is per token in whichever layout (`algorithms.weighted_policy_loss`): the host gives
each token its aggregation weight over the whole mini-batch (`algorithms.token_weights`), so
micro-batch losses sum to the mini-batch loss exactly, however the tokens were split.

Programs are pure and compiled ahead of time per padded shape (`ProgramPool`):
- `logprob_program(params, batch) -> (logprobs, features)` (per-token log-probs in the
  batch's layout, zero off responses; the final-norm features for the drafter's buffer).
- `grad_program(params, accum, batch, inputs, ...) -> accum` adds one micro-batch's weighted
  loss gradient into the accumulator (donated); `on_policy` (a step of one mini-batch, the
  default) takes the old log-probs as the current ones without gradient, so the step needs
  no log-prob recompute; `features` also returns the forward's final-norm features.
- `apply_program(state, accum) -> (state, metrics)` takes one AdamW step (state and
  accumulator donated), or keeps the state unchanged when the loss or gradient is not finite.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from tlt_jax.models.transformer import KVCache, NewKV, PackedMask, RowPrefix
from tlt_jax.optim import OptimConfig
from tlt_jax.programs import abstract_like
from tlt_jax.rl import algorithms
from tlt_jax.rl.config import RLConfig

# Weighted sums kept in the gradient accumulator besides the gradients themselves.
ACCUMULATED_METRICS = (
    "loss", "pg_loss", "kl", "entropy", "clip_fraction", "ratio_mean", "approx_kl_old",
    "engine_gap", "weight",
)  # fmt: skip


@struct.dataclass
class TrainState:
    """Everything the policy update owns; checkpointed whole."""

    params: nnx.State  # the policy's parameters (train shardings)
    opt_state: Any  # optax state over `params`
    step: jax.Array  # int32 scalar, RL steps completed
    rng: jax.Array  # uint32 [2], raw key data of the run's base key (rollout seeds derive from it)


@struct.dataclass
class SequenceBatch:
    """One micro-batch of whole groups (host numpy until a program receives it)."""

    prompt_tokens_PxS: Any  # int32, right-padded prompts
    prompt_lens_P: Any  # int32, real prompt lengths
    response_tokens_BxT: Any  # int32, right-padded responses; row b answers prompt b // G
    response_mask_BxT: Any  # bool, real response tokens


@struct.dataclass
class PackedBatch:
    """One packed micro-batch: R rows of L positions (host numpy until a program gets it).

    A row's first piece may continue a group whose prompt is laid out in another row of the
    micro-batch (`packing.pack_rows` with bins): it has no prompt tokens of its own and reads
    that prompt's keys and values through `prefix_RxS` (`transformer.RowPrefix`).
    """

    tokens_RxL: Any  # int32
    positions_RxL: Any  # int32, RoPE positions: 0.. along a prompt, continuing into responses
    piece_RxL: Any  # int32, which piece of its row a position belongs to (-1: padding)
    segment_RxL: Any  # int32, 0 on a piece's prompt, k >= 1 on its k-th response
    predictor_RxL: Any  # int32, column of the feature that predicts this position's token;
    # -1: the last of the row's prefix (a continuing piece's first response token)
    response_mask_RxL: Any  # bool, real response tokens (the ones the loss sees)
    prefix_RxS: Any  # int32, flat position (row * L + column) of each prompt token the row's
    # first piece reads from another row, -1 past it or when it has its own prompt; S = 0
    # when the run shares no prompts across rows (then no prefix is read at all)
    row_shards: int = struct.field(pytree_node=False, default=1)  # the mesh's data shards
    # split the rows into this many contiguous blocks; a prefix never leaves its block


@struct.dataclass
class LossInputs:
    """Per-token inputs of the policy loss, in the layout of the batch's log-probs
    (`[B, T]` padded, `[R, L]` packed); 0 wherever there is no response token."""

    old_logprobs: Any  # float32, log-probs under the policy that sampled (recomputed; unused
    # by an `on_policy` program, which takes the current ones without gradient)
    ref_logprobs: Any  # float32, reference-policy log-probs (zeros when kl_coef == 0)
    advantages: Any  # float32, the token's sequence advantage
    loss_weights: Any  # float32, the token's aggregation weight over its mini-batch
    metric_weights: Any  # float32, 1 / the mini-batch's real tokens (token-mean metrics)
    engine_logprobs: Any = None  # float32, the rollout engine's log-probs of its tokens (the
    # `engine_gap` metric: how far the trainer's forward is from the sampler's); None: no gap


# ----------------------------------------------------------------------------- optimizer


def learning_rate_schedule(config: OptimConfig, total_updates: int) -> optax.Schedule:
    """Linear warm-up, then constant, cosine or linear decay over `total_updates`."""
    return config.schedule_fn(total_updates)


def make_optimizer(config: OptimConfig, total_updates: int) -> optax.GradientTransformation:
    """AdamW (decay on matrices only) after global-norm clipping (`grad_clip` 0 disables it)."""
    return config.optimizer(total_updates)


def init_train_state(params: nnx.State, optimizer: optax.GradientTransformation, seed: int
                     ) -> TrainState:  # fmt: skip
    """A fresh state at step 0 (optimizer state follows the params' shardings)."""
    return TrainState(
        params=params,
        opt_state=optimizer.init(params),
        step=jnp.zeros((), jnp.int32),
        rng=jax.random.key_data(jax.random.key(seed)).astype(jnp.uint32),
    )


# ----------------------------------------------------------------------------- forward


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    """How the train programs' forward spends memory (static: part of a program's key).

    Attributes:
      remat: recompute each layer in the backward pass (keep only the layers' inputs).
      attention_chunk: queries per attention block (0: all at once; `attention`).
      logits_chunk: positions per LM-head block (0: all; the [rows, len, V] float32 logits,
        152k vocab x 17k positions is 10.6 GB a row, are then never all live).
    """

    remat: bool = False
    attention_chunk: int = 0
    logits_chunk: int = 0

    @classmethod
    def of(cls, rl: RLConfig, num_layers: int, platform: str | None = None) -> ForwardOptions:
        """The options of `rl` for a policy of `num_layers` layers on `platform` (default: the
        default backend); `rl.remat=None` and `rl.logits_chunk=None` resolve per backend
        (`default_remat`, `default_logits_chunk`)."""
        platform = platform or jax.default_backend()
        remat = default_remat(num_layers, platform) if rl.remat is None else rl.remat
        chunk = default_logits_chunk(platform) if rl.logits_chunk is None else rl.logits_chunk
        return cls(remat, rl.attention_chunk, chunk)

    def model_kwargs(self) -> dict:
        return {"remat": self.remat, "query_chunk": self.attention_chunk}


# Policies this deep recompute their layers in the backward pass by default on CPU.
REMAT_MIN_LAYERS = 8


def default_remat(num_layers: int, platform: str) -> bool:
    """Whether the train programs recompute each layer in the backward pass when `rl.remat`
    is unset: on CPU for policies of >= `REMAT_MIN_LAYERS` layers, elsewhere not.

    On XLA:CPU the price of storing every layer's activations is not memory but time: each
    execution allocates its temporaries afresh (glibc maps big blocks anew and returns them on
    free), and the kernel zeroes every page on first touch. SmolLM2's gradient program of a
    13 x 320 packed micro-batch keeps 13.7 GB of temporaries and ran 55 s, about half of its
    CPU time (55 of ~110 CPU-seconds on 2 cores) in the kernel; with remat it keeps 4.0 GB
    and took 27-32 s, a third more flops included (BENCHMARKS.md, "The update on CPU").
    Accelerators keep their memory pooled, so there remat is only the memory-for-flops trade
    a config chooses (the big presets set it).
    """
    return platform == "cpu" and num_layers >= REMAT_MIN_LAYERS


# Positions along a row per LM-head block of the train programs on CPU when unset.
CPU_LOGITS_CHUNK = 32


def default_logits_chunk(platform: str) -> int:
    """`rl.logits_chunk` when unset: `CPU_LOGITS_CHUNK` on CPU, else 0 (the head at once).

    On XLA:CPU the head's float32 [positions, vocab] logits, their softmax and its backward
    are memory-bound passes over hundreds of MB (SmolLM2's 13 x 320 micro-batch: 818 MB of
    logits); a block of every row's 32 positions (416 at 13 rows) keeps them in cache. The
    gradient program then ran 1.14x faster at 13 rows, 1.02x at 2 and 1.08x at 1
    (BENCHMARKS.md, "The LM head a block at a time"). Accelerators keep the one product.
    """
    return CPU_LOGITS_CHUNK if platform == "cpu" else 0


def token_stats(model, predicting_BxTxD: jax.Array, tokens_BxT: jax.Array, temperature: float,
                *, chunk: int = 0, entropy: bool = False):  # fmt: skip
    """(log-probs [B, T], entropy [B, T] or None) of `tokens_BxT` under the LM head applied to
    the features predicting them, `gcd(T, chunk)` positions at a time when `chunk` (each block
    rematerialized in the backward pass). Entropy is of the sampling distribution (logits /
    temperature), a metric: no gradient."""

    def stats(features, tokens):
        logits = model.logits(features)
        logprobs = algorithms.token_logprobs(logits, tokens, temperature)
        if not entropy:
            return logprobs, None
        return logprobs, algorithms.token_entropy(jax.lax.stop_gradient(logits) / temperature)

    b, t = tokens_BxT.shape
    c = math.gcd(t, chunk) if chunk else t
    if c >= t:
        return stats(predicting_BxTxD, tokens_BxT)

    def blocks(x):  # [B, T, ...] -> [T / c, B, c, ...]
        return jnp.swapaxes(x.reshape(b, t // c, c, *x.shape[2:]), 0, 1)

    out = jax.lax.map(jax.checkpoint(lambda xs: stats(*xs)),
                      (blocks(predicting_BxTxD), blocks(tokens_BxT)))  # fmt: skip
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape(b, t), out)


def sequence_forward(model, batch: SequenceBatch, temperature: float,
                     options: ForwardOptions = ForwardOptions(),
                     entropy: bool = False):  # fmt: skip
    """Log-probs of every response token and the final-norm features, prompts shared.

    Args:
      model: the policy (`Transformer`).
      batch: one micro-batch of whole groups.
      temperature: the sampling temperature (log-probs of `softmax(logits / temperature)`).
      options: remat and chunking of the forward.
      entropy: also return the sampling distribution's entropy per token.

    Returns:
      (logprobs_BxT float32, entropy_BxT float32 or None, prompt_features_PxSxD,
      features_BxTxD).
    """
    p, s = batch.prompt_tokens_PxS.shape
    b, t = batch.response_tokens_BxT.shape
    group = b // p
    kwargs = options.model_kwargs()
    prompt_positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (p, s))
    prompt_features, prompt_kv = model(batch.prompt_tokens_PxS, prompt_positions, **kwargs)
    prompt_lens_B = jnp.repeat(batch.prompt_lens_P, group)
    cache = KVCache.from_new(NewKV(k=jnp.repeat(prompt_kv.k, group, axis=1),
                                   v=jnp.repeat(prompt_kv.v, group, axis=1)))  # fmt: skip
    positions = prompt_lens_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    features, _ = model(batch.response_tokens_BxT, positions, cache=cache,
                        cache_lens_B=prompt_lens_B, **kwargs)  # fmt: skip
    last_prompt = jnp.take_along_axis(
        prompt_features, (batch.prompt_lens_P - 1)[:, None, None], axis=1
    )  # [P, 1, D]
    predicting = jnp.concatenate(
        [jnp.repeat(last_prompt, group, axis=0), features[:, :-1]], axis=1
    )  # feature before each response token
    logprobs, entropies = token_stats(model, predicting, batch.response_tokens_BxT, temperature,
                                      chunk=options.logits_chunk, entropy=entropy)  # fmt: skip
    return logprobs, entropies, prompt_features, features


def packed_mask(piece_RxL: jax.Array, segment_RxL: jax.Array) -> jax.Array:
    """[R, L, L] attention mask of packed rows (`PackedMask`, built whole)."""
    return PackedMask(piece_RxL, segment_RxL).rows(0, piece_RxL.shape[1])


def row_prefix(batch: PackedBatch) -> RowPrefix | None:
    """The `RowPrefix` of a packed batch (None when it has no prefix columns): a row's first
    piece (piece 0) attends to the prompt positions `prefix_RxS` names."""
    prefix = batch.prefix_RxS
    if prefix.shape[1] == 0:
        return None
    rows, cols = batch.piece_RxL.shape
    per_shard = rows // batch.row_shards
    shard_start = (jnp.arange(rows) // per_shard * per_shard * cols)[:, None]
    mask = (batch.piece_RxL == 0)[:, :, None] & (prefix >= 0)[:, None, :]
    return RowPrefix(jnp.maximum(prefix - shard_start, 0), mask, batch.row_shards)


def packed_forward(model, batch: PackedBatch, temperature: float,
                   options: ForwardOptions = ForwardOptions(), entropy: bool = False):  # fmt: skip
    """Log-probs of every packed position's token and the final-norm features.

    Returns:
      (logprobs_RxL float32, entropy_RxL float32 or None, features_RxLxD). Only positions in
      `response_mask_RxL` are meaningful in the first two.
    """
    mask = PackedMask(batch.piece_RxL, batch.segment_RxL)
    if not options.attention_chunk:
        mask = mask.rows(0, batch.piece_RxL.shape[1])
    prefix = row_prefix(batch)
    features, _ = model(batch.tokens_RxL, batch.positions_RxL, mask_BxTxT=mask, prefix=prefix,
                        **options.model_kwargs())  # fmt: skip
    predictor = batch.predictor_RxL
    predicting = jnp.take_along_axis(features, jnp.maximum(predictor, 0)[..., None], axis=1)
    if prefix is not None:  # a continuing piece's first token: the prompt's last feature
        last = prefix.gather(features, jnp.max(prefix.index_BxS, axis=1, keepdims=True))
        predicting = jnp.where((predictor < 0)[..., None], last, predicting)
    logprobs, entropies = token_stats(model, predicting, batch.tokens_RxL, temperature,
                                      chunk=options.logits_chunk, entropy=entropy)  # fmt: skip
    return logprobs, entropies, features


def response_mask(batch: SequenceBatch | PackedBatch):
    """The real response tokens of either layout (the shape of its log-probs)."""
    if isinstance(batch, PackedBatch):
        return batch.response_mask_RxL
    return batch.response_mask_BxT


def _forward(model, batch: SequenceBatch | PackedBatch, temperature: float,
             options: ForwardOptions, entropy: bool = False):  # fmt: skip
    """(logprobs, entropy or None, features) of either layout; features are `(prompt,
    response)` arrays for a padded batch and one `[R, L, D]` array for a packed one."""
    if isinstance(batch, PackedBatch):
        return packed_forward(model, batch, temperature, options, entropy)
    logprobs, entropies, prompt_features, features = sequence_forward(
        model, batch, temperature, options, entropy)  # fmt: skip
    return logprobs, entropies, (prompt_features, features)


def logprob_program(graphdef, params, batch: SequenceBatch | PackedBatch, *,
                    temperature: float, options: ForwardOptions = ForwardOptions()):  # fmt: skip
    """(logprobs, features) of one micro-batch, no gradient; log-probs 0 off responses."""
    model = nnx.merge(graphdef, params)
    logprobs, _, features = _forward(model, batch, temperature, options)
    return jnp.where(response_mask(batch), logprobs, 0.0), features


def _micro_batch_loss(params, graphdef, batch, inputs: LossInputs, *,
                      algorithm: algorithms.AlgorithmConfig, temperature: float,
                      options: ForwardOptions, on_policy: bool):  # fmt: skip
    model = nnx.merge(graphdef, params)
    logprobs, entropy, features = _forward(model, batch, temperature, options, entropy=True)
    mask = response_mask(batch)
    # Weights are 0 off responses already; the mask also guards against a host mistake.
    loss_weights = jnp.where(mask, inputs.loss_weights, 0.0)
    metric_weights = jnp.where(mask, inputs.metric_weights, 0.0)
    current = jax.lax.stop_gradient(logprobs)
    # On-policy, the policy that sampled is the one being differentiated: its log-probs are
    # these, so the ratio is exactly 1 (a recompute would give 1 up to float rounding).
    old_logprobs = current if on_policy else inputs.old_logprobs
    loss, metrics = algorithms.weighted_policy_loss(
        logprobs, old_logprobs, inputs.advantages, loss_weights, metric_weights,
        epsilon=algorithm.epsilon, epsilon_high=algorithm.epsilon_high,
        ref_logprobs=inputs.ref_logprobs if algorithm.kl_coef else None,
        kl_coef=algorithm.kl_coef, kl_estimator=algorithm.kl_estimator,
    )  # fmt: skip
    gap = jnp.zeros((), jnp.float32)
    if inputs.engine_logprobs is not None:
        gap = jnp.sum(jnp.where(mask, jnp.abs(inputs.engine_logprobs - current), 0.0)
                      * metric_weights)  # fmt: skip
    metrics = dict(metrics, entropy=jnp.sum(jnp.where(mask, entropy, 0.0) * metric_weights),
                   loss=jax.lax.stop_gradient(loss), engine_gap=gap)  # fmt: skip
    return loss, (metrics, jax.lax.stop_gradient(features))


def grad_program(graphdef, params, accum: dict, batch, inputs: LossInputs, *,
                 algorithm: algorithms.AlgorithmConfig, temperature: float,
                 options: ForwardOptions = ForwardOptions(), on_policy: bool = False,
                 features: bool = False):  # fmt: skip
    """Adds one micro-batch's weighted loss gradient (and weighted metrics) into `accum`.

    `on_policy`: `params` are the weights that sampled the batch (a step's only mini-batch),
    so the importance ratio is computed against the current log-probs without gradient
    instead of `inputs.old_logprobs`, and no log-prob recompute is needed before the update.

    Returns:
      the new accumulator; with `features`, `(accumulator, features)`: the forward's
      final-norm features as `logprob_program` returns them (the drafter's training data,
      so a step that feeds a drafter needs no forward of its own for them).
    """
    grad_fn = jax.grad(_micro_batch_loss, has_aux=True)
    grads, (metrics, hidden) = grad_fn(params, graphdef, batch, inputs, algorithm=algorithm,
                                       temperature=temperature, options=options,
                                       on_policy=on_policy)  # fmt: skip
    out = {"grads": jax.tree.map(lambda a, g: a + g.astype(a.dtype), accum["grads"], grads)}
    for name in ACCUMULATED_METRICS:
        out[name] = accum[name] + metrics[name]
    return (out, hidden) if features else out


def accumulator_dtype(dtype) -> jnp.dtype:
    """The dtype gradients of `dtype` parameters are summed in: at least float32.

    Summing micro-batch gradients in bfloat16 (the big presets' parameter dtype) rounds each
    partial sum to 8 significant bits, so the update would depend on how the batch is split
    into micro-batches; in float32 it does not, to float32 rounding. The sum is cast back to
    the parameters' dtype for the optimizer, so the optimizer state keeps its dtype.
    """
    return jnp.promote_types(dtype, jnp.float32)


def zero_accumulator(params) -> dict:
    """A gradient accumulator of zeros shaped (and sharded) like `params`, in
    `accumulator_dtype`."""
    out = {"grads": jax.tree.map(lambda p: jnp.zeros_like(p, accumulator_dtype(p.dtype)), params)}
    out.update({name: jnp.zeros((), jnp.float32) for name in ACCUMULATED_METRICS})
    return out


def apply_program(state: TrainState, accum: dict, *, optimizer: optax.GradientTransformation,
                  schedule: optax.Schedule):  # fmt: skip
    """One optimizer update from the accumulated gradient; a non-finite loss skips it.

    Returns:
      (state, metrics) with `grad_norm`, `learning_rate` and `skipped` (1.0 when the loss, the
      gradient norm or the updated parameters were not finite, and the parameters and optimizer
      state were kept).
    """
    grad_norm = optax.global_norm(accum["grads"])
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), accum["grads"], state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # Also checks the result: an overflowing update (or weights that are already broken while
    # every micro-batch was skipped) must not reach the parameters or a checkpoint.
    finite = (jnp.isfinite(grad_norm) & jnp.isfinite(accum["loss"])
              & jnp.isfinite(optax.global_norm(params)))  # fmt: skip

    def keep_if_finite(new, old):
        return jnp.where(finite, new, old)

    params = jax.tree.map(keep_if_finite, params, state.params)
    opt_state = jax.tree.map(keep_if_finite, opt_state, state.opt_state)
    count = _update_count(state.opt_state)
    metrics = {
        "grad_norm": grad_norm,
        "learning_rate": jnp.asarray(schedule(count), jnp.float32),
        "skipped": 1.0 - finite.astype(jnp.float32),
    }
    return state.replace(params=params, opt_state=opt_state), metrics


def _update_count(opt_state) -> jax.Array:
    """The optimizer's update count (the schedule's input) from its state."""
    counts = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]
              if "count" in jax.tree_util.keystr(path)]  # fmt: skip
    return counts[0] if counts else jnp.zeros((), jnp.int32)


# ----------------------------------------------------------------------------- host side


def power_of_two_bucket(length: int, minimum: int, maximum: int) -> int:
    """The smallest `minimum * 2**k` >= length, capped at `maximum` (itself a bucket)."""
    bucket = minimum
    while bucket < length:
        bucket *= 2
    return min(bucket, max(maximum, length))


def build_sequence_batch(prompts: list[tuple[int, ...]], responses: list[list[int]],
                         group_size: int, *, min_bucket: int, max_prompt: int,
                         max_response: int) -> SequenceBatch:  # fmt: skip
    """Pads one micro-batch (P prompts, P * G responses) to power-of-two length buckets."""
    s = power_of_two_bucket(max(len(x) for x in prompts), min_bucket, max_prompt)
    t = power_of_two_bucket(max(max(len(r) for r in responses), 1), min_bucket, max_response)
    prompt_tokens = np.zeros((len(prompts), s), np.int32)
    for i, prompt in enumerate(prompts):
        prompt_tokens[i, : len(prompt)] = prompt
    response_tokens = np.zeros((len(responses), t), np.int32)
    response_mask = np.zeros((len(responses), t), bool)
    for i, response in enumerate(responses):
        response_tokens[i, : len(response)] = response
        response_mask[i, : len(response)] = True
    if len(responses) != len(prompts) * group_size:
        raise ValueError(f"{len(responses)=} != {len(prompts)=} * {group_size=}")
    lens = np.asarray([len(x) for x in prompts], np.int32)
    return SequenceBatch(prompt_tokens, lens, response_tokens, response_mask)


# Accumulated metrics that are mini-batch values already (weighted sums); the others are
# token means, divided by the accumulated `weight` (the trained share of the tokens).
SUMMED_METRICS = ("loss", "pg_loss", "kl")


def combine_minibatch_metrics(minibatches: Sequence[tuple[dict, dict]]) -> dict[str, float]:
    """The step's metrics from each mini-batch's (accumulated sums, optimizer metrics).

    `loss`, `pg_loss` and `kl` are mini-batch values (zero-advantage micro-batches, skipped,
    contribute exactly 0): their mean over the mini-batches. The token-mean metrics are means
    over the step's trained tokens: every mini-batch's weighted sums over the sum of their
    weights (`weight`, each mini-batch's trained share of its tokens), so a mini-batch that
    trained nothing counts for nothing (it used to count as a 0, halving the step's entropy
    with one such mini-batch of two), and NaN when the step trained no token (not 0: an
    entropy of 0 reads as a collapse). `skipped` is 1 if any update was; the optimizer's
    other metrics are means over the mini-batches.
    """
    n = len(minibatches)
    totals: dict[str, float] = {}
    token_sums: dict[str, float] = {}
    weight = 0.0
    for sums, applied in minibatches:
        sums = {k: float(v) for k, v in sums.items()}
        weight += sums.pop("weight")
        for k, v in sums.items():
            if k in SUMMED_METRICS:
                totals[k] = totals.get(k, 0.0) + v / n
            else:
                token_sums[k] = token_sums.get(k, 0.0) + v
        for k, v in applied.items():
            if k == "skipped":
                totals[k] = max(totals.get(k, 0.0), float(v))
            else:
                totals[k] = totals.get(k, 0.0) + float(v) / n
    for k, v in token_sums.items():
        totals[k] = v / weight if weight > 0 else float("nan")
    return totals


def logprob_gap(recomputed: list[np.ndarray], engine: list[list[float]]) -> tuple[float, int]:
    """(sum of |engine log-prob - recomputed log-prob|, response tokens) over responses: a
    step's gap is the sum over its micro-batches over their token count (a token mean; the
    mean of micro-batch means weighted a 5-token micro-batch like a 500-token one)."""
    gaps = [np.abs(np.asarray(e, np.float64) - r[: len(e)]) for r, e in
            zip(recomputed, engine, strict=True) if len(e)]  # fmt: skip
    return (float(np.sum(np.concatenate(gaps))), sum(map(len, gaps))) if gaps else (0.0, 0)


def plan_micro_batches(has_signal: np.ndarray, group_size: int, micro_batch_size: int,
                       num_minibatches: int, group_lengths: np.ndarray | None = None
                       ) -> list[list[list[int]]]:  # fmt: skip
    """Group (prompt) indices per micro-batch per mini-batch.

    Mini-batches take the groups in order; within one, groups with a non-zero advantage come
    first, so the micro-batches whose groups all have zero advantage (exactly zero policy
    gradient) are the last ones and can be skipped. With `group_lengths` (each group's longest
    response), groups of similar length share micro-batches (longest first within each of
    the two classes): every micro-batch is padded to its own longest response, so a long-tail
    straggler's group no longer pads a short one. The loss is a weighted sum over
    micro-batches, so the order changes no value.
    """
    p = len(has_signal)
    per_micro = micro_batch_size // group_size
    per_mini = p // num_minibatches
    lengths = np.zeros(p) if group_lengths is None else np.asarray(group_lengths)
    out = []
    for start in range(0, p, per_mini):
        groups = sorted(range(start, start + per_mini),
                        key=lambda g: (not has_signal[g], -lengths[g]))  # fmt: skip
        out.append([groups[i : i + per_micro] for i in range(0, per_mini, per_micro)])
    return out


def abstract_accumulator(params) -> dict:
    """The accumulator's `ShapeDtypeStruct`s for `params` (for lowering, nothing allocated)."""
    out = {"grads": jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(p.shape, accumulator_dtype(p.dtype), sharding=p.sharding),
        abstract_like(params))}  # fmt: skip
    out.update({name: jax.ShapeDtypeStruct((), jnp.float32) for name in ACCUMULATED_METRICS})
    return out


def partial_program(fn: Callable, graphdef, **static) -> Callable:
    """`fn` with the graphdef and static keyword arguments bound (what the pool jits)."""
    return functools.partial(fn, graphdef, **static)
