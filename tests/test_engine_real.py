"""The engine's greedy output equals HF transformers' greedy `generate` on the real model."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tlt_jax.models import checkpoints  # noqa: E402
from tlt_jax.rollout.engine import EngineConfig, Request, RolloutEngine  # noqa: E402

PROMPTS = [
    [{"role": "user", "content": "What is 17 + 25?"}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Translate 'good morning' into French."}],
]
NEW_TOKENS = 24


@pytest.mark.slow
def test_greedy_matches_transformers_generate():
    name = "smollm2-135m-instruct"
    path = checkpoints.resolve_model_path(name)
    tokenizer = checkpoints.load_tokenizer(name)
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
               for m in PROMPTS]  # fmt: skip
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]

    engine = RolloutEngine(checkpoints.load_model(name),
                           EngineConfig(max_batch_size=2, max_seq_len=256))  # fmt: skip
    eos = tokenizer.eos_token_id
    requests = [Request(p, NEW_TOKENS, stop_ids=(eos,)) for p in prompts]
    ours = [c.token_ids for c in engine.generate(requests)]

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    hf.eval()
    for prompt, tokens in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                              eos_token_id=eos, do_sample=False)  # fmt: skip
        # Both stop after (and keep) the first EOS, or after NEW_TOKENS tokens.
        assert tokens == out[0, len(prompt) :].tolist()
