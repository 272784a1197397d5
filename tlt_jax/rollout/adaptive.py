"""Step policies: what the rollout engine runs at each decode step (DESIGN.md section 4).

A step policy is the engine's declared seam for speculative decoding. Before every decode step
the engine asks `choose(num_running)` for a `StepChoice` (a draft source and a `SpecStrategy`)
or None (plain decoding); after the step it reports `record(choice, num_running, emitted,
seconds)`: the tokens the step emitted over the whole batch and the host time from dispatch to
the read of its tokens (less a lazy drafter's catch-up: the plain steps' deferred upkeep, not the
SD arm's cost). The engine reads every step's tokens anyway (stop detection), so this timing
adds no device sync.

Policies:

- `PlainPolicy`: never speculates.
- `FixedPolicy`: one choice whenever at most `max_batch` requests run (benchmarks, generate.py).
- `ScheduledPolicy`: a choice per step index (benchmarks of the switch cost).
- `AdaptivePolicy`: TLT's adaptive rollout. SD mode turns on after `warmup_steps` consecutive
  steps with at most `threshold` requests running and off as soon as more run (new requests
  admitted). In SD mode a bucketed epsilon-greedy bandit (BEG-MAB) picks the arm: the running
  batch's engine batch bucket (1, 2, 4, ...; TLT's fine-grained groups) holds the arms of the
  BEG bucket `[t_i, t_{i+1})` that contains it: every strategy with that bucket's verify budget,
  for every draft source, plus plain decoding, so a cold or stale drafter costs nothing: the
  bandit falls back to plain where SD does not pay. Reward = emitted tokens per running
  request per second (acceptance length / step time: a step costs what its bucket costs, and
  the batch falls through a bucket's sizes during the tail, so tokens per second would rank
  arms by when they ran), kept in a window of `window` steps per arm; select
  untried arms first, else with probability `epsilon` a uniform arm among those that could
  still win, else the best median. An arm with `MIN_SAMPLES_TO_CLOSE` rewards whose best
  is below the leader's median is explored once per `window` steps of its bucket only (TLT
  explores every arm uniformly; where SD loses that kept losing arms on ~5% of steps).
  With `epsilon_decay` the exploration probability of an engine bucket falls as
  epsilon / sqrt(1 + n / window) after n SD-mode steps there: TLT's fixed 0.1 explores a
  losing arm on ~7% of steps forever, which alone costs 3-4% where SD runs at half plain
  speed (measured with `bench_spec --adaptive` on this CPU), while the windows keep tracking a
  drafter that improves during RL. When a new drafter version reaches the engine (the RL
  loop's step boundary), `drafter_changed` cuts each drafter arm's window to the last
  version's rewards, so an arm closed while a cold-start drafter was weak is retried within a
  version of the drafter passing the leader (`scripts/bench_bandit.py`).
  Deterministic given its seed; `state_dict` / `load_state_dict` checkpoint it.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from tlt_jax.rollout.speculative import SpecStrategy

DRAFT_SOURCES = ("eagle", "ngram", "hybrid")
PLAIN = "plain"


@dataclasses.dataclass(frozen=True)
class StepChoice:
    """One SD step's plan: where the draft tree comes from and its shape.

    `source`: "eagle" (the drafter's EAGLE-2 tree), "ngram" (model-free suffix matches over the
    prompt, the response so far, GRPO siblings and earlier steps) or "hybrid" (n-gram chains
    merged into the EAGLE tree within the verify budget).
    """

    strategy: SpecStrategy
    source: str = "eagle"

    def __post_init__(self):
        if isinstance(self.strategy, str):
            object.__setattr__(self, "strategy", SpecStrategy.parse(self.strategy))
        if self.source not in DRAFT_SOURCES:
            raise ValueError(f"StepChoice.source={self.source!r} is not one of "
                             f"{list(DRAFT_SOURCES)}")  # fmt: skip

    @property
    def needs_drafter(self) -> bool:
        return self.source in ("eagle", "hybrid")

    @property
    def needs_ngram(self) -> bool:
        return self.source in ("ngram", "hybrid")

    def __str__(self) -> str:
        return f"{self.source}:{self.strategy}"


def arm_name(choice: StepChoice | None) -> str:
    return PLAIN if choice is None else str(choice)


class StepPolicy(Protocol):
    """What the engine asks before and tells after every decode step."""

    def choices(self) -> Sequence[StepChoice]:
        """Every choice the policy may return (the engine checks it can run them)."""
        ...

    def begin(self) -> None:
        """A `generate` call starts (a new rollout)."""
        ...

    def may_speculate(self, num_running: int) -> bool:
        """Whether the next `choose(num_running)` may plan an SD step (no side effects).

        With a plain step in flight, the engine reads it (settling the batch an SD step needs)
        before choosing when this is true; when false it chooses at `num_running`, which must
        then return None, and reads the step while the next one runs.
        """
        ...

    def choose(self, num_running: int) -> StepChoice | None:
        """The next step's plan; None: plain decoding."""
        ...

    def record(self, choice: StepChoice | None, num_running: int, emitted_tokens: int,
               seconds: float) -> None:  # fmt: skip
        """The step that ran `choice` emitted `emitted_tokens` in `seconds` (host time)."""
        ...

    def drafter_changed(self) -> None:
        """A new drafter version reaches the engine (at a step boundary)."""
        ...

    def choice_counts(self) -> dict[str, int]:
        """This rollout's steps per 'batch bucket/arm' (metrics)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state for run checkpoints ({} when stateless)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class PlainPolicy:
    """Plain decoding only."""

    def choices(self) -> Sequence[StepChoice]:
        return ()

    def begin(self) -> None:
        pass

    def may_speculate(self, num_running: int) -> bool:
        return bool(self.choices())

    def choose(self, num_running: int) -> StepChoice | None:
        return None

    def record(self, choice, num_running, emitted_tokens, seconds) -> None:
        pass

    def drafter_changed(self) -> None:
        pass

    def choice_counts(self) -> dict[str, int]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class FixedPolicy(PlainPolicy):
    """`choice` at every step with at most `max_batch` running requests (None: always)."""

    def __init__(self, choice: StepChoice, max_batch: int | None = None):
        self.choice = choice
        self.max_batch = max_batch

    def choices(self) -> Sequence[StepChoice]:
        return (self.choice,)

    def may_speculate(self, num_running: int) -> bool:
        return self.max_batch is None or num_running <= self.max_batch

    def choose(self, num_running: int) -> StepChoice | None:
        if self.max_batch is not None and num_running > self.max_batch:
            return None
        return self.choice


class ScheduledPolicy(PlainPolicy):
    """Plain for the first `plain_steps` steps of every `generate`, then `choice`."""

    def __init__(self, choice: StepChoice | None, plain_steps: int = 0):
        self.choice = choice
        self.plain_steps = plain_steps
        self._steps = 0

    def choices(self) -> Sequence[StepChoice]:
        return () if self.choice is None else (self.choice,)

    def begin(self) -> None:
        self._steps = 0

    def choose(self, num_running: int) -> StepChoice | None:
        self._steps += 1
        return None if self._steps <= self.plain_steps else self.choice


@dataclasses.dataclass(frozen=True)
class BanditConfig:
    """TLT's adaptive SD settings (defaults: the paper's, but for the verify budgets).

    Attributes:
      threshold: SD only with at most this many running requests (the measured crossover).
      warmup_steps: consecutive steps at or under the threshold before SD turns on (N).
      bucket_bounds: lower bounds t_i of the BEG buckets [t_i, t_{i+1}) (first must be 1).
      strategies: per bucket, the strategies with its verify budget ('depth,topk,verify').
      sources: draft sources tried with every strategy.
      epsilon / window: exploration probability and reward window per arm.
      epsilon_decay: shrink epsilon per engine bucket with its step count (module docstring).
      seed: the bandit's random stream.
      include_plain: plain decoding is an arm of every bucket (False: SD arms only).
    """

    threshold: int = 32
    warmup_steps: int = 10
    bucket_bounds: tuple[int, ...] = (1, 2, 5, 21)
    strategies: tuple[tuple[str, ...], ...] = (("8,4,48",), ("8,4,32",), ("8,4,16",),
                                               ("8,4,8",))  # fmt: skip
    sources: tuple[str, ...] = ("eagle",)
    epsilon: float = 0.1
    window: int = 300
    seed: int = 0
    include_plain: bool = True
    epsilon_decay: bool = True

    def __post_init__(self):
        integral = all(isinstance(b, int | np.integer) and not isinstance(b, bool)
                       for b in self.bucket_bounds)  # fmt: skip
        if not integral:  # int() truncated 2.5 to 2: another bucket than the one asked for
            raise ValueError(f"spec.bucket_bounds={self.bucket_bounds!r} must be integers")
        object.__setattr__(self, "bucket_bounds", tuple(int(b) for b in self.bucket_bounds))
        object.__setattr__(self, "strategies", tuple(tuple(s) for s in self.strategies))
        object.__setattr__(self, "sources", tuple(self.sources))
        for name in ("threshold", "warmup_steps", "window"):
            value, low = getattr(self, name), 0 if name == "warmup_steps" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"spec.{name}={value!r} must be an integer >= {low}")
        bounds = self.bucket_bounds
        rising = all(a < b for a, b in zip(bounds, bounds[1:], strict=False))
        if not bounds or bounds[0] != 1 or not rising:
            raise ValueError(f"spec.bucket_bounds={bounds!r} must start at 1 and increase")
        if len(self.strategies) != len(bounds):
            raise ValueError(f"spec.strategies has {len(self.strategies)} buckets; "
                             f"spec.bucket_bounds={bounds!r} has {len(bounds)}")  # fmt: skip
        for i, group in enumerate(self.strategies):
            if not group:
                raise ValueError(f"spec.strategies[{i}] is empty: every bucket needs at least "
                                 "one strategy")  # fmt: skip
            parsed = [SpecStrategy.parse(s) for s in group]  # raises on a bad string
            if len(set(parsed)) < len(parsed):  # one arm twice: its rewards split in two
                raise ValueError(f"spec.strategies[{i}]={group!r} names a strategy twice")
            if len({s.verify_tokens for s in parsed}) > 1:
                raise ValueError(f"spec.strategies[{i}]={group!r}: a bucket's strategies share "
                                 "one verify budget (BEG-MAB groups strategies by it)")  # fmt: skip
        bad = [s for s in self.sources if s not in DRAFT_SOURCES]
        if not self.sources or bad or len(set(self.sources)) < len(self.sources):
            raise ValueError(f"spec.sources={self.sources!r}: expected a non-empty subset of "
                             f"{list(DRAFT_SOURCES)}, each once")  # fmt: skip
        number = isinstance(self.epsilon, int | float | np.number)
        if not number or isinstance(self.epsilon, bool) or not 0 <= self.epsilon <= 1:
            raise ValueError(f"spec.epsilon={self.epsilon!r} must be in [0, 1]")

    def bucket_arms(self, bucket: int) -> tuple[StepChoice | None, ...]:
        """Plain first (if included), then every (strategy, source) pair of BEG bucket
        `bucket`."""
        arms: list[StepChoice | None] = [None] if self.include_plain else []
        for text in self.strategies[bucket]:
            strategy = SpecStrategy.parse(text)
            arms.extend(StepChoice(strategy, source) for source in self.sources)
        return tuple(arms)

    def beg_bucket(self, num_running: int) -> int:
        """Index i of the BEG bucket [t_i, t_{i+1}) holding `num_running`."""
        return int(np.searchsorted(self.bucket_bounds, num_running, side="right")) - 1


# An arm below the leader is closed to exploration (retried once per `window` steps) only
# after this many rewards of its own.
MIN_SAMPLES_TO_CLOSE = 3


def engine_bucket(num_running: int) -> int:
    """The engine's power-of-two batch bucket of `num_running` (the bandit's state key)."""
    return 1 << max(0, int(num_running) - 1).bit_length()


class AdaptivePolicy:
    """SD on in the tail, off when the batch grows; BEG-MAB picks the arm (module docstring)."""

    def __init__(self, config: BanditConfig):
        self.config = config
        self._rng = np.random.default_rng(config.seed)
        # (engine batch bucket, arm name) -> recent rewards (tokens per running request per
        # second).
        self._rewards: dict[tuple[int, str], deque] = {}
        self._steps: dict[int, int] = {}  # SD-mode steps per engine bucket, over all rollouts
        self._tried: dict[tuple[int, str], int] = {}  # the bucket step an arm last ran at
        # Rewards each drafter arm recorded under the current drafter version (`drafter_changed`).
        self._fresh: dict[tuple[int, str], int] = {}
        self._drafter_arms = frozenset(arm_name(c) for c in self.choices() if c.needs_drafter)
        self.sd_on = False
        self._under = 0
        self._draws: tuple[float, float] | None = None  # (explore?, which arm), drawn ahead
        # This rollout's choices: (engine batch bucket, arm name) -> steps.
        self.counts: dict[tuple[int, str], int] = {}

    def choices(self) -> Sequence[StepChoice]:
        out = []
        for i in range(len(self.config.bucket_bounds)):
            out.extend(a for a in self.config.bucket_arms(i) if a is not None)
        return tuple(dict.fromkeys(out))

    def begin(self) -> None:
        self.sd_on = False
        self._under = 0
        self.counts = {}

    def arms_for(self, num_running: int) -> tuple[StepChoice | None, ...]:
        """The arms the bandit picks from at this batch size (plain first)."""
        # The engine pads a batch to its bucket, so the bucket's size decides what it costs.
        size = max(num_running, min(engine_bucket(num_running), self.config.threshold))
        return self.config.bucket_arms(self.config.beg_bucket(size))

    def may_speculate(self, num_running: int) -> bool:
        # Exact, so a plain step in flight is read early only before an SD step: the engine
        # keeps dispatching plain steps ahead of their reads wherever the bandit picks plain.
        return self._plan(num_running)[0] is not None

    def choose(self, num_running: int) -> StepChoice | None:
        choice, self._under, self.sd_on, drew = self._plan(num_running)
        if drew:
            self._draws = None
        if not self.sd_on:
            return None
        key = engine_bucket(num_running)
        step = self._steps.get(key, 0)
        name = (key, arm_name(choice))
        self.counts[name] = self.counts.get(name, 0) + 1
        self._tried[name] = step
        self._steps[key] = step + 1
        return choice

    def _plan(self, num_running: int) -> tuple[StepChoice | None, int, bool, bool]:
        """(choice, consecutive steps under the threshold, SD mode, whether the choice used
        the pending random draws) that `choose(num_running)` makes now; no side effects but
        drawing the next random numbers, which stay pending until a choice uses them."""
        cfg = self.config
        if num_running > cfg.threshold:
            return None, 0, False, False
        under = self._under + 1
        sd_on = self.sd_on or under > cfg.warmup_steps  # N steps under the threshold ran plain
        if not sd_on:
            return None, under, sd_on, False
        arms = self.arms_for(num_running)
        key = engine_bucket(num_running)
        windows = [self._rewards.get((key, arm_name(a))) for a in arms]
        untried = [a for a, w in zip(arms, windows, strict=True) if not w]
        if untried:
            return untried[0], under, sd_on, False
        medians = [float(np.median(w)) for w in windows]
        best = int(np.argmax(medians))
        choice = arms[best]
        if len(arms) == 1:
            return choice, under, sd_on, False
        if self._draws is None:
            self._draws = tuple(float(u) for u in self._rng.random(2))
        explore, pick = self._draws
        if explore < self.epsilon_at(key):
            # Explore uniformly among the arms that could still win: an arm whose best
            # recorded reward is below the leader's median is retried once per `window`
            # steps of the bucket only (a drafter that improves gets its chance back), once
            # it has `MIN_SAMPLES_TO_CLOSE` rewards (one noisy step closed the better arm for
            # 300 steps in 6% of simulated runs at 30% timing noise).
            step = self._steps.get(key, 0)
            enough = min(MIN_SAMPLES_TO_CLOSE, cfg.window)
            open_arms = [a for a, w in zip(arms, windows, strict=True)
                         if len(w) < enough or max(w) >= medians[best] or step - self._tried.get(
                             (key, arm_name(a)), -cfg.window) >= cfg.window]  # fmt: skip
            if open_arms:
                choice = open_arms[min(int(pick * len(open_arms)), len(open_arms) - 1)]
        return choice, under, sd_on, True

    def epsilon_at(self, bucket: int) -> float:
        """The exploration probability of engine bucket `bucket` now."""
        cfg = self.config
        if not cfg.epsilon_decay:
            return cfg.epsilon
        return cfg.epsilon / float(np.sqrt(1.0 + self._steps.get(bucket, 0) / cfg.window))

    def record(self, choice: StepChoice | None, num_running: int, emitted_tokens: int,
               seconds: float) -> None:  # fmt: skip
        # Plain steps count only in SD mode (its own arm); earlier plain steps ran at other
        # batch sizes or before the switch and say nothing about this bucket's choice.
        if not self.sd_on or seconds <= 0 or num_running > self.config.threshold:
            return
        key = (engine_bucket(num_running), arm_name(choice))
        window = self._rewards.setdefault(key, deque(maxlen=self.config.window))
        # Per running request: a step costs what its bucket costs, and a bucket holds several
        # batch sizes (8 holds 5..8) that fall through the tail; in tokens per second an arm
        # that ran at 8 outranked a faster one that ran at 5.
        window.append(emitted_tokens / num_running / seconds)
        if key[1] in self._drafter_arms:
            self._fresh[key] = min(self._fresh.get(key, 0) + 1, self.config.window)

    def drafter_changed(self) -> None:
        """A new drafter version: each drafter arm's window keeps only the rewards of the
        version that just ended, so it spans the last two versions at most, and an arm that did
        not run under that version is untried again (picked at its bucket's next SD step).

        Without this a window of `window` rewards spans many versions of a drafter that trains
        during RL, and a drafter arm closed while the drafter was weak (a cold start) stays
        behind the leader's median long after it passes it: its one retry per `window` steps
        adds one reward to a window of old ones.
        """
        for key in [k for k in self._rewards if k[1] in self._drafter_arms]:
            window, keep = self._rewards[key], self._fresh.get(key, 0)
            while len(window) > keep:
                window.popleft()
            if not window:
                del self._rewards[key]
                self._tried.pop(key, None)
        self._fresh = {}

    def choice_counts(self) -> dict[str, int]:
        return {f"{b}/{a}": n for (b, a), n in sorted(self.counts.items())}

    def median_rewards(self) -> dict[str, float]:
        """'bucket/arm' -> median reward (tokens per running request per second), for
        metrics."""
        return {f"{b}/{a}": float(np.median(w)) for (b, a), w in sorted(self._rewards.items())
                if w}  # fmt: skip

    # -- checkpointing -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: reward windows, step counts, the drafter arms' rewards of
        the current version and the random stream."""
        return {
            "rewards": [[b, a, list(w)] for (b, a), w in sorted(self._rewards.items())],
            "steps": [[b, n] for b, n in sorted(self._steps.items())],
            "tried": [[b, a, n] for (b, a), n in sorted(self._tried.items())],
            "fresh": [[b, a, n] for (b, a), n in sorted(self._fresh.items())],
            "rng": self._rng.bit_generator.state,
            "draws": None if self._draws is None else list(self._draws),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self._rewards = {
            (int(b), str(a)): deque((float(r) for r in w), maxlen=self.config.window)
            for b, a, w in state["rewards"]
        }
        self._steps = {int(b): int(n) for b, n in state.get("steps", [])}
        self._tried = {(int(b), str(a)): int(n) for b, a, n in state.get("tried", [])}
        if "fresh" in state:
            self._fresh = {(int(b), str(a)): int(n) for b, a, n in state["fresh"]}
        else:  # a state from before `drafter_changed`: its windows' drafter versions unknown,
            # they are kept whole at the next version (not dropped as none of its own)
            self._fresh = {
                k: len(w) for k, w in self._rewards.items() if k[1] in self._drafter_arms
            }
        self._rng.bit_generator.state = state["rng"]
        draws = state.get("draws")
        self._draws = None if draws is None else (float(draws[0]), float(draws[1]))
