"""Decoding: what every entry point that produces or scores tokens shares.

  step.py      the one decode step: the logit hook, sample or pick, NaN rows -> -1 and stop, stop ids,
               log-probabilities (`select`); beam search's scores through the same hook (`log_probs`)
  request.py   request normalization: prompts, stop ids, seeds, samplers, cache dtype, attention name, the
               left- and right-padded token layouts (every check a ValueError before any compute)
  programs.py  the compiled forward programs: a forward pass through a cache, the contiguous and paged prefills,
               one decode step
  loop.py      the compiled decode loop (`lax.while_loop` over `step.select` and a forward pass), its stream
  paged.py     `generate` on the paged cache (n samples forked from each prompt, a prefix cache)
  result.py    `Generation`, built from the loop's host arrays with its measured figures
  phase.py     timing a phase with compile time reported apart

The entry points over it: `jaxkv.generate` (generate, decode, prefill, decode_step, generate_pmap),
`jaxkv.beam_search`, `jaxkv.score` and `jaxkv.engine`. A new strategy (speculative verification, constraint
masks) plugs in at `step`.

May import: the model (`jaxkv.model`), `jaxkv.cache`, `jaxkv.attention` (names only), `jaxkv.sampling`,
`jaxkv.sharding`, `jaxkv.roofline`, `jaxkv.checks`, `jaxkv.config`. Never the entry points, the engine or the server.
"""
