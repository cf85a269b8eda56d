"""The gated delta rule's decode step (one token per sequence) as a Pallas kernel.

The spec is `jaxkv.layers.delta_rule.recurrent` with T == 1 (same arguments, same results). Letters as there:
B batch, Hk query/key heads, Hv value heads (a multiple of Hk), Dk / Dv the key / value head dims.

What a program does
-------------------
One program per (sequence b, value head h), grid (B, Hv), both axes parallel. It reads the head's float32 state
S [Dk, Dv] once (TPU: one DMA into VMEM; GPU: one load into registers, Triton having no explicit shared-memory
staging for a block that is used element-wise), and in that one residence:

    S     = S * exp(g)                  decayed
    kv    = k . S            [1, Dv]    what S already predicts for k
    delta = (v - kv) * beta  [1, Dv]    the delta rule's correction
    S     = S + k delta^T               written back (into the same HBM buffer: `input_output_aliases`)
    out   = q . S            [1, Dv]    read after the write, as the reference does

The l2-normalization of q and k (epsilon 1e-6 under the square root, as transformers and the FLA kernels) and q's
scaling by Dk ** -0.5 happen inside the kernel, on the program's [Dk, 1] columns (a handful of flops next to the
state's Dk x Dv). The wrapper only casts q, k, v, g, beta to float32 and reshapes them, both free or fused: the
vectors are 1 / Dk of the state's bytes. Value head h reads q/k head h // (Hv // Hk) (repeat_interleave, as the
reference), chosen by the q/k BlockSpecs' index map: nothing is repeated in memory.

The two matrix-vector products are element-wise products and sums over the Dk (sublane) axis in float32, not
dots: a [1, Dk] x [Dk, Dv] product is below Triton's 16-row minimum for tl.dot, on TPU the MXU's float32 path
would need HIGHEST precision (several bf16 passes) for the reference's accuracy, and on GPU a float32 dot is TF32
by default. The step does ~6 Dk Dv flops on 8 Dk Dv bytes (the state read and written), so it is bound by memory
bandwidth either way. Accuracy: the same float32 products as the reference, summed in another order.

Layout: q and k reach the program as columns [Dk, 1] (the outer product k delta^T broadcasts a column against a
row), v and the outputs as rows [1, Dv], g and beta as [1, 1]. Every block is the array's full last two dims, which
Mosaic accepts at any size (128 in real models, 8 or 12 in tests) and Triton at powers of two; on GPU other sizes
are zero-padded to the next power of two (exact: zero key rows and value columns stay zero through the step), at
the cost of a padded copy of the state, as decode_kernel pads an odd head dim. Real models (Dk = Dv = 128) take
no copy.

One body serves both Pallas backends: it uses only loads, stores, element-wise math and reductions, which lower
to Mosaic and to Triton alike. `platform` picks the compiler parameters (and the GPU padding).

In place: the state is input 5 and output 1 of the pallas_call (`input_output_aliases`), so under jit XLA writes
the new state into the old one's buffer when that buffer is dead afterwards (a donated or loop-carried cache);
otherwise XLA copies it first, as it would for any in-place update.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxkv.attention.pallas_namespace import pl, pltpu, pltriton, require_triton

from jaxkv.attention.decode_kernel import next_pow2, pad_axis
from jaxkv.attention.pallas import PLATFORMS, default_platform

# transformers' (and the FLA kernels') l2norm epsilon; `jaxkv.layers.delta_rule._L2_EPS` (the attention package
# does not import the layers; tests/attention/test_delta_rule_kernel.py checks the two agree).
L2_EPS = 1e-6
STATE_INPUT = 5  # the state's position among the pallas_call's inputs: aliased to output 1


def _l2norm(x):
    """x [D, 1] float32 scaled to unit length (with the reference's epsilon)."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=0, keepdims=True) + L2_EPS)


def _step_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, state_ref, out_ref, new_state_ref, *, scale: float):
    """Grid (B, Hv). q_ref, k_ref [Dk, 1] (the value head's q/k head); v_ref [1, Dv]; g_ref, beta_ref [1, 1];
    state_ref [Dk, Dv]; outputs out_ref [1, Dv], new_state_ref [Dk, Dv] (the same HBM buffer as state_ref). All
    float32."""
    q = _l2norm(q_ref[...]) * scale  # [Dk, 1]; normalized, then scaled, in the reference's order
    k = _l2norm(k_ref[...])  # [Dk, 1]
    S = state_ref[...] * jnp.exp(g_ref[...])  # [Dk, Dv] * [1, 1]
    kv_mem = jnp.sum(S * k, axis=0, keepdims=True)  # [1, Dv]
    delta = (v_ref[...] - kv_mem) * beta_ref[...]  # [1, Dv]
    S = S + k * delta  # [Dk, 1] x [1, Dv] outer product
    new_state_ref[...] = S
    out_ref[...] = jnp.sum(S * q, axis=0, keepdims=True)  # [1, Dv]


def _compiler_params(platform: str, Dk: int, Dv: int):
    if platform == "tpu":
        return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
    # The [Dk, Dv] float32 state lives in registers: at 128 x 128 that is 128 floats per thread over 4 warps, so
    # large states get 8 warps (64 per thread). Not measured on a device. Explicit Triton parameters also keep JAX
    # 0.10 from lowering a GPU pallas_call with Mosaic GPU.
    require_triton()
    return pltriton.CompilerParams(num_warps=8 if Dk * Dv > 64 * 64 else 4, num_stages=1)


def recurrent_step(q, k, v, g, beta, state, *, interpret=None, platform: str | None = None):
    """One gated delta rule step per sequence: `delta_rule.recurrent` at T == 1, as a Pallas kernel.

    Args:
      q, k: [B, 1, Hk, Dk], any float dtype (l2-normalized and q scaled by Dk ** -0.5 in the kernel).
      v: [B, 1, Hv, Dv], Hv a multiple of Hk: value head h reads q/k head h // (Hv // Hk).
      g: [B, 1, Hv], the log decay (<= 0); beta: [B, 1, Hv], the step. g = beta = 0 leaves the state unchanged.
      state: float32 [B, Hv, Dk, Dv]; updated in place where XLA can (module docstring).
      interpret: run in the Pallas interpreter; None means "only on CPU".
      platform: "tpu" (Mosaic) or "gpu" (Triton) compiler parameters; None picks the default backend's.

    Returns:
      (out [B, 1, Hv, Dv] in v.dtype, the new state float32 [B, Hv, Dk, Dv]). Computed in float32.

    Raises:
      ValueError: shapes that do not fit (T != 1, Hv not a multiple of Hk, a state of another shape), an unknown
        platform.
    """
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2], v.shape[3]
    if T != 1:
        raise ValueError(f"recurrent_step takes one token per sequence, got T={T} (delta_rule.chunked for more)")
    if q.shape != k.shape or v.shape[:2] != (B, 1) or g.shape != (B, 1, Hv) or beta.shape != (B, 1, Hv):
        raise ValueError(f"shapes do not fit: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, beta {beta.shape}")
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    if state.shape != (B, Hv, Dk, Dv):
        raise ValueError(f"state must have shape {(B, Hv, Dk, Dv)} (B, Hv, Dk, Dv), got {state.shape}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    platform = platform or default_platform()
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    rep, f32 = Hv // Hk, jnp.float32
    # Free reshapes (T == 1): q/k heads become columns, v a row per head, g and beta [1, 1] blocks.
    qc = q.astype(f32).reshape(B, Hk, Dk, 1)
    kc = k.astype(f32).reshape(B, Hk, Dk, 1)
    vr = v.astype(f32).reshape(B, Hv, 1, Dv)
    gs = g.astype(f32).reshape(B, Hv, 1, 1)
    bs = beta.astype(f32).reshape(B, Hv, 1, 1)
    S = state.astype(f32)
    Dkp, Dvp = Dk, Dv
    if platform == "gpu":  # Triton tensors have power-of-two sizes; zero padding is an exact no-op (docstring)
        Dkp, Dvp = next_pow2(Dk), next_pow2(Dv)
        qc, kc = pad_axis(qc, 2, Dkp), pad_axis(kc, 2, Dkp)
        vr = pad_axis(vr, 3, Dvp)
        S = pad_axis(pad_axis(S, 2, Dkp), 3, Dvp)

    def qk_map(b, h):  # repeat_interleave: value head h reads q/k head h // rep
        # lax.div (truncating; h >= 0), not //: jnp's floor division needs sign(), which Mosaic lowers only for a
        # known TPU generation, so a lowering from a host without one would fail
        return b, lax.div(h, rep), 0, 0

    def head_map(b, h):
        return b, h, 0, 0

    out, S = pl.pallas_call(
        functools.partial(_step_kernel, scale=Dk ** -0.5),  # the real Dk's scale, whatever the padding
        grid=(B, Hv),
        in_specs=[pl.BlockSpec((None, None, Dkp, 1), qk_map), pl.BlockSpec((None, None, Dkp, 1), qk_map),
                  pl.BlockSpec((None, None, 1, Dvp), head_map), pl.BlockSpec((None, None, 1, 1), head_map),
                  pl.BlockSpec((None, None, 1, 1), head_map), pl.BlockSpec((None, None, Dkp, Dvp), head_map)],
        out_specs=[pl.BlockSpec((None, None, 1, Dvp), head_map), pl.BlockSpec((None, None, Dkp, Dvp), head_map)],
        out_shape=[jax.ShapeDtypeStruct((B, Hv, 1, Dvp), f32), jax.ShapeDtypeStruct((B, Hv, Dkp, Dvp), f32)],
        input_output_aliases={STATE_INPUT: 1},
        compiler_params=_compiler_params(platform, Dkp, Dvp),
        interpret=interpret,
        name="jaxkv_delta_rule_step",
    )(qc, kc, vr, gs, bs, S)
    if (Dkp, Dvp) != (Dk, Dv):
        out, S = out[..., :Dv], S[:, :, :Dk, :Dv]
    return out.reshape(B, 1, Hv, Dv).astype(v.dtype), S  # [B, Hv, 1, Dv] -> [B, 1, Hv, Dv]: a free reshape
