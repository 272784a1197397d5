r"""Probes a prompt design on the real policy: answer format, accuracy and the response-length tail.

    python scripts/probe_workload.py --config configs/smollm2_arith.py --designs=config \
        --num_problems=32 --samples=1,8 --output_json=/tmp/probe.json

For every design (`config`: the config's own `data.system_prompt` / `data.instruction`; the
other names are in `DESIGNS`) and every sample count (1: greedy; > 1: that many samples per
problem at `rollout.temperature`), the first `--num_problems` train problems go through the
repository's `RolloutEngine` in one batch. Printed per row: format rates (a `####` line, any
final-answer statement `rewards.final_answer` recognises), accuracy under `math_accuracy`
(last number as a fallback) and `final_answer_accuracy`, response lengths (p50 / p90 / max,
share past half the cap, truncated share), and the share of rollout wall time with at most
4 / 8 / 16 requests running, from the engine's `stats.timeline`.
"""

import json
import time

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from tlt_jax import files
from tlt_jax.files import write_json

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file (configs/X.py[:variant]).",
                                lock_config=False)  # fmt: skip
flags.DEFINE_list("designs", ["config"], "Prompt designs: 'config' or names in DESIGNS.")
flags.DEFINE_list("samples", ["1", "8"], "Samples per problem; 1 is greedy.")
flags.DEFINE_integer("num_problems", 32, "Train problems per greedy row.", lower_bound=1)
flags.DEFINE_integer(
    "sampled_problems", 8, "Train problems per sampled row (samples > 1).", lower_bound=1
)
flags.DEFINE_string("split", "train", "Split to draw problems from.")
flags.DEFINE_string("output_json", None, "Write every row (and the responses) here.")
files.register_output_checks("output_json")
flags.mark_flags_as_required(["config"])

_ONE_SHOT = (
    "Solve the problem step by step, one operation per line, then give the final answer on "
    "its own line as '#### <number>'.\n\nExample:\nQuestion: What is 12 + 7 - 5?\nAnswer:\n"
    "12 + 7 = 19\n19 - 5 = 14\n#### 14"
)
_ONE_SHOT_WORD = (
    "Solve the problem step by step, one operation per line, then give the final answer on "
    "its own line as '#### <number>'.\n\nExample:\nQuestion: Ann has 12 pens. Then Ann buys 7 "
    "more. Then Ann gives 5 to a friend. How many pens does Ann have now?\nAnswer:\n"
    "Ann starts with 12 pens.\n12 + 7 = 19\n19 - 5 = 14\n#### 14"
)
# name -> (system_prompt, instruction); None keeps SmolLM2's default system prompt.
DESIGNS = {
    "hash": (None, "Solve step by step, end with '#### <number>'."),
    "boxed": (None, "Solve the problem step by step and put the final answer in \\boxed{}."),
    "oneshot_system": (_ONE_SHOT, ""),
    "oneshot_user": (None, _ONE_SHOT),
    "oneshot_word_system": (_ONE_SHOT_WORD, ""),
    "hash_own_line": (
        None,
        "Solve the problem step by step. Then write the final answer on its "
        "own line as '#### <number>'.",
    ),
    "think": (
        "You are a careful math tutor. Think step by step and show your work.",
        "Show your work, then write the final answer as '#### <number>'.",
    ),
}
THRESHOLDS = (4, 8, 16)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from tlt_jax.data.pipeline import load_data
    from tlt_jax.data.tokenizer import stop_token_ids
    from tlt_jax.metrics.timing import tail_stats
    from tlt_jax.rl import policy, rewards
    from tlt_jax.rl.config import TrainConfig
    from tlt_jax.rollout.engine import Request
    from tlt_jax.rollout.sampling import SamplingParams

    base = TrainConfig.from_config_dict(FLAGS.config)
    cap = base.rollout.max_new_tokens
    examples = load_data(base.data, FLAGS.split)[: max(FLAGS.num_problems,
                                                       FLAGS.sampled_problems)]  # fmt: skip
    tokenizer = policy.build_tokenizer(base.model)
    stop_ids = stop_token_ids(tokenizer)
    engine = None
    rows = []
    for design in FLAGS.designs:
        config = FLAGS.config
        if design != "config":
            config = FLAGS.config.copy_and_resolve_references()
            config.data.system_prompt, config.data.instruction = DESIGNS[design]
        cfg = TrainConfig.from_config_dict(config)
        if engine is None:
            engine = policy.build_engine(cfg, policy.build_policy(cfg.model, None))
        encode = policy.build_encoder(cfg, tokenizer)
        for samples in (int(s) for s in FLAGS.samples):
            count = FLAGS.num_problems if samples == 1 else FLAGS.sampled_problems
            prompts = [encode(ex["question"]) for ex in examples[:count]]
            sampling = SamplingParams() if samples == 1 else SamplingParams(
                cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k)  # fmt: skip
            requests = [Request(p, cap, sampling, stop_ids, seed=i * samples + j)
                        for i, p in enumerate(prompts) for j in range(samples)]  # fmt: skip
            start = time.perf_counter()
            completions = engine.generate(requests, progress=False)
            seconds = time.perf_counter() - start
            texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
            answers = [str(ex["answer"]) for ex in examples[:count] for _ in range(samples)]
            lengths = np.asarray([len(c.token_ids) for c in completions])
            row = {
                "design": design, "samples": samples, "requests": len(requests),
                "prompt_tokens": int(np.mean([len(p) for p in prompts])), "seconds": seconds,
                "hash_rate": float(np.mean([rewards.format_reward(t) for t in texts])),
                "final_rate": float(np.mean([rewards.extract_final_answer(t) is not None
                                             for t in texts])),
                "acc_last_number": float(np.mean([rewards.math_accuracy(t, a)
                                                  for t, a in zip(texts, answers, strict=True)])),
                "acc_final": float(np.mean([rewards.final_answer_accuracy(t, a)
                                            for t, a in zip(texts, answers, strict=True)])),
                "p50": float(np.percentile(lengths, 50)),
                "p90": float(np.percentile(lengths, 90)), "max": int(lengths.max()),
                "past_half_cap": float(np.mean(lengths > cap / 2)),
                "truncated": float(np.mean([c.finish_reason == "length" for c in completions])),
                **{f"tail_le{k}": tail_stats(engine.stats.timeline, k)["long_tail_share"]
                   for k in THRESHOLDS},
            }  # fmt: skip
            # Wall seconds, running requests and the compile seconds inside each step (the
            # tail figures beside it leave those out: `timing.tail_stats`).
            timeline = [[entry[0], entry[1], entry[3]] for entry in engine.stats.timeline]
            rows.append({**row, "texts": texts, "lengths": lengths.tolist(),
                         "timeline": timeline})  # fmt: skip
            print(json.dumps(row), flush=True)
            print("   sample:", repr(texts[0][:300]), flush=True)
    if FLAGS.output_json:
        write_json(FLAGS.output_json, rows, indent=1)


if __name__ == "__main__":
    app.run(main)
