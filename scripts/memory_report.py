r"""Per-device memory of big presets on an 8-device mesh, without allocating the model.

Parameters and the KV cache are counted from their shardings on a `jax.sharding.AbstractMesh`
(the role's logical-axis rules); a decode step (one token per row over a KV cache of
`--seq_len`, cache donated) is lowered and compiled ahead of time for 8 fake CPU devices and
its `memory_analysis()` reported. CPU figures for temporaries overstate an accelerator's: the
CPU backend upcasts bfloat16 matmul operands (the weights, the KV cache) to float32 copies.
(qwen2_5_7b 2x4 decode: temp 6.6 GiB in bfloat16, 0.2 GiB with float32 weights.)

  python scripts/memory_report.py --preset=qwen2_5_7b,qwen2_5_32b --mesh=2,4 --mesh=1,8 \
      --role=rollout --batch=8 --seq_len=4096 --output_json=/tmp/memory.json
"""

import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import json  # noqa: E402
import shlex  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AbstractMesh  # noqa: E402

from tlt_jax.models.presets import get_preset  # noqa: E402
from tlt_jax.models.transformer import KVCache, abstract_state, write_kv  # noqa: E402
from tlt_jax.parallel import sharding  # noqa: E402

_PRESET = flags.DEFINE_list("preset", ["qwen2_5_7b", "qwen2_5_32b"], "Model presets.")
_MESH = flags.DEFINE_multi_string("mesh", ["2,4"], "data,tensor mesh shape (repeatable).")
_ROLE = flags.DEFINE_enum("role", "rollout", sorted(sharding.RULES), "Sharding rules table.")
_BATCH = flags.DEFINE_integer("batch", 8, "Decode batch (rows of the KV cache).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 4096, "KV cache length per row.")
_COMPILE = flags.DEFINE_bool("compile", True, "AOT-compile the decode step for memory_analysis.")
_OUTPUT_JSON = flags.DEFINE_string("output_json", None, "Also write the rows here as JSON.")

GIB = 1024**3


def decode_step_memory(config, graphdef, state, cache, mesh, rules, batch: int) -> dict:
    """Lowers and compiles one decode step on 8 CPU devices; its compiled memory stats."""
    rows = sharding.named_sharding((batch,), ("batch",), mesh, rules)
    tokens = jax.ShapeDtypeStruct(
        (batch, 1), jnp.int32,
        sharding=sharding.named_sharding((batch, 1), ("batch", "length"), mesh, rules),
    )  # fmt: skip
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows)

    def step(state, cache, tokens_Bx1, lens_B):
        model = nnx.merge(graphdef, state)
        features, new_kv = model(tokens_Bx1, lens_B[:, None], cache=cache, cache_lens_B=lens_B)
        return model.logits(features), write_kv(cache, new_kv, lens_B)

    with sharding.use_sharding(mesh, rules):
        traced = jax.jit(step, donate_argnums=1).trace(state, cache, tokens, lens)
    lowered = traced.lower(lowering_platforms=("cpu",))
    devices = jax.devices("cpu")
    if len(devices) < mesh.size:
        return {"compiled": f"skipped: {len(devices)} CPU devices < {mesh.size}"}
    stats = lowered.compile(device_assignment=tuple(devices[: mesh.size])).memory_analysis()
    if stats is None:
        return {"compiled": "memory_analysis() unavailable"}
    return {
        "argument_bytes": stats.argument_size_in_bytes,
        "output_bytes": stats.output_size_in_bytes,
        "alias_bytes": stats.alias_size_in_bytes,
        "temp_bytes": stats.temp_size_in_bytes,
        "peak_estimate_bytes": stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes,
    }


def report(preset: str, mesh_shape: tuple[int, int], role: str, batch: int, seq_len: int) -> dict:
    config = get_preset(preset)
    mesh = AbstractMesh(mesh_shape, ("data", "tensor"))
    rules = sharding.rules_for(role)
    graphdef, state = abstract_state(config, mesh, rules)
    shape = (config.num_layers, batch, seq_len, config.num_kv_heads, config.head_dim)
    kv_axes = ("layers", "batch", "kv_length", "kv_heads", "head_dim")
    kv = jax.ShapeDtypeStruct(
        shape, config.jnp_dtype, sharding=sharding.named_sharding(shape, kv_axes, mesh, rules)
    )
    cache = KVCache(k=kv, v=kv)
    row = {
        "preset": preset,
        "mesh": f"{mesh_shape[0]}x{mesh_shape[1]}",
        "role": role,
        "batch": batch,
        "seq_len": seq_len,
        "dtype": config.param_dtype,
        "num_params": config.num_params(),
        "param_bytes_total": config.num_params() * jnp.dtype(config.jnp_param_dtype).itemsize,
        "param_bytes_per_device": sharding.per_device_bytes(state),
        "kv_cache_bytes_per_device": sharding.per_device_bytes(cache),
        "q_spec": str(dict(nnx.to_flat_state(state))[("layers", "q")].get_value().sharding.spec),
        "kv_spec": str(kv.sharding.spec),
    }
    if _COMPILE.value:
        row["decode_step"] = decode_step_memory(config, graphdef, state, cache, mesh, rules, batch)
    return row


def _print_row(row: dict) -> None:
    print(f"\n{row['preset']}  mesh {row['mesh']} (data x tensor)  role {row['role']}  "
          f"batch {row['batch']}  seq_len {row['seq_len']}")  # fmt: skip
    total, per_device = row["param_bytes_total"] / GIB, row["param_bytes_per_device"] / GIB
    print(f"  params         {row['num_params'] / 1e9:.3f} B = {total:.2f} GiB total; "
          f"per device {per_device:.3f} GiB  (q {row['q_spec']})")  # fmt: skip
    print(f"  KV cache       per device {row['kv_cache_bytes_per_device'] / GIB:.3f} GiB"
          f"  (k/v {row['kv_spec']})")  # fmt: skip
    step = row.get("decode_step")
    if step and "argument_bytes" in step:
        parts = ", ".join(f"{k[:-6]} {v / GIB:.3f}" for k, v in step.items())
        print(f"  decode step    compiled for CPU, per device GiB: {parts}")
        if row["dtype"] != "float32":
            dtype = row["dtype"]
            print(f"                 (CPU temp includes float32 copies of {dtype} matmul operands: "
                  f"weights ~2x params, KV cache; an accelerator keeps {dtype})")  # fmt: skip
    elif step:
        print(f"  decode step    {step['compiled']}")


def main(argv):
    del argv
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}  devices: {jax.devices('cpu')[:1]} x "
          f"{len(jax.devices('cpu'))}")  # fmt: skip
    rows = []
    for preset in _PRESET.value:
        for mesh in _MESH.value:
            shape = tuple(int(s) for s in mesh.split(","))
            if len(shape) != 2:
                raise app.UsageError(f"--mesh={mesh!r} must be 'data,tensor', e.g. 2,4")
            rows.append(report(preset, shape, _ROLE.value, _BATCH.value, _SEQ_LEN.value))
            _print_row(rows[-1])
    if _OUTPUT_JSON.value:
        with open(_OUTPUT_JSON.value, "w") as f:
            json.dump({"command": sys.argv, "rows": rows}, f, indent=2)
        print(f"\nwrote {_OUTPUT_JSON.value}")


if __name__ == "__main__":
    app.run(main)
