"""The continuous-batching engine: requests come and go through a fixed number of slots of one paged cache.

`jaxkv.generate` decodes a static batch: every row runs until the longest is done, and new work waits for the whole
batch. Here a request takes a slot when one is free, and gives it back (with its pages) the step it finishes, so
the slots stay busy while output lengths vary.

    engine = jaxkv.Engine(model, slots=16, max_len=1024)
    a = engine.submit(prompt_a, max_new_tokens=64)
    b = engine.submit(prompt_b, max_new_tokens=200, temperature=0.8, top_p=0.95, seed=1, logprobs=5)
    for event in engine.run():          # events as tokens come out
        print(event.id, event.tokens, event.finished, event.finish_reason)
    results = engine.results()          # or: engine.generate([prompt_a, prompt_b], max_new_tokens=64)

The device state (`programs.State`) is one pytree of fixed shape, threaded through five compiled programs
(`jaxkv/engine/programs.py`) and donated to each, so nothing recompiles once they are warm:

  admit     a request takes a staging row: its page-table row holds the pages of its cached prefix, if any
  prefill   one chunk of at most `prefill_chunk` prompt tokens for each of up to `prefill_rows` staging rows,
            attending over the pages written before it (as stored) and its own fresh K/V (`Decoder`'s `chunk`);
            a row whose prompt is complete keeps its last logits
  decode    moves complete prefills into free slots (a page-table row, and the request's PRNG key, sampling
            settings, stop ids, token budget), then `steps_per_dispatch` decode steps in a `lax.scan` over the
            first W slots, W the smallest of `decode_widths` (powers of two up to S) holding every decoding slot
            (requests take the lowest free slots, and requests left in high slots move down into free low ones
            first, so a lightly loaded engine computes a small batch): sample each decoding slot's next token
            (its own settings and key, so a request draws what it would draw alone), record its
            log-probability, feed it back; a slot that finishes releases its pages in the same step, and a step
            with no slot decoding skips the model (`lax.cond`)
  release   cancelled slots drop their pages
  refs      the prefix cache's index takes or drops its references on pages

The host scheduler (`Engine.step`) admits waiting requests in submission order into free staging rows (twice
`prefill_rows` of them) while the pool can hold their worst case (prompt + max_new_tokens, less the pages of a
cached prefix), evicting cached prefixes the running requests do not use when it must; runs one prefill chunk
(two when a free slot would otherwise stay empty, as many as it takes while nothing decodes); then one decode
dispatch. A long prompt delays the running requests by a chunk or two per dispatch, never by its whole prefill.

Why each request is independent of the batch it shares. Its rows of every matrix product, its own page-table row
and its own PRNG key (split once per token it draws, as `generate`'s loop splits its key) are all that its tokens
depend on: greedy tokens equal `jaxkv.generate` of the request alone, and sampled ones equal it too with the same
seed, up to float rounding of the differently shaped programs.

The package:

  scheduler.py  `Engine`: submit, cancel, run/step, results; admission, prefill rounds, decode dispatches (host)
  programs.py   the device state (`State`) and the five compiled programs over it
  outputs.py    `Event`, `Result`, and a decode dispatch's outputs read into each slot's tokens
  requests.py   `Request`, a submitted request as the host tracks it
  data_parallel.py  `DataParallelEngine`: what `Engine(mesh=)` is for a "data" axis above 1, an engine per shard

May import: `jaxkv.decoding` (the one decode step, request normalization, the forward pass), `jaxkv.cache`, the
model, `jaxkv.sampling`, `jaxkv.sharding`, `jaxkv.checks`. The server imports this package, never the reverse.
"""

from jaxkv.engine.data_parallel import DataParallelEngine, data_shards
from jaxkv.engine.outputs import Event, Result
from jaxkv.engine.scheduler import Engine

__all__ = ["DataParallelEngine", "Engine", "Event", "Result", "data_shards"]
