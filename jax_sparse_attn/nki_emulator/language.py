"""The ``nki.language`` subset, emulated on the host (bind it as ``nl``).

Tile-returning functions (``load``, ``copy``, ``broadcast_to``, the elementwise and reduction
functions) allocate a new SBUF tile for their result, which counts against the SBUF budget for as
long as it is referenced. Arithmetic runs in fp32 (as the engines do) and is rounded once to the
result dtype (round-to-nearest-even for bf16).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from ..constants import PARTITIONS, PSUM_BANK_FP32
from ._core import (
    _FP8_E4M3,
    _FP8_E4M3FN,
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
    check_in_scope,
    current_context,
    read,
    write,
)
from . import versions
from .errors import (
    NkiMemorySpaceError,
    NkiShapeError,
    NkiUnsupportedError,
)

__all__ = [
    "bfloat16", "float32", "float16", "float8_e4m3", "float8_e4m3fn", "float8_e5m2", "int32", "uint32", "int16",
    "uint16", "int8", "uint8", "sbuf", "psum", "hbm", "shared_hbm", "private_hbm", "tile_size",
    "ndarray", "zeros", "full", "load", "store", "copy", "broadcast_to", "add", "subtract",
    "multiply", "divide", "maximum", "minimum", "negative", "exp", "log", "tanh", "sqrt", "square",
    "relu", "reciprocal", "max", "min", "sum", "affine_range", "static_range", "sequential_range",
    "dynamic_range", "fori_loop",
]  # fmt: skip

# dtypes: numpy scalar types; a tensor's ``.dtype`` compares equal to them.
bfloat16 = ml_dtypes.bfloat16
float32 = np.float32
float16 = np.float16
float8_e4m3 = _FP8_E4M3
float8_e4m3fn = _FP8_E4M3FN  # language pages: nl.float8_e4m3fn (NKI >= 0.2.0)
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


# Loops. nki/deep-dives/nki-dynamic-loops.rst: static_range, affine_range and sequential_range take
# compile-time bounds and are fully unrolled, so here they are plain Python ranges: every
# iteration's instructions are part of the compiled program. From NKI 0.6 all three are deprecated
# in favour of Python's own range (language pages at v2.32.0). Loops the hardware runs, whose body
# is compiled once: nl.dynamic_range (deprecated in 0.6, removed in 0.7) and nl.fori_loop (0.6+).
# What each NKI version has: versions.py.
def _check_bounds(kind: str, args: tuple) -> None:
    from .isa import VirtualRegister

    for a in args:
        if isinstance(a, (LoopIndex, VirtualRegister)) or not isinstance(a, (int, np.integer)):
            # nki-dynamic-loops.rst: "The other NKI range iterators ... all require compile-time
            # constant bounds."
            raise NkiUnsupportedError(
                f"nl.{kind} needs compile-time int bounds, got {type(a).__name__} "
                "(nki/deep-dives/nki-dynamic-loops.rst; runtime bounds need nl.fori_loop)"
            )


def static_range(*args: int, **kwargs: Any) -> range:
    """Fully unrolled loop over compile-time ints (deprecated from NKI 0.6: use ``range``)."""
    versions.requires("nl.static_range")
    _check_bounds("static_range", args)
    return range(*args)


def affine_range(*args: int, **kwargs: Any) -> range:
    """Fully unrolled loop (deprecated: ``static_range`` in NKI 0.3, ``range`` from 0.6)."""
    versions.requires("nl.affine_range")
    _check_bounds("affine_range", args)
    return range(*args)


def sequential_range(*args: int, **kwargs: Any) -> range:
    """Fully unrolled loop (deprecated: ``static_range`` in NKI 0.3, ``range`` from 0.6)."""
    versions.requires("nl.sequential_range")
    _check_bounds("sequential_range", args)
    return range(*args)


class LoopIndex:
    """The induction variable of an ``nl.dynamic_range`` loop in NKI 0.3: opaque to Python.

    ``nki-dynamic-loops.rst``: "The loop variable is a device register, not a Python int. You
    cannot use it in host-side Python expressions". The NKI 0.3 release notes (known issues) add:
    it "cannot be used as a scalar_offset in access patterns or in arithmetic expressions for
    computing tile offsets". (The deep dive's last example passes it as ``scalar_offset``; the
    emulator takes the stricter known-issues reading.) So any use of it raises; per-iteration
    offsets come from a counter in SBUF (a ``[1, 1]`` int32 tile updated by an instruction) or
    a ``VirtualRegister``, passed as ``.ap(scalar_offset=...)``. From NKI 0.4 the variable is a
    read-only ``VirtualRegister`` instead (:class:`LoopRegister`).
    """

    __slots__ = ("_value",)

    def __init__(self, value: int):
        self._value = value

    def _refuse(self, *args: Any, **kwargs: Any):
        raise NkiUnsupportedError(
            "the nl.dynamic_range loop variable cannot be used in Python expressions, index "
            "arithmetic or as a scalar_offset (NKI 0.3 release notes, known issues; "
            "nki/deep-dives/nki-dynamic-loops.rst): keep a [1, 1] int32 SBUF counter (or a "
            "VirtualRegister) and pass it as .ap(scalar_offset=...)"
        )

    __index__ = __int__ = __float__ = __bool__ = __hash__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __floordiv__ = __rfloordiv__ = __mod__ = __truediv__ = __eq__ = __ne__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = _refuse

    def __repr__(self) -> str:
        return "<nl.dynamic_range loop variable>"


def _loop_register(value: int, loop: str):
    """The induction variable of a hardware loop from NKI 0.4 on: a ``VirtualRegister`` holding
    the iteration value, usable as ``scalar_offset``, which the kernel may not write ([RN 0.4]:
    writes "raise AssertionError at trace time"; fori_loop page: "writing to i has no effect")."""
    from .isa import VirtualRegister

    return VirtualRegister(int(value), read_only=loop)


def _loop_bound(value: Any, loop: str) -> int:
    from .isa import VirtualRegister

    if isinstance(value, VirtualRegister):
        return value.read(f"{loop} bound")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        # nki-dynamic-loops.rst / fori_loop page: bounds are ints or VirtualRegisters.
        raise NkiUnsupportedError(
            f"{loop} bounds are ints or VirtualRegisters, got {type(value).__name__}"
        )
    return int(value)


def _loop_step(step: Any, loop: str) -> int:
    # nki-dynamic-loops.rst / fori_loop page: "step: must be a compile-time positive int".
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step <= 0:
        raise NkiUnsupportedError(
            f"{loop} step must be a compile-time positive int, got {step!r} "
            "(nki/deep-dives/nki-dynamic-loops.rst; nki.language.fori_loop page)"
        )
    return int(step)


class DynamicRange:
    """``nl.dynamic_range``: a hardware loop; the body is compiled once, run ``trip`` times.

    The emulator runs the body once per iteration (so values and costs are those of every
    iteration) but counts its instructions in ``compiled_instructions`` only on the first
    iteration. A loop with zero trips runs nothing and so counts nothing (a limitation: its body
    is still compiled on hardware).
    """

    def __init__(self, start: Any, stop: Any = None, step: Any = 1):
        if stop is None:
            start, stop = 0, start
        self.start, self.stop, self.step = start, stop, _loop_step(step, "nl.dynamic_range")

    def __iter__(self):
        ctx = current_context()
        lo = _loop_bound(self.start, "nl.dynamic_range")
        hi = _loop_bound(self.stop, "nl.dynamic_range")
        register = versions.has("loop variable as scalar_offset")
        for n, value in enumerate(range(lo, hi, self.step)):
            repeat = 1 if n > 0 else 0
            ctx.repeat_depth += repeat
            try:
                yield _loop_register(value, "nl.dynamic_range") if register else LoopIndex(value)
            finally:
                ctx.repeat_depth -= repeat


def dynamic_range(start: Any, stop: Any = None, step: int = 1) -> DynamicRange:
    """A loop the hardware runs (``nki/deep-dives/nki-dynamic-loops.rst``): never unrolled.

    ``start``/``stop`` are ints or ``nisa.VirtualRegister``; ``step`` a positive int. The loop
    variable is opaque in NKI 0.3 (:class:`LoopIndex`), a read-only register from 0.4. Deprecated
    in NKI 0.6 and removed in 0.7 (use :func:`fori_loop`).
    """
    versions.requires("nl.dynamic_range")
    return DynamicRange(start, stop, step)


def fori_loop(lower: Any, upper: Any, body_fun: Any, step: int = 1) -> None:
    """``nl.fori_loop(lower, upper, body_fun, step=1)`` (NKI 0.6+): a hardware loop running
    ``body_fun(i)`` for ``i`` in ``range(lower, upper, step)``; its body is compiled once.

    nki.language.fori_loop page (v2.32.0): ``lower``/``upper`` ints or VirtualRegisters, ``step``
    a compile-time positive int; ``i`` a VirtualRegister "passed by value" (usable as
    ``scalar_offset``; the emulator refuses writes to it); the body returns None and carries any
    other state "through SBUF/HBM". The emulator enforces that: a body returning a value raises,
    and a tensor allocated in the body is dead once its iteration ends (any later use raises).
    Instruction counts as :class:`DynamicRange`; returns None.
    """
    versions.requires("nl.fori_loop")
    if not callable(body_fun):
        raise NkiUnsupportedError(f"nl.fori_loop: body_fun must be callable, got {body_fun!r}")
    ctx = current_context()
    step = _loop_step(step, "nl.fori_loop")
    lo, hi = _loop_bound(lower, "nl.fori_loop"), _loop_bound(upper, "nl.fori_loop")
    where = f"body {getattr(body_fun, '__name__', 'body_fun')}"
    for n, value in enumerate(range(lo, hi, step)):
        repeat = 1 if n > 0 else 0
        ctx.repeat_depth += repeat
        ctx.loop_scopes.append([])
        try:
            result = body_fun(_loop_register(value, "nl.fori_loop"))
        finally:
            ctx.repeat_depth -= repeat
            for ref in ctx.loop_scopes.pop():
                st = ref()
                if st is not None:  # still referenced after its iteration: dead from now on
                    st.closed_by = f"nl.fori_loop {where}, iteration {value}"
                del st
        if result is not None:
            # fori_loop page: "body_fun: function (i: VirtualRegister) -> None"; "Returns: None".
            raise NkiUnsupportedError(
                f"a fori_loop body returns nothing: {where} returned {type(result).__name__}; "
                "carry loop state in SBUF/HBM tensors allocated before the loop "
                "(nki.language.fori_loop page)"
            )
    return None


# SPMD launch (nki/get-started/about/lnc.rst; nki/api/nki/language/__init__.py).
def program_id(axis: int = 0) -> int:
    """Index of this program in the launch grid (0 without a grid); ``axis`` must be 0."""
    ctx = current_context()
    if axis != 0:
        raise NkiUnsupportedError(
            f"nl.program_id({axis}): the NKI >= 0.3 launch grid has one axis "
            "(nki/get-started/about/lnc.rst)"
        )
    return ctx.program_id


def num_programs(axes: int = 0) -> int:
    """Number of programs in the launch grid (1 without a grid); ``axes`` must be 0."""
    ctx = current_context()
    if axes not in (0, None):
        raise NkiUnsupportedError(
            f"nl.num_programs({axes}): the NKI >= 0.3 launch grid has one axis "
            "(nki/get-started/about/lnc.rst)"
        )
    return ctx.launch.grid


def program_ndim() -> int:
    """Number of launch-grid dimensions: 0 without a grid, else 1."""
    return 1 if current_context().launch.grid > 1 else 0


# ----------------------------------------------------------------------------------------------
# helpers shared with isa.py


def begin(instr: str):
    """Start the instruction ``instr``: count it; the live on-chip memory must fit (see
    _core.Context.begin_instruction). Returns the running program's context."""
    ctx = current_context()
    ctx.begin_instruction(instr)
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
    check_in_scope(x._st, instr, arg)
    if buffers and x.buffer not in buffers:
        # Each caller passes the memories its instruction's page allows.
        names = " or ".join(b.name for b in buffers)
        raise NkiMemorySpaceError(
            f"operand in the wrong memory: {instr} {arg} must be in {names}, got {x.describe()}"
        )
    return x


def same_base_partition(instr: str, *tiles: Any) -> None:
    """On-chip inputs of one instruction must start at the same partition.

    The compiler rejects two SBUF inputs of one instruction at different base partitions
    (NCC_IBIR297, recorded in jax_sparse_attn/constants.py and docs/nki-emulator.md: a project
    observation, not a documented rule); applied here to every on-chip input, the stricter reading.
    """
    starts = {t._p0 for t in tiles if isinstance(t, Tensor) and t.buffer.on_chip}
    if len(starts) > 1:
        raise NkiShapeError(
            f"inputs at different base partitions: {instr} reads on-chip inputs starting at "
            f"partitions {sorted(starts)} (compiler error NCC_IBIR297)"
        )


def check_dst_shape(instr: str, dst: Tensor, shape: tuple) -> None:
    if tuple(dst.shape) != tuple(shape):
        # Inferred (stricter than pages asking for equal partitions and elements per partition):
        # dst has exactly the computed value's shape; there is no implicit broadcast into dst.
        raise NkiShapeError(
            f"shape mismatch between dst and the computed value: {instr} computes shape "
            f"{tuple(shape)}, dst is {dst.describe()}"
        )


def check_free_axes(instr: str, axis: Any, ndim: int) -> tuple[int, ...]:
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    norm = []
    for a in axes:
        a = int(a)
        if not -ndim <= a < ndim:  # inferred
            raise NkiShapeError(f"{instr}: axis {a} out of range for a rank-{ndim} tile")
        norm.append(a % ndim)
    if 0 in norm:
        # tensor_reduce page: "Axis 0 (partition axis) cannot be reduced."
        raise NkiShapeError(
            f"reduction over the partition axis: {instr} axis={axis} includes axis 0; engines "
            "reduce along free axes only (transpose first, or use a matmul against ones)"
        )
    if not norm:  # inferred
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
    instr = "nl.full"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    t = ctx.allocate(shape, dtype, buffer, name or "nl.full")
    write(t, np.asarray(fill_value, F32))
    if ctx.cost is not None and buffer.on_chip:
        ctx.cost.compute(instr, None, t, [], value=fill_value)
    return t


def zeros(shape: Any, dtype: Any, buffer: Any = SBUF, name: str = "", **kwargs: Any) -> Tensor:
    """``nl.ndarray`` filled with zeros."""
    return full(shape, 0.0, dtype, buffer, name or "nl.zeros", **kwargs)


def load(src: Tensor, dtype: Any = None, **kwargs: Any) -> Tensor:
    """A new SBUF tile holding ``src`` (an HBM tensor or view; axis 0 becomes the partition axis)."""
    instr = "nl.load"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    tensor_arg(src, instr, "src", HBM_BUFFERS)  # nl.load page: from device memory (HBM)
    values = read(src, instr, "src")
    tile = ctx.allocate(src.shape, src.dtype if dtype is None else dtype, SBUF, "nl.load")
    write(tile, values)
    if ctx.cost is not None:
        ctx.cost.dma(instr, src, tile, values, None, None)
    return tile


def store(dst: Tensor, value: Tensor, **kwargs: Any) -> None:
    """Write the SBUF tile ``value`` into the HBM tensor (or view) ``dst``, converting the dtype."""
    instr = "nl.store"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    tensor_arg(dst, instr, "dst", HBM_BUFFERS)  # nl.store page: to device memory (HBM)
    # NKI 0.3 release notes (known issues): "nki.language.store does not support PSUM tiles".
    tensor_arg(value, instr, "value", (SBUF,))
    check_dst_shape(instr, dst, value.shape)
    values = read(value, instr, "value")
    write(dst, values)
    if ctx.cost is not None:
        ctx.cost.dma(instr, value, dst, values, None, None)


def copy(x: Tensor, dtype: Any = None, **kwargs: Any) -> Tensor:
    """A new SBUF tile copied (and cast) from ``x``: an SBUF tile, or from NKI 0.6 also a PSUM
    tile (before 0.6 use nisa.tensor_copy for PSUM). On the Scalar engine before 0.6, the Vector
    engine (``tensor_copy``) from 0.6 (versions.py, "nl.copy on VectorE")."""
    instr = "nl.copy"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    if versions.has("nl.copy on VectorE"):
        # NKI 0.6 release notes (new features): nl.copy "creates a copy of an SBUF or PSUM tile on
        # SBUF ... It uses the Vector engine (tensor_copy)".
        tensor_arg(x, instr, "x", ON_CHIP)
    else:
        # NKI 0.3 release notes, known issues (Data Movement): nl.copy "cross-buffer copies (e.g.,
        # PSUM to SBUF) are not supported"; the result is an SBUF tile, so x must be in SBUF.
        tensor_arg(x, instr, "x", (SBUF,))
    values = read(x, instr, "x")
    tile = ctx.allocate(x.shape, x.dtype if dtype is None else dtype, SBUF, "nl.copy")
    write(tile, values)
    if ctx.cost is not None:
        ctx.cost.compute(instr, None, tile, [x])
    return tile


def broadcast_to(src: Tensor, shape: Any = None, **kwargs: Any) -> Tensor:
    """A new SBUF tile of ``shape``: same rank as ``src``, each axis equal or broadcast from 1.

    Broadcasting the partition axis (``[1, F] -> [P, F]``) is allowed here, as in NKI.
    """
    instr = "nl.broadcast_to"
    no_extra(kwargs, instr)
    if shape is None:  # nki.language.broadcast_to page: shape is required
        raise NkiShapeError(f"{instr} needs shape=")
    ctx = begin(instr)
    tensor_arg(src, instr, "src", ON_CHIP)
    shape = tuple(int(s) for s in shape)
    if len(shape) != src.ndim or any(s != d and d != 1 for s, d in zip(shape, src.shape)):
        # nki.language.broadcast_to page (numpy's rule, same rank: each axis equal or from 1).
        raise NkiShapeError(
            f"{instr}: cannot broadcast {src.shape} to {shape} (same rank; each axis equal or from 1)"
        )
    values = read(src, instr, "src")
    tile = ctx.allocate(shape, src.dtype, SBUF, "nl.broadcast_to")
    write(tile, np.broadcast_to(values, shape))
    if ctx.cost is not None:
        ctx.cost.compute(instr, None, tile, [])
    return tile


# ----------------------------------------------------------------------------------------------
# elementwise and reductions


def _elementwise(name: str, fn, operands: tuple, dtype: Any) -> Tensor:
    instr = f"nl.{name}"
    ctx = begin(instr)
    tiles = [o for o in operands if isinstance(o, Tensor)]
    if not tiles:
        raise NkiUnsupportedError(f"{instr} needs at least one tile operand")
    values = []
    for i, o in enumerate(operands):
        if isinstance(o, Tensor):
            tensor_arg(o, instr, f"operand {i}", ON_CHIP)  # engines read SBUF/PSUM (arch guides)
            values.append(f32_values(o, instr, f"operand {i}"))
        elif isinstance(o, (int, float, np.integer, np.floating)) and not isinstance(o, bool):
            values.append(np.float32(o))
        elif isinstance(o, AccessPattern):
            raise NkiUnsupportedError(f"{instr}: access patterns are dma_copy operands only")
        else:
            raise NkiUnsupportedError(f"{instr}: operand {i} of type {type(o).__name__}")
    shapes = [t.shape for t in tiles]
    if any(s != shapes[0] for s in shapes):
        # NKI 0.3 release notes, known issues (Broadcasting): "Binary operations do not support
        # broadcasting — Operations like nl.add(a, b) require both operands to have the same
        # shape." Python scalars are accepted (inferred: a scalar is an immediate operand).
        raise NkiShapeError(
            f"{instr}: operand shapes {shapes} differ: nl binary operations do not broadcast in "
            "NKI 0.3 (release notes, known issues); use nisa.tensor_scalar with a [P, 1] column "
            "or nl.broadcast_to first"
        )
    out_shape = list(shapes[0])
    same_base_partition(instr, *tiles)
    with np.errstate(all="ignore"):
        result = fn(*values)
    out_dtype = default_dtype(tiles) if dtype is None else as_dtype(dtype, instr)
    tile = ctx.allocate(tuple(out_shape), out_dtype, SBUF, instr)
    write(tile, np.broadcast_to(result, tuple(out_shape)))
    if ctx.cost is not None:
        ctx.cost.compute(instr, None, tile, tiles, ops=(name,))
    return tile


def _binary(name: str, fn: Any) -> Any:
    def op(x: Any, y: Any, dtype: Any = None, **kwargs: Any) -> Tensor:
        no_extra(kwargs, f"nl.{name}")
        return _elementwise(name, fn, (x, y), dtype)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = (
        f"``nl.{name}(x, y, dtype=None)``: elementwise in fp32 on SBUF/PSUM tiles of one shape "
        "(or a tile and a scalar; no broadcasting, as in NKI 0.3); returns a new SBUF tile."
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


def _no_instruction(name: str) -> Any:
    def op(*args: Any, **kwargs: Any) -> Tensor:
        # NKI 0.3 release notes, known issues (Math Operations): nl.divide, nl.fmod and nl.mod
        # are not available as hardware instructions.
        raise NkiUnsupportedError(
            f"nl.{name} has no hardware instruction (NKI 0.3 release notes, known issues): "
            "multiply by nl.reciprocal / nisa.reciprocal instead"
        )

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"``nl.{name}``: rejected, no hardware instruction in NKI 0.3 (known issues)."
    return op


divide = _no_instruction("divide")
mod = _no_instruction("mod")
fmod = _no_instruction("fmod")
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
    ctx = begin(instr)
    tensor_arg(x, instr, "x", ON_CHIP)
    axes = check_free_axes(instr, axis, x.ndim)
    with np.errstate(all="ignore"):
        result = reduce_values(ufunc, f32_values(x, instr, "x"), axes, keepdims)
    out_dtype = x.dtype if dtype is None else as_dtype(dtype, instr)
    tile = ctx.allocate(result.shape, out_dtype, SBUF, instr)
    write(tile, result)
    if ctx.cost is not None:
        ctx.cost.compute(instr, None, tile, [x], ops=(name,))
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


# Comparisons (elementwise 1.0 / 0.0 in fp32; NaN compares false, IEEE, inferred): the ALU
# operators of nki.language that nisa.tensor_scalar / tensor_tensor take as op (range_select page,
# v2.32.0, lists equal, less, less_equal, greater, greater_equal as comparison operators).
def compare_values(ufunc):
    """A numpy comparison as an ALU function returning fp32 1.0 / 0.0 (used by isa.py)."""

    def fn(a, b):
        return ufunc(a, b).astype(F32)

    fn.__name__ = ufunc.__name__
    return fn


equal = _binary("equal", compare_values(np.equal))
not_equal = _binary("not_equal", compare_values(np.not_equal))
less = _binary("less", compare_values(np.less))
less_equal = _binary("less_equal", compare_values(np.less_equal))
greater = _binary("greater", compare_values(np.greater))
greater_equal = _binary("greater_equal", compare_values(np.greater_equal))
__all__ += ["equal", "not_equal", "less", "less_equal", "greater", "greater_equal"]

