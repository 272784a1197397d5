r"""Tiny random model, byte tokenizer, a few steps in seconds: tests and smoke checks.

    python scripts/train.py --config configs/tiny.py --workdir /tmp/tlt_tiny

The model is `init_model(get_preset("tiny"))` (random weights, vocab 256), so rewards are
mostly zero: this config exercises the machinery (rollout, log-probs, update, sync,
checkpoints, metrics), not learning.
"""

import ml_collections

from tlt_jax.rl.config import default_config_dict


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg
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
    return c
