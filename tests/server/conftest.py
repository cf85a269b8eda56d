"""Fixtures only: a compilation cache shared by the `jaxkv serve` subprocesses of the "server" xdist group.

tests/server/test_server.py's server and scripts/soak_serve.py's (tests/server/test_soak.py) run the same engine
(the bundled model, 4 slots, max_len 256, the default chunk and dispatch sizes): whichever starts second reads
every program the first compiled. Both run in one worker (the group), so one directory per session serves both.
The test process's own cache stays off (tests/conftest.py): only these subprocesses read and write it, and no
test counts their compiles."""

import pytest


@pytest.fixture(scope="session")
def serve_compile_cache(tmp_path_factory):
    """{"JAXKV_COMPILE_CACHE": a directory for this session's serve subprocesses}."""
    return {"JAXKV_COMPILE_CACHE": str(tmp_path_factory.mktemp("serve-xla"))}
