"""The packed update's steady state: gradient-program seconds per step for packings of the
same response lengths, every shape compiled first (`scripts/bench_update_packing.py`).

A whole-run comparison (`bench_rl_step.py --rl_sides`) mixes two things a packing change
moves: the compute per step, and the compiles a new row count costs the first time it
appears (a few seconds each on CPU, once per run). Runs long enough amortise the second;
this measures the first. The policy's weights and tokens are random (a step's cost depends
on shapes only); the lengths are recorded ones or drawn from a long-tailed distribution.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax.metrics import timing
from tlt_jax.models.transformer import init_model
from tlt_jax.rl import packing
from tlt_jax.rl import step as step_lib
from tlt_jax.rl.config import TrainConfig
from tlt_jax.rl.policy import planned_model_config


def long_tail_lengths(steps: int, responses: int, cap: int, p50: float = 53.0,
                      sigma: float = 0.8, seed: int = 0) -> list[list[int]]:  # fmt: skip
    """Response lengths of `steps` steps: lognormal around `p50`, clipped to [1, cap] (the
    main job's step 1 measured p50 / p90 / max 52 / 219 / 256)."""
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(np.log(p50), sigma, (steps, responses))
    return np.clip(draws, 1, cap).astype(int).tolist()


def recorded_lengths(record: Any) -> list[list[int]]:
    """Per-step response lengths from a JSON record: a list of per-step lists, or a
    `bench_tlt.py` output (`by_batch/*/response_lengths/<side>/[step]`)."""
    if isinstance(record, list):
        return [list(map(int, step)) for step in record]
    steps = []
    for batch in record.get("by_batch", {}).values():
        for side in batch.get("response_lengths", {}).values():
            steps += [list(map(int, step)) for step in side]
    if not steps:
        raise ValueError("no response lengths found: expected a list of per-step lists or a "
                         "bench_tlt.py JSON with by_batch/*/response_lengths")  # fmt: skip
    return steps


def as_train_config(config: Any) -> TrainConfig:
    return config if isinstance(config, TrainConfig) else TrainConfig.from_config_dict(config)


def time_sides(run: Callable[[str, int], None], sides: Sequence[str], steps: int,
               repeats: int, clock: Callable[[], float] = time.perf_counter
               ) -> dict[str, list[list[float]]]:  # fmt: skip
    """Seconds of `run(side, step)` (which blocks until its work is done) for every side, step
    and repeat: `{side: [[seconds per repeat] per step]}`.

    A step's sides run back to back, in `timing.side_order` of round `repeat + step`: every
    step runs each side first in alternate repeats (and neighbouring steps start with other
    sides), so neither side is always the one timed right after the other's work.
    """
    seconds: dict[str, list[list[float]]] = {name: [[] for _ in range(steps)] for name in sides}
    for repeat in range(repeats):
        for i in range(steps):
            for name in timing.side_order(sides, repeat + i):
                start = clock()
                run(name, i)
                seconds[name][i].append(clock() - start)
    return seconds


def repeat_ratios(seconds: dict[str, list[list[float]]], num: str, den: str) -> list[float]:
    """Per repeat of `time_sides`' `seconds`, side `num`'s seconds over all steps over side
    `den`'s: the whole-run ratio as each repeat measured it (its spread is the noise)."""
    totals = {name: [sum(per_repeat) for per_repeat in zip(*seconds[name], strict=True)]
              for name in (num, den)}  # fmt: skip
    return [a / b for a, b in zip(totals[num], totals[den], strict=True)]


def validate(config: Any, lengths: Sequence[Sequence[int]], prompt_len: int) -> None:
    """A clear error for inputs `bench_update_packing` cannot run, before anything compiles."""
    config = as_train_config(config)
    rl, rollout = config.rl, config.rollout
    if rl.update_layout != "packed":
        raise ValueError(f"rl.update_layout={rl.update_layout!r}: expected 'packed'")
    if not 1 <= prompt_len <= rollout.max_prompt_len:
        raise ValueError(f"prompt_len={prompt_len}: expected 1..rollout.max_prompt_len="
                         f"{rollout.max_prompt_len}")  # fmt: skip
    if not lengths:
        raise ValueError("no steps to time")
    g, cap = rl.group_size, rollout.max_new_tokens
    for i, step in enumerate(lengths):
        if not step or len(step) % g or max(step) > cap or min(step) < 0:
            raise ValueError(
                f"step {i}: {len(step)} lengths in [{min(step, default=0)}, "
                f"{max(step, default=0)}]; expected a non-zero multiple of "
                f"rl.group_size={g}, each in [0, rollout.max_new_tokens={cap}]"
            )


def bench_update_packing(config: Any, lengths: Sequence[Sequence[int]], *, prompt_len: int,
                         signal_fraction: float = 1.0, repeats: int = 1, seed: int = 0
                         ) -> dict[str, Any]:  # fmt: skip
    """Steady-state update seconds per step with `rl.share_prompts` off and on.

    Args:
      config: a `TrainConfig` or `ConfigDict` (the policy's architecture, `rl` and
        `rollout` groups).
      lengths: response lengths per step (a multiple of `rl.group_size` each, <= the cap).
      prompt_len: tokens of every prompt (<= `rollout.max_prompt_len`).
      signal_fraction: share of groups with advantage signal (the update trains those).
      repeats: timed passes over the steps (`time_sides`: which side of a step runs first
        alternates from repeat to repeat).
      seed: of the tokens and of which groups have signal.

    Returns:
      Per side: rows and micro-batches per step, seconds per step (the median over repeats),
      `update_padding_share` over all steps; per step and overall: off / on ratios, and
      the overall ratio's spread over the repeats (`ratio_off_over_on_spread`).
    """
    config = as_train_config(config)
    validate(config, lengths, prompt_len)
    rl, rollout = config.rl, config.rollout
    g = rl.group_size
    sides = {"off": dataclasses.replace(rl, share_prompts=False),
             "on": dataclasses.replace(rl, share_prompts=True)}  # fmt: skip
    rng = np.random.default_rng(seed)
    model_config = planned_model_config(config.model)
    vocab = model_config.vocab_size
    plans: dict[str, list] = {name: [] for name in sides}
    real = dict.fromkeys(sides, 0)
    for step in lengths:
        n = len(step) // g
        prompts = [rng.integers(1, vocab, prompt_len).tolist() for _ in range(n)]
        responses = [rng.integers(1, vocab, k).tolist() for k in step]
        signal = rng.random(n) < signal_fraction
        signal[0] = True  # a step with nothing to train times nothing
        for name, side_rl in sides.items():
            _, micro = packing.micro_batches(side_rl, rollout, prompts, responses, signal,
                                             include_silent=False)  # fmt: skip
            trained = [m for m in micro[0] if m.trained]
            plans[name].append(trained)
            real[name] += sum(m.needed for m in trained)
    graphdef, params = nnx.split(init_model(model_config, seed=0))
    options = step_lib.ForwardOptions.of(rl, model_config.num_layers)
    program = jax.jit(functools.partial(step_lib.grad_program, graphdef,
                                        algorithm=rl.algorithm, temperature=1.0,
                                        options=options, on_policy=True),
                      donate_argnums=(1,))  # fmt: skip
    accum = step_lib.zero_accumulator(params)

    def inputs(batch):
        shape = batch.tokens_RxL.shape
        zeros = jnp.zeros(shape, jnp.float32)
        weights = jnp.where(jnp.asarray(batch.response_mask_RxL), 1e-3, 0.0)
        return step_lib.LossInputs(zeros, zeros, zeros + 1.0, weights, weights)

    compiled, compile_s = {}, 0.0
    placed = {name: [[jax.tree.map(jnp.asarray, m.batch) for m in step] for step in plan]
              for name, plan in plans.items()}  # fmt: skip
    for plan in placed.values():
        for batch in (b for step in plan for b in step):
            key = batch.prefix_RxS.shape
            if key not in compiled:
                start = time.perf_counter()
                compiled[key] = program.lower(params, accum, batch, inputs(batch)).compile()
                compile_s += time.perf_counter() - start

    def run_step(name, i):
        nonlocal accum
        for batch in placed[name][i]:
            accum = compiled[batch.prefix_RxS.shape](params, accum, batch, inputs(batch))
        jax.block_until_ready(accum)

    seconds = time_sides(run_step, tuple(sides), len(lengths), repeats)
    median = {name: [float(np.median(s)) for s in per] for name, per in seconds.items()}
    result: dict[str, Any] = {
        "steps": len(lengths), "repeats": repeats, "prompt_len": prompt_len,
        "signal_fraction": signal_fraction, "compiles": len(compiled),
        "compile_s": round(compile_s, 1),
    }  # fmt: skip
    for name in sides:
        rows = [[m.shape[0] for m in step] for step in plans[name]]
        computed = sum(m.computed for step in plans[name] for m in step)
        result[name] = {
            "rows_per_step": rows,
            "rows": int(sum(map(sum, rows))),
            "update_padding_share": round(1 - real[name] / max(computed, 1), 4),
            "seconds_per_step": [round(s, 3) for s in median[name]],
            "seconds": round(sum(median[name]), 2),
        }
    ratios = [off / on for off, on in zip(median["off"], median["on"], strict=True)]
    result["ratio_off_over_on_per_step"] = [round(r, 3) for r in ratios]
    result["ratio_off_over_on"] = round(sum(median["off"]) / sum(median["on"]), 3)
    result["ratio_off_over_on_spread"] = timing.spread(repeat_ratios(seconds, "off", "on"))
    result["rows_off_over_on"] = round(result["off"]["rows"] / result["on"]["rows"], 3)
    return result
