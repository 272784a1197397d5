"""Every preset builds; the big ones lower ahead of time on an abstract 8-device mesh.

Nothing here allocates a big model: states come from `nnx.eval_shape`, shardings from the
logical axes and a role's rules on a `jax.sharding.AbstractMesh`, and programs are lowered
from `ShapeDtypeStruct`s that carry those shardings.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tlt_jax.models.config import ModelConfig, config_from_hf_dict
from tlt_jax.models.presets import PRESETS, get_preset
from tlt_jax.models.transformer import KVCache, abstract_state
from tlt_jax.parallel import sharding

BIG = ["qwen2_5_7b", "qwen2_5_32b", "llama3_8b"]
MESHES = [(1, 8), (2, 4)]
# Parameter counts of the public checkpoints (safetensors totals on the HF hub).
PUBLIC_PARAM_COUNTS = {
    "smollm2_135m": 134_515_008,
    "qwen2_5_0_5b": 494_032_768,
    "qwen2_5_1_5b": 1_543_714_304,
    "qwen2_5_7b": 7_615_616_512,
    "ds_r1_distill_qwen_7b": 7_615_616_512,
    "qwen2_5_32b": 32_763_876_352,
    "llama3_8b": 8_030_261_248,
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_builds_and_round_trips_through_hf_config(name):
    config = get_preset(name)
    assert isinstance(config, ModelConfig)
    dtypes = {"param_dtype": config.param_dtype, "dtype": config.dtype}
    assert config_from_hf_dict(config.to_hf_dict(), **dtypes) == config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_num_params_matches_abstract_state(name):
    config = get_preset(name)
    _, state = abstract_state(config)
    sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(state)]
    assert sum(sizes) == config.num_params()
    if name in PUBLIC_PARAM_COUNTS:
        assert config.num_params() == PUBLIC_PARAM_COUNTS[name]


def test_get_preset_overrides_and_errors():
    assert get_preset("tiny", dtype="bfloat16").dtype == "bfloat16"
    assert get_preset("tiny").dtype == "float32"
    with pytest.raises(ValueError, match="'qwen9'"):
        get_preset("qwen9")
    with pytest.raises(ValueError, match="dtype='float8'"):
        get_preset("tiny", dtype="float8")


def expected_param_bytes_per_device(config: ModelConfig, mesh_shape, role: str) -> int:
    """By hand: tensor parallelism splits heads / mlp / vocab where the degree divides them;
    `train` also splits the embed dim of every weight over data (FSDP); norms replicate."""
    data, tensor = mesh_shape
    fsdp = data if role == "train" and config.hidden_size % data == 0 else 1
    c = config

    def tp(count: int, dim: int) -> float:
        return count / tensor if dim % tensor == 0 else count

    L, D, F, N, K, H, V = (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads,
                           c.num_kv_heads, c.head_dim, c.vocab_size)  # fmt: skip
    weights = (
        tp(2 * L * D * N * H, N)  # q, o
        + tp(2 * L * D * K * H, K)  # k, v
        + tp(3 * L * D * F, F)  # gate, up, down
        + tp((1 if c.tie_word_embeddings else 2) * V * D, V)
    ) / fsdp
    biases = tp(L * N * H, N) + tp(2 * L * K * H, K) if c.attention_bias else 0
    norms = 2 * L * D + D
    itemsize = np.dtype(c.jnp_param_dtype).itemsize
    return round((weights + biases + norms) * itemsize)


def _lower_forward(graphdef, state, mesh, rules, batch: int, length: int, cache=None):
    """Lowers prefill (cache None) or a cached step on `mesh` (abstract: no devices needed)."""
    tokens = jax.ShapeDtypeStruct(
        (batch, length), jnp.int32,
        sharding=sharding.named_sharding((batch, length), ("batch", "length"), mesh, rules),
    )  # fmt: skip
    lens = jax.ShapeDtypeStruct(
        (batch,), jnp.int32, sharding=sharding.named_sharding((batch,), ("batch",), mesh, rules)
    )

    def forward(state, tokens_BxT, positions_BxT, cache, lens_B):
        model = nnx.merge(graphdef, state)
        features, new_kv = model(
            tokens_BxT, positions_BxT, cache=cache, cache_lens_B=None if cache is None else lens_B
        )
        return model.logits(features[:, -1:]), new_kv

    with sharding.use_sharding(mesh, rules):
        traced = jax.jit(forward).trace(state, tokens, tokens, cache, lens)
    return traced.lower(lowering_platforms=("cpu",))


def _abstract_cache(config, mesh, rules, batch, length):
    shapes = jax.eval_shape(lambda: KVCache.zeros(config, batch, length))
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, shapes.shardings(mesh, rules))  # fmt: skip


@pytest.mark.parametrize("role", ["rollout", "train"])
@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
@pytest.mark.parametrize("name", BIG)
def test_big_preset_lowers_on_abstract_mesh(name, mesh_shape, role):
    config = get_preset(name)
    mesh = AbstractMesh(mesh_shape, ("data", "tensor"))
    rules = sharding.rules_for(role)
    live_before = {id(x) for x in jax.live_arrays()}
    graphdef, state = abstract_state(config, mesh, rules)

    per_device = sharding.per_device_bytes(state)
    assert per_device == expected_param_bytes_per_device(config, mesh_shape, role)
    total = config.num_params() * 2  # bfloat16
    degree = mesh_shape[1] * (mesh_shape[0] if role == "train" else 1)
    fully_divisible = (
        config.num_heads % mesh_shape[1] == 0 and config.num_kv_heads % mesh_shape[1] == 0
    )
    if fully_divisible:  # only norms and biases are replicated
        assert per_device == pytest.approx(total / degree, rel=2e-3)
    else:  # qwen2.5-7b on 8-way tensor: 28 heads / 4 kv heads replicate q, k, v, o
        assert per_device > 1.2 * total / degree

    prefill = _lower_forward(graphdef, state, mesh, rules, batch=8, length=128)
    cache = _abstract_cache(config, mesh, rules, batch=8, length=1024)
    decode = _lower_forward(graphdef, state, mesh, rules, batch=8, length=1, cache=cache)
    for lowered in (prefill, decode):
        text = lowered.as_text()
        assert f'sdy.mesh @mesh = <["data"={mesh_shape[0]}, "tensor"={mesh_shape[1]}]>' in text
        assert "sdy.sharding_constraint" in text
        logits_info = lowered.out_info[0]
        assert logits_info.shape == (8, 1, config.vocab_size)
    new_kv = decode.out_info[1]
    assert new_kv.k.shape == (config.num_layers, 8, 1, config.num_kv_heads, config.head_dim)
    # Nothing was allocated on the way.
    assert all(id(x) in live_before for x in jax.live_arrays())


@pytest.mark.parametrize("name", ["qwen2_5_7b", "qwen2_5_32b"])
def test_compiled_arguments_are_the_sharded_params(name):
    """The AOT-compiled program's per-device argument bytes are the params' shards (+ tokens)."""
    config = get_preset(name)
    mesh = AbstractMesh((2, 4), ("data", "tensor"))
    rules = sharding.rules_for("rollout")
    graphdef, state = abstract_state(config, mesh, rules)
    lowered = _lower_forward(graphdef, state, mesh, rules, batch=8, length=16)
    compiled = lowered.compile(device_assignment=tuple(jax.devices()[:8]))
    stats = compiled.memory_analysis()
    if stats is None:
        pytest.skip("memory_analysis() is not available on this backend")
    # Tokens and positions: 8 // 2 rows of 16 int32 per device; the unused lens are pruned.
    tokens_bytes = 2 * (8 // 2) * 16 * 4
    expected = sharding.per_device_bytes(state) + tokens_bytes
    assert stats.argument_size_in_bytes == expected


def test_abstract_state_needs_rules_with_mesh():
    with pytest.raises(ValueError, match="rules"):
        abstract_state(get_preset("tiny"), AbstractMesh((2, 4), ("data", "tensor")))


def test_abstract_shardings_are_named_and_abstract():
    mesh = AbstractMesh((2, 4), ("data", "tensor"))
    _, state = abstract_state(get_preset("qwen2_5_32b"), mesh, sharding.rules_for("rollout"))
    q = dict(nnx.to_flat_state(state))[("layers", "q")].get_value()
    assert isinstance(q.sharding, NamedSharding) and q.sharding.mesh == mesh
    assert q.sharding.spec == P(None, None, "tensor", None)
