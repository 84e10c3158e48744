"""The attention op's Neuron data path (pack -> NKI kernel -> unpack) and its "neuron" lowering.

The same path runs the kernel through ``nki.jit`` on a Neuron device, or under the project's NKI
emulator on the host through a host callback (``implementation="nki_emulated"``). Which kernel
runs is one table, ``KERNELS``, keyed by the operands' layout; the variants, the targets and the
launch grid are in docs/neuron-kernel.md.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from . import primitive as primitives
from .primitive import PREGATHERED, AttnOperands, Layout
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


class KernelVariant(NamedTuple):
    """A kernel entry point of kernel.py and its arguments: fields of ``PackedOperands`` in the
    kernel's order (``q_groups`` and ``sink_groups`` are taken per head group)."""

    name: str
    args: tuple[str, ...]


_PREGATHERED_KERNEL = KernelVariant("gathered_attn_kernel",
                                    ("q_groups", "slot_rows", "bias", "sink_groups"))

# The kernel that reads a bind's operands itself, by its layout, on targets with indirect DMA
# (TARGETS_WITH_DGE); a layout missing here, or any indexed one on another target, has XLA
# gather the slots for the pre-gathered kernel (docs/neuron-kernel.md, "Kernel variants by operand
# layout").
KERNELS = {
    PREGATHERED: _PREGATHERED_KERNEL,
    Layout(): KernelVariant(
        "gathered_attn_idx_kernel", ("q_groups", "slot_rows", "idx", "bias", "sink_groups")),
    Layout(fp8=True): KernelVariant(
        "gathered_attn_idx_fp8_kernel",
        ("q_groups", "slot_rows", "slot_scale", "idx", "bias", "sink_groups")),
    Layout(fp8=True, split=True): KernelVariant(
        "gathered_attn_idx_fp8_split_kernel",
        ("q_groups", "slot_rows", "rope_rows", "slot_scale", "idx", "bias", "sink_groups")),
    Layout(extra=True): KernelVariant(
        "gathered_attn_idx_two_caches_kernel",
        ("q_groups", "slot_rows", "idx", "extra_rows", "extra_idx", "bias", "sink_groups")),
    Layout(fp8=True, extra=True): KernelVariant(
        "gathered_attn_idx_fp8_beside_16bit_kernel",
        ("q_groups", "slot_rows", "extra_rows", "slot_scale", "idx", "extra_idx", "bias",
         "sink_groups")),
    Layout(fp8=True, split=True, extra=True): KernelVariant(
        "gathered_attn_idx_fp8_split_beside_16bit_kernel",
        ("q_groups", "slot_rows", "rope_rows", "extra_rows", "slot_scale", "idx", "extra_idx",
         "bias", "sink_groups")),
    Layout(fp8=True, extra=True, extra_fp8=True): KernelVariant(
        "gathered_attn_idx_fp8_two_caches_kernel",
        ("q_groups", "slot_rows", "extra_rows", "slot_scale", "idx", "extra_idx", "bias",
         "sink_groups")),
    Layout(fp8=True, split=True, extra=True, extra_fp8=True, extra_split=True): KernelVariant(
        "gathered_attn_idx_fp8_split_two_caches_kernel",
        ("q_groups", "slot_rows", "rope_rows", "extra_rows", "extra_rope", "slot_scale", "idx",
         "extra_idx", "bias", "sink_groups")),
}


def kernel_reading(target: str, ops: AttnOperands) -> KernelVariant | None:
    """The kernel that reads ``ops`` itself on ``target`` (``KERNELS``), or None where XLA gathers
    the slots first. Beyond the layout the kernels need rows in each cache and columns in the
    main one, and an FP8 second cache laid out as the main one (FP8 dtype, widths, scale groups)."""
    layout = ops.layout
    if layout.indexed and target not in TARGETS_WITH_DGE:
        return None
    variant = KERNELS.get(layout)
    if variant is None or not layout.indexed:
        return variant
    caches = [ops.kv] if ops.extra_kv is None else [ops.kv, ops.extra_kv]
    if ops.kv.shape[1] == 0 or any(c.shape[0] == 0 for c in caches):
        return None
    if layout.extra_fp8:
        same = (ops.kv.dtype == ops.extra_kv.dtype and ops.kv.shape[1] == ops.extra_kv.shape[1]
                and ops.kv_scale.shape[1] == ops.extra_kv_scale.shape[1]
                and (ops.kv_rope is None or ops.kv_rope.shape[1] == ops.extra_kv_rope.shape[1]))
        if not same:
            return None
    return variant


def _run_kernel(call_kernels: KernelCall, target: str, variant: KernelVariant,
                ops: AttnOperands, value_dim=None, gather_in_xla: bool = False):
    """pack -> ``call_kernels`` -> unpack; returns ``(out [T, H, value_dim], lse [T, H] f32)``;
    the kernel does ``value_dim`` (default D) columns of value work. ``gather_in_xla``: an
    indexed bind of one cache of whole rows run by the pre-gathered kernel, its slots gathered
    (and FP8 ones dequantised) by XLA. Two caches' slots are packed as one index set of
    ``K + K2`` slots, the main ones first."""
    from . import kernel as kernels

    q = ops.q
    T, H, D = q.shape
    value_dim = D if value_dim is None else value_dim
    two = ops.extra_kv is not None
    bias = jnp.concatenate([ops.bias, ops.extra_bias], 1) if two else ops.bias
    idx = jnp.concatenate([ops.idx, ops.extra_idx], 1) if two else ops.idx
    slot_rows = ops.kv if ops.layout.indexed else ops.g
    layout = kernel_layout(T, H, D, bias.shape[1], value_dim=value_dim)
    if layout.is_empty or (idx is not None and slot_rows.shape[0] == 0):
        return empty_result(q, ops.sink, value_dim)
    if ops.kv_scale is not None and gather_in_xla:  # FP8 rows: XLA dequantises the slots
        from . import fp8

        in_range = (idx >= 0) & (idx < slot_rows.shape[0])
        g = fp8.gather_dequantized(slot_rows, ops.kv_scale, jnp.where(in_range, idx, -1),
                                   jnp.bfloat16)
        pregathered = AttnOperands(q=q, g=g, sink=ops.sink, scale=ops.scale,
                                              bias=jnp.where(in_range, bias, -jnp.inf))
        return _run_kernel(call_kernels, target, _PREGATHERED_KERNEL, pregathered, value_dim)
    scale_groups = 0 if ops.kv_scale is None else ops.kv_scale.shape[1]
    # Trace-time check that the shape can be planned (only an absurd head dim cannot).
    kernels.plan_slots(layout.heads_per_group, layout.dim_padded, layout.slots_padded,
                       indexed=idx is not None and not gather_in_xla,
                       fp8_scale_groups=scale_groups, index_sets=2 if two else 1)
    main_slots = ops.idx.shape[1] if two else 0
    packed, layout = pack_for_kernel(
        q, slot_rows, ops.sink, bias, ops.scale, idx=idx, gather_in_xla=gather_in_xla,
        programs=launch_programs(target), kv_scale=ops.kv_scale, value_dim=value_dim,
        extra_rows=ops.extra_kv, main_slots=main_slots, kv_rope=ops.kv_rope,
        extra_kv_scale=ops.extra_kv_scale, extra_rope=ops.extra_kv_rope,
    )  # fmt: skip
    # The value product's overflow guard for the user's K (docs/contract.md): the kernel's bf16.
    options = {"value_shift": value_shift(bias.shape[1], "bfloat16")}
    if two:
        options["main_slots"] = main_slots
    if layout.value_dim_padded != layout.dim_padded:
        options["value_dim"] = layout.value_dim_padded
    out_groups, lse_groups = call_kernels(variant, target, packed, layout, options)
    return unpack_from_kernel(out_groups, lse_groups, layout, packed.row_has_slot, ops.sink,
                              q.dtype)


def _pregathered_slots(dtype, kv, idx, bias, extra_kv, extra_idx, extra_bias, kv_scale, kv_rope,
                       extra_kv_scale=None, extra_kv_rope=None):
    """The slots ``(g [T, K (+ K2), D], bias)`` that XLA gathers for the pre-gathered kernel when
    no kernel reads two caches or split rows itself. Two caches' slots sit side by side, main
    first, in q's ``dtype``, an FP8 cache's dequantised (``_fp8_slots``; one split cache alone: to
    bf16, the kernel's type); the caches are not concatenated. Every empty slot's bias is
    ``-inf`` and its row is zeros, never read (docs/neuron-kernel.md)."""
    if extra_kv is None:
        return _fp8_slots(kv, kv_scale, kv_rope, idx, bias)
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
    slot ``-inf`` (docs/neuron-kernel.md)."""
    from . import fp8
    from .reference import gather_bits

    rows = kv.shape[0]
    valid = (idx >= 0) & (idx < rows) & (bias != -jnp.inf)
    g = fp8.gather_dequantized(kv, kv_scale, jnp.where(valid, idx, -1), dtype)
    if kv_rope is not None:
        rope = gather_bits(kv_rope.astype(dtype), jnp.where(valid, idx, rows))
        g = jnp.concatenate([g, rope], axis=-1)
    return g, jnp.where(valid, bias, -jnp.inf)


def _run_indexed(call_kernels: KernelCall, ops: AttnOperands, value_dim):
    """``gathered_attn_idx_p`` on the Neuron path (``call_kernels``: the device's or the
    emulator's): the kernel that reads the operands where one does (``kernel_reading``); else
    XLA gathers the slots for the pre-gathered kernel, in the packing for one cache of whole
    rows, in ``_pregathered_slots`` for two caches or split rows."""
    target = neuron_target()
    variant = kernel_reading(target, ops)
    if variant is not None:
        return _run_kernel(call_kernels, target, variant, ops, value_dim)
    if ops.extra_kv is None and ops.kv_rope is None:
        return _run_kernel(call_kernels, target, _PREGATHERED_KERNEL, ops, value_dim,
                           gather_in_xla=True)
    g, bias = _pregathered_slots(ops.q.dtype, ops.kv, ops.idx, ops.bias, ops.extra_kv,
                                 ops.extra_idx, ops.extra_bias, ops.kv_scale, ops.kv_rope,
                                 ops.extra_kv_scale, ops.extra_kv_rope)
    pregathered = AttnOperands(q=ops.q, g=g, sink=ops.sink, bias=bias, scale=ops.scale)
    return _run_kernel(call_kernels, target, _PREGATHERED_KERNEL, pregathered, value_dim)


def _indexed_path(call_kernels: KernelCall, doc: str) -> Callable:
    """``gathered_attn_idx_p``'s Neuron path through ``call_kernels`` (the device's or the
    emulator's), taking the operands as the reference does."""

    def path(q, kv, idx, sink, bias, scale, extra_kv=None, extra_idx=None, extra_bias=None, *,
             kv_scale=None, kv_rope=None, extra_kv_scale=None, extra_kv_rope=None,
             value_dim=None):
        ops = AttnOperands(
            q=q, kv=kv, idx=idx, sink=sink, bias=bias, scale=scale, kv_scale=kv_scale,
            kv_rope=kv_rope, extra_kv=extra_kv, extra_idx=extra_idx, extra_bias=extra_bias,
            extra_kv_scale=extra_kv_scale, extra_kv_rope=extra_kv_rope)
        return _run_indexed(call_kernels, ops, value_dim)

    path.__doc__ = doc
    return path


def _kernel_args(variant: KernelVariant, packed: PackedOperands, group: int) -> tuple:
    """Arguments of one kernel call (head group ``group``), in the kernel's order."""
    per_group = {"q_groups": packed.q_groups[group], "sink_groups": packed.sink_groups[group]}
    return tuple(per_group[a] if a in per_group else getattr(packed, a) for a in variant.args)


def _kernel_function(variant: KernelVariant):
    from . import kernel as kernels

    return getattr(kernels, variant.name)


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


def _call_nki_kernels(variant: KernelVariant, target, packed: PackedOperands,
                      layout: KernelLayout, options):
    del target  # nki.jit compiles for the target NEURON_PLATFORM_TARGET_OVERRIDE names
    jitted = jitted_kernel(_kernel_function(variant))
    if layout.programs > 1:
        jitted = jitted[layout.programs]  # kernel[2]: one program per physical core (LNC=2)
    results = [jitted(*_kernel_args(variant, packed, g), **options)
               for g in range(layout.head_groups)]
    return jnp.stack([r[0] for r in results]), jnp.stack([r[1] for r in results])


def nki_gathered_attn_lse(q, g, sink, bias, scale, *, value_dim=None):
    """The Neuron path of ``gathered_attn_p`` with the lse: q ``[T, H, D]``, g ``[T, K, D]``, sink
    ``[H]`` f32 (``-inf`` = none), bias ``[T, K]`` f32 (``-inf`` = empty slot), scale ``[T]`` f32
    -> ``(out [T, H, value_dim] in q's dtype, lse [T, H] f32)``."""
    ops = AttnOperands(q=q, g=g, sink=sink, bias=bias, scale=scale)
    return _run_kernel(_call_nki_kernels, neuron_target(), _PREGATHERED_KERNEL, ops, value_dim)


nki_gathered_attn_idx_lse = _indexed_path(_call_nki_kernels, """The Neuron path of
``gathered_attn_idx_p`` with the lse: the operands as the reference takes them (shapes in
docs/contract.md, "Operand layout") -> ``(out [T, H, value_dim], lse [T, H] f32)``. A kernel reads
the operands itself where one does (``kernel_reading``); otherwise, and on trn1, XLA gathers (and
dequantises) the slots for the pre-gathered kernel.""")


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


def _call_emulated_kernels(variant: KernelVariant, target, packed: PackedOperands,
                           layout: KernelLayout, options):
    shape = (layout.head_groups, layout.tokens_padded, layout.heads_per_group)
    # One result array, not two: JAX 0.7 cannot lower a pure_callback with two results inside
    # shard_map ("result shardings don't match number of values"), which is where the sharded
    # paths run it. The bf16 output travels exactly as f32, the lse in the last column.
    result = jax.ShapeDtypeStruct(shape + (layout.value_dim_padded + 1,), jnp.float32)
    # Host arrays in the kernel's order: q per head group, then the shared ones, the sink last.
    arrays = [packed.q_groups, *_kernel_args(variant, packed, 0)[1:-1], packed.sink_groups]
    # The primitives' vmap rule folds batches into tokens before lowering, so this callback is
    # never batched itself; "sequential" is only the safe answer should that ever change.
    packed_result = jax.pure_callback(
        functools.partial(_run_emulated_on_host, _kernel_function(variant), target,
                          layout.programs, options), result,
        *arrays,
        vmap_method="sequential",
    )  # fmt: skip
    return packed_result[..., :-1].astype(jnp.bfloat16), packed_result[..., -1:]


def emulated_gathered_attn_lse(q, g, sink, bias, scale, *, value_dim=None):
    """``implementation="nki_emulated"`` for ``gathered_attn_p``, with the lse: the Neuron data
    path on the host, for the target ``NEURON_PLATFORM_TARGET_OVERRIDE`` names (default trn2).

    Operands and result as :func:`nki_gathered_attn_lse`."""
    ops = AttnOperands(q=q, g=g, sink=sink, bias=bias, scale=scale)
    return _run_kernel(_call_emulated_kernels, neuron_target(), _PREGATHERED_KERNEL, ops,
                       value_dim)


emulated_gathered_attn_idx_lse = _indexed_path(_call_emulated_kernels, """``implementation=
"nki_emulated"`` for ``gathered_attn_idx_p``, with the lse. Operands and result as
:func:`nki_gathered_attn_idx_lse`.""")


def emulated_gathered_attn(q, g, sink, bias, scale, *, value_dim=None):
    """``implementation="nki_emulated"`` for ``gathered_attn_p``: the Neuron path on the host.

    Operands and result as :func:`nki_gathered_attn`."""
    return emulated_gathered_attn_lse(q, g, sink, bias, scale, value_dim=value_dim)[0]


def emulated_gathered_attn_idx(q, kv, idx, sink, bias, scale, *, value_dim=None):
    """``implementation="nki_emulated"`` for ``gathered_attn_idx_p``: Neuron path on the host.

    Operands and result as :func:`nki_gathered_attn_idx`."""
    return emulated_gathered_attn_idx_lse(q, kv, idx, sink, bias, scale, value_dim=value_dim)[0]


# --- the "neuron" platform rule ---------------------------------------------------------------


def _neuron_rule(*args, layout, implementation, value_dim):
    if implementation is None or implementation == "nki":
        # The primitives return (out, lse): the kernels' own lse.
        path_fn = nki_gathered_attn_idx_lse if layout.indexed else nki_gathered_attn_lse
    elif implementation == "nki_emulated":
        raise NotImplementedError(NO_HOST_CALLBACKS_ON_NEURON)
    else:
        path_fn = primitives.path(implementation, layout.indexed)
    # Each device runs the kernel on its own tokens/heads: no gathers around the custom call.
    return primitives.run_shard_local(path_fn, layout.unflatten(args), value_dim=value_dim)


_neuron_lowerings_registered = False


def register_neuron_lowerings(**_plugin_info) -> bool:
    """Registers the ``"neuron"`` rules once JAX knows that platform; returns whether they are.

    Called by JAX after PJRT plugin discovery (with ``c_api=...`` for each discovered plugin).
    """
    global _neuron_lowerings_registered
    if _neuron_lowerings_registered:
        return True
    try:
        for prim in (primitives.gathered_attn_p, primitives.gathered_attn_idx_p):
            mlir.register_lowering(prim, mlir.lower_fun(_neuron_rule, multiple_results=True),
                                   platform=NEURON_PLATFORM)
    except NotImplementedError:
        return False  # No Neuron plugin among the discovered ones: nothing to register.
    _neuron_lowerings_registered = True
    return True


def install_neuron_lowerings() -> None:
    """Defers :func:`register_neuron_lowerings` to JAX's plugin discovery (never fails): JAX knows
    the "neuron" platform only once its PJRT plugin is discovered, and registering a rule for an
    unknown platform raises."""
    try:
        from jax._src import xla_bridge

        xla_bridge.register_plugin_callbacks(register_neuron_lowerings)
    except (ImportError, AttributeError):
        # A JAX without plugin callbacks: try now (succeeds only if "neuron" is already known).
        register_neuron_lowerings()
