"""The Pallas delta-rule decode step (`jaxkv.attention.delta_rule_kernel.recurrent_step`) against
`jaxkv.layers.delta_rule.recurrent` (the reference) at T == 1, its lowering, and the Gated DeltaNet layer's choice
between the two.

On CPU the kernel runs in the Pallas interpreter with both platforms' settings (one body; "gpu" also pads dims that
are not powers of two). With JAXKV_PALLAS_COMPILED=1 (set by scripts/device_check.py on a GPU or TPU machine) it
runs compiled, the device's platform only.

Inputs follow the model's ranges (as tests/layers/test_delta_rule.py): q/k/v ~ N(0, 1), g = -A * softplus(a) with A
log-uniform in [0.01, 2], beta = sigmoid(N(0, 1)), a random initial state; the first step's q and k are shrunk to
norms near the l2norm's epsilon, where a wrong epsilon shows. Steps are chained: each side carries its own state.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.attention import delta_rule_kernel
from jaxkv.cache.contiguous import KVCache
from jaxkv.config import LinearAttention
from jaxkv.layers import delta_rule
from jaxkv.layers.gated_delta import GatedDeltaNet

from helpers import kernels
# the interpreter on CPU; compiled with JAXKV_PALLAS_COMPILED=1
from helpers.kernels import INTERPRET, PLATFORMS, lowered_text

# Kernel against reference, keyed by the inputs' dtype. The state is float32 on both sides whatever the inputs,
# computed from the same (rounded) inputs with the same float32 products; only the order of the two Dk-long sums
# differs (the kernel's reductions vs the reference's einsum): a few ulps of O(1) numbers, ~1e-7, over a handful
# of chained steps. 1e-5 leaves margin and still catches a wrong epsilon, scale, head mapping or step order
# (O(1e-2) and up). bfloat16 inputs give a bfloat16 output: the two float32 results, ~1e-7 apart, round to the
# same bfloat16 or, across a rounding boundary, to neighbours one bfloat16 ulp apart (<= 2^-7 relative); the
# state stays at the float32 bound.
TOL = {"float32": dict(atol=1e-5, rtol=1e-5), "bfloat16": dict(atol=1e-6, rtol=2 ** -7)}
STATE_TOL = TOL["float32"]
STEPS = 5
PAD_STEP = 2  # in this step row 0 is padding (g = beta = 0, q/k/v arbitrary): its state must not change at all


@functools.lru_cache(maxsize=None)
def _kernel(platform):
    def step(q, k, v, g, beta, state):
        return delta_rule_kernel.recurrent_step(q, k, v, g, beta, state, platform=platform, interpret=INTERPRET)

    return step


def _reference(q, k, v, g, beta, state):
    return delta_rule.recurrent(q, k, v, g, beta, state)


def _inputs(seed, B, Hk, Hv, Dk, Dv, dtype):
    """STEPS steps of (q, k [B, 1, Hk, Dk], v [B, 1, Hv, Dv] in dtype; g float32, beta in dtype [B, 1, Hv]), as
    the layer passes them, and a float32 state [B, Hv, Dk, Dv]."""
    rng = np.random.default_rng(seed)
    A = np.exp(rng.uniform(np.log(0.01), np.log(2.0), Hv))
    steps = []
    for t in range(STEPS):
        q, k = rng.standard_normal((2, B, 1, Hk, Dk))
        if t == 0:
            q, k = q * 1e-3, k * 1e-3  # |q|^2 ~ Dk * 1e-6, near the epsilon (1e-6)
        v = rng.standard_normal((B, 1, Hv, Dv))
        g = -A * np.logaddexp(0.0, rng.standard_normal((B, 1, Hv)))
        beta = 1 / (1 + np.exp(-rng.standard_normal((B, 1, Hv))))
        if t == PAD_STEP:
            g[0], beta[0] = 0.0, 0.0
            q[0], k[0], v[0] = q[0] * 3, k[0] * 3, v[0] * 3  # padding tokens' q/k/v are anything
        steps.append((jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(g, jnp.float32),
                      jnp.asarray(beta, dtype)))
    return steps, jnp.asarray(rng.standard_normal((B, Hv, Dk, Dv)) * 0.5, jnp.float32)


# (B, Hk, Hv, Dk, Dv): real-model head dims (Qwen3-Next: 128) and small ones, among them the tiny test model's
# (8, 12) and a Dk of 12 (sizes that are not powers of two: the GPU settings pad them, and q's scale must stay the
# real Dk's); Hv == Hk and Hv = 2 Hk, 3 Hk and 4 Hk (the tiny model's).
SHAPES = [(3, 2, 2, 8, 12), (3, 2, 4, 8, 12), (2, 1, 3, 12, 8), (2, 2, 4, 16, 32), (2, 2, 2, 128, 128),
          (2, 2, 4, 128, 128)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("B,Hk,Hv,Dk,Dv", SHAPES)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_chained_steps_match_reference(platform, B, Hk, Hv, Dk, Dv, dtype):
    """STEPS decode steps, each side carrying its own state: every step's output and state against the reference;
    in the padding step row 0's state comes back bit for bit while the other rows move."""
    steps, state = _inputs(Dk + Hv, B, Hk, Hv, Dk, Dv, dtype)
    got_state = want_state = state
    for t, args in enumerate(steps):
        before = got_state
        got, got_state = kernels.run(_kernel(platform), *args, got_state)
        want, want_state = kernels.run(_reference, *args, want_state)
        assert got.dtype == jnp.dtype(dtype) and got.shape == (B, 1, Hv, Dv)
        assert got_state.dtype == jnp.float32 and got_state.shape == (B, Hv, Dk, Dv)
        msg = f"step {t}"
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **TOL[dtype],
                                   err_msg=msg)
        np.testing.assert_allclose(np.asarray(got_state), np.asarray(want_state), **STATE_TOL, err_msg=msg)
        if t == PAD_STEP:
            np.testing.assert_array_equal(np.asarray(got_state[0]), np.asarray(before[0]))
            assert not np.allclose(np.asarray(got_state[1:]), np.asarray(before[1:]))


def test_epsilon_is_the_reference_one():
    assert delta_rule_kernel.L2_EPS == delta_rule._L2_EPS


@pytest.mark.parametrize("platform", PLATFORMS)
def test_refuses_what_it_does_not_serve(platform):
    steps, state = _inputs(0, 2, 2, 4, 8, 12, "float32")
    q, k, v, g, beta = steps[0]
    step = functools.partial(delta_rule_kernel.recurrent_step, platform=platform, interpret=INTERPRET)
    two = [jnp.concatenate([a, a], axis=1) for a in (q, k, v, g, beta)]
    with pytest.raises(ValueError, match="one token per sequence"):
        step(*two, state)
    with pytest.raises(ValueError, match="multiple of key heads"):
        step(q, k, v[:, :, :3], g[..., :3], beta[..., :3], state[:, :3])
    with pytest.raises(ValueError, match="state must have shape"):
        step(q, k, v, g, beta, state[..., :8])
    with pytest.raises(ValueError, match="platform"):
        delta_rule_kernel.recurrent_step(q, k, v, g, beta, state, platform="cuda", interpret=INTERPRET)


# --- the layer's decode step ---------------------------------------------------------------------------------

HYBRID = jaxkv.Config(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_positions=64,
                      layer_types=("linear_attention", "full_attention"),
                      linear_attention=LinearAttention(key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=12))


@pytest.mark.skipif(not INTERPRET, reason="CPU only: a device resolves 'auto' to the kernel")
def test_layer_decode_step_calls_the_kernel_for_pallas_only(monkeypatch):
    """GatedDeltaNet's decode step (T == 1 with a cache): attention "pallas" runs the kernel (interpreted here),
    "xla" and "auto" (on CPU) the reference, to the same result; padding rows keep their state either way; the
    prompt (T > 1) never calls the kernel."""
    calls = []
    real_step = delta_rule_kernel.recurrent_step

    def recording(*args, **kwargs):
        calls.append(args[0].shape)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(delta_rule_kernel, "recurrent_step", recording)
    layer = GatedDeltaNet(HYBRID, 0)
    # jitted (the kernel is recorded as it is traced): eagerly, each of the layer's ops compiled on its own
    apply = jax.jit(layer.apply, static_argnums=4)
    B, D = 3, HYBRID.d_model
    rng = np.random.default_rng(0)
    cache = KVCache.allocate(HYBRID, B, 16)
    prompt = jnp.asarray(rng.standard_normal((B, 5, D)), jnp.float32)
    params = jax.jit(layer.init)(jax.random.PRNGKey(0), prompt, cache, jnp.ones((B, 5), bool))
    _, cache = apply(params, prompt, cache, jnp.ones((B, 5), bool), "pallas")
    assert calls == []  # the prompt's chunked form has no kernel
    x = jnp.asarray(rng.standard_normal((B, 1, D)), jnp.float32)
    real = jnp.asarray([[True], [False], [True]])
    outs = {name: apply(params, x, cache, real, name) for name in ("pallas", "xla", "auto")}
    assert calls == [(B, 1, 2, 8)]  # once, for "pallas"
    (want, want_cache), (got, got_cache) = outs["xla"], outs["pallas"]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL["float32"])
    np.testing.assert_allclose(np.asarray(got_cache.recurrent_states[0]), np.asarray(want_cache.recurrent_states[0]),
                               **STATE_TOL)
    np.testing.assert_array_equal(np.asarray(got_cache.recurrent_states[0][1]),
                                  np.asarray(cache.recurrent_states[0][1]))
    np.testing.assert_array_equal(np.asarray(outs["auto"][0]), np.asarray(want))


def test_layer_defaults_to_the_reference(monkeypatch):
    """Until the decoder passes its attention name the layer's default is "xla": the kernel is not called."""
    monkeypatch.setattr(delta_rule_kernel, "recurrent_step", lambda *a, **k: pytest.fail("kernel called"))
    layer = GatedDeltaNet(HYBRID, 0)
    cache = KVCache.allocate(HYBRID, 2, 8)
    x, real = jnp.ones((2, 1, HYBRID.d_model), jnp.float32), jnp.ones((2, 1), bool)
    params = jax.jit(layer.init)(jax.random.PRNGKey(0), x, cache, real)
    jax.jit(layer.apply)(params, x, cache, real)  # traced as the decoder runs it (eagerly: an op compile each)


# --- lowering for real hardware without the hardware ---------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("platform,lowering_platform,custom_call",
                         [("tpu", "tpu", "tpu_custom_call"), ("gpu", "cuda", "__gpu$xla.gpu.triton")])
def test_lowers_for_device(platform, lowering_platform, custom_call, dtype):
    """The compiled (interpret=False) kernel lowers to Mosaic / Triton IR from any host at the real model's shape
    (Qwen3-Next-80B: B = 8, Hk = 16, Hv = 32, Dk = Dv = 128), with the state aliased in place (output 1 is input
    5's buffer). This runs the whole Pallas lowering (block-shape rules, every primitive's Mosaic or Triton rule)
    but not the device compiler (Mosaic's layout passes live in libtpu, ptxas in the CUDA toolchain)."""
    B, Hk, Hv, Dk, Dv = 8, 16, 32, 128, 128
    shapes = [((B, 1, Hk, Dk), dtype), ((B, 1, Hk, Dk), dtype), ((B, 1, Hv, Dv), dtype), ((B, 1, Hv), jnp.float32),
              ((B, 1, Hv), dtype), ((B, Hv, Dk, Dv), jnp.float32)]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    f = jax.jit(functools.partial(delta_rule_kernel.recurrent_step, platform=platform, interpret=False))
    text = lowered_text(f, args, lowering_platform)
    assert f"stablehlo.custom_call @{custom_call}" in text
    call = next(line for line in text.splitlines() if f"custom_call @{custom_call}" in line)
    alias = ("output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [1], "
             f"operand_index = {delta_rule_kernel.STATE_INPUT}, operand_tuple_indices = []>]")
    assert alias in call
    # the real dims need no padding: the state goes into the kernel as it is, and no pad precedes the call
    assert f"tensor<{B}x{Hv}x{Dk}x{Dv}xf32>" in call and "stablehlo.pad" not in text
