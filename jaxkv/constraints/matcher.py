"""The host side of constrained decoding: llguidance matchers, one per constrained row, and the packed masks
they fill.

- `lltokenizer(tokenizer, vocab_size, eos_ids)`: the llguidance view of a model's `tokenizers.Tokenizer`, built
  once per (tokenizer, logits width, eos ids) and kept (about 1 s at a 150k vocabulary).
- `compiled(constraint, lltok)`: a fresh matcher for a constraint, copied from one compiled per (grammar,
  tokenizer) and kept (LRU), so n samples, beams and repeated requests compile once.
- `Rows`: one call's rows. `first()` fills the mask of the first token; `advance(tokens, emitted)` feeds each
  constrained row its new token and fills the next mask, returning which rows end there. A row whose constraint
  is complete (nothing but a stop token could follow) is `finished`: its next mask allows only its stop ids, so
  it emits one (with the model's log-probability) and ends "stop" as a row that chose a stop token does (issue
  50: one rule, the stop token included); with no stop id to emit (`stop_tokens=[]`) it ends at once. One that
  completes with no room left for the stop token ends "stop" too (its caller reads `finished`). A row that runs
  out of tokens before its constraint is complete is `incomplete()` ("length"). A token a matcher refuses (a
  custom sampler ignoring the mask) ends the row and is reported by `check()` after the loop: nothing raises
  inside a host callback, where XLA would turn it into an opaque runtime error.

Stop tokens: llguidance allows its eos ids where the grammar may end. The rows' own stop ids replace them there
(a call's stop_tokens may differ from the model's eos), and are allowed only where the grammar may end.

The compiled loop reaches a call's `Rows` through `host_step(handle, ...)`: one module-level function for every
call (no recompile per call), the handle a traced int32 naming the registered `Rows`.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import threading
import weakref

import jax
import numpy as np

from jaxkv.constraints import mask as device_mask
from jaxkv.constraints.spec import Constraint, llguidance

COMPILED_KEPT = 256  # compiled grammars kept per process (LRU); each is its grammar's lexer and parser tables

_lock = threading.Lock()
_tokenizers: dict = {}  # (id(tokenizer), V, eos) -> (tokenizer, LLTokenizer): the tokenizer is held, so its id stays
_compiled: collections.OrderedDict = collections.OrderedDict()  # (grammar, id(LLTokenizer)) -> LLMatcher
_executor = None


def lltokenizer(tokenizer, vocab_size: int, eos_ids) -> object:
    """The `llguidance.LLTokenizer` of a `tokenizers.Tokenizer` for a model whose logits are `vocab_size` wide
    (ids past the tokenizer's are never allowed), with `eos_ids` as its end tokens; built once and kept."""
    if tokenizer is None:
        raise ValueError("constrained decoding needs a model with a tokenizer (the grammar is over text)")
    key = (id(tokenizer), int(vocab_size), tuple(int(t) for t in eos_ids))
    with _lock:
        hit = _tokenizers.get(key)
    if hit is not None:
        return hit[1]
    llg = llguidance()
    if not list(eos_ids):
        raise ValueError("constrained decoding needs the model to have an eos id (config.eos_ids)")
    lltok = llg.LLTokenizer(tokenizer.to_str(), n_vocab=int(vocab_size), eos_token=[int(t) for t in eos_ids])
    with _lock:
        _tokenizers[key] = (tokenizer, lltok)
    return lltok


def compiled(constraint: Constraint, lltok) -> object:
    """A fresh `llguidance.LLMatcher` for `constraint` over `lltok`, or ValueError naming what the grammar
    cannot be compiled for (a grammar valid alone may still refer to a token the tokenizer lacks)."""
    key = (constraint.grammar, id(lltok))
    with _lock:
        template = _compiled.get(key)
        if template is not None:
            _compiled.move_to_end(key)
    if template is None:
        template = llguidance().LLMatcher(lltok, constraint.grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"the constraint {constraint!r} cannot be compiled: {template.get_error()}")
        # One mask now: llguidance builds its lexer lazily, and copies made after share what the template built
        # (the first masks of every later copy then cost what the rest do).
        template.compute_bitmask()
        with _lock:
            _compiled[key] = template
            while len(_compiled) > COMPILED_KEPT:
                _compiled.popitem(last=False)
    return template.deep_copy()


def threads() -> int:
    """The threads that fill a batch's masks: half the CPUs, 1 to 8."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def executor():
    """The llguidance thread pool that fills a batch's masks in parallel (`threads()`)."""
    global _executor
    if _executor is None:
        _executor = llguidance().LLExecutor(num_threads=threads())
    return _executor


class Rows:
    """One call's constrained rows (see the module docstring). `matchers[b]`: row b's matcher, None for an
    unconstrained row (its mask stays all ones); rows past the list are batch filler."""

    def __init__(self, matchers: list, *, rows: int, vocab_size: int, stop_ids, eos_ids):
        self.matchers = list(matchers) + [None] * (rows - len(matchers))
        self.vocab_size = vocab_size
        self.mask = np.full((rows, device_mask.words(vocab_size)), -1, np.int32)
        self._eos_bits = self._bits(eos_ids)  # llguidance's eos: cleared where not a stop id of the row
        self._stop = np.zeros_like(self.mask)  # each row's stop ids as mask bits
        self._clear = np.zeros_like(self.mask)  # each row's eos bits that are not its stop ids
        for b in range(rows):
            self.set_stops(b, stop_ids if np.ndim(stop_ids) == 1 else stop_ids[b])
        self.over = np.array([m is None for m in self.matchers])  # no more masks to fill for the row
        self.finished = np.zeros((rows,), bool)  # the row's constraint is complete (its stop token may follow)
        self.errors: dict[int, str] = {}
        self.mask_seconds = 0.0
        self.masks_filled = 0
        self.steps = 0  # host steps taken (`advance` calls): none while no row is constrained

    def _bits(self, ids) -> np.ndarray:
        """int32[W]: the mask with exactly `ids` allowed (negative ids: padding, ignored)."""
        bits = np.zeros((device_mask.words(self.vocab_size),), np.uint32)
        for t in {int(t) for t in np.asarray(ids).ravel() if t >= 0}:
            bits[t // 32] |= np.uint32(1 << (t % 32))
        return bits.view(np.int32)

    def set_stops(self, row: int, stop_ids):
        """Row `row`'s stop ids (int32[n], -1 padding): allowed where its constraint may end."""
        self._stop[row] = self._bits(stop_ids)
        self._clear[row] = self._eos_bits & ~self._stop[row]

    def start(self, row: int, matcher, stop_ids) -> np.ndarray:
        """A new request in row `row` (the engine's slots): its matcher (None: unconstrained) and stop ids ->
        int32[W] the mask of its first token (all ones when unconstrained)."""
        self.matchers[row] = matcher
        self.set_stops(row, stop_ids)
        self.over[row], self.finished[row] = matcher is None, False
        self.errors.pop(row, None)
        self.mask[row] = -1
        if matcher is not None:
            self._fill([row])
        return self.mask[row].copy()

    def clear(self, row: int):
        """Row `row` holds nothing (its request finished)."""
        self.matchers[row], self.over[row] = None, True

    def move(self, dst: int, src: int):
        """Row `dst` takes over row `src`'s request (the engine compacting its slots); `src` holds nothing."""
        for a in (self.matchers, self.over, self.finished, self.mask, self._stop, self._clear):
            a[dst] = a[src]
        if src in self.errors:
            self.errors[dst] = self.errors.pop(src)
        self.clear(src)

    @property
    def constrained(self) -> list[int]:
        return [b for b, m in enumerate(self.matchers) if m is not None]

    def _fill(self, rows):
        import time

        start = time.perf_counter()
        if rows and threads() == 1:
            # One thread: a plain loop. The pool's hand-off cost here what the fills did (8 rows of the bench's
            # schema: 103-141 us pooled, 50-70 us in a loop; scripts/constrained_host_costs.py, 2 cores).
            from llguidance.numpy import fill_next_token_bitmask

            for b in rows:
                fill_next_token_bitmask(self.matchers[b], self.mask, b)
        elif rows:
            from llguidance.numpy import fill_next_token_bitmask_par

            fill_next_token_bitmask_par(executor(), [(self.matchers[b], b) for b in rows], self.mask)
        for b in rows:  # (both ways: the row's own stop ids where the constraint may end, not llguidance's eos)
            self.mask[b] &= ~self._clear[b]
            if self.matchers[b].is_accepting():
                self.mask[b] |= self._stop[b]
        self.mask_seconds += time.perf_counter() - start
        self.masks_filled += len(rows)

    def first(self) -> np.ndarray:
        """int32[B, W]: the mask of each row's first token."""
        self._fill([b for b in range(len(self.matchers)) if not self.over[b]])
        return self.mask.copy()

    def _consume(self, b: int, token: int) -> bool:
        """Row b's matcher takes `token` -> whether the row ends there: the constraint refused it (an error,
        `check`), or completed with it and the row has no stop id to emit. A row the token completes is
        `finished`, its mask the stop ids alone (the stop token comes next)."""
        m = self.matchers[b]
        if self.finished[b] or not m.consume_token(token):
            error = "the constraint is complete" if self.finished[b] else m.get_error()
            self.errors[b] = f"token {token} is not allowed by the constraint: {error}"
            self.over[b] = True
            return True
        if m.is_stopped():
            self.finished[b] = True
            self.mask[b] = self._stop[b]
            self.over[b] = not self._stop[b].any()
            return bool(self.over[b])
        return False

    def advance(self, tokens, emitted) -> tuple[np.ndarray, np.ndarray]:
        """Feeds each live constrained row that `emitted` its token (int32[B], bool[B]; a row that did not emit is
        over: it stopped) -> (int32[B, W] the next masks, bool[B] the rows that end here, `_consume`)."""
        tokens, emitted = np.asarray(tokens), np.asarray(emitted)
        self.steps += 1
        ended = np.zeros_like(self.finished)
        live = []
        for b in np.flatnonzero(~self.over):
            if not emitted[b]:
                self.over[b] = True
            elif self._consume(b, int(tokens[b])):
                ended[b] = True
            elif not self.finished[b]:
                live.append(b)
        self._fill(live)
        return self.mask.copy(), ended

    def draft_masks(self, proposals) -> np.ndarray:
        """Speculative decoding: int32[B, k + 1, W], each live constrained row's masks at the k + 1 positions a
        verify decides (after its last token, then after each of its k proposals int32[B, k]), without changing
        its matcher. Past the first proposal the constraint refuses, the mask is all ones (the verify has
        rejected by then: that proposal is checked against the mask before it, which refuses it)."""
        from llguidance.numpy import fill_next_token_bitmask_par_with_draft_tokens

        import time

        start = time.perf_counter()
        proposals = np.asarray(proposals)
        B, k = proposals.shape
        masks = np.full((B * (k + 1), self.mask.shape[1]), -1, np.int32)
        work = []
        for b in np.flatnonzero(~self.over):
            if self.finished[b]:  # complete: its stop token next (what follows it is never kept)
                masks[b * (k + 1): (b + 1) * (k + 1)] = self._stop[b]
                continue
            draft = [int(t) for t in proposals[b]]
            work.append((self.matchers[b], b * (k + 1), draft[:self.matchers[b].validate_tokens(draft)]))
        with_draft = [w for w in work if w[2]]
        if with_draft:
            fill_next_token_bitmask_par_with_draft_tokens(executor(), with_draft, masks)
        if len(with_draft) < len(work):  # (llguidance refuses an empty draft: the first proposal is refused)
            from llguidance.numpy import fill_next_token_bitmask_par

            fill_next_token_bitmask_par(executor(), [(m, row) for m, row, draft in work if not draft], masks)
        masks = masks.reshape(B, k + 1, -1)
        for _, row, draft in work:  # llguidance's eos bits mark where the constraint may end: the row's stops there
            b = row // (k + 1)
            for i in range(len(draft) + 1):
                accepting = bool(np.any(masks[b, i] & self._eos_bits))
                masks[b, i] &= ~self._clear[b]
                if accepting:
                    masks[b, i] |= self._stop[b]
        self.mask_seconds += time.perf_counter() - start
        self.masks_filled += sum(len(d) + 1 for _, _, d in work)
        return masks

    def advance_verified(self, tokens, last) -> tuple[np.ndarray, np.ndarray]:
        """Speculative decoding: feeds each live constrained row a verify's tokens int32[B, k + 1] at positions
        0..last (int32[] for every row, or int32[B]; -1: none), up to a stop id (not fed: the row ends there)
        -> (int32[B, W] the next masks, int32[B] the position where the row ends without a stop token
        (`_consume`: a refused token, or a completed constraint with no stop id), -1 where it does not). A
        constraint completed at position i (`finished`) takes the stop token at i + 1, in this verify or the
        next."""
        tokens = np.asarray(tokens)
        last = np.broadcast_to(np.asarray(last), tokens.shape[:1])
        ended_at = np.full((tokens.shape[0],), -1, np.int32)
        live = []
        for b in np.flatnonzero(~self.over):
            for i in range(int(last[b]) + 1):
                t = int(tokens[b, i])
                if t < 0 or (self._stop[b][t // 32] >> (t % 32)) & 1:
                    self.over[b] = True  # a stop token (or NaN logits) ends the row
                    break
                if self._consume(b, t):
                    ended_at[b] = i
                    break
            if not self.over[b] and not self.finished[b]:
                live.append(b)
        self._fill(live)
        return self.mask.copy(), ended_at

    def reorder(self, parents, tokens) -> np.ndarray:
        """Beam search: row r continues row parents[r] (-1: none, the row is over) with tokens[r] (each new row
        its parent's matcher copied, then fed) -> int32[B, W] the new rows' masks. A row the constraint cannot
        continue (refused, or complete) allows only the stop ids, so its every continuation ends it."""
        parents, tokens = np.asarray(parents), np.asarray(tokens)
        old, live = self.matchers, []
        self.matchers = [None] * len(old)
        for r, p in enumerate(parents):
            if p < 0 or old[p] is None:
                continue
            m = self.matchers[r] = old[p].deep_copy()
            if m.consume_token(int(tokens[r])) and not m.is_stopped():
                live.append(r)
            else:
                self.mask[r] = self._stop[r]
        self._fill(live)
        return self.mask.copy()

    def incomplete(self, rows: int) -> list[int]:
        """The first `rows` rows' indices whose constraint was not satisfied when they finished (out of tokens)."""
        return [b for b in self.constrained[:rows] if b < rows and not self.finished[b]
                and not self.matchers[b].is_accepting()]

    def check(self, what: str = "prompt"):
        """ValueError for the first row whose matcher refused a token."""
        for b, error in sorted(self.errors.items()):
            raise ValueError(f"{what} {b}: {error}")


_live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # handle -> Rows, while its owner holds it
_handles = itertools.count(1)


def register(rows: Rows) -> int:
    """`rows` reachable from compiled code by the returned handle (an int) while its owner holds it (an engine's
    rows, for the engine's life)."""
    handle = next(_handles) % (2**31 - 1)
    _live[handle] = rows
    return handle


@contextlib.contextmanager
def registered(rows: Rows):
    """`rows` reachable from the compiled loop by the yielded handle (an int) while the context lasts."""
    handle = register(rows)
    try:
        yield handle
    finally:
        _live.pop(handle, None)


def host_call(method: str, handle, *args, shapes):
    """The compiled loops' callback: `Rows.<method>(*args)` of the registered rows, results as `shapes` say."""
    rows = _live.get(int(handle))
    if rows is None:  # a stale handle (the call ended): allow everything, end nothing
        full = [np.full(s.shape, -1 if s.dtype == np.int32 else 0, s.dtype) for s in jax.tree.leaves(shapes)]
        return tuple(full) if isinstance(shapes, tuple) else full[0]
    return getattr(rows, method)(*args)
