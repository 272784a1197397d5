"""The accelerator check's one command runs end to end on CPU (`--dry_run`): every stage ok,
each stage's figures in the JSON, and no more files under the output folder than the device
returns (8)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
from rl_testing import REPO


def test_accelerator_check_dry_run(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    proc = subprocess.run(
        [sys.executable, "scripts/accelerator_check.py", "--dry_run", f"--out_dir={out}",
         f"--scratch_dir={scratch}"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "accelerator_check.json").read_text())
    stages = report["stages"]
    assert list(stages) == ["tree_attention_tests", "bench_kernels", "sd_crossover", "rl_loop"]
    assert all(s["status"] == "ok" for s in stages.values()), stages
    tests = stages["tree_attention_tests"]["summary"]
    assert tests["tests"] > 20 and not tests["failed"]
    kernels = stages["bench_kernels"]["summary"]["summary"]
    assert set(kernels["goals"]) == {"pallas_at_least_1.5x_xla",
                                     "pallas_at_least_0.7_hbm_bandwidth",
                                     "pallas_within_1.2x_best_cuda"}  # fmt: skip
    crossover = stages["sd_crossover"]["summary"]["xla"]
    assert set(crossover["crossover_batch"]["3,1,4"]) == {"2.0", "3.0"}
    assert crossover["batch_1"]["plain_ms"] > 0
    rl = stages["rl_loop"]["summary"]
    assert rl["steps"] == 2 and rl["mean_phase_s"]["time_rollout"] > 0
    assert "sd_step_share" in rl["last_step"]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files


@functools.cache  # its absl flags can be defined once per process
def _accelerator_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_accelerator_check", REPO / "scripts" / "accelerator_check.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_device_argv_and_a_half_written_json(tmp_path):
    """The device run's stage arguments (what the dry run does not pass), and a stage JSON cut
    short by the stage's kill: its summary says so and the check goes on."""
    check = _accelerator_check()
    tests = check._stage_argv("tree_attention_tests", tmp_path, tmp_path, 72.0, dry=False)
    assert "-v" in tests and "-q" not in tests  # one line per test in the log as it finishes
    assert tests[-2:] == ["-k", "not True"]  # compiled kernels only (interpret=True ids)
    crossover = check._stage_argv("sd_crossover", tmp_path, tmp_path, 154.0, dry=False)
    assert "--batches=1,128,16" in crossover and "--max_batch=128" in crossover
    (tmp_path / "bench_kernels.json").write_text('{"results": [{"kernel": "tr')
    summary = check._summary("bench_kernels", tmp_path, tmp_path)
    assert summary["error"].startswith("bench_kernels.json does not parse")


def test_the_scratch_folder_is_deleted_only_when_this_script_made_it(tmp_path):
    """`--scratch_dir` is emptied on every run: a folder of the user's (no marker) is refused,
    not deleted; a new, empty or earlier scratch folder is (re)made with its marker."""
    from absl import app

    check = _accelerator_check()
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    try:
        check._fresh_scratch(precious)
        raise AssertionError("a folder of the user's was accepted as scratch")
    except app.UsageError as e:
        assert "--scratch_dir=" in str(e) and "not a scratch folder" in str(e)
    assert (precious / "notes.txt").read_text() == "keep me"
    scratch = tmp_path / "scratch"
    check._fresh_scratch(scratch)
    (scratch / "rl_tiny").mkdir()  # what a run leaves
    check._fresh_scratch(scratch)  # ours: emptied
    assert [p.name for p in scratch.iterdir()] == [check.SCRATCH_MARK]
    empty = tmp_path / "empty"
    empty.mkdir()
    check._fresh_scratch(empty)
    assert (empty / check.SCRATCH_MARK).is_file()


def test_a_test_stage_killed_before_its_junit_report_keeps_the_logs_verdicts(tmp_path):
    """pytest writes its JUnit report only at the end; a stage killed at its limit used to
    report {} although its -v log held every finished test's verdict."""
    check = _accelerator_check()
    log = tmp_path / "tree_attention_tests.log"
    log.write_text(
        "$ python -m pytest -v tests/test_tree_attention.py\n"
        "tests/test_tree_attention.py::test_a[float32-False] PASSED   [  5%]\n"
        "tests/test_tree_attention.py::test_b[bfloat16-False] FAILED  [ 10%]\n"
        "tests/test_tree_attention.py::test_c SKIPPED (no gpu)        [ 15%]\n"
    )  # fmt: skip
    summary = check._summary("tree_attention_tests", tmp_path, tmp_path)
    assert summary == {"tests": 3, "failed": ["test_b[bfloat16-False]"], "skipped": 1,
                       "compiled_cases": 2, "from_log": True}  # fmt: skip
    # A JUnit report cut short raises here; main() records it as the stage's summary.
    (tmp_path / "tree_attention_tests.xml").write_text("<testsuite><testcase")
    with pytest.raises(check.ElementTree.ParseError):
        check._summary("tree_attention_tests", tmp_path, tmp_path)


def test_the_budget_holds_the_probe_and_passes_unused_time_on():
    """--budget_s is the whole check's: the start-up probe came on top of it (a call sized to
    --budget_s lost the last stage), and a stage that ended early left its time unused."""
    check = _accelerator_check()
    stages = list(check.SHARES)
    # 480 s, the probe took 100: the stages share the 380 left, in proportion.
    budgets = [check.stage_budget(380.0, stages[i:]) for i in range(len(stages))]
    assert budgets[0] == pytest.approx(380.0 * check.SHARES[stages[0]])
    assert budgets[-1] == pytest.approx(380.0)
    # The first stage used 10 of its 57 s: the next three share the 370 s left.
    second = check.stage_budget(370.0, stages[1:])
    assert second == pytest.approx(370.0 * check.SHARES[stages[1]] / (1 - check.SHARES[stages[0]]))
    assert second > 380.0 * check.SHARES[stages[1]]  # the 47 s the first left are passed on
    assert check.stage_budget(0.0, stages) == 0.0
