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


def test_profile_decode_accounts_for_the_step(tmp_path):
    """scripts/profile_decode.py: per-op times from the profiler trace, matched to the compiled HLO."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "profile_decode.py"
    spec = importlib.util.spec_from_file_location("profile_decode", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "p.json"
    assert module.main(["--config", "test-tiny", "--steps", "8", "--live", "16", "--capacity", "32",
                        "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    # The ops found in the trace are the decode loop's: dots for every layer's projections and the head, and
    # their time is part of (not more than) the measured step.
    assert r["by_kind_ms"]["dot"] > 0
    assert r["ops_per_step"] >= 7 * 2 + 1  # 7 weight matrices per layer, 2 layers, the head
    assert 0 < r["ops_ms"] <= r["step_ms"]
    with pytest.raises(SystemExit):
        module.parse_args(["--live", "400", "--capacity", "384"])
