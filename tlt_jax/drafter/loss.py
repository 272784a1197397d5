"""EAGLE training objective: feature regression plus soft cross-entropy through the policy head.

Dimension legend: B rows, T positions, D model, V vocab.

Alignment (EAGLE): the drafter's input pair at position t is (x[t+1], f[t]) and its target is
f[t+1]. Pair t is trained iff positions t and t+1 lie in the same (non-padding) segment and
token x[t+1] is a response token: exactly the pairs the drafter sees while drafting a response
(the first is (first response token, feature of the last prompt token)).

Loss per trained pair, averaged over the trained pairs of the whole batch (so a packed row
weighs every token equally, like the separate samples concatenated):

    vloss = mean_D SmoothL1_beta=1(g_t - f[t+1])
    ploss = -sum_v softmax(head(f[t+1]))_v * log_softmax(head(g_t))_v   (target: no gradient)
    loss  = vloss_weight * vloss + ploss_weight * ploss

Hot vocabulary. `head` may be the policy head's columns of a hot vocabulary (`[D, U]`, the
ids the engine drafts over, `tlt_jax.drafter.hot_vocab`). Both softmaxes then run over those U
columns, so the drafter matches the target distribution *conditioned on the hot vocabulary*
(a softmax over a subset of logits is the full softmax renormalised on it): exactly what a
hot-vocabulary draft head proposes from. It cuts the two [tokens, V] head products of a step
by V / U (24x for SmolLM2 at U = 2,048), which dominate a drafter step; verification keeps the
full vocabulary, so decoding stays lossless whatever the drafter learned.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class EagleInputs(NamedTuple):
    """Shifted drafter inputs and targets of a (packed) batch."""

    tokens_BxT: jax.Array  # int32, x[t+1] (0 where t+1 leaves the segment)
    features_BxTxD: jax.Array  # f[t]
    targets_BxTxD: jax.Array  # f[t+1] (0 where t+1 leaves the segment)
    loss_mask_BxT: jax.Array  # bool, pair t is trained


def eagle_inputs(
    tokens_BxT: jax.Array,
    features_BxTxD: jax.Array,
    loss_mask_BxT: jax.Array,
    segment_ids_BxT: jax.Array,
) -> EagleInputs:
    """Builds the EAGLE pairs (x[t+1], f[t]) -> f[t+1] without crossing segment boundaries.

    Args:
      tokens_BxT: token ids of the (packed) rows.
      features_BxTxD: the policy's final-norm features at the same positions.
      loss_mask_BxT: True where the token is a response token.
      segment_ids_BxT: sample id per position, 0 for padding.

    Returns:
      `EagleInputs`; the drafter runs at the original positions and segment ids.
    """
    same_BxT = (segment_ids_BxT[:, :-1] == segment_ids_BxT[:, 1:]) & (segment_ids_BxT[:, :-1] > 0)
    same_BxT = jnp.pad(same_BxT, ((0, 0), (0, 1)))
    next_tokens = jnp.pad(tokens_BxT[:, 1:], ((0, 0), (0, 1)))
    next_features = jnp.pad(features_BxTxD[:, 1:], ((0, 0), (0, 1), (0, 0)))
    next_mask = jnp.pad(loss_mask_BxT[:, 1:], ((0, 0), (0, 1)))
    return EagleInputs(
        tokens_BxT=jnp.where(same_BxT, next_tokens, 0).astype(jnp.int32),
        features_BxTxD=features_BxTxD,
        targets_BxTxD=jnp.where(same_BxT[..., None], next_features, 0),
        loss_mask_BxT=same_BxT & next_mask.astype(bool),
    )


def smooth_l1(x: jax.Array, beta: float = 1.0) -> jax.Array:
    """Elementwise SmoothL1 (Huber / beta): 0.5 x^2 / beta inside |x| < beta, |x| - beta/2 out."""
    a = jnp.abs(x)
    return jnp.where(a < beta, 0.5 * a * a / beta, a - 0.5 * beta)


def _per_token_losses(
    g_NxD: jax.Array, target_NxD: jax.Array, head_DxV: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(vloss_N, ploss_N, correct_N) for N flat positions, all float32."""
    g32 = g_NxD.astype(jnp.float32)
    target32 = jax.lax.stop_gradient(target_NxD).astype(jnp.float32)
    vloss_N = jnp.mean(smooth_l1(g32 - target32), axis=-1)
    head = jax.lax.stop_gradient(head_DxV).astype(g_NxD.dtype)
    draft_logits_NxV = jnp.einsum("ND,DV->NV", g_NxD, head, preferred_element_type=jnp.float32)
    target_logits_NxV = jnp.einsum(
        "ND,DV->NV", target_NxD.astype(head.dtype), head, preferred_element_type=jnp.float32
    )
    target_probs_NxV = jax.lax.stop_gradient(jax.nn.softmax(target_logits_NxV, axis=-1))
    ploss_N = -jnp.sum(target_probs_NxV * jax.nn.log_softmax(draft_logits_NxV, axis=-1), axis=-1)
    correct_N = jnp.argmax(draft_logits_NxV, -1) == jnp.argmax(target_logits_NxV, -1)
    return vloss_N, ploss_N, correct_N.astype(jnp.float32)


def eagle_loss(
    g_BxTxD: jax.Array,
    targets_BxTxD: jax.Array,
    loss_mask_BxT: jax.Array,
    head_DxV: jax.Array,
    *,
    vloss_weight: float = 1.0,
    ploss_weight: float = 0.1,
    token_chunk: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """EAGLE loss, masked mean over the trained pairs.

    Args:
      g_BxTxD: drafter outputs (predicted f[t+1]).
      targets_BxTxD: the policy's features f[t+1] (no gradient).
      loss_mask_BxT: which pairs count (`eagle_inputs(...).loss_mask_BxT`).
      head_DxV: the policy's LM head (frozen), or its hot-vocabulary columns `[D, U]`.
      vloss_weight: weight of the SmoothL1 feature loss.
      ploss_weight: weight of the soft cross-entropy.
      token_chunk: if set, the [positions, V] logits are computed `token_chunk` positions at
        a time under rematerialisation, bounding memory for large vocabularies.

    Returns:
      (loss, metrics) with metrics `loss`, `vloss`, `ploss`, `accuracy` (draft argmax ==
      target argmax, both over `head_DxV`'s columns: with a hot head, among the hot tokens,
      which counts a position whose policy argmax is a cold token the drafter cannot propose
      as agreeing when the hot argmaxes agree, so it overstates what drafts can accept by up to
      the hot set's missing coverage) and `tokens` (number of trained pairs), all float32
      scalars.
    """
    b, t, d = g_BxTxD.shape
    n = b * t
    g_NxD = g_BxTxD.reshape(n, d)
    target_NxD = targets_BxTxD.reshape(n, d)
    mask_N = loss_mask_BxT.reshape(n).astype(jnp.float32)
    if token_chunk is None or token_chunk >= n:
        vloss_N, ploss_N, correct_N = _per_token_losses(g_NxD, target_NxD, head_DxV)
    else:
        chunks = -(-n // token_chunk)
        pad = chunks * token_chunk - n
        g_CxKxD = jnp.pad(g_NxD, ((0, pad), (0, 0))).reshape(chunks, token_chunk, d)
        target_CxKxD = jnp.pad(target_NxD, ((0, pad), (0, 0))).reshape(chunks, token_chunk, d)
        per_chunk = jax.checkpoint(lambda xs: _per_token_losses(xs[0], xs[1], head_DxV))
        outs = jax.lax.map(per_chunk, (g_CxKxD, target_CxKxD))
        vloss_N, ploss_N, correct_N = (o.reshape(-1)[:n] for o in outs)
    tokens = jnp.sum(mask_N)
    denominator = jnp.maximum(tokens, 1.0)
    vloss = jnp.sum(vloss_N * mask_N) / denominator
    ploss = jnp.sum(ploss_N * mask_N) / denominator
    accuracy = jnp.sum(correct_N * mask_N) / denominator
    loss = vloss_weight * vloss + ploss_weight * ploss
    metrics = {"loss": loss, "vloss": vloss, "ploss": ploss, "accuracy": accuracy, "tokens": tokens}
    return loss, metrics
