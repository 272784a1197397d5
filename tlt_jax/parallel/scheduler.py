"""Rollout slices and the spot scheduler: idle slices train the drafter while stragglers decode.

A rollout slice is a disjoint set of devices with its own engine replica (`RolloutSlice`).
`SpotScheduler.rollout` decodes every slice's requests at once (one host thread per slice: the
single controller dispatches to disjoint devices, which run concurrently) and tracks each
slice's state:

    BUSY ----(its requests are done)----> IDLE ----(the drafter has data, no trainer yet)---->
    TRAINING ----(the last slice is done: preempted at the next drafter-step boundary)----> back
    to the step boundary (the policy update).

At most one slice trains at a time, and it trains the one canonical drafter (the first slice to
go idle takes it; later idle slices stay IDLE). Data parallelism over the training slices would
need collectives among a set of slices that changes while others decode, and a compile per set
size, for a one-layer drafter whose step is already short; one trainer is also what makes
"never on a BUSY slice's devices" trivially true. Drafter work is placed on the trainer slice's
devices only.

Preemption is cooperative: when the last slice finishes, the scheduler sets the trainer's stop
event and waits; the trainer checks it between steps, so the latency is at most one drafter
step (`SpotReport.preemption_latency_s` measures it, from the stop to the trainer's end, for
a trainer whose check found the stop set: one that stopped on its own, out of data or steps,
was not preempted, even if it was still returning at the rollout's end). The
trainer reports each step's seconds and whether it was applied: only applied steps count as
reclaimed idle time, dropped (non-finite) ones are counted apart. A trainer that raises is
logged and counted (`trainer_failures`); the rollout is unaffected and the drafter keeps its
last good state. An error in a decoding slice stops the trainer and is raised after every
thread ended.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import jax

from tlt_jax.parallel.distributed import ProcessGroup
from tlt_jax.rollout.engine import Completion, Request, RolloutEngine

log = logging.getLogger(__name__)


# How long a failing rollout waits for the drafter trainer to reach a step boundary.
_TRAINER_JOIN_S = 120.0


class SliceState(enum.Enum):
    BUSY = "busy"
    IDLE = "idle"
    TRAINING = "training"


@dataclasses.dataclass
class RolloutSlice:
    """One rollout replica: its devices and the engine whose arrays live on them."""

    index: int
    devices: tuple[Any, ...]
    engine: RolloutEngine
    state: SliceState = SliceState.IDLE

    def device_context(self):
        return jax.default_device(self.devices[0])


class _StopSignal(threading.Event):
    """The preemption signal, remembering whether the trainer saw it: a trainer is preempted
    when its `is_set()` check returns True, not when it merely is still running at the
    rollout's end (one that ended its loop on its own, out of data or steps, and is still
    returning then was counted as preempted, with a latency of its clean-up)."""

    def __init__(self):
        super().__init__()
        self.heeded = False

    def is_set(self) -> bool:
        seen = super().is_set()
        self.heeded = self.heeded or seen
        return seen

    def requested(self) -> bool:
        """Whether it is set, asked by the scheduler (not the trainer heeding it)."""
        return super().is_set()


class SpotTrainable(Protocol):
    """What the scheduler trains on an idle slice (`tlt_jax.rl.spot.SpotTrainer`).

    `exact_steps` > 0 asks for exactly that many steps per rollout: when no slice went idle
    while another decoded, the trainer runs after the rollout on the first slice that finished.
    Such a trainer is not preempted when the rollout ends; its `stop` is set only when the
    rollout fails.
    """

    exact_steps: int

    def ready(self) -> bool: ...

    def train_on(self, slice_: RolloutSlice, stop: threading.Event, on_step) -> int:
        """Drafter steps on `slice_` until `stop` is set (checked with `stop.is_set()` before
        each step: a check that finds it set is the preemption); calls `on_step(seconds,
        applied)` after each step (`applied=False`: dropped, e.g. non-finite); returns the
        steps applied."""
        ...


@dataclasses.dataclass(frozen=True)
class SliceEvent:
    """One interval of one slice's timeline, in seconds since the rollout started."""

    slice: int
    state: str
    start: float
    end: float


@dataclasses.dataclass
class SpotReport:
    """What happened on the slices during one rollout."""

    rollout_s: float
    finish_s: list[float]
    events: list[SliceEvent]
    trainer_slice: int | None = None
    drafter_steps: int = 0
    drafter_step_s: list[float] = dataclasses.field(default_factory=list)
    drafter_step_spans: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    # Steps the trainer ran and dropped (non-finite): no reclaimed time, no new drafter.
    dropped_step_spans: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    training_s: float = 0.0
    # Seconds from the rollout's end (the stop) until the trainer ended, when it was still
    # running then; None when there was nothing to preempt (no trainer, one that had stopped
    # on its own, or exact steps, which ignore the stop).
    preemption_latency_s: float | None = None
    trainer_failures: int = 0
    # Seconds from this process's start until the run's last process started its rollout
    # (several processes: before it a peer was still in the previous step, checkpointing or
    # plotting, and this process's finished slices waited for that, not for a straggler).
    window_start_s: float = 0.0
    # When the rollout started, in wall-clock seconds (`time.time()`, comparable across the
    # processes of one host; across hosts within NTP's skew).
    start_wall: float = 0.0

    @property
    def idle_slice_s(self) -> float:
        """Slice-seconds between a slice's last request and the rollout's end, from when every
        process's rollout had started."""
        return sum(max(0.0, self.rollout_s - max(t, self.window_start_s)) for t in self.finish_s)

    def _in_window(self, spans: Sequence[tuple[float, float]]) -> float:
        """Seconds of `spans` inside the idle window (not what a step ran past the rollout's
        end or before every process had started it), at most the idle slice-seconds."""
        return min(self.idle_slice_s, sum(max(0.0, min(b, self.rollout_s)
                                               - max(a, self.window_start_s))
                                           for a, b in spans))  # fmt: skip

    def metrics(self) -> dict[str, Any]:
        """The step record's spot fields. `spot_preemption_latency_s` is there only when a
        trainer was preempted (`spot_preempted_windows` counts those): a trainer that stopped
        on its own has no latency, and a 0 would read as an instant preemption."""
        idle = self.idle_slice_s
        # Reclaimed: idle slice-seconds inside applied drafter steps (not their set-up, not
        # dropped steps, which leave the drafter as it was).
        training = self._in_window(self.drafter_step_spans)
        out: dict[str, Any] = {
            "spot_slices": len(self.finish_s),
            "spot_idle_slice_s": idle,
            "spot_training_s": training,
            "spot_reclaimed_share": training / idle if idle > 0 else 0.0,
            "spot_drafter_steps": self.drafter_steps,
            "spot_dropped_steps": len(self.dropped_step_spans),
            "spot_dropped_s": self._in_window(self.dropped_step_spans),
            "spot_preempted_windows": int(self.preemption_latency_s is not None),
            "spot_trainer_failures": self.trainer_failures,
            "slice_finish_s": [round(t, 3) for t in self.finish_s],
            "spot_window_start_s": self.window_start_s,
        }
        if self.drafter_step_s:
            out["spot_drafter_step_s"] = sum(self.drafter_step_s) / len(self.drafter_step_s)
        if self.preemption_latency_s is not None:
            out["spot_preemption_latency_s"] = self.preemption_latency_s
        return out


class SpotScheduler:
    """Runs a rollout over the slices, handing the first idle slice drafter steps."""

    def __init__(self, slices: Sequence[RolloutSlice], trainable: SpotTrainable | None = None):
        if not slices:
            raise ValueError("SpotScheduler needs at least one rollout slice")
        devices = [d for s in slices for d in s.devices]
        if len(set(devices)) != len(devices):
            raise ValueError(f"rollout slices share devices: {[s.devices for s in slices]}")
        self.slices = list(slices)
        self.trainable = trainable

    def rollout(
        self, requests: Sequence[Sequence[Request]], *, progress: bool | None = None,
        group: ProcessGroup | None = None, step: int = 0,
    ) -> tuple[list[list[Completion]], SpotReport]:  # fmt: skip
        """Decodes `requests[i]` on slice i (all slices at once); returns the completions per
        slice (in request order) and the report.

        Args:
          requests: one request list per local slice.
          progress: a progress bar (single-slice runs only).
          group: the run's processes when it spans several: this process's slices are then
            some of the run's, the trainer role is claimed across processes (one canonical
            drafter), and the rollout ends when every process's slices are done.
          step: the RL step (names this rollout's keys in the coordination service).
        """
        multi = group is not None and group.count > 1
        if len(requests) != len(self.slices):
            raise ValueError(f"{len(requests)} request lists for {len(self.slices)} slices")
        try:
            for s, reqs in zip(self.slices, requests, strict=True):
                s.engine.validate(reqs)  # before any thread starts
        except Exception:
            if multi:  # the peers wait for this process's rollout (30 min): it failed
                group.set(f"start/{step}", time.time())
                group.set(f"done/{step}", {"failed": True})
            raise
        start, start_wall = time.perf_counter(), time.time()
        if len(self.slices) == 1 and not multi:  # nothing to overlap: decode in this thread
            s = self.slices[0]
            s.state = SliceState.BUSY
            out = s.engine.generate(requests[0], progress=progress)
            s.state = SliceState.IDLE
            end = time.perf_counter() - start
            return [out], SpotReport(end, [end], [SliceEvent(0, "busy", 0.0, end)],
                                     start_wall=start_wall)  # fmt: skip

        if multi:
            group.set(f"start/{step}", start_wall)
        results: list[list[Completion] | None] = [None] * len(self.slices)
        errors: list[BaseException | None] = [None] * len(self.slices)
        finished: queue.Queue = queue.Queue()

        def decode(i: int) -> None:
            s = self.slices[i]
            try:
                with s.device_context():
                    results[i] = s.engine.generate(requests[i], progress=False)
            except BaseException as e:  # re-raised by the controller
                errors[i] = e
            finally:
                finished.put((i, time.perf_counter() - start))

        threads = [threading.Thread(target=decode, args=(i,), name=f"slice{i}-decode",
                                    daemon=True) for i in range(len(self.slices))]  # fmt: skip
        for s in self.slices:
            s.state = SliceState.BUSY
        for t in threads:
            t.start()
        finish = [0.0] * len(self.slices)
        report = SpotReport(0.0, finish, [], start_wall=start_wall)
        stop = _StopSignal()
        trainer: threading.Thread | None = None
        train_span = [0.0, 0.0]
        stop_at = 0.0  # when the rollout's end set `stop` (seconds from `start`)

        # `stop` preempts a trainer when the rollout ends; `abort` when it fails (the only
        # stop an exact-steps trainer heeds).
        abort = threading.Event()

        def on_step(seconds: float, applied: bool = True) -> None:
            end = time.perf_counter() - start
            if applied:  # counted here: a trainer that fails later keeps the steps it applied
                report.drafter_step_s.append(seconds)
                report.drafter_step_spans.append((end - seconds, end))
                report.drafter_steps = len(report.drafter_step_s)
            else:
                report.dropped_step_spans.append((end - seconds, end))

        def train(i: int) -> None:
            s = self.slices[i]
            train_span[0] = time.perf_counter() - start
            try:
                with s.device_context():
                    self.trainable.train_on(s, abort if self.trainable.exact_steps else stop,
                                            on_step)  # fmt: skip
            except Exception:
                report.trainer_failures += 1
                log.warning("drafter training on slice %d failed; the rollout goes on with "
                            "the previous drafter", i, exc_info=True)  # fmt: skip
            finally:
                train_span[1] = time.perf_counter() - start

        try:
            remaining = len(self.slices)
            while remaining:
                i, t = finished.get()
                remaining -= 1
                finish[i] = t
                self.slices[i].state = SliceState.IDLE
                if errors[i] is not None:
                    stop.set()
                    abort.set()
                if multi and not remaining:  # this process's slices are all done
                    group.set(f"done/{step}", {"failed": any(e is not None for e in errors)})
                busy_elsewhere = remaining > 0 or (multi and not _all_done(group, step))
                if (busy_elsewhere and trainer is None and self.trainable is not None
                        and not stop.requested() and self.trainable.ready()
                        and (group is None or group.claim(f"trainer/{step}"))):  # fmt: skip
                    self.slices[i].state = SliceState.TRAINING
                    report.trainer_slice = i
                    trainer = threading.Thread(target=train, args=(i,), name=f"slice{i}-drafter",
                                               daemon=True)  # fmt: skip
                    trainer.start()
            peers_failed = []
            if multi:  # the rollout ends when the run's last slice is done
                for p in range(group.count):
                    if group.wait_for(f"done/{step}", p).get("failed") and p != group.index:
                        peers_failed.append(p)
            report.rollout_s = time.perf_counter() - start
            if multi:  # idle time counts from when the run's last process started
                last = max(group.wait_for(f"start/{step}", p) for p in range(group.count))
                report.window_start_s = min(max(0.0, last - start_wall), report.rollout_s)
            # Preempted: a trainer that heeds the stop (`_StopSignal.heeded`, read once it has
            # ended); the latency runs from here, where the stop is set (after the waits for
            # the run's processes, which are no trainer's doing).
            may_preempt = trainer is not None and not self.trainable.exact_steps
            stop_at = time.perf_counter() - start
            stop.set()
            if peers_failed:
                abort.set()
            if (trainer is None and self.trainable is not None and self.trainable.exact_steps
                    and not any(e is not None for e in errors) and not peers_failed
                    and self.trainable.ready()
                    and (group is None or group.claim(f"trainer/{step}"))):  # fmt: skip
                first = min(range(len(finish)), key=finish.__getitem__)
                report.trainer_slice = first
                trainer = threading.Thread(target=train, args=(first,), name="drafter-exact",
                                           daemon=True)  # fmt: skip
                trainer.start()
            if trainer is not None:
                trainer.join()
                # Training inside the idle window; what ran past the rollout's end is the latency.
                report.training_s = max(0.0, min(train_span[1], report.rollout_s) - train_span[0])
                if may_preempt and stop.heeded:
                    report.preemption_latency_s = max(0.0, train_span[1] - stop_at)
            for t in threads:
                t.join()
            for s in self.slices:
                s.state = SliceState.IDLE
        except BaseException:
            # A failed wait for a peer, a coordination-service error, Ctrl-C: the drafter
            # trainer stops at its next step boundary before the error leaves, so no thread
            # keeps training (and holding the drafter's lock) behind it. Decode threads cannot
            # be interrupted; they are daemons and end with their rollout.
            stop.set()
            abort.set()
            if trainer is not None:
                trainer.join(timeout=_TRAINER_JOIN_S)
                if trainer.is_alive():
                    log.warning("the drafter trainer did not stop within %.0f s of the "
                                "rollout's error", _TRAINER_JOIN_S)  # fmt: skip
            raise
        # Every slice is back at the step boundary once the trainer stopped.
        boundary = max(report.rollout_s, train_span[1])
        for i, t in enumerate(finish):
            name = self.slices[i].index
            report.events.append(SliceEvent(name, "busy", 0.0, t))
            if i == report.trainer_slice:
                if train_span[0] > t:  # an exact-steps trainer that started after the rollout
                    report.events.append(SliceEvent(name, "idle", t, train_span[0]))
                report.events.append(SliceEvent(name, "training", *train_span))
                tail = (train_span[1], boundary)
            else:
                tail = (t, boundary)
            if tail[1] > tail[0]:
                report.events.append(SliceEvent(name, "idle", *tail))
        failed = [e for e in errors if e is not None]
        if failed:
            raise failed[0]
        if peers_failed:  # their processes raise; this one must not wait for them downstream
            raise RuntimeError(f"step {step}: a rollout slice failed on process(es) "
                               f"{peers_failed} (their logs hold the error); stopping here "
                               "too")  # fmt: skip
        return results, report  # type: ignore[return-value]


def _all_done(group: ProcessGroup, step: int) -> bool:
    """Whether every process has reported its slices done for `step` (non-blocking)."""
    return group.count_set(f"done/{step}") == group.count
