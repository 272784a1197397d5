"""Model sizes as data. One tiny preset for tests; the rest mirror public checkpoints."""

from __future__ import annotations

from tlt_jax.models.config import ModelConfig, RopeScaling

PRESETS: dict[str, ModelConfig] = {
    # Random weights, seconds to compile: unit tests and the `tiny` RL config.
    "tiny": ModelConfig(
        model_type="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct.
    "smollm2_135m": ModelConfig(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
    # Qwen/Qwen2.5-0.5B-Instruct.
    "qwen2_5_0_5b": ModelConfig(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=True,
        max_position_embeddings=32768,
    ),
    # Qwen/Qwen2.5-1.5B: the accelerator check's decode / verify crossover preset.
    "qwen2_5_1_5b": ModelConfig(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=True,
        max_position_embeddings=32768,
        param_dtype="bfloat16",
        dtype="bfloat16",
    ),
    # Qwen/Qwen2.5-7B.
    "qwen2_5_7b": ModelConfig(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=True,
        max_position_embeddings=131072,
        param_dtype="bfloat16",
        dtype="bfloat16",
    ),
    # deepseek-ai/DeepSeek-R1-Distill-Qwen-7B (Qwen2.5-Math-7B base).
    "ds_r1_distill_qwen_7b": ModelConfig(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=True,
        max_position_embeddings=131072,
        param_dtype="bfloat16",
        dtype="bfloat16",
    ),
    # Qwen/Qwen2.5-32B.
    "qwen2_5_32b": ModelConfig(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_layers=64,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=True,
        max_position_embeddings=131072,
        param_dtype="bfloat16",
        dtype="bfloat16",
    ),
    # meta-llama/Llama-3.1-8B (Llama 3 architecture with llama3 RoPE scaling).
    "llama3_8b": ModelConfig(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        param_dtype="bfloat16",
        dtype="bfloat16",
    ),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """Returns the named preset, optionally with fields replaced (e.g. dtype)."""
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} is unknown; expected one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
