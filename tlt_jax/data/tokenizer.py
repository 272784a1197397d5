"""Tokenizers the RL loop accepts, and the prompt encoder it uses.

`ByteTokenizer` is for the random `tiny` model (vocab 256): UTF-8 bytes are their own ids,
except byte 0 (NUL, never in text), which is the end-of-sequence token. It has no chat template,
so prompts are plain `question + instruction` text. Real checkpoints use their Hugging Face
tokenizer (`tlt_jax.models.checkpoints.load_tokenizer`), which satisfies the same `Tokenizer`
protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tlt_jax.data.pipeline import render_prompt


class Tokenizer(Protocol):
    """What the RL loop needs from a tokenizer (a subset of Hugging Face's API)."""

    eos_token_id: int
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids; id 0 is end-of-sequence. Exactly invertible on text."""

    vocab_size = 256
    eos_token_id = 0
    eos_token = "\x00"
    chat_template: str | None = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The UTF-8 bytes of `text`; `add_special_tokens` is accepted and ignored."""
        del add_special_tokens
        data = text.encode("utf-8")
        if b"\x00" in data:
            raise ValueError("ByteTokenizer: text contains NUL, which is the end-of-sequence id")
        return list(data)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of the ids; the end-of-sequence id is dropped when `skip_special_tokens`."""
        ids = [int(t) for t in token_ids]
        if skip_special_tokens:
            ids = [t for t in ids if t != self.eos_token_id]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"ByteTokenizer: ids {bad[:5]} outside [0, {self.vocab_size})")
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        raise ValueError("ByteTokenizer has no chat template; use use_chat_template=False")


def stop_token_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Ids that end a response: eos, plus `<|im_end|>` when the vocabulary has it.

    Chat models (SmolLM2, Qwen2.5) end an assistant turn with `<|im_end|>`, which is not always
    their `eos_token` (Qwen2.5 base models use `<|endoftext|>`).
    """
    ids = {int(tokenizer.eos_token_id)}
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    unk = getattr(tokenizer, "unk_token_id", None)
    if convert is not None:
        im_end = convert("<|im_end|>")
        if isinstance(im_end, int) and im_end != unk:
            ids.add(im_end)
    return tuple(sorted(ids))


class PromptEncoder:
    """Question text -> prompt token ids, rendered the same way for training and evaluation."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        instruction: str,
        use_chat_template: bool,
        max_prompt_len: int,
        system_prompt: str | None = None,
    ):
        self.tokenizer = tokenizer
        self.instruction = instruction
        self.use_chat_template = use_chat_template
        self.system_prompt = system_prompt
        self.max_prompt_len = max_prompt_len

    def __call__(self, question: str) -> tuple[int, ...]:
        """Token ids of the rendered prompt.

        Raises:
          ValueError: when the prompt is longer than `max_prompt_len`, naming the flag.
        """
        text = render_prompt(
            self.tokenizer, question, instruction=self.instruction,
            use_chat_template=self.use_chat_template, system_prompt=self.system_prompt,
        )  # fmt: skip
        ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        if len(ids) > self.max_prompt_len:
            raise ValueError(
                f"a prompt has {len(ids)} tokens > rollout.max_prompt_len={self.max_prompt_len}; "
                f"raise --config.rollout.max_prompt_len (question: {question[:60]!r}...)"
            )
        return ids
