r"""Which mesh each big preset needs: its run's programs lowered on 8, 64 and 256 devices.

For every preset and device count, the train (gradient, optimizer update), prefill, decode,
draft and verify programs of the preset's run config are lowered on an abstract mesh (nothing
allocated; `tlt_jax.rl.fit`) for `--platforms`, and compiled for as many fake CPU devices
(256 are made) so XLA's memory analysis of each is read. Per device: train state, rollout copy, KV
cache at the rollout batch, drafter (params, cache, optimizer), and the compiler's
temporaries where measured, against H200 (141 GB) and TPU v5p (95 GB) at 90% usable.

  python scripts/fit_report.py --output_json=/tmp/fit.json --markdown=/tmp/fit.md

CPU temporaries overstate an accelerator's: the CPU backend upcasts bfloat16 matmul operands
(weights, KV cache) to float32 copies, so a verdict with them is conservative.
Presets without a config of their own plan with `configs/ds_r1_distill_qwen_7b_math.py`'s
sizes (16k-token reasoning responses) and their own architecture.
"""

import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=256"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import shlex  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
from absl import app, flags  # noqa: E402

from tlt_jax import files
from tlt_jax.files import write_json  # noqa: E402
from tlt_jax.models.presets import get_preset  # noqa: E402
from tlt_jax.rl import fit, policy  # noqa: E402
from tlt_jax.rl.config import TrainConfig  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PRESET_CONFIGS = {
    "qwen2_5_7b": "configs/qwen2_5_7b_gsm8k.py",
    "ds_r1_distill_qwen_7b": "configs/ds_r1_distill_qwen_7b_math.py",
    "qwen2_5_32b": "configs/ds_r1_distill_qwen_7b_math.py",
    "llama3_8b": "configs/ds_r1_distill_qwen_7b_math.py",
}

_PRESETS = flags.DEFINE_list("presets", list(PRESET_CONFIGS), "Model presets to plan.")
_DEVICES = flags.DEFINE_list("devices", [str(n) for n in fit.MESH_SIZES], "Device counts.")
_PLATFORMS = flags.DEFINE_list("platforms", ["tpu", "cuda"], "Backends lowered for (abstract).")
_COMPILE = flags.DEFINE_bool("compile", True, "Compile each mesh's programs on fake CPU devices.")
_PROGRAMS = flags.DEFINE_list("programs", list(fit.PROGRAMS), "Programs to lower.")
_OUTPUT_JSON = flags.DEFINE_string("output_json", None, "Write the rows here as JSON.")
_MARKDOWN = flags.DEFINE_string("markdown", None, "Write the README table here.")
files.register_output_checks("output_json", "markdown")

GB = 1e9


def run_config(preset: str) -> TrainConfig:
    """The preset's run config (its own, or the long-reasoning one with its architecture).

    Only sizes shape the programs, so a config whose data needs files (GSM8K) plans with the
    procedural arithmetic data instead.
    """
    path = REPO / PRESET_CONFIGS.get(preset, "configs/ds_r1_distill_qwen_7b_math.py")
    spec = importlib.util.spec_from_file_location("_fit_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config(None)
    c.model.architecture = preset
    if c.data.name == "gsm8k" and not c.data.data_dir:
        c.data.name = "arithmetic"
    return TrainConfig.from_config_dict(c)


def model_for(config: TrainConfig, preset: str):
    """The model the run would build (`policy.planned_model_config`: a checkpoint's dtypes
    when the config loads one), of `preset`'s architecture."""
    return policy.planned_model_config(dataclasses.replace(config.model, architecture=preset))


def plan(preset: str, devices: int) -> dict:
    config = run_config(preset)
    model = model_for(config, preset)
    shape = fit.mesh_for(model, devices)
    only = tuple(_PROGRAMS.value)
    lowered = {}
    for platform in _PLATFORMS.value:
        programs = fit.lower_programs(config, model, fit.make_mesh(shape), platform=platform,
                                      only=only)  # fmt: skip
        lowered[platform] = programs.lower_seconds
    memory = None
    cpu = jax.devices("cpu")
    if _COMPILE.value and devices <= len(cpu):
        programs = fit.lower_programs(config, model, fit.make_mesh(shape, cpu), only=only)
        start = time.perf_counter()
        memory = fit.compile_memory(programs)
        compile_s = time.perf_counter() - start
    row = fit.fit_row(programs, memory)
    row.update(preset=preset, config=PRESET_CONFIGS.get(preset), param_dtype=model.param_dtype,
               dtype=model.dtype, num_params=model.num_params(),
               lowered_for=lowered)  # fmt: skip
    if memory:
        row["compile_seconds"] = round(compile_s, 1)
    return row


def _gb(n: int) -> str:
    return f"{n / GB:.1f}"


def print_row(row: dict) -> None:
    sizes = row["bytes_per_device"]
    parts = "  ".join(f"{k} {_gb(v)}" for k, v in sizes.items())
    temps = ""
    if "compiled" in row:
        temps = "  temp (CPU): " + " ".join(f"{k} {_gb(v.get('temp', 0))}"
                                           for k, v in row["compiled"].items())  # fmt: skip
        # What the partitioner sends per program call (all-gathers and all-reduces).
        temps += "\n" + " " * 31 + "collectives GB/call: " + " ".join(
            f"{k} {_gb(sum(b for n, b in v.items() if n.endswith('_bytes')))}"
            for k, v in row["compiled"].items())  # fmt: skip
    fits = " ".join(f"{chip}={'yes' if ok else 'no'}" for chip, ok in row["fits"].items())
    print(f"{row['preset']:<22} {row['mesh']:>6}  GB/device: {parts}{temps}\n"
          f"{'':<22} {'':>6}  resident {_gb(row['resident_bytes'])}  peak "
          f"{_gb(row['peak_bytes'])} ({row['temporaries']})  fits: {fits}", flush=True)  # fmt: skip


def markdown(rows: list[dict]) -> str:
    """The README table: per preset and mesh, the big components and the verdicts."""
    chips = list(fit.MEMORY_GB)
    head = (
        "| preset | mesh (data x tensor) | train state | rollout params | KV cache "
        "(rows x len) | drafter | max temp (CPU compile) | peak | " + " | ".join(chips) + " |"
    )
    lines = [head, "|" + "---|" * (8 + len(chips))]
    for r in rows:
        s, g = r["bytes_per_device"], r["geometry"]
        train = s["train_params"] + s["optimizer_state"]
        drafter = s["drafter"] + s["drafter_optimizer"]
        temp = (_gb(max(v.get("temp", 0) for v in r["compiled"].values()))
                if "compiled" in r else "n/m")  # fmt: skip
        verdict = ["yes" if r["fits"][c] else "no" for c in chips]
        rollout = s["rollout_params"] + s.get("rollout_layers", 0)  # stacked + per-layer
        lines.append(f"| {r['preset']} | {r['mesh']} | {_gb(train)} | {_gb(rollout)}"
                     f" | {_gb(s['kv_cache'])} ({g['rollout_batch']} x {g['max_seq_len']}) | "
                     f"{_gb(drafter)} | {temp} | {_gb(r['peak_bytes'])} | "
                     + " | ".join(verdict) + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    unknown = sorted(set(_PRESETS.value) - set(PRESET_CONFIGS))
    for name in unknown:
        get_preset(name)  # unknown presets fail here, naming the choices
    devices = [int(d) for d in _DEVICES.value]
    cpus = len(jax.devices("cpu"))
    if not _PLATFORMS.value and not (_COMPILE.value and max(devices) <= cpus):
        # Each row is planned from an abstract lowering, or from the compile on fake CPU
        # devices; with neither it had no programs (UnboundLocalError).
        raise app.UsageError(f"--platforms is empty and --compile does not cover "
                             f"--devices={devices} ({cpus} CPU devices): give --platforms "
                             "tpu and/or cuda")  # fmt: skip
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    print(f"command: {command}\njax {jax.__version__}, {len(jax.devices('cpu'))} CPU devices; "
          f"GB = 1e9 bytes per device; usable {fit.USABLE_FRACTION:.0%} of "
          f"{fit.MEMORY_GB}", flush=True)  # fmt: skip
    rows = []
    for preset in _PRESETS.value:
        for n in devices:
            rows.append(plan(preset, n))
            print_row(rows[-1])
    if _OUTPUT_JSON.value:
        write_json(_OUTPUT_JSON.value, {"command": command, "rows": rows}, indent=1)
        print(f"wrote {_OUTPUT_JSON.value}")
    if _MARKDOWN.value:
        files.write_text_atomic(_MARKDOWN.value, markdown(rows))
        print(f"wrote {_MARKDOWN.value}")


if __name__ == "__main__":
    app.run(main)
