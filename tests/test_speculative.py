"""Lossless tree speculative decoding: strategies, greedy parity, exact sampling distribution,
KV commit, and the engine's SD mode (switching, stop tokens, max_new_tokens).

Models are the tiny preset in float32 (untied head). An "aligned" drafter is built by hand: the
target's second layer is switched off and its embeddings have unit RMS, so a drafter with
fc = [I; 0] and a noisy copy of the target's first layer reproduces most of the target's
computation (all but the first token, the final norm and the noise); acceptance lengths > 1
really happen. The untrained drafter is a random init.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from tlt_jax.drafter.hot_vocab import count_tokens, hot_token_ids
from tlt_jax.models.decode import unstack_layers
from tlt_jax.models.drafter import Drafter, drafter_forward, init_drafter
from tlt_jax.models.presets import get_preset
from tlt_jax.models.transformer import Transformer, init_model
from tlt_jax.rollout import engine as engine_lib
from tlt_jax.rollout import spec_engine as spec_engine_lib
from tlt_jax.rollout import speculative
from tlt_jax.rollout.acceptance import accept_tree
from tlt_jax.rollout.adaptive import PlainPolicy, arm_name
from tlt_jax.rollout.engine import EngineConfig, Request, RolloutEngine
from tlt_jax.rollout.sampling import SamplingParams, filtered_logits
from tlt_jax.rollout.speculative import SpecStrategy

KV_LEN = 64
ALIGNED = dict(attention=30.0, noise=0.03)  # mean acceptance about 2 of at most 3-4


def aligned_pair(vocab: int = 256, seed: int = 0, noise: float = 0.0, attention: float = 1.0,
                 logit_scale: float = 1.0) -> tuple[Transformer, Drafter]:  # fmt: skip
    """A target whose next token the drafter predicts well (see the module docstring)."""
    config = get_preset("tiny", vocab_size=vocab, tie_word_embeddings=False)
    model = init_model(config, seed)
    model.layers.o.set_value(model.layers.o.get_value() * attention)
    embed = np.asarray(model.embed.get_value())
    embed = embed / np.sqrt(np.mean(embed**2, axis=-1, keepdims=True))
    model.embed.set_value(jnp.asarray(embed))
    for name in ("o", "down"):  # layer 1 adds nothing: the target is its first layer
        param = getattr(model.layers, name)
        param.set_value(param.get_value().at[1].set(0.0))
    model.final_norm.set_value(model.final_norm.get_value() * logit_scale)
    drafter = init_drafter(config, seed + 1)
    d = config.hidden_size
    layers = {name: value[:1] for name, value in model.layers.stacked().items()
              if name != "attn_norm"}  # fmt: skip
    rng = np.random.default_rng(seed)
    layers = {name: value + noise * rng.standard_normal(value.shape).astype(np.float32)
              for name, value in layers.items()}  # fmt: skip
    fc = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], axis=0)
    drafter.load_params({"fc": fc, "layers": layers})
    return model, drafter


# ----------------------------------------------------------------------------- harness
# The engine's SD programs at one fixed batch and kv size (one compile per static key).


@functools.cache
def _jit(fn, *args, **static):
    return jax.jit(functools.partial(fn, *args, **static))


def run_sd(model, drafter, prompts, strategy, min_tokens, *, sampling=None, seeds=None,
           residual="exact", kv_len=KV_LEN, prompt_len=12, hot_token_ids=None):  # fmt: skip
    """Greedy prefill, then SD steps (sampling with `sampling` if given) until every row has
    emitted `min_tokens` tokens after the prefill token.

    Returns:
      (emitted tokens per row after the prefill token, prefill tokens, emitted counts
      [steps, B], final state).
    """
    graphdef, params = nnx.split(model)
    b = len(prompts)
    tokens = np.zeros((b, prompt_len), np.int32)
    for i, prompt in enumerate(prompts):
        tokens[i, : len(prompt)] = prompt
    lens = np.array([len(x) for x in prompts], np.int32)
    seeds = np.arange(b, dtype=np.uint32) if seeds is None else seeds
    zeros = np.zeros((b,), np.float32)
    greedy = sampling is None
    k, d, config = strategy.topk, strategy.depth, drafter.config
    draft = _jit(speculative.draft_program, graphdef, config, batch=b, kv_len=kv_len, topk=k,
                 depth=d)  # fmt: skip
    tree = _jit(speculative.tree_program, batch=b, verify_tokens=strategy.verify_tokens, depth=d)
    # Shared by strategies with the same verify count (the tree's shape), as in the engine.
    verify = _jit(speculative.verify_program, graphdef, config, batch=b, kv_len=kv_len,
                  greedy_only=greedy, residual=residual)  # fmt: skip
    commit = _jit(speculative.commit_program, batch=b)
    layers = unstack_layers(model.layers.stacked())
    dparams = drafter.params_dict()
    state = engine_lib.DecodeState.create(model.config, b, kv_len, config)
    prefill = _jit(engine_lib.prefill_program, graphdef, greedy_only=True, drafter_config=config)
    state, first, _ = prefill(
        params, dparams, state, tokens, lens, np.arange(b, dtype=np.int32),
        np.arange(b, dtype=np.int32), zeros, zeros.astype(np.int32), zeros + 1, seeds,
    )  # fmt: skip
    if sampling is not None:
        state = state.replace(
            temperature=jnp.full((b,), sampling.temperature, jnp.float32),
            top_k=jnp.full((b,), sampling.top_k, jnp.int32),
            top_p=jnp.full((b,), sampling.top_p, jnp.float32),
        )
    out = [[] for _ in range(b)]
    counts_all = []
    while min(len(o) for o in out) < min_tokens:
        cands = draft(params, dparams, state, hot_token_ids)
        if hot_token_ids is not None:  # every drafted token is a hot one
            assert np.isin(np.asarray(cands.tokens_BxC), hot_token_ids).all()
        state, emitted, _, counts, new, path = verify(
            params, layers, dparams, state, tree(cands, state.last_token, state.lengths)
        )
        state = commit(state, new, path, counts)
        emitted, counts = np.asarray(emitted), np.asarray(counts)
        for i in range(b):
            out[i].extend(emitted[i, : counts[i]].tolist())
        counts_all.append(counts)
    return out, np.asarray(first), np.asarray(counts_all).reshape(-1, b), state


def random_prompts(n, vocab, seed, low=3, high=12):
    rng = np.random.default_rng(seed)
    return [tuple(int(t) for t in rng.integers(0, vocab, size=rng.integers(low, high)))
            for _ in range(n)]  # fmt: skip


def plain_greedy(model, prompts, max_new_tokens):
    config = EngineConfig(max_batch_size=len(prompts), max_prefill_batch=len(prompts),
                          max_seq_len=KV_LEN, min_kv_bucket=KV_LEN)  # fmt: skip
    requests = [Request(p, max_new_tokens) for p in prompts]
    return [c.token_ids for c in RolloutEngine(model, config).generate(requests)]


# ----------------------------------------------------------------------------- strategy


def test_strategy_parse_and_validation():
    assert SpecStrategy.parse("8,4,48") == SpecStrategy(depth=8, topk=4, verify_tokens=48)
    assert SpecStrategy.parse("8_4_32") == SpecStrategy(8, 4, 32)
    assert str(SpecStrategy(8, 4, 48)) == "8,4,48"
    SpecStrategy(1, 1, 2)  # 1 drafted node fits k + 0 = 1
    SpecStrategy(3, 2, 11)  # 10 = 2 + 2 * 4
    with pytest.raises(ValueError, match=r"verify_tokens=12 .* = 10 \(depth=3, topk=2\)"):
        SpecStrategy(3, 2, 12)
    with pytest.raises(ValueError, match="verify_tokens=3"):
        SpecStrategy(1, 1, 3)
    for bad in ({"depth": 0}, {"topk": -1}, {"verify_tokens": 0}, {"depth": 2.0}):
        name, value = next(iter(bad.items()))
        with pytest.raises(ValueError, match=rf"spec_strategy.{name}={value!r}"):
            SpecStrategy(**{"depth": 2, "topk": 2, "verify_tokens": 3, **bad})
    with pytest.raises(ValueError, match="three integers"):
        SpecStrategy.parse("8,4")
    with pytest.raises(ValueError, match="spec_max_batch=0"):
        EngineConfig(spec_max_batch=0)
    with pytest.raises(ValueError, match="needs a drafter"):
        RolloutEngine(init_model(get_preset("tiny")), EngineConfig(max_seq_len=64,
                      spec_strategy=SpecStrategy(2, 2, 3)))  # fmt: skip


# ----------------------------------------------------------------------------- acceptance
# A hand-made tree: root (token 5) -> node 1 (token 1) -> node 3 (token 3); root -> node 2
# (token 2). Children are walked in index order.
TREE_TOKENS = np.array([5, 1, 2, 3], np.int32)
TREE_PARENTS = np.array([-1, 0, 0, 1], np.int32)
NEG = -1e9


def _accept(logits_BxTxV, temperature, residual="exact", seed=0):
    b = logits_BxTxV.shape[0]
    tile = lambda x: jnp.asarray(np.broadcast_to(x, (b, 4)))  # noqa: E731
    fn = _jit(accept_tree, greedy_only=temperature == 0, residual=residual)
    return fn(
        jnp.asarray(logits_BxTxV, jnp.float32), tile(TREE_TOKENS), tile(TREE_PARENTS),
        tile(np.array([10, 11, 11, 12])), jnp.full((b,), temperature, jnp.float32),
        jnp.zeros((b,), jnp.int32), jnp.ones((b,), jnp.float32),
        jax.random.split(jax.random.key(seed), b),
    )  # fmt: skip


def test_accept_tree_greedy_by_hand():
    logits = np.zeros((3, 4, 6), np.float32)
    logits[0, 0, 2] = logits[0, 2, 4] = 5.0  # root -> node 2 (leaf) -> bonus 4
    logits[1, 0, 1] = logits[1, 1, 3] = logits[1, 3, 0] = 5.0  # root -> 1 -> 3 -> bonus 0
    logits[2, 0, 4] = 5.0  # the argmax is no child: correction 4
    got = _accept(logits, 0.0)
    np.testing.assert_array_equal(got.num_accepted_B, [1, 2, 0])
    np.testing.assert_array_equal(got.tokens_BxT[0, :2], [2, 4])
    np.testing.assert_array_equal(got.tokens_BxT[1, :3], [1, 3, 0])
    np.testing.assert_array_equal(got.tokens_BxT[2, :1], [4])
    np.testing.assert_array_equal(got.path_BxT[1, :3], [0, 1, 3])
    top = np.log(np.exp(5.0) / (np.exp(5.0) + 5))
    np.testing.assert_allclose(got.logprobs_BxT[1, :3], [top] * 3, atol=1e-6)


@pytest.mark.parametrize("residual", ["exact", "buggy_no_removal"])
def test_accept_tree_sampling_by_hand(residual):
    """Root q: token 1 (child) 0.3, token 2 (child) 0.2, token 0 (no child) 0.5; node 1 always
    continues to node 3, whose bonus is 0 or 1; node 2's bonus is 4. Exact outcome
    probabilities: (1, 3, 0) 0.15, (1, 3, 1) 0.15, (2, 4) 0.2, (0,) 0.5."""
    n = 16384
    logits = np.full((n, 4, 6), NEG, np.float32)
    logits[:, 0, [1, 2, 0]] = np.log([0.3, 0.2, 0.5])
    logits[:, 1, 3] = 0.0
    logits[:, 2, 4] = 0.0
    logits[:, 3, [0, 1]] = 0.0
    got = _accept(logits, 1.0, residual)
    m, tokens = np.asarray(got.num_accepted_B), np.asarray(got.tokens_BxT)
    slots = np.arange(4)[None, :]
    emitted = np.where(slots <= m[:, None], tokens, -1)  # -1 pads after the last emitted
    want = {(1, 3, 0): 0.15, (1, 3, 1): 0.15, (2, 4): 0.2, (0,): 0.5}
    freq = {
        key: np.mean(np.all(emitted == np.array(key + (-1,) * (4 - len(key))), axis=1))
        for key in want
    }
    close = all(abs(freq[key] - p) < 4 * np.sqrt(p * (1 - p) / n) for key, p in want.items())
    if residual == "exact":
        assert close and abs(sum(freq.values()) - 1.0) < 1e-9, freq
        np.testing.assert_allclose(
            got.logprobs_BxT[m == 2, :3], np.log([[0.3, 1.0, 0.5]] * int((m == 2).sum())), rtol=1e-5
        )
    else:  # the correction also draws the rejected children: 1 and 2 come out too often
        assert not close, freq


# ----------------------------------------------------------------------------- greedy


@pytest.fixture(scope="module")
def aligned():
    return aligned_pair(**ALIGNED)


@pytest.fixture(scope="module")
def untrained(aligned):
    return aligned[0], init_drafter(aligned[0].config, 7)


GREEDY_STRATEGIES = [
    SpecStrategy(3, 2, 5),
    SpecStrategy(1, 1, 1),  # verify_tokens 1: plain decoding through the SD programs
    SpecStrategy(1, 3, 4),  # depth 1
    SpecStrategy(4, 1, 5),  # topk 1: a chain
]


@pytest.mark.parametrize("strategy", GREEDY_STRATEGIES, ids=str)
def test_greedy_sd_equals_plain_greedy(strategy, aligned, untrained):
    model = aligned[0]
    prompts = random_prompts(8, model.config.vocab_size, seed=3)
    new_tokens = 16
    want = plain_greedy(model, prompts, new_tokens + 1)
    for name, (_, drafter) in {"aligned": aligned, "untrained": untrained}.items():
        out, first, counts, _ = run_sd(model, drafter, prompts, strategy, new_tokens)
        for i in range(len(prompts)):
            got = [int(first[i])] + out[i][:new_tokens]
            assert got == want[i], f"{name} drafter, {strategy}, prompt {i}"
        if name == "aligned" and strategy.verify_tokens > 1:
            assert counts.mean() > 1.5, (strategy, counts.mean())


def test_greedy_sd_with_hot_vocab_equals_plain_greedy(aligned):
    """Drafting among a hot vocabulary leaves greedy output unchanged: with the target's
    frequent tokens acceptance stays high, with tokens it never emits nothing is accepted."""
    model, drafter = aligned
    vocab = model.config.vocab_size
    prompts = random_prompts(8, vocab, seed=3)
    new_tokens = 16
    want = plain_greedy(model, prompts, new_tokens + 1)
    counts = count_tokens(want, vocab)
    hot = {"frequent": hot_token_ids(counts, 64), "cold": np.flatnonzero(counts == 0)[:8]}
    assert hot["frequent"][0] == np.argmax(counts) and counts[hot["cold"]].sum() == 0
    strategy = SpecStrategy(3, 2, 5)
    means = {}
    for name, ids in hot.items():
        out, first, accepted, _ = run_sd(model, drafter, prompts, strategy, new_tokens,
                                         hot_token_ids=jnp.asarray(ids, jnp.int32))  # fmt: skip
        for i in range(len(prompts)):
            assert [int(first[i])] + out[i][:new_tokens] == want[i], f"{name}, prompt {i}"
        means[name] = accepted.mean()
    assert means["frequent"] > 1.5 and means["cold"] == 1.0, means


def test_draft_through_a_presliced_hot_head_is_the_same_draft(aligned):
    """The engine slices the head's hot columns once per weight sync (`hot_head_program`) and
    passes them to every draft step: the candidates are bit-identical to slicing in the step.
    A head of the wrong shape, or one without its ids, is refused."""
    model, drafter = aligned
    graphdef, params = nnx.split(model)
    b, kv_len, k, d = 2, 32, 3, 3
    state = engine_lib.DecodeState.create(model.config, b, kv_len, drafter.config)
    state = state.replace(draft=state.draft.replace(
        lengths=jnp.array([5, 9], jnp.int32),
        feature=jax.random.normal(jax.random.key(1), state.draft.feature.shape)))  # fmt: skip
    ids = jnp.asarray(np.random.default_rng(0).permutation(model.config.vocab_size)[:40],
                      jnp.int32)  # fmt: skip
    head = jax.jit(functools.partial(speculative.hot_head_program, graphdef))(params, ids)
    np.testing.assert_array_equal(head, np.asarray(model.head_weight_DxV())[:, np.asarray(ids)])
    draft = _jit(speculative.draft_program, graphdef, drafter.config, batch=b, kv_len=kv_len,
                 topk=k, depth=d)  # fmt: skip
    dparams = drafter.params_dict()
    sliced_here, presliced = (draft(params, dparams, state, ids, h) for h in (None, head))
    for want, got in zip(sliced_here, presliced, strict=True):
        np.testing.assert_array_equal(got, want)
    assert np.isin(np.asarray(presliced.tokens_BxC), np.asarray(ids)).all()
    with pytest.raises(ValueError, match=r"hot_head_DxU.shape=\(.*\) must be \(D, U\)"):
        draft(params, dparams, state, ids, head[:, :-1])
    with pytest.raises(ValueError, match="needs the hot_token_ids"):
        draft(params, dparams, state, None, head)


# ----------------------------------------------------------------------------- KV commit


def _reference_states(model, drafter, sequences):
    """Target K/V and features of full forwards, and the drafter's pairs over them."""
    graphdef, params = nnx.split(model)
    b, t = len(sequences), max(len(s) for s in sequences)
    tokens = np.zeros((b, t), np.int32)
    for i, seq in enumerate(sequences):
        tokens[i, : len(seq)] = seq
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))

    @jax.jit
    def forward(params, dparams, tokens):
        model = nnx.merge(graphdef, params)
        features, new = model(tokens, positions)
        next_tokens = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
        g, dnew = drafter_forward(dparams, drafter.config, model.embed.get_value(), next_tokens,
                                  features, positions)  # fmt: skip
        return new, dnew, g

    return forward(params, drafter.params_dict(), tokens)


def test_kv_commit_matches_plain_cache(aligned):
    """After SD steps the target cache below `lengths` holds what plain decoding would have
    built for the same tokens, the drafter cache what the drafter computes over them, and the
    drafter's next feature is its output at the last pair."""
    model, drafter = aligned
    prompts = random_prompts(8, model.config.vocab_size, seed=11)
    out, first, counts, state = run_sd(model, drafter, prompts, SpecStrategy(3, 2, 5), 8)
    assert counts.max() > 1
    sequences = [list(p) + [int(f)] + o for p, f, o in zip(prompts, first, out, strict=True)]
    lengths = np.asarray(state.lengths)
    np.testing.assert_array_equal(lengths, [len(s) - 1 for s in sequences])
    np.testing.assert_array_equal(np.asarray(state.draft.lengths), lengths)
    np.testing.assert_array_equal(np.asarray(state.last_token), [s[-1] for s in sequences])
    new, dnew, g = _reference_states(model, drafter, sequences)
    cache, draft_cache = state.cache.token_major(), state.draft.cache.token_major()
    for i, n in enumerate(lengths):
        for got, want in (
            (cache.k, new.k),
            (cache.v, new.v),
            (draft_cache.k, dnew.k),
            (draft_cache.v, dnew.v),
        ):
            np.testing.assert_allclose(got[:, i, :n], want[:, i, :n], atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(state.draft.feature[i], g[i, n - 1], atol=2e-5, rtol=1e-4)


def _plain_steps(model, drafter, *, eager: bool, steps: int = 7):
    """An SD-synced state of 8 rows, then `steps` plain decode steps (eager drafter sync or
    not). Returns (state, prompts, lengths before the plain steps, tokens x[start ..])."""
    graphdef, params = nnx.split(model)
    prompts = random_prompts(8, model.config.vocab_size, seed=5)
    _, _, _, state = run_sd(model, drafter, prompts, SpecStrategy(3, 2, 5), 0)
    start = np.asarray(state.lengths)
    decode = jax.jit(functools.partial(engine_lib.decode_program, graphdef, batch=8,
                                       kv_len=KV_LEN, greedy_only=True,
                                       drafter_config=drafter.config))  # fmt: skip
    dparams = drafter.params_dict() if eager else None
    layers = unstack_layers(model.layers.stacked())
    tokens = [np.asarray(state.last_token)]
    for _ in range(steps):
        state, tok, _ = decode(params, layers, state, dparams)
        tokens.append(np.asarray(tok))
    return state, prompts, start, np.stack(tokens, axis=1)


def _assert_drafter_matches_reference(model, drafter, state, prompts, tokens, lengths):
    sequences = [list(p) + tokens[i].tolist() for i, p in enumerate(prompts)]
    _, dnew, g = _reference_states(model, drafter, sequences)
    draft_cache = state.draft.cache.token_major()
    for i, n in enumerate(lengths):
        for got, want in ((draft_cache.k, dnew.k), (draft_cache.v, dnew.v)):
            np.testing.assert_allclose(got[:, i, :n], want[:, i, :n], atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(state.draft.feature[i], g[i, n - 1], atol=2e-5, rtol=1e-4)


def test_drafter_catchup_after_plain_steps(aligned):
    """Plain steps leave the drafter behind; the catch-up program rebuilds exactly its state."""
    model, drafter = aligned
    graphdef, params = nnx.split(model)
    state, prompts, start, tokens = _plain_steps(model, drafter, eager=False)
    np.testing.assert_array_equal(np.asarray(state.draft.lengths), start)  # behind by 7
    pad = np.zeros((8, 16 - 7), np.int32)
    catchup = jax.jit(functools.partial(speculative.catchup_program, graphdef, drafter.config,
                                        batch=8, kv_len=KV_LEN))  # fmt: skip
    state = catchup(
        params,
        unstack_layers(model.layers.stacked()),
        drafter.params_dict(),
        state,
        np.concatenate([tokens[:, :7], pad], 1),
        np.concatenate([tokens[:, 1:], pad], 1),
        np.full((8,), 7, np.int32),
    )
    np.testing.assert_array_equal(np.asarray(state.draft.lengths), start + 7)
    _assert_drafter_matches_reference(model, drafter, state, prompts, tokens, start + 7)


def test_eager_drafter_sync_in_plain_steps(aligned):
    """Eager-sync plain steps keep the drafter exactly where the catch-up would put it."""
    model, drafter = aligned
    state, prompts, start, tokens = _plain_steps(model, drafter, eager=True)
    np.testing.assert_array_equal(np.asarray(state.draft.lengths), start + 7)  # in sync
    _assert_drafter_matches_reference(model, drafter, state, prompts, tokens, start + 7)


def test_group_prefill_runs_the_drafter_once_per_prompt(aligned):
    """Two prompts shared by 6 slots in another order (a GRPO prefill), sampled first tokens:
    the drafter runs over the 2 distinct prompts, then one step per slot for its own first
    token. Each slot's drafter cache and next feature equal the drafter over that slot's own
    sequence (prompt + first token), and an unused row (slot = Bmax) writes nothing."""
    model, drafter = aligned
    graphdef, params = nnx.split(model)
    prompts = random_prompts(2, model.config.vocab_size, seed=3)
    tokens = np.zeros((2, 12), np.int32)
    for i, prompt in enumerate(prompts):
        tokens[i, : len(prompt)] = prompt
    lens = np.array([len(p) for p in prompts], np.int32)
    rows = np.array([1, 0, 0, 1, 1, 0, 0], np.int32)
    slots = np.array([4, 0, 2, 1, 5, 3, 6], np.int32)  # the last row is unused (6 = Bmax)
    state = engine_lib.DecodeState.create(model.config, 6, KV_LEN, drafter.config)
    prefill = _jit(engine_lib.prefill_program, graphdef, greedy_only=False,
                   drafter_config=drafter.config)  # fmt: skip
    n = len(rows)
    state, first, _ = prefill(
        params, drafter.params_dict(), state, tokens, lens, rows, slots,
        np.full((n,), 1.5, np.float32), np.zeros((n,), np.int32), np.ones((n,), np.float32),
        np.arange(n, dtype=np.uint32),
    )  # fmt: skip
    first = np.asarray(first)
    assert len({int(f) for f, r in zip(first, rows, strict=True) if r == 0}) > 1  # samples differ
    order = np.argsort(slots[:-1])
    sequences = [list(prompts[rows[i]]) + [int(first[i])] for i in order]
    lengths = np.array([len(s) - 1 for s in sequences])
    np.testing.assert_array_equal(np.asarray(state.draft.lengths), lengths)
    _, dnew, g = _reference_states(model, drafter, sequences)
    draft_cache = state.draft.cache.token_major()
    for slot, m in enumerate(lengths):
        for got, want in ((draft_cache.k, dnew.k), (draft_cache.v, dnew.v)):
            np.testing.assert_allclose(got[:, slot, :m], want[:, slot, :m], atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(state.draft.feature[slot], g[slot, m - 1], atol=2e-5,
                                   rtol=1e-4)  # fmt: skip


def test_pallas_attention_matches_xla(aligned):
    """The SD programs with the Pallas tree-attention kernel (interpret mode on CPU)."""
    model, drafter = aligned
    graphdef, params = nnx.split(model)
    prompts = random_prompts(8, model.config.vocab_size, seed=13)
    _, _, _, state = run_sd(model, drafter, prompts, SpecStrategy(3, 2, 5), 4)
    dparams, results = drafter.params_dict(), []
    for impl in ("xla", "pallas"):
        draft = jax.jit(functools.partial(speculative.draft_program, graphdef, drafter.config,
                                          batch=8, kv_len=KV_LEN, topk=2, depth=3,
                                          attention_impl=impl))  # fmt: skip
        cands = draft(params, dparams, state)
        tree = _jit(speculative.tree_program, batch=8, verify_tokens=5, depth=3)(
            cands, state.last_token, state.lengths)  # fmt: skip
        verify = jax.jit(functools.partial(speculative.verify_program, graphdef, drafter.config,
                                           batch=8, kv_len=KV_LEN, greedy_only=True,
                                           attention_impl=impl))  # fmt: skip
        layers = unstack_layers(model.layers.stacked())
        results.append((cands, *verify(params, layers, dparams, state, tree)[:4]))
    (cx, sx, tx, lx, nx), (cp, sp, tp, lp, np_) = results
    np.testing.assert_array_equal(cx.tokens_BxC, cp.tokens_BxC)
    np.testing.assert_array_equal(nx, np_)
    np.testing.assert_array_equal(tx, tp)
    np.testing.assert_allclose(lx, lp, atol=1e-5)
    np.testing.assert_allclose(sx.cache.k, sp.cache.k, atol=1e-5)
    np.testing.assert_allclose(sx.cache.v, sp.cache.v, atol=1e-5)
    np.testing.assert_allclose(sx.draft.feature, sp.draft.feature, atol=1e-5)


# ----------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def engines(aligned):
    """One SD engine (SD at <= 1 running request) whose plain mode is the reference; lazy
    drafter sync, so the switch into SD runs the catch-up. Synchronous steps, so the switch
    comes exactly at the step a request finishes (with `overlap_host` the next plain step is
    already in flight then: tests/test_engine.py and test_tlt_rollout.py cover that)."""
    model, drafter = aligned
    config = EngineConfig(max_batch_size=2, max_prefill_batch=2, max_seq_len=KV_LEN,
                          min_kv_bucket=KV_LEN, spec_strategy=SpecStrategy(3, 2, 6),
                          spec_max_batch=1, drafter_sync="lazy",
                          overlap_host=False)  # fmt: skip
    sd = RolloutEngine(model, config, drafter=drafter)
    plain = RolloutEngine(model, config, drafter=drafter)
    plain.step_policy = PlainPolicy()  # the declared seam: plain decoding only
    return sd, plain


def _requests(prompts, second: dict):
    return [Request(prompts[0], 6), Request(prompts[1], **{"max_new_tokens": 40, **second})]


def test_engine_switches_to_sd_and_matches_plain(engines, aligned):
    sd, plain = engines
    prompts = random_prompts(2, aligned[0].config.vocab_size, seed=21)
    # The engines' stats count over the module's tests: this one's, as differences.
    before = {e: dataclasses.replace(e.stats) for e in (sd, plain)}
    want = plain.generate(_requests(prompts, {}))
    got = sd.generate(_requests(prompts, {}))
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)
        assert g.finish_reason == w.finish_reason == "length"

    # Request 0 ran with two requests (plain); request 1 switched to SD when it was alone,
    # after 1 prefill token + 5 plain tokens: the drafter caught up on those 5 positions.
    def grew(engine, field):
        return getattr(engine.stats, field) - getattr(before[engine], field)

    assert got[0].accepted_lengths == []
    assert grew(sd, "spec_switch_count") == 1 and grew(sd, "spec_switch_tokens") == 5
    assert grew(sd, "spec_switch_seconds") > 0
    assert sum(got[1].accepted_lengths) == 40 - 6 + _trimmed(got[1])
    assert np.mean(got[1].accepted_lengths) > 1.5
    assert grew(plain, "spec_steps") == 0
    assert grew(sd, "spec_steps") == len(got[1].accepted_lengths)


def test_engine_eager_drafter_sync_switches_for_free(engines, aligned):
    model, drafter = aligned
    sd, _ = engines
    prompts = random_prompts(2, model.config.vocab_size, seed=21)
    lazy = sd.generate(_requests(prompts, {}))
    eager = RolloutEngine(model, dataclasses.replace(sd.config, drafter_sync="eager"),
                          drafter=drafter)  # fmt: skip
    got = eager.generate(_requests(prompts, {}))
    # Same tokens and the same drafts: the eagerly built drafter state is the caught-up one.
    assert [g.token_ids for g in got] == [w.token_ids for w in lazy]
    assert [g.accepted_lengths for g in got] == [w.accepted_lengths for w in lazy]
    assert eager.stats.spec_switch_count == 0 and eager.stats.spec_steps > 0
    with pytest.raises(ValueError, match="drafter_sync='soon'"):
        EngineConfig(drafter_sync="soon")


class _Rewards:
    """Wraps a step policy; keeps every reward the engine reports: (arm, running, tokens,
    seconds)."""

    def __init__(self, inner):
        self.inner, self.records = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def record(self, choice, num_running, emitted_tokens, seconds):
        self.records.append((arm_name(choice), num_running, emitted_tokens, seconds))
        self.inner.record(choice, num_running, emitted_tokens, seconds)


class _FakeClock:
    """The engine's `time`: every program run advances it by its kind's cost (default 1)."""

    def __init__(self, costs: dict[str, float]):
        self.now, self.costs = 0.0, costs

    def perf_counter(self) -> float:
        return self.now

    def install(self, engine, monkeypatch) -> None:
        program = engine._program

        def timed(key, fn, *args, **kwargs):
            if not engine.holds(key):
                self.now += self.costs.get("compile", 0.0)
            compiled = program(key, fn, *args, **kwargs)

            def run(*a):
                out = compiled(*a)
                self.now += self.costs.get(key[0], 1.0)
                return out

            return run

        monkeypatch.setattr(engine_lib, "time", self)
        monkeypatch.setattr(spec_engine_lib, "time", self)
        monkeypatch.setattr(engine, "_program", timed)
        monkeypatch.setattr(engine.spec, "_program", timed)


def test_sd_rewards_leave_out_the_drafter_catch_up(engines, aligned, monkeypatch):
    """The lazy drafter's catch-up is the deferred upkeep of the plain steps before it (eager
    sync pays it inside them); it grows with how long they ran, so in the SD step's reward it
    would rate the arm by the policy's history: the SD step that catches up reports the
    seconds of its own programs, like every other."""
    sd, _ = engines
    engine = RolloutEngine(aligned[0], sd.config, drafter=aligned[1], pool=sd.pool)
    engine.step_policy = _Rewards(engine.step_policy)
    requests = _requests(random_prompts(2, aligned[0].config.vocab_size, seed=21), {})
    engine.generate(requests)  # compiles what the pool lacks (a compiling step is no reward)
    _FakeClock({"drafter_catchup": 100.0}).install(engine, monkeypatch)
    engine.step_policy.records.clear()
    before = dataclasses.replace(engine.stats)
    engine.generate(requests)
    assert engine.stats.compile_count == before.compile_count
    assert engine.stats.spec_switch_count == before.spec_switch_count + 1
    assert engine.stats.spec_switch_seconds - before.spec_switch_seconds == 100.0
    sd_seconds = [s for arm, _, _, s in engine.step_policy.records if arm != "plain"]
    assert len(sd_seconds) == engine.stats.spec_steps - before.spec_steps  # all rewarded
    assert len(set(sd_seconds)) == 1, sd_seconds


def test_rewards_count_the_tokens_a_step_emitted(engines, aligned):
    """An SD step whose accepted run holds a request's stop token emits the run up to it; its
    reward counts those tokens, not the dropped rest (plain steps count only what they emit
    too, so the dropped tokens would favour SD at every request's end)."""
    sd, _ = engines
    engine = RolloutEngine(aligned[0], sd.config, drafter=aligned[1], pool=sd.pool)
    engine.step_policy = _Rewards(engine.step_policy)
    prompts = random_prompts(2, aligned[0].config.vocab_size, seed=21)
    full = engine.generate(_requests(prompts, {}))[1]
    tokens = full.token_ids
    starts = 6 + np.cumsum([0] + full.accepted_lengths[:-1])  # first token of each SD step
    j = next(int(s) for s, n in zip(starts, full.accepted_lengths, strict=True)
             if n >= 2 and tokens[s] not in tokens[:s])  # fmt: skip
    requests = _requests(prompts, {"stop_ids": (tokens[j],)})
    engine.generate(requests)  # compiles what the pool lacks (a compiling step is no reward)
    engine.step_policy.records.clear()
    compiled = engine.stats.compile_count
    got = engine.generate(requests)
    assert engine.stats.compile_count == compiled and _trimmed(got[1]) >= 1
    rewarded = sum(tokens for _, _, tokens, _ in engine.step_policy.records)
    assert rewarded == sum(len(c.token_ids) - 1 for c in got)  # all but the prefill's tokens


def test_an_overlapped_plain_step_is_no_reward_when_the_next_step_compiled(aligned, monkeypatch):
    """With `overlap_host`, a plain step is read after the next one is dispatched: programs
    compiled for that one (a decode or cache resize at a new batch bucket, a slot move) fall
    inside the read step's time, so it is no reward either."""
    model, drafter = aligned
    config = EngineConfig(max_batch_size=2, max_prefill_batch=2, max_seq_len=KV_LEN,
                          min_kv_bucket=KV_LEN, overlap_host=True)  # fmt: skip
    engine = RolloutEngine(model, config, drafter=drafter, step_policy=_Rewards(PlainPolicy()))
    _FakeClock({"compile": 1000.0}).install(engine, monkeypatch)
    engine.generate(_requests(random_prompts(2, model.config.vocab_size, seed=21), {}))
    seconds = [s for _, _, _, s in engine.step_policy.records]
    assert engine.stats.compile_count > 0 and len(seconds) > 30
    assert max(seconds) < 1000, sorted(seconds)[-3:]


def test_engine_hot_vocab_matches_plain(engines, aligned):
    sd, plain = engines
    vocab = aligned[0].config.vocab_size
    prompts = random_prompts(2, vocab, seed=21)
    want = plain.generate(_requests(prompts, {}))
    counts = count_tokens([c.token_ids for c in want], vocab)
    for bad, match in (([3, 3, 4], "duplicate"), ([0, vocab], "outside"), ([5], "topk=2"),
                       ([[1, 2]], "1-D")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            sd.set_hot_token_ids(bad)
    sd.set_hot_token_ids(hot_token_ids(counts, 32))
    try:
        got = sd.generate(_requests(prompts, {}))
    finally:
        sd.set_hot_token_ids(None)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert np.mean(got[1].accepted_lengths) > 1.5
    assert sd.holds(("spec_draft", 1, 2, 3, KV_LEN, 32))


def test_engine_slices_the_hot_head_once_per_weight_sync(engines, aligned):
    """The draft head's hot columns are sliced once per weight version and set of ids (not in
    every draft step) and always from the live head: a weight sync or new ids re-slice them."""
    sd, _ = engines
    vocab = aligned[0].config.vocab_size
    prompts = random_prompts(2, vocab, seed=23)
    original = sd.params
    head_of = lambda engine: np.asarray(nnx.merge(engine.graphdef, engine.params)  # noqa: E731
                                        .head_weight_DxV())  # fmt: skip
    ids = np.arange(3, 3 + 32)
    sd.set_hot_token_ids(ids)
    try:
        steps = sd.stats.spec_steps
        sd.generate(_requests(prompts, {}))
        assert sd.stats.spec_steps > steps and sd.holds(("hot_head", 32))
        sliced = sd._hot_vocab()[1]
        np.testing.assert_array_equal(sliced, head_of(sd)[:, ids])
        sd.generate(_requests(prompts, {}))
        assert sd._hot_vocab()[1] is sliced  # the same weights: not sliced again
        scaled = jax.tree.map(lambda x: x * 1.5 if x.ndim == 2 else x, original)
        sd.update_params(scaled)
        sd.generate(_requests(prompts, {}))
        np.testing.assert_array_equal(sd._hot_vocab()[1], head_of(sd)[:, ids])
        assert not np.array_equal(sd._hot_vocab()[1], sliced)
        sd.set_hot_token_ids(ids[::-1])
        np.testing.assert_array_equal(sd._hot_vocab()[1], head_of(sd)[:, ids[::-1]])
    finally:
        sd.update_params(original)
        sd.set_hot_token_ids(None)
    assert sd._hot_vocab() is None


def test_hot_token_ids_rank_by_count():
    counts = count_tokens([[4, 4, 2], [2, 7, 4]], vocab_size=8)
    np.testing.assert_array_equal(counts, [0, 0, 2, 0, 3, 0, 0, 1])
    # 4 (3x), 2 (2x), 7 (1x), then unseen ids in id order.
    np.testing.assert_array_equal(hot_token_ids(counts, 5), [4, 2, 7, 0, 1])
    # Ties go to the preferred ids first, in their order, then by id.
    np.testing.assert_array_equal(hot_token_ids(counts, 6, prefer=[6, 2, 5, 6]), [4, 2, 7, 6, 5, 0])
    with pytest.raises(ValueError, match="size=9"):
        hot_token_ids(counts, 9)
    with pytest.raises(ValueError, match="outside"):
        count_tokens([[8]], vocab_size=8)


def _trimmed(completion) -> int:
    return sum(completion.accepted_lengths) + 6 - len(completion.token_ids)


def test_engine_stop_token_and_max_new_tokens_inside_accepted_run(engines, aligned):
    sd, _ = engines
    prompts = random_prompts(2, aligned[0].config.vocab_size, seed=21)
    full = sd.generate(_requests(prompts, {}))[1]
    tokens = full.token_ids
    starts = 6 + np.cumsum([0] + full.accepted_lengths[:-1])  # first token of each SD step
    runs = [int(s) for s, n in zip(starts, full.accepted_lengths, strict=True)
            if n >= 2 and tokens[s] not in tokens[:s]]  # fmt: skip
    assert runs, "no multi-token SD step with a fresh first token"
    j = runs[0]
    compiled = sd.stats.compile_count
    # A stop token that is the first of a multi-token step: the rest of the run is dropped.
    stopped = sd.generate(_requests(prompts, {"stop_ids": (tokens[j],)}))[1]
    assert stopped.token_ids == tokens[: j + 1] and stopped.finish_reason == "stop"
    assert stopped.accepted_lengths[-1] >= 2 and _trimmed(stopped) >= 1
    # max_new_tokens ending inside a multi-token step: met exactly.
    cut = sd.generate(_requests(prompts, {"max_new_tokens": j + 1}))[1]
    assert cut.token_ids == tokens[: j + 1] and cut.finish_reason == "length"
    assert len(cut.logprobs) == j + 1 and _trimmed(cut) >= 1
    assert sd.stats.compile_count == compiled  # steady state: the pool has every program


class _Counting:
    """Wraps a step policy; keeps every `choose` that planned an SD step."""

    def __init__(self, inner):
        self.inner, self.sd_choices = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def choose(self, num_running):
        choice = self.inner.choose(num_running)
        if choice is not None:
            self.sd_choices.append(num_running)
        return choice


def test_overlapped_engine_runs_every_sd_step_it_chose(engines, aligned):
    """With `overlap_host`, a plain step is in flight when the batch reaches the SD threshold;
    it is read before the policy chooses, so each SD choice is for the batch that runs it (a
    choice made before the read was lost when that read retired the last request, and counted
    by the bandit as a step that never ran). Request 0 ends by length at token j while request
    1's token j, its stop token, is in flight."""
    sd, plain = engines
    prompts = random_prompts(2, aligned[0].config.vocab_size, seed=21)
    tokens = plain.generate(_requests(prompts, {}))[1].token_ids
    stops = [j for j in range(3, 12) if tokens[j] not in tokens[:j]]
    assert stops, "request 1 repeats its earlier tokens"
    over = RolloutEngine(aligned[0], dataclasses.replace(sd.config, overlap_host=True),
                         drafter=aligned[1])  # fmt: skip
    over.step_policy = _Counting(over.step_policy)
    for j in stops:
        before = over.stats.spec_steps
        over.step_policy.sd_choices.clear()
        got = over.generate([Request(prompts[0], j),
                             Request(prompts[1], 40, stop_ids=(tokens[j],))])  # fmt: skip
        assert got[1].token_ids == tokens[: j + 1] and got[1].finish_reason == "stop"
        assert over.step_policy.sd_choices == [1] * (over.stats.spec_steps - before)


def test_overlapped_sampled_sd_equals_the_synchronous_engine_when_a_request_ends_by_length(
        engines, aligned):  # fmt: skip
    """With `overlap_host`, request 0's last token (by length) is in flight when the batch would
    fall to the SD threshold: the step after it must be the SD step the synchronous engine runs
    (a plain step dispatched ahead decides request 1's next position with another draw)."""
    sd, _ = engines
    prompts = random_prompts(2, aligned[0].config.vocab_size, seed=21)
    sampling = SamplingParams(temperature=1.0)
    requests = [Request(prompts[0], 5, sampling, seed=0), Request(prompts[1], 20, sampling, seed=1)]
    outs, steps = [], []
    for overlap in (False, True):
        engine = RolloutEngine(aligned[0], dataclasses.replace(sd.config, overlap_host=overlap),
                               drafter=aligned[1])  # fmt: skip
        outs.append(engine.generate(requests))
        steps.append((engine.stats.decode_steps, engine.stats.spec_steps))
    sync, over = outs
    for a, b in zip(sync, over, strict=True):
        assert (a.token_ids, a.accepted_lengths) == (b.token_ids, b.accepted_lengths)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert steps[0] == steps[1] and steps[0][1] > 0, steps


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_program_and_layered_steps_agree(aligned, temperature):
    """Each step as one program (`layers_per_program=0`, the accelerator default), as one
    program per layer plus inputs and outputs programs (never promoted), and layered first
    then promoted to one program after 2 steps of a bucket (the CPU default's tiers, sooner):
    the same tokens, logprobs and accepted lengths, through plain steps, the drafter's
    catch-up, SD verify and commit, a queued request and slot moves."""
    model, drafter = aligned
    prompts = random_prompts(3, model.config.vocab_size, seed=5)
    requests = [Request(p, n, SamplingParams(temperature=temperature), seed=i)
                for i, (p, n) in enumerate(zip(prompts, (6, 30, 12), strict=True))]  # fmt: skip
    outs, engines = [], []
    for block, after in ((0, 0), (1, 0), (1, 2)):
        config = EngineConfig(max_batch_size=2, max_prefill_batch=2, max_seq_len=KV_LEN,
                              min_kv_bucket=KV_LEN, spec_strategy=SpecStrategy(3, 2, 6),
                              spec_max_batch=1, drafter_sync="lazy", layers_per_program=block,
                              one_program_after=after)  # fmt: skip
        engines.append(RolloutEngine(model, config, drafter=drafter))
        outs.append(engines[-1].generate(requests))
    for one, layered, tiered in zip(*outs, strict=True):
        for other in (layered, tiered):
            assert other.token_ids == one.token_ids
            assert other.accepted_lengths == one.accepted_lengths
            np.testing.assert_allclose(other.logprobs, one.logprobs, atol=1e-5)
    kinds = [{key[0] for key in e.pool.keys()} for e in engines]
    one_program = {"decode", "spec_verify", "spec_commit", "drafter_catchup"}
    layered = {"layers", "decode_outputs", "verify_outputs", "commit_block", "catchup_outputs"}
    assert one_program <= kinds[0] and not kinds[0] & layered
    assert layered <= kinds[1] and not kinds[1] & one_program
    # Tiered: every step kind ran layered first, then decode and verify as one program.
    assert layered | {"decode", "spec_verify", "spec_commit"} <= kinds[2]
    for e in engines:
        assert e.stats.spec_steps > 0 and e.stats.spec_switch_count > 0
    assert engines[0].decode_sizes() == engines[1].decode_sizes() == engines[2].decode_sizes()


def test_layers_per_program_is_checked():
    with pytest.raises(ValueError, match=r"layers_per_program=-1"):
        EngineConfig(layers_per_program=-1)
    with pytest.raises(ValueError, match=r"layers_per_program='2'"):
        EngineConfig(layers_per_program="2")
    with pytest.raises(ValueError, match=r"one_program_after=-1"):
        EngineConfig(one_program_after=-1)


# ----------------------------------------------------------------------------- sampling

SAMPLE_ROWS = 4096
SAMPLE_STRATEGY = SpecStrategy(3, 3, 8)
SETTINGS = {"t1": SamplingParams(temperature=1.0), "t07p09": SamplingParams(0.7, top_p=0.9)}
NEGATIVE_CASES = {("aligned", "t07p09"), ("untrained", "t1")}


@pytest.fixture(scope="module")
def small_vocab():
    """A 12-token target with an aligned and an untrained drafter."""
    model, drafter = aligned_pair(vocab=12, logit_scale=8.0, **ALIGNED)
    return model, {"aligned": drafter, "untrained": init_drafter(model.config, 9)}


def exact_sequence_probs(model, context, sampling, length=3):
    """P(next `length` tokens) by enumeration with full forwards: [V] * length array."""
    vocab = model.config.vocab_size
    grid = np.stack(np.meshgrid(*[np.arange(vocab)] * length, indexing="ij"), -1)
    grid = grid.reshape(-1, length)
    tokens = np.concatenate([np.broadcast_to(context, (len(grid), len(context))), grid], axis=1)
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    features, _ = model(jnp.asarray(tokens, jnp.int32), jnp.asarray(positions))
    logits = model.logits(features)[:, len(context) - 1 : -1]  # [R, length, V]
    flat = logits.reshape(-1, vocab)
    n = flat.shape[0]
    q = jax.nn.softmax(filtered_logits(
        flat, jnp.full((n,), sampling.temperature), jnp.full((n,), sampling.top_k, jnp.int32),
        jnp.full((n,), sampling.top_p)), axis=-1).reshape(len(grid), length, vocab)  # fmt: skip
    probs = np.take_along_axis(np.asarray(q), grid[:, :, None], axis=-1)[..., 0].prod(-1)
    return probs.reshape((vocab,) * length)


def chi_square_pvalue(counts, probs, min_expected=5.0):
    """Pearson chi-square of counts against probs; cells expected below 5 are pooled. A
    sample where the target's probability is exactly 0 (outside top-k / top-p) fails outright
    (p = 0): pooled with the other small cells it would add to a chi-square term, and a leak
    of a few percent of the mass onto them passed."""
    counts, expected = counts.ravel(), probs.ravel() * counts.sum()
    if counts[probs.ravel() == 0].sum():
        return 0.0, 0
    small = expected < min_expected
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    statistic = np.sum((observed[keep] - expected[keep]) ** 2 / expected[keep])
    return stats.chi2.sf(statistic, keep.sum() - 1), observed[keep].sum() - observed[keep][-1]


def sd_samples(model, drafter, sampling, residual):
    prompt = (3, 7, 1, 10)
    out, first, counts, _ = run_sd(
        model, drafter, [prompt] * SAMPLE_ROWS, SAMPLE_STRATEGY, 3, sampling=sampling,
        seeds=np.arange(SAMPLE_ROWS, dtype=np.uint32) + 1000, residual=residual, kv_len=32,
        prompt_len=4,
    )  # fmt: skip
    samples = np.array([o[:3] for o in out])
    return prompt + (int(first[0]),), samples, counts


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("drafter_name", ["aligned", "untrained"])
def test_sampling_distribution_equals_target(small_vocab, drafter_name, setting):
    """Next-token and 3-token frequencies of SD match the target's exact probabilities
    (chi-square p > 1e-4 over 4096 rows; fixed seeds), while the residual that forgets to
    remove the tried children fails the same check (p < 1e-6)."""
    model, drafters = small_vocab
    sampling = SETTINGS[setting]
    vocab = model.config.vocab_size
    context, samples, counts = sd_samples(model, drafters[drafter_name], sampling, "exact")
    probs = exact_sequence_probs(model, np.array(context), sampling)
    first_counts = np.bincount(samples[:, 0], minlength=vocab)
    seq_counts = np.bincount(np.ravel_multi_index(samples.T, (vocab,) * 3),
                             minlength=vocab**3)  # fmt: skip
    p_first, _ = chi_square_pvalue(first_counts, probs.sum((1, 2)))
    p_seq, _ = chi_square_pvalue(seq_counts, probs)
    tv = 0.5 * np.abs(first_counts / SAMPLE_ROWS - probs.sum((1, 2))).sum()
    assert p_first > 1e-4 and p_seq > 1e-4, (p_first, p_seq, tv)
    assert tv < 0.03
    assert counts[0].mean() > 1.3, counts[0].mean()  # multi-token acceptance happens
    if (drafter_name, setting) not in NEGATIVE_CASES:
        return
    _, buggy, _ = sd_samples(model, drafters[drafter_name], sampling, "buggy_no_removal")
    buggy_first = np.bincount(buggy[:, 0], minlength=vocab)
    p_buggy, _ = chi_square_pvalue(buggy_first, probs.sum((1, 2)))
    assert p_buggy < 1e-6, p_buggy
