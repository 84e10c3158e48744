"""What a layer's cache holds, and what a call past it does (docs/guides/caches.md, "A layer
cache's capacity"); shared by :mod:`jax_sparse_attn.flax` and :mod:`jax_sparse_attn.deepseek`.

A cache made by ``init_cache(batch_size, max_len)`` holds ``max_len`` tokens per sequence, its
capacity. A call whose lengths are known (eager) and that would take a sequence past it raises
:class:`CacheOverflowError` before anything is written. Under ``jit`` the lengths are traced: the
tokens past the capacity write nothing and get NaN outputs, and ``length`` still counts them, so
``length > capacity`` records the overflow for :func:`check_cache`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

# Sequences named in an error message; the rest are counted.
_NAMED = 4


class CacheOverflowError(ValueError):
    """A call would write past a layer cache's capacity (``max_len`` tokens per sequence), or a
    jitted one did (:func:`check_cache`). A ``ValueError``; the message names the capacity, the
    sequences' lengths and the tokens."""


def concrete(value) -> Optional[np.ndarray]:
    """``value`` as a numpy array when it is known now (an eager call), None when it is traced
    (under ``jit``, ``vmap``, ...)."""
    try:
        return np.asarray(value)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _listed(parts: list) -> str:
    more = len(parts) - _NAMED
    return "; ".join(parts[:_NAMED]) + (f"; and {more} more" if more > 0 else "")


def _overflow(what: str, capacity, sequences: list, outcome: str) -> CacheOverflowError:
    """The one form of both overflow messages: what happened, the capacity, the sequences past
    it, what became of their tokens, and the remedy."""
    return CacheOverflowError(
        f"{what} capacity of {int(capacity)} tokens per sequence (init_cache's max_len): "
        + _listed(sequences) + f". {outcome}; make the cache with a larger max_len.")


def refuse_overflow(context: str, capacity, length, s: int, num_tokens=None) -> None:
    """Raises :class:`CacheOverflowError` (its message starting with ``context``) when a call of
    ``s`` tokens per sequence (``num_tokens [B]`` of them real, clipped to ``[0, s]``; all without
    it) would take a sequence of ``length [B]`` past ``capacity`` (an int or ``[B]``). Does
    nothing when any of them is traced: the call then follows the rule under ``jit``."""
    capacity, length = concrete(capacity), concrete(length)
    count = np.full(np.shape(length), s) if num_tokens is None else concrete(num_tokens)
    if capacity is None or length is None or count is None:
        return
    count = np.clip(count, 0, s)
    capacity = np.broadcast_to(capacity, length.shape)
    over = np.flatnonzero((count > 0) & (length.astype(np.int64) + count > capacity))
    if over.size:
        raise _overflow(
            f"{context}: the call would write past the cache's", capacity[over[0]],
            [f"sequence {b} holds {int(length[b])} and the call brings {int(count[b])} "
             f"(to {int(length[b]) + int(count[b])})" for b in over], "Nothing was written")


def nan_past_capacity(y: jax.Array, positions: jax.Array, capacity) -> jax.Array:
    """``y [B, s, ...]`` with NaN for the tokens at ``positions [B, s]`` at or past ``capacity``
    (an int or ``[B]``): their rows were not written, and a finite output would be a wrong one."""
    capacity = jnp.asarray(capacity)
    past = positions >= (capacity[:, None] if capacity.ndim == 1 else capacity)
    return jnp.where(past.reshape(past.shape + (1,) * (y.ndim - 2)), jnp.asarray(jnp.nan, y.dtype), y)


def check_cache(cache) -> None:
    """Raises :class:`CacheOverflowError` if a call went past the cache's capacity.

    ``cache``: a :class:`~jax_sparse_attn.deepseek.V4Cache`,
    :class:`~jax_sparse_attn.deepseek.V32Cache` or :class:`~jax_sparse_attn.flax.SparseAttentionCache`
    (any value with ``length [B]`` and ``capacity``, an int or ``[B]``). A sequence has gone past it
    when ``length > capacity``: a jitted call gave it more tokens than its ``max_len``, and those
    tokens' outputs were NaN and nothing of them was written (an eager call raises instead).

    Eagerly (a cache a jitted step returned) it raises at once. Traced, it is a ``checkify``
    check: call it inside a function wrapped in ``jax.experimental.checkify.checkify`` and the
    returned error's ``throw()`` raises with the same message (without ``checkify``, tracing it
    is an error).
    """
    length, capacity = cache.length, cache.capacity
    got_length, got_capacity = concrete(length), concrete(capacity)
    if got_length is None or got_capacity is None:
        from jax.experimental import checkify

        capacity = jnp.broadcast_to(jnp.asarray(capacity, jnp.int32), length.shape)
        checkify.check(jnp.all(length <= capacity),
                       "the cache went past its capacity (init_cache's max_len): lengths {length}, "
                       "capacity {capacity}; the tokens past it got NaN outputs and were not written",
                       length=length, capacity=capacity)
        return
    got_capacity = np.broadcast_to(got_capacity, got_length.shape)
    over = np.flatnonzero(got_length > got_capacity)
    if over.size:
        raise _overflow(
            "the cache went past its", got_capacity[over[0]],
            [f"sequence {b} was given {int(got_length[b])} tokens, "
             f"{int(got_length[b] - got_capacity[b])} past it" for b in over],
            "Those tokens got NaN outputs and nothing of them was written")
