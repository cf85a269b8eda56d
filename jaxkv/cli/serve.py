"""`jaxkv serve ...`: handed to the server's own parser and main (`jaxkv.server.main`), imported only then, so
neither Starlette nor uvicorn is needed for the other commands."""

from __future__ import annotations


def run(argv: list[str]) -> int:
    """`argv`: what follows `jaxkv serve`."""
    from jaxkv.server.main import main as serve

    return serve(argv)
