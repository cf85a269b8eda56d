"""jaxkv.moe against transformers' DeepseekV3MoE and DeepseekV2Moe (float32), module by module.

Ties: the weights and hidden states are continuous random draws, so two router scores tie with probability zero;
`assert_no_near_ties` (helpers.hf) checks it for every token (the gap between the A-th and (A+1)-th choice scores,
and between the topk_group-th and next group scores, is well above float32 rounding), so the expert-id comparison
can only fail on a real routing difference. Where a tie did occur, jax.lax.top_k would pick the lower expert id and
torch.topk makes no promise.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import moe as moe_lib
from jaxkv.moe import Moe, MoeConfig, route

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE  # noqa: E402

from helpers.hf import assert_no_near_ties  # noqa: E402
from helpers.tolerances import atol  # noqa: E402

# float32 throughout (their reasons: helpers.tolerances).
WEIGHT_TOL = atol("moe routing weights")
OUT_TOL = atol("moe outputs")

D = 32
# name -> (version, HF config fields). Several experts per token, shared experts, scaling != 1, both norm settings,
# group-limited top-k with topk_group < n_group.
CASES = {
    "v3-grouped-norm": ("v3", dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                   norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=2)),
    "v3-grouped-unnormed": ("v3", dict(n_routed_experts=12, num_experts_per_tok=3, n_group=3, topk_group=2,
                                       norm_topk_prob=False, routed_scaling_factor=1.5, n_shared_experts=1)),
    "v3-one-group": ("v3", dict(n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                                norm_topk_prob=True, routed_scaling_factor=0.75, n_shared_experts=1)),
    "v2-greedy": ("v2", dict(n_routed_experts=12, num_experts_per_tok=3, topk_method="greedy",
                             routed_scaling_factor=2.0, n_shared_experts=2)),
    "v2-group-limited": ("v2", dict(n_routed_experts=16, num_experts_per_tok=4, topk_method="group_limited_greedy",
                                    n_group=4, topk_group=2, routed_scaling_factor=16.0, n_shared_experts=1)),
}


def moe_config(version: str, hf: dict, ffn: int = 16) -> MoeConfig:
    greedy = version == "v2" and hf["topk_method"] == "greedy"
    return MoeConfig(
        n_routed_experts=hf["n_routed_experts"], experts_per_token=hf["num_experts_per_tok"], moe_ffn_dim=ffn,
        n_shared_experts=hf["n_shared_experts"], scoring="sigmoid" if version == "v3" else "softmax",
        topk_method="noaux_tc" if version == "v3" else hf["topk_method"],
        n_group=1 if greedy else hf["n_group"], topk_group=1 if greedy else hf["topk_group"],
        routed_scaling_factor=hf["routed_scaling_factor"],
        # transformers' V2 router never normalizes
        norm_topk_prob=hf.get("norm_topk_prob", False) if version == "v3" else False)


def hf_module(version: str, hf: dict, seed: int = 0, ffn: int = 16):
    """A transformers MoE block with random weights (and a random correction bias for V3)."""
    if version == "v3":
        config = transformers.DeepseekV3Config(hidden_size=D, moe_intermediate_size=ffn, **hf)
        module = DeepseekV3MoE(config)
    else:
        config = transformers.DeepseekV2Config(hidden_size=D, moe_intermediate_size=ffn, **hf)
        module = DeepseekV2Moe(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        if version == "v3":
            module.gate.e_score_correction_bias.copy_(torch.randn(hf["n_routed_experts"], generator=g) * 0.1)
    return module.eval()


def jax_params(module, moe: MoeConfig, dtype="float32") -> dict:
    """The HF block's weights as Moe parameters ([out, in] forms, then laid out)."""
    t = {name: p.detach().numpy() for name, p in module.named_parameters()}
    I = moe.moe_ffn_dim
    out_in = {"router": t["gate.weight"], "we_gate": t["experts.gate_up_proj"][:, :I],
              "we_up": t["experts.gate_up_proj"][:, I:], "we_down": t["experts.down_proj"],
              "ws_gate": t["shared_experts.gate_proj.weight"], "ws_up": t["shared_experts.up_proj.weight"],
              "ws_down": t["shared_experts.down_proj.weight"]}
    if moe.topk_method == "noaux_tc":
        out_in["router_bias"] = module.gate.e_score_correction_bias.numpy()
    return {k: jnp.asarray(v) for k, v in moe_lib.from_out_in(out_in, moe, D, dtype).items()}


def hidden(B=2, T=7, seed=1):
    return np.random.default_rng(seed).normal(size=(B, T, D)).astype(np.float32)


@pytest.mark.parametrize("name", sorted(CASES))
def test_routing_matches_transformers(name):
    version, hf = CASES[name]
    moe = moe_config(version, hf)
    module = hf_module(version, hf)
    x = hidden().reshape(-1, D)
    with torch.no_grad():
        logits_t, weights_t, ids_t = module.gate(torch.from_numpy(x))
    params = jax_params(module, moe)
    logits = jnp.einsum("md,xd->mx", x, params["router"])
    np.testing.assert_allclose(logits, logits_t.numpy(), atol=1e-6, rtol=0)
    bias = params.get("router_bias")
    assert_no_near_ties(logits, moe, bias)
    weights, ids = route(logits, moe, bias)
    ids_t, weights_t = ids_t.numpy(), weights_t.numpy()
    # transformers' order within a token is unspecified (topk sorted=False): compare sorted by expert id
    ours, theirs = np.argsort(ids, axis=-1), np.argsort(ids_t, axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), ours, -1),
                                  np.take_along_axis(ids_t, theirs, -1))
    # on the scale of the probabilities: routed_scaling_factor (up to 16 here) multiplies both sides' rounding
    scale = moe.routed_scaling_factor
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), ours, -1) / scale,
                               np.take_along_axis(weights_t, theirs, -1) / scale, atol=WEIGHT_TOL, rtol=0)


# "auto" is "grouped" (Moe.__call__), the same program: its mapping runs in the default-dispatch tests
# (test_one_token_decode_shape_matches_transformers against transformers, test_return_routing_matches_route).
@pytest.mark.parametrize("dispatch", ["grouped", "dense", "sorted", "gather"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_block_matches_transformers(name, dispatch):
    version, hf = CASES[name]
    moe = moe_config(version, hf)
    module = hf_module(version, hf)
    x = hidden()
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    out = Moe(moe, D, dispatch=dispatch).apply({"params": jax_params(module, moe)}, jnp.asarray(x))
    np.testing.assert_allclose(out, expected, atol=OUT_TOL, rtol=0)


@pytest.mark.parametrize("name", ["v3-grouped-norm", "v2-greedy"])
def test_one_token_decode_shape_matches_transformers(name):
    """One row (the decode step: A tiles of one real row each)."""
    version, hf = CASES[name]
    moe = moe_config(version, hf)
    module = hf_module(version, hf, seed=3)
    x = hidden(B=1, T=1, seed=4)
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    out = Moe(moe, D).apply({"params": jax_params(module, moe)}, jnp.asarray(x))
    np.testing.assert_allclose(out, expected, atol=OUT_TOL, rtol=0)


def test_out_in_experts_match_transformers():
    """Experts of D x I >= 2**21 elements are stored [out, in] (`stored_out_in`), the shared ones too."""
    hf = dict(n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, norm_topk_prob=True,
              routed_scaling_factor=2.5, n_shared_experts=1)
    I = (1 << 21) // D
    moe = moe_config("v3", hf, ffn=I)
    assert moe_lib.in_out_names(moe, D, "float32") == frozenset()
    module = hf_module("v3", hf, ffn=I)
    x = hidden(T=3)
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    params = jax_params(module, moe)
    assert params["we_gate"].shape == (4, I, D) and params["we_down"].shape == (4, D, I)
    for dispatch in ("grouped", "dense", "sorted", "gather"):
        # jitted: one compile per dispatch instead of ~35 op-by-op ones over these large expert weights
        out = jax.jit(Moe(moe, D, dispatch=dispatch).apply)({"params": params}, jnp.asarray(x))
        np.testing.assert_allclose(out, expected, atol=OUT_TOL, rtol=0, err_msg=dispatch)


@pytest.mark.parametrize("name", ["v3-grouped-norm", "v2-group-limited"])
def test_bfloat16_block_is_as_close_to_float32_as_transformers_bfloat16(name):
    """bfloat16 experts (the router stays float32, as transformers keeps it) run on every dispatch (XLA:CPU has no
    batched bf16 x bf16 -> f32 dot: `moe._f32`) and land no farther from the float32 block than transformers'
    own bfloat16 run does (x1.5: different rounding orders)."""
    version, hf = CASES[name]
    moe = moe_config(version, hf)
    module = hf_module(version, hf)
    params = {k: v if k.startswith("router") else v.astype(jnp.bfloat16) for k, v in jax_params(module, moe).items()}
    x = hidden()
    with torch.no_grad():
        reference = module(torch.from_numpy(x)).numpy()
        theirs = module.to(torch.bfloat16)(torch.from_numpy(x).to(torch.bfloat16)).float().numpy()
    their_error = np.abs(theirs - reference).max()
    for dispatch in ("grouped", "dense", "sorted", "gather"):
        out = Moe(moe, D, dtype="bfloat16", dispatch=dispatch).apply({"params": params}, jnp.asarray(x, jnp.bfloat16))
        assert out.dtype == jnp.bfloat16
        assert np.abs(np.asarray(out, np.float32) - reference).max() <= 1.5 * their_error, dispatch


def test_wrong_routing_is_caught():
    """The comparison can fail: a router that drops the correction bias picks other experts for some token."""
    version, hf = CASES["v3-grouped-norm"]
    moe = moe_config(version, hf)
    module = hf_module(version, hf)
    with torch.no_grad():
        module.gate.e_score_correction_bias.mul_(20.0)  # large enough to change choices
        x = hidden().reshape(-1, D)
        ids_t = module.gate(torch.from_numpy(x))[2].numpy()
    params = jax_params(module, moe)
    logits = jnp.einsum("md,xd->mx", x, params["router"])
    _, ids = route(logits, moe, jnp.zeros_like(params["router_bias"]))
    assert not np.array_equal(np.sort(np.asarray(ids), -1), np.sort(ids_t, -1))


def test_in_out_layouts_agree():
    """[in, out] and [out, in] expert weights give the same block (a 2**21-element expert is stored [out, in])."""
    big = MoeConfig(n_routed_experts=4, experts_per_token=2, moe_ffn_dim=2048, n_shared_experts=1)
    assert moe_lib.in_out_names(big, 1024, "float32") == frozenset()
    assert moe_lib.in_out_names(big, 64, "float32") == frozenset(moe_lib.OUT_IN_ORDER)
    small = MoeConfig(n_routed_experts=4, experts_per_token=2, moe_ffn_dim=8)  # no shared experts: routed only
    params = Moe(small, 16).init(jax.random.PRNGKey(0), jnp.zeros((1, 3, 16)))["params"]
    assert params["we_gate"].shape == (4, 16, 8) and params["we_down"].shape == (4, 8, 16)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 16)), jnp.float32)
    expected = Moe(small, 16).apply({"params": params}, x[None])[0]
    weights, ids = route(jnp.einsum("md,xd->mx", x, params["router"]), small)
    gate, up, down = (jnp.swapaxes(params[k], 1, 2) for k in ("we_gate", "we_up", "we_down"))  # [out, in]
    for dispatch in ("grouped", "dense", "sorted", "gather"):
        experts = moe_lib.Experts(gate, up, down, None, (False, False), moe_lib.activation(small))
        y = moe_lib._DISPATCH[dispatch](x, weights, ids, experts)
        np.testing.assert_allclose(y, expected, atol=1e-6, rtol=0)


def _count_eqns(jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _count_eqns(sub)
    return n


@pytest.mark.parametrize("dispatch", ["grouped", "dense", "sorted", "gather"])
def test_no_loop_over_tokens_and_one_compile(dispatch):
    """The traced program does not grow with the token count (no Python loop over tokens), and a fixed shape
    compiles once whatever the routing."""
    version, hf = CASES["v3-grouped-norm"]
    moe = moe_config(version, hf)
    params = jax_params(hf_module(version, hf), moe)
    block = Moe(moe, D, dispatch=dispatch)
    sizes = {T: _count_eqns(jax.make_jaxpr(lambda x: block.apply({"params": params}, x))(
        jnp.zeros((2, T, D))).jaxpr) for T in (1, 8, 64)}
    assert len(set(sizes.values())) == 1, sizes
    fn = jax.jit(lambda p, x: block.apply({"params": p}, x))
    for seed in range(3):  # different hidden states route to different experts
        fn(params, jnp.asarray(hidden(seed=seed))).block_until_ready()
    assert fn._cache_size() == 1


def test_return_routing_matches_route():
    version, hf = CASES["v2-group-limited"]
    moe = moe_config(version, hf)
    params = jax_params(hf_module(version, hf), moe)
    x = jnp.asarray(hidden())
    _, state = Moe(moe, D).apply({"params": params}, x, mutable=["intermediates"])
    ids, weights = state["intermediates"]["expert_ids"][0], state["intermediates"]["expert_weights"][0]
    w, i = route(jnp.einsum("md,xd->mx", x.reshape(-1, D), params["router"]), moe)
    np.testing.assert_array_equal(ids.reshape(-1, moe.experts_per_token), i)
    np.testing.assert_array_equal(weights.reshape(-1, moe.experts_per_token), w)


@pytest.mark.parametrize("fields, message", [
    (dict(experts_per_token=9), "exceeds moe.n_routed_experts"),
    (dict(moe_ffn_dim=0), "moe_ffn_dim must be an integer >= 1"),
    (dict(scoring="relu"), "moe.scoring"),
    (dict(topk_method="top1"), "moe.topk_method"),
    (dict(n_group=2), "'greedy' has no groups"),
    (dict(topk_method="group_limited_greedy", n_group=3, topk_group=1), "multiple of moe.n_group"),
    (dict(topk_method="group_limited_greedy", n_group=4, topk_group=5), "exceeds moe.n_group"),
    (dict(topk_method="group_limited_greedy", n_group=4, topk_group=1, experts_per_token=3), "hold fewer than"),
    (dict(topk_method="noaux_tc", n_group=8, topk_group=4, experts_per_token=2), "two best experts"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor"),
    (dict(n_shared_experts=-1), "n_shared_experts"),
    (dict(norm_topk_prob=1), "norm_topk_prob must be a bool"),
])
def test_bad_config_is_a_clear_error(fields, message):
    base = dict(n_routed_experts=8, experts_per_token=2, moe_ffn_dim=16)
    with pytest.raises(ValueError, match=message):
        MoeConfig(**{**base, **fields})


def test_bad_input_is_a_clear_error():
    moe = MoeConfig(n_routed_experts=8, experts_per_token=2, moe_ffn_dim=16, topk_method="noaux_tc",
                    scoring="sigmoid", n_group=2, topk_group=1)
    with pytest.raises(ValueError, match="needs a correction bias"):
        route(jnp.zeros((3, 8)), moe)
    with pytest.raises(ValueError, match=r"\[M, X=8\]"):
        route(jnp.zeros((3, 7)), moe, jnp.zeros(8))
    with pytest.raises(ValueError, match=r"\[B, T, D=32\]"):
        Moe(moe, D).init(jax.random.PRNGKey(0), jnp.zeros((3, 16)))
    with pytest.raises(ValueError, match="dispatch"):
        Moe(moe, D, dispatch="loop").init(jax.random.PRNGKey(0), jnp.zeros((1, 3, D)))


@pytest.mark.parametrize("variant", ["gpt-oss", "llama4"])
def test_variant_dispatches_equal_a_per_token_loop(variant):
    """gpt-oss's experts (logit bias, top-k softmax, expert biases, clamped SwiGLU that binds) and Llama 4's (top-k
    sigmoid scaling each expert's input, a shared expert): every dispatch equals a plain loop over tokens and
    their chosen experts, written from transformers' formulas."""
    if variant == "gpt-oss":
        cfg = MoeConfig(n_routed_experts=6, experts_per_token=2, moe_ffn_dim=8, scoring="topk_softmax",
                        router_logit_bias=True, expert_bias=True, swiglu_limit=0.5)
    else:
        cfg = MoeConfig(n_routed_experts=6, experts_per_token=2, moe_ffn_dim=8, scoring="topk_sigmoid",
                        scale_expert_input=True, shared_expert_ffn_dim=8)
    D, rng = 16, np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(1, 7, D)), jnp.float32)
    params = Moe(cfg, D).init(jax.random.PRNGKey(0), x)["params"]
    params = jax.tree_util.tree_map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 0.5, p.dtype), params)
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    names = moe_lib.in_out_names(cfg, D, "float32")
    # every expert matrix in its [X, out, in] form, the shared expert's [out, in]
    w = {k: (p[k] if k not in names else np.swapaxes(p[k], 1, 2)) for k in ("we_gate", "we_up", "we_down")}
    w |= {k: (p[k] if k not in names else p[k].T) for k in ("ws_gate", "ws_up", "ws_down") if k in p}
    want = np.zeros((7, D))
    for m, h in enumerate(np.asarray(x[0], np.float64)):
        logits = p["router"] @ h + (p["router_logit_bias"] if cfg.router_logit_bias else 0)
        ids = np.argsort(-logits)[:2]
        top = logits[ids]
        if variant == "gpt-oss":
            weights = np.exp(top - top.max()) / np.exp(top - top.max()).sum()
        else:
            weights = 1 / (1 + np.exp(-top))
        for e, g in zip(ids, weights):
            inp = h * g if cfg.scale_expert_input else h
            gate, up = w["we_gate"][e] @ inp, w["we_up"][e] @ inp
            if cfg.expert_bias:
                gate, up = gate + p["we_gate_bias"][e], up + p["we_up_bias"][e]
            if cfg.swiglu_limit is None:
                hidden = gate / (1 + np.exp(-gate)) * up
            else:
                gate, up = np.minimum(gate, 0.5), np.clip(up, -0.5, 0.5)
                hidden = (up + 1) * gate / (1 + np.exp(-1.702 * gate))
            out = w["we_down"][e] @ hidden + (p["we_down_bias"][e] if cfg.expert_bias else 0)
            want[m] += out if cfg.scale_expert_input else g * out
        if cfg.shared_ffn_dim:
            sg, su = w["ws_gate"] @ h, w["ws_up"] @ h
            want[m] += w["ws_down"] @ (sg / (1 + np.exp(-sg)) * su)
    for dispatch in ("grouped", "dense", "sorted", "gather"):
        got = Moe(cfg, D, dispatch=dispatch).apply({"params": params}, x)[0]
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0, err_msg=dispatch)
