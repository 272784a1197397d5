"""Phase timers and rollout-shape statistics of an RL step."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

# `host`: the step's wall time outside the timed phases (encoding prompts, the micro-batch
# plan, building the metrics record), so that the phases add up to `step_time`. Writing the
# record, checkpoints and plots come after the step (`Trainer.between_steps_s`).
PHASES = ("rollout", "reward", "logprob", "update", "sync", "host")


class PhaseTimer:
    """Wall time per named phase of one step (callers block on device work inside a phase),
    from the timer's creation (the step's start)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """`time_<phase>` for every phase in `PHASES` (0 when it did not run), `time_host` the
        rest of the wall time so far, and `step_time`, that wall time (the step's, when read
        at its end)."""
        wall = time.perf_counter() - self._start
        timed = sum(self.seconds.values())
        out = {f"time_{name}": self.seconds.get(name, 0.0) for name in PHASES if name != "host"}
        out["time_host"] = max(wall - timed, 0.0)  # the phases ran inside `wall`
        out["step_time"] = wall
        return out


def without_compiles(timeline: Sequence[tuple]) -> list[tuple]:
    """A step timeline on a clock that stops while programs compile: (seconds, running[,
    arm]) rows, each row's seconds less the compile seconds of its step and every step before
    it (`EngineStats.timeline`'s fourth field; rows without one compiled nothing).

    A program compiles once per shape in a run, however long the run: in a short run's
    rollout, mostly where new cache-length buckets come up, in the long tail. Left in, it
    would count as decoding there."""
    out, compiled, last = [], 0.0, 0.0
    for row in timeline:
        compiled += float(row[3]) if len(row) > 3 else 0.0
        last = max(last, float(row[0]) - compiled)  # never before the row above (rounding)
        out.append((last, *row[1:3]))
    return out


def record_tail_threshold(record: dict[str, Any]) -> int | None:
    """Where a step record counted its long tail: `long_tail_threshold`, or in records written
    before that key the SD threshold (which counted there); None with neither."""
    value = record.get("long_tail_threshold")
    return record.get("sd_threshold") if value is None else value


def tail_stats(timeline: Sequence[tuple], threshold: int) -> dict[str, float]:
    """How much of a rollout ran in its long tail, from the engine's step timeline, on a
    clock without the compiles inside its steps (`without_compiles`).

    Args:
      timeline: `EngineStats.timeline`: (seconds since the rollout started, running requests,
        arm, compile seconds) after every decode step (the last two optional); a step's
        duration is the time since the previous one.
      threshold: the tail is every step with at most this many running requests.

    Returns:
      `long_tail_share` (tail seconds / decode seconds), `long_tail_s`, `rollout_decode_s`
      (seconds until the last step), and `sd_tail_s`, the tail seconds that ran SD: all
      without compiles, which `rollout_compile_s` counts.
    """
    if not timeline:
        return {"long_tail_share": 0.0, "long_tail_s": 0.0, "rollout_decode_s": 0.0,
                "sd_tail_s": 0.0, "rollout_compile_s": 0.0}  # fmt: skip
    compile_s = float(sum(float(row[3]) for row in timeline if len(row) > 3))
    timeline = without_compiles(timeline)
    ends = np.asarray([row[0] for row in timeline], np.float64)
    running = np.asarray([row[1] for row in timeline])
    plain = np.asarray([len(row) < 3 or row[2] == "plain" for row in timeline])
    durations = np.diff(np.concatenate([[0.0], ends]))
    tail = running <= threshold
    total = float(ends[-1])
    # Each run of tail steps lasts from the end before its first step to the end of its last:
    # a rollout all in its tail is exactly its total (the float sum of its step durations
    # passed the last end by an ulp: a share of 1.0000000000000002).
    starts = np.concatenate([[0.0], ends[:-1]])
    before, after = np.concatenate([[False], tail[:-1]]), np.concatenate([tail[1:], [False]])
    tail_s = float(np.sum(ends[tail & ~after] - starts[tail & ~before]))
    return {
        "long_tail_share": tail_s / total if total > 0 else 0.0,
        "long_tail_s": tail_s,
        "rollout_decode_s": total,
        "sd_tail_s": float(durations[tail & ~plain].sum()),
        "rollout_compile_s": compile_s,
    }


def pooled_accept_len(records: Sequence[dict], source: str) -> float | None:
    """A run's tokens per SD row of draft `source` over step records: the steps' acceptance
    lengths (`accept_len_<source>`) weighed by their rows (`sd_rows_<source>`), so a step
    of 1 SD row counts as 1 row and a step without SD of the source not at all (None when
    no step has it; the plain mean of the steps for records written before their rows were)."""
    key = f"accept_len_{source}"
    steps = [r for r in records if r.get(key) is not None]
    if not steps:
        return None
    weights = [float(r.get(f"sd_rows_{source}") or 0.0) for r in steps]
    if all(w > 0 for w in weights):
        return float(np.average([float(r[key]) for r in steps], weights=weights))
    return float(np.mean([float(r[key]) for r in steps]))


def pooled_sd_step_share(records: Sequence[dict]) -> float:
    """A run's share of decode steps that ran SD over step records (its SD steps over its
    decode steps, not the mean of the steps' shares; that mean for records written before
    `decode_steps` was)."""
    if records and all(r.get("decode_steps") is not None for r in records):
        decode = sum(int(r["decode_steps"]) for r in records)
        return sum(int(r.get("sd_steps") or 0) for r in records) / decode if decode else 0.0
    return float(np.mean([float(r.get("sd_step_share") or 0.0) for r in records] or [0.0]))


def merge_timelines(timelines: Sequence[Sequence[tuple]]) -> list[tuple[float, int]]:
    """Several engines' step timelines as one: (seconds, requests running over all of them).

    Each timeline is `EngineStats.timeline` of one rollout slice, its clock started when the
    slice's rollout did (the slices start together, after the step's weight sync); a slice
    runs its step's requests up to each step's end and none after its last step. The merged
    timeline has a row at every step end of any slice, with the sum of the slices' running
    requests over the interval that row closes, so `tail_stats(merged, threshold)` is the
    run's long tail in wall time: the seconds in which at most `threshold` requests were
    running anywhere (arms are dropped: a merged row is no one engine's step).
    """
    series = [(np.asarray([row[0] for row in t], np.float64), np.asarray([row[1] for row in t]))
              for t in timelines if t]  # fmt: skip
    if not series:
        return []
    ends = np.unique(np.concatenate([e for e, _ in series]))
    total = np.zeros(len(ends), np.int64)
    for slice_ends, running in series:
        # The step of this slice that covers the interval closing at each merged end.
        index = np.searchsorted(slice_ends, ends, side="left")
        inside = index < len(slice_ends)
        total[inside] += running[index[inside]]
    return [(float(t), int(n)) for t, n in zip(ends, total, strict=True)]


def median_step_ms(timeline: Sequence[tuple], batch: int | None = None) -> float:
    """Median milliseconds of a rollout's decode steps (those with `batch` running requests;
    all for None), from `EngineStats.timeline`; the rollout's first step, which follows
    prefill (its time includes it), counts only when no other step qualifies.

    Raises:
      ValueError: when no step ran `batch` requests (a NaN median used to go on into the
        caller's figures).
    """
    times = np.diff([0.0] + [row[0] for row in timeline])
    ran = [(i, dt) for i, (dt, row) in enumerate(zip(times, timeline, strict=True))
           if batch in (None, row[1])]  # fmt: skip
    if not ran:
        raise ValueError(f"median_step_ms: no decode step with batch={batch} running requests "
                         f"in a timeline of {len(timeline)} steps")  # fmt: skip
    later = [dt for i, dt in ran if i > 0]
    return 1e3 * float(np.median(later or [dt for _, dt in ran]))


def length_stats(lengths: Sequence[int], prefix: str = "response_len") -> dict[str, float]:
    """Mean, p50, p90 and max of response lengths (tokens)."""
    values = np.asarray(lengths, np.float64) if len(lengths) else np.zeros(1)
    return {
        f"{prefix}_mean": float(values.mean()),
        f"{prefix}_p50": float(np.percentile(values, 50)),
        f"{prefix}_p90": float(np.percentile(values, 90)),
        f"{prefix}_max": float(values.max()),
    }


def side_order(sides: Sequence, round_: int) -> list:
    """The order `sides` run in round `round_` of a side-by-side benchmark: as given in even
    rounds, reversed in odd ones. Whatever drifts between two back-to-back runs on a shared
    machine (other jobs, clocks, caches, the allocator) then favours each side in as many
    rounds as the other, and the per-round ratios' spread shows how much it moved them."""
    return list(sides) if round_ % 2 == 0 else list(reversed(sides))


def spread(values: Sequence[float]) -> dict:
    """Median, mean, min, max and every value of a benchmark figure over its rounds: the one
    summary of every benchmark (a throughput's best run is its `max`, a time's its `min`).
    The median resists one disturbed round; the mean is what the RL-step benchmarks
    (`bench_tlt`, `bench_full_tlt`) recorded, so both are kept."""
    if not len(values):
        raise ValueError("spread of no values: expected at least one round")
    return {"median": float(np.median(values)), "mean": float(np.mean(values)),
            "min": float(np.min(values)), "max": float(np.max(values)),
            "runs": [float(v) for v in values]}  # fmt: skip
