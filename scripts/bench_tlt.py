r"""TLT vs plain GRPO steps side by side (same seeds and prompts): rollout, tail and whole step.

    python scripts/bench_tlt.py --output_json /tmp/bench_tlt.json
    python scripts/bench_tlt.py --config configs/tiny.py --steps 1 --batch_multipliers 1 \
        --output_json /tmp/bench_tlt_tiny.json

Runs the config twice in one process, `spec.mode=off` and TLT's adaptive rollouts (the
config's `spec` group; `adaptive` if it says `off`), from the same weights: first greedy
rollouts of the same requests on both engines (identical tokens, exact ratios), then
`--warmup` + `--steps` RL steps per side in alternating order, at the config's batch and at
each `--batch_multipliers` multiple of it. With `--same_policy` (the default) both sides start
every step from the same policy, so they sample nearly the same responses and the step ratio
measures the engines; `--nosame_policy` lets each side follow its own samples. Ratios are
plain / TLT (`tlt_jax/rl/bench_tlt.py`).
"""

import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from tlt_jax import files
from tlt_jax.files import to_json, write_json

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", "configs/smollm2_arith.py", "Config file.", lock_config=True
)
flags.DEFINE_string("output_json", None, "Where to write the results.", required=True)
files.register_output_checks("output_json")
flags.DEFINE_integer("steps", 2, "Measured RL steps per side.", lower_bound=1)
flags.DEFINE_integer("warmup", 1, "RL steps per side run first and not measured.", lower_bound=0)
flags.DEFINE_list("batch_multipliers", ["1", "2"], "Prompts per step times these.")
flags.register_validator("batch_multipliers",
                         lambda values: all(v.isdigit() and int(v) >= 1 for v in values),
                         message="--batch_multipliers must be integers >= 1")  # fmt: skip
flags.DEFINE_integer("greedy_repeats", 3, "Timed greedy rollouts per side (alternating).",
                     lower_bound=1)  # fmt: skip
flags.DEFINE_bool(
    "same_policy",
    True,
    "Start every RL step of both sides from the plain side's policy (False: each side follows "
    "its own samples).",
)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from tlt_jax import programs

    programs.SHARED.enabled = False  # each side pays its own compiles, as a run of its own would
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every file at INFO
    from tlt_jax.metrics import plots
    from tlt_jax.rl.bench_tlt import bench_tlt

    command = "python " + " ".join(sys.argv)
    print(command, flush=True)

    def partial(result):  # each multiplier's figures on disk once measured
        write_json(FLAGS.output_json, {**result, "command": command, "partial": True}, indent=2)

    result = bench_tlt(FLAGS.config, steps=FLAGS.steps, warmup=FLAGS.warmup,
                       batch_multipliers=tuple(int(m) for m in FLAGS.batch_multipliers),
                       greedy_repeats=FLAGS.greedy_repeats, same_policy=FLAGS.same_policy,
                       on_batch=partial)  # fmt: skip
    result["command"] = command
    write_json(FLAGS.output_json, result, indent=2)
    stem = FLAGS.output_json.removesuffix(".json")
    for m, r in result["by_batch"].items():
        # Reward and accuracy of both sides per step (same seeds; with --same_policy both
        # sample each step from the same policy, so the curves compare the two samplers), and
        # each side's last rollout: running requests over time with SD steps shaded.
        tlt_label = "TLT (same policy)" if FLAGS.same_policy else "TLT"
        plots.plot_tlt_vs_plain(r["per_step"]["tlt"], r["per_step"]["plain"],
                                f"{stem}_x{m}_reward.png", labels=(tlt_label, "plain"))  # fmt: skip
        for name, timeline in r["last_timeline"].items():
            plots.plot_rollout_timeline(timeline, r["threshold"], f"{stem}_x{m}_{name}.png",
                                        title=f"{name} rollout, batch x{m}")  # fmt: skip
    hidden = ("per_step", "calibration", "last_timeline", "response_lengths")
    summary = {m: {k: v for k, v in r.items() if k not in hidden}
               for m, r in result["by_batch"].items()}  # fmt: skip
    print(to_json(summary, indent=2))


if __name__ == "__main__":
    app.run(main)
