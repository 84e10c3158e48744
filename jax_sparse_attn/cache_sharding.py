"""A KV cache split over its rows: each device attends to the rows it holds, then a merge by lse.

The forward ``gathered_attn_idx`` runs on each device's row block and the partial results merge
exactly (``merge_attention``); an FP8 cache instead gathers its slots where they live and sums
them over the devices. The cache never moves. The steps, and where rounding may differ from one
device: docs/sharding.md, "A KV cache split over its rows".
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from . import sharding
from .attention.merge import merge_attention

def row_axes(kv_spec, rows: int, mesh_shape: dict, taken: Sequence[str] = ()) -> tuple:
    """The mesh axes that split the cache's rows (PartitionSpec entry 0 of ``kv``), or ``()``
    when there are none, when they do not divide ``rows``, or when one of them is ``taken`` (it
    already splits q's tokens or heads)."""
    spec = tuple(kv_spec or ()) + (None,)
    axes = sharding._mesh_axes(spec[0])
    if not axes or any(a in taken for a in axes):
        return ()
    if rows % math.prod(mesh_shape[a] for a in axes) != 0:
        return ()
    return axes


def _shard_index(axes: tuple, mesh_shape: dict):
    """This device's position along ``axes`` (major to minor, as a PartitionSpec orders them)."""
    index = jnp.int32(0)
    for a in axes:
        index = index * mesh_shape[a] + jax.lax.axis_index(a)
    return index


def _rows_of_shard(idx, axes: tuple, mesh_shape: dict, block: int):
    """This device's shard index, and which slots' rows it holds (``idx`` into the whole cache)."""
    shard = _shard_index(axes, mesh_shape)
    first = shard * block
    return shard, first, (idx >= first) & (idx < first + block)


def row_local(layout) -> Callable:
    """``make_local`` for the attention op on a 16-bit cache split over its rows: ``fn`` (the op
    on the flat operands of ``layout``, returning ``(out, lse)``) runs on this device's row block
    and the partial results are merged over the row axes."""

    def make_local(fn: Callable, axes: tuple, mesh_shape: dict) -> Callable:
        def local(*leaves):
            ops = layout.unflatten(leaves)
            shard, first, mine = _rows_of_shard(ops.idx, axes, mesh_shape, ops.kv.shape[0])
            changes = {"idx": jnp.where(mine, ops.idx - first, jnp.int32(-1)),
                       "sink": jnp.where(shard == 0, ops.sink, -jnp.inf)}
            if ops.extra_kv is not None:  # a second cache, not split: its slots join on shard 0
                changes["extra_idx"] = jnp.where(shard == 0, ops.extra_idx, jnp.int32(-1))
            out, lse = fn(*ops.replace(**changes).tree_flatten()[0])[:2]
            packed = jnp.concatenate([out.astype(jnp.float32), lse[..., None]], axis=-1)
            parts = jax.lax.all_gather(packed, axes, axis=0)  # [n, t, h, D + 1]
            merged, merged_lse = merge_attention(parts[..., :-1], parts[..., -1])
            return merged.astype(ops.q.dtype), merged_lse

        return local

    return make_local


def fp8_row_local(layout) -> Callable:
    """``make_local`` for an FP8 cache split over its rows (with its scales and, in a split
    layout, its ``kv_rope``): the slots' FP8 bytes, scales (and rope columns) gathered where their
    rows live and summed over the devices (one all-reduce each, ``[T, K, D]`` bytes and
    ``[T, K, n]`` f32; no cache row moves), then ``fn`` on them as a cache of ``T * K`` rows, one
    per slot: exactly what one device holding the whole cache computes."""

    def make_local(fn: Callable, axes: tuple, mesh_shape: dict) -> Callable:
        def local(*leaves):
            ops = layout.unflatten(leaves)
            kv, idx = ops.kv, ops.idx
            block = kv.shape[0]
            _, first, mine = _rows_of_shard(idx, axes, mesh_shape, block)
            rows = jnp.where(mine, idx - first, block)  # out of range: filled with 0, not read
            raw = jax.lax.bitcast_convert_type(kv, jnp.uint8).at[rows].get(mode="fill",
                                                                            fill_value=0)
            scales = ops.kv_scale.at[rows].get(mode="fill", fill_value=0)
            raw, scales = jax.lax.psum(raw, axes), jax.lax.psum(scales, axes)  # one term each
            T, K = idx.shape
            changes = {
                "kv": jax.lax.bitcast_convert_type(raw, kv.dtype).reshape(T * K, kv.shape[1]),
                "idx": jnp.where(idx >= 0, jnp.arange(T * K, dtype=jnp.int32).reshape(T, K), -1),
                "kv_scale": scales.reshape(T * K, -1),
            }
            if ops.kv_rope is not None:
                rope = ops.kv_rope
                bits = jax.lax.bitcast_convert_type(rope, jnp.uint16).at[rows].get(
                    mode="fill", fill_value=0)
                rope = jax.lax.bitcast_convert_type(jax.lax.psum(bits, axes), rope.dtype)
                changes["kv_rope"] = rope.reshape(T * K, rope.shape[-1])
            return fn(*ops.replace(**changes).tree_flatten()[0])

        return local

    return make_local


class _RowPartitioner(sharding._Partitioner):
    """Automatic mesh axes: the partition callback keeps the cache split over its rows.

    ``row_operands``: the operands split over the rows (the first one, the cache, decides the
    split); ``make_local(fn, axes, mesh_shape)``: the per-device function that runs ``fn`` on one
    row block and merges the partial results (``row_local`` for the attention op).
    """

    def __init__(self, *args, row_operands: Sequence[int], make_local: Callable, **kwargs):
        super().__init__(*args, **kwargs)
        self.row_operands = tuple(row_operands)
        self.make_local = make_local

    def partition(self, mesh, arg_shapes, result_shape):
        mesh = self._mesh(mesh, arg_shapes)
        axes = self._factor_axes(mesh, arg_shapes)
        kv = arg_shapes[self.row_operands[0]]
        taken = [a for f in sharding.SHARDABLE_FACTORS for a in axes[f]]
        rows = ()
        if isinstance(kv.sharding, NamedSharding):
            rows = row_axes(kv.sharding.spec, kv.shape[0], dict(mesh.shape), taken)
        if not rows:
            return super().partition(mesh, arg_shapes, result_shape)
        arg_shardings = list(self._shardings(mesh, self.operand_layouts, axes))
        for i in self.row_operands:
            arg_shardings[i] = NamedSharding(mesh, _row_spec(rows, arg_shapes[i].ndim))
        result_shardings = self._shardings(mesh, self.result_layouts, axes)
        lower_fn = self.make_local(self.fn, rows, dict(mesh.shape))
        return mesh, lower_fn, result_shardings, tuple(arg_shardings)

    def sharding_rule(self):
        rule, kinds = super().sharding_rule()
        # The rows may stay split: this partitioner handles them (a pass-through factor).
        if "need_replication_factors" in kinds:
            kept = tuple(f for f in kinds["need_replication_factors"] if f != "r")
            kinds = dict(kinds, need_replication_factors=kept) if kept else {}
        return rule, kinds


def _row_spec(rows: tuple, ndim: int) -> PartitionSpec:
    return PartitionSpec(sharding._spec_entry(rows), *([None] * (ndim - 1)))


def _run_explicit(fn, operands, operand_layouts, result_layouts, factor_axes, rows, mesh,
                  row_operands, make_local):
    """Explicit axes: ``fn`` per device under ``jax.shard_map``, the cache split over ``rows``."""
    in_specs = [sharding._spec(lay, factor_axes) for lay in operand_layouts]
    for i in row_operands:
        in_specs[i] = _row_spec(rows, operands[i].ndim)
    out_specs = tuple(sharding._spec(lay, factor_axes) for lay in result_layouts)
    placed = []
    for x, spec in zip(operands, in_specs):
        current = tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim
        if current[: x.ndim] != tuple(spec) + (None,) * (x.ndim - len(spec)):
            x = jax.sharding.reshard(x, NamedSharding(mesh, spec))
        placed.append(x)
    used = [a for axes in factor_axes.values() for a in axes] + list(rows)
    local = make_local(fn, rows, dict(mesh.shape))
    return tuple(jax.shard_map(
        lambda *ops: tuple(local(*ops)), mesh=mesh, in_specs=tuple(in_specs),
        out_specs=out_specs, axis_names=set(used), check_vma=False,
    )(*placed))


def shard_local_rows(
    fn: Callable, operand_layouts: Sequence[str], result_layouts: Sequence[str],
    row_operands: Sequence[int], make_local: Callable, q_layout: str = sharding.LAYOUTS["q"],
) -> Callable:
    """:func:`sharding.shard_local` for an op that may also leave its cache split over its rows
    (see the module docstring): the forward ``gathered_attn_idx`` (``fn`` returns ``(out, lse)``,
    merged by ``row_local``), and the indexer (``row_operands`` its keys and key scales, merged
    by its own ``make_local``)."""
    partitioner = functools.partial(_RowPartitioner, row_operands=row_operands,
                                    make_local=make_local)
    plain = sharding.shard_local(fn, operand_layouts, result_layouts, partitioner, q_layout)

    def wrapped(*operands):
        q, kv = jax.typeof(operands[0]), jax.typeof(operands[row_operands[0]])
        if sharding._in_manual_region(q):
            return tuple(fn(*operands))  # inside a user's shard_map: the blocks are given
        explicit = sharding._explicit_axis_names(kv) | sharding._explicit_axis_names(q)
        if explicit:
            mesh = kv.sharding.mesh
            factor_axes = sharding._explicit_factor_axes(q, q_layout) \
                if sharding._has_explicit_axes(q) else {f: () for f in sharding.SHARDABLE_FACTORS}
            taken = [a for axes in factor_axes.values() for a in axes]
            rows = row_axes(kv.sharding.spec, kv.shape[0], dict(mesh.shape), taken)
            rows = rows if all(a in explicit for a in rows) else ()
            if rows:
                return _run_explicit(fn, operands, operand_layouts, result_layouts,
                                     factor_axes, rows, mesh, row_operands, make_local)
        return plain(*operands)

    return wrapped
