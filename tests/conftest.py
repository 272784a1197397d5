"""Test set-up: 8 fake CPU devices, set before JAX is imported anywhere."""

import importlib.metadata
import os

# Tiny models compile far longer than they run: LLVM's -O0 halves the suite's compile seconds
# (146 -> 83 s for tests/test_engine.py + test_speculative.py) and runs faster overall even
# with real weights (matmuls are library calls either way). Subprocesses inherit it.
#
# XLA:CPU's fusion emitters (its default on jaxlib 0.10) compile twice as long as the
# legacy LLVM IR emitters for these programs: tests/test_engine.py 110 -> 49 compile seconds
# (275 programs), tests/test_model.py (real weights) 81 -> 69 s in all. Only on the jaxlib it
# was measured on: an XLA that no longer knows a flag aborts at start-up. A setting for -O0
# only: at the default level the legacy emitters compile SmolLM2's decode programs 2.2x
# longer (scripts/bench_rollout.py --batch_sizes 1,32: 16.0-18.5 s a side vs 7.3-9.1 s).
try:
    _JAXLIB = importlib.metadata.version("jaxlib")
except importlib.metadata.PackageNotFoundError:  # a jaxlib installed without its metadata
    _JAXLIB = ""
_LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false " if _JAXLIB.startswith("0.10.") else ""
os.environ["XLA_FLAGS"] = (
    "--xla_backend_optimization_level=0 "
    + _LEGACY_EMITTERS
    + os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402  (after XLA_FLAGS)

# No persistent compilation cache: one SIGSEGV of the suite printed its stack loading an entry
# (compilation_cache.get_executable_and_time; later ones crashed compiling, see below),
# and loading XLA:CPU executables is known to crash (jax-ml/jax#28908; uwplasma/vmex#142 traced
# one to LLVM's object linking). It saved 358 s of a 33-minute run (before -O0 above).
jax.config.update("jax_compilation_cache_dir", None)

import contextlib  # noqa: E402
import faulthandler  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """A crash in native code prints the crashing thread only, on the stderr pytest's own
    faulthandler set-up found (after it): with every thread's stack the one that matters
    scrolled out of a CI log's tail.

    The files go to the workers in `pytest_collection_modifyitems`' order, not in
    pytest-xdist's own (by test count, `--loadscope-reorder`, 3.6+)."""
    stderr = sys.stderr if hasattr(sys.stderr, "fileno") else sys.__stderr__
    faulthandler.enable(file=os.dup(stderr.fileno()), all_threads=False)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# Seconds each test file took in a whole-suite run (2 workers, `--dist loadfile`, JUnit times,
# 2026-12-07, session 40, adjusted for that session's test changes; files under 10 s left
# out). The workers take whole files in this order, the longest first, so that both end
# together: in pytest-xdist's order (by test count) the two tests of test_multiprocess.py and
# test_checkpointing.py's five came last, and one worker ran them while the other had finished.
_FILE_SECONDS = {
    "test_rl_trainer.py": 259, "test_tlt_rollout.py": 180, "test_engine.py": 147,
    "test_speculative.py": 136, "test_multiprocess.py": 126, "test_model.py": 108,
    "test_accelerator_check.py": 101, "test_spec_bench.py": 101, "test_packing.py": 95,
    "test_spot.py": 80, "test_checkpointing.py": 78, "test_distributed.py": 61,
    "test_bench_accept.py": 40, "test_drafter.py": 39, "test_fit.py": 37,
    "test_bench_tlt.py": 32, "test_sampling_fixes.py": 30, "test_pool_bench.py": 29,
    "test_sharding.py": 27, "test_data.py": 26, "test_bench_versions.py": 24,
    "test_decode.py": 22, "test_tree_attention.py": 20, "test_vocab_parallel.py": 18,
    "test_plots.py": 15, "test_accept_ceiling.py": 14, "test_configs.py": 13,
    "test_ngram.py": 13, "test_bench_update_packing.py": 13, "test_programs.py": 13,
    "test_kernel_bench.py": 11,
}  # fmt: skip


def pytest_collection_modifyitems(items):
    """Longest files first (`_FILE_SECONDS`; a file not listed counts 0.3 s a test); a file's
    own tests keep their order."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1
    items.sort(key=lambda item: -_FILE_SECONDS.get(item.path.name, 0.3 * counts[item.path.name]))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Each test module's compiled programs are released when it ends.

    A whole-suite process otherwise holds thousands of XLA:CPU executables. Three full runs in
    a row crashed with SIGSEGV late in the suite (tests 545-548 of 592, ~3,700 compiles in), the
    last one printed inside `backend_compile_and_load`, while the same tests pass alone.
    """
    yield
    jax.clear_caches()
    gc.collect()


_COMPILES = {"count": 0, "seconds": 0.0}


def _on_duration(event: str, duration: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES["count"] += 1
        _COMPILES["seconds"] += duration


jax.monitoring.register_event_duration_secs_listener(_on_duration)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _compiles_of(item, "setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _compiles_of(item, "call"):
        return (yield)


@contextlib.contextmanager
def _compiles_of(item, phase):
    """Adds the phase's compile seconds to the test's report (it is made after the phase), so
    that the controller can name the tests that compile longest."""
    before = _COMPILES["seconds"]
    try:
        yield
    finally:
        item.user_properties.append(("xla_compile_s", _COMPILES["seconds"] - before))


_COMPILE_S_BY_TEST: dict[str, float] = {}


def pytest_runtest_logreport(report):
    for name, value in report.user_properties:
        if name == "xla_compile_s" and report.when in ("setup", "call"):
            _COMPILE_S_BY_TEST[report.nodeid] = _COMPILE_S_BY_TEST.get(report.nodeid, 0) + value


def pytest_sessionfinish(session):
    """A pytest-xdist worker hands its compile count to the controller (`pytest_testnodedown`)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["xla_compiles"] = dict(_COMPILES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    worker = getattr(node, "workeroutput", {}).get("xla_compiles", {})
    for key, value in worker.items():
        _COMPILES[key] += value


def pytest_terminal_summary(terminalreporter):
    """How much of the session was XLA compiling (the test processes', not subprocesses')."""
    terminalreporter.write_line(
        f"XLA: {_COMPILES['count']} compiles in {_COMPILES['seconds']:.0f} s"
    )
    by_file: dict[str, float] = {}
    for nodeid, seconds in _COMPILE_S_BY_TEST.items():
        by_file[nodeid.split("::")[0]] = by_file.get(nodeid.split("::")[0], 0) + seconds
    if by_file:
        top = sorted(by_file.items(), key=lambda kv: -kv[1])[:8]
        terminalreporter.write_line(
            "XLA compile seconds by file (in-process): "
            + ", ".join(f"{path.removeprefix('tests/')} {s:.0f}" for path, s in top)
        )
