"""`jaxkv serve ...` and `jaxkv run-batch ...`: handed to their own parsers and mains (`jaxkv.server.main`,
`jaxkv.server.batch`), imported only then, so neither Starlette nor uvicorn is needed for the other commands."""

from __future__ import annotations


def add_parsers(commands):
    """`serve` and `run-batch` listed for --help only: `main` hands them to `run` and `run_batch` before the parser
    sees them (their options are the server's own parsers', which import nothing until they run)."""
    commands.add_parser("serve", add_help=False, help="an OpenAI-compatible HTTP server on the engine")
    commands.add_parser("run-batch", add_help=False,
                        help="an OpenAI Batch API file (JSONL) through the server, resumable")


def run(argv: list[str]) -> int:
    """`argv`: what follows `jaxkv serve`."""
    from jaxkv.server.main import main as serve

    return serve(argv)


def run_batch(argv: list[str]) -> int:
    """`argv`: what follows `jaxkv run-batch`."""
    try:
        import starlette  # noqa: F401  (the app run-batch drives is the server's)
    except ImportError:
        import sys

        print('jaxkv run-batch: error: it runs the server\'s app: pip install "jaxkv[serve]"', file=sys.stderr)
        return 2
    from jaxkv.server.batch import main as batch

    return batch(argv)
