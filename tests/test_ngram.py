"""Model-free n-gram draft trees: index semantics against a brute-force reference, tree validity,
inert padding under the real acceptance code, hybrid merging, and greedy parity of n-gram SD
with plain greedy decoding on the tiny model."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.models.presets import get_preset
from tlt_jax.models.transformer import init_model
from tlt_jax.rollout.acceptance import accept_tree
from tlt_jax.rollout.draft_tree import Candidates, DraftTree, build_tree, tree_node_scores
from tlt_jax.rollout.ngram import NgramIndex, empty_tree, merge_into_tree, validate_tree


def paths(tree: DraftTree, row: int = 0) -> list[tuple[int, ...]]:
    """The token path (root excluded) of every drafted node of a row, in node order."""
    tokens, parents = np.asarray(tree.tokens_BxT[row]), np.asarray(tree.parents_BxT[row])
    out: dict[int, tuple[int, ...]] = {0: ()}
    for j in range(1, tokens.shape[0]):
        if parents[j] >= 0:
            out[j] = out[int(parents[j])] + (int(tokens[j]),)
    return [out[j] for j in sorted(out) if j > 0]


def propose(index, request_id, verify_tokens=16, depth=4, topk=4):
    group, seq = index._requests[request_id]
    length = len(group.prompt) + len(seq.tokens) - seq.start - 1
    last = seq.tokens[-1]
    return index.propose_batch([request_id], [length], [last], verify_tokens=verify_tokens,
                               depth=depth, topk=topk)  # fmt: skip


# ----------------------------------------------------------------------------- index


def test_constructor_and_size_errors_name_the_field():
    cases = (({"max_ngram": 0}, "ngram.max_ngram=0"),
             ({"min_ngram": 3, "max_ngram": 2}, "min_ngram=3 must be <= max_ngram=2"),
             ({"max_matches": 1.5}, "ngram.max_matches=1.5"),
             ({"max_history_per_prompt": -1}, "max_history_per_prompt=-1"))  # fmt: skip
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            NgramIndex(**kwargs)
    index = NgramIndex()
    index.start("r", "p", [1, 2, 3])
    with pytest.raises(ValueError, match="verify_tokens=0"):
        index.propose_batch(["r"], [2], [3], verify_tokens=0, depth=2, topk=2)
    with pytest.raises(ValueError, match="already started"):
        index.start("r", "p", [1, 2, 3])
    with pytest.raises(ValueError, match="another prompt"):
        index.start("s", "p", [1, 2])
    with pytest.raises(ValueError, match="never started"):
        index.extend("nobody", [1])


def test_repeated_pattern_is_proposed_exactly():
    index = NgramIndex()
    index.start(0, "p", [1, 2, 3, 4, 5] * 4)
    index.extend(0, [1])
    index.extend(0, [2])
    tree = index.propose_batch([0], [21], [2], verify_tokens=9, depth=6, topk=1)
    validate_tree(tree)
    np.testing.assert_array_equal(tree.tokens_BxT[0], [2, 3, 4, 5, 1, 2, 3, 2, 2])
    np.testing.assert_array_equal(tree.parents_BxT[0], [-1, 0, 1, 2, 3, 4, 5, -1, -1])
    np.testing.assert_array_equal(tree.positions_BxT[0], [21, 22, 23, 24, 25, 26, 27, 21, 21])
    assert tree.tokens_BxT.dtype == np.int32 and tree.mask_BxTxT.dtype == bool


def test_branches_are_ranked_by_count_and_capped():
    # After "7 8": "1" follows three times, "2" twice, "3" once, most recently (each then "9").
    prompt = [7, 8, 1, 9, 7, 8, 2, 9, 7, 8, 1, 9, 7, 8, 2, 9, 7, 8, 1, 9, 7, 8, 3, 9, 7]
    index = NgramIndex(max_ngram=2)
    index.start(0, "p", prompt)
    index.extend(0, [8])
    tree = propose(index, 0, verify_tokens=8, depth=2, topk=4)
    validate_tree(tree)
    assert paths(tree) == [(1,), (1, 9), (2,), (2, 9), (3,), (3, 9)]
    tree = propose(index, 0, verify_tokens=4, depth=2, topk=2)  # 3 nodes, 2 children at most
    assert paths(tree) == [(1,), (1, 9), (2,)]
    assert (tree.parents_BxT[0, 4:] == -1).all()
    assert paths(propose(index, 0, verify_tokens=8, depth=2, topk=1)) == [(1,), (1, 9)]


def test_siblings_and_history_are_used():
    prompt = [1, 2, 3]
    index = NgramIndex(max_history_per_prompt=2)
    index.start("a", "p", prompt)
    index.start("b", "p", prompt)
    index.start("c", "q", [1, 2, 3])  # another prompt key: never a source for "p"
    index.extend("a", [4, 5, 6])
    index.extend("c", [4, 5, 60, 61])
    index.extend("b", [4, 5])
    # b's own sequence has no "4 5" before its end: the continuation is its live sibling a's.
    assert paths(propose(index, "b", depth=3, topk=4)) == [(6,)]
    index.finish("a")  # a's response stays as history for "p"
    index.start("d", "p", prompt)
    index.extend("d", [4, 5])
    assert paths(propose(index, "d", depth=3, topk=4)) == [(6,)]
    index.extend("b", [7, 8])
    index.finish("b")
    index.start("e", "p", prompt)
    index.extend("e", [4, 5])
    # Equal counts: the newer source first (b after a), and topk=1 keeps only it.
    assert paths(propose(index, "e", depth=3, topk=4)) == [(7,), (7, 8), (6,)]
    assert paths(propose(index, "e", depth=3, topk=1)) == [(7,), (7, 8)]
    index.add_history("p", [4, 5, 9])  # an earlier RL step's response; a is evicted (2 kept)
    index.finish("d", keep=False)
    index.start("f", "p", prompt)
    index.extend("f", [4, 5])
    assert paths(propose(index, "f", depth=3, topk=4)) == [(9,), (7,), (7, 8)]
    index.finish_all()
    assert index.live_requests == []


def test_max_prompts_evicts_least_recent_idle_groups():
    index = NgramIndex(max_prompts=2)
    for key in ("x", "y"):
        index.add_history(key, [1, 2, 3])
    index.start("live", "y", [5])
    index.add_history("z", [1, 2, 3])  # three groups: x is the least recent idle one
    for key in ("z", "y", "x"):  # groups with live requests are never evicted
        index.start(key, key, [9] if key != "y" else [5])
        index.extend(key, [1, 2])
        assert paths(propose(index, key, depth=1)) == ([] if key == "x" else [(3,)]), key


def reference_paths(prompt, own, others, depth, min_ngram, max_ngram):
    """Brute force: every prefix (length <= depth) of every continuation of the longest
    matched suffix, with its count. `others` are the other responses of the same prompt."""
    full = list(prompt) + list(own)
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(full) < n:
            continue
        query = full[-n:]
        chains = []
        sequences = [(full, 0)] + [(list(prompt) + list(r), len(prompt)) for r in others]
        for seq, first_end in sequences:
            for end in range(max(first_end, n - 1), len(seq)):
                if seq[end - n + 1 : end + 1] == query and seq[end + 1 : end + 1 + depth]:
                    chains.append(tuple(seq[end + 1 : end + 1 + depth]))
        if chains:
            counts: dict[tuple[int, ...], int] = {}
            for chain in chains:
                for i in range(1, len(chain) + 1):
                    counts[chain[:i]] = counts.get(chain[:i], 0) + 1
            return counts
    return {}


@pytest.mark.parametrize("seed", range(4))
def test_random_trees_are_valid_and_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    vocab, depth = 4, 3
    prompts = {key: list(rng.integers(0, vocab, rng.integers(1, 12))) for key in "pq"}
    full = NgramIndex(max_ngram=3, min_ngram=1, max_matches=10**6)
    capped = NgramIndex(max_ngram=3, min_ngram=1, max_matches=3)
    responses: dict[int, list[int]] = {}
    keys = {}
    for r in range(6):
        keys[r] = "pq"[r % 2]
        for index in (full, capped):
            index.start(r, keys[r], prompts[keys[r]])
        responses[r] = []
    for _ in range(30):
        r = int(rng.integers(0, 6))
        new = list(rng.integers(0, vocab, rng.integers(1, 4)))
        responses[r] += new
        for index in (full, capped):
            index.extend(r, new)
        others = [responses[o] for o in responses if o != r and keys[o] == keys[r]]
        want = reference_paths(prompts[keys[r]], responses[r], others, depth, 1, 3)
        tree = propose(full, r, verify_tokens=128, depth=depth, topk=vocab)
        validate_tree(tree, vocab_size=vocab)
        got = paths(tree)
        assert sorted(got) == sorted(want)
        for parent in set(p[:-1] for p in got):  # siblings in node order: counts non-increasing
            counts = [want[p] for p in got if p[:-1] == parent]
            assert counts == sorted(counts, reverse=True)
        for t, k in ((8, 2), (3, 1), (1, 4)):
            small = propose(capped, r, verify_tokens=t, depth=depth, topk=k)
            validate_tree(small, vocab_size=vocab)
            small_paths = paths(small)
            assert set(small_paths) <= set(want) and len(small_paths) <= t - 1
            assert (len(small_paths) > 0) == (len(want) > 0 and t > 1)
            kids = np.bincount(small.parents_BxT[0][small.parents_BxT[0] >= 0], minlength=t)
            assert kids.max(initial=0) <= k


def test_incremental_extend_equals_rebuild():
    """Token-by-token extends of interleaved siblings give the same trees as one extend per
    request made afterwards in another order (the source order depends on tokens only)."""
    rng = np.random.default_rng(0)
    prompt = list(rng.integers(0, 5, 9))
    streams = {r: list(rng.integers(0, 5, 40)) for r in range(4)}
    incremental = NgramIndex(max_matches=4)
    for r in streams:
        incremental.start(r, "p", prompt)
    done = dict.fromkeys(streams, 0)
    while any(done[r] < 40 for r in streams):
        r = int(rng.choice([r for r in streams if done[r] < 40]))
        step = int(rng.integers(1, 4))
        incremental.extend(r, streams[r][done[r] : done[r] + step])
        done[r] = min(40, done[r] + step)
    rebuilt = NgramIndex(max_matches=4)
    for r in streams:
        rebuilt.start(r, "p", prompt)
    for r in reversed(list(streams)):
        rebuilt.extend(r, streams[r])
    for r in streams:
        for t, d, k in ((16, 4, 4), (6, 3, 2)):
            a, b = propose(incremental, r, t, d, k), propose(rebuilt, r, t, d, k)
            for x, y in zip(a, b, strict=True):
                np.testing.assert_array_equal(x, y)


def test_out_of_sync_rows_raise():
    index = NgramIndex()
    index.start(0, "p", [1, 2, 3])
    index.extend(0, [4])
    index.propose_batch([0, None], [3, 9], [4, 7], verify_tokens=4, depth=2, topk=2)
    with pytest.raises(ValueError, match="out of sync"):
        index.propose_batch([0], [3], [5], verify_tokens=4, depth=2, topk=2)
    with pytest.raises(ValueError, match="out of sync"):
        index.propose_batch([0], [4], [4], verify_tokens=4, depth=2, topk=2)


def test_empty_tree_is_root_plus_detached_nodes():
    tree = empty_tree(2, 4, [5, 6], [9, 8])
    validate_tree(tree)
    np.testing.assert_array_equal(tree.tokens_BxT, [[9] * 4, [8] * 4])
    np.testing.assert_array_equal(tree.parents_BxT, -np.ones((2, 4)))
    np.testing.assert_array_equal(tree.positions_BxT, [[5] * 4, [6] * 4])
    np.testing.assert_array_equal(tree.mask_BxTxT[0], np.eye(4, dtype=bool))


# ----------------------------------------------------------------------------- validity


def random_tree(rng, t, n_real, vocab, root_position=10) -> DraftTree:
    """A random valid tree: n_real drafted nodes (detached where no token is left), detached
    padding up to t nodes; depth and mask by hand."""
    tokens, parents = [int(rng.integers(0, vocab))], [-1]
    for j in range(1, n_real + 1):
        open_nodes = [i for i in range(j) if (i == 0 or parents[i] >= 0)
                      and sum(p == i for p in parents[1:]) < vocab]  # fmt: skip
        if not open_nodes:
            tokens.append(tokens[0])
            parents.append(-1)
            continue
        parent = int(rng.choice(open_nodes))
        used = {tokens[i] for i in range(1, j) if parents[i] == parent}
        tokens.append(int(rng.choice([x for x in range(vocab) if x not in used])))
        parents.append(parent)
    tokens += [tokens[0]] * (t - n_real - 1)
    parents += [-1] * (t - n_real - 1)
    mask = np.eye(t, dtype=bool)
    depth = np.zeros(t, np.int32)
    for j in range(t):
        i = j
        while parents[i] >= 0:
            i = parents[i]
            mask[j, i] = True
            depth[j] += 1
    return DraftTree(np.array([tokens], np.int32), np.array([parents], np.int32), depth[None],
                     root_position + depth[None], mask[None])  # fmt: skip


def hand_tree(tokens, parents) -> DraftTree:
    """root(5) -> 1 -> 3, root -> 2, plus what the caller appends; depth and mask derived."""
    t = len(tokens)
    mask, depth = np.eye(t, dtype=bool), np.zeros(t, np.int32)
    for j in range(t):
        i = j
        while parents[i] >= 0:
            i = parents[i]
            mask[j, i], depth[j] = True, depth[j] + 1
    return DraftTree(np.array([tokens], np.int32), np.array([parents], np.int32), depth[None],
                     10 + depth[None], mask[None])  # fmt: skip


def test_validate_tree_rejects_invalid_layouts():
    tree = hand_tree([5, 1, 2, 3, 5], [-1, 0, 0, 1, -1])
    validate_tree(tree, vocab_size=6)
    validate_tree(random_tree(np.random.default_rng(0), 12, 10, 2))
    tokens, parents, depth, positions, mask = (np.array(x) for x in tree)

    def changed(array, index, value):
        array = array.copy()
        array[(0,) + index] = value
        return array

    cases = {
        "node 0 must be the root": (tokens, changed(parents, (0,), 0), depth, positions, mask),
        "share a token": (changed(tokens, (2,), 1), parents, depth, positions, mask),
        "precede": (tokens, changed(parents, (1,), 3), depth, positions, mask),
        "depth": (tokens, parents, changed(depth, (3,), 3), positions, mask),
        "positions": (tokens, parents, depth, changed(positions, (3,), 13), mask),
        "ancestor-or-self": (tokens, parents, depth, positions, changed(mask, (3, 0), False)),
        "vocab_size": (changed(tokens, (1,), 6), parents, depth, positions, mask),
        "detached node has children": hand_tree([5, 1, 2, 3, 5, 4], [-1, 0, 0, 1, -1, 4]),
    }
    for match, arrays in cases.items():
        with pytest.raises(ValueError, match=match):
            validate_tree(arrays, vocab_size=6)


# ----------------------------------------------------------------------------- acceptance


@functools.cache
def _accept(greedy_only: bool):
    return jax.jit(functools.partial(accept_tree, greedy_only=greedy_only))


def run_accept(tree: DraftTree, logits_BxTxV, temperature: float, seed: int = 0):
    b = logits_BxTxV.shape[0]
    return jax.device_get(_accept(temperature == 0)(
        jnp.asarray(logits_BxTxV, jnp.float32), tree.tokens_BxT, tree.parents_BxT,
        tree.positions_BxT, jnp.full((b,), temperature, jnp.float32), jnp.zeros((b,), jnp.int32),
        jnp.ones((b,), jnp.float32), jax.random.split(jax.random.key(seed), b),
    ))  # fmt: skip


def branching_index():
    """One request whose tree after "7 8" has 9 drafted nodes: (2, 4, 7), (2, 6, 4), (1, 5, 3)
    and (1, 5, 7)."""
    prompt = [7, 8, 1, 5, 7, 8, 2, 6, 4, 7, 8, 1, 5, 3, 7, 8, 2, 4, 7]
    index = NgramIndex(max_ngram=2)
    index.start(0, "p", prompt)
    index.extend(0, [8])
    return index, len(prompt)


def tile(tree: DraftTree, n: int) -> DraftTree:
    return DraftTree(*(np.repeat(np.asarray(x), n, axis=0) for x in tree))


def test_padding_is_inert_under_accept_tree():
    """The detached padding gives bit-identical outcomes to the unpadded tree, greedy and
    sampled; padding that repeats a root child's token under the root does not."""
    index, length = branching_index()
    padded1 = index.propose_batch([0], [length], [8], verify_tokens=16, depth=3, topk=4)
    n_real = int((padded1.parents_BxT[0] >= 0).sum())
    assert n_real == 9 and paths(padded1)[:2] == [(2,), (1,)]
    tight1 = index.propose_batch([0], [length], [8], verify_tokens=n_real + 1, depth=3, topk=4)
    np.testing.assert_array_equal(padded1.tokens_BxT[:, : n_real + 1], tight1.tokens_BxT)
    rows, vocab = 2048, 10
    padded, tight = tile(padded1, rows), tile(tight1, rows)
    rng = np.random.default_rng(0)
    logits = 1.5 * rng.standard_normal((rows, 16, vocab)).astype(np.float32)
    duplicate = DraftTree(*(np.array(x) for x in padded))
    duplicate.tokens_BxT[:, n_real + 1 :] = padded.tokens_BxT[:, 1:2]  # root child 1 again
    duplicate.parents_BxT[:, n_real + 1 :] = 0
    for temperature in (0.0, 1.0):
        a = run_accept(padded, logits, temperature)
        b = run_accept(tight, logits[:, : n_real + 1], temperature)
        m = a.num_accepted_B
        np.testing.assert_array_equal(m, b.num_accepted_B)
        slots = np.arange(n_real + 1)[None] <= m[:, None]
        for x, y in ((a.tokens_BxT, b.tokens_BxT), (a.path_BxT, b.path_BxT),
                     (a.logprobs_BxT, b.logprobs_BxT)):  # fmt: skip
            np.testing.assert_array_equal(np.where(slots, x[:, : n_real + 1], 0),
                                          np.where(slots, y, 0))  # fmt: skip
        if temperature > 0:  # the first drafted token is the child's one far too often
            c = run_accept(duplicate, logits, temperature)
            first = lambda r: r.tokens_BxT[:, 0] == padded.tokens_BxT[0, 1]  # noqa: E731
            assert first(c).mean() > first(a).mean() + 0.05, (first(c).mean(), first(a).mean())


def test_greedy_acceptance_follows_the_known_chain():
    """Logits whose argmax follows a known continuation: accept_tree emits the longest prefix
    of it that is a tree path, then the continuation's next token."""
    index, length = branching_index()
    tree1 = index.propose_batch([0], [length], [8], verify_tokens=12, depth=3, topk=4)
    tree_paths = {(): 0} | {p: j for p, j in zip(paths(tree1), range(1, 12), strict=False)}
    truths = [(1, 5, 7, 3), (2, 6, 9, 9), (1, 6, 0, 0), (9, 9, 9, 9), (2, 4, 7, 8)]
    vocab = 10
    logits = np.zeros((len(truths), 12, vocab), np.float32)
    want = []
    for b, truth in enumerate(truths):
        for path, j in tree_paths.items():
            on_truth = truth[: len(path)] == path
            logits[b, j, truth[len(path)] if on_truth else (sum(path) + 7) % vocab] = 9.0
        m = max(len(p) for p in tree_paths if truth[: len(p)] == p)
        want.append(truth[: m + 1])
    got = run_accept(tile(tree1, len(truths)), logits, 0.0)
    for b, expected in enumerate(want):
        assert got.num_accepted_B[b] == len(expected) - 1
        assert tuple(got.tokens_BxT[b, : len(expected)]) == expected
    assert [len(w) - 1 for w in want] == [3, 2, 1, 0, 3]


# ----------------------------------------------------------------------------- hybrid


def test_merge_into_tree_by_hand():
    eagle = hand_tree([5, 1, 2, 3], [-1, 0, 0, 1])  # root(5) -> 1 -> 3, root -> 2
    chain = ngram_chain(5, [1, 4, 6])  # 1 is shared, 4 and 6 are new under it
    merged = merge_into_tree(eagle, chain)  # 2 new nodes: drops 3, then 2 (1 is shared)
    validate_tree(merged)
    assert paths(merged) == [(1,), (1, 4), (1, 4, 6)]
    np.testing.assert_array_equal(merged.positions_BxT[0], [10, 11, 12, 13])
    merged = merge_into_tree(eagle, chain, verify_tokens=6)
    assert paths(merged) == [(1,), (2,), (1, 3), (1, 4), (1, 4, 6)]
    merged = merge_into_tree(eagle, chain, verify_tokens=5)  # 3 has the highest index
    assert paths(merged) == [(1,), (2,), (1, 4), (1, 4, 6)]
    merged = merge_into_tree(eagle, chain, verify_tokens=5, eagle_scores_BxT=[[0, -1, -3, -2]])
    assert paths(merged) == [(1,), (1, 3), (1, 4), (1, 4, 6)]  # 2 ranks lowest: dropped
    merged = merge_into_tree(eagle, chain, verify_tokens=3)  # the chain is cut to the budget
    assert paths(merged) == [(1,), (1, 4)]
    same = merge_into_tree(eagle, ngram_chain(5, [1, 3]))
    for x, y in zip(same, eagle, strict=True):
        np.testing.assert_array_equal(x, y)


def test_hybrid_drops_the_eagle_leaf_the_drafter_ranks_lowest():
    """topk = 2, depth 2: the kept EAGLE nodes are 5 (-0.1), 6 (-3.0) at the root, 7 (-0.2)
    and 8 (-0.5) under 5. A 1-node n-gram extension needs a slot: by index the best-scored
    deep leaf (8) was dropped; by the drafter's ranks the shallow unlikely one (6) is."""
    candidates = Candidates(
        tokens_BxC=jnp.array([[5, 6, 7, 8, 9, 4]], jnp.int32),
        scores_BxC=jnp.array([[-0.1, -3.0, -0.2, -0.5, -3.1, -3.2]]),
        parents_BxC=jnp.array([[-1, -1, 0, 0, 1, 1]], jnp.int32),
    )
    tree = build_tree(candidates, jnp.array([1]), jnp.array([10]), verify_tokens=5, max_depth=2)
    assert paths(tree) == [(5,), (6,), (5, 7), (5, 8)]
    scores = tree_node_scores(tree, candidates)
    np.testing.assert_allclose(scores, [[np.inf, -0.1, -3.0, -0.2, -0.5]], rtol=1e-6)
    chain = ngram_chain(1, [5, 3])  # 5 is shared, 3 is new under it
    by_index = merge_into_tree(tree, chain)
    assert paths(by_index) == [(5,), (6,), (5, 7), (5, 3)]
    by_score = merge_into_tree(tree, chain, eagle_scores_BxT=scores)
    assert paths(by_score) == [(5,), (5, 7), (5, 8), (5, 3)]


@pytest.mark.parametrize("monotone", [True, False])
def test_tree_node_scores_are_the_ranks_build_tree_kept(monotone):
    """Each node's score is its candidate's score capped by its ancestors' (NaN as -inf), as
    `build_tree` ranks them: the nodes' scores are the T - 1 best capped candidate scores."""
    from test_sampling_fixes import random_candidates

    rng = np.random.default_rng(7)
    topk, depth, t = 3, 3, 8
    candidates = random_candidates(rng, 16, topk, depth, vocab=topk + 2, nan_share=0.2,
                                   monotone=monotone)  # fmt: skip
    tree = build_tree(candidates, jnp.zeros(16, jnp.int32), jnp.zeros(16, jnp.int32),
                      verify_tokens=t, max_depth=depth)  # fmt: skip
    scores = tree_node_scores(tree, candidates)
    own = np.asarray(candidates.scores_BxC, np.float64)
    own = np.where(np.isnan(own), -np.inf, own)
    parents = np.asarray(candidates.parents_BxC)
    capped = own.copy()
    for c in range(own.shape[1]):  # parents precede children
        has = parents[:, c] >= 0
        capped[has, c] = np.minimum(own[has, c], capped[has, parents[has, c]])
    assert np.all(scores[:, 0] == np.inf)
    np.testing.assert_allclose(np.sort(scores[:, 1:], axis=1),
                               np.sort(capped, axis=1)[:, -(t - 1):], rtol=1e-6)  # fmt: skip
    with pytest.raises(ValueError, match="no candidate of its parent's"):
        other = tree._replace(tokens_BxT=tree.tokens_BxT.at[0, 1].set(99))
        tree_node_scores(other, candidates)


def ngram_chain(root, chain) -> DraftTree:
    """The index's topk=1 tree for a prompt in which `chain` follows the root token once."""
    index = NgramIndex(max_ngram=1)
    prompt = [root, *chain, 0, root]
    index.start(0, "p", prompt)
    tree = index.propose_batch([0], [len(prompt) - 1], [root], verify_tokens=len(chain) + 1,
                               depth=len(chain), topk=1)  # fmt: skip
    assert paths(tree) == [tuple(chain[: i + 1]) for i in range(len(chain))]
    return tree


@pytest.mark.parametrize("seed", range(3))
def test_merge_into_tree_random_is_valid_and_keeps_the_ngram_paths(seed):
    rng = np.random.default_rng(seed)
    vocab = 4
    for _ in range(40):
        t = int(rng.integers(2, 10))
        eagle = random_tree(rng, t, int(rng.integers(0, t)), vocab)
        ngram = random_tree(rng, 7, int(rng.integers(0, 7)), vocab)
        ngram.tokens_BxT[0, 0] = eagle.tokens_BxT[0, 0]
        t_out = int(rng.integers(1, 12))
        merged = merge_into_tree(eagle, ngram, verify_tokens=t_out)
        validate_tree(merged, vocab_size=vocab)
        assert merged.tokens_BxT.shape == (1, t_out)
        got = set(paths(merged))
        ngram_paths = paths(ngram)[: t_out - 1]
        assert set(ngram_paths) <= got
        assert got <= set(paths(eagle)) | set(ngram_paths)
        want_nodes = min(t_out - 1, len(set(paths(eagle)) | set(ngram_paths)))
        assert len(got) == want_nodes  # the budget is used as far as the nodes allow


# ----------------------------------------------------------------------------- tiny model

VOCAB, BUFFER, T = 8, 48, 6


@functools.cache
def tiny_programs():
    # Untied: a tied random model repeats one token; this one walks patterns like 3 4 6 3 4 6.
    model = init_model(get_preset("tiny", vocab_size=VOCAB, tie_word_embeddings=False), 0)
    graphdef, params = nnx.split(model)

    @jax.jit
    def next_token(params, seq_BxS, lengths_B):  # plain greedy: a causal forward
        model = nnx.merge(graphdef, params)
        b, s = seq_BxS.shape
        features, _ = model(seq_BxS, jnp.broadcast_to(jnp.arange(s), (b, s)))
        logits = jnp.take_along_axis(model.logits(features), (lengths_B - 1)[:, None, None], 1)
        return jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)

    @jax.jit
    def tree_logits(params, seq_BxS, lengths_B, tree: DraftTree):
        """Target logits at the tree nodes: the cached prefix attends causally, every node to
        the prefix below `lengths` and to its ancestors (what verify_program computes)."""
        model = nnx.merge(graphdef, params)
        b, s = seq_BxS.shape
        t = tree.tokens_BxT.shape[1]
        keys = jnp.arange(s)
        prefix = (keys[None, :] <= keys[:, None])[None] & (keys < lengths_B[:, None])[:, None]
        nodes_to_prefix = jnp.broadcast_to((keys < lengths_B[:, None])[:, None], (b, t, s))
        mask = jnp.concatenate([
            jnp.concatenate([prefix, jnp.zeros((b, s, t), bool)], 2),
            jnp.concatenate([nodes_to_prefix, tree.mask_BxTxT], 2)], 1)  # fmt: skip
        tokens = jnp.concatenate([seq_BxS, tree.tokens_BxT], 1)
        positions = jnp.concatenate([jnp.broadcast_to(keys, (b, s)), tree.positions_BxT], 1)
        features, _ = model(tokens, positions, mask_BxTxT=mask)
        return model.logits(features[:, s:])

    return params, next_token, tree_logits


def test_greedy_sd_with_ngram_trees_equals_plain_greedy():
    """The tiny model decodes 30 tokens greedily, plainly and with n-gram trees verified by
    accept_tree; rows 0 and 1 are GRPO siblings. Outputs match and drafts get accepted."""
    params, next_token, tree_logits = tiny_programs()
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, VOCAB, 6)) for _ in range(2)]
    prompts = [prompts[0], prompts[0], prompts[1]]
    b, new = len(prompts), 30
    seq = np.zeros((b, BUFFER), np.int32)
    for i, p in enumerate(prompts):
        seq[i, : len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    plain, plain_seq, plain_len = [[] for _ in prompts], seq.copy(), lengths.copy()
    for _ in range(new + 1):
        token = np.asarray(next_token(params, plain_seq, plain_len))
        for i in range(b):
            plain[i].append(int(token[i]))
            plain_seq[i, plain_len[i]] = token[i]
        plain_len += 1
    index = NgramIndex(max_ngram=3)
    first = np.asarray(next_token(params, seq, lengths))
    out = [[int(first[i])] for i in range(b)]
    for i in range(b):
        index.start(i, tuple(prompts[i]), prompts[i])
        index.extend(i, out[i])
    steps = 0
    while min(len(o) for o in out) <= new:
        last = np.array([o[-1] for o in out], np.int32)
        tree = index.propose_batch(list(range(b)), lengths, last, verify_tokens=T, depth=4,
                                   topk=2)  # fmt: skip
        validate_tree(tree, vocab_size=VOCAB)
        logits = tree_logits(params, seq, lengths, tree)
        result = run_accept(tree, logits, 0.0)
        steps += 1
        for i in range(b):
            emitted = [int(x) for x in result.tokens_BxT[i, : result.num_accepted_B[i] + 1]]
            seq[i, lengths[i] : lengths[i] + len(emitted)] = [out[i][-1]] + emitted[:-1]
            lengths[i] += len(emitted)
            out[i] += emitted
            index.extend(i, emitted)
    for i in range(b):
        assert out[i][: new + 1] == plain[i], i
    assert steps < 0.7 * new, steps  # several tokens per step: drafts were accepted
