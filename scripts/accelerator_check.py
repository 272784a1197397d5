r"""Every accelerator figure in one command: kernels, the SD crossover and the RL loop on a GPU.

On the device (one GPU, at most 8 minutes; results and logs under --out_dir):

  scripts/device_wheels.sh   # here, once: the packages the device image lacks, into .whl/
  # there:
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  PYTHONPATH=/tmp/site:$PWD python3 scripts/accelerator_check.py --out_dir=$OUT

Here, as CI and every session can (tiny shapes, Pallas interpret mode, about two minutes):

  python scripts/accelerator_check.py --dry_run --out_dir=/tmp/accelerator_check

Stages, each its own process with its own time limit, so one failing or hanging keeps the
others' figures (`accelerator_check.json` is rewritten after every stage):
  a. `tree_attention_tests`: tests/test_tree_attention.py with the kernel compiled (not
     interpreted) on a GPU: the test class's compiled half (its interpreted half runs on CPU).
  b. `bench_kernels`: tree-verify and decode attention on the 7B head shapes, XLA vs Pallas vs
     the CUDA paths (scripts/bench_kernels.py), time and HBM fraction.
  c. `sd_crossover`: plain vs SD step times of the random-init Qwen2.5-1.5B preset (bf16) at
     batches 1, 128, 16 (in that order, as many as the budget allows; each compiles its own
     programs) for strategy 3,1,4, XLA and Pallas attention (scripts/sd_crossover.py): where
     the crossover lies and plain decoding's HBM fraction at batch 1.
  d. `rl_loop`: three steps (two in the dry run) of the RL loop with TLT (adaptive SD) on the
     tiny preset (scripts/train.py, configs/tiny.py:tlt): its phase split and SD share. One
     GPU is one rollout slice, so spot training (two slices) runs in the dry run only.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from absl import app, flags

from tlt_jax.files import write_text_atomic

REPO = Path(__file__).resolve().parent.parent
_OUT_DIR = flags.DEFINE_string("out_dir", os.environ.get("OUT"), "Where results and logs go.")
_SCRATCH_DIR = flags.DEFINE_string(
    "scratch_dir",
    "/tmp/accelerator_check",
    "The RL run's workdir and the test report (the "
    "device returns at most 8 files from $OUT: the JSON, the log, the stage logs and results).",
)
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "CPU: tiny shapes, interpret mode, 2 fake devices.")
_BUDGET_S = flags.DEFINE_float("budget_s", 480.0, "Total seconds; split over the stages.")
_STAGES = flags.DEFINE_list("stages", ["tree_attention_tests", "bench_kernels", "sd_crossover",
                                       "rl_loop"], "Stages to run, in order.")  # fmt: skip

# Share of the budget per stage (each stage's own budget flags leave it a margin to finish).
SHARES = {"tree_attention_tests": 0.15, "bench_kernels": 0.35, "sd_crossover": 0.32,
          "rl_loop": 0.18}  # fmt: skip


DRY_TREE_ATTENTION_TESTS = (
    "not bfloat16 and (not matches_reference or decode) and "
    "not interpret_mode and not ignores_cache and not scale_and"
)


def stage_budget(seconds_left: float, stages_left: list[str]) -> float:
    """The first of `stages_left`'s seconds: its share of what the check has left."""
    return seconds_left * SHARES[stages_left[0]] / sum(SHARES[s] for s in stages_left)


def _stage_argv(name: str, out: Path, scratch: Path, budget: float, dry: bool) -> list[str]:
    py = sys.executable
    if name == "tree_attention_tests":
        # On the device -v: each test's name and verdict is a line of the log as it finishes
        # (the JUnit report is written only at the end, and a stage past its limit is killed).
        argv = [py, "-m", "pytest", "-q" if dry else "-v", "-p", "no:cacheprovider",
                "tests/test_tree_attention.py",
                f"--junitxml={scratch / 'tree_attention_tests.xml'}"]  # fmt: skip
        # Dry: the plumbing only (the suite runs the whole file); interpret mode is slow, so
        # one interpreted kernel case and the cheap checks. Device: the class's interpreted
        # half (ids ending "-True", 17 tests the CPU suite runs) is left out: alternating with
        # the compiled cases, each compiling its own programs, it spent the 72 s limit twice.
        return argv + ["-k", DRY_TREE_ATTENTION_TESTS if dry else "not True"]
    if name == "bench_kernels":
        return [py, "scripts/bench_kernels.py", f"--shapes={'tiny' if dry else 'device'}",
                f"--budget_s={max(budget - 40, 5):.0f}",
                f"--output_json={out / 'bench_kernels.json'}"]  # fmt: skip
    if name == "sd_crossover":
        argv = [py, "scripts/sd_crossover.py", f"--output_json={out / 'sd_crossover.json'}",
                f"--budget_s={max(budget / 2 - 40, 5):.0f}"]  # fmt: skip
        if dry:  # the tiny preset; Pallas in interpret mode is minutes, so XLA only
            argv += ["--attention_impls=xla", "--strategy=3,1,4", "--max_batch=2", "--steps=4"]
        else:
            # Every batch compiles its programs for the 28-layer model: plain prefill and
            # decode plus draft, tree, verify and commit per strategy (14 s of XLA:CPU compile
            # for one strategy at batch 1 on the CPU), so 9 batches x 3 strategies x 2 paths
            # cannot fit; spread batches, one strategy, and each batch's figures are written.
            argv += ["--strategy=3,1,4", "--max_batch=128", "--batches=1,128,16"]
        return argv
    if name == "rl_loop":
        argv = [py, "scripts/train.py", "--config=configs/tiny.py:tlt",
                f"--workdir={scratch / 'rl_tiny'}", f"--config.total_steps={2 if dry else 3}",
                "--config.checkpoint_every=3", "--config.eval.num_problems=0"]  # fmt: skip
        if not dry:  # one device is one rollout slice: no idle slice to train on
            argv += ["--config.spot.enabled=False", "--config.spot.slices=1"]
        return argv
    raise app.UsageError(f"--stages: {name!r} is not one of {list(SHARES)}")


def _env(dry: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    if dry:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            " --xla_force_host_platform_device_count=2").strip()  # fmt: skip
    else:
        env.pop("JAX_PLATFORMS", None)
        env["JAX_PLATFORMS"] = ""  # tests/conftest.py defaults to cpu unless it is set
    return env


def _run(argv: list[str], log: Path, timeout: float, env: dict) -> tuple[int | None, float]:
    """Runs `argv` (its own process group) into `log`; rc None when it ran out of time."""
    start = time.perf_counter()
    with log.open("w") as f:
        f.write("$ " + " ".join(shlex.quote(a) for a in argv) + "\n")
        f.flush()
        # Its own process group (killed whole at its limit) in this session: a new session
        # (setsid) would outlive a device call stopped at its time limit, holding the GPU.
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                process_group=0)  # fmt: skip
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return rc, time.perf_counter() - start


_VERDICT = re.compile(r"^(tests/\S+::(\S+)) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def _verdicts_from_log(log: Path) -> dict:
    """The counts of a pytest -v log (what a stage killed before pytest wrote its JUnit
    report still printed): one line per test as it finished."""
    if not log.is_file():
        return {}
    found = {}
    for line in log.read_text(errors="replace").splitlines():
        match = _VERDICT.match(line)
        if match:
            found[match.group(2)] = match.group(3)
    if not found:
        return {}
    return {"tests": len(found), "failed": [n for n, v in found.items() if v in ("FAILED",
                                                                             "ERROR")],
            "skipped": sum(v == "SKIPPED" for v in found.values()),
            "compiled_cases": sum("False" in n for n in found), "from_log": True}  # fmt: skip


def _junit(path: Path, log: Path | None = None) -> dict:
    if not path.is_file():
        return _verdicts_from_log(log) if log is not None else {}
    suite = ElementTree.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    cases = suite.findall("testcase")
    failed = [c.get("name") for c in cases if c.find("failure") is not None
              or c.find("error") is not None]  # fmt: skip
    return {"tests": len(cases), "failed": failed, "skipped": int(suite.get("skipped", 0)),
            "compiled_cases": sum("False" in (c.get("name") or "") for c in cases)}  # fmt: skip


def _rl_summary(workdir: Path) -> dict:
    path = workdir / "metrics.jsonl"
    if not path.is_file():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "time_rollout" in r]
    if not steps:
        return {}
    phases = {k: round(sum(r[k] for r in steps) / len(steps), 3)
              for k in steps[0] if k.startswith("time_")}  # fmt: skip
    keep = (
        "sd_step_share",
        "long_tail_share",
        "tokens_per_s",
        "sd_steps",
        "accept_len_ngram",
        "accept_len_eagle",
        "spot_reclaimed_share",
        "drafter_version",
        "step_time",
    )
    last = {k: steps[-1][k] for k in keep if k in steps[-1]}
    return {"steps": len(steps), "mean_phase_s": phases, "last_step": last}


def _summary(name: str, out: Path, scratch: Path) -> dict:
    """The stage's key figures from the files it wrote."""
    if name == "tree_attention_tests":
        return _junit(scratch / "tree_attention_tests.xml", out / f"{name}.log")
    if name == "rl_loop":
        return _rl_summary(scratch / "rl_tiny")
    path = out / f"{name}.json"
    if not path.is_file():
        return {}
    try:  # a stage killed while writing must not end the check (the later stages' figures)
        result = json.loads(path.read_text())
    except ValueError as error:
        return {"error": f"{path.name} does not parse: {error}"}
    if name == "bench_kernels":
        keys = ("summary", "truncated", "skipped_budget", "in_progress")
        return {k: result.get(k) for k in keys} | {"rows": len(result.get("results", []))}
    by_impl = result.get("by_attention", {})
    return {
        impl: {k: v for k, v in r.items() if k != "rows"}
        | ({"batch_1": r["rows"][0]} if r.get("rows") else {})
        for impl, r in by_impl.items()
    }


# In the scratch folder this script made, so that it only ever deletes a folder of its own.
SCRATCH_MARK = ".accelerator_check_scratch"


def _fresh_scratch(scratch: Path) -> None:
    """Empties the scratch folder (a run's workdir there would resume the last run's
    checkpoint): one this script made (it holds `SCRATCH_MARK`) is removed, a new or empty one
    is used, and any other folder or file is refused rather than deleted."""
    if scratch.exists():
        if not scratch.is_dir() or (any(scratch.iterdir())
                                    and not (scratch / SCRATCH_MARK).is_file()):  # fmt: skip
            raise app.UsageError(
                f"--scratch_dir={scratch} exists and is not a scratch folder this script made "
                f"(no {SCRATCH_MARK} in it); it deletes its scratch folder on every run, so "
                "give a new or empty path")  # fmt: skip
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    (scratch / SCRATCH_MARK).write_text("made by scripts/accelerator_check.py; deleted by it\n")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not _OUT_DIR.value:
        raise app.UsageError("--out_dir is required (or set $OUT)")
    if not _STAGES.value:
        raise app.UsageError(f"--stages is empty; give one or more of {list(SHARES)}")
    unknown = sorted(set(_STAGES.value) - set(SHARES))
    if unknown:
        raise app.UsageError(f"--stages {unknown} are not among {list(SHARES)}")
    out, scratch = Path(_OUT_DIR.value), Path(_SCRATCH_DIR.value)
    _fresh_scratch(scratch)
    out.mkdir(parents=True, exist_ok=True)
    dry = _DRY_RUN.value
    env = _env(dry)
    command = " ".join(shlex.quote(a) for a in ["python", *sys.argv])
    report = {"command": command, "dry_run": dry, "budget_s": _BUDGET_S.value, "stages": {}}
    log = (out / "accelerator_check.log").open("w")

    def say(text: str) -> None:
        print(text, flush=True)
        log.write(text + "\n")
        log.flush()

    say(f"command: {command}")
    # --budget_s holds everything from here: the start-up probe, and each stage's share of
    # what is left when it starts (a stage that ends early passes its time on).
    deadline = time.monotonic() + _BUDGET_S.value
    probe_s = min(120.0, 0.15 * _BUDGET_S.value)
    try:  # a hung start-up must not end the check before its stages (each has a limit)
        # protobuf too: the carried tensorflow-metadata wheel's generated code checks the
        # runtime's version at import (rl_loop's TFDS import fails on an older one).
        probe = subprocess.run([sys.executable, "-c", "import jax; d = jax.devices()[0]; "
                                "import importlib.metadata as m; "
                                "print(jax.__version__, jax.default_backend(), d.device_kind, "
                                "len(jax.devices()), 'protobuf', m.version('protobuf'))"],
                               cwd=REPO, env=env, capture_output=True, text=True,
                               timeout=probe_s)  # fmt: skip
        report["platform"] = (probe.stdout or probe.stderr).strip().splitlines()[-1:]
    except subprocess.TimeoutExpired:
        report["platform"] = [f"probe timed out after {probe_s:.0f} s"]
    say(f"jax version, backend, device, count, protobuf: {report['platform']}")
    for i, name in enumerate(_STAGES.value):
        budget = stage_budget(max(deadline - time.monotonic(), 0.0), _STAGES.value[i:])
        argv = _stage_argv(name, out, scratch, budget, dry)
        rc, seconds = _run(argv, out / f"{name}.log", budget, env)
        for partial in out.glob("*.tmp"):  # a stage killed mid-write: the device returns 8 files
            partial.unlink()
        status = "ok" if rc == 0 else "timeout" if rc is None else f"failed (rc {rc})"
        try:  # a summary that cannot be read is the stage's result, not the check's end
            summary = _summary(name, out, scratch)
        except Exception as error:
            summary = {"error": f"{type(error).__name__}: {error}"[:2000]}
            status = status if status != "ok" else "ok (summary unreadable)"
        report["stages"][name] = {"status": status, "seconds": round(seconds, 1),
                                  "budget_s": round(budget), "log": f"{name}.log",
                                  "summary": summary}  # fmt: skip
        say(f"{name}: {status} in {seconds:.0f} s (budget {budget:.0f} s)\n"
            + json.dumps(report["stages"][name]["summary"], indent=1))  # fmt: skip
        write_text_atomic(out / "accelerator_check.json", json.dumps(report, indent=1))
    failed = [n for n, s in report["stages"].items() if s["status"] != "ok"]
    say(f"wrote {out / 'accelerator_check.json'}; stages not ok: {failed or 'none'}")
    log.close()
    return 1 if failed else 0


if __name__ == "__main__":
    app.run(main)
