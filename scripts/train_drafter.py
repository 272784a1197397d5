r"""Drafter warm-up: generate with the policy, train the EAGLE drafter on its features, export.

    python scripts/train_drafter.py --config configs/drafter_warmup.py --workdir /tmp/drafter \
        --config.prompts=prompts.jsonl --config.train.total_steps=2000

The config file holds every setting (`configs/drafter_warmup.py`: model, prompts, generation,
drafter training and its optimizer, the RL run's `OptimConfig`); any field can be overridden
as `--config.<field>=...`. Re-running with the same --workdir resumes (cached responses, latest
orbax checkpoint).
"""

from absl import app, flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", "configs/drafter_warmup.py", "Drafter config file.",
                                lock_config=True)  # fmt: skip
flags.DEFINE_string("workdir", None, "Checkpoints and cached responses.", required=True)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from tlt_jax.drafter.warmup import config_from_dict, run_warmup
    from tlt_jax.models.checkpoints import load_model, load_tokenizer

    config, script = config_from_dict(FLAGS.config, FLAGS.workdir)  # errors before loading
    print(FLAGS.config, flush=True)
    dtype = script["dtype"]
    overrides = {"param_dtype": dtype, "dtype": dtype} if dtype else {}
    out = run_warmup(config, load_model(script["model"], **overrides),
                     load_tokenizer(script["model"]),
                     max_steps=config.train.total_steps)  # fmt: skip
    print(f"exported EAGLE drafter to {out}")


if __name__ == "__main__":
    app.run(main)
