r"""The executable pool's size: one SD strategy vs all pairs vs TLT's bucketed pool.

TLT captures CUDA graphs per (batch size, strategy) and reports their memory: 7.81 GB for one
strategy, 30.39 GB for every (batch, strategy) pair, 10.69 GB for the bucketed pool. This is the
JAX counterpart (DESIGN.md section 4, "Executable pool"): three pools, each compiled into a fresh
`ProgramPool` by a real `RolloutEngine` (the engine's own programs and keys, no private names):

- `single`: one strategy (`single`, default bucket 0's first) at every batch bucket;
- `naive`: every strategy of every BEG bucket at every batch bucket;
- `bucketed`: at each engine batch bucket only the strategies of the BEG buckets the bandit maps
  its batch sizes to (`AdaptivePolicy.arms_for`); verify programs (keyed by batch, verify
  tokens and kv only) are shared by every strategy and source with that verify budget, and
  draft programs (batch, topk, depth) by strategies that differ only in the verify budget.

Every batch bucket up to the bandit's threshold runs a plain step too (plain is an arm of every
bucket), so each pool also holds the plain decode, prefill and slot-move programs (`base`,
the same in all three). One `generate` call of `n` two-token requests under
`FixedPolicy(choice)` compiles exactly one SD step at batch bucket(n): prefill emits the first
token and the SD step the rest. Only shapes matter, so a random drafter serves.

Reported per pool, for the SD programs and for all: the number of programs by kind, their
compile seconds, and XLA's memory analysis summed: executable bytes (generated code + temp,
what the pool itself holds: `ProgramPool.memory_bytes`) and arguments / outputs (the decode
state and weights, shared buffers counted once per program).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tlt_jax import programs
from tlt_jax.programs import CompiledInfo
from tlt_jax.rollout.adaptive import (
    DRAFT_SOURCES,
    AdaptivePolicy,
    BanditConfig,
    FixedPolicy,
    PlainPolicy,
    StepChoice,
)
from tlt_jax.rollout.engine import EngineConfig, Request, RolloutEngine, bucket_for
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.speculative import SpecStrategy

log = logging.getLogger(__name__)

POOLS = ("single", "naive", "bucketed")
SD_KINDS = ("spec_draft", "spec_tree", "spec_verify", "spec_commit")
STRATEGY_SETS = ("spec", "paper")
PROMPT_TOKENS = 8
MEMORY_FIELDS = ("generated_code", "temp", "argument", "output", "alias")
# TLT's Table (graph memory of the CUDA-graph pool), GB.
PAPER_GB = {"single": 7.81, "naive": 30.39, "bucketed": 10.69}
PAPER_BANDIT = {"bucket_bounds": (1, 2, 5, 21),
                "strategies": (("8,4,48",), ("8,4,32",), ("8,4,16",), ("8,4,8",))}  # fmt: skip

TINY_SIZES = {"max_batch_size": 2, "kv_len": 64, "hot_vocab": 32}

Plan = list[tuple[int, StepChoice | None]]  # (running requests, the step's choice; None: plain)


@dataclasses.dataclass(frozen=True)
class PoolBenchConfig:
    """`scripts/bench_pool.py`'s settings, one field per flag.

    Attributes:
      preset: "" (the checkpoint `model`) or "tiny" (random tiny model, small strategies:
        `tiny_bandit`, for tests and a quick run).
      strategy_set: "spec" (the `spec` group's default buckets and strategies) or "paper"
        (TLT's 8,4,48 / 8,4,32 / 8,4,16 / 8,4,8 with bounds 1,2,5,21).
      single: the single-strategy pool's strategy ("": bucket 0's first).
      sources: draft sources of every arm (ngram and hybrid reuse eagle's programs).
      threshold: the bandit's threshold (0: max_batch_size): SD batch buckets go up to it.
      max_batch_size / kv_len: the engine's batch buckets (1, 2, 4, .., max) and its one kv bucket.
      hot_vocab: draft head size (0: the full vocabulary).
      greedy: greedy requests (False: sampled, as GRPO rollouts are).
      share_compiles: a pool reuses the programs an earlier pool of the run compiled
        (`programs.SHARED`): the counts, keys and memory figures are the same, the compile
        seconds count only the first pool to compile each program (for tests; the benchmark
        compiles every pool privately).
    """

    model: str = "smollm2-135m-instruct"
    preset: str = ""
    strategy_set: str = "spec"
    single: str = ""
    sources: tuple[str, ...] = ("eagle",)
    threshold: int = 0
    max_batch_size: int = 32
    kv_len: int = 256
    hot_vocab: int = 2048
    greedy: bool = False
    share_compiles: bool = False

    def __post_init__(self):
        object.__setattr__(self, "sources", tuple(self.sources))
        if self.preset not in ("", "tiny"):
            raise ValueError(f"preset={self.preset!r} is not one of ['', 'tiny']")
        if self.strategy_set not in STRATEGY_SETS:
            raise ValueError(f"strategy_set={self.strategy_set!r} is not one of "
                             f"{list(STRATEGY_SETS)}")  # fmt: skip
        bad = [s for s in self.sources if s not in DRAFT_SOURCES]
        if not self.sources or bad:
            raise ValueError(f"sources={self.sources!r}: expected a non-empty subset of "
                             f"{list(DRAFT_SOURCES)}")  # fmt: skip
        if self.single:
            SpecStrategy.parse(self.single)
        for name, low in (("threshold", 0), ("max_batch_size", 1), ("kv_len", 16),
                          ("hot_vocab", 0)):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an integer >= {low}")

    @classmethod
    def tiny(cls, **overrides) -> PoolBenchConfig:
        """The tiny preset: batch buckets 1, 2, kv 64, a 32-token hot vocabulary."""
        return dataclasses.replace(cls(preset="tiny", **TINY_SIZES), **overrides)

    def bandit(self) -> BanditConfig:
        """The bandit whose arms the bucketed pool holds."""
        threshold = self.threshold or self.max_batch_size
        if self.preset == "tiny":
            return tiny_bandit(threshold, self.sources)
        groups = PAPER_BANDIT if self.strategy_set == "paper" else spec_default_bandit()
        return BanditConfig(threshold=threshold, sources=self.sources, **groups)


def spec_default_bandit() -> dict[str, Any]:
    """The `spec` config group's default bucket bounds and strategies."""
    from tlt_jax.rl.config import SpecConfig

    spec = SpecConfig()
    return {"bucket_bounds": spec.bucket_bounds,
            "strategies": tuple(tuple(s.split("|")) for s in spec.strategies)}  # fmt: skip


def tiny_bandit(threshold: int = 2, sources: Sequence[str] = ("eagle",)) -> BanditConfig:
    """Small strategies for the tiny model (batch buckets 1, 2): bucket 0 holds two with one
    verify budget (one shared verify program), bucket 1's has bucket 0's first's topk and depth
    (one shared draft program in the naive pool)."""
    return BanditConfig(threshold=threshold, bucket_bounds=(1, 2), sources=tuple(sources),
                        strategies=(("3,2,6", "5,1,6"), ("3,2,4",)))  # fmt: skip


# ----------------------------------------------------------------------------- plans


def _sd_batches(bandit: BanditConfig, batch_buckets: Sequence[int]) -> dict[int, list[int]]:
    """Engine batch bucket -> the running batch sizes (<= threshold) that fall in it."""
    out: dict[int, list[int]] = {}
    for n in range(1, min(bandit.threshold, batch_buckets[-1]) + 1):
        out.setdefault(bucket_for(n, batch_buckets), []).append(n)
    return out


def _all_choices(bandit: BanditConfig) -> list[StepChoice]:
    arms = [a for i in range(len(bandit.bucket_bounds)) for a in bandit.bucket_arms(i)]
    return list(dict.fromkeys(a for a in arms if a is not None))


def pool_plans(bandit: BanditConfig, batch_buckets: Sequence[int],
               single: SpecStrategy | None = None) -> dict[str, Plan]:  # fmt: skip
    """The steps that compile each pool: (running requests, choice) per batch bucket.

    Args:
      bandit: the BEG buckets, their strategies and sources, and the threshold.
      batch_buckets: the engine's batch buckets (`EngineConfig.batch_buckets`).
      single: the single-strategy pool's strategy (None: bucket 0's first).

    Returns:
      {"single" | "naive" | "bucketed": [(n, choice)]}: a plain step (None) and the pool's SD
      choices at one batch size n of every batch bucket SD can run at (n <= threshold).
    """
    single = single or SpecStrategy.parse(bandit.strategies[0][0])
    policy = AdaptivePolicy(bandit)
    plans: dict[str, Plan] = {name: [] for name in POOLS}
    for sizes in _sd_batches(bandit, batch_buckets).values():
        n = sizes[-1]
        bucketed = [a for m in sizes for a in policy.arms_for(m) if a is not None]
        choices = {
            "single": [StepChoice(single, source) for source in bandit.sources],
            "naive": _all_choices(bandit),
            "bucketed": list(dict.fromkeys(bucketed)),
        }
        for name in POOLS:
            plans[name].extend([(n, None)] + [(n, c) for c in choices[name]])
    return plans


# ----------------------------------------------------------------------------- compiling


def engine_config(max_batch_size: int, kv_len: int) -> EngineConfig:
    """One kv bucket; eager drafter sync (the rollout default: no catch-up programs); every
    step one program (the paper's pools: a layered engine's verify steps share their block
    programs across strategies of one budget the same way)."""
    return EngineConfig(max_batch_size=max_batch_size, max_seq_len=kv_len,
                        max_prefill_batch=min(max_batch_size, 8), min_kv_bucket=kv_len,
                        drafter_sync="eager", layers_per_program=0)  # fmt: skip


def compile_pool(model, drafter, plan: Plan, config: EngineConfig, *, hot_vocab: int = 0,
                 greedy: bool = False, private: bool = True) -> list[CompiledInfo]:  # fmt: skip
    """Runs `plan` on a fresh engine (a fresh pool; with `private`, compiling every program
    itself: nothing from another pool of the process); returns what its pool compiled.

    Each (n, choice) is one `generate` of n requests of two tokens: a prefill, then one step
    of `choice` (plain when None) at n running requests.
    """
    hot = np.arange(hot_vocab) if hot_vocab else None
    engine = RolloutEngine(model, config, drafter=drafter, hot_token_ids=hot)
    sampling = SamplingParams() if greedy else SamplingParams(temperature=1.0)
    vocab = model.config.vocab_size
    with programs.compile_privately() if private else contextlib.nullcontext():
        for n, choice in plan:
            engine.step_policy = PlainPolicy() if choice is None else FixedPolicy(choice)
            requests = [Request(tuple((7 * i + j) % (vocab - 1) + 1
                                      for j in range(PROMPT_TOKENS)), 2, sampling, seed=i)
                        for i in range(n)]  # fmt: skip
            engine.generate(requests, progress=False)
    return list(engine.pool.compiled)


def summarize(compiled: Sequence[CompiledInfo]) -> dict[str, Any]:
    """Counts, compile seconds and summed memory of the SD programs and of all programs."""

    def totals(infos: list[CompiledInfo]) -> dict[str, Any]:
        memory = {name: sum(c.memory.get(name, 0) for c in infos) for name in MEMORY_FIELDS}
        return {
            "programs": len(infos),
            "compile_seconds": round(sum(c.seconds for c in infos), 3),
            "executable_bytes": memory["generated_code"] + memory["temp"],
            **{f"{name}_bytes": value for name, value in memory.items()},
        }

    sd = [c for c in compiled if c.key[0] in SD_KINDS]
    kinds = {kind: sum(c.key[0] == kind for c in compiled) for kind in SD_KINDS}
    base = [c for c in compiled if c.key[0] not in SD_KINDS]
    base_kinds = sorted({c.key[0] for c in base})
    return {"sd": {**totals(sd), "by_kind": kinds}, "all": totals(list(compiled)),
            "base_by_kind": {k: sum(c.key[0] == k for c in base) for k in base_kinds},
            "keys": [str(c.key) for c in sd]}  # fmt: skip


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def bench_pools(model, drafter, bandit: BanditConfig, *, max_batch_size: int = 32,
                kv_len: int = 256, single: SpecStrategy | None = None, hot_vocab: int = 0,
                greedy: bool = False, share_compiles: bool = False) -> dict[str, Any]:  # fmt: skip
    """Compiles the single, naive and bucketed pools (module docstring) and compares them.

    Args:
      model: the policy (`Transformer`).
      drafter: an EAGLE drafter of it (random weights serve; needed by eagle/hybrid sources).
      bandit: the BEG buckets, strategies, sources and threshold of the bucketed pool.
      max_batch_size: the engine's largest batch bucket (buckets 1, 2, 4, .., max).
      kv_len: the one kv bucket.
      single: the single-strategy pool's strategy (None: bucket 0's first).
      hot_vocab: draft head size (0: full vocabulary).
      greedy: greedy requests (False: sampled).
      share_compiles: pools reuse each other's programs (`PoolBenchConfig.share_compiles`).

    Returns:
      {"pools": {name: summarize(...)}, "ratios": naive/bucketed and bucketed/single of the SD
      programs' count, compile seconds and executable bytes, "plans": steps per pool}.
    """
    config = engine_config(max_batch_size, kv_len)
    plans = pool_plans(bandit, config.batch_buckets, single)
    pools = {}
    for name in POOLS:
        start = time.perf_counter()
        compiled = compile_pool(model, drafter, plans[name], config, hot_vocab=hot_vocab,
                                greedy=greedy, private=not share_compiles)  # fmt: skip
        pools[name] = {**summarize(compiled), "wall_seconds": round(time.perf_counter() - start, 2)}
        sd = pools[name]["sd"]
        log.info("%s pool: %d SD programs, %.1f s, %.1f MB executable", name, sd["programs"],
                 sd["compile_seconds"], sd["executable_bytes"] / 2**20)  # fmt: skip
    ratios = {}
    for num, den in (("naive", "bucketed"), ("bucketed", "single"), ("naive", "single")):
        for field in ("programs", "compile_seconds", "executable_bytes"):
            ratios[f"{num}/{den}:{field}"] = _ratio(pools[num]["sd"][field],
                                                     pools[den]["sd"][field])  # fmt: skip
    return {
        "batch_buckets": list(config.batch_buckets),
        "kv_len": kv_len,
        "bandit": {
            "threshold": bandit.threshold,
            "bucket_bounds": list(bandit.bucket_bounds),
            "strategies": [list(g) for g in bandit.strategies],
            "sources": list(bandit.sources),
        },
        "plans": {
            name: [[n, str(c) if c else "plain"] for n, c in plan] for name, plan in plans.items()
        },
        "pools": pools,
        "ratios": ratios,
    }


def run(config: PoolBenchConfig) -> dict[str, Any]:
    """Loads the model (or builds the tiny one) and a random drafter; runs `bench_pools`."""
    import os

    import jax

    from tlt_jax.models.drafter import init_drafter

    if config.preset == "tiny":
        from tlt_jax.models.presets import get_preset
        from tlt_jax.models.transformer import init_model

        model = init_model(get_preset("tiny"), 0)
    else:
        from tlt_jax.models import checkpoints

        model = checkpoints.load_model(config.model)
    drafter = init_drafter(model.config, 0)
    single = SpecStrategy.parse(config.single) if config.single else None
    result = bench_pools(model, drafter, config.bandit(), max_batch_size=config.max_batch_size,
                         kv_len=config.kv_len, single=single, hot_vocab=config.hot_vocab,
                         greedy=config.greedy, share_compiles=config.share_compiles)  # fmt: skip
    paper = {f"{k}_gb": v for k, v in PAPER_GB.items()}
    paper["naive/bucketed"] = _ratio(PAPER_GB["naive"], PAPER_GB["bucketed"])
    paper["bucketed/single"] = _ratio(PAPER_GB["bucketed"], PAPER_GB["single"])
    return {"model": "tiny" if config.preset == "tiny" else config.model,
            "dtype": model.config.param_dtype, "hot_vocab": config.hot_vocab,
            "greedy": config.greedy, "backend": jax.default_backend(),
            "cpu_count": os.cpu_count(), **result, "paper": paper}  # fmt: skip
