"""scripts/bench_drafter.py on the tiny preset: its ratios come with their spread over the
alternating rounds (every timed step kept), not a median alone, and the rounds alternate which
variant runs first."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from rl_testing import REPO


def test_ratios_carry_the_spread_of_their_rounds(tmp_path):
    out = tmp_path / "bench_drafter.json"
    done = subprocess.run(
        [sys.executable, "scripts/bench_drafter.py", "--model=tiny", "--batch_rows=1",
         "--row_len=64", "--window=64", "--hot_sizes=16", "--unroll_steps=1", "--num_steps=3",
         f"--output_json={out}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = result["step_s_runs"]
    assert set(runs) == {"full", "hot16"} and all(len(v) == 3 for v in runs.values())
    # Each variant runs first in alternate rounds (not the full head first in every round).
    assert result["round_order"] == [["full", "hot16"], ["hot16", "full"], ["full", "hot16"]]
    spread = result["speedup_vs_full_spread"]["hot16"]
    # Per round: the full step over the hot one timed beside it.
    per_round = sorted(f / h for f, h in zip(runs["full"], runs["hot16"], strict=True))
    assert spread["min"] == pytest.approx(per_round[0])
    assert spread["max"] == pytest.approx(per_round[-1])
    assert spread["median"] == pytest.approx(per_round[1])
    assert result["speedup_vs_full"]["hot16"] == pytest.approx(
        result["step_s"]["full"] / result["step_s"]["hot16"])  # fmt: skip
