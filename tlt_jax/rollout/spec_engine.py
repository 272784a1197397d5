"""The rollout engine's speculative-decoding steps (host side), mixed into `RolloutEngine`.

Per step the engine asks `step_mode(num_running)` for a `SpecStrategy` (None: plain decoding).
An SD step first brings every running request's drafter in sync (`_sync_drafter`: the switch
cost after plain steps), then runs the draft, tree and verify programs of `speculative.py` from
the engine's executable pool and emits each request's accepted tokens, trimmed at its stop tokens
and `max_new_tokens`. `Completion.accepted_lengths` gets the step's count before trimming (the
acceptance length the adaptive strategy selection rewards).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.transformer import ATTENTION_IMPLS
from tlt_jax.rollout import speculative
from tlt_jax.rollout.speculative import SpecStrategy


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
    if max_batch is not None and (not isinstance(max_batch, int) or max_batch <= 0):
        raise ValueError(f"engine.spec_max_batch={max_batch!r} must be a positive integer or None")
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"engine.spec_attention_impl={attention_impl!r} is not one of "
                         f"{list(ATTENTION_IMPLS)}")  # fmt: skip


def _bucket(value: int, buckets) -> int:
    return next(b for b in buckets if value <= b)


class SpeculativeSteps:
    """SD methods of `RolloutEngine`; they use the engine attributes declared below."""

    config: Any  # EngineConfig
    graphdef: Any
    params: Any
    drafter_config: ModelConfig | None
    drafter_params: Any  # DrafterParams or None
    state: Any  # DecodeState
    stats: Any  # EngineStats
    _program: Callable
    _emit: Callable
    model_config: ModelConfig
    hot_token_ids: jax.Array | None  # [U] int32, the draft head's vocabulary (None: all)

    def set_hot_token_ids(self, hot_token_ids) -> None:
        """Drafts among these token ids only (None: the full vocabulary).

        The draft levels' LM head becomes the live head's columns of these U tokens (see
        `tlt_jax.drafter.hot_vocab`); verification keeps the full vocabulary, so outputs are
        unchanged. A new size compiles new draft programs; new ids of the same size do not.

        Raises:
          ValueError: if the ids are not a 1-D list of distinct ids in [0, vocab) with at
            least the configured strategy's topk entries.
        """
        if hot_token_ids is None:
            self.hot_token_ids = None
            return
        ids = np.asarray(hot_token_ids)
        vocab = self.model_config.vocab_size
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"hot_token_ids must be a non-empty 1-D integer array; got shape "
                             f"{ids.shape} dtype {ids.dtype}")  # fmt: skip
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"hot_token_ids hold ids outside [0, {vocab}): min {ids.min()}, "
                             f"max {ids.max()}")  # fmt: skip
        if np.unique(ids).size != ids.size:
            raise ValueError("hot_token_ids hold duplicate ids")
        strategy = self.config.spec_strategy
        if strategy is not None and ids.size < strategy.topk:
            raise ValueError(f"hot_token_ids has {ids.size} ids; engine.spec_strategy "
                             f"{strategy} needs at least topk={strategy.topk}")  # fmt: skip
        self.hot_token_ids = jnp.asarray(ids, jnp.int32)

    def update_drafter_params(self, params) -> None:
        """Swaps in new drafter weights (`Drafter.params_dict()` layout), checked like the
        policy's (structure, shapes, dtypes, shardings).

        Drafter caches of running requests keep what the old weights computed; later SD steps
        extend them with the new weights (speculation stays lossless either way).
        """
        from tlt_jax.rl.weight_sync import check_compatible

        if self.drafter_params is None:
            raise ValueError("update_drafter_params: this engine was built without a drafter")
        check_compatible(self.drafter_params, params)
        self.drafter_params = params

    def step_mode(self, num_running: int) -> SpecStrategy | None:
        """The strategy of the next decode step, or None for plain decoding.

        The hook the adaptive controller drives (override it on the instance or in a
        subclass): SD whenever a drafter and a strategy are configured, unless more than
        `spec_max_batch` requests are running.
        """
        cfg = self.config
        if self.drafter_params is None or cfg.spec_strategy is None:
            return None
        if cfg.spec_max_batch is not None and num_running > cfg.spec_max_batch:
            return None
        return cfg.spec_strategy

    def _spec_step(self, running: list, max_len: int, strategy: SpecStrategy) -> None:
        """One SD step over the running requests (slot i holds running[i])."""
        if self.drafter_params is None:
            raise ValueError(f"step_mode chose {strategy} but this engine has no drafter")
        self._sync_drafter(running, max_len)
        cfg = self.config
        b = _bucket(len(running), cfg.batch_buckets)
        s = _bucket(max_len + 1, cfg.kv_buckets)
        greedy = all(r.request.sampling.greedy for r in running)
        k, d, t = strategy.topk, strategy.depth, strategy.verify_tokens
        impl = cfg.spec_attention_impl
        draft_fn = functools.partial(
            speculative.draft_program,
            self.graphdef,
            self.drafter_config,
            batch=b,
            kv_len=s,
            topk=k,
            depth=d,
            attention_impl=impl,
        )
        hot = self.hot_token_ids
        if hot is not None and hot.shape[0] < k:
            raise ValueError(f"strategy {strategy} needs topk={k} <= the hot vocabulary size "
                             f"{hot.shape[0]}")  # fmt: skip
        args = (self.params, self.drafter_params, self.state, hot)
        key = ("spec_draft", b, k, d, s, None if hot is None else hot.shape[0])
        candidates = self._program(key, draft_fn, *args)(*args)
        tree_fn = functools.partial(speculative.tree_program, batch=b, verify_tokens=t, depth=d)
        program = self._program(("spec_tree", b, k, d, t), tree_fn, candidates, self.state)
        tree = program(candidates, self.state)
        verify_fn = functools.partial(
            speculative.verify_program, self.graphdef, self.drafter_config, batch=b, kv_len=s,
            greedy_only=greedy, attention_impl=impl,
        )  # fmt: skip
        args = (self.params, self.drafter_params, self.state, tree)
        program = self._program(("spec_verify", b, t, s, greedy), verify_fn, *args, donate=(2,))
        self.state, tokens, logprobs, counts = program(*args)
        self.stats.spec_steps += 1
        tokens, logprobs, counts = np.asarray(tokens), np.asarray(logprobs), np.asarray(counts)
        for i, run in enumerate(running):
            run.completion.accepted_lengths.append(int(counts[i]))
            for j in range(int(counts[i])):
                self._emit(run, int(tokens[i, j]), float(logprobs[i, j]))
                if run.completion.finish_reason:
                    break  # the rest of the run is dropped with the finished request
            run.draft_len = run.cache_len

    def _sync_drafter(self, running: list, max_len: int) -> None:
        """Catches the drafter up on the positions plain steps decoded (the SD switch cost)."""
        behind = [r.cache_len - r.draft_len for r in running]
        if max(behind) <= 0:
            return
        cfg = self.config
        b = _bucket(len(running), cfg.batch_buckets)
        s = _bucket(max_len + 1, cfg.kv_buckets)
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
        fn = functools.partial(
            speculative.catchup_program,
            self.graphdef,
            self.drafter_config,
            batch=b,
            kv_len=s,
            attention_impl=cfg.spec_attention_impl,
        )
        args = (self.params, self.drafter_params, self.state, tokens, next_tokens, counts)
        program = self._program(("drafter_catchup", b, t, s), fn, *args, donate=(2,))
        start = time.perf_counter()
        self.state = program(*args)
        jax.block_until_ready(self.state.draft.lengths)  # rare, and measured
        self.stats.spec_switch_seconds += time.perf_counter() - start
        self.stats.spec_switch_count += 1
        self.stats.spec_switch_tokens += int(counts.sum())
        for run in running:
            run.draft_len = run.cache_len
