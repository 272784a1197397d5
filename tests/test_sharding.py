"""The tiny model sharded on 8 fake CPU devices: same logits, expected specs, real constraints.

Meshes 1x8, 2x4 and 4x2 over (data, tensor), roles `train` and `rollout`. The checkpoint is
a random Qwen2 (q/k/v biases, untied head) whose sizes divide 8 except the 4 kv heads, which
must be replicated on a tensor axis of 8. Sharded and unsharded float32 logits agree to 2e-5.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tlt_jax.models import checkpoints
from tlt_jax.models.transformer import KVCache, write_kv
from tlt_jax.parallel import sharding

ATOL = 2e-5
MESHES = [(1, 8), (2, 4), (4, 2)]
ROLES = ["train", "rollout"]
B, T = 4, 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = transformers.Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn_like(param)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    directory = tmp_path_factory.mktemp("tiny_qwen2")
    model.save_pretrained(str(directory), safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 256, (B, T)).astype(np.int32)


@pytest.fixture(scope="module")
def reference(checkpoint, tokens):
    """Unsharded single-device logits [B, T, V]."""
    model = checkpoints.load_model(checkpoint)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    features, _ = model(jnp.asarray(tokens), positions)
    return np.asarray(model.logits(features))


def _forward_fn(graphdef):
    def forward(state, tokens_BxT, positions_BxT):
        model = nnx.merge(graphdef, state)
        features, _ = model(tokens_BxT, positions_BxT)
        return model.logits(features)

    return forward


def _sharded_forward(model, mesh, rules, tokens_BxT):
    """Logits of a fresh jit (traced under `use_sharding`) and its lowered StableHLO text."""
    graphdef, state = nnx.split(model)
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    batch = sharding.named_sharding(tokens_BxT.shape, ("batch", "length"), mesh, rules)
    tokens = jax.device_put(tokens_BxT, batch)
    positions = jax.device_put(np.broadcast_to(np.arange(T), (B, T)).astype(np.int32), batch)
    with sharding.use_sharding(mesh, rules):
        jitted = jax.jit(_forward_fn(graphdef), in_shardings=(state_shardings, batch, batch))
        lowered = jitted.lower(state, tokens, positions)
    return lowered.compile()(state, tokens, positions), lowered.as_text()


def _expected_specs(mesh_shape, role):
    """Specs by hand: `train` adds FSDP over data on the embed dim; 4 kv heads on 8: replicated."""
    data, tensor = mesh_shape
    fsdp = "data" if role == "train" and data > 1 else None
    kv = "tensor" if 4 % tensor == 0 else None
    return {
        ("embed",): P("tensor", fsdp),
        ("lm_head",): P(fsdp, "tensor"),
        ("final_norm",): P(None),
        ("layers", "attn_norm"): P(None, None),
        ("layers", "q"): P(None, fsdp, "tensor", None),
        ("layers", "k"): P(None, fsdp, kv, None),
        ("layers", "q_bias"): P(None, "tensor", None),
        ("layers", "k_bias"): P(None, kv, None),
        ("layers", "o"): P(None, "tensor", None, fsdp),
        ("layers", "gate"): P(None, fsdp, "tensor"),
        ("layers", "down"): P(None, "tensor", fsdp),
    }


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
def test_param_specs(checkpoint, mesh_shape, role):
    mesh = sharding.make_mesh(mesh_shape)
    model = checkpoints.load_model(checkpoint, mesh=mesh, role=role)
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    for path, spec in _expected_specs(mesh_shape, role).items():
        array = flat[path].get_value()
        assert array.sharding.mesh == mesh
        assert array.sharding.spec == spec, (path, array.sharding.spec, spec)
        # The data really is split: each device holds its shard, not the whole array.
        shard = array.addressable_shards[0].data
        assert shard.shape == array.sharding.shard_shape(array.shape)


def test_literal_specs():
    """A few specs spelled out, independent of `_expected_specs`."""
    rollout, train = sharding.rules_for("rollout"), sharding.rules_for("train")
    mesh = sharding.make_mesh((2, 4))
    axes = ("layers", "embed", "q_heads", "head_dim")
    assert sharding.named_sharding((2, 64, 8, 8), axes, mesh, rollout).spec == P(
        None, None, "tensor", None
    )
    assert sharding.named_sharding((2, 64, 8, 8), axes, mesh, train).spec == P(
        None, "data", "tensor", None
    )
    # 28 heads do not divide over 8 devices: replicated rather than an error.
    wide = sharding.make_mesh((1, 8))
    assert sharding.named_sharding((2, 64, 28, 8), axes, wide, rollout).spec == P(
        None, None, None, None
    )
    with pytest.raises(ValueError, match="'nonsense'"):
        sharding.named_sharding((2,), ("nonsense",), mesh, rollout)
    with pytest.raises(ValueError, match="role='serving'"):
        sharding.rules_for("serving")


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
def test_sharded_logits_match_unsharded(checkpoint, tokens, reference, mesh_shape, role):
    mesh = sharding.make_mesh(mesh_shape)
    rules = sharding.rules_for(role)
    model = checkpoints.load_model(checkpoint, mesh=mesh, role=role)
    logits, hlo = _sharded_forward(model, mesh, rules, tokens)
    np.testing.assert_allclose(np.asarray(logits), reference, atol=ATOL, rtol=0)

    data = '{"data"}' if mesh_shape[0] > 1 else "{}"
    # The MLP hidden activation [B, T, F] carries the constraint batch->data, mlp->tensor.
    mlp = rf'sdy\.sharding_constraint %\S+ <@mesh, \[{data}, \{{\}}, \{{"tensor"\}}\]> : '
    assert re.search(mlp + r"tensor<4x16x128xf32>", hlo), hlo[:2000]
    # ... and the logits [B, T, V] batch->data, vocab->tensor.
    assert re.search(mlp + r"tensor<4x16x256xf32>", hlo)
    expected = NamedSharding(mesh, P("data" if mesh_shape[0] > 1 else None, None, "tensor"))
    assert logits.sharding.is_equivalent_to(expected, 3), logits.sharding


def test_no_constraints_outside_use_sharding(checkpoint, tokens):
    """`constrain` is a no-op without a context, so the annotations above came from it."""
    model = checkpoints.load_model(checkpoint)
    graphdef, state = nnx.split(model)
    positions = np.broadcast_to(np.arange(T), (B, T)).astype(np.int32)
    hlo = jax.jit(_forward_fn(graphdef)).lower(state, tokens, positions).as_text()
    assert "sharding_constraint" not in hlo


@pytest.mark.parametrize(
    ("mesh_shape", "role"),
    [((2, 4), "rollout"), ((4, 2), "train")],
    ids=["2x4-rollout", "4x2-train"],
)
def test_sharded_cached_decode(checkpoint, tokens, reference, mesh_shape, role):
    """Prefill ragged prefixes, then decode token by token, all sharded; equals the full pass."""
    mesh = sharding.make_mesh(mesh_shape)
    rules = sharding.rules_for(role)
    model = checkpoints.load_model(checkpoint, mesh=mesh, role=role)
    graphdef, state = nnx.split(model)
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    cache = KVCache.zeros(model.config, B, T + 4)
    cache_sharding = cache.shardings(mesh, rules)
    cache = jax.device_put(cache, cache_sharding)
    batch = sharding.named_sharding((B, T), ("batch", "length"), mesh, rules)
    rows = sharding.named_sharding((B,), ("batch",), mesh, rules)

    def step(state, cache, tokens_BxT, positions_BxT, lens_B):
        model = nnx.merge(graphdef, state)
        features, new_kv = model(tokens_BxT, positions_BxT, cache=cache, cache_lens_B=lens_B)
        return model.logits(features), write_kv(cache, new_kv, lens_B)

    with sharding.use_sharding(mesh, rules):
        jitted = jax.jit(
            step,
            in_shardings=(state_shardings, cache_sharding, batch, batch, rows),
            out_shardings=(None, cache_sharding),
            donate_argnums=1,
        )
        # Prefill through the cached path (empty cache), then ragged single-token steps.
        prefix = np.asarray([3, 7, 5, 9])
        width = int(prefix.max())
        positions = np.broadcast_to(np.arange(width), (B, width)).astype(np.int32)
        logits, cache = jitted(
            state, cache, jnp.asarray(tokens[:, :width]), jnp.asarray(positions),
            jnp.zeros(B, jnp.int32),
        )  # fmt: skip
        got = np.full((B, T, 256), np.nan, np.float32)
        for row in range(B):
            got[row, : prefix[row]] = np.asarray(logits)[row, : prefix[row]]
        lens = prefix.astype(np.int32)
        while lens.min() < T:
            index = np.minimum(lens, T - 1)[:, None]
            logits, cache = jitted(
                state, cache, jnp.asarray(np.take_along_axis(tokens, index, 1)),
                jnp.asarray(index), jnp.asarray(lens),
            )  # fmt: skip
            for row in np.flatnonzero(lens < T):
                got[row, lens[row]] = np.asarray(logits)[row, 0]
            lens = np.minimum(lens + 1, T)
    assert cache.k.sharding.spec == cache_sharding.k.spec
    np.testing.assert_allclose(got, reference, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- rows per device


def test_collective_report_counts_what_the_partitioner_adds():
    """Hand-computed: the column sums of a row-sharded [8, 4] float32 array all-reduce one
    f32[4] (16 bytes); a bfloat16 [2, 3] gathered over 2 devices is bf16[2, 3] (12 bytes)."""
    from tlt_jax.programs import collective_report

    mesh = sharding.make_mesh((2, 1))
    rows = NamedSharding(mesh, P("data"))
    x = jax.device_put(jnp.ones((8, 4)), rows)
    summed = jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P()))
    assert collective_report(summed.lower(x).compile()) == {"all_reduce": 1,
                                                            "all_reduce_bytes": 16}  # fmt: skip
    y = jax.device_put(jnp.ones((2, 3), jnp.bfloat16), rows)
    gathered = jax.jit(lambda a: a * 2, out_shardings=NamedSharding(mesh, P()))
    report = collective_report(gathered.lower(y).compile())
    assert report["all_gather"] == 1 and report["all_gather_bytes"] in (12, 24)  # f32 on CPU
    assert collective_report(jax.jit(lambda a: a * 2).lower(x).compile()) == {}


def test_rowwise_keeps_row_math_on_each_device():
    """Token choice with top-p over a data-sharded batch: the partitioner all-gathers the
    logits for `top_k` and all-reduces the filter's predicates; `rowwise` under
    `rows_per_device` runs each device's rows alone (no collective) with the same tokens and
    logprobs; a batch the axis does not divide falls back to the plain function."""
    from tlt_jax.programs import collective_report
    from tlt_jax.rollout.sampling import choose_tokens

    mesh = sharding.make_mesh((2, 1))
    rows = NamedSharding(mesh, P("data"))

    def args(b):
        logits = jax.random.normal(jax.random.key(0), (b, 512)) * 3
        keys = jax.random.split(jax.random.key(1), b)
        return (logits, jnp.full((b,), 0.8), jnp.zeros((b,), jnp.int32), jnp.full((b,), 0.9),
                keys)  # fmt: skip

    def choose():  # a fresh function per trace: jit's trace cache ignores the context
        return lambda *a: sharding.rowwise(choose_tokens)(*a, greedy_only=False)

    plain = jax.jit(choose()).lower(*args(4)).compile()
    placed = [jax.device_put(a, rows) for a in args(4)]
    partitioned = jax.jit(choose()).lower(*placed).compile()
    assert collective_report(partitioned).get("all_gather", 0) >= 1
    with sharding.rows_per_device(mesh):
        local = jax.jit(choose()).lower(*placed).compile()
        odd = jax.jit(choose()).lower(*args(3))  # 3 rows over 2 devices: the plain function
    assert collective_report(local) == {}
    for got, want in zip(local(*placed), plain(*args(4)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert "shard_map" not in odd.as_text() and "shmap" not in odd.as_text()


def test_shared_prompt_rows_read_their_prefix_on_their_own_data_shard():
    """Packed rows over a data axis of 2 (weights replicated): rows that continue a prompt
    from another row read it within their own shard, so the log-prob program has no
    collective, like rows without a prefix; the same rows read through one global gather
    (`row_shards=1`) make the partitioner move keys between devices. Log-probs equal the
    unsharded program's."""
    from tlt_jax.models.presets import get_preset
    from tlt_jax.models.transformer import init_model
    from tlt_jax.programs import collective_report
    from tlt_jax.rl import packing
    from tlt_jax.rl import step as step_lib

    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, 200, 4)) for _ in range(6)]
    lengths = [11, 9, 8, 5, 6, 3, 3, 3, 4, 11, 9, 12]  # groups of 2 spill into other rows
    responses = [list(rng.integers(1, 200, n)) for n in lengths]
    (micros,) = packing.packed_micro_batches(
        prompts, responses, [list(range(6))], 2, np.ones(6, bool), row_len=16, max_rows=8,
        include_silent=False, row_multiple=2, prefix_width=4,
    )  # fmt: skip
    (micro,) = micros  # 8 rows (10 without sharing: 8 + 2)
    prefix = np.asarray(micro.batch.prefix_RxS)
    assert micro.shape == (8, 16) and micro.batch.row_shards == 2
    assert (prefix[:4] >= 0).any() and (prefix[4:] >= 0).any()  # continuing rows in both
    assert prefix[:4].max() < 4 * 16 and prefix[4:][prefix[4:] >= 0].min() >= 4 * 16

    graphdef, params = nnx.split(init_model(get_preset("tiny"), seed=0))
    batch = jax.tree.map(jnp.asarray, micro.batch)
    expected = step_lib.logprob_program(graphdef, params, batch, temperature=1.0)[0]
    mesh = sharding.make_mesh((2, 1))
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    reports = {}
    for name, b in [("shards", batch), ("global", batch.replace(row_shards=1))]:
        b = jax.device_put(b, replicated)
        with sharding.use_sharding(mesh, sharding.rules_for("rollout")):
            program = jax.jit(
                lambda p, x: step_lib.logprob_program(graphdef, p, x, temperature=1.0)[0]
            )
            compiled = program.lower(params, b).compile()
        reports[name] = collective_report(compiled)
        np.testing.assert_allclose(np.asarray(compiled(params, b)), expected, atol=ATOL)
    assert reports["shards"] == {}
    assert reports["global"].get("all_gather", 0) >= 1
