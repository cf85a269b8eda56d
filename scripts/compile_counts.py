"""How many times `jaxkv.generate` compiles as max_new_tokens varies, and how long compiling takes.

    python scripts/compile_counts.py [--model tiny|PATH] [--values 1,2,4,...] [--prompt-len N]

Counts XLA backend compiles (JAX's "/jax/core/compile/backend_compile_duration" events) and the seconds spent
tracing, lowering and compiling, per call, for one prompt and each max_new_tokens value in turn (stop tokens off, so
every call runs all its steps). Prints one line per call, then the totals.
"""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_VALUES = "1,2,3,5,8,13,40,100,200,300,400,512"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="checkpoint directory or 'tiny' (default)")
    parser.add_argument("--values", default=DEFAULT_VALUES, help=f"max_new_tokens values (default {DEFAULT_VALUES})")
    parser.add_argument("--prompt-len", type=int, default=12, help="prompt tokens (default 12)")
    args = parser.parse_args(argv)
    try:
        values = [int(v) for v in args.values.split(",")]
    except ValueError:
        parser.error(f"--values must be comma-separated integers, got {args.values!r}")

    import jax

    import jaxkv

    events = {"compiles": 0, "seconds": 0.0}
    timed = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
             "/jax/core/compile/backend_compile_duration")

    def listen(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            events["compiles"] += 1
        if event in timed:
            events["seconds"] += duration

    jax.monitoring.register_event_duration_secs_listener(listen)
    model = jaxkv.load(args.model)
    prompt = [(7 * i + 3) % model.config.vocab_size for i in range(args.prompt_len)]
    print(f"jaxkv {getattr(jaxkv, '__version__', '')} model {args.model}, prompt {args.prompt_len} tokens, "
          f"{len(values)} values of max_new_tokens", file=sys.stderr)
    jaxkv.generate(model, [prompt], max_new_tokens=1, stop_tokens=[])  # warm the helpers every call shares
    start = dict(events)
    t0 = time.perf_counter()
    for n in values:
        before = dict(events)
        t = time.perf_counter()
        out = jaxkv.generate(model, [prompt], max_new_tokens=n, stop_tokens=[])
        print(f"max_new_tokens {n:5d}: {events['compiles'] - before['compiles']} compiles, "
              f"{events['seconds'] - before['seconds']:6.2f} s compiling, {time.perf_counter() - t:6.2f} s in all, "
              f"capacity {out.stats.get('cache_capacity')}")
    print(f"total: {events['compiles'] - start['compiles']} compiles, {events['seconds'] - start['seconds']:.1f} s "
          f"compiling, {time.perf_counter() - t0:.1f} s in all (after one warm-up call)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
