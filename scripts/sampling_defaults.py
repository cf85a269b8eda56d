"""Which sampling the bundled model ("tiny") should ship in its generation_config.json, measured: a few settings
on a few prompts, with the text's repetition in figures.

    python scripts/sampling_defaults.py [--max-new-tokens 64] [--seeds 0,1,2]

Per setting, `jaxkv.generate` continues every prompt (one call per seed, `--max-new-tokens` tokens, the model's
eos stops a row) and the continuations' words are counted: distinct-2 (distinct word bigrams / all bigrams, higher
is more varied), repeated-3 (word trigrams that already occurred earlier in the same continuation / all trigrams,
lower is less looping), and mean words. Figures are means over prompts and seeds. The last column is the first
seed's continuation of the first prompt (the README quickstart's), as `jaxkv generate` would print it.
"""

from __future__ import annotations

import argparse
import statistics
import sys

PROMPTS = ["The KV cache", "Once upon a time", "The model", "In the morning, the", "A language model is"]
SETTINGS = {  # name -> jaxkv.generate's sampling arguments
    "greedy": dict(temperature=0.0),
    "greedy, repetition 1.3": dict(temperature=0.0, repetition_penalty=1.3),
    "T 0.7, top-p 0.9": dict(temperature=0.7, top_p=0.9),
    "T 0.7, top-p 0.9, repetition 1.2": dict(temperature=0.7, top_p=0.9, repetition_penalty=1.2),
    "T 0.8, top-k 40, repetition 1.2": dict(temperature=0.8, top_k=40, repetition_penalty=1.2),
    "T 1.0, min-p 0.1": dict(temperature=1.0, min_p=0.1),
    "T 1.0, min-p 0.1, repetition 1.2": dict(temperature=1.0, min_p=0.1, repetition_penalty=1.2),
}


def distinct(words: list[str], n: int) -> float:
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def repeated(words: list[str], n: int) -> float:
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    seen, again = set(), 0
    for g in grams:
        again += g in seen
        seen.add(g)
    return again / len(grams) if grams else 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seeds", default="0,1,2")
    args = p.parse_args(argv)
    import jaxkv

    model = jaxkv.load("tiny")
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"tiny, {len(PROMPTS)} prompts x seeds {seeds}, {args.max_new_tokens} new tokens")
    print(f"{'setting':<34} {'distinct-2':>10} {'repeated-3':>10} {'words':>6}  first prompt, seed {seeds[0]}")
    for name, sampling in SETTINGS.items():
        d2, r3, lengths, first = [], [], [], None
        for seed in seeds:
            out = jaxkv.generate(model, PROMPTS, max_new_tokens=args.max_new_tokens, seed=seed, **sampling)
            for text in out.text:
                words = text.split()
                d2.append(distinct(words, 2))
                r3.append(repeated(words, 3))
                lengths.append(len(words))
            first = first if first is not None else out.text[0]
        print(f"{name:<34} {statistics.fmean(d2):>10.3f} {statistics.fmean(r3):>10.3f} "
              f"{statistics.fmean(lengths):>6.1f}  {PROMPTS[0] + first!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
