"""Attention implementations, chosen by name. `reference` (plain XLA) is the spec the others are tested against.

"auto" picks the Pallas kernels on GPU and TPU and the XLA reference on CPU (where Pallas only interprets).
"""

from __future__ import annotations

import jax

from jaxkv.attention import reference

IMPLEMENTATIONS = {"xla": reference.attention}

try:  # Pallas ships with jaxlib; a build without it simply has no "pallas" implementation.
    from jaxkv.attention import pallas
except ImportError:  # pragma: no cover
    pass
else:
    IMPLEMENTATIONS["pallas"] = pallas.attention

NAMES = ("auto", "xla", "pallas")


def resolve(name: str) -> str:
    """The concrete implementation name for `name` ("auto" resolved for the default backend)."""
    if name not in NAMES:
        raise ValueError(f"unknown attention implementation {name!r}; choose one of {list(NAMES)}")
    if name == "auto":
        return "pallas" if jax.default_backend() in ("gpu", "tpu") and "pallas" in IMPLEMENTATIONS else "xla"
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {name!r} is not available in this build")
    return name


def get(name: str):
    """The attention function registered under `name` (see `resolve`)."""
    return IMPLEMENTATIONS[resolve(name)]
