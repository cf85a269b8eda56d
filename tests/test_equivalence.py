"""Whole-model equivalence: cached decoding equals recomputing the whole prefix."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from helpers.models import CONFIGS, model_for, left_pad, recompute
from helpers.tolerances import atol

# float32 on CPU: cached and recomputed logits differ only by summation order (helpers.tolerances).
ATOL = {"float32": atol("cached vs recomputed")}
STEPS = 33


def cached_step_logits(model, prompts, steps, capacity):
    """Greedy decode with prefill + decode_step; returns (tokens [B, steps], logits [B, steps, V]) where
    logits[:, i] is what token i was chosen from."""
    cfg = model.config
    tokens, start = left_pad(prompts)
    logits, cache = jaxkv.prefill(model.params, tokens, start, config=cfg,
                                  capacity=capacity, attention="xla")
    all_logits, all_tokens = [], []
    for _ in range(steps):
        all_logits.append(np.asarray(logits))
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        all_tokens.append(np.asarray(nxt))
        logits, cache = jaxkv.decode_step(model.params, nxt, cache, config=cfg)
    return np.stack(all_tokens, 1), np.stack(all_logits, 1)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_decode_equals_recompute(name):
    model = model_for(name)
    prompt = [5, 17, 3, 88, 41, 9, 60]
    toks, step_logits = cached_step_logits(model, [prompt], STEPS, capacity=64)
    full = jaxkv.logits(model, [prompt + toks[0].tolist()])[0]  # [len, V]; row t sees tokens <= t only
    expected = full[len(prompt) - 1: len(prompt) - 1 + STEPS]
    np.testing.assert_allclose(step_logits[0], expected, atol=ATOL["float32"], rtol=0)


@pytest.mark.parametrize("name", ["gqa", "learned", "sliding"])
def test_cached_decode_equals_recompute_ragged_batch(name):
    """Left-padded rows of different lengths: each row's step logits equal its own recompute."""
    model = model_for(name)
    prompts = [[7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7, 1, 8, 2, 8]]
    toks, step_logits = cached_step_logits(model, prompts, STEPS, capacity=48)
    fulls = recompute(model, [prompt + toks[b].tolist() for b, prompt in enumerate(prompts)])
    for b, prompt in enumerate(prompts):
        expected = fulls[b][len(prompt) - 1: len(prompt) - 1 + STEPS]
        np.testing.assert_allclose(step_logits[b], expected, atol=ATOL["float32"], rtol=0, err_msg=f"row {b}")


def test_sliding_window_actually_limits_attention():
    """The sliding-window model must differ from the same weights without a window once the context exceeds it
    (otherwise the window tests above would pass with the window ignored)."""
    model = model_for("sliding")
    unwindowed = jaxkv.Model(CONFIGS["sliding"].replace(sliding_window=None), model.params)
    seq = list(range(1, 30))
    a, b = jaxkv.logits(model, [seq])[0], jaxkv.logits(unwindowed, [seq])[0]
    window = CONFIGS["sliding"].sliding_window
    np.testing.assert_allclose(a[:window], b[:window], atol=ATOL["float32"])  # inside the window: identical
    assert np.abs(a[window:] - b[window:]).max() > 1e-3


# A model whose FFN reaches OUT_IN_ELEMENTS (1,024 x 2,048 = 2**21) stores it [out, in], and a batch-1 decode step
# multiplies it as a matrix-vector product on jax >= 0.11 (`jaxkv.layers.linear.linear`) while prefill uses the
# einsum.
WIDE = jaxkv.Config(vocab_size=64, d_model=1024, n_layers=1, n_heads=8, n_kv_heads=2, ffn_dim=2048,
                    max_positions=128)


def test_batch_one_steps_of_an_out_in_model_equal_recompute():
    from jaxkv.layers.linear import in_out_names
    assert "w_down" not in in_out_names(WIDE) and "w_up" not in in_out_names(WIDE)  # [out, in]: the matvec path
    model = jaxkv.Model.random(WIDE, seed=3)
    prompt = [5, 17, 3, 40, 9]
    toks, step_logits = cached_step_logits(model, [prompt], 8, capacity=32)
    full = jaxkv.logits(model, [prompt + toks[0].tolist()])[0]
    np.testing.assert_allclose(step_logits[0], full[len(prompt) - 1: len(prompt) - 1 + 8],
                               atol=ATOL["float32"], rtol=0)


def test_the_matvec_form_is_the_einsum():
    """`linear` for one token and an [out, in] weight of OUT_IN_ELEMENTS is w @ x (a dot_general with a vector
    operand) on XLA:CPU from jax 0.11, and gives the einsum's values; a batch of two, an [in, out] weight, a
    smaller weight, and jax 0.10 keep the einsum."""
    import jax

    from jaxkv.layers.linear import OUT_IN_ELEMENTS, einsum_repacks_out_in, linear
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((OUT_IN_ELEMENTS // 1024, 1024), np.float32))  # [out, in]
    x = jnp.asarray(rng.standard_normal((1, 1, 1024), np.float32))
    ref = np.einsum("bti,oi->bto", np.asarray(x, np.float64), np.asarray(w, np.float64))
    # float32 sums of 1,024 products of N(0, 1) values (results of order 30): rounding ~1e-5 of the result
    np.testing.assert_allclose(linear(x, w, out_in=True), ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(linear(x, w.T, out_in=False), ref, rtol=1e-5, atol=1e-4)

    def vector_dots(x, w, out_in):
        jaxpr = jax.make_jaxpr(lambda x, w: linear(x, w, out_in))(x, w)
        return [e for e in jaxpr.eqns if e.primitive.name == "dot_general" and min(v.aval.ndim for v in e.invars) == 1]

    assert einsum_repacks_out_in() == (jax.__version_info__[:2] >= (0, 11))  # the tests run on XLA:CPU
    assert len(vector_dots(x, w, True)) == einsum_repacks_out_in()
    assert not vector_dots(x, w.T, False)
    assert not vector_dots(jnp.concatenate([x, x]), w, True)
    assert not vector_dots(x, w[:64], True)
