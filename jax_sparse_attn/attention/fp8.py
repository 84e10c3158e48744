"""FP8 KV caches with f32 scales: the gathered slots are dequantised, never the whole cache.

A cache ``kv [R, D]`` in ``float8_e4m3fn`` or ``float8_e5m2`` comes with ``kv_scale``, either
``[R]`` (one scale per row) or ``[R, D // G]`` (one per group of G consecutive columns; G = 128 is
FlashMLA's layout). It means ``kv_dequant = (kv.astype(f32) * scale).astype(q.dtype)``, the scale
broadcast over its group, and ``gathered_attn_idx`` on it computes what it computes on
``kv_dequant``.

How: the FP8 cache and its scales are operands of ``gathered_attn_idx_p`` (the layout's ``fp8``
part, docs/contract.md "Operand layout"), so every implementation takes the same path:

- the jnp reference gathers each chunk of tokens' FP8 rows (one byte per element, half of a bf16
  cache's) and their scales inside its token loop and dequantises them there
  (``reference.dequantise_slots``), so memory stays within the bound of a bf16 cache at any T;
- ``nki_emulated`` and the Neuron device run the FP8 kernel, which gathers the FP8 rows by
  indirect DMA and dequantises on chip (trn2, trn3); on trn1, which has no indirect DMA, XLA
  gathers and dequantises the slots (``gather_dequantized``) for the pre-gathered kernel.

Rows and scales that no valid slot selects are never read (the gathers fill them with 0). The
gradient (of q, the sink, the bias and the scale; the cache and its scales get none) is the
primitive's own (autodiff.py), on the same dequantised slots.

A cache (and its scales) split over its rows across devices: each device gathers the FP8 bytes
and scales of the slots it holds (zeros for the others), one all-reduce of the ``[T, K, D]`` bytes
completes them, and the op runs on those slots (``cache_sharding.fp8_row_local``); the cache itself
never moves, and the result is the single-device one bit for bit (tests/test_cache_sharding.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .. import sharding

FP8_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))


def is_fp8(dtype) -> bool:
    return np.dtype(dtype) in FP8_DTYPES


def check_kv_scale(kv_shape: tuple, kv_dtype, kv_scale, cache: str = "kv") -> jax.Array:
    """Validates the scales of the FP8 cache named ``cache`` (``kv`` or ``extra_kv``; its scales
    are ``cache + "_scale"``); returns them as ``[R, n]`` f32 (``n`` groups)."""
    R, D = kv_shape
    name = cache + "_scale"
    if not is_fp8(kv_dtype):
        raise TypeError(
            f"{name} is for FP8 caches (float8_e4m3fn, float8_e5m2); {cache} has dtype {kv_dtype}"
        )
    if kv_scale is None:
        raise ValueError(
            f"an FP8 cache ({cache} dtype {kv_dtype}) needs {name}: [R] = ({R},) per row or "
            f"[R, D // G] per group of G columns"
        )
    shape = tuple(np.shape(kv_scale))
    if shape == (R,):
        groups = 1
    elif len(shape) == 2 and shape[0] == R and shape[1] >= 1 and D % shape[1] == 0:
        groups = shape[1]
    else:
        raise ValueError(
            f"{name} must have shape [R] = ({R},) or [R, D // G] = ({R}, n) with n dividing "
            f"D = {D}; got {shape}"
        )
    dtype = jax.dtypes.result_type(kv_scale)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating dtype (cast to f32); got {dtype}")
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
