"""What the test files share (issue 28: no test file imports another; they all import from here).

    env.py         the test process's environment: XLA flags (FAST_COMPILE), the repository's paths; no jax import
    tolerances.py  every numeric tolerance, keyed by purpose and dtype, each with its reason
    models.py      tiny random models (CONFIGS, model_for), left_pad, recompute, placed_like, a tiny MLA config
    hf.py          the transformers parity harness: shared prompts, build_hf, hf_logits, hf_greedy, hf_beam_search,
                   greedy_cases, assert_clear_margins, assert_no_near_ties, and the parity test bodies families share
    kernels.py     running Pallas kernels against their references: run, inputs, PLATFORMS, BLOCKS, page layouts
    compiles.py    count_compiles: XLA compiles counted through jax.monitoring
    hlo.py         reading compiled HLO text: whole-buffer copies, collectives
    text.py        tokenizers built in memory (byte-level BPE)
    server.py      start_server: `jaxkv serve` as a subprocess

The folder is importable as `helpers` because tests/conftest.py puts tests/ on sys.path. Nothing here is collected
(no test_ names) and nothing here imports a test file (tests/test_layout.py checks both directions).
"""
