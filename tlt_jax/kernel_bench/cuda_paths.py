"""The CUDA paths users know, on the cases' inputs: torch SDPA (with ``enable_gqa`` or with K/V
heads repeated), flash_attn's ``flash_attn_with_kvcache`` and flashinfer's paged wrappers. Each
library is imported inside its ``prepare``; torch runs on CPU when it has no CUDA device.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from tlt_jax.kernel_bench.cases import L2_BYTES, PAGE_SIZE, CaseInputs, Prepared


def _to_torch(array: jax.Array, device: str):
    import torch

    try:
        tensor = torch.from_dlpack(array)
    except (BufferError, RuntimeError, TypeError):  # a dtype or device dlpack cannot share
        float32 = torch.from_numpy(np.asarray(array, np.float32))
        tensor = float32.to(getattr(torch, array.dtype.name))
    return tensor.to(device)


def _flush_l2() -> Callable[[], Any]:
    """Zeroes a buffer of twice `L2_BYTES` on the GPU: run before a timed call, its inputs are
    no longer in the L2 cache (as `triton.testing.do_bench` does)."""
    import torch

    scratch = torch.empty(2 * L2_BYTES, dtype=torch.int8, device="cuda")
    return scratch.zero_


def _cuda_event_ms(call: Callable[[], Any], num_runs: int,
                   flush: Callable[[], Any] | None = None) -> float:  # fmt: skip
    """Median CUDA-event time of one call; `flush` (default `_flush_l2`) runs before each,
    outside the events, so that inputs under the L2's size are read from HBM as the chained
    JAX programs' are (`cases.chained_device_ms`)."""
    import torch

    flush = flush or _flush_l2()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(num_runs)]  # fmt: skip
    for start, end in pairs:
        flush()
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in pairs)


def _torch_prepared(call: Callable[[], Any], device: str, to_bxtxnxh: Callable) -> Prepared:
    import torch

    def sync(out):
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    to_numpy = lambda out: to_bxtxnxh(out).float().cpu().numpy()
    event_ms = _cuda_event_ms if device == "cuda" else None
    return Prepared(call, sync, to_numpy, device, event_ms)


def _torch_inputs(inputs: CaseInputs) -> dict[str, Any]:
    """q [B, T, N, H] and a cache [B, L, K, H] with the tree K/V written at each request's end,
    L = S + T rounded up to whole pages, its mask [B, T, L] and live lengths (len + T)."""
    if "torch" in inputs.memo:
        return inputs.memo["torch"]
    import torch

    case = inputs.case
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k_cache, v_cache, _, k_tree, v_tree, tree_mask = (_to_torch(a, device) for a in inputs.args)
    batch, tokens, cache_len = case.batch_size, case.num_tokens, case.cache_len
    buffer_len = math.ceil((cache_len + tokens) / PAGE_SIZE) * PAGE_SIZE
    lens = case.cache_lens().tolist()
    k_buffer = k_cache.new_zeros((batch, buffer_len, *k_cache.shape[2:]))
    v_buffer = torch.zeros_like(k_buffer)
    k_buffer[:, :cache_len], v_buffer[:, :cache_len] = k_cache, v_cache
    positions_L = torch.arange(buffer_len, device=device)
    lens_B = torch.as_tensor(lens, device=device)
    mask_BxTxL = (positions_L[None, :] < lens_B[:, None])[:, None, :].repeat(1, tokens, 1)
    for b, length in enumerate(lens):
        k_buffer[b, length : length + tokens] = k_tree[b]
        v_buffer[b, length : length + tokens] = v_tree[b]
        mask_BxTxL[b, :, length : length + tokens] = tree_mask[b]
    kv_lens = [length + tokens for length in lens]
    inputs.memo["torch"] = dict(q=q, k=k_buffer, v=v_buffer, mask=mask_BxTxL, kv_lens=kv_lens,
                                device=device)  # fmt: skip
    return inputs.memo["torch"]


def prepare_sdpa(inputs: CaseInputs, *, repeat_kv: bool) -> Prepared:
    import torch
    import torch.nn.functional as F

    tensors = _torch_inputs(inputs)
    if not repeat_kv and tuple(map(int, torch.__version__.split(".")[:2])) < (2, 5):
        raise RuntimeError(f"torch {torch.__version__} has no enable_gqa (torch >= 2.5)")
    group = inputs.case.num_heads // inputs.case.num_kv_heads
    q_BxNxTxH = tensors["q"].transpose(1, 2).contiguous()
    if "k_heads" not in tensors:  # the heads-first layout SDPA wants, shared by both variants
        tensors["k_heads"] = tensors["k"].transpose(1, 2).contiguous()
        tensors["v_heads"] = tensors["v"].transpose(1, 2).contiguous()
    k_BxKxLxH, v_BxKxLxH = tensors["k_heads"], tensors["v_heads"]
    mask_Bx1xTxL = tensors["mask"][:, None]
    if repeat_kv:
        call = lambda: F.scaled_dot_product_attention(
            q_BxNxTxH, k_BxKxLxH.repeat_interleave(group, dim=1),
            v_BxKxLxH.repeat_interleave(group, dim=1), attn_mask=mask_Bx1xTxL,
        )  # fmt: skip
    else:
        call = lambda: F.scaled_dot_product_attention(
            q_BxNxTxH, k_BxKxLxH, v_BxKxLxH, attn_mask=mask_Bx1xTxL, enable_gqa=True
        )
    return _torch_prepared(call, tensors["device"], lambda out: out.transpose(1, 2))


def prepare_flash_attn(inputs: CaseInputs) -> Prepared:
    import torch
    from flash_attn import flash_attn_with_kvcache

    tensors = _torch_inputs(inputs)
    seqlens_B = torch.as_tensor(tensors["kv_lens"], dtype=torch.int32, device=tensors["device"])
    call = lambda: flash_attn_with_kvcache(
        tensors["q"], tensors["k"], tensors["v"], cache_seqlens=seqlens_B
    )
    return _torch_prepared(call, tensors["device"], lambda out: out)


def prepare_flashinfer(inputs: CaseInputs) -> Prepared:
    import flashinfer
    import torch

    tensors, case = _torch_inputs(inputs), inputs.case
    device, dtype = tensors["device"], tensors["q"].dtype
    batch, tokens = case.batch_size, case.num_tokens
    heads = (case.num_heads, case.num_kv_heads, case.head_dim)
    pages_per_request = tensors["k"].shape[1] // PAGE_SIZE
    page_shape = (batch * pages_per_request, PAGE_SIZE, case.num_kv_heads, case.head_dim)
    pages = (tensors["k"].view(page_shape), tensors["v"].view(page_shape))
    used = [math.ceil(n / PAGE_SIZE) for n in tensors["kv_lens"]]
    int32 = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    indptr = int32([0, *itertools.accumulate(used)])
    indices = int32([b * pages_per_request + p for b, n in enumerate(used) for p in range(n)])
    last_page_len = int32([n - (u - 1) * PAGE_SIZE
                           for n, u in zip(tensors["kv_lens"], used, strict=True)])  # fmt: skip
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    types = dict(q_data_type=dtype, kv_data_type=dtype)
    if case.kernel == "decode":
        # The tensor-core path takes any group size (Qwen's G = 7).
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=True
        )
        wrapper.plan(indptr, indices, last_page_len, *heads, PAGE_SIZE, **types)
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        custom_mask = torch.cat([tensors["mask"][b, :, :n].reshape(-1)
                                 for b, n in enumerate(tensors["kv_lens"])])  # fmt: skip
        qo_indptr = int32([b * tokens for b in range(batch + 1)])
        wrapper.plan(qo_indptr, indptr, indices, last_page_len, *heads, PAGE_SIZE,
                     custom_mask=custom_mask, **types)  # fmt: skip
    q_flat = tensors["q"].reshape(batch * tokens, case.num_heads, case.head_dim)
    call = lambda: wrapper.run(q_flat, pages)
    to_bxtxnxh = lambda out: out.reshape(batch, tokens, case.num_heads, case.head_dim)
    return _torch_prepared(call, device, to_bxtxnxh)
