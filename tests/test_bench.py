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


def test_bench_runs_side_by_side_and_samples_the_roofline_beside_each_row(tmp_path):
    import json

    from jaxkv import bench

    assert bench.main(["--configs", "test-tiny", "--dtypes", "float32", "--batches", "1,2", "--reps", "2",
                       "--new-tokens", "40", "--no-curves", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert [(r["batch"], r["dtype"]) for r in report["decode"]] == [(1, "float32"), (2, "float32")]
    for r in report["decode"]:
        # The fraction is against the bandwidth sampled beside the run, so it lies between the figures implied by
        # the slowest and fastest bandwidth samples.
        achieved = r["achieved_GBps"]
        low, high = r["roofline_GBps"]["min"], r["roofline_GBps"]["max"]
        assert 0 < low <= high
        tps = r["decode_tokens_per_s"]
        assert achieved / high * tps["min"] / tps["median"] * 0.999 <= r["fraction_of_roofline"]
        assert r["fraction_of_roofline"] <= achieved / low * tps["max"] / tps["median"] * 1.001
        # float32 on both sides: the same greedy tokens, and a measured ratio.
        assert r["greedy_first_32_equal"] and r["greedy_first_difference"] is None
        assert r["ratio_vs_hf"]["median"] > 0 and r["recompile_s_after_warmup"] == 0


def test_gemv_meter_reads_its_whole_matrix():
    from jaxkv import roofline

    meter = roofline.GemvMeter(nbytes=1 << 22)
    assert meter.nbytes == 1 << 22 and meter.w.shape == (256, 4096)
    assert 1e8 < meter.sample() < 1e13  # bytes/s: between 0.1 GB/s and 10 TB/s on anything this runs on
