r"""Speculative vs plain decoding benchmarks: the library side of `scripts/bench_spec.py`.

Runs go through the rollout engine's public API (`tlt_jax.rollout.bench`: timed generate calls
under declared step policies); program times through the public programs of
`tlt_jax.rollout.speculative`, jitted here on the engine's state. The measurement rules are
`tlt_jax.rollout.bench`'s.

`bench_fixed`: one draft source (`StepChoice.source`) at fixed strategies:
  (a) `grid` at batch 1: every strategy of `grid` (depths x verify tokens at `topk`), EAGLE and
      hybrid drafts with the hot draft vocabulary and (`full_vocab`) the full one, vs plain;
      `max_speedup` is what a point's step time would give if every drafted token were accepted;
  (b) `bs_sweep` at the fastest point of (a): speedup and acceptance per batch size, and
      `crossover_batch`, the smallest batch at which SD no longer beats plain decoding;
  (c) `switch_cost` (drafter sources): a running batch switched into SD after `switch_lags`
      plain steps: the lazy drafter catch-up in ms and in plain steps, and the plain step with
      eager drafter sync vs lazy;
  (d) `step_breakdown_bs1` (drafter sources): each program of a batch-1 EAGLE step and their
      parts timed alone on the engine's state, vs the engine's own steps (host overhead).
`bench.bench_adaptive` (`adaptive`): per batch size, plain decoding vs TLT's adaptive rollout
  (`AdaptivePolicy` with `adaptive_bandit`: the `spec` group's default buckets, strategies and
  sources, threshold = the largest batch, SD from the first step), runs alternating;
  `adaptive_over_plain` per batch (goal >= 0.98 at every batch: the bandit falls back to plain
  where SD loses) and whether the tokens equal plain decoding's.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from tlt_jax.metrics import timing
from tlt_jax.rollout.adaptive import (
    DRAFT_SOURCES,
    BanditConfig,
    PlainPolicy,
    ScheduledPolicy,
    StepChoice,
)
from tlt_jax.rollout.bench import (
    WARM_TOKENS,
    bench_adaptive,
    best_ms,
    compare,
    decode_tokens_per_s,
    fixed_policy,
    kv_length,
    load_questions,
    make_engine,
    require_prompts,
    round_ratios,
    run_point,
    run_points,
    step_ms,
    warm_up,
)
from tlt_jax.rollout.engine import DRAFTER_SYNC, Request, RolloutEngine
from tlt_jax.rollout.speculative import SpecStrategy

log = logging.getLogger(__name__)
FULL_VOCAB = ("per_depth", "all", "none")


@dataclasses.dataclass(frozen=True)
class SpecBenchConfig:
    """`scripts/bench_spec.py`'s settings, one field per flag (the flags' help says more).

    Attributes:
      draft: the source of `bench_fixed` ("": eagle with a drafter, else ngram); with
        `adaptive`, the bandit's only source ("": ngram, plus eagle and hybrid with a drafter).
      adaptive: run `bench_adaptive` (over `batch_sizes`, `sweep_new_tokens` each,
        `adaptive_repeats` alternating pairs, `drafter_sync`) instead of `bench_fixed`.
      The rest: see `bench_fixed` and the module docstring.
    """

    model: str = "smollm2-135m-instruct"
    drafter: str = ""
    draft: str = ""
    gsm8k_dir: str = ""
    drafter_note: str = ""
    adaptive: bool = False
    num_prompts: int = 2
    max_new_tokens: int = 64
    sweep_new_tokens: int = 32
    grid: str = "2,4,6x4,8,16"
    topk: int = 4
    hot_vocab_size: int = 2048
    hot_vocab: str = ""
    full_vocab: str = "per_depth"
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    switch_batches: tuple[int, ...] = (1, 4, 16)
    switch_lags: tuple[int, ...] = (32, 128)
    repeats: int = 2
    breakdown: bool = True
    adaptive_repeats: int = 5
    drafter_sync: str = "eager"

    def __post_init__(self):
        for name in ("batch_sizes", "switch_batches", "switch_lags"):
            try:
                values = tuple(sorted({int(x) for x in getattr(self, name)}))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{name}={getattr(self, name)!r} must be integers") from e
            if any(x < 1 for x in values) or (name == "batch_sizes" and not values):
                raise ValueError(f"{name}={values!r} must be integers >= 1")
            object.__setattr__(self, name, values)
        for name, low in (("num_prompts", 1), ("max_new_tokens", 1), ("sweep_new_tokens", 2),
                          ("topk", 1), ("hot_vocab_size", 0), ("repeats", 1),
                          ("adaptive_repeats", 1)):  # fmt: skip
            if getattr(self, name) < low:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= {low}")
        if self.draft not in ("", *DRAFT_SOURCES):
            raise ValueError(f"draft={self.draft!r} is not one of {['', *DRAFT_SOURCES]}")
        if self.draft in ("eagle", "hybrid") and not self.drafter:
            raise ValueError(f"draft={self.draft!r} needs drafter= (an EAGLE export of "
                             "scripts/train_drafter.py); draft='ngram' runs without")  # fmt: skip
        if self.full_vocab not in FULL_VOCAB:
            raise ValueError(f"full_vocab={self.full_vocab!r} is not one of {list(FULL_VOCAB)}")
        if self.drafter_sync not in DRAFTER_SYNC:
            raise ValueError(f"drafter_sync={self.drafter_sync!r} is not one of "
                             f"{list(DRAFTER_SYNC)}")  # fmt: skip
        valid, invalid = parse_grid(self.grid, self.topk)
        if not valid:
            raise ValueError(f"grid={self.grid!r} topk={self.topk}: no valid strategy {invalid}")

    @property
    def source(self) -> str:
        """`bench_fixed`'s draft source."""
        return self.draft or ("eagle" if self.drafter else "ngram")


def parse_grid(text: str, topk: int) -> tuple[list[SpecStrategy], list[str]]:
    """'2,4,6x4,8,16' -> (valid strategies, invalid 'depth,topk,verify: reason' strings)."""
    try:
        depths, verifies = ([int(x) for x in part.split(",")] for part in text.split("x"))
    except ValueError as e:
        raise ValueError(f"grid={text!r} must look like '2,4,6x4,8,16' (depths x verify "
                         "tokens)") from e  # fmt: skip
    valid, invalid = [], []
    for depth in depths:
        for verify in verifies:
            try:
                valid.append(SpecStrategy(depth, topk, verify))
            except ValueError as e:
                invalid.append(f"{depth},{topk},{verify}: {e}")
    return valid, invalid


# ----------------------------------------------------------------------------- bench_fixed


def measure_grid(engine, groups, choices, hot_ids, repeats: int, full_vocab: str = "per_depth"
                 ) -> tuple[dict, list]:  # fmt: skip
    """(a): plain decoding, then every choice with `hot_ids` and (`full_vocab`, when `hot_ids`
    is given) with the full draft vocabulary. Returns (plain point, grid rows)."""
    warm_up(engine, groups, choices[0], hot_ids)
    plain = run_point(engine, groups, None, None, repeats)
    log.info("plain bs1: %.1f tok/s", plain["tokens_per_s"])
    grid = []

    def point(choice, hot):
        warm_up(engine, groups, choice, hot)
        # Against the plain runs alternating with this point's, not the plain point above.
        plain_here, sd = run_points(engine, groups, [(None, None), (choice, hot)], repeats)
        row = compare(sd, plain_here)
        s = choice.strategy
        most = min(s.depth, s.verify_tokens - 1) + 1  # the most tokens a step can emit
        row["max_speedup"] = most * row["plain_step_ms"] / row["step_ms"]
        grid.append(dict(strategy=str(s), source=choice.source, hot_vocab=hot is not None, **row))
        log.info("%s hot=%s: %.1f tok/s, speedup %.2f, accept %.2f, step %.0f ms (plain %.0f)",
                 choice, hot is not None, row["tokens_per_s"], row["speedup"],
                 row["accept_len"] or 0.0, row["step_ms"], row["plain_step_ms"])  # fmt: skip

    for choice in choices:
        point(choice, hot_ids)
    if hot_ids is None or full_vocab == "none":
        return plain, grid
    if full_vocab == "all":
        for choice in choices:
            point(choice, None)
        return plain, grid
    for depth in sorted({c.strategy.depth for c in choices}):
        rows = [r for r in grid if SpecStrategy.parse(r["strategy"]).depth == depth]
        best = SpecStrategy.parse(max(rows, key=lambda r: r["speedup"])["strategy"])
        point(StepChoice(best, choices[0].source), None)
    return plain, grid


def measure_sweep(model, drafter, requests, batches, choice, hot_ids, kv_len: int, repeats: int,
                  new_tokens: int) -> tuple[dict, float]:  # fmt: skip
    """(b): plain vs `choice` at every batch size, one engine per size. Returns ({batch: row},
    compile seconds)."""
    sweep, compile_s = {}, 0.0
    for batch in batches:
        group = [requests(batch, new_tokens)]
        engine = make_engine(model, drafter, batch, kv_len, ngram=choice.needs_ngram)
        warm_up(engine, group, choice, hot_ids)
        plain, sd = run_points(engine, group, [(None, None), (choice, hot_ids)], repeats)
        sweep[str(batch)] = row = compare(sd, plain)
        compile_s += engine.stats.compile_seconds
        log.info("batch %3d: plain %.1f tok/s, SD %.1f tok/s, speedup %.2f, accept %.2f", batch,
                 row["plain_tokens_per_s"], row["tokens_per_s"], row["speedup"],
                 row["accept_len"] or 0.0)  # fmt: skip
    return sweep, compile_s


def measure_switch(model, drafter, requests, batches, lags, choice, hot_ids, kv_len: int,
                   repeats: int, new_tokens: int) -> dict:  # fmt: skip
    """(c): the cost of switching a running batch into SD, lazy and eager drafter sync.

    Lazy: prefill leaves every drafter in sync, `lag` plain steps (`ScheduledPolicy`) leave it
    `lag` positions behind, and the first SD step runs the engine's catch-up, timed by the engine
    (`EngineStats.spec_switch_seconds`, compilation excluded). Eager: every plain step also runs
    the drafter layer over its new pair; both engines' plain steps are timed on the same
    requests (`new_tokens` each), their runs alternating.

    Returns:
      {batch: {"catchup": {lag: row}, "plain_step_ms", "eager_plain_step_ms", "eager_overhead",
      "eager_overhead_spread"}} (the step times of each side's fastest run; the spread over
      rounds of each eager run against the lazy run beside it); a catch-up row also gives
      `catchup_in_plain_steps`.
    """
    out = {}
    for batch in batches:
        engine = make_engine(model, drafter, batch, kv_len, ngram=choice.needs_ngram)
        engine.set_hot_token_ids(hot_ids)
        stats, catchup = engine.stats, {}
        for lag in lags:
            engine.step_policy = ScheduledPolicy(choice, plain_steps=lag)
            best = None
            for _ in range(repeats + 1):  # the first run compiles this lag's catch-up
                before = (stats.spec_switch_seconds, stats.spec_switch_tokens,
                          stats.spec_switch_count, stats.compile_count)  # fmt: skip
                engine.generate(requests(batch, lag + 1 + WARM_TOKENS), progress=False)
                if stats.spec_switch_count - before[2] != 1 or stats.compile_count != before[3]:
                    continue  # compiled (or did not switch exactly once): not timed
                row = {"catchup_ms": 1e3 * (stats.spec_switch_seconds - before[0]),
                       "catchup_tokens": stats.spec_switch_tokens - before[1]}  # fmt: skip
                if best is None or row["catchup_ms"] < best["catchup_ms"]:
                    best = row
            if best is None:
                raise RuntimeError(f"switch at batch {batch}, lag {lag}: every run compiled")
            catchup[str(lag)] = best
        group = [requests(batch, new_tokens)]
        eager = make_engine(model, drafter, batch, kv_len, ngram=choice.needs_ngram,
                            drafter_sync="eager")  # fmt: skip
        warm_up(eager, group, choice, hot_ids)
        # Plain steps of the two engines, their runs alternating (`run_points`).
        plain, eager_plain = run_points([engine, eager], group, [(None, None), (None, None)],
                                        repeats)  # fmt: skip
        plain_ms, eager_ms = step_ms(plain), step_ms(eager_plain)
        overheads = [r - 1.0 for r in round_ratios(eager_plain, plain, step_ms)]
        for row in catchup.values():
            row["catchup_in_plain_steps"] = row["catchup_ms"] / plain_ms
        out[str(batch)] = {"catchup": catchup, "plain_step_ms": plain_ms,
                           "eager_plain_step_ms": eager_ms,
                           "eager_overhead": eager_ms / plain_ms - 1.0,
                           # Per round, the eager run over the lazy one beside it, - 1.
                           "eager_overhead_spread": timing.spread(overheads)
                           if overheads else None}  # fmt: skip
        log.info(
            "switch batch %3d: plain step %.0f ms (eager sync %.0f ms); catch-up %s",
            batch,
            plain_ms,
            eager_ms,
            {lag: round(r["catchup_ms"]) for lag, r in catchup.items()},
        )
    return out


def engine_steps(model, drafter, prompt, choice: StepChoice, hot_ids, kv_len: int,
                 new_tokens: int) -> tuple[RolloutEngine, dict]:  # fmt: skip
    """The engine's own batch-1 plain and `choice` steps on `prompt` (`new_tokens` each; SD
    drafting among `hot_ids`), their runs alternating (`run_points`), so that `engine_speedup`
    and its spread pair neighbouring runs.

    Returns:
      (the engine, in the state an SD run left: its drafter in sync; `plain_step_in_engine_ms`
      and `sd_step_in_engine_ms`, the mean step of each side's fastest run, host work included,
      `plain_step_median_ms`, the fastest plain run's median step, `engine_accept_len`,
      `engine_speedup` (fastest over fastest) and `engine_speedup_spread` (per round)).
    """
    engine = make_engine(model, drafter, 1, kv_len, ngram=False)
    group = [[Request(tuple(prompt), new_tokens)]]
    warm_up(engine, group, choice, hot_ids)
    plain, sd = run_points(engine, group, [(None, None), (choice, hot_ids)], repeats=2)
    if isinstance(engine.step_policy, PlainPolicy):  # the last run was plain: leave SD's state
        engine.step_policy = fixed_policy(choice)
        engine.generate(group[0], progress=False)
    ratios = round_ratios(sd, plain, decode_tokens_per_s)  # each SD run over the plain beside it
    return engine, {
        "plain_step_in_engine_ms": step_ms(plain),
        "plain_step_median_ms": plain["median_step_ms"][0],
        "sd_step_in_engine_ms": step_ms(sd),
        "engine_accept_len": sd["accept_len"],
        "engine_speedup": sd["tokens_per_s"] / plain["tokens_per_s"],
        "engine_speedup_spread": timing.spread(ratios) if ratios else None,
    }


def step_breakdown(model, drafter, prompt, strategy: SpecStrategy, hot_ids, engine_hot_ids,
                   kv_len: int, new_tokens: int, iters: int = 10) -> dict:  # fmt: skip
    """(d): each program of a batch-1 EAGLE step, and their parts, timed alone on a real state.

    First the engine's plain and SD steps on `prompt` (`engine_steps`; SD drafting among
    `engine_hot_ids`), then, on the state an SD run left (drafter in sync), the public programs
    of `speculative` alone (draft with the full head, with the `hot_ids` columns sliced once as
    the engine does, and sliced in the draft step; tree, verify) and parts:
    one draft level's LM head (full and hot), acceptance, and the target forward (with logits)
    over 1 .. 16 new tokens (what a wider tree costs to verify). Host overhead = the engine's
    SD step - its programs; `break_even_accept_len` = programs / the engine's plain step (a
    lower bound: each program's best time alone, without host work, over the median step of
    the engine's fastest plain run, `plain_step_median_ms`, with it);
    `break_even_accept_len_in_engine` = the engine's SD step / its plain step, each the mean
    step of its side's fastest run, host work included.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tlt_jax.models.decode import cached_forward
    from tlt_jax.models.drafter import draft_logits
    from tlt_jax.rollout import speculative
    from tlt_jax.rollout.acceptance import accept_tree
    from tlt_jax.rollout.draft_tree import DraftTree

    # The engine's own steps first, so that step and program times see the same machine load.
    engine, in_engine = engine_steps(model, drafter, prompt, StepChoice(strategy, "eagle"),
                                     engine_hot_ids, kv_len, new_tokens)  # fmt: skip
    plain_median_ms = in_engine["plain_step_median_ms"]
    state, params, dparams = engine.state, engine.params, engine.drafter_params
    layers, graphdef, dconfig = engine.layers, engine.graphdef, engine.drafter_config
    kv_len = state.cache.length  # the engine's last cache size (the programs read exactly it)
    k, depth, t = strategy.topk, strategy.depth, strategy.verify_tokens
    hot = None if hot_ids is None else jnp.asarray(hot_ids, jnp.int32)
    out = {"strategy": str(strategy), "kv_len": kv_len, "context": int(state.lengths[0]),
           "iters": iters, "draft_levels": depth}  # fmt: skip

    def fresh(args):  # verify donates the state: each call gets its own copy
        return (*args[:3], jax.tree.map(jnp.copy, args[3]), *args[4:])

    draft = jax.jit(functools.partial(speculative.draft_program, graphdef, dconfig, batch=1,
                                      kv_len=kv_len, topk=k, depth=depth))  # fmt: skip
    out["draft_full_ms"] = best_ms(draft, params, dparams, state, None, iters=iters)
    hot_head = None
    if hot is not None:  # as the engine drafts: the hot columns sliced once per weight sync
        hot_head = jax.jit(functools.partial(speculative.hot_head_program, graphdef))(params, hot)
        out["draft_hot_ms"] = best_ms(draft, params, dparams, state, hot, hot_head, iters=iters)
        # ... and slicing them in every draft step instead
        out["draft_hot_slicing_ms"] = best_ms(draft, params, dparams, state, hot, iters=iters)
    candidates = draft(params, dparams, state, hot, hot_head)
    tree_fn = jax.jit(functools.partial(speculative.tree_program, batch=1, verify_tokens=t,
                                        depth=depth))  # fmt: skip
    out["tree_ms"] = best_ms(tree_fn, candidates, state.last_token, state.lengths, iters=iters)
    tree = tree_fn(candidates, state.last_token, state.lengths)
    verify = jax.jit(
        functools.partial(
            speculative.verify_program, graphdef, dconfig, batch=1, kv_len=kv_len, greedy_only=True
        ),
        donate_argnums=(3,),
    )
    out["verify_ms"] = best_ms(verify, params, layers, dparams, state, tree, iters=iters,
                               fresh=fresh)  # fmt: skip
    _, _, _, counts, new, path = verify(params, layers, dparams, jax.tree.map(jnp.copy, state),
                                        tree)  # fmt: skip
    commit = jax.jit(functools.partial(speculative.commit_program, batch=1), donate_argnums=(0,))

    def fresh_state(args):
        return (jax.tree.map(jnp.copy, args[0]), *args[1:])

    out["commit_ms"] = best_ms(commit, state, new, path, counts, iters=iters, fresh=fresh_state)

    def head_level(head, g_1xkxD):  # one draft level's head: logits, log-softmax, top-k
        return jax.lax.top_k(jax.nn.log_softmax(draft_logits(g_1xkxD, head), axis=-1), k)

    g = jax.random.normal(jax.random.key(0), (1, k, model.config.hidden_size), jnp.float32)
    head_jit = jax.jit(head_level)
    full_head = nnx.merge(graphdef, params).head_weight_DxV()
    out["draft_head_level_full_ms"] = best_ms(head_jit, full_head, g, iters=iters)
    if hot is not None:
        out["draft_head_level_hot_ms"] = best_ms(head_jit, hot_head, g, iters=iters)

    def target_tree(params, layers, state, tree):
        model_ = nnx.merge(graphdef, params)
        features, _, _ = cached_forward(model_, layers, tree.tokens_BxT, tree.positions_BxT,
                                        state.cache, state.lengths[:1],
                                        mask_BxTxT=tree.mask_BxTxT)  # fmt: skip
        return model_.logits(features)

    target_jit = jax.jit(target_tree)
    logits = target_jit(params, layers, state, tree)
    accept = jax.jit(functools.partial(accept_tree, greedy_only=True))
    out["verify_accept_ms"] = best_ms(
        accept, logits, tree.tokens_BxT, tree.parents_BxT, tree.positions_BxT,
        state.temperature[:1], state.top_k[:1], state.top_p[:1], state.keys[:1], iters=iters,
    )  # fmt: skip
    widths = {}
    for width in (1, 2, 4, 8, 16):
        chain = DraftTree(
            tokens_BxT=jnp.zeros((1, width), jnp.int32),
            parents_BxT=jnp.arange(width, dtype=jnp.int32)[None] - 1,
            depth_BxT=jnp.arange(width, dtype=jnp.int32)[None],
            positions_BxT=state.lengths[:1, None] + jnp.arange(width, dtype=jnp.int32)[None],
            mask_BxTxT=jnp.tril(jnp.ones((width, width), bool))[None],
        )
        widths[str(width)] = best_ms(target_jit, params, layers, state, chain, iters=iters)
    out["target_forward_ms_by_tokens"] = widths
    out.update(in_engine)
    for suffix, draft_key in (("", "draft_full_ms"), ("_hot", "draft_hot_ms")):
        if draft_key in out:
            out[f"sd_programs{suffix}_ms"] = (out[draft_key] + out["tree_ms"] + out["verify_ms"]
                                              + out["commit_ms"])  # fmt: skip
            # The acceptance length at which an SD step costs as much as its plain steps.
            out[f"break_even_accept_len{suffix}"] = out[f"sd_programs{suffix}_ms"] / plain_median_ms
    programs = out["sd_programs_ms" if engine_hot_ids is None else "sd_programs_hot_ms"]
    out["engine_hot_vocab"] = engine_hot_ids is not None
    out["sd_host_overhead_ms"] = out["sd_step_in_engine_ms"] - programs
    out["break_even_accept_len_in_engine"] = (out["sd_step_in_engine_ms"]
                                              / out["plain_step_in_engine_ms"])  # fmt: skip
    return out


def bench_fixed(model, drafter, prompts, config: SpecBenchConfig, hot_ids=None) -> dict:
    """(a)-(d) of the module docstring for `config.source`, greedy.

    Args:
      model: the policy (`Transformer`).
      drafter: its EAGLE drafter (None: n-gram drafts only; ignored for them).
      prompts: token-id lists; at least max(num_prompts, batch sizes, switch batches).
      config: sizes and switches (`config.source`: the draft source); its model, drafter and
        data paths are `run`'s, not read here.
      hot_ids: the hot draft vocabulary (EAGLE and hybrid drafts; None: full).

    Returns:
      A JSON-serialisable dict: `plain_bs1`, `grid`, `strategy`, `speedup_bs1`, `bs_sweep`,
      `crossover_batch`, `switch_cost`, `step_breakdown_bs1`, `all_match_plain`, sizes.
    """
    from tlt_jax.drafter.hot_vocab import count_tokens, coverage

    strategies, invalid = parse_grid(config.grid, config.topk)
    choices = [StepChoice(s, config.source) for s in strategies]
    uses_drafter = choices[0].needs_drafter
    if uses_drafter and drafter is None:
        raise ValueError(f"draft={config.source!r} needs a drafter; draft='ngram' runs without")
    drafter, hot_ids = (drafter, hot_ids) if uses_drafter else (None, None)
    switch = config.switch_batches if uses_drafter else ()
    lags = config.switch_lags if switch else ()
    require_prompts(prompts, max(config.num_prompts, *config.batch_sizes, *switch))
    kv_len = kv_length(prompts, max(config.max_new_tokens, config.sweep_new_tokens,
                                    *(lag + 1 + WARM_TOKENS for lag in lags)))  # fmt: skip

    def requests(count, new_tokens):  # greedy, no stop ids
        return [Request(tuple(p), new_tokens) for p in prompts[:count]]

    groups = [[r] for r in requests(config.num_prompts, config.max_new_tokens)]
    engine = make_engine(model, drafter, 1, kv_len, ngram=choices[0].needs_ngram)
    plain, grid = measure_grid(engine, groups, choices, hot_ids, config.repeats, config.full_vocab)
    compile_s = engine.stats.compile_seconds
    del engine  # frees its decode state before the larger batches
    best = max(grid, key=lambda r: r["speedup"])
    choice = StepChoice(SpecStrategy.parse(best["strategy"]), config.source)
    best_hot = hot_ids if best["hot_vocab"] else None
    sweep, sweep_compile_s = measure_sweep(model, drafter, requests, config.batch_sizes, choice,
                                           best_hot, kv_len, config.repeats,
                                           config.sweep_new_tokens)  # fmt: skip
    hot_info = None
    if hot_ids is not None:
        plain_tokens = [t for group in plain["outputs"] for out in group for t in out]
        # Share of the plain outputs' tokens the hot vocabulary can propose at all.
        hot_info = {"size": int(np.asarray(hot_ids).size), "coverage_of_plain_outputs": coverage(
            count_tokens([plain_tokens], model.config.vocab_size), hot_ids)}  # fmt: skip
    out = {
        "draft": config.source,
        "num_prompts_bs1": config.num_prompts,
        "max_new_tokens": config.max_new_tokens,
        "sweep_new_tokens": config.sweep_new_tokens,
        "kv_len": kv_len,
        "repeats": config.repeats,
        "hot_vocab": hot_info,
        "plain_bs1": {key: plain[key] for key in ("tokens_per_s", "e2e_tokens_per_s",
                                                  "decode_tokens", "decode_s", "steps")},
        "grid": grid,
        "grid_invalid": invalid,
        "strategy": best["strategy"],
        "strategy_hot_vocab": best["hot_vocab"],
        "speedup_bs1": best["speedup"],
        "accept_len_bs1": best["accept_len"],
        "tokens_per_s_bs1": {"plain": plain["tokens_per_s"], "sd": best["tokens_per_s"]},
        "bs_sweep": sweep,
        # The smallest batch at which SD no longer beats plain decoding (None: it always does).
        "crossover_batch": next((b for b in config.batch_sizes
                                 if sweep[str(b)]["speedup"] < 1.0), None),
        "switch_cost": measure_switch(model, drafter, requests, switch, lags, choice, best_hot,
                                      kv_len, config.repeats, config.sweep_new_tokens)
                       if switch else None,
        "all_match_plain": all(r["matches_plain"] for r in [*grid, *sweep.values()]),
        "step_breakdown_bs1": step_breakdown(
            model, drafter, prompts[0], choice.strategy, hot_ids, best_hot, kv_len,
            new_tokens=min(64, config.max_new_tokens),
        ) if config.breakdown and uses_drafter else None,
    }  # fmt: skip
    out["compile_seconds"] = compile_s + sweep_compile_s
    return out


def adaptive_bandit(threshold: int, has_drafter: bool, source: str = "") -> BanditConfig:
    """The `spec` group's default bandit (`SpecConfig`: buckets, strategies, sources; seed 0)
    at `threshold`, SD from the first step; `source` makes it the only draft source."""
    from tlt_jax.rl.config import SpecConfig

    bandit = SpecConfig().bandit(threshold, has_drafter)
    return dataclasses.replace(bandit, warmup_steps=0,
                               sources=(source,) if source else bandit.sources)  # fmt: skip


# ----------------------------------------------------------------------------- entry point


def run(config: SpecBenchConfig) -> dict[str, Any]:
    """Loads the model, drafter, hot vocabulary and questions of `config`; runs
    `bench_adaptive` (config.adaptive) or `bench_fixed`. Returns the JSON dict."""
    import os

    import jax

    from tlt_jax.data.tokenizer import PromptEncoder
    from tlt_jax.models import checkpoints

    began, load_start = time.perf_counter(), os.getloadavg()
    tokenizer = checkpoints.load_tokenizer(config.model)
    model = checkpoints.load_model(config.model)
    drafter, hot_ids, hot_source = None, None, None
    if config.drafter:
        from tlt_jax.drafter.export import load_eagle
        from tlt_jax.drafter.hot_vocab import HOT_VOCAB_FILE, load_hot_vocab

        drafter = load_eagle(config.drafter, target=model.config)
        if config.hot_vocab_size:
            hot_source = config.hot_vocab or str(Path(config.drafter) / HOT_VOCAB_FILE)
            if not Path(hot_source).exists():
                raise FileNotFoundError(f"hot_vocab={hot_source!r} not found: pass hot_vocab "
                                        "(hot_vocab.json or the warm-up's responses.jsonl) or "
                                        "hot_vocab_size=0")  # fmt: skip
            hot_ids = load_hot_vocab(hot_source, config.hot_vocab_size, model.config.vocab_size)
    switch = () if config.adaptive else config.switch_batches
    questions, data = load_questions(
        config.gsm8k_dir, max(config.num_prompts, *config.batch_sizes, *switch)
    )
    encode = PromptEncoder(tokenizer)  # the RL prompt template, as the drafter warm-up renders
    prompts = [list(encode(q)) for q in questions]
    out = {"model": config.model, "dtype": model.config.param_dtype,
           "drafter": str(Path(config.drafter).resolve()) if config.drafter else None,
           "drafter_note": config.drafter_note, "hot_vocab_source": hot_source, "data": data,
           "prompt_tokens": [len(p) for p in prompts], "greedy": True,
           "backend": jax.default_backend(), "cpu_count": os.cpu_count()}  # fmt: skip
    if config.adaptive:
        bandit = adaptive_bandit(max(config.batch_sizes), drafter is not None, config.draft)
        out["adaptive"] = bench_adaptive(
            model, drafter, prompts, batches=config.batch_sizes,
            new_tokens=config.sweep_new_tokens, repeats=config.adaptive_repeats, bandit=bandit,
            hot_ids=hot_ids, drafter_sync=config.drafter_sync,
        )  # fmt: skip
    else:
        out.update(bench_fixed(model, drafter, prompts, config, hot_ids))
    out["total_seconds"] = time.perf_counter() - began
    out["loadavg_1min"] = {"start": load_start[0], "end": os.getloadavg()[0]}
    return out
