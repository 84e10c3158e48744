"""``indexer_kl``: argument checks, normalisation, and the primitive bind (docs/indexer-kl.md)."""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from ..checks import as_array, check_integer, check_rank, check_scale, dtype_of, shape_of
from ..constants import MAX_ROWS
from ..indexer.api import _normalise_positions, _static_int
from . import primitive

ArrayLike = jax.typing.ArrayLike


def _array(name: str, x, rank: int, layout: str, *, floating: bool):
    if isinstance(x, (str, bytes)) or x is None:
        raise TypeError(f"{name} must be an array; got {type(x).__name__}")
    x = as_array(name, x)
    check_rank(name, x, rank, layout)
    if floating and not jnp.issubdtype(dtype_of(x), jnp.floating):
        raise TypeError(f"{name} must be a floating dtype (bf16, f16, f32, or FP8 dequantised "
                        f"rows' float dtype); got {dtype_of(x)}")
    if not floating:
        check_integer(name, x)
    return x


def _shape(name: str, x, want: tuple, layout: str, why: str) -> None:
    if shape_of(x) != want:
        raise ValueError(f"{name} must have shape {layout} = {want} to match {why}; "
                         f"got {shape_of(x)}")


def _scalar(name: str, x, default):
    """A real scalar as f32 (``checks.check_scale``), its errors naming ``name``."""
    try:
        return check_scale(x, default)
    except (TypeError, ValueError) as err:
        raise type(err)(str(err).replace("scale", name, 1)) from None


def _normalise_idx(idx, rows: int):
    """Any integer dtype -> int32, every entry outside ``[0, rows)`` -1 (decided at the index's
    own width, so a 64-bit index is never wrapped into a valid row)."""
    if isinstance(idx, np.ndarray):
        out = np.full(idx.shape, -1, np.int32)
        ok = (idx >= 0) & (idx < rows)
        out[ok] = idx[ok]
        return jnp.asarray(out)
    idx = jnp.asarray(idx)
    return jnp.where((idx >= 0) & (idx < rows), idx, -1).astype(jnp.int32)


def indexer_kl(
    q: ArrayLike,
    kv: ArrayLike,
    index_q: ArrayLike,
    index_weights: ArrayLike,
    index_keys: ArrayLike,
    positions: ArrayLike,
    idx: ArrayLike,
    *,
    sparse: bool,
    scale: Union[float, ArrayLike],
    index_scale: Union[float, ArrayLike, None] = None,
    key_scale: Optional[ArrayLike] = None,
    compress_ratio: int = 1,
    lse_extra: Optional[ArrayLike] = None,
    implementation: Optional[str] = None,
) -> tuple[jax.Array, jax.Array]:
    """The indexer's KL objective per token: from the main attention's head-summed probabilities
    over each token's candidates (the teacher) to the indexer's softmax over them (the student).

    Per token ``t`` with candidates ``C_t`` (``sparse=True``: the valid slots of ``idx[t]``,
    DeepSeek's sparse stage; ``sparse=False``: every visible row, the dense warm-up), per head
    ``h`` with logits ``l_h[t, j] = scale * q[t, h] . kv[j]``::

        Z_h    = exp(lse_extra[t, h]) + sum_{j in C_t} exp(l_h[t, j])
        p_t(j) = sum_h exp(l_h[t, j]) / Z_h,  normalised over C_t
        I[t, j] = index_scale * key_scale[j] * sum_i index_weights[t, i]
                  * relu(index_q[t, i] . index_keys[j])
        s_t    = softmax over C_t of I[t, :]
        kl[t]  = sum_{j in C_t} p_t(j) (log p_t(j) - log s_t(j))
        mass[t] = sum over idx[t]'s valid rows of p_t(j)

    Row ``j`` is visible to token ``t`` iff ``(j + 1) * compress_ratio <= positions[t] + 1``; a
    slot of ``idx`` that is ``-1``, out of range or not visible is empty. A token with no
    candidate (or no teacher mass) has ``kl = mass = 0``. Logs are base e. Memory: the sparse form
    is ``O(T K)``; the dense form streams over blocks of rows and never holds a ``[T, R]`` tensor.
    Definitions, the reductions layers take and the memory: ``docs/indexer-kl.md``.

    Args:
      q: ``[T, H, D]`` float, the teacher's (main attention's) queries. No gradient.
      kv: ``[R, D]`` float, the teacher's key rows (FP8 rows dequantised). No gradient.
      index_q: ``[T, Hi, Di]`` float, the indexer's queries.
      index_weights: ``[T, Hi]`` float, the indexer's per-head weights.
      index_keys: ``[R, Di]`` float, the indexer's keys; row ``j`` is kv's row ``j``.
      positions: ``[T]`` any integer dtype.
      idx: ``[T, K]`` any integer dtype, the indexer's current top-k (``-1``: empty), e.g.
        :func:`jax_sparse_attn.indexer_topk`'s result. No gradient.
      sparse: bool (static): the candidates are idx's slots (True) or every visible row (False).
      scale: real scalar, the teacher's softmax scale (f32).
      index_scale: real scalar, the score scale (default ``(Hi * Di) ** -0.5``, as
        :func:`jax_sparse_attn.indexer_topk`'s ``scale``).
      key_scale: ``[R]`` positive float per-row scales of the keys, or None (1). No gradient.
      compress_ratio: static int >= 1, tokens per row (V4's compressed blocks: 4).
      lse_extra: ``[T, H]`` float: the base-e log of the part of each head's softmax denominator
        outside the candidates (the sink, a window's rows: ``gathered_attn_idx(...,
        return_lse=True)``'s lse), or None (nothing, ``-inf``). ``+inf``: that head adds
        nothing. No gradient.
      implementation: None or ``"reference"`` (the jnp reference, also on Trainium for now).

    Returns:
      ``(kl [T] f32, mass [T] f32)``. ``kl`` is differentiable with respect to ``index_q``,
      ``index_weights`` and ``index_keys`` (``d kl[t] / d I[t, j] = s_t(j) - p_t(j)``); ``mass``
      carries no gradient.
    """
    operands, params = primitive_operands(
        q, kv, index_q, index_weights, index_keys, positions, idx, sparse=sparse, scale=scale,
        index_scale=index_scale, key_scale=key_scale, compress_ratio=compress_ratio,
        lse_extra=lse_extra, implementation=implementation)
    kl, mass = primitive.indexer_kl_p.bind(*(x[None] for x in operands), mode="value", **params)
    return kl[0], mass[0]


def primitive_operands(q, kv, index_q, index_weights, index_keys, positions, idx, *, sparse,
                       scale, index_scale=None, key_scale=None, compress_ratio=1, lse_extra=None,
                       implementation=None):
    """``indexer_kl``'s checks and operand preparation: ``(operands, params)`` of
    ``indexer_kl_p`` for one sequence (no leading axis), in ``primitive.OPERANDS``' order."""
    if implementation not in (None, "reference"):
        raise ValueError(f"implementation must be None or 'reference' (indexer_kl has no kernel "
                         f"yet); got {implementation!r}")
    if not isinstance(sparse, (bool, np.bool_)):
        raise TypeError(f"sparse must be a bool (static); got {type(sparse).__name__} "
                        f"{sparse!r:.40}")
    q = _array("q", q, 3, "[T, H, D]", floating=True)
    kv = _array("kv", kv, 2, "[R, D]", floating=True)
    index_q = _array("index_q", index_q, 3, "[T, Hi, Di]", floating=True)
    index_weights = _array("index_weights", index_weights, 2, "[T, Hi]", floating=True)
    index_keys = _array("index_keys", index_keys, 2, "[R, Di]", floating=True)
    positions = _array("positions", positions, 1, "[T]", floating=False)
    idx = _array("idx", idx, 2, "[T, K]", floating=False)
    T, H, D = shape_of(q)
    R = shape_of(kv)[0]
    Hi, Di = shape_of(index_q)[1:]
    _shape("kv", kv, (R, D), "[R, D]", f"q {shape_of(q)}")
    _shape("index_q", index_q, (T, Hi, Di), "[T, Hi, Di]", f"q {shape_of(q)} (its tokens)")
    _shape("index_weights", index_weights, (T, Hi), "[T, Hi]", f"index_q {shape_of(index_q)}")
    _shape("index_keys", index_keys, (R, Di), "[R, Di]",
           f"kv {shape_of(kv)} (its rows) and index_q {shape_of(index_q)} (its width)")
    _shape("positions", positions, (T,), "[T]", f"q {shape_of(q)}")
    if shape_of(idx)[0] != T:
        raise ValueError(f"idx must have shape [T, K] = ({T}, K) to match q {shape_of(q)}; "
                         f"got {shape_of(idx)}")
    if R > MAX_ROWS:
        raise ValueError(f"kv has {R} rows; at most {MAX_ROWS} can be indexed with int32")
    compress_ratio = _static_int("compress_ratio", compress_ratio, 1)
    if scale is None:
        raise TypeError("scale must be a real number (the teacher's softmax scale); got None")
    scale = _scalar("scale", scale, None)
    index_scale = _scalar("index_scale", index_scale, (Hi * Di) ** -0.5)
    if key_scale is None:
        key_scale = jnp.ones((R,), jnp.float32)
    else:
        key_scale = _array("key_scale", key_scale, 1, "[R]", floating=True)
        _shape("key_scale", key_scale, (R,), "[R]", f"kv {shape_of(kv)}")
        key_scale = jnp.asarray(key_scale, jnp.float32)
    if lse_extra is None:
        lse_extra = jnp.full((T, H), -jnp.inf, jnp.float32)
    else:
        lse_extra = _array("lse_extra", lse_extra, 2, "[T, H]", floating=True)
        _shape("lse_extra", lse_extra, (T, H), "[T, H]", f"q {shape_of(q)}")
        lse_extra = jnp.asarray(lse_extra, jnp.float32)
    stop = jax.lax.stop_gradient
    weights = jnp.asarray(index_weights).astype(jnp.float32) * stop(index_scale)
    operands = (stop(jnp.asarray(q)), stop(jnp.asarray(kv)), jnp.asarray(index_q), weights,
                jnp.asarray(index_keys), stop(key_scale), _normalise_positions(positions),
                _normalise_idx(idx, R), stop(lse_extra), stop(scale).reshape(()))
    return operands, dict(sparse=bool(sparse), compress_ratio=compress_ratio,
                          implementation=implementation)
