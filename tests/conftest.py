"""Fixtures only (the shared code is in tests/helpers, which no test file reaches through here).

XLA_FLAGS must be set before jax is first imported, so multi-device tests can see 8 host devices; nothing here
depends on the device count otherwise. tests/ goes on sys.path so that every folder's test files import `helpers`.
"""

import gc
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from helpers.env import FAST_COMPILE  # noqa: E402  (no jax import there)

os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}")
# No persistent compilation cache in tests (tests/test_compile_cache.py turns it on in its own processes): compile
# counts and compile times must not depend on what an earlier run left on disk.
os.environ.setdefault("JAXKV_COMPILE_CACHE", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

from helpers.models import CONFIGS, model_for  # noqa: E402


@pytest.fixture(params=sorted(CONFIGS))
def any_model(request):
    return model_for(request.param)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_code():
    """Drops every compiled executable after each test file. XLA:CPU maps the code of each executable into memory
    (several mappings each); the whole suite compiles thousands of programs, and one process crossed Linux's limit
    of 65,530 mappings (vm.max_map_count): mmap failed inside the compiler and the process died with a segfault.
    Files rarely share compiled shapes, so clearing costs little."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the marks into the node ids
def pytest_collection_modifyitems(config, items):
    """Under `--dist loadgroup` a test without an xdist_group is a work unit of its own, so the two workers take
    turns through every file and each compiles the programs the file's tests share. Grouped by file instead, a
    file runs on one worker; explicit groups (one server shared by several files) are kept."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
