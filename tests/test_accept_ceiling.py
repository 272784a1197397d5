"""A perfect drafter's acceptance: the step walk by hand, ranks against a plain forward."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.models import presets
from tlt_jax.models.transformer import init_model
from tlt_jax.rl import accept_ceiling


@pytest.mark.parametrize(
    "hits, depth, want",
    [
        # A step accepts its run of hits (at most depth) and emits one more token.
        ([1, 1, 0, 1, 0, 0], 4, [3, 2, 1]),
        ([1, 1, 1, 1, 1, 1, 1], 2, [3, 3, 1]),
        ([0, 0, 0], 3, [1, 1, 1]),
        # At the end of a response a step emits what is left, with no bonus token after it.
        ([1, 1, 1], 5, [3]),
        ([0, 1, 1], 1, [1, 2]),
        ([], 2, []),
    ],
)
def test_walk_by_hand(hits, depth, want):
    assert accept_ceiling.walk([bool(h) for h in hits], depth) == want
    assert sum(want) == len(hits)


def test_walk_rejects_a_depth_below_one():
    with pytest.raises(ValueError, match="depth=0"):
        accept_ceiling.walk([True], 0)


def test_ceiling_by_hand():
    # Ranks of two responses (k = 2 means "not in the top 2").
    ranks = [np.array([0, 0, 1, 2]), np.array([1, 0])]
    out = accept_ceiling.ceiling(ranks, depths=(1, 2), widths=(1, 2))
    assert out["top1_share"] == pytest.approx(3 / 6)
    assert out["top2_share"] == pytest.approx(5 / 6)
    # Chains: response 1 hits [1, 1, 0, 0], response 2 [0, 1].
    assert out["top1_depth1"]["accept_len"] == pytest.approx(6 / 5)  # [2, 1, 1] and [1, 1]
    assert out["top1_depth2"]["accept_len"] == pytest.approx(6 / 4)  # [3, 1] and [1, 1]
    # Width 2: [1, 1, 1, 0] and [1, 1].
    assert out["top2_depth1"]["accept_len"] == pytest.approx(6 / 3)  # [2, 2] and [2]
    assert out["top2_depth2"]["accept_len"] == pytest.approx(6 / 3)  # [3, 1] and [2]
    assert out["top2_depth2"]["verify_steps"] == 3


def test_sample_ranks_match_a_plain_forward():
    model = init_model(presets.get_preset("tiny"), seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 9, 3)]
    responses = [rng.integers(3, 256, n).tolist() for n in (7, 2, 12)]
    # The first response is the greedy one: rank 0 everywhere.
    tokens = list(prompts[0])
    for _ in range(7):
        features, _ = model(jnp.asarray([tokens]), jnp.arange(len(tokens))[None])
        tokens.append(int(jnp.argmax(model.logits(features)[0, -1])))
    responses[0] = tokens[len(prompts[0]) :]
    k = 4
    ranks = accept_ceiling.sample_ranks(model, prompts, responses, k=k, batch_size=2)
    assert ranks[0].tolist() == [0] * 7
    for p, r, got in zip(prompts, responses, ranks, strict=True):
        seq = p + r
        features, _ = model(jnp.asarray([seq]), jnp.arange(len(seq))[None])
        logits = np.asarray(model.logits(features)[0])
        want = []
        for j, token in enumerate(r):
            order = np.argsort(-logits[len(p) + j - 1], kind="stable")  # lower id first on ties
            rank = int(np.flatnonzero(order == token)[0])
            want.append(min(rank, k))
        assert got.tolist() == want


def test_sample_ranks_bad_input():
    model = init_model(presets.get_preset("tiny"), seed=3)
    with pytest.raises(ValueError, match="2 prompts for 1 responses"):
        accept_ceiling.sample_ranks(model, [[1], [2]], [[3]], k=2)
    with pytest.raises(ValueError, match="responses \\[0\\] are empty"):
        accept_ceiling.sample_ranks(model, [[1]], [[]], k=2)
    with pytest.raises(ValueError, match="k=0"):
        accept_ceiling.sample_ranks(model, [[1]], [[3]], k=0)


def test_measure_reports_all_responses_and_the_longest_quarter():
    model = init_model(presets.get_preset("tiny"), seed=3)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, 4).tolist() for _ in range(8)]
    responses = [rng.integers(3, 256, n).tolist() for n in (2, 3, 4, 5, 6, 7, 8, 20)]
    out = accept_ceiling.measure(model, prompts, responses, depths=(1, 3), widths=(1, 4))
    ranks = accept_ceiling.sample_ranks(model, prompts, responses, k=4)
    assert out["responses"] == 8 and out["response_tokens"] == 55
    assert out["all"] == accept_ceiling.ceiling(ranks, (1, 3), (1, 4))
    quarter = out["longest_quarter"]  # lengths >= the 75th percentile (7.25): 8 and 20
    assert quarter["responses"] == 2 and quarter["response_len_mean"] == 14.0
    assert quarter["top4_depth3"] == accept_ceiling.ceiling(ranks[-2:], (3,), (4,))["top4_depth3"]


def test_read_responses_reads_a_warmup_cache_and_names_bad_input(tmp_path):
    import json

    from tlt_jax.drafter.warmup import read_responses

    good = tmp_path / "responses.jsonl"
    rows = [{"prompt_ids": [1, 2], "response_ids": [3], "max_new_tokens": 8},
            {"prompt_ids": [4], "response_ids": [5, 6], "max_new_tokens": 8}]  # fmt: skip
    good.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert read_responses(good) == ([[1, 2], [4]], [[3], [5, 6]])
    with pytest.raises(ValueError, match="responses='/nowhere.jsonl' must be"):
        read_responses("/nowhere.jsonl")
    bad = tmp_path / "prompts.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"prompt": "What is 3 + 4?"}) + "\n")
    with pytest.raises(ValueError, match=r"records \[1\] of 2 lack prompt_ids / response_ids"):
        read_responses(bad)
