"""bench_tlt end to end on the tiny run: both sides, greedy exactness, every reported ratio."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from rl_testing import tiny_config

from tlt_jax.rl.bench_tlt import _adopt_policy, _digest, _ratio_stats, bench_tlt
from tlt_jax.rl.trainer import Trainer
from tlt_jax.rollout.engine import Request
from tlt_jax.rollout.sampling import SamplingParams


def test_bench_tlt_runs_both_sides_on_the_tiny_config():
    partial = []  # what the script writes after each multiplier, before the next one runs
    result = bench_tlt(tiny_config(), steps=1, warmup=1, batch_multipliers=(1,),
                       greedy_repeats=2,
                       on_batch=lambda r: partial.append(list(r["by_batch"])))  # fmt: skip
    assert partial == [["1"]]
    one = result["by_batch"]["1"]
    # The measured step follows a warm-up step on each side: with `same_policy` (the default)
    # both sides start it from the plain side's updated policy.
    assert result["same_policy"] and one["same_policy"]
    plain, tlt = one["per_step"]["plain"][0], one["per_step"]["tlt"][0]
    assert plain["step"] == tlt["step"] == 2
    assert plain["policy_digest"] == tlt["policy_digest"]
    assert len(one["equal_length_share"]) == 1 and 0.0 <= one["equal_length_share"][0] <= 1.0
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
        "update_speedup",
    ):
        assert math.isfinite(one[key]["mean"]) and one[key]["min"] <= one[key]["max"], key
    assert set(one["phase_s"]) == {"plain", "tlt"}
    assert len(one["per_step"]["plain"]) == len(one["per_step"]["tlt"]) == 1
    assert one["ceiling_step_speedup"] >= 1.0
    assert one["step_speedup_excluding_compiles"]["mean"] == (
        (plain["step_time"] - plain["compile_s"]) / (tlt["step_time"] - tlt["compile_s"])
    )


def test_ratio_stats_by_hand():
    """Plain / TLT per pair of runs as `timing.spread`; a pair whose TLT figure is 0 (no long
    tail) has no ratio, and no ratio at all is None (NaN is not JSON)."""
    stats = _ratio_stats([2.0, 3.0, 5.0], [1.0, 0.0, 2.0])
    assert stats["runs"] == [2.0, 2.5] and stats["mean"] == stats["median"] == 2.25
    assert (stats["min"], stats["max"]) == (2.0, 2.5)
    assert _ratio_stats([1.0], [0.0]) is None
    with pytest.raises(ValueError):  # the two sides ran another number of steps
        _ratio_stats([1.0, 2.0], [1.0])


def test_the_tlt_side_adopts_a_copy_of_the_plain_policy_down_to_its_engine(tmp_path):
    """`same_policy`'s hand-over: equal params and optimizer state, the same greedy tokens and
    log-probs from both engines, and a copy (the source's buffers may be donated by its next
    update)."""
    plain = Trainer(tiny_config(), tmp_path / "plain", progress=False)
    tlt = Trainer(tiny_config(**{"model.init_seed": 1}), tmp_path / "tlt", progress=False)
    try:
        assert _digest(plain) != _digest(tlt)
        request = Request(plain.encode("1+2="), 8, SamplingParams(), plain.stop_ids, seed=0)

        def sampled(trainer):
            done = trainer.engine.generate([request], progress=False)[0]
            return done.token_ids, np.asarray(done.logprobs)

        assert not np.array_equal(sampled(tlt)[1], sampled(plain)[1])
        _adopt_policy(tlt, plain)
        assert _digest(tlt) == _digest(plain)
        for a, b in zip(jax.tree.leaves(plain.state), jax.tree.leaves(tlt.state), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            if isinstance(a, jax.Array):
                assert a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()
        (tokens_tlt, logprobs_tlt), (tokens_plain, logprobs_plain) = sampled(tlt), sampled(plain)
        assert tokens_tlt == tokens_plain
        np.testing.assert_array_equal(logprobs_tlt, logprobs_plain)
    finally:
        plain.close()
        tlt.close()
