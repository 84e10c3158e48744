"""``indexer_topk``: argument checks, normalisation, and the primitive bind (docs/indexer.md)."""

from __future__ import annotations

import operator
import warnings
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from ..attention import fp8
from ..checks import (as_array, check_implementation, check_integer, check_rank, check_scale,
                      dtype_of, shape_of)
from ..constants import MAX_ROWS
from ..storage import Bf16Bits
from . import primitive
from . import reference
from .reference import MAX_TOPK

ArrayLike = jax.typing.ArrayLike

_INT32 = np.iinfo(np.int32)


def _check_float_or_fp8(name: str, x) -> None:
    dtype = dtype_of(x)
    if not (jnp.issubdtype(dtype, jnp.floating)):
        raise TypeError(
            f"{name} must be a floating dtype (bf16, f16, f32 or float8_e4m3fn); got {dtype}"
        )


def _compute_dtype(q_dtype, keys_dtype):
    """The products' dtype: f32 if either side is f32, else the 16-bit dtype both share (FP8 is
    upcast to bf16, exactly)."""
    widths = {np.dtype(jnp.float32), np.dtype(jnp.float64)}
    if np.dtype(q_dtype) in widths or np.dtype(keys_dtype) in widths:
        return jnp.float32
    q16 = jnp.bfloat16 if fp8.is_fp8(q_dtype) else np.dtype(q_dtype)
    k16 = jnp.bfloat16 if fp8.is_fp8(keys_dtype) else np.dtype(keys_dtype)
    if np.dtype(q16) != np.dtype(k16):
        raise TypeError(
            f"keys ({keys_dtype}) and q ({q_dtype}) must share a 16-bit dtype (FP8 counts as "
            "bf16), or one of them be f32; a bf16 and an f16 operand have no exact common product"
        )
    return q16


def _static_int(name: str, value, minimum: int, maximum: Optional[int] = None) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer; got a bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a Python integer (static); got {type(value).__name__}") from None
    if v < minimum or (maximum is not None and v > maximum):
        bound = f"at least {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise ValueError(f"{name} must be {bound}; got {v}")
    return v


def _normalise_positions(positions):
    """Any integer dtype -> int32; beyond int32 is clipped (a later position than any row, or
    -1), so a 64-bit position is never wrapped into a small one."""
    # Bounds that a dtype cannot hold (-1 unsigned, 2**31 - 1 in 8 or 16 bits) are refused by
    # NumPy 2 (OverflowError): unsigned positions are only capped, and only when they can exceed it.
    if isinstance(positions, np.ndarray):
        if np.issubdtype(positions.dtype, np.unsignedinteger):
            if positions.dtype.itemsize >= 4:
                positions = np.minimum(positions, positions.dtype.type(_INT32.max))
            return jnp.asarray(positions.astype(np.int32))
        return jnp.asarray(np.clip(positions.astype(np.int64), -1, _INT32.max).astype(np.int32))
    positions = jnp.asarray(positions)
    if positions.dtype.itemsize > 4 or positions.dtype == jnp.uint32:
        if jnp.issubdtype(positions.dtype, jnp.unsignedinteger):
            positions = jnp.minimum(positions, _INT32.max)
        else:
            positions = jnp.clip(positions, -1, _INT32.max)
    return positions.astype(jnp.int32)


def indexer_topk(
    q: ArrayLike,
    weights: ArrayLike,
    keys: Union[ArrayLike, Bf16Bits],
    positions: ArrayLike,
    topk: int,
    *,
    scale: Union[float, ArrayLike, None] = None,
    compress_ratio: int = 1,
    key_scale: Optional[ArrayLike] = None,
    return_scores: bool = False,
    implementation: Optional[str] = None,
    keys_as_bits: Optional[bool] = None,
) -> Union[jax.Array, tuple[jax.Array, jax.Array]]:
    """Each token's top-k cache rows by the lightning-indexer score, exact and in bounded memory.

    For token ``t`` and cache row ``r`` (DeepSeek V3.2's lightning indexer; V4's over compressed
    blocks)::

        I[t, r] = scale * key_scale[r] * sum_j weights[t, j] * relu(q[t, j] . keys[r])

    Row ``r`` is valid for token ``t`` iff ``(r + 1) * compress_ratio <= positions[t] + 1``
    (ratio 1: ``r <= position``; ratio 4: complete compressed blocks only; a negative position
    selects nothing). The result is the ``min(topk, valid rows)`` valid rows with the highest
    scores, best first, exact ties to the lower row, a NaN score below every number; the rest of
    each row is ``-1``, so it feeds :func:`jax_sparse_attn.gathered_attn_idx` directly. Rows that
    are not valid for a token never influence its selection, whatever they hold. Nothing of size
    ``[T, R]`` is built beyond a small call's few MiB; a prefill chunk of ``Tc`` tokens may hold
    its ``[Tc, R]`` keys, within 4 MiB (arithmetic and guarantees: ``docs/indexer.md``).

    Args:
      q: ``[T, Hi, Di]`` indexer queries: bf16, f16, f32 or ``float8_e4m3fn`` (its scale folded
        into ``weights`` by the caller, as DeepSeek does).
      weights: ``[T, Hi]`` float, per-token head weights (cast to f32).
      keys: ``[R, Di]`` cached indexer keys, q's dtype family (16-bit or FP8 with bf16, or f32);
        or bf16 keys as a :class:`jax_sparse_attn.storage.Bf16Bits` of their ``uint16`` bit
        patterns (a cache stored as bits, as the Flax layers store bf16), which the reference
        reads in place, block by block, with no float copy of the cache.
      positions: ``[T]`` any integer dtype, each token's position.
      topk: static int, the output width (``0 <= topk <= 32768``); may exceed R.
      scale: real scalar (f32), default ``(Hi * Di) ** -0.5``.
      compress_ratio: static int >= 1, tokens per cache row (V4's compressed blocks: 4).
      key_scale: ``[R]`` positive f32 per-row scales (an FP8 key cache needs them), or None.
      return_scores: also return the scores of the selected rows.
      implementation: as for the attention op: None (the NKI kernel on Neuron, the jnp reference
        elsewhere), ``"reference"``, ``"nki"``, ``"nki_emulated"``.
      keys_as_bits: deprecated (a ``DeprecationWarning``; to be removed in the next release):
        ``True`` with ``uint16`` keys is ``keys=Bf16Bits(keys)``.

    Returns:
      ``idx [T, topk]`` int32, or ``(idx, scores [T, topk] f32)`` with ``-inf`` at the ``-1``
      slots. The scores are differentiable with respect to ``q``, ``weights`` and ``keys``; the
      indices and ``key_scale`` carry no gradient.
    """
    operands, params = primitive_operands(q, weights, keys, positions, topk, scale=scale,
                                          compress_ratio=compress_ratio, key_scale=key_scale,
                                          implementation=implementation, keys_as_bits=keys_as_bits)
    # The primitive takes a batch of sequences with their own caches: here, one.
    idx, scores = (x[0] for x in primitive.indexer_topk_p.bind(*(x[None] for x in operands),
                                                              **params))
    return (idx, scores) if return_scores else idx


def primitive_operands(q, weights, keys, positions, topk, *, scale=None, compress_ratio=1,
                       key_scale=None, implementation=None, keys_as_bits=None):
    """``indexer_topk``'s checks and operand preparation: ``(operands, params)`` of
    ``indexer_topk_p`` (q and keys in the compute dtype, weights f32 with the scale folded in,
    key_scale ``[R]`` f32, positions ``[T]`` int32), also for code that runs the primitive's
    lowerings on the same operands (the benchmark's scores alone)."""
    check_implementation(implementation)
    if keys_as_bits is not None:
        if not isinstance(keys_as_bits, bool):
            raise TypeError(f"keys_as_bits must be a bool; got {type(keys_as_bits).__name__}")
        warnings.warn("indexer_topk(keys_as_bits=...) is deprecated: pass bf16 keys stored as "
                      "uint16 bits as keys=jax_sparse_attn.storage.Bf16Bits(bits)",
                      DeprecationWarning, stacklevel=3)
        if keys_as_bits and not isinstance(keys, Bf16Bits):
            if dtype_of(keys) != jnp.uint16:
                raise TypeError(f"keys_as_bits=True takes keys as uint16 (bf16 bit patterns); "
                                f"got keys of dtype {dtype_of(keys)}")
            keys = Bf16Bits(keys)
    stored_bits = isinstance(keys, Bf16Bits)
    if stored_bits:
        keys = keys.bits
        if dtype_of(keys) != jnp.uint16:
            raise TypeError(f"keys as Bf16Bits hold uint16 bit patterns of bf16 keys; got "
                            f"{dtype_of(keys)}")
    for name, x in (("q", q), ("weights", weights), ("keys", keys), ("positions", positions),
                    ("key_scale", key_scale)):
        if isinstance(x, (str, bytes)):
            raise TypeError(f"{name} must be an array; got a {type(x).__name__}")
    q, weights, keys, positions, key_scale = (
        as_array(n, a)
        for n, a in (("q", q), ("weights", weights), ("keys", keys), ("positions", positions),
                     ("key_scale", key_scale))
    )
    check_rank("q", q, 3, "[T, Hi, Di]")
    _check_float_or_fp8("q", q)
    check_rank("weights", weights, 2, "[T, Hi]")
    _check_float_or_fp8("weights", weights)
    check_rank("keys", keys, 2, "[R, Di]")
    if not stored_bits:
        if dtype_of(keys) == jnp.uint16:
            raise TypeError("keys must be a floating dtype (bf16, f16, f32 or float8_e4m3fn); got "
                            "uint16 (bit patterns of bf16 keys go in as storage.Bf16Bits(keys))")
        _check_float_or_fp8("keys", keys)
    check_rank("positions", positions, 1, "[T]")
    check_integer("positions", positions)
    T, Hi, Di = shape_of(q)
    R = shape_of(keys)[0]
    if shape_of(weights) != (T, Hi):
        raise ValueError(f"weights must have shape [T, Hi] = ({T}, {Hi}) to match q {shape_of(q)}; "
                         f"got {shape_of(weights)}")
    if shape_of(keys)[1] != Di:
        raise ValueError(f"keys must have shape [R, Di] = (R, {Di}) to match q {shape_of(q)}; "
                         f"got {shape_of(keys)}")
    if shape_of(positions) != (T,):
        raise ValueError(f"positions must have shape [T] = ({T},) to match q {shape_of(q)}; "
                         f"got {shape_of(positions)}")
    if R > MAX_ROWS:
        raise ValueError(f"keys has {R} rows; at most {MAX_ROWS} can be indexed with int32")
    topk = _static_int("topk", topk, 0, MAX_TOPK)
    compress_ratio = _static_int("compress_ratio", compress_ratio, 1)
    if key_scale is None:
        if fp8.is_fp8(dtype_of(keys)):
            raise ValueError(f"an FP8 key cache (keys dtype {dtype_of(keys)}) needs key_scale [R] "
                             f"= ({R},), its positive per-row f32 scales")
        key_scale = jnp.ones((R,), jnp.float32)
    else:
        _check_float_or_fp8("key_scale", key_scale)
        if shape_of(key_scale) != (R,):
            raise ValueError(f"key_scale must have shape [R] = ({R},) to match keys "
                             f"{shape_of(keys)}; got {shape_of(key_scale)}")
        key_scale = jax.lax.stop_gradient(jnp.asarray(key_scale, jnp.float32))
    dtype = _compute_dtype(dtype_of(q), jnp.bfloat16 if stored_bits else dtype_of(keys))
    scale = check_scale(scale, (Hi * Di) ** -0.5)
    keys = jnp.asarray(keys)
    if not (stored_bits and dtype == jnp.bfloat16):  # bf16 bits go in as they are
        keys = reference.key_rows(keys).astype(dtype)
    operands = (jnp.asarray(q).astype(dtype), jnp.asarray(weights, jnp.float32) * scale,
                keys, key_scale, _normalise_positions(positions))
    return operands, dict(topk=topk, compress_ratio=compress_ratio, implementation=implementation)
