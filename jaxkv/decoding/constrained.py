"""`constraint=` in `generate` and beam search: the host-side rows (`jaxkv.constraints.matcher.Rows`) of a call,
the device carry the compiled loops take (`Grammar`), and what the finished call reports.

Every matcher is compiled before any compute, so a constraint the tokenizer cannot serve is a ValueError
before the prefill, like every other bad argument.
"""

from __future__ import annotations

import contextlib
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jaxkv.constraints import spec


@flax.struct.dataclass
class Grammar:
    """A call's constrained rows as a compiled loop carries them.

    handle:  int32[], names the call's host-side `constraints.matcher.Rows` (`matcher.registered`).
    allowed: int32[B, ceil(V / 32)], the packed mask of each row's next token (all ones: unconstrained).
    """

    handle: jax.Array
    allowed: jax.Array

    def _call(self, host, *args, ended=None, shapes=None):
        from jaxkv.constraints import matcher

        B, W = self.allowed.shape
        if shapes is None:
            shapes = jax.ShapeDtypeStruct((B, W), jnp.int32)
            if ended is not None:
                shapes = (shapes, jax.ShapeDtypeStruct((B,), ended))
        # ordered: the host sees the steps in order, as the stream does
        return io_callback(functools.partial(matcher.host_call, host, shapes=shapes), shapes, self.handle, *args,
                           ordered=True)

    def advance(self, tokens, emitted):
        """The host feeds each constrained row that `emitted` its token (int32[B], bool[B]) and fills the next
        masks -> (the grammar with those masks, bool[B] the rows whose constraint has just ended)."""
        allowed, ended = self._call("advance", tokens, emitted, ended=jnp.bool_)
        return self.replace(allowed=allowed), ended

    def reorder(self, parents, tokens):
        """Beam search: row r continues row parents[r] (int32[B]; -1: none) with tokens[r] -> the grammar with
        the new rows' masks."""
        return self.replace(allowed=self._call("reorder", parents, tokens))

    def draft_masks(self, proposals):
        """Speculative decoding: int32[B, k + 1, ceil(V / 32)] the masks at the verify's positions, for proposals
        int32[B, k] (`matcher.Rows.draft_masks`); the matchers unchanged."""
        B, k = proposals.shape
        return self._call("draft_masks", proposals,
                          shapes=jax.ShapeDtypeStruct((B, k + 1, self.allowed.shape[1]), jnp.int32))

    def advance_verified(self, tokens, last):
        """Speculative decoding: the host feeds each row a verify's tokens int32[B, k + 1] at positions 0..last
        (`matcher.Rows.advance_verified`) -> (the grammar with the next masks, int32[B] where a constraint was
        completed, -1: nowhere)."""
        allowed, ended_at = self._call("advance_verified", tokens, last, ended=jnp.int32)
        return self.replace(allowed=allowed), ended_at


def rows_for(model, constraint, prompts: int, *, rows: int, stop_ids, repeat: int = 1):
    """The `Rows` of a call (None: no prompt is constrained): `constraint` per prompt (`spec.per_row`), each
    prompt's `repeat` rows (n samples, beams) next to each other, `rows` rows in all (batch filler unconstrained).
    ValueError for a bad constraint or a model without a tokenizer."""
    per_prompt = spec.per_row(constraint, prompts)
    if per_prompt is None:
        return None
    from jaxkv.constraints import matcher

    config = model.config
    lltok = matcher.lltokenizer(model.tokenizer, config.vocab_size, config.eos_ids or
                                [int(t) for t in np.asarray(stop_ids).ravel() if t >= 0])
    if not any(t >= 0 for t in np.asarray(stop_ids).ravel()) and not config.eos_ids:
        raise ValueError("constrained decoding needs a stop token")
    compiled = {}
    matchers = []
    for c in per_prompt:
        if c is not None and c not in compiled:
            compiled[c] = matcher.compiled(c, lltok)
        for _ in range(repeat):
            matchers.append(None if c is None else compiled[c].deep_copy())
    return matcher.Rows(matchers, rows=rows, vocab_size=config.vocab_size, stop_ids=stop_ids,
                        eos_ids=lltok.eos_tokens)


@contextlib.contextmanager
def carried(rows):
    """The decode loop's `loop.Grammar` for `rows` (None for None), its rows registered while the context lasts;
    the first token's masks filled on the host first."""
    if rows is None:
        yield None
        return
    from jaxkv.constraints import matcher

    with matcher.registered(rows) as handle:
        yield Grammar(handle=jax.device_put(np.int32(handle)), allowed=jax.device_put(rows.first()))


def report(rows, gen, num_rows: int, what: str = "prompt"):
    """After the loop, on its `Generation`: ValueError for a row whose matcher refused a token; else the
    constraint figures in `gen.stats`: "constraint_incomplete" (the rows whose constraint was not complete when
    they ran out of tokens: finish reason "length"), the host's mask time. A row whose constraint was completed
    by its last allowed token, with no room left for the stop token, finishes "stop" (its answer is whole)."""
    if rows is None:
        return
    rows.check(what)
    for b in range(num_rows):
        if rows.finished[b]:
            gen.finish_reasons[b] = "stop"
    stats = gen.stats
    stats["constraint_incomplete"] = rows.incomplete(num_rows)
    stats["constraint_masks"] = rows.masks_filled
    stats["constraint_mask_s"] = rows.mask_seconds
