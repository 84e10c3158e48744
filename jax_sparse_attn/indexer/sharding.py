"""The indexer under multi-device jit (docs/indexer.md, "Transforms and sharding").

- **Tokens split.** A token's selection reads only its own queries, weights and position and the
  whole cache, so each device runs the reference (or the kernel) on its block of tokens with the
  keys replicated, with no collective: the shared machinery of :mod:`jax_sparse_attn.sharding`,
  with the indexer heads ``j`` never split (they are summed inside a score).
- **Keys split over their rows** (``PartitionSpec("y")`` on ``keys`` and ``key_scale``): each
  device selects among its own rows, numbered globally (its positions shifted by its first row),
  then one ``all_gather`` of the ``[T, topk]`` candidates (order keys and rows) and an exact cut to
  the best ``topk`` give every device the global selection, bit for bit: the union of the devices'
  top-k holds the global top-k, and device order is row order, so ties still go to the lower row.
  No collective carries R-sized data. The row machinery is the attention cache's
  (:mod:`jax_sparse_attn.cache_sharding`).
- **Sequences split** (the primitive's leading axis, more than one sequence under vmap): each
  device selects for its own sequences, with no collective.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .. import cache_sharding
from .. import sharding as shared_sharding
from ..attention.reference import per_platform
from . import reference

# Operand and result layouts: ``t`` tokens, ``j`` indexer heads (never split), ``d`` the key
# width, ``r`` cache rows, ``k`` the selected slots.
LAYOUTS = {
    "q": "t j d",
    "weights": "t j",
    "keys": "r d",
    "key_scale": "r",
    "positions": "t",
    "idx": "t k",
    "scores": "t k",
}
OPERAND_LAYOUTS = [LAYOUTS[n] for n in ("q", "weights", "keys", "key_scale", "positions")]
RESULT_LAYOUTS = [LAYOUTS["idx"], LAYOUTS["scores"]]
ROW_OPERANDS = (2, 3)  # keys, key_scale


def merge_candidates(idx, scores, topk: int):
    """The best ``topk`` of candidate lists ``[T, n]`` (rows ascending among equal scores in
    list order) by the indexer's ranking: ``(idx [T, topk], scores [T, topk])``. On CPU by the
    reference's sort (``best_first``); elsewhere by ``lax.top_k`` on the order keys, which puts
    equal keys in list order (few large steps: a GPU syncs on each of the sort's loops)."""
    keys = jnp.where(idx >= 0, reference.order_keys(scores), reference.INVALID_KEY)
    keys, rows = per_platform(
        lambda k, i: reference.best_first(jnp.stack([k, i], axis=-1), topk),
        lambda k, i: best_by_top_k(k, i, topk), keys, idx)
    return jnp.where(keys == reference.INVALID_KEY, -1, rows), reference.scores_of_keys(keys)


def best_by_top_k(keys, rows, topk: int):
    """``reference.best_first``'s result for order keys and rows ``[T, n]`` (``n >= topk``) by
    ``lax.top_k``, which puts equal keys in index order (JAX's documentation)."""
    best, at = jax.lax.top_k(keys, topk)
    return best, jnp.take_along_axis(rows, at, axis=1)


def positions_from_row(positions, first, compress_ratio: int):
    """Positions for the cache's rows from row ``first`` on, numbered from 0: local row ``r`` is
    valid at the result iff row ``first + r`` is valid at ``positions`` (-1, nothing, for a token
    before them). ``positions`` int32 ``[T]`` (or any shape), ``first`` an int32 broadcasting
    against it."""
    # (first + r + 1) * ratio <= p + 1  <=>  (r + 1) * ratio <= p - first * ratio + 1.
    return jnp.where(positions // compress_ratio < first, -1, positions - first * compress_ratio)


def _rows_local(compress_ratio: int, topk: int):
    def make_local(fn, axes, mesh_shape):
        def local(q, weights, keys, key_scale, positions, *extra):
            first = cache_sharding._shard_index(axes, mesh_shape) * keys.shape[0]
            shifted = positions_from_row(positions, first, compress_ratio)
            idx, scores = fn(q, weights, keys, key_scale, shifted, *extra)[:2]
            idx = jnp.where(idx >= 0, idx + first, -1)
            all_idx = jax.lax.all_gather(idx, axes, axis=1, tiled=True)  # [T, n * topk]
            all_scores = jax.lax.all_gather(scores, axes, axis=1, tiled=True)
            return merge_candidates(all_idx, all_scores, topk)

        return local

    return make_local


def run_over_sequences(one, each, *operands, host_callbacks: bool = False):
    """The call over a batch of sequences with their own caches (the primitive's operands, a
    leading axis of S > 1 sequences): ``each`` of those operands, ``one`` of a single sequence's.
    With the batch split over the mesh, each device selects for its own sequences, with no
    collective (a sequence's tokens and rows are on one device):

    - Explicit axes: under ``shard_map`` (the reference's loop over sequences cannot take a split
      axis);
    - Auto axes: a custom partitioning (``_SequencePartitioner``), unless the call runs Python on
      the host (the emulated kernel), which custom_partitioning cannot hold: then, as inside a
      user's ``shard_map``, the plain program.
    """
    keys = jax.typeof(operands[2])
    explicit = shared_sharding._explicit_axis_names(keys)
    manual = shared_sharding._in_manual_region(keys)
    local = _on_local_sequences(one, each)
    if not explicit and not manual and not host_callbacks:
        run = shared_sharding.shard_local(local, SEQUENCE_LAYOUTS, SEQUENCE_RESULT_LAYOUTS,
                                          _SequencePartitioner, q_layout=SEQUENCE_LAYOUTS[0])
        return tuple(run(*operands))
    spec = tuple(getattr(keys.sharding, "spec", ())) if explicit else ()
    axes = shared_sharding._mesh_axes(spec[0]) if spec else ()
    if not axes or not set(axes) <= explicit or manual:
        return tuple(each(*operands))
    mesh = keys.sharding.mesh
    split = PartitionSpec(shared_sharding._spec_entry(axes))
    operands = [_leading_split(x, mesh, split) for x in operands]
    return tuple(jax.shard_map(local, mesh=mesh, in_specs=(split,) * 5, out_specs=(split, split),
                               axis_names=set(axes), check_vma=False)(*operands))


def split_like_batch(x, batched):
    """``x`` (broadcast to a vmap's batch) with its leading axis split like ``batched``'s under
    Explicit mesh axes, unchanged elsewhere: vmap needs every batch axis split alike, and each
    device then runs its own sequences (``run_over_sequences``)."""
    like = jax.typeof(batched)
    if not shared_sharding._explicit_axis_names(like):
        return x
    spec = tuple(like.sharding.spec)
    return _leading_split(x, like.sharding.mesh, PartitionSpec(spec[0] if spec else None))


def _leading_split(x, mesh, split: PartitionSpec):
    """``x`` resharded so that its leading axis is split as ``split`` says (Explicit axes)."""
    if tuple(jax.typeof(x).sharding.spec)[:1] == tuple(split):
        return x
    return jax.sharding.reshard(x, NamedSharding(mesh, split))


# The primitive's operands and results: ``t`` here is the sequences (the one factor that may be
# split), ``u`` each sequence's tokens; heads, widths, rows and slots whole.
SEQUENCE_LAYOUTS = ("t u j d", "t u j", "t r d", "t r", "t u")
SEQUENCE_RESULT_LAYOUTS = ("t u k", "t u k")


def result_aval(q_aval, shape, dtype):
    """The abstract value of a result ``[S, T, topk]``: q's mesh, its sequences' and tokens'
    split, the slots whole (sharding-in-types with Explicit axes; a plain shape elsewhere)."""
    sharding = getattr(q_aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return jax.core.ShapedArray(shape, dtype)
    spec = tuple(spec) + (None,) * 2
    out = NamedSharding(sharding.mesh, PartitionSpec(spec[0], spec[1], None))
    return q_aval.update(shape=tuple(shape), dtype=np.dtype(dtype), weak_type=False, sharding=out)


def _on_local_sequences(one, each):
    """The call on one device's sequences: as many as its block of caches holds."""
    def fn(*operands):
        if operands[2].shape[0] == 1:  # one sequence: its cache as a single one
            return tuple(o[None] for o in one(*(x[0] for x in operands)))
        return tuple(each(*operands))
    return fn


class _SequencePartitioner(shared_sharding._Partitioner):
    """custom_partitioning of a call over a batch of caches (Auto mesh axes): the sequences split
    like the caches' leading axis when its devices divide them, each device selecting for its
    own; else the call runs whole on each device."""

    def _factor_axes(self, mesh, arg_shapes) -> dict:
        sharding = arg_shapes[2].sharding
        axes = ()
        if isinstance(sharding, NamedSharding) and len(sharding.spec):
            axes = shared_sharding._mesh_axes(sharding.spec[0])
            if arg_shapes[2].shape[0] % math.prod(mesh.shape[a] for a in axes):
                axes = ()
        return {"t": axes, "h": ()}


def run_shard_local(fn, topk: int, compress_ratio: int, *operands):
    """``fn(*operands)`` on each device's block of tokens (and of key rows, when the keys are
    split over their rows); returns ``(idx, scores)``."""
    run = cache_sharding.shard_local_rows(
        lambda *a: tuple(fn(*a)), OPERAND_LAYOUTS, RESULT_LAYOUTS, row_operands=ROW_OPERANDS,
        make_local=_rows_local(compress_ratio, topk), q_layout=LAYOUTS["q"],
    )
    return tuple(run(*operands))
