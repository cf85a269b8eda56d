"""The pieces a decoder layer is assembled from (`jaxkv.model.Decoder` picks them per layer by config). Shapes use
the letters of `jaxkv.shapes`.

Owns: `norms` (Norm), `rope` (rotary embeddings), `linear` (the initializer, `linear`, the weight-layout rule),
`mlp` (the dense FFN), `moe` (mixture of experts: router and experts), `gqa` (grouped-query attention: projections,
norms, cache writes), `mla` (multi-head latent attention), `per_layer` (Gemma 4's per-layer inputs).
May import: `jaxkv.config`, `jaxkv.attention` (through `jaxkv.attention.api`, the one dispatch), the caches,
`jaxkv.sharding` (gqa, mla: meshes), flax, jax. Never the decoder, the entry points or anything above.

This package is also the old module `jaxkv.layers` (norms, RoPE, projections, the MLP): its names are re-exported
here. The attention layers and the mixture of experts are not imported here, so that `jaxkv.sharding` (which
reads the weight layout from this package) stays below `jaxkv.attention.api` (which imports it).
"""

from __future__ import annotations

from jaxkv.layers.linear import (ALL_OUT_IN_ORDER, MLA_OUT_IN_ORDER, OUT_IN_ELEMENTS, OUT_IN_ORDER, fan_in_init,
                                 in_out_names, linear, mla_out_in, stored_out_in)
from jaxkv.layers.mlp import Mlp, activation
from jaxkv.layers.norms import Norm
from jaxkv.layers.rope import apply_rope, rope_angles, rope_inv_freq, yarn_attention_factor

__all__ = ["ALL_OUT_IN_ORDER", "MLA_OUT_IN_ORDER", "OUT_IN_ELEMENTS", "OUT_IN_ORDER", "fan_in_init", "in_out_names",
           "linear", "mla_out_in", "stored_out_in", "Mlp", "activation", "Norm", "apply_rope", "rope_angles",
           "rope_inv_freq", "yarn_attention_factor"]
