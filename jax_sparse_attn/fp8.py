"""FP8 KV caches with f32 scales: the gathered slots are dequantised, never the whole cache.

A cache ``kv [R, D]`` in ``float8_e4m3fn`` or ``float8_e5m2`` comes with ``kv_scale``, either
``[R]`` (one scale per row) or ``[R, D // G]`` (one per group of G consecutive columns; G = 128 is
FlashMLA's layout). It means ``kv_dequant = (kv.astype(f32) * scale).astype(q.dtype)``, the scale
broadcast over its group, and ``gathered_attn_idx`` on it computes what it computes on
``kv_dequant``.

How: each token's slots are gathered from the FP8 cache (one byte per element moved, half of a
bf16 cache's), dequantised in f32 and rounded to q's dtype, and passed with the empty slots
masked to the pre-gathered op (``gathered_attn_p``), whose data path (the jnp reference, or the
NKI kernel on Neuron) then runs unchanged. Rows that no valid slot selects are never read (the
gather fills them with 0). The gathered slots ``[T, K, D]`` exist in q's dtype for all tokens
at once: sized for decode; split a long prefill into token chunks.

A cache (and its scales) split over its rows across devices: XLA gathers each device's slots
locally (the others filled with 0) and sums the ``[T, K, D]`` FP8 bytes over the devices (one
all-reduce; tests/test_cache_sharding.py); the cache itself never moves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from . import sharding

FP8_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))


def is_fp8(dtype) -> bool:
    return np.dtype(dtype) in FP8_DTYPES


def check_kv_scale(kv_shape: tuple, kv_dtype, kv_scale) -> jax.Array:
    """Validates ``kv_scale`` for an FP8 cache; returns it as ``[R, n]`` f32 (``n`` groups)."""
    R, D = kv_shape
    if not is_fp8(kv_dtype):
        raise TypeError(
            f"kv_scale is for FP8 caches (float8_e4m3fn, float8_e5m2); kv has dtype {kv_dtype}"
        )
    if kv_scale is None:
        raise ValueError(
            f"an FP8 cache (kv dtype {kv_dtype}) needs kv_scale: [R] = ({R},) per row or "
            f"[R, D // G] per group of G columns"
        )
    shape = tuple(np.shape(kv_scale))
    if shape == (R,):
        groups = 1
    elif len(shape) == 2 and shape[0] == R and shape[1] >= 1 and D % shape[1] == 0:
        groups = shape[1]
    else:
        raise ValueError(
            f"kv_scale must have shape [R] = ({R},) or [R, D // G] = ({R}, n) with n dividing "
            f"D = {D}; got {shape}"
        )
    dtype = jax.dtypes.result_type(kv_scale)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"kv_scale must be a floating dtype (cast to f32); got {dtype}")
    return jnp.asarray(kv_scale, jnp.float32).reshape(R, groups)


def gather_dequantized(kv, kv_scale, idx, dtype) -> jax.Array:
    """Slots ``[T, K, D]`` in ``dtype``: ``(kv[idx].astype(f32) * scale[idx]).astype(dtype)``.

    ``kv [R, D]`` FP8, ``kv_scale [R, n]`` f32 (``check_kv_scale``), ``idx [T, K]`` int32 with -1
    for an empty slot (normalised by the API). An empty slot's row is 0 and reads nothing.
    """
    R, D = kv.shape
    if R == 0:  # an empty cache: every slot is empty (a gather from 0 rows is not valid XLA)
        return jnp.zeros(idx.shape + (D,), dtype)
    groups = kv_scale.shape[1]
    rows = jnp.where(idx >= 0, idx, R)  # out of range: filled with 0
    # A cache split over explicit mesh axes: the gathered slots are replicated, which XLA does by
    # gathering locally (masked) and summing over the devices: T * K * D bytes, never the cache.
    kw = {}
    if sharding._explicit_axis_names(jax.typeof(kv)):
        kw["out_sharding"] = NamedSharding(jax.typeof(kv).sharding.mesh, PartitionSpec())
    # The gather moves the raw bytes (as the reference moves bf16 bits): one byte per element.
    bits = jax.lax.bitcast_convert_type(kv, jnp.uint8).at[rows].get(
        mode="fill", fill_value=0, **kw
    )
    x = jax.lax.bitcast_convert_type(bits, kv.dtype).astype(jnp.float32)  # [T, K, D]
    s = kv_scale.at[rows].get(mode="fill", fill_value=0, **kw)  # [T, K, n]
    x = x.reshape(x.shape[:-1] + (groups, D // groups)) * s[..., None]
    return x.reshape(idx.shape + (D,)).astype(dtype)


def kernel_reads_fp8(kv=None) -> bool:
    """Whether ``implementation="nki_emulated"`` runs the FP8 kernel, which reads the FP8 rows
    itself: on the targets with indirect DMA (trn2, trn3; ``NEURON_PLATFORM_TARGET_OVERRIDE``),
    for a cache ``kv`` not split over explicit mesh axes. Otherwise the slots are gathered and
    dequantised by XLA, as for the reference (on trn1, which has no indirect DMA; and for a split
    cache, whose slots each device gathers locally, above)."""
    from .constants import TARGETS_WITH_DGE
    from .nki_emulator.targets import current_target

    if kv is not None and sharding._explicit_axis_names(jax.typeof(kv)):
        return False
    return current_target() in TARGETS_WITH_DGE
