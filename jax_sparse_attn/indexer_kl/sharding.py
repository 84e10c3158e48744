"""``indexer_kl``'s primitives under multi-device jit (docs/sharding.md, "The indexer's KL").

The factors that may be split are read off ``q [S, T, H, D]``'s sharding, as for the other ops
(:mod:`jax_sparse_attn.sharding`): tokens ``t`` and the teacher's heads ``h``; everything else
(sequences, rows, the indexer's heads, widths, slots) is whole on each device.

- **Tokens split.** A token's KL reads its own queries, weights, position, slots and lse_extra
  and all the rows, so each device runs the reference on its block of tokens. The gradient of
  ``index_keys`` (a sum over tokens) takes one ``psum``.
- **Heads split.** Each device holds its heads of ``q`` and ``lse_extra``. Each head's log-sum-exp
  is its own; the head sums, the teacher's ``sum_h a_h(j)`` per block of candidates and its
  normaliser ``N``, are ``psum``-ed over the head axes inside the passes, before anything is
  normalised by them (``reference.head_sum``). The student (its heads whole) and everything after
  the head sums is then the same on each of those devices: the results come from the first device
  along the head axes (the others give zeros to the ``psum`` that assembles them), so nothing is
  counted twice.

Each device runs ``make_local(...)``: under ``jax.shard_map`` for Explicit mesh axes, under a
``custom_partitioning`` (``_Partitioner``, which tells the device's function its axes) for Auto
ones, and as it is inside a user's ``shard_map``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import sharding as shared
from ..cache_sharding import _shard_index

Q_LAYOUT = "s t h d"
# The primitives' operands (primitive.OPERANDS) and results, one letter per dimension: ``s``
# sequences, ``t`` tokens, ``h`` heads, ``d`` and ``e`` widths, ``r`` rows, ``i`` index heads,
# ``k`` slots.
OPERAND_LAYOUTS = ("s t h d", "s r d", "s t i e", "s t i", "s r e", "s r", "s t", "s t k", "s t h",
                   "s")
STUDENT_LAYOUTS = ("s t i e", "s t i", "s r e")
RESIDUAL_LAYOUTS = ("s t",) + STUDENT_LAYOUTS
VALUE_RESULTS = ("s t", "s t")
FUSED_RESULTS = VALUE_RESULTS + RESIDUAL_LAYOUTS
NO_AXES = {"t": (), "h": ()}


def first_along(axes: tuple, mesh_shape: dict, results):
    """``results`` on the first device along ``axes``, zeros on the others (selected, so a NaN
    stays where it was): the ``psum`` over ``axes`` that follows then counts each once."""
    if not axes:
        return results
    first = _shard_index(axes, mesh_shape) == 0
    return tuple(jnp.where(first, r, jnp.zeros((), r.dtype)) for r in results)


class _Partitioner(shared._Partitioner):
    """The shared custom partitioning, with each device's function made for the axes that the
    partition callback chose (``make_local(axes, mesh_shape)``)."""

    def __init__(self, fn, operand_layouts, result_layouts, q_layout, *, make_local, count):
        super().__init__(fn, operand_layouts, result_layouts, q_layout)
        self.make_local, self.count = make_local, count

    def partition(self, mesh, arg_shapes, result_shape):
        mesh = self._mesh(mesh, arg_shapes)
        local = self.make_local(self._factor_axes(mesh, arg_shapes), dict(mesh.shape))
        self.fn = lambda *args: local(*args[:self.count])  # the constants after them unused
        return super().partition(mesh, arg_shapes, result_shape)


def run(make_local, operands, operand_layouts, result_layouts):
    """The primitive's results on each device's block (the module docstring). ``operands[0]`` is
    ``q``; ``make_local(axes, mesh_shape)`` returns the function of one device's operands (axes:
    the mesh axes of ``t`` and ``h``, empty on one device)."""
    q = jax.typeof(operands[0])
    if shared._in_manual_region(q):
        return tuple(make_local(NO_AXES, {})(*operands))  # a user's shard_map: blocks given
    if shared._has_explicit_axes(q):
        axes = shared._explicit_factor_axes(q, Q_LAYOUT)
        if any(axes.values()):
            mesh = q.sharding.mesh
            used = [a for names in axes.values() for a in names]
            return shared._run_under_shard_map(make_local(axes, dict(mesh.shape)), operands,
                                               operand_layouts, result_layouts, axes, mesh, used)
    partitioner = _partitioner_type(make_local, len(operands))
    wrapped = shared.shard_local(make_local(NO_AXES, {}), operand_layouts, result_layouts,
                                 partitioner, q_layout=Q_LAYOUT)
    return tuple(wrapped(*operands))


def _partitioner_type(make_local, count):
    def build(fn, operand_layouts, result_layouts, q_layout):
        return _Partitioner(fn, operand_layouts, result_layouts, q_layout, make_local=make_local,
                            count=count)
    return build


def token_aval(q_aval, dtype=jnp.float32):
    """``[S, T]``: split like q's sequences and tokens (Explicit axes; a shape elsewhere)."""
    return shared.result_aval(q_aval, q_aval.shape[:2], dtype, "t h")


def student_avals(q_aval, index_q, weights, index_keys, dtypes):
    """The student operands' cotangents (or residuals): their shapes, ``dtypes``, split like q's
    sequences and (index_q's, the weights') tokens, the rest whole."""
    return [shared.result_aval(q_aval, a.shape, d, layout) for a, d, layout in
            zip((index_q, weights, index_keys), dtypes, ("t h i e", "t h i", "t r e"))]
