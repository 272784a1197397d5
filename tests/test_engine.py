"""Rollout engine: plain decoding parity, continuous batching, retracing, sampling, bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.models import presets
from tlt_jax.models.transformer import init_model
from tlt_jax.rl.weight_sync import check_compatible
from tlt_jax.rollout import engine as engine_lib
from tlt_jax.rollout.engine import EngineConfig, Request, RolloutEngine
from tlt_jax.rollout.sampling import SamplingParams, filtered_logits


@pytest.fixture(scope="module")
def model():
    return init_model(presets.get_preset("tiny"), seed=1)


@pytest.fixture(scope="module")
def engine(model):
    return RolloutEngine(model, EngineConfig(max_batch_size=4, max_seq_len=256,
                                             max_prefill_batch=2, min_kv_bucket=32))  # fmt: skip


_PAD = 128


@jax.jit
def _last_logits(model, tokens_1xP, last):
    # Right padding never changes earlier positions under the causal mask, so one padded
    # shape serves every reference call.
    features, _ = model(tokens_1xP, jnp.arange(_PAD)[None])
    return model.logits(features)[0, last]


def full_forward_logits(model, seq):
    """Logits after `seq`, from one full forward without any cache (the reference)."""
    tokens = np.zeros((1, _PAD), np.int32)
    tokens[0, : len(seq)] = seq
    return np.asarray(_last_logits(model, jnp.asarray(tokens), len(seq) - 1))


def reference_greedy(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(full_forward_logits(model, seq).argmax()))
    return seq[len(prompt) :]


def _on_mesh(model, shape):
    """`model` with its parameters sharded over a mesh of `shape` by the rollout's rules;
    (the sharded model, the mesh, the rules)."""
    from flax import nnx

    from tlt_jax.parallel import sharding

    mesh = sharding.make_mesh(shape)
    graphdef, state = nnx.split(model)
    rules = sharding.rules_for("rollout")
    sharded = nnx.merge(
        graphdef, jax.device_put(state, sharding.state_shardings(state, mesh, rules))
    )
    return sharded, mesh, rules


def random_requests(rng, n, vocab=256, **kwargs):
    return [
        Request(rng.integers(0, vocab, rng.integers(2, 40)).tolist(), int(rng.integers(1, 30)),
                **kwargs)
        for _ in range(n)
    ]  # fmt: skip


def test_greedy_equals_full_forward_with_continuous_batching(model, engine):
    # 9 requests through 4 slots: requests finish at different times, slots move, queued
    # requests join mid-flight; every output must still be the unbatched greedy sequence.
    requests = random_requests(np.random.default_rng(0), 9)
    completions = engine.generate(requests)
    for req, comp in zip(requests, completions, strict=True):
        assert comp.index == requests.index(req)
        assert comp.token_ids == reference_greedy(model, req.prompt_ids, req.max_new_tokens)
        assert comp.finish_reason == "length"
        assert len(comp.logprobs) == len(comp.token_ids)


def test_logprobs_are_policy_logprobs(model, engine):
    req = Request([3, 14, 15, 92, 6], 6, SamplingParams(temperature=0.7), seed=5)
    (comp,) = engine.generate([req])
    seq = list(req.prompt_ids)
    for token, logprob in zip(comp.token_ids, comp.logprobs, strict=True):
        logits = full_forward_logits(model, seq) / 0.7
        expected = logits[token] - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        np.testing.assert_allclose(logprob, expected, atol=1e-4)
        seq.append(token)


def test_no_retrace_in_steady_state(engine):
    rng = np.random.default_rng(1)
    engine.generate(random_requests(rng, 6))
    traces = dict(engine_lib.TRACE_COUNTS)
    compiles = engine.stats.compile_count
    # New requests of the same size classes reuse the pool: no trace, no compile.
    engine.generate(random_requests(np.random.default_rng(1), 6))
    assert engine_lib.TRACE_COUNTS == traces
    assert engine.stats.compile_count == compiles
    assert engine.stats.compile_seconds > 0


def test_timeline_rows_carry_the_compile_seconds_inside_each_step(model):
    """Every second the engine compiled during a generate is in exactly one timeline row (the
    step it held up, prefill's in the step after it), so the tail figures can leave it out."""
    eng = RolloutEngine(model, EngineConfig(max_batch_size=4, max_seq_len=128, min_kv_bucket=16))
    before = eng.stats.compile_seconds
    eng.generate(random_requests(np.random.default_rng(3), 3))
    rows = eng.stats.timeline
    assert all(len(row) == 4 and row[3] >= 0 for row in rows)
    assert sum(row[3] for row in rows) == pytest.approx(eng.stats.compile_seconds - before)
    assert rows[0][3] > 0  # the first step compiled (and prefill before it)
    # A second generate compiles nothing: its rows carry no compile seconds.
    eng.generate(random_requests(np.random.default_rng(3), 3))
    assert sum(row[3] for row in eng.stats.timeline) == 0.0


def test_requests_finishing_at_the_end_leave_without_a_slot_move(model, monkeypatch):
    """Slots 0 and 2 of 3 finish at the same step: slot 2 leaves, slot 1 moves into 0: one
    move (slot 2 was copied into 0 first, then replaced: each move copies a row of every
    layer's cache). The tokens are a one-request engine's."""
    reqs = [Request([1, 2, 3], 4, seed=0), Request([4, 5], 9, seed=1), Request([6], 4, seed=2)]
    eng = RolloutEngine(model, EngineConfig(max_batch_size=4, max_seq_len=64, min_kv_bucket=16))
    moves = []
    move = eng._move
    monkeypatch.setattr(eng, "_move", lambda src, dst: (moves.append((src, dst)), move(src, dst)))
    got = [c.token_ids for c in eng.generate(reqs)]
    assert moves == [(1, 0)]
    alone = RolloutEngine(model, EngineConfig(max_batch_size=1, max_seq_len=64, min_kv_bucket=16))
    assert got == [c.token_ids for c in alone.generate(reqs)]


def test_decode_cost_follows_context(model):
    eng = RolloutEngine(model, EngineConfig(max_batch_size=4, max_seq_len=1024, min_kv_bucket=32))
    eng.generate([Request([1, 2, 3], 10), Request([4, 5], 3)])
    # Short contexts only ever use the smallest kv bucket, never the 1024 maximum.
    assert {s for _, s in eng.decode_sizes()} == {32}
    assert {b for b, _ in eng.decode_sizes()} <= {1, 2}


def test_sampling_is_per_request_deterministic(model):
    # The same request gives the same sample whatever else shares its batch.
    sampling = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
    reqs = random_requests(np.random.default_rng(2), 5, sampling=sampling)
    reqs = [Request(r.prompt_ids, r.max_new_tokens, r.sampling, seed=i) for i, r in enumerate(reqs)]
    small = RolloutEngine(model, EngineConfig(max_batch_size=1, max_seq_len=128, min_kv_bucket=32))
    big = RolloutEngine(model, EngineConfig(max_batch_size=4, max_seq_len=128, min_kv_bucket=32))
    a = [c.token_ids for c in small.generate(reqs)]
    b = [c.token_ids for c in big.generate(reqs)]
    assert a == b
    other_seed = [Request(r.prompt_ids, r.max_new_tokens, r.sampling, seed=100) for r in reqs]
    assert [c.token_ids for c in big.generate(other_seed)] != b


def test_top_k_one_is_greedy(model, engine):
    reqs = random_requests(np.random.default_rng(3), 3)
    sampled = [Request(r.prompt_ids, r.max_new_tokens, SamplingParams(1.3, 1.0, 1)) for r in reqs]
    assert [c.token_ids for c in engine.generate(sampled)] == [
        c.token_ids for c in engine.generate(reqs)
    ]


def test_filtered_logits_top_k_top_p():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    one = jnp.ones((1,))
    keep = lambda k, p: np.isfinite(np.asarray(filtered_logits(logits, one, k, p)))[0]  # noqa: E731
    assert keep(jnp.array([2]), one).tolist() == [True, True, False, False]
    # top-p 0.7: 0.5 < 0.7, 0.5 + 0.3 >= 0.7 -> two tokens.
    assert keep(jnp.array([0]), jnp.array([0.7])).tolist() == [True, True, False, False]
    assert keep(jnp.array([0]), jnp.array([0.81])).tolist() == [True, True, True, False]
    assert keep(jnp.array([0]), jnp.array([1.0])).all()


def test_stop_token_ends_request(model, engine):
    prompt = [7, 8, 9, 10]
    free = reference_greedy(model, prompt, 12)
    stop = free[4]
    first = free.index(stop)
    (comp,) = engine.generate([Request(prompt, 12, stop_ids=(stop,))])
    assert comp.finish_reason == "stop"
    assert comp.token_ids == free[: first + 1]


def test_max_new_tokens_one(engine):
    (comp,) = engine.generate([Request([1, 2, 3], 1)])
    assert len(comp.token_ids) == 1 and comp.finish_reason == "length"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Request([], 4), "prompt_ids is empty"),
        (lambda: Request([1, 2], 0), "max_new_tokens=0"),
        (lambda: Request([1, 2], -3), "max_new_tokens=-3"),
        (lambda: SamplingParams(temperature=-0.5), "temperature=-0.5"),
        (lambda: SamplingParams(top_p=0.0), "top_p=0.0"),
        (lambda: SamplingParams(temperature=float("inf")), "temperature=inf must be finite"),
        # Sampled token 0 with +-inf log-probs (logits / t overflowed exp in float32).
        (lambda: SamplingParams(temperature=1e-12), "temperature=1e-12 is below 0.0001: use 0"),
        (lambda: SamplingParams(top_k=True), "top_k=True must be an integer"),
        (lambda: EngineConfig(max_batch_size=0), "max_batch_size=0"),
        (lambda: EngineConfig(max_batch_size=True), "max_batch_size=True"),
        (lambda: Request([1, 2], True), "max_new_tokens=True"),
        # Failed after the first compile, naming neither request nor field, or were silently
        # truncated / folded into 32 bits.
        (lambda: Request([1, 2], 3, seed=1.5), r"seed=1\.5 must be an integer in \[0, 2\*\*32\)"),
        (lambda: Request([1, 2], 3, seed=2**32 + 5), r"seed=4294967301 must be"),
        (lambda: Request([1, 2], 3, seed=-1), r"seed=-1 must be"),
        (lambda: Request([1, 2], 3, sampling=None), "sampling=None must be a SamplingParams"),
        (lambda: Request([1.7, True], 3), r"prompt_ids holds \[1\.7, True\]; token ids are"),
        (lambda: Request([1, 2], 3, stop_ids=5), "stop_ids=5 must be a sequence of token ids"),
    ],
)
def test_bad_request_values(make, message):
    with pytest.raises(ValueError, match=message):
        make()
    # numpy ints are ints (kept as int)
    assert SamplingParams(top_k=np.int64(5)).top_k == 5
    assert type(Request([1, 2], np.int64(3)).max_new_tokens) is int
    assert type(EngineConfig(max_batch_size=np.int32(4)).max_batch_size) is int
    config = EngineConfig(spec_max_batch=np.int64(4), layers_per_program=np.int64(2),
                          one_program_after=np.int32(8))  # fmt: skip
    assert (config.spec_max_batch, config.layers_per_program, config.one_program_after) == (4, 2, 8)
    assert all(type(v) is int for v in (config.spec_max_batch, config.layers_per_program))
    for field in ("spec_max_batch", "layers_per_program", "one_program_after"):
        with pytest.raises(ValueError, match=rf"engine\.{field}=True must be"):
            EngineConfig(**{field: True})
    # A top_k past the vocabulary keeps every token; past int32 (the engine's per-slot array,
    # where 2**31 failed after a compile) it is clamped, not refused.
    assert SamplingParams(top_k=2**40).top_k == 2**31 - 1


def test_prompt_longer_than_context_fails_before_compiling(model):
    eng = RolloutEngine(model, EngineConfig(max_batch_size=2, max_seq_len=64))
    with pytest.raises(ValueError, match=r"prompt length 60 \+ max_new_tokens 10 = 70 .*64"):
        eng.generate([Request([1, 2], 4), Request(list(range(60)), 10)])
    with pytest.raises(ValueError, match=r"outside \[0, 256\)"):
        eng.generate([Request([1, 999], 4)])
    # A stop id outside the vocabulary never matched: the request ran to its cap, silently.
    with pytest.raises(ValueError, match=r"requests\[0\]: stop ids \[999\] outside"):
        eng.generate([Request([1, 2], 4, stop_ids=(999,))])
    assert eng.stats.compile_count == 0


def test_weight_sync_checks(model, engine):
    params = engine.params
    engine.update_params(jax.tree.map(lambda x: x * 0.5, params))  # same layout: accepted
    bad_shape = jax.tree.map(lambda x: x, params)
    bad_shape["embed"].set_value(jnp.zeros((3, 3)))
    with pytest.raises(ValueError, match=r"\['embed'\].*shape \(3, 3\)"):
        engine.update_params(bad_shape)
    bad_dtype = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    with pytest.raises(ValueError, match="dtype bfloat16"):
        check_compatible(params, bad_dtype)
    with pytest.raises(ValueError, match="tree structure differs"):
        check_compatible(params, {"embed": params["embed"]})
    devices = jax.devices()
    if len(devices) > 1:
        moved = jax.tree.map(lambda x: jax.device_put(x, devices[1]), params)
        with pytest.raises(ValueError, match="sharding"):
            check_compatible(params, moved)
    engine.update_params(params)


def test_a_group_shares_its_prompt_prefill_and_keeps_its_own_samples(model):
    # 6 samples of one prompt and 2 of another, as GRPO groups: one prefill of 2 prompt rows
    # fills all 8 slots, and each sample equals the same request decoded on its own.
    eng = RolloutEngine(model, EngineConfig(max_batch_size=8, max_seq_len=128,
                                            max_prefill_batch=2, min_kv_bucket=32))  # fmt: skip
    sampling = SamplingParams(temperature=1.0)
    prompts = [(5, 9, 2, 7)] * 6 + [(11, 3)] * 2
    group = [Request(p, 12, sampling, seed=i) for i, p in enumerate(prompts)]
    got = eng.generate(group)
    assert eng.stats.prefill_steps == 1
    assert [k[:5] for k in eng.pool.keys() if k[0] == "prefill"] == [("prefill", 8, 2, 16, False)]
    alone = RolloutEngine(model, EngineConfig(max_batch_size=1, max_seq_len=128,
                                              min_kv_bucket=32))  # fmt: skip
    for request, completion in zip(group, got, strict=True):
        (want,) = alone.generate([request])
        assert completion.token_ids == want.token_ids
        np.testing.assert_allclose(completion.logprobs, want.logprobs, atol=1e-5)
    assert len({tuple(c.token_ids) for c in got[:6]}) > 1  # the group's samples differ


@pytest.mark.parametrize("layers_per_program", [0, 1], ids=["one_program", "layered"])
def test_sharded_engine_keeps_its_state_sharded_and_its_tokens(model, layers_per_program):
    """A policy on a mesh gets a decode state sharded like it (slots over data, cache heads over
    tensor), kept through prefill, plain and SD steps and across calls; tokens as unsharded,
    sampled. Layered: a layer block's activations come from the inputs program, then from
    the block before, in other shardings (each compiles its own program); its cache writes
    need no collective (every device writes its own slots).
    Token choice and tree acceptance reduce over each device's block of the head's
    vocabulary with a few values per row (`sampling.VocabAxis`): the partitioner gathered
    the [B, V] logits in every step (4,160 bytes per plain step of 4 rows here, before), and
    in every prefill."""

    from tlt_jax.models.drafter import init_drafter
    from tlt_jax.programs import collective_report, collectives
    from tlt_jax.rollout.adaptive import FixedPolicy, StepChoice

    sharded, mesh, rules = _on_mesh(model, (2, 2))
    drafter = init_drafter(model.config, 3)
    config = EngineConfig(max_batch_size=4, max_seq_len=128, max_prefill_batch=2,
                          min_kv_bucket=32, layers_per_program=layers_per_program,
                          one_program_after=0)  # fmt: skip
    policy = FixedPolicy(StepChoice("2,2,4", "eagle"), max_batch=2)
    engines = [RolloutEngine(m, config, drafter=drafter, step_policy=policy)
               for m in (model, sharded)]  # fmt: skip
    # Per layer, keys [B, K, H, S] and values [B, K, S, H]: slots over data, kv heads over
    # tensor (a cache of 4 slots; one slot is replicated over data).
    four = engine_lib.DecodeState.create(model.config, 4, 32, drafter.config)
    want = engine_lib.decode_state_shardings(four, mesh, rules)
    for spec in (want.cache.k[0].spec, want.cache.v[0].spec, want.draft.cache.k[0].spec):
        assert spec == jax.sharding.PartitionSpec("data", "tensor", None, None)
    requests = [dataclasses.replace(r, seed=i) for i, r in enumerate(random_requests(
        np.random.default_rng(4), 6, sampling=SamplingParams(temperature=0.8)))]  # fmt: skip
    for _ in range(2):  # the second call reuses every program on the state the first left
        outs = [e.generate(requests) for e in engines]
        assert [c.token_ids for c in outs[0]] == [c.token_ids for c in outs[1]]
        for one, split in zip(*outs, strict=True):
            np.testing.assert_allclose(split.logprobs, one.logprobs, atol=1e-5)
        state = engines[1].state
        want = engine_lib.decode_state_shardings(state, mesh, rules)
        for got, expected in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
            assert got.sharding.is_equivalent_to(expected, got.ndim)
    assert engines[1].stats.spec_steps > 0
    steps = [k for k in engines[1].pool.keys()
             if k[0] in ("decode", "spec_verify", "decode_outputs", "verify_outputs")]  # fmt: skip
    assert len({k[0] for k in steps}) == 2, steps  # plain and SD: the programs that choose
    for key in steps:
        report = collective_report(engines[1].pool.get(key, None, None))
        assert report.get("all_gather_bytes", 0) <= 32 * key[1], (key, report)
    # A prefill chooses its first tokens on the vocabulary blocks too: it gathers the prompt
    # rows its slots take, but no [B, V] logits (the sampler's top-k and cumulative sum did).
    prefills = [k for k in engines[1].pool.keys() if k[0] == "prefill"]
    assert prefills
    vocab = model.config.vocab_size
    for key in prefills:
        found = collectives(engines[1].pool.get(key, None, None))
        assert any(kind == "all_gather" for kind, _ in found), key  # the prompt rows
        assert not [a for _, arrays in found for a in arrays if a[1][-1:] == (vocab,)], found
    # Caches were resized on the mesh (slots shrinking as the batch drained) and kept sharded.
    assert any(k[0] == "resize" and k[3] < k[1] for k in engines[1].pool.keys())
    if layers_per_program:
        blocks = [k for k in engines[1].pool.keys() if k[0] == "layers" and k[5]]
        assert blocks
        for key in blocks:
            text = engines[1].pool.get(key, None, None).as_text()
            # (tensor parallelism all-reduces the heads' outputs: that one belongs)
            assert "all-gather" not in text and "all-to-all" not in text, key


def test_a_data_sharded_engine_keeps_each_slots_math_on_its_device(model):
    """Slots over 2 devices, sampled with top-p: the same tokens as one device. Token choice
    runs per device (`sharding.rowwise`): a plain decode step holds no collective at any
    batch bucket (the partitioner all-gathered the logits for top-p and all-reduced the
    filter's predicates; per-slot scalars of `max_batch_size` rows were resharded by every
    step below it).
    A slot move sends one row, not every layer's whole cache (it all-gathered the cache onto
    every device). (SD's acceptance per device: the (2, 2) test above.)"""

    from tlt_jax.programs import collective_report

    sharded, _, _ = _on_mesh(model, (2, 1))
    config = EngineConfig(max_batch_size=4, max_seq_len=64, max_prefill_batch=2,
                          min_kv_bucket=32)  # fmt: skip
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    # As many requests as slots: no request waits, so the slots shrink with the batch.
    rng = np.random.default_rng(4)
    requests = [Request(rng.integers(0, 256, rng.integers(2, 20)).tolist(), n, sampling, seed=i)
                for i, n in enumerate((3, 14, 7, 16))]  # fmt: skip
    engines = [RolloutEngine(m, config) for m in (model, sharded)]
    outs = [[c.token_ids for c in e.generate(requests)] for e in engines]
    assert outs[0] == outs[1]
    pool = engines[1].pool
    decodes = [k for k in pool.keys() if k[0] == "decode"]
    moves = [k for k in pool.keys() if k[0] == "move"]
    assert decodes and moves
    for key in decodes:  # at every batch bucket: per-slot scalars are sized like the cache
        assert collective_report(pool.get(key, None, None)) == {}, key
    assert {k[1] for k in decodes} == {1, 2, 4}
    for key in moves:
        slots = key[1]
        cache = engine_lib.DecodeState.create(model.config, slots, key[2])
        one_slot = sum(x.nbytes for x in jax.tree.leaves(cache) if x.ndim) // slots
        report = collective_report(pool.get(key, None, None))
        sent = sum(v for k, v in report.items() if k.endswith("_bytes"))
        # one row, in one all-reduce (the scalars too: a few bytes over)
        assert set(report) == {"all_reduce", "all_reduce_bytes"}, report
        assert 0 < sent <= one_slot + 64, (key, sent, one_slot)
    assert max(k[1] for k in moves) == 4  # a move of 4 slots sends 1 row, not 4


def test_a_mesh_engine_compiles_a_program_per_input_sharding(model):
    """On a mesh a compiled program accepts only the input shardings it was compiled for, and
    one program's output may come in another sharding than the last caller's (SmolLM2's layered
    verify on a (2, 1) mesh raised here): the engine keys its programs by input sharding too."""
    from jax.sharding import NamedSharding, PartitionSpec

    sharded, mesh, _ = _on_mesh(model, (2, 2))
    engine = RolloutEngine(sharded, EngineConfig(max_batch_size=4, max_seq_len=64))
    x = jnp.arange(32.0).reshape(4, 8)
    for spec in (PartitionSpec("data"), PartitionSpec(), PartitionSpec("data")):
        arg = jax.device_put(x, NamedSharding(mesh, spec))
        np.testing.assert_array_equal(engine._program(("probe",), lambda a: 2 * a, arg)(arg),
                                      2 * x)  # fmt: skip
    assert len([k for k in engine.pool.keys() if k[0] == "probe"]) == 2


def test_a_rollout_starts_from_caches_fitted_to_its_own_requests(model):
    """The caches a long rollout leaves (256 positions) are refitted when the next rollout
    starts: its requests (at most 78 positions) decode over the 128-position bucket, not the
    last tail's 256 (within a rollout, a context one bucket smaller keeps the cache)."""
    engine = RolloutEngine(model, EngineConfig(max_batch_size=4, max_seq_len=256,
                                               max_prefill_batch=2, min_kv_bucket=32))  # fmt: skip
    engine.generate([Request([5, 6, 7], 200)])
    assert engine.state.cache.length == 256
    before = engine.decode_sizes()
    prompts = [[1 + i] * 70 for i in range(4)]
    short = engine.generate([Request(p, 8) for p in prompts])
    assert [len(c.token_ids) for c in short] == [8] * 4
    decodes = engine.decode_sizes() - before
    assert decodes and all(s == 128 for _, s in decodes), decodes
    assert engine.state.cache.length == 128


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_overlapping_the_host_changes_no_token(model, temperature):
    """`overlap_host`: each plain step is dispatched before the previous one's tokens are read,
    so a stop is seen one step late; the extra token is dropped and every output (tokens,
    logprobs, finish reasons) equals the synchronous engine's, stop tokens, length caps, slot
    moves and a queue included. Steps overlap only once the queue is empty."""
    rng = np.random.default_rng(11)
    sampling = SamplingParams(temperature=temperature)
    requests = [Request(r.prompt_ids, r.max_new_tokens, sampling, stop_ids=(3, 7, 11),
                        seed=i) for i, r in enumerate(random_requests(rng, 10))]  # fmt: skip
    outs, engines = [], []
    for overlap in (False, True):
        eng = RolloutEngine(model, EngineConfig(max_batch_size=4, max_seq_len=256,
                                                max_prefill_batch=2, min_kv_bucket=32,
                                                overlap_host=overlap))  # fmt: skip
        outs.append(eng.generate(requests))
        engines.append(eng)
    sync, overlapped = outs
    assert any(c.finish_reason == "stop" for c in sync)
    assert any(c.finish_reason == "length" for c in sync)
    for a, b in zip(sync, overlapped, strict=True):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
    # Extra steps only where a request stopped on a token while others were in flight.
    extra = engines[1].stats.decode_steps - engines[0].stats.decode_steps
    assert 0 <= extra <= sum(c.finish_reason == "stop" for c in sync)
    assert engines[1].stats.generated_tokens == engines[0].stats.generated_tokens


def test_a_bucket_runs_layered_then_as_one_program(model):
    """The two program tiers: a bucket's first `one_program_after` decode steps run as
    per-layer programs, then the bucket is compiled as one program; `one_program_steps`
    skips the first tier (calibration times the steady state). Tokens are the same."""
    config = EngineConfig(max_batch_size=2, max_seq_len=128, min_kv_bucket=128,
                          layers_per_program=1, one_program_after=3)  # fmt: skip
    tiered = RolloutEngine(model, config)
    (out,) = tiered.generate([Request([5, 6, 7], 10)])
    kinds = {key[0] for key in tiered.pool.keys()}
    assert {"layers", "decode_inputs", "decode_outputs", "decode"} <= kinds
    layered = [k for k in tiered.pool.keys() if k[0] == "layers"]
    assert {k[1] for k in layered} == {1}  # one block program serves both layers
    assert tiered.decode_sizes() == {(1, 128)}
    steady = RolloutEngine(model, config)
    with steady.one_program_steps():
        (same,) = steady.generate([Request([5, 6, 7], 10)])
    assert not {key[0] for key in steady.pool.keys()} & {"layers", "decode_outputs"}
    assert same.token_ids == out.token_ids == reference_greedy(model, [5, 6, 7], 10)


def test_a_compiled_one_program_runs_at_once_on_a_mesh(model):
    """A bucket whose one program is compiled (here under `one_program_steps`, as calibration
    does) runs as it from its first step, also on a mesh, where the pool's keys end with the
    arguments' sharding signature (the check missed those, so such a bucket ran
    `one_program_after` layered steps, compiling their programs, before using its program)."""

    sharded, _, _ = _on_mesh(model, (2, 1))
    config = EngineConfig(max_batch_size=2, max_seq_len=128, min_kv_bucket=128,
                          layers_per_program=1, one_program_after=100)  # fmt: skip
    engine = RolloutEngine(sharded, config)
    request = Request([5, 6, 7], 10)
    with engine.one_program_steps():
        (steady,) = engine.generate([request])
    before = set(engine.pool.keys())
    assert [k for k in before if k[0] == "decode"] and not [k for k in before if k[0] == "layers"]
    (again,) = engine.generate([request])
    layered = {"layers", "decode_inputs", "decode_outputs"}
    assert not {k[0] for k in set(engine.pool.keys()) - before} & layered
    assert again.token_ids == steady.token_ids == reference_greedy(model, [5, 6, 7], 10)


def test_rollout_config_checks_layers_per_program():
    from tlt_jax.rl.config import RolloutConfig

    with pytest.raises(ValueError, match=r"rollout.layers_per_program=-2"):
        RolloutConfig(layers_per_program=-2)
    assert RolloutConfig(layers_per_program=0).layers_per_program == 0


def test_the_layered_tier_is_the_cpu_default_for_deep_policies():
    shallow = init_model(presets.get_preset("tiny"), seed=1)
    deep = init_model(presets.get_preset("tiny", num_layers=engine_lib.LAYERED_MIN_LAYERS), seed=1)
    config = EngineConfig(max_batch_size=2, max_seq_len=64)
    assert RolloutEngine(shallow, config).forward is None  # 2 layers: one program at once
    layered = RolloutEngine(deep, config).forward
    assert layered is not None and layered.block == 1
    assert RolloutEngine(deep, EngineConfig(max_batch_size=2, max_seq_len=64,
                                            layers_per_program=0)).forward is None  # fmt: skip


def test_an_admission_round_sizes_the_cache_once(model):
    """Four distinct prompts, two per prefill: the cache holds all four slots from the first
    prefill on, so both prefills share one program and nothing is resized in between."""
    engine = RolloutEngine(model, EngineConfig(max_batch_size=4, max_seq_len=256,
                                               max_prefill_batch=2, min_kv_bucket=32))  # fmt: skip
    requests = [Request([1 + i, 2, 3], 4) for i in range(4)]
    out = engine.generate(requests)
    prefills = [k for k in engine.pool.keys() if k[0] == "prefill"]
    assert len(prefills) == 1 and prefills[0][5] == 4, prefills  # (.., cache slots, kv)
    assert not any(k[0] == "resize" for k in engine.pool.keys())
    for req, comp in zip(requests, out, strict=True):
        assert comp.token_ids == reference_greedy(model, req.prompt_ids, 4)
