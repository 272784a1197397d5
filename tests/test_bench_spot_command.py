"""bench_spot's recorded command reproduces the run: the launcher that started its processes
(`launch_local.py`, with its flags) and the environment a one-process run needs."""

from __future__ import annotations

import os
import subprocess
import sys

from rl_testing import REPO

from tlt_jax.rl.bench_spot import reproducing_command

ARGV = ["scripts/bench_spot.py", "--output_json", "/tmp/b.json"]


def test_the_command_names_the_launcher_and_its_flags():
    launcher = "python scripts/launch_local.py --num_processes=2 --pin_cores"
    got = reproducing_command(ARGV, {"TLT_LAUNCHER": launcher})
    assert got == f"{launcher} -- python scripts/bench_spot.py --output_json /tmp/b.json"
    # One process on two fake CPU devices: the flag it ran with is part of the command.
    flags = "--xla_force_host_platform_device_count=2"
    got = reproducing_command(ARGV, {"XLA_FLAGS": flags})
    assert got == f"XLA_FLAGS={flags} python scripts/bench_spot.py --output_json /tmp/b.json"
    assert reproducing_command(ARGV, {}) == "python scripts/bench_spot.py --output_json /tmp/b.json"


def test_launch_local_tells_its_processes_how_they_were_started():
    pin = len(os.sched_getaffinity(0)) >= 2
    probe = "import os; print('LAUNCHER=' + os.environ['TLT_LAUNCHER'])"
    done = subprocess.run(
        [sys.executable, "scripts/launch_local.py", "--num_processes=2",
         *(["--pin_cores"] if pin else []), "--", sys.executable, "-c", probe],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    want = "python scripts/launch_local.py --num_processes=2" + (" --pin_cores" if pin else "")
    lines = [line for line in done.stdout.splitlines() if "LAUNCHER=" in line]
    assert sorted(lines) == [f"[0] LAUNCHER={want}", f"[1] LAUNCHER={want}"]


def test_launch_local_exits_as_a_shell_reports_a_killed_process():
    """A process killed by a signal makes the launcher exit 128 + N (137 for SIGKILL), as a
    shell reports it; Popen's -N used to reach sys.exit and exit 247."""
    kill = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    done = subprocess.run(
        [sys.executable, "scripts/launch_local.py", "--num_processes=1", "--", sys.executable,
         "-c", kill],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 137, done.stdout + done.stderr
    assert "process 0 was killed by SIGKILL" in done.stdout
