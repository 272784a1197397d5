"""Timing the rollout engine through its public API: runs, step times, policy A/B tests.

Every measurement is a `RolloutEngine.generate` call under a declared step policy
(`tlt_jax.rollout.adaptive`). A step's time comes from the engine's step counters or from
`EngineStats.timeline` (`median_step_ms`); nothing here reaches into the engine's programs.
Used by `tlt_jax.rollout.spec_bench` (`scripts/bench_spec.py`) and `scripts/bench_rollout.py`.

Rules of every measurement. Greedy, no stop ids: every request generates exactly its new
tokens, so plain and SD emit the same tokens (`matches_plain`). Tokens/s counts decoding only
(from the last request's first token, which prefill emits, to the last token); end-to-end
figures are next to them. One kv bucket covers every length (`engine_config`), so a short
warm-up generation compiles a configuration's programs before it is timed; a timed run that
still compiled (an SD batch's tail at smaller batch buckets, a bandit arm first tried late) is
discarded and run again. N-gram drafts keep no finished responses across runs
(`max_history_per_prompt=0`): a repeated prompt would otherwise draft from its own earlier,
identical greedy output.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from tlt_jax.metrics import timing
from tlt_jax.metrics.timing import median_step_ms
from tlt_jax.rollout.adaptive import (
    AdaptivePolicy,
    BanditConfig,
    FixedPolicy,
    PlainPolicy,
    ScheduledPolicy,
    StepChoice,
)
from tlt_jax.rollout.engine import EngineConfig, Request, RolloutEngine

log = logging.getLogger(__name__)
WARM_TOKENS = 4  # a prefill, a plain step and SD steps: compiles every program of a config
GOAL_ADAPTIVE_OVER_PLAIN = 0.98


def load_transformers(model_name: str):
    """HF transformers' own model of `model_name` (a preset name or path; float32, eval mode):
    the independent reference of the parity tests and `scripts/bench_rollout.py`.

    A GGUF file is loaded by transformers' GGUF path (its own dequantisation), inside
    `_gguf_parsed_once`: the same weights and config, 30-40 s -> 10 s for SmolLM2 on this
    project's CPU VM (BENCHMARKS, "Start-up")."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tlt_jax.models import checkpoints

    path = checkpoints.resolve_model_path(model_name)
    if path.suffix != ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with _gguf_parsed_once(path):
        # The config passed in, or from_pretrained reads it from the metadata once more.
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  config=config, dtype=torch.float32)  # fmt: skip
    return hf.eval()


@contextlib.contextmanager
def _gguf_parsed_once(path: Path):
    """Within the block, `gguf`'s reader of `path` and its tensor-name maps are made once.

    transformers (5.x) parses a GGUF file's metadata in Python for the config and again for the
    weights (~10 s each for SmolLM2's 147k fields), and builds `gguf.get_tensor_name_map(arch,
    layers)` once per submodule of the model (397 times, 14 s). Both are `gguf`'s pure functions
    of their arguments, and the reader is read-only (a memmap opened "r"), so the block hands
    transformers the reader this process's own loader already parsed (`checkpoints.gguf_source`)
    and one name map per (arch, layers): what transformers computes is unchanged, and it stays
    independent of our dequantisation and model code (only `gguf`'s parse is shared)."""
    import gguf

    from tlt_jax.models import checkpoints

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    parsed = checkpoints.gguf_source(path).reader
    target = path.resolve()

    def shared_reader(file, *args, **kwargs):
        if not args and not kwargs and Path(file).resolve() == target:
            return parsed
        return reader(file, *args, **kwargs)

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def load_questions(gsm8k_dir: str, count: int) -> tuple[list[str], str]:
    """The first `count` GSM8K test questions, or arithmetic questions when the file is
    missing; returns (questions, what they are)."""
    path = Path(gsm8k_dir) / "test.jsonl"
    if gsm8k_dir and path.is_file():
        with open(path) as f:
            rows = [json.loads(line) for line, _ in zip(f, range(count), strict=False)]
        return [r["question"] for r in rows], f"gsm8k {path} (first {len(rows)} questions)"
    from tlt_jax.data.arithmetic import make_problem

    rng = np.random.default_rng([0, 1])
    questions = [make_problem(rng, 2)[0] for _ in range(count)]
    return questions, f"arithmetic level 2 (seed [0, 1]): {path} is missing"


def engine_config(batch: int, kv_len: int, drafter_sync: str = "lazy") -> EngineConfig:
    """One kv bucket for every length (the short warm-up compiles the timed runs' programs);
    every step one program (the steady state a long run decodes with). Lazy drafter sync by
    default: a plain baseline in an engine with a drafter is pure plain decoding
    (`measure_switch` times eager sync)."""
    return EngineConfig(max_batch_size=batch, max_seq_len=kv_len, max_prefill_batch=min(batch, 8),
                        min_kv_bucket=kv_len, drafter_sync=drafter_sync,
                        layers_per_program=0)  # fmt: skip


def make_engine(model, drafter, batch: int, kv_len: int, *, ngram: bool,
                drafter_sync: str = "lazy") -> RolloutEngine:  # fmt: skip
    """An engine for benchmarks; its n-gram index (if any) keeps no finished responses."""
    from tlt_jax.rollout.ngram import NgramIndex

    index = NgramIndex(max_history_per_prompt=0) if ngram else None
    return RolloutEngine(model, engine_config(batch, kv_len, drafter_sync), drafter=drafter,
                         ngram_index=index)  # fmt: skip


def kv_length(prompts, new_tokens: int) -> int:
    """The one kv bucket: the longest prompt + `new_tokens` + 1, rounded up to 64."""
    return -(-(max(len(p) for p in prompts) + new_tokens + 1) // 64) * 64


def decode_step_ms(model, kv_len: int, steps: int = 20) -> float:
    """Median batch-1 plain decode step of the engine attending to `kv_len` cache positions
    (one kv bucket of exactly `kv_len`), timed through `generate` (host work included)."""
    engine = RolloutEngine(
        model,
        EngineConfig(
            max_batch_size=1,
            max_seq_len=kv_len,
            max_prefill_batch=1,
            min_kv_bucket=kv_len,
            layers_per_program=0,
        ),
    )
    request = [Request((1, 2, 3, 4), steps + 2)]
    engine.generate(request, progress=False)  # compiles
    engine.generate(request, progress=False)
    return median_step_ms(engine.stats.timeline)


def logit_parity(reference, other, tokens) -> dict[str, float]:
    """How `other` (e.g. the same weights in bfloat16) follows `reference` on one sequence.

    Both models score `tokens` (teacher forcing, one full forward each); returns the share of
    positions whose argmax agrees, the largest absolute logit error, and the reference's
    largest absolute logit (the error's scale).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    ids = jnp.asarray(tokens, jnp.int32)[None]
    positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]

    def score(model):
        graphdef, state = nnx.split(model)

        def forward(state, ids, positions):
            model = nnx.merge(graphdef, state)
            features, _ = model(ids, positions)
            return model.logits(features)[0]

        return np.asarray(jax.jit(forward)(state, ids, positions), np.float32)

    want, got = score(reference), score(other)
    return {
        "argmax_agreement": float(np.mean(want.argmax(-1) == got.argmax(-1))),
        "max_logit_error": float(np.max(np.abs(want - got))),
        "max_abs_logit": float(np.max(np.abs(want))),
        "positions": int(want.shape[0]),
    }


def timed_generate(engine: RolloutEngine, requests) -> dict[str, Any]:
    """One generate() call: decode-only and end-to-end figures, outputs, step and arm counts,
    and `median_step_ms`, this run's own median step (None without a decode step)."""
    stats = engine.stats
    steps, compiles = stats.spec_steps + stats.decode_steps, stats.compile_count
    rows, emitted = dict(stats.spec_rows_by_source), dict(stats.spec_tokens_by_source)
    start = time.perf_counter()
    out = engine.generate(requests, progress=False)
    wall = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in out)
    return {
        "steps": stats.spec_steps + stats.decode_steps - steps,
        "decode_tokens": tokens - len(out),  # prefill emits each request's first token
        "decode_s": max(c.finish_time for c in out) - max(c.first_token_time for c in out),
        "tokens": tokens,
        "wall_s": wall,
        "accepted": [n for c in out for n in c.accepted_lengths],
        "outputs": [c.token_ids for c in out],
        "compiled": stats.compile_count != compiles,
        "arms": collections.Counter(row[2] for row in stats.timeline),
        "median_step_ms": median_step_ms(stats.timeline) if stats.timeline else None,
        "source_rows": {k: v - rows.get(k, 0) for k, v in stats.spec_rows_by_source.items()},
        "source_tokens": {
            k: v - emitted.get(k, 0) for k, v in stats.spec_tokens_by_source.items()
        },  # fmt: skip
    }


def fixed_policy(choice: StepChoice | None) -> FixedPolicy | PlainPolicy:
    """`choice` at every step (None: plain decoding)."""
    return PlainPolicy() if choice is None else FixedPolicy(choice)


def warm_up(engine, groups, choice: StepChoice | None, hot_ids) -> None:
    """Compiles the programs the timed runs of `groups` need, plain and SD, in one short run
    per group: the first step plain, the rest `choice`."""
    engine.step_policy = ScheduledPolicy(choice, plain_steps=1)
    engine.set_hot_token_ids(hot_ids)
    for group in groups:
        engine.generate([dataclasses.replace(r, max_new_tokens=WARM_TOKENS) for r in group],
                        progress=False)  # fmt: skip


def run_point(engine, groups, choice: StepChoice | None, hot_ids, repeats: int) -> dict:
    """Times `groups` (one generate() call each) under `FixedPolicy(choice)` (None: plain)
    after `warm_up`; keeps the fastest run that compiled nothing.

    Runs until `repeats` runs compiled nothing, at most `repeats + 1` runs: an SD batch whose
    requests finish at different steps runs its tail at smaller batch buckets, whose programs
    the first full-length run may compile (greedy runs repeat exactly, so the next does not).
    """
    return run_points(engine, groups, [(choice, hot_ids)], repeats)[0]


def run_points(engine, groups, sides, repeats: int) -> list[dict]:
    """`run_point` for several (choice, hot_ids) sides, their runs alternating (the order
    reversed every round: `timing.side_order`), so that a disturbance of the machine hits
    every side of a ratio alike.

    Args:
      engine: the `RolloutEngine` of every side, or a list of them, one per side (sides that
        differ in the engine itself, e.g. its drafter sync).
      groups, repeats: as `run_point`'s.
      sides: (choice, hot_ids) per side (choice None: plain).

    Returns:
      One `run_point` dict per side, in the order given; each also holds `rounds`, the totals
      of its clean runs by round, from which `round_ratios` pairs two sides' runs. A total
      (and the best run's figures) sums its groups' runs, but for `median_step_ms`, one per
      group (`timed_generate`'s: a median is no sum).
    """
    engines = list(engine) if isinstance(engine, list | tuple) else [engine] * len(sides)
    if len(engines) != len(sides):
        raise ValueError(f"{len(engines)} engines for {len(sides)} sides: expected one engine, "
                         "or one per side")  # fmt: skip
    state = [{"best": None, "clean": 0, "runs": 0, "rounds": {}} for _ in sides]
    hot_set: dict[int, Any] = {}  # per engine, the ids last given to it

    def wanted(i):
        return state[i]["clean"] < repeats and state[i]["runs"] < repeats + 1

    round_ = 0
    while any(wanted(i) for i in range(len(sides))):
        order = timing.side_order(range(len(sides)), round_)
        for i in order:
            if not wanted(i):
                continue
            choice, hot_ids = sides[i]
            side_engine = engines[i]
            side_engine.step_policy = fixed_policy(choice)
            # Plain steps draft nothing: the SD side's ids stay, sliced once, not per run.
            key = id(side_engine)
            if choice is not None and (key not in hot_set or hot_set[key] is not hot_ids):
                side_engine.set_hot_token_ids(hot_ids)
                hot_set[key] = hot_ids
            runs = [timed_generate(side_engine, group) for group in groups]
            side = state[i]
            side["runs"] += 1
            if any(r["compiled"] for r in runs):
                continue
            side["clean"] += 1
            keys = ("decode_tokens", "decode_s", "tokens", "wall_s", "steps")
            total = {key: sum(r[key] for r in runs) for key in keys}
            total["median_step_ms"] = [r["median_step_ms"] for r in runs]  # per group
            side["rounds"][round_] = total
            if side["best"] is None or total["decode_s"] < side["best"]["decode_s"]:
                side["best"] = dict(total, accepted=[n for r in runs for n in r["accepted"]],
                                    outputs=[r["outputs"] for r in runs])  # fmt: skip
        round_ += 1
    out = []
    for (choice, _), side in zip(sides, state, strict=True):
        best = side["best"]
        if best is None:
            raise RuntimeError(f"every timed run of {choice} compiled programs; see warm_up")
        accepted = best.pop("accepted")
        out.append(dict(best, tokens_per_s=best["decode_tokens"] / best["decode_s"],
                        e2e_tokens_per_s=best["tokens"] / best["wall_s"],
                        accept_len=float(np.mean(accepted)) if accepted else None,
                        sd_steps=len(accepted), timed_runs=side["runs"],
                        clean_runs=side["clean"], rounds=side["rounds"]))  # fmt: skip
    return out


def round_ratios(a: dict, b: dict, figure) -> list[float]:
    """`figure(run)` of side `a` over side `b`'s, per round both ran clean (`run_points`'
    `rounds`): the ratio as each pair of neighbouring runs measured it."""
    both = sorted(set(a["rounds"]) & set(b["rounds"]))
    return [figure(a["rounds"][r]) / figure(b["rounds"][r]) for r in both]


def repeat_ratio(ours, theirs) -> tuple[float, dict]:
    """One side's tokens/s over another's at one point, from their runs repeat by repeat (the
    two runs of a repeat ran next to each other: `scripts/bench_rollout.py`).

    Returns:
      (best over best: what each side reaches on its quietest run, the two runs perhaps far
      apart; `timing.spread` of the per-repeat ratios: each run over the one beside it, so a
      disturbance of the machine shows as their spread instead of as one side's best).

    Raises:
      ValueError: when the sides ran another number of repeats, or none.
    """
    if len(ours) != len(theirs) or not len(ours):
        raise ValueError(f"{len(ours)} runs against {len(theirs)}: expected the same number of "
                         "repeats (at least one) on both sides")  # fmt: skip
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return max(ours) / max(theirs), timing.spread(ratios)


def decode_tokens_per_s(run: dict) -> float:
    return run["decode_tokens"] / run["decode_s"]


def step_ms(run: dict) -> float:
    return 1e3 * run["decode_s"] / run["steps"]


def compare(sd: dict, plain: dict) -> dict:
    """The JSON row of an SD point against plain decoding of the same requests (two sides of
    one `run_points` call: `speedup_spread` pairs their runs round by round; None when no
    round ran both clean)."""
    ratios = round_ratios(sd, plain, decode_tokens_per_s)
    return {
        "tokens_per_s": sd["tokens_per_s"],
        "plain_tokens_per_s": plain["tokens_per_s"],
        "speedup": sd["tokens_per_s"] / plain["tokens_per_s"],
        "e2e_speedup": sd["e2e_tokens_per_s"] / plain["e2e_tokens_per_s"],
        "accept_len": sd["accept_len"],
        "sd_steps": sd["sd_steps"],
        "matches_plain": sd["outputs"] == plain["outputs"],
        "step_ms": 1e3 * sd["decode_s"] / sd["steps"],
        "plain_step_ms": 1e3 * plain["decode_s"] / plain["steps"],
        "timed_runs": sd["timed_runs"],  # runs that compiled something are not kept
        "clean_runs": sd["clean_runs"],
        # Per round, SD's run over the plain run beside it: the speedup's spread.
        "speedup_spread": timing.spread(ratios) if ratios else None,
    }


def best_ms(fn, *args, iters: int, fresh=None) -> float:
    """Fastest of `iters` calls of a jitted function (compiled first), in ms: the minimum, as
    other jobs share the machine. `fresh(args)` rebuilds donated arguments, off the clock."""
    import jax

    jax.block_until_ready(fn(*(fresh(args) if fresh else args)))
    times = []
    for _ in range(iters):
        call_args = fresh(args) if fresh else args
        jax.block_until_ready(call_args)
        start = time.perf_counter()
        jax.block_until_ready(fn(*call_args))
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


# ----------------------------------------------------------------------------- adaptive


def bench_adaptive(model, drafter, prompts, bandit: BanditConfig, *, batches, new_tokens: int,
                   repeats: int, hot_ids=None, drafter_sync: str = "eager",
                   max_warmup_runs: int = 6) -> dict:  # fmt: skip
    """Plain decoding vs `AdaptivePolicy` at every batch size, greedy, runs alternating.

    Per batch: a plain engine (no drafter, no n-gram index: pure plain decoding) and an
    adaptive one (the drafter, if any, with `drafter_sync`; the bandit's arms from `bandit`);
    untimed runs until one compiles nothing (the bandit learns in them as in RL's earlier
    steps), then `repeats` (plain, adaptive) pairs, order alternating, a pair that compiled
    run again (at most `repeats` extra).

    Args:
      model, drafter: the policy and its EAGLE drafter (None: n-gram arms only).
      prompts: token-id lists, at least max(batches).
      bandit: the adaptive policy's settings (its threshold: usually max(batches)).
      batches: batch sizes; new_tokens: tokens per request; repeats: timed pairs per batch.
      hot_ids: the drafter's hot vocabulary (None: full).

    Returns:
      {"bandit", "batches": {batch: row}, "min_adaptive_over_plain", "goal", "goal_met",
      "all_match_plain", sizes}; a row has per-side tokens/s (median, min, max, runs),
      `adaptive_over_plain` (median over median), `pair_ratio`, `arm_steps`, `sd_step_share`,
      `accept_len_by_source`, `median_rewards` and `matches_plain`.
    """
    batches = sorted({int(b) for b in batches})
    require_prompts(prompts, max(batches))
    arms = AdaptivePolicy(bandit).choices()
    ngram = any(c.needs_ngram for c in arms)
    if not any(c.needs_drafter for c in arms):
        drafter, hot_ids = None, None  # n-gram arms only: no drafter sync in any step
    kv_len = kv_length(prompts, new_tokens)
    rows = {}
    for batch in batches:
        requests = [Request(tuple(p), new_tokens) for p in prompts[:batch]]
        policy = AdaptivePolicy(bandit)
        engines = {"plain": make_engine(model, None, batch, kv_len, ngram=False),
                   "adaptive": make_engine(model, drafter, batch, kv_len, ngram=ngram,
                                           drafter_sync=drafter_sync)}  # fmt: skip
        engines["adaptive"].step_policy = policy  # raises if an arm needs a missing drafter
        if drafter is not None:
            engines["adaptive"].set_hot_token_ids(hot_ids)
        warmup = {side: _warm(engine, requests, max_warmup_runs) for side, engine in
                  engines.items()}  # fmt: skip
        pairs, attempts = [], 0
        while len(pairs) < repeats and attempts < 2 * repeats:
            order = ("plain", "adaptive") if attempts % 2 == 0 else ("adaptive", "plain")
            runs = {side: timed_generate(engines[side], requests) for side in order}
            attempts += 1
            if not any(r["compiled"] for r in runs.values()):
                pairs.append(runs)
        if not pairs:
            raise RuntimeError(f"adaptive batch {batch}: every timed pair compiled programs")
        rows[str(batch)] = row = _adaptive_row(pairs, policy)
        row.update(
            pairs_run=attempts,
            warmup_runs=warmup,
            compile_seconds=sum(e.stats.compile_seconds for e in engines.values()),
        )
        log.info("adaptive batch %3d: plain %.1f tok/s, adaptive %.1f tok/s (%.3f), SD steps "
                 "%.0f%%, arms %s", batch, row["plain_tokens_per_s"]["median"],
                 row["adaptive_tokens_per_s"]["median"], row["adaptive_over_plain"],
                 100 * row["sd_step_share"], row["arm_steps"])  # fmt: skip
    worst = min(r["adaptive_over_plain"] for r in rows.values())
    return {"bandit": dataclasses.asdict(bandit), "drafter_sync": drafter_sync,
            "new_tokens": new_tokens, "repeats": repeats, "kv_len": kv_len, "batches": rows,
            "min_adaptive_over_plain": worst, "goal": GOAL_ADAPTIVE_OVER_PLAIN,
            "goal_met": worst >= GOAL_ADAPTIVE_OVER_PLAIN,
            "all_match_plain": all(r["matches_plain"] for r in rows.values())}  # fmt: skip


def _warm(engine, requests, max_runs: int) -> int:
    """Untimed runs until one compiles nothing; returns how many ran."""
    for runs in range(1, max_runs + 1):
        if not timed_generate(engine, requests)["compiled"]:
            return runs
    return max_runs


def _adaptive_row(pairs, policy: AdaptivePolicy) -> dict[str, Any]:
    def tps(run):
        return run["decode_tokens"] / run["decode_s"]

    plain = [tps(p["plain"]) for p in pairs]
    adaptive = [tps(p["adaptive"]) for p in pairs]
    arms, rows, tokens = collections.Counter(), collections.Counter(), collections.Counter()
    for p in pairs:
        arms.update(p["adaptive"]["arms"])
        rows.update(p["adaptive"]["source_rows"])
        tokens.update(p["adaptive"]["source_tokens"])
    return {
        "plain_tokens_per_s": timing.spread(plain),
        "adaptive_tokens_per_s": timing.spread(adaptive),
        "adaptive_over_plain": float(np.median(adaptive) / np.median(plain)),
        "pair_ratio": timing.spread([a / b for a, b in zip(adaptive, plain, strict=True)]),
        "plain_step_ms": float(
            np.median([1e3 * p["plain"]["decode_s"] / p["plain"]["steps"] for p in pairs])
        ),  # fmt: skip
        "arm_steps": dict(arms),
        "sd_step_share": 1.0 - arms.get("plain", 0) / max(1, sum(arms.values())),
        "accept_len_by_source": {s: tokens[s] / n for s, n in rows.items() if n},
        "median_rewards": policy.median_rewards(),
        "matches_plain": all(p["adaptive"]["outputs"] == p["plain"]["outputs"] for p in pairs),
    }


def require_prompts(prompts, count: int) -> None:
    """Raises ValueError unless there are at least `count` prompts."""
    if len(prompts) < count:
        raise ValueError(f"{len(prompts)} prompts given; the benchmark needs {count} "
                         "(the largest batch or num_prompts)")  # fmt: skip
