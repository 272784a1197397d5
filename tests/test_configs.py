"""Every config loads and builds; bad values are refused before anything loads or compiles."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags
from rl_testing import CONFIG_DIR, REPO, load_config_dict, tiny_config

from tlt_jax.models.presets import get_preset
from tlt_jax.rl import packing, policy
from tlt_jax.rl.config import ModelSettings, RLConfig, TrainConfig, default_config_dict
from tlt_jax.rl.trainer import Trainer

CONFIGS = [("tiny", None), ("tiny", "tlt"), ("smollm2_arith", None), ("smollm2_arith", "smoke"),
           ("smollm2_arith", "quick"),
           ("smollm2_gsm8k", None), ("qwen2_5_7b_gsm8k", None),
           ("ds_r1_distill_qwen_7b_math", None)]  # fmt: skip
BIG = {"qwen2_5_7b_gsm8k", "ds_r1_distill_qwen_7b_math"}


def _build(name, arg=None):
    config = load_config_dict(name, arg)
    if config.data.name == "gsm8k":
        config.data.data_dir = str(REPO.parent / "shared" / "data" / "gsm8k")
    return config, TrainConfig.from_config_dict(config)


DRAFTER_CONFIGS = [("drafter_warmup", None), ("drafter_warmup", "arith")]


def test_every_config_file_is_listed():
    listed = {name for name, _ in CONFIGS + DRAFTER_CONFIGS}
    assert {p.stem for p in CONFIG_DIR.glob("*.py")} == listed


@pytest.mark.parametrize(("name", "arg"), DRAFTER_CONFIGS)
def test_drafter_config_loads_and_builds(name, arg, tmp_path):
    """train_drafter.py's config files: every field typed, the optimizer the RL run's own."""
    from tlt_jax.drafter.warmup import config_from_dict
    from tlt_jax.optim import OptimConfig

    raw = load_config_dict(name, arg)
    with pytest.raises(ValueError, match="prompts=''"):
        config_from_dict(raw, "/tmp/w")
    raw.prompts = str(tmp_path / "prompts.jsonl")
    # A missing prompts file is named before train_drafter.py loads the policy.
    with pytest.raises(FileNotFoundError, match=r"--config\.prompts file .*prompts\.jsonl does"):
        config_from_dict(raw, "/tmp/w")
    # So are an empty file and rows of another form (they failed after the policy loaded).
    (tmp_path / "prompts.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"--config\.prompts file .* has no prompts; expected"):
        config_from_dict(raw, "/tmp/w")
    (tmp_path / "prompts.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match=r"prompts\.jsonl:1: expected an object with .*prompt"):
        config_from_dict(raw, "/tmp/w")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "q"}\n')
    # A workdir that is a file or a URL is refused by name.
    (tmp_path / "a_file").write_text("")
    for workdir, why in ((tmp_path / "a_file", "exists and is not a directory"),
                         ("gs://bucket/run", "is a URL")):  # fmt: skip
        with pytest.raises(ValueError, match=f"--workdir=.*{why}"):
            config_from_dict(raw, str(workdir))
    config, script = config_from_dict(raw, "/tmp/w")
    assert script["model"] == "smollm2-135m-instruct" and config.workdir == "/tmp/w"
    assert isinstance(config.train.optim, OptimConfig)
    assert config.train.total_steps == (400 if arg == "arith" else 1000)
    raw.train.optim.warmup_steps = 5000
    with pytest.raises(ValueError, match="optim.warmup_steps=5000 must be < total_steps"):
        config_from_dict(raw, "/tmp/w")
    raw.train.optim.warmup_steps = 10
    raw.train.lr = 1.0
    with pytest.raises(ValueError, match="train.lr is not a field"):
        config_from_dict(raw, "/tmp/w")


@pytest.mark.parametrize(("name", "arg"), CONFIGS)
def test_config_loads_and_builds(name, arg):
    raw, config = _build(name, arg)
    for field in ("total_steps", "checkpoint_every", "seed"):
        assert field in raw, field
    assert f"configs/{name}.py" in (CONFIG_DIR / f"{name}.py").read_text()  # launch command
    plan = policy.plan_run(config)  # shapes and shardings only; nothing is allocated
    expected = get_preset(config.model.architecture or config.model.preset)
    assert plan.num_params == expected.num_params()
    assert plan.mesh_shape == config.model.mesh_shape
    assert plan.abstract_state.params is not None
    if name in BIG:
        # float32 master weights FSDP x TP over 8 chips, AdamW moments laid out alike.
        assert plan.param_bytes_per_device == pytest.approx(4 * plan.num_params / 8, rel=0.05)
        assert plan.opt_state_bytes_per_device == pytest.approx(
            2 * plan.param_bytes_per_device, rel=0.01
        )
        lowered = policy.lower_grad_program(config, plan, prompt_len=256, response_len=512)
        assert "stablehlo" in lowered.as_text()[:2000] or lowered.as_text()


@pytest.mark.parametrize("name", sorted({n for n, _ in CONFIGS + DRAFTER_CONFIGS}))
def test_an_unknown_variant_is_refused_not_ignored(name):
    """`--config file.py:bogus` names the variant and the file's own; a file without variants
    refuses any instead of ignoring it and launching the full run."""
    variants = sorted({a for n, a in CONFIGS + DRAFTER_CONFIGS if n == name and a})
    want = f"is not one of {variants}" if variants else "takes no variant; got 'bogus'"
    with pytest.raises(ValueError, match=re.escape(want)):
        load_config_dict(name, "bogus")


def _error(**overrides):
    with pytest.raises(ValueError) as info:
        tiny_config(**overrides)
    return str(info.value)


def test_bad_values_name_field_and_allowed_values():
    assert "rl.group_size=1 must be an integer >= 2" in _error(**{"rl.group_size": 1})
    assert "optim.learning_rate=-0.001" in _error(**{"optim.learning_rate": -1e-3})
    message = _error(**{"rl.micro_batch_size": 3})
    assert "rl.micro_batch_size=3" in message and "allowed: [4, 8]" in message
    message = _error(**{"rl.advantage_estimator": "ppo"})
    assert "rl.advantage_estimator='ppo'" in message and "'dr_grpo', 'grpo', 'rloo'" in message
    assert "'seq_mean_token_mean'" in _error(**{"rl.loss_aggregation": "sum"})
    assert "rollout.temperature=0.0 must be finite and > 0" in _error(
        **{"rollout.temperature": 0.0}
    )
    assert "rollout.temperature=inf must be finite" in _error(**{"rollout.temperature": math.inf})
    assert "config.seed=4294967296 must be < 2**32" in _error(seed=2**32)
    assert "model.init_seed=4294967296 must be < 2**32" in _error(**{"model.init_seed": 2**32})
    # A fractional size used to be truncated to a mesh of another shape (1.5 -> 1).
    for shape in ((1.5, 1), (1, True), (1, 1, 1), (0, 1)):
        assert f"model.mesh_shape={shape!r} must be two positive integers" in _error(
            **{"model.mesh_shape": shape}
        )
    assert "data.num_train=0 must be >= 1" in _error(**{"data.num_train": 0})
    message = _error(total_steps=2, **{"optim.warmup_steps": 4, "rl.num_minibatches": 2})
    assert ("optim.warmup_steps=4 must be < the run's optimizer updates, total_steps=2 x "
            "rl.num_minibatches=2 = 4") in message  # fmt: skip
    tiny_config(total_steps=2, **{"optim.warmup_steps": 3, "rl.num_minibatches": 2})
    for name in ("attention_chunk", "logits_chunk"):
        assert f"rl.{name}=3 must be 0 or a power of two" in _error(**{f"rl.{name}": 3})
    assert "rollout.xla_opt_level=4 must be an integer in 0..3" in _error(
        **{"rollout.xla_opt_level": 4}
    )
    assert "optim.schedule='step'" in _error(**{"optim.schedule": "step"})
    assert "'math_accuracy'" in _error(**{"rl.reward_fn": "no_such_reward"})
    message = _error(**{"model.preset": "huge"})
    assert "model.preset='huge'" in message and "'tiny'" in message
    with pytest.raises(ValueError, match="rl.remat='yes' must be true, false or unset"):
        RLConfig(remat="yes")  # a config file's typed placeholder refuses it even earlier
    message = _error(**{"rl.recompute_logprobs": False, "rl.num_minibatches": 2})
    assert "rl.recompute_logprobs=False with rl.num_minibatches=2" in message


def test_unknown_field_is_refused():
    config = load_config_dict("tiny")
    config.unlock()
    config.rl.group_sise = 4
    with pytest.raises(ValueError, match=r"rl.group_sise is not a field.*'group_size'"):
        TrainConfig.from_config_dict(config)


def test_gsm8k_without_folder_names_the_flag(tmp_path):
    config = load_config_dict("smollm2_gsm8k")
    with pytest.raises(ValueError, match="--config.data.data_dir"):
        TrainConfig.from_config_dict(config)
    # A folder that does not exist fails when the data loads, before any model is built.
    config = tiny_config(**{"data.name": "gsm8k", "data.data_dir": str(tmp_path / "missing")})
    with pytest.raises(FileNotFoundError, match="--config.data.data_dir"):
        Trainer(config, tmp_path / "run", progress=False)


def test_cli_refuses_bad_config_before_compiling(tmp_path):
    result = subprocess.run(
        [sys.executable, "scripts/train.py", "--config", "configs/tiny.py",
         "--workdir", str(tmp_path), "--config.rl.group_size=1"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "rl.group_size=1 must be an integer >= 2" in result.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_default_config_dict_is_the_typed_defaults():
    config = default_config_dict()
    config.model.preset = "tiny"
    assert TrainConfig.from_config_dict(config) == TrainConfig(ModelSettings(preset="tiny"))


def test_command_line_sets_fields_whose_default_is_none():
    # Fields defaulting to None are typed placeholders, so absl can parse a value for them.
    argv = ["train.py", f"--config={CONFIG_DIR / 'smollm2_gsm8k.py'}",
            "--config.data.data_dir=/data/gsm8k", "--config.data.system_prompt=Be brief.",
            "--config.rl.epsilon_high=0.3", "--config.rollout.xla_opt_level=2"]  # fmt: skip
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
    values(argv)
    config = TrainConfig.from_config_dict(values.config)
    assert config.data.data_dir == "/data/gsm8k"
    assert config.data.system_prompt == "Be brief."
    assert config.rl.algorithm.epsilon_high == 0.3
    assert config.rollout.xla_opt_level == 2


def test_the_rollout_engine_gets_the_configured_xla_level():
    from tlt_jax.models.transformer import init_model

    config = tiny_config(**{"rollout.xla_opt_level": 2})
    model = init_model(get_preset(config.model.preset), seed=0)
    engine = policy.build_engine(config, model)
    assert engine.config.xla_opt_level == 2
    assert engine._options == {"xla_backend_optimization_level": 2}


def test_dr_grpo_normed_aggregation_takes_the_generation_budget_unless_set():
    config = default_config_dict()
    config.model.preset = "tiny"
    config.rl.update(advantage_estimator="dr_grpo", loss_aggregation="seq_mean_token_sum_norm")
    config.rollout.max_new_tokens = 48
    algorithm = TrainConfig.from_config_dict(config).rl.algorithm
    assert algorithm.loss_norm_tokens == 48
    config.rl.loss_norm_tokens = 1024
    assert TrainConfig.from_config_dict(config).rl.algorithm.loss_norm_tokens == 1024
    config.rl.loss_norm_tokens = 0
    with pytest.raises(ValueError, match=r"rl.loss_norm_tokens=0 must be a positive integer"):
        TrainConfig.from_config_dict(config)
    config.rl.loss_aggregation = "token_mean"  # named as itself, whichever aggregation is set
    with pytest.raises(ValueError, match=r"rl.loss_norm_tokens=0 must be a positive integer"):
        TrainConfig.from_config_dict(config)
    # Its weights through the packed update's: seq_mean_token_sum's over the budget.
    lengths = [[1] * 5, [2] * 3, [], [4]]
    normed, _ = packing.minibatch_weights("seq_mean_token_sum_norm", [0, 1], 2, lengths, 48)
    summed, _ = packing.minibatch_weights("seq_mean_token_sum", [0, 1], 2, lengths)
    np.testing.assert_allclose(normed, summed / 48, rtol=1e-12)
