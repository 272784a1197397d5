r"""Tiny random model, byte tokenizer, a few steps in seconds: tests and smoke checks.

    python scripts/train.py --config configs/tiny.py --workdir /tmp/tlt_tiny

The model is `init_model(get_preset("tiny"))` (random weights, vocab 256), so rewards are
mostly zero: this config exercises the machinery (rollout, log-probs, update, sync,
checkpoints, metrics), not learning.
"""

import ml_collections
from ml_collections import config_dict


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.total_steps = 4
    c.checkpoint_every = 2
    c.plot_every = 2

    c.model = dict(
        name="",
        preset="tiny",
        tokenizer="byte",
        dtype="",
        param_dtype="",
        mesh_shape=(1, 1),
        init_seed=0,
    )
    c.rl = dict(
        prompts_per_step=2,
        group_size=4,
        micro_batch_size=4,
        num_minibatches=1,
        reward_fn="math_accuracy",
        format_weight=0.0,
        reward_timeout_s=5.0,
        max_nonfinite_steps=2,
        min_length_bucket=8,
        advantage_estimator="grpo",
        loss_aggregation="token_mean",
        epsilon=0.2,
        epsilon_high=0.28,
        kl_coef=0.0,
        kl_estimator="k3",
        advantage_eps=1e-6,
    )
    c.data = dict(
        name="arithmetic",
        data_dir=config_dict.placeholder(str),
        cache_dir="~/.cache/tlt_jax/tfds",
        level="level1",
        num_train=200,
        num_test=32,
        instruction="",
        use_chat_template=False,
        system_prompt=config_dict.placeholder(str),
        seed=0,
        train_split="train",
        eval_split="test",
    )
    c.optim = dict(
        learning_rate=1e-3,
        schedule="constant",
        warmup_steps=0,
        end_lr_ratio=0.1,
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        grad_clip=1.0,
    )
    c.rollout = dict(
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=8,
        max_prompt_len=32,
        max_batch_size=8,
        max_prefill_batch=8,
        min_prompt_bucket=8,
    )
    c.eval = dict(num_problems=8, max_new_tokens=8, at_start=True, at_end=True)
    c.checkpoint = dict(max_to_keep=3, async_save=True)
    return c
