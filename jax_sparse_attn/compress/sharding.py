"""``compress_pool`` under multi-device jit (docs/compress.md, "Transforms and sharding").

Which factors of ``kv`` may stay split, and what each device then runs (``factor_axes``,
``make_local``):

- **Batch dims** (each leading dim of its own): blocks of sequences, no collective.
- **Tokens**, when each device holds whole blocks (``T`` a multiple of ``r`` times the shards):
  without overlap each device pools its own blocks. With overlap a device's first block also reads
  the previous device's last block: one ``ppermute`` of ``r`` rows of kv and of their f32 scores
  (the halo) from each device to the next; the first device reads ``prev_kv``/``prev_score``.
- **Channels**: without overlap each device pools its own channels. With overlap output channel
  ``c`` reads input channels ``c`` and ``d + c``, which a contiguous split of ``C`` puts on two
  different devices: the inputs' channels are gathered (the partitioner does it) and each device
  takes its share of each half, so the result is split over the same mesh axes in ``d``.

A split that the rules above do not keep (uneven, or tokens not block-aligned) is gathered first.
Each device runs the reference (or the NKI kernel: ``pool_functions``) on exactly the rows and
channels the single-device call would pool together, in the same order: the result is
bit-identical to one device's.

The machinery is the package's (:mod:`jax_sparse_attn.sharding`): ``jax.shard_map`` for Explicit
mesh axes, and a ``custom_partitioning`` with a Shardy rule for Auto ones, through
``sharding.shard_local`` and its ``_Partitioner``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from .. import sharding as shared
from ..cache_sharding import _shard_index
from . import reference


def layouts(batch_dims: int, overlap: bool, operands: int) -> tuple[list, str]:
    """Factor strings of the primitive's operands and result: ``b0 b1 ...`` the batch dims, ``t``
    tokens, ``i`` a block's rows (ape, prev_*), ``e`` input channels, ``n`` output blocks, ``c``
    output channels (``e`` too without overlap)."""
    batch = " ".join(f"b{k}" for k in range(batch_dims))
    channels = "e" if overlap else "c"
    rows = f"{batch} t {channels}".strip()
    block = f"{batch} i {channels}".strip()
    return [rows, rows] + [block] * (operands - 2), f"{batch} n c".strip()


def factor_axes(shape, spec, mesh_shape: dict, ratio: int, overlap: bool,
                keep=lambda name: True) -> dict:
    """The mesh axes that stay split, by factor (``b0``..., ``t``, ``c``), from kv's shape
    ``[..., T, C]`` and PartitionSpec; ``keep`` filters the axis names (Explicit ones only in an
    abstract eval)."""
    spec = tuple(spec) + (None,) * len(shape)
    axes = {}

    def split(dim, divides):
        names = tuple(a for a in shared._mesh_axes(spec[dim]) if keep(a))
        shards = math.prod(mesh_shape[a] for a in names)
        return names if names and divides(shards) else ()

    for dim in range(len(shape) - 2):
        axes[f"b{dim}"] = split(dim, lambda n, size=shape[dim]: size % n == 0)
    T, C = shape[-2:]
    # Whole blocks on every device: no tail inside a shard.
    axes["t"] = split(len(shape) - 2, lambda n: T > 0 and T % (n * ratio) == 0)
    width = C // 2 if overlap else C
    axes["c"] = split(len(shape) - 1, lambda n: width % n == 0)
    return axes


def operand_specs(axes: dict, batch_dims: int, overlap: bool, operands: int):
    """PartitionSpecs of the operands (the extra ones after them replicated) and of the result."""
    batch = [shared._spec_entry(axes[f"b{k}"]) for k in range(batch_dims)]
    tokens = shared._spec_entry(axes["t"])
    channels = shared._spec_entry(axes["c"])
    in_channels = None if overlap else channels  # overlap: each device gathers the channels
    rows = PartitionSpec(*batch, tokens, in_channels)
    block = PartitionSpec(*batch, None, in_channels)
    specs = [rows, rows] + [block] * (operands - 2)
    return specs, PartitionSpec(*batch, tokens, channels)


def _halves_share(x, axes: tuple, mesh_shape: dict):
    """This device's share of each half of the channels: ``[..., 2d]`` -> ``[..., 2 (d / n)]``,
    the columns ``[k d/n, (k+1) d/n)`` and ``d`` more, for shard ``k`` of ``n`` along ``axes``."""
    n = math.prod(mesh_shape[a] for a in axes)
    d = x.shape[-1] // 2
    width = d // n
    start = _shard_index(axes, mesh_shape) * width
    low = jax.lax.dynamic_slice_in_dim(x, start, width, axis=x.ndim - 1)
    high = jax.lax.dynamic_slice_in_dim(x, d + start, width, axis=x.ndim - 1)
    return jnp.concatenate([low, high], axis=-1)


def pool_functions(implementation=None):
    """``(whole, rows)``: the whole op on one device (``compress_pool_reference``'s signature)
    and one run of whole blocks (``pool_rows``'s), for ``implementation``: the jnp reference, or
    the NKI kernel for ``"nki"`` / ``"nki_emulated"`` (``compress/neuron.py``)."""
    if implementation in ("nki", "nki_emulated"):
        from . import neuron

        emulated = implementation == "nki_emulated"
        return (functools.partial(neuron.compress_pool_neuron, emulated=emulated),
                functools.partial(neuron.pool_rows_neuron, emulated=emulated))
    return reference.compress_pool_reference, reference.pool_rows


def make_local(axes: dict, mesh_shape: dict, ratio: int, overlap: bool, with_prev: bool,
               implementation=None):
    """What one device runs on its blocks (the operands as ``operand_specs`` places them; any
    operands after the primitive's pass through unused). Returns ``[..., N_local, C_local]`` f32."""
    pool_whole, pool_rows = pool_functions(implementation)

    def local(kv, score, ape, *rest):
        prev = rest[:2] if with_prev else (None, None)
        if overlap and axes["c"]:
            share = functools.partial(_halves_share, axes=axes["c"], mesh_shape=mesh_shape)
            kv, score, ape = share(kv), share(score), share(ape)
            prev = tuple(None if p is None else share(p) for p in prev)
        if not (overlap and axes["t"]):
            return pool_whole(kv, score, ape, *prev, overlap=overlap)
        N = kv.shape[-2] // ratio  # >= 1: tokens are split in whole blocks only
        before_kv, before_s = reference.rows_before(score, ape, *prev)
        # The halo: each device's last block goes to the next device, with the f32 scores that
        # device computed for it (the same ape: ape is never split over tokens).
        n = math.prod(mesh_shape[a] for a in axes["t"])
        to_next = [(k, k + 1) for k in range(n - 1)]
        last = slice(N * ratio - ratio, N * ratio)
        halo_kv = kv[..., last, :].astype(jnp.float32)
        halo_s = reference.block_scores(score[..., last, :], ape)
        halo_kv, halo_s = (jax.lax.ppermute(x, axes["t"], to_next) for x in (halo_kv, halo_s))
        first = _shard_index(axes["t"], mesh_shape) == 0
        before_kv = jnp.where(first, before_kv, halo_kv)
        before_s = jnp.where(first, before_s, halo_s)
        return pool_rows(kv, score, ape, overlap=True, before_kv=before_kv, before_s=before_s)

    return local


def result_aval(kv_aval, shape, ratio: int, overlap: bool):
    """The result's abstract value: f32, split over kv's Explicit mesh axes as ``run`` splits it
    (``shared.result_aval``'s counterpart for this op's layouts)."""
    sharding = getattr(kv_aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return jax.core.ShapedArray(shape, jnp.float32)
    explicit = shared._explicit_axis_names(kv_aval)
    axes = factor_axes(kv_aval.shape, spec, dict(sharding.mesh.shape), ratio, overlap,
                       explicit.__contains__)
    _, out_spec = operand_specs(axes, len(shape) - 2, overlap, 3)
    out = NamedSharding(sharding.mesh, out_spec)
    return kv_aval.update(shape=tuple(shape), dtype=jnp.dtype(jnp.float32), weak_type=False,
                          sharding=out)


def tokens_factor(tokens: int, ratio: int, devices: int) -> str:
    """kv's token factor in the Shardy rule. The result's blocks times a block's rows, ``(n i)``,
    where every split of the mesh divides the blocks (``n`` itself for ratio 1), so that a token
    split propagates to the result. Elsewhere a factor of its own, ``t``, and the result's blocks
    are kept whole (``run``): a split that the blocks do not divide would reach them as sub-axes
    (through the compound, or the reshape in the JVP's reference), which custom partitioning
    cannot read back. Shardy refuses a compound factor of size 1."""
    N = tokens // ratio
    if ratio == 1:
        return "n"
    if N > 1 and tokens == N * ratio and N % devices == 0:
        return "(n i)"
    return "t"


class _CompressPartitioner(shared._Partitioner):
    """custom_partitioning for Auto mesh axes: keeps the splits ``factor_axes`` allows (read off
    kv's sharding) and runs ``make_local`` on each device. Where it safely can, the Shardy rule
    ties kv's tokens ``(n i)`` to the result's blocks ``n``, so that a token split propagates to
    the result (``sharding_rule``)."""

    def __init__(self, *args, ratio: int, overlap: bool, operands: int, tokens: int,
                 devices: int, implementation=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.ratio, self.overlap, self.operands = ratio, overlap, operands
        self.implementation = implementation
        self.tokens, self.devices = tokens, devices

    def _factor_axes(self, mesh, arg_shapes) -> dict:
        kv = arg_shapes[0]
        spec = kv.sharding.spec if isinstance(kv.sharding, NamedSharding) else ()
        return factor_axes(kv.shape, spec, dict(mesh.shape), self.ratio, self.overlap)

    def _specs(self, axes):
        batch_dims = len(self.operand_layouts[0].split()) - 2
        specs, out_spec = operand_specs(axes, batch_dims, self.overlap, self.operands)
        specs += [PartitionSpec()] * (len(self.operand_layouts) - self.operands)  # constants
        return specs, out_spec

    def partition(self, mesh, arg_shapes, result_shape):
        mesh = self._mesh(mesh, arg_shapes)
        axes = self._factor_axes(mesh, arg_shapes)
        specs, out_spec = self._specs(axes)
        local = make_local(axes, dict(mesh.shape), self.ratio, self.overlap, self.operands == 5,
                           self.implementation)
        # shard_local's function returns a one-tuple: so does each device's.
        return (mesh, lambda *ops: (local(*ops),), (NamedSharding(mesh, out_spec),),
                tuple(NamedSharding(mesh, s) for s in specs))

    def infer_sharding_from_operands(self, mesh, arg_shapes, result_shape):
        """For the GSPMD partitioner (Shardy uses the sharding rule instead)."""
        mesh = self._mesh(mesh, arg_shapes)
        return (NamedSharding(mesh, self._specs(self._factor_axes(mesh, arg_shapes))[1]),)

    def sharding_rule(self):
        batch = [f"b{k}" for k in range(len(self.operand_layouts[0].split()) - 2)]
        channels = "e" if self.overlap else "c"
        tokens = tokens_factor(self.tokens, self.ratio, self.devices)
        operands = [" ".join(batch + [tokens, channels])] * 2
        operands += [" ".join(batch + ["i", channels])] * (self.operands - 2)
        operands += self.operand_layouts[self.operands:]  # the constants, c0, c1, ...
        result = " ".join(batch + ["n", "c"])
        rule = ", ".join(operands) + " -> " + result
        if "need_replication_factors" not in shared._DEF_PARTITION_KWARGS:
            return rule, {}  # JAX 0.7: every factor is a pass-through factor.
        # A block's rows and the constants stay whole (Shardy wants special factors in order of
        # first appearance); the other factors' splits are the partition callback's to handle.
        factors = dict.fromkeys(f for lay in operands
                                for f in lay.replace("(", " ").replace(")", " ").split())
        replicated = tuple(f for f in factors if f not in batch + ["t", "n", channels])
        return rule, ({"need_replication_factors": replicated} if replicated else {})


def _padded(spec, ndim: int) -> tuple:
    return (tuple(spec) + (None,) * ndim)[:ndim]


def run_explicit(kv, score, ape, *prev, ratio: int, overlap: bool, implementation=None):
    """Explicit mesh axes: ``make_local`` on each device under ``jax.shard_map``, the operands
    first resharded to ``operand_specs`` (a local slice for a replicated one). Differentiable:
    the JVP's tangent runs split the same way."""
    kv_aval = jax.typeof(kv)
    operands = (kv, score, ape) + tuple(prev)
    explicit = shared._explicit_axis_names(kv_aval)
    mesh = kv_aval.sharding.mesh
    axes = factor_axes(kv.shape, kv_aval.sharding.spec, dict(mesh.shape), ratio, overlap,
                       explicit.__contains__)
    specs, out_spec = operand_specs(axes, kv.ndim - 2, overlap, len(operands))
    placed = [x if _padded(jax.typeof(x).sharding.spec, x.ndim) == _padded(spec, x.ndim)
              else jax.sharding.reshard(x, NamedSharding(mesh, spec))
              for x, spec in zip(operands, specs)]
    local = make_local(axes, dict(mesh.shape), ratio, overlap, bool(prev), implementation)
    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=out_spec,
                         axis_names=explicit, check_vma=False)(*placed)


def split_like_lowering(kv, score, ape, *prev, overlap: bool):
    """The op in jnp, split over Explicit mesh axes as the primitive's lowering splits it (the
    reference as it is elsewhere): what the JVP differentiates. The plain reference there would
    slice a split token axis unevenly, which Explicit sharding refuses."""
    kv_aval = jax.typeof(kv)
    if shared._explicit_axis_names(kv_aval) and not shared._in_manual_region(kv_aval):
        return run_explicit(kv, score, ape, *prev, ratio=ape.shape[-2], overlap=overlap)
    return reference.compress_pool_reference(kv, score, ape, *prev, overlap=overlap)


def run_host_callback(kv, score, ape, *prev, ratio: int, overlap: bool, mesh):
    """Automatic mesh axes with the kernel under the emulator (a host callback, which cannot live
    in a ``custom_partitioning`` body: ``jax_sparse_attn/sharding.py``): ``make_local`` under
    ``jax.shard_map`` over the whole mesh, split over the first batch dim where the mesh divides
    it, else every device pooling all blocks (the operands replicated). Each device runs the
    windows the single-device call runs, so the result is the same."""
    operands = (kv, score, ape) + tuple(prev)
    names = tuple(mesh.axis_names)
    devices = math.prod(mesh.shape.values())
    axes = {f"b{k}": () for k in range(kv.ndim - 2)}
    axes.update(t=(), c=())
    if kv.ndim > 2 and kv.shape[0] % devices == 0:
        axes["b0"] = names
    specs, out_spec = operand_specs(axes, kv.ndim - 2, overlap, len(operands))
    local = make_local(axes, dict(mesh.shape), ratio, overlap, bool(prev), "nki_emulated")
    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=out_spec,
                         axis_names=set(names), check_vma=False)(*operands)


def run(kv, score, ape, *prev, ratio: int, overlap: bool, implementation=None):
    """The op on each device's blocks (the module docstring), called while lowering the
    primitive; on one device, the whole op (the reference, or the kernel: ``pool_functions``)."""
    kv_aval = jax.typeof(kv)
    operands = (kv, score, ape) + tuple(prev)
    pool_whole = pool_functions(implementation)[0]

    def whole(kv, score, ape, *rest):
        return (pool_whole(kv, score, ape, *rest[:len(prev)], overlap=overlap),)

    if shared._in_manual_region(kv_aval):
        return whole(*operands)[0]  # inside a user's shard_map: the blocks are given
    if shared._explicit_axis_names(kv_aval):
        return run_explicit(*operands, ratio=ratio, overlap=overlap,
                            implementation=implementation)
    operand_layouts, result_layout = layouts(kv.ndim - 2, overlap, len(operands))
    mesh = getattr(kv_aval.sharding, "mesh", None)
    devices = math.prod(mesh.shape.values()) if mesh is not None and not mesh.empty else 1
    if implementation == "nki_emulated" and devices > 1:
        return run_host_callback(*operands, ratio=ratio, overlap=overlap, mesh=mesh)
    partitioner = functools.partial(_CompressPartitioner, ratio=ratio, overlap=overlap,
                                    operands=len(operands), tokens=kv.shape[-2], devices=devices,
                                    implementation=implementation)
    wrapped = shared.shard_local(whole, operand_layouts, [result_layout], partitioner,
                                 q_layout=operand_layouts[0])
    out = wrapped(*operands)[0]
    if devices > 1 and tokens_factor(kv.shape[-2], ratio, devices) == "t":
        # Blocks not linked to the tokens stay whole (tokens_factor); the other dims are free.
        free = PartitionSpec.UNCONSTRAINED
        keep = PartitionSpec(*([free] * (out.ndim - 2)), None, free)
        out = jax.lax.with_sharding_constraint(out, NamedSharding(mesh, keep))
    return out
