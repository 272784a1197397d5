"""The rollout form of the policy (`tlt_jax.models.decode`): per-layer weights and cache, the
cached forward written and read-only, and the engine programs that must update it in place."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.models.decode import DecodeCache, cached_forward, move_row, unstack_layers
from tlt_jax.models.presets import get_preset
from tlt_jax.models.transformer import KVCache, NewKV, init_model
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
