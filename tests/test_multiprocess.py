"""The whole TLT path as two JAX processes (jax.distributed, gloo on CPU) vs one process:
rollout slices one per process, spot training, the drafter's and the data-parallel update's
collectives, process 0 writing."""

import json
import os
import subprocess
import sys

import pytest
from rl_testing import REPO, load_config_dict

from tlt_jax.rl.config import TrainConfig
from tlt_jax.rl.trainer import Trainer

STEPS = 3
# Plain rollouts: SD at temperature > 0 is lossless in distribution, but which tokens it samples
# depends on the bandit's (timing-driven) arm choices, so only plain rollouts sample the same
# tokens in two runs. Spot training, the drafter's cross-process sync and export all still run.
# A dense reward, so every group has signal and the data-parallel update has gradients to sum.
REWARD = "rl_testing:mean_byte_reward"
OVERRIDES = [f"--config.total_steps={STEPS}", "--config.eval.num_problems=0",
             "--config.checkpoint_every=2", "--config.spec.mode=off",
             f"--config.rl.reward_fn={REWARD}"]  # fmt: skip


def _records(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


# Each variant's extra overrides: the default (on-policy: the update's own forward gives the
# drafter its features), and a log-prob recompute before the update, which each process runs
# only on the micro-batches it trains (the drafter's features shared across processes).
VARIANTS = {"on_policy": {}, "recompute": {"rl.recompute_logprobs": True}}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_two_processes_run_tlt_in_sync_and_match_one_process(tmp_path, variant):
    extra = VARIANTS[variant]
    workdir = tmp_path / "two"
    env = dict(os.environ)  # one device per process; the suite's compiler options kept
    env["XLA_FLAGS"] = env["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=8", "")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests"),
                                                      env.get("PYTHONPATH")]))  # fmt: skip
    command = [sys.executable, str(REPO / "scripts" / "launch_local.py"), "--num_processes", "2",
               "--pin_cores", "--", sys.executable, str(REPO / "scripts" / "train.py"),
               f"--config={REPO / 'configs' / 'tiny.py'}:tlt", f"--workdir={workdir}",
               *OVERRIDES, *(f"--config.{k}={v}" for k, v in extra.items())]  # fmt: skip
    if len(os.sched_getaffinity(0)) < 2:
        command.remove("--pin_cores")
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    two = _records(workdir)
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))  # process 0 wrote them once
    for r in two:  # after every step both processes hold the same policy, drafter and buffer
        assert r["processes_in_sync"] is True and r["spot_slices"] == 2
    assert (workdir / "drafter" / "model.safetensors").is_file()
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "3"]

    assert all(r["micro_batches_trained"] >= 2 and r["loss"] != 0 for r in two)
    # The same config in one process (two of the test session's fake devices): rollouts use
    # per-request seeds, so the sampled tokens, rewards and the update are the same math
    # (the drafter's steps are not: how many fit in an idle window is a matter of timing).
    config = load_config_dict("tiny", "tlt")
    config.total_steps, config.eval.num_problems, config.checkpoint_every = STEPS, 0, 2
    config.spec.mode = "off"
    config.rl.reward_fn = REWARD
    for k, v in extra.items():
        section, field = k.split(".")
        config[section][field] = v
    trainer = Trainer(TrainConfig.from_config_dict(config), tmp_path / "one", progress=False)
    one = trainer.train()
    trainer.close()
    for a, b in zip(one, two, strict=True):
        assert a["response_lengths"] == b["response_lengths"]
        for key in ("reward_mean", "accuracy", "groups_with_signal", "micro_batches_trained",
                    "update_tokens_computed"):  # fmt: skip
            assert a[key] == b[key], key
        for key in ("loss", "grad_norm", "logprob_diff"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        if extra:  # each process recomputed half of what one process did
            assert a["logprob_forwards"] == a["micro_batches_trained"] >= 2
            assert b["logprob_forwards"] == -(-a["logprob_forwards"] // 2)
        else:
            assert a["logprob_forwards"] == b["logprob_forwards"] == 0
