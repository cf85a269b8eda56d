"""What every `jaxkv` subcommand's parser shares: the parser that raises instead of printing usage, the exit
status of a usage error, the value types of numeric flags, and the version string.

JAX-free (argparse only), as every module of the CLI's parsing: `--help` and a bad flag answer before JAX is
imported.
"""

from __future__ import annotations

import argparse

EXIT_USAGE = 2
VERSION = "0.1.0"  # what --version says when the package metadata is missing (running from a source tree)


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("jaxkv")
    except metadata.PackageNotFoundError:
        return VERSION


class UsageError(Exception):
    """A flag argparse refused: the CLI prints it as one line and exits with EXIT_USAGE."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise UsageError(message)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _float(text: str, *, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    # float("nan") and float("inf") parse; neither is a memory size.
    if not (value > 0 or (allow_zero and value == 0)) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number {'>= 0' if allow_zero else '> 0'}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    return _float(text, allow_zero=False)


def non_negative_float(text: str) -> float:
    return _float(text, allow_zero=True)

