"""Spot training, measured: what drafter steps on the idle slice cost the straggler, and how
much of the idle time they reclaim (`scripts/bench_spot.py`).

One run, side by side: the trainer's real rollout slices decode the same requests (same seeds,
plain decoding, so both sides do the same decode work and write the same tokens) with spot
training off and on, alternating which side goes first, `rounds` times. Before the rounds, one
rollout and the log-prob recompute fill the drafter buffer (the features the RL step computes
anyway); there is no policy update, so only the rollout phase is compared.

Figures:
- `straggler_slowdown`: median straggler decode seconds (the slice that finishes last) with
  spot training on / off - 1, with every round's ratio; the goal is <= 0.02.
- `reclaimed_idle_share`: idle slice-seconds spent inside drafter steps (goal >= 0.8).
- `preemption_latency_s` against `drafter_step_s` (goal: at most one drafter step), over the
  rounds whose trainer was preempted (`preempted_windows_per_round`; a trainer that ran out of
  data before the rollout's end has no latency); None when none was.
- `tokens_identical`: both sides wrote the same tokens (spot training changes no rollout).

On a CPU, run it as two processes pinned one per core (`scripts/launch_local.py
--pin_cores`): in one process the slices share both cores' thread pool, so the idle slice's
drafter steps take compute from the straggler by construction.
"""

from __future__ import annotations

import dataclasses
import shlex
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from tlt_jax.metrics import timing
from tlt_jax.rl.config import TrainConfig


def bench_config(config: TrainConfig, slices: int) -> TrainConfig:
    """The run's config with spot training on `slices` slices and plain decoding."""
    return dataclasses.replace(
        config,
        spot=dataclasses.replace(config.spot, enabled=True, slices=slices),
        spec=dataclasses.replace(config.spec, mode="off"),
    )


def reproducing_command(argv: list[str], env: dict[str, str]) -> str:
    """The command line that reproduces this run: `python` + `argv`, under the launcher that
    started the processes (`TLT_LAUNCHER`, set by `scripts/launch_local.py` with its flags),
    or with the `XLA_FLAGS` a one-process run gets its two CPU devices from."""
    command = "python " + " ".join(argv)
    if env.get("TLT_LAUNCHER"):
        return f"{env['TLT_LAUNCHER']} -- {command}"
    if env.get("XLA_FLAGS"):
        return f"XLA_FLAGS={shlex.quote(env['XLA_FLAGS'])} {command}"
    return command


def bench_spot(config: TrainConfig, workdir: str | Path, *, rounds: int = 3) -> dict[str, Any]:
    """Runs the comparison (every process of the run calls it); returns the figures."""
    from tlt_jax.rl.trainer import Trainer

    start = time.perf_counter()
    trainer = Trainer(config, workdir, progress=False)
    group = trainer.group
    try:
        examples = next(trainer.iterator)
        prompts, requests = trainer.make_requests(examples, step=1)
        completions, _ = trainer.rollout(requests, step=1, spot=False)
        trainer.recompute_features(prompts, completions, step=1)
        trainer.rollouts.precompile_drafter()
        sides: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        tokens: dict[str, list] = {}
        key = 1
        for r in range(rounds):
            for side in timing.side_order(("off", "on"), r):
                key += 1
                group.barrier(f"bench_spot/{key}")  # every process starts together
                comps, stats = trainer.rollout(requests, step=key, spot=side == "on")
                finish = [t for s in stats for t in s["spot"]["slice_finish_s"]]
                sides[side].append({"straggler_s": max(finish), **stats_sum(stats)})
                tokens.setdefault(side, [c.token_ids for c in comps])
        off = [s["straggler_s"] for s in sides["off"]]
        on = [s["straggler_s"] for s in sides["on"]]
        ratios = [b / a - 1.0 for a, b in zip(off, on, strict=True)]
        steps = [s["spot_drafter_steps"] for s in sides["on"]]
        latency = [s["preemption_latency_s"] for s in sides["on"]
                   if s["preemption_latency_s"] is not None]  # fmt: skip
        lengths = [len(t) for t in tokens["off"]]
        result = {
            "processes": group.count,
            "slices": config.spot.slices,
            "rounds": rounds,
            "requests": len(requests),
            "response_len": {"median": float(np.median(lengths)), "max": max(lengths)},
            "straggler_s_off": off,
            "straggler_s_on": on,
            "straggler_slowdown": statistics.median(on) / statistics.median(off) - 1.0,
            "straggler_slowdown_per_round": ratios,
            "reclaimed_idle_share": timing.spread([s["reclaimed"] for s in sides["on"]]),
            "idle_slice_s": timing.spread([s["idle_slice_s"] for s in sides["on"]]),
            "drafter_steps_per_round": steps,
            "dropped_steps_per_round": [s["spot_dropped_steps"] for s in sides["on"]],
            "preempted_windows_per_round": [s["spot_preempted_windows"] for s in sides["on"]],
            "drafter_step_s": timing.spread([s["drafter_step_s"] for s in sides["on"]
                                             if s["drafter_step_s"]]) if any(steps) else None,
            "preemption_latency_s": timing.spread(latency) if latency else None,
            "tokens_identical": tokens["on"] == tokens["off"],
            "devices": [str(d) for d in jax.local_devices()],
            "wall_s": time.perf_counter() - start,
        }  # fmt: skip
    finally:
        trainer.close()
    return result


def stats_sum(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Spot figures of one rollout summed over the processes' `rollout_stats`."""
    spots = [s["spot"] for s in stats]
    idle = sum(m["spot_idle_slice_s"] for m in spots)
    training = sum(m["spot_training_s"] for m in spots)
    step_s = [m["spot_drafter_step_s"] for m in spots if "spot_drafter_step_s" in m]
    latency = [m["spot_preemption_latency_s"] for m in spots if "spot_preemption_latency_s" in m]
    return {
        "idle_slice_s": idle,
        "reclaimed": training / idle if idle > 0 else 0.0,
        "spot_drafter_steps": sum(m["spot_drafter_steps"] for m in spots),
        "spot_dropped_steps": sum(m["spot_dropped_steps"] for m in spots),
        "spot_preempted_windows": sum(m["spot_preempted_windows"] for m in spots),
        "drafter_step_s": max(step_s) if step_s else None,
        "preemption_latency_s": max(latency) if latency else None,
    }
