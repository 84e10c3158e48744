"""What both ops share on the Neuron path: whether the SDK is here, and the registrations.

Nothing here imports the Neuron SDK at import time: importing the package on a machine without
Neuron never fails or warns. Importing this package

- registers ``implementation="nki_emulated"`` (the Neuron data path with the kernel source run by
  the project's NKI emulator on the host) for the attention's primitives (the indexer's primitive
  dispatches to ``indexer/neuron.py`` itself), and
- asks JAX to register the ``"neuron"`` platform lowerings once its plugins are discovered.

Each op's kernel, packing and lowering live in its own package: ``attention/kernel.py``,
``attention/packing.py``, ``attention/neuron.py``; ``indexer/kernel.py``, ``indexer/neuron.py``.
"""

from __future__ import annotations

from ..attention import primitive
from ..attention.neuron import (
    emulated_gathered_attn_idx_lse,
    emulated_gathered_attn_lse,
    install_hint,
    install_neuron_lowerings,
)

# The primitives' paths return (out, lse): the emulated kernels' own lse.
primitive.register_path("nki_emulated", emulated_gathered_attn_lse, emulated_gathered_attn_idx_lse)
install_neuron_lowerings()


def nki_available() -> bool:
    """Whether the Neuron SDK's ``nki`` (0.6 or 0.7 supported) can be imported here (imports it on first call)."""
    from ..attention import kernel

    return kernel.nki is not None


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
