"""The one legend of shape letters and logical axis names used across jaxkv.

Shape letters (docstrings, einsums and shape comments use these and nothing else):

  B  batch (sequences decoded together)
  T  tokens in this call (the padded prompt in prefill, 1 in a decode step)
  S  cache capacity in slots (`max_len`); a slot is one position of the fixed-shape cache
  N  query heads
  K  key/value heads
  G  query heads per KV head, N // K
  H  head dim
  D  model (residual) dim
  F  feed-forward hidden dim
  V  vocabulary
  L  layers
  P  pages (paged cache)
  W  beams per prompt (beam search)
  C  candidates per prompt ranked in one beam-search step
  R  latent width of multi-head latent attention (`kv_lora_rank`)
  E  rotary key width of multi-head latent attention (`qk_rope_head_dim`), shared by all heads
  M  token rows of a mixture of experts, B * T flattened
  X  routed experts
  A  experts chosen per token (`experts_per_token`)
  I  one routed expert's hidden width (`moe_ffn_dim`)
  J  the shared experts' hidden width, n_shared_experts * I (or the config's shared_expert_ffn_dim)
  Hk, Hv  a linear-attention (Gated DeltaNet) layer's key heads and value heads; Dk, Dv their head dims
  U  that layer's conv channels, 2 Hk Dk + Hv Dv (queries, keys and values side by side)
  Y  that layer's conv kernel width; its conv state holds the last Y - 1 inputs

Logical axis names name the same axes for sharding rules: a rule maps a logical name to a mesh axis, so sharding
over batch and KV heads never needs to know where those axes sit in a particular array.
"""

BATCH = "batch"
KV_HEADS = "kv_heads"
SEQUENCE = "sequence"
HEAD_DIM = "head_dim"

# Axis order of every cached key/value array: [B, K, S, H]. Batch and KV heads lead so that sharding either one
# splits the cache into contiguous per-device blocks, and each (sequence, KV head) row of S x H is contiguous, which
# is what a decode kernel streams.
KV_AXES = (BATCH, KV_HEADS, SEQUENCE, HEAD_DIM)
