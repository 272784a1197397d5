r"""The most any drafter could accept on the policy's own samples (`tlt_jax/rl/accept_ceiling.py`).

    python scripts/train_drafter.py --config configs/drafter_warmup.py:arith --workdir /tmp/warm \
        --config.prompts=/tmp/P.jsonl --config.train.total_steps=300
    python scripts/bench_accept_ceiling.py --responses /tmp/warm/responses.jsonl \
        --output_json /tmp/bench_accept_ceiling.json

The responses are a drafter warm-up's cached samples (`train_drafter.py` writes
`responses.jsonl` in its workdir before it trains: the main job's prompt, sampled at its
temperature). One policy forward over each gives every response token's rank among the
policy's most likely tokens; walking the responses a verify step at a time gives a perfect
drafter's tokens per verify step for chains (width 1) and trees of `--widths` children per node
at each of `--depths`, over all responses and over the longest quarter (the requests that make
the long tail). Divide by what a whole SD step of depth + 1 tree tokens costs in plain steps
(`calibrate_spec.py --verify_tokens T --max_cost_ratio 10`, per batch bucket) for the most SD
could speed up the tail.
"""

from __future__ import annotations

import sys
import time

from absl import app, flags

from tlt_jax import files
from tlt_jax.files import write_json

_RESPONSES = flags.DEFINE_string("responses", None, "A warm-up workdir's responses.jsonl.")
_OUTPUT_JSON = flags.DEFINE_string("output_json", None, "Where to write the results (JSON).")
files.register_output_checks("output_json")
_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Policy checkpoint (short name).")
_DEPTHS = flags.DEFINE_list("depths", ["1", "2", "3", "4", "6", "8"], "Drafted levels.")
_WIDTHS = flags.DEFINE_list("widths", ["1", "2", "4"], "Children per node (1: a chain).")
_LIMIT = flags.DEFINE_integer("limit", 0, "Use the first N responses (0: all).")


def _positive_ints(name: str, values: list[str]) -> list[int]:
    try:
        out = [int(v) for v in values]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise app.UsageError(f"--{name}={','.join(values)!r} must be positive integers")
    return out


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not _OUTPUT_JSON.value:
        raise app.UsageError("--output_json is required")
    if _LIMIT.value < 0:
        raise app.UsageError(f"--limit={_LIMIT.value} must be >= 0 (0: every response)")
    depths = _positive_ints("depths", _DEPTHS.value)
    widths = _positive_ints("widths", _WIDTHS.value)
    from tlt_jax.drafter.warmup import read_responses

    try:
        prompts, responses = read_responses(_RESPONSES.value or "")
    except ValueError as e:
        raise app.UsageError(f"--responses: {e}") from e
    if _LIMIT.value:
        prompts, responses = prompts[: _LIMIT.value], responses[: _LIMIT.value]

    from tlt_jax.models.checkpoints import load_model
    from tlt_jax.rl.accept_ceiling import measure

    command = "python " + " ".join(sys.argv)
    print(command, flush=True)
    model = load_model(_MODEL.value)
    start = time.perf_counter()
    result = measure(model, prompts, responses, depths=depths, widths=widths)
    result = {"command": command, "seconds": round(time.perf_counter() - start, 1), **result}
    write_json(_OUTPUT_JSON.value, result, indent=2)
    for part in ("all", "longest_quarter"):
        print(f"{part}: " + "  ".join(
            f"w{w}: " + " ".join(f"d{d}={result[part][f'top{w}_depth{d}']['accept_len']:.2f}"
                                 for d in depths) for w in widths))  # fmt: skip
    print(f"wrote {_OUTPUT_JSON.value}")


if __name__ == "__main__":
    app.run(main)
