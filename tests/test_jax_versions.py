"""jaxkv on every supported jax (0.10.2 through 0.12.x): the Pallas namespace it imports, and no deprecation warning
raised from jaxkv's own code on the installed jax (docs/design/overview.md, "Supported versions")."""

import importlib.util
import os
import subprocess
import sys

import jax

from jaxkv.attention import pallas_namespace

from helpers.env import FAST_COMPILE, REPO

# The smoke path: the calls a user makes first, each kind of compiled program once (contiguous and paged caches,
# the Pallas kernels in the interpreter, int4 weights, a 2 x 2 mesh, beams, a save and load through orbax).
SMOKE = r"""
import tempfile, warnings
warnings.filterwarnings("error", category=DeprecationWarning, module=r"jaxkv(\.|$)")  # submodules too (-W's is exact)
import jax, jaxkv
model = jaxkv.load("tiny")
assert jaxkv.generate(model, ["The KV cache", "Py"], max_new_tokens=3).tokens
jaxkv.generate(model, ["The KV cache"], max_new_tokens=2, attention="pallas")
jaxkv.generate(model, ["The KV cache"], max_new_tokens=2, page_size=16, attention="pallas")
jaxkv.generate(jaxkv.load("tiny", weights="int4"), ["x"], max_new_tokens=2)
jaxkv.generate(model, ["a", "b"], max_new_tokens=2, mesh=jax.make_mesh((2, 2), ("data", "model")))
jaxkv.beam_search(model, ["a"], num_beams=2, max_new_tokens=2)
jaxkv.logits(model, [[1, 2, 3]])
with tempfile.TemporaryDirectory() as d:
    jaxkv.save(model, d + "/m")
    jaxkv.generate(jaxkv.load(d + "/m"), ["x"], max_new_tokens=2)
print("smoke ok")
"""


def test_no_deprecation_warning_from_jaxkv_code():
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {FAST_COMPILE}",
               JAXKV_COMPILE_CACHE="0")
    run = subprocess.run([sys.executable, "-W", "error::DeprecationWarning:jaxkv", "-c", SMOKE], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "smoke ok" in run.stdout, run.stderr[-4000:]


def test_pallas_comes_from_the_installed_jax_s_namespace():
    if importlib.util.find_spec("jax.pallas") is not None:  # jax >= 0.12.1
        assert pallas_namespace.pl.__name__ == "jax.pallas" and pallas_namespace.pltpu.__name__ == "jax.pallas.tpu"
    else:
        assert pallas_namespace.pl.__name__ == "jax.experimental.pallas"
    # the Triton bodies stay while jax ships the backend (the device issue replaces them with Mosaic GPU)
    assert pallas_namespace.pltriton is not None, jax.__version__


def test_every_extra_accepts_the_jax_users_have():
    """Installing jaxkv or any extra never replaces a supported jax: no requirement excludes 0.10.2, 0.11.x or
    0.12.x, and the installed one satisfies them all (.ci/run also checks that pip left it in place)."""
    import importlib.metadata
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    pins = [Requirement(line) for line in lines if Requirement(line).name in ("jax", "jaxlib")]
    assert pins, "pyproject.toml names no jax requirement"
    installed = importlib.metadata.version("jax")
    for pin in pins:
        for version in ("0.10.2", "0.11.0", "0.11.2", "0.12.0", "0.12.0.1", "0.12.1", installed):
            assert pin.specifier.contains(version), (str(pin), version)
    assert Requirement(next(line for line in lines if line.startswith("jax"))).specifier.contains("0.13.0") is False
