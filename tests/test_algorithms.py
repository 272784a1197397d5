"""Hand-computed checks of the RL math in tlt_jax.rl.algorithms."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.rl import algorithms
from tlt_jax.rl.algorithms import AlgorithmConfig

# ---------------------------------------------------------------------------------------------
# Advantages.
# ---------------------------------------------------------------------------------------------

REWARDS_2x4 = [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]


def test_grpo_uses_sample_std_and_all_equal_group_is_zero():
    # Group 0: mean 0.5, deviations +-0.5, sum of squares 4 * 0.25 = 1,
    # sample variance 1 / (4 - 1) = 1/3, std = 0.57735, advantage = 0.5 / 0.57735 = sqrt(3)/2.
    # Group 1: all equal -> deviations 0 -> 0 / (0 + eps) = 0, not NaN.
    a = math.sqrt(3) / 2
    advantages = algorithms.grpo_advantages(jnp.array(REWARDS_2x4))
    np.testing.assert_allclose(advantages, [[a, -a, -a, a], [0, 0, 0, 0]], rtol=1e-5)
    assert not np.any(np.isnan(advantages))


def test_grpo_with_eps_zero_keeps_an_all_equal_group_at_zero():
    """`rl.advantage_eps=0` (pure std scaling) is accepted: an all-equal group must not divide 0
    by 0 (NaN advantages count as signal, the loss turns NaN and the run stops)."""
    config = AlgorithmConfig(advantage_eps=0.0)
    advantages = np.asarray(algorithms.compute_advantages(config, jnp.array(REWARDS_2x4)))
    a = math.sqrt(3) / 2  # 0.5 / sqrt(1/3), as above, without the eps
    np.testing.assert_allclose(advantages, [[a, -a, -a, a], [0, 0, 0, 0]], rtol=1e-6)
    assert not np.any(advantages[1] != 0)


def test_grpo_three_member_group():
    # [3, 1, 2]: mean 2, deviations [1, -1, 0], sample variance (1 + 1 + 0) / 2 = 1, std 1.
    # (The population std would be sqrt(2/3) and give +-1.2247 instead.)
    advantages = algorithms.grpo_advantages(jnp.array([[3.0, 1.0, 2.0]]))
    np.testing.assert_allclose(advantages, [[1.0, -1.0, 0.0]], rtol=1e-5)


def test_dr_grpo_is_mean_centred_only():
    # Group 0: mean 0.5 -> [0.5, -0.5, -0.5, 0.5]; group 1: mean 1 -> zeros.
    advantages = algorithms.dr_grpo_advantages(jnp.array(REWARDS_2x4))
    np.testing.assert_allclose(advantages, [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]])


def test_rloo_leaves_one_out():
    # Group 0: r=1, others (0 + 0 + 1) / 3 = 1/3 -> 2/3; r=0, others (1 + 0 + 1) / 3 -> -2/3.
    # Same as G/(G-1) * (r - mean) = 4/3 * 0.5. Group [3, 1, 2]: 3 - 1.5, 1 - 2.5, 2 - 2.
    two_thirds = 2.0 / 3.0
    advantages = algorithms.rloo_advantages(jnp.array(REWARDS_2x4))
    np.testing.assert_allclose(
        advantages, [[two_thirds, -two_thirds, -two_thirds, two_thirds], [0, 0, 0, 0]], rtol=1e-6
    )
    np.testing.assert_allclose(
        algorithms.rloo_advantages(jnp.array([[3.0, 1.0, 2.0]])), [[1.5, -1.5, 0.0]]
    )


# Constants whose float32 group mean is not exactly the constant for some of these G (eight
# 0.1s average to 0.1 + 7e-9; GRPO used to turn that into -0.007, sixteen 0.7s into -0.106).
@pytest.mark.parametrize("name", sorted(algorithms.ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize("group_size", [3, 8, 16])
@pytest.mark.parametrize("reward", [0.1, 0.7, 1.1, 1.2])
def test_all_equal_group_is_exactly_zero(name, group_size, reward):
    rewards = jnp.full((2, group_size), reward, jnp.float32)
    advantages = algorithms.ADVANTAGE_ESTIMATORS[name](rewards)
    assert advantages.dtype == jnp.float32
    assert np.all(np.asarray(advantages) == 0), np.asarray(advantages)


@pytest.mark.parametrize("name", sorted(algorithms.ADVANTAGE_ESTIMATORS))
def test_has_signal_marks_only_groups_with_different_rewards(name):
    # The trainer skips micro-batches whose groups all have advantage exactly 0
    # (`has_signal = np.any(advantages != 0, axis=1)`): a format-only group (every completion
    # 0.1) must count as no signal, a group with one correct answer as signal.
    rewards = np.array([[0.1] * 8, [1.1] + [0.1] * 7, [0.0] * 8], np.float32)
    config = AlgorithmConfig(advantage_estimator=name)
    advantages = np.asarray(algorithms.compute_advantages(config, rewards), np.float32)
    assert np.any(advantages != 0, axis=1).tolist() == [False, True, False]


def _advantages_float64(name, rewards):
    group_size = rewards.shape[-1]
    centered = rewards - rewards.mean(axis=-1, keepdims=True)
    if name == "grpo":
        return centered / (rewards.std(axis=-1, ddof=1, keepdims=True) + 1e-6)
    if name == "rloo":
        return centered * group_size / (group_size - 1)
    return centered


@pytest.mark.parametrize("name", sorted(algorithms.ADVANTAGE_ESTIMATORS))
def test_advantages_match_float64_on_random_groups(name):
    # The shift by the group's first reward must not cost accuracy on ordinary groups.
    rewards = np.random.default_rng(0).uniform(-2, 3, size=(64, 8)).astype(np.float32)
    got = algorithms.ADVANTAGE_ESTIMATORS[name](jnp.asarray(rewards))
    expected = _advantages_float64(name, rewards.astype(np.float64))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(algorithms.ADVANTAGE_ESTIMATORS))
def test_group_of_one_gives_zero_advantage(name):
    advantages = algorithms.ADVANTAGE_ESTIMATORS[name](jnp.array([[5.0], [-2.0]]))
    np.testing.assert_array_equal(advantages, [[0.0], [0.0]])


# ---------------------------------------------------------------------------------------------
# Aggregations on a ragged mask.
# ---------------------------------------------------------------------------------------------

# Row 3 is pure batch padding; NaN / huge values sit under the mask and must not leak.
RAGGED_LOSS = jnp.array(
    [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, jnp.nan, 9.0], [7.0, jnp.inf, 0.0, 0.0], [100.0] * 4]
)
RAGGED_MASK = jnp.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    "name, expected",
    [
        # (1 + 2 + 3 + 4 + 5 + 6 + 7) / 7 tokens = 28 / 7.
        ("token_mean", 4.0),
        # Sums 10, 11, 7 over the 3 non-empty rows: 28 / 3.
        ("seq_mean_token_sum", 28.0 / 3.0),
        # Means 10/4 = 2.5, 11/2 = 5.5, 7/1 = 7 over 3 rows: 15 / 3.
        ("seq_mean_token_mean", 5.0),
        # Sums 10, 11, 7, each / 8 tokens (Dr. GRPO's constant), over 3 rows: 28 / 24.
        ("seq_mean_token_sum_norm", 28.0 / 24.0),
    ],
)
def test_aggregation_on_ragged_mask(name, expected):
    value = algorithms.aggregator(name, norm_tokens=8)(RAGGED_LOSS, RAGGED_MASK)
    np.testing.assert_allclose(value, expected, rtol=1e-6)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("token_mean", [1 / 7] * 3 + [0.0]),
        ("seq_mean_token_sum", [1 / 3] * 3 + [0.0]),
        ("seq_mean_token_mean", [1 / 12, 1 / 6, 1 / 3, 0.0]),  # 1 / (length * 3 rows)
        ("seq_mean_token_sum_norm", [1 / 24] * 3 + [0.0]),  # 1 / (8 tokens * 3 rows)
    ],
)
def test_token_weights_by_hand_and_against_the_aggregation(name, expected):
    lengths = np.asarray(RAGGED_MASK).sum(1)  # 4, 2, 1, 0
    weights = algorithms.token_weights(name, lengths, norm_tokens=8)
    np.testing.assert_allclose(weights, expected, rtol=1e-12)
    loss = np.nan_to_num(np.asarray(RAGGED_LOSS), nan=0.0, posinf=0.0) * np.asarray(RAGGED_MASK)
    aggregate = algorithms.aggregator(name, norm_tokens=8)(RAGGED_LOSS, RAGGED_MASK)
    np.testing.assert_allclose(np.sum(loss * weights[:, None]), aggregate, rtol=1e-6)
    with pytest.raises(ValueError, match="rl.loss_aggregation='mean'"):
        algorithms.token_weights("mean", lengths)


@pytest.mark.parametrize("name", sorted(algorithms.LOSS_AGGREGATIONS))
def test_aggregation_of_all_padding_is_zero(name):
    value = algorithms.aggregator(name, norm_tokens=8)(jnp.full((2, 3), jnp.nan),
                                                       jnp.zeros((2, 3)))  # fmt: skip
    assert float(value) == 0.0


@pytest.mark.parametrize("norm_tokens", [None, 0, 2.5, True])
def test_the_normed_aggregation_needs_its_constant(norm_tokens):
    match = "rl.loss_aggregation='seq_mean_token_sum_norm' needs rl.loss_norm_tokens"
    with pytest.raises(ValueError, match=match):
        algorithms.token_weights("seq_mean_token_sum_norm", [3, 1], norm_tokens)
    with pytest.raises(ValueError, match=match):
        algorithms.aggregator("seq_mean_token_sum_norm", norm_tokens)


# ---------------------------------------------------------------------------------------------
# Policy loss.
# ---------------------------------------------------------------------------------------------

# Two sequences, eps = 0.2, eps_high = 0.28, so ratios are clipped to [0.8, 1.28].
# Seq 0, A = +1, ratios [1.5, 0.5, 1.0]:
#   1.5 -> -min(1.5, 1.28) = -1.28 (clipped); 0.5 -> -min(0.5, 0.8) = -0.5; 1.0 -> -1.0.
# Seq 1, A = -1, ratios [1.5, 0.5, pad]:
#   1.5 -> -min(-1.5, -1.28) = 1.5; 0.5 -> -min(-0.5, -0.8) = 0.8 (clipped).
# The pad token carries a log-ratio of 1000: exp() would overflow if it were not masked.
RATIOS = np.array([[1.5, 0.5, 1.0], [1.5, 0.5, 1.0]])
OLD_LOGPROBS = jnp.full((2, 3), -2.0)
LOGPROBS = (OLD_LOGPROBS + jnp.log(RATIOS)).at[1, 2].set(998.0)
ADVANTAGES = jnp.array([1.0, -1.0])
MASK = jnp.array([[1, 1, 1], [1, 1, 0]])
LOSS_PARAMS = dict(epsilon=0.2, epsilon_high=0.28)
SUM_0, SUM_1 = -1.28 - 0.5 - 1.0, 1.5 + 0.8  # -2.78, 2.3


@pytest.mark.parametrize(
    "aggregation, expected",
    [
        ("token_mean", (SUM_0 + SUM_1) / 5),  # -0.48 / 5 = -0.096
        ("seq_mean_token_sum", (SUM_0 + SUM_1) / 2),  # -0.24
        ("seq_mean_token_mean", (SUM_0 / 3 + SUM_1 / 2) / 2),  # (-0.92667 + 1.15) / 2 = 0.11167
        ("seq_mean_token_sum_norm", (SUM_0 + SUM_1) / 2 / 4),  # a budget of 4 tokens: -0.06
    ],
)
def test_clipped_policy_loss(aggregation, expected):
    loss, metrics = algorithms.policy_loss(
        LOGPROBS, OLD_LOGPROBS, ADVANTAGES, MASK, aggregation=aggregation, norm_tokens=4,
        **LOSS_PARAMS,
    )  # fmt: skip
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    np.testing.assert_allclose(metrics["pg_loss"], expected, rtol=1e-5)
    assert float(metrics["kl"]) == 0.0
    # Clipping active on seq 0 token 0 and seq 1 token 1: 2 of 5 tokens.
    np.testing.assert_allclose(metrics["clip_fraction"], 0.4, rtol=1e-6)
    # (1.5 + 0.5 + 1.0 + 1.5 + 0.5) / 5 = 1.0.
    np.testing.assert_allclose(metrics["ratio_mean"], 1.0, rtol=1e-6)
    # (r - 1) - ln r: 1.5 -> 0.5 - 0.405465 = 0.094535; 0.5 -> -0.5 + 0.693147 = 0.193147;
    # 1.0 -> 0. Token mean: (2 * 0.094535 + 2 * 0.193147) / 5 = 0.115073.
    np.testing.assert_allclose(metrics["approx_kl_old"], 0.115073, rtol=1e-4)


def test_clip_higher_only_moves_the_upper_bound():
    # A = +1, ratio 1.25: inside [0.8, 1.28] with eps_high 0.28 -> loss -1.25, nothing clipped;
    # symmetric eps 0.2 clips it to 1.2 -> loss -1.2, clip fraction 1.
    logprobs, old, mask = jnp.log(jnp.array([[1.25]])), jnp.zeros((1, 1)), jnp.ones((1, 1))
    for epsilon_high, expected_loss, expected_clip in [(0.28, -1.25, 0.0), (0.2, -1.2, 1.0)]:
        loss, metrics = algorithms.policy_loss(
            logprobs, old, jnp.array([1.0]), mask,
            epsilon=0.2, epsilon_high=epsilon_high, aggregation="token_mean",
        )  # fmt: skip
        np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
        assert float(metrics["clip_fraction"]) == expected_clip


def test_kl_estimators_by_hand():
    # logp - ref = +1: k1 = 1, k3 = exp(-1) - (-1) - 1 = e^-1 = 0.367879.
    # logp - ref = -1: k1 = -1, k3 = exp(1) - 1 - 1 = 0.718282.
    logprobs, ref = jnp.array([-1.0, -2.0]), jnp.array([-2.0, -1.0])
    np.testing.assert_allclose(algorithms.kl_k1(logprobs, ref), [1.0, -1.0])
    np.testing.assert_allclose(
        algorithms.kl_k3(logprobs, ref), [math.exp(-1), math.e - 2], rtol=1e-6
    )
    np.testing.assert_allclose(algorithms.kl_k3(logprobs, logprobs), [0.0, 0.0], atol=1e-7)


@pytest.mark.parametrize("estimator, per_token_kl",
                         [("k1", 1.0), ("k2", 0.5), ("k3", math.exp(-1))])  # fmt: skip
def test_policy_loss_adds_weighted_kl(estimator, per_token_kl):
    # ref = logp - 1 on every real token -> k1 = 1 and k3 = e^-1 per token, token mean the same.
    # loss = -0.096 + 0.1 * kl.
    ref = LOGPROBS - 1.0
    loss, metrics = algorithms.policy_loss(
        LOGPROBS, OLD_LOGPROBS, ADVANTAGES, MASK, aggregation="token_mean",
        ref_logprobs_BxT=ref, kl_coef=0.1, kl_estimator=estimator, **LOSS_PARAMS,
    )  # fmt: skip
    np.testing.assert_allclose(metrics["kl"], per_token_kl, rtol=1e-5)
    np.testing.assert_allclose(loss, -0.096 + 0.1 * per_token_kl, rtol=1e-5)


def test_kl_estimators_gradients_as_loss_terms_are_exact_on_a_small_vocabulary():
    # The expected gradient of a KL loss term over the policy's own samples (each sample a
    # constant: no score-function term), enumerated exactly over 5 tokens, against the exact
    # gradients of both KL directions.
    theta = jnp.array([0.3, -1.2, 0.8, 0.0, -0.4])
    ref_logp = jax.nn.log_softmax(jnp.array([-0.5, 0.4, 0.1, -1.0, 0.9]))

    def expected_term(estimator):
        def term(t):
            logp = jax.nn.log_softmax(t)
            per_token = algorithms.KL_ESTIMATORS[estimator](logp, ref_logp)
            return jnp.sum(jax.lax.stop_gradient(jnp.exp(logp)) * per_token)

        return jax.grad(term)(theta)

    def kl(t):  # KL(policy || reference)
        logp = jax.nn.log_softmax(t)
        return jnp.sum(jnp.exp(logp) * (logp - ref_logp))

    def reverse_kl(t):  # KL(reference || policy)
        return jnp.sum(jnp.exp(ref_logp) * (ref_logp - jax.nn.log_softmax(t)))

    np.testing.assert_allclose(expected_term("k1"), 0.0, atol=1e-6)
    np.testing.assert_allclose(expected_term("k2"), jax.grad(kl)(theta), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(expected_term("k3"), jax.grad(reverse_kl)(theta), rtol=1e-5,
                               atol=1e-7)  # fmt: skip
    assert float(jnp.max(jnp.abs(jax.grad(kl)(theta)))) > 0.05  # not a trivially zero case


def test_kl_needs_reference():
    with pytest.raises(ValueError, match="ref_logprobs_BxT"):
        algorithms.policy_loss(
            LOGPROBS, OLD_LOGPROBS, ADVANTAGES, MASK, aggregation="token_mean",
            kl_coef=0.1, **LOSS_PARAMS,
        )  # fmt: skip


def test_policy_loss_jits_and_has_finite_gradients_despite_padding():
    loss_fn = functools.partial(
        algorithms.policy_loss, aggregation="seq_mean_token_mean", kl_coef=0.1, **LOSS_PARAMS
    )
    jitted = jax.jit(lambda lp, old, a, m, ref: loss_fn(lp, old, a, m, ref_logprobs_BxT=ref))
    ref = LOGPROBS - 1.0
    eager_loss, eager_metrics = loss_fn(
        LOGPROBS, OLD_LOGPROBS, ADVANTAGES, MASK, ref_logprobs_BxT=ref
    )
    jit_loss, jit_metrics = jitted(LOGPROBS, OLD_LOGPROBS, ADVANTAGES, MASK, ref)
    np.testing.assert_allclose(jit_loss, eager_loss, rtol=1e-6)
    np.testing.assert_allclose(jit_metrics["clip_fraction"], eager_metrics["clip_fraction"])

    grads = jax.grad(lambda lp: jitted(lp, OLD_LOGPROBS, ADVANTAGES, MASK, ref)[0])(LOGPROBS)
    assert np.all(np.isfinite(grads))
    assert float(grads[1, 2]) == 0.0  # padding gets no gradient
    # Clipped tokens (seq 0 token 0, seq 1 token 1) get only the KL gradient: 0.1 * d k3 / d logp
    # = 0.1 * (1 - e^-1) / (3 tokens * 2 seqs) for seq 0 token 0.
    np.testing.assert_allclose(grads[0, 0], 0.1 * (1 - math.exp(-1)) / 6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Logit helpers.
# ---------------------------------------------------------------------------------------------


def test_entropy_of_uniform_is_log_vocab():
    logits = jnp.zeros((2, 3, 7))
    mask = jnp.array([[1, 1, 0], [1, 0, 0]])
    np.testing.assert_allclose(algorithms.entropy_from_logits(logits, mask), math.log(7), rtol=1e-6)


def test_entropy_with_masked_out_vocab_entries_and_finite_gradient():
    # Two live logits of equal value -> entropy log 2; the -inf entry has p = 0 and adds 0.
    logits = jnp.array([[[0.0, 0.0, -jnp.inf]]])
    mask = jnp.ones((1, 1))
    np.testing.assert_allclose(algorithms.entropy_from_logits(logits, mask), math.log(2), rtol=1e-6)
    grads = jax.grad(lambda x: algorithms.entropy_from_logits(x, mask))(logits)
    assert np.all(np.isfinite(grads))


def test_entropy_of_peaked_distribution():
    # logits [ln 3, 0] -> p = [3/4, 1/4]; H = -(0.75 ln 0.75 + 0.25 ln 0.25) = 0.562335.
    logits = jnp.array([[[math.log(3.0), 0.0]]])
    np.testing.assert_allclose(
        algorithms.entropy_from_logits(logits, jnp.ones((1, 1))), 0.562335, rtol=1e-5
    )


def test_token_logprobs_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 11)).astype(np.float32)
    tokens = rng.integers(0, 11, size=(2, 5))
    temperature = 0.7
    scaled = logits.astype(np.float64) / temperature
    log_normalizer = np.log(np.sum(np.exp(scaled), axis=-1))
    expected = np.take_along_axis(scaled, tokens[..., None], -1)[..., 0] - log_normalizer
    got = algorithms.token_logprobs(jnp.array(logits), jnp.array(tokens), temperature)
    assert got.shape == (2, 5) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Config.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"advantage_estimator": "foo"},
            "rl.advantage_estimator='foo' is not one of ['dr_grpo', 'grpo', 'rloo']",
        ),
        (
            {"loss_aggregation": "sum"},
            "rl.loss_aggregation='sum' is not one of "
            "['seq_mean_token_mean', 'seq_mean_token_sum', 'seq_mean_token_sum_norm', "
            "'token_mean']",
        ),
        ({"kl_estimator": "k4"}, "rl.kl_estimator='k4' is not one of ['k1', 'k2', 'k3']"),
        ({"kl_estimator": "k1", "kl_coef": 0.1}, "rl.kl_estimator='k1' with rl.kl_coef=0.1"),
        ({"epsilon": -0.1}, "rl.epsilon=-0.1 must be a finite number >= 0"),
        ({"epsilon_high": -0.1}, "rl.epsilon_high=-0.1 must be a finite number >= 0"),
        ({"kl_coef": -1.0}, "rl.kl_coef=-1.0 must be a finite number >= 0"),
        # NaN passes `< 0`; a NaN kl_coef kept a reference model yet trained no KL term
        ({"kl_coef": float("nan")}, "rl.kl_coef=nan must be a finite number >= 0"),
        ({"epsilon_high": float("nan")}, "rl.epsilon_high=nan must be a finite number >= 0"),
        ({"advantage_eps": float("inf")}, "rl.advantage_eps=inf must be a finite number >= 0"),
        ({"epsilon": 1.0}, "rl.epsilon=1.0 must be < 1"),
    ],
)
def test_config_validation_messages(kwargs, message):
    with pytest.raises(ValueError) as error:
        AlgorithmConfig(**kwargs)
    assert str(error.value).startswith(message)


def test_config_defaults_and_epsilon_high():
    config = AlgorithmConfig(epsilon=0.1)
    assert config.epsilon_high == 0.1
    assert AlgorithmConfig(epsilon_high=0.28).epsilon_high == 0.28
    assert hash(config) == hash(AlgorithmConfig(epsilon=0.1))  # usable as a jit static arg


def test_compute_advantages_and_loss_dispatch_through_config():
    config = AlgorithmConfig(
        advantage_estimator="dr_grpo", loss_aggregation="seq_mean_token_sum", epsilon_high=0.28
    )
    np.testing.assert_allclose(
        algorithms.compute_advantages(config, jnp.array(REWARDS_2x4))[0], [0.5, -0.5, -0.5, 0.5]
    )
    loss_fn = jax.jit(algorithms.compute_loss, static_argnums=0)
    loss, _ = loss_fn(config, LOGPROBS, OLD_LOGPROBS, ADVANTAGES, MASK)
    np.testing.assert_allclose(loss, -0.24, rtol=1e-5)
