"""Timing a phase of a call (prefill, decode, a beam search) with its compile time reported apart."""

from __future__ import annotations

import time

import jax

_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
compile_seconds = [0.0]  # running total of tracing + lowering + compiling in this process (all threads)
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **_: compile_seconds.__setitem__(0, compile_seconds[0] + duration)
    if event in _COMPILE_EVENTS else None)


class Phase:
    """Wall time of a phase, split into compile time (from JAX's compile events) and the rest: `compile_s` and
    `run_s` once the `with` block ends."""

    def __enter__(self):
        self.t0, self.c0 = time.perf_counter(), compile_seconds[0]
        return self

    def __exit__(self, *exc):
        self.compile_s = compile_seconds[0] - self.c0
        self.run_s = max(time.perf_counter() - self.t0 - self.compile_s, 0.0)

    @classmethod
    def empty(cls) -> "Phase":
        """A phase that took no time (for a path that does not time it separately)."""
        phase = cls()
        phase.compile_s = phase.run_s = 0.0
        return phase
