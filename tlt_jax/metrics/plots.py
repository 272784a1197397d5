"""PNG plots of a run from its `metrics.jsonl` records (matplotlib, Agg backend)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tlt_jax.metrics.timing import PHASES

PLOT_FILES = ("reward_accuracy.png", "response_lengths.png", "time_breakdown.png")


def _as_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def write_plots(records: Sequence[dict[str, Any]], out_dir: str | os.PathLike, *,
                histogram_steps: int = 5) -> list[Path]:  # fmt: skip
    """Writes the run's plots; returns their paths ([] when there are no records).

    - `reward_accuracy.png`: rollout reward mean and accuracy over steps.
    - `response_lengths.png`: histogram of response lengths of the latest `histogram_steps`.
    - `time_breakdown.png`: stacked per-phase seconds of every step.
    """
    if not records:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = [int(r["step"]) for r in records]
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("reward_mean", "-o"), ("accuracy", "--s")):
        ax.plot(steps, [_as_float(r.get(key)) for r in records], style, label=key, alpha=0.8)
    ax.set_xlabel("step")
    ax.set_title("rollout reward and accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(out / PLOT_FILES[0])
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)

    latest = records[-histogram_steps:]
    lengths = [n for r in latest for n in r.get("response_lengths", [])]
    fig, ax = plt.subplots(figsize=(7, 4))
    if lengths:
        ax.hist(lengths, bins=min(50, max(5, len(set(lengths)))), color="tab:blue", alpha=0.8)
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("responses")
    ax.set_title(f"response lengths, steps {latest[0]['step']}-{latest[-1]['step']}")
    paths.append(out / PLOT_FILES[1])
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)

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
    paths.append(out / PLOT_FILES[2])
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)
    return paths
