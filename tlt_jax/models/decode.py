"""The policy's rollout form: per-layer weights, an exactly sized per-layer cache, and the
cached forward over them (decode, tree verification, catch-up, the drafter's cache).

Dimension legend as in `transformer.py` (B batch, T new tokens, S cache positions, L layers,
K kv heads, H head dim, D model).

Why a second form of the forward: training scans one layer body over weights stacked on a
leading L axis (`Transformer.__call__`), which compiles like one layer. On XLA:CPU that scan
copies every layer's weights out of the stacked arrays before its products, and a cache window
cut from an [L, Bmax, Smax, K, H] cache is copied and transposed before attention reads it: at
batch 32 most of a decode step was copies. Here:

- the layers run unrolled over per-layer weight arrays (`unstack_layers`; the engine converts
  the policy once per weight sync), 2-D matrices so that no product transposes a weight
  (`flat_layer`): no weight is copied;
- the cache (`DecodeCache`) is one array pair per layer, sized exactly to the step's batch
  and kv bucket (the engine resizes it when the bucket changes, `DecodeCache.resized`), keys
  [B, K, H, S] and values [B, K, S, H]: the attention products read them in place;
- a step's new keys and values are written before attention reads the cache
  (`cached_forward(write=True)`): the scatter then works in place, where a write after the
  reads makes XLA copy every cache array first.

Decode step of SmolLM2-135M against the scanned form, side by side in one process (248 of 256
positions): 1.29x / 1.49x / 1.76x / 1.70x faster at batch 1 / 8 / 32 / 64 (BENCHMARKS.md).
Attention reads the cache positions below each row's start and the new tokens separately, in
both modes, so written and read-only forwards compute the same numbers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.transformer import (
    NewKV,
    Transformer,
    _scores,
    apply_rope,
    attention,
    causal_mask,
    rms_norm,
    rope_inv_freq,
    rope_sin_cos,
)
from tlt_jax.parallel.sharding import AnyMesh, Rules, constrain, named_sharding, rows_split

LayerParams = tuple[dict[str, jax.Array], ...]
# Logical axes of a `DecodeCache` layer's keys and values.
KEY_AXES = ("batch", "kv_heads", "head_dim", "kv_length")
VALUE_AXES = ("batch", "kv_heads", "kv_length", "head_dim")


@struct.dataclass
class DecodeCache:
    """Keys [B, K, H, S] and values [B, K, S, H] of every layer, one array pair per layer.

    B and S are exactly the slots and positions a program computes over (no view, no window
    copy); `resized` moves the contents to another size. Writers return a whole new cache.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    layout = "head_major"  # what `attention(cache_layout=...)` reads

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, length: int, dtype=None) -> DecodeCache:
        k, h, dtype = config.num_kv_heads, config.head_dim, dtype or config.jnp_dtype
        layers = range(config.num_layers)
        return cls(
            k=tuple(jnp.zeros((batch, k, h, length), dtype) for _ in layers),
            v=tuple(jnp.zeros((batch, k, length, h), dtype) for _ in layers),
        )

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def length(self) -> int:
        return self.k[0].shape[3]

    def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
        return self.k[i], self.v[i]

    def block(self, start: int, stop: int) -> DecodeCache:
        """Layers [start, stop) as a cache of their own (no copy: the same arrays)."""
        return DecodeCache(k=self.k[start:stop], v=self.v[start:stop])

    @classmethod
    def joined(cls, blocks: list[DecodeCache]) -> DecodeCache:
        """The caches of consecutive layer blocks as one cache."""
        return cls(k=sum((c.k for c in blocks), ()), v=sum((c.v for c in blocks), ()))

    def check_size(self, batch: int, length: int) -> None:
        """Refuses a cache that is not exactly `batch` slots x `length` positions (a program
        compiled for one size run on a state fitted to another)."""
        if (self.batch, self.length) != (batch, length):
            raise ValueError(f"the cache holds {self.batch} slots x {self.length} positions; "
                             f"this program runs {batch} x {length}")  # fmt: skip

    def token_major(self) -> NewKV:
        """The whole cache as [L, B, S, K, H] keys and values (for checks and exports)."""
        return NewKV(k=jnp.stack([jnp.transpose(x, (0, 3, 1, 2)) for x in self.k]),
                     v=jnp.stack([jnp.transpose(x, (0, 2, 1, 3)) for x in self.v]))  # fmt: skip

    def shardings(self, mesh: AnyMesh, rules: Rules) -> DecodeCache:
        """`NamedSharding`s of this cache's arrays: slots over the rules' batch axes, heads like
        the policy's kv heads."""
        return DecodeCache(
            k=tuple(named_sharding(x.shape, KEY_AXES, mesh, rules) for x in self.k),
            v=tuple(named_sharding(x.shape, VALUE_AXES, mesh, rules) for x in self.v),
        )

    def resized(self, batch: int, length: int) -> DecodeCache:
        """A cache of `batch` slots and `length` positions holding this one's overlap (the first
        min(batch) slots and min(length) positions; the rest zero)."""
        b, s = min(batch, self.batch), min(length, self.length)

        def one(x, key_major: bool):
            shape = (batch, x.shape[1], x.shape[2], length) if key_major else (
                batch, x.shape[1], length, x.shape[3])  # fmt: skip
            part = x[:b, :, :, :s] if key_major else x[:b, :, :s]
            return jax.lax.dynamic_update_slice(jnp.zeros(shape, x.dtype), part, (0, 0, 0, 0))

        return DecodeCache(k=tuple(one(x, True) for x in self.k),
                           v=tuple(one(x, False) for x in self.v))  # fmt: skip

    def write_layer(self, i: int, slots_Bx1: jax.Array, positions_BxA: jax.Array,
                    k_BxAxKxH: jax.Array, v_BxAxKxH: jax.Array) -> DecodeCache:  # fmt: skip
        """Layer i's keys/values of A tokens per row written at `positions_BxA` of slots
        `slots_Bx1` (in place when donated); positions or slots out of range are dropped."""
        if positions_BxA.size == 1:
            # One write: XLA:CPU turns a one-index scatter into a dynamic-update-slice it
            # does on a copy of the array (the whole cache, at batch 1); the same write twice
            # stays a scatter, done in place.
            slots_Bx1, positions_BxA, k_BxAxKxH, v_BxAxKxH = (
                jnp.concatenate([x, x]) for x in (slots_Bx1, positions_BxA, k_BxAxKxH, v_BxAxKxH)
            )
        k = self.k[i].at[slots_Bx1, :, :, positions_BxA].set(k_BxAxKxH.astype(self.k[i].dtype),
                                                             mode="drop")  # fmt: skip
        v = self.v[i].at[slots_Bx1, :, positions_BxA].set(v_BxAxKxH.astype(self.v[i].dtype),
                                                          mode="drop")  # fmt: skip
        return DecodeCache(k=self.k[:i] + (k,) + self.k[i + 1 :],
                           v=self.v[:i] + (v,) + self.v[i + 1 :])  # fmt: skip

    def write_rows(self, i: int, positions_BxA: jax.Array, k_BxAxKxH: jax.Array,
                   v_BxAxKxH: jax.Array) -> DecodeCache:  # fmt: skip
        """`write_layer` with row b written into slot b (a step's rows are its slots).

        The batch is a batching dimension of the scatter (each row writes only its own slot),
        so on a batch-sharded mesh every device writes its own rows: no collective. Written
        over slot indices, the SPMD partitioner all-gathers every layer's indices and new keys
        and values instead, and on a 2-core host XLA:CPU then deadlocked: one device's
        independent all-gathers held both pool threads while the other device's partition
        waited for a thread (BENCHMARKS.md).
        """
        if positions_BxA.shape[1] == 1:  # as in `write_layer`: two equal writes stay a scatter
            positions_BxA = jnp.concatenate([positions_BxA, positions_BxA], axis=1)
            k_BxAxKxH, v_BxAxKxH = (jnp.concatenate([x, x], axis=1) for x in (k_BxAxKxH, v_BxAxKxH))

        def key_row(row_KxHxS, pos_A, new_AxKxH):
            return row_KxHxS.at[:, :, pos_A].set(jnp.transpose(new_AxKxH, (1, 2, 0)), mode="drop")

        def value_row(row_KxSxH, pos_A, new_AxKxH):
            return row_KxSxH.at[:, pos_A].set(jnp.transpose(new_AxKxH, (1, 0, 2)), mode="drop")

        k = jax.vmap(key_row)(self.k[i], positions_BxA, k_BxAxKxH.astype(self.k[i].dtype))
        v = jax.vmap(value_row)(self.v[i], positions_BxA, v_BxAxKxH.astype(self.v[i].dtype))
        return DecodeCache(k=self.k[:i] + (k,) + self.k[i + 1 :],
                           v=self.v[:i] + (v,) + self.v[i + 1 :])  # fmt: skip

    def write_positions(self, slots_Bx1: jax.Array, positions_BxA: jax.Array, k_LxBxAxKxH,
                        v_LxBxAxKxH) -> DecodeCache:  # fmt: skip
        """Token-major keys/values of every layer written like `write_layer`."""
        cache = self
        for i in range(self.num_layers):
            cache = cache.write_layer(i, slots_Bx1, positions_BxA, k_LxBxAxKxH[i], v_LxBxAxKxH[i])
        return cache

    def write_prefix(self, slots_B: jax.Array, new: NewKV) -> DecodeCache:
        """`new`'s T positions written at positions [0, T) of `slots_B` (prefill); slots out of
        range and positions past the cache are dropped.

        One scatter per array whose index is the slot alone and whose window is the row's
        whole [K, H, T] block: the same values as `write_positions` (an index per slot and
        position), and in the prefill program XLA:CPU compiles it 0.5 s faster at 8-16
        prompts (3.5 -> 3.1 s of a SmolLM2 prefill's compile; level at one prompt), at the
        same run time (BENCHMARKS.md, "What the main job compiles").
        """
        t = min(new.k.shape[2], self.length)
        slots_Bx1 = slots_B.astype(jnp.int32)[:, None]

        def scatter(cache, rows, window_axes):
            numbers = jax.lax.ScatterDimensionNumbers(
                update_window_dims=window_axes, inserted_window_dims=(0,),
                scatter_dims_to_operand_dims=(0,))  # fmt: skip
            return jax.lax.scatter(cache, slots_Bx1, rows.astype(cache.dtype), numbers,
                                   indices_are_sorted=False, unique_indices=False,
                                   mode=jax.lax.GatherScatterMode.FILL_OR_DROP)  # fmt: skip

        # new: [L, B, T, K, H]; keys go in as [B, K, H, T], values as [B, K, T, H].
        k = tuple(scatter(c, jnp.transpose(x[:, :t], (0, 2, 3, 1)), (1, 2, 3))
                  for c, x in zip(self.k, new.k, strict=True))  # fmt: skip
        v = tuple(scatter(c, jnp.transpose(x[:, :t], (0, 2, 1, 3)), (1, 2, 3))
                  for c, x in zip(self.v, new.v, strict=True))  # fmt: skip
        return DecodeCache(k=k, v=v)

    def write_prompts(self, slots_B: jax.Array, rows_B: jax.Array, new: NewKV) -> DecodeCache:
        """`write_prefix` of prompt row `rows_B[b]` of `new` into slot `slots_B[b]` (prefix
        sharing: the G samples of a GRPO group take one prompt row).

        Under `sharding.rows_per_device` with slots over `data`, each device writes its own
        slots from the distinct prompts' keys and values (U rows, gathered once). Left to the
        partitioner, the scatter gathered the B expanded rows (every sample of every prompt)
        onto every device, each layer: a group of G samples sent G times the bytes.
        """

        def write(cache, slots_B, rows_B, k, v):
            return cache.write_prefix(slots_B, NewKV(k=k[:, rows_B], v=v[:, rows_B]))

        split = rows_split(self.batch)
        if split is None:
            return write(self, slots_B, rows_B, new.k, new.v)

        def local(cache, first_1, slots_B, rows_B, k, v):
            first = first_1[0]  # this device's first slot
            mine = (slots_B >= first) & (slots_B < first + cache.batch)
            return write(cache, jnp.where(mine, slots_B - first, cache.batch), rows_B, k, v)

        slots, whole = split.spec, PartitionSpec()
        firsts = jnp.arange(split.devices, dtype=jnp.int32) * (self.batch // split.devices)
        layer_write = jax.shard_map(local, mesh=split.mesh,
                                    in_specs=(slots, slots) + (whole,) * 4, out_specs=slots,
                                    axis_names=set(split.axes), check_vma=False)  # fmt: skip
        # A layer at a time: each gathers one layer's prompt rows, not all layers' at once.
        layers = [layer_write(self.block(i, i + 1), firsts, slots_B, rows_B, new.k[i : i + 1],
                              new.v[i : i + 1]) for i in range(self.num_layers)]  # fmt: skip
        return DecodeCache.joined(layers)


def move_row(x: jax.Array, src, dst) -> jax.Array:
    """`x` with row `src` (leading axis) copied into row `dst`: a dynamic slice and update.

    The same copy as `x.at[dst].set(x[src])`, which lowers to a gather and a scatter: for the
    engine's per-slot scalars (typed PRNG keys among them) those took XLA:CPU 0.7 s of the
    slot-move program's 0.9 s compile, once per cache size (about 10 sizes a run).
    """
    return jax.lax.dynamic_update_index_in_dim(
        x, jax.lax.dynamic_index_in_dim(x, src, 0, keepdims=True), dst, 0)  # fmt: skip


def flat_layer(params: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """A layer's projections as 2-D matrices: q / k / v [D, heads x H], o [N x H, D], biases
    [heads x H] (reshapes of contiguous arrays; 2-D arrays pass through).

    Unrolled, the [D, N, H] / [N, H, D] forms made XLA:CPU transpose weight copies to its
    preferred product layout in every layer (a decode step at batch 1 took 40 ms against
    20 ms with 2-D weights, SmolLM2).
    """
    out = dict(params)
    for name in ("q", "k", "v"):
        if params[name].ndim == 3:
            out[name] = params[name].reshape(params[name].shape[0], -1)
    if params["o"].ndim == 3:
        out["o"] = params["o"].reshape(-1, params["o"].shape[-1])
    for name in ("q_bias", "k_bias", "v_bias"):
        if name in params and params[name].ndim == 2:
            out[name] = params[name].reshape(-1)
    return out


def unstack_layers(stacked: dict[str, jax.Array]) -> LayerParams:
    """Per-layer weight dicts (`flat_layer` form) from weights stacked on a leading L axis."""
    n = next(iter(stacked.values())).shape[0]
    return tuple(flat_layer({name: value[i] for name, value in stacked.items()})
                 for i in range(n))  # fmt: skip


def layer_shardings(stacked: dict[str, jax.Array]):
    """The shardings `unstack_layers` gives each layer's arrays: the stacked arrays' shardings
    without the (unsharded) layer axis, merged dims sharded over both dims' mesh axes (major
    first); None where an array has no named sharding."""

    def merged(parts):
        axes = []
        for part in parts:
            axes += [] if part is None else list(part) if isinstance(part, tuple) else [part]
        return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)

    def one(name, x):
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, jax.sharding.NamedSharding):
            return sharding
        spec = list(sharding.spec) + [None] * (x.ndim - len(sharding.spec))
        spec = spec[1:]
        if name in ("q", "k", "v") and len(spec) == 3:
            spec = [spec[0], merged(spec[1:])]
        elif name == "o" and len(spec) == 3:
            spec = [merged(spec[:2]), spec[2]]
        elif name.endswith("_bias") and len(spec) == 2:
            spec = [merged(spec)]
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))

    n = next(iter(stacked.values())).shape[0]
    return tuple({name: one(name, value) for name, value in stacked.items()} for _ in range(n))


def _inputs(p, x_BxTxD, sin_cos, config: ModelConfig, input_norm: bool):
    """`transformer.attention_inputs` with 2-D weights."""
    b, t, d = x_BxTxD.shape
    n, kv, h, dtype = config.num_heads, config.num_kv_heads, config.head_dim, config.jnp_dtype
    x = rms_norm(x_BxTxD, p["attn_norm"], config.rms_norm_eps) if input_norm else x_BxTxD
    x = x.reshape(b * t, d)

    def project(name, heads):
        y = x @ p[name].astype(dtype)
        if config.attention_bias:
            y = y + p[f"{name}_bias"].astype(dtype)
        return y.reshape(b, t, heads, h)

    q_axes, kv_axes = ("batch", "length", "q_heads", "head_dim"), ("batch", "length", "kv_heads",
                                                                   "head_dim")  # fmt: skip
    q = constrain(apply_rope(project("q", n), *sin_cos), q_axes)
    k = constrain(apply_rope(project("k", kv), *sin_cos), kv_axes)
    v = constrain(project("v", kv), kv_axes)
    return q, k, v


def _output(p, x_BxTxD, attn_BxTxNxH, config: ModelConfig):
    """`transformer.layer_output` with 2-D weights."""
    b, t, d = x_BxTxD.shape
    dtype = config.jnp_dtype
    w = {name: p[name].astype(dtype) for name in ("o", "gate", "up", "down")}
    x = x_BxTxD + (attn_BxTxNxH.reshape(b * t, -1) @ w["o"]).reshape(b, t, d)
    x = constrain(x, ("batch", "length", "embed"))
    hid = rms_norm(x, p["mlp_norm"], config.rms_norm_eps).reshape(b * t, d)
    hidden = constrain(jax.nn.silu(hid @ w["gate"]) * (hid @ w["up"]), ("batch", "mlp"))
    x = x + (hidden @ w["down"]).reshape(b, t, d)
    return constrain(x, ("batch", "length", "embed"))


def head_major_attention(q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array,
                         mask_BxTxT: jax.Array, cache_k_BxKxHxS: jax.Array,
                         cache_v_BxKxSxH: jax.Array,
                         cache_lens_B: jax.Array) -> jax.Array:  # fmt: skip
    """Softmax attention over a `DecodeCache` layer's positions `< cache_lens_B` plus the new
    tokens under `mask_BxTxT` (`transformer.attention`'s math, float32 scores).

    Shaped for the products to read the cache in place: the G query heads of a kv head and the
    T tokens are one row axis M = G x T, so both products are [B, K] batches of [M, H] x [H, S]
    and [M, S] x [S, H] (XLA:CPU gives these to its fused YNNPACK kernels; written with T as
    an axis of its own, as `transformer.attention` does, it ran them as generic dots and the
    whole decode step was 1.2x slower than the scanned form at batch 8-64, SmolLM2). The two
    parts' softmax shares one max and one sum, so no [.., S + T] concatenation is copied.
    """
    b, t, n, h = q_BxTxNxH.shape
    kv = k_BxTxKxH.shape[2]
    g = n // kv
    s = cache_k_BxKxHxS.shape[3]
    scale = jnp.asarray(h**-0.5, q_BxTxNxH.dtype)
    q_BxKxMxH = jnp.transpose((q_BxTxNxH * scale).reshape(b, t, kv, g, h), (0, 2, 3, 1, 4))
    q_BxKxMxH = q_BxKxMxH.reshape(b, kv, g * t, h)
    k_BxKxTxH = jnp.transpose(k_BxTxKxH, (0, 2, 1, 3))
    v_BxKxTxH = jnp.transpose(v_BxTxKxH, (0, 2, 1, 3)).astype(cache_v_BxKxSxH.dtype)
    neg = jnp.finfo(jnp.float32).min
    valid_Bx1x1xS = (jnp.arange(s)[None, :] < cache_lens_B[:, None])[:, None, None, :]
    logits_cache = jnp.where(valid_Bx1x1xS, _scores("BKMH,BKHS->BKMS", q_BxKxMxH,
                                                    cache_k_BxKxHxS), neg)  # fmt: skip
    mask_Bx1xMxT = jnp.broadcast_to(mask_BxTxT[:, None, None], (b, 1, g, t, t)).reshape(
        b, 1, g * t, t)  # fmt: skip
    logits_new = jnp.where(mask_Bx1xMxT, _scores("BKMH,BKTH->BKMT", q_BxKxMxH, k_BxKxTxH), neg)
    top = jnp.maximum(logits_cache.max(-1, keepdims=True), logits_new.max(-1, keepdims=True))
    p_cache, p_new = jnp.exp(logits_cache - top), jnp.exp(logits_new - top)
    norm = p_cache.sum(-1, keepdims=True) + p_new.sum(-1, keepdims=True)
    dtype = cache_v_BxKxSxH.dtype
    out = _scores("BKMS,BKSH->BKMH", (p_cache / norm).astype(dtype), cache_v_BxKxSxH)
    out = out + _scores("BKMT,BKTH->BKMH", (p_new / norm).astype(dtype), v_BxKxTxH)
    out = jnp.transpose(out.reshape(b, kv, g, t, h), (0, 3, 1, 2, 4))
    return out.reshape(b, t, n, h).astype(q_BxTxNxH.dtype)


def cached_layers(layers: LayerParams, x_BxTxD: jax.Array, sin_cos, mask_BxTxT: jax.Array,
                  config: ModelConfig, cache: DecodeCache, starts_B: jax.Array, *,
                  write: bool, attention_impl: str = "xla",
                  input_norm: bool = True) -> tuple[jax.Array, NewKV, DecodeCache]:  # fmt: skip
    """Runs `layers` (`flat_layer` form) unrolled over T new tokens per row against `cache`.

    Every query attends to cache positions `< starts_B[b]` and to the new tokens `mask_BxTxT`
    allows. With `write`, each layer first writes its new keys/values at positions
    `starts_B + t` (past the cache: dropped), then reads; positions at or past `starts_B` are
    never read, so the written forward computes the same numbers as the read-only one.

    Returns:
      (output x, NewKV of the T tokens [L, B, T, K, H], the cache (written with `write`)).
    """
    if len(layers) != cache.num_layers:
        raise ValueError(f"{len(layers)} layers of weights but the cache has {cache.num_layers}")
    b, t = x_BxTxD.shape[:2]
    if cache.batch != b:
        raise ValueError(f"cache has {cache.batch} slots for a batch of {b} rows")
    positions_BxT = starts_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    ks, vs = [], []
    for i, params in enumerate(layers):
        q, k, v = _inputs(params, x_BxTxD, sin_cos, config, input_norm)
        if write:
            cache = cache.write_rows(i, positions_BxT, k, v)
        cache_k, cache_v = cache.layer(i)
        if attention_impl == "xla":
            attn = head_major_attention(q, k, v, mask_BxTxT, cache_k, cache_v, starts_B)
        else:
            attn = attention(q, k, v, mask_BxTxT, cache_k, cache_v, starts_B, attention_impl,
                             cache_layout=cache.layout)  # fmt: skip
        x_BxTxD = _output(params, x_BxTxD, attn, config)
        ks.append(k)
        vs.append(v)
    return x_BxTxD, NewKV(k=jnp.stack(ks), v=jnp.stack(vs)), cache


def final_features(model: Transformer, x_BxTxD: jax.Array) -> jax.Array:
    """The last layer's output through the policy's final norm (what the head reads)."""
    return rms_norm(x_BxTxD, model.final_norm.get_value(), model.config.rms_norm_eps)


def block_program(layers: LayerParams, cache: DecodeCache, x_BxTxD: jax.Array,
                  positions_BxT: jax.Array, mask_BxTxT: jax.Array, starts_B: jax.Array, *,
                  config: ModelConfig, write: bool, attention_impl: str = "xla"):  # fmt: skip
    """`cached_layers` over a block of layers as a program of its own (`LayeredForward`).

    Returns (x, NewKV of the block's layers, the block's cache) with `write` (the cache is
    donated and written in place), (x, NewKV) without.
    """
    sin_cos = rope_sin_cos(positions_BxT, rope_inv_freq(config))
    x, new, cache = cached_layers(layers, x_BxTxD, sin_cos, mask_BxTxT, config, cache, starts_B,
                                  write=write, attention_impl=attention_impl)  # fmt: skip
    return (x, new, cache) if write else (x, new)


ForwardInputs = tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # x, positions, mask, starts


class LayeredForward:
    """Runs the policy's layers against a `DecodeCache` as compiled programs of `block` layers
    each, dispatched one after another from the host (`EngineConfig.layers_per_program`).

    Why: an unrolled step compiles every layer anew, and on XLA:CPU that is most of a rollout's
    first step (SmolLM2, 30 layers: 2-4 s a decode program, one per batch and kv bucket, and
    as much again for each verify and commit program). A block program is compiled once per
    (block size, batch, new tokens, kv) and reused by every block; the step's other parts
    (embedding, head, sampling, acceptance) are programs that depend on the batch alone. The
    price: on this CPU a layered step runs 5-15% slower than the one-program step (mostly the
    head and token choice running as a program of their own; a dispatch is ~30 us), so the
    engine promotes a bucket that keeps running to one program
    (`EngineConfig.one_program_after`); accelerators, where a dispatch per layer would show,
    start with one program (BENCHMARKS.md, "Two tiers of step programs").
    """

    def __init__(self, config: ModelConfig, block: int, program):
        """
        Args:
          config: the policy's architecture.
          block: layers per program.
          program: `program(key, fn, *args, donate=())` -> compiled program (the engine's pool).
        """
        self.config = config
        self.block = block
        self._program = program

    def __call__(self, layers: LayerParams, cache: DecodeCache, inputs: ForwardInputs, *,
                 write: bool, attention_impl: str = "xla",
                 ) -> tuple[jax.Array, list[NewKV], DecodeCache]:  # fmt: skip
        """The layers over `inputs` (x, positions, mask, starts; `cached_layers`' meaning).

        Returns the last layer's output, each block's NewKV and the cache (written with
        `write`, in place: the blocks' caches are donated).
        """
        x, positions, mask, starts = inputs
        b, t = x.shape[:2]
        news, blocks = [], []
        fn = functools.partial(block_program, config=self.config, write=write,
                               attention_impl=attention_impl)  # fmt: skip
        for start in range(0, len(layers), self.block):
            stop = min(start + self.block, len(layers))
            args = (layers[start:stop], cache.block(start, stop), x, positions, mask, starts)
            key = ("layers", stop - start, b, t, cache.length, write, attention_impl)
            out = self._program(key, fn, *args, donate=(1,) if write else ())(*args)
            x, new = out[:2]
            news.append(new)
            if write:
                blocks.append(out[2])
        return x, news, DecodeCache.joined(blocks) if write else cache


def cached_forward(model: Transformer, layers: LayerParams, tokens_BxT: jax.Array,
                   positions_BxT: jax.Array, cache: DecodeCache, starts_B: jax.Array, *,
                   mask_BxTxT: jax.Array | None = None, write: bool = False,
                   attention_impl: str = "xla",
                   ) -> tuple[jax.Array, NewKV, DecodeCache]:  # fmt: skip
    """The policy's forward over T new tokens per row against a `DecodeCache`.

    Args:
      model: the policy (its embedding, final norm and head; its stacked layers are unused).
      layers: the policy's per-layer weights (`unstack_layers` of the same policy).
      tokens_BxT / positions_BxT: token ids and their RoPE positions.
      cache: B slots' keys and values; row b's first `starts_B[b]` positions are valid.
      starts_B: valid cached length per row.
      mask_BxTxT: which new tokens each new token attends to (default causal; a tree mask for
        verification).
      write: write the new tokens' keys/values at `starts_B + t` (decode steps, the drafter's
        extend) instead of leaving the cache alone (verification: its commit writes only the
        accepted path, in a separate program).
      attention_impl: "xla" or "pallas".

    Returns:
      (final-norm features [B, T, D], NewKV of the T tokens, the cache).
    """
    config = model.config
    b, t = tokens_BxT.shape
    mask = causal_mask(b, t) if mask_BxTxT is None else mask_BxTxT
    sin_cos = rope_sin_cos(positions_BxT, rope_inv_freq(config))
    x, new, cache = cached_layers(layers, model.embed_tokens(tokens_BxT), sin_cos, mask, config,
                                  cache, starts_B, write=write,
                                  attention_impl=attention_impl)  # fmt: skip
    return final_features(model, x), new, cache
