r"""Drafter warm-up: the policy answers the prompts, the EAGLE drafter trains on its features.

    python scripts/train_drafter.py --config configs/drafter_warmup.py --workdir /tmp/drafter \
        --config.prompts=prompts.jsonl
    # the main job's workload: arithmetic worked step by step, sampled as RL samples
    python scripts/train_drafter.py --config configs/drafter_warmup.py:arith \
        --workdir /tmp/warm_drafter --config.prompts=/tmp/warm_prompts.jsonl

Every field of `tlt_jax.drafter.warmup.WarmupConfig` (its drafter training in `train`, whose
optimizer is `train.optim`, the RL run's `OptimConfig`) can be overridden on the command line,
e.g. `--config.train.optim.learning_rate=1e-4`. Re-running with the same --workdir resumes
(cached responses, the latest orbax checkpoint). The export goes to `workdir/eagle` unless
`export_dir` is set; point an RL run's `spec.drafter` at it.
"""

import ml_collections

from tlt_jax.config_fields import config_variant
from tlt_jax.drafter.warmup import default_config_dict

VARIANTS = ("", "arith")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = config_variant(arg, VARIANTS)
    c = default_config_dict()
    c.model = "smollm2-135m-instruct"
    c.max_new_tokens = 1024
    c.hot_vocab_size = 2048
    c.train.total_steps = 1000
    if variant == "arith":  # configs/smollm2_arith.py's prompt and sampling
        c.instruction = "Solve step by step, end with '#### <number>'."
        c.max_new_tokens = 256
        c.temperature = 0.8
        c.train.total_steps = 400
    return c
