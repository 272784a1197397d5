"""One pool of ahead-of-time compiled programs for the trainer and the rollout engine.

The JAX counterpart of TLT's bucketed CUDA-graph pool: every device program is lowered and
compiled once per static key (program name and bucketed shapes) and kept; steady state never
traces. The pool reports each program's compile seconds and XLA's memory analysis, so a run can
say how many programs it compiled, how long that took and how much executable memory
(arguments, outputs, temporaries, generated code) the pool holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import time
from collections.abc import Callable
from typing import Any

import jax


@dataclasses.dataclass
class CompiledInfo:
    key: tuple
    seconds: float
    memory: dict[str, int]


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


def collective_report(compiled) -> dict[str, int]:
    """Collectives in a compiled program: count and output bytes (per device) by kind.

    From the partitioned HLO text, so it says what the SPMD partitioner added: e.g. an
    all-gather of a batch-sharded array that a program indexes by row.
    """
    report: dict[str, int] = {}
    for match in _COLLECTIVE.finditer(compiled.as_text()):
        kind = match.group(2).replace("-", "_")
        size = 0
        for dtype, dims in _ARRAY.findall(match.group(1)):
            bits = 8 if dtype == "pred" else int(re.match(r"[a-z]+(\d+)", dtype).group(1))
            size += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
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
            donate: tuple[int, ...] = (), *, sharded: bool = True):  # fmt: skip
        """The compiled program for `key`; the first time, lowers `fn` on `example_args()`
        (arrays or `ShapeDtypeStruct`s, built only then), inside the pool's sharding context
        when `sharded`."""
        program = self._programs.get(key)
        if program is None:
            start = time.perf_counter()
            jitted = jax.jit(fn, donate_argnums=donate)
            context = self._context() if (sharded and self._context) else contextlib.nullcontext()
            with context:
                program = jitted.lower(*example_args()).compile()
            self.compiled.append(
                CompiledInfo(key, time.perf_counter() - start, memory_report(program))
            )
            self._programs[key] = program
        return program
