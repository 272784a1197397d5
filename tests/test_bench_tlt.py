"""bench_tlt end to end on the tiny run: both sides, greedy exactness, every reported ratio."""

from __future__ import annotations

import math

from rl_testing import tiny_config

from tlt_jax.rl.bench_tlt import bench_tlt


def test_bench_tlt_runs_both_sides_on_the_tiny_config():
    result = bench_tlt(tiny_config(), steps=1, warmup=0, batch_multipliers=(1,),
                       greedy_repeats=2)  # fmt: skip
    one = result["by_batch"]["1"]
    greedy = one["greedy"]
    assert greedy["tokens_identical"]
    for side in ("plain", "tlt"):  # two timed repeats; the best one reported
        assert len(greedy[side]["rollout_s_runs"]) == 2
        assert greedy[side]["rollout_s"] == min(greedy[side]["rollout_s_runs"])
    runs = greedy["rollout_speedup_greedy_runs"]
    assert runs["min"] <= runs["mean"] <= runs["max"]
    for key in (
        "rollout_speedup",
        "step_speedup",
        "rollout_per_token_speedup",
        "step_speedup_excluding_compiles",
    ):
        assert math.isfinite(one[key]["mean"]) and one[key]["min"] <= one[key]["max"], key
    assert set(one["phase_s"]) == {"plain", "tlt"}
    assert len(one["per_step"]["plain"]) == len(one["per_step"]["tlt"]) == 1
    assert one["ceiling_step_speedup"] >= 1.0
    plain, tlt = one["per_step"]["plain"][0], one["per_step"]["tlt"][0]
    assert one["step_speedup_excluding_compiles"]["mean"] == (
        (plain["step_time"] - plain["compile_s"]) / (tlt["step_time"] - tlt["compile_s"])
    )
