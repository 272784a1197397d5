"""The checks a run makes before it resumes (or evaluates) a checkpoint: that it is of the same
data and model as this run's config, and that every process restored the same step.

Each check reads only the checkpoint's config (and the model's weight fingerprint), before
anything loads, so a refused resume costs no model load or compile.
"""

from __future__ import annotations

import logging
from typing import Any

from tlt_jax.checkpointing.manager import RunCheckpointer, tree_paths
from tlt_jax.parallel.distributed import ProcessGroup
from tlt_jax.rl.config import TrainConfig, data_changes, model_changes

log = logging.getLogger(__name__)


def check_same_restore(group: ProcessGroup, step: int | None, directory) -> None:
    """Each process of a run restores its own copy of the checkpoint (`step`, None for none):
    they must agree, or the processes would wait on each other's steps forever.

    Raises:
      RuntimeError: naming every process's step, when they differ.
    """
    if group.count > 1:
        steps = group.allgather("restored_step", step)
        if len(set(steps)) > 1:
            raise RuntimeError(f"the processes restored different checkpoints (steps by "
                               f"process: {steps}; None: none): is {directory} one directory "
                               "that every process reads?")  # fmt: skip


def _listed(changes: dict[str, tuple[Any, Any]]) -> str:
    """`{"group.field": (checkpointed, this run's)}` as the resume checks' errors name them."""
    return ", ".join(f"{name} (checkpoint {old!r}, this run {new!r})"
                     for name, (old, new) in changes.items())  # fmt: skip


def check_resumed_data(checkpointer: RunCheckpointer, config: TrainConfig,
                       data_files: str | None = None) -> bool:  # fmt: skip
    """Whether the run to resume (the latest checkpoint's) had another `data` config than
    `config`, or read files of other content; reads only the checkpoint's config and
    fingerprints.

    Args:
      data_files: this run's `pipeline.data_fingerprint`. Where both runs have one, it
        decides for `data.data_dir`: the same files under another path (a moved folder, a
        relative spelling) resume; files edited in place do not.

    Raises:
      ValueError: naming the checkpoint and each changed field with both values, unless
        `checkpoint.allow_data_change`: its data position (and the accuracy before training)
        belong to the other data, so resuming would silently mix two runs.
    """
    step = checkpointer.latest_step()
    stored = checkpointer.read_config(step) if step is not None else None
    changes = data_changes(stored or {}, config.data)
    stored_files = checkpointer.read_data_files(step) if step is not None else None
    if stored_files is not None and data_files is not None:
        changes.pop("data.data_dir", None)
        if stored_files != data_files:
            changes["data files (content)"] = (stored_files, data_files)
    if not changes:
        return False
    listed = _listed(changes)
    if not config.checkpoint.allow_data_change:
        raise ValueError(
            f"checkpoint {checkpointer.directory}/{step} was written by a run with another data "
            f"config: {listed}. Resume with the checkpoint's data config, use another "
            "--workdir, or set --config.checkpoint.allow_data_change=True to train on the new "
            "data from the checkpoint"
        )
    log.warning("resuming step %d on changed data (checkpoint.allow_data_change): %s", step,
                listed)  # fmt: skip
    return True


def check_resumed_model(checkpointer: RunCheckpointer, config: TrainConfig,
                        weights: str | None, *, tokenizer: str | None = None,
                        evaluating: bool = False) -> None:  # fmt: skip
    """Refuses a checkpoint (the latest) written by a run of another model than `config`'s
    (`model_changes`; `weights`: this run's `policy.weights_fingerprint`, `tokenizer` its
    `policy.tokenizer_fingerprint`); reads only the checkpoint's config and fingerprints.

    Args:
      evaluating: the checkpoint is to be evaluated, not resumed (its weights replace the
        loaded ones, but the prompts are still this config's tokenizer's).

    Raises:
      ValueError: naming the checkpoint and each changed field with both values, unless
        `checkpoint.allow_model_change`: the KL reference (rebuilt from the model this run
        loads, not checkpointed) would be another model than the checkpointed run's.
    """
    step = checkpointer.latest_step()
    if step is None:
        return
    stored = checkpointer.read_config(step) or {}
    changes = model_changes(stored, checkpointer.read_weights(step), config.model, weights,
                            stored_tokenizer=checkpointer.read_tokenizer(step),
                            tokenizer=tokenizer)  # fmt: skip
    if not changes:
        return
    listed = _listed(changes)
    action = "evaluate" if evaluating else "resume"
    if not config.checkpoint.allow_model_change:
        raise ValueError(
            f"checkpoint {checkpointer.directory}/{step} was written by a run of another model: "
            f"{listed}. {action.capitalize()} with the checkpoint's model config, use another "
            f"--workdir, or set --config.checkpoint.allow_model_change=True to {action} the "
            "checkpoint's policy with this model's tokenizer"
            + ("" if evaluating else " and weights as its KL reference")
        )
    log.warning("%s step %d of another model (checkpoint.allow_model_change): %s",
                "evaluating" if evaluating else "resuming", step, listed)  # fmt: skip


def check_resumed_drafter(checkpointer: RunCheckpointer, config: TrainConfig) -> str | None:
    """Warns (and returns the warning) when the run to resume (the latest checkpoint's) named
    another `spec.drafter`; reads only the checkpoint's config.

    Not refused: speculative decoding is lossless, so a drafter changes no sample's
    distribution. When both runs train the drafter online (`spot.enabled`) the checkpoint's
    spot-trained drafter is restored over the one this run names (which only starts a fresh
    run); otherwise the rollouts draft with this run's from the resumed step on.
    """
    step = checkpointer.latest_step()
    stored = checkpointer.read_config(step) if step is not None else None
    if not stored or "spec" not in stored:
        return None
    before, now = stored["spec"].get("drafter", ""), config.spec.drafter
    if before == now:
        return None
    message = (f"spec.drafter changed (checkpoint {checkpointer.directory}/{step}: {before!r}, "
               f"this run: {now!r}): ")  # fmt: skip
    # The checkpoint holds a spot-trained drafter when its run trained one; this run
    # restores it when it trains one too.
    restored = config.spot.enabled and stored.get("spot", {}).get("enabled", False)
    message += ("the checkpoint's spot-trained drafter is restored (if its arrays fit this "
                "run's drafter: `check_resumed_drafter_fits`); this run's only warm-starts a "
                "fresh run" if restored else  # fmt: skip
                "the rollouts draft with this run's from here (lossless: the samples' "
                "distribution does not change)")  # fmt: skip
    log.warning("%s", message)
    return message


def check_resumed_drafter_fits(checkpointer: RunCheckpointer, config: TrainConfig,
                               drafter_like: Any) -> None:  # fmt: skip
    """Refuses a checkpoint (the latest) whose spot-trained drafter state does not fit this
    run's (`drafter_like`: the online drafter's state; None: this run restores none); reads
    only orbax's metadata of the checkpoint's drafter, before any array is read.

    A run that trains the drafter online restores the checkpoint's over the one it names
    (`check_resumed_drafter`), which needs the same architecture: a drafter with an fc bias
    (an EAGLE-1/2 layout) named on resuming a cold start, or the reverse, failed inside
    orbax's restore with a tree-structure error that blamed the model config.

    Raises:
      ValueError: naming the checkpoint, both runs' `spec.drafter`, each differing array
        (path, checkpoint shape, this run's shape) and the ways on.
    """
    if drafter_like is None:
        return
    step = checkpointer.latest_step()
    stored = checkpointer.read_shapes("drafter", step)
    if stored is None:
        return
    mine = tree_paths(drafter_like)
    differ = sorted(
        (p for p in set(stored) | set(mine) if stored.get(p) != mine.get(p)),
        key=lambda p: (not p.startswith("params/"), p),
    )  # the params' first
    if not differ:
        return

    def shape(shapes: dict, path: str) -> str:
        return str(shapes[path]) if path in shapes else "missing"

    shown = ", ".join(f"{p} (checkpoint {shape(stored, p)}, this run {shape(mine, p)})"
                      for p in differ[:6])  # fmt: skip
    if len(differ) > 6:
        shown += f" and {len(differ) - 6} more"
    before = ((checkpointer.read_config(step) or {}).get("spec") or {}).get("drafter", "")
    where = f"checkpoint {checkpointer.directory}/{step}"
    if any(p.startswith("params/") for p in differ):
        raise ValueError(
            f"{where} holds a spot-trained drafter of another architecture than this run's "
            f"(spec.drafter: checkpoint {before!r}, this run {config.spec.drafter!r}): {shown}. "
            f"Resume with --config.spec.drafter={before!r} to go on training the checkpoint's "
            "drafter, with --config.spot.enabled=False to draft with this run's drafter "
            "without restoring the checkpoint's, or use another --workdir"
        )
    raise ValueError(
        f"{where} holds a spot-trained drafter whose optimizer state does not fit this run's "
        f"(another optimizer config for the drafter?): {shown}. Resume with the checkpoint's "
        "optimizer settings or use another --workdir"
    )
