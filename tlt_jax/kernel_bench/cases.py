"""The benchmark's cases and the interface every implementation fills: shape sets, ``Case``,
its inputs (``CaseInputs``, ``make_inputs``), ``Prepared`` and ``Implementation``, the constants
recorded with the results, and the two JAX implementations (``xla``, ``pallas``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.tree_attention import BlockSizes, tree_attention, tree_attention_reference
from tlt_jax.models.presets import get_preset
from tlt_jax.models.transformer import attention

KERNELS = {
    "tree": "verify step: q [B, T, N, H] over a ragged cache [B, S, K, H] (request b holds "
    "S - b * S // (2 * B) tokens) plus T tree tokens under a chain mask (the densest tree mask)",
    "decode": "plain decode step: the same call with T = 1 and tree_mask [[True]] (the new token "
    "attends to its cache and itself); flash_attn / flashinfer use their decode kernels",
}
BYTES_FORMULA = (
    "itemsize * (2 * sum_b(cache_lens[b]) * K * H + 2 * B * T * K * H + 2 * B * T * N * H): "
    "K and V of every live cache position, the tree K and V, q and the output"
)
TIMING = (
    "median_ms: median wall time of num_runs calls after num_warmup, each call synchronised "
    "(jax.block_until_ready / torch.cuda.synchronize); pipelined_ms: num_runs calls back to back, "
    "one synchronisation, mean; cuda_event_ms (torch on CUDA): median CUDA-event time of one "
    "call; device_ms (JAX paths on an accelerator): one compiled program of chained calls "
    "(each waits for the last), each call on its own copy of the inputs, the copies together "
    "twice the L2 cache where 128 copies and 16 GiB suffice, so calls read HBM and pay no "
    "Python dispatch or synchronisation (a dispatch-only program's time is subtracted); "
    "first_call_s includes compilation. goal_ms, which GB/s, hbm_fraction, "
    "the speedups and the goals use: device_ms, else cuda_event_ms, else median_ms (which "
    "holds each call's dispatch and synchronisation: tens of us against the headline rows' "
    "2.5-250 us at full bandwidth); hbm_fraction_pipelined uses pipelined_ms. The torch "
    "paths' event-timed calls each follow a write of twice the L2 cache's size (outside the "
    "events, as triton.testing.do_bench does), so they too read their inputs from HBM; "
    "median_ms and pipelined_ms re-read inputs under the L2's 50 MB from it."
)
# Above the L2 cache of an H100 / H200 (50 MB): `device_ms` cycles over input copies that
# together hold at least twice this, so a call never finds its inputs in L2.
L2_BYTES = 64 * 2**20
MAX_INPUT_COPIES = 128
MIN_CHAINED_CALLS = 8
INPUT_COPY_BYTES = 16 * 2**30  # the copies' memory at most (a GPU of 80 GB or more)
# Peak HBM bandwidth by a substring of jax's device_kind.
HBM_GBPS_BY_DEVICE_KIND = {"H200": 4800.0, "H100": 3350.0, "TPU v5p": 2765.0}
# (goal, summary field, comparison, threshold), evaluated on the headline tree rows.
GOALS = (
    ("pallas_at_least_1.5x_xla", "geomean_speedup_pallas_over_xla", ">=", 1.5),
    ("pallas_at_least_0.7_hbm_bandwidth", "median_pallas_hbm_fraction", ">=", 0.7),
    ("pallas_within_1.2x_best_cuda", "geomean_pallas_ms_over_best_cuda_ms", "<=", 1.2),
)
PAGE_SIZE = 16
NUM_WARMUP = 2

# name: (presets, tree grid (B, T, S), decode grid (B, S), headline rule for the first head shape)
_SHAPE_SETS = {
    "device": (
        ("qwen2_5_7b", "ds_r1_distill_qwen_7b"),
        ((1, 4, 16, 64), (8, 16, 32, 64), (1024, 4096, 16384, 32768)),
        ((1, 4, 16, 64), (1024, 4096, 16384, 32768)),
        lambda b, t, s: b <= 16 and 8 <= t <= 32 and s >= 4096,
    ),
    "full": (
        ("qwen2_5_7b", "smollm2_135m"),
        ((1, 4, 16), (8, 16, 32, 48), (512, 2048, 8192)),
        ((1, 4, 16), (512, 2048, 8192)),
        lambda b, t, s: True,
    ),
    "tiny": (("tiny",), ((1, 2), (8,), (256,)), ((1, 2), (256,)), lambda b, t, s: True),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One shape of one kernel."""

    kernel: str  # "tree" | "decode"
    presets: tuple[str, ...]  # the model presets with these head shapes
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    batch_size: int  # B
    num_tokens: int  # T, 1 for decode
    cache_len: int  # S, the buffer length
    headline: bool = False

    def cache_lens(self) -> np.ndarray:
        """Ragged live lengths [B]: request b holds ``S - b * S // (2 * B)`` tokens."""
        batch, cache_len = self.batch_size, self.cache_len
        return np.array([cache_len - b * cache_len // (2 * batch) for b in range(batch)], np.int32)

    def input_bytes(self, itemsize: int) -> int:
        """q, the K/V cache buffers, the tree K/V and the tree mask."""
        batch, tokens, kv = self.batch_size, self.num_tokens, self.num_kv_heads * self.head_dim
        q_and_tree = batch * tokens * (self.num_heads * self.head_dim + 2 * kv)
        return itemsize * (q_and_tree + 2 * batch * self.cache_len * kv) + batch * tokens**2

    def live_bytes(self, itemsize: int) -> int:
        """The bytes an ideal kernel moves, ``BYTES_FORMULA``."""
        batch, tokens, kv = self.batch_size, self.num_tokens, self.num_kv_heads * self.head_dim
        cache = 2 * int(self.cache_lens().sum()) * kv
        q_and_out = 2 * batch * tokens * self.num_heads * self.head_dim
        return itemsize * (cache + 2 * batch * tokens * kv + q_and_out)


def shape_cases(shapes: str) -> list[Case]:
    """The cases of a shape set: headline tree cases first, then decode, then the other tree ones.

    Presets with identical head shapes run once, labelled with every preset name.
    """
    if shapes not in _SHAPE_SETS:
        raise ValueError(f"{shapes=} must be one of {sorted(_SHAPE_SETS)}")
    presets, tree_grid, decode_grid, is_headline = _SHAPE_SETS[shapes]
    groups: dict[tuple[int, int, int], list[str]] = {}
    for name in presets:
        config = get_preset(name)
        groups.setdefault((config.num_heads, config.num_kv_heads, config.head_dim), []).append(name)
    cases = []
    for index, (heads, names) in enumerate(groups.items()):
        for b, t, s in itertools.product(*tree_grid):
            headline = index == 0 and is_headline(b, t, s)
            cases.append(Case("tree", tuple(names), *heads, b, t, s, headline=headline))
        for b, s in itertools.product(*decode_grid):
            cases.append(Case("decode", tuple(names), *heads, b, 1, s))
    return sorted(cases, key=lambda c: 0 if c.headline else 1 if c.kernel == "decode" else 2)


@dataclasses.dataclass
class CaseInputs:
    """One case's arrays, shared by every implementation; ``memo`` keeps derived copies."""

    case: Case
    args: tuple[jax.Array, ...]  # q, k_cache, v_cache, cache_lens, k_tree, v_tree, tree_mask
    interpret: bool
    block_sizes: BlockSizes | None
    memo: dict[str, Any] = dataclasses.field(default_factory=dict)


def make_inputs(case: Case, dtype, *, interpret: bool, block_sizes=None, seed=0) -> CaseInputs:
    """Random normal q, cache and tree K/V (positions past a request's length hold garbage)."""
    keys = iter(jax.random.split(jax.random.key(seed), 5))
    normal = lambda *shape: jax.random.normal(next(keys), shape, dtype)
    b, t, s = case.batch_size, case.num_tokens, case.cache_len
    n, k, h = case.num_heads, case.num_kv_heads, case.head_dim
    tree_mask_BxTxT = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    args = (normal(b, t, n, h), normal(b, s, k, h), normal(b, s, k, h),
            jnp.asarray(case.cache_lens()), normal(b, t, k, h), normal(b, t, k, h),
            tree_mask_BxTxT)  # fmt: skip
    return CaseInputs(case, args, interpret, block_sizes)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """One implementation made ready for one case; only ``call`` is timed."""

    call: Callable[[], Any]
    sync: Callable[[Any], Any]  # waits for an output or a list of outputs
    to_numpy: Callable[[Any], np.ndarray]  # an output -> float32 [B, T, N, H]
    device: str
    event_ms: Callable[[Callable[[], Any], int], float] | None = None  # device-side timer
    device_ms: Callable[[int], float] | None = None  # ms a call inside one chained program


@dataclasses.dataclass(frozen=True)
class Implementation:
    """An attention implementation under test.

    Attributes:
        name: its column in the results.
        prepare: builds a ``Prepared`` for a case (layouts, plans); raising records an error.
        kernels: the kernels it covers; other rows record it as not applicable.
        cuda_path: counts toward the best CUDA path the Pallas kernel is compared with.
        requires: a module that must import, else the implementation is unavailable.
    """

    name: str
    prepare: Callable[[CaseInputs], Prepared]
    kernels: tuple[str, ...] = ("tree", "decode")
    cuda_path: bool = False
    requires: str | None = None


def chained_device_ms(fn: Callable, args: tuple, live_bytes: int, num_runs: int) -> float:
    """Milliseconds per call of `fn(*args)` inside one compiled program: the calls run one
    after another (each call's q waits for the last call's output), each on its own copy of
    `args` (calls sharing a copy would share XLA's work on it: one upcast of the cache for
    all), at least `MIN_CHAINED_CALLS` of them and enough that the copies hold twice
    `L2_BYTES` (at most `MAX_INPUT_COPIES`, and at most `INPUT_COPY_BYTES` of copies: a
    case bigger than that runs fewer calls). The median over runs of the program less that of
    a program that only reads one element of the same arguments (its dispatch and
    synchronisation), divided by the calls.

    What a kernel costs inside a model step, where nothing synchronises between layers: no
    Python dispatch, no `block_until_ready`, inputs from HBM."""
    size = sum(int(x.nbytes) for x in jax.tree.leaves(args))
    wanted = max(MIN_CHAINED_CALLS, -(-2 * L2_BYTES // max(live_bytes, 1)))
    calls = int(max(1, min(wanted, MAX_INPUT_COPIES, INPUT_COPY_BYTES // max(size, 1))))
    sets = [args] + [jax.tree.map(jnp.copy, args) for _ in range(calls - 1)]

    @jax.jit
    def chain(sets):
        out = None
        for q, *rest in sets:
            if out is not None:  # a float times 0 is not folded (NaN): a real dependency
                q = q + (out.reshape(-1)[0] * 0).astype(q.dtype)
            out = fn(q, *rest)
        return out

    @jax.jit
    def dispatch_only(sets):  # the same arguments, one element read
        return sets[0][0].reshape(-1)[:1] + 0

    def median_s(program) -> float:
        jax.block_until_ready(program(sets))  # compiles
        times = []
        for _ in range(max(3, num_runs // 4)):
            start = time.perf_counter()
            jax.block_until_ready(program(sets))
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    chained, fixed = median_s(chain), median_s(dispatch_only)
    return max(chained - fixed, chained / 1e3) / calls * 1e3


def _jax_prepared(fn: Callable, inputs: CaseInputs) -> Prepared:
    to_numpy = lambda out: np.asarray(jax.device_get(out.astype(jnp.float32)))
    call = lambda: fn(*inputs.args)
    device_ms = None
    if jax.default_backend() != "cpu":  # on CPU the kernel is the Pallas interpreter
        live = inputs.case.live_bytes(inputs.args[0].dtype.itemsize)
        device_ms = functools.partial(chained_device_ms, fn, inputs.args, live)
    return Prepared(call, jax.block_until_ready, to_numpy, jax.default_backend(),
                    device_ms=device_ms)  # fmt: skip


def prepare_xla_reference(inputs: CaseInputs) -> Prepared:
    return _jax_prepared(tree_attention_reference, inputs)


@jax.jit
def _model_xla_attention(q, k_cache, v_cache, cache_lens, k_tree, v_tree, tree_mask):
    return attention(q, k_tree, v_tree, tree_mask, k_cache, v_cache, cache_lens, impl="xla")


def prepare_xla(inputs: CaseInputs) -> Prepared:
    """The attention the model runs with ``attention_impl="xla"``, the path the kernel replaces:
    products of input-dtype operands with float32 results (``preferred_element_type``: the
    scores, and the cache and tree value products, added before one rounding), probabilities
    cast back to the input dtype for the value products.

    It reads the buffer the kernel is given. A dense call cannot skip a request's dead tail, and
    the static prefix it could be cut to (the longest request's length) is the whole buffer in
    every case (``Case.cache_lens``: request 0 holds S tokens), so the kernel's per-request skip
    is a gain a JAX user would see, not a difference of setup.
    """
    return _jax_prepared(_model_xla_attention, inputs)


def prepare_pallas(inputs: CaseInputs) -> Prepared:
    kernel = functools.partial(
        tree_attention, block_sizes=inputs.block_sizes, interpret=inputs.interpret
    )
    return _jax_prepared(kernel, inputs)
