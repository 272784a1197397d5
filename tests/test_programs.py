"""Pools share compiled programs within a process only when the executables would be the same
(`programs.SharedPrograms`): same lowered text, trees, kept arguments and devices."""

import jax
import jax.numpy as jnp
import numpy as np

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
