r"""GRPO (DAPO clip-higher) on Qwen2.5-7B-Instruct with GSM8K, for 8 accelerators.

    python scripts/train.py --config configs/qwen2_5_7b_gsm8k.py --workdir /mnt/runs/qwen7b \
        --config.model.name=/path/to/Qwen2.5-7B-Instruct \
        --config.data.data_dir=/path/to/gsm8k

Mesh (data=2, tensor=4): the trainer keeps float32 master weights FSDP x tensor parallel
(`train` rules), the rollout engine runs 2 replicas of 4-way tensor parallelism (`rollout`
rules); compute is bfloat16. `model.architecture` checks the checkpoint and lets
`tests/test_configs.py` plan the run (shapes, bytes per device) on an abstract mesh.
"""

import ml_collections

from tlt_jax.config_fields import config_variant
from tlt_jax.rl.config import default_config_dict

_BOXED = "Please reason step by step, and put your final answer within \\boxed{}."


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config_variant(arg, ("",))
    c = default_config_dict()
    c.total_steps = 500
    c.checkpoint_every = 25
    c.plot_every = 5
    c.model.update(name="Qwen/Qwen2.5-7B-Instruct", architecture="qwen2_5_7b",
                   dtype="bfloat16", param_dtype="float32", mesh_shape=(2, 4))  # fmt: skip
    c.rl.update(prompts_per_step=64, group_size=8, micro_batch_size=32, num_minibatches=4,
                min_length_bucket=128, epsilon_high=0.28, remat=True, attention_chunk=1024,
                logits_chunk=1024)  # fmt: skip
    c.data.update(name="gsm8k", instruction=_BOXED)
    c.optim.update(learning_rate=1e-6, warmup_steps=10, weight_decay=0.01)
    c.rollout.update(max_new_tokens=2048, max_prompt_len=512, max_batch_size=256,
                     max_prefill_batch=32, min_prompt_bucket=128)  # fmt: skip
    c.eval.update(num_problems=1319, max_new_tokens=2048)
    return c
