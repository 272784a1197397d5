"""The 7B run's programs lower on an abstract 8-device mesh with the run's shardings, bytes per
device by hand, and the fit report runs end to end. Nothing here allocates a big model."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from rl_testing import REPO, load_config_dict

from tlt_jax.models.presets import get_preset
from tlt_jax.rl import fit
from tlt_jax.rl.config import TrainConfig


def _config(name: str) -> TrainConfig:
    raw = load_config_dict(name)
    raw.data.name = "arithmetic"  # data does not shape the programs
    return TrainConfig.from_config_dict(raw)


@pytest.fixture(scope="module")
def qwen7b():
    config = _config("qwen2_5_7b_gsm8k")
    return config, get_preset("qwen2_5_7b", dtype="bfloat16")


def test_a_checkpoint_run_is_planned_in_the_dtypes_it_loads():
    """A config that loads a checkpoint (`model.name`) with `architecture` for the plan and no
    dtype set runs in `ModelConfig`'s float32 (the loader does not read torch_dtype); the plan
    took the preset's bfloat16 and counted half the memory."""
    from tlt_jax.models.config import config_from_hf_dict
    from tlt_jax.rl import policy

    raw = load_config_dict("qwen2_5_7b_gsm8k")
    raw.data.name = "arithmetic"  # data does not shape the plan
    raw.model.update(dtype="", param_dtype="")
    settings = TrainConfig.from_config_dict(raw).model
    loaded = config_from_hf_dict(get_preset("qwen2_5_7b").to_hf_dict())
    planned = policy.planned_model_config(settings)
    assert (planned.param_dtype, planned.dtype) == (loaded.param_dtype, loaded.dtype)
    assert loaded.param_dtype == "float32"
    raw.model.update(dtype="bfloat16", param_dtype="float32")  # what the shipped config sets
    planned = policy.planned_model_config(TrainConfig.from_config_dict(raw).model)
    assert (planned.param_dtype, planned.dtype) == ("float32", "bfloat16")


def test_mesh_for_follows_the_heads():
    assert fit.mesh_for(get_preset("qwen2_5_7b"), 8) == (2, 4)  # 28 heads, 4 kv heads
    assert fit.mesh_for(get_preset("qwen2_5_32b"), 256) == (32, 8)
    assert fit.mesh_for(get_preset("llama3_8b"), 64) == (8, 8)
    with pytest.raises(ValueError, match="devices=6 is not a multiple of the tensor degree 4"):
        fit.mesh_for(get_preset("qwen2_5_7b"), 6)


def test_7b_programs_lower_on_an_abstract_8_device_mesh(qwen7b):
    config, model = qwen7b
    live_before = {id(x) for x in jax.live_arrays()}
    programs = fit.lower_programs(config, model, fit.make_mesh((2, 4)), platform="tpu")
    assert set(programs.lowered) == set(fit.PROGRAMS)
    for name, lowered in programs.lowered.items():
        assert '"data"=2, "tensor"=4' in lowered.as_text(), name
    geo = programs.geometry
    r = config.rollout
    assert (geo.rollout_batch, geo.max_seq_len) == (
        r.max_batch_size,
        r.max_prompt_len + r.max_new_tokens,
    )
    # The decode state's K/V by hand: slots over data (2), the 4 kv heads over tensor (4).
    kv = 2 * model.num_layers * geo.rollout_batch * geo.max_seq_len * 4 * 128 * 2  # bf16
    assert programs.bytes_per_device["kv_cache"] == kv // 8
    # The train state is FSDP x TP: all of it over 8 devices, up to replicated norms/biases.
    params = programs.bytes_per_device["train_params"]
    total = model.num_params() * np.dtype(model.jnp_param_dtype).itemsize
    assert params == pytest.approx(total / 8, rel=0.01)
    assert programs.bytes_per_device["optimizer_state"] == pytest.approx(2 * params, rel=0.01)
    # The KL term's frozen reference is a second copy of the train params (it was left out).
    assert config.rl.algorithm.kl_coef == 0 and programs.bytes_per_device["reference_params"] == 0
    rl = dataclasses.replace(config.rl, algorithm=dataclasses.replace(config.rl.algorithm,
                                                                      kl_coef=1e-3))  # fmt: skip
    with_kl = fit.lower_programs(dataclasses.replace(config, rl=rl), model,
                                 fit.make_mesh((2, 4)), platform="tpu", only=())  # fmt: skip
    assert with_kl.bytes_per_device["reference_params"] == params
    # Verify checks the SD threshold's batch with the config's largest tree.
    verify = programs.lowered["verify"].out_info
    assert verify[1].shape == (geo.sd_batch, geo.strategy.verify_tokens)
    assert all(id(x) in live_before for x in jax.live_arrays())  # nothing was allocated


def test_compiled_7b_decode_reports_memory_and_a_verdict(qwen7b):
    config, model = qwen7b
    mesh = fit.make_mesh((2, 4), jax.devices("cpu"))
    programs = fit.lower_programs(config, model, mesh, only=("decode", "draft", "move"))
    memory = fit.compile_memory(programs)
    # The decode step's arguments: the per-layer weights, the decode state and the drafter (the
    # stacked layer weights are unused there, and pruned).
    sizes = programs.bytes_per_device
    assert sizes["rollout_layers"] > 0.8 * sizes["rollout_params"]
    assert memory["decode"]["argument"] >= sizes["rollout_layers"] + sizes["kv_cache"]
    assert memory["decode"]["alias"] > 0  # the state is donated, updated in place
    # A slot move sends one slot's rows (float32 on CPU: twice the bfloat16 bytes), not the
    # cache: the partitioner's own placement all-gathered every layer's whole cache.
    one_slot = sizes["kv_cache"] // (programs.geometry.rollout_batch // 2)
    sent = sum(v for k, v in memory["move"].items() if k.endswith("_bytes"))
    assert 0 < sent <= 3 * one_slot, (sent, one_slot)
    row = fit.fit_row(programs, memory)
    expected_peak = sum(v for k, v in sizes.items() if k != "grad_accumulator") + max(
        sizes["grad_accumulator"], memory["decode"]["temp"], memory["draft"]["temp"],
        memory["move"]["temp"],
    )  # fmt: skip
    assert row["peak_bytes"] == expected_peak
    assert row["fits"] == {chip: expected_peak <= 0.9 * gb * 1e9
                           for chip, gb in fit.MEMORY_GB.items()}  # fmt: skip
    with pytest.raises(ValueError, match="not abstract"):
        fit.compile_memory(fit.lower_programs(config, model, fit.make_mesh((2, 4)),
                                              only=("draft",)))  # fmt: skip


def test_geometry_rounds_rows_to_the_data_degree():
    config = _config("ds_r1_distill_qwen_7b_math")
    geo = fit.Geometry.of(config, data=64)
    assert geo.rollout_batch == 256 and geo.prefill_prompts == 64  # 32 prompts -> 64 replicas
    assert geo.sd_batch == 64
    with pytest.raises(ValueError, match=r"programs \['backward'\] are unknown"):
        fit.lower_programs(config, get_preset("tiny"), fit.make_mesh((1, 1)), only=("backward",))


def test_fit_report_script(tmp_path):
    out = tmp_path / "fit.json"
    md = tmp_path / "fit.md"
    proc = subprocess.run(
        [sys.executable, "scripts/fit_report.py", "--presets=qwen2_5_7b", "--devices=8",
         "--platforms=tpu", "--programs=decode,verify", "--compile=False",
         f"--output_json={out}", f"--markdown={md}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["preset"], r["mesh"]) for r in rows] == [("qwen2_5_7b", "2x4")]
    assert rows[0]["temporaries"] == "not measured (abstract mesh)"
    assert "| qwen2_5_7b | 2x4 |" in md.read_text()


def test_pallas_programs_lowered_for_cuda_hold_the_triton_kernel():
    """With spec.attention_impl=pallas the programs lowered for CUDA on a CPU hold the Triton
    kernel. They held the Pallas interpreter, the CPU's form, since the kernel chose by the
    default backend; and jax 0.11's Triton lowering raises "No supported GPU devices found"
    unless an abstract GPU is named (`fit.ABSTRACT_DEVICES`)."""
    raw = load_config_dict("qwen2_5_7b_gsm8k")
    raw.data.name = "arithmetic"
    raw.spec.attention_impl = "pallas"
    config = TrainConfig.from_config_dict(raw)
    model = get_preset("tiny", dtype="bfloat16")
    programs = fit.lower_programs(config, model, fit.make_mesh((2, 2)), platform="cuda",
                                  only=("decode", "draft", "verify"))  # fmt: skip
    for name, lowered in programs.lowered.items():
        assert "custom_call @__gpu$xla.gpu.triton" in lowered.as_text(), name
