"""PNG plots of a run (matplotlib, Agg backend).

- From `metrics.jsonl` records: `write_plots` (the run's plots, `PLOT_FILES`) and
  `plot_tlt_vs_plain` (a TLT run against a plain run with the same seeds).
- From one rollout's step timeline (`EngineStats.timeline`: (seconds since the rollout started,
  running requests, arm, compile seconds) after every decode step): `plot_rollout_timeline`,
  the long tail as users want to see it; `save_timeline` keeps the timeline as JSON next to
  its plot and `load_timeline` reads it back to plot it again.
- From response lengths: `plot_length_histogram`.

Empty inputs never raise: plots are drawn inside the training loop, where a missing metric must
not end a run. A plot function given no data still writes its PNG, with its axes, title and
"no data" in the middle, so a file a report links to exists; `write_plots` with no records
writes nothing and returns []. Inputs that are wrong rather than empty (a negative threshold, a
timeline row that is not (seconds, running requests[, arm[, compile seconds]])) raise
ValueError.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tlt_jax.files import write_text_atomic
from tlt_jax.metrics import timing
from tlt_jax.metrics.timing import PHASES

# Every file `write_plots` may write, in its order; `tlt_per_step.png` only when the records
# hold TLT fields (the trainer's always do).
PLOT_FILES = (
    "reward_accuracy.png",
    "response_lengths.png",
    "time_breakdown.png",
    "response_lengths_last.png",
    "tlt_per_step.png",
)
TIMELINE_FILE = "rollout_timeline.json"  # `save_timeline`'s usual name; its plot: same stem .png
PLAIN_ARM = "plain"  # == rollout.adaptive.PLAIN; metrics does not import the rollout package
SOURCE_COLORS = {"eagle": "tab:orange", "ngram": "tab:green", "hybrid": "tab:purple"}
_TLT_SHARES = ("sd_step_share", "long_tail_share")
_TLT_SECONDS = ("rollout_decode_s", "long_tail_s")  # wall seconds of the run's rollout
# Summed over rollout slices (SD runs in each slice's own tail): beside each other, not beside
# the wall seconds, which they exceed with several slices.
_TLT_SLICE_SECONDS = ("slice_tail_s", "sd_tail_s")
_ACCEPT_PREFIX = "accept_len_"
_TEXT_BOX = {"facecolor": "white", "alpha": 0.85, "edgecolor": "none", "pad": 2}


def _as_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _integer_ticks():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)  # steps are whole numbers: no 2.5 on the axis


def _save(fig, path: str | os.PathLike) -> Path:
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def _no_data(ax, text: str = "no data", y: float = 0.5) -> None:
    ax.text(0.5, y, text, transform=ax.transAxes, ha="center", va="center", color="gray",
            fontsize=12)  # fmt: skip


def _runs(labels: Sequence[Any]) -> list[tuple[int, int, Any]]:
    """Contiguous runs of equal labels as (start, stop, label), stop exclusive."""
    runs = []
    start = 0
    for i in range(1, len(labels) + 1):
        if i == len(labels) or labels[i] != labels[start]:
            runs.append((start, i, labels[start]))
            start = i
    return runs


def arm_source(arm: str) -> str:
    """The draft source of a timeline arm ("ngram:4,1,5" -> "ngram"; "plain" -> "plain")."""
    return arm.split(":", 1)[0]


def _timeline_arrays(timeline: Sequence[Sequence[Any]]
                     ) -> tuple[np.ndarray, np.ndarray, list[str], np.ndarray]:  # fmt: skip
    """(step end seconds, running requests, arm names, compile seconds) of a timeline; rows
    without an arm are plain steps, as in `timing.tail_stats`, and rows without compile
    seconds compiled nothing."""
    for i, row in enumerate(timeline):
        if len(row) not in (2, 3, 4):
            raise ValueError(f"timeline[{i}]={row!r} is not (seconds, running requests"
                             "[, arm[, compile seconds]])")  # fmt: skip
    ends = np.asarray([row[0] for row in timeline], np.float64)
    running = np.asarray([row[1] for row in timeline], np.int64)
    arms = [str(row[2]) if len(row) > 2 else PLAIN_ARM for row in timeline]
    compiled = np.asarray([row[3] if len(row) > 3 else 0.0 for row in timeline], np.float64)
    return ends, running, arms, compiled


def _check_threshold(threshold: int) -> None:
    if threshold < 0:
        raise ValueError(f"{threshold=} must be >= 0 (running requests)")


def plot_rollout_timeline(timeline: Sequence[Sequence[Any]], threshold: int,
                          path: str | os.PathLike, *, title: str = "rollout") -> Path:  # fmt: skip
    """Running requests over one rollout's decode steps, with its long tail and SD steps.

    A step plot of the running requests (a step lasts from the previous step's end to its
    own), the steps that ran speculative decoding shaded in their draft source's colour, the
    long tail (steps with at most `threshold` running) shaded grey with its share of the decode
    time (`timing.tail_stats`) written over the last tail run, and the threshold as a line.

    Args:
      timeline: `EngineStats.timeline` rows (seconds since the rollout started, running
        requests, arm, compile seconds), arm "plain" or "<source>:<strategy>"; or the rows of
        `load_timeline`. The x axis is wall time (compiles included); the tail share written
        on it leaves the compiles out, as `timing.tail_stats` does.
      threshold: the SD threshold (running requests) the rollout ran with.
      path: the PNG to write.
      title: the plot's title; the step counts and time are appended.

    Returns:
      `path`. An empty timeline writes a plot that says so.
    """
    _check_threshold(threshold)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.set_xlabel("seconds since the rollout started")
    ax.set_ylabel("running requests")
    ax.axhline(threshold, color="tab:red", ls="--", lw=1, zorder=2,
               label=f"SD threshold ({threshold})")  # fmt: skip
    if not timeline:
        _no_data(ax, "no decode steps")
        ax.set_title(title)
        return _save(fig, path)

    ends, running, arms, _ = _timeline_arrays(timeline)
    edges = np.concatenate([[0.0], ends])
    stats = timing.tail_stats(timeline, threshold)
    span = ax.get_xaxis_transform()  # x in seconds, y in axes fractions: full-height bands

    tail_runs = [(a, b) for a, b, is_tail in _runs(list(running <= threshold)) if is_tail]
    if tail_runs:
        ax.broken_barh([(edges[a], edges[b] - edges[a]) for a, b in tail_runs], (0, 1),
                       transform=span, color="0.88", zorder=0,
                       label=f"long tail (<= {threshold} running)")  # fmt: skip
    sources = [arm_source(a) for a in arms]
    sd_runs: dict[str, list[tuple[float, float]]] = {}
    for a, b, source in _runs(sources):
        if source != PLAIN_ARM:
            sd_runs.setdefault(source, []).append((edges[a], edges[b] - edges[a]))
    for source, ranges in sorted(sd_runs.items()):
        steps = sum(s == source for s in sources)
        color = SOURCE_COLORS.get(source, "tab:gray")
        ax.broken_barh(ranges, (0, 1), transform=span, color=color, alpha=0.45, lw=0, zorder=1,
                       label=f"SD steps: {source} ({steps})")  # fmt: skip
    ax.stairs(running, edges, color="black", lw=1.5, zorder=3, label="running requests")

    top = max(int(running.max()), threshold)
    ax.set_ylim(0, top * 1.3 + 1)
    ax.set_xlim(0, edges[-1] if edges[-1] > 0 else 1.0)
    if tail_runs:
        x0, x1 = edges[tail_runs[-1][0]], edges[tail_runs[-1][1]]
        y = top * 1.12 + 0.5
        ax.annotate("", xy=(x0, y), xytext=(x1, y), zorder=4,
                    arrowprops={"arrowstyle": "<->", "color": "0.25"})  # fmt: skip
        text = (f"long tail: {stats['long_tail_share']:.0%} of the decode time\n"
                f"{stats['long_tail_s']:.2f} s of {stats['rollout_decode_s']:.2f} s, "
                f"SD in {stats['sd_tail_s']:.2f} s")  # fmt: skip
        if stats["rollout_compile_s"] > 0:  # the x axis is wall time, compiles included
            text += f"\n(without {stats['rollout_compile_s']:.2f} s of compiling)"
        # Keep the text inside the axes when the tail hugs one side.
        middle = (x0 + x1) / 2 / edges[-1] if edges[-1] > 0 else 0.5
        x, ha = (x1, "right") if middle > 0.7 else (x0, "left") if middle < 0.3 else (
            (x0 + x1) / 2, "center")  # fmt: skip
        ax.text(x, y, text, ha=ha, va="bottom", fontsize=9, zorder=4, bbox=_TEXT_BOX)
    else:
        _no_data(ax, f"no long tail: never <= {threshold} running", y=0.92)  # above the steps
    sd_steps = sum(s != PLAIN_ARM for s in sources)
    ax.set_title(f"{title}: {len(ends)} decode steps, {sd_steps} SD, {edges[-1]:.2f} s")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=8, frameon=False)
    return _save(fig, path)


def save_timeline(timeline: Sequence[Sequence[Any]], threshold: int,
                  path_json: str | os.PathLike, *, title: str = "rollout",
                  plot: bool = True) -> list[Path]:  # fmt: skip
    """Keeps one rollout's timeline: JSON at `path_json` and its plot next to it (.png).

    Args:
      timeline: `EngineStats.timeline` (copy it before the engine's next `generate`, which
        clears it).
      threshold: the SD threshold the rollout ran with.
      path_json: where the JSON goes: {"threshold", "columns", "rows", and the
        `timing.tail_stats` of the rollout}.
      title: the plot's title.
      plot: also write `plot_rollout_timeline` to `path_json` with suffix .png.

    Returns:
      The paths written: [json] or [json, png].
    """
    _check_threshold(threshold)
    ends, running, arms, compiled = _timeline_arrays(timeline)
    rows = [[float(t), int(n), a, float(c)]
            for t, n, a, c in zip(ends, running, arms, compiled, strict=True)]  # fmt: skip
    doc = {"threshold": int(threshold), "columns": ["seconds", "running", "arm", "compile_s"],
           "rows": rows, **timing.tail_stats(timeline, threshold)}  # fmt: skip
    path_json = Path(path_json)
    path_json.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path_json, json.dumps(doc))  # a reader never sees half a file
    paths = [path_json]
    if plot:
        paths.append(plot_rollout_timeline(rows, threshold, path_json.with_suffix(".png"),
                                           title=title))  # fmt: skip
    return paths


def load_timeline(path_json: str | os.PathLike) -> tuple[list[tuple], int]:
    """(timeline rows, threshold) of a `save_timeline` file, for `plot_rollout_timeline`
    (files written before the compile seconds column have three columns)."""
    doc = json.loads(Path(path_json).read_text())
    rows = [(float(row[0]), int(row[1]), str(row[2]), *map(float, row[3:4]))
            for row in doc["rows"]]  # fmt: skip
    return rows, int(doc["threshold"])


SLICE_TIMELINE_FILE = "slice_timeline.png"
_SLICE_COLOURS = {"busy": "tab:blue", "training": "tab:green", "idle": "lightgray",
                  "update": "tab:orange"}  # fmt: skip


def plot_slice_timeline(events: Sequence[Any], path: str | os.PathLike, *,
                        after_s: float = 0.0, title: str = "step") -> Path:  # fmt: skip
    """One RL step per rollout slice: decoding, idle, drafter training, then the update.

    Args:
      events: `tlt_jax.parallel.scheduler.SliceEvent`s (slice, state, start, end) of one
        rollout, seconds since it started.
      path: the PNG to write.
      after_s: seconds of the step after the rollout (reward, log-probs, update, sync), drawn
        on every slice as "update".
      title: the plot's title.
    """
    plt = _pyplot()
    slices = sorted({e.slice for e in events})
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(slices) + 1.6))
    end = max((e.end for e in events), default=0.0)
    for e in events:
        ax.barh(e.slice, e.end - e.start, left=e.start, color=_SLICE_COLOURS[e.state],
                edgecolor="none", label=e.state)  # fmt: skip
    if after_s > 0:
        for i in slices:
            ax.barh(i, after_s, left=end, color=_SLICE_COLOURS["update"], label="update")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), loc="upper center", ncol=4, frameon=False,
              bbox_to_anchor=(0.5, -0.35 if len(slices) < 3 else -0.15))  # fmt: skip
    ax.set_yticks(slices, [f"slice {i}" for i in slices])
    ax.set_xlabel("seconds since the rollout started")
    ax.set_title(title)
    ax.invert_yaxis()
    return _save(fig, path)


def plot_length_histogram(lengths: Sequence[int], cap: int | None, path: str | os.PathLike, *,
                          title: str = "response lengths") -> Path:  # fmt: skip
    """Histogram of response lengths with p50, p90 and max marked, and the length cap.

    Args:
      lengths: response lengths in tokens.
      cap: the response length limit (`rollout.max_new_tokens`); None draws no cap line.
      path: the PNG to write.
      title: the plot's title; the count (and how many hit the cap) is appended.

    Returns:
      `path`. No lengths write a plot that says so.
    """
    plt = _pyplot()
    values = np.asarray(list(lengths), np.float64)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("responses")
    if cap is not None:
        ax.axvline(cap, color="tab:red", ls="-.", lw=1.5, label=f"cap {cap}")
    if values.size == 0:
        _no_data(ax, "no responses")
        ax.set_title(title)
        if cap is not None:
            ax.legend(fontsize=8)
        return _save(fig, path)
    top = max(float(values.max()), float(cap or 0))
    width = max(1, math.ceil((top + 1) / 50))
    ax.hist(values, bins=np.arange(0, top + width + 1, width), color="tab:blue", alpha=0.7)
    stats = timing.length_stats(values.tolist())
    for key, name, style, color in (("p50", "p50", "--", "tab:green"),
                                    ("p90", "p90", "--", "tab:orange"),
                                    ("max", "max", ":", "black")):  # fmt: skip
        value = stats[f"response_len_{key}"]
        ax.axvline(value, color=color, ls=style, lw=1.5, label=f"{name} {value:.0f}")
    at_cap = f", {int((values >= cap).sum())} at the cap" if cap is not None else ""
    ax.set_title(f"{title} ({values.size} responses{at_cap})")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_tlt_vs_plain(records_tlt: Sequence[dict[str, Any]],
                      records_plain: Sequence[dict[str, Any]], path: str | os.PathLike, *,
                      labels: tuple[str, str] = ("TLT", "plain")) -> Path:  # fmt: skip
    """Reward mean and accuracy per step of a TLT run over a plain run with the same seeds.

    With the same seeds the curves should agree (TLT changes how fast a rollout runs, not what
    it samples, up to float differences between SD and plain steps); the title gives each run's
    mean rollout seconds when the records have `time_rollout`.

    Args:
      records_tlt, records_plain: `metrics.jsonl` records of the two runs.
      path: the PNG to write.
      labels: the two runs' names in the legend.

    Returns:
      `path`. Runs without records are left out; with neither the panels say so.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    runs = ((records_tlt, labels[0], "tab:orange", "-o"),
            (records_plain, labels[1], "tab:blue", "--s"))  # fmt: skip
    for ax, key in zip(axes, ("reward_mean", "accuracy"), strict=True):
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(_integer_ticks())
        ax.grid(alpha=0.3)
        drawn = False
        for records, label, color, style in runs:
            if records:
                ax.plot([int(r["step"]) for r in records], [_as_float(r.get(key)) for r in records],
                        style, color=color, label=label, alpha=0.8, markersize=4)  # fmt: skip
                drawn = True
        if drawn:
            ax.legend(fontsize=8)
        else:
            _no_data(ax, "no records")
    times = [np.nanmean([_as_float(r.get("time_rollout")) for r in records]) if records
             else float("nan") for records, *_ in runs]  # fmt: skip
    heading = f"{labels[0]} vs {labels[1]}"
    if all(math.isfinite(t) and t > 0 for t in times):
        heading += (f": mean rollout {times[0]:.2f} s vs {times[1]:.2f} s "
                    f"({labels[1]} / {labels[0]} = {times[1] / times[0]:.2f}x)")  # fmt: skip
    fig.suptitle(heading)
    return _save(fig, path)


def _has_tlt_fields(records: Sequence[dict[str, Any]]) -> bool:
    keys = set().union(*(r.keys() for r in records))
    return bool(keys & {*_TLT_SHARES, *_TLT_SECONDS, *_TLT_SLICE_SECONDS, "sd_choices"}) or any(
        k.startswith(_ACCEPT_PREFIX) for k in keys
    )


def _plot_tlt_per_step(records: Sequence[dict[str, Any]], path: Path) -> Path:
    """Per step: SD and tail shares, acceptance length per draft source, tail seconds, and the
    arms chosen (summed over batch buckets); a panel per group that the records hold."""
    steps = [int(r["step"]) for r in records]
    keys = set().union(*(r.keys() for r in records))
    accept = sorted(k for k in keys if k.startswith(_ACCEPT_PREFIX))
    choices: dict[str, list[float]] = {}
    for i, r in enumerate(records):
        for name, count in (r.get("sd_choices") or {}).items():
            source = arm_source(name.split("/", 1)[-1])  # 'bucket/arm'
            choices.setdefault(source, [0.0] * len(records))[i] += _as_float(count)
    panels = [
        (title, kind, group)
        for title, kind, group in (
            ("share", "line", [k for k in _TLT_SHARES if k in keys]),
            ("acceptance length (tokens per SD row)", "accept", accept),
            ("seconds (wall)", "line", [k for k in _TLT_SECONDS if k in keys]),
            (
                "tail slice-seconds (over slices)",
                "line",
                [k for k in _TLT_SLICE_SECONDS if k in keys],
            ),
            ("arms chosen (decode steps)", "bars", sorted(choices)),
        )
        if group
    ]
    plt = _pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True,
                             squeeze=False)  # fmt: skip
    for ax, (title, kind, group) in zip(axes[:, 0], panels, strict=True):
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if kind == "bars":
            bottom = np.zeros(len(records))
            for source in group:
                color = SOURCE_COLORS.get(source, "0.6" if source == PLAIN_ARM else "tab:gray")
                ax.bar(steps, choices[source], bottom=bottom, color=color, label=source)
                bottom += np.asarray(choices[source])
        else:
            for key in group:
                label = key.removeprefix(_ACCEPT_PREFIX) if kind == "accept" else key
                ax.plot(steps, [_as_float(r.get(key)) for r in records], "-o", markersize=3,
                        label=label)  # fmt: skip
        if title == "share":
            ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=8, loc="best")
    axes[-1, 0].set_xlabel("step")
    axes[-1, 0].xaxis.set_major_locator(_integer_ticks())
    threshold = records[-1].get("sd_threshold")
    fig.suptitle("TLT per step" + (f" (SD threshold {threshold})" if threshold is not None else ""))
    return _save(fig, path)


def write_plots(records: Sequence[dict[str, Any]], out_dir: str | os.PathLike, *,
                histogram_steps: int = 5, cap: int | None = None) -> list[Path]:  # fmt: skip
    """Writes the run's plots (`PLOT_FILES`); returns their paths ([] when there are no records).

    - `reward_accuracy.png`: rollout reward mean and accuracy over steps.
    - `response_lengths.png`: histogram of response lengths of the latest `histogram_steps`.
    - `time_breakdown.png`: stacked per-phase seconds of every step.
    - `response_lengths_last.png`: the last step's response lengths (`plot_length_histogram`).
    - `tlt_per_step.png`, when the records hold TLT fields: `sd_step_share` and
      `long_tail_share`, `accept_len_<source>`, `rollout_decode_s` / `long_tail_s` /
      `sd_tail_s`, and `sd_choices` summed per draft source, per step.

    Args:
      records: `metrics.jsonl` records in step order.
      out_dir: the folder for the PNGs (created).
      histogram_steps: how many of the latest steps `response_lengths.png` pools.
      cap: the response length limit (`rollout.max_new_tokens`) marked on the histograms.
    """
    if not records:
        return []
    plt = _pyplot()
    out = Path(out_dir)
    steps = [int(r["step"]) for r in records]
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("reward_mean", "-o"), ("accuracy", "--s")):
        ax.plot(steps, [_as_float(r.get(key)) for r in records], style, label=key, alpha=0.8)
    ax.set_xlabel("step")
    ax.set_title("rollout reward and accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out / PLOT_FILES[0]))

    latest = records[-histogram_steps:]
    paths.append(plot_length_histogram(
        [n for r in latest for n in r.get("response_lengths", [])], cap, out / PLOT_FILES[1],
        title=f"response lengths, steps {latest[0]['step']}-{latest[-1]['step']}"))  # fmt: skip

    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(records)
    for phase in PHASES:
        values = [_as_float(r.get(f"time_{phase}", 0.0)) for r in records]
        ax.bar(steps, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("time per step by phase")
    ax.legend()
    paths.append(_save(fig, out / PLOT_FILES[2]))

    paths.append(plot_length_histogram(records[-1].get("response_lengths", []), cap,
                                       out / PLOT_FILES[3],
                                       title=f"response lengths, step {steps[-1]}"))  # fmt: skip
    if _has_tlt_fields(records):
        paths.append(_plot_tlt_per_step(records, out / PLOT_FILES[4]))
    return paths
