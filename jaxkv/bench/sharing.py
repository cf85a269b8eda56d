"""The sharing benchmark: parallel samples of one prompt and prompt caching, against what users would run instead.

    jaxkv bench sharing [--config small] [--prompt-len 1024] [--n 16] [--new-tokens 128] [--reps 3] [--no-hf]
    python scripts/bench_sharing.py ...            (the same)

One process, the same random weights, round-robin repetitions (medians), compile excluded (one warm-up of each):

  shared:      jaxkv.generate([prompt], n=N, temperature=1): the prompt prefilled once, N samples forked from it
               on a paged cache.
  unshared:    jaxkv.generate([prompt] * N, temperature=1): today's contiguous path, N private copies.
  transformers generate(num_return_sequences=N, do_sample=True, top_k=0) on the same weights (float32, CPU).

It prints the peak KV bytes (shared: pages in use at the end, which is the peak, and the pool allocated;
unshared: the cache allocated and the bytes its prompts + new tokens need), end-to-end seconds and the ratios.
Then prompt caching: `--calls` calls that share the prompt as a prefix, each with its own `--suffix-len` suffix,
through one `jaxkv.PrefixCache`; time to first token (a call with max_new_tokens=1) of the first call against the
median of the others. The whole sequence runs twice on fresh caches; the second (compiled) pass is reported.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

TARGETS = {"peak_bytes_ratio": 4.0, "speedup_vs_unshared": 2.0, "speedup_vs_hf": 2.0, "ttft_ratio": 5.0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="jaxkv bench sharing", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="small", help="preset (default small)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--n", type=int, default=16, help="samples of the prompt")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--calls", type=int, default=8, help="prompt-caching calls")
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    p.add_argument("--out", default=None, help="write the figures as JSON to this file")
    return p.parse_args(argv)


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run(args) -> dict:
    # Long on purpose: the scenario's calls side by side in the order they are timed.
    import numpy as np

    import jaxkv
    from jaxkv.bench.decode import HFRunner, settle
    from jaxkv.config import PRESETS

    config = PRESETS[args.config]
    model = jaxkv.Model.random(config, seed=0)
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, config.vocab_size, args.prompt_len).tolist()
    common = dict(max_new_tokens=args.new_tokens, temperature=1.0, stop_tokens=[])

    def shared(seed):
        return jaxkv.generate(model, [prompt], n=args.n, page_size=args.page_size, seed=seed, **common)

    def unshared(seed):
        return jaxkv.generate(model, [prompt] * args.n, seed=seed, **common)

    runners = {"shared": shared, "unshared": unshared}
    if args.hf:
        import torch

        hf = HFRunner(model, "float32").model
        ids = torch.tensor([prompt], dtype=torch.int64)

        def transformers(seed):
            torch.manual_seed(seed)
            with torch.inference_mode():
                return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, top_p=1.0,
                                   temperature=1.0, num_return_sequences=args.n, max_new_tokens=args.new_tokens,
                                   min_new_tokens=args.new_tokens, pad_token_id=0, eos_token_id=None)

        runners["transformers"] = transformers
    print(f"sharing: {args.config}, prompt {args.prompt_len}, {args.n} samples of {args.new_tokens} new tokens, "
          f"temperature 1; {args.reps} rounds of {', '.join(runners)} (one warm-up each)", file=sys.stderr)
    last, seconds = {}, {name: [] for name in runners}
    for name, fn in runners.items():
        last[name] = fn(0)  # compiles
    for rep in range(args.reps):
        for name, fn in runners.items():
            settle()
            s, last[name] = _timed(lambda: fn(rep + 1))
            seconds[name].append(s)
        print(f"  round {rep + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in seconds.items()), file=sys.stderr)
    med = {name: statistics.median(v) for name, v in seconds.items()}
    s_stats, u_stats = last["shared"].stats, last["unshared"].stats
    result = {
        "args": vars(args),
        "seconds": seconds, "median_s": med,
        "shared_peak_bytes": s_stats["kv_bytes_in_use_peak"], "shared_pool_bytes": s_stats["kv_cache_bytes"],
        "unshared_allocated_bytes": u_stats["kv_cache_bytes"],
        "unshared_needed_bytes": u_stats["kv_cache_bytes_requested"],
        "distinct_samples": len({tuple(t) for t in last["shared"].tokens}),
    }
    result["peak_bytes_ratio"] = result["unshared_allocated_bytes"] / result["shared_pool_bytes"]
    result["peak_bytes_ratio_in_use"] = result["unshared_needed_bytes"] / result["shared_peak_bytes"]
    result["speedup_vs_unshared"] = med["unshared"] / med["shared"]
    if "transformers" in med:
        result["speedup_vs_hf"] = med["transformers"] / med["shared"]
    result.update(prompt_caching(model, prompt, args))
    return result


def prompt_caching(model, prompt, args) -> dict:
    import numpy as np

    import jaxkv

    rng = np.random.default_rng(1)
    suffixes = [rng.integers(1, model.config.vocab_size, args.suffix_len).tolist() for _ in range(args.calls)]
    need = jaxkv.memory.plan_pages(model.config, [args.prompt_len + args.suffix_len], 1,
                                   page_size=args.page_size).pages_needed
    num_pages = 1 << (2 * need + args.calls * 2).bit_length()  # the prefix and every call's own pages, cached
    for attempt in range(2):  # the first pass compiles; the second is timed
        pc = jaxkv.PrefixCache(model, num_pages=num_pages, page_size=args.page_size)
        ttft, hits = [], []
        for suffix in suffixes:
            s, out = _timed(lambda: jaxkv.generate(model, [prompt + suffix], max_new_tokens=1, prefix_cache=pc))
            ttft.append(s)
            hits.append(out.stats["prefix_hit_tokens"])
    rest = statistics.median(ttft[1:])
    return {"ttft_s": ttft, "prefix_hit_tokens": hits, "ttft_first_s": ttft[0], "ttft_rest_median_s": rest,
            "ttft_ratio": ttft[0] / rest}


def report(r: dict) -> str:
    a = r["args"]
    lines = [f"sharing ({a['config']}, float32, prompt {a['prompt_len']}, {a['n']} samples x {a['new_tokens']} new, "
             f"temperature 1, medians of {a['reps']}):"]
    lines.append(f"  peak KV bytes: shared pool {r['shared_pool_bytes']:,} ({r['shared_peak_bytes']:,} in use) vs "
                 f"generate([prompt] * {a['n']}) {r['unshared_allocated_bytes']:,} allocated "
                 f"({r['unshared_needed_bytes']:,} needed): {r['peak_bytes_ratio']:.1f}x less allocated, "
                 f"{r['peak_bytes_ratio_in_use']:.1f}x less in use (target {TARGETS['peak_bytes_ratio']:.0f}x)")
    med = r["median_s"]
    line = (f"  end to end: shared {med['shared']:.2f} s, unshared {med['unshared']:.2f} s: "
            f"{r['speedup_vs_unshared']:.2f}x (target {TARGETS['speedup_vs_unshared']:.0f}x)")
    if "speedup_vs_hf" in r:
        line += (f"; transformers {med['transformers']:.2f} s: {r['speedup_vs_hf']:.2f}x "
                 f"(target {TARGETS['speedup_vs_hf']:.0f}x)")
    lines.append(line)
    lines.append(f"  samples: {r['distinct_samples']} distinct of {a['n']}")
    lines.append(f"  prompt caching ({a['calls']} calls, {a['prompt_len']}-token shared prefix, {a['suffix_len']}-token "
                 f"suffixes): time to first token {r['ttft_first_s'] * 1e3:.0f} ms for call 1, median "
                 f"{r['ttft_rest_median_s'] * 1e3:.0f} ms for calls 2-{a['calls']}: {r['ttft_ratio']:.1f}x lower "
                 f"(target {TARGETS['ttft_ratio']:.0f}x); prefix hits {r['prefix_hit_tokens']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    for name in ("prompt_len", "n", "new_tokens", "page_size", "calls", "suffix_len", "reps"):
        if getattr(args, name) < 1:
            print(f"jaxkv bench sharing: error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.hf:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError:
            print("transformers/torch not installed: skipping them (pip install 'jaxkv[test]')", file=sys.stderr)
            args.hf = False
    from jaxkv.config import PRESETS

    if args.config not in PRESETS:
        print(f"jaxkv bench sharing: error: unknown config {args.config!r}; choose from {sorted(PRESETS)}",
              file=sys.stderr)
        return 2
    r = run(args)
    print(report(r), flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(r, indent=2, default=float))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
