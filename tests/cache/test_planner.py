"""The KV-cache memory planner: the classic figures exactly, the per-dtype arithmetic, the sliding-window cap, and
the `jaxkv memory` command (table, JSON, HBM fit, plot, one-line errors)."""

import json
import subprocess
import sys

import jax.numpy as jnp
import pytest

import jaxkv
from jaxkv import cli
from jaxkv.cache import planner as memory
from jaxkv.checkpoint import TINY_DIR, config_from_dict
from helpers.models import CONFIGS

GIB = 1 << 30

# The classic 13B-class shape: 40 layers, 40 heads of 128 dims (d_model 5120), float16.
MHA_13B = jaxkv.Config(vocab_size=32000, d_model=5120, n_layers=40, n_heads=40, ffn_dim=13824, max_positions=4096,
                       dtype="float16")
GQA_13B = MHA_13B.replace(n_kv_heads=8)

# Llama-2-13B's config.json as published (trimmed of fields jaxkv ignores). 13,015,864,320 parameters.
LLAMA2_13B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 5120, "intermediate_size": 13824,
    "num_attention_heads": 40, "num_hidden_layers": 40, "num_key_value_heads": 40, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "hidden_act": "silu", "rope_scaling": None,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16",
}
LLAMA2_13B_PARAMS = 13_015_864_320


# --- the arithmetic -------------------------------------------------------------------------------------------


def test_classic_figures():
    assert memory.kv_bytes_per_token(MHA_13B) == 819_200  # 2 x 40 x 40 x 128 x 2
    assert jaxkv.kv_cache_bytes(MHA_13B, tokens=2048) == 1_677_721_600  # 819,200 x 2,048 = 1.5625 GiB
    assert memory.kv_bytes_per_token(GQA_13B) == 163_840  # 2 x 40 x 8 x 128 x 2
    assert jaxkv.kv_cache_bytes(GQA_13B, tokens=2048, batch=4) == 4 * 2048 * 163_840


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_dtype_ratios_and_scale_overhead(name):
    cfg = CONFIGS[name]
    L, K, H = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    per_token = {d: memory.kv_bytes_per_token(cfg, d) for d in memory.CACHE_DTYPES}
    assert per_token["float32"] == 2 * L * K * H * 4
    assert per_token["bfloat16"] == per_token["float16"] == per_token["float32"] // 2
    # One byte per element plus exactly one float32 scale per token per KV head, for keys and for values.
    assert per_token["int8"] == per_token["float8_e4m3fn"] == 2 * L * K * H + 2 * L * K * 4
    # Without a quantized dtype the planner agrees with Config's own formula.
    for d in ("float32", "bfloat16", "float16"):
        assert per_token[d] == cfg.kv_bytes_per_token(memory.BYTES_PER_ELEMENT[d])


def test_bytes_per_element_are_the_real_dtype_sizes():
    for d in memory.CACHE_DTYPES:
        assert memory.BYTES_PER_ELEMENT[d] == jnp.dtype(d).itemsize, d


def test_dtype_objects_are_accepted_like_their_names():
    for d in memory.CACHE_DTYPES:
        assert jaxkv.kv_cache_bytes(MHA_13B, tokens=3, cache_dtype=jnp.dtype(d)) == \
            jaxkv.kv_cache_bytes(MHA_13B, tokens=3, cache_dtype=d)
    assert memory.kv_bytes_per_token(MHA_13B, jnp.int8) == memory.kv_bytes_per_token(MHA_13B, "int8")


def test_default_cache_dtype_is_the_model_dtype():
    for d in ("float32", "bfloat16", "float16"):
        cfg = GQA_13B.replace(dtype=d)
        assert jaxkv.kv_cache_bytes(cfg, tokens=7) == jaxkv.kv_cache_bytes(cfg, tokens=7, cache_dtype=d)


def test_bytes_scale_with_tokens_and_batch():
    cfg = CONFIGS["gqa"]
    one = jaxkv.kv_cache_bytes(cfg, tokens=1, cache_dtype="int8")
    assert jaxkv.kv_cache_bytes(cfg, tokens=37, batch=3, cache_dtype="int8") == 3 * 37 * one


def test_sliding_window_caps_slots():
    cfg = CONFIGS["sliding"]  # window 8
    assert [memory.cache_slots(cfg, t) for t in (1, 7, 8, 9, 1000)] == [1, 7, 8, 8, 8]
    for d in memory.CACHE_DTYPES:
        capped = jaxkv.kv_cache_bytes(cfg, tokens=1000, batch=2, cache_dtype=d)
        assert capped == jaxkv.kv_cache_bytes(cfg, tokens=8, batch=2, cache_dtype=d)
        assert capped == 2 * 8 * memory.kv_bytes_per_token(cfg, d)
    assert memory.cache_slots(cfg.replace(sliding_window=None), 1000) == 1000


def test_geometry_gives_the_same_numbers_as_the_config():
    geometry = memory.CacheGeometry(n_layers=40, n_kv_heads=40, head_dim=128, dtype="float16")
    assert memory.CacheGeometry.of(MHA_13B) == geometry
    assert jaxkv.kv_cache_bytes(geometry, tokens=2048) == 1_677_721_600


@pytest.mark.parametrize("kwargs, match", [
    (dict(tokens=0), "tokens must be a positive integer, got 0"),
    (dict(tokens=-3), "tokens must be a positive integer"),
    (dict(tokens=2.0), "tokens must be a positive integer, got 2.0"),
    (dict(tokens=True), "tokens must be a positive integer, got True"),
    (dict(tokens="8"), "tokens must be a positive integer"),
    (dict(tokens=8, batch=0), "batch must be a positive integer, got 0"),
    (dict(tokens=8, cache_dtype="int4"), "cache_dtype must be one of"),
    (dict(tokens=8, cache_dtype="float64"), "cache_dtype must be one of"),
    (dict(tokens=8, cache_dtype=jnp.float64), "cache_dtype must be one of"),
    (dict(tokens=8, cache_dtype=3), "cache_dtype must be one of"),
])
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxkv.kv_cache_bytes(MHA_13B, **kwargs)


def test_bad_geometry_and_config_type():
    with pytest.raises(ValueError, match="n_kv_heads must be a positive integer, got 0"):
        memory.CacheGeometry(n_layers=2, n_kv_heads=0, head_dim=8)
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        memory.CacheGeometry(n_layers=2, n_kv_heads=1, head_dim=8, sliding_window=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        memory.CacheGeometry(n_layers=2, n_kv_heads=1, head_dim=8, dtype="int8")  # a cache dtype, not a model's
    with pytest.raises(TypeError, match="expected a jaxkv.Config"):
        jaxkv.kv_cache_bytes({"n_layers": 2}, tokens=8)


def test_weight_bytes_and_sequences_that_fit():
    llama = MHA_13B.replace(max_positions=4096)
    assert llama.param_count() == LLAMA2_13B_PARAMS
    assert memory.weight_bytes(llama) == 2 * LLAMA2_13B_PARAMS == 26_031_728_640
    assert memory.weight_bytes(llama, "float32") == 4 * LLAMA2_13B_PARAMS
    per_sequence = 1_677_721_600  # float16, 2,048 tokens
    fit = lambda memory_bytes, weights: memory.sequences_that_fit(  # noqa: E731
        llama, tokens=2048, memory_bytes=memory_bytes, weights_bytes=weights)
    # 80 GiB - 26,031,728,640 = 59,867,617,280 bytes; / 1,677,721,600 = 35.68: 35 sequences.
    assert fit(80 * GIB, 26_031_728_640) == 35
    assert fit(10 + 2 * per_sequence, 10) == 2
    assert fit(9 + 2 * per_sequence, 10) == 1
    assert fit(10, 10) == 0
    assert fit(10, 11) == 0  # weights alone do not fit: 0, not negative
    with pytest.raises(ValueError, match="memory_bytes must be a non-negative integer"):
        fit(-1, 0)


# --- the command ----------------------------------------------------------------------------------------------


def run(capsys, *args):
    code = cli.main(["memory", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def run_json(capsys, *args):
    return json.loads(run(capsys, *args, "--json"))


def table_row(out: str, cache_dtype: str) -> list[str]:
    """The cells of the table line for `cache_dtype`."""
    (line,) = [line for line in out.splitlines() if line.split()[:1] == [cache_dtype]]
    return line.split()


FLAGS_13B = ["--layers", "40", "--kv-heads", "40", "--head-dim", "128", "--dtype", "float16"]


def test_flags_print_the_classic_figures(capsys):
    out = run(capsys, *FLAGS_13B, "--tokens", "2048")
    # cache dtype, bytes/token, bytes/sequence, total bytes, total GiB, allocated bytes (batch 1: no padding)
    assert table_row(out, "float16") == ["float16", "819,200", "1,677,721,600", "1,677,721,600", "1.5625",
                                         "1,677,721,600"]
    assert table_row(out, "int8") == ["int8", "422,400", "865,075,200", "865,075,200", "0.8057", "865,075,200"]
    assert [line.split()[0] for line in out.splitlines()[-5:]] == list(memory.CACHE_DTYPES)
    out = run(capsys, "--layers", "40", "--kv-heads", "8", "--head-dim", "128", "--dtype", "float16",
              "--cache-dtype", "float16", "--batch", "2")
    assert table_row(out, "float16") == ["float16", "163,840", "335,544,320", "671,088,640", "0.6250",
                                         "671,088,640"]
    assert "int8" not in out


def test_json_output(capsys):
    result = run_json(capsys, *FLAGS_13B, "--batch", "3", "--window", "1024", "--tokens", "4096")
    assert (result["n_layers"], result["n_kv_heads"], result["head_dim"]) == (40, 40, 128)
    assert result["sliding_window"] == 1024 and result["slots"] == 1024 and result["model"] is None
    row = {r["cache_dtype"]: r for r in result["rows"]}["float16"]
    assert row["bytes_per_token"] == 819_200
    assert row["bytes_per_sequence"] == 1024 * 819_200
    assert row["total_bytes"] == 3 * 1024 * 819_200 and row["total_gib"] == 3 * 1024 * 819_200 / GIB
    assert row["sequences_fit"] is None and result["hbm_bytes"] is None


def test_model_tiny_reads_only_its_config(capsys):
    config = config_from_dict(json.loads((TINY_DIR / "jaxkv_config.json").read_text()), source="tiny")
    for source in ("tiny", str(TINY_DIR)):  # by name and as a jaxkv checkpoint directory
        result = run_json(capsys, "--model", source, "--tokens", "100", "--batch", "2")
        assert result["param_count"] == config.param_count() and result["dtype"] == config.dtype
        rows = {r["cache_dtype"]: r["total_bytes"] for r in result["rows"]}
        assert rows == {d: jaxkv.kv_cache_bytes(config, tokens=100, batch=2, cache_dtype=d)
                        for d in memory.CACHE_DTYPES}


@pytest.mark.parametrize("batch, cache_dtype", [(3, "float32"), (5, "int8")])
def test_allocated_column_is_what_generate_allocates(capsys, batch, cache_dtype):
    """jaxkv memory reports both figures: the cache these sequences need and what generate allocates for them
    (max_len = --tokens, the batch padded): checked against a real generate call with odd batch sizes."""
    model = jaxkv.load("tiny")
    result = run_json(capsys, "--model", "tiny", "--tokens", "40", "--batch", str(batch), "--cache-dtype",
                      cache_dtype)
    (row,) = result["rows"]
    prompts = [[65 + b] * (3 + 7 * b) for b in range(batch)]  # ragged; the longest plus new tokens is <= 40
    out = jaxkv.generate(model, prompts, max_new_tokens=40 - max(map(len, prompts)), max_len=40,
                         cache_dtype=cache_dtype, stop_tokens=[])
    assert row["allocated_bytes"] == out.stats["kv_cache_bytes"] > row["total_bytes"]
    assert row["total_bytes"] == out.stats["kv_cache_bytes_requested"]


def test_sharing_columns_are_what_generate_n_holds(capsys):
    """jaxkv memory --n: the bytes with prefix sharing equal what generate(n=...) holds at its peak, and the bytes
    without equal its unshared figure; kv_cache_bytes knows paged pools."""
    model = jaxkv.load("tiny")
    result = run_json(capsys, "--model", "tiny", "--tokens", "40", "--n", "3", "--new-tokens", "6", "--page-size", "8",
                      "--cache-dtype", "float32")
    (row,) = result["rows"]
    out = jaxkv.generate(model, [[65] * 40], max_new_tokens=6, n=3, page_size=8, stop_tokens=[])
    assert row["shared_bytes"] == out.stats["kv_bytes_in_use_peak"] < row["unshared_bytes"]
    assert row["unshared_bytes"] == out.stats["kv_cache_bytes_unshared"]
    assert out.stats["kv_cache_bytes"] == jaxkv.kv_cache_bytes(model.config, num_pages=out.stats["num_pages"],
                                                               page_size=8)
    assert jaxkv.kv_cache_bytes(model.config, tokens=41, page_size=8) == 6 * 8 * model.config.kv_bytes_per_token()
    with pytest.raises(ValueError, match="num_pages gives a pool"):
        jaxkv.kv_cache_bytes(model.config, tokens=4, num_pages=3, page_size=8)


def test_hugging_face_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_13B))
    for args in (["--model", str(tmp_path)], ["--config", str(tmp_path / "config.json")]):
        result = run_json(capsys, *args, "--cache-dtype", "float16")
        assert result["dtype"] == "float16"  # from torch_dtype, without any weights present
        assert result["param_count"] == LLAMA2_13B_PARAMS
        assert result["rows"][0]["bytes_per_token"] == 819_200
        assert result["rows"][0]["total_bytes"] == 1_677_721_600


def test_hugging_face_sliding_window(tmp_path, capsys):
    mistral = {**LLAMA2_13B, "architectures": ["MistralForCausalLM"], "num_key_value_heads": 8,
               "sliding_window": 4096, "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(mistral))
    result = run_json(capsys, "--config", str(tmp_path / "config.json"), "--tokens", "32768")
    assert result["sliding_window"] == 4096 and result["slots"] == 4096
    assert {r["cache_dtype"]: r["bytes_per_sequence"] for r in result["rows"]}["bfloat16"] == 4096 * 163_840


def test_hbm_fit_with_weights_from_the_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_13B))
    out = run(capsys, "--model", str(tmp_path), "--hbm-gib", "80")
    # 80 GiB = 85,899,345,920 bytes; float16 weights 2 x 13,015,864,320 = 26,031,728,640; left 59,867,617,280.
    assert "85,899,345,920 - 26,031,728,640 = 59,867,617,280 bytes" in out
    # / 3,355,443,200 (float32) = 17.8; / 1,677,721,600 = 35.7; / 865,075,200 (int8 and fp8) = 69.2
    assert [table_row(out, d)[-1] for d in memory.CACHE_DTYPES] == ["17", "35", "35", "69", "69"]


def test_hbm_fit_with_weights_given(capsys):
    flags = ["--layers", "40", "--kv-heads", "8", "--head-dim", "128", "--tokens", "4096"]
    result = run_json(capsys, *flags, "--hbm-gib", "80", "--weights-gib", "24")
    # 56 GiB left. Per 4,096-token sequence: float32 1.25 GiB -> 44.8; float16 0.625 GiB -> 89.6;
    # int8 4,096 x 84,480 = 346,030,080 bytes -> 60,129,542,144 / 346,030,080 = 173.8.
    assert result["hbm_bytes"] == 80 * GIB and result["weights_bytes"] == 24 * GIB and result["weights_fit"]
    assert [r["sequences_fit"] for r in result["rows"]] == [44, 89, 89, 173, 173]
    out = run(capsys, *flags, "--hbm-gib", "16", "--weights-gib", "24")
    assert "do not fit" in out
    assert [table_row(out, d)[-1] for d in memory.CACHE_DTYPES] == ["0"] * 5


def test_plot_writes_a_png(tmp_path, capsys):
    path = tmp_path / "cache.png"
    out = run(capsys, *FLAGS_13B, "--tokens", "4096", "--window", "1024", "--hbm-gib", "80", "--weights-gib", "24",
              "--plot", str(path))
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert str(path) in out


def test_plot_without_matplotlib_is_one_clear_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail as if not installed
    assert cli.main(["memory", "--model", "tiny", "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and err.count("\n") == 1
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("args, match", [
    (["--layers", "40"], "missing --kv-heads, --head-dim"),
    (["--model", "tiny", "--layers", "4"], "cannot be combined with --model"),
    (["--model", "tiny", "--config", "x.json"], "not allowed with argument"),
    (["--layers", "0", "--kv-heads", "8", "--head-dim", "128"], "--layers: must be a positive integer"),
    (["--model", "tiny", "--tokens", "many"], "invalid int value"),
    (["--model", "tiny", "--batch", "-2"], "--batch: must be a positive integer"),
    (["--model", "tiny", "--cache-dtype", "int4"], "invalid choice"),
    (["--model", "tiny", "--hbm-gib", "nan"], "--hbm-gib: must be a finite number > 0"),
    (["--model", "tiny", "--weights-gib", "3"], "--weights-gib is only used with --hbm-gib"),
    (["--layers", "40", "--kv-heads", "8", "--head-dim", "128", "--hbm-gib", "80"], "also needs --weights-gib"),
    (["--model", "/nonexistent/dir"], "no such directory"),
    (["--model", str(TINY_DIR / "params")], "has neither jaxkv_config.json"),
    (["--config", "/nonexistent/config.json"], "no such file"),
    (["--model", "tiny", "--plot", "/nonexistent/dir/x.png"], "--plot /nonexistent/dir/x.png"),
])
def test_bad_arguments_give_one_line_and_status_2(capsys, args, match):
    assert cli.main(["memory", *args]) == 2
    out, err = capsys.readouterr()
    assert match in err and err.count("\n") == 1 and "Traceback" not in err and out == ""


def test_bad_hugging_face_config_names_the_file(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA2_13B, "num_key_value_heads": 0}))
    assert cli.main(["memory", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "num_key_value_heads" in err and err.count("\n") == 1
    path.write_text("{not json")
    assert cli.main(["memory", "--config", str(path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_console_script_in_a_subprocess():
    """As a user runs it: the table on stdout, and a bad value is one line on stderr with status 2."""
    ok = subprocess.run([sys.executable, "-m", "jaxkv.cli", "memory", *FLAGS_13B, "--cache-dtype", "float16"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "1,677,721,600" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "jaxkv.cli", "memory", "--layers", "-1"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("jaxkv: error: argument --layers: must be a positive integer")


# --- multi-head latent attention (issue 17) ---------------------------------------------------------------------

# DeepSeek-V3's config.json as published (trimmed of fields jaxkv ignores).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
    "attention_bias": False, "scoring_func": "sigmoid",
}


def test_mla_bytes_per_token(tmp_path, capsys):
    """The issue's figure: 61 layers x (512 + 64) x 2 bytes = 70,272 per token in bfloat16, beside what 128 heads'
    full keys (192) and values (128) would take: 61 x 128 x 320 x 2 = 4,997,120."""
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    result = run_json(capsys, "--model", str(tmp_path), "--tokens", "1000")
    rows = {r["cache_dtype"]: r for r in result["rows"]}
    assert rows["bfloat16"]["bytes_per_token"] == 70_272 and rows["float32"]["bytes_per_token"] == 140_544
    assert rows["int8"]["bytes_per_token"] == 61 * (576 + 4)  # one float32 scale per row
    assert rows["bfloat16"]["per_head_kv_bytes_per_token"] == 4_997_120
    assert rows["bfloat16"]["per_head_kv_total_bytes"] == 1000 * 4_997_120
    assert rows["int8"]["per_head_kv_bytes_per_token"] == 61 * 128 * (320 + 8)
    assert result["mla"] == {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "n_heads": 128, "qk_head_dim": 192,
                             "v_head_dim": 128, "index_head_dim": None}
    out = run(capsys, "--model", str(tmp_path), "--tokens", "1000", "--cache-dtype", "bfloat16")
    assert "latent 512 + rotary key 64 = 576 values (keys only)" in out and "indexer" not in out
    assert table_row(out, "bfloat16")[-2:] == ["4,997,120", "4,997,120,000"]


def test_deepseek_v32_counts_the_indexer_key(tmp_path, capsys):
    """DeepSeek-V3.2 (V3's shape plus a lightning indexer of 64 heads x 128): each token and layer also caches the
    indexer's key of 128 values: 61 x (576 + 128) x 2 = 85,888 bytes per token in bfloat16 (int8: a scale each)."""
    v32 = dict(DEEPSEEK_V3, architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", index_topk=2048,
               index_head_dim=128, index_n_heads=64)
    (tmp_path / "config.json").write_text(json.dumps(v32))
    result = run_json(capsys, "--model", str(tmp_path), "--tokens", "1000")
    rows = {r["cache_dtype"]: r for r in result["rows"]}
    assert rows["bfloat16"]["bytes_per_token"] == 61 * (576 + 128) * 2 == 85_888
    assert rows["int8"]["bytes_per_token"] == 61 * (576 + 4 + 128 + 4)
    assert result["mla"]["index_head_dim"] == 128
    assert "indexer's key of 128 values" in run(capsys, "--model", str(tmp_path), "--tokens", "1000")


def test_mla_allocation_equals_the_planner():
    """A latent cache allocates exactly what the planner says: one [B, 1, S, R + E] buffer per layer (and its
    scales when quantized), no value buffers."""
    from jaxkv.cache import KVCache
    from jaxkv.config import Mla

    config = jaxkv.Config(vocab_size=64, d_model=32, n_layers=3, n_heads=4, ffn_dim=48,
                          mla=Mla(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8))
    for cache_dtype in memory.CACHE_DTYPES:
        cache = KVCache.allocate(config, 2, 40, dtype=cache_dtype)
        leaves = [x for x in (*cache.keys, *cache.values, *cache.key_scales, *cache.value_scales)]
        assert sum(x.nbytes for x in leaves) == jaxkv.kv_cache_bytes(config, tokens=40, batch=2,
                                                                     cache_dtype=cache_dtype)
        assert all(k.shape == (2, 1, 40, 20) for k in cache.keys)
    assert memory.kv_bytes_per_token(config, "float32") == 3 * 20 * 4
    assert memory.expanded_kv_bytes_per_token(config, "float32") == 3 * 4 * (12 + 8) * 4


def test_sharing_and_fit_columns_line_up(capsys):
    """With --n and --hbm-gib together, every cell sits under its own header (the fit column used to come before
    the sharing columns in the rows but after them in the header)."""
    out = run(capsys, "--model", "tiny", "--tokens", "40", "--n", "3", "--hbm-gib", "1", "--cache-dtype", "int8")
    header = next(line for line in out.splitlines() if line.startswith("cache dtype"))
    assert header.rstrip().endswith("with sharing  without sharing  sequences that fit")
    result = run_json(capsys, "--model", "tiny", "--tokens", "40", "--n", "3", "--hbm-gib", "1", "--cache-dtype",
                      "int8")
    (row,) = result["rows"]
    assert table_row(out, "int8")[-3:] == [f"{row['shared_bytes']:,}", f"{row['unshared_bytes']:,}",
                                           f"{row['sequences_fit']:,}"]


def test_the_lookahead_is_room_not_part_of_the_request():
    """Issue 50: `lookahead` (a speculative verify's k) never makes a request that fits fail, nor changes what an
    error names. The default capacity counts the k slots as far as the positions allow (never past them), the
    padded prompt shrinks to leave them under a given max_len (never below the longest prompt), and a paged plan
    counts pages for them only as far as its table and the positions reach."""
    config = CONFIGS["gqa"].replace(max_positions=2048)
    # the repro's request: 2040 + 8 = 2048 positions
    plan = memory.plan_cache(config, [2040], 8, lookahead=4)
    assert (plan.capacity, plan.prompt_len) == (2048, 2040)
    assert plan.requested_bytes == memory.plan_cache(config, [2040], 8).requested_bytes
    # positions to spare: the k slots are planned (the bucket 128 + 125 = 253 fits 256; + 4 does not)
    assert memory.plan_cache(config, [100], 125).capacity == 256
    assert memory.plan_cache(config, [100], 125, lookahead=4).capacity == 512
    # max_len = prompt + max_new_tokens: the bucket (64) shrinks to the prompt, not below it
    plan = memory.plan_cache(config, [40, 9], 8, max_len=48, lookahead=4)
    assert (plan.capacity, plan.prompt_len) == (48, 40)
    assert memory.plan_cache(config, [40, 9], 8, max_len=56, lookahead=4).prompt_len == 44
    for lookahead in (0, 4):
        with pytest.raises(ValueError, match=r"^prompt 0 has 2045 tokens; with max_new_tokens=8 it needs 2053 "):
            memory.plan_cache(config, [2045], 8, lookahead=lookahead)
        with pytest.raises(ValueError, match=r"40 \+ 8 = 48 exceeds max_len=47$"):
            memory.plan_cache(config, [40], 8, max_len=47, lookahead=lookahead)
        with pytest.raises(ValueError, match=r"with max_new_tokens=8 it needs 2053 "):
            memory.plan_pages(config, [2045], 8, page_size=4, lookahead=lookahead)
        with pytest.raises(ValueError, match=r"= 48 exceeds max_len=47$"):
            memory.plan_pages(config, [40], 8, page_size=4, max_len=47, lookahead=lookahead)
    # pages: a verify from length L writes L..L + k only while L + k + 1 <= min(table, positions)
    pages = memory.plan_pages(config, [2040], 8, n=2, page_size=4, lookahead=4)
    assert pages.max_pages == 512 and pages.pages_needed == memory.pages_for(2040, 9, 2, 4)
    roomy = memory.plan_pages(config, [100], 8, n=2, page_size=4, lookahead=4)
    assert roomy.pages_needed == memory.pages_for(100, 12, 2, 4) > memory.plan_pages(config, [100], 8, n=2,
                                                                                      page_size=4).pages_needed
    assert roomy.unshared_bytes == memory.plan_pages(config, [100], 8, n=2, page_size=4).unshared_bytes
