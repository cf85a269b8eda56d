"""The `jaxkv` command line: argument parsing and printing only; the work is the library's.

  jaxkv generate --prompt TEXT [--model PATH|tiny] [--max-new-tokens N] [--temperature T] [--top-k K]
                 [--top-p P] [--min-p M] [--seed S] [--dtype D] [--max-len N]
                 [--cache-dtype D] [--n N] [--logprobs K] [--json] [--no-compile-cache]
                 [--repetition-penalty P] [--presence-penalty R] [--frequency-penalty F]
                 [--logit-bias ID:BIAS,...] [--min-tokens N]
  jaxkv generate --prompt TEXT --num-beams K [--length-penalty F] [--early-stopping true|false|never]
                 [--num-return-sequences R] [--model PATH|tiny] [--max-new-tokens N] [--dtype D] [--max-len N]
                 [--cache-dtype D] [--json]
                 (beam search, jaxkv.beam_search: prints the best hypothesis at the end, or the R best; with
                 --json all R with their scores. Deterministic: no sampling flags, --n or --logprobs)
  jaxkv memory [--model PATH|tiny | --config config.json | --layers L --kv-heads K --head-dim H [--dtype D]]
               [--window W] [--tokens N] [--batch B] [--cache-dtype D] [--hbm-gib G [--weights-gib W]]
               [--plot FILE.png] [--json]
               (no model named: the bundled "tiny", as jaxkv generate; --tokens past a config's max positions
               is an error, as jaxkv.generate refuses them)
  jaxkv bench [options]     (the decode benchmark, the same as python scripts/bench.py; jaxkv bench --help lists
                             every benchmark, a line each)
  jaxkv bench sharing [options]   (parallel samples and prompt caching: jaxkv.bench.sharing)
  jaxkv bench engine [options]    (continuous batching against static batches: jaxkv.bench.engine)
  jaxkv bench beam [options]      (beam search: jaxkv.bench.beam)
  jaxkv bench mla [options]       (multi-head latent attention against its GQA twin: jaxkv.bench.mla)
  jaxkv bench layers [options]    (per-layer rings against full-length caches: jaxkv.bench.layers)
  jaxkv serve [options]     (an OpenAI-compatible HTTP server on the engine; see jaxkv serve --help;
                             needs pip install "jaxkv[serve]")
  jaxkv run-batch -i requests.jsonl -o results.jsonl [options]   (an OpenAI Batch API file through the
                             server's handling; resumable, split over processes; see jaxkv run-batch --help)
  jaxkv --version

Compiled programs are kept on disk between runs (`jaxkv.compile_cache`: ~/.cache/jaxkv/xla, JAXKV_COMPILE_CACHE
to move or disable it), so a second `jaxkv generate` starts warm; --no-compile-cache opts out for one run.

Every flag is parsed and checked (`jaxkv.checks`, which is JAX-free) before JAX is imported and before anything is
printed: `--help` and a bad flag answer in a fraction of a second, where importing JAX, Flax and Pallas takes
seconds. Bad arguments and bad checkpoints print one line on stderr and exit with status 2; never a traceback.

Files (docs/design/cli.md, "Package layout"): `command.py` the top-level parser and `main`; `arguments.py` what
the subcommands' parsers share; one module per subcommand: `generate.py`, `memory.py`, `bench.py`, `serve.py`.

May import anything in jaxkv, and `jaxkv.bench` by name only, inside `bench.run`, for `jaxkv bench` (the one
tie from the library to the benchmarks, which import torch and transformers). Nothing in jaxkv imports the CLI.
"""

from jaxkv.cli.command import main

__all__ = ["main"]
