"""Config validation: clear errors on construction."""

import pytest

import jaxkv

BASE = dict(vocab_size=100, d_model=64, n_layers=2, n_heads=4)


def test_defaults_are_derived():
    cfg = jaxkv.Config(**BASE)
    assert (cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.group_size) == (4, 16, 256, 1)
    assert hash(cfg) == hash(jaxkv.Config(**BASE))  # static jit argument: must hash by value


def test_param_count_of_the_benchmark_configs():
    assert round(jaxkv.PRESETS["small"].param_count() / 1e6) == 56
    assert round(jaxkv.PRESETS["medium"].param_count() / 1e6) == 246


@pytest.mark.parametrize("changes, match", [
    (dict(n_kv_heads=3), r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"),
    (dict(n_kv_heads=8), r"n_kv_heads \(8\) must not exceed n_heads"),
    (dict(n_heads=5), r"head_dim must be given"),
    (dict(vocab_size=0), r"vocab_size must be a positive integer"),
    (dict(n_layers=2.5), r"n_layers must be a positive integer"),
    (dict(head_dim=15), r"RoPE needs an even head_dim"),
    (dict(ffn_kind="relu"), r"ffn_kind must be"),
    (dict(norm_kind="batchnorm"), r"norm_kind must be"),
    (dict(positions="alibi"), r"positions must be"),
    (dict(norm_eps=0.0), r"norm_eps must be > 0"),
    (dict(rope_theta=-1.0), r"rope_theta must be > 0"),
    (dict(sliding_window=0), r"sliding_window must be None or a positive integer"),
    (dict(eos_ids=(100,)), r"eos id 100 is outside the vocabulary"),
    (dict(dtype="int8"), r"dtype must be one of"),
    (dict(attention="cuda"), r"attention must be one of"),
    (dict(positions="learned", rope_scaling=jaxkv.RopeScaling(8.0, 1.0, 4.0, 8192)), r"rope_scaling is set"),
])
def test_bad_values_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        jaxkv.Config(**{**BASE, **changes})


def test_bad_rope_scaling_is_refused():
    with pytest.raises(ValueError, match="high_freq_factor"):
        jaxkv.RopeScaling(factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0, original_max_positions=8192)
