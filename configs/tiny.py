r"""Tiny random model, byte tokenizer, a few steps in seconds: tests and smoke checks.

    python scripts/train.py --config configs/tiny.py --workdir /tmp/tlt_tiny

`:tlt` runs the whole TLT path: adaptive SD (BEG-MAB over EAGLE, n-gram and hybrid drafts),
two rollout slices and the drafter spot-trained on the idle one, cold-started. It needs two
devices: two processes,

    python scripts/launch_local.py --num_processes 2 --pin_cores -- \
        python scripts/train.py --config configs/tiny.py:tlt --workdir /tmp/tlt_tiny2

or one process with `XLA_FLAGS=--xla_force_host_platform_device_count=2`.

The model is `init_model(get_preset("tiny"))` (random weights, vocab 256), so rewards are
mostly zero: this config exercises the machinery (rollout, log-probs, update, sync,
checkpoints, metrics), not learning.
"""

import ml_collections

from tlt_jax.config_fields import config_variant
from tlt_jax.rl.config import default_config_dict

VARIANTS = ("", "tlt")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = config_variant(arg, VARIANTS)
    c = default_config_dict()
    c.total_steps = 4
    c.checkpoint_every = 2
    c.plot_every = 2
    c.model.update(preset="tiny", tokenizer="byte")
    c.rl.update(prompts_per_step=2, group_size=4, micro_batch_size=4, max_nonfinite_steps=2,
                min_length_bucket=8, epsilon_high=0.28)  # fmt: skip
    c.data.update(level="level1", num_train=200, num_test=32, instruction="",
                  use_chat_template=False)  # fmt: skip
    c.optim.learning_rate = 1e-3
    c.rollout.update(max_new_tokens=8, max_prompt_len=32, max_batch_size=8, min_prompt_bucket=8)
    c.eval.update(num_problems=8, max_new_tokens=8)
    if variant == "tlt":
        c.rollout.max_new_tokens = 24
        c.spec.update(mode="adaptive", threshold=8, warmup_steps=1, bucket_bounds=(1, 2, 3),
                      strategies=("3,1,4", "2,1,3", "1,1,2"))  # fmt: skip
        # A random policy scores 0 on every group, so the update trains nothing and only the
        # silent groups' forward feeds the drafter (spot.silent_features).
        c.spot.update(enabled=True, slices=2, row_len=64, window=64, silent_features=True)
    return c
