"""DeepSeek-V3's multi-token-prediction (MTP) modules, the model side of the "mtp" proposer: `Mtp` (what
`jaxkv.load` keeps in `Model.mtp`), `mtp_forward` (one module's reference forward pass over its own cache) and
`mtp_cache`. Letters as in `jaxkv.shapes`.

Module k (DeepSeek-V3 report, section 2.2; vLLM's `deepseek_mtp.py`, sglang's `deepseek_nextn.py`) reads the
main model's hidden state h_t at position t and the embedding of the token at t + 1, and predicts the token at
t + 2:

    x_t    = eh_proj(concat(enorm(e_t), hnorm(h_t)))     [B, T, 2D] -> [B, T, D];  e_t = embed(token_{t+1}),
                                                          zeroed at position 0 (as vLLM does; not for
                                                          Qwen3-Next: `Config.mtp_zero_first_embedding`)
    h'_t   = shared_head.norm(block(x_t))                 block: one ordinary decoder layer (MLA + MoE),
                                                          attending causally over the module's own cache
    logits = lm_head(h'_t)

with the main model's embedding and head unless the module has its own. h_t is the main model's state after its
final norm (what its head reads: `Decoder(..., return_hidden=True)`), and h'_t, the module's own normed output,
is what a chained step reads next, as sglang does and vLLM since its PR #45895 (the modeling code shipped with
DeepSeek's MTP checkpoints feeds the normed state, per ROCm/ATOM PR #1764; a chain fed the block's un-normed
output lost acceptance). The block's
cache is the module's own: a one-layer `KVCache` of `Mtp.config` whose slot for (h_t, token_{t+1}) is position t,
so it runs one token behind the main model's.

Prefilling it from a prompt of T tokens (left-padded, positions p [B, T] as `generate` lays them out), once the
first new token x is drawn:

    logits, _, h = model.apply(prompt, p, cache, prefill=True, return_hidden=True)
    mtp_c = mtp_cache(model, B, capacity, start=cache.start)
    mtp_logits, h2, mtp_c = mtp_forward(model.mtp.params[0], model.params, h,
                                        concat(prompt[:, 1:], x[:, None]), p, mtp_c,
                                        config=model.mtp.config, prefill=True)

mtp_logits[:, -1] then proposes the token after x; each later step feeds the new (h_t, token_{t+1}) pairs at the
positions `mtp_c.positions(T)`.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.contiguous import KVCache
from jaxkv.cache.paged import PagedKVCache
from jaxkv.config import Config
from jaxkv.layers import quantized
from jaxkv.layers.linear import fan_in_init, linear
from jaxkv.layers.norms import Norm
from jaxkv.layers.rope import rope_angles
from jaxkv.model import Block, init_params

# Optional per-module copies of the main model's tables (the release repeats them); without, the main model's.
_TABLES = ("embedding", "lm_head")


@dataclasses.dataclass(frozen=True)
class Mtp:
    """A model's multi-token-prediction modules.

    Attributes:
      config: the one-layer config every module's decoder layer runs with (the main config with n_layers 1 and
        that layer's FFN); static under jit, and the config of each module's `KVCache`.
      params: one params dict per module, in order: enorm/scale, hnorm/scale [D], eh_proj [D, 2D] (the [out, in]
        form), layer_0 (a decoder layer's params, laid out as `config` says), final_norm/scale (shared_head.norm),
        and optionally embedding and lm_head [V, D] where the checkpoint's differ from the main model's.
    """

    config: Config
    params: tuple[dict, ...]


class MtpModule(nn.Module):
    """One module without its tables: (embedded next tokens [B, T, D], hidden [B, T, D], positions, cache) ->
    (h' [B, T, D], cache)."""

    config: Config

    @nn.compact
    def __call__(self, embedded, hidden, positions, cache, prefill: bool, attention: str):
        cfg = self.config
        D, T = cfg.d_model, positions.shape[1]
        if cfg.mtp_zero_first_embedding:
            # vLLM's reading of DeepSeek's and GLM's code: position 0 (h_0 of the first token) takes no token
            # embedding (Qwen3-Next's, vLLM's qwen3_next_mtp, does not zero it)
            embedded = jnp.where((positions == 0)[..., None], jnp.zeros((), embedded.dtype), embedded)
        x = jnp.concatenate([Norm(cfg, name="enorm")(embedded), Norm(cfg, name="hnorm")(hidden)], axis=-1)
        w = self.param("eh_proj", fan_in_init(2 * D), (D, 2 * D), jnp.dtype(cfg.dtype))  # [out, in]
        x = linear(x, w, out_in=True)  # [B, T, 2D] -> [B, T, D]
        real = positions >= 0  # [B, T]; padding's state zeroed, as the decoder's (`jaxkv.model.Decoder`)
        x = jnp.where(real[..., None], x, jnp.zeros((), x.dtype))
        paged = isinstance(cache, PagedKVCache)
        if paged:  # as the decoder's: each row writes its real tokens at its own slots
            cache = cache.reserve(jnp.sum(real, axis=1, dtype=jnp.int32))
            start = real
        else:  # without a cache, padding is on the left: the first real token's index
            start = jnp.sum(~real, axis=1, dtype=jnp.int32) if cache is None else cache.start  # [B]
        x, cache, _ = Block(cfg, 0, name="layer_0")(x, rope_angles(positions, cfg), cache, start, prefill, attention)
        if cache is not None:
            cache = cache.advance(jnp.sum(real, axis=1, dtype=jnp.int32) if paged else T)
        return Norm(cfg, name="final_norm")(x), cache


def mtp_forward(mtp_params: dict, params: dict, hidden, tokens, positions,
                cache: KVCache | PagedKVCache | None = None, *,
                config: Config, attention: str | None = None, prefill: bool = False):
    """One MTP module over T positions (pure, jittable with `config`, `attention` and `prefill` static).

    Args:
      mtp_params: the module's params (`Mtp.params[k]`).
      params: the main model's params (its embedding and head, unless the module has its own).
      hidden: [B, T, D] the main model's hidden states at positions t, after its final norm
        (`Decoder(..., return_hidden=True)`), or the h' of a previous module or step.
      tokens: int32[B, T], the tokens at positions t + 1.
      positions: int32[B, T], the positions t (negative: padding). With a cache they must be `cache.positions(T)`.
      cache: the module's own one-layer `KVCache` (`mtp_cache`), or a `PagedKVCache` of `config` (each row's real
        positions written at its own slots from its length on, as the decoder's; the engine runs the module's pools
        under the target's page tables); None attends causally among the T positions only (the recompute
        reference).
      config: `Mtp.config`.
      prefill: the cache is empty (as `Decoder`'s prefill).

    Returns:
      (float32[B, T, V] logits for the tokens at t + 2, h' [B, T, D] (after shared_head.norm: what the head read
      and what a chained step reads as `hidden`), the cache or None).
      A row's logits are NaN where its positions pass config.max_positions or its writes the cache's capacity.
    """
    if cache is not None and not isinstance(cache, (KVCache, PagedKVCache)):
        raise ValueError(f"an MTP module runs over a KVCache or a PagedKVCache, got {type(cache).__name__}")
    attention = attention or config.attention
    embedding = mtp_params.get("embedding", params["embedding"])
    block = {k: v for k, v in mtp_params.items() if k not in _TABLES}
    x = quantized.rows(embedding, tokens, jnp.dtype(config.dtype))  # [B, T, D] (the main model's may be quantized)
    h, new_cache = MtpModule(config).apply({"params": block}, x, hidden, positions, cache, prefill, attention)
    logits = mtp_head(mtp_params, params, h, config=config)
    poisoned = jnp.any(positions >= config.max_positions, axis=1)  # [B]
    if isinstance(new_cache, PagedKVCache):
        poisoned |= new_cache.overflowed
    elif cache is not None and not cache.ring:
        poisoned |= cache.length + positions.shape[1] > cache.capacity
    logits = jnp.where(poisoned[:, None, None], jnp.nan, logits)
    return logits, h, new_cache


def mtp_head(mtp_params: dict, params: dict, h, *, config: Config):
    """The module's head over its output h' [..., D] (`mtp_forward`'s second result) -> float32[..., V] logits:
    the module's own lm_head if it has one, else the main model's."""
    head = mtp_params.get("lm_head", params["embedding"] if config.tie_embeddings else params["lm_head"])
    return quantized.einsum("...d,vd->...v", h, head)


def mtp_cache(model, batch: int, capacity: int, *, dtype=None, start=None) -> KVCache:
    """A zeroed cache for `model.mtp`'s modules (one each; a single layer of latent rows): `batch` sequences of
    `capacity` slots, `start` [B] the left padding (the main cache's), `dtype` one of the cache dtypes (default the
    model's)."""
    if model.mtp is None:
        raise ValueError("the model has no multi-token-prediction modules (Model.mtp is None)")
    return KVCache.allocate(model.mtp.config, batch, capacity, dtype=dtype, start=start)


def random_mtp(config: Config, n: int = 1, seed: int = 0) -> Mtp:
    """n random modules for a DeepSeek-style `config` (one-layer block config from the main one, the layer's FFN
    that of the main model's last layer): norms 1, weights Normal(0, 1/sqrt(fan_in)); no own tables. For tests."""
    moe = config.moe
    if moe is not None:
        moe = (dataclasses.replace(moe, first_dense_layers=0, dense_layers=())
               if moe.is_moe_layer(config.n_layers - 1) else None)
    block = config.replace(n_layers=1, moe=moe, mtp_zero_first_embedding=True)
    rng = np.random.default_rng(seed)
    D, dtype = config.d_model, jnp.dtype(config.dtype)
    modules = []
    for k in range(n):
        layer = init_params(block, seed + 1 + k)["layer_0"]
        ones = {"scale": jnp.ones((D,), dtype)}
        eh = rng.normal(0.0, 1.0 / math.sqrt(2 * D), (D, 2 * D)).astype(dtype)
        modules.append({"enorm": ones, "hnorm": ones, "eh_proj": jnp.asarray(eh), "layer_0": layer,
                        "final_norm": ones})
    return Mtp(block, tuple(modules))
