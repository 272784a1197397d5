"""Full TLT vs plain RL, as whole runs: adaptive SD plus the drafter spot-trained on the idle
slice, against plain decoding with the idle slice left idle (`scripts/bench_full_tlt.py`).

`bench_tlt.py` runs both sides in one process; spot training cannot be measured that way on a
CPU (the slices share the process's thread pool, so the idle slice's drafter steps take compute
from the straggler by construction) and two trainers per process do not fit twice in 24 GB.
Here each side is a `scripts/train.py` run of the same config and seed, started as N processes
(`scripts/launch_local.py`, one rollout slice per process, `--pin_cores`: one core each, so
the idle core is physically idle), run in ABBA order (`pairs` pairs, the first side of each
pair alternating) so that a drifting machine speed cancels in the pairs' mean:

- `plain`: `spec.mode=off`, spot training off (the idle slice waits for the straggler);
- `tlt`: `spec.mode=adaptive` (BEG-MAB over the config's strategies), spot training on, the
  drafter warm-started from `warm` (an HF-EAGLE export) or, without one, from a random init.

The first `warmup` steps of every run (the programs compile there) are not measured. Ratios are
plain / TLT per (pair, step), their mean, median and range (`timing.spread`). The two plain
runs of a benchmark decode the same tokens (same seeds, plain decoding:
`plain_tokens_identical` checks the counts), so their step-time ratio (`plain_run_to_run`) is
the machine's own noise, reported beside the speedups.
SD draws other samples than plain decoding from the same distribution, so response lengths
differ between the sides; `rollout_per_token_speedup` does not depend on them.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tlt_jax.metrics import timing
from tlt_jax.metrics.writer import read_metrics

SIDES = {
    "plain": ("--config.spec.mode=off", "--config.spot.enabled=False"),
    "tlt": ("--config.spec.mode=adaptive", "--config.spot.enabled=True",
            "--config.spec.drafter={warm}"),
}  # fmt: skip
PER_STEP = ("step_time", "compile_s", "time_rollout", "time_update", "time_logprob",
            "time_reward", "time_sync", "long_tail_s", "long_tail_share", "generated_tokens",
            "response_len_mean", "response_len_max", "reward_mean", "sd_step_share",
            "accept_len_eagle", "accept_len_ngram", "accept_len_hybrid", "drafter_version",
            "drafter_steps", "spot_reclaimed_share", "spot_idle_slice_s", "sd_threshold",
            "long_tail_threshold", "sd_steps", "decode_steps", "sd_rows_eagle", "sd_rows_ngram",
            "sd_rows_hybrid")  # fmt: skip


def run_order(pairs: int) -> list[tuple[int, str]]:
    """ABBA...: (pair, side) in the order they run."""
    if pairs < 1:
        raise ValueError(f"pairs={pairs!r} must be >= 1")
    return [(k, side) for k in range(pairs) for side in timing.side_order(("plain", "tlt"), k)]


def run_argv(config: str, workdir: Path, side: str, steps: int, warm: str | None,
             processes: int, pin_cores: bool, extra: Sequence[str] = ()) -> list[str]:  # fmt: skip
    """The command of one run: `train.py` with the side's flags, under `launch_local.py` for
    several processes (one rollout slice each); one process gets two slices (two CPU devices,
    which the caller's `XLA_FLAGS` must provide)."""
    if side not in SIDES:
        raise ValueError(f"side={side!r} is not one of {list(SIDES)}")
    if processes < 1:
        raise ValueError(f"processes={processes!r} must be >= 1")
    slices = max(processes, 2)
    train = [sys.executable, "scripts/train.py", f"--config={config}", f"--workdir={workdir}",
             f"--config.total_steps={steps}", "--config.eval.num_problems=0",
             f"--config.spot.slices={slices}", *(f.format(warm=warm or "") for f in SIDES[side]),
             *extra]  # fmt: skip
    if processes == 1:
        return train
    launch = [sys.executable, "scripts/launch_local.py", f"--num_processes={processes}"]
    return [*launch, *(["--pin_cores"] if pin_cores else []), "--", *train]


def read_steps(workdir: Path) -> list[dict]:
    """Per RL step, the `PER_STEP` metrics of a run's `metrics.jsonl` (missing ones None)."""
    records = read_metrics(workdir)  # a torn last record (a killed run) is skipped
    by_step = {int(r["step"]): r for r in records if "step_time" in r}
    return [{"step": s, **{k: by_step[s].get(k) for k in PER_STEP}} for s in sorted(by_step)]


def _ratio(a: float, b: float) -> float | None:
    return a / b if a > 0 and b > 0 else None


def _mean(values) -> float | None:
    seen = [float(v) for v in values if v is not None and np.isfinite(v)]
    return float(np.mean(seen)) if seen else None


def summarize(runs: dict[str, dict[int, list[dict]]], warmup: int) -> dict:
    """Speedups over the measured steps of every pair; `runs[side][pair]` are `read_steps` rows.

    A ratio is formed for each step both runs of a pair measured (a run cut short keeps the
    steps it logged). The long tail is counted at each run's tail threshold (its SD threshold,
    or `policy.REPORT_THRESHOLD` where that is 0): a step whose sides
    counted theirs at different thresholds (a plain side without the TLT side's calibration
    file falls back to `policy.REPORT_THRESHOLD`; pass `--override` to both) forms no
    `long_tail` ratio, and `long_tail_thresholds` says which thresholds the sides used."""
    ratios: dict[str, list[float]] = {k: [] for k in (
        "step", "step_excluding_compiles", "rollout", "rollout_per_token", "long_tail",
        "update")}  # fmt: skip
    pairs = sorted(set(runs.get("plain", {})) & set(runs.get("tlt", {})))
    for k in pairs:
        plain = {r["step"]: r for r in runs["plain"][k] if r["step"] > warmup}
        tlt = {r["step"]: r for r in runs["tlt"][k] if r["step"] > warmup}
        for s in sorted(set(plain) & set(tlt)):
            p, t = plain[s], tlt[s]

            def ratio(key, p=p, t=t):
                return p[key] / t[key] if p.get(key) and t.get(key) else None

            values = {
                "step": ratio("step_time"),
                "step_excluding_compiles": _ratio(p["step_time"] - (p["compile_s"] or 0.0),
                                                  t["step_time"] - (t["compile_s"] or 0.0)),
                "rollout": ratio("time_rollout"),
                "rollout_per_token": (p["time_rollout"] / p["generated_tokens"])
                / (t["time_rollout"] / t["generated_tokens"])
                if p.get("generated_tokens") and t.get("generated_tokens") else None,
                "long_tail": ratio("long_tail_s")
                if timing.record_tail_threshold(p) == timing.record_tail_threshold(t) else None,
                "update": ratio("time_update"),
            }  # fmt: skip
            for key, value in values.items():
                if value is not None:
                    ratios[key].append(float(value))
    # bench_tlt.py's names: `step_speedup`, `step_speedup_excluding_compiles`, ...; None
    # where no step of any pair was measured by both runs.
    out: dict = {"step_speedup_excluding_compiles" if k == "step_excluding_compiles"
                 else f"{k}_speedup": timing.spread(v) if v else None
                 for k, v in ratios.items()}  # fmt: skip
    measured = {side: [r for rows in by_pair.values() for r in rows if r["step"] > warmup]
                for side, by_pair in runs.items()}  # fmt: skip
    out["phase_s"] = {side: {key: _mean(r[key] for r in rows) for key in (
        "step_time", "time_rollout", "long_tail_s", "time_update", "time_logprob",
        "time_reward", "time_sync", "compile_s")} for side, rows in measured.items()}  # fmt: skip
    out["generated_tokens"] = {side: _mean(r["generated_tokens"] for r in rows)
                               for side, rows in measured.items()}  # fmt: skip
    out["long_tail_share_plain"] = _mean(r["long_tail_share"] for r in measured.get("plain", []))
    thresholds = {side: [timing.record_tail_threshold(r) for r in rows]
                  for side, rows in measured.items()}  # fmt: skip
    out["long_tail_thresholds"] = {side: sorted({int(t) for t in values if t is not None})
                                   for side, values in thresholds.items()}  # fmt: skip
    tlt = measured.get("tlt", [])
    # The run's ratios (SD steps over decode steps, tokens per SD row), as its report pools
    # them: a step of 1 SD row weighs 1 row.
    out["tlt_sd_step_share"] = timing.pooled_sd_step_share(tlt) if tlt else None
    for source in ("eagle", "ngram", "hybrid"):
        out[f"tlt_accept_len_{source}"] = timing.pooled_accept_len(tlt, source)
    for key in ("spot_reclaimed_share", "drafter_steps"):
        out[f"tlt_{key}"] = _mean(r[key] for r in tlt)
    # Two plain runs decode the same tokens: their step-time ratio is the machine's noise.
    plain = runs.get("plain", {})
    if len(plain) >= 2:
        a, b = (plain[k] for k in sorted(plain)[:2])
        both = sorted({r["step"] for r in a} & {r["step"] for r in b})
        by_a, by_b = {r["step"]: r for r in a}, {r["step"]: r for r in b}
        out["plain_tokens_identical"] = all(
            by_a[s]["generated_tokens"] == by_b[s]["generated_tokens"] for s in both
        )
        noise = [by_a[s]["step_time"] / by_b[s]["step_time"] for s in both if s > warmup]
        out["plain_run_to_run"] = timing.spread(noise) if noise else None
    return out


def run(config: str, root: Path, *, pairs: int, steps: int, warmup: int, warm: str | None,
        processes: int, pin_cores: bool, extra: Sequence[str] = (), env: dict | None = None,
        log=print) -> dict:  # fmt: skip
    """Runs the sides in ABBA order (module docstring); a run that fails keeps the steps it
    logged and its error, and the benchmark goes on.

    Raises:
      ValueError: when `steps <= warmup` (nothing would be measured) or a run's workdir already
        holds files (a resumed run would time other work).
    """
    if steps <= warmup:
        raise ValueError(f"steps={steps} must exceed warmup={warmup}: nothing would be measured")
    order = run_order(pairs)
    root = Path(root)
    for k, side in order:
        workdir = root / f"{k}_{side}"
        if workdir.exists() and any(workdir.iterdir()):
            raise ValueError(f"{workdir} is not empty: a timing run must start fresh "
                             "(give another --root or remove it)")  # fmt: skip
    runs: dict[str, dict[int, list[dict]]] = {side: {} for side in SIDES}
    errors = {}
    for k, side in order:
        workdir = root / f"{k}_{side}"
        argv = run_argv(config, workdir, side, steps, warm, processes, pin_cores, extra)
        log(" ".join(argv))
        logfile = root / f"{k}_{side}.log"
        logfile.parent.mkdir(parents=True, exist_ok=True)
        with logfile.open("w") as f:
            rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
        runs[side][k] = read_steps(workdir)
        if rc:
            errors[f"{k}_{side}"] = f"rc {rc}; see {logfile}"
        log(f"{k}_{side}: step_time {[round(r['step_time'], 1) for r in runs[side][k]]}")
    return {"summary": summarize(runs, warmup), "per_step": runs, "errors": errors,
            "order": [f"{k}_{side}" for k, side in order]}  # fmt: skip
