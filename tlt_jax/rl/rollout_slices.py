"""The rollout side of an RL run: this process's slices, their engines, the spot scheduler and
the online drafter (`RolloutSlices`, owned by `tlt_jax.rl.trainer.Trainer`).

One slice (the default): one engine on the trainer's devices (its mesh, if any), decoding in
the calling thread. `spot.slices = R > 1`, or several processes: each process builds
`R / processes` engine replicas on disjoint local devices (`tlt_jax.rl.spot`), the scheduler
decodes them at once and, with `spot.enabled`, hands the first idle slice drafter steps. The
step boundary (`end_step`) makes the drafter version of this rollout every slice's (across
processes: broadcast from the process that trained it) and checks the processes agree.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from tlt_jax.drafter.online import OnlineDrafter
from tlt_jax.metrics import timing
from tlt_jax.parallel.distributed import ProcessGroup
from tlt_jax.parallel.scheduler import RolloutSlice, SpotScheduler
from tlt_jax.programs import ProgramPool
from tlt_jax.rl import policy
from tlt_jax.rl import spot as spot_lib
from tlt_jax.rl.config import TrainConfig
from tlt_jax.rollout.engine import Completion, Request

log = logging.getLogger(__name__)


def slice_devices(config: TrainConfig, group: ProcessGroup) -> list[tuple] | None:
    """This process's device groups, one per slice; None for the single-slice run. Checked
    before any model loads.

    Raises:
      ValueError: for slices with a model mesh, a slice count that the processes do not
        divide, or too few local devices (naming the XLA flag that makes CPU devices).
    """
    cfg = config
    if cfg.spot.slices == 1 and group.count == 1:
        return None
    if cfg.model.uses_mesh:
        raise ValueError(f"spot.slices={cfg.spot.slices} with model.mesh_shape="
                         f"{cfg.model.mesh_shape}: rollout slices are one device each in this "
                         "version; keep model.mesh_shape=(1, 1)")  # fmt: skip
    if cfg.spot.slices % group.count:
        raise ValueError(f"spot.slices={cfg.spot.slices} must be a multiple of the number of "
                         f"processes ({group.count}): every process runs the same number of "
                         "slices")  # fmt: skip
    groups = spot_lib.split_devices(jax.local_devices(), cfg.spot.slices // group.count)
    if len(groups[0]) > 1:
        log.warning("spot.slices=%d on %d process(es) of %d local devices: a slice runs on its "
                    "first device only in this version, so %d of this process's devices stay "
                    "unused; set spot.slices=%d to use them all", cfg.spot.slices, group.count,
                    len(jax.local_devices()), len(groups) * (len(groups[0]) - 1),
                    len(jax.local_devices()) * group.count)  # fmt: skip
    return groups


class RolloutSlices:
    """This process's rollout slices, scheduler and online drafter."""

    def __init__(self, config: TrainConfig, model, pool: ProgramPool, group: ProcessGroup,
                 devices: list[tuple] | None):  # fmt: skip
        """
        Args:
          config: the run config.
          model: the policy.
          pool: the trainer's program pool (slice 0's engine compiles into it).
          group: the run's processes.
          devices: `slice_devices(config, group)`.
        """
        self.config = cfg = config
        self.group = group
        drafter = policy.load_drafter(cfg.spec, model.config)
        self.online: OnlineDrafter | None = None
        if cfg.spot.enabled:
            self.online, drafter = _online_drafter(cfg, model.config, *drafter)
        build = lambda m, p: policy.build_engine(cfg, m, pool=p, drafter=drafter)  # noqa: E731
        if devices is None:
            engine = build(model, pool)
            own = tuple(jax.tree.leaves(engine.params)[0].devices())
            self.slices = [RolloutSlice(0, own, engine)]
        else:
            self.slices = spot_lib.build_slices(build, model, devices, pool,
                                                first_index=group.index * len(devices))  # fmt: skip
        trainable = None
        if self.online is not None:
            trainable = spot_lib.SpotTrainer(self.online, cfg.spot.max_steps_per_rl_step,
                                             cfg.spot.exact_steps_per_rl_step)  # fmt: skip
        self.scheduler = SpotScheduler(self.slices, trainable)
        self.threshold = 0
        self.last_timeline: list = []
        self.last_report = None

    @property
    def engine(self):
        """Slice 0's engine (evaluation, calibration)."""
        return self.slices[0].engine

    @property
    def tail_threshold(self) -> int:
        """Where the long tail is counted: at the SD threshold, or at
        `policy.REPORT_THRESHOLD` where that is 0 (calibrated SD never pays; counted at 0 the
        run reported no tail at all)."""
        return self.threshold or policy.REPORT_THRESHOLD

    @property
    def single(self) -> bool:
        return len(self.slices) == 1 and self.group.count == 1

    def install_step_policies(self, threshold: int, bandits: list[dict] | None) -> None:
        """TLT's step policy per slice (one bandit each, on its own random stream)."""
        self.threshold = threshold
        for s in self.slices:
            s.engine.step_policy = policy.build_step_policy(
                self.config, threshold, s.engine.drafter_params is not None, seed_offset=s.index
            )
            if bandits and s.index < len(bandits):
                s.engine.step_policy.load_state_dict(bandits[s.index])

    def precompile_drafter(self) -> None:
        """Compiles the online drafter's step for every slice that may train it."""
        if self.online is None:
            return
        embed = nnx.merge(self.engine.graphdef, self.engine.params).embed.get_value()
        for s in self.slices:
            seconds = self.online.precompile(s.devices[0], embed)
            log.info("compiled the drafter step for slice %d in %.1f s", s.index, seconds)

    def compiles(self, *, besides: ProgramPool | None = None) -> tuple[int, float]:
        """Programs the engines compiled and their seconds, but for those compiled into the
        pool `besides` (the trainer's, which counts them itself)."""
        stats = [s.engine.stats for s in self.slices if s.engine.pool is not besides]
        return sum(e.compile_count for e in stats), sum(e.compile_seconds for e in stats)

    # -- one rollout -----------------------------------------------------------------------

    def rollout(self, requests: list[Request], step: int, *, spot: bool = True,
                progress: bool | None = None) -> tuple[list[Completion], list[dict]]:  # fmt: skip
        """Decodes `requests` over the run's slices (this process decodes its share); returns
        the completions in request order and every process's rollout statistics (tail, SD
        counters, spot report). `spot=False` leaves idle slices idle (benchmarks)."""
        before = [_spec_counters(s.engine.stats) for s in self.slices]
        first = self.slices[0].index  # this process's slices among the run's
        parts = spot_lib.split_groups(requests, self.config.rl.group_size, self.config.spot.slices)
        parts = parts[first : first + len(self.slices)]
        scheduler = self.scheduler if spot else SpotScheduler(self.slices)
        per_slice, report = scheduler.rollout(
            [[requests[i] for i in idx] for idx in parts], progress=progress,
            group=self.group, step=step,
        )  # fmt: skip
        completions = spot_lib.gather_completions(self.group, step, per_slice, parts,
                                                  len(requests))  # fmt: skip
        # Copies: evaluate()'s generate clears the engines' timelines.
        self.last_timeline = list(self.engine.stats.timeline)
        self.last_report = report
        stats = self.group.allgather(f"rollout_stats/{step}", {
            "tail": [_tail(list(s.engine.stats.timeline), self.tail_threshold)
                     for s in self.slices],
            "spec": self._spec_metrics(before),
            "spot": report.metrics(),
            "start_wall": report.start_wall,
        })  # fmt: skip
        return completions, stats

    def _spec_metrics(self, before: list[dict]) -> dict[str, Any]:
        """This process's SD counters of the rollout (differences over its slices)."""
        now = [_spec_counters(s.engine.stats) for s in self.slices]
        pairs = list(zip(now, before, strict=True))
        sources = sorted({src for c in now for src in c["rows"]})
        choices: dict[str, int] = {}
        for s in self.slices:
            for arm, n in s.engine.step_policy.choice_counts().items():
                choices[arm] = choices.get(arm, 0) + n
        return {
            "spec": sum(a["spec"] - b["spec"] for a, b in pairs),
            "plain": sum(a["plain"] - b["plain"] for a, b in pairs),
            "rows": {k: sum(a["rows"].get(k, 0) - b["rows"].get(k, 0) for a, b in pairs)
                     for k in sources},
            "tokens": {k: sum(a["tokens"].get(k, 0) - b["tokens"].get(k, 0) for a, b in pairs)
                       for k in sources},
            "choices": choices,
            "threshold": self.threshold,
            "tail_threshold": self.tail_threshold,
        }  # fmt: skip

    # -- the step boundary -----------------------------------------------------------------

    def sync_policy(self, train_params, to_rollout) -> None:
        """The train params into every slice's engine (checked)."""
        if len(self.slices) == 1 and self.group.count == 1:
            params = to_rollout(train_params)
            jax.block_until_ready(params)
            self.engine.update_params(params)
        else:
            spot_lib.sync_policy(train_params, self.slices)

    def end_step(self, step: int, train_params) -> dict[str, Any]:
        """Publishes the drafter version trained during this step's rollout (from the process
        that trained it, across processes) and checks the processes hold the same params."""
        metrics: dict[str, Any] = {}
        if self.online is not None:
            if self.group.count > 1:
                spot_lib.sync_drafter_across(self.group, step, self.online)
            metrics = spot_lib.publish_drafter(self.online, self.slices)
        if self.group.count > 1:
            # The drafter's buffer too: whichever process trains next samples from its own.
            metrics["processes_in_sync"] = spot_lib.processes_in_sync(
                self.group, step, train_params,
                *(() if self.online is None else (self.online.params(),
                                                  self.online.buffer.to_arrays())),
            )  # fmt: skip
            if not metrics["processes_in_sync"]:  # every process sees the same digests
                raise RuntimeError(
                    f"step {step}: the processes' policy or drafter params differ (compared by "
                    "digest); data-parallel steps on different weights would train wrongly from "
                    "here on. The last checkpoint holds the last step they agreed on."
                )
            self.group.end_step()  # after the digests: every process finished the step before
        # The sync phase ends when every slice holds its new weights: the copies to each
        # slice's devices and the engines' per-layer copies are asynchronous, and would
        # otherwise land in the next rollout's first steps.
        jax.block_until_ready([(s.engine.params, s.engine.layers, s.engine.drafter_params)
                               for s in self.slices])  # fmt: skip
        return metrics

    # -- checkpoints and export ------------------------------------------------------------

    def run_bandit_states(self, step: int) -> list[dict]:
        """Every slice's bandit state in run-wide slice order, from every process (a
        collective: each process calls it at the same step)."""
        mine = [[s.index, s.engine.step_policy.state_dict()] for s in self.slices]
        every = [pair for part in self.group.allgather(f"bandits/{step}", mine) for pair in part]
        return [state for _, state in sorted(every, key=lambda pair: pair[0])]

    def state_dict(self, bandits: list[dict]) -> tuple[dict[str, Any], Any, dict | None]:
        """(host state for the checkpoint's `extra`, the drafter's train state or None, its
        buffer's recent samples or None: absent, or over `spot.checkpoint_buffer_mb`).
        `bandits`: every slice's, run-wide (`run_bandit_states`)."""
        extra: dict[str, Any] = {"bandit": bandits[0], "bandits": bandits}
        if self.online is None:
            return extra, None, None
        extra["drafter"] = self.online.state_dict()
        limit = self.config.spot.checkpoint_buffer_mb * 2**20
        buffer = self.online.buffer.to_arrays(max_bytes=limit) if limit else None
        if buffer is None and limit and self.online.buffer.recent_samples():
            log.warning("drafter buffer over spot.checkpoint_buffer_mb=%d: left out of the "
                        "checkpoint; a resumed run's first step trains on nothing",
                        self.config.spot.checkpoint_buffer_mb)  # fmt: skip
        return extra, self.online.state, buffer

    def load_drafter(self, extra: dict[str, Any], drafter_state, buffer=None) -> None:
        """Restores the online drafter (and its buffer, when the checkpoint holds it) and
        hands it to every slice."""
        if self.online is not None and drafter_state is not None:
            self.online.load_state_dict(extra["drafter"], drafter_state)
            if buffer is not None:
                self.online.buffer.load_arrays(buffer)
            spot_lib.push_drafter(self.online, self.slices)

    def export_drafter(self, workdir: Path) -> Path | None:
        """Writes the online drafter as an HF-EAGLE directory (`workdir/drafter`, with its
        `hot_vocab.json`) that `generate.py --drafter` and `spec.drafter` load."""
        if self.online is None:
            return None
        from tlt_jax.drafter.export import export_eagle
        from tlt_jax.drafter.hot_vocab import save_hot_vocab

        out = export_eagle(self.online.params(), self.engine.model_config, workdir / "drafter")
        if self.online.token_counts.any():
            save_hot_vocab(out, self.online.token_counts)
        return out


def bandit_states(extra: dict[str, Any]) -> list[dict] | None:
    """The per-slice bandit states of a checkpoint's `extra` (older ones hold one)."""
    if extra.get("bandits"):
        return extra["bandits"]
    return [extra["bandit"]] if extra.get("bandit") else None


def _spec_counters(stats) -> dict[str, Any]:
    return {"spec": stats.spec_steps, "plain": stats.decode_steps,
            "rows": dict(stats.spec_rows_by_source),
            "tokens": dict(stats.spec_tokens_by_source)}  # fmt: skip


def _online_drafter(cfg: TrainConfig, target, drafter, hot):
    """The online drafter (warm from `spec.drafter` when set, else a random init) and the
    engines' `(Drafter, hot ids)`."""
    from tlt_jax.models.drafter import drafter_from_params

    hot_vocab = cfg.spec.hot_vocab if cfg.spec.hot_vocab < target.vocab_size else 0
    # One sample per response: the window's steps' every response fits (a fixed 2,000 dropped
    # part of the window from 1,000 responses a step on, without a word).
    window = cfg.spot.buffer_steps * cfg.rl.prompts_per_step * cfg.rl.group_size
    online = OnlineDrafter(
        target, cfg.spot.train_config(), hot_vocab=hot_vocab, seed=cfg.seed,
        params=None if drafter is None else drafter.params_dict(), max_samples=window,
    )  # fmt: skip
    if hot is not None and hot_vocab and len(hot) == hot_vocab:
        online.hot_ids = np.asarray(hot, np.int32)
    return online, (drafter_from_params(target, online.params()), online.hot_ids)


def _tail(timeline: list[tuple], threshold: int) -> dict[str, Any]:
    """One slice's `timing.tail_stats` and its (seconds, running) timeline on the clock
    without compiles (as the stats are), which `spot.combine_rollout_stats` merges over every
    process's slices."""
    return {
        **timing.tail_stats(timeline, threshold),
        "timeline": [
            (round(float(row[0]), 6), int(row[1])) for row in timing.without_compiles(timeline)
        ],
    }
