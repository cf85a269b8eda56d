"""DeepSeek-V3's multi-token-prediction (MTP) modules (`jaxkv.decoding.mtp`): loaded apart from the decoder, and
`mtp_forward` against an oracle written from the module's definition, with transformers' own DeepseekV3 decoder
layer as its block.

transformers does not implement MTP (it drops the tensors), so the checkpoint is built by hand: a tiny random
DeepseekV3ForCausalLM (helpers.hf's DEEPSEEK_MOE_LIKE, 3 layers: layer 0 dense, 1-2 mixtures of experts) saved by
transformers, plus layer 3 = the MTP module: the decoder layer of a second random one-layer DeepseekV3 (a mixture of
experts, as DeepSeek's rule makes layer 3 one; its norms randomized too), its final norm as shared_head.norm, and
seeded enorm, hnorm and eh_proj. The oracle: e = embed(next token) (zero at position 0), x = eh_proj(concat(
rms(e) * enorm, rms(h) * hnorm)) in numpy, then that one-layer transformers model from inputs_embeds x (its
lm_head the main model's), h = the main model's hidden state after its final norm, captured from transformers.
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

import jaxkv  # noqa: E402
from jaxkv.config import Config, Mla, MoeConfig  # noqa: E402
from jaxkv.decoding.mtp import mtp_cache, mtp_forward, random_mtp  # noqa: E402
from jaxkv.io.checkpoint import cast  # noqa: E402
from jaxkv.model import Decoder  # noqa: E402
from helpers.hf import DEEPSEEK_MOE_LIKE, assert_no_near_ties, build_deepseek_moe_hf  # noqa: E402
from helpers.tolerances import tolerance  # noqa: E402

FIELDS = dict(DEEPSEEK_MOE_LIKE, q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
              topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1,
              num_nextn_predict_layers=1)
L, D, V = FIELDS["num_hidden_layers"], FIELDS["hidden_size"], FIELDS["vocab_size"]
MTP = f"model.layers.{L}."
# The same float32 arithmetic in another order (numpy / torch vs XLA) through an MLA and MoE layer: rounding only,
# 1e-5 relative to logits of a few units (measured: at most 1.3e-5 absolute on logits of 3.8).
TOL = dict(atol=1e-5, rtol=1e-5)
TOKENS = np.random.default_rng(3).integers(3, V, (2, 13))


def _block_hf():
    """The one-layer transformers model whose decoder layer is the MTP block, norms randomized (all ones would
    hide a norm left out or swapped) and V3's correction bias too (transformers zeroes it)."""
    torch.manual_seed(1)
    config = transformers.DeepseekV3Config(**dict(FIELDS, num_hidden_layers=1, first_k_dense_replace=0))
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape))
        bias = hf.model.layers[0].mlp.gate.e_score_correction_bias
        bias.copy_(torch.randn(bias.shape) * 0.1)
    return hf


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(main transformers model, block transformers model, the MTP module's own tensors, directory holding
    "plain" (transformers' save, num_nextn_predict_layers 1 but no MTP tensors) and "mtp")."""
    root = tmp_path_factory.mktemp("deepseek_mtp")
    main = build_deepseek_moe_hf("DeepseekV3Config", FIELDS)
    main.save_pretrained(root / "plain", safe_serialization=True)
    block = _block_hf()
    with torch.no_grad():  # the block's tables are the main model's: the oracle's head is then the main one's
        block.model.embed_tokens.weight.copy_(main.model.embed_tokens.weight)
        block.lm_head.weight.copy_(main.lm_head.weight)
    block.save_pretrained(root / "block", safe_serialization=True)  # one tensor per expert, as the release
    stored = safetensors_numpy.load_file(str(root / "block" / "model.safetensors"))
    rng = np.random.default_rng(2)
    own = {MTP + k.removeprefix("model.layers.0."): v for k, v in stored.items() if k.startswith("model.layers.0.")}
    own |= {MTP + "shared_head.norm.weight": stored["model.norm.weight"],
            MTP + "enorm.weight": (1 + 0.2 * rng.standard_normal(D)).astype(np.float32),
            MTP + "hnorm.weight": (1 + 0.2 * rng.standard_normal(D)).astype(np.float32),
            MTP + "eh_proj.weight": (rng.standard_normal((D, 2 * D)) / np.sqrt(2 * D)).astype(np.float32)}
    _write(root / "plain", root / "mtp", own)
    return main, block, own, root


def _write(source, target, extra=None, drop=(), config=None):
    """`source`'s checkpoint with tensors added and dropped (and config.json fields changed) at `target`."""
    shutil.copytree(source, target)
    tensors = safetensors_numpy.load_file(str(target / "model.safetensors"))
    tensors = {k: v for k, v in {**tensors, **(extra or {})}.items() if k not in drop}
    safetensors_numpy.save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    if config:
        c = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps(c | config))
    return target


def _rms(x, w, eps=FIELDS["rms_norm_eps"]):
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * w


def _captured(module, run):
    """The output of `module` during `run()` (a forward hook)."""
    out = []
    handle = module.register_forward_hook(lambda m, args, result: out.append(result))
    try:
        run()
    finally:
        handle.remove()
    return out[0]


def _oracle(main, block, own, tokens):
    """transformers' main hidden states after the final norm for tokens[:, :-1], and the MTP module's (logits,
    normed block output) for the pairs (h_t, token_{t+1}) at positions t, from the definition."""
    ids = torch.tensor(tokens)
    with torch.no_grad():
        h = _captured(main.model.norm, lambda: main(ids[:, :-1])).numpy()  # [B, T, D]
        T = h.shape[1]
        e = main.model.embed_tokens.weight.numpy()[tokens[:, 1:]]  # [B, T, D]
        e[:, 0] = 0  # position 0 takes no token embedding
        x = np.concatenate([_rms(e, own[MTP + "enorm.weight"]), _rms(h, own[MTP + "hnorm.weight"])], -1)
        x = x @ own[MTP + "eh_proj.weight"].T  # [B, T, 2D] -> [B, T, D]
        positions = torch.arange(T)[None].expand(len(tokens), T)
        router_in = []
        hook = block.model.layers[0].mlp.register_forward_hook(lambda m, args, r: router_in.append(args[0]))
        normed = []
        hook2 = block.model.norm.register_forward_hook(lambda m, args, r: normed.append(r))
        logits = block(inputs_embeds=torch.tensor(x, dtype=torch.float32), position_ids=positions).logits
        hook.remove()
        hook2.remove()
        gate = block.model.layers[0].mlp.gate
        router_logits = router_in[0].reshape(-1, D).numpy() @ gate.weight.numpy().T
        bias = gate.e_score_correction_bias.numpy()
    return h, logits.numpy(), normed[0].numpy(), router_logits, bias


def test_load_keeps_the_mtp_module_apart(built):
    main, _, own, root = built
    plain, model = jaxkv.load(root / "plain"), jaxkv.load(root / "mtp")
    assert plain.mtp is None  # transformers writes num_nextn_predict_layers = 1 and no MTP tensors
    assert len(model.mtp.params) == 1 and model.mtp.config.n_layers == 1
    p = model.mtp.params[0]
    assert p["eh_proj"].shape == (D, 2 * D) and p["enorm"]["scale"].shape == (D,)
    assert p["hnorm"]["scale"].shape == (D,) and p["final_norm"]["scale"].shape == (D,)
    assert p["layer_0"]["mlp"]["we_gate"].shape[0] == FIELDS["n_routed_experts"]  # layer 3: experts
    assert "embedding" not in p and "lm_head" not in p  # none stored: the main model's are used
    np.testing.assert_array_equal(p["enorm"]["scale"], own[MTP + "enorm.weight"])
    np.testing.assert_array_equal(p["eh_proj"], own[MTP + "eh_proj.weight"])
    # the decoder is untouched: the same params tree, the same logits
    jax.tree_util.tree_map(np.testing.assert_array_equal, model.params, plain.params)
    np.testing.assert_array_equal(jaxkv.logits(model, TOKENS), jaxkv.logits(plain, TOKENS))


def test_tables_kept_only_where_they_differ(built, tmp_path):
    main, _, _, root = built
    embedding = main.model.embed_tokens.weight.detach().numpy()
    head = main.lm_head.weight.detach().numpy()
    # the release's form: the module repeats the main model's tables; one copy is kept
    same = jaxkv.load(_write(root / "mtp", tmp_path / "same", {MTP + "embed_tokens.weight": embedding,
                                                               MTP + "shared_head.head.weight": head}))
    assert "embedding" not in same.mtp.params[0] and "lm_head" not in same.mtp.params[0]
    other = np.random.default_rng(5).standard_normal(head.shape).astype(np.float32)
    own_head = jaxkv.load(_write(root / "mtp", tmp_path / "own", {MTP + "shared_head.head.weight": other}))
    np.testing.assert_array_equal(own_head.mtp.params[0]["lm_head"], other)
    h = np.random.default_rng(6).standard_normal((1, 4, D)).astype(np.float32)
    tokens, positions = jnp.asarray(TOKENS[:1, :4]), jnp.arange(4)[None]
    logits, normed, _ = mtp_forward(own_head.mtp.params[0], own_head.params, h, tokens, positions,
                                    config=own_head.mtp.config)
    np.testing.assert_allclose(logits, np.asarray(normed) @ other.T, **TOL)


def test_mtp_forward_matches_the_definition(built):
    main, block, own, root = built
    model = jaxkv.load(root / "mtp", dtype="float32")
    h_hf, logits_hf, normed_hf, router_logits, bias = _oracle(main, block, own, TOKENS)
    assert_no_near_ties(router_logits, model.mtp.config.moe, bias)
    B, T = TOKENS.shape[0], TOKENS.shape[1] - 1
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    _, _, h = Decoder(model.config).apply({"params": model.params}, jnp.asarray(TOKENS[:, :-1]), positions,
                                          return_hidden=True)
    np.testing.assert_allclose(h, h_hf, **tolerance("transformers logits"))  # return_hidden: after the final norm
    run = jax.jit(mtp_forward, static_argnames=("config", "attention", "prefill"))
    for name, cache in (("no cache", None), ("prefill", mtp_cache(model, B, 16))):
        logits, normed, cache = run(model.mtp.params[0], model.params, jnp.asarray(h_hf), jnp.asarray(TOKENS[:, 1:]),
                                    positions, cache, config=model.mtp.config, prefill=cache is not None)
        np.testing.assert_allclose(logits, logits_hf, **TOL, err_msg=name)
        np.testing.assert_allclose(normed, normed_hf, **TOL, err_msg=name)
    assert int(cache.length) == T


def test_cached_steps_equal_one_pass():
    """Positions fed one at a time through the module's cache (after a prefill of the first 5) equal one pass over
    all of them, for a ragged batch (row 1 left-padded by 3): logits and h' at every real position."""
    config = Config(vocab_size=V, d_model=D, n_layers=2, n_heads=4, ffn_dim=96, norm_eps=1e-6,
                                 mla=Mla(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                                      v_head_dim=16, q_lora_rank=48),
                                 moe=MoeConfig(n_routed_experts=8, experts_per_token=3, moe_ffn_dim=32,
                                                            n_shared_experts=1, first_dense_layers=1,
                                                            scoring="sigmoid", topk_method="noaux_tc", n_group=4,
                                                            topk_group=2, norm_topk_prob=True,
                                                            routed_scaling_factor=2.5))
    model = jaxkv.Model.random(config, seed=0)
    model.mtp = random_mtp(config, seed=1)
    assert model.mtp.config.moe is not None
    B, T, pad, first = 2, 12, 3, 5
    rng = np.random.default_rng(4)
    hidden = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    tokens = jnp.asarray(rng.integers(3, V, (B, T)), jnp.int32)
    start = jnp.asarray([0, pad], jnp.int32)
    positions = jnp.arange(T)[None] - start[:, None]  # left padding: negative positions
    run = jax.jit(mtp_forward, static_argnames=("config", "attention", "prefill"))
    kwargs = dict(config=model.mtp.config)
    full_logits, full_h, _ = run(model.mtp.params[0], model.params, hidden, tokens, positions, None, **kwargs)
    cache = mtp_cache(model, B, 16, start=start)
    logits, h, cache = run(model.mtp.params[0], model.params, hidden[:, :first], tokens[:, :first],
                           positions[:, :first], cache, prefill=True, **kwargs)
    steps_logits, steps_h = [logits], [h]
    for t in range(first, T):
        np.testing.assert_array_equal(cache.positions(1), positions[:, t:t + 1])
        logits, h, cache = run(model.mtp.params[0], model.params, hidden[:, t:t + 1], tokens[:, t:t + 1],
                               cache.positions(1), cache, **kwargs)
        steps_logits.append(logits), steps_h.append(h)
    real = np.asarray(positions >= 0)
    got_logits, got_h = np.concatenate(steps_logits, 1), np.concatenate(steps_h, 1)
    np.testing.assert_allclose(got_logits[real], np.asarray(full_logits)[real], **tolerance("mla absorbed"))
    np.testing.assert_allclose(got_h[real], np.asarray(full_h)[real], **tolerance("mla absorbed"))
    # and the module really attends: its last output changes when an earlier position's token does
    changed = run(model.mtp.params[0], model.params, hidden, tokens.at[:, 6].set(4), positions, None, **kwargs)[0]
    assert np.abs(np.asarray(changed)[:, -1] - np.asarray(full_logits)[:, -1]).max() > 1e-3


@pytest.mark.parametrize("case", ["missing eh_proj", "enorm of the wrong shape", "mtp disabled in config.json"])
def test_broken_mtp_checkpoints(built, tmp_path, case):
    _, _, own, root = built
    if case == "missing eh_proj":
        bad, match = _write(root / "mtp", tmp_path / "bad", drop=[MTP + "eh_proj.weight"]), \
            f"tensor '{MTP}eh_proj.weight' is missing"
    elif case == "enorm of the wrong shape":
        bad, match = _write(root / "mtp", tmp_path / "bad", {MTP + "enorm.weight": np.ones(D + 1, np.float32)}), \
            rf"tensor '{MTP}enorm.weight' .* has shape \[{D + 1}\]"
    else:  # the tensors are there but config.json says there are no MTP layers
        bad, match = _write(root / "mtp", tmp_path / "bad", config={"num_nextn_predict_layers": 0}), \
            f"tensor '{MTP}.*' .* is not used by this architecture"
    with pytest.raises(ValueError, match=match):
        jaxkv.load(bad)


def test_cast_carries_the_mtp_modules(built):
    _, _, _, root = built
    model = jaxkv.load(root / "mtp", dtype="float32")
    half = cast(model, "bfloat16")
    assert half.mtp.config.dtype == "bfloat16" and len(half.mtp.params) == 1
    for path, leaf in jax.tree_util.tree_flatten_with_path(half.mtp.params[0])[0]:
        router = path[-1].key in ("router", "router_bias")  # kept float32, as the decoder's
        assert leaf.dtype == (jnp.float32 if router else jnp.bfloat16), jax.tree_util.keystr(path)
    h = jnp.zeros((1, 3, D), jnp.bfloat16)
    logits, _, _ = mtp_forward(half.mtp.params[0], half.params, h, jnp.asarray(TOKENS[:1, :3]), jnp.arange(3)[None],
                               config=half.mtp.config)
    assert np.isfinite(np.asarray(logits)).all()
