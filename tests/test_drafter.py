"""EAGLE drafter: model, alignment, loss, packing, training, checkpoints and export."""

import dataclasses
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.checkpointing.manager import DrafterCheckpointer
from tlt_jax.data.tokenizer import stop_token_ids
from tlt_jax.drafter.data import DrafterBuffer, cut_window, pack_windows
from tlt_jax.drafter.export import export_eagle, load_eagle
from tlt_jax.drafter.hot_vocab import load_hot_vocab, load_token_counts
from tlt_jax.drafter.loss import eagle_inputs, eagle_loss, smooth_l1
from tlt_jax.drafter.trainer import (
    DrafterTrainConfig,
    batch_loss,
    init_train_state,
    make_train_step,
    param_shardings,
    unrolled_forward,
)
from tlt_jax.models.drafter import (
    Drafter,
    draft_logits,
    drafter_config,
    drafter_forward,
    drafter_from_params,
    init_drafter,
)
from tlt_jax.models.presets import get_preset
from tlt_jax.models.transformer import Transformer, init_model, segment_causal_mask, write_kv
from tlt_jax.optim import OptimConfig
from tlt_jax.parallel.sharding import make_mesh

# A quick constant-rate optimizer for the training tests (decay on matrices as by default).
FAST_OPTIM = OptimConfig(learning_rate=3e-3, schedule="constant", warmup_steps=2, b2=0.95,
                         weight_decay=0.01)  # fmt: skip
CONFIG = get_preset("tiny")
D, V = CONFIG.hidden_size, CONFIG.vocab_size
# One program per shape instead of one per primitive: much faster on few CPU cores.
forward = jax.jit(drafter_forward, static_argnums=1)
loss_of = jax.jit(batch_loss, static_argnums=(1, 2))


def _random_values(abstract_pure: dict, seed: int, scale: float = 0.02) -> dict:
    """Normal(scale) matrices, unit norms, small biases; host RNG (no per-shape compiles)."""
    rng = np.random.default_rng(seed)

    def one(path, leaf):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            return jnp.asarray(1.0 + 0.1 * rng.standard_normal(leaf.shape), leaf.dtype)
        return jnp.asarray(scale * rng.standard_normal(leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(one, abstract_pure)


def random_drafter(seed: int = 0, config=CONFIG, scale: float = 0.05) -> Drafter:
    abstract = nnx.eval_shape(lambda: Drafter(config, rngs=nnx.Rngs(0)))
    return drafter_from_params(config, _random_values(abstract.params_dict(), seed, scale))


@pytest.fixture(scope="module")
def policy():
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(CONFIG, rngs=nnx.Rngs(0))))
    pure = _random_values(nnx.to_pure_dict(state), seed=1, scale=0.5)
    pure["embed"] = pure["embed"] * 2.0
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


@pytest.fixture(scope="module")
def embed_head(policy):
    return policy.embed.get_value(), policy.head_weight_DxV()


def _positions(b, t):
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


# ----------------------------------------------------------------------------- model


def test_forward_shapes_and_only_trainable_params(embed_head):
    embed, head = embed_head
    drafter = random_drafter()
    tokens = jnp.arange(10, dtype=jnp.int32).reshape(2, 5)
    features = jax.random.normal(jax.random.key(0), (2, 5, D))
    g, kv = drafter(embed, tokens, features, _positions(2, 5))
    assert g.shape == (2, 5, D)
    assert kv.k.shape == (1, 2, 5, CONFIG.num_kv_heads, CONFIG.head_dim)
    params = drafter.params_dict()
    assert set(params) == {"fc", "layers"}
    assert params["fc"].shape == (2 * D, D)
    assert set(params["layers"]) == {"q", "k", "v", "o", "mlp_norm", "gate", "up", "down"}
    count = sum(x.size for x in jax.tree.leaves(params))
    layer = CONFIG.num_params() - V * D - D  # tied embedding, final norm
    layer = layer // CONFIG.num_layers - D  # one layer without its input norm
    assert count == 2 * D * D + layer
    # The embedding really is the one passed in: another embedding changes the output.
    g2, _ = drafter(embed * 2.0, tokens, features, _positions(2, 5))
    assert not np.allclose(g, g2)
    logits = draft_logits(g, head)
    assert logits.shape == (2, 5, V) and logits.dtype == jnp.float32
    hot = jnp.array([7, 3, 200], jnp.int32)
    np.testing.assert_allclose(draft_logits(g, head, hot), logits[..., hot], rtol=1e-5, atol=1e-5)


def test_cached_multistep_drafting_equals_full_forward(embed_head):
    embed, _ = embed_head
    drafter = random_drafter(1)
    b, prefill, steps = 2, 5, 4
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, V, (b, prefill + steps)), jnp.int32)
    features = jnp.asarray(rng.standard_normal((b, prefill, D)), jnp.float32)
    positions = _positions(b, prefill + steps)
    cache = drafter.init_cache(b, 16)
    lens = jnp.zeros((b,), jnp.int32)
    params, config = drafter.params_dict(), drafter.config
    g_prefill, kv = forward(params, config, embed, tokens[:, :prefill], features,
                            positions[:, :prefill], cache=cache, cache_lens_B=lens)  # fmt: skip
    cache, lens = write_kv(cache, kv, lens), lens + prefill
    feature, drafted = g_prefill[:, -1:], []
    for i in range(steps):
        t = prefill + i
        feature, kv = forward(params, config, embed, tokens[:, t : t + 1], feature,
                              positions[:, t : t + 1], cache=cache, cache_lens_B=lens)  # fmt: skip
        cache, lens = write_kv(cache, kv, lens), lens + 1
        drafted.append(feature)
    # The full forward sees, at every drafted position, the previous position's own output.
    full_features = jnp.concatenate([features, g_prefill[:, -1:], *drafted[:-1]], axis=1)
    g_full, _ = forward(params, config, embed, tokens, full_features, positions)
    np.testing.assert_allclose(g_full[:, :prefill], g_prefill, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g_full[:, prefill:], jnp.concatenate(drafted, 1), atol=1e-5)


# ----------------------------------------------------------------------------- alignment, loss


def test_eagle_inputs_alignment_by_hand():
    tokens = jnp.array([[10, 11, 12, 13, 20, 21, 22, 0]])
    segments = jnp.array([[1, 1, 1, 1, 2, 2, 2, 0]])
    response = jnp.array([[0, 0, 1, 1, 0, 1, 1, 0]], bool)
    features = jnp.arange(8, dtype=jnp.float32).reshape(1, 8, 1)
    out = eagle_inputs(tokens, features, response, segments)
    np.testing.assert_array_equal(out.tokens_BxT, [[11, 12, 13, 0, 21, 22, 0, 0]])
    np.testing.assert_array_equal(out.features_BxTxD[..., 0], [[0, 1, 2, 3, 4, 5, 6, 7]])
    np.testing.assert_array_equal(out.targets_BxTxD[..., 0], [[1, 2, 3, 0, 5, 6, 0, 0]])
    # Pair t trains iff x[t+1] is a response token of the same segment.
    np.testing.assert_array_equal(out.loss_mask_BxT, [[0, 1, 1, 0, 1, 1, 0, 0]])


def test_loss_hand_computed():
    g = jnp.array([[[0.5, 2.0], [9.0, -9.0]]])
    target = jnp.array([[[1.0, 0.0], [0.0, 0.0]]])
    mask = jnp.array([[True, False]])  # the second (huge) pair must not count
    head = jnp.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])  # D=2, V=3
    loss, metrics = jax.jit(eagle_loss)(g, target, mask, head)
    vloss = (0.5 * 0.5**2 + (2.0 - 0.5)) / 2  # SmoothL1 of (-0.5, 2.0), mean over D
    p = np.exp([1.0, 0.0, 0.0]) / np.exp([1.0, 0.0, 0.0]).sum()
    log_q = np.array([0.5, 2.0, 0.0]) - math.log(math.exp(0.5) + math.exp(2.0) + 1.0)
    ploss = -float(np.sum(p * log_q))
    np.testing.assert_allclose(metrics["vloss"], vloss, rtol=1e-6)
    np.testing.assert_allclose(metrics["ploss"], ploss, rtol=1e-6)
    np.testing.assert_allclose(loss, vloss + 0.1 * ploss, rtol=1e-6)
    assert float(metrics["accuracy"]) == 0.0 and float(metrics["tokens"]) == 1.0
    np.testing.assert_allclose(smooth_l1(jnp.array([0.5, -3.0])), [0.125, 2.5])
    # Chunked logits give the same loss and gradient.
    grad = jax.jit(jax.grad(lambda x: eagle_loss(x, target, mask, head)[0]))(g)
    chunked = jax.grad(lambda x: eagle_loss(x, target, mask, head, token_chunk=1)[0])
    grad_chunked = jax.jit(chunked)(g)
    np.testing.assert_allclose(grad_chunked, grad, rtol=1e-6)


def test_hot_vocabulary_loss_is_the_renormalised_target():
    # With the head's columns of a hot vocabulary, both distributions are the full softmaxes
    # renormalised on those ids (by hand, in numpy).
    rng = np.random.default_rng(0)
    g, target = rng.standard_normal((2, 1, 3, 4)).astype(np.float32)
    head = rng.standard_normal((4, 7)).astype(np.float32)
    hot = np.array([5, 0, 3])
    mask = np.ones((1, 3), bool)
    _, metrics = jax.jit(eagle_loss)(g, target, mask, head[:, hot])

    def renormalised(logits):
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p = (p / p.sum(-1, keepdims=True))[..., hot]
        return p / p.sum(-1, keepdims=True)

    p, q = renormalised(target[0] @ head), renormalised(g[0] @ head)
    np.testing.assert_allclose(metrics["ploss"], -np.mean(np.sum(p * np.log(q), -1)), rtol=1e-5)
    accuracy = np.mean(p.argmax(-1) == q.argmax(-1))
    np.testing.assert_allclose(metrics["accuracy"], accuracy)


def _samples(rng, lengths):
    out = []
    for n in lengths:
        mask = np.zeros(n, bool)
        mask[rng.integers(1, 3) :] = True
        out.append((rng.integers(0, V, n).astype(np.int32),
                    rng.standard_normal((n, D)).astype(np.float32), mask))  # fmt: skip
    return out


def test_packed_loss_equals_separate_losses(embed_head):
    embed, head = embed_head
    params = random_drafter(2).params_dict()
    config = DrafterTrainConfig()
    samples = _samples(np.random.default_rng(3), (6, 9, 5))
    packed, count = pack_windows(samples, batch_rows=1, row_len=24)
    assert count == 3
    np.testing.assert_array_equal(packed.segment_ids_BxT[0], [1] * 6 + [2] * 9 + [3] * 5 + [0] * 4)
    np.testing.assert_array_equal(packed.positions_BxT[0, 6:15], np.arange(9))
    _, total = loss_of(params, CONFIG, config, packed, embed, head)
    separate = [loss_of(params, CONFIG, config, pack_windows([s], 1, 24)[0], embed, head)[1]
                for s in samples]  # fmt: skip
    tokens = np.array([float(m["tokens"]) for m in separate])
    assert float(total["tokens"]) == tokens.sum()
    for key in ("vloss", "ploss", "loss"):
        weighted = np.sum([float(m[key]) for m in separate] * tokens) / tokens.sum()
        np.testing.assert_allclose(float(total[key]), weighted, rtol=1e-5)


def test_packed_segments_do_not_leak(embed_head):
    embed, _ = embed_head
    drafter = random_drafter(3)
    samples = _samples(np.random.default_rng(4), (7, 8))

    def outputs(batch):
        inputs = eagle_inputs(batch.tokens_BxT, batch.features_BxTxD, batch.loss_mask_BxT,
                              batch.segment_ids_BxT)  # fmt: skip
        g, _ = forward(drafter.params_dict(), drafter.config, embed, inputs.tokens_BxT,
                       inputs.features_BxTxD, batch.positions_BxT,
                       mask_BxTxT=segment_causal_mask(batch.segment_ids_BxT))  # fmt: skip
        return g

    g = outputs(pack_windows(samples, 1, 16)[0])
    changed = [(np.roll(samples[0][0], 1) + 1) % V, samples[0][1] + 1.0, samples[0][2]]
    g_changed = outputs(pack_windows([tuple(changed), samples[1]], 1, 16)[0])
    assert not np.allclose(g[0, :6], g_changed[0, :6])
    np.testing.assert_allclose(g[0, 7:15], g_changed[0, 7:15], rtol=0, atol=1e-6)
    # And segment 2 of the packed row equals sample 2 run alone (positions restart at 0).
    g_alone = outputs(pack_windows([samples[1]], 1, 16)[0])
    np.testing.assert_allclose(g[0, 7:14], g_alone[0, :7], rtol=1e-5, atol=1e-5)


def test_unrolled_levels_equal_multistep_drafting(embed_head):
    """Training-time test: level m of the unrolled forward is what cached drafting computes."""
    embed, _ = embed_head
    drafter = random_drafter(4)
    params, config = drafter.params_dict(), drafter.config
    first, sample = _samples(np.random.default_rng(6), (5, 12))
    sample[2][:] = np.arange(12) >= 3  # response from position 3
    sample[2][9] = False  # a hole: chains through pair 8 (x[9]) are not trained
    steps = 3
    packed, _ = pack_windows([first, sample], batch_rows=1, row_len=20)
    inputs = eagle_inputs(packed.tokens_BxT, packed.features_BxTxD, packed.loss_mask_BxT,
                          packed.segment_ids_BxT)  # fmt: skip
    unroll = jax.jit(unrolled_forward, static_argnums=(1, 6))
    levels = unroll(params, config, embed, inputs, packed.positions_BxT, packed.segment_ids_BxT,
                    steps)  # fmt: skip
    assert len(levels) == steps
    # Reference: the sample alone, drafted step by step through the drafter's KV cache.
    n, offset = 12, 5
    tokens = np.asarray(inputs.tokens_BxT[0, offset : offset + n])[None]
    features = jnp.asarray(sample[1])[None]
    positions = _positions(1, n)
    _, kv_all = forward(params, config, embed, jnp.asarray(tokens), features, positions)
    full_cache = write_kv(drafter.init_cache(1, 16), kv_all, jnp.zeros((1,), jnp.int32))
    pair_trained = np.asarray(inputs.loss_mask_BxT[0, offset : offset + n])
    checked = 0
    for t in range(n - steps):
        cache, feature = full_cache, features[:, t : t + 1]
        for m in range(1, steps + 1):
            i = t + m - 1  # the pair at position i: (x[i+1], level m-1's output)
            lens = jnp.full((1,), i, jnp.int32)
            feature, kv = forward(params, config, embed, jnp.asarray(tokens[:, i : i + 1]),
                                  feature, positions[:, i : i + 1], cache=cache,
                                  cache_lens_B=lens)  # fmt: skip
            cache = write_kv(cache, kv, lens)
            g_m, trained_m = levels[m - 1]
            assert bool(trained_m[0, offset + i]) == bool(pair_trained[t : i + 1].all()), (t, m)
            np.testing.assert_allclose(g_m[0, offset + i], feature[0, 0], rtol=1e-4, atol=1e-5)
            checked += int(trained_m[0, offset + i])
    assert checked >= 8
    # The packed neighbour is untouched by the sample: level m is trained nowhere in it past
    # its own pairs, and nothing is trained at padding.
    assert not np.asarray(levels[-1][1][0, offset + n :]).any()
    # Level-1 loss and metrics stay those of plain EAGLE training.
    embed_, head = embed_head
    plain = loss_of(params, CONFIG, DrafterTrainConfig(), packed, embed_, head)[1]
    unrolled = loss_of(params, CONFIG, DrafterTrainConfig(unroll_steps=3), packed, embed_, head)[1]
    for key in ("vloss", "ploss", "accuracy", "tokens"):
        np.testing.assert_allclose(unrolled[key], plain[key], rtol=1e-6)
    assert set(unrolled) >= {"accuracy_2", "accuracy_3"}


# ----------------------------------------------------------------------------- data


def test_windows_and_buffer_recent_steps():
    rng = np.random.default_rng(0)
    mask = np.zeros(100, bool)
    mask[30:90] = True
    assert cut_window(mask, 128, 8, rng) == (22, 90)
    for _ in range(20):
        start, end = cut_window(mask, 16, 8, rng)
        assert end - start == 16 and 22 <= start and end <= 90
    assert cut_window(np.zeros(5, bool), 16, 8, rng) is None
    assert cut_window(mask, 16, 100, rng)[0] >= 30 - 8  # context capped at half a window

    buffer = DrafterBuffer(window=16, prompt_context=2, last_n_steps=2, feature_dtype=np.float32)
    for step in range(3):
        tokens = np.full((2, 12), step + 1, np.int32)
        tokens[:, 0] = 100  # left padding, dropped through valid_mask
        valid = np.ones((2, 12), bool)
        valid[:, 0] = False
        response = np.zeros((2, 12), bool)
        response[:, 6:] = True
        features = np.full((2, 12, D), float(step), np.float32)
        assert buffer.add(tokens, features, response, step, valid_mask=valid) == 2
    assert len(buffer) == 6 and buffer.latest_step == 2
    batch = buffer.sample_batch(rng, batch_rows=2, row_len=32)
    used = batch.segment_ids_BxT > 0
    assert set(np.unique(batch.tokens_BxT[used])) == {2, 3}  # steps 1 and 2 only
    assert used.sum() == 4 * 8  # 2 prompt-context tokens + 6 response tokens per window
    np.testing.assert_array_equal(batch.loss_mask_BxT[used].reshape(4, 8)[:, :2], False)
    # Steps that added nothing (every group silent) still move the window on: one step on,
    # only step 2's samples; two, none (no training on a policy older than 2 steps).
    buffer.end_step(3)
    assert {s.step for s in buffer.recent_samples()} == {2}
    buffer.end_step(4)
    assert buffer.recent_samples() == [] and buffer.sample_batch(rng, 2, 32) is None
    buffer.end_step(1)  # an earlier step never moves it back
    assert buffer.latest_step == 4


# ----------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def train_buffer(policy):
    from tlt_jax.drafter.warmup import harvest_features

    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(0, V, 8)) for _ in range(8)]
    responses = [list(rng.integers(0, V, 32)) for _ in range(8)]
    buffer = DrafterBuffer(window=32, prompt_context=4, last_n_steps=1, feature_dtype=np.float32)
    assert harvest_features(policy, buffer, prompts, responses, batch_size=8) == 8
    return buffer


def test_harvest_features_equal_unpadded_forward(policy):
    # Mixed lengths: batched in length order, padded per batch; every stored sample must hold
    # its own unpadded forward's features, in its own order of tokens.
    from tlt_jax.drafter.warmup import harvest_features

    rng = np.random.default_rng(8)
    prompts = [list(rng.integers(0, V, n)) for n in (5, 9, 3, 7, 6)]
    responses = [list(rng.integers(0, V, n)) for n in (70, 4, 20, 90, 11)]
    buffer = DrafterBuffer(window=256, prompt_context=64, last_n_steps=1,
                           feature_dtype=np.float32)  # fmt: skip
    assert harvest_features(policy, buffer, prompts, responses, batch_size=2) == 5
    by_tokens = {tuple(s.tokens_T.tolist()): s for s in buffer._samples}
    for p, r in zip(prompts, responses, strict=True):
        sample = by_tokens[tuple(p + r)]
        n = len(p) + len(r)
        want, _ = policy(jnp.asarray([p + r]), jnp.arange(n)[None])
        np.testing.assert_allclose(sample.features_TxD, want[0], atol=2e-5, rtol=1e-4)
        np.testing.assert_array_equal(sample.response_mask_T, [False] * len(p) + [True] * len(r))


def test_training_reduces_loss_and_checkpoint_resumes(train_buffer, embed_head, tmp_path):
    embed, head = embed_head
    config = DrafterTrainConfig(optim=FAST_OPTIM, batch_rows=2, row_len=64)
    step_fn = make_train_step(CONFIG, config)
    state = init_train_state(random_drafter(4).params_dict(), config)
    eval_batch = train_buffer.sample_batch(np.random.default_rng(99), 2, 64)
    first = float(loss_of(state.params, CONFIG, config, eval_batch, embed, head)[0])
    for step in range(50):
        batch = train_buffer.sample_batch(np.random.default_rng(step), 2, 64)
        state, metrics = step_fn(state, batch, embed, head)
    last = float(loss_of(state.params, CONFIG, config, eval_batch, embed, head)[0])
    assert last < 0.8 * first, (first, last)
    assert int(state.step) == 50 and np.isfinite(float(metrics["grad_norm"]))
    assert step_fn._cache_size() == 1  # every batch has the same shapes: one program

    checkpointer = DrafterCheckpointer(tmp_path / "ckpt", CONFIG, keep=2)
    assert checkpointer.restore(state) is None
    saved = jax.tree.map(np.array, state)
    assert checkpointer.save(state)
    # The step donates `state` right after the (asynchronous) save was started.
    state, expected = step_fn(state, eval_batch, embed, head)
    checkpointer.close()

    fresh = init_train_state(random_drafter(5).params_dict(), config)
    reopened = DrafterCheckpointer(tmp_path / "ckpt", CONFIG, keep=2)
    restored = reopened.restore(fresh)
    assert int(restored.step) == 50 and reopened.latest_step() == 50
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.array, restored), saved)
    restored, again = step_fn(restored, eval_batch, embed, head)
    assert int(restored.step) == 51
    for key in expected:
        np.testing.assert_array_equal(again[key], expected[key])
    # A checkpoint of another architecture is refused by name.
    other = DrafterCheckpointer(tmp_path / "ckpt", CONFIG.replace(rope_theta=500.0))
    with pytest.raises(ValueError, match="rope_theta"):
        other.restore(fresh)
    # A field only the checkpoint records is named too (the message said "differ at {}").
    stored_only = DrafterCheckpointer(tmp_path / "ckpt2", CONFIG)
    stored_only._metadata["from_a_newer_version"] = 1
    stored_only.save(fresh, force=True)
    stored_only.close()
    with pytest.raises(ValueError, match=r"'from_a_newer_version': \(1, None\)"):
        DrafterCheckpointer(tmp_path / "ckpt2", CONFIG).check()


# ----------------------------------------------------------------------------- export


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_export_round_trip(model_type, embed_head, tmp_path):
    embed, _ = embed_head
    config = CONFIG.replace(model_type=model_type, attention_bias=model_type == "qwen2")
    drafter = random_drafter(6, config)
    out = export_eagle(drafter.params_dict(), config, tmp_path / "eagle")
    from safetensors.numpy import load_file

    names = set(load_file(str(out / "model.safetensors")))
    assert all(n.startswith(("fc.", "layers.0.")) for n in names)
    assert "fc.weight" in names and not any("input_layernorm" in n for n in names)
    assert ("layers.0.self_attn.q_proj.bias" in names) == (model_type == "qwen2")
    assert load_file(str(out / "model.safetensors"))["fc.weight"].shape == (D, 2 * D)
    hf = json.loads((out / "config.json").read_text())
    assert hf["num_hidden_layers"] == 1
    assert hf["architectures"] == [{"llama": "LlamaForCausalLMEagle",
                                    "qwen2": "Qwen2ForCausalLMEagle"}[model_type]]  # fmt: skip
    loaded = load_eagle(out)
    assert loaded.config == drafter_config(config)
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
    features = jax.random.normal(jax.random.key(1), (2, 6, D))
    g, _ = drafter(embed, tokens, features, _positions(2, 6))
    g_loaded, _ = loaded(embed, tokens, features, _positions(2, 6))
    np.testing.assert_array_equal(g_loaded, g)


def test_a_drafter_of_another_model_is_refused_by_name_on_every_load_path(tmp_path, monkeypatch):
    """A drafter exported for a model of the same widths but another vocabulary used to load
    (and compile, and draft ids of the other tokenizer): `load_eagle` with the target, the RL
    run's `spec.drafter` and generate.py --drafter refuse it, naming the directory and both
    values, before an engine is built."""
    from tlt_jax.data.tokenizer import ByteTokenizer
    from tlt_jax.models import checkpoints
    from tlt_jax.rl import policy
    from tlt_jax.rl.config import ModelSettings, SpecConfig
    from tlt_jax.rl.policy import load_drafter
    from tlt_jax.rollout import generate

    out = export_eagle(random_drafter(3).params_dict(), CONFIG, tmp_path / "eagle")
    other = CONFIG.replace(vocab_size=2 * CONFIG.vocab_size)
    message = re.escape(
        f"EAGLE drafter {out} was exported for another model: its config.json "
        f"has vocab_size={CONFIG.vocab_size} (the target's: {other.vocab_size})"
    )
    with pytest.raises(ValueError, match=message):
        load_eagle(out, target=other)
    with pytest.raises(ValueError, match=message):
        load_drafter(SpecConfig(drafter=str(out)), other)
    assert load_drafter(SpecConfig(drafter=str(out)), CONFIG)[0].config == drafter_config(CONFIG)
    with pytest.raises(ValueError, match=re.escape("model_type='llama' (the target's: 'qwen2')")):
        load_eagle(out, target=CONFIG.replace(model_type="qwen2", attention_bias=True))

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was built before the drafter was checked")

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the drafter was checked")

    monkeypatch.setattr(checkpoints, "load_tokenizer", lambda name: ByteTokenizer())
    monkeypatch.setattr(checkpoints, "load_config", lambda *a, **k: other)
    monkeypatch.setattr(checkpoints, "load_model", no_model)
    monkeypatch.setattr(generate, "RolloutEngine", no_engine)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    config = generate.GenerateConfig(model="tiny", prompts=str(prompts), drafter=str(out))
    with pytest.raises(ValueError, match=message):
        generate.run(config)
    # The RL run checks it with its spec files, before its policy loads.
    monkeypatch.setattr(policy, "model_config", lambda settings: other)
    with pytest.raises(ValueError, match=message):
        policy.check_spec_files(SpecConfig(drafter=str(out)), ModelSettings(preset="tiny"))


def test_a_linear_rope_targets_own_export_loads(tmp_path):
    """An HF target with linear RoPE scaling and `original_max_position_embeddings` (unused by
    linear scaling): its export writes only `factor`, and reloading it compared unequal to the
    target ('exported for another model'). Unused fields now take their defaults."""
    from tlt_jax.models.config import RopeScaling

    scaling = RopeScaling("linear", 2.0, original_max_position_embeddings=4096)
    target = CONFIG.replace(rope_scaling=scaling)
    assert target.rope_scaling == RopeScaling("linear", 2.0)
    out = export_eagle(init_drafter(target, 0).params_dict(), target, tmp_path / "eagle")
    assert load_eagle(out, target=target).config.rope_scaling == target.rope_scaling
    llama3 = RopeScaling("llama3", 8.0, original_max_position_embeddings=4096)
    assert llama3 != RopeScaling("llama3", 8.0)  # used there


def test_spot_training_refuses_a_warm_drafter_whose_layer_it_cannot_train(tmp_path):
    """An EAGLE export may keep its own MLP width and norm epsilon (drafting takes them), but
    spot training builds the target's layer: it failed after the policy loaded on the width,
    and trained with the target's epsilon silently. Refused by name before the policy loads."""
    from tlt_jax.rl import policy
    from tlt_jax.rl.config import ModelSettings, SpecConfig

    wide = CONFIG.replace(intermediate_size=2 * CONFIG.intermediate_size,
                          rms_norm_eps=CONFIG.rms_norm_eps / 10)  # fmt: skip
    out = export_eagle(init_drafter(wide, 0).params_dict(), wide, tmp_path / "wide")
    settings = ModelSettings(preset="tiny")
    policy.check_spec_files(SpecConfig(drafter=str(out)), settings)  # drafting: fine
    message = (rf"spec\.drafter='.*wide' has intermediate_size={wide.intermediate_size} \(the "
               rf"target's: {CONFIG.intermediate_size}\), rms_norm_eps={wide.rms_norm_eps!r} "
               rf"\(the target's: {CONFIG.rms_norm_eps!r}\): spot training "
               r"\(spot\.enabled\)")  # fmt: skip
    with pytest.raises(ValueError, match=message):
        policy.check_spec_files(SpecConfig(drafter=str(out)), settings, spot=True)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "field, value",
    [("batch_rows", 0), ("loss_token_chunk", 0), ("window", 2.5), ("unroll_steps", 0),
     ("unroll_decay", 0.0), ("total_steps", 50)],
)  # fmt: skip
def test_train_config_validation_names_field(field, value):
    # total_steps=50 is under the default optimizer's 100 warm-up steps (cosine).
    name = "optim.warmup_steps=100 must be < total_steps=50" if field == "total_steps" else (
        rf"{field}={value!r}".replace(".", r"\."))  # fmt: skip
    with pytest.raises(ValueError, match=name):
        DrafterTrainConfig(**{field: value})


@pytest.mark.parametrize(
    "field, value", [("learning_rate", -1.0), ("schedule", "step"), ("b2", 1.0),
                     ("grad_clip", -0.5)])  # fmt: skip
def test_the_drafter_optimizer_is_the_rl_optimizer_config(field, value):
    """One optimizer config for both trainers: the drafter's errors are `OptimConfig`'s."""
    assert isinstance(DrafterTrainConfig().optim, OptimConfig)
    with pytest.raises(ValueError, match=re.escape(f"optim.{field}={value!r}")):
        DrafterTrainConfig(optim=dataclasses.replace(DrafterTrainConfig().optim,
                                                     **{field: value}))  # fmt: skip
    with pytest.raises(ValueError, match=r"optim\.learning_rate=0\.0 must be > 0"):
        DrafterTrainConfig(optim=OptimConfig(learning_rate=0.0))


def test_param_shardings_on_fake_mesh():
    shardings = param_shardings(CONFIG, make_mesh((2, 4)), role="train")
    assert shardings["fc"].spec == jax.sharding.PartitionSpec("data", None)
    assert shardings["layers"]["q"].spec[2] == "tensor"
    with_bias = param_shardings(CONFIG, make_mesh((2, 4)), role="train", fc_bias=True)
    assert with_bias["fc_bias"].spec == jax.sharding.PartitionSpec("data")
    assert "fc_bias" not in shardings


# ----------------------------------------------------------------------------- warm-up


class _ByteTokenizer:
    """Bytes folded into the tiny vocabulary; id 0 is eos and there are no other special tokens."""

    chat_template = None
    eos_token_id = 0

    def encode(self, text, add_special_tokens=True):
        return [1 + b % (V - 1) for b in text.encode()]

    def convert_tokens_to_ids(self, token):
        return None

    def convert_ids_to_tokens(self, token_id):
        return None


def test_warmup_trains_resumes_and_exports(policy, tmp_path, monkeypatch):
    from tlt_jax.drafter import warmup

    calls = []

    def fake_generate(model, prompt_ids, *, max_new_tokens, stop_ids, **kwargs):
        calls.append((len(prompt_ids), tuple(stop_ids)))
        return [[(3 * i + j) % (V - 1) + 1 for j in range(max_new_tokens)]
                for i in range(len(prompt_ids))]  # fmt: skip

    monkeypatch.setattr(warmup, "generate_responses", fake_generate)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(5)))
    # The training test's settings and shapes: its programs come from the compilation cache.
    train = DrafterTrainConfig(optim=FAST_OPTIM, batch_rows=2, row_len=64, window=32,
                               checkpoint_every=2)  # fmt: skip
    config = warmup.WarmupConfig(prompts=str(prompts), workdir=str(tmp_path / "work"),
                                 instruction="", max_new_tokens=20, harvest_batch=8,
                                 train=train)  # fmt: skip
    out = warmup.run_warmup(config, policy, _ByteTokenizer(), max_steps=3)
    assert load_eagle(out).config == drafter_config(CONFIG)
    # Response i holds ids 3i+1 .. 3i+20: ids 13 .. 20 occur in all five (ties: lower id first).
    counts = load_token_counts(out, V)
    assert counts.sum() == 5 * 20 and counts[13] == 5 and counts[0] == 0
    assert load_hot_vocab(out, 3, V).tolist() == [13, 14, 15]
    # A size at least the vocabulary is the whole vocabulary, as the online drafter treats it
    # (a small-vocabulary run's export loads with the default spec.hot_vocab of 2048).
    assert load_hot_vocab(out, V, V) is None and load_hot_vocab(out, 2048, V) is None
    seen_hot = []
    train_drafter = warmup.train_drafter

    def spy_train(*args, hot_token_ids=None, **kwargs):
        seen_hot.append(hot_token_ids)
        return train_drafter(*args, hot_token_ids=hot_token_ids, **kwargs)

    monkeypatch.setattr(warmup, "train_drafter", spy_train)
    config = dataclasses.replace(config, hot_vocab_size=3)
    out = warmup.run_warmup(config, policy, _ByteTokenizer(), max_steps=5)
    # The RL job's stop ids; the second run reused the cached responses.
    assert calls == [(5, stop_token_ids(_ByteTokenizer()))] == [(5, (0,))]
    assert seen_hot[0].tolist() == [13, 14, 15]  # the loss ran over the hot ids
    # Other weights are refused before anything is generated: this workdir's drafter was
    # trained for the other policy (it used to regenerate the responses, then resume that
    # drafter). Another temperature generates anew (features of other tokens would train the
    # drafter on the wrong distribution); the same settings do not.
    scaled = init_model(CONFIG, 1)
    with pytest.raises(ValueError, match="trained for another policy"):
        warmup.run_warmup(config, scaled, _ByteTokenizer(), max_steps=5)
    assert len(calls) == 1
    warmup.run_warmup(dataclasses.replace(config, temperature=0.7), policy, _ByteTokenizer(),
                      max_steps=5)  # fmt: skip
    warmup.run_warmup(dataclasses.replace(config, temperature=0.7), policy, _ByteTokenizer(),
                      max_steps=5)  # fmt: skip
    assert len(calls) == 2
    with pytest.raises(ValueError, match="hot_vocab_size=999"):
        warmup.run_warmup(dataclasses.replace(config, hot_vocab_size=999), policy,
                          _ByteTokenizer(), max_steps=5)  # fmt: skip
    steps = sorted(int(p.name) for p in (tmp_path / "work" / "checkpoints").iterdir())
    assert steps[-1] == 5 and 3 in steps


def test_another_policys_drafter_checkpoint_is_refused_by_name_before_any_work(
    tmp_path, monkeypatch
):
    """A workdir whose drafter checkpoint was trained for a policy of other shapes: the
    architecture check names the field (orbax's shape error used to come first), and the
    warm-up refuses it before regenerating the cached responses or compiling the harvest."""
    from tlt_jax.drafter import warmup

    config = DrafterTrainConfig(optim=FAST_OPTIM, batch_rows=2, row_len=64)
    checkpointer = DrafterCheckpointer(tmp_path / "work" / "checkpoints", CONFIG,
                                       async_save=False)  # fmt: skip
    assert checkpointer.save(init_train_state(random_drafter(4).params_dict(), config), force=True)
    checkpointer.close()
    wider = CONFIG.replace(intermediate_size=2 * CONFIG.intermediate_size)
    fresh = jax.eval_shape(lambda: init_train_state(random_drafter(4, wider).params_dict(), config))
    other = DrafterCheckpointer(tmp_path / "work" / "checkpoints", wider)
    with pytest.raises(ValueError, match="another drafter.*intermediate_size"):
        other.restore(fresh)
    other.close()
    cache = tmp_path / "work" / "responses.jsonl"
    cache.write_text("the earlier policy's responses\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "q"}) + "\n")

    def no_work(*args, **kwargs):
        raise AssertionError("generated or harvested before refusing the checkpoint")

    monkeypatch.setattr(warmup, "generate_responses", no_work)
    monkeypatch.setattr(warmup, "harvest_features", no_work)
    warm = warmup.WarmupConfig(prompts=str(prompts), workdir=str(tmp_path / "work"),
                               train=config)  # fmt: skip
    with pytest.raises(ValueError, match="another drafter.*intermediate_size"):
        warmup.run_warmup(warm, nnx.eval_shape(lambda: Transformer(wider, rngs=nnx.Rngs(0))),
                          _ByteTokenizer(), max_steps=2)  # fmt: skip
    assert cache.read_text() == "the earlier policy's responses\n"
    # The same architecture trained for another policy (a base vs an instruct model): the
    # architecture alone let it resume, so a finished warm-up re-exported the old drafter.
    policy = Transformer(CONFIG, rngs=nnx.Rngs(0))
    digest = warmup.policy_digest(policy)
    assert digest != warmup.policy_digest(Transformer(CONFIG, rngs=nnx.Rngs(1)))
    with pytest.raises(ValueError, match=f"trained for another policy \\(weights digest "
                       f"0123456789abcdef, this policy's {digest}\\)"):  # fmt: skip
        other_policy = DrafterCheckpointer(tmp_path / "work" / "checkpoints", CONFIG,
                                           policy_weights="0123456789abcdef")  # fmt: skip
        other_policy.save(init_train_state(random_drafter(4).params_dict(), config).replace(
            step=jnp.int32(7)), force=True)  # fmt: skip
        other_policy.close()
        warmup.run_warmup(warm, policy, _ByteTokenizer(), max_steps=2)
    assert cache.read_text() == "the earlier policy's responses\n"
    # A checkpoint that records no policy (written before it did) is not refused.
    assert DrafterCheckpointer(tmp_path / "work" / "checkpoints", CONFIG).check(0) == 0


def test_a_torn_response_cache_is_regenerated_not_fatal(tmp_path):
    """A warm-up killed while writing responses.jsonl left half a line: the next run
    generates anew (it used to stop on a JSONDecodeError naming no file)."""
    from tlt_jax.drafter import warmup

    line = json.dumps({"prompt_ids": [1, 2], "response_ids": list(range(500)), "generation": {}})
    cache = tmp_path / "responses.jsonl"
    cache.write_text(line + "\n" + line[:300])
    assert warmup._cached_responses(cache, [[1, 2]] * 2, {}) is None
    cache.write_text(line + "\n" + line + "\n")
    assert warmup._cached_responses(cache, [[1, 2]] * 2, {}) == [list(range(500))] * 2


@pytest.mark.parametrize("fc_bias", [False, True])
def test_export_matches_torch_eagle_reference(embed_head, tmp_path, fc_bias):
    """What an HF / SGLang EAGLE loader computes from the export equals our drafter; an
    EAGLE-1/2 checkpoint with a trained (non-zero) fc.bias loads into the optional bias."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import load_file, save_file

    embed, _ = embed_head
    config = CONFIG.replace(model_type="qwen2", attention_bias=True)
    drafter = random_drafter(7, config)
    out = export_eagle(drafter.params_dict(), config, tmp_path / "eagle")
    if fc_bias:  # the EAGLE-1/2 layout: fc declared with a bias, trained
        written = load_file(str(out / "model.safetensors"))
        written["fc.bias"] = np.asarray(jax.random.normal(jax.random.key(5), (D,)), np.float32)
        save_file(written, str(out / "model.safetensors"), {"format": "pt"})
        drafter = load_eagle(out)
        assert "fc_bias" in drafter.params_dict()
        # And back out: the bias survives an export round trip.
        again = load_eagle(export_eagle(drafter.params_dict(), config, tmp_path / "again"))
        np.testing.assert_array_equal(again.params_dict()["fc_bias"], written["fc.bias"])
    else:
        assert "fc_bias" not in load_eagle(out).params_dict()  # a zero bias is dropped
        # ... but a malformed one is refused, zero or not (it was read only when non-zero).
        written = load_file(str(out / "model.safetensors"))
        bad = tmp_path / "bad"
        bad.mkdir()
        (bad / "config.json").write_text((out / "config.json").read_text())
        save_file({**written, "fc.bias": np.zeros((7,), np.float32)},
                  str(bad / "model.safetensors"), {"format": "pt"})  # fmt: skip
        with pytest.raises(ValueError, match=r"fc\.bias has shape \(7,\); expected"):
            load_eagle(bad)
    hf_config = transformers.Qwen2Config(**{
        k: v for k, v in json.loads((out / "config.json").read_text()).items()
        if k not in ("architectures", "torch_dtype")
    })  # fmt: skip
    tensors = {k: torch.from_numpy(v) for k, v in load_file(str(out / "model.safetensors")).items()}
    model = transformers.Qwen2Model(hf_config).float().eval()
    missing = model.load_state_dict({k: v for k, v in tensors.items() if k.startswith("layers")},
                                    strict=False).missing_keys  # fmt: skip
    assert sorted(missing) == ["embed_tokens.weight", "layers.0.input_layernorm.weight",
                               "norm.weight"]  # fmt: skip
    model.layers[0].input_layernorm = torch.nn.Identity()  # EAGLE: no input norm
    model.norm = torch.nn.Identity()  # and no final norm
    fc = torch.nn.Linear(2 * D, D)
    fc.load_state_dict({"weight": tensors["fc.weight"], "bias": tensors["fc.bias"]})
    tokens = np.arange(12, dtype=np.int32).reshape(2, 6) * 7
    features = np.array(jax.random.normal(jax.random.key(2), (2, 6, D)))
    with torch.no_grad():
        e = torch.from_numpy(np.array(embed))[torch.from_numpy(tokens).long()]
        h = fc(torch.cat([e, torch.from_numpy(features)], dim=-1))
        want = model(inputs_embeds=h, position_ids=torch.arange(6)[None].repeat(2, 1))
    g, _ = forward(drafter.params_dict(), drafter.config, embed, tokens, features,
                   _positions(2, 6))  # fmt: skip
    np.testing.assert_allclose(g, want.last_hidden_state.numpy(), rtol=1e-4, atol=1e-4)
