"""Acceptance of drafters on a run's final policy, measured on many SD steps.

In an RL run a drafter's acceptance is seen only in the SD steps of the long tail that the
bandit gave to EAGLE; once responses shrink that is a handful per step (`bench_accept.py` logged
1-7 at steps 18-20), too few to compare drafters. This probe restores a run's latest checkpoint
(its policy), samples the held-out prompts at the run's temperature with speculative decoding
on every step (one fixed strategy, `FixedPolicy`), once per drafter and once with the
model-free n-gram drafts, the same requests and seeds each time, and reports tokens per verify
step over all of them. Each drafter is loaded the way a run loads `spec.drafter` (its HF-EAGLE
directory and hot vocabulary).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tlt_jax.checkpointing.manager import RunCheckpointer
from tlt_jax.data.pipeline import load_data
from tlt_jax.rl.config import TrainConfig
from tlt_jax.rollout.adaptive import FixedPolicy, StepChoice
from tlt_jax.rollout.engine import Request
from tlt_jax.rollout.speculative import SpecStrategy

NGRAM = "ngram"  # the key of the model-free drafts' figure


def run_config(workdir: str | Path) -> TrainConfig:
    """The config stored with a run's latest checkpoint.

    Raises:
      FileNotFoundError: when `workdir/checkpoints` holds no checkpoint.
    """
    checkpointer = RunCheckpointer(Path(workdir) / "checkpoints", read_only=True)
    try:
        raw = checkpointer.read_config()
    finally:
        checkpointer.close()
    if raw is None:
        raise FileNotFoundError(f"{workdir}/checkpoints holds no checkpoint to probe")
    return TrainConfig.from_config_dict(raw)


def accept_stats(per_request: list[list[int]]) -> dict[str, Any]:
    """Tokens per verify step over requests (each a list of its verify steps' accepted
    lengths), with the standard error of that ratio.

    A request's steps are not independent draws (one hard answer rejects many drafts in a
    row), so the error treats requests as the samples: the ratio estimator's delta-method
    standard error, sqrt(n / (n - 1) * sum_i (t_i - r s_i)^2) / sum_i s_i, with t_i the tokens
    and s_i the verify steps of request i and r = sum t / sum s. None with fewer than two
    requests that verified anything.
    """
    steps = [len(a) for a in per_request if a]
    tokens = [sum(a) for a in per_request if a]
    if not steps:
        return {"accept_len": None, "accept_len_stderr": None, "verify_steps": 0}
    ratio = sum(tokens) / sum(steps)
    n = len(steps)
    stderr = None
    if n > 1:
        spread = sum((t - ratio * s) ** 2 for t, s in zip(tokens, steps, strict=True))
        stderr = math.sqrt(n / (n - 1) * spread) / sum(steps)
    return {"accept_len": ratio, "accept_len_stderr": stderr, "verify_steps": sum(steps)}


def _accept(completions) -> dict[str, Any]:
    return {**accept_stats([list(c.accepted_lengths) for c in completions]),
            "tokens": sum(len(c.token_ids) for c in completions)}  # fmt: skip


def probe(workdir: str | Path, drafters: Mapping[str, str], *, prompts: int = 16,
          strategy: str = "4,1,5", seed: int = 10_000) -> dict[str, Any]:  # fmt: skip
    """Tokens per verify step of each drafter (name -> HF-EAGLE dir) and of n-gram drafts on
    the policy of `workdir`'s latest checkpoint.

    Args:
      workdir: a `scripts/train.py` run directory.
      drafters: the drafters to measure, by name.
      prompts: held-out problems (`data.eval_split`), each sampled `rl.group_size` times.
      strategy: the SD strategy of every step (`depth,topk,verify_tokens`).
      seed: request i samples with `seed + i` (the same on every drafter).

    Returns:
      `{"step": checkpoint step, "requests": n, "strategy": ..., name: {"accept_len",
      "accept_len_stderr", "verify_steps", "tokens"}, ..., "ngram": {...}}`
      (`accept_stats`).

    Raises:
      ValueError: for an empty `drafters`, a missing drafter directory or `prompts < 1`.
    """
    from tlt_jax.rl.trainer import Trainer

    if not drafters:
        raise ValueError("drafters is empty: name at least one HF-EAGLE directory to probe")
    missing = {name: d for name, d in drafters.items() if not Path(d).is_dir()}
    if missing:
        raise ValueError(f"drafter directories {missing} do not exist")
    if prompts < 1:
        raise ValueError(f"prompts={prompts!r} must be >= 1")
    spec_strategy = SpecStrategy.parse(strategy)
    base = run_config(workdir)
    examples = load_data(base.data, base.data.eval_split)[:prompts]
    out: dict[str, Any] = {"strategy": strategy}
    for i, (name, directory) in enumerate(drafters.items()):
        # One rollout slice, no spot training: the checkpoint's policy with this drafter.
        cfg = dataclasses.replace(
            base, spot=dataclasses.replace(base.spot, enabled=False, slices=1),
            spec=dataclasses.replace(base.spec, mode="adaptive", drafter=str(directory)),
        )  # fmt: skip
        trainer = Trainer(cfg, workdir, progress=False)
        try:
            if trainer.restored_from is None:
                raise FileNotFoundError(f"{workdir} has no checkpoint to probe")
            out["step"] = trainer.restored_from
            g = cfg.rl.group_size
            requests = [Request(trainer.encode(ex["question"]), cfg.rollout.max_new_tokens,
                                trainer.sampling, trainer.stop_ids, seed=seed + k * g + j)
                        for k, ex in enumerate(examples) for j in range(g)]  # fmt: skip
            out["requests"] = len(requests)
            sources = ("eagle", NGRAM) if i == 0 else ("eagle",)  # n-gram: once per policy
            for source in sources:
                trainer.engine.step_policy = FixedPolicy(StepChoice(spec_strategy, source))
                result = _accept(trainer.engine.generate(requests, progress=False))
                out[NGRAM if source == NGRAM else name] = result
        finally:
            trainer.close()
    return out
