"""The quantisation that DeepSeek's models simulate, in jnp (docs/deepseek.md, "Quantisation").

DeepSeek's kernels quantise per row, per block of columns: ``amax`` of the block, raised to a
floor, times ``1 / max`` in f32; with ``ue8m0`` scales (every released config) the scale is rounded
up to a power of two through its exponent bits; the values are ``x / scale`` clamped to
``+-max`` and rounded to the narrow format (round to nearest even). The "fake" forms write
``value * scale`` back in the input's dtype, which is exact in bf16: a power-of-two multiple of an
e4m3 or e2m1 value has at most 4 significant bits.

Under differentiation the fake forms pass the gradient straight through (their derivative is the
identity, :func:`with_identity_gradient`): DeepSeek's quantisation-aware training
(docs/deepseek.md, "Gradients"). Their forward values are those of the plain computation, bit for
bit.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

# DeepSeek's act_quant: the e4m3 range and the floor of a block's amax (kernel.py, act_quant_kernel).
FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
# fp4_act_quant: the e2m1 range and its floor, 6 * 2^-126 (the smallest normal f32 scale).
FP4_MAX = 6.0
FP4_AMAX_FLOOR = 6.0 * 2.0**-126
# Block widths: activations before an FP8 matrix product, and the weights' square blocks
# (model.py's block_size); the KV rows' FP8 simulation (Attention.forward, Compressor.forward);
# the indexer's FP4 simulation (fp4_block_size).
LINEAR_BLOCK = 128
KV_BLOCK = 64
FP4_BLOCK = 32


def pow2_ceil(x: jax.Array) -> jax.Array:
    """``2 ** ceil(log2(x))`` for positive normal f32 ``x``, from its exponent and mantissa bits
    (DeepSeek's fast_log2_ceil and fast_pow2: exact, no transcendental)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(jnp.int32) + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type((exponent << 23).astype(jnp.uint32), jnp.float32)


def block_scales(x: jax.Array, block: int, max_value: float, amax_floor: float,
                 pow2: bool) -> jax.Array:
    """``[..., n * block]`` -> ``[..., n]`` f32 scales: ``max(amax, floor) * f32(1 / max)``,
    rounded up to a power of two when ``pow2``."""
    x = x.astype(jnp.float32)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1), jnp.float32(amax_floor))
    scale = amax * jnp.float32(1.0 / max_value)
    return pow2_ceil(scale) if pow2 else scale


def _expand(scale: jax.Array, block: int) -> jax.Array:
    return jnp.repeat(scale, block, axis=-1)


def round_to_grid(y: jax.Array, mantissa_bits: int, min_normal: float) -> jax.Array:
    """f32 ``y`` (within a narrow float format's range) rounded to nearest even on that format's
    grid: ``mantissa_bits`` explicit mantissa bits above ``min_normal``, multiples of
    ``min_normal * 2^-mantissa_bits`` below it. The cast to the format after it is exact: XLA:CPU
    in JAX 0.7 converts f32 to e4m3 and e2m1 through a wider format, rounding twice (91.98 went to
    e4m3's 96, not 88)."""
    drop = 23 - mantissa_bits
    bits = jax.lax.bitcast_convert_type(y, jnp.uint32)
    odd = (bits >> drop) & 1
    kept = (bits + jnp.uint32((1 << (drop - 1)) - 1) + odd) & jnp.uint32((0xFFFFFFFF << drop) & 0xFFFFFFFF)
    step = jnp.float32(min_normal * 2.0 ** -mantissa_bits)
    subnormal = jnp.round(y / step) * step  # half to even; a power-of-two step divides exactly
    return jnp.where(jnp.abs(y) >= jnp.float32(min_normal),
                     jax.lax.bitcast_convert_type(kept, jnp.float32), subnormal)


# e4m3 and e2m1: explicit mantissa bits and smallest normal value.
E4M3_GRID = (3, 2.0**-6)
E2M1_GRID = (1, 1.0)


def fp8_quantize(x: jax.Array, block: int, pow2: bool = True) -> tuple[jax.Array, jax.Array]:
    """``x [..., D]`` -> ``(values [..., D] float8_e4m3fn, scales [..., D // block] f32)`` with
    ``values * scales ~ x`` (DeepSeek's act_quant)."""
    scale = block_scales(x, block, FP8_MAX, FP8_AMAX_FLOOR, pow2)
    y = jnp.clip(x.astype(jnp.float32) / _expand(scale, block), -FP8_MAX, FP8_MAX)
    return round_to_grid(y, *E4M3_GRID).astype(jnp.float8_e4m3fn), scale


def fp8_dequantize(values: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """``values [..., D]`` FP8 times their per-block ``scale [..., n]``, in ``dtype``."""
    block = values.shape[-1] // scale.shape[-1]
    return (values.astype(jnp.float32) * _expand(scale.astype(jnp.float32), block)).astype(dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def with_identity_gradient(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """``fn(x)``, whose derivative is taken to be the identity (the straight-through estimator):
    the tangent of ``x`` passes unchanged, cast to the result's dtype. The forward is ``fn``
    itself, so its values are those of ``fn(x)`` bit for bit (``x + stop_gradient(fn(x) - x)``
    may round differently). ``fn`` maps an array to one of the same shape."""
    return fn(x)


@with_identity_gradient.defjvp
def _identity_tangent(fn, primals, tangents):
    (x,), (dx,) = primals, tangents
    y = with_identity_gradient(fn, x)
    return y, dx.astype(y.dtype)


def _fake_fp8(x, block, pow2, dtype):
    values, scale = fp8_quantize(x, block, pow2)
    return fp8_dequantize(values, scale, dtype)


def fake_fp8(x: jax.Array, block: int, pow2: bool = True, dtype=None, *,
             straight_through: bool = True) -> jax.Array:
    """``x [..., D]`` through FP8 (per ``block`` columns) and back, in ``dtype`` (default
    ``x``'s; act_quant's in-place form, or the activation operand of ``fp8_gemm``).

    ``straight_through``: the derivative is the identity (DeepSeek's quantisation-aware
    training); otherwise it is that of the rounding arithmetic (zero almost everywhere)."""
    fn = functools.partial(_fake_fp8, block=block, pow2=pow2,
                           dtype=x.dtype if dtype is None else jnp.dtype(dtype))
    return with_identity_gradient(fn, x) if straight_through else fn(x)


def _fake_fp4(x, block):
    scale = _expand(block_scales(x, block, FP4_MAX, FP4_AMAX_FLOOR, pow2=True), block)
    y = round_to_grid(jnp.clip(x.astype(jnp.float32) / scale, -FP4_MAX, FP4_MAX), *E2M1_GRID)
    y = y.astype(jnp.float4_e2m1fn)
    return (y.astype(jnp.float32) * scale).astype(x.dtype)


def fake_fp4(x: jax.Array, block: int = FP4_BLOCK, *, straight_through: bool = True) -> jax.Array:
    """``x`` through e2m1 with power-of-two scales per ``block`` columns and back, in ``x``'s
    dtype (DeepSeek's fp4_act_quant, in place). ``straight_through`` as in :func:`fake_fp8`."""
    fn = functools.partial(_fake_fp4, block=block)
    return with_identity_gradient(fn, x) if straight_through else fn(x)
