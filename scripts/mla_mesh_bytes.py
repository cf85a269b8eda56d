"""Per-device KV-cache bytes of an MLA model and a GQA model of similar size on ("data", "model") meshes.

    python scripts/mla_mesh_bytes.py [--batch 8] [--tokens 1024] [--cache-dtype bfloat16] [--meshes 8x1,2x4,1x8]

Each model's cache is built by `jaxkv.prefill(..., mesh=)` on the sharded weights, the path `generate(mesh=)` runs,
and measured as the sum of the addressable shards' nbytes on one device (`jaxkv.sharding.cache_bytes_per_device`).
The MLA latent cache is split over "data" and replicated over "model" (one row per token, shared by all heads);
the GQA cache is split over "data" and KV heads, its KV heads repeated to lcm(K, M) when M does not divide K.
On a CPU-only machine the script asks XLA for 8 host devices itself (before JAX starts).

Bad input: one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import sharding  # noqa: E402
from jaxkv.config import Mla  # noqa: E402

# Two models of about the same weights (D 1024, 16 query heads, 4 layers): DeepSeek-V2-Lite's attention shape
# scaled down (R = 256, E = 32) against Llama-style GQA with 4 KV heads of 64.
COMMON = dict(vocab_size=1024, d_model=1024, n_layers=4, n_heads=16, ffn_dim=2048, max_positions=4096)
MODELS = {
    "mla": jaxkv.Config(**COMMON, mla=Mla(kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                                          q_lora_rank=384)),
    "gqa": jaxkv.Config(**COMMON, n_kv_heads=4, head_dim=64),
}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="sequences (a multiple of every mesh's data axis)")
    parser.add_argument("--tokens", type=int, default=1024, help="cache slots per sequence")
    parser.add_argument("--cache-dtype", default="bfloat16")
    parser.add_argument("--meshes", default="8x1,2x4,1x8", help="comma-separated DATAxMODEL shapes")
    args = parser.parse_args(argv)
    try:
        meshes = [tuple(int(n) for n in shape.split("x")) for shape in args.meshes.split(",")]
        if any(len(shape) != 2 for shape in meshes):
            raise ValueError
    except ValueError:
        raise ValueError(f"--meshes must look like 8x1,2x4, got {args.meshes!r}") from None
    args.meshes = meshes
    for data, model in args.meshes:
        if data < 1 or model < 1 or data * model > jax.device_count():
            raise ValueError(f"a {data} x {model} mesh needs {data * model} devices, {jax.device_count()} available")
        if args.batch % data:
            raise ValueError(f"--batch {args.batch} must divide over the data axis of the {data} x {model} mesh")
    if args.batch < 1 or args.tokens < 2:
        raise ValueError(f"--batch must be >= 1 and --tokens >= 2, got {args.batch} and {args.tokens}")
    jaxkv.cache.check_cache_dtype(args.cache_dtype)
    return args


def measure(model: jaxkv.Model, data: int, model_axis: int, batch: int, tokens: int, cache_dtype: str) -> dict:
    """Whole and per-device cache bytes (and weight bytes per device) of `model` prefilled on a data x model mesh."""
    mesh = sharding.check_mesh(Mesh(np.array(jax.devices()[: data * model_axis]).reshape(data, model_axis),
                                    sharding.AXES))
    params, config = sharding.shard_params(model.params, model.config, mesh)
    rows = NamedSharding(mesh, sharding.BATCH_SPEC)
    prompt = sharding.global_array(np.ones((batch, 2), np.int32), rows)
    start = sharding.global_array(np.zeros((batch,), np.int32), rows)
    _, cache = jaxkv.prefill(params, prompt, start, config=config, capacity=tokens, cache_dtype=cache_dtype,
                             attention="xla", mesh=mesh)
    device = cache.keys[0].addressable_shards[0].device
    weights = sum(s.data.nbytes for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards
                  if s.device == device)
    return dict(total=cache.nbytes(), per_device=sharding.cache_bytes_per_device(cache), weights=weights,
                spec=str(cache.keys[0].sharding.spec), kv_heads=config.n_kv_heads)


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"batch {args.batch}, {args.tokens} slots, cache {args.cache_dtype}; bytes on one device")
    print(f"{'model':<5} {'params':>10} {'mesh':>5} {'cache total':>12} {'cache/device':>13} {'weights/device':>15}"
          f"  cache spec (cached KV heads)")
    for name, config in MODELS.items():
        model = jaxkv.Model.random(config, seed=0)
        for data, model_axis in args.meshes:
            got = measure(model, data, model_axis, args.batch, args.tokens, args.cache_dtype)
            print(f"{name:<5} {config.param_count():>10,} {data}x{model_axis:<3} {got['total']:>12,} "
                  f"{got['per_device']:>13,} {got['weights']:>15,}  {got['spec']} ({got['kv_heads']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
