r"""RL step time and its phase breakdown for a config (default: the main job) on this machine.

    python scripts/bench_rl_step.py --output_json /tmp/bench_rl_step.json
    python scripts/bench_rl_step.py --config configs/smollm2_arith.py:smoke --steps 2 \
        --output_json /tmp/bench_smoke.json
    python scripts/bench_rl_step.py --layouts padded,packed --steps 2 \
        --output_json /tmp/bench_layouts.json
    python scripts/bench_rl_step.py --rl_sides remat=false,remat=true --steps 2 \
        --output_json /tmp/bench_remat.json

Runs `--warmup` RL steps (compilation; not measured) and `--steps` measured steps of the
config's GRPO loop in a temporary workdir, then, side by side with the same engine, prompts
and batch, plain decoding of exactly `max_new_tokens` per request (no stop token, hence no
long tail). The JSON has `step_time_s`, the phase seconds and shares, `rollout_share`,
`long_tail_share` (decode time with at most the SD threshold of requests running),
generated tokens/s in the rollout and in plain decoding, the update's padding share and
seconds per real token, and the command, model, batch and lengths.

With `--layouts`, it runs the same steps in each `rl.update_layout` instead, one trainer per
layout in one process, alternating (`tlt_jax.rl.bench.bench_update_layouts`), and reports
each layout's phase seconds and the ratios of the first layout's over the others'.
`--rl_sides` does the same for any `rl` field, one `field=value` per side
(`tlt_jax.rl.bench.bench_update_sides`).
"""

import json
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from tlt_jax import files
from tlt_jax.files import write_json

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", "configs/smollm2_arith.py", "Config file.", lock_config=True
)
flags.DEFINE_string("output_json", None, "Where to write the results.", required=True)
files.register_output_checks("output_json")
flags.DEFINE_integer("steps", 3, "Measured RL steps.", lower_bound=1)
flags.DEFINE_integer(
    "warmup", 1, "RL steps run first and not measured (compilation).", lower_bound=0
)
flags.DEFINE_list("layouts", [], "Compare these rl.update_layout values side by side.")
flags.DEFINE_list(
    "rl_sides",
    [],
    "Compare these `rl` settings side by side, one field=value "
    "per side (true/false/none/numbers parsed), e.g. remat=false,remat=true.",
)


def parse_sides(entries: list[str]) -> tuple[tuple[str, dict], ...]:
    """`["remat=false", "remat=true"]` -> sides `(("remat=false", {"remat": False}), ...)`,
    checked against the `rl` group's fields before anything compiles."""
    import dataclasses

    from tlt_jax.rl.config import RLConfig

    if not entries:
        return ()
    fields = {f.name for f in dataclasses.fields(RLConfig)} - {"algorithm"}
    words = {"true": True, "false": False, "none": None}
    sides = []
    for entry in entries:
        key, sep, text = entry.partition("=")
        if not sep or key not in fields:
            raise app.UsageError(f"--rl_sides entry {entry!r}: expected field=value with field "
                                 f"one of {sorted(fields)}")  # fmt: skip
        value: object = words.get(text.lower(), text)
        if isinstance(value, str):
            for kind in (int, float):
                try:
                    value = kind(text)
                    break
                except ValueError:
                    pass
        sides.append((entry, {key: value}))
    if len(sides) < 2 or len({name for name, _ in sides}) < len(sides):
        raise app.UsageError(f"--rl_sides={entries}: expected two or more distinct entries")
    return tuple(sides)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from tlt_jax import programs

    programs.SHARED.enabled = False  # each side pays its own compiles, as a run of its own would
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every file at INFO
    from tlt_jax.rl.bench import bench_rl_step, bench_update_layouts, bench_update_sides
    from tlt_jax.rl.config import UPDATE_LAYOUTS

    bad = [x for x in FLAGS.layouts if x not in UPDATE_LAYOUTS]
    if bad or len(FLAGS.layouts) == 1:
        raise app.UsageError(f"--layouts={FLAGS.layouts}: expected two or more of "
                             f"{list(UPDATE_LAYOUTS)}")  # fmt: skip
    if FLAGS.layouts and FLAGS.rl_sides:
        raise app.UsageError("--layouts and --rl_sides: give one of them")
    sides = parse_sides(FLAGS.rl_sides)
    command = "python " + " ".join(sys.argv)
    print(command, flush=True)
    if sides:
        result = bench_update_sides(FLAGS.config, steps=FLAGS.steps, warmup=FLAGS.warmup,
                                    sides=sides)  # fmt: skip
    elif FLAGS.layouts:
        result = bench_update_layouts(FLAGS.config, steps=FLAGS.steps, warmup=FLAGS.warmup,
                                      layouts=tuple(FLAGS.layouts))  # fmt: skip
    else:
        result = bench_rl_step(FLAGS.config, steps=FLAGS.steps, warmup=FLAGS.warmup)
    result["command"] = command
    write_json(FLAGS.output_json, result, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k not in ("per_step", "config")},
                     indent=2, default=str)[:20000])  # fmt: skip


if __name__ == "__main__":
    app.run(main)
