"""The first `jaxkv.generate` call of a fresh process, compile included: cold (empty persistent compilation
cache), warm (the cache the cold run filled) and with the cache off.

    python scripts/first_call.py [--config small] [--prompt 128] [--new 64] [--reps 3]

Each measurement is a new Python process (`python -c ...`, the environment's JAXKV_COMPILE_CACHE set to a fresh
temporary directory, to that same directory again, or to 0) that imports jaxkv, builds the random preset model
(`jaxkv.Model.random`, seed 0, float32) and times one `jaxkv.generate(model, [prompt], max_new_tokens=N,
stop_tokens=[])`; it prints the call's wall seconds, its stats["compile_s"] and the seconds from process start to
the call's end. Medians over --reps processes per mode (a fresh cache directory for every cold run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import numpy as np
import jaxkv
from jaxkv.config import PRESETS
model = jaxkv.Model.random(PRESETS[sys.argv[1]], seed=0)
prompt = [int(t) for t in np.random.default_rng(0).integers(1, model.config.vocab_size, int(sys.argv[2]))]
t1 = time.perf_counter()
g = jaxkv.generate(model, [prompt], max_new_tokens=int(sys.argv[3]), stop_tokens=[])
t2 = time.perf_counter()
print(json.dumps({"call_s": t2 - t1, "compile_s": g.stats["compile_s"], "process_s": t2 - t0}))
"""


def run(config: str, prompt: int, new: int, cache: str) -> dict:
    env = dict(os.environ, JAXKV_COMPILE_CACHE=cache)
    out = subprocess.run([sys.executable, "-c", CHILD, config, str(prompt), str(new)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    results = {"cold": [], "warm": [], "off": []}
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory() as cache:
            results["cold"].append(run(args.config, args.prompt, args.new, cache))
            results["warm"].append(run(args.config, args.prompt, args.new, cache))
        results["off"].append(run(args.config, args.prompt, args.new, "0"))
    print(f"first jaxkv.generate call, {args.config}, prompt {args.prompt}, {args.new} new tokens, medians of "
          f"{args.reps} processes:")
    for mode, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"  {mode:5s} call {med['call_s']:.2f} s (compile {med['compile_s']:.2f} s), process start to "
              f"result {med['process_s']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
