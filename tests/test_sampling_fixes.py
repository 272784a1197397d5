"""Draft trees with NaN drafter scores and top-k / top-p filtering against a numpy reference."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.models.decode import DecodeCache
from tlt_jax.models.drafter import init_drafter
from tlt_jax.models.presets import get_preset
from tlt_jax.models.transformer import init_model
from tlt_jax.rollout.draft_tree import Candidates, build_tree, draft_candidates
from tlt_jax.rollout.sampling import PRESELECT, choose_tokens, filtered_logits

# ----------------------------------------------------------------------------- draft trees


def random_candidates(rng, batch, topk, depth, vocab, nan_share, monotone):
    """Candidates laid out as `draft_candidates` lays them out, with NaN scores sprinkled in.

    Siblings get distinct tokens from a small vocabulary (so different branches share tokens,
    as real drafts do). `monotone`: scores are cumulative log-probabilities (NaN propagating to
    descendants, as the drafter's sums do); otherwise arbitrary numbers.
    """
    c = topk + (depth - 1) * topk * topk
    tokens = np.zeros((batch, c), np.int32)
    scores = np.zeros((batch, c), np.float32)
    parents = np.full((batch, c), -1, np.int32)
    for b in range(batch):
        tokens[b, :topk] = rng.permutation(vocab)[:topk]
        logp = np.log(rng.uniform(0.01, 1.0, size=c)).astype(np.float32)
        logp[rng.uniform(size=c) < nan_share] = np.nan
        scores[b, :topk] = logp[:topk]
        frontier = np.arange(topk)
        for level in range(1, depth):
            offset = topk + (level - 1) * topk * topk
            for j, parent in enumerate(frontier):
                children = offset + j * topk + np.arange(topk)
                tokens[b, children] = rng.permutation(vocab)[:topk]
                parents[b, children] = parent
                base = scores[b, parent] if monotone else 0.0
                scores[b, children] = base + logp[children]
            frontier = offset + rng.permutation(topk * topk)[:topk]
    return Candidates(jnp.asarray(tokens), jnp.asarray(scores), jnp.asarray(parents))


def check_tree(tree, candidates, lengths, max_depth):
    """Asserts the tree is consistent and every node sits under its drafted parent."""
    tokens, parents = np.asarray(tree.tokens_BxT), np.asarray(tree.parents_BxT)
    depth, mask = np.asarray(tree.depth_BxT), np.asarray(tree.mask_BxTxT)
    cand_tokens = np.asarray(candidates.tokens_BxC)
    cand_parents = np.asarray(candidates.parents_BxC)
    np.testing.assert_array_equal(tree.positions_BxT, np.asarray(lengths)[:, None] + depth)
    for b in range(tokens.shape[0]):
        # The token path from the root of every candidate; siblings are distinct, so unique.
        paths = {}
        for i in range(cand_tokens.shape[1]):
            parent = cand_parents[b, i]
            paths[i] = (paths[parent] if parent >= 0 else ()) + (int(cand_tokens[b, i]),)
        drafted = set(paths.values())
        assert parents[b, 0] == -1 and depth[b, 0] == 0
        assert mask[b, 0].tolist() == [True] + [False] * (tokens.shape[1] - 1)
        node_paths = {0: ()}
        siblings = set()
        for i in range(1, tokens.shape[1]):
            parent = parents[b, i]
            assert 0 <= parent < i, (b, i, parents[b])
            assert (parent, tokens[b, i]) not in siblings, f"duplicate sibling {b=} {i=}"
            siblings.add((parent, tokens[b, i]))
            assert depth[b, i] == depth[b, parent] + 1 <= max_depth
            expected_mask = mask[b, parent].copy()
            expected_mask[i] = True
            np.testing.assert_array_equal(mask[b, i], expected_mask)
            node_paths[i] = node_paths[parent] + (int(tokens[b, i]),)
            assert node_paths[i] in drafted, f"node {i} of row {b} is not a drafted branch"


def test_orphan_of_a_nan_score_is_not_hung_under_the_root():
    # k = 2, depth 2: root children 0 (token 5) and 1 (token 6); 2, 3 under 0; 4, 5 under 1.
    # Candidate 4 (token 5) has a NaN score: top-k used to keep it first without its parent
    # (score -5) and hang it under the root, next to candidate 0, also token 5. Capped by its
    # parent it ranks last; the kept three are 0 (-1), 2 (-2), 3 (-3).
    candidates = Candidates(
        tokens_BxC=jnp.array([[5, 6, 5, 7, 5, 8]], jnp.int32),
        scores_BxC=jnp.array([[-1.0, -5.0, -2.0, -3.0, jnp.nan, -6.0]]),
        parents_BxC=jnp.array([[-1, -1, 0, 0, 1, 1]], jnp.int32),
    )
    tree = build_tree(candidates, jnp.array([1]), jnp.array([10]), verify_tokens=4, max_depth=2)
    assert tree.tokens_BxT.tolist() == [[1, 5, 5, 7]]
    assert tree.parents_BxT.tolist() == [[-1, 0, 1, 1]]
    assert tree.depth_BxT.tolist() == [[0, 1, 2, 2]]
    check_tree(tree, candidates, [10], 2)


@pytest.mark.parametrize("monotone", [True, False])
@pytest.mark.parametrize("topk, depth, verify_tokens", [(2, 3, 6), (3, 3, 8), (4, 4, 16)])
def test_nan_scores_never_give_duplicate_siblings(topk, depth, verify_tokens, monotone):
    rng = np.random.default_rng(topk * 10 + depth)
    batch = 64
    candidates = random_candidates(rng, batch, topk, depth, vocab=topk + 2, nan_share=0.3,
                                   monotone=monotone)  # fmt: skip
    lengths = rng.integers(3, 20, size=batch).astype(np.int32)
    roots = rng.integers(0, 9, size=batch).astype(np.int32)
    tree = jax.jit(build_tree, static_argnames=("verify_tokens", "max_depth"))(
        candidates, jnp.asarray(roots), jnp.asarray(lengths), verify_tokens=verify_tokens,
        max_depth=depth,
    )  # fmt: skip
    check_tree(tree, candidates, lengths, depth)


def test_finite_scores_keep_the_best_candidates():
    # Without NaN, the tree is the verify_tokens - 1 best candidates (the cap changes nothing).
    rng = np.random.default_rng(5)
    candidates = random_candidates(rng, 8, 3, 3, vocab=6, nan_share=0.0, monotone=True)
    tree = build_tree(candidates, jnp.zeros(8, jnp.int32), jnp.zeros(8, jnp.int32),
                      verify_tokens=7, max_depth=3)  # fmt: skip
    check_tree(tree, candidates, np.zeros(8, np.int32), 3)
    scores = np.asarray(candidates.scores_BxC)
    best = np.sort(np.argsort(-scores, axis=1, kind="stable")[:, :6], axis=1)
    np.testing.assert_array_equal(
        tree.tokens_BxT[:, 1:], np.take_along_axis(np.asarray(candidates.tokens_BxC), best, 1)
    )


def test_draft_candidates_maps_nan_logprobs_to_minus_inf():
    # Row 1's root feature is NaN, so its every drafter log-probability is NaN.
    config = get_preset("tiny", vocab_size=32)
    model, drafter = init_model(config, 0), init_drafter(config, 1)
    feature = jax.random.normal(jax.random.key(0), (2, config.hidden_size))
    feature = feature.at[1].set(jnp.nan).astype(config.jnp_dtype)
    topk, depth = 3, 3
    candidates = draft_candidates(
        drafter.params_dict(), drafter.config, model.embed.get_value(), model.head_weight_DxV(),
        DecodeCache.zeros(drafter.config, 2, 16), jnp.array([4, 6], jnp.int32), feature, topk=topk,
        depth=depth,
    )  # fmt: skip
    scores = np.asarray(candidates.scores_BxC)
    assert not np.any(np.isnan(scores))
    assert np.all(np.isfinite(scores[0])) and np.all(scores[1] == -np.inf)
    tree = build_tree(candidates, jnp.array([1, 2]), jnp.array([4, 6]), verify_tokens=8,
                      max_depth=depth)  # fmt: skip
    check_tree(tree, candidates, [4, 6], depth)


# ----------------------------------------------------------------------------- filtering


def reference_keep(scaled, top_k, top_p):
    """Which tokens top-k / top-p keep, by a full sort in float64 (ties keep every tied one)."""
    keep = np.zeros(scaled.shape, bool)
    for b, row in enumerate(scaled):
        ordered = np.sort(row.astype(np.float64))[::-1]
        threshold = -np.inf
        if 0 < top_k[b] < len(row):
            threshold = ordered[top_k[b] - 1]
        if top_p[b] < 1:
            finite = ordered[np.isfinite(ordered)]
            probs = np.exp(finite - finite[0])
            mass_before = np.concatenate([[0.0], np.cumsum(probs / probs.sum())[:-1]])
            threshold = max(threshold, finite[max(np.sum(mass_before < top_p[b]), 1) - 1])
        keep[b] = row >= threshold
    return keep


def check_filtered(logits, temperature, top_k, top_p, **kwargs):
    """Asserts filtered_logits keeps what the reference keeps, at the scaled values."""
    b = len(logits)
    logits, temperature_B = jnp.asarray(logits), jnp.full(b, temperature, jnp.float32)
    got = np.asarray(filtered_logits(logits, temperature_B, jnp.asarray(top_k, jnp.int32),
                                     jnp.asarray(top_p, jnp.float32), **kwargs))  # fmt: skip
    # The scaling alone (no row filters); XLA's division may differ from numpy's by an ulp.
    scaled = np.asarray(filtered_logits(logits, temperature_B, jnp.zeros(b, jnp.int32),
                                        jnp.ones(b)))  # fmt: skip
    np.testing.assert_allclose(scaled, np.asarray(logits) / temperature, rtol=1e-6)
    keep = reference_keep(scaled, top_k, top_p)
    for row in range(b):
        assert np.array_equal(np.isfinite(got[row]), keep[row] & np.isfinite(scaled[row])), (
            f"row {row}: top_k={top_k[row]} top_p={top_p[row]} kept "
            f"{np.isfinite(got[row]).sum()}, reference {keep[row].sum()}"
        )
    np.testing.assert_array_equal(got[keep], scaled[keep])
    return keep


def test_filtered_logits_matches_full_sort_reference():
    rng = np.random.default_rng(0)
    vocab = 2000
    settings = [(k, p) for k in (0, 1, 7, 50, PRESELECT, PRESELECT + 44, vocab - 1, vocab, 5000)
                for p in (1.0, 0.95, 0.9, 0.5, 0.1)]  # fmt: skip
    top_k, top_p = np.array(settings).T
    # Peaked rows (nucleus inside the pre-selection) and flat ones (far outside it).
    scale = np.where(np.arange(len(settings)) % 2 == 0, 6.0, 0.5)[:, None]
    logits = (rng.standard_normal((len(settings), vocab)) * scale).astype(np.float32)
    keep = check_filtered(logits, 0.8, top_k.astype(int), top_p)
    assert keep[top_p == 1.0].sum(axis=1).max() == vocab  # top_k 0 / >= V with top_p 1
    assert keep.sum(axis=1).max() > PRESELECT  # some rows needed the threshold search


def test_top_p_one_keeps_every_token():
    # Every other token holds about 1e-13 of the mass: the float32 cumulative sum reaches 1 at
    # the first token, and the sort-based filter used to drop the other 999.
    logits = np.zeros((2, 1000), np.float32)
    logits[:, 1:] = -30.0 - np.linspace(0.0, 1.0, 999)
    got = filtered_logits(jnp.asarray(logits), jnp.ones(2), jnp.array([0, 5]), jnp.ones(2))
    assert np.isfinite(np.asarray(got)).sum(axis=1).tolist() == [1000, 5]


def test_nucleus_larger_than_the_preselection():
    # Flat logits: a 0.9 nucleus holds thousands of tokens, far past the top PRESELECT; rows
    # of one batch mix the fast path (peaked, top-k 3) and the search (flat), and -inf logits.
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((4, 8192)) * 0.3).astype(np.float32)
    logits[1] *= 20.0
    logits[2, ::3] = -np.inf
    keep = check_filtered(logits, 1.0, np.array([0, 3, 0, 4000]), np.array([0.9, 1.0, 0.7, 0.99]))
    assert keep[0].sum() > 10 * PRESELECT and keep[1].sum() == 3 and keep[3].sum() == 4000


def test_ties_at_the_threshold_keep_every_tied_token():
    logits = np.zeros((3, 1000), np.float32)
    logits[:, :300] = 2.0  # 300 tokens tied at the top, more than the pre-selection
    logits[2, :2] = 3.0
    keep = check_filtered(logits, 1.0, np.array([10, 0, 0]), np.array([1.0, 0.01, 0.2]))
    # Top-10 and a tiny nucleus both land inside the tie: all 300 stay. Row 2: the two 3.0s
    # hold 2 e^3 / (2 e^3 + 298 e^2 + 700) = 0.014 of the mass, below 0.2, so the nucleus
    # reaches into the 298 tied 2.0s and keeps them all.
    assert keep.sum(axis=1).tolist() == [300, 300, 300]


@pytest.mark.parametrize("preselect", [1, 4, 16])
def test_threshold_search_agrees_with_the_preselected_path(preselect):
    # A small pre-selection sends most rows to the bisection: same kept sets as the default.
    rng = np.random.default_rng(preselect)
    logits = (rng.standard_normal((24, 64)) * rng.uniform(0.2, 5, (24, 1))).astype(np.float32)
    top_k = rng.choice([0, 1, 3, 10, 40], 24)
    top_p = rng.choice([1.0, 0.95, 0.8, 0.3], 24)
    check_filtered(logits, 0.7, top_k, top_p, preselect=preselect)


def test_no_filtering_is_only_scaling_and_nothing_sorts():
    logits = jax.random.normal(jax.random.key(0), (4, 300))
    temperature = jnp.array([0.5, 1.0, 2.0, 0.0])
    got = filtered_logits(logits, temperature, jnp.zeros(4, jnp.int32), jnp.ones(4))
    np.testing.assert_array_equal(got, logits / jnp.array([0.5, 1.0, 2.0, 1.0])[:, None])
    args = (logits, temperature, jnp.array([5, 0, 0, 0]), jnp.array([1.0, 0.9, 1.0, 1.0]))
    sorts = re.compile(r"\bsort\[")  # the primitive, in any branch or loop body
    assert not sorts.search(str(jax.make_jaxpr(filtered_logits)(*args)))
    keys = jax.random.split(jax.random.key(1), 4)
    jaxpr = jax.make_jaxpr(lambda *a: choose_tokens(*a, greedy_only=False))(*args, keys)
    assert not sorts.search(str(jaxpr))
    old_rule = jax.make_jaxpr(lambda x: -jnp.sort(-x, axis=-1))(logits)
    assert sorts.search(str(old_rule))  # the pattern does see a sort


def test_a_batch_that_truncates_nothing_traces_no_filter_and_samples_the_same():
    """`filtering=False` (no sampled request truncates: `needs_filtering`) traces the scaling
    only, and draws exactly what the filtering program draws for such a batch; so does the
    tree acceptance."""
    from tlt_jax.rollout.acceptance import accept_tree
    from tlt_jax.rollout.sampling import SamplingParams, needs_filtering

    assert not needs_filtering([SamplingParams(0.8), SamplingParams(0.0, top_p=0.5, top_k=3)])
    assert needs_filtering([SamplingParams(0.8), SamplingParams(0.8, top_p=0.9)])
    assert needs_filtering([SamplingParams(1.0, top_k=40)])
    assert not needs_filtering([])
    b, v = 6, 300
    logits = jax.random.normal(jax.random.key(5), (b, v)) * 4
    temperature = jnp.array([0.8, 1.0, 0.0, 0.5, 1.3, 0.8])
    top_k, top_p = jnp.zeros(b, jnp.int32), jnp.ones(b)
    keys = jax.random.split(jax.random.key(6), b)
    outs = [jax.jit(lambda *a, f=f: choose_tokens(*a, greedy_only=False, filtering=f))(
        logits, temperature, top_k, top_p, keys) for f in (True, False)]  # fmt: skip
    for got, want in zip(outs[1], outs[0], strict=True):
        np.testing.assert_array_equal(got, want)
    no_filter = str(jax.make_jaxpr(lambda *a: filtered_logits(*a, filtering=False))(
        logits, temperature, top_k, top_p))  # fmt: skip
    assert "top_k" not in no_filter and "cond" not in no_filter
    t = 4  # a chain root -> 1 -> 2 -> 3 per row
    tree_logits = jax.random.normal(jax.random.key(7), (b, t, v)) * 4
    tokens = jax.random.randint(jax.random.key(8), (b, t), 0, v)
    parents = jnp.broadcast_to(jnp.arange(-1, t - 1), (b, t))
    positions = jnp.broadcast_to(jnp.arange(t) + 10, (b, t))
    args = (tree_logits, tokens, parents, positions, temperature, top_k, top_p, keys)
    accepted = [accept_tree(*args, greedy_only=False, filtering=f) for f in (True, False)]
    for got, want in zip(accepted[1], accepted[0], strict=True):
        np.testing.assert_array_equal(got, want)


def test_inverse_cdf_sampling_is_categorical_and_never_draws_zero_mass():
    from scipy import stats

    from tlt_jax.rollout.sampling import sample_from_probs

    weights = np.array([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 4.5], np.float32)  # unnormalised
    n = 20000
    keys = jax.random.split(jax.random.key(3), n)
    draws = np.asarray(jax.jit(sample_from_probs)(keys, jnp.broadcast_to(weights, (n, 7))))
    counts = np.bincount(draws, minlength=7)
    assert counts[[0, 2, 5]].sum() == 0
    expected = weights / weights.sum() * n
    keep = expected > 0
    assert stats.chisquare(counts[keep], expected[keep]).pvalue > 1e-4
    # One-hot rows and a single-token vocabulary.
    one_hot = np.zeros((4, 5), np.float32)
    one_hot[np.arange(4), [4, 0, 2, 3]] = 1.0
    np.testing.assert_array_equal(sample_from_probs(keys[:4], jnp.asarray(one_hot)), [4, 0, 2, 3])
    assert int(sample_from_probs(keys[:1], jnp.ones((1, 1)))[0]) == 0
