r"""Tree-verify and decode attention: the float32 XLA reference (the numerics oracle), the
model's XLA attention (bf16 products, float32 scores: what the Pallas speedup is taken over),
the Pallas kernel and the CUDA paths (torch SDPA, flash_attn, flashinfer where they import) side
by side (`tlt_jax/kernel_bench/`).

On a GPU (the device shape set: Qwen2.5-7B / R1-Distill-Qwen-7B heads, B 1-64, T 8-64,
S 1k-32k, headline verify cases first, within a 240 s budget):

    python scripts/bench_kernels.py --shapes=device --output_json=$OUT/bench_kernels.json

On CPU (the default there: a tiny shape set in Pallas interpret mode, which times the
interpreter, not the kernel, and proves the script end to end in well under a minute):

    python scripts/bench_kernels.py --shapes=tiny --output_json=/tmp/k.json

The command is printed first; the JSON is written after every case, so a run cut short keeps
what it measured.
"""

import os
import sys

from absl import app, flags

from tlt_jax import files

_SHAPES = flags.DEFINE_enum(
    "shapes", "auto", ["auto", "tiny", "device", "full"],
    "Shape set; auto = tiny on CPU, else device.",
)  # fmt: skip
_OUTPUT_JSON = flags.DEFINE_string("output_json", None, "Where to write the results (JSON).")
files.register_output_checks("output_json")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Input dtype.")
_BUDGET_S = flags.DEFINE_float("budget_s", 240.0, "No case starts after this many seconds.")
_MAX_BYTES = flags.DEFINE_integer("max_bytes", 8 << 30, "Skip cases whose inputs exceed this.")
_NUM_RUNS = flags.DEFINE_integer("num_runs", 0, "Timed runs per case (median); 0 = auto.")
_HBM_GBPS = flags.DEFINE_float("hbm_gbps", 0.0, "Peak HBM GB/s; 0 = by device kind.")
_INTERPRET = flags.DEFINE_enum(
    "interpret", "auto", ["auto", "true", "false"], "Pallas interpret mode; auto = on CPU only."
)
_IMPLEMENTATIONS = flags.DEFINE_list(
    "implementations", None, "Implementations to run (default: all), e.g. xla,pallas,torch_sdpa."
)  # fmt: skip
_BLOCK_KV = flags.DEFINE_integer("block_kv", 0, "Kernel block_kv; 0 = platform default.")
_BLOCK_ROWS = flags.DEFINE_integer("block_rows", 0, "Kernel block_rows; 0 = platform default.")
_NUM_KV_SPLITS = flags.DEFINE_integer("num_kv_splits", 0, "Kernel splits; 0 = platform default.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    command = " ".join(["python", *sys.argv])
    print(f"command: {command}", flush=True)
    # JAX must not take 75% of the GPU up front: torch's implementations need memory too.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from pallas_kernels.tree_attention import BlockSizes
    from tlt_jax import kernel_bench

    block_sizes = None
    if _BLOCK_KV.value or _BLOCK_ROWS.value or _NUM_KV_SPLITS.value:
        block_sizes = BlockSizes(
            block_kv=_BLOCK_KV.value or 128,
            block_rows=_BLOCK_ROWS.value or None,
            num_kv_splits=_NUM_KV_SPLITS.value or 1,
        )
    implementations = kernel_bench.IMPLEMENTATIONS
    if _IMPLEMENTATIONS.value:
        known = {i.name: i for i in implementations}
        unknown = sorted(set(_IMPLEMENTATIONS.value) - set(known))
        if unknown:
            raise app.UsageError(f"--implementations {unknown} not in {sorted(known)}")
        implementations = [known[name] for name in _IMPLEMENTATIONS.value]
    kernel_bench.run(
        _SHAPES.value,
        out_json=_OUTPUT_JSON.value,
        budget_s=_BUDGET_S.value,
        max_bytes=_MAX_BYTES.value,
        dtype=_DTYPE.value,
        num_runs=_NUM_RUNS.value,
        hbm_gbps=_HBM_GBPS.value,
        interpret={"auto": None, "true": True, "false": False}[_INTERPRET.value],
        block_sizes=block_sizes,
        implementations=implementations,
        command=command,
    )
    if _OUTPUT_JSON.value:
        print(f"wrote {_OUTPUT_JSON.value}")


if __name__ == "__main__":
    app.run(main)
