"""scripts/bench_versions.py: an earlier commit's RL step beside this checkout's, one process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run(*args):
    return subprocess.run([sys.executable, "scripts/bench_versions.py", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def test_head_beside_the_checkout_runs_the_same_steps(tmp_path):
    out = tmp_path / "versions.json"
    done = _run("--config=configs/tiny.py", "--ref=HEAD", "--steps=2", f"--output_json={out}")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    old, new = result["records"]["old"], result["records"]["new"]
    assert len(old) == len(new) == 2
    # Plain rollouts of the same prompts by (nearly) the same code: the same number of tokens.
    assert [r["generated_tokens"] for r in old] == [r["generated_tokens"] for r in new]
    assert all(r["step_time"] > 0 for r in old + new)
    assert old[0]["compile_count"] > 0  # the first step compiles on each side
    # The same packing of the same samples (the tiny policy's groups may all be silent: then
    # the update computes nothing and has no rate).
    computed = result["update_tokens_computed"]
    assert computed["old"] == computed["new"] == [r["update_tokens_computed"] for r in new]
    rates = result["update_ms_per_computed_position"]
    assert set(rates) == {"old", "new"}
    assert all((v is None) == (sum(computed[k][1:]) == 0) for k, v in rates.items())
    assert all(v is None or v > 0 for v in rates.values())
    assert len(result["step_old_over_new"]) == 2 and all(x > 0 for x in result["step_old_over_new"])
    assert result["command"].startswith("python scripts/bench_versions.py")


def test_a_ref_that_names_no_commit_is_refused_before_loading():
    done = _run("--config=configs/tiny.py", "--ref=no-such-ref")
    assert done.returncode != 0
    assert "--ref='no-such-ref' is not a commit" in done.stderr


def test_fields_an_older_version_lacks_are_left_out_of_its_config():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from bench_versions import known_fields
    finally:
        sys.path.remove(str(REPO / "scripts"))
    config = {"seed": 1, "spec": {"mode": "off", "max_cost_ratio": 1.5},
              "spot": {"enabled": True, "silent_features": False},
              "rl": {"logits_chunk": None, "remat": None},
              "new_group": {"x": 1}}  # fmt: skip
    known = {"seed": 0, "spec": {"mode": "adaptive"}, "spot": {"enabled": False},
             "rl": {"logits_chunk": 0, "remat": None}}  # fmt: skip
    kept, dropped = known_fields(config, known)
    # A field now unset (None: per backend) that the old version has a value for keeps the
    # old version's own default.
    assert kept == {"seed": 1, "spec": {"mode": "off"}, "spot": {"enabled": True},
                    "rl": {"logits_chunk": 0, "remat": None}}  # fmt: skip
    assert dropped == {"spec.max_cost_ratio": 1.5, "spot.silent_features": False,
                       "rl.logits_chunk": None, "new_group": {"x": 1}}  # fmt: skip
