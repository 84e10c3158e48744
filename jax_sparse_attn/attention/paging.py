"""Paged KV caches: logical row indices mapped to the physical rows of a pool of pages.

vLLM and sglang keep a sequence's cache rows in fixed-size pages (blocks) of one shared pool
``[num_blocks * block_size, D]``; the sequence's block table lists its pages in order, so logical
row ``i`` lives at physical row ``block_table[i // block_size] * block_size + i % block_size``.
:func:`paged_indices` does that mapping for the index operand of ``gathered_attn_idx``, with this
package's empty-slot rule carried through: an index that names no row stays empty.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..checks import check_integer, host_rows_or_empty
from ..constants import MAX_ROWS


def paged_indices(idx, block_table, block_size: int) -> jax.Array:
    """Maps logical cache rows to the physical rows of a paged pool.

    ``out = block_table[idx // block_size] * block_size + idx % block_size`` for every entry of
    ``idx``, and ``-1`` (an empty slot) where that names no row: ``idx < 0``, a logical block at or
    beyond ``len(block_table)``, a negative table entry (an unallocated page), or a physical row
    that int32 cannot hold.

    Args:
      idx: ``[...]`` (typically ``[T, K]``) any integer dtype: logical row indices of one sequence.
      block_table: ``[num_blocks]`` any integer dtype: the sequence's pages, in order. For a batch
        of sequences with one table each, ``jax.vmap`` over ``idx`` and ``block_table`` together.
      block_size: rows per page, a positive Python int (static).

    Returns:
      ``int32`` array of ``idx``'s shape: physical rows of the pool, ``-1`` for an empty slot.
      Pass it as ``idx`` to ``gathered_attn_idx`` with the pool ``[pages * block_size, D]``.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"block_size must be a Python int; got {type(block_size).__name__}")
    block_size = int(block_size)
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1; got {block_size}")
    if isinstance(idx, (list, tuple)):
        idx = np.asarray(idx)
    if isinstance(block_table, (list, tuple)):
        block_table = np.asarray(block_table)
    check_integer("idx", idx)
    check_integer("block_table", block_table)
    if np.ndim(block_table) != 1:
        raise ValueError(
            f"block_table must have rank 1 ([num_blocks]); got shape {np.shape(block_table)} "
            "(vmap over a batch of tables)"
        )
    num_blocks = np.shape(block_table)[0]
    logical_rows = num_blocks * block_size
    if isinstance(idx, np.ndarray):
        # Host indices: decided at full width before JAX could narrow an int64 to int32.
        idx = host_rows_or_empty(idx, logical_rows)
    idx = jnp.asarray(idx)
    if idx.dtype.itemsize < 4:
        idx = idx.astype(jnp.int32)
    signed = jnp.issubdtype(idx.dtype, jnp.signedinteger)
    in_table = ((idx >= 0) if signed else True) & (idx < logical_rows)
    logical = jnp.where(in_table, idx, 0).astype(jnp.int32)
    block = logical // block_size
    offset = logical % block_size
    table = jnp.asarray(block_table)
    if num_blocks == 0:
        return jnp.full(idx.shape, -1, jnp.int32)
    # A page number whose physical row would not fit int32 is as unusable as a negative one.
    largest_page = (MAX_ROWS - (block_size - 1)) // block_size
    page = table[block]  # in range: block < num_blocks wherever in_table holds
    page_ok = (page >= 0) & (page <= largest_page)
    page32 = jnp.where(page_ok, page, 0).astype(jnp.int32)
    physical = page32 * jnp.int32(block_size) + offset
    return jnp.where(in_table & page_ok, physical, jnp.int32(-1))
