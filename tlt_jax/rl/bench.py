"""RL step benchmark: phase breakdown, rollout share, long tail, rollout vs plain decoding."""

from __future__ import annotations

import dataclasses
import platform
import tempfile
import time
from typing import Any

import numpy as np

from tlt_jax.metrics.timing import PHASES
from tlt_jax.rl.config import TrainConfig
from tlt_jax.rl.trainer import Trainer
from tlt_jax.rollout.engine import Request


def _mean(records: list[dict], key: str) -> float:
    return float(np.mean([float(r[key]) for r in records]))


def bench_rl_step(config: Any, *, steps: int = 3, warmup: int = 1) -> dict[str, Any]:
    """Runs `warmup + steps` RL steps in a temporary workdir; returns the measurements.

    Args:
      config: a `TrainConfig` or `ConfigDict` (its `total_steps` is ignored).
      steps: measured steps (their means are reported).
      warmup: steps run first to compile every program; not measured.

    Returns:
      A JSON-serialisable dict: `step_time_s`, `phase_s`, `phase_share`, `rollout_share`,
      `long_tail_share`, `rollout_tokens_per_s`, `plain_decode_tokens_per_s`,
      `rollout_vs_plain`, sizes, compile counts and `per_step` records.
    """
    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_config_dict(config)
    with tempfile.TemporaryDirectory(prefix="bench_rl_step_") as workdir:
        trainer = Trainer(cfg, workdir, progress=False)
        try:
            precompile = trainer.precompile()
            records = []
            for _ in range(warmup + steps):
                records.append(trainer.run_step(next(trainer.iterator)))
            measured = records[warmup:]
            plain = _plain_decode(trainer, next(trainer.iterator))
        finally:
            trainer.close()
    step_time = _mean(measured, "step_time")
    phase_s = {p: _mean(measured, f"time_{p}") for p in PHASES}
    rollout_tps = _mean(measured, "tokens_per_s")
    return {
        "config": cfg.to_dict(),
        "model": cfg.model.name or cfg.model.preset,
        "batch": {"prompts": cfg.rl.prompts_per_step, "group_size": cfg.rl.group_size,
                  "sequences": cfg.rl.batch_size, "micro_batch": cfg.rl.micro_batch_size},
        "lengths": {"max_new_tokens": cfg.rollout.max_new_tokens,
                    "max_prompt_len": cfg.rollout.max_prompt_len,
                    "response_len_mean": _mean(measured, "response_len_mean"),
                    "response_len_p90": _mean(measured, "response_len_p90"),
                    "response_len_max": max(r["response_len_max"] for r in measured)},
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "steps_measured": steps,
        "warmup_steps": warmup,
        "step_time_s": step_time,
        "phase_s": phase_s,
        "phase_share": {p: s / step_time for p, s in phase_s.items()},
        "rollout_share": phase_s["rollout"] / step_time,
        "long_tail_share": _mean(measured, "long_tail_share"),
        "rollout_tokens_per_s": rollout_tps,
        "plain_decode_tokens_per_s": plain,
        "rollout_vs_plain": rollout_tps / plain if plain else None,
        "update_padding_share": _mean(measured, "update_padding_share"),
        "update_s_per_real_token": _update_s_per_token(measured),
        "compile_in_measured_steps": sum(r["compile_count"] for r in measured),
        "precompile": precompile,
        "per_step": [{k: v for k, v in r.items() if k != "response_lengths"} for r in records],
    }  # fmt: skip


def _update_s_per_token(records: list[dict]) -> float:
    """Update seconds per generated (real) response token, over the records."""
    tokens = sum(r["generated_tokens"] for r in records)
    return sum(r["time_update"] for r in records) / tokens if tokens else 0.0


def bench_update_layouts(
    config: Any, *, steps: int = 2, warmup: int = 1, layouts: tuple[str, ...] = ("padded", "packed")
) -> dict[str, Any]:
    """`bench_update_sides` with one side per `rl.update_layout` (named after the layout)."""
    out = bench_update_sides(config, steps=steps, warmup=warmup,
                             sides=tuple((x, {"update_layout": x}) for x in layouts))  # fmt: skip
    out["layouts"] = out.pop("sides")
    return out


def bench_update_sides(config: Any, *, sides: tuple[tuple[str, dict[str, Any]], ...],
                       steps: int = 2, warmup: int = 1) -> dict[str, Any]:  # fmt: skip
    """The same RL steps under several `rl` settings (e.g. update layouts, remat on and off),
    side by side in one process.

    One trainer per side (`(name, rl overrides)`), same seeds and prompts; every step runs in
    all of them, the order rotating step by step. Rollouts are plain (`spec.mode=off`): the
    update's settings change nothing there, and TLT's bandit picks arms by wall-clock time, so
    SD would draw other samples on each side. The first step's rollouts are then identical
    (same weights, same request seeds; checked in `first_step_identical`), later ones differ
    only through the sides' float rounding in the update.

    Returns:
      Per side the mean step and phase seconds, `update_padding_share`,
      `update_s_per_real_token` and the per-step records; `ratios` of the first side's
      seconds over each other's (update, logprob, step) with their min/max over steps.
    """
    base = config if isinstance(config, TrainConfig) else TrainConfig.from_config_dict(config)
    names = tuple(name for name, _ in sides)
    if len(set(names)) != len(names) or len(names) < 2:
        raise ValueError(f"sides {list(names)}: expected two or more distinct names")
    records: dict[str, list[dict]] = {name: [] for name in names}
    spec = dataclasses.replace(base.spec, mode="off")
    # Every side's config is checked before the first trainer loads anything.
    configs = {name: dataclasses.replace(base, rl=dataclasses.replace(base.rl, **overrides),
                                         spec=spec) for name, overrides in sides}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench_update_") as root:
        trainers = {}
        try:
            for name, cfg in configs.items():
                trainers[name] = Trainer(cfg, f"{root}/{len(trainers)}", progress=False)
                trainers[name].precompile()
            for i in range(warmup + steps):
                examples = next(trainers[names[0]].iterator)
                for name in names[1:]:
                    next(trainers[name].iterator)
                order = names[i % len(names) :] + names[: i % len(names)]
                for name in order:
                    records[name].append(trainers[name].run_step(examples))
        finally:
            for trainer in trainers.values():
                trainer.close()
    first_lengths = [recs[0]["response_lengths"] for recs in records.values()]
    out: dict[str, Any] = {"config": base.to_dict(), "sides": list(names),
                           "overrides": {name: dict(o) for name, o in sides},
                           "steps_measured": steps, "warmup_steps": warmup,
                           "first_step_identical": all(x == first_lengths[0]
                                                       for x in first_lengths)}  # fmt: skip
    keys = ("time_update", "time_logprob", "step_time")
    for name, recs in records.items():
        measured = recs[warmup:]
        out[name] = {
            **{k: _mean(measured, k) for k in keys},
            **{f"time_{p}": _mean(measured, f"time_{p}") for p in PHASES},
            "update_padding_share": _mean(measured, "update_padding_share"),
            "update_tokens_computed": _mean(measured, "update_tokens_computed"),
            "update_s_per_real_token": _update_s_per_token(measured),
            "micro_batches_trained": _mean(measured, "micro_batches_trained"),
            "per_step": [{k: v for k, v in r.items() if k != "response_lengths"} for r in recs],
        }
    first = records[names[0]][warmup:]
    out["ratios"] = {}
    for name in names[1:]:
        for k in keys:
            per_step = [a[k] / b[k] for a, b in zip(first, records[name][warmup:], strict=True)]
            out["ratios"][f"{k}_{names[0]}_over_{name}"] = {
                "mean": sum(a[k] for a in first) / sum(b[k] for b in records[name][warmup:]),
                "min": min(per_step), "max": max(per_step),
            }  # fmt: skip
    return out


def _plain_decode(trainer: Trainer, examples: list[dict]) -> float:
    """Generated tokens/s of the same engine on the same kind of batch, every request running
    to `max_new_tokens` (no stop ids: no early finishes, no long tail). The first pass
    compiles any missing shape; the second is timed."""
    cfg = trainer.config
    g = cfg.rl.group_size
    requests = [Request(trainer.encode(ex["question"]), cfg.rollout.max_new_tokens,
                        trainer.sampling, (), seed=i * g + j)
                for i, ex in enumerate(examples) for j in range(g)]  # fmt: skip
    trainer.engine.generate(requests, progress=False)
    start = time.perf_counter()
    out = trainer.engine.generate(requests, progress=False)
    seconds = time.perf_counter() - start
    return sum(len(c.token_ids) for c in out) / seconds
