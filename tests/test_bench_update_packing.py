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
    result = bench_packing.bench_update_packing(config, lengths, prompt_len=8)
    assert result["steps"] == 2 and result["compiles"] >= 1
    off, on = result["off"], result["on"]
    assert len(off["seconds_per_step"]) == len(on["seconds_per_step"]) == 2
    assert all(s > 0 for s in off["seconds_per_step"] + on["seconds_per_step"])
    assert on["rows"] < off["rows"] and on["update_padding_share"] < off["update_padding_share"]
    assert result["rows_off_over_on"] == pytest.approx(off["rows"] / on["rows"], abs=1e-3)
    assert len(result["ratio_off_over_on_per_step"]) == 2


def test_bad_lengths_are_refused_by_name():
    config = tiny_config(**{"rl.group_size": 4})
    with pytest.raises(ValueError, match=r"step 0: 3 lengths .* multiple of rl.group_size=4"):
        bench_packing.validate(config, [[1, 2, 3]], prompt_len=4)
    with pytest.raises(ValueError, match="prompt_len=999"):
        bench_packing.validate(config, [[1, 2, 3, 4]], prompt_len=999)
    assert bench_packing.recorded_lengths([[1, 2], [3]]) == [[1, 2], [3]]
    with pytest.raises(ValueError, match="no response lengths found"):
        bench_packing.recorded_lengths({"by_batch": {}})
