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
from ml_collections import config_dict


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.total_steps = 400
    c.checkpoint_every = 10
    c.plot_every = 1

    c.model = dict(
        name="deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
        preset="",
        architecture="ds_r1_distill_qwen_7b",
        tokenizer="checkpoint",
        dtype="bfloat16",
        param_dtype="float32",
        mesh_shape=(2, 4),
        init_seed=0,
    )
    c.rl = dict(
        prompts_per_step=32,
        group_size=16,
        micro_batch_size=16,
        num_minibatches=4,
        reward_fn="math_accuracy",
        format_weight=0.0,
        reward_timeout_s=10.0,
        max_nonfinite_steps=3,
        min_length_bucket=512,
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
        temperature=0.6,
        top_p=0.95,
        top_k=0,
        max_new_tokens=16384,
        max_prompt_len=1024,
        max_batch_size=256,
        max_prefill_batch=32,
        min_prompt_bucket=128,
    )
    c.eval = dict(num_problems=500, max_new_tokens=16384, at_start=True, at_end=True)
    c.checkpoint = dict(max_to_keep=3, async_save=True)
    return c
