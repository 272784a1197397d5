"""`ProcessGroup` across two JAX processes: collectives whose arrival is far apart (an RL
step's straggler slice or a longer share of micro-batches: gloo alone gives up after 30 s), and
the coordination service's values deleted once every process has read them."""

import os
import subprocess
import sys

from rl_testing import REPO


def _run_two_processes(peer_script: str, **env_vars: str) -> None:
    """`tests/<peer_script>` as 2 processes under `scripts/launch_local.py`; both must say ok."""
    env = dict(os.environ, **env_vars)
    env["XLA_FLAGS"] = env["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=8", "")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, str(REPO / "scripts" / "launch_local.py"), "--num_processes", "2",
               "--", sys.executable, str(REPO / "tests" / peer_script)]  # fmt: skip
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "[0] process 0: ok" in run.stdout and "[1] process 1: ok" in run.stdout


def test_collectives_wait_for_a_peer_that_arrives_late():
    _run_two_processes("collective_peer.py", TLT_TEST_LATE_S="35")  # past gloo's 30 s


def test_a_steps_values_leave_the_coordination_service_at_the_end_of_the_next():
    # Every step wrote completions, statistics and the drafter's host state into the
    # coordinator's memory and nothing deleted them: a long run's store grew without bound.
    _run_two_processes("kv_peer.py")
