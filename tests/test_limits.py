"""The machine-limit probes of `scripts/bench_rollout.py`, on the tiny preset."""

from __future__ import annotations

from tlt_jax.models.presets import get_preset
from tlt_jax.models.transformer import init_model
from tlt_jax.rollout import limits


def test_decode_flops_by_hand():
    c = get_preset("smollm2_135m")
    d, f, v, n, k, h, layers = 576, 1536, 49152, 9, 3, 64, 30
    assert (c.hidden_size, c.intermediate_size, c.vocab_size) == (d, f, v)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers) == (n, k, h, layers)
    # q and o are 576 x 576, k and v 576 x 192, the MLP 3 x 576 x 1536; the head 576 x 49152.
    macs = layers * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) + 576 * 49152
    assert limits.decode_flops_per_token(c, 0) == 2 * macs
    # Each of 9 heads multiplies 64 dims with 100 keys and 100 values per layer.
    extra = limits.decode_flops_per_token(c, 100) - limits.decode_flops_per_token(c, 0)
    assert extra == 2 * layers * 9 * 64 * 100 * 2


def test_probes_measure_something_positive():
    assert limits.read_bandwidth_gbs(nbytes=1 << 22, repeats=2) > 0
    assert limits.matmul_gflops(n=128, repeats=2) > 0
    model = init_model(get_preset("tiny"))
    ms = limits.target_forward_ms(model, kv_len=32, widths=(1, 4, 8), repeats=2)
    assert set(ms) == {1, 4, 8} and all(t > 0 for t in ms.values())
