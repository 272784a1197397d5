"""One pool of ahead-of-time compiled programs for the trainer and the rollout engine.

The JAX counterpart of TLT's bucketed CUDA-graph pool: every device program is lowered and
compiled once per static key (program name and bucketed shapes) and kept; steady state never
traces. The pool reports each program's compile seconds and XLA's memory analysis, so a run can
say how many programs it compiled, how long that took and how much executable memory
(arguments, outputs, temporaries, generated code) the pool holds.

Pools share what they compile within a process (`SharedPrograms`): two engines or trainers of
the same config (the sides of a benchmark, the engines a test compares) lower the same
programs, and the second one reuses the first one's executables instead of compiling them
again.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass
class CompiledInfo:
    key: tuple
    seconds: float  # lowering and compiling (lowering only when `reused`)
    memory: dict[str, int]
    reused: bool = False  # the executable another pool of this process had compiled


def _devices(sharding) -> tuple | None:
    """The devices a sharding places on, in its order (a mesh's with its axis names); None
    for a sharding that names no devices (unspecified: the compiler would choose)."""
    mesh = getattr(sharding, "mesh", None)
    if isinstance(mesh, jax.sharding.Mesh):
        return (*(d.id for d in np.asarray(mesh.devices).flat), *mesh.axis_names)
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return tuple(d.id for d in sharding.device_set)
    return None


def check_opt_level(level: Any, field: str) -> None:
    """Refuses an XLA backend optimisation level (`xla_backend_optimization_level`) other than
    None or an integer in 0..3, naming the config `field` it came from."""
    if level is not None and (not isinstance(level, int) or isinstance(level, bool)
                              or not 0 <= level <= 3):  # fmt: skip
        raise ValueError(f"{field}={level!r} must be an integer in 0..3 (XLA's backend "
                         "optimisation level) or None (per backend)")  # fmt: skip


class SharedPrograms:
    """Executables by what they compile, shared by every `ProgramPool` of the process.

    Two lowerings get one executable only when everything the executable depends on is the
    same: the lowered module's text (operations, constants, shardings, donation), the argument
    and result trees, the arguments kept after pruning, and the devices of every input and
    output sharding, in order (the text alone does not say which devices a mesh holds),
    or, with no input committed to a device, the default device. A lowering that calls back
    into the host, or whose lowering internals this JAX version does not expose, is never
    shared. Bounded: past `capacity` entries the least recently used is dropped (pools keep
    their own references to what they use).

    `enabled` False (`compile_privately`): every lowering compiles, and nothing is kept.
    Benchmark entry points that build engines or trainers in their own process set it, so
    that each side they compare pays its own compiles, as a run of its own would.
    """

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self.enabled = True
        self._executables: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def fingerprint(lowered) -> str | None:
        """The key of a `jax.stages.Lowered`, or None when it must not be shared."""
        args = getattr(getattr(lowered, "_lowering", None), "compile_args", None)
        needed = ("in_shardings", "out_shardings", "kept_var_idx", "committed", "host_callbacks")
        if not isinstance(args, dict) or any(k not in args for k in needed):
            return None
        if args["host_callbacks"]:
            return None
        inputs = [_devices(s) for s in args["in_shardings"]]
        placed = [d for d in inputs if d is not None]
        if args["committed"] and not placed:
            return None  # committed to devices this key could not name
        # Nothing committed: the program runs where uncommitted arrays live.
        default = () if placed else (str(jax.config.jax_default_device), jax.devices()[0].id)
        outputs = [_devices(s) for s in args["out_shardings"]]
        context = args.get("context_mesh")
        parts = (lowered.as_text(), str(lowered.in_tree), str(lowered.out_tree),
                 sorted(args["kept_var_idx"]), inputs, outputs, _devices(context) or (),
                 default, jax.default_backend())  # fmt: skip
        return hashlib.sha256(repr(parts).encode()).hexdigest()

    def compile(self, lowered, options: dict[str, Any] | None = None) -> tuple[Any, bool]:
        """(the executable of `lowered` compiled with XLA `options`, whether it was already
        compiled)."""
        key = self.fingerprint(lowered) if self.enabled else None
        if key is not None and options:
            key = hashlib.sha256(repr((key, sorted(options.items()))).encode()).hexdigest()
        if key is not None:
            with self._lock:
                program = self._executables.get(key)
                if program is not None:
                    self._executables.move_to_end(key)
                    return program, True
        program = lowered.compile(compiler_options=dict(options)) if options else lowered.compile()
        if key is not None:
            with self._lock:
                self._executables[key] = program
                while len(self._executables) > self.capacity:
                    self._executables.popitem(last=False)
        return program, False


SHARED = SharedPrograms()


@contextlib.contextmanager
def compile_privately() -> Iterator[None]:
    """Within the block, in every thread, pools compile every program themselves (nothing
    from `SHARED`, and nothing they compile goes into it): for code that times compiling."""
    enabled, SHARED.enabled = SHARED.enabled, False
    try:
        yield
    finally:
        SHARED.enabled = enabled


def memory_report(compiled) -> dict[str, int]:
    """Bytes from `compiled.memory_analysis()` (empty where the backend reports nothing)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return {}
    names = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
             "temp_size_in_bytes", "generated_code_size_in_bytes")  # fmt: skip
    return {n.removesuffix("_size_in_bytes"): int(getattr(analysis, n, 0) or 0) for n in names}


_COLLECTIVE = re.compile(
    r"= (.+?) (all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)(?:-start)?\("
)
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+)\[([\d,]*)\]")


def collectives(compiled) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """Each collective in a compiled program: its kind ("all_gather", ...) and its output
    arrays' (dtype, shape) per device, from the partitioned HLO text."""
    found = []
    for match in _COLLECTIVE.finditer(compiled.as_text()):
        arrays = [(dtype, tuple(int(d) for d in dims.split(",") if d))
                  for dtype, dims in _ARRAY.findall(match.group(1))]  # fmt: skip
        found.append((match.group(2).replace("-", "_"), arrays))
    return found


def collective_report(compiled) -> dict[str, int]:
    """Collectives in a compiled program: count and output bytes (per device) by kind.

    From the partitioned HLO text, so it says what the SPMD partitioner added: e.g. an
    all-gather of a batch-sharded array that a program indexes by row.
    """
    report: dict[str, int] = {}
    for kind, arrays in collectives(compiled):
        size = 0
        for dtype, shape in arrays:
            bits = 8 if dtype == "pred" else int(re.match(r"[a-z]+(\d+)", dtype).group(1))
            size += math.prod(shape) * bits // 8
        report[kind] = report.get(kind, 0) + 1
        report[f"{kind}_bytes"] = report.get(f"{kind}_bytes", 0) + size
    return report


def abstract_like(tree):
    """`ShapeDtypeStruct`s (shape, dtype, sharding) of a pytree of arrays."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree,
    )


class ProgramPool:
    """Programs compiled ahead of time, one per (name, static shape) key."""

    def __init__(self, sharding_context: Callable[[], Any] | None = None):
        """
        Args:
          sharding_context: entered while lowering programs that ask for it (`get(...,
            sharded=True)`), e.g. the trainer's logical-axis rules on its mesh.
        """
        self._programs: dict[tuple, Any] = {}
        self.compiled: list[CompiledInfo] = []
        self._context = sharding_context

    def __contains__(self, key: tuple) -> bool:
        return key in self._programs

    def keys(self) -> list[tuple]:
        return list(self._programs)

    @property
    def compile_count(self) -> int:
        return len(self.compiled)

    @property
    def compile_seconds(self) -> float:
        return sum(c.seconds for c in self.compiled)

    def memory_bytes(self, prefix: str | None = None) -> int:
        """Generated code plus temporaries of the programs whose key starts with `prefix`:
        what the pool itself holds beyond the arguments its callers own."""
        return sum(c.memory.get("generated_code", 0) + c.memory.get("temp", 0)
                   for c in self.compiled if prefix is None or c.key[0] == prefix)  # fmt: skip

    def get(self, key: tuple, fn: Callable, example_args: Callable[[], tuple],
            donate: tuple[int, ...] = (), *, sharded: bool = True,
            options: dict[str, Any] | None = None):  # fmt: skip
        """The compiled program for `key`; the first time, lowers `fn` on `example_args()`
        (arrays or `ShapeDtypeStruct`s, built only then), inside the pool's sharding context
        when `sharded`, and compiles it with XLA compile `options` (e.g.
        `{"xla_backend_optimization_level": 1}`; None: XLA's defaults) unless another pool of
        the process has (`SHARED`). A key is compiled once: `options` apply to its first
        compile, so a caller whose options vary puts them in the key (the rollout engine
        does)."""
        program = self._programs.get(key)
        if program is None:
            start = time.perf_counter()
            jitted = jax.jit(fn, donate_argnums=donate)
            context = self._context() if (sharded and self._context) else contextlib.nullcontext()
            with context:
                program, reused = SHARED.compile(jitted.lower(*example_args()), options)
            self.compiled.append(CompiledInfo(key, time.perf_counter() - start,
                                              memory_report(program), reused))  # fmt: skip
            self._programs[key] = program
        return program
