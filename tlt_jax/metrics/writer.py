"""Per-step metrics: one JSON object a line in `metrics.jsonl`, and TensorBoard event files.

A record's values may be numbers, lists (e.g. `response_lengths`) or dicts (e.g. `sd_choices`,
'bucket/arm' -> steps). The JSON line keeps every value as it is (numpy scalars and arrays become
Python numbers and lists, non-finite floats the strings "nan" / "inf"). TensorBoard holds numbers
only: numbers are scalars, numeric lists histograms, and dicts are flattened into one scalar per
key under the dict's name (`sd_choices/4/ngram_4_1_5`; characters TensorBoard does not allow in
a tag become `_`). Strings and other values are JSON only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from tlt_jax.files import jsonable, write_text_atomic

METRICS_FILE = "metrics.jsonl"
log = logging.getLogger(__name__)
_TAG_INVALID = re.compile(r"[^-/\w.]")  # what tensorboardX's own tag cleaning replaces


def _tensorboardx():
    """tensorboardX, imported without torch.

    Its writer imports torch whenever torch is installed (to accept torch tensors): 2.5 s of
    every run's start on this CPU, for a writer that is only ever given numpy values. With
    torch not yet imported, the import sees none (its `ImportError` path, which tensorboardX
    supports); torch itself stays importable afterwards.
    """
    if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
        try:
            import tensorboardX
        finally:
            del sys.modules["torch"]
    import tensorboardX

    # A NaN scalar is a value written on purpose (a figure with no data this step, e.g. no
    # EAGLE verify step): tensorboardX warned for each, five lines a step of a TLT run.
    logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
    return tensorboardX


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(
        value, bool | np.bool_
    )


def tensorboard_values(record: dict[str, Any]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """What `MetricsWriter.write` sends to TensorBoard for one record.

    Args:
      record: a step record; `step` is the x axis and not itself a value.

    Returns:
      (scalars, histograms), both keyed by tag: numbers as scalars; numeric lists as histograms
      of their finite values (left out when there are none); nested dicts flattened with '/'
      into the same two kinds; strings, bools and empty lists left out.
    """
    scalars: dict[str, float] = {}
    histograms: dict[str, np.ndarray] = {}

    def visit(tag: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                visit(f"{tag}/{key}", item)
            return
        tag = _TAG_INVALID.sub("_", tag)
        if _is_number(value):
            scalars[tag] = float(value)
        elif isinstance(value, list | tuple | np.ndarray) and len(value):
            array = np.asarray(value)
            if array.dtype.kind in "iuf":
                array = array[np.isfinite(array)]  # a NaN makes tensorboardX's histogram fail
                if array.size:
                    histograms[tag] = array

    for key, value in record.items():
        if key != "step":
            visit(key, value)
    return scalars, histograms


def read_metrics(workdir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of `workdir/metrics.jsonl` in file order ([] when there is none).

    An unterminated last line that is not JSON (a write a crash or a full disk cut short) is
    skipped with a warning; any other malformed line raises `ValueError` naming file and line.
    """
    path = Path(workdir) / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    lines = path.read_text().split("\n")  # the last item is "" when the file ends in a newline
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number == len(lines):
                log.warning("%s:%d: skipping an unfinished last record (%s)", path, number, e)
                continue
            raise ValueError(f"{path}:{number}: not a JSON record ({e})") from e
    return records


class MetricsWriter:
    """Appends step records to `metrics.jsonl` and their numbers to TensorBoard under
    `workdir/tensorboard` (see the module docstring for lists and dicts).

    On resume from checkpoint step k, `truncate_after(k)` drops the records of steps after k,
    which the resumed run recomputes, so the file holds each step once; TensorBoard is told the
    same (a `SessionLog.START` at step k + 1, tensorboardX's `purge_step`), so it hides the
    earlier run's events of those steps instead of showing each step twice.
    """

    def __init__(self, workdir: str | os.PathLike, *, tensorboard: bool = True):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.path = self.workdir / METRICS_FILE
        self._tb = None
        self._tensorboard = tensorboard
        self._purge_step: int | None = None
        if tensorboard:  # the event file is opened on first use (after a resume's truncation)
            _tensorboardx()  # fail here, not at the first step, if it is missing

    def _tensorboard_writer(self):
        if self._tb is None and self._tensorboard:
            logdir = str(self.workdir / "tensorboard")
            purge = {} if self._purge_step is None else {"purge_step": self._purge_step}
            self._tb = _tensorboardx().SummaryWriter(logdir, **purge)
        return self._tb

    def truncate_after(self, step: int) -> None:
        kept = [r for r in read_metrics(self.workdir) if int(r.get("step", 0)) <= step]
        write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._purge_step = step + 1
        if self._tb is not None:  # already writing: the purge marker goes in a new event file
            self._tb.close()
            self._tb = None

    def write(self, record: dict[str, Any]) -> None:
        """Appends one step record (must have `step`): all of it to JSON, its numbers, numeric
        lists and flattened dicts to TensorBoard."""
        step = int(record["step"])
        line = json.dumps(jsonable(record))  # before writing: a bad value leaves no half line
        with self.path.open("a") as f:
            f.write(line + "\n")
        tb = self._tensorboard_writer()
        if tb is None:
            return
        scalars, histograms = tensorboard_values(record)
        for tag, value in scalars.items():
            tb.add_scalar(tag, value, step)
        for tag, values in histograms.items():
            tb.add_histogram(tag, values, step)
        tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
