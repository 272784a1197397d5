"""Which mesh a preset needs: a run's programs lowered on abstract meshes, bytes per device.

For a run config and an architecture, `lower_programs` lowers the programs a TLT run compiles,
with the shardings the run gives them, on a `jax.sharding.AbstractMesh` (no devices, nothing
allocated) or on a device mesh (then they also compile):

- `train_grad`: one micro-batch's policy-gradient program (`step.grad_program`), train state
  with the `train` rules (FSDP over `data` x tensor parallel), and `train_apply`, the AdamW
  update (`step.apply_program`);
- `prefill`, `decode`: the engine's own `prefill_program` / `decode_program` on the rollout
  copy of the policy (`rollout` rules) and a decode state sharded as the engine shards it
  (`engine.decode_state_shardings`: slots over `data`, cache heads over `tensor`);
- `draft`, `verify`: `speculative.draft_program` / `verify_program` with the EAGLE drafter at the
  SD threshold's batch and the config's largest verify budget;
- `move`: `engine.move_program`, the slot compaction that copies one slot's cache rows into
  another as the batch drains.

`fit_row` adds up what one device holds in a colocated run (train state, rollout copy and the
engine's per-layer copy of its layer weights, KV cache at the rollout batch, drafter with its
cache and optimizer) and, for compiled programs,
XLA's temporaries. The sizes are the config's global ones (rollout batch, micro-batch), so a
bigger mesh holds fewer rows per device: the question answered is how many chips a config
needs. Programs compile for fake CPU devices as well as real ones (nothing is allocated), so
temporaries are measured on every mesh the CPU device count covers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, Mesh

from tlt_jax.drafter import trainer as drafter_trainer
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.decode import layer_shardings, unstack_layers
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.transformer import abstract_state
from tlt_jax.parallel import sharding as sharding_lib
from tlt_jax.programs import collective_report, memory_report
from tlt_jax.rl import policy
from tlt_jax.rl import step as step_lib
from tlt_jax.rl.config import TrainConfig
from tlt_jax.rollout import engine as engine_lib
from tlt_jax.rollout import speculative
from tlt_jax.rollout.engine import DecodeState, bucket_for
from tlt_jax.rollout.speculative import SpecStrategy

PROGRAMS = ("train_grad", "train_apply", "prefill", "decode", "draft", "verify", "move")
MESH_SIZES = (8, 64, 256)
# Accelerator memory per chip (decimal GB, as vendors state it).
MEMORY_GB = {"H200": 141.0, "TPU v5p": 95.0}
# Share of a chip's memory a run can plan with (runtime, fragmentation; on GPU raise
# XLA_PYTHON_CLIENT_MEM_FRACTION from its 0.75 default to use it).
USABLE_FRACTION = 0.9
# The chip an abstract mesh's programs are lowered for, per platform (`lower_programs`). Kernels
# choose their form by it (`pallas_kernels.tree_attention.target_platform`: the Pallas
# interpreter otherwise, the CPU's form), and jax 0.11's Triton lowering reads the compute
# capability from it ("No supported GPU devices found" without one). TPU is not named: the
# Mosaic kernel would raise on every mesh of more than one device (Mosaic calls are not
# partitioned automatically, and the model's Pallas path is not in a shard_map), so a TPU
# lowering of spec.attention_impl=pallas still holds the interpreter.
ABSTRACT_DEVICES = {
    "cuda": AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu"),
}


def tensor_degree(model: ModelConfig, devices: int, most: int = 8) -> int:
    """The largest power-of-two tensor-parallel degree (<= `most`, <= devices) that divides
    both the query and the kv heads (a larger one would replicate attention weights)."""
    degree = 1
    while (degree * 2 <= min(most, devices) and model.num_heads % (degree * 2) == 0
           and model.num_kv_heads % (degree * 2) == 0):  # fmt: skip
        degree *= 2
    return degree


def mesh_for(model: ModelConfig, devices: int) -> tuple[int, int]:
    """(data, tensor) for `devices` chips: tensor parallel as wide as the heads allow."""
    tensor = tensor_degree(model, devices)
    if devices % tensor:
        raise ValueError(f"devices={devices} is not a multiple of the tensor degree {tensor}")
    return devices // tensor, tensor


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The static sizes of a run's programs on one mesh."""

    rollout_batch: int  # decode-state rows (engine.max_batch_size)
    max_seq_len: int  # prompt + longest response
    prefill_prompts: int  # distinct prompts per prefill (engine.max_prefill_batch)
    prefill_rows: int  # slots one prefill fills (its prompts x the group size, capped)
    prompt_len: int
    response_len: int
    micro_batch_size: int  # train rows per micro-batch (responses)
    sd_batch: int  # the SD threshold's batch bucket
    strategy: SpecStrategy  # the largest verify budget of the config
    hot_vocab: int

    @classmethod
    def of(cls, config: TrainConfig, data: int) -> Geometry:
        """`config`'s sizes (global batches, split over `data` replicas), rounded up to a
        multiple of `data` where a mesh has more replicas than rows."""

        def rows(n: int) -> int:
            return math.ceil(n / data) * data

        r, rl = config.rollout, config.rl
        max_new = max(r.max_new_tokens, config.eval.max_new_tokens)
        batch = rows(r.max_batch_size)
        prompts = min(rows(r.max_prefill_batch), batch)
        strategies = [SpecStrategy.parse(s) for line in config.spec.strategies
                      for s in line.split("|")]  # fmt: skip
        threshold = config.spec.threshold or policy.REPORT_THRESHOLD
        buckets = engine_lib.power_of_two_buckets(1, batch)
        return cls(
            rollout_batch=batch,
            max_seq_len=r.max_prompt_len + max_new,
            prefill_prompts=prompts,
            prefill_rows=min(batch, prompts * rl.group_size),
            prompt_len=r.max_prompt_len,
            response_len=r.max_new_tokens,
            micro_batch_size=rl.micro_batch_size,
            sd_batch=bucket_for(min(rows(threshold), batch), buckets),
            strategy=max(strategies, key=lambda s: (s.verify_tokens, s.depth)),
            hot_vocab=config.spec.hot_vocab,
        )


def make_mesh(shape: tuple[int, int], devices=None) -> Mesh | AbstractMesh:
    """An abstract mesh of `shape` (data, tensor), or a device mesh over `devices`."""
    axes, types = policy.MESH_AXES, (AxisType.Auto,) * 2
    if devices is None:
        return AbstractMesh(tuple(shape), axes, axis_types=types)
    grid = np.asarray(devices[: int(np.prod(shape))]).reshape(shape)
    return Mesh(grid, axes, axis_types=types)


def _structs(tree, mesh, names_of) -> Any:
    """`ShapeDtypeStruct`s of `tree` (arrays or structs) sharded by `names_of(struct)`."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=(
        sharding_lib.named_sharding(x.shape, names_of(x), mesh, sharding_lib.rules_for(
            "rollout")))), tree)  # fmt: skip


def _placed(tree, shardings) -> Any:
    """`ShapeDtypeStruct`s of `tree` with the matching `shardings`."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                        shardings)  # fmt: skip


def _rows_first(x) -> tuple[str | None, ...]:
    return ("batch",) + ("length",) * (len(x.shape) - 1)


@dataclasses.dataclass
class Programs:
    """Lowered programs and the abstract state they run on, for one (config, model, mesh)."""

    mesh: Mesh | AbstractMesh
    geometry: Geometry
    lowered: dict[str, jax.stages.Lowered]
    lower_seconds: dict[str, float]
    bytes_per_device: dict[str, int]


def lower_programs(config: TrainConfig, model: ModelConfig, mesh: Mesh | AbstractMesh, *,
                   platform: str = "cpu", only: tuple[str, ...] = PROGRAMS
                   ) -> Programs:  # fmt: skip
    """Lowers the run's programs (those in `only`) for `platform` on `mesh`.

    Args:
      config: the run (its sizes, SD strategies, optimizer, update layout).
      model: the policy's architecture.
      mesh: an `AbstractMesh` (lowering only) or a device `Mesh` (the results also compile).
        An abstract mesh is given the platform's `ABSTRACT_DEVICES` chip and the programs
        are traced and lowered under it (`jax.sharding.use_abstract_mesh`).
      platform: the backend lowered for ("cpu", "cuda", "tpu").
      only: a subset of `PROGRAMS`.
    """
    unknown = sorted(set(only) - set(PROGRAMS))
    if unknown:
        raise ValueError(f"programs {unknown} are unknown; expected a subset of {PROGRAMS}")
    target = contextlib.nullcontext
    if isinstance(mesh, AbstractMesh) and platform in ABSTRACT_DEVICES:
        mesh = AbstractMesh(mesh.axis_sizes, mesh.axis_names, axis_types=mesh.axis_types,
                            abstract_device=ABSTRACT_DEVICES[platform])  # fmt: skip
        target = functools.partial(jax.sharding.use_abstract_mesh, mesh)
    data = mesh.shape["data"]
    geo = Geometry.of(config, data)
    rollout_rules = sharding_lib.rules_for("rollout")
    plan = policy.plan_run(config, model, mesh)
    graphdef, rollout_params = abstract_state(model, mesh, rollout_rules)
    drafter_module = nnx.eval_shape(lambda: Drafter(model, rngs=nnx.Rngs(0)))
    _, drafter_state = sharding_lib.abstract_module_state(drafter_module, mesh, rollout_rules)
    drafter_params = nnx.to_pure_dict(drafter_state)
    drafter_config = drafter_module.config
    drafter_opt = jax.eval_shape(drafter_trainer.make_optimizer(config.spot.train_config()).init,
                                 drafter_params)  # fmt: skip

    def decode_state(batch: int):
        """The decode state of `batch` slots (programs read exact sizes)."""
        state = jax.eval_shape(
            lambda: DecodeState.create(model, batch, geo.max_seq_len, drafter_config)
        )
        return _placed(state, engine_lib.decode_state_shardings(state, mesh, rollout_rules))

    state, sd_state = decode_state(geo.rollout_batch), decode_state(geo.sd_batch)
    # The engine's per-layer copy of the layer weights (what decode steps read).
    stacked = nnx.merge(graphdef, rollout_params).layers.stacked()
    layers = _placed(jax.eval_shape(unstack_layers, stacked), layer_shardings(stacked))
    accum = step_lib.abstract_accumulator(plan.abstract_state.params)
    sizes = {
        "train_params": sharding_lib.per_device_bytes(plan.abstract_state.params),
        "optimizer_state": sharding_lib.per_device_bytes(plan.abstract_state.opt_state),
        "grad_accumulator": sharding_lib.per_device_bytes(accum),
        "rollout_params": sharding_lib.per_device_bytes(rollout_params),
        # The engine's per-layer copy of the layer weights, which decode steps read.
        "rollout_layers": sharding_lib.per_device_bytes(layers),
        "kv_cache": sharding_lib.per_device_bytes(state.cache),
        "drafter": sharding_lib.per_device_bytes((drafter_params, state.draft)),
        # The drafter's AdamW moments on its trainer slice (replicated: one slice trains).
        "drafter_optimizer": sharding_lib.per_device_bytes(drafter_opt),
        # The frozen reference policy the KL term reads (`Trainer.reference_params`): a
        # second copy of the train params, only with `rl.algorithm.kl_coef > 0`.
        "reference_params": sharding_lib.per_device_bytes(plan.abstract_state.params)
        if config.rl.algorithm.kl_coef > 0
        else 0,
    }
    s = geo.strategy
    # The largest buckets the engine compiles (its buckets always include the maxima).
    kv, u, p = geo.max_seq_len, geo.prefill_prompts, geo.prompt_len
    b = bucket_for(geo.prefill_rows, engine_lib.power_of_two_buckets(1, geo.rollout_batch))
    hot = jax.ShapeDtypeStruct((min(geo.hot_vocab or model.vocab_size, model.vocab_size),),
                               jnp.int32)  # fmt: skip
    greedy = config.rollout.temperature == 0
    impl = config.spec.attention_impl

    def prefill_args():
        ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        floats = jax.ShapeDtypeStruct((b,), jnp.float32)
        host = (ints(u, p), ints(u), ints(b), ints(b), floats, ints(b), floats,
                jax.ShapeDtypeStruct((b,), jnp.uint32))  # fmt: skip
        return (rollout_params, drafter_params, state, *_structs(host, mesh, _rows_first))

    def draft_candidates():
        fn = _draft_fn(graphdef, drafter_config, s, geo.sd_batch, kv, impl)
        return jax.eval_shape(fn, rollout_params, drafter_params, sd_state, hot)

    def tree():
        fn = functools.partial(speculative.tree_program, batch=geo.sd_batch,
                               verify_tokens=s.verify_tokens, depth=s.depth)  # fmt: skip
        return _structs(jax.eval_shape(fn, draft_candidates(), sd_state.last_token,
                                       sd_state.lengths), mesh, _rows_first)  # fmt: skip

    specs: dict[str, tuple] = {
        "train_grad": None,  # policy.lower_grad_program
        "train_apply": (
            lambda: functools.partial(step_lib.apply_program, optimizer=optimizer,
                                      schedule=schedule),
            lambda: (plan.abstract_state, accum), (0, 1), "train"),
        "prefill": (
            lambda: functools.partial(engine_lib.prefill_program, graphdef, greedy_only=greedy,
                                      drafter_config=drafter_config),
            prefill_args, (2,), "rollout"),
        "decode": (
            lambda: functools.partial(engine_lib.decode_program, graphdef,
                                      batch=geo.rollout_batch, kv_len=kv, greedy_only=greedy,
                                      drafter_config=drafter_config, attention_impl=impl),
            lambda: (rollout_params, layers, state, drafter_params), (2,), "rollout"),
        "draft": (
            lambda: _draft_fn(graphdef, drafter_config, s, geo.sd_batch, kv, impl),
            lambda: (rollout_params, drafter_params, sd_state, hot), (), "rollout"),
        "verify": (
            lambda: functools.partial(speculative.verify_program, graphdef, drafter_config,
                                      batch=geo.sd_batch, kv_len=kv, greedy_only=greedy,
                                      attention_impl=impl),
            lambda: (rollout_params, layers, drafter_params, sd_state, tree()), (3,), "rollout"),
        # Slot compaction: one slot's rows copied into another (each device its own rows).
        "move": (
            lambda: functools.partial(engine_lib.move_program, mesh=mesh, specs=jax.tree.map(
                lambda x: x.sharding.spec, state)),
            lambda: (state, *_structs((jax.ShapeDtypeStruct((), jnp.int32),) * 2, mesh,
                                      lambda x: ())),
            (0,), "rollout"),
    }  # fmt: skip
    optimizer = step_lib.make_optimizer(config.optim, config.total_steps)
    schedule = step_lib.learning_rate_schedule(config.optim, config.total_steps)
    lowered, seconds = {}, {}
    for name in only:
        start = time.perf_counter()
        if name == "train_grad":
            with target():
                lowered[name] = policy.lower_grad_program(
                    config, plan, prompt_len=geo.prompt_len, response_len=geo.response_len,
                    platform=platform,
                )  # fmt: skip
        else:
            make_fn, make_args, donate, role = specs[name]
            # As the engine lowers them: row math per device (`sharding.rowwise`).
            rows = (sharding_lib.rows_per_device(mesh) if role == "rollout"
                    else contextlib.nullcontext())  # fmt: skip
            with target(), sharding_lib.use_sharding(mesh, sharding_lib.rules_for(role)), rows:
                traced = jax.jit(make_fn(), donate_argnums=donate).trace(*make_args())
                lowered[name] = traced.lower(lowering_platforms=(platform,))
        seconds[name] = time.perf_counter() - start
    return Programs(mesh, geo, lowered, seconds, sizes)


def _draft_fn(graphdef, drafter_config, strategy: SpecStrategy, batch: int, kv: int, impl: str):
    return functools.partial(speculative.draft_program, graphdef, drafter_config, batch=batch,
                             kv_len=kv, topk=strategy.topk, depth=strategy.depth,
                             attention_impl=impl)  # fmt: skip


def compile_memory(programs: Programs) -> dict[str, dict[str, int]]:
    """XLA's memory analysis of each program (compiled on the programs' device mesh) and the
    collectives the SPMD partitioner put in it (`programs.collective_report`)."""
    if isinstance(programs.mesh, AbstractMesh):
        raise ValueError("compile_memory needs programs lowered on a device mesh, not abstract")
    report = {}
    for name, lowered in programs.lowered.items():
        compiled = lowered.compile()
        report[name] = memory_report(compiled) | collective_report(compiled)
    return report


def fit_row(programs: Programs, memory: dict[str, dict[str, int]] | None = None) -> dict:
    """What one device holds, by component, and whether it fits each chip of `MEMORY_GB`.

    Resident in a colocated run: the train state, the rollout copy, the KV cache, the
    drafter (params, cache, optimizer) and, with a KL term, the frozen reference params. The
    peak adds, over the resident bytes, the larger of the update (gradient accumulator + the
    train programs' temporaries) and the rollout programs' temporaries; without compiled
    temporaries (abstract meshes) only the accumulator, and the verdict says `state only`.
    """
    sizes = programs.bytes_per_device
    resident = sum(v for k, v in sizes.items() if k != "grad_accumulator")
    temps = {k: v.get("temp", 0) for k, v in (memory or {}).items()}
    train_temp = max((temps.get(k, 0) for k in ("train_grad", "train_apply")), default=0)
    rollout_temp = max((temps.get(k, 0) for k in ("prefill", "decode", "draft", "verify",
                                                  "move")),
                       default=0)  # fmt: skip
    peak = resident + max(sizes["grad_accumulator"] + train_temp, rollout_temp)
    mesh = programs.mesh
    row = {
        "mesh": f"{mesh.shape['data']}x{mesh.shape['tensor']}",
        "devices": int(mesh.size),
        "geometry": dataclasses.asdict(programs.geometry) | {
            "strategy": str(programs.geometry.strategy)},
        "bytes_per_device": dict(sizes),
        "resident_bytes": resident,
        "peak_bytes": peak,
        "temporaries": "compiled" if memory else "not measured (abstract mesh)",
        "lower_seconds": {k: round(v, 2) for k, v in programs.lower_seconds.items()},
    }  # fmt: skip
    if memory:
        row["compiled"] = memory
    row["fits"] = {chip: peak <= USABLE_FRACTION * gb * 1e9 for chip, gb in MEMORY_GB.items()}
    return row
