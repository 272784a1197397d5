"""Logical axis names -> mesh axes, one rules table per role.

Params carry logical axis names as NNX variable metadata (`logical_axes=(...)`); activations
are constrained by name inside the model. A role's rules table maps each logical name to a
mesh axis (or a tuple of mesh axes, or None for replicated):

- `train`: FSDP over `fsdp` (the embed dimension of every weight) x tensor parallel over
  `tensor` (heads, mlp, vocab); the batch is split over both data-like axes.
- `rollout`: tensor parallel within one replica; replicas split the batch over `data`.
- `drafter`: like rollout (the drafter decodes next to the policy on the same slice).

Mesh axes: `data` (replicas / FSDP) and `tensor`. A mesh `(2, 4)` means 2 x 4 devices.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
AnyMesh = Mesh | AbstractMesh
Rules = tuple[tuple[str, MeshAxes], ...]

LOGICAL_AXES = (
    "batch", "length", "kv_length", "layers", "vocab", "embed", "mlp", "q_heads", "kv_heads",
    "head_dim", "norm", "concat_embed",
)  # fmt: skip

RULES: dict[str, Rules] = {
    "train": (
        ("batch", "data"),
        ("length", None),
        ("kv_length", None),
        ("layers", None),
        ("vocab", "tensor"),
        ("embed", "data"),
        ("mlp", "tensor"),
        ("q_heads", "tensor"),
        ("kv_heads", "tensor"),
        ("head_dim", None),
        ("norm", None),
        ("concat_embed", "data"),  # the drafter fc's [embed; feature] input (2D)
    ),
    "rollout": (
        ("batch", "data"),
        ("length", None),
        ("kv_length", None),
        ("layers", None),
        ("vocab", "tensor"),
        ("embed", None),
        ("mlp", "tensor"),
        ("q_heads", "tensor"),
        ("kv_heads", "tensor"),
        ("head_dim", None),
        ("norm", None),
        ("concat_embed", None),
    ),
}
RULES["drafter"] = RULES["rollout"]


@dataclasses.dataclass(frozen=True)
class ShardingContext:
    mesh: AnyMesh
    rules: Rules


_CONTEXT: contextvars.ContextVar[ShardingContext | None] = contextvars.ContextVar(
    "tlt_jax_sharding", default=None
)


def make_mesh(shape: Sequence[int], axis_names: Sequence[str] = ("data", "tensor")) -> Mesh:
    """A device mesh of `shape` over the first prod(shape) devices, with `Auto` axes.

    `jax.make_mesh` defaults to `Explicit` axes, under which `with_sharding_constraint` by
    name is refused; the model places activations with such constraints, so axes are `Auto`.

    Raises:
      ValueError: if the mesh needs more devices than are available.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(axis_names):
        raise ValueError(f"mesh shape={shape} must have one entry per axis {tuple(axis_names)}")
    needed = int(np.prod(shape))
    devices = jax.devices()
    if needed > len(devices) or needed <= 0:
        raise ValueError(f"mesh shape={shape} needs {needed} devices; {len(devices)} available")
    return jax.make_mesh(
        shape,
        tuple(axis_names),
        axis_types=(AxisType.Auto,) * len(shape),
        devices=devices[:needed],
    )


def rules_for(role: str) -> Rules:
    if role not in RULES:
        raise ValueError(f"sharding role={role!r} is unknown; expected one of {sorted(RULES)}")
    return RULES[role]


def logical_to_spec(names: Sequence[str | None], rules: Rules, mesh: AnyMesh) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec, dropping mesh axes of size 1 or reused."""
    table = dict(rules)
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for name in names:
        if name is not None and name not in table:
            raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(table)}")
        axes = table.get(name) if name is not None else None
        if axes is None:
            spec.append(None)
            continue
        axes_tuple = (axes,) if isinstance(axes, str) else tuple(axes)
        kept = tuple(a for a in axes_tuple if mesh.shape.get(a, 1) > 1 and a not in used)
        used.update(kept)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*spec)


def _fits(shape: Sequence[int], spec: PartitionSpec, mesh: AnyMesh) -> PartitionSpec:
    """Replicates dimensions that the mesh axes do not divide (e.g. 9 heads over 2 devices)."""
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=True):
        if axes is None:
            out.append(None)
            continue
        size = int(np.prod([mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]))
        out.append(axes if dim % size == 0 else None)
    return PartitionSpec(*out)


def named_sharding(
    shape: Sequence[int], names: Sequence[str | None], mesh: AnyMesh, rules: Rules
) -> NamedSharding:
    """The `NamedSharding` of an array of `shape` whose axes have logical `names`.

    Dimensions the mapped mesh axes do not divide are replicated (e.g. 28 heads over 8).

    Raises:
      ValueError: if `names` does not have one entry per dimension, or names an unknown axis.
    """
    if len(names) != len(shape):
        raise ValueError(f"shape={tuple(shape)} has logical axes {tuple(names)}; need one/dim")
    return NamedSharding(mesh, _fits(shape, logical_to_spec(names, rules, mesh), mesh))


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded arrays or `ShapeDtypeStruct`s.

    Leaves without a sharding count in full (as if replicated). With uneven shards the
    largest one is counted, which is what the device allocates.
    """
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def logical_axes_of(state: nnx.State) -> nnx.State:
    """The `logical_axes` metadata of every variable in an NNX state, as a matching tree."""
    return jax.tree.map(
        lambda v: v.get_metadata().get("logical_axes"),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def state_shardings(state: nnx.State, mesh: AnyMesh, rules: Rules) -> nnx.State:
    """NamedShardings for an (abstract) NNX state from its variables' logical axes.

    Every variable must carry `logical_axes`; a missing annotation is an error, not a silent
    replication.
    """

    def one(variable):
        names = variable.get_metadata().get("logical_axes")
        shape = variable.get_value().shape
        if names is None:
            raise ValueError(f"variable of shape {shape} has no logical_axes metadata")
        return named_sharding(shape, names, mesh, rules)

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def abstract_module_state(
    module: nnx.Module, mesh: AnyMesh | None = None, rules: Rules | None = None
) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of an abstract module (`nnx.eval_shape`) as `ShapeDtypeStruct`s,
    each carrying its `NamedSharding` on `mesh` under `rules` when a mesh is given."""
    graphdef, state = nnx.split(module)
    if mesh is None:
        return graphdef, state
    if rules is None:
        raise ValueError("abstract_state: rules are required with a mesh")

    def with_sharding(variable, sharding):
        value = variable.get_value()
        return variable.replace(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))

    state = jax.tree.map(with_sharding, state, state_shardings(state, mesh, rules),
                         is_leaf=lambda x: isinstance(x, nnx.Variable))  # fmt: skip
    return graphdef, state


@contextlib.contextmanager
def use_sharding(mesh: AnyMesh, rules: Rules) -> Iterator[ShardingContext]:
    """Within the block, `constrain` maps logical activation axes onto `mesh` with `rules`.

    The context is read when a function is traced, and jit's trace cache (keyed on the
    function and the argument types, shared by every `jax.jit` of that function) does not key
    on it: trace a function of its own inside the block (e.g. a fresh `functools.partial`),
    or a trace from outside the block is silently reused.
    """
    token = _CONTEXT.set(ShardingContext(mesh, rules))
    try:
        yield _CONTEXT.get()
    finally:
        _CONTEXT.reset(token)


def current() -> ShardingContext | None:
    return _CONTEXT.get()


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` by logical names under `use_sharding`; unsharded otherwise.

    Outside a `use_sharding` block the program is single-device by construction, so there is
    nothing to constrain.
    """
    ctx = _CONTEXT.get()
    if ctx is None:
        return x
    return jax.lax.with_sharding_constraint(x, named_sharding(x.shape, names, ctx.mesh, ctx.rules))


# ----------------------------------------------------------------------------- rows per device


class RowSplit(NamedTuple):
    """How `rows_per_device` splits a batch: over `axes` of `mesh`, `devices` ways, each
    device's rows given by `spec` (a `shard_map` spec)."""

    mesh: Mesh
    axes: tuple[str, ...]
    devices: int
    spec: PartitionSpec


class _Rows(NamedTuple):
    mesh: Mesh
    split: RowSplit | None  # None: the axes are all of size 1


_ROWS: contextvars.ContextVar[_Rows | None] = contextvars.ContextVar("tlt_jax_rows",
                                                                    default=None)  # fmt: skip

# The mesh axis a head's vocabulary is split over (the rules' `("vocab", "tensor")`).
VOCAB_AXIS = "tensor"


@contextlib.contextmanager
def rows_per_device(mesh: Mesh, axes: Sequence[str] = ("data",)) -> Iterator[None]:
    """While tracing inside the block, `rowwise` functions run on each device's own rows.

    For programs whose batch is split over the mesh `axes` (the rollout engine's: slots over
    `data`). Read at trace time, like `use_sharding`, with the same caveat: trace a function of
    its own inside the block.
    """
    kept = tuple(a for a in axes if mesh.shape.get(a, 1) > 1)
    split = None
    if kept:
        devices = int(np.prod([mesh.shape[a] for a in kept]))
        split = RowSplit(mesh, kept, devices, PartitionSpec(kept if len(kept) > 1 else kept[0]))
    token = _ROWS.set(_Rows(mesh, split))
    try:
        yield
    finally:
        _ROWS.reset(token)


def rows_split(batch: int) -> RowSplit | None:
    """How a batch of `batch` rows is split per device, under `rows_per_device` and when the
    axes divide it; else None."""
    rows = _ROWS.get()
    split = None if rows is None else rows.split
    return None if split is None or batch % split.devices else split


def vocab_split(vocab: int) -> str | None:
    """The mesh axis (`VOCAB_AXIS`) a vocabulary of `vocab` ids is split over per device,
    under `rows_per_device` on a mesh where that axis has several devices and divides it;
    else None."""
    rows = _ROWS.get()
    if rows is None:
        return None
    devices = rows.mesh.shape.get(VOCAB_AXIS, 1)
    return VOCAB_AXIS if devices > 1 and vocab % devices == 0 else None


def rowwise(fn: Callable, *, vocab_args: Sequence[int] = ()) -> Callable:
    """Runs `fn` per device on its rows of the batch, under `rows_per_device`.

    `fn`'s positional arguments and outputs are arrays (or pytrees of them) with the batch
    first, and rows never interact (sampling, acceptance: each row's math reads only its own
    row). The SPMD partitioner cannot see that: a `top_k` or a scatter over a batch-sharded
    array all-gathers the batch, and a `lax.cond` on `jnp.any(...)` of the batch all-reduces
    its predicate, in every step. Under `rows_per_device(mesh)` with a batch the axes divide,
    `fn` runs inside `jax.shard_map`, manual over those axes only (others, e.g. `tensor`,
    stay with the partitioner), so the batch needs no collective; a cond's predicate becomes
    each device's own (the result per row is the same). Elsewhere (one device, a batch the
    axes do not divide) it is `fn`. Keyword arguments are static and passed through.

    `vocab_args`: positional arguments whose last dimension is the vocabulary (logits). On a
    mesh whose `VOCAB_AXIS` divides it (`vocab_split`), `fn` also runs manual over that axis
    on each device's block of the vocabulary and is called with `vocab_axis=VOCAB_AXIS`, to
    reduce over it with collectives of a few values per row (`sampling.VocabAxis`): the
    partitioner would all-gather the logits over the axis instead (a [B, V] float32 array
    per step; 156 MB at DS-R1's rollout batch on a (2, 4) mesh). Its outputs must then be
    the same on every device of that axis.
    """

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        batch = {x.shape[0] for x in jax.tree.leaves(args)}
        split = rows_split(batch.pop()) if len(batch) == 1 else None
        vocab = vocab_split(args[vocab_args[0]].shape[-1]) if vocab_args else None
        if split is None and vocab is None:
            return fn(*args, **kwargs)
        rows = _ROWS.get()
        row_axes = split.spec[0] if split else None
        in_specs = [PartitionSpec(row_axes) for _ in args]
        if vocab:
            kwargs = {**kwargs, "vocab_axis": vocab}
            for i in vocab_args:
                in_specs[i] = PartitionSpec(row_axes, *(None,) * (args[i].ndim - 2), vocab)
        axes = set(split.axes if split else ()) | ({vocab} if vocab else set())
        return jax.shard_map(
            functools.partial(fn, **kwargs), mesh=rows.mesh, in_specs=tuple(in_specs),
            out_specs=PartitionSpec(row_axes), axis_names=axes, check_vma=False,
        )(*args)  # fmt: skip

    return wrapped
