r"""Plain-decoding throughput of the rollout engine vs HF transformers, side by side.

  python scripts/bench_rollout.py --output_json /tmp/bench_rollout.json

Measures, for SmolLM2-135M-Instruct greedy decoding with the same prompt and lengths:
generated tokens/s at batch 1, 8 and 32 for tlt_jax and transformers' `generate`, and
their ratio; the engine's decode step time at context 128 vs 2048 (the median step of a
generate call, from `EngineStats.timeline`: `tlt_jax.rollout.bench.decode_step_ms`); the
memory-bandwidth floor at batch 1 (parameter bytes / measured copy bandwidth) and the fraction
of it reached.
"""

import json
import sys
import time

import numpy as np
from absl import app, flags

flags.DEFINE_string("output_json", None, "Where to write the JSON results.")
flags.DEFINE_string("model", "smollm2-135m-instruct", "Model path or short name.")
flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "Batch sizes to measure.")
flags.DEFINE_integer("new_tokens", 128, "Generated tokens per request.")
flags.DEFINE_integer("repeats", 2, "Timed runs per point (the best is kept).")
flags.DEFINE_bool("transformers", True, "Also measure HF transformers.")
FLAGS = flags.FLAGS

PROMPT = [{"role": "user", "content": "Explain why the sky is blue in a few sentences."}]


def copy_bandwidth_gbs(nbytes: int = 512 * 1024**2, repeats: int = 5) -> float:
    """Best bytes copied per second for a buffer far larger than the caches."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def time_engine(engine, prompt, batch, new_tokens, repeats):
    from tlt_jax.rollout.engine import Request

    requests = [Request(prompt, new_tokens, seed=i) for i in range(batch)]
    engine.generate(requests, progress=False)  # compiles every program this shape mix needs
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = engine.generate(requests, progress=False)
        best = min(best, time.perf_counter() - start)
    assert all(len(c.token_ids) == new_tokens for c in out)
    return batch * new_tokens / best


def time_transformers(hf, prompt, batch, new_tokens, repeats):
    import torch

    ids = torch.tensor([prompt] * batch)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            hf.generate(ids, **kwargs)
            best = min(best, time.perf_counter() - start)
    return batch * new_tokens / best


def main(argv):
    del argv
    import jax

    from tlt_jax.models import checkpoints
    from tlt_jax.rollout import bench
    from tlt_jax.rollout.engine import EngineConfig, RolloutEngine

    command = " ".join([sys.executable.split("/")[-1]] + sys.argv)
    tokenizer = checkpoints.load_tokenizer(FLAGS.model)
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    model = checkpoints.load_model(FLAGS.model)
    batches = [int(b) for b in FLAGS.batch_sizes]
    results = {"tlt_jax": {}, "transformers": {}}
    for batch in batches:
        engine = RolloutEngine(model, EngineConfig(max_batch_size=batch, max_seq_len=512,
                                                   max_prefill_batch=min(batch, 8)))  # fmt: skip
        results["tlt_jax"][str(batch)] = time_engine(
            engine, prompt, batch, FLAGS.new_tokens, FLAGS.repeats
        )
        print(f"tlt_jax      batch {batch:3d}: {results['tlt_jax'][str(batch)]:8.1f} tok/s")
    if FLAGS.transformers:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(max(1, torch.get_num_threads()))
        path = checkpoints.resolve_model_path(FLAGS.model)
        if path.suffix == ".gguf":
            hf = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32
            )
        else:
            hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        hf.eval()
        for batch in batches:
            results["transformers"][str(batch)] = time_transformers(
                hf, prompt, batch, FLAGS.new_tokens, FLAGS.repeats
            )
            print(
                f"transformers batch {batch:3d}: {results['transformers'][str(batch)]:8.1f} tok/s"
            )
    ratio = {b: results["tlt_jax"][b] / results["transformers"][b] for b in results["transformers"]}
    # The engine's batch-1 plain step (host work included) at one kv bucket of 128 / 2048.
    step_128 = bench.decode_step_ms(model, 128) / 1e3
    step_2048 = bench.decode_step_ms(model, 2048) / 1e3
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx_state(model)))
    bandwidth = copy_bandwidth_gbs()
    # A batch-1 decode step must stream every parameter through the cores once.
    floor_tps = bandwidth * 1e9 / param_bytes
    out = {
        "command": command,
        "model": FLAGS.model,
        "dtype": model.config.param_dtype,
        "new_tokens": FLAGS.new_tokens,
        "prompt_tokens": len(prompt),
        "backend": jax.default_backend(),
        "tokens_per_s": results,
        "ratio_vs_transformers": ratio,
        "decode_step_s": {"128": step_128, "2048": step_2048},
        "decode_step_ratio_2048_vs_128": step_2048 / step_128,
        "param_bytes": param_bytes,
        "copy_bandwidth_gbs": bandwidth,
        "bandwidth_floor_tokens_per_s_bs1": floor_tps,
        "bandwidth_floor_fraction_bs1": results["tlt_jax"].get("1", float("nan")) / floor_tps,
    }
    print(json.dumps(out, indent=2))
    print(f"command: {command}")
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(out, f, indent=2)


def nnx_state(model):
    from flax import nnx

    return nnx.state(model, nnx.Param)


if __name__ == "__main__":
    app.run(main)
