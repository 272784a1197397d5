r"""Measures where speculative decoding can pay on this machine: the SD threshold as JSON.

    python scripts/calibrate_spec.py --config configs/smollm2_arith.py \
        --output_json configs/calibration/cpu_smollm2.json

Times plain decode steps and verify steps of `--verify_tokens` tree tokens per engine batch
bucket (sampled at the config's temperature, random prompts, the config's engine sizes) and
writes `tlt_jax.rollout.calibrate.Calibration`: per bucket the two step times and their ratio,
and the threshold: the largest bucket whose ratio is below `--max_cost_ratio`. Point
`--config.spec.calibration_file` at the file.
"""

import math
import sys

from absl import app, flags
from ml_collections import config_flags

from tlt_jax import files
from tlt_jax.files import to_json

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", "configs/smollm2_arith.py", "Config file.", lock_config=True
)
flags.DEFINE_string("output_json", None, "Where to write the calibration.", required=True)
files.register_output_checks("output_json")
flags.DEFINE_integer(
    "verify_tokens",
    0,
    "Tree tokens per verify step (0: the smallest budget of the config's spec.strategies).",
    lower_bound=0,
)
flags.DEFINE_float("max_cost_ratio", 2.0, "SD is tried where verify / plain is below this.")
flags.register_validator("max_cost_ratio", lambda v: math.isfinite(v) and v > 0,
                         "--max_cost_ratio must be a finite number > 0")  # fmt: skip
flags.DEFINE_integer(
    "max_batch", 0, "Largest batch bucket timed (0: the engine's largest).", lower_bound=0
)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from tlt_jax import programs

    programs.SHARED.enabled = False  # each side pays its own compiles, as a run of its own would
    from tlt_jax.rl import policy
    from tlt_jax.rl.config import TrainConfig
    from tlt_jax.rollout.calibrate import calibrate
    from tlt_jax.rollout.speculative import SpecStrategy

    command = "python " + " ".join(sys.argv)
    print(command, flush=True)
    cfg = TrainConfig.from_config_dict(FLAGS.config)
    verify = FLAGS.verify_tokens or min(
        SpecStrategy.parse(s.split("|")[0]).verify_tokens for s in cfg.spec.strategies
    )
    engine = policy.build_engine(cfg, policy.build_policy(cfg.model, policy.build_mesh(cfg.model)))
    result = calibrate(engine, verify_tokens=verify, max_batch=FLAGS.max_batch or None,
                       temperature=cfg.rollout.temperature, max_cost_ratio=FLAGS.max_cost_ratio,
                       seed=cfg.seed)  # fmt: skip
    result.save(FLAGS.output_json)
    print(to_json({**result.to_dict(), "command": command}, indent=1))


if __name__ == "__main__":
    app.run(main)
