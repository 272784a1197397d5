r"""Drafter warm-up: generate with the policy, train the EAGLE drafter on its features, export.

    python scripts/train_drafter.py --model=/path/to/hf_model --prompts=prompts.jsonl \
        --workdir=/tmp/drafter --max_steps=2000 --export_dir=/tmp/drafter/eagle

Re-running with the same --workdir resumes (cached responses, latest orbax checkpoint).
"""

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "HF directory, .gguf file or short model name.", required=True)
flags.DEFINE_string("prompts", None, "JSONL with 'prompt' (a question, rendered like RL prompts) "
                    "or 'messages' (a chat) per line.", required=True)  # fmt: skip
flags.DEFINE_string("workdir", None, "Checkpoints and cached responses.", required=True)
flags.DEFINE_string("export_dir", None, "EAGLE output directory (default workdir/eagle).")
flags.DEFINE_integer("max_steps", 1000, "Drafter optimizer steps.")
flags.DEFINE_integer("max_new_tokens", 1024, "Response length limit for generation.")
flags.DEFINE_integer("max_prompts", None, "Use at most this many prompts.")
flags.DEFINE_integer("batch_rows", 4, "Packed rows per training batch.")
flags.DEFINE_integer("row_len", 2048, "Tokens per packed row.")
flags.DEFINE_integer("window", 512, "Maximum training window (tokens).")
flags.DEFINE_float("lr", 5e-5, "Peak learning rate.")
flags.DEFINE_integer("warmup_steps", 100, "Linear learning-rate warm-up steps.")
flags.DEFINE_integer("checkpoint_every", 100, "Steps between orbax checkpoints.")
flags.DEFINE_float("temperature", 0.0, "Generation temperature (0: greedy).")
flags.DEFINE_integer("seed", 0, "Seed for init, generation and batches.")
flags.DEFINE_string("instruction", None, "RL prompt instruction (default: the RL pipeline's).")
flags.DEFINE_integer(
    "hot_vocab",
    2048,
    "Train the draft head's cross-entropy over the responses' "
    "this many most frequent tokens, as generate.py --hot_vocab drafts over them "
    "(0: the full vocabulary).",
)
flags.DEFINE_integer(
    "unroll_steps",
    1,
    "Training-time test: also train drafting levels 2..N on the drafter's own fed-back "
    "features (1: plain EAGLE). Costs about N forward passes per step.",
)
flags.DEFINE_float("unroll_decay", 0.8, "Loss weight of level m is unroll_decay ** (m - 1).")
flags.DEFINE_string("dtype", None, "Override the policy's param/compute dtype, e.g. bfloat16.")


def main(argv):
    del argv
    from tlt_jax.drafter.trainer import DrafterTrainConfig
    from tlt_jax.drafter.warmup import WarmupConfig, run_warmup
    from tlt_jax.models.checkpoints import load_model, load_tokenizer

    overrides = {"param_dtype": FLAGS.dtype, "dtype": FLAGS.dtype} if FLAGS.dtype else {}
    train = DrafterTrainConfig(
        learning_rate=FLAGS.lr, warmup_steps=min(FLAGS.warmup_steps, FLAGS.max_steps - 1),
        total_steps=FLAGS.max_steps, window=FLAGS.window, batch_rows=FLAGS.batch_rows,
        row_len=FLAGS.row_len, checkpoint_every=FLAGS.checkpoint_every,
        unroll_steps=FLAGS.unroll_steps, unroll_decay=FLAGS.unroll_decay,
    )  # fmt: skip
    # Without --instruction, WarmupConfig's default: the RL pipeline's instruction.
    instruction = {} if FLAGS.instruction is None else {"instruction": FLAGS.instruction}
    config = WarmupConfig(
        prompts=FLAGS.prompts, workdir=FLAGS.workdir, export_dir=FLAGS.export_dir,
        max_new_tokens=FLAGS.max_new_tokens, max_prompts=FLAGS.max_prompts,
        temperature=FLAGS.temperature, seed=FLAGS.seed, hot_vocab_size=FLAGS.hot_vocab or None,
        train=train, **instruction,
    )  # fmt: skip
    out = run_warmup(config, load_model(FLAGS.model, **overrides), load_tokenizer(FLAGS.model),
                     max_steps=FLAGS.max_steps)  # fmt: skip
    print(f"exported EAGLE drafter to {out}")


if __name__ == "__main__":
    app.run(main)
