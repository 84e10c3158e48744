"""The attention op's public functions: argument checking at trace time, normalisation, and the
primitive bind (docs/contract.md)."""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from ..checks import (
    ArrayLike,
    Scale,
    as_array,
    check_integer,
    check_float,
    check_implementation,
    check_rank,
    check_scale,
    dtype_of,
    host_rows_or_empty,
    shape_of,
)
from ..constants import BIAS_FLOOR, FLT_MAX, MAX_ROWS
from . import fp8, primitive


def _sink_bias_scale(q_shape, k: int, sink, bias, scale):
    """Checks the optional operands and returns them in the primitive's normalised form."""
    T, H, D = q_shape
    if sink is None:
        sink = jnp.full((H,), -jnp.inf, jnp.float32)
    else:
        check_float("sink", sink)
        if shape_of(sink) != (H,):
            raise ValueError(f"sink must have shape [H] = ({H},) to match q {q_shape}; got {shape_of(sink)}")
        sink = jnp.asarray(sink, jnp.float32)
    if bias is None:
        bias = jnp.zeros((T, k), jnp.float32)
    else:
        check_float("bias", bias)
        if shape_of(bias) != (T, k):
            raise ValueError(f"bias must have shape [T, K] = ({T}, {k}); got {shape_of(bias)}")
        bias = jnp.asarray(bias, jnp.float32)
        # -inf stays (empty slot); finite values below BIAS_FLOOR rise to it; +inf becomes FLT_MAX
        # (the logit saturation rule, docs/contract.md); NaN stays NaN.
        bias = jnp.where(
            bias == -jnp.inf, bias, jnp.clip(bias, jnp.float32(BIAS_FLOOR), jnp.float32(FLT_MAX))
        )
    # An infinite scale saturates like an overflowed logit (FLT_MAX), so 0 * scale stays 0.
    scale = check_scale(scale, D**-0.5)
    scale = jnp.broadcast_to(scale, (T,))
    return sink, bias, scale


def _apply_topk_length(bias, topk_length, name: str = "topk_length"):
    """Folds a per-token slot count into the normalised bias: slot ``j >= topk_length[t]`` of
    token ``t`` becomes empty (``-inf``), so every backend sees it as an empty slot. ``bias``
    ``[T, K]`` f32; ``topk_length`` ``[T]`` any integer dtype, or ``None`` (all K slots real)."""
    if topk_length is None:
        return bias
    topk_length = as_array(name, topk_length)
    T, K = shape_of(bias)
    check_integer(name, topk_length)
    if shape_of(topk_length) != (T,):
        raise ValueError(f"{name} must have shape [T] = ({T},); got {shape_of(topk_length)}")
    if isinstance(topk_length, np.ndarray):  # full width on the host (an int64 beyond int32)
        topk_length = np.clip(topk_length, -1, K).astype(np.int32)
    lengths = jnp.asarray(topk_length)
    if lengths.dtype.itemsize < 4:
        lengths = lengths.astype(jnp.int32)
    real = jnp.arange(K, dtype=jnp.int32)[None, :] < lengths[:, None]
    return jnp.where(real, bias, -jnp.inf)


def _value_dim(value_dim, D: int) -> int:
    """``value_dim`` checked against the head dim ``D``; ``None`` means D."""
    if value_dim is None:
        return D
    if isinstance(value_dim, bool) or not isinstance(value_dim, (int, np.integer)):
        raise TypeError(f"value_dim must be a Python int or None; got {type(value_dim).__name__}")
    if not 1 <= int(value_dim) <= D:
        raise ValueError(f"value_dim must be in [1, D] = [1, {D}]; got {value_dim}")
    return int(value_dim)


def _check_q(q):
    check_rank("q", q, 3, "[T, H, D]")
    check_float("q", q)
    if shape_of(q)[2] == 0:
        raise ValueError(f"q has head dim D = 0 (shape {shape_of(q)}); D must be at least 1")


def gathered_attn(
    q: ArrayLike,
    g: ArrayLike,
    sink: Optional[ArrayLike] = None,
    *,
    bias: Optional[ArrayLike] = None,
    scale: Scale = None,
    implementation: Optional[str] = None,
    return_lse: bool = False,
    topk_length: Optional[ArrayLike] = None,
    value_dim: Optional[int] = None,
) -> Union[jax.Array, tuple[jax.Array, jax.Array]]:
    """Sparse attention over pre-gathered slots, with an optional per-head attention sink.

    For every token ``t`` and head ``h``::

        s[j] = (q[t, h] . g[t, j]) * scale + bias[t, j]
        out[t, h] = sum_j softmax(s, sink[h])[j] * g[t, j, :value_dim]

    where the sink joins only the softmax denominator. Each slot row serves as key and, in its
    first ``value_dim`` columns, as value (MQA / absorbed MLA). The arithmetic follows the bf16 contract: bf16 operands, fp32
    accumulation, fp32 softmax, bf16 probabilities in the value product.

    Args:
      q: ``[T, H, D]`` queries, bf16 (f16 and f32 accepted).
      g: ``[T, K, D]`` gathered key/value rows, float; computed in ``q``'s dtype.
      sink: ``[H]`` per-head sink logits (cast to f32), or ``None``. ``-inf`` = no sink;
        ``+inf`` makes that head's output 0.
      bias: ``[T, K]`` additive logit bias (cast to f32), or ``None``. A ``-inf`` entry marks the
        slot empty; finite entries below ``-1e29`` are raised to ``-1e29`` (see
        ``constants.BIAS_FLOOR``) so that masked-but-real slots still rank above empty ones.
      scale: softmax scale, a real scalar (python number or array, cast to f32); default
        ``D ** -0.5``.
      implementation: ``None`` (the NKI kernel on Neuron, the jnp reference elsewhere),
        ``"reference"``, ``"nki"`` or ``"nki_emulated"`` (the Neuron data path on the host).
      return_lse: also return the log-sum-exp of the logits (see Returns).
      topk_length: ``[T]`` any integer dtype, or ``None``: token ``t``'s slots ``j >=
        topk_length[t]`` are empty (FlashMLA's ``topk_length``), whatever their rows hold.
      value_dim: a Python int in ``[1, D]``, or ``None`` (D): the logits use all D columns of each
        row, the values and the output only the first ``value_dim`` (FlashMLA's ``d_v``; V3.2's
        absorbed MLA: D = 576, value_dim = 512). No backend computes the other columns' values.

    Returns:
      ``out [T, H, value_dim]`` in ``q``'s dtype. A token whose slots are all empty gets exactly 0.
      With ``return_lse=True``, ``(out, lse)`` where ``lse [T, H]`` f32 is
      ``log(exp(sink[h]) + sum over valid slots j of exp(s[t, h, j]))``, ``s`` the scaled and
      biased fp32 logit: ``sink[h]`` for a token with no valid slot (``-inf`` without a sink).
      Partial results over disjoint slot sets combine exactly with :func:`merge_attention`.
    """
    check_implementation(implementation)
    q, g, sink, bias = (as_array(n, a) for n, a in (("q", q), ("g", g), ("sink", sink), ("bias", bias)))
    _check_q(q)
    check_rank("g", g, 3, "[T, K, D]")
    check_float("g", g)
    T, H, D = shape_of(q)
    if shape_of(g)[0] != T or shape_of(g)[2] != D:
        raise ValueError(
            f"g must have shape [T, K, D] = ({T}, K, {D}) to match q {shape_of(q)}; got {shape_of(g)}"
        )
    q = jnp.asarray(q)
    g = jnp.asarray(g, q.dtype)
    value_dim = _value_dim(value_dim, D)
    sink, bias, scale = _sink_bias_scale(shape_of(q), shape_of(g)[1], sink, bias, scale)
    bias = _apply_topk_length(bias, topk_length)
    operands = primitive.AttnOperands(q=q, g=g, sink=sink, bias=bias, scale=scale)
    out, lse = primitive.bind(operands, implementation=implementation, value_dim=value_dim)
    return (out, lse) if return_lse else out


def _normalise_idx(idx, rows: int):
    """Any integer dtype -> int32 with every empty slot (``idx < 0`` or ``>= R``) set to -1.

    Validity is decided in a dtype wide enough to hold both the index and ``R``, so an int64 or
    uint32 index beyond int32 is empty rather than wrapped into range.
    """
    if isinstance(idx, np.ndarray):
        # Concrete host indices: decide validity in numpy before JAX would canonicalise an int64
        # array to int32 (which wraps 2**32 + 5 into the valid row 5 when x64 is off).
        return jnp.asarray(host_rows_or_empty(idx, rows))
    idx = jnp.asarray(idx)
    if idx.dtype.itemsize < 4:
        idx = idx.astype(jnp.int32)
    valid = (idx >= 0) & (idx < rows) if jnp.issubdtype(idx.dtype, jnp.signedinteger) else idx < rows
    return jnp.where(valid, idx.astype(jnp.int32), jnp.int32(-1))


def _check_kv_rope(kv, kv_rope, kv_scale, D: int, cache: str = "kv"):
    """Checks the 16-bit columns of split FP8 rows (``cache + "_rope"``) against the FP8 cache
    named ``cache`` and q's width ``D``; returns them as an array."""
    name, scale_name = cache + "_rope", cache + "_scale"
    kv_rope = as_array(name, kv_rope)
    check_rank(name, kv_rope, 2, "[R, Dr]")
    dtype = dtype_of(kv_rope)
    if not (jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize == 2):
        raise TypeError(f"{name} must be a 16-bit float (bf16 or f16); got {dtype}")
    if not fp8.is_fp8(dtype_of(kv)) or kv_scale is None:
        raise ValueError(f"{name} is the unquantised part of an FP8 cache: {cache} must be FP8 "
                         f"with {scale_name}")
    R, D8 = shape_of(kv)
    if shape_of(kv_rope)[0] != R or D8 + shape_of(kv_rope)[1] != D:
        raise ValueError(
            f"{name} must have shape [R, D - D8] = ({R}, {D - D8}) (q's width D = {D}, {cache}'s "
            f"FP8 columns D8 = {D8}); got {shape_of(kv_rope)}"
        )
    return jnp.asarray(kv_rope)


def _stopped_rope(rope):
    """Split rows' 16-bit columns as an operand: no gradient reaches them, and a rope of zero
    columns is no rope (whole FP8 rows)."""
    if rope is None or shape_of(rope)[1] == 0:
        return None
    return jax.lax.stop_gradient(rope)


def _check_extra_cache(q_shape, extra_kv, extra_idx, kv_dtype, extra_kv_scale, extra_kv_rope):
    """Checks the second cache and its indices (and, for an FP8 one, its scales and rope
    columns); returns ``(extra_kv, extra_idx, extra_kv_scale, extra_kv_rope)``, the indices
    normalised (-1 for an empty slot), the scales and rope None where absent."""
    T, H, D = q_shape
    if extra_idx is None:
        raise ValueError("extra_kv needs extra_idx [T, K2]: the second cache's row of each slot")
    extra_kv = as_array("extra_kv", extra_kv)
    extra_idx = as_array("extra_idx", extra_idx)
    check_rank("extra_kv", extra_kv, 2, "[R2, D]")
    check_float("extra_kv", extra_kv)
    check_rank("extra_idx", extra_idx, 2, "[T, K2]")
    check_integer("extra_idx", extra_idx)
    fp8_operands = (None, None)
    if fp8.is_fp8(dtype_of(extra_kv)) or extra_kv_scale is not None:
        fp8_operands = _check_fp8_extra(D, extra_kv, kv_dtype, extra_kv_scale, extra_kv_rope)
    elif extra_kv_rope is not None:
        _check_kv_rope(extra_kv, extra_kv_rope, extra_kv_scale, D, "extra_kv")  # raises
    elif shape_of(extra_kv)[1] != D:
        raise ValueError(
            f"extra_kv must have shape [R2, D] = (R2, {D}) to match q {q_shape}; got {shape_of(extra_kv)}"
        )
    if shape_of(extra_idx)[0] != T:
        raise ValueError(
            f"extra_idx must have shape [T, K2] = ({T}, K2) to match q {q_shape}; got {shape_of(extra_idx)}"
        )
    R2 = shape_of(extra_kv)[0]
    if R2 > MAX_ROWS:
        raise ValueError(f"extra_kv has {R2} rows; at most {MAX_ROWS} can be indexed with int32")
    return (extra_kv, _normalise_idx(extra_idx, R2), *fp8_operands)


def _check_fp8_extra(D: int, extra_kv, kv_dtype, extra_kv_scale, extra_kv_rope):
    """An FP8 second cache's ``(extra_kv_scale [R2, n] f32, extra_kv_rope [R2, Dr] or None)``,
    checked as kv's own."""
    if not fp8.is_fp8(dtype_of(extra_kv)):  # scales for a 16-bit cache: check_kv_scale says so
        fp8.check_kv_scale(shape_of(extra_kv), dtype_of(extra_kv), extra_kv_scale, "extra_kv")
    if not fp8.is_fp8(kv_dtype):
        # The primitive's forms: an FP8 second cache sits beside an FP8 main cache only.
        raise TypeError(
            f"an FP8 extra_kv ({dtype_of(extra_kv)}) needs an FP8 kv with kv_scale; kv is "
            f"{np.dtype(kv_dtype)}: dequantise extra_kv, or pass both caches in FP8"
        )
    R2 = shape_of(extra_kv)[0]
    scale = fp8.check_kv_scale(shape_of(extra_kv), dtype_of(extra_kv), extra_kv_scale, "extra_kv")
    if extra_kv_rope is None:
        if shape_of(extra_kv)[1] != D:
            raise ValueError(f"extra_kv must have shape [R2, D] = (R2, {D}) (or [R2, D - Dr] with "
                             f"extra_kv_rope) to match q's width; got {shape_of(extra_kv)}")
        return jax.lax.stop_gradient(scale), None
    rope = _check_kv_rope(extra_kv, extra_kv_rope, extra_kv_scale, D, "extra_kv")
    return jax.lax.stop_gradient(scale), _stopped_rope(rope)


def gathered_attn_idx(
    q: ArrayLike,
    kv: ArrayLike,
    idx: ArrayLike,
    sink: Optional[ArrayLike] = None,
    *,
    bias: Optional[ArrayLike] = None,
    scale: Scale = None,
    implementation: Optional[str] = None,
    return_lse: bool = False,
    kv_scale: Optional[ArrayLike] = None,
    topk_length: Optional[ArrayLike] = None,
    value_dim: Optional[int] = None,
    extra_kv: Optional[ArrayLike] = None,
    extra_idx: Optional[ArrayLike] = None,
    extra_topk_length: Optional[ArrayLike] = None,
    kv_rope: Optional[ArrayLike] = None,
    extra_kv_scale: Optional[ArrayLike] = None,
    extra_kv_rope: Optional[ArrayLike] = None,
) -> Union[jax.Array, tuple[jax.Array, jax.Array]]:
    """DeepSeek-style top-k sparse attention that gathers rows of a shared KV cache by index.

    Equivalent to ``gathered_attn(q, kv[idx], sink, ...)`` without materialising ``kv[idx]``,
    except that an index outside ``[0, R)`` marks its slot empty instead of wrapping or clipping.
    Duplicated indices count twice.

    Args:
      q: ``[T, H, D]`` queries, bf16 (f16 and f32 accepted).
      kv: ``[R, D]`` cache; each row is key and value (one KV head); computed in ``q``'s dtype.
        An FP8 cache (``float8_e4m3fn`` or ``float8_e5m2``) needs ``kv_scale``.
      idx: ``[T, K]`` any integer dtype: the cache row of each slot. ``idx < 0`` or ``idx >= R``
        is an empty slot. (With x64 disabled, JAX itself narrows 64-bit arrays to int32 when they
        enter ``jax.jit`` as arguments; numpy arrays passed to this function directly are checked
        at full width.)
      sink: ``[H]`` per-head sink logits (cast to f32), or ``None``. ``-inf`` = no sink;
        ``+inf`` makes that head's output 0.
      bias: ``[T, K]`` additive logit bias (cast to f32), or ``None``; ``-inf`` = empty slot;
        finite entries below ``-1e29`` are raised to ``-1e29`` (``constants.BIAS_FLOOR``).
      scale: softmax scale, a real scalar (python number or array, cast to f32); default
        ``D ** -0.5``.
      implementation: ``None`` (the NKI kernel on Neuron, the jnp reference elsewhere),
        ``"reference"``, ``"nki"`` or ``"nki_emulated"`` (the Neuron data path on the host).
      return_lse: also return the log-sum-exp of the logits (see Returns).
      kv_scale: for an FP8 ``kv`` only: ``[R]`` f32 (one scale per row) or ``[R, D // G]`` f32
        (one per group of G consecutive columns; G = 128 is FlashMLA's layout). The op then
        computes on ``kv_dequant = (kv.astype(f32) * scale).astype(q.dtype)``, dequantising only
        the gathered slots (see ``jax_sparse_attn/attention/fp8.py``). The cache and its scales carry no
        gradient.
      topk_length: ``[T]`` any integer dtype, or ``None``: token ``t``'s slots ``j >=
        topk_length[t]`` are empty (FlashMLA's ``topk_length``): their rows are never read.
      value_dim: a Python int in ``[1, D]``, or ``None`` (D): the logits use all D columns of each
        row, the values and the output only the first ``value_dim`` (FlashMLA's ``d_v``; V3.2's
        absorbed MLA: D = 576, value_dim = 512). No backend computes the other columns' values.
      extra_kv: ``[R2, D]`` float, a second cache (V4: the sliding window beside the compressed
        rows; FlashMLA's ``extra_k_cache``), with ``extra_idx [T, K2]`` (any integer dtype, empty
        outside ``[0, R2)``): the op attends to the union of both caches' slots in one softmax,
        with one rounding, as the single-cache call on ``[kv; extra_kv]`` with indices
        ``[idx | extra_idx + R]`` would (bit for bit on the reference), without concatenating the
        caches. ``bias`` is then ``[T, K + K2]`` (the main slots first). Gradients reach both
        caches (not an FP8 one). Beside an FP8 ``kv`` (and ``kv_rope``), ``extra_kv`` may stay
        16-bit, in q's dtype (FP8 compressed rows and a bf16 window), or be FP8 itself with
        ``extra_kv_scale`` and ``extra_kv_rope`` (V4 keeps both caches in FP8, as FlashMLA's
        ``extra_k_cache``); an FP8 ``extra_kv`` beside a 16-bit ``kv`` is refused.
      extra_topk_length: ``[T]`` any integer dtype, or ``None``: ``topk_length`` of the second
        cache's slots (needs ``extra_kv``).
      kv_rope: ``[R, Dr]`` 16-bit float, or ``None``: with an FP8 ``kv [R, D - Dr]`` and its
        ``kv_scale``, the columns of each row that are not quantised (DeepSeek's split rows: V3.2
        512 FP8 columns with a scale per 128 plus 64 bf16; V4 448 FP8 with power-of-two scales per
        64 plus 64 bf16). The logical row is ``[dequantised kv | kv_rope]``, of q's width D. No
        gradient reaches it.
      extra_kv_scale, extra_kv_rope: ``kv_scale`` and ``kv_rope`` of an FP8 ``extra_kv``, with the
        same rules and their own shapes (``[R2]`` or ``[R2, n]``; ``[R2, Dr2]``).

    Returns:
      ``out [T, H, value_dim]`` in ``q``'s dtype. A token whose slots are all empty gets exactly 0.
      With ``return_lse=True``, ``(out, lse)`` where ``lse [T, H]`` f32 is
      ``log(exp(sink[h]) + sum over valid slots j of exp(s[t, h, j]))``, ``s`` the scaled and
      biased fp32 logit: ``sink[h]`` for a token with no valid slot (``-inf`` without a sink).
      Partial results over disjoint slot sets combine exactly with :func:`merge_attention`.
    """
    check_implementation(implementation)
    q, kv, idx, sink, bias = (
        as_array(n, a)
        for n, a in (("q", q), ("kv", kv), ("idx", idx), ("sink", sink), ("bias", bias))
    )
    _check_q(q)
    check_rank("kv", kv, 2, "[R, D]")
    check_float("kv", kv)
    check_rank("idx", idx, 2, "[T, K]")
    check_integer("idx", idx)
    T, H, D = shape_of(q)
    R = shape_of(kv)[0]
    if kv_rope is not None:
        kv_rope = _check_kv_rope(kv, kv_rope, kv_scale, D)
    elif shape_of(kv)[1] != D:
        raise ValueError(f"kv must have shape [R, D] = (R, {D}) to match q {shape_of(q)}; got {shape_of(kv)}")
    if shape_of(idx)[0] != T:
        raise ValueError(f"idx must have shape [T, K] = ({T}, K) to match q {shape_of(q)}; got {shape_of(idx)}")
    if R > MAX_ROWS:
        raise ValueError(f"kv has {R} rows; at most {MAX_ROWS} can be indexed with int32")
    value_dim = _value_dim(value_dim, D)
    q = jnp.asarray(q)
    idx = _normalise_idx(idx, R)
    K = shape_of(idx)[1]
    if extra_kv is None:
        for name, value in (("extra_idx", extra_idx), ("extra_topk_length", extra_topk_length),
                            ("extra_kv_scale", extra_kv_scale), ("extra_kv_rope", extra_kv_rope)):
            if value is not None:
                raise ValueError(f"{name} is for a second cache: pass extra_kv with it")
        sink, bias, scale = _sink_bias_scale(shape_of(q), K, sink, bias, scale)
        extra_bias = None
    else:
        extra_kv, extra_idx, extra_kv_scale, extra_kv_rope = _check_extra_cache(
            shape_of(q), extra_kv, extra_idx, dtype_of(kv), extra_kv_scale, extra_kv_rope)
        K2 = shape_of(extra_idx)[1]
        sink, bias, scale = _sink_bias_scale(shape_of(q), K + K2, sink, bias, scale)
        bias, extra_bias = bias[:, :K], bias[:, K:]
        extra_bias = _apply_topk_length(extra_bias, extra_topk_length, "extra_topk_length")
        if extra_kv_scale is None:
            extra_kv = jnp.asarray(extra_kv, q.dtype)
        else:  # FP8: no gradient reaches the cache, its scales or its rope columns
            extra_kv = jax.lax.stop_gradient(jnp.asarray(extra_kv))
    bias = _apply_topk_length(bias, topk_length)
    if kv_scale is not None or fp8.is_fp8(dtype_of(kv)):
        # FP8 cache: the cache and its scales are operands of the primitive; every path gathers
        # the FP8 rows of the slots and dequantises only those (fp8.py). No gradient reaches them.
        kv_scale = jax.lax.stop_gradient(fp8.check_kv_scale(shape_of(kv), dtype_of(kv), kv_scale))
        kv = jax.lax.stop_gradient(jnp.asarray(kv))
        kv_rope = _stopped_rope(kv_rope)
    else:
        kv = jnp.asarray(kv, q.dtype)
    operands = primitive.AttnOperands(
        q=q, kv=kv, idx=idx, sink=sink, bias=bias, scale=scale, kv_scale=kv_scale,
        kv_rope=kv_rope, extra_kv=extra_kv, extra_idx=extra_idx,
        extra_bias=extra_bias, extra_kv_scale=extra_kv_scale, extra_kv_rope=extra_kv_rope)
    out, lse = primitive.bind(operands, implementation=implementation, value_dim=value_dim)
    return (out, lse) if return_lse else out
