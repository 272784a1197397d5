"""Acceptance length per RL step: a spot-trained drafter vs a frozen one vs a cold start.

Three runs of the same config and seed (`scripts/train.py`, two rollout slices), differing only
in the drafter (`VARIANTS`):

- `spot`: the warm-up drafter (`spec.drafter`), spot-trained on the idle slice every step;
- `frozen`: the same warm-up drafter, never trained (spot training off);
- `cold`: no warm-up, a random drafter spot-trained from the first step.

Each step's `accept_len_eagle` (tokens per EAGLE SD step under the drafter version of that
step) and `accept_len_ngram` (the model-free drafts' in the same rollouts) come from the runs'
`metrics.jsonl`. Once responses shrink those rest on a handful of EAGLE steps per RL step, so
the final policies are also probed (`accept_probe`): each run's last checkpoint samples
held-out prompts with SD on every step, once per drafter, over thousands of verify steps. The
goals: the spot-trained drafter beats the frozen one by >= 0.3 tokens at
the last step (mean of the last three steps: a step's acceptance rests on its SD steps only),
and the cold start passes the n-gram drafts within the run.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tlt_jax.metrics.writer import read_metrics

VARIANTS = {
    "spot": ("--config.spot.enabled=True", "--config.spec.drafter={warm}"),
    "frozen": ("--config.spot.enabled=False", "--config.spec.drafter={warm}"),
    "cold": ("--config.spot.enabled=True", "--config.spec.drafter="),
}
PER_STEP = ("accept_len_eagle", "accept_len_ngram", "sd_steps", "drafter_version",
            "drafter_steps", "drafter_accuracy", "response_len_mean", "response_len_max",
            "long_tail_share", "slice_tail_share", "reward_mean")  # fmt: skip
# The probe's differences (first minus second), on every policy where both were probed.
PROBE_PAIRS = (("spot", "frozen"), ("cold", "frozen"), ("cold", "ngram"), ("spot", "ngram"),
               ("cold", "spot"))  # fmt: skip
LAST_STEPS = 3  # the final acceptance is the mean of the last this many steps that had SD


def train_argv(config: str, workdir: Path, variant: str, steps: int, warm: str | None,
               extra: Sequence[str] = ()) -> list[str]:  # fmt: skip
    """`scripts/train.py` for one variant (no evaluation; two rollout slices)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not one of {list(VARIANTS)}")
    if variant != "cold" and not warm:
        raise ValueError(f"variant {variant!r} needs a warm-up drafter (--warm_drafter)")
    flags = [f.format(warm=warm or "") for f in VARIANTS[variant]]
    return [sys.executable, "scripts/train.py", f"--config={config}", f"--workdir={workdir}",
            f"--config.total_steps={steps}", "--config.eval.num_problems=0",
            "--config.spot.slices=2", *flags, *extra]  # fmt: skip


def read_steps(workdir: Path) -> list[dict]:
    """Per RL step, the `PER_STEP` metrics of a run's `metrics.jsonl` (missing ones None)."""
    records = read_metrics(workdir)  # a torn last record (a killed run) is skipped
    by_step = {int(r["step"]): r for r in records if "time_rollout" in r}
    return [{"step": s, **{k: by_step[s].get(k) for k in PER_STEP}} for s in sorted(by_step)]


def _final(values: list[float | None]) -> float | None:
    seen = [v for v in values if v is not None and math.isfinite(v)]
    return sum(seen[-LAST_STEPS:]) / len(seen[-LAST_STEPS:]) if seen else None


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Acceptance by step per variant, the final values and the issue's goals."""
    by_step = {v: [r["accept_len_eagle"] for r in rows] for v, rows in runs.items()}
    final = {v: _final(values) for v, values in by_step.items()}
    # The n-gram drafts' figure: the mean over every step of every run that had n-gram SD
    # steps, and per run the mean of its last steps, as `final_accept_len` is for EAGLE.
    ngram = [v for rows in runs.values() for r in rows
             if (v := r["accept_len_ngram"]) is not None and math.isfinite(v)]  # fmt: skip
    out: dict = {"accept_len_by_step": by_step, "final_accept_len": final,
                 "ngram_accept_len_mean": sum(ngram) / len(ngram) if ngram else None,
                 "final_ngram_accept_len": {v: _final([r["accept_len_ngram"] for r in rows])
                                            for v, rows in runs.items()}}  # fmt: skip
    if final.get("spot") is not None and final.get("frozen") is not None:
        gain = final["spot"] - final["frozen"]
        out["spot_minus_frozen"] = gain
        out["goal_spot_beats_frozen_by_0.3"] = gain >= 0.3
    if "cold" in runs:
        passed = [r["step"] for r in runs["cold"] if r["accept_len_eagle"] is not None
                  and r["accept_len_ngram"] is not None
                  and r["accept_len_eagle"] > r["accept_len_ngram"]]  # fmt: skip
        out["cold_passes_ngram_at_step"] = passed[0] if passed else None
        out["goal_cold_passes_ngram"] = bool(passed)
    return out


def probe_drafters(root: Path, variants: Sequence[str], warm: str | None
                   ) -> dict[str, dict[str, str]]:  # fmt: skip
    """Per finished run (its final policy), the drafters `accept_probe` compares on it: the
    run's own (the spot-trained or cold-started export, or the frozen warm-up) and the
    other drafters of the benchmark that exist. The frozen drafter is the warm-up export
    itself, so it is compared on every policy whenever `warm` is given, with or without a
    "frozen" run (whose policy is probed only when it ran)."""
    # Every trained drafter under `root`, also those of runs an earlier invocation made, so a
    # run's policy is probed with the other runs' drafters too.
    own = {v: Path(root) / v / "drafter" for v in ("spot", "cold")}
    if warm:
        own["frozen"] = Path(warm)
    ready = {v: str(d) for v, d in own.items() if d.is_dir()}
    return {v: {v: ready[v], **{o: d for o, d in ready.items() if o != v}}
            for v in variants if v in ready}  # fmt: skip


def summarize_probe(probes: dict[str, dict]) -> dict:
    """On each run's final policy: spot-trained minus frozen (warm-up) drafter acceptance, and
    the cold start against the n-gram drafts, over the probe's many verify steps."""
    out = {}
    for policy, p in probes.items():
        figures = {k: v for k, v in p.items() if isinstance(v, dict)}
        for a, b in PROBE_PAIRS:
            if a not in figures or b not in figures:
                continue
            x, y = figures[a], figures[b]
            if x["accept_len"] is None or y["accept_len"] is None:
                continue
            key = f"{policy}_policy_{a}_minus_{b}"
            out[key] = x["accept_len"] - y["accept_len"]
            # The drafters sample their own tokens from the same requests: independent errors.
            errors = [x.get("accept_len_stderr"), y.get("accept_len_stderr")]
            if all(e is not None for e in errors):
                out[f"{key}_stderr"] = math.hypot(*errors)
    return out


def run(config: str, root: Path, variants: Sequence[str], steps: int, warm: str | None,
        extra: Sequence[str] = (), env: dict | None = None, log=print,
        probe_prompts: int = 0) -> dict:  # fmt: skip
    """Runs (or resumes: a workdir with a checkpoint continues to `steps`) each variant and
    summarizes; a variant that fails keeps the steps it logged and its error. With
    `probe_prompts`, each finished run's final policy is then probed with every drafter
    (`accept_probe`: SD on every step over that many held-out prompts x the group size)."""
    runs, errors = {}, {}
    for variant in variants:
        workdir = Path(root) / variant
        argv = train_argv(config, workdir, variant, steps, warm, extra)
        log(" ".join(argv))
        logfile = Path(root) / f"{variant}.log"
        logfile.parent.mkdir(parents=True, exist_ok=True)
        with logfile.open("a") as f:
            rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
        runs[variant] = read_steps(workdir)
        if rc:
            errors[variant] = f"rc {rc}; see {logfile}"
        log(f"{variant}: {len(runs[variant])} steps, accept_len_eagle "
            f"{[r['accept_len_eagle'] for r in runs[variant]]}")  # fmt: skip
    result = {"summary": summarize(runs), "per_step": runs, "errors": errors}
    if probe_prompts:
        from tlt_jax.rl import accept_probe

        probes = {}
        for policy, drafters in probe_drafters(root, variants, warm).items():
            if policy in errors:
                continue
            probes[policy] = accept_probe.probe(Path(root) / policy, drafters,
                                                prompts=probe_prompts)  # fmt: skip
            log(f"probe on the {policy} run's policy: " + ", ".join(
                f"{k} {v['accept_len']} +- {v.get('accept_len_stderr')}"
                for k, v in probes[policy].items()
                if isinstance(v, dict)))  # fmt: skip
        result["probe"] = probes
        result["summary"]["probe"] = summarize_probe(probes)
    return result
