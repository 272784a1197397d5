"""Hot vocabulary for drafting: the policy's most frequent output tokens.

Dimension legend: V vocab, U hot-vocabulary size.

Each draft level multiplies the drafter's features by the LM head ([D, V]; 49,152 x 576 for
SmolLM2, about a fifth of the model). Restricting the draft head to the U most frequent tokens
of the policy's own outputs cuts that read by V / U; verification keeps the full vocabulary, so
speculative decoding stays lossless (a hot vocabulary only changes which tokens are proposed).

`hot_vocab.json` (written next to an exported drafter by the warm-up) holds the counts of every
token seen in the warm-up responses, most frequent first; `load_hot_vocab` turns it (or a
`responses.jsonl` of the warm-up, or any list of token-id sequences via `count_tokens`) into the
U ids the engine takes (`RolloutEngine(..., hot_token_ids=...)`). The warm-up trains the
drafter's cross-entropy over the same U ids (`train_drafter.py --hot_vocab`, same default size
as `generate.py --hot_vocab`), which makes a drafter step several times cheaper.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from tlt_jax.files import write_text_atomic

HOT_VOCAB_FILE = "hot_vocab.json"


def count_tokens(sequences: Iterable[Sequence[int]], vocab_size: int) -> np.ndarray:
    """Occurrences of every token id in `sequences`, as an int64 array [V].

    Raises:
      ValueError: if a token id is outside [0, vocab_size).
    """
    counts = np.zeros((vocab_size,), np.int64)
    for seq in sequences:
        ids = np.asarray(seq, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"token ids outside [0, {vocab_size}) in a sequence: "
                             f"min {ids.min()}, max {ids.max()}")  # fmt: skip
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def hot_token_ids(counts_V: np.ndarray, size: int, prefer: np.ndarray | None = None
                  ) -> np.ndarray:  # fmt: skip
    """The `size` most frequent token ids, int32 [U], most frequent first.

    Ties (unseen tokens among them) go to the ids of `prefer` first, in its order (e.g. the
    hot set in use: a ranking from a few counts keeps it where the counts cannot tell), then
    by ascending id. `size` larger than the vocabulary raises.
    """
    counts_V = np.asarray(counts_V)
    vocab = counts_V.shape[0]
    if not isinstance(size, int | np.integer) or not 1 <= size <= vocab:
        raise ValueError(f"hot vocabulary size={size!r} must be in [1, {vocab}]")
    tiebreak_V = np.arange(vocab, dtype=np.int64) + vocab  # then by id
    if prefer is not None and len(prefer):
        prefer = np.asarray(prefer, np.int64)
        # The first position of each preferred id (a later duplicate must not overwrite it).
        first = np.unique(prefer, return_index=True)
        tiebreak_V[first[0]] = first[1]
    order = np.lexsort((tiebreak_V, -counts_V))  # by count, then the tiebreak
    return order[:size].astype(np.int32)


def save_hot_vocab(out_dir: str | os.PathLike, counts_V: np.ndarray) -> Path:
    """Writes `out_dir/hot_vocab.json`: the seen token ids, most frequent first, and counts."""
    counts_V = np.asarray(counts_V)
    seen = np.flatnonzero(counts_V)
    order = seen[np.argsort(-counts_V[seen], kind="stable")]
    path = Path(out_dir) / HOT_VOCAB_FILE
    write_text_atomic(path, json.dumps({
        "vocab_size": int(counts_V.shape[0]),
        "total_tokens": int(counts_V.sum()),
        "token_ids": order.tolist(),
        "counts": counts_V[order].tolist(),
    }))  # fmt: skip
    return path


def load_token_counts(path: str | os.PathLike, vocab_size: int) -> np.ndarray:
    """Token counts [V] from a `hot_vocab.json` (or a directory holding one) or from a
    warm-up `responses.jsonl` (lines with "response_ids")."""
    path = Path(path)
    if path.is_dir():
        path = path / HOT_VOCAB_FILE
    if path.suffix == ".jsonl":
        with open(path) as f:
            rows = [json.loads(line)["response_ids"] for line in f if line.strip()]
        return count_tokens(rows, vocab_size)
    record = json.loads(path.read_text())
    if record.get("vocab_size", vocab_size) != vocab_size:
        raise ValueError(f"{path} is for vocab_size={record['vocab_size']}; the policy has "
                         f"{vocab_size}")  # fmt: skip
    counts = np.zeros((vocab_size,), np.int64)
    counts[np.asarray(record["token_ids"], np.int64)] = record["counts"]
    return counts


def load_hot_vocab(path: str | os.PathLike, size: int, vocab_size: int) -> np.ndarray | None:
    """The `size` hot token ids (int32 [U]) from a file `load_token_counts` reads; None (the
    whole vocabulary) when `size >= vocab_size`, as the online drafter treats it, so a drafter
    exported from a small-vocabulary run loads with the default `hot_vocab`."""
    counts = load_token_counts(path, vocab_size)
    return None if size >= vocab_size else hot_token_ids(counts, size)


def coverage(counts_V: np.ndarray, ids_U: np.ndarray) -> float:
    """Fraction of the counted tokens that fall in `ids_U` (an upper bound on how often the
    drafter could still propose the policy's token)."""
    counts_V = np.asarray(counts_V)
    total = counts_V.sum()
    return float(counts_V[np.asarray(ids_U)].sum() / total) if total else float("nan")
