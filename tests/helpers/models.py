"""Tiny random models and the padded layouts tests build: each config differs from the Llama-style GQA default in
one way that matters for caching. Models are built once per process (`model_for`)."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv.config import Mla

BASE = dict(vocab_size=97, d_model=64, n_layers=2, n_heads=4, ffn_dim=96, max_positions=4096)

# name -> config; each differs from the Llama-style GQA default in one way that matters for caching.
CONFIGS = {
    "mha": jaxkv.Config(**BASE, n_kv_heads=4),
    "gqa": jaxkv.Config(**BASE, n_kv_heads=2),
    "mqa": jaxkv.Config(**BASE, n_kv_heads=1),
    # head_dim != d_model / n_heads, q/k/v bias, Llama-3 rope scaling
    "gqa-wide-heads": jaxkv.Config(**BASE, n_kv_heads=2, head_dim=24, qkv_bias=True, rope_theta=500000.0,
                                   rope_scaling=jaxkv.RopeScaling(8.0, 1.0, 4.0, 64)),
    # GPT-2 style: learned absolute positions, LayerNorm, GELU MLP, biases everywhere, tied head
    "learned": jaxkv.Config(**{**BASE, "max_positions": 256}, n_kv_heads=4, positions="learned",
                            norm_kind="layernorm", ffn_kind="gelu", qkv_bias=True, out_bias=True, mlp_bias=True,
                            tie_embeddings=True),
    "sliding": jaxkv.Config(**BASE, n_kv_heads=2, sliding_window=8),
}

# A DeepSeek-style MLA model for the MTP proposer's tests (`with_mtp`).
MTP_CONFIG = jaxkv.Config(vocab_size=80, d_model=48, n_layers=2, n_heads=4, ffn_dim=64,
                          mla=Mla(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12))


_models = {}


def left_pad(prompts, length=None):
    """(int32[B, T] tokens, int32[B] start): prompts right-aligned to T (default: the longest), as generate lays
    them out; padding is token 0 before each prompt's first slot `start[b]`."""
    T = length or max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), T), np.int32)
    start = np.array([T - len(p) for p in prompts], np.int32)
    for b, p in enumerate(prompts):
        tokens[b, start[b]:] = p
    return jnp.asarray(tokens), jnp.asarray(start)


def recompute(model: jaxkv.Model, rows) -> list:
    """The no-cache logits [len(row), V] of each row (a list of ids), from one `jaxkv.logits` call with the rows
    right-padded (token 0) to the longest: causal, so the padding after a row changes none of its logits, and one
    compiled shape serves every row."""
    longest = max(map(len, rows))
    logits = jaxkv.logits(model, [row + [0] * (longest - len(row)) for row in rows])
    return [logits[b, :len(row)] for b, row in enumerate(rows)]


def model_for(name: str) -> jaxkv.Model:
    if name not in _models:
        _models[name] = jaxkv.Model.random(CONFIGS[name], seed=1)
    return _models[name]


def placed_like(model: jaxkv.Model, loaded: jaxkv.Model) -> jaxkv.Model:
    """`model` with each weight committed to its device where `loaded`'s is (`jaxkv.load` commits some or all of
    them). jit keys on committed vs uncommitted arrays: a test that compares a loaded model with the one it saved
    then runs one set of compiled programs for both, not each program twice."""
    params = jax.tree_util.tree_map(lambda x, ref: jax.device_put(x, ref.sharding) if ref.committed else x,
                                    model.params, loaded.params)
    return jaxkv.Model(model.config, params, model.tokenizer)


# A tiny dense multi-head latent attention model (DeepSeek's MLA, no experts): the paged latent attention tests and the
# paged cache's write-path test share it. The latent cache holds kv_lora_rank + qk_rope_head_dim per slot.
MLA_DENSE = jaxkv.Config(vocab_size=160, d_model=48, n_layers=2, n_heads=6, ffn_dim=64,
                         mla=Mla(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                                 q_lora_rank=24))


def with_mtp(bigram: bool, noisy: bool = False):
    """The MLA model with a random MTP module, or (`bigram`) a model whose layers are zeroed (its next token a
    function g of the current one: logits = head(norm(embed(x)))) with an MTP module that reads only the next
    token's embedding through zeroed layers (eh_proj = [I, 0]): it predicts g(token_{t+1}), the true token at
    t + 2, so every proposal is right exactly when the module is fed the right pairs (tokens) in order. Its
    layer ignores the positions; `noisy` gives it back its random layer, whose attention over the pairs before
    makes the proposals depend on every pair and position fed (some kept, some not)."""
    from jaxkv.decoding.mtp import Mtp, random_mtp

    MLA = MTP_CONFIG
    m = jaxkv.Model.random(MLA, seed=2)  # the same weights as test_speculation's model("mla")
    mtp = random_mtp(MLA, seed=1)
    if not bigram:
        m.mtp = mtp
        return m
    params = {k: jax.tree.map(jnp.zeros_like, v) if k.startswith("layer_") else v for k, v in m.params.items()}
    module = dict(mtp.params[0], layer_0=mtp.params[0]["layer_0"] if noisy
                  else jax.tree.map(jnp.zeros_like, mtp.params[0]["layer_0"]),
                  eh_proj=jnp.concatenate([jnp.eye(MLA.d_model), jnp.zeros((MLA.d_model,) * 2)], axis=1))
    m = jaxkv.Model(MLA, params)
    m.mtp = Mtp(mtp.config, (module,))
    return m
