"""vmap helpers shared by the package's primitives (the attention ops and the indexer)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def to_front(x, dim, size: int):
    """``x`` with its batch axis ``dim`` moved to 0, or, unbatched (``dim`` None), broadcast to
    ``size`` copies along a new axis 0."""
    if dim is None:
        return jnp.broadcast_to(x, (size,) + x.shape)
    return jnp.moveaxis(x, dim, 0)


def fold(x):
    """``x [A, B, ...]`` as ``[A B, ...]`` (a reshape: no copy)."""
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def map_over_batch(prim, args, dims, params):
    """The vmap of ``prim`` as one bind per batch element, in a loop (``lax.map``): for operands
    that no rule folds into one call. Results come back with the batch axis at 0."""
    batched = [i for i, d in enumerate(dims) if d is not None]

    def one(slices):
        full = list(args)
        for i, s in zip(batched, slices):
            full[i] = s
        return prim.bind(*full, **params)

    out = jax.lax.map(one, [jnp.moveaxis(args[i], dims[i], 0) for i in batched])
    return (out, [0] * len(out)) if prim.multiple_results else (out, 0)
