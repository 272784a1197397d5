"""Drafter training data: a buffer of harvested (tokens, features) samples and packed windows.

Dimension legend: B packed rows, T row length, D model.

The RL trainer hands the buffer what its logprob-recompute forward computed anyway: token ids,
the policy's final-norm features and the response mask of every sample, tagged with the RL
step. Training batches come from the last N steps (default 2, so long responses that finish
late in a step still get represented next step).

Windows (a documented variant of TLT's "window of <= 512 tokens starting at the first response
token"): a window keeps up to `prompt_context` prompt tokens before the response, so that the
first drafting pair (first response token, feature of the last prompt token) is trained and the
drafter attends to some prompt. When the context plus response fit in `window` tokens they are
taken whole; otherwise the window start is drawn uniformly, so the late parts of long responses,
where the long tail is decoded with the drafter, are trained as often as the beginnings.

Packing: windows go greedily (first fit, random order) into fixed-length rows, with segment ids
(1, 2, ... per row; 0 = padding) and positions restarting at 0 in every segment; training uses
a block-diagonal causal mask, so packed samples never see each other.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence

import jax
import numpy as np
from flax import struct


@struct.dataclass
class DrafterBatch:
    """Packed training rows (host numpy arrays until the train step transfers them)."""

    tokens_BxT: np.ndarray  # int32 token ids
    features_BxTxD: np.ndarray  # policy final-norm features
    loss_mask_BxT: np.ndarray  # bool, response tokens
    segment_ids_BxT: np.ndarray  # int32, 1.. per packed window, 0 = padding
    positions_BxT: np.ndarray  # int32, restart at 0 in every segment


@dataclasses.dataclass(frozen=True)
class Sample:
    """One harvested sequence, trimmed to the part windows can use."""

    tokens_T: np.ndarray  # int32
    features_TxD: np.ndarray  # feature dtype of the buffer
    response_mask_T: np.ndarray  # bool
    step: int


def cut_window(
    response_mask_T: np.ndarray, window: int, prompt_context: int, rng: np.random.Generator
) -> tuple[int, int] | None:
    """The [start, end) of one training window of a sample, or None without response tokens.

    Args:
      response_mask_T: True at response tokens.
      window: maximum window length (tokens).
      prompt_context: prompt tokens kept before the first response token (at least the last
        one, when there is one, so the first drafting pair is trained; at most window // 2).
      rng: draws the start of windows of responses longer than fit.
    """
    where = np.flatnonzero(response_mask_T)
    if where.size == 0:
        return None
    first, end = int(where[0]), int(where[-1]) + 1
    # At most half a window of prompt, so every window is mostly response.
    start = max(0, first - min(max(prompt_context, 1), window // 2))
    if end - start <= window:
        return start, end
    start = int(rng.integers(start, end - window + 1))
    return start, start + window


def pack_windows(
    windows: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
    batch_rows: int,
    row_len: int,
    feature_dtype=np.float32,
) -> tuple[DrafterBatch, int]:
    """Packs windows first-fit into `batch_rows` rows of `row_len` tokens.

    Args:
      windows: (tokens_T, features_TxD, response_mask_T) per window, each T <= row_len.
      batch_rows: rows in the batch.
      row_len: tokens per row.
      feature_dtype: dtype of the packed features.

    Returns:
      (batch, number of windows packed); windows that fit no row are skipped.
    """
    if not windows:
        raise ValueError("pack_windows needs at least one window")
    d = windows[0][1].shape[-1]
    tokens = np.zeros((batch_rows, row_len), np.int32)
    features = np.zeros((batch_rows, row_len, d), feature_dtype)
    loss_mask = np.zeros((batch_rows, row_len), bool)
    segment_ids = np.zeros((batch_rows, row_len), np.int32)
    positions = np.zeros((batch_rows, row_len), np.int32)
    used = [0] * batch_rows
    segments = [0] * batch_rows
    packed = 0
    for window_tokens, window_features, window_mask in windows:
        n = len(window_tokens)
        if n > row_len:
            raise ValueError(f"window of {n} tokens is longer than {row_len=}")
        row = next((r for r in range(batch_rows) if used[r] + n <= row_len), None)
        if row is None:
            continue
        span = slice(used[row], used[row] + n)
        segments[row] += 1
        tokens[row, span] = window_tokens
        features[row, span] = window_features
        loss_mask[row, span] = window_mask
        segment_ids[row, span] = segments[row]
        positions[row, span] = np.arange(n)
        used[row] += n
        packed += 1
    batch = DrafterBatch(tokens, features, loss_mask, segment_ids, positions)
    return batch, packed


class DrafterBuffer:
    """Harvested samples of the recent RL steps; serves packed training batches.

    Thread-safe: the RL loop adds while a spot-training thread samples.
    """

    def __init__(
        self,
        *,
        max_samples: int = 2000,
        last_n_steps: int = 2,
        window: int = 512,
        prompt_context: int = 64,
        feature_dtype=jax.numpy.bfloat16,
    ):
        """Args:
        max_samples: oldest samples are dropped beyond this many.
        last_n_steps: batches use samples of the latest `last_n_steps` RL steps.
        window: maximum training window (tokens).
        prompt_context: prompt tokens kept before the response in a window.
        feature_dtype: host dtype of stored features (bf16 halves host memory).
        """
        for name, value in (("max_samples", max_samples), ("last_n_steps", last_n_steps),
                            ("window", window)):  # fmt: skip
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if prompt_context < 0:
            raise ValueError(f"prompt_context={prompt_context} must be >= 0")
        self.last_n_steps = last_n_steps
        self.window = window
        self.prompt_context = prompt_context
        self.feature_dtype = np.dtype(feature_dtype)
        self._samples: collections.deque[Sample] = collections.deque(maxlen=max_samples)
        self._latest_step: int | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def latest_step(self) -> int | None:
        return self._latest_step

    @property
    def capacity(self) -> int:
        """Samples held at most (the oldest are dropped beyond it)."""
        return self._samples.maxlen

    def add(
        self,
        tokens,
        features,
        response_mask,
        step: int,
        valid_mask=None,
    ) -> int:
        """Adds one sample ([T] / [T, D] / [T]) or a batch of them ([B, T] / [B, T, D] / [B, T]).

        Args:
          tokens: token ids of prompt + response.
          features: the policy's final-norm features at the same positions (device or host).
          response_mask: True at response tokens (the loss mask).
          step: the RL step the sample comes from.
          valid_mask: optional, True at real tokens; other positions (left or right padding)
            are removed before storing, so padded batches can be passed as they are.

        Returns:
          The number of samples stored (samples without response tokens are skipped).
        """
        tokens = np.asarray(tokens)
        features = np.asarray(jax.device_get(features))
        response_mask = np.asarray(response_mask, bool)
        if tokens.ndim == 1:
            tokens, features, response_mask = tokens[None], features[None], response_mask[None]
            valid_mask = None if valid_mask is None else np.asarray(valid_mask)[None]
        if features.shape[:2] != tokens.shape or response_mask.shape != tokens.shape:
            raise ValueError(
                f"tokens.shape={tokens.shape}, features.shape={features.shape} and "
                f"response_mask.shape={response_mask.shape} must agree on [B, T]"
            )
        if valid_mask is not None and np.shape(valid_mask) != tokens.shape:
            raise ValueError(f"valid_mask.shape={np.shape(valid_mask)} != {tokens.shape=}")
        stored = []
        for b in range(tokens.shape[0]):
            keep = slice(None) if valid_mask is None else np.asarray(valid_mask[b], bool)
            row_tokens, row_mask = tokens[b][keep], response_mask[b][keep]
            where = np.flatnonzero(row_mask)
            if where.size == 0:
                continue
            # Nothing before the prompt context or after the last response token is ever used.
            span = slice(max(0, int(where[0]) - max(self.prompt_context, 1)), int(where[-1]) + 1)
            stored.append(Sample(
                tokens_T=row_tokens[span].astype(np.int32),
                features_TxD=features[b][keep][span].astype(self.feature_dtype),
                response_mask_T=row_mask[span],
                step=int(step),
            ))  # fmt: skip
        with self._lock:
            if self._samples and stored:
                d_old = self._samples[0].features_TxD.shape[-1]
                if stored[0].features_TxD.shape[-1] != d_old:
                    raise ValueError(
                        f"features have D={stored[0].features_TxD.shape[-1]}; "
                        f"the buffer holds D={d_old}"
                    )
            self._samples.extend(stored)
            if self._latest_step is None or step > self._latest_step:
                self._latest_step = int(step)
        return len(stored)

    def to_arrays(self, max_bytes: int | None = None) -> dict[str, np.ndarray] | None:
        """The recent samples as flat host arrays (what a run checkpoint stores, so a resumed
        run trains on the same data); None when empty or over `max_bytes`. bfloat16 features
        travel as their uint16 bits."""
        samples = self.recent_samples()
        if not samples:
            return None
        features = np.concatenate([s.features_TxD for s in samples])
        if max_bytes is not None and features.nbytes > max_bytes:
            return None
        if features.dtype == jax.numpy.bfloat16:
            features = features.view(np.uint16)
        return {
            "tokens": np.concatenate([s.tokens_T for s in samples]),
            "features": features,
            "response_mask": np.concatenate([s.response_mask_T for s in samples]),
            "lengths": np.asarray([len(s.tokens_T) for s in samples], np.int64),
            "steps": np.asarray([s.step for s in samples], np.int64),
        }

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Replaces the contents with `to_arrays`' samples."""
        features = np.asarray(arrays["features"])
        if features.dtype == np.uint16:
            features = features.view(jax.numpy.bfloat16)
        ends = np.cumsum(arrays["lengths"])
        starts = ends - np.asarray(arrays["lengths"])
        samples = [Sample(tokens_T=np.asarray(arrays["tokens"][a:b], np.int32),
                          features_TxD=features[a:b].astype(self.feature_dtype),
                          response_mask_T=np.asarray(arrays["response_mask"][a:b], bool),
                          step=int(step))
                   for a, b, step in zip(starts, ends, arrays["steps"], strict=True)]  # fmt: skip
        with self._lock:
            self._samples.clear()
            self._samples.extend(samples)
            self._latest_step = max((s.step for s in samples), default=None)

    def end_step(self, step: int) -> None:
        """RL step `step` has added everything it had: the recent window ends at it even when
        it added nothing (a step whose every group was silent), so `recent_samples` never
        returns features older than `last_n_steps` RL steps. (A checkpoint holds only the
        window's samples, so a resumed buffer, whose window ends at its newest sample, returns
        the same ones until the next step ends.)"""
        with self._lock:
            if self._latest_step is None or step > self._latest_step:
                self._latest_step = int(step)

    def recent_samples(self) -> list[Sample]:
        """The samples of the latest `last_n_steps` RL steps."""
        with self._lock:
            if self._latest_step is None:
                return []
            oldest = self._latest_step - self.last_n_steps + 1
            return [s for s in self._samples if s.step >= oldest]

    def sample_batch(
        self, rng: np.random.Generator, batch_rows: int, row_len: int
    ) -> DrafterBatch | None:
        """A packed batch of random windows from the recent steps.

        Args:
          rng: numpy generator (sample order and window starts).
          batch_rows: rows of the batch.
          row_len: tokens per row; windows are at most `min(window, row_len)` long.

        Returns:
          The batch, or None when the recent steps hold no sample.
        """
        samples = self.recent_samples()
        if not samples:
            return None
        window = min(self.window, row_len)
        capacity = batch_rows * row_len
        windows, total = [], 0
        for index in rng.permutation(len(samples)):
            sample = samples[int(index)]
            start, end = cut_window(sample.response_mask_T, window, self.prompt_context, rng)
            windows.append((sample.tokens_T[start:end], sample.features_TxD[start:end],
                            sample.response_mask_T[start:end]))  # fmt: skip
            total += end - start
            if total >= capacity:
                break
        batch, _ = pack_windows(windows, batch_rows, row_len, self.feature_dtype)
        return batch
