"""Constrained decoding: output held to a JSON schema, a regex, a choice of strings or a grammar.

  spec.py     the constraints (`JsonSchema`, `Regex`, `Choice`, `Grammar`), checked when made
  matcher.py  the host side: llguidance matchers per row, the packed masks they fill
  mask.py     the device side: the packed int32[B, ceil(V / 32)] mask applied to logits in the compiled step

How it runs in each decoding path, and why: docs/design/constrained.md.
"""

from jaxkv.constraints.spec import Choice, Constraint, Grammar, JsonSchema, Regex, per_row

__all__ = ["Choice", "Constraint", "Grammar", "JsonSchema", "Regex", "per_row"]
