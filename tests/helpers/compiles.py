"""Counting XLA compiles: every backend compile of this process, seen through jax.monitoring (the listener is
registered once, when this module is first imported).

    with count_compiles() as c:
        ...
    assert c["n"] <= 2
"""

import contextlib

import jax

_compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: _compiles.append(event) if event == "/jax/core/compile/backend_compile_duration"
    else None)


@contextlib.contextmanager
def count_compiles():
    before = len(_compiles)
    counter = {}
    yield counter
    counter["n"] = len(_compiles) - before
