r"""Plain-decoding throughput of the rollout engine vs HF transformers, side by side.

  python scripts/bench_rollout.py --output_json /tmp/bench_rollout.json

SmolLM2-135M-Instruct on one chat prompt, every request generating exactly `--new_tokens`
(no stop ids; transformers with `min_new_tokens`), greedy and sampled at temperature 0.8 (what
RL does; transformers with `top_k=0`, the engine's default, so both sample the full
distribution), at batch 1 / 8 / 32 / 64. Per batch, the engine and transformers alternate
(the order flips every repeat) so both sides see the same machine load; each reports its
tokens/s over `--repeats` runs (`timing.spread`: median, mean, min, max = its best, and every
run). `ratio_vs_transformers` is the best over the best; `ratio_vs_transformers_spread` is the
spread of the per-repeat ratios, each engine run over the transformers run next to it (a
disturbance of the machine shows there, where one side's best can hide it). Every ratio below
comes both ways.

With `--sync_side`, the engine also runs with `overlap_host=False` (each step's tokens read
before the next step is dispatched) beside the default, and `overlap_speedup` is their ratio.
The engine runs every step as one program (`layers_per_program=0`: the steady state of the
engine's program tiers, what a long RL run decodes with). With `--layered_side`, an engine
that runs every step as one program per layer (the first tier, where a bucket starts on CPU)
runs beside it: `layered_speedup` per mode and batch; `compile_seconds` of every engine side.
With `--dtypes=bfloat16`, an engine on the same weights in that dtype (parameters and
compute) runs beside the float32 one: `dtype_speedup` per mode and batch, and `dtype_parity`
(argmax agreement and largest logit error against the float32 model, teacher-forced on the
prompt and a greedy continuation).

Beside the figures, what bounds them on this machine, measured by the script
(`tlt_jax.rollout.limits`): batch 1 against the read bandwidth of a large-array reduction
(every weight is read once per step: `bandwidth_floor_fraction_bs1`), batch 32 against the
measured float32 matmul roofline (`compute_roofline_fraction_bs32`), and the cost of verifying
a tree of 4 / 8 tokens over a 1-token forward at batch 1 (`verify4_over_plain_bs1`,
`verify8_over_plain_bs1`).
"""

import dataclasses
import sys
import time

from absl import app, flags

from tlt_jax import files
from tlt_jax.files import to_json, write_json

flags.DEFINE_string("output_json", None, "Where to write the JSON results.")
files.register_output_checks("output_json")
flags.DEFINE_string("model", "smollm2-135m-instruct", "Model path or short name.")
flags.DEFINE_list("batch_sizes", ["1", "8", "32", "64"], "Batch sizes to measure.")
flags.DEFINE_list("modes", ["greedy", "sampled"], "greedy and/or sampled (temperature 0.8).")
flags.DEFINE_float("temperature", 0.8, "Temperature of the sampled mode.")
flags.DEFINE_integer("new_tokens", 128, "Generated tokens per request.", lower_bound=1)
flags.DEFINE_integer(
    "repeats", 3, "Timed runs per point and side (alternating sides).", lower_bound=1
)
flags.DEFINE_bool("transformers", True, "Also measure HF transformers.")
flags.DEFINE_bool(
    "sync_side",
    False,
    "Also measure the engine with overlap_host=False (each "
    "step's tokens read before the next is dispatched): `overlap_speedup`.",
)
flags.DEFINE_bool(
    "layered_side",
    False,
    "Also measure the engine with its steps as one program per layer, never promoted "
    "(layers_per_program=1, one_program_after=0: a bucket's first steps on CPU) beside the "
    "steady state (each step one program): `layered_speedup` and the compile seconds of both.",
)
flags.DEFINE_list(
    "dtypes",
    [],
    "Also measure the engine with the weights in these dtypes "
    "(e.g. bfloat16): `dtype_speedup` and `dtype_parity`.",
)
FLAGS = flags.FLAGS

PROMPT = [{"role": "user", "content": "Explain why the sky is blue in a few sentences."}]
MODES = ("greedy", "sampled")
DTYPES = ("bfloat16", "float16")  # besides the float32 engine


def engine_run(engine, prompt, batch, new_tokens, temperature):
    """A timed call of the engine: tokens/s of `batch` requests of exactly `new_tokens`."""
    from tlt_jax.rollout.engine import Request
    from tlt_jax.rollout.sampling import SamplingParams

    sampling = SamplingParams(temperature=temperature)
    requests = [Request(prompt, new_tokens, sampling, seed=i) for i in range(batch)]

    def run():
        start = time.perf_counter()
        out = engine.generate(requests, progress=False)
        elapsed = time.perf_counter() - start
        assert all(len(c.token_ids) == new_tokens for c in out)
        return batch * new_tokens / elapsed

    return run


def transformers_run(hf, prompt, batch, new_tokens, temperature):
    """A timed call of transformers' `generate` with the same lengths and sampling."""
    import torch

    ids = torch.tensor([prompt] * batch)
    sampling = (dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
                if temperature > 0 else dict(do_sample=False))  # fmt: skip

    def run():
        with torch.no_grad():
            start = time.perf_counter()
            out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              **sampling)  # fmt: skip
            elapsed = time.perf_counter() - start
        assert out.shape[1] == ids.shape[1] + new_tokens
        return batch * new_tokens / elapsed

    return run


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from tlt_jax import programs

    programs.SHARED.enabled = False  # each side pays its own compiles, as a run of its own would
    unknown = sorted(set(FLAGS.modes) - set(MODES))
    if unknown:
        raise app.UsageError(f"--modes {unknown} are not among {list(MODES)}")
    batches = [int(b) for b in FLAGS.batch_sizes]
    if not batches or min(batches) < 1:
        raise app.UsageError(f"--batch_sizes={FLAGS.batch_sizes} must be positive integers")
    bad = [d for d in FLAGS.dtypes if d not in DTYPES]
    if bad:
        raise app.UsageError(f"--dtypes {bad} are not among {list(DTYPES)}")
    import jax

    from tlt_jax.metrics import timing
    from tlt_jax.models import checkpoints
    from tlt_jax.rollout import bench, limits
    from tlt_jax.rollout.engine import EngineConfig, RolloutEngine

    command = " ".join(["python"] + sys.argv)
    print(command, flush=True)
    tokenizer = checkpoints.load_tokenizer(FLAGS.model)
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    model = checkpoints.load_model(FLAGS.model)
    hf = bench.load_transformers(FLAGS.model) if FLAGS.transformers else None
    others = {d: checkpoints.load_model(FLAGS.model, dtype=d, param_dtype=d) for d in FLAGS.dtypes}
    temperatures = {"greedy": 0.0, "sampled": FLAGS.temperature}
    names = (("tlt_jax", "transformers") + (("tlt_jax_sync",) if FLAGS.sync_side else ())
             + (("tlt_jax_layered",) if FLAGS.layered_side else ())
             + tuple(f"tlt_jax_{d}" for d in others))  # fmt: skip
    compile_seconds = {side: {} for side in names if side != "transformers"}
    runs = {side: {m: {} for m in FLAGS.modes} for side in names}
    for batch in batches:
        config = EngineConfig(max_batch_size=batch, max_seq_len=512,
                              max_prefill_batch=min(batch, 8), layers_per_program=0)  # fmt: skip
        engine = RolloutEngine(model, config)
        sync = RolloutEngine(model, dataclasses.replace(config, overlap_host=False))
        typed = {d: RolloutEngine(m, config) for d, m in others.items()}
        engines = {"tlt_jax": engine, "tlt_jax_sync": sync,
                   **{f"tlt_jax_{d}": e for d, e in typed.items()}}  # fmt: skip
        if FLAGS.layered_side:
            engines["tlt_jax_layered"] = RolloutEngine(
                model, dataclasses.replace(config, layers_per_program=1, one_program_after=0)
            )
        for mode in FLAGS.modes:
            t = temperatures[mode]
            sides = {"tlt_jax": engine_run(engine, prompt, batch, FLAGS.new_tokens, t)}
            if FLAGS.sync_side:
                sides["tlt_jax_sync"] = engine_run(sync, prompt, batch, FLAGS.new_tokens, t)
            for d, typed_engine in typed.items():
                sides[f"tlt_jax_{d}"] = engine_run(typed_engine, prompt, batch,
                                                   FLAGS.new_tokens, t)  # fmt: skip
            if FLAGS.layered_side:
                sides["tlt_jax_layered"] = engine_run(engines["tlt_jax_layered"], prompt, batch,
                                                      FLAGS.new_tokens, t)  # fmt: skip
            if hf is not None:
                sides["transformers"] = transformers_run(hf, prompt, batch, FLAGS.new_tokens, t)
            for run in sides.values():  # the engine compiles this batch's programs
                run()
            for side in sides:
                if side in compile_seconds:  # every program this batch and mode compiled
                    compile_seconds[side][f"{mode}/{batch}"] = round(
                        engines[side].stats.compile_seconds, 2)  # fmt: skip
                    engines[side].stats.compile_seconds = 0.0
            for repeat in range(FLAGS.repeats):
                for side in timing.side_order(sides, repeat):
                    runs[side][mode].setdefault(str(batch), []).append(sides[side]())
            for side in sides:
                figure = timing.spread(runs[side][mode][str(batch)])
                print(f"{side:12s} {mode:7s} batch {batch:3d}: best {figure['max']:7.1f} "
                      f"median {figure['median']:7.1f} tok/s", flush=True)  # fmt: skip
            if FLAGS.output_json:  # the points measured so far outlive a later failure
                write_json(FLAGS.output_json, {
                    "command": command, "partial": True, "model": FLAGS.model,
                    "new_tokens": FLAGS.new_tokens, "repeats": FLAGS.repeats,
                    "tokens_per_s_runs": runs, "compile_seconds": compile_seconds,
                }, indent=2)  # fmt: skip
    tokens_per_s = {side: {m: {b: timing.spread(v) for b, v in by_batch.items()}
                           for m, by_batch in by_mode.items()}
                    for side, by_mode in runs.items()}  # fmt: skip

    def ratio(mode, other="transformers", inverse=False, spread=False):
        """{batch: best over best} (`spread`: the spread of the per-repeat ratios)."""
        ours, theirs = runs["tlt_jax"][mode], runs[other][mode]
        if inverse:  # the other side over ours
            ours, theirs = theirs, ours
        pairs = {b: bench.repeat_ratio(ours[b], theirs[b]) for b in theirs}
        return {b: p[1] if spread else round(p[0], 3) for b, p in pairs.items()}

    best = {m: {b: f["max"] for b, f in tokens_per_s["tlt_jax"][m].items()} for m in FLAGS.modes}
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx_state(model)))
    bandwidth = limits.read_bandwidth_gbs()
    roofline = limits.matmul_gflops()
    # A batch-1 step reads every weight once: the floor is bandwidth / weight bytes.
    floor_tps = bandwidth * 1e9 / param_bytes
    context = len(prompt) + FLAGS.new_tokens // 2  # the mean context of a timed run
    flops = limits.decode_flops_per_token(model.config, context)
    verify = limits.target_forward_ms(model, kv_len=256)
    # The engine's batch-1 plain step (host work included) at one kv bucket of 128 / 2048.
    step_ms = {str(kv): bench.decode_step_ms(model, kv) for kv in (128, 2048)}
    reference = "greedy" if "greedy" in best else FLAGS.modes[0]

    def fraction(tokens_per_s, limit_tokens_per_s):  # None (null) where the batch was not run
        return None if tokens_per_s is None else tokens_per_s / limit_tokens_per_s

    out = {
        "command": command,
        "model": FLAGS.model,
        "dtype": model.config.param_dtype,
        "new_tokens": FLAGS.new_tokens,
        "prompt_tokens": len(prompt),
        "temperature_sampled": FLAGS.temperature,
        "repeats": FLAGS.repeats,
        "backend": jax.default_backend(),
        "tokens_per_s": tokens_per_s,
        "param_bytes": param_bytes,
        "read_bandwidth_gbs": bandwidth,
        "bandwidth_floor_tokens_per_s_bs1": floor_tps,
        "bandwidth_floor_fraction_bs1": fraction(best[reference].get("1"), floor_tps),
        "matmul_roofline_gflops_f32": roofline,
        "decode_gflops_per_token": flops / 1e9,
        "compute_roofline_fraction_bs32": fraction(
            best[reference].get("32"), roofline * 1e9 / flops
        ),
        "decode_step_ms_bs1_by_kv_len": step_ms,
        "target_forward_ms_by_tokens_bs1": verify,
        "verify4_over_plain_bs1": verify[4] / verify[1],
        "verify8_over_plain_bs1": verify[8] / verify[1],
    }
    out["compile_seconds"] = compile_seconds
    if others:  # the same weights in another dtype: how closely it follows float32
        continuation = greedy_continuation(model, prompt, FLAGS.new_tokens)
        out["dtype_parity"] = {d: bench.logit_parity(model, m, continuation)
                               for d, m in others.items()}  # fmt: skip
    # Each ratio best over best, and beside it (`_spread`) per repeat: each run over the other
    # side's run next to it.
    for suffix, spread in (("", False), ("_spread", True)):
        if FLAGS.layered_side:  # one program per layer over one program per step
            out[f"layered_speedup{suffix}"] = {m: ratio(m, "tlt_jax_layered", True, spread)
                                               for m in FLAGS.modes}  # fmt: skip
        if FLAGS.sync_side:  # what overlapping the host with the device step pays
            out[f"overlap_speedup{suffix}"] = {m: ratio(m, "tlt_jax_sync", spread=spread)
                                               for m in FLAGS.modes}  # fmt: skip
        if others:  # the same weights in another dtype
            out[f"dtype_speedup{suffix}"] = {
                d: {m: ratio(m, f"tlt_jax_{d}", True, spread) for m in FLAGS.modes}
                for d in others}  # fmt: skip
        if hf is not None:
            if "greedy" in FLAGS.modes:
                out[f"ratio_vs_transformers{suffix}"] = ratio("greedy", spread=spread)
            if "sampled" in FLAGS.modes:
                out[f"ratio_vs_transformers_sampled{suffix}"] = ratio("sampled", spread=spread)
    print(to_json(out, indent=2))
    print(f"command: {command}")
    if FLAGS.output_json:
        write_json(FLAGS.output_json, out, indent=2)


def greedy_continuation(model, prompt, new_tokens):
    """`prompt` and the float32 engine's greedy continuation of it (the parity sequence)."""
    from tlt_jax.rollout.engine import EngineConfig, Request, RolloutEngine

    engine = RolloutEngine(model, EngineConfig(max_batch_size=1, max_seq_len=512))
    out = engine.generate([Request(prompt, new_tokens)], progress=False)[0]
    return list(prompt) + list(out.token_ids)


def nnx_state(model):
    from flax import nnx

    return nnx.state(model, nnx.Param)


if __name__ == "__main__":
    app.run(main)
