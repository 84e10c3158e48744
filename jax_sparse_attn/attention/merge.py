"""Exact merging of partial attention results by their log-sum-exp.

Attention over a set of slots ``S`` split into disjoint parts ``S_1 .. S_N`` is recovered from each
part's output ``o_i`` and log-sum-exp ``l_i = log sum_{j in S_i} exp(s_j)``::

    l = log sum_i exp(l_i)          o = sum_i exp(l_i - l) o_i

This is how a long cache split over devices (or a sparse and a sliding-window part) is combined.
A sink joins the denominator once: give it as one more part with output 0 and lse ``sink``.
"""

from __future__ import annotations

from typing import Sequence, Union

import jax
import jax.numpy as jnp

ArrayLike = jax.typing.ArrayLike


def _stack(parts, name: str):
    if isinstance(parts, (list, tuple)):
        if not parts:
            raise ValueError(f"{name}: at least one partial result is needed")
        return jnp.stack([jnp.asarray(p) for p in parts])
    return jnp.asarray(parts)


def merge_attention(
    outs: Union[ArrayLike, Sequence[ArrayLike]],
    lses: Union[ArrayLike, Sequence[ArrayLike]],
) -> tuple[jax.Array, jax.Array]:
    """Combines partial attention results into the attention over the union of their slots.

    Each partial ``i`` is attention over its own set of slots, as returned by
    ``gathered_attn(..., return_lse=True)`` or ``gathered_attn_idx(..., return_lse=True)``: an
    output ``outs[i]`` and ``lses[i] = log(sum over its slots of exp(logit))``. The slot sets
    must be disjoint (a slot in two partials counts twice, like a duplicated index). The result
    is the output and lse of attention over all the slots::

        lse = log(sum_i exp(lses[i]))        out = sum_i exp(lses[i] - lse) * outs[i]

    A sink must enter exactly one partial: either compute one partial with the sink and the
    others without (``sink=None``), or add the sink as a partial of its own with output 0 and
    lse ``sink`` broadcast to ``[T, H]``.

    Edge rules: a partial with lse ``-inf`` (no valid slot, no sink) contributes nothing; if every
    partial's lse is ``-inf`` the output is 0 and the lse ``-inf``; an lse of ``+inf`` (a ``+inf``
    sink) gives output 0 and lse ``+inf``, as the op does. No NaN arises from these, in the values
    or in the gradients. Differentiable in both arguments; works under ``jit`` and ``vmap``.

    Args:
      outs: ``[N, T, H, D]`` float, or a sequence of N ``[T, H, D]`` arrays (any float dtype;
        more generally ``[N, ..., D]``).
      lses: ``[N, T, H]`` (``[N, ...]``) float, or a sequence of N ``[T, H]`` arrays.

    Returns:
      ``(out, lse)``: ``out [T, H, D]`` in the dtype of ``outs``, ``lse [T, H]`` f32. The weighted
      sum is accumulated in f32 and rounded once.
    """
    outs = _stack(outs, "outs")
    lses = _stack(lses, "lses")
    if not jnp.issubdtype(outs.dtype, jnp.floating) or not jnp.issubdtype(lses.dtype, jnp.floating):
        raise TypeError(f"outs and lses must be floating; got {outs.dtype} and {lses.dtype}")
    if outs.ndim < 2 or lses.shape != outs.shape[:-1]:
        raise ValueError(
            f"lses must have the shape of outs without its last axis: outs {outs.shape} gives "
            f"{outs.shape[:-1]}, lses has {lses.shape}"
        )
    lses = lses.astype(jnp.float32)
    # The max is only a stabiliser (the result does not depend on it), so it carries no gradient.
    top = jax.lax.stop_gradient(jnp.max(lses, axis=0))
    finite = jnp.isfinite(top)
    # Non-finite top (all -inf, or a +inf part): every weight is sent to 0 before the exp, so no
    # inf - inf appears in the values or in the gradients; the result is selected below.
    shifted = jnp.where(finite, lses - jnp.where(finite, top, 0.0), -jnp.inf)
    weights = jnp.exp(shifted)  # [N, ...], the largest is 1 when top is finite
    total = jnp.sum(weights, axis=0)
    total = jnp.where(finite, total, 1.0)  # >= 1 where finite
    lse = jnp.where(finite, top + jnp.log(total), top)
    combined = jnp.sum((weights / total)[..., None] * outs.astype(jnp.float32), axis=0)
    out = jnp.where(finite[..., None], combined, 0.0).astype(outs.dtype)
    return out, lse
