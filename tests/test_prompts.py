"""One prompt path: the JSONL reader, the prompt encoder and the stop ids every caller shares.

RL training (`rl.policy.build_encoder`, `rl.trainer`), the drafter warm-up (`drafter.warmup`)
and batch generation (`rollout.generate`) must prompt the policy with the same ids and stop it
on the same tokens; these tests hold them to it for the byte tokenizer and SmolLM2's.
"""

import json

import pytest

from tlt_jax.data.pipeline import DEFAULT_INSTRUCTION, read_prompt_rows, render_prompt
from tlt_jax.data.tokenizer import ByteTokenizer, PromptEncoder, stop_token_ids
from tlt_jax.drafter import warmup
from tlt_jax.models.presets import get_preset
from tlt_jax.rl import policy
from tlt_jax.rl.config import ModelSettings, TrainConfig
from tlt_jax.rollout import generate

QUESTION = "What is 17 + 25?"


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    pytest.importorskip("transformers")
    from tlt_jax.models import checkpoints

    return checkpoints.load_tokenizer("smollm2-135m-instruct")


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _generate_ids(tokenizer, rows):
    requests = generate.build_requests(tokenizer, rows, generate.GenerateConfig())
    return [list(r.prompt_ids) for r in requests], [r.stop_ids for r in requests]


# ----------------------------------------------------------------------------- stop ids


def test_request_seeds_wrap_past_the_largest_seed():
    """`--seed` takes up to 2**32 - 1, and prompt i samples with seed + i: the second prompt
    was refused (seed=4294967296), naming neither the flag nor the prompt count."""
    config = generate.GenerateConfig(seed=2**32 - 1)
    requests = generate.build_requests(ByteTokenizer(), [{"prompt": "a"}, {"prompt": "b"}],
                                       config)  # fmt: skip
    assert [r.seed for r in requests] == [2**32 - 1, 0]


def test_byte_tokenizer_stops_on_nul_only_everywhere():
    tokenizer = ByteTokenizer()
    assert stop_token_ids(tokenizer) == (0,)
    _, stops = _generate_ids(tokenizer, [{"prompt": "abc"}])
    assert stops == [(0,)]


def test_stop_ids_take_end_tokens_in_the_vocabulary_only():
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "<|endoftext|>": 3, "<|im_end|>": 5}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(model), unk_token="[UNK]", eos_token="<|endoftext|>"
    )
    # `<|eot_id|>` converts to the unknown id 0, which must not become a stop id.
    assert tokenizer.convert_tokens_to_ids("<|eot_id|>") == 0
    assert stop_token_ids(tokenizer) == (3, 5)


@pytest.mark.slow
def test_smollm2_stop_ids_are_shared_by_trainer_generate_and_warmup(
    smollm2_tokenizer, tmp_path, monkeypatch
):
    from tlt_jax.rl import run, trainer

    tokenizer = smollm2_tokenizer
    # eos `<|im_end|>` (2) and `<|endoftext|>` (0), which is also SmolLM2's unknown token: a
    # check against unk_token_id would drop it.
    assert tokenizer.convert_ids_to_tokens(0) == "<|endoftext|>" == tokenizer.unk_token
    assert stop_token_ids(tokenizer) == (0, 2)
    # The trainer and the evaluation run stop on what this module computes.
    assert trainer.stop_token_ids is run.stop_token_ids is stop_token_ids
    _, stops = _generate_ids(tokenizer, [{"prompt": "Hi"}, {"messages": [
        {"role": "user", "content": "Hi"}]}])  # fmt: skip
    assert stops == [(0, 2), (0, 2)]

    seen = []

    def fake_generate(model, prompt_ids, *, stop_ids, **kwargs):
        seen.append(tuple(stop_ids))
        raise RuntimeError("stop here: only the stop ids are under test")

    monkeypatch.setattr(warmup, "generate_responses", fake_generate)

    class Model:  # the warm-up reads its config only (its drafter checkpoints' architecture)
        config = get_preset("smollm2_135m").replace(vocab_size=len(tokenizer))

    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": QUESTION}])
    config = warmup.WarmupConfig(prompts=str(prompts), workdir=str(tmp_path / "work"))
    with pytest.raises(RuntimeError, match="stop here"):
        warmup.run_warmup(config, Model(), tokenizer, max_steps=1)
    assert seen == [(0, 2)]


# ----------------------------------------------------------------------------- encoder


def _ids_at_every_call_site(tokenizer, settings, tmp_path):
    """The prompt ids of QUESTION as the trainer, the warm-up and generate.py encode it."""
    trainer_ids = list(policy.build_encoder(TrainConfig(settings), tokenizer)(QUESTION))
    prompts = _write_jsonl(tmp_path / "warmup.jsonl", [{"prompt": QUESTION}])
    config = warmup.WarmupConfig(prompts=str(prompts), workdir=str(tmp_path / "work"))
    (warmup_ids,) = warmup.load_prompt_ids(config, tokenizer)
    # generate.py encodes a `prompt` as raw text: given the rendered prompt, it must agree.
    rows = [{"prompt": render_prompt(tokenizer, QUESTION)}]
    if tokenizer.chat_template:  # and a chat of the same user turn
        rows.append(
            {"messages": [{"role": "user", "content": f"{QUESTION}\n\n{DEFAULT_INSTRUCTION}"}]}
        )
    generate_file = _write_jsonl(tmp_path / "generate.jsonl", rows)
    generate_ids, _ = _generate_ids(tokenizer, read_prompt_rows(generate_file))
    return trainer_ids, warmup_ids, generate_ids


def test_byte_tokenizer_prompt_ids_agree_at_every_call_site(tmp_path):
    tokenizer = ByteTokenizer()
    settings = ModelSettings(preset="tiny", tokenizer="byte")
    trainer_ids, warmup_ids, generate_ids = _ids_at_every_call_site(tokenizer, settings, tmp_path)
    expected = list(f"{QUESTION}\n\n{DEFAULT_INSTRUCTION}".encode())
    assert trainer_ids == warmup_ids == expected
    assert generate_ids == [expected]


@pytest.mark.slow
def test_smollm2_prompt_ids_agree_at_every_call_site(smollm2_tokenizer, tmp_path):
    tokenizer = smollm2_tokenizer
    settings = ModelSettings(name="smollm2-135m-instruct")
    trainer_ids, warmup_ids, generate_ids = _ids_at_every_call_site(tokenizer, settings, tmp_path)
    messages = [{"role": "user", "content": f"{QUESTION}\n\n{DEFAULT_INSTRUCTION}"}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert expected[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert trainer_ids == warmup_ids == expected
    assert generate_ids == [expected, expected]


@pytest.mark.slow
def test_smollm2_generate_keeps_raw_text_prompts_as_given(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    text = "  The sea is\n"  # not stripped, not templated
    (ids,), _ = _generate_ids(tokenizer, [{"prompt": text}])
    assert ids == tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text


class _BosTokenizer:
    """Adds a BOS (id 1) when asked to; its chat template writes `<s>` (id 1) into the text."""

    eos_token_id = 0

    def __init__(self, chat_template):
        self.chat_template = chat_template

    def encode(self, text, add_special_tokens=True):
        ids = [1] if text.startswith("<s>") else []
        ids += [2 + ord(c) for c in text.removeprefix("<s>")]
        return [1] + ids if add_special_tokens else ids

    def apply_chat_template(self, conversation, tokenize, add_generation_prompt):
        return "<s>" + "".join(m["content"] for m in conversation)


@pytest.mark.parametrize("chat_template", [None, "<s>{{content}}"])
def test_encoder_adds_special_tokens_once(chat_template):
    """Templated text holds its BOS already; plain text gets the tokenizer's."""
    tokenizer = _BosTokenizer(chat_template)
    ids = PromptEncoder(tokenizer, instruction="")("ab")
    assert ids == (1, 2 + ord("a"), 2 + ord("b"))
    assert PromptEncoder(tokenizer, prompt_kind="text").encode_row({"prompt": "ab"}) == ids
    if chat_template:
        assert PromptEncoder(tokenizer).encode_messages([{"role": "user", "content": "ab"}]) == ids


def test_encoder_rows_and_validation():
    tokenizer = ByteTokenizer()
    question = PromptEncoder(tokenizer, instruction="Box it.")
    text = PromptEncoder(tokenizer, prompt_kind="text")
    assert question.encode_row({"prompt": " 1+1 "}) == tuple(b"1+1\n\nBox it.")
    assert text.encode_row({"prompt": " 1+1 "}) == tuple(b" 1+1 ")
    with pytest.raises(ValueError, match="chat template; ByteTokenizer has none"):
        text.encode_row({"messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(ValueError, match=r"prompt_kind='raw' is not one of \('question', 'text'\)"):
        PromptEncoder(tokenizer, prompt_kind="raw")
    with pytest.raises(ValueError, match=r"max_prompt_len=0 must be >= 1"):
        PromptEncoder(tokenizer, max_prompt_len=0)
    short = PromptEncoder(tokenizer, instruction="", max_prompt_len=3)
    assert short("abc") == tuple(b"abc")
    with pytest.raises(ValueError, match=r"4 tokens > rollout\.max_prompt_len=3.*'abcd'"):
        short("abcd")
    # A whole split at once: every too-long prompt counted, the longest named.
    assert short.encode_all(["ab", "abc"], "train split") == [tuple(b"ab"), tuple(b"abc")]
    with pytest.raises(ValueError, match=r"2 of the 4 prompts of the train split have more "
                       r"than rollout\.max_prompt_len=3 tokens \(the longest: 6\); raise "
                       r"--config\.rollout\.max_prompt_len to at least 6"):  # fmt: skip
        short.encode_all(["ab", "abcdef", "abc", "abcd"], "train split")


# ----------------------------------------------------------------------------- JSONL reader


def test_reader_reads_rows_in_order_and_stops_at_limit(tmp_path):
    chat = {"messages": [{"role": "user", "content": "hi"}], "id": 7}
    path = tmp_path / "p.jsonl"
    path.write_text(f'{json.dumps({"prompt": "a"})}\n\n{json.dumps(chat)}\n{{"prompt": "c"}}\n')
    assert read_prompt_rows(path) == [{"prompt": "a"}, chat, {"prompt": "c"}]
    assert read_prompt_rows(path, limit=2) == [{"prompt": "a"}, chat]


@pytest.mark.parametrize(
    "bad_line",
    [
        '{"prompt": "unterminated',
        '["a list"]',
        '{"text": "neither"}',
        '{"prompt": "a", "messages": [{"role": "user", "content": "both"}]}',
        '{"prompt": 3}',
        '{"prompt": ""}',
        '{"messages": []}',
        '{"messages": [{"role": "user"}]}',
        '{"messages": "hi"}',
    ],
)
def test_reader_error_names_line_and_what_was_expected(tmp_path, bad_line):
    path = tmp_path / "p.jsonl"
    path.write_text(f'{{"prompt": "ok"}}\n\n{bad_line}\n')
    with pytest.raises(ValueError) as error:
        read_prompt_rows(path)
    message = str(error.value)
    assert message.startswith(f"{path}:3: ")
    assert 'expected an object with a non-empty string "prompt" or a non-empty "messages"' in (
        message
    )


def test_reader_rejects_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="--prompts file .*missing.jsonl does not exist"):
        read_prompt_rows(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match="empty.jsonl has no prompts"):
        read_prompt_rows(tmp_path / "empty.jsonl")
