"""Argument checks shared by the public functions of both ops (attention and indexer): arrays
from Python lists, ranks and dtypes named in the errors, and the ``implementation`` choice."""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from .attention import primitive
from .constants import FLT_MAX

ArrayLike = jax.typing.ArrayLike
Scale = Union[float, ArrayLike, None]


def shape_of(x) -> tuple:
    return tuple(np.shape(x))


def dtype_of(x):
    return jax.dtypes.result_type(x) if not hasattr(x, "dtype") else np.dtype(x.dtype)


def as_array(name: str, x):
    """Python lists and tuples become arrays (numpy, so that integer indices keep their full width
    until ``_normalise_idx``); anything that cannot become a numeric array raises a TypeError that
    names the argument. Arrays and scalars pass through unchanged."""
    if not isinstance(x, (list, tuple)):
        return x
    try:
        arr = np.asarray(x)
    except Exception:  # e.g. a list of traced arrays, or a ragged list
        try:
            arr = jnp.asarray(x)
        except Exception as err:
            raise TypeError(f"{name} must be an array; got a {type(x).__name__} that is not one: {err}")
    if arr.dtype.kind not in "biuf":
        raise TypeError(
            f"{name} must be an array of numbers; got a {type(x).__name__} of dtype {arr.dtype}"
        )
    return arr


def host_rows_or_empty(idx: np.ndarray, rows: int) -> np.ndarray:
    """Host indices of any integer dtype -> int32, with each one outside ``[0, rows)`` set to -1.

    Decided at the index's own width, before JAX would narrow an int64 to int32 (which wraps
    ``2**32 + 5`` into the valid row 5 when x64 is off); written without a -1 of the index's own
    dtype, which NumPy 2.5 refuses for unsigned indices (OverflowError).
    """
    out = np.full(np.shape(idx), -1, np.int32)
    valid = (idx >= 0) & (idx < rows)
    out[valid] = idx[valid]
    return out


def check_rank(name: str, x, rank: int, layout: str) -> None:
    if np.ndim(x) != rank:
        raise ValueError(f"{name} must have rank {rank} ({layout}); got shape {shape_of(x)}")


def check_float(name: str, x) -> None:
    if not jnp.issubdtype(dtype_of(x), jnp.floating):
        raise TypeError(f"{name} must be a floating dtype (bf16, f16 or f32); got {dtype_of(x)}")


def check_integer(name: str, x) -> None:
    if not jnp.issubdtype(dtype_of(x), jnp.integer):
        raise TypeError(f"{name} must have an integer dtype; got {dtype_of(x)}")


def check_implementation(implementation: Optional[str]) -> None:
    if implementation is None or implementation == "reference":
        return
    if implementation not in primitive.IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of None, 'reference', 'nki', 'nki_emulated'; "
            f"got {implementation!r}"
        )
    from . import neuron

    neuron.check_implementation_available(implementation)


def check_scale(scale, default: float):
    """A real scalar softmax or score scale (``default`` for None) as f32, clamped to
    ``+-FLT_MAX`` (an infinite scale saturates); strings, arrays of other shapes and non-numbers
    raise errors that name ``scale``."""
    if scale is None:
        scale = default
    if isinstance(scale, (str, bytes)) or not (
        isinstance(scale, (int, float, np.number))
        or (hasattr(scale, "dtype") and np.dtype(scale.dtype).kind in "biuf")
    ):
        kind = getattr(scale, "dtype", type(scale).__name__)
        raise TypeError(f"scale must be a real number (cast to f32); got {kind!s}: {scale!r:.40}")
    if shape_of(scale) != ():
        raise ValueError(f"scale must be a scalar; got shape {shape_of(scale)}")
    return jnp.clip(jnp.asarray(scale, jnp.float32), -FLT_MAX, FLT_MAX)
