"""A checkpoint's generation_config.json (issue 30, item 5): its eos ids join config.json's as the default stop
tokens, so a chat release whose end-of-turn token is listed only there stops at it, as transformers' `generate`
does."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxkv  # noqa: E402
from jaxkv.checkpoint_hf import load_hf  # noqa: E402

from helpers.hf import EOS, LLAMA_LIKE, PAD, build_hf  # noqa: E402

PROMPT = [5, 17, 33, 8, 90, 12]


def test_an_eos_id_listed_only_in_generation_config_stops_generate_as_transformers(tmp_path):
    hf = build_hf("LlamaConfig", LLAMA_LIKE, seed=3)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    free = jaxkv.generate(load_hf(tmp_path), [PROMPT], max_new_tokens=12, stop_tokens=[]).tokens[0]
    # the end-of-turn token: the 4th one greedy decoding emits, not emitted before it (nor eos)
    turn = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i] and t != EOS)
    stop_at = free.index(turn)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, turn], "pad_token_id": PAD}))
    model = load_hf(tmp_path)
    assert model.config.eos_ids == (EOS, turn)  # config.json's first
    got = jaxkv.generate(model, [PROMPT], max_new_tokens=12).tokens[0]  # default stop tokens
    assert got == free[:stop_at + 1]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        out = reloaded.generate(torch.tensor([PROMPT]), attention_mask=torch.ones((1, len(PROMPT)), dtype=torch.long),
                                do_sample=False, max_new_tokens=12)
    assert out[0, len(PROMPT):].tolist() == got


@pytest.mark.parametrize("text, message", [
    ("{'eos_token_id': 3", "generation_config.json: not valid JSON"),
    ("[1, 2]", "generation_config.json: expected a JSON object"),
    (json.dumps({"eos_token_id": [EOS, 10 ** 6]}), "'eos_token_id' must be token ids"),
])
def test_a_bad_generation_config_is_refused_naming_it(tmp_path, text, message):
    hf = build_hf("LlamaConfig", LLAMA_LIKE, seed=3)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        load_hf(tmp_path)


def test_no_generation_config_keeps_config_json_eos(tmp_path):
    hf = build_hf("LlamaConfig", LLAMA_LIKE, seed=3)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    (tmp_path / "generation_config.json").unlink(missing_ok=True)
    assert load_hf(tmp_path).config.eos_ids == (EOS,)


# --- its sampling defaults --------------------------------------------------------------------------------------


def _checkpoint(tmp_path, generation: dict):
    hf = build_hf("LlamaConfig", LLAMA_LIKE, seed=3)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, **generation}))
    return hf


def test_do_sample_false_is_greedy_with_its_repetition_penalty_as_transformers_generate(tmp_path):
    """transformers' meaning: do_sample false is greedy whatever the temperature, and its repetition_penalty
    applies; `generate(sampling="checkpoint")` gives transformers' `generate()` tokens with the file's defaults."""
    _checkpoint(tmp_path, {"do_sample": False, "temperature": 0.7, "top_p": 0.5, "repetition_penalty": 1.8})
    model = load_hf(tmp_path)
    got = jaxkv.generate(model, [PROMPT], max_new_tokens=12, sampling="checkpoint", stop_tokens=[]).tokens[0]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        out = reloaded.generate(torch.tensor([PROMPT]), attention_mask=torch.ones((1, len(PROMPT)), dtype=torch.long),
                                max_new_tokens=12, min_new_tokens=12)
    assert out[0, len(PROMPT):].tolist() == got
    assert got != jaxkv.generate(model, [PROMPT], max_new_tokens=12, stop_tokens=[]).tokens[0]  # the penalty bites


def test_sampling_defaults_are_generates_with_sampling_checkpoint_and_arguments_override_them(tmp_path):
    _checkpoint(tmp_path, {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.2})
    model = load_hf(tmp_path)

    def tokens(**kw):
        return jaxkv.generate(model, [PROMPT], max_new_tokens=10, seed=4, stop_tokens=[], **kw).tokens[0]

    # no top_k in the file: transformers samples with its default 50 (this vocabulary is too small to show it)
    assert model.sampling_defaults.arguments()["top_k"] == 50
    assert tokens(sampling="checkpoint") == tokens(temperature=0.7, top_k=50, top_p=0.8, repetition_penalty=1.2)
    assert tokens(sampling="checkpoint", top_p=0.3, repetition_penalty=1.0) == tokens(temperature=0.7, top_k=50,
                                                                                       top_p=0.3)
    # an explicit temperature 0 is greedy: the checkpoint's filters go, its penalty stays
    assert tokens(sampling="checkpoint", temperature=0) == tokens(repetition_penalty=1.2)
    assert tokens() == tokens(temperature=0)  # without sampling="checkpoint": jaxkv's defaults (greedy)


def test_sampling_defaults_survive_save_and_load(tmp_path):
    _checkpoint(tmp_path / "hf", {"do_sample": True, "temperature": 0.6, "top_k": 20, "min_p": 0.05})
    model = load_hf(tmp_path / "hf")
    jaxkv.save(model, tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "generation_config.json").read_text()) == {
        "do_sample": True, "temperature": 0.6, "top_k": 20, "min_p": 0.05}
    assert jaxkv.load(str(tmp_path / "saved")).sampling_defaults == model.sampling_defaults


@pytest.mark.parametrize("generation, message", [
    ({"do_sample": "yes"}, "do_sample must be true or false"), ({"temperature": "hot"}, "temperature must be"),
    ({"top_p": 0}, "top_p must be"), ({"top_k": 2.5}, "top_k must be an integer"),
    ({"repetition_penalty": -1}, "repetition_penalty must be"),
])
def test_a_bad_sampling_default_is_refused_naming_the_file(tmp_path, generation, message):
    _checkpoint(tmp_path, generation)
    with pytest.raises(ValueError, match="generation_config.json: " + message):
        load_hf(tmp_path)


def test_the_bundled_model_samples_by_default_as_measured():
    """jaxkv/tiny ships the setting scripts/sampling_defaults.py chose (docs/design/cli.md): T 0.7, top-p 0.9."""
    defaults = jaxkv.load("tiny").sampling_defaults
    assert defaults.arguments() == dict(temperature=0.7, top_k=None, top_p=0.9, min_p=None, repetition_penalty=None)
