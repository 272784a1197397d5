r"""Speculative decoding vs plain decoding on SmolLM2: tokens/s, acceptance, the adaptive policy.

  python scripts/bench_spec.py --drafter /tmp/drafter_warm/eagle \
      --hot_vocab /tmp/drafter_warm/run/responses.jsonl --output_json /tmp/bench_spec.json
  python scripts/bench_spec.py --draft ngram --output_json /tmp/bench_spec_ngram.json
  python scripts/bench_spec.py --adaptive --output_json /tmp/bench_adaptive.json  # + --drafter

Greedy, on GSM8K *test* questions in the RL prompt template (arithmetic questions when the
folder is missing). Without --adaptive: one draft source (--draft) at fixed strategies: the
batch-1 grid, the batch sweep and crossover batch, the switch cost and the step breakdown
(`tlt_jax.rollout.spec_bench.bench_fixed`). With --adaptive: plain decoding vs TLT's adaptive
policy per batch size, runs alternating, `adaptive_over_plain` (`bench.bench_adaptive`).
"""

import dataclasses
import sys
from pathlib import Path

from absl import app, flags

from tlt_jax import files
from tlt_jax.files import to_json, write_json

SHARED = Path(__file__).resolve().parent.parent.parent / "shared"
flags.DEFINE_string("output_json", None, "Where to write the JSON results.")
files.register_output_checks("output_json")
flags.DEFINE_string("model", "smollm2-135m-instruct", "Policy: HF directory, .gguf or short name.")
flags.DEFINE_string("drafter", "", "EAGLE drafter directory (scripts/train_drafter.py export).")
flags.DEFINE_enum("draft", "", ["", "eagle", "ngram", "hybrid"], "Draft source; default eagle "
                  "with --drafter, else ngram (--adaptive: ngram, + eagle, hybrid).")  # fmt: skip
flags.DEFINE_bool("adaptive", False, "Plain vs the adaptive step policy per batch size.")
flags.DEFINE_string("gsm8k_dir", str(SHARED / "data" / "gsm8k"), "Folder with GSM8K test.jsonl.")
flags.DEFINE_string("drafter_note", "", "Free text for the JSON: the drafter's data and training.")
flags.DEFINE_integer(
    "num_prompts", 2, "Batch-1 prompts (each generated on its own).", lower_bound=1
)
flags.DEFINE_integer(
    "max_new_tokens", 64, "Tokens generated per request at batch 1.", lower_bound=1
)
flags.DEFINE_integer(
    "sweep_new_tokens", 32, "Tokens per request in the batch and adaptive sweeps.", lower_bound=1
)
flags.DEFINE_string("grid", "2,4,6x4,8,16", "Batch-1 grid: 'depths x verify_tokens'.")
flags.DEFINE_integer("topk", 4, "Top-k of every grid strategy.", lower_bound=1)
flags.DEFINE_integer(
    "hot_vocab_size", 2048, "Hot draft vocabulary size (0: full vocab only).", lower_bound=0
)
flags.DEFINE_string("hot_vocab", "", "hot_vocab.json or warm-up responses.jsonl to count tokens "
                    "from; default DRAFTER/hot_vocab.json.")  # fmt: skip
flags.DEFINE_enum("full_vocab", "per_depth", ["per_depth", "all", "none"],
                  "Grid points also drafted with the full vocabulary.")  # fmt: skip
flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8", "16", "32"], "Batch and adaptive sweeps.")
flags.DEFINE_list("switch_batches", ["1", "4", "16"], "Batch sizes of the SD switch-cost runs.")
flags.DEFINE_list("switch_lags", ["32", "128"], "Plain steps before the switch into SD.")
flags.DEFINE_integer("repeats", 2, "Timed runs per fixed point (the best is kept).", lower_bound=1)
flags.DEFINE_bool("breakdown", True, "Time the programs of a batch-1 SD step separately.")
flags.DEFINE_integer(
    "adaptive_repeats", 5, "Timed (plain, adaptive) pairs per batch size.", lower_bound=1
)
flags.DEFINE_enum("drafter_sync", "eager", ["eager", "lazy"], "The adaptive engine's drafter sync.")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from tlt_jax import programs

    programs.SHARED.enabled = False  # each side pays its own compiles, as a run of its own would
    from tlt_jax.rollout import spec_bench

    names = [f.name for f in dataclasses.fields(spec_bench.SpecBenchConfig)]
    try:
        config = spec_bench.SpecBenchConfig(**{name: FLAGS[name].value for name in names})
    except ValueError as e:
        raise app.UsageError(f"--{e}") from e  # the message starts with the field = flag name
    # Before the model loads. The default GSM8K folder may be absent (arithmetic questions
    # instead, said in the JSON); one given on the command line must hold the test split.
    if FLAGS["gsm8k_dir"].present and not (Path(FLAGS.gsm8k_dir) / "test.jsonl").is_file():
        raise app.UsageError(f"--gsm8k_dir={FLAGS.gsm8k_dir!r} has no test.jsonl")
    if FLAGS.drafter:
        from tlt_jax.drafter.export import check_eagle_dir

        try:
            check_eagle_dir(FLAGS.drafter, "--drafter")
        except FileNotFoundError as e:
            raise app.UsageError(str(e)) from e
    command = " ".join([sys.executable.split("/")[-1]] + sys.argv)
    print(f"command: {command}", flush=True)
    result = {"command": command, **spec_bench.run(config)}
    print(to_json(result, indent=2))
    print(f"command: {command}")
    if FLAGS.output_json:
        write_json(FLAGS.output_json, result, indent=2)


if __name__ == "__main__":
    app.run(main)
