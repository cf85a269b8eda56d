"""Pallas attention: the public entry point, with the reference's signature plus tuning knobs.

`attention(q, k, v, start, q_offset, *, scale, sliding_window, k_scale, v_scale, ring, softcap, sinks)` computes what
`reference.attention` computes (for every query row with at least one live key; a row with none returns 0) and
dispatches on the shape:

  T <= MAX_DECODE_QUERIES  ->  `decode_kernel.decode_attention`: flash-decoding over the cache, reading only live
              K/V blocks (every block of a ring cache), dequantizing int8/fp8 blocks as they are read; T > 1 (a
              speculative verify's k + 1 queries) folds the T query positions into the kernel's rows, each masked
              by its own position, so each block is read once for all of them.
  T larger    ->  `prefill_kernel.prefill_attention`: causal flash attention, skipping masked key blocks. Quantized
              caches are supported; ring caches are not (NotImplementedError: the library's prefill attends over
              the fresh prompt K/V, and there is no Pallas path that quietly calls the XLA one).

`paged_attention(q, k_pages, v_pages, page_table, lengths, q_slots, *, ...)` computes what
`paged_reference.paged_attention` computes (without `fresh`), for up to MAX_DECODE_QUERIES queries per sequence,
with `paged_decode_kernel.paged_decode_attention`: only the live pages of each sequence are read.

`softcap` (Gemma 2's attention-logit soft-capping, `reference.soft_cap`) is a static float of every kernel's
configuration: each float32 score tile is capped in the kernel, before its mask.

`sinks` (gpt-oss's attention sinks: float32[N], one logit per query head in every softmax denominator, a traced
array; `reference`) are served by every kernel here: the decode kernels fold them into their split combine (the
sink as one more partial softmax state), the prefill kernel and the TPU paged body start each row's online softmax
from its sink. With sinks, a row with no live key returns 0 as the reference does. A wrong shape is a ValueError
before any compute; sinks=None runs the very kernels of before.

Per-layer windows (Gemma 2/3: sliding layers over a ring of `window` slots, global layers over the whole cache):
each layer calls with its own static `sliding_window` and `ring`. Decode takes every combination (a window or none,
a ring or not, a ring wrapped any number of times); prefill takes any window over the fresh prompt K/V, however
much longer than the window the prompt is (tests/attention/test_softcap.py, tests/attention/test_pallas.py).

Each kernel has two bodies sharing their math: Mosaic for TPU and Triton for GPU (`platform`). On CPU there is no
Pallas compiler, so the kernels run in the Pallas interpreter (`interpret` defaults to True there); the
interpreted kernel is the same program, which is what the CPU tests check against the reference.
"""

from __future__ import annotations

import jax

from jaxkv.attention import decode_kernel, paged_decode_kernel, prefill_kernel
from jaxkv.attention.reference import Unsupported, check_chunk, check_sinks

PLATFORMS = ("tpu", "gpu")
# The most queries per sequence the decode kernels take. They hold all T * G rows of a KV group (T queries times
# its G query heads) in one program: the [T * G, H] float32 accumulator and the [T * G, block] score tile sit in
# registers (GPU) or VMEM (TPU), and every row computes over the union of the rows' live blocks. A speculative
# verify has T = k + 1 (2..9 in practice); 16 covers it with G up to 8 in 128 rows. Past that, the prefill
# kernel's query tiles bound the rows per program and it skips the key blocks above each tile's diagonal.
MAX_DECODE_QUERIES = 16


def default_platform() -> str:
    """The kernel body for the default backend: "gpu" on GPUs, else "tpu" (on CPU either body interprets; the TPU
    one is the default there)."""
    return "gpu" if jax.default_backend() == "gpu" else "tpu"


def attention(q, k, v, start, q_offset, *, scale: float, sliding_window: int | None = None, k_scale=None,
              v_scale=None, ring: bool = False, interpret=None, platform: str | None = None,
              decode_block_k: int | None = None, decode_splits: int | None = None, prefill_block_q: int | None = None,
              prefill_block_k: int | None = None, softcap: float | None = None, sinks=None,
              chunk: int | None = None):
    """Softmax attention of T queries over S cached keys and values, as Pallas kernels.

    Args:
      q: [B, T, N, H] queries for slots [q_offset, q_offset + T).
      k, v: [B, K, S, H] keys and values, K dividing N; query head n reads KV head n // (N // K). Any float dtype
        (need not be q's), or int8 / float8_e4m3fn with scales.
      start: int32[B], each sequence's first live slot.
      q_offset: int32[], the slot of the first query.
      scale: multiplies q.k.
      sliding_window: if set, a query sees only the `sliding_window` most recent slots, itself included.
      k_scale, v_scale: float32[B, K, S] dequantization scales of an int8/fp8 cache, else None.
      ring: the cache is a ring buffer of S slots (`reference` module docstring); at most MAX_DECODE_QUERIES
        queries (the decode kernel: the reference's ring formula per query).
      interpret: run in the Pallas interpreter; None means "only on CPU". Any value `pl.pallas_call` accepts
        (e.g. `pltpu.InterpretParams()`) is passed through.
      platform: "tpu" (Mosaic) or "gpu" (Triton) kernel body; None picks the default backend's.
      decode_block_k, decode_splits: decode tile size (slots) and flash-decoding splits.
      prefill_block_q, prefill_block_k: prefill tile sizes.
      softcap: if set, each scaled score s becomes softcap * tanh(s / softcap) before masking (Gemma 2); None: off.
      sinks: float32[N], one logit per query head in the softmax denominator (gpt-oss; `reference`), or None.
      chunk: Llama 4's chunked attention (`reference`): served by the decode kernel (one more lower bound per
        query); the prefill kernel has no chunk mask, so a longer block with a chunk is `Unsupported` ("auto"
        falls through to the XLA reference).

    Returns:
      [B, T, N, H] in q's dtype.
    """
    sinks, chunk = check_sinks(sinks, q.shape[2]), check_chunk(chunk)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    platform = platform or default_platform()
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    cache = dict(k_scale=k_scale, v_scale=v_scale, softcap=softcap, sinks=sinks)
    if q.shape[1] <= MAX_DECODE_QUERIES:
        # A ring with T > 1 too: the kernel computes the reference's formula (each query's index-to-slot map over
        # the S indices as they are), which is right whenever the reference's is: when no query of the block
        # overwrote a slot an earlier one still sees (`reference` module docstring). The library never asks
        # (a ring cache refuses writes of more than one token after its prompt).
        return decode_kernel.decode_attention(q, k, v, start, q_offset, scale=scale, sliding_window=sliding_window,
                                              ring=ring, platform=platform, block_k=decode_block_k,
                                              splits=decode_splits, interpret=interpret, chunk=chunk, **cache)
    if chunk is not None:
        raise Unsupported(f"the Pallas prefill kernel has no chunk mask (chunk={chunk}); the XLA reference serves "
                          "a chunked prompt")
    if ring:
        # Past the decode kernel's rows the prefill kernel would have to serve it, and it has no ring layout; a
        # chunk that long over a full ring of S = window slots overwrites the oldest slots its earlier queries
        # still see, so the reference's ring formula is not the attention anyway (`reference` module docstring).
        raise Unsupported(f"Pallas attention over a ring cache takes at most {MAX_DECODE_QUERIES} queries per "
                          f"sequence (the decode kernel), got T={q.shape[1]}; prefill attends over the fresh "
                          "prompt K/V (ring=False)")
    return prefill_kernel.prefill_attention(q, k, v, start, q_offset, scale=scale, sliding_window=sliding_window,
                                            platform=platform, block_q=prefill_block_q,
                                            block_k=prefill_block_k, interpret=interpret, **cache)


def paged_attention(q, k_pages, v_pages, page_table, lengths, q_slots, *, scale: float,
                    sliding_window: int | None = None, k_scale=None, v_scale=None, interpret=None,
                    platform: str | None = None, pages_per_block: int | None = None, softcap: float | None = None,
                    fresh=None, sinks=None, chunk: int | None = None):
    """Softmax attention of a few queries per sequence over its pages, as a Pallas kernel.

    Args:
      q: [B, T, N, H], T <= MAX_DECODE_QUERIES (decode: 1; a speculative verify: k + 1); query t of sequence b
        sits in slot q_slots[b, t] and sees its sequence's written slots up to its own (within the window): the
        verify writes its K/V first and attends over the pages as stored.
      k_pages, v_pages: [P, K, page_size, H] pools (any float dtype, or int8 / float8_e4m3fn with scales).
      page_table: int32[B, M], each sequence's pages in slot order (-1: none).
      lengths: int32[B], slots written per sequence.
      q_slots: int32[B, T].
      scale, sliding_window, k_scale, v_scale, softcap: as `paged_reference.paged_attention`.
      interpret: run in the Pallas interpreter; None means "only on CPU".
      platform: "tpu" (Mosaic) or "gpu" (Triton) kernel body; None picks the default backend's.
      pages_per_block: pages per grid step (TPU) or loop iteration (GPU).
      fresh: `paged_reference.paged_attention`'s prompt-chunk argument; only None is served (else `Unsupported`).
      sinks: float32[N], one logit per query head in the softmax denominator (gpt-oss; `paged_reference`), or None.
      chunk: Llama 4's chunked attention, served by the kernel (one more lower bound per query).

    Returns:
      [B, T, N, H] in q's dtype; a query with no live slot gets 0.
    """
    sinks, chunk = check_sinks(sinks, q.shape[2]), check_chunk(chunk)
    if q.shape[1] > MAX_DECODE_QUERIES:
        raise Unsupported(f"Pallas paged attention takes at most {MAX_DECODE_QUERIES} queries per sequence (the "
                          f"decode kernel's rows; there is no paged prefill kernel), got T={q.shape[1]}")
    if fresh is not None:
        raise Unsupported("the Pallas paged kernel reads every slot as stored; a prompt chunk attending over its own "
                          "fresh K/V (`fresh`) is the XLA formulation's")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    platform = platform or default_platform()
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    return paged_decode_kernel.paged_decode_attention(q, k_pages, v_pages, page_table, lengths, scale=scale,
                                                      sliding_window=sliding_window, k_scale=k_scale,
                                                      v_scale=v_scale, q_slots=q_slots, platform=platform,
                                                      pages_per_block=pages_per_block, interpret=interpret,
                                                      softcap=softcap, sinks=sinks, chunk=chunk)
