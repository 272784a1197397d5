"""Greedy evaluation on a held-out split: accuracy with its binomial standard error."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tlt_jax.rl.rewards import score_batch
from tlt_jax.rollout.engine import Request
from tlt_jax.rollout.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Accuracy of greedy answers on `num_problems` problems.

    Attributes:
      accuracy: share of problems whose extracted answer equals the gold one.
      stderr: binomial standard error, sqrt(p (1 - p) / n).
      num_problems: n.
      mean_length: mean response length (tokens).
      correct: per problem, in split order.
      lengths: per problem response lengths.
      seconds: wall time of generation and scoring.
      responses: per problem response text.
      num_errors / num_timeouts: problems whose scoring raised / ran past the time limit (each
        scored wrong, and named in `summary`).
    """

    accuracy: float
    stderr: float
    num_problems: int
    mean_length: float
    correct: tuple[bool, ...]
    lengths: tuple[int, ...]
    seconds: float
    responses: tuple[str, ...] = ()
    num_errors: int = 0
    num_timeouts: int = 0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["correct"] = [bool(c) for c in self.correct]
        out["lengths"] = [int(n) for n in self.lengths]
        out["responses"] = list(self.responses)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalResult:
        tuples = {k: tuple(d.get(k, ())) for k in ("correct", "lengths", "responses")}
        return cls(**{**d, **tuples})

    def summary(self) -> str:
        counts = ((self.num_errors, "errors"), (self.num_timeouts, "timeouts"))
        failed = [f"{count} scoring {what}" for count, what in counts if count]
        suffix = f" ({', '.join(failed)}, scored wrong)" if failed else ""
        return self._accuracy_summary() + suffix

    def _accuracy_summary(self) -> str:
        n, acc = self.num_problems, self.accuracy
        if n and acc in (0.0, 1.0):
            # The binomial error is 0 here, which says nothing: give the 95% Wilson bound.
            correct = round(acc * n)
            low, high = wilson_interval(correct, n)
            bound = f"95% upper bound {high:.3f}" if acc == 0 else f"95% lower bound {low:.3f}"
            spread = f"({correct} of {n} correct; {bound}, Wilson)"
            return f"{acc:.3f} {spread} (mean length {self.mean_length:.1f} tokens)"
        return (f"{acc:.3f} +- {self.stderr:.3f} (n={n}, "
                f"mean length {self.mean_length:.1f} tokens)")  # fmt: skip


def binomial_stderr(accuracy: float, n: int) -> float:
    return math.sqrt(accuracy * (1 - accuracy) / n) if n else float("nan")


def wilson_interval(correct: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% at the default `z`): unlike
    p +- z s.e., it is not empty at 0 or n successes (0 of 96: [0, 0.038])."""
    if n <= 0:
        raise ValueError(f"n={n}: expected at least one trial")
    p, z2 = correct / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference(before: EvalResult, after: EvalResult) -> dict[str, float]:
    """after - before on the same problems, with the paired standard error.

    The problems are the same, so the difference's error comes from the discordant pairs only:
    with g problems gained and l lost out of n, diff = (g - l) / n and
    se = sqrt((g + l - (g - l)^2 / n) / (n - 1)) / sqrt(n): the sample std of the per-problem
    differences (n - 1 in its denominator) over sqrt n; NaN for fewer than 2 problems.
    """
    if before.num_problems != after.num_problems:
        raise ValueError(f"{before.num_problems=} != {after.num_problems=}: not the same problems")
    b, a = np.asarray(before.correct, bool), np.asarray(after.correct, bool)
    n = len(b)
    gained, lost = int(np.sum(a & ~b)), int(np.sum(b & ~a))
    diff = (gained - lost) / n if n else float("nan")
    se = (math.sqrt(max(gained + lost - (gained - lost) ** 2 / n, 0.0) / (n - 1) / n)
          if n > 1 else float("nan"))  # fmt: skip
    return {"diff": diff, "stderr": se, "gained": gained, "lost": lost, "n": n}


def evaluate(
    engine,
    encode: Callable[[str], tuple[int, ...]],
    decode: Callable[[Sequence[int]], str],
    examples: Sequence[dict],
    *,
    max_new_tokens: int,
    stop_ids: tuple[int, ...],
    reward_fn: str | Callable[[str, str], float] = "math_accuracy",
    reward_timeout_s: float = 5.0,
    progress: bool | None = None,
) -> EvalResult:
    """Greedy answers of the engine's current weights to `examples`, scored by `reward_fn`.

    Args:
      engine: a `RolloutEngine` holding the policy to evaluate.
      encode: question -> prompt token ids (the training prompt rendering).
      decode: response token ids -> text.
      examples: dicts with `question` and `answer`.
      max_new_tokens: response length limit.
      stop_ids: tokens that end a response.
      reward_fn: a key of `REWARD_FUNCTIONS` or a function; correct when it is > 0.
      reward_timeout_s: per-completion scoring time limit (a run's `rl.reward_timeout_s`).
      progress: show the engine's progress bar.
    """
    start = time.perf_counter()
    requests = [Request(encode(ex["question"]), max_new_tokens, SamplingParams(), stop_ids)
                for ex in examples]  # fmt: skip
    completions = engine.generate(requests, progress=progress) if requests else []
    texts = [decode(c.token_ids) for c in completions]
    scored = score_batch(reward_fn, texts, [str(ex["answer"]) for ex in examples],
                         timeout_s=reward_timeout_s)  # fmt: skip
    if scored.num_errors or scored.num_timeouts:
        log.warning("evaluation: %d of %d answers could not be scored (%d errors, %d past "
                    "the %.1f s limit); they count as wrong", scored.num_errors
                    + scored.num_timeouts, len(texts), scored.num_errors, scored.num_timeouts,
                    reward_timeout_s)  # fmt: skip
    correct = tuple(bool(c) for c in scored.correct)
    lengths = tuple(len(c.token_ids) for c in completions)
    n = len(examples)
    accuracy = float(np.mean(correct)) if n else float("nan")
    return EvalResult(
        accuracy=accuracy,
        stderr=binomial_stderr(accuracy, n),
        num_problems=n,
        mean_length=float(np.mean(lengths)) if n else 0.0,
        correct=correct,
        lengths=lengths,
        seconds=time.perf_counter() - start,
        responses=tuple(texts),
        num_errors=int(scored.num_errors),
        num_timeouts=int(scored.num_timeouts),
    )
