"""The server's text out of tokens (jaxkv/server/text.py), without a server: stop strings and log-probability pieces,
offsets and bytes around characters that span several tokens, with a byte-level BPE tokenizer (the bundled model's:
one token per byte) and a SentencePiece-style one with byte fallback (<0xC3><0xA9>, as Llama 2's), and a BOS the
tokenizer adds to a text prompt."""

import json

import pytest

from jaxkv.server.text import Detokenizer, TextStream, added_tokens, prompt_text

from helpers.text import byte_level

TEXT = "café au lait, naïve 😀 ok ’quoted’ and 。"


def sentencepiece():
    """A Llama-2-style tokenizer: BPE over "▁"-joined words, characters outside the vocabulary as <0xHH> byte
    tokens, a BOS added, a decoder that strips the space it prepended."""
    from tokenizers import Tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    merges = [("▁", "c"), ("a", "f"), ("▁c", "af"), ("▁", "a"), ("n", "d"), ("▁a", "nd"), ("▁", "o"), ("▁o", "k"),
              ("a", "u"), ("▁", "l"), ("▁l", "a")]
    for a, b in merges:
        for piece in (a, b, a + b):
            vocab.setdefault(piece, len(vocab))
    for piece in "éitvqdue,":
        vocab.setdefault(piece, len(vocab))
    special = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                "special": True} for t, i in list(vocab.items())[:3]]
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": special,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges]},
    }
    return Tokenizer.from_str(json.dumps(spec))


TOKENIZERS = {"byte_level": byte_level, "sentencepiece": sentencepiece}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tokenizer(request):
    tok = TOKENIZERS[request.param]()
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    assert tok.decode(ids) == TEXT and len(ids) > 20
    assert any(tok.decode([t]) == "\ufffd" for t in ids)  # some characters span several tokens
    return tok


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("stop", ["é", "ï", "😀", "’", "。", "fé", "e 😀", "k ’q", " 。", "and"])
def test_a_stop_string_ending_in_a_multibyte_character_matches(tokenizer, stop):
    """Issue 27, item 3: the stop ends the text before it, at the token that completed its last character, in
    dispatches of any size; nothing past the stop's start is released first (for "fé", not "caf")."""
    tokens = ids(tokenizer, TEXT)
    used = min(k for k in range(len(tokens) + 1) if stop in tokenizer.decode(tokens[:k]))
    for size in (1, 3, len(tokens)):
        stream = TextStream(tokenizer, stop=[stop])
        released = [stream.add(tokens[i:i + size]) for i in range(0, len(tokens), size)] + [stream.finish()]
        assert "".join(released) == TEXT[:TEXT.index(stop)], (stop, size)
        assert stream.stopped and stream.tokens_used == used


@pytest.mark.parametrize("stops, min_tokens, want, used", [
    ([" "], 0, "ab", 3),
    ([" "], 2, "ab", 3),  # the space is token 3: past min_tokens
    ([" "], 3, "ab cd", 6),  # token 3's space is inside the first 3: the next one stops
    (["b c"], 2, "a", 4),  # begins in token 2, ends in token 4: straddles min_tokens, stops (vLLM)
    (["b c"], 4, "ab cd a", 10),  # the first ends in token 4, inside the first 4: the second stops
    (["cd a", "b"], 2, "ab ", 7),  # "b" (token 2) is no stop on its own, nor found later from a longer stop's start
    (["b"], 14, "ab cd ab cd ab", None),  # every occurrence inside the first 14 tokens: no stop
])
def test_stop_strings_wait_for_min_tokens(stops, min_tokens, want, used):
    """Issue 50: a stop string must end in the text of token min_tokens + 1 or later (byte-level: one token per
    character here), in dispatches of any size; what it may still start is held back as without min_tokens."""
    tokenizer = byte_level()
    tokens = ids(tokenizer, "ab cd ab cd ab")
    for size in (1, 3, len(tokens)):
        stream = TextStream(tokenizer, stop=stops, min_tokens=min_tokens)
        released = [stream.add(tokens[i:i + size]) for i in range(0, len(tokens), size)] + [stream.finish()]
        assert "".join(released) == want, (size, released)
        assert stream.stopped == (used is not None) and stream.tokens_used == used


@pytest.mark.parametrize("stop", ["é", "😀", "。"])  # (each once in TEXT)
def test_min_tokens_counts_tokens_not_characters(tokenizer, stop):
    """A multi-byte character whose tokens straddle min_tokens belongs to the token that completes it (vLLM's
    convention): min_tokens = that token - 1 lets it stop the text, min_tokens = that token does not."""
    tokens = ids(tokenizer, TEXT)
    completing = min(k for k in range(len(tokens) + 1) if stop in tokenizer.decode(tokens[:k]))
    for min_tokens, stops in ((completing - 1, True), (completing, False)):
        stream = TextStream(tokenizer, stop=[stop], min_tokens=min_tokens)
        text = stream.add(tokens) + stream.finish()
        assert stream.stopped == stops and text == (TEXT[:TEXT.index(stop)] if stops else TEXT), (min_tokens, text)


def test_pieces_join_to_the_text_a_character_at_the_token_that_completes_it(tokenizer):
    """Issue 27, item 4: each token's text is what it adds to the text ("" inside a character, the character at
    the token completing it, vLLM's convention), so offsets counted from the pieces index the text."""
    tokens = ids(tokenizer, TEXT)
    decoded = Detokenizer(tokenizer)
    for t in tokens:
        decoded.add(t)
    assert decoded.pieces == [decoded.token(j)[0] for j in range(len(tokens))]
    assert "".join(decoded.pieces) == decoded.text == TEXT
    offset = 0
    for j, piece in enumerate(decoded.pieces):
        assert TEXT[offset:offset + len(piece)] == piece
        assert "\ufffd" not in piece
        prefix = tokenizer.decode(tokens[:j + 1])
        assert TEXT.startswith(prefix.rstrip("\ufffd")) and offset + len(piece) == len(prefix.rstrip("\ufffd"))
        offset += len(piece)
    assert "" in decoded.pieces  # the tokens inside a character


def test_token_bytes_are_the_tokens_own_and_join_to_the_text(tokenizer):
    """Issue 27, item 4: a token's bytes are its own (byte-level: token i is byte i; byte fallback: <0xC3> is
    0xC3), not U+FFFD's, and together they are the text's UTF-8 (SentencePiece's first token without the space
    its decoder strips: "▁caf" is b"caf" there)."""
    tokens = ids(tokenizer, TEXT)
    decoded = Detokenizer(tokenizer)
    for t in tokens:
        decoded.add(t)
    listed = [decoded.token(j)[1] for j in range(len(tokens))]
    assert b"".join(listed) == TEXT.encode()
    for t, raw in zip(tokens, listed):
        if tokenizer.decode([t]) == "\ufffd":  # a byte of a longer character: that byte
            name = tokenizer.id_to_token(t)
            assert raw == (bytes([int(name[3:5], 16)]) if name.startswith("<0x") else bytes([t]))
    # alternatives at a position inside "é": a lone byte is that byte
    j = next(j for j, piece in enumerate(decoded.pieces) if piece == "")
    lead = tokenizer.token_to_id("<0xC3>") or 0xC3
    assert decoded.alternatives(j, [lead]) == [("", b"\xc3")]
    assert decoded.alternatives(j + 1, [tokens[j + 1]]) == [decoded.token(j + 1)]


def test_an_incomplete_character_at_the_end_is_released_by_finish(tokenizer):
    tokens = ids(tokenizer, "ok 😀")[:-1]  # the emoji's last byte missing
    stream = TextStream(tokenizer)
    assert stream.add(tokens) == "ok "
    assert stream.finish() == "\ufffd" * len(tokenizer.decode(tokens)[3:]) and stream.text.startswith("ok \ufffd")
    assert "".join(stream.decoded.pieces) == "ok "  # no token's piece holds the U+FFFD


def test_special_tokens_and_the_stop_token_add_no_text():
    """A skipped special token inside a character adds nothing ("" and no bytes); the stop token that ended the
    text (listed past the tokens read) shows what it would add: "" for a special one, its text for another."""
    tok = byte_level()
    eos = tok.token_to_id("<|endoftext|>")
    decoded = Detokenizer(tok)
    for t in ids(tok, "é") + [eos] + ids(tok, "a"):
        decoded.add(t)
    assert decoded.text == "éa" and decoded.token(2) == ("", b"")
    assert decoded.entry(4, eos) == ("", b"") and decoded.entry(4, ord(".")) == (".", b".")


@pytest.mark.parametrize("make,prompt", [(lambda: byte_level(bos=True), "naïve <s> café"),
                                         (sentencepiece, "naïve 😀 café")])
def test_a_bos_the_tokenizer_added_to_a_text_prompt_is_no_part_of_its_text(make, prompt):
    """Issue 27, item 4: echoing a text prompt, the BOS the tokenizer added is listed with text "" (the prompt
    text does not contain it), so the other tokens' offsets index the prompt; a "<s>" typed in the text is the
    text's own; an id prompt's BOS is shown, as its echo (the ids decoded) shows it."""
    tok = make()
    encoded = tok.encode(prompt).ids
    added = added_tokens(tok, prompt, encoded)
    assert added[0] and not any(added[1:])
    decoded = prompt_text(tok, encoded, added)
    assert decoded.pieces[0] == "" and "".join(decoded.pieces) == prompt
    shown = prompt_text(tok, encoded)
    assert shown.pieces[0] == "<s>" and "".join(shown.pieces) == tok.decode(encoded, skip_special_tokens=False)


def test_the_text_is_the_whole_list_decoded_for_random_tokens():
    """Decoding in a short window, released in dispatches of any size, gives exactly the whole list decoded (as
    `jaxkv.generate` decodes it): random byte-level tokens (invalid UTF-8, a special token inside a character
    included) and SentencePiece text whose characters are byte-fallback runs; the tokens' bytes join to it."""
    import random

    rng = random.Random(0)
    words = ["héllo", " wörld", " 😀", "’ok’", " 。", "中文", "w", " ", "and"]
    for tok in (byte_level(), sentencepiece()):
        for trial in range(150):
            if tok.get_vocab_size() <= 257 and trial % 2:
                tokens = [rng.randrange(tok.get_vocab_size()) for _ in range(rng.randrange(1, 40))]
            else:
                tokens = ids(tok, "".join(rng.choice(words) for _ in range(12)))
            stream, released, i = TextStream(tok), "", 0
            while i < len(tokens):
                size = rng.randrange(1, 6)
                released += stream.add(tokens[i:i + size])
                i += size
            released += stream.finish()
            assert released == stream.text == tok.decode(tokens), tokens
            listed = b"".join(stream.decoded.token(j)[1] for j in range(len(tokens)))
            assert listed.decode("utf-8", "replace") == released, tokens
