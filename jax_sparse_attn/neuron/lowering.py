"""The Neuron data path (pack -> NKI kernel -> unpack) and where it plugs into JAX.

Two ways to run the same path, both traced with jnp inside ``mlir.lower_fun``:

- on a Neuron device, the kernel is the ``nki.jit`` function called on the traced arrays: that
  binds NKI's own JAX primitive (``nki_call``), which lowers to a StableHLO custom call
  (``jax_neuronx.nki_call`` is gone since Neuron 2.23);
- ``implementation="nki_emulated"`` runs the kernel source under the project's NKI emulator on the
  host through ``jax.pure_callback``, on any platform, so the whole data path is testable without
  Trainium.

The ``"neuron"`` lowering rule is registered lazily: JAX only knows the platform once its PJRT
plugin has been discovered (on first backend use), and registering a rule for an unknown platform
raises ``NotImplementedError``. ``install_neuron_lowerings`` hands the registration to JAX's plugin
callbacks, which run right after plugin discovery (or at once when it already happened).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from .. import primitives
from .packing import (
    KernelLayout,
    PackedOperands,
    check_fits_on_chip,
    empty_result,
    kernel_layout,
    pack_for_kernel,
    unpack_from_kernel,
)

NEURON_PLATFORM = "neuron"

NEURON_INSTALL_HINT = (
    "install the Neuron SDK on a Trainium host from the Neuron pip repository: "
    "pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "
    "'nki>=0.3' 'jax-neuronx>=0.7' 'libneuronxla>=2.2' 'neuronx-cc>=2.24' (Neuron SDK >= 2.29; "
    "'.[neuron]' in a clone of this repository installs the same). implementation='nki_emulated' "
    "runs the kernel source on the host."
)

KernelCall = Callable[[PackedOperands, KernelLayout], jax.Array]


def _run_packed(call_kernels: KernelCall, q, slot_rows, sink, bias, scale, idx=None) -> jax.Array:
    """pack -> ``call_kernels`` (returns ``[G, T*Hg, Dp]`` bf16) -> unpack."""
    T, H, D = q.shape
    layout = kernel_layout(T, H, D, bias.shape[1])
    if layout.is_empty or (idx is not None and slot_rows.shape[0] == 0):
        return empty_result(q)
    check_fits_on_chip(layout)
    packed, layout = pack_for_kernel(q, slot_rows, sink, bias, scale, idx=idx)
    out_groups = call_kernels(packed, layout)
    return unpack_from_kernel(out_groups, layout, packed.row_has_slot, q.dtype)


def _kernel_args(packed: PackedOperands, group: int) -> tuple:
    """Arguments of one kernel call, in the kernel's order."""
    if packed.idx is not None:
        return (packed.q_groups[group], packed.slot_rows, packed.idx, packed.bias,
                packed.sink_groups[group])
    return (packed.q_groups[group], packed.slot_rows, packed.bias, packed.sink_groups[group])


def _raw_kernel(indexed: bool):
    from . import kernels

    return kernels.gathered_attn_idx_kernel if indexed else kernels.gathered_attn_kernel


# --- on Neuron: nki.jit on traced arrays ------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _jitted_kernel(indexed: bool):
    from . import kernels

    if kernels.nki is None:
        raise RuntimeError(
            f"the NKI kernel needs the Neuron SDK (`import nki` failed): {NEURON_INSTALL_HINT}"
        )
    return kernels.nki.jit(_raw_kernel(indexed))


def _call_nki_kernels(packed: PackedOperands, layout: KernelLayout) -> jax.Array:
    kernel = _jitted_kernel(packed.idx is not None)
    outs = [kernel(*_kernel_args(packed, g)) for g in range(layout.head_groups)]
    return jnp.stack(outs)


def nki_gathered_attn(q, g, sink, bias, scale):
    """The Neuron path of ``gathered_attn_p``: q ``[T, H, D]``, g ``[T, K, D]``, sink ``[H]`` f32,
    bias ``[T, K]`` f32 (``-inf`` = empty slot), scale ``[T]`` f32 -> ``[T, H, D]`` in q's dtype."""
    return _run_packed(_call_nki_kernels, q, g, sink, bias, scale)


def nki_gathered_attn_idx(q, kv, idx, sink, bias, scale):
    """The Neuron path of ``gathered_attn_idx_p``: q ``[T, H, D]``, kv ``[R, D]``, idx ``[T, K]``
    int32 (-1 = empty), sink ``[H]`` f32, bias ``[T, K]`` f32, scale ``[T]`` f32 -> ``[T, H, D]``."""
    return _run_packed(_call_nki_kernels, q, kv, sink, bias, scale, idx=idx)


# --- on the host: the kernel source under the emulator, through a host callback ---------------


def _run_emulated_on_host(indexed: bool, *arrays):
    """Host side of the callback: the kernel operands in the kernel's order, q and sink stacked
    per head group (numpy); returns ``[G, T*Hg, Dp]`` bf16."""
    from ..nki_emulator import simulate

    kernel = simulate(_raw_kernel(indexed))
    # The callback may receive jax.Arrays: slicing one would dispatch a computation to a device
    # that is busy waiting for this very callback (a deadlock once every device runs one).
    arrays = [np.asarray(a) for a in arrays]
    q_groups, shared, sink_groups = arrays[0], arrays[1:-1], arrays[-1]
    outs = [kernel(q_groups[g], *shared, sink_groups[g]) for g in range(len(q_groups))]
    return np.stack([np.asarray(o) for o in outs]).astype(jnp.bfloat16)


def _call_emulated_kernels(packed: PackedOperands, layout: KernelLayout) -> jax.Array:
    indexed = packed.idx is not None
    result = jax.ShapeDtypeStruct(
        (layout.head_groups, layout.tokens * layout.heads_per_group, layout.dim_padded),
        jnp.bfloat16,
    )
    arrays = [packed.q_groups, packed.slot_rows, packed.bias, packed.sink_groups]
    if indexed:
        arrays.insert(2, packed.idx)
    # The primitives' vmap rule folds batches into tokens before lowering, so this callback is
    # never batched itself; "sequential" is only the safe answer should that ever change.
    return jax.pure_callback(
        functools.partial(_run_emulated_on_host, indexed), result, *arrays, vmap_method="sequential"
    )


def emulated_gathered_attn(q, g, sink, bias, scale):
    """``implementation="nki_emulated"`` for ``gathered_attn_p``: the Neuron path on the host.

    Operands and result as :func:`nki_gathered_attn`."""
    return _run_packed(_call_emulated_kernels, q, g, sink, bias, scale)


def emulated_gathered_attn_idx(q, kv, idx, sink, bias, scale):
    """``implementation="nki_emulated"`` for ``gathered_attn_idx_p``: Neuron path on the host.

    Operands and result as :func:`nki_gathered_attn_idx`."""
    return _run_packed(_call_emulated_kernels, q, kv, sink, bias, scale, idx=idx)


# --- the "neuron" platform rule ---------------------------------------------------------------


def _neuron_rule(indexed: bool):
    kernel_path = nki_gathered_attn_idx if indexed else nki_gathered_attn

    def rule(*args, implementation):
        if implementation is None or implementation == "nki":
            path_fn = kernel_path
        else:
            path_fn = primitives.path(implementation, indexed)
        # Each device runs the kernel on its own tokens/heads: no gathers around the custom call.
        return primitives.run_shard_local(path_fn, indexed, *args)

    return rule


_neuron_lowerings_registered = False


def register_neuron_lowerings(**_plugin_info) -> bool:
    """Registers the ``"neuron"`` rules once JAX knows that platform; returns whether they are.

    Called by JAX after PJRT plugin discovery (with ``c_api=...`` for each discovered plugin).
    """
    global _neuron_lowerings_registered
    if _neuron_lowerings_registered:
        return True
    try:
        mlir.register_lowering(
            primitives.gathered_attn_p,
            mlir.lower_fun(_neuron_rule(False), multiple_results=True),
            platform=NEURON_PLATFORM,
        )
        mlir.register_lowering(
            primitives.gathered_attn_idx_p,
            mlir.lower_fun(_neuron_rule(True), multiple_results=True),
            platform=NEURON_PLATFORM,
        )
    except NotImplementedError:
        return False  # No Neuron plugin among the discovered ones: nothing to register.
    _neuron_lowerings_registered = True
    return True


def install_neuron_lowerings() -> None:
    """Defers :func:`register_neuron_lowerings` to JAX's plugin discovery (never fails)."""
    try:
        from jax._src import xla_bridge

        xla_bridge.register_plugin_callbacks(register_neuron_lowerings)
    except (ImportError, AttributeError):
        # A JAX without plugin callbacks: try now (succeeds only if "neuron" is already known).
        register_neuron_lowerings()
