"""``compress_pool``: argument checks and the primitive bind (docs/compress.md)."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from ..checks import as_array, check_float, check_implementation, shape_of
from . import primitive

ArrayLike = jax.typing.ArrayLike


def _check_implementation(implementation) -> None:
    """None, "reference", "nki" or "nki_emulated" (the shared check: "nki" needs the Neuron SDK,
    a RuntimeError saying what to install otherwise)."""
    check_implementation(implementation)


def _check_array(name: str, x):
    if isinstance(x, (str, bytes)):
        raise TypeError(f"{name} must be an array; got a {type(x).__name__}")
    x = as_array(name, x)
    check_float(name, x)
    return x


def compress_pool(
    kv: ArrayLike,
    score: ArrayLike,
    ape: ArrayLike,
    *,
    overlap: bool = False,
    prev_kv: Optional[ArrayLike] = None,
    prev_score: Optional[ArrayLike] = None,
    implementation: Optional[str] = None,
) -> jax.Array:
    """DeepSeek V4's compressor pooling: each block of ``r`` tokens becomes one row, a per-channel
    softmax over the block's gate scores weighting its kv rows.

    With ``r = ape.shape[0]`` and ``N = T // r`` whole blocks (the ``T % r`` trailing rows are
    never read, whatever they hold), without overlap, for block ``j`` and channel ``c``::

        out[j, c] = sum_{i < r} softmax_i(score[j r + i, c] + ape[i, c]) * kv[j r + i, c]

    With ``overlap`` (DeepSeek's ratio-4 compressor; ``C = 2 d``) output channel ``c < d`` pools
    ``2 r`` rows in one softmax: block ``j - 1``'s rows on channel ``c``, then block ``j``'s own on
    channel ``d + c`` (ape's row ``i`` added to row ``i`` of either block). Block 0's previous rows
    are ``prev_kv`` and ``prev_score`` (raw scores: ape is added to them too), or none.

    Computed in f32 with a fixed order of operations: the arithmetic, and the rules for ``-inf``
    (a masked row; a block of them gives 0), ``+inf`` (as ``FLT_MAX``) and NaN (only its own
    block's channel) are in ``docs/compress.md``, "Contract".

    Args:
      kv: ``[..., T, C]`` float (bf16, f16, f32...), the rows to pool; ``...`` are batch dims.
      score: ``[..., T, C]`` float, their gate scores (kv's shape).
      ape: ``[r, C]`` float, the learned per-position bias; ``r >= 1`` is the compression ratio.
      overlap: static bool, pool each block with the one before it (C must be even).
      prev_kv: ``[..., r, C]`` float or None, the block before block 0 (only with ``overlap``).
      prev_score: ``[..., r, C]`` float or None, its raw scores (given with ``prev_kv``).
      implementation: None (the NKI kernel on Neuron, the jnp reference elsewhere),
        ``"reference"`` (the jnp reference everywhere), ``"nki"`` (the NKI kernel: Neuron SDK
        needed) or ``"nki_emulated"`` (the kernel source under the project's NKI emulator, on the
        host; docs/compress-kernel.md).

    Returns:
      ``[..., T // r, C]`` f32, or ``[..., T // r, C // 2]`` with ``overlap``. Differentiable with
      respect to kv, score, ape, prev_kv and prev_score.
    """
    _check_implementation(implementation)
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool (static); got {type(overlap).__name__}")
    kv = _check_array("kv", kv)
    score = _check_array("score", score)
    ape = _check_array("ape", ape)
    if len(shape_of(kv)) < 2:
        raise ValueError(f"kv must have rank 2 or more ([..., T, C]); got shape {shape_of(kv)}")
    if shape_of(score) != shape_of(kv):
        raise ValueError(f"score must have kv's shape [..., T, C] = {shape_of(kv)}; got "
                         f"{shape_of(score)}")
    *lead, T, C = shape_of(kv)
    if len(shape_of(ape)) != 2:
        raise ValueError(f"ape must have rank 2 ([ratio, C]); got shape {shape_of(ape)}")
    ratio = shape_of(ape)[0]
    if ratio < 1:
        raise ValueError(f"ape must have at least one row: its rows are the compression ratio "
                         f"(ratio >= 1); got shape {shape_of(ape)}")
    if shape_of(ape)[1] != C:
        raise ValueError(f"ape must have shape [ratio, C] = ({ratio}, {C}) to match kv "
                         f"{shape_of(kv)}; got {shape_of(ape)}")
    if overlap and C % 2:
        raise ValueError(f"overlap=True pools the two halves of kv's channels: C must be even; "
                         f"got kv of shape {shape_of(kv)}")
    given = {n: x for n, x in (("prev_kv", prev_kv), ("prev_score", prev_score)) if x is not None}
    if given and not overlap:
        raise ValueError(f"{' and '.join(given)} only apply with overlap=True (the block before "
                         "block 0 joins block 0's window only then)")
    if len(given) == 1:
        missing = "prev_score" if "prev_kv" in given else "prev_kv"
        raise ValueError(f"{next(iter(given))} needs {missing}: give both or neither")
    prev = []
    for name, x in given.items():
        x = _check_array(name, x)
        want = tuple(lead) + (ratio, C)
        if shape_of(x) != want:
            raise ValueError(f"{name} must have shape [..., ratio, C] = {want} to match kv "
                             f"{shape_of(kv)} and ape {shape_of(ape)}; got {shape_of(x)}")
        prev.append(jnp.asarray(x))
    ape = jnp.broadcast_to(jnp.asarray(ape), tuple(lead) + (ratio, C))
    return primitive.compress_pool_p.bind(jnp.asarray(kv), jnp.asarray(score), ape, *prev,
                                          overlap=overlap, implementation=implementation)
