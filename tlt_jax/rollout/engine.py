"""Continuous-batching rollout engine: request queue, slots, bucketed prefill and decode.

Dimension legend: B batch (slots), P prompt length, S kv length, V vocab.

Slots are kept compact: the running requests always occupy slots `[0, n)`. A decode step
runs over `batch_bucket(n)` slots and `kv_bucket(max_len + 1)` cache positions, so its cost
follows the real batch and context: the KV cache (`DecodeCache`, one array pair per layer) is
sized exactly to those buckets and resized when they change (`_fit_cache`: it grows with the
batch or the context and shrinks as requests finish and none wait),
and steps run over per-layer weights (`tlt_jax.models.decode`: on XLA:CPU the scanned form
copied each layer's weights and cache window before reading them). When a request finishes
the last running slot moves into its place, and queued requests are prefilled into the free
slots before the next step.

Every device program is compiled ahead of time once per static shape key and kept in the
engine's executable pool; steady-state generation never traces. `EngineStats` reports the
compile count and compile seconds. Decode and verify steps come in two tiers
(`EngineConfig.layers_per_program`, `one_program_after`): a bucket's first steps run as
programs of a few layers each (`LayeredForward`: cheap to compile, shared by every block and
by greedy and sampled steps), and a bucket that keeps running is compiled as one program with
every layer unrolled (the fastest step). On CPU that halves what a short run spends compiling;
accelerators start in the second tier.

What each decode step runs is the engine's `step_policy` (`tlt_jax.rollout.adaptive`): plain
decoding or a speculative step (`StepChoice`: an EAGLE, n-gram or hybrid draft tree of a
`SpecStrategy`; host side in `spec_engine.py`, programs in `speculative.py`). The policy is told
every step's emitted tokens and host time, which is how TLT's bandit learns (no extra sync: the
engine reads each step's tokens anyway). SD programs share the pool: drafts keyed by (batch,
k, depth, kv, hot vocabulary size), trees by (batch, k, depth, verify tokens), verifies by
(batch, verify tokens, kv) only. Prefill also runs the drafter over the prompt. An optional
hot vocabulary (`hot_token_ids`) restricts the draft levels' LM head to frequent tokens;
verification keeps the full vocabulary. The pool (`tlt_jax.programs.ProgramPool`) can be
shared with the trainer: one pool, one compile report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import PartitionSpec

from tlt_jax.config_fields import is_int as _is_int
from tlt_jax.models.decode import (
    DecodeCache,
    ForwardInputs,
    LayeredForward,
    block_program,
    final_features,
    layer_shardings,
    move_row,
    unstack_layers,
)
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.transformer import Transformer, causal_mask
from tlt_jax.parallel import sharding as sharding_lib
from tlt_jax.programs import ProgramPool, check_opt_level
from tlt_jax.rollout import speculative
from tlt_jax.rollout.adaptive import FixedPolicy, PlainPolicy, StepChoice, StepPolicy, arm_name
from tlt_jax.rollout.sampling import SamplingParams, choose_tokens, needs_filtering
from tlt_jax.rollout.spec_engine import (
    SpecRunner,
    check_drafter_fits,
    check_hot_token_ids,
    check_spec_settings,  # fmt: skip
)
from tlt_jax.rollout.speculative import DraftState, SpecStrategy, draft_length, without_caches

DRAFTER_SYNC = ("lazy", "eager")
# `xla_opt_level=None` on CPU: -O1 compiles SmolLM2's rollout programs 5-12% faster than
# XLA's -O2 and they decode as fast (BENCHMARKS.md, "-O1 for the engine's programs on CPU").
CPU_OPT_LEVEL = 1
# `layers_per_program=None` starts CPU engines of policies this deep in the layered tier.
LAYERED_MIN_LAYERS = 8

# Bumped inside traced functions, so it counts traces (tests prove no retracing).
TRACE_COUNTS: dict[str, int] = {}


def _count_trace(name: str) -> None:
    TRACE_COUNTS[name] = TRACE_COUNTS.get(name, 0) + 1


def power_of_two_buckets(minimum: int, maximum: int) -> tuple[int, ...]:
    """minimum, 2*minimum, ... capped by (and always including) maximum."""
    out, b = [], max(1, minimum)
    while b < maximum:
        out.append(b)
        b *= 2
    out.append(maximum)
    return tuple(out)


def compile_options(level: int | None, backend: str) -> dict[str, int] | None:
    """XLA compile options of an engine's programs for `EngineConfig.xla_opt_level`."""
    if level is None:
        if backend != "cpu" or "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
            return None
        level = CPU_OPT_LEVEL
    return {"xla_backend_optimization_level": level}


def bucket_for(value: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if value <= b:
            return b
    raise ValueError(f"{value=} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static sizes of the engine. All programs are compiled for buckets of these."""

    max_batch_size: int = 32
    max_seq_len: int = 2048
    max_prefill_batch: int = 8
    min_kv_bucket: int = 128
    min_prompt_bucket: int = 16
    # Speculative decoding (needs a drafter): the strategy, the largest running batch that
    # uses it (None: every batch), and the attention of the SD programs ("xla" | "pallas").
    spec_strategy: SpecStrategy | None = None
    spec_max_batch: int | None = None
    spec_attention_impl: str = "xla"
    # How plain steps treat the drafter (engines with one): "eager" runs the drafter layer
    # over every plain step's new pair, so switching into SD costs nothing; "lazy" leaves it
    # behind and the first SD step catches it up (a target forward over the missed
    # positions). bench_spec on SmolLM2: eager adds <= 2% to a plain step at batch 1-16; the
    # lazy catch-up after 128 plain steps costs 8-34 plain steps.
    drafter_sync: str = "eager"
    # Plain decode steps are dispatched before the previous step's tokens are read (when no
    # request waits to be admitted): the host's per-step work (argument dispatch, reading and
    # emitting tokens, stop checks, slot moves) overlaps the device's step. A request's stop is
    # then seen one step late; the one token computed after it is dropped (outputs are those
    # of `overlap_host=False` token for token where both run the same programs; a step sized
    # before a stop is read can run at a larger batch or kv bucket, whose kernels may round a
    # near tie differently, so in general they are equal in distribution). With a step
    # policy that speculates, a stop seen late can also delay the switch into SD by a step
    # (ends by length are foreseen and are not): sampled tokens of that step then differ from
    # `overlap_host=False`'s, equally distributed (SD is lossless either way).
    overlap_host: bool = True
    # Two tiers of step programs. A decode or verify step at a (batch, kv) bucket first runs
    # as programs of `layers_per_program` layers each (`models.decode.LayeredForward`: one
    # block program serves every block and bucket of the same size, so entering a bucket
    # compiles little), and once that bucket has run `one_program_after` such steps it is
    # compiled as one program with every layer unrolled (the fastest step, the dearest
    # compile). 0 layers: one program from the start; None: per backend (1 on CPU for
    # policies of >= 8 layers, where an unrolled SmolLM2 step compiles in 2-4 s and a layered
    # one runs 5-15% slower; 0 elsewhere, where a dispatch per layer costs more, and for
    # shallow policies, which compile fast unrolled). `one_program_after=0`: never fused.
    layers_per_program: int | None = None
    one_program_after: int = 256
    # XLA's backend optimisation level (`xla_backend_optimization_level`, LLVM's -O) of every
    # program the engine compiles; the trainer's programs keep XLA's default. None: per
    # backend, `CPU_OPT_LEVEL` on CPU unless XLA_FLAGS sets the level (then XLA_FLAGS rules),
    # XLA's default (2) elsewhere.
    xla_opt_level: int | None = None

    def __post_init__(self):
        for name in ("max_batch_size", "max_seq_len", "max_prefill_batch", "min_kv_bucket",
                     "min_prompt_bucket"):  # fmt: skip
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"engine.{name}={value!r} must be a positive integer")
            object.__setattr__(self, name, int(value))
        if isinstance(self.spec_strategy, str):
            object.__setattr__(self, "spec_strategy", SpecStrategy.parse(self.spec_strategy))
        check_spec_settings(self.spec_strategy, self.spec_max_batch, self.spec_attention_impl)
        n = self.layers_per_program
        if n is not None and (not _is_int(n) or n < 0):
            raise ValueError(f"engine.layers_per_program={n!r} must be an integer >= 0 (0: one "
                             "program per step) or None (per backend)")  # fmt: skip
        if not _is_int(self.one_program_after) or self.one_program_after < 0:
            raise ValueError(f"engine.one_program_after={self.one_program_after!r} must be an "
                             "integer >= 0 (0: never)")  # fmt: skip
        for name in ("spec_max_batch", "layers_per_program", "one_program_after"):
            if getattr(self, name) is not None:  # a numpy integer is taken as an int
                object.__setattr__(self, name, int(getattr(self, name)))
        if self.drafter_sync not in DRAFTER_SYNC:
            raise ValueError(f"engine.drafter_sync={self.drafter_sync!r} is not one of "
                             f"{list(DRAFTER_SYNC)}")  # fmt: skip
        check_opt_level(self.xla_opt_level, "engine.xla_opt_level")

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        return power_of_two_buckets(1, self.max_batch_size)

    @property
    def kv_buckets(self) -> tuple[int, ...]:
        return power_of_two_buckets(min(self.min_kv_bucket, self.max_seq_len), self.max_seq_len)

    @property
    def prompt_buckets(self) -> tuple[int, ...]:
        return power_of_two_buckets(min(self.min_prompt_bucket, self.max_seq_len), self.max_seq_len)

    @property
    def prefill_batch_buckets(self) -> tuple[int, ...]:
        return power_of_two_buckets(1, min(self.max_prefill_batch, self.max_batch_size))


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request. Validated on construction, before anything compiles."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self):
        for field in ("prompt_ids", "stop_ids"):
            ids = getattr(self, field)
            if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
                raise ValueError(f"{field}={ids!r} must be a sequence of token ids")
            ids = tuple(ids)
            bad = [t for t in ids if not _is_int(t)]
            if bad:  # int() would truncate 1.7 and True into token ids
                raise ValueError(f"{field} holds {bad[:3]!r}; token ids are integers")
            object.__setattr__(self, field, tuple(int(t) for t in ids))
        if not self.prompt_ids:
            raise ValueError("prompt_ids is empty; a request needs at least one prompt token")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be a positive integer")
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling={self.sampling!r} must be a SamplingParams")
        # The request's PRNG stream is keyed by a uint32: a wider seed would be folded into
        # one, silently (5 and 5 + 2**32 sampled the same tokens).
        if not _is_int(self.seed) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed={self.seed!r} must be an integer in [0, 2**32)")
        object.__setattr__(self, "seed", int(self.seed))


def check_requests(requests: Sequence[Request], max_seq_len: int,
                   vocab_size: int | None = None) -> None:  # fmt: skip
    """Checks every request against a context of `max_seq_len` and, when given, the vocabulary
    (`RolloutEngine.validate`; callers that know the sizes before the model loads call it
    then), naming the request."""
    for i, req in enumerate(requests):
        if not isinstance(req, Request):
            raise TypeError(f"requests[{i}] is {type(req).__name__}; expected Request")
        total = len(req.prompt_ids) + req.max_new_tokens
        if total > max_seq_len:
            raise ValueError(
                f"requests[{i}]: prompt length {len(req.prompt_ids)} + max_new_tokens "
                f"{req.max_new_tokens} = {total} exceeds the context length "
                f"max_seq_len={max_seq_len}"
            )
        if vocab_size is not None:
            bad = [t for t in req.prompt_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"requests[{i}]: token ids {bad[:5]} outside [0, {vocab_size})")
            # A stop id no token can be never matches: every such request ran to its cap.
            bad = [t for t in req.stop_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"requests[{i}]: stop ids {bad[:5]} outside [0, {vocab_size})")


@dataclasses.dataclass
class Completion:
    """The result of one request, in the order the requests were given."""

    index: int
    prompt_ids: tuple[int, ...]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = ""  # "stop" (a stop token was emitted, and kept) or "length"
    accepted_lengths: list[int] = dataclasses.field(default_factory=list)
    submit_time: float = 0.0
    first_token_time: float = 0.0
    finish_time: float = 0.0

    @property
    def latency_s(self) -> float:
        return self.finish_time - self.submit_time


@dataclasses.dataclass
class EngineStats:
    compile_count: int = 0
    compile_seconds: float = 0.0
    prefill_steps: int = 0
    decode_steps: int = 0
    generated_tokens: int = 0
    # (wall time since generate() started, running requests, arm, compile seconds) after
    # every decode step; the arm is "plain" or the step's `StepChoice` as text
    # ("ngram:4,1,5"); the compile seconds are the programs compiled since the row before
    # (inside the step's time: `timing.without_compiles` takes them out of the clock).
    timeline: list[tuple[float, int, str, float]] = dataclasses.field(default_factory=list)
    spec_steps: int = 0
    # Per draft source: running rows of its SD steps and the tokens they emitted (their ratio
    # is the source's acceptance length).
    spec_rows_by_source: dict[str, int] = dataclasses.field(default_factory=dict)
    spec_tokens_by_source: dict[str, int] = dataclasses.field(default_factory=dict)
    # Drafter catch-ups when SD (re)starts after plain steps: calls, positions recomputed
    # (one target forward plus one drafter layer each) and their wall time, waited for.
    spec_switch_count: int = 0
    spec_switch_tokens: int = 0
    spec_switch_seconds: float = 0.0


@struct.dataclass
class DecodeState:
    """Everything a decode step reads and writes; donated to every program.

    Every array has a row per slot, B of them: the batch bucket the caches are sized to
    (`RolloutEngine._fit_cache` resizes all of them together). So on a mesh a step's per-slot
    scalars split over the data axis like its cache rows, and a decode or verify step moves
    no row between devices; only a resize (at a bucket change) does. Scalars of
    `max_batch_size` rows beside a cache of B did: every step below the full batch read rows
    [0, B) of arrays split at `max_batch_size`, which resharded them.
    """

    cache: DecodeCache  # per layer: k [B, K, H, S], v [B, K, S, H] (B, S: the current buckets)
    lengths: jax.Array  # [B] int32, tokens in the cache (= position of last_token)
    last_token: jax.Array  # [B] int32, the token fed to the next step
    temperature: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32
    top_p: jax.Array  # [B] float32
    keys: jax.Array  # [B] typed PRNG keys, one stream per request
    draft: DraftState | None = None  # the drafter's cache and features (engines with a drafter)

    @classmethod
    def create(cls, config, batch: int, max_len: int, drafter_config=None) -> DecodeState:
        """Zeros for `batch` slots, caches of `max_len` positions (with `drafter_config`, the
        drafter's too)."""
        draft = None if drafter_config is None else DraftState.create(
            drafter_config, batch, max_len)  # fmt: skip
        return cls(
            cache=DecodeCache.zeros(config, batch, max_len),
            lengths=jnp.zeros((batch,), jnp.int32),
            last_token=jnp.zeros((batch,), jnp.int32),
            temperature=jnp.zeros((batch,), jnp.float32),
            top_k=jnp.zeros((batch,), jnp.int32),
            top_p=jnp.ones((batch,), jnp.float32),
            keys=jax.random.split(jax.random.key(0), batch),
            draft=draft,
        )


# Logical axes of the decode state's other arrays by rank (caches: `KVCache.shardings`): the
# drafter's features [B, D], per-slot scalars [B] (typed PRNG keys included).
_STATE_AXES = {2: ("batch", "embed"), 1: ("batch",)}


def decode_state_shardings(state: DecodeState, mesh, rules) -> DecodeState:
    """`NamedSharding`s of a decode state (arrays or `ShapeDtypeStruct`s) on `mesh`: slots over
    the rules' batch axes, cache heads like the policy's kv heads (so each tensor-parallel
    device holds the K/V of its own heads), features like its activations."""

    def one(x):
        if isinstance(x, DecodeCache):
            return x.shardings(mesh, rules)
        return sharding_lib.named_sharding(x.shape, _STATE_AXES[len(x.shape)], mesh, rules)

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, DecodeCache))


def params_mesh(params) -> jax.sharding.Mesh | None:
    """The mesh of params placed with `NamedSharding`s over more than one device, else None."""
    shardings = {getattr(x, "sharding", None) for x in jax.tree.leaves(params)}
    meshes = {s.mesh for s in shardings if isinstance(s, jax.sharding.NamedSharding)}
    mesh = next(iter(meshes), None) if len(meshes) == 1 else None
    return mesh if mesh is not None and mesh.size > 1 else None


def _step_keys(keys_B: jax.Array, positions_B: jax.Array) -> jax.Array:
    # A request's randomness depends only on its seed and position, not on its batch-mates.
    return jax.vmap(jax.random.fold_in)(keys_B, positions_B)


# ----------------------------------------------------------------------------- programs


def _sharding_signature(args) -> tuple:
    """The partition specs of `args`' arrays (what a compiled program's inputs must match)."""
    return tuple(getattr(getattr(x, "sharding", None), "spec", None)
                 for x in jax.tree.leaves(args))  # fmt: skip


def prefill_program(graphdef, params, drafter_params, state: DecodeState, tokens_UxP,
                    prompt_lens_U, rows_B, slots_B, temperature_B, top_k_B, top_p_B, seeds_B, *,
                    greedy_only: bool, drafter_config=None, filtering: bool = True):  # fmt: skip
    """Runs U distinct prompts (right-padded) once and writes each into the slots that share it.

    Prefix sharing: the requests of a GRPO group have one prompt; slot b takes prompt row
    `rows_B[b]` (its cache, and the logits its first token is sampled from, with its own seed).
    `slots_B` = Bmax marks an unused row (dropped). With a drafter (`drafter_params` not None)
    its state for the slots is built too. The prompts run through the scanned forward (their
    tokens amortize its weight copies); the state's caches must hold the slots and prompts.
    """
    _count_trace("prefill")
    model = nnx.merge(graphdef, params)
    u, p = tokens_UxP.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (u, p))
    features_UxPxD, new = model(tokens_UxP, positions)
    last = jnp.take_along_axis(features_UxPxD, (prompt_lens_U - 1)[:, None, None], axis=1)
    logits_B = model.logits(last)[:, 0][rows_B]
    prompt_lens_B = prompt_lens_U[rows_B]
    keys = jax.vmap(jax.random.key)(seeds_B)
    step_keys = _step_keys(keys, prompt_lens_B)
    # On a mesh each device chooses from its own block of the head's vocabulary (the
    # partitioner gathered the [B, V] logits for the sampler's top-k and cumulative sum).
    tokens, logprobs = sharding_lib.rowwise(choose_tokens, vocab_args=(0,))(
        logits_B, temperature_B, top_k_B, top_p_B, step_keys, greedy_only=greedy_only,
        filtering=filtering,
    )  # fmt: skip
    cache = state.cache.write_prompts(slots_B, rows_B, new)

    def put(arr, values):
        return arr.at[slots_B].set(values, mode="drop")

    draft = state.draft
    if drafter_params is not None:
        draft = speculative.prefill_drafter(
            drafter_params, drafter_config, model.embed.get_value(), draft, tokens_UxP,
            features_UxPxD, prompt_lens_U, rows_B, tokens, slots_B,
        )  # fmt: skip
    state = DecodeState(
        cache=cache,
        lengths=put(state.lengths, prompt_lens_B),
        last_token=put(state.last_token, tokens),
        temperature=put(state.temperature, temperature_B),
        top_k=put(state.top_k, top_k_B),
        top_p=put(state.top_p, top_p_B),
        keys=put(state.keys, keys),
        draft=draft,
    )
    return state, tokens, logprobs


def decode_inputs(graphdef, params, state: DecodeState, *, batch: int) -> ForwardInputs:
    """A decode step's layer inputs: slots [0, batch)'s last tokens embedded at their
    lengths, attending to the cache below them."""
    model = nnx.merge(graphdef, params)
    lengths = state.lengths[:batch]
    x = model.embed_tokens(state.last_token[:batch, None])
    return x, lengths[:, None], causal_mask(batch, 1), lengths


def decode_outputs(graphdef, params, state: DecodeState, drafter_params, x_Bx1xD, *,
                   batch: int, greedy_only: bool, drafter_config=None,
                   attention_impl: str = "xla", filtering: bool = True):  # fmt: skip
    """A decode step after the layers: head, token choice, the state's scalars and (eager
    drafter sync) the drafter's pair. Leaves `state.cache` alone (None in layered steps)."""
    model = nnx.merge(graphdef, params)
    lengths = state.lengths[:batch]
    features = final_features(model, x_Bx1xD)
    logits = model.logits(features)[:, 0]
    # Rows are slots: on a mesh each device chooses its own slots' tokens from its own block of
    # the vocabulary where the head splits it.
    tokens, logprobs = sharding_lib.rowwise(choose_tokens, vocab_args=(0,))(
        logits, state.temperature[:batch], state.top_k[:batch], state.top_p[:batch],
        _step_keys(state.keys[:batch], lengths + 1), greedy_only=greedy_only,
        filtering=filtering,
    )  # fmt: skip
    draft = state.draft
    if drafter_params is not None:
        draft = speculative.extend_drafter(
            drafter_params, drafter_config, model.embed.get_value(), draft, tokens[:, None],
            features, lengths, jnp.ones_like(lengths), batch=batch,
            attention_impl=attention_impl,
        )  # fmt: skip
    state = state.replace(
        lengths=state.lengths.at[:batch].add(1),
        last_token=state.last_token.at[:batch].set(tokens),
        draft=draft,
    )
    return state, tokens, logprobs


def decode_program(graphdef, params, layers, state: DecodeState, drafter_params=None, *,
                   batch: int, kv_len: int, greedy_only: bool, drafter_config=None,
                   attention_impl: str = "xla", filtering: bool = True):  # fmt: skip
    """One token for slots [0, batch) attending to cache positions [0, kv_len): the state's
    caches are exactly that size (`DecodeState.cache`), `layers` the policy's per-layer weights.

    With `drafter_params` (eager drafter sync; every slot's drafter in sync) the drafter also
    appends the step's pair (new token, feature of the fed token), staying in sync. One
    program: `decode_inputs`, the layers (`block_program`), `decode_outputs`; a layered engine
    runs the three as programs of their own.
    """
    _count_trace("decode")
    for cache in [state.cache] + ([] if state.draft is None else [state.draft.cache]):
        cache.check_size(batch, kv_len)
    model_config = nnx.merge(graphdef, params).config
    inputs = decode_inputs(graphdef, params, state, batch=batch)
    x, _, cache = block_program(layers, state.cache, *inputs, config=model_config, write=True)
    state, tokens, logprobs = decode_outputs(
        graphdef, params, state, drafter_params, x, batch=batch, greedy_only=greedy_only,
        drafter_config=drafter_config, attention_impl=attention_impl, filtering=filtering,
    )  # fmt: skip
    return state.replace(cache=cache), tokens, logprobs


def resize_program(state: DecodeState, *, config, drafter_config, batch: int, kv_len: int,
                   shardings=None) -> DecodeState:  # fmt: skip
    """`state` moved to `batch` slots x `kv_len` positions: the caches (the target's and the
    drafter's) keep their overlap, the per-slot arrays their first rows (new slots zero);
    `shardings` (a `DecodeState` of shardings, or None) keeps a sharded state so."""
    _count_trace("resize")

    def rows(x, zeros):
        return jax.lax.dynamic_update_slice_in_dim(zeros, x[: min(len(x), len(zeros))], 0, 0)

    blank = without_caches(DecodeState.create(config, batch, 1, drafter_config))
    out = jax.tree.map(rows, without_caches(state), blank)
    out = out.replace(cache=state.cache.resized(batch, kv_len))
    if state.draft is not None:
        out = out.replace(draft=out.draft.replace(cache=state.draft.cache.resized(batch, kv_len)))
    if shardings is None:
        return out
    return jax.tree.map(jax.lax.with_sharding_constraint, out, shardings)


def fresh_program(*, config, drafter_config, batch: int, kv_len: int,
                  shardings=None) -> DecodeState:  # fmt: skip
    """A zero state of `batch` slots x `kv_len` positions: nothing is live when a rollout
    starts, so nothing is copied, and the program depends on the new size alone."""
    _count_trace("fresh")
    state = DecodeState.create(config, batch, kv_len, drafter_config)
    if shardings is None:
        return state
    return jax.tree.map(jax.lax.with_sharding_constraint, state, shardings)


def move_program(state: DecodeState, src, dst, *, mesh: jax.sharding.Mesh | None = None,
               specs=None):  # fmt: skip
    """Copies slot `src` (its cache rows and scalars) into slot `dst`.

    On a `mesh` (`specs`: the state's partition specs), each device moves rows of its own
    shard: the source row reaches the devices in one all-reduce (`_move_local`). Left to
    the SPMD partitioner, the dynamic row index all-gathered every layer's whole cache onto
    every device, for each move (at a 7B preset's rollout batch, gigabytes per layer).
    """
    _count_trace("move_slot")
    if mesh is not None:
        return jax.shard_map(
            functools.partial(_move_local, specs=specs), mesh=mesh,
            in_specs=(specs, PartitionSpec(), PartitionSpec()), out_specs=specs,
            check_vma=False,
        )(state, src, dst)  # fmt: skip

    return jax.tree.map(lambda x: move_row(x, src, dst), state)


def _move_local(state: DecodeState, src, dst, *, specs) -> DecodeState:
    """`move_program` on one device's shard of every array (inside `shard_map`)."""

    def move(x, spec):
        axes = spec[0] if len(spec) else None
        if axes is None:  # slots replicated (a slot count the mesh does not divide)
            return jax.lax.dynamic_update_index_in_dim(
                x, jax.lax.dynamic_index_in_dim(x, src, 0, keepdims=True), dst, 0)  # fmt: skip
        rows = x.shape[0]  # this device holds slots [device * rows, (device + 1) * rows)
        keys = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        local = jax.random.key_data(x) if keys else x
        device = jax.lax.axis_index(axes)
        row = jax.lax.dynamic_index_in_dim(local, src % rows, 0, keepdims=True)
        # One row reaches every device: the owner's, the others add zeros (an all-gather of
        # each device's candidate row would send a row per device: 64 on a 64-way axis).
        row = jax.lax.psum(jnp.where(device == src // rows, row, jnp.zeros_like(row)), axes)
        here = device == dst // rows
        kept = jax.lax.dynamic_index_in_dim(local, dst % rows, 0, keepdims=True)
        local = jax.lax.dynamic_update_index_in_dim(local, jnp.where(here, row, kept),
                                                    dst % rows, 0)  # fmt: skip
        return jax.random.wrap_key_data(local, impl=jax.random.key_impl(x)) if keys else local

    return jax.tree.map(move, state, specs)


# ----------------------------------------------------------------------------- engine


@dataclasses.dataclass
class _Pending:
    """A plain decode step dispatched and not yet read."""

    running: list  # the slots' requests when it was dispatched (slot i: running[i])
    tokens: jax.Array
    logprobs: jax.Array
    eager: bool  # it also extended the drafters
    dispatched: float
    compiles: int  # the engine's compile count before its dispatch


@dataclasses.dataclass
class _Running:
    index: int
    request: Request
    completion: Completion
    draft_len: int = 0  # positions the drafter has seen (in sync when = the cache length)

    @property
    def cache_len(self) -> int:
        """Tokens in the target cache: all but the pending last one."""
        return len(self.request.prompt_ids) + len(self.completion.token_ids) - 1


class RolloutEngine:
    """Generates completions for many requests with continuous batching.

    The engine owns the decode state and uses an executable pool; the policy's weights are a
    separate pytree swapped through `update_params` (checked: same structure, shapes, dtypes
    and shardings), so a weight sync never recompiles. So are the drafter's
    (`update_drafter_params`).
    """

    def __init__(self, model: Transformer, config: EngineConfig = EngineConfig(),
                 drafter: Drafter | None = None,
                 hot_token_ids: Sequence[int] | np.ndarray | None = None, *,
                 step_policy: StepPolicy | None = None, pool: ProgramPool | None = None,
                 ngram_index=None):  # fmt: skip
        """
        Args:
          model: the policy.
          config: static sizes and the SD settings.
          drafter: an EAGLE drafter of this policy (needed for EAGLE and hybrid drafts).
          hot_token_ids: optional hot vocabulary for drafting (`set_hot_token_ids`).
          step_policy: what each decode step runs (default: `config.spec_strategy` with the
            drafter whenever at most `config.spec_max_batch` requests run, else plain).
          pool: the executable pool to compile into (default: the engine's own).
          ngram_index: the model-free draft index (default: a fresh `NgramIndex` when the step
            policy can choose n-gram or hybrid drafts).
        """
        self.model_config = model.config
        self.config = config
        if config.max_seq_len > model.config.max_position_embeddings:
            raise ValueError(
                f"engine.max_seq_len={config.max_seq_len} exceeds the model's "
                f"max_position_embeddings={model.config.max_position_embeddings}"
            )
        if config.spec_strategy is not None and drafter is None:
            raise ValueError(f"engine.spec_strategy={config.spec_strategy} needs a drafter; "
                             "pass RolloutEngine(model, config, drafter=...)")  # fmt: skip
        if drafter is not None:
            check_drafter_fits(model.config, drafter.config)
        self.drafter_config = None if drafter is None else drafter.config
        self.drafter_params = None if drafter is None else drafter.params_dict()
        self.graphdef, self.params = nnx.split(model)  # also sets `layers`
        self.stats = EngineStats()
        self.pool = pool if pool is not None else ProgramPool()
        self._options = compile_options(config.xla_opt_level, jax.default_backend())
        # What the programs compile in beyond a key's shapes ends every pool key (`_pool_key`),
        # built once here: the model's and drafter's configs and the SD attention path (a
        # digest), then the XLA options where set. Engines that share a pool then never run
        # each other's programs; identically configured ones (rollout slices) share them.
        made_of = repr((model.config, self.drafter_config, config.spec_attention_impl))
        identity = "model:" + hashlib.sha256(made_of.encode()).hexdigest()[:8]
        options = sorted((self._options or {}).items())
        xla = ("xla:" + ",".join(f"{k}={v}" for k, v in options),) if options else ()
        self._key_suffix = (identity, *xla)
        self.ngram = ngram_index
        self._policy: StepPolicy = PlainPolicy()
        self.hot_token_ids = None
        if step_policy is None and drafter is not None and config.spec_strategy is not None:
            step_policy = FixedPolicy(StepChoice(config.spec_strategy, "eagle"),
                                      config.spec_max_batch)  # fmt: skip
        self.step_policy = step_policy if step_policy is not None else PlainPolicy()
        if hot_token_ids is not None:
            self.set_hot_token_ids(hot_token_ids)
        block = config.layers_per_program
        if block is None:  # a few unrolled layers compile quickly: nothing to save there
            cpu = jax.default_backend() == "cpu"
            block = 1 if cpu and model.config.num_layers >= LAYERED_MIN_LAYERS else 0
        # None: every step is one program (all layers unrolled in it).
        self.forward = (LayeredForward(model.config, block, self._program)
                        if 0 < block < model.config.num_layers else None)  # fmt: skip
        self._layered_steps: dict[tuple, int] = {}
        self._one_program_keys: set[tuple] = set()  # promoted: never looked up again
        self._steady = False  # `one_program_steps`
        self.spec = SpecRunner(config, self.graphdef, self.drafter_config, self.stats,
                               self._program, self.ngram, self.forward,
                               self._one_program)  # fmt: skip
        # Caches start at one slot and the smallest kv bucket; `_fit_cache` sizes them.
        self.state = DecodeState.create(model.config, 1, config.kv_buckets[0],
                                        self.drafter_config)  # fmt: skip
        self._mesh = params_mesh(self.params)
        if self._mesh is not None:  # the policy is sharded: so is the state (never replicated)
            self.state = jax.device_put(self.state, self._state_shardings(self.state))

    # -- step policy and drafts ------------------------------------------------------------

    @property
    def step_policy(self) -> StepPolicy:
        return self._policy

    @step_policy.setter
    def step_policy(self, policy: StepPolicy) -> None:
        """Sets what decode steps run; checks this engine can run every choice it may make."""
        choices = list(policy.choices())
        for choice in choices:
            if choice.needs_drafter and self.drafter_params is None:
                raise ValueError(f"step policy choice {choice} needs a drafter; this engine has "
                                 "none (RolloutEngine(model, config, drafter=...))")  # fmt: skip
        topk = max((c.strategy.topk for c in choices if c.needs_drafter), default=0)
        if self.hot_token_ids is not None and self.hot_token_ids.shape[0] < topk:
            raise ValueError(f"step policy needs topk={topk} > the hot vocabulary size "
                             f"{self.hot_token_ids.shape[0]}")  # fmt: skip
        if any(c.needs_ngram for c in choices) and self.ngram is None:
            from tlt_jax.rollout.ngram import NgramIndex

            self.ngram = NgramIndex()
            if hasattr(self, "spec"):
                self.spec.ngram = self.ngram
        self._policy = policy

    def set_hot_token_ids(self, hot_token_ids) -> None:
        """Drafts among these token ids only (None: the full vocabulary).

        The draft levels' LM head becomes the live head's columns of these U tokens (see
        `tlt_jax.drafter.hot_vocab`); verification keeps the full vocabulary, so outputs are
        unchanged. A new size compiles new draft programs; new ids of the same size do not.

        Raises:
          ValueError: if the ids are not a 1-D list of distinct ids in [0, vocab) with at
            least the step policy's largest EAGLE top-k entries.
        """
        topk = max((c.strategy.topk for c in self.step_policy.choices() if c.needs_drafter),
                   default=1)  # fmt: skip
        self.hot_token_ids = check_hot_token_ids(hot_token_ids, self.model_config.vocab_size,
                                                 topk)  # fmt: skip
        self._hot_head = None  # sliced for these ids by the next draft (`_hot_vocab`)

    def _hot_vocab(self) -> tuple[jax.Array, jax.Array] | None:
        """(hot ids [U], the live head's columns of them [D, U]) for draft steps, or None.

        The columns are sliced once per weight sync (and per new ids), not in every draft
        step: sliced in the step, they cost it 1.4-2.6 ms on this CPU (SmolLM2, U = 2,048,
        batch 1-16; a batch-1 depth-4 chain drafts in 2.4 ms instead of 3.9), and on a
        vocabulary-sharded head a collective per step.
        """
        if self.hot_token_ids is None:
            return None
        if self._hot_head is None:
            fn = functools.partial(speculative.hot_head_program, self.graphdef)
            args = (self.params, self.hot_token_ids)
            key = ("hot_head", self.hot_token_ids.shape[0])
            self._hot_head = self._program(key, fn, *args)(*args)
        return self.hot_token_ids, self._hot_head

    def update_drafter_params(self, params) -> None:
        """Swaps in new drafter weights (`Drafter.params_dict()` layout), checked like the
        policy's (structure, shapes, dtypes, shardings).

        Drafter caches of running requests keep what the old weights computed; later SD steps
        extend them with the new weights (speculation stays lossless either way).
        """
        from tlt_jax.rl.weight_sync import check_compatible

        if self.drafter_params is None:
            raise ValueError("update_drafter_params: this engine was built without a drafter")
        check_compatible(self.drafter_params, params)
        self.drafter_params = params

    # -- weights ---------------------------------------------------------------------------

    @property
    def params(self) -> nnx.State:
        """The policy's weights (stacked layers, as the trainer holds them)."""
        return self._params

    @params.setter
    def params(self, params: nnx.State) -> None:
        """Sets the weights and their per-layer copy `layers`, which decode steps read
        (`tlt_jax.models.decode`: one copy of the layer weights per weight sync)."""
        self._params = params
        self._hot_head = None  # the draft head's hot columns come from these weights
        stacked = nnx.merge(self.graphdef, params).layers.stacked()
        shardings = layer_shardings(stacked)
        if getattr(self, "_unstack_shardings", None) != shardings:  # compiled once per placement
            self._unstack = jax.jit(unstack_layers, out_shardings=shardings)
            self._unstack_shardings = shardings
        self.layers = self._unstack(stacked)

    def update_params(self, params: nnx.State) -> None:
        """Swaps in new policy weights after checking they match the compiled programs."""
        from tlt_jax.rl.weight_sync import check_compatible

        check_compatible(self.params, params)
        self.params = params

    # -- executable pool -------------------------------------------------------------------

    def _pool_key(self, key: tuple) -> tuple:
        """`key` as the pool holds it: with what this engine's programs are made of (model,
        drafter, SD attention path) and the XLA compile options it compiles with, so engines
        of other configs or `xla_opt_level`s sharing a pool never run each other's programs
        (the key's own fields stay where its readers look, in front)."""
        return (*key, *self._key_suffix)

    def _program(self, key: tuple, fn: Callable, *args, donate: tuple[int, ...] = ()):
        key = self._pool_key(key)
        if self._mesh is not None:
            # A compiled program takes its arguments in the shardings it was compiled for, and
            # on a mesh one program's output need not match the next one's input (a layer
            # block's activations come from the step's inputs program first, from the block
            # before after): each sharding of a key compiles a program of its own.
            key = (*key, _sharding_signature(args))
        if key in self.pool:
            return self.pool.get(key, fn, lambda: args, donate)  # compiled: no options needed
        before = self.pool.compile_seconds
        # On a mesh, row-independent math (token choice, tree acceptance) runs on each
        # device's own slots: no collective over the batch (`sharding.rowwise`).
        rows = contextlib.nullcontext()
        if self._mesh is not None:
            rows = sharding_lib.rows_per_device(self._mesh)
            fn = functools.partial(fn)  # a fresh trace: jit's trace cache ignores the context
        with rows:
            program = self.pool.get(key, fn, lambda: args, donate, sharded=False,
                                    options=self._options)  # fmt: skip
        self.stats.compile_seconds += self.pool.compile_seconds - before
        self.stats.compile_count += 1
        return program

    def _one_program(self, key: tuple) -> bool:
        """Whether the step whose one-program key is `key` runs as that program: always
        without a layered forward, and with one once the key was compiled or has run
        `one_program_after` layered steps (then it compiles); else the step runs layered
        and is counted."""
        if self.forward is None or self._steady or key in self._one_program_keys:
            return True
        steps = self._layered_steps.get(key, 0)
        after = self.config.one_program_after
        if (after and steps >= after) or self._compiled_as_one(key):
            self._one_program_keys.add(key)
            return True
        self._layered_steps[key] = steps + 1
        return False

    def _compiled_as_one(self, key: tuple) -> bool:
        """Whether the pool holds the one program of `key` (compiled by this engine or by
        another one sharing the pool, e.g. under `one_program_steps`). On a mesh the pool's
        keys end with the arguments' sharding signature (`_program`), which a step only
        knows once it has built its arguments: any signature counts (a scan of the pool's
        keys, so `_one_program` asks only until the key is promoted)."""
        pool_key = self._pool_key(key)
        if self._mesh is None:
            return pool_key in self.pool
        n = len(pool_key)
        return any(len(k) == n + 1 and k[:n] == pool_key for k in self.pool.keys())

    def holds(self, key: tuple) -> bool:
        """Whether the shared pool holds this engine's program of `key` (its own fields, as
        the engine builds them: the pool's key adds what the programs are made of)."""
        return self._compiled_as_one(key)

    @contextlib.contextmanager
    def one_program_steps(self):
        """Inside, every decode and verify step runs as one program (the engine's steady
        state), however few steps its bucket has run: for timing steps (calibration)."""
        saved, self._steady = self._steady, True
        try:
            yield self
        finally:
            self._steady = saved

    def decode_sizes(self) -> set[tuple[int, int]]:
        """(batch, kv) buckets of the plain decode steps compiled so far, in either form (one
        program, keyed "decode", or layer blocks writing one token, keyed "layers")."""
        sizes = set()
        for key in self.pool.keys():
            if key[0] == "decode":
                sizes.add((key[1], key[2]))
            elif key[0] == "layers" and key[3] == 1 and key[5]:  # (.., b, t, s, write, impl)
                sizes.add((key[2], key[4]))
        return sizes

    # -- cache size ------------------------------------------------------------------------

    def _state_shardings(self, state):
        return decode_state_shardings(state, self._mesh, sharding_lib.rules_for("rollout"))

    def _kv_margin(self) -> int:
        """Cache positions a step may write past the longest running request: one for a plain
        step, a tree's verify tokens for SD (every step kind shares one kv bucket)."""
        return max([1] + [c.strategy.verify_tokens for c in self.step_policy.choices()])

    def _fit_cache(self, slots: int, positions: int, *, shrink_slots: bool,
                   fresh: bool = False) -> None:  # fmt: skip
        """Resizes the caches to hold `slots` slots and `positions` positions, in buckets.

        They grow at once. The slots shrink with the batch bucket, but only when `shrink_slots`
        (no request waits to be admitted, so the batch only falls), the positions only once
        two buckets fewer do: a batch or context at a bucket's edge never resizes back and
        forth. A resize copies the live part of the cache (rare: at bucket changes). `fresh`
        (no request is live: a rollout starts) fits both exactly, with zero caches: a rollout
        that inherited the last one's long tail would otherwise decode its whole batch over
        the tail's context, and compile programs for those sizes.
        """
        cfg = self.config
        cache = self.state.cache
        b = bucket_for(min(slots, cfg.max_batch_size), cfg.batch_buckets)
        s = bucket_for(min(positions, cfg.max_seq_len), cfg.kv_buckets)
        if not fresh:
            if b < cache.batch and not (shrink_slots and 2 * b <= cache.batch):
                b = cache.batch
            if s < cache.length and 4 * s > cache.length:
                s = cache.length
        if (b, s) == (cache.batch, cache.length):
            return
        if fresh:  # zero caches from a program keyed by the new size alone
            fn = functools.partial(fresh_program, config=self.model_config, batch=b, kv_len=s,
                                   drafter_config=self.drafter_config)  # fmt: skip
            key, args = ("fresh", b, s), ()
        else:  # the live part copied
            fn = functools.partial(resize_program, config=self.model_config, batch=b, kv_len=s,
                                   drafter_config=self.drafter_config)  # fmt: skip
            key, args = ("resize", cache.batch, cache.length, b, s), (self.state,)
        if self._mesh is not None:
            fn = functools.partial(fn, shardings=self._state_shardings(jax.eval_shape(fn, *args)))
        self.state = self._program(key, fn, *args)(*args)  # new shapes: no donation

    def _run_prefill(self, batch: list[_Running], slots: list[int], running: list[_Running],
                     admitting: int = 0) -> tuple[np.ndarray, ...]:  # fmt: skip
        """Prefills `batch` into `slots`, each distinct prompt once (`prefill_program`); the
        cache holds at least `admitting` slots (the running and admitted requests)."""
        cfg = self.config
        longest = max([len(r.request.prompt_ids) for r in batch] + [r.cache_len for r in running])
        self._fit_cache(max(slots[-1] + 1, admitting), longest + self._margin, shrink_slots=False,
                        fresh=not running)  # fmt: skip
        rows: dict[tuple[int, ...], int] = {}
        for run in batch:
            rows.setdefault(run.request.prompt_ids, len(rows))
        u = bucket_for(len(rows), cfg.prefill_batch_buckets)
        b = bucket_for(len(batch), cfg.batch_buckets)
        p = bucket_for(max(len(prompt) for prompt in rows), cfg.prompt_buckets)
        tokens = np.zeros((u, p), np.int32)
        lens = np.ones((u,), np.int32)
        for prompt, row in rows.items():
            tokens[row, : len(prompt)] = prompt
            lens[row] = len(prompt)
        row_ids = np.zeros((b,), np.int32)
        slot_ids = np.full((b,), cfg.max_batch_size, np.int32)  # out of range: dropped
        temperature = np.zeros((b,), np.float32)
        top_k = np.zeros((b,), np.int32)
        top_p = np.ones((b,), np.float32)
        seeds = np.zeros((b,), np.uint32)
        for i, (run, slot) in enumerate(zip(batch, slots, strict=True)):
            row_ids[i], slot_ids[i] = rows[run.request.prompt_ids], slot
            s = run.request.sampling
            temperature[i], top_k[i], top_p[i] = s.temperature, s.top_k, s.top_p
            seeds[i] = np.uint32(run.request.seed)
        greedy = bool(np.all(temperature[: len(batch)] == 0))
        filtering = needs_filtering(run.request.sampling for run in batch)
        args = (self.params, self.drafter_params, self.state, tokens, lens, row_ids, slot_ids,
                temperature, top_k, top_p, seeds)  # fmt: skip
        fn = functools.partial(prefill_program, self.graphdef, greedy_only=greedy,
                               drafter_config=self.drafter_config, filtering=filtering)  # fmt: skip
        cache = self.state.cache
        key = ("prefill", b, u, p, greedy, cache.batch, cache.length, filtering)
        program = self._program(key, fn, *args, donate=(2,))
        self.state, next_tokens, logprobs = program(*args)
        self.stats.prefill_steps += 1
        if self.drafter_params is not None:
            for run in batch:
                run.draft_len = len(run.request.prompt_ids)
        return np.asarray(next_tokens), np.asarray(logprobs)

    def _dispatch_decode(self, running: list[_Running]) -> _Pending:
        """Dispatches one plain decode step for `running` (read later by `_read_decode`)."""
        cfg = self.config
        b, s = self.state.cache.batch, self.state.cache.length  # fitted by generate()
        greedy = all(r.request.sampling.greedy for r in running)
        filtering = needs_filtering(r.request.sampling for r in running)
        # Eager sync only extends drafters that are in sync (a lagging one is caught up by
        # the next SD step as in lazy mode).
        eager = (self.drafter_params is not None and cfg.drafter_sync == "eager"
                 and all(r.draft_len == r.cache_len for r in running))  # fmt: skip
        compiles = self.stats.compile_count
        dispatched = time.perf_counter()
        key = ("decode", b, s, greedy, eager, filtering)
        if self._one_program(key):
            fn = functools.partial(decode_program, self.graphdef, batch=b, kv_len=s,
                                   greedy_only=greedy, drafter_config=self.drafter_config,
                                   attention_impl=cfg.spec_attention_impl,
                                   filtering=filtering)  # fmt: skip
            args = (self.params, self.layers, self.state, self.drafter_params if eager else None)
            program = self._program(key, fn, *args, donate=(2,))
            self.state, tokens, logprobs = program(*args)
        else:  # inputs, the layer blocks, outputs: programs of their own
            fn = functools.partial(decode_inputs, self.graphdef, batch=b)
            args = (self.params, without_caches(self.state))
            inputs = self._program(("decode_inputs", b), fn, *args)(*args)
            x, _, cache = self.forward(self.layers, self.state.cache, inputs, write=True)
            fn = functools.partial(decode_outputs, self.graphdef, batch=b, greedy_only=greedy,
                                   drafter_config=self.drafter_config,
                                   attention_impl=cfg.spec_attention_impl,
                                   filtering=filtering)  # fmt: skip
            args = (self.params, self.state.replace(cache=None),
                    self.drafter_params if eager else None, x)  # fmt: skip
            # (the drafter's cache, if any, is the step's size too)
            key = ("decode_outputs", b, greedy, eager, draft_length(self.state), filtering)
            program = self._program(key, fn, *args, donate=(1,))
            state, tokens, logprobs = program(*args)
            self.state = state.replace(cache=cache)
        self.stats.decode_steps += 1
        return _Pending(list(running), tokens, logprobs, eager, dispatched, compiles)

    def _read_decode(self, step: _Pending) -> int:
        """Reads a plain step's tokens and emits them to the requests that were still running
        (a request that finished at the step before gets none); returns the tokens emitted."""
        tokens, logprobs = np.asarray(step.tokens), np.asarray(step.logprobs)
        emitted = 0
        for i, run in enumerate(step.running):
            if run.completion.finish_reason:
                continue
            self._emit(run, int(tokens[i]), float(logprobs[i]))
            emitted += 1
            if step.eager:
                run.draft_len = run.cache_len  # the drafter took the step's pair too
        return emitted

    def _move(self, src: int, dst: int) -> None:
        cache = self.state.cache
        src_a, dst_a = np.int32(src), np.int32(dst)
        fn = move_program
        if self._mesh is not None:
            specs = jax.tree.map(lambda x: x.sharding.spec, self.state)
            fn = functools.partial(move_program, mesh=self._mesh, specs=specs)
        program = self._program(("move", cache.batch, cache.length), fn, self.state, src_a,
                                dst_a, donate=(0,))  # fmt: skip
        self.state = program(self.state, src_a, dst_a)

    # -- generation ------------------------------------------------------------------------

    def validate(self, requests: Sequence[Request]) -> None:
        """Checks every request against the engine's sizes (before anything compiles)."""
        check_requests(requests, self.config.max_seq_len, self.model_config.vocab_size)

    def generate(self, requests: Sequence[Request], *, progress: bool | None = None
                 ) -> list[Completion]:  # fmt: skip
        """Runs all requests to completion; returns completions in input order.

        Args:
          requests: the requests; validated before any device work.
          progress: show a progress bar (default: when stderr is a terminal).
        """
        self.validate(requests)
        cfg = self.config
        start = time.perf_counter()
        queue = deque(
            _Running(i, r, Completion(i, r.prompt_ids, [], [], submit_time=start))
            for i, r in enumerate(requests)
        )  # fmt: skip
        running: list[_Running] = []  # slot i holds running[i]
        done: list[Completion | None] = [None] * len(requests)
        bar = _progress_bar(len(requests), progress)
        self.stats.timeline = []
        policy = self.step_policy
        policy.begin()
        self._margin = self._kv_margin()
        if self.ngram is not None:  # an interrupted generate() leaves its requests live
            self.ngram.finish_all(keep=False)
        pending: _Pending | None = None  # a plain step dispatched, not yet read
        last_read, last_compile_s = start, self.stats.compile_seconds

        def settle(choice, n: int, emitted: int, began: float, compiled: bool) -> None:
            """A step's tokens are emitted: reward the policy, log it, retire what finished."""
            nonlocal running, last_read, last_compile_s
            now = time.perf_counter()
            if not compiled:  # a step that compiled is no reward
                policy.record(choice, n, emitted, now - began)
            last_read = now
            compile_s, last_compile_s = (self.stats.compile_seconds - last_compile_s,
                                         self.stats.compile_seconds)  # fmt: skip
            self.stats.timeline.append((now - start, n, arm_name(choice), compile_s))
            running = self._retire(running, done, now, bar)

        def read(step: _Pending) -> None:
            # Its time starts when it was dispatched or when the step before it was read, and
            # ends now: it holds whatever compiled since its dispatch (overlapped: the next
            # step's decode, cache resize or slot moves), so then it is no reward either.
            began = max(step.dispatched, last_read)
            compiled = self.stats.compile_count != step.compiles
            settle(None, len(step.running), self._read_decode(step), began, compiled)

        while queue or running:
            # Admit queued requests into free slots, one prefill per group (no step is in
            # flight while requests wait: `overlap_host` needs an empty queue).
            while queue and len(running) < cfg.max_batch_size:
                # Up to max_prefill_batch distinct prompts per prefill, into any free slots.
                room = cfg.max_batch_size - len(running)
                batch, prompts = [], set()
                while queue and len(batch) < room:
                    prompt = queue[0].request.prompt_ids
                    if prompt not in prompts and len(prompts) == cfg.max_prefill_batch:
                        break
                    prompts.add(prompt)
                    batch.append(queue.popleft())
                slots = list(range(len(running), len(running) + len(batch)))
                # The cache is sized once for every request this admission round takes (not
                # grown prefill by prefill: each size would compile its own prefill program).
                admitting = min(cfg.max_batch_size, len(running) + len(batch) + len(queue))
                tokens, logprobs = self._run_prefill(batch, slots, running, admitting)
                now = time.perf_counter()
                for run, tok, lp in zip(batch, tokens, logprobs, strict=False):
                    run.completion.first_token_time = now
                    running.append(run)
                    if self.ngram is not None:
                        self.ngram.start(run.index, run.request.prompt_ids,
                                         run.request.prompt_ids)  # fmt: skip
                    self._emit(run, int(tok), float(lp))
                running = self._retire(running, done, now, bar)
            if not running:
                continue
            # The step in flight is read first when the policy may plan an SD step (which
            # needs the settled batch, and is chosen at its size), also at the batch left once
            # the requests it ends by length are gone (the synchronous engine chooses there: a
            # plain step dispatched ahead would decide positions its SD step decides, and
            # sampled tokens would differ), and when it is every running request's last.
            if pending is not None:
                staying = sum(not _ends_at_next_token(r) for r in running)
                if (staying == 0 or policy.may_speculate(len(running))
                        or policy.may_speculate(staying)):  # fmt: skip
                    read(pending)
                    pending = None
                    if not running:
                        continue
            choice = policy.choose(len(running))
            if choice is not None and pending is not None:
                raise RuntimeError(f"step policy {type(policy).__name__} chose {choice} at "
                                   f"{len(running)} running requests after may_speculate "
                                   "said it would not")  # fmt: skip
            # A step in flight has not entered its token in any cache_len yet.
            max_len = max(r.cache_len for r in running) + (pending is not None)
            self._fit_cache(len(running), max_len + self._margin, shrink_slots=not queue)
            if choice is None:
                step = self._dispatch_decode(running)
                if pending is not None:
                    read(pending)  # while `step` runs
                pending = step
                if not (cfg.overlap_host and not queue):
                    read(pending)
                    pending = None
                continue
            compiled, catchup = self.stats.compile_count, self.stats.spec_switch_seconds
            dispatched = time.perf_counter()
            emitted = self._spec_step(running, choice)
            # The drafter's catch-up (lazy sync) is no part of the arm's reward: it is the plain
            # steps' deferred drafter upkeep (eager sync pays it in their step time) and grows
            # with how many ran, so it would rate the SD arm by the policy's own history:
            # counted in, with BENCHMARKS.md's batch-1 switch costs, a simulated bandit kept
            # plain where SD ran 1.5x faster (a dominated arm is retried rarely, after ever
            # longer plain runs, so ever dearer catch-ups).
            began = dispatched + self.stats.spec_switch_seconds - catchup
            settle(choice, len(running), emitted, began, self.stats.compile_count != compiled)
        if bar is not None:
            bar.close()
        return done  # type: ignore[return-value]

    def _spec_step(self, running: list[_Running], choice: StepChoice) -> int:
        """One SD step; emits each request's accepted run (trimmed at its stop tokens and
        `max_new_tokens`); returns the tokens it emitted (the bandit's reward: a plain step's
        counts only its emitted tokens too; the acceptance counters keep the untrimmed runs)."""
        self.state, result = self.spec.step(
            choice,
            self.params,
            self.layers,
            self.drafter_params,
            self._hot_vocab() if choice.needs_drafter else None,
            self.state,
            running,
        )
        emitted = 0
        for i, run in enumerate(running):
            count = int(result.counts[i])
            run.completion.accepted_lengths.append(count)
            for j in range(count):
                self._emit(run, int(result.tokens[i, j]), float(result.logprobs[i, j]))
                emitted += 1
                if run.completion.finish_reason:
                    break  # the rest of the run is dropped with the finished request
            run.draft_len = run.cache_len
        return emitted

    def _emit(self, run: _Running, token: int, logprob: float) -> None:
        comp = run.completion
        if self.ngram is not None:
            self.ngram.extend(run.index, (token,))
        comp.token_ids.append(token)
        comp.logprobs.append(logprob)
        self.stats.generated_tokens += 1
        if token in run.request.stop_ids:
            comp.finish_reason = "stop"
        elif len(comp.token_ids) >= run.request.max_new_tokens:
            comp.finish_reason = "length"

    def _retire(self, running, done, now, bar) -> list[_Running]:
        """Removes finished requests, moving the last live slot into each hole (finished
        requests at the end leave first: a GRPO group often finishes together, and each move
        copies a slot's row of every layer's cache)."""

        def finish(run: _Running) -> None:
            run.completion.finish_time = now
            done[run.index] = run.completion
            if self.ngram is not None:
                self.ngram.finish(run.index)

        retired = 0
        i = 0
        while i < len(running):
            if not running[i].completion.finish_reason:
                i += 1
                continue
            finish(running[i])
            while len(running) - 1 > i and running[-1].completion.finish_reason:
                finish(running.pop())
                retired += 1
            last = len(running) - 1
            if i != last:
                self._move(last, i)
                running[i] = running[last]
            running.pop()
            retired += 1
        if bar is not None and retired:
            bar.update(retired)
            bar.set_postfix(tokens=self.stats.generated_tokens, running=len(running))
        return running


def _ends_at_next_token(run: _Running) -> bool:
    """Whether the request's next token is its last by length (a stop token is not known)."""
    return len(run.completion.token_ids) + 1 >= run.request.max_new_tokens


def _progress_bar(total: int, progress: bool | None):
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="rollout", unit="req", dynamic_ncols=True)
