"""The Neuron data path (pack -> NKI kernel -> unpack) and where it plugs into JAX.

Two ways to run the same path, both traced with jnp inside ``mlir.lower_fun``:

- on a Neuron device, the kernel is the ``nki.jit`` function called on the traced arrays: that
  binds NKI's own JAX primitive (``nki_call``), which lowers to a StableHLO custom call
  (``jax_neuronx.nki_call`` is gone since Neuron 2.23);
- ``implementation="nki_emulated"`` runs the kernel source under the project's NKI emulator on the
  host through ``jax.pure_callback``, so the whole data path is testable without Trainium. JAX on
  Neuron has no host callbacks, so on the ``"neuron"`` platform it raises a clear error instead.

The kernel variant follows the NKI target (:func:`neuron_target`, docs/neuron-kernel.md): trn2 and
trn3 gather inside the kernel, trn1 gathers with XLA and runs the kernel without
``dma_transpose`` or indirect DMA. The ``*_lse`` functions also return the ``[T, H]`` f32
log-sum-exp of each row.

The ``"neuron"`` lowering rule is registered lazily: JAX only knows the platform once its PJRT
plugin has been discovered (on first backend use), and registering a rule for an unknown platform
raises ``NotImplementedError``. ``install_neuron_lowerings`` hands the registration to JAX's plugin
callbacks, which run right after plugin discovery (or at once when it already happened).
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from . import primitive as primitives
from ..constants import TARGETS_WITH_DGE, value_shift
from .packing import (
    KernelLayout,
    PackedOperands,
    empty_result,
    kernel_layout,
    pack_for_kernel,
    unpack_from_kernel,
)

NEURON_PLATFORM = "neuron"

def install_hint() -> str:
    """What to install for the NKI kernel: the supported Neuron SDKs' packages (from
    ``nki_emulator.versions``, imported only when a message needs it)."""
    from ..nki_emulator.versions import NEURON_REQUIREMENTS, SDK_RELEASES

    sdks = " or ".join(f"{r.sdk} (NKI {r.nki})" for r in SDK_RELEASES.values())
    return (
        "install the Neuron SDK on a Trainium host from the Neuron pip repository: "
        "pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "
        + " ".join(f"'{r}'" for r in NEURON_REQUIREMENTS)
        + f" (Neuron SDK {sdks}; '.[neuron]' in a clone of this repository installs the same). "
        "implementation='nki_emulated' runs the kernel source on the host."
    )


KernelCall = Callable[..., tuple[jax.Array, jax.Array]]

# JAX on Neuron cannot call back into the host: nki_emulated cannot run on that platform.
NO_HOST_CALLBACKS_ON_NEURON = (
    "implementation='nki_emulated' runs the kernel under the project's NKI emulator through a host "
    "callback (jax.pure_callback), and JAX on Neuron does not support host callbacks (JAX NeuronX "
    "release notes, known issues). Run it on the CPU backend instead: put the inputs on "
    "jax.devices('cpu')[0] (for example inside `with jax.default_device(jax.devices('cpu')[0]):`), "
    "or use implementation=None / 'nki' for the NKI kernel on the Neuron device."
)


def neuron_target() -> str:
    """The NKI compile target: ``NEURON_PLATFORM_TARGET_OVERRIDE`` (``trn1``/``gen2``,
    ``trn2``/``gen3``, ``trn3``/``gen4``: the variable NKI itself reads, nki.jit page), ``trn2``
    when it is unset; a ``ValueError`` names the variable on another value. The one reading of it
    (``nki_emulator.targets.current_target``) serves the Neuron device and ``nki_emulated``."""
    from ..nki_emulator.targets import current_target

    return current_target()


# The LNC settings (about-neuron/arch/neuron-features/logical-neuroncore-config.rst): the runtime's
# (and, when set, the compiler's and NKI's) NEURON_LOGICAL_NC_CONFIG, and the compiler's own flag,
# which frameworks pass through NEURON_CC_FLAGS (compiler/error-codes/EVRF066, SDK 2.33 docs).
LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
CC_FLAGS_ENV = "NEURON_CC_FLAGS"
# neuronx-cc's spellings of the flag (logical-neuroncore-config.rst: --logical-nc-config / -lnc;
# EVRF066: --lnc=1).
LNC_FLAGS = ("--lnc", "--logical-nc-config", "-lnc")


def _lnc_value(text: str, where: str) -> int:
    if text.strip() not in ("1", "2"):
        raise ValueError(f"{where}: the LNC degree is 1 or 2, got {text!r}")
    return int(text)


def compiler_lnc_flag(flags: str | None = None) -> int | None:
    """The LNC degree that ``NEURON_CC_FLAGS`` (or ``flags``) passes to neuronx-cc (``--lnc=N``,
    ``--lnc N``, ``--logical-nc-config N``, ``-lnc N``), or None when it names none. A flag
    without a value, with a value other than 1 or 2, or given twice with different values is a
    ``ValueError`` naming ``NEURON_CC_FLAGS``: the kernel's launch grid cannot be known then."""
    import shlex

    flags = os.environ.get(CC_FLAGS_ENV, "") if flags is None else flags
    try:
        tokens = shlex.split(flags)
    except ValueError as err:
        raise ValueError(f"{CC_FLAGS_ENV}={flags!r} cannot be parsed ({err})") from None
    found = []
    for i, token in enumerate(tokens):
        for name in LNC_FLAGS:
            if token == name:
                if i + 1 >= len(tokens):
                    raise ValueError(f"{CC_FLAGS_ENV}={flags!r}: {name} has no value")
                found.append(_lnc_value(tokens[i + 1], f"{CC_FLAGS_ENV}={flags!r} ({name})"))
            elif token.startswith(name + "="):
                found.append(_lnc_value(token[len(name) + 1 :], f"{CC_FLAGS_ENV}={flags!r} ({name})"))
    if len(set(found)) > 1:
        raise ValueError(
            f"{CC_FLAGS_ENV}={flags!r} sets the LNC degree twice ({found}): set it once (or "
            f"drop it and set {LNC_ENV})"
        )
    return found[0] if found else None


def launch_programs(target: str) -> int:
    """The kernel's SPMD launch grid ``kernel[n]``: the LNC degree neuronx-cc compiles with, so
    that the kernel's LNC always equals the compiler's (from NKI 0.7 a mismatch is compiler error
    NCC_EVRF066; nki/get-started/about/lnc.rst: "its LNC degree must match the global graph
    compilation --lnc degree used by neuronx-cc").

    trn1 has no logical cores: 1 (``--lnc=2`` there is a ``ValueError``, compiler error
    NCC_EARG001). On trn2 and trn3: the ``--lnc`` of ``NEURON_CC_FLAGS`` (:func:`compiler_lnc_flag`)
    and ``NEURON_LOGICAL_NC_CONFIG`` (1 or 2), which must agree when both are set (else a
    ``ValueError`` naming both); either one when only it is set; neither: 2, neuronx-cc's default
    "on Trn2 and later" (compiler/error-codes/EVRF066). A setting that cannot be read raises a
    ``ValueError`` naming the variable to fix.
    """
    from ..nki_emulator.targets import TARGETS

    info = TARGETS[target]
    flag = compiler_lnc_flag()
    if info.lnc_max == 1:
        if flag is not None and flag > 1:
            raise ValueError(
                f"{CC_FLAGS_ENV} passes --lnc={flag} on {target}, which has no logical cores "
                f"(only LNC=1: compiler error NCC_EARG001); remove it from {CC_FLAGS_ENV}"
            )
        return 1
    raw = os.environ.get(LNC_ENV, "").strip()
    runtime = _lnc_value(raw, f"{LNC_ENV}={raw!r}") if raw else None
    if flag is not None and runtime is not None and flag != runtime:
        raise ValueError(
            f"{CC_FLAGS_ENV} passes --lnc={flag} to neuronx-cc but {LNC_ENV}={runtime}: the "
            "kernel's LNC must equal the compiler's (NKI 0.7: compiler error NCC_EVRF066); set "
            f"both to the same degree (or drop --lnc from {CC_FLAGS_ENV}: neuronx-cc then follows "
            f"{LNC_ENV})"
        )
    if flag is not None:
        return flag
    if runtime is not None:
        return runtime
    return info.lnc_default


def _run_packed(call_kernels: KernelCall, target: str, q, slot_rows, sink, bias, scale, idx=None,
                kv_scale=None, value_dim=None, extra_rows=None, main_slots=0, kv_rope=None,
                extra_kv_scale=None, extra_rope=None):
    """pack -> ``call_kernels`` -> unpack; returns ``(out [T, H, value_dim], lse [T, H] f32)``;
    the kernel does ``value_dim`` (default D) columns of value work.

    With ``kv_scale`` (``[R, n]`` f32), ``slot_rows`` is an FP8 cache: the FP8 kernel reads it on
    trn2/trn3; on trn1 (or with D = 0) XLA gathers and dequantises the slots first. With
    ``extra_rows`` (a second 16-bit cache, trn2/trn3, both caches of rows and D > 0; see
    ``_reads_both_caches``), ``idx`` and ``bias`` cover both caches' slots, the first
    ``main_slots`` the main one's, and the two-cache kernel reads both. With ``kv_rope`` (split
    FP8 rows, trn2/trn3: ``_reads_split_rows``) the split kernel reads both parts of the rows;
    with both (and ``extra_kv_scale``, ``extra_rope``: two FP8 caches of split rows,
    ``_reads_both_split_caches``) the kernel that reads the four."""
    from . import kernel as kernels

    T, H, D = q.shape
    value_dim = D if value_dim is None else value_dim
    layout = kernel_layout(T, H, D, bias.shape[1], value_dim=value_dim)
    if layout.is_empty or (idx is not None and slot_rows.shape[0] == 0):
        return empty_result(q, sink, value_dim)
    kernel, gather_in_xla = kernels.kernel_for(target, idx is not None, fp8=kv_scale is not None)
    if extra_rows is not None and kv_scale is not None:  # an FP8 main cache beside a second one
        assert not gather_in_xla
        kernel = {(True, False): kernels.gathered_attn_idx_fp8_split_beside_16bit_kernel,
                  (True, True): kernels.gathered_attn_idx_fp8_split_two_caches_kernel,
                  (False, False): kernels.gathered_attn_idx_fp8_beside_16bit_kernel,
                  (False, True): kernels.gathered_attn_idx_fp8_two_caches_kernel,
                  }[kv_rope is not None, extra_kv_scale is not None]
    elif extra_rows is not None:
        assert not gather_in_xla and kv_scale is None
        kernel = kernels.gathered_attn_idx_two_caches_kernel
    elif kv_rope is not None:
        assert not gather_in_xla and kv_scale is not None and D > 0
        kernel = kernels.gathered_attn_idx_fp8_split_kernel
    if kv_scale is not None and (gather_in_xla or D == 0):
        from . import fp8

        rows = slot_rows.shape[0]
        in_range = (idx >= 0) & (idx < rows)
        g = fp8.gather_dequantized(slot_rows, kv_scale, jnp.where(in_range, idx, -1), jnp.bfloat16)
        bias = jnp.where(in_range, bias, -jnp.inf)
        return _run_packed(call_kernels, target, q, g, sink, bias, scale, value_dim=value_dim)
    scale_groups = 0 if kv_scale is None else kv_scale.shape[1]
    # Trace-time check that the shape can be planned (only an absurd head dim cannot).
    kernels.plan_slots(layout.heads_per_group, layout.dim_padded, layout.slots_padded,
                       indexed=idx is not None and not gather_in_xla,
                       fp8_scale_groups=scale_groups,
                       index_sets=1 if extra_rows is None else 2)  # fmt: skip
    packed, layout = pack_for_kernel(
        q, slot_rows, sink, bias, scale, idx=idx, gather_in_xla=gather_in_xla,
        programs=launch_programs(target), kv_scale=kv_scale, value_dim=value_dim,
        extra_rows=extra_rows, main_slots=main_slots, kv_rope=kv_rope,
        extra_kv_scale=extra_kv_scale, extra_rope=extra_rope,
    )  # fmt: skip
    # The value product's overflow guard for the user's K (docs/contract.md): the kernel's bf16.
    options = {"value_shift": value_shift(bias.shape[1], "bfloat16")}
    if extra_rows is not None:
        options["main_slots"] = main_slots
    if layout.value_dim_padded != layout.dim_padded:
        options["value_dim"] = layout.value_dim_padded
    out_groups, lse_groups = call_kernels(kernel, target, packed, layout, options)
    return unpack_from_kernel(out_groups, lse_groups, layout, packed.row_has_slot, sink, q.dtype)


def _pregathered_slots(dtype, kv, idx, bias, extra_kv, extra_idx, extra_bias, kv_scale, kv_rope,
                       extra_kv_scale=None, extra_kv_rope=None):
    """The slots ``(g [T, K (+ K2), D], bias)`` that XLA gathers for the pre-gathered kernel when
    no kernel reads the operands itself (``_run_indexed``); None for one cache of whole rows,
    which ``_run_packed`` takes as it is (on trn1 gathering there). Two
    caches' slots sit side by side, main first, in q's ``dtype``, an FP8 cache's dequantised
    (``_fp8_slots``; one split cache alone: to bf16, the kernel's type); the caches are not
    concatenated. Every empty slot's bias is ``-inf`` and its
    row is zeros, never read (docs/neuron-kernel.md)."""
    if extra_kv is None:
        return None if kv_rope is None else _fp8_slots(kv, kv_scale, kv_rope, idx, bias)
    parts = [_plain_slots(c, i, b) if s is None else _fp8_slots(c, s, r, i, b, dtype)
             for c, i, b, s, r in ((kv, idx, bias, kv_scale, kv_rope),
                                   (extra_kv, extra_idx, extra_bias, extra_kv_scale, extra_kv_rope))]
    return tuple(jnp.concatenate(p, axis=1) for p in zip(*parts))


def _plain_slots(cache, idx, bias):
    """A 16-bit cache's slots ``[T, K, D]`` gathered as bits (zeros for an empty slot; a cache of
    0 rows gives zeros) and the bias with every empty slot ``-inf``."""
    from .reference import gather_bits

    rows = cache.shape[0]
    valid = (idx >= 0) & (idx < rows) & (bias != -jnp.inf)
    g = (gather_bits(cache, jnp.where(valid, idx, rows)) if rows
         else jnp.zeros(idx.shape + cache.shape[1:], cache.dtype))
    return g, jnp.where(valid, bias, -jnp.inf)


def _fp8_slots(kv, kv_scale, kv_rope, idx, bias, dtype=jnp.bfloat16):
    """An FP8 cache's slots for the pre-gathered kernel: each slot's FP8 columns gathered and
    dequantised by XLA (``fp8.gather_dequantized``), with DeepSeek's split rows next to their
    16-bit ``kv_rope`` columns, ``g [T, K, D (+ Dr)]`` in ``dtype``, and the bias with every empty
    slot ``-inf``. The FP8 kernel reads whole FP8 rows of one cache only
    (docs/neuron-kernel.md)."""
    from . import fp8
    from .reference import gather_bits

    rows = kv.shape[0]
    valid = (idx >= 0) & (idx < rows) & (bias != -jnp.inf)
    g = fp8.gather_dequantized(kv, kv_scale, jnp.where(valid, idx, -1), dtype)
    if kv_rope is not None:
        rope = gather_bits(kv_rope.astype(dtype), jnp.where(valid, idx, rows))
        g = jnp.concatenate([g, rope], axis=-1)
    return g, jnp.where(valid, bias, -jnp.inf)


def _reads_both_caches(target, kv, extra_kv, kv_scale, kv_rope, extra_kv_scale) -> bool:
    """Whether the two-cache kernel reads both caches itself: two 16-bit caches with rows and
    columns, on a target with indirect DMA (trn2, trn3). An FP8 main cache: see
    ``_reads_fp8_beside_a_second_cache``; trn1 or an empty cache: XLA gathers both caches' slots
    for the pre-gathered kernel (``_pregathered_slots``)."""
    return (extra_kv is not None and kv_scale is None and kv_rope is None
            and extra_kv_scale is None and target in TARGETS_WITH_DGE
            and kv.shape[0] > 0 and extra_kv.shape[0] > 0 and kv.shape[1] > 0)


def _reads_split_rows(target, kv, kv_rope, extra_kv) -> bool:
    """Whether the split kernel reads DeepSeek's split rows itself (one cache, FP8 columns and
    rows, trn2/trn3); otherwise XLA gathers and dequantises the slots (``_pregathered_slots``)."""
    return (kv_rope is not None and extra_kv is None and target in TARGETS_WITH_DGE
            and kv.shape[0] > 0 and kv.shape[1] > 0)


def _reads_fp8_beside_a_second_cache(target, kv, extra_kv, kv_scale, kv_rope, extra_kv_scale,
                                     extra_kv_rope) -> bool:
    """Whether one kernel reads an FP8 main cache (whole or split rows) and a second cache itself:
    a 16-bit one, or an FP8 one of the same layout (FP8 dtype, FP8 columns, scale groups, rope
    width); rows in both, trn2/trn3. Otherwise XLA gathers (and dequantises) both caches' slots
    (``_pregathered_slots``)."""
    if extra_kv is None or kv_scale is None or target not in TARGETS_WITH_DGE:
        return False
    if not (kv.shape[0] > 0 and kv.shape[1] > 0 and extra_kv.shape[0] > 0):
        return False
    if extra_kv_scale is None:  # a 16-bit second cache of whole rows
        return True
    rope_width = lambda rope: 0 if rope is None else rope.shape[1]  # noqa: E731
    return (kv.dtype == extra_kv.dtype and kv.shape[1] == extra_kv.shape[1]
            and kv_scale.shape[1] == extra_kv_scale.shape[1]
            and rope_width(kv_rope) == rope_width(extra_kv_rope))


def _run_indexed(call_kernels, run_pregathered, q, kv, idx, sink, bias, scale, extra_kv, extra_idx,
                 extra_bias, kv_scale, kv_rope, extra_kv_scale, extra_kv_rope, value_dim):
    """``gathered_attn_idx_p`` on the Neuron path (``call_kernels``: the device's or the
    emulator's): the kernel that reads the operands where one does, else the pre-gathered kernel
    (``run_pregathered``, the ``gathered_attn_p`` path) on the slots XLA gathers."""
    target = neuron_target()
    if (_reads_both_caches(target, kv, extra_kv, kv_scale, kv_rope, extra_kv_scale)
            or _reads_fp8_beside_a_second_cache(target, kv, extra_kv, kv_scale, kv_rope,
                                                extra_kv_scale, extra_kv_rope)):
        return _run_packed(call_kernels, target, q, kv, sink,
                           jnp.concatenate([bias, extra_bias], 1), scale,
                           idx=jnp.concatenate([idx, extra_idx], 1), value_dim=value_dim,
                           kv_scale=kv_scale, kv_rope=kv_rope, extra_rows=extra_kv,
                           main_slots=idx.shape[1], extra_kv_scale=extra_kv_scale,
                           extra_rope=extra_kv_rope)  # fmt: skip
    if _reads_split_rows(target, kv, kv_rope, extra_kv):
        return _run_packed(call_kernels, target, q, kv, sink, bias, scale, idx=idx,
                           kv_scale=kv_scale, kv_rope=kv_rope, value_dim=value_dim)
    slots = _pregathered_slots(q.dtype, kv, idx, bias, extra_kv, extra_idx, extra_bias, kv_scale,
                               kv_rope, extra_kv_scale, extra_kv_rope)
    if slots is not None:
        return run_pregathered(q, slots[0], sink, slots[1], scale, value_dim=value_dim)
    return _run_packed(call_kernels, target, q, kv, sink, bias, scale, idx=idx, kv_scale=kv_scale,
                       value_dim=value_dim)


def _kernel_args(packed: PackedOperands, group: int) -> tuple:
    """Arguments of one kernel call, in the kernel's order."""
    if packed.extra_rope is not None:
        return (packed.q_groups[group], packed.slot_rows, packed.rope_rows, packed.extra_rows,
                packed.extra_rope, packed.slot_scale, packed.idx, packed.extra_idx, packed.bias,
                packed.sink_groups[group])
    if packed.extra_rows is not None and packed.slot_scale is not None:
        rope = () if packed.rope_rows is None else (packed.rope_rows,)
        return (packed.q_groups[group], packed.slot_rows, *rope, packed.extra_rows,
                packed.slot_scale, packed.idx, packed.extra_idx, packed.bias,
                packed.sink_groups[group])
    if packed.extra_rows is not None:
        return (packed.q_groups[group], packed.slot_rows, packed.idx, packed.extra_rows,
                packed.extra_idx, packed.bias, packed.sink_groups[group])
    if packed.rope_rows is not None:
        return (packed.q_groups[group], packed.slot_rows, packed.rope_rows, packed.slot_scale,
                packed.idx, packed.bias, packed.sink_groups[group])
    if packed.slot_scale is not None:
        return (packed.q_groups[group], packed.slot_rows, packed.slot_scale, packed.idx,
                packed.bias, packed.sink_groups[group])
    if packed.idx is not None:
        return (packed.q_groups[group], packed.slot_rows, packed.idx, packed.bias,
                packed.sink_groups[group])
    return (packed.q_groups[group], packed.slot_rows, packed.bias, packed.sink_groups[group])


# --- on Neuron: nki.jit on traced arrays ------------------------------------------------------


@functools.lru_cache(maxsize=None)
def jitted_kernel(kernel):
    """``nki.jit`` of an NKI kernel function (either op's), once per kernel; a RuntimeError with the
    install hint where the Neuron SDK is missing."""
    from . import kernel as kernels

    if kernels.nki is None:
        raise RuntimeError(
            f"the NKI kernel needs the Neuron SDK (`import nki` failed): {install_hint()}"
        )
    return kernels.nki.jit(kernel)


def _call_nki_kernels(kernel, target, packed: PackedOperands, layout: KernelLayout, options):
    del target  # nki.jit compiles for the target NEURON_PLATFORM_TARGET_OVERRIDE names
    jitted = jitted_kernel(kernel)
    if layout.programs > 1:
        jitted = jitted[layout.programs]  # kernel[2]: one program per physical core (LNC=2)
    results = [jitted(*_kernel_args(packed, g), **options) for g in range(layout.head_groups)]
    return jnp.stack([r[0] for r in results]), jnp.stack([r[1] for r in results])


def nki_gathered_attn_lse(q, g, sink, bias, scale, *, value_dim=None):
    """The Neuron path of ``gathered_attn_p`` with the lse: q ``[T, H, D]``, g ``[T, K, D]``, sink
    ``[H]`` f32 (``-inf`` = none), bias ``[T, K]`` f32 (``-inf`` = empty slot), scale ``[T]`` f32
    -> ``(out [T, H, value_dim] in q's dtype, lse [T, H] f32)``."""
    return _run_packed(_call_nki_kernels, neuron_target(), q, g, sink, bias, scale,
                       value_dim=value_dim)


def nki_gathered_attn_idx_lse(q, kv, idx, sink, bias, scale, extra_kv=None, extra_idx=None,
                              extra_bias=None, *, kv_scale=None, kv_rope=None,
                              extra_kv_scale=None, extra_kv_rope=None, value_dim=None):
    """The Neuron path of ``gathered_attn_idx_p`` with the lse: q ``[T, H, D]``, kv ``[R, D]``,
    idx ``[T, K]`` int32 (-1 = empty), sink ``[H]`` f32, bias ``[T, K]`` f32, scale ``[T]`` f32
    -> ``(out [T, H, value_dim], lse [T, H] f32)``. With ``kv_scale`` (``[R, n]`` f32) ``kv`` is
    an FP8 cache, with ``kv_rope`` of split rows; ``extra_*`` is a second cache. On trn2/trn3 a
    kernel reads the operands itself where one does (``_run_indexed``: one cache of any kind, two
    16-bit caches, FP8 rows beside a second cache of their layout or of 16 bits); otherwise, and
    on trn1, XLA gathers (and dequantises) the slots for the pre-gathered kernel
    (``_pregathered_slots``)."""
    return _run_indexed(_call_nki_kernels, nki_gathered_attn_lse, q, kv, idx, sink, bias, scale,
                        extra_kv, extra_idx, extra_bias, kv_scale, kv_rope, extra_kv_scale,
                        extra_kv_rope, value_dim)


def nki_gathered_attn(q, g, sink, bias, scale, *, value_dim=None):
    """The Neuron path of ``gathered_attn_p`` (:func:`nki_gathered_attn_lse` without the lse)."""
    return nki_gathered_attn_lse(q, g, sink, bias, scale, value_dim=value_dim)[0]


def nki_gathered_attn_idx(q, kv, idx, sink, bias, scale, *, value_dim=None):
    """The Neuron path of ``gathered_attn_idx_p`` (:func:`nki_gathered_attn_idx_lse` without the
    lse)."""
    return nki_gathered_attn_idx_lse(q, kv, idx, sink, bias, scale, value_dim=value_dim)[0]


# --- on the host: the kernel source under the emulator, through a host callback ---------------


def _run_emulated_on_host(kernel, target, programs, options, *arrays):
    """Host side of the callback: the kernel operands in the kernel's order, q and sink stacked
    per head group (numpy); returns one ``[G, Tp, Hg, Dp + 1]`` f32 array: the bf16 output (exact
    in f32) next to the lse (see ``_call_emulated_kernels``)."""
    from ..nki_emulator import simulate

    run = simulate(kernel, target=target)[programs]
    # The callback may receive jax.Arrays: slicing one would dispatch a computation to a device
    # that is busy waiting for this very callback (a deadlock once every device runs one).
    arrays = [np.asarray(a) for a in arrays]
    q_groups, shared, sink_groups = arrays[0], arrays[1:-1], arrays[-1]
    results = [run(q_groups[g], *shared, sink_groups[g], **options) for g in range(len(q_groups))]
    outs = np.stack([np.asarray(r[0]) for r in results]).astype(jnp.bfloat16)
    lses = np.stack([np.asarray(r[1]) for r in results]).astype(np.float32)
    return np.concatenate([outs.astype(np.float32), lses], axis=-1)


def _call_emulated_kernels(kernel, target, packed: PackedOperands, layout: KernelLayout, options):
    shape = (layout.head_groups, layout.tokens_padded, layout.heads_per_group)
    # One result array, not two: JAX 0.7 cannot lower a pure_callback with two results inside
    # shard_map ("result shardings don't match number of values"), which is where the sharded
    # paths run it. The bf16 output travels exactly as f32, the lse in the last column.
    result = jax.ShapeDtypeStruct(shape + (layout.value_dim_padded + 1,), jnp.float32)
    # Host arrays in the kernel's order: q per head group, then the shared ones, the sink last.
    arrays = [packed.q_groups, *_kernel_args(packed, 0)[1:-1], packed.sink_groups]
    # The primitives' vmap rule folds batches into tokens before lowering, so this callback is
    # never batched itself; "sequential" is only the safe answer should that ever change.
    packed_result = jax.pure_callback(
        functools.partial(_run_emulated_on_host, kernel, target, layout.programs, options), result,
        *arrays,
        vmap_method="sequential",
    )  # fmt: skip
    return packed_result[..., :-1].astype(jnp.bfloat16), packed_result[..., -1:]


def emulated_gathered_attn_lse(q, g, sink, bias, scale, *, value_dim=None):
    """``implementation="nki_emulated"`` for ``gathered_attn_p``, with the lse: the Neuron data
    path on the host, for the target ``NEURON_PLATFORM_TARGET_OVERRIDE`` names (default trn2).

    Operands and result as :func:`nki_gathered_attn_lse`."""
    return _run_packed(_call_emulated_kernels, neuron_target(), q, g, sink, bias, scale,
                       value_dim=value_dim)


def emulated_gathered_attn_idx_lse(q, kv, idx, sink, bias, scale, extra_kv=None, extra_idx=None,
                                   extra_bias=None, *, kv_scale=None, kv_rope=None,
                                   extra_kv_scale=None, extra_kv_rope=None, value_dim=None):
    """``implementation="nki_emulated"`` for ``gathered_attn_idx_p``, with the lse.

    Operands and result as :func:`nki_gathered_attn_idx_lse`."""
    return _run_indexed(_call_emulated_kernels, emulated_gathered_attn_lse, q, kv, idx, sink, bias,
                        scale, extra_kv, extra_idx, extra_bias, kv_scale, kv_rope, extra_kv_scale,
                        extra_kv_rope, value_dim)


def emulated_gathered_attn(q, g, sink, bias, scale, *, value_dim=None):
    """``implementation="nki_emulated"`` for ``gathered_attn_p``: the Neuron path on the host.

    Operands and result as :func:`nki_gathered_attn`."""
    return emulated_gathered_attn_lse(q, g, sink, bias, scale, value_dim=value_dim)[0]


def emulated_gathered_attn_idx(q, kv, idx, sink, bias, scale, *, value_dim=None):
    """``implementation="nki_emulated"`` for ``gathered_attn_idx_p``: Neuron path on the host.

    Operands and result as :func:`nki_gathered_attn_idx`."""
    return emulated_gathered_attn_idx_lse(q, kv, idx, sink, bias, scale, value_dim=value_dim)[0]


# --- the "neuron" platform rule ---------------------------------------------------------------


def _neuron_rule(indexed: bool):
    # The primitives return (out, lse): the kernels' own lse.
    kernel_path = nki_gathered_attn_idx_lse if indexed else nki_gathered_attn_lse

    def rule(*args, implementation, value_dim=None):
        if implementation is None or implementation == "nki":
            path_fn = kernel_path
        elif implementation == "nki_emulated":
            raise NotImplementedError(NO_HOST_CALLBACKS_ON_NEURON)
        else:
            path_fn = primitives.path(implementation, indexed)
        # Each device runs the kernel on its own tokens/heads: no gathers around the custom call.
        return primitives.run_shard_local(path_fn, indexed, *args, value_dim=value_dim)

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
