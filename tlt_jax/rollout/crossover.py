"""Where speculative decoding stops paying on this hardware: plain vs SD step costs per batch.

An SD step (draft, tree, verify) that costs `r` plain steps pays when it emits more than `r`
tokens on average (the acceptance length). `step_costs` times, per engine batch bucket, a
plain decode step and a full EAGLE SD step of each strategy through the engine's public API,
on random prompts with a random drafter (only shapes matter for cost: a step that accepts
nothing costs the same as one that accepts everything), and `crossover` reads off the largest
batch at which each strategy's cost ratio stays under an acceptance length. Plain steps also
report their HBM traffic (the weights plus the live K/V read once per step) against the
chip's peak, the bound a decode step at small batch is held to.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from tlt_jax.models.config import ModelConfig
from tlt_jax.rollout.adaptive import FixedPolicy, PlainPolicy, StepChoice
from tlt_jax.rollout.calibrate import random_requests, step_ms
from tlt_jax.rollout.speculative import SpecStrategy


def decode_bytes(config: ModelConfig, batch: int, context: int) -> int:
    """Bytes one plain decode step reads at least: every weight once and the live K/V."""
    weights = config.num_params() * np.dtype(config.jnp_param_dtype).itemsize
    kv = (2 * config.num_layers * batch * context * config.num_kv_heads * config.head_dim
          * np.dtype(config.jnp_dtype).itemsize)  # fmt: skip
    return int(weights + kv)


@dataclasses.dataclass
class StepCosts:
    """Milliseconds per step by batch: plain, and per SD strategy (its string)."""

    plain_ms: dict[int, float]
    sd_ms: dict[str, dict[int, float]]
    context: int
    seconds: float
    truncated: bool = False

    def ratio(self, strategy: str) -> dict[int, float]:
        return {b: ms / self.plain_ms[b] for b, ms in self.sd_ms[strategy].items()}

    def crossover(self, strategy: str, accept_len: float) -> int:
        """The largest timed batch whose SD / plain cost is below `accept_len` (0: none)."""
        return max((b for b, r in self.ratio(strategy).items() if r < accept_len), default=0)


def step_costs(engine, strategies: Sequence[str], batches: Sequence[int], *, prompt_len: int,
               steps: int = 8, temperature: float = 0.8, seed: int = 0,
               budget_s: float | None = None,
               on_batch: Callable[[StepCosts], None] | None = None) -> StepCosts:  # fmt: skip
    """Times plain and EAGLE SD steps of `strategies` at each batch (engine buckets).

    Args:
      engine: a `RolloutEngine` with a drafter; its step policy is restored afterwards.
      strategies: 'depth,topk,verify_tokens' strings.
      batches: batch sizes, each an engine batch bucket.
      prompt_len / steps: context of the timed steps (prompt) and steps timed per point.
      temperature: sampling (RL samples; 0 is greedy).
      budget_s: stop before a new batch once this many seconds have passed (`truncated`).
      on_batch: called with the costs so far after each batch (e.g. to write them, so that a
        process killed in a later batch keeps the earlier ones).
    """
    for text in strategies:
        SpecStrategy.parse(text)  # a bad strategy fails before anything compiles
    unknown = sorted(set(batches) - set(engine.config.batch_buckets))
    if unknown:
        raise ValueError(f"batches {unknown} are not engine batch buckets "
                         f"{engine.config.batch_buckets}")  # fmt: skip
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    saved = engine.step_policy
    costs = StepCosts({}, {s: {} for s in strategies}, prompt_len, 0.0)
    try:
        with engine.one_program_steps():  # a long run's steps, not a bucket's first tier
            for b in batches:
                if budget_s is not None and time.perf_counter() - start > budget_s:
                    costs.truncated = True
                    break
                requests = random_requests(engine.model_config.vocab_size, b,
                                           prompt_len=prompt_len, steps=steps,
                                           temperature=temperature, rng=rng)  # fmt: skip
                costs.plain_ms[b] = step_ms(engine, PlainPolicy(), requests)
                for text in strategies:
                    choice = StepChoice(SpecStrategy.parse(text), "eagle")
                    costs.sd_ms[text][b] = step_ms(engine, FixedPolicy(choice), requests)
                if on_batch is not None:
                    costs.seconds = time.perf_counter() - start
                    on_batch(costs)
    finally:
        engine.step_policy = saved
    costs.seconds = time.perf_counter() - start
    return costs


def report(costs: StepCosts, config: ModelConfig, *, peak_gbps: float | None,
           accept_lens: Sequence[float] = (2.0, 3.0)) -> dict:  # fmt: skip
    """JSON-ready rows per batch (costs, ratios, plain HBM traffic) and the crossovers."""
    rows = []
    for b, plain in costs.plain_ms.items():
        gbps = decode_bytes(config, b, costs.context) / (plain * 1e-3) / 1e9
        row = {
            "batch": b,
            "plain_ms": round(plain, 4),
            "plain_gb_per_s": round(gbps, 1),
            "plain_hbm_fraction": None if not peak_gbps else round(gbps / peak_gbps, 3),
        }
        for s in costs.sd_ms:
            if b in costs.sd_ms[s]:
                row[f"sd_ms[{s}]"] = round(costs.sd_ms[s][b], 4)
                row[f"ratio[{s}]"] = round(costs.sd_ms[s][b] / plain, 3)
        rows.append(row)  # fmt: skip
    crossovers = {s: {str(a): costs.crossover(s, a) for a in accept_lens} for s in costs.sd_ms}
    return {"rows": rows, "crossover_batch": crossovers, "context": costs.context,
            "seconds": round(costs.seconds, 1), "truncated": costs.truncated}  # fmt: skip
