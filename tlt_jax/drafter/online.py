"""The online drafter: one canonical EAGLE drafter trained during RL on the policy's features.

The RL trainer's log-prob recompute hands `OnlineDrafter.add` (a `FeatureSink`) the final-norm
features it computed anyway; they go into a `DrafterBuffer` (windows of the last
`buffer_steps` RL steps, packed with segment ids). The spot scheduler calls `train_on` on the
devices of a rollout slice whose requests are done, which runs drafter gradient steps there
until its `stop` event is set (cooperative preemption: the check sits between two steps, so a
stop waits for at most the step in flight). At the RL step boundary `publish` hands out the new
version for every slice's engine (through the engine's checked `update_drafter_params`).

There is one train state, never one per slice: a training run moves it onto the training
slice's devices, and the engines only ever receive published copies, so replicas cannot drift.
A step whose loss or gradient norm is not finite is dropped (the state before it is kept: the
step does not donate its input), counted in `failures` and in `publish`'s `drafter_dropped_steps`,
and logged; the run goes on with the next batch. One bad sample in the buffer (drawn at random)
thus costs the steps that draw it, not the rest of every idle window for `buffer_steps` RL
steps. `MAX_CONSECUTIVE_DROPS` dropped steps in a row end the run: random batches seldom fail
that often in a row because of a few bad samples, so it means most of the buffer (or the
drafter) is broken, and more steps would only be thrown away (in `exact_steps_per_rl_step`
mode they would also add to the step time).

The hot vocabulary (the draft head's columns) follows the tokens the policy generates: counts
of every response token the sink sees; `publish` ranks them. Training uses the same columns,
so the drafter learns the head it drafts with.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.drafter.data import DrafterBatch, DrafterBuffer
from tlt_jax.drafter.hot_vocab import hot_token_ids
from tlt_jax.drafter.trainer import (
    DrafterTrainConfig,
    DrafterTrainState,
    init_train_state,
    make_buffer,
    make_train_step,
)
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import DrafterParams, init_drafter

log = logging.getLogger(__name__)

# Metrics of one drafter step that are averaged into the step-boundary record.
STEP_METRICS = ("loss", "vloss", "ploss", "accuracy", "grad_norm")
# Non-finite drafter steps in a row that end a training run (see the module docstring): with
# a share q of batches failing at random, a run ends early with probability about q**8 per
# attempt (0.4 % at q = 0.5), while a broken buffer wastes at most 8 steps per idle window.
MAX_CONSECUTIVE_DROPS = 8


class OnlineDrafter:
    """The drafter's train state, buffer and version; trained by the spot scheduler."""

    def __init__(
        self,
        target_config: ModelConfig,
        config: DrafterTrainConfig,
        *,
        params: DrafterParams | None = None,
        hot_vocab: int = 0,
        seed: int = 0,
        max_samples: int = 2000,
    ):
        """
        Args:
          target_config: the policy's model config.
          config: optimiser, loss, window and batch settings.
          params: a warm start (`Drafter.params_dict()`, e.g. an EAGLE export); None starts
            from a random initialisation (cold start).
          hot_vocab: draft and train over the policy's `hot_vocab` most generated tokens (0:
            the full head).
          seed: the random init and the batch sampling stream.
          max_samples: the buffer's capacity (oldest samples dropped).
        """
        if hot_vocab < 0 or hot_vocab > target_config.vocab_size:
            raise ValueError(f"hot_vocab={hot_vocab} must be in [0, vocab_size="
                             f"{target_config.vocab_size}]")  # fmt: skip
        self.target_config = target_config
        self.config = config
        if params is None:
            params = init_drafter(target_config, seed).params_dict()
        self.state: DrafterTrainState = init_train_state(params, config)
        self.buffer: DrafterBuffer = make_buffer(config, max_samples=max_samples)
        self._train_step = make_train_step(target_config, config, donate=False)
        self._rng = np.random.default_rng([seed, 0x5107])
        self.hot_vocab = hot_vocab
        self.token_counts = np.zeros((target_config.vocab_size,), np.int64)
        # Until tokens are counted, the first ids: a fixed size from the start, so the engine's
        # draft programs never recompile when the real ranking arrives.
        self.hot_ids = np.arange(hot_vocab, dtype=np.int32) if hot_vocab else None
        self.version = 0  # published versions
        self.failures = 0  # dropped non-finite steps and failed training runs
        self._dropped = 0  # dropped non-finite steps since publish
        self._published_step = 0
        self._lock = threading.Lock()
        self._window: list[dict[str, float]] = []  # metrics of the steps since publish
        self._compiled: dict[Any, Any] = {}  # device -> precompiled train step

    # -- data ------------------------------------------------------------------------------

    def add(self, tokens, features, response_mask, step: int, valid_mask=None) -> int:
        """The `FeatureSink` entry point: counts response tokens, stores the samples."""
        tokens = np.asarray(tokens)
        counted = np.asarray(response_mask, bool)  # the caller's own array: never written
        if valid_mask is not None:
            counted = counted & np.asarray(valid_mask, bool)
        np.add.at(self.token_counts, tokens[counted], 1)
        return self.buffer.add(tokens, features, response_mask, step, valid_mask=valid_mask)

    def end_step(self, step: int) -> None:
        """RL step `step` handed over its features (`DrafterBuffer.end_step`)."""
        self.buffer.end_step(step)

    def ready(self) -> bool:
        """Whether the buffer holds samples of the recent steps."""
        return bool(self.buffer.recent_samples())

    @property
    def steps(self) -> int:
        """Optimizer steps taken so far (every version included)."""
        return int(jax.device_get(self.state.step))

    # -- training --------------------------------------------------------------------------

    def precompile(self, device, embed_VxD: jax.Array) -> float:
        """Compiles the train step for `device` ahead of the first idle window (a compile
        there would be one long drafter step, and the preemption would wait for it);
        returns the seconds it took (0 when it was compiled already)."""
        cfg = self.config
        d = self.target_config.hidden_size
        u = self.hot_vocab or self.target_config.vocab_size
        sharding = jax.sharding.SingleDeviceSharding(device)

        def spec(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        rows = (cfg.batch_rows, cfg.row_len)
        batch = DrafterBatch(spec(rows, jnp.int32), spec((*rows, d), self.buffer.feature_dtype),
                             spec(rows, jnp.bool_), spec(rows, jnp.int32),
                             spec(rows, jnp.int32))  # fmt: skip
        state = jax.tree.map(lambda x: spec(x.shape, x.dtype), self.state)
        start = time.perf_counter()
        compiled = self._train_step.lower(
            state, batch, spec(embed_VxD.shape, embed_VxD.dtype), spec((d, u), embed_VxD.dtype)
        ).compile()
        self._compiled[device] = compiled
        return time.perf_counter() - start

    def train_on(
        self,
        devices,
        embed_VxD: jax.Array,
        head_DxV: jax.Array,
        stop: threading.Event,
        *,
        max_steps: int = 0,
        on_step: Callable[[float, bool], None] | None = None,
        max_consecutive_drops: int = MAX_CONSECUTIVE_DROPS,
    ) -> int:
        """Runs drafter steps on `devices` until `stop` is set (checked before every step).

        Args:
          devices: the idle slice's devices; the state, the batches and the frozen embedding
            and head are placed there, so no work lands on another slice's devices.
          embed_VxD / head_DxV: the policy's embedding and LM head (any device; copied).
          stop: the preemption signal.
          max_steps: at most this many applied steps (0: until stopped or out of data).
          on_step: called after each step with its seconds and whether it was applied (False:
            dropped as non-finite), so the caller counts only applied steps as reclaimed.
          max_consecutive_drops: this many dropped steps in a row end the run.

        Returns:
          The number of steps applied (dropped non-finite steps excluded).
        """
        if max_consecutive_drops < 1:
            raise ValueError(f"max_consecutive_drops={max_consecutive_drops} must be >= 1")
        device = devices[0] if isinstance(devices, (list, tuple)) else devices
        with self._lock:
            state = self.state
            done = dropped = in_a_row = 0
            try:  # copies onto the slice included: a failed one is a failed run too
                state = jax.device_put(state, device)
                embed = jax.device_put(embed_VxD, device)
                head = jax.device_put(head_DxV, device)
                if self.hot_ids is not None:  # the columns the engines draft with
                    head = jnp.take(head, jax.device_put(self.hot_ids, device), axis=1)
                # The cap first: a trainer that stops on it was not preempted, and asking
                # the stop marks it heeded (`scheduler._StopSignal`).
                while (max_steps == 0 or done < max_steps) and not stop.is_set():
                    batch = self.buffer.sample_batch(self._rng, self.config.batch_rows,
                                                     self.config.row_len)  # fmt: skip
                    if batch is None:
                        break
                    start = time.perf_counter()
                    train_step = self._compiled.get(device, self._train_step)
                    new_state, metrics = train_step(state, jax.device_put(batch, device), embed,
                                                    head)  # fmt: skip
                    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    seconds = time.perf_counter() - start
                    applied = bool(np.isfinite(values["loss"]) and np.isfinite(values["grad_norm"]))
                    if on_step is not None:
                        on_step(seconds, applied)
                    if not applied:
                        self.failures += 1
                        self._dropped += 1
                        dropped += 1
                        in_a_row += 1
                        if dropped == 1:  # once per run (the count is in the publish metrics)
                            log.warning("drafter step %d: non-finite loss %s / grad norm %s; "
                                        "dropped, keeping version %d and going on with the "
                                        "next batch", int(state.step), values["loss"],
                                        values["grad_norm"], self.version)  # fmt: skip
                        if in_a_row >= max_consecutive_drops:
                            log.warning("%d drafter steps in a row were non-finite: ending this "
                                        "training run (the buffer's recent samples or the "
                                        "drafter look broken)", in_a_row)  # fmt: skip
                            break
                        continue
                    in_a_row = 0
                    state = new_state
                    self._window.append(values)
                    done += 1
            except Exception:
                self.failures += 1  # a failed training run (the caller logs it)
                raise
            finally:
                # The steps applied so far are kept (their metrics are in the window): a run
                # that fails later does not discard them.
                self.state = state
        if dropped > 1:
            log.warning("%d of %d drafter steps in this run were non-finite and dropped",
                        dropped, dropped + done)  # fmt: skip
        return done

    # -- the step boundary -----------------------------------------------------------------

    def publish(self) -> dict[str, Any]:
        """Ends the window: a new version when steps were taken since the last publish.

        Returns:
          Metrics of the window: `drafter_version`, `drafter_steps` (applied this window),
          `drafter_dropped_steps` (non-finite, dropped this window), `drafter_failures` (so
          far: dropped steps and failed runs) and the mean `drafter_loss`, `drafter_accuracy` (top-1
          agreement with the policy, over the hot vocabulary when there is one), ...
        """
        with self._lock:
            steps = self.steps
            if steps > self._published_step:
                self.version += 1
                self._published_step = steps
            if self.hot_vocab and self.token_counts.any():
                # Tokens the counts do not rank yet keep the hot set in use (the warm-up's, at
                # first), not the lowest ids.
                self.hot_ids = hot_token_ids(self.token_counts, self.hot_vocab, self.hot_ids)
            window, self._window = self._window, []
            dropped, self._dropped = self._dropped, 0
        out: dict[str, Any] = {
            "drafter_version": self.version,
            "drafter_steps": len(window),
            "drafter_dropped_steps": dropped,
            "drafter_failures": self.failures,
        }
        for name in STEP_METRICS:
            if window:
                out[f"drafter_{name}"] = float(np.mean([w[name] for w in window]))
        return out

    def params(self) -> DrafterParams:
        """The current (published) params, on their training device."""
        return self.state.params

    def state_dict(self) -> dict[str, Any]:
        """Host-side counters for the run checkpoint (the train state is saved by orbax)."""
        return {
            "version": self.version,
            "failures": self.failures,
            "published_step": self._published_step,
            "rng": self._rng.bit_generator.state,
            "token_counts": self.token_counts.tolist() if self.token_counts.any() else [],
            "hot_ids": [] if self.hot_ids is None else self.hot_ids.tolist(),
        }

    def sync_dict(self) -> dict[str, Any]:
        """What another process needs to continue from this one's training (JSON): the
        counters, the sampling stream and the metrics of the steps since the last publish."""
        return {"failures": self.failures, "rng": self._rng.bit_generator.state,
                "window": self._window, "dropped": self._dropped}  # fmt: skip

    def load_sync(self, train_state: DrafterTrainState, host: dict[str, Any]) -> None:
        """Takes over another process's training (`sync_dict`, its broadcast train state)."""
        with self._lock:
            self.state = train_state
            self.failures = int(host["failures"])
            self._rng.bit_generator.state = host["rng"]
            self._window = list(host["window"])
            self._dropped = int(host["dropped"])

    def load_state_dict(self, state: dict[str, Any], train_state: DrafterTrainState) -> None:
        self.state = train_state
        self.version = int(state["version"])
        self.failures = int(state["failures"])
        self._published_step = int(state["published_step"])
        self._rng.bit_generator.state = state["rng"]
        if state["token_counts"]:
            self.token_counts = np.asarray(state["token_counts"], np.int64)
        stored = np.asarray(state.get("hot_ids") or (), np.int32)
        if self.hot_vocab and len(stored) == self.hot_vocab:
            self.hot_ids = stored
        elif self.hot_vocab and len(stored):  # resumed under another spec.hot_vocab: re-ranked
            # (the programs are built for this size), the stored set first among ties
            self.hot_ids = hot_token_ids(self.token_counts, self.hot_vocab, prefer=stored)
        elif self.hot_vocab and state["token_counts"]:  # a checkpoint from before hot_ids
            self.hot_ids = hot_token_ids(self.token_counts, self.hot_vocab)
