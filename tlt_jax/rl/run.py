"""Entry points of the command-line scripts: train-and-evaluate, evaluate a run.

`train_and_evaluate` is what `scripts/train.py` calls: greedy accuracy on the held-out split
before training (skipped on resume; read back from `eval_before.json`), the RL steps, accuracy
after, then a report: both accuracies with their binomial standard errors and the paired
difference, the per-phase time table and where the plots are.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from tlt_jax.checkpointing.manager import RunCheckpointer
from tlt_jax.data.pipeline import load_data
from tlt_jax.data.tokenizer import stop_token_ids
from tlt_jax.files import write_text_atomic
from tlt_jax.metrics import timing
from tlt_jax.metrics.plots import PLOT_FILES
from tlt_jax.metrics.timing import PHASES
from tlt_jax.metrics.writer import read_metrics
from tlt_jax.parallel import distributed
from tlt_jax.rl import evaluation, policy
from tlt_jax.rl import step as step_lib
from tlt_jax.rl.config import TrainConfig, resolve_reward_fn
from tlt_jax.rl.resume import check_resumed_model
from tlt_jax.rl.trainer import Trainer

log = logging.getLogger(__name__)


def _as_train_config(config: Any) -> TrainConfig:
    return config if isinstance(config, TrainConfig) else TrainConfig.from_config_dict(config)


def _eval_file(workdir: Path, tag: str) -> Path:
    return workdir / f"eval_{tag}.json"


def _eval_settings(cfg: TrainConfig, data_files: str | None = None) -> dict[str, Any]:
    """What decides which problems an evaluation scores and how: two results compare (the
    paired difference) only when these are equal. As JSON reads them back."""
    config = cfg.to_dict()
    # The model that scored (a rerun of a run killed before its first checkpoint, with another
    # model, has no checkpoint to refuse it), less the mesh it ran on; the scorer.
    model = {k: v for k, v in config["model"].items() if k != "mesh_shape"}
    data = {k: v for k, v in config["data"].items() if k != "cache_dir"}  # where TFDS caches
    settings = {"data": data, "model": model, "reward_fn": cfg.rl.reward_fn,
                "num_problems": cfg.eval.num_problems, "max_new_tokens": cfg.eval.max_new_tokens,
                "max_prompt_len": cfg.rollout.max_prompt_len}  # fmt: skip
    if data_files is not None:  # the files' content (`pipeline.data_fingerprint`)
        settings["data_files"] = data_files
    return json.loads(json.dumps(settings))


def _save_eval(workdir: Path, tag: str, result: evaluation.EvalResult, step: int,
               settings: dict[str, Any]) -> None:  # fmt: skip
    write_text_atomic(_eval_file(workdir, tag), json.dumps({"step": step, "settings": settings,
                                                            **result.to_dict()}))  # fmt: skip


def _load_eval(workdir: Path, tag: str, settings: dict[str, Any]) -> evaluation.EvalResult | None:
    """The saved result, or None when there is none, it does not parse, or it was evaluated
    under other `settings` (a run resumed with a changed `eval` or `data` group: its problems
    are not this run's, and a paired difference with them would be wrong or fail; another
    model or reward function: it scored something else)."""
    path = _eval_file(workdir, tag)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as error:  # torn or foreign: it cannot be this run's result
        log.warning("%s does not parse (%s); evaluating anew where the run can", path, error)
        return None
    data.pop("step", None)
    saved = data.pop("settings", None)
    result = evaluation.EvalResult.from_dict(data)
    if saved is not None:  # a file from before a setting was recorded is not held to it
        settings = {k: v for k, v in settings.items() if k in saved}
        if isinstance(saved.get("data"), dict):
            saved["data"].pop("cache_dir", None)
    if saved is not None and saved != settings:
        log.warning("%s was evaluated with other eval/data settings than this run's (%s, not "
                    "%s); not reported", path, saved, settings)  # fmt: skip
        return None
    return result


def _compile_summary(workdir: Path, before_step: int | None) -> str:
    """The compile report's line, for the programs this process compiled before its first
    step, `before_step` (1 unless resumed; None: it ran no step, so compiled nothing and the
    file, if any, is an earlier process's): the train step's and the rollout engine's (the
    evaluation's and SD calibration's programs, which share the pool) apart."""
    path = workdir / "compile_report.json"
    if before_step is None or not path.is_file():
        return ""
    rows = json.loads(path.read_text())
    peak = max((r.get("temp", 0) + r.get("argument", 0) + r.get("output", 0)
                - r.get("alias", 0) for r in rows), default=0)  # fmt: skip
    seconds = sum(r["compile_s"] for r in rows)
    train = [r for r in rows if r.get("role", "train") == "train"]
    train_s = sum(r["compile_s"] for r in train)
    return (f"programs compiled before this process's first step (step {before_step}): "
            f"{len(rows)} in {seconds:.1f} s (the train step's {len(train)} in {train_s:.1f} s, "
            f"the rollout engine's {len(rows) - len(train)} in {seconds - train_s:.1f} s); "
            f"largest footprint (arguments + outputs + temporaries) {peak / 2**30:.2f} GiB "
            f"({path.name})")  # fmt: skip


def phase_table(records: list[dict[str, Any]]) -> str:
    """Mean and total seconds per phase over the records (steps), as aligned text."""
    if not records:
        return "(no steps ran)"
    rows = [(phase, [float(r.get(f"time_{phase}", 0.0)) for r in records]) for phase in PHASES]
    rows.append(("step", [float(r.get("step_time", 0.0)) for r in records]))
    step_total = sum(rows[-1][1]) or 1.0
    lines = [f"{'phase':<9}{'mean s/step':>12}{'total s':>10}{'share':>8}"]
    for name, values in rows:
        lines.append(f"{name:<9}{np.mean(values):>12.2f}{sum(values):>10.1f}"
                     f"{sum(values) / step_total:>8.1%}")  # fmt: skip

    # Each step counts its tail at its own threshold (a resumed run may be re-calibrated).
    thresholds = sorted({int(timing.record_tail_threshold(r) or 0) for r in records})
    threshold = (str(thresholds[0]) if len(thresholds) == 1
                 else f"{thresholds[0]}-{thresholds[-1]} (by step)")  # fmt: skip
    tail_share = _pooled(records, "long_tail_s", "rollout_decode_s", "long_tail_share")
    tokens_per_s = _pooled(records, "generated_tokens", "time_rollout", "tokens_per_s")
    tail_s = float(np.mean([float(r.get("long_tail_s", 0.0)) for r in records]))
    compile_s = sum(float(r.get("compile_s", 0.0)) for r in records)
    rollout_compile_s = sum(float(r.get("rollout_compile_s", 0.0)) for r in records)
    lines.append(f"compiling inside the steps: {compile_s:.1f} s ({compile_s / step_total:.1%}"
                 f" of the steps; process 0's); inside rollouts {rollout_compile_s:.1f} "
                 "slice-s over every slice, which the tail and decode figures below leave "
                 "out")  # fmt: skip
    decoding = ""
    if all("decode_tokens_per_s" in r for r in records):
        decode_tps = _pooled(records, "generated_tokens", "rollout_decode_s",
                             "decode_tokens_per_s")  # fmt: skip
        decoding = f" ({decode_tps:.1f} in decode time without compiles)"
    lines.append(f"rollout long tail (decode time with <= {threshold} requests running, over "
                 f"the run): {tail_share:.1%}, {tail_s:.1f} s/step; generated tokens/s in "
                 f"rollout: {tokens_per_s:.1f}{decoding}")  # fmt: skip
    lines.append(tlt_summary(records))
    return "\n".join(lines)


def _pooled(records: list[dict[str, Any]], numerator: str, denominator: str,
            per_step: str) -> float:  # fmt: skip
    """The run's ratio sum(numerator) / sum(denominator) over the records (a step of 1 s
    weighs as its 1 s, not as much as one of 100 s); the mean of the steps' own `per_step`
    ratios where a record lacks either sum's key (written before it was recorded)."""
    if all(numerator in r and denominator in r for r in records):
        total = sum(float(r[denominator]) for r in records)
        return sum(float(r[numerator]) for r in records) / total if total > 0 else 0.0
    return float(np.mean([float(r.get(per_step, 0.0)) for r in records]))


def tlt_summary(records: list[dict[str, Any]]) -> str:
    """What TLT's adaptive rollout did over the records (the run's ratios, not means of the
    steps'): SD share of decode steps, acceptance length per draft source, tail seconds that
    ran SD, and the most chosen arms."""
    sd = sum(int(r.get("sd_steps", 0)) for r in records)
    share = timing.pooled_sd_step_share(records)
    if not sd:
        return ("TLT: no speculative steps (spec.mode=off; or the running requests never "
                "stayed at or under the SD threshold for spec.warmup_steps decode steps; or "
                "the bandit rated plain decoding faster there)")  # fmt: skip
    sources = sorted({k.removeprefix("accept_len_") for r in records for k in r
                      if k.startswith("accept_len_")})  # fmt: skip
    accept = ", ".join(f"{s} {timing.pooled_accept_len(records, s):.2f}" for s in sources)
    choices: dict[str, int] = {}
    for r in records:
        for arm, n in (r.get("sd_choices") or {}).items():
            choices[arm] = choices.get(arm, 0) + int(n)
    top = ", ".join(f"{a} x{n}" for a, n in sorted(choices.items(), key=lambda kv: -kv[1])[:6])
    # SD runs in each slice's own tail (its running requests at most the threshold), so its
    # seconds compare with the slices' tail seconds; one slice's are the run's.
    sd_tail = sum(float(r.get("sd_tail_s", 0.0)) for r in records)
    tail = sum(float(r.get("slice_tail_s", r.get("long_tail_s", 0.0))) for r in records)
    return (
        f"TLT: SD in {share:.1%} of decode steps ({sd} steps); acceptance length {accept}; "
        f"{sd_tail:.1f} of {tail:.1f} tail slice-seconds ran SD; arms (batch bucket/arm) {top}"
    )


def train_and_evaluate(config: Any, workdir: str | Path, *, progress: bool | None = None
                       ) -> dict[str, Any]:  # fmt: skip
    """Evaluates, trains to `total_steps` (resuming from `workdir`), evaluates, reports.

    Args:
      config: a `TrainConfig` or an ml_collections `ConfigDict` (validated here, before any
        loading or compiling).
      workdir: checkpoints, `metrics.jsonl`, TensorBoard events, plots and eval results.
      progress: progress bars (default: when stderr is a terminal).

    Returns:
      A summary dict: `before` / `after` eval results (dicts), `paired` difference, `steps`,
      `wall_s`, `plots`, `report` (the printed text).
    """
    start = time.perf_counter()
    cfg = _as_train_config(config)
    workdir = Path(workdir)
    distributed.initialize_from_env()  # a no-op unless launched as several processes
    trainer = Trainer(cfg, workdir, progress=progress)
    # Process 0 evaluates and reports (evaluation needs no other process); the others train.
    primary = trainer.group.is_primary
    try:
        settings = _eval_settings(cfg, trainer.data_files)
        before = _load_eval(workdir, "before", settings) if primary else None
        if primary and before is None and cfg.eval.at_start and cfg.eval.num_problems:
            if trainer.step_count == 0:
                before = trainer.evaluate()
                _save_eval(workdir, "before", before, 0, settings)
                log.info("accuracy before training: %s", before.summary())
        # The other processes wait here while process 0 evaluates (in a step's collectives
        # they would give up after `distributed.TIMEOUT_MS`), and at the end until it has
        # evaluated and plotted (exiting first, they would wait in JAX's shutdown barrier,
        # which aborts every process after its timeout).
        trainer.group.barrier("evaluated_before", distributed.EVAL_TIMEOUT_MS)
        trainer.train()
        after = None
        if primary and cfg.eval.at_end and cfg.eval.num_problems:
            after = trainer.evaluate()
            _save_eval(workdir, "after", after, trainer.step_count, settings)
        plots = trainer.plot()
        trainer.group.barrier("run_end", distributed.EVAL_TIMEOUT_MS)
    finally:
        trainer.close()
    if not primary:
        return {"steps": trainer.step_count, "process": trainer.group.index}
    records = read_metrics(workdir)
    resumed = ("not resumed" if trainer.restored_from is None
               else f"resumed from {trainer.restored_from}")  # fmt: skip
    lines = [f"workdir: {workdir}", f"steps: {trainer.step_count} (config total_steps "
             f"{cfg.total_steps}; {resumed})"]  # fmt: skip
    paired = None
    split = cfg.data.name + (f"/{cfg.data.level}" if cfg.data.name == "arithmetic" else "")
    if before is not None:
        lines.append(f"accuracy before ({split} {cfg.data.eval_split}, greedy): "
                     f"{before.summary()}")  # fmt: skip
    if after is not None:
        lines.append(f"accuracy after  ({split} {cfg.data.eval_split}, greedy): "
                     f"{after.summary()}")  # fmt: skip
    # (a result saved before its settings were: the same problems only if as many)
    if before is not None and after is not None and before.num_problems == after.num_problems:
        paired = evaluation.paired_difference(before, after)
        lines.append(
            f"difference: {paired['diff']:+.3f} +- {paired['stderr']:.3f} (paired, 1 s.e., same "
            f"{paired['n']} problems: {paired['gained']} gained, {paired['lost']} lost)"
        )
    compiled = _compile_summary(workdir, trainer.compiled_before_step)
    if compiled:
        lines.append(compiled)
    lines.append("time per phase:")
    lines.append(phase_table(records))
    if trainer.between_steps_s > 0:
        lines.append(f"between this process's steps (writing records, checkpoints, plots; "
                     f"outside step_time): {trainer.between_steps_s:.1f} s")  # fmt: skip
    lines.append(f"plots: {', '.join(str(p) for p in plots) or 'none'}")
    lines.append(f"metrics: {workdir / 'metrics.jsonl'}; tensorboard: {workdir / 'tensorboard'}")
    wall = time.perf_counter() - start
    lines.append(f"wall time: {wall:.1f} s")
    report = "\n".join(lines)
    print(report, flush=True)
    return {
        "before": None if before is None else before.to_dict(),
        "after": None if after is None else after.to_dict(),
        "paired": paired,
        "steps": trainer.step_count,
        "wall_s": wall,
        "plots": [str(p) for p in plots],
        "plot_names": list(PLOT_FILES),
        "report": report,
    }


def evaluate_run(config: Any, workdir: str | Path | None, *, num_problems: int | None = None,
                 progress: bool | None = None) -> tuple[int, evaluation.EvalResult]:  # fmt: skip
    """Greedy accuracy of the latest checkpoint in `workdir` (or of the config's model when
    `workdir` is None or holds no checkpoint) on the held-out split. Writes nothing.

    `config.data` may differ from the run's (evaluating on other data is the point); its
    model may not (`resume.check_resumed_model`, checked before any model loads) unless
    `checkpoint.allow_model_change`.

    Returns:
      (the checkpoint's step, 0 for the untrained model; the result).
    """
    cfg = _as_train_config(config)
    if workdir is not None and not Path(workdir).is_dir():  # a typo would score the init
        raise FileNotFoundError(f"workdir={str(workdir)!r} is not a directory; pass a "
                                "training run's workdir, or none to score the config's "
                                "model as loaded")  # fmt: skip
    n = cfg.eval.num_problems if num_problems is None else num_problems
    if n < 1:  # in a training config, 0 means "no evaluation"; here it would score nothing
        raise ValueError(f"num_problems={n} (from "
                         f"{'eval.num_problems' if num_problems is None else '--num_problems'})"
                         ": expected at least 1 problem to score")  # fmt: skip
    directory = None if workdir is None else Path(workdir) / "checkpoints"
    checkpointer = (
        RunCheckpointer(directory, read_only=True)  # the run may still be saving
        if directory is not None and directory.is_dir()
        else None
    )
    try:
        if checkpointer is not None:
            check_resumed_model(checkpointer, cfg, policy.weights_fingerprint(cfg.model),
                                tokenizer=policy.tokenizer_fingerprint(cfg.model),
                                evaluating=True)  # fmt: skip
        examples = load_data(cfg.data, cfg.data.eval_split)
        tokenizer = policy.build_tokenizer(cfg.model)
        encode = policy.build_encoder(cfg, tokenizer)
        # Every scored prompt is checked before the model loads.
        encode.encode_all([ex["question"] for ex in examples[:n]], f"{cfg.data.eval_split} split")
        mesh = policy.build_mesh(cfg.model)
        model = policy.build_policy(cfg.model, mesh)
        engine = policy.build_engine(cfg, model)
        step = 0
        if workdir is not None and (checkpointer is None or checkpointer.latest_step() is None):
            log.warning("%s holds no checkpoint: scoring the config's model as loaded",
                        workdir)  # fmt: skip
        if checkpointer is not None and checkpointer.latest_step() is not None:
            to_train, to_rollout = policy.resharding_copies(engine.params, mesh)
            optimizer = step_lib.make_optimizer(cfg.optim, cfg.total_steps)
            like = jax.eval_shape(
                lambda p: step_lib.init_train_state(to_train(p), optimizer, cfg.seed),
                engine.params,
            )
            restored = checkpointer.restore(like)
            engine.update_params(to_rollout(restored.state.params))
            step = restored.step
    finally:
        if checkpointer is not None:
            checkpointer.close()
    if n > len(examples):
        log.warning("num_problems=%d but the %s split holds %d problems: scoring all %d", n,
                    cfg.data.eval_split, len(examples), len(examples))  # fmt: skip
    result = evaluation.evaluate(
        engine, encode,
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True), examples[:n],
        max_new_tokens=cfg.eval.max_new_tokens, stop_ids=stop_token_ids(tokenizer),
        reward_fn=resolve_reward_fn(cfg.rl.reward_fn), reward_timeout_s=cfg.rl.reward_timeout_s,
        progress=progress,
    )  # fmt: skip
    print(f"{cfg.data.name} {cfg.data.eval_split} at step {step}: accuracy {result.summary()}",
          flush=True)  # fmt: skip
    return step, result
