"""`ProcessGroup` across two JAX processes: collectives whose arrival is far apart (an RL
step's straggler slice or a longer share of micro-batches: gloo alone gives up after 30 s), and
the coordination service's values deleted once every process has read them."""

import os
import subprocess
import sys
import time

import pytest
from rl_testing import REPO

from tlt_jax.parallel import distributed


def _launch(peer_script: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_vars)
    env["XLA_FLAGS"] = env["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=8", "")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, str(REPO / "scripts" / "launch_local.py"), "--num_processes", "2",
               "--", sys.executable, str(REPO / "tests" / peer_script)]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def _run_two_processes(peer_script: str, **env_vars: str) -> None:
    """`tests/<peer_script>` as 2 processes under `scripts/launch_local.py`; both must say ok."""
    run = _launch(peer_script, **env_vars)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "[0] process 0: ok" in run.stdout and "[1] process 1: ok" in run.stdout


def test_collectives_wait_for_a_peer_that_arrives_late():
    _run_two_processes("collective_peer.py", TLT_TEST_LATE_S="35")  # past gloo's 30 s


def test_a_steps_values_leave_the_coordination_service_at_the_end_of_the_next():
    # Every step wrote completions, statistics and the drafter's host state into the
    # coordinator's memory and nothing deleted them: a long run's store grew without bound.
    _run_two_processes("kv_peer.py")


def test_a_failing_process_stops_the_run_at_once_with_status_1():
    # It used to exit through JAX's shutdown barrier while its peer waited for it: both hung
    # for five minutes, then aborted (the launcher's status 134, SIGABRT).
    start = time.monotonic()
    run = _launch("failing_peer.py")
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr[-4000:]
    assert "process 1 failed on purpose" in run.stdout
    assert "[launch_local] process 1 exited with 1" in run.stdout
    assert time.monotonic() - start < 120


def test_coordinator_and_device_ids_are_checked_by_name():
    assert distributed.parse_coordinator("10.0.0.2:1234") == ("10.0.0.2", 1234)
    for bad in ("localhost", "localhost:", ":1234", "host:70000", "host:x"):
        with pytest.raises(ValueError, match="TLT_COORDINATOR=.*host:port"):
            distributed.parse_coordinator(bad)
    assert distributed.parse_local_device_ids("2,3") == [2, 3]
    assert distributed.parse_local_device_ids("") is None
    for bad in ("0,0", "a", "-1", "0,,1"):
        with pytest.raises(ValueError, match="TLT_LOCAL_DEVICE_IDS="):
            distributed.parse_local_device_ids(bad)


def test_launcher_refuses_a_port_out_of_range():
    # --port 70000 was accepted and bound port 4464 (70000 - 65536).
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "launch_local.py"),
                          "--port=70000", "--", "true"], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert run.returncode != 0 and "--port" in run.stderr and "65535" in run.stderr


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_pin_cores_pins_process_i_to_core_i():
    cores = sorted(os.sched_getaffinity(0))[:2]
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "launch_local.py"),
                          "--num_processes=2", "--pin_cores", "--", sys.executable, "-c",
                          "import os; print(sorted(os.sched_getaffinity(0)))"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert f"[0] [{cores[0]}]" in run.stdout and f"[1] [{cores[1]}]" in run.stdout
