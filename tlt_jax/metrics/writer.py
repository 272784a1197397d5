"""Per-step metrics: one JSON object a line in `metrics.jsonl`, and TensorBoard event files."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

METRICS_FILE = "metrics.jsonl"


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN / inf; "nan" / "inf" keep the record readable
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def read_metrics(workdir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of `workdir/metrics.jsonl` in file order ([] when there is none)."""
    path = Path(workdir) / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        if line.strip():
            records.append(json.loads(line))
    return records


class MetricsWriter:
    """Appends step records to `metrics.jsonl` and scalars (and a length histogram) to
    TensorBoard under `workdir/tensorboard`.

    On resume from checkpoint step k, `truncate_after(k)` drops the records of steps after k,
    which the resumed run recomputes, so the file holds each step once.
    """

    def __init__(self, workdir: str | os.PathLike, *, tensorboard: bool = True):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.path = self.workdir / METRICS_FILE
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.workdir / "tensorboard"))

    def truncate_after(self, step: int) -> None:
        kept = [r for r in read_metrics(self.workdir) if int(r.get("step", 0)) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
        """Appends one step record (must have `step`); lists go to JSON only (and histograms)."""
        step = int(record["step"])
        clean = {k: _jsonable(v) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
        if self._tb is None:
            return
        for key, value in record.items():
            if key == "step":
                continue
            if isinstance(value, list | tuple):
                if value:
                    self._tb.add_histogram(key, np.asarray(value), step)
            elif isinstance(value, int | float | np.generic) and not isinstance(value, bool):
                self._tb.add_scalar(key, float(value), step)
        self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
