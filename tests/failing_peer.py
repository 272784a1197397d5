"""One process of `test_distributed.py`'s fail-fast test (run under `scripts/launch_local.py`):
process 1 raises inside `exit_on_failure` while process 0 waits for it at a barrier."""

from tlt_jax.parallel import distributed

distributed.initialize_from_env()
group = distributed.ProcessGroup()
with distributed.exit_on_failure():
    if group.index == 1:
        raise RuntimeError("process 1 failed on purpose")
    group.barrier("never_reached_by_1")
print(f"process {group.index}: ok", flush=True)
