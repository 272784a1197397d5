"""The RL step: shared-prompt forward parity, exact micro-batching, update/skip, the trainer."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rl_testing import tiny_config

from tlt_jax.metrics import timing
from tlt_jax.models.presets import get_preset
from tlt_jax.models.transformer import init_model
from tlt_jax.rl import evaluation, spot
from tlt_jax.rl import step as step_lib
from tlt_jax.rl.algorithms import AlgorithmConfig, token_weights
from tlt_jax.rl.config import OptimConfig
from tlt_jax.rl.trainer import NonFiniteLossError, Trainer, rollout_seeds

PROMPTS = [(5, 6, 7, 8, 9), (10, 11)]
RESPONSES = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10, 11, 12]]  # group size 2


def _batch(prompts=PROMPTS, responses=RESPONSES, group=2):
    batch = step_lib.build_sequence_batch(prompts, responses, group, min_bucket=4,
                                          max_prompt=16, max_response=16)  # fmt: skip
    return jax.tree.map(jnp.asarray, batch)


@pytest.fixture(scope="module")
def tiny():
    model = init_model(get_preset("tiny"), seed=3)
    graphdef, params = nnx.split(model)
    return model, graphdef, params


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prompt_forward_equals_full_forward(tiny, temperature):
    model = tiny[0]
    logprobs, _, prompt_features, features = step_lib.sequence_forward(model, _batch(), temperature)
    for b, response in enumerate(RESPONSES):
        prompt = PROMPTS[b // 2]
        full = jnp.asarray([list(prompt) + response])
        full_features, _ = model(full, jnp.arange(full.shape[1])[None])
        logits = model.logits(full_features)[0] / temperature
        expected = [jax.nn.log_softmax(logits[len(prompt) - 1 + t])[token]
                    for t, token in enumerate(response)]  # fmt: skip
        np.testing.assert_allclose(logprobs[b, : len(response)], expected, atol=2e-5)
        np.testing.assert_allclose(features[b, : len(response)],
                                   full_features[0, len(prompt):], atol=2e-5)  # fmt: skip
        np.testing.assert_allclose(prompt_features[b // 2, : len(prompt)],
                                   full_features[0, : len(prompt)], atol=2e-5)  # fmt: skip


@functools.cache
def _programs(graphdef, algorithm):
    """The log-prob and gradient programs, jitted once per model and algorithm (run op by op,
    a bfloat16 gradient took over a minute)."""
    logprob = jax.jit(functools.partial(step_lib.logprob_program, graphdef, temperature=1.0))
    grad = jax.jit(functools.partial(step_lib.grad_program, graphdef, algorithm=algorithm,
                                     temperature=1.0))  # fmt: skip
    return logprob, grad


def _accumulate(graphdef, params, batches, advantages, algorithm, lengths=None):
    """Accumulates padded micro-batches (advantages per response of each) with token weights
    over all of them, as the trainer does."""
    logprob_program, grad_program = _programs(graphdef, algorithm)
    masks = [np.asarray(b.response_mask_BxT) for b in batches]
    lengths = np.concatenate([m.sum(1) for m in masks]) if lengths is None else lengths
    weights = token_weights(algorithm.loss_aggregation, lengths)
    metric = 1.0 / lengths.sum()
    accum, start = step_lib.zero_accumulator(params), 0
    for batch, mask, adv in zip(batches, masks, advantages, strict=True):
        n = len(mask)
        old = logprob_program(params, batch)[0]
        per_row = lambda v, m=mask: jnp.asarray(np.where(m, np.float32(v)[:, None], 0))  # noqa: E731
        inputs = step_lib.LossInputs(old, jnp.zeros(mask.shape), per_row(adv),
                                     per_row(weights[start : start + n]),
                                     per_row(np.full(n, metric)))  # fmt: skip
        accum = grad_program(params, accum, batch, inputs)
        start += n
    return accum


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_weighted_micro_batches_equal_one_batch(tiny, aggregation):
    _, graphdef, params = tiny
    algorithm = AlgorithmConfig(loss_aggregation=aggregation)
    advantages = np.asarray([0.5, -1.0, 2.0, -0.3], np.float32)
    whole = _accumulate(graphdef, params, [_batch()], [advantages], algorithm)
    parts = [_batch(PROMPTS[:1], RESPONSES[:2]), _batch(PROMPTS[1:], RESPONSES[2:])]
    split = _accumulate(graphdef, params, parts, [advantages[:2], advantages[2:]], algorithm)
    assert float(whole["weight"]) == pytest.approx(1.0)
    assert float(whole["loss"]) == pytest.approx(float(split["loss"]), abs=1e-6)
    for a, b in zip(jax.tree.leaves(whole["grads"]), jax.tree.leaves(split["grads"]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert float(optax_norm(whole["grads"])) > 0


def test_bfloat16_gradients_are_summed_in_float32(tiny):
    """Micro-batch gradients of bfloat16 params are summed in float32: the accumulated sum is
    exactly the float32 sum of the micro-batches' own gradients (a bfloat16 sum rounds each
    partial sum to 8 bits, so the update would depend on the micro-batch split), and the
    update keeps the params' and optimizer state's bfloat16."""
    _, graphdef, params = tiny
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    algorithm = AlgorithmConfig(loss_aggregation="token_mean")
    advantages = [np.asarray([a, -0.5 * a], np.float32) for a in (-2.0, 0.7, 3.0, -1.3)]
    batches = [_batch(PROMPTS[:1], RESPONSES[:2]) for _ in advantages]
    # Every micro-batch gets the whole step's token weights, so each one's gradient computed
    # alone is bit for bit the one the whole accumulation adds.
    lengths = np.asarray([3, 1] * len(advantages))
    each = [_accumulate(graphdef, params, [b], [a], algorithm, lengths=lengths)["grads"]
            for b, a in zip(batches, advantages, strict=True)]  # fmt: skip
    total = _accumulate(graphdef, params, batches, advantages, algorithm, lengths=lengths)
    assert {g.dtype for g in jax.tree.leaves(total["grads"])} == {jnp.dtype(jnp.float32)}
    expected = jax.tree.map(lambda *g: sum(x.astype(jnp.float32) for x in g), *each)
    for a, b in zip(jax.tree.leaves(total["grads"]), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    optimizer = step_lib.make_optimizer(OptimConfig(learning_rate=1e-2), 10)
    schedule = step_lib.learning_rate_schedule(OptimConfig(learning_rate=1e-2), 10)
    state = step_lib.init_train_state(jax.tree.map(jnp.copy, params), optimizer, 0)
    new, metrics = step_lib.apply_program(state, total, optimizer=optimizer, schedule=schedule)
    assert float(metrics["skipped"]) == 0.0
    dtypes = lambda tree: jax.tree.map(lambda x: x.dtype, tree)  # noqa: E731
    assert dtypes(new) == dtypes(state)
    assert dtypes(step_lib.abstract_accumulator(params)) == dtypes(
        step_lib.zero_accumulator(params)
    )


def test_on_policy_gradient_equals_the_recomputed_one_and_measures_the_sampler_gap(tiny):
    """`on_policy`: old log-probs are the current ones without gradient. The same loss and
    gradient as a recompute gives, the ratio exactly 1; `engine_gap` is the token mean of
    |engine log-prob - the trainer's| (hand-checked against the recompute)."""
    _, graphdef, params = tiny
    algorithm = AlgorithmConfig()
    batch = _batch()
    mask = np.asarray(batch.response_mask_BxT)
    old = step_lib.logprob_program(graphdef, params, batch, temperature=1.0)[0]
    adv = jnp.asarray(np.where(mask, np.asarray([0.5, -1.0, 2.0, -0.3], np.float32)[:, None], 0))
    weights = jnp.asarray(mask / mask.sum(), jnp.float32)
    engine = jnp.where(mask, old + 0.01 * jnp.arange(mask.shape[1]), 0.0)
    out = {}
    for on_policy in (False, True):
        inputs = step_lib.LossInputs(
            jnp.zeros(mask.shape) if on_policy else old,
            jnp.zeros(mask.shape),
            adv,
            weights,
            weights,
            engine,
        )
        out[on_policy] = step_lib.grad_program(
            graphdef, params, step_lib.zero_accumulator(params), batch, inputs,
            algorithm=algorithm, temperature=1.0, on_policy=on_policy)  # fmt: skip
    # (the ratio is 1; its token mean is a weighted sum, 1 up to rounding)
    assert float(out[True]["ratio_mean"]) == pytest.approx(1.0, abs=1e-6)
    assert float(out[True]["clip_fraction"]) == 0.0
    assert float(out[True]["loss"]) == pytest.approx(float(out[False]["loss"]), abs=1e-6)
    for a, b in zip(jax.tree.leaves(out[True]["grads"]), jax.tree.leaves(out[False]["grads"]),
                    strict=True):  # fmt: skip
        np.testing.assert_allclose(a, b, atol=1e-6)
    expected = np.sum(np.abs(np.asarray(engine - old)) * mask) / mask.sum()
    for on_policy in (False, True):
        assert float(out[on_policy]["engine_gap"]) == pytest.approx(expected, rel=1e-4)


def test_the_recomputed_sampler_gap_is_a_token_mean_over_micro_batches():
    """Hand-computed: one micro-batch of 1 token off by 1.0, one of 3 tokens off by 0 (and
    a response with no token). The step's gap is 1/4 (token mean, as the on-policy
    `engine_gap`); the mean of the micro-batch means said 1/2."""
    first = step_lib.logprob_gap([np.asarray([-1.0, 0.0])], [[-2.0]])
    second = step_lib.logprob_gap([np.asarray([-0.5, -0.25, -3.0, 0.0]), np.zeros(3)],
                                  [[-0.5, -0.25, -3.0], []])  # fmt: skip
    assert first == (1.0, 1) and second == (0.0, 3)
    assert (first[0] + second[0]) / (first[1] + second[1]) == 0.25
    assert step_lib.logprob_gap([np.zeros(2)], [[]]) == (0.0, 0)


def optax_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def test_zero_advantages_give_zero_gradient(tiny):
    _, graphdef, params = tiny
    accum = _accumulate(graphdef, params, [_batch()], [np.zeros(4, np.float32)],
                        AlgorithmConfig())  # fmt: skip
    assert float(optax_norm(accum["grads"])) == 0.0


def test_apply_skips_non_finite_loss(tiny):
    _, _, params = tiny
    optimizer = step_lib.make_optimizer(OptimConfig(learning_rate=1e-2), 10)
    schedule = step_lib.learning_rate_schedule(OptimConfig(learning_rate=1e-2), 10)
    state = step_lib.init_train_state(jax.tree.map(jnp.copy, params), optimizer, 0)
    accum = step_lib.zero_accumulator(params)
    accum["grads"] = jax.tree.map(jnp.ones_like, accum["grads"])
    for loss, skipped in ((jnp.float32(jnp.nan), 1.0), (jnp.float32(0.5), 0.0)):
        new, metrics = step_lib.apply_program(
            state, dict(accum, loss=loss), optimizer=optimizer, schedule=schedule
        )
        same = all(
            bool(jnp.array_equal(a, b))
            for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params), strict=True)
        )
        assert float(metrics["skipped"]) == skipped
        assert same == bool(skipped)


def test_micro_batch_plan_puts_zero_advantage_groups_last():
    signal = np.asarray([False, True, False, True, True, False, False, False])
    plan = step_lib.plan_micro_batches(signal, group_size=4, micro_batch_size=8,
                                       num_minibatches=2)  # fmt: skip
    # Two mini-batches of 4 groups, 2 groups per micro-batch; within a mini-batch the groups
    # with signal come first (stable order).
    assert plan == [[[1, 3], [0, 2]], [[4, 5], [6, 7]]]
    # By longest response too: long groups together, within the signal / no-signal classes.
    lengths = np.asarray([10, 300, 40, 20, 5, 60, 70, 8])
    plan = step_lib.plan_micro_batches(signal, group_size=4, micro_batch_size=8,
                                       num_minibatches=1, group_lengths=lengths)  # fmt: skip
    assert plan == [[[1, 3], [4, 6], [5, 2], [0, 7]]]


def test_long_tail_share_and_seeds():
    # Steps end at 1, 2, 4, 7, 8 s with 9, 5, 4, 2, 1 running; the last three steps ran at
    # <= 4 requests (4 -> 7, 7 -> 8 and 2 -> 4: 2 + 3 + 1 = 6 of 8 s), two of them as SD.
    timeline = [(1.0, 9, "plain"), (2.0, 5, "plain"), (4.0, 4, "plain"), (7.0, 2, "ngram:3,1,4"),
                (8.0, 1, "eagle:4,4,8")]  # fmt: skip
    stats = timing.tail_stats(timeline, threshold=4)
    assert stats["long_tail_share"] == pytest.approx(6 / 8)
    assert stats["long_tail_s"] == pytest.approx(6.0) and stats["rollout_decode_s"] == 8.0
    assert stats["sd_tail_s"] == pytest.approx(4.0)
    assert timing.tail_stats(timeline, threshold=0)["long_tail_share"] == 0.0
    assert timing.tail_stats([], threshold=4)["long_tail_share"] == 0.0
    # Compile seconds (the fourth field) stop the clock: 0.5 s in the first step and 2 s in
    # the fourth (a tail step) leave steps ending at 0.5, 1.5, 3.5, 4.5, 5.5 s: 4 tail
    # seconds of 5.5, SD 2 of them.
    compiled = [(*row, c) for row, c in zip(timeline, [0.5, 0.0, 0.0, 2.0, 0.0], strict=True)]
    stats = timing.tail_stats(compiled, threshold=4)
    assert stats["long_tail_share"] == pytest.approx(4 / 5.5)
    assert stats["long_tail_s"] == pytest.approx(4.0)
    assert stats["rollout_decode_s"] == pytest.approx(5.5)
    assert stats["sd_tail_s"] == pytest.approx(2.0)
    assert stats["rollout_compile_s"] == pytest.approx(2.5)
    assert timing.without_compiles(compiled)[3] == (pytest.approx(4.5), 2, "ngram:3,1,4")
    words = np.asarray([1, 2], np.uint32)
    np.testing.assert_array_equal(rollout_seeds(words, 3, 8), rollout_seeds(words, 3, 8))
    assert not np.array_equal(rollout_seeds(words, 3, 8), rollout_seeds(words, 4, 8))
    assert len(set(rollout_seeds(words, 3, 64).tolist())) == 64


def test_long_tail_over_slices_is_wall_time_with_few_requests_running_anywhere():
    # Slice a: steps end at 1, 3 s with 4, 2 running; slice b: at 2, 5 s with 3, 1 running.
    # Together: (0, 1] 7 running, (1, 2] 5, (2, 3] 3, (3, 5] 1.
    a = [(1.0, 4, "plain"), (3.0, 2, "ngram:3,1,4")]
    b = [(2.0, 3, "plain"), (5.0, 1, "plain")]
    assert timing.merge_timelines([a, b]) == [(1.0, 7), (2.0, 5), (3.0, 3), (5.0, 1)]
    assert timing.merge_timelines([a]) == [(1.0, 4), (3.0, 2)]
    assert timing.merge_timelines([[], []]) == []
    spec = {"spec": 1, "plain": 3, "rows": {}, "tokens": {}, "choices": {}, "threshold": 3,
            "tail_threshold": 3}  # fmt: skip

    def slice_stats(timeline):
        return {**timing.tail_stats(timeline, 3), "timeline": [row[:2] for row in timeline]}

    # Two processes, one slice each: at most 3 running anywhere for 1 + 2 of 5 s. Each slice
    # against its own requests: a is in its tail 2 of 3 s (1 of them SD), b all 5 s.
    out = spot.combine_rollout_stats(
        [{"tail": [slice_stats(a)], "spec": spec}, {"tail": [slice_stats(b)], "spec": spec}],
        sliced=False)  # fmt: skip
    assert out["long_tail_share"] == pytest.approx(3 / 5)
    assert out["long_tail_s"] == pytest.approx(3.0) and out["rollout_decode_s"] == 5.0
    assert out["slice_tail_share"] == pytest.approx(7 / 8) and out["slice_tail_s"] == 7.0
    assert out["sd_tail_s"] == pytest.approx(2.0)
    # One slice: the run's tail is the slice's.
    one = spot.combine_rollout_stats([{"tail": [slice_stats(a)], "spec": spec}], sliced=False)
    assert one["long_tail_share"] == one["slice_tail_share"] == pytest.approx(2 / 3)


def test_a_zero_sd_threshold_counts_the_tail_at_the_report_threshold():
    """A calibration where SD never pays gives threshold 0; the tail, counted there, was 0 in
    every step (the run reported no tail at all)."""
    import types

    from tlt_jax.rl import policy
    from tlt_jax.rl.rollout_slices import RolloutSlices

    assert RolloutSlices.tail_threshold.fget(types.SimpleNamespace(threshold=0)) == 32
    assert RolloutSlices.tail_threshold.fget(types.SimpleNamespace(threshold=8)) == 8
    timeline = [(1.0, 40), (3.0, 10)]
    spec = {"spec": 0, "plain": 2, "rows": {}, "tokens": {}, "choices": {}, "threshold": 0,
            "tail_threshold": policy.REPORT_THRESHOLD}  # fmt: skip
    tail = {**timing.tail_stats(timeline, policy.REPORT_THRESHOLD), "timeline": timeline}
    out = spot.combine_rollout_stats([{"tail": [tail], "spec": spec}], sliced=False)
    assert out["long_tail_share"] == pytest.approx(2 / 3)
    assert (out["sd_threshold"], out["long_tail_threshold"]) == (0, 32)


def test_long_tail_over_processes_places_each_timeline_at_its_process_start():
    # Both processes: 4 running until 1 s, then 1 until 2 s, on their own clocks; process b
    # started 1 s after a (a wrote the last checkpoint). On a's clock b's steps end at 2, 3 s:
    # (0, 1] 4 + 4 running (b's requests wait), (1, 2] 1 + 4, (2, 3] 0 + 1. At most 2 running
    # for 1 of 3 s; read as one clock it was (0, 1] 8, (1, 2] 2: 1 of 2 s.
    spec = {"spec": 0, "plain": 4, "rows": {}, "tokens": {}, "choices": {}, "threshold": 2,
            "tail_threshold": 2}  # fmt: skip
    timeline = [(1.0, 4), (2.0, 1)]

    def process(start_wall):
        return {"tail": [{**timing.tail_stats(timeline, 2), "timeline": timeline}], "spec": spec,
                "start_wall": start_wall}  # fmt: skip

    out = spot.combine_rollout_stats([process(100.0), process(101.0)], sliced=False)
    assert out["long_tail_s"] == pytest.approx(1.0)
    assert out["long_tail_share"] == pytest.approx(1 / 3)
    assert out["rollout_decode_s"] == pytest.approx(3.0)
    same = spot.combine_rollout_stats([process(100.0), process(100.0)], sliced=False)
    assert same["long_tail_share"] == pytest.approx(1 / 2) and same["rollout_decode_s"] == 2.0


def test_paired_difference_hand_computed():
    def result(correct):
        return evaluation.EvalResult(float(np.mean(correct)), 0.0, len(correct), 1.0,
                                     tuple(correct), (1,) * len(correct), 0.0)  # fmt: skip

    before = result([True, False, False, True, False])
    after = result([True, True, True, False, False])
    paired = evaluation.paired_difference(before, after)
    # gained 2, lost 1: differences (0, 1, 1, -1, 0), diff 1/5; their sample variance
    # (3 - 5 * 0.2^2) / 4 = 0.7, se sqrt(0.7 / 5) (it divided by n, not n - 1).
    assert paired["gained"] == 2 and paired["lost"] == 1
    assert paired["diff"] == pytest.approx(0.2)
    assert paired["stderr"] == pytest.approx(math.sqrt(0.7 / 5))
    assert paired["stderr"] == pytest.approx(np.std([0, 1, 1, -1, 0], ddof=1) / math.sqrt(5))
    one = evaluation.paired_difference(result([True]), result([False]))
    assert one["diff"] == -1.0 and math.isnan(one["stderr"])
    assert evaluation.binomial_stderr(0.5, 100) == pytest.approx(0.05)


def test_an_accuracy_of_none_or_all_reports_a_wilson_bound_not_a_zero_error():
    """At 0 of n the binomial error is 0, which claims certainty: the summary gives the 95%
    Wilson bound instead (reference values: 0 of 96 -> 3.84 / 99.84; 5 of 10 -> [0.2366,
    0.7634], the textbook example)."""
    low, high = evaluation.wilson_interval(5, 10)
    assert (low, high) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    assert evaluation.wilson_interval(0, 96) == (
        0.0,
        pytest.approx(1.959964**2 / (96 + 1.959964**2)),
    )
    none = evaluation.EvalResult(0.0, 0.0, 96, 12.0, (False,) * 96, (12,) * 96, 0.0)
    assert none.summary() == ("0.000 (0 of 96 correct; 95% upper bound 0.038, Wilson) "
                              "(mean length 12.0 tokens)")  # fmt: skip
    every = evaluation.EvalResult(1.0, 0.0, 4, 3.0, (True,) * 4, (3,) * 4, 0.0)
    assert "4 of 4 correct; 95% lower bound 0.510" in every.summary()
    some = evaluation.EvalResult(0.25, 0.217, 4, 3.0, (True,) + (False,) * 3, (3,) * 4, 0.0)
    assert some.summary().startswith("0.250 +- 0.217 (n=4,")
    with pytest.raises(ValueError, match="n=0"):
        evaluation.wilson_interval(0, 0)


def test_step_metrics_are_token_means_over_the_trained_tokens_of_every_minibatch():
    """Mini-batch 1 trains 60% of its tokens (entropy sum 0.3, ratios 0.6: token means 0.5
    and 1.0); mini-batch 2 trains none (its groups are all silent). The step's token means are
    0.5 and 1.0, not halved by a mini-batch that counted as a 0; its losses are mini-batch
    values, averaged; a step that trained no token reports NaN token means, not 0."""
    zero = dict.fromkeys(step_lib.ACCUMULATED_METRICS, 0.0)
    first = {**zero, "loss": 0.4, "pg_loss": 0.3, "kl": 0.1, "entropy": 0.3,
             "ratio_mean": 0.6, "clip_fraction": 0.06, "weight": 0.6}  # fmt: skip
    applied = {"grad_norm": 2.0, "learning_rate": 1e-6, "skipped": 0.0}
    out = step_lib.combine_minibatch_metrics(
        [(first, applied), (zero, {**applied, "grad_norm": 0.0})]
    )
    assert out["entropy"] == pytest.approx(0.5) and out["ratio_mean"] == pytest.approx(1.0)
    assert out["clip_fraction"] == pytest.approx(0.1)
    assert out["loss"] == pytest.approx(0.2) and out["kl"] == pytest.approx(0.05)
    assert out["grad_norm"] == pytest.approx(1.0) and out["skipped"] == 0.0
    # Two trained mini-batches: weighted by their trained shares, (0.3 + 0.1) / (0.6 + 0.4).
    second = {**zero, "entropy": 0.1, "ratio_mean": 0.4, "weight": 0.4}
    out = step_lib.combine_minibatch_metrics(
        [(first, applied), (second, {**applied, "skipped": 1.0})]
    )
    assert out["entropy"] == pytest.approx(0.4) and out["skipped"] == 1.0
    none = step_lib.combine_minibatch_metrics([(zero, applied)])
    assert math.isnan(none["entropy"]) and math.isnan(none["ratio_mean"]) and none["loss"] == 0.0


def test_the_report_gives_the_runs_ratios_not_means_of_the_steps():
    """Two steps with 1 of 100 and 9 of 10 tail seconds: the run's tail share is 10 / 110, not
    (1% + 90%) / 2; the same for the SD share of decode steps, tokens/s and acceptance."""
    from tlt_jax.rl import run

    records = [
        {"long_tail_s": 1.0, "rollout_decode_s": 100.0, "long_tail_share": 0.01,
         "generated_tokens": 1000, "time_rollout": 100.0, "tokens_per_s": 10.0,
         "sd_steps": 1, "decode_steps": 100, "sd_step_share": 0.01, "sd_threshold": 4,
         "accept_len_ngram": 1.0, "sd_rows_ngram": 1, "step_time": 100.0},
        {"long_tail_s": 9.0, "rollout_decode_s": 10.0, "long_tail_share": 0.9,
         "generated_tokens": 900, "time_rollout": 10.0, "tokens_per_s": 90.0,
         "sd_steps": 9, "decode_steps": 10, "sd_step_share": 0.9, "sd_threshold": 4,
         "accept_len_ngram": 3.0, "sd_rows_ngram": 9, "step_time": 10.0},
    ]  # fmt: skip
    table = run.phase_table(records)
    assert "over the run): 9.1%, 5.0 s/step; generated tokens/s in rollout: 17.3\n" in table
    # With the compiles inside the steps recorded: their line, and tokens/s without them.
    for r, compile_s, decode_tps in zip(records, [40.0, 1.0], [10.0, 90.0], strict=True):
        r.update(compile_s=compile_s, rollout_compile_s=compile_s / 2,
                 decode_tokens_per_s=decode_tps)  # fmt: skip
    table = run.phase_table(records)
    assert ("compiling inside the steps: 41.0 s (37.3% of the steps; process 0's); inside "
            "rollouts 20.5 slice-s over every slice") in table  # fmt: skip
    assert "generated tokens/s in rollout: 17.3 (17.3 in decode time without compiles)" in table
    # 10 SD steps of 110 decode steps; acceptance (1 * 1 + 3 * 9) / 10 rows.
    assert "SD in 9.1% of decode steps (10 steps); acceptance length ngram 2.80;" in table
    # Records written before the sums were recorded: the steps' mean, as before.
    newer = ("decode_steps", "sd_rows_ngram", "generated_tokens")
    old = [{k: v for k, v in r.items() if k not in newer} for r in records]
    table = run.phase_table(old)
    assert "rollout: 50.0" in table and "SD in 45.5% of decode steps" in table
    assert "ngram 2.00" in table
    assert "(decode time with <= 4 requests running" in table
    # A resumed run re-calibrated to another threshold: the line names both, not the last.
    records[1]["sd_threshold"] = 8
    assert "(decode time with <= 4-8 (by step) requests running" in run.phase_table(records)


def test_pooled_acceptance_skips_steps_without_sd_of_the_source():
    """A measured step whose tail never switched SD on has no `accept_len_eagle`: it is no
    acceptance length of 0 (bench_tlt averaged it in as one: 1.5 for a run at 3.0)."""
    records = [
        {"sd_steps": 0, "decode_steps": 40},
        {"accept_len_eagle": 3.0, "sd_rows_eagle": 4, "sd_steps": 2, "decode_steps": 60},
    ]
    assert timing.pooled_accept_len(records, "eagle") == 3.0
    assert timing.pooled_accept_len(records, "ngram") is None
    assert timing.pooled_sd_step_share(records) == pytest.approx(0.02)
    # Records written before the sums: the steps' own shares, as before.
    assert timing.pooled_sd_step_share([{"sd_step_share": 0.5}, {}]) == 0.25


class RecordingSink:
    def __init__(self):
        self.calls = []

    def add(self, tokens, features, response_mask, step, valid_mask=None):
        self.calls.append((np.asarray(tokens), np.asarray(features), np.asarray(response_mask),
                           step, np.asarray(valid_mask)))  # fmt: skip
        return len(tokens)


def test_trainer_steps_update_sync_and_feed_the_sink(tmp_path):
    sink = RecordingSink()
    config = tiny_config(total_steps=2, checkpoint_every=2)
    trainer = Trainer(config, tmp_path, feature_sink=sink, progress=False)
    initial = jax.tree.map(np.asarray, trainer.state.params)
    compiled = trainer.pool.compile_count  # the trainer's and the engine's programs
    records = trainer.train()
    assert [r["step"] for r in records] == [1, 2]
    # Each program compiled in a step is counted once (the engine shares the trainer's pool;
    # evaluation compiles outside the steps).
    assert 0 < sum(r["compile_count"] for r in records) <= trainer.pool.compile_count - compiled
    for record in records:
        assert record["micro_batches_trained"] == record["micro_batches_total"] >= 1
        assert math.isfinite(record["loss"]) and record["grad_norm"] > 0
        assert record["skipped"] == 0.0
        # 8 requests, all under the report threshold of a plain run: all of it is "tail".
        assert record["long_tail_share"] == pytest.approx(1.0)
        assert record["sd_step_share"] == 0.0 and record["sd_threshold"] == 32
        # Packed rows: whole rows computed; of them, real tokens are prompts and responses.
        computed = record["update_tokens_computed"]
        assert computed % trainer.row_len == 0
        needed = (1 - record["update_padding_share"]) * computed
        assert sum(record["response_lengths"]) < needed <= computed
        # The engine's sampling log-probs and the trainer's recompute agree.
        assert record["logprob_diff"] < 1e-4
    changed = [
        not np.array_equal(a, np.asarray(b))
        for a, b in zip(
            jax.tree.leaves(initial), jax.tree.leaves(trainer.state.params), strict=True
        )
    ]
    assert all(changed)
    # Weight sync: the engine samples with exactly the trained weights.
    for a, b in zip(jax.tree.leaves(trainer.engine.params),
                    jax.tree.leaves(trainer.state.params), strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert {"reward_mean", "accuracy", "loss", "time_rollout", "response_len_p90"} <= set(
        json.loads(lines[0])
    )
    assert trainer.checkpointer.latest_step() == 2
    assert all(
        (tmp_path / "plots" / name).is_file()
        for name in ("reward_accuracy.png", "response_lengths.png", "time_breakdown.png")
    )
    assert list((tmp_path / "tensorboard").iterdir())

    # Feature sink: every sequence of both steps, prompt + response, with their masks.
    assert sum(len(c[0]) for c in sink.calls) == 2 * config.rl.batch_size
    tokens, features, response_mask, step, valid = sink.calls[-1]
    assert step == 2 and features.shape == tokens.shape + (get_preset("tiny").hidden_size,)
    assert not (response_mask & ~valid).any() and response_mask.any(axis=1).all()
    assert tokens.shape[1] == trainer.row_len and len(sink.calls) >= 2

    # Same shapes again: nothing is compiled.
    examples = [{"question": "What is 1 + 2?", "answer": "3"}] * config.rl.prompts_per_step
    trainer.run_step(examples)
    assert trainer.run_step(examples)["compile_count"] == 0
    trainer.close()


def test_packed_and_padded_updates_agree_in_the_trainer(tmp_path):
    # Plain rollouts of the tiny run are deterministic, so both layouts see the same
    # responses; the update must give the same loss, gradient norm and weights. The padded
    # side also recomputes the old log-probs first (`rl.recompute_logprobs`), the packed one
    # takes them on-policy inside its gradient program (the default for one mini-batch).
    records, params, programs = {}, {}, {}
    for layout in ("padded", "packed"):
        overrides = {"rl.update_layout": layout}
        if layout == "padded":
            overrides["rl.recompute_logprobs"] = True
        config = tiny_config(total_steps=1, **overrides)
        trainer = Trainer(config, tmp_path / layout, progress=False)
        records[layout] = trainer.run_step(next(trainer.iterator))
        params[layout] = jax.tree.map(np.asarray, trainer.state.params)
        programs[layout] = {c.key[0] for c in trainer.pool.compiled}
        trainer.close()
    padded, packed = records["padded"], records["packed"]
    assert "logprob" in programs["padded"] and "logprob" not in programs["packed"]
    assert padded["response_lengths"] == packed["response_lengths"]
    for key in ("loss", "pg_loss", "grad_norm", "entropy", "ratio_mean"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-6), key
    # On-policy, the ratio is 1 by construction; the sampler's log-probs are still compared.
    assert packed["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert packed["clip_fraction"] == 0.0 and packed["approx_kl_old"] == pytest.approx(0.0)
    assert 0 < packed["logprob_diff"] < 1e-4 and padded["logprob_diff"] < 1e-4
    for a, b in zip(jax.tree.leaves(params["padded"]), jax.tree.leaves(params["packed"]),
                    strict=True):  # fmt: skip
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_two_minibatches_take_their_ratios_against_the_weights_that_sampled(tmp_path):
    """`rl.num_minibatches=2` (the old log-probs recomputed before the update, the default
    with several): two optimizer updates in one RL step, each mini-batch's ratio against the
    log-probs of the weights that sampled. At learning rate 0 the weights never move, so the
    ratio is exactly 1 in both mini-batches (another micro-batch's old log-probs, or zeros,
    would not give 1); at the tiny config's rate the first update moves the weights under the
    second mini-batch: a ratio off 1 and an approximate KL to the old policy above 0."""
    records, counts = {}, {}
    for lr in (0.0, 1e-3):
        config = tiny_config(total_steps=1, **{"rl.num_minibatches": 2,
                                               "optim.learning_rate": lr})  # fmt: skip
        assert config.rl.on_policy_update is False
        trainer = Trainer(config, tmp_path / str(lr), progress=False)
        before = jax.tree.map(np.asarray, trainer.state.params)
        records[lr] = trainer.run_step(next(trainer.iterator))
        counts[lr] = {int(c) for c in jax.tree.leaves(
            jax.tree.map(np.asarray, trainer.state.opt_state)) if np.ndim(c) == 0
            and np.issubdtype(np.asarray(c).dtype, np.integer)}  # fmt: skip
        moved = any(
            not np.array_equal(a, np.asarray(b))
            for a, b in zip(
                jax.tree.leaves(before), jax.tree.leaves(trainer.state.params), strict=True
            )
        )
        trainer.close()
        assert records[lr]["micro_batches_trained"] >= 2 and moved == (lr > 0)
    frozen, moving = records[0.0], records[1e-3]
    assert counts[0.0] == counts[1e-3] == {2}  # the optimizer stepped once per mini-batch
    assert frozen["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert frozen["clip_fraction"] == 0.0 and frozen["approx_kl_old"] == pytest.approx(0, abs=1e-9)
    assert abs(moving["ratio_mean"] - 1.0) > 1e-5 and moving["approx_kl_old"] > 1e-9
    assert 0 < frozen["logprob_diff"] < 1e-4  # the recompute, against the sampler


def test_a_trainer_on_a_mesh_lays_its_state_out_as_planned_and_steps_like_one_device(tmp_path):
    """model.mesh_shape (2, 2): the train state is FSDP x TP as `plan_run` says (moments
    following their params), the engine's decode state sharded, and one RL step's responses
    and update equal the single-device trainer's."""
    from tlt_jax.parallel import sharding
    from tlt_jax.rl import policy
    from tlt_jax.rollout import engine as engine_lib

    records = {}
    for shape in ((1, 1), (2, 2)):
        config = tiny_config(total_steps=1, **{"model.mesh_shape": shape})
        trainer = Trainer(config, tmp_path / f"{shape[0]}x{shape[1]}", progress=False)
        if shape == (2, 2):
            plan = policy.plan_run(config, trainer.engine.model_config, trainer.mesh)
            for got, want in zip(jax.tree.leaves(trainer.state),
                                 jax.tree.leaves(plan.abstract_state), strict=True):  # fmt: skip
                assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
        records[shape] = trainer.run_step(next(trainer.iterator))
        if shape == (2, 2):  # the engine's state stays sharded as planned through the rollout
            state = trainer.engine.state
            want = engine_lib.decode_state_shardings(state, trainer.mesh,
                                                     sharding.rules_for("rollout"))  # fmt: skip
            for got, expected in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
                assert got.sharding.is_equivalent_to(expected, got.ndim)
        trainer.close()
    one, mesh = records[(1, 1)], records[(2, 2)]
    assert one["response_lengths"] == mesh["response_lengths"]
    for key in ("reward_mean", "loss", "grad_norm"):
        assert mesh[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key


def test_a_cpu_mesh_in_one_process_warns_when_the_pool_is_small(monkeypatch, caplog):
    """XLA:CPU shares one pool (PJRT_NPROC threads, default one per core) among a process's
    devices, and its collectives block their threads: a mesh gets a warning naming the fix."""
    import logging

    from tlt_jax.parallel import sharding
    from tlt_jax.rl import policy

    mesh = sharding.make_mesh((2, 1))
    monkeypatch.delenv("NPROC", raising=False)
    monkeypatch.setenv("PJRT_NPROC", "2")
    with caplog.at_level(logging.WARNING, logger=policy.log.name):
        policy.warn_cpu_pool(mesh)
    assert "PJRT_NPROC=8" in caplog.text
    caplog.clear()
    monkeypatch.setenv("PJRT_NPROC", "8")
    with caplog.at_level(logging.WARNING, logger=policy.log.name):
        policy.warn_cpu_pool(mesh)
    assert not caplog.text


def test_the_train_script_sizes_the_cpu_pool_for_a_mesh_of_forced_host_devices(monkeypatch):
    """`size_cpu_pool` (what scripts/train.py calls before JAX starts): PJRT_NPROC = 4 threads
    per device the mesh uses in this process, only for forced host devices, never over a
    setting the user made, never below the cores."""
    from tlt_jax.rl import policy

    monkeypatch.setattr(policy.os, "cpu_count", lambda: 2)
    flags = {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8"}
    env = dict(flags)
    assert policy.size_cpu_pool((2, 1), env) == 8 and env["PJRT_NPROC"] == "8"
    env = dict(flags)
    assert policy.size_cpu_pool((2, 2), env) == 16 and env["PJRT_NPROC"] == "16"
    for mesh, environ in [
        ((1, 1), dict(flags)),  # one device: no shared pool to starve
        ((2, 1), {}),  # no forced host devices (an accelerator, or one CPU device)
        ((2, 1), {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}),
        ((2, 1), dict(flags, PJRT_NPROC="3")),  # the user's setting stands
        ((2, 1), dict(flags, NPROC="3")),
    ]:
        before = dict(environ)
        assert policy.size_cpu_pool(mesh, environ) is None, (mesh, before)
        assert environ == before
    monkeypatch.setattr(policy.os, "cpu_count", lambda: 64)  # enough cores: left alone
    env = dict(flags)
    assert policy.size_cpu_pool((2, 1), env) is None and "PJRT_NPROC" not in env


def test_without_a_sink_the_recompute_holds_no_features(tmp_path):
    """The log-prob recompute's features went into a dict held through the update whether or
    not any sink read them: [rows, length, hidden] per micro-batch, about 0.9-2.7 GB a
    micro-batch per device at the 7B configs' shapes."""
    trainer = Trainer(tiny_config(total_steps=1, **{"rl.recompute_logprobs": True}), tmp_path,
                      progress=False)  # fmt: skip
    seen = []
    update = trainer._update

    def recording_update(*args):
        seen.append((len(args[3]), args[-1]))  # old log-probs, features
        return update(*args)

    trainer._update = recording_update
    (record,) = trainer.train()
    trainer.close()
    ((old, features),) = seen
    assert old >= 1 and features == {}
    assert record["logprob_diff"] < 1e-4  # the recompute ran


def test_training_bfloat16_params_warns(tmp_path, caplog):
    """optax keeps AdamW's updates in the params' dtype: most small updates round away in
    bfloat16, and nothing said so."""
    with caplog.at_level(logging.WARNING, logger="tlt_jax"):
        trainer = Trainer(tiny_config(**{"model.param_dtype": "bfloat16"}), tmp_path,
                          progress=False)  # fmt: skip
        trainer.close()
    assert "model.param_dtype='bfloat16'" in caplog.text and "param_dtype=float32" in caplog.text


def test_sink_features_match_the_policy_forward(tmp_path):
    sink = RecordingSink()
    trainer = Trainer(tiny_config(total_steps=1), tmp_path, feature_sink=sink, progress=False)
    params_before = jax.tree.map(jnp.copy, trainer.state.params)
    trainer.run_step([{"question": "What is 10 + 20?", "answer": "30"}] * 2)
    model = nnx.merge(trainer.graphdef, params_before)
    tokens, features, response_mask, _, valid = sink.calls[0]
    row = tokens[1][valid[1]]
    expected, _ = model(jnp.asarray(row[None]), jnp.arange(len(row))[None])
    np.testing.assert_allclose(features[1][valid[1]], expected[0], atol=2e-5)
    assert response_mask[1][valid[1]].sum() == len(row) - len(trainer.encode("What is 10 + 20?"))
    trainer.close()


# One group with signal and one silent group under `rl_testing:silent_unless_30_reward`.
SILENT_EXAMPLES = [{"question": "What is 10 + 20?", "answer": "30"},
                   {"question": "What is 1 + 2?", "answer": "3"}]  # fmt: skip


def _count_forwards(trainer: Trainer) -> list:
    """Wraps the trainer's log-prob (forward) programs; returns the list each call appends its
    batch to."""
    programs, seen = trainer._programs, []

    def counting(batch, *, logprob=True):
        forward, grad = programs(batch, logprob=logprob)
        if forward is None:
            return forward, grad
        return (lambda params, b: (seen.append(b), forward(params, b))[1]), grad

    trainer._programs = counting
    return seen


def test_sink_features_come_from_the_update_and_match_a_forward_over_every_micro_batch(
        tmp_path):  # fmt: skip
    # One group with signal (its micro-batch trained: the features come out of the gradient
    # program) and one silent group (skipped by the update: a forward of its own). The sink
    # must get what the recompute path's forward over every micro-batch gives, in that order.
    calls, forwards, records = {}, {}, {}
    for recompute in (True, None):
        sink = RecordingSink()
        overrides = {"rl.recompute_logprobs": recompute,
                     "rl.reward_fn": "rl_testing:silent_unless_30_reward"}  # fmt: skip
        config = tiny_config(total_steps=1, **overrides)
        trainer = Trainer(config, tmp_path / str(recompute), feature_sink=sink, progress=False)
        forwards[recompute] = _count_forwards(trainer)
        records[recompute] = trainer.run_step(SILENT_EXAMPLES)
        calls[recompute] = sink.calls
        trainer.close()
    assert records[None]["groups_with_signal"] == 0.5
    assert 1 <= records[None]["micro_batches_trained"] < records[None]["micro_batches_total"]
    # The recompute ran a forward over every micro-batch; on-policy, only the skipped ones.
    assert len(forwards[True]) == records[True]["micro_batches_total"]
    assert len(forwards[None]) == (records[None]["micro_batches_total"]
                                   - records[None]["micro_batches_trained"])  # fmt: skip
    assert records[None]["loss"] == pytest.approx(records[True]["loss"], rel=1e-5)
    assert len(calls[None]) == len(calls[True]) == records[None]["micro_batches_total"]
    for got, want in zip(calls[None], calls[True], strict=True):
        for a, b in zip(got, want, strict=True):
            if isinstance(a, np.ndarray) and a.dtype.kind == "f":
                np.testing.assert_allclose(a, b, atol=2e-5)
            else:
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("silent_features", [False, True])
def test_online_drafter_takes_silent_groups_features_only_with_spot_silent_features(
        tmp_path, silent_features, layout):  # fmt: skip
    # The online drafter's sink alone: the silent group's micro-batch, which the update
    # skips, gets a forward of its own (and its rows reach the buffer) only when asked.
    # The padded layout keeps silent micro-batches in its plan untrained: without a forward
    # they have no features, and the sinks skip them (they raised a KeyError).
    config = tiny_config(total_steps=1, **{
        "rl.recompute_logprobs": None, "rl.reward_fn": "rl_testing:silent_unless_30_reward",
        "rl.update_layout": layout, "spot.enabled": True, "spot.slices": 2,
        "spot.silent_features": silent_features})  # fmt: skip
    trainer = Trainer(config, tmp_path, progress=False)
    forwards, added, add = _count_forwards(trainer), [], trainer.online.add
    trainer.online.add = lambda tokens, *rest, **kw: (added.append(len(tokens)),
                                                      add(tokens, *rest, **kw))[1]  # fmt: skip
    record = trainer.run_step(SILENT_EXAMPLES)
    trainer.close()
    assert record["groups_with_signal"] == 0.5
    trained = record["micro_batches_trained"]
    # The buffer holds its window's every response (spot.buffer_steps steps of P x G).
    assert trainer.online.buffer.capacity == 2 * 2 * 4
    if silent_features:
        assert len(forwards) == record["micro_batches_total"] - trained >= 1
        assert len(added) == record["micro_batches_total"]
        assert len(trainer.online.buffer) == 2 * 4  # every response of the step
    else:
        assert forwards == [] and len(added) == trained >= 1
        assert record["micro_batches_total"] == trained + (layout == "padded")


def test_non_finite_loss_skips_updates_then_stops_with_checkpoint_intact(tmp_path):
    Trainer(tiny_config(total_steps=1), tmp_path, progress=False).train()
    config = tiny_config(total_steps=6, checkpoint_every=1, **{"rl.max_nonfinite_steps": 2})
    trainer = Trainer(config, tmp_path, progress=False)
    assert trainer.step_count == 1
    trainer.state = trainer.state.replace(
        params=jax.tree.map(lambda x: x * jnp.nan, trainer.state.params)
    )
    with pytest.raises(NonFiniteLossError, match="2 consecutive non-finite updates"):
        trainer.train()
    trainer.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["skipped"] for r in records] == [0.0, 1.0, 1.0]
    assert records[1]["loss"] == "nan"  # step 3: every micro-batch skipped, new params NaN
    resumed = Trainer(config, tmp_path, progress=False)
    assert resumed.step_count == 1  # no checkpoint was written from a non-finite step
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(resumed.state.params))
    resumed.close()


def test_a_skipped_last_step_still_saves_the_last_finite_weights(tmp_path):
    """The run's last step skipped its (non-finite) update: the steps since the last
    checkpoint are kept with the weights the skip left, the last finite ones (nothing was
    saved, and a resume repeated those steps)."""
    config = tiny_config(total_steps=2, checkpoint_every=10)
    trainer = Trainer(config, tmp_path, progress=False)
    update = trainer._update

    def nan_at_step_2(minibatches, micro_plan, batches, old, ref, advantages, *rest):
        if trainer.step_count == 1:  # run_step counts the step after its update
            advantages = advantages * np.nan
        return update(minibatches, micro_plan, batches, old, ref, advantages, *rest)

    trainer._update = nan_at_step_2
    after_step_1 = []
    run_step = trainer.run_step

    def keep(examples):
        if trainer.step_count == 1:
            after_step_1.append(jax.device_get(trainer.state.params))
        return run_step(examples)

    trainer.run_step = keep
    records = trainer.train()
    trainer.close()
    assert [r["skipped"] for r in records] == [0.0, 1.0]
    resumed = Trainer(config, tmp_path, progress=False)
    assert resumed.step_count == 2
    for got, want in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(after_step_1[0]),
                         strict=True):  # fmt: skip
        np.testing.assert_array_equal(got, want)
    resumed.close()


def test_processes_holding_different_params_stop_the_run(tmp_path):
    """After each step the processes compare digests of their params: a mismatch (which
    data-parallel steps would silently train on) raises on every process instead of being
    logged."""

    class TwoProcesses:  # this process's digest, and another one from the second process
        count, index = 2, 0

        def allgather(self, key, value):
            return [value, "0" * len(value)]

    trainer = Trainer(tiny_config(total_steps=1), tmp_path, progress=False)
    trainer.rollouts.group = TwoProcesses()
    with pytest.raises(RuntimeError, match="step 3: the processes' policy or drafter params"):
        trainer.rollouts.end_step(3, trainer.state.params)
    trainer.close()


def test_the_checkpoint_holds_every_processs_slice_bandits(tmp_path):
    """Process 0 writes the checkpoint; the other processes' slices' bandit states reach it
    first, in run-wide slice order (only process 0's were saved, so a resumed run's other
    slices started with fresh bandits)."""

    class TwoProcesses:  # process 1 runs slice 1 and answers second
        count, index = 2, 0

        def allgather(self, key, value):
            assert key == "bandits/0"
            return [value, [[1, {"windows": "slice 1's"}]]]

    config = tiny_config(total_steps=1, **{"spec.mode": "adaptive", "spec.threshold": 4})
    trainer = Trainer(config, tmp_path, progress=False)
    own = trainer.slices[0].engine.step_policy.state_dict()
    assert own  # the adaptive policy has state to keep
    trainer.rollouts.group = TwoProcesses()
    bandits = trainer.rollouts.run_bandit_states(0)
    assert bandits == [own, {"windows": "slice 1's"}]
    extra, _, _ = trainer.rollouts.state_dict(bandits)
    assert extra["bandits"] == bandits and extra["bandit"] == own
    trainer.close()


def test_processes_that_restored_different_steps_stop_before_training():
    from tlt_jax.rl.resume import check_same_restore

    class TwoProcesses:
        count, index = 2, 0

        def __init__(self, other):
            self.other = other

        def allgather(self, key, value):
            assert key == "restored_step"
            return [value, self.other]

    check_same_restore(TwoProcesses(4), 4, "/ckpt")
    check_same_restore(TwoProcesses(None), None, "/ckpt")
    with pytest.raises(RuntimeError, match=r"steps by process: \[4, None\].*is /ckpt one"):
        check_same_restore(TwoProcesses(None), 4, "/ckpt")


def test_weight_sync_rejects_mismatched_weights(tmp_path):
    trainer = Trainer(tiny_config(total_steps=1), tmp_path, progress=False)
    params = trainer.state.params
    bad_dtype = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    with pytest.raises(ValueError, match="dtype"):
        trainer.engine.update_params(bad_dtype)
    leaves, treedef = jax.tree.flatten(params)
    bad_shape = jax.tree.unflatten(treedef, [jnp.zeros((3,))] + leaves[1:])
    with pytest.raises(ValueError, match="shape"):
        trainer.engine.update_params(bad_shape)
    trainer.close()


def test_evaluate_run_scores_the_latest_checkpoint(tmp_path, monkeypatch):
    from tlt_jax.rl import evaluation
    from tlt_jax.rl.run import evaluate_run

    # The weights each evaluation's engine holds (the tiny policy's greedy answers are the
    # same before and after 2 steps, so the answers alone cannot tell).
    weights, evaluate = [], evaluation.evaluate

    def spy(engine, *args, **kwargs):
        weights.append([np.asarray(x) for x in jax.tree.leaves(engine.params)])
        return evaluate(engine, *args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate", spy)
    trainer = Trainer(tiny_config(total_steps=2, **{"eval.num_problems": 4}), tmp_path,
                      progress=False)  # fmt: skip
    trainer.train()
    trained = trainer.evaluate()  # the trained weights, in the run's own engine
    trainer.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    step, result = evaluate_run(tiny_config(**{"eval.num_problems": 4}), tmp_path)
    assert step == 2 and result.num_problems == 4 and len(result.responses) == 4
    assert result.responses == trained.responses and result.correct == trained.correct
    step, _ = evaluate_run(tiny_config(**{"eval.num_problems": 2}), None)
    assert step == 0
    with _no_model_load("the missing workdir was named"):  # a typo is not the untrained model
        with pytest.raises(FileNotFoundError, match=r"workdir='.*/typo' is not a directory"):
            evaluate_run(tiny_config(), tmp_path / "typo")
    with _no_model_load("num_problems=0 was refused"):  # it printed "nan +- nan (n=0)"
        with pytest.raises(ValueError, match=r"num_problems=0 \(from eval.num_problems\)"):
            evaluate_run(tiny_config(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == files  # evaluation writes nothing
    # The checkpoint's weights are the trained ones; the untrained model's differ.
    run_weights, from_checkpoint, untrained = weights
    for a, b in zip(run_weights, from_checkpoint, strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(run_weights, untrained, strict=True))


def _train_one_step(workdir, **overrides):
    """A tiny run of one step in `workdir`, closed (its checkpoint is step 1)."""
    trainer = Trainer(tiny_config(total_steps=1, **overrides), workdir, progress=False)
    trainer.train()
    trainer.close()


@contextlib.contextmanager
def _no_model_load(before: str):
    """Inside the block, loading the policy fails the test: `before` had to come first."""
    from tlt_jax.rl import policy

    def no_model(*args, **kwargs):
        raise AssertionError(f"the model loaded before {before}")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(policy, "build_policy", no_model)
        yield


def test_a_train_prompt_longer_than_the_limit_is_refused_before_the_model_loads(tmp_path):
    """Prompts were encoded step by step: a split with one prompt over
    `rollout.max_prompt_len` failed at whichever step drew it (after hours, and again at the
    same step on resume). The whole split is checked at start-up, and the ids are kept."""
    config = tiny_config(**{"rollout.max_prompt_len": 12})
    with _no_model_load("the prompts' lengths were checked"):
        with pytest.raises(ValueError, match=r"\d+ of the 200 prompts of the train split have "
                           r"more than rollout\.max_prompt_len=12 tokens \(the longest: "
                           r"\d+\); raise --config\.rollout\.max_prompt_len"):  # fmt: skip
            Trainer(config, tmp_path, progress=False)
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_an_evaluated_prompt_longer_than_the_limit_is_refused_before_the_model_loads(
        tmp_path, monkeypatch):  # fmt: skip
    """Only the train split was checked at start-up: a long test question failed the run's
    last evaluation, after every training step (and `evaluate_run` after its model load)."""
    from tlt_jax.data import pipeline
    from tlt_jax.rl import run, trainer

    read = []

    def with_a_long_test_question(data, split):
        read.append(split)
        examples = pipeline.load_data(data, split)
        if split == data.eval_split:
            examples = [{**examples[0], "question": "1 + 1 " * 40}, *examples[1:]]
        return examples

    for module in (trainer, run):
        monkeypatch.setattr(module, "load_data", with_a_long_test_question)
    config = tiny_config(**{"rollout.max_prompt_len": 48, "eval.num_problems": 4})
    want = (r"1 of the 4 prompts of the test split( \(evaluated\))? have more than "
            r"rollout\.max_prompt_len=48 tokens")  # fmt: skip
    with _no_model_load("the evaluated prompts' lengths were checked"):
        with pytest.raises(ValueError, match=want):
            Trainer(config, tmp_path, progress=False)
        with pytest.raises(ValueError, match=want):
            run.evaluate_run(config, None)
    # A run that evaluates nothing neither reads nor checks the split.
    for settings in ({"eval.num_problems": 0}, {"eval.at_start": False, "eval.at_end": False}):
        read.clear()
        Trainer(tiny_config(**{"rollout.max_prompt_len": 48, **settings}), tmp_path,
                progress=False).close()  # fmt: skip
        assert read == ["train"]


def test_evaluation_counts_answers_it_could_not_score_and_uses_the_runs_time_limit(caplog):
    """Evaluation scored with `score_batch`'s default 5 s limit, not `rl.reward_timeout_s`,
    and kept no count of failed scores: a timed-out answer was a silent wrong one."""
    from tlt_jax.rl import evaluation

    class Engine:
        def generate(self, requests, progress=None):
            return [type("C", (), {"token_ids": [ord(c) for c in text]})()
                    for text in ("7", "slow", "boom")]  # fmt: skip

    def reward(completion, answer):
        if completion == "slow":
            time.sleep(0.5)
        if completion == "boom":
            raise RuntimeError("no")
        return float(completion == answer)

    examples = [{"question": q, "answer": "7"} for q in "abc"]
    kwargs = dict(max_new_tokens=4, stop_ids=(), reward_fn=reward, progress=False)
    decode = lambda ids: "".join(map(chr, ids))  # noqa: E731
    with caplog.at_level(logging.WARNING):
        result = evaluation.evaluate(Engine(), lambda q: (1,), decode, examples,
                                     reward_timeout_s=0.1, **kwargs)  # fmt: skip
    assert result.correct == (True, False, False)
    assert (result.num_errors, result.num_timeouts) == (1, 1)
    assert "(1 scoring errors, 1 scoring timeouts, scored wrong)" in result.summary()
    assert "2 of 3 answers could not be scored" in caplog.text
    assert evaluation.EvalResult.from_dict(result.to_dict()) == result
    old = {k: v for k, v in result.to_dict().items() if not k.startswith("num_e")
           and k != "num_timeouts"}  # a result saved before the counts  # fmt: skip
    assert evaluation.EvalResult.from_dict(old).num_timeouts == 0
    slow_ok = evaluation.evaluate(Engine(), lambda q: (1,), decode, examples,
                                  reward_timeout_s=2.0, **kwargs)  # fmt: skip
    assert slow_ok.num_timeouts == 0 and slow_ok.num_errors == 1


def test_evaluate_run_refuses_a_checkpoint_of_another_model(tmp_path):
    """`evaluate_run` never compared the checkpoint's model with the config's: evaluating
    under another model of the same shapes ran silently. It is refused before the model
    loads unless `checkpoint.allow_model_change`; evaluating on other data stays allowed."""
    from tlt_jax.rl.run import evaluate_run

    _train_one_step(tmp_path)
    other = {"eval.num_problems": 2, "model.init_seed": 1}
    message = re.escape("another model: model.init_seed (checkpoint 0, this run 1). Evaluate "
                        "with the checkpoint's model config")  # fmt: skip
    with _no_model_load("the model's identity was checked"):
        with pytest.raises(ValueError, match=message):
            evaluate_run(tiny_config(**other), tmp_path)
    step, result = evaluate_run(tiny_config(**{"eval.num_problems": 2, "data.seed": 5}),
                                tmp_path)  # fmt: skip
    assert step == 1 and result.num_problems == 2
    step, _ = evaluate_run(tiny_config(**other, **{"checkpoint.allow_model_change": True}),
                           tmp_path)  # fmt: skip
    assert step == 1


def test_a_resumed_run_reuses_the_before_evaluation_only_under_the_same_eval_settings(
        tmp_path, monkeypatch):  # fmt: skip
    """`eval_before.json` (the untrained policy's, which a resumed run cannot redo) is the
    run's own only under the same eval settings: a run resumed with another
    `eval.num_problems` reported a paired difference over other problems, or failed in its
    report after training ("not the same problems"). Each run draws its plots once (the
    run's end drew the last step's a second time)."""
    from tlt_jax.rl import trainer as trainer_module
    from tlt_jax.rl.run import train_and_evaluate

    drawn = []
    write_plots = trainer_module.write_plots
    monkeypatch.setattr(trainer_module, "write_plots",
                        lambda *a, **k: drawn.append(1) or write_plots(*a, **k))  # fmt: skip

    def run(num_problems):
        config = tiny_config(total_steps=1, plot_every=100,
                             **{"eval.num_problems": num_problems})  # fmt: skip
        return train_and_evaluate(config, tmp_path, progress=False)

    first = run(4)
    assert first["before"]["num_problems"] == 4 and first["paired"]["n"] == 4
    assert len(drawn) == 1 and first["plots"]
    same = run(4)  # resumed at step 1: nothing to train, the saved before-result is reused
    assert same["before"] == first["before"] and same["paired"]["n"] == 4
    assert len(drawn) == 2  # its steps ran before: no timeline of its own, the rest anew
    other = run(2)
    assert other["after"]["num_problems"] == 2
    assert other["before"] is None and other["paired"] is None


def test_the_saved_before_evaluation_is_held_to_the_model_and_scorer(tmp_path, caplog):
    """A run killed before its first checkpoint and rerun with another model (no checkpoint
    to refuse it), or resumed with another reward function, reused `eval_before.json` as its
    own; a torn file stopped every resume. Now they are evaluated anew or not reported."""
    from tlt_jax.rl import evaluation
    from tlt_jax.rl.run import _eval_settings, _load_eval, _save_eval

    result = evaluation.EvalResult(accuracy=0.5, stderr=0.35, num_problems=2, mean_length=3.0,
                                   correct=(True, False), lengths=(2, 4), seconds=1.0)  # fmt: skip
    config = tiny_config(**{"eval.num_problems": 2})
    settings = _eval_settings(config)
    _save_eval(tmp_path, "before", result, 0, settings)
    assert _load_eval(tmp_path, "before", settings) is not None
    for other in ({"model.init_seed": 1}, {"model.dtype": "bfloat16"},
                  {"rl.reward_fn": "rl_testing:slow_mean_byte_reward"}):  # fmt: skip
        changed = _eval_settings(tiny_config(**{"eval.num_problems": 2}, **other))
        assert _load_eval(tmp_path, "before", changed) is None, other
    moved = _eval_settings(tiny_config(**{"eval.num_problems": 2, "data.cache_dir": "/x"}))
    assert _load_eval(tmp_path, "before", moved) is not None  # where TFDS caches is no setting
    # A file written before the model and scorer were recorded is held to what it recorded.
    path = tmp_path / "eval_before.json"
    old = json.loads(path.read_text())
    del old["settings"]["model"], old["settings"]["reward_fn"]
    path.write_text(json.dumps(old))
    assert _load_eval(tmp_path, "before", settings) is not None
    path.write_text(path.read_text()[:40])
    with caplog.at_level("WARNING"):
        assert _load_eval(tmp_path, "before", settings) is None
    assert "eval_before.json does not parse" in caplog.text


def test_a_resume_under_another_data_config_is_refused_unless_allowed(tmp_path):
    """A run resumed with another `data` group used to only log a warning and then train on
    the other data from the checkpoint's position: it is refused before the model loads,
    naming each field with both values, and the checkpoint stays resumable;
    `checkpoint.allow_data_change` lets it through (a position past the new split's end
    starts the next epoch)."""
    from tlt_jax.data.pipeline import DataConfig
    from tlt_jax.rl.config import data_changes

    _train_one_step(tmp_path)
    changed = {"data.seed": 5, "data.instruction": "Answer."}
    message = re.escape(f"checkpoint {tmp_path / 'checkpoints'}/1 was written by a run with "
                        "another data config: data.instruction (checkpoint '', this run "
                        "'Answer.'), data.seed (checkpoint 0, this run 5).")  # fmt: skip
    with _no_model_load("the data config was checked"):
        with pytest.raises(ValueError, match=message):
            Trainer(tiny_config(total_steps=2, **changed), tmp_path, progress=False)
    same = Trainer(tiny_config(total_steps=1), tmp_path, progress=False)
    assert same.restored_from == 1
    assert same.iterator.state() == {"epoch": 0, "index": 2, "shuffle": 2}
    same.close()
    allowed_config = tiny_config(
        total_steps=1, **changed, **{"data.num_train": 1, "checkpoint.allow_data_change": True}
    )
    allowed = Trainer(allowed_config, tmp_path, progress=False)
    assert allowed.restored_from == 1
    assert allowed.iterator.state() == {"epoch": 1, "index": 0, "shuffle": 2}
    allowed.close()
    # Another drafter is not refused (SD is lossless) but named: this checkpoint's run
    # trained none online, so the rollouts draft with the new one.
    from tlt_jax.checkpointing.manager import RunCheckpointer
    from tlt_jax.rl.resume import check_resumed_drafter

    checkpointer = RunCheckpointer(tmp_path / "checkpoints")
    assert check_resumed_drafter(checkpointer, tiny_config()) is None
    warned = check_resumed_drafter(checkpointer, tiny_config(**{"spec.drafter": "/x/eagle"}))
    assert "spec.drafter changed" in warned and "'', this run: '/x/eagle'" in warned
    assert "the rollouts draft with this run's" in warned
    stored = checkpointer.read_config(1)
    stored["spot"]["enabled"] = True  # as if its run had spot-trained a drafter
    checkpointer.read_config = lambda step=None: stored
    spot = tiny_config(**{"spec.drafter": "/x/eagle", "spot.enabled": True, "spot.slices": 2})
    assert "spot-trained drafter is restored" in check_resumed_drafter(checkpointer, spot)
    checkpointer.close()
    # A field the checkpoint predates counts as its default; the TFDS cache is no data.
    assert data_changes({"data": {}}, DataConfig()) == {}
    assert data_changes({"data": {"cache_dir": "/elsewhere"}}, DataConfig()) == {}
    assert data_changes({"data": {}}, DataConfig(seed=3)) == {"data.seed": (0, 3)}
    # A field only the other dataset reads is no change (two gsm8k runs never read
    # `data.level`); it is one where either run read it.
    gsm8k = {"name": "gsm8k", "data_dir": "/d", "level": "level1", "num_train": 8}
    assert data_changes({"data": gsm8k}, DataConfig(name="gsm8k", data_dir="/d")) == {}
    assert data_changes({"data": {"level": "level1"}}, DataConfig(name="gsm8k", data_dir="/d")) \
        == {"data.name": ("arithmetic", "gsm8k"), "data.data_dir": (None, "/d"),
            "data.level": ("level1", "mixed")}  # fmt: skip


def test_a_resume_follows_the_gsm8k_files_content_not_their_path(tmp_path):
    """`data.data_dir` was compared as a string: files edited in place resumed silently (the
    position and the before-evaluation then belong to other problems), while the same folder
    spelled differently was refused. The checkpoint keeps the files' digest and it decides."""
    import shutil

    def folder(name, answer):
        path = tmp_path / name
        path.mkdir()
        rows = [{"question": f"{a} + {b}?", "answer": f"#### {a + b + answer}"}
                for a in range(4) for b in range(3)]  # fmt: skip
        (path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (path / "test.jsonl").write_text(json.dumps(rows[0]) + "\n")
        return path

    data = folder("gsm8k", 0)
    work = tmp_path / "work"

    def gsm8k(path, **more):
        return {"data.name": "gsm8k", "data.data_dir": str(path),
                "data.cache_dir": str(tmp_path / "tfds"), **more}  # fmt: skip

    _train_one_step(work, **gsm8k(data))
    moved = tmp_path / "moved"
    shutil.copytree(data, moved)
    same = Trainer(tiny_config(total_steps=1, **gsm8k(moved)), work, progress=False)
    assert same.restored_from == 1  # the same files under another path
    same.close()
    (data / "train.jsonl").write_text((folder("edited", 1) / "train.jsonl").read_text())
    with _no_model_load("the data files were compared"):
        with pytest.raises(
            ValueError,
            match=r"another data config: data files \(content\) "
            r"\(checkpoint 'files_[0-9a-f]{12}', this run 'files_[0-9a-f]{12}'\)",
        ):
            Trainer(tiny_config(total_steps=1, **gsm8k(data)), work, progress=False)


def test_a_resume_of_another_model_is_refused_unless_allowed(tmp_path):
    """A run with a KL penalty resumed with another `model.init_seed` only logged "changed
    config groups ['model']" and then took the other model as its KL reference (the
    reference is rebuilt from the loaded model, not checkpointed): it is refused before the
    model loads, naming the field with both values; `checkpoint.allow_model_change` lets it
    through. Fields that keep the weights (dtypes, mesh, architecture) are free."""
    from tlt_jax.rl.config import ModelSettings, model_changes

    _train_one_step(tmp_path, **{"rl.kl_coef": 0.5})
    other = {"rl.kl_coef": 0.5, "model.init_seed": 1}
    message = re.escape(f"checkpoint {tmp_path / 'checkpoints'}/1 was written by a run of "
                        "another model: model.init_seed (checkpoint 0, this run 1).")  # fmt: skip
    with _no_model_load("the model's identity was checked"):
        with pytest.raises(ValueError, match=message):
            Trainer(tiny_config(total_steps=2, **other), tmp_path, progress=False)
    allow = {"checkpoint.allow_model_change": True}
    allowed = Trainer(tiny_config(total_steps=1, **other, **allow), tmp_path, progress=False)
    assert allowed.restored_from == 1
    allowed.close()
    stored = {"model": {"preset": "tiny", "tokenizer": "byte"}}  # fields it lacks: defaults
    free = ModelSettings(preset="tiny", tokenizer="byte", dtype="bfloat16",
                         param_dtype="bfloat16", mesh_shape=(1, 2),
                         architecture="tiny")  # fmt: skip
    assert model_changes(stored, None, free, None) == {}
    assert model_changes(stored, None, ModelSettings(preset="smollm2_135m", tokenizer="byte"),
                         None) == {"model.preset": ("tiny", "smollm2_135m")}  # fmt: skip
    assert model_changes({"model": {"name": "/a"}}, None, ModelSettings(name="/b"), "f2") == {
        "model.name": ("/a", "/b")}  # no stored fingerprint: the paths are compared  # fmt: skip


def test_a_resume_over_tokenizer_files_edited_in_place_is_refused(tmp_path, monkeypatch):
    """Only the weights were fingerprinted, so a checkpoint's tokenizer edited in place (another
    chat template: other prompt tokens under the same `model.tokenizer`) resumed silently. The
    run stores its tokenizer files' fingerprint; another one is refused before the model
    loads, as another model is; the same one resumes."""
    from tlt_jax.checkpointing.manager import RunCheckpointer
    from tlt_jax.rl import policy
    from tlt_jax.rl.config import ModelSettings, model_changes

    monkeypatch.setattr(policy, "tokenizer_fingerprint", lambda settings: "aaaa")
    _train_one_step(tmp_path)
    checkpointer = RunCheckpointer(tmp_path / "checkpoints")
    assert checkpointer.read_tokenizer(1) == "aaaa" and checkpointer.read_weights(1) is None
    checkpointer.close()
    monkeypatch.setattr(policy, "tokenizer_fingerprint", lambda settings: "bbbb")
    message = re.escape(f"checkpoint {tmp_path / 'checkpoints'}/1 was written by a run of "
                        "another model: model.tokenizer (checkpoint \"'byte' (files aaaa)\", "
                        "this run \"'byte' (files bbbb)\").")  # fmt: skip
    with _no_model_load("the tokenizer files were checked"):
        with pytest.raises(ValueError, match=message):
            Trainer(tiny_config(total_steps=2), tmp_path, progress=False)
    monkeypatch.setattr(policy, "tokenizer_fingerprint", lambda settings: "aaaa")
    same = Trainer(tiny_config(total_steps=2), tmp_path, progress=False)
    assert same.restored_from == 1
    same.close()
    # A checkpoint without one (a GGUF model's, or written before it existed) compares none.
    settings = ModelSettings(name="/m", tokenizer="checkpoint")
    stored = {"model": {"name": "/m", "tokenizer": "checkpoint"}}
    assert model_changes(stored, None, settings, None, tokenizer="bbbb") == {}


def test_a_resume_from_a_moved_checkpoint_is_allowed_from_other_weights_refused(tmp_path):
    """The model's `name` is a path: the same weights moved elsewhere resume, other weights
    of the same shapes (which only logged a warning and became the KL reference) do not."""
    import shutil

    from tlt_jax.models import checkpoints

    config = get_preset("tiny")
    weights = checkpoints.export_hf(init_model(config, seed=0), tmp_path / "weights")
    other = checkpoints.export_hf(init_model(config, seed=1), tmp_path / "other")

    def run(name, total_steps):
        overrides = {"model.preset": "", "model.name": str(name), "rl.kl_coef": 0.5}
        return Trainer(tiny_config(total_steps=total_steps, **overrides), tmp_path / "run",
                       progress=False)  # fmt: skip

    first = run(weights, 1)
    first.train()
    first.close()
    moved = shutil.move(weights, tmp_path / "moved")
    resumed = run(moved, 1)
    assert resumed.restored_from == 1
    resumed.close()
    fingerprint = checkpoints.weights_fingerprint
    message = re.escape(f"model.name (checkpoint '{weights} (weights {fingerprint(moved)})', "
                        f"this run '{other} (weights {fingerprint(other)})')")  # fmt: skip
    with pytest.raises(ValueError, match=message):
        run(other, 2)


def test_the_report_names_the_step_this_process_compiled_before(tmp_path):
    """The report said "compiled before step 1" on a resumed run, and on a run with no step
    left it reported the earlier process's compile_report.json as its own."""
    from tlt_jax.rl.run import train_and_evaluate

    def report_lines(total_steps):
        # The held-out evaluation before step 1 runs the rollout engine from the shared pool.
        config = tiny_config(total_steps=total_steps, plot_every=100,
                             **{"eval.num_problems": 2})  # fmt: skip
        report = train_and_evaluate(config, tmp_path, progress=False)["report"]
        # Writing the record and the checkpoint after a step is no part of its step_time; the
        # report says how long it took (a run with no step left has none).
        between = re.search(r"between this process's steps \(.*\): ([\d.]+) s", report)
        assert (between is not None) == ("resumed from 2" not in report), report
        return [line for line in report.splitlines()
                if line.startswith(("steps:", "programs compiled"))]  # fmt: skip

    fresh, resumed, finished = report_lines(1), report_lines(2), report_lines(2)
    assert fresh[0] == "steps: 1 (config total_steps 1; not resumed)"
    assert fresh[1].startswith("programs compiled before this process's first step (step 1): ")
    # The shared pool's engine programs (the evaluation's) are told apart from the train
    # step's (gradient, apply, ...): the line called them all train programs.
    counts = re.search(r": (\d+) in .* s \(the train step's (\d+) in .* s, the rollout "
                       r"engine's (\d+) in", fresh[1]).groups()  # fmt: skip
    total, train, engine = map(int, counts)
    assert total == train + engine and train >= 2 and engine >= 2
    assert resumed[0] == "steps: 2 (config total_steps 2; resumed from 1)"
    assert resumed[1].startswith("programs compiled before this process's first step (step 2): ")
    assert finished == ["steps: 2 (config total_steps 2; resumed from 2)"]  # compiled nothing


def test_kl_to_the_frozen_initial_policy(tmp_path):
    config = tiny_config(total_steps=2, **{"rl.kl_coef": 0.5})
    trainer = Trainer(config, tmp_path, progress=False)
    initial = jax.tree.map(np.asarray, trainer.reference_params)
    records = trainer.train()
    # Step 1 samples from the reference itself (KL 0); after one update the policy has moved.
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert records[1]["kl"] > 0
    for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(trainer.reference_params),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)  # the reference never changes
    trainer.close()
    without = Trainer(tiny_config(total_steps=1), tmp_path / "no_kl", progress=False)
    assert without.reference_params is None  # kl_coef == 0 keeps no reference copy
    without.close()


def test_tlt_adaptive_rollouts_in_the_rl_loop_and_the_bandit_resumes(tmp_path):
    # Random tiny models rarely stop early (no tail): a threshold of the whole batch (8).
    # epsilon 1 and a window of 2: whichever arm the timings favour, the other (even when
    # dominated) is retried every 2 steps, so both arms run.
    spec = {"spec.mode": "adaptive", "spec.threshold": 8, "spec.warmup_steps": 1,
            "spec.epsilon": 1.0, "spec.window": 2, "spec.epsilon_decay": False,
            "spec.bucket_bounds": (1, 2, 3), "spec.strategies": ("3,1,4", "2,1,3", "1,1,2"),
            "rollout.max_new_tokens": 24}  # fmt: skip
    config = tiny_config(total_steps=2, checkpoint_every=2, **spec)
    trainer = Trainer(config, tmp_path, progress=False)
    assert trainer.threshold == 8
    records = trainer.train()
    rewards = trainer.engine.step_policy.median_rewards()
    trainer.close()
    for record in records:
        assert 0 < record["sd_step_share"] < 1 and record["sd_threshold"] == 8
        assert record["accept_len_ngram"] >= 1.0
        assert sum(record["sd_choices"].values()) == record["sd_steps"] + sum(
            n for arm, n in record["sd_choices"].items() if arm.endswith("/plain")
        )
        assert 0 < record["long_tail_share"] <= 1 and record["sd_tail_s"] > 0
        assert record["logprob_diff"] < 1e-4  # SD steps report the trainer's logprobs
    assert rewards and any("ngram" in arm for arm in rewards)
    # The bandit's windows and random stream are in the checkpoint.
    resumed = Trainer(config, tmp_path, progress=False)
    assert resumed.restored_from == 2
    assert resumed.engine.step_policy.median_rewards() == rewards
    resumed.close()


def test_spec_max_cost_ratio_rederives_the_calibration_files_threshold(tmp_path):
    from tlt_jax.rl import policy
    from tlt_jax.rollout.calibrate import Calibration

    # verify / plain per bucket: 1.18, 1.03, 1.05, 1.69, 1.32, 1.94 (hand-computed bounds below)
    plain = {1: 100.0, 2: 100.0, 4: 100.0, 8: 100.0, 16: 100.0, 32: 100.0}
    verify = {1: 118.0, 2: 103.0, 4: 105.0, 8: 169.0, 16: 132.0, 32: 194.0}
    path = Calibration(32, 2, 2.0, plain, verify, 1.0, "cpu").save(tmp_path / "cal.json")
    calibration = Calibration.from_dict(json.loads(path.read_text()))
    assert [calibration.threshold_at(r) for r in (1.0, 1.04, 1.1, 1.4, 1.7, 2.0)] == [
        0, 2, 4, 16, 16, 32]  # fmt: skip
    with pytest.raises(ValueError, match="max_cost_ratio=0"):
        calibration.threshold_at(0)

    def threshold(**spec):
        config = tiny_config(**{"spec.mode": "adaptive", "spec.calibration_file": str(path),
                                **{f"spec.{k}": v for k, v in spec.items()}})  # fmt: skip
        return policy.resolve_threshold(config, engine=None)

    assert threshold() == 32  # the file's own
    assert threshold(max_cost_ratio=1.4) == 16
    assert threshold(max_cost_ratio=1.1) == 4
    assert threshold(max_cost_ratio=1.1, threshold=8) == 8  # an explicit threshold wins
    with pytest.raises(ValueError, match=r"spec.max_cost_ratio=-1\.0 must be a number >= 0"):
        tiny_config(**{"spec.max_cost_ratio": -1.0})


def test_spec_threshold_is_calibrated_at_start_without_a_file(tmp_path, monkeypatch):
    from tlt_jax.rl import policy

    config = tiny_config(total_steps=1, **{"spec.mode": "adaptive"})
    trainer = Trainer(config, tmp_path, progress=False)
    trainer.close()
    # A resumed run decodes under the threshold the run started with, measured once: the
    # bandit state it restores was learnt under it (it was measured anew on every start).
    monkeypatch.setattr(policy.calibrate_lib, "calibrate",
                        lambda *a, **k: pytest.fail("measured again on resume"))  # fmt: skip
    again = Trainer(config, tmp_path, progress=False)
    again.close()
    assert again.threshold == trainer.threshold
    monkeypatch.undo()
    saved = json.loads((tmp_path / "spec_calibration.json").read_text())
    timed = [int(b) for b in saved["plain_ms"]]
    ratios = saved["cost_ratio"]
    assert timed == [1, 2, 4, 8][: len(timed)] and timed
    if len(timed) < 4:  # stopped early: two buckets in a row past the bound
        assert all(ratios[str(b)] >= saved["max_cost_ratio"] for b in timed[-2:])
    assert saved["threshold"] == trainer.threshold
    want = max((int(b) for b, r in ratios.items() if r < saved["max_cost_ratio"]), default=0)
    assert trainer.threshold == want
    # A torn file (written in place by older versions) is measured anew, not a failed resume.
    path = tmp_path / "spec_calibration.json"
    path.write_text(path.read_text()[:30])
    measured = []
    real = policy.calibrate_lib.calibrate
    monkeypatch.setattr(policy.calibrate_lib, "calibrate",
                        lambda *a, **k: measured.append(1) or real(*a, **k))  # fmt: skip
    third = Trainer(config, tmp_path, progress=False)
    third.close()
    monkeypatch.undo()
    assert measured and json.loads(path.read_text())["threshold"] == third.threshold
    with pytest.raises(FileNotFoundError, match="spec.calibration_file='/nowhere.json'"):
        Trainer(tiny_config(**{"spec.mode": "adaptive", "spec.calibration_file": "/nowhere.json"}),
                tmp_path / "other", progress=False)  # fmt: skip
    # Also beside a threshold, which overrides the file: a wrong path is not silently unused.
    with pytest.raises(FileNotFoundError, match="spec.calibration_file='/nowhere.json'"):
        Trainer(tiny_config(**{"spec.mode": "adaptive", "spec.threshold": 4,
                               "spec.calibration_file": "/nowhere.json"}),
                tmp_path / "third", progress=False)  # fmt: skip


def test_a_workdir_that_is_a_file_or_a_url_is_refused_by_name(tmp_path, monkeypatch):
    """Before anything loads: a file (a bare FileExistsError before) or `gs://bucket/run`
    (Python's file calls made a local folder `gs:/bucket/run` and checkpointed into it)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"--workdir='.*a_file' exists and is not a directory"):
        Trainer(tiny_config(total_steps=1), tmp_path / "a_file", progress=False)
    with pytest.raises(ValueError, match=r"--workdir='gs://bucket/run' is a URL"):
        Trainer(tiny_config(total_steps=1), "gs://bucket/run", progress=False)
    assert not (tmp_path / "gs:").exists()


def test_spec_files_that_cannot_be_read_are_named_before_the_policy_loads(tmp_path, monkeypatch):
    """`spec.drafter` without an HF-EAGLE export in it and a missing `spec.calibration_file`
    failed only after the policy loaded (20-27 s here; minutes for a 7B policy)."""
    from tlt_jax.rl import policy

    def no_model(*args, **kwargs):
        raise AssertionError("the policy loaded before spec's files were checked")

    monkeypatch.setattr(policy, "build_policy", no_model)
    (tmp_path / "empty").mkdir()
    for override, message in [
        ({"spec.drafter": str(tmp_path / "empty")}, r"spec\.drafter=.*empty' is not an HF-EAGLE"),
        ({"spec.calibration_file": str(tmp_path / "no.json")},
         r"spec\.calibration_file=.*no\.json' does not exist"),
    ]:  # fmt: skip
        with pytest.raises(FileNotFoundError, match=message):
            Trainer(tiny_config(total_steps=1, **override), tmp_path / "run", progress=False)
