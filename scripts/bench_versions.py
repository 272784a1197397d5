r"""The whole RL step of an earlier commit beside this checkout's, in one process, alternating.

  python scripts/bench_versions.py --ref 6da61a4 --steps 4 --output_json /tmp/bench_versions.json

A speed-up that a micro-benchmark shows has to reach the RL step; this measures that. The
package (`tlt_jax`, `pallas_kernels`) at `--ref` is exported with `git archive` into a
temporary folder under another name (`tlt_jax_<ref>`: every import rewritten), so both
versions load in one process and share its machine load. One trainer per version on the same
config (`--config`), the same prompts each step, the order of the two alternating step by
step; rollouts plain by default (`--plain_rollouts`: the bandit's wall-clock choices would
draw other samples on each side). Per step: rollout, phase and step seconds, compiles, and
the ratios old / new (above 1: this checkout is faster). The first steps compile; later ones
show the steady state, so run enough steps to see both.
"""

import dataclasses
import importlib
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from tlt_jax import files
from tlt_jax.files import to_json, write_json

REPO = Path(__file__).resolve().parent.parent
_CONFIG = config_flags.DEFINE_config_file("config", str(REPO / "configs/smollm2_arith.py"),
                                          "The run config both versions train.")  # fmt: skip
_REF = flags.DEFINE_string("ref", None, "The earlier commit (any git revision).", required=True)
_STEPS = flags.DEFINE_integer(
    "steps", 4, "RL steps per side (the first ones compile).", lower_bound=1
)
_PLAIN = flags.DEFINE_bool("plain_rollouts", True, "spec.mode=off on both sides.")
_OUTPUT = flags.DEFINE_string("output_json", None, "Where to write the JSON results.")
files.register_output_checks("output_json")
PACKAGES = ("tlt_jax", "pallas_kernels")
KEYS = ("time_rollout", "time_logprob", "time_update", "step_time", "compile_count", "compile_s")
# Also recorded when the side's trainer reports them (older commits may not): what the update
# computed, so that updates over different samples compare per computed position.
UPDATE_KEYS = ("update_tokens_computed", "update_padding_share", "micro_batches_trained")


def resolve(ref: str) -> str:
    """The short commit id of `ref` in this repository (a usage error when it names none)."""
    found = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", f"{ref}^{{commit}}"],
                           capture_output=True, text=True)  # fmt: skip
    if found.returncode:
        raise app.UsageError(f"--ref={ref!r} is not a commit of {REPO}: {found.stderr.strip()}")
    return found.stdout.strip()


def export(commit: str, root: Path) -> str:
    """Exports the packages at `commit` under `root` as `<package>_<commit>`; returns the
    suffix."""
    suffix = f"_{commit}"
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, *PACKAGES],
                             check=True, capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    pattern = re.compile(r"\b(" + "|".join(PACKAGES) + r")\b")
    for package in PACKAGES:
        (root / package).rename(root / f"{package}{suffix}")
        for path in (root / f"{package}{suffix}").rglob("*.py"):
            path.write_text(pattern.sub(lambda m: m.group(1) + suffix, path.read_text()))
    return suffix


def load_trainer_classes(suffix: str):
    """The (TrainConfig, Trainer, default config dict) of an exported version."""
    import tensorflow_datasets as tfds

    # The data builders are registered by name once per process (this checkout's came first).
    with tfds.core.registered.skip_registration():
        config = importlib.import_module(f"tlt_jax{suffix}.rl.config")
        trainer = importlib.import_module(f"tlt_jax{suffix}.rl.trainer")
    return config.TrainConfig, trainer.Trainer, config.default_config_dict().to_dict()


def known_fields(config: dict, known: dict, path: str = "") -> tuple[dict, dict]:
    """(`config` without the fields an older version's defaults `known` lack, those fields).

    A field added after `--ref` is left out of the old side's config (the old code has no such
    setting: it runs as it did), and so is one this checkout leaves unset (None: resolved per
    backend) where the old version has a value (it keeps its own default); the dropped fields
    are printed and written to the JSON.
    """
    kept, dropped = {}, {}
    for key, value in config.items():
        name = f"{path}{key}"
        if key not in known:
            dropped[name] = value
        elif value is None and known[key] is not None:
            kept[key], dropped[name] = known[key], value
        elif isinstance(value, dict) and isinstance(known[key], dict):
            kept[key], more = known_fields(value, known[key], f"{name}.")
            dropped.update(more)
        else:
            kept[key] = value
    return kept, dropped


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from tlt_jax import programs

    programs.SHARED.enabled = False  # each side pays its own compiles, as a run of its own would
    if _STEPS.value < 1:
        raise app.UsageError(f"--steps={_STEPS.value} must be >= 1")
    commit = resolve(_REF.value)  # before anything loads or compiles
    from tlt_jax.rl.config import TrainConfig
    from tlt_jax.rl.trainer import Trainer

    command = " ".join(["python"] + sys.argv)
    print(command, flush=True)
    config_dict = _CONFIG.value.to_dict()
    records: dict[str, list[dict]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="bench_versions_") as root:
        suffix = export(commit, Path(root))
        sys.path.insert(0, root)
        old_config, old_trainer, old_defaults = load_trainer_classes(suffix)
        old_dict, dropped = known_fields(config_dict, old_defaults)
        if dropped:
            print(f"fields {_REF.value} does not have, left out of its config: {dropped}")
        classes = {"old": (old_config, old_trainer, old_dict),
                   "new": (TrainConfig, Trainer, config_dict)}  # fmt: skip
        trainers = {}
        try:
            for name, (config_cls, trainer_cls, side_dict) in classes.items():
                cfg = config_cls.from_config_dict(side_dict)
                if _PLAIN.value:
                    cfg = dataclasses.replace(cfg, spec=dataclasses.replace(cfg.spec, mode="off"))
                start = time.perf_counter()
                trainers[name] = trainer_cls(cfg, f"{root}/run_{name}", progress=False)
                trainers[name].precompile()
                print(f"{name}: set up in {time.perf_counter() - start:.1f} s", flush=True)
            for step in range(_STEPS.value):
                examples = next(trainers["old"].iterator)
                next(trainers["new"].iterator)
                for name in ("old", "new") if step % 2 == 0 else ("new", "old"):
                    record = trainers[name].run_step(examples)
                    row = {k: float(record[k]) for k in KEYS}
                    row.update({k: float(record[k]) for k in UPDATE_KEYS if k in record})
                    row["generated_tokens"] = int(sum(record["response_lengths"]))
                    records[name].append(row)
                    print(f"step {step + 1} {name}: " + ", ".join(
                        f"{k} {v:.2f}" for k, v in row.items()), flush=True)  # fmt: skip
        finally:
            for trainer in trainers.values():
                trainer.close()
    old, new = records["old"], records["new"]
    out = {
        "command": command,
        "ref": _REF.value,
        "commit": commit,
        "plain_rollouts": _PLAIN.value,
        "fields_left_out_of_ref_config": dropped,
        "records": records,
        "rollout_old_over_new": [
            o["time_rollout"] / n["time_rollout"] for o, n in zip(old, new, strict=True)
        ],
        "step_old_over_new": [
            o["step_time"] / n["step_time"] for o, n in zip(old, new, strict=True)
        ],
        "total_s": {name: sum(r["step_time"] for r in recs) for name, recs in records.items()},
    }
    if all("update_tokens_computed" in r for r in old + new):
        # Steps after the first (its compiles): update seconds per position computed, and the
        # positions each side computed. Samples part after step 1, so the update's own rate is
        # the figure that compares.
        later = {name: recs[1:] or recs for name, recs in records.items()}
        out["update_ms_per_computed_position"] = {
            name: (1e3 * sum(r["time_update"] for r in recs) / positions) if positions else None
            for name, recs in later.items()
            for positions in [sum(r["update_tokens_computed"] for r in recs)]
        }  # fmt: skip
        out["update_tokens_computed"] = {
            name: [int(r["update_tokens_computed"]) for r in recs] for name, recs in records.items()
        }  # fmt: skip
    print(to_json(out, indent=2))
    print(f"command: {command}")
    if _OUTPUT.value:
        write_json(_OUTPUT.value, out, indent=2)


if __name__ == "__main__":
    app.run(main)
