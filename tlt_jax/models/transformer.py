"""Llama / Qwen2-family decoder (Flax NNX) with an explicit KV cache.

Dimension legend: B batch, T query tokens, S cached kv length, L layers, N query heads,
K kv heads, G = N // K query heads per kv head, H head dim, D model, F mlp, V vocab.

Layer weights are stacked along a leading L axis and the forward scans over them, so a
30-layer model compiles like a one-layer one. The forward never mutates anything: it returns
the final-norm features (the drafter's input and the LM head's input) and the new keys and
values of the T query tokens; writing them into a cache is the caller's explicit step
(`write_kv`), which lets tree verification commit only the accepted path.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from tlt_jax.models.config import ModelConfig
from tlt_jax.parallel.sharding import (
    AnyMesh,
    Rules,
    abstract_module_state,
    constrain,
    named_sharding,
)

ATTENTION_IMPLS = ("xla", "pallas")
# Cache array layouts `attention` reads: `KVCache`'s and `DecodeCache`'s (models/decode.py).
CACHE_LAYOUTS = ("token_major", "head_major")
# Logical axes of `KVCache.k` and `KVCache.v`.
KV_AXES = ("layers", "batch", "kv_length", "kv_heads", "head_dim")


@struct.dataclass
class KVCache:
    """Keys and values of every layer for B slots of S positions, token-major like `NewKV`.

    The layout is known here only: the writers (`write_kv`, `write_positions`,
    `write_prefix`, `moved`, `from_new`; each returns a whole cache, never a view), the
    per-layer reads (`layer`) and the sharding axes (`shardings`). A keys-transposed layout
    ([L, B, K, H, S], values [L, B, K, S, H]) ran attention 1.4-2.0x faster alone but not the
    engine's step (BENCHMARKS.md).
    """

    k: jax.Array  # [L, B, S, K, H]
    v: jax.Array  # [L, B, S, K, H]
    layout = "token_major"  # what `attention(cache_layout=...)` reads
    # A view's slots and positions (`view`); None: all of them.
    view_batch: int | None = struct.field(pytree_node=False, default=None)
    view_length: int | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, length: int, dtype=None) -> KVCache:
        shape = (config.num_layers, batch, length, config.num_kv_heads, config.head_dim)
        dtype = dtype or config.jnp_dtype
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @classmethod
    def from_new(cls, new: NewKV) -> KVCache:
        """A cache holding exactly the T positions of a forward's keys and values."""
        return cls(k=new.k, v=new.v)

    @property
    def length(self) -> int:
        return self.k.shape[2] if self.view_length is None else self.view_length

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    def token_major(self) -> NewKV:
        """The whole cache as [L, B, S, K, H] keys and values (for checks and exports)."""
        return NewKV(k=self.k, v=self.v)

    def shardings(self, mesh: AnyMesh, rules: Rules) -> KVCache:
        """`NamedSharding`s of this cache's arrays (or `ShapeDtypeStruct`s): slots over the
        rules' batch axes, heads like the policy's kv heads (each tensor-parallel device holds
        the keys and values of its own heads)."""
        return self.replace(k=named_sharding(self.k.shape, KV_AXES, mesh, rules),
                            v=named_sharding(self.v.shape, KV_AXES, mesh, rules))  # fmt: skip

    def view(self, batch: int, length: int) -> KVCache:
        """The first `batch` slots and `length` positions (static sizes: one program each).

        Lazy: the arrays stay whole and each layer is cut where it is read (`layer`). Sliced
        up front, the view was a copy the layer loop needed as its operand (XLA:CPU: 377 MB at
        batch 32 and 256 positions of SmolLM2, as much traffic as its weights).
        """
        return self.replace(view_batch=batch, view_length=length)

    def layer(self, i) -> tuple[jax.Array, jax.Array]:
        """Layer `i`'s keys and values, cut to the view: [batch, length, K, H] each.

        One dynamic slice of the whole array per read, indexed by the layer: XLA cannot hoist
        it out of the layer loop (it did hoist a static cut of a scanned-over layer, rebuilding
        the copy `view` avoids), so each layer's window is read where its attention reads it.
        """
        _, b, _, k, h = self.k.shape
        sizes = (1, b if self.view_batch is None else self.view_batch, self.length, k, h)

        def cut(arr):
            return jax.lax.dynamic_slice(arr, (i, 0, 0, 0, 0), sizes)[0]

        return cut(self.k), cut(self.v)

    def write_positions(self, slots_Bx1: jax.Array, positions_BxA: jax.Array, k_LxBxAxKxH,
                        v_LxBxAxKxH) -> KVCache:  # fmt: skip
        """Writes token-major keys/values of A tokens per row at `positions_BxA` of slots
        `slots_Bx1`: one scatter per array (in place when the cache is donated); positions
        at or past the cache length are dropped."""

        def write(cache_arr, new_arr):
            return cache_arr.at[:, slots_Bx1, positions_BxA].set(new_arr.astype(cache_arr.dtype),
                                                                 mode="drop")  # fmt: skip

        return KVCache(k=write(self.k, k_LxBxAxKxH), v=write(self.v, v_LxBxAxKxH))

    def write_prefix(self, slots_B: jax.Array, new: NewKV) -> KVCache:
        """Writes `new`'s T positions at positions [0, T) of `slots_B` (prefill); slots out of
        range are dropped."""

        def write(cache_arr, new_arr):
            return cache_arr.at[:, slots_B, : new_arr.shape[2]].set(
                new_arr.astype(cache_arr.dtype), mode="drop")  # fmt: skip

        return KVCache(k=write(self.k, new.k), v=write(self.v, new.v))

    def moved(self, src, dst, *, kv_len: int) -> KVCache:
        """Slot `src`'s first `kv_len` positions copied into slot `dst`."""

        def move(arr):
            row = jax.lax.dynamic_slice_in_dim(arr, src, 1, axis=1)[:, :, :kv_len]
            return jax.lax.dynamic_update_slice(arr, row, (0, dst, 0, 0, 0))

        return KVCache(k=move(self.k), v=move(self.v))


class NewKV(NamedTuple):
    """Keys and values computed for the query tokens of one forward (token-major)."""

    k: jax.Array  # [L, B, T, K, H]
    v: jax.Array  # [L, B, T, K, H]


def write_kv(cache: KVCache, new: NewKV, start_B: jax.Array) -> KVCache:
    """Writes T new positions of the first B slots at per-slot offsets `start_B`.

    One scatter per array, so with the cache donated the update happens in place: a decode
    step costs O(T), not a copy of the whole cache. Positions past the cache length are
    dropped (never shifted onto earlier, valid positions).
    """
    b, t = new.k.shape[1], new.k.shape[2]
    slots_Bx1 = jnp.arange(b)[:, None]
    positions_BxT = start_B[:, None] + jnp.arange(t)[None, :]
    return cache.write_positions(slots_Bx1, positions_BxT, new.k, new.v)


# ----------------------------------------------------------------------------- math


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies [H/2], with the checkpoint's scaling applied."""
    h = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
    scaling = config.rope_scaling
    if scaling is None or scaling.rope_type == "default":
        return inv.astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv / scaling.factor).astype(np.float32)
    # llama3: long wavelengths are divided by `factor`, short ones kept, smooth in between.
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    scaled = np.where(mid, (1 - smooth) * inv / scaling.factor + smooth * inv, scaled)
    return scaled.astype(np.float32)


def rope_sin_cos(positions_BxT: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    angles_BxTxH2 = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.sin(angles_BxTxH2), jnp.cos(angles_BxTxH2)


def apply_rope(x_BxTxNxH: jax.Array, sin_BxTxH2: jax.Array, cos_BxTxH2: jax.Array) -> jax.Array:
    """HF-style (rotate-half) rotary embedding, computed in float32."""
    x = x_BxTxNxH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    sin, cos = sin_BxTxH2[:, :, None, :], cos_BxTxH2[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxH.dtype)


def causal_mask(batch: int, length: int) -> jax.Array:
    return jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))


def segment_causal_mask(segment_ids_BxT: jax.Array) -> jax.Array:
    """Causal and block-diagonal: packed samples never attend across segments."""
    b, t = segment_ids_BxT.shape
    same = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
    return causal_mask(b, t) & same


@struct.dataclass
class CausalMask:
    """The causal [B, T, T] mask, built a block of query rows at a time (`rows`)."""

    length: int = struct.field(pytree_node=False)

    def rows(self, start, size: int) -> jax.Array:
        """Rows [start, start + size) as [1, size, T] (broadcasts over the batch)."""
        q = start + jnp.arange(size)
        return (jnp.arange(self.length)[None, :] <= q[:, None])[None]


@struct.dataclass
class PackedMask:
    """Packed rows' mask, built a block of query rows at a time: causal, within a piece, and
    a response sees only its piece's prompt (segment 0) and itself (padding, piece -1, sees
    earlier padding only)."""

    piece_BxT: jax.Array
    segment_BxT: jax.Array

    def rows(self, start, size: int) -> jax.Array:
        """Rows [start, start + size) as [B, size, T]."""
        piece, segment = self.piece_BxT, self.segment_BxT
        q_piece = jax.lax.dynamic_slice_in_dim(piece, start, size, axis=1)
        q_segment = jax.lax.dynamic_slice_in_dim(segment, start, size, axis=1)
        causal = CausalMask(piece.shape[1]).rows(start, size)
        same_piece = q_piece[:, :, None] == piece[:, None, :]
        own_or_prompt = (q_segment[:, :, None] == segment[:, None, :]) | (segment[:, None, :] == 0)
        return causal & same_piece & own_or_prompt


@struct.dataclass
class PrefixedMask:
    """A [B, T, S + T] mask: which of S prefix keys (`RowPrefix`) each query sees, then
    `inner` over the T new keys; built a block of query rows at a time like `inner`."""

    prefix_BxTxS: jax.Array
    inner: jax.Array | CausalMask | PackedMask

    def rows(self, start, size: int) -> jax.Array:
        """Rows [start, start + size) as [B, size, S + T]."""
        prefix = jax.lax.dynamic_slice_in_dim(self.prefix_BxTxS, start, size, axis=1)
        inner = mask_rows(self.inner, start, size)
        inner = jnp.broadcast_to(inner, (prefix.shape[0], size, inner.shape[-1]))
        return jnp.concatenate([prefix, inner], axis=2)


AnyMask = jax.Array | CausalMask | PackedMask | PrefixedMask


@struct.dataclass
class RowPrefix:
    """Keys and values each row reads from other rows of the same call: a packed training row
    whose first piece continues a group whose prompt is laid out in another row of the
    micro-batch reads that prompt's keys and values instead of repeating its tokens.

    Attributes:
      index_BxS: int32, positions (row * T + column, rows counted within the row's shard)
        of the call's tokens whose keys and values row b also attends to (any in-range value
        where nothing attends).
      mask_BxTxS: bool, which of them each new token attends to.
      shards: the rows form this many equal contiguous blocks (the mesh's data shards) and
        read only within their own, so the gather is a batched one the data axis splits
        without moving keys between devices.
    """

    index_BxS: jax.Array
    mask_BxTxS: jax.Array
    shards: int = struct.field(pytree_node=False, default=1)

    def gather(self, x_BxTx: jax.Array, index_BxS: jax.Array | None = None) -> jax.Array:
        """[B, S, ...]: a [B, T, ...] per-token array at the prefix positions (or at
        `index_BxS`, positions in the same form)."""
        index = self.index_BxS if index_BxS is None else index_BxS
        b, t = x_BxTx.shape[:2]
        g = self.shards
        blocks = x_BxTx.reshape(g, b // g * t, *x_BxTx.shape[2:])
        out = jax.vmap(lambda xs, i: jnp.take(xs, i, axis=0))(blocks, index.reshape(g, -1))
        return out.reshape(b, index.shape[1], *x_BxTx.shape[2:])


def mask_rows(mask: AnyMask, start, size: int) -> jax.Array:
    """Query rows [start, start + size) of any mask as a (broadcastable) [B, size, T] array."""
    if isinstance(mask, CausalMask | PackedMask | PrefixedMask):
        return mask.rows(start, size)
    return jax.lax.dynamic_slice_in_dim(mask, start, size, axis=1)


def full_mask(mask: AnyMask, length: int) -> jax.Array:
    return mask if isinstance(mask, jax.Array) else mask.rows(0, length)


def attention(
    q_BxTxNxH: jax.Array,
    k_BxTxKxH: jax.Array,
    v_BxTxKxH: jax.Array,
    mask_BxTxT: jax.Array,
    cache_k_BxSxKxH: jax.Array | None = None,
    cache_v_BxSxKxH: jax.Array | None = None,
    cache_lens_B: jax.Array | None = None,
    impl: str = "xla",
    cache_mask_BxTxS: jax.Array | None = None,
    query_chunk: int = 0,
    cache_layout: str = "token_major",
) -> jax.Array:
    """Softmax attention over the valid cached prefix plus the masked new tokens.

    A query attends to cache positions `< cache_lens_B[b]`, or, with `cache_mask_BxTxS`
    (xla only), to exactly the cache positions that mask allows it. `mask_BxTxT` is an array
    or a mask built by rows (`CausalMask`, `PackedMask`). The cache arrays are token-major
    ([B, S, K, H], `KVCache`) or, with `cache_layout="head_major"`, keys [B, K, H, S] and
    values [B, K, S, H] (`tlt_jax.models.decode.DecodeCache`: what the products read in place).

    With `query_chunk` (xla only) the queries go `gcd(T, query_chunk)` at a time, each block
    rematerialized in the backward pass: the [B, N, T, T] float32 scores (and the mask) are
    never all live, only one block's (long training rows: 16k tokens are 34 GB a layer).
    """
    if impl == "pallas" and cache_mask_BxTxS is not None:
        raise ValueError("cache_mask_BxTxS is supported by impl='xla' only")
    if cache_layout not in CACHE_LAYOUTS:
        raise ValueError(f"{cache_layout=} is not one of {list(CACHE_LAYOUTS)}")
    t = q_BxTxNxH.shape[1]
    if impl == "pallas" and cache_k_BxSxKxH is not None:
        from pallas_kernels.tree_attention import tree_attention

        if cache_layout == "head_major":  # the kernel reads token-major blocks
            cache_k_BxSxKxH = jnp.transpose(cache_k_BxSxKxH, (0, 3, 1, 2))
            cache_v_BxSxKxH = jnp.transpose(cache_v_BxSxKxH, (0, 2, 1, 3))

        # A mask built by rows (`CausalMask`, with `query_chunk`) is [1, T, T]; the kernel
        # takes one [T, T] mask per row.
        mask = jnp.broadcast_to(full_mask(mask_BxTxT, t), (q_BxTxNxH.shape[0], t, t))
        return tree_attention(
            q_BxTxNxH, cache_k_BxSxKxH, cache_v_BxSxKxH, cache_lens_B,
            k_BxTxKxH, v_BxTxKxH, mask,
        )  # fmt: skip
    chunk = math.gcd(t, query_chunk) if query_chunk else t
    if chunk >= t:
        return _dense_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, full_mask(mask_BxTxT, t),
                                cache_k_BxSxKxH, cache_v_BxSxKxH, cache_lens_B,
                                cache_mask_BxTxS, cache_layout)  # fmt: skip

    @jax.checkpoint
    def block(start):
        q = jax.lax.dynamic_slice_in_dim(q_BxTxNxH, start, chunk, axis=1)
        cache_mask = (
            None
            if cache_mask_BxTxS is None
            else jax.lax.dynamic_slice_in_dim(cache_mask_BxTxS, start, chunk, axis=1)
        )
        return _dense_attention(q, k_BxTxKxH, v_BxTxKxH, mask_rows(mask_BxTxT, start, chunk),
                                cache_k_BxSxKxH, cache_v_BxSxKxH, cache_lens_B,
                                cache_mask, cache_layout)  # fmt: skip

    out_CxBxcxNxH = jax.lax.map(block, jnp.arange(0, t, chunk))
    b, n, h = q_BxTxNxH.shape[0], q_BxTxNxH.shape[2], q_BxTxNxH.shape[3]
    return jnp.moveaxis(out_CxBxcxNxH, 0, 1).reshape(b, t, n, h)


def _scores(equation: str, q: jax.Array, k: jax.Array) -> jax.Array:
    """An attention product in float32: the logits, and the probabilities times the values
    (whose cache and new-token parts are added before one rounding to the values' dtype).
    XLA:CPU runs some batched products (a cache read in place) with a dot kernel that has no
    bfloat16 x bfloat16 -> float32 form, so on CPU low-precision operands are converted to
    float32 first (the cache copy that used to do it is gone)."""

    def native():
        return jnp.einsum(equation, q, k, preferred_element_type=jnp.float32)

    if q.dtype == jnp.float32 and k.dtype == jnp.float32:
        return native()

    def upcast():
        return jnp.einsum(equation, q.astype(jnp.float32), k.astype(jnp.float32))

    return jax.lax.platform_dependent(cpu=upcast, default=native)


def _dense_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, mask_BxTxT, cache_k_BxSxKxH,
                     cache_v_BxSxKxH, cache_lens_B, cache_mask_BxTxS,
                     cache_layout: str = "token_major") -> jax.Array:  # fmt: skip
    b, t, n, h = q_BxTxNxH.shape
    k = k_BxTxKxH.shape[2]
    q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, k, n // k, h) * jnp.asarray(h**-0.5, q_BxTxNxH.dtype)
    neg = jnp.finfo(jnp.float32).min
    logits_new = _scores("BTKGH,BtKH->BKGTt", q_BxTxKxGxH, k_BxTxKxH)
    logits_new = jnp.where(mask_BxTxT[:, None, None], logits_new, neg)
    if cache_k_BxSxKxH is None:
        probs = jax.nn.softmax(logits_new, axis=-1).astype(v_BxTxKxH.dtype)
        out = jnp.einsum("BKGTt,BtKH->BTKGH", probs, v_BxTxKxH)
        return out.reshape(b, t, n, h)
    head_major = cache_layout == "head_major"
    s = cache_k_BxSxKxH.shape[3 if head_major else 1]
    logits_cache = _scores("BTKGH,BKHS->BKGTS" if head_major else "BTKGH,BSKH->BKGTS",
                           q_BxTxKxGxH, cache_k_BxSxKxH.astype(q_BxTxNxH.dtype))  # fmt: skip
    if cache_mask_BxTxS is None:
        valid = (jnp.arange(s)[None, :] < cache_lens_B[:, None])[:, None, None, None, :]
    else:
        valid = cache_mask_BxTxS[:, None, None]
    logits_cache = jnp.where(valid, logits_cache, neg)
    probs = jax.nn.softmax(jnp.concatenate([logits_cache, logits_new], axis=-1), axis=-1)
    probs = probs.astype(v_BxTxKxH.dtype)
    # Both parts in float32, rounded once after the sum (bfloat16 products each rounded, then
    # added in bfloat16, put up to three roundings on the output).
    out = _scores("BKGTS,BKSH->BTKGH" if head_major else "BKGTS,BSKH->BTKGH", probs[..., :s],
                  cache_v_BxSxKxH.astype(probs.dtype))  # fmt: skip
    out = out + _scores("BKGTt,BtKH->BTKGH", probs[..., s:], v_BxTxKxH)
    return out.reshape(b, t, n, h).astype(v_BxTxKxH.dtype)


def attention_inputs(params: dict[str, jax.Array], x_BxTxD: jax.Array,
                     sin_cos: tuple[jax.Array, jax.Array], config: ModelConfig,
                     input_norm: bool = True,
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """A layer's rotated queries and keys, and values, of its input tokens: (q, k, v)."""
    dtype = config.jnp_dtype
    p = {name: value.astype(dtype) for name, value in params.items() if "norm" not in name}
    h_BxTxD = rms_norm(x_BxTxD, params["attn_norm"], config.rms_norm_eps) if input_norm else x_BxTxD
    q = jnp.einsum("BTD,DNH->BTNH", h_BxTxD, p["q"])
    k = jnp.einsum("BTD,DKH->BTKH", h_BxTxD, p["k"])
    v = jnp.einsum("BTD,DKH->BTKH", h_BxTxD, p["v"])
    if config.attention_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    q = constrain(apply_rope(q, *sin_cos), ("batch", "length", "q_heads", "head_dim"))
    k = constrain(apply_rope(k, *sin_cos), ("batch", "length", "kv_heads", "head_dim"))
    v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
    return q, k, v


def layer_output(params: dict[str, jax.Array], x_BxTxD: jax.Array, attn_BxTxNxH: jax.Array,
                 config: ModelConfig) -> jax.Array:  # fmt: skip
    """The rest of a layer after attention: output projection, residual and the MLP."""
    dtype = config.jnp_dtype
    p = {name: params[name].astype(dtype) for name in ("o", "gate", "up", "down")}
    x_BxTxD = x_BxTxD + jnp.einsum("BTNH,NHD->BTD", attn_BxTxNxH, p["o"])
    x_BxTxD = constrain(x_BxTxD, ("batch", "length", "embed"))
    h_BxTxD = rms_norm(x_BxTxD, params["mlp_norm"], config.rms_norm_eps)
    gate_BxTxF = jnp.einsum("BTD,DF->BTF", h_BxTxD, p["gate"])
    up_BxTxF = jnp.einsum("BTD,DF->BTF", h_BxTxD, p["up"])
    hidden_BxTxF = constrain(jax.nn.silu(gate_BxTxF) * up_BxTxF, ("batch", "length", "mlp"))
    x_BxTxD = x_BxTxD + jnp.einsum("BTF,FD->BTD", hidden_BxTxF, p["down"])
    return constrain(x_BxTxD, ("batch", "length", "embed"))


def decoder_layer(
    params: dict[str, jax.Array],
    x_BxTxD: jax.Array,
    sin_cos: tuple[jax.Array, jax.Array],
    mask_BxTxT: jax.Array,
    config: ModelConfig,
    cache_k_BxSxKxH: jax.Array | None = None,
    cache_v_BxSxKxH: jax.Array | None = None,
    cache_lens_B: jax.Array | None = None,
    attention_impl: str = "xla",
    input_norm: bool = True,
    cache_mask_BxTxS: jax.Array | None = None,
    query_chunk: int = 0,
    cache_layout: str = "token_major",
    prefix: RowPrefix | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """One pre-norm decoder layer; returns the output and the new keys/values. With `prefix`
    (and no cache) each row also attends to the prefix's positions of this layer's own keys
    and values (other rows'), laid before the row's own keys under a `PrefixedMask`."""
    q, k, v = attention_inputs(params, x_BxTxD, sin_cos, config, input_norm)
    new_kv = (k, v)
    if prefix is not None:  # the prefix's keys go before the row's own, one product for both
        k = jnp.concatenate([prefix.gather(k), k], axis=1)
        v = jnp.concatenate([prefix.gather(v), v], axis=1)
        mask_BxTxT = PrefixedMask(prefix.mask_BxTxS, mask_BxTxT)
    attn = attention(
        q, k, v, mask_BxTxT, cache_k_BxSxKxH, cache_v_BxSxKxH, cache_lens_B, attention_impl,
        cache_mask_BxTxS, query_chunk, cache_layout,
    )  # fmt: skip
    return layer_output(params, x_BxTxD, attn, config), new_kv


def tied_head(x_BxTxD: jax.Array, embed_VxD: jax.Array) -> jax.Array:
    """Float32 logits [B, T, V] of features against a tied [V, D] embedding.

    On XLA:CPU a product of R >= 2 rows with the [V, D] matrix runs about 30% faster written
    with the big matrix on the left ("VD,BTD->VBT", then the small [V, R] result transposed;
    SmolLM2's head at 8 and 32 rows), which `scripts/bench_rollout.py` saw as 8-11% faster
    decoding. A single row (batch-1 decoding) keeps the matrix-vector form, and other
    backends, which choose layouts themselves, the plain einsum.
    """
    b, t, _ = x_BxTxD.shape

    def rows_major():
        return jnp.einsum("BTD,VD->BTV", x_BxTxD, embed_VxD, preferred_element_type=jnp.float32)

    if b * t < 2:
        return rows_major()

    def vocab_major():
        logits_VxBxT = jnp.einsum(
            "VD,BTD->VBT", embed_VxD, x_BxTxD, preferred_element_type=jnp.float32
        )
        return jnp.transpose(logits_VxBxT, (1, 2, 0))

    return jax.lax.platform_dependent(cpu=vocab_major, default=rows_major)


# ----------------------------------------------------------------------------- modules


def _param(rngs: nnx.Rngs, shape, axes, dtype, init: str = "normal") -> nnx.Param:
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=axes)


class DecoderLayers(nnx.Module):
    """`num_layers` decoder layers with weights stacked on a leading L axis."""

    def __init__(self, config: ModelConfig, num_layers: int, *, rngs: nnx.Rngs):
        d, f, n, k, h = (config.hidden_size, config.intermediate_size, config.num_heads,
                         config.num_kv_heads, config.head_dim)  # fmt: skip
        dt, L = config.jnp_param_dtype, num_layers
        self.attn_norm = _param(rngs, (L, d), ("layers", "norm"), dt, "ones")
        self.q = _param(rngs, (L, d, n, h), ("layers", "embed", "q_heads", "head_dim"), dt)
        self.k = _param(rngs, (L, d, k, h), ("layers", "embed", "kv_heads", "head_dim"), dt)
        self.v = _param(rngs, (L, d, k, h), ("layers", "embed", "kv_heads", "head_dim"), dt)
        if config.attention_bias:
            self.q_bias = _param(rngs, (L, n, h), ("layers", "q_heads", "head_dim"), dt, "zeros")
            self.k_bias = _param(rngs, (L, k, h), ("layers", "kv_heads", "head_dim"), dt, "zeros")
            self.v_bias = _param(rngs, (L, k, h), ("layers", "kv_heads", "head_dim"), dt, "zeros")
        self.o = _param(rngs, (L, n, h, d), ("layers", "q_heads", "head_dim", "embed"), dt)
        self.mlp_norm = _param(rngs, (L, d), ("layers", "norm"), dt, "ones")
        self.gate = _param(rngs, (L, d, f), ("layers", "embed", "mlp"), dt)
        self.up = _param(rngs, (L, d, f), ("layers", "embed", "mlp"), dt)
        self.down = _param(rngs, (L, f, d), ("layers", "mlp", "embed"), dt)

    def stacked(self) -> dict[str, jax.Array]:
        """The layer weights as a dict of [L, ...] arrays (the scan's input)."""
        return {path[0]: var.get_value() for path, var in nnx.to_flat_state(nnx.state(self))}


class Transformer(nnx.Module):
    """The policy: token ids -> final-norm features (and logits through `logits`)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        d, v, dt = config.hidden_size, config.vocab_size, config.jnp_param_dtype
        self.embed = _param(rngs, (v, d), ("vocab", "embed"), dt)
        self.layers = DecoderLayers(config, config.num_layers, rngs=rngs)
        self.final_norm = _param(rngs, (d,), ("norm",), dt, "ones")
        if not config.tie_word_embeddings:
            self.lm_head = _param(rngs, (d, v), ("embed", "vocab"), dt)

    def embed_tokens(self, tokens_BxT: jax.Array) -> jax.Array:
        x = jnp.take(self.embed.get_value(), tokens_BxT, axis=0).astype(self.config.jnp_dtype)
        return constrain(x, ("batch", "length", "embed"))

    def head_weight_DxV(self) -> jax.Array:
        if self.config.tie_word_embeddings:
            return self.embed.get_value().T
        return self.lm_head.get_value()

    def logits(self, features_BxTxD: jax.Array) -> jax.Array:
        """LM head in the compute dtype, returned as float32 [B, T, V]."""
        x = features_BxTxD.astype(self.config.jnp_dtype)
        if self.config.tie_word_embeddings:
            logits = tied_head(x, self.embed.get_value().astype(x.dtype))
        else:
            w = self.lm_head.get_value().astype(x.dtype)
            logits = jnp.einsum("BTD,DV->BTV", x, w, preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "length", "vocab"))

    def __call__(
        self,
        tokens_BxT: jax.Array,
        positions_BxT: jax.Array,
        *,
        mask_BxTxT: jax.Array | None = None,
        cache: KVCache | None = None,
        cache_lens_B: jax.Array | None = None,
        attention_impl: str = "xla",
        remat: bool = False,
        query_chunk: int = 0,
        prefix: RowPrefix | None = None,
    ) -> tuple[jax.Array, NewKV]:
        """Runs the decoder over T new tokens per row.

        Args:
          tokens_BxT: token ids.
          positions_BxT: RoPE positions of the tokens.
          mask_BxTxT: which new tokens each new token attends to (default causal). A tree
            mask for verification, a block-diagonal one for packed training windows.
          cache: keys/values of earlier positions (`KVCache`); every query also attends to
            cache positions `< cache_lens_B[b]`.
          cache_lens_B: valid cached length per row (required with `cache`).
          attention_impl: "xla" (jnp) or "pallas" (the tree-attention kernel, cached path).
          remat: recompute each layer in the backward pass instead of keeping its
            activations (a gradient then holds one layer's, plus every layer's input).
          query_chunk: attention `query_chunk` queries at a time (`attention`); with the
            default causal mask (or a `PackedMask`) no [B, T, T] mask is built either.
          prefix: positions of other rows each row also attends to (`RowPrefix`, packed
            training rows that share a prompt); not with `cache`.

        Returns:
          (features_BxTxD: final-norm hidden states, NewKV of the T tokens for every layer).
        """
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"{attention_impl=} is not one of {list(ATTENTION_IMPLS)}")
        if (cache is None) != (cache_lens_B is None):
            raise ValueError("cache and cache_lens_B must be given together")
        if cache is not None and prefix is not None:
            raise ValueError("a call reads a cache or a row prefix, not both")
        config = self.config
        b, t = tokens_BxT.shape
        if mask_BxTxT is None:
            mask_BxTxT = CausalMask(t) if query_chunk else causal_mask(b, t)
        sin_cos = rope_sin_cos(positions_BxT, rope_inv_freq(config))
        x_BxTxD = self.embed_tokens(tokens_BxT)

        def body(x, layer):
            params, index = layer
            cache_k, cache_v = (None, None) if cache is None else cache.layer(index)
            x, kv = decoder_layer(params, x, sin_cos, mask_BxTxT, config, cache_k, cache_v,
                                  cache_lens_B, attention_impl,
                                  query_chunk=query_chunk, prefix=prefix)  # fmt: skip
            return x, kv

        if remat:
            body = jax.checkpoint(body, prevent_cse=False)

        # The cache is read per layer in place (`KVCache.layer`), not scanned over.
        xs = (self.layers.stacked(), jnp.arange(config.num_layers, dtype=jnp.int32))
        x_BxTxD, (k_new, v_new) = jax.lax.scan(body, x_BxTxD, xs)
        features = rms_norm(x_BxTxD, self.final_norm.get_value(), config.rms_norm_eps)
        return features, NewKV(k=k_new, v=v_new)


def init_model(config: ModelConfig, seed: int = 0) -> Transformer:
    return Transformer(config, rngs=nnx.Rngs(params=seed))


def abstract_state(
    config: ModelConfig, mesh: AnyMesh | None = None, rules: Rules | None = None
) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and its state as `ShapeDtypeStruct`s; nothing is allocated.

    Args:
      config: the architecture.
      mesh: a device or abstract mesh; with it every leaf carries its `NamedSharding`.
      rules: the role's logical-axis rules (required with `mesh`).

    Returns:
      (graphdef, state) ready for `jax.jit(...).lower` or for loading into.
    """
    module = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    return abstract_module_state(module, mesh, rules)
