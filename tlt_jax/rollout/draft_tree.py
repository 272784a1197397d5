"""EAGLE-2 dynamic tree drafting and the verification tree it yields (DESIGN.md section 4).

Dimension legend: B batch, C draft candidates, T tree nodes (verify tokens), D model, V vocab,
U hot vocabulary, S cached kv length, k top-k, N drafted-node slots of the level loop
((depth - 1) * k).

Drafting positions. The drafter's cache holds one pair per position p < lengths[b]: (token
x[p+1], policy feature f[p]); its output at the last pair predicts f[lengths], the feature of the
pending token `last_token` (the tree's root at position lengths). That prediction (`feature_BxD`
of the `DraftState`) gives the level-0 candidates, children of the root. A tree node at depth
delta >= 1 (position lengths + delta) enters the drafter as the pair (its token, its parent's
predicted feature) at drafter position lengths + delta - 1, attending to the cached prefix and to
its in-tree ancestors.

Levels. Level 0: the k best drafter tokens at the root, scored by their log-probability. Level
i = 1 .. depth-1: one drafter forward over the frontier (k nodes per row) expands every frontier
node to its k best children, each scored by the cumulative log-probability of its branch; the
best k of the k*k children form the next frontier. All candidates are kept: k at level 0 and k*k
at every later level, C = k + (depth-1) * k^2, indexed level by level, so a parent always has a
lower index than its children.

Hot vocabulary. With `hot_token_ids` every level's head is the live LM head's columns of those
U tokens (`hot_head`; the engine slices it once per weight sync and passes it in, else each
call slices it once): the drafter proposes only hot tokens, at U / V of the head's cost per
level. Verification always uses the full vocabulary, so the output is unchanged.

The drafter is one layer, so a node's keys and values depend on its own input only: instead of
copying ancestor KV into per-branch slots (SGLang's `move_kv_cache`), every level runs the
frontier nodes of all levels in one fixed-size buffer of (depth-1)*k tokens per row with an
ancestor mask (one drafter layer; earlier levels' outputs are recomputed unchanged and unused
slots attend to themselves only). A `fori_loop` over levels keeps one compiled level body
whatever the depth.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.decode import DecodeCache
from tlt_jax.models.drafter import DrafterParams, draft_logits, drafter_decode


class Candidates(NamedTuple):
    """Every drafted node of one step, level by level (parents before children)."""

    tokens_BxC: jax.Array  # int32 drafted tokens
    scores_BxC: jax.Array  # float32 cumulative drafter log-probability of the branch
    parents_BxC: jax.Array  # int32 candidate index of the parent, -1 for children of the root


class DraftTree(NamedTuple):
    """The verification tree: node 0 is the root (the pending token), parents before children."""

    tokens_BxT: jax.Array  # int32
    parents_BxT: jax.Array  # int32 node index of the parent, -1 for the root
    depth_BxT: jax.Array  # int32, 0 for the root
    positions_BxT: jax.Array  # int32, lengths + depth
    mask_BxTxT: jax.Array  # bool, [b, i, j]: node j is an ancestor of node i or i itself


def _gather_rows(x_BxN, index_BxM):
    """x[b, index[b, m]] for arrays with trailing dims."""
    index = index_BxM.reshape(index_BxM.shape + (1,) * (x_BxN.ndim - 2))
    return jnp.take_along_axis(x_BxN, index, axis=1)


def hot_head(head_DxV: jax.Array, hot_token_ids: jax.Array) -> jax.Array:
    """The LM head's columns of the hot vocabulary, [D, U]: every draft level's head."""
    return jnp.take(head_DxV, hot_token_ids, axis=1)


def draft_candidates(
    params: DrafterParams,
    config: ModelConfig,
    embed_VxD: jax.Array,
    head_DxV: jax.Array,
    cache: DecodeCache,
    lengths_B: jax.Array,
    feature_BxD: jax.Array,
    *,
    topk: int,
    depth: int,
    attention_impl: str = "xla",
    hot_token_ids: jax.Array | None = None,
    hot_head_DxU: jax.Array | None = None,
) -> Candidates:
    """Drafts the candidate tree of every row (level 0 plus depth-1 drafter forwards).

    Args:
      params: the drafter's parameters (`Drafter.params_dict()`).
      config: the drafter's model config.
      embed_VxD / head_DxV: the policy's embedding and LM head.
      cache: the drafter cache of these rows (a one-layer `DecodeCache`), valid below
        `lengths_B`.
      lengths_B: the rows' cached lengths (the root's position).
      feature_BxD: the drafter's prediction of the root's feature.
      topk: children per expanded node (k); depth: tree depth (levels).
      attention_impl: "xla" or "pallas" for the drafter's cached attention.
      hot_token_ids: optional int32 [U] (U >= topk): draft only among these tokens (the head
        is sliced to their columns once per call, from the live head; log-probabilities are
        normalised over the U tokens).
      hot_head_DxU: optional, with `hot_token_ids`: the head's columns of those ids, sliced
        by the caller (`hot_head`) once per weight sync instead of once per call here.

    Returns:
      `Candidates` with C = topk + (depth - 1) * topk**2 nodes per row (vocabulary ids).
    """
    b, k, d = lengths_B.shape[0], topk, feature_BxD.shape[-1]
    if hot_token_ids is not None:
        if hot_token_ids.ndim != 1 or hot_token_ids.shape[0] < k:
            raise ValueError(f"hot_token_ids.shape={hot_token_ids.shape} must be [U] with "
                             f"U >= topk={k}")  # fmt: skip
        if hot_head_DxU is None:  # once per call, outside the level loop
            head_DxV = hot_head(head_DxV, hot_token_ids)
        elif hot_head_DxU.shape != (d, hot_token_ids.shape[0]):
            raise ValueError(f"hot_head_DxU.shape={hot_head_DxU.shape} must be (D, U)="
                             f"{(d, hot_token_ids.shape[0])}")  # fmt: skip
        else:
            head_DxV = hot_head_DxU
    elif hot_head_DxU is not None:
        raise ValueError("hot_head_DxU needs the hot_token_ids it was sliced for")

    def to_vocab(index):  # top-k indices into the (possibly hot) head -> vocabulary ids
        ids = index if hot_token_ids is None else jnp.take(hot_token_ids, index)
        return ids.astype(jnp.int32)

    logp_BxV = _nan_to_neg_inf(
        jax.nn.log_softmax(draft_logits(feature_BxD[:, None], head_DxV)[:, 0], axis=-1)
    )
    scores, tokens = jax.lax.top_k(logp_BxV, k)
    tokens = to_vocab(tokens)
    c = k + (depth - 1) * k * k
    cands = Candidates(
        tokens_BxC=jnp.zeros((b, c), jnp.int32).at[:, :k].set(tokens),
        scores_BxC=jnp.zeros((b, c), jnp.float32).at[:, :k].set(scores),
        parents_BxC=jnp.full((b, c), -1, jnp.int32),
    )
    if depth == 1:
        return cands
    # Every frontier node forwarded so far, in fixed-size buffers (one compiled level body):
    # slots [(i-1)k, ik) hold level i's frontier; unused slots attend to themselves only.
    n = (depth - 1) * k
    run = _Run(
        tokens_BxN=jnp.zeros((b, n), jnp.int32),
        features_BxNxD=jnp.zeros((b, n, d), feature_BxD.dtype),
        mask_BxNxN=jnp.broadcast_to(jnp.eye(n, dtype=bool), (b, n, n)),
    )
    front = _Frontier(
        tokens_Bxk=tokens,
        scores_Bxk=scores,
        features_BxkxD=jnp.broadcast_to(feature_BxD[:, None], (b, k, d)),
        cands_Bxk=jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k)),
        parent_slots_Bxk=jnp.full((b, k), -1, jnp.int32),
    )
    slots = jnp.arange(n, dtype=jnp.int32)

    def level(i, carry):
        run, front, cands = carry
        first = (i - 1) * k
        # The frontier's ancestor rows: its parent's row (none for the root) plus itself.
        parent_rows = _gather_rows(run.mask_BxNxN, jnp.maximum(front.parent_slots_Bxk, 0))
        parent_rows &= (front.parent_slots_Bxk >= 0)[..., None]
        own = (slots[None, :] == first + jnp.arange(k)[:, None])[None]  # [1, k, N]
        run = _Run(
            tokens_BxN=jax.lax.dynamic_update_slice(run.tokens_BxN, front.tokens_Bxk, (0, first)),
            features_BxNxD=jax.lax.dynamic_update_slice(
                run.features_BxNxD, front.features_BxkxD.astype(run.features_BxNxD.dtype),
                (0, first, 0),
            ),
            mask_BxNxN=jax.lax.dynamic_update_slice(run.mask_BxNxN, parent_rows | own,
                                                    (0, first, 0)),
        )  # fmt: skip
        # A node at depth delta sits at drafter position lengths + delta - 1 = slot // k.
        positions = lengths_B[:, None] + slots[None, :] // k
        g_BxNxD, _, _ = drafter_decode(
            params, config, embed_VxD, run.tokens_BxN, run.features_BxNxD, positions, cache,
            lengths_B, mask_BxTxT=run.mask_BxNxN, attention_impl=attention_impl,
        )  # fmt: skip
        g_front = jax.lax.dynamic_slice_in_dim(g_BxNxD, first, k, axis=1)  # [B, k, D]
        logp = _nan_to_neg_inf(jax.nn.log_softmax(draft_logits(g_front, head_DxV), axis=-1))
        child_logp, child_tokens = jax.lax.top_k(logp, k)  # [B, k, k]
        child_scores = (front.scores_Bxk[:, :, None] + child_logp).reshape(b, k * k)
        child_tokens = to_vocab(child_tokens.reshape(b, k * k))
        offset = k + (i - 1) * k * k
        cands = Candidates(
            tokens_BxC=jax.lax.dynamic_update_slice(cands.tokens_BxC, child_tokens, (0, offset)),
            scores_BxC=jax.lax.dynamic_update_slice(cands.scores_BxC, child_scores, (0, offset)),
            parents_BxC=jax.lax.dynamic_update_slice(
                cands.parents_BxC, jnp.repeat(front.cands_Bxk, k, axis=1), (0, offset)
            ),
        )
        # The next frontier: the best k children (unused after the last level).
        front_scores, pick = jax.lax.top_k(child_scores, k)
        front = _Frontier(
            tokens_Bxk=jnp.take_along_axis(child_tokens, pick, axis=1),
            scores_Bxk=front_scores,
            features_BxkxD=_gather_rows(g_front, pick // k).astype(front.features_BxkxD.dtype),
            cands_Bxk=(offset + pick).astype(jnp.int32),
            parent_slots_Bxk=(first + pick // k).astype(jnp.int32),
        )
        return run, front, cands

    _, _, cands = jax.lax.fori_loop(1, depth, level, (run, front, cands))
    return cands


def _nan_to_neg_inf(x: jax.Array) -> jax.Array:
    # `lax.top_k` ranks NaN above every number: a NaN-scored node would be drafted, expanded and
    # kept first. As -inf it ranks last, and sums of -inf scores stay -inf (never NaN).
    return jnp.where(jnp.isnan(x), -jnp.inf, x)


class _Run(NamedTuple):
    tokens_BxN: jax.Array
    features_BxNxD: jax.Array
    mask_BxNxN: jax.Array


class _Frontier(NamedTuple):
    tokens_Bxk: jax.Array
    scores_Bxk: jax.Array
    features_BxkxD: jax.Array
    cands_Bxk: jax.Array  # candidate index of each frontier node
    parent_slots_Bxk: jax.Array  # run slot of the parent, -1 for the root


def build_tree(
    candidates: Candidates,
    root_tokens_B: jax.Array,
    lengths_B: jax.Array,
    *,
    verify_tokens: int,
    max_depth: int,
) -> DraftTree:
    """Keeps the verify_tokens - 1 best-scoring candidates and prepends the root.

    Candidates are ranked by their score capped by every ancestor's (NaN read as -inf), so a
    child never outranks its parent: `draft_candidates` scores already satisfy this (log-
    probabilities are <= 0), the cap makes it hold for any scores, NaN included. With
    `lax.top_k` preferring the lower index on ties, the kept set is closed under ancestors:
    no node loses its parent, so siblings keep the distinct tokens the drafter's top-k gave them
    (an orphan re-hung under the root could repeat a root child's token, and a repeated sibling
    would be accepted twice by the sibling walk, which is then no longer lossless). Sorting the
    kept candidate indices puts parents before children.

    Args:
      candidates: from `draft_candidates`.
      root_tokens_B: the pending tokens (the roots).
      lengths_B: the cached lengths (the roots' positions).
      verify_tokens: T, nodes in the tree including the root.
      max_depth: the deepest candidate's depth (the strategy's depth).

    Returns:
      The `DraftTree` of T nodes per row.
    """
    b = root_tokens_B.shape[0]
    n = verify_tokens - 1
    root = root_tokens_B[:, None].astype(jnp.int32)
    if n == 0:
        zeros = jnp.zeros((b, 1), jnp.int32)
        return DraftTree(root, zeros - 1, zeros, lengths_B[:, None] + zeros,
                         jnp.ones((b, 1, 1), bool))  # fmt: skip
    # Parents precede children, so after i passes nodes down to depth i + 1 are capped.
    own_scores = _nan_to_neg_inf(candidates.scores_BxC.astype(jnp.float32))
    has_parent = candidates.parents_BxC >= 0
    gather_cand = jnp.maximum(candidates.parents_BxC, 0)
    ranks = own_scores
    for _ in range(max_depth - 1):
        capped = jnp.take_along_axis(ranks, gather_cand, axis=1)
        ranks = jnp.where(has_parent, jnp.minimum(own_scores, capped), own_scores)
    _, keep = jax.lax.top_k(ranks, n)
    keep = jnp.sort(keep, axis=1)
    tokens = jnp.take_along_axis(candidates.tokens_BxC, keep, axis=1)
    parent_cands = jnp.take_along_axis(candidates.parents_BxC, keep, axis=1)
    c = candidates.tokens_BxC.shape[1]
    node_of_cand = (
        jnp.zeros((b, c), jnp.int32)
        .at[jnp.arange(b)[:, None], keep]
        .set(jnp.arange(1, n + 1, dtype=jnp.int32))
    )
    parents = jnp.take_along_axis(node_of_cand, jnp.maximum(parent_cands, 0), axis=1)
    parents = jnp.where(parent_cands < 0, 0, parents)  # 0: the root
    parents_BxT = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parents], axis=1)
    # Ancestor-or-self: each pass adds one more generation; max_depth passes reach the root.
    gather_parent = jnp.maximum(parents_BxT, 0)
    mask = jnp.broadcast_to(jnp.eye(n + 1, dtype=bool), (b, n + 1, n + 1))
    for _ in range(max_depth):
        mask = mask | _gather_rows(mask, gather_parent)
    depth = jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1
    return DraftTree(
        tokens_BxT=jnp.concatenate([root, tokens], axis=1),
        parents_BxT=parents_BxT,
        depth_BxT=depth,
        positions_BxT=lengths_B[:, None] + depth,
        mask_BxTxT=mask,
    )


def tree_node_scores(tree, candidates) -> np.ndarray:
    """The rank `build_tree` kept each tree node by: its candidate's score capped by every
    ancestor's (NaN read as -inf), [B, T] float64 on the host; +inf for the root (never
    dropped) and -inf for padding nodes.

    For ranking EAGLE nodes outside the program, e.g. `ngram.merge_into_tree`'s choice of
    leaves to drop (by index, a shallow low-scoring leaf outlived a deeper better one when
    topk > 1). A node is matched to its candidate by (parent's candidate, token): siblings'
    tokens are distinct (the drafter's top-k), so the match is unique.

    Args:
      tree: a `DraftTree` of `candidates` (host or device arrays).
      candidates: the `Candidates` it was built from.
    """
    tokens, parents = np.asarray(tree[0]), np.asarray(tree[1])
    c_tokens = np.asarray(candidates.tokens_BxC)
    c_scores = np.asarray(candidates.scores_BxC, np.float64)
    c_parents = np.asarray(candidates.parents_BxC)
    b, t = tokens.shape
    out = np.full((b, t), -np.inf)
    out[:, 0] = np.inf
    for i in range(b):
        pairs = zip(c_parents[i].tolist(), c_tokens[i].tolist(), strict=True)
        which = {pair: c for c, pair in enumerate(pairs)}
        cand_of = {0: -1}  # the root's children have parent candidate -1
        for j in range(1, t):
            parent = int(parents[i, j])
            if parent < 0 or parent not in cand_of:  # padding (detached)
                continue
            c = which.get((cand_of[parent], int(tokens[i, j])))
            if c is None:
                raise ValueError(f"tree_node_scores: row {i} node {j} (token {int(tokens[i, j])})"
                                 " is no candidate of its parent's: not a tree of these "
                                 "candidates")  # fmt: skip
            cand_of[j] = c
            own = c_scores[i, c] if not np.isnan(c_scores[i, c]) else -np.inf
            out[i, j] = min(own, out[i, parent])
    return out
