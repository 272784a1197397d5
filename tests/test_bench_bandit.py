"""bench_bandit: the simulated arms' figures by hand, both sides on the same draws, and bad
scenario names refused before anything runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from rl_testing import REPO

from tlt_jax.rollout import bandit_bench


def test_an_oracle_fraction_by_hand_and_the_sides_on_the_same_draws():
    # Without noise, one arm much faster than the others from the start: each arm is tried
    # once (untried first: plain at 30, EAGLE at 60, n-gram at 25), then the bandit exploits
    # EAGLE but for epsilon's exploration, so the oracle's 100 steps at 60 take at most the
    # share (100 / 60) / (98 / 60 + 1 / 30 + 1 / 25) of the bandit's time.
    speeds = bandit_bench.scenario("strong", 4)
    assert speeds(0) == {"plain": 30.0, "ngram:8,4,8": 25.0, "eagle:8,4,8": 60.0}
    fraction = bandit_bench.simulate(speeds, told=False, rl_steps=1, sd_steps=100, noise=0.0,
                                     seed=0)  # fmt: skip
    assert 0.9 < fraction <= (100 / 60) / (98 / 60 + 1 / 30 + 1 / 25)
    # Both sides draw the same noise and exploration: where the drafter arm leads under every
    # version (its window is cut to the last version's rewards, which never changes the
    # leader) the told side chooses exactly as the other.
    sides = [bandit_bench.simulate(speeds, told=told, rl_steps=3, sd_steps=100, noise=0.1,
                                   seed=1) for told in (True, False)]  # fmt: skip
    assert sides[0] == sides[1]
    improving = bandit_bench.scenario("improving", 8)
    assert improving(0)["eagle:8,4,8"] == 15.0 and improving(6)["eagle:8,4,8"] == 60.0
    with pytest.raises(ValueError, match="scenario 'fast' is not one of"):
        bandit_bench.scenario("fast", 8)(0)


def test_the_script_writes_both_sides_per_scenario(tmp_path):
    out = tmp_path / "bandit.json"
    run = subprocess.run([sys.executable, "scripts/bench_bandit.py", "--seeds=2", "--rl_steps=6",
                          "--sd_steps=60", f"--output_json={out}"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["scenarios"]) == {"improving", "weak", "strong"}
    for row in result["scenarios"].values():
        for side in ("told", "untold"):
            assert 0 < row[side]["min"] <= row[side]["mean"] <= row[side]["max"] <= 1
        assert row["told_over_untold"] == pytest.approx(row["told"]["mean"] / row["untold"]["mean"])
    assert result["command"].endswith(f"--output_json={out}")
    bad = subprocess.run([sys.executable, "scripts/bench_bandit.py", "--scenarios=fast"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode != 0 and "--scenarios: scenario 'fast' is not one of" in bad.stderr
