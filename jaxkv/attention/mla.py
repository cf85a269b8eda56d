"""The old home of multi-head latent attention's spec and its dispatch by name, kept for users: the spec is now
`jaxkv.attention.mla_reference`, the dispatch `jaxkv.attention.api` (kind "latent")."""

from __future__ import annotations

import functools

from jaxkv.attention import api
from jaxkv.attention.mla_reference import attention, full_attention

__all__ = ["attention", "full_attention", "IMPLEMENTATIONS", "get"]

IMPLEMENTATIONS = api.IMPLEMENTATIONS["latent"]
get = functools.partial(api.function, "latent")  # get(name) -> the latent attention function, no fall-through
