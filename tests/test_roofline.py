"""The bytes-per-step arithmetic behind every roofline figure, against hand-computed values."""

import jaxkv
from jaxkv import roofline


def test_decode_bytes_per_step_hand_computed():
    # V=10, D=4, L=1, N=2, K=1, H=2, F=8, untied, RMSNorm, RoPE:
    # attention 4*2*2 + 2*4*1*2 + 2*2*4 = 48; SwiGLU 3*4*8 = 96; norms 2*4 + final 4 = 12; embed 40; head 40.
    cfg = jaxkv.Config(vocab_size=10, d_model=4, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=8)
    assert cfg.param_count() == 48 + 96 + 12 + 40 + 40
    # A batch-1 step reads one embedding row (4 of its 40 values): 236 - 36 = 200 weights x 4 bytes = 800.
    assert roofline.weight_bytes_per_step(cfg, 1, 4) == 800
    # K/V per token: 2 x 1 layer x 1 KV head x 2 dims x 4 bytes = 16; 5 live tokens read + 1 written = 96.
    assert roofline.decode_bytes_per_step(cfg, 1, 5, 4) == 800 + 96
    # Tied: the head reads the whole table, so nothing is skipped (and there is no separate head).
    tied = cfg.replace(tie_embeddings=True)
    assert roofline.weight_bytes_per_step(tied, 1, 2) == (236 - 40) * 2


def test_live_reads_are_bounded_per_layer():
    """A step reads at most a layer's window or chunk (a global layer beside sliding ones reads every live token),
    and DeepSeek-V3.2 reads every indexer key but only top-k latent rows."""
    from jaxkv.config import Mla, SparseIndexer
    cfg = jaxkv.Config(vocab_size=10, d_model=4, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=8, sliding_window=3,
                       layer_types=("sliding_attention", "full_attention"))
    slot = 2 * 1 * 2 * 4  # K and V, 1 KV head of 2, float32
    assert roofline.kv_read_bytes_per_step(cfg, 10, 4) == slot * (3 + 10)
    assert roofline.decode_bytes_per_step(cfg, 2, 10, 4) == roofline.weight_bytes_per_step(cfg, 2, 4) + 2 * (
        slot * 13 + 2 * slot)
    mla = Mla(kv_lora_rank=6, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=2, q_lora_rank=4,
              indexer=SparseIndexer(n_heads=2, head_dim=4, topk=5))
    v32 = jaxkv.Config(vocab_size=10, d_model=4, n_layers=2, n_heads=2, ffn_dim=8, mla=mla)
    assert roofline.kv_read_bytes_per_step(v32, 12, 2) == 2 * (8 * 2 * 5 + 4 * 2 * 12)
    assert roofline.kv_read_bytes_per_step(v32, 3, 2) == 2 * (8 * 2 * 3 + 4 * 2 * 3)


def test_generation_stats_report_per_step_figures():
    cfg = jaxkv.Config(vocab_size=10, d_model=4, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=8)
    out = jaxkv.generate(jaxkv.Model.random(cfg), [[1, 2, 3]], max_new_tokens=5, stop_tokens=[])
    s = out.stats
    assert s["decode_steps"] == 4 and s["new_tokens"] == 5
    assert s["bytes_per_step"] == roofline.decode_bytes_per_step(cfg, 1, 3 + 4 / 2, 4)
    assert abs(s["achieved_GBps"] - s["bytes_per_step"] * s["decode_steps_per_s"] / 1e9) < 1e-12
    assert s["kv_cache_bytes"] == cfg.kv_bytes_per_token() * s["cache_capacity"]
