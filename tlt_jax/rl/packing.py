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

A group's responses often span two or three rows. With prompt sharing
(`share_prompt_rows`, `rl.share_prompts`), the rows are repacked into the split's
micro-batches in order, and a piece in a row of a micro-batch that already holds its group's
prompt continues that prompt (at most one such piece a row, the row's first) instead of
repeating it: the model reads the prompt's keys and values from the other row
(`transformer.RowPrefix`). On recorded long-tail steps this computes about 10% fewer
positions (`update_padding_share` 0.19 -> 0.10, BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

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


def _check_prompts(prompts: Sequence[Sequence[int]]) -> None:
    """Refuses an empty prompt: a response's first token is predicted from its prompt's last
    (with none, packing took the previous piece's last token, or the token itself)."""
    for q, prompt in enumerate(prompts):
        if not len(prompt):
            raise ValueError(f"prompt {q} is empty; expected at least one token (a response's "
                             "first token is predicted from its prompt's last)")  # fmt: skip


def padded_micro_batches(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                         plan: list[list[list[int]]], group_size: int, has_signal: np.ndarray,
                         *, min_bucket: int, max_prompt: int, max_response: int
                         ) -> list[list[MicroBatch]]:  # fmt: skip
    """Micro-batches of whole groups padded to power-of-two buckets (`plan` from
    `step.plan_micro_batches`: group indices per micro-batch per mini-batch)."""
    _check_prompts(prompts)
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


class Piece(NamedTuple):
    """A packed row's piece: a prompt and some of its group's responses after it, or, when
    `continues`, only responses, reading the prompt's keys and values from another row of
    the micro-batch that holds it (a row's continuing piece is its first)."""

    group: int
    responses: list[int]
    continues: bool = False


def pack_rows(prompt_lens: Sequence[int], response_lens: Sequence[int], groups: Sequence[int],
              group_size: int, row_len: int, bins: Sequence[int] = ()
              ) -> list[list[Piece]]:  # fmt: skip
    """Rows of pieces holding every non-empty response of `groups` (the module docstring has
    the rule).

    With `bins` (rows per micro-batch, in order: the split the rows will run in), a response
    that fits in no open piece of its group first tries a continuing piece: in a row of a
    micro-batch that already holds its group's prompt, at most one a row, without repeating
    the prompt. Rows past the bins continue nothing.
    """
    rows: list[list[Piece]] = []
    free: list[int] = []
    bounds = np.cumsum(bins, dtype=np.int64)
    prompt_bins: dict[int, set[int]] = {}  # micro-batches holding a group's prompt

    def bin_of(r: int) -> int:
        i = int(np.searchsorted(bounds, r, side="right"))
        return i if i < len(bins) else -1 - r  # past the bins: a micro-batch of its own

    def new_row() -> int:
        rows.append([])
        free.append(row_len)
        return len(rows) - 1

    def continuing_row(q: int, n: int) -> int | None:
        wanted = prompt_bins.get(q, ())
        return next((r for r, f in enumerate(free) if f >= n and bin_of(r) in wanted
                     and not (rows[r] and rows[r][0].continues)), None)  # fmt: skip

    def longest(q: int) -> int:
        return max(response_lens[q * group_size : (q + 1) * group_size])

    order = sorted(groups, key=lambda q: -longest(q))
    for q in order:
        members = [b for b in range(q * group_size, (q + 1) * group_size) if response_lens[b]]
        members.sort(key=lambda b: -response_lens[b])
        open_pieces: list[tuple[int, Piece]] = []  # (row, piece)
        for b in members:
            n = response_lens[b]
            for r, piece in open_pieces:
                if free[r] >= n:
                    piece.responses.append(b)
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
                # A continuing piece in a row with room, else a piece with its prompt in a
                # row with room, else a new row (continuing if its micro-batch has the prompt).
                r = continuing_row(q, n)
                continues = r is not None
                if r is None:
                    r = next((i for i, f in enumerate(free) if f >= need), None)
                if r is None:
                    r = new_row()
                    continues = bin_of(r) in prompt_bins.get(q, ())
                piece = Piece(q, [b], continues)
                if continues:
                    rows[r].insert(0, piece)
                    free[r] -= n
                else:
                    rows[r].append(piece)
                    free[r] -= need
                    prompt_bins.setdefault(q, set()).add(bin_of(r))
                open_pieces.append((r, piece))
    return rows


# A split's micro-batches: each one's packed rows (lists of `Piece`s) and the rows it computes.
Plan = list[tuple[list[list[Piece]], int]]

# Repacks tried by `share_prompt_rows`, each into the best split of the previous one's rows.
SHARE_REPACKS = 2


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
    sizes = _row_sizes(max_rows, multiple)
    splits = []
    for size in sizes:
        full, rest = divmod(num_rows, size)
        last = (next(s for s in sizes if s >= rest),) if rest else ()
        splits += [(size,) * full + last, (size,) * -(-num_rows // size)]
    return min(splits, key=lambda split: _split_cost(split, processes))


def _row_sizes(max_rows: int, multiple: int) -> list[int]:
    """The row counts a micro-batch may have (ascending)."""
    return sorted({b for b in ROW_BUCKETS if b < max_rows and b % multiple == 0} | {max_rows})


def _split_cost(split: Sequence[int], processes: int) -> tuple:
    """`split_rows`'s order: the busiest process's rows (+ `MICRO_BATCH_COST_ROWS` per
    micro-batch), then fewer micro-batches, fewer rows, a larger first one."""
    loads = [0.0] * processes
    for i, rows in enumerate(split):
        loads[i % processes] += rows + MICRO_BATCH_COST_ROWS
    return max(loads), len(split), sum(split), -split[0]


def build_packed_batch(rows: list[list[Piece]], num_rows: int, row_len: int,
                       prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                       prefix_width: int = 0, row_shards: int = 1
                       ) -> tuple[step_lib.PackedBatch, np.ndarray, np.ndarray]:  # fmt: skip
    """The `PackedBatch` of `rows` (padded to `num_rows`; `prefix_width` prefix columns) and
    its (spans, prompt spans). A continuing piece reads the prompt of its group's first
    piece with one in its data shard (`num_rows / row_shards` rows a shard)."""
    per_shard = num_rows // row_shards
    shape = (num_rows, row_len)
    tokens = np.zeros(shape, np.int32)
    positions = np.zeros(shape, np.int32)
    piece_ids = np.full(shape, -1, np.int32)
    segments = np.zeros(shape, np.int32)
    predictor = np.broadcast_to(np.arange(row_len, dtype=np.int32), shape).copy()
    mask = np.zeros(shape, bool)
    prefix = np.full((num_rows, prefix_width), -1, np.int32)
    prompt_at: dict[tuple[int, int], tuple[int, int]] = {}  # (group, shard) -> (row, column)
    for r, row in enumerate(rows):
        col = 0
        for q, members, continues in row:
            if not continues:
                prompt_at.setdefault((q, r // per_shard), (r, col))
            col += (0 if continues else len(prompts[q])) + sum(len(responses[b]) for b in members)
    spans, prompt_spans = [], []
    for r, row in enumerate(rows):
        col = 0
        for p, (q, members, continues) in enumerate(row):
            s = len(prompts[q])
            if continues:
                if p or (q, r // per_shard) not in prompt_at:
                    raise ValueError(
                        f"row {r}: a continuing piece of group {q} must be the row's first "
                        "and its prompt in another row of the batch's same data shard"
                    )
                if s > prefix_width:
                    raise ValueError(f"prompt {q} ({s} tokens) continues in row {r}, past the "
                                     f"{prefix_width} prefix columns; expected prompts <= "
                                     "rollout.max_prompt_len")  # fmt: skip
                prompt_row, prompt_col = prompt_at[q, r // per_shard]
                prefix[r, :s] = prompt_row * row_len + prompt_col + np.arange(s)
                last_prompt = -1
            else:
                prompt_row, prompt_col = r, col
                tokens[r, col : col + s] = prompts[q]
                positions[r, col : col + s] = np.arange(s)
                piece_ids[r, col : col + s] = p
                last_prompt = col + s - 1
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
                prompt_spans.append((prompt_row, prompt_col, s))
                col += n
    batch = step_lib.PackedBatch(tokens, positions, piece_ids, segments, predictor, mask, prefix,
                                 row_shards)  # fmt: skip
    return (batch, np.asarray(spans, np.int64).reshape(-1, 4),
            np.asarray(prompt_spans, np.int64).reshape(-1, 3))  # fmt: skip


def packed_micro_batches(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                         minibatches: list[list[int]], group_size: int, has_signal: np.ndarray,
                         *, row_len: int, max_rows: int, include_silent: bool,
                         row_multiple: int = 1, processes: int = 1, deal_silent: bool = False,
                         prefix_width: int = 0) -> list[list[MicroBatch]]:  # fmt: skip
    """Packed micro-batches per mini-batch (`minibatches`: group indices of each).

    Groups with advantage signal pack first and apart from the silent ones (all-equal
    rewards), which get micro-batches of their own only with `include_silent` (a KL term or a
    feature sink needs them); those are marked untrained. Rows per micro-batch are multiples
    of `row_multiple` (the mesh's data degree, whose shards take equal blocks of rows). The
    trained micro-batches are split for the trainer's round-robin over `processes`
    (`split_rows`), and so are the silent ones with `deal_silent` (a KL term trains them);
    otherwise every process runs the silent ones (a forward for their features), so they
    split as for one process. With `prefix_width`, rows may continue a prompt laid out in
    another row of their micro-batch and data shard (`share_prompt_rows`).
    """
    _check_prompts(prompts)
    prompt_lens = [len(p) for p in prompts]
    response_lens = [len(r) for r in responses]
    out = []
    for groups in minibatches:
        micros = []
        classes = [([q for q in groups if has_signal[q]], True)]
        if include_silent:
            classes.append(([q for q in groups if not has_signal[q]], False))
        for members, trained in classes:
            dealt_over = processes if trained or deal_silent else 1
            rows = pack_rows(prompt_lens, response_lens, members, group_size, row_len)
            split = split_rows(len(rows), max_rows, row_multiple, dealt_over)
            ends = np.cumsum(split, dtype=np.int64)
            plan = [(rows[end - per : end], per) for end, per in zip(ends, split, strict=True)]
            if prefix_width:
                plan = share_prompt_rows(prompt_lens, response_lens, members, group_size,
                                         row_len, max_rows, row_multiple, dealt_over,
                                         plan)  # fmt: skip
            counted = set()
            for chunk, per in plan:
                batch, spans, prompt_spans = build_packed_batch(
                    chunk, per, row_len, prompts, responses, prefix_width, row_multiple
                )
                # A prompt is real once per step: in the first micro-batch that holds it.
                first = {q for row in chunk for q, _, _ in row} - counted
                counted |= first
                needed = sum(prompt_lens[q] for q in first) + int(sum(spans[:, 3]))
                micros.append(MicroBatch(batch, spans, prompt_spans, trained,
                                         per * row_len, needed))  # fmt: skip
        out.append(micros)
    return out


def share_prompt_rows(prompt_lens: Sequence[int], response_lens: Sequence[int],
                      groups: Sequence[int], group_size: int, row_len: int, max_rows: int,
                      multiple: int, processes: int, plan: Plan) -> Plan:  # fmt: skip
    """`plan` or a repack that computes less, whose rows continue prompts laid out in other
    rows of their micro-batch and data shard.

    A group's 8 responses of ~60 tokens span two or three 320-token rows, and each extra
    row repeated the group's prompt; a continuing piece reads it from the row that has it.
    The repack fills the shards of each micro-batch of a split in order (`pack_rows` with
    `bins` of rows / `multiple`), then each micro-batch is computed at the smallest row count
    whose shards hold their rows (a shard's unused rows are padding at its end), so no
    prefix crosses a micro-batch or a shard. Kept only if `split_rows`'s cost falls.
    """
    if not plan:
        return plan
    best, cost = plan, _split_cost([per for _, per in plan], processes)
    num_rows = sum(len(rows) for rows, _ in plan)
    sizes = _row_sizes(max_rows, multiple)
    for _ in range(SHARE_REPACKS):
        split = split_rows(num_rows, max_rows, multiple, processes)
        bins = [per // multiple for per in split for _ in range(multiple)]
        rows = pack_rows(prompt_lens, response_lens, groups, group_size, row_len, bins)
        if len(rows) > sum(bins):
            break
        shards = [rows[end - size : end] for end, size in zip(np.cumsum(bins), bins,
                                                                strict=True)]  # fmt: skip
        shared = []
        for i in range(len(split)):
            mine = shards[i * multiple : (i + 1) * multiple]
            longest = max(map(len, mine))
            if not longest:  # rows open in order: only the last micro-batches are empty
                break
            per = next(s for s in sizes if s >= longest * multiple)
            laid_out = []  # each shard's rows, then empty ones up to its share of `per`
            for shard in mine:
                laid_out += shard + [[]] * (per // multiple - len(shard))
            shared.append((laid_out, per))
        shared_cost = _split_cost([per for _, per in shared], processes)
        if shared_cost >= cost:
            break
        best, cost, num_rows = shared, shared_cost, len(rows)
    return best


# ----------------------------------------------------------------------------- a run's


def run_geometry(rl, rollout, data: int = 1) -> tuple[int, int]:
    """`packed_geometry` of a run's `rl` and `rollout` config groups, rows rounded down to a
    multiple of the mesh's `data` degree (at least `data`): rows that the data axis does not
    divide would be computed whole on every data shard."""
    row_len, rows = packed_geometry(rollout.max_prompt_len, rollout.max_new_tokens,
                                    rl.micro_batch_size, rl.group_size,
                                    rl.min_length_bucket)  # fmt: skip
    return row_len, max(data, rows // data * data)


def prefix_width(rl, rollout) -> int:
    """Prefix columns of a run's packed rows: `rollout.max_prompt_len` with
    `rl.share_prompts`, else 0."""
    return rollout.max_prompt_len if rl.share_prompts else 0


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
        deal_silent=deal_silent, prefix_width=prefix_width(rl, rollout),
    )  # fmt: skip


def minibatch_weights(
    aggregation: str,
    groups: Sequence[int],
    group_size: int,
    responses: Sequence[Sequence[int]],
    norm_tokens: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(loss weight, metric weight) per response of the step, non-zero on `groups`' only.

    Loss weights are `algorithms.token_weights` over every response of the mini-batch (silent
    groups count in the denominators even when their micro-batches are skipped); the metric
    weight is 1 / the mini-batch's real tokens (token means). `norm_tokens`: the constant of
    `algorithms.NORMED_AGGREGATIONS`.
    """
    ids = [q * group_size + j for q in groups for j in range(group_size)]
    lengths = np.asarray([len(responses[b]) for b in ids])
    loss_w = np.zeros(len(responses))
    loss_w[ids] = algorithms.token_weights(aggregation, lengths, norm_tokens)
    metric_w = np.zeros(len(responses))
    metric_w[ids] = 1.0 / max(int(lengths.sum()), 1)
    return loss_w, metric_w
