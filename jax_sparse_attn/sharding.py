"""Multi-device sharding: every primitive of the package runs shard-locally, with no gathers.

Each operand and result has a layout of one-letter factors (``LAYOUTS``); only tokens (``t``) and
heads (``h``) are split, on the mesh axes that split operand 0, and results summed over a split
factor take one ``psum``. :func:`shard_local` wraps the function a primitive lowers to, under
``jax.shard_map`` (Explicit axes) or ``custom_partitioning`` (Auto axes): docs/sharding.md.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, Sequence

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import ClosedJaxpr, Jaxpr, jaxpr_as_fun
from jax.sharding import AxisType, NamedSharding, PartitionSpec

# The factors that may be sharded: tokens and heads. Everything else is replicated.
SHARDABLE_FACTORS = ("t", "h")

# Layouts of the primitives' operands and results, by name. ``sink_per_token`` is the sink
# cotangent before its sum over tokens (see autodiff.py).
LAYOUTS = {
    "q": "t h d",
    "g": "t k d",
    "kv": "r d",
    "idx": "t k",
    "sink": "h",
    "bias": "t k",
    "scale": "t",
    "kv_scale": "r g",  # an FP8 cache's scales: the cache's rows, g groups of columns
    "kv_rope": "r c",  # the 16-bit columns of a split FP8 row: the cache's rows, c columns
    "extra_kv": "e d",  # the second cache: rows of its own (e), the same columns
    "extra_idx": "t j",  # its slots (j)
    "extra_bias": "t j",
    "extra_kv_scale": "e n",  # an FP8 second cache's scales: its rows, n groups of its own
    "extra_kv_rope": "e w",  # and its 16-bit columns (w of them, its own width)
    "out": "t h v",  # v: the value columns (value_dim <= D), a factor of its own
    "lse": "t h",
    "sink_per_token": "t h",
}

_DEF_PARTITION_KWARGS = inspect.signature(custom_partitioning.def_partition).parameters


def register_device_aware(*primitives) -> None:
    """Marks primitives whose lowering needs the device assignment (custom partitioning does).

    JAX lowers a jit program without devices unless a primitive in it asks for them; JAX's own
    cuDNN attention and TransformerEngine register their primitives the same way. The registry
    is internal to JAX, so its absence is tolerated (single-device lowering still works).
    """
    try:
        from jax._src import dispatch
    except ImportError:  # pragma: no cover - depends on the JAX version
        return
    registry = getattr(dispatch, "prim_requires_devices_during_lowering", None)
    if registry is not None:
        registry.update(primitives)


# --- shardings from q's abstract value ----------------------------------------------------------


def _mesh_axes(entry) -> tuple:
    """The mesh axis names of one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def _spec_entry(axes: tuple):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def _spec(layout: str, factor_axes: dict) -> PartitionSpec:
    return PartitionSpec(*(_spec_entry(factor_axes.get(f, ())) for f in layout.split()))


def _q_factor_axes(spec, q_shape, mesh_shape, keep: Callable[[str], bool] = lambda name: True,
                   q_layout: str = LAYOUTS["q"]):
    """Mesh axes of ``t`` and ``h`` from q's PartitionSpec, dropping a split that does not divide.
    ``q_layout`` names q's dimensions (a factor outside SHARDABLE_FACTORS is never split).

    An uneven split would pad blocks with undefined tokens, which would then enter the sums over
    tokens (the cache gradient): such a factor is replicated instead.
    """
    spec = tuple(spec) + (None,) * 3
    axes = {f: () for f in SHARDABLE_FACTORS}
    for dim, factor in enumerate(q_layout.split()):
        if factor in SHARDABLE_FACTORS:
            names = tuple(n for n in _mesh_axes(spec[dim]) if keep(n))
            shards = math.prod(mesh_shape[n] for n in names)
            axes[factor] = names if names and q_shape[dim] % shards == 0 else ()
    return axes


def result_aval(q_aval, shape, dtype, layout: str):
    """Abstract value of a result: ``q``'s mesh, its ``t``/``h`` sharding, other dims replicated.

    With explicit mesh axes the sharding is part of the type; elsewhere it is unspecified and
    this is just ``ShapedArray(shape, dtype)`` (``q``'s varying manual axes are kept, so the op
    also types inside a user's ``shard_map``).
    """
    sharding = getattr(q_aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return jax.core.ShapedArray(shape, dtype)
    spec = tuple(spec) + (None,) * 3
    by_factor = {"t": spec[0], "h": spec[1]}
    out = NamedSharding(sharding.mesh, PartitionSpec(*(by_factor.get(f) for f in layout.split())))
    return q_aval.update(shape=tuple(shape), dtype=np.dtype(dtype), weak_type=False, sharding=out)


def like_aval(x, aval):
    """``x`` resharded to ``aval``'s explicit sharding when its own differs (a cotangent must have
    its primal's type); unchanged elsewhere."""
    want = getattr(aval, "sharding", None)
    have = getattr(jax.typeof(x), "sharding", None)
    if not _explicit_axis_names(aval) or want is None or have is None or want.spec == have.spec:
        return x
    return jax.sharding.reshard(x, want)


# --- host callbacks cannot live in a custom_partitioning body -----------------------------------


def _has_host_callback(jaxpr) -> bool:
    """Whether a jaxpr calls back into Python anywhere (``pure_callback``, ``io_callback``...)."""
    for eqn in jaxpr.eqns:
        if "callback" in eqn.primitive.name:
            return True
        if any(_has_host_callback(sub) for v in eqn.params.values() for sub in _jaxprs_in(v)):
            return True
    return False


def _jaxprs_in(value):
    """The jaxprs held by an equation parameter (a jaxpr, a closed jaxpr, or tuples of them)."""
    if isinstance(value, ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _jaxprs_in(v)


# --- the two ways of running shard-locally ------------------------------------------------------


def _with_psums(fn: Callable, reduce_over: Sequence[tuple]) -> Callable:
    """``fn`` followed by a psum of each result over the mesh axes it was summed across."""

    def local(*operands):
        outs = fn(*operands)
        single = not isinstance(outs, (tuple, list))
        outs = (outs,) if single else tuple(outs)
        outs = tuple(jax.lax.psum(o, names) if names else o for o, names in zip(outs, reduce_over))
        return outs[0] if single else outs

    return local


def _reduced_axes(result_layouts, factor_axes) -> list:
    return [
        tuple(a for f in SHARDABLE_FACTORS if f not in lay.split() for a in factor_axes[f])
        for lay in result_layouts
    ]


def _explicit_axis_names(aval) -> set:
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is None or mesh.empty:
        return set()
    return {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}


def _in_manual_region(aval) -> bool:
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    return mesh is not None and any(t == AxisType.Manual for t in mesh.axis_types)


def _has_explicit_axes(aval) -> bool:
    return bool(_explicit_axis_names(aval))


def _explicit_factor_axes(q_aval, q_layout: str = LAYOUTS["q"]) -> dict:
    """``t``/``h`` mesh axes of q that are Explicit (empty when the mesh has none)."""
    explicit = _explicit_axis_names(q_aval)
    mesh = q_aval.sharding.mesh
    spec, shape = q_aval.sharding.spec, q_aval.shape
    return _q_factor_axes(spec, shape, dict(mesh.shape), explicit.__contains__, q_layout)


def _replicated(x):
    sharding = jax.typeof(x).sharding
    if all(entry is None for entry in sharding.spec):
        return x
    return jax.sharding.reshard(x, NamedSharding(sharding.mesh, PartitionSpec()))


def _run_under_shard_map(fn, operands, operand_layouts, result_layouts, factor_axes, mesh,
                         axis_names):
    """Runs ``fn`` per device under ``jax.shard_map`` with ``t``/``h`` split as ``factor_axes``.

    With explicit axes each operand is first resharded to its layout (a local slice at most, for
    a replicated operand); with automatic axes the partitioner does that itself.
    """
    in_specs = tuple(_spec(lay, factor_axes) for lay in operand_layouts)
    out_specs = tuple(_spec(lay, factor_axes) for lay in result_layouts)
    explicit = _explicit_axis_names(jax.typeof(operands[0]))
    resharded = []
    for x, spec in zip(operands, in_specs):
        current = tuple(jax.typeof(x).sharding.spec) + (None,) * (x.ndim - len(spec))
        target = tuple(spec) + (None,) * (x.ndim - len(spec))
        if explicit and current != target:
            x = jax.sharding.reshard(x, NamedSharding(mesh, spec))
        resharded.append(x)
    local = _with_psums(fn, _reduced_axes(result_layouts, factor_axes))

    def body(*ops):
        return tuple(local(*ops))

    outs = jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(axis_names),
        check_vma=False,
    )(*resharded)
    return tuple(outs)


def _callback_factor_axes(q_aval, mesh, q_layout: str = LAYOUTS["q"]) -> dict:
    """Automatic axes, host-callback body: tokens over the whole mesh, else heads, else neither.

    The partitioner's own choice is unknown while lowering, so this picks the token split, the
    common layout (no communication when the operands are split that way already).
    """
    devices = math.prod(mesh.shape.values())
    everything = tuple(mesh.axis_names)
    T, H, _ = q_aval.shape
    if T % devices == 0:
        return {"t": everything, "h": ()}
    if H % devices == 0 and "h" in q_layout.split():
        return {"t": (), "h": everything}
    return {"t": (), "h": ()}


class _Partitioner:
    """custom_partitioning callbacks for one wrapped function (automatic mesh axes)."""

    def __init__(self, fn: Callable, operand_layouts: Sequence[str], result_layouts: Sequence[str],
                 q_layout: str = LAYOUTS["q"]):
        self.fn = fn
        self.q_layout = q_layout
        self.operand_layouts = list(operand_layouts)
        self.result_layouts = list(result_layouts)

    def _mesh(self, mesh, arg_shapes):
        if isinstance(arg_shapes[0].sharding, NamedSharding):
            return arg_shapes[0].sharding.mesh
        if mesh is not None and not mesh.empty:
            return mesh
        # No named mesh (e.g. positional shardings): one axis over the devices, all replicated.
        devices = sorted(arg_shapes[0].sharding.device_set, key=lambda d: d.id)
        return jax.sharding.Mesh(np.array(devices), ("devices",))

    def _factor_axes(self, mesh, arg_shapes) -> dict:
        sharding = arg_shapes[0].sharding
        if not isinstance(sharding, NamedSharding):
            return {f: () for f in SHARDABLE_FACTORS}
        return _q_factor_axes(sharding.spec, arg_shapes[0].shape, dict(mesh.shape),
                              q_layout=self.q_layout)

    def _shardings(self, mesh, layouts, factor_axes):
        return tuple(NamedSharding(mesh, _spec(lay, factor_axes)) for lay in layouts)

    def partition(self, mesh, arg_shapes, result_shape):
        mesh = self._mesh(mesh, arg_shapes)
        axes = self._factor_axes(mesh, arg_shapes)
        arg_shardings = self._shardings(mesh, self.operand_layouts, axes)
        result_shardings = self._shardings(mesh, self.result_layouts, axes)
        lower_fn = _with_psums(self.fn, _reduced_axes(self.result_layouts, axes))
        if not isinstance(result_shape, (tuple, list)):
            result_shardings = result_shardings[0]
        return mesh, lower_fn, result_shardings, arg_shardings

    def infer_sharding_from_operands(self, mesh, arg_shapes, result_shape):
        """For the GSPMD partitioner (Shardy uses the sharding rule instead)."""
        mesh = self._mesh(mesh, arg_shapes)
        shardings = self._shardings(mesh, self.result_layouts, self._factor_axes(mesh, arg_shapes))
        return shardings if isinstance(result_shape, (tuple, list)) else shardings[0]

    def sharding_rule(self) -> tuple[str, dict]:
        rule = ", ".join(self.operand_layouts) + " -> " + ", ".join(self.result_layouts)
        if "need_replication_factors" not in _DEF_PARTITION_KWARGS:
            return rule, {}  # JAX 0.7: every factor is a pass-through factor.
        # Shardy numbers factors in order of first appearance and wants special ones in that order.
        layouts = self.operand_layouts + self.result_layouts
        factors = dict.fromkeys(f for lay in layouts for f in lay.split())
        replicated = tuple(f for f in factors if f not in SHARDABLE_FACTORS)
        return rule, ({"need_replication_factors": replicated} if replicated else {})

    def wrap(self, traced: Callable) -> Callable:
        """custom_partitioning of ``traced`` (``fn`` already traced on the global shapes)."""
        partitioned = custom_partitioning(traced)
        rule, kinds = self.sharding_rule()
        partitioned.def_partition(
            partition=self.partition,
            infer_sharding_from_operands=self.infer_sharding_from_operands,
            sharding_rule=rule,
            **kinds,
        )
        return partitioned


def shard_local(
    fn: Callable, operand_layouts: Sequence[str], result_layouts: Sequence[str],
    partitioner_type: type = _Partitioner, q_layout: str = LAYOUTS["q"],
) -> Callable:
    """Wraps ``fn`` so that, under multi-device ``jit``, it runs on each device's block.

    Args:
      fn: a jnp-traceable function of the operands returning a tuple of arrays, one per entry
        of ``result_layouts``; it must be correct on any block of tokens and heads given the
        other dimensions whole.
      operand_layouts: one factor string per operand, e.g. ``"t h d"``; operand 0 must be ``q``.
      result_layouts: one factor string per result. A result missing ``t`` or ``h`` is summed
        over the devices that split that factor.
      partitioner_type: the custom_partitioning callbacks for automatic mesh axes (a subclass of
        ``_Partitioner``; cache_sharding.py keeps the cache's rows split with its own).
      q_layout: the factors of operand 0's dimensions (default the attention's ``"t h d"``; the
        indexer's ``"t j d"`` keeps its heads whole).

    Returns:
      A function of the operands returning the tuple of results, meant to be called while
      lowering a primitive (inside ``mlir.lower_fun``). On one device it computes what ``fn``
      does (the partitioner inlines the wrapper).
    """

    def wrapped(*operands):
        if _in_manual_region(jax.typeof(operands[0])):
            return tuple(fn(*operands))  # inside a shard_map: the operands already are blocks
        if _has_explicit_axes(jax.typeof(operands[0])):
            explicit_axes = _explicit_factor_axes(jax.typeof(operands[0]), q_layout)
            if any(explicit_axes.values()):
                mesh = jax.typeof(operands[0]).sharding.mesh
                used = [a for axes in explicit_axes.values() for a in axes]
                return _run_under_shard_map(
                    fn, operands, operand_layouts, result_layouts, explicit_axes, mesh, used
                )
            # q is not split over an explicit axis: the op runs whole on each device, under
            # shard_map with every operand replicated (outside a manual region JAX 0.7 has no
            # explicit-sharding rule for the backward's scatter-add).
            mesh = jax.typeof(operands[0]).sharding.mesh
            axes = sorted(_explicit_axis_names(jax.typeof(operands[0])))
            return _run_under_shard_map(
                fn, operands, operand_layouts, result_layouts,
                {f: () for f in SHARDABLE_FACTORS}, mesh, axes,
            )
        # Trace fn once here; the partition callback traces it again on the per-device shapes.
        avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in operands]
        closed = jax.make_jaxpr(fn)(*avals)
        if _has_host_callback(closed.jaxpr):
            mesh = getattr(jax.typeof(operands[0]).sharding, "mesh", None)
            if mesh is None or mesh.empty or math.prod(mesh.shape.values()) == 1:
                return tuple(jaxpr_as_fun(closed)(*operands))
            # Left to the partitioner, the callback would run on device 0 alone, on gathered
            # operands (and XLA can deadlock around it); run it on every device instead.
            axes = _callback_factor_axes(jax.typeof(operands[0]), mesh, q_layout)
            return _run_under_shard_map(
                fn, operands, operand_layouts, result_layouts, axes, mesh, mesh.axis_names
            )
        # custom_partitioning refuses a body that captures array constants: they travel as extra
        # (flattened, replicated) operands after the real ones.
        count = len(operands)
        shapes = [np.shape(c) for c in closed.consts]
        flat_consts = [jax.numpy.ravel(jax.numpy.asarray(c)) for c in closed.consts]

        def traced(*args):
            consts = [c.reshape(shape) for c, shape in zip(args[count:], shapes)]
            return tuple(jaxpr_as_fun(ClosedJaxpr(closed.jaxpr, consts))(*args[:count]))

        partitioner = partitioner_type(
            lambda *args: fn(*args[:count]),
            list(operand_layouts) + [f"c{i}" for i in range(len(flat_consts))],
            result_layouts,
            q_layout,
        )
        return tuple(partitioner.wrap(traced)(*operands, *flat_consts))

    return wrapped
