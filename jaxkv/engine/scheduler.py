"""The engine's host side: `Engine`, the scheduler that admits requests into slots, runs prefill chunks and decode
dispatches (`jaxkv.engine.programs`), and turns their outputs into events (`jaxkv.engine.outputs`).

The package docstring (`jaxkv.engine`) says how the programs and the schedule fit together.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import checks, sharding
from jaxkv.cache import planner as memory
from jaxkv.cache.paged import NO_PAGE
from jaxkv.cache.prefix import PrefixCache
from jaxkv.decoding import constrained, processing, request
from jaxkv.decoding.speculation import Speculation
from jaxkv.engine import outputs, programs
from jaxkv.engine import speculative as speculative_program
from jaxkv.engine.outputs import Event, Result
from jaxkv.engine.requests import Request, generate_calls, padded
from jaxkv.engine.programs import FINISH_REASONS, MAX_LOGPROBS, STOP_SLOTS
from jaxkv.model import Model
from jaxkv.sampling import Sampler

# --- the host side --------------------------------------------------------------------------------------------


class Engine:
    """Continuous batching over `slots` sequences of one paged KV cache.

    Args:
      model: a `jaxkv.Model`.
      slots: sequences decoded together (S): the batch of the compiled decode step.
      max_len: the most slots one request may use: its prompt plus max_new_tokens, at most the model's max
        positions. A longer request is refused at `submit`.
      page_size: slots per page (default 16, or the prefix cache's).
      cache_dtype: the cache dtype (default the model's): "float32", "bfloat16", "float16", "int8",
        "float8_e4m3fn".
      prefix_cache: a `jaxkv.PrefixCache`: the engine runs in its pool, a request reuses the pages of a cached
        prefix of its prompt (whole pages) and prefills only the rest, and every prompt's whole pages stay cached
        for later requests (and later `generate` calls), evicted least recently used first when the pool is
        short. While requests are in flight the engine holds the pool (a `generate` call on it is refused).
        A hybrid model (linear-attention layers) resumes a hit from the cache's state snapshot at its end; its
        prompt chunks are cut back to the snapshot boundaries they reach, where its state is snapshotted.
      mesh: a ("data", "model") `jax.sharding.Mesh`. Its "data" axis above 1: one engine per data shard, each with
        these arguments (`jaxkv.engine.data_parallel.DataParallelEngine`, what is returned then). With data 1:
        weights split Megatron-style over "model" as for
        `generate`, the page pools over KV heads (`sharding.paged_cache_shardings`), the page tables and the
        per-slot state on every device; attention="pallas" runs the paged kernel per shard of the heads
        (`sharding.shard_paged_attention`). A prefix_cache must be built for the same mesh
        (`jaxkv.PrefixCache(..., mesh=mesh)`: its pool split as the engine's).
      num_pages: pages in the pool (default: every slot at max_len; `jaxkv.memory.pool_bytes` gives the bytes).
        A request is admitted only when its worst case fits beside the worst cases of those admitted (the others
        wait, in order), so a smaller pool trades throughput for memory, never correctness. With a prefix_cache
        its pool is used instead.
      prefill_chunk: prompt tokens prefilled per request per dispatch (C).
      prefill_rows: requests prefilled together per dispatch (R); the chunk program is [R, C] tokens. Twice as
        many staging rows hold requests being prefilled or prefilled and waiting for a slot.
      steps_per_dispatch: decode steps per compiled dispatch (the host sees tokens and admits requests between
        dispatches).
      attention: "auto", "xla" or "pallas" for the decode step (prefill chunks use XLA).
      decode_widths: the batch widths decode dispatches are compiled for (default: 1, 2, 4, ... and `slots`); a
        dispatch computes the first W slots for the smallest W holding every decoding slot. Fewer widths compile
        fewer programs; `[slots]` computes every slot every step. Must include `slots`.
      speculative: a `jaxkv.Speculation("ngram", k)`: each decode step of a slot whose sequence so far predicts
        its next tokens verifies k of them in one pass (`jaxkv.engine.speculative`); every request's output is
        distributed as without it (greedy: the same tokens), each slot keeps its own accepted count and falls
        back to plain steps on its own (`adaptive`). A request's worst case then counts k more slots. `stats`
        adds the speculation counters. `Speculation("draft", draft=...)`: the draft model's K/V live in a pool
        of its own under the target's page tables (`programs.State.draft`), so its pages come and go with the
        target's; its prompt is prefilled beside the target's chunks (from slot 0, also after a prefix-cache
        hit). `Speculation("mtp")` (a checkpoint with MTP layers, `Model.mtp`): the first module's one-layer
        K/V live alike under the target's tables, one position behind; its prompt pairs are written with the
        target's chunks. No mesh.
    """

    def __new__(cls, model=None, *args, mesh=None, **kwargs):
        # A mesh whose "data" axis is above 1: one engine per data shard (`jaxkv.engine.data_parallel`)
        if mesh is not None and sharding.data_size(sharding.check_mesh(mesh)) > 1:
            from jaxkv.engine.data_parallel import DataParallelEngine

            return DataParallelEngine(model, *args, mesh=mesh, engine=cls, **kwargs)
        return super().__new__(cls)

    def __init__(self, model: Model, *, slots: int, max_len: int, page_size: int | None = None,
                 cache_dtype: str | None = None, prefix_cache=None, mesh=None, num_pages: int | None = None,
                 prefill_chunk: int = 128, prefill_rows: int = 4, steps_per_dispatch: int = 8,
                 attention: str | None = None, decode_widths: Sequence[int] | None = None, speculative=None):
        if not isinstance(model, Model):
            raise ValueError(f"model must be a jaxkv.Model, got {type(model).__name__}")
        config = model.config
        request.refuse_hybrid(config, *(["the engine's mesh"] if mesh is not None else []))
        self.model, self.config = model, config
        self.mesh = None if mesh is None else sharding.check_paged_mesh(mesh)  # data 1: run one engine per shard
        self._params, self._run_config = model.params, config
        if self.mesh is not None:
            self._params, self._run_config = sharding.shard_params(model.params, config, self.mesh)
        self.slots = checks.check_int("slots", slots, 1)
        self.max_len = checks.check_int("max_len", max_len, 2)
        if self.max_len > config.max_positions:
            raise ValueError(f"max_len={max_len} exceeds the model's max positions ({config.max_positions})")
        self.cache_dtype = request.cache_dtype(config, cache_dtype)
        if prefix_cache is not None:
            if not isinstance(prefix_cache, PrefixCache):
                raise ValueError(f"prefix_cache must be a jaxkv.PrefixCache, got {type(prefix_cache).__name__}")
            if num_pages is not None:
                raise ValueError("pass num_pages or prefix_cache, not both: the engine runs in the prefix cache's pool")
            page_size = prefix_cache.page_size if page_size is None else page_size
            prefix_cache.check(model, self.cache_dtype, checks.check_int("page_size", page_size, 1), self.mesh)
        self.page_size = checks.check_int("page_size", memory.DEFAULT_PAGE_SIZE if page_size is None else page_size, 1)
        self.speculation = None  # the checked `speculation.Plan`
        if speculative is not None:
            if not isinstance(speculative, Speculation):
                raise ValueError(f"speculative must be a jaxkv.Speculation, got {type(speculative).__name__}")
            self.speculation = speculative.check(model)
            if self.mesh is not None:
                raise ValueError("the engine does not speculate on a mesh yet")
        self.draft = None if self.speculation is None or self.speculation.method != "draft" else speculative.draft
        # With the MTP proposer: the checkpoint's first module (`Model.mtp`), proposing as a draft would.
        self.mtp = None if self.speculation is None or self.speculation.method != "mtp" else model.mtp
        self._mtp_pools = None  # the module's pools between two leases of a prefix cache's pool (`_return_pool`)
        if self.mtp is not None:
            self._draft_cache_dtype = request.cache_dtype(self.mtp.config, self.cache_dtype)
            self._draft_attention = request.attention(self.mtp.config, attention, paged=True)
        if self.draft is not None:
            # The draft's cache lives in pages of the same pool geometry, under the target's tables.
            if self.draft.config.max_positions < self.max_len:
                raise ValueError(f"max_len={max_len} exceeds the draft model's max positions "
                                 f"({self.draft.config.max_positions})")
            self._draft_cache_dtype = request.cache_dtype(self.draft.config, self.cache_dtype)
            self._draft_attention = request.attention(self.draft.config, attention, paged=True)
        self._lookahead = 0 if self.speculation is None else self.speculation.num_tokens
        # M: a verify writes k slots past the last token before it gives back what the rejected ones took.
        self.max_pages = -(-(self.max_len + self._lookahead) // self.page_size)
        if prefix_cache is not None:
            self.num_pages = prefix_cache.num_pages
        else:
            self.num_pages = checks.check_int("num_pages", self.slots * self.max_pages if num_pages is None
                                              else num_pages, 1)
        self.prefill_chunk = checks.check_int("prefill_chunk", prefill_chunk, 1)
        self.prefill_rows = checks.check_int("prefill_rows", prefill_rows, 1)
        self.steps_per_dispatch = checks.check_int("steps_per_dispatch", steps_per_dispatch, 1)
        # Decode widths compiled (powers of two, and S): a dispatch computes the smallest holding every decoding slot
        if decode_widths is None:
            self.decode_widths = sorted({min(1 << k, self.slots) for k in range(self.slots.bit_length() + 1)})
        else:
            if isinstance(decode_widths, (str, int)) or not isinstance(decode_widths, Sequence):
                raise ValueError(f"decode_widths must be a list of widths, got {decode_widths!r}")
            widths = sorted({checks.check_int("decode width", w, 1, self.slots) for w in decode_widths})
            if not widths or widths[-1] != self.slots:
                raise ValueError(f"decode_widths must include slots ({self.slots}), got {list(decode_widths)}")
            self.decode_widths = widths
        self.attention = request.attention(config, attention, paged=True)  # MLA: "xla" (no paged kernel)
        self.prefix_cache = prefix_cache
        # a hybrid model's prefix cache keeps state snapshots where prompt chunks end (`jaxkv.cache.prefix`)
        self._snapshotting = prefix_cache is not None and prefix_cache.hybrid
        self._state: programs.State | None = None  # allocated on first use
        self._free = self.num_pages  # free pages as of the last dispatch
        self._requests: dict[int, Request] = {}  # unfinished, by id
        self._waiting: collections.deque[int] = collections.deque()
        self._by_slot: list[int | None] = [None] * self.slots  # decode slot -> request id
        # Staging rows (Q): twice the prefill rows, so that requests prefilled and waiting for a slot do not leave
        # the prefill dispatch's rows empty.
        self._staging: list[int | None] = [None] * (2 * self.prefill_rows)  # staging row -> request id
        self._results: dict[int, Result] = {}  # finished, not yet collected
        # Events not yet reported: cancellations (between steps) and what a `run` left early did not yield.
        self._events: collections.deque[Event] = collections.deque()
        self._order: list[int] = []  # ids submitted and not yet collected, in submission order
        self._next_id = 0
        self._stats = collections.Counter()
        self._key_shape = np.asarray(request.prng_key(0)).shape  # a PRNG key's raw words (2 for threefry)
        # Constrained requests' matchers, one row per decode slot (`jaxkv.constraints.matcher.Rows`), which the
        # decode program reaches through a handle. A model without a tokenizer takes no constraint: no masks.
        self._grammar = None
        if model.tokenizer is not None:
            from jaxkv.constraints import matcher

            self._grammar = matcher.Rows([], rows=self.slots, vocab_size=config.vocab_size, stop_ids=[-1],
                                         eos_ids=config.eos_ids)
            self._grammar_handle = matcher.register(self._grammar)

    # --- requests -----------------------------------------------------------------------------------------------

    def submit(self, prompt, *, max_new_tokens: int, temperature=0.0, top_k=None, top_p=None, min_p=None,
               seed: int = 0, stop_tokens: Sequence[int] | None = None, logprobs: int = 0,
               callback: Callable | None = None, repetition_penalty=None, presence_penalty=None,
               frequency_penalty=None, logit_bias=None, min_tokens=None, constraint=None) -> int:
        """Queues a request -> its id. Every setting is checked here (ValueError), never in a running batch.

        prompt: token ids, or text for a model with a tokenizer. max_new_tokens: at most this many new tokens;
        prompt + max_new_tokens must fit max_len, and its pages the pool (else ValueError: it could never run).
        temperature, top_k, top_p, min_p: as `jaxkv.generate` (scalars); different requests' settings run in the
        same compiled step. seed: the request's own PRNG seed: it draws what `generate` of it alone draws.
        stop_tokens: ids that end it (included in its tokens); None: the model's eos ids; []: none (at most
        STOP_SLOTS). logprobs: k in [0, 20], the top-k alternatives to report per token (each token's own
        log-probability is always reported). callback: called with each `Event` of this request as it is
        produced; if it raises, this request ends with finish_reason "error" and the others go on.
        repetition_penalty, presence_penalty, frequency_penalty, logit_bias, min_tokens: as `jaxkv.generate`
        (scalars; logit_bias one dict); traced per slot, so they never recompile (not with speculation yet).
        constraint: a `jaxkv.JsonSchema`, `Regex`, `Choice` or `Grammar` (a model with a tokenizer; with
        speculation too), compiled here: the request's tokens follow it as in `jaxkv.generate`, and a complete
        constraint finishes it with "stop" (its stop token emitted, where max_new_tokens leaves room for it).
        Constrained and unconstrained requests share the compiled step; a dispatch with no constrained request
        decoding pays nothing for them.
        """
        config = self.config
        with checks.about("prompt"):  # each refusal names its argument (`checks.ArgumentError`)
            prompt = request.token_lists([prompt] if not isinstance(prompt, str) else prompt, config.vocab_size,
                                  self.model.tokenizer)
            if len(prompt) != 1:
                raise ValueError("submit takes one prompt (token ids or a string); use generate() for a list")
        prompt = prompt[0]
        with checks.about("max_new_tokens"):  # what a prompt that fits leaves room for
            max_new_tokens = checks.check_int("max_new_tokens", max_new_tokens, 1)
            if len(prompt) + max_new_tokens > self.max_len:
                raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                                 f"engine's max_len ({self.max_len})")
            pages = -(-(len(prompt) + max_new_tokens - 1 + self._lookahead) // self.page_size)
            if pages > self.num_pages:
                raise ValueError(f"the request needs {pages} pages of {self.page_size} slots; the pool has "
                                 f"{self.num_pages}")
        s = checks.sampling(temperature, top_k, top_p, min_p)
        settings = (float(s["temperature"]), int(s["top_k"] or 0), 1.0 if s["top_p"] is None else float(s["top_p"]),
                    0.0 if s["min_p"] is None else float(s["min_p"]))
        key = np.asarray(request.prng_key(seed))
        with checks.about("stop_tokens"):
            stop_ids = request.stop_ids(stop_tokens, config)
            if (stop_ids >= 0).sum() > STOP_SLOTS:
                raise ValueError(f"at most {STOP_SLOTS} stop tokens per request, got {(stop_ids >= 0).sum()}")
        stop_ids = np.concatenate([stop_ids, np.full(STOP_SLOTS, -1, np.int32)])[:STOP_SLOTS]
        top = checks.check_int("logprobs", logprobs, 0, MAX_LOGPROBS)
        asked = dict(repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                     frequency_penalty=frequency_penalty, logit_bias=logit_bias, min_tokens=min_tokens)
        if self.speculation is not None and processing.requested(asked):
            raise checks.ArgumentError(f"the engine does not take {', '.join(processing.requested(asked))} with "
                                       "speculation yet", processing.requested(asked)[0])
        penalties = processing.settings(**asked, rows=1, padded=1, vocab_size=config.vocab_size,
                                        max_new_tokens=max_new_tokens)
        if callback is not None and not callable(callback):
            raise ValueError(f"callback must be a callable (event), got {callback!r}")
        grammar = None
        if constraint is not None:
            with checks.about("constraint"):
                grammar = self._matcher(constraint)
        rid = self._next_id
        self._next_id += 1
        self._requests[rid] = Request(id=rid, prompt=prompt, max_new_tokens=max_new_tokens, settings=settings,
                                       key=key, stop_ids=stop_ids, top=top, callback=callback, pages=pages,
                                       penalties=penalties, matcher=grammar)
        self._waiting.append(rid)
        self._order.append(rid)
        return rid

    def _matcher(self, constraint):
        """A fresh llguidance matcher for a request's constraint, or ValueError (before anything runs)."""
        from jaxkv.constraints import matcher, spec

        if self._grammar is None:
            raise ValueError("a constraint needs a model with a tokenizer (the grammar is over text)")
        (constraint,) = spec.per_row(constraint, 1) if isinstance(constraint, spec.Constraint) else [None]
        if constraint is None:
            raise ValueError("constraint must be a jaxkv.JsonSchema, Regex, Choice or Grammar")
        return matcher.compiled(constraint, matcher.lltokenizer(self.model.tokenizer, self.config.vocab_size,
                                                                self.config.eos_ids))

    def cancel(self, request_id: int) -> bool:
        """Ends a request now (finish_reason "cancelled", tokens so far kept) and frees its slot and pages ->
        whether it was still unfinished."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._finish(req, "cancelled")
        # Its callback gets the event now; run() / the next step report it.
        self._events.append(self._notify(req, Event(req.id, [], [], True, "cancelled")))
        return True

    # --- running ------------------------------------------------------------------------------------------------

    def run(self) -> Iterator[Event]:
        """Runs until every submitted request has finished, yielding each `Event` as its tokens come out.
        Requests submitted meanwhile (from the loop consuming the events) join. Leaving the loop early is safe:
        the requests stay where they were, the events not yet yielded stay queued, and a later `run` (or `step`)
        reports them first, then continues."""
        while self._requests or self._events:
            if not self._events:
                # the round's events before what its callbacks queued (a cancel comes after the events before it),
                # the order `step` reports them in
                self._events.extendleft(reversed(self._round()))
            while self._events:  # taken one at a time: a consumer that leaves keeps the rest queued
                yield self._events.popleft()

    def step(self) -> list[Event]:
        """One scheduling round: admit what fits, one prefill chunk, one decode dispatch -> the events (those
        queued before it first: cancellations, and what a `run` left early did not yield)."""
        return self.take_events() + self._round()

    def take_events(self) -> list[Event]:
        """The events queued and not yet reported (`queued_events`), handed over now without a round: the
        data-parallel engine takes a shard's cancellation as it happens, so that it reports it as one engine
        does (before the next round)."""
        events = list(self._events)
        self._events.clear()
        return events

    def _round(self) -> list[Event]:
        if self.prefix_cache is not None and self.prefix_cache.lent_to not in (None, self):
            # Two engines cannot run in one pool at once (each would step on its own copy of it). Nothing here
            # has changed: this engine's requests wait, and it runs once the other has finished and given the
            # pool back.
            raise RuntimeError("this engine's PrefixCache pool is in use by another jaxkv.Engine with requests in "
                               "flight: finish those (its results()) first, then step this one")
        events = []
        if self._requests:
            self._take_pool()
            self._prefill_round()
            events += self._decode_dispatch()
        if not self._requests:
            self._return_pool()
        return events

    def results(self) -> list[Result]:
        """Runs every submitted request to the end -> one `Result` per request submitted since the last call, in
        submission order (each is returned once)."""
        for _ in self.run():
            pass
        order, self._order = self._order, []
        return [self._results.pop(rid) for rid in order]

    def take(self, request_id: int) -> Result | None:
        """The `Result` of a finished request, handed over once and forgotten (None while it is unfinished, or if
        it was already taken). A long-running caller (a server) takes each result as its request finishes, so
        that finished requests do not pile up waiting for `results()`."""
        result = self._results.pop(request_id, None)
        if result is not None:
            self._order.remove(request_id)
        return result

    @contextlib.contextmanager
    def submitting(self):
        """A block of `submit` calls that all stand or none does: if the block raises, the requests it submitted
        are withdrawn (never run, no event, no callback, no id used) and the exception goes on. Only for submits:
        nothing else may run the engine inside it."""
        saved = (self._next_id, list(self._order), collections.deque(self._waiting), dict(self._requests))
        try:
            yield
        except BaseException:
            self._next_id, self._order, self._waiting, self._requests = saved
            raise

    def generate(self, requests, **defaults) -> list[Result]:
        """Blocking: submits every request (all checked first: one bad request submits none), runs them to the
        end -> their `Result`s in order. A request is a prompt (token ids or text), or a dict of `submit`
        arguments with a "prompt"; `defaults` are `submit` arguments for every request (max_new_tokens, ...)."""
        calls = generate_calls(requests, defaults)
        ids = []
        with self.submitting():
            for call in calls:
                ids.append(self.submit(call.pop("prompt"), **call))
        for _ in self.run():
            pass
        self._order = [rid for rid in self._order if rid not in ids]
        return [self._results.pop(rid) for rid in ids]

    # --- inspection ---------------------------------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return sum(owner is None for owner in self._by_slot)

    @property
    def free_pages(self) -> int:
        """Free pages of the pool as of the last dispatch (cached prefixes are not free)."""
        return self._free

    def held_pages(self) -> int:
        """Pages some request holds (its page-table row names them; a cached prefix page a request reads counts,
        one the prefix cache alone keeps does not), read from the device's reference counts: 0 once every request
        has finished or been cancelled. Reads device memory: call it between steps."""
        if self._state is None:
            return 0
        counts = np.asarray(self._state.cache.refcounts).copy()
        if self.prefix_cache is not None:
            np.subtract.at(counts, self.prefix_cache.pages(), 1)
        return int((counts > 0).sum())

    @property
    def cached_pages(self) -> int:
        """Pages the prefix cache keeps for later prompts (0 without one)."""
        return 0 if self.prefix_cache is None else self.prefix_cache.cached_pages

    @property
    def queued_events(self) -> int:
        """Events not yet reported (cancellations, and what a `run` left early did not yield): the next `step`
        returns them first."""
        return len(self._events)

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet admitted (no cache row yet)."""
        return len(self._waiting)

    @property
    def pending(self) -> int:
        """Requests submitted and not finished."""
        return len(self._requests)

    @property
    def stats(self) -> dict:
        """Counters since the engine was built (or `reset_stats`): requests, tokens, dispatches, decode steps run,
        slot occupancy (decoding slots per step that ran / slots), decode rows computed (each step computes the
        dispatch's width, not every slot) and the fraction of them that were idle, prefill tokens computed and
        padding, prefix-cache hits, seconds spent in each kind of dispatch."""
        c = dict(self._stats)
        rows = c.get("decode_steps", 0) * self.slots
        c["slot_occupancy"] = c.get("decode_rows_used", 0) / rows if rows else 0.0
        computed = c.get("decode_rows_computed", 0)
        c["decode_padding"] = 1.0 - c.get("decode_rows_used", 0) / computed if computed else 0.0
        computed = c.get("prefill_tokens_computed", 0)
        c["prefill_padding"] = 1.0 - c.get("prefill_tokens", 0) / computed if computed else 0.0
        if self.speculation is not None:
            proposed = c.setdefault("spec_proposed", 0)
            c["spec_acceptance_rate"] = c.get("spec_accepted", 0) / proposed if proposed else 0.0
            for name in ("spec_accepted", "spec_verifies", "target_forwards"):
                c.setdefault(name, 0)
            # Tokens per decode forward pass per decoding slot (the first token of each request comes from its
            # prefill's logits and is not counted).
            rows = c.get("decode_rows_used", 0)
            c["tokens_per_target_forward"] = c.pop("pass_tokens", 0) / rows if rows else 0.0
        return c

    def warm_up(self):
        """Compiles every program the engine may run (one request through admit, prefill, decode and release, then
        an idle decode dispatch at each width in `decode_widths`), so that no request waits on a compile later.
        Without it a decode width compiles the first time the load needs it."""
        if self._requests:
            raise ValueError("warm_up runs on an idle engine: finish the requests in flight first")
        self.generate([[0]], max_new_tokens=2, stop_tokens=[])
        self._take_pool()
        S, none = self.slots, np.full((self.slots,), -1, np.int32)
        sampler = Sampler(temperature=np.zeros((S,), np.float32), top_k=np.zeros((S,), np.int32),
                          top_p=np.ones((S,), np.float32), min_p=np.zeros((S,), np.float32))
        for width in self.decode_widths:  # nothing decodes: each dispatch only compiles
            self._state, _, free, _ = self._decode(width, none, none, np.zeros((S, *self._key_shape), np.uint32),
                                                   sampler, np.full((S, STOP_SLOTS), -1, np.int32),
                                                   np.zeros((S,), np.int32), np.zeros((S,), np.int32),
                                                   *self._prompts([]), grammar=self._grammar_moves([]))
        self._free = int(free)
        self._return_pool()
        self.reset_stats()

    def reset_stats(self):
        """Zeroes `stats` (e.g. after a warm-up request, so that the counters describe real traffic only)."""
        self._stats.clear()

    # --- scheduling ---------------------------------------------------------------------------------------------

    def _take_pool(self):
        if self._state is not None:
            return
        S, Q, V = self.slots, len(self._staging), self.config.vocab_size
        if self.prefix_cache is not None:
            table = np.full((S + Q, self.max_pages), NO_PAGE, np.int32)
            cache = self.prefix_cache.cache(table, np.zeros((S + Q,), np.int32))
            self.prefix_cache.lent_to = self
        else:
            cache = programs.allocate(self._run_config, S + Q, num_pages=self.num_pages, page_size=self.page_size,
                                      max_len=self.max_pages * self.page_size, dtype=self.cache_dtype)
        self._state = programs.State(
            cache=cache, staged=jnp.zeros((Q, V), jnp.float32), logits=jnp.zeros((S, V), jnp.float32),
            keys=jnp.zeros((S, *self._key_shape), jnp.uint32), decoding=jnp.zeros((S,), bool),
            sampler=Sampler(temperature=jnp.zeros((S,), jnp.float32), top_k=jnp.zeros((S,), jnp.int32),
                            top_p=jnp.ones((S,), jnp.float32), min_p=jnp.zeros((S,), jnp.float32)),
            stop_ids=jnp.full((S, STOP_SLOTS), -1, jnp.int32), budget=jnp.zeros((S,), jnp.int32),
            top=jnp.zeros((S,), jnp.int32),
            spec=None if self.speculation is None else speculative_program.Slots.empty(
                S, self._history_width, None if self.mtp is None else (self._lookahead, self.config.d_model,
                                                                       self.config.dtype)),
            draft=self._mtp_pools if self._mtp_pools is not None
            else None if self.draft is None and self.mtp is None else programs.allocate(
                (self.draft or self.mtp).config, S + Q, num_pages=self.num_pages, page_size=self.page_size,
                max_len=self.max_pages * self.page_size, dtype=self._draft_cache_dtype),
            staged_hidden=None if self.mtp is None else jnp.zeros((Q, self.config.d_model), self.config.dtype),
            processing=processing.start(processing.Penalties.neutral(S), np.full((S, 1), -1, np.int32),
                                        vocab_size=V),
            staged_processing=processing.start(processing.Penalties.neutral(Q), np.full((Q, 1), -1, np.int32),
                                               vocab_size=V),
            grammar=None if self._grammar is None else constrained.Grammar(
                handle=jnp.int32(self._grammar_handle), allowed=jnp.asarray(self._grammar.mask)),
            constrained=None if self._grammar is None else jnp.zeros((S,), bool))
        if self.mesh is not None:  # the pools split over KV heads, everything else on every device
            rep = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            shardings = jax.tree.map(lambda _: rep, self._state)
            shardings = shardings.replace(cache=sharding.paged_cache_shardings(cache, self.mesh))
            self._state = jax.device_put(self._state, shardings)
        else:
            # Committed to one device, as program outputs are when the weights are (a loaded checkpoint's are):
            # jit's cache keys on committedness, so a state of fresh arrays and one of program outputs (a prefix
            # cache's pool coming back for the next run) would each compile every program once.
            self._state = jax.device_put(self._state, jax.local_devices()[0])
        # The two small programs a run may first need late (a cancel; an eviction), compiled now with no effect,
        # so that no request ever waits on a compile once the first has run.
        self._state, _ = programs.release(self._state, np.zeros((S + Q,), bool), mesh=self.mesh)
        self._state, free = programs.refs(self._state, padded([], self.num_pages), np.int32(0), mesh=self.mesh)
        self._free = int(free)
        self._state = programs.mark_prompt(self._state, np.int32(S), padded([], self.max_len), mesh=self.mesh)

    def _return_pool(self):
        """Idle: a prefix cache gets its pool back (every row empty, the cached prefixes kept)."""
        if self.prefix_cache is not None and self._state is not None and not self._requests:
            self.prefix_cache.store(self._state.cache)
            self.prefix_cache.lent_to = None
            # The MTP module's pools stay with the engine: the cached prefixes' module K/V, which later hits rely
            # on (`programs.prefill`), come back with the pool at the next lease.
            self._mtp_pools = None if self.mtp is None else self._state.draft
            self._state = None

    def _pending_pages(self) -> int:
        """Pages the admitted requests may still take: each one's worst case less the pages it holds."""
        ps = self.page_size
        return sum(r.pages - -(-r.written // ps) for r in self._requests.values() if r.row >= 0)

    def _admit_waiting(self):
        """Waiting requests, in submission order, into free staging rows while the pool holds their worst case."""
        while self._waiting and None in self._staging:
            req = self._requests[self._waiting[0]]
            hits, snapshot = self.prefix_cache.match_with_state(req.prompt) if self.prefix_cache is not None \
                else ([], -1)
            need = req.pages - len(hits)
            room = self._free - self._pending_pages()
            if room < need and self.prefix_cache is not None:
                keep = {p for r in self._requests.values() if r.row >= 0 for p in r.hit_pages} | set(hits)
                counts = np.asarray(self._state.cache.refcounts)
                dropped, _ = self.prefix_cache.evict(need + self._pending_pages(), keep, counts, self._state.cache)
                if dropped:
                    self._state, free = programs.refs(self._state, padded(dropped, self.num_pages), np.int32(-1),
                                                      mesh=self.mesh)
                    self._free = int(free)
                room = self._free - self._pending_pages()
            if room < need:
                return  # it waits (and the requests behind it) until finished requests free pages
            if self.prefix_cache is not None and self.prefix_cache.host_pages:
                # host-tier blocks continuing the hit come back into free pages (pages `need` counts anyway)
                host = self.prefix_cache.host_match(req.prompt, len(hits))
                if host:
                    free = np.flatnonzero(np.asarray(self._state.cache.refcounts) == 0)[:len(host)]
                    host = host[:len(free)]
                    pages = [int(p) for p in free[:len(host)]]
                    self._state, free_count = programs.restore(self._state, jnp.asarray(pages, jnp.int32),
                                                               self.prefix_cache.take_host(host), mesh=self.mesh)
                    self._free = int(free_count)
                    self.prefix_cache.indexed(host, pages)
                    hits = list(hits) + pages
                    self._stats["host_hit_tokens"] += len(pages) * self.page_size
            self._waiting.popleft()
            j = self._staging.index(None)
            table = np.full((self.max_pages,), NO_PAGE, np.int32)
            table[:len(hits)] = hits
            req.row, req.state = self.slots + j, "prefilling"
            req.cached = req.written = len(hits) * self.page_size
            req.hit_pages = tuple(hits)
            self._staging[j] = req.id
            # a hybrid model resumes from the state snapshot at the end of its hit (zeros without one)
            states = self.prefix_cache.snapshot_rows(np.array([snapshot], np.int32)) if self._snapshotting else None
            self._state, free = programs.admit(self._state, np.int32(req.row), table, np.int32(req.written),
                                               req.penalties, states, mesh=self.mesh)
            self._free = int(free)
            if req.penalties.repetition[0] != 1.0:  # it penalizes its prompt's tokens too
                self._state = programs.mark_prompt(self._state, np.int32(req.row), padded(req.prompt, self.max_len),
                                                   mesh=self.mesh)
            self._stats["requests_admitted"] += 1
            self._stats["prefix_hit_tokens"] += req.cached

    def _prefill_round(self):
        """Admits and prefills before a decode dispatch: one chunk per prefilling row; a second when some free slot
        would otherwise stay empty through the dispatch (requests finish faster than one chunk a round refills
        them); as many as it takes while no slot decodes (nothing to hold up). A long prompt therefore delays the
        running slots by at most two chunks per dispatch."""
        # (a draft model's chunks trail the target's by a prefix-cache hit at most: twice as many then)
        for i in range(len(self._staging) * -(-self.max_len // self.prefill_chunk) * (1 + (self.draft is not None))):
            self._admit_waiting()
            if not self._prefill_chunk():
                return
            decoding = sum(rid is not None for rid in self._by_slot)
            ready = sum(rid is not None and self._requests[rid].state == "ready" for rid in self._staging)
            if decoding and (i >= 1 or ready >= self.slots - decoding):
                return

    def _prefill_chunk(self) -> bool:
        """One prefill dispatch: the next chunk of up to R prefilling staging rows (first admitted first) ->
        whether there was any."""
        R, C = self.prefill_rows, self.prefill_chunk
        rows = np.full((R,), -1, np.int32)
        tokens = np.zeros((R, C), np.int32)
        counts = np.zeros((R,), np.int32)
        prefilling = sorted((self._requests[rid] for rid in self._staging
                             if rid is not None and self._requests[rid].state == "prefilling"), key=lambda r: r.id)
        chunked = []
        drafting = self.draft is not None
        draft_tokens, draft_counts, draft_written = np.zeros((R, C), np.int32), np.zeros((R,), np.int32), \
            np.zeros((R,), np.int32)
        nexts = np.full((R, C), -1, np.int32)
        for j, req in enumerate(prefilling[:R]):
            end = req.written + C
            if self._snapshotting:  # end on the last state-snapshot boundary the chunk reaches, if any
                boundaries = self.prefix_cache.snapshot_keys(req.prompt, req.written, min(end, len(req.prompt)))
                end = boundaries[-1][0] if boundaries else end
            chunk = req.prompt[req.written:end]
            rows[j], counts[j] = req.row, len(chunk)
            tokens[j, :len(chunk)] = chunk
            if drafting:  # the draft's chunk, from its own progress (it trails the target's after a prefix hit)
                chunk = req.prompt[req.draft_written:req.draft_written + C]
                draft_tokens[j, :len(chunk)], draft_counts[j], draft_written[j] = chunk, len(chunk), req.draft_written
            if self.mtp is not None:  # the token after each chunk token: the module's pairs (-1: the last's waits)
                after = req.prompt[req.written + 1:req.written + 1 + counts[j]]
                nexts[j, :len(after)] = after
            chunked.append((j, req))
        if not chunked:
            return False
        t0 = time.perf_counter()
        draft = {} if not drafting else dict(draft=(self.draft.params, draft_tokens, draft_counts, draft_written),
                                             draft_config=self.draft.config)
        if self.mtp is not None:
            draft = dict(mtp=(self.mtp.params[0], nexts), draft_config=self.mtp.config)
        self._state, free = programs.prefill(self._params, self._state, rows, tokens, counts, config=self._run_config,
                                             mesh=self.mesh, **draft)
        self._free = int(free)
        self._stats["prefill_s"] += time.perf_counter() - t0
        self._stats["prefill_dispatches"] += 1
        self._stats["prefill_tokens"] += int(counts.sum())
        self._stats["prefill_tokens_computed"] += R * C
        snapshots = []
        for j, req in chunked:
            done = req.written == len(req.prompt)
            if self._snapshotting:
                snapshots += [(req.row, key) for _, key in self.prefix_cache.snapshot_keys(
                    req.prompt, req.written, req.written + int(counts[j]))]
            req.written += int(counts[j])
            req.draft_written += int(draft_counts[j])
            if req.written == len(req.prompt) and not done and self.prefix_cache is not None:
                # its whole prompt pages stay cached for later requests
                table = np.asarray(self._state.cache.page_table[req.row])
                # With MTP, the whole pages of the prompt but its last token: the module's pair at the last
                # position waits for the first drawn token, so its page is written after the prefill and must not
                # be shared before (another request's read of it would depend on this one's draw).
                adopted = self.prefix_cache.adopt([req.prompt[:-1] if self.mtp is not None else req.prompt],
                                                  [table])
                if adopted:
                    self._state, free = programs.refs(self._state, padded(adopted, self.num_pages), np.int32(1),
                                                      mesh=self.mesh)
                    self._free = int(free)
            if req.written == len(req.prompt) and (not drafting or req.draft_written == len(req.prompt)):
                req.state = "ready"
        if snapshots:  # the rows' states at the boundaries their chunks ended on
            self.prefix_cache.take_snapshots(self._state.cache, snapshots)
        return True

    def _decode_dispatch(self) -> list[Event]:
        shifts = self._compact()
        moves, keys, sampler, stop_ids, budget, top = self._move_ready()
        if not any(rid is not None for rid in self._by_slot):
            return []
        grammar = self._grammar_moves([(slot, self._requests[self._by_slot[slot]])
                                       for slot in np.flatnonzero(moves >= 0)])
        high = max(slot for slot, rid in enumerate(self._by_slot) if rid is not None) + 1
        width = next(w for w in self.decode_widths if w >= high)
        t0 = time.perf_counter()
        moved = [self._requests[self._by_slot[slot]] for slot in np.flatnonzero(moves >= 0)]
        self._state, out, free, counts = self._decode(width, shifts, moves, keys, sampler, stop_ids, budget, top,
                                                      *self._prompts(moved), grammar=grammar)
        out = outputs.DecodeOut(*(np.asarray(x) for x in out))
        self._free = int(free)
        self._stats["decode_s"] += time.perf_counter() - t0
        self._stats["decode_dispatches"] += 1
        if self.speculation is not None:
            counted = dict(zip(speculative_program.COUNTERS, map(int, np.asarray(counts))))
            for name, value in counted.items():
                self._stats[name] += value
            self._stats["decode_steps"] += counted["target_forwards"]
            self._stats["decode_rows_computed"] += counted["target_forwards"] * width
        else:
            ran = int(np.sum(np.any(out.tokens >= 0, axis=1)))  # steps some slot decoded
            self._stats["decode_steps"] += ran
            self._stats["decode_rows_computed"] += ran * width
            self._stats["decode_rows_used"] += int(np.sum(out.tokens >= 0))
        events = []
        for slot, rid in enumerate(self._by_slot):
            req = self._requests.get(rid) if rid is not None else None
            if req is None:
                continue
            new, new_logp, new_top, fed = outputs.slot_tokens(out, slot, req.top)
            req.written += fed
            req.tokens += new
            if self.speculation is not None and new:  # its last token waits to be fed at its next pass
                req.written = len(req.prompt) + len(req.tokens) - 1
            req.logprobs += new_logp
            req.top_logprobs += new_top
            self._stats["generated_tokens"] += len(new)
            code = int(out.codes[:, slot].max())  # a slot finishes at most once per dispatch
            error = "the model's logits became NaN" if code == 3 else None
            if code and self._grammar is not None and slot in self._grammar.errors:  # (a bug if ever)
                code, error = FINISH_REASONS.index("error"), self._grammar.errors.pop(slot)
            elif code == FINISH_REASONS.index("length") and self._grammar is not None and self._grammar.finished[slot]:
                code = FINISH_REASONS.index("stop")  # its constraint complete, no room left for the stop token
            if code:
                self._finish(req, FINISH_REASONS[code], error, release=False)
            if new or code:
                events.append(self._notify(req, Event(req.id, new, new_logp, bool(code), FINISH_REASONS[code],
                                                      new_top if req.top else None)))
        return events

    @property
    def _history_width(self) -> int:
        return speculative_program.history_width(self.max_len, self._lookahead)

    def _prompts(self, moved):
        """With speculation, the n-gram proposer's history of each slot a request moves into (its prompt) ->
        (int32[S, H], int32[S]); without, nothing."""
        if self.speculation is None:
            return ()
        prompts = np.zeros((self.slots, self._history_width), np.int32)
        lengths = np.zeros((self.slots,), np.int32)
        for req in moved:
            prompts[req.row, :len(req.prompt)], lengths[req.row] = req.prompt, len(req.prompt)
        return prompts, lengths

    def _grammar_moves(self, moved):
        """The decode program's `grammar` for the requests moving into slots (`moved`: (slot, request) pairs):
        (int32[S, ceil(V / 32)] their first masks, bool[S] which are constrained); each slot's matcher set on the
        host. None for an engine without masks."""
        if self._grammar is None:
            return None
        allowed = np.full_like(self._grammar.mask, -1)
        constrained_in = np.zeros((self.slots,), bool)
        for slot, req in moved:
            allowed[slot] = self._grammar.start(slot, req.matcher, req.stop_ids)
            constrained_in[slot] = req.matcher is not None
        return allowed, constrained_in

    def _decode(self, width, shifts, moves, keys, sampler, stop_ids, budget, top, *prompts, grammar=None):
        """One decode dispatch (`programs.decode`, or with speculation `speculative.decode`) -> (state, outputs,
        free pages, the speculation counters or None)."""
        if self.speculation is None:
            state, out, free = programs.decode(self._params, self._state, shifts, moves, keys, sampler, stop_ids,
                                               budget, top, grammar, config=self._run_config, attention=self.attention,
                                               steps=self.steps_per_dispatch, width=width, mesh=self.mesh)
            return state, out, free, None
        draft = {} if self.draft is None else dict(draft_params=self.draft.params, draft_config=self.draft.config,
                                                   draft_attention=self._draft_attention)
        if self.mtp is not None:
            draft = dict(draft_params=self.mtp.params[0], draft_config=self.mtp.config,
                         draft_attention=self._draft_attention)
        return speculative_program.decode(self._params, self._state, shifts, moves, keys, sampler, stop_ids,
                                          budget, top, *prompts, grammar=grammar, config=self._run_config,
                                          attention=self.attention,
                                          steps=self.steps_per_dispatch, width=width, plan=self.speculation,
                                          mesh=self.mesh, **draft)

    def _compact(self) -> np.ndarray:
        """Requests decoding in slots at or past the width their number needs move down into the free slots below
        it (their page-table rows and per-slot state move on the device, `programs.decode`'s shift; no page is
        copied), so a request left in a high slot does not keep the decode width up after the others finished
        -> int32[S] shifts (slot s takes over slot shifts[s]; -1: none)."""
        shifts = np.full((self.slots,), -1, np.int32)
        live = [slot for slot, rid in enumerate(self._by_slot) if rid is not None]
        if live:
            need = next(w for w in self.decode_widths if w >= len(live))
            holes = [slot for slot in range(need) if self._by_slot[slot] is None]
            for dst, src in zip(holes, [slot for slot in reversed(live) if slot >= need]):
                shifts[dst] = src
                rid = self._by_slot[src]
                self._by_slot[dst], self._by_slot[src] = rid, None
                self._requests[rid].row = dst
                if self._grammar is not None:
                    self._grammar.move(dst, src)
                self._stats["slot_moves"] += 1
        return shifts

    def _move_ready(self):
        """Prefilled requests into the lowest free slots, in submission order -> the decode program's moves and
        the per-slot settings they bring (PRNG key, sampler, stop ids, budget, top alternatives)."""
        S = self.slots
        moves = np.full((S,), -1, np.int32)
        keys = np.zeros((S, *self._key_shape), np.uint32)
        settings = np.zeros((4, S), np.float32)
        stop_ids = np.full((S, STOP_SLOTS), -1, np.int32)
        budget = np.zeros((S,), np.int32)
        top = np.zeros((S,), np.int32)
        ready = sorted((self._requests[rid] for rid in self._staging
                        if rid is not None and self._requests[rid].state == "ready"), key=lambda r: r.id)
        for slot in range(S):
            if not ready:
                break
            if self._by_slot[slot] is None:
                req = ready.pop(0)
                moves[slot] = req.row - S
                self._staging[req.row - S] = None
                self._by_slot[slot] = req.id
                req.row, req.state = slot, "decoding"
                keys[slot], settings[:, slot], stop_ids[slot] = req.key, req.settings, req.stop_ids
                budget[slot], top[slot] = req.max_new_tokens, req.top
        sampler = Sampler(temperature=settings[0], top_k=settings[1].astype(np.int32), top_p=settings[2],
                          min_p=settings[3])
        return moves, keys, sampler, stop_ids, budget, top

    def _notify(self, req: Request, event: Event) -> Event:
        """The request's callback, if any, gets the event; if it raises, the request ends with "error" (its slot
        and pages freed) and the others are untouched -> the event as reported."""
        if req.callback is None:
            return event
        try:
            req.callback(event)
        except Exception as exc:
            error = f"callback raised {type(exc).__name__}: {exc}"
            if req.id in self._requests:
                self._finish(req, "error", error)
            else:  # it had just finished: its result records the failure
                self._results[req.id].finish_reason, self._results[req.id].error = "error", error
            return event._replace(finished=True, finish_reason="error")
        return event

    def _finish(self, req: Request, reason: str, error: str | None = None, *, release: bool = True):
        """Ends a request: frees its row (and, unless the decode step already did, its pages) -> its Result."""
        if req.row >= 0:
            if release:
                rows = np.zeros((self.slots + len(self._staging),), bool)
                rows[req.row] = True
                self._state, free = programs.release(self._state, rows, mesh=self.mesh)
                self._free = int(free)
            if req.row < self.slots:
                self._by_slot[req.row] = None
                if self._grammar is not None:
                    self._grammar.clear(req.row)
            else:
                self._staging[req.row - self.slots] = None
        elif req.id in self._waiting:
            self._waiting.remove(req.id)
        req.state, req.finish_reason, req.error, req.row = "finished", reason, error, -1
        del self._requests[req.id]
        text = None
        if self.model.tokenizer is not None:
            text = self.model.tokenizer.decode(req.tokens, skip_special_tokens=True)
        self._results[req.id] = Result(id=req.id, tokens=req.tokens, logprobs=req.logprobs,
                                       top_logprobs=req.top_logprobs if req.top else None, finish_reason=reason,
                                       prompt_tokens=len(req.prompt), cached_tokens=req.cached, text=text,
                                       error=error)
        self._stats["requests_finished"] += 1
