"""The ``nki.language`` subset, emulated on the host (bind it as ``nl``).

Tile-returning functions (``load``, ``copy``, ``broadcast_to``, the elementwise and reduction
functions) allocate a new SBUF tile for their result, which counts against the SBUF budget for as
long as it is referenced. Arithmetic runs in fp32 (as the engines do) and is rounded once to the
result dtype (round-to-nearest-even for bf16).
"""

from __future__ import annotations

import builtins
from typing import Any

import ml_dtypes
import numpy as np

from ..constants import PARTITIONS, PSUM_BANK_FP32
from ._core import (
    _FP8_E4M3,
    F32,
    FLOAT_DTYPES,
    HBM,
    HBM_BUFFERS,
    ON_CHIP,
    PRIVATE_HBM,
    PSUM,
    SBUF,
    SHARED_HBM,
    AccessPattern,
    Tensor,
    as_dtype,
    current_context,
    read,
    write,
)
from .errors import (
    NkiMemorySpaceError,
    NkiShapeError,
    NkiUnsupportedError,
)

__all__ = [
    "bfloat16", "float32", "float16", "float8_e4m3", "float8_e5m2", "int32", "uint32", "int16",
    "uint16", "int8", "uint8", "sbuf", "psum", "hbm", "shared_hbm", "private_hbm", "tile_size",
    "ndarray", "zeros", "full", "load", "store", "copy", "broadcast_to", "add", "subtract",
    "multiply", "divide", "maximum", "minimum", "negative", "exp", "log", "tanh", "sqrt", "square",
    "relu", "reciprocal", "max", "min", "sum", "affine_range", "static_range", "sequential_range",
]  # fmt: skip

# dtypes: numpy scalar types; a tensor's ``.dtype`` compares equal to them.
bfloat16 = ml_dtypes.bfloat16
float32 = np.float32
float16 = np.float16
float8_e4m3 = _FP8_E4M3
float8_e5m2 = ml_dtypes.float8_e5m2
int32 = np.int32
uint32 = np.uint32
int16 = np.int16
uint16 = np.uint16
int8 = np.int8
uint8 = np.uint8

# buffers
sbuf = SBUF
psum = PSUM
hbm = HBM
shared_hbm = SHARED_HBM
private_hbm = PRIVATE_HBM


class tile_size:
    """Hardware tile limits (``nl.tile_size.pmax`` etc.)."""

    pmax = PARTITIONS
    psum_fmax = PSUM_BANK_FP32
    gemm_stationary_fmax = PARTITIONS
    gemm_moving_fmax = PSUM_BANK_FP32


# Loops: in NKI >= 0.3 these are plain Python ranges, unrolled by tracing.
def affine_range(*args: int, **kwargs: Any) -> range:
    return range(*args)


def static_range(*args: int, **kwargs: Any) -> range:
    return range(*args)


def sequential_range(*args: int, **kwargs: Any) -> range:
    return range(*args)


# ----------------------------------------------------------------------------------------------
# helpers shared with isa.py


def begin():
    """Start an instruction: the live on-chip memory must fit (see _core.Context.check_capacity)."""
    ctx = current_context()
    ctx.check_capacity()
    return ctx


def no_extra(kwargs: dict, instr: str) -> None:
    kwargs.pop("name", None)
    if kwargs:
        raise NkiUnsupportedError(f"{instr}: arguments not emulated: {sorted(kwargs)}")


def tensor_arg(x: Any, instr: str, arg: str, buffers: tuple = ()) -> Tensor:
    if not isinstance(x, Tensor):
        raise NkiUnsupportedError(
            f"{instr}: {arg} must be a kernel tensor (tile or view), got {type(x).__name__}"
        )
    if buffers and x.buffer not in buffers:
        names = " or ".join(b.name for b in buffers)
        raise NkiMemorySpaceError(
            f"operand in the wrong memory: {instr} {arg} must be in {names}, got {x.describe()}"
        )
    return x


def same_base_partition(instr: str, *tiles: Any) -> None:
    """On-chip inputs of one instruction must start at the same partition.

    The compiler rejects two SBUF inputs of one instruction at different base partitions
    (NCC_IBIR297, CONTRACT.md section 4); applied here to every on-chip input, the stricter reading.
    """
    starts = {t._p0 for t in tiles if isinstance(t, Tensor) and t.buffer.on_chip}
    if len(starts) > 1:
        raise NkiShapeError(
            f"inputs at different base partitions: {instr} reads on-chip inputs starting at "
            f"partitions {sorted(starts)} (compiler error NCC_IBIR297)"
        )


def check_dst_shape(instr: str, dst: Tensor, shape: tuple) -> None:
    if tuple(dst.shape) != tuple(shape):
        raise NkiShapeError(
            f"shape mismatch between dst and the computed value: {instr} computes shape "
            f"{tuple(shape)}, dst is {dst.describe()}"
        )


def check_free_axes(instr: str, axis: Any, ndim: int) -> tuple[int, ...]:
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    norm = []
    for a in axes:
        a = int(a)
        if not -ndim <= a < ndim:
            raise NkiShapeError(f"{instr}: axis {a} out of range for a rank-{ndim} tile")
        norm.append(a % ndim)
    if 0 in norm:
        raise NkiShapeError(
            f"reduction over the partition axis: {instr} axis={axis} includes axis 0; engines "
            "reduce along free axes only (transpose first, or use a matmul against ones)"
        )
    if not norm:
        raise NkiShapeError(f"{instr}: empty reduction axis")
    return tuple(sorted(set(norm)))


def default_dtype(tiles: list[Tensor]) -> np.dtype:
    dts = [t.dtype for t in tiles]
    if len(set(dts)) == 1:
        return dts[0]
    if F32 in dts:
        return F32
    floats = [d for d in dts if d in FLOAT_DTYPES]
    return floats[0] if floats else dts[0]


def f32_values(x: Tensor, instr: str, arg: str) -> np.ndarray:
    return read(x, instr, arg).astype(F32, copy=False)


# ----------------------------------------------------------------------------------------------
# allocation and data movement


def ndarray(shape: Any, dtype: Any, buffer: Any = SBUF, name: str = "", **kwargs: Any) -> Tensor:
    """A new tensor ``[shape]`` of ``dtype`` in ``buffer``; its contents are garbage until written.

    On-chip buffers (``sbuf``, ``psum``) use axis 0 as the partition axis (at most 128); a PSUM
    tile holds at most 2 KiB per partition. Kernel outputs go in ``nl.shared_hbm``.
    """
    no_extra(kwargs, "nl.ndarray")
    return current_context().allocate(shape, dtype, buffer, name)


def full(shape: Any, fill_value: Any, dtype: Any, buffer: Any = SBUF, name: str = "", **kwargs: Any) -> Tensor:
    """``nl.ndarray`` filled with ``fill_value`` (one memset instruction)."""
    no_extra(kwargs, "nl.full")
    ctx = begin()
    t = ctx.allocate(shape, dtype, buffer, name or "nl.full")
    write(t, np.asarray(fill_value, F32))
    return t


def zeros(shape: Any, dtype: Any, buffer: Any = SBUF, name: str = "", **kwargs: Any) -> Tensor:
    """``nl.ndarray`` filled with zeros."""
    return full(shape, 0.0, dtype, buffer, name or "nl.zeros", **kwargs)


def load(src: Tensor, dtype: Any = None, **kwargs: Any) -> Tensor:
    """A new SBUF tile holding ``src`` (an HBM tensor or view; axis 0 becomes the partition axis)."""
    instr = "nl.load"
    no_extra(kwargs, instr)
    ctx = begin()
    tensor_arg(src, instr, "src", HBM_BUFFERS)
    values = read(src, instr, "src")
    tile = ctx.allocate(src.shape, src.dtype if dtype is None else dtype, SBUF, "nl.load")
    write(tile, values)
    return tile


def store(dst: Tensor, value: Tensor, **kwargs: Any) -> None:
    """Write the SBUF tile ``value`` into the HBM tensor (or view) ``dst``, converting the dtype."""
    instr = "nl.store"
    no_extra(kwargs, instr)
    begin()
    tensor_arg(dst, instr, "dst", HBM_BUFFERS)
    tensor_arg(value, instr, "value", (SBUF,))  # a DMA cannot read PSUM
    check_dst_shape(instr, dst, value.shape)
    write(dst, read(value, instr, "value"))


def copy(x: Tensor, dtype: Any = None, **kwargs: Any) -> Tensor:
    """A new SBUF tile copied (and cast) from the SBUF or PSUM tile ``x``."""
    instr = "nl.copy"
    no_extra(kwargs, instr)
    ctx = begin()
    tensor_arg(x, instr, "x", ON_CHIP)
    values = read(x, instr, "x")
    tile = ctx.allocate(x.shape, x.dtype if dtype is None else dtype, SBUF, "nl.copy")
    write(tile, values)
    return tile


def broadcast_to(src: Tensor, shape: Any = None, **kwargs: Any) -> Tensor:
    """A new SBUF tile of ``shape``: same rank as ``src``, each axis equal or broadcast from 1.

    Broadcasting the partition axis (``[1, F] -> [P, F]``) is allowed here, as in NKI.
    """
    instr = "nl.broadcast_to"
    no_extra(kwargs, instr)
    if shape is None:
        raise NkiShapeError(f"{instr} needs shape=")
    ctx = begin()
    tensor_arg(src, instr, "src", ON_CHIP)
    shape = tuple(int(s) for s in shape)
    if len(shape) != src.ndim or any(s != d and d != 1 for s, d in zip(shape, src.shape)):
        raise NkiShapeError(
            f"{instr}: cannot broadcast {src.shape} to {shape} (same rank; each axis equal or from 1)"
        )
    values = read(src, instr, "src")
    tile = ctx.allocate(shape, src.dtype, SBUF, "nl.broadcast_to")
    write(tile, np.broadcast_to(values, shape))
    return tile


# ----------------------------------------------------------------------------------------------
# elementwise and reductions


def _elementwise(name: str, fn, operands: tuple, dtype: Any) -> Tensor:
    instr = f"nl.{name}"
    ctx = begin()
    tiles = [o for o in operands if isinstance(o, Tensor)]
    if not tiles:
        raise NkiUnsupportedError(f"{instr} needs at least one tile operand")
    values = []
    for i, o in enumerate(operands):
        if isinstance(o, Tensor):
            tensor_arg(o, instr, f"operand {i}", ON_CHIP)
            values.append(f32_values(o, instr, f"operand {i}"))
        elif isinstance(o, (int, float, np.integer, np.floating)) and not isinstance(o, bool):
            values.append(np.float32(o))
        elif isinstance(o, AccessPattern):
            raise NkiUnsupportedError(f"{instr}: access patterns are dma_copy operands only")
        else:
            raise NkiUnsupportedError(f"{instr}: operand {i} of type {type(o).__name__}")
    shapes = [t.shape for t in tiles]
    ndim = len(shapes[0])
    if any(len(s) != ndim for s in shapes):
        raise NkiShapeError(f"{instr}: operands of different rank {shapes}")
    out_shape = []
    for axis in range(ndim):
        sizes = {s[axis] for s in shapes}
        big = sizes - {1}
        if len(big) > 1 or (axis == 0 and len(sizes) > 1):
            raise NkiShapeError(
                f"{instr}: operand shapes {shapes} do not line up (the partition axis must match; "
                "free axes may broadcast from 1; use nl.broadcast_to for the partition axis)"
            )
        out_shape.append(builtins.max(sizes))
    same_base_partition(instr, *tiles)
    with np.errstate(all="ignore"):
        result = fn(*values)
    out_dtype = default_dtype(tiles) if dtype is None else as_dtype(dtype, instr)
    tile = ctx.allocate(tuple(out_shape), out_dtype, SBUF, instr)
    write(tile, np.broadcast_to(result, tuple(out_shape)))
    return tile


def _binary(name: str, fn: Any) -> Any:
    def op(x: Any, y: Any, dtype: Any = None, **kwargs: Any) -> Tensor:
        no_extra(kwargs, f"nl.{name}")
        return _elementwise(name, fn, (x, y), dtype)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = (
        f"``nl.{name}(x, y, dtype=None)``: elementwise in fp32 on SBUF/PSUM tiles (or scalars), "
        "broadcasting like NKI; returns a new SBUF tile."
    )
    return op


def _unary(name: str, fn: Any) -> Any:
    def op(x: Tensor, dtype: Any = None, **kwargs: Any) -> Tensor:
        no_extra(kwargs, f"nl.{name}")
        return _elementwise(name, fn, (x,), dtype)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = (
        f"``nl.{name}(x, dtype=None)``: elementwise in fp32 on an SBUF/PSUM tile; returns a new "
        "SBUF tile."
    )
    return op


def _relu(v: np.ndarray) -> np.ndarray:
    return np.maximum(v, np.float32(0))


def _reciprocal(v: np.ndarray) -> np.ndarray:
    return np.float32(1) / v


add = _binary("add", np.add)
subtract = _binary("subtract", np.subtract)
multiply = _binary("multiply", np.multiply)
divide = _binary("divide", np.divide)
maximum = _binary("maximum", np.maximum)
minimum = _binary("minimum", np.minimum)
negative = _unary("negative", np.negative)
exp = _unary("exp", np.exp)
log = _unary("log", np.log)
tanh = _unary("tanh", np.tanh)
sqrt = _unary("sqrt", np.sqrt)
square = _unary("square", np.square)
relu = _unary("relu", _relu)
reciprocal = _unary("reciprocal", _reciprocal)


def reduce_values(ufunc, values: np.ndarray, axes: tuple[int, ...], keepdims: bool) -> np.ndarray:
    """fp32 reduction along free axes; sums accumulate in float64 and round once to fp32."""
    if ufunc is np.add:
        return np.add.reduce(values, axis=axes, keepdims=keepdims, dtype=np.float64).astype(F32)
    return ufunc.reduce(values, axis=axes, keepdims=keepdims)


def _reduction(name: str, ufunc, x: Tensor, axis: Any, dtype: Any, keepdims: bool) -> Tensor:
    instr = f"nl.{name}"
    ctx = begin()
    tensor_arg(x, instr, "x", ON_CHIP)
    axes = check_free_axes(instr, axis, x.ndim)
    with np.errstate(all="ignore"):
        result = reduce_values(ufunc, f32_values(x, instr, "x"), axes, keepdims)
    out_dtype = x.dtype if dtype is None else as_dtype(dtype, instr)
    tile = ctx.allocate(result.shape, out_dtype, SBUF, instr)
    write(tile, result)
    return tile


def max(x: Tensor, axis: Any, dtype: Any = None, keepdims: bool = False, **kwargs: Any) -> Tensor:  # noqa: A001
    """Maximum along free axes ``axis`` (never axis 0, the partition axis)."""
    no_extra(kwargs, "nl.max")
    return _reduction("max", np.maximum, x, axis, dtype, keepdims)


def min(x: Tensor, axis: Any, dtype: Any = None, keepdims: bool = False, **kwargs: Any) -> Tensor:  # noqa: A001
    """Minimum along free axes ``axis`` (never axis 0, the partition axis)."""
    no_extra(kwargs, "nl.min")
    return _reduction("min", np.minimum, x, axis, dtype, keepdims)


def sum(x: Tensor, axis: Any, dtype: Any = None, keepdims: bool = False, **kwargs: Any) -> Tensor:  # noqa: A001
    """Sum along free axes ``axis`` (never axis 0, the partition axis)."""
    no_extra(kwargs, "nl.sum")
    return _reduction("sum", np.add, x, axis, dtype, keepdims)
