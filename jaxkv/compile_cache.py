"""The persistent compilation cache: compiled programs written to disk, so a second process starts warm.

jaxkv turns on JAX's persistent compilation cache when it is first used (`setup`, called by `jaxkv.model` on
import): compiled XLA executables of at least MIN_COMPILE_SECONDS are stored under a directory and read back by
the next process that compiles the same program (same jax/jaxlib, backend, flags and shapes), which then skips
XLA's compile. The directory:

  JAXKV_COMPILE_CACHE unset     $XDG_CACHE_HOME/jaxkv/xla (default ~/.cache/jaxkv/xla)
  JAXKV_COMPILE_CACHE=PATH      PATH
  JAXKV_COMPILE_CACHE=0 (or "off", "false", "")  no persistent cache (the opt-out; `jaxkv generate
                                --no-compile-cache` sets it)

A directory the user already gave JAX (`jax.config.update("jax_compilation_cache_dir", ...)` or
JAX_COMPILATION_CACHE_DIR) is left as it is. Cold and warm first-call times: docs/design/cli.md ("First call").
"""

from __future__ import annotations

import os
import pathlib

ENV = "JAXKV_COMPILE_CACHE"
OFF = ("0", "off", "false", "no", "")
MIN_COMPILE_SECONDS = 0.2  # programs that compile faster are not worth a disk entry (JAX's default is 1 s)
_state = {"done": False}


def directory() -> pathlib.Path | None:
    """Where the cache goes under the current environment, None when opted out."""
    value = os.environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in OFF else pathlib.Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "jaxkv" / "xla"


def setup() -> pathlib.Path | None:
    """Turns the persistent cache on (once per process) -> the directory in use, or None. Never raises: a
    directory that cannot be created leaves the cache off (compiling still works, only slower next time)."""
    import jax

    if _state["done"]:
        return _state.get("path")
    _state["done"] = True
    existing = jax.config.jax_compilation_cache_dir
    if existing:  # the user's own choice
        _state["path"] = pathlib.Path(existing)
        return _state["path"]
    path = directory()
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    _state["path"] = path
    return path
