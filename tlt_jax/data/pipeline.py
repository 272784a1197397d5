"""Prompt data: TFDS splits read without TensorFlow, JSONL prompt files, rendering, batches.

Datasets are built by TFDS `GeneratorBasedBuilder`s (`arithmetic`, `gsm8k`) into
`array_record` files and read back through `as_data_source` (what `tfds.data_source` returns):
random access in pure Python, so TensorFlow is never imported. The default `tfrecord` format
would need TensorFlow to write, which is why `file_format="array_record"` is always passed.

`PromptIterator` walks a split in fixed-size batches, reshuffling each epoch with
`numpy.random.default_rng([seed, epoch])`; its position `{"epoch", "index", "shuffle"}` is
JSON-serialisable for checkpoints, and restoring it replays exactly the batches that would
have come next.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import tensorflow_datasets as tfds

from tlt_jax.data import arithmetic, gsm8k

DEFAULT_INSTRUCTION = "Solve the problem step by step and put the final answer in \\boxed{}."
DATASET_NAMES = ("arithmetic", "gsm8k")
SPLITS = ("train", "test")
_BUILDERS: dict[str, type[tfds.core.GeneratorBasedBuilder]] = {
    "arithmetic": arithmetic.Arithmetic,
    "gsm8k": gsm8k.Gsm8k,
}


def _to_python(value: Any) -> Any:
    """Decodes what the data source returns: Text features as bytes, scalars as numpy."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.generic):
        return value.item()
    return value


@contextlib.contextmanager
def _tfds_scratch(data_dir: Path):
    """Temporary folders made meanwhile go under `data_dir` and are removed after.

    A builder whose dataset is not built yet calls `DatasetInfo.initialize_from_bucket`, which
    makes a `tempfile.mkdtemp("tfds")` folder for GCS metadata and, with GCS off (here, always),
    returns without removing it (TFDS 4.9): one empty `/tmp/tmp*tfds` folder per first build,
    200 in a day of test runs. The caller holds the build lock, so one process at a time.
    """
    scratch = data_dir / ".tfds_scratch"
    scratch.mkdir(exist_ok=True)
    before, tempfile.tempdir = tempfile.tempdir, os.fspath(scratch)
    try:
        yield
    finally:
        tempfile.tempdir = before
        shutil.rmtree(scratch, ignore_errors=True)


def load_split(
    name: str,
    split: str,
    *,
    data_dir: str | os.PathLike,
    manual_dir: str | os.PathLike | None = None,
    **builder_kwargs: Any,
) -> list[dict[str, Any]]:
    """Builds a dataset once (as array_record) and reads one split back, without TensorFlow.

    Args:
      name: one of `DATASET_NAMES`.
      split: one of `SPLITS`.
      data_dir: where TFDS writes and caches the built dataset (a run's workdir or a cache).
      manual_dir: for `gsm8k`, the folder with `train.jsonl` / `test.jsonl`; checked before
        anything is built. Unused by `arithmetic`.
      **builder_kwargs: passed to the builder, e.g. `config=arithmetic.make_config("level2")`
        or `config="level2"`.

    Returns:
      The split's examples as dicts of Python values (`str` for text, `int` for `level`), in
      the fixed order TFDS stored them.
    """
    if name not in DATASET_NAMES:
        raise ValueError(f"dataset name={name!r} is not one of {DATASET_NAMES}")
    if split not in SPLITS:
        raise ValueError(f"{split=} is not one of {SPLITS}")
    download_config = tfds.download.DownloadConfig()
    if name == "gsm8k":
        folder = gsm8k.check_manual_dir(manual_dir)
        download_config = tfds.download.DownloadConfig(manual_dir=os.fspath(folder))
        builder_kwargs.setdefault("config", gsm8k.config_for_files(folder))
    data_dir = Path(os.path.expanduser(os.fspath(data_dir)))
    data_dir.mkdir(parents=True, exist_ok=True)
    # Processes sharing data_dir (N JAX processes on one host, `launch_local.py`) build one at a
    # time: TFDS writes to a temporary folder and renames it, so concurrent builds of the same
    # config race, and the loser fails with FileExistsError. The others wait, then find it built.
    # Closing the lock file releases the lock.
    with (data_dir / ".prepare.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with _tfds_scratch(data_dir):
            builder = _BUILDERS[name](data_dir=os.fspath(data_dir), file_format="array_record",
                                      **builder_kwargs)  # fmt: skip
        # A no-op when the build is already in data_dir.
        builder.download_and_prepare(download_config=download_config,
                                     file_format="array_record")  # fmt: skip
    source = builder.as_data_source(split=split)
    records = source.__getitems__(range(len(source)))
    return [{key: _to_python(value) for key, value in record.items()} for record in records]


class ChatTokenizer(Protocol):
    """The part of a Hugging Face tokenizer that prompt rendering uses."""

    chat_template: str | None

    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        *,
        tokenize: bool,
        add_generation_prompt: bool,
    ) -> Any: ...


def render_chat(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, str]]) -> str:
    """A conversation in the tokenizer's chat template, ending in the assistant generation prompt.

    Args:
      tokenizer: a tokenizer with a chat template.
      messages: `{"role", "content"}` turns.

    Returns:
      The prompt text (not yet tokenised); it holds the template's special tokens.
    """
    if not tokenizer.chat_template:
        raise ValueError(
            f"a `messages` prompt needs a tokenizer with a chat template; "
            f"{type(tokenizer).__name__} has none (give a `prompt` instead)"
        )
    rendered = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
    )
    if not isinstance(rendered, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(rendered).__name__}")
    return rendered


def render_prompt(
    tokenizer: ChatTokenizer | None,
    question: str,
    *,
    instruction: str = DEFAULT_INSTRUCTION,
    use_chat_template: bool = True,
    system_prompt: str | None = None,
) -> str:
    """Turns a question into the text a policy model is prompted with.

    Args:
      tokenizer: a tokenizer with an optional chat template; `None` for plain text.
      question: the problem statement.
      instruction: appended after a blank line; `""` leaves the question alone.
      use_chat_template: wrap the text as one user turn with the tokenizer's chat template
        (ending in the assistant generation prompt) when it has one.
      system_prompt: with the chat template, a system turn with this text before the user
        turn (`""` gives an empty one); None leaves the template's default (SmolLM2's adds
        its own system prompt, about 20 tokens).

    Returns:
      The prompt text (not yet tokenised).
    """
    content = f"{question.strip()}\n\n{instruction}" if instruction else question.strip()
    if not uses_chat_template(tokenizer, use_chat_template):
        return content
    messages = [{"role": "user", "content": content}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return render_chat(tokenizer, messages)


def uses_chat_template(tokenizer: ChatTokenizer | None, use_chat_template: bool) -> bool:
    """Whether `render_prompt` wraps a question in the chat template (it needs one to)."""
    return use_chat_template and tokenizer is not None and bool(tokenizer.chat_template)


PROMPT_ROW_EXPECTED = (
    'an object with a non-empty string "prompt" or a non-empty "messages" list of '
    '{"role": str, "content": str} objects (not both)'
)


def _is_prompt_row(row: Any) -> bool:
    if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
        return False
    if "prompt" in row:
        return isinstance(row["prompt"], str) and bool(row["prompt"])
    messages = row["messages"]
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    )


def read_prompt_rows(path: str | os.PathLike, limit: int | None = None, *,
                     flag: str = "--prompts") -> list[dict[str, Any]]:  # fmt: skip
    """Reads a JSONL prompt file: each non-blank line a `prompt` (text) or a `messages` chat.

    What a `prompt` means (a question to render like RL prompts, or raw text) is the
    encoder's choice (`tlt_jax.data.tokenizer.PromptEncoder`); rows may carry other keys.

    Args:
      path: the file.
      limit: stop after this many rows; None reads them all.
      flag: where the path came from, for errors (`scripts/generate.py`'s `--prompts`,
        `train_drafter.py`'s `--config.prompts`).

    Returns:
      The rows, in file order.

    Raises:
      FileNotFoundError: naming the path.
      ValueError: naming the file, the line and what a row must be; or an empty file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{flag} file {path} does not exist")
    rows: list[dict[str, Any]] = []
    with path.open() as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}:{line_number}: not valid JSON ({e}); expected {PROMPT_ROW_EXPECTED}"
                ) from e
            if not _is_prompt_row(row):
                raise ValueError(
                    f"{path}:{line_number}: expected {PROMPT_ROW_EXPECTED}; got {line.strip()[:80]}"
                )
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise ValueError(f"{flag} file {path} has no prompts; expected {PROMPT_ROW_EXPECTED}")
    return rows


# How an epoch's order is drawn: 2, `default_rng([seed, epoch])`; 1 (positions saved before
# 2026-12-08), `default_rng(seed + epoch)`.
SHUFFLE_SCHEME, LEGACY_SHUFFLE_SCHEME = 2, 1


class PromptIterator:
    """Endless, deterministic batches of examples that can resume from a saved position.

    Epoch `e` visits the examples in the order `default_rng([seed, e]).permutation(n)` (or in
    stored order when `shuffle=False`). Batches run across epoch boundaries, so every batch
    has exactly `batch_size` examples.

    A position saved before 2026-12-08 (no "shuffle" key) resumes in the order of then,
    `default_rng(seed + e)`, under which seed s at epoch e + 1 repeated seed s + 1 at epoch
    e: the runs of a seed sweep shared their epochs' orders, one epoch apart.
    """

    def __init__(
        self, examples: Sequence[dict], batch_size: int, *, seed: int = 0, shuffle: bool = True
    ) -> None:
        """Starts at epoch 0, index 0.

        Args:
          examples: the split, with random access (a list or a data source).
          batch_size: examples per batch, at least 1.
          seed: shuffle seed, at least 0; epoch `e` draws from `default_rng([seed, e])`.
          shuffle: whether to permute each epoch.
        """
        if len(examples) == 0:
            raise ValueError("PromptIterator needs at least one example; got an empty split")
        if batch_size < 1:
            raise ValueError(f"{batch_size=} must be >= 1")
        if seed < 0:
            raise ValueError(f"{seed=} must be >= 0 (numpy seeds are non-negative)")
        self._examples = examples
        self._batch_size = batch_size
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0
        self._index = 0
        self._scheme = SHUFFLE_SCHEME
        self._order_epoch = -1
        self._order = np.arange(0)

    def _order_for(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            n = len(self._examples)
            key = [self._seed, epoch] if self._scheme == SHUFFLE_SCHEME else self._seed + epoch
            self._order = (
                np.random.default_rng(key).permutation(n) if self._shuffle else np.arange(n)
            )
            self._order_epoch = epoch
        return self._order

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> list[dict]:
        batch = []
        while len(batch) < self._batch_size:
            if self._index == len(self._examples):
                self._epoch += 1
                self._index = 0
            batch.append(self._examples[int(self._order_for(self._epoch)[self._index])])
            self._index += 1
        return batch

    @property
    def epoch(self) -> int:
        """The epoch the next example comes from (before a boundary is crossed)."""
        return self._epoch

    def state(self) -> dict[str, int]:
        """Returns the position, `{"epoch": int, "index": int, "shuffle": int}` (the order's
        scheme; JSON-serialisable)."""
        return {"epoch": self._epoch, "index": self._index, "shuffle": self._scheme}

    def restore(self, state: Mapping[str, int]) -> None:
        """Moves to a position returned by `state()` (of an iterator over the same split).

        Args:
          state: `{"epoch": int >= 0, "index": int in [0, len(examples)]}` and the order's
            `"shuffle"` scheme (absent: a position saved before it, drawn as then); numpy or
            0-d array integers (as an orbax checkpoint may return) are accepted.
        """
        if set(state) not in ({"epoch", "index"}, {"epoch", "index", "shuffle"}):
            raise ValueError(f"state keys {sorted(state)} must be ['epoch', 'index'] and "
                             "optionally 'shuffle'")  # fmt: skip
        scheme = int(np.asarray(state.get("shuffle", LEGACY_SHUFFLE_SCHEME)).item())
        if scheme not in (LEGACY_SHUFFLE_SCHEME, SHUFFLE_SCHEME):
            raise ValueError(f"state shuffle={scheme} is not one of "
                             f"{[LEGACY_SHUFFLE_SCHEME, SHUFFLE_SCHEME]}")  # fmt: skip
        epoch, index = (int(np.asarray(state[key]).item()) for key in ("epoch", "index"))
        if epoch < 0:
            raise ValueError(f"state epoch={epoch} must be >= 0")
        if not 0 <= index <= len(self._examples):
            raise ValueError(f"state index={index} must be in [0, {len(self._examples)}]")
        self._epoch, self._index = epoch, index
        if scheme != self._scheme:
            self._scheme, self._order_epoch = scheme, -1


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Which prompts to train and evaluate on, and how to render them.

    Attributes:
      name: dataset, one of `DATASET_NAMES`.
      data_dir: `gsm8k` only: the folder with `train.jsonl` / `test.jsonl`
        (flag `--config.data.data_dir`).
      cache_dir: where TFDS writes built datasets.
      level: `arithmetic` only: one of `arithmetic.LEVEL_NAMES`.
      num_train: `arithmetic` only: size of the generated train split.
      num_test: `arithmetic` only: size of the generated test split.
      instruction: appended to every question.
      use_chat_template: render prompts with the tokenizer's chat template when it has one.
      system_prompt: a system turn before the question (chat template only); None keeps the
        template's default.
      seed: shuffle seed of the train iterator.
      train_split: split the policy trains on.
      eval_split: held-out split for evaluation.
    """

    name: str = "arithmetic"
    data_dir: str | None = None
    cache_dir: str = "~/.cache/tlt_jax/tfds"
    level: str = "mixed"
    num_train: int = 20_000
    num_test: int = 500
    instruction: str = DEFAULT_INSTRUCTION
    use_chat_template: bool = True
    system_prompt: str | None = None
    seed: int = 0
    train_split: str = "train"
    eval_split: str = "test"

    def __post_init__(self) -> None:
        if self.name not in DATASET_NAMES:
            raise ValueError(f"data.name={self.name!r} is not one of {DATASET_NAMES}")
        if self.name == "gsm8k" and not self.data_dir:
            raise ValueError(
                f"data.data_dir={self.data_dir!r}: gsm8k needs the folder with "
                f"{' and '.join(gsm8k.SPLIT_FILES.values())}; set {gsm8k.DATA_DIR_FLAG}"
            )
        if self.level not in arithmetic.LEVEL_NAMES:
            raise ValueError(f"data.level={self.level!r} is not one of {arithmetic.LEVEL_NAMES}")
        for field in ("num_train", "num_test"):
            if getattr(self, field) < 1:
                raise ValueError(f"data.{field}={getattr(self, field)} must be >= 1")
        if self.seed < 0:
            raise ValueError(f"data.seed={self.seed} must be >= 0")
        for field in ("train_split", "eval_split"):
            if getattr(self, field) not in SPLITS:
                raise ValueError(f"data.{field}={getattr(self, field)!r} is not one of {SPLITS}")
        if self.eval_split == self.train_split:
            raise ValueError(
                f"data.eval_split={self.eval_split!r} is the train split: evaluation "
                f"reads held-out problems; expected another of {SPLITS}"
            )


def load_data(config: DataConfig, split: str) -> list[dict[str, Any]]:
    """Loads one split of the dataset a `DataConfig` names.

    Args:
      config: the data config.
      split: one of `SPLITS`.

    Returns:
      The examples, as from `load_split`.
    """
    builder_kwargs: dict[str, Any] = {}
    if config.name == "arithmetic":
        builder_kwargs["config"] = arithmetic.make_config(
            config.level, num_train=config.num_train, num_test=config.num_test
        )
    return load_split(
        config.name,
        split,
        data_dir=config.cache_dir,
        manual_dir=config.data_dir,
        **builder_kwargs,
    )


def data_fingerprint(config: DataConfig) -> str | None:
    """What identifies the content of the files a `DataConfig` reads: GSM8K's split files'
    digest (`gsm8k.config_for_files`, e.g. `files_af5af9840296`); None for generated data,
    which its config alone determines.

    Raises:
      FileNotFoundError: when GSM8K's folder or a split file is missing (naming the flag).
    """
    if config.name != "gsm8k":
        return None
    return gsm8k.config_for_files(gsm8k.check_manual_dir(config.data_dir)).name


def make_prompt_iterator(config: DataConfig, batch_size: int) -> PromptIterator:
    """The train-split iterator of a `DataConfig`.

    Args:
      config: the data config (dataset, split and shuffle seed).
      batch_size: prompts per batch.

    Returns:
      A `PromptIterator` at epoch 0, index 0.
    """
    return PromptIterator(load_data(config, config.train_split), batch_size, seed=config.seed)
