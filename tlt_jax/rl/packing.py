"""Host-side micro-batches of the RL update, padded or packed, with the maps back to responses.

The trainer's log-prob and gradient programs see a `MicroBatch`'s `batch` (`SequenceBatch`
or `PackedBatch`, see `rl/step.py`); everything else here is numpy bookkeeping: which
response sits where (`spans`), so per-response values (advantages, aggregation weights) go
into the batch's token layout and per-token outputs (log-probs, features) come back out.

Packing (`packed_micro_batches`): within one mini-batch, each group's responses, longest
first, join an open piece of that group (the prompt is already in the row) when they fit,
else open a new piece (prompt + response) in the first row with room, else a new row. Rows
have one fixed length per run (the longest prompt plus the longest response, so anything
fits), and a micro-batch holds up to `max_rows` of them, the token budget of a padded
micro-batch at its longest. The rows split into micro-batches of sizes from a short list
(`ROW_BUCKETS`, so a run compiles a few shapes): some of one size and one smaller for the
rest, the split that computes the fewest rows plus a small cost per micro-batch
(`split_rows`). Groups whose advantages are all zero pack into
micro-batches of their own, which the update skips.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from tlt_jax.rl import algorithms
from tlt_jax.rl import step as step_lib

# Packed row counts a micro-batch may have (each one compiles once; steps about 1.25x apart,
# so rounding a step's rows up wastes at most ~20% and usually nothing, see `split_rows`).
ROW_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96,
               112, 128, 160, 192, 224, 256)  # fmt: skip


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch and where its responses are.

    Attributes:
      batch: the programs' input (host numpy `SequenceBatch` or `PackedBatch`).
      spans: int [n, 4], per response it holds: (response id, row, column, length) of its
        tokens in the batch's log-prob layout ([B, T] padded, [R, L] packed).
      prompt_spans: int [n, 3], per response: (row, column, length) of its prompt in the
        layout of the features the drafter buffer gets (see `sink_rows`).
      trained: whether its policy gradient can be non-zero (some group has advantage signal).
      computed: token positions the programs compute (prompt and response sides).
      needed: of those, real tokens: its responses, plus each group's prompt if this is the
        first micro-batch of the step that holds it (a prompt repeated in other rows or
        micro-batches is padding; so the step's sum is its prompts and responses).
    """

    batch: step_lib.SequenceBatch | step_lib.PackedBatch
    spans: np.ndarray
    prompt_spans: np.ndarray
    trained: bool
    computed: int
    needed: int

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, columns) of the log-prob layout."""
        return step_lib.response_mask(self.batch).shape

    @property
    def response_ids(self) -> np.ndarray:
        return self.spans[:, 0]

    def per_token(self, per_response: np.ndarray) -> np.ndarray:
        """float32 [rows, cols]: each response's value on its tokens, 0 elsewhere."""
        out = np.zeros(self.shape, np.float32)
        for b, row, col, n in self.spans:
            out[row, col : col + n] = per_response[b]
        return out

    def token_values(self, per_response_tokens: Sequence[Sequence[float]]) -> np.ndarray:
        """float32 [rows, cols]: each response's per-token values (indexed by response id,
        one value per token) on its tokens, 0 elsewhere."""
        out = np.zeros(self.shape, np.float32)
        for b, row, col, n in self.spans:
            out[row, col : col + n] = np.asarray(per_response_tokens[b], np.float32)[:n]
        return out

    def per_response(self, values) -> list[np.ndarray]:
        """A [rows, cols] per-token array cut back into one array per response (spans order)."""
        values = np.asarray(values)
        return [values[row, col : col + n] for _, row, col, n in self.spans]

    def sink_rows(self, features):
        """Each response's `prompt + response` as one row for the drafter buffer.

        Args:
          features: the log-prob program's features of this batch.

        Returns:
          (tokens [n, W] int32, features [n, W, D] (device), response_mask, valid_mask):
          row i is response i's prompt then its tokens, right-padded to W (the padded
          layout's S + T, the packed row length).
        """
        flat, tokens, prompt_stride, response_base = self._flat_features(features)
        width = self.shape[1] + (0 if response_base == 0 else prompt_stride)
        n = len(self.spans)
        index = np.zeros((n, width), np.int32)
        valid = np.zeros((n, width), bool)
        response = np.zeros((n, width), bool)
        cols = self.shape[1]
        for i, ((_, row, col, length), (p_row, p_col, p_len)) in enumerate(
            zip(self.spans, self.prompt_spans, strict=True)
        ):
            index[i, :p_len] = p_row * prompt_stride + p_col + np.arange(p_len)
            r_start = response_base + row * cols + col
            index[i, p_len : p_len + length] = r_start + np.arange(length)
            valid[i, : p_len + length] = True
            response[i, p_len : p_len + length] = True
        rows_tokens = np.where(valid, tokens[index], 0).astype(np.int32)
        return rows_tokens, jnp.take(flat, jnp.asarray(index), axis=0), response, valid

    def _flat_features(self, features):
        """(features [N, D] on one token axis, their tokens, prompt row stride, offset of the
        response rows): packed rows as they are; a padded batch's prompt features [P, S, D]
        then its response features [B, T, D]."""
        if isinstance(self.batch, step_lib.PackedBatch):
            cols = self.shape[1]
            return (features.reshape(-1, features.shape[-1]),
                    np.asarray(self.batch.tokens_RxL).reshape(-1), cols, 0)  # fmt: skip
        prompt_features, response_features = features
        d = prompt_features.shape[-1]
        prompt_tokens = np.asarray(self.batch.prompt_tokens_PxS)
        flat = jnp.concatenate([prompt_features.reshape(-1, d),
                                response_features.reshape(-1, d)])  # fmt: skip
        response_tokens = np.asarray(self.batch.response_tokens_BxT)
        tokens = np.concatenate([prompt_tokens.reshape(-1), response_tokens.reshape(-1)])
        return flat, tokens, prompt_tokens.shape[1], prompt_tokens.size


# ----------------------------------------------------------------------------- padded


def padded_micro_batches(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                         plan: list[list[list[int]]], group_size: int, has_signal: np.ndarray,
                         *, min_bucket: int, max_prompt: int, max_response: int
                         ) -> list[list[MicroBatch]]:  # fmt: skip
    """Micro-batches of whole groups padded to power-of-two buckets (`plan` from
    `step.plan_micro_batches`: group indices per micro-batch per mini-batch)."""
    out = []
    for mini in plan:
        micros = []
        for groups in mini:
            ids = [q * group_size + j for q in groups for j in range(group_size)]
            batch = step_lib.build_sequence_batch(
                [prompts[q] for q in groups], [responses[b] for b in ids], group_size,
                min_bucket=min_bucket, max_prompt=max_prompt, max_response=max_response,
            )  # fmt: skip
            spans = np.asarray([(b, i, 0, len(responses[b])) for i, b in enumerate(ids)],
                               np.int64).reshape(-1, 4)  # fmt: skip
            prompt_rows = [i // group_size for i in range(len(ids))]
            prompt_spans = np.asarray([(p, 0, len(prompts[groups[p]])) for p in prompt_rows],
                                      np.int64).reshape(-1, 3)  # fmt: skip
            computed = batch.prompt_tokens_PxS.size + batch.response_tokens_BxT.size
            needed = sum(len(prompts[q]) for q in groups) + sum(len(responses[b]) for b in ids)
            micros.append(MicroBatch(batch, spans, prompt_spans, bool(has_signal[groups].any()),
                                     int(computed), int(needed)))  # fmt: skip
        out.append(micros)
    return out


# ----------------------------------------------------------------------------- packed


def packed_geometry(max_prompt: int, max_response: int, micro_batch_size: int,
                    group_size: int, min_bucket: int) -> tuple[int, int]:  # fmt: skip
    """(row length, rows per micro-batch) of a run.

    A row fits the longest prompt plus the longest response (rounded up to `min_bucket`); a
    micro-batch holds the tokens of a padded micro-batch at its longest (its prompts plus
    `micro_batch_size` responses), so the update's memory bound stays where it was.
    """
    row_len = math.ceil((max_prompt + max_response) / min_bucket) * min_bucket
    budget = micro_batch_size // group_size * max_prompt + micro_batch_size * max_response
    return row_len, max(1, budget // row_len)


def pack_rows(prompt_lens: Sequence[int], response_lens: Sequence[int], groups: Sequence[int],
              group_size: int, row_len: int) -> list[list[tuple[int, list[int]]]]:  # fmt: skip
    """Rows of pieces `(prompt index, [response ids])` holding every non-empty response of
    `groups` (see the module docstring for the rule)."""
    rows: list[list[tuple[int, list[int]]]] = []
    free: list[int] = []

    def longest(q: int) -> int:
        return max(response_lens[q * group_size : (q + 1) * group_size])

    order = sorted(groups, key=lambda q: -longest(q))
    for q in order:
        members = [b for b in range(q * group_size, (q + 1) * group_size) if response_lens[b]]
        members.sort(key=lambda b: -response_lens[b])
        open_pieces: list[tuple[int, list[int]]] = []  # (row, the piece's response list)
        for b in members:
            n = response_lens[b]
            for r, piece in open_pieces:
                if free[r] >= n:
                    piece.append(b)
                    free[r] -= n
                    break
            else:
                need = prompt_lens[q] + n
                if need > row_len:
                    raise ValueError(
                        f"prompt {q} ({prompt_lens[q]} tokens) + response {b} ({n} tokens) = "
                        f"{need} > the packed row length {row_len}; expected prompts <= "
                        "rollout.max_prompt_len and responses <= rollout.max_new_tokens"
                    )
                r = next((i for i, f in enumerate(free) if f >= need), None)
                if r is None:
                    rows.append([])
                    free.append(row_len)
                    r = len(rows) - 1
                piece = [b]
                rows[r].append((q, piece))
                free[r] -= need
                open_pieces.append((r, piece))
    return rows


# What one more micro-batch costs, in rows, when choosing a split: its fixed work (reading the
# weights, adding into the gradient accumulator, a dispatch) and smaller, less efficient
# matmuls. Half a row keeps micro-batches few and large unless splitting saves real rows.
MICRO_BATCH_COST_ROWS = 0.5


def split_rows(num_rows: int, max_rows: int, multiple: int = 1,
               processes: int = 1) -> tuple[int, ...]:  # fmt: skip
    """Rows per micro-batch for `num_rows` packed rows.

    Sizes are `ROW_BUCKETS` sizes or `max_rows`, multiples of `multiple` (the mesh's data
    degree, which splits the rows; `max_rows` must be one). Candidates: micro-batches of one
    size with one smaller for the rest (13 rows at most 12 each: 12 + 1, not 3 x 5), and
    micro-batches of one size (2 x 8). The cheapest wins, by the rows the busiest process
    computes plus `MICRO_BATCH_COST_ROWS` per micro-batch it runs: the trainer deals a step's
    trained micro-batches round-robin over `processes`, and the gradient all-reduce before
    the optimizer step waits for the last (where the round starts does not change the
    busiest load). With one process that is all rows computed, and 12 + 1 wins; with two,
    13 + 2 would leave one process 13 rows while the other has 2, so 8 + 8 wins. Among
    equals: the fewest micro-batches, the fewest rows, the largest first micro-batch.

    The full micro-batches are usually `max_rows` (the shape `Trainer.precompile` compiles).
    Per packed position a gradient step costs the same from 1 row to 10 (BENCHMARKS.md, "The
    update against one core's matmul rate"), so a small last micro-batch is no slower per row.
    """
    if num_rows == 0:
        return ()
    if max_rows % multiple:
        raise ValueError(f"max_rows={max_rows} is not a multiple of the data degree {multiple}")
    if processes < 1:
        raise ValueError(f"processes={processes}: expected at least 1")
    sizes = sorted({b for b in ROW_BUCKETS if b < max_rows and b % multiple == 0} | {max_rows})
    splits = []
    for size in sizes:
        full, rest = divmod(num_rows, size)
        last = (next(s for s in sizes if s >= rest),) if rest else ()
        splits += [(size,) * full + last, (size,) * -(-num_rows // size)]

    def cost(split):
        loads = [0.0] * processes
        for i, rows in enumerate(split):
            loads[i % processes] += rows + MICRO_BATCH_COST_ROWS
        return max(loads), len(split), sum(split), -split[0]

    return min(splits, key=cost)


def build_packed_batch(rows: list[list[tuple[int, list[int]]]], num_rows: int, row_len: int,
                       prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
                       ) -> tuple[step_lib.PackedBatch, np.ndarray, np.ndarray]:  # fmt: skip
    """The `PackedBatch` of `rows` (padded to `num_rows`) and its (spans, prompt spans)."""
    shape = (num_rows, row_len)
    tokens = np.zeros(shape, np.int32)
    positions = np.zeros(shape, np.int32)
    piece_ids = np.full(shape, -1, np.int32)
    segments = np.zeros(shape, np.int32)
    predictor = np.broadcast_to(np.arange(row_len, dtype=np.int32), shape).copy()
    mask = np.zeros(shape, bool)
    spans, prompt_spans = [], []
    for r, row in enumerate(rows):
        col = 0
        for p, (q, members) in enumerate(row):
            s = len(prompts[q])
            tokens[r, col : col + s] = prompts[q]
            positions[r, col : col + s] = np.arange(s)
            piece_ids[r, col : col + s] = p
            prompt_col, last_prompt = col, col + s - 1
            col += s
            for k, b in enumerate(members, start=1):
                n = len(responses[b])
                sl = slice(col, col + n)
                tokens[r, sl] = responses[b]
                positions[r, sl] = s + np.arange(n)
                piece_ids[r, sl] = p
                segments[r, sl] = k
                predictor[r, col] = last_prompt
                predictor[r, col + 1 : col + n] = np.arange(col, col + n - 1)
                mask[r, sl] = True
                spans.append((b, r, col, n))
                prompt_spans.append((r, prompt_col, s))
                col += n
    batch = step_lib.PackedBatch(tokens, positions, piece_ids, segments, predictor, mask)
    return (batch, np.asarray(spans, np.int64).reshape(-1, 4),
            np.asarray(prompt_spans, np.int64).reshape(-1, 3))  # fmt: skip


def packed_micro_batches(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                         minibatches: list[list[int]], group_size: int, has_signal: np.ndarray,
                         *, row_len: int, max_rows: int, include_silent: bool,
                         row_multiple: int = 1, processes: int = 1, deal_silent: bool = False
                         ) -> list[list[MicroBatch]]:  # fmt: skip
    """Packed micro-batches per mini-batch (`minibatches`: group indices of each).

    Groups with advantage signal pack first and apart from the silent ones (all-equal
    rewards), which get micro-batches of their own only with `include_silent` (a KL term or a
    feature sink needs them); those are marked untrained. Rows per micro-batch are multiples
    of `row_multiple`. The trained micro-batches are split for the trainer's round-robin
    over `processes` (`split_rows`), and so are the silent ones with `deal_silent` (a KL term
    trains them); otherwise every process runs the silent ones (a forward for their
    features), so they split as for one process.
    """
    prompt_lens = [len(p) for p in prompts]
    response_lens = [len(r) for r in responses]
    out = []
    for groups in minibatches:
        micros = []
        classes = [([q for q in groups if has_signal[q]], True)]
        if include_silent:
            classes.append(([q for q in groups if not has_signal[q]], False))
        for members, trained in classes:
            rows = pack_rows(prompt_lens, response_lens, members, group_size, row_len)
            start, counted = 0, set()
            dealt_over = processes if trained or deal_silent else 1
            for per in split_rows(len(rows), max_rows, row_multiple, dealt_over):
                chunk = rows[start : start + per]
                start += per
                batch, spans, prompt_spans = build_packed_batch(chunk, per, row_len, prompts,
                                                                responses)  # fmt: skip
                # A prompt is real once per step: in the first micro-batch that holds it.
                first = {q for row in chunk for q, _ in row} - counted
                counted |= first
                needed = sum(prompt_lens[q] for q in first) + int(sum(spans[:, 3]))
                micros.append(MicroBatch(batch, spans, prompt_spans, trained,
                                         per * row_len, needed))  # fmt: skip
        out.append(micros)
    return out


# ----------------------------------------------------------------------------- a run's


def run_geometry(rl, rollout, data: int = 1) -> tuple[int, int]:
    """`packed_geometry` of a run's `rl` and `rollout` config groups, rows rounded down to a
    multiple of the mesh's `data` degree (at least `data`): rows that the data axis does not
    divide would be computed whole on every data shard."""
    row_len, rows = packed_geometry(rollout.max_prompt_len, rollout.max_new_tokens,
                                    rl.micro_batch_size, rl.group_size,
                                    rl.min_length_bucket)  # fmt: skip
    return row_len, max(data, rows // data * data)


def micro_batches(rl, rollout, prompts, responses, has_signal: np.ndarray, *,
                  include_silent: bool, data: int = 1, processes: int = 1,
                  deal_silent: bool = False
                  ) -> tuple[list[list[int]], list[list[MicroBatch]]]:  # fmt: skip
    """(group indices per mini-batch, `MicroBatch`es per mini-batch) in `rl.update_layout`.

    Padded: `step.plan_micro_batches` (groups of similar length share micro-batches, silent
    ones last). Packed: mini-batches take the groups in order, then `packed_micro_batches`
    (`processes`: over how many the trainer deals the trained micro-batches, and the silent
    ones with `deal_silent`).
    """
    g = rl.group_size
    if rl.update_layout == "padded":
        lengths = np.asarray([len(r) for r in responses]).reshape(-1, g).max(1)
        plan = step_lib.plan_micro_batches(has_signal, g, rl.micro_batch_size,
                                           rl.num_minibatches, lengths)  # fmt: skip
        minibatches = [sorted(q for groups in mini for q in groups) for mini in plan]
        return minibatches, padded_micro_batches(
            prompts, responses, plan, g, has_signal, min_bucket=rl.min_length_bucket,
            max_prompt=rollout.max_prompt_len, max_response=rollout.max_new_tokens,
        )  # fmt: skip
    per_mini = len(prompts) // rl.num_minibatches
    minibatches = [list(range(s, s + per_mini)) for s in range(0, len(prompts), per_mini)]
    row_len, max_rows = run_geometry(rl, rollout, data)
    return minibatches, packed_micro_batches(
        prompts, responses, minibatches, g, has_signal, row_len=row_len, max_rows=max_rows,
        include_silent=include_silent, row_multiple=data, processes=processes,
        deal_silent=deal_silent,
    )  # fmt: skip


def minibatch_weights(
    aggregation: str, groups: Sequence[int], group_size: int, responses: Sequence[Sequence[int]]
) -> tuple[np.ndarray, np.ndarray]:
    """(loss weight, metric weight) per response of the step, non-zero on `groups`' only.

    Loss weights are `algorithms.token_weights` over every response of the mini-batch (silent
    groups count in the denominators even when their micro-batches are skipped); the metric
    weight is 1 / the mini-batch's real tokens (token means).
    """
    ids = [q * group_size + j for q in groups for j in range(group_size)]
    lengths = np.asarray([len(responses[b]) for b in ids])
    loss_w = np.zeros(len(responses))
    loss_w[ids] = algorithms.token_weights(aggregation, lengths)
    metric_w = np.zeros(len(responses))
    metric_w[ids] = 1.0 / max(int(lengths.sum()), 1)
    return loss_w, metric_w
