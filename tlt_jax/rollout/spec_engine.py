"""Host side of the rollout engine's speculative-decoding steps.

`SpecRunner` runs one SD step over the engine's running requests for a `StepChoice`: it first
brings every running request's drafter in sync (`sync_drafter`: the switch cost after lazy
plain steps), builds the step's verification tree from its source, and runs the verify program:

- "eagle": the drafter's EAGLE-2 candidates and tree (`draft_program`, `tree_program`), on device.
- "ngram": a tree of suffix-match continuations from the engine's `NgramIndex` (host, numpy).
- "hybrid": the EAGLE tree with n-gram chains merged in within the verify budget.

All three are checked by the same verify program and the same acceptance code, so every source
is lossless by construction. Programs come from the engine's `ProgramPool`: drafts keyed by
(batch, k, depth, kv, hot vocabulary size), trees by (batch, k, depth, verify tokens) and
verifies by (batch, verify tokens, kv, greedy, drafter, filtering) only, shared by every
strategy and source with that verify budget.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.config_fields import is_int
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.decode import DecodeCache
from tlt_jax.models.transformer import ATTENTION_IMPLS
from tlt_jax.rollout import speculative
from tlt_jax.rollout.adaptive import StepChoice
from tlt_jax.rollout.draft_tree import DraftTree, tree_node_scores
from tlt_jax.rollout.sampling import needs_filtering
from tlt_jax.rollout.speculative import SpecStrategy, draft_length, without_caches


def check_drafter_fits(target: ModelConfig, drafter: ModelConfig) -> None:
    """The drafter must share the policy's width, attention layout and RoPE."""
    for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "rope_theta",
                 "rope_scaling"):  # fmt: skip
        if getattr(target, name) != getattr(drafter, name):
            raise ValueError(
                f"drafter {name}={getattr(drafter, name)!r} differs from the policy's "
                f"{getattr(target, name)!r}"
            )


def check_spec_settings(strategy, max_batch, attention_impl) -> None:
    """Validates the engine config's SD fields (errors name the field and the value)."""
    if strategy is not None and not isinstance(strategy, SpecStrategy):
        raise ValueError(f"engine.spec_strategy={strategy!r} must be a SpecStrategy, a "
                         "'depth,topk,verify_tokens' string or None")  # fmt: skip
    if max_batch is not None and (not is_int(max_batch) or max_batch <= 0):
        raise ValueError(f"engine.spec_max_batch={max_batch!r} must be a positive integer or None")
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"engine.spec_attention_impl={attention_impl!r} is not one of "
                         f"{list(ATTENTION_IMPLS)}")  # fmt: skip


def check_hot_token_ids(hot_token_ids, vocab: int, min_size: int) -> jax.Array | None:
    """The draft head's vocabulary as a device array (None: the full vocabulary).

    Raises:
      ValueError: if the ids are not a 1-D list of distinct ids in [0, vocab) with at least
        `min_size` (the largest configured top-k) entries.
    """
    if hot_token_ids is None:
        return None
    ids = np.asarray(hot_token_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"hot_token_ids must be a non-empty 1-D integer array; got shape "
                         f"{ids.shape} dtype {ids.dtype}")  # fmt: skip
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"hot_token_ids hold ids outside [0, {vocab}): min {ids.min()}, "
                         f"max {ids.max()}")  # fmt: skip
    if np.unique(ids).size != ids.size:
        raise ValueError("hot_token_ids hold duplicate ids")
    if ids.size < min_size:
        raise ValueError(f"hot_token_ids has {ids.size} ids; the step policy's strategies "
                         f"need at least topk={min_size}")  # fmt: skip
    return jnp.asarray(ids, jnp.int32)


def _bucket(value: int, buckets) -> int:
    return next(b for b in buckets if value <= b)


@dataclasses.dataclass
class SpecResult:
    """One SD step's output for the running rows (host arrays)."""

    tokens: np.ndarray  # [B, T] emitted tokens, row i's first counts[i] are real
    logprobs: np.ndarray  # [B, T]
    counts: np.ndarray  # [B] tokens emitted per row (accepted drafts + 1)


class SpecRunner:
    """SD steps for one engine; every dependency is passed in (no reach into the engine)."""

    def __init__(self, config, graphdef, drafter_config: ModelConfig | None, stats,
                 program: Callable, ngram=None, forward=None,
                 one_program: Callable[[tuple], bool] | None = None):  # fmt: skip
        """
        Args:
          config: the engine's `EngineConfig` (buckets, attention impl).
          graphdef: the policy's graph definition.
          drafter_config: the drafter's architecture (None: model-free drafts only).
          stats: the engine's `EngineStats` (switch cost and per-source counters).
          program: `program(key, fn, *args, donate=())` -> compiled program (the engine's pool).
          ngram: the engine's `NgramIndex` (None: no model-free drafts).
          forward: the engine's `LayeredForward` (None: each step's layers run inside one
            program).
          one_program: `one_program(key)` -> whether the step of that one-program key runs as
            one program (the engine's tiering; default: whenever `forward` is None).
        """
        self.config = config
        self.graphdef = graphdef
        self.drafter_config = drafter_config
        self.stats = stats
        self._program = program
        self.ngram = ngram
        self.forward = forward
        self._one_program = one_program or (lambda key: forward is None)

    def step(self, choice: StepChoice, params, layers, drafter_params, hot,
             state: Any, running: list) -> tuple[Any, SpecResult]:  # fmt: skip
        """One SD step over `running` (slot i holds running[i]); returns (state, result).

        `hot` is None or (hot token ids [U], the live head's columns of them [D, U]): EAGLE
        drafts among those tokens only.

        The state's caches are the step's size (the engine fits them: room for a whole tree
        past the longest running request); `layers` are the policy's per-layer weights. A
        verify program reads the target cache and a commit program writes the accepted path.
        """
        if choice.needs_drafter and drafter_params is None:
            raise ValueError(f"step policy chose {choice} but this engine has no drafter")
        if choice.needs_ngram and self.ngram is None:
            raise ValueError(f"step policy chose {choice} but this engine has no n-gram index")
        if drafter_params is not None:
            state = self.sync_drafter(params, layers, drafter_params, state, running)
        b, s = state.cache.batch, state.cache.length
        strategy = choice.strategy
        k, d, t = strategy.topk, strategy.depth, strategy.verify_tokens
        if choice.needs_drafter:
            tree, candidates = self._eagle_tree(params, drafter_params, hot, state, b, s,
                                                strategy)  # fmt: skip
            if choice.source == "hybrid":
                tree = self._hybrid_tree(tree, candidates, running, t, d, k)
        else:
            tree = self._ngram_tree(running, b, t, d, k)
        greedy = all(r.request.sampling.greedy for r in running)
        filtering = needs_filtering(r.request.sampling for r in running)
        if self._one_program(self._verify_key(b, t, s, greedy, filtering, drafter_params)):
            state, tokens, logprobs, counts = self._verify(
                params, layers, drafter_params, state, tree, b, s, t, greedy, filtering
            )  # fmt: skip
        else:
            state, tokens, logprobs, counts = self._verify_layered(
                params, layers, drafter_params, state, tree, b, t, greedy, filtering)  # fmt: skip
        result = SpecResult(np.asarray(tokens), np.asarray(logprobs), np.asarray(counts))
        stats = self.stats
        stats.spec_steps += 1
        n = len(running)
        stats.spec_rows_by_source[choice.source] = stats.spec_rows_by_source.get(
            choice.source, 0) + n  # fmt: skip
        stats.spec_tokens_by_source[choice.source] = stats.spec_tokens_by_source.get(
            choice.source, 0) + int(result.counts[:n].sum())  # fmt: skip
        return state, result

    @staticmethod
    def _verify_key(b, t, s, greedy, filtering, drafter_params) -> tuple:
        return ("spec_verify", b, t, s, greedy, drafter_params is not None, filtering)

    def _verify(self, params, layers, drafter_params, state, tree, b, s, t, greedy, filtering):
        """Verify and commit as two programs, every layer unrolled in each."""
        verify_fn = functools.partial(
            speculative.verify_program, self.graphdef, self.drafter_config, batch=b, kv_len=s,
            greedy_only=greedy, attention_impl=self.config.spec_attention_impl,
            filtering=filtering,
        )  # fmt: skip
        args = (params, layers, drafter_params, state, tree)
        key = self._verify_key(b, t, s, greedy, filtering, drafter_params)
        state, tokens, logprobs, counts, new, path = self._program(key, verify_fn, *args,
                                                                   donate=(3,))(*args)  # fmt: skip
        commit_fn = functools.partial(speculative.commit_program, batch=b)
        args = (state, new, path, counts)
        state = self._program(("spec_commit", b, t, s), commit_fn, *args, donate=(0,))(*args)
        return state, tokens, logprobs, counts

    def _verify_layered(self, params, layers, drafter_params, state, tree, b, t, greedy,
                        filtering):  # fmt: skip
        """Verify and commit with the layers as block programs (`LayeredForward`): the
        inputs, the blocks reading the cache, the acceptance, then one commit per block."""
        impl = self.config.spec_attention_impl
        fn = functools.partial(speculative.verify_inputs, self.graphdef, batch=b)
        args = (params, without_caches(state), tree)
        inputs = self._program(("verify_inputs", b, t), fn, *args)(*args)
        x, news, cache = self.forward(layers, state.cache, inputs, write=False,
                                      attention_impl=impl)  # fmt: skip
        fn = functools.partial(speculative.verify_outputs, self.graphdef, self.drafter_config,
                               batch=b, greedy_only=greedy, attention_impl=impl,
                               filtering=filtering)  # fmt: skip
        args = (params, drafter_params, state.replace(cache=None), tree, x)
        key = ("verify_outputs", b, t, greedy, drafter_params is not None, draft_length(state),
               filtering)  # fmt: skip
        state, tokens, logprobs, counts, path = self._program(key, fn, *args, donate=(2,))(*args)
        blocks, start = [], 0
        fn = functools.partial(speculative.commit_block_program, batch=b)
        for new in news:
            n = new.k.shape[0]
            args = (cache.block(start, start + n), new, path, counts, state.lengths)
            key = ("commit_block", n, b, t, cache.length)
            blocks.append(self._program(key, fn, *args, donate=(0,))(*args))
            start += n
        return state.replace(cache=DecodeCache.joined(blocks)), tokens, logprobs, counts

    def _eagle_tree(self, params, drafter_params, hot, state, b, s, strategy):
        """The EAGLE tree of the running slots, and the candidates it was built from."""
        k, d, t = strategy.topk, strategy.depth, strategy.verify_tokens
        ids, head = (None, None) if hot is None else hot
        if ids is not None and ids.shape[0] < k:
            raise ValueError(f"strategy {strategy} needs topk={k} <= the hot vocabulary size "
                             f"{ids.shape[0]}")  # fmt: skip
        draft_fn = functools.partial(
            speculative.draft_program, self.graphdef, self.drafter_config, batch=b, kv_len=s,
            topk=k, depth=d, attention_impl=self.config.spec_attention_impl,
        )  # fmt: skip
        args = (params, drafter_params, state, ids, head)
        key = ("spec_draft", b, k, d, s, None if ids is None else ids.shape[0])
        candidates = self._program(key, draft_fn, *args)(*args)
        tree_fn = functools.partial(speculative.tree_program, batch=b, verify_tokens=t, depth=d)
        args = (candidates, state.last_token, state.lengths)
        return self._program(("spec_tree", b, k, d, t), tree_fn, *args)(*args), candidates

    def _rows(self, running: list, b: int):
        ids = [r.index for r in running]
        lengths = np.zeros((b,), np.int32)
        last = np.zeros((b,), np.int32)
        for i, run in enumerate(running):
            lengths[i] = run.cache_len
            last[i] = run.completion.token_ids[-1]
        return ids, lengths, last

    def _ngram_tree(self, running: list, b: int, t: int, d: int, k: int) -> DraftTree:
        ids, lengths, last = self._rows(running, b)
        arrays = self.ngram.propose_batch(ids, lengths[: len(ids)], last[: len(ids)],
                                          verify_tokens=t, depth=d, topk=k)  # fmt: skip
        return _padded_tree(arrays, b, lengths, last)

    def _hybrid_tree(self, tree: DraftTree, candidates, running: list, t: int, d: int,
                     k: int) -> DraftTree:  # fmt: skip
        """The n-gram chains merged into the EAGLE tree; the EAGLE leaves dropped for them are
        the lowest-ranked by the drafter's scores (with topk = 1 the tree is a chain and its
        index order is its score order, so the scores are not fetched)."""
        from tlt_jax.rollout.ngram import merge_into_tree

        n = len(running)
        ids, lengths, last = self._rows(running, tree.tokens_BxT.shape[0])
        host = [np.array(x) for x in jax.device_get(tuple(tree))]
        scores = None if k == 1 else tree_node_scores(host, jax.device_get(candidates))[:n]
        chains = self.ngram.propose_batch(ids, lengths[:n], last[:n], verify_tokens=t,
                                          depth=d, topk=1)  # fmt: skip
        merged = merge_into_tree(tuple(x[:n] for x in host), chains, verify_tokens=t,
                                 eagle_scores_BxT=scores)  # fmt: skip
        for full, part in zip(host, merged, strict=True):
            full[:n] = part
        return DraftTree(*(jnp.asarray(x) for x in host))

    def sync_drafter(self, params, layers, drafter_params, state, running: list):
        """Catches the drafter up on the positions plain steps decoded (the SD switch cost)."""
        behind = [r.cache_len - r.draft_len for r in running]
        if max(behind) <= 0:
            return state
        cfg = self.config
        b, s = state.cache.batch, state.cache.length
        t = _bucket(max(behind), cfg.prompt_buckets)
        tokens = np.zeros((b, t), np.int32)
        next_tokens = np.zeros((b, t), np.int32)
        counts = np.zeros((b,), np.int32)
        for i, run in enumerate(running):
            if behind[i] > 0:
                seq = run.request.prompt_ids + tuple(run.completion.token_ids)
                tokens[i, : behind[i]] = seq[run.draft_len : run.cache_len]
                next_tokens[i, : behind[i]] = seq[run.draft_len + 1 : run.cache_len + 1]
                counts[i] = behind[i]
        start, compiling = time.perf_counter(), self.stats.compile_seconds
        if self.forward is None:  # rare: no tiering, layered whenever the engine is
            fn = functools.partial(
                speculative.catchup_program, self.graphdef, self.drafter_config, batch=b,
                kv_len=s, attention_impl=cfg.spec_attention_impl,
            )  # fmt: skip
            args = (params, layers, drafter_params, state, tokens, next_tokens, counts)
            state = self._program(("drafter_catchup", b, t, s), fn, *args, donate=(3,))(*args)
        else:
            fn = functools.partial(speculative.catchup_inputs, self.graphdef, batch=b)
            args = (params, without_caches(state), tokens)
            inputs = self._program(("catchup_inputs", b, t), fn, *args)(*args)
            x, _, cache = self.forward(layers, state.cache, inputs, write=False,
                                       attention_impl=cfg.spec_attention_impl)  # fmt: skip
            fn = functools.partial(speculative.catchup_outputs, self.graphdef,
                                   self.drafter_config, batch=b,
                                   attention_impl=cfg.spec_attention_impl)  # fmt: skip
            args = (params, drafter_params, state.replace(cache=None), next_tokens, counts, x)
            key = ("catchup_outputs", b, t, draft_length(state))
            state = self._program(key, fn, *args, donate=(2,))(*args)
            state = state.replace(cache=cache)
        jax.block_until_ready(state.draft.lengths)  # rare, and measured
        compiling = self.stats.compile_seconds - compiling  # not the switch's cost
        self.stats.spec_switch_seconds += time.perf_counter() - start - compiling
        self.stats.spec_switch_count += 1
        self.stats.spec_switch_tokens += int(counts.sum())
        for run in running:
            run.draft_len = run.cache_len
        return state


def _padded_tree(arrays, b: int, lengths: np.ndarray, last: np.ndarray) -> DraftTree:
    """A host-built tree for the running rows, padded to the batch bucket with root-only rows
    (their nodes are the harmless padding `ngram.propose_batch` uses)."""
    tokens, parents, depth, positions, mask = (np.asarray(x) for x in arrays)
    n, t = tokens.shape
    if n < b:
        from tlt_jax.rollout.ngram import empty_tree

        pad = empty_tree(b - n, t, lengths[n:], last[n:])
        tokens, parents, depth, positions, mask = (
            np.concatenate([x, p]) for x, p in zip((tokens, parents, depth, positions, mask),
                                                    pad, strict=True))  # fmt: skip
    return DraftTree(jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32),
                     jnp.asarray(depth, jnp.int32), jnp.asarray(positions, jnp.int32),
                     jnp.asarray(mask, bool))  # fmt: skip
