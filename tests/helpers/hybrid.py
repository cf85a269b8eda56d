"""The tiny random Qwen3-Next every hybrid-model test builds (tests/families/test_qwen3_next.py, the sharing
features' tests): every layer kind (three Gated DeltaNet layers, then a gated full-attention layer), mixture of
experts on (a dense layer between sparse ones, the gated shared expert) and off ("dense"). Import only after
pytest.importorskip("torch") and ("transformers")."""

from helpers.hf import BOS, EOS, PAD, VOCAB, saved_and_loaded
from helpers.hf import build_hf as hf_model

LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
FIELDS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
              mlp_only_layers=[1], max_position_embeddings=256, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, layer_types=LAYER_TYPES,
              initializer_range=0.25, rms_norm_eps=1e-6, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
CASES = {"moe": ({},), "dense": (dict(num_experts=0),)}
loaded = saved_and_loaded(lambda changes: hf_model("Qwen3NextConfig", dict(FIELDS, **changes)), CASES)
