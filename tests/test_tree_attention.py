"""Tree-attention kernel == reference == a naive per-query loop.

Tolerances: float32 atol = rtol = 1e-5 (kernel and reference both accumulate in float32 at full
matmul precision; measured gaps are ~1e-6). bfloat16 atol = rtol = 3e-2 (inputs and output are
bfloat16, about 3 significant digits, and the kernel feeds bfloat16 probabilities to the value
matmul as flash attention does; outputs are O(1)).
"""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels.tree_attention import (
    BlockSizes,
    _tree_attention_impl,
    tree_attention,
    tree_attention_reference,
)

INTERPRET_MODES = [True] + ([False] if jax.default_backend() != "cpu" else [])
TOLERANCES = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def random_tree_mask(rng: np.random.Generator, num_tokens: int) -> np.ndarray:
    """Ancestor-or-self mask of a random tree whose parents come before their children."""
    mask_TxT = np.eye(num_tokens, dtype=bool)
    for token in range(1, num_tokens):
        parent = rng.integers(0, token)
        mask_TxT[token] |= mask_TxT[parent]
    return mask_TxT


def make_inputs(seed, batch, tokens, q_heads, kv_heads, head_dim, cache_len, lens, dtype):
    """Random inputs; cache positions past each request's length hold 0."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
    cache_lens_B = np.asarray(lens, np.int32)
    valid_BxS = np.arange(cache_len)[None, :] < cache_lens_B[:, None]
    k_cache = normal(batch, cache_len, kv_heads, head_dim) * valid_BxS[:, :, None, None]
    v_cache = normal(batch, cache_len, kv_heads, head_dim) * valid_BxS[:, :, None, None]
    tree_mask_BxTxT = np.stack([random_tree_mask(rng, tokens) for _ in range(batch)])
    return (
        jnp.asarray(normal(batch, tokens, q_heads, head_dim), dtype),
        jnp.asarray(k_cache, dtype),
        jnp.asarray(v_cache, dtype),
        jnp.asarray(cache_lens_B),
        jnp.asarray(normal(batch, tokens, kv_heads, head_dim), dtype),
        jnp.asarray(normal(batch, tokens, kv_heads, head_dim), dtype),
        jnp.asarray(tree_mask_BxTxT),
    )


def with_garbage(inputs, value):
    """Overwrite every cache position at or past the request's length with ``value``."""
    q, k_cache, v_cache, cache_lens_B, k_tree, v_tree, tree_mask = inputs
    cache_len = k_cache.shape[1]
    garbage_BxSx1x1 = (jnp.arange(cache_len)[None, :] >= cache_lens_B[:, None])[:, :, None, None]
    k_cache = jnp.where(garbage_BxSx1x1, jnp.asarray(value, k_cache.dtype), k_cache)
    v_cache = jnp.where(garbage_BxSx1x1, jnp.asarray(-value, v_cache.dtype), v_cache)
    return q, k_cache, v_cache, cache_lens_B, k_tree, v_tree, tree_mask


def naive_tree_attention(q, k_cache, v_cache, cache_lens_B, k_tree, v_tree, tree_mask):
    """Per-query float64 softmax over the concatenated allowed keys; independent of the others."""
    q, k_cache, v_cache, k_tree, v_tree = (
        np.asarray(x, np.float64) for x in (q, k_cache, v_cache, k_tree, v_tree)
    )
    batch, tokens, q_heads, head_dim = q.shape
    group = q_heads // k_cache.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for t in range(tokens):
            allowed_tree = np.flatnonzero(np.asarray(tree_mask[b, t]))
            for n in range(q_heads):
                kv = n // group
                keys = np.concatenate(
                    [k_cache[b, : cache_lens_B[b], kv], k_tree[b, allowed_tree, kv]]
                )
                values = np.concatenate(
                    [v_cache[b, : cache_lens_B[b], kv], v_tree[b, allowed_tree, kv]]
                )
                logits = keys @ q[b, t, n] / np.sqrt(head_dim)
                weights = np.exp(logits - logits.max())
                out[b, t, n] = weights @ values / weights.sum()
    return out


# (batch, tokens, q_heads, kv_heads, head_dim, cache_len, lens, block_sizes):
# GQA ratios 1, 3, 4; T in {1, 4, 7}; empty and full prefixes; buffers that are not a multiple of
# block_kv; several kv splits (some left empty) and several row blocks.
CASES = [
    (1, 1, 4, 4, 32, 64, [64], None),
    (2, 4, 12, 4, 64, 200, [0, 200], None),
    (3, 7, 8, 2, 32, 256, [0, 100, 256], BlockSizes(block_kv=32, num_kv_splits=3)),
    (3, 7, 12, 4, 16, 130, [129, 1, 130], BlockSizes(block_kv=16, block_rows=16, num_kv_splits=2)),
    (1, 7, 3, 3, 32, 96, [5], BlockSizes(block_kv=16, num_kv_splits=4)),
    (2, 4, 4, 1, 64, 48, [48, 17], BlockSizes(block_kv=16, block_rows=16)),
]
CASE_IDS = ["decode-G1", "G3-empty-full", "G4-splits", "G3-rowblocks", "G1-empty-splits", "G4-K1"]


def tiles_for(block_sizes, interpret):
    """Compiled TPU kernels need lane-aligned cache blocks; small ones only run elsewhere."""
    if interpret or jax.default_backend() != "tpu" or block_sizes is None:
        return block_sizes
    return dataclasses.replace(block_sizes, block_kv=128)


def assert_close(actual, expected, dtype):
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(expected, np.float32), **TOLERANCES[dtype]
    )


@pytest.mark.parametrize("interpret", INTERPRET_MODES)
class TestTreeAttention:
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
    def test_matches_reference(self, interpret, case, dtype):
        *shape, block_sizes = case
        inputs = make_inputs(0, *shape, dtype)
        block_sizes = tiles_for(block_sizes, interpret)
        out = tree_attention(*inputs, block_sizes=block_sizes, interpret=interpret)
        assert out.shape == inputs[0].shape and out.dtype == dtype
        assert_close(out, tree_attention_reference(*inputs), dtype)

    @pytest.mark.parametrize("garbage", [1e30, np.inf, np.nan])
    def test_ignores_cache_past_length(self, interpret, garbage):
        inputs = make_inputs(1, 3, 4, 8, 2, 32, 160, [0, 37, 160], jnp.float32)
        block_sizes = tiles_for(BlockSizes(block_kv=32, num_kv_splits=2), interpret)
        clean = tree_attention(*inputs, block_sizes=block_sizes, interpret=interpret)
        dirty = tree_attention(
            *with_garbage(inputs, garbage), block_sizes=block_sizes, interpret=interpret
        )
        assert np.all(np.isfinite(np.asarray(dirty)))
        np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))

    def test_scale_and_out_of_range_lengths(self, interpret):
        inputs = make_inputs(2, 2, 4, 6, 2, 32, 64, [64, 0], jnp.float32)
        q, k_cache, v_cache, _, k_tree, v_tree, tree_mask = inputs
        lens = jnp.asarray([1000, -5], jnp.int32)  # read as "all" and "none"
        args = (q, k_cache, v_cache, lens, k_tree, v_tree, tree_mask)
        out = tree_attention(*args, sm_scale=0.3, interpret=interpret)
        assert_close(out, tree_attention_reference(*args, sm_scale=0.3), jnp.float32)
        assert_close(out, tree_attention(*inputs, sm_scale=0.3, interpret=interpret), jnp.float32)

    def test_empty_cache_buffer(self, interpret):
        """S = 0 (no cache at all): the tree tokens alone; was a TypeError from the block cut."""
        inputs = make_inputs(3, 2, 3, 4, 2, 16, 0, [0, 0], jnp.float32)
        out = tree_attention(*inputs, interpret=interpret)
        assert_close(out, tree_attention_reference(*inputs), jnp.float32)


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_platform_default_tiling_in_interpret_mode(platform):
    """Each platform's padding, default tiles and cache layout give the reference's numbers."""
    inputs = make_inputs(3, 2, 7, 28, 4, 64, 300, [0, 250], jnp.float32)
    run = functools.partial(
        _tree_attention_impl, sm_scale=64**-0.5, block_sizes=None, interpret=True, platform=platform
    )
    assert_close(jax.jit(run)(*inputs), tree_attention_reference(*inputs), jnp.float32)


def abstract_h100():
    """An abstract H100 to lower the Triton kernel for when no GPU is attached.

    jax 0.11's Triton lowering reads the target's compute capability from the device
    (``pallas.triton.gpu_info.get_gpu_info``) and raises "No supported GPU devices found, please
    specify an abstract GPU device" on a CPU; jax 0.10 fell back to sm_90 itself. An H100 is
    sm_90 too, and the card the device checks run on.
    """
    device = jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu"
    )
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_triton_and_mosaic(platform, dtype):
    """The kernel lowers (Pallas Triton / Mosaic TPU) without the device: no compile, no run."""
    run = functools.partial(
        _tree_attention_impl,
        sm_scale=0.1,
        block_sizes=None,
        interpret=False,
        platform="gpu" if platform == "cuda" else platform,
    )
    triton_call = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    for batch, tokens, q_heads, kv_heads, head_dim, cache_len in [
        (4, 48, 28, 4, 128, 2048),  # Qwen2.5-7B heads, tree verify
        (1, 1, 9, 3, 64, 300),  # SmolLM2-135M heads, decode, odd buffer length
    ]:
        struct = lambda *shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt)
        args = (
            struct(batch, tokens, q_heads, head_dim),
            struct(batch, cache_len, kv_heads, head_dim),
            struct(batch, cache_len, kv_heads, head_dim),
            struct(batch, dt=jnp.int32),
            struct(batch, tokens, kv_heads, head_dim),
            struct(batch, tokens, kv_heads, head_dim),
            struct(batch, tokens, tokens, dt=jnp.bool_),
        )
        exported = export.export(jax.jit(run), platforms=[platform], disabled_checks=[triton_call])
        with abstract_h100() if platform == "cuda" else contextlib.nullcontext():
            module = exported(*args).mlir_module()
        kernel_call = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
        assert f"custom_call @{kernel_call}" in module


@pytest.mark.parametrize("case", CASES[:4], ids=CASE_IDS[:4])
def test_reference_matches_naive_loop(case):
    *shape, _ = case
    inputs = with_garbage(make_inputs(4, *shape, jnp.float32), np.nan)
    expected = naive_tree_attention(*(np.asarray(x) for x in inputs))
    np.testing.assert_allclose(
        np.asarray(tree_attention_reference(*inputs)), expected, atol=1e-5, rtol=1e-5
    )


def test_random_tree_mask_is_ancestor_closed():
    mask_TxT = random_tree_mask(np.random.default_rng(5), 9)
    assert mask_TxT.diagonal().all() and not np.triu(mask_TxT, 1).any()
    for token in range(9):
        for ancestor in np.flatnonzero(mask_TxT[token]):
            assert (mask_TxT[ancestor] <= mask_TxT[token]).all()


def _bad_inputs(change):
    inputs = list(make_inputs(6, 2, 4, 8, 2, 32, 64, [3, 64], jnp.float32))
    index, value = change(inputs)
    inputs[index] = value
    return inputs


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda x: (0, x[0][0]), r"q_BxTxNxH.shape=\(4, 8, 32\) must be rank 4"),
        (lambda x: (0, x[0].astype(jnp.float16)), r"q_BxTxNxH.dtype=dtype\('float16'\)"),
        (lambda x: (0, x[0][:, :, :7]), r"num_kv_heads=2 must divide num_q_heads=7"),
        (lambda x: (2, x[2][:, :32]), r"v_cache_BxSxKxH.shape=\(2, 32, 2, 32\) must be"),
        (lambda x: (1, x[1].astype(jnp.bfloat16)), r"k_cache_BxSxKxH.dtype=bfloat16 must equal"),
        (lambda x: (3, x[3][:1]), r"cache_lens_B.shape=\(1,\)"),
        (lambda x: (3, x[3].astype(jnp.float32)), r"cache_lens_B.dtype=dtype\('float32'\)"),
        (lambda x: (4, x[4][:, :3]), r"k_tree_BxTxKxH.shape=\(2, 3, 2, 32\) must be"),
        (lambda x: (6, x[6][:, :, :3]), r"tree_mask_BxTxT.shape=\(2, 4, 3\) must be \(2, 4, 4\)"),
        (lambda x: (6, x[6].astype(jnp.int32)), r"tree_mask_BxTxT.dtype=dtype\('int32'\) must be"),
    ],
)
def test_input_checks_name_the_bad_value(change, message):
    with pytest.raises(ValueError, match=message):
        tree_attention(*_bad_inputs(change))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_kv=100), r"block_kv=100 must be a power of two >= 16"),
        (dict(block_kv=8), r"block_kv=8 must be a power of two >= 16"),
        (dict(block_rows=24), r"block_rows=24 must be None or a power of two >= 16"),
        (dict(num_kv_splits=0), r"num_kv_splits=0 must be >= 1"),
    ],
)
def test_block_sizes_checks(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BlockSizes(**kwargs)


def test_gpu_defaults_split_the_cache_when_programs_are_few():
    few = BlockSizes.get_default("gpu", batch_size=1, num_kv_heads=4, num_rows=8, cache_len=8192)
    many = BlockSizes.get_default(
        "gpu", batch_size=16, num_kv_heads=4, num_rows=336, cache_len=8192
    )
    assert few.num_kv_splits == 32 and many.num_kv_splits == 1
    tpu = BlockSizes.get_default("tpu", batch_size=1, num_kv_heads=4, num_rows=8, cache_len=8192)
    assert tpu.num_kv_splits == 1 and tpu.block_kv % 128 == 0
