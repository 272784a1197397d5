"""The acceptance-by-step benchmark: its goals by hand on logged steps, and one variant run
end to end (the frozen drafter, the tiny config) through the script."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from rl_testing import REPO

from tlt_jax.drafter.export import export_eagle
from tlt_jax.models.drafter import init_drafter
from tlt_jax.models.presets import get_preset
from tlt_jax.rl import bench_accept


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


def test_frozen_variant_runs_end_to_end(tmp_path):
    drafter = init_drafter(get_preset("tiny"), seed=2)
    warm = export_eagle(drafter.params_dict(), get_preset("tiny"), tmp_path / "eagle")
    out = tmp_path / "accept.json"
    proc = subprocess.run(
        [sys.executable, "scripts/bench_accept.py", "--config=configs/tiny.py:tlt",
         f"--warm_drafter={warm}", "--steps=1", "--variants=frozen",
         f"--root={tmp_path / 'runs'}", f"--output_json={out}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert not result["errors"]
    steps = result["per_step"]["frozen"]
    assert [r["step"] for r in steps] == [1]
    assert all(r["drafter_version"] in (0, None) for r in steps)  # never trained
    assert list(result["summary"]["accept_len_by_step"]) == ["frozen"]
