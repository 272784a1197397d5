"""The benchmark library (`rollout.bench`, `rollout.spec_bench`) end to end on tiny models:
expected keys, SD tokens == plain greedy tokens for every draft source, config errors."""

from __future__ import annotations

import numpy as np
import pytest
from test_speculative import ALIGNED, aligned_pair, plain_greedy, random_prompts

from tlt_jax.metrics import timing
from tlt_jax.rollout import bench, spec_bench
from tlt_jax.rollout.adaptive import StepChoice
from tlt_jax.rollout.engine import Request
from tlt_jax.rollout.speculative import SpecStrategy

TINY = dict(num_prompts=1, max_new_tokens=8, sweep_new_tokens=6, grid="2x3", topk=2,
            batch_sizes=(1, 2), switch_batches=(2,), switch_lags=(3,), repeats=1)  # fmt: skip


@pytest.fixture(scope="module")
def aligned():
    return aligned_pair(**ALIGNED)


def test_median_step_ms_by_hand():
    # Steps end at 0.1, 0.3, 0.4, 0.6 s: 100, 200, 100, 200 ms with 2, 2, 1, 2 running.
    timeline = [(0.1, 2, "plain"), (0.3, 2, "plain"), (0.4, 1, "ngram:4,1,5"), (0.6, 2, "plain")]
    assert timing.median_step_ms(timeline, 2) == pytest.approx(200.0)  # first step skipped
    assert timing.median_step_ms(timeline, 1) == pytest.approx(100.0)
    assert timing.median_step_ms(timeline) == pytest.approx(200.0)  # 200, 100, 200
    # Two steps: the second (the first followed prefill and took 5 s; it was kept).
    assert timing.median_step_ms([(5.0, 8), (5.1, 8)]) == pytest.approx(100.0)
    assert timing.median_step_ms([(5.0, 8)]) == pytest.approx(5000.0)  # the only one
    with pytest.raises(ValueError, match="no decode step with batch=3"):
        timing.median_step_ms(timeline, 3)


def test_spread_by_hand():
    """The one summary of every benchmark figure: the median and the mean (which one disturbed
    round moves) side by side, the range, every value."""
    assert timing.spread([4.0, 1.0, 1.0]) == {"median": 1.0, "mean": 2.0, "min": 1.0,
                                              "max": 4.0, "runs": [4.0, 1.0, 1.0]}  # fmt: skip
    with pytest.raises(ValueError, match="at least one round"):
        timing.spread([])


def test_repeat_ratio_pairs_each_run_with_the_one_beside_it():
    """bench_rollout's ratios: best over best, and each repeat's run over the other side's run
    of the same repeat (the best runs, 60 and 25, came from different repeats)."""
    best, spread = bench.repeat_ratio([50.0, 40.0, 60.0], [20.0, 25.0, 10.0])
    assert best == pytest.approx(60.0 / 25.0)
    assert spread["runs"] == pytest.approx([2.5, 1.6, 6.0])
    assert spread["median"] == pytest.approx(2.5) and spread["mean"] == pytest.approx(10.1 / 3)
    assert (spread["min"], spread["max"]) == pytest.approx((1.6, 6.0))
    with pytest.raises(ValueError, match="2 runs against 3"):
        bench.repeat_ratio([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="0 runs against 0"):
        bench.repeat_ratio([], [])


@pytest.mark.parametrize("source", [None, "eagle", "ngram", "hybrid"])
def test_run_point_tokens_equal_plain_greedy(aligned, source):
    model, drafter = aligned
    prompts = random_prompts(2, model.config.vocab_size, seed=5)
    want = plain_greedy(model, prompts, 10)  # a separate plain engine
    choice = None if source is None else StepChoice(SpecStrategy(2, 2, 3), source)
    engine = bench.make_engine(model, drafter, 2, bench.kv_length(prompts, 10), ngram=True)
    group = [[Request(p, 10) for p in prompts]]
    bench.warm_up(engine, group, choice, None)
    point = bench.run_point(engine, group, choice, None, repeats=1)
    assert point["outputs"] == [want]
    assert point["decode_tokens"] == 2 * 9 and point["clean_runs"] == 1
    if source is None:
        assert point["sd_steps"] == 0 and point["steps"] == 9
    else:
        # One accepted length per running row and SD step; rows may finish at different steps.
        assert 0 < point["steps"] <= point["sd_steps"] <= 2 * point["steps"]
    if source in ("eagle", "hybrid"):  # the aligned drafter is right about half the time
        assert point["accept_len"] > 1.3
    # `compare` must notice a single changed token.
    changed = [[w[:-1] + [w[-1] ^ 1] for w in want]]
    row = bench.compare(dict(point, outputs=changed), point)
    assert row["matches_plain"] is False and bench.compare(point, point)["matches_plain"]


def test_bench_fixed_eagle_keys_and_parity(aligned):
    model, drafter = aligned
    prompts = random_prompts(2, model.config.vocab_size, seed=7)
    config = spec_bench.SpecBenchConfig(drafter="tiny", draft="eagle", **TINY)
    out = spec_bench.bench_fixed(model, drafter, prompts, config, hot_ids=np.arange(128))
    assert out["draft"] == "eagle" and out["all_match_plain"] is True
    # One hot-vocabulary point and the full-vocabulary one at its depth.
    assert [(r["strategy"], r["hot_vocab"]) for r in out["grid"]] == [
        ("2,2,3", True),
        ("2,2,3", False),
    ]
    assert set(out["bs_sweep"]) == {"1", "2"}
    assert out["accept_len_bs1"] > 1.0 and out["hot_vocab"]["size"] == 128
    assert 0.0 < out["hot_vocab"]["coverage_of_plain_outputs"] <= 1.0
    assert out["crossover_batch"] in (None, 1, 2)
    switch = out["switch_cost"]["2"]
    assert set(switch) == {"catchup", "plain_step_ms", "eager_plain_step_ms", "eager_overhead",
                           "eager_overhead_spread"}  # fmt: skip
    assert switch["catchup"]["3"]["catchup_tokens"] == 2 * 3  # 3 plain steps on 2 rows
    breakdown = out["step_breakdown_bs1"]
    for key in (
        "draft_full_ms",
        "draft_hot_ms",
        "draft_hot_slicing_ms",
        "tree_ms",
        "verify_ms",
        "verify_accept_ms",
        "break_even_accept_len",
        "sd_host_overhead_ms",
        "plain_step_median_ms",
    ):
        assert breakdown[key] > 0 or key == "sd_host_overhead_ms", key
    assert set(breakdown["target_forward_ms_by_tokens"]) == {"1", "2", "4", "8", "16"}
    assert breakdown["break_even_accept_len_in_engine"] == pytest.approx(
        breakdown["sd_step_in_engine_ms"] / breakdown["plain_step_in_engine_ms"]
    )


def test_plain_and_sd_runs_alternate_in_the_sweep_and_the_grid(aligned, monkeypatch):
    """Each ratio's two sides run alternately on the same engine (a plain baseline timed once
    before every SD point is exposed alone to a disturbance: BENCHMARKS.md discards two such
    runs), and the grid compares each point with the plain runs beside it."""
    model, drafter = aligned
    prompts = random_prompts(2, model.config.vocab_size, seed=11)
    sides, timed = [], bench.timed_generate

    def spy(engine, requests):
        sides.append(type(engine.step_policy).__name__)
        return timed(engine, requests)

    monkeypatch.setattr(bench, "timed_generate", spy)
    choice = StepChoice(SpecStrategy(2, 2, 3), "eagle")
    kv_len = bench.kv_length(prompts, 6)

    def requests(count, new_tokens):
        return [Request(tuple(p), new_tokens) for p in prompts[:count]]

    sweep, _ = spec_bench.measure_sweep(model, drafter, requests, (2,), choice, None, kv_len,
                                        repeats=2, new_tokens=6)  # fmt: skip
    assert sweep["2"]["matches_plain"]
    assert len(sweep["2"]["speedup_spread"]["runs"]) >= 1
    assert sides[:2] in (["PlainPolicy", "FixedPolicy"], ["FixedPolicy", "PlainPolicy"]), sides
    # Some SD run comes before some plain run and vice versa: the sides interleave.
    first = {k: sides.index(k) for k in ("PlainPolicy", "FixedPolicy")}
    last = {k: len(sides) - 1 - sides[::-1].index(k) for k in first}
    assert first["FixedPolicy"] < last["PlainPolicy"] and first["PlainPolicy"] < last["FixedPolicy"]
    sides.clear()
    engine = bench.make_engine(model, drafter, 1, kv_len, ngram=False)
    groups = [[r] for r in requests(1, 6)]
    _, grid = spec_bench.measure_grid(engine, groups, [choice], None, repeats=2)
    (row,) = grid
    assert row["matches_plain"] and "PlainPolicy" in sides[-4:] and "FixedPolicy" in sides[-4:]


def test_round_ratios_pair_the_runs_of_one_round():
    """A ratio's spread pairs each side's run with the other side's run of the same round;
    a round that one side ran unclean (it compiled) pairs nothing."""

    def run(decode_s):
        return {"decode_tokens": 10, "decode_s": decode_s, "steps": 5}

    sd = {"rounds": {0: run(1.0), 2: run(2.0), 3: run(1.0)}}
    plain = {"rounds": {0: run(2.0), 1: run(9.0), 2: run(3.0), 3: run(4.0)}}
    assert bench.round_ratios(sd, plain, bench.decode_tokens_per_s) == [2.0, 1.5, 4.0]
    assert bench.round_ratios(sd, plain, bench.step_ms) == [0.5, 2.0 / 3.0, 0.25]
    row = bench.compare(dict(run(1.0), **sd, outputs=[], accept_len=None, sd_steps=0,
                             tokens_per_s=10.0, e2e_tokens_per_s=1.0, timed_runs=4,
                             clean_runs=3),
                        dict(run(2.0), **plain, outputs=[], tokens_per_s=5.0,
                             e2e_tokens_per_s=1.0))  # fmt: skip
    assert row["speedup_spread"] == {"median": 2.0, "mean": 2.5, "min": 1.5, "max": 4.0,
                                     "runs": [2.0, 1.5, 4.0]}  # fmt: skip
    with pytest.raises(ValueError, match="2 engines for 1 sides"):
        bench.run_points([object(), object()], [], [(None, None)], 1)


def test_eager_and_lazy_plain_steps_alternate_in_the_switch_cost(aligned, monkeypatch):
    """The eager-sync overhead is a ratio of two engines' plain steps: their runs interleave
    (all of one engine's, then all of the other's, would put a drift of the machine between
    the two sides), and the overhead comes with its spread over the rounds."""
    model, drafter = aligned
    prompts = random_prompts(2, model.config.vocab_size, seed=12)
    runs, timed = [], bench.timed_generate

    def spy(engine, requests):
        runs.append((engine.config.drafter_sync, type(engine.step_policy).__name__))
        return timed(engine, requests)

    monkeypatch.setattr(bench, "timed_generate", spy)
    choice = StepChoice(SpecStrategy(2, 2, 3), "eagle")

    def requests(count, new_tokens):
        return [Request(tuple(p), new_tokens) for p in prompts[:count]]

    kv_len = bench.kv_length(prompts, 2 + 1 + bench.WARM_TOKENS)
    out = spec_bench.measure_switch(model, drafter, requests, (1,), (2,), choice, None, kv_len,
                                    repeats=2, new_tokens=4)["1"]  # fmt: skip
    plain_runs = [sync for sync, policy in runs if policy == "PlainPolicy"]
    assert set(plain_runs) == {"lazy", "eager"}, runs
    first = {k: plain_runs.index(k) for k in ("lazy", "eager")}
    last = {k: len(plain_runs) - 1 - plain_runs[::-1].index(k) for k in first}
    assert first["eager"] < last["lazy"] and first["lazy"] < last["eager"], plain_runs
    spread = out["eager_overhead_spread"]
    assert spread is not None and len(spread["runs"]) >= 1
    assert spread["min"] <= spread["median"] <= spread["max"]
    assert out["eager_overhead"] == pytest.approx(
        out["eager_plain_step_ms"] / out["plain_step_ms"] - 1.0
    )


def test_step_breakdown_alternates_plain_and_sd_runs(aligned, monkeypatch):
    """The engine's side of `step_breakdown`: `engine_speedup` pairs neighbouring runs (all
    plain runs, then all SD runs, put a drift of the machine between the sides),
    `plain_step_median_ms` is a plain run's own median step (it read the engine's last
    timeline, which alternation can make an SD run's), and the programs that follow time the
    state an SD run left."""
    model, drafter = aligned
    prompt = random_prompts(1, model.config.vocab_size, seed=13)[0]
    timed_runs, generates = [], []
    timed, generate = bench.timed_generate, bench.RolloutEngine.generate

    def spy_timed(engine, requests):
        result = timed(engine, requests)
        timed_runs.append((type(engine.step_policy).__name__, result.get("median_step_ms")))
        return result

    def spy_generate(self, requests, **kwargs):
        generates.append(type(self.step_policy).__name__)
        return generate(self, requests, **kwargs)

    monkeypatch.setattr(bench, "timed_generate", spy_timed)
    monkeypatch.setattr(bench.RolloutEngine, "generate", spy_generate)
    choice = StepChoice(SpecStrategy(2, 2, 3), "eagle")
    engine, out = spec_bench.engine_steps(model, drafter, prompt, choice, None,
                                          bench.kv_length([prompt], 6), new_tokens=6)  # fmt: skip
    sides = [policy for policy, _ in timed_runs]
    first = {k: sides.index(k) for k in ("PlainPolicy", "FixedPolicy")}
    last = {k: len(sides) - 1 - sides[::-1].index(k) for k in first}
    assert first["FixedPolicy"] < last["PlainPolicy"] and first["PlainPolicy"] < last["FixedPolicy"]
    assert out["plain_step_median_ms"] in [ms for p, ms in timed_runs if p == "PlainPolicy"]
    # The programs run on SD's state (two rounds end on a plain run: one more SD run follows).
    assert generates[-1] == "FixedPolicy", (sides, generates)
    assert any(row[2] != "plain" for row in engine.stats.timeline)
    spread = out["engine_speedup_spread"]
    assert spread is not None and len(spread["runs"]) >= 1


def test_bench_fixed_ngram_runs_without_a_drafter(aligned):
    model, _ = aligned
    prompts = random_prompts(2, model.config.vocab_size, seed=8)
    config = spec_bench.SpecBenchConfig(**{**TINY, "batch_sizes": (2,)})
    assert config.source == "ngram"
    out = spec_bench.bench_fixed(model, None, prompts, config)
    assert out["draft"] == "ngram" and out["all_match_plain"] is True
    assert [r["source"] for r in out["grid"]] == ["ngram"] and out["hot_vocab"] is None
    assert out["switch_cost"] is None and out["step_breakdown_bs1"] is None
    assert out["grid"][0]["sd_steps"] > 0 and set(out["bs_sweep"]) == {"2"}


def test_bench_adaptive_keys_parity_and_every_arm_tried(aligned):
    model, drafter = aligned
    prompts = random_prompts(2, model.config.vocab_size, seed=9)
    bandit = spec_bench.adaptive_bandit(2, has_drafter=True)
    assert (bandit.threshold, bandit.warmup_steps) == (2, 0)
    assert bandit.sources == ("eagle", "ngram", "hybrid") and bandit.include_plain
    out = bench.bench_adaptive(model, drafter, prompts, bandit, batches=(1, 2), new_tokens=8,
                               repeats=2)  # fmt: skip
    assert out["all_match_plain"] is True and set(out["batches"]) == {"1", "2"}
    assert out["goal"] == 0.98 and out["goal_met"] == (out["min_adaptive_over_plain"] >= 0.98)
    for batch, row in out["batches"].items():
        assert len(row["plain_tokens_per_s"]["runs"]) == len(row["adaptive_tokens_per_s"]["runs"])
        assert row["adaptive_over_plain"] == pytest.approx(
            row["adaptive_tokens_per_s"]["median"] / row["plain_tokens_per_s"]["median"]
        )
        # Untried arms go first, so the warm-up runs tried plain and every (strategy, source).
        strategy = bandit.strategies[bandit.beg_bucket(int(batch))][0]
        want = {f"{batch}/plain"} | {f"{batch}/{s}:{strategy}" for s in bandit.sources}
        assert want <= set(row["median_rewards"]), row["median_rewards"]
        # At most 7 decode steps per timed run (8 tokens, the first from prefill), SD fewer.
        runs = len(row["plain_tokens_per_s"]["runs"])
        assert runs <= sum(row["arm_steps"].values()) <= 7 * runs
        assert 0.0 <= row["sd_step_share"] <= 1.0
    only_ngram = spec_bench.adaptive_bandit(2, has_drafter=True, source="ngram")
    assert only_ngram.sources == ("ngram",)


@pytest.mark.parametrize("kwargs, message", [
    (dict(draft="eagle"), "draft='eagle' needs drafter="),
    (dict(draft="medusa"), "draft='medusa' is not one of"),
    (dict(grid="2x9", topk=1), "grid='2x9' topk=1: no valid strategy"),
    (dict(grid="2;4"), "grid='2;4' must look like"),
    (dict(batch_sizes=(0, 2)), "batch_sizes=(0, 2) must be integers >= 1"),
    (dict(sweep_new_tokens=1), "sweep_new_tokens=1 must be >= 2"),
    (dict(full_vocab="some"), "full_vocab='some' is not one of"),
])  # fmt: skip
def test_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        spec_bench.SpecBenchConfig(**kwargs)


def test_generate_config_draft_source():
    from tlt_jax.rollout.generate import GenerateConfig

    assert GenerateConfig().source is None  # plain decoding
    assert GenerateConfig(drafter="eagle_dir").source == "eagle"
    assert GenerateConfig(draft="ngram").source == "ngram"  # model-free: no drafter needed
    assert GenerateConfig(drafter="eagle_dir", draft="hybrid").source == "hybrid"
    with pytest.raises(ValueError, match="draft='hybrid' needs drafter="):
        GenerateConfig(draft="hybrid")
    with pytest.raises(ValueError, match="draft='medusa' is not one of"):
        GenerateConfig(draft="medusa")
    # A context that cannot hold the new tokens is named before the model loads.
    with pytest.raises(ValueError, match=r"max_new_tokens=256 must be < max_seq_len=4 "):
        GenerateConfig(max_seq_len=4)


def test_generate_refuses_an_unwritable_output_before_loading_the_model(tmp_path, monkeypatch):
    """--output is written once every prompt is generated: a path that cannot take the file
    fails first (it used to fail after the whole run, losing every completion)."""
    from tlt_jax.data.tokenizer import ByteTokenizer
    from tlt_jax.models import checkpoints
    from tlt_jax.rollout import generate

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before --output was checked")

    monkeypatch.setattr(checkpoints, "load_tokenizer", lambda name: ByteTokenizer())
    monkeypatch.setattr(checkpoints, "load_model", no_model)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("")
    for output, message in [(tmp_path / "a_dir", "is a directory"),
                            (tmp_path / "a_file" / "out.jsonl", "cannot be written")]:  # fmt: skip
        config = generate.GenerateConfig(model="tiny", prompts=str(prompts), output=str(output))
        with pytest.raises(ValueError, match=f"--output='{output}' {message}"):
            generate.run(config)
    # A prompt too long for the context, or a drafter folder that is none, fails before the
    # model loads, and leaves no (empty) output file behind.
    output = tmp_path / "out" / "o.jsonl"
    config = generate.GenerateConfig(model="tiny", prompts=str(prompts), output=str(output),
                                     max_seq_len=8, max_new_tokens=4)  # fmt: skip
    with pytest.raises(
        ValueError, match=r"requests\[0\]: prompt length .* \+ max_new_tokens 4 = .* exceeds"
    ):
        generate.run(config)
    config = generate.GenerateConfig(model="tiny", prompts=str(prompts), output=str(output),
                                     draft="eagle", drafter=str(tmp_path / "a_dir"))  # fmt: skip
    with pytest.raises(FileNotFoundError, match="--drafter=.*a_dir' is not an HF-EAGLE export"):
        generate.run(config)
    assert not output.exists()


def test_output_flags_are_checked_when_parsed_not_after_the_run(tmp_path):
    """Every benchmark's --output_json (`files.register_output_checks`): a directory or a
    folder that cannot be made fails as the flags parse; a missing folder is made."""
    import subprocess
    import sys

    from rl_testing import REPO

    (tmp_path / "a_file").write_text("")
    for value, message in [(tmp_path, "is a directory"),
                           (tmp_path / "a_file" / "x.json", "cannot be written")]:  # fmt: skip
        proc = subprocess.run([sys.executable, "scripts/bench_rl_step.py", "--config",
                               "configs/tiny.py", f"--output_json={value}"], cwd=REPO,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode != 0 and f"--output_json='{value}' {message}" in proc.stderr
    from tlt_jax import files

    made = files.check_output_file(tmp_path / "new" / "x.json", "--output_json")
    assert made.parent.is_dir() and not made.exists()


def test_logit_parity_of_a_model_with_itself_and_in_bfloat16():
    import dataclasses

    from tlt_jax.models.presets import get_preset
    from tlt_jax.models.transformer import init_model

    config = get_preset("tiny")
    model = init_model(config, seed=3)
    tokens = list(np.random.default_rng(0).integers(0, config.vocab_size, 24))
    same = bench.logit_parity(model, model, tokens)
    assert same["argmax_agreement"] == 1.0 and same["max_logit_error"] == 0.0
    assert same["positions"] == 24 and same["max_abs_logit"] > 0
    half = init_model(dataclasses.replace(config, dtype="bfloat16", param_dtype="bfloat16"), 3)
    rounded = bench.logit_parity(model, half, tokens)
    # Same initial weights, rounded to 8 mantissa bits: close, not equal.
    assert 0 < rounded["max_logit_error"] < 0.1 * rounded["max_abs_logit"]
    assert rounded["argmax_agreement"] >= 0.5
