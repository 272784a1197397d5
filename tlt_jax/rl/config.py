"""Typed, validated configuration of an RL run, built from an ml_collections ConfigDict.

`TrainConfig.from_config_dict` is the only place a `ConfigDict` is read: every group becomes a
frozen dataclass validated in `__post_init__`, so a bad value fails before anything loads or
compiles, with a message naming the flag (`rl.group_size=1 ...`) and the allowed values. Groups:

- `model`: which policy (a checkpoint, or a random preset for tests), tokenizer, dtypes, mesh.
- `rl`: batch geometry (prompts, group size, micro-batches), reward, and the algorithm
  (`tlt_jax.rl.algorithms.AlgorithmConfig` fields, flat in the same group).
- `data`: `tlt_jax.data.pipeline.DataConfig`.
- `optim`: AdamW, gradient clipping, learning-rate schedule.
- `rollout`: sampling and engine sizes.
- `spec`: TLT's adaptive speculative rollout (`SpecConfig`).
- `eval`: held-out evaluation before / after training.
- `checkpoint`: orbax retention and async saves.
- `spot`: rollout slices and the spot-trained drafter (`tlt_jax.rl.spot.SpotConfig`).

Top level: `total_steps`, `checkpoint_every`, `seed`, `plot_every`.

Config files start from `default_config_dict()` (every field at its default) and override
what their run needs, so a field added here reaches every config.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any

import ml_collections

from tlt_jax.config_fields import is_int as _is_int
from tlt_jax.config_fields import placeholder
from tlt_jax.data.pipeline import DataConfig
from tlt_jax.models.config import DTYPES
from tlt_jax.models.presets import PRESETS
from tlt_jax.optim import OptimConfig
from tlt_jax.programs import check_opt_level
from tlt_jax.rl import algorithms
from tlt_jax.rl.algorithms import AlgorithmConfig
from tlt_jax.rl.rewards import REWARD_FUNCTIONS, RewardFunction
from tlt_jax.rl.spot import SpotConfig
from tlt_jax.rollout.adaptive import DRAFT_SOURCES, BanditConfig

TOKENIZERS = ("checkpoint", "byte")
UPDATE_LAYOUTS = ("packed", "padded")


def resolve_reward_fn(name: str) -> RewardFunction:
    """A registered reward function (`REWARD_FUNCTIONS` key) or one named `module.path:function`.

    Raises:
      ValueError: naming the registered functions when `name` is neither.
    """
    if name in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[name]
    module_name, _, attribute = name.partition(":")
    fn = None
    if module_name and attribute:
        try:
            fn = getattr(importlib.import_module(module_name), attribute, None)
        except ImportError:
            fn = None
    if not callable(fn):
        raise ValueError(
            f"rl.reward_fn={name!r} is not one of {sorted(REWARD_FUNCTIONS)} nor an importable "
            "'module.path:function'"
        )
    return fn


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _positive_int(group: str, name: str, value: Any, minimum: int = 1) -> None:
    _require(
        _is_int(value) and value >= minimum,
        f"{group}.{name}={value!r} must be an integer >= {minimum}",
    )


def _finite_at_least(group: str, name: str, value: Any, minimum: float) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    _require(
        ok and math.isfinite(value) and value >= minimum,
        f"{group}.{name}={value!r} must be a finite number >= {minimum}",
    )


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """The `model` group.

    Attributes:
      name: checkpoint: HF directory, .gguf file or short name (`smollm2-135m-instruct`).
      preset: instead of `name`, a random-init preset from `tlt_jax.models.presets` (tests).
      tokenizer: `checkpoint` (the checkpoint's HF tokenizer) or `byte` (`ByteTokenizer`).
      dtype / param_dtype: override the compute / parameter dtype ("" keeps the model's).
      mesh_shape: (data, tensor) device mesh; (1, 1) runs on one device without a mesh.
      init_seed: seed of a preset's random initialisation.
      architecture: optional preset naming the checkpoint's architecture: a loaded checkpoint
        must match it, and dry plans (`plan_run`) use it where the weights are not present.
    """

    name: str = ""
    preset: str = ""
    architecture: str = ""
    tokenizer: str = "checkpoint"
    dtype: str = ""
    param_dtype: str = ""
    mesh_shape: tuple[int, int] = (1, 1)
    init_seed: int = 0

    def __post_init__(self):
        shape = tuple(self.mesh_shape)
        _require(
            len(shape) == 2 and all(_is_int(s) and s >= 1 for s in shape),
            f"model.mesh_shape={self.mesh_shape!r} must be two positive integers (data, tensor)",
        )
        object.__setattr__(self, "mesh_shape", tuple(int(s) for s in shape))
        _require(
            bool(self.name) != bool(self.preset),
            f"model.name={self.name!r} and model.preset={self.preset!r}: set exactly one "
            "(a checkpoint, or a random-init preset)",
        )
        for name in ("preset", "architecture"):
            value = getattr(self, name)
            _require(
                value == "" or value in PRESETS,
                f"model.{name}={value!r} is not one of {sorted(PRESETS)}",
            )
        _require(
            self.tokenizer in TOKENIZERS,
            f"model.tokenizer={self.tokenizer!r} is not one of {list(TOKENIZERS)}",
        )
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            _require(
                value == "" or value in DTYPES,
                f"model.{name}={value!r} is not one of {['', *DTYPES]} ('' keeps the model's)",
            )
        _positive_int("model", "init_seed", self.init_seed, minimum=0)
        _require(self.init_seed < 2**32, f"model.init_seed={self.init_seed} must be < 2**32 "
                 "(JAX's keys take 32 bits: larger seeds alias smaller ones)")  # fmt: skip

    @property
    def uses_mesh(self) -> bool:
        return self.mesh_shape != (1, 1)

    def dtype_overrides(self) -> dict[str, str]:
        return {k: getattr(self, k) for k in ("dtype", "param_dtype") if getattr(self, k)}


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """The `rl` group: batch geometry, reward, and the algorithm.

    Attributes:
      prompts_per_step: prompts sampled per RL step (P).
      group_size: completions per prompt (G); the batch has P * G sequences.
      micro_batch_size: sequences per forward/backward (whole groups: a multiple of G that
        divides the batch); gradients are accumulated over micro-batches.
      num_minibatches: optimizer updates per RL step (PPO mini-batches of whole micro-batches).
      reward_fn: key of `tlt_jax.rl.rewards.REWARD_FUNCTIONS`, or `module.path:function` for a
        custom `fn(completion, answer) -> float`.
      format_weight: weight of the format reward added to the task reward.
      reward_timeout_s: per-completion reward time limit.
      max_nonfinite_steps: stop after this many consecutive non-finite losses (K).
      min_length_bucket: smallest padded prompt / response length; lengths pad to powers of two
        from here, so the train programs compile for a few shapes only.
      update_layout: token layout of the log-prob recompute and the update: "packed" (rows of
        prompt + responses end to end, segment masks, computing about the real tokens; the
        same token budget per micro-batch as a padded one at its longest) or "padded"
        (`micro_batch_size` sequences, each padded to the micro-batch's longest response).
      share_prompts: packed layout: a group whose responses spill into another row of the
        micro-batch (and data shard) reads its prompt's keys and values from the row that
        holds it instead of repeating the prompt (`packing.share_prompt_rows`; each row then
        attends to `rollout.max_prompt_len` more keys).
      algorithm: advantage estimator, loss aggregation, clipping and KL (flat in the group).
      remat: recompute each layer in the backward pass (long responses: activations of one
        layer instead of all); None per backend (`step.default_remat`: on for CPU policies of
        >= 8 layers, where it halves the update's time; off on accelerators).
      attention_chunk: queries per attention block in the train programs (0: all at once;
        else a power of two: a row's blocks are gcd(row length, chunk) long); no [len, len]
        scores or mask are then live beyond one block's.
      logits_chunk: positions along a row per LM-head block in the train programs (0: all
        at once; a block is every row's `logits_chunk` positions); None per backend
        (`step.default_logits_chunk`: 32 on CPU, where the gradient program runs 1.02-1.14x
        faster, 0 elsewhere).
      recompute_logprobs: run the log-prob recompute (a forward over every sequence) before
        the update, for the importance ratio's old log-probs. None: only when a step has
        several mini-batches (the later ones are off-policy). With one mini-batch the policy
        that sampled is the one updated, so the gradient program takes its own log-probs
        without gradient (ratio exactly 1, the same update) and the step skips that forward;
        the sampler/trainer mismatch is still measured (`logprob_diff`, in the update).
    """

    prompts_per_step: int = 8
    group_size: int = 8
    micro_batch_size: int = 16
    num_minibatches: int = 1
    reward_fn: str = "math_accuracy"
    format_weight: float = 0.0
    reward_timeout_s: float = 5.0
    max_nonfinite_steps: int = 3
    min_length_bucket: int = 16
    update_layout: str = "packed"
    share_prompts: bool = True
    algorithm: AlgorithmConfig = AlgorithmConfig()
    remat: bool | None = None
    attention_chunk: int = 0
    logits_chunk: int | None = None
    recompute_logprobs: bool | None = None

    def __post_init__(self):
        _positive_int("rl", "prompts_per_step", self.prompts_per_step)
        _positive_int("rl", "group_size", self.group_size, minimum=2)
        _positive_int("rl", "micro_batch_size", self.micro_batch_size)
        _positive_int("rl", "num_minibatches", self.num_minibatches)
        _positive_int("rl", "max_nonfinite_steps", self.max_nonfinite_steps)
        _positive_int("rl", "min_length_bucket", self.min_length_bucket)
        for name in ("attention_chunk", "logits_chunk"):
            value = getattr(self, name)
            if value is None:  # logits_chunk: per backend
                continue
            _positive_int("rl", name, value, minimum=0)
            # A row splits into blocks of gcd(row length, chunk) positions: with a chunk of 3
            # an even row went one position at a time. Row lengths are multiples of
            # min_length_bucket, so a power of two keeps the blocks as large as they divide.
            _require(value & (value - 1) == 0, f"rl.{name}={value} must be 0 or a power of two "
                     "(a row's blocks are gcd(row length, chunk) positions long)")  # fmt: skip
        _require(
            self.remat is None or isinstance(self.remat, bool),
            f"rl.remat={self.remat!r} must be true, false or unset (None: per backend)",
        )
        _require(
            self.recompute_logprobs is None or isinstance(self.recompute_logprobs, bool),
            f"rl.recompute_logprobs={self.recompute_logprobs!r} must be true, false or unset",
        )
        _require(
            self.recompute_logprobs is not False or self.num_minibatches == 1,
            f"rl.recompute_logprobs=False with rl.num_minibatches={self.num_minibatches}: "
            "mini-batches after the first are off-policy and need the sampling policy's "
            "log-probs; expected rl.recompute_logprobs true or unset",
        )
        _require(self.update_layout in UPDATE_LAYOUTS,
                 f"rl.update_layout={self.update_layout!r} is not one of "
                 f"{list(UPDATE_LAYOUTS)}")  # fmt: skip
        batch = self.batch_size
        _require(
            self.micro_batch_size % self.group_size == 0 and batch % self.micro_batch_size == 0,
            f"rl.micro_batch_size={self.micro_batch_size} must be a multiple of "
            f"rl.group_size={self.group_size} that divides the batch "
            f"rl.prompts_per_step * rl.group_size = {batch}; allowed: "
            f"{[m for m in range(self.group_size, batch + 1, self.group_size) if batch % m == 0]}",
        )
        micro_batches = batch // self.micro_batch_size
        _require(
            micro_batches % self.num_minibatches == 0,
            f"rl.num_minibatches={self.num_minibatches} must divide the {micro_batches} "
            f"micro-batches per step; allowed: "
            f"{[n for n in range(1, micro_batches + 1) if micro_batches % n == 0]}",
        )
        resolve_reward_fn(self.reward_fn)
        _finite_at_least("rl", "format_weight", self.format_weight, 0.0)
        _finite_at_least("rl", "reward_timeout_s", self.reward_timeout_s, 1e-3)

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def on_policy_update(self) -> bool:
        """Whether the update takes the old log-probs as its own (no recompute before it)."""
        if self.recompute_logprobs is None:
            return self.num_minibatches == 1
        return not self.recompute_logprobs


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """The `rollout` group: sampling of training completions and the engine's sizes.

    Attributes:
      temperature: sampling temperature (> 0: the G samples of a group must differ).
      top_p / top_k: nucleus and top-k truncation (1.0 / 0 disable them). top_k = 1 samples
        the argmax (a group's samples alike, their advantages zero): kept for determinism
        checks, which compare SD and plain rollouts token for token.
      max_new_tokens: response length limit.
      max_prompt_len: longest prompt accepted (tokens); sizes the engine's context.
      max_batch_size: engine slots (requests decoded together).
      max_prefill_batch: prompts prefilled per program call.
      min_prompt_bucket: smallest padded prompt length of the engine's prefill (buckets double
        from here up to the context); `max_prompt_len` gives one bucket, tight for prompts of
        similar length.
      layers_per_program: layers per compiled program of the engine's decode and verify
        steps' first tier (`EngineConfig.layers_per_program`): 0 one program per step from
        the start, None per backend (one program per layer on CPU for policies of >= 8
        layers: a bucket's first steps compile in less than half the time, 5-15% slower).
      xla_opt_level: XLA's backend optimisation level of the engine's programs
        (`EngineConfig.xla_opt_level`); None per backend (1 on CPU unless XLA_FLAGS sets it:
        they compile 5-12% faster than at XLA's 2 and decode as fast; XLA's default
        elsewhere). The trainer's programs keep XLA's default.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    max_prompt_len: int = 256
    max_batch_size: int = 64
    max_prefill_batch: int = 8
    min_prompt_bucket: int = 16
    layers_per_program: int | None = None
    xla_opt_level: int | None = None

    def __post_init__(self):
        if self.layers_per_program is not None:
            _positive_int("rollout", "layers_per_program", self.layers_per_program, minimum=0)
        check_opt_level(self.xla_opt_level, "rollout.xla_opt_level")
        _require(
            isinstance(self.temperature, int | float) and 0 < self.temperature < math.inf,
            f"rollout.temperature={self.temperature!r} must be finite and > 0 (greedy groups "
            "have identical samples and zero advantages; an infinite one samples uniformly)",
        )
        _require(0 < self.top_p <= 1, f"rollout.top_p={self.top_p!r} must be in (0, 1]")
        _positive_int("rollout", "top_k", self.top_k, minimum=0)
        for name in (
            "max_new_tokens",
            "max_prompt_len",
            "max_batch_size",
            "max_prefill_batch",
            "min_prompt_bucket",
        ):
            _positive_int("rollout", name, getattr(self, name))


SPEC_MODES = ("off", "adaptive", "always")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """The `spec` group: TLT's adaptive speculative rollout (DESIGN.md section 4).

    Attributes:
      mode: `off` (plain decoding), `adaptive` (SD in the tail: after `warmup_steps`
        consecutive steps with at most `threshold` requests running, the bandit picks SD or
        plain per step; off again when the batch grows) or `always` (SD at every step, the
        bandit choosing among SD arms only; for tests and benchmarks).
      drafter: an HF-EAGLE export (`train_drafter.py`) for EAGLE and hybrid drafts; "" runs
        model-free (n-gram) drafts only.
      hot_vocab: draft over the drafter dir's `hot_vocab.json` top ids (0: the full head).
      draft_sources: comma-separated subset of eagle, ngram, hybrid; `auto`: all three with a
        drafter, ngram without.
      attention_impl: `xla` or `pallas` for the SD programs.
      threshold: most running requests SD is tried at; 0 takes it from `calibration_file`,
        or calibrates at start (`tlt_jax.rollout.calibrate`) when that is "".
      calibration_file: JSON written by `scripts/calibrate_spec.py`.
      max_cost_ratio: with `threshold` 0, the bound on the calibrated verify / plain step cost
        that sets the threshold (the largest batch bucket below it); 0 keeps the calibration
        file's threshold (its own bound, 2.0 by default) or calibrates with 2.0. Set it to
        about the acceptance length the run's drafts reach (tokens per verify step): SD
        cannot pay where a verify step costs more plain steps than it emits tokens.
      warmup_steps: N consecutive steps at or under the threshold before SD turns on.
      bucket_bounds: BEG bucket lower bounds t_i (buckets [t_i, t_{i+1})).
      strategies: per bucket, '|'-separated 'depth,topk,verify' strategies of one verify budget.
      epsilon / window: the bandit's exploration probability and reward window.
      epsilon_decay: shrink epsilon per batch bucket as it gathers steps (`BanditConfig`).
    """

    mode: str = "off"
    drafter: str = ""
    hot_vocab: int = 2048
    draft_sources: str = "auto"
    attention_impl: str = "xla"
    threshold: int = 0
    calibration_file: str = ""
    max_cost_ratio: float = 0.0
    warmup_steps: int = 10
    bucket_bounds: tuple[int, ...] = (1, 2, 5, 9)
    strategies: tuple[str, ...] = ("4,1,5", "3,1,4", "2,1,3", "1,1,2")
    epsilon: float = 0.1
    window: int = 300
    epsilon_decay: bool = True

    def __post_init__(self):
        # Checked as given (`bandit()` below): int() truncated 2.5 to 2.
        object.__setattr__(self, "bucket_bounds", tuple(self.bucket_bounds))
        object.__setattr__(self, "strategies", tuple(str(s) for s in self.strategies))
        _require(self.mode in SPEC_MODES,
                 f"spec.mode={self.mode!r} is not one of {list(SPEC_MODES)}")  # fmt: skip
        _positive_int("spec", "hot_vocab", self.hot_vocab, minimum=0)
        _positive_int("spec", "threshold", self.threshold, minimum=0)
        _require(isinstance(self.max_cost_ratio, (int, float)) and self.max_cost_ratio >= 0,
                 f"spec.max_cost_ratio={self.max_cost_ratio!r} must be a number >= 0 "
                 "(0: the calibration's own bound)")  # fmt: skip
        sources = self.sources(has_drafter=True)
        _require(
            all(src in DRAFT_SOURCES for src in sources) and sources,
            f"spec.draft_sources={self.draft_sources!r} must be 'auto' or a comma-separated "
            f"subset of {list(DRAFT_SOURCES)}",
        )
        from tlt_jax.models.transformer import ATTENTION_IMPLS

        _require(self.attention_impl in ATTENTION_IMPLS,
                 f"spec.attention_impl={self.attention_impl!r} is not one of "
                 f"{list(ATTENTION_IMPLS)}")  # fmt: skip
        self.bandit(threshold=max(self.threshold, 1), has_drafter=bool(self.drafter))

    def sources(self, has_drafter: bool) -> tuple[str, ...]:
        if self.draft_sources == "auto":
            return DRAFT_SOURCES if has_drafter else ("ngram",)
        return tuple(s.strip() for s in self.draft_sources.split(",") if s.strip())

    def bandit(self, threshold: int, has_drafter: bool, seed: int = 0) -> BanditConfig:
        """The step policy's settings at `threshold` (validated: errors name `spec.*`)."""
        return BanditConfig(
            threshold=threshold,
            warmup_steps=0 if self.mode == "always" else self.warmup_steps,
            bucket_bounds=self.bucket_bounds,
            strategies=tuple(tuple(s.split("|")) for s in self.strategies),
            sources=self.sources(has_drafter),
            epsilon=self.epsilon,
            epsilon_decay=self.epsilon_decay,
            window=self.window,
            seed=seed,
            include_plain=self.mode != "always",
        )


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """The `eval` group: greedy accuracy on the held-out split (`data.eval_split`).

    Attributes:
      num_problems: the first N problems of the split (0: no evaluation).
      max_new_tokens: response length limit when evaluating.
      at_start / at_end: evaluate before the first and after the last step.
    """

    num_problems: int = 200
    max_new_tokens: int = 256
    at_start: bool = True
    at_end: bool = True

    def __post_init__(self):
        _positive_int("eval", "num_problems", self.num_problems, minimum=0)
        _positive_int("eval", "max_new_tokens", self.max_new_tokens)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """The `checkpoint` group (the save interval is the top-level `checkpoint_every`).

    Attributes:
      max_to_keep: checkpoints kept in `workdir/checkpoints`.
      async_save: write checkpoints in the background.
      allow_data_change: resume a workdir whose checkpoint was written under another `data`
        group (`data_changes`). Off, such a resume is refused before anything loads: the
        checkpoint's data position, and the accuracy before training, are of the other
        data. On, the run trains on the new data from the checkpointed position (the next
        epoch's start when that position is past the new split's end).
      allow_model_change: resume (or evaluate) a workdir whose checkpoint was written by a
        run of another model (`model_changes`). Off, that is refused before any model loads:
        the KL reference is not checkpointed but rebuilt from the model this run loads, so it
        would be another model than the run's, and the prompts another tokenizer's. On, the
        checkpoint's policy continues with this run's model as its KL reference and tokenizer.
    """

    max_to_keep: int = 3
    async_save: bool = True
    allow_data_change: bool = False
    allow_model_change: bool = False

    def __post_init__(self):
        _positive_int("checkpoint", "max_to_keep", self.max_to_keep)


# Where TFDS caches what it builds: moving it changes no prompt.
_DATA_FIELDS_NOT_COMPARED = ("cache_dir",)
# Fields only one dataset reads: a change matters only where either run read that dataset.
_DATA_FIELDS_OF = {"data_dir": "gsm8k", "level": "arithmetic", "num_train": "arithmetic",
                   "num_test": "arithmetic"}  # fmt: skip


def data_changes(stored: dict[str, Any], data: DataConfig) -> dict[str, tuple[Any, Any]]:
    """`data` fields whose values differ from the checkpointed run's, as
    `{"data.<field>": (checkpointed, this run's)}`.

    Args:
      stored: the checkpoint's `TrainConfig.to_dict()`. A field it lacks (written before the
        field existed) counts as its default, which the run then had; a checkpoint with no
        `data` group at all (not written by a run) has nothing to compare. A field only one
        dataset reads (`data.level` for arithmetic, `data.data_dir` for gsm8k) is compared
        only where either run used that dataset.
    """
    if "data" not in stored:
        return {}
    before = stored["data"]
    changes = {}
    for field in dataclasses.fields(DataConfig):
        if field.name in _DATA_FIELDS_NOT_COMPARED:
            continue
        owner = _DATA_FIELDS_OF.get(field.name)
        if owner is not None and owner not in (before.get("name", DataConfig.name), data.name):
            continue  # e.g. `data.level` of two gsm8k runs: neither read it
        old = before.get(field.name, field.default)
        new = getattr(data, field.name)
        if old != new:
            changes[f"data.{field.name}"] = (old, new)
    return changes


def model_changes(stored: dict[str, Any], stored_weights: str | None, model: ModelSettings,
                  weights: str | None, *, stored_tokenizer: str | None = None,
                  tokenizer: str | None = None) -> dict[str, tuple[Any, Any]]:  # fmt: skip
    """Where this run's model differs in identity from the checkpointed run's, as
    `{"model.<field>": (checkpointed, this run's)}`.

    The identity is what decides the initial weights (the KL reference) and what the token
    ids mean: `preset`, its `init_seed`, `tokenizer`, and for a model loaded from `name` the
    weights' fingerprint (`checkpoints.weights_fingerprint`), not the path: a moved or
    renamed checkpoint is the same model, and another checkpoint of the same shapes is not.
    Free to change: `dtype` and `param_dtype` (the same weights computed or held at another
    precision), `mesh_shape` (their layout), `architecture` (a check of the loaded
    checkpoint's shapes, and the dry plan's), and `init_seed` of a loaded model (unused).

    Args:
      stored: the checkpoint's `TrainConfig.to_dict()`. A field it lacks counts as its
        default; a checkpoint with no `model` group (not written by a run) has nothing to
        compare.
      stored_weights: the checkpoint's weights fingerprint (None: a preset, or a checkpoint
        that predates it, whose `name` is then compared as written).
      model: this run's settings.
      weights: the fingerprint of this run's `model.name` (None for a preset).
      stored_tokenizer, tokenizer: the fingerprints of the checkpoint's and this run's
        tokenizer files (`checkpoints.tokenizer_fingerprint`; compared when both exist): the
        same `model.tokenizer` setting over files edited in place (another chat template or
        vocabulary) changes what the token ids mean.
    """
    if "model" not in stored:
        return {}
    before = {f.name: stored["model"].get(f.name, f.default)
              for f in dataclasses.fields(ModelSettings)}  # fmt: skip
    fields = ("preset", "tokenizer", "init_seed") if model.preset else ("preset", "tokenizer")
    changes = {f"model.{f}": (before[f], getattr(model, f)) for f in fields
               if before[f] != getattr(model, f)}  # fmt: skip
    old_name, new_name = before["name"], model.name
    if old_name and new_name and stored_weights is not None and weights is not None:
        if stored_weights != weights:
            changes["model.name"] = (f"{old_name} (weights {stored_weights})",
                                     f"{new_name} (weights {weights})")  # fmt: skip
    elif old_name != new_name:
        changes["model.name"] = (old_name, new_name)
    if (stored_tokenizer is not None and tokenizer is not None and stored_tokenizer != tokenizer
            and "model.tokenizer" not in changes):  # fmt: skip
        changes["model.tokenizer"] = (f"{before['tokenizer']!r} (files {stored_tokenizer})",
                                      f"{model.tokenizer!r} (files {tokenizer})")  # fmt: skip
    return dict(sorted(changes.items()))


_GROUPS: dict[str, type] = {
    "model": ModelSettings,
    "rl": RLConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "rollout": RolloutConfig,
    "spec": SpecConfig,
    "eval": EvalConfig,
    "checkpoint": CheckpointConfig,
    "spot": SpotConfig,
}
_ALGORITHM_FIELDS = tuple(f.name for f in dataclasses.fields(AlgorithmConfig))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A whole RL run. Build with `from_config_dict`; every group is already validated."""

    model: ModelSettings
    rl: RLConfig = RLConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    rollout: RolloutConfig = RolloutConfig()
    spec: SpecConfig = SpecConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    spot: SpotConfig = SpotConfig()
    total_steps: int = 100
    checkpoint_every: int = 10
    seed: int = 0
    plot_every: int = 1

    def __post_init__(self):
        _positive_int("config", "total_steps", self.total_steps)
        _positive_int("config", "checkpoint_every", self.checkpoint_every)
        _positive_int("config", "seed", self.seed, minimum=0)
        _require(self.seed < 2**32, f"config.seed={self.seed} must be < 2**32 (JAX's keys take "
                 "32 bits: larger seeds alias smaller ones)")  # fmt: skip
        updates = self.total_steps * self.rl.num_minibatches
        _require(self.optim.warmup_steps < updates or not self.optim.warmup_steps,
                 f"optim.warmup_steps={self.optim.warmup_steps} must be < the run's optimizer "
                 f"updates, total_steps={self.total_steps} x rl.num_minibatches="
                 f"{self.rl.num_minibatches} = {updates}: the learning rate would never reach "
                 "optim.learning_rate")  # fmt: skip
        _positive_int("config", "plot_every", self.plot_every)
        algorithm = self.rl.algorithm
        if (
            algorithm.loss_aggregation in algorithms.NORMED_AGGREGATIONS
            and algorithm.loss_norm_tokens is None
        ):  # Dr. GRPO: the generation budget
            algorithm = dataclasses.replace(algorithm, loss_norm_tokens=self.rollout.max_new_tokens)
            object.__setattr__(self, "rl", dataclasses.replace(self.rl, algorithm=algorithm))
        spec = self.spec
        if not spec.drafter and not self.spot.enabled:
            needs = [src for src in spec.sources(has_drafter=False) if src != "ngram"]
            _require(not needs, f"spec.draft_sources={spec.draft_sources!r} needs a drafter "
                     f"for {needs}; set spec.drafter to an HF-EAGLE export or train one "
                     "online (spot.enabled=True)")  # fmt: skip

    @classmethod
    def from_config_dict(cls, config: Any) -> TrainConfig:
        """Converts an ml_collections `ConfigDict` (or a plain nested dict).

        Raises:
          ValueError: for an unknown group or field (naming the allowed ones) or an invalid
            value (naming the field and the allowed values).
        """
        raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        top_fields = {f.name for f in dataclasses.fields(cls)} - set(_GROUPS)
        unknown = sorted(set(raw) - top_fields - set(_GROUPS))
        _require(not unknown, f"config keys {unknown} are unknown; expected "
                 f"groups {sorted(_GROUPS)} and fields {sorted(top_fields)}")  # fmt: skip
        kwargs: dict[str, Any] = {k: raw[k] for k in top_fields if k in raw}
        for group, group_cls in _GROUPS.items():
            values = dict(raw.get(group) or {})
            if group == "rl":
                algorithm = {k: values.pop(k) for k in _ALGORITHM_FIELDS if k in values}
                values["algorithm"] = AlgorithmConfig(**algorithm)
                allowed = {f.name for f in dataclasses.fields(group_cls)} - {"algorithm"}
                allowed |= set(_ALGORITHM_FIELDS)
            else:
                allowed = {f.name for f in dataclasses.fields(group_cls)}
            unknown = sorted(set(values) - allowed - {"algorithm"})
            _require(not unknown, f"{group}.{unknown[0] if unknown else ''} is not a field of "
                     f"the {group!r} group; expected one of {sorted(allowed)}")  # fmt: skip
            kwargs[group] = group_cls(**values)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (the `rl` group flat again), stored in checkpoints."""
        out = dataclasses.asdict(self)
        out["rl"].update(out["rl"].pop("algorithm"))
        out["model"]["mesh_shape"] = list(self.model.mesh_shape)
        out["spec"]["bucket_bounds"] = list(self.spec.bucket_bounds)
        out["spec"]["strategies"] = list(self.spec.strategies)
        return out


def _config_fields(cls) -> dict[str, Any]:
    """A dataclass's fields at their defaults; None defaults become typed placeholders."""
    out = {}
    for field in dataclasses.fields(cls):
        value = field.default
        if value is dataclasses.MISSING:
            value = field.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(value):  # the algorithm, flat in its group
            out.update(_config_fields(type(value)))
        elif value is None:  # `--config.group.field=...` needs the field's type to parse
            out[field.name] = placeholder(cls, field.name)
        else:
            out[field.name] = value
    return out


def default_config_dict() -> ml_collections.ConfigDict:
    """Every `TrainConfig` field at its default, as a ConfigDict: what config files start from.

    With `model.name` or `model.preset` set, `TrainConfig.from_config_dict` of it equals
    `TrainConfig(ModelSettings(...))`.
    """
    c = ml_collections.ConfigDict()
    top = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name not in _GROUPS}
    for name, value in top.items():
        setattr(c, name, value)
    for group, group_cls in _GROUPS.items():
        setattr(c, group, _config_fields(group_cls))
    return c
