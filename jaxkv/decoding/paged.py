"""`generate` on the paged cache (n > 1 samples per prompt, a page_size, a prefix cache): each prompt prefilled
once (after its cached prefix, with a `jaxkv.PrefixCache`), its n samples forked from it, then the same decode
loop as the contiguous path (`jaxkv.decoding.loop`)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import checks, sharding
from jaxkv.cache import planner as memory
from jaxkv.decoding import constrained, loop, processing, programs, request, result, speculation
from jaxkv.decoding.phase import Phase
from jaxkv.model import Model


def generate_paged(model: Model, prompts, *, n, page_size, max_new_tokens, temperature, top_k, top_p, min_p,
                   sampler, seed, stop_tokens, cache_dtype, attention, stream, prefix_cache=None,
                   max_len=None, logprobs=0, mesh=None, speculative=None, draft=None,
                   penalties=None, constraint=None) -> result.Generation:
    """`generate` on a paged cache: each prompt prefilled once (after its cached prefix, with a prefix cache),
    its n samples forked from it. With a mesh (data 1): weights Megatron-style over "model", the pools over KV
    heads, everything else on every device, as `jaxkv.Engine` runs on one. `speculative`: a checked
    `speculation.Plan` (no mesh): the speculative loop, each row verifying over its own pages (`draft`: the
    draft model of method "draft", with a contiguous cache of its own; method "mtp": the checkpoint's module
    over a paged pool of its own, forked as the target's rows). `penalties`: generate's penalty arguments
    ({name: value}, per prompt: each of its n samples counts its own output)."""
    config = model.config
    token_lists = request.token_lists(prompts, config.vocab_size, model.tokenizer)
    max_new_tokens = checks.check_int("max_new_tokens", max_new_tokens, 1)
    stop_ids, key = request.stop_ids(stop_tokens, config), request.prng_key(seed)
    cache_dtype = request.cache_dtype(config, cache_dtype)
    attention = request.attention(config, attention, paged=True)
    pages = memory.plan_pages(config, [len(p) for p in token_lists], max_new_tokens, n=n, page_size=page_size,
                              cache_dtype=cache_dtype, max_len=request.optional_int("max_len", max_len),
                              lookahead=0 if speculative is None else speculative.num_tokens)
    rows = pages.batch * n
    if sampler is None:  # per-prompt settings, repeated for each of the prompt's samples
        settings = checks.sampling(temperature, top_k, top_p, min_p, rows=pages.batch)
        temperature, top_k, top_p, min_p = ([v for v in settings[name] for _ in range(n)]
                                            if isinstance(settings[name], list) else settings[name]
                                            for name in ("temperature", "top_k", "top_p", "min_p"))
    sample_fn, sampler_rows = request.sampler_for(temperature, top_k, top_p, min_p, sampler, rows, pages.padded_rows)
    on_step = loop.step_stream(stream, rows, "row_index")
    grammar_rows = constrained.rows_for(model, constraint, len(token_lists), rows=pages.padded_rows,
                                        stop_ids=stop_ids, repeat=n)
    if prefix_cache is not None:
        prefix_cache.check(model, cache_dtype, page_size, mesh)
    params, run_config = (model.params, config) if mesh is None else sharding.sharded_weights(model.params, config,
                                                                                              mesh)
    parents = np.full((pages.padded_rows,), -1, np.int32)
    parents[:rows] = np.repeat(np.arange(pages.batch), n)
    done = np.arange(pages.padded_rows) >= rows
    row_prompts = [token_lists[p] for p in parents[:rows]]
    row_penalties = processing.settings(**(penalties or {}), rows=pages.batch, padded=pages.padded_rows,
                                        vocab_size=config.vocab_size, max_new_tokens=max_new_tokens, repeat=n)
    draft_args, draft_kwargs = (), {}
    if draft is not None:  # (before the prefix cache's transaction: it checks the draft before any compute)
        draft_args = (draft.params, speculation.prefill_draft(draft, row_prompts, rows=pages.padded_rows,
                                                              max_new_tokens=max_new_tokens,
                                                              lookahead=speculative.num_tokens,
                                                              attention=attention))
        draft_kwargs = {"draft_config": draft.config}
    # A call that fails at any point (a refused make_room, a sampler or stream that raises half way) leaves the
    # prefix cache's index and pool as it found them.
    with prefix_cache.transaction() if prefix_cache is not None else contextlib.nullcontext():
        with Phase() as prefill_time:
            logits, cache, hit, tokens = _prefill(params, token_lists, parents, pages, prefix_cache,
                                                  config=run_config, attention=attention, page_size=page_size,
                                                  cache_dtype=cache_dtype, mesh=mesh)
        if speculative is not None and speculative.method == "mtp":
            # The module's own pool (`programs.prefill_mtp_paged`): a pair's K/V depends on the token after it,
            # so it cannot live in the target's shared pages. One more page per row than the target's plan: the
            # module's partly filled last page at a fork is one slot behind the target's.
            full, full_positions = request.right_pad(
                token_lists, rows=pages.prefill_batch,
                length=max(memory.MIN_PROMPT_BUCKET, memory.next_pow2(max(map(len, token_lists)))))
            draft_args = (model.mtp.params[0], programs.prefill_mtp_paged(
                params, model.mtp.params[0], jax.device_put(full), jax.device_put(full_positions),
                jax.device_put(parents), config=run_config, attention=attention,
                num_pages=pages.num_pages + pages.padded_rows, page_size=page_size, max_pages=pages.max_pages,
                cache_dtype=cache_dtype, mtp_config=model.mtp.config))
            draft_kwargs = {"draft_config": model.mtp.config}
        max_steps = loop.steps_bound(cache.capacity, False, max_new_tokens)
        with Phase() as decode_time, constrained.carried(grammar_rows) as grammar:
            if speculative is None:
                state = processing.Fresh(row_penalties, processing.prompt_ids(row_prompts, pages.padded_rows,
                                                                              cache.capacity))
                out = loop.on_host(loop.run(
                    params, cache, logits, jax.device_put(key), sample_fn, jax.device_put(stop_ids),
                    jax.device_put(done), jax.device_put(np.int32(max_new_tokens)), state, grammar=grammar,
                    config=run_config,
                    max_steps=max_steps, rows=sampler_rows, attention=attention, stream=on_step, mesh=mesh,
                    logprobs=logprobs))
            else:
                history, length = speculation.prompt_history(row_prompts, pages.padded_rows,
                                                             cache.capacity + speculative.num_tokens + 2)
                out = loop.on_host_surfacing(on_step, lambda: loop.on_host(loop.speculative_loop(
                    params, cache, logits, jax.device_put(key), sample_fn, jax.device_put(stop_ids),
                    jax.device_put(done), np.int32(max_new_tokens), history, length, *draft_args, grammar=grammar,
                    config=run_config, max_steps=max_steps, attention=attention, stream=on_step,
                    logprobs=logprobs, plan=speculative, **draft_kwargs)))
        overflowed = bool(np.asarray(out.cache.overflowed).any())
        peak = int(out.cache.pages_in_use())  # nothing is freed while decoding, so the end is the peak
        if prefix_cache is not None:
            prefix_cache.store(out.cache)  # the rows' pages released; the prefixes' stay cached
    if overflowed:  # the plan sizes the pool for the whole call: a bug if this happens
        raise RuntimeError("the paged pool ran out of pages; the plan should have prevented it")
    plan = memory.CachePlan(batch=rows, padded_batch=pages.padded_rows, prompt_len=tokens.shape[1],
                            capacity=pages.max_pages * page_size, ring=False, cache_dtype=cache_dtype,
                            requested_bytes=pages.requested_bytes, allocated_bytes=pages.allocated_bytes)
    req = result.Request(token_lists=[p for p in token_lists for _ in range(n)], max_new_tokens=max_new_tokens,
                         sampler=sample_fn, rows=sampler_rows, stop_ids=stop_ids, key=key, attention=attention,
                         plan=plan, tokens=tokens, start=np.zeros((pages.prefill_batch,), np.int32), done=done)
    gen = result.generation(model, req, out, prefill_time, decode_time)
    constrained.report(grammar_rows, gen, rows, "row")
    gen.stats.update(_pool_stats(config, token_lists, n, page_size, cache_dtype, pages, prefix_cache, peak, hit))
    return gen


def _prefill(params, token_lists, parents, pages, prefix_cache, *, config, attention, page_size, cache_dtype,
             mesh):
    """Each prompt into the pool once (after its cached prefix, with a prefix cache, which remembers the new
    prompts' pages), its rows forked by `parents` -> (float32[R, V] logits, the cache, the tokens each prompt
    found cached, the right-padded prompt tokens)."""
    hits = [[] for _ in token_lists]  # cached pages of each prompt's prefix
    snapshots = np.full((pages.prefill_batch,), -1, np.int32)  # a hybrid model's: the state each hit resumes
    if prefix_cache is not None:
        matched = [prefix_cache.match_with_state(p) for p in token_lists]
        hits = [pages for pages, _ in matched]
        snapshots[:len(matched)] = [slot for _, slot in matched]
        # The pages this call adds: everything the plan counts but the prefix pages it reuses.
        prefix_cache.make_room(pages.pages_needed - sum(map(len, hits)), keep={p for h in hits for p in h})
        # Host-tier blocks continuing a device match come back into free pages (pages the prompt needs anyway)
        hits = [prefix_cache.fetch(p, h) for p, h in zip(token_lists, hits)]
    hit = [len(h) * page_size for h in hits]  # tokens found in the cache
    T = max(memory.MIN_PROMPT_BUCKET, memory.next_pow2(max(len(p) - h for p, h in zip(token_lists, hit))))
    tokens, positions = request.right_pad(token_lists, rows=pages.prefill_batch, length=T, cached=hit)
    if prefix_cache is None:
        logits, cache = programs.prefill_paged(params, jax.device_put(tokens), jax.device_put(positions),
                                               jax.device_put(parents), config=config, attention=attention,
                                               num_pages=pages.num_pages, page_size=page_size,
                                               max_pages=pages.max_pages, cache_dtype=cache_dtype, mesh=mesh)
    else:
        table = np.full((pages.prefill_batch, pages.max_pages), -1, np.int32)
        for b, h in enumerate(hits):
            table[b, :len(h)] = h
        lengths = np.zeros((pages.prefill_batch,), np.int32)
        lengths[:len(hit)] = hit
        if prefix_cache.hybrid:
            logits, prefilled, cache = _prefill_snapshotting(params, token_lists, hit, parents, prefix_cache,
                                                             prefix_cache.cache(table, lengths, snapshots),
                                                             config=config, attention=attention)
        else:
            logits, prefilled, cache = programs.prefill_suffix(
                params, jax.device_put(tokens), jax.device_put(positions), prefix_cache.cache(table, lengths),
                jax.device_put(parents), config=config, attention=attention, mesh=mesh)
        cache = prefix_cache.remember(token_lists, np.asarray(prefilled), cache)
    logits.block_until_ready()
    return logits, cache, hit, tokens


def _prefill_snapshotting(params, token_lists, hit, parents, prefix_cache, cache, *, config, attention):
    """A hybrid model's prefill after its prefix-cache hits (each row resuming at `hit[b]`, a snapshot boundary,
    from that snapshot's state): the prompts in chunks of the snapshot interval, each chunk ending on a boundary,
    where the rows' states are snapshotted (`PrefixCache.take_snapshots`) -> (float32[R, V] logits of the rows
    forked by `parents`, the prefilled page table, the forked cache)."""
    interval = prefix_cache.snapshot_interval
    B = cache.batch
    logits = None
    for c in range(-(-max(len(p) - h for p, h in zip(token_lists, hit)) // interval)):
        starts = [h + c * interval for h in hit]
        tokens = np.zeros((B, interval), np.int32)
        positions = np.full((B, interval), -1, np.int32)
        for b, (p, start) in enumerate(zip(token_lists, starts)):
            chunk = p[start:start + interval]
            tokens[b, :len(chunk)], positions[b, :len(chunk)] = chunk, np.arange(start, start + len(chunk))
        chunk_logits, cache = programs.prefill_chunk(params, jax.device_put(tokens), jax.device_put(positions),
                                                     cache, config=config, attention=attention)
        ends = np.zeros((B,), bool)  # rows whose last prompt token is in this chunk: their logits are final
        ends[:len(token_lists)] = [start < len(p) <= start + interval for p, start in zip(token_lists, starts)]
        logits = chunk_logits if logits is None else jnp.where(jnp.asarray(ends)[:, None], chunk_logits, logits)
        prefix_cache.take_snapshots(cache, [(b, key) for b, (p, start) in enumerate(zip(token_lists, starts))
                                            for _, key in prefix_cache.snapshot_keys(p, start, min(len(p),
                                                                                                   start + interval))])
    prefilled = cache.page_table
    return logits[jnp.maximum(jnp.asarray(parents), 0)], prefilled, programs.fork(cache, jax.device_put(parents))


def _pool_stats(config, token_lists, n, page_size, cache_dtype, pages, prefix_cache, peak, hit) -> dict:
    """What a paged call adds to `Generation.stats`: the pool, its peak, the prefix cache's hits."""
    stats = {
        "prompt_tokens": int(sum(len(p) for p in token_lists)),  # each prompt once, not once per sample
        "n": n, "page_size": page_size,
        "num_pages": pages.num_pages if prefix_cache is None else prefix_cache.num_pages,
        # Pages held at the end (with a prefix cache: also the cached prefixes that other calls left).
        # (and a hybrid model's states: one per row, never shared)
        "pages_in_use_peak": peak, "kv_bytes_in_use_peak": peak * memory.page_bytes(config, page_size, cache_dtype)
        + len(token_lists) * n * memory.state_bytes_per_sequence(config),
        # What batch x n private contiguous sequences of prompt + max_new_tokens tokens would need.
        "kv_cache_bytes_unshared": pages.unshared_bytes,
        "prefix_hit_tokens": int(sum(hit)),
        "prefilled_tokens": int(sum(len(p) for p in token_lists) - sum(hit)),
    }
    if prefix_cache is not None:
        stats["kv_cache_bytes"] = prefix_cache.nbytes()
    return stats
