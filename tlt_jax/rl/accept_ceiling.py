"""The most any drafter could accept on a policy's samples: a perfect drafter's tokens per
verify step, measured without a drafter.

SD is lossless, so a drafted token t is accepted with probability p(t) under the policy's
sampling distribution p (the coupling behind that rule: the step samples from p and accepts t
exactly when the sample is t). At temperature > 0 no drafter is accepted every time; the best
single guess at a position is the policy's argmax, and a tree whose node has k children (the
sibling walk tries them in turn, each against what the ones before it left) accepts one of
them exactly when the sample is among them. So a perfect chain drafter (depth d, one child
per node) accepts, from a step's first position, the run of following positions whose sample
is the argmax, at most d, and emits one more token (the bonus or the residual's draw); a
perfect tree with k children per node (no budget), the run whose samples are among the top k.

Plain samples of the policy have the distribution SD's output has, so walking them a step at a
time (each step starting where the last ended) measures the ceiling exactly: one forward over
each sampled response gives every position's rank of the sampled token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax.drafter.warmup import length_batches
from tlt_jax.rl.accept_probe import accept_stats


def sample_ranks(model, prompt_ids: Sequence[Sequence[int]],
                 response_ids: Sequence[Sequence[int]], *, k: int,
                 batch_size: int = 8) -> list[np.ndarray]:  # fmt: skip
    """Each response token's rank among the policy's `k` most likely tokens at its position.

    Ranks are 0-based; a token outside the top `k` gets `k`. Ties rank the lower id first, as
    `lax.top_k` (and so every drafter's top-k) does. The ranks do not depend on temperature,
    top-k or top-p filtering: those keep the order of the logits.

    Raises:
      ValueError: for mismatched lists, an empty response or `k < 1`.
    """
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts for {len(response_ids)} responses")
    if k < 1:
        raise ValueError(f"k={k!r} must be >= 1")
    empty = [i for i, r in enumerate(response_ids) if not len(r)]
    if empty:
        raise ValueError(f"responses {empty[:5]} are empty")
    graphdef, weights = nnx.split(model)

    @jax.jit
    def top(weights, tokens_BxT):
        m = nnx.merge(graphdef, weights)
        positions = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
        features, _ = m(tokens_BxT, positions)
        # Position t's logits predict token t + 1.
        return jax.lax.top_k(m.logits(features[:, :-1]), k)[1]

    ranks: list[np.ndarray | None] = [None] * len(prompt_ids)
    for rows, tokens in length_batches(prompt_ids, response_ids, batch_size):
        top_BxTxk = np.asarray(top(weights, jnp.asarray(tokens)))
        for row, i in enumerate(rows):
            p, n = len(prompt_ids[i]), len(response_ids[i])
            predicted = top_BxTxk[row, p - 1 : p - 1 + n]  # [n, k]
            sampled = np.asarray(response_ids[i])[:, None]
            hit = predicted == sampled
            ranks[i] = np.where(hit.any(axis=1), hit.argmax(axis=1), k).astype(np.int32)
    return ranks  # type: ignore[return-value]


def walk(hits: Sequence[bool], depth: int) -> list[int]:
    """Tokens each verify step emits, over one response, for a drafter of `depth` levels
    whose drafts are accepted at exactly the positions `hits` marks.

    A step from position s accepts the run of hits from s (at most `depth`) and emits one
    more token, the bonus or the residual's draw, unless the response ended; the next step
    starts after them.
    """
    if depth < 1:
        raise ValueError(f"depth={depth!r} must be >= 1")
    steps, s, n = [], 0, len(hits)
    while s < n:
        run = 0
        while run < depth and s + run < n and hits[s + run]:
            run += 1
        emitted = min(run + 1, n - s)
        steps.append(emitted)
        s += emitted
    return steps


def ceiling(ranks: Sequence[np.ndarray], depths: Sequence[int],
            widths: Sequence[int]) -> dict[str, Any]:  # fmt: skip
    """A perfect drafter's tokens per verify step (`accept_probe.accept_stats`, requests as
    the samples) for every depth and width (children per node; 1: a chain).

    Returns:
      `{"top{w}_depth{d}": {"accept_len", "accept_len_stderr", "verify_steps"}, ...,
      "top{w}_share": share of positions whose sample is among the top w}`.
    """
    out: dict[str, Any] = {}
    total = sum(len(r) for r in ranks)
    for w in widths:
        hits = [r < w for r in ranks]
        out[f"top{w}_share"] = float(sum(h.sum() for h in hits) / total)
        for d in depths:
            out[f"top{w}_depth{d}"] = accept_stats([walk(h, d) for h in hits])
    return out


def measure(model, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
            *, depths: Sequence[int], widths: Sequence[int]) -> dict[str, Any]:  # fmt: skip
    """`ceiling` of the policy `model`'s sampled responses, over all of them and over the
    longest quarter (the requests that make the long tail).

    Returns:
      `{"responses", "response_tokens", "response_len_mean", "all": ceiling(...),
      "longest_quarter": {"responses", "response_len_mean", **ceiling(...)}}`.
    """
    ranks = sample_ranks(model, prompt_ids, response_ids, k=max(widths))
    lengths = np.array([len(r) for r in ranks])
    longest = [r for r in ranks if len(r) >= np.percentile(lengths, 75)]
    return {
        "responses": len(ranks),
        "response_tokens": int(lengths.sum()),
        "response_len_mean": float(lengths.mean()),
        "all": ceiling(ranks, depths, widths),
        "longest_quarter": {
            "responses": len(longest),
            "response_len_mean": float(np.mean([len(r) for r in longest])),
            **ceiling(longest, depths, widths),
        },
    }
