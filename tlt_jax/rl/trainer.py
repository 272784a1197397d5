"""The RL loop: rollout -> reward -> advantages -> log-prob recompute -> update -> weight sync.

`Trainer` owns one run: the prompt iterator, the policy's rollout engine, the train state and
its compiled programs, checkpoints and metrics. Every phase of a step is timed on its own
(`time_rollout`, `time_reward`, `time_logprob`, `time_update`, `time_sync`), blocking on device
work at its end, so later work (speculative rollouts, drafter spot training) can be measured
against each phase; `time_host` is the rest of the step's wall time (`step_time`).

The policy's final-norm features of every sequence go to an optional `FeatureSink` (the
drafter buffer) from the forward the step runs anyway: the update's own (the gradient program
returns them) for the micro-batches it trains, the log-prob recompute's where one runs, and a
forward of their own only for micro-batches the update skips (no group with signal).

Rollouts are TLT's adaptive rollouts when `spec.mode != "off"`: the engine's step policy turns
speculative decoding on in the long tail and a bandit picks the draft source and strategy per
batch bucket (`tlt_jax.rollout.adaptive`); the engine and the trainer compile into one program
pool. Each step's record says what TLT did: the share of decode steps that ran SD, acceptance
length per draft source, arm choices per batch bucket, and the rollout time spent with at
most `threshold` requests running (`long_tail_share`).

Rollouts run over `RolloutSlices` (`tlt_jax.rl.rollout_slices`): one engine by default; with
`spot.slices > 1` or several `jax.distributed` processes, engine replicas on disjoint devices
decode at once, and with `spot.enabled` the first idle slice trains the online drafter (the
features of the step's forward fill its buffer) until the last slice is done; the new
drafter version reaches every slice in the `sync` phase. Across processes completions are
shared through the coordination service, the update is data-parallel (micro-batches dealt
round-robin, accumulators all-reduced; every process holds the whole train state), so is the
forward before it (each process recomputes the old and reference log-probs of the micro-batches
it trains; the drafter's features of them are all-reduced), and process 0 writes metrics,
checkpoints and exports.

Determinism: the request seeds of step k are a function of the run's RNG key (from `seed`,
checkpointed) and k only, and the data iterator's position is checkpointed, so a run resumed
from step k's checkpoint repeats the uninterrupted run's steps k + 1, ... exactly (CPU) with
plain rollouts or greedy ones. With SD at temperature > 0 it samples from the same
distributions (SD is lossless) but not the same tokens: which tokens a step samples depends on
its draft trees, that is on the bandit's arm choices (driven by measured step times) and on
the n-gram index of earlier responses (not checkpointed).
"""

from __future__ import annotations

import collections
import json
import logging
import time
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from tlt_jax.checkpointing.manager import RunCheckpointer
from tlt_jax.data.pipeline import PromptIterator, data_fingerprint, load_data
from tlt_jax.data.tokenizer import stop_token_ids
from tlt_jax.files import check_local_dir, write_text_atomic
from tlt_jax.metrics import timing
from tlt_jax.metrics.plots import (
    SLICE_TIMELINE_FILE,
    TIMELINE_FILE,
    plot_slice_timeline,
    save_timeline,
    write_plots,
)
from tlt_jax.metrics.progress import progress_bar
from tlt_jax.metrics.writer import MetricsWriter, read_metrics
from tlt_jax.parallel import sharding as sharding_lib
from tlt_jax.parallel.distributed import TIMEOUT_MS, ProcessGroup
from tlt_jax.programs import ProgramPool, abstract_like
from tlt_jax.rl import evaluation, packing, policy, rollout_slices, spot
from tlt_jax.rl import step as step_lib
from tlt_jax.rl.algorithms import compute_advantages
from tlt_jax.rl.config import TrainConfig, resolve_reward_fn
from tlt_jax.rl.resume import (
    check_resumed_data,
    check_resumed_drafter,
    check_resumed_drafter_fits,
    check_resumed_model,
    check_same_restore,
)
from tlt_jax.rl.rewards import RewardResult, score_batch
from tlt_jax.rollout.engine import Request
from tlt_jax.rollout.sampling import SamplingParams

log = logging.getLogger(__name__)


class FeatureSink(Protocol):
    """Receives what the log-prob recompute computed (e.g. `tlt_jax.drafter.data.DrafterBuffer`).

    Row i of `tokens` [N, W] is one sequence, its prompt then its response, right-padded;
    `features` [N, W, D] are the policy's final-norm features at the same positions,
    `response_mask` marks the response tokens and `valid_mask` the real ones.
    """

    def add(self, tokens, features, response_mask, step: int, valid_mask=None) -> int: ...


class NonFiniteLossError(FloatingPointError):
    """Raised after `rl.max_nonfinite_steps` consecutive steps with a non-finite loss."""


def rollout_seeds(rng_words: np.ndarray, step: int, count: int) -> np.ndarray:
    """Per-request uint32 seeds of step `step`: a function of (run key, step, request index)."""
    entropy = [int(w) for w in np.asarray(rng_words).reshape(-1)] + [int(step)]
    return np.random.SeedSequence(entropy).generate_state(count, dtype=np.uint32)


# The trainer's program kinds in the pool it shares with the rollout engine (key[0]).
TRAIN_PROGRAMS = ("logprob", "grad", "apply", "zeros")


class Trainer:
    """One RL run in `workdir`; resumes from the latest checkpoint there automatically."""

    def __init__(
        self,
        config: TrainConfig,
        workdir: str | Path,
        *,
        model=None,
        tokenizer=None,
        feature_sink: FeatureSink | None = None,
        progress: bool | None = None,
    ):
        """Loads data, model and tokenizer, builds the engine and train state, restores.

        Args:
          config: the validated run config.
          workdir: checkpoints, metrics and plots go here.
          model: a `Transformer` to train instead of `config.model`'s (tests); a resume is
            still checked against `config.model`.
          tokenizer: a tokenizer instead of `config.model`'s.
          feature_sink: receives tokens, features and masks of every recomputed sequence.
          progress: progress bars per phase (default: when stderr is a terminal).
        """
        self.config = cfg = config
        self.workdir = check_local_dir(workdir, "--workdir")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.sinks: list[FeatureSink] = [] if feature_sink is None else [feature_sink]
        self.progress = progress
        self.group = ProcessGroup()
        self.checkpointer = RunCheckpointer(
            self.workdir / "checkpoints", max_to_keep=cfg.checkpoint.max_to_keep,
            async_save=cfg.checkpoint.async_save, process_local=self.group.count > 1,
        )  # fmt: skip
        # First, a resume of another model or under another data config is refused (reads
        # only its config and weights fingerprint), then a missing data folder fails, all
        # before any model is loaded or compiled.
        try:
            self._weights = policy.weights_fingerprint(cfg.model)
            self._tokenizer_files = policy.tokenizer_fingerprint(cfg.model)
            check_resumed_model(self.checkpointer, cfg, self._weights,
                                tokenizer=self._tokenizer_files)  # fmt: skip
            self.data_files = data_fingerprint(cfg.data)
            data_changed = check_resumed_data(self.checkpointer, cfg, self.data_files)
            check_resumed_drafter(self.checkpointer, cfg)
            policy.check_spec_files(cfg.spec, cfg.model, spot=cfg.spot.enabled)
            self._train_examples = load_data(cfg.data, cfg.data.train_split)
            self.tokenizer = (tokenizer if tokenizer is not None
                              else policy.build_tokenizer(cfg.model))  # fmt: skip
            self.stop_ids = stop_token_ids(self.tokenizer)
            self.encode = policy.build_encoder(cfg, self.tokenizer)
            # Every train prompt is encoded, its length checked, once, before the model loads.
            questions = [ex["question"] for ex in self._train_examples]
            self._prompt_ids = dict(zip(questions, self.encode.encode_all(questions, "train "
                                        "split"), strict=True))  # fmt: skip
            # The evaluated prompts too (where this process evaluates: `run.train_and_evaluate`
            # on the primary): a long one failed the run's last evaluation, after every step.
            self._eval_examples: list[dict] | None = None
            evaluates = cfg.eval.at_start or cfg.eval.at_end
            if cfg.eval.num_problems > 0 and evaluates and self.group.is_primary:
                self._eval_examples = load_data(cfg.data, cfg.data.eval_split)
                self.encode.encode_all([ex["question"] for ex in
                                        self._eval_examples[:cfg.eval.num_problems]],
                                       f"{cfg.data.eval_split} split (evaluated)")  # fmt: skip
        except BaseException:
            self.checkpointer.close()  # its background threads would outlive the error
            raise
        self.iterator = PromptIterator(
            self._train_examples, cfg.rl.prompts_per_step, seed=cfg.data.seed
        )
        devices = rollout_slices.slice_devices(cfg, self.group)  # before any model loads

        self.mesh = policy.build_mesh(cfg.model)
        model = model if model is not None else policy.build_policy(cfg.model, self.mesh)
        if model.config.param_dtype != "float32":
            # optax keeps AdamW's moments and updates in the params' dtype: at bfloat16's 8
            # bits of mantissa an update under 1/256 of its weight rounds away (at lr 1e-6
            # on weights of 0.02, 98% of entries never moved in 10 steps).
            log.warning("training %s params (model.param_dtype=%r): most small optimizer "
                        "updates round away; set --config.model.param_dtype=float32 (compute "
                        "can stay in model.dtype)", model.config.param_dtype,
                        cfg.model.param_dtype or "(the model's)")  # fmt: skip
        context = None
        if self.mesh is not None:
            rules = sharding_lib.rules_for("train")
            context = lambda: sharding_lib.use_sharding(self.mesh, rules)  # noqa: E731
        self.pool = ProgramPool(context)  # the trainer's and slice 0's engine's programs
        self.rollouts = rollout_slices.RolloutSlices(cfg, model, self.pool, self.group, devices)
        self.online = self.rollouts.online
        if self.online is not None:
            self.sinks.append(self.online)
        # Micro-batches the update skips (groups with all-zero advantages) need a forward of
        # their own for their features: for a caller's sink, and for the online drafter's only
        # with `spot.silent_features` (the forward is on the step's critical path).
        self._silent_features = feature_sink is not None or (
            self.online is not None and cfg.spot.silent_features
        )
        self.engine = self.rollouts.engine
        self.slices = self.rollouts.slices
        self.graphdef = self.engine.graphdef
        self.reward_fn = resolve_reward_fn(cfg.rl.reward_fn)
        self.sampling = SamplingParams(
            cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k
        )
        self.row_len, self.max_rows = packing.run_geometry(cfg.rl, cfg.rollout,
                                                           cfg.model.mesh_shape[0])  # fmt: skip
        self.prefix_width = packing.prefix_width(cfg.rl, cfg.rollout)

        total_updates = cfg.total_steps * cfg.rl.num_minibatches
        self.optimizer = step_lib.make_optimizer(cfg.optim, total_updates)
        self.schedule = step_lib.learning_rate_schedule(cfg.optim, total_updates)
        self._to_train, self._to_rollout = policy.resharding_copies(self.engine.params, self.mesh)
        params = self._to_train(self.engine.params)
        # The frozen reference is the initial policy; kl_coef == 0 keeps none.
        self.reference_params = params if cfg.rl.algorithm.kl_coef else None
        if self.reference_params is not None:
            params = self._to_train(self.engine.params)
        # On a mesh the train state is laid out as the dry plan says (eval_shape: params with
        # train shardings, moments following them, scalars replicated), not as XLA infers.
        out = None if self.mesh is None else jax.tree.map(
            lambda x: x.sharding,
            policy.plan_run(cfg, self.engine.model_config, self.mesh).abstract_state)  # fmt: skip
        init = jax.jit(lambda p: step_lib.init_train_state(p, self.optimizer, cfg.seed),
                       out_shardings=out)  # fmt: skip
        self.state: step_lib.TrainState = init(params)

        self.restored_from: int | None = None
        # The step `precompile` compiled before (None: this process has not compiled).
        self.compiled_before_step: int | None = None
        drafter_like = None if self.online is None else self.online.state
        try:
            check_resumed_drafter_fits(self.checkpointer, cfg, drafter_like)
            restored = self.checkpointer.restore(self.state, drafter_like=drafter_like)
        except BaseException:
            self.checkpointer.close()
            raise
        check_same_restore(self.group, restored and restored.step, self.checkpointer.directory)
        if restored is not None:
            self.state = restored.state
            self.rollouts.load_drafter(restored.extra, restored.drafter, restored.drafter_buffer)
            position = restored.data_position
            if data_changed and int(position["index"]) > len(self._train_examples):
                log.warning("checkpoint data position %s is past the new train split's %d "
                            "examples: starting the next epoch", position,
                            len(self._train_examples))  # fmt: skip
                position = {**position, "epoch": int(position["epoch"]) + 1, "index": 0}
            self.iterator.restore(position)
            self.restored_from = restored.step
            changed = {k for k, v in cfg.to_dict().items() if restored.config.get(k) != v}
            if changed:
                log.warning("resuming step %d with changed config groups %s", restored.step,
                            sorted(changed))  # fmt: skip
            self.sync_weights()
        # Process 0 resolves (and measures, if it must) the threshold; every process decodes
        # under its value, so the slices' bandits see the same buckets.
        threshold = (policy.resolve_threshold(cfg, self.engine, self.workdir)
                     if self.group.is_primary else None)  # fmt: skip
        self.threshold = int(self.group.allgather("spec_threshold", threshold)[0])
        self.rollouts.install_step_policies(
            self.threshold,
            None if restored is None else rollout_slices.bandit_states(restored.extra),
        )
        self.step_count = int(jax.device_get(self.state.step))
        self._rng_words = np.asarray(jax.device_get(self.state.rng))
        # Process 0 writes the run's metrics, checkpoints, plots and exports.
        self.writer = MetricsWriter(self.workdir) if self.group.is_primary else None
        if self.writer is not None:
            self.writer.truncate_after(self.step_count)
        self._nonfinite_streak = 0
        self.between_steps_s = 0.0  # this process's seconds between steps (`train`)
        self._last_timeline: list = []
        self._after_rollout_s = 0.0
        self._plotted: tuple[int, list[Path]] | None = None  # (step, paths) last drawn
        self._feature_shape_cache: dict = {}

    # -- compilation ---------------------------------------------------------------------------

    def _put(self, tree):
        if self.mesh is None:
            return jax.device_put(tree)
        return jax.device_put(tree, NamedSharding(self.mesh, PartitionSpec()))

    def _programs(self, batch: step_lib.SequenceBatch | step_lib.PackedBatch, *,
                  logprob: bool = True):  # fmt: skip
        """(logprob, grad) programs for this batch's layout and shape, compiled on first use
        (the logprob one None unless `logprob`; the grad one returns features too when
        `_features_from_update`)."""
        cfg = self.config
        rows, cols = step_lib.response_mask(batch).shape
        if isinstance(batch, step_lib.PackedBatch):
            shape = ("packed", rows, cols)
        else:
            shape = ("padded", batch.prompt_tokens_PxS.shape[1], cols)
        temperature = float(cfg.rollout.temperature)
        params = abstract_like(self.state.params)
        batch_spec = abstract_like(batch)
        # Laid out as `_put` places them (the host-built loss inputs arrive replicated).
        replicated = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
        per_token = jax.ShapeDtypeStruct((rows, cols), jnp.float32, sharding=replicated)
        options = self._forward_options
        logprob_program = None
        if logprob:
            logprob_program = self.pool.get(("logprob", *shape), self._logprob_fn(),
                                            lambda: (params, batch_spec))  # fmt: skip
        features = self._features_from_update
        grad = self.pool.get(
            ("grad", *shape, *(("features",) if features else ())),
            step_lib.partial_program(step_lib.grad_program, self.graphdef,
                                     algorithm=cfg.rl.algorithm, temperature=temperature,
                                     options=options, on_policy=cfg.rl.on_policy_update,
                                     features=features),
            lambda: (params, step_lib.abstract_accumulator(self.state.params), batch_spec,
                     step_lib.LossInputs(*[per_token] * 6)),
            donate=(1,),
        )  # fmt: skip
        return logprob_program, grad

    @property
    def _forward_options(self) -> step_lib.ForwardOptions:
        return step_lib.ForwardOptions.of(self.config.rl, self.engine.model_config.num_layers)

    def _logprob_fn(self):
        """`logprob_program` with this run's graph, temperature and forward options bound."""
        return step_lib.partial_program(step_lib.logprob_program, self.graphdef,
                                        temperature=float(self.config.rollout.temperature),
                                        options=self._forward_options)  # fmt: skip

    @property
    def _forward_before_update(self) -> bool:
        """Whether a step runs the log-prob program over every micro-batch before its update:
        for the old log-probs (`rl.recompute_logprobs`) or the reference policy's."""
        return not self.config.rl.on_policy_update or self.reference_params is not None

    @property
    def _features_from_update(self) -> bool:
        """Whether the drafter sinks' features of trained micro-batches come out of the
        gradient program (no forward of their own): when no forward runs before the update."""
        return bool(self.sinks) and not self._forward_before_update

    def _zero_accumulator(self) -> dict:
        zeros = self.pool.get(("zeros",), step_lib.zero_accumulator,
                              lambda: (abstract_like(self.state.params),))  # fmt: skip
        return zeros(self.state.params)

    def _apply_program(self):
        fn = lambda state, accum: step_lib.apply_program(  # noqa: E731
            state, accum, optimizer=self.optimizer, schedule=self.schedule
        )
        # The accumulator is not donated: no output has its shape, so XLA could not reuse it.
        return self.pool.get(
            ("apply",), fn,
            lambda: (abstract_like(self.state),
                     step_lib.abstract_accumulator(self.state.params)),
            donate=(0,),
        )  # fmt: skip

    def precompile(self) -> list[dict[str, Any]]:
        """Compiles the train programs for the next batch's prompts and the longest responses,
        before the step runs; returns every program the shared pool holds by then (the
        rollout engine's so far too, by `role`) with its compile seconds and memory analysis
        (bytes of arguments, outputs, aliased and temporary buffers), also logged and written
        to `workdir/compile_report.json`."""
        cfg = self.config
        probe = PromptIterator(self._train_examples, cfg.rl.prompts_per_step,
                               seed=cfg.data.seed)  # fmt: skip
        probe.restore(self.iterator.state())
        examples = next(probe)
        groups = cfg.rl.micro_batch_size // cfg.rl.group_size
        prompts = [self.encode(ex["question"]) for ex in examples[:groups]]
        if cfg.rl.update_layout == "packed":
            # The full-size packed micro-batch (smaller row counts compile when first met).
            batch = packing.build_packed_batch([], self.max_rows, self.row_len, [], [],
                                               self.prefix_width,
                                               cfg.model.mesh_shape[0])[0]  # fmt: skip
        else:
            responses = [[0] * cfg.rollout.max_new_tokens] * (groups * cfg.rl.group_size)
            batch = step_lib.build_sequence_batch(
                prompts, responses, cfg.rl.group_size, min_bucket=cfg.rl.min_length_bucket,
                max_prompt=cfg.rollout.max_prompt_len, max_response=cfg.rollout.max_new_tokens,
            )  # fmt: skip
        # Micro-batches the update skips may still need a forward for their features.
        self._programs(self._put(batch),
                       logprob=self._forward_before_update or self._silent_features)  # fmt: skip
        self._apply_program()
        self.rollouts.precompile_drafter()
        # The pool is the engine's too: its programs so far (the evaluation's, the SD
        # calibration's) are in the report beside the train step's, each with its role.
        report = [{"program": "/".join(map(str, c.key)), "compile_s": round(c.seconds, 2),
                   "role": "train" if c.key[0] in TRAIN_PROGRAMS else "rollout", **c.memory}
                  for c in self.pool.compiled]  # fmt: skip
        for row in report:
            log.info("compiled %s", row)
        if self.group.is_primary:
            write_text_atomic(self.workdir / "compile_report.json", json.dumps(report, indent=1))
        self.compiled_before_step = self.step_count + 1
        return report

    # -- one step ------------------------------------------------------------------------------

    def make_requests(self, examples: list[dict], step: int) -> tuple[list, list[Request]]:
        """(prompt ids per example, G requests per prompt) of RL step `step`."""
        cfg, g = self.config, self.config.rl.group_size
        prompts = [self._prompt_ids.get(ex["question"]) or self.encode(ex["question"])
                   for ex in examples]  # fmt: skip
        seeds = rollout_seeds(self._rng_words, step, len(prompts) * g)
        requests = [Request(prompt, cfg.rollout.max_new_tokens, self.sampling, self.stop_ids,
                            seed=int(seeds[i * g + j]))
                    for i, prompt in enumerate(prompts) for j in range(g)]  # fmt: skip
        return prompts, requests

    def rollout(self, requests: list[Request], step: int, *, spot: bool = True):
        """`RolloutSlices.rollout`: (completions in request order, every process's stats)."""
        completions, stats = self.rollouts.rollout(requests, step, spot=spot,
                                                   progress=self.progress)  # fmt: skip
        self._last_timeline = self.rollouts.last_timeline
        return completions, stats

    def recompute_features(self, prompts, completions, step: int) -> None:
        """The log-prob recompute's forward over every sequence, its features to the sinks
        only (what `run_step` hands the drafter buffer, without the update)."""
        responses = [c.token_ids for c in completions]
        groups = np.ones((len(prompts),), bool)
        _, plan = packing.micro_batches(self.config.rl, self.config.rollout, prompts, responses,
                                        groups, include_silent=True,
                                        data=self.config.model.mesh_shape[0])  # fmt: skip
        for micro in (m for micros in plan for m in micros):
            batch = self._put(micro.batch)
            _, features = self._programs(batch)[0](self.state.params, batch)
            tokens, feats, response_mask, valid = micro.sink_rows(features)
            for sink in self.sinks:
                sink.add(tokens, feats, response_mask, step, valid_mask=valid)

    def run_step(self, examples: list[dict]) -> dict[str, Any]:
        """One RL step on a batch of prompts; returns its metrics record."""
        cfg, g = self.config, self.config.rl.group_size
        timer = timing.PhaseTimer()
        step = self.step_count + 1
        compiles_before, compile_s_before = self._compiles()
        prompts, requests = self.make_requests(examples, step)
        with timer.phase("rollout"):
            completions, rollout_stats = self.rollout(requests, step)
        with timer.phase("reward"):
            texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
                     for c in completions]  # fmt: skip
            answers = [str(ex["answer"]) for ex in examples for _ in range(g)]
            scored = self._score(step, texts, answers)
            rewards_PxG = scored.rewards.reshape(len(prompts), g)
            advantages = np.asarray(compute_advantages(cfg.rl.algorithm, rewards_PxG), np.float32)
            has_signal = np.any(advantages != 0, axis=1)
        responses = [c.token_ids for c in completions]
        needs_all = self._silent_features or cfg.rl.algorithm.kl_coef > 0
        minibatches, micro_plan = packing.micro_batches(
            cfg.rl, cfg.rollout, prompts, responses, has_signal, include_silent=needs_all,
            data=cfg.model.mesh_shape[0], processes=self.group.count,
            deal_silent=cfg.rl.algorithm.kl_coef > 0,  # as `_trains` deals them
        )  # fmt: skip
        flat = [(i, j) for i, micros in enumerate(micro_plan) for j in range(len(micros))]
        batches, old_logprobs, ref_logprobs = {}, {}, {}
        features: dict[tuple[int, int], Any] = {}  # the sinks', by micro-batch
        logprob_diffs = []
        recompute = not cfg.rl.on_policy_update
        forward = self._forward_before_update
        owners = self._owners(micro_plan)
        mine, others = [], []  # trained micro-batches whose forward ran here / on their owner
        forwards = 0  # micro-batches this process ran the log-prob program on
        with (
            timer.phase("logprob"),
            progress_bar(self.progress, "logprob", len(flat)) as bar,
        ):
            for key in flat:
                bar.update(1)
                micro = micro_plan[key[0]][key[1]]
                if not (needs_all or micro.trained):
                    continue
                batch = batches[key] = self._put(micro.batch)
                # Without a forward before the update, the update's gradient program yields
                # the features of what it trains; only a skipped micro-batch needs its own.
                if not (forward or (self.sinks and not self._trains(micro))):
                    continue
                # Only the process that trains a micro-batch needs its old and reference
                # log-probs; the sinks get its features from that process below.
                if owners.get(key, self.group.index) != self.group.index:
                    others.append(key)
                    continue
                if key in owners:
                    mine.append(key)
                forwards += 1
                logprob, _ = self._programs(batch)
                logprobs, feats = logprob(self.state.params, batch)
                if self.sinks:  # else not held: [rows, length, hidden] per micro-batch
                    features[key] = feats
                if recompute:
                    old_logprobs[key] = logprobs
                if self.reference_params is not None:
                    ref_logprobs[key] = logprob(self.reference_params, batch)[0]
            if self.sinks and self.group.count > 1 and (mine or others):  # the same on all
                features.update(self._share_features(features, mine, others, batches))
            jax.block_until_ready((old_logprobs, ref_logprobs, features))
        with timer.phase("update"):
            update = self._update(minibatches, micro_plan, batches, old_logprobs, ref_logprobs,
                                  advantages, responses, [c.logprobs for c in completions],
                                  features)  # fmt: skip
            # In micro-batch order, whichever program computed them (the same order, and on
            # every process the same values, as a forward over all of them would give).
            for key in flat if self.sinks else ():
                micro = micro_plan[key[0]][key[1]]
                if not (needs_all or micro.trained):
                    continue  # skipped above: no forward, no features (the padded layout)
                tokens, feats, response_mask, valid = micro.sink_rows(features[key])
                for sink in self.sinks:
                    sink.add(tokens, feats, response_mask, step, valid_mask=valid)
            if self.online is not None:  # its window moves on, also past a step that added none
                self.online.end_step(step)
        with timer.phase("sync"):
            self.sync_weights()
            # The drafter version trained during this rollout reaches every slice.
            drafter_metrics = self.rollouts.end_step(step, self.state.params)
        self.state = self.state.replace(step=self.state.step + 1)
        self.step_count = step
        for key, logprobs in old_logprobs.items():
            micro = micro_plan[key[0]][key[1]]
            engine_lp = [completions[b].logprobs for b in micro.response_ids]
            logprob_diffs.append(
                (key, step_lib.logprob_gap(micro.per_response(np.asarray(logprobs)), engine_lp))
            )
        if self.group.count > 1 and recompute:  # each process recomputed its own micro-batches
            gathered = self.group.allgather(f"logprob_diffs/{step}", logprob_diffs)
            logprob_diffs = sorted((tuple(k), gap) for part in gathered for k, gap in part)
        gap_sum = sum(total for _, (total, _) in logprob_diffs)
        gap_tokens = sum(count for _, (_, count) in logprob_diffs)
        # The busiest process's: every process runs the same silent ones, and the deal of the
        # trained ones is known everywhere (no collective needed).
        dealt = collections.Counter(owners[k] for k in mine + others)
        forwards += max(dealt.values(), default=0) - len(mine)

        # The sampler's log-probs against the trainer's: from the recompute, or (on-policy)
        # from the update's forward over the trained micro-batches.
        engine_gap = update.pop("engine_gap", 0.0)
        logprob_diff = gap_sum / gap_tokens if gap_tokens else engine_gap
        self._after_rollout_s = sum(v for k, v in timer.seconds.items() if k != "rollout")
        compiles_after, compile_s_after = self._compiles()
        lengths = [len(c.token_ids) for c in completions]
        generated = int(sum(lengths))
        rollout_s = timer.seconds["rollout"]
        record = {
            "step": step,
            "epoch": self.iterator.epoch,
            "reward_mean": float(scored.rewards.mean()),
            "reward_std": float(scored.rewards.std()),
            "accuracy": float(scored.correct.mean()),
            "groups_with_signal": float(has_signal.mean()),
            "advantage_abs_mean": float(np.abs(advantages).mean()),
            **update,
            **timing.length_stats(lengths),
            "truncated_share": float(np.mean([c.finish_reason == "length" for c in completions])),
            "generated_tokens": generated,
            "tokens_per_s": generated / rollout_s if rollout_s > 0 else 0.0,
            **spot.combine_rollout_stats(rollout_stats, cfg.spot.slices > 1),
            **drafter_metrics,
            "logprob_diff": logprob_diff,
            "logprob_forwards": forwards,
            "reward_errors": scored.num_errors,
            "reward_timeouts": scored.num_timeouts,
            **timer.metrics(),
            "compile_count": compiles_after - compiles_before,
            "compile_s": compile_s_after - compile_s_before,
            "response_lengths": lengths,
        }  # fmt: skip
        # Tokens per second of decoding, without the compiles inside the rollout (a short
        # run's first steps compile most of the engine's programs).
        decode_s = record["rollout_decode_s"]
        record["decode_tokens_per_s"] = generated / decode_s if decode_s > 0 else 0.0
        return record

    def _score(self, step: int, texts: list[str], answers: list[str]) -> RewardResult:
        """The rewards of this step's completions (every process holds all of them). With
        several processes, process 0 scores and the others take its scores: each scoring
        against its own clock, a reward function near `rl.reward_timeout_s` timed out on one
        process only, and the processes' advantages, micro-batch plans and micro-batch deals
        parted (mismatched collectives, or an update mixing two sets of advantages)."""
        cfg, key = self.config.rl, f"rewards/{step}"
        if self.group.count > 1 and not self.group.is_primary:
            # As long as process 0 may score (every completion up to its timeout).
            wait_ms = TIMEOUT_MS + int(len(texts) * cfg.reward_timeout_s * 1000)
            return RewardResult.from_json(self.group.wait_for(key, 0, timeout_ms=wait_ms))
        scored = score_batch(self.reward_fn, texts, answers, timeout_s=cfg.reward_timeout_s,
                             format_weight=cfg.format_weight)  # fmt: skip
        if self.group.count > 1:
            self.group.set(key, scored.to_json())
        return scored

    def _compiles(self) -> tuple[int, float]:
        """Programs compiled so far and their seconds: the trainer's pool (slice 0's engine
        included) and every other engine's."""
        count, seconds = self.rollouts.compiles(besides=self.pool)
        return self.pool.compile_count + count, self.pool.compile_seconds + seconds

    def _feature_shapes(self, batch):
        """The shapes of `logprob_program`'s (and the gradient program's) features of this
        batch's layout and shape (traced once per shape)."""
        key = tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(batch))
        if key not in self._feature_shape_cache:
            params, spec = abstract_like(self.state.params), abstract_like(batch)
            self._feature_shape_cache[key] = jax.eval_shape(self._logprob_fn(), params, spec)[1]
        return self._feature_shape_cache[key]

    def _trains(self, micro) -> bool:
        """Whether the update runs the gradient program on this micro-batch: an all-zero-
        advantage micro-batch has exactly zero policy gradient (skipped unless a KL term)."""
        return self.config.rl.algorithm.kl_coef > 0 or micro.trained

    def _owners(self, micro_plan) -> dict[tuple[int, int], int]:
        """The process that trains each trained micro-batch (by key): dealt round-robin in
        step order over the processes, the same on every process."""
        keys = [(i, j) for i, micros in enumerate(micro_plan)
                for j, micro in enumerate(micros) if self._trains(micro)]  # fmt: skip
        return {key: n % self.group.count for n, key in enumerate(keys)}

    def _share_features(self, features, mine, others, batches) -> dict:
        """Every process's features of the micro-batches in `mine` (computed here) and
        `others` (computed by their owners): an all-reduce of each owner's features and the
        other processes' zeros (exact), the same keys in the same order on every process."""
        local = {k: features[k] if k in mine else jax.tree.map(
            lambda x: jnp.zeros(x.shape, x.dtype), self._feature_shapes(batches[k]))
            for k in sorted(mine + others)}  # fmt: skip
        return self.group.allreduce_sum(local)

    def _update(self, minibatches, micro_plan, batches, old_logprobs, ref_logprobs, advantages,
                responses, engine_logprobs, features) -> dict[str, float]:  # fmt: skip
        """Gradient accumulation over micro-batches and one optimizer step per mini-batch.

        With `_features_from_update`, the features of every trained micro-batch go into
        `features` (by key); a micro-batch another process trained arrives through an
        all-reduce of the owner's features and zeros (exact), so every process's drafter
        buffer holds the same rows.

        Each token's loss weight is its aggregation weight over the whole mini-batch (silent
        groups count in the denominators even when their micro-batches are skipped), so the
        accumulated loss is the mini-batch's `policy_loss` exactly, in either layout.

        Across processes the update is data-parallel: the trained micro-batches of the step
        are dealt round-robin over the processes, each accumulates its own, and the
        accumulators are summed (an all-reduce) before every optimizer step, so every process
        applies the same update (only the order of the float sums differs from one process).
        """
        cfg, g = self.config, self.config.rl.group_size
        recompute = not cfg.rl.on_policy_update
        group = self.group
        owners = self._owners(micro_plan)
        apply = self._apply_program()
        advantages = np.asarray(advantages, np.float32).reshape(-1)
        pending = []  # each mini-batch's metrics, read back once every update is dispatched
        trained = computed = needed = 0
        num_micro = sum(len(m) for m in micro_plan)
        from_update = self._features_from_update
        mine, others = [], []  # trained micro-batches whose features this process computed / not
        with progress_bar(self.progress, "update", num_micro) as bar:
            for i, (groups, micros) in enumerate(zip(minibatches, micro_plan, strict=True)):
                loss_w, metric_w = packing.minibatch_weights(
                    cfg.rl.algorithm.loss_aggregation, groups, g, responses,
                    cfg.rl.algorithm.loss_norm_tokens,
                )  # fmt: skip
                accum = self._zero_accumulator()
                for j, micro in enumerate(micros):
                    bar.update(1)
                    key = (i, j)
                    if not self._trains(micro):
                        continue
                    if owners[key] != group.index:
                        if from_update:  # the owner's features, summed with these zeros
                            others.append(key)
                        continue
                    # Zeros only where the program reads none: on-policy (its own log-probs
                    # are the old ones) and without a KL term. A recomputed micro-batch's
                    # log-probs missing here is a bug, not a ratio of exp(log-prob).
                    zeros = np.zeros(micro.shape, np.float32)
                    inputs = self._put(step_lib.LossInputs(
                        old_logprobs[key] if recompute else zeros,
                        ref_logprobs[key] if self.reference_params is not None else zeros,
                        micro.per_token(advantages), micro.per_token(loss_w),
                        micro.per_token(metric_w), micro.token_values(engine_logprobs),
                    ))  # fmt: skip
                    _, grad = self._programs(batches[key], logprob=False)
                    accum = grad(self.state.params, accum, batches[key], inputs)
                    if from_update:
                        accum, features[key] = accum
                        mine.append(key)
                    trained += 1
                    computed += micro.computed
                    needed += micro.needed
                accum = group.allreduce_sum(accum)  # one process: a no-op
                self.state, applied = apply(self.state, accum)
                pending.append(({k: accum[k] for k in step_lib.ACCUMULATED_METRICS}, applied))
        # No metric is read back between mini-batches: the host never waits on the device
        # before dispatching the next mini-batch's gradient programs.
        totals = step_lib.combine_minibatch_metrics(jax.device_get(pending))
        if from_update and group.count > 1:
            features.update(self._share_features(features, mine, others, batches))
        if group.count > 1:
            counts = group.allgather(f"update_counts/{self.step_count + 1}",
                                     [trained, computed, needed])  # fmt: skip
            trained, computed, needed = (sum(c[k] for c in counts) for k in range(3))
        # Token positions the gradient programs computed that were not real prompt or
        # response tokens (each trained group's prompt counted once per step).
        totals["update_padding_share"] = 1.0 - needed / computed if computed else 0.0
        totals["update_tokens_computed"] = computed
        totals["micro_batches_trained"] = trained
        totals["micro_batches_total"] = num_micro
        return totals

    def sync_weights(self) -> None:
        """Pushes the train params into every slice's engine (checked: structure, shape, dtype,
        sharding); the online drafter goes at the step's end (`RolloutSlices.end_step`)."""
        self.rollouts.sync_policy(self.state.params, self._to_rollout)

    # -- the loop ------------------------------------------------------------------------------

    def train(self) -> list[dict[str, Any]]:
        """Runs steps until `total_steps`, checkpointing and plotting; returns the new records.

        Raises:
          NonFiniteLossError: after `rl.max_nonfinite_steps` consecutive non-finite losses; the
            updates were skipped and no checkpoint was written since the last finite step.
        """
        cfg = self.config
        records = []
        if self.step_count < cfg.total_steps:
            self.precompile()
        while self.step_count < cfg.total_steps:
            record = self.run_step(next(self.iterator))
            ended = time.perf_counter()
            try:
                self._after_step(record, records)
            finally:  # outside `step_time`: writing the record, checkpoints, plots
                self.between_steps_s += time.perf_counter() - ended
        self.checkpointer.wait()
        if records and cfg.spot.export and self.online is not None and self.group.is_primary:
            log.info("drafter exported to %s", self.export_drafter())
        return records

    def _after_step(self, record: dict[str, Any], records: list[dict[str, Any]]) -> None:
        """Writes and logs a step's record, checkpoints and plots at their intervals."""
        cfg = self.config
        if self.writer is not None:
            self.writer.write(record)
        records.append(record)
        step = record["step"]
        log.info("step %d: %s", step, _summary(record))
        if record["skipped"]:
            self._nonfinite_streak += 1
            log.warning("step %d: non-finite update (loss %s, grad_norm %s); skipped (%d in a "
                        "row)", step, record["loss"], record["grad_norm"],
                        self._nonfinite_streak)  # fmt: skip
            if self._nonfinite_streak >= cfg.rl.max_nonfinite_steps:
                self.checkpointer.wait()
                raise NonFiniteLossError(
                    f"{self._nonfinite_streak} consecutive non-finite updates (step {step}); "
                    f"stopping. Latest checkpoint: step {self.checkpointer.latest_step()} in "
                    f"{self.checkpointer.directory}"
                )
            if step == cfg.total_steps and self._params_finite():
                # A skipped update left the last finite weights: keep the steps since the
                # last checkpoint (the run ends here, so nothing else would save them).
                self.save()
            return
        self._nonfinite_streak = 0
        if step % cfg.checkpoint_every == 0 or step == cfg.total_steps:
            self.save()
        if step % cfg.plot_every == 0 or step == cfg.total_steps:
            self.plot()

    def _params_finite(self) -> bool:
        return bool(jnp.isfinite(optax.global_norm(self.state.params)))

    def save(self) -> None:
        """Writes the run checkpoint from process 0; every process calls it at the same step
        (their slices' bandit states reach process 0 first)."""
        bandits = self.rollouts.run_bandit_states(self.step_count)
        if not self.group.is_primary:
            return
        extra, drafter, buffer = self.rollouts.state_dict(bandits)
        self.checkpointer.save(self.step_count, self.state, self.iterator.state(),
                               self.config.to_dict(), extra, drafter=drafter,
                               drafter_buffer=buffer, weights=self._weights,
                               tokenizer=self._tokenizer_files,
                               data_files=self.data_files)  # fmt: skip

    def export_drafter(self) -> Path | None:
        """The online drafter as an HF-EAGLE directory (`workdir/drafter`); None without one."""
        return self.rollouts.export_drafter(self.workdir)

    def plot(self) -> list[Path]:
        """Per-step plots, and the last rollout's timeline (running requests, SD shaded).

        Drawn once per step: the run's end asks again after the last step drew them (5 s of a
        tiny run on this CPU, matplotlib's rendering)."""
        if not self.group.is_primary:
            return []
        if self._plotted is not None and self._plotted[0] == self.step_count:
            return list(self._plotted[1])
        out = self.workdir / "plots"
        paths = write_plots(read_metrics(self.workdir), out, cap=self.config.rollout.max_new_tokens)
        if self._last_timeline:
            # Slice 0's engine: with several slices, its own requests and its own tail (the
            # record's `long_tail_share` is the run's, over every slice).
            slices = self.config.spot.slices
            title = f"step {self.step_count} rollout" + (
                f", slice 0 of {slices} (its requests only)" if slices > 1 else ""
            )
            paths += save_timeline(self._last_timeline, self.rollouts.tail_threshold,
                                   out / TIMELINE_FILE,
                                   title=title)  # fmt: skip
        report = self.rollouts.last_report
        if report is not None and len(report.finish_s) > 1:  # this process's slices
            paths.append(plot_slice_timeline(
                report.events, out / SLICE_TIMELINE_FILE, after_s=self._after_rollout_s,
                title=f"step {self.step_count}: decode / idle / drafter training / update",
            ))  # fmt: skip
        self._plotted = (self.step_count, list(paths))
        return paths

    def evaluate(self, num_problems: int | None = None) -> evaluation.EvalResult:
        """Greedy accuracy of the engine's current weights on the first problems of the
        held-out split (`data.eval_split`)."""
        cfg = self.config
        if self._eval_examples is None:
            self._eval_examples = load_data(cfg.data, cfg.data.eval_split)
        n = cfg.eval.num_problems if num_problems is None else num_problems
        return evaluation.evaluate(
            self.engine, self.encode,
            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            self._eval_examples[:n], max_new_tokens=cfg.eval.max_new_tokens,
            stop_ids=self.stop_ids, reward_fn=self.reward_fn,
            reward_timeout_s=cfg.rl.reward_timeout_s, progress=self.progress,
        )  # fmt: skip

    def close(self) -> None:
        self.checkpointer.close()
        if self.writer is not None:
            self.writer.close()


def _summary(record: dict[str, Any]) -> str:
    keys = ("reward_mean", "accuracy", "loss", "response_len_mean", "step_time")
    return " ".join(f"{k}={record[k]:.3f}" for k in keys if k in record)
