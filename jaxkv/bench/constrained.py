"""Constrained decoding's costs: the host's mask time per token, the compiled step's extra time, and the engine's
throughput with 0%, 50% and 100% of its requests held to a nested JSON schema.

    jaxkv bench constrained [--model tiny] [--tokenizer PATH ...] [--requests 32] [--slots 16] [--reps 3]
                            [--max-new 96] [--out F]

1. Mask time per token (host): llguidance's matcher for SCHEMA walks a valid instance (compact JSON, tokenized by
   the tokenizer), filling the packed int32 [1, ceil(V / 32)] mask before each token as jaxkv's `Rows` does
   (`jaxkv.constraints.matcher`); median, p99 and the first mask (llguidance builds its lexer lazily), at the
   model's vocabulary and at each --tokenizer's (a tokenizer.json: e.g. a 150k one).
2. The step's extra time: `generate` of the same greedy batch of 4 with and without a constraint that never ends
   (a regex; both run --max-new steps): the decode time per step (the mask unpack, the host callback and the
   host's masks), and the mask apply alone (`mask.apply`, jitted) on [16, V] at each vocabulary.
3. Engine throughput: --requests requests (prompts of 8-32 random bytes) through one `jaxkv.Engine`, greedy,
   max_new_tokens --max-new; the constrained ones get SCHEMA, the others stop_tokens=[] (they run to
   --max-new). The three mixes run round-robin --reps times after a warm-up; generated tokens per second,
   medians. Target (issue 30): the 50% mix at most 15% below none.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

# A nested schema (objects three deep, bounded arrays, enums, bounded numbers, a patterned string, optional
# fields): every path through it is bounded, so a weak model's output still ends.
SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["id", "user", "items", "status"],
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "user": {"type": "object", "additionalProperties": False, "required": ["name", "address"],
                 "properties": {"name": {"type": "string", "maxLength": 12},
                                "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
                                "address": {"type": "object", "additionalProperties": False,
                                            "required": ["city", "zip"],
                                            "properties": {"city": {"type": "string", "maxLength": 10},
                                                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                            "properties": {"sku": {"enum": ["A1", "B2", "C3"]},
                                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
        "status": {"enum": ["new", "paid", "shipped"]},
    },
}
INSTANCE = {"id": 4217, "user": {"name": "Ada Lovelace", "email": "ada@math.com",
                                 "address": {"city": "London", "zip": "12345"}},
            "items": [{"sku": "A1", "qty": 2}, {"sku": "C3", "qty": 1}], "status": "paid"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="jaxkv bench constrained", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="a jaxkv.load path (default the bundled tiny model)")
    p.add_argument("--tokenizer", action="append", default=[], help="a tokenizer.json for the mask-time figures "
                   "at its vocabulary (repeatable)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--steps-per-dispatch", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None, help="write the figures as JSON to this file")
    return p.parse_args(argv)


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def mask_walk(tokenizer_json: str, vocab_size: int, eos_ids, walks: int = 5) -> dict:
    """Host mask time per token over INSTANCE's tokens at one vocabulary (microseconds)."""
    import numpy as np

    import llguidance
    import llguidance.numpy as lln
    from jaxkv.constraints import JsonSchema
    from jaxkv.constraints.spec import WHITESPACE  # noqa: F401 (the same whitespace default as jaxkv's)

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids))
    setup_s = time.perf_counter() - t0
    grammar = JsonSchema(SCHEMA, whitespace="compact").grammar
    tokens = lltok.tokenize_str(json.dumps(INSTANCE, separators=(",", ":")))
    bits = np.zeros((1, (vocab_size + 31) // 32), np.int32)
    times, first = [], None
    for _ in range(walks):
        m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        for t in tokens + [None]:
            start = time.perf_counter()
            lln.fill_next_token_bitmask(m, bits)
            us = (time.perf_counter() - start) * 1e6
            first = us if first is None else first
            times.append(us)
            if t is not None:
                assert m.consume_token(t), m.get_error()
    return {"vocab": vocab_size, "tokens": len(tokens), "tokenizer_s": round(setup_s, 3),
            "first_us": round(first, 1), "median_us": round(statistics.median(times), 1),
            "p99_us": round(_pct(times, 0.99), 1)}


def device_apply(vocab_size: int, batch: int = 16, reps: int = 50) -> float:
    """Microseconds of the jitted mask apply on float32 [batch, V] (the step's device-side work)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxkv.constraints import mask

    f = jax.jit(mask.apply)
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(batch, vocab_size)).astype(np.float32))
    bits = jnp.full((batch, mask.words(vocab_size)), -1, jnp.int32)
    f(logits, bits).block_until_ready()
    start = time.perf_counter()
    for _ in range(reps):
        out = f(logits, bits)
    out.block_until_ready()
    return round((time.perf_counter() - start) / reps * 1e6, 1)


def step_overhead(model, constraint, prompts, max_new: int) -> dict:
    """generate's decode time per step for the same greedy batch, unconstrained and constrained by a constraint
    that never ends (stop_tokens=[]: both run max_new steps), compiles run first."""
    import jaxkv

    out = {}
    for name, c in (("none", None), ("constrained", constraint)):
        kwargs = dict(max_new_tokens=max_new, stop_tokens=[], constraint=c)
        jaxkv.generate(model, prompts, **kwargs)  # compile
        g = jaxkv.generate(model, prompts, **kwargs)
        out[f"{name}_ms_per_step"] = round(g.stats["decode_s"] / max(1, g.stats["decode_steps"]) * 1e3, 3)
        if c is not None:
            out["host_mask_us_per_row"] = round(g.stats["constraint_mask_s"] / max(1, g.stats["constraint_masks"])
                                                * 1e6, 1)
    return out


def engine_mixes(model, args) -> dict:
    """Generated tokens per second through one engine with 0%, 50% and 100% of the requests constrained."""
    import numpy as np

    import jaxkv

    rng = np.random.default_rng(0)
    prompts = [bytes(rng.integers(97, 123, rng.integers(8, 33)).astype(np.uint8)).decode()
               for _ in range(args.requests)]
    schema = jaxkv.JsonSchema(SCHEMA)
    engine = jaxkv.Engine(model, slots=args.slots, max_len=64 + args.max_new,
                          steps_per_dispatch=args.steps_per_dispatch)
    engine.warm_up()

    def run(fraction):
        every = None if fraction == 0 else round(1 / fraction)
        reqs = [dict(prompt=p, constraint=schema) if every and i % every == 0 else dict(prompt=p, stop_tokens=[])
                for i, p in enumerate(prompts)]
        engine.reset_stats()
        start = time.perf_counter()
        results = engine.generate(reqs, max_new_tokens=args.max_new)
        seconds = time.perf_counter() - start
        stats = engine.stats
        return (sum(len(r.tokens) for r in results) / seconds, seconds,
                stats["decode_s"] / max(1, stats["decode_steps"]) * 1e3)

    mixes = {0.0: [], 0.5: [], 1.0: []}
    for f in mixes:  # warm-up: every program and each mix's first masks
        run(f)
    for _ in range(args.reps):
        for f in mixes:
            mixes[f].append(run(f))
    out = {f"{int(f * 100)}%": {"tokens_per_s": round(statistics.median(r[0] for r in runs), 1),
                                "seconds": round(statistics.median(r[1] for r in runs), 3),
                                "decode_ms_per_step": round(statistics.median(r[2] for r in runs), 3)}
           for f, runs in mixes.items()}
    out["50%_vs_none"] = round(out["50%"]["tokens_per_s"] / out["0%"]["tokens_per_s"], 3)
    out["50%_step_time_vs_none"] = round(out["50%"]["decode_ms_per_step"] / out["0%"]["decode_ms_per_step"], 3)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    import jaxkv

    model = jaxkv.load(args.model)
    if model.tokenizer is None:
        print("the model has no tokenizer: constraints need one", file=sys.stderr)
        return 2
    config = model.config
    figures = {"device": str(jax.devices()[0]), "model": args.model, "vocab": config.vocab_size}
    figures["mask_walk"] = [mask_walk(model.tokenizer.to_str(), config.vocab_size, config.eos_ids)]
    vocabs = [config.vocab_size]
    for path in args.tokenizer:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(path)
        size = tok.get_vocab_size()
        figures["mask_walk"].append(mask_walk(tok.to_str(), size, [0]))
        vocabs.append(size)
    figures["device_apply_us_b16"] = {v: device_apply(v) for v in vocabs}
    prompts = ["Order: ", "JSON: ", "{", "Reply"]
    figures["generate_step"] = step_overhead(model, jaxkv.Regex("[a-z ,.]*"), prompts, args.max_new)
    figures["engine"] = engine_mixes(model, args)
    print(json.dumps(figures, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
