"""The Neuron path: packing for the NKI kernels, the kernels, and their lowerings.

Nothing here imports the Neuron SDK at import time: importing the package on a machine without
Neuron never fails or warns. Importing this package

- registers ``implementation="nki_emulated"`` (the Neuron data path with the kernel source run by
  the project's NKI emulator on the host) for both primitives, and
- asks JAX to register the ``"neuron"`` platform lowerings once its plugins are discovered.

Modules: :mod:`.packing` (jnp pack / unpack), :mod:`.kernels` (the NKI kernel source),
:mod:`.lowering` (kernel calls, the emulated path, the platform rules).
"""

from __future__ import annotations

from .. import primitives
from .lowering import (
    emulated_gathered_attn_idx_lse,
    emulated_gathered_attn_lse,
    install_hint,
    install_neuron_lowerings,
)

# The primitives' paths return (out, lse): the emulated kernels' own lse.
primitives.register_path("nki_emulated", emulated_gathered_attn_lse, emulated_gathered_attn_idx_lse)
install_neuron_lowerings()


def nki_available() -> bool:
    """Whether the Neuron SDK's ``nki`` (0.6 or 0.7 supported) can be imported here (imports it on first call)."""
    from . import kernels

    return kernels.nki is not None


def check_implementation_available(implementation: str) -> None:
    """Raises a clear error when ``implementation`` cannot run here (called at trace time).

    ``"nki_emulated"`` always runs. ``"nki"`` needs the Neuron SDK; without it this raises a
    ``RuntimeError`` saying what to install.
    """
    if implementation == "nki" and not nki_available():
        raise RuntimeError(
            "implementation='nki' runs the NKI kernel on AWS Trainium, but the Neuron SDK is not "
            f"installed here (`import nki` failed): {install_hint()}"
        )
