"""Benchmarks: each scenario times jaxkv against what users would pick instead, side by side in one run, and prints
the figures and ratios measured (medians over repetitions).

  decode.py   decode against the memory roofline and transformers (`jaxkv bench`; its shared helpers: Progress,
              HFRunner, settle, decode_inputs)
  sharing.py  parallel samples and prompt caching (`jaxkv bench sharing`)
  engine.py   continuous batching against static batches (`jaxkv bench engine`)
  beam.py     beam search against transformers (`jaxkv bench beam`)
  mla.py      multi-head latent attention against its GQA twin (`jaxkv bench mla`)
  layers.py   per-layer rings against full-length caches (`jaxkv bench layers`)

The only package of jaxkv that may import torch or transformers (inside functions, so `jaxkv bench --help` and the
base install never need them). It imports the library; nothing in the library imports it.
"""
