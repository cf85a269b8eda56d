"""The tiny random Qwen3-Next every hybrid-model test builds (tests/families/test_qwen3_next.py, the sharing
features' tests): every layer kind (three Gated DeltaNet layers, then a gated full-attention layer), mixture of
experts on (a dense layer between sparse ones, the gated shared expert) and off ("dense"). Import only after
pytest.importorskip("torch") and ("transformers")."""

import jax.numpy as jnp
import numpy as np

import jaxkv
from helpers.hf import ATOL, BOS, EOS, PAD, VOCAB, saved_and_loaded
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


def add_mtp(hf, directory, layer_class, norm_class):
    """transformers drops Qwen3-Next's and Qwen3.5's multi-token-prediction layer, so the tests build it from
    transformers' own parts as vLLM's qwen3_next_mtp.py / qwen3_5_mtp.py compose them (two norms, fc over [normed
    embedding; normed hidden], a full-attention decoder layer of the family, a norm), random, and add its tensors
    (`mtp.*`) to the saved checkpoint -> the torch pieces {name: module}."""
    import torch
    from safetensors.torch import load_file, save_file

    torch.manual_seed(4)
    cfg = hf.config.get_text_config()
    D = cfg.hidden_size
    full = list(cfg.layer_types).index("full_attention")  # a full-attention index: the layer's own kind
    parts = dict(pre_fc_norm_embedding=norm_class(D, eps=cfg.rms_norm_eps),
                 pre_fc_norm_hidden=norm_class(D, eps=cfg.rms_norm_eps),
                 fc=torch.nn.Linear(2 * D, D, bias=False), layer=layer_class(cfg, full),
                 norm=norm_class(D, eps=cfg.rms_norm_eps))
    tensors = {}
    for name, module in parts.items():
        params = dict(module.named_parameters())
        for key, value in module.state_dict().items():
            value = torch.randn_like(value) * (0.3 if value.ndim == 1 else 0.2)  # norms' weights away from 0 too
            with torch.no_grad():
                params[key].copy_(value)
            tensors[f"mtp.{'layers.0' if name == 'layer' else name}.{key}"] = value.contiguous()
    path = directory / "model.safetensors"
    save_file({**load_file(path), **tensors}, path, metadata={"format": "pt"})
    return parts


def check_mtp_module(hf, directory, layer_class, norm_class):
    """`add_mtp`, then `jaxkv.load`: Model.mtp holds one module whose logits for the pairs (h_t, token_{t+1}), fed
    the same hidden states, equal the torch composition's at 1e-4 (vLLM's: no zeroed embedding at position 0,
    unlike DeepSeek's). (The decoder's own parity is the family tests'.)"""
    import torch

    from jaxkv.decoding.mtp import mtp_forward

    parts = add_mtp(hf, directory, layer_class, norm_class)
    model = jaxkv.load(directory)
    assert model.mtp is not None and len(model.mtp.params) == 1 and model.mtp.config.n_layers == 1
    assert set(model.mtp.params[0]) == {"enorm", "hnorm", "eh_proj", "layer_0", "final_norm"}
    tokens = np.random.default_rng(9).integers(0, VOCAB, (1, 24))
    base = hf.model.language_model if hasattr(hf.model, "language_model") else hf.model
    with torch.no_grad():
        ids = torch.tensor(tokens)
        h = base(input_ids=ids).last_hidden_state  # after the final norm: what the head reads
        T = ids.shape[1] - 1
        x = parts["fc"](torch.cat([parts["pre_fc_norm_embedding"](base.embed_tokens(ids[:, 1:])),
                                   parts["pre_fc_norm_hidden"](h[:, :-1])], dim=-1))
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        y = parts["layer"](x, position_embeddings=base.rotary_emb(x, pos), attention_mask=mask, position_ids=pos)
        want = hf.lm_head(parts["norm"](y[0] if isinstance(y, tuple) else y)).numpy()
    got, _, _ = mtp_forward(model.mtp.params[0], model.params, jnp.asarray(h[:, :-1].numpy()),
                            jnp.asarray(tokens[:, 1:]), jnp.arange(T)[None], None, config=model.mtp.config)
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0)
