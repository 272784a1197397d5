r"""Batched generation with the rollout engine.

  python scripts/generate.py --prompts prompts.jsonl --output out.jsonl \
      --model smollm2-135m-instruct --max_new_tokens 128

Each input line has `prompt` (raw text, encoded as given) or `messages` (chat, templated by the
tokenizer); generation stops on the ids RL stops on (`tlt_jax.data.tokenizer.stop_token_ids`:
eos and end-of-turn tokens such as `<|im_end|>`). Each output line has `index`, `text`,
`token_ids`, `logprobs`, `finish_reason`, `accepted_lengths` (one entry per speculative step),
in input order. Speculative decoding with an EAGLE drafter (or model-free n-gram drafts, or
both merged into one tree):

  python scripts/generate.py ... --drafter /path/to/eagle_dir --spec_strategy 8,4,48
  python scripts/generate.py ... --draft ngram --spec_strategy 4,1,5
  python scripts/generate.py ... --drafter /path/to/eagle_dir --draft hybrid
"""

from absl import app, flags

from tlt_jax.rollout import generate

flags.DEFINE_string("model", "smollm2-135m-instruct", "HF dir, .gguf file or short name.")
flags.DEFINE_string("prompts", None, "JSONL with `prompt` or `messages` per line.", required=True)
flags.DEFINE_string("output", None, "Output JSONL path.", required=True)
flags.DEFINE_integer("max_new_tokens", 256, "Tokens to generate per prompt at most.")
flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
flags.DEFINE_float("top_p", 1.0, "Nucleus mass (1 disables).")
flags.DEFINE_integer("top_k", 0, "Top-k (0 disables).", lower_bound=0)
flags.DEFINE_integer(
    "seed", 0, "Request i samples with seed + i (mod 2**32).", lower_bound=0, upper_bound=2**32 - 1
)  # a request's PRNG stream is keyed by a uint32
flags.DEFINE_integer("max_batch_size", 32, "Concurrent requests (slots).", lower_bound=1)
flags.DEFINE_integer(
    "max_seq_len", 2048, "Prompt + generated tokens per request at most.", lower_bound=1
)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Params and compute dtype.")
flags.DEFINE_string("drafter", "", "Exported HF-EAGLE drafter dir: speculative decoding on.")
flags.DEFINE_enum("draft", "", ["", "eagle", "ngram", "hybrid"], "Draft source (default: eagle "
                  "with --drafter, plain without; ngram needs no drafter).")  # fmt: skip
flags.DEFINE_string("spec_strategy", "8,4,48", "SD strategy depth,topk,verify_tokens.")
flags.DEFINE_integer(
    "hot_vocab", 2048, "Draft over this many hot tokens (0: full vocabulary).", lower_bound=0
)
flags.DEFINE_integer(
    "spec_max_batch", 0, "SD only at <= this many running requests (0: always).", lower_bound=0
)
flags.DEFINE_enum("drafter_sync", "eager", ["eager", "lazy"],
                  "Plain steps keep the drafter in sync (its layer in every plain step) or leave "
                  "it behind (caught up at the switch into SD).")  # fmt: skip


def main(argv):
    del argv
    f = flags.FLAGS
    config = generate.GenerateConfig(
        model=f.model, prompts=f.prompts, output=f.output, max_new_tokens=f.max_new_tokens,
        temperature=f.temperature, top_p=f.top_p, top_k=f.top_k, seed=f.seed,
        max_batch_size=f.max_batch_size, max_seq_len=f.max_seq_len, dtype=f.dtype,
        drafter=f.drafter, draft=f.draft, spec_strategy=f.spec_strategy,
        spec_max_batch=f.spec_max_batch, hot_vocab=f.hot_vocab, drafter_sync=f.drafter_sync,
    )  # fmt: skip
    summary = generate.run(config)
    print(
        f"{summary['requests']} requests, {summary['generated_tokens']} tokens in "
        f"{summary['seconds']:.1f}s ({summary['tokens_per_s']:.1f} tok/s; "
        f"{summary['compile_count']} programs compiled in {summary['compile_seconds']:.1f}s) "
        f"-> {f.output}"
    )
    if summary["spec_steps"]:
        print(f"{summary['spec_steps']} speculative steps ({summary['draft']} drafts), mean "
              f"accepted length {summary['mean_accepted_length']:.2f}")  # fmt: skip


if __name__ == "__main__":
    app.run(main)
