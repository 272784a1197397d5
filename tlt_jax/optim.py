"""The optimizer both trainers use (policy and drafter): one config (`OptimConfig`, the RL
run's `optim` group and the drafter trainer's `optim` field), warm-up + decay schedule, AdamW
with weight decay on matrices only, after global-norm clipping."""

from __future__ import annotations

import dataclasses
import math

import jax
import optax

SCHEDULES = ("constant", "cosine", "linear")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW after global-norm clipping, with a schedule (errors name `optim.<field>`).

    `schedule`: `constant` (after linear warm-up), `cosine` (warm-up then cosine decay to
    `end_lr_ratio * learning_rate` at the trainer's horizon: the RL run's optimizer updates,
    the drafter's `total_steps`) or `linear` (the same, decaying linearly). `grad_clip` 0
    disables clipping; weight decay applies to matrices only.
    """

    learning_rate: float = 1e-6
    schedule: str = "constant"
    warmup_steps: int = 0
    end_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0

    def __post_init__(self):
        def number(name: str, low: float, high: float | None = None, *, open_high=False):
            value = getattr(self, name)
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            ok = ok and math.isfinite(value) and value >= low
            if high is not None:
                ok = ok and (value < high if open_high else value <= high)
            bound = "" if high is None else f" and {'<' if open_high else '<='} {high}"
            _check(ok, f"optim.{name}={value!r} must be a finite number >= {low}{bound}")

        number("learning_rate", 0.0)
        _check(self.schedule in SCHEDULES,
               f"optim.schedule={self.schedule!r} is not one of {list(SCHEDULES)}")  # fmt: skip
        w = self.warmup_steps
        _check(isinstance(w, int) and not isinstance(w, bool) and w >= 0,
               f"optim.warmup_steps={w!r} must be an integer >= 0")  # fmt: skip
        number("b1", 0.0, 1.0, open_high=True)
        number("b2", 0.0, 1.0, open_high=True)
        number("end_lr_ratio", 0.0, 1.0)
        for name in ("eps", "weight_decay", "grad_clip"):
            number(name, 0.0)

    def schedule_fn(self, total_steps: int) -> optax.Schedule:
        """The learning rate by optimizer step, over a horizon of `total_steps` steps."""
        return learning_rate_schedule(
            self.learning_rate, schedule=self.schedule, warmup_steps=self.warmup_steps,
            total_steps=total_steps, end_lr_ratio=self.end_lr_ratio,
        )  # fmt: skip

    def optimizer(self, total_steps: int) -> optax.GradientTransformation:
        """AdamW on `schedule_fn(total_steps)`."""
        return adamw(self.schedule_fn(total_steps), b1=self.b1, b2=self.b2, eps=self.eps,
                     weight_decay=self.weight_decay, grad_clip=self.grad_clip)  # fmt: skip


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
