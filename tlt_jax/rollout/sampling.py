"""Sampling parameters and the token-choice math shared by plain and speculative decoding.

Dimension legend: B batch, V vocab, C candidates pre-selected per row (`PRESELECT`).

Every reduction over the vocabulary goes through `VocabAxis`, so the same math runs on a whole
row or, inside `shard_map`, on a device's block of it (the logits of a head split over the
mesh's `tensor` axis) with collectives of a few scalars per row instead of gathering the row.

Reported logprobs are `log_softmax(logits / temperature)` at the emitted token (temperature 1
for greedy rows), i.e. the policy's own distribution before top-k / top-p truncation: that is
what the RL trainer recomputes, so old and new logprobs compare like for like.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

# The smallest positive temperature a request may sample at (below it: use 0, greedy).
MIN_TEMPERATURE = 1e-4


TOP_K_MAX = 2**31 - 1  # the engine keeps each slot's top_k as int32


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy; top_k 0 and top_p 1 disable them (a
    top_k of the vocabulary or more keeps every token, as 0 does)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if not 0 <= self.temperature < math.inf:  # also rejects NaN
            raise ValueError(f"temperature={self.temperature} must be finite and >= 0 (0 means "
                             "greedy)")  # fmt: skip
        if 0 < self.temperature < MIN_TEMPERATURE:
            # logits / t past ~1e9 overflow exp() in float32 once XLA fuses the scaling twice
            # (max and x - max round differently): token 0 with +-inf log-probs.
            raise ValueError(f"temperature={self.temperature} is below {MIN_TEMPERATURE}: use 0 "
                             "for greedy decoding")  # fmt: skip
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if (not isinstance(self.top_k, int | np.integer) or isinstance(self.top_k, bool)
                or self.top_k < 0):  # fmt: skip
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0 disables it)")
        # Any top_k >= the vocabulary keeps every token: clamped to what the engine's int32
        # per-slot array holds (2**31 failed there, after the cache program compiled).
        object.__setattr__(self, "top_k", min(int(self.top_k), TOP_K_MAX))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass(frozen=True)
class VocabAxis:
    """Reductions over the vocabulary (the last dimension), whole or split over a mesh axis.

    `name` None: the array holds whole rows and each reduction is the plain `jnp` one (what
    one device computes, bit for bit). Otherwise the caller runs inside `jax.shard_map`,
    manual over the mesh axis `name`, each device holding one contiguous block of the ids
    (device i: [i * V_local, (i + 1) * V_local)), and reductions combine the blocks with
    collectives of a few values per row (`sharding.rowwise(vocab_args=...)`): the [B, V]
    logits are never gathered. Float sums then add in another order than one device's (the
    same values to float32 rounding); maxima, argmaxes, counts and top-k values are exact.
    """

    name: str | None = None

    def size(self, x: jax.Array) -> int:
        """The whole vocabulary's size."""
        return x.shape[-1] * (1 if self.name is None else jax.lax.axis_size(self.name))

    def max(self, x: jax.Array) -> jax.Array:
        m = jnp.max(x, axis=-1)
        return m if self.name is None else jax.lax.pmax(m, self.name)

    def min(self, x: jax.Array) -> jax.Array:
        m = jnp.min(x, axis=-1)
        return m if self.name is None else jax.lax.pmin(m, self.name)

    def sum(self, x: jax.Array, dtype=None) -> jax.Array:
        total = jnp.sum(x, axis=-1, dtype=dtype)
        return total if self.name is None else jax.lax.psum(total, self.name)

    def argmax(self, x: jax.Array) -> jax.Array:
        """int32 index of each row's largest value (the first, on ties, as `jnp.argmax`)."""
        index = jnp.argmax(x, axis=-1).astype(jnp.int32)
        if self.name is None:
            return index
        local_max = jnp.max(x, axis=-1)
        mine = local_max == jax.lax.pmax(local_max, self.name)
        first = jnp.where(mine, index + self._offset(x), jnp.iinfo(jnp.int32).max)
        return jax.lax.pmin(first, self.name)

    def logsumexp(self, x: jax.Array, keepdims: bool = False) -> jax.Array:
        if self.name is None:
            return jax.nn.logsumexp(x, axis=-1, keepdims=keepdims)
        m = jax.lax.stop_gradient(self.max(x))
        m = jnp.where(jnp.isfinite(m), m, 0.0)  # a row of -inf: log(0), as jax.nn.logsumexp
        out = m + jnp.log(self.sum(jnp.exp(x - m[..., None])))
        return out[..., None] if keepdims else out

    def softmax(self, x: jax.Array) -> jax.Array:
        if self.name is None:
            return jax.nn.softmax(x, axis=-1)
        return jnp.exp(x - self.logsumexp(x, keepdims=True))

    def log_softmax_at(self, x: jax.Array, ids: jax.Array) -> jax.Array:
        """log_softmax(x) at the ids [...] of rows [..., V]."""
        if self.name is None:
            logprobs = jax.nn.log_softmax(x, axis=-1)
            return jnp.take_along_axis(logprobs, ids[..., None], axis=-1)[..., 0]
        return self.take(x, ids[..., None])[..., 0] - self.logsumexp(x)

    def take(self, x: jax.Array, ids: jax.Array) -> jax.Array:
        """x at the vocabulary ids [..., K] of rows [..., V] (`jnp.take_along_axis`)."""
        local, inside = self.local(x, ids)
        return self.owned(jnp.take_along_axis(x, local, axis=-1), inside)

    def local(self, x: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """(ids within this device's block of x's vocabulary, clipped into it; whether each
        id is in the block, None when the rows are whole)."""
        if self.name is None:
            return ids, None
        rel = ids - self._offset(x)
        inside = (rel >= 0) & (rel < x.shape[-1])
        return jnp.clip(rel, 0, x.shape[-1] - 1), inside

    def owned(self, values: jax.Array, inside: jax.Array | None) -> jax.Array:
        """Values read at `local` ids, each kept from the device whose block holds its id."""
        if inside is None:
            return values
        return jax.lax.psum(jnp.where(inside, values, jnp.zeros_like(values)), self.name)

    def top_values(self, x: jax.Array, c: int) -> jax.Array:
        """The c largest values of each row, descending (`lax.top_k`'s values)."""
        if self.name is None:
            return jax.lax.top_k(x, c)[0]
        local = jax.lax.top_k(x, min(c, x.shape[-1]))[0]
        gathered = jax.lax.all_gather(local, self.name, axis=x.ndim - 1, tiled=True)
        return jax.lax.top_k(gathered, c)[0]

    def before_and_total(self, totals: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(the sum of `totals` over the blocks before this device's, over all blocks).

        The total is the last block's `before + its own total`, summed in exactly the order
        that block's running sum is: a sum of all blocks in another order can be a float32
        step larger, and an inverse-CDF draw in that gap fell past every token (and was
        clamped onto the last one, whatever its mass).
        """
        if self.name is None:
            return jnp.zeros_like(totals), totals
        every = jax.lax.all_gather(totals, self.name)  # [n, ...]
        shape = (-1,) + (1,) * totals.ndim
        blocks = jnp.arange(every.shape[0])

        def before(block):
            return jnp.sum(jnp.where((blocks < block).reshape(shape), every, 0.0), axis=0)

        last = every.shape[0] - 1
        return before(jax.lax.axis_index(self.name)), before(last) + every[last]

    def _offset(self, x: jax.Array) -> jax.Array:
        return jax.lax.axis_index(self.name) * x.shape[-1]


# Candidates `filtered_logits` takes per row with `lax.top_k` before any threshold search:
# a nucleus or top-k within this many tokens costs one top-k, not a sort of the vocabulary.
PRESELECT = 256


def filtered_logits(
    logits_BxV: jax.Array,
    temperature_B: jax.Array,
    top_k_B: jax.Array,
    top_p_B: jax.Array,
    *,
    preselect: int = PRESELECT,
    filtering: bool = True,
    vocab: VocabAxis = VocabAxis(),
) -> jax.Array:
    """logits / temperature with tokens outside top-k and the top-p nucleus set to -inf.

    Row b keeps the tokens whose scaled logit is >= its threshold: the larger of the k-th
    largest logit (top_k_B[b] > 0) and the smallest logit of the nucleus, the fewest
    highest-probability tokens whose mass reaches top_p_B[b] (top_p_B[b] < 1). Ties at a
    threshold keep every tied token (a superset of at most a few tokens). A row with top_k 0
    (or >= V) and top_p 1 keeps every token; if no row filters, nothing but the scaling runs.

    The thresholds come from the `preselect` largest logits of each row (`lax.top_k`). Only
    when some row's top-k or nucleus reaches past them (a flat distribution) does a bisection
    over the float32 values run, over the whole row; neither path sorts the vocabulary.

    Args:
      logits_BxV: logits, any float dtype (computed in float32).
      temperature_B: per-row temperature; rows <= 0 (greedy) are scaled by 1.
      top_k_B: per-row top-k, 0 disables it.
      top_p_B: per-row top-p in (0, 1], 1 disables it.
      preselect: static; candidates per row for the fast path.
      filtering: static; False when no row filters (top_k 0, top_p 1 everywhere, as an RL
        rollout samples): only the scaling is traced (see `needs_filtering`).
      vocab: how the rows' vocabulary is laid out (`VocabAxis`; whole by default).

    Returns:
      float32 [B, V]: the scaled logits, -inf where filtered out.
    """
    temperature_Bx1 = jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None]
    scaled_BxV = logits_BxV.astype(jnp.float32) / temperature_Bx1
    if not filtering:
        return scaled_BxV
    use_k_B = (top_k_B > 0) & (top_k_B < vocab.size(scaled_BxV))
    use_p_B = top_p_B < 1
    filtering_B = use_k_B | use_p_B

    def truncate(scaled_BxV):
        threshold_B = _thresholds(scaled_BxV, top_k_B, top_p_B, use_k_B, use_p_B, preselect,
                                  vocab)  # fmt: skip
        keep_BxV = (scaled_BxV >= threshold_B[:, None]) | ~filtering_B[:, None]
        return jnp.where(keep_BxV, scaled_BxV, -jnp.inf)

    return jax.lax.cond(jnp.any(filtering_B), truncate, lambda x: x, scaled_BxV)


def _thresholds(scaled_BxV, top_k_B, top_p_B, use_k_B, use_p_B, preselect, vocab: VocabAxis):
    """The smallest kept logit per row (-inf for a row that keeps everything)."""
    c = min(preselect, vocab.size(scaled_BxV))
    top_BxC = vocab.top_values(scaled_BxV, c)  # descending
    log_norm_Bx1 = vocab.logsumexp(scaled_BxV, keepdims=True)
    probs_BxC = jnp.exp(top_BxC - log_norm_Bx1)
    cumulative_BxC = jnp.cumsum(probs_BxC, axis=-1)
    mass_before_BxC = jnp.concatenate([jnp.zeros_like(cumulative_BxC[:, :1]),
                                       cumulative_BxC[:, :-1]], axis=-1)  # fmt: skip
    # Tokens needed to reach top_p (at least one); exact when the top c reach it.
    n_keep_B = jnp.maximum(jnp.sum(mass_before_BxC < top_p_B[:, None], axis=-1), 1)
    k_inside_B = use_k_B & (top_k_B <= c)
    p_inside_B = use_p_B & (cumulative_BxC[:, -1] >= top_p_B)
    kth_B = jnp.take_along_axis(top_BxC, (jnp.clip(top_k_B, 1, c) - 1)[:, None], axis=-1)[:, 0]
    pth_B = jnp.take_along_axis(top_BxC, (n_keep_B - 1)[:, None], axis=-1)[:, 0]
    # One threshold inside the top c decides the row: the other one, outside, is lower.
    threshold_B = jnp.maximum(jnp.where(k_inside_B, kth_B, -jnp.inf),
                              jnp.where(p_inside_B, pth_B, -jnp.inf))  # fmt: skip
    decided_B = k_inside_B | p_inside_B | ~(use_k_B | use_p_B)

    def search():
        searched_B = _searched_thresholds(scaled_BxV, log_norm_Bx1, top_k_B, top_p_B, use_k_B,
                                          use_p_B, vocab)  # fmt: skip
        return jnp.where(decided_B, threshold_B, searched_B)

    return jax.lax.cond(jnp.all(decided_B), lambda: threshold_B, search)


def _order_key(x: jax.Array) -> jax.Array:
    """uint32 keys ordered like the float32 values (negative floats have their bits flipped)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_order_key(key: jax.Array) -> jax.Array:
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _searched_thresholds(scaled_BxV, log_norm_Bx1, top_k_B, top_p_B, use_k_B, use_p_B,
                         vocab: VocabAxis):  # fmt: skip
    """The same thresholds by bisection over the whole row, for flat distributions.

    The threshold is the largest logit v with at least top_k tokens >= v, or with the tokens
    >= v holding at least top_p of the mass (the larger of the two where both apply). Both
    counts only fall as v grows, so bisecting the 2^32 float32 order keys between the row's
    min and max finds it, an exact row value, in 32 passes. If no value qualifies (the float32
    mass of the row falls short of top_p), the row's minimum is kept: every token, like the
    sorted cumulative sum that never reaches top_p.
    """
    probs_BxV = jnp.exp(scaled_BxV - log_norm_Bx1)
    keys_BxV = _order_key(scaled_BxV)

    def qualifies(key_B):
        at_least_BxV = scaled_BxV >= _from_order_key(key_B)[:, None]
        count_B = vocab.sum(at_least_BxV, dtype=jnp.int32)
        mass_B = vocab.sum(jnp.where(at_least_BxV, probs_BxV, 0.0))
        return (use_k_B & (count_B >= top_k_B)) | (use_p_B & (mass_B >= top_p_B))

    def halve(_, bounds):  # the answer lies in [low, high)
        low_B, high_B = bounds
        open_B = high_B - low_B > 1
        mid_B = low_B + (high_B - low_B) // 2
        up_B = open_B & qualifies(mid_B)
        return jnp.where(up_B, mid_B, low_B), jnp.where(open_B & ~up_B, mid_B, high_B)

    bounds = (vocab.min(keys_BxV), vocab.max(keys_BxV) + 1)
    low_B, _ = jax.lax.fori_loop(0, 32, halve, bounds)
    return _from_order_key(low_B)


def cumulative_mass(probs_BxV: jax.Array,
                    vocab: VocabAxis = VocabAxis()) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """(the rows' cumulative mass [B, V], float32, each row's total [B]).

    The total is bit-equal to the row's last cumulative value, split or not, so a uniform
    draw in [0, total) always lands on a token with mass (`sample_from_probs`).
    """
    cdf_BxV = jnp.cumsum(probs_BxV.astype(jnp.float32), axis=-1)
    if vocab.name is None:
        return cdf_BxV, cdf_BxV[..., -1]
    before_B, total_B = vocab.before_and_total(cdf_BxV[..., -1])
    return cdf_BxV + before_B[..., None], total_B


def sample_from_probs(keys_B: jax.Array, probs_BxV: jax.Array,
                      vocab: VocabAxis = VocabAxis()) -> jax.Array:  # fmt: skip
    """One draw per row from (unnormalised) probabilities, by inverse CDF.

    Exactly categorical sampling (up to float32 rounding of the cumulative sum) from one
    uniform per row: Gumbel-max (`jax.random.categorical`) draws V uniforms per row, which on
    XLA:CPU cost more than the sampled decode step's forward at batch 32 (78 vs 10 ms for
    [32, 49152]). Zero-probability tokens are never drawn: the chosen index is the first
    whose cumulative mass exceeds u in [0, total).

    Args:
      keys_B: one typed PRNG key per row.
      probs_BxV: non-negative weights, each row with positive mass.
      vocab: the rows' layout (`VocabAxis`): split, each block's cumulative sum continues
        from the mass of the blocks before it.

    Returns:
      int32 [B] token ids.
    """
    cdf_BxV, total_B = cumulative_mass(probs_BxV, vocab)
    u_B = jax.vmap(jax.random.uniform)(keys_B) * total_B
    index_B = vocab.sum(cdf_BxV <= u_B[..., None], dtype=jnp.int32)
    return jnp.minimum(index_B, vocab.size(probs_BxV) - 1)


def needs_filtering(params: Iterable[SamplingParams]) -> bool:
    """Whether a batch of these requests needs `filtered_logits`' top-k / top-p math: some
    sampled request truncates. A program traced without it (`filtering=False`) compiles
    faster: on XLA:CPU the thresholds and their exact search fallback took 0.5 s of a
    sampled token choice's 0.9 s compile, once per batch bucket, and 0.6 s of a sampled tree
    acceptance's 1.9 s (BENCHMARKS.md, "What the main job compiles")."""
    return any(not p.greedy and (p.top_p < 1 or p.top_k > 0) for p in params)


def choose_tokens(
    logits_BxV: jax.Array,
    temperature_B: jax.Array,
    top_k_B: jax.Array,
    top_p_B: jax.Array,
    keys_B: jax.Array,
    *,
    greedy_only: bool,
    filtering: bool = True,
    vocab_axis: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Next token per row and its logprob.

    Args:
      logits_BxV: float32 logits.
      temperature_B / top_k_B / top_p_B: per-row sampling parameters.
      keys_B: one typed PRNG key per row (ignored by greedy rows).
      greedy_only: static; every row is greedy (no sampling math is traced).
      filtering: static; False: no row truncates (`needs_filtering`), no filter is traced.
      vocab_axis: static; the mesh axis the logits' vocabulary is split over, inside
        `shard_map` (`VocabAxis`); None: whole rows.

    Returns:
      (tokens_B int32, logprobs_B float32).
    """
    vocab = VocabAxis(vocab_axis)
    logits_BxV = logits_BxV.astype(jnp.float32)
    argmax_B = vocab.argmax(logits_BxV)
    if greedy_only:
        tokens_B = argmax_B
        scaled_BxV = logits_BxV
    else:
        # Greedy rows take the argmax: they need no filtering (which an all-greedy batch skips).
        sampling_B = temperature_B > 0
        masked = filtered_logits(logits_BxV, temperature_B, jnp.where(sampling_B, top_k_B, 0),
                                 jnp.where(sampling_B, top_p_B, 1.0),
                                 filtering=filtering, vocab=vocab)  # fmt: skip
        sampled_B = sample_from_probs(keys_B, vocab.softmax(masked), vocab)
        tokens_B = jnp.where(temperature_B > 0, sampled_B, argmax_B)
        temperature = jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None]
        scaled_BxV = logits_BxV / temperature
    return tokens_B, vocab.log_softmax_at(scaled_BxV, tokens_B)
