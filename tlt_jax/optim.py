"""The optimizer both trainers use (policy and drafter): warm-up + decay schedule, AdamW with
weight decay on matrices only, after global-norm clipping."""

from __future__ import annotations

import jax
import optax

SCHEDULES = ("constant", "cosine", "linear")


def learning_rate_schedule(
    peak: float, *, schedule: str, warmup_steps: int, total_steps: int, end_lr_ratio: float
) -> optax.Schedule:
    """Linear warm-up from 0, then constant, cosine or linear decay to `peak * end_lr_ratio`
    at `total_steps` (warm-up included)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {list(SCHEDULES)}")
    decay_steps = max(total_steps - warmup_steps, 1)
    if schedule == "constant":
        main = optax.constant_schedule(peak)
    elif schedule == "cosine":
        main = optax.cosine_decay_schedule(peak, decay_steps, alpha=end_lr_ratio)
    else:
        main = optax.linear_schedule(peak, peak * end_lr_ratio, decay_steps)
    if warmup_steps == 0:
        return main
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warmup_steps), main], [warmup_steps]
    )


def _decay_mask(params):
    # Weight decay on matrices only: not on norms or biases.
    def decays(path, _):
        name = jax.tree_util.keystr(path)
        return "norm" not in name and "bias" not in name

    return jax.tree_util.tree_map_with_path(decays, params)


def adamw(
    schedule: optax.Schedule,
    *,
    b1: float,
    b2: float,
    weight_decay: float,
    grad_clip: float,
    eps: float = 1e-8,
) -> optax.GradientTransformation:
    """AdamW (decay on matrices only) after global-norm clipping (`grad_clip` 0 disables it)."""
    opt = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                      mask=_decay_mask)  # fmt: skip
    if grad_clip == 0:
        return opt
    return optax.chain(optax.clip_by_global_norm(grad_clip), opt)
