"""Test set-up: 8 fake CPU devices, set before JAX is imported anywhere."""

import os

# Tiny models compile far longer than they run: LLVM's -O0 halves the suite's compile seconds
# (146 -> 83 s for tests/test_engine.py + test_speculative.py) and runs faster overall even
# with real weights (matmuls are library calls either way). Subprocesses inherit it.
os.environ["XLA_FLAGS"] = (
    "--xla_backend_optimization_level=0 "
    + os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
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

import faulthandler  # noqa: E402
import sys  # noqa: E402

# A crash in native code prints the crashing thread only: with every thread's stack (pytest's
# default) the one that matters scrolls out of a CI log's tail.
faulthandler.enable(file=sys.__stderr__, all_threads=False)

_CACHE_STATS = {"hits": 0, "saved_s": 0.0, "compiles": 0, "compile_s": 0.0}


def _on_duration(event: str, duration: float, **_) -> None:
    if event == "/jax/compilation_cache/compile_time_saved_sec":
        _CACHE_STATS["hits"] += 1
        _CACHE_STATS["saved_s"] += duration
    elif event == "/jax/core/compile/backend_compile_duration":
        _CACHE_STATS["compiles"] += 1
        _CACHE_STATS["compile_s"] += duration


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def pytest_terminal_summary(terminalreporter):
    """How much compiling this session did, and what the persistent cache saved."""
    s = _CACHE_STATS
    terminalreporter.write_line(
        f"XLA: {s['compiles']} compiles in {s['compile_s']:.0f} s; compilation cache: "
        f"{s['hits']} hits saved {s['saved_s']:.0f} s"
    )
