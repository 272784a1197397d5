"""Test set-up: 8 fake CPU devices, set before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402  (after XLA_FLAGS)

# Tests build many engines over the same tiny model; identical programs are compiled once
# per test session instead of once per engine.
jax.config.update(
    "jax_compilation_cache_dir",
    os.path.join(os.environ.get("TLT_TEST_CACHE", "/tmp"), "tlt_jax_test_xla_cache"),
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
