"""Where Pallas lives in the installed jax: every kernel imports `pl`, `pltpu` and `pltriton` from here.

jax 0.12.1 exposes Pallas as `jax.pallas` (with `jax.pallas.tpu`); earlier releases (jaxkv supports 0.10.2 on) only
as `jax.experimental.pallas`, which later releases keep as a deprecated alias. Importing the new namespace where it
exists keeps jaxkv's own code free of Pallas deprecation warnings on every supported jax (a test runs the smoke
path with `-W error::DeprecationWarning:jaxkv`).

The Triton GPU backend (`jax.experimental.pallas.triton`) has no `jax.pallas` home: it is deprecated since jax 0.11
in favour of Mosaic GPU, and jax warns when a Triton body is lowered (on a GPU, never in the CPU interpreter). jaxkv
keeps its Triton bodies while jax ships the backend; `pltriton` is None on a jax without it, and asking for a "gpu"
body then is an error naming the cause (`require_triton`).
"""

from __future__ import annotations

try:  # jax >= 0.12.1
    from jax import pallas as pl
    from jax.pallas import tpu as pltpu
except ImportError:  # jax 0.10.2 - 0.12.0
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

try:
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # a jax that no longer ships Pallas' Triton backend
    pltriton = None


def require_triton() -> None:
    """Raises if the installed jax has no Pallas Triton backend (the kernels' "gpu" bodies are written for it)."""
    if pltriton is None:
        import jax

        raise NotImplementedError(
            f"jax {jax.__version__} no longer ships Pallas' Triton backend, which jaxkv's GPU kernel bodies use; "
            "use attention='xla', or a jax release that has jax.experimental.pallas.triton")


__all__ = ["pl", "pltpu", "pltriton", "require_triton"]
