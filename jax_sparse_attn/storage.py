"""How the Flax layers store cache rows, and write new rows into them (shared by
:mod:`jax_sparse_attn.flax` and :mod:`jax_sparse_attn.deepseek`).

A bf16 array is stored as its ``uint16`` bit patterns and an FP8 one as ``uint8``: XLA:CPU updates
a 16-bit float array by converting all of it to f32 and back (a full pass over a cache that may
hold a million rows, at every decode step, donated or not), while an integer array is updated in
place. Reading the rows back is a bit cast, which copies nothing; the indexer reads bf16 bits in
place (``Bf16Bits``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_BITS = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16),
         jnp.dtype(jnp.float8_e4m3fn): jnp.dtype(jnp.uint8)}
_FLOATS = {bits: dtype for dtype, bits in _BITS.items()}


def storage_dtype(dtype) -> jnp.dtype:
    """The dtype that rows of ``dtype`` are stored in (their bits for bf16 and e4m3)."""
    return _BITS.get(jnp.dtype(dtype), jnp.dtype(dtype))


def to_storage(rows: jax.Array, stored_dtype) -> jax.Array:
    """``rows`` in the storage dtype ``stored_dtype`` (rounded to the float it stands for)."""
    stored_dtype = jnp.dtype(stored_dtype)
    if stored_dtype in _FLOATS:
        return jax.lax.bitcast_convert_type(rows.astype(_FLOATS[stored_dtype]), stored_dtype)
    return rows.astype(stored_dtype)


def values(stored):
    """The float rows of a stored array (``None`` passes through)."""
    if stored is None or stored.dtype not in _FLOATS:
        return stored
    return jax.lax.bitcast_convert_type(stored, _FLOATS[stored.dtype])


class Bf16Bits(NamedTuple):
    """bf16 rows held as their ``uint16`` bit patterns, for an op that reads them in place.

    ``indexer_topk`` takes its keys so: its reference reads each block of rows back as bf16 inside
    its loop, where a bf16 view of the whole cache would be a copy of it (XLA:CPU gives every loop
    operand a buffer of its own). A pytree, so it passes through ``jit`` and ``vmap``."""

    bits: jax.Array


def as_operand(stored):
    """A stored array as an op's operand: ``Bf16Bits`` for bf16's bits, the float rows (a bit
    cast) otherwise."""
    if stored.dtype == jnp.uint16:
        return Bf16Bits(stored)
    return values(stored)


def put(stored: jax.Array, rows: jax.Array, at: jax.Array) -> jax.Array:
    """``stored [B, R, ...]`` with ``rows [B, n, ...]`` written at rows ``at [B, n]``. Rows at or
    past ``R`` (or negative) are dropped: a clamped dynamic_update_slice would overwrite the last
    row. Entries of ``at`` must be distinct where they are in range."""
    # Per sequence under vmap: the batch axis stays the scatter's batch (split like the cache's
    # under an Explicit mesh axis, where a scatter indexed by a batch iota has no output split).
    at = jnp.where(at < 0, stored.shape[1], at)
    return jax.vmap(lambda s, v, a: s.at[a].set(v, mode="drop"))(
        stored, to_storage(rows, stored.dtype), at)
