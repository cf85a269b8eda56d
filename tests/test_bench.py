"""The benchmark's weight conversion: transformers must run the very same model, or the side-by-side is void."""

import numpy as np
import pytest

import jaxkv
from jaxkv.config import Config

torch = pytest.importorskip("torch")


def test_to_hf_llama_gives_the_same_logits():
    from jaxkv.bench import to_hf_llama

    cfg = Config(vocab_size=97, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=80,
                 max_positions=64)
    model = jaxkv.Model.random(cfg, seed=3)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 11))
    with torch.no_grad():
        hf = to_hf_llama(model)(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(jaxkv.logits(model, tokens), hf, atol=1e-4, rtol=1e-4)
