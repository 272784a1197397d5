"""Runs the implementations over the cases: ``IMPLEMENTATIONS``, timing, per-case measurement,
the summary and goals, printing and the JSON written after every case (``run``).
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.tree_attention import BlockSizes
from tlt_jax.files import write_text_atomic
from tlt_jax.kernel_bench.cases import (
    BYTES_FORMULA,
    GOALS,
    HBM_GBPS_BY_DEVICE_KIND,
    KERNELS,
    NUM_WARMUP,
    TIMING,
    Implementation,
    Prepared,
    make_inputs,
    prepare_pallas,
    prepare_xla,
    prepare_xla_reference,
    shape_cases,
)
from tlt_jax.kernel_bench.cuda_paths import prepare_flash_attn, prepare_flashinfer, prepare_sdpa

_ERROR_CHARS = 2000
# The correctness oracle: every output's max_abs_diff and status are taken against its output.
REFERENCE = "xla_reference"
# How far an implementation's output may be from the XLA reference's and still count; past it
# the status is "mismatch", and the row's timings count toward no goal. float32: `np.allclose`
# terms (tests/test_tree_attention.py's, widened for libraries whose float32 products may round
# through TF32). bfloat16: the largest difference against the reference's root mean square,
# since attention outputs shrink as the prefix grows (averages of more values): at the 7B
# shapes (outputs' RMS about 0.025) the model's bf16 XLA path is 5e-4 from the reference, while
# dropping the tree mask or the last cache token moves an output by 6e-3 to 8e-3, which the
# earlier absolute 3e-2 let pass as "ok".
TOLERANCES = {"float32": dict(atol=1e-3, rtol=1e-3), "bfloat16": dict(rms_fraction=0.1)}


def output_matches(got: np.ndarray, want: np.ndarray, dtype: str) -> bool:
    """Whether an output is within `TOLERANCES[dtype]` of the reference's (float32's terms
    for other dtypes)."""
    tolerance = TOLERANCES.get(dtype, TOLERANCES["float32"])
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if "rms_fraction" in tolerance:
        rms = float(np.sqrt(np.mean(np.square(want)))) if want.size else 0.0
        return bool(np.all(np.isfinite(got))) and (
            float(np.max(np.abs(got - want), initial=0.0)) <= tolerance["rms_fraction"] * rms
        )
    return bool(np.allclose(got, want, **tolerance))


IMPLEMENTATIONS = (
    Implementation(REFERENCE, prepare_xla_reference),
    Implementation("xla", prepare_xla),
    Implementation("pallas", prepare_pallas),
    Implementation("torch_sdpa", functools.partial(prepare_sdpa, repeat_kv=False),
                   cuda_path=True, requires="torch"),
    Implementation("torch_sdpa_repeat_kv", functools.partial(prepare_sdpa, repeat_kv=True),
                   cuda_path=True, requires="torch"),
    Implementation("flash_attn", prepare_flash_attn, kernels=("decode",), cuda_path=True,
                   requires="flash_attn"),
    Implementation("flashinfer", prepare_flashinfer, cuda_path=True, requires="flashinfer"),
)  # fmt: skip


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:_ERROR_CHARS]


def _time(prepared: Prepared, num_runs: int, num_warmup: int) -> tuple[dict[str, float], Any]:
    start = time.perf_counter()
    out = prepared.sync(prepared.call())
    figures = dict(first_call_s=time.perf_counter() - start)
    for _ in range(num_warmup):
        prepared.sync(prepared.call())
    times = []
    for _ in range(num_runs):
        start = time.perf_counter()
        prepared.sync(prepared.call())
        times.append(time.perf_counter() - start)
    figures["median_ms"] = statistics.median(times) * 1e3
    start = time.perf_counter()
    prepared.sync([prepared.call() for _ in range(num_runs)])
    figures["pipelined_ms"] = (time.perf_counter() - start) / num_runs * 1e3
    if prepared.event_ms is not None:
        figures["cuda_event_ms"] = prepared.event_ms(prepared.call, num_runs)
    if prepared.device_ms is not None:
        figures["device_ms"] = prepared.device_ms(num_runs)
    # What the goals read (cases.TIMING): the device's time where one was measured.
    figures["goal_ms"] = figures.get(
        "device_ms", figures.get("cuda_event_ms", figures["median_ms"])
    )
    return figures, out


def _measure_case(
    inputs, implementations, unavailable, *, num_runs, num_warmup, hbm_gbps, on_impl=None
):
    """Every implementation on one case; errors are recorded per implementation.

    ``on_impl(impls)`` (optional) runs after each implementation with the figures so far, so
    that a run killed inside a case (a library compiling kernels on first use, a hang) keeps
    what the case measured before.
    """
    case = inputs.case
    live_bytes = case.live_bytes(inputs.args[0].dtype.itemsize)
    impls, reference = {}, None
    for impl in implementations:
        if on_impl is not None and impls:
            on_impl(impls)
        if impl.name in unavailable:
            impls[impl.name] = dict(status="unavailable", reason=unavailable[impl.name])
            continue
        if case.kernel not in impl.kernels:
            reason = f"covers {', '.join(impl.kernels)} only"
            impls[impl.name] = dict(status="not_applicable", reason=reason)
            continue
        try:
            prepared = impl.prepare(inputs)
            figures, out = _time(prepared, num_runs, num_warmup)
            out_BxTxNxH = prepared.to_numpy(out)
        except Exception as error:  # any failure of one implementation is a result, not a crash
            impls[impl.name] = dict(status="error", error=_error(error))
            continue
        if impl.name == REFERENCE:
            reference = out_BxTxNxH
        gb_per_s = live_bytes / figures["goal_ms"] / 1e6
        # Back-to-back calls hide the per-call dispatch and synchronisation (tens of us) that
        # median_ms holds: the headline rows' ideal times at full bandwidth are 2.5-250 us.
        gb_per_s_pipelined = live_bytes / figures["pipelined_ms"] / 1e6
        max_diff, status = None, "ok"
        if reference is not None:
            got, want = np.asarray(out_BxTxNxH, np.float32), np.asarray(reference, np.float32)
            max_diff = float(np.max(np.abs(got - want)))
            if not output_matches(got, want, str(inputs.args[0].dtype)):
                status = "mismatch"  # wrong numbers are timed but count toward no goal
        impls[impl.name] = dict(
            status=status, device=prepared.device, **figures, gb_per_s=gb_per_s,
            hbm_fraction=gb_per_s / hbm_gbps if hbm_gbps else None, max_abs_diff=max_diff,
            hbm_fraction_pipelined=gb_per_s_pipelined / hbm_gbps if hbm_gbps else None,
        )  # fmt: skip
    ok = lambda name: impls.get(name, {}).get("status") == "ok"
    cuda = [i.name for i in implementations if i.cuda_path and ok(i.name)]
    best_cuda = min(cuda, key=lambda name: impls[name]["goal_ms"], default=None)
    pallas_ms = impls["pallas"]["goal_ms"] if ok("pallas") else None
    speedup = lambda name: impls[name]["goal_ms"] / pallas_ms if pallas_ms and ok(name) else None
    return dict(
        kernel=case.kernel, presets=list(case.presets), num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads, head_dim=case.head_dim, batch=case.batch_size,
        tokens=case.num_tokens, cache_len=case.cache_len,
        mean_cache_len=float(case.cache_lens().mean()), dtype=str(inputs.args[0].dtype),
        headline=case.headline, live_bytes=live_bytes, impls=impls, best_cuda_path=best_cuda,
        speedup_pallas_over_xla=speedup("xla"),
        speedup_pallas_over_xla_reference=speedup(REFERENCE),
        pallas_ms_over_best_cuda_ms=pallas_ms / impls[best_cuda]["goal_ms"]
        if pallas_ms and best_cuda else None,
    )  # fmt: skip


def _geomean(values: list[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


def _group_summary(rows: list[dict]) -> dict[str, Any]:
    speedups = [r["speedup_pallas_over_xla"] for r in rows if r["speedup_pallas_over_xla"]]
    over_reference = [r["speedup_pallas_over_xla_reference"] for r in rows
                      if r["speedup_pallas_over_xla_reference"]]  # fmt: skip
    cuda = [r["pallas_ms_over_best_cuda_ms"] for r in rows if r["pallas_ms_over_best_cuda_ms"]]
    pallas = [r["impls"].get("pallas", {}) for r in rows]
    pallas = [p for p in pallas if p.get("status") == "ok"]
    fractions = [p["hbm_fraction"] for p in pallas if p["hbm_fraction"] is not None]
    pipelined = [p["hbm_fraction_pipelined"] for p in pallas
                 if p.get("hbm_fraction_pipelined") is not None]  # fmt: skip
    return dict(
        num_rows=len(rows),
        geomean_speedup_pallas_over_xla=_geomean(speedups),
        geomean_speedup_pallas_over_xla_reference=_geomean(over_reference),
        min_pallas_hbm_fraction=min(fractions, default=None),
        median_pallas_hbm_fraction=statistics.median(fractions) if fractions else None,
        median_pallas_hbm_fraction_pipelined=statistics.median(pipelined) if pipelined else None,
        geomean_pallas_ms_over_best_cuda_ms=_geomean(cuda),
    )


def summarise(rows: list[dict], *, interpret: bool) -> dict[str, Any]:
    """Pallas against XLA, HBM and the best CUDA path, and the goals, per row group.

    Groups: ``headline_tree`` (the first head shape's headline verify rows, where the goals are
    evaluated), ``tree`` (every tree row of the first head shape), ``decode`` (its decode rows).
    """
    first = rows[0]["presets"] if rows else None
    same_heads = [r for r in rows if r["presets"] == first and "impls" in r]
    groups = dict(
        headline_tree=_group_summary([r for r in same_heads if r["headline"]]),
        tree=_group_summary([r for r in same_heads if r["kernel"] == "tree"]),
        decode=_group_summary([r for r in same_heads if r["kernel"] == "decode"]),
    )
    goals = {}
    for goal, field, comparison, threshold in GOALS:
        value = groups["headline_tree"][field]
        entry = dict(field=field, comparison=comparison, threshold=threshold, value=value, met=None)
        if interpret:
            entry.update(status="not_applicable", reason="interpret mode times the interpreter")
        elif value is None:
            entry.update(status="not_measured")
        else:
            met = value >= threshold if comparison == ">=" else value <= threshold
            entry.update(status="measured", met=met)
        goals[goal] = entry
    # Every output off the XLA reference, on any head shape (the goals read none of them).
    mismatches = [dict(kernel=r["kernel"], presets=r["presets"], batch=r["batch"],
                       tokens=r["tokens"], cache_len=r["cache_len"], impl=name,
                       max_abs_diff=impl["max_abs_diff"])
                  for r in rows if "impls" in r for name, impl in r["impls"].items()
                  if impl.get("status") == "mismatch"]  # fmt: skip
    return dict(presets=first, **groups, goals=goals, mismatches=mismatches)


def device_hbm_gbps(device_kind: str) -> float | None:
    """Peak HBM GB/s from ``HBM_GBPS_BY_DEVICE_KIND``, None for an unknown device."""
    return next((v for k, v in HBM_GBPS_BY_DEVICE_KIND.items() if k in device_kind), None)


# flashinfer-python alone "compiles/downloads kernels on first use" (docs.flashinfer.ai,
# Installation); its prebuilt kernels are the flashinfer-jit-cache package. A first call that
# compiles runs inside a case, past any budget check, so without the cache it is skipped
# unless this variable is set to 1.
FLASHINFER_JIT_ENV = "TLT_BENCH_FLASHINFER_JIT"


def _flashinfer_prebuilt() -> bool:
    if os.environ.get(FLASHINFER_JIT_ENV) == "1":
        return True
    try:
        importlib.import_module("flashinfer_jit_cache")
    except Exception:
        return False
    return True


def _unavailable(implementations: Sequence[Implementation]) -> dict[str, str]:
    missing = {}
    for impl in implementations:
        if impl.requires is None:
            continue
        try:
            importlib.import_module(impl.requires)
        except Exception as error:  # a broken install is as unavailable as a missing one
            missing[impl.name] = f"{impl.requires} does not import: {_error(error)}"
            continue
        torch_cuda = impl.cuda_path and importlib.import_module("torch").cuda.is_available()
        if impl.cuda_path and not torch_cuda and jax.default_backend() != "cpu":
            # A CPU dry run of device-sized shapes would only spend the budget (e.g. on a TPU).
            missing[impl.name] = "torch has no CUDA device and JAX is not on CPU"
        elif impl.requires == "flashinfer" and torch_cuda and not _flashinfer_prebuilt():
            missing[impl.name] = (
                "flashinfer_jit_cache does not import: flashinfer-python compiles (or downloads) "
                f"its kernels on first use, minutes inside one case; {FLASHINFER_JIT_ENV}=1 runs "
                "it anyway"
            )
    return missing


def _print_row(row: dict, names: Sequence[str]) -> None:
    cell = lambda r: f"{r['goal_ms']:.3f}" if r["status"] == "ok" else r["status"][:11]
    pallas = row["impls"].get("pallas", {})
    fraction = pallas.get("hbm_fraction")
    diffs = [r["max_abs_diff"] for r in row["impls"].values() if r.get("max_abs_diff") is not None]
    extras = (row["speedup_pallas_over_xla"], fraction, max(diffs, default=None))
    shape = f"{row['kernel']:<7}{row['batch']:>4}{row['tokens']:>4}{row['cache_len']:>7}"
    cells = "".join(f"{cell(row['impls'][n]):>{max(12, len(n) + 1)}}" for n in names)
    print(shape + cells + "".join(f"{'-' if v is None else f'{v:.3g}':>10}" for v in extras))


def run(
    shapes: str = "auto",
    *,
    out_json: str | None = None,
    budget_s: float = 240.0,
    max_bytes: int = 8 << 30,
    dtype: str = "bfloat16",
    num_runs: int = 0,
    num_warmup: int = NUM_WARMUP,
    hbm_gbps: float = 0.0,
    interpret: bool | None = None,
    block_sizes: BlockSizes | None = None,
    implementations: Sequence[Implementation] = IMPLEMENTATIONS,
    command: str | None = None,
) -> dict[str, Any]:
    """Runs the kernel benchmark in-process, printing a row per case; returns the results.

    On a GPU, set ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` before JAX starts so that torch has
    memory too (``scripts/bench_kernels.py`` does).

    Args:
        shapes: ``tiny``, ``device`` or ``full`` (``shape_cases``); ``auto``: tiny on CPU.
        out_json: written before the first case and after every implementation of every case
            (the case under way is ``in_progress``), so an interrupted run keeps what it
            measured.
        budget_s: no case starts after this many seconds (the first always runs); the rest are
            counted in ``skipped_budget`` and ``truncated`` is set.
        max_bytes: cases whose inputs (``Case.input_bytes``) exceed it are skipped.
        dtype: ``bfloat16`` or ``float32``, of every input.
        num_runs: timed calls per implementation and case; 0: 3 in interpret mode, else 20.
        num_warmup: untimed calls after the first one.
        hbm_gbps: peak HBM bandwidth; 0: by device kind (``HBM_GBPS_BY_DEVICE_KIND``).
        interpret: Pallas interpret mode; None: on CPU only.
        block_sizes: Pallas tiles; None: ``BlockSizes.get_default``.
        implementations: what to run; ``REFERENCE`` is the numerics oracle and should come
            first (outputs before it get no ``max_abs_diff``).
        command: the command line to record.

    Returns:
        The JSON document: environment, ``results`` (one row per case), ``summary``.
    """
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"{dtype=} must be 'bfloat16' or 'float32'")
    if budget_s < 0 or num_runs < 0 or num_warmup < 0:
        raise ValueError(f"{budget_s=}, {num_runs=}, {num_warmup=} must be >= 0")
    start = time.perf_counter()
    backend, device_kind = jax.default_backend(), jax.devices()[0].device_kind
    interpret = backend == "cpu" if interpret is None else interpret
    shapes = ("tiny" if backend == "cpu" else "device") if shapes == "auto" else shapes
    cases, num_runs = shape_cases(shapes), num_runs or (3 if interpret else 20)
    peak_gbps = hbm_gbps or device_hbm_gbps(device_kind)
    unavailable = _unavailable(implementations)
    itemsize = jnp.dtype(dtype).itemsize
    fitting = [c for c in cases if c.input_bytes(itemsize) <= max_bytes]
    torch = sys.modules.get("torch")
    result = dict(
        command=command, backend=backend, device_kind=device_kind, jax_version=jax.__version__,
        torch_version=getattr(torch, "__version__", None),
        torch_cuda=bool(torch and torch.cuda.is_available()), interpret=interpret, dtype=dtype,
        shapes=shapes, num_runs=num_runs, num_warmup=num_warmup, budget_s=budget_s,
        max_bytes=max_bytes, hbm_gbps=peak_gbps, block_sizes=str(block_sizes or "default"),
        xla_python_client_preallocate=os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
        implementations={i.name: unavailable.get(i.name, "available") for i in implementations},
        kernels=KERNELS, bytes_formula=BYTES_FORMULA, timing=TIMING,
        note="Pallas interpret mode: times measure the interpreter, not the kernel; run on a "
        "GPU/TPU for real figures." if interpret else "",
        num_cases=len(cases), skipped_max_bytes=len(cases) - len(fitting), skipped_budget=0,
        truncated=False, finished=False, results=[],
    )  # fmt: skip
    names = [i.name for i in implementations]
    print(f"{backend} ({device_kind}), jax {jax.__version__}, {dtype}, interpret={interpret}, "
          f"shapes={shapes} ({len(fitting)} of {len(cases)} cases fit max_bytes), "
          f"HBM peak {peak_gbps} GB/s, median of {num_runs} runs after {num_warmup} warm-up",
          flush=True)  # fmt: skip
    if result["note"]:
        print(f"NOTE: {result['note']}")
    print(f"{'kernel':<7}{'B':>4}{'T':>4}{'S':>7}"
          + "".join(f"{n:>{max(12, len(n) + 1)}}" for n in names)
          + f"{'pl/xla':>10}{'pl_hbm':>10}{'max_diff':>10}", flush=True)  # fmt: skip
    _write(out_json, result)  # a run killed in its first case still leaves its settings

    def in_progress(case, impls):
        result["in_progress"] = dict(kernel=case.kernel, presets=list(case.presets),
                                     batch=case.batch_size, tokens=case.num_tokens,
                                     cache_len=case.cache_len, impls=impls)  # fmt: skip
        _write(out_json, result)

    for index, case in enumerate(fitting):
        if index and time.perf_counter() - start >= budget_s:
            result.update(truncated=True, skipped_budget=len(fitting) - index)
            break
        try:
            inputs = make_inputs(
                case, jnp.dtype(dtype), interpret=interpret, block_sizes=block_sizes
            )
            row = _measure_case(inputs, implementations, unavailable, num_runs=num_runs,
                                num_warmup=num_warmup, hbm_gbps=peak_gbps,
                                on_impl=functools.partial(in_progress, case))  # fmt: skip
            _print_row(row, names)
        except Exception as error:  # the inputs themselves failed (out of memory): keep going
            row = dict(kernel=case.kernel, presets=list(case.presets), batch=case.batch_size,
                       tokens=case.num_tokens, cache_len=case.cache_len,
                       error=_error(error))  # fmt: skip
            print(f"{case.kernel:<7}{case.batch_size:>4}{case.num_tokens:>4}{case.cache_len:>7}"
                  f"  {row['error']}")  # fmt: skip
        inputs = None  # free this case's device memory before the next one
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()
        result.pop("in_progress", None)
        result["results"].append(row)
        _write(out_json, result)
    result.update(finished=True, elapsed_s=time.perf_counter() - start)
    environment = ("backend", "device_kind", "jax_version", "torch_version", "interpret", "note")
    result["summary"] = dict(**{key: result[key] for key in environment},
                             **summarise(result["results"], interpret=interpret))  # fmt: skip
    _write(out_json, result)
    _print_summary(result)
    return result


def _print_summary(result: dict) -> None:
    summary = result["summary"]
    print(f"summary ({', '.join(summary['presets'] or [])}; {summary['backend']}, "
          f"{summary['device_kind']}, jax {summary['jax_version']}, "
          f"torch {summary['torch_version']}, interpret={summary['interpret']}):")  # fmt: skip
    for group in ("headline_tree", "tree", "decode"):
        figures = ", ".join(f"{k}={'-' if v is None else f'{v:.3g}'}"
                            for k, v in summary[group].items())  # fmt: skip
        print(f"  {group}: {figures}")
    for goal, entry in summary["goals"].items():
        value = "-" if entry["value"] is None else f"{entry['value']:.3g}"
        print(f"  goal {goal}: {entry['status']}, met={entry['met']} "
              f"({entry['field']} {value} {entry['comparison']} {entry['threshold']})")  # fmt: skip
    for m in summary["mismatches"]:
        print(
            f"  MISMATCH: {m['impl']} off the XLA reference by {m['max_abs_diff']:.3g} "
            f"({m['kernel']}, batch {m['batch']}, {m['tokens']} tokens, cache {m['cache_len']})"
        )
    if result["truncated"]:
        print(f"truncated by budget_s={result['budget_s']}: {result['skipped_budget']} cases "
              "not run")  # fmt: skip
    if summary["note"]:
        print(f"NOTE: {summary['note']}")


def _write(path: str | None, result: dict) -> None:
    """Whole or not at all (a temporary file renamed): a run killed while writing leaves the
    last complete JSON, which the accelerator check reads after the kill."""
    if path:
        write_text_atomic(path, json.dumps(result, indent=2))
