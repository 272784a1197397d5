"""TLT's adaptive rollout through the engine: lossless with EAGLE, n-gram and hybrid trees.

(a) greedy rollouts with the adaptive step policy equal plain rollouts token for token (tiny
model here; SmolLM2 in the slow test); (b) sampled n-gram and hybrid SD match the target's exact
next-token and 3-token probabilities (chi-square), with top-p too; (c) SD steps report the
logprobs plain decoding would: log_softmax(logits / T) at the emitted token, checked against a
full forward of the finished sequences.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from test_speculative import (
    ALIGNED,
    KV_LEN,
    aligned_pair,
    chi_square_pvalue,
    exact_sequence_probs,
    random_prompts,
)

from tlt_jax.models.drafter import init_drafter
from tlt_jax.rollout import acceptance, speculative
from tlt_jax.rollout.adaptive import AdaptivePolicy, BanditConfig, FixedPolicy, StepChoice
from tlt_jax.rollout.engine import EngineConfig, Request, RolloutEngine
from tlt_jax.rollout.sampling import SamplingParams

SOURCES = ("eagle", "ngram", "hybrid")


def _engine(model, drafter=None, batch=8, policy=None, kv_len=KV_LEN, min_kv_bucket=None):
    config = EngineConfig(max_batch_size=batch, max_prefill_batch=batch, max_seq_len=kv_len,
                          min_kv_bucket=min_kv_bucket or kv_len)  # fmt: skip
    return RolloutEngine(model, config, drafter=drafter, step_policy=policy)


GREEDY = SamplingParams()


def _long_tail_requests(prompts, sampling=GREEDY, seed=0):
    """A long tail: most requests stop early, two run to 40 tokens."""
    lengths = [6, 8, 10, 12, 14, 16, 40, 40]
    return [Request(p, n, sampling, seed=seed + i) for i, (p, n) in
            enumerate(zip(prompts, lengths, strict=True))]  # fmt: skip


@pytest.fixture(scope="module")
def pair():
    return aligned_pair(**ALIGNED)


def _tail_policy(include_plain: bool) -> AdaptivePolicy:
    """SD at <= 4 running after 2 steps there, every source, one to two strategies a bucket."""
    return AdaptivePolicy(BanditConfig(
        threshold=4, warmup_steps=2, bucket_bounds=(1, 2, 3),
        strategies=(("3,2,6", "5,1,6"), ("3,1,4",), ("2,1,3",)), sources=SOURCES,
        include_plain=include_plain, seed=0, epsilon=0.3,
    ))  # fmt: skip


@pytest.mark.parametrize("include_plain", [False, True], ids=["sd_only", "with_plain"])
def test_adaptive_greedy_rollout_equals_plain(pair, include_plain):
    model, drafter = pair
    # GRPO-like groups: 4 prompts, 2 samples each (siblings feed the n-gram index).
    prompts = [p for p in random_prompts(4, model.config.vocab_size, seed=5) for _ in range(2)]
    want = _engine(model, drafter).generate(_long_tail_requests(prompts))
    policy = _tail_policy(include_plain)
    # Cache buckets of 16, 32 and 64 positions: the SD programs of one batch bucket and
    # strategy meet several cache lengths as the requests grow.
    engine = _engine(model, drafter, policy=policy, min_kv_bucket=16)
    for _ in range(2):  # the second rollout also drafts from the first one's responses
        got = engine.generate(_long_tail_requests(prompts))
        for w, g in zip(want, got, strict=True):
            assert g.token_ids == w.token_ids
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)
    stats = engine.stats
    assert stats.spec_steps > 0 and stats.decode_steps > 0
    # SD only in the tail: never with more than 4 running.
    arms = [(row[1], row[2]) for row in stats.timeline]
    assert all(n <= 4 for n, arm in arms if arm != "plain")
    if not include_plain:
        assert set(stats.spec_rows_by_source) == set(SOURCES)
        for source in SOURCES:  # tokens per row-step >= 1 (the correction / bonus token)
            assert stats.spec_tokens_by_source[source] >= stats.spec_rows_by_source[source]
        assert stats.spec_tokens_by_source["eagle"] > 1.3 * stats.spec_rows_by_source["eagle"]


def test_ngram_drafts_need_no_drafter_and_accept_on_repetitive_text(pair):
    model, _ = pair
    # A random tiny model falls into loops quickly: suffix matches then pay.
    prompts = random_prompts(8, model.config.vocab_size, seed=9)
    requests = [Request(p, 40) for p in prompts]
    want = _engine(model).generate(requests)
    engine = _engine(model, policy=FixedPolicy(StepChoice("4,1,5", "ngram")))
    got = engine.generate(requests)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert engine.state.draft is None and engine.stats.spec_steps > 0
    accept = engine.stats.spec_tokens_by_source["ngram"] / engine.stats.spec_rows_by_source["ngram"]
    assert accept > 1.5, accept
    with pytest.raises(ValueError, match="needs a drafter"):
        engine.step_policy = FixedPolicy(StepChoice("4,1,5", "hybrid"))


def test_greedy_rows_verified_beside_sampled_ones_equal_plain_greedy(pair):
    """A batch that mixes greedy and sampled requests verifies them in one program (the
    sampling path, `greedy_only` off): the greedy rows still emit plain greedy decoding's
    tokens and log-probs, whatever their sampled neighbours drew (and fed the n-gram index)."""
    model, drafter = pair
    prompts = [p for p in random_prompts(4, model.config.vocab_size, seed=5) for _ in range(2)]
    want = _engine(model, drafter).generate(_long_tail_requests(prompts))
    requests = [r if i % 2 == 0 else dataclasses.replace(r, sampling=SamplingParams(1.0))
                for i, r in enumerate(_long_tail_requests(prompts))]  # fmt: skip
    policy = _tail_policy(include_plain=False)
    engine = _engine(model, drafter, policy=policy, min_kv_bucket=16)
    got = engine.generate(requests)
    assert engine.stats.spec_steps > 0
    mixed = [row for row in engine.stats.timeline if row[2] != "plain" and row[1] > 1]
    assert mixed, "no SD step verified several rows"
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        if i % 2 == 0:
            assert g.token_ids == w.token_ids
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)
    assert any(g.token_ids != w.token_ids for w, g in zip(want[1::2], got[1::2], strict=True))


@pytest.fixture(scope="module")
def small_vocab():
    model, drafter = aligned_pair(vocab=12, logit_scale=8.0, **ALIGNED)
    return model, drafter


ROWS = 2048
# The second with both filters (tests/test_speculative.py covers top-p alone): top-k binds
# where the nucleus holds more than 3 tokens.
SETTINGS = {"t1": SamplingParams(temperature=1.0),
            "t07k3p09": SamplingParams(0.7, top_p=0.9, top_k=3)}  # fmt: skip


def _sampled_sd_pvalues(model, drafter, source, sampling):
    """ROWS samples of 3 tokens after a repetitive prompt, each request a GRPO sibling of the
    others (the n-gram index drafts from the prompt and the siblings' responses). Returns the
    chi-square p-values (next token, 3 tokens) against the exact probabilities, conditioned on
    each of the two most frequent prefill tokens, and the engine's stats."""
    prompt = (3, 7, 1, 10, 3, 7, 1, 10, 3)
    requests = [Request(prompt, 4, sampling, seed=1000 + i) for i in range(ROWS)]
    engine = _engine(model, drafter, batch=64, kv_len=32,
                     policy=FixedPolicy(StepChoice("3,3,8", source)))  # fmt: skip
    done = engine.generate(requests)
    # The first token comes from prefill (plain sampling); the next three from SD steps.
    first = np.array([c.token_ids[0] for c in done])
    samples = np.array([c.token_ids[1:4] for c in done])
    vocab = model.config.vocab_size
    counts = np.bincount(first, minlength=vocab)
    # The two most frequent prefill tokens: the two smallest ids had under 300 rows each at
    # temperature 1, so nothing was checked there.
    pvalues = []
    for token in np.argsort(-counts, kind="stable")[:2]:
        rows = samples[first == token]
        assert len(rows) >= 300, counts
        probs = exact_sequence_probs(model, np.array(prompt + (int(token),)), sampling)
        p_first, _ = chi_square_pvalue(np.bincount(rows[:, 0], minlength=vocab),
                                       probs.sum((1, 2)))  # fmt: skip
        p_seq, _ = chi_square_pvalue(
            np.bincount(np.ravel_multi_index(rows.T, (vocab,) * 3), minlength=vocab**3), probs
        )
        pvalues += [p_first, p_seq]
    return pvalues, engine.stats


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("source", ["ngram", "hybrid"])
def test_sampled_ngram_and_hybrid_sd_match_the_target_distribution(small_vocab, source,
                                                                    setting):  # fmt: skip
    model, drafter = small_vocab
    pvalues, stats = _sampled_sd_pvalues(model, drafter, source, SETTINGS[setting])
    assert min(pvalues) > 1e-4, pvalues
    assert stats.spec_tokens_by_source[source] > 1.2 * stats.spec_rows_by_source[source]


def test_the_sampled_check_fails_a_residual_keeping_the_tried_children(small_vocab, monkeypatch):
    """The negative case: the same check at temperature 1 fails the wrong residual."""

    def buggy(*args, **kwargs):
        return acceptance.accept_tree(*args, **{**kwargs, "residual": "buggy_no_removal"})

    monkeypatch.setattr(speculative, "accept_tree", buggy)
    pvalues, _ = _sampled_sd_pvalues(*small_vocab, "ngram", SETTINGS["t1"])
    assert min(pvalues) < 1e-6, pvalues


def test_sd_logprobs_are_the_plain_logprobs_of_the_emitted_tokens(pair):
    model, drafter = pair
    sampling = SamplingParams(temperature=0.8, top_p=0.95)
    prompts = [p for p in random_prompts(4, model.config.vocab_size, seed=13) for _ in range(2)]
    policy = FixedPolicy(StepChoice("3,2,6", "hybrid"))
    done = _engine(model, drafter, policy=policy).generate(
        _long_tail_requests(prompts, sampling, seed=7)
    )
    assert any(len(c.accepted_lengths) for c in done)
    # One causal forward over the right-padded sequences (padding never reaches earlier rows).
    rows = [c.prompt_ids + tuple(c.token_ids) for c in done]
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    logprobs = jax.jit(lambda t, p: jax.nn.log_softmax(
        model.logits(model(t, p)[0]) / sampling.temperature, -1))(tokens, positions)  # fmt: skip
    for i, c in enumerate(done):
        start = len(c.prompt_ids) - 1
        want = logprobs[i, np.arange(start, start + len(c.token_ids)), np.array(c.token_ids)]
        np.testing.assert_allclose(c.logprobs, want, atol=2e-4)


@pytest.mark.slow
def test_smollm2_adaptive_greedy_equals_plain():
    """Real SmolLM2 (random-init drafter: lossless whatever it drafts), all three sources."""
    from tlt_jax.data.tokenizer import PromptEncoder, stop_token_ids
    from tlt_jax.models import checkpoints

    name = "smollm2-135m-instruct"
    model = checkpoints.load_model(name)
    tokenizer = checkpoints.load_tokenizer(name)
    encode = PromptEncoder(tokenizer)
    questions = ["What is 3 + 4 + 5? Think step by step.", "Count from 1 to 8."]
    prompts = [encode(q) for q in questions for _ in range(2)]
    stops = stop_token_ids(tokenizer)
    requests = [Request(p, n, stop_ids=stops) for p, n in zip(prompts, (8, 12, 20, 28),
                                                                strict=True)]  # fmt: skip
    drafter = init_drafter(model.config, 0)
    want = _engine(model, drafter, batch=4, kv_len=256).generate(requests)
    policy = AdaptivePolicy(BanditConfig(
        threshold=2, warmup_steps=1, bucket_bounds=(1, 2), strategies=(("3,2,6",), ("2,1,3",)),
        sources=SOURCES, include_plain=False))  # fmt: skip
    engine = _engine(model, drafter, batch=4, kv_len=256, policy=policy)
    got = engine.generate(requests)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert set(engine.stats.spec_rows_by_source) == set(SOURCES)
