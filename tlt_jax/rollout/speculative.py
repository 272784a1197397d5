"""Lossless tree speculative decoding: strategy, drafter state and the engine's SD programs.

Dimension legend: B batch (slots), T tree nodes (verify tokens), C draft candidates, P prompt
length, S kv length, L layers, K kv heads, H head dim, D model, V vocab.

One SD step over the first `batch` slots of the engine's `DecodeState` is three programs:

1. `draft_program` (batch, k, depth, kv, hot vocabulary size): EAGLE-2 candidates
   (`draft_tree.draft_candidates`); with a hot vocabulary, through the head's hot columns
   that `hot_head_program` sliced once per weight sync.
2. `tree_program` (batch, k, depth, T): the T-node tree (`draft_tree.build_tree`).
3. `verify_program` (batch, T, kv): one target forward over B x T tokens with the tree mask
   (reading the target cache, not writing it), acceptance (`acceptance.accept_tree`), and the
   drafter over the accepted path with the target's features of that path (EAGLE's
   draft-extend), which extends its cache by the same m + 1 pairs and predicts the next root's
   feature.
4. `commit_program` (batch, T, kv): the accepted path's keys and values scattered into the
   target cache at positions lengths .. lengths + m (nothing else is written and lengths grew by
   m + 1, so rejected branches are never readable). A program of its own: written in the
   program whose attention read the cache, XLA copies every cache array first.

Drafter state is in sync for a slot when its `DraftState.lengths` equals the target's lengths.
Prefill puts it in sync (`prefill_drafter`, one drafter layer over the prompt). Plain decode
steps either keep it in sync (the engine's `drafter_sync="eager"`: each step also runs the
drafter layer over its one new pair) or leave it behind ("lazy"); then `catchup_program` brings
slots back by recomputing the target features of the missing positions (one target forward
over those tokens against the target cache) and running the drafter over them: the cost of
switching a running batch into SD mode (`scripts/bench_spec.py` measures both).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
from flax import nnx, struct

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.decode import DecodeCache, ForwardInputs, block_program, final_features
from tlt_jax.models.drafter import DrafterParams, drafter_decode, drafter_forward
from tlt_jax.models.transformer import KVCache, NewKV, causal_mask
from tlt_jax.parallel import sharding as sharding_lib
from tlt_jax.rollout.acceptance import accept_tree
from tlt_jax.rollout.draft_tree import (
    Candidates,
    DraftTree,
    build_tree,
    draft_candidates,
    hot_head,
)


@dataclasses.dataclass(frozen=True)
class SpecStrategy:
    """A tree SD strategy: draft depth, top-k per expanded node, tokens verified (root included).

    `verify_tokens - 1` drafted nodes must fit in the candidates: `topk + (depth - 1) * topk**2`.
    """

    depth: int
    topk: int
    verify_tokens: int

    def __post_init__(self):
        for name in ("depth", "topk", "verify_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"spec_strategy.{name}={value!r} must be an integer >= 1")
        if self.verify_tokens - 1 > self.num_candidates:
            raise ValueError(
                f"spec_strategy verify_tokens={self.verify_tokens} needs verify_tokens - 1 <= "
                f"topk + (depth - 1) * topk**2 = {self.topk} + ({self.depth} - 1) * "
                f"{self.topk}**2 = {self.num_candidates} (depth={self.depth}, topk={self.topk})"
            )

    @property
    def num_candidates(self) -> int:
        return self.topk + (self.depth - 1) * self.topk**2

    @classmethod
    def parse(cls, text: str) -> SpecStrategy:
        """'depth,topk,verify_tokens', e.g. '8,4,48' (TLT's '8_4_48' also accepted)."""
        parts = re.split(r"[,_]", text.strip())
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(
                f"spec_strategy {text!r} must be three integers 'depth,topk,verify_tokens', "
                "e.g. '8,4,48'"
            )
        depth, topk, verify = (int(p) for p in parts)
        return cls(depth=depth, topk=topk, verify_tokens=verify)

    def __str__(self) -> str:
        return f"{self.depth},{self.topk},{self.verify_tokens}"


@struct.dataclass
class DraftState:
    """The drafter's part of the decode state (donated with it)."""

    cache: DecodeCache  # one layer, sized like the target's; pair (x[p+1], f[p]) at position p
    lengths: jax.Array  # [B] int32, pairs in the cache (= target lengths when in sync)
    feature: jax.Array  # [B, D] drafter output at the last pair: predicted f[lengths]

    @classmethod
    def create(cls, config: ModelConfig, batch: int, max_len: int) -> DraftState:
        """Zeros for `batch` slots (B: the target cache's slots) of `max_len` positions."""
        return cls(
            cache=DecodeCache.zeros(config, batch, max_len),
            lengths=jnp.zeros((batch,), jnp.int32),
            feature=jnp.zeros((batch, config.hidden_size), config.jnp_dtype),
        )


def commit_kv(cache: DecodeCache, new: NewKV, rows_BxA: jax.Array, start_B: jax.Array,
              count_B: jax.Array) -> DecodeCache:  # fmt: skip
    """Writes `new` rows `rows_BxA[b, :count_B[b]]` at positions start_B[b] + 0, 1, ...

    Only those positions change: the rest of each row (and positions past the buffer) is
    dropped from the scatter.
    """
    b, a = rows_BxA.shape
    index = rows_BxA[None, :, :, None, None]
    slots = jnp.arange(a, dtype=jnp.int32)[None, :]
    positions = jnp.where(slots < count_B[:, None], start_B[:, None] + slots, cache.length)

    def rows(new_arr):
        return jnp.take_along_axis(new_arr, index, axis=2)

    return cache.write_positions(jnp.arange(b)[:, None], positions, rows(new.k), rows(new.v))


def extend_drafter(params, config, embed_VxD, draft: DraftState, next_tokens_BxA,
                    features_BxAxD, start_B, count_B, *, batch: int,
                    attention_impl: str = "xla") -> DraftState:  # fmt: skip
    """Appends pairs (next_tokens[a], features[a]) at start + a for a < count (rows < batch).

    The drafter's EAGLE-extend: verification appends the accepted path, the catch-up the
    positions plain steps decoded, and an eager-sync plain step its one new pair. All A pairs
    are written before attention reads the cache (in place); those at or past start + count
    lie beyond the row's new length, never read, and are overwritten later.
    """
    a = next_tokens_BxA.shape[1]
    positions = start_B[:, None] + jnp.arange(a, dtype=jnp.int32)[None, :]
    g_BxAxD, _, cache = drafter_decode(
        params, config, embed_VxD, next_tokens_BxA, features_BxAxD, positions, draft.cache,
        start_B, write=True, attention_impl=attention_impl,
    )  # fmt: skip
    last = jnp.take_along_axis(g_BxAxD, jnp.maximum(count_B - 1, 0)[:, None, None], axis=1)[:, 0]
    moved = count_B > 0
    feature = jnp.where(moved[:, None], last.astype(draft.feature.dtype), draft.feature[:batch])
    return DraftState(
        cache=cache,
        lengths=draft.lengths.at[:batch].set(
            jnp.where(moved, start_B + count_B, draft.lengths[:batch])
        ),  # fmt: skip
        feature=draft.feature.at[:batch].set(feature),
    )


def prefill_drafter(params: DrafterParams, config: ModelConfig, embed_VxD: jax.Array,
                    draft: DraftState, tokens_UxP: jax.Array, features_UxPxD: jax.Array,
                    prompt_lens_U: jax.Array, rows_B: jax.Array, first_tokens_B: jax.Array,
                    slots_B: jax.Array) -> DraftState:  # fmt: skip
    """The drafter over freshly prefilled prompts: pairs (x[p+1], f[p]) for p < prompt_len.

    Slot `slots_B[b]` takes prompt row `rows_B[b]` (the engine's prefix sharing). The pairs
    before a prompt's last position are the same for every sample of the prompt: the drafter
    runs once per distinct prompt (U rows), and they are written into each of its slots. The
    last pair (the sampled first token, f[len - 1]) is each slot's own: one drafter step per
    slot, attending to its prompt's pairs. A GRPO group of G samples costs one prompt's
    drafter pass, not G (and on a mesh sends one prompt's keys and values, not G).

    Args:
      params / config: the drafter's.
      embed_VxD: the policy's embedding.
      draft: the engine's drafter state.
      tokens_UxP / features_UxPxD: the right-padded distinct prompts and their target features.
      prompt_lens_U: prompt lengths; rows_B: each slot's prompt row.
      first_tokens_B: the token sampled after each slot's prompt.
      slots_B: destination slots (out of range: dropped), as in the engine's prefill.

    Returns:
      The drafter state with those slots in sync (lengths = prompt lengths).
    """
    u, p = tokens_UxP.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (u, p))
    # The pair at len - 1 waits for each sample's first token: written below, per slot.
    next_tokens = jnp.concatenate([tokens_UxP[:, 1:], jnp.zeros((u, 1), tokens_UxP.dtype)], 1)
    _, new = drafter_forward(params, config, embed_VxD, next_tokens, features_UxPxD, positions)
    cache = draft.cache.write_prompts(slots_B, rows_B, new)
    last_B = prompt_lens_U[rows_B] - 1
    prompt = KVCache(k=new.k[:, rows_B], v=new.v[:, rows_B])
    feature_Bx1xD = jnp.take_along_axis(features_UxPxD, (prompt_lens_U - 1)[:, None, None],
                                        axis=1)[rows_B]  # fmt: skip
    g_Bx1xD, pair = drafter_forward(params, config, embed_VxD, first_tokens_B[:, None],
                                    feature_Bx1xD, last_B[:, None], cache=prompt,
                                    cache_lens_B=last_B)  # fmt: skip
    return DraftState(
        cache=cache.write_positions(slots_B[:, None], last_B[:, None], pair.k, pair.v),
        lengths=draft.lengths.at[slots_B].set(last_B + 1, mode="drop"),
        feature=draft.feature.at[slots_B].set(
            g_Bx1xD[:, 0].astype(draft.feature.dtype), mode="drop"
        ),  # fmt: skip
    )


def without_caches(state):
    """An engine `DecodeState` with its caches (the target's and the drafter's) taken out: what
    a program that reads none of them takes, so its key needs no cache size."""
    draft = None if state.draft is None else state.draft.replace(cache=None)
    return state.replace(cache=None, draft=draft)


def draft_length(state) -> int | None:
    """The drafter cache's positions (a program that reads it depends on them), None without."""
    return None if state.draft is None else state.draft.cache.length


# ----------------------------------------------------------------------------- programs
# Each takes the target's (graphdef, params) and the engine's `DecodeState` (`state.draft` is
# a `DraftState`); static keywords are bound with functools.partial before AOT compilation.


def draft_program(graphdef, drafter_config: ModelConfig, params, drafter_params, state,
                  hot_token_ids=None, hot_head_DxU=None, *, batch: int, kv_len: int, topk: int,
                  depth: int, attention_impl: str = "xla") -> Candidates:  # fmt: skip
    """Candidates of the first `batch` slots (reads the state, writes nothing); drafted among
    `hot_token_ids` ([U] int32) only when given (an argument, so new ids never recompile),
    through `hot_head_DxU` when given (`hot_head_program`'s, once per weight sync), else
    through the head's columns sliced here."""
    model = nnx.merge(graphdef, params)
    draft = state.draft
    draft.cache.check_size(batch, kv_len)
    return draft_candidates(
        drafter_params, drafter_config, model.embed.get_value(), model.head_weight_DxV(),
        draft.cache, draft.lengths[:batch], draft.feature[:batch],
        topk=topk, depth=depth, attention_impl=attention_impl, hot_token_ids=hot_token_ids,
        hot_head_DxU=hot_head_DxU,
    )  # fmt: skip


def hot_head_program(graphdef, params, hot_token_ids) -> jax.Array:
    """The policy head's columns of the hot vocabulary, [D, U] (`draft_tree.hot_head`), which
    every draft step of one weight version reads: sliced once, not once per draft step (on a
    vocabulary-sharded head each slice is a collective)."""
    return hot_head(nnx.merge(graphdef, params).head_weight_DxV(), hot_token_ids)


def tree_program(candidates: Candidates, last_token, lengths, *, batch: int, verify_tokens: int,
                 depth: int) -> DraftTree:  # fmt: skip
    """The verification tree of the first `batch` slots (`last_token`, `lengths`: the decode
    state's; only those, so the program does not depend on the cache's length bucket)."""
    return build_tree(candidates, last_token[:batch], lengths[:batch],
                      verify_tokens=verify_tokens, max_depth=depth)  # fmt: skip


def verify_inputs(graphdef, params, state, tree: DraftTree, *, batch: int) -> ForwardInputs:
    """The layer inputs of a verify step: the tree's tokens embedded at their positions,
    attending to the cache below each slot's length and to their ancestors."""
    model = nnx.merge(graphdef, params)
    x = model.embed_tokens(tree.tokens_BxT)
    return x, tree.positions_BxT, tree.mask_BxTxT, state.lengths[:batch]


def verify_outputs(graphdef, drafter_config: ModelConfig, params, drafter_params, state,
                   tree: DraftTree, x_BxTxD, *, batch: int, greedy_only: bool,
                   attention_impl: str = "xla", residual: str = "exact",
                   filtering: bool = True):  # fmt: skip
    """A verify step after the layers: acceptance, the drafter's extend, the state's scalars.
    Leaves `state.cache` alone (None in layered steps).

    Returns (state, tokens_BxT, logprobs_BxT, num_emitted_B, path_BxT) as `verify_program`.
    """
    model = nnx.merge(graphdef, params)
    lengths = state.lengths[:batch]
    features_BxTxD = final_features(model, x_BxTxD)
    logits_BxTxV = model.logits(features_BxTxD)
    # Rows are slots: on a mesh each device accepts its own slots' trees, reading its own
    # block of the vocabulary where the head splits it (no gather of the logits).
    result = sharding_lib.rowwise(accept_tree, vocab_args=(0,))(
        logits_BxTxV, tree.tokens_BxT, tree.parents_BxT, tree.positions_BxT,
        state.temperature[:batch], state.top_k[:batch], state.top_p[:batch],
        state.keys[:batch], greedy_only=greedy_only, residual=residual, filtering=filtering,
    )  # fmt: skip
    count_B = result.num_accepted_B + 1
    draft = state.draft
    if drafter_params is not None:  # model-free trees on an engine without a drafter: none
        path_features = jnp.take_along_axis(features_BxTxD, result.path_BxT[..., None], axis=1)
        draft = extend_drafter(
            drafter_params, drafter_config, model.embed.get_value(), state.draft,
            result.tokens_BxT, path_features, lengths, count_B, batch=batch,
            attention_impl=attention_impl,
        )  # fmt: skip
    last_token = jnp.take_along_axis(result.tokens_BxT, (count_B - 1)[:, None], axis=1)[:, 0]
    state = state.replace(
        lengths=state.lengths.at[:batch].add(count_B),
        last_token=state.last_token.at[:batch].set(last_token),
        draft=draft,
    )
    return state, result.tokens_BxT, result.logprobs_BxT, count_B, result.path_BxT


def verify_program(graphdef, drafter_config: ModelConfig, params, layers, drafter_params, state,
                   tree: DraftTree, *, batch: int, kv_len: int, greedy_only: bool,
                   attention_impl: str = "xla", residual: str = "exact",
                   filtering: bool = True):  # fmt: skip
    """Verifies and accepts one tree per slot in [0, batch); `commit_program` then writes the
    accepted path into the target cache. One program: `verify_inputs`, the layers (reading the
    cache), `verify_outputs`; a layered engine runs the three as programs of their own.

    Returns:
      (state, tokens_BxT, logprobs_BxT, num_emitted_B, new_kv, path_BxT): the emitted tokens are
      `tokens[b, :num_emitted[b]]` (accepted drafts, then the correction or bonus token), with
      their logprobs under the target; the state's lengths grew by num_emitted, `last_token`
      is the last emitted token and the drafter (if `drafter_params` is given) is in sync;
      `new_kv` are the tree nodes' keys and values and `path_BxT` the accepted nodes, for the
      commit.
    """
    state.cache.check_size(batch, kv_len)
    model_config = nnx.merge(graphdef, params).config
    inputs = verify_inputs(graphdef, params, state, tree, batch=batch)
    x, new = block_program(layers, state.cache, *inputs, config=model_config, write=False,
                           attention_impl=attention_impl)  # fmt: skip
    state, tokens, logprobs, count_B, path = verify_outputs(
        graphdef, drafter_config, params, drafter_params, state, tree, x, batch=batch,
        greedy_only=greedy_only, attention_impl=attention_impl, residual=residual,
        filtering=filtering,
    )  # fmt: skip
    return state, tokens, logprobs, count_B, new, path


def commit_program(state, new: NewKV, path_BxT: jax.Array, count_B: jax.Array, *,
                   batch: int):  # fmt: skip
    """Writes the accepted path of the last `verify_program` (its `new_kv`, `path_BxT` and
    `num_emitted_B`) into the target cache, at the positions before the verify's lengths."""
    start_B = state.lengths[:batch] - count_B
    return state.replace(cache=commit_kv(state.cache, new, path_BxT, start_B, count_B))


def commit_block_program(cache: DecodeCache, new: NewKV, path_BxT: jax.Array,
                         count_B: jax.Array, lengths: jax.Array, *,
                         batch: int) -> DecodeCache:  # fmt: skip
    """`commit_program` for one block of layers of a layered engine (`lengths`: the state's,
    after the verify)."""
    return commit_kv(cache, new, path_BxT, lengths[:batch] - count_B, count_B)


def catchup_inputs(graphdef, params, state, tokens_BxT, *, batch: int) -> ForwardInputs:
    """The layer inputs of a drafter catch-up: the missed tokens at the drafter's lengths."""
    model = nnx.merge(graphdef, params)
    starts = state.draft.lengths[:batch]
    t = tokens_BxT.shape[1]
    positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return model.embed_tokens(tokens_BxT), positions, causal_mask(batch, t), starts


def catchup_outputs(graphdef, drafter_config: ModelConfig, params, drafter_params, state,
                    next_tokens_BxT, counts_B, x_BxTxD, *, batch: int,
                    attention_impl: str = "xla"):  # fmt: skip
    """A catch-up after the layers: the drafter appends the pairs."""
    model = nnx.merge(graphdef, params)
    draft = extend_drafter(
        drafter_params, drafter_config, model.embed.get_value(), state.draft, next_tokens_BxT,
        final_features(model, x_BxTxD), state.draft.lengths[:batch], counts_B, batch=batch,
        attention_impl=attention_impl,
    )  # fmt: skip
    return state.replace(draft=draft)


def catchup_program(graphdef, drafter_config: ModelConfig, params, layers, drafter_params, state,
                    tokens_BxT, next_tokens_BxT, counts_B, *, batch: int, kv_len: int,
                    attention_impl: str = "xla"):  # fmt: skip
    """Brings the drafter of slots [0, batch) in sync with the target.

    Row b's drafter holds `state.draft.lengths[b]` = a pairs; `tokens_BxT[b, :counts[b]]` are
    the sequence's tokens x[a ..] up to the target length and `next_tokens_BxT` the same shifted
    by one (ending with the pending token). The target's features of those positions are
    recomputed (one forward against the target cache, which is not written) and the drafter
    appends their pairs. Rows with count 0 are left alone. One program: `catchup_inputs`, the
    layers, `catchup_outputs` (a layered engine runs them as programs of their own).
    """
    state.cache.check_size(batch, kv_len)
    model_config = nnx.merge(graphdef, params).config
    inputs = catchup_inputs(graphdef, params, state, tokens_BxT, batch=batch)
    x, _ = block_program(layers, state.cache, *inputs, config=model_config, write=False,
                         attention_impl=attention_impl)  # fmt: skip
    return catchup_outputs(graphdef, drafter_config, params, drafter_params, state,
                           next_tokens_BxT, counts_B, x, batch=batch,
                           attention_impl=attention_impl)  # fmt: skip
