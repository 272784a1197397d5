"""The full-TLT benchmark's harness: run order, commands and its ratios by hand on logged steps
(the runs themselves are `scripts/train.py`, tested elsewhere; a benchmark is not run here)."""

from __future__ import annotations

import json
import sys

import pytest

from tlt_jax.rl import bench_full_tlt as bft


def _row(step, step_time, rollout, tokens, compile_s=0.0, update=1.0, tail=1.0):
    row = dict.fromkeys(bft.PER_STEP)
    row.update(step=step, step_time=step_time, time_rollout=rollout, generated_tokens=tokens,
               compile_s=compile_s, time_update=update, long_tail_s=tail)  # fmt: skip
    return row


def test_runs_alternate_abba_and_commands_carry_each_sides_flags(tmp_path):
    assert bft.run_order(2) == [(0, "plain"), (0, "tlt"), (1, "tlt"), (1, "plain")]
    with pytest.raises(ValueError, match="pairs=0"):
        bft.run_order(0)
    argv = bft.run_argv("c.py", tmp_path, "tlt", 4, "/w", processes=2, pin_cores=True)
    assert argv[:5] == [sys.executable, "scripts/launch_local.py", "--num_processes=2",
                        "--pin_cores", "--"]  # fmt: skip
    assert {"--config.spot.slices=2", "--config.spot.enabled=True",
            "--config.spec.mode=adaptive", "--config.spec.drafter=/w",
            "--config.total_steps=4"} <= set(argv)  # fmt: skip
    plain = bft.run_argv("c.py", tmp_path, "plain", 4, None, processes=1, pin_cores=False)
    assert plain[1] == "scripts/train.py"  # one process: two slices on two devices, no launcher
    assert {"--config.spec.mode=off", "--config.spot.enabled=False",
            "--config.spot.slices=2"} <= set(plain)  # fmt: skip
    with pytest.raises(ValueError, match="side='fast'"):
        bft.run_argv("c.py", tmp_path, "fast", 4, None, processes=1, pin_cores=False)


def test_ratios_by_hand_over_measured_steps_of_each_pair():
    runs = {
        "plain": {0: [_row(1, 99.0, 50.0, 100), _row(2, 10.0, 6.0, 100, compile_s=2.0)],
                  1: [_row(1, 98.0, 50.0, 100), _row(2, 12.0, 6.0, 100)]},
        "tlt": {0: [_row(1, 90.0, 40.0, 100), _row(2, 8.0, 4.0, 80, compile_s=1.0)],
                1: [_row(1, 90.0, 40.0, 100), _row(2, 6.0, 3.0, 120)]},
    }  # fmt: skip
    s = bft.summarize(runs, warmup=1)  # step 1 compiles: not measured
    assert s["step_speedup"]["runs"] == pytest.approx([10 / 8, 12 / 6])
    assert s["step_speedup"]["median"] == pytest.approx((10 / 8 + 12 / 6) / 2)
    assert s["step_speedup"]["mean"] == pytest.approx((10 / 8 + 12 / 6) / 2)
    assert s["step_speedup_excluding_compiles"]["mean"] == pytest.approx((8 / 7 + 12 / 6) / 2)
    assert s["rollout_speedup"]["min"] == pytest.approx(6 / 4)
    # Per token: (6 / 100) / (4 / 80) and (6 / 100) / (3 / 120).
    assert s["rollout_per_token_speedup"]["mean"] == pytest.approx((1.2 + 2.4) / 2)
    assert s["phase_s"]["tlt"]["step_time"] == pytest.approx(7.0)
    assert s["plain_tokens_identical"] is True
    assert s["plain_run_to_run"]["mean"] == pytest.approx(10 / 12)
    # A run cut short: only the steps both runs of a pair logged are compared.
    runs["tlt"][1] = runs["tlt"][1][:1]
    assert bft.summarize(runs, warmup=1)["step_speedup"]["runs"] == pytest.approx([10 / 8])
    # No step measured by both runs of any pair: no figure (not a spread of nothing).
    assert bft.summarize(runs, warmup=2)["step_speedup"] is None


def test_long_tail_ratio_needs_one_threshold_and_acceptance_is_pooled_by_rows():
    runs = {
        "plain": {0: [_row(1, 9.0, 5.0, 100), _row(2, 9.0, 5.0, 100, tail=4.0)]},
        "tlt": {0: [_row(1, 9.0, 5.0, 100), _row(2, 8.0, 4.0, 100, tail=2.0)]},
    }
    for rows, threshold in ((runs["plain"][0], 32), (runs["tlt"][0], 8)):
        for r in rows:
            r["sd_threshold"] = threshold
    s = bft.summarize(runs, warmup=1)
    # Tails counted at 32 and at 8 running requests are no ratio; the thresholds are named.
    assert s["long_tail_speedup"] is None
    assert s["long_tail_thresholds"] == {"plain": [32], "tlt": [8]}
    runs["plain"][0][1]["sd_threshold"] = 8
    assert bft.summarize(runs, warmup=1)["long_tail_speedup"]["runs"] == [2.0]
    # SD calibrated off (threshold 0) counts its tail at 32, as a plain side does.
    runs["plain"][0][1].update(sd_threshold=32, long_tail_threshold=32)
    runs["tlt"][0][1].update(sd_threshold=0, long_tail_threshold=32)
    assert bft.summarize(runs, warmup=1)["long_tail_speedup"]["runs"] == [2.0]
    runs["plain"][0][1]["sd_threshold"] = runs["tlt"][0][1]["sd_threshold"] = 8
    del runs["plain"][0][1]["long_tail_threshold"], runs["tlt"][0][1]["long_tail_threshold"]
    # Acceptance over the run's SD rows: a step with 1 row at 3.0 and one with 9 rows at 1.0
    # give 1.2 (the steps' mean would be 2.0); a step without SD of the source counts no row.
    tlt = runs["tlt"][0]
    tlt.append(_row(3, 8.0, 4.0, 100))
    runs["plain"][0].append(_row(3, 9.0, 5.0, 100))
    tlt[1].update(accept_len_ngram=3.0, sd_rows_ngram=1, sd_steps=1, decode_steps=10)
    tlt[2].update(accept_len_ngram=1.0, sd_rows_ngram=9, sd_steps=9, decode_steps=90)
    s = bft.summarize(runs, warmup=1)
    assert s["tlt_accept_len_ngram"] == pytest.approx(1.2)
    assert s["tlt_accept_len_eagle"] is None
    assert s["tlt_sd_step_share"] == pytest.approx(0.1)


def test_refuses_a_used_workdir_and_nothing_to_measure(tmp_path):
    (tmp_path / "0_plain").mkdir()
    (tmp_path / "0_plain" / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    kw = dict(pairs=1, steps=2, warmup=1, warm=None, processes=1, pin_cores=False)
    with pytest.raises(ValueError, match="0_plain is not empty"):
        bft.run("c.py", tmp_path, **kw)
    with pytest.raises(ValueError, match="steps=1 must exceed warmup=1"):
        bft.run("c.py", tmp_path, **{**kw, "steps": 1})
