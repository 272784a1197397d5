r"""GRPO on SmolLM2-135M-Instruct with GSM8K read from a local folder (TFDS manual dir).

    python scripts/train.py --config configs/smollm2_gsm8k.py --workdir /tmp/tlt_gsm8k \
        --config.data.data_dir=../shared/data/gsm8k

The folder must hold GSM8K's `train.jsonl` and `test.jsonl`. SmolLM2-135M scores near zero
on GSM8K; this config is for pipeline runs and rollout-shape measurements (long, varied
responses), and on a CPU a step takes minutes.
"""

import ml_collections

from tlt_jax.config_fields import config_variant
from tlt_jax.rl.config import default_config_dict


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config_variant(arg, ("",))
    c = default_config_dict()
    c.total_steps = 200
    c.checkpoint_every = 20
    c.plot_every = 5
    c.model.update(name="smollm2-135m-instruct", architecture="smollm2_135m")
    c.rl.update(prompts_per_step=8, group_size=8, micro_batch_size=16, format_weight=0.1,
                min_length_bucket=32, epsilon_high=0.28)  # fmt: skip
    c.data.name = "gsm8k"
    c.optim.update(learning_rate=2e-6, warmup_steps=5, b2=0.99)
    c.rollout.update(max_new_tokens=384, max_prompt_len=320)
    c.eval.max_new_tokens = 384
    return c
