"""Phase timers and rollout-shape statistics of an RL step."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import numpy as np

PHASES = ("rollout", "reward", "logprob", "update", "sync")


class PhaseTimer:
    """Wall time per named phase of one step (callers block on device work inside a phase)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """`time_<phase>` for every phase in `PHASES` (0 when it did not run) and `step_time`."""
        out = {f"time_{name}": self.seconds.get(name, 0.0) for name in PHASES}
        out["step_time"] = sum(self.seconds.values())
        return out


def long_tail_share(start: float, finish_times: Sequence[float], quantile: float = 0.9) -> float:
    """Share of a rollout's wall time spent after `quantile` of its requests had finished.

    With n requests, the moment `ceil(quantile * n)` of them are done splits the rollout;
    the share is (last finish - that moment) / (last finish - start). 0 for an empty rollout.
    """
    if not finish_times:
        return 0.0
    done = np.sort(np.asarray(finish_times, np.float64))
    k = int(np.ceil(quantile * len(done))) - 1
    total = done[-1] - start
    if total <= 0:
        return 0.0
    return float((done[-1] - done[max(k, 0)]) / total)


def length_stats(lengths: Sequence[int], prefix: str = "response_len") -> dict[str, float]:
    """Mean, p50, p90 and max of response lengths (tokens)."""
    values = np.asarray(lengths, np.float64) if len(lengths) else np.zeros(1)
    return {
        f"{prefix}_mean": float(values.mean()),
        f"{prefix}_p50": float(np.percentile(values, 50)),
        f"{prefix}_p90": float(np.percentile(values, 90)),
        f"{prefix}_max": float(values.max()),
    }
