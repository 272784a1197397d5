r"""TLT's bandit against simulated arms: following a drafter that trains during RL.

  python scripts/bench_bandit.py --output_json /tmp/bench_bandit.json

A simulation, not a timing (`tlt_jax.rollout.bandit_bench`): plain decoding, n-gram drafts
and the drafter's EAGLE tree as arms of known speed per RL step, with --noise timing noise on
every recorded reward, --sd_steps SD-mode decode steps per RL step. Per scenario ("improving":
a cold start passing plain; "weak"; "strong") and side (the bandit told of every new drafter
version at the step boundary, as the RL loop does, or not), the time an oracle that knows
the speeds would take over the time of the bandit's choices, over --seeds seeds (1.0: the
oracle). One batch bucket: a real rollout pays the retries in each of its buckets. Seconds
of CPU.
"""

import sys

from absl import app, flags

from tlt_jax import files
from tlt_jax.files import to_json, write_json

flags.DEFINE_string("output_json", None, "Where to write the JSON results.")
files.register_output_checks("output_json")
flags.DEFINE_list("scenarios", ["improving", "weak", "strong"], "Arm-speed scenarios.")
flags.DEFINE_integer("seeds", 20, "Seeds per scenario and side.", lower_bound=1)
flags.DEFINE_integer("rl_steps", 16, "RL steps (drafter versions) per run.", lower_bound=1)
flags.DEFINE_integer("sd_steps", 150, "SD-mode decode steps per RL step.", lower_bound=1)
flags.DEFINE_float("noise", 0.1, "Relative timing noise (standard deviation).", lower_bound=0)
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from tlt_jax.rollout import bandit_bench

    for name in FLAGS.scenarios:  # named before anything runs
        try:
            bandit_bench.scenario(name, FLAGS.rl_steps)
        except ValueError as e:
            raise app.UsageError(f"--scenarios: {e}") from e
    command = " ".join([sys.executable.split("/")[-1]] + sys.argv)
    result = {"command": command, **bandit_bench.run(
        scenarios=tuple(FLAGS.scenarios), seeds=FLAGS.seeds, rl_steps=FLAGS.rl_steps,
        sd_steps=FLAGS.sd_steps, noise=FLAGS.noise)}  # fmt: skip
    print(to_json(result, indent=2))
    print(f"command: {command}")
    if FLAGS.output_json:
        write_json(FLAGS.output_json, result, indent=2)


if __name__ == "__main__":
    app.run(main)
