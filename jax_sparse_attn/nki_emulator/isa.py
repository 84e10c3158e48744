"""The ``nki.isa`` subset, emulated on the host (bind it as ``nisa``).

Every instruction writes into a caller-provided ``dst`` whose shape must equal the computed value's
shape exactly (no implicit broadcasting into ``dst``). Compute instructions read their inputs as
fp32, compute in fp32 and round once to ``dst.dtype``.
"""

from __future__ import annotations

import enum
from typing import Any

import ml_dtypes
import numpy as np

from ..constants import PARTITIONS, PSUM_BANK_FP32
from . import language as nl
from . import versions
from ._core import (
    _FP8_E4M3,
    F32,
    HBM_BUFFERS,
    ON_CHIP,
    PSUM,
    SBUF,
    AccessPattern,
    Tensor,
    current_context,
    read,
    read_ap,
    write,
    write_ap,
)
from .errors import (
    NkiDtypeError,
    NkiEmulatorError,
    NkiLimitError,
    NkiMemorySpaceError,
    NkiShapeError,
    NkiUninitializedReadError,
    NkiUnsupportedError,
)
from .language import (
    begin,
    check_dst_shape,
    check_free_axes,
    f32_values,
    no_extra,
    reduce_values,
    same_base_partition,
    tensor_arg,
)

__all__ = [
    "VirtualRegister", "register_alloc", "register_load", "register_move", "register_store",
    "iota", "reduce_cmd", "oob_mode", "engine", "dge_mode", "dma_copy", "dma_transpose", "tensor_copy",
    "nc_matmul", "nc_transpose", "activation", "activation_reduce", "tensor_scalar",
    "scalar_tensor_tensor", "tensor_tensor", "tensor_reduce", "reciprocal", "memset",
]  # fmt: skip


class reduce_cmd(enum.Enum):
    """Scalar Engine reduce-register commands (``nisa.activation(reduce_cmd=...)``)."""

    idle = "idle"
    reset = "reset"
    reduce = "reduce"
    reset_reduce = "reset_reduce"
    load_reduce = "load_reduce"


_RC = reduce_cmd  # the enum, for functions whose reduce_cmd parameter shadows it


class oob_mode(enum.Enum):
    """What an indirect DMA does with an out-of-range index: raise (default) or skip that row."""

    error = "error"
    skip = "skip"


_OOB = oob_mode


class engine(enum.Enum):
    unknown = "unknown"
    tensor = "tensor"
    vector = "vector"
    scalar = "scalar"
    gpsimd = "gpsimd"
    dma = "dma"
    sync = "sync"


_ENGINE = engine  # the enum, for functions whose engine parameter shadows it


class dge_mode(enum.Enum):
    """Descriptor Generation Engine mode (``nki/deep-dives/nki-dge.rst``)."""

    unknown = "unknown"
    none = "none"
    swdge = "swdge"
    hwdge = "hwdge"


_DGE = dge_mode


# Operators, keyed by the nl function (and the numpy ufunc older NKI code passes).
# The ALU operator table (nki-aluop) is not among the stored 0.3 pages; divide is accepted as an
# engine ALU operator (inferred; only the nl.divide *function* is documented as unsupported).
_BINARY_OPS = {
    nl.add: np.add, nl.subtract: np.subtract, nl.multiply: np.multiply, nl.divide: np.divide,
    nl.maximum: np.maximum, nl.minimum: np.minimum,
    np.add: np.add, np.subtract: np.subtract, np.multiply: np.multiply, np.divide: np.divide,
    np.maximum: np.maximum, np.minimum: np.minimum,
    # Comparisons give 1.0 / 0.0 (the ALU's boolean result, stored in dst's dtype; range_select
    # page lists nl.equal/less/less_equal/greater/greater_equal as comparison operators). NaN
    # compares false (IEEE; inferred).
    nl.equal: nl.compare_values(np.equal), nl.not_equal: nl.compare_values(np.not_equal),
    nl.less: nl.compare_values(np.less), nl.less_equal: nl.compare_values(np.less_equal),
    nl.greater: nl.compare_values(np.greater),
    nl.greater_equal: nl.compare_values(np.greater_equal),
}  # fmt: skip
_REDUCE_OPS = {
    nl.add: np.add, nl.multiply: np.multiply, nl.max: np.maximum, nl.min: np.minimum,
    np.add: np.add, np.multiply: np.multiply, np.max: np.maximum, np.min: np.minimum,
}  # fmt: skip


def _identity(v: np.ndarray) -> np.ndarray:
    return v


_ACTIVATIONS = {
    nl.exp: np.exp, nl.copy: _identity, nl.tanh: np.tanh, nl.log: np.log, nl.sqrt: np.sqrt,
    nl.square: np.square, nl.relu: lambda v: np.maximum(v, np.float32(0)),
    nl.reciprocal: lambda v: np.float32(1) / v, nl.negative: np.negative,
    np.exp: np.exp, np.tanh: np.tanh,
}  # fmt: skip

# nc_matmul page: stationary/moving in float8_e4m3/float8_e5m2/bfloat16/float16/tfloat32/float32;
# float8_e4m3fn is not listed there, so the emulator refuses it as a matmul input (stricter).
_MATMUL_INPUT_DTYPES = frozenset(
    np.dtype(t)
    for t in (np.float32, ml_dtypes.bfloat16, np.float16, _FP8_E4M3, ml_dtypes.float8_e5m2)
)


def _op(table: dict, op: Any, instr: str, arg: str):
    try:
        return table[op]
    except (KeyError, TypeError):
        names = sorted(
            k.__name__ for k in table if getattr(k, "__module__", "") == nl.__name__
        )
        raise NkiUnsupportedError(
            f"{instr}: {arg}={getattr(op, '__name__', op)!r} is not an emulated operator "
            f"(emulated: {', '.join(names)})"
        ) from None


def _free_broadcast(column: np.ndarray, ndim: int) -> np.ndarray:
    """A ``[P, 1]`` column shaped to broadcast along all free axes of a rank-``ndim`` tile."""
    return column.reshape((column.shape[0],) + (1,) * (ndim - 1))


def _scalar_or_column(value: Any, data: Tensor, instr: str, arg: str, inputs: list) -> Any:
    """A python/numpy scalar as fp32, or an on-chip ``[P, 1]`` tile as an fp32 column."""
    if isinstance(value, Tensor):
        tensor_arg(value, instr, arg, ON_CHIP)
        if value.shape != (data.shape[0], 1):
            # tensor_scalar / activation pages: "a scalar constant or a tile of shape
            # (data.shape[0], 1)".
            raise NkiShapeError(
                f"{instr}: {arg} must be a scalar or a [{data.shape[0]}, 1] column "
                f"(one value per partition of data), got {value.describe()}"
            )
        inputs.append(value)
        return _free_broadcast(f32_values(value, instr, arg), data.ndim)
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        return np.float32(value)
    raise NkiUnsupportedError(f"{instr}: {arg} of type {type(value).__name__}")


def _apply(fn, a, b, reverse: bool):
    return fn(b, a) if reverse else fn(a, b)


def _not_both_psum(instr: str, a: Tensor, b: Tensor, names: str) -> None:
    if a.buffer is PSUM and b.buffer is PSUM:
        # tensor_tensor page: "data1 and data2 cannot both reside in PSUM"; scalar_tensor_tensor
        # page: "data and operand1 cannot both reside in PSUM".
        raise NkiMemorySpaceError(
            f"operand in the wrong memory: {instr} {names} may not both be in PSUM"
        )


# ----------------------------------------------------------------------------------------------
# data movement


def _require_nc_version(instr: str, minimum: int, what: str, source: str) -> None:
    """Reject ``what`` on targets older than NeuronCore-v``minimum`` (trn1 is v2)."""
    target = current_context().target_info
    if target.nc_version < minimum:
        raise NkiUnsupportedError(
            f"not available on {target.name}: {' '.join(filter(None, (instr, what)))} needs "
            f"NeuronCore-v{minimum} or newer "
            f"({target.name} is NeuronCore-v{target.nc_version}; {source})"
        )


def _mode_value(value: Any, enum_type: type, instr: str, arg: str) -> Any:
    if value is None:
        return None
    if not isinstance(value, enum_type):
        # NKI 0.3 release notes, breaking changes: "Raw integer enum constants no longer accepted."
        raise NkiUnsupportedError(f"{instr}: {arg} must be a nisa.{enum_type.__name__} member, got {value!r}")
    return value


def _check_dma_target(instr: str, src: Any, dst: Any, dge: Any) -> None:
    """The generation rules of DMA forms (trn1 is NeuronCore-v2)."""
    if dge is _DGE.hwdge:
        # dma_copy / dma_transpose pages: "Hardware based DGE is only supported for
        # NeuronCore-v3 or newer."; nki/deep-dives/nki-dge.rst, mode table.
        _require_nc_version(instr, 3, "dge_mode=hwdge", "dma_copy page, nki/deep-dives/nki-dge.rst")
    for x in (src, dst):
        if isinstance(x, AccessPattern) and x.is_indirect:
            # nki/deep-dives/nki-dge.rst, mode table: swdge "Any (indirect: v3+)".
            _require_nc_version(
                instr, 3, "with an indirect (vector_offset) access pattern",
                "nki/deep-dives/nki-dge.rst, DGE mode table",
            )
            if dge not in (None, _DGE.unknown, _DGE.swdge):
                # nki-dge.rst, "How .ap() Affects DGE Mode": vector_offset needs unknown or swdge.
                raise NkiUnsupportedError(
                    f"{instr}: an indirect (vector_offset) access pattern needs dge_mode unknown "
                    f"or swdge, got {dge.name} (nki/deep-dives/nki-dge.rst)"
                )


# Engines an instruction may be given with engine= (ISA pages: tensor_copy and tensor_scalar run on
# Vector, Scalar or GpSimd; tensor_tensor and memset on Vector or GpSimd).
_ENGINES_OF = {
    "nisa.tensor_copy": ("vector", "scalar", "gpsimd"),
    "nisa.tensor_scalar": ("vector", "scalar", "gpsimd"),
    "nisa.tensor_tensor": ("vector", "gpsimd"),
    "nisa.memset": ("vector", "gpsimd"),
}
# tensor_scalar page (v2.29.1 and v2.32.0): "The Scalar Engine on trn2 only supports some operator
# combinations": op0=multiply with op1=add or None, op0=add with op1=None.
_SCALAR_ENGINE_TENSOR_SCALAR = {("multiply", "add"), ("multiply", None), ("add", None)}


def _op_name(op: Any) -> str | None:
    if op is None:
        return None
    return getattr(op, "__name__", str(op))


def check_engine(instr: str, engine: Any, tiles: list, ops: tuple = ()) -> str | None:
    """The engine rules of the ISA pages for an explicit ``engine=``; returns its name (None for
    ``engine=unknown``, which lets the compiler choose a legal engine)."""
    if engine is None:
        return None
    if not isinstance(engine, _ENGINE):
        raise NkiUnsupportedError(f"{instr}: engine must be a nisa.engine member, got {engine!r}")
    name = engine.value
    if name == "unknown":
        return None
    allowed = _ENGINES_OF.get(instr)
    if allowed is not None and name not in allowed:
        raise NkiUnsupportedError(
            f"{instr} does not run on the {name} engine (ISA page: {', '.join(allowed)})"
        )
    target = current_context().target_info
    if name == "gpsimd":
        in_psum = [t for t in tiles if isinstance(t, Tensor) and t.buffer is PSUM]
        if in_psum:
            # tensor_copy page: "since GpSimd Engine cannot access PSUM in NeuronCore, Scalar or
            # Vector Engine must be chosen when the input or output tile is in PSUM"; the same
            # sentence on the iota, rand and nc_n_gather pages (every target).
            raise NkiMemorySpaceError(
                f"GpSimd Engine cannot access PSUM: {instr} on engine=gpsimd touches "
                f"{in_psum[0].describe()} (nki.isa.tensor_copy page; use the Vector or Scalar "
                "engine for PSUM operands)"
            )
    if name == "scalar" and instr == "nisa.tensor_copy" and target.nc_version == 2:
        # tensor_copy page: "On NeuronCore v2, tensor_copy is not supported on the Scalar Engine.
        # Instead, use nisa.activation with op=nl.copy."
        raise NkiUnsupportedError(
            f"not available on {target.name}: nisa.tensor_copy on the Scalar engine is not "
            "supported on NeuronCore-v2 (nki.isa.tensor_copy page); use nisa.activation with "
            "op=nl.copy"
        )
    if name == "scalar" and instr == "nisa.tensor_scalar":
        combo = (_op_name(ops[0]), _op_name(ops[1]) if len(ops) > 1 else None)
        if combo not in _SCALAR_ENGINE_TENSOR_SCALAR:
            # Documented for trn2; applied on every target (stricter: the page states no other
            # target's Scalar-engine combinations; inferred).
            raise NkiUnsupportedError(
                f"operators the Scalar engine lacks: nisa.tensor_scalar op0={combo[0]}, "
                f"op1={combo[1]} on engine=scalar; the Scalar Engine on trn2 only supports "
                "op0=multiply with op1=add or None, or op0=add with op1=None "
                "(nki.isa.tensor_scalar page; trn1/trn3 held to the same, inferred)"
            )
    return name


def _charge(ctx: Any, instr: str, engine: Any, dst: Any, inputs: list, **info: Any) -> None:
    """Record the instruction's modelled cost when the run records costs (see cost.py)."""
    if ctx.cost is not None:
        ctx.cost.compute(instr, engine, dst, inputs, **info)


def _masked_write(dst: Tensor, values: np.ndarray, ok: np.ndarray | None) -> None:
    """Write ``values`` into ``dst`` where ``ok`` (None: everywhere); the rest keeps its contents."""
    if ok is None:
        write(dst, values)
        return
    mask = np.broadcast_to(ok.reshape(ok.shape + (1,) * (values.ndim - ok.ndim)), values.shape)
    dst._data[mask] = values[mask]
    dst._mask[mask] = True


def dma_copy(
    dst: Any,
    src: Any,
    oob_mode: oob_mode = oob_mode.error,
    dge_mode: Any = None,
    engine: Any = None,
    **kwargs: Any,
) -> None:
    """``dst = src`` by DMA, between any memories except that PSUM cannot be read; converts dtype.

    ``src``/``dst`` may be tensors, views or access patterns ``t.ap(...)``: with
    ``scalar_offset`` the start moves by a runtime value; with ``vector_offset=idx_tile`` it
    gathers HBM rows (on ``src``) or scatters partition ``p`` to row ``idx[p]`` (on ``dst``),
    trn2+. An out-of-range index or address raises (the default
    ``oob_mode=nisa.oob_mode.error``); with ``oob_mode=nisa.oob_mode.skip`` that row (or that
    whole scalar-offset transfer) is skipped and the destination keeps what it held.
    """
    instr = "nisa.dma_copy"
    for removed in ("dst_rmw_op", "unique_indices"):
        if removed in kwargs:
            # NKI 0.3 release notes (breaking changes) and nki/migration/index.rst (0.3.0 update
            # guide): "dst_rmw_op and unique_indices parameters removed. Use nisa.dma_compute".
            raise NkiUnsupportedError(
                f"{instr}: {removed} was removed in NKI 0.3 (release notes, breaking changes): "
                "use nisa.dma_compute"
            )
    no_extra(kwargs, instr)
    ctx = begin(instr)
    for arg, x in (("dst", dst), ("src", src)):
        if not isinstance(x, (Tensor, AccessPattern)):
            raise NkiUnsupportedError(f"{instr}: {arg} must be a tensor, view or ap, got {type(x).__name__}")
    mode = _mode_value(oob_mode, _OOB, instr, "oob_mode")
    dge = _mode_value(dge_mode, _DGE, instr, "dge_mode")
    _check_dma_target(instr, src, dst, dge)
    if engine is not None and dge is not _DGE.hwdge and getattr(engine, "name", "unknown") != "unknown":
        # dma_copy page: engine "Only valid when dge_mode=nisa.dge_mode.hwdge".
        raise NkiUnsupportedError(f"{instr}: engine= is only valid with dge_mode=hwdge")
    if src.buffer is PSUM:
        # NKI 0.3 release notes, breaking changes: "nisa.dma_copy — No longer supports reading
        # directly from PSUM."
        raise NkiMemorySpaceError(
            f"operand in the wrong memory: {instr} cannot read PSUM (src is {src.describe()}); "
            "copy it to SBUF with nisa.tensor_copy first"
        )
    if dst.buffer is PSUM:
        # dma_copy page, memory types: "Both src and dst tiles can be in HBM or SBUF."
        raise NkiMemorySpaceError(
            f"operand in the wrong memory: {instr} writes HBM or SBUF, dst is {dst.describe()}"
        )
    skip = mode is _OOB.skip
    if isinstance(src, AccessPattern):
        src.check_dma_copy_indices(instr)
        values, ok = read_ap(src, instr, "src", skip)
    else:
        values, ok = read(src, instr, "src"), None
    # Inferred (stricter than the page, which asks for equal element counts): dst and src shapes
    # must be equal.
    check_dst_shape(instr, dst, values.shape)
    if dge is _DGE.hwdge and dst.dtype != src.dtype:
        # NKI 0.3 release notes: dma_copy "Enforces matching source and destination element
        # types when using dge_mode=dge_mode.hwdge".
        raise NkiDtypeError(
            f"{instr}: dge_mode=hwdge copies need equal dtypes, src {src.dtype.name} dst {dst.dtype.name}"
        )
    if isinstance(dst, AccessPattern):
        if ok is not None:
            raise NkiUnsupportedError(f"{instr}: oob_mode=skip with an access-pattern dst")
        dst.check_dma_copy_indices(instr)
        write_ap(dst, values, instr, skip)
        if dst.is_indirect:  # what the cost model counts as moved: the rows in range
            ok = _scatter_rows_in_range(dst, instr)
    else:
        _masked_write(dst, values, ok)
    if ctx.cost is not None:
        ctx.cost.dma(
            instr, src, dst, values, ok, dge,
            indirect_rows=next((x.shape[0] for x in (src, dst)
                                if isinstance(x, AccessPattern) and x.is_indirect), 0),
            dynamic=any(isinstance(x, AccessPattern) and x.scalar_offset is not None for x in (src, dst)),
            nc_version=ctx.target_info.nc_version,
        )  # fmt: skip


def _scatter_rows_in_range(dst: AccessPattern, instr: str) -> np.ndarray:
    rows = read(dst.vector_offset, instr, "vector_offset").astype(np.int64).reshape(-1)
    return (rows >= 0) & (rows < dst.base.shape[0])


def dma_transpose(
    dst: Tensor,
    src: Any,
    axes: Any = None,
    dge_mode: Any = None,
    oob_mode: Any = oob_mode.error,
    **kwargs: Any,
) -> None:
    """``dst[B, A] = src[A, B].T`` by DMA into SBUF, for 2-byte dtypes (trn2+).

    Direct form: ``src`` an HBM tensor or view ``[A, B]`` with ``B <= 128``; the destination view
    must start at a 32-byte aligned offset within its partition.

    Indirect form (gather + transpose in one DMA): ``src = kv.ap(pattern=[[row, A], [1, B]],
    offset=col0, vector_offset=idx, indirect_dim=0)`` with ``idx`` a 2-D uint32 SBUF tile
    ``[I0, I1]``: gathered row ``a`` is ``idx.T.flatten()[a]`` (i.e. ``idx[a % I0, a // I0]``),
    and ``dst[b, a] = kv[row_a, col0 + b]``. The page's constraints are enforced: ``B <= 128``,
    ``A % 16 == 0``, ``I0`` in ``[16, 128]`` and a multiple of 16, ``I0 == 128`` when ``I1 > 1``,
    ``I0 * I1 >= A``. With ``oob_mode=nisa.oob_mode.skip`` an out-of-range index leaves its
    destination column as it was (zero the tile first for zeros).
    """
    instr = "nisa.dma_transpose"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    # Trainium2 arch guide (nki/guides/architecture/trainium2_arch.rst, "DMA Transpose") describes
    # DMA transpose as a Trainium2 feature; the indirect form is "TRN2+ only" (dma_transpose page).
    _require_nc_version(instr, 3, "", "dma_transpose page; trainium2_arch.rst, DMA Transpose")
    if axes not in (None, (1, 0), [1, 0]):
        raise NkiUnsupportedError(f"{instr}: only the 2-D transpose axes=(1, 0) is emulated")
    mode = _mode_value(oob_mode, _OOB, instr, "oob_mode")
    dge = _mode_value(dge_mode, _DGE, instr, "dge_mode")
    tensor_arg(dst, instr, "dst", (SBUF,))  # dma_transpose page: dst "must be a tile in SBUF"
    indirect = isinstance(src, AccessPattern) and src.is_indirect
    if isinstance(src, AccessPattern) and not indirect:
        raise NkiUnsupportedError(f"{instr}: a non-indirect access-pattern src is not emulated")
    if not indirect:
        # The emulator takes HBM sources only (the page also allows SBUF; not emulated).
        tensor_arg(src, instr, "src", HBM_BUFFERS)
    if src.dtype.itemsize != 2:
        # dma_transpose page / nki-dge.rst: the hwdge and indirect forms need 2-byte dtypes.
        # trainium2_arch.rst allows 4-byte transposes, but the default dge_mode may lower to
        # hwdge, so the emulator requires 2 bytes for every form (stricter reading).
        raise NkiDtypeError(
            f"dma_transpose of a {src.dtype.itemsize}-byte dtype ({src.dtype.name}): "
            "dma_transpose moves 2-byte dtypes only (bf16/fp16)"
        )
    if dst.dtype != src.dtype:
        # dma_transpose page: "src.dtype == dst.dtype".
        raise NkiDtypeError(
            f"{instr} does not convert dtypes: src {src.dtype.name}, dst {dst.dtype.name}"
        )
    if len(src.shape) != 2 or dst.ndim != 2:  # coverage: the 3-D/4-D forms are not emulated
        raise NkiShapeError(f"{instr}: 2-D src and dst only, got {src.shape} -> {dst.shape}")
    if src.shape[1] > PARTITIONS:
        # dma_transpose page (indirect constraints) and nki-dge.rst: src.shape[-1] <= 128; the
        # transposed axis becomes dst's partition axis, so the direct form is bound too.
        raise NkiLimitError(
            f"dma_transpose source free size over {PARTITIONS}: src shape {src.shape}"
        )
    check_dst_shape(instr, dst, src.shape[::-1])
    st = dst._st
    row_bytes = st.data.dtype.itemsize * int(np.prod(st.data.shape[1:], dtype=np.int64))
    start = dst._data.__array_interface__["data"][0] - st.data.__array_interface__["data"][0]
    if (start % row_bytes) % 32:
        # Inferred from trainium2_arch.rst (16 DMA engines write 16 contiguous 2-byte elements
        # of each partition together): a 32-byte aligned destination start.
        raise NkiLimitError(
            f"dma_transpose destination offset not 32-byte aligned: dst view starts "
            f"{start % row_bytes} bytes into its partition ({dst.describe()})"
        )
    if not indirect:
        if mode is _OOB.skip:
            # dma_transpose page: oob_mode.skip is "Only valid when src uses indirect indexing."
            raise NkiUnsupportedError(f"{instr}: oob_mode=skip is only valid with an indirect src")
        if dge not in (None, _DGE.unknown, _DGE.hwdge, _DGE.none):
            # dma_transpose page: direct transposes take dge_mode unknown or hwdge (nki-dge.rst's
            # table also lists none for static patterns).
            raise NkiUnsupportedError(f"{instr}: a direct transpose takes dge_mode unknown/none/hwdge")
        if dge is _DGE.hwdge and (src.shape[0] != 16 or src.shape[1] % 128):
            # dma_transpose page, "DMA Direct Transpose Constraints" for hwdge.
            raise NkiShapeError(
                f"{instr}: a hwdge transpose needs src.shape[0] == 16 and src.shape[-1] % 128 == 0,"
                f" got {src.shape}"
            )
        values = read(src, instr, "src")
        write(dst, values.T)
        if ctx.cost is not None:
            ctx.cost.dma(instr, src, dst, values, None, dge, transpose=True)
        return
    _check_indirect_transpose(instr, src, dge)
    idx = src.vector_offset
    count = src.shape[0]
    rows = read(idx, instr, "vector_offset").astype(np.int64).T.reshape(-1)[:count]
    values, ok = read_ap(src, instr, "src", mode is _OOB.skip, rows=rows)
    _masked_write(dst, values.T, None if ok is None else np.broadcast_to(ok, dst.shape))
    if ctx.cost is not None:
        ctx.cost.dma(instr, src, dst, values, ok, dge, transpose=True, indirect_rows=count)


def _check_indirect_transpose(instr: str, src: AccessPattern, dge: Any) -> None:
    """The "DMA Indirect Transpose Constraints" of the dma_transpose page (and nki-dge.rst)."""
    idx = src.vector_offset
    # Each check below is one line of that list (dma_transpose page; nki-dge.rst, swdge).
    if dge not in (None, _DGE.unknown, _DGE.swdge):
        raise NkiUnsupportedError(
            f"{instr}: an indirect transpose takes dge_mode unknown or swdge, got {dge.name}"
        )
    if idx.ndim != 2:
        raise NkiShapeError(f"{instr}: the index tile must be 2-D, got {idx.describe()}")
    if idx.dtype != np.dtype(np.uint32):
        raise NkiDtypeError(f"{instr}: the index tile must be uint32, got {idx.dtype.name}")
    i0, i1 = idx.shape
    if not (16 <= i0 <= PARTITIONS and i0 % 16 == 0):
        raise NkiShapeError(
            f"{instr}: index tile partitions must be in [16, 128] and a multiple of 16, got {i0}"
        )
    if i1 > 1 and i0 != PARTITIONS:
        raise NkiShapeError(
            f"{instr}: an index tile with {i1} columns needs exactly 128 partitions, got {i0}"
        )
    count = src.shape[0]
    if count % 16:
        raise NkiShapeError(f"{instr}: the gathered row count {count} must be a multiple of 16")
    if src.shape[1] != PARTITIONS and not versions.has("dma_transpose indirect src.shape[-1] < 128"):
        # NKI 0.4 release notes: the indirect form's innermost dimension was "exactly 128" before.
        raise NkiShapeError(
            f"{instr}: an indirect transpose needs src.shape[-1] == 128 in NKI "
            f"{versions.nki_version()} (<= 128 from NKI 0.4), got {src.shape}"
        )
    if i0 * i1 < count:
        raise NkiShapeError(
            f"{instr}: index tile {idx.shape} holds {i0 * i1} indices, fewer than the {count} "
            "gathered rows"
        )


def tensor_copy(dst: Tensor, src: Tensor, engine: Any = None, **kwargs: Any) -> None:
    """``dst = src`` between SBUF/PSUM tiles, converting the dtype."""
    instr = "nisa.tensor_copy"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    tensor_arg(dst, instr, "dst", ON_CHIP)
    tensor_arg(src, instr, "src", ON_CHIP)
    check_engine(instr, engine, [dst, src])
    check_dst_shape(instr, dst, src.shape)
    write(dst, read(src, instr, "src"))
    _charge(ctx, instr, engine, dst, [src])


# ----------------------------------------------------------------------------------------------
# Tensor Engine


def nc_matmul(
    dst: Tensor,
    stationary: Tensor,
    moving: Tensor,
    is_stationary_onezero: bool = False,
    is_moving_onezero: bool = False,
    is_transpose: bool = False,
    accumulate: Any = None,
    tile_position: Any = (),
    tile_size: Any = (),
    perf_mode: Any = None,
    **kwargs: Any,
) -> None:
    """``dst[M, N] (+)= stationary[K, M].T @ moving[K, N]`` on the Tensor Engine, fp32 accumulation.

    Contracts the partition axis of both inputs; K <= 128, M <= 128, N <= 512. Inputs in SBUF
    (bf16, fp16, fp8 or fp32; fp32 only with fp32), ``dst`` an fp32 PSUM tile.
    ``accumulate=True`` adds into ``dst`` (which must hold values), ``False`` overwrites it; the
    emulator requires it explicitly (stricter than NKI's ``None`` default, whose meaning varies
    across releases).
    """
    instr = "nisa.nc_matmul"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    if is_transpose:  # coverage: use nisa.nc_transpose
        raise NkiUnsupportedError(f"{instr}: is_transpose=True is not emulated; use nisa.nc_transpose")
    if tile_position or tile_size or perf_mode not in (None, "none"):
        raise NkiUnsupportedError(f"{instr}: tile_position/tile_size/perf_mode are not emulated")
    if not isinstance(accumulate, bool):
        # nc_matmul page: accumulate=None "auto-detects"; the emulator asks for an explicit bool
        # (stricter reading, inferred).
        raise NkiUnsupportedError(
            f"{instr}: pass accumulate=True (add into dst) or accumulate=False (overwrite dst) "
            f"explicitly, got {accumulate!r}"
        )
    # nc_matmul page / trainium_inferentia2_arch.rst: TensorE reads SBUF, writes PSUM.
    tensor_arg(stationary, instr, "stationary", (SBUF,))
    tensor_arg(moving, instr, "moving", (SBUF,))
    tensor_arg(dst, instr, "dst", (PSUM,))
    if stationary.ndim != 2 or moving.ndim != 2:
        raise NkiShapeError(
            f"{instr}: 2-D stationary [K, M] and moving [K, N], got {stationary.shape} and {moving.shape}"
        )
    k, m = stationary.shape
    k2, n = moving.shape
    if k > PARTITIONS or m > PARTITIONS or n > PSUM_BANK_FP32:
        # nc_matmul page, tile size: partitions <= 128, stationary free <= 128, moving free <= 512
        # on NeuronCore-v2/v3 (v4 allows more; the emulator keeps 512 on every target: stricter).
        raise NkiLimitError(
            f"matmul K/M/N over {PARTITIONS}/{PARTITIONS}/{PSUM_BANK_FP32}: K={k}, M={m}, N={n} "
            f"(stationary {stationary.shape}, moving {moving.shape})"
        )
    if k != k2:  # nc_matmul page: "partition dimension sizes ... must be identical"
        raise NkiShapeError(
            f"{instr}: stationary and moving must share the contraction (partition) size K, "
            f"got {stationary.shape} and {moving.shape}"
        )
    for arg, t in (("stationary", stationary), ("moving", moving)):
        if t.dtype not in _MATMUL_INPUT_DTYPES:  # nc_matmul page, data types
            raise NkiDtypeError(f"{instr}: {arg} dtype {t.dtype.name} is not a matmul input dtype")
    if (stationary.dtype == F32) != (moving.dtype == F32):
        # nc_matmul page: "if one of the input tiles is tfloat32/float32, the other tile must
        # also be tfloat32/float32".
        raise NkiDtypeError(
            f"{instr}: an fp32 matmul needs both inputs fp32, got {stationary.dtype.name} and "
            f"{moving.dtype.name}"
        )
    nc_version = ctx.target_info.nc_version
    if dst.dtype != F32 and not (nc_version >= 4 and dst.dtype == np.dtype(ml_dtypes.bfloat16)):
        # nc_matmul page: dst "must be a float32 tile in NeuronCore-v2 and NeuronCore-v3.
        # Starting NeuronCore-v4, dst can either be a float32 or bfloat16 tile" (the internal
        # accumulation is fp32; a bf16 dst rounds each write).
        raise NkiDtypeError(
            f"{instr}: the PSUM dst must be float32 on {ctx.target} (NeuronCore-v{nc_version}; "
            f"bfloat16 too from NeuronCore-v4), got {dst.dtype.name}"
        )
    check_dst_shape(instr, dst, (m, n))
    same_base_partition(instr, stationary, moving)
    operands = {"stationary": f32_values(stationary, instr, "stationary"),
                "moving": f32_values(moving, instr, "moving")}  # fmt: skip
    onezero = 0
    for arg, t, flag in (("stationary", stationary, is_stationary_onezero),
                         ("moving", moving, is_moving_onezero)):  # fmt: skip
        if not flag:
            continue
        if not np.isin(operands[arg], (0.0, 1.0)).all():
            # nc_matmul page: the flag "hints to the compiler" that the operand holds ones and
            # zeros only; a false hint would compute something else on hardware (inferred).
            raise NkiEmulatorError(
                f"{instr}: is_{arg}_onezero=True but {arg} holds values other than 0 and 1"
            )
        onezero += t.dtype == F32
    # An fp32 sum that overflows gives inf, as the PE's accumulator does: no numpy warning.
    with np.errstate(all="ignore"):
        product = operands["stationary"].T @ operands["moving"]
        if accumulate:
            product = read(dst, instr, "dst (accumulate=True adds into it)") + product
    write(dst, product)
    _charge(ctx, instr, None, dst, [stationary, moving], n_stationary=m, n_moving=n,
            fp32_onezero=onezero)


def nc_transpose(dst: Tensor, data: Tensor, engine: Any = None, **kwargs: Any) -> None:
    """``dst[F, P] = data[P, F].T`` on the Tensor Engine: SBUF -> PSUM, at most 128 x 128, same dtype."""
    instr = "nisa.nc_transpose"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    if engine is not None and getattr(engine, "value", engine) not in ("unknown", "tensor"):
        # coverage: the Vector Engine transpose is not emulated
        raise NkiUnsupportedError(f"{instr}: only the Tensor Engine transpose is emulated")
    # nc_transpose page: "Tensor Engine nc_transpose must read the input tile from SBUF and write
    # the transposed result to PSUM".
    tensor_arg(data, instr, "data", (SBUF,))
    tensor_arg(dst, instr, "dst", (PSUM,))
    if data.ndim != 2:  # coverage (the page flattens free axes; not emulated)
        raise NkiShapeError(f"{instr}: 2-D data only, got {data.shape}")
    if data.shape[0] > PARTITIONS or data.shape[1] > PARTITIONS:
        # nc_transpose is a matmul with data as the stationary tile (nc_transpose page): both
        # sizes bound by the stationary limits, 128 x 128.
        raise NkiLimitError(
            f"transpose over {PARTITIONS} x {PARTITIONS}: data shape {data.shape}"
        )
    if dst.dtype != data.dtype:
        # nc_transpose page: "The output dst tile must have the same data type as that of data."
        raise NkiDtypeError(
            f"{instr}: dst dtype {dst.dtype.name} must equal data dtype {data.dtype.name}"
        )
    check_dst_shape(instr, dst, data.shape[::-1])
    write(dst, read(data, instr, "data").T)
    _charge(ctx, instr, engine, dst, [data])


# ----------------------------------------------------------------------------------------------
# Scalar Engine


def activation(
    dst: Tensor,
    op: Any,
    data: Tensor,
    bias: Any = None,
    scale: Any = 1.0,
    reduce_op: Any = None,
    reduce_res: Tensor | None = None,
    reduce_cmd: reduce_cmd = reduce_cmd.idle,
    **kwargs: Any,
) -> None:
    """``dst = op(data * scale + bias)`` in fp32, with the Scalar Engine's reduce registers.

    ``bias`` and ``scale``: scalars or ``[P, 1]`` columns. The reduction follows NKI >= 0.3
    (SDK 2.29+): ``reduce_cmd`` drives 128 fp32 registers (one per partition):
    ``reset`` zeroes them, ``reduce`` adds the free-axis sum of this result (the fp32 values,
    before rounding to dst), ``reset_reduce`` does both, ``idle`` leaves them; passing
    ``reduce_res`` (``[P, 1]``) reads the registers out after the update. So the sum of *this*
    call reaches ``reduce_res`` only with ``reduce_cmd=nisa.reduce_cmd.reset_reduce`` (or
    ``reduce`` after a reset); ``reduce_op`` must then be ``nl.add``. A ``reduce_op`` with an
    ``idle``/``reset`` command, or a read of registers never reset, is rejected (strict reading:
    on hardware it would silently return stale register contents).
    """
    instr = "nisa.activation"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    tensor_arg(data, instr, "data", ON_CHIP)
    tensor_arg(dst, instr, "dst", ON_CHIP)
    fn = _op(_ACTIVATIONS, op, instr, "op")
    inputs: list = [data]
    scale_v = _scalar_or_column(scale, data, instr, "scale", inputs)
    bias_v = np.float32(0) if bias is None else _scalar_or_column(bias, data, instr, "bias", inputs)
    check_dst_shape(instr, dst, data.shape)
    same_base_partition(instr, *inputs)
    cmd = reduce_cmd
    if not isinstance(cmd, _RC):
        raise NkiUnsupportedError(f"{instr}: reduce_cmd must be a nisa.reduce_cmd, got {cmd!r}")
    if cmd is _RC.load_reduce:
        raise NkiUnsupportedError(f"{instr}: reduce_cmd=load_reduce is not emulated")
    accumulates = cmd in (_RC.reduce, _RC.reset_reduce)
    if reduce_op is not None and reduce_op not in (nl.add, np.add):
        raise NkiUnsupportedError(f"{instr}: reduce_op must be nl.add (the only Scalar Engine reduction)")
    if accumulates and reduce_op is None:  # activation page: the reduction needs reduce_op
        raise NkiShapeError(f"{instr}: reduce_cmd={cmd.name} needs reduce_op=nl.add")
    if reduce_op is not None and not accumulates:
        # activation page (0.3): reduce_cmd=idle "Not using the accumulator registers"; a reduce_op
        # without reduce/reset_reduce would reduce nothing (stricter reading, inferred).
        raise NkiEmulatorError(
            f"activation reduce_op=nl.add with reduce_cmd={cmd.name} reduces nothing: in NKI >= 0.3 "
            "pass reduce_cmd=nisa.reduce_cmd.reset_reduce to sum this activation into reduce_res"
        )
    with np.errstate(all="ignore"):
        result = fn(f32_values(data, instr, "data") * scale_v + bias_v).astype(F32, copy=False)
    if cmd is not _RC.idle or reduce_res is not None:
        p = data.shape[0]
        lanes = slice(data._p0, data._p0 + p)
        regs, valid = ctx.reduce_regs, ctx.reduce_regs_valid
        if cmd in (_RC.reset, _RC.reset_reduce):
            regs[lanes] = 0.0
            valid[lanes] = True
        if accumulates:
            if not valid[lanes].all():  # inferred: registers hold garbage until reset
                raise NkiUninitializedReadError(
                    f"read of memory never written: {instr} reduce_cmd=reduce adds into Scalar "
                    "Engine reduce registers never reset (use reset_reduce first)"
                )
            with np.errstate(all="ignore"):
                row_sums = reduce_values(np.add, result.reshape(p, -1), (1,), False)
                regs[lanes] = regs[lanes] + row_sums
        if reduce_res is not None:
            tensor_arg(reduce_res, instr, "reduce_res", ON_CHIP)
            if reduce_res.shape != (p, 1):  # activation page: "(data.shape[0], 1)"
                raise NkiShapeError(
                    f"shape mismatch between dst and the computed value: {instr} reduce_res must "
                    f"be [{p}, 1], got {reduce_res.describe()}"
                )
            if not valid[lanes].all():  # inferred, as above
                raise NkiUninitializedReadError(
                    f"read of memory never written: {instr} reduce_res reads Scalar Engine reduce "
                    f"registers never reset (reduce_cmd={cmd.name}; use reset_reduce)"
                )
            write(reduce_res, regs[lanes].reshape(p, 1))
    write(dst, result)
    _charge(ctx, instr, None, dst, [data], reduce=accumulates)


def activation_reduce(
    dst: Tensor,
    op: Any,
    data: Tensor,
    reduce_op: Any,
    reduce_res: Tensor,
    bias: Any = None,
    scale: Any = 1.0,
    **kwargs: Any,
) -> None:
    """``nisa.activation`` with ``reduce_cmd=reset_reduce``: ``reduce_res`` gets this call's sum."""
    activation(dst, op, data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res,
               reduce_cmd=reduce_cmd.reset_reduce, **kwargs)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Vector Engine


def tensor_scalar(
    dst: Tensor,
    data: Tensor,
    op0: Any,
    operand0: Any,
    reverse0: bool = False,
    op1: Any = None,
    operand1: Any = None,
    reverse1: bool = False,
    engine: Any = None,
    **kwargs: Any,
) -> None:
    """``dst = (data op0 operand0) op1 operand1`` in fp32; operands scalars or ``[P, 1]`` columns.

    ``reverse0`` computes ``operand0 op0 data``; ``reverse1`` computes ``operand1 op1 (...)``.
    """
    instr = "nisa.tensor_scalar"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    tensor_arg(data, instr, "data", ON_CHIP)
    tensor_arg(dst, instr, "dst", ON_CHIP)
    if (op1 is None) != (operand1 is None):  # tensor_scalar page: op1 uses operand1
        raise NkiShapeError(f"{instr}: op1 and operand1 go together (both set or both None)")
    inputs: list = [data]
    f0 = _op(_BINARY_OPS, op0, instr, "op0")
    v0 = _scalar_or_column(operand0, data, instr, "operand0", inputs)
    f1 = v1 = None
    if op1 is not None:
        f1 = _op(_BINARY_OPS, op1, instr, "op1")
        v1 = _scalar_or_column(operand1, data, instr, "operand1", inputs)
    check_engine(instr, engine, [dst] + inputs, (op0, op1))
    check_dst_shape(instr, dst, data.shape)
    same_base_partition(instr, *inputs)
    with np.errstate(all="ignore"):
        result = _apply(f0, f32_values(data, instr, "data"), v0, reverse0)
        if f1 is not None:
            result = _apply(f1, result, v1, reverse1)
    write(dst, result)
    _charge(ctx, instr, engine, dst, [data], ops=(op0,) if op1 is None else (op0, op1))


def tensor_scalar_reduce(
    dst: Tensor,
    data: Tensor,
    op0: Any,
    operand0: Any,
    reduce_op: Any,
    reduce_res: Tensor | None = None,
    reverse0: bool = False,
    reduce_cmd: reduce_cmd = reduce_cmd.reset_reduce,
    reduce_init: Any = None,
    reduce_res_negate: bool = False,
    **kwargs: Any,
) -> None:
    """``dst = data op0 operand0`` (as ``tensor_scalar``) and ``reduce_res [P, 1]`` = that result
    reduced over the free axes by ``reduce_op`` (add, multiply, max, min), on the Vector Engine.

    Emulated: ``reduce_cmd=reset_reduce`` (the default of the v2.32.0 page) with a ``reduce_res``
    tile; chaining through the accumulator (``reduce`` / ``load_reduce``, ``reduce_res=None``) is
    refused. ``reverse0`` is "not supported yet" on that page and refused too.
    """
    instr = "nisa.tensor_scalar_reduce"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    tensor_arg(data, instr, "data", ON_CHIP)
    tensor_arg(dst, instr, "dst", ON_CHIP)
    if reverse0:  # v2.32.0 page: reverse0 "(not supported yet)"
        raise NkiUnsupportedError(f"{instr}: reverse0 is not supported (the ISA page, v2.32.0)")
    if not isinstance(reduce_cmd, _RC) or reduce_cmd is not _RC.reset_reduce or reduce_init is not None:
        raise NkiUnsupportedError(
            f"{instr}: only reduce_cmd=reset_reduce without reduce_init is emulated, got {reduce_cmd!r}"
        )
    if reduce_res is None:
        raise NkiUnsupportedError(
            f"{instr}: reduce_res=None (keep the sum in the accumulator) is not emulated; pass a "
            "[P, 1] tile"
        )
    tensor_arg(reduce_res, instr, "reduce_res", ON_CHIP)
    fold = _op(_REDUCE_OPS, reduce_op, instr, "reduce_op")
    inputs: list = [data]
    f0 = _op(_BINARY_OPS, op0, instr, "op0")
    v0 = _scalar_or_column(operand0, data, instr, "operand0", inputs)
    check_dst_shape(instr, dst, data.shape)
    if reduce_res.shape != (data.shape[0], 1):  # the page: "(data.shape[0], 1)"
        raise NkiShapeError(
            f"shape mismatch between dst and the computed value: {instr} reduce_res must be "
            f"[{data.shape[0]}, 1], got {reduce_res.describe()}"
        )
    same_base_partition(instr, *inputs)
    with np.errstate(all="ignore"):
        result = _apply(f0, f32_values(data, instr, "data"), v0, False).astype(F32, copy=False)
        folded = reduce_values(fold, result.reshape(data.shape[0], -1), (1,), True)
    write(dst, result)
    write(reduce_res, -folded if reduce_res_negate else folded)
    _charge(ctx, instr, None, dst, [data], ops=(op0,))


def scalar_tensor_tensor(
    dst: Tensor,
    data: Tensor,
    op0: Any,
    operand0: Any,
    op1: Any,
    operand1: Tensor,
    reverse0: bool = False,
    reverse1: bool = False,
    **kwargs: Any,
) -> None:
    """``dst = (data op0 operand0) op1 operand1`` in fp32.

    ``operand0``: scalar or ``[P, 1]`` column; ``operand1``: a tile of ``data``'s shape. ``data``
    and ``operand1`` may not both be in PSUM.
    """
    instr = "nisa.scalar_tensor_tensor"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    tensor_arg(data, instr, "data", ON_CHIP)
    tensor_arg(operand1, instr, "operand1", ON_CHIP)
    tensor_arg(dst, instr, "dst", ON_CHIP)
    _not_both_psum(instr, data, operand1, "data and operand1")
    if operand1.shape != data.shape:
        # scalar_tensor_tensor page: data, operand1 and dst have the same partitions and elements
        # per partition (the emulator asks for equal shapes: stricter).
        raise NkiShapeError(
            f"{instr}: operand1 must have data's shape {data.shape}, got {operand1.describe()}"
        )
    inputs: list = [data, operand1]
    f0 = _op(_BINARY_OPS, op0, instr, "op0")
    f1 = _op(_BINARY_OPS, op1, instr, "op1")
    v0 = _scalar_or_column(operand0, data, instr, "operand0", inputs)
    check_dst_shape(instr, dst, data.shape)
    same_base_partition(instr, *inputs)
    with np.errstate(all="ignore"):
        result = _apply(f0, f32_values(data, instr, "data"), v0, reverse0)
        result = _apply(f1, result, f32_values(operand1, instr, "operand1"), reverse1)
    write(dst, result)
    _charge(ctx, instr, None, dst, [data, operand1], ops=(op0, op1))


def tensor_tensor(dst: Tensor, data1: Tensor, data2: Tensor, op: Any, engine: Any = None, **kwargs: Any) -> None:
    """``dst = data1 op data2`` elementwise in fp32 (same shapes; not both in PSUM)."""
    instr = "nisa.tensor_tensor"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    tensor_arg(data1, instr, "data1", ON_CHIP)
    tensor_arg(data2, instr, "data2", ON_CHIP)
    tensor_arg(dst, instr, "dst", ON_CHIP)
    _not_both_psum(instr, data1, data2, "data1 and data2")
    if data1.shape != data2.shape:
        # tensor_tensor page: "The two tiles must have the same partition axis size and the same
        # number of elements per partition" (equal shapes here: stricter).
        raise NkiShapeError(f"{instr}: data1 {data1.shape} and data2 {data2.shape} differ")
    fn = _op(_BINARY_OPS, op, instr, "op")
    check_engine(instr, engine, [dst, data1, data2])
    check_dst_shape(instr, dst, data1.shape)
    same_base_partition(instr, data1, data2)
    with np.errstate(all="ignore"):
        result = fn(f32_values(data1, instr, "data1"), f32_values(data2, instr, "data2"))
    write(dst, result)
    _charge(ctx, instr, engine, dst, [data1, data2], ops=(op,))


def tensor_tensor_scan(
    dst: Tensor,
    data0: Tensor,
    data1: Tensor,
    initial: Any,
    op0: Any,
    op1: Any,
    reverse0: bool = False,
    reverse1: bool = False,
    **kwargs: Any,
) -> None:
    """A scan along the free axis of each partition, on the Vector Engine, in fp32 (the
    tensor_tensor_scan page, v2.32.0): ``r[:, 0] = op1(op0(data0[:, 0], initial), data1[:, 0])``,
    ``r[:, i] = op1(op0(data0[:, i], r[:, i-1]), data1[:, i])``; ``reverse0`` / ``reverse1`` swap
    an operator's operands. ``initial``: a scalar or a ``[P, 1]`` tile. 2-D tiles only."""
    instr = "nisa.tensor_tensor_scan"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    tensor_arg(data0, instr, "data0", ON_CHIP)
    tensor_arg(data1, instr, "data1", ON_CHIP)
    tensor_arg(dst, instr, "dst", ON_CHIP)
    # The page: "data0 and data1 cannot both reside in PSUM".
    _not_both_psum(instr, data0, data1, "data0 and data1")
    if data0.shape != data1.shape or data0.ndim != 2:
        # The page: "the same partition axis size and the same number of elements per
        # partition" (equal 2-D shapes here: stricter; coverage).
        raise NkiShapeError(f"{instr}: 2-D data0 {data0.shape} and data1 {data1.shape} must match")
    f0 = _op(_BINARY_OPS, op0, instr, "op0")
    f1 = _op(_BINARY_OPS, op1, instr, "op1")
    inputs: list = [data0, data1]
    state = _scalar_or_column(initial, data0, instr, "initial", inputs)
    check_dst_shape(instr, dst, data0.shape)
    same_base_partition(instr, *inputs)
    a = f32_values(data0, instr, "data0")
    b = f32_values(data1, instr, "data1")
    result = np.empty(a.shape, F32)
    state = np.broadcast_to(np.asarray(state, F32).reshape(-1), (a.shape[0],)).astype(F32)
    with np.errstate(all="ignore"):
        for i in range(a.shape[1]):  # fp32 after every step (the page: "float32 math")
            inner = np.asarray(_apply(f0, a[:, i], state, reverse0), F32)
            state = np.asarray(_apply(f1, inner, b[:, i], reverse1), F32)
            result[:, i] = state
    write(dst, result)
    _charge(ctx, instr, None, dst, [data0, data1], ops=(op0, op1))


def tensor_reduce(
    dst: Tensor,
    op: Any,
    data: Tensor,
    axis: Any,
    negate: bool = False,
    keepdims: bool = False,
    **kwargs: Any,
) -> None:
    """``dst = op-reduce(data, axis)`` along free axes (never axis 0), fp32; ``negate`` negates it."""
    instr = "nisa.tensor_reduce"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    tensor_arg(data, instr, "data", ON_CHIP)
    tensor_arg(dst, instr, "dst", ON_CHIP)
    fn = _op(_REDUCE_OPS, op, instr, "op")
    axes = check_free_axes(instr, axis, data.ndim)
    with np.errstate(all="ignore"):
        result = reduce_values(fn, f32_values(data, instr, "data"), axes, keepdims)
    if negate:
        result = -result
    check_dst_shape(instr, dst, result.shape)
    write(dst, result)
    _charge(ctx, instr, None, dst, [data], ops=(op,))


def reciprocal(dst: Tensor, data: Tensor, **kwargs: Any) -> None:
    """``dst = 1 / data`` in fp32."""
    instr = "nisa.reciprocal"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    tensor_arg(data, instr, "data", ON_CHIP)
    tensor_arg(dst, instr, "dst", ON_CHIP)
    check_dst_shape(instr, dst, data.shape)
    with np.errstate(all="ignore"):
        result = np.float32(1) / f32_values(data, instr, "data")
    write(dst, result)
    _charge(ctx, instr, None, dst, [data])


def memset(dst: Tensor, value: Any, engine: Any = None, **kwargs: Any) -> None:
    """Fill the on-chip tile ``dst`` with the compile-time constant ``value``."""
    instr = "nisa.memset"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    # memset page: Vector or GpSimd engine writes an SBUF/PSUM tile (on-chip; inferred for PSUM).
    tensor_arg(dst, instr, "dst", ON_CHIP)
    check_engine(instr, engine, [dst])
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise NkiUnsupportedError(f"{instr}: value must be a compile-time number, got {value!r}")
    if dst.dtype.kind in "iu" and isinstance(value, (float, np.floating)):
        # NKI 0.3 release notes, breaking changes: memset "Enforces strict type matching between
        # value and destination dtype" (value=2.0 into an integer tile is a compile error).
        raise NkiDtypeError(
            f"{instr}: a float value {value!r} into the integer tile {dst.describe()} (NKI 0.3 "
            "enforces matching types: pass an int)"
        )
    write(dst, np.full(dst.shape, value))
    _charge(ctx, instr, engine, dst, [], value=value)


# ----------------------------------------------------------------------------------------------
# virtual registers (nki/api/nki/isa/__init__.py: VirtualRegister, register_alloc/_load/_move/
# _store): 32-bit engine-sequencer registers for dynamic loop bounds and dynamic addressing.


class VirtualRegister:
    """A 32-bit register of an engine sequencer (``nisa.register_alloc``).

    Usable as an ``nl.dynamic_range`` bound and as ``.ap(scalar_offset=...)``. Its value is a
    device value: Python cannot branch on it (``while reg:`` loops are not emulated).
    """

    __slots__ = ("_value", "_read_only")

    def __init__(self, value: int | None, read_only: str | None = None):
        self._value = value
        self._read_only = read_only  # the loop whose induction variable this is, if any

    def check_writable(self, instr: str) -> None:
        if self._read_only:
            # NKI 0.4 release notes (bug fixes): writing to a dynamic loop's induction variable
            # "now raise[s] AssertionError at trace time"; fori_loop page: it "has no effect".
            raise NkiUnsupportedError(
                f"write to a loop's induction variable: {instr} writes the {self._read_only} "
                "loop variable, which the loop alone controls (NKI 0.4 release notes; "
                "nki.language.fori_loop page)"
            )

    def read(self, what: str) -> int:
        if self._value is None:  # inferred: register_alloc(None) is uninitialized
            raise NkiUninitializedReadError(
                f"read of memory never written: {what} reads a VirtualRegister never set "
                "(register_alloc(None) without register_load/register_move)"
            )
        return self._value

    def __bool__(self):
        raise NkiUnsupportedError("`while reg:` loops over a VirtualRegister are not emulated")

    def __index__(self):
        raise NkiUnsupportedError(
            "a VirtualRegister holds a device value: it cannot be used as a Python int"
        )

    __int__ = __index__

    def __repr__(self) -> str:
        return "<nisa.VirtualRegister>"


def _int32(value: Any, what: str) -> int:
    v = int(value)
    if not -(2**31) <= v < 2**32:  # register_alloc page: 32-bit registers
        raise NkiLimitError(f"{what}: {v} does not fit a 32-bit register")
    return v


def register_alloc(x: Any = None) -> VirtualRegister:
    """A new virtual register, uninitialised (``None``) or holding the int ``x``."""
    if x is not None and (isinstance(x, bool) or not isinstance(x, (int, np.integer))):
        raise NkiUnsupportedError(f"nisa.register_alloc takes None or an int, got {x!r}")
    return VirtualRegister(None if x is None else _int32(x, "nisa.register_alloc"))


def _one_element(t: Any, instr: str, arg: str) -> Tensor:
    # register_load / register_store pages: a tensor with exactly one element, HBM or SBUF.
    tensor_arg(t, instr, arg, (SBUF,) + tuple(HBM_BUFFERS))
    if t.shape not in ((1,), (1, 1)):  # register_load/_store pages: exactly one element
        raise NkiShapeError(f"{instr}: {arg} must have shape [1] or [1, 1], got {t.describe()}")
    return t


def register_load(dst: VirtualRegister, src: Tensor) -> None:
    """``dst = src[0]``: a 32-bit value from a one-element HBM/SBUF tensor into a register."""
    instr = "nisa.register_load"
    begin(instr)
    if not isinstance(dst, VirtualRegister):
        raise NkiUnsupportedError(f"{instr}: dst must be a VirtualRegister")
    dst.check_writable(instr)
    _one_element(src, instr, "src")
    if src.dtype.itemsize > 4 or src.dtype.kind not in "iu":  # register_load: "up to 32-bit"
        raise NkiDtypeError(f"{instr}: src must hold a 32-bit (or narrower) integer, got {src.dtype.name}")
    dst._value = _int32(read(src, instr, "src").reshape(-1)[0], instr)


def register_move(dst: VirtualRegister, src: Any) -> None:
    """``dst = src``: a compile-time int or another register's value."""
    instr = "nisa.register_move"
    begin(instr)
    if not isinstance(dst, VirtualRegister):
        raise NkiUnsupportedError(f"{instr}: dst must be a VirtualRegister")
    dst.check_writable(instr)
    if isinstance(src, VirtualRegister):
        dst._value = src.read(instr)
    elif isinstance(src, (int, np.integer)) and not isinstance(src, bool):
        dst._value = _int32(src, instr)
    else:
        raise NkiUnsupportedError(f"{instr}: src must be an int or a VirtualRegister, got {src!r}")


def register_store(dst: Tensor, src: VirtualRegister) -> None:
    """``dst[0] = src``: a register's value into a one-element HBM/SBUF tensor."""
    instr = "nisa.register_store"
    begin(instr)
    if not isinstance(src, VirtualRegister):
        raise NkiUnsupportedError(f"{instr}: src must be a VirtualRegister")
    _one_element(dst, instr, "dst")
    write(dst, np.full(dst.shape, src.read(instr)))


def iota(dst: Tensor, pattern: Any, offset: int = 0, channel_multiplier: int = 0, **kwargs: Any) -> None:
    """``dst[c, i...] = offset + c * channel_multiplier + sum(i_k * step_k)`` (int32 arithmetic).

    ``pattern`` is ``[[step, num], ...]`` (up to 4 pairs) whose counts multiply to the elements
    per partition of ``dst`` (an SBUF tile); values are cast to ``dst.dtype``.
    """
    instr = "nisa.iota"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    tensor_arg(dst, instr, "dst", (SBUF,))  # iota page: "The output dst tile must be in SBUF."
    try:
        pairs = [(int(a), int(b)) for a, b in pattern]
    except (TypeError, ValueError) as exc:
        raise NkiShapeError(f"{instr}: pattern must be [[step, num], ...], got {pattern!r}") from exc
    if not 1 <= len(pairs) <= 4:  # iota page: "up to 4D pattern"
        raise NkiShapeError(f"{instr}: pattern needs 1 to 4 [step, num] pairs, got {len(pairs)}")
    per_partition = int(np.prod(dst.shape[1:], dtype=np.int64))
    counts = int(np.prod([n for _, n in pairs], dtype=np.int64))
    if counts != per_partition:
        # iota page: "The total number of elements in pattern must match the number of elements
        # per partition in the dst tile."
        raise NkiShapeError(
            f"{instr}: pattern {pairs} has {counts} elements, dst {dst.describe()} has "
            f"{per_partition} per partition"
        )
    values = np.zeros([n for _, n in pairs], np.int64) + int(offset)
    for axis, (step, n) in enumerate(pairs):
        shape = [1] * len(pairs)
        shape[axis] = n
        values = values + (np.arange(n, dtype=np.int64) * step).reshape(shape)
    channels = np.arange(dst.shape[0], dtype=np.int64) * int(channel_multiplier)
    full = channels.reshape(-1, 1) + values.reshape(1, -1)
    # iota page: computed in 32-bit integer arithmetic (wraps), then cast to dst.dtype.
    full = full.astype(np.int32).reshape(dst.shape)
    write(dst, full)
    _charge(ctx, instr, None, dst, [])


# Selection instructions (max8, nc_find_index8, nc_match_replace8, nc_n_gather, select_reduce):
# their rules and sources are in _select.py.
from ._select import (  # noqa: E402
    max8,
    nc_find_index8,
    nc_match_replace8,
    nc_n_gather,
    select_reduce,
    topk,
)

__all__ += ["tensor_scalar_reduce", "tensor_tensor_scan"]
__all__ += ["max8", "nc_find_index8", "nc_match_replace8", "nc_n_gather", "select_reduce", "topk"]
