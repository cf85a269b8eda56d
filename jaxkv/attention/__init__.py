"""Attention implementations, chosen by name. `reference` (plain XLA) is the spec the others are tested against."""

from __future__ import annotations

from jaxkv.attention import reference

IMPLEMENTATIONS = {"xla": reference.attention}


def get(name: str):
    """The attention function registered under `name`."""
    try:
        return IMPLEMENTATIONS[name]
    except KeyError:
        raise ValueError(f"unknown attention implementation {name!r}; choose one of {sorted(IMPLEMENTATIONS)}") \
            from None
