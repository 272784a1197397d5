"""TLT's adaptive drafter in the RL loop: rollout slices, spot training, version sync.

`SpotConfig` is the `spot` config group. With `spot.slices = R > 1` the trainer builds R engine
replicas, one per disjoint set of local devices (`build_slices`), spreads whole GRPO groups
over them (`split_groups`, balanced by prompt count) and decodes them at once through
`tlt_jax.parallel.scheduler.SpotScheduler`. With `spot.enabled` the first slice to finish
trains the one canonical `OnlineDrafter` on its devices until the last slice is done; at the
step boundary the new version reaches every slice through the engines' checked sync entry
points (`publish_drafter`, `sync_policy`).

Rollouts stay exactly what they would be without spot training: every engine drafts with the
version published at the previous boundary throughout the rollout, and speculative decoding is
lossless whatever the drafter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from tlt_jax.drafter.online import OnlineDrafter
from tlt_jax.drafter.trainer import DRAFTER_OPTIM, DrafterTrainConfig
from tlt_jax.metrics import timing
from tlt_jax.parallel.distributed import ProcessGroup
from tlt_jax.parallel.scheduler import RolloutSlice
from tlt_jax.programs import ProgramPool
from tlt_jax.rollout.engine import Completion, Request, RolloutEngine


@dataclasses.dataclass(frozen=True)
class SpotConfig:
    """The `spot` group: rollout slices and the spot-trained drafter (DESIGN.md section 4).

    Attributes:
      slices: R rollout slices (engine replicas on disjoint local devices; on a CPU set
        `XLA_FLAGS=--xla_force_host_platform_device_count=R`, or run R processes).
      enabled: train the drafter online on idle slices (needs R >= 2: one slice is never
        idle while the rollout runs). Without `spec.drafter` it starts from a random init.
      learning_rate / warmup_steps: the drafter's AdamW (constant after a linear warm-up).
      batch_rows / row_len / window / prompt_context / buffer_steps: drafter batches (packed
        windows of the last `buffer_steps` RL steps' features).
      ploss_weight: weight of the token (soft cross-entropy) loss next to the feature loss.
      max_steps_per_rl_step: cap on drafter steps per RL step (0: until preempted).
      exact_steps_per_rl_step: exactly this many drafter steps per RL step (0: as many as the
        idle windows hold). For reproducible runs and side-by-side comparisons: the drafter
        then evolves the same way whatever the timing, and the steps the idle window did not
        hold run after the rollout (they add to the step time).
      checkpoint_buffer_mb: the drafter buffer's recent samples go into the run checkpoint
        when their features are at most this many MB (0: never), so a resumed run trains on
        what the uninterrupted one would; larger buffers (long responses of big models) are
        left out, and the first resumed step trains on nothing (a warning says so).
      export: write the drafter as an HF-EAGLE directory (`workdir/drafter`) at the end.
      silent_features: also run a forward over the micro-batches the update skips (groups
        whose advantages are all zero) for the drafter's features. Off, the drafter learns
        from what the update computes anyway (DESIGN.md: no extra target pass): in the
        2-process main job that forward took 10-18 s of 79-161 s TLT steps (BENCHMARKS.md).
        Turn it on where most groups are silent (greedy rollouts; a policy that fails or
        solves every problem): without it such steps give the drafter no data.
    """

    slices: int = 1
    enabled: bool = False
    learning_rate: float = 3e-4
    warmup_steps: int = 10
    batch_rows: int = 2
    row_len: int = 512
    window: int = 512
    prompt_context: int = 64
    buffer_steps: int = 2
    ploss_weight: float = 0.1
    max_steps_per_rl_step: int = 0
    exact_steps_per_rl_step: int = 0
    checkpoint_buffer_mb: int = 1024
    export: bool = True
    silent_features: bool = False

    def __post_init__(self):
        for name in ("slices", "batch_rows", "row_len", "window", "buffer_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"spot.{name}={value!r} must be an integer >= 1")
        for name in ("warmup_steps", "prompt_context", "max_steps_per_rl_step",
                     "exact_steps_per_rl_step", "checkpoint_buffer_mb"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"spot.{name}={value!r} must be an integer >= 0")
        if self.enabled and self.slices < 2:
            raise ValueError(f"spot.enabled=True needs spot.slices >= 2 (got {self.slices}): "
                             "a single slice is never idle while the rollout runs")  # fmt: skip
        if self.exact_steps_per_rl_step and self.max_steps_per_rl_step:
            raise ValueError(f"spot.exact_steps_per_rl_step={self.exact_steps_per_rl_step} "
                             "is also the cap: leave spot.max_steps_per_rl_step at 0 (got "
                             f"{self.max_steps_per_rl_step})")  # fmt: skip
        if self.window > self.row_len:
            raise ValueError(f"spot.window={self.window} must be <= spot.row_len={self.row_len}")
        # Named here: the drafter trainer's own checks would blame `optim.learning_rate`
        # (the RL optimizer's field) and a bare `ploss_weight`.
        for name in ("learning_rate", "ploss_weight"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or not math.isfinite(value) or value < 0):  # fmt: skip
                raise ValueError(f"spot.{name}={value!r} must be a finite number >= 0")
        self.train_config()  # the drafter trainer's remaining checks

    def train_config(self) -> DrafterTrainConfig:
        optim = dataclasses.replace(
            DRAFTER_OPTIM,
            learning_rate=self.learning_rate,
            schedule="constant",
            warmup_steps=self.warmup_steps,
        )
        return DrafterTrainConfig(
            optim=optim, total_steps=self.warmup_steps + 1,
            ploss_weight=self.ploss_weight, window=self.window,
            prompt_context=self.prompt_context, batch_rows=self.batch_rows,
            row_len=self.row_len, buffer_steps=self.buffer_steps,
        )  # fmt: skip


# -- slices ----------------------------------------------------------------------------------


def split_devices(devices: Sequence[Any], count: int) -> list[tuple[Any, ...]]:
    """`count` disjoint, equal, contiguous groups of `devices`.

    Raises:
      ValueError: when the devices do not split evenly into `count` groups.
    """
    if count < 1 or len(devices) < count or len(devices) % count:
        raise ValueError(
            f"spot.slices={count} needs a multiple of {count} local devices; this process has "
            f"{len(devices)} ({[str(d) for d in devices]}). On a CPU, set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={count} before JAX starts"
        )
    size = len(devices) // count
    return [tuple(devices[i * size : (i + 1) * size]) for i in range(count)]


def place_engine(engine: RolloutEngine, device) -> RolloutEngine:
    """Moves an engine's policy, drafter and decode state onto `device` (before it compiles)."""
    engine.params = jax.device_put(engine.params, device)
    if engine.drafter_params is not None:
        engine.drafter_params = jax.device_put(engine.drafter_params, device)
    engine.state = jax.device_put(engine.state, device)
    return engine


def build_slices(build_engine, model, devices_per_slice: Sequence[tuple[Any, ...]],
                 first_pool: ProgramPool, first_index: int = 0) -> list[RolloutSlice]:  # fmt: skip
    """One engine replica per device group; slice 0 compiles into the trainer's pool.

    Args:
      build_engine: `(model, pool) -> RolloutEngine` (the run's engine settings).
      model: the policy (its params are copied onto each slice's first device).
      devices_per_slice: `split_devices` output; each slice runs on its first device.
      first_pool: the trainer's program pool, shared with slice 0's engine.
      first_index: the run-wide index of this process's first slice.
    """
    graphdef, params = nnx.split(model)
    slices = []
    for i, devices in enumerate(devices_per_slice):
        with jax.default_device(devices[0]):
            # Fresh buffers: on the device they are on, `params` would be aliased.
            replica = nnx.merge(graphdef, jax.device_put(params, devices[0], may_alias=False))
            engine = build_engine(replica, first_pool if i == 0 else ProgramPool())
            slices.append(RolloutSlice(first_index + i, devices,
                                       place_engine(engine, devices[0])))  # fmt: skip
    return slices


def split_groups(requests: Sequence[Request], group_size: int, count: int
                 ) -> list[list[int]]:  # fmt: skip
    """Request indices per slice: whole groups, contiguous, prompt counts differing by <= 1.

    Raises:
      ValueError: when the requests are not whole groups (a trailing part would be decoded
        by no slice and its completions missing).
    """
    if group_size < 1 or len(requests) % group_size:
        raise ValueError(f"split_groups: {len(requests)} requests are not whole groups of "
                         f"group_size={group_size}")  # fmt: skip
    groups = len(requests) // group_size
    bounds = np.linspace(0, groups, count + 1).round().astype(int)
    return [list(range(bounds[i] * group_size, bounds[i + 1] * group_size))
            for i in range(count)]  # fmt: skip


def merge_completions(
    per_slice: Sequence[Sequence[Completion]], indices: Sequence[Sequence[int]], total: int
) -> list[Completion]:
    """Completions back in request order, each renumbered to its request's index."""
    out: list[Completion | None] = [None] * total
    for comps, idx in zip(per_slice, indices, strict=True):
        for c, i in zip(comps, idx, strict=True):
            out[i] = dataclasses.replace(c, index=i)
    return out  # type: ignore[return-value]


def gather_completions(group: ProcessGroup, step: int, per_slice, indices, total: int
                       ) -> list[Completion]:  # fmt: skip
    """Every process's completions, in request order, on every process (one process: a
    merge). Token ids, log-probs (floats round-trip JSON exactly) and finish reasons travel;
    timings stay local."""
    if group.count == 1:
        return merge_completions(per_slice, indices, total)
    mine = [[i, list(c.prompt_ids), c.token_ids, c.logprobs, c.finish_reason,
             c.accepted_lengths]
            for comps, idx in zip(per_slice, indices, strict=True)
            for c, i in zip(comps, idx, strict=True)]  # fmt: skip
    out: list[Completion | None] = [None] * total
    for part in group.allgather(f"completions/{step}", mine):
        for i, prompt, tokens, logprobs, reason, accepted in part:
            out[i] = Completion(i, tuple(prompt), tokens, logprobs, reason, accepted)
    missing = [i for i, c in enumerate(out) if c is None]
    if missing:
        raise RuntimeError(f"step {step}: no process returned completions {missing[:8]}")
    return out  # type: ignore[return-value]


def combine_rollout_stats(stats: Sequence[dict[str, Any]], sliced: bool) -> dict[str, Any]:
    """One step record's rollout fields from every process's `rollout_stats`.

    The long tail (`long_tail_share`, `long_tail_s`) is the run's, in wall time without the
    compiles inside steps (each slice's clock stops while it compiles; `rollout_compile_s`
    sums those slice-seconds): the seconds
    in which at most the SD threshold of requests were running over all slices together
    (`timing.merge_timelines`, each process's timeline placed by its `start_wall`; before a
    process starts, its requests count as running). Each slice decides SD against its own
    running requests, so a slice holding no more requests than the threshold is in its own
    tail from its first step:
    that view is `slice_tail_share` / `slice_tail_s`, in slice-seconds, and `sd_tail_s` counts
    the slice-seconds of it that ran SD. SD shares and acceptance sum the processes' counters;
    spot fields (when the run has slices) sum idle and training slice-seconds and the counts;
    `spot_preemption_latency_s` is the largest of the preempted trainers' (absent when no
    trainer was preempted: it had stopped on its own, or there was none).
    """
    tails = [t for s in stats for t in s["tail"]]
    # Each process's clock starts with its own rollout; processes start apart (process 0
    # writes checkpoints and plots between steps), so each timeline moves by its process's
    # start after the earliest one (`start_wall`, absent from single-process stats).
    starts = [s.get("start_wall") for s in stats]
    offsets = ([w - min(starts) for w in starts] if None not in starts  # type: ignore[type-var]
               else [0.0] * len(stats))  # fmt: skip
    timelines = [[(row[0] + offset, *row[1:]) for row in t["timeline"]]
                 for s, offset in zip(stats, offsets, strict=True) for t in s["tail"]]  # fmt: skip
    decode_s = [t["rollout_decode_s"] + offset
                for s, offset in zip(stats, offsets, strict=True) for t in s["tail"]]  # fmt: skip
    spec0 = stats[0]["spec"]
    threshold = int(spec0["tail_threshold"])
    run_tail = timing.tail_stats(timing.merge_timelines(timelines), threshold)
    slice_total = sum(t["rollout_decode_s"] for t in tails)
    slice_tail = sum(t["long_tail_s"] for t in tails)
    out: dict[str, Any] = {
        "long_tail_share": run_tail["long_tail_share"],
        "long_tail_s": run_tail["long_tail_s"],
        "rollout_decode_s": max(decode_s),
        "slice_tail_share": slice_tail / slice_total if slice_total > 0 else 0.0,
        "slice_tail_s": slice_tail,
        "sd_tail_s": sum(t["sd_tail_s"] for t in tails),
        # Slice-seconds: slices compile in their own threads or processes, at once.
        "rollout_compile_s": sum(t.get("rollout_compile_s", 0.0) for t in tails),
    }
    spec = sum(s["spec"]["spec"] for s in stats)
    plain = sum(s["spec"]["plain"] for s in stats)
    out.update(sd_step_share=spec / (spec + plain) if spec + plain else 0.0, sd_steps=spec,
               decode_steps=spec + plain, sd_threshold=spec0["threshold"],
               long_tail_threshold=threshold)  # fmt: skip
    for source in sorted({k for s in stats for k in s["spec"]["rows"]}):
        rows = sum(s["spec"]["rows"].get(source, 0) for s in stats)
        if rows:
            out[f"sd_rows_{source}"] = rows  # what the run's acceptance length weighs by
            out[f"accept_len_{source}"] = sum(s["spec"]["tokens"].get(source, 0)
                                              for s in stats) / rows  # fmt: skip
    choices: dict[str, int] = {}
    for s in stats:
        for arm, n in s["spec"]["choices"].items():
            choices[arm] = choices.get(arm, 0) + n
    out["sd_choices"] = choices
    if sliced:
        spots = [s["spot"] for s in stats]
        idle = sum(m["spot_idle_slice_s"] for m in spots)
        training = sum(min(m["spot_training_s"], m["spot_idle_slice_s"]) for m in spots)
        out.update(
            spot_slices=sum(m["spot_slices"] for m in spots), spot_idle_slice_s=idle,
            spot_training_s=training, spot_reclaimed_share=training / idle if idle else 0.0,
            spot_drafter_steps=sum(m["spot_drafter_steps"] for m in spots),
            spot_dropped_steps=sum(m["spot_dropped_steps"] for m in spots),
            spot_dropped_s=sum(m["spot_dropped_s"] for m in spots),
            spot_preempted_windows=sum(m["spot_preempted_windows"] for m in spots),
            spot_trainer_failures=sum(m["spot_trainer_failures"] for m in spots),
            slice_finish_s=[t for m in spots for t in m["slice_finish_s"]],
        )  # fmt: skip
        for name in ("spot_drafter_step_s", "spot_preemption_latency_s"):
            values = [m[name] for m in spots if name in m]
            if values:
                out[name] = max(values)
    return out


def sync_drafter_across(group: ProcessGroup, step: int, online: OnlineDrafter) -> None:
    """Makes the process that trained this step's drafter the source of every process's copy.

    All processes first meet at a barrier: the trainer role was claimed during the rollout,
    before its claimer arrived, so after the barrier every process reads the same owner.
    """
    group.barrier(f"boundary/{step}")
    owner = group.owner(f"trainer/{step}")
    if owner is None:
        return
    state = group.broadcast(online.state, source=owner)
    host = group.allgather(f"drafter/{step}", online.sync_dict() if group.index == owner else {})
    online.load_sync(jax.device_put(state, jax.local_devices()[0]), host[owner])


def processes_in_sync(group: ProcessGroup, step: int, *trees) -> bool:
    """Whether every process holds bit-identical `trees` (policy and drafter params, the
    drafter's buffer)."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(trees)):
        digest.update(np.ascontiguousarray(leaf).tobytes())
    digests = group.allgather(f"digest/{step}", digest.hexdigest())
    return len(set(digests)) == 1


def _like(tree, like):
    """`tree` placed with `like`'s shardings, in fresh buffers: a `device_put` onto the
    sharding an array already has returns its buffer, and the train state it came from is
    donated to the next update (an engine sharing it would read a deleted array)."""
    return jax.device_put(tree, jax.tree.map(lambda x: x.sharding, like), may_alias=False)


def sync_policy(params, slices: Sequence[RolloutSlice]) -> None:
    """The train params into every slice's engine (copied to its devices; checked there)."""
    for s in slices:
        s.engine.update_params(_like(params, s.engine.params))


def push_drafter(online: OnlineDrafter, slices: Sequence[RolloutSlice], *,
                 params: bool = True) -> None:  # fmt: skip
    """The drafter's hot vocabulary, and its current params unless `params=False`, into every
    slice's engine (checked)."""
    for s in slices:
        if params:
            s.engine.update_drafter_params(_like(online.params(), s.engine.drafter_params))
        if online.hot_ids is not None:
            s.engine.set_hot_token_ids(online.hot_ids)


def publish_drafter(online: OnlineDrafter, slices: Sequence[RolloutSlice]) -> dict[str, Any]:
    """Ends the drafter's window: the hot vocabulary, and the params when there is a new
    version, reach every slice; each slice's step policy is told of a new version (its drafter
    arms' rewards then span the last two versions: `AdaptivePolicy.drafter_changed`)."""
    version = online.version
    metrics = online.publish()
    changed = online.version != version
    push_drafter(online, slices, params=changed)
    if changed:
        for s in slices:
            s.engine.step_policy.drafter_changed()
    return metrics


class SpotTrainer:
    """The scheduler's `SpotTrainable`: drafter steps against the idle slice's policy copy."""

    def __init__(self, online: OnlineDrafter, max_steps: int = 0, exact_steps: int = 0):
        """
        Args:
          max_steps: at most this many drafter steps per RL step (0: until preempted).
          exact_steps: exactly this many (0: off); preemption then waits for them.
        """
        self.online = online
        self.max_steps = exact_steps or max_steps
        self.exact_steps = exact_steps

    def ready(self) -> bool:
        return self.online.ready()

    def train_on(self, slice_: RolloutSlice, stop: threading.Event, on_step) -> int:
        model = nnx.merge(slice_.engine.graphdef, slice_.engine.params)
        return self.online.train_on(
            slice_.devices, model.embed.get_value(), model.head_weight_DxV(), stop,
            max_steps=self.max_steps, on_step=on_step,
        )  # fmt: skip
