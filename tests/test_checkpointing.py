"""Checkpoints: round trip, retention, crash leftovers, and kill -9 + resume == uninterrupted
(the TLT config: adaptive SD, two rollout slices, a spot-trained drafter)."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_testing import REPO

from tlt_jax.checkpointing.manager import RunCheckpointer
from tlt_jax.models.presets import get_preset
from tlt_jax.models.transformer import init_model
from tlt_jax.rl import step as step_lib
from tlt_jax.rl.config import OptimConfig

# Values that depend only on the computation, not on timing.
DETERMINISTIC = (
    "step", "epoch", "reward_mean", "reward_std", "accuracy", "groups_with_signal",
    "advantage_abs_mean", "loss", "pg_loss", "entropy", "clip_fraction", "ratio_mean",
    "grad_norm", "learning_rate", "skipped", "response_len_mean", "response_len_p90",
    "response_len_max", "generated_tokens", "response_lengths",
)  # fmt: skip


def _state(seed=0):
    from flax import nnx

    params = nnx.state(init_model(get_preset("tiny"), seed=seed))
    optimizer = step_lib.make_optimizer(OptimConfig(learning_rate=1e-3), 10)
    return step_lib.init_train_state(params, optimizer, seed)


def test_round_trip_retention_and_crash_leftovers(tmp_path):
    state = _state()
    checkpointer = RunCheckpointer(tmp_path, max_to_keep=2)
    for step in range(1, 5):
        bumped = state.replace(step=jnp.int32(step))
        checkpointer.save(step, bumped, {"epoch": 1, "index": step}, {"total_steps": step})
    checkpointer.wait()
    assert checkpointer.all_steps() == [3, 4]
    restored = checkpointer.restore(_state(seed=1))
    assert restored.step == 4 and int(restored.state.step) == 4
    assert restored.data_position == {"epoch": 1, "index": 4}
    assert restored.config == {"total_steps": 4}
    for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state.replace(
            step=jnp.int32(4))), strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)
    checkpointer.close()
    # What a crash during the save of step 5 leaves behind: an unfinished temporary directory.
    leftover = tmp_path / "5.orbax-checkpoint-tmp"
    (leftover / "state").mkdir(parents=True)
    (leftover / "state" / "partial").write_bytes(b"\0" * 100)
    # A reader (scripts/eval.py on a run still training) must not take it for a leftover: it
    # may be the trainer's save in flight. It reads, and deletes and saves nothing.
    reader = RunCheckpointer(tmp_path, read_only=True)
    assert reader.all_steps() == [3, 4] and reader.read_config() == {"total_steps": 4}
    assert reader.restore(_state(seed=1)).step == 4 and leftover.exists()
    with pytest.raises(ValueError, match="opened read-only"):
        reader.save(5, state, {"epoch": 1, "index": 5}, {})
    reader.close()
    assert leftover.exists() and checkpointer.all_steps() == [3, 4]
    reopened = RunCheckpointer(tmp_path, max_to_keep=2)
    assert reopened.latest_step() == 4
    assert reopened.restore(_state()).step == 4
    assert not leftover.exists()
    # A reader of a live run sees the steps it saves and deletes after the reader opened
    # (orbax lists them once: the reader chose step 4 and failed on its deleted files).
    live = RunCheckpointer(tmp_path, read_only=True)
    for step in (5, 6):
        reopened.save(step, state.replace(step=jnp.int32(step)), {"epoch": 1, "index": step},
                      {"total_steps": step})  # fmt: skip
    reopened.wait()
    assert live.all_steps() == [5, 6]  # max_to_keep=2 deleted the step it listed at open
    assert live.latest_step() == 6 and live.restore(_state(seed=1)).step == 6
    live.close()
    reopened.close()


# A failed orbax restore leaves its other array reads' coroutines to the garbage collector,
# each "Exception ignored" (orbax's own; collected inside the test so they are counted here).
def _FAILED_READS(test):
    """Orbax's failed reads leave unraisable exceptions and never-awaited read coroutines."""
    test = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")(test)
    return pytest.mark.filterwarnings("ignore:coroutine .* was never awaited")(test)


@_FAILED_READS
def test_a_workdir_of_another_model_is_named(tmp_path):
    from flax import nnx

    checkpointer = RunCheckpointer(tmp_path, async_save=False)
    checkpointer.save(2, _state(), {"epoch": 0, "index": 2}, {"model": {"preset": "tiny"}})
    checkpointer.close()
    wider = get_preset("tiny").replace(intermediate_size=256)
    optimizer = step_lib.make_optimizer(OptimConfig(learning_rate=1e-3), 10)
    like = jax.eval_shape(
        lambda: step_lib.init_train_state(nnx.state(init_model(wider, seed=0)), optimizer, 0)
    )
    reopened = RunCheckpointer(tmp_path)
    with pytest.raises(ValueError, match=rf"checkpoint {tmp_path}/2 does not fit .*'tiny'"):
        reopened.restore(like)
    gc.collect()
    reopened.close()


@_FAILED_READS
def test_a_damaged_checkpoint_is_named_as_damaged_with_the_step_to_resume_from(tmp_path):
    """Array files lost after a save committed: the run's own state, unreadable. The error
    said "does not fit this run's state (a workdir of another model config?)"; it names the
    damage and the earlier step, and removes nothing (both steps stay on disk)."""
    import shutil

    checkpointer = RunCheckpointer(tmp_path, async_save=False)
    for step in (1, 2):
        checkpointer.save(step, _state().replace(step=jnp.int32(step)),
                          {"epoch": 0, "index": step}, {"model": {"preset": "tiny"}})  # fmt: skip
    checkpointer.close()
    shutil.rmtree(tmp_path / "2" / "state" / "d")  # the OCDBT data files
    reopened = RunCheckpointer(tmp_path)
    damaged = rf"checkpoint {tmp_path}/2 cannot be read \(files lost or damaged"
    with pytest.raises(ValueError, match=damaged + r" .* resume from step 1"):
        reopened.restore(_state())
    gc.collect()
    assert reopened.all_steps() == [1, 2]
    assert reopened.restore(_state(), step=1).step == 1
    reopened.close()


@_FAILED_READS
def test_a_checkpoint_missing_a_part_is_named_as_damaged(tmp_path):
    """A whole part lost (an interrupted copy): orbax raised a KeyError ('Item "data" was not
    found') or a FileNotFoundError naming neither the step nor what to do."""
    import shutil

    checkpointer = RunCheckpointer(tmp_path, async_save=False)
    for step in (1, 2, 3):
        checkpointer.save(step, _state().replace(step=jnp.int32(step)),
                          {"epoch": 0, "index": step}, {"model": {"preset": "tiny"}})  # fmt: skip
    checkpointer.close()
    shutil.rmtree(tmp_path / "3" / "data")
    (tmp_path / "2" / "state" / "_METADATA").unlink()
    (tmp_path / "2" / "state" / "manifest.ocdbt").unlink()
    reopened = RunCheckpointer(tmp_path, read_only=True)
    with pytest.raises(ValueError, match=rf"{tmp_path}/3 cannot be read \(its \['data'\] part "
                                         r"is missing.*resume from step 2"):  # fmt: skip
        reopened.restore(_state())
    with pytest.raises(ValueError, match=rf"{tmp_path}/2 cannot be read .*resume from step 1"):
        reopened.restore(_state(), step=2)
    assert reopened.restore(_state(), step=1).step == 1
    reopened.close()


def _env():
    return {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}:{REPO}"}


# Spot training with exactly 2 drafter steps per RL step (the drafter evolves the same way
# whatever the timing) and top_k = 1 (SD emits the argmax whatever the drafts): the drafter's
# losses, versions and steps are as deterministic as the policy's metrics.
SPOT_OVERRIDES = {
    "total_steps": 4, "checkpoint_every": 2, "eval.num_problems": 0, "plot_every": 100,
    "rl.reward_fn": "rl_testing:slow_mean_byte_reward", "rollout.max_new_tokens": 24,
    "rollout.top_k": 1, "spot.exact_steps_per_rl_step": 2,
}  # fmt: skip
SPOT_DETERMINISTIC = DETERMINISTIC + ("drafter_version", "drafter_steps", "drafter_loss",
                                      "drafter_accuracy")  # fmt: skip


def _spot_command(workdir):
    flags = [f"--config.{key}={value}" for key, value in SPOT_OVERRIDES.items()]
    return [sys.executable, "scripts/train.py", "--config", "configs/tiny.py:tlt",
            "--workdir", str(workdir), *flags]  # fmt: skip


def test_kill_9_with_spot_training_resumes_the_drafter_too(tmp_path):
    """configs/tiny.py:tlt (adaptive SD, two slices, the drafter spot-trained from a cold
    start), two CPU devices per process: kill -9 in step 4, after the step-2 checkpoint; the
    resumed run redoes step 3 exactly as the killed run did it (policy and drafter metrics:
    params, optimizer states, data order, sampling seeds and the drafter's buffer all came
    back), then finishes step 4. An uninterrupted reference run would add one more process
    start (~40 s of the suite) to check step 4 too; the redone step is the one that reads
    everything the checkpoint restored."""
    # Two devices per process (the last device-count flag wins), the suite's other options.
    xla_flags = os.environ["XLA_FLAGS"] + " --xla_force_host_platform_device_count=2"
    env = {**_env(), "XLA_FLAGS": xla_flags}
    killed = tmp_path / "killed"

    def records(lines):
        return [{k: json.loads(line).get(k) for k in SPOT_DETERMINISTIC} for line in lines]

    process = subprocess.Popen(_spot_command(killed), cwd=REPO, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    metrics, step_2 = killed / "metrics.jsonl", killed / "checkpoints" / "2"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        # The step-2 checkpoint is saved in the background: on a loaded machine step 3 can end
        # before orbax renames its temporary directory, and a kill then leaves nothing to resume.
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3 and step_2.is_dir():
            break
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    before_kill = records(metrics.read_text().splitlines())
    assert [r["step"] for r in before_kill] == [1, 2, 3]  # killed in step 4
    assert before_kill[2]["drafter_version"] >= 1 and before_kill[2]["drafter_steps"] == 2
    resumed = subprocess.run(_spot_command(killed), cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=400)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    resumed_from = int(resumed.stdout.split("resumed from ")[1].split(")")[0])
    assert resumed_from == 2
    after = records(metrics.read_text().splitlines())
    assert [r["step"] for r in after] == [1, 2, 3, 4]  # one line per step, step 3 redone
    assert after[:3] == before_kill
    assert after[3]["drafter_version"] >= 2 and after[3]["drafter_steps"] == 2
