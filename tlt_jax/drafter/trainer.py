"""Drafter training: typed config, train state, jitted EAGLE step.

Only the drafter's own parameters (fc and its one layer), the optimizer state and the step are
trained and checkpointed (`tlt_jax.checkpointing.DrafterCheckpointer`); the policy's embedding
and LM head enter every step as frozen inputs (no gradient) and are never saved with it (TLT's
"selective" checkpoints).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh

from tlt_jax.drafter.data import DrafterBatch, DrafterBuffer
from tlt_jax.drafter.loss import EagleInputs, eagle_inputs, eagle_loss
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import Drafter, DrafterParams, drafter_config, drafter_forward
from tlt_jax.models.transformer import KVCache, NewKV, segment_causal_mask
from tlt_jax.optim import OptimConfig
from tlt_jax.parallel import sharding as sharding_lib

# EAGLE / TLT's drafter optimizer: AdamW(0.9, 0.95), decay 0.01 on matrices, clip 1.0,
# warm-up then cosine decay to 10% of 5e-5 over `total_steps`.
DRAFTER_OPTIM = OptimConfig(learning_rate=5e-5, schedule="cosine", warmup_steps=100, b2=0.95,
                            weight_decay=0.01, grad_clip=1.0)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DrafterTrainConfig:
    """Optimiser, loss and batch settings of drafter training (defaults: TLT / EAGLE).

    `optim` is the RL trainer's optimizer config (`tlt_jax.optim.OptimConfig`), one for both
    trainers; `total_steps` is its schedule's horizon.
    """

    optim: OptimConfig = DRAFTER_OPTIM
    total_steps: int = 10_000  # the schedule's horizon (warm-up included)
    vloss_weight: float = 1.0
    ploss_weight: float = 0.1
    window: int = 512
    prompt_context: int = 64
    batch_rows: int = 4
    row_len: int = 2048
    buffer_steps: int = 2
    loss_token_chunk: int | None = None  # bound [tokens, V] logits memory for large vocabs
    # Training-time test (EAGLE-3 / HASS): also train drafting levels 2..unroll_steps, each
    # fed the drafter's own previous output as in multi-step drafting; level m's loss weighs
    # unroll_decay ** (m - 1). 1: plain EAGLE (every level sees the policy's features).
    unroll_steps: int = 1
    unroll_decay: float = 0.8
    checkpoint_every: int = 100
    keep_checkpoints: int = 3

    def __post_init__(self):
        if not isinstance(self.optim, OptimConfig):
            raise ValueError(f"optim={self.optim!r} must be an OptimConfig")
        if not self.optim.learning_rate > 0:
            raise ValueError(f"optim.learning_rate={self.optim.learning_rate!r} must be > 0")
        for name in ("vloss_weight", "ploss_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")
        if self.vloss_weight == 0 and self.ploss_weight == 0:
            raise ValueError("vloss_weight=0 and ploss_weight=0: at least one must be > 0")
        if not isinstance(self.prompt_context, int) or self.prompt_context < 0:
            raise ValueError(f"prompt_context={self.prompt_context!r} must be an integer >= 0")
        for name in ("total_steps", "window", "batch_rows", "row_len", "buffer_steps",
                     "checkpoint_every", "keep_checkpoints", "unroll_steps"):  # fmt: skip
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be an integer >= 1")
        if self.optim.schedule != "constant" and self.optim.warmup_steps >= self.total_steps:
            raise ValueError(
                f"optim.warmup_steps={self.optim.warmup_steps} must be < total_steps="
                f"{self.total_steps} for the {self.optim.schedule} schedule"
            )
        if not 0 < self.unroll_decay <= 1:
            raise ValueError(f"unroll_decay={self.unroll_decay!r} must be in (0, 1]")
        if self.loss_token_chunk is not None and self.loss_token_chunk < 1:
            raise ValueError(f"loss_token_chunk={self.loss_token_chunk!r} must be >= 1 or None")


@struct.dataclass
class DrafterTrainState:
    """Everything drafter training owns: the trainable params, optimizer state and step."""

    params: DrafterParams  # {"fc": [2D, D], "layers": {name: [1, ...]}}
    opt_state: Any  # optax state over `params`
    step: jax.Array  # int32 scalar, optimizer steps taken


def learning_rate_schedule(config: DrafterTrainConfig) -> optax.Schedule:
    """`config.optim`'s schedule over `config.total_steps`."""
    return config.optim.schedule_fn(config.total_steps)


def make_optimizer(config: DrafterTrainConfig) -> optax.GradientTransformation:
    """`config.optim`'s AdamW (the RL trainer's optimizer) over `config.total_steps`."""
    return config.optim.optimizer(config.total_steps)


def init_train_state(params: DrafterParams, config: DrafterTrainConfig) -> DrafterTrainState:
    """A fresh state at step 0 (the optimizer state follows the params' shardings)."""
    params = jax.tree.map(jnp.asarray, params)
    opt_state = make_optimizer(config).init(params)
    return DrafterTrainState(params=params, opt_state=opt_state, step=jnp.zeros((), jnp.int32))


def make_buffer(config: DrafterTrainConfig, *, max_samples: int = 2000) -> DrafterBuffer:
    """The sample buffer with this config's window, prompt context and step horizon."""
    return DrafterBuffer(max_samples=max_samples, last_n_steps=config.buffer_steps,
                         window=config.window, prompt_context=config.prompt_context)  # fmt: skip


def param_shardings(target_config: ModelConfig, mesh: Mesh, role: str = "train", *,
                    fc_bias: bool = False) -> DrafterParams:  # fmt: skip
    """NamedShardings of the drafter params (plain-dict layout) from their logical axes;
    `fc_bias`: of a drafter with fc's bias (warm-started from an EAGLE-1/2 checkpoint)."""
    abstract = nnx.eval_shape(lambda: Drafter(target_config, rngs=nnx.Rngs(0), fc_bias=fc_bias))
    state = nnx.state(abstract, nnx.Param)
    shardings = sharding_lib.state_shardings(state, mesh, sharding_lib.rules_for(role))
    return nnx.to_pure_dict(shardings)


def unrolled_forward(
    params: DrafterParams,
    model_config: ModelConfig,
    embed_VxD: jax.Array,
    inputs: EagleInputs,
    positions_BxT: jax.Array,
    segment_ids_BxT: jax.Array,
    steps: int,
) -> list[tuple[jax.Array, jax.Array]]:
    """The drafter's outputs at drafting levels 1..steps over every position of a packed batch.

    Level 1 is the plain EAGLE forward: pair t = (x[t+1], f[t]) under the block-diagonal causal
    mask. Level m at position i is what multi-step drafting computes there when the last
    position drafted from is t = i - m + 1 and the drafted tokens are the true ones: its input
    is (x[i+1], level m-1's output at i-1), and it attends to level 1's keys at positions <= t
    (the cache of accepted pairs), to level p's key at position t + p - 1 for 1 < p < m (the
    drafted path) and to itself. Each level is one pass whose "cache" is the earlier levels'
    keys and values, under `cache_mask_BxTxS`; gradients flow through the fed-back outputs.

    Returns:
      `[(g_BxTxD, loss_mask_BxT), ...]`, one per level: level m's predicted f[i+1] at
      position i, trained iff pairs i-m+1 .. i are all trained pairs (one response, unbroken).
    """
    b, t = inputs.tokens_BxT.shape
    same_BxTxT = segment_causal_mask(segment_ids_BxT)
    g, kv = drafter_forward(
        params, model_config, embed_VxD, inputs.tokens_BxT, inputs.features_BxTxD,
        positions_BxT, mask_BxTxT=same_BxTxT,
    )  # fmt: skip
    levels = [(g, inputs.loss_mask_BxT)]
    keys, values, valid_BxT = [kv.k], [kv.v], inputs.loss_mask_BxT
    i_T1, j_1T = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    eye_BxTxT = jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, t, t))
    for m in range(2, steps + 1):
        valid_BxT = valid_BxT & jnp.pad(inputs.loss_mask_BxT, ((0, 0), (m - 1, 0)))[:, :t]
        blocks = [same_BxTxT & (j_1T <= i_T1 - (m - 1))[None]]  # level 1: the accepted prefix
        blocks += [jnp.broadcast_to(j_1T == i_T1 - m + p, (b, t, t)) for p in range(2, m)]
        fed_back_BxTxD = jnp.pad(g[:, :-1], ((0, 0), (1, 0), (0, 0)))
        g, kv = drafter_forward(
            params, model_config, embed_VxD, inputs.tokens_BxT, fed_back_BxTxD, positions_BxT,
            mask_BxTxT=eye_BxTxT,
            cache=KVCache.from_new(NewKV(k=jnp.concatenate(keys, axis=2),
                                         v=jnp.concatenate(values, axis=2))),
            cache_mask_BxTxS=jnp.concatenate(blocks, axis=-1),
        )  # fmt: skip
        levels.append((g, valid_BxT))
        keys.append(kv.k)
        values.append(kv.v)
    return levels


def batch_loss(
    params: DrafterParams,
    model_config: ModelConfig,
    config: DrafterTrainConfig,
    batch: DrafterBatch,
    embed_VxD: jax.Array,
    head_DxV: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The EAGLE loss of a packed batch (block-diagonal mask, per-segment positions).

    With `config.unroll_steps > 1` the loss is the `unroll_decay`-weighted mean over drafting
    levels (`unrolled_forward`); `vloss`, `ploss` and `accuracy` stay level 1's, and
    `accuracy_m` reports level m.
    """
    inputs = eagle_inputs(
        batch.tokens_BxT, batch.features_BxTxD, batch.loss_mask_BxT, batch.segment_ids_BxT
    )
    levels = unrolled_forward(params, model_config, embed_VxD, inputs, batch.positions_BxT,
                              batch.segment_ids_BxT, config.unroll_steps)  # fmt: skip
    total, weights, metrics = 0.0, 0.0, {}
    for m, (g_BxTxD, mask_BxT) in enumerate(levels, start=1):
        loss, level_metrics = eagle_loss(
            g_BxTxD, inputs.targets_BxTxD, mask_BxT, head_DxV,
            vloss_weight=config.vloss_weight, ploss_weight=config.ploss_weight,
            token_chunk=config.loss_token_chunk,
        )  # fmt: skip
        weight = config.unroll_decay ** (m - 1)
        total, weights = total + weight * loss, weights + weight
        if m == 1:
            metrics = level_metrics
        else:
            metrics[f"accuracy_{m}"] = level_metrics["accuracy"]
    loss = total / weights
    return loss, dict(metrics, loss=loss)


def make_train_step(
    target_config: ModelConfig, config: DrafterTrainConfig, *, donate: bool = True
) -> Callable[..., tuple[DrafterTrainState, dict[str, jax.Array]]]:
    """`train_step(state, batch, embed_VxD, head_DxV) -> (state, metrics)`, jitted, the state
    donated unless `donate=False` (online training keeps the last good state to fall back to).

    The embedding and head are frozen inputs: gradients are taken w.r.t. `state.params` only.
    Metrics: loss, vloss, ploss, accuracy, tokens, grad_norm, learning_rate.
    """
    model_config = drafter_config(target_config)
    optimizer = make_optimizer(config)
    schedule = learning_rate_schedule(config)

    def train_step(state: DrafterTrainState, batch: DrafterBatch, embed_VxD, head_DxV):
        grad_fn = jax.value_and_grad(batch_loss, has_aux=True)
        (_, metrics), grads = grad_fn(state.params, model_config, config, batch, embed_VxD,
                                      head_DxV)  # fmt: skip
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, grad_norm=optax.global_norm(grads),
                       learning_rate=jnp.asarray(schedule(state.step), jnp.float32))  # fmt: skip
        return DrafterTrainState(params, opt_state, state.step + 1), metrics

    return jax.jit(train_step, donate_argnums=0 if donate else ())
