"""Draft trees with NaN drafter scores and top-k / top-p filtering against a numpy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.models.drafter import init_drafter
from tlt_jax.models.presets import get_preset
from tlt_jax.models.transformer import init_model
from tlt_jax.rollout.draft_tree import Candidates, build_tree, draft_candidates

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
        drafter.init_cache(2, 16), jnp.array([4, 6], jnp.int32), feature, topk=topk,
        depth=depth,
    )  # fmt: skip
    scores = np.asarray(candidates.scores_BxC)
    assert not np.any(np.isnan(scores))
    assert np.all(np.isfinite(scores[0])) and np.all(scores[1] == -np.inf)
    tree = build_tree(candidates, jnp.array([1, 2]), jnp.array([4, 6]), verify_tokens=8,
                      max_depth=depth)  # fmt: skip
    check_tree(tree, candidates, [4, 6], depth)
