r"""Speculative decoding vs plain decoding, side by side: acceptance length and tokens/s.

  python scripts/bench_spec.py --drafter /tmp/drafter_warm/eagle \
      --hot_vocab /tmp/drafter_warm/run/responses.jsonl --output_json /tmp/bench_spec.json

SmolLM2-135M-Instruct (--model) with an EAGLE drafter warmed up by `scripts/train_drafter.py`
(--drafter), greedy, on GSM8K *test* questions (the warm-up uses train questions) rendered with
the RL prompt template exactly as the warm-up renders them; arithmetic questions when the GSM8K
folder is missing (the JSON's "data" says which). Every request generates exactly its number of
new tokens (no stop ids), so plain and SD emit the same tokens (checked: "matches_plain").

Measured in one run:
  (a) grid at batch 1 (--num_prompts prompts, one at a time, --max_new_tokens each):
      depth x verify_tokens (--grid) at --topk with the hot draft vocabulary (--hot_vocab_size
      ids counted from --hot_vocab, default DRAFTER/hot_vocab.json), and with the full one at
      each depth's fastest point (--full_vocab), vs plain decoding; `max_speedup` is what
      each point's measured step time would give if every drafted token were accepted;
  (b) batch sweep (--batch_sizes, --sweep_new_tokens each) at the fastest strategy of (a):
      speedup and acceptance per batch size, and `crossover_batch`, the smallest batch at
      which SD no longer beats plain decoding;
  (c) `switch_cost`: switching a running batch from plain decoding into SD after --switch_lags
      plain steps, at --switch_batches: the engine's drafter catch-up (one target forward over
      every row's missed positions plus the drafter over them, `speculative.catchup_program`),
      in ms and in plain steps of that batch; and the plain step with eager drafter sync
      (`drafter_sync="eager"`: no catch-up, the drafter layer in every plain step) vs lazy;
  (d) `step_breakdown_bs1`: each compiled program of a batch-1 SD step (draft full and hot,
      tree, verify) and their parts (one draft level's LM head, full vs hot; the drafter layer;
      the target forward over the tree; acceptance) timed alone on a real state, vs a plain
      step, and the host overhead of the engine's steps.

Tokens/s counts decoding only (from each request's first token, which prefill emits, to its
last); end-to-end figures (prefill included) are next to them. Plain and SD run in the same
engine per batch size (plain steps are the engine's plain program; its prefill also fills the
drafter cache, which only the end-to-end figure sees). One kv bucket covers every length, so a
short warm-up generation compiles the programs of a configuration before it is timed; a timed
run that still compiled (an SD batch's tail at smaller batch buckets) is discarded and run
again. Each point keeps the fastest of --repeats clean runs ("timed_runs", "clean_runs").
"""

import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np
from absl import app, flags

REPO = Path(__file__).resolve().parent.parent
flags.DEFINE_string("output_json", None, "Where to write the JSON results.")
flags.DEFINE_string("model", "smollm2-135m-instruct", "Policy: HF directory, .gguf or short name.")
flags.DEFINE_string("drafter", None, "EAGLE drafter directory (scripts/train_drafter.py export).")
flags.DEFINE_string("gsm8k_dir", str(REPO.parent / "shared" / "data" / "gsm8k"),
                    "Folder with GSM8K test.jsonl (arithmetic questions if missing).")  # fmt: skip
flags.DEFINE_string("drafter_note", "", "Free text for the JSON: the drafter's data and training.")
flags.DEFINE_integer("num_prompts", 2, "Batch-1 prompts (each generated on its own).")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens generated per request at batch 1.")
flags.DEFINE_integer("sweep_new_tokens", 32, "Tokens per request in the batch sweep (>1).")
flags.DEFINE_string("grid", "2,4,6x4,8,16", "Batch-1 grid: 'depths x verify_tokens'.")
flags.DEFINE_integer("topk", 4, "Top-k of every grid strategy.")
flags.DEFINE_integer("hot_vocab_size", 2048, "Hot draft vocabulary size (0: full vocab only).")
flags.DEFINE_string("hot_vocab", None, "hot_vocab.json (or warm-up responses.jsonl) to count "
                    "tokens from; default DRAFTER/hot_vocab.json.")  # fmt: skip
flags.DEFINE_enum("full_vocab", "per_depth", ["per_depth", "all", "none"],
                  "Where the grid also runs the full draft vocabulary: at each depth's fastest "
                  "hot-vocabulary point, at every point, or nowhere.")  # fmt: skip
flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8", "16", "32"], "Batch sweep sizes.")
flags.DEFINE_list("switch_batches", ["1", "4", "16"], "Batch sizes of the SD switch-cost runs.")
flags.DEFINE_list("switch_lags", ["32", "128"], "Plain steps before the switch into SD.")
flags.DEFINE_integer("repeats", 2, "Timed runs per configuration (the best is kept).")
flags.DEFINE_bool("breakdown", True, "Time the programs of a batch-1 SD step separately.")
FLAGS = flags.FLAGS

WARM_TOKENS = 4  # enough for a prefill plus SD steps: compiles every program of a config


def load_questions(gsm8k_dir: str, count: int) -> tuple[list[str], str]:
    """The first `count` GSM8K test questions, or arithmetic test questions as a fallback."""
    path = Path(gsm8k_dir) / "test.jsonl"
    if path.is_file():
        with open(path) as f:
            rows = [json.loads(line) for line, _ in zip(f, range(count), strict=False)]
        return [r["question"] for r in rows], f"gsm8k {path} (first {len(rows)} questions)"
    from tlt_jax.data.arithmetic import make_problem

    rng = np.random.default_rng([0, 1])
    questions = [make_problem(rng, 2)[0] for _ in range(count)]
    return questions, f"arithmetic level 2 (seed [0, 1]): {path} is missing"


def generate_timed(engine, group) -> dict:
    """One generate() call: decode-only and end-to-end figures, outputs, SD step counts."""
    steps = engine.stats.spec_steps + engine.stats.decode_steps
    start = time.perf_counter()
    out = engine.generate(group)
    wall = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in out)
    return {
        "steps": engine.stats.spec_steps + engine.stats.decode_steps - steps,
        "decode_tokens": tokens - len(out),  # prefill emits each request's first token
        "decode_s": max(c.finish_time for c in out) - max(c.first_token_time for c in out),
        "tokens": tokens,
        "wall_s": wall,
        "accepted": [n for c in out for n in c.accepted_lengths],
        "outputs": [c.token_ids for c in out],
    }


def warm_up(engine, groups, strategy, hot_ids) -> None:
    """Compiles every program the timed runs of `groups` need, plain and SD, in one short run
    per group (one kv bucket covers every length): the first step plain, the rest SD."""
    engine.set_hot_token_ids(hot_ids)
    steps = iter(range(10**9))
    engine.step_mode = lambda num_running: None if next(steps) == 0 else strategy
    for group in groups:
        engine.generate([dataclasses.replace(r, max_new_tokens=WARM_TOKENS) for r in group])


def run_point(engine, groups, strategy, hot_ids, repeats: int) -> dict:
    """Times `groups` (one generate() call each) after `warm_up`; keeps the fastest run that
    compiled nothing.

    Runs until `repeats` runs compiled nothing, at most `repeats + 1` runs: an SD batch whose
    requests finish at different steps runs its tail at smaller batch buckets, whose programs
    the first full-length run may compile (greedy runs repeat exactly, so the next one does
    not).

    Args:
      engine: a RolloutEngine with a drafter.
      groups: lists of requests; batch 1 is one single-request group per prompt.
      strategy: SpecStrategy, or None for plain decoding.
      hot_ids: the draft vocabulary (None: full).
      repeats: timed runs wanted.
    """
    engine.step_mode = lambda num_running: strategy  # the engine's hook for the step mode
    engine.set_hot_token_ids(hot_ids)
    best, clean, runs_done = None, 0, 0
    while clean < repeats and runs_done < repeats + 1:
        compiles = engine.stats.compile_count
        runs = [generate_timed(engine, group) for group in groups]
        runs_done += 1
        if engine.stats.compile_count != compiles:
            continue
        clean += 1
        total = {key: sum(r[key] for r in runs)
                 for key in ("decode_tokens", "decode_s", "tokens", "wall_s", "steps")}  # fmt: skip
        if best is None or total["decode_s"] < best["decode_s"]:
            best = dict(total, accepted=[n for r in runs for n in r["accepted"]],
                        outputs=[r["outputs"] for r in runs])  # fmt: skip
    if best is None:
        raise RuntimeError(f"every timed run of {strategy} compiled programs; see warm_up")
    accepted = best.pop("accepted")
    return dict(
        best,
        tokens_per_s=best["decode_tokens"] / best["decode_s"],
        e2e_tokens_per_s=best["tokens"] / best["wall_s"],
        accept_len=float(np.mean(accepted)) if accepted else None,
        sd_steps=len(accepted),
        timed_runs=runs_done,
        clean_runs=clean,
    )


def compare(sd: dict, plain: dict) -> dict:
    """The JSON row of an SD point against plain decoding of the same requests."""
    row = {
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
    }
    return row


def engine_config(batch: int, kv_len: int):
    from tlt_jax.rollout.engine import EngineConfig

    # One kv bucket for every length: the short compile run builds the timed runs' programs.
    # Lazy drafter sync: the plain baseline is pure plain decoding (SD runs have no plain
    # steps; their prefill syncs the drafter). `measure_switch` times eager sync separately.
    return EngineConfig(max_batch_size=batch, max_seq_len=kv_len, max_prefill_batch=min(batch, 8),
                        min_kv_bucket=kv_len, drafter_sync="lazy")  # fmt: skip


def parse_grid(text: str, topk: int):
    """'2,4,6x4,8,16' -> (valid strategies, invalid 'd,k,t: reason' strings)."""
    from tlt_jax.rollout.speculative import SpecStrategy

    try:
        depths, verifies = ([int(x) for x in part.split(",")] for part in text.split("x"))
    except ValueError as e:
        raise app.UsageError(f"--grid={text!r} must look like '2,4,6x4,8,16' "
                             "(depths x verify_tokens)") from e  # fmt: skip
    valid, invalid = [], []
    for depth in depths:
        for verify in verifies:
            try:
                valid.append(SpecStrategy(depth, topk, verify))
            except ValueError as e:
                invalid.append(f"{depth},{topk},{verify}: {e}")
    return valid, invalid


def best_ms(fn, *args, iters: int, fresh=None) -> float:
    """Fastest of `iters` calls of a jitted function (compiled first), in ms: the minimum, like
    the engine figures' best run, since other jobs share the cores. `fresh(args)` rebuilds
    donated arguments before each call, outside the timing."""
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


def step_breakdown(model, drafter, prompt, strategy, hot_ids, engine_hot_ids, kv_len: int,
                   new_tokens: int, iters: int) -> dict:  # fmt: skip
    """Times each compiled program of a batch-1 SD step, and their parts, on a real state.

    First the engine's plain and SD steps on `prompt` (`new_tokens` each; SD with
    `engine_hot_ids`), then, on the state SD left, the engine's programs alone
    (`speculative.*_program`, `engine._decode`) and their parts: one draft level's LM head (full
    and hot), the drafter layer over the level buffer and over the accepted path, the target
    forward over the tree, acceptance, and the target forward (with logits) over 1 .. 16 new
    tokens (what a wider tree costs to verify). Host overhead = engine step - its programs.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tlt_jax.models.drafter import draft_logits, drafter_forward
    from tlt_jax.rollout import speculative
    from tlt_jax.rollout.acceptance import accept_tree
    from tlt_jax.rollout.draft_tree import DraftTree
    from tlt_jax.rollout.engine import Request, RolloutEngine, _decode

    # The engine's own steps first (plain, then SD: the state ends with the drafter in sync),
    # so that step times and program times are measured under the same machine load.
    engine = RolloutEngine(model, engine_config(1, kv_len), drafter=drafter)
    group = [[Request(tuple(prompt), new_tokens)]]
    warm_up(engine, group, strategy, engine_hot_ids)
    plain = run_point(engine, group, None, None, repeats=2)
    sd = run_point(engine, group, strategy, engine_hot_ids, repeats=2)
    state, params, dparams = engine.state, engine.params, engine.drafter_params
    graphdef, dconfig = engine.graphdef, engine.drafter_config
    k, depth, t = strategy.topk, strategy.depth, strategy.verify_tokens
    hot = None if hot_ids is None else jnp.asarray(hot_ids, jnp.int32)

    def fresh(args):  # verify donates the state: each call gets its own copy
        return (*args[:2], jax.tree.map(jnp.copy, args[2]), *args[3:])

    out = {"strategy": str(strategy), "kv_len": kv_len, "context": int(state.lengths[0]),
           "iters": iters}  # fmt: skip

    draft = jax.jit(functools.partial(speculative.draft_program, graphdef, dconfig, batch=1,
                                      kv_len=kv_len, topk=k, depth=depth))  # fmt: skip
    out["draft_full_ms"] = best_ms(draft, params, dparams, state, None, iters=iters)
    if hot is not None:
        out["draft_hot_ms"] = best_ms(draft, params, dparams, state, hot, iters=iters)
    candidates = draft(params, dparams, state, hot)
    tree_fn = jax.jit(functools.partial(speculative.tree_program, batch=1, verify_tokens=t,
                                        depth=depth))  # fmt: skip
    out["tree_ms"] = best_ms(tree_fn, candidates, state, iters=iters)
    tree = tree_fn(candidates, state)
    verify = jax.jit(
        functools.partial(
            speculative.verify_program, graphdef, dconfig, batch=1, kv_len=kv_len, greedy_only=True
        ),
        donate_argnums=(2,),
    )
    out["verify_ms"] = best_ms(verify, params, dparams, state, tree, iters=iters, fresh=fresh)
    decode = jax.jit(functools.partial(_decode, graphdef, batch=1, kv_len=kv_len,
                                       greedy_only=True), donate_argnums=(1,))  # fmt: skip
    out["plain_decode_ms"] = best_ms(
        decode, params, state, iters=iters,
        fresh=lambda a: (a[0], jax.tree.map(jnp.copy, a[1])),
    )  # fmt: skip

    # Parts. One draft level's head: logits of k features, log-softmax, top-k.
    def head_level(params, g_1xkxD, ids):
        head = nnx.merge(graphdef, params).head_weight_DxV()
        if ids is not None:
            head = jnp.take(head, ids, axis=1)
        return jax.lax.top_k(jax.nn.log_softmax(draft_logits(g_1xkxD, head), axis=-1), k)

    g = jax.random.normal(jax.random.key(0), (1, k, model.config.hidden_size), jnp.float32)
    head_jit = jax.jit(head_level)
    out["draft_head_level_full_ms"] = best_ms(head_jit, params, g, None, iters=iters)
    if hot is not None:
        out["draft_head_level_hot_ms"] = best_ms(head_jit, params, g, hot, iters=iters)

    def drafter_layer(params, dparams, state, n):
        embed = nnx.merge(graphdef, params).embed.get_value()
        positions = state.draft.lengths[:1, None] + jnp.arange(n, dtype=jnp.int32)[None] // k
        return drafter_forward(
            dparams, dconfig, embed, jnp.zeros((1, n), jnp.int32),
            jnp.zeros((1, n, model.config.hidden_size), jnp.float32), positions,
            mask_BxTxT=jnp.eye(n, dtype=bool)[None], cache=state.draft.cache.view(1, kv_len),
            cache_lens_B=state.draft.lengths[:1],
        )[0]  # fmt: skip

    n = max(1, (depth - 1) * k)
    layer_jit = jax.jit(drafter_layer, static_argnums=3)
    out["drafter_layer_level_ms"] = best_ms(layer_jit, params, dparams, state, n, iters=iters)
    out["drafter_layer_path_ms"] = best_ms(layer_jit, params, dparams, state, t, iters=iters)
    out["draft_levels"] = depth

    def target_tree(params, state, tree):
        model_ = nnx.merge(graphdef, params)
        features, _ = model_(
            tree.tokens_BxT,
            tree.positions_BxT,
            mask_BxTxT=tree.mask_BxTxT,
            cache=state.cache.view(1, kv_len),
            cache_lens_B=state.lengths[:1],
        )
        return model_.logits(features)

    target_jit = jax.jit(target_tree)
    out["verify_target_forward_ms"] = best_ms(target_jit, params, state, tree, iters=iters)
    logits = target_jit(params, state, tree)
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
        widths[str(width)] = best_ms(target_jit, params, state, chain, iters=iters)
    out["target_forward_ms_by_tokens"] = widths
    out["sd_programs_ms"] = out["draft_full_ms"] + out["tree_ms"] + out["verify_ms"]
    if hot is not None:
        out["sd_programs_hot_ms"] = out["draft_hot_ms"] + out["tree_ms"] + out["verify_ms"]
    # Acceptance length at which one SD step's programs cost as much as its plain steps.
    out["break_even_accept_len"] = out["sd_programs_ms"] / out["plain_decode_ms"]
    if hot is not None:
        out["break_even_accept_len_hot"] = out["sd_programs_hot_ms"] / out["plain_decode_ms"]
    programs = out["sd_programs_ms" if engine_hot_ids is None else "sd_programs_hot_ms"]
    out["engine_hot_vocab"] = engine_hot_ids is not None
    out["sd_step_in_engine_ms"] = 1e3 * sd["decode_s"] / sd["steps"]
    out["sd_host_overhead_ms"] = out["sd_step_in_engine_ms"] - programs
    out["plain_step_in_engine_ms"] = 1e3 * plain["decode_s"] / plain["steps"]
    out["plain_host_overhead_ms"] = out["plain_step_in_engine_ms"] - out["plain_decode_ms"]
    out["engine_accept_len"] = sd["accept_len"]
    out["engine_speedup"] = sd["tokens_per_s"] / plain["tokens_per_s"]
    return out


def measure_grid(engine, groups, strategies, hot_ids, repeats: int) -> tuple[dict, list]:
    """(a): plain decoding, then every strategy with the hot vocabulary and (--full_vocab)
    with the full one, on the batch-1 `engine`. Returns (plain point, grid rows)."""
    from tlt_jax.rollout.speculative import SpecStrategy

    warm_up(engine, groups, strategies[0], hot_ids)
    plain = run_point(engine, groups, None, None, repeats)
    print(f"plain bs1: {plain['tokens_per_s']:.1f} tok/s", flush=True)
    grid = []

    def point(strategy, hot):
        warm_up(engine, groups, strategy, hot)
        row = compare(run_point(engine, groups, strategy, hot, repeats), plain)
        # The speedup if every drafted token were accepted: a step emits at most
        # min(depth, verify_tokens - 1) + 1 tokens, at this measured SD step time.
        most = min(strategy.depth, strategy.verify_tokens - 1) + 1
        row["max_speedup"] = most * row["plain_step_ms"] / row["step_ms"]
        grid.append(dict(strategy=str(strategy), hot_vocab=hot is not None, **row))
        print(f"{strategy!s:>8} hot={hot is not None!s:5}: {row['tokens_per_s']:6.1f} tok/s, "
              f"speedup {row['speedup']:.2f}, accept {row['accept_len']:.2f}, step "
              f"{row['step_ms']:.0f} ms (plain {row['plain_step_ms']:.0f} ms)",
              flush=True)  # fmt: skip

    for strategy in strategies:
        point(strategy, hot_ids)
    if hot_ids is None or FLAGS.full_vocab == "none":
        return plain, grid
    if FLAGS.full_vocab == "all":
        for strategy in strategies:
            point(strategy, None)
        return plain, grid
    for depth in sorted({x.depth for x in strategies}):
        rows = [r for r in grid if SpecStrategy.parse(r["strategy"]).depth == depth]
        point(SpecStrategy.parse(max(rows, key=lambda r: r["speedup"])["strategy"]), None)
    return plain, grid


def measure_sweep(model, drafter, requests, batches, strategy, hot_ids, kv_len: int,
                  repeats: int) -> tuple[dict, float]:  # fmt: skip
    """(b): plain vs SD at every batch size, one engine per size (plain mode shares its
    prefill programs). Returns ({batch: row}, compile seconds)."""
    from tlt_jax.rollout.engine import RolloutEngine

    sweep, compile_s = {}, 0.0
    for batch in batches:
        group = [requests(batch, FLAGS.sweep_new_tokens)]
        engine = RolloutEngine(model, engine_config(batch, kv_len), drafter=drafter)
        warm_up(engine, group, strategy, hot_ids)
        plain = run_point(engine, group, None, None, repeats)
        sweep[str(batch)] = row = compare(run_point(engine, group, strategy, hot_ids, repeats),
                                          plain)  # fmt: skip
        compile_s += engine.stats.compile_seconds
        print(f"batch {batch:3d}: plain {row['plain_tokens_per_s']:7.1f} tok/s, SD "
              f"{row['tokens_per_s']:7.1f} tok/s, speedup {row['speedup']:.2f}, accept "
              f"{row['accept_len']:.2f}", flush=True)  # fmt: skip
    return sweep, compile_s


def measure_switch(model, drafter, requests, batches, lags, strategy, hot_ids, kv_len: int,
                   repeats: int) -> dict:  # fmt: skip
    """(c): the cost of switching a running batch into SD, lazy and eager drafter sync.

    Lazy (the default): prefill leaves every drafter in sync, `lag` plain steps leave it `lag`
    positions behind, and the first SD step runs the engine's catch-up, timed by the engine
    itself (`EngineStats.spec_switch_seconds`, compilation excluded). Eager
    (`EngineConfig.drafter_sync="eager"`): every plain step also runs the drafter layer over its
    new pair, so the switch costs nothing and each plain step a little more; both engines'
    plain steps are timed on the same requests (--sweep_new_tokens each).

    Returns:
      {batch: {"catchup": {lag: row}, "plain_step_ms": .., "eager_plain_step_ms": ..,
      "eager_overhead": ..}}; a catch-up row also gives `catchup_in_plain_steps`.
    """
    import itertools

    from tlt_jax.rollout.engine import RolloutEngine

    out = {}
    for batch in batches:
        engine = RolloutEngine(model, engine_config(batch, kv_len), drafter=drafter)
        engine.set_hot_token_ids(hot_ids)
        catchup = {}
        for lag in lags:
            best = None
            for _ in range(repeats + 1):  # the first run compiles this lag's catch-up
                steps = itertools.count()
                stats = engine.stats
                before = (stats.spec_switch_seconds, stats.spec_switch_tokens,
                          stats.spec_switch_count, stats.compile_count)  # fmt: skip
                engine.step_mode = lambda n, steps=steps, lag=lag: (
                    None if next(steps) < lag else strategy
                )
                engine.generate(requests(batch, lag + 1 + WARM_TOKENS))
                if stats.spec_switch_count - before[2] != 1 or stats.compile_count != before[3]:
                    continue  # compiled (or did not switch exactly once): not timed
                row = {"catchup_ms": 1e3 * (stats.spec_switch_seconds - before[0]),
                       "catchup_tokens": stats.spec_switch_tokens - before[1]}  # fmt: skip
                if best is None or row["catchup_ms"] < best["catchup_ms"]:
                    best = row
            if best is None:
                raise RuntimeError(f"switch at batch {batch}, lag {lag}: every run compiled")
            catchup[str(lag)] = best
        group = [requests(batch, FLAGS.sweep_new_tokens)]
        eager = RolloutEngine(model, dataclasses.replace(engine.config, drafter_sync="eager"),
                              drafter=drafter)  # fmt: skip
        warm_up(eager, group, strategy, hot_ids)
        plain = run_point(engine, group, None, None, repeats)
        eager_plain = run_point(eager, group, None, None, repeats)
        plain_ms = 1e3 * plain["decode_s"] / plain["steps"]
        eager_ms = 1e3 * eager_plain["decode_s"] / eager_plain["steps"]
        for row in catchup.values():
            row["catchup_in_plain_steps"] = row["catchup_ms"] / plain_ms
        out[str(batch)] = {"catchup": catchup, "plain_step_ms": plain_ms,
                           "eager_plain_step_ms": eager_ms,
                           "eager_overhead": eager_ms / plain_ms - 1.0}  # fmt: skip
        print(f"switch batch {batch:3d}: plain step {plain_ms:.0f} ms (eager sync "
              f"{eager_ms:.0f} ms); lazy catch-up " + ", ".join(
                  f"after {lag}: {row['catchup_ms']:.0f} ms = "
                  f"{row['catchup_in_plain_steps']:.1f} plain steps"
                  for lag, row in catchup.items()), flush=True)  # fmt: skip
    return out


def main(argv):
    del argv
    if not FLAGS.drafter:
        raise app.UsageError(
            "--drafter is required: the EAGLE directory exported by "
            "scripts/train_drafter.py (e.g. --drafter /tmp/drafter_warm/eagle)"
        )
    import os

    import jax

    from tlt_jax.drafter.export import load_eagle
    from tlt_jax.drafter.hot_vocab import HOT_VOCAB_FILE, count_tokens, coverage, load_hot_vocab
    from tlt_jax.drafter.warmup import encode_prompts
    from tlt_jax.models import checkpoints
    from tlt_jax.rollout.engine import Request, RolloutEngine
    from tlt_jax.rollout.speculative import SpecStrategy

    began, load_start = time.perf_counter(), os.getloadavg()
    command = " ".join([sys.executable.split("/")[-1]] + sys.argv)
    strategies, invalid = parse_grid(FLAGS.grid, FLAGS.topk)
    if not strategies:
        raise app.UsageError(f"--grid={FLAGS.grid!r} --topk={FLAGS.topk}: no valid strategy "
                             f"({invalid})")  # fmt: skip
    batches = sorted({int(b) for b in FLAGS.batch_sizes})
    try:
        switch_batches = sorted({int(b) for b in FLAGS.switch_batches})
        switch_lags = sorted({int(x) for x in FLAGS.switch_lags})
    except ValueError as e:
        raise app.UsageError(f"--switch_batches={FLAGS.switch_batches} and --switch_lags="
                             f"{FLAGS.switch_lags} must be integers") from e  # fmt: skip
    if any(x < 1 for x in switch_batches + switch_lags):
        raise app.UsageError("--switch_batches and --switch_lags must be >= 1")
    tokenizer = checkpoints.load_tokenizer(FLAGS.model)
    model = checkpoints.load_model(FLAGS.model)
    drafter = load_eagle(FLAGS.drafter)
    vocab = model.config.vocab_size
    hot_ids, hot_source = None, None
    if FLAGS.hot_vocab_size:
        hot_source = FLAGS.hot_vocab or str(Path(FLAGS.drafter) / HOT_VOCAB_FILE)
        if not Path(hot_source).exists():
            raise app.UsageError(
                f"{hot_source} not found: pass --hot_vocab (hot_vocab.json or "
                "the warm-up's responses.jsonl) or --hot_vocab_size=0"
            )
        hot_ids = load_hot_vocab(hot_source, FLAGS.hot_vocab_size, vocab)

    questions, data = load_questions(
        FLAGS.gsm8k_dir, max(FLAGS.num_prompts, *batches, *switch_batches)
    )
    prompts = encode_prompts(tokenizer, [{"prompt": q} for q in questions], None)
    longest = max(
        FLAGS.max_new_tokens,
        FLAGS.sweep_new_tokens,
        *(lag + 1 + WARM_TOKENS for lag in switch_lags),
    )
    kv_len = -(-(max(len(p) for p in prompts) + longest + 1) // 64) * 64
    print(f"data: {data}; kv_len {kv_len}; grid {[str(x) for x in strategies]}", flush=True)

    def requests(count, new_tokens):
        return [Request(tuple(p), new_tokens) for p in prompts[:count]]  # greedy, no stop ids

    bs1_groups = [[r] for r in requests(FLAGS.num_prompts, FLAGS.max_new_tokens)]
    bs1_engine = RolloutEngine(model, engine_config(1, kv_len), drafter=drafter)
    plain, grid = measure_grid(bs1_engine, bs1_groups, strategies, hot_ids, FLAGS.repeats)
    compile_s = bs1_engine.stats.compile_seconds
    del bs1_engine  # frees its decode state before the larger batches
    best = max(grid, key=lambda r: r["speedup"])
    strategy = SpecStrategy.parse(best["strategy"])
    best_hot = hot_ids if best["hot_vocab"] else None
    sweep, sweep_compile_s = measure_sweep(model, drafter, requests, batches, strategy, best_hot,
                                           kv_len, FLAGS.repeats)  # fmt: skip
    switch = measure_switch(model, drafter, requests, switch_batches, switch_lags, strategy,
                            best_hot, kv_len, FLAGS.repeats) if switch_batches else {}  # fmt: skip
    hot_info = None
    if hot_ids is not None:
        plain_tokens = [t for group in plain["outputs"] for out in group for t in out]
        hot_info = {
            "size": int(hot_ids.size),
            "source": hot_source,
            # Share of the plain outputs' tokens the hot vocabulary can propose at all.
            "coverage_of_plain_outputs": coverage(count_tokens([plain_tokens], vocab), hot_ids),
        }
    out = {
        "command": command,
        "model": FLAGS.model,
        "dtype": model.config.param_dtype,
        "drafter": str(Path(FLAGS.drafter).resolve()),
        "drafter_note": FLAGS.drafter_note,
        "data": data,
        "num_prompts_bs1": FLAGS.num_prompts,
        "prompt_tokens": [len(p) for p in prompts],
        "max_new_tokens": FLAGS.max_new_tokens,
        "sweep_new_tokens": FLAGS.sweep_new_tokens,
        "kv_len": kv_len,
        "greedy": True,
        "repeats": FLAGS.repeats,
        "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
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
        "crossover_batch": next((b for b in batches if sweep[str(b)]["speedup"] < 1.0), None),
        "switch_cost": switch,
        "all_match_plain": all(r["matches_plain"] for r in [*grid, *sweep.values()]),
    }  # fmt: skip
    if FLAGS.breakdown:
        out["step_breakdown_bs1"] = step_breakdown(
            model, drafter, prompts[0], strategy, hot_ids, best_hot, kv_len,
            new_tokens=min(64, FLAGS.max_new_tokens), iters=10,
        )  # fmt: skip
    out["compile_seconds"] = compile_s + sweep_compile_s
    out["total_seconds"] = time.perf_counter() - began
    out["loadavg_1min"] = {"start": load_start[0], "end": os.getloadavg()[0]}
    print(json.dumps(out, indent=2))
    print(f"command: {command}")
    if FLAGS.output_json:
        Path(FLAGS.output_json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    app.run(main)
