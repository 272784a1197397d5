"""Drafter warm-up before RL: generate with the policy, harvest its features, train, export.

Pipeline (TLT's offline EAGLE warm-up, on the policy's own outputs):

1. Encode the prompts exactly as the RL job does (`tlt_jax.data.tokenizer.PromptEncoder`:
   tokenizer chat template over question + instruction): drafter acceptance is sensitive to
   the prompt prefix.
2. Generate responses with the rollout engine (`generate_responses`, the one place that
   touches the engine's API), stopping on the RL job's `stop_token_ids`. Responses are cached
   in `workdir/responses.jsonl`, so a resumed run skips generation.
3. One policy forward over prompt + response per sample gives the final-norm features.
4. Train the drafter on packed windows (orbax checkpoints in `workdir/checkpoints`, resumed
   when present), then export an HF-style EAGLE directory, with `hot_vocab.json` (the
   responses' token counts, `tlt_jax.drafter.hot_vocab`) next to it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm
from flax import nnx

from tlt_jax.checkpointing.manager import DrafterCheckpointer
from tlt_jax.config_fields import placeholder
from tlt_jax.data.pipeline import DEFAULT_INSTRUCTION, PROMPT_ROW_EXPECTED, read_prompt_rows
from tlt_jax.data.tokenizer import PromptEncoder, Tokenizer, stop_token_ids
from tlt_jax.drafter.data import DrafterBuffer
from tlt_jax.drafter.export import export_eagle
from tlt_jax.drafter.hot_vocab import count_tokens, hot_token_ids, save_hot_vocab
from tlt_jax.drafter.trainer import (
    DrafterTrainConfig,
    DrafterTrainState,
    init_train_state,
    make_buffer,
    make_train_step,
)
from tlt_jax.files import check_local_dir, write_text_atomic
from tlt_jax.models.drafter import init_drafter
from tlt_jax.models.transformer import Transformer
from tlt_jax.optim import OptimConfig


@dataclasses.dataclass(frozen=True)
class WarmupConfig:
    """Everything `run_warmup` needs besides the model and tokenizer."""

    prompts: str  # JSONL: each line has "prompt" (question text) or "messages" (chat list)
    workdir: str
    export_dir: str | None = None  # default: workdir/eagle
    instruction: str = DEFAULT_INSTRUCTION  # appended to each `prompt` question
    max_new_tokens: int = 1024
    max_prompts: int | None = None
    temperature: float = 0.0
    generate_batch: int = 32
    harvest_batch: int = 8
    seed: int = 0
    # Train the soft cross-entropy over the responses' most frequent tokens only (the draft
    # head the engine uses with the same hot-vocabulary size); None: the full vocabulary.
    hot_vocab_size: int | None = None
    train: DrafterTrainConfig = DrafterTrainConfig()
    log_every: int = 10

    def __post_init__(self):
        for name in ("max_new_tokens", "generate_batch", "harvest_batch", "log_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be an integer >= 1")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(f"max_prompts={self.max_prompts!r} must be >= 1 or None")
        if not isinstance(self.instruction, str):
            raise ValueError(f"instruction={self.instruction!r} must be a string ('' for none)")
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0")
        if self.hot_vocab_size is not None and (
            not isinstance(self.hot_vocab_size, int) or self.hot_vocab_size < 1
        ):
            raise ValueError(f"hot_vocab_size={self.hot_vocab_size!r} must be an integer >= 1 "
                             "or None (full vocabulary)")  # fmt: skip


# -- config files (`scripts/train_drafter.py --config`, like `train.py`'s) --------------------

# Fields of a config file besides `WarmupConfig`'s (the workdir is a flag, as for train.py).
SCRIPT_FIELDS = {"model": "", "dtype": ""}
_NESTED = {"train": DrafterTrainConfig, "optim": OptimConfig}


def _as_config_dict(instance) -> ml_collections.ConfigDict:
    """A dataclass instance's fields as a ConfigDict (nested configs nested; None values as
    typed placeholders, so `--config.x=...` parses)."""
    out = ml_collections.ConfigDict()
    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        if dataclasses.is_dataclass(value):
            out[field.name] = _as_config_dict(value)
        elif value is None:
            out[field.name] = placeholder(type(instance), field.name)
        else:
            out[field.name] = value
    return out


def default_config_dict() -> ml_collections.ConfigDict:
    """Every warm-up field at its default (drafter training's and its optimizer's nested), plus
    `model` and `dtype`: what drafter config files start from."""
    c = _as_config_dict(WarmupConfig(prompts="", workdir=""))
    del c["workdir"]
    for name, value in SCRIPT_FIELDS.items():
        c[name] = value
    return c


def _build(cls, raw: dict[str, Any], where: str):
    allowed = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ValueError(f"{where}{unknown[0]} is not a field; expected one of {sorted(allowed)}")
    values = {k: _build(_NESTED[k], dict(v), f"{where}{k}.") if k in _NESTED else v
              for k, v in raw.items()}  # fmt: skip
    return cls(**values)


def config_from_dict(config: Any, workdir: str) -> tuple[WarmupConfig, dict[str, str]]:
    """(`WarmupConfig`, the script fields `model` / `dtype`) of a config file's ConfigDict.

    Raises:
      ValueError: naming an unknown field (with the allowed ones) or an invalid value.
    """
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    script = {k: raw.pop(k, v) for k, v in SCRIPT_FIELDS.items()}
    if not script["model"]:
        raise ValueError("model='' : set the policy (HF directory, .gguf or short name)")
    if not raw.get("prompts"):
        raise ValueError(f"prompts='' : set --config.prompts to a JSONL of {PROMPT_ROW_EXPECTED}")
    check_local_dir(workdir, "--workdir")
    built = _build(WarmupConfig, {**raw, "workdir": workdir}, "")
    # Every row is read now, before the policy loads: a missing or empty file, or rows of
    # another form, fail in seconds.
    read_prompt_rows(built.prompts, built.max_prompts, flag="--config.prompts")
    return built, script


def load_prompt_ids(config: WarmupConfig, tokenizer: Tokenizer) -> list[list[int]]:
    """Token ids of the prompts file, each `prompt` rendered as an RL question.

    Returns:
      At most `config.max_prompts` prompts' ids, in file order.
    """
    encode = PromptEncoder(tokenizer, instruction=config.instruction)
    rows = read_prompt_rows(config.prompts, config.max_prompts)
    return [list(encode.encode_row(row)) for row in rows]


def generate_responses(
    model: Transformer,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    temperature: float = 0.0,
    max_batch_size: int = 32,
    seed: int = 0,
    progress: bool = True,
) -> list[list[int]]:
    """Response token ids for every prompt, in order (the only use of the rollout engine)."""
    from tlt_jax.rollout.engine import EngineConfig, Request, RolloutEngine
    from tlt_jax.rollout.sampling import SamplingParams

    max_seq_len = max(len(p) for p in prompt_ids) + max_new_tokens
    engine = RolloutEngine(
        model, EngineConfig(max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    )
    sampling = SamplingParams(temperature=temperature, top_p=1.0, top_k=0)
    requests = [
        Request(prompt_ids=tuple(p), max_new_tokens=max_new_tokens, sampling=sampling,
                stop_ids=tuple(stop_ids), seed=seed + i)
        for i, p in enumerate(prompt_ids)
    ]  # fmt: skip
    return [list(c.token_ids) for c in engine.generate(requests, progress=progress)]


HARVEST_BUCKET = 64  # harvest rows are padded to a multiple of this many tokens


def length_batches(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                   batch_size: int) -> Iterator[tuple[list[int], np.ndarray]]:  # fmt: skip
    """Prompt + response samples in batches of similar length: (the samples' indices, their
    tokens [batch_size, T] int32, right-padded with zeros to a multiple of `HARVEST_BUCKET`).

    Sorting by length keeps padding under `HARVEST_BUCKET` tokens per row at the price of a
    few programs (one per length bucket); the last batch's unused rows are all padding.
    """
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    for begin in range(0, len(order), batch_size):
        rows = order[begin : begin + batch_size]
        t = -(-max(lengths[i] for i in rows) // HARVEST_BUCKET) * HARVEST_BUCKET
        tokens = np.zeros((batch_size, t), np.int32)
        for row, i in enumerate(rows):
            tokens[row, : lengths[i]] = [*prompt_ids[i], *response_ids[i]]
        yield rows, tokens


def harvest_features(
    model: Transformer,
    buffer: DrafterBuffer,
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    *,
    step: int = 0,
    batch_size: int = 8,
) -> int:
    """One policy forward over prompt + response per sample; features go into `buffer`.

    Samples are batched by length (`length_batches`). The causal mask keeps the padding out of
    the real tokens' features, and `valid_mask` drops it from the buffer.

    Returns:
      The number of samples stored.
    """
    graphdef, weights = nnx.split(model)

    @jax.jit
    def forward(weights, tokens_BxT, positions_BxT):
        return nnx.merge(graphdef, weights)(tokens_BxT, positions_BxT)[0]

    stored = 0
    for rows, tokens in length_batches(prompt_ids, response_ids, batch_size):
        t = tokens.shape[1]
        response_mask = np.zeros((batch_size, t), bool)
        valid = np.zeros((batch_size, t), bool)
        for row, i in enumerate(rows):
            p, r = len(prompt_ids[i]), len(response_ids[i])
            response_mask[row, p : p + r] = True
            valid[row, : p + r] = True
        positions = np.broadcast_to(np.arange(t, dtype=np.int32), (batch_size, t))
        features = forward(weights, jnp.asarray(tokens), jnp.asarray(positions))
        stored += buffer.add(tokens, features, response_mask, step, valid_mask=valid)
    return stored


def read_responses(path: str | os.PathLike) -> tuple[list[list[int]], list[list[int]]]:
    """The prompt and response ids of a warm-up's cached `responses.jsonl` (the policy's
    sampled answers; `bench_drafter_init.py` and `bench_accept_ceiling.py` read them).

    Raises:
      ValueError: naming the path when it is not a file, or the lines without both ids.
    """
    if not path or not Path(path).is_file():
        raise ValueError(f"responses={str(path)!r} must be a warm-up's responses.jsonl "
                         "(train_drafter.py writes it in its workdir)")  # fmt: skip
    path = Path(path)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    bad = [i for i, r in enumerate(rows) if not r.get("prompt_ids") or not r.get("response_ids")]
    if not rows or bad:
        raise ValueError(f"{path}: records {bad[:5]} of {len(rows)} lack prompt_ids / response_ids")
    return [r["prompt_ids"] for r in rows], [r["response_ids"] for r in rows]


def policy_digest(model: Transformer) -> str:
    """A digest of the policy's weights: every parameter's sum, in tree order (one host
    read)."""
    sums = jax.device_get(
        [jnp.sum(x, dtype=jnp.float32) for x in jax.tree.leaves(nnx.state(model))]
    )
    return hashlib.sha256(np.asarray(sums, np.float64).tobytes()).hexdigest()[:16]


def generation_key(model: Transformer, config: WarmupConfig, stop_ids: Sequence[int]) -> dict:
    """What decides the cached responses besides the prompts: the policy's weights
    (`policy_digest`), the temperature, seed, stop ids and length."""
    return {"weights": policy_digest(model),
            "temperature": config.temperature, "seed": config.seed,
            "stop_ids": sorted(int(t) for t in stop_ids),
            "max_new_tokens": config.max_new_tokens}  # fmt: skip


def _cached_responses(path: Path, prompt_ids: list[list[int]], key: dict):
    """Responses an earlier run saved for exactly these prompts and `generation_key`, else
    None (then logged: a policy, temperature, seed, stop ids or length that changed
    regenerates them, since features of another model's tokens would train the drafter
    on the wrong distribution)."""
    if not path.is_file():
        return None
    try:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as e:  # e.g. an earlier run's write cut short
        logging.info("%s is not readable (%s): generating the responses anew", path, e)
        return None
    if len(lines) != len(prompt_ids) or any(
        line["prompt_ids"] != p for line, p in zip(lines, prompt_ids, strict=True)
    ):
        logging.info("%s holds other prompts: generating the responses anew", path)
        return None
    saved = [line.get("generation") for line in lines]
    if any(g != key for g in saved):
        logging.info("%s was generated with %s, not %s: generating the responses anew", path,
                     next(g for g in saved if g != key), key)  # fmt: skip
        return None
    return [line["response_ids"] for line in lines]


def run_warmup(config: WarmupConfig, model: Transformer, tokenizer, *, max_steps: int) -> Path:
    """Generates, harvests, trains (resuming from `workdir`) and exports the drafter.

    Args:
      config: prompts, workdir, generation and training settings.
      model: the policy.
      tokenizer: its HF tokenizer (chat template, eos).
      max_steps: train until the drafter's optimizer step count reaches this.

    Returns:
      The exported EAGLE directory.
    """
    vocab_size = model.config.vocab_size
    if config.hot_vocab_size is not None and config.hot_vocab_size > vocab_size:
        raise ValueError(f"hot_vocab_size={config.hot_vocab_size} exceeds the policy's "
                         f"vocab_size={vocab_size}")  # fmt: skip
    workdir = Path(config.workdir).expanduser()
    workdir.mkdir(parents=True, exist_ok=True)
    # A workdir of another policy's drafter fails here, before its cached responses are
    # regenerated (and overwritten) and the harvest compiles.
    checkpointer = DrafterCheckpointer(workdir / "checkpoints", model.config)
    try:
        trained_steps = checkpointer.check() or 0
        if trained_steps:  # and one of the same architecture trained for another policy
            checkpointer.check(policy_weights=policy_digest(model))
    finally:
        checkpointer.close()
    prompt_ids = load_prompt_ids(config, tokenizer)
    cache_path = workdir / "responses.jsonl"
    stop_ids = stop_token_ids(tokenizer)
    key = generation_key(model, config, stop_ids) if cache_path.is_file() else None
    responses = None if key is None else _cached_responses(cache_path, prompt_ids, key)
    if responses is None:
        responses = generate_responses(
            model, prompt_ids, max_new_tokens=config.max_new_tokens, stop_ids=stop_ids,
            temperature=config.temperature, max_batch_size=config.generate_batch,
            seed=config.seed,
        )  # fmt: skip
        key = key or generation_key(model, config, stop_ids)
        # Whole or not at all: a kill mid-write leaves the old cache or none, not half.
        write_text_atomic(cache_path, "".join(
            json.dumps({"prompt_ids": p, "response_ids": r,
                        "max_new_tokens": config.max_new_tokens, "generation": key}) + "\n"
            for p, r in zip(prompt_ids, responses, strict=True)
        ))  # fmt: skip
    counts_V = count_tokens(responses, vocab_size)
    hot_ids = None
    if config.hot_vocab_size is not None:
        hot_ids = hot_token_ids(counts_V, config.hot_vocab_size)
    train = config.train
    buffer = make_buffer(train, max_samples=len(prompt_ids))  # every sample is from step 0
    if trained_steps < max_steps:  # a finished run only exports: no policy forward needed
        stored = harvest_features(model, buffer, prompt_ids, responses,
                                  batch_size=config.harvest_batch)  # fmt: skip
        logging.info("harvested %d samples (%d response tokens)", stored,
                     sum(len(r) for r in responses))  # fmt: skip
    state = train_drafter(model, buffer, train, workdir / "checkpoints", max_steps=max_steps,
                          seed=config.seed, log_every=config.log_every,
                          hot_token_ids=hot_ids)  # fmt: skip
    export_dir = Path(config.export_dir) if config.export_dir else workdir / "eagle"
    out = export_eagle(state.params, model.config, export_dir)
    # The responses' token counts: the engine's hot vocabulary for drafting.
    save_hot_vocab(out, counts_V)
    return out


def train_drafter(
    model: Transformer,
    buffer: DrafterBuffer,
    config: DrafterTrainConfig,
    checkpoint_dir: str | os.PathLike,
    *,
    max_steps: int,
    seed: int = 0,
    log_every: int = 10,
    hot_token_ids: np.ndarray | None = None,
) -> DrafterTrainState:
    """Trains a drafter on `buffer` to `max_steps`, resuming from `checkpoint_dir`.

    Batches are drawn with `default_rng([seed, step])`, so a resumed run sees the batches the
    uninterrupted run would have. Metrics of step t are read after step t+1 is dispatched.
    With `hot_token_ids` ([U] ids) the loss runs over those columns of the policy head only
    (see `tlt_jax.drafter.loss`); accuracy is then the argmax agreement within them.

    Returns:
      The final `DrafterTrainState` (also checkpointed).
    """
    checkpointer = DrafterCheckpointer(checkpoint_dir, model.config,
                                       keep=config.keep_checkpoints,
                                       policy_weights=policy_digest(model))  # fmt: skip
    fresh = lambda: init_train_state(init_drafter(model.config, seed).params_dict(), config)
    # Resuming restores into the abstract state: no random initialisation runs.
    state = checkpointer.restore(jax.eval_shape(fresh))
    if state is None:
        state = fresh()
    else:
        logging.info("resumed drafter training at step %d", int(state.step))
    train_step = make_train_step(model.config, config)
    embed_VxD, head_DxV = model.embed.get_value(), model.head_weight_DxV()
    if hot_token_ids is not None:  # sliced once: every step reads a [D, U] head
        head_DxV = jnp.take(head_DxV, jnp.asarray(hot_token_ids, jnp.int32), axis=1)
    first = int(state.step)
    pending = None
    bar = tqdm.tqdm(total=max_steps, initial=first, desc="drafter", unit="step")
    for step in range(first, max_steps):
        batch = buffer.sample_batch(
            np.random.default_rng([seed, step]), config.batch_rows, config.row_len
        )
        if batch is None:
            raise ValueError("the drafter buffer holds no sample with response tokens")
        state, metrics = train_step(state, batch, embed_VxD, head_DxV)
        if pending is not None and (step - 1) % log_every == 0:
            values = {k: float(v) for k, v in jax.device_get(pending).items()}
            bar.set_postfix(loss=f"{values['loss']:.4f}", acc=f"{values['accuracy']:.3f}")
            logging.info("drafter step %d: %s", step - 1, values)
        pending = metrics
        bar.update(1)
        if (step + 1) % config.checkpoint_every == 0:
            checkpointer.save(state)
    bar.close()
    checkpointer.save(state, force=True)
    checkpointer.close()
    return state
