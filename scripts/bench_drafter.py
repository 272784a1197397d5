r"""Drafter training step: full-vocabulary vs hot-vocabulary soft cross-entropy, side by side.

  python scripts/bench_drafter.py --output_json /tmp/bench_drafter.json

One jitted EAGLE step (`tlt_jax.drafter.trainer.make_train_step`: drafter forward, loss,
gradient, AdamW) on a packed batch of --batch_rows x --row_len tokens, for the policy head's
full vocabulary and for its --hot_sizes most frequent columns (what `train_drafter.py
--hot_vocab` trains), and with the first hot size, for each --unroll_steps > 1 (training-time
test, `train_drafter.py --unroll_steps`: N drafting levels per step). The policy's shapes
come from the --model preset; its weights and the batch are random (a step's cost does not
depend on their values). Steps alternate between the variants, the order reversed every round
(`round_order`), so that other load on the machine hits them alike and no variant always runs
right after the same other one; each figure is the median of --num_steps timed steps after
one compile step, with the per-round ratios' spread.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

from absl import app, flags

from tlt_jax import files
from tlt_jax.files import to_json, write_json

_OUTPUT_JSON = flags.DEFINE_string("output_json", None, "Where to write the results (JSON).")
files.register_output_checks("output_json")
_MODEL = flags.DEFINE_string("model", "smollm2_135m", "Model preset (shapes only).")
_BATCH_ROWS = flags.DEFINE_integer("batch_rows", 2, "Packed rows per step.", lower_bound=1)
_ROW_LEN = flags.DEFINE_integer("row_len", 1024, "Tokens per packed row.", lower_bound=1)
_WINDOW = flags.DEFINE_integer("window", 512, "Sample window (tokens).", lower_bound=1)
_HOT_SIZES = flags.DEFINE_list("hot_sizes", ["2048", "8192"], "Hot-vocabulary sizes to time.")
_UNROLL = flags.DEFINE_list("unroll_steps", ["3"], "Unrolled levels to time (first hot size).")
_NUM_STEPS = flags.DEFINE_integer("num_steps", 5, "Timed steps per variant.", lower_bound=1)


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tlt_jax.drafter.data import pack_windows
    from tlt_jax.drafter.trainer import DrafterTrainConfig, init_train_state, make_train_step
    from tlt_jax.metrics import timing
    from tlt_jax.models.drafter import init_drafter
    from tlt_jax.models.presets import get_preset

    config = get_preset(_MODEL.value)
    vocab, d = config.vocab_size, config.hidden_size
    try:
        hot_sizes = [int(x) for x in _HOT_SIZES.value]
    except ValueError as e:
        raise app.UsageError(f"--hot_sizes={_HOT_SIZES.value} must be integers") from e
    try:
        unrolls = [int(x) for x in _UNROLL.value]
    except ValueError as e:
        raise app.UsageError(f"--unroll_steps={_UNROLL.value} must be integers") from e
    if any(n < 1 for n in unrolls) or (unrolls and not hot_sizes):
        raise app.UsageError(f"--unroll_steps={unrolls} must be >= 1, with a --hot_sizes entry")
    bad = [u for u in hot_sizes if not 1 <= u <= vocab]
    if bad:
        raise app.UsageError(f"--hot_sizes {bad} must be in [1, vocab_size={vocab}]")
    train = DrafterTrainConfig(batch_rows=_BATCH_ROWS.value, row_len=_ROW_LEN.value,
                               window=_WINDOW.value)  # fmt: skip
    rng = np.random.default_rng(0)
    per_row = max(1, _ROW_LEN.value // _WINDOW.value)
    samples = [
        (rng.integers(0, vocab, _WINDOW.value).astype(np.int32),
         rng.standard_normal((_WINDOW.value, d)).astype(np.float32),
         np.ones(_WINDOW.value, bool))
        for _ in range(_BATCH_ROWS.value * per_row)
    ]  # fmt: skip
    batch, _ = pack_windows(samples, _BATCH_ROWS.value, _ROW_LEN.value)
    embed = jnp.asarray(0.02 * rng.standard_normal((vocab, d)), config.jnp_dtype)
    step_fn = make_train_step(config, train)
    variants = {"full": (embed.T, step_fn)}  # name: (head, step function)
    variants.update({f"hot{u}": (embed.T[:, :u], step_fn) for u in hot_sizes})
    for n in (n for n in unrolls if n > 1):
        unrolled = dataclasses.replace(train, unroll_steps=n)
        variants[f"hot{hot_sizes[0]}_unroll{n}"] = (
            embed.T[:, : hot_sizes[0]], make_train_step(config, unrolled))  # fmt: skip
    states, times = {}, {name: [] for name in variants}
    for name, (head, step) in variants.items():  # compile (one program per variant)
        states[name] = init_train_state(init_drafter(config, 0).params_dict(), train)
        states[name], metrics = step(states[name], batch, embed, head)
        jax.block_until_ready(metrics)
    order = []  # the variants of each round, in the order they ran
    for round_ in range(_NUM_STEPS.value):
        order.append(timing.side_order(list(variants), round_))
        for name in order[-1]:
            head, step = variants[name]
            start = time.perf_counter()
            states[name], metrics = step(states[name], batch, embed, head)
            jax.block_until_ready(metrics)
            times[name].append(time.perf_counter() - start)
    step_s = {name: statistics.median(t) for name, t in times.items()}
    command = " ".join([sys.executable.split("/")[-1]] + sys.argv)
    out = {
        "command": command,
        "model": _MODEL.value,
        "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
        "tokens_per_step": _BATCH_ROWS.value * _ROW_LEN.value,
        "step_s": step_s,
        "step_s_runs": times,  # every timed step, round by round
        "round_order": order,
        "speedup_vs_full": {name: step_s["full"] / s for name, s in step_s.items()},
        # The spread: per round, the full step over the variant's step timed beside it.
        "speedup_vs_full_spread": {
            name: timing.spread([f / v for f, v in zip(times["full"], t, strict=True)])
            for name, t in times.items()
            if name != "full"
        },  # fmt: skip
        "loadavg_1min": os.getloadavg()[0],
    }
    print(to_json(out, indent=2))
    print(f"command: {command}")
    if _OUTPUT_JSON.value:
        write_json(_OUTPUT_JSON.value, out, indent=2)


if __name__ == "__main__":
    app.run(main)
