"""The compressor's gated pooling in plain jnp: the arithmetic of docs/compress.md, "Contract".

For every block ``j`` of ``r`` rows and every output channel the op pools a *window* of rows, in
row order: the block's own ``r`` rows, and with ``overlap`` first the ``r`` rows before them (the
previous block on the other half of the channels). Per window, in f32::

    s[i] = min(score[i] + ape[i], FLT_MAX)      +inf -> FLT_MAX; -inf stays: the row is masked
    m    = max_i s[i]                            (0 where every row is masked)
    e[i] = exp(s[i] - m)
    z    = ((e[0] + e[1]) + e[2]) + ...          left to right (1 where every row is masked)
    out  = ((t[0] + t[1]) + t[2]) + ...          t[i] = e[i] / z * kv[i], or +0 for a masked row

The sums are loops over the rows in window order, so that every backend, shard layout and batch
shape adds the same terms in the same order: the sharded call is bit-identical to the
single-device one.

Everything here works on any leading batch dims; ``pool_rows`` is what a device runs on its own
block of tokens (``compress/sharding.py`` hands it the rows before its first block).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from ..constants import FLT_MAX


def blocks_of(x, ratio: int):
    """The whole blocks: ``[..., T, C]`` -> ``[..., T // r, r, C]`` (the ``T % r`` trailing rows
    dropped)."""
    N = x.shape[-2] // ratio
    return x[..., :N * ratio, :].reshape(x.shape[:-2] + (N, ratio, x.shape[-1]))


def row_scores(score_blocks, ape):
    """``s = min(f32(score) + f32(ape), FLT_MAX)`` for each row of the blocks: scores
    ``[..., N, r, C]`` (any float) and ape ``[..., r, C]`` -> ``[..., N, r, C]`` f32. A ``+inf``
    score (or an f32 overflow of the sum) becomes ``FLT_MAX``; NaN and ``-inf`` pass through."""
    s = score_blocks.astype(jnp.float32) + ape.astype(jnp.float32)[..., None, :, :]
    return jnp.minimum(s, FLT_MAX)


def sum_in_order(x):
    """``((x[0] + x[1]) + x[2]) + ...`` over axis -2 of ``[..., n, C]``, as a loop: an XLA
    reduction may add in another order for another shape; this chain cannot."""
    def add_row(i, total):
        return total + jax.lax.dynamic_index_in_dim(x, i, axis=x.ndim - 2, keepdims=False)

    return jax.lax.fori_loop(1, x.shape[-2], add_row, x[..., 0, :])


def softmax_pool(kv, s):
    """Softmax-weighted sum over each window of rows: kv ``[..., N, n, C]`` (any float) and its
    ``row_scores`` ``[..., N, n, C]`` f32, rows in window order -> ``[..., N, C]`` f32. A row with
    ``s = -inf`` is masked: weight 0, its kv never read; a window of masked rows gives 0."""
    m = jnp.max(s, axis=-2, keepdims=True)  # exact in any order; NaN if any row's score is NaN
    # The max only keeps exp in range; the result does not depend on it, so neither does the
    # gradient (as in jax.nn.softmax).
    m = jax.lax.stop_gradient(jnp.where(m == -jnp.inf, 0.0, m))
    e = jnp.exp(s - m)
    z = sum_in_order(e)[..., None, :]
    # z >= 1 wherever a row is live (the max row has e = 1); 0 only for a fully masked window.
    z = jnp.where(z == 0.0, 1.0, z)
    return sum_in_order(jnp.where(s == -jnp.inf, 0.0, e / z * kv.astype(jnp.float32)))


def pool_rows(kv, score, ape, *, overlap: bool, before_kv=None, before_s=None):
    """The pooled blocks of one run of whole blocks.

    Args:
      kv: ``[..., T, C]`` any float, the rows from a block boundary (a tail is dropped).
      score: ``[..., T, C]`` any float, their raw scores.
      ape: ``[..., r, C]`` any float.
      overlap: pool each block with the one before it (C = 2d).
      before_kv, before_s: with ``overlap``, the ``r`` rows before the first block,
        ``[..., r, C]`` f32 (``rows_before``: s as ``row_scores`` makes it, ``-inf`` for none).

    Returns:
      ``[..., T // r, C]`` f32, or ``[..., T // r, d]`` with ``overlap``.
    """
    ratio = ape.shape[-2]
    kv_blocks = blocks_of(kv, ratio).astype(jnp.float32)
    s_blocks = row_scores(blocks_of(score, ratio), ape)
    if not overlap:
        return softmax_pool(kv_blocks, s_blocks)
    d = kv.shape[-1] // 2

    # Block j's window on output channel c: block j - 1's rows on channel c (block -1's are the
    # rows before), then its own on d + c.
    def window(blocks, before):
        previous = jnp.concatenate([before[..., None, :, :d], blocks[..., :-1, :, :d]], axis=-3)
        return jnp.concatenate([previous, blocks[..., d:]], axis=-2)

    return softmax_pool(window(kv_blocks, before_kv), window(s_blocks, before_s))


def rows_before(score_like, ape, prev_kv=None, prev_score=None):
    """The rows before block 0 as ``pool_rows`` takes them: ``(kv [..., r, C], s [..., r, C])``
    f32, from ``prev_kv``/``prev_score`` (raw scores: ape is added), or zeros and ``-inf`` for
    none. ``score_like`` gives the leading dims."""
    shape = score_like.shape[:-2] + ape.shape[-2:]
    if prev_kv is None:
        return jnp.zeros(shape, jnp.float32), jnp.full(shape, -jnp.inf, jnp.float32)
    return prev_kv.astype(jnp.float32), block_scores(prev_score, ape)


def block_scores(score_block, ape):
    """``row_scores`` of one whole block: ``[..., r, C]`` (any float) -> ``[..., r, C]`` f32."""
    return row_scores(score_block[..., None, :, :], ape)[..., 0, :, :]


def compress_pool_reference(kv, score, ape, prev_kv: Optional[jax.Array] = None,
                            prev_score: Optional[jax.Array] = None, *, overlap: bool):
    """The whole op on one device: kv, score ``[..., T, C]``, ape ``[..., r, C]``, prev_kv and
    prev_score ``[..., r, C]`` or None (any float dtypes) -> ``[..., T // r, C]`` f32, or
    ``[..., T // r, C // 2]`` with ``overlap``. The ``T % r`` trailing rows are never read."""
    ratio = ape.shape[-2]
    N = kv.shape[-2] // ratio
    C = kv.shape[-1]
    out_shape = kv.shape[:-2] + (N, C // 2 if overlap else C)
    if N == 0 or out_shape[-1] == 0:
        return jnp.zeros(out_shape, jnp.float32)
    if not overlap:
        return pool_rows(kv, score, ape, overlap=False)
    before_kv, before_s = rows_before(score, ape, prev_kv, prev_score)
    return pool_rows(kv, score, ape, overlap=True, before_kv=before_kv, before_s=before_s)
