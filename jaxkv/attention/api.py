"""The one attention dispatch: `get(kind, impl)` is the attention a layer calls, for every cache kind.

Kinds, each with one signature (that of its XLA reference, listed last in its table):

  "contiguous"    (q, k, v, start, q_offset, *, scale, sliding_window, k_scale, v_scale, ring, softcap, sinks)
                  `reference.attention`; Pallas: `pallas.attention` (decode and prefill kernels)
  "paged"         (q, k_pages, v_pages, page_table, lengths, q_slots, *, scale, sliding_window, k_scale, v_scale,
                  softcap, fresh, sinks)  `paged_reference.xla_attention`; Pallas: `pallas.paged_attention` (decode)
  "latent"        (q, latent, start, q_offset, *, latent_dim, scale, latent_scale, sliding_window, ring)
                  `mla_reference.attention`; Pallas: `mla_decode_kernel.mla_decode` (decode)
  "paged_latent"  (q, latent_pages, page_table, lengths, q_slots, *, latent_dim, scale, sliding_window,
                  latent_scale, fresh)  `paged_mla.live_paged_mla_attention`; no Pallas kernel yet

`impl` is "xla", "pallas" or "auto". "auto" tries the kind's implementations in `order(kind)`: on GPU and TPU the
Pallas kernel first, then the XLA reference; on CPU the XLA reference alone (Pallas only interprets there). A kernel
that cannot serve a call (a shape, dtype, platform, ring, prompt chunk, ...) raises NotImplementedError while
tracing, before any compute (`reference.Unsupported`), and "auto" falls through to the next implementation; the
XLA reference, last, serves every case. A named implementation never falls through: it serves the call or raises
`Unsupported` (a ValueError and a NotImplementedError) naming itself and the reason. An unknown kind or name is a
ValueError before anything is traced (`check`).

With a mesh, a Pallas kernel runs per shard (`jaxkv.sharding`'s shard_map wrappers: a kernel cannot be
auto-partitioned); the XLA references are partitioned by XLA and never wrapped.

May import: the attention modules of this package, `jaxkv.sharding` (for the shard_map wrappers), jax.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Callable

import jax

from jaxkv import sharding
from jaxkv.attention import mla_reference, paged_mla, paged_reference, reference
from jaxkv.attention.reference import Unsupported

KINDS = ("contiguous", "paged", "latent", "paged_latent")
NAMES = ("auto", "xla", "pallas")
DEVICE_PLATFORMS = ("gpu", "tpu")  # where "auto" puts the Pallas kernels first

# kind -> implementation name -> function (the XLA reference last). Mutable: a build without Pallas has no
# "pallas" entries, and tests swap an entry to watch the fall-through.
IMPLEMENTATIONS: dict[str, dict[str, Callable]] = {
    "contiguous": {"xla": reference.attention},
    "paged": {"xla": paged_reference.xla_attention},
    "latent": {"xla": mla_reference.attention},
    "paged_latent": {"xla": paged_mla.live_paged_mla_attention},
}

try:  # Pallas ships with jaxlib; a build without it simply has no "pallas" implementations.
    from jaxkv.attention import mla_decode_kernel, pallas
except ImportError:  # pragma: no cover
    pass
else:
    IMPLEMENTATIONS["contiguous"]["pallas"] = pallas.attention
    IMPLEMENTATIONS["paged"]["pallas"] = pallas.paged_attention
    IMPLEMENTATIONS["latent"]["pallas"] = mla_decode_kernel.mla_decode

# Why a kind has no implementation of a name, for the error that refuses it by name.
MISSING = types.MappingProxyType({
    "paged_latent": "there is no Pallas kernel for MLA over a paged cache yet: use attention='xla' or 'auto' (n=1 "
                    "without a prefix cache uses the contiguous cache's kernel)",
})

# The shard_map wrapper a kernel of each kind runs under on a mesh: its name in `jaxkv.sharding`, looked up when a
# kernel is wrapped (so the wrapper is sharding's own at that time, as a test that counts the wrappings needs).
SHARDED = types.MappingProxyType({"contiguous": "shard_attention", "paged": "shard_paged_attention",
                                  "latent": "shard_latent_attention"})


def kind_of(*, latent: bool, paged: bool) -> str:
    """The kind of attention a model runs over a cache: `latent` for an MLA config, `paged` for a `PagedKVCache`."""
    if latent:
        return "paged_latent" if paged else "latent"
    return "paged" if paged else "contiguous"


def check(impl: str, kind: str = "contiguous") -> str:
    """`impl` itself, once known to name an implementation of `kind` in this build: ValueError for an unknown kind
    or name, `Unsupported` for a name the kind does not have (before anything is compiled)."""
    if kind not in KINDS:
        raise ValueError(f"unknown attention kind {kind!r}; choose one of {list(KINDS)}")
    if impl not in NAMES:
        raise ValueError(f"unknown attention implementation {impl!r}; choose one of {list(NAMES)}")
    if impl != "auto" and impl not in IMPLEMENTATIONS[kind]:
        reason = MISSING.get(kind, "it is not available in this build")
        raise Unsupported(f"attention implementation {impl!r} cannot serve {kind} attention: {reason}")
    return impl


def order(kind: str, platform: str | None = None) -> tuple[str, ...]:
    """The implementations "auto" tries for `kind`, first choice first, on `platform` (default: the default
    backend's): the Pallas kernel then the XLA reference on GPU and TPU, the XLA reference alone on CPU."""
    check("auto", kind)
    platform = platform or jax.default_backend()
    names = ("pallas", "xla") if platform in DEVICE_PLATFORMS else ("xla",)
    return tuple(name for name in names if name in IMPLEMENTATIONS[kind])


def resolve(impl: str, kind: str = "contiguous") -> str:
    """The one implementation name `impl` stands for before any call is seen: itself, or for "auto" the first of
    `order(kind)` (which may still fall through at a call it cannot serve)."""
    return order(kind)[0] if check(impl, kind) == "auto" else impl


def function(kind: str, impl: str) -> Callable:
    """The raw function `resolve(impl, kind)` names (no fall-through, no mesh): what the old per-kind
    `get(name)` functions return (`jaxkv.attention.get`, `jaxkv.attention.mla.get`)."""
    return IMPLEMENTATIONS[kind][resolve(impl, kind)]


@dataclasses.dataclass(frozen=True)
class Attend:
    """The attention of one kind as a layer calls it (`get`): tries `names` in order (one, unless "auto")."""

    kind: str
    names: tuple[str, ...]
    explicit: bool  # a name was asked for: it serves the call or raises, never falls through
    mesh: object = None  # a jax.sharding.Mesh: kernels run per shard

    def implementation(self, name: str) -> Callable:
        fn = IMPLEMENTATIONS[self.kind][name]
        if self.mesh is not None and name != "xla":  # the XLA references are partitioned by XLA itself
            fn = getattr(sharding, SHARDED[self.kind])(fn, self.mesh)
        return fn

    def __call__(self, *args, **kwargs):
        for name in self.names[:-1]:
            try:
                return self.implementation(name)(*args, **kwargs)
            except NotImplementedError:  # raised while tracing, before any compute: the next one serves
                continue
        name = self.names[-1]
        try:
            return self.implementation(name)(*args, **kwargs)
        except NotImplementedError as err:
            if not self.explicit:
                raise
            raise Unsupported(f"attention implementation {name!r} cannot serve this {self.kind} attention call: "
                              f"{err}") from err

    def serving(self, *args, **kwargs) -> str:
        """The name of the implementation that serves this call, found by tracing the candidates abstractly
        (`jax.eval_shape`, nothing computed); the XLA reference, last, is never traced. For a caller whose work
        before the call depends on it (`KVCache.write`'s zero_dead_values is for the XLA path only)."""
        for name in self.names[:-1]:
            try:
                jax.eval_shape(lambda *a: self.implementation(name)(*a, **kwargs), *args)
            except NotImplementedError:
                continue
            return name
        return self.names[-1]


def get(kind: str, impl: str, *, mesh=None) -> Attend:
    """The attention of `kind` ("contiguous", "paged", "latent" or "paged_latent") by implementation `impl`
    ("auto", "xla" or "pallas"): a callable with the kind's signature (module docstring). "auto" falls through its
    `order` at a call a kernel cannot serve; a name serves or raises `Unsupported`. With a `mesh`, kernels run per
    shard. Unknown kinds and names are ValueErrors here, before any call."""
    check(impl, kind)
    names = order(kind) if impl == "auto" else (impl,)
    return Attend(kind, names, impl != "auto", mesh)
