"""Building the policy of a run: mesh, model, tokenizer, train <-> rollout copies, dry plans.

The engine keeps the policy laid out by the `rollout` rules; the trainer keeps its own copy
laid out by the `train` rules (FSDP x tensor parallel). The two never share buffers: the train
state is donated to every update, so each direction is an explicit jitted copy
(`resharding_copies`), which is also where a layout change happens on a real mesh.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from tlt_jax.data.tokenizer import ByteTokenizer, PromptEncoder
from tlt_jax.models import checkpoints
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.presets import get_preset
from tlt_jax.models.transformer import Transformer, abstract_state, init_model
from tlt_jax.parallel import sharding as sharding_lib
from tlt_jax.programs import ProgramPool
from tlt_jax.rl import packing
from tlt_jax.rl import step as step_lib
from tlt_jax.rl.config import ModelSettings, SpecConfig, TrainConfig
from tlt_jax.rollout import calibrate as calibrate_lib
from tlt_jax.rollout.adaptive import AdaptivePolicy, PlainPolicy, StepPolicy
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.rollout.speculative import SpecStrategy

MESH_AXES = ("data", "tensor")
REPORT_THRESHOLD = 32  # TLT's default SD threshold; where plain runs count their long tail
log = logging.getLogger(__name__)


# Threads XLA:CPU's pool needs per local device of a mesh in one process (measured: a 2-device
# mesh on a 2-core host deadlocks with the default pool, one thread per core, and runs with 8).
CPU_POOL_THREADS_PER_DEVICE = 4


def build_mesh(settings: ModelSettings) -> Mesh | None:
    """The run's device mesh; None for `mesh_shape == (1, 1)` (one device, no sharding)."""
    if not settings.uses_mesh:
        return None
    mesh = sharding_lib.make_mesh(settings.mesh_shape, MESH_AXES)
    warn_cpu_pool(mesh)
    return mesh


def size_cpu_pool(mesh_shape, environ=os.environ) -> int | None:
    """Sets `PJRT_NPROC` in `environ` for a mesh of forced host devices in one process.

    For an entry point (`scripts/train.py`) to call before JAX starts its backends, which read
    `PJRT_NPROC` once. It acts only when `XLA_FLAGS` forces several host devices
    (`--xla_force_host_platform_device_count=N`), the mesh spans more than one of them, and
    neither `PJRT_NPROC` nor `NPROC` is set: then XLA:CPU's pool gets
    `CPU_POOL_THREADS_PER_DEVICE` threads per device the mesh uses here, when that is more
    than the cores (see `warn_cpu_pool`: with one thread per core a (2, 1) mesh on 2 cores
    deadlocks in its first rollout).

    Returns:
      the thread count it set, or None when it set nothing.
    """
    if "PJRT_NPROC" in environ or "NPROC" in environ:
        return None
    forced = re.findall(r"--xla_force_host_platform_device_count=(\d+)",
                        environ.get("XLA_FLAGS", ""))  # fmt: skip
    if not forced:
        return None
    local = min(int(forced[-1]), math.prod(mesh_shape))
    threads = CPU_POOL_THREADS_PER_DEVICE * local
    if local < 2 or threads <= (os.cpu_count() or 1):
        return None
    environ["PJRT_NPROC"] = str(threads)
    return threads


def warn_cpu_pool(mesh: Mesh) -> None:
    """Warns when XLA:CPU's thread pool may be too small for this process's part of `mesh`.

    XLA:CPU runs every device's part of a program on one thread pool, as many threads as
    cores unless `PJRT_NPROC` says otherwise, and a collective blocks its thread until every
    device arrives. A device whose part holds all threads, some blocked in independent
    collectives, starves the others: the main job on a (2, 1) mesh of two CPU devices on a
    2-core host waited 40 s in an all-reduce, then XLA aborted (BENCHMARKS.md). Several
    processes (`scripts/launch_local.py`) have no shared pool.
    """
    local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    if jax.default_backend() != "cpu" or local < 2:
        return
    want = CPU_POOL_THREADS_PER_DEVICE * local
    have = os.environ.get("PJRT_NPROC") or os.environ.get("NPROC")
    threads = int(have) if have and have.isdigit() else os.cpu_count() or 1
    if threads < want:
        log.warning(
            "a mesh of %d CPU devices in one process shares XLA:CPU's pool of %d threads; "
            "collectives can deadlock (XLA aborts after 40 s). Set PJRT_NPROC=%d before the "
            "process starts, or run one process per device (scripts/launch_local.py)",
            local, threads, want,
        )  # fmt: skip


def model_config(settings: ModelSettings) -> ModelConfig:
    """The architecture of the run's policy without loading weights."""
    if settings.preset:
        return get_preset(settings.preset, **settings.dtype_overrides())
    return checkpoints.load_config(settings.name, **settings.dtype_overrides())


def planned_model_config(settings: ModelSettings) -> ModelConfig:
    """`architecture`'s preset when set (no file is read), else `model_config`.

    With `name` set, the run loads a checkpoint, whose config keeps `ModelConfig`'s dtypes
    unless `dtype` / `param_dtype` override them (the loader does not read `torch_dtype`);
    the plan does the same, not the preset's bfloat16 (it planned half the memory the run
    then needed)."""
    if settings.architecture:
        loaded = {} if settings.preset or not settings.name else {
            f.name: f.default for f in dataclasses.fields(ModelConfig)
            if f.name in ("dtype", "param_dtype")}  # fmt: skip
        return get_preset(settings.architecture, **{**loaded, **settings.dtype_overrides()})
    return model_config(settings)


def weights_fingerprint(settings: ModelSettings) -> str | None:
    """`checkpoints.weights_fingerprint` of `name`, which the run's checkpoints store (reads
    at most 512 KiB a weight file); None for a random preset, whose `preset` and `init_seed`
    say which weights it is."""
    return None if settings.preset else checkpoints.weights_fingerprint(settings.name)


def tokenizer_fingerprint(settings: ModelSettings) -> str | None:
    """`checkpoints.tokenizer_fingerprint` of `name` when the run's tokenizer is the
    checkpoint's (stored with the run's checkpoints); None for the byte tokenizer, a preset
    or a GGUF file."""
    if settings.tokenizer == "byte" or settings.preset or not settings.name:
        return None
    return checkpoints.tokenizer_fingerprint(settings.name)


_ARCHITECTURE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                        "num_layers", "num_heads", "num_kv_heads", "head_dim")  # fmt: skip


def build_policy(settings: ModelSettings, mesh: Mesh | None) -> Transformer:
    """The policy laid out by the `rollout` rules: loaded from `name`, or a random preset.

    Raises:
      ValueError: when the checkpoint's architecture differs from `model.architecture`.
    """
    if not settings.preset:
        if settings.architecture:
            found = checkpoints.load_config(settings.name)
            expected = get_preset(settings.architecture)
            diff = {f: (getattr(found, f), getattr(expected, f)) for f in _ARCHITECTURE_FIELDS
                    if getattr(found, f) != getattr(expected, f)}  # fmt: skip
            if diff:
                raise ValueError(
                    f"model.name={settings.name!r} is not a "
                    f"model.architecture={settings.architecture!r}: (checkpoint, preset) "
                    f"differ at {diff}"
                )
        return checkpoints.load_model(settings.name, mesh=mesh, role="rollout",
                                      **settings.dtype_overrides())  # fmt: skip
    model = init_model(model_config(settings), seed=settings.init_seed)
    if mesh is not None:
        graphdef, state = nnx.split(model)
        shardings = sharding_lib.state_shardings(state, mesh, sharding_lib.rules_for("rollout"))
        model = nnx.merge(graphdef, jax.device_put(state, shardings))
    return model


def build_tokenizer(settings: ModelSettings):
    """`ByteTokenizer` for `tokenizer == "byte"`, else the checkpoint's HF tokenizer."""
    if settings.tokenizer == "byte":
        return ByteTokenizer()
    if not settings.name:
        raise ValueError(
            "model.tokenizer='checkpoint' needs model.name (a checkpoint); a preset has no "
            "tokenizer, set --config.model.tokenizer=byte"
        )
    return checkpoints.load_tokenizer(settings.name)


def check_spec_files(spec: SpecConfig, model: ModelSettings | None = None, *,
                     spot: bool = False) -> None:  # fmt: skip
    """Names a `spec.drafter` folder that is no HF-EAGLE export, or one exported for another
    model than `model`'s, and a `spec.calibration_file` that cannot be read, before the policy
    loads (the drafter and the threshold are read only after it).

    With `spot` (spot training), also a drafter whose layer differs from the one spot training
    builds (the target's `intermediate_size` and `rms_norm_eps`; an EAGLE export may keep its
    own, which drafting alone accepts)."""
    if spec.drafter:
        from tlt_jax.drafter.export import check_eagle_dir, check_eagle_target, load_eagle_config

        path = check_eagle_dir(spec.drafter, "spec.drafter")
        if model is not None:
            drafter, target = load_eagle_config(path), model_config(model)
            check_eagle_target(path, drafter, target)
            diff = [f"{name}={getattr(drafter, name)!r} (the target's: {getattr(target, name)!r})"
                    for name in ("intermediate_size", "rms_norm_eps")
                    if spot and getattr(drafter, name) != getattr(target, name)]  # fmt: skip
            if diff:
                raise ValueError(
                    f"spec.drafter={spec.drafter!r} has {', '.join(diff)}: spot training "
                    "(spot.enabled) trains a drafter layer shaped like the target's; draft "
                    "with it without spot training, or start spot training from a random "
                    "drafter (no spec.drafter)"
                )
    if spec.calibration_file:
        calibrate_lib.load_calibration(spec.calibration_file)


def load_drafter(spec: SpecConfig, target: ModelConfig):
    """(drafter, hot token ids) of `spec.drafter` (an HF-EAGLE export), or (None, None).

    The drafter takes the policy's dtypes; the hot vocabulary is the export's
    `hot_vocab.json` top `spec.hot_vocab` ids when both are there.
    """
    if not spec.drafter:
        return None, None
    from tlt_jax.drafter.export import load_eagle
    from tlt_jax.drafter.hot_vocab import HOT_VOCAB_FILE, load_hot_vocab

    path = Path(spec.drafter)
    if not path.is_dir():
        raise FileNotFoundError(f"spec.drafter={spec.drafter!r} is not a directory (expected an "
                                "HF-EAGLE export from scripts/train_drafter.py)")  # fmt: skip
    drafter = load_eagle(path, target=target, dtype=target.dtype, param_dtype=target.param_dtype)
    hot_file = path / HOT_VOCAB_FILE
    hot = None
    if spec.hot_vocab and not hot_file.is_file():  # e.g. a public EAGLE checkpoint
        log.warning(
            "spec.hot_vocab=%d: %s does not exist (train_drafter.py exports it); "
            "drafting over the full vocabulary",
            spec.hot_vocab,
            hot_file,
        )
    elif spec.hot_vocab:
        hot = load_hot_vocab(hot_file, spec.hot_vocab, target.vocab_size)
    return drafter, hot


CALIBRATION_FILE = "spec_calibration.json"  # in the run's workdir


def resolve_threshold(config: TrainConfig, engine: RolloutEngine, workdir: Path | None = None
                      ) -> int:  # fmt: skip
    """The SD threshold: `spec.threshold`, else the calibration file's (re-derived under
    `spec.max_cost_ratio` when that is set), else the one this run measured when it started
    (`workdir/spec_calibration.json`: a resumed run keeps it), else measured now (written
    there and logged); the engine's largest batch for
    `spec.mode == "always"`. With `spec.mode == "off"` nothing is measured: the threshold
    (which then only sets where `long_tail_share` is counted) falls back to
    `REPORT_THRESHOLD`, the paper's default."""
    spec = config.spec
    if spec.mode == "always":
        return engine.config.max_batch_size
    if spec.threshold:
        if spec.calibration_file:  # not used, but read: a wrong path is named, not ignored
            calibrate_lib.load_calibration(spec.calibration_file)
            log.warning("spec.threshold=%d is set, so spec.calibration_file=%r is not used",
                        spec.threshold, spec.calibration_file)  # fmt: skip
        return spec.threshold
    if spec.calibration_file:
        calibration = calibrate_lib.load_calibration(spec.calibration_file)
        if not spec.max_cost_ratio:
            return calibration.threshold
        return calibration.threshold_at(spec.max_cost_ratio)
    if spec.mode == "off":
        return REPORT_THRESHOLD
    saved = None if workdir is None else Path(workdir) / CALIBRATION_FILE
    if saved is not None and saved.is_file():  # a resumed run keeps the threshold it ran with
        try:
            calibration = calibrate_lib.load_calibration(saved, "the run's own calibration")
        except ValueError as error:  # a torn file (older versions wrote it in place)
            log.warning("%s; measuring it again", error)
        else:
            threshold = calibration.threshold_at(spec.max_cost_ratio or 2.0)
            log.info("SD threshold %d from %s (measured when the run started)", threshold,
                     saved)  # fmt: skip
            return threshold
    verify = min(SpecStrategy.parse(s.split("|")[0]).verify_tokens for s in spec.strategies)
    result = calibrate_lib.calibrate(engine, verify_tokens=verify, seed=config.seed,
                                     temperature=config.rollout.temperature,
                                     max_cost_ratio=spec.max_cost_ratio or 2.0)  # fmt: skip
    log.info("SD calibration (%.1f s): threshold %d, verify/plain cost per batch %s",
             result.seconds, result.threshold, result.to_dict()["cost_ratio"])  # fmt: skip
    if saved is not None:
        result.save(saved)
    return result.threshold


def build_step_policy(config: TrainConfig, threshold: int, has_drafter: bool,
                      seed_offset: int = 0) -> StepPolicy:  # fmt: skip
    """`PlainPolicy` for `spec.mode == "off"` or a zero threshold, else TLT's
    `AdaptivePolicy` (BEG-MAB) seeded from the run's seed (+ `seed_offset`: one bandit per
    rollout slice, each exploring on its own stream)."""
    if config.spec.mode == "off" or threshold <= 0:
        return PlainPolicy()
    return AdaptivePolicy(config.spec.bandit(threshold, has_drafter,
                                             seed=config.seed + seed_offset))  # fmt: skip


def build_engine(config: TrainConfig, model: Transformer, *, pool: ProgramPool | None = None,
                 drafter: tuple | None = None) -> RolloutEngine:  # fmt: skip
    """The rollout engine sized for the run's prompts and its longest responses, with the
    `spec` group's drafter (if any; or `drafter = (Drafter, hot ids)`, e.g. the online one)
    and a plain step policy (the trainer installs the adaptive one once the threshold is
    known: `resolve_threshold`, `build_step_policy`)."""
    max_new = max(config.rollout.max_new_tokens, config.eval.max_new_tokens)
    drafter, hot = drafter if drafter is not None else load_drafter(config.spec, model.config)
    return RolloutEngine(model, EngineConfig(
        max_batch_size=config.rollout.max_batch_size,
        max_seq_len=config.rollout.max_prompt_len + max_new,
        max_prefill_batch=config.rollout.max_prefill_batch,
        min_prompt_bucket=config.rollout.min_prompt_bucket,
        spec_attention_impl=config.spec.attention_impl,
        layers_per_program=config.rollout.layers_per_program,
        xla_opt_level=config.rollout.xla_opt_level,
    ), drafter=drafter, hot_token_ids=hot, pool=pool)  # fmt: skip


def build_encoder(config: TrainConfig, tokenizer) -> PromptEncoder:
    """Question -> prompt ids, rendered as `data` says (shared by training and evaluation)."""
    return PromptEncoder(
        tokenizer, instruction=config.data.instruction,
        use_chat_template=config.data.use_chat_template,
        max_prompt_len=config.rollout.max_prompt_len, system_prompt=config.data.system_prompt,
    )  # fmt: skip


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def resharding_copies(rollout_params: nnx.State, mesh: Mesh | None):
    """(to_train, to_rollout): jitted copies between the engine's and the trainer's layouts.

    Without a mesh both are plain device copies (fresh buffers, so donating the train state
    never frees the engine's weights).
    """
    if mesh is None:
        copy = jax.jit(_copy)
        return copy, copy
    train = sharding_lib.state_shardings(rollout_params, mesh, sharding_lib.rules_for("train"))
    rollout = jax.tree.map(lambda x: x.sharding, rollout_params)
    return jax.jit(_copy, out_shardings=train), jax.jit(_copy, out_shardings=rollout)


# ----------------------------------------------------------------------------- dry plans


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """Shapes and per-device bytes of a run's train state, computed without allocating."""

    model: ModelConfig
    mesh_shape: tuple[int, int]
    num_params: int
    param_bytes_per_device: int
    opt_state_bytes_per_device: int
    abstract_state: Any  # TrainState of ShapeDtypeStructs with shardings


def abstract_mesh(shape: tuple[int, int]) -> AbstractMesh:
    return AbstractMesh(tuple(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(shape))


def plan_run(config: TrainConfig, model: ModelConfig | None = None,
             mesh: Mesh | AbstractMesh | None = None) -> RunPlan:  # fmt: skip
    """The train state of `config` as `ShapeDtypeStruct`s with train-role shardings.

    Args:
      config: the run config.
      model: the architecture (default: `model_config(config.model)`; pass a preset to plan a
        checkpoint that is not on this machine).
      mesh: a device or abstract mesh (default: an abstract mesh of `model.mesh_shape`).
    """
    model = model or planned_model_config(config.model)
    mesh = mesh if mesh is not None else abstract_mesh(config.model.mesh_shape)
    _, params = abstract_state(model, mesh, sharding_lib.rules_for("train"))
    optimizer = step_lib.make_optimizer(config.optim, config.total_steps)
    state = jax.eval_shape(lambda p: step_lib.init_train_state(p, optimizer, config.seed), params)
    # eval_shape drops shardings: params keep theirs, optimizer moments follow their params.
    by_path = {jax.tree_util.keystr(path): leaf.sharding
               for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}  # fmt: skip
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(path, leaf):
        key = jax.tree_util.keystr(path)
        sharding = next((s for p, s in by_path.items() if key.endswith(p)), replicated)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    state = state.replace(
        params=params,
        opt_state=jax.tree_util.tree_map_with_path(place, state.opt_state),
        step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
        rng=jax.ShapeDtypeStruct(state.rng.shape, state.rng.dtype, sharding=replicated),
    )
    param_bytes = sharding_lib.per_device_bytes(params)
    leaves = jax.tree.leaves(params)
    return RunPlan(
        model=model,
        mesh_shape=tuple(mesh.shape[a] for a in MESH_AXES),
        num_params=int(sum(np.prod(x.shape) for x in leaves)),
        param_bytes_per_device=param_bytes,
        opt_state_bytes_per_device=sharding_lib.per_device_bytes(state.opt_state),
        abstract_state=state,
    )


def lower_grad_program(config: TrainConfig, plan: RunPlan, *, prompt_len: int,
                       response_len: int, platform: str = "tpu"):  # fmt: skip
    """Lowers one micro-batch's gradient program for `plan` (abstract mesh, nothing allocated).

    Returns:
      The `jax.stages.Lowered` program (its text, cost and shardings can be inspected).
    """
    params = plan.abstract_state.params
    mesh = jax.tree.leaves(params)[0].sharding.mesh
    replicated = NamedSharding(mesh, PartitionSpec())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    rl = config.rl
    if rl.update_layout == "packed":
        rollout = dataclasses.replace(
            config.rollout, max_prompt_len=prompt_len, max_new_tokens=response_len
        )
        cols, rows = packing.run_geometry(rl, rollout, mesh.shape["data"])
        tokens = spec((rows, cols), jnp.int32)
        prefix = spec((rows, packing.prefix_width(rl, rollout)), jnp.int32)
        batch = step_lib.PackedBatch(tokens, tokens, tokens, tokens, tokens,
                                     spec((rows, cols), jnp.bool_), prefix,
                                     mesh.shape["data"])  # fmt: skip
    else:
        rows, cols = rl.micro_batch_size, response_len
        p = rl.micro_batch_size // rl.group_size
        batch = step_lib.SequenceBatch(spec((p, prompt_len), jnp.int32), spec((p,), jnp.int32),
                                       spec((rows, cols), jnp.int32),
                                       spec((rows, cols), jnp.bool_))  # fmt: skip
    inputs = step_lib.LossInputs(*[spec((rows, cols), jnp.float32)] * 6)
    accum = {name: spec((), jnp.float32) for name in step_lib.ACCUMULATED_METRICS}
    accum["grads"] = step_lib.abstract_accumulator(params)["grads"]
    graphdef, _ = abstract_state(plan.model)
    fn = step_lib.partial_program(step_lib.grad_program, graphdef, algorithm=rl.algorithm,
                                  temperature=float(config.rollout.temperature),
                                  options=step_lib.ForwardOptions.of(
                                      rl, plan.model.num_layers, platform))  # fmt: skip
    with sharding_lib.use_sharding(mesh, sharding_lib.rules_for("train")):
        traced = jax.jit(fn, donate_argnums=(1,)).trace(params, accum, batch, inputs)
        return traced.lower(lowering_platforms=(platform,))
