"""The continuous-batching benchmark: `jaxkv.Engine` against static batches of the same requests.

    jaxkv bench engine [--config small] [--requests 256] [--slots 16] [--reps 1] [--no-hf] [--quick] [--out F]
    python scripts/bench_engine.py ...            (the same)

One process, the same random weights (`jaxkv.Model.random(PRESETS[config], seed=0)`, float32) and the same
requests: prompt lengths uniform in [--min-prompt, --max-prompt], token ids uniform in [1, vocab), max_new_tokens
geometric with mean --mean-new capped at --max-new, stop_tokens=[] (every request runs to its own
max_new_tokens), greedy. Three paths, each warmed up first (compiles excluded, and counted in the timed runs to
show it), repetitions round-robin (medians):

  engine:        jaxkv.Engine(model, slots=S, max_len=max prompt + max new).generate(requests, stop_tokens=[]),
                 a fresh engine per run (its stats are that run's).
  static:        jaxkv.generate over static batches of S in submission order, each with max_new_tokens = the
                 batch's largest; each request's tokens truncated to its own max_new_tokens.
  transformers   generate over the same static batches on the same weights (left-padded with an attention mask,
                 greedy, min_new_tokens = max_new_tokens, no eos; float32, CPU).

How padding is counted. A token row is one slot of one step in which tokens are sampled: the useful ones are the
tokens some request asked for. The engine computes `slots` rows per decode step that any slot ran
(`Engine.stats`: decode_steps, decode_rows_used); a static batch computes padded batch x max_new_tokens rows
(stats["decode_steps"] forward passes + the first token, which comes from the prefill). Slot occupancy is
useful / computed rows, padding 1 - occupancy. transformers computes the same rows as the static jaxkv batches.
Prefill padding: the engine's chunk rows left empty (`prefill_padding`); a static batch's left padding (padded
batch x padded prompt length, less the prompt tokens).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

TARGETS = {"speedup_vs_static": 2.5, "speedup_vs_hf": 2.0}
QUICK = {"requests": 32, "max_prompt": 128, "mean_new": 16, "max_new": 64}  # --quick: a run of a minute or so


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="jaxkv bench engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="small", help="preset (default small)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--mean-new", type=float, default=64.0, help="mean of the geometric max_new_tokens")
    p.add_argument("--max-new", type=int, default=512, help="cap on max_new_tokens")
    p.add_argument("--slots", type=int, default=16, help="engine slots and static batch size")
    p.add_argument("--seed", type=int, default=0, help="numpy seed of the requests")
    p.add_argument("--reps", type=int, default=1)
    quick = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
    p.add_argument("--quick", action="store_true", help=f"a small run, as if given {quick} (explicit options win)")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    p.add_argument("--out", default=None, help="write the figures as JSON to this file")
    args = p.parse_args(argv)
    if args.quick:  # its values as defaults: options given explicitly still win
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    return args


def make_requests(vocab_size: int, args) -> list[tuple[list[int], int]]:
    """(prompt, max_new_tokens) per request, from a fixed numpy seed."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_prompt, args.max_prompt + 1, args.requests)
    new = np.minimum(rng.geometric(1.0 / args.mean_new, args.requests), args.max_new)
    return [(rng.integers(1, vocab_size, n).tolist(), int(m)) for n, m in zip(lengths, new)]


def _batches(requests, size):
    return [requests[i:i + size] for i in range(0, len(requests), size)]


# --- the three paths: each (model, requests, args) -> (tokens per request, counts) ------------------------------


def run_engine(model, requests, args):
    import jaxkv

    engine = jaxkv.Engine(model, slots=args.slots, max_len=args.max_prompt + args.max_new)
    results = engine.generate([dict(prompt=p, max_new_tokens=m) for p, m in requests], stop_tokens=[])
    s = engine.stats
    counts = {"useful_rows": s["decode_rows_used"], "computed_rows": s["decode_rows_computed"],
              "prefill_tokens": s["prefill_tokens"], "prefill_computed": s["prefill_tokens_computed"],
              "stats": s}
    return [r.tokens for r in results], counts


def run_static(model, requests, args):
    import jaxkv

    tokens, counts = [], {"useful_rows": 0, "computed_rows": 0, "prefill_tokens": 0, "prefill_computed": 0,
                          "compile_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}
    for batch in _batches(requests, args.slots):
        new = [m for _, m in batch]
        g = jaxkv.generate(model, [p for p, _ in batch], max_new_tokens=max(new), stop_tokens=[])
        tokens += [t[:m] for t, m in zip(g.tokens, new)]
        s = g.stats
        counts["useful_rows"] += sum(new)
        counts["computed_rows"] += s["padded_batch"] * (s["decode_steps"] + 1)  # + 1: the prefill's token
        counts["prefill_tokens"] += s["prompt_tokens"]
        counts["prefill_computed"] += s["padded_batch"] * s["padded_prompt_len"]
        for k in ("compile_s", "prefill_s", "decode_s", "decode_steps"):
            counts[k] += s[k]
    return tokens, counts


class _HF:
    """transformers generate over static batches, left-padded, on the same weights."""

    def __init__(self, model):
        from jaxkv.bench.decode import HFRunner

        self.model = HFRunner(model, "float32").model

    def __call__(self, model, requests, args):
        import torch

        tokens, counts = [], {"useful_rows": 0, "computed_rows": 0, "prefill_tokens": 0, "prefill_computed": 0}
        for batch in _batches(requests, args.slots):
            new = [m for _, m in batch]
            width = max(len(p) for p, _ in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.int64)
            mask = torch.zeros_like(ids)
            for i, (p, _) in enumerate(batch):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(new),
                                          min_new_tokens=max(new), pad_token_id=0, eos_token_id=None)
            tokens += [row[width:width + m].tolist() for row, m in zip(out, new)]
            counts["useful_rows"] += sum(new)
            counts["computed_rows"] += len(batch) * max(new)
            counts["prefill_tokens"] += sum(len(p) for p, _ in batch)
            counts["prefill_computed"] += len(batch) * width
        return tokens, counts


def warm_up(runners, model, requests, args):
    """Compiles everything the timed runs use: the engine's programs (an engine of the same shapes, 4 short
    requests), generate's programs for every static batch shape (the batch's prompts and cache capacity, 2 new
    tokens); transformers' first call. -> the number of static batch shapes."""
    import jaxkv
    from jaxkv.cache.planner import plan_cache

    few = [(p, min(m, 9)) for p, m in requests[:4]]
    jaxkv.Engine(model, slots=args.slots, max_len=args.max_prompt + args.max_new).warm_up()  # every decode width
    run_engine(model, few, args)
    shapes = {}
    for batch in _batches(requests, args.slots):
        plan = plan_cache(model.config, [len(p) for p, _ in batch], max(m for _, m in batch))
        shapes.setdefault((plan.padded_batch, plan.prompt_len, plan.capacity), batch)
    for (_, _, capacity), batch in shapes.items():
        jaxkv.generate(model, [p for p, _ in batch], max_new_tokens=2, max_len=capacity, stop_tokens=[])
    if "transformers" in runners:
        runners["transformers"](model, few[:2], args)
    return len(shapes)


def run(args) -> dict:
    import jax

    import jaxkv
    from jaxkv.bench.decode import settle
    from jaxkv.config import PRESETS

    config = PRESETS[args.config]
    model = jaxkv.Model.random(config, seed=0)
    requests = make_requests(config.vocab_size, args)
    runners = {"engine": run_engine, "static": run_static}
    if args.hf:
        runners["transformers"] = _HF(model)
    compiles = [0]

    def listen(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    prompt_tokens = sum(len(p) for p, _ in requests)
    useful = sum(m for _, m in requests)
    print(f"engine: {args.config}, float32, {args.requests} requests ({prompt_tokens:,} prompt tokens, {useful:,} "
          f"new), prompts {args.min_prompt}-{args.max_prompt}, max_new_tokens geometric mean {args.mean_new:g} "
          f"cap {args.max_new}, {args.slots} slots; {args.reps} rounds of {', '.join(runners)}", file=sys.stderr)
    t0 = time.perf_counter()
    shapes = warm_up(runners, model, requests, args)
    print(f"  warm-up: {time.perf_counter() - t0:.1f} s ({shapes} static batch shapes)", file=sys.stderr)
    seconds = {name: [] for name in runners}
    timed_compiles = {name: 0 for name in runners}
    last = {}
    for rep in range(args.reps):
        for name, fn in runners.items():
            settle()
            before = compiles[0]
            t = time.perf_counter()
            last[name] = fn(model, requests, args)
            seconds[name].append(time.perf_counter() - t)
            timed_compiles[name] += compiles[0] - before
            print(f"  round {rep + 1}: {name} {seconds[name][-1]:.2f} s", file=sys.stderr)
    return figures(args, requests, seconds, last, timed_compiles)


def figures(args, requests, seconds, last, timed_compiles) -> dict:
    """The JSON result: per path its seconds, useful tokens, rates, occupancy and padding; the ratios; matches."""
    r = {"args": vars(args), "prompt_tokens": sum(len(p) for p, _ in requests),
         "requested_new_tokens": sum(m for _, m in requests), "paths": {}}
    for name, (tokens, c) in last.items():
        med = statistics.median(seconds[name])
        generated = sum(len(t) for t in tokens)
        path = {"seconds": seconds[name], "median_s": med, "generated_tokens": generated,
                "tokens_per_s": generated / med, "useful_rows": c["useful_rows"], "computed_rows": c["computed_rows"],
                "slot_occupancy": c["useful_rows"] / c["computed_rows"],
                "decode_padding": 1.0 - c["useful_rows"] / c["computed_rows"],
                "prefill_tokens": c["prefill_tokens"], "prefill_computed": c["prefill_computed"],
                "prefill_padding": 1.0 - c["prefill_tokens"] / c["prefill_computed"],
                "compiles_in_timed_runs": timed_compiles[name]}
        if "stats" in c:
            s = c["stats"]
            path["engine_stats"] = {k: s[k] for k in sorted(s)}
        for k in ("compile_s", "prefill_s", "decode_s", "decode_steps"):
            if k in c:
                path[k] = c[k]
        r["paths"][name] = path
    med = {name: p["median_s"] for name, p in r["paths"].items()}
    rate = {name: p["tokens_per_s"] for name, p in r["paths"].items()}
    r["speedup_vs_static"] = rate["engine"] / rate["static"]
    if "transformers" in rate:
        r["speedup_vs_hf"] = rate["engine"] / rate["transformers"]
    r["median_s"] = med
    engine, static = last["engine"][0], last["static"][0]
    r["engine_matches_static"] = sum(a == b for a, b in zip(engine, static))
    r["engine_first_mismatch"] = [_first_mismatch(a, b) for a, b in zip(engine, static) if a != b][:8]
    if "transformers" in last:
        r["transformers_matches_static"] = sum(a == b for a, b in zip(last["transformers"][0], static))
    return r


def _first_mismatch(a, b) -> dict:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"position": i, "of": max(len(a), len(b))}


def report(r: dict) -> str:
    a = r["args"]
    lines = [f"engine ({a['config']}, float32, {a['requests']} requests, prompts {a['min_prompt']}-{a['max_prompt']} "
             f"({r['prompt_tokens']:,} tokens), max_new_tokens geometric mean {a['mean_new']:g} cap {a['max_new']} "
             f"({r['requested_new_tokens']:,} tokens), stop_tokens=[], greedy, {a['slots']} slots, "
             f"medians of {a['reps']}):"]
    label = {"engine": "engine", "static": f"static jaxkv.generate x{a['slots']}",
             "transformers": f"static transformers x{a['slots']}"}
    width = max(len(label[name]) for name in r["paths"])
    for name, p in r["paths"].items():
        lines.append(f"  {label[name]:<{width}}  {p['median_s']:8.2f} s  {p['generated_tokens']:7,} tokens  "
                     f"{p['tokens_per_s']:7.1f} tok/s  occupancy {p['slot_occupancy']:6.1%}  decode padding "
                     f"{p['decode_padding']:6.1%} ({p['computed_rows']:,} rows)  prefill padding "
                     f"{p['prefill_padding']:6.1%}  compiles {p['compiles_in_timed_runs']}")
    if "engine_stats" in r["paths"]["engine"]:
        s = r["paths"]["engine"]["engine_stats"]
        lines.append(f"  engine time: prefill {s.get('prefill_s', 0):.1f} s in {s.get('prefill_dispatches', 0)} "
                     f"dispatches, decode {s.get('decode_s', 0):.1f} s in {s.get('decode_dispatches', 0)} dispatches "
                     f"({s.get('decode_steps', 0)} steps)")
    if "decode_s" in r["paths"]["static"]:
        p = r["paths"]["static"]
        lines.append(f"  static jaxkv time: prefill {p['prefill_s']:.1f} s, decode {p['decode_s']:.1f} s "
                     f"({p['decode_steps']} steps), compiling {p['compile_s']:.1f} s")
    line = (f"  throughput: engine / static jaxkv {r['speedup_vs_static']:.2f}x "
            f"(target {TARGETS['speedup_vs_static']}x)")
    if "speedup_vs_hf" in r:
        line += f"; engine / transformers {r['speedup_vs_hf']:.2f}x (target {TARGETS['speedup_vs_hf']}x)"
    lines.append(line)
    line = f"  greedy tokens: engine equals static jaxkv for {r['engine_matches_static']} of {a['requests']} requests"
    if r["engine_first_mismatch"]:
        line += f" (first differences at {r['engine_first_mismatch']})"
    if "transformers_matches_static" in r:
        line += f"; transformers equals static jaxkv for {r['transformers_matches_static']}"
    lines.append(line)
    return "\n".join(lines)


def _usage_error(args) -> str | None:
    from jaxkv.config import PRESETS

    small = [f"--{k.replace('_', '-')}" for k in ("requests", "min_prompt", "max_prompt", "max_new", "slots", "reps")
             if getattr(args, k) < 1]
    if small:
        return f"{', '.join(small)} must be >= 1"
    if args.max_prompt < args.min_prompt or args.mean_new < 1:
        return "need --min-prompt <= --max-prompt and --mean-new >= 1"
    if args.config not in PRESETS:
        return f"unknown config {args.config!r}; choose from {sorted(PRESETS)}"
    if args.max_prompt + args.max_new > PRESETS[args.config].max_positions:
        return f"--max-prompt + --max-new exceeds the model's max positions ({PRESETS[args.config].max_positions})"
    return None


def main(argv=None) -> int:
    import importlib.util

    args = parse_args(argv)
    error = _usage_error(args)
    if error:
        print(f"jaxkv bench engine: error: {error}", file=sys.stderr)
        return 2
    if args.hf and not all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
        print("transformers/torch not installed: skipping them (pip install 'jaxkv[test]')", file=sys.stderr)
        args.hf = False
    r = run(args)
    print(report(r), flush=True)
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(r, indent=2, default=float))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
