"""Text out of a growing list of token ids: released as it becomes final, cut at stop strings.

Why not decode each new token on its own: a token can be part of a character (byte-level BPE splits a multi-byte
character over several tokens, and decoding the first alone gives U+FFFD), and SentencePiece-style decoders drop a
leading space at the start of what they decode. So the whole list is decoded each time and the new suffix released,
holding back (a) a trailing U+FFFD, which the next token may complete, and (b) a tail that could be the start of a
stop string. Decoding the whole list is O(length) per call; calls come once per decode dispatch (several tokens),
and the tokenizer is Rust, so it stays far below a decode step's cost at the context lengths served here.

Stop strings are found in the decoded text token by token, so the stop ends the output at the exact token that
completed it (`TextStream.tokens_used`): the tokens after it in the same dispatch are dropped, and the usage counts
and log-probabilities cover only the tokens that made the text.
"""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    """The text of one sequence's new tokens, released piece by piece.

    add(tokens) -> the newly released text; after a stop string, `stopped` is True, `tokens_used` is the number of
    tokens that produced the text up to it (the token completing the stop included), and nothing more is released.
    finish() -> whatever was held back (an incomplete character, a possible stop prefix) at the end of the sequence.
    `text` is everything released so far. Without a tokenizer (None) there is no text: every call releases "".
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self.text = ""
        self.stopped = False
        self.tokens_used: int | None = None
        self._decoded = ""  # the whole list decoded, as of the last add
        self._searched = 0  # characters of _decoded already searched for a stop (up to the held tail)

    def _decode(self, tokens) -> str:
        if self.tokenizer is None:  # a model without a tokenizer has no text (the server sends token ids)
            return ""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def add(self, tokens: Sequence[int]) -> str:
        if self.stopped or not tokens:
            return ""
        if not self.stop:
            self.tokens += tokens
            self._decoded = self._decode(self.tokens)
            return self._release(self._decoded, hold=_incomplete(self._decoded))
        for i, token in enumerate(tokens):  # one at a time: the stop must end at the token that completed it
            self.tokens.append(token)
            self._decoded = self._decode(self.tokens)
            longest = max(map(len, self.stop))
            start = max(0, self._searched - longest + 1)
            hits = [p for p in (self._decoded.find(s, start) for s in self.stop) if p >= 0]
            self._searched = len(self._decoded)
            if hits:
                self.stopped, self.tokens_used = True, len(self.tokens)
                return self._release(self._decoded[:min(hits)], hold=0)
        hold = max(_incomplete(self._decoded), self._stop_prefix(self._decoded))
        return self._release(self._decoded, hold=hold)

    def finish(self) -> str:
        """The held-back tail, once the sequence has ended (nothing if it stopped at a stop string)."""
        if self.stopped:
            return ""
        return self._release(self._decoded, hold=0)

    def _release(self, decoded: str, hold: int) -> str:
        ready = decoded[:len(decoded) - hold]
        if not ready.startswith(self.text):  # the decoder revised released text (rare): release only what is new
            common = 0
            while common < min(len(ready), len(self.text)) and ready[common] == self.text[common]:
                common += 1
            new = ready[common:] if len(ready) > len(self.text) else ""
            self.text += new
            return new
        new = ready[len(self.text):]
        self.text = ready if len(ready) >= len(self.text) else self.text
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


def _incomplete(text: str) -> int:
    """Trailing U+FFFD characters: an incomplete UTF-8 sequence the next tokens may complete."""
    return len(text) - len(text.rstrip("\ufffd"))


_WINDOW = 4  # tokens of left context a token's text is read in (its piece depends on its neighbours only)


def _piece(tokenizer, history: list[int], token: int) -> str:
    """A token's text after `history`: the growth of the decoded text when it is appended, or the token decoded
    alone when that growth is not a clean suffix (a token inside a multi-byte character)."""
    before = tokenizer.decode(history, skip_special_tokens=False)
    after = tokenizer.decode(history + [token], skip_special_tokens=False)
    if after.startswith(before) and len(after) > len(before) and not after.endswith("\ufffd"):
        return after[len(before):]
    return tokenizer.decode([token], skip_special_tokens=False)


def token_pieces(tokenizer, tokens: Sequence[int], context: Sequence[int] = (),
                 alternatives: Sequence[Sequence[int]] | None = None):
    """Each token's text as it reads in the sequence, for log-probability listings (`context`: tokens before the
    first, e.g. the prompt). With `alternatives` (per position, ids the model ranked), also their texts at that
    position -> (pieces, alternative pieces or None)."""
    history = list(context[-_WINDOW:])
    pieces, alt_pieces = [], [] if alternatives is not None else None
    for i, token in enumerate(tokens):
        pieces.append(_piece(tokenizer, history, token))
        if alternatives is not None:
            alt_pieces.append([_piece(tokenizer, history, alt) for alt in alternatives[i]])
        history = (history + [int(token)])[-_WINDOW:]
    return pieces, alt_pieces
