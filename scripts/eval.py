r"""Greedy accuracy and mean response length of a run's latest checkpoint (or of the config's
untrained model) on the held-out split.

    python scripts/eval.py --config configs/smollm2_arith.py --workdir /tmp/tlt_main
    python scripts/eval.py --config configs/smollm2_arith.py --num_problems=500

Without --workdir (or with one that has no checkpoint, with a warning) the config's model is
scored as loaded; a --workdir that does not exist is refused.
The config's `data` may differ from the run's; a checkpoint of another model than the config's
(other weights, preset, init seed or tokenizer) is refused unless
--config.checkpoint.allow_model_change=True.
"""

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None, "Config file (configs/X.py[:variant]).", lock_config=True
)
flags.DEFINE_string("workdir", None, "A training run's workdir (its latest checkpoint).")
flags.DEFINE_integer(
    "num_problems", None, "Problems to score (default: config eval.num_problems).", lower_bound=1
)
flags.mark_flags_as_required(["config"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every file at INFO
    from tlt_jax.rl.run import evaluate_run

    evaluate_run(FLAGS.config, FLAGS.workdir, num_problems=FLAGS.num_problems)


if __name__ == "__main__":
    app.run(main)
