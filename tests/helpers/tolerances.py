"""Every numeric tolerance the tests compare with, in one table keyed by (purpose, dtype), each entry with its reason.

A test names what it compares (`tolerance("kernel", q.dtype)`, `atol("transformers logits")`) instead of declaring a
number of its own, so that a tolerance is widened or tightened in one place and for one stated reason. Literal
bounds left inline in a test are local to one assertion (a hand-computed case, a count), said there.

Bounds measured on a machine say so ("measured ..."); the rest follow from the arithmetic: float32 sums of the same
terms in another order differ by a few ulps of the result (~1e-7 relative), a few layers deep ~1e-5.
"""

import numpy as np

# (purpose, dtype) -> dict(atol=, rtol=): what np.testing.assert_allclose takes.
TOLERANCES = {
    # jaxkv against transformers on the same weights (tiny random models, 2-3 layers): the two libraries sum in
    # different orders (matmul blocking, softmax, norms), so logits of magnitude ~1-10 differ by up to ~3e-5; 1e-4
    # leaves margin yet fails any mapping error (a wrong rope, window, norm or bias moves logits by 1e-2 and up).
    ("transformers logits", "float32"): dict(atol=1e-4, rtol=0),
    # Gemma (2, 3 and 4) against transformers: twice the above. Gemma scales the embeddings by sqrt(d_model) and
    # normalizes four times per layer, so float32 rounding in the two libraries' summation orders lands further
    # apart: measured up to 1.13e-4 on an AMD EPYC (Zen 4) machine on 2026-12-01, under 1e-4 on the Intel machines
    # before. A wrong rope, window, norm or softcap moves logits by far more (test_gemma's test_each_feature_matters).
    ("transformers logits, gemma", "float32"): dict(atol=2e-4, rtol=0),
    # A hybrid model's logits (Qwen3-Next: tests/families/test_qwen3_next.py) against transformers in float64 and in
    # float32. The linear layers' gated RMSNorm scales each value head of the delta rule's output to unit RMS, and on
    # the random test models some heads are nearly zero (rms 1e-5, where the read q.S cancels): their float32
    # rounding is amplified 1e3-fold. Measured: transformers' own float32 logits up to 2.1e-3 from its float64 ones
    # (jaxkv's up to 1.8e-3) over 40 and 150 tokens, on logits of magnitude 4-8; 5e-3 leaves ~2x, while a wrong
    # gate, norm, split, rotation or state moves logits by O(1).
    ("transformers logits, hybrid", "float32"): dict(atol=5e-3, rtol=0),
    # Beam hypothesis scores against transformers': both sum the same log-probabilities, from logits that agree to
    # ~1e-5, over up to 12 steps.
    ("transformers beam scores", "float32"): dict(atol=1e-4, rtol=0),
    # Cached decoding against recomputing the whole prefix (no cache): only the summation order in the attention
    # and matmuls differs.
    ("cached vs recomputed", "float32"): dict(atol=1e-5, rtol=0),
    # A weight-only quantized model (`jaxkv.layers.quantized`) against the float model of its dequantized weights:
    # the same products, but a dequantized weight feeds its einsum inside the jitted program in one and is a
    # stored array in the other, so XLA may fuse and order the sums differently (measured up to 1.2e-5 on
    # logits of magnitude ~20); a weight read on a wrong axis or unscaled moves them by O(1).
    ("quantized vs dequantized float", "float32"): dict(atol=1e-4, rtol=0),
    # Log-probabilities (generate's logprobs, score, the engine) against log_softmax of the no-cache forward pass:
    # the cached and recomputed passes differ in summation order (a cache vs the sequence, one chunk vs several),
    # a few ulps of logits of magnitude ~10, so up to ~1e-5 after the log-softmax; 1e-4 leaves margin.
    ("logprobs", "float32"): dict(atol=1e-4, rtol=0),
    # The paged cache against the contiguous one: the same products gathered in another layout; only the
    # softmax's padding (dead slots, exactly zero) differs.
    ("paged vs contiguous", "float32"): dict(atol=1e-5, rtol=0),
    # Sharded generation against one device: the sharded matmuls sum the same products in another order (partial
    # sums over heads, FFN or expert columns, then an all-reduce): logits and log-probabilities differ in the last
    # bits only.
    ("sharded vs one device", "float32"): dict(atol=1e-5, rtol=0),
    # A speculative verify pass computes k + 1 positions at once: the first layer's K/V are the same products
    # (exact), a later layer's come from attention outputs summed in another order, measured up to 1.5e-6 (4.5e-6
    # relative) on a 2-layer tiny model; a K/V written for a rejected token instead would be off by O(1).
    ("speculative cache", "float32"): dict(atol=1e-6, rtol=2e-5),
    # The XLA attention reference against itself by another route (through the dispatch, or hand-computed cases of
    # a handful of numbers): float32 rounding only.
    ("attention reference", "float32"): dict(atol=1e-6, rtol=0),
    # The live-length (prefix) attention path against the full masked formula: the same arithmetic on the same
    # slots; only the float32 sums run over a different number of (exactly zero) dead terms, which can change
    # their order.
    ("live prefix", "float32"): dict(atol=1e-6, rtol=1e-5),
    # A Pallas kernel (contiguous, paged, MLA) against its XLA reference, keyed by the query's dtype. float32:
    # both accumulate in float32 in a different order (block-wise online softmax vs one pass), a few ulps of O(1)
    # outputs (~1e-6), so 1e-5 leaves margin yet catches any masking or rescaling error (O(1e-2) and up). A cache in
    # another dtype (bfloat16, float16, int8 or fp8 with scales) holds the same numbers for both sides, and both
    # compute in float32 from them (1-byte caches cast exactly into q's dtype, scales applied per score /
    # probability column: a reordering of float32 products, ~1 ulp).
    ("kernel", "float32"): dict(atol=1e-5, rtol=1e-5),
    # bfloat16 queries: the output is rounded to bfloat16 (relative step 2^-8 = 4e-3) and the kernel rounds the
    # softmax probabilities to bfloat16 for the P.V matmul (as flash kernels do for the MXU / tensor cores) where
    # the reference keeps them in float32: errors of a few 2^-8 on outputs of magnitude <= ~2.
    ("kernel", "bfloat16"): dict(atol=2e-2, rtol=2e-2),
    # MLA's absorbed decode against the expanded per-head recompute: the same float32 math, reassociated.
    ("mla absorbed", "float32"): dict(atol=1e-5, rtol=0),
    # A quantized latent cache (per-slot scales) against the float32 cache, on logits of standard deviation 1 (max
    # 3.8): int8 keeps steps of 1/254 of a row's range, fp8 e4m3 a 3-bit mantissa. Measured max differences over 8
    # steps of 3 rows: 0.066 (int8) and 0.28 (fp8), against 0.021 for a bfloat16 cache; the bounds leave about 2x.
    ("quantized latent cache", "int8"): dict(atol=0.15, rtol=0),
    ("quantized latent cache", "float8_e4m3fn"): dict(atol=0.6, rtol=0),
    # 16-bit weights (and caches) against float32, same logits: measured max differences over prefill + 4 steps of
    # 3 rows 0.065 (bfloat16, 8-bit mantissa) and 0.0086 (float16, 11-bit); the bounds leave about 2x.
    ("16-bit weights", "bfloat16"): dict(atol=0.15, rtol=0),
    ("16-bit weights", "float16"): dict(atol=0.02, rtol=0),
    # The MoE router's weights against transformers' (DeepseekV2/V3 MoE modules): a few float32 ops from the
    # same logits.
    ("moe routing weights", "float32"): dict(atol=1e-6, rtol=0),
    # The MoE block's outputs (magnitudes up to ~3) against transformers': A + 1 SwiGLUs summed in a different
    # order: measured up to 1.0e-5 apart on an AMD EPYC (Zen 4) machine on 2026-12-01 (under 1e-5 on the Intel
    # machines before), so 2e-5.
    ("moe outputs", "float32"): dict(atol=2e-5, rtol=0),
}

# Margins a reference output must clear for a comparison with it to mean something (not tolerances of jaxkv's
# error: bounds below which the reference itself is ambiguous).
THRESHOLDS = {
    # A greedy step whose two best logits are closer than this could flip on float noise alone (both
    # implementations are right then): ten times the transformers tolerance.
    "greedy margin": 10 * TOLERANCES[("transformers logits", "float32")]["atol"],
    # An expert choice closer than this to the next candidate would make comparing routed expert ids depend on
    # rounding (router scores are a few float32 ops from the logits, ~1e-6).
    "moe tie gap": 1e-5,
}


def _dtype_name(dtype) -> str:
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def tolerance(purpose: str, dtype="float32") -> dict:
    """dict(atol=, rtol=) for comparing `purpose` in `dtype` (a name, a numpy or jax dtype)."""
    return dict(TOLERANCES[(purpose, _dtype_name(dtype))])


def atol(purpose: str, dtype="float32") -> float:
    return TOLERANCES[(purpose, _dtype_name(dtype))]["atol"]


def by_dtype(purpose: str) -> dict:
    """{dtype name: dict(atol=, rtol=)} of every dtype the table holds for `purpose`."""
    return {dtype: dict(tol) for (p, dtype), tol in TOLERANCES.items() if p == purpose}


def threshold(purpose: str) -> float:
    return THRESHOLDS[purpose]
