"""Model-free draft trees from n-gram matches (TLT-Base; vLLM / SGLang suffix decoding), host side.

Dimension legend: B batch (rows of one verify call), T tree nodes (verify tokens, root included).

Sources. A request drafts from every sequence of its prompt group (the requests that share a
`prompt_key`): its own prompt and response so far, the responses its GRPO siblings have produced
so far (live requests of the same key) and finished responses to that prompt (siblings that left
the engine and earlier RL steps' responses, kept across `generate` calls; `add_history` feeds
more). At most `max_history_per_prompt` finished responses are kept per prompt (oldest evicted
first) and at most `max_prompts` prompt groups without live requests (least recently used
evicted first).

Index. Every sequence keeps its own dict from n-gram (min_ngram <= n <= max_ngram) to the end
positions of its occurrences, in increasing order; `extend` indexes the n-grams that end at the
new tokens only, O(new tokens x n-gram sizes). Keys are the n-grams' tuple hashes: a collision
only yields a wrong draft, which verification rejects like any other. A response is stored after
the last `max_ngram` prompt tokens, so n-grams straddling the prompt/response boundary are found
in it; the prompt itself is indexed once per group.

Proposal. The query is the longest suffix (n from max_ngram down to min_ngram) of the request's
prompt + response (ending at the pending token, the tree's root) with an earlier occurrence that
has a continuation. Occurrences are taken from the sources in a fixed order: own response, own
prompt (its continuation runs on into the own response), then the group's other sequences
newest first; within a sequence later positions first; at most `max_matches`. This order depends
only on the tokens, not on how `extend` calls were chunked. Each occurrence gives the chain of up
to `depth` tokens after it; the chains form a trie with counts, and the tree is a best-first
selection of up to verify_tokens - 1 trie nodes (highest count first, then first seen), at most
`topk` children per node. A node is emitted after its parent, so parents precede children; trie
siblings are distinct tokens, so no (parent, token) pair repeats.

Padding. Every row has exactly T nodes; unused slots are *detached* nodes: parent -1, depth 0,
the root's token and position, a mask row holding only themselves. They are provably inert in
`acceptance.accept_tree`: node j is a child of n iff parents[j] == n (and j > 0), and no node
index is -1, so a detached node is nobody's child. Greedy: it is never a hit. Sampling: it adds
nothing to any node's cumulative child mass, and its row of the `removed` scatter is index T,
dropped. The walk follows accepted-child links from node 0 only, so a detached node is never on
the path: never emitted, and its keys and values are never committed (`commit_kv` writes path
rows). Real nodes' draws are keyed by their positions, not their indices, so the outcome is
bit-identical to the unpadded tree (tests/test_ngram.py checks this, and that the tempting
alternative, pads under the root that repeat a child's token, changes sampled outcomes: the
repeated child's probability is counted twice). In the target forward a detached node repeats
the root's computation (same token, position and attention to the prefix): finite values, and
no real node attends to it. Rows with no draft are the root plus T - 1 detached nodes.

Hybrid. `merge_into_tree` merges an n-gram tree (usually a `topk=1` chain) into an EAGLE tree:
n-gram nodes that already exist are shared, the others are appended, and the lowest-ranked EAGLE
leaves are dropped to stay within the verify budget.

Everything here is numpy and Python; the trees are `DraftTree`s of host arrays, ready to be
passed to `speculative.verify_program` (int32 and bool, the dtypes the device tree has).
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from tlt_jax.rollout.draft_tree import DraftTree


class _Sequence:
    """One token sequence of a prompt group and its n-gram index."""

    __slots__ = ("tokens", "start", "index", "order")

    def __init__(self, prefix: list[int], order: int):
        self.tokens = list(prefix)  # prefix (prompt tail, unindexed) + indexed tokens
        self.start = len(prefix)  # n-grams ending at positions >= start are indexed
        self.index: dict[int, Any] = {}  # hash(n-gram) -> end position (int) or list of them
        self.order = order  # creation order: later sequences are newer sources

    def extend(self, new_tokens, sizes: range) -> None:
        tokens, index = self.tokens, self.index
        for token in new_tokens:
            tokens.append(int(token))
            end = len(tokens) - 1
            for n in sizes:
                if end < n - 1:
                    break
                key = hash(tuple(tokens[-n:]))
                old = index.get(key)
                if old is None:
                    index[key] = end  # most n-grams occur once: no list
                elif type(old) is int:
                    index[key] = [old, end]
                else:
                    old.append(end)


class _Group:
    """The sequences of one prompt: the prompt, live responses and finished ones."""

    __slots__ = ("prompt", "prompt_seq", "seqs", "finished", "live")

    def __init__(self):
        self.prompt: list[int] | None = None
        self.prompt_seq: _Sequence | None = None
        self.seqs: dict[int, _Sequence] = {}  # responses by creation order (oldest first)
        self.finished: collections.deque[_Sequence] = collections.deque()
        self.live = 0


class NgramIndex:
    """Suffix-match drafts for the requests of one engine (see the module docstring)."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_history_per_prompt: int = 4,
                 max_matches: int = 16, max_prompts: int = 256):  # fmt: skip
        """
        Args:
          max_ngram / min_ngram: the longest and shortest suffix matched.
          max_history_per_prompt: finished responses kept per prompt (0: siblings only while
            they run).
          max_matches: occurrences of the matched suffix a proposal reads at most.
          max_prompts: prompt groups kept; the least recently used groups without live
            requests are evicted beyond it. Memory is about 350 bytes per indexed token (CPython,
            default n-gram sizes): 256 prompts x 4 kept 1000-token responses ~ 360 MB at most.
        """
        limits = (("max_ngram", max_ngram, 1), ("min_ngram", min_ngram, 1),
                  ("max_history_per_prompt", max_history_per_prompt, 0),
                  ("max_matches", max_matches, 1), ("max_prompts", max_prompts, 1))  # fmt: skip
        for name, value, low in limits:
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"ngram.{name}={value!r} must be an integer >= {low}")
        if min_ngram > max_ngram:
            raise ValueError(f"ngram.min_ngram={min_ngram} must be <= max_ngram={max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_history_per_prompt = max_history_per_prompt
        self.max_matches = max_matches
        self.max_prompts = max_prompts
        self._sizes = range(min_ngram, max_ngram + 1)
        self._groups: collections.OrderedDict[Hashable, _Group] = collections.OrderedDict()
        self._requests: dict[Hashable, tuple[_Group, _Sequence]] = {}
        self._order = 0

    # -- sources --------------------------------------------------------------------------

    def start(self, request_id: Hashable, prompt_key: Hashable, prompt_tokens: Sequence[int]):
        """A request enters the engine (its response starts empty)."""
        if request_id in self._requests:
            raise ValueError(f"ngram: request {request_id!r} already started (finish it first)")
        group = self._group(prompt_key)
        prompt = [int(t) for t in prompt_tokens]
        if group.prompt is None:
            self._set_prompt(group, prompt)
        elif group.prompt != prompt:
            raise ValueError(f"ngram: prompt_key {_short(prompt_key)} was started with another "
                             "prompt")  # fmt: skip
        seq = self._new_seq(group)
        group.live += 1
        self._requests[request_id] = (group, seq)
        self._evict_prompts()

    def extend(self, request_id: Hashable, new_tokens: Sequence[int]) -> None:
        """Appends tokens the request emitted (its response so far grows)."""
        self._request(request_id)[1].extend(new_tokens, self._sizes)

    def finish(self, request_id: Hashable, keep: bool = True) -> None:
        """The request left; with `keep`, its response becomes history for its prompt."""
        group, seq = self._request(request_id)
        del self._requests[request_id]
        group.live -= 1
        if keep and len(seq.tokens) > seq.start:
            self._keep_finished(group, seq)
        else:
            del group.seqs[seq.order]
        self._evict_prompts()

    def finish_all(self, keep: bool = False) -> None:
        """Finishes every live request (e.g. after an interrupted `generate`)."""
        for request_id in list(self._requests):
            self.finish(request_id, keep=keep)

    def add_history(self, prompt_key: Hashable, response_tokens: Sequence[int]) -> None:
        """Adds a finished response to `prompt_key` (e.g. from an earlier RL step)."""
        if self.max_history_per_prompt == 0 or len(response_tokens) == 0:
            return
        group = self._group(prompt_key)
        seq = self._new_seq(group)
        seq.extend(response_tokens, self._sizes)
        self._keep_finished(group, seq)
        self._evict_prompts()

    @property
    def live_requests(self) -> list[Hashable]:
        return list(self._requests)

    def _group(self, prompt_key: Hashable) -> _Group:
        group = self._groups.get(prompt_key)
        if group is None:
            group = self._groups[prompt_key] = _Group()
        self._groups.move_to_end(prompt_key)
        return group

    def _set_prompt(self, group: _Group, prompt: list[int]) -> None:
        group.prompt = prompt
        group.prompt_seq = _Sequence([], -1)
        group.prompt_seq.extend(prompt, self._sizes)

    def _new_seq(self, group: _Group) -> _Sequence:
        prefix = group.prompt[-self.max_ngram :] if group.prompt else []
        self._order += 1
        seq = group.seqs[self._order] = _Sequence(prefix, self._order)
        return seq

    def _keep_finished(self, group: _Group, seq: _Sequence) -> None:
        group.finished.append(seq)
        while len(group.finished) > self.max_history_per_prompt:
            del group.seqs[group.finished.popleft().order]

    def _evict_prompts(self) -> None:
        if len(self._groups) <= self.max_prompts:
            return
        idle = [key for key, group in self._groups.items() if group.live == 0]
        for key in idle[: len(self._groups) - self.max_prompts]:
            del self._groups[key]

    def _request(self, request_id: Hashable) -> tuple[_Group, _Sequence]:
        try:
            return self._requests[request_id]
        except KeyError:
            raise ValueError(f"ngram: request {request_id!r} was never started") from None

    # -- proposals ------------------------------------------------------------------------

    def _chains(self, group: _Group, seq: _Sequence, depth: int) -> list[list[int]]:
        """Continuations of the longest matched suffix, in source order (module docstring)."""
        # The stored prefix is the prompt's last max_ngram tokens: every query fits in it.
        context = seq.tokens
        own_response = context[seq.start :]
        sources = [seq]
        if group.prompt_seq is not None:
            sources.append(group.prompt_seq)
        sources.extend(s for s in reversed(group.seqs.values()) if s is not seq)
        for n in reversed(self._sizes):
            if len(context) < n:
                continue
            key = hash(tuple(context[-n:]))
            chains: list[list[int]] = []
            for source in sources:
                ends = source.index.get(key)
                if ends is None:
                    continue
                for end in reversed(ends) if type(ends) is list else (ends,):
                    chain = source.tokens[end + 1 : end + 1 + depth]
                    if source is group.prompt_seq and len(chain) < depth:
                        chain = chain + own_response[: depth - len(chain)]
                    if chain:
                        chains.append(chain)
                        if len(chains) == self.max_matches:
                            return chains
            if chains:
                return chains
        return []

    def _draft(self, request_id, depth: int, topk: int, budget: int):
        """(tokens, parents) of the drafted nodes (node i + 1; parent 0 is the root)."""
        if request_id is None or budget <= 0:
            return [], []
        group, seq = self._request(request_id)
        chains = self._chains(group, seq, depth)
        if not chains:
            return [], []
        # Trie over the chains: node 0 is the root; ids grow in first-seen order.
        children: list[dict[int, int]] = [{}]
        counts = [0]
        trie_tokens = [-1]
        for chain in chains:
            node = 0
            for token in chain:
                child = children[node].get(token)
                if child is None:
                    child = children[node][token] = len(counts)
                    children.append({})
                    counts.append(0)
                    trie_tokens.append(token)
                counts[child] += 1
                node = child

        def best_children(node):
            kids = children[node].values()
            if len(kids) > topk:
                kids = sorted(kids, key=lambda c: (-counts[c], c))[:topk]
            return kids

        out_tokens: list[int] = []
        out_parents: list[int] = []
        heap = [(-counts[c], c, 0) for c in best_children(0)]
        heapq.heapify(heap)
        while heap and len(out_tokens) < budget:
            _, child, parent = heapq.heappop(heap)
            out_tokens.append(trie_tokens[child])
            out_parents.append(parent)
            me = len(out_tokens)
            for grandchild in best_children(child):
                heapq.heappush(heap, (-counts[grandchild], grandchild, me))
        return out_tokens, out_parents

    def _check_row(self, request_id, length: int, last_token: int) -> None:
        group, seq = self._request(request_id)
        have = len(group.prompt or ()) + len(seq.tokens) - seq.start
        pending = seq.tokens[-1] if len(seq.tokens) > seq.start else (group.prompt or [None])[-1]
        if have != length + 1 or pending != last_token:
            raise ValueError(
                f"ngram: request {request_id!r} is out of sync: the index holds {have} tokens "
                f"ending with {pending}, the engine has length {length} + 1 pending token "
                f"{last_token} (call extend with every emitted token)"
            )

    def propose_batch(self, request_ids: Sequence[Hashable | None], lengths, last_tokens, *,
                      verify_tokens: int, depth: int, topk: int) -> DraftTree:  # fmt: skip
        """One draft tree per row, padded to exactly `verify_tokens` nodes.

        Args:
          request_ids: the row's request (None: an empty row, root and padding only).
          lengths: [B] cached lengths (the roots' positions); last_tokens: [B] pending tokens
            (the roots), which must match the index's last token of each request.
          verify_tokens: T, nodes per row including the root.
          depth: the deepest drafted level; topk: children per node at most.

        Returns:
          A `DraftTree` of host arrays ([B, T] int32, mask [B, T, T] bool).
        """
        _check_sizes(verify_tokens=verify_tokens, depth=depth, topk=topk)
        lengths = np.asarray(lengths, np.int32).reshape(-1)
        last_tokens = np.asarray(last_tokens, np.int32).reshape(-1)
        if not len(request_ids) == lengths.shape[0] == last_tokens.shape[0]:
            raise ValueError(f"ngram: {len(request_ids)} request ids, {lengths.shape[0]} "
                             f"lengths and {last_tokens.shape[0]} last tokens differ")  # fmt: skip
        rows = []
        for b, request_id in enumerate(request_ids):
            if request_id is not None:
                self._check_row(request_id, int(lengths[b]), int(last_tokens[b]))
            rows.append(self._draft(request_id, depth, topk, verify_tokens - 1))
        return _assemble(rows, last_tokens, lengths, verify_tokens)


def _short(key) -> str:
    text = repr(key)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"ngram: {name}={value!r} must be an integer >= 1")


def _assemble(rows, root_tokens_B, root_positions_B, t: int) -> DraftTree:
    """Host `DraftTree` from per-row (tokens, parents) drafted lists, detached padding after."""
    b = len(rows)
    tokens = np.repeat(np.asarray(root_tokens_B, np.int32)[:, None], t, axis=1)
    parents = np.full((b, t), -1, np.int32)
    for i, (row_tokens, row_parents) in enumerate(rows):
        n = len(row_tokens)
        if n:
            tokens[i, 1 : n + 1] = row_tokens
            parents[i, 1 : n + 1] = row_parents
    depth = np.zeros((b, t), np.int32)
    mask = np.zeros((b, t, t), bool)
    nodes = np.arange(t)
    mask[:, nodes, nodes] = True
    batch = np.arange(b)
    for j in range(1, t):  # parents precede children: their rows are final
        parent = parents[:, j]
        real = parent >= 0
        if not real.any():
            continue
        safe = np.maximum(parent, 0)
        mask[:, j] |= mask[batch, safe] & real[:, None]
        depth[:, j] = np.where(real, depth[batch, safe] + 1, 0)
    positions = np.asarray(root_positions_B, np.int32)[:, None] + depth
    return DraftTree(tokens, parents, depth, positions.astype(np.int32), mask)


def empty_tree(batch: int, verify_tokens: int, lengths, last_tokens) -> DraftTree:
    """Rows of only the root (the pending token) and T - 1 detached padding nodes."""
    return _assemble([([], [])] * batch, np.asarray(last_tokens).reshape(-1)[:batch],
                     np.asarray(lengths).reshape(-1)[:batch], verify_tokens)  # fmt: skip


def validate_tree(tree, vocab_size: int | None = None) -> None:
    """Raises ValueError unless `tree` (a `DraftTree` or its 5 arrays) is a valid layout.

    Valid: tokens in [0, vocab_size); node 0 is the root (parent -1, depth 0); every other node
    either has an earlier parent, depth = its parent's + 1 and a distinct token among its
    siblings, or is detached (parent -1, depth 0, nobody's parent); positions = the root's +
    depth; mask = ancestor-or-self (a detached node: itself only).
    """
    tokens, parents, depth, positions, mask = (np.asarray(x) for x in tree)
    b, t = tokens.shape
    nodes = np.arange(t)
    if mask.shape != (b, t, t) or any(x.shape != (b, t) for x in (parents, depth, positions)):
        raise ValueError(f"tree shapes {tokens.shape=} {parents.shape=} {depth.shape=} "
                         f"{positions.shape=} {mask.shape=} must be [B,T] / [B,T,T]")  # fmt: skip
    if (tokens < 0).any() or (vocab_size is not None and (tokens >= vocab_size).any()):
        raise ValueError(f"tree tokens must lie in [0, {vocab_size=})")
    if (parents[:, 0] != -1).any() or (depth[:, 0] != 0).any():
        raise ValueError("tree node 0 must be the root (parent -1, depth 0)")
    if ((parents >= nodes[None]) | (parents < -1)).any():
        raise ValueError("tree parents must precede their children (or be -1)")
    safe = np.maximum(parents, 0)
    detached = (parents < 0) & (nodes[None] > 0)
    want_depth = np.where(parents < 0, 0, np.take_along_axis(depth, safe, axis=1) + 1)
    if (depth != want_depth).any():
        raise ValueError("tree depth must be the parent's depth + 1 (0 for root and detached)")
    if (positions != positions[:, :1] + depth).any():
        raise ValueError("tree positions must be the root's position + depth")
    for i in range(b):
        if np.isin(parents[i], np.flatnonzero(detached[i])).any():
            raise ValueError(f"tree row {i}: a detached node has children")
        real = parents[i] >= 0
        pairs = parents[i, real].astype(np.int64) * (1 << 32) + tokens[i, real]
        if np.unique(pairs).size != pairs.size:
            raise ValueError(f"tree row {i}: two siblings share a token")
    want = np.zeros((b, t, t), bool)
    want[:, nodes, nodes] = True
    batch = np.arange(b)
    for j in range(1, t):
        want[:, j] |= want[batch, safe[:, j]] & (parents[:, j] >= 0)[:, None]
    if (mask != want).any():
        raise ValueError("tree mask must be ancestor-or-self")


def merge_into_tree(eagle_tree, ngram_tree, verify_tokens: int | None = None,
                    eagle_scores_BxT=None) -> DraftTree:  # fmt: skip
    """Merges n-gram drafts into an EAGLE tree within a verify budget, per row.

    The n-gram nodes (from `NgramIndex.propose_batch`, usually `topk=1`: one chain) are walked
    in order; a node whose token the merged tree already has under the same parent is shared,
    the others are appended after the EAGLE nodes. To fit `verify_tokens`, the lowest-ranked
    EAGLE leaves that no n-gram node uses are dropped, repeatedly (a parent whose children are
    gone becomes a leaf); n-gram nodes beyond the budget (the last ones: best first) are not
    merged. No (parent, token) pair repeats, parents precede children, and depth, positions and
    mask are rebuilt, so the result is a valid tree for any valid inputs.

    Args:
      eagle_tree: a `DraftTree` (or its 5 arrays, host or device), rows of T nodes.
      ngram_tree: the n-gram trees of the same rows, any node count; same roots.
      verify_tokens: nodes per merged row (default: the EAGLE tree's T).
      eagle_scores_BxT: optional rank of each EAGLE node (higher kept first, e.g. cumulative
        drafter log-probabilities); default: a higher node index ranks lower, which is
        `build_tree`'s level-by-level order.

    Returns:
      A `DraftTree` of host arrays with `verify_tokens` nodes per row.
    """
    tokens, parents, _, positions, _ = (np.asarray(x) for x in eagle_tree)
    ngram_tokens, ngram_parents = np.asarray(ngram_tree[0]), np.asarray(ngram_tree[1])
    b, t = tokens.shape
    t_out = t if verify_tokens is None else verify_tokens
    _check_sizes(verify_tokens=t_out)
    if ngram_tokens.shape[0] != b:
        raise ValueError(f"merge_into_tree: {ngram_tokens.shape[0]} n-gram rows for {b} rows")
    scores = None if eagle_scores_BxT is None else np.asarray(eagle_scores_BxT, np.float64)
    rows = []
    for i in range(b):
        rank = (lambda j: (-j,)) if scores is None else (lambda j, s=scores[i]: (s[j], -j))
        rows.append(_merge_row(tokens[i], parents[i], ngram_tokens[i], ngram_parents[i], t_out,
                               rank))  # fmt: skip
    return _assemble(rows, tokens[:, 0], positions[:, 0], t_out)


def _merge_row(tokens, parents, ngram_tokens, ngram_parents, t_out: int, rank):
    real = [j for j in range(1, tokens.shape[0]) if parents[j] >= 0]  # drop detached padding
    children: dict[int, dict[int, int]] = {0: {}}
    for j in real:
        children[j] = {}
        if int(tokens[j]) in children[int(parents[j])]:
            raise ValueError("merge_into_tree: the EAGLE tree has two siblings with one token")
        children[int(parents[j])][int(tokens[j])] = j
    # Map n-gram nodes onto EAGLE nodes (shared) or new nodes ('new', k), best first. The
    # n-gram siblings are distinct, so two n-gram nodes never map to one node.
    ngram_real = [j for j in range(1, ngram_tokens.shape[0]) if ngram_parents[j] >= 0]
    where: dict[int, Any] = {0: 0}
    shared: set[int] = {0}
    new: list[tuple[int, Any]] = []  # (token, parent: EAGLE node or ('new', k))
    for j in ngram_real[: t_out - 1]:
        parent = where.get(int(ngram_parents[j]))
        if parent is None:  # an ancestor was cut by the budget
            continue
        token = int(ngram_tokens[j])
        existing = None if isinstance(parent, tuple) else children[parent].get(token)
        if existing is None:
            existing = ("new", len(new))
            new.append((token, parent))
        else:
            shared.add(existing)
        where[j] = existing
    excess = len(real) + 1 + len(new) - t_out
    removed: set[int] = set()
    if excess > 0:  # shared nodes' ancestors are shared: leaves-first removal can reach all
        left = {j: len(children[j]) for j in children}
        heap = [(rank(j), j) for j in real if left[j] == 0 and j not in shared]
        heapq.heapify(heap)
        while excess > 0:
            _, j = heapq.heappop(heap)
            removed.add(j)
            excess -= 1
            parent = int(parents[j])
            left[parent] -= 1
            if left[parent] == 0 and parent not in shared:
                heapq.heappush(heap, (rank(parent), parent))
    index = {0: 0}
    out_tokens, out_parents = [], []
    for j in real:
        if j not in removed:
            out_tokens.append(int(tokens[j]))
            out_parents.append(index[int(parents[j])])
            index[j] = len(out_tokens)
    for k, (token, parent) in enumerate(new):
        out_tokens.append(token)
        out_parents.append(index[parent])
        index[("new", k)] = len(out_tokens)
    return out_tokens, out_parents
