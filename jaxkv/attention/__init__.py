"""Attention: the specifications (plain XLA), the Pallas kernels and the one dispatch over them (`api`).

Owns: `reference` (contiguous cache, the spec), `paged_reference` (paged cache, its XLA formulations),
`mla_reference` and `paged_mla` (multi-head latent attention over a contiguous / paged latent cache), one module per
Pallas kernel (`decode_kernel`, `prefill_kernel`, `paged_decode_kernel`, `mla_decode_kernel`; `pallas` their
entry points) and `api`: `api.get(kind, impl)` is what every layer calls ("auto" picks the Pallas kernels on GPU
and TPU, the XLA reference on CPU, and falls through to the reference where a kernel cannot serve a call).
May import: jax, `jaxkv.sharding` (api only, for the shard_map wrappers); nothing above the layers.

`IMPLEMENTATIONS`, `NAMES`, `resolve` and `get` are the contiguous kind's names of before the one dispatch, kept
for users: `get(name)` is `api.function("contiguous", name)`.
"""

from __future__ import annotations

import functools

from jaxkv.attention import api

IMPLEMENTATIONS = api.IMPLEMENTATIONS["contiguous"]  # the same dict: "xla", and "pallas" where Pallas is built
NAMES = api.NAMES
resolve = api.resolve  # resolve(name) -> the concrete name for the default backend (contiguous kind)
get = functools.partial(api.function, "contiguous")  # get(name) -> the attention function, no fall-through
