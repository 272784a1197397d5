"""What bounds a decode step on this machine, measured rather than quoted.

- `read_bandwidth_gbs`: bytes per second a large-array reduction reads (a copy also writes,
  and understates what a decode step, which only reads its weights, can stream).
- `matmul_gflops`: the best FLOP/s of a large square matmul in a dtype (the compute roofline).
- `decode_flops_per_token`: the FLOPs one decoded token costs a model at a context length.
- `target_forward_ms`: the target's forward with logits over T new tokens on a cache, at batch
  1, in the engine's form (per-layer weights and cache, `tlt_jax.models.decode`), for T = 1
  (a plain step's forward) and the verify widths of a tree (its cost over T = 1 is what an SD
  step pays on top of a plain step to verify T drafted tokens).

Used by `scripts/bench_rollout.py`; every figure is a best of several runs (other jobs share
the machine) and the widths are timed round-robin so that each sees the same load.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.decode import DecodeCache, cached_forward, unstack_layers
from tlt_jax.models.transformer import Transformer
from tlt_jax.rollout.bench import best_ms


def read_bandwidth_gbs(nbytes: int = 512 * 1024**2, repeats: int = 5) -> float:
    """GB/s of a float32 sum over `nbytes` (far larger than the caches)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    return nbytes / (best_ms(jax.jit(jnp.sum), x, iters=repeats) / 1e3) / 1e9


def matmul_gflops(n: int = 2048, dtype=jnp.float32, repeats: int = 5) -> float:
    """GFLOP/s of an [n, n] x [n, n] matmul in `dtype` (float32 accumulation)."""
    a = jnp.ones((n, n), dtype)
    fn = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    return 2 * n**3 / (best_ms(fn, a, a, iters=repeats) / 1e3) / 1e9


def decode_flops_per_token(config: ModelConfig, context: int) -> float:
    """2 x the multiply-adds of one token: every weight matrix once (q, k, v, o and the MLP's
    three per layer, and the LM head; the embedding is looked up, not multiplied), plus
    attention's scores and weighted sum over `context` positions."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    n, k, h = config.num_heads, config.num_kv_heads, config.head_dim
    per_layer = 2 * d * n * h + 2 * d * k * h + 3 * d * f
    attention = 2 * n * h * context
    return 2.0 * (config.num_layers * (per_layer + attention) + d * v)


def target_forward_ms(model: Transformer, kv_len: int, widths: Sequence[int] = (1, 4, 8),
                      repeats: int = 10) -> dict[int, float]:  # fmt: skip
    """Best milliseconds of the target forward + logits over T chained new tokens at batch 1,
    attending to a `kv_len`-position cache (`kv_len - max(widths)` of it valid), per T."""
    config = model.config
    graphdef, params = nnx.split(model)
    layers = jax.jit(unstack_layers)(model.layers.stacked())  # the engine's per-layer weights
    cache = DecodeCache.zeros(config, 1, kv_len)
    context = jnp.array([kv_len - max(widths)], jnp.int32)

    @jax.jit
    def forward(params, layers, cache, tokens_1xT):
        model_ = nnx.merge(graphdef, params)
        t = tokens_1xT.shape[1]
        positions = context[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
        features, _, _ = cached_forward(model_, layers, tokens_1xT, positions, cache, context)
        return model_.logits(features)

    tokens = {t: jnp.ones((1, t), jnp.int32) for t in widths}
    for t in widths:
        jax.block_until_ready(forward(params, layers, cache, tokens[t]))  # compiles
    best = dict.fromkeys(widths, float("inf"))
    for _ in range(repeats):
        for t in widths:  # round-robin: every width sees the same machine load
            start = time.perf_counter()
            jax.block_until_ready(forward(params, layers, cache, tokens[t]))
            best[t] = min(best[t], time.perf_counter() - start)
    return {t: 1e3 * s for t, s in best.items()}
