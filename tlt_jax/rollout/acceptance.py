"""Lossless acceptance of a verified draft tree: greedy and the target-only sibling walk.

Dimension legend: B batch, T tree nodes (node 0 is the root, parents before children), V vocab.

Sampling rule (DESIGN.md section 4, SGLang's `TreeSpeculativeSamplingTargetOnly`): q is the
target distribution at a node after temperature, top-k and top-p (`filtered_logits`). At the
node draw one uniform u and walk its children in index order accumulating their q; accept the
first child with u <= cumulative q and continue from it. If none is accepted, emit a correction
token drawn from q with the children removed and renormalised; at a leaf, a bonus token from q.
Drafts are deterministic given the prefix (top-k of the drafter) and siblings are distinct, so
each child is accepted with probability exactly q(child), and the residual reproduces q on the
rest: every emitted token is distributed exactly as the target's.

Every node's decision is computed in parallel (one uniform and one residual draw per node) and
the walk follows the accepted-child links from the root. Node randomness comes from the
request's key folded with the position of the token being chosen, so each position's draw is
used once, whichever step decides it.

Greedy rows (temperature 0): accept the child equal to the target argmax; correct with argmax.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tlt_jax.rollout.sampling import VocabAxis, filtered_logits, sample_from_probs

RESIDUALS = ("exact", "buggy_no_removal")  # the second only exists to prove the tests can fail


class Acceptance(NamedTuple):
    """The outcome of one tree per row; slots past `num_accepted_B` repeat the last entry."""

    path_BxT: jax.Array  # int32 accepted nodes: path[:, 0] = 0 (root), .. path[:, m]
    tokens_BxT: jax.Array  # int32 emitted tokens: m accepted drafts, then correction / bonus
    logprobs_BxT: jax.Array  # float32 log_softmax(logits / temperature) of each emitted token
    num_accepted_B: jax.Array  # int32 m; m + 1 tokens are emitted


def _node_keys(keys_B: jax.Array, positions_BxT: jax.Array) -> jax.Array:
    """One key per node: the request's key folded with the position being chosen."""
    fold = jax.vmap(jax.vmap(jax.random.fold_in, in_axes=(None, 0)), in_axes=(0, 0))
    return fold(keys_B, positions_BxT + 1)


def accept_tree(
    logits_BxTxV: jax.Array,
    tokens_BxT: jax.Array,
    parents_BxT: jax.Array,
    positions_BxT: jax.Array,
    temperature_B: jax.Array,
    top_k_B: jax.Array,
    top_p_B: jax.Array,
    keys_B: jax.Array,
    *,
    greedy_only: bool,
    residual: str = "exact",
    filtering: bool = True,
    vocab_axis: str | None = None,
) -> Acceptance:
    """Walks every row's tree and emits the accepted drafts plus one target token.

    Args:
      logits_BxTxV: target logits at every node (the next-token distribution after it).
      tokens_BxT: node tokens (node 0 is the root, whose token is already emitted).
      parents_BxT: parent node index, -1 for the root; parents precede children.
      positions_BxT: node positions (the chosen token's position is one more).
      temperature_B / top_k_B / top_p_B: per-row sampling parameters.
      keys_B: one typed PRNG key per row (the request's stream).
      greedy_only: static; every row is greedy (skips the sampling math).
      residual: "exact"; "buggy_no_removal" keeps the tried children in the correction
        distribution (wrong on purpose, for the tests' negative case only).
      filtering: static; False: no row truncates (`sampling.needs_filtering`).
      vocab_axis: static; the mesh axis the logits' vocabulary is split over, inside
        `shard_map` (`sampling.VocabAxis`); None: whole rows.

    Returns:
      `Acceptance`.
    """
    if residual not in RESIDUALS:
        raise ValueError(f"{residual=} is not one of {list(RESIDUALS)}")
    vocab = VocabAxis(vocab_axis)
    b, t, v = logits_BxTxV.shape  # v: this device's block of the vocabulary
    logits = logits_BxTxV.astype(jnp.float32)
    nodes = jnp.arange(t, dtype=jnp.int32)
    # child[b, n, j]: node j is a child of node n.
    child_BxTxT = (parents_BxT[:, None, :] == nodes[None, :, None]) & (nodes > 0)[None, None, :]
    argmax_BxT = vocab.argmax(logits)
    hit_BxTxT = child_BxTxT & (tokens_BxT[:, None, :] == argmax_BxT[:, :, None])
    final_BxT = argmax_BxT
    temperature = jnp.ones_like(temperature_B)
    if not greedy_only:
        sampling_B = temperature_B > 0
        temperature = jnp.where(sampling_B, temperature_B, 1.0)
        # Greedy rows never read q: unfiltered, they let an all-greedy batch skip filtering.
        top_k_B = jnp.where(sampling_B, top_k_B, 0)
        top_p_B = jnp.where(sampling_B, top_p_B, 1.0)
        filtered = filtered_logits(
            logits.reshape(b * t, v), jnp.repeat(temperature_B, t), jnp.repeat(top_k_B, t),
            jnp.repeat(top_p_B, t), filtering=filtering, vocab=vocab,
        ).reshape(b, t, v)  # fmt: skip
        q_BxTxV = vocab.softmax(filtered)
        q_child_BxTxT = vocab.take(q_BxTxV, jnp.broadcast_to(tokens_BxT[:, None, :], (b, t, t)))
        cumulative_BxTxT = jnp.cumsum(jnp.where(child_BxTxT, q_child_BxTxT, 0.0), axis=-1)
        # removed[b, n, x]: token x is a child of node n (the root has no parent: dropped).
        # On a split vocabulary a token outside this device's block is dropped too.
        parent_rows = jnp.where(parents_BxT < 0, t, parents_BxT)
        columns, inside = vocab.local(q_BxTxV, tokens_BxT)
        if inside is not None:
            parent_rows = jnp.where(inside, parent_rows, t)
        removed_BxTxV = (
            jnp.zeros((b, t, v), bool)
            .at[jnp.arange(b)[:, None], parent_rows, columns]
            .set(True, mode="drop")
        )
        rest_BxT = vocab.sum(jnp.where(removed_BxTxV, 0.0, q_BxTxV))
        # Normalising by the children's plus the rest's mass makes "all of q on the children"
        # accept one of them for sure, instead of drawing from an empty residual.
        total_BxT = cumulative_BxTxT[..., -1] + rest_BxT
        keys = _node_keys(keys_B, positions_BxT)
        split = jax.vmap(jax.vmap(jax.random.split))(keys)
        uniform_BxT = jax.vmap(jax.vmap(jax.random.uniform))(split[..., 0])
        # u in [0, 1) and a strict `<`: a child with q = 0 is never accepted.
        sample_hit = child_BxTxT & (uniform_BxT[..., None] * total_BxT[..., None]
                                    < cumulative_BxTxT)  # fmt: skip
        residual_q = q_BxTxV
        if residual == "exact":
            residual_q = jnp.where(removed_BxTxV, 0.0, q_BxTxV)
        # All of q on the tried children (rest 0) never reaches the residual draw: a child is
        # accepted for sure; the draw then only needs some mass to stay finite.
        residual_q = jnp.where(rest_BxT[..., None] > 0, residual_q, q_BxTxV)
        residual_BxT = sample_from_probs(
            split[..., 1].reshape(b * t), residual_q.reshape(b * t, v), vocab
        ).reshape(b, t)
        hit_BxTxT = jnp.where(sampling_B[:, None, None], sample_hit, hit_BxTxT)
        final_BxT = jnp.where(sampling_B[:, None], residual_BxT.astype(jnp.int32), argmax_BxT)
    # The first accepted child of every node, -1 if none.
    next_BxT = jnp.where(jnp.any(hit_BxTxT, axis=-1), jnp.argmax(hit_BxTxT, axis=-1), -1)

    def walk(i, carry):
        current, alive, path, count = carry
        nxt = jnp.take_along_axis(next_BxT, current[:, None], axis=1)[:, 0]
        step = alive & (nxt >= 0)
        current = jnp.where(step, nxt, current).astype(jnp.int32)
        return current, step, path.at[:, i].set(current), count + step.astype(jnp.int32)

    zeros = jnp.zeros((b,), jnp.int32)
    start = (zeros, jnp.ones((b,), bool), jnp.zeros((b, t), jnp.int32), zeros)
    last, _, path_BxT, count_B = jax.lax.fori_loop(1, t, walk, start)
    # Emitted slot i is the token chosen at path node i: its child path[i + 1] while i < m,
    # then the correction / bonus token of the last accepted node.
    next_on_path = jnp.concatenate([path_BxT[:, 1:], path_BxT[:, -1:]], axis=1)
    drafted = jnp.take_along_axis(tokens_BxT, next_on_path, axis=1)
    final_B = jnp.take_along_axis(final_BxT, last[:, None], axis=1)
    emitted_BxT = jnp.where(nodes[None, :] < count_B[:, None], drafted, final_B)
    # log_softmax(logits / temperature) at (path node, emitted token), without a [B, T, V] copy.
    scaled_BxTxV = logits / temperature[:, None, None]
    lse_BxT = vocab.logsumexp(scaled_BxTxV)
    columns, inside = vocab.local(scaled_BxTxV, emitted_BxT)
    picked = jnp.take_along_axis(scaled_BxTxV.reshape(b, t * v), path_BxT * v + columns, axis=1)
    logprobs_BxT = vocab.owned(picked, inside) - jnp.take_along_axis(lse_BxT, path_BxT, axis=1)
    return Acceptance(path_BxT, emitted_BxT, logprobs_BxT, count_B)
