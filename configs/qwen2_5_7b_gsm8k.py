r"""GRPO (DAPO clip-higher) on Qwen2.5-7B-Instruct with GSM8K, for 8 accelerators.

    python scripts/train.py --config configs/qwen2_5_7b_gsm8k.py --workdir gs://bucket/run \
        --config.model.name=/path/to/Qwen2.5-7B-Instruct \
        --config.data.data_dir=/path/to/gsm8k

Mesh (data=2, tensor=4): the trainer keeps float32 master weights FSDP x tensor parallel
(`train` rules), the rollout engine runs 2 replicas of 4-way tensor parallelism (`rollout`
rules); compute is bfloat16. `model.architecture` checks the checkpoint and lets
`tests/test_configs.py` plan the run (shapes, bytes per device) on an abstract mesh.
"""

import ml_collections
from ml_collections import config_dict


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.total_steps = 500
    c.checkpoint_every = 25
    c.plot_every = 5

    c.model = dict(
        name="Qwen/Qwen2.5-7B-Instruct",
        preset="",
        architecture="qwen2_5_7b",
        tokenizer="checkpoint",
        dtype="bfloat16",
        param_dtype="float32",
        mesh_shape=(2, 4),
        init_seed=0,
    )
    c.rl = dict(
        prompts_per_step=64,
        group_size=8,
        micro_batch_size=32,
        num_minibatches=4,
        reward_fn="math_accuracy",
        format_weight=0.0,
        reward_timeout_s=5.0,
        max_nonfinite_steps=3,
        min_length_bucket=128,
        advantage_estimator="grpo",
        loss_aggregation="token_mean",
        epsilon=0.2,
        epsilon_high=0.28,
        kl_coef=0.0,
        kl_estimator="k3",
        advantage_eps=1e-6,
    )
    c.data = dict(
        name="gsm8k",
        data_dir=config_dict.placeholder(str),
        cache_dir="~/.cache/tlt_jax/tfds",
        level="mixed",
        num_train=20_000,
        num_test=500,
        instruction="Please reason step by step, and put your final answer within \\boxed{}.",
        use_chat_template=True,
        system_prompt=config_dict.placeholder(str),
        seed=0,
        train_split="train",
        eval_split="test",
    )
    c.optim = dict(
        learning_rate=1e-6,
        schedule="constant",
        warmup_steps=10,
        end_lr_ratio=0.1,
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        weight_decay=0.01,
        grad_clip=1.0,
    )
    c.rollout = dict(
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=2048,
        max_prompt_len=512,
        max_batch_size=256,
        max_prefill_batch=32,
        min_prompt_bucket=128,
    )
    c.eval = dict(num_problems=1319, max_new_tokens=2048, at_start=True, at_end=True)
    c.checkpoint = dict(max_to_keep=3, async_save=True)
    return c
