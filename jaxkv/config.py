"""The model config: one frozen, hashable dataclass for a decoder-only transformer.

The config is a static argument of every jitted function, so it must be hashable and immutable; every field is a
plain Python value (tuples, not lists). It is validated on construction so a bad value fails with a clear message
before any array is allocated. The RoPE scalings it may hold are `jaxkv.rope_scaling`'s (re-exported here).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from jaxkv.rope_scaling import LinearScaling, ProportionalRope, RopeScaling, YarnScaling, yarn_mscale

FfnKind = Literal["swiglu", "geglu", "gelu"]
NormKind = Literal["rmsnorm", "gemma_rmsnorm", "rmsnorm_f32", "layernorm"]
NORM_KINDS = ("rmsnorm", "gemma_rmsnorm", "rmsnorm_f32", "layernorm")
LayerType = Literal["full_attention", "sliding_attention", "chunked_attention", "linear_attention"]
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention")
PositionKind = Literal["rope", "learned"]
MoeScoring = Literal["softmax", "sigmoid", "topk_softmax", "topk_sigmoid"]
MoeTopkMethod = Literal["greedy", "group_limited_greedy", "noaux_tc"]

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLS = ("auto", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class SparseIndexer:
    """DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention): per token and layer one small key of
    `head_dim` is cached beside the MLA latent row, and each query attends only to the `topk` cached slots the
    indexer scores highest (`jaxkv.attention.indexer`). Letters as in `jaxkv.shapes`.

    Attributes:
      n_heads: the indexer's query heads (index_n_heads), each weighted per token by a learned projection.
      head_dim: the indexer's query / key width (index_head_dim); its first qk_rope_head_dim columns are rotated.
      topk: slots each query attends to (index_topk); a query with fewer live slots attends to them all.
      key_dtype: the cache dtype of the indexer keys: None, the cache's own (what transformers computes with);
        "float8_e4m3fn" stores them as DeepSeek's release does (one float32 scale per key), beside latent rows of
        any cache dtype. One of the cache dtypes (`jaxkv.cache.CACHE_DTYPES`).
    """

    n_heads: int = 64
    head_dim: int = 128
    topk: int = 2048
    key_dtype: str | None = None

    def __post_init__(self):
        for name in ("n_heads", "head_dim", "topk"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                   f"mla.indexer.{name} must be a positive integer, got {value!r}")
        # The cache dtypes' names (`jaxkv.cache.dtypes`, which imports this module's package's cache: not here)
        _check(self.key_dtype in (None, "float32", "bfloat16", "float16", "int8", "float8_e4m3fn"),
               f"mla.indexer.key_dtype must be None or a cache dtype name, got {self.key_dtype!r}")


@dataclasses.dataclass(frozen=True)
class Mla:
    """Multi-head latent attention (DeepSeek-V2/V3). Letters as in `jaxkv.shapes`.

    Attributes:
      kv_lora_rank: R, the latent width: per token and layer the cache holds the normalized latent (R) and the
        rotated key every head shares (E = qk_rope_head_dim), one row of R + E.
      qk_nope_head_dim: per-head query/key width without positions (up-projected from the latent).
      qk_rope_head_dim: E, per-head query/key width with rotary positions.
      v_head_dim: per-head value width.
      q_lora_rank: the query's low-rank width (q = W_qb norm(W_qa x)); None projects the query directly.
      latent_norm_eps: epsilon of the q and kv latent RMSNorms (transformers fixes it at 1e-6, whatever
        rms_norm_eps says).
      indexer: DeepSeek-V3.2's sparse-attention indexer (its keys are cached as the latent cache's values), or
        None: every query attends to every live slot.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    latent_norm_eps: float = 1e-6
    indexer: SparseIndexer | None = None

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                   f"mla.{name} must be a positive integer, got {value!r}")
        _check(self.q_lora_rank is None or (isinstance(self.q_lora_rank, int) and not isinstance(
            self.q_lora_rank, bool) and self.q_lora_rank >= 1),
               f"mla.q_lora_rank must be None or a positive integer, got {self.q_lora_rank!r}")
        _check(self.qk_rope_head_dim % 2 == 0, f"RoPE needs an even mla.qk_rope_head_dim, got {self.qk_rope_head_dim}")
        _check(self.latent_norm_eps > 0 and math.isfinite(self.latent_norm_eps),
               f"mla.latent_norm_eps must be > 0, got {self.latent_norm_eps}")
        if self.indexer is not None:
            _check(isinstance(self.indexer, SparseIndexer),
                   f"mla.indexer must be a SparseIndexer or None, got {type(self.indexer).__name__}")
            # The indexer's query is projected from the query's low-rank latent and rotates its first E columns.
            _check(self.q_lora_rank is not None, "mla.indexer needs mla.q_lora_rank (its query reads the q latent)")
            _check(self.indexer.head_dim >= self.qk_rope_head_dim,
                   f"mla.indexer.head_dim ({self.indexer.head_dim}) must be >= qk_rope_head_dim "
                   f"({self.qk_rope_head_dim}): its first qk_rope_head_dim columns are rotated")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def row_dim(self) -> int:
        """R + E: the width of one cached row."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet token mixing (Qwen3-Next, Qwen3.5: `jaxkv.layers.gated_delta`), the "linear_attention"
    layers of `Config.layer_types`. Such a layer caches no keys or values: per sequence it carries a fixed-size
    state, the last conv_kernel - 1 inputs of its causal conv ([C, W - 1] in the model dtype) and the delta-rule
    state (float32 [Hv, Dk, Dv]), whatever the length. Letters as in `jaxkv.shapes`.

    Attributes:
      key_heads: Hk, query/key heads (HF `linear_num_key_heads`).
      value_heads: Hv, value heads, a multiple of Hk (each key head serves Hv // Hk value heads).
      key_head_dim: Dk. value_head_dim: Dv.
      conv_kernel: W, the causal depthwise conv's width over the q/k/v channels (HF `linear_conv_kernel_dim`).
      chunk: the chunk length of the prefill's parallel form (`jaxkv.layers.delta_rule.chunked`).
    """

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    chunk: int = 64

    def __post_init__(self):
        for name in ("key_heads", "value_heads", "key_head_dim", "value_head_dim", "conv_kernel", "chunk"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                   f"linear_attention.{name} must be a positive integer, got {value!r}")
        _check(self.conv_kernel >= 2, f"linear_attention.conv_kernel must be >= 2, got {self.conv_kernel}")
        _check(self.value_heads % self.key_heads == 0,
               f"linear_attention.value_heads ({self.value_heads}) must be a multiple of key_heads "
               f"({self.key_heads})")

    @property
    def conv_dim(self) -> int:
        """C, the conv's channels: queries, keys and values side by side (2 Hk Dk + Hv Dv)."""
        return 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim

    def state_bytes(self, dtype: str) -> int:
        """One layer's state per sequence: the conv window in `dtype` (the model's) and the float32 delta-rule
        state."""
        conv = self.conv_dim * (self.conv_kernel - 1) * (4 if dtype == "float32" else 2)
        return conv + 4 * self.value_heads * self.key_head_dim * self.value_head_dim

    def param_count(self, d_model: int) -> int:
        """One layer: the q/k/v, z, b and a projections, the conv, A_log and dt_bias, the gated norm, out."""
        D, Hv, Dv = d_model, self.value_heads, self.value_head_dim
        return (D * self.conv_dim + D * Hv * Dv + 2 * D * Hv + self.conv_dim * self.conv_kernel + 2 * Hv
                + Dv + Hv * Dv * D)


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A mixture of experts (DeepSeek-V2 / V3, Qwen3-MoE, Mixtral; `jaxkv.layers.moe`); letters as in `jaxkv.shapes`.

    Attributes:
      n_routed_experts: X.
      experts_per_token: A (HF `num_experts_per_tok`).
      moe_ffn_dim: I, one expert's hidden width (HF `moe_intermediate_size`).
      n_shared_experts: experts every token uses, run as one SwiGLU of width n_shared_experts * I (0: none).
      first_dense_layers: layers [0, first_dense_layers) keep the dense MLP (HF `first_k_dense_replace`).
      dense_layers: further layers, anywhere, that keep the dense MLP (Qwen3-MoE's `mlp_only_layers` and the
        layers `decoder_sparse_step` skips); sorted, no repeats.
      scoring: "softmax" (V2) or "sigmoid" (V3) of the float32 router logits, or "topk_softmax" (gpt-oss): the A
        largest logits chosen, their softmax the weights ("greedy" only), or "topk_sigmoid" (Llama 4): the A largest
        logits chosen, their sigmoid the weights.
      topk_method: "greedy" (the A best scores), "group_limited_greedy" (V2: experts in n_group groups, a group
        scored by its best expert, only the topk_group best groups eligible) or "noaux_tc" (V3: the choice uses
        the scores plus a per-expert correction bias, a group scored by the sum of its two best; the weights are
        the uncorrected scores).
      n_group, topk_group: the groups of the group-limited methods (1 and 1 for "greedy").
      routed_scaling_factor: multiplies the routing weights (after normalization).
      norm_topk_prob: divide the A weights by their sum (+ 1e-20) before scaling. transformers 5.24 applies this
        for V3 only; its V2 router ignores the flag (`config_from_hf` maps V2 to False accordingly).
      router_logit_bias: the router's logits have a learned bias, float32[X] (gpt-oss's router.bias).
      expert_bias: each routed expert's gate, up and down projections have biases (gpt-oss).
      swiglu_limit: None (each expert is down(silu(gate x) * up x)) or gpt-oss's clamped SwiGLU: g = min(gate x,
        limit), u = clip(up x, -limit, limit), down((u + 1) * g * sigmoid(swiglu_alpha * g)).
      swiglu_alpha: the sigmoid's gain in the clamped SwiGLU (gpt-oss: 1.702).
      scale_expert_input: the routing weight multiplies each chosen expert's input, and its output is summed as is
        (Llama 4); otherwise (every other family) the weight multiplies the expert's output.
    """

    n_routed_experts: int
    experts_per_token: int
    moe_ffn_dim: int
    n_shared_experts: int = 0
    # Qwen3-Next / Qwen3.5: one shared expert of its own width (HF shared_expert_intermediate_size; overrides
    # n_shared_experts * moe_ffn_dim), its output times sigmoid(w . x) when shared_expert_gate.
    shared_expert_ffn_dim: int | None = None
    shared_expert_gate: bool = False
    first_dense_layers: int = 0
    dense_layers: tuple[int, ...] = ()
    scoring: MoeScoring = "softmax"
    topk_method: MoeTopkMethod = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    router_logit_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    scale_expert_input: bool = False

    def __post_init__(self):
        for name in ("n_routed_experts", "experts_per_token", "moe_ffn_dim", "n_group", "topk_group"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                   f"moe.{name} must be an integer >= 1, got {value!r}")
        _check(self.shared_expert_ffn_dim is None or (isinstance(self.shared_expert_ffn_dim, int) and not isinstance(
            self.shared_expert_ffn_dim, bool) and self.shared_expert_ffn_dim >= 1),
               f"moe.shared_expert_ffn_dim must be None or a positive integer, got {self.shared_expert_ffn_dim!r}")
        _check(isinstance(self.shared_expert_gate, bool) and (not self.shared_expert_gate or self.shared_ffn_dim),
               "moe.shared_expert_gate needs a shared expert (shared_expert_ffn_dim or n_shared_experts)")
        for name in ("n_shared_experts", "first_dense_layers"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                   f"moe.{name} must be an integer >= 0, got {value!r}")
        _check(isinstance(self.dense_layers, tuple) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.dense_layers)
               and list(self.dense_layers) == sorted(set(self.dense_layers)),
               f"moe.dense_layers must be a sorted tuple of distinct layer indices, got {self.dense_layers!r}")
        X, A = self.n_routed_experts, self.experts_per_token
        _check(A <= X, f"moe.experts_per_token ({A}) exceeds moe.n_routed_experts ({X})")
        _check(self.scoring in ("softmax", "sigmoid", "topk_softmax", "topk_sigmoid"),
               f"moe.scoring must be 'softmax', 'sigmoid', 'topk_softmax' or 'topk_sigmoid', got {self.scoring!r}")
        _check(not self.scoring.startswith("topk_") or self.topk_method == "greedy",
               f"moe.scoring {self.scoring!r} chooses the best logits: topk_method must be 'greedy', got "
               f"{self.topk_method!r}")
        _check(not (self.scale_expert_input and self.expert_bias),
               "moe.scale_expert_input needs experts without biases (a scaled-away expert must give zero)")
        for name in ("router_logit_bias", "expert_bias", "scale_expert_input"):
            _check(isinstance(getattr(self, name), bool), f"moe.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("swiglu_limit", "swiglu_alpha"):
            value = getattr(self, name)
            _check((value is None and name == "swiglu_limit") or (
                isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0),
                   f"moe.{name} must be {'None or ' if name == 'swiglu_limit' else ''}a finite number > 0, got "
                   f"{value!r}")
        _check(self.topk_method in ("greedy", "group_limited_greedy", "noaux_tc"),
               f"moe.topk_method must be 'greedy', 'group_limited_greedy' or 'noaux_tc', got {self.topk_method!r}")
        _check(isinstance(self.routed_scaling_factor, (int, float)) and math.isfinite(self.routed_scaling_factor)
               and self.routed_scaling_factor > 0,
               f"moe.routed_scaling_factor must be a finite number > 0, got {self.routed_scaling_factor!r}")
        _check(isinstance(self.norm_topk_prob, bool), f"moe.norm_topk_prob must be a bool, got "
                                                      f"{self.norm_topk_prob!r}")
        if self.topk_method == "greedy":
            _check(self.n_group == 1 and self.topk_group == 1,
                   f"moe.topk_method 'greedy' has no groups: n_group and topk_group must be 1, got "
                   f"{self.n_group} and {self.topk_group}")
            return
        G, Gk = self.n_group, self.topk_group
        _check(X % G == 0, f"moe.n_routed_experts ({X}) must be a multiple of moe.n_group ({G})")
        _check(Gk <= G, f"moe.topk_group ({Gk}) exceeds moe.n_group ({G})")
        # Fewer eligible experts than A would make top-k pick masked ones (score 0 or -inf): ties, routed
        # arbitrarily. Refused rather than reproduced.
        _check(Gk * (X // G) >= A, f"moe.topk_group ({Gk}) groups of {X // G} experts hold fewer than "
                                   f"experts_per_token ({A})")
        if self.topk_method == "noaux_tc":
            _check(X // G >= 2, f"moe.topk_method 'noaux_tc' scores a group by its two best experts: groups of "
                                f"{X // G} expert(s) (n_routed_experts {X}, n_group {G}) are too small")

    @property
    def shared_ffn_dim(self) -> int:
        """J, the shared experts' hidden width."""
        if self.shared_expert_ffn_dim is not None:
            return self.shared_expert_ffn_dim
        return self.n_shared_experts * self.moe_ffn_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_dense_layers and layer not in self.dense_layers

    def param_count(self, d_model: int) -> int:
        """One MoE layer's parameters: router (+ correction or logit bias), X experts (+ their biases) and the shared
        experts."""
        X, D, I = self.n_routed_experts, d_model, self.moe_ffn_dim
        router = X * D + (X if self.topk_method == "noaux_tc" else 0) + (X if self.router_logit_bias else 0)
        return (router + 3 * D * I * X + (X * (2 * I + D) if self.expert_bias else 0) + 3 * D * self.shared_ffn_dim
                + (D if self.shared_expert_gate else 0))


@dataclasses.dataclass(frozen=True)
class Config:
    """A decoder-only transformer.

    Attributes:
      vocab_size: V, number of token ids.
      d_model: D, width of the residual stream.
      n_layers: L.
      n_heads: N, query heads.
      n_kv_heads: K, key/value heads. N == K is MHA, K == 1 is MQA, anything between that divides N is GQA.
      head_dim: H; defaults to d_model // n_heads but may differ (then the attention width N*H != D).
      ffn_dim: F, hidden width of the feed-forward block.
      ffn_kind: "swiglu" (Llama family: down(silu(gate x) * up x)), "geglu" (Gemma: down(gelu_tanh(gate x) *
        up x)) or "gelu" (GPT-2: proj(gelu_tanh(fc x))).
      norm_kind: "rmsnorm" (x / rms(x) cast back, then times w), "gemma_rmsnorm" (Gemma 2/3: in float32 times
        (1 + w), then cast back; w is stored as the checkpoint holds it, zero-centred), "rmsnorm_f32" (Gemma 4: in
        float32 times w, then cast back) or "layernorm"; norm_eps its epsilon. The q/k norms (`qk_norm`) follow the
        same kind.
      positions: "rope" (rotary, `rope_theta`, optional `rope_scaling`) or "learned" (an absolute position table
        of `max_positions` rows).
      qkv_bias: bias on the q, k and v projections (Qwen2, GPT-2). out_bias / mlp_bias: on the attention output
        projection / the FFN linears (GPT-2).
      tie_embeddings: the output head reuses the token embedding.
      max_positions: the largest position id + 1 the model supports.
      sliding_window: if set, a token attends only to the `sliding_window` most recent tokens, itself included:
        on every layer, or with `layer_types` on the "sliding_attention" layers only.
      attention_chunk_size: the chunk of the "chunked_attention" layers (Llama 4): positions are cut into chunks of
        this many tokens and a query attends only to the earlier tokens of its own chunk; such a layer's cache is a
        ring of the chunk (`layer_chunk`, `layer_span`).
      nope_layers: layers without rotary positions (Llama 4's NoPE layers, no_rope_layers 0).
      qk_l2_norm: a weightless RMS norm (eps norm_eps, in float32) over each query and key head after the rotation,
        on the rotary layers only (Llama 4's use_qk_norm).
      attn_temperature: (floor_scale, attn_scale): the NoPE layers' queries at position p are scaled by
        log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 (Llama 4's attn_temperature_tuning); None: off.
      layer_types: per layer "full_attention", "sliding_attention", "chunked_attention" or (with `linear_attention`)
        "linear_attention" (Hugging Face's `layer_types`), or None (every layer sliding when sliding_window is
        set, else full). Each layer's cache is sized by its kind (`layer_window`): a ring of the window for a
        sliding layer, full length for a full one, and no K/V but a fixed-size state for a linear one.
      rope_local_theta: the rotary base of the sliding layers (Gemma 3's rope_local_base_freq), which then take
        no rope_scaling; None: every layer uses rope_theta and rope_scaling.
      embed_scale: the token embeddings are multiplied by this (Gemma: sqrt(d_model), rounded to the dtype).
      qk_norm: an RMS norm (of norm_kind) over each query and key head before the rotation (Gemma 3, Qwen3).
      post_norms: Gemma 2/3's sandwich norms: the attention output and the FFN output are normalized before
        each is added to the residual stream.
      query_pre_attn_scalar: the scores are scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5
        (1.0: unscaled scores, Gemma 4).
      attn_logit_softcap: scores become cap * tanh(scores / cap) before masking and softmax (Gemma 2).
      mtp_zero_first_embedding: in a multi-token-prediction module's config (`jaxkv.decoding.mtp`): the token
        embedding at position 0 is zeroed before enorm (DeepSeek's and GLM's modules as vLLM reads them; not
        Qwen3-Next's). Set by the family's MTP plan; a decoder ignores it.
      attention_sinks: each attention layer has one learned logit per query head (`sinks` [N]) that joins every
        softmax's denominator and weighs no value (gpt-oss; `jaxkv.attention.reference`).
      final_logit_softcap: the output logits become cap * tanh(logits / cap) (Gemma 2).
      global_head_dim: the head dim of the full-attention layers (`layer_window` None), when it differs from
        head_dim (Gemma 4); None: head_dim. `layer_head_dim`.
      global_kv_heads: the KV-head count of the full-attention layers (Gemma 4's num_global_key_value_heads);
        None: n_kv_heads. `layer_kv_heads`.
      global_values_from_keys: the full-attention layers have no value projection: their values are the key
        projection's output, before the key norm and the rotation (Gemma 4's attention_k_eq_v).
      value_norm: an RMS norm without a weight (epsilon norm_eps) over each value head (Gemma 4's v_norm).
      kv_shared_layers: the last kv_shared_layers layers compute no keys or values and cache nothing: each
        attends over the keys and values of the last earlier layer of its own kind (sliding or full), already
        updated for the current tokens (Gemma 4's num_kv_shared_layers; `kv_source`). The cache holds an empty
        buffer for them.
      kv_shared_ffn_dim: the FFN width of those layers when it differs from ffn_dim (Gemma 4's
        use_double_wide_mlp: 2 x ffn_dim); None: ffn_dim. `layer_ffn_dim`.
      per_layer_input_dim: P, per-layer input embeddings (Gemma 4's PLE): a second table [V, L * P] (times
        sqrt(P)) plus a projection of the scaled embeddings ([D] -> [L * P], times D ** -0.5, then a norm of
        width P), summed and times 2 ** -0.5, give each layer a P-wide input; after its FFN each layer adds
        norm(W_up(act(W_gate x) * input)) to its residual stream (act: the FFN's activation). None: none.
      layer_scalar: each layer's output (the residual stream after it) is multiplied by a learned scalar.
      eos_ids: default stop tokens for `generate`.
      mla: multi-head latent attention (`Mla`) instead of grouped-query attention. The cache then holds one row of
        R + E per token (MQA with one KV head of that width, keys only): n_kv_heads is 1 and head_dim is R + E,
        the cache's geometry (filled in when omitted); the attention's own widths are the `Mla` fields.
      linear_attention: the Gated DeltaNet geometry of the "linear_attention" layers (`LinearAttention`); a
        hybrid model (Qwen3-Next, Qwen3.5) mixes them with full-attention layers.
      attn_output_gate: the attention's output is multiplied by sigmoid of a second query-sized projection
        before wo (Qwen3-Next's gated attention; the gate's weight is wq_gate [N, H, D]).
      rotary_dim: only the first rotary_dim of each query/key head are rotated (halves convention within them),
        the rest pass through (HF partial_rotary_factor * head_dim); None: the whole head.
      moe: a mixture of experts (`MoeConfig`) in place of the dense MLP from layer moe.first_dense_layers on,
        except moe.dense_layers (the dense layers keep ffn_dim; `MoeConfig.is_moe_layer`).
      dtype: parameter and activation dtype; softmax, norms and logits are computed in float32 whatever it is.
      attention: default attention implementation: "auto" (Pallas on GPU/TPU, XLA on CPU), "xla" or "pallas".
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    ffn_dim: int | None = None
    ffn_kind: FfnKind = "swiglu"
    norm_kind: NormKind = "rmsnorm"
    norm_eps: float = 1e-5
    positions: PositionKind = "rope"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | LinearScaling | YarnScaling | ProportionalRope | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = False
    max_positions: int = 4096
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    embed_scale: float | None = None
    qk_norm: bool = False
    post_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    attention_sinks: bool = False
    mtp_zero_first_embedding: bool = False
    attention_chunk_size: int | None = None
    nope_layers: tuple[int, ...] = ()
    qk_l2_norm: bool = False
    attn_temperature: tuple[float, float] | None = None
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    global_values_from_keys: bool = False
    value_norm: bool = False
    kv_shared_layers: int = 0
    kv_shared_ffn_dim: int | None = None
    per_layer_input_dim: int | None = None
    layer_scalar: bool = False
    eos_ids: tuple[int, ...] = ()
    mla: Mla | None = None
    moe: MoeConfig | None = None
    linear_attention: LinearAttention | None = None
    attn_output_gate: bool = False
    rotary_dim: int | None = None
    dtype: str = "float32"
    attention: str = "auto"

    def __post_init__(self):
        # Fill the derived defaults first (frozen: go through object.__setattr__), then validate everything.
        if isinstance(self.mla, Mla):  # the cache's geometry: one "KV head" holding the latent row
            if self.n_kv_heads is None:
                object.__setattr__(self, "n_kv_heads", 1)
            if self.head_dim is None:
                object.__setattr__(self, "head_dim", self.mla.row_dim)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim is None and self.n_heads > 0 and self.d_model % max(self.n_heads, 1) == 0:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.ffn_dim is None:
            object.__setattr__(self, "ffn_dim", 4 * self.d_model)
        if self.layer_types is not None and not isinstance(self.layer_types, tuple):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        for name in ("nope_layers", "attn_temperature"):  # JSON gives lists
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.eos_ids, int):
            object.__setattr__(self, "eos_ids", (self.eos_ids,))
        else:
            object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))
        self._validate()

    def _validate(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_positions"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                   f"{name} must be a positive integer, got {value!r}")
        _check(self.head_dim is not None,
               f"head_dim must be given when d_model ({self.d_model}) is not divisible by n_heads ({self.n_heads})")
        _check(isinstance(self.head_dim, int) and self.head_dim >= 1,
               f"head_dim must be a positive integer, got {self.head_dim!r}")
        _check(self.n_kv_heads <= self.n_heads,
               f"n_kv_heads ({self.n_kv_heads}) must not exceed n_heads ({self.n_heads})")
        _check(self.n_heads % self.n_kv_heads == 0,
               f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        _check(self.ffn_kind in ("swiglu", "geglu", "gelu"),
               f"ffn_kind must be 'swiglu', 'geglu' or 'gelu', got {self.ffn_kind!r}")
        _check(self.norm_kind in NORM_KINDS, f"norm_kind must be one of {NORM_KINDS}, got {self.norm_kind!r}")
        _check(self.norm_eps > 0 and math.isfinite(self.norm_eps), f"norm_eps must be > 0, got {self.norm_eps}")
        _check(self.positions in ("rope", "learned"),
               f"positions must be 'rope' or 'learned', got {self.positions!r}")
        self._validate_parts()

    def _validate_parts(self):
        """The sub-configs (MLA, MoE) and the positions (RoPE, its scaling, windows, layer types)."""
        _check(self.mla is None or isinstance(self.mla, Mla),
               f"mla must be an Mla or None, got {type(self.mla).__name__}")
        _check(self.moe is None or isinstance(self.moe, MoeConfig),
               f"moe must be a MoeConfig or None, got {type(self.moe).__name__}")
        _check(self.moe is None or (self.ffn_kind == "swiglu" and not self.mlp_bias),
               "a mixture of experts (moe) needs ffn_kind 'swiglu' and no mlp_bias: its experts are bias-free "
               "SwiGLUs")
        if self.mla is not None:
            _check(self.n_kv_heads == 1 and self.head_dim == self.mla.row_dim,
                   f"an MLA config caches one row of kv_lora_rank + qk_rope_head_dim = {self.mla.row_dim} per "
                   f"token: n_kv_heads must be 1 and head_dim {self.mla.row_dim}, got {self.n_kv_heads} and "
                   f"{self.head_dim}")
            _check(self.positions == "rope", "an MLA config needs positions 'rope'")
            _check(self.mla.indexer is None or self.sliding_window is None,
                   "mla.indexer (sparse attention) is not supported with a sliding_window")
        if self.positions == "rope" and self.mla is None:
            _check(self.head_dim % 2 == 0, f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.positions == "rope":
            _check(self.rope_theta > 0 and math.isfinite(self.rope_theta),
                   f"rope_theta must be > 0, got {self.rope_theta}")
        else:
            _check(self.rope_scaling is None, "rope_scaling is set but positions is 'learned'")
        _check(self.rope_scaling is None or isinstance(self.rope_scaling, (RopeScaling, LinearScaling, YarnScaling,
                                                                           ProportionalRope)),
               f"rope_scaling must be a RopeScaling, LinearScaling, YarnScaling, ProportionalRope or None, got "
               f"{type(self.rope_scaling).__name__}")
        _check(not (isinstance(self.rope_scaling, ProportionalRope) and self.mla is not None),
               "a ProportionalRope rope_scaling is not supported with mla")
        _check(self.sliding_window is None or (isinstance(self.sliding_window, int)
                                               and not isinstance(self.sliding_window, bool)
                                               and self.sliding_window >= 1),
               f"sliding_window must be None or a positive integer, got {self.sliding_window!r}")
        if self.layer_types is not None:
            _check(len(self.layer_types) == self.n_layers,
                   f"layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            _check(not bad, f"layer_types entries must be one of {LAYER_TYPES}, got {bad[0]!r}" if bad else "")
            _check(self.attention_chunk_size is not None or "chunked_attention" not in self.layer_types,
                   "layer_types has chunked_attention layers but attention_chunk_size is None")
            _check(self.sliding_window is not None or "sliding_attention" not in self.layer_types,
                   "layer_types has sliding_attention layers but sliding_window is None")
            _check(self.mla is None, "layer_types is not supported with mla")
        self._validate_hybrid()
        self._validate_gemma()

    def _validate_hybrid(self):
        """Linear-attention layers, the gated attention output and partial rotation (Qwen3-Next, Qwen3.5)."""
        la = self.linear_attention
        _check(la is None or isinstance(la, LinearAttention),
               f"linear_attention must be a LinearAttention or None, got {type(la).__name__}")
        linear = self.layer_types is not None and "linear_attention" in self.layer_types
        _check(linear == (la is not None), "layer_types has linear_attention layers but linear_attention is None"
               if linear else "linear_attention is set but no layer_types entry is 'linear_attention'")
        if linear:
            _check(self.positions == "rope" and self.kv_shared_layers == 0 and self.global_head_dim is None
                   and self.global_kv_heads is None,
                   "linear_attention layers need rotary positions and no kv_shared_layers, global_head_dim or "
                   "global_kv_heads")
            _check(any(t != "linear_attention" for t in self.layer_types),
                   "a model of linear_attention layers only is not supported (its cache would hold no K/V to "
                   "bound the sequence)")
        _check(isinstance(self.attn_output_gate, bool), f"attn_output_gate must be a bool, got "
                                                        f"{self.attn_output_gate!r}")
        _check(not (self.attn_output_gate and self.mla is not None), "attn_output_gate is not supported with mla")
        for name in ("attention_sinks", "mtp_zero_first_embedding"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be a bool, got {getattr(self, name)!r}")
        _check(not (self.attention_sinks and self.mla is not None), "attention_sinks is not supported with mla")
        if self.rotary_dim is not None:
            _check(isinstance(self.rotary_dim, int) and not isinstance(self.rotary_dim, bool)
                   and 2 <= self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0
                   and self.mla is None and self.positions == "rope" and self.global_head_dim is None,
                   f"rotary_dim must be an even integer in [2, head_dim = {self.head_dim}] (rotary positions, no "
                   f"mla or global_head_dim), got {self.rotary_dim!r}")

    def _validate_gemma(self):
        """Gemma's scalars and norms, the per-layer fields, eos ids, dtype and attention name."""
        _check(self.rope_local_theta is None or (self.positions == "rope" and self.rope_local_theta > 0
                                                 and math.isfinite(self.rope_local_theta)),
               f"rope_local_theta must be None or > 0 with rotary positions, got {self.rope_local_theta!r}")
        for name in ("embed_scale", "query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                     and math.isfinite(value) and value > 0),
                   f"{name} must be None or a finite number > 0, got {value!r}")
        for name in ("qk_norm", "post_norms"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be a bool, got {getattr(self, name)!r}")
        _check(not (self.qk_norm and self.mla is not None), "qk_norm is not supported with mla")
        self._validate_per_layer()
        self._validate_llama4()
        for i in self.eos_ids:
            _check(0 <= i < self.vocab_size, f"eos id {i} is outside the vocabulary [0, {self.vocab_size})")
        _check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.attention in ATTENTION_IMPLS,
               f"attention must be one of {ATTENTION_IMPLS}, got {self.attention!r}")

    def _validate_llama4(self):
        """Chunked attention, NoPE layers, the q/k L2 norm and attention temperature tuning."""
        c = self.attention_chunk_size
        _check(c is None or (isinstance(c, int) and not isinstance(c, bool) and c >= 1),
               f"attention_chunk_size must be None or a positive integer, got {c!r}")
        _check(c is None or (self.layer_types is not None and "chunked_attention" in self.layer_types),
               "attention_chunk_size is set but no layer_types entry is 'chunked_attention'")
        _check(c is None or self.mla is None, "chunked attention is not supported with mla")
        _check(isinstance(self.nope_layers, tuple) and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.n_layers for i in self.nope_layers)
               and list(self.nope_layers) == sorted(set(self.nope_layers)),
               f"nope_layers must be a sorted tuple of distinct layer indices, got {self.nope_layers!r}")
        _check(not self.nope_layers or (self.positions == "rope" and self.mla is None),
               "nope_layers needs rotary positions and no mla")
        _check(isinstance(self.qk_l2_norm, bool), f"qk_l2_norm must be a bool, got {self.qk_l2_norm!r}")
        _check(not (self.qk_l2_norm and self.mla is not None), "qk_l2_norm is not supported with mla")
        t = self.attn_temperature
        _check(t is None or (isinstance(t, tuple) and len(t) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in t)),
               f"attn_temperature must be None or (floor_scale, attn_scale), two finite numbers > 0, got {t!r}")

    def _validate_per_layer(self):
        """The Gemma 4 fields: per-layer geometry, cross-layer K/V sharing, per-layer inputs."""
        for name in ("global_head_dim", "global_kv_heads", "kv_shared_ffn_dim", "per_layer_input_dim"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1),
                   f"{name} must be None or a positive integer, got {value!r}")
        for name in ("global_values_from_keys", "value_norm", "layer_scalar"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be a bool, got {getattr(self, name)!r}")
        n = self.kv_shared_layers
        _check(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < self.n_layers,
               f"kv_shared_layers must be an integer in [0, n_layers = {self.n_layers}), got {n!r}")
        gemma4 = (self.global_head_dim, self.global_kv_heads, self.kv_shared_ffn_dim, self.per_layer_input_dim)
        if any(v is not None for v in gemma4) or self.global_values_from_keys or self.value_norm or n \
                or self.layer_scalar:
            _check(self.mla is None and self.moe is None and self.positions == "rope",
                   "global_head_dim, global_kv_heads, global_values_from_keys, value_norm, kv_shared_layers, "
                   "kv_shared_ffn_dim, per_layer_input_dim and layer_scalar need rotary positions and no mla or moe")
        if self.global_head_dim is not None:
            _check(self.global_head_dim % 2 == 0, f"RoPE needs an even global_head_dim, got {self.global_head_dim}")
        if self.global_kv_heads is not None:
            K = self.global_kv_heads
            _check(K <= self.n_heads and self.n_heads % K == 0,
                   f"n_heads ({self.n_heads}) must be a multiple of global_kv_heads ({K})")
        if n:
            first = self.n_layers - n
            producers = {self.layer_window(layer) is None for layer in range(first)}
            for layer in range(first, self.n_layers):
                _check((self.layer_window(layer) is None) in producers,
                       f"layer {layer} shares the keys and values of an earlier "
                       f"{'full' if self.layer_window(layer) is None else 'sliding'}-attention layer, but none of "
                       f"layers 0..{first - 1} is one (kv_shared_layers = {n})")

    # Per-layer attention -------------------------------------------------------------------------------------

    def layer_is_linear(self, layer: int) -> bool:
        """`layer` is a Gated DeltaNet ("linear_attention") layer: a state, no K/V (`linear_attention`)."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer in range(self.n_layers) if self.layer_is_linear(layer))

    def caches_kv(self, layer: int) -> bool:
        """`layer` has K/V buffers of its own in a cache: it stores K/V (`stores_kv`) and is not linear."""
        return self.stores_kv(layer) and not self.layer_is_linear(layer)

    def state_bytes_per_sequence(self) -> int:
        """Bytes of the linear layers' state per sequence (conv windows and delta-rule states): fixed, whatever
        the length; 0 without linear layers."""
        if self.linear_attention is None:
            return 0
        return len(self.linear_layers) * self.linear_attention.state_bytes(self.dtype)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: it sees the whole context, or its chunk: `layer_chunk`)."""
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_chunk(self, layer: int) -> int | None:
        """The attention chunk of a "chunked_attention" layer (Llama 4), else None."""
        if self.layer_types is not None and self.layer_types[layer] == "chunked_attention":
            return self.attention_chunk_size
        return None

    def layer_span(self, layer: int) -> int | None:
        """The most recent slots `layer` can ever read: its sliding window or its chunk (its cache is then a ring of
        that many slots), or None (every slot)."""
        window = self.layer_window(layer)
        return window if window is not None else self.layer_chunk(layer)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.layer_window(layer) for layer in range(self.n_layers))

    @property
    def layer_spans(self) -> tuple[int | None, ...]:
        return tuple(self.layer_span(layer) for layer in range(self.n_layers))

    @property
    def every_layer_sliding(self) -> bool:
        """Every layer reads a bounded span (a window or a chunk): a cache that is a ring on every layer needs no
        bound on the length."""
        return all(w is not None for w in self.layer_spans)

    def layer_is_nope(self, layer: int) -> bool:
        """`layer` has no rotary positions (Llama 4's NoPE layers)."""
        return layer in self.nope_layers

    def layer_head_dim(self, layer: int) -> int:
        """H of `layer`: global_head_dim on a full-attention layer when set, else head_dim."""
        if self.global_head_dim is not None and self.layer_window(layer) is None:
            return self.global_head_dim
        return self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        """K of `layer`: global_kv_heads on a full-attention layer when set, else n_kv_heads."""
        if self.global_kv_heads is not None and self.layer_window(layer) is None:
            return self.global_kv_heads
        return self.n_kv_heads

    def layer_values_from_keys(self, layer: int) -> bool:
        """`layer` has no value projection (its values are the key projection's output)."""
        return self.global_values_from_keys and self.layer_window(layer) is None

    def kv_source(self, layer: int) -> int:
        """The layer whose keys and values `layer` attends over: itself, or for one of the last kv_shared_layers
        the last earlier layer of the same kind (transformers' "store" layer; `kv_shared_layers`)."""
        first = self.n_layers - self.kv_shared_layers
        if layer < first:
            return layer
        full = self.layer_window(layer) is None
        return max(i for i in range(first) if (self.layer_window(i) is None) == full)

    def stores_kv(self, layer: int) -> bool:
        """`layer` computes and caches its own keys and values (it is not a K/V-sharing layer)."""
        return layer < self.n_layers - self.kv_shared_layers

    @property
    def uniform_kv(self) -> bool:
        """Every layer caches K/V of one geometry (n_kv_heads x head_dim): no per-layer heads, no sharing."""
        return (self.global_head_dim is None and self.global_kv_heads is None and self.kv_shared_layers == 0
                and self.linear_attention is None)

    def layer_ffn_dim(self, layer: int) -> int:
        """F of `layer`: kv_shared_ffn_dim on a K/V-sharing layer when set, else ffn_dim."""
        if self.kv_shared_ffn_dim is not None and not self.stores_kv(layer):
            return self.kv_shared_ffn_dim
        return self.ffn_dim

    def layer_rope(self, layer: int) -> tuple[float, RopeScaling | LinearScaling | YarnScaling | None]:
        """(rope base, scaling) of `layer`: the sliding layers' own base (unscaled) when rope_local_theta is set."""
        if self.rope_local_theta is not None and self.layer_window(layer) is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    # Derived sizes --------------------------------------------------------------------------------------------

    @property
    def group_size(self) -> int:
        """G = N // K: query heads that share one KV head."""
        return self.n_heads // self.n_kv_heads

    def kv_bytes_per_token(self, bytes_per_element: int | None = None) -> int:
        """2 (K and V) x layers x KV heads x head dim x bytes per element; an MLA cache holds keys only (its
        values are the first R columns of the same row): layers x (R + E) x bytes per element, plus DeepSeek-V3.2's
        indexer key (`SparseIndexer.head_dim`) per layer where it has one."""
        if bytes_per_element is None:
            bytes_per_element = 4 if self.dtype == "float32" else 2
        kinds = 1 if self.mla is not None else 2
        # (an indexer key of another dtype, `SparseIndexer.key_dtype`, is counted at this size too: an estimate;
        # the planner's `kv_bytes_per_token` is exact)
        indexer = 0 if self.mla is None or self.mla.indexer is None else self.mla.indexer.head_dim
        return bytes_per_element * sum(kinds * self.layer_kv_heads(layer) * self.layer_head_dim(layer) + indexer
                                       for layer in range(self.n_layers) if self.caches_kv(layer))

    @property
    def attention_scale(self) -> float:
        """What multiplies q.k: 1/sqrt(head dim), or query_pre_attn_scalar ** -0.5 when that is set; for MLA, 1/sqrt(qk_nope + qk_rope), times YaRN's
        mscale(factor, mscale_all_dim) squared when that is set (transformers' `yarn_apply_mscale`)."""
        if self.mla is None:
            if self.query_pre_attn_scalar is not None:
                return self.query_pre_attn_scalar ** -0.5
            return 1.0 / math.sqrt(self.head_dim)
        scale = self.mla.qk_head_dim ** -0.5
        yarn = self.rope_scaling
        if isinstance(yarn, YarnScaling) and yarn.mscale_all_dim:
            mscale = yarn_mscale(yarn.factor, yarn.mscale_all_dim)
            scale = scale * mscale * mscale
        return scale

    def _mla_attention_params(self) -> int:
        m, D, N = self.mla, self.d_model, self.n_heads
        q = D * N * m.qk_head_dim if m.q_lora_rank is None else (
            D * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * N * m.qk_head_dim)
        kv = D * m.row_dim + m.kv_lora_rank + m.kv_lora_rank * N * (m.qk_nope_head_dim + m.v_head_dim)
        attn = q + kv + N * m.v_head_dim * D
        if self.qkv_bias:
            attn += (m.q_lora_rank or 0) + m.row_dim
        if self.out_bias:
            attn += D
        if m.indexer is not None:  # wq [H*Di, q_rank], wk [Di, D], its LayerNorm, the head weights [H, D]
            ix = m.indexer
            attn += ix.n_heads * ix.head_dim * m.q_lora_rank + ix.head_dim * D + 2 * ix.head_dim + ix.n_heads * D
        return attn

    def param_count(self) -> int:
        D, V = self.d_model, self.vocab_size
        norm = 2 * D if self.norm_kind == "layernorm" else D
        norms = 4 if self.post_norms else 2
        total = norm + V * D
        for layer in range(self.n_layers):
            total += self._layer_attention_params(layer) + self._layer_ffn_params(layer) + norms * norm
            if self.per_layer_input_dim is not None:  # gate [P, D], projection [D, P], its norm [D]
                total += 2 * D * self.per_layer_input_dim + norm
            total += 1 if self.layer_scalar else 0
        if self.per_layer_input_dim is not None:  # the table [V, L*P], the projection [L*P, D], its norm [P]
            LP = self.n_layers * self.per_layer_input_dim
            total += V * LP + LP * D + self.per_layer_input_dim
        if not self.tie_embeddings:
            total += D * V
        if self.positions == "learned":
            total += self.max_positions * D
        return total

    def _layer_attention_params(self, layer: int) -> int:
        if self.mla is not None:
            return self._mla_attention_params()
        if self.layer_is_linear(layer):
            return self.linear_attention.param_count(self.d_model)
        D, N = self.d_model, self.n_heads
        H, K = self.layer_head_dim(layer), self.layer_kv_heads(layer)
        kv = 0 if not self.stores_kv(layer) else 1 if self.layer_values_from_keys(layer) else 2
        attn = (2 if self.attn_output_gate else 1) * D * N * H + kv * D * K * H + N * H * D
        if self.qkv_bias:
            attn += N * H + kv * K * H
        if self.out_bias:
            attn += D
        if self.qk_norm:
            attn += (2 if self.stores_kv(layer) else 1) * H
        if self.attention_sinks:
            attn += N
        return attn

    def _layer_ffn_params(self, layer: int) -> int:
        D = self.d_model
        if self.moe is not None and self.moe.is_moe_layer(layer):  # experts in place of the dense FFN
            return self.moe.param_count(D)
        F = self.layer_ffn_dim(layer)
        gated = self.ffn_kind in ("swiglu", "geglu")
        ffn = (3 if gated else 2) * D * F
        if self.mlp_bias:
            ffn += (2 * F if gated else F) + D
        return ffn

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)


def _check(ok: bool, message: str):
    if not ok:
        raise ValueError(f"invalid config: {message}")


# Presets used by tests, scripts and benchmarks. "small" and "medium" are the benchmark configs of issue 4.
PRESETS: dict[str, Config] = {
    "test-tiny": Config(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                        max_positions=4096),
    "small": Config(vocab_size=32000, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1408,
                    max_positions=4096),
    "medium": Config(vocab_size=32000, d_model=1024, n_layers=16, n_heads=16, n_kv_heads=4, ffn_dim=2816,
                     max_positions=4096),
}
