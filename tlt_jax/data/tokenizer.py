"""Tokenizers the project accepts, the ids that end a response, and the one prompt encoder.

`ByteTokenizer` is for the random `tiny` model (vocab 256): UTF-8 bytes are their own ids,
except byte 0 (NUL, never in text), which is the end-of-sequence token. It has no chat template,
so prompts are plain `question + instruction` text. Real checkpoints use their Hugging Face
tokenizer (`tlt_jax.models.checkpoints.load_tokenizer`), which satisfies the same `Tokenizer`
protocol.

`stop_token_ids` and `PromptEncoder` are shared by RL training and evaluation, the drafter
warm-up (`tlt_jax.drafter.warmup`) and batch generation (`tlt_jax.rollout.generate`), so all
of them prompt the policy with the same ids and stop it on the same tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tlt_jax.data.pipeline import (
    DEFAULT_INSTRUCTION,
    render_chat,
    render_prompt,
    uses_chat_template,
)

# Tokens that end a turn or a document in the chat formats we meet: ChatML (SmolLM2, Qwen2.5)
# `<|im_end|>`, Llama 3 `<|eot_id|>`, GPT-2-style document end `<|endoftext|>`.
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")
PROMPT_KINDS = ("question", "text")


class Tokenizer(Protocol):
    """What the project needs from a tokenizer (a subset of Hugging Face's API)."""

    eos_token_id: int | None
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def convert_tokens_to_ids(self, token: str) -> int | None: ...

    def convert_ids_to_tokens(self, token_id: int) -> str | None: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


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

    def convert_tokens_to_ids(self, token: str) -> int | None:
        """The id of a one-byte token; None for anything else (there are no special tokens)."""
        data = token.encode("utf-8")
        return data[0] if len(data) == 1 else None

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        """The one-byte token of an id below 128 (longer UTF-8 sequences have no token)."""
        return chr(token_id) if 0 <= token_id < 128 else None

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        raise ValueError("ByteTokenizer has no chat template; use use_chat_template=False")


def stop_token_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Ids that end a response: eos, and each of `END_TOKENS` the vocabulary holds.

    Chat models end an assistant turn with a token that is not always their `eos_token`
    (Qwen2.5 base models' eos is `<|endoftext|>`, their chat turns end in `<|im_end|>`), and a
    model that ends the document instead of the turn must stop too.

    Args:
      tokenizer: a Hugging Face tokenizer or a `ByteTokenizer`.

    Returns:
      The sorted ids, for `Request.stop_ids` in training, evaluation, the drafter warm-up and
      batch generation alike.
    """
    eos = tokenizer.eos_token_id
    ids = {int(t) for t in (eos if isinstance(eos, Sequence) else [eos]) if t is not None}
    for token in END_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        # A token outside the vocabulary converts to the unknown id (or None); the round trip
        # tells them apart even where the unknown token is itself one of END_TOKENS (SmolLM2's
        # unk is `<|endoftext|>`).
        if token_id is not None and tokenizer.convert_ids_to_tokens(token_id) == token:
            ids.add(int(token_id))
    return tuple(sorted(ids))


class PromptEncoder:
    """Prompts -> token ids, rendered the same way for training, evaluation, warm-up, generation.

    Text rendered through a chat template already holds its special tokens, so it is encoded
    without adding any; plain text is encoded with them (a BOS where the tokenizer adds one).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        instruction: str = DEFAULT_INSTRUCTION,
        use_chat_template: bool = True,
        max_prompt_len: int | None = None,
        system_prompt: str | None = None,
        prompt_kind: str = "question",
    ):
        """Keeps the rendering settings.

        Args:
          tokenizer: the policy's tokenizer.
          instruction: appended to every question (`render_prompt`).
          use_chat_template: wrap questions in the tokenizer's chat template when it has one.
          max_prompt_len: longest prompt allowed, in tokens; None: no limit.
          system_prompt: a system turn before each question (chat template only); None keeps
            the template's default.
          prompt_kind: what a JSONL row's `prompt` is (`encode_row`): "question" is rendered
            like RL prompts (`__call__`), "text" is encoded as given (`encode_text`).
        """
        if prompt_kind not in PROMPT_KINDS:
            raise ValueError(f"PromptEncoder {prompt_kind=} is not one of {PROMPT_KINDS}")
        if max_prompt_len is not None and max_prompt_len < 1:
            raise ValueError(f"PromptEncoder {max_prompt_len=} must be >= 1 or None")
        self.tokenizer = tokenizer
        self.instruction = instruction
        self.use_chat_template = use_chat_template
        self.system_prompt = system_prompt
        self.max_prompt_len = max_prompt_len
        self.prompt_kind = prompt_kind

    def __call__(self, question: str) -> tuple[int, ...]:
        """Token ids of a question rendered as an RL prompt (`render_prompt`).

        Raises:
          ValueError: when the prompt is longer than `max_prompt_len`, naming the flag.
        """
        return self._check(self._question_ids(question), shown=question)

    def encode_all(self, questions: Sequence[str], what: str) -> list[tuple[int, ...]]:
        """Every question's prompt ids (`__call__`), checked at once: a run checks its whole
        split before it compiles, instead of failing at whichever step draws a long one.

        Raises:
          ValueError: naming how many of `what` (e.g. "train split") are longer than
            `max_prompt_len`, the longest, and the flag to raise.
        """
        ids = [self._question_ids(q) for q in questions]
        over = [len(x) for x in ids if self.max_prompt_len is not None
                and len(x) > self.max_prompt_len]  # fmt: skip
        if over:
            raise ValueError(
                f"{len(over)} of the {len(ids)} prompts of the {what} have more than "
                f"rollout.max_prompt_len={self.max_prompt_len} tokens (the longest: "
                f"{max(over)}); raise --config.rollout.max_prompt_len to at least {max(over)}"
            )
        return ids

    def _question_ids(self, question: str) -> tuple[int, ...]:
        text = render_prompt(
            self.tokenizer, question, instruction=self.instruction,
            use_chat_template=self.use_chat_template, system_prompt=self.system_prompt,
        )  # fmt: skip
        templated = uses_chat_template(self.tokenizer, self.use_chat_template)
        return tuple(self.tokenizer.encode(text, add_special_tokens=not templated))

    def encode_messages(self, messages: Sequence[Mapping[str, str]]) -> tuple[int, ...]:
        """Token ids of a chat in the tokenizer's template, ending in the generation prompt."""
        text = render_chat(self.tokenizer, messages)
        return self._encode(text, templated=True, shown=messages[-1]["content"])

    def encode_text(self, text: str) -> tuple[int, ...]:
        """Token ids of raw text, as given (plus the tokenizer's own special tokens)."""
        return self._encode(text, templated=False, shown=text)

    def encode_row(self, row: Mapping[str, Any]) -> tuple[int, ...]:
        """Token ids of a row of `tlt_jax.data.pipeline.read_prompt_rows`.

        A `messages` row goes through the chat template as given; a `prompt` row is a
        question or raw text, as `prompt_kind` says.
        """
        if "messages" in row:
            return self.encode_messages(row["messages"])
        if self.prompt_kind == "question":
            return self(row["prompt"])
        return self.encode_text(row["prompt"])

    def _encode(self, text: str, templated: bool, shown: str) -> tuple[int, ...]:
        ids = tuple(self.tokenizer.encode(text, add_special_tokens=not templated))
        return self._check(ids, shown)

    def _check(self, ids: tuple[int, ...], shown: str) -> tuple[int, ...]:
        if self.max_prompt_len is not None and len(ids) > self.max_prompt_len:
            raise ValueError(
                f"a prompt has {len(ids)} tokens > rollout.max_prompt_len={self.max_prompt_len}; "
                f"raise --config.rollout.max_prompt_len (prompt: {shown[:60]!r}...)"
            )
        return ids
