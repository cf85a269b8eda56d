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
