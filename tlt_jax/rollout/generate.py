"""Batch generation from a JSONL file of prompts: the library side of `scripts/generate.py`."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from absl import logging

from tlt_jax.data.pipeline import read_prompt_rows
from tlt_jax.data.tokenizer import PromptEncoder, stop_token_ids
from tlt_jax.files import check_output_file, write_text_atomic
from tlt_jax.rollout.adaptive import DRAFT_SOURCES, FixedPolicy, PlainPolicy, StepChoice
from tlt_jax.rollout.engine import (
    DRAFTER_SYNC,
    Completion,
    EngineConfig,
    Request,
    RolloutEngine,
    check_requests,
)
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.speculative import SpecStrategy


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    model: str = "smollm2-135m-instruct"
    prompts: str = ""
    output: str = ""
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_batch_size: int = 32
    max_seq_len: int = 2048
    dtype: str = "float32"
    drafter: str = ""  # an exported HF-EAGLE drafter directory: speculative decoding on
    # Draft source: eagle | ngram (model-free, no drafter needed) | hybrid; "": eagle with a
    # drafter, plain decoding without.
    draft: str = ""
    spec_strategy: str = "8,4,48"  # depth,topk,verify_tokens (used whenever SD is on)
    hot_vocab: int = 2048  # draft over the drafter dir's hot_vocab.json top ids (0: full head)
    spec_max_batch: int = 0  # SD only at or under this many running requests (0: always)
    drafter_sync: str = "eager"  # plain steps keep the drafter in sync, or leave it behind

    @property
    def source(self) -> str | None:
        """The draft source of every SD step (None: plain decoding)."""
        return self.draft or ("eagle" if self.drafter else None)

    def __post_init__(self):
        # SamplingParams and Request validate the rest with their own messages.
        SamplingParams(self.temperature, self.top_p, self.top_k)
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be > 0")
        if self.max_new_tokens >= self.max_seq_len:  # no prompt of a token fits: say so now
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be < max_seq_len="
                             f"{self.max_seq_len} (the context holds the prompt too)")  # fmt: skip
        SpecStrategy.parse(self.spec_strategy)
        if self.draft not in ("", *DRAFT_SOURCES):
            raise ValueError(f"draft={self.draft!r} is not one of {['', *DRAFT_SOURCES]}")
        if self.draft in ("eagle", "hybrid") and not self.drafter:
            raise ValueError(f"draft={self.draft!r} needs drafter= (an exported HF-EAGLE "
                             "drafter directory); draft='ngram' needs none")  # fmt: skip
        if self.spec_max_batch < 0:
            raise ValueError(f"spec_max_batch={self.spec_max_batch} must be >= 0 (0: always)")
        if self.drafter_sync not in DRAFTER_SYNC:
            raise ValueError(f"drafter_sync={self.drafter_sync!r} is not one of "
                             f"{list(DRAFTER_SYNC)}")  # fmt: skip


def completion_record(comp: Completion, tokenizer) -> dict[str, Any]:
    return {
        "index": comp.index,
        "text": tokenizer.decode(comp.token_ids, skip_special_tokens=True),
        "token_ids": comp.token_ids,
        "logprobs": [round(x, 6) for x in comp.logprobs],
        "finish_reason": comp.finish_reason,
        "accepted_lengths": comp.accepted_lengths,
        "latency_s": round(comp.latency_s, 4),
    }


def build_requests(
    tokenizer, rows: Sequence[dict[str, Any]], config: GenerateConfig
) -> list[Request]:
    """One request per row of `read_prompt_rows`: a `prompt` is raw text, `messages` a chat.

    Prompts are encoded by the project's one `PromptEncoder`, and requests stop on
    `stop_token_ids`, the ids RL training and the drafter warm-up stop on.
    """
    sampling = SamplingParams(config.temperature, config.top_p, config.top_k)
    stops = stop_token_ids(tokenizer)
    encode = PromptEncoder(tokenizer, prompt_kind="text")
    requests = []
    for i, row in enumerate(rows):
        ids = encode.encode_row(row)
        if not ids:
            raise ValueError(f"prompt {i} encodes to no tokens; expected a non-empty prompt")
        # Seeds are uint32: `--seed` up to 2**32 - 1 wraps for the later prompts instead of
        # failing request i (which named neither the flag nor the prompt count).
        seed = (config.seed + i) % 2**32
        requests.append(Request(ids, config.max_new_tokens, sampling, stops, seed))
    return requests


def run(config: GenerateConfig) -> dict[str, Any]:
    """Generates for every prompt, writes the JSONL output, returns a summary."""
    from tlt_jax.models import checkpoints

    if config.output:  # before the model loads and the programs compile
        check_output_file(config.output, "--output")  # writes no file: a failure leaves none
    rows = read_prompt_rows(config.prompts)
    tokenizer = checkpoints.load_tokenizer(config.model)
    requests = build_requests(tokenizer, rows, config)
    check_requests(requests, config.max_seq_len)  # the vocabulary once the model is loaded
    if config.drafter:  # a drafter of another model is named before the model loads
        from tlt_jax.drafter.export import check_eagle_dir, check_eagle_target, load_eagle_config

        path = check_eagle_dir(config.drafter, "--drafter")
        check_eagle_target(path, load_eagle_config(path), checkpoints.load_config(config.model))
    model = checkpoints.load_model(config.model, param_dtype=config.dtype, dtype=config.dtype)
    drafter, hot_ids = None, None
    if config.source in ("eagle", "hybrid"):
        from tlt_jax.drafter.export import load_eagle
        from tlt_jax.drafter.hot_vocab import load_hot_vocab

        drafter = load_eagle(
            config.drafter, target=model.config, param_dtype=config.dtype, dtype=config.dtype
        )
        hot_file = Path(config.drafter) / "hot_vocab.json"
        if config.hot_vocab and not hot_file.is_file():  # e.g. a public EAGLE checkpoint
            logging.warning(
                "hot_vocab=%d: %s does not exist (train_drafter.py exports it); "
                "drafting over the full vocabulary",
                config.hot_vocab,
                hot_file,
            )
        elif config.hot_vocab:
            hot_ids = load_hot_vocab(hot_file, config.hot_vocab, model.config.vocab_size)
    policy = PlainPolicy()
    if config.source is not None:
        choice = StepChoice(SpecStrategy.parse(config.spec_strategy), config.source)
        policy = FixedPolicy(choice, config.spec_max_batch or None)
    engine = RolloutEngine(
        model,
        EngineConfig(
            max_batch_size=config.max_batch_size,
            max_seq_len=config.max_seq_len,
            max_prefill_batch=min(8, config.max_batch_size),
            drafter_sync=config.drafter_sync,
        ),
        drafter=drafter,
        hot_token_ids=hot_ids,
        step_policy=policy,
    )
    engine.validate(requests)
    start = time.perf_counter()
    completions = engine.generate(requests)
    elapsed = time.perf_counter() - start
    if config.output:  # whole or not at all: a kill mid-write leaves no torn JSONL
        write_text_atomic(
            config.output,
            "".join(json.dumps(completion_record(comp, tokenizer)) + "\n" for comp in completions),
        )
    tokens = sum(len(c.token_ids) for c in completions)
    return {
        "requests": len(completions),
        "generated_tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "compile_count": engine.stats.compile_count,
        "compile_seconds": engine.stats.compile_seconds,
        "draft": config.source,
        "spec_steps": engine.stats.spec_steps,
        "mean_accepted_length": _mean([n for c in completions for n in c.accepted_lengths]),
        "spec_switch_seconds": engine.stats.spec_switch_seconds,
    }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
