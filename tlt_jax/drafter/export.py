"""The drafter as an HF-style EAGLE directory (what SGLang / EAGLE tooling load), and back.

Layout (EAGLE-1 / TLT checkpoints, no `model.` prefix):

    config.json         the target's HF config with num_hidden_layers=1 and
                        architectures ["LlamaForCausalLMEagle"] or ["Qwen2ForCausalLMEagle"]
    model.safetensors   fc.weight [D, 2D] (torch Linear layout, input = [embed; feature]),
                        fc.bias [D] (zeros unless the drafter has a trained bias; on by
                        default: SGLang declares the Linear with a bias and would otherwise
                        keep it uninitialised; EAGLE-1/2 checkpoints carry a non-zero one,
                        which `load_eagle` keeps as the drafter's optional `fc_bias`),
                        layers.0.self_attn.{q,k,v,o}_proj.weight (+ q/k/v biases for Qwen2),
                        layers.0.mlp.{gate,up,down}_proj.weight,
                        layers.0.post_attention_layernorm.weight

No embedding, no LM head (the live policy's are used) and no input_layernorm (EAGLE drops it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np

from tlt_jax.files import write_text_atomic
from tlt_jax.models.checkpoints import (
    _LAYER_EXPORT,
    _LAYER_TENSORS,
    SafetensorsSource,
    remove_weight_files,
)
from tlt_jax.models.config import ModelConfig, config_from_hf_dict
from tlt_jax.models.drafter import Drafter, DrafterParams, drafter_config, drafter_from_params

EAGLE_ARCHITECTURES = {"llama": "LlamaForCausalLMEagle", "qwen2": "Qwen2ForCausalLMEagle"}
# The fields of an EAGLE config.json that are its target's: the drafter takes the target's
# embedding, head and token ids, so a drafter of another model (another vocabulary, family,
# width or RoPE) would load and compile, then draft tokens that mean something else. Its own
# layer's sizes (intermediate_size, rms_norm_eps) and max_position_embeddings are not checked:
# public EAGLE checkpoints may set them on their own.
TARGET_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_heads", "num_kv_heads",
                 "head_dim", "rope_theta", "rope_scaling")  # fmt: skip
# Tensors other EAGLE checkpoints may carry that the drafter takes from the live policy.
_IGNORED_TENSORS = ("embed_tokens.weight", "lm_head.weight")


def _layer_names(config: ModelConfig) -> dict[str, str]:
    """Drafter layer param -> HF tensor name (no input norm, biases only for Qwen2-style)."""
    names = {}
    for key, (suffix, _) in _LAYER_TENSORS.items():
        if key == "attn_norm" or (key.endswith("_bias") and not config.attention_bias):
            continue
        names[key] = f"layers.0.{suffix}"
    return names


def eagle_state_dict(
    params: DrafterParams, target_config: ModelConfig, *, zero_fc_bias: bool = True
) -> dict[str, np.ndarray]:
    """The drafter params under EAGLE HF names and torch layouts, as float32 host arrays."""
    config = drafter_config(target_config)
    host = jax.device_get(params)
    fc = np.asarray(host["fc"], np.float32)
    out = {"fc.weight": np.ascontiguousarray(fc.T)}
    if "fc_bias" in host:
        out["fc.bias"] = np.asarray(host["fc_bias"], np.float32)
    elif zero_fc_bias:
        out["fc.bias"] = np.zeros((fc.shape[1],), np.float32)
    for key, name in _layer_names(config).items():
        value = np.asarray(host["layers"][key], np.float32)[0]
        out[name] = np.ascontiguousarray(_LAYER_EXPORT[key](value))
    return out


def export_eagle(
    params: DrafterParams,
    target_config: ModelConfig,
    out_dir: str | os.PathLike,
    *,
    zero_fc_bias: bool = True,
    tokenizer=None,
) -> Path:
    """Writes `config.json` and `model.safetensors` (float32) of an EAGLE drafter.

    Args:
      params: drafter params (`Drafter.params_dict()` or `DrafterTrainState.params`).
      target_config: the policy's config (the drafter's architecture follows it).
      out_dir: created if missing; existing files of the same names are replaced.
      zero_fc_bias: also write a zero `fc.bias` (see the module docstring).
      tokenizer: optionally saved alongside (`save_pretrained`).

    Returns:
      The output directory.
    """
    import safetensors.numpy

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = drafter_config(target_config).replace(param_dtype="float32")
    hf = config.to_hf_dict()
    hf["architectures"] = [EAGLE_ARCHITECTURES[config.model_type]]
    tensors = eagle_state_dict(params, target_config, zero_fc_bias=zero_fc_bias)
    # Each file is whole on disk before it is renamed into place: a kill mid-export leaves
    # the earlier export or the new one readable, never half a file.
    tmp = out / "model.safetensors.tmp"
    safetensors.numpy.save_file(tensors, str(tmp), {"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    # An earlier sharded export's index would shadow the new file (read first).
    remove_weight_files(out, keep=("model.safetensors",))
    write_text_atomic(out / "config.json", json.dumps(hf, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


def check_eagle_dir(path: str | os.PathLike, flag: str) -> Path:
    """`path` as an HF-EAGLE export folder, or a FileNotFoundError naming `flag`: a check of
    its config.json that callers run before the policy loads (the weights are read after)."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"{flag}={os.fspath(path)!r} is not an HF-EAGLE export (no "
                                "config.json in it; train_drafter.py writes one)")  # fmt: skip
    return Path(path)


def load_eagle_config(path: str | os.PathLike) -> ModelConfig:
    """The drafter `ModelConfig` of an EAGLE directory (one layer).

    Raises:
      ValueError: if config.json is not a one-layer EAGLE drafter of a supported family.
    """
    path = Path(path)
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise OSError(f"cannot read {path / 'config.json'}: {e}") from e
    archs = hf.get("architectures") or []
    if any(arch not in EAGLE_ARCHITECTURES.values() for arch in archs):
        raise ValueError(
            f"{path / 'config.json'} architectures={archs}; expected one of "
            f"{sorted(EAGLE_ARCHITECTURES.values())}"
        )
    if hf.get("num_hidden_layers") != 1:
        raise ValueError(
            f"{path / 'config.json'} num_hidden_layers={hf.get('num_hidden_layers')}; "
            "an EAGLE drafter has 1"
        )
    return config_from_hf_dict(dict(hf, architectures=None))


def check_eagle_target(path: str | os.PathLike, drafter: ModelConfig, target: ModelConfig
                       ) -> None:  # fmt: skip
    """Checks that the EAGLE drafter at `path` (its config `drafter`) was made for `target`.

    Raises:
      ValueError: naming the directory and, per differing `TARGET_FIELDS` entry, the drafter's
        value and the target's.
    """
    diff = [f"{name}={getattr(drafter, name)!r} (the target's: {getattr(target, name)!r})"
            for name in TARGET_FIELDS
            if getattr(drafter, name) != getattr(target, name)]  # fmt: skip
    if diff:
        raise ValueError(f"EAGLE drafter {path} was exported for another model: its "
                         f"config.json has {', '.join(diff)}")  # fmt: skip


def load_eagle(path: str | os.PathLike, *, target: ModelConfig | None = None,
               **config_overrides) -> Drafter:  # fmt: skip
    """Loads an EAGLE directory written by `export_eagle` (or a TLT / EAGLE-1 checkpoint).

    Args:
      path: directory with config.json and model.safetensors (or a sharded index).
      target: the config of the model it will draft for: checked (`check_eagle_target`)
        before any weight is read. Every caller that has a target passes it; None only
        inspects the directory.
      **config_overrides: e.g. `param_dtype="bfloat16"`.

    Returns:
      A `Drafter` with the loaded weights.

    Raises:
      ValueError: on a drafter of another model than `target`, missing or unexpected tensors
        or shape mismatches.
    """
    path = Path(path)
    config = load_eagle_config(path)
    if target is not None:
        check_eagle_target(path, config, target)
    if config_overrides:
        config = config.replace(**config_overrides)
    source = SafetensorsSource(path)
    names = _layer_names(config)
    expected = {"fc.weight", *names.values()}
    present = source.names()
    missing = expected - present
    unexpected = present - expected - {"fc.bias", *_IGNORED_TENSORS}
    if missing or unexpected:
        raise ValueError(
            f"EAGLE checkpoint {path}: missing tensors {sorted(missing)}, "
            f"unexpected tensors {sorted(unexpected)}"
        )
    dtype = config.jnp_param_dtype
    params = {
        "fc": source.read("fc.weight").T.astype(dtype),
        "layers": {
            key: _LAYER_TENSORS[key][1](source.read(name), config)[None].astype(dtype)
            for key, name in names.items()
        },
    }
    # A zero bias (what `export_eagle` writes for SGLang) is dropped; a trained one is kept.
    # Its shape is checked either way: a malformed checkpoint is refused, not half-read.
    if "fc.bias" in present:
        bias = source.read("fc.bias")
        if bias.shape != (config.hidden_size,):
            raise ValueError(f"EAGLE checkpoint {path}: fc.bias has shape {bias.shape}; "
                             f"expected ({config.hidden_size},)")  # fmt: skip
        if np.any(bias):
            params["fc_bias"] = bias.astype(dtype)
    return drafter_from_params(config, jax.tree.map(jax.numpy.asarray, params))
