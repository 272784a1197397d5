"""bench_update_packing on the tiny run: both packings timed on the same lengths, the shared
one computing no more rows, and bad lengths refused before anything compiles."""

from __future__ import annotations

import pytest
from rl_testing import tiny_config

from tlt_jax.rl import bench_packing


def test_both_packings_time_the_same_steps():
    config = tiny_config(**{"rl.group_size": 4, "rollout.max_new_tokens": 24,
                            "rollout.max_prompt_len": 8})  # fmt: skip
    # Groups of 4 whose responses spill out of one 32-token row.
    lengths = [[20, 9, 8, 7, 18, 10, 6, 6], [12, 12, 11, 3, 24, 2, 2, 2]]
    result = bench_packing.bench_update_packing(config, lengths, prompt_len=8, repeats=2)
    assert result["steps"] == 2 and result["compiles"] >= 1
    off, on = result["off"], result["on"]
    assert len(off["seconds_per_step"]) == len(on["seconds_per_step"]) == 2
    assert all(s > 0 for s in off["seconds_per_step"] + on["seconds_per_step"])
    assert on["rows"] < off["rows"] and on["update_padding_share"] < off["update_padding_share"]
    assert result["rows_off_over_on"] == pytest.approx(off["rows"] / on["rows"], abs=1e-3)
    assert len(result["ratio_off_over_on_per_step"]) == 2
    spread = result["ratio_off_over_on_spread"]
    assert len(spread["runs"]) == 2 and spread["min"] <= spread["median"] <= spread["max"]


def test_each_step_runs_either_side_first_and_the_ratio_has_its_spread():
    """A fake clock: each run advances it by the side's cost in that repeat, and the order of
    the runs is recorded. With one step (the worst case of a per-step order) and 4 repeats,
    each side runs first in 2 repeats; the per-repeat ratios are the clock's."""
    now, calls = [0.0], []
    cost = {"off": [2.0, 3.0, 2.0, 4.0], "on": [1.0, 1.0, 1.0, 1.0]}

    def run(side, step):
        repeat = sum(1 for s, _ in calls if s == side)
        calls.append((side, step))
        now[0] += cost[side][repeat]

    seconds = bench_packing.time_sides(run, ("off", "on"), 1, 4, clock=lambda: now[0])
    firsts = [calls[2 * r][0] for r in range(4)]
    assert firsts == ["off", "on", "off", "on"]
    assert seconds == {"off": [[2.0, 3.0, 2.0, 4.0]], "on": [[1.0, 1.0, 1.0, 1.0]]}
    two_steps = {"off": [[2.0, 3.0], [4.0, 3.0]], "on": [[1.0, 2.0], [1.0, 1.0]]}
    assert bench_packing.repeat_ratios(two_steps, "off", "on") == [3.0, 2.0]
    # Two steps: each step runs each side first once over two repeats.
    calls.clear()
    cost = {"off": [1.0] * 2 * 2, "on": [1.0] * 2 * 2}
    bench_packing.time_sides(run, ("off", "on"), 2, 2, clock=lambda: now[0])
    firsts = {step: [calls[k][0] for k in range(0, 8, 2) if calls[k][1] == step] for step in (0, 1)}
    assert firsts == {0: ["off", "on"], 1: ["on", "off"]}


def test_bad_lengths_are_refused_by_name():
    config = tiny_config(**{"rl.group_size": 4})
    with pytest.raises(ValueError, match=r"step 0: 3 lengths .* multiple of rl.group_size=4"):
        bench_packing.validate(config, [[1, 2, 3]], prompt_len=4)
    with pytest.raises(ValueError, match="prompt_len=999"):
        bench_packing.validate(config, [[1, 2, 3, 4]], prompt_len=999)
    assert bench_packing.recorded_lengths([[1, 2], [3]]) == [[1, 2], [3]]
    with pytest.raises(ValueError, match="no response lengths found"):
        bench_packing.recorded_lengths({"by_batch": {}})
