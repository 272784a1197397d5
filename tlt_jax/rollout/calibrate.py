"""Measuring where speculative decoding can pay on this hardware: the SD threshold.

SD turns a decode step into a verification of T tree tokens. It pays at batch b when the
tokens a step emits (the acceptance length) exceed the verify step's cost in plain steps,
`cost_ratio(b) = verify_step(b, T) / plain_step(b)`. That ratio grows with the batch as steps
turn compute-bound; the threshold is the largest engine batch bucket whose ratio is below
`max_cost_ratio` (default 2.0, about the acceptance length a warmed EAGLE drafter reaches on
SmolLM2; BENCHMARKS.md). Above it SD is never tried; at or under it the bandit decides per
bucket from measured rewards, with plain decoding as one of its arms.

`calibrate` times both kinds of step through the engine's public API (plain and n-gram verify
steps of the same random requests, sampled as RL samples), so it needs no drafter, and its
programs land in the engine's pool for the run to reuse. `scripts/calibrate_spec.py` writes the
result as JSON (`spec.calibration_file`); without a file the trainer calibrates at start.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from tlt_jax.files import write_text_atomic
from tlt_jax.metrics.timing import median_step_ms
from tlt_jax.rollout.adaptive import FixedPolicy, PlainPolicy, StepChoice
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.speculative import SpecStrategy


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Per engine batch bucket: plain and verify step milliseconds, their ratio; the threshold."""

    threshold: int
    verify_tokens: int
    max_cost_ratio: float
    plain_ms: dict[int, float]
    verify_ms: dict[int, float]
    seconds: float
    backend: str = ""

    @property
    def cost_ratio(self) -> dict[int, float]:
        return {b: self.verify_ms[b] / self.plain_ms[b] for b in self.plain_ms}

    def threshold_at(self, max_cost_ratio: float) -> int:
        """The threshold under another bound: the largest timed bucket whose verify / plain
        ratio is below `max_cost_ratio` (0: none). A bound of about the acceptance length the
        run's drafts reach (tokens per verify step) keeps SD where it can pay; the file's own
        bound (`max_cost_ratio`, 2.0 by default) is a loose upper one. Buckets above the
        timed ones were not measured and never qualify."""
        if not max_cost_ratio > 0:
            raise ValueError(f"max_cost_ratio={max_cost_ratio!r} must be > 0")
        return max((b for b, r in self.cost_ratio.items() if r < max_cost_ratio), default=0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "threshold": self.threshold,
            "verify_tokens": self.verify_tokens,
            "max_cost_ratio": self.max_cost_ratio,
            # Unrounded: a resumed run recomputes its threshold from these (`threshold_at`),
            # and rounded times moved a ratio of 1.99993 past 2.0 (another threshold).
            "plain_ms": {str(b): float(v) for b, v in self.plain_ms.items()},
            "verify_ms": {str(b): float(v) for b, v in self.verify_ms.items()},
            "cost_ratio": {str(b): round(v, 3) for b, v in self.cost_ratio.items()},
            "seconds": round(self.seconds, 2),
            "backend": self.backend,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Calibration:
        """Raises ValueError for a file that could not have been measured: buckets timed on
        one side only (a bare KeyError once the run used it), times that are not positive
        and finite (a ZeroDivisionError), a negative threshold (SD silently off)."""
        out = cls(
            threshold=int(raw["threshold"]),
            verify_tokens=int(raw["verify_tokens"]),
            max_cost_ratio=float(raw["max_cost_ratio"]),
            plain_ms={int(b): float(v) for b, v in raw["plain_ms"].items()},
            verify_ms={int(b): float(v) for b, v in raw["verify_ms"].items()},
            seconds=float(raw.get("seconds", 0.0)),
            backend=str(raw.get("backend", "")),
        )
        if set(out.plain_ms) != set(out.verify_ms):
            raise ValueError(f"plain_ms buckets {sorted(out.plain_ms)} differ from verify_ms "
                             f"buckets {sorted(out.verify_ms)}")  # fmt: skip
        times = [*out.plain_ms.values(), *out.verify_ms.values()]
        if not all(math.isfinite(t) and t > 0 for t in times):
            raise ValueError(f"step times must be positive and finite milliseconds; got {times}")
        if out.threshold < 0:
            raise ValueError(f"threshold={out.threshold} must be >= 0")
        return out

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=1))


def load_calibration(path: str | os.PathLike, label: str = "spec.calibration_file"
                     ) -> Calibration:  # fmt: skip
    """Reads a calibration JSON; the error names the file (as `label`, e.g. the flag that gave
    it) and what is missing."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{label}={str(path)!r} does not exist; write one "
                                "with scripts/calibrate_spec.py or set it to ''")  # fmt: skip
    try:
        return Calibration.from_dict(json.loads(path.read_text()))
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(
            f"{label}={str(path)!r} is not a calibration "
            f"(expected threshold, verify_tokens, plain_ms, verify_ms): {e}"
        ) from e


def random_requests(vocab: int, batch: int, *, prompt_len: int, steps: int, temperature: float,
                    rng: np.random.Generator) -> list:  # fmt: skip
    """`batch` random prompts of `prompt_len` tokens, each decoding `steps` + 2 tokens."""
    from tlt_jax.rollout.engine import Request

    sampling = SamplingParams(temperature=temperature)
    return [Request(tuple(int(t) for t in rng.integers(0, vocab, prompt_len)), steps + 2,
                    sampling, (), seed=i) for i in range(batch)]  # fmt: skip


def step_ms(engine, policy, requests: list) -> float:
    """Median milliseconds of a decode step under `policy` with all `requests` running (a
    two-token warm-up first compiles the batch's programs off the clock)."""
    engine.step_policy = policy
    engine.generate([dataclasses.replace(r, max_new_tokens=2) for r in requests])
    engine.generate(requests)
    return median_step_ms(engine.stats.timeline, len(requests))


def calibrate(engine, *, verify_tokens: int = 4, max_batch: int | None = None,
              prompt_len: int = 16, steps: int = 8, temperature: float = 0.8,
              max_cost_ratio: float = 2.0, seed: int = 0) -> Calibration:  # fmt: skip
    """Times plain and verify steps per engine batch bucket and derives the threshold.

    Args:
      engine: a `RolloutEngine` (its step policy is restored afterwards).
      verify_tokens: T of the timed verify steps (the smallest budget the run's bandit has).
      max_batch: largest bucket timed (default: the engine's largest).
      prompt_len / steps: random prompts of this length, `steps` timed steps per bucket.
      temperature: sampling of the timed requests (as RL samples).
      max_cost_ratio: SD is tried where verify / plain is below this.
      seed: the random prompts' seed.

    Returns:
      The `Calibration`; threshold 0 when SD pays at no batch size.
    """
    start = time.perf_counter()
    cfg = engine.config
    buckets = [b for b in cfg.batch_buckets if max_batch is None or b <= max_batch]
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    choice = StepChoice(SpecStrategy(max(verify_tokens - 1, 1), 1, verify_tokens), "ngram")
    saved = engine.step_policy
    plain_ms, verify_ms = {}, {}
    above = 0
    # The steps a long run decodes with (one program each), not a bucket's first, layered tier.
    with engine.one_program_steps():
        try:
            for b in buckets:
                requests = random_requests(vocab, b, prompt_len=prompt_len, steps=steps,
                                           temperature=temperature, rng=rng)  # fmt: skip
                plain_ms[b] = step_ms(engine, PlainPolicy(), requests)
                verify_ms[b] = step_ms(engine, FixedPolicy(choice), requests)
                # The ratio grows with the batch: two buckets past the bound end the search.
                above = above + 1 if verify_ms[b] / plain_ms[b] >= max_cost_ratio else 0
                if above == 2:
                    break
        finally:
            engine.step_policy = saved
    import jax

    result = Calibration(0, verify_tokens, max_cost_ratio, plain_ms, verify_ms,
                         time.perf_counter() - start, jax.default_backend())  # fmt: skip
    return dataclasses.replace(result, threshold=result.threshold_at(max_cost_ratio))
