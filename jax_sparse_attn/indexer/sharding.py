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
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
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


def run_over_sequences(path_for, sequences: int, *operands, host_callbacks: bool = False):
    """The call over a vmap's batch of caches (``sequences`` of them: keys ``[S, R, Di]``; the
    primitive's docstring). ``path_for(s)`` is the function for ``s`` sequences. With the batch
    split over the mesh, each device selects for its own sequences, with no collective (a
    sequence's tokens and rows are on one device):

    - Explicit axes: under ``shard_map`` (the reference's loop over sequences cannot take a split
      axis);
    - Auto axes: a custom partitioning (``_SequencePartitioner``), unless ``path_for`` calls back
      into Python (the emulated kernel), which custom_partitioning cannot hold: then, as inside a
      user's ``shard_map``, the plain program.
    """
    keys = jax.typeof(operands[2])
    explicit = shared_sharding._explicit_axis_names(keys)
    manual = shared_sharding._in_manual_region(keys)
    if not explicit and not manual and not host_callbacks:
        return _auto_over_sequences(path_for, sequences, operands)
    spec = tuple(getattr(keys.sharding, "spec", ())) if explicit else ()
    axes = shared_sharding._mesh_axes(spec[0]) if spec else ()
    if not axes or not set(axes) <= explicit or manual:
        return tuple(path_for(sequences)(*operands))
    mesh = keys.sharding.mesh
    split = PartitionSpec(shared_sharding._spec_entry(axes))
    operands = [_leading_split(x, mesh, split) for x in operands]
    return tuple(jax.shard_map(_on_local_sequences(path_for), mesh=mesh, in_specs=(split,) * 5,
                               out_specs=(split, split), axis_names=set(axes),
                               check_vma=False)(*operands))


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


# A call over a batch of caches: the sequences ("t" here: whole sequences' tokens, and the caches'
# leading axis) split alike; heads, widths, rows and slots whole.
SEQUENCE_LAYOUTS = ("t j d", "t j", "t r d", "t r", "t")
SEQUENCE_RULE = ("(s u) j d", "(s u) j", "s r d", "s r", "(s u)")


def _on_local_sequences(path_for):
    """The call on one device's sequences: as many as its block of caches holds."""
    def fn(q, weights, keys, key_scale, positions):
        local = keys.shape[0]
        if local == 1:  # one sequence: its cache as a single one
            keys, key_scale = keys[0], key_scale[0]
        return tuple(path_for(local)(q, weights, keys, key_scale, positions))
    return fn


class _SequencePartitioner(shared_sharding._Partitioner):
    """custom_partitioning of a call over a batch of caches (Auto mesh axes): the sequences split
    like the caches' leading axis when its devices divide them, each device selecting for its
    own; else the call runs whole on each device. The Shardy rule ties the tokens ``(s u)`` (S
    sequences of u tokens) to the caches' ``s``."""

    def __init__(self, *args, sequences: int, tokens: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.sequences, self.tokens = sequences, tokens  # S, and u tokens per sequence

    def _factor_axes(self, mesh, arg_shapes) -> dict:
        sharding = arg_shapes[2].sharding
        axes = ()
        if isinstance(sharding, NamedSharding) and len(sharding.spec):
            axes = shared_sharding._mesh_axes(sharding.spec[0])
            if self.sequences % math.prod(mesh.shape[a] for a in axes):
                axes = ()
        return {"t": axes, "h": ()}

    def sharding_rule(self):
        # The five operands, then the constants shard_local passes after them (c0, c1, ...).
        # One token per sequence (a decode step): the tokens are the sequences (Shardy refuses a
        # compound factor of size 1).
        tokens = "(s u)" if self.tokens > 1 else "s"
        operands = [lay.replace("(s u)", tokens) for lay in SEQUENCE_RULE]
        operands += self.operand_layouts[len(SEQUENCE_RULE):]
        rule = ", ".join(operands) + " -> " + ", ".join(f"{tokens} k" for _ in self.result_layouts)
        replicated = tuple(dict.fromkeys(
            f for lay in operands + ["k"] for f in lay.replace("(", " ").replace(")", " ").split()
            if f != "s"))
        sizes = {"u": self.tokens} if self.tokens > 1 else {}
        if "need_replication_factors" not in shared_sharding._DEF_PARTITION_KWARGS:  # JAX 0.7
            from jax._src.custom_partitioning_sharding_rule import str_to_sdy_sharding_rule

            return str_to_sdy_sharding_rule(rule, **sizes), {}
        return rule, {"need_replication_factors": replicated, **sizes}


def _auto_over_sequences(path_for, sequences, operands):
    partitioner = functools.partial(_SequencePartitioner, sequences=sequences,
                                    tokens=operands[0].shape[0] // sequences)
    run = shared_sharding.shard_local(_on_local_sequences(path_for), SEQUENCE_LAYOUTS,
                                      RESULT_LAYOUTS, partitioner, q_layout=LAYOUTS["q"])
    return tuple(run(*operands))


def run_shard_local(fn, topk: int, compress_ratio: int, *operands):
    """``fn(*operands)`` on each device's block of tokens (and of key rows, when the keys are
    split over their rows); returns ``(idx, scores)``."""
    run = cache_sharding.shard_local_rows(
        lambda *a: tuple(fn(*a)), OPERAND_LAYOUTS, RESULT_LAYOUTS, row_operands=ROW_OPERANDS,
        make_local=_rows_local(compress_ratio, topk), q_layout=LAYOUTS["q"],
    )
    return tuple(run(*operands))
