"""One process of `test_distributed.py`'s late-peer test (run under `scripts/launch_local.py`):
process 0 reaches the first collectives `TLT_TEST_LATE_S` seconds after process 1."""

import os
import sys
import time

import numpy as np

from tlt_jax.parallel import distributed

distributed.initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

group = distributed.ProcessGroup()
late_s = float(os.environ["TLT_TEST_LATE_S"])
for round_ in range(2):  # the first collective sets gloo up (late); the second is on time
    if group.index == 0 and round_ == 0:
        time.sleep(late_s)
    mine = jax.device_put(jnp.full((3,), group.index + 1.0), jax.local_devices()[0])
    total = group.allreduce_sum({"x": mine})["x"]
    np.testing.assert_array_equal(np.asarray(total), np.full((3,), 3.0))
    got = group.broadcast({"y": np.arange(2.0) + group.index}, source=1)["y"]
    np.testing.assert_array_equal(got, np.arange(2.0) + 1)
print(f"process {group.index}: ok", flush=True)
sys.exit(0)
