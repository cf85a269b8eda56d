"""The beam-search benchmark: `jaxkv.beam_search` on the paged cache against transformers' beam search.

    jaxkv bench beam [--config small] [--prompt-len 512] [--new-tokens 64] [--beams 4,8] [--batch 1] [--reps 3]
                     [--no-hf] [--quick] [--out F]
    python scripts/bench_beam.py ...            (the same)

One process, the same random weights (`jaxkv.Model.random(PRESETS[config], seed=0)`, float32) and the same
prompts (--batch prompts of --prompt-len token ids uniform in [1, vocab), numpy seed --seed). For each K in
--beams, two paths:

  jaxkv:         jaxkv.beam_search(model, prompts, num_beams=K, max_new_tokens=N, stop_tokens=[]): each prompt
                 prefilled once, its K beams forks of it on a paged cache (full pages shared).
  transformers   generate(ids, num_beams=K, do_sample=False, max_new_tokens=N, min_new_tokens=N, no eos,
                 early_stopping=False, length_penalty=1.0, num_return_sequences=1) on the same weights (float32,
                 CPU, its default dynamic cache: each prompt expanded to K rows, prefilled K times, K private
                 caches reordered every step).

Every path is warmed up first (one call per K: compiles excluded, and counted in the timed runs to show it), then
--reps rounds, each running every (K, path) once in turn; medians. Without stop tokens every hypothesis runs to N
tokens, so both sides do the same steps.

Reported per K: seconds and the speedup (transformers / jaxkv, target 1.5x); jaxkv's time split (stats
"prefill_s", "search_s"; transformers': its first forward, the prefill, against the others, timed by hooks); KV
bytes: jaxkv's pages in use at the peak (stats "pages_in_use_peak", "kv_bytes_in_use_peak") against K private
caches of prompt + new tokens per prompt (stats "kv_cache_bytes_unshared", batch x K x (prompt + new) x
`jaxkv.memory.kv_bytes_per_token`), and the bytes transformers' cache held at the end (measured from its
tensors); whether the best hypotheses' tokens are equal (reported, not asserted).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

TARGETS = {"speedup_vs_hf": 1.5}
QUICK = {"config": "test-tiny", "prompt_len": 40, "new_tokens": 8, "beams": "2,4", "reps": 1}  # a few seconds


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="jaxkv bench beam", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="small", help="preset (default small)")
    p.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt (default 512)")
    p.add_argument("--new-tokens", type=int, default=64, help="max_new_tokens (default 64; no stop tokens)")
    p.add_argument("--beams", default="4,8", help="comma-separated num_beams values (default 4,8)")
    p.add_argument("--batch", type=int, default=1, help="prompts per call (default 1)")
    p.add_argument("--page-size", type=int, default=None, help="jaxkv's page size (default beam_search's)")
    p.add_argument("--seed", type=int, default=0, help="numpy seed of the prompts")
    p.add_argument("--reps", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    p.add_argument("--out", default=None, help="write the figures as JSON to this file")
    as_if = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
    p.add_argument("--quick", action="store_true", help=f"a small run, as if given {as_if} (explicit options win)")
    quick = argparse.ArgumentParser(add_help=False)
    quick.add_argument("--quick", action="store_true")
    if quick.parse_known_args(argv)[0].quick:  # its values as defaults: options given explicitly still win
        p.set_defaults(**QUICK)
    return p.parse_args(argv)


def beam_values(args) -> list[int]:
    """--beams as a list of ints (ValueError if it is not one)."""
    return [int(k) for k in args.beams.split(",") if k.strip()]


def make_prompts(vocab_size: int, args) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(args.seed)
    return [rng.integers(1, vocab_size, args.prompt_len).tolist() for _ in range(args.batch)]


# --- the two paths: each (K) -> (best hypothesis tokens per prompt, figures of the call) ---------------------------


class _Jaxkv:
    def __init__(self, model, prompts, args):
        self.model, self.prompts, self.args = model, prompts, args

    def __call__(self, K):
        import jaxkv

        kwargs = {} if self.args.page_size is None else {"page_size": self.args.page_size}
        r = jaxkv.beam_search(self.model, self.prompts, num_beams=K, max_new_tokens=self.args.new_tokens,
                              stop_tokens=[], **kwargs)
        return [hyps[0].tokens for hyps in r], dict(r.stats)


class _HF:
    """transformers' beam search on the same weights; its forwards timed by hooks (the first is the prefill)."""

    def __init__(self, model, prompts, args):
        import torch

        from jaxkv.bench.decode import HFRunner

        self.model = HFRunner(model, "float32").model
        self.ids = torch.tensor(prompts, dtype=torch.int64)
        self.args = args
        self.forwards = []  # seconds of each forward of the current call
        self.model.register_forward_pre_hook(self._start)
        self.model.register_forward_hook(self._stop)

    def _start(self, *_):
        self.t0 = time.perf_counter()

    def _stop(self, *_):
        self.forwards.append(time.perf_counter() - self.t0)

    def __call__(self, K, cache_bytes=False):
        import torch

        n = self.args.new_tokens
        self.forwards.clear()
        with torch.inference_mode():
            out = self.model.generate(self.ids, attention_mask=torch.ones_like(self.ids), num_beams=K,
                                      do_sample=False, max_new_tokens=n, min_new_tokens=n, early_stopping=False,
                                      length_penalty=1.0, num_return_sequences=1, pad_token_id=0, eos_token_id=None,
                                      return_dict_in_generate=True)
        figures = {"prefill_s": self.forwards[0], "decode_s": sum(self.forwards[1:]), "forwards": len(self.forwards)}
        if cache_bytes:
            # transformers 5 names it `cache` (`past_key_values`, deprecated, warns); 4.x only past_key_values
            fields = getattr(out, "__dataclass_fields__", {})
            figures["cache_bytes"] = _cache_bytes(getattr(out, "cache" if "cache" in fields else "past_key_values",
                                                          None))
        return out.sequences[:, self.ids.shape[1]:].tolist(), figures


def _cache_bytes(cache) -> int | None:
    """The bytes of the key and value tensors a transformers cache holds (None if its layout is not known)."""
    import torch

    layers = getattr(cache, "layers", None)
    if not layers:
        return None
    tensors = [getattr(layer, name, None) for layer in layers for name in ("keys", "values")]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    return sum(t.numel() * t.element_size() for t in tensors)


def run(args) -> dict:
    import jax

    import jaxkv
    from jaxkv.bench.decode import settle
    from jaxkv.config import PRESETS

    config = PRESETS[args.config]
    model = jaxkv.Model.random(config, seed=0)
    prompts = make_prompts(config.vocab_size, args)
    beams = beam_values(args)
    runners = {"jaxkv": _Jaxkv(model, prompts, args)}
    if args.hf:
        runners["transformers"] = _HF(model, prompts, args)
    compiles = [0]

    def listen(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    print(f"beam: {args.config}, float32, {args.batch} prompt(s) of {args.prompt_len} tokens, {args.new_tokens} new "
          f"tokens, num_beams {', '.join(map(str, beams))}; {args.reps} rounds of {', '.join(runners)}",
          file=sys.stderr)
    warm = {}
    for K in beams:  # compiles (jaxkv) and first-call costs (transformers); the cache bytes once
        for name, fn in runners.items():
            t = time.perf_counter()
            warm[K, name] = fn(K, cache_bytes=True) if name == "transformers" else fn(K)
            print(f"  warm-up K={K} {name}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    seconds = {(K, name): [] for K in beams for name in runners}
    timed_compiles = {key: 0 for key in seconds}
    last, splits = {}, {key: [] for key in seconds}
    for rep in range(args.reps):
        for K in beams:
            for name, fn in runners.items():
                settle()
                before = compiles[0]
                t = time.perf_counter()
                last[K, name] = fn(K)
                splits[K, name].append(last[K, name][1])
                seconds[K, name].append(time.perf_counter() - t)
                timed_compiles[K, name] += compiles[0] - before
        print(f"  round {rep + 1}: " + ", ".join(f"K={K} {name} {s[-1]:.2f} s" for (K, name), s in seconds.items()),
              file=sys.stderr)
    return figures(args, config, beams, seconds, splits, last, warm, timed_compiles)


def figures(args, config, beams, seconds, splits, last, warm, timed_compiles) -> dict:
    """The JSON result: per K, each path's seconds and time split (medians over the rounds), jaxkv's pages and
    bytes (the last round's; the same every round), the ratios, matches."""
    from jaxkv.cache.planner import kv_bytes_per_token

    per_token = kv_bytes_per_token(config)
    r = {"args": vars(args), "kv_bytes_per_token": per_token, "beams": {}}
    for K in beams:
        tokens, s = last[K, "jaxkv"]
        jx = {"seconds": seconds[K, "jaxkv"], "median_s": statistics.median(seconds[K, "jaxkv"]),
              "compiles_in_timed_runs": timed_compiles[K, "jaxkv"],
              "warmup_compile_s": warm[K, "jaxkv"][1]["compile_s"], "stats": s}
        for k in ("prefill_s", "search_s", "compile_s"):
            jx[k] = statistics.median(x[k] for x in splits[K, "jaxkv"])
        for k in ("steps", "pages_in_use_peak", "kv_bytes_in_use_peak", "kv_cache_bytes_unshared", "kv_cache_bytes",
                  "pages_needed", "num_pages", "page_size"):
            jx[k] = s[k]
        row = {"jaxkv": jx, "peak_bytes_ratio": s["kv_cache_bytes_unshared"] / s["kv_bytes_in_use_peak"],
               "hf_cache_bytes_estimate": args.batch * K * (args.prompt_len + args.new_tokens) * per_token,
               "generated_tokens": [len(t) for t in tokens]}
        if (K, "transformers") in last:
            hf_tokens, h = last[K, "transformers"]
            hf = {"seconds": seconds[K, "transformers"], "median_s": statistics.median(seconds[K, "transformers"]),
                  "prefill_s": statistics.median(x["prefill_s"] for x in splits[K, "transformers"]),
                  "decode_s": statistics.median(x["decode_s"] for x in splits[K, "transformers"]),
                  "forwards": h["forwards"],
                  "cache_bytes_measured": warm[K, "transformers"][1].get("cache_bytes")}
            row["transformers"] = hf
            row["speedup_vs_hf"] = hf["median_s"] / jx["median_s"]
            row["tokens_equal"] = [a == b for a, b in zip(tokens, hf_tokens)]
            row["first_difference"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                       for a, b in zip(tokens, hf_tokens)]
        r["beams"][str(K)] = row
    return r


def report(r: dict) -> str:
    a = r["args"]
    lines = [f"beam search ({a['config']}, float32, {a['batch']} prompt(s) of {a['prompt_len']} random tokens, "
             f"{a['new_tokens']} new tokens, stop_tokens=[], length_penalty 1, early_stopping False, medians of "
             f"{a['reps']}):"]
    for K, row in r["beams"].items():
        jx = row["jaxkv"]
        line = f"  K={K}: jaxkv {jx['median_s']:.2f} s (prefill {jx['prefill_s']:.2f}, search {jx['search_s']:.2f})"
        if "transformers" in row:
            hf = row["transformers"]
            line += (f"; transformers {hf['median_s']:.2f} s (prefill {hf['prefill_s']:.2f}, {hf['forwards'] - 1} "
                     f"decode forwards {hf['decode_s']:.2f}): {row['speedup_vs_hf']:.2f}x "
                     f"(target {TARGETS['speedup_vs_hf']}x)")
        lines.append(line)
        line = (f"    KV: jaxkv peak {jx['pages_in_use_peak']} pages of {jx['page_size']} = "
                f"{jx['kv_bytes_in_use_peak']:,} bytes (pool {jx['kv_cache_bytes']:,}) vs {K} private caches per "
                f"prompt {jx['kv_cache_bytes_unshared']:,}: {row['peak_bytes_ratio']:.2f}x less")
        if "transformers" in row:
            measured = row["transformers"]["cache_bytes_measured"]
            line += "; transformers' cache at the end " + (f"{measured:,}" if measured is not None else "unknown")
        lines.append(line)
        line = (f"    compiles in timed runs: jaxkv {jx['compiles_in_timed_runs']} (warm-up compile "
                f"{jx['warmup_compile_s']:.1f} s)")
        if "tokens_equal" in row:
            equal = row["tokens_equal"]
            line += f"; best hypothesis equals transformers' for {sum(equal)} of {len(equal)} prompt(s)"
            if not all(equal):
                line += f" (first differences at {row['first_difference']})"
        lines.append(line)
    return "\n".join(lines)


def _usage_error(args) -> str | None:
    """What is wrong with the options (checked before JAX is imported), or None."""
    from jaxkv.config import PRESETS

    try:
        beams = beam_values(args)
    except ValueError:
        beams = []
    small = [f"--{k.replace('_', '-')}" for k in ("prompt_len", "new_tokens", "batch", "reps", "page_size")
             if getattr(args, k) is not None and getattr(args, k) < 1]
    config = PRESETS.get(args.config)
    problems = [
        (small, f"{', '.join(small)} must be >= 1"),
        (not beams or min(beams) < 1, f"--beams must be comma-separated integers >= 1, got {args.beams!r}"),
        (config is None, f"unknown config {args.config!r}; choose from {sorted(PRESETS)}"),
        (config is not None and args.prompt_len + args.new_tokens > config.max_positions,
         f"--prompt-len + --new-tokens exceeds the model's max positions ({config and config.max_positions})"),
    ]
    return next((message for bad, message in problems if bad), None)


def main(argv=None) -> int:
    import importlib.util

    args = parse_args(argv)
    error = _usage_error(args)
    if not error and args.hf and not all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
        print("transformers/torch not installed: skipping them (pip install 'jaxkv[test]')", file=sys.stderr)
        args.hf = False
    if error:
        print(f"jaxkv bench beam: error: {error}", file=sys.stderr)
    else:
        _write(run(args), args.out)
    return 2 if error else 0


def _write(r: dict, out: str | None):
    """The report on stdout; with --out, every figure as JSON."""
    print(report(r), flush=True)
    if out:
        path = pathlib.Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r, indent=2, default=float))
        print(f"wrote {out}")

if __name__ == "__main__":
    sys.exit(main())
