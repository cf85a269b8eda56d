"""Tokenizers built in memory (the `tokenizers` package, no download): byte-level BPE vocabularies, one token per
byte."""

import json

from jaxkv import checkpoint


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # id i is byte i, spelled in the GPT-2 byte-to-unicode alphabet that the ByteLevel pre-tokenizer emits:
    # printable bytes stand for themselves, the others are shifted to 256 + n in byte order.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = iter(range(256, 512))
    vocab = {chr(b if b in printable else next(shifted)): b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def byte_level(bos: bool = False, swap: dict[int, int] | None = None):
    """The bundled model's tokenizer (byte-level BPE without merges: token i is byte i); `bos`: id 0 (byte 0,
    unused here) becomes a special "<s>" the tokenizer adds in front of a text; `swap`: token ids exchanged."""
    from tokenizers import Tokenizer

    spec = json.loads((checkpoint.TINY_DIR / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    by_id = {i: s for s, i in vocab.items()}
    for a, b in (swap or {}).items():
        vocab[by_id[a]], vocab[by_id[b]] = b, a
    if bos:
        del vocab[by_id[0]]
        vocab["<s>"] = 0
        spec["added_tokens"].append({"id": 0, "content": "<s>", "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
        spec["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}}
    return Tokenizer.from_str(json.dumps(spec))
