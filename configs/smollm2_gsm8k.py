r"""GRPO on SmolLM2-135M-Instruct with GSM8K read from a local folder (TFDS manual dir).

    python scripts/train.py --config configs/smollm2_gsm8k.py --workdir /tmp/tlt_gsm8k \
        --config.data.data_dir=../shared/data/gsm8k

The folder must hold GSM8K's `train.jsonl` and `test.jsonl`. SmolLM2-135M scores near zero
on GSM8K; this config is for pipeline runs and rollout-shape measurements (long, varied
responses), and on a CPU a step takes minutes.
"""

import ml_collections
from ml_collections import config_dict


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.total_steps = 200
    c.checkpoint_every = 20
    c.plot_every = 5

    c.model = dict(
        name="smollm2-135m-instruct",
        preset="",
        architecture="smollm2_135m",
        tokenizer="checkpoint",
        dtype="",
        param_dtype="",
        mesh_shape=(1, 1),
        init_seed=0,
    )
    c.rl = dict(
        prompts_per_step=8,
        group_size=8,
        micro_batch_size=16,
        num_minibatches=1,
        reward_fn="math_accuracy",
        format_weight=0.1,
        reward_timeout_s=5.0,
        max_nonfinite_steps=3,
        min_length_bucket=32,
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
        instruction="Solve the problem step by step and put the final answer in \\boxed{}.",
        use_chat_template=True,
        system_prompt=config_dict.placeholder(str),
        seed=0,
        train_split="train",
        eval_split="test",
    )
    c.optim = dict(
        learning_rate=2e-6,
        schedule="constant",
        warmup_steps=5,
        end_lr_ratio=0.1,
        b1=0.9,
        b2=0.99,
        eps=1e-8,
        weight_decay=0.0,
        grad_clip=1.0,
    )
    c.rollout = dict(
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=384,
        max_prompt_len=320,
        max_batch_size=64,
        max_prefill_batch=8,
        min_prompt_bucket=16,
    )
    c.eval = dict(num_problems=200, max_new_tokens=384, at_start=True, at_end=True)
    c.checkpoint = dict(max_to_keep=3, async_save=True)
    return c
