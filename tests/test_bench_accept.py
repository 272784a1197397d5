"""The acceptance-by-step benchmark: its goals by hand on logged steps, and one variant run
end to end (the frozen drafter, the tiny config) through the script."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from rl_testing import REPO

from tlt_jax.drafter.export import export_eagle
from tlt_jax.models.drafter import init_drafter
from tlt_jax.models.presets import get_preset
from tlt_jax.rl import accept_probe, bench_accept


def _rows(eagle, ngram):
    return [{"step": i + 1, "accept_len_eagle": e, "accept_len_ngram": n}
            for i, (e, n) in enumerate(zip(eagle, ngram, strict=True))]  # fmt: skip


def test_summary_goals_by_hand():
    runs = {
        "spot": _rows([1.0, 1.8, None, 2.2, 2.6], [1.5] * 5),
        "frozen": _rows([1.6, 1.7, 1.6, None, 1.5], [1.5] * 5),
        "cold": _rows([1.0, None, 1.4, 1.6, 2.0], [1.5] * 5),
    }
    s = bench_accept.summarize(runs)
    # Final = mean of the last three steps that had EAGLE SD steps.
    assert s["final_accept_len"]["spot"] == pytest.approx((1.8 + 2.2 + 2.6) / 3)
    assert s["final_accept_len"]["frozen"] == pytest.approx((1.7 + 1.6 + 1.5) / 3)
    assert s["spot_minus_frozen"] == pytest.approx(2.2 - 1.6)
    assert s["goal_spot_beats_frozen_by_0.3"] is True
    assert s["cold_passes_ngram_at_step"] == 4 and s["goal_cold_passes_ngram"] is True
    assert bench_accept.summarize({"cold": _rows([1.0, 1.2], [1.5, 1.5])})[
        "goal_cold_passes_ngram"] is False  # fmt: skip
    with pytest.raises(ValueError, match="needs a warm-up drafter"):
        bench_accept.train_argv("c.py", REPO, "frozen", 2, None)


def test_ngram_figures_are_a_mean_over_every_run_and_a_final_per_run():
    # Two runs whose n-gram figures differ: the mean is over every logged step of both runs
    # (not the last three steps of whichever run came last), and each run's final n-gram
    # figure is the mean of its own last three, as `final_accept_len` is for EAGLE.
    runs = {"spot": _rows([2.0] * 4, [1.0, 1.0, None, 1.0]),
            "cold": _rows([1.0] * 4, [3.0, 3.0, 3.0, 3.0])}  # fmt: skip
    s = bench_accept.summarize(runs)
    assert s["ngram_accept_len_mean"] == pytest.approx((3 * 1.0 + 4 * 3.0) / 7)
    assert s["final_ngram_accept_len"] == {"spot": pytest.approx(1.0), "cold": pytest.approx(3.0)}
    assert bench_accept.summarize({"cold": _rows([1.0], [None])})["ngram_accept_len_mean"] is None


def test_frozen_variant_runs_end_to_end(tmp_path):
    drafter = init_drafter(get_preset("tiny"), seed=2)
    warm = export_eagle(drafter.params_dict(), get_preset("tiny"), tmp_path / "eagle")
    out = tmp_path / "accept.json"
    proc = subprocess.run(
        [sys.executable, "scripts/bench_accept.py", "--config=configs/tiny.py:tlt",
         f"--warm_drafter={warm}", "--steps=1", "--variants=frozen",
         f"--root={tmp_path / 'runs'}", f"--output_json={out}", "--probe_prompts=1"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert not result["errors"]
    steps = result["per_step"]["frozen"]
    assert [r["step"] for r in steps] == [1]
    assert all(r["drafter_version"] in (0, None) for r in steps)  # never trained
    assert list(result["summary"]["accept_len_by_step"]) == ["frozen"]
    # The final policy probed with SD on every step: the frozen (warm-up) drafter and n-gram.
    probe = result["probe"]["frozen"]
    assert probe["step"] == 1 and probe["requests"] == 4  # 1 prompt x the tiny group of 4
    assert probe["frozen"]["verify_steps"] > 0 and probe["ngram"]["verify_steps"] > 0
    assert 1.0 <= probe["frozen"]["accept_len"] <= 5.0  # strategy 4,1,5: at most depth + 1


def test_probe_pairs_each_policy_with_every_drafter_and_summarizes(tmp_path):
    for v in ("spot", "cold", "warm"):
        (tmp_path / v / "drafter").mkdir(parents=True)
    warm = str(tmp_path / "warm" / "drafter")
    pairs = bench_accept.probe_drafters(tmp_path, ["spot", "frozen", "cold"], warm)
    assert pairs["spot"] == {"spot": str(tmp_path / "spot" / "drafter"), "frozen": warm,
                             "cold": str(tmp_path / "cold" / "drafter")}  # fmt: skip
    assert list(pairs["frozen"]) == ["frozen", "spot", "cold"]  # the run's own drafter first
    assert "frozen" not in bench_accept.probe_drafters(tmp_path, ["spot", "frozen"], None)
    # No frozen run: the warm-up drafter is still compared on the runs' policies.
    pairs = bench_accept.probe_drafters(tmp_path, ["spot", "cold"], warm)
    assert list(pairs) == ["spot", "cold"]
    assert pairs["spot"] == {"spot": str(tmp_path / "spot" / "drafter"), "frozen": warm,
                             "cold": str(tmp_path / "cold" / "drafter")}  # fmt: skip
    # A run of an earlier invocation under the same root: its drafter is probed too.
    assert bench_accept.probe_drafters(tmp_path, ["cold"], None) == {
        "cold": {"cold": str(tmp_path / "cold" / "drafter"),
                 "spot": str(tmp_path / "spot" / "drafter")}}  # fmt: skip
    probes = {"spot": {"step": 20, "spot": {"accept_len": 2.0, "accept_len_stderr": 0.3},
                       "frozen": {"accept_len": 1.5, "accept_len_stderr": 0.4},
                       "ngram": {"accept_len": 1.4}},
              "cold": {"cold": {"accept_len": 1.6}, "ngram": {"accept_len": 1.5}}}  # fmt: skip
    s = bench_accept.summarize_probe(probes)
    assert s == {"spot_policy_spot_minus_frozen": pytest.approx(0.5),
                 "spot_policy_spot_minus_frozen_stderr": pytest.approx(0.5),  # hypot(0.3, 0.4)
                 "spot_policy_spot_minus_ngram": pytest.approx(0.6),
                 "cold_policy_cold_minus_ngram": pytest.approx(0.1)}  # fmt: skip


def test_acceptance_and_its_stderr_by_hand():
    # Requests of 5, 1 and 6 tokens in 2, 1 and 3 verify steps (one verified nothing):
    # r = 12 / 6 = 2; residuals t - r s = 1, -1, 0; stderr sqrt(3 / 2 * 2) / 6.
    got = accept_probe.accept_stats([[2, 3], [], [1], [4, 1, 1]])
    assert got["accept_len"] == pytest.approx(2.0) and got["verify_steps"] == 6
    assert got["accept_len_stderr"] == pytest.approx(math.sqrt(3) / 6)
    assert accept_probe.accept_stats([[3, 1]])["accept_len_stderr"] is None
    assert accept_probe.accept_stats([[], []]) == {
        "accept_len": None,
        "accept_len_stderr": None,
        "verify_steps": 0,
    }
