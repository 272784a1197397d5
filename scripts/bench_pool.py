r"""The executable pool's size: one SD strategy vs all (batch, strategy) pairs vs TLT's buckets.

  nice -n 10 python scripts/bench_pool.py --output_json /tmp/bench_pool.json
  nice -n 10 python scripts/bench_pool.py --strategy_set paper \
      --output_json /tmp/bench_pool_paper.json
  python scripts/bench_pool.py --preset tiny  # random tiny model: 19 small programs

Compiles three pools with fresh rollout engines (SmolLM2-135M, a random EAGLE drafter: only
program sizes matter) and reports, per pool, the SD programs by kind, their compile seconds and
XLA's memory analysis summed (generated code + temp; arguments and outputs), and the ratios
naive/bucketed (TLT: 30.39 / 10.69 GB of CUDA graphs) (`tlt_jax.rollout.pool_bench`).

Measured on CPU (f32, 2 shared cores, kv 256, batch buckets 1-32, hot vocab 2048, sampled), SD
programs / compile s / temp GB (XLA's CPU backend reports no generated-code size):
  spec defaults: single 4,1,5 18 / 45 / 0.81; naive 72 / 253 / 2.84; bucketed 18 / 49 / 0.64
  paper:         single 8,4,48 18 / 122 / 4.03; naive 54 / 288 / 8.80; bucketed 18 / 76 / 1.29
so naive/bucketed = 4.5x (spec) and 6.8x (paper) in executable memory (TLT: 2.8x).
"""

import dataclasses
import sys

from absl import app, flags

from tlt_jax import files
from tlt_jax.files import to_json, write_json

flags.DEFINE_string("output_json", None, "Where to write the JSON results.")
files.register_output_checks("output_json")
flags.DEFINE_string("model", "smollm2-135m-instruct", "Policy: HF directory, .gguf or short name.")
flags.DEFINE_enum("preset", "", ["", "tiny"], "tiny: random tiny model, small strategies and "
                  "sizes (flags given explicitly still apply).")  # fmt: skip
flags.DEFINE_enum("strategy_set", "spec", ["spec", "paper"], "BEG buckets and strategies: the spec "
                  "group's defaults, or TLT's 8,4,48/32/16/8 at bounds 1,2,5,21.")  # fmt: skip
flags.DEFINE_string("single", "", "The single-strategy pool's strategy (default: bucket 0's).")
flags.DEFINE_list("sources", ["eagle"], "Draft sources of every arm (ngram and hybrid reuse "
                  "eagle's programs).")  # fmt: skip
flags.DEFINE_integer("threshold", 0, "The bandit's threshold (0: max_batch_size).", lower_bound=0)
flags.DEFINE_integer("max_batch_size", 32, "The engine's largest batch bucket.", lower_bound=1)
flags.DEFINE_integer("kv_len", 256, "The one kv bucket.", lower_bound=1)
flags.DEFINE_integer("hot_vocab", 2048, "Draft head size (0: the full vocabulary).", lower_bound=0)
flags.DEFINE_bool("greedy", False, "Greedy requests (default: sampled, as GRPO rollouts are).")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from tlt_jax import programs

    programs.SHARED.enabled = False  # each side pays its own compiles, as a run of its own would
    import logging

    from tlt_jax.rollout import pool_bench

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    names = [f.name for f in dataclasses.fields(pool_bench.PoolBenchConfig)]
    values = {name: FLAGS[name].value for name in names}
    values["sources"] = tuple(values["sources"])
    try:
        if FLAGS.preset == "tiny":
            given = {n: v for n, v in values.items() if FLAGS[n].present and n != "preset"}
            config = pool_bench.PoolBenchConfig.tiny(**given)
        else:
            config = pool_bench.PoolBenchConfig(**values)
    except ValueError as e:
        raise app.UsageError(f"--{e}") from e  # the message starts with the field = flag name
    command = " ".join([sys.executable.split("/")[-1]] + sys.argv)
    print(f"command: {command}", flush=True)
    result = {"command": command, **pool_bench.run(config)}
    print(to_json(result, indent=2))
    print(f"command: {command}")
    if FLAGS.output_json:
        write_json(FLAGS.output_json, result, indent=2)


if __name__ == "__main__":
    app.run(main)
