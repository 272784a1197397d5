r"""The packed update in steady state, rows sharing prompts (`rl.share_prompts`) off vs on.

    python scripts/bench_update_packing.py --output_json /tmp/bench_update_packing.json
    python scripts/bench_update_packing.py --lengths_json /tmp/bench_tlt.json \
        --output_json /tmp/bench_update_packing.json

Packs each step's responses both ways, compiles every micro-batch shape first, then times the
gradient programs of each step's trained micro-batches, the two sides back to back, the first
of them alternating from repeat to repeat (`tlt_jax.rl.bench_packing.time_sides`); the off / on
ratio comes with its spread over the `--repeats` passes. Lengths: `--lengths_json` (a list
of per-step lists, or a `scripts/bench_tlt.py` output, whose recorded response lengths it
reads), else `--steps` long-tailed steps of the config's `prompts_per_step x group_size`
responses (lognormal, `--p50`). What a run also pays, a compile the first time a row count
appears, is left out: `scripts/bench_rl_step.py --rl_sides
share_prompts=false,share_prompts=true` shows both.
"""

import json
import sys

from absl import app, flags
from ml_collections import config_flags

from tlt_jax import files
from tlt_jax.files import to_json, write_json

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config",
    "configs/smollm2_arith.py",
    "Config file (policy, rl and rollout groups).",
    lock_config=True,
)
flags.DEFINE_string("output_json", None, "Where to write the results.", required=True)
files.register_output_checks("output_json")
flags.DEFINE_string("lengths_json", None, "Recorded response lengths (see above).")
flags.DEFINE_list("step_indices", [], "With --lengths_json: which recorded steps (default all).")
flags.DEFINE_integer("steps", 4, "Synthetic steps (without --lengths_json).", lower_bound=1)
flags.DEFINE_float("p50", 53.0, "Synthetic lengths' median (the main job's step 1: 52).")
flags.DEFINE_integer("prompt_len", 55, "Tokens per prompt (the main job's: 40-64).", lower_bound=1)
flags.DEFINE_float("signal_fraction", 1.0, "Share of groups the update trains.")
flags.DEFINE_integer("repeats", 3, "Timed passes over the steps (the ratio's spread is "
                     "over them).", lower_bound=1)  # fmt: skip


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from tlt_jax.rl import bench_packing

    config = FLAGS.config
    if FLAGS.lengths_json:
        try:
            with open(FLAGS.lengths_json) as f:
                lengths = bench_packing.recorded_lengths(json.load(f))
        except (OSError, ValueError) as e:
            raise app.UsageError(f"--lengths_json={FLAGS.lengths_json}: {e}") from e
        try:
            picked = [int(i) for i in FLAGS.step_indices]
        except ValueError as e:
            raise app.UsageError(f"--step_indices={FLAGS.step_indices}: expected integers") from e
        bad = [i for i in picked if not 0 <= i < len(lengths)]
        if bad:
            raise app.UsageError(f"--step_indices {bad}: {FLAGS.lengths_json} has "
                                 f"{len(lengths)} steps")  # fmt: skip
        lengths = [lengths[i] for i in picked] if picked else lengths
    else:
        if FLAGS.p50 <= 0:
            raise app.UsageError(f"--p50={FLAGS.p50} must be > 0")
        responses = config.rl.prompts_per_step * config.rl.group_size
        lengths = bench_packing.long_tail_lengths(FLAGS.steps, responses,
                                                  config.rollout.max_new_tokens,
                                                  p50=FLAGS.p50)  # fmt: skip
    if not 0 < FLAGS.signal_fraction <= 1:
        raise app.UsageError(f"--signal_fraction={FLAGS.signal_fraction} must be in (0, 1]")
    command = "python " + " ".join(sys.argv)
    print(command, flush=True)
    try:
        bench_packing.validate(config, lengths, FLAGS.prompt_len)
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    result = bench_packing.bench_update_packing(
        config, lengths, prompt_len=FLAGS.prompt_len, signal_fraction=FLAGS.signal_fraction,
        repeats=FLAGS.repeats,
    )  # fmt: skip
    result["command"] = command
    write_json(FLAGS.output_json, result, indent=2)
    print(to_json(result, indent=2))


if __name__ == "__main__":
    app.run(main)
