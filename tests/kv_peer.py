"""One process of `test_distributed.py`'s key-cleanup test (run under
`scripts/launch_local.py`): the values a process wrote in one RL step are deleted from the
coordination service at the end of the next, when every process has read them."""

import sys

from tlt_jax.parallel import distributed

distributed.initialize_from_env()

from jax._src import distributed as jax_distributed  # noqa: E402

group = distributed.ProcessGroup()
client = jax_distributed.global_state.client


def keys() -> set[str]:
    return {k for k, _ in client.key_value_dir_get(f"{group.namespace}/")}


assert group.allgather("values/1", group.index) == [0, 1]
won = group.claim("trainer/1")
assert group.allgather("won/1", won).count(True) == 1  # one claim wins
group.barrier("boundary/1")
assert group.owner("trainer/1") == (group.index if won else 1 - group.index)
assert group.owner("trainer/never") is None
assert {"tlt/values/1/0", "tlt/values/1/1", "tlt/trainer/1"} <= keys()
group.allgather("digest/1", 0)
group.end_step()  # step 1 ends: its values stay (a peer may still be reading them)
before = keys()
assert {"tlt/values/1/0", "tlt/values/1/1", "tlt/trainer/1"} <= before, before
group.allgather("digest/2", 0)  # every process is past step 1
group.end_step()  # step 2 ends: step 1's values go
group.allgather("done/3", 0)  # every process has deleted its own by now
after = keys()
assert not {"tlt/values/1/0", "tlt/values/1/1", "tlt/won/1/0", "tlt/trainer/1"} & after, after
assert {"tlt/digest/2/0", "tlt/digest/2/1", "tlt/done/3/1"} <= after, after
print(f"process {group.index}: ok {len(before)} -> {len(after)} keys", flush=True)
sys.exit(0)
