"""Memories, tensors, access patterns and the per-run context of the NKI emulator.

Memory model (see the package docstring for the user-facing summary):

* Every ``nl.ndarray`` (and every tile an ``nl`` function returns) is a :class:`_Storage`: a
  contiguous numpy array of the tensor's dtype plus a boolean *initialised* mask of the same shape.
  Fresh storage is filled with garbage (NaN for floats, the byte 0xA5 for integers) and an all-False
  mask; every instruction checks the mask of what it reads, so reading memory never written raises
  instead of silently producing zeros.
* A :class:`Tensor` is a view: numpy basic-index views of the data and of the mask, so writes through
  a view land in the allocation.
* On-chip storage (SBUF, PSUM) is charged to the running :class:`Context` while the Python object
  is alive (CPython frees it as soon as the last reference goes, e.g. when a loop variable is
  rebound). Capacity is checked when an instruction starts, not when memory is allocated, so
  ``tile = nl.ndarray(...)`` in a loop does not count the previous iteration's tile that the
  assignment is about to drop. SBUF is charged ``prod(shape[1:]) * itemsize`` bytes per partition
  whatever the partition count (the allocator reserves the same free range on every partition);
  each PSUM tile takes one whole 2 KiB bank (the stricter reading: tiles never share a bank).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import ml_dtypes
import numpy as np

from .. import constants
from ..constants import PARTITIONS, PSUM_BANK_FP32, PSUM_BANKS
from .errors import (
    NkiCapacityError,
    NkiDtypeError,
    NkiEmulatorError,
    NkiLimitError,
    NkiMemorySpaceError,
    NkiOutOfBoundsError,
    NkiShapeError,
    NkiUninitializedReadError,
    NkiUnsupportedError,
)

PSUM_BANK_BYTES = PSUM_BANK_FP32 * 4

# SBUF bytes per partition available to a kernel, by target (NKI_SUBSET.md).
SBUF_BYTES_PER_PARTITION = {
    "trn1": constants.SBUF_BYTES_PER_PARTITION,
    "trn2": constants.SBUF_BYTES_PER_PARTITION_TRN2,
}

_PACKAGE = __name__.rsplit(".", 1)[0]


# --------------------------------------------------------------------------------------------
# dtypes and buffers


# NKI's float8_e4m3 is the IEEE-style e4m3 (with infinities) where ml_dtypes has it (>= 0.5).
_FP8_E4M3 = getattr(ml_dtypes, "float8_e4m3", ml_dtypes.float8_e4m3fn)

SUPPORTED_DTYPES = frozenset(
    np.dtype(t)
    for t in (
        np.float32,
        ml_dtypes.bfloat16,
        np.float16,
        _FP8_E4M3,
        ml_dtypes.float8_e5m2,
        np.int32,
        np.uint32,
        np.int16,
        np.uint16,
        np.int8,
        np.uint8,
    )
)

F32 = np.dtype(np.float32)
FLOAT_DTYPES = frozenset(
    np.dtype(t)
    for t in (np.float32, ml_dtypes.bfloat16, np.float16, _FP8_E4M3, ml_dtypes.float8_e5m2)
)


def as_dtype(dtype: Any, where: str) -> np.dtype:
    """``dtype`` as a numpy dtype, rejecting what NKI has no storage type for."""
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise NkiDtypeError(f"unsupported dtype: {where} got {dtype!r}") from exc
    if dt not in SUPPORTED_DTYPES:
        raise NkiDtypeError(
            f"unsupported dtype: {where} got {dt.name}; NKI stores float32, bfloat16, float16, fp8, "
            "and 8/16/32-bit integers (cast float64/int64 on the host)"
        )
    return dt


class Buffer:
    """A memory kind: ``nl.sbuf``, ``nl.psum``, ``nl.hbm``, ``nl.shared_hbm``, ``nl.private_hbm``."""

    __slots__ = ("name", "on_chip")

    def __init__(self, name: str, on_chip: bool):
        self.name = name
        self.on_chip = on_chip

    def __repr__(self) -> str:
        return f"nl.{self.name}"


SBUF = Buffer("sbuf", True)
PSUM = Buffer("psum", True)
HBM = Buffer("hbm", False)
SHARED_HBM = Buffer("shared_hbm", False)
PRIVATE_HBM = Buffer("private_hbm", False)
HBM_BUFFERS = (HBM, SHARED_HBM, PRIVATE_HBM)
ON_CHIP = (SBUF, PSUM)


# --------------------------------------------------------------------------------------------
# the run context


_ACTIVE = threading.local()


def current_context() -> Context:
    ctx = getattr(_ACTIVE, "ctx", None)
    if ctx is None:
        raise NkiEmulatorError(
            "NKI emulator call outside a simulated kernel: run the kernel through "
            "jax_sparse_attn.nki_emulator.simulate(kernel)(*arrays)"
        )
    return ctx


def _user_site() -> str:
    """``file:line`` of the first frame outside the emulator (the kernel line that allocated)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_PACKAGE):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"


class Context:
    """State of one simulated kernel run: live on-chip memory and the Scalar Engine reduce registers."""

    def __init__(self, target: str = "trn1"):
        if target not in SBUF_BYTES_PER_PARTITION:
            raise ValueError(
                f"target must be one of {sorted(SBUF_BYTES_PER_PARTITION)}, got {target!r}"
            )
        self.target = target
        self.sbuf_budget = SBUF_BYTES_PER_PARTITION[target]
        self.sbuf_used = 0
        self.psum_banks_used = 0
        self.live: dict[int, str] = {}  # id(storage) -> description, for capacity messages
        self.sbuf_peak = 0
        self.psum_peak = 0
        self.instructions = 0
        # Scalar Engine accumulation registers, one fp32 per partition (nisa.activation reduce_cmd).
        self.reduce_regs = np.full(PARTITIONS, np.nan, np.float32)
        self.reduce_regs_valid = np.zeros(PARTITIONS, bool)

    def __enter__(self) -> Context:
        self._previous = getattr(_ACTIVE, "ctx", None)
        _ACTIVE.ctx = self
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.ctx = self._previous

    # -- accounting ---------------------------------------------------------------------------

    def _charge(self, st: _Storage, description: str) -> None:
        self.sbuf_used += st.sbuf_bytes
        self.psum_banks_used += st.psum_banks
        self.live[id(st)] = description

    def _release(self, st: _Storage) -> None:
        self.sbuf_used -= st.sbuf_bytes
        self.psum_banks_used -= st.psum_banks
        self.live.pop(id(st), None)

    def _live_listing(self, buffer_name: str) -> str:
        rows = [d for d in self.live.values() if d.startswith(buffer_name)]
        shown = "\n  ".join(rows[:12])
        more = f"\n  ... and {len(rows) - 12} more" if len(rows) > 12 else ""
        return f"live {buffer_name} allocations:\n  {shown}{more}"

    def check_capacity(self) -> None:
        """Called at the start of every instruction: live on-chip memory must fit the chip."""
        self.instructions += 1
        if self.sbuf_used > self.sbuf_peak:
            self.sbuf_peak = self.sbuf_used
        if self.psum_banks_used > self.psum_peak:
            self.psum_peak = self.psum_banks_used
        if self.sbuf_used > self.sbuf_budget:
            raise NkiCapacityError(
                f"SBUF over its budget: {self.sbuf_used} bytes per partition live, "
                f"{self.target} has {self.sbuf_budget}. Drop references to tiles no longer needed "
                f"(or `del` them).\n" + self._live_listing("sbuf")
            )
        if self.psum_banks_used > PSUM_BANKS:
            raise NkiCapacityError(
                f"more PSUM live than {PSUM_BANKS} banks: {self.psum_banks_used} PSUM tiles live "
                f"(each takes one {PSUM_BANK_BYTES}-byte bank per partition).\n"
                + self._live_listing("psum")
            )

    # -- allocation ---------------------------------------------------------------------------

    def allocate(self, shape: Any, dtype: Any, buffer: Buffer, name: str = "") -> Tensor:
        if not isinstance(buffer, Buffer):
            raise NkiMemorySpaceError(
                f"unknown buffer {buffer!r}: use nl.sbuf, nl.psum, nl.hbm or nl.shared_hbm"
            )
        if isinstance(shape, (int, np.integer)):
            shape = (shape,)
        try:
            shape = tuple(int(s) for s in shape)
        except TypeError as exc:
            raise NkiShapeError(f"shape must be a tuple of ints, got {shape!r}") from exc
        dt = as_dtype(dtype, f"nl.ndarray({shape}, buffer={buffer!r})")
        if any(s < 0 for s in shape):
            raise NkiShapeError(f"negative dimension in shape {shape}")
        sbuf_bytes = 0
        psum_banks = 0
        if buffer.on_chip:
            if not shape or any(s == 0 for s in shape):
                raise NkiShapeError(
                    f"on-chip tiles need a partition axis and non-empty dims, got shape {shape}"
                )
            if shape[0] > PARTITIONS:
                raise NkiLimitError(
                    f"partition axis > {PARTITIONS}: {buffer.name} tile of shape {shape} puts "
                    f"{shape[0]} on axis 0 (the partition axis)"
                )
            per_partition = int(np.prod(shape[1:], dtype=np.int64)) * dt.itemsize
            if buffer is PSUM:
                if per_partition > PSUM_BANK_BYTES:
                    raise NkiLimitError(
                        f"PSUM tile over 2 KiB per partition: shape {shape} {dt.name} needs "
                        f"{per_partition} bytes per partition, one bank holds {PSUM_BANK_BYTES}"
                    )
                psum_banks = 1
            else:
                sbuf_bytes = per_partition
        data = np.empty(shape, dt)
        if dt in FLOAT_DTYPES:
            data.fill(np.nan)  # what the real simulator does; e5m2/e4m3 have NaN encodings too
        else:
            data.view(np.uint8).fill(0xA5)
        st = _Storage(data, np.zeros(shape, bool), buffer, name or "", None)
        if buffer.on_chip:
            st.ctx = self
            self._charge(
                st,
                f"{buffer.name} {name or 'tile'} {shape} {dt.name} "
                f"({sbuf_bytes or PSUM_BANK_BYTES} B/partition) allocated at {_user_site()}",
            )
        return Tensor(st, data, st.init, 0)

    def wrap_input(self, array: np.ndarray, position: str) -> Tensor:
        """A kernel argument: an HBM tensor holding a copy of ``array``, fully initialised."""
        dt = as_dtype(array.dtype, f"kernel argument {position}")
        data = np.array(array, dtype=dt, copy=True, order="C")
        st = _Storage(data, np.ones(data.shape, bool), HBM, position, None)
        return Tensor(st, data, st.init, 0)


class _Storage:
    """One allocation: data, initialised mask, buffer; releases its on-chip charge when collected."""

    __slots__ = ("data", "init", "buffer", "name", "ctx", "sbuf_bytes", "psum_banks")

    def __init__(self, data, init, buffer, name, ctx):
        self.data = data
        self.init = init
        self.buffer = buffer
        self.name = name
        self.ctx = ctx
        if buffer.on_chip:
            self.sbuf_bytes = (
                data.dtype.itemsize * int(np.prod(data.shape[1:], dtype=np.int64))
                if buffer is SBUF
                else 0
            )
            self.psum_banks = 1 if buffer is PSUM else 0
        else:
            self.sbuf_bytes = 0
            self.psum_banks = 0

    def __del__(self):
        ctx = self.ctx
        if ctx is not None:
            ctx._release(self)


# --------------------------------------------------------------------------------------------
# tensors and views


def _is_int(k: Any) -> bool:
    return isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_))


class Tensor:
    """An NKI tensor or a view of one (``nl.ndarray`` result, kernel argument, or slice).

    ``shape``, ``dtype`` (a numpy dtype, equal to ``nl.float32`` etc.), ``buffer``. Indexing with
    python ints and slices returns a view that writes through. On-chip tensors keep axis 0 as the
    partition axis: it can be sliced (step 1) but not dropped by an integer index.
    """

    __slots__ = ("_st", "_data", "_mask", "_p0")

    def __init__(self, st: _Storage, data: np.ndarray, mask: np.ndarray, p0: int):
        self._st = st
        self._data = data
        self._mask = mask
        self._p0 = p0  # first partition of this view (on-chip tensors)

    # -- descriptors --------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        return self._data.shape

    @property
    def dtype(self) -> np.dtype:
        return self._data.dtype

    @property
    def buffer(self) -> Buffer:
        return self._st.buffer

    @property
    def ndim(self) -> int:
        return self._data.ndim

    @property
    def name(self) -> str:
        return self._st.name

    def describe(self) -> str:
        whole = self._data.shape == self._st.data.shape and self._p0 == 0
        what = "tensor" if whole else f"view of {self._st.data.shape}"
        name = f" '{self._st.name}'" if self._st.name else ""
        return f"{self.buffer.name}{name} {what} shape {self.shape} {self.dtype.name}"

    def __repr__(self) -> str:
        return f"<nki_emulator {self.describe()}>"

    def __len__(self) -> int:
        return self.shape[0]

    def __iter__(self):
        raise NkiUnsupportedError(
            "iterating over a tensor is not an NKI operation: index it with ints and slices"
        )

    def __array__(self, *args, **kwargs):
        raise NkiUnsupportedError(
            f"a kernel tensor ({self.describe()}) cannot be turned into a host array inside a "
            "kernel: move data with nl.load / nl.store / nisa.dma_copy"
        )

    def __bool__(self):
        raise NkiUnsupportedError("the truth value of a kernel tensor is not defined")

    def __setitem__(self, key, value):
        raise NkiUnsupportedError(
            "assigning into a tensor with `t[...] = value` is not emulated: write through an "
            "instruction (nisa.tensor_copy(dst=t[...], src=value), nl.store, ...)"
        )

    # -- views --------------------------------------------------------------------------------

    def __getitem__(self, key: Any) -> Tensor:
        if not isinstance(key, tuple):
            key = (key,)
        shape = self._data.shape
        n_ellipsis = sum(1 for k in key if k is Ellipsis)
        if n_ellipsis > 1:
            raise NkiShapeError("at most one Ellipsis in an index")
        if n_ellipsis:
            pos = next(i for i, k in enumerate(key) if k is Ellipsis)
            fill = len(shape) - (len(key) - 1)
            key = key[:pos] + (slice(None),) * fill + key[pos + 1 :]
        if len(key) > len(shape):
            raise NkiOutOfBoundsError(
                f"access outside a tensor: {len(key)} indices for {self.describe()}"
            )
        on_chip = self._st.buffer.on_chip
        p0 = self._p0
        norm: list[Any] = []
        for axis, (k, dim) in enumerate(zip(key, shape)):
            if _is_int(k):
                k = int(k)
                if not 0 <= k < dim:
                    raise NkiOutOfBoundsError(
                        f"access outside a tensor: index {k} on axis {axis} of size {dim} "
                        f"({self.describe()}; negative indices are not accepted)"
                    )
                if axis == 0 and on_chip:
                    raise NkiShapeError(
                        f"an integer index would drop the partition axis of {self.describe()}: "
                        f"slice it instead (t[{k}:{k + 1}, ...])"
                    )
                norm.append(k)
            elif isinstance(k, slice):
                start = 0 if k.start is None else k.start
                stop = dim if k.stop is None else k.stop
                step = 1 if k.step is None else k.step
                if not (_is_int(start) and _is_int(stop) and _is_int(step)):
                    raise NkiUnsupportedError(f"slice bounds must be python ints, got {k!r}")
                start, stop, step = int(start), int(stop), int(step)
                if step <= 0:
                    raise NkiUnsupportedError(f"slice step must be positive, got {k!r}")
                if start < 0 or stop > dim or start >= stop:
                    raise NkiOutOfBoundsError(
                        f"access outside a tensor: slice {start}:{stop} on axis {axis} of size "
                        f"{dim} ({self.describe()}; negative or empty slices are not accepted)"
                    )
                if axis == 0 and on_chip:
                    if step != 1:
                        raise NkiUnsupportedError(
                            f"a strided slice of the partition axis ({k!r}) is not emulated"
                        )
                    p0 += start
                norm.append(slice(start, stop, step))
            else:
                raise NkiUnsupportedError(
                    f"index tensors with python ints and slices only, got {type(k).__name__} "
                    f"(for a gather use tensor.ap(..., vector_offset=idx_tile) with nisa.dma_copy)"
                )
        nk = tuple(norm)
        return Tensor(self._st, self._data[nk], self._mask[nk], p0)

    def reshape(self, *shape: Any) -> Tensor:
        """A reshaped view of a whole HBM tensor (row-major, like ``numpy.reshape``)."""
        if len(shape) == 1 and not _is_int(shape[0]):
            shape = tuple(shape[0])
        shape = tuple(int(s) for s in shape)
        if self.buffer.on_chip:
            raise NkiUnsupportedError("reshape of on-chip tiles is not emulated")
        if not self._data.flags.c_contiguous:
            raise NkiUnsupportedError(f"reshape of a non-contiguous view ({self.describe()})")
        if int(np.prod(shape, dtype=np.int64)) != self._data.size:
            raise NkiShapeError(f"cannot reshape {self.shape} into {shape}")
        return Tensor(self._st, self._data.reshape(shape), self._mask.reshape(shape), 0)

    def ap(
        self,
        pattern: Any,
        offset: int = 0,
        vector_offset: Tensor | None = None,
        indirect_dim: int = 0,
        **kwargs: Any,
    ) -> AccessPattern:
        """A hardware access pattern over this (whole) tensor.

        ``pattern`` is ``[[stride, count], ...]``, outermost first, strides in elements of the
        row-major tensor; element ``(i0, i1, ...)`` reads flat index
        ``offset + sum(i_k * stride_k)``. With ``vector_offset=idx_tile`` (an SBUF ``[count0, 1]``
        integer tile) the access is a row gather: index ``i0`` is replaced by the row
        ``idx_tile[i0]`` of the tensor (HBM tensors and ``indirect_dim=0`` only).
        """
        if kwargs:
            raise NkiUnsupportedError(f"tensor.ap arguments not emulated: {sorted(kwargs)}")
        return AccessPattern(self, pattern, offset, vector_offset, indirect_dim)

    # -- arithmetic sugar: the nl functions -----------------------------------------------------

    def _nl(self):
        from . import language

        return language

    def __add__(self, other):
        return self._nl().add(self, other)

    def __radd__(self, other):
        return self._nl().add(other, self)

    def __sub__(self, other):
        return self._nl().subtract(self, other)

    def __rsub__(self, other):
        return self._nl().subtract(other, self)

    def __mul__(self, other):
        return self._nl().multiply(self, other)

    def __rmul__(self, other):
        return self._nl().multiply(other, self)

    def __truediv__(self, other):
        return self._nl().divide(self, other)

    def __rtruediv__(self, other):
        return self._nl().divide(other, self)

    def __neg__(self):
        return self._nl().negative(self)


class AccessPattern:
    """``tensor.ap(...)``: an explicit (possibly indirect) access pattern, a ``dma_copy`` operand."""

    __slots__ = ("base", "pattern", "offset", "vector_offset", "indirect_dim", "shape")

    def __init__(self, base: Tensor, pattern: Any, offset: Any, vector_offset: Any, indirect_dim: Any):
        st = base._st
        if base._data.shape != st.data.shape or base._p0 != 0:
            raise NkiUnsupportedError(
                f"tensor.ap on a view is not emulated: call it on the whole tensor "
                f"({base.describe()}) and fold the view into offset/pattern"
            )
        try:
            pairs = [(int(s), int(c)) for s, c in pattern]
        except (TypeError, ValueError) as exc:
            raise NkiShapeError(f"ap pattern must be [[stride, count], ...], got {pattern!r}") from exc
        if not pairs or len(pairs) > 5:
            raise NkiShapeError(f"ap pattern needs 1 to 5 [stride, count] pairs, got {len(pairs)}")
        if any(c <= 0 for _, c in pairs) or any(s < 0 for s, _ in pairs):
            raise NkiShapeError(f"ap pattern counts must be positive and strides >= 0: {pairs}")
        if not _is_int(offset) or offset < 0:
            raise NkiOutOfBoundsError(f"access outside a tensor: ap offset {offset!r}")
        if st.buffer.on_chip and vector_offset is not None:
            raise NkiMemorySpaceError(
                f"operand in the wrong memory: an indirect (vector_offset) access pattern gathers "
                f"HBM rows, {base.describe()} is on chip"
            )
        if st.buffer.on_chip:
            # The kernels use access patterns on HBM only; the partition-step convention of
            # on-chip patterns is not modelled, so refuse rather than guess.
            raise NkiUnsupportedError(
                f"tensor.ap on an on-chip tensor is not emulated ({base.describe()}); slice it"
            )
        if vector_offset is not None:
            if indirect_dim != 0:
                raise NkiUnsupportedError(f"indirect_dim={indirect_dim}: only indirect_dim=0 is emulated")
            if not isinstance(vector_offset, Tensor) or vector_offset.buffer is not SBUF:
                raise NkiMemorySpaceError(
                    "operand in the wrong memory: vector_offset must be an SBUF tile of row indices"
                )
            if vector_offset.dtype.kind not in "iu":
                raise NkiDtypeError(
                    f"vector_offset must hold integers, got {vector_offset.dtype.name}"
                )
            if vector_offset.shape != (pairs[0][1], 1):
                raise NkiShapeError(
                    f"vector_offset shape {vector_offset.shape} must be (count of the first "
                    f"pattern pair, 1) = ({pairs[0][1]}, 1)"
                )
            row = int(np.prod(st.data.shape[1:], dtype=np.int64))
            if pairs[0][0] != row:
                # Stricter reading of "the leading stride comes from the base tensor".
                raise NkiShapeError(
                    f"indirect ap: the leading stride {pairs[0][0]} must equal the row stride "
                    f"{row} of the gathered tensor {st.data.shape}"
                )
        self.base = base
        self.pattern = pairs
        self.offset = int(offset)
        self.vector_offset = vector_offset
        self.indirect_dim = indirect_dim
        self.shape = tuple(c for _, c in pairs)

    @property
    def dtype(self) -> np.dtype:
        return self.base.dtype

    @property
    def buffer(self) -> Buffer:
        return self.base.buffer

    def describe(self) -> str:
        kind = "indirect ap" if self.vector_offset is not None else "ap"
        return f"{kind} {self.pattern} offset {self.offset} over {self.base.describe()}"

    def resolve(self, instr: str, skip_oob: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """Flat element indices ``[*shape]`` into the base, and (gathers) the rows to transfer."""
        n = len(self.pattern)
        size = self.base._st.data.size
        flat = np.full((1,) * n, self.offset, np.int64)
        first = 1 if self.vector_offset is not None else 0
        for axis in range(first, n):
            stride, count = self.pattern[axis]
            shape = [1] * n
            shape[axis] = count
            flat = flat + (np.arange(count, dtype=np.int64) * stride).reshape(shape)
        rows_ok = None
        if self.vector_offset is not None:
            rows = read(self.vector_offset, instr, "vector_offset").astype(np.int64).reshape(-1)
            nrows = self.base._st.data.shape[0]
            bad = (rows < 0) | (rows >= nrows)
            if bad.any():
                if not skip_oob:
                    p = int(np.flatnonzero(bad)[0])
                    raise NkiOutOfBoundsError(
                        f"out-of-range gather index: {instr} vector_offset[{p}] = {int(rows[p])} "
                        f"is outside the {nrows} rows of {self.base.describe()} "
                        f"({int(bad.sum())} bad indices; oob_mode=error)"
                    )
                rows_ok = ~bad
                rows = np.where(bad, 0, rows)
            shape = [1] * n
            shape[0] = rows.size
            flat = flat + (rows * self.pattern[0][0]).reshape(shape)
        flat = np.broadcast_to(flat, self.shape)
        if flat.size and (flat.min() < 0 or flat.max() >= size):
            raise NkiOutOfBoundsError(
                f"access outside a tensor: {instr} {self.describe()} reaches flat index "
                f"{int(flat.max())} of {size}"
            )
        return flat, rows_ok


# --------------------------------------------------------------------------------------------
# reading and writing


def read(t: Tensor, instr: str, arg: str) -> np.ndarray:
    """The values of ``t`` (a view, do not mutate); raises on any element never written."""
    mask = t._mask
    if not mask.all():
        missing = np.argwhere(~mask)
        raise NkiUninitializedReadError(
            f"read of memory never written: {instr} reads {arg} = {t.describe()}, "
            f"{len(missing)} of {mask.size} elements were never written (first at index "
            f"{tuple(int(i) for i in missing[0])}); fresh allocations hold garbage"
        )
    return t._data


def write(t: Tensor, values: np.ndarray) -> None:
    """Store ``values`` (already of ``t.shape``) into ``t``, rounding to its dtype (RNE for floats)."""
    t._data[...] = values
    t._mask[...] = True


def read_ap(ap: AccessPattern, instr: str, arg: str, skip_oob: bool) -> tuple[np.ndarray, np.ndarray | None]:
    flat, rows_ok = ap.resolve(instr, skip_oob)
    st = ap.base._st
    init = st.init.reshape(-1)[flat]
    if rows_ok is not None:
        init = init | ~rows_ok.reshape((-1,) + (1,) * (init.ndim - 1))
    if not init.all():
        raise NkiUninitializedReadError(
            f"read of memory never written: {instr} reads {arg} = {ap.describe()}, "
            f"{int((~init).sum())} elements were never written"
        )
    return st.data.reshape(-1)[flat], rows_ok


def write_ap(ap: AccessPattern, values: np.ndarray, instr: str) -> None:
    if ap.vector_offset is not None:
        raise NkiUnsupportedError(
            f"{instr}: an indirect access pattern as destination (scatter) is not emulated"
        )
    flat, _ = ap.resolve(instr)
    if np.unique(flat).size != flat.size:
        raise NkiShapeError(f"{instr}: destination {ap.describe()} writes some elements twice")
    st = ap.base._st
    st.data.reshape(-1)[flat] = values
    st.init.reshape(-1)[flat] = True
