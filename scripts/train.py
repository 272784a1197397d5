r"""GRPO-family RL post-training from an ml_collections config.

    python scripts/train.py --config configs/smollm2_arith.py --workdir /tmp/tlt_main
    python scripts/train.py --config configs/smollm2_arith.py:smoke --workdir /tmp/tlt_smoke \
        --config.rl.group_size=8 --config.optim.learning_rate=2e-6

Re-running with the same --workdir resumes from its latest checkpoint. A resume with another
`data` group (dataset, folder, splits, seed, prompt format) is refused, naming the changed
fields, unless --config.checkpoint.allow_data_change=True; so is one of another model (other
weights under `model.name`, which may move; another preset, init seed or tokenizer) unless
--config.checkpoint.allow_model_change=True.
"""

import logging

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None, "Config file (configs/X.py[:variant]).", lock_config=True
)
flags.DEFINE_string("workdir", None, "Checkpoints, metrics, TensorBoard events and plots.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every file at INFO
    logging.getLogger("tlt_jax").setLevel(logging.INFO)
    from tlt_jax.rl.policy import size_cpu_pool
    from tlt_jax.rl.run import train_and_evaluate

    # Before JAX starts its backends: a mesh of forced host devices needs a bigger CPU pool.
    threads = size_cpu_pool(FLAGS.config.model.mesh_shape)
    if threads:
        logging.getLogger("tlt_jax").info("PJRT_NPROC=%d for the mesh's CPU devices", threads)

    from tlt_jax.parallel.distributed import exit_on_failure

    with exit_on_failure():  # one of several processes failing stops them all at once
        train_and_evaluate(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
    app.run(main)
