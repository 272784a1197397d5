r"""Full TLT (adaptive SD + the drafter spot-trained on the idle slice) vs plain, as whole runs.

    python scripts/bench_full_tlt.py --warm_drafter /tmp/warm/eagle --num_processes 2 \
        --pin_cores --steps 4 --pairs 2 --root /tmp/bench_full_tlt \
        --output_json /tmp/bench_full_tlt.json

`--config` (default: the main job) run as `scripts/train.py` twice per pair, plain and TLT, in
ABBA order, each as `--num_processes` processes (one rollout slice each; `--pin_cores` gives
each its own core, so the idle slice's core is physically idle) or, with one process, two
slices on two CPU devices (`XLA_FLAGS` is set for it). The first `--warmup` steps of each run
compile and are not measured (`tlt_jax/rl/bench_full_tlt.py`). Give the run the machine.
"""

import os
import sys
from pathlib import Path

from absl import app, flags

from tlt_jax import files
from tlt_jax.files import to_json, write_json

_CONFIG = flags.DEFINE_string("config", "configs/smollm2_arith.py", "Config file (train.py's).")
_WARM = flags.DEFINE_string(
    "warm_drafter", None, "HF-EAGLE drafter the TLT side starts from (default: random init)."
)
_STEPS = flags.DEFINE_integer("steps", 4, "RL steps per run.", lower_bound=1)
_WARMUP = flags.DEFINE_integer(
    "warmup", 1, "First steps of each run not measured (compiles).", lower_bound=0
)
_PAIRS = flags.DEFINE_integer("pairs", 2, "Plain/TLT pairs (ABBA order).", lower_bound=1)
_PROCESSES = flags.DEFINE_integer(
    "num_processes", 2, "Processes per run (one slice each).", lower_bound=1
)
_PIN = flags.DEFINE_bool("pin_cores", False, "Pin process i to core i (launch_local.py).")
_ROOT = flags.DEFINE_string("root", "/tmp/bench_full_tlt", "One fresh workdir per run under here.")
_EXTRA = flags.DEFINE_multi_string("override", [], "More train.py flags for every run.")
_OUTPUT_JSON = flags.DEFINE_string("output_json", None, "Where to write the results.")
files.register_output_checks("output_json")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from tlt_jax.rl import bench_full_tlt

    if _WARM.value and not Path(_WARM.value).is_dir():
        raise app.UsageError(f"--warm_drafter={_WARM.value!r} is not a directory")
    if not Path(_CONFIG.value.split(":")[0]).is_file():
        raise app.UsageError(f"--config={_CONFIG.value!r}: no such file")
    command = " ".join(["python", *sys.argv])
    print(command, flush=True)
    env = dict(os.environ)
    if _PROCESSES.value == 1:  # two slices in one process: two CPU devices
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            " --xla_force_host_platform_device_count=2").strip()  # fmt: skip
    try:
        result = bench_full_tlt.run(
            _CONFIG.value, Path(_ROOT.value), pairs=_PAIRS.value, steps=_STEPS.value,
            warmup=_WARMUP.value, warm=_WARM.value, processes=_PROCESSES.value,
            pin_cores=_PIN.value, extra=_EXTRA.value, env=env)  # fmt: skip
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    result["command"] = command
    print(to_json(result["summary"], indent=1))
    if _OUTPUT_JSON.value:
        write_json(_OUTPUT_JSON.value, result, indent=1)
        print(f"wrote {_OUTPUT_JSON.value}")
    if result["errors"]:
        print(f"runs that failed: {result['errors']}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
