"""Attention kernels side by side: the XLA reference, the Pallas kernel and the CUDA paths users
know, on tree-verify and decode shapes (``scripts/bench_kernels.py`` is the command line).

Kernels (dimension letters as in ``pallas_kernels/tree_attention.py``):
- ``tree``: one verify step. q [B, T, N, H] over a ragged cache [B, S, K, H] (request b holds
  ``S - b * S // (2 * B)`` tokens) plus T tree tokens under a chain mask (each token sees itself
  and every earlier one), the densest tree mask of T tokens.
- ``decode``: one plain decode step, the same call with T = 1 and ``tree_mask = [[True]]``: the
  new token attends to its cache and to itself.

Implementations (``IMPLEMENTATIONS``), each case on the same inputs:
- ``xla_reference``: ``tree_attention_reference``, jitted jnp in float32 at HIGHEST precision:
  the numerics oracle every ``max_abs_diff`` is taken against (``runner.TOLERANCES``). Timed
  too (``speedup_pallas_over_xla_reference``), but it upcasts the cache and multiplies in
  float32, which no one would ship, so no goal reads it.
- ``xla``: the model's own XLA attention (``tlt_jax.models.transformer.attention`` with
  ``impl="xla"``), the path the kernel replaces: input-dtype products with float32 scores,
  over the same cache buffer as the kernel. ``speedup_pallas_over_xla`` and its goal use it.
- ``pallas``: ``tree_attention`` (the Pallas interpreter on CPU, which times the interpreter).
- ``torch_sdpa``: ``F.scaled_dot_product_attention(..., enable_gqa=True)`` with a boolean mask over
  a cache [B, K, L, H] holding the tree K/V at each request's end (where a verify step writes
  them), L = S + T rounded up to a page; the mask allows position < len plus the tree positions
  the tree mask allows. ``torch_sdpa_repeat_kv``: the same with K/V heads repeated to N inside
  the timed call (the transformers path; a mask with ``enable_gqa`` may fall back to the math
  backend). On CUDA when ``torch.cuda.is_available()``, else on CPU (a dry run).
- ``flash_attn``: ``flash_attn_with_kvcache`` over that cache with ``cache_seqlens = len + 1``;
  decode only (it has no tree mask).
- ``flashinfer``: the same cache as pages of ``PAGE_SIZE``; ``BatchPrefillWithPagedKVCacheWrapper``
  with a custom mask (tree), ``BatchDecodeWithPagedKVCacheWrapper`` (decode); ``plan`` runs once
  outside the timed call, as it does once per step for all layers.
A library that does not import is recorded as unavailable; an implementation that raises on a
case is recorded with its error and the run goes on.

Modules: ``cases`` (shape sets, inputs, the implementation interface and the JAX paths),
``cuda_paths`` (torch SDPA, flash_attn, flashinfer), ``runner`` (timing, summary, ``run``).
"""

from tlt_jax.kernel_bench.cases import (
    BYTES_FORMULA,
    GOALS,
    HBM_GBPS_BY_DEVICE_KIND,
    KERNELS,
    NUM_WARMUP,
    PAGE_SIZE,
    TIMING,
    Case,
    CaseInputs,
    Implementation,
    Prepared,
    make_inputs,
    shape_cases,
)
from tlt_jax.kernel_bench.runner import IMPLEMENTATIONS, device_hbm_gbps, run, summarise

__all__ = [
    "BYTES_FORMULA",
    "GOALS",
    "HBM_GBPS_BY_DEVICE_KIND",
    "IMPLEMENTATIONS",
    "KERNELS",
    "NUM_WARMUP",
    "PAGE_SIZE",
    "TIMING",
    "Case",
    "CaseInputs",
    "Implementation",
    "Prepared",
    "device_hbm_gbps",
    "make_inputs",
    "run",
    "shape_cases",
    "summarise",
]
