r"""Runs a command as N JAX processes on this machine (coordinator on localhost).

    python scripts/launch_local.py --num_processes 2 --pin_cores -- \
        python scripts/train.py --config configs/tiny.py:tlt --workdir /tmp/tlt_spot2

Each process gets `TLT_COORDINATOR`, `TLT_NUM_PROCESSES` and `TLT_PROCESS_ID`, which
`tlt_jax.parallel.distributed.initialize_from_env` hands to `jax.distributed.initialize` (gloo
collectives on CPU), and `TLT_LAUNCHER`, this launcher's own command line (a benchmark records
it with its command, so the command reproduces the run). `--pin_cores` pins process i to core
i (`os.sched_setaffinity`), so on a 2-core CPU an idle process's core is physically idle. On
a cluster, start the same command once per host with the same variables instead (process ids
0..N-1, the coordinator's host:port).

Output lines are prefixed with the process id. When one process fails, the others are stopped
and the launcher exits with the failing process's status.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app, flags

flags.DEFINE_integer("num_processes", 2, "Processes to start.")
flags.DEFINE_bool("pin_cores", False, "Pin process i to CPU core i (Linux).")
flags.DEFINE_integer(
    "port", 0, "Coordinator port on localhost (0: a free one).", lower_bound=0, upper_bound=65535
)
flags.DEFINE_integer(
    "devices_per_process", 0,
    "Accelerators per process: process i gets the host's devices i*N .. i*N+N-1 "
    "(TLT_LOCAL_DEVICE_IDS, JAX's local_device_ids). 0: JAX's default, every process sees "
    "every device of the host, which on a GPU host puts every process's slices on the same "
    "devices. Not for CPU devices.", lower_bound=0)  # fmt: skip
FLAGS = flags.FLAGS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _relay(index: int, stream) -> None:
    for line in iter(stream.readline, b""):
        sys.stdout.write(f"[{index}] {line.decode(errors='replace')}")
        sys.stdout.flush()


def _stop(procs, grace_s: float = 10.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def main(argv):
    command = argv[1:]
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise app.UsageError("give the command after --")
    if FLAGS.num_processes < 1:
        raise app.UsageError(f"--num_processes={FLAGS.num_processes} must be >= 1")
    cores = sorted(os.sched_getaffinity(0)) if FLAGS.pin_cores else []
    if FLAGS.pin_cores and FLAGS.num_processes > len(cores):
        raise app.UsageError(f"--pin_cores with --num_processes={FLAGS.num_processes}: only "
                             f"{len(cores)} cores are available ({cores})")  # fmt: skip
    address = f"localhost:{FLAGS.port or _free_port()}"
    # How the processes were started, for a command a process records (`bench_spot.py`).
    launcher = (f"python scripts/launch_local.py --num_processes={FLAGS.num_processes}"
                + (" --pin_cores" if FLAGS.pin_cores else "")
                + (f" --devices_per_process={FLAGS.devices_per_process}"
                   if FLAGS.devices_per_process else ""))  # fmt: skip
    procs, relays = [], []
    for i in range(FLAGS.num_processes):
        env = dict(os.environ, TLT_COORDINATOR=address, TLT_LAUNCHER=launcher,
                   TLT_NUM_PROCESSES=str(FLAGS.num_processes), TLT_PROCESS_ID=str(i))  # fmt: skip
        if FLAGS.devices_per_process:
            n = FLAGS.devices_per_process
            env["TLT_LOCAL_DEVICE_IDS"] = ",".join(str(i * n + k) for k in range(n))
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)  # fmt: skip
        if FLAGS.pin_cores:
            # Pinned from here, not in `preexec_fn` (unsafe once the relay threads run); the
            # process has only started its interpreter, and its threads inherit the pinning.
            os.sched_setaffinity(proc.pid, {cores[i]})
        procs.append(proc)
        relay = threading.Thread(target=_relay, args=(i, proc.stdout), daemon=True)
        relay.start()
        relays.append(relay)
    status = 0
    pending = set(range(len(procs)))

    # Stopping the launcher stops its processes (a JAX process blocked in the coordination
    # service can outlive SIGTERM: it gets SIGKILL after a grace period).
    def on_signal(signum, _frame):
        _stop(procs)
        sys.exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    while pending:
        for i in list(pending):
            code = procs[i].poll()
            if code is None:
                continue
            pending.discard(i)
            if code and not status:
                # A process killed by a signal exits as a shell reports it (128 + N), not
                # Popen's -N, which sys.exit would wrap to 256 - N (247 for SIGKILL).
                status = 128 - code if code < 0 else code
                how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with {code}"
                print(f"[launch_local] process {i} {how}; stopping the others", flush=True)
                _stop([procs[j] for j in pending])
        if pending:
            try:
                procs[min(pending)].wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
    for relay in relays:
        relay.join(timeout=5)
    sys.exit(status)


if __name__ == "__main__":
    app.run(main)
