"""Packing the primitives' operands into the NKI kernel interface, and unpacking the result (jnp).

The kernels (:mod:`jax_sparse_attn.attention.kernel`, docs/neuron-kernel.md) accept bf16 only, ``K``
a multiple of 128, at most 128 heads per call, one ``[T, 16 + Kp]`` f32 tensor for scale
and bias. :func:`pack_for_kernel` turns the primitive operands into that form:

- q and the slot rows are cast to bf16 (the kernel is bf16-only, also for f32 / f16 inputs);
- ``D`` is passed as it is (the kernel takes any head dim, so the cache is never copied to pad
  it; only ``D = 0`` becomes one zero column);
- ``K`` is padded to ``Kp``, a multiple of 128, with empty slots;
- an empty slot (index outside ``[0, R)``, a ``-inf`` bias entry, or padding) gets bias
  ``EMPTY_LOGIT`` and never reads a cache row: the indexed kernel receives the out-of-range index
  ``EMPTY_SLOT_INDEX`` (its DMA skips it into a zeroed tile), and pre-gathered rows of empty slots
  are zeros (a select, never ``0 * row``), so a NaN, inf or huge value in an unselected row
  cannot reach any output bit;
- ``H > 128`` is split into ``G`` groups of ``Hg = ceil(H / G)`` heads (one kernel call each; the
  few padding heads get zero q and a ``-inf`` sink, and are cropped);
- the per-token scale goes to column ``SCALE_COL`` of the bias tensor, the per-slot bias to
  columns ``BIAS_PREFIX_COLS:``;
- the products' overflow guards of docs/contract.md: q is scaled down per token by a power of two
  (``reference.prescale_queries``, the same function the reference uses), whose two f32 factors
  go to columns ``UP_COLS`` for the kernel to multiply the dot products back; the value product's
  shift is a compile-time argument of the kernel (``constants.value_shift(K)``).

On trn1 (no indirect DMA) the indexed primitive's rows are gathered here, by XLA
(``gather_in_xla=True``), and run through the pre-gathered kernel.

:func:`unpack_from_kernel` reassembles ``[T, H, D]`` and the ``[T, H]`` lse, sets the rows that
have no valid slot to exactly 0 (and their lse to the sink, ``-inf`` without one) and casts to
q's dtype.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from ..constants import (
    BIAS_PREFIX_COLS,
    EMPTY_LOGIT,
    EMPTY_SLOT_INDEX,
    KERNEL_TILE,
    MAX_HEADS_PER_CALL,
    SCALE_COL,
    UP_COLS,
    round_up,
)
from .reference import prescale_queries


@dataclasses.dataclass(frozen=True)
class KernelLayout:
    """Static sizes of one packed call: the user's ``T, H, D, K`` and the kernel's padded ones."""

    tokens: int
    heads: int
    dim: int
    slots: int
    head_groups: int  # G kernel calls
    heads_per_group: int  # Hg <= 128
    dim_padded: int  # Dp = D (1 when D = 0: the kernel takes any D)
    slots_padded: int  # Kp, multiple of 128
    programs: int = 1  # the kernel's launch grid (physical cores of the logical core)
    tokens_padded: int = 0  # Tp, a multiple of programs (padding tokens have no valid slot)
    value_dim: int = 0  # the output's columns (0: all D); the kernel's value work covers these

    @property
    def value_dim_padded(self) -> int:
        """The kernel's output columns: ``value_dim`` (``dim_padded`` when it is all of D)."""
        return self.value_dim if 0 < self.value_dim < self.dim else self.dim_padded

    @property
    def is_empty(self) -> bool:
        """Nothing to compute: the result is all zeros (``T``, ``H`` or ``K`` is 0)."""
        return self.tokens == 0 or self.heads == 0 or self.slots == 0


def kernel_layout(
    tokens: int, heads: int, dim: int, slots: int, programs: int = 1, value_dim: int = 0
) -> KernelLayout:
    """Chooses the padding and head grouping for ``q [T, H, D]`` with ``K`` slots per token, for
    a kernel launched as ``programs`` SPMD programs (each takes ``Tp / programs`` tokens), with
    ``value_dim`` output columns (0 or D: all)."""
    groups = max(1, -(-heads // MAX_HEADS_PER_CALL))
    return KernelLayout(
        tokens=tokens,
        heads=heads,
        dim=dim,
        slots=slots,
        head_groups=groups,
        heads_per_group=max(1, -(-heads // groups)),
        dim_padded=max(dim, 1),
        slots_padded=round_up(max(slots, 1), KERNEL_TILE),
        programs=programs,
        tokens_padded=round_up(tokens, programs),
        value_dim=value_dim if 0 < value_dim < dim else 0,
    )


class PackedOperands(NamedTuple):
    """Operands of the kernel calls (``G`` calls share everything but q and sink).

    q_groups:    ``[G, Tp, Hg, Dp]`` bf16, group g's head h is head ``g*Hg + h``.
    slot_rows:   ``kv [R, Dp]`` bf16 (indexed) or ``g [Tp, Kp, Dp]`` bf16, the rows of empty
                 slots zero.
    idx:         ``[Tp, 128, Kp/128]`` uint32, ``idx[t, p, kc]`` the row of slot ``kc*128 + p``,
                 ``EMPTY_SLOT_INDEX`` for an empty slot (indexed), else ``None``.
    bias:        ``[Tp, 16 + Kp]`` f32: scale in column 0, per-slot bias (or -1e30) from
                 column 16.
    sink_groups: ``[G, Hg, 1]`` f32.
    row_has_slot: ``[T]`` bool, whether the token has at least one valid slot.
    slot_scale:  FP8 kernel only: ``[Tp, 128, Kp/128 * n]`` f32, laid out as ``idx``:
                 ``[t, p, kc*n + g]`` the scale of group g of slot ``kc*128 + p``'s row, 0 for an
                 empty slot; ``slot_rows`` is then the FP8 cache ``[R, D]`` as the user gave it
                 (no copy, no dequantisation). Else ``None``.
    """

    q_groups: jax.Array
    slot_rows: jax.Array
    idx: Optional[jax.Array]
    bias: jax.Array
    sink_groups: jax.Array
    row_has_slot: jax.Array
    slot_scale: Optional[jax.Array] = None
    rope_rows: Optional[jax.Array] = None  # FP8 split rows: kv_rope [R, D - D8] bf16
    extra_rows: Optional[jax.Array] = None  # two caches: the second one [R2, Dp] bf16
    extra_idx: Optional[jax.Array] = None  # and its indices, laid out as idx (see pack_for_kernel)
    extra_rope: Optional[jax.Array] = None  # two FP8 split caches: the second one's rope columns


def _pad_axis(x, axis: int, size: int, value=0):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def pack_for_kernel(
    q, slot_rows, sink, bias, scale, idx=None, *, gather_in_xla: bool = False, programs: int = 1,
    kv_scale=None, value_dim: int = 0, extra_rows=None, main_slots: int = 0, kv_rope=None,
    extra_kv_scale=None, extra_rope=None,
) -> tuple[PackedOperands, KernelLayout]:
    """Packs normalised primitive operands for the NKI kernels.

    Args:
      q: ``[T, H, D]`` float. slot_rows: ``g [T, K, D]`` (``idx is None``) or ``kv [R, D]`` (R > 0).
      sink: ``[H]`` f32 (``-inf`` = none). bias: ``[T, K]`` f32 (``-inf`` = empty slot).
      scale: ``[T]`` f32. idx: ``[T, K]`` int32 or ``None``; outside ``[0, R)`` = empty slot.
      gather_in_xla: with ``idx``, gather the rows here for the pre-gathered kernel (trn1).
      programs: the kernel's launch grid; the tokens are padded to a multiple of it.
      value_dim: the output's columns (0: all D).
      kv_scale: ``[R, n]`` f32 with an FP8 ``kv`` (``D > 0``, ``idx`` given, not
        ``gather_in_xla``): the FP8 kernel's operands. The cache passes through unchanged; the
        scales of the slots are gathered here (``T * Kp * n`` f32, no scale of a row that no slot
        selects is read).
      kv_rope: ``[R, D - D8]`` 16-bit with an FP8 ``kv [R, D8]`` (split rows, the split kernel):
        passes through as bf16.
      extra_rows, main_slots: two caches (the two-cache kernel; 16-bit, ``idx`` given, not
        ``gather_in_xla``): ``extra_rows [R2, D]`` the second cache, ``idx`` and ``bias`` the
        slots of both, the first ``main_slots`` the main cache's. Each cache gets its own indices
        of all ``Kp`` slots, ``EMPTY_SLOT_INDEX`` at the other cache's. Two FP8 caches of split
        rows add ``extra_kv_scale`` and ``extra_rope`` (each slot's scales from its own cache);
        beside an FP8 ``kv`` without them, ``extra_rows`` is a 16-bit cache (scales 0).
    Returns the packed operands and the static layout. The layout must not be empty.
    """
    T, H, D = q.shape
    K = bias.shape[1]
    layout = kernel_layout(T, H, D, K, programs, value_dim)
    G, Hg = layout.head_groups, layout.heads_per_group
    Dp, Kp, Tp = layout.dim_padded, layout.slots_padded, layout.tokens_padded

    valid = bias != -jnp.inf
    is_main = None
    if extra_rows is not None:
        assert idx is not None and not gather_in_xla
        assert extra_kv_scale is None or kv_scale is not None
        is_main = jnp.arange(K) < main_slots
        rows = jnp.where(is_main, slot_rows.shape[0], extra_rows.shape[0])
        valid = valid & (idx >= 0) & (idx < rows[None, :])
    elif idx is not None:
        rows = slot_rows.shape[0]
        valid = valid & (idx >= 0) & (idx < rows)
    row_has_slot = jnp.any(valid, axis=1)
    # Padding tokens: zero q, every slot empty, scale 0; their results are cropped.
    valid = _pad_axis(valid, 0, Tp, False)
    bias, scale = _pad_axis(bias, 0, Tp), _pad_axis(scale, 0, Tp)
    if idx is not None:
        idx = _pad_axis(idx, 0, Tp)
    elif Tp > T:
        slot_rows = _pad_axis(slot_rows, 0, Tp)

    # The dot products' overflow guard (docs/contract.md): q scaled down per token by a power of
    # two, the kernel multiplies its sums back by up1 * up2 with saturation, as the reference does.
    q_scaled, (up1, up2) = prescale_queries(q.astype(jnp.bfloat16))
    q_bf16 = _pad_axis(_pad_axis(_pad_axis(q_scaled, 2, Dp), 1, G * Hg), 0, Tp)
    q_groups = q_bf16.reshape(Tp, G, Hg, Dp).transpose(1, 0, 2, 3)
    sink_groups = _pad_axis(sink.astype(jnp.float32), 0, G * Hg, -jnp.inf).reshape(G, Hg, 1)

    slot_bias = _pad_axis(jnp.where(valid, bias, jnp.float32(EMPTY_LOGIT)), 1, Kp, EMPTY_LOGIT)
    prefix = jnp.zeros((Tp, BIAS_PREFIX_COLS), jnp.float32).at[:, SCALE_COL].set(scale)
    prefix = prefix.at[:, UP_COLS[0]].set(_pad_axis(up1, 0, Tp, 1.0))
    prefix = prefix.at[:, UP_COLS[1]].set(_pad_axis(up2, 0, Tp, 1.0))
    packed_bias = jnp.concatenate([prefix, slot_bias.astype(jnp.float32)], axis=1)

    empty = jnp.uint32(EMPTY_SLOT_INDEX)

    def kernel_indices(mask):
        packed = _pad_axis(jnp.where(mask, idx.astype(jnp.uint32), empty), 1, Kp, empty)
        # Slot kc*128 + p at [t, p, kc]: partition p's indices are contiguous (one DMA per token).
        return packed.reshape(Tp, Kp // KERNEL_TILE, KERNEL_TILE).transpose(0, 2, 1)

    packed_extra_rows = packed_extra_idx = None
    if idx is not None and not gather_in_xla:
        packed_idx = kernel_indices(valid if is_main is None else valid & is_main)
        if extra_rows is not None:
            packed_extra_idx = kernel_indices(valid & ~is_main)
            packed_extra_rows = (extra_rows if extra_kv_scale is not None  # FP8, as it is
                                 else _pad_axis(extra_rows.astype(jnp.bfloat16), 1, Dp))
        if kv_scale is None:
            packed_rows = _pad_axis(slot_rows.astype(jnp.bfloat16), 1, Dp)
        else:  # the FP8 kernel reads the cache as it is, and the scales of its slots
            assert Dp == D and kv_scale.ndim == 2 and kv_scale.shape[0] == slot_rows.shape[0]
            assert slot_rows.shape[1] == D - (0 if kv_rope is None else kv_rope.shape[1])
            rows, n = kv_scale.shape
            packed_rows = slot_rows

            def slot_scales(scales, mine):  # out of range: filled with 0, nothing read
                in_cache = jnp.where(mine, idx, scales.shape[0])
                return scales.astype(jnp.float32).at[in_cache].get(mode="fill", fill_value=0)

            if extra_rows is None:
                slot_scale = slot_scales(kv_scale, valid)
            elif extra_kv_scale is None:  # a 16-bit second cache: its slots' scales are 0
                slot_scale = slot_scales(kv_scale, valid & is_main)
            else:  # each slot's scales from its own cache
                slot_scale = jnp.where(is_main[None, :, None],
                                       slot_scales(kv_scale, valid & is_main),
                                       slot_scales(extra_kv_scale, valid & ~is_main))
            slot_scale = _pad_axis(slot_scale, 1, Kp)  # [Tp, Kp, n]
            slot_scale = slot_scale.reshape(Tp, Kp // KERNEL_TILE, KERNEL_TILE, n)
            kv_scale = slot_scale.transpose(0, 2, 1, 3).reshape(Tp, KERNEL_TILE, -1)
    else:
        assert kv_scale is None, "FP8 rows gathered by XLA are dequantised before packing"
        packed_idx = None
        if idx is not None:  # trn1: XLA gathers (row 0 for an empty slot, replaced just below)
            slot_rows = slot_rows[jnp.where(valid, idx, 0)]
        g = jnp.where(valid[:, :, None], slot_rows.astype(jnp.bfloat16), jnp.zeros((), jnp.bfloat16))
        packed_rows = _pad_axis(_pad_axis(g, 2, Dp), 1, Kp)

    packed = PackedOperands(
        q_groups=q_groups,
        slot_rows=packed_rows,
        idx=packed_idx,
        bias=packed_bias,
        sink_groups=sink_groups,
        row_has_slot=row_has_slot,
        slot_scale=kv_scale,
        rope_rows=None if kv_rope is None else kv_rope.astype(jnp.bfloat16),
        extra_rope=None if extra_rope is None else extra_rope.astype(jnp.bfloat16),
        extra_rows=packed_extra_rows,
        extra_idx=packed_extra_idx,
    )
    return packed, layout


def unpack_from_kernel(
    out_groups, lse_groups, layout: KernelLayout, row_has_slot, sink, dtype
) -> tuple[jax.Array, jax.Array]:
    """Kernel outputs ``[G, Tp, Hg, Vp]`` and lse ``[G, Tp, Hg, 1]`` -> ``out [T, H, V]`` in
    ``dtype`` and ``lse [T, H]`` f32 (``V`` the value columns, ``Vp = layout.value_dim_padded``). A row with no valid slot gets output exactly 0 and lse
    ``sink[h]`` (``-inf`` without a sink), whatever the kernel computed for it."""
    T, G, Hg = layout.tokens, layout.head_groups, layout.heads_per_group
    Vp = layout.value_dim_padded
    Tp = out_groups.shape[1]
    out = out_groups.transpose(1, 0, 2, 3).reshape(Tp, G * Hg, Vp)
    out = out[:T, : layout.heads, : (layout.value_dim or layout.dim)]
    out = jnp.where(row_has_slot[:, None, None], out, jnp.zeros((), out.dtype))
    lse = lse_groups.reshape(G, Tp, Hg).transpose(1, 0, 2).reshape(Tp, G * Hg)[:T, : layout.heads]
    lse = jnp.where(row_has_slot[:, None], lse, sink.astype(jnp.float32)[None, :])
    return out.astype(dtype), lse


def empty_result(q, sink, value_dim=None) -> tuple[jax.Array, jax.Array]:
    """The result when there is nothing to attend to (``T``, ``H`` or ``K`` is 0, or ``R`` is 0):
    zeros ``[T, H, value_dim]`` (default D), and the sink as the lse of every row."""
    T, H, D = q.shape
    lse = jnp.broadcast_to(sink.astype(jnp.float32)[None, :], (T, H))
    return jnp.zeros((T, H, D if value_dim is None else value_dim), q.dtype), lse
