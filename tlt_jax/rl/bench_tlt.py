"""TLT vs plain RL steps, side by side: the whole step, reward and sync included.

Two trainers of the same config, same seeds and prompts: one with `spec.mode=off` (plain
rollouts), one with TLT's adaptive rollouts (`spec.mode=adaptive`, the config's drafter or
model-free drafts). Both start from the same weights. The TLT trainer resolves the SD threshold
first (calibration); the plain one counts its long tail at the same threshold.

1. Greedy rollouts of the same requests on both engines at the initial weights: the tokens are
   identical (checked), so the ratios are exact (`*_greedy`).
2. RL steps at the config's temperature, alternating which side runs first, after `warmup`
   steps each. With `same_policy` (the default) every step starts both sides from the same
   policy: the TLT trainer takes a copy of the plain trainer's train state (params and
   optimizer state) before the step. Each request then samples from the same distribution
   with the same seed on both sides, and SD's acceptance draws from the same per-position key
   streams as plain sampling, so most responses come out the same (`equal_length_share`
   says how many) and the two updates train on nearly the same tokens: the step ratio
   measures the rollout engines, not two policies that parted after the first update (what
   `same_policy=False` measures, each side on its own trajectory). Sampled ratios are the
   mean and spread of per-step ratios.

Memory: both trainers (engine, train state, programs) live in one process; on the default
SmolLM2 config that is ~15 GB resident, so give the run the machine to itself on 24 GB.

Ratios are plain / TLT: `rollout_speedup`, `long_tail_speedup` (decode seconds with at most
`threshold` requests running), `step_speedup`, `rollout_per_token_speedup` (rollout seconds
per generated token, which the sides' different sampled lengths do not move); plus
`accept_len_*` per draft source, `sd_step_share`, `long_tail_share` and
`ceiling_step_speedup` (the plain step if its tail cost nothing: step / (step - tail
seconds), from the measured split).
"""

from __future__ import annotations

import dataclasses
import platform
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.metrics import timing
from tlt_jax.metrics.timing import PHASES
from tlt_jax.rl import policy
from tlt_jax.rl.config import TrainConfig
from tlt_jax.rl.trainer import Trainer
from tlt_jax.rollout.engine import Request
from tlt_jax.rollout.sampling import SamplingParams


def _scaled(cfg: TrainConfig, multiplier: int) -> TrainConfig:
    prompts = cfg.rl.prompts_per_step * multiplier
    rl = dataclasses.replace(cfg.rl, prompts_per_step=prompts)
    rollout = dataclasses.replace(cfg.rollout, max_batch_size=max(cfg.rollout.max_batch_size,
                                                                  rl.batch_size))  # fmt: skip
    return dataclasses.replace(cfg, rl=rl, rollout=rollout)


def _greedy(trainers: dict[str, Trainer], examples: list[dict], repeats: int, threshold: int):
    """Times the same greedy requests on both engines (alternating; the first run of each
    compiles); returns per-side best seconds, tail seconds and whether tokens matched."""
    any_trainer = next(iter(trainers.values()))
    cfg = any_trainer.config
    g = cfg.rl.group_size
    requests = [Request(any_trainer.encode(ex["question"]), cfg.rollout.max_new_tokens,
                        SamplingParams(), any_trainer.stop_ids, seed=i * g + j)
                for i, ex in enumerate(examples) for j in range(g)]  # fmt: skip
    out: dict[str, dict[str, Any]] = {name: {"s": [], "tail_s": []} for name in trainers}
    tokens = {}
    for repeat in range(repeats + 1):
        for name in timing.side_order(trainers, repeat):
            engine = trainers[name].engine
            start = time.perf_counter()
            done = engine.generate(requests, progress=False)
            seconds = time.perf_counter() - start
            tokens[name] = [c.token_ids for c in done]
            if repeat:  # the first pass compiles
                out[name]["s"].append(seconds)
                out[name]["tail_s"].append(
                    timing.tail_stats(engine.stats.timeline, threshold)["long_tail_s"]
                )
    identical = tokens["plain"] == tokens["tlt"]
    result = {name: {"rollout_s": min(v["s"]), "long_tail_s": min(v["tail_s"]),
                     "rollout_s_runs": v["s"], "long_tail_s_runs": v["tail_s"]}
              for name, v in out.items()}  # fmt: skip
    return result, identical, sum(len(t) for t in tokens["plain"])


def _adopt_policy(dst: Trainer, src: Trainer) -> None:
    """`dst` continues from `src`'s train state (copied: updates donate their buffers) and
    pushes the params to its engines."""
    dst.state = jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x,
                             src.state)  # fmt: skip
    dst.sync_weights()


@jax.jit
def _abs_sum(params) -> jax.Array:
    return sum(jnp.sum(jnp.abs(x.astype(jnp.float32))) for x in jax.tree.leaves(params))


def _digest(trainer: Trainer) -> float:
    """The sum of |param| over the policy, computed where the params live (one scalar comes
    back, not a 7B model): equal on two sides that hold the same params."""
    return float(_abs_sum(trainer.state.params))


def _ratio_stats(plain: list[float], tlt: list[float]) -> dict | None:
    """Plain / TLT of each pair of runs (a pair whose TLT figure is 0, e.g. no long tail, has
    no ratio) as `timing.spread`; None when no pair has one (NaN is not JSON)."""
    ratios = [p / t for p, t in zip(plain, tlt, strict=True) if t > 0]
    return timing.spread(ratios) if ratios else None


def bench_one(cfg: TrainConfig, *, steps: int, warmup: int, greedy_repeats: int,
              same_policy: bool = True) -> dict[str, Any]:  # fmt: skip
    """Both sides at one batch size (module docstring)."""
    tlt_cfg = cfg if cfg.spec.mode != "off" else dataclasses.replace(
        cfg, spec=dataclasses.replace(cfg.spec, mode="adaptive"))  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench_tlt_") as workdir:
        trainers: dict[str, Trainer] = {}
        try:
            trainers["tlt"] = Trainer(tlt_cfg, f"{workdir}/tlt", progress=False)
            threshold = trainers["tlt"].threshold
            # The TLT side's resolved threshold (its calibration file would only be ignored,
            # with a warning).
            plain_spec = dataclasses.replace(
                tlt_cfg.spec, mode="off", threshold=max(threshold, 1), calibration_file=""
            )
            plain_cfg = dataclasses.replace(cfg, spec=plain_spec)
            trainers["plain"] = Trainer(plain_cfg, f"{workdir}/plain", progress=False)
            trainers = {"plain": trainers["plain"], "tlt": trainers["tlt"]}
            for trainer in trainers.values():
                trainer.precompile()
            probe = next(trainers["plain"].iterator)
            assert probe == next(trainers["tlt"].iterator), "the two sides drew other prompts"
            greedy, identical, greedy_tokens = _greedy(trainers, probe, greedy_repeats, threshold)
            records: dict[str, list[dict]] = {"plain": [], "tlt": []}
            for k in range(warmup + steps):
                examples = {name: next(t.iterator) for name, t in trainers.items()}
                assert examples["plain"] == examples["tlt"], "the two sides drew other prompts"
                if same_policy and k:  # both start every step from the plain side's policy
                    _adopt_policy(trainers["tlt"], trainers["plain"])
                digests = {name: _digest(t) for name, t in trainers.items()}
                for name in timing.side_order(trainers, k):
                    record = trainers[name].run_step(examples[name])
                    if k >= warmup:
                        records[name].append({**record, "policy_digest": digests[name]})
            timelines = {name: t._last_timeline for name, t in trainers.items()}
            calibration = trainers["tlt"].workdir / policy.CALIBRATION_FILE
            calibration = calibration.read_text() if calibration.is_file() else None
        finally:
            for trainer in trainers.values():
                trainer.close()

    def series(name: str, key: str) -> list[float]:
        return [float(r.get(key, 0.0)) for r in records[name]]

    def mean(name: str, key: str) -> float:
        return float(np.mean(series(name, key)))

    plain_step, plain_tail = mean("plain", "step_time"), mean("plain", "long_tail_s")
    equal_lengths = [float(np.mean(np.equal(p["response_lengths"], t["response_lengths"])))
                     for p, t in zip(records["plain"], records["tlt"], strict=True)]  # fmt: skip
    sources = sorted({k for r in records["tlt"] for k in r if k.startswith("accept_len_")})
    choices: dict[str, int] = {}
    for r in records["tlt"]:
        for arm, n in r["sd_choices"].items():
            choices[arm] = choices.get(arm, 0) + n
    return {
        "batch": {"prompts": cfg.rl.prompts_per_step, "group_size": cfg.rl.group_size,
                  "sequences": cfg.rl.batch_size},
        "threshold": threshold,
        "calibration": calibration,
        "same_policy": same_policy,
        # Per measured step: the share of requests whose responses have the same length on
        # both sides (with `same_policy`, most are the same response).
        "equal_length_share": equal_lengths,
        "greedy": {**greedy, "tokens_identical": identical, "tokens": greedy_tokens,
                   "rollout_speedup_greedy": greedy["plain"]["rollout_s"]
                   / greedy["tlt"]["rollout_s"],
                   "long_tail_speedup_greedy": greedy["plain"]["long_tail_s"]
                   / max(greedy["tlt"]["long_tail_s"], 1e-9),
                   # Per repeat (the two sides of a repeat ran back to back).
                   "rollout_speedup_greedy_runs": _ratio_stats(
                       greedy["plain"]["rollout_s_runs"], greedy["tlt"]["rollout_s_runs"]),
                   "long_tail_speedup_greedy_runs": _ratio_stats(
                       greedy["plain"]["long_tail_s_runs"], greedy["tlt"]["long_tail_s_runs"])},
        "phase_s": {name: {p: mean(name, f"time_{p}") for p in PHASES} for name in records},
        "step_time_s": {name: mean(name, "step_time") for name in records},
        "rollout_speedup": _ratio_stats(series("plain", "time_rollout"),
                                        series("tlt", "time_rollout")),
        "long_tail_speedup": _ratio_stats(series("plain", "long_tail_s"),
                                          series("tlt", "long_tail_s")),
        "step_speedup": _ratio_stats(series("plain", "step_time"), series("tlt", "step_time")),
        # Both sides' updates over the same tokens (`same_policy`) cost the same: this ratio's
        # distance from 1 is the run's noise plus the responses that differ.
        "update_speedup": _ratio_stats(series("plain", "time_update"),
                                       series("tlt", "time_update")),
        # Programs compiled inside a measured step (a new packed row count, a new cache
        # bucket) cost once per run; a long run amortizes them, a 3-step one does not.
        "step_speedup_excluding_compiles": _ratio_stats(
            [t - c for t, c in zip(series("plain", "step_time"), series("plain", "compile_s"),
                                   strict=True)],
            [t - c for t, c in zip(series("tlt", "step_time"), series("tlt", "compile_s"),
                                   strict=True)]),
        "compile_s": {name: series(name, "compile_s") for name in records},
        # Sampled lengths differ between the sides; rollout seconds per generated token do not
        # depend on how long the answers happened to be.
        "rollout_per_token_speedup": _ratio_stats(
            [t / max(n, 1) for t, n in zip(series("plain", "time_rollout"),
                                           series("plain", "generated_tokens"), strict=True)],
            [t / max(n, 1) for t, n in zip(series("tlt", "time_rollout"),
                                           series("tlt", "generated_tokens"), strict=True)],
        ),  # fmt: skip
        "ceiling_step_speedup": plain_step / max(plain_step - plain_tail, 1e-9),
        "long_tail_share": mean("plain", "long_tail_share"),
        # The run's ratios over the measured steps (SD steps over decode steps, tokens per
        # SD row): a step without SD of a source is no acceptance length of 0.
        "sd_step_share": timing.pooled_sd_step_share(records["tlt"]),
        **{k: timing.pooled_accept_len(records["tlt"], k.removeprefix("accept_len_"))
           for k in sources},
        "sd_choices": choices,
        "generated_tokens": {name: mean(name, "generated_tokens") for name in records},
        "response_len_p50": {name: mean(name, "response_len_p50") for name in records},
        "response_len_max": {name: max(series(name, "response_len_max")) for name in records},
        "reward_mean": {name: mean(name, "reward_mean") for name in records},
        "per_step": {name: [{k: v for k, v in r.items() if k != "response_lengths"}
                            for r in rs] for name, rs in records.items()},
        "last_timeline": timelines,
        "response_lengths": {name: [r["response_lengths"] for r in rs]
                             for name, rs in records.items()},
    }  # fmt: skip


def bench_tlt(config: Any, *, steps: int = 2, warmup: int = 1,
              batch_multipliers: tuple[int, ...] = (1, 2), greedy_repeats: int = 3,
              same_policy: bool = True, on_batch: Callable[[dict], None] | None = None
              ) -> dict[str, Any]:  # fmt: skip
    """Plain vs TLT RL steps at the config's batch and multiples of it.

    Args:
      config: a `TrainConfig` or `ConfigDict` (its `spec` group configures the TLT side).
      steps / warmup: measured and unmeasured (compiling) RL steps per side.
      batch_multipliers: prompts per step are multiplied by these (1, 2: the default batch and
        twice it).
      greedy_repeats: timed greedy rollouts per side (after one compiling pass).
      same_policy: start every RL step of both sides from the plain side's policy (module
        docstring); False lets each side follow its own samples.
      on_batch: called with the results so far after each multiplier (a long run's figures
        outlive a later multiplier's failure).

    Returns:
      JSON-serialisable results per multiplier (`by_batch`) and the machine.
    """
    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_config_dict(config)
    result = {
        "model": cfg.model.name or cfg.model.preset,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "temperature": cfg.rollout.temperature,
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "steps_measured": steps,
        "warmup_steps": warmup,
        "same_policy": same_policy,
        "by_batch": {},
    }
    for m in batch_multipliers:
        result["by_batch"][str(m)] = bench_one(_scaled(cfg, m), steps=steps, warmup=warmup,
                                               greedy_repeats=greedy_repeats,
                                               same_policy=same_policy)  # fmt: skip
        if on_batch is not None:
            on_batch(result)
    return result
