"""The kernel benchmark (`tlt_jax.kernel_bench`) end to end on the tiny shape set on CPU: every
implementation row, numerics against the XLA reference, the JSON, the budget and byte guards,
failures recorded per implementation, and the flash_attn / flashinfer argument plumbing against
stand-ins that follow those libraries' documented semantics. No timing assertions.

Tolerances: float32 1e-4 (one missing or extra key among ~256 moves an output by ~1e-3, so a mask
error fails it); bfloat16 3e-2 as in test_tree_attention.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import sys
import types

import jax
import jax.numpy as jnp
import pytest
import torch

from pallas_kernels.tree_attention import tree_attention_reference
from tlt_jax import kernel_bench

IMPLEMENTATIONS = {impl.name: impl for impl in kernel_bench.IMPLEMENTATIONS}
MEASURED = ("xla_reference", "xla", "pallas", "torch_sdpa", "torch_sdpa_repeat_kv")
TINY = dict(num_runs=1, num_warmup=0)


@pytest.fixture(scope="module")
def tiny_float32(tmp_path_factory):
    path = tmp_path_factory.mktemp("kernel_bench") / "k.json"
    result = kernel_bench.run("tiny", out_json=str(path), dtype="float32", command="cmd", **TINY)
    return result, json.loads(path.read_text())


def test_tiny_rows_numerics_and_json(tiny_float32):
    result, on_disk = tiny_float32
    assert on_disk == json.loads(json.dumps(result))
    assert on_disk["command"] == "cmd" and on_disk["backend"] == "cpu" and on_disk["interpret"]
    assert on_disk["finished"] and not on_disk["truncated"] and on_disk["skipped_budget"] == 0
    assert on_disk["torch_version"] == torch.__version__ and on_disk["note"]
    assert "sum_b(cache_lens[b])" in on_disk["bytes_formula"] and on_disk["hbm_gbps"] is None
    assert set(on_disk["kernels"]) == {"tree", "decode"}
    rows = on_disk["results"]
    assert [(r["kernel"], r["batch"], r["tokens"], r["cache_len"]) for r in rows] == [
        ("tree", 1, 8, 256), ("tree", 2, 8, 256), ("decode", 1, 1, 256), ("decode", 2, 1, 256)
    ]  # fmt: skip
    assert [r["headline"] for r in rows] == [True, True, False, False]
    assert rows[1]["mean_cache_len"] == 224.0  # lens 256 and 256 - 256 // 4
    # float32, N=4, K=2, H=16: 2*256*2*16 cache + 2*8*2*16 tree + 2*8*4*16 q and out.
    assert rows[0]["live_bytes"] == 4 * (16384 + 512 + 1024)
    for row in rows:
        assert set(row["impls"]) == set(IMPLEMENTATIONS)
        for name in MEASURED:
            impl = row["impls"][name]
            assert impl["status"] == "ok", (name, impl)
            for field in ("median_ms", "pipelined_ms", "first_call_s", "gb_per_s"):
                assert math.isfinite(impl[field]) and impl[field] > 0, (name, field)
            assert impl["max_abs_diff"] < 1e-4, (name, row["kernel"], impl["max_abs_diff"])
            assert impl["hbm_fraction"] is None  # no HBM peak for a CPU
        for name in ("flash_attn", "flashinfer"):
            if importlib.util.find_spec(name) is None:
                assert row["impls"][name]["status"] == "unavailable"
        xla_ms, reference_ms, pallas_ms = (row["impls"][n]["median_ms"]
                                           for n in ("xla", "xla_reference", "pallas"))  # fmt: skip
        assert row["speedup_pallas_over_xla"] == pytest.approx(xla_ms / pallas_ms)
        assert row["speedup_pallas_over_xla_reference"] == pytest.approx(reference_ms / pallas_ms)
        assert row["impls"]["xla_reference"]["max_abs_diff"] == 0.0  # the oracle itself
        assert row["best_cuda_path"] in ("torch_sdpa", "torch_sdpa_repeat_kv")


def test_tiny_summary_goals_not_applicable_in_interpret_mode(tiny_float32):
    summary = tiny_float32[1]["summary"]
    assert summary["interpret"] and summary["presets"] == ["tiny"]
    assert summary["headline_tree"]["num_rows"] == 2 and summary["decode"]["num_rows"] == 2
    headline = summary["headline_tree"]
    assert headline["geomean_speedup_pallas_over_xla"] == pytest.approx(
        math.sqrt(math.prod(r["speedup_pallas_over_xla"] for r in tiny_float32[1]["results"][:2]))
    )
    assert headline["geomean_speedup_pallas_over_xla_reference"] > 0
    assert set(summary["goals"]) == {goal for goal, *_ in kernel_bench.GOALS}
    for entry in summary["goals"].values():
        assert entry["status"] == "not_applicable" and entry["met"] is None


def test_device_shape_set_order_labels_and_sizes():
    cases = kernel_bench.shape_cases("device")
    assert len(cases) == 4 * 4 * 4 + 4 * 4  # one head shape for both 7B presets
    assert all(c.presets == ("qwen2_5_7b", "ds_r1_distill_qwen_7b") for c in cases)
    assert {(c.num_heads, c.num_kv_heads, c.head_dim) for c in cases} == {(28, 4, 128)}
    headline = [c for c in cases if c.headline]
    assert cases[: len(headline)] == headline and len(headline) == 3 * 3 * 3
    assert all(c.batch_size <= 16 and 8 <= c.num_tokens <= 32 for c in headline)
    assert all(c.cache_len >= 4096 and c.kernel == "tree" for c in headline)
    assert [c.kernel for c in cases[27:43]] == ["decode"] * 16
    assert all(c.num_tokens == 1 for c in cases if c.kernel == "decode")
    # The largest case's bfloat16 inputs (B 64, S 32768: 4 GiB of cache) pass the 8 GiB guard.
    assert max(c.input_bytes(2) for c in cases) < 8 << 30
    with pytest.raises(ValueError, match="shapes='huge'"):
        kernel_bench.shape_cases("huge")


def test_budget_zero_truncates_and_keeps_the_first_case(tmp_path):
    path = tmp_path / "k.json"
    result = kernel_bench.run("tiny", out_json=str(path), budget_s=0, **TINY)
    on_disk = json.loads(path.read_text())
    assert on_disk["truncated"] and on_disk["skipped_budget"] == 3 and on_disk["finished"]
    assert len(on_disk["results"]) == 1 == len(result["results"])
    row = on_disk["results"][0]
    assert row["dtype"] == "bfloat16"
    for name in MEASURED:
        assert row["impls"][name]["max_abs_diff"] < 3e-2, name


def test_max_bytes_skips_cases():
    result = kernel_bench.run("tiny", max_bytes=1, **TINY)
    assert result["skipped_max_bytes"] == 4 and result["results"] == []
    assert result["summary"]["goals"]["pallas_at_least_1.5x_xla"]["value"] is None


def _off_by_one(inputs):
    """A reference that drops each request's last cache token: its diff must show."""
    q, k_cache, v_cache, lens, *tree = inputs.args
    prepared = IMPLEMENTATIONS["xla_reference"].prepare(inputs)
    return dataclasses.replace(
        prepared, call=lambda: tree_attention_reference(q, k_cache, v_cache, lens - 1, *tree)
    )


def _raises(inputs):
    raise RuntimeError("no kernel for this shape")


def test_a_raising_implementation_is_recorded_and_the_run_goes_on():
    implementations = [
        IMPLEMENTATIONS["xla_reference"],
        kernel_bench.Implementation("raises", _raises),
        kernel_bench.Implementation("off_by_one", _off_by_one),
        kernel_bench.Implementation("tree_only", _raises, kernels=("tree",)),
    ]
    result = kernel_bench.run("tiny", dtype="float32", implementations=implementations, **TINY)
    assert len(result["results"]) == 4
    for row in result["results"]:
        impls = row["impls"]
        error = "RuntimeError: no kernel for this shape"
        assert impls["raises"] == dict(status="error", error=error)
        assert impls["xla_reference"]["status"] == "ok"
        assert impls["xla_reference"]["max_abs_diff"] == 0.0
        assert impls["off_by_one"]["max_abs_diff"] > 1e-3
        assert impls["off_by_one"]["status"] == "mismatch"  # timed, but it counts toward no goal
        assert row["speedup_pallas_over_xla"] is None and row["best_cuda_path"] is None
        want = "error" if row["kernel"] == "tree" else "not_applicable"
        assert impls["tree_only"]["status"] == want
    mismatches = result["summary"]["mismatches"]
    assert {m["impl"] for m in mismatches} == {"off_by_one"} and len(mismatches) == 4


def _attend(q_TxNxH, k_SxKxH, v_SxKxH, mask_TxS=None):
    """Documented semantics of both libraries: query head n reads kv head n // G."""
    group = q_TxNxH.shape[1] // k_SxKxH.shape[1]
    k, v = (x.repeat_interleave(group, dim=1).double() for x in (k_SxKxH, v_SxKxH))
    scores_NxTxS = torch.einsum("tnh,snh->nts", q_TxNxH.double(), k) * q_TxNxH.shape[-1] ** -0.5
    if mask_TxS is not None:
        scores_NxTxS = scores_NxTxS.masked_fill(~mask_TxS, -math.inf)
    return torch.einsum("nts,snh->tnh", scores_NxTxS.softmax(-1), v).to(q_TxNxH.dtype)


class _PagedWrapper:
    """flashinfer's paged prefill / decode wrappers: ``plan`` then ``run(q, (k, v))``."""

    def __init__(self, workspace, layout, use_tensor_cores=False):
        assert layout == "NHD"

    def plan(self, *args, custom_mask=None, q_data_type=None, kv_data_type=None):
        if len(args) == 8:  # prefill: qo_indptr first
            self.qo_indptr, *args = args
        self.indptr, self.indices, self.last_page_len, *_, self.page_size = args
        self.custom_mask = custom_mask

    def run(self, q, pages):
        k_pages, v_pages = pages
        batch = len(self.last_page_len)
        qo_indptr = getattr(self, "qo_indptr", torch.arange(batch + 1))
        outs, mask_offset = [], 0
        for b in range(batch):
            ids = self.indices[self.indptr[b] : self.indptr[b + 1]]
            kv_len = (len(ids) - 1) * self.page_size + int(self.last_page_len[b])
            k, v = (p[ids].flatten(0, 1)[:kv_len] for p in (k_pages, v_pages))
            q_b = q[qo_indptr[b] : qo_indptr[b + 1]]
            mask = None
            if self.custom_mask is not None:
                size = len(q_b) * kv_len
                mask = self.custom_mask[mask_offset : mask_offset + size].view(len(q_b), kv_len)
                mask_offset += size
            outs.append(_attend(q_b, k, v, mask))
        return torch.cat(outs)


def _flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None):
    return torch.stack([_attend(q[b], k_cache[b, :n], v_cache[b, :n])
                        for b, n in enumerate(cache_seqlens.tolist())])  # fmt: skip


def test_flash_attn_and_flashinfer_plumbing_against_documented_semantics(monkeypatch):
    flashinfer = types.ModuleType("flashinfer")
    flashinfer.BatchPrefillWithPagedKVCacheWrapper = _PagedWrapper
    flashinfer.BatchDecodeWithPagedKVCacheWrapper = _PagedWrapper
    flash_attn = types.ModuleType("flash_attn")
    flash_attn.flash_attn_with_kvcache = _flash_attn_with_kvcache
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer)
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn)
    implementations = [IMPLEMENTATIONS[n] for n in ("xla_reference", "flash_attn", "flashinfer")]
    result = kernel_bench.run("tiny", dtype="float32", implementations=implementations, **TINY)
    for row in result["results"]:
        assert row["impls"]["flashinfer"]["max_abs_diff"] < 1e-4, row
        if row["kernel"] == "decode":
            assert row["impls"]["flash_attn"]["max_abs_diff"] < 1e-4, row
        else:
            assert row["impls"]["flash_attn"]["status"] == "not_applicable"
        assert row["best_cuda_path"] in ("flash_attn", "flashinfer")


def test_json_is_on_disk_before_the_first_case_and_after_each_implementation(tmp_path):
    """A run killed inside a case (e.g. a library compiling its kernels on first use) keeps
    its settings and the implementations the case had measured: the file as each
    implementation starts is recorded here."""
    path = tmp_path / "k.json"
    seen = []

    def peek(inputs):
        seen.append(json.loads(path.read_text()))
        raise RuntimeError("stop")

    implementations = [IMPLEMENTATIONS["xla_reference"], kernel_bench.Implementation("peek", peek)]
    kernel_bench.run("tiny", out_json=str(path), budget_s=0, dtype="float32",
                     implementations=implementations, **TINY)  # fmt: skip
    (first,) = seen
    assert first["results"] == [] and not first["finished"]  # the header, before any row
    progress = first["in_progress"]
    assert progress["kernel"] == "tree" and progress["impls"]["xla_reference"]["status"] == "ok"
    final = json.loads(path.read_text())
    assert "in_progress" not in final and len(final["results"]) == 1
    assert not list(tmp_path.glob("*.tmp"))


def test_flashinfer_without_its_prebuilt_kernels_is_unavailable_on_cuda(monkeypatch):
    """flashinfer-python alone compiles its kernels on first use (minutes inside one case, past
    the budget check); without flashinfer_jit_cache it is skipped unless opted in."""
    from tlt_jax.kernel_bench import runner

    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer_jit_cache", None)  # import raises
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(runner.FLASHINFER_JIT_ENV, raising=False)
    missing = runner._unavailable([IMPLEMENTATIONS["flashinfer"]])
    assert "flashinfer_jit_cache" in missing["flashinfer"]
    monkeypatch.setenv(runner.FLASHINFER_JIT_ENV, "1")
    assert runner._unavailable([IMPLEMENTATIONS["flashinfer"]]) == {}
    monkeypatch.delenv(runner.FLASHINFER_JIT_ENV)
    monkeypatch.setitem(sys.modules, "flashinfer_jit_cache", types.ModuleType("cache"))
    assert runner._unavailable([IMPLEMENTATIONS["flashinfer"]]) == {}


def test_pipelined_hbm_fraction_is_reported_beside_the_synchronised_one():
    """median_ms holds each call's dispatch and synchronisation (tens of us against headline
    kernels of 2.5-250 us at full bandwidth): the back-to-back figure is recorded too."""
    implementations = [IMPLEMENTATIONS["xla"], IMPLEMENTATIONS["pallas"]]
    result = kernel_bench.run("tiny", budget_s=0, hbm_gbps=1.0, implementations=implementations,
                              **TINY)  # fmt: skip
    (row,) = result["results"]
    for impl in row["impls"].values():
        want = row["live_bytes"] / impl["pipelined_ms"] / 1e6
        assert impl["hbm_fraction_pipelined"] == pytest.approx(want)
    tree = result["summary"]["headline_tree"]
    assert tree["median_pallas_hbm_fraction_pipelined"] == pytest.approx(
        row["impls"]["pallas"]["hbm_fraction_pipelined"]
    )


def _products(implementation: str, dtype) -> list[tuple[str, str, str]]:
    """(lhs, rhs, result) tensor types of every dot_general the implementation's timed call
    lowers to for CUDA (no GPU needed: XLA ops only), on the second tiny tree case."""
    case = kernel_bench.shape_cases("tiny")[1]
    inputs = kernel_bench.make_inputs(case, dtype, interpret=True)
    call = IMPLEMENTATIONS[implementation].prepare(inputs).call
    text = jax.jit(call).trace().lower(lowering_platforms=("cuda",)).as_text()
    return re.findall(r"dot_general.*?: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)",
                      text)  # fmt: skip


def test_the_xla_side_pallas_is_timed_against_is_the_models_bf16_attention():
    """``xla`` (what speedup_pallas_over_xla and its goal read) multiplies the bfloat16 cache
    in bfloat16 with float32 scores, over the same [B, S, K, H] buffer the kernel is given, as
    the model's attention(impl="xla") does on a GPU; the float32 oracle upcasts everything. The
    longest request fills the buffer in every case, so no static prefix is shorter."""
    cache = "tensor<2x256x2x16x{}>"  # B 2, S 256, K 2, H 16
    products = _products("xla", jnp.bfloat16)
    assert len(products) == 4 and all(lhs.endswith("xbf16>") for lhs, _, _ in products)
    assert (cache.format("bf16"), "tensor<2x8x2x2x16xbf16>", "tensor<2x2x256x8x2xf32>") in products
    reference = _products("xla_reference", jnp.bfloat16)
    assert all(t.endswith("xf32>") for product in reference for t in product)
    assert cache.format("f32") in {lhs for lhs, _, _ in reference}
    cases = kernel_bench.shape_cases("device") + kernel_bench.shape_cases("tiny")
    assert all(c.cache_lens().max() == c.cache_len for c in cases)


def test_bf16_outputs_are_checked_against_the_references_scale():
    """At a 7B verify shape the model's bf16 path passes and masking bugs do not: dropping the
    tree mask moved outputs by about 8e-3, inside the earlier absolute bf16 tolerance (3e-2)."""
    from tlt_jax.kernel_bench import cases, runner

    case = cases.Case("tree", ("qwen2_5_7b",), 28, 4, 128, 1, 8, 1024)
    args = cases.make_inputs(case, jnp.bfloat16, interpret=True).args
    want = tree_attention_reference(*args)
    model_bf16 = cases._model_xla_attention(*args)
    no_tree_mask = tree_attention_reference(*args[:-1], jnp.ones_like(args[-1]))
    lens = args[3] - 1  # the last cache token dropped
    last_dropped = tree_attention_reference(*args[:3], lens, *args[4:])
    assert runner.output_matches(model_bf16, want, "bfloat16")
    assert not runner.output_matches(no_tree_mask, want, "bfloat16")
    assert not runner.output_matches(last_dropped, want, "bfloat16")
    assert not runner.output_matches(want * float("nan"), want, "bfloat16")


def test_goals_read_the_devices_time_where_one_was_measured(monkeypatch):
    """Synchronised per-call wall time holds Python dispatch and block_until_ready (tens of us):
    a perfect kernel of 30 us read as 0.4-0.6 of HBM bandwidth. Where a device time exists
    (`device_ms`, the chained program on an accelerator) the goals read it."""
    from tlt_jax.kernel_bench import cases, runner

    case = kernel_bench.shape_cases("tiny")[0]
    inputs = kernel_bench.make_inputs(case, jnp.float32, interpret=True)
    prepared = IMPLEMENTATIONS["xla"].prepare(inputs)
    # Every chained call gets its own copy of the inputs: calls sharing one shared XLA's work
    # on it (the reference's upcast of the cache ran once for all of them).
    monkeypatch.setattr(cases, "L2_BYTES", case.live_bytes(4) * 5)  # 10 copies wanted
    caches = []

    def recording(q, k_cache, *rest):
        caches.append(k_cache)
        return tree_attention_reference(q, k_cache, *rest)

    ms = cases.chained_device_ms(recording, inputs.args, case.live_bytes(4), num_runs=4)
    assert 0 < ms < 1e3
    assert len(caches) == 10 and len({id(c) for c in caches}) == 10
    timed = dataclasses.replace(prepared, device_ms=lambda runs: 1e-3)
    figures, _ = runner._time(timed, num_runs=2, num_warmup=0)
    assert figures["device_ms"] == figures["goal_ms"] == 1e-3 < figures["median_ms"]
    figures, _ = runner._time(prepared, num_runs=2, num_warmup=0)  # CPU: no device time
    assert "device_ms" not in figures and figures["goal_ms"] == figures["median_ms"]


def test_event_timed_torch_calls_follow_an_l2_flush(monkeypatch):
    """The torch paths' CUDA-event times reused one input set, warm in L2 under 50 MB, against
    the JAX paths' HBM-cold chained calls: each timed call now follows a flush, outside its
    events."""
    from tlt_jax.kernel_bench import cuda_paths

    log = []

    class Event:
        def __init__(self, enable_timing):
            self.t = None

        def record(self):
            log.append("record")
            self.t = len(log)

        def elapsed_time(self, end):
            return float(end.t - self.t)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    ms = cuda_paths._cuda_event_ms(lambda: log.append("call"), 3,
                                   flush=lambda: log.append("flush"))  # fmt: skip
    assert log == ["flush", "record", "call", "record"] * 3 + ["sync"]
    assert ms == 2.0  # the events hold the call, not the flush
