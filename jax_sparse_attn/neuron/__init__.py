"""The Neuron path: packing for the NKI kernels, the kernels, and their lowerings.

Nothing here imports the Neuron SDK at import time: importing the package on a machine without
Neuron never fails or warns.
"""

from __future__ import annotations


def check_implementation_available(implementation: str) -> None:
    """Raises a clear error when ``implementation`` cannot run here (called at trace time)."""
    raise NotImplementedError(
        f"implementation={implementation!r} is not available yet in this build of "
        "jax-sparse-attn; use implementation=None or 'reference'."
    )
