"""One process of the multi-process test (`tests/test_multiprocess.py` launches two of these).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 \
        python tests/multiprocess_worker.py PORT PROCESS_ID NUM_PROCESSES DATAxMODEL [DATAxMODEL ...]

Each process has its own CPU devices; together they form one global ("data", "model") mesh of DATA x MODEL
devices for each shape given, in turn (one pair of processes serves every shape the test checks: the process
start and the coordinator's handshake are most of a run). Every process passes the same prompts (as `generate`
requires) and prints, per shape, the tokens it reads back as one JSON line on stdout.
"""

import json
import sys

import jax

import jaxkv

# What every process generates; the test compares it with single-process generation of the same model.
CONFIG = jaxkv.Config(vocab_size=128, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=128)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
NEW_TOKENS = 8
SEED = 1


def main(port: str, process_id: str, num_processes: str, *shapes: str):
    # XLA:CPU needs a cross-process collectives backend for collectives between processes; gloo ships with jaxlib.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=int(num_processes),
                               process_id=int(process_id), initialization_timeout=120)
    model = jaxkv.Model.random(CONFIG, seed=SEED)
    for shape in shapes:
        data, size = map(int, shape.split("x"))
        mesh = jax.make_mesh((data, size), ("data", "model"))
        gen = jaxkv.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, stop_tokens=[], mesh=mesh)
        print(json.dumps({"shape": shape, "process": jax.process_index(), "processes": jax.process_count(),
                          "devices": jax.device_count(), "local_devices": jax.local_device_count(),
                          "tokens": gen.tokens, "kv_cache_bytes": gen.stats["kv_cache_bytes"],
                          "kv_cache_bytes_per_device": gen.stats["kv_cache_bytes_per_device"]}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
