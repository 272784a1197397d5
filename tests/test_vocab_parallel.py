"""Token choice and tree acceptance on a vocabulary split over the mesh's `tensor` axis
(`sampling.VocabAxis`, `sharding.rowwise(vocab_args=...)`) against the whole-row math of one
device: the same tokens, the same log-probs to float32 rounding, and collectives of a few
values per row instead of the [B, V] logits the partitioner gathered."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from tlt_jax.parallel import sharding
from tlt_jax.programs import collective_report
from tlt_jax.rollout.acceptance import accept_tree
from tlt_jax.rollout.sampling import PRESELECT, choose_tokens

V = 8192  # 4 blocks of 2,048: a block is larger than the top-k candidates gathered per row
B = 8

# Per row: greedy; plain T = 0.8 and 1.0; top-k inside the candidates; top-p inside them; a
# flat row whose nucleus (top-p 0.95) and a row whose top-k (600) reach past the candidates
# (the bisection over the whole row); a greedy row again.
TEMPERATURE = [0.0, 0.8, 1.0, 0.7, 0.9, 1.0, 0.6, 0.0]
TOP_K = [0, 0, 0, 40, 0, 0, 600, 0]
TOP_P = [1.0, 1.0, 1.0, 1.0, 0.9, 0.95, 1.0, 1.0]


def _logits(seed: int, shape) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 3.0, shape).astype(np.float32)
    logits[..., 5, :] = rng.normal(0.0, 0.01, shape[-1:])  # row 5: nearly flat
    return logits


def _sampling_args():
    return (jnp.asarray(TEMPERATURE, jnp.float32), jnp.asarray(TOP_K, jnp.int32),
            jnp.asarray(TOP_P, jnp.float32))  # fmt: skip


def _place(mesh, x, *, vocab: bool):
    """Rows over `data`, the last dimension over `tensor` when `vocab` (as the head's
    logits come out of a rollout program)."""
    spec = PartitionSpec("data", *(None,) * (x.ndim - 2), "tensor") if vocab else None
    return jax.device_put(x, NamedSharding(mesh, spec or PartitionSpec("data")))


def _on_mesh(fn, mesh, args, vocab_args=(0,)):
    """`fn` lowered and run under `rows_per_device(mesh)`, as the engine runs it, on logits
    (`args[0]`) split over `tensor` as the head makes them; returns (outputs, the compiled
    program's collectives). `vocab_args=()`: rows per device only, the vocabulary left to
    the partitioner (as before `VocabAxis`)."""

    def program(*xs):
        with sharding.rows_per_device(mesh):
            return sharding.rowwise(fn, vocab_args=vocab_args)(*xs)

    placed = [_place(mesh, x, vocab=i == 0) for i, x in enumerate(args)]
    compiled = jax.jit(program).lower(*placed).compile()
    return compiled(*placed), collective_report(compiled)


def _sent(report) -> int:
    return sum(v for k, v in report.items() if k.endswith("_bytes"))


def test_a_split_rows_total_is_exactly_its_last_cumulative_mass():
    """On a split vocabulary each block's cumulative sum continues from the blocks before it;
    the row's total must be bit-equal to where the last block ends, or a uniform draw in
    [0, total) can land past every token (then clamped onto the last one, even with no
    mass). Summing the blocks' totals in another order (as before) differed on 29% of these
    rows, by a float32 step."""
    from tlt_jax.rollout.sampling import VocabAxis, cumulative_mass

    def total_and_end(probs_BxV, vocab_axis=None):
        assert vocab_axis is not None  # the split path
        cdf_BxV, total_B = cumulative_mass(probs_BxV, VocabAxis(vocab_axis))
        last = jax.lax.axis_index(vocab_axis) == jax.lax.axis_size(vocab_axis) - 1
        end_B = jax.lax.psum(jnp.where(last, cdf_BxV[..., -1], 0.0), vocab_axis)  # exact
        return total_B, end_B

    mesh = sharding.make_mesh((1, 8))
    rows = np.random.default_rng(3).exponential(1.0, (2000, V)).astype(np.float32)
    rows *= np.random.default_rng(4).uniform(0.0, 1.0, (2000, 1)) ** 8  # many magnitudes
    (total, end), _ = _on_mesh(total_and_end, mesh, (jnp.asarray(rows),))
    np.testing.assert_array_equal(np.asarray(total), np.asarray(end))
    np.testing.assert_allclose(total, rows.astype(np.float64).sum(-1), rtol=1e-5)


@pytest.mark.parametrize("mesh_shape", [(1, 4), (2, 2)])
@pytest.mark.parametrize("mode", ["greedy", "sampled", "filtered"])
def test_choose_tokens_on_a_split_vocabulary_equals_whole_rows(mesh_shape, mode):
    mesh = sharding.make_mesh(mesh_shape)
    rows = _logits(0, (B, V))
    logits = jnp.asarray(rows)
    temperature, top_k, top_p = _sampling_args()
    if mode != "filtered":
        top_k, top_p = jnp.zeros_like(top_k), jnp.ones_like(top_p)
    keys = jax.random.split(jax.random.key(7), B)
    fn = functools.partial(choose_tokens, greedy_only=mode == "greedy",
                           filtering=mode == "filtered")  # fmt: skip
    args = (logits, temperature, top_k, top_p, keys)
    want_tokens, want_logprobs = jax.jit(fn)(*args)
    (tokens, logprobs), report = _on_mesh(fn, mesh, args)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want_tokens))
    np.testing.assert_allclose(np.asarray(logprobs), np.asarray(want_logprobs), atol=2e-5)
    # Greedy rows take the argmax; the flat row drew outside the candidates' reach.
    np.testing.assert_array_equal(np.asarray(tokens)[[0, 7]], np.argmax(rows[[0, 7]], -1))
    # A few values per row (maxima, sums, each block's mass), plus with filtering the
    # top-k candidates of every block: far below the rows' size, which the partitioner
    # all-gathered.
    rows_per_device = B // mesh_shape[0]
    row_bytes = rows_per_device * V * 4
    if mode == "filtered":
        assert _sent(report) < rows_per_device * mesh_shape[1] * PRESELECT * 4 * 2, report
    else:
        assert _sent(report) < row_bytes / 256, report
    if mode == "sampled":  # what the partitioner sends for the same math: the rows, gathered
        (tokens, _), whole = _on_mesh(fn, mesh, args, vocab_args=())
        np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want_tokens))
        assert _sent(whole) >= row_bytes * (mesh_shape[1] - 1) / mesh_shape[1], whole


@pytest.mark.parametrize("greedy_only", [True, False])
def test_accept_tree_on_a_split_vocabulary_equals_whole_rows(greedy_only):
    """Trees of 6 nodes (a root, 3 children, 2 grandchildren) whose children are the
    target's likely tokens, so some rows accept drafts and others correct."""
    mesh = sharding.make_mesh((2, 2))
    t = 6
    logits = _logits(1, (B, t, V))
    top = np.argsort(-logits, axis=-1)
    parents = np.tile(np.asarray([-1, 0, 0, 0, 1, 1], np.int32), (B, 1))
    tokens = np.zeros((B, t), np.int32)
    tokens[:, 1:4] = top[:, 0, :3]  # the root's 3 likeliest next tokens
    tokens[:, 4:6] = top[:, 1, 1:3]  # under child 1: its 2nd and 3rd likeliest
    tokens[1::2, 1] = top[1::2, 0, 7]  # odd rows: the first child is an unlikely token
    positions = np.tile(np.asarray([10, 11, 11, 11, 12, 12], np.int32), (B, 1))
    temperature, top_k, top_p = _sampling_args()
    keys = jax.random.split(jax.random.key(3), B)
    fn = functools.partial(accept_tree, greedy_only=greedy_only)
    if greedy_only:
        temperature = jnp.zeros_like(temperature)
    args = (jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(parents),
            jnp.asarray(positions), temperature, top_k, top_p, keys)  # fmt: skip
    want = jax.jit(fn)(*args)
    got, report = _on_mesh(fn, mesh, args)
    for name in ("path_BxT", "tokens_BxT", "num_accepted_B"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                      np.asarray(getattr(want, name)), err_msg=name)  # fmt: skip
    np.testing.assert_allclose(np.asarray(got.logprobs_BxT), np.asarray(want.logprobs_BxT),
                               atol=2e-5)  # fmt: skip
    assert 0 < int(np.sum(np.asarray(want.num_accepted_B))) < B * 2  # accepts and corrects
    assert _sent(report) < (B // 2) * t * V * 4 / 8, report
