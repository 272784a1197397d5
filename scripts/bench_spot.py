r"""Spot drafter training on the idle slice: straggler slowdown and reclaimed idle time.

    python scripts/launch_local.py --num_processes 2 --pin_cores -- \
        python scripts/bench_spot.py --output_json /tmp/bench_spot.json
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python scripts/bench_spot.py \
        --config configs/tiny.py --rounds 2 --output_json /tmp/bench_spot_tiny.json

The config's rollout on `--slices` slices (one per process under `launch_local.py`), spot
training off and on side by side, alternating, `--rounds` times, plain decoding on both sides
(`tlt_jax/rl/bench_spot.py`). Process 0 prints the command and writes the JSON.
"""

import contextlib
import os
import sys
import tempfile

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from tlt_jax import files
from tlt_jax.files import to_json, write_json

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", "configs/smollm2_arith.py", "Config file.", lock_config=True
)
flags.DEFINE_string("output_json", None, "Where to write the results.", required=True)
files.register_output_checks("output_json")
flags.DEFINE_integer(
    "rounds", 3, "Rollouts per side (alternating which side goes first).", lower_bound=1
)
flags.DEFINE_integer(
    "slices", 2, "Rollout slices in all (a multiple of the processes).", lower_bound=1
)
flags.DEFINE_string("workdir", None, "Scratch directory, kept (default: a temporary one, removed).")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from tlt_jax import programs

    programs.SHARED.enabled = False  # each side pays its own compiles, as a run of its own would
    absl_logging.set_verbosity(absl_logging.WARNING)
    from tlt_jax.parallel import distributed

    distributed.initialize_from_env()
    import jax

    from tlt_jax.rl.bench_spot import bench_config, bench_spot, reproducing_command
    from tlt_jax.rl.config import TrainConfig

    command = reproducing_command(sys.argv, dict(os.environ))  # with the launcher's flags
    primary = jax.process_index() == 0
    if primary:
        print(command, flush=True)
    config = bench_config(TrainConfig.from_config_dict(FLAGS.config), FLAGS.slices)
    with contextlib.ExitStack() as stack:  # a scratch workdir is removed at the end
        workdir = FLAGS.workdir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="tlt_bench_spot_"))  # fmt: skip
        result = bench_spot(config, f"{workdir}/{jax.process_index()}", rounds=FLAGS.rounds)
    result["command"] = command
    if primary:
        write_json(FLAGS.output_json, result, indent=2)
        print(to_json(result, indent=2))


if __name__ == "__main__":
    app.run(main)
