"""Policy model parity: HF transformers (PyTorch float32: logits and the engine's greedy
generate), cached decode, packing, export, errors.

Tolerances (float32 everywhere):
- tiny random checkpoints vs HF: max abs logit error <= 2e-5 on logits of scale ~4.5
  (measured ~5e-6);
- SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised by us and by transformers independently):
  <= 1e-3 on logits of scale ~40 (measured 1.25e-4), and the same argmax everywhere;
- our own paths against each other (cached vs full, packed vs separate): <= 2e-5 (measured
  ~4e-6); SmolLM2 cached vs full <= 3e-4 (measured 6e-5).
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from tlt_jax.models import checkpoints
from tlt_jax.models.presets import get_preset
from tlt_jax.models.transformer import KVCache, NewKV, segment_causal_mask, write_kv
from tlt_jax.rollout.bench import load_transformers
from tlt_jax.rollout.engine import EngineConfig, Request, RolloutEngine

TINY_ATOL = 2e-5
REAL_ATOL = 1e-3

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # < test lengths, so every RoPE branch is used
}
_COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2)
TINY_HF_CONFIGS = {
    "llama_llama3_untied": lambda: transformers.LlamaConfig(
        **_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_theta=10000.0, rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=False,
        max_position_embeddings=128, rms_norm_eps=1e-5,
    ),
    "llama_tied": lambda: transformers.LlamaConfig(
        **_COMMON, num_attention_heads=4, num_key_value_heads=4, rope_theta=500.0,
        tie_word_embeddings=True, max_position_embeddings=128,
    ),
    "qwen2_untied": lambda: transformers.Qwen2Config(
        **_COMMON, num_attention_heads=8, num_key_value_heads=2, rope_theta=1e6,
        tie_word_embeddings=False, max_position_embeddings=128,
    ),
    "qwen2_tied": lambda: transformers.Qwen2Config(
        **_COMMON, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
        max_position_embeddings=128,
    ),
}  # fmt: skip


def save_tiny_hf(kind: str, directory) -> torch.nn.Module:
    """Saves a random HF model of `kind`; weights scaled up so logits are far from uniform."""
    torch.manual_seed(sum(map(ord, kind)))
    model = transformers.AutoModelForCausalLM.from_config(
        TINY_HF_CONFIGS[kind](), dtype=torch.float32
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn_like(param)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    model.eval()
    model.save_pretrained(str(directory), safe_serialization=True)
    return model


def hf_logits(model: torch.nn.Module, tokens_BxT: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens_BxT), dtype=torch.long)).logits.numpy()


@nnx.jit
def forward(model, tokens, positions, mask=None, cache=None, cache_lens=None):
    features, new_kv = model(
        tokens, positions, mask_BxTxT=mask, cache=cache, cache_lens_B=cache_lens
    )
    return model.logits(features), new_kv


def full_logits(model, tokens_BxT) -> np.ndarray:
    tokens = jnp.asarray(tokens_BxT, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(forward(model, tokens, positions)[0])


def random_tokens(vocab: int, shape, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """kind -> (checkpoint dir, HF model, our model), built once per module."""
    out = {}
    for kind in TINY_HF_CONFIGS:
        directory = tmp_path_factory.mktemp(kind)
        hf = save_tiny_hf(kind, directory)
        out[kind] = (directory, hf, checkpoints.load_model(directory))
    return out


# ----------------------------------------------------------------------------- HF parity


@pytest.mark.parametrize("kind", sorted(TINY_HF_CONFIGS))
def test_tiny_logits_match_transformers(tiny, kind):
    directory, hf, model = tiny[kind]
    tokens = random_tokens(model.config.vocab_size, (2, 24))
    expected = hf_logits(hf, tokens)
    got = full_logits(model, tokens)
    assert expected.std() > 1.0, "logits too flat to make the comparison meaningful"
    np.testing.assert_allclose(got, expected, atol=TINY_ATOL, rtol=0)
    np.testing.assert_array_equal(got.argmax(-1), expected.argmax(-1))


def test_tiny_configs_read_as_written(tiny):
    config = tiny["llama_llama3_untied"][2].config
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == "llama3"
    assert config.rope_scaling.original_max_position_embeddings == 16
    assert not config.tie_word_embeddings and not config.attention_bias
    qwen = tiny["qwen2_tied"][2].config
    assert qwen.attention_bias and qwen.tie_word_embeddings and qwen.num_kv_heads == 1


@pytest.fixture(scope="module")
def smollm2():
    path = checkpoints.resolve_model_path("smollm2-135m-instruct")
    ours = checkpoints.load_model(path)
    hf = load_transformers("smollm2-135m-instruct")  # transformers' own GGUF path
    tokenizer = checkpoints.load_tokenizer(path)
    messages = [{"role": "user", "content": "What is 17 times 23? Think step by step."}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    return ours, hf, np.asarray([prompt], np.int32), tokenizer


def test_a_gguf_tokenizer_is_converted_once_then_read_from_the_cache(tmp_path, monkeypatch):
    """transformers converts a GGUF file's tokenizer from its metadata on every load (8-15 s
    here); `load_tokenizer` keeps the conversion under `tokenizer_cache_dir()`. The copy read
    back renders chats, encodes and decodes as the conversion does; an unreadable copy is
    converted again and replaced."""
    from tlt_jax.data.tokenizer import stop_token_ids

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = checkpoints.resolve_model_path("smollm2-135m-instruct")
    converted = checkpoints.load_tokenizer(path)  # converts, then writes the cache
    (entry,) = checkpoints.tokenizer_cache_dir().iterdir()
    conversions, read = [], transformers.AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):
        if "gguf_file" in kwargs:
            conversions.append(args)
            return converted
        return read(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    cached = checkpoints.load_tokenizer(path)
    assert not conversions and cached is not converted
    chats = [[{"role": "user", "content": "What is 17 times 23? Think step by step."}],
             [{"role": "system", "content": "Reply with the result only."},
              {"role": "user", "content": "Ünïcode 中文 <|im_end|> #### 42"}]]  # fmt: skip
    for chat in chats:
        text = converted.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert cached.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == text
        ids = converted.encode(text, add_special_tokens=False)
        assert cached.encode(text, add_special_tokens=False) == ids
        assert cached.decode(ids, skip_special_tokens=True) == converted.decode(
            ids, skip_special_tokens=True)  # fmt: skip
    assert stop_token_ids(cached) == stop_token_ids(converted)
    assert (len(cached), cached.special_tokens_map) == (
        len(converted),
        converted.special_tokens_map,
    )
    (entry / "tokenizer.json").write_text("{")  # unreadable: converted again, then replaced
    assert checkpoints.load_tokenizer(path) is converted and len(conversions) == 1
    assert checkpoints.load_tokenizer(path) is not converted and len(conversions) == 1


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2):
    ours, hf, prompt, _ = smollm2
    tokens = np.concatenate([prompt, random_tokens(ours.config.vocab_size, prompt.shape)], 0)
    expected = hf_logits(hf, tokens)
    got = full_logits(ours, tokens)
    assert np.abs(expected).max() > 10
    np.testing.assert_allclose(got, expected, atol=REAL_ATOL, rtol=0)
    np.testing.assert_array_equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.slow
def test_smollm2_cached_decode_matches_full_forward(smollm2):
    ours, _, prompt, _ = smollm2
    expected = full_logits(ours, prompt)
    got = cached_decode_logits(ours, prompt, np.asarray([prompt.shape[1] - 8]), chunk=2, steps=6)
    np.testing.assert_allclose(got[0], expected[0, -9:], atol=3e-4, rtol=0)
    np.testing.assert_array_equal(got[0].argmax(-1), expected[0, -9:].argmax(-1))


ENGINE_PROMPTS = [
    [{"role": "user", "content": "What is 17 + 25?"}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Translate 'good morning' into French."}],
]


@pytest.mark.slow
def test_smollm2_engine_greedy_matches_transformers_generate(smollm2):
    """The continuous-batching engine (4 requests through 2 slots) emits HF's greedy tokens."""
    ours, hf, _, tokenizer = smollm2
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
               for m in ENGINE_PROMPTS]  # fmt: skip
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    engine = RolloutEngine(ours, EngineConfig(max_batch_size=2, max_seq_len=256))
    eos, new_tokens = tokenizer.eos_token_id, 24
    got = [c.token_ids for c in engine.generate([Request(p, new_tokens, stop_ids=(eos,))
                                                 for p in prompts])]  # fmt: skip
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                              eos_token_id=eos, do_sample=False)  # fmt: skip
        # Both stop after (and keep) the first EOS, or after `new_tokens` tokens.
        assert tokens == out[0, len(prompt) :].tolist()


# ----------------------------------------------------------------------------- cached decode


def cached_decode_logits(model, tokens_BxT, prefix_B, chunk: int, steps: int) -> np.ndarray:
    """Prefills each row's prefix, then one `chunk`-token step, then `steps` single tokens.

    Returns the logits of positions prefix_B[b] - 1 ... prefix_B[b] + chunk + steps - 1 of
    every row b, [B, 1 + chunk + steps, V].
    """
    b, t = tokens_BxT.shape
    assert prefix_B.max() + chunk + steps <= t
    # Slots at or past a row's cache length hold garbage: attention must mask them.
    zeros = KVCache.zeros(model.config, b, t + 2)
    cache = zeros.replace(k=100 * jax.random.normal(jax.random.key(0), zeros.k.shape),
                          v=100 * jax.random.normal(jax.random.key(1), zeros.v.shape))  # fmt: skip
    prefill = int(prefix_B.max())
    # Rows with shorter prefixes prefill junk after them; their cache length masks it and the
    # following writes overwrite it.
    logits, new_kv = forward(
        model,
        jnp.asarray(tokens_BxT[:, :prefill]),
        jnp.broadcast_to(jnp.arange(prefill), (b, prefill)),
    )
    cache = write_kv(cache, new_kv, jnp.zeros(b, jnp.int32))
    lens = np.asarray(prefix_B, np.int32)
    out = [np.asarray(logits)[np.arange(b), lens - 1][:, None]]
    for n in [chunk] + [1] * steps:
        index = lens[:, None] + np.arange(n)
        logits, new_kv = forward(
            model, jnp.asarray(np.take_along_axis(tokens_BxT, index, 1)), jnp.asarray(index),
            None, cache, jnp.asarray(lens),
        )  # fmt: skip
        cache = write_kv(cache, new_kv, jnp.asarray(lens))
        out.append(np.asarray(logits))
        lens = lens + n
    return np.concatenate(out, 1)


@pytest.mark.parametrize("kind", ["llama_llama3_untied", "qwen2_untied"])
def test_cached_decode_matches_full_forward_ragged(tiny, kind):
    model = tiny[kind][2]
    tokens = random_tokens(model.config.vocab_size, (2, 24), seed=1)
    prefix = np.asarray([4, 13])
    expected = full_logits(model, tokens)
    got = cached_decode_logits(model, tokens, prefix, chunk=3, steps=8)
    for row in range(2):
        start = prefix[row] - 1
        np.testing.assert_allclose(got[row], expected[row, start : start + 12], atol=TINY_ATOL)


def test_write_kv_offsets_bounds_and_in_place():
    cache = KVCache.from_new(NewKV(k=jnp.zeros((2, 3, 6, 1, 2)), v=jnp.zeros((2, 3, 6, 1, 2))))
    new_k = jnp.arange(1, 17, dtype=jnp.float32).reshape(2, 2, 2, 1, 2)
    out = write_kv(cache, NewKV(k=new_k, v=-new_k), jnp.asarray([1, 5])).token_major()
    expected = np.zeros((2, 3, 6, 1, 2), np.float32)
    expected[:, 0, 1:3] = new_k[:, 0]
    expected[:, 1, 5] = new_k[:, 1, 0]  # position 6 is past the cache: dropped, not shifted
    np.testing.assert_array_equal(np.asarray(out.k), expected)  # row 2 untouched
    np.testing.assert_array_equal(np.asarray(out.v), -expected)
    # Prefill writes positions [0, T) of the given slots; slot 7 is out of range: dropped.
    prefix = KVCache.from_new(NewKV(k=jnp.zeros((2, 3, 6, 1, 2)), v=jnp.zeros((2, 3, 6, 1, 2))))
    out = prefix.write_prefix(jnp.asarray([2, 7]), NewKV(k=new_k, v=-new_k)).token_major()
    expected = np.zeros((2, 3, 6, 1, 2), np.float32)
    expected[:, 2, :2] = new_k[:, 0]
    np.testing.assert_array_equal(np.asarray(out.k), expected)
    np.testing.assert_array_equal(np.asarray(out.v), -expected)
    # With the cache donated the write is in place: no temporary the size of the cache.
    config = get_preset("tiny").replace(num_layers=4, num_kv_heads=4, head_dim=128)
    big = jax.eval_shape(lambda: KVCache.zeros(config, 8, 4096, jnp.float32))
    step = jax.ShapeDtypeStruct((4, 8, 1, 4, 128), jnp.float32)
    compiled = (
        jax.jit(write_kv, donate_argnums=0)
        .lower(big, NewKV(k=step, v=step), jax.ShapeDtypeStruct((8,), jnp.int32))
        .compile()
    )
    stats = compiled.memory_analysis()
    assert stats.temp_size_in_bytes < 2 * 4 * 8 * 4096 * 4 * 128 * 4 / 100


# ----------------------------------------------------------------------------- packing


def test_packed_forward_matches_separate_segments(tiny):
    model = tiny["llama_llama3_untied"][2]
    lengths = [[5, 3, 7, 1, 8], [24]]
    tokens = random_tokens(model.config.vocab_size, (2, 24), seed=3)
    segment_ids = np.asarray([np.repeat(np.arange(len(row)), row) for row in lengths])
    positions = np.asarray([np.concatenate([np.arange(n) for n in row]) for row in lengths])
    packed, _ = forward(
        model, jnp.asarray(tokens), jnp.asarray(positions),
        segment_causal_mask(jnp.asarray(segment_ids)),
    )  # fmt: skip
    # Every segment alone, left-aligned in its own row (what follows it cannot matter).
    spans = [(row, start, n) for row, ls in enumerate(lengths) for start, n in
             zip(np.cumsum([0, *ls[:-1]]), ls, strict=True)]  # fmt: skip
    alone = np.zeros((len(spans), 24), np.int32)
    for i, (row, start, n) in enumerate(spans):
        alone[i, :n] = tokens[row, start : start + n]
    alone_logits = full_logits(model, alone)
    for i, (row, start, n) in enumerate(spans):
        np.testing.assert_allclose(
            np.asarray(packed)[row, start : start + n], alone_logits[i, :n], atol=TINY_ATOL, rtol=0
        )


# ----------------------------------------------------------------------------- export


@pytest.mark.parametrize("kind", ["llama_llama3_untied", "qwen2_untied", "qwen2_tied"])
def test_export_loads_in_transformers_and_back(tiny, kind, tmp_path):
    _, _, model = tiny[kind]
    out = checkpoints.export_hf(model, tmp_path / "export")
    tokens = random_tokens(model.config.vocab_size, (2, 24), seed=4)
    expected = full_logits(model, tokens)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    np.testing.assert_allclose(hf_logits(hf, tokens), expected, atol=TINY_ATOL, rtol=0)
    again = checkpoints.load_model(out)
    assert again.config == model.config
    for (path, a), (_, b) in zip(
        nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(again)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), path)


def test_an_export_with_its_tokenizer_tells_hf_where_to_stop(tiny, tmp_path):
    """config.json carries the tokenizer's bos / eos and generation_config.json the ids the
    rollouts stop on; without them HF's defaults applied (an exported Llama stopped on id 2)."""

    class Tokenizer:  # the attributes `export_hf` and `stop_token_ids` read
        bos_token_id, eos_token_id = 1, 0
        vocab = {"<|im_end|>": 5, "<|endoftext|>": 0}

        def convert_tokens_to_ids(self, token):
            return self.vocab.get(token)

        def convert_ids_to_tokens(self, token_id):
            return {v: k for k, v in self.vocab.items()}.get(token_id)

        def save_pretrained(self, path):
            (Path(path) / "tokenizer_saved").write_text("")

    model = tiny["llama_llama3_untied"][2]
    out = checkpoints.export_hf(model, tmp_path / "export", tokenizer=Tokenizer())
    generation = transformers.GenerationConfig.from_pretrained(str(out))
    assert generation.eos_token_id == [0, 5] and generation.bos_token_id == 1
    hf_config = transformers.AutoConfig.from_pretrained(str(out))
    assert (hf_config.bos_token_id, hf_config.eos_token_id) == (1, 0)
    assert (out / "tokenizer_saved").is_file()
    assert checkpoints.load_model(out).config == model.config


def test_export_in_shards_round_trips(tiny, tmp_path):
    model = tiny["llama_tied"][2]
    out = checkpoints.export_hf(model, tmp_path / "export", max_shard_bytes=50_000)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert (out / "model.safetensors.index.json").is_file()
    tokens = random_tokens(model.config.vocab_size, (2, 24), seed=5)
    np.testing.assert_array_equal(
        full_logits(checkpoints.load_model(out), tokens), full_logits(model, tokens)
    )


def test_export_over_an_earlier_sharded_export_loads_the_new_weights(tmp_path):
    """The earlier export's index would shadow the new single file (silently the old weights)."""
    from tlt_jax.models.transformer import init_model

    config = get_preset("tiny")
    old, new = init_model(config, seed=0), init_model(config, seed=1)
    checkpoints.export_hf(old, tmp_path, max_shard_bytes=50_000)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    checkpoints.export_hf(new, tmp_path)
    assert not list(tmp_path.glob("model-*-of-*.safetensors"))
    np.testing.assert_array_equal(checkpoints.load_model(tmp_path).embed.get_value(),
                                  new.embed.get_value())  # fmt: skip


@pytest.mark.parametrize("blocks", [None, (4, 64)], ids=["whole_files", "sampled_blocks"])
def test_the_weights_fingerprint_follows_the_weights_not_the_path(tmp_path, monkeypatch,
                                                                  blocks):  # fmt: skip
    """A resume compares this fingerprint (the path does not tell a moved checkpoint from
    other weights of the same shapes): equal for a copy elsewhere and for a renamed GGUF,
    different for another init, a sharded export's changed shard, or another shard layout.
    `sampled_blocks`: files larger than the blocks read, as real checkpoints are."""
    import shutil

    from tlt_jax.models.transformer import init_model

    if blocks is not None:
        monkeypatch.setattr(checkpoints, "FINGERPRINT_BLOCKS", blocks[0])
        monkeypatch.setattr(checkpoints, "FINGERPRINT_BLOCK_BYTES", blocks[1])
    config = get_preset("tiny")
    first = checkpoints.export_hf(init_model(config, seed=0), tmp_path / "first")
    moved = shutil.copytree(first, tmp_path / "elsewhere" / "moved")
    other = checkpoints.export_hf(init_model(config, seed=1), tmp_path / "other")
    fingerprint = checkpoints.weights_fingerprint
    assert fingerprint(moved) == fingerprint(first) != fingerprint(other)
    sharded = checkpoints.export_hf(init_model(config, seed=0), tmp_path / "sharded",
                                    max_shard_bytes=50_000)  # fmt: skip
    changed = shutil.copytree(sharded, tmp_path / "changed")
    last = sorted(changed.glob("model-*-of-*.safetensors"))[-1]
    data = bytearray(last.read_bytes())
    data[-1] ^= 1  # the last byte: in the last block read
    last.write_bytes(bytes(data))
    assert len({fingerprint(first), fingerprint(sharded), fingerprint(changed)}) == 3
    gguf = checkpoints.resolve_model_path("smollm2-135m-instruct")
    (tmp_path / "renamed.gguf").symlink_to(gguf)
    assert fingerprint(tmp_path / "renamed.gguf") == fingerprint("smollm2-135m-instruct")
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor an index"):
        fingerprint(shutil.copytree(first, tmp_path / "empty", ignore=shutil.ignore_patterns(
            "*.safetensors")))  # fmt: skip


def test_the_tokenizer_fingerprint_follows_the_files_edited_in_place(tmp_path):
    """The weights fingerprint misses a tokenizer edited in place (another chat template or
    special token under the same weights): the tokenizer files get their own fingerprint,
    equal for a moved copy; none for a GGUF file or a directory without tokenizer files."""
    import shutil

    fingerprint = checkpoints.tokenizer_fingerprint
    first = tmp_path / "first"
    first.mkdir()
    (first / "config.json").write_text("{}")  # what resolves a checkpoint directory
    assert fingerprint(first) is None
    (first / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ a }}"}))
    (first / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    moved = shutil.copytree(first, tmp_path / "elsewhere")
    assert fingerprint(moved) == fingerprint(first) is not None
    (moved / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ b }}"}))
    edited = fingerprint(moved)
    assert edited != fingerprint(first)
    (moved / "chat_template.jinja").write_text("{{ b }}")  # a file added counts too
    assert fingerprint(moved) not in (edited, fingerprint(first))
    assert fingerprint("smollm2-135m-instruct") is None  # its tokenizer is in the GGUF file


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def no_compiles():
    """Fails the test if XLA compiles anything while it runs."""
    events = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield
    jax.monitoring.unregister_event_duration_listener(listener)
    assert not events, f"compiled {len(events)} program(s) before raising"


def write_config(directory, **changes):
    config = transformers.LlamaConfig(**_COMMON, num_attention_heads=4).to_dict()
    config.update(changes)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(__import__("json").dumps(config))
    return directory


def test_unknown_model_type(tmp_path, no_compiles):
    directory = write_config(tmp_path / "m", model_type="mamba", architectures=None)
    with pytest.raises(ValueError, match="model_type='mamba'"):
        checkpoints.load_model(directory)


def test_unknown_architecture(tmp_path, no_compiles):
    directory = write_config(tmp_path / "m", architectures=["LlamaForSequenceClassification"])
    with pytest.raises(ValueError, match="LlamaForSequenceClassification"):
        checkpoints.load_model(directory)


def test_directory_without_weights(tmp_path, no_compiles):
    directory = write_config(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match=str(directory)):
        checkpoints.load_model(directory)


def test_nonexistent_path(tmp_path, no_compiles):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        checkpoints.load_model(missing)


def test_garbage_safetensors(tmp_path, no_compiles):
    directory = write_config(tmp_path / "m")
    (directory / "model.safetensors").write_bytes(b"\x07not a safetensors file" * 10)
    with pytest.raises(OSError, match="model.safetensors"):
        checkpoints.load_model(directory)


def test_garbage_gguf(tmp_path, no_compiles):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + bytes(range(200)))
    with pytest.raises(OSError, match="bad.gguf"):
        checkpoints.load_model(path)


def write_gguf(path, tensors: dict, raw_dtypes: dict | None = None):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    for name, data in tensors.items():
        writer.add_tensor(name, data, raw_dtype=(raw_dtypes or {}).get(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_file_is_parsed_once_while_unchanged(tmp_path):
    """`load_config` and `load_model` share one parse of a GGUF file (gguf's reader takes
    6-11 s over SmolLM2's metadata); the same file by another path is the same parse, an
    edited one (a new modification time) is parsed again."""
    import os

    path = write_gguf(tmp_path / "m.gguf", {"blk.0.attn_norm.weight": np.ones(8, np.float32)})
    first = checkpoints.gguf_source(path)
    (tmp_path / "link.gguf").symlink_to(path)
    assert checkpoints.gguf_source(tmp_path / "link.gguf") is first
    mtime = path.stat().st_mtime_ns
    os.utime(path, ns=(mtime, mtime + 1_000_000_000))
    assert checkpoints.gguf_source(path) is not first


def test_the_transformers_reference_shares_only_ggufs_parse_and_puts_it_back(tmp_path):
    """`load_transformers` hands transformers the reader our loader parsed (only for that file,
    only with gguf's default arguments) and one tensor-name map per (arch, layers), and restores
    both `gguf` functions after the load, also when it fails."""
    import gguf

    from tlt_jax.rollout import bench

    path = write_gguf(tmp_path / "m.gguf", {"blk.0.attn_norm.weight": np.ones(8, np.float32)})
    other = write_gguf(tmp_path / "o.gguf", {"blk.0.attn_norm.weight": np.ones(8, np.float32)})
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError, match="inside"):
        with bench._gguf_parsed_once(path):
            assert gguf.GGUFReader(str(path)) is checkpoints.gguf_source(path).reader
            assert gguf.GGUFReader(path, "r") is not checkpoints.gguf_source(path).reader
            assert gguf.GGUFReader(other) is not checkpoints.gguf_source(other).reader
            arch = gguf.MODEL_ARCH.LLAMA
            assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
            assert gguf.get_tensor_name_map(arch, 2) is not gguf.get_tensor_name_map(arch, 3)
            raise RuntimeError("inside")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)


def test_a_llama_gguf_without_kv_head_count_has_as_many_kv_heads_as_heads(tmp_path):
    """llama.cpp writes `llama.attention.head_count_kv` only when the HF config names
    num_key_value_heads; the config then read as many kv heads as heads, but un-permuting k
    looked the count up with no default and crashed (int(None))."""
    import gguf

    heads, head_dim = 2, 4
    k_hf = np.arange(heads * head_dim * 8, dtype=np.float32).reshape(heads * head_dim, 8)
    # llama.cpp's permutation of q/k rows (convert_hf_to_gguf.py's `permute`).
    k_gguf = (k_hf.reshape(heads, 2, head_dim // 2, 8).swapaxes(1, 2)
              .reshape(k_hf.shape))  # fmt: skip
    path = tmp_path / "no_kv_count.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_head_count(heads)  # and no add_head_count_kv
    writer.add_tensor("blk.0.attn_k.weight", k_gguf)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    source = checkpoints.gguf_source(path)
    np.testing.assert_array_equal(source.read("model.layers.0.self_attn.k_proj.weight"), k_hf)


@pytest.mark.parametrize("qtype", ["I8", "IQ4_NL"])
def test_gguf_unsupported_quantisation(tmp_path, qtype, no_compiles):
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    block, type_size = gguf.GGML_QUANT_SIZES[kind]
    # I8 is stored as int8 values; IQ4_NL as raw blocks (bytes), 256 values per row.
    data = (
        np.ones((4, 256), np.int8)
        if qtype == "I8"
        else np.zeros((4, 256 // block * type_size), np.uint8)
    )
    path = write_gguf(
        tmp_path / "bad.gguf", {"blk.0.attn_q.weight": data}, {"blk.0.attn_q.weight": kind}
    )
    with pytest.raises(ValueError, match=rf"'blk\.0\.attn_q\.weight'.*{qtype}"):
        checkpoints.load_model(path)


def test_gguf_rope_frequency_tensor_is_refused(tmp_path, no_compiles):
    tensors = {
        "rope_freqs.weight": np.ones(8, np.float32),
        "token_embd.weight": np.ones((4, 8), np.float32),
    }
    path = write_gguf(tmp_path / "llama31.gguf", tensors)
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        checkpoints.load_model(path)


def test_sliding_window_is_refused(tmp_path, no_compiles):
    directory = write_config(tmp_path / "m", model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                             use_sliding_window=True)  # fmt: skip
    with pytest.raises(ValueError, match="use_sliding_window=True"):
        checkpoints.load_model(directory)


def test_llama_attention_bias_is_refused(tmp_path, no_compiles):
    """HF Llama's attention_bias also gives o_proj a bias, which the model has no place for:
    loading such a checkpoint dropped it silently (logits off by ~3 at scale ~1)."""
    directory = write_config(tmp_path / "m", attention_bias=True)
    with pytest.raises(ValueError, match="o_proj a bias"):
        checkpoints.load_model(directory)


def test_qwen2_always_has_qkv_biases(tmp_path, no_compiles):
    """HF Qwen2 builds q/k/v biases whatever config.json says, so the biases are read too."""
    directory = write_config(tmp_path / "m", model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                             attention_bias=False)  # fmt: skip
    assert checkpoints.load_config(directory).attention_bias


def test_unknown_short_name(no_compiles):
    with pytest.raises(FileNotFoundError, match="smollm2-999m-instruct"):
        checkpoints.resolve_model_path("smollm2-999m-instruct")


def test_missing_tensor_for_the_config(tiny, tmp_path, no_compiles):
    directory = tiny["qwen2_tied"][0]
    with pytest.raises(ValueError, match="lm_head.weight"):
        checkpoints.load_model(directory, tie_word_embeddings=False)


def _copy_with(source, directory, **tensors):
    """An HF directory: `source`'s config and weights, `tensors` added or replaced."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, directory)
    weights = load_file(directory / "model.safetensors")
    save_file({**weights, **tensors}, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def test_shape_mismatch_between_config_and_weights_names_the_tensor(tiny, tmp_path):
    directory = tiny["llama_llama3_untied"][0]
    config = checkpoints.load_config(directory)
    # A larger vocabulary than the config's: slicing each shard out of it loaded a part of it.
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' gives parameter embed "
                                         rf"shape \({config.vocab_size}, "):  # fmt: skip
        checkpoints.load_model(directory, vocab_size=config.vocab_size - 8)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.\w+_proj.weight'.*intermediate_s"):
        checkpoints.load_model(directory, intermediate_size=config.intermediate_size // 2)


def test_a_tensor_the_model_would_not_read_is_refused(tiny, tmp_path, no_compiles):
    # e.g. HF Llama's o_proj bias (attention_bias): dropping it would change the outputs.
    base = tiny["llama_llama3_untied"][0]
    width = checkpoints.load_config(base).hidden_size
    bias = np.ones(width, np.float32)
    directory = _copy_with(base, tmp_path / "m", **{"model.layers.0.self_attn.o_proj.bias": bias})
    with pytest.raises(ValueError, match=r"would not read: \['model.layers.0.self_attn.o_proj"):
        checkpoints.load_model(directory)
    # Rotary tables some checkpoints store are recomputed, not refused.
    inv_freq = np.ones(4, np.float32)
    rotary = {"model.layers.0.self_attn.rotary_emb.inv_freq": inv_freq}
    directory = _copy_with(base, tmp_path / "r", **rotary)
    checkpoints.load_model(directory)
