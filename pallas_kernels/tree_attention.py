"""Tree attention: verify a draft token tree against a ragged KV cache.

One target forward pass verifies ``T`` drafted tree tokens per request. Query token ``t`` of request
``b`` attends to

1. the cached prefix ``s < cache_lens_B[b]`` (ragged per request; cache positions at or past the
   request's length are garbage and are ignored, even when they hold NaN or inf), and
2. the tree tokens ``j`` with ``tree_mask_BxTxT[b, t, j]`` (ancestor-or-self mask, diagonal True),

with one softmax over the union of both parts. ``T = 1`` with ``tree_mask = [[True]]`` is plain
decode attention.

Dimension legend:
    B: batch (requests)
    T: query / tree tokens per request
    S: cache buffer length (positions ``>= cache_lens_B[b]`` are unused)
    N: query heads
    K: kv heads
    G: query heads per kv head, ``N // K`` (query head ``n`` reads kv head ``n // G``)
    H: head dim
    R: kernel rows, the ``T * G`` queries of one kv head (row ``t * G + g``), padded
    P: kv splits, programs that share one request's cache (flash decoding)

Kernel layout. The grid is ``(B, K, R // block_rows, P)``. A program owns ``block_rows`` query rows
of one kv head, so both matmuls are ``block_rows x H`` against ``H x block_kv``. It runs an online
softmax over cache blocks with a ``fori_loop`` whose trip count follows the request's real length
(not the buffer length), then folds in the tree tokens. With ``P > 1`` each split takes a share of
the request's real blocks, split 0 also takes the tree, and the wrapper merges the splits by their
log-sum-exp.

Lowering. GPU uses Pallas Triton (``pallas.triton.CompilerParams``; Mosaic GPU is JAX's default),
which wants power-of-two tiles of at least 16, so rows and tree columns are padded to that. TPU
uses Mosaic: the last two block dims must be multiples of (8, 128) or full extent; the cache is read
as a ``(B, S, K * H)`` view with an ``(S, H)`` block, which needs ``H % 128 == 0`` (else the
wrapper transposes the cache to ``(B, K, S, H)``, an extra copy). On TPU a program's whole
``S x H`` cache rows sit in VMEM, so the DMA follows the buffer length while the compute follows
the real length.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_TRANS_B_DIMS = (((1,), (1,)), ((), ()))
_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# Enough programs to fill a large GPU (an H200 has 132 SMs) when B * K is small.
_TARGET_GPU_PROGRAMS = 128


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the tree-attention kernel; numerics barely change, speed does.

    Attributes:
        block_kv: cache positions per inner-loop step. A power of two >= 16 (Triton tiles); TPU
            also wants a multiple of 128 (the lane width).
        block_rows: query rows (of the ``T * G`` per kv head) per program, a power of two >= 16;
            None puts all rows in one program. Smaller blocks keep a GPU program's accumulator in
            registers at the price of re-reading the cache once per row block.
        num_kv_splits: programs that share one request's cache (flash decoding). Splits fill a GPU
            when ``B * K`` is small; on TPU they only serialise, so keep 1 there.
    """

    block_kv: int = 128
    block_rows: int | None = None
    num_kv_splits: int = 1

    def __post_init__(self):
        block_kv, block_rows, num_kv_splits = self.block_kv, self.block_rows, self.num_kv_splits
        if not _is_power_of_two(block_kv) or block_kv < 16:
            raise ValueError(f"{block_kv=} must be a power of two >= 16")
        if block_rows is not None and (not _is_power_of_two(block_rows) or block_rows < 16):
            raise ValueError(f"{block_rows=} must be None or a power of two >= 16")
        if num_kv_splits < 1:
            raise ValueError(f"{num_kv_splits=} must be >= 1")

    @classmethod
    def get_default(
        cls, platform: str, *, batch_size: int, num_kv_heads: int, num_rows: int, cache_len: int
    ) -> BlockSizes:
        """Defaults for ``platform`` (as ``jax.default_backend()`` spells it) and static shapes.

        Only the GPU defaults split work across programs; none of these are tuned yet.
        """
        if platform == "gpu":
            block_kv, block_rows = 64, 64
            row_blocks = pl.cdiv(num_rows, block_rows)
            wanted = pl.cdiv(_TARGET_GPU_PROGRAMS, batch_size * num_kv_heads * row_blocks)
            # Keep at least two blocks of the buffer per split.
            num_kv_splits = max(1, min(wanted, cache_len // (2 * block_kv)))
            return cls(block_kv=block_kv, block_rows=block_rows, num_kv_splits=num_kv_splits)
        if platform == "tpu":
            return cls(block_kv=256)
        return cls()


def _online_softmax_step(carry, scores_RxC, values_CxH, precision):
    """One flash-attention update of (max, sum, unnormalised output) with a block of scores."""
    max_Rx1, sum_Rx1, acc_RxH = carry
    max_next_Rx1 = jnp.maximum(max_Rx1, jnp.max(scores_RxC, axis=1, keepdims=True))
    correction_Rx1 = jnp.exp(max_Rx1 - max_next_Rx1)
    probs_RxC = jnp.exp(scores_RxC - max_next_Rx1)
    sum_next_Rx1 = correction_Rx1 * sum_Rx1 + jnp.sum(probs_RxC, axis=1, keepdims=True)
    acc_next_RxH = correction_Rx1 * acc_RxH + lax.dot(
        probs_RxC.astype(values_CxH.dtype),
        values_CxH,
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    return max_next_Rx1, sum_next_Rx1, acc_next_RxH


def _tree_attention_kernel(
    # inputs
    cache_lens_ref,  # [B] int32, whole array (SMEM on TPU)
    q_ref,  # [block_rows, H] query rows of one kv head (row t * G + g)
    k_cache_ref,  # [S, H] one kv head's cache of one request
    v_cache_ref,  # [S, H]
    k_tree_ref,  # [Tp, H] tree keys of one kv head, padded to Tp columns
    v_tree_ref,  # [Tp, H]
    tree_bias_ref,  # [block_rows, Tp] f32: 0 where the tree mask allows, else DEFAULT_MASK_VALUE
    # outputs
    out_ref,  # [block_rows, H] normalised within this split
    *lse_refs,  # P > 1 only: [block_rows, 1] float32 log-sum-exp of this split
    sm_scale: float,
    block_kv: int,
    num_kv_splits: int,
    precision,
):
    batch_index = pl.program_id(0)
    split_index = pl.program_id(3)
    cache_len = cache_lens_ref[batch_index]
    q_RxH = q_ref[...]
    rows = q_RxH.shape[0]
    head_dim = q_RxH.shape[1]

    num_blocks = pl.cdiv(cache_len, block_kv)
    blocks_per_split = pl.cdiv(num_blocks, num_kv_splits)
    first_block = split_index * blocks_per_split
    end_block = jnp.minimum(first_block + blocks_per_split, num_blocks)

    def cache_block(block_index, carry):
        start = pl.multiple_of(block_index * block_kv, block_kv)
        k_CxH = k_cache_ref[pl.ds(start, block_kv), :]
        v_CxH = v_cache_ref[pl.ds(start, block_kv), :]
        scores_RxC = lax.dot_general(
            q_RxH, k_CxH, _TRANS_B_DIMS, precision=precision, preferred_element_type=jnp.float32
        )
        scores_RxC = scores_RxC * sm_scale
        # Only the request's last block is partial; masking every block keeps one code path.
        valid_1xC = start + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1) < cache_len
        valid_Cx1 = start + lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0) < cache_len
        scores_RxC = jnp.where(valid_1xC, scores_RxC, DEFAULT_MASK_VALUE)
        # Zero the garbage values too: 0 * NaN would poison the accumulator.
        v_CxH = jnp.where(valid_Cx1, v_CxH, jnp.zeros_like(v_CxH))
        return _online_softmax_step(carry, scores_RxC, v_CxH, precision)

    def tree_tokens(carry):
        scores_RxTp = lax.dot_general(
            q_RxH,
            k_tree_ref[...],
            _TRANS_B_DIMS,
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        scores_RxTp = scores_RxTp * sm_scale + tree_bias_ref[...]
        return _online_softmax_step(carry, scores_RxTp, v_tree_ref[...], precision)

    carry = (
        jnp.full((rows, 1), DEFAULT_MASK_VALUE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    carry = lax.fori_loop(first_block, end_block, cache_block, carry)
    if num_kv_splits == 1:
        carry = tree_tokens(carry)
    else:
        carry = lax.cond(split_index == 0, tree_tokens, lambda c: c, carry)
    max_Rx1, sum_Rx1, acc_RxH = carry

    # A split with no cache blocks and no tree has sum 0; its log-sum-exp is -inf and it drops out.
    safe_sum_Rx1 = jnp.where(sum_Rx1 == 0.0, 1.0, sum_Rx1)
    out_ref[...] = (acc_RxH / safe_sum_Rx1).astype(out_ref.dtype)
    if lse_refs:
        (lse_ref,) = lse_refs
        lse_ref[...] = max_Rx1 + jnp.log(sum_Rx1)


def _round_up(value: int, multiple: int) -> int:
    return pl.cdiv(value, multiple) * multiple


def _padded_tile(size: int, platform: str) -> int:
    """Rows / tree columns padded to what the target's tiles accept."""
    if platform == "tpu":
        return _round_up(size, 8)
    # Triton (and interpret mode, to exercise the same padding): power of two, tl.dot wants >= 16.
    return max(16, pl.next_power_of_2(size))


def _check_inputs(
    q_BxTxNxH,
    k_cache_BxSxKxH,
    v_cache_BxSxKxH,
    cache_lens_B,
    k_tree_BxTxKxH,
    v_tree_BxTxKxH,
    tree_mask_BxTxT,
) -> None:
    if q_BxTxNxH.ndim != 4:
        raise ValueError(f"{q_BxTxNxH.shape=} must be rank 4 (B, T, N, H)")
    batch_size, num_tokens, num_q_heads, head_dim = q_BxTxNxH.shape
    if q_BxTxNxH.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{q_BxTxNxH.dtype=} must be one of {_SUPPORTED_DTYPES}")
    if k_cache_BxSxKxH.ndim != 4:
        raise ValueError(f"{k_cache_BxSxKxH.shape=} must be rank 4 (B, S, K, H)")
    _, cache_len, num_kv_heads, _ = k_cache_BxSxKxH.shape
    expected_cache = (batch_size, cache_len, num_kv_heads, head_dim)
    expected_tree = (batch_size, num_tokens, num_kv_heads, head_dim)
    for name, array, expected in (
        ("k_cache_BxSxKxH", k_cache_BxSxKxH, expected_cache),
        ("v_cache_BxSxKxH", v_cache_BxSxKxH, expected_cache),
        ("k_tree_BxTxKxH", k_tree_BxTxKxH, expected_tree),
        ("v_tree_BxTxKxH", v_tree_BxTxKxH, expected_tree),
    ):
        if array.shape != expected:
            raise ValueError(f"{name}.shape={array.shape} must be {expected} (from q and k_cache)")
        if array.dtype != q_BxTxNxH.dtype:
            raise ValueError(f"{name}.dtype={array.dtype} must equal {q_BxTxNxH.dtype=}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_kv_heads=} must divide {num_q_heads=}")
    if cache_lens_B.shape != (batch_size,) or not jnp.issubdtype(cache_lens_B.dtype, jnp.integer):
        raise ValueError(
            f"{cache_lens_B.shape=}, {cache_lens_B.dtype=} must be integer of shape ({batch_size},)"
        )
    if tree_mask_BxTxT.shape != (batch_size, num_tokens, num_tokens):
        raise ValueError(
            f"{tree_mask_BxTxT.shape=} must be {(batch_size, num_tokens, num_tokens)} (B, T, T)"
        )
    if tree_mask_BxTxT.dtype != jnp.bool_:
        raise ValueError(f"{tree_mask_BxTxT.dtype=} must be bool")


def _compiler_params(platform: str, vmem_bytes: int):
    if platform == "gpu":
        # Imported here: Pallas's Triton backend is deprecated in jax 0.11 (Mosaic GPU is the
        # default); its removal must not break importing the kernel on other platforms.
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=4, num_stages=2)
    if platform == "tpu":
        # Raise the scoped VMEM limit (16 MiB by default on some chips) when the cache rows need it.
        limit = int(vmem_bytes * 1.25) + (4 << 20) if vmem_bytes > (12 << 20) else None
        return pltpu.CompilerParams(dimension_semantics=("parallel",) * 4, vmem_limit_bytes=limit)
    return None


def _tree_attention_impl(
    q_BxTxNxH,
    k_cache_BxSxKxH,
    v_cache_BxSxKxH,
    cache_lens_B,
    k_tree_BxTxKxH,
    v_tree_BxTxKxH,
    tree_mask_BxTxT,
    *,
    sm_scale: float,
    block_sizes: BlockSizes | None,
    interpret: bool,
    platform: str,
) -> jax.Array:
    """The wrapper body for a target ``platform``; tests lower it for GPU and TPU on a CPU."""
    batch_size, num_tokens, num_q_heads, head_dim = q_BxTxNxH.shape
    cache_len, num_kv_heads = k_cache_BxSxKxH.shape[1:3]
    group = num_q_heads // num_kv_heads
    rows = num_tokens * group
    if block_sizes is None:
        block_sizes = BlockSizes.get_default(
            platform,
            batch_size=batch_size,
            num_kv_heads=num_kv_heads,
            num_rows=rows,
            cache_len=cache_len,
        )
    block_kv, num_kv_splits = block_sizes.block_kv, block_sizes.num_kv_splits
    if platform == "gpu" and not interpret and (not _is_power_of_two(head_dim) or head_dim < 16):
        raise ValueError(f"{head_dim=} must be a power of two >= 16 for the Triton kernel")
    if platform == "tpu" and not interpret and block_kv % 128:
        raise ValueError(f"{block_kv=} must be a multiple of 128 on TPU")
    block_rows = _padded_tile(rows, platform)
    if block_sizes.block_rows is not None:
        block_rows = min(block_rows, block_sizes.block_rows)
    padded_rows = _round_up(rows, block_rows)
    # The tree scores' last dim is the lane dim on TPU.
    padded_tokens = (
        _round_up(num_tokens, 128) if platform == "tpu" else _padded_tile(num_tokens, platform)
    )
    dtype = q_BxTxNxH.dtype
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT

    # Fold the G query heads of each kv head into rows: row t * G + g is query head k * G + g.
    q_BxKxRxH = (
        q_BxTxNxH.reshape(batch_size, num_tokens, num_kv_heads, group, head_dim)
        .transpose(0, 2, 1, 3, 4)
        .reshape(batch_size, num_kv_heads, rows, head_dim)
    )
    q_BxKxRxH = jnp.pad(q_BxKxRxH, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))
    tree_pad = ((0, 0), (0, 0), (0, padded_tokens - num_tokens), (0, 0))
    k_tree_BxKxTxH = jnp.pad(k_tree_BxTxKxH.transpose(0, 2, 1, 3), tree_pad)
    v_tree_BxKxTxH = jnp.pad(v_tree_BxTxKxH.transpose(0, 2, 1, 3), tree_pad)
    tree_bias_BxRxT = jnp.where(
        jnp.repeat(tree_mask_BxTxT, group, axis=1), 0.0, DEFAULT_MASK_VALUE
    ).astype(jnp.float32)
    tree_bias_BxRxT = jnp.pad(
        tree_bias_BxRxT,
        ((0, 0), (0, padded_rows - rows), (0, padded_tokens - num_tokens)),
        constant_values=DEFAULT_MASK_VALUE,
    )
    # Out-of-range lengths mean "none" / "all", as in the reference; clipping keeps loads in bounds.
    cache_lens_B = jnp.clip(cache_lens_B.astype(jnp.int32), 0, cache_len)

    # Pad the buffer to whole blocks (at least one: an empty buffer has no block to cut). Only
    # buffer lengths that are not a positive multiple pay for the copy.
    padded_cache_len = max(_round_up(cache_len, block_kv), block_kv)
    if padded_cache_len != cache_len:
        cache_pad = ((0, 0), (0, padded_cache_len - cache_len), (0, 0), (0, 0))
        k_cache_BxSxKxH = jnp.pad(k_cache_BxSxKxH, cache_pad)
        v_cache_BxSxKxH = jnp.pad(v_cache_BxSxKxH, cache_pad)
    if platform == "tpu" and head_dim % 128 and num_kv_heads > 1:
        # Mosaic cannot cut an (S, H) block out of (S, K * H) lanes unless H is lane aligned.
        k_cache = k_cache_BxSxKxH.transpose(0, 2, 1, 3)
        v_cache = v_cache_BxSxKxH.transpose(0, 2, 1, 3)
        cache_block = (None, None, padded_cache_len, head_dim)
        cache_spec = pl.BlockSpec(cache_block, lambda b, k, r, p: (b, k, 0, 0))
    else:
        # A free reshape: kv head k is the k-th H-wide column block of every cache row.
        cache_shape = (batch_size, padded_cache_len, num_kv_heads * head_dim)
        k_cache = k_cache_BxSxKxH.reshape(cache_shape)
        v_cache = v_cache_BxSxKxH.reshape(cache_shape)
        cache_spec = pl.BlockSpec((None, padded_cache_len, head_dim), lambda b, k, r, p: (b, 0, k))

    lens_spec = pl.BlockSpec(memory_space=pltpu.SMEM) if platform == "tpu" else pl.BlockSpec()
    rows_spec = pl.BlockSpec((None, None, block_rows, head_dim), lambda b, k, r, p: (b, k, r, 0))
    tree_spec = pl.BlockSpec((None, None, padded_tokens, head_dim), lambda b, k, r, p: (b, k, 0, 0))
    bias_spec = pl.BlockSpec((None, block_rows, padded_tokens), lambda b, k, r, p: (b, r, 0))
    if num_kv_splits == 1:
        out_shape = [jax.ShapeDtypeStruct(q_BxKxRxH.shape, dtype)]
        out_specs = [rows_spec]
    else:
        split_shape = (batch_size, num_kv_heads, num_kv_splits, padded_rows)
        out_shape = [
            jax.ShapeDtypeStruct((*split_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((*split_shape, 1), jnp.float32),
        ]
        split_index_map = lambda b, k, r, p: (b, k, p, r, 0)
        out_specs = [
            pl.BlockSpec((None, None, None, block_rows, head_dim), split_index_map),
            pl.BlockSpec((None, None, None, block_rows, 1), split_index_map),
        ]
    kernel = functools.partial(
        _tree_attention_kernel,
        sm_scale=sm_scale,
        block_kv=block_kv,
        num_kv_splits=num_kv_splits,
        precision=precision,
    )
    # Double-buffered K and V rows of one program, the bulk of its VMEM on TPU.
    vmem_bytes = 4 * padded_cache_len * head_dim * jnp.dtype(dtype).itemsize
    outputs = pl.pallas_call(
        kernel,
        grid=(batch_size, num_kv_heads, padded_rows // block_rows, num_kv_splits),
        in_specs=[lens_spec, rows_spec, cache_spec, cache_spec, tree_spec, tree_spec, bias_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=None if interpret else _compiler_params(platform, vmem_bytes),
        interpret=interpret,
        name="tree_attention",
    )(cache_lens_B, q_BxKxRxH, k_cache, v_cache, k_tree_BxKxTxH, v_tree_BxKxTxH, tree_bias_BxRxT)

    if num_kv_splits == 1:
        (out_BxKxRxH,) = outputs
    else:
        split_out_BxKxPxRxH, lse_BxKxPxRx1 = outputs
        weights_BxKxPxRx1 = jnp.exp(lse_BxKxPxRx1 - jnp.max(lse_BxKxPxRx1, axis=2, keepdims=True))
        out_BxKxRxH = jnp.sum(weights_BxKxPxRx1 * split_out_BxKxPxRxH, axis=2) / jnp.sum(
            weights_BxKxPxRx1, axis=2
        )
    out_BxKxRxH = out_BxKxRxH[:, :, :rows].astype(dtype)
    return (
        out_BxKxRxH.reshape(batch_size, num_kv_heads, num_tokens, group, head_dim)
        .transpose(0, 2, 1, 3, 4)
        .reshape(batch_size, num_tokens, num_q_heads, head_dim)
    )


def target_platform() -> str:
    """The backend the kernel is built for, spelt as ``jax.default_backend()`` spells it.

    The device of the abstract mesh in context where it names one
    (``jax.sharding.use_abstract_mesh`` with an ``AbstractDevice``), else the default backend.
    A program lowered for an accelerator on a machine without one (``tlt_jax.rl.fit``) then
    holds that accelerator's kernel: with the default backend it held the CPU's, the Pallas
    interpreter. jit's trace cache keys on the abstract mesh, so no trace is reused across
    targets.
    """
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is None:
        return jax.default_backend()
    return "gpu" if device.platform in ("cuda", "rocm") else device.platform


@functools.partial(jax.jit, static_argnames=["sm_scale", "block_sizes", "interpret"])
def tree_attention(
    q_BxTxNxH: jax.Array,
    k_cache_BxSxKxH: jax.Array,
    v_cache_BxSxKxH: jax.Array,
    cache_lens_B: jax.Array,
    k_tree_BxTxKxH: jax.Array,
    v_tree_BxTxKxH: jax.Array,
    tree_mask_BxTxT: jax.Array,
    *,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Attention of tree tokens over their ragged cached prefix and their tree ancestors (Pallas).

    Args:
        q_BxTxNxH: queries of the tree tokens, float32 or bfloat16.
        k_cache_BxSxKxH: cached keys; positions ``>= cache_lens_B[b]`` are ignored. Same dtype as q.
        v_cache_BxSxKxH: cached values, like ``k_cache_BxSxKxH``.
        cache_lens_B: int, valid cache length of each request (values outside ``[0, S]`` are
            clipped, which matches the reference).
        k_tree_BxTxKxH: keys of the tree tokens.
        v_tree_BxTxKxH: values of the tree tokens.
        tree_mask_BxTxT: bool, ``[b, t, j]`` True when tree token ``t`` may attend to tree
            token ``j`` (its ancestors and itself; the diagonal must be True).
        sm_scale: logit scale, default ``H ** -0.5``.
        block_sizes: tiles; default ``BlockSizes.get_default`` for the backend and shapes.
        interpret: run the kernel in the Pallas interpreter; default True when the target
            (``target_platform``) is the CPU.

    Returns:
        out_BxTxNxH in q's dtype, accumulated in float32.

    Raises:
        ValueError: when shapes, dtypes or tiles do not fit, naming the offending value.
    """
    _check_inputs(
        q_BxTxNxH,
        k_cache_BxSxKxH,
        v_cache_BxSxKxH,
        cache_lens_B,
        k_tree_BxTxKxH,
        v_tree_BxTxKxH,
        tree_mask_BxTxT,
    )
    platform = target_platform()
    if interpret is None:
        interpret = platform == "cpu"
    if sm_scale is None:
        sm_scale = q_BxTxNxH.shape[-1] ** -0.5
    return _tree_attention_impl(
        q_BxTxNxH,
        k_cache_BxSxKxH,
        v_cache_BxSxKxH,
        cache_lens_B,
        k_tree_BxTxKxH,
        v_tree_BxTxKxH,
        tree_mask_BxTxT,
        sm_scale=sm_scale,
        block_sizes=block_sizes,
        interpret=interpret,
        platform=platform,
    )


@functools.partial(jax.jit, static_argnames=["sm_scale"])
def tree_attention_reference(
    q_BxTxNxH: jax.Array,
    k_cache_BxSxKxH: jax.Array,
    v_cache_BxSxKxH: jax.Array,
    cache_lens_B: jax.Array,
    k_tree_BxTxKxH: jax.Array,
    v_tree_BxTxKxH: jax.Array,
    tree_mask_BxTxT: jax.Array,
    *,
    sm_scale: float | None = None,
) -> jax.Array:
    """Plain-jnp tree attention in float32; same arguments and result as ``tree_attention``.

    Returns:
        out_BxTxNxH in q's dtype.
    """
    batch_size, num_tokens, num_q_heads, head_dim = q_BxTxNxH.shape
    cache_len, num_kv_heads = k_cache_BxSxKxH.shape[1:3]
    group = num_q_heads // num_kv_heads
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    einsum = functools.partial(jnp.einsum, precision=lax.Precision.HIGHEST)
    q_BxTxKxGxH = q_BxTxNxH.reshape(batch_size, num_tokens, num_kv_heads, group, head_dim).astype(
        jnp.float32
    )
    cache_valid_BxS = jnp.arange(cache_len)[None, :] < cache_lens_B[:, None]
    # Zero the garbage so that 0 * NaN cannot leak into the output.
    k_cache_BxSxKxH = jnp.where(cache_valid_BxS[:, :, None, None], k_cache_BxSxKxH, 0)
    v_cache_BxSxKxH = jnp.where(cache_valid_BxS[:, :, None, None], v_cache_BxSxKxH, 0)
    cache_logits_BxKxGxTxS = sm_scale * einsum(
        "BTKGH,BSKH->BKGTS", q_BxTxKxGxH, k_cache_BxSxKxH.astype(jnp.float32)
    )
    tree_logits_BxKxGxTxT = sm_scale * einsum(
        "BTKGH,BJKH->BKGTJ", q_BxTxKxGxH, k_tree_BxTxKxH.astype(jnp.float32)
    )
    cache_logits_BxKxGxTxS = jnp.where(
        cache_valid_BxS[:, None, None, None, :], cache_logits_BxKxGxTxS, -jnp.inf
    )
    tree_logits_BxKxGxTxT = jnp.where(
        tree_mask_BxTxT[:, None, None, :, :], tree_logits_BxKxGxTxT, -jnp.inf
    )
    probs = jax.nn.softmax(
        jnp.concatenate([cache_logits_BxKxGxTxS, tree_logits_BxKxGxTxT], axis=-1), axis=-1
    )
    cache_probs_BxKxGxTxS, tree_probs_BxKxGxTxT = probs[..., :cache_len], probs[..., cache_len:]
    out_BxTxKxGxH = einsum(
        "BKGTS,BSKH->BTKGH", cache_probs_BxKxGxTxS, v_cache_BxSxKxH.astype(jnp.float32)
    ) + einsum("BKGTJ,BJKH->BTKGH", tree_probs_BxKxGxTxT, v_tree_BxTxKxH.astype(jnp.float32))
    return out_BxTxKxGxH.reshape(batch_size, num_tokens, num_q_heads, head_dim).astype(
        q_BxTxNxH.dtype
    )
