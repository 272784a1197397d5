r"""GRPO on DeepSeek-R1-Distill-Qwen-7B with long reasoning (the TLT paper's setting), 8 chips.

    python scripts/train.py --config configs/ds_r1_distill_qwen_7b_math.py --workdir /ckpt/run \
        --config.model.name=/path/to/DeepSeek-R1-Distill-Qwen-7B \
        --config.data.data_dir=/path/to/gsm8k

Prompts are math word problems from the GSM8K folder (the project's math builder; swap in a
harder set through the same manual-dir convention). Responses run to 16k tokens, so the
rollout long tail dominates the step: the baseline the speculative-rollout issues measure
against. DeepSeek recommends no system prompt and temperature 0.6; the chat template of the
checkpoint adds none.
"""

import ml_collections

from tlt_jax.config_fields import config_variant
from tlt_jax.rl.config import default_config_dict

_BOXED = "Please reason step by step, and put your final answer within \\boxed{}."


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config_variant(arg, ("",))
    c = default_config_dict()
    c.total_steps = 400
    c.checkpoint_every = 10
    c.model.update(name="deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
                   architecture="ds_r1_distill_qwen_7b", dtype="bfloat16",
                   param_dtype="float32", mesh_shape=(2, 4))  # fmt: skip
    c.rl.update(prompts_per_step=32, group_size=16, num_minibatches=4, reward_timeout_s=10.0,
                min_length_bucket=512, epsilon_high=0.28, remat=True, attention_chunk=1024,
                logits_chunk=1024)  # fmt: skip
    c.data.update(name="gsm8k", instruction=_BOXED)
    c.optim.update(learning_rate=1e-6, warmup_steps=10, weight_decay=0.01)
    c.rollout.update(temperature=0.6, top_p=0.95, max_new_tokens=16384, max_prompt_len=1024,
                     max_batch_size=256, max_prefill_batch=32, min_prompt_bucket=128)  # fmt: skip
    c.eval.update(num_problems=500, max_new_tokens=16384)
    return c
