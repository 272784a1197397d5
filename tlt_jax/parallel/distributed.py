"""The run's processes: `jax.distributed` (multi-controller) and its coordination service.

A run spans N processes when `TLT_COORDINATOR`, `TLT_NUM_PROCESSES` and `TLT_PROCESS_ID` are
set (`scripts/launch_local.py` sets them on one machine; on a cluster set them per host, or
pass the same values to `jax.distributed.initialize` as JAX documents). On CPU the collectives
are gloo's.

`ProcessGroup` is what the trainer and the spot scheduler use across processes, all of it
JAX's own runtime: the coordination service's key-value store for small host values (a claim
that only the first caller wins, completions, counters; JSON) and barriers, and
`multihost_utils.broadcast_one_to_all` and a jitted sum over a one-device-per-process mesh
(collectives) for arrays. With one process every call
is local and free.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

log = logging.getLogger(__name__)

ENV_COORDINATOR = "TLT_COORDINATOR"
ENV_NUM_PROCESSES = "TLT_NUM_PROCESSES"
ENV_PROCESS_ID = "TLT_PROCESS_ID"
# Optional: this process's accelerators among the host's ("0,1"); JAX's `local_device_ids`.
# Outside TPU, Slurm or Open MPI every process otherwise sees every GPU of its host, so two
# processes' slices would share one device (`launch_local.py --devices_per_process` sets it).
ENV_LOCAL_DEVICE_IDS = "TLT_LOCAL_DEVICE_IDS"
TIMEOUT_MS = 30 * 60 * 1000  # a straggler's whole rollout may pass before a value is set
# Process 0 alone evaluates (before and after training) while the others wait for it: as long
# as an evaluation may take (a 7B model's full GSM8K test split runs for hours).
EVAL_TIMEOUT_MS = 24 * 60 * 60 * 1000
# JAX's shutdown barrier (every process waits there for the others as it exits) aborts them
# all after `shutdown_timeout_seconds`; the run's own barriers above make the processes end
# together, so this only bounds a peer that died without reaching them.
SHUTDOWN_TIMEOUT_S = 600


def parse_coordinator(value: str) -> tuple[str, int]:
    """(host, port) of a `TLT_COORDINATOR` value `host:port`.

    Raises:
      ValueError: naming the variable, when there is no host or the port is not an integer
        in 1..65535 (JAX failed with a bare IndexError on a value without a port).
    """
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{ENV_COORDINATOR}={value!r} must be host:port with a port in "
                         "1..65535 (the coordinator is process 0's host)")  # fmt: skip
    return host, int(port)


def parse_local_device_ids(value: str | None) -> list[int] | None:
    """The `TLT_LOCAL_DEVICE_IDS` value as JAX's `local_device_ids` (None when unset).

    Raises:
      ValueError: naming the variable, unless it is comma-separated distinct integers >= 0.
    """
    if not value:
        return None
    parts = [p.strip() for p in value.split(",")]
    if not all(p.isdigit() for p in parts) or len(set(parts)) != len(parts):
        raise ValueError(f"{ENV_LOCAL_DEVICE_IDS}={value!r} must be distinct device ids >= 0, "
                         "comma-separated (e.g. '0,1')")  # fmt: skip
    return [int(p) for p in parts]


def initialize_from_env() -> bool:
    """`jax.distributed.initialize` from the `TLT_*` variables; False when they are unset.

    Raises:
      ValueError: when only some of the variables are set, or they are not integers.
    """
    names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
    values = [os.environ.get(n) for n in names]
    if not any(values):
        return False
    if not all(values):
        raise ValueError(f"set all of {list(names)} or none; got "
                         f"{dict(zip(names, values, strict=True))}")  # fmt: skip
    try:
        count, index = int(values[1]), int(values[2])
    except ValueError as e:
        raise ValueError(f"{ENV_NUM_PROCESSES}={values[1]!r} and {ENV_PROCESS_ID}={values[2]!r} "
                         "must be integers") from e  # fmt: skip
    if not 0 <= index < count:
        raise ValueError(f"{ENV_PROCESS_ID}={index} must be in [0, {ENV_NUM_PROCESSES}={count})")
    parse_coordinator(values[0])
    local_ids = parse_local_device_ids(os.environ.get(ENV_LOCAL_DEVICE_IDS))
    if (os.environ.get("JAX_PLATFORMS") or "cpu").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(values[0], num_processes=count, process_id=index,
                               local_device_ids=local_ids,
                               shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)  # fmt: skip
    return True


@contextlib.contextmanager
def exit_on_failure() -> Iterator[None]:
    """Around a multi-process run's work: an exception in this process prints its traceback
    and ends the process at once with status 1 (one process: it propagates as usual).

    A failing process that exits normally waits in JAX's shutdown barrier for the others,
    which wait for it in a collective: every process hung until the barrier's timeout and then
    aborted (SIGABRT, status 134 from the launcher, five minutes late). Exiting at once, the
    launcher (or the cluster's scheduler) sees the failure and stops the others."""
    try:
        yield
    except BaseException as e:
        clean = isinstance(e, SystemExit) and e.code in (0, None)  # ends like any other exit
        # Not `jax.process_count()`: before `initialize_from_env` it would start the backends
        # (and take the GPUs) only to re-raise.
        if clean or not jax.distributed.is_initialized():
            raise
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


class ProcessGroup:
    """This process's view of the run's processes (one process: everything local)."""

    def __init__(self, namespace: str = "tlt"):
        self.index = jax.process_index()
        self.count = jax.process_count()
        self.namespace = namespace
        self._local: dict[str, str] = {}
        self._reduce = None  # (sharding, program, device) of `allreduce_sum`
        self._collectives = 0  # collectives so far (the same sequence on every process)
        # Keys this process wrote in this RL step, and in the one before (`end_step` deletes
        # the second list): the coordination service holds about two steps of values, not
        # every step's since the run began.
        self._written: list[str] = []
        self._written_before: list[str] = []

    @property
    def is_primary(self) -> bool:
        """Process 0 writes the run's metrics, checkpoints and exports."""
        return self.index == 0

    @property
    def _client(self):
        from jax._src import distributed

        return distributed.global_state.client

    def _key(self, key: str) -> str:
        return f"{self.namespace}/{key}"

    def claim(self, key: str) -> bool:
        """True for the first process that claims `key` (atomic in the coordination service)."""
        if self.count == 1:
            if key in self._local:
                return False
            self._local[key] = "0"
            return True
        try:
            self._client.key_value_set(self._key(key), str(self.index))
        except Exception as e:  # ALREADY_EXISTS: another process was first
            if "ALREADY_EXISTS" not in str(e):
                raise
            return False
        self._written.append(self._key(key))
        return True

    def owner(self, key: str) -> int | None:
        """The process that claimed `key`, or None (read after a `barrier` to agree on it)."""
        if self.count == 1:
            return 0 if key in self._local else None
        try:
            return int(self._client.key_value_try_get(self._key(key)))
        except Exception as e:  # NOT_FOUND: nobody claimed it
            if "NOT_FOUND" not in str(e):
                raise
            return None

    def set(self, key: str, value: Any) -> None:
        """Publishes a JSON value under `key` for this process (`key/<index>`)."""
        if self.count > 1:
            full = self._key(f"{key}/{self.index}")
            self._client.key_value_set(full, json.dumps(value))
            self._written.append(full)

    def count_set(self, key: str) -> int:
        """How many processes have `set(key, ...)` so far (non-blocking)."""
        if self.count == 1:
            return 0
        return len(self._client.key_value_dir_get(self._key(key) + "/"))

    def wait_for(self, key: str, process: int, timeout_ms: int = TIMEOUT_MS) -> Any:
        """Blocks until `process` has `set(key, ...)`; returns its value."""
        raw = self._client.blocking_key_value_get(self._key(f"{key}/{process}"), timeout_ms)
        return json.loads(raw)

    def allgather(self, key: str, value: Any) -> list[Any]:
        """Every process's `value` in process order (JSON through the key-value store)."""
        if self.count == 1:
            return [value]
        self.set(key, value)
        return [value if p == self.index else self.wait_for(key, p) for p in range(self.count)]

    def barrier(self, name: str, timeout_ms: int = TIMEOUT_MS) -> None:
        if self.count > 1:
            self._client.wait_at_barrier(self._key(name), timeout_ms)

    def end_step(self) -> None:
        """Deletes the values this process wrote before the RL step that ends here.

        Call it on every process at the end of every step, after an `allgather` of that step
        (the trainer's digest check). Every value is read within the step that writes it (an
        `allgather` reads its peers' values before it returns; a rollout's `done` / `start`
        values during that rollout; the trainer claim at the step's boundary). A process
        that has read every peer's value of step s + 1 knows each peer finished step s and
        its reads, so step s's values can go.
        """
        stale, self._written_before, self._written = self._written_before, self._written, []
        for key in stale:
            try:
                self._client.key_value_delete(key)
            except Exception:  # only the coordinator's memory is at stake; the run goes on
                log.debug("could not delete %s from the coordination service", key,
                          exc_info=True)  # fmt: skip

    def _arrive(self, tree: Any) -> None:
        """Waits until `tree` is computed here and every process has reached this collective.

        Gloo gives up on a peer after 30 s (its context set-up on the first collective:
        `GetKeyValue() timed out`), while the processes of an RL step can reach a collective
        minutes apart (one process's micro-batches, or its slice's straggler, take longer). The
        coordination service's barrier waits up to `TIMEOUT_MS`, so the collective itself then
        starts on every process at once. The inputs are awaited first: with asynchronous
        dispatch a process would otherwise pass the barrier long before its collective runs.
        """
        jax.block_until_ready(tree)
        self._collectives += 1
        self.barrier(f"collective/{self._collectives}")

    def allreduce_sum(self, tree: Any) -> Any:
        """The element-wise sum of every process's `tree` (arrays on this process's first
        local device), on every process, placed like the input (a gloo all-reduce on CPU)."""
        if self.count == 1:
            return tree
        self._arrive(tree)
        if self._reduce is None:
            from jax.sharding import Mesh, NamedSharding, PartitionSpec

            firsts = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
                      for p in range(self.count)]  # fmt: skip
            mesh = Mesh(np.array(firsts), ("processes",))
            split = NamedSharding(mesh, PartitionSpec("processes"))
            whole = NamedSharding(mesh, PartitionSpec())
            total = jax.jit(lambda t: jax.tree.map(lambda a: a.sum(0), t), out_shardings=whole)
            self._reduce = (split, total, firsts[self.index])
        split, total, device = self._reduce

        def stacked(x):
            local = jax.device_put(x, device)[None]
            return jax.make_array_from_single_device_arrays((self.count, *x.shape), split,
                                                            [local])  # fmt: skip

        summed = total(jax.tree.map(stacked, tree))
        return jax.tree.map(lambda a, x: jax.device_put(a.addressable_data(0), x.sharding),
                            summed, tree)  # fmt: skip

    def broadcast(self, tree: Any, source: int) -> Any:
        """`tree` as process `source` holds it, on every process (host numpy arrays)."""
        if self.count == 1:
            return tree
        from jax.experimental import multihost_utils

        self._arrive(tree)
        return multihost_utils.broadcast_one_to_all(
            jax.device_get(tree), is_source=self.index == source
        )
