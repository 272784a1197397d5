"""The rollout form of the policy (`tlt_jax.models.decode`): per-layer weights and cache, the
cached forward written and read-only, and the engine programs that must update it in place."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.models.decode import (
    DecodeCache,
    cached_forward,
    head_major_attention,
    move_row,
    unstack_layers,
)
from tlt_jax.models.presets import get_preset
from tlt_jax.models.transformer import KVCache, NewKV, attention, init_model
from tlt_jax.programs import memory_report
from tlt_jax.rollout import engine as engine_lib
from tlt_jax.rollout import speculative


@pytest.fixture(scope="module")
def model():
    return init_model(get_preset("tiny"), seed=7)


def _filled(model, batch: int, length: int, seed: int):
    """A KVCache and the same contents as a DecodeCache (random keys and values)."""
    config = model.config
    shape = (config.num_layers, batch, length, config.num_kv_heads, config.head_dim)
    k, v = jax.random.normal(jax.random.key(seed), (2, *shape), jnp.float32)
    empty = DecodeCache.zeros(config, batch, length)
    rows = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return KVCache(k=k, v=v), empty.write_positions(jnp.arange(batch)[:, None], rows, k, v)


def test_cache_layout_round_trips_and_resizes(model):
    stacked, cache = _filled(model, 3, 16, seed=1)
    back = cache.token_major()
    np.testing.assert_array_equal(back.k, stacked.k)
    np.testing.assert_array_equal(back.v, stacked.v)
    assert (cache.batch, cache.length, cache.num_layers) == (3, 16, model.config.num_layers)
    bigger = cache.resized(4, 32).token_major()
    np.testing.assert_array_equal(bigger.k[:, :3, :16], stacked.k)
    assert not np.asarray(bigger.k[:, 3:]).any() and not np.asarray(bigger.v[:, :, 16:]).any()
    smaller = cache.resized(2, 8).token_major()
    np.testing.assert_array_equal(smaller.v, stacked.v[:, :2, :8])
    moved = jax.tree.map(lambda x: move_row(x, 2, 0), cache).token_major()  # slot 2 -> 0
    np.testing.assert_array_equal(moved.k[:, 0], stacked.k[:, 2])
    np.testing.assert_array_equal(moved.k[:, 1:], stacked.k[:, 1:])


def test_write_prefix_and_out_of_range_writes_are_dropped(model):
    config = model.config
    cache = DecodeCache.zeros(config, 2, 8)
    shape = (config.num_layers, 3, 10, config.num_kv_heads, config.head_dim)
    new = NewKV(*jax.random.normal(jax.random.key(2), (2, *shape), jnp.float32))
    # Rows 0 and 2 of `new` into slots 1 and 2 (out of range: dropped); positions 8, 9 dropped.
    got = cache.write_prefix(jnp.array([1, 2, 0]), NewKV(new.k[:, [0, 2, 1]], new.v[:, [0, 2, 1]]))
    back = got.token_major()
    for got_x, new_x in ((back.k, new.k), (back.v, new.v)):
        np.testing.assert_array_equal(got_x[:, 1], new_x[:, 0, :8])
        np.testing.assert_array_equal(got_x[:, 0], new_x[:, 1, :8])


@pytest.mark.parametrize("tokens", [1, 4])
def test_cached_forward_equals_the_scanned_forward(model, tokens):
    """Per-layer weights and cache, unrolled, compute what the scanned form does (features and
    new keys/values); written, the new tokens land at starts + t and nothing else changes."""
    graphdef, params = nnx.split(model)
    layers = unstack_layers(model.layers.stacked())
    stacked, cache = _filled(model, 3, 16, seed=3)
    starts = jnp.array([5, 9, 0], jnp.int32)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, model.config.vocab_size, (3, tokens)), jnp.int32)
    positions = starts[:, None] + jnp.arange(tokens)[None]
    mask = jnp.asarray(np.tril(np.ones((tokens, tokens), bool))[None].repeat(3, 0))
    mask = mask.at[:, -1, 0].set(tokens == 1)  # a tree-like mask (last token skips the first)
    want_f, want_new = model(ids, positions, mask_BxTxT=mask, cache=stacked, cache_lens_B=starts)

    @functools.partial(jax.jit, static_argnames="write")
    def run(params, layers, cache, write):
        return cached_forward(nnx.merge(graphdef, params), layers, ids, positions, cache, starts,
                              mask_BxTxT=mask, write=write)  # fmt: skip

    for write in (False, True):
        f, new, out = run(params, layers, cache, write)
        np.testing.assert_allclose(f, want_f, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(new.k, want_new.k, atol=1e-5, rtol=1e-5)
        got = np.asarray(out.token_major().k)
        want = np.asarray(stacked.k).copy()
        if write:
            for b, s in enumerate(np.asarray(starts)):
                want[:, b, s : s + tokens] = np.asarray(want_new.k[:, b])
        np.testing.assert_allclose(got, want, atol=1e-6)


def _temp_bytes(fn, *args, donate):
    return memory_report(jax.jit(fn, donate_argnums=donate).lower(*args).compile())["temp"]


@pytest.mark.parametrize("b", [1, 8])
def test_decode_verify_and_commit_update_the_cache_in_place(b):
    """No program copies the cache: a decode step writes its keys/values before attention
    reads them, verification only reads, and the commit only writes (a write after a read in
    one program makes XLA copy every cache array, as much traffic as the step itself). Head
    dim 64 makes one layer's keys 8x the verify's [B, K, G x T, S] scores."""
    model = init_model(get_preset("tiny").replace(head_dim=64), seed=7)
    config = model.config
    graphdef, params = nnx.split(model)
    layers = unstack_layers(model.layers.stacked())
    s = 1024
    state = engine_lib.DecodeState.create(config, b, s)
    array_bytes = b * s * config.num_kv_heads * config.head_dim * 4  # one layer's keys
    decode = functools.partial(engine_lib.decode_program, graphdef, batch=b, kv_len=s,
                               greedy_only=True)  # fmt: skip
    assert _temp_bytes(decode, params, layers, state, donate=(2,)) < array_bytes / 2
    t = 4
    tree = speculative.DraftTree(
        tokens_BxT=jnp.zeros((b, t), jnp.int32),
        parents_BxT=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) - 1, (b, t)),
        depth_BxT=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
        positions_BxT=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
        mask_BxTxT=jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t)),
    )
    verify = functools.partial(speculative.verify_program, graphdef, None, batch=b, kv_len=s,
                               greedy_only=True)  # fmt: skip
    assert _temp_bytes(verify, params, layers, None, state, tree, donate=(3,)) < array_bytes / 2
    _, _, _, counts, new, path = jax.jit(verify)(params, layers, None, state, tree)
    commit = functools.partial(speculative.commit_program, batch=b)
    assert _temp_bytes(commit, state, new, path, counts, donate=(0,)) < array_bytes / 2


def test_programs_refuse_a_cache_of_another_size(model):
    graphdef, params = nnx.split(model)
    layers = unstack_layers(model.layers.stacked())
    state = engine_lib.DecodeState.create(model.config, 2, 32)
    with pytest.raises(ValueError, match="2 slots x 32 positions; this program runs 4 x 32"):
        engine_lib.decode_program(graphdef, params, layers, state, batch=4, kv_len=32,
                                  greedy_only=True)  # fmt: skip


def test_pallas_cached_forward_with_query_chunk(model):
    """`query_chunk` builds the causal mask by rows ([1, T, T]); the Pallas path read that as
    the kernel's per-row mask and raised on a batch of 2."""
    b, t, s = 2, 6, 8
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (b, t)), jnp.int32)
    lens = jnp.array([3, 8], jnp.int32)
    positions = lens[:, None] + jnp.arange(t)[None]
    k, v = jax.random.normal(jax.random.key(0), (2, 2, b, s, 2, 16))
    cache = KVCache(k=k, v=v)
    want, _ = model(ids, positions, cache=cache, cache_lens_B=lens)
    got, _ = model(ids, positions, cache=cache, cache_lens_B=lens, query_chunk=3,
                   attention_impl="pallas")  # fmt: skip
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def _uniform_attention_case(b: int = 2, t: int = 4, s: int = 32, n: int = 4, kv: int = 2,
                            h: int = 16):  # fmt: skip
    """bfloat16 inputs whose attention weights are exact: zero queries make every visible
    position's weight 1 / count, with cache lengths + T a power of two (16, 32). Each output
    is then the mean of bfloat16 values, and the float64 mean is the answer up to one final
    rounding to bfloat16."""
    rng = np.random.default_rng(0)
    bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
    q = jnp.zeros((b, t, n, h), jnp.bfloat16)
    k, v = bf16(b, t, kv, h), bf16(b, t, kv, h)
    cache_k, cache_v = bf16(b, s, kv, h), bf16(b, s, kv, h)  # past each length: garbage
    lens = np.asarray([16 - t, 32 - t], np.int32)[:b]
    mask = jnp.ones((b, t, t), bool)
    v64, cache_v64 = np.asarray(v, np.float64), np.asarray(cache_v, np.float64)
    want = np.empty((b, t, n, h))
    for row, length in enumerate(lens):
        seen = np.concatenate([cache_v64[row, :length], v64[row]], 0)  # [length + T, K, H]
        mean = seen.mean(0)  # [K, H]; query head j reads kv head j // (n // kv)
        want[row] = np.repeat(mean, n // kv, axis=0)[None]
    return (q, k, v, mask, cache_k, cache_v, jnp.asarray(lens)), want


def _assert_rounded_once(got, want):
    """`got` (bfloat16) is within half a bfloat16 ulp of `want`: one rounding of the exact
    result, not several (two products each rounded, then their sum rounded, err by up to
    1.5 ulp)."""
    got = np.asarray(got, np.float64)
    _, exponent = np.frexp(want)
    half_ulp = np.ldexp(1.0, exponent - 9)  # bfloat16 keeps 8 significant bits
    err = np.abs(got - want) / half_ulp
    off = err > 1.0 + 1e-3
    assert not off.any(), (f"{off.sum()} of {err.size} outputs are off by more than half an ulp "
                           f"(worst: {err.max()} half ulps)")  # fmt: skip


@pytest.mark.parametrize("form", ["token_major", "head_major", "query_chunk", "decode"])
def test_bfloat16_attention_rounds_the_output_once(form):
    """The cache's and the new tokens' value products are accumulated in float32 and added
    before one rounding to bfloat16 (as the Pallas kernel and flash attention do), in every
    XLA form of attention: rounding each product to bfloat16 and adding in bfloat16 put up to
    three roundings on the output."""
    (q, k, v, mask, cache_k, cache_v, lens), want = _uniform_attention_case()
    head_k, head_v = jnp.transpose(cache_k, (0, 2, 3, 1)), jnp.transpose(cache_v, (0, 2, 1, 3))
    if form == "decode":
        fn = functools.partial(head_major_attention, q, k, v, mask, head_k, head_v, lens)
    else:
        layout = "head_major" if form == "head_major" else "token_major"
        caches = (head_k, head_v) if form == "head_major" else (cache_k, cache_v)
        fn = functools.partial(attention, q, k, v, mask, *caches, lens, impl="xla",
                               query_chunk=2 if form == "query_chunk" else 0,
                               cache_layout=layout)  # fmt: skip
    got = jax.jit(fn)()
    assert got.dtype == jnp.bfloat16
    _assert_rounded_once(got, want)
