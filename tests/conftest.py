"""Shared fixtures: tiny configs covering every attention and position variant.

XLA_FLAGS must be set before jax is first imported, so multi-device tests can see 8 host devices; nothing here
depends on the device count otherwise.
"""

import gc
import os
import pathlib
import sys

# Transitional (issue 28, the move into folders): every test folder importable by module name, so that the cross-file
# imports still resolve whichever file a worker imports first. Goes once the shared code is in tests/helpers.
for _folder in sorted(pathlib.Path(__file__).resolve().parent.iterdir()):
    if _folder.is_dir() and not _folder.name.startswith((".", "_")):
        sys.path.insert(0, str(_folder))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

# The suite is compile-bound (thousands of small programs, each run a few times): XLA:CPU's LLVM backend at
# optimization level 0 cut a sample of test files' CPU time by 26-37% (docs/design/testing.md). The HLO
# passes, and so every program's structure and what the HLO tests read, are unchanged. Outside the tests (the
# library, its commands, the benchmarks) XLA's defaults apply.
FAST_COMPILE = "--xla_backend_optimization_level=0"  # also in the XLA_FLAGS of the tests' own subprocesses
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}")
# No persistent compilation cache in tests (tests/test_compile_cache.py turns it on in its own processes): compile
# counts and compile times must not depend on what an earlier run left on disk.
os.environ.setdefault("JAXKV_COMPILE_CACHE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jaxkv  # noqa: E402

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


@pytest.fixture(params=sorted(CONFIGS))
def any_model(request):
    return model_for(request.param)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_code():
    """Drops every compiled executable after each test file. XLA:CPU maps the code of each executable into memory
    (several mappings each); the whole suite compiles thousands of programs, and one process crossed Linux's limit
    of 65,530 mappings (vm.max_map_count): mmap failed inside the compiler and the process died with a segfault.
    Files rarely share compiled shapes, so clearing costs little."""
    yield
    jax.clear_caches()
    gc.collect()
