"""`crossover.step_costs` hands the costs so far to `on_batch` after each batch, so that
`scripts/sd_crossover.py` can write them and a process killed in a later batch (the
accelerator check's stage limit) keeps the earlier batches. A stand-in engine and step timer:
no model, no compile."""

from __future__ import annotations

import contextlib
import types

from tlt_jax.rollout import crossover


class _Engine:
    config = types.SimpleNamespace(batch_buckets=(1, 2, 4))
    model_config = types.SimpleNamespace(vocab_size=32)
    step_policy = None

    @contextlib.contextmanager
    def one_program_steps(self):
        yield self


def test_on_batch_sees_each_finished_batch(monkeypatch):
    monkeypatch.setattr(crossover, "step_ms", lambda engine, policy, requests: float(len(requests)))
    seen = []
    record = lambda costs: seen.append((dict(costs.plain_ms), dict(costs.sd_ms["3,1,4"])))
    costs = crossover.step_costs(_Engine(), ["3,1,4"], [1, 2, 4], prompt_len=4, steps=1,
                                 on_batch=record)  # fmt: skip
    assert [list(plain) for plain, _ in seen] == [[1], [1, 2], [1, 2, 4]]
    assert [list(sd) for _, sd in seen] == [[1], [1, 2], [1, 2, 4]]
    assert costs.plain_ms == {1: 1.0, 2: 2.0, 4: 4.0}
