"""The one attention dispatch (`jaxkv.attention.api`): every kind resolves, "auto" keeps its per-platform order and
falls through a kernel that raises NotImplementedError to the XLA reference, a named implementation that cannot
serve a call says so (a ValueError naming it and the reason), and unknown kinds or names are refused before any
implementation runs. The model asks the dispatch: a patched kernel is seen through `jaxkv.logits`."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import attention as legacy
from jaxkv.attention import api, mla, mla_reference, paged_reference, pallas, reference
from jaxkv.layers import mla as mla_layer

from helpers.tolerances import atol

ATOL = atol("attention reference")  # the same XLA reference computed twice (dispatch, direct): helpers.tolerances
SCALE = 0.25
TOO_MANY = pallas.MAX_DECODE_QUERIES + 1  # queries per sequence past the decode kernels' rows

CONFIG = jaxkv.Config(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)


def contiguous_args(T=1, S=16, ring=False):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, T, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 2, S, 8)), jnp.float32) for _ in range(2))
    args = (q, k, v, jnp.asarray([0, 3], jnp.int32), jnp.int32(S - T if not ring else 20))
    return args, dict(scale=SCALE, sliding_window=S if ring else None, ring=ring)


def paged_args(T=1):
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(2, T, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(6, 2, 4, 8)), jnp.float32) for _ in range(2))
    table = jnp.asarray([[0, 2, -1], [1, 3, 4]], jnp.int32)
    lengths = jnp.asarray([7, 11], jnp.int32)
    q_slots = lengths[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None]
    return (q, k, v, table, lengths, q_slots), dict(scale=SCALE)


def latent_args(T=1):
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(2, T, 4, 24)), jnp.float32)
    latent = jnp.asarray(rng.normal(size=(2, 16, 24)), jnp.float32)
    return (q, latent, jnp.asarray([0, 5], jnp.int32), jnp.int32(16 - T)), dict(latent_dim=16, scale=SCALE)


def paged_latent_args(T=1):
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(2, T, 4, 24)), jnp.float32)
    pages = jnp.asarray(rng.normal(size=(6, 1, 4, 24)), jnp.float32)
    table = jnp.asarray([[0, 2, -1], [1, 3, 4]], jnp.int32)
    lengths = jnp.asarray([7, 11], jnp.int32)
    return (q, pages, table, lengths, lengths[:, None] - 1), dict(latent_dim=16, scale=SCALE)


CASES = {  # kind -> (inputs, the XLA reference to compare with)
    "contiguous": (contiguous_args, reference.full_attention),
    "paged": (paged_args, paged_reference.paged_attention),
    "latent": (latent_args, mla_reference.full_attention),
    "paged_latent": (paged_latent_args, None),  # its XLA implementation is the spec (test_paged_mla)
}


@pytest.fixture
def kernels_first(monkeypatch):
    """"auto" on this host tries the Pallas kernels first, as on GPU and TPU (on CPU they would interpret)."""
    monkeypatch.setattr(api, "DEVICE_PLATFORMS", (*api.DEVICE_PLATFORMS, jax.default_backend()))


def refusing(calls):
    def kernel(*args, **kwargs):
        calls.append(args)
        raise NotImplementedError("this patched kernel serves nothing")
    return kernel


# --- every kind resolves; "auto" keeps its order per platform ------------------------------------------------


@pytest.mark.parametrize("kind", api.KINDS)
def test_every_kind_resolves_and_equals_its_reference(kind):
    make, spec = CASES[kind]
    args, kwargs = make()
    got = {impl: np.asarray(api.get(kind, impl)(*args, **kwargs)) for impl in ("auto", "xla")}
    np.testing.assert_allclose(got["auto"], got["xla"], atol=ATOL, rtol=0)
    if spec is not None:
        np.testing.assert_allclose(got["xla"], spec(*args, **kwargs), atol=ATOL, rtol=0)
    assert api.resolve("auto", kind) in api.IMPLEMENTATIONS[kind]


def test_auto_order_per_platform():
    """As before the one dispatch: the Pallas kernels on GPU and TPU, the XLA reference on CPU (where Pallas only
    interprets); MLA over pages has no kernel anywhere."""
    for kind in ("contiguous", "paged", "latent"):
        assert api.order(kind, "cpu") == ("xla",)
        assert api.order(kind, "gpu") == api.order(kind, "tpu") == ("pallas", "xla")
    assert {api.order("paged_latent", p) for p in ("cpu", "gpu", "tpu")} == {("xla",)}
    on_device = jax.default_backend() in ("gpu", "tpu")
    assert legacy.resolve("auto") == ("pallas" if on_device else "xla")


def test_the_old_names_are_the_dispatch():
    assert legacy.IMPLEMENTATIONS is api.IMPLEMENTATIONS["contiguous"]
    assert legacy.IMPLEMENTATIONS["xla"] is reference.attention
    assert legacy.get("xla") is reference.attention
    assert mla.IMPLEMENTATIONS is api.IMPLEMENTATIONS["latent"] and mla.get("xla") is mla_reference.attention
    assert legacy.NAMES == api.NAMES == ("auto", "xla", "pallas")
    latent_config = types.SimpleNamespace(mla=object())  # all paged_attention_name reads: is it an MLA config
    assert mla_layer.paged_attention_name("auto", latent_config) == "xla"
    assert mla_layer.paged_attention_name("auto", CONFIG) == api.resolve("auto", "paged")


# --- fall-through for "auto"; a named implementation raises ---------------------------------------------------


@pytest.mark.parametrize("kind", ["contiguous", "paged", "latent"])
def test_auto_falls_through_a_refusing_kernel(kind, kernels_first, monkeypatch):
    calls = []
    monkeypatch.setitem(api.IMPLEMENTATIONS[kind], "pallas", refusing(calls))
    args, kwargs = CASES[kind][0]()
    attend = api.get(kind, "auto")
    assert attend.names == ("pallas", "xla")
    got = attend(*args, **kwargs)
    assert len(calls) == 1  # the kernel was asked first
    np.testing.assert_allclose(got, api.IMPLEMENTATIONS[kind]["xla"](*args, **kwargs), atol=ATOL, rtol=0)
    assert attend.serving(*args, **kwargs) == "xla"


def test_auto_falls_through_the_real_kernels_where_they_cannot_serve(kernels_first):
    """Real refusals, raised before any kernel runs: more queries over a ring than the decode kernel takes
    (contiguous), more queries per sequence than the paged kernel takes, a prompt chunk's fresh K/V (paged)."""
    args, kwargs = contiguous_args(T=TOO_MANY, S=32, ring=True)
    np.testing.assert_allclose(api.get("contiguous", "auto")(*args, **kwargs),
                               reference.attention(*args, **kwargs), atol=ATOL, rtol=0)
    args, kwargs = paged_args(T=TOO_MANY)
    np.testing.assert_allclose(api.get("paged", "auto")(*args, **kwargs),
                               paged_reference.paged_attention(*args, **kwargs), atol=ATOL, rtol=0)
    args, kwargs = paged_args(T=2)
    rng = np.random.default_rng(4)
    fresh = (*(jnp.asarray(rng.normal(size=(2, 2, 2, 8)), jnp.float32) for _ in range(2)),  # [B, K, T, H]
             jnp.asarray([[True, True], [True, False]]))
    np.testing.assert_allclose(api.get("paged", "auto")(*args, fresh=fresh, **kwargs),
                               paged_reference.paged_attention(*args, fresh=fresh, **kwargs), atol=ATOL, rtol=0)


def test_a_named_kernel_that_cannot_serve_raises_naming_itself():
    args, kwargs = contiguous_args(T=TOO_MANY, S=32, ring=True)
    with pytest.raises(ValueError, match=r"'pallas' cannot serve this contiguous attention call: .*ring"):
        api.get("contiguous", "pallas")(*args, **kwargs)
    args, kwargs = paged_args(T=TOO_MANY)
    with pytest.raises(ValueError, match=r"'pallas' cannot serve this paged attention call: .*at most 16 queries"):
        api.get("paged", "pallas")(*args, **kwargs)
    # Still a NotImplementedError, as these refusals were before the one dispatch.
    with pytest.raises(NotImplementedError, match="no Pallas kernel for MLA over a paged cache"):
        api.get("paged_latent", "pallas")


def test_a_named_implementation_never_falls_through(kernels_first, monkeypatch):
    calls = []
    monkeypatch.setitem(api.IMPLEMENTATIONS["contiguous"], "pallas", refusing(calls))
    args, kwargs = contiguous_args()
    with pytest.raises(ValueError, match="'pallas' cannot serve.*this patched kernel serves nothing"):
        api.get("contiguous", "pallas")(*args, **kwargs)
    assert len(calls) == 1


# --- unknown kinds and names: refused before any implementation runs ------------------------------------------


def test_unknown_kind_or_name_is_a_value_error_before_compute(monkeypatch):
    model = jaxkv.Model.random(CONFIG)  # before the patches: its init traces the model
    calls = []
    for kind in api.KINDS:
        for name in list(api.IMPLEMENTATIONS[kind]):
            monkeypatch.setitem(api.IMPLEMENTATIONS[kind], name, refusing(calls))
    with pytest.raises(ValueError, match="unknown attention kind 'ragged'"):
        api.get("ragged", "auto")
    with pytest.raises(ValueError, match="unknown attention implementation 'triton'"):
        api.get("paged", "triton")
    with pytest.raises(ValueError, match="unknown attention implementation 'triton'"):
        jaxkv.logits(model, [[1, 2, 3]], attention="triton")
    assert calls == []


# --- the model asks the dispatch ------------------------------------------------------------------------------


def test_the_model_attends_through_the_dispatch(kernels_first, monkeypatch):
    """A refusing kernel first in "auto"'s order: the whole model falls through to the XLA reference (the same
    logits as attention="xla"); named, the same kernel's refusal surfaces."""
    model = jaxkv.Model.random(CONFIG, seed=1)
    tokens = [[5, 9, 2, 7, 30, 1]]
    want = jaxkv.logits(model, tokens, attention="xla")
    calls = []
    monkeypatch.setitem(api.IMPLEMENTATIONS["contiguous"], "pallas", refusing(calls))
    np.testing.assert_allclose(jaxkv.logits(model, tokens, attention="auto"), want, atol=1e-5, rtol=0)
    assert len(calls) == CONFIG.n_layers
    with pytest.raises(ValueError, match="'pallas' cannot serve"):
        jaxkv.logits(model, tokens, attention="pallas")


def test_kernels_run_per_shard_on_a_mesh():
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    attend = api.get("contiguous", "auto", mesh=mesh)
    assert attend.implementation("xla") is reference.attention  # XLA partitions its own reference
    if "pallas" in api.IMPLEMENTATIONS["contiguous"]:
        assert attend.implementation("pallas") is not api.IMPLEMENTATIONS["contiguous"]["pallas"]
