"""EAGLE drafter (Flax NNX): one decoder layer of the target's architecture over fused inputs.

Dimension legend as in `transformer.py` (B batch, T tokens, S cached kv length, D model, V vocab).

Dataflow for input position t (the EAGLE convention, see DESIGN.md section 4):

    h_t = fc(concat(embed(x[t+1]), f[t]))        fc: [2D, D], no bias, embedding first
    g   = decoder_layer(h)                        no input norm; post-attention norm kept
    g_t ~ f[t+1]                                  no final norm: g is the next feature

`f` is the policy's final-norm feature (the LM head's input); `draft_logits(g, head)` turns a
predicted feature into token logits with the policy's own LM head. The embedding and the head
are the live policy's arrays passed in at call time: never stored, copied or trained here.
Feeding `g_t` back as the next step's `f` gives multi-step drafting.

The forward is the pure function `drafter_forward(params, config, ...)` over a plain dict of
arrays (`{"fc": ..., "layers": {...}}`), so training, checkpointing and export work on that
dict; `Drafter` is the NNX module holding the same arrays with logical axes for sharding.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.decode import DecodeCache, cached_layers, flat_layer
from tlt_jax.models.transformer import (
    ATTENTION_IMPLS,
    DecoderLayers,
    KVCache,
    NewKV,
    _param,
    causal_mask,
    decoder_layer,
    rope_inv_freq,
    rope_sin_cos,
)
from tlt_jax.parallel.sharding import constrain

DrafterParams = dict[str, Any]  # {"fc": [2D, D], "layers": {name: [1, ...]}}


def drafter_config(target: ModelConfig) -> ModelConfig:
    """The drafter's config: the target's architecture with one layer (RoPE, GQA, biases kept)."""
    return target.replace(num_layers=1)


def drafter_forward(
    params: DrafterParams,
    config: ModelConfig,
    embed_VxD: jax.Array,
    tokens_BxT: jax.Array,
    features_BxTxD: jax.Array,
    positions_BxT: jax.Array,
    *,
    mask_BxTxT: jax.Array | None = None,
    cache: KVCache | None = None,
    cache_lens_B: jax.Array | None = None,
    cache_mask_BxTxS: jax.Array | None = None,
    attention_impl: str = "xla",
) -> tuple[jax.Array, NewKV]:
    """Pure drafter forward over T input pairs per row.

    Args:
      params: `{"fc": [2D, D], "layers": {...}}` (`Drafter.params_dict()`).
      config: the drafter's (or the target's) model config; only one layer is used.
      embed_VxD: the policy's token embedding (frozen; no gradient flows into it).
      tokens_BxT: at position t the token x[t+1] (the token after the feature's position).
      features_BxTxD: at position t the feature f[t] (policy final-norm feature, or the
        drafter's own previous output while drafting).
      positions_BxT: RoPE positions (the position of f[t]).
      mask_BxTxT: which new positions attend to which (default causal; block-diagonal for
        packed training rows, a tree mask for tree drafting).
      cache: the drafter's own cache (a one-layer `KVCache`, or the engine's `DecodeCache`:
        read-only here, see `drafter_decode` for the written form); queries also attend to positions
        `< cache_lens_B[b]`, or to those `cache_mask_BxTxS` allows.
      cache_lens_B: valid cached length per row (with `cache`, this or `cache_mask_BxTxS`).
      cache_mask_BxTxS: which cache positions each new position attends to (xla only; the
        unrolled training of `tlt_jax.drafter.trainer`, whose cache is earlier passes).
      attention_impl: "xla" or "pallas" (cached path only).

    Returns:
      (g_BxTxD: predicted next features, NewKV of the T positions with a leading L=1 axis).
    """
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"{attention_impl=} is not one of {list(ATTENTION_IMPLS)}")
    given = (cache_lens_B is not None) + (cache_mask_BxTxS is not None)
    if given != (0 if cache is None else 1):
        raise ValueError(
            "a cache needs exactly one of cache_lens_B or cache_mask_BxTxS, and neither goes "
            f"without one (cache given: {cache is not None}, cache_lens_B given: "
            f"{cache_lens_B is not None}, cache_mask_BxTxS given: {cache_mask_BxTxS is not None})"
        )
    if cache is not None and cache.num_layers != 1:
        raise ValueError(f"drafter cache has {cache.num_layers} layers; expected 1")
    b, t = tokens_BxT.shape
    if mask_BxTxT is None:
        mask_BxTxT = causal_mask(b, t)
    h_BxTxD = _fused_input(params, config, embed_VxD, tokens_BxT, features_BxTxD)
    sin_cos = rope_sin_cos(positions_BxT, rope_inv_freq(config))
    g_BxTxD, (k_BxTxKxH, v_BxTxKxH) = decoder_layer(
        _layer(params), h_BxTxD, sin_cos, mask_BxTxT, config,
        *((None, None) if cache is None else cache.layer(0)),
        cache_lens_B, attention_impl, input_norm=False, cache_mask_BxTxS=cache_mask_BxTxS,
        cache_layout="token_major" if cache is None else cache.layout,
    )  # fmt: skip
    return g_BxTxD, NewKV(k=k_BxTxKxH[None], v=v_BxTxKxH[None])


def drafter_decode(
    params: DrafterParams,
    config: ModelConfig,
    embed_VxD: jax.Array,
    tokens_BxT: jax.Array,
    features_BxTxD: jax.Array,
    positions_BxT: jax.Array,
    cache: DecodeCache,
    starts_B: jax.Array,
    *,
    mask_BxTxT: jax.Array | None = None,
    write: bool = False,
    attention_impl: str = "xla",
) -> tuple[jax.Array, NewKV, DecodeCache]:
    """`drafter_forward` against the rollout engine's drafter cache (a one-layer `DecodeCache`),
    attending to its positions `< starts_B`; with `write` the T new pairs are first written at
    `starts_B + t` (`decode.cached_layers`). Returns (g_BxTxD, NewKV, the cache)."""
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"{attention_impl=} is not one of {list(ATTENTION_IMPLS)}")
    if cache.num_layers != 1:
        raise ValueError(f"drafter cache has {cache.num_layers} layers; expected 1")
    b, t = tokens_BxT.shape
    mask = causal_mask(b, t) if mask_BxTxT is None else mask_BxTxT
    h_BxTxD = _fused_input(params, config, embed_VxD, tokens_BxT, features_BxTxD)
    sin_cos = rope_sin_cos(positions_BxT, rope_inv_freq(config))
    layers = (flat_layer(_layer(params)),)
    return cached_layers(layers, h_BxTxD, sin_cos, mask, config, cache, starts_B, write=write,
                         attention_impl=attention_impl, input_norm=False)  # fmt: skip


def _fused_input(params, config: ModelConfig, embed_VxD, tokens_BxT, features_BxTxD):
    """fc(concat(embed(x[t+1]), f[t])) (+ the optional fc bias)."""
    d = config.hidden_size
    if features_BxTxD.shape[-1] != d or embed_VxD.shape[-1] != d:
        raise ValueError(
            f"features_BxTxD.shape={features_BxTxD.shape} and embed_VxD.shape="
            f"{embed_VxD.shape} must end in hidden_size={d}"
        )
    dtype = config.jnp_dtype
    embed_VxD = jax.lax.stop_gradient(embed_VxD)
    e_BxTxD = jnp.take(embed_VxD, tokens_BxT, axis=0).astype(dtype)
    pair_BxTx2D = jnp.concatenate([e_BxTxD, features_BxTxD.astype(dtype)], axis=-1)
    h_BxTxD = jnp.einsum("BTE,ED->BTD", pair_BxTx2D, params["fc"].astype(dtype))
    if "fc_bias" in params:  # EAGLE-1/2 checkpoints declare fc with a bias
        h_BxTxD = h_BxTxD + params["fc_bias"].astype(dtype)
    return constrain(h_BxTxD, ("batch", "length", "embed"))


def _layer(params) -> dict[str, jax.Array]:
    return {name: value[0] for name, value in params["layers"].items()}


def draft_logits(
    g_BxTxD: jax.Array, head_DxV: jax.Array, hot_token_ids: jax.Array | None = None
) -> jax.Array:
    """Token logits of predicted features through the policy's LM head, as float32.

    Args:
      g_BxTxD: drafter outputs (predicted features).
      head_DxV: the policy's LM head (`Transformer.head_weight_DxV()`).
      hot_token_ids: optional int ids [U]; the head is restricted to these columns and the
        logits are over the subset (`logits[..., j]` is token `hot_token_ids[j]`): the caller
        maps back with the ids.

    Returns:
      logits [B, T, V] (or [B, T, U] with `hot_token_ids`).
    """
    head = jax.lax.stop_gradient(head_DxV)
    if hot_token_ids is not None:
        head = jnp.take(head, hot_token_ids, axis=1)
    head = head.astype(g_BxTxD.dtype)
    logits = jnp.einsum("BTD,DV->BTV", g_BxTxD, head, preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "length", "vocab"))


class Drafter(nnx.Module):
    """The trainable part of the EAGLE drafter: `fc` and one decoder layer (no input norm).

    Attributes:
      config: the drafter config (`drafter_config(target)`: the target's with one layer).
      fc: Param [2D, D] over `concat(embed(x[t+1]), f[t])`.
      layers: `DecoderLayers` with one stacked layer, without `attn_norm` (EAGLE drops the
        first layer's input norm, so the weight would be dead; it is not created).
    """

    def __init__(self, target_config: ModelConfig, *, rngs: nnx.Rngs, fc_bias: bool = False):
        self.config = drafter_config(target_config)
        d, dt = self.config.hidden_size, self.config.jnp_param_dtype
        self.fc = _param(rngs, (2 * d, d), ("concat_embed", "embed"), dt)
        if fc_bias:  # optional: EAGLE-1/2 checkpoints (SGLang's loader) carry one
            self.fc_bias = _param(rngs, (d,), ("embed",), dt, init="zeros")
        self.layers = DecoderLayers(self.config, 1, rngs=rngs)
        del self.layers.attn_norm

    def params_dict(self) -> DrafterParams:
        """The parameters as a plain dict of arrays: the trainer's and checkpoint's format."""
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))

    def load_params(self, params: DrafterParams) -> None:
        """Replaces the parameters in place, checking structure, shapes and dtypes.

        Raises:
          ValueError: naming the first parameter whose structure, shape or dtype differs.
        """
        current = self.params_dict()
        got, want = jax.tree.structure(params), jax.tree.structure(current)
        if got != want:
            raise ValueError(f"drafter params structure {got} differs from the model's {want}")
        for (path, new), old in zip(
            jax.tree.leaves_with_path(params), jax.tree.leaves(current), strict=True
        ):
            if new.shape != old.shape or new.dtype != old.dtype:
                raise ValueError(
                    f"drafter param {jax.tree_util.keystr(path)}: got {new.shape} {new.dtype}, "
                    f"expected {old.shape} {old.dtype}"
                )
        state = nnx.state(self, nnx.Param)
        nnx.replace_by_pure_dict(state, params)
        nnx.update(self, state)

    def init_cache(self, batch: int, length: int, dtype=None) -> KVCache:
        """An empty drafter KV cache [1, batch, length, K, H]."""
        return KVCache.zeros(self.config, batch, length, dtype)

    def __call__(
        self,
        embed_VxD: jax.Array,
        tokens_BxT: jax.Array,
        features_BxTxD: jax.Array,
        positions_BxT: jax.Array,
        *,
        mask_BxTxT: jax.Array | None = None,
        cache: KVCache | None = None,
        cache_lens_B: jax.Array | None = None,
        attention_impl: str = "xla",
    ) -> tuple[jax.Array, NewKV]:
        """`drafter_forward` with this module's parameters (see there for the arguments)."""
        return drafter_forward(
            self.params_dict(), self.config, embed_VxD, tokens_BxT, features_BxTxD,
            positions_BxT, mask_BxTxT=mask_BxTxT, cache=cache, cache_lens_B=cache_lens_B,
            attention_impl=attention_impl,
        )  # fmt: skip


def init_drafter(target_config: ModelConfig, seed: int = 0) -> Drafter:
    """A randomly initialised drafter (normal(0.02) matrices, unit norms, zero biases)."""
    return Drafter(target_config, rngs=nnx.Rngs(params=seed))


def drafter_from_params(target_config: ModelConfig, params: DrafterParams) -> Drafter:
    """A drafter holding `params` (checked against the architecture; an `fc_bias` entry gives
    it the optional fc bias); no random init runs."""
    bias = "fc_bias" in params
    drafter = nnx.eval_shape(lambda: Drafter(target_config, rngs=nnx.Rngs(0), fc_bias=bias))
    drafter.load_params(params)
    return drafter
