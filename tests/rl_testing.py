"""Helpers shared by the RL tests: config loading, the tiny run config, a dense reward."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "configs"


def load_config_dict(name: str, arg: str | None = None):
    """`configs/<name>.py:get_config(arg)`, loaded from its file like `config_flags` does."""
    spec = importlib.util.spec_from_file_location(f"_config_{name}", CONFIG_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def tiny_config(**overrides):
    """The tiny run (random model, byte tokenizer) with dense rewards and no evaluation.

    Args:
      **overrides: dotted config keys to values, e.g. `**{"rl.group_size": 2}`.
    """
    from tlt_jax.rl.config import TrainConfig

    config = load_config_dict("tiny")
    config.rl.reward_fn = "rl_testing:mean_byte_reward"
    config.eval.num_problems = 0
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return TrainConfig.from_config_dict(config)


def mean_byte_reward(completion: str, answer: str) -> float:
    """Mean UTF-8 byte value / 255: a dense reward that random byte-level outputs vary in,
    so every group has a non-zero advantage and every update path runs."""
    del answer
    data = completion.encode("utf-8", errors="replace")
    return sum(data) / (255.0 * max(len(data), 1))


def silent_unless_30_reward(completion: str, answer: str) -> float:
    """`mean_byte_reward` for answer "30", a constant (a silent group) for any other."""
    return mean_byte_reward(completion, answer) if answer == "30" else 0.5


def slow_mean_byte_reward(completion: str, answer: str) -> float:
    """`mean_byte_reward` after a 20 ms pause: keeps a tiny run's steps long enough to be
    killed in the middle (the reward, and so the run, stays deterministic)."""
    import time

    time.sleep(0.02)
    return mean_byte_reward(completion, answer)
