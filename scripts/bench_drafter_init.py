r"""How fast a cold-started drafter learns: initialisation and learning rate, side by side.

  python scripts/bench_drafter_init.py --responses /tmp/warm/responses.jsonl \
      --output_json /tmp/bench_drafter_init.json

The spot-trained drafter of a cold start (`spot.enabled` without `spec.drafter`) begins from a
random init and gets a few hundred steps over an RL run. This asks whether another start or
learning rate gets it further in that budget. The policy answers are a drafter warm-up's
cached `responses.jsonl` (`train_drafter.py` writes it in its workdir); the policy's features of
the first --train_samples form the training buffer and the rest a held-out one. Every variant
trains with the spot trainer's settings (`SpotConfig().train_config()`, hot vocabulary of the
training responses' --hot_vocab most frequent tokens) on the same batch stream, and every
--eval_every steps its held-out top-1 agreement and loss are measured on the same fixed
batches. Variants are `init:learning_rate`, inits:

- `random`: the default (normal(0.02) matrices).
- `random_fc_feature_identity`: random, but the fc's feature half is the identity (the layer
  starts from the policy's feature).
- `target_last_layer`: the decoder layer copied from the policy's last layer, fc random.
- `target_last_layer_zero_out`: the same with the attention output and MLP down projections
  zeroed, so the layer starts as the identity on fc's output and its residual branches grow
  from the policy's own q/k/v, gate and up weights.
"""

from __future__ import annotations

import sys
import time

from absl import app, flags

from tlt_jax import files
from tlt_jax.files import to_json, write_json

INITS = ("random", "random_fc_feature_identity", "target_last_layer",
         "target_last_layer_zero_out")  # fmt: skip

_RESPONSES = flags.DEFINE_string("responses", None, "A warm-up workdir's responses.jsonl.")
_OUTPUT_JSON = flags.DEFINE_string("output_json", None, "Where to write the results (JSON).")
files.register_output_checks("output_json")
_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Policy checkpoint (short name).")
_VARIANTS = flags.DEFINE_list(
    "variants",
    ["random:3e-4", "random_fc_feature_identity:3e-4", "target_last_layer:3e-4",
     "target_last_layer_zero_out:3e-4", "random:1e-3", "random:3e-3"],
    f"init:learning_rate pairs; inits: {', '.join(INITS)}.",
)  # fmt: skip
_STEPS = flags.DEFINE_integer("steps", 300, "Drafter steps per variant.", lower_bound=1)
_EVAL_EVERY = flags.DEFINE_integer(
    "eval_every", 25, "Held-out evaluation interval (steps).", lower_bound=1
)
_TRAIN_SAMPLES = flags.DEFINE_integer("train_samples", 200, "Responses trained on; the rest "
                                      "are held out.", lower_bound=1)  # fmt: skip
_HOT_VOCAB = flags.DEFINE_integer(
    "hot_vocab", 2048, "Hot-vocabulary size (0: full head).", lower_bound=0
)
_EVAL_BATCHES = flags.DEFINE_integer(
    "eval_batches", 4, "Held-out batches of 4 x 512 tokens.", lower_bound=1
)


def parse_variants(texts: list[str]) -> list[tuple[str, float]]:
    out = []
    for text in texts:
        init, _, lr = text.partition(":")
        try:
            rate = float(lr)
        except ValueError:
            rate = -1.0
        if init not in INITS or not rate > 0:
            raise app.UsageError(f"--variants entry {text!r}: expected init:learning_rate with "
                                 f"init one of {list(INITS)} and a rate > 0")  # fmt: skip
        out.append((init, rate))
    return out


def initial_params(init: str, model, seed: int = 0):
    """The drafter's starting params under `init` (module docstring)."""
    import jax.numpy as jnp

    from tlt_jax.models.drafter import init_drafter

    params = init_drafter(model.config, seed).params_dict()
    d = model.config.hidden_size
    if init == "random_fc_feature_identity":
        params["fc"] = params["fc"].at[d:].set(jnp.eye(d, dtype=params["fc"].dtype))
    elif init.startswith("target_last_layer"):
        stacked = model.layers.stacked()
        params["layers"] = {name: stacked[name][-1:] for name in params["layers"]}
        if init == "target_last_layer_zero_out":
            for name in ("o", "down"):
                params["layers"][name] = jnp.zeros_like(params["layers"][name])
    return params


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    variants = parse_variants(_VARIANTS.value)
    from tlt_jax.drafter.warmup import read_responses

    try:
        prompts, responses = read_responses(_RESPONSES.value or "")
    except ValueError as e:
        raise app.UsageError(f"--responses: {e}") from e
    n_train = _TRAIN_SAMPLES.value
    if not 0 < n_train < len(responses):
        raise app.UsageError(f"--train_samples={n_train} must leave held-out samples of the "
                             f"{len(responses)} responses")  # fmt: skip

    import jax
    import jax.numpy as jnp
    import numpy as np

    from tlt_jax.drafter.hot_vocab import count_tokens, hot_token_ids
    from tlt_jax.drafter.trainer import batch_loss, init_train_state, make_buffer, make_train_step
    from tlt_jax.drafter.warmup import harvest_features
    from tlt_jax.models.checkpoints import load_model
    from tlt_jax.rl.spot import SpotConfig

    model = load_model(_MODEL.value)
    base = SpotConfig().train_config()
    train_buffer, test_buffer = make_buffer(base, max_samples=len(responses)), make_buffer(
        base, max_samples=len(responses))  # fmt: skip
    start = time.perf_counter()
    harvest_features(model, train_buffer, prompts[:n_train], responses[:n_train])
    harvest_features(model, test_buffer, prompts[n_train:], responses[n_train:])
    harvest_s = time.perf_counter() - start
    embed = model.embed.get_value()
    head = model.head_weight_DxV()
    if _HOT_VOCAB.value:
        hot = hot_token_ids(count_tokens(responses[:n_train], model.config.vocab_size),
                            _HOT_VOCAB.value)  # fmt: skip
        head = jnp.take(head, jnp.asarray(hot, jnp.int32), axis=1)
    held_out = [test_buffer.sample_batch(np.random.default_rng([99, i]), 4, 512)
                for i in range(_EVAL_BATCHES.value)]  # fmt: skip
    evaluate = jax.jit(lambda p, b: batch_loss(p, model.config, base, b, embed, head)[1])

    results = {}
    for init, rate in variants:
        config = SpotConfig(learning_rate=rate).train_config()
        step_fn = make_train_step(model.config, config, donate=False)
        state = init_train_state(initial_params(init, model), config)
        curve, start = [], time.perf_counter()
        for step in range(_STEPS.value + 1):
            if step % _EVAL_EVERY.value == 0 or step == _STEPS.value:
                metrics = jax.device_get([evaluate(state.params, b) for b in held_out])
                curve.append({"step": step,
                              "accuracy": float(np.mean([m["accuracy"] for m in metrics])),
                              "loss": float(np.mean([m["loss"] for m in metrics]))})  # fmt: skip
                print(f"{init}:{rate:g} {curve[-1]}", flush=True)
            if step == _STEPS.value:
                break
            batch = train_buffer.sample_batch(np.random.default_rng([0, step]),
                                              config.batch_rows, config.row_len)  # fmt: skip
            state, _ = step_fn(state, batch, embed, head)
        seconds = round(time.perf_counter() - start, 1)
        results[f"{init}:{rate:g}"] = {"curve": curve, "final": curve[-1], "seconds": seconds}
    command = " ".join([sys.executable.split("/")[-1]] + sys.argv)
    out = {
        "command": command,
        "model": _MODEL.value,
        "train_samples": n_train,
        "held_out_samples": len(responses) - n_train,
        "held_out_tokens": int(sum(int(np.asarray(b.loss_mask_BxT).sum()) for b in held_out)),
        "steps": _STEPS.value,
        "spot_train_config": {
            "batch_rows": base.batch_rows,
            "row_len": base.row_len,
            "window": base.window,
            "hot_vocab": _HOT_VOCAB.value,
        },  # fmt: skip
        "harvest_s": round(harvest_s, 1),
        "variants": results,
    }
    print(to_json({k: v["final"] for k, v in results.items()}, indent=1))
    print(f"command: {command}")
    if _OUTPUT_JSON.value:
        write_json(_OUTPUT_JSON.value, out, indent=1)


if __name__ == "__main__":
    app.run(main)
