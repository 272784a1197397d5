r"""Plain vs speculative decode step costs per batch: where SD stops paying on this chip.

A random-init preset (no weights needed) with a random EAGLE drafter; per batch bucket a plain
step and a full SD step (draft, tree, verify) of each strategy, and the crossover batch at
acceptance lengths 2 and 3 (`tlt_jax.rollout.crossover`). The GPU run of the accelerator check:

  python scripts/sd_crossover.py --preset=qwen2_5_1_5b --max_batch=256 \
      --output_json=$OUT/sd_crossover.json

On CPU the default is the tiny preset at batch 1-4 (seconds; it proves the script).
"""

from __future__ import annotations

import functools
import shlex
import sys

import jax
from absl import app, flags

from tlt_jax import files
from tlt_jax.files import to_json, write_json

_PRESET = flags.DEFINE_string("preset", "", "Model preset (default: qwen2_5_1_5b, tiny on CPU).")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Compute and parameter dtype.")
_MAX_BATCH = flags.DEFINE_integer(
    "max_batch", 0, "Largest batch (0: 256, 4 on CPU).", lower_bound=0
)
_STRATEGIES = flags.DEFINE_multi_string("strategy", ["3,1,4", "7,1,8", "4,4,16"],
                                        "SD strategy 'depth,topk,verify_tokens' (repeat the "
                                        "flag for several).")  # fmt: skip
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 0, "Context of the timed steps (0: 1024, 16 "
                                   "on CPU).", lower_bound=0)  # fmt: skip
_STEPS = flags.DEFINE_integer("steps", 8, "Timed steps per point.", lower_bound=1)
_ATTENTION = flags.DEFINE_list("attention_impls", ["xla", "pallas"],
                               "SD programs' attention, one engine each.")  # fmt: skip
_HBM_GBPS = flags.DEFINE_float("hbm_gbps", 0.0, "Peak HBM GB/s (0: by device kind).")
_BATCHES = flags.DEFINE_list("batches", [], "Batches timed, in this order (powers of two up "
                             "to --max_batch; default: all of them, smallest first). Each "
                             "batch compiles its own programs.")  # fmt: skip
_BUDGET_S = flags.DEFINE_float("budget_s", 0.0, "Stop starting new batches after this (0: none).")
_OUTPUT_JSON = flags.DEFINE_string("output_json", None, "Where to write the results.")
files.register_output_checks("output_json")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from tlt_jax import programs

    programs.SHARED.enabled = False  # each side pays its own compiles, as a run of its own would
    from tlt_jax.kernel_bench import device_hbm_gbps
    from tlt_jax.models.drafter import init_drafter
    from tlt_jax.models.presets import get_preset
    from tlt_jax.models.transformer import init_model
    from tlt_jax.rollout import crossover
    from tlt_jax.rollout.engine import EngineConfig, RolloutEngine, power_of_two_buckets
    from tlt_jax.rollout.speculative import SpecStrategy

    for text in _STRATEGIES.value:  # before any model is built
        try:
            SpecStrategy.parse(text)
        except ValueError as e:
            raise app.UsageError(f"--strategy={text!r}: {e}") from e
    cpu = jax.default_backend() == "cpu"
    preset = _PRESET.value or ("tiny" if cpu else "qwen2_5_1_5b")
    max_batch = _MAX_BATCH.value or (4 if cpu else 256)
    prompt_len = _PROMPT_LEN.value or (16 if cpu else 1024)
    config = get_preset(preset, dtype=_DTYPE.value, param_dtype=_DTYPE.value)
    device = jax.devices()[0].device_kind
    peak = _HBM_GBPS.value or device_hbm_gbps(device)
    command = " ".join(shlex.quote(a) for a in ["python", *sys.argv])
    print(f"command: {command}\n{jax.default_backend()} ({device}), jax {jax.__version__}; "
          f"{preset} {_DTYPE.value} random init, context {prompt_len}", flush=True)  # fmt: skip
    model = init_model(config)
    drafter = init_drafter(config, seed=1)
    buckets = list(power_of_two_buckets(1, max_batch))
    batches = [int(b) for b in _BATCHES.value] or buckets
    if not set(batches) <= set(buckets):
        raise app.UsageError(f"--batches {batches} must be among {buckets} (--max_batch)")
    verify = max(SpecStrategy.parse(s).verify_tokens for s in _STRATEGIES.value)
    result = {
        "command": command,
        "backend": jax.default_backend(),
        "device": device,
        "jax_version": jax.__version__,
        "preset": preset,
        "dtype": _DTYPE.value,
        "num_params": config.num_params(),
        "peak_hbm_gbps": peak,
        "by_attention": {},
    }

    def write() -> None:
        if _OUTPUT_JSON.value:  # whole or not at all: the stage may be killed while writing
            write_json(_OUTPUT_JSON.value, result, indent=1)

    def partial(impl: str, costs) -> None:
        """After each batch: what the path measured so far (kept if a later batch is killed)."""
        result["by_attention"][impl] = crossover.report(costs, config, peak_gbps=peak) | {
            "partial": True
        }
        write()

    for impl in _ATTENTION.value:
        engine = RolloutEngine(model, EngineConfig(
            max_batch_size=max_batch, max_seq_len=prompt_len + _STEPS.value * verify + 8,
            max_prefill_batch=min(max_batch, 32), min_prompt_bucket=16,
            spec_attention_impl=impl), drafter=drafter)  # fmt: skip
        try:
            costs = crossover.step_costs(
                engine,
                _STRATEGIES.value,
                batches,
                prompt_len=prompt_len,
                steps=_STEPS.value,
                budget_s=_BUDGET_S.value or None,
                on_batch=functools.partial(partial, impl),
            )
            out = crossover.report(costs, config, peak_gbps=peak)
        except Exception as error:  # one attention path failing keeps the other's figures
            out = {"error": f"{type(error).__name__}: {error}"[:2000]}
            if impl in result["by_attention"]:  # the batches measured before the error
                out["measured"] = result["by_attention"][impl]
        result["by_attention"][impl] = out
        print(to_json({impl: out}, indent=1), flush=True)
        write()  # rewritten after every path (and batch): a timeout keeps what was measured
        del engine
    failed = [impl for impl, out in result["by_attention"].items() if "error" in out]
    if failed and len(failed) == len(_ATTENTION.value):  # nothing measured: not a success
        raise SystemExit(f"every attention path failed ({failed}); see the JSON's errors")


if __name__ == "__main__":
    app.run(main)
