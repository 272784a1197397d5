"""Typed model configuration shared by the policy, the drafter and the checkpoint code."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

MODEL_TYPES = ("llama", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as stored in HF `config.json["rope_scaling"]`."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling.rope_type={self.rope_type!r} is not supported; expected one of "
                f"{list(ROPE_TYPES)}"
            )
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor={self.factor} must be > 0")
        # Fields the rope type does not use take their defaults, so that configs compare by
        # what they compute: `to_hf_dict` writes only `factor` for "linear", and an HF config's
        # `original_max_position_embeddings` there made a drafter export unequal to its target.
        llama3_only = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        unused = {"default": ("factor", *llama3_only), "linear": llama3_only}
        for field in dataclasses.fields(self):
            if field.name in unused.get(self.rope_type, ()):
                object.__setattr__(self, field.name, field.default)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of one Llama / Qwen2-family decoder.

    Attributes use the dimension letters of `transformer.py`: V vocab, D model, F mlp,
    L layers, N query heads, K kv heads, H head dim.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 8192
    param_dtype: str = "float32"
    dtype: str = "float32"

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(
                f"model_type={self.model_type!r} is not supported; "
                f"expected one of {list(MODEL_TYPES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        # The biases are HF's: Qwen2 always has q/k/v biases (no o bias); Llama's
        # `attention_bias` gives q/k/v *and* o_proj a bias, and there is no o bias here.
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ValueError("model_type='qwen2' has q/k/v biases: attention_bias must be True")
        if self.model_type == "llama" and self.attention_bias:
            raise ValueError(
                "model_type='llama' with attention_bias=True is not supported: HF Llama's "
                "attention_bias also gives o_proj a bias, which this model does not implement"
            )
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {list(DTYPES)}")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @property
    def jnp_param_dtype(self):
        return DTYPES[self.param_dtype]

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f, n, k, h = (
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        attn = d * n * h * 2 + d * k * h * 2
        if self.attention_bias:
            attn += (n + 2 * k) * h
        layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * layer + d + head

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF transformers `config.json` for this architecture."""
        architectures = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        out: dict[str, Any] = {
            "architectures": [architectures[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "torch_dtype": self.param_dtype,
        }
        if self.model_type == "llama":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = False
        if self.rope_scaling is not None and self.rope_scaling.rope_type != "default":
            scaling = dataclasses.asdict(self.rope_scaling)
            if scaling["rope_type"] == "linear":
                scaling = {"rope_type": "linear", "factor": scaling["factor"]}
            out["rope_scaling"] = scaling
        return out


def config_from_hf_dict(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """Builds a `ModelConfig` from an HF `config.json` dict.

    Raises:
      ValueError: for a model_type or architecture this project does not implement.
    """
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"config.json model_type={model_type!r} is not supported; expected one of "
            f"{list(MODEL_TYPES)}"
        )
    known_archs = {"LlamaForCausalLM", "Qwen2ForCausalLM"}
    for arch in hf.get("architectures") or []:
        if arch not in known_archs:
            raise ValueError(
                f"config.json architectures contains {arch!r}; "
                f"expected one of {sorted(known_archs)}"
            )
    if hf.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=True is not supported; expected false")
    if hf.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window=True is not supported; expected false")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={hf.get('hidden_act')!r}; expected 'silu'")
    num_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    scaling = hf.get("rope_scaling") or (hf.get("rope_parameters") or {})
    rope_theta = hf.get("rope_theta", scaling.get("rope_theta", 10000.0))
    rope = None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in (None, "default"):
        rope = RopeScaling(
            rope_type=rope_type,
            factor=float(scaling.get("factor", 1.0)),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                scaling.get("original_max_position_embeddings", 8192)
            ),
        )
    kwargs: dict[str, Any] = dict(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rope_theta=float(rope_theta),
        rope_scaling=rope,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # HF Qwen2 always has q/k/v biases and ignores the key; HF Llama reads it.
        attention_bias=True if model_type == "qwen2" else bool(hf.get("attention_bias", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)
