"""The `jaxkv` command itself: the top-level parser (each subcommand adds its own flags) and `main`, which hands
`serve` and `bench` to their own parsers, runs `generate` or `memory`, and turns bad input into one line on
stderr and exit status 2.
"""

from __future__ import annotations

import json
import sys
import time

from jaxkv.cli import bench, generate, memory, serve
from jaxkv.cli.arguments import EXIT_USAGE, Parser, UsageError, version


def parser() -> Parser:
    parser = Parser(prog="jaxkv", description="KV-cached decoding for decoder-only transformers in JAX.",
                    epilog="jaxkv COMMAND --help shows a command's options.")
    parser.add_argument("--version", action="version", version=f"jaxkv {version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")
    generate.add_parser(commands)
    memory.add_parser(commands)
    bench.add_parser(commands)
    return parser


def main(argv=None) -> int:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # the server has its own options (jaxkv/server/main.py)
        return serve.run(argv[1:])
    if argv[:1] == ["run-batch"]:  # a batch job: the server's engine options and its own (jaxkv/server/batch.py)
        return serve.run_batch(argv[1:])
    if argv[:1] == ["bench"]:  # each benchmark has its own options
        return bench.run(argv[1:])
    try:
        args = parser().parse_args(argv)
        result = memory.run(args) if args.command == "memory" else generate.run(args, started)
    except UsageError as e:
        command = "memory" if argv[:1] == ["memory"] else "generate"
        print(f"jaxkv: error: {e} (see jaxkv {command} --help)", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"jaxkv: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps(result))
    elif args.command == "memory":
        memory.show(result)
    else:
        generate.show(result)
    return 0
