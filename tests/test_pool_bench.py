"""The executable-pool benchmark: which SD programs each pool holds, counted by hand.

Plans of the `spec` group's and TLT's paper buckets (no compiling), then the tiny preset's three
pools compiled by real engines: program counts by kind, the bucketed pool's verify programs =
the (batch bucket, verify budget) pairs the bandit can use, naive >= bucketed, and draft sources
that add no programs.
"""

from __future__ import annotations

import ast

import pytest

from tlt_jax.rollout import pool_bench
from tlt_jax.rollout.adaptive import AdaptivePolicy, BanditConfig
from tlt_jax.rollout.engine import bucket_for

BUCKETS_32 = (1, 2, 4, 8, 16, 32)


def _strategies(plan) -> dict[int, set[str]]:
    """Batch bucket -> the SD strategies a plan runs there (plain steps left out)."""
    out: dict[int, set[str]] = {}
    for n, choice in plan:
        out.setdefault(bucket_for(n, BUCKETS_32), set())
        if choice is not None:
            out[bucket_for(n, BUCKETS_32)].add(str(choice.strategy))
    return out


def test_plans_of_the_spec_defaults_by_hand():
    # Bounds 1, 2, 5, 9: bucket 2 holds batches 5-8, bucket 3 from 9 on.
    bandit = BanditConfig(threshold=32, **pool_bench.spec_default_bandit())
    plans = pool_bench.pool_plans(bandit, BUCKETS_32)
    assert _strategies(plans["bucketed"]) == {
        1: {"4,1,5"},
        2: {"3,1,4"},
        4: {"3,1,4"},
        8: {"2,1,3"},
        16: {"1,1,2"},
        32: {"1,1,2"},
    }
    everything = {"4,1,5", "3,1,4", "2,1,3", "1,1,2"}
    assert _strategies(plans["naive"]) == {b: everything for b in BUCKETS_32}
    assert _strategies(plans["single"]) == {b: {"4,1,5"} for b in BUCKETS_32}
    # One plain step per batch bucket in every pool.
    for plan in plans.values():
        assert [n for n, c in plan if c is None] == list(BUCKETS_32)


def test_plans_of_the_paper_buckets_by_hand():
    # Bounds 1, 2, 5, 21: batches 3-4 in bucket 1, 5-16 in bucket 2, 32 in bucket 3.
    bandit = BanditConfig(threshold=32, sources=("eagle", "hybrid"), **pool_bench.PAPER_BANDIT)
    plans = pool_bench.pool_plans(bandit, BUCKETS_32)
    assert _strategies(plans["bucketed"]) == {
        1: {"8,4,48"},
        2: {"8,4,32"},
        4: {"8,4,32"},
        8: {"8,4,16"},
        16: {"8,4,16"},
        32: {"8,4,8"},
    }
    # Every source of the bucket's strategy: 6 buckets x 1 strategy x 2 sources.
    assert sum(c is not None for _, c in plans["bucketed"]) == 12
    assert sum(c is not None for _, c in plans["naive"]) == 6 * 4 * 2


def test_plans_stop_at_the_threshold():
    bandit = BanditConfig(threshold=3, **pool_bench.spec_default_bandit())
    plans = pool_bench.pool_plans(bandit, BUCKETS_32)
    # SD runs at most 3 requests: bucket 4 runs at n = 3, buckets 8-32 never.
    assert sorted({n for n, _ in plans["bucketed"]}) == [1, 2, 3]
    assert _strategies(plans["bucketed"]) == {1: {"4,1,5"}, 2: {"3,1,4"}, 4: {"3,1,4"}}


@pytest.fixture(scope="module")
def tiny():
    # Every source: n-gram and hybrid trees reuse the EAGLE programs, so the counts stay.
    # Pools share what an earlier one compiled: the counts and memory are the same.
    return pool_bench.run(
        pool_bench.PoolBenchConfig.tiny(sources=("eagle", "ngram", "hybrid"), share_compiles=True)
    )


def test_tiny_pool_counts_by_hand(tiny):
    # single 3,2,6 at batch buckets 1, 2: a draft, a tree and a verify each.
    # bucketed: batch 1 runs 3,2,6 and 5,1,6 (two drafts, two trees, one verify of 6 tokens),
    #   batch 2 runs 3,2,4 (one of each).
    # naive: each batch runs all three: drafts (topk 2, depth 3) and (1, 5), as 3,2,4 shares
    #   3,2,6's; three trees; verifies of 6 and 4 tokens.
    # Every verify key has its commit program (the accepted path into the cache).
    want = {"single": (2, 2, 2), "bucketed": (3, 3, 2), "naive": (4, 6, 4)}
    for name, (drafts, trees, verifies) in want.items():
        sd = tiny["pools"][name]["sd"]
        assert sd["by_kind"] == {
            "spec_draft": drafts,
            "spec_tree": trees,
            "spec_verify": verifies,
            "spec_commit": verifies,
        }, name
        assert sd["programs"] == drafts + trees + 2 * verifies
    assert tiny["ratios"]["naive/bucketed:programs"] == pytest.approx(18 / 10, abs=1e-3)


def test_tiny_bucketed_verifies_are_the_pairs_the_bandit_uses(tiny):
    bandit = pool_bench.PoolBenchConfig.tiny().bandit()
    policy = AdaptivePolicy(bandit)
    usable = {(bucket_for(n, tiny["batch_buckets"]), arm.strategy.verify_tokens)
              for n in range(1, bandit.threshold + 1) for arm in policy.arms_for(n)
              if arm is not None}  # fmt: skip
    keys = [ast.literal_eval(k) for k in tiny["pools"]["bucketed"]["keys"]]
    verifies = {(k[1], k[2]) for k in keys if k[0] == "spec_verify"}
    assert verifies == usable == {(1, 6), (2, 4)}
    # Sampled requests (greedy=False), one kv bucket, engines with a drafter, no top-k/top-p.
    assert {k[3:7] for k in keys if k[0] == "spec_verify"} == {(64, False, True, False)}
    # Drafts use the 32-token hot vocabulary; every key ends with what the programs are made of.
    assert {k[5] for k in keys if k[0] == "spec_draft"} == {32}
    assert len({next(e for e in k if str(e).startswith("model:")) for k in keys}) == 1


def test_tiny_naive_holds_more_than_bucketed(tiny):
    pools = tiny["pools"]
    naive, bucketed = pools["naive"]["sd"], pools["bucketed"]["sd"]
    assert set(pools["bucketed"]["keys"]) < set(pools["naive"]["keys"])
    assert naive["temp_bytes"] > bucketed["temp_bytes"] > 0
    assert naive["executable_bytes"] > bucketed["executable_bytes"]
    assert naive["argument_bytes"] > bucketed["argument_bytes"]
    # The plain programs (decode, prefill, slot moves) are the same in every pool.
    base = [pools[name]["base_by_kind"] for name in pool_bench.POOLS]
    assert base[0] == base[1] == base[2] and base[0]["decode"] == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"preset": "big"}, "preset='big'"),
        ({"strategy_set": "tlt"}, "strategy_set='tlt'"),
        ({"sources": ("medusa",)}, "sources=('medusa',)"),
        ({"kv_len": 8}, "kv_len=8"),
        ({"single": "8,4"}, "'8,4'"),
    ],
)
def test_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pool_bench.PoolBenchConfig(**kwargs)
