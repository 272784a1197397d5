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

import json
import logging
import os
from typing import Any

import jax
import numpy as np

log = logging.getLogger(__name__)

ENV_COORDINATOR = "TLT_COORDINATOR"
ENV_NUM_PROCESSES = "TLT_NUM_PROCESSES"
ENV_PROCESS_ID = "TLT_PROCESS_ID"
TIMEOUT_MS = 30 * 60 * 1000  # a straggler's whole rollout may pass before a value is set


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
    if (os.environ.get("JAX_PLATFORMS") or "cpu").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(values[0], num_processes=count, process_id=index)
    return True


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
