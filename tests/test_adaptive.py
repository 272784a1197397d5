"""TLT's step policy: SD on/off in the tail, BEG-MAB arm choice, determinism, checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tlt_jax.rl.config import SpecConfig
from tlt_jax.rollout.adaptive import (
    MIN_SAMPLES_TO_CLOSE,
    AdaptivePolicy,
    BanditConfig,
    FixedPolicy,
    ScheduledPolicy,
    StepChoice,
    engine_bucket,
)
from tlt_jax.rollout.speculative import SpecStrategy

BOUNDS = (1, 2, 5)
STRATEGIES = (("4,1,5", "2,2,5"), ("3,1,4",), ("1,1,2",))


def _config(**kw) -> BanditConfig:
    base = dict(threshold=8, warmup_steps=3, bucket_bounds=BOUNDS, strategies=STRATEGIES,
                sources=("ngram",), epsilon=0.1, window=5, seed=0)  # fmt: skip
    return BanditConfig(**{**base, **kw})


def test_sd_turns_on_after_n_steps_under_threshold_and_off_when_the_batch_grows():
    policy = AdaptivePolicy(_config(epsilon=0.0))
    policy.begin()
    # Above the threshold: plain; the counter starts only at <= 8 running.
    assert [policy.choose(n) for n in (20, 9)] == [None, None]
    # 3 plain steps at <= 8, then SD (the first untried arm of bucket [5, ...): 1,1,2).
    got = [policy.choose(n) for n in (8, 8, 8, 8)]
    assert got[:3] == [None] * 3 and policy.sd_on
    # Untried arms first, in order: plain (index 0) is an arm too.
    assert got[3] is None
    policy.record(None, 8, 8, 0.1)
    assert policy.choose(8) == StepChoice(SpecStrategy(1, 1, 2), "ngram")
    # New requests admitted: off again, and the warm-up counter restarts.
    assert policy.choose(9) is None and not policy.sd_on
    assert [policy.choose(3) for _ in range(3)] == [None] * 3
    assert policy.choose(3) is None and policy.sd_on  # untried plain at engine bucket 4
    policy.begin()
    assert not policy.sd_on


def test_arms_per_bucket_follow_the_engine_batch_bucket():
    policy = AdaptivePolicy(_config())
    # Batch 1 -> BEG bucket [1, 2): two strategies of verify 5; 3 and 4 pad to engine bucket
    # 4 -> [2, 5); 5..8 pad to 8 -> [5, ...).
    assert [str(a) for a in policy.arms_for(1)] == ["None", "ngram:4,1,5", "ngram:2,2,5"]
    assert [str(a) for a in policy.arms_for(3)] == ["None", "ngram:3,1,4"]
    assert [str(a) for a in policy.arms_for(6)] == ["None", "ngram:1,1,2"]
    assert [engine_bucket(n) for n in (1, 2, 3, 5, 9)] == [1, 2, 4, 8, 16]
    with_eagle = AdaptivePolicy(_config(sources=("eagle", "ngram", "hybrid"), include_plain=False))
    assert [str(a) for a in with_eagle.arms_for(2)] == ["eagle:3,1,4", "ngram:3,1,4",
                                                       "hybrid:3,1,4"]  # fmt: skip


def _run(policy, speed: dict, steps: int, n: int = 1, rng_seed: int = 1):
    """Drives the policy at batch n; arm -> tokens per second (with noise)."""
    rng = np.random.default_rng(rng_seed)
    policy.begin()
    chosen = []
    for _ in range(steps):
        choice = policy.choose(n)
        name = "plain" if choice is None else str(choice)
        chosen.append(name)
        tokens_per_s = speed[name] * (1 + 0.05 * rng.standard_normal())
        emitted = n if choice is None else 2 * n
        policy.record(choice, n, emitted, emitted / tokens_per_s)
    return chosen


def test_bandit_falls_back_to_plain_where_sd_is_slower_and_takes_sd_where_it_pays():
    cfg = _config(warmup_steps=0, window=50, epsilon_decay=False)
    # SD slower than plain (a cold drafter): after trying each arm, plain wins ~90%.
    slow = {"plain": 30.0, "ngram:4,1,5": 20.0, "ngram:2,2,5": 22.0}
    chosen = _run(AdaptivePolicy(cfg), slow, 400)
    assert chosen[:3] == ["plain", "ngram:4,1,5", "ngram:2,2,5"]
    # Both SD arms are dominated (best reward < plain's median): once each holds
    # MIN_SAMPLES_TO_CLOSE rewards it is retried once per window (50 steps) at most, so plain
    # runs > 95% of the steps.
    for arm in ("ngram:4,1,5", "ngram:2,2,5"):
        assert 1 <= chosen[3:].count(arm) <= MIN_SAMPLES_TO_CLOSE - 1 + 400 // 50
    assert chosen[3:].count("plain") / 397 > 0.95
    fast = {"plain": 30.0, "ngram:4,1,5": 50.0, "ngram:2,2,5": 40.0}
    chosen = _run(AdaptivePolicy(cfg), fast, 400)
    # The two others are dominated now: each runs again once a window has passed and an
    # exploring step (0.1) picks it among the two open arms, about every 50 + 20 steps.
    for arm in ("plain", "ngram:2,2,5"):
        assert 1 <= chosen[3:].count(arm) <= MIN_SAMPLES_TO_CLOSE - 1 + 400 // 50
    assert 0.95 < chosen[3:].count("ngram:4,1,5") / 397 < 0.995


def test_may_speculate_says_exactly_what_choose_will_do():
    # The engine reads a plain step in flight before choosing only when `may_speculate` is
    # true, and dispatches the next plain step ahead of that read otherwise: in SD mode too,
    # wherever the bandit's choice is plain (exploration draws included).
    rng = np.random.default_rng(0)
    speed = {"plain": 30.0, "ngram:4,1,5": 33.0, "ngram:2,2,5": 29.0, "ngram:3,1,4": 28.0,
             "ngram:1,1,2": 31.0}  # fmt: skip
    policy = AdaptivePolicy(_config(epsilon=0.5, epsilon_decay=False))
    policy.begin()
    plain_in_sd_mode = 0
    for _ in range(2000):
        n = int(rng.choice([1, 2, 3, 6, 8, 12]))
        predicted = policy.may_speculate(n)
        assert predicted == policy.may_speculate(n)  # no side effects
        choice = policy.choose(n)
        assert predicted == (choice is not None)
        plain_in_sd_mode += choice is None and policy.sd_on
        policy.record(choice, n, n, n / (speed[str(choice) if choice else "plain"]
                                         * (1 + 0.1 * rng.random())))  # fmt: skip
    assert plain_in_sd_mode > 100


def test_bandit_is_deterministic_and_its_state_round_trips_through_json():
    cfg = _config(warmup_steps=0)
    speed = {"plain": 30.0, "ngram:4,1,5": 31.0, "ngram:2,2,5": 29.0}
    a, b = AdaptivePolicy(cfg), AdaptivePolicy(cfg)
    assert _run(a, speed, 200) == _run(b, speed, 200)
    other = AdaptivePolicy(_config(warmup_steps=0, seed=1))
    assert _run(other, speed, 200) != _run(AdaptivePolicy(cfg), speed, 200)
    # Checkpoint in the middle: a restored policy continues exactly like the original.
    first, resumed = AdaptivePolicy(cfg), AdaptivePolicy(cfg)
    _run(first, speed, 50)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert resumed.median_rewards() == first.median_rewards()
    assert _run(first, speed, 100, rng_seed=7) == _run(resumed, speed, 100, rng_seed=7)


def test_a_dominated_arm_that_gets_faster_is_found_again():
    cfg = _config(warmup_steps=0, window=50, epsilon_decay=False)
    policy = AdaptivePolicy(cfg)
    _run(policy, {"plain": 30.0, "ngram:4,1,5": 20.0, "ngram:2,2,5": 10.0}, 300)
    # The drafter improved: 4,1,5 now doubles plain's throughput.
    later = _run(policy, {"plain": 30.0, "ngram:4,1,5": 60.0, "ngram:2,2,5": 10.0}, 1500,
                 rng_seed=2)  # fmt: skip
    assert later[-500:].count("ngram:4,1,5") / 500 > 0.85


def test_a_drafter_arm_closed_while_the_drafter_was_weak_returns_at_its_next_version():
    """A cold-start drafter during RL: its arms lose to plain for five RL steps (~150 SD
    steps each) and close; then a version doubles plain's speed. Told of each new version
    (`drafter_changed`, at the step boundary), the bandit drops the drafter arms' rewards
    older than the last version and retries them at once; with the default window (300) and
    epsilon decay, the old rewards kept the better arm out of the next RL steps. The n-gram
    arm's rewards do not depend on the drafter and stay."""
    cfg = _config(warmup_steps=0, window=300, sources=("eagle", "ngram"))
    weak = {"plain": 30.0, "eagle:4,1,5": 20.0, "eagle:2,2,5": 18.0, "ngram:4,1,5": 25.0,
            "ngram:2,2,5": 24.0}  # fmt: skip
    strong = {**weak, "eagle:4,1,5": 60.0, "eagle:2,2,5": 50.0}
    told, untold = AdaptivePolicy(cfg), AdaptivePolicy(cfg)
    eagle = {"eagle:4,1,5", "eagle:2,2,5"}
    told_runs = []
    for step in range(5):
        last = {name: _run(policy, weak, 150, rng_seed=step)
                for name, policy in (("told", told), ("untold", untold))}  # fmt: skip
        told_runs.append(last["told"])
        if step:  # a drafter arm that did not run under the last version runs under this one
            assert eagle <= set(told_runs[-2]) | set(told_runs[-1][:2])
        others = {k: list(w) for k, w in told._rewards.items() if k[1] not in eagle}
        told.drafter_changed()
    # The drafter arms' windows hold the last version's rewards only; the others keep theirs.
    for arm in eagle:
        assert 1 <= len(told._rewards[(1, arm)]) == last["told"].count(arm) < 5
        assert len(untold._rewards[(1, arm)]) > last["untold"].count(arm)
    assert {k: list(w) for k, w in told._rewards.items() if k[1] not in eagle} == others
    # The first RL step of the better drafter: the told bandit runs it; the other one's window
    # of weak rewards keeps it behind plain (it catches up a step or more later).
    after = {name: _run(policy, strong, 150, rng_seed=10)
             for name, policy in (("told", told), ("untold", untold))}  # fmt: skip
    assert after["told"].count("eagle:4,1,5") / 150 > 0.85
    assert after["untold"].count("eagle:4,1,5") / 150 < 0.1


def test_a_new_drafter_version_keeps_only_the_last_versions_rewards_also_after_a_resume():
    cfg = _config(warmup_steps=0, window=300, sources=("eagle",), epsilon=1.0,
                  epsilon_decay=False)  # fmt: skip
    policy = AdaptivePolicy(cfg)
    speed = {"plain": 30.0, "eagle:4,1,5": 40.0, "eagle:2,2,5": 35.0}
    _run(policy, speed, 60)
    policy.drafter_changed()
    counts = {k: len(w) for k, w in policy._rewards.items()}
    chosen = _run(policy, speed, 40, rng_seed=3)
    resumed = AdaptivePolicy(cfg)
    resumed.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    for p in (policy, resumed):
        p.drafter_changed()
    # Each drafter arm keeps exactly its rewards of the last 40 steps; plain keeps all.
    for arm in ("eagle:4,1,5", "eagle:2,2,5"):
        assert len(policy._rewards.get((1, arm), ())) == chosen.count(arm)
    assert len(policy._rewards[(1, "plain")]) == counts[(1, "plain")] + chosen.count("plain")
    assert resumed.median_rewards() == policy.median_rewards()
    assert _run(resumed, speed, 50, rng_seed=4) == _run(policy, speed, 50, rng_seed=4)
    # A state saved before the hook (no "fresh"): its windows are kept whole at the next
    # version, not dropped as rewards of no version.
    old = {k: v for k, v in policy.state_dict().items() if k != "fresh"}
    legacy = AdaptivePolicy(cfg)
    legacy.load_state_dict(json.loads(json.dumps(old)))
    before = legacy.median_rewards()
    legacy.drafter_changed()
    assert legacy.median_rewards() == before and any("eagle" in k for k in before)


def test_epsilon_decays_per_bucket_and_survives_checkpoints():
    cfg = _config(warmup_steps=0, window=50)
    slow = {"plain": 30.0, "ngram:4,1,5": 20.0, "ngram:2,2,5": 22.0}
    policy = AdaptivePolicy(cfg)
    chosen = _run(policy, slow, 2000)
    # epsilon / sqrt(1 + n / 50): 0.1 at first, 0.016 after 2,000 steps; explore 2/3 of it.
    assert policy.epsilon_at(1) == pytest.approx(0.1 / np.sqrt(1 + 2000 / 50))
    assert policy.epsilon_at(2) == 0.1  # another bucket has its own count
    late = chosen[1000:]
    assert late.count("plain") / len(late) > 0.975
    resumed = AdaptivePolicy(cfg)
    resumed.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    assert resumed.epsilon_at(1) == policy.epsilon_at(1)


def test_rewards_are_windowed_and_plain_steps_outside_sd_mode_are_not_recorded():
    policy = AdaptivePolicy(_config(warmup_steps=2, window=3))
    policy.begin()
    for _ in range(2):
        assert policy.choose(1) is None
        policy.record(None, 1, 1, 0.5)  # warm-up steps: not rewards of the SD-mode arm
    assert policy.median_rewards() == {}
    for seconds in (1.0, 0.5, 0.25, 0.125):
        policy.choose(1)
        policy.record(None, 1, 1, seconds)
    # Window of 3: the last three rewards 2, 4, 8 tokens/s.
    assert policy.median_rewards() == {"1/plain": 4.0}


def test_fixed_and_scheduled_policies():
    choice = StepChoice("3,2,6", "eagle")
    assert choice.strategy == SpecStrategy(3, 2, 6) and choice.needs_drafter
    fixed = FixedPolicy(choice, max_batch=2)
    assert [fixed.choose(n) for n in (3, 2, 1)] == [None, choice, choice]
    scheduled = ScheduledPolicy(choice, plain_steps=2)
    scheduled.begin()
    assert [scheduled.choose(1) for _ in range(4)] == [None, None, choice, choice]
    scheduled.begin()
    assert scheduled.choose(1) is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(bucket_bounds=(2, 5)), "must start at 1"),
        (dict(bucket_bounds=(1, 5, 5)), "must start at 1 and increase"),
        (dict(strategies=(("4,1,5",),)), "has 1 buckets"),
        (dict(strategies=(("4,1,5", "3,1,4"), ("3,1,4",), ("1,1,2",))), "one verify budget"),
        (dict(sources=("medusa",)), "spec.sources"),
        (dict(epsilon=1.5), "spec.epsilon"),
        (dict(threshold=0), r"spec.threshold=0 must be an integer >= 1"),
        (dict(threshold=True), r"spec.threshold=True must be an integer >= 1"),
        (dict(warmup_steps=-1), r"spec.warmup_steps=-1 must be an integer >= 0"),
        (dict(strategies=(("4,1,9",), ("3,1,4",), ("1,1,2",))), "verify_tokens=9"),
        (dict(strategies=((), ("3,1,4",), ("1,1,2",))), r"spec.strategies\[0\] is empty"),
        # Accepted before: 2.5 truncated to bucket 2, an arm twice (its rewards split between
        # the copies), and a TypeError from the comparison.
        (dict(bucket_bounds=(1, 2.5, 5)), r"spec.bucket_bounds=\(1, 2.5, 5\) must be integers"),
        (dict(strategies=(("4,1,5", "4,1,5"), ("3,1,4",), ("1,1,2",))), "a strategy twice"),
        (dict(sources=("ngram", "ngram")), "each once"),
        (dict(epsilon="0.1"), "spec.epsilon='0.1' must be in"),
    ],
)
def test_bandit_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _config(**kwargs)


def test_spec_config_builds_the_bandit_and_rejects_bad_values():
    spec = SpecConfig(mode="adaptive", bucket_bounds=(1, 2), strategies=("4,1,5|2,2,5", "3,1,4"))
    bandit = spec.bandit(threshold=8, has_drafter=False, seed=3)
    assert bandit.strategies == (("4,1,5", "2,2,5"), ("3,1,4",))
    assert bandit.sources == ("ngram",) and bandit.include_plain and bandit.seed == 3
    assert SpecConfig(mode="always").bandit(4, False).include_plain is False
    assert SpecConfig(mode="always").bandit(4, False).warmup_steps == 0
    assert SpecConfig(drafter="/x").sources(has_drafter=True) == ("eagle", "ngram", "hybrid")
    for kwargs, match in (
        (dict(mode="sometimes"), "spec.mode='sometimes'"),
        (dict(draft_sources="ngram,medusa"), "spec.draft_sources"),
        (dict(attention_impl="cuda"), "spec.attention_impl"),
        (dict(strategies=("4,1,5",)), "spec.strategies has 1 buckets"),
        (dict(bucket_bounds=(1, 2.5, 5, 9)), r"spec.bucket_bounds=\(1, 2.5, 5, 9\) must be"),
    ):
        with pytest.raises(ValueError, match=match):
            SpecConfig(**kwargs)


def test_arms_are_ranked_per_running_request_within_a_bucket():
    """Bucket 8 holds batches of 5 to 8. Plain ran at 8 (8 tokens in 1 s), SD at 5 (1.5
    tokens per request in 1 s: 1.5x plain's rate per request). In tokens per second SD
    (7.5) ranked below plain (8) and was never chosen again with epsilon 0."""
    policy = AdaptivePolicy(_config(warmup_steps=0, epsilon=0.0, threshold=8))
    policy.begin()
    plain_first = policy.choose(8)
    policy.record(plain_first, 8, 8, 1.0)
    sd = policy.choose(5)
    assert sd is not None and plain_first is None
    policy.record(sd, 5, 7.5, 1.0)
    assert policy.choose(5) == sd


def test_one_noisy_reward_does_not_close_an_arm():
    """After one step each, an arm whose one reward fell below the leader's was closed to
    exploration for `window` steps: one slow step (timing noise) shut out the better arm."""
    policy = AdaptivePolicy(_config(warmup_steps=0, epsilon=1.0, epsilon_decay=False,
                                    threshold=1, window=300))  # fmt: skip
    policy.begin()
    first = policy.choose(1)
    policy.record(first, 1, 10, 1.0)
    second = policy.choose(1)
    policy.record(second, 1, 9, 1.0)
    losing = second
    seen = 0
    for _ in range(50):
        choice = policy.choose(1)
        seen += choice == losing
        policy.record(choice, 1, 10 if choice == first else 9, 1.0)
        if seen:
            break
    assert seen


def test_a_saved_calibration_gives_the_same_threshold_and_bad_files_are_named(tmp_path):
    """Rounded to 3 decimals, 1.19996 / 0.6 (1.99993, under 2) read back as 2.0: a resumed
    run got threshold 1 where it had run at 2. Files that could not have been measured
    failed late (KeyError, ZeroDivisionError) or turned SD off silently (threshold < 0)."""
    from tlt_jax.rollout.calibrate import Calibration, load_calibration

    cal = Calibration(2, 4, 2.0, {1: 0.6, 2: 0.6}, {1: 1.0, 2: 1.19996}, 1.0, "cpu")
    assert cal.threshold_at(2.0) == 2
    path = cal.save(tmp_path / "cal.json")
    assert load_calibration(path).threshold_at(2.0) == 2
    raw = json.loads(path.read_text())
    for change in ({"verify_ms": {"1": 1.0}}, {"plain_ms": {"1": 0.0, "2": 0.6}},
                   {"threshold": -1}):  # fmt: skip
        path.write_text(json.dumps({**raw, **change}))
        with pytest.raises(ValueError, match=r"spec.calibration_file=.*cal.json"):
            load_calibration(path)
