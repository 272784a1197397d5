"""Times the Pallas tree-attention kernel against the jitted XLA reference, side by side.

One GPU / TPU run covers the full shape set (B in {1, 4, 16}, T in {8, 16, 32, 48},
S in {512, 2048, 8192}, Qwen2.5-7B and SmolLM2-135M heads):

  python scripts/bench_kernels.py --dtype=bfloat16 --output_json=/tmp/bench_kernels.json

On CPU the kernel runs in the Pallas interpreter, which says nothing about kernel speed, so the
default there is a tiny shape set that only proves the script end to end (under a minute).
Cache lengths are ragged: request b of B holds ``S - b * S // (2 * B)`` cached tokens.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from pallas_kernels.tree_attention import BlockSizes, tree_attention, tree_attention_reference
from tlt_jax.models.presets import get_preset

_OUTPUT_JSON = flags.DEFINE_string("output_json", None, "Where to write the results (JSON).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Input dtype.")
_INTERPRET = flags.DEFINE_enum(
    "interpret", "auto", ["auto", "true", "false"], "Pallas interpret mode; auto = on CPU only."
)
_SHAPES = flags.DEFINE_enum(
    "shapes", "auto", ["auto", "tiny", "full"], "Shape set; auto = tiny on CPU, full elsewhere."
)
_MODELS = flags.DEFINE_list(
    "models", ["qwen2_5_7b", "smollm2_135m"], "Model presets whose head shapes (N, K, H) to use."
)
_NUM_RUNS = flags.DEFINE_integer("num_runs", 0, "Timed runs per case (median); 0 = auto.")
_BLOCK_KV = flags.DEFINE_integer("block_kv", 0, "Kernel block_kv; 0 = platform default.")
_BLOCK_ROWS = flags.DEFINE_integer("block_rows", 0, "Kernel block_rows; 0 = platform default.")
_NUM_KV_SPLITS = flags.DEFINE_integer("num_kv_splits", 0, "Kernel splits; 0 = platform default.")

SHAPE_SETS = {
    # (batch sizes, tree tokens, cache buffer lengths)
    "full": ([1, 4, 16], [8, 16, 32, 48], [512, 2048, 8192]),
    "tiny": ([1, 4], [8], [512]),
}
NUM_WARMUP = 2


def _cache_lens(batch_size: int, cache_len: int) -> np.ndarray:
    return np.array([cache_len - b * cache_len // (2 * batch_size) for b in range(batch_size)])


def _inputs(batch_size, tokens, cache_len, q_heads, kv_heads, head_dim, dtype):
    keys = iter(jax.random.split(jax.random.key(0), 5))
    normal = lambda *shape: jax.random.normal(next(keys), shape, dtype)
    # A chain (each token attends to all earlier ones) is the densest tree mask of T tokens.
    tree_mask_BxTxT = jnp.broadcast_to(
        jnp.tril(jnp.ones((tokens, tokens), bool)), (batch_size, tokens, tokens)
    )
    return (
        normal(batch_size, tokens, q_heads, head_dim),
        normal(batch_size, cache_len, kv_heads, head_dim),
        normal(batch_size, cache_len, kv_heads, head_dim),
        jnp.asarray(_cache_lens(batch_size, cache_len), jnp.int32),
        normal(batch_size, tokens, kv_heads, head_dim),
        normal(batch_size, tokens, kv_heads, head_dim),
        tree_mask_BxTxT,
    )


def _time(fn, args, num_runs: int) -> tuple[float, float, jax.Array]:
    """(compile + first run seconds, median seconds of num_runs, output)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    for _ in range(NUM_WARMUP):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(num_runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return first, statistics.median(times), out


def _block_sizes() -> BlockSizes | None:
    if not (_BLOCK_KV.value or _BLOCK_ROWS.value or _NUM_KV_SPLITS.value):
        return None
    return BlockSizes(
        block_kv=_BLOCK_KV.value or 128,
        block_rows=_BLOCK_ROWS.value or None,
        num_kv_splits=_NUM_KV_SPLITS.value or 1,
    )


def main(argv):
    del argv
    backend = jax.default_backend()
    interpret = {"auto": backend == "cpu", "true": True, "false": False}[_INTERPRET.value]
    shape_set = _SHAPES.value if _SHAPES.value != "auto" else "tiny" if backend == "cpu" else "full"
    num_runs = _NUM_RUNS.value or (3 if interpret else 20)
    dtype = jnp.dtype(_DTYPE.value)
    block_sizes = _block_sizes()
    command = " ".join(["python", *sys.argv])
    device = jax.devices()[0].device_kind
    print(f"command: {command}")
    print(
        f"backend: {backend} ({device}), jax {jax.__version__}, dtype {dtype}, "
        f"interpret={interpret}, shapes={shape_set}, block_sizes={block_sizes or 'default'}"
    )
    note = ""
    if interpret:
        note = (
            "Pallas interpret mode: times measure the interpreter, not the kernel; "
            "only the tiny shape set by default. Run on a GPU/TPU for real figures."
        )
        print(f"NOTE: {note}")
    print(
        "median of",
        num_runs,
        "runs after",
        NUM_WARMUP,
        "warm-up runs; cache lens are ragged "
        "(request b holds S - b*S//(2B) tokens); tree = chain of T tokens",
    )

    reference = jax.jit(tree_attention_reference)
    header = (
        f"{'model':<14}{'B':>4}{'T':>4}{'S':>6}{'mean_len':>9}{'xla_ms':>10}"
        f"{'pallas_ms':>11}{'speedup':>9}{'pallas_GB/s':>12}{'max_diff':>10}"
    )
    print(header)
    results = []
    batch_sizes, token_counts, cache_lens = SHAPE_SETS[shape_set]
    for model in _MODELS.value:
        config = get_preset(model)
        heads = (config.num_heads, config.num_kv_heads, config.head_dim)
        for batch_size in batch_sizes:
            for tokens in token_counts:
                for cache_len in cache_lens:
                    args = _inputs(batch_size, tokens, cache_len, *heads, dtype)
                    pallas = lambda *a: tree_attention(
                        *a, block_sizes=block_sizes, interpret=interpret
                    )
                    ref_first, ref_s, ref_out = _time(reference, args, num_runs)
                    pallas_first, pallas_s, pallas_out = _time(pallas, args, num_runs)
                    max_diff = float(
                        jnp.max(
                            jnp.abs(pallas_out.astype(jnp.float32) - ref_out.astype(jnp.float32))
                        )
                    )
                    lens = _cache_lens(batch_size, cache_len)
                    # Real cache bytes the kernel must read: K and V of every live position.
                    cache_bytes = 2 * int(lens.sum()) * heads[1] * heads[2] * dtype.itemsize
                    row = dict(
                        model=model,
                        batch=batch_size,
                        tokens=tokens,
                        cache_len=cache_len,
                        q_heads=heads[0],
                        kv_heads=heads[1],
                        head_dim=heads[2],
                        mean_cache_len=float(lens.mean()),
                        xla_ms=ref_s * 1e3,
                        pallas_ms=pallas_s * 1e3,
                        speedup=ref_s / pallas_s,
                        pallas_gb_per_s=cache_bytes / pallas_s / 1e9,
                        max_abs_diff=max_diff,
                        xla_first_call_s=ref_first,
                        pallas_first_call_s=pallas_first,
                    )
                    results.append(row)
                    print(
                        f"{model:<14}{batch_size:>4}{tokens:>4}{cache_len:>6}"
                        f"{row['mean_cache_len']:>9.0f}{row['xla_ms']:>10.3f}"
                        f"{row['pallas_ms']:>11.3f}{row['speedup']:>9.2f}"
                        f"{row['pallas_gb_per_s']:>12.1f}{max_diff:>10.2e}",
                        flush=True,
                    )
    if _OUTPUT_JSON.value:
        summary = dict(
            command=command,
            backend=backend,
            device=device,
            jax_version=jax.__version__,
            dtype=str(dtype),
            interpret=interpret,
            shape_set=shape_set,
            num_runs=num_runs,
            num_warmup=NUM_WARMUP,
            block_sizes=str(block_sizes or "default"),
            note=note,
            results=results,
        )
        with open(_OUTPUT_JSON.value, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"wrote {_OUTPUT_JSON.value}")


if __name__ == "__main__":
    app.run(main)
