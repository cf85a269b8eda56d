"""The `jaxkv` command itself: the top-level parser (each subcommand adds its own flags) and `main`, which hands
`serve` and `bench` to their own parsers, runs `generate` or `memory`, and turns bad input into one line on
stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from jaxkv.cli import bench, generate, memory, serve
from jaxkv.cli.arguments import EXIT_USAGE, Parser, UsageError, version


class _Formatter(argparse.HelpFormatter):
    """argparse measures the commands' names without the indent it prints them at, so the longest (run-batch)
    would get a line of its own in `jaxkv --help`; this counts the indent."""

    def add_argument(self, action):
        super().add_argument(action)
        indent = self._current_indent + self._indent_increment
        for sub in getattr(action, "_get_subactions", list)():  # (the subparsers action has them)
            self._action_max_length = max(self._action_max_length, len(self._format_action_invocation(sub)) + indent)


def parser() -> Parser:
    parser = Parser(prog="jaxkv", description="KV-cached decoding for decoder-only transformers in JAX.",
                    epilog="jaxkv COMMAND --help shows a command's options.", formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"jaxkv {version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")
    generate.add_parser(commands)
    memory.add_parser(commands)
    serve.add_parsers(commands)
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
        command = argv[0] if argv[:1] in (["generate"], ["memory"]) else None  # else the command itself is wrong
        print(f"jaxkv: error: {e} (see jaxkv {command + ' ' if command else ''}--help)", file=sys.stderr)
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
