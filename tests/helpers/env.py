"""The test process's environment: the XLA flags every test process (and each subprocess a test starts) runs with,
and the repository's paths. Imports no jax: tests/conftest.py reads it before jax is first imported."""

import pathlib

# The suite is compile-bound (thousands of small programs, each run a few times): XLA:CPU's LLVM backend at
# optimization level 0 cut a sample of test files' CPU time by 26-37% (docs/design/testing.md). The HLO
# passes, and so every program's structure and what the HLO tests read, are unchanged. Outside the tests (the
# library, its commands, the benchmarks) XLA's defaults apply.
FAST_COMPILE = "--xla_backend_optimization_level=0"  # also in the XLA_FLAGS of the tests' own subprocesses

TESTS = pathlib.Path(__file__).resolve().parents[1]
REPO = TESTS.parent
SCRIPTS = REPO / "scripts"
README = REPO / "README.md"
