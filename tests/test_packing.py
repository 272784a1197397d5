"""Packed update micro-batches: hand-checked layouts, and the packed forward, loss and gradient
against per-sequence forwards, `algorithms.policy_loss` and the padded layout."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.models.presets import get_preset
from tlt_jax.models.transformer import init_model
from tlt_jax.rl import algorithms, packing
from tlt_jax.rl import step as step_lib
from tlt_jax.rl.algorithms import AlgorithmConfig
from tlt_jax.rl.config import RLConfig

PROMPTS = [(5, 6, 7, 8, 9), (10, 11)]
RESPONSES = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10, 11, 12]]  # group size 2
ADVANTAGES = np.asarray([0.5, -1.0, 2.0, -0.3], np.float32)


@pytest.fixture(scope="module")
def tiny():
    model = init_model(get_preset("tiny"), seed=3)
    graphdef, params = nnx.split(model)
    return model, graphdef, params


def _micro(row_len, max_rows=4, signal=(True, True), silent=False, prefix_width=0):
    return packing.packed_micro_batches(
        PROMPTS, RESPONSES, [[0, 1]], 2, np.asarray(signal), row_len=row_len,
        max_rows=max_rows, include_silent=silent, prefix_width=prefix_width,
    )[0]  # fmt: skip


def test_pack_rows_by_hand():
    lens_p, lens_r = [len(p) for p in PROMPTS], [len(r) for r in RESPONSES]
    # Group 1 has the longest response, so it goes first: prompt 2 + 6 + 2 = 10 tokens. Group
    # 0 (5 + 3 + 1) does not fit the 2 left in a 12-token row, so it opens a second row.
    assert packing.pack_rows(lens_p, lens_r, [0, 1], 2, 12) == [
        [(1, [3, 2], False)],
        [(0, [0, 1], False)],
    ]
    # A 19-token row holds both pieces.
    assert packing.pack_rows(lens_p, lens_r, [0, 1], 2, 19) == [
        [(1, [3, 2], False), (0, [0, 1], False)]
    ]
    # A response that does not fit beside its piece's prompt opens a piece in another row.
    assert packing.pack_rows(lens_p, lens_r, [1], 2, 8) == [[(1, [3], False)], [(1, [2], False)]]
    with pytest.raises(ValueError, match=r"prompt 1 \(2 tokens\) \+ response 3 \(6 tokens\) = 8"):
        packing.pack_rows(lens_p, lens_r, [1], 2, 7)
    # Empty responses take no room.
    assert packing.pack_rows([3], [0, 2], [0], 2, 8) == [[(0, [1], False)]]


def test_pack_rows_continues_a_prompt_only_within_a_micro_batch():
    lens_p, lens_r = [len(p) for p in PROMPTS], [len(r) for r in RESPONSES]
    # Both rows in one micro-batch: response 2 continues group 1's piece without its prompt.
    assert packing.pack_rows(lens_p, lens_r, [1], 2, 8, bins=[2]) == [
        [(1, [3], False)],
        [(1, [2], True)],
    ]
    # One row per micro-batch: the prompt must be repeated.
    assert packing.pack_rows(lens_p, lens_r, [1], 2, 8, bins=[1, 1]) == [
        [(1, [3], False)],
        [(1, [2], False)],
    ]
    # Group 0 (longest response 3) fills row 2 (5 + 3); response 1 cannot continue in row 1,
    # which already has a continuing piece (one a row), so it repeats its prompt there.
    assert packing.pack_rows(lens_p, lens_r, [0, 1], 2, 8, bins=[4]) == [
        [(1, [3], False)],
        [(1, [2], True), (0, [1], False)],
        [(0, [0], False)],
    ]


@pytest.mark.parametrize(
    ("rows", "max_rows", "expected"),
    [(0, 4, ()), (1, 12, (1,)), (5, 12, (5,)), (12, 12, (12,)),
     # 7 rows: 6 + 1 (cost 7 + 2 x 0.5 = 8) beats one micro-batch of 8 (8.5) and 4 + 4 (9);
     # 5 + 2 and 4 + 3 cost 8 too, and the largest first micro-batch wins the tie.
     (7, 13, (6, 1)),
     # 13 rows, at most 12 each: 12 + 1 (cost 14) beats 3 x 5 (16.5) and 2 x 8 (17).
     (13, 12, (12, 1)),
     # 16 rows: 12 + 4 and 8 + 8 both cost 17; the larger first micro-batch wins (12 is the
     # precompiled `max_rows` shape).
     (16, 12, (12, 4)),
     # 25 rows: 12 + 12 + 1 and 10 + 10 + 5 both cost 26.5; 5 x 5 costs 27.5.
     (25, 12, (12, 12, 1)),
     (7, 5, (5, 2))],
)  # fmt: skip
def test_split_rows(rows, max_rows, expected):
    assert packing.split_rows(rows, max_rows) == expected


def test_split_rows_balances_the_processes_the_micro_batches_are_dealt_to():
    """The trainer deals trained micro-batches round-robin over the processes and the
    all-reduce waits for the busiest: the split minimises that process's rows (+ 0.5 per
    micro-batch), not the sum."""
    # 15 rows at most 13: one process runs 13 + 2 (cost 16); two would wait 13.5 for the
    # first while the second had 2.5, so 8 + 8 (8.5 each).
    assert packing.split_rows(15, 13) == (13, 2)
    assert packing.split_rows(15, 13, processes=2) == (8, 8)
    # 13 rows at most 12, two processes: 6 + 1 and 6 (8.0 and 6.5) beat 8 + 8 (8.5 each).
    assert packing.split_rows(13, 12, processes=2) == (6, 6, 1)
    # 14 rows on four processes: one micro-batch each, the last of 2 rows (4 x 4 has the
    # same busiest load and computes 2 rows more).
    assert packing.split_rows(14, 13, processes=4) == (4, 4, 4, 2)
    with pytest.raises(ValueError, match="processes=0: expected at least 1"):
        packing.split_rows(3, 12, processes=0)
    for processes in (1, 2, 3):
        for rows in range(1, 60):
            sizes = packing.split_rows(rows, 12, processes=processes)
            assert sum(sizes) >= rows and max(sizes) <= 12 and sum(sizes[:-1]) < rows


def test_silent_micro_batches_split_for_the_processes_only_when_dealt():
    """Every process runs the silent groups' forward (features) unless a KL term trains them,
    when they are dealt like the trained ones."""
    prompts, responses = [[1, 2]] * 15, [[3] * 6] * 15  # 15 groups of one: a row each
    rows = {}
    for deal in (False, True):
        (micros,) = packing.packed_micro_batches(
            prompts, responses, [list(range(15))], 1, np.zeros(15, bool), row_len=8,
            max_rows=13, include_silent=True, processes=2, deal_silent=deal,
        )  # fmt: skip
        assert not any(m.trained for m in micros)
        rows[deal] = [m.shape[0] for m in micros]
    assert rows == {False: [13, 2], True: [8, 8]}


def test_split_rows_rounds_up_only_the_last_micro_batch():
    """On one process all micro-batches but the last have one size, and only the last is
    rounded up (to a bucket size, by less than its own size)."""
    for max_rows in (5, 12, 13, 24):
        for rows in range(1, 80):
            sizes = packing.split_rows(rows, max_rows)
            assert sum(sizes) >= rows and max(sizes) <= max_rows
            assert len(set(sizes[:-1])) <= 1 and sizes[-1] <= sizes[0]
            assert sum(sizes[:-1]) < rows  # the last micro-batch holds real rows
            bigger = [b for b in (*packing.ROW_BUCKETS, max_rows) if b >= sizes[-1]]
            assert sum(sizes) - rows < sizes[-1] and sizes[-1] in bigger


def test_a_prompt_is_real_once_per_step_however_its_group_splits():
    """Group 1 (prompt 2, responses 6 and 2) in 8-token rows, one row per micro-batch: its
    prompt is computed twice but is real once, so the step's real tokens are 2 + 6 + 2 and the
    repeat is padding, whatever the split."""
    micros = packing.packed_micro_batches(
        PROMPTS, RESPONSES, [[1]], 2, np.asarray([True, True]), row_len=8, max_rows=1,
        include_silent=False,
    )[0]  # fmt: skip
    assert [m.computed for m in micros] == [8, 8]
    assert [m.needed for m in micros] == [2 + 6, 2]
    together = packing.packed_micro_batches(
        PROMPTS, RESPONSES, [[1]], 2, np.asarray([True, True]), row_len=8, max_rows=2,
        include_silent=False,
    )[0]  # fmt: skip
    assert [(m.computed, m.needed) for m in together] == [(16, 10)]


def test_packed_batch_layout_by_hand():
    (micro,) = _micro(19)
    batch = micro.batch
    assert micro.shape == (1, 19) and micro.computed == 19
    assert micro.needed == 2 + 5 + sum(map(len, RESPONSES))
    np.testing.assert_array_equal(
        batch.tokens_RxL[0], [10, 11, 7, 8, 9, 10, 11, 12, 5, 6, 5, 6, 7, 8, 9, 1, 2, 3, 4]
    )
    np.testing.assert_array_equal(
        batch.positions_RxL[0], [0, 1, 2, 3, 4, 5, 6, 7, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 5]
    )
    np.testing.assert_array_equal(batch.piece_RxL[0], [0] * 10 + [1] * 9)
    np.testing.assert_array_equal(batch.segment_RxL[0], [0, 0] + [1] * 6 + [2] * 2 + [0] * 5
                                  + [1] * 3 + [2])  # fmt: skip
    # The first token of each response is predicted by its prompt's last token.
    assert batch.predictor_RxL[0, 2] == 1 and batch.predictor_RxL[0, 8] == 1
    assert batch.predictor_RxL[0, 15] == 14 and batch.predictor_RxL[0, 18] == 14
    assert batch.predictor_RxL[0, 9] == 8
    np.testing.assert_array_equal(micro.spans, [[3, 0, 2, 6], [2, 0, 8, 2], [0, 0, 15, 3],
                                                [1, 0, 18, 1]])  # fmt: skip
    mask = np.asarray(step_lib.packed_mask(jnp.asarray(batch.piece_RxL),
                                           jnp.asarray(batch.segment_RxL)))[0]  # fmt: skip
    assert mask[9, 1] and mask[9, 8] and not mask[9, 7]  # prompt and itself, not its sibling
    assert not mask[12, 5] and mask[12, 10]  # never across pieces
    # Per-response values go onto their tokens and come back out.
    per_token = micro.per_token(np.arange(4, dtype=np.float32) + 1)
    assert per_token[0, 2:8].tolist() == [4.0] * 6 and per_token[0, :2].sum() == 0
    assert [x.tolist() for x in micro.per_response(per_token)] == [[4] * 6, [3] * 2, [1] * 3, [2]]


@pytest.mark.parametrize(("processes", "data"), [(1, 1), (2, 1), (1, 2)])
def test_shared_prompts_cover_every_response_once_in_fewer_rows(processes, data):
    """Random long-tail steps (8 groups of 8, 40-64-token prompts, 320-token rows, `data`
    shards a micro-batch): with a prefix every response is still laid out once, with its
    prompt's tokens where its spans say, every prefix reads its prompt's positions in its
    own shard, and the busiest process never computes more rows than without."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        prompts = [list(rng.integers(1, 100, rng.integers(40, 65))) for _ in range(8)]
        lengths = np.clip(rng.lognormal(np.log(53), 0.8, 64), 1, 256).astype(int)
        responses = [list(rng.integers(1, 100, n)) for n in lengths]
        signal = rng.random(8) < 0.8
        rows = {}
        for width in (0, 64):
            (micros,) = packing.packed_micro_batches(
                prompts, responses, [list(range(8))], 8, signal, row_len=320,
                max_rows=12 if data > 1 else 13, include_silent=True, processes=processes,
                prefix_width=width, row_multiple=data,
            )  # fmt: skip
            seen = []
            for m in micros:
                tokens = np.asarray(m.batch.tokens_RxL).reshape(-1)
                assert m.shape[0] % data == 0 and m.batch.row_shards == data
                per_shard = m.shape[0] // data * 320
                for r, prefix in enumerate(np.asarray(m.batch.prefix_RxS)):
                    shard = r * 320 // per_shard
                    assert all(p // per_shard == shard for p in prefix[prefix >= 0])
                    if (prefix >= 0).any():  # the prompt of the row's first response
                        b = m.spans[m.spans[:, 1] == r][0, 0]
                        assert tokens[prefix[prefix >= 0]].tolist() == prompts[b // 8]
                for (b, row, col, n), (p_row, p_col, p_len) in zip(m.spans, m.prompt_spans,
                                                                   strict=True):  # fmt: skip
                    assert tokens[row * 320 + col : row * 320 + col + n].tolist() == responses[b]
                    start = p_row * 320 + p_col
                    assert tokens[start : start + p_len].tolist() == prompts[b // 8]
                    seen.append(int(b))
            assert sorted(seen) == list(range(64))
            loads = [0] * processes
            for i, m in enumerate(m for m in micros if m.trained):
                loads[i % processes] += m.shape[0]
            rows[width] = max(loads)
        assert rows[64] <= rows[0]


def test_continuing_piece_layout_by_hand():
    """8-token rows: group 1's second response continues its prompt from row 0, and the step
    takes 3 rows, not the 4 each piece with its prompt would."""
    assert [m.shape for m in _micro(8)] == [(4, 8)]
    (micro,) = _micro(8, prefix_width=6)
    batch = micro.batch
    assert micro.shape == (3, 8) and micro.computed == 24
    assert micro.needed == 2 + 5 + sum(map(len, RESPONSES))
    # Row 1: response 2 (positions 2, 3 after the 2-token prompt), then group 0's second piece.
    np.testing.assert_array_equal(batch.tokens_RxL[1], [5, 6, 5, 6, 7, 8, 9, 4])
    np.testing.assert_array_equal(batch.positions_RxL[1], [2, 3, 0, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(batch.piece_RxL[1], [0, 0, 1, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(batch.segment_RxL[1], [1, 1, 0, 0, 0, 0, 0, 1])
    # It reads the prompt at row 0, columns 0-1 (flat 0, 1); its first token is predicted by
    # the prefix's last feature (-1); no other row has a prefix.
    np.testing.assert_array_equal(batch.prefix_RxS, [[-1] * 6, [0, 1] + [-1] * 4, [-1] * 6])
    assert batch.predictor_RxL[1, 0] == -1 and batch.predictor_RxL[1, 1] == 0
    assert batch.predictor_RxL[1, 7] == 6
    np.testing.assert_array_equal(micro.prompt_spans[micro.response_ids == 2], [[0, 0, 2]])
    # A prompt longer than the prefix columns is refused before any program runs.
    with pytest.raises(ValueError, match=r"prompt 1 \(2 tokens\) continues in row 1, past the 1"):
        _micro(8, prefix_width=1)


def _reference_logprobs(model, temperature=1.0):
    out = []
    for b, response in enumerate(RESPONSES):
        prompt = PROMPTS[b // 2]
        full = jnp.asarray([list(prompt) + response])
        features, _ = model(full, jnp.arange(full.shape[1])[None])
        logits = model.logits(features)[0] / temperature
        out.append(np.asarray([jax.nn.log_softmax(logits[len(prompt) - 1 + t])[token]
                               for t, token in enumerate(response)]))  # fmt: skip
    return out


@pytest.mark.parametrize(("row_len", "prefix_width"), [(12, 0), (19, 0), (24, 0), (8, 6)])
def test_packed_logprobs_and_features_equal_per_sequence_forwards(tiny, row_len, prefix_width):
    model, graphdef, params = tiny
    expected = _reference_logprobs(model, temperature=0.7)
    for micro in _micro(row_len, prefix_width=prefix_width):
        batch = jax.tree.map(jnp.asarray, micro.batch)
        logprobs, features = step_lib.logprob_program(graphdef, params, batch, temperature=0.7)
        for b, got in zip(micro.response_ids, micro.per_response(logprobs), strict=True):
            np.testing.assert_allclose(got, expected[b], atol=2e-5)
        # The drafter buffer's rows: each sequence's features as its own forward gives them.
        tokens, feats, response, valid = micro.sink_rows(features)
        for i, b in enumerate(micro.response_ids):
            row = tokens[i][valid[i]]
            assert row.tolist() == list(PROMPTS[b // 2]) + RESPONSES[b]
            assert response[i].sum() == len(RESPONSES[b])
            full, _ = model(jnp.asarray(row[None]), jnp.arange(len(row))[None])
            np.testing.assert_allclose(np.asarray(feats)[i][valid[i]], full[0], atol=2e-5)


@functools.cache
def _programs(graphdef, algorithm, options):
    """The log-prob and gradient programs, jitted once per model, algorithm and options (op
    by op, the first layout's gradient took most of a minute)."""
    logprob = jax.jit(functools.partial(step_lib.logprob_program, graphdef, temperature=1.0,
                                        options=options))  # fmt: skip
    grad = jax.jit(functools.partial(step_lib.grad_program, graphdef, algorithm=algorithm,
                                     temperature=1.0, options=options))  # fmt: skip
    return logprob, grad


def _accumulate(graphdef, params, micros, algorithm, ref_shift=0.0, options=None, old_shift=-0.05):
    options = options or step_lib.ForwardOptions()
    logprob_program, grad_program = _programs(graphdef, algorithm, options)
    lengths = np.asarray([len(r) for r in RESPONSES])
    weights = algorithms.token_weights(algorithm.loss_aggregation, lengths)
    metric = np.full(len(RESPONSES), 1.0 / lengths.sum())
    accum = step_lib.zero_accumulator(params)
    for micro in micros:
        batch = jax.tree.map(jnp.asarray, micro.batch)
        old = logprob_program(params, batch)[0]
        inputs = step_lib.LossInputs(old + old_shift, old + ref_shift, micro.per_token(ADVANTAGES),
                                     micro.per_token(weights), micro.per_token(metric))  # fmt: skip
        accum = grad_program(params, accum, batch, inputs)
    return accum


@pytest.mark.parametrize(
    ("aggregation", "kl_coef", "old_shift"),
    # Every aggregation, one of them with the KL term and shared-prompt rows (each layout
    # compiles). Old log-probs 0.05 under the new (ratio 1.051, past epsilon 0.01): every
    # token of a positive advantage is clipped and has no gradient, so the gradients compare
    # only the others; 0.005 under (ratio 1.005): nothing clipped, every token has one.
    [("token_mean", 0.0, -0.005), ("seq_mean_token_mean", 0.1, -0.05),
     ("seq_mean_token_sum", 0.0, -0.005)],
)  # fmt: skip
def test_packed_loss_and_gradient_equal_padded_and_the_reference_loss(
    tiny, aggregation, kl_coef, old_shift
):
    model, graphdef, params = tiny
    algorithm = AlgorithmConfig(loss_aggregation=aggregation, kl_coef=kl_coef, epsilon=0.01)
    padded = packing.padded_micro_batches(
        PROMPTS, RESPONSES, [[[0], [1]]], 2, np.asarray([True, True]), min_bucket=4,
        max_prompt=16, max_response=16,
    )[0]  # fmt: skip
    layouts = [padded, _micro(12, max_rows=1), _micro(19)]
    if kl_coef:  # rows continuing prompts from other rows (one case: each layout compiles)
        layouts.append(_micro(8, prefix_width=6))
    results = [_accumulate(graphdef, params, micros, algorithm, ref_shift=0.2,
                           old_shift=old_shift) for micros in layouts]  # fmt: skip
    # The loss `algorithms.policy_loss` gives the whole batch, from per-sequence forwards.
    reference = _reference_logprobs(model)
    t = max(map(len, RESPONSES))
    lp = np.zeros((4, t), np.float32)
    mask = np.zeros((4, t), bool)
    for b, row in enumerate(reference):
        lp[b, : len(row)], mask[b, : len(row)] = row, True
    expected, metrics = algorithms.policy_loss(
        lp, lp + old_shift, ADVANTAGES, mask, epsilon=0.01, epsilon_high=0.01,
        aggregation=aggregation, ref_logprobs_BxT=lp + 0.2, kl_coef=kl_coef,
    )  # fmt: skip
    assert (float(metrics["clip_fraction"]) > 0) == (old_shift < -0.01)
    for accum in results:
        assert float(accum["loss"]) == pytest.approx(float(expected), abs=1e-5)
        assert float(accum["weight"]) == pytest.approx(1.0)
        assert float(accum["clip_fraction"]) == pytest.approx(float(metrics["clip_fraction"]))
        assert float(accum["kl"]) == pytest.approx(float(metrics["kl"]), abs=1e-6)
    for other in results[1:]:
        for a, b in zip(jax.tree.leaves(results[0]["grads"]), jax.tree.leaves(other["grads"]),
                        strict=True):  # fmt: skip
            np.testing.assert_allclose(a, b, atol=2e-6)


def test_silent_groups_pack_apart_and_untrained():
    micros = _micro(19, signal=(False, True), silent=True)
    assert [m.trained for m in micros] == [True, False]
    assert [sorted(m.response_ids.tolist()) for m in micros] == [[2, 3], [0, 1]]
    assert [sorted(m.response_ids.tolist()) for m in _micro(19, signal=(False, True))] == [[2, 3]]


def test_packed_geometry_keeps_the_padded_token_budget():
    # 64-token prompts + 256-token responses: 320-token rows; a padded micro-batch of 16
    # (2 groups of 8) computes 2 x 64 + 16 x 256 = 4224 positions at most -> 13 rows.
    assert packing.packed_geometry(64, 256, 16, 8, 16) == (320, 13)
    assert packing.packed_geometry(40, 24, 16, 8, 16) == (64, 7)
    assert packing.packed_geometry(30, 4, 1, 1, 16) == (48, 1)


def test_remat_and_logits_chunk_defaults_per_backend():
    """Unset, remat is on for deep policies on CPU only and the LM head goes by blocks on CPU
    only; a config's choice always wins."""
    assert step_lib.default_remat(30, "cpu") and step_lib.default_remat(8, "cpu")
    assert not step_lib.default_remat(2, "cpu")  # the test model: little to keep
    assert not step_lib.default_remat(30, "gpu") and not step_lib.default_remat(80, "tpu")
    unset = RLConfig()
    assert unset.remat is None
    assert step_lib.ForwardOptions.of(unset, 30, "cpu").remat
    assert not step_lib.ForwardOptions.of(unset, 30, "tpu").remat
    assert not step_lib.ForwardOptions.of(RLConfig(remat=False), 30, "cpu").remat
    assert step_lib.ForwardOptions.of(RLConfig(remat=True), 2, "tpu").remat
    # The LM head a block of 32 positions a row at a time on CPU, at once elsewhere, unless set.
    assert unset.logits_chunk is None
    assert step_lib.ForwardOptions.of(unset, 30, "cpu").logits_chunk == 32
    assert step_lib.ForwardOptions.of(unset, 30, "gpu").logits_chunk == 0
    assert step_lib.ForwardOptions.of(RLConfig(logits_chunk=0), 30, "cpu").logits_chunk == 0
    assert step_lib.ForwardOptions.of(RLConfig(logits_chunk=64), 30, "tpu").logits_chunk == 64


@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
def test_remat_and_chunked_forward_give_the_same_loss_and_gradient(tiny, layout):
    """Layer remat, attention 4 (or gcd) queries at a time and the LM head 4 positions at a
    time change memory, not math: the same log-probs, loss, metrics and gradient."""
    _, graphdef, params = tiny
    algorithm = AlgorithmConfig(kl_coef=0.1, epsilon=0.01)
    if layout == "padded":
        micros = packing.padded_micro_batches(
            PROMPTS, RESPONSES, [[[0], [1]]], 2, np.asarray([True, True]), min_bucket=8,
            max_prompt=16, max_response=16,
        )[0]  # fmt: skip
    elif layout == "packed":
        micros = _micro(24)
    else:  # rows continuing prompts from other rows: the prefix mask goes by query blocks too
        micros = _micro(8, prefix_width=6)
    chunked = step_lib.ForwardOptions(remat=True, attention_chunk=4, logits_chunk=4)
    plain = _accumulate(graphdef, params, micros, algorithm, ref_shift=0.2)
    other = _accumulate(graphdef, params, micros, algorithm, ref_shift=0.2, options=chunked)
    for name in step_lib.ACCUMULATED_METRICS:
        assert float(other[name]) == pytest.approx(float(plain[name]), abs=1e-6), name
    for a, b in zip(jax.tree.leaves(plain["grads"]), jax.tree.leaves(other["grads"]),
                    strict=True):  # fmt: skip
        np.testing.assert_allclose(a, b, atol=2e-6)
    batch = jax.tree.map(jnp.asarray, micros[0].batch)
    lp = [step_lib.logprob_program(graphdef, params, batch, temperature=0.7, options=o)[0]
          for o in (step_lib.ForwardOptions(), chunked)]  # fmt: skip
    np.testing.assert_allclose(lp[0], lp[1], atol=1e-6)


def test_rows_per_micro_batch_are_multiples_of_the_data_degree():
    """Rows the mesh's data axis does not divide would be computed whole on every data shard:
    the geometry and every split round to multiples of it."""
    assert packing.split_rows(7, 12, multiple=2) == (8,)
    assert packing.split_rows(13, 12, multiple=4) == (12, 4)
    with pytest.raises(ValueError, match="max_rows=13 is not a multiple of the data degree 2"):
        packing.split_rows(5, 13, multiple=2)
    for rows in range(1, 40):
        sizes = packing.split_rows(rows, 24, multiple=4)
        assert all(s % 4 == 0 for s in sizes) and sum(sizes) >= rows


def test_an_empty_prompt_is_refused_by_both_layouts():
    """With an empty prompt, packing predicted the response's first token from the previous
    piece's last token (another group's response) or from itself."""
    prompts, responses = [(7, 8, 9), ()], [[1, 2], [3, 4]]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        packing.packed_micro_batches(prompts, responses, [[0, 1]], 1, np.ones(2, bool),
                                     row_len=16, max_rows=4, include_silent=True)  # fmt: skip
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        packing.padded_micro_batches(prompts, responses, [[[0, 1]]], 1, np.ones(2, bool),
                                     min_bucket=8, max_prompt=8, max_response=8)  # fmt: skip
