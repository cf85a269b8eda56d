"""What each KV-cache dtype costs in accuracy, on the bundled model over held-out text.

    python scripts/cache_accuracy.py [--windows N] [--greedy-prompts P] [--new-tokens 256] [--json FILE]

For every cache dtype: the perplexity of the held-out text scored through the cache (prefill one token, then one
teacher-forced decode step per token: `jaxkv.score.cached_nll`), its change against the float32 cache, and greedy
agreement: P held-out prompts generate `--new-tokens` tokens with each cache dtype; the share of positions equal to
the float32 cache's tokens and the mean index of the first difference. Prints a markdown table (docs/design/cache.md).

The defaults take roughly 8 minutes on a 2-core CPU; it says its estimate up front and prints one line per stage
(one per cache dtype) on stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys

import numpy as np

import jaxkv
from jaxkv.bench.decode import Progress
from jaxkv.cache.dtypes import CACHE_DTYPES

SCRIPTS = pathlib.Path(__file__).resolve().parent


def training_script():
    """scripts/train_tiny.py, loaded by path: its held-out split is by construction the one training excluded."""
    spec = importlib.util.spec_from_file_location("train_tiny", SCRIPTS / "train_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def heldout_windows(model, count: int | None = None) -> np.ndarray:
    """int32[n, SEQ_LEN + 1] windows of the held-out text, at the context length the model was trained on."""
    train_tiny = training_script()
    return train_tiny.windows(train_tiny.heldout_stream(model.tokenizer), train_tiny.SEQ_LEN, count)


# Rough costs on the 2-core dev machine (measured with 4 and 12 windows), for the up-front estimate.
LOAD_S = 3.0  # importing JAX and reading the bundled model
COMPILE_S = 3.0  # each stage compiles its loop once
# One held-out window scored token by token through the cache. float8 is emulated on CPU: most of the run.
NLL_S_PER_WINDOW = {"float32": 0.15, "bfloat16": 0.2, "float16": 0.4, "int8": 0.6, "float8_e4m3fn": 4.5}
GREEDY_S_PER_TOKEN = 0.003  # one generated token of one prompt (the prompts decode together)
HELDOUT_WINDOWS = 70  # the bundled model's held-out text in SEQ_LEN windows


def stages(windows: int, prompts: int, new_tokens: int, dtypes=CACHE_DTYPES) -> list[tuple[str, float]]:
    greedy = COMPILE_S + prompts * new_tokens * GREEDY_S_PER_TOKEN
    return ([("load the bundled model", LOAD_S)]
            + [(f"perplexity, {dt} cache, {windows} windows", COMPILE_S + windows * NLL_S_PER_WINDOW[dt])
               for dt in dtypes]
            + [(f"greedy, {prompts} prompts: the float32 reference", greedy)]
            + [(f"greedy, {prompts} prompts, {dt} cache", greedy) for dt in dtypes])


def perplexities(model, windows: np.ndarray, dtypes=CACHE_DTYPES, progress=None) -> dict[str, float]:
    from jaxkv.score import cached_nll

    out = {}
    for dt in dtypes:
        if progress is not None:
            progress.next()
        out[dt] = float(np.exp(cached_nll(model, windows, cache_dtype=dt).mean()))
    return out


def greedy_agreement(model, prompts: list[list[int]], new_tokens: int, dtypes=CACHE_DTYPES,
                     progress=None) -> dict[str, dict]:
    """Per cache dtype: share of generated positions equal to the float32 cache's, and mean first difference."""
    if progress is not None:
        progress.next()
    ref = jaxkv.generate(model, prompts, max_new_tokens=new_tokens, stop_tokens=[], cache_dtype="float32").tokens
    out = {}
    for dt in dtypes:
        if progress is not None:
            progress.next()
        got = jaxkv.generate(model, prompts, max_new_tokens=new_tokens, stop_tokens=[], cache_dtype=dt).tokens
        equal = [np.asarray(a) == np.asarray(b) for a, b in zip(got, ref)]
        first = [int(np.argmin(e)) if not e.all() else new_tokens for e in equal]
        out[dt] = {"agreement": float(np.mean(np.concatenate(equal))), "first_difference": float(np.mean(first))}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=None, help="held-out windows to score (default: all)")
    parser.add_argument("--greedy-prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    # The window count is known only once the text is tokenized: the held-out split makes HELDOUT_WINDOWS.
    expected_windows = args.windows if args.windows is not None else HELDOUT_WINDOWS
    progress = Progress("cache_accuracy", stages(expected_windows, args.greedy_prompts, args.new_tokens))
    progress.next()
    model = jaxkv.load("tiny")
    windows = heldout_windows(model, args.windows)
    ppl = perplexities(model, windows, progress=progress)
    prompts = [w[:32].tolist() for w in windows[: args.greedy_prompts]]
    greedy = greedy_agreement(model, prompts, args.new_tokens, progress=progress)
    progress.finish()
    print(f"bundled model, {windows.shape[0]} held-out windows x {windows.shape[1] - 1} tokens scored through the "
          f"cache; greedy: {len(prompts)} held-out 32-token prompts x {args.new_tokens} new tokens\n")
    print("| cache dtype | bytes/token | perplexity | vs float32 | greedy agreement | mean first difference |")
    print("|---|---|---|---|---|---|")
    for dt in CACHE_DTYPES:
        per_token = jaxkv.memory.kv_bytes_per_token(model.config, dt)
        print(f"| {dt} | {per_token:,} | {ppl[dt]:.4f} | {100 * (ppl[dt] / ppl['float32'] - 1):+.3f}% | "
              f"{100 * greedy[dt]['agreement']:.1f}% | {greedy[dt]['first_difference']:.0f} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"perplexity": ppl, "greedy": greedy,
                                                       "windows": list(windows.shape)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
