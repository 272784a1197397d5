"""Pools share compiled programs within a process only when the executables would be the same
(`programs.SharedPrograms`): same lowered text, trees, kept arguments and devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax import programs
from tlt_jax.programs import ProgramPool, SharedPrograms


def _double(a, b):
    return a * 2.0, b


def test_a_second_pool_reuses_the_first_pools_program():
    x = jnp.arange(4.0)
    first, second = ProgramPool(), ProgramPool()
    # A shape no other test compiles, so the first pool compiles it itself.
    y = jnp.arange(17.0)
    program = first.get(("double",), _double, lambda: (x, y))
    assert second.get(("twice",), _double, lambda: (x, y)) is program
    assert [c.reused for c in first.compiled] == [False]
    assert [c.reused for c in second.compiled] == [True]
    np.testing.assert_array_equal(program(x, y)[0], x * 2)
    with programs.compile_privately():
        third = ProgramPool()
        assert third.get(("double",), _double, lambda: (x, y)) is not program
    assert not third.compiled[0].reused


def test_programs_that_differ_only_in_what_the_text_hides_are_not_shared():
    x = jnp.ones((4,))
    key = SharedPrograms.fingerprint
    # The argument pruning keeps: the same module text, another argument read.
    assert key(jax.jit(lambda a, b: a * 2).lower(x, x)) != key(
        jax.jit(lambda a, b: b * 2).lower(x, x)
    )
    # Donation.
    assert key(jax.jit(lambda a: a * 2).lower(x)) != key(
        jax.jit(lambda a: a * 2, donate_argnums=0).lower(x)
    )
    # The device an input lives on, and the default device of uncommitted inputs.
    d0, d1 = jax.devices()[:2]
    f = jax.jit(lambda a: a * 2)
    assert key(f.lower(jax.device_put(x, d0))) != key(f.lower(jax.device_put(x, d1)))
    spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    with jax.default_device(d1):
        on_d1 = key(f.lower(spec))
    assert on_d1 != key(f.lower(spec))
    # The same mesh shape over other devices.
    meshes = [jax.sharding.Mesh(np.asarray(devices), ("data",))
              for devices in (jax.devices()[:2], jax.devices()[2:4])]  # fmt: skip
    placed = [jax.device_put(jnp.ones((4,)), jax.sharding.NamedSharding(m, jax.P("data")))
              for m in meshes]  # fmt: skip
    assert key(f.lower(placed[0])) != key(f.lower(placed[1]))
    # A host callback is never shared.
    assert key(jax.jit(lambda a: jax.debug.callback(print, a) or a).lower(x)) is None
    # And the same program twice is.
    assert key(f.lower(x)) == key(jax.jit(lambda a: a * 2).lower(x)) is not None


def test_compile_options_reach_xla_and_key_the_shared_executable():
    x = jnp.arange(19.0)
    first, second, third = ProgramPool(), ProgramPool(), ProgramPool()
    plain = first.get(("p",), _double, lambda: (x, x))
    level1 = second.get(("p",), _double, lambda: (x, x),
                        options={"xla_backend_optimization_level": 1})  # fmt: skip
    assert level1 is not plain and not second.compiled[0].reused  # another executable
    assert third.get(("q",), _double, lambda: (x, x),
                     options={"xla_backend_optimization_level": 1}) is level1  # fmt: skip
    np.testing.assert_array_equal(level1(x, x)[0], plain(x, x)[0])
    # The options reach XLA: a name it does not know fails the compile, naming it.
    with pytest.raises(Exception, match="xla_no_such_option"):
        ProgramPool().get(("r",), _double, lambda: (x, x), options={"xla_no_such_option": 1})


def test_engine_programs_compile_at_the_configured_level(monkeypatch):
    from tlt_jax.rollout.engine import CPU_OPT_LEVEL, EngineConfig, compile_options

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert compile_options(None, "cpu") == {"xla_backend_optimization_level": CPU_OPT_LEVEL}
    assert compile_options(None, "gpu") is None and compile_options(None, "tpu") is None
    assert compile_options(2, "gpu") == {"xla_backend_optimization_level": 2}
    # A level the user set in XLA_FLAGS (the test suite's -O0) rules over the per-backend one.
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    assert compile_options(None, "cpu") is None
    assert compile_options(3, "cpu") == {"xla_backend_optimization_level": 3}
    for bad in (4, -1, True, 1.0, "1"):
        with pytest.raises(ValueError, match=f"engine.xla_opt_level={bad!r}"):
            EngineConfig(xla_opt_level=bad)


def test_an_engine_compiles_every_program_with_its_level_and_emits_the_same_tokens(monkeypatch):
    from tlt_jax.models import presets
    from tlt_jax.models.transformer import init_model
    from tlt_jax.rollout.engine import EngineConfig, Request, RolloutEngine

    seen = []
    compile_ = programs.SHARED.compile
    monkeypatch.setattr(
        programs.SHARED,
        "compile",
        lambda lowered, options=None: seen.append(options) or compile_(lowered, options),
    )
    model = init_model(presets.get_preset("tiny"), seed=1)
    tokens = {}
    # One pool for both engines: each level's programs are its own (a shared pool ran the
    # first engine's programs at the second's level).
    pool = programs.ProgramPool()
    for level in (0, 1):
        engine = RolloutEngine(model, EngineConfig(max_batch_size=2, max_seq_len=64,
                                                   xla_opt_level=level), pool=pool)  # fmt: skip
        seen.clear()
        out = engine.generate([Request(prompt_ids=[1, 2, 3], max_new_tokens=6)], progress=False)
        assert seen and all(o == {"xla_backend_optimization_level": level} for o in seen)
        tokens[level] = out[0].token_ids, out[0].logprobs
    levels = {key[-1] for key in pool.keys()}
    assert levels == {"xla:xla_backend_optimization_level=0",
                      "xla:xla_backend_optimization_level=1"}  # fmt: skip
    assert tokens[0][0] == tokens[1][0]  # greedy: the level changes no token of this model
    np.testing.assert_allclose(tokens[0][1], tokens[1][1], atol=1e-5)


def test_engines_of_other_models_sharing_a_pool_run_their_own_programs():
    """Pool keys held shapes, not what the programs are made of: an engine of another model
    of the same shapes (here another RoPE base) sharing a pool ran the first one's programs
    (review finding). Identically configured engines still share theirs."""
    from tlt_jax.models import presets
    from tlt_jax.models.transformer import init_model
    from tlt_jax.rollout.engine import EngineConfig, Request, RolloutEngine

    config = presets.get_preset("tiny")
    models = [init_model(config, seed=1), init_model(config.replace(rope_theta=77.0), seed=1)]
    request = [Request(prompt_ids=[1, 2, 3, 4, 5], max_new_tokens=8)]
    engine_config = EngineConfig(max_batch_size=2, max_seq_len=64)

    def tokens(engine):  # with their log-probs, which any change of the model moves
        out = engine.generate(request, progress=False)[0]
        return out.token_ids, np.round(out.logprobs, 5).tolist()

    alone = [tokens(RolloutEngine(m, engine_config)) for m in models]
    assert alone[0] != alone[1]  # the RoPE base changes what this model computes
    pool = programs.ProgramPool()
    shared = [tokens(RolloutEngine(m, engine_config, pool=pool)) for m in models]
    assert shared == alone
    compiled = len(pool.keys())
    assert tokens(RolloutEngine(models[1], engine_config, pool=pool)) == alone[1]
    assert len(pool.keys()) == compiled  # the same config's programs are reused
