"""The bandit against simulated arms: how fast it follows a drafter that trains during RL.

`AdaptivePolicy` picks arms by measured step times, so its behaviour over many RL steps of a
drafter that changes (a cold start learning online) cannot be timed on a real run without
also timing everything else. Here each arm has a known speed (tokens per running request per
second) per RL step and the recorded rewards carry multiplicative timing noise. Each decode
step stands for the same tokens, taking 1 / speed of the arm chosen; the figure is the time an
oracle that knows the speeds would take over the time of the bandit's choices (1.0: the
oracle). Both sides see the same speeds and noise draws; one is told of each new drafter
version at the RL step boundary (`drafter_changed`, as `spot.publish_drafter` does), the other
is not (the bandit before that hook). One batch bucket with one strategy per source: a real
rollout has up to one bucket per power of two under the SD threshold, each with its drafter
arms, and the retries after a new version are paid in each.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tlt_jax.rollout.adaptive import AdaptivePolicy, BanditConfig, arm_name

# One BEG bucket at batch 1 with one strategy per source: plain, the drafter's EAGLE tree,
# and model-free n-gram drafts (which do not depend on the drafter).
ARMS_CONFIG = dict(threshold=1, warmup_steps=0, bucket_bounds=(1,), strategies=(("8,4,8",),),
                   sources=("eagle", "ngram"))  # fmt: skip
PLAIN_SPEED, NGRAM_SPEED = 30.0, 25.0


SCENARIOS = ("improving", "weak", "strong")


def scenario(name: str, rl_steps: int) -> Callable[[int], dict[str, float]]:
    """RL step -> arm speeds. "improving": the EAGLE arm from 0.5x plain's speed to 2x over
    the first three quarters of the steps (a cold start that passes plain and n-gram drafts
    on the way); "weak" / "strong": 0.5x / 2x plain throughout."""
    if name not in SCENARIOS:
        raise ValueError(f"scenario {name!r} is not one of {list(SCENARIOS)}")
    plain, eagle, ngram = (arm_name(a) for a in BanditConfig(**ARMS_CONFIG).bucket_arms(0))

    def speeds(step: int) -> dict[str, float]:
        x = min(step / max(1, round(0.75 * rl_steps)), 1.0) if name == "improving" else 0.0
        ratio = {"improving": 0.5 + 1.5 * x, "weak": 0.5, "strong": 2.0}[name]
        return {plain: PLAIN_SPEED, ngram: NGRAM_SPEED, eagle: ratio * PLAIN_SPEED}

    return speeds


def simulate(speeds: Callable[[int], dict[str, float]], *, told: bool, rl_steps: int,
             sd_steps: int, noise: float, seed: int) -> float:  # fmt: skip
    """The oracle's time over the bandit's for `rl_steps` RL steps of `sd_steps` SD-mode
    decode steps each (each step: one token per request at the chosen arm's true speed)."""
    policy = AdaptivePolicy(BanditConfig(**ARMS_CONFIG, seed=seed))
    rng = np.random.default_rng(seed + 1)
    taken = oracle = 0.0
    for step in range(rl_steps):
        speed = speeds(step)
        policy.begin()
        for _ in range(sd_steps):
            choice = policy.choose(1)
            true = speed[arm_name(choice)]
            measured = true * max(0.05, 1.0 + noise * rng.standard_normal())
            policy.record(choice, 1, 1, 1.0 / measured)
            taken += 1.0 / true
            oracle += 1.0 / max(speed.values())
        if told:
            policy.drafter_changed()
    return oracle / taken


def run(*, scenarios: tuple[str, ...], seeds: int, rl_steps: int, sd_steps: int,
        noise: float) -> dict:  # fmt: skip
    """Per scenario, told and untold: the oracle-time fraction's mean, min and max over
    seeds."""
    out: dict = {"arms": dict(ARMS_CONFIG), "plain_speed": PLAIN_SPEED,
                 "ngram_speed": NGRAM_SPEED, "seeds": seeds, "rl_steps": rl_steps,
                 "sd_steps_per_rl_step": sd_steps, "timing_noise": noise,
                 "scenarios": {}}  # fmt: skip
    for name in scenarios:
        speeds = scenario(name, rl_steps)
        row = {}
        for side, told in (("told", True), ("untold", False)):
            fractions = [simulate(speeds, told=told, rl_steps=rl_steps, sd_steps=sd_steps,
                                  noise=noise, seed=s) for s in range(seeds)]  # fmt: skip
            row[side] = {"mean": float(np.mean(fractions)), "min": float(min(fractions)),
                         "max": float(max(fractions))}  # fmt: skip
        row["told_over_untold"] = row["told"]["mean"] / row["untold"]["mean"]
        out["scenarios"][name] = row
    return out
