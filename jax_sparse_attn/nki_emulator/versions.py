"""The NKI versions the emulator models, and what each version has, deprecated or removed.

One place for every version fact (docs/nki-emulator.md, "NKI versions", lists them with their
sources). The emulator models one NKI version per simulated launch: ``simulate(kernel,
nki_version="0.6")``, else :func:`nki_version` (a :func:`using` block, else the environment
variable ``JAX_SPARSE_ATTN_NKI_VERSION``, else :data:`DEFAULT_VERSION`, the newest the project
supports). Emulated instructions call :func:`requires` for what not every version has::

    from jax_sparse_attn.nki_emulator import versions
    versions.nki_version()              # "0.7" (or the environment's choice)
    versions.has("nl.fori_loop")        # True from NKI 0.6
    versions.requires("nl.dynamic_range")  # raises under 0.7 (removed), warns under 0.6

Sources (Neuron SDK docs): ``release-notes/components/nki.rst`` at tag v2.32.0 of
aws-neuron/aws-neuron-sdk (its NKI 0.4, 0.5 and 0.6 sections), the language and ISA
pages ``nki/api/nki/{language,isa}/__init__.py`` at v2.32.0, and for NKI 0.7 the readthedocs
pages of SDK v2.33.0 / v2.33.1 (``release-notes/components/nki``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from dataclasses import dataclass

from .errors import NkiUnsupportedError

VERSION_ENV = "JAX_SPARSE_ATTN_NKI_VERSION"

# NKI version -> the Neuron SDK release that ships it (each release notes' heading:
# "Neuron Kernel Interface (NKI) [0.6.0] (Neuron 2.32.0 Release)", ...).
SDK_OF_VERSION = {"0.3": "2.29", "0.4": "2.30", "0.5": "2.31", "0.6": "2.32", "0.7": "2.33"}
# Every version the emulator can model (to check what an older NKI would reject).
KNOWN_VERSIONS = tuple(SDK_OF_VERSION)
# The versions the project's kernels are written for and tested under (docs/guides/trainium.md,
# "Running on Trainium"): both have nl.fori_loop; 0.3 to 0.5 would need a second loop form (docs/neuron-kernel.md).
SUPPORTED_VERSIONS = ("0.6", "0.7")
DEFAULT_VERSION = SUPPORTED_VERSIONS[-1]


@dataclass(frozen=True)
class SdkRelease:
    """The Neuron SDK release that ships one supported NKI version, and its JAX packages."""

    nki: str
    sdk: str
    jax_neuronx: str
    jax: str  # the JAX versions its release notes support
    libneuronxla: str
    neuronx_cc: str
    python: str
    source: str


# SDK 2.32: release-notes/components/jax.rst ("continues support for JAX versions 0.7.0 to 0.10.0
# ... you must have libneuronxla version 3.*") and src/helperscripts/n2-manifest.json (package
# versions) at v2.32.0. SDK 2.33: readthedocs v2.33.0, release-notes/components/index (JAX NeuronX
# 0.10.0.1.0.14198 "supports JAX 0.7.0 to 0.10.0", NKI 0.7.0, Neuron Compiler 2.28.7631.0) and
# setup/jax/index (Python 3.11 to 3.14); its libneuronxla version is not in the stored pages: 3.*,
# as 2.30 to 2.32 require for JAX >= 0.8.2, is inferred.
SDK_RELEASES = {
    "0.6": SdkRelease("0.6.0", "2.32.0", "0.10.0.1.0.11459", "0.7.0 to 0.10.0", "3.0.5356.0",
                      "2.27.5334.0", "3.11 to 3.13",
                      "release-notes/components/jax.rst, src/helperscripts/n2-manifest.json @v2.32.0"),
    "0.7": SdkRelease("0.7.0", "2.33.0", "0.10.0.1.0.14198", "0.7.0 to 0.10.0", "3.* (inferred)",
                      "2.28.7631.0", "3.11 to 3.14",
                      "readthedocs v2.33.0: release-notes/components/index, setup/jax/index"),
}  # fmt: skip
# The pip requirements of the project's `neuron` extra (pyproject.toml holds the same list; a test
# checks it): the supported NKI versions and the lowest package versions of their SDKs.
NEURON_REQUIREMENTS = ("nki>=0.6,<0.8", "jax-neuronx>=0.10.0.1.0", "libneuronxla>=3,<4",
                       "neuronx-cc>=2.27")  # fmt: skip


class NkiDeprecationWarning(DeprecationWarning):
    """An API the modelled NKI version deprecates (NKI itself warns; the emulator does too)."""


@dataclass(frozen=True)
class Feature:
    """One versioned NKI API or behaviour: the version that added it, deprecated it, removed it."""

    name: str
    added: str = "0.3"
    deprecated: str | None = None
    removed: str | None = None
    source: str = ""
    instead: str = ""


_FEATURES = [
    # Loops.
    Feature("nl.dynamic_range", deprecated="0.6", removed="0.7",
            source="NKI 0.6 release notes, deprecated APIs; NKI 0.7 release notes: dynamic loops "
                   "removed with the Python-tracing front end (NKI_COMPILER_FRONTEND=custom keeps "
                   "them on SDK 2.33 only)",
            instead="nl.fori_loop(lower, upper, body)"),
    Feature("nl.fori_loop", added="0.6",
            source="NKI 0.6 release notes, new features; nki.language.fori_loop page"),
    Feature("nl.static_range", deprecated="0.6",
            source="nki.language.static_range page at v2.32.0: deprecated, will be removed",
            instead="Python range"),
    Feature("nl.affine_range", deprecated="0.3",
            source="nki.language pages: deprecated for static_range (0.3), for range (0.6)",
            instead="Python range"),
    Feature("nl.sequential_range", deprecated="0.3",
            source="nki.language pages: deprecated for static_range (0.3), for range (0.6)",
            instead="Python range"),
    # A dynamic loop's induction variable is a VirtualRegister usable as scalar_offset, and
    # writing to it raises (before, a 0.3 known issue: the variable could not address memory).
    Feature("loop variable as scalar_offset", added="0.4",
            source="NKI 0.4 release notes, bug fixes"),
    # Instructions and forms.
    Feature("nisa.topk", added="0.6", source="NKI 0.6 release notes, new features; nki.isa.topk"),
    Feature("nisa.topk(sorted=False)", added="0.7",
            source="NKI 0.7 release notes; nki.isa.topk page (v2.33.0)"),
    Feature("nc_matmul 8192-element bf16 dst (NeuronCore-v4)", added="0.5",
            source="NKI 0.5 release notes, new features: 8192 elements for a bfloat16 dst"),
    Feature("dma_transpose indirect src.shape[-1] < 128", added="0.4",
            source="NKI 0.4 release notes: the indirect form's innermost dimension relaxed from "
                   "exactly 128 to <= 128"),
    Feature("dma_transpose scalar_offset oob skip", added="0.5",
            source="NKI 0.5 release notes, new features"),
    Feature("dma_transpose hwdge relaxed", added="0.6",
            source="NKI 0.6 release notes, new features: hwdge src.shape[0] in {1, 2, 4, 8, 16}, "
                   "src.shape[-1] <= 128"),
    Feature("tensor_scalar_reduce reduce_res=None", added="0.6",
            source="NKI 0.6 release notes, new features"),
    # nl.copy runs on the Vector engine (tensor_copy) from 0.6, on the Scalar engine before (NKI
    # 0.3 release notes, known issues).
    Feature("nl.copy on VectorE", added="0.6",
            source="NKI 0.6 release notes, new features: nki.language.copy"),
]
FEATURES: dict[str, Feature] = {f.name: f for f in _FEATURES}


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def resolve_version(version: str | None = None) -> str:
    """``"0.3"`` .. ``"0.7"`` from ``version`` (``"0.7"``, ``"0.7.0"``, ``0.7``); ``None`` means
    :func:`nki_version`. Raises ``ValueError`` naming the accepted versions otherwise."""
    if version is None:
        return nki_version()
    text = str(version).strip()
    parts = text.split(".")
    short = ".".join(parts[:2]) if len(parts) >= 2 and all(p.isdigit() for p in parts) else text
    if len(parts) == 3 and parts[2] != "0":
        short = text  # only x.y.0 releases exist
    if short not in SDK_OF_VERSION:
        raise ValueError(
            f"NKI version must be one of {', '.join(KNOWN_VERSIONS)} (the project's kernels support "
            f"{', '.join(SUPPORTED_VERSIONS)}), got {version!r}"
        )
    return short


_OVERRIDE = threading.local()


def nki_version() -> str:
    """The NKI version being modelled: inside a simulated kernel the launch's version; else a
    :func:`using` block's; else ``JAX_SPARSE_ATTN_NKI_VERSION``; else :data:`DEFAULT_VERSION`.
    An unknown value of the variable raises ``ValueError`` naming it."""
    from ._core import _ACTIVE

    ctx = getattr(_ACTIVE, "ctx", None)
    if ctx is not None and getattr(ctx, "nki_version", None):
        return ctx.nki_version
    override = getattr(_OVERRIDE, "version", None)
    if override:
        return override
    raw = os.environ.get(VERSION_ENV, "").strip()
    if not raw:
        return DEFAULT_VERSION
    try:
        return resolve_version(raw)
    except ValueError as err:
        raise ValueError(f"{VERSION_ENV}={raw!r}: {err}") from None


@contextlib.contextmanager
def using(version: str):
    """``with versions.using("0.6"):`` models NKI 0.6 in this thread (launches without
    ``nki_version=``); for tests and host code."""
    resolved = resolve_version(version)
    previous = getattr(_OVERRIDE, "version", None)
    _OVERRIDE.version = resolved
    try:
        yield resolved
    finally:
        _OVERRIDE.version = previous


def sdk_of(version: str | None = None) -> str:
    """The Neuron SDK release that ships NKI ``version`` (default: the modelled one)."""
    return SDK_OF_VERSION[resolve_version(version)]


def has(feature: str, version: str | None = None) -> bool:
    """Whether NKI ``version`` (default: the modelled one) has ``feature`` (a :data:`FEATURES`
    name) and has not removed it."""
    f = FEATURES[feature]
    v = _key(resolve_version(version))
    return _key(f.added) <= v and (f.removed is None or v < _key(f.removed))


def requires(feature: str, what: str | None = None) -> None:
    """Raise :class:`NkiUnsupportedError` if the modelled NKI version lacks ``feature`` (not yet
    added, or removed); warn :class:`NkiDeprecationWarning` if it deprecates it. ``what`` names
    the use in the message (default: the feature)."""
    f = FEATURES[feature]
    version = nki_version()
    v = _key(version)
    what = what or f.name
    where = f"NKI {version} (SDK {SDK_OF_VERSION[version]}; {VERSION_ENV} selects the version)"
    instead = f"; use {f.instead}" if f.instead else ""
    if v < _key(f.added):
        raise NkiUnsupportedError(
            f"not in this NKI version: {what} needs NKI >= {f.added}, the emulator models "
            f"{where} ({f.source})"
        )
    if f.removed is not None and v >= _key(f.removed):
        raise NkiUnsupportedError(
            f"removed in this NKI version: {what} was removed in NKI {f.removed}, the emulator "
            f"models {where} ({f.source}){instead}"
        )
    if f.deprecated is not None and v >= _key(f.deprecated):
        warnings.warn(
            f"{what} is deprecated since NKI {f.deprecated} ({f.source}){instead}",
            NkiDeprecationWarning, stacklevel=3,
        )  # fmt: skip
