r"""Acceptance length per RL step: spot-trained vs frozen warm-up drafter vs a cold start.

    python scripts/train_drafter.py --config configs/drafter_warmup.py:arith \
        --workdir /tmp/warm_drafter --config.prompts=P.jsonl --config.train.total_steps=300 \
        --config.train.batch_rows=2 --config.train.row_len=1024 \
        --config.train.optim.learning_rate=3e-4 --config.train.optim.warmup_steps=50
    python scripts/bench_accept.py --warm_drafter /tmp/warm_drafter/eagle --steps 20 \
        --root /tmp/bench_accept --output_json /tmp/bench_accept.json

Three runs of `--config` (default: the main job) with two rollout slices on two CPU devices
(`XLA_FLAGS` is set for them), differing only in the drafter (`tlt_jax/rl/bench_accept.py`).
A run whose workdir already holds checkpoints resumes to `--steps`, so a cut-short benchmark
continues where it stopped. Acceptance is a count, not a time: a busy machine slows the runs,
not the figure (it changes how many drafter steps fit in the idle windows).
"""

import os
import sys
from pathlib import Path

from absl import app, flags

from tlt_jax import files
from tlt_jax.files import to_json, write_json

_CONFIG = flags.DEFINE_string("config", "configs/smollm2_arith.py", "Config file (train.py's).")
_WARM = flags.DEFINE_string("warm_drafter", None, "The warm-up drafter (HF-EAGLE export).")
_STEPS = flags.DEFINE_integer("steps", 20, "RL steps per run.", lower_bound=1)
_ROOT = flags.DEFINE_string("root", "/tmp/bench_accept", "One workdir per variant under here.")
_VARIANTS = flags.DEFINE_list("variants", ["spot", "frozen", "cold"], "Runs, in order.")
_EXTRA = flags.DEFINE_multi_string("override", [], "More train.py flags for every run.")
_PROBE = flags.DEFINE_integer(
    "probe_prompts", 8,
    "Then probe each run's final policy with every drafter on this many held-out prompts "
    "(x the group size, SD on every step; 0: no probe).")  # fmt: skip
_OUTPUT_JSON = flags.DEFINE_string("output_json", None, "Where to write the results.")
files.register_output_checks("output_json")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from tlt_jax.rl import bench_accept

    unknown = sorted(set(_VARIANTS.value) - set(bench_accept.VARIANTS))
    if unknown:
        raise app.UsageError(f"--variants {unknown} not in {list(bench_accept.VARIANTS)}")
    if _WARM.value and not Path(_WARM.value).is_dir():
        raise app.UsageError(f"--warm_drafter={_WARM.value!r} is not a directory")
    warm_variants = [v for v in _VARIANTS.value if v != "cold"]
    if warm_variants and not _WARM.value:  # not once the runs before them are done
        raise app.UsageError(f"--variants {warm_variants} start from a warm-up drafter: give "
                             "--warm_drafter (an exported HF-EAGLE directory), or run only "
                             "--variants=cold")  # fmt: skip
    command = " ".join(["python", *sys.argv])
    print(command, flush=True)
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=2").strip()  # fmt: skip
    result = bench_accept.run(_CONFIG.value, Path(_ROOT.value), _VARIANTS.value, _STEPS.value,
                              _WARM.value, _EXTRA.value, env=env,
                              probe_prompts=_PROBE.value)  # fmt: skip
    result["command"] = command
    print(to_json(result["summary"], indent=1))
    if _OUTPUT_JSON.value:
        write_json(_OUTPUT_JSON.value, result, indent=1)
        print(f"wrote {_OUTPUT_JSON.value}")


if __name__ == "__main__":
    app.run(main)
