"""Text out of a growing list of token ids: released as it becomes final, cut at stop strings, and each token's own
text and bytes for log-probability listings.

Why not decode each new token on its own: a token can be part of a character (byte-level BPE splits a multi-byte
character over several tokens, SentencePiece's byte fallback spells it <0xC3><0xA9>, and decoding the first alone
gives U+FFFD), and SentencePiece-style decoders drop a leading space at the start of what they decode. So each
token is decoded after a short window of the tokens before it (`Detokenizer`, as vLLM's incremental detokenizer
does), and its piece is what it adds to the final text: the text up to its last complete character. A token
inside a multi-byte character adds "" and the token that completes the character adds all of it (vLLM's
convention). The window starts at a character boundary, so an incomplete character at its end is one whose start
it holds. Whether the text ends inside a character is read from the tokens' own bytes (`Vocabulary`: vocabulary
entries through the decoder's byte mapping, GPT-2's byte-level alphabet or <0xHH> byte-fallback tokens), or, for a
decoder whose bytes are not known here, from a trailing U+FFFD. The text is the pieces joined, so what is found or
counted in it (stop strings, `text_offset`) is in characters of the text as returned.

Stop strings are searched in that text token by token, so the stop ends the output at the exact token that
completed it (`TextStream.tokens_used`): the tokens after it in the same dispatch are dropped, and the usage counts
and log-probabilities cover only the tokens that made the text. Each search starts where the final text ended
before the token (less that stop's length), so a stop string whose last character arrived over several tokens is
found once that character is complete.

With `min_tokens` m (issue 50, vLLM's rule: its detokenizer's stop_check_offset, PR 22014), the text of the first m
tokens is never searched on its own: a stop string must end in text that token m + 1 or a later one added (so the
answer has at least m tokens, as stop token ids wait for m). One that begins in the first m tokens' text and ends
after it does stop the output, as in vLLM (the search starts a stop's length back, as above).
"""

from __future__ import annotations

import codecs
import json
import re
import weakref
from collections.abc import Sequence

_WINDOW = 4  # tokens of left context a token is decoded after (decoders read a token's neighbours only)
_CHAR_TOKENS = 4  # a UTF-8 character is at most 4 bytes: a longer run of U+FFFD is invalid bytes, not one pending


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the others for 256 + i."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + len(chars) - len(printable))
    return {c: b for b, c in chars.items()}


_BYTE_OF = _byte_alphabet()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_steps(tokenizer) -> list[dict]:
    decoder = getattr(tokenizer, "decoder", None)
    if decoder is None:
        return []
    try:
        spec = json.loads(decoder.__getstate__())
    except Exception:  # not a `tokenizers` decoder we can read: its bytes are not known here
        return []
    steps, todo = [], [spec]
    while todo:
        step = todo.pop(0)
        if step.get("type") == "Sequence":
            todo[:0] = step.get("decoders", [])
        else:
            steps.append(step)
    return steps


class Vocabulary:
    """A tokenizer's tokens as the bytes its decoder makes of them, where that is known: byte-level BPE (GPT-2,
    Llama 3, Qwen: each character of a token stands for one byte) and SentencePiece with byte fallback (Llama 2,
    Mistral, Gemma: <0xHH> is byte HH, "▁" a space); `kind` None for other decoders (`raw` answers None)."""

    def __init__(self, tokenizer):
        steps = _decoder_steps(tokenizer)
        types = [s.get("type") for s in steps]
        self.replace = [(s["pattern"]["String"], s["content"]) for s in steps
                        if s.get("type") == "Replace" and "String" in s.get("pattern", {})]
        self.replace += [(s.get("replacement", "▁"), " ") for s in steps if s.get("type") == "Metaspace"]
        self.kind = ("byte_level" if "ByteLevel" in types else "byte_fallback" if "ByteFallback" in types
                     else "metaspace" if "Metaspace" in types else None)
        added = tokenizer.get_added_tokens_decoder() if hasattr(tokenizer, "get_added_tokens_decoder") else {}
        self.added = {i: t.content for i, t in added.items()}
        self.special = frozenset(i for i, t in added.items() if t.special)
        self._raw: dict[int, bytes | None] = {}

    def raw(self, tokenizer, token: int) -> bytes | None:
        """The bytes `token` stands for (an added token: its content), or None where the decoder is not known."""
        token = int(token)
        if token in self._raw:
            return self._raw[token]
        piece = tokenizer.id_to_token(token)
        if piece is None:  # outside the tokenizer's vocabulary (a model's padded rows): decodes to nothing
            out = b""
        elif self.kind == "byte_level":  # as the ByteLevel decoder: a character of the alphabet is its byte
            out = b"".join(bytes([_BYTE_OF[c]]) if c in _BYTE_OF else c.encode() for c in piece)
        elif self.kind in ("byte_fallback", "metaspace"):
            match = _BYTE_TOKEN.fullmatch(piece) if self.kind == "byte_fallback" else None
            if match and token not in self.added:
                out = bytes([int(match.group(1), 16)])
            else:
                for pattern, content in self.replace:
                    piece = piece.replace(pattern, content)
                out = piece.encode()
        else:
            out = None
        self._raw[token] = out
        return out


_VOCABULARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def vocabulary(tokenizer) -> Vocabulary:
    """The tokenizer's `Vocabulary`, built once per tokenizer object."""
    try:
        return _VOCABULARIES[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable: no cache
        return Vocabulary(tokenizer)
    vocab = _VOCABULARIES[tokenizer] = Vocabulary(tokenizer)
    return vocab


def _incomplete_tail(data: bytes) -> bytes:
    """The bytes at the end of `data` that begin a UTF-8 character not yet complete (b"" if none)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data)
    return decoder.getstate()[0]


class Detokenizer:
    """Token ids to text, one token at a time, each token's piece the text it makes final.

    add(token) appends a token; `pieces[j]` is token j's text ("" inside a multi-byte character, the whole
    character at the token completing it; "" for a special token the decoding skips), `text` their join,
    `pending[j]` whether the text after token j ends inside a character. A `silent` token (one the tokenizer added
    to a text prompt, such as a BOS the text does not contain) is listed with text "" and is not decoded.
    `tail()`: an incomplete character at the end, as the decoder shows it (U+FFFD), which no token's piece holds.
    `token(j)` -> (text, bytes) of token j, `alternatives(j, ids)` -> (text, bytes) of other tokens at position j,
    for log-probability listings. Without a tokenizer (None) there is no text: every piece is "".
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.vocab = vocabulary(tokenizer) if tokenizer is not None else None
        self.tokens: list[int] = []
        self.pieces: list[str] = []
        self.pending: list[bool] = []
        self.silent: list[bool] = []
        self.text = ""
        self._ids: list[int] = []  # the tokens decoded (all but the silent ones); windows are slices of it
        self._at: list[tuple] = []  # per token, the window it was read after: (start, end, base, carry, run)
        self._start = 0  # the current window: _ids[_start:], which begins at a character boundary
        self._base = ""  # the window's final text (its decode, less an incomplete character at the end)
        self._carry = self._known()  # bytes of an incomplete character at the window's end; None if not known
        self._run = 0  # tokens since the text last ended at a character boundary
        self._bounds = [0]  # indices into _ids where the text ended at a character boundary (window starts)

    def _known(self) -> bytes | None:
        return b"" if self.vocab is not None and self.vocab.kind is not None else None

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_all(self, lists: list[list[int]]) -> list[str]:
        if self.tokenizer is None:
            return [""] * len(lists)
        if len(lists) == 1:
            return [self._decode(lists[0])]
        return self.tokenizer.decode_batch(lists, skip_special_tokens=self.skip_special_tokens)

    def _own_bytes(self, token: int) -> bytes | None:
        """What `token` puts into the decoded byte stream: nothing for a special token the decoding skips."""
        if self.vocab is None:
            return None
        if self.skip_special_tokens and int(token) in self.vocab.special:
            return b""
        return self.vocab.raw(self.tokenizer, token)

    def _read(self, after: str, base: str, carry: bytes | None, run: int, token: int):
        """Token `token` read after a window whose final text is `base` (its decode with the token: `after`) ->
        (its piece, the window's new final text, the new carry, whether the text now ends inside a character)."""
        if carry is not None:
            raw = self._own_bytes(token)
            carry = None if raw is None else _incomplete_tail(carry + raw)
        if carry is not None:
            pending = bool(carry)
        else:  # the bytes are not known: a trailing U+FFFD may be a character the next tokens complete
            pending = after.endswith("\ufffd") and run + 1 < _CHAR_TOKENS
        if after.startswith(base):  # what is final: all of it, or (pending) up to the trailing U+FFFD
            end = max(len(after.rstrip("\ufffd")), len(base)) if pending else len(after)
            return after[len(base):end], after[:end], carry, pending
        if pending:  # SentencePiece's byte fallback shows a run of byte tokens as U+FFFD while it is incomplete
            return "", base, carry, pending  # (<0xE4><0xB8><0xAD><0xE6>: "中" too): nothing new is final yet
        # The decoder read the window's text differently with this token: byte fallback shows a run of byte tokens
        # that ends invalid as one U+FFFD per byte, valid ones before it included. Text already given stays; what
        # is past its length is new (so the text keeps the decoded text's length, and offsets in it hold).
        return after[len(base):], after, carry, pending

    def add(self, token: int, silent: bool = False) -> str:
        """Appends a token -> its piece."""
        token = int(token)
        self._at.append((self._start, len(self._ids), self._base, self._carry, self._run))
        self.tokens.append(token)
        self.silent.append(silent)
        if silent:
            self.pieces.append("")
            self.pending.append(self._run > 0)
            return ""
        after = self._decode(self._ids[self._start:] + [token])
        piece, self._base, self._carry, pending = self._read(after, self._base, self._carry, self._run, token)
        self._ids.append(token)
        self.pieces.append(piece)
        self.pending.append(pending)
        self.text += piece
        if pending:
            self._run += 1
        else:
            self._run = 0
            self._bounds.append(len(self._ids))
            if len(self._ids) - self._start > 2 * _WINDOW:  # restart the window at a boundary _WINDOW tokens back
                start = max(b for b in self._bounds if b <= len(self._ids) - _WINDOW)
                if start > self._start:
                    self._start = start
                    self._bounds = [b for b in self._bounds if b >= start]
                    self._base = self._decode(self._ids[start:])
                    self._carry = self._known()
        return piece

    def tail(self) -> str:
        """The text past `text` the decoder shows for an incomplete character at the end (U+FFFD), if any."""
        if not self._run:
            return ""
        return self._decode(self._ids[self._start:])[len(self._base):]  # (past the given text's length, as _read)

    def _window(self, j: int):
        if j < len(self._at):
            start, end, base, carry, run = self._at[j]
            return self._ids[start:end], base, carry, run
        return self._ids[self._start:], self._base, self._carry, self._run

    def alternatives(self, j: int, ids: Sequence[int]) -> list[tuple[str, bytes]]:
        """What each of `ids` would have added at position j, in place of the token there -> (text, bytes) each
        (a position at or past the end: after the last token, as for the stop token that ended the text)."""
        if not ids:
            return []
        window, base, carry, run = self._window(j)
        afters = self._decode_all([window + [int(i)] for i in ids])
        out = []
        for i, after in zip(ids, afters):
            piece, _, _, pending = self._read(after, base, carry, run, int(i))
            out.append((piece, self._bytes(int(i), piece, run > 0, pending)))
        return out

    def _bytes(self, token: int, piece: str, pending_before: bool, pending_after: bool) -> bytes:
        """A token's bytes: its own (vocabulary) bytes; but its text's where it begins and ends at character
        boundaries and its own bytes do not make its text (a decoder that strips a leading space or replaces), or
        where its bytes are not known here."""
        if self.vocab is not None and self.skip_special_tokens and token in self.vocab.special:
            return b""
        raw = self._own_bytes(token)
        if raw is None:
            return piece.encode()
        if pending_before or pending_after:
            return raw
        return raw if raw.decode("utf-8", "replace") == piece else piece.encode()

    def entry(self, j: int, token: int) -> tuple[str, bytes]:
        """(text, bytes) of `token` at position j of a listing: token j's own where it was added (`token(j)`), else
        (the stop token that ended the text, which is no part of it) what it would add after the last token."""
        if j < len(self.tokens):
            return self.token(j)
        return self.alternatives(j, [token])[0]

    def token(self, j: int) -> tuple[str, bytes]:
        """Token j's (text, bytes): its piece, and its bytes in the text (they join to the text's UTF-8)."""
        if self.silent[j]:
            return "", b""
        token, piece, run = self.tokens[j], self.pieces[j], self._at[j][4]
        own = self._bytes(token, piece, run > 0, self.pending[j])
        if run == 0 or self.pending[j]:
            return piece, own
        # token j ends a run of tokens that began inside a character: its own bytes, where with the run's they make
        # the run's text (byte-level, byte fallback); else (a decoder that strips or replaces, or bytes not known
        # here) the rest of the run's text, so the listing's bytes join to the text's UTF-8 either way
        g = j - 1
        while g > 0 and self._at[g][4] > 0:
            g -= 1
        given = b"".join(self.token(i)[1] for i in range(g, j))
        text = "".join(self.pieces[g:j + 1])
        raw = self._own_bytes(token)
        if raw is not None and (given + raw).decode("utf-8", "replace") == text:
            return piece, raw
        text = text.encode()
        return piece, text[len(given):] if text.startswith(given) else own


class TextStream:
    """The text of one sequence's new tokens, released piece by piece.

    add(tokens) -> the newly released text; after a stop string, `stopped` is True, `tokens_used` is the number of
    tokens that produced the text up to it (the token completing the stop included), and nothing more is released.
    finish() -> whatever was held back (an incomplete character, a possible stop prefix) at the end of the sequence.
    `text` is everything released so far; `decoded` is the `Detokenizer` of the tokens added (their pieces, for
    log-probability listings). Without a tokenizer (None) there is no text: every call releases "".
    min_tokens: the request's; no stop string ends in the text of its first min_tokens tokens (module docstring).
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.min_tokens = min_tokens
        self.decoded = Detokenizer(tokenizer)
        self.text = ""
        self.stopped = False
        self.tokens_used: int | None = None
        self._searched = 0  # characters of the final text already searched for a stop

    @property
    def tokens(self) -> list[int]:
        return self.decoded.tokens

    def add(self, tokens: Sequence[int]) -> str:
        if self.stopped or not tokens:
            return ""
        for token in tokens:  # one at a time: the stop must end at the token that completed it
            if not self.decoded.add(token) or not self.stop:
                continue
            final = self.decoded.text
            if len(self.tokens) <= self.min_tokens:  # (min_tokens: its text is searched only as a stop's start)
                self._searched = len(final)
                continue
            hits = [p for p in (final.find(s, max(0, self._searched - len(s) + 1)) for s in self.stop) if p >= 0]
            self._searched = len(final)
            if hits:
                self.stopped, self.tokens_used = True, len(self.tokens)
                return self._release(final[:min(hits)])
        final = self.decoded.text
        return self._release(final[:len(final) - self._stop_prefix(final)])

    def finish(self) -> str:
        """The held-back tail, once the sequence has ended (nothing if it stopped at a stop string)."""
        if self.stopped:
            return ""
        return self._release(self.decoded.text + self.decoded.tail())

    def _release(self, ready: str) -> str:
        new = ready[len(self.text):] if ready.startswith(self.text) else ""  # (the final text only grows)
        self.text += new
        return new

    def _stop_prefix(self, decoded: str) -> int:
        """The length of the longest tail of `decoded` that begins some stop string (it may yet complete it)."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(decoded)), best, -1):
                if decoded.endswith(s[:k]):
                    best = k
                    break
        return best


def added_tokens(tokenizer, text: str, ids: Sequence[int]) -> list[bool]:
    """Which of `ids` (`text` encoded with the tokenizer's special tokens) the tokenizer added around the text (a
    BOS, an EOS), rather than read from it: they are no part of the text."""
    processor = getattr(tokenizer, "post_processor", None)
    if processor is None or not processor.num_special_tokens_to_add(False):
        return [False] * len(ids)
    encoding = tokenizer.encode(text)
    if list(encoding.ids) != list(ids):
        return [False] * len(ids)
    return [bool(m) for m in encoding.special_tokens_mask]


def prompt_text(tokenizer, ids: Sequence[int], added: Sequence[bool] | None = None) -> Detokenizer:
    """A prompt's tokens read as its echoed text is: special tokens shown; `added` ones (see `added_tokens`) silent."""
    decoded = Detokenizer(tokenizer, skip_special_tokens=False)
    for j, token in enumerate(ids):
        decoded.add(token, silent=bool(added[j]) if added is not None else False)
    return decoded
