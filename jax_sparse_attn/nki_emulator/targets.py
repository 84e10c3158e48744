"""The Trainium generations the emulator models, and the target NKI compiles for.

Sources (Neuron SDK docs, aws-neuron/aws-neuron-sdk at tag v2.29.1):

* ``nki/api/nki/__init__.py`` (``nki.jit``): the target comes from the environment variable
  ``NEURON_PLATFORM_TARGET_OVERRIDE``, values ``trn1``/``gen2``, ``trn2``/``gen3``, ``trn3``/``gen4``
  (``nki.jit(platform_target=...)`` is deprecated in NKI 0.3, release notes).
* ``nki/api/nki/isa/__init__.py`` (``nki.isa.nc_version``): gen2 = Trn1, gen3 = Trn2, gen4 = Trn3.
* SBUF per partition: ``nki/guides/architecture/trainium_inferentia2_arch.rst`` (NeuronCore-v2,
  24 MiB = 128 x 192 KiB), ``trainium2_arch.rst`` (NeuronCore-v3, 28 MiB = 128 x 224 KiB),
  ``trainium3_arch.rst`` (NeuronCore-v4, 32 MiB, i.e. 128 x 256 KiB).
* Logical cores: ``about-neuron/arch/neuron-features/logical-neuroncore-config.rst``: LNC is 1 or 2,
  applies only to Trn2 and Trn3, and LNC=2 is the default on Trainium2. trn3's default is not
  stated there; the SDK 2.33 compiler error page ``compiler/error-codes/EVRF066`` gives
  "neuronx-cc defaults to LNC=2 on Trn2 and later", so 2 for trn3 as well.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .. import constants

TARGET_ENV = "NEURON_PLATFORM_TARGET_OVERRIDE"
DEFAULT_TARGET = "trn2"


@dataclass(frozen=True)
class Target:
    """One Trainium generation as the emulator models it.

    Attributes:
      name: ``"trn1"``, ``"trn2"`` or ``"trn3"``.
      nc_version: the NeuronCore version (2, 3, 4): NeuronCore-v2 is trn1, v3 trn2, v4 trn3.
      sbuf_bytes_per_partition: SBUF capacity of one partition of one physical core.
      lnc_max: the largest launch grid (physical cores per logical core) a kernel may use.
      lnc_default: the runtime's default number of physical cores per logical core.
    """

    name: str
    nc_version: int
    sbuf_bytes_per_partition: int
    lnc_max: int
    lnc_default: int


TARGETS: dict[str, Target] = {
    "trn1": Target("trn1", 2, constants.SBUF_BYTES_PER_PARTITION, lnc_max=1, lnc_default=1),
    "trn2": Target("trn2", 3, constants.SBUF_BYTES_PER_PARTITION_TRN2, lnc_max=2, lnc_default=2),
    # trainium3_arch.rst: 32 MiB SBUF = 128 partitions x 256 KiB.
    "trn3": Target("trn3", 4, 256 * 1024, lnc_max=2, lnc_default=2),
}

# nki.jit's page lists gen2/gen3/gen4 as synonyms of trn1/trn2/trn3.
_ALIASES = {"gen2": "trn1", "gen3": "trn2", "gen4": "trn3"}


def resolve_target(name: str | Target | None = None) -> Target:
    """The :class:`Target` called ``name`` (``trn1``/``trn2``/``trn3`` or ``gen2``-``gen4``).

    ``None`` means :func:`current_target`. Raises ``ValueError`` for anything else.
    """
    if isinstance(name, Target):
        return name
    if name is None:
        name = current_target()
    key = _ALIASES.get(str(name).strip().lower(), str(name).strip().lower())
    if key not in TARGETS:
        raise ValueError(
            f"target must be one of {sorted(TARGETS)} (or gen2/gen3/gen4), got {name!r}"
        )
    return TARGETS[key]


def current_target() -> str:
    """The target NKI compiles for: ``NEURON_PLATFORM_TARGET_OVERRIDE``, default ``"trn2"``.

    Returns ``"trn1"``, ``"trn2"`` or ``"trn3"`` (``gen2``/``gen3``/``gen4`` are accepted as the
    variable's value too). An unknown value raises ``ValueError`` naming the variable.
    """
    raw = os.environ.get(TARGET_ENV, "").strip()
    if not raw:
        return DEFAULT_TARGET
    key = _ALIASES.get(raw.lower(), raw.lower())
    if key not in TARGETS:
        raise ValueError(
            f"{TARGET_ENV}={raw!r} is not a target NKI knows: use trn1, trn2 or trn3 "
            "(or gen2, gen3, gen4)"
        )
    return key
