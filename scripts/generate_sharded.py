"""Generate for a batch of prompts on a ("data", "model") device mesh and print the per-device cache bytes.

    python scripts/generate_sharded.py [--data D] [--model M] [--checkpoint tiny|DIR] [--prompt TEXT ...]
        [--max-new-tokens 32] [--cache-dtype DTYPE] [--attention auto|xla|pallas] [--pmap]

The mesh uses D x M devices (default: every device on "data", M = 1): the batch is split over "data", attention
heads and the FFN over "model", the KV cache over both (`jaxkv.sharding`). `--pmap` runs `jaxkv.generate_pmap`
instead (data parallel over the local devices, no mesh).

On a CPU-only machine, ask XLA for several host devices before running:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/generate_sharded.py --data 2 --model 2

Several hosts (a TPU pod slice, GPU nodes): run the same command on every host with `--distributed` (calls
`jax.distributed.initialize()`, which finds the coordinator on TPU pods and under SLURM/Open MPI by itself), or
pass `--coordinator HOST:PORT --num-processes N --process-id I` explicitly; D x M then counts all hosts' devices.
Every process must pass the same prompts; process 0 prints.

Bad input: one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np

import jaxkv
import jaxkv.sharding

DEFAULT_PROMPTS = ["The KV cache", "Attention is", "A transformer", "In Python,", "The model"]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=int, default=None, help="devices on the 'data' (batch) axis")
    parser.add_argument("--model", type=int, default=1, help="devices on the 'model' (heads, FFN) axis")
    parser.add_argument("--checkpoint", default="tiny", help="'tiny' (bundled), a jaxkv or Hugging Face directory")
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--cache-dtype", default=None)
    parser.add_argument("--attention", default=None, choices=["auto", "xla", "pallas"])
    parser.add_argument("--pmap", action="store_true", help="jaxkv.generate_pmap over the local devices")
    parser.add_argument("--distributed", action="store_true", help="jax.distributed.initialize() (auto-detect)")
    parser.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (implies --distributed)")
    parser.add_argument("--num-processes", type=int, default=None)
    parser.add_argument("--process-id", type=int, default=None)
    return parser.parse_args(argv)


def make_mesh(data: int | None, model: int) -> jax.sharding.Mesh:
    """A (data, model) mesh over the first data x model devices; ValueError if there are not that many."""
    available = jax.device_count()
    if model < 1 or (data is not None and data < 1):
        raise ValueError(f"--data and --model must be >= 1, got {data} and {model}")
    if data is None:
        if available % model:
            raise ValueError(f"--model {model} does not divide the {available} devices")
        data = available // model
    if data * model > available:
        raise ValueError(f"a {data} x {model} mesh needs {data * model} devices, {available} available (on CPU: "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={data * model})")
    if data * model == available:  # lets jax order the devices for the interconnect (and across hosts)
        return jax.make_mesh((data, model), jaxkv.sharding.AXES)
    devices = np.array(jax.devices()[: data * model]).reshape(data, model)
    return jax.sharding.Mesh(devices, jaxkv.sharding.AXES)


def run(args) -> int:
    if args.distributed or args.coordinator:
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id)
    model = jaxkv.load(args.checkpoint)
    prompts = args.prompt or DEFAULT_PROMPTS
    if model.tokenizer is None:
        raise ValueError(f"{args.checkpoint} has no tokenizer: this script takes text prompts")
    kwargs = dict(max_new_tokens=args.max_new_tokens, cache_dtype=args.cache_dtype, attention=args.attention)
    if args.pmap:
        gen, layout = jaxkv.generate_pmap(model, prompts, **kwargs), f"pmap over {jax.local_device_count()} devices"
    else:
        mesh = make_mesh(args.data, args.model)
        gen = jaxkv.generate(model, prompts, mesh=mesh, **kwargs)
        kv = jaxkv.sharding.sharded_kv_heads(model.config, mesh)
        layout = (f"mesh data={mesh.shape['data']} x model={mesh.shape['model']}, KV heads "
                  f"{model.config.n_kv_heads}" + (f" replicated to {kv}" if kv != model.config.n_kv_heads else ""))
    if jax.process_index() != 0:
        return 0
    for prompt, tokens, text in zip(prompts, gen.tokens, gen.text):
        print(f"{prompt!r} -> {text!r}\n    {tokens}")
    s = gen.stats
    print(f"{layout}; padded batch {s['padded_batch']}, cache {s['cache_capacity']} slots {s['cache_dtype']}: "
          f"{s['kv_cache_bytes']} bytes in all, {s['kv_cache_bytes_per_device']} per device; "
          f"{s['decode_tokens_per_s']:.1f} tok/s decode, compile {s['compile_s']:.1f} s")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"generate_sharded: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
