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
import weakref
from typing import Any

import ml_dtypes
import numpy as np

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
from .targets import TARGETS, Target, resolve_target

PSUM_BANK_BYTES = PSUM_BANK_FP32 * 4

# SBUF bytes per partition available to a kernel, by target (sources in targets.py).
SBUF_BYTES_PER_PARTITION = {name: t.sbuf_bytes_per_partition for name, t in TARGETS.items()}

_PACKAGE = __name__.rsplit(".", 1)[0]


# --------------------------------------------------------------------------------------------
# dtypes and buffers


# NKI's float8_e4m3 is the IEEE-style e4m3 (with infinities) where ml_dtypes has it (>= 0.5).
_FP8_E4M3 = getattr(ml_dtypes, "float8_e4m3", ml_dtypes.float8_e4m3fn)
# nl.float8_e4m3fn (new in NKI 0.2.0, release notes "New dtypes"; language pages: "Extended range:
# no inf, NaN represented by 0bS111'1111") is the OCP e4m3fn format, JAX's jnp.float8_e4m3fn.
_FP8_E4M3FN = ml_dtypes.float8_e4m3fn

SUPPORTED_DTYPES = frozenset(
    np.dtype(t)
    for t in (
        np.float32,
        ml_dtypes.bfloat16,
        np.float16,
        _FP8_E4M3,
        _FP8_E4M3FN,
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
    for t in (np.float32, ml_dtypes.bfloat16, np.float16, _FP8_E4M3, _FP8_E4M3FN, ml_dtypes.float8_e5m2)
)


def as_dtype(dtype: Any, where: str) -> np.dtype:
    """``dtype`` as a numpy dtype, rejecting what NKI has no storage type for."""
    # NKI's storage types are those of nki/api/nki/language/__init__.py (no 64-bit types).
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


class Launch:
    """What the program instances of one launch share: the target, the grid and shared HBM.

    SPMD programs run the same kernel text (``nki/get-started/about/lnc.rst``), so the i-th
    ``nl.shared_hbm`` tensor each program allocates is one tensor, shared by all of them: program 0
    allocates it, the others get the same storage back (same shape and dtype, or an error).
    """

    def __init__(self, target: Target, grid: int, nki_version: str | None = None):
        self.target = target
        self.grid = grid
        self.nki_version = nki_version  # the NKI version modelled (versions.py); None: default
        self.shared: list[_Storage] = []


class Context:
    """State of one program instance of a simulated kernel (one physical core).

    Live on-chip memory, the Scalar Engine reduce registers, the program id, and the instruction
    record: ``instructions`` counts every instruction executed, ``compiled_instructions`` only those
    of the compiled program text, i.e. the body of an ``nl.dynamic_range`` loop (a hardware loop,
    not unrolled) counts once, however many times it runs. A body counts only if it runs in the
    first iteration of its enclosing hardware loops (a 0-trip body has no trace to count): a
    0-or-1-trip branch taken first in a later iteration is missing from the figure.
    """

    def __init__(self, target: str | Target | None = None, program_id: int = 0, launch: Launch | None = None):
        self.target_info = resolve_target(target)
        self.target = self.target_info.name
        self.launch = launch if launch is not None else Launch(self.target_info, 1)
        self.program_id = program_id
        self.sbuf_budget = self.target_info.sbuf_bytes_per_partition
        self.sbuf_used = 0
        self.psum_banks_used = 0
        self.live: dict[int, str] = {}  # id(storage) -> description, for capacity messages
        self.sbuf_peak = 0
        self.psum_peak = 0
        self.instructions = 0
        self.compiled_instructions = 0
        self.ops: dict[str, int] = {}  # executed instructions by name
        self.repeat_depth = 0  # > 0 inside the second and later iterations of a dynamic loop
        # The NKI version this program is modelled under (versions.nki_version reads it).
        self.nki_version = self.launch.nki_version
        # Allocations made in the current iteration of each enclosing nl.fori_loop body, innermost
        # last: when an iteration ends they are closed (a tensor must not escape the body).
        self.loop_scopes: list[list] = []
        self.cost = None  # a cost.CostRecord when cost recording is on
        self._shared_seen = 0  # shared_hbm allocations of this program so far
        # Scalar Engine accumulation registers, one fp32 per partition (nisa.activation reduce_cmd).
        self.reduce_regs = np.full(PARTITIONS, np.nan, np.float32)
        self.reduce_regs_valid = np.zeros(PARTITIONS, bool)

    def __enter__(self) -> Context:
        self._previous = getattr(_ACTIVE, "ctx", None)
        _ACTIVE.ctx = self
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.ctx = self._previous

    def begin_instruction(self, instr: str) -> None:
        """Count one instruction ``instr`` and check that live on-chip memory fits the chip."""
        self.instructions += 1
        if self.repeat_depth == 0:
            self.compiled_instructions += 1
        self.ops[instr] = self.ops.get(instr, 0) + 1
        self.check_capacity()

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
        if self.sbuf_used > self.sbuf_peak:
            self.sbuf_peak = self.sbuf_used
        if self.psum_banks_used > self.psum_peak:
            self.psum_peak = self.psum_banks_used
        if self.sbuf_used > self.sbuf_budget:
            # SBUF per partition per target: the architecture guides (see targets.py).
            raise NkiCapacityError(
                f"SBUF over its budget: {self.sbuf_used} bytes per partition live, "
                f"{self.target} has {self.sbuf_budget}. Drop references to tiles no longer needed "
                f"(or `del` them).\n" + self._live_listing("sbuf")
            )
        if self.psum_banks_used > PSUM_BANKS:
            # trainium_inferentia2_arch.rst: PSUM is 2 MiB = 16 KiB per partition, i.e. 8 banks of
            # 2 KiB (512 fp32, nc_matmul page); one tile per bank is the stricter reading (inferred).
            raise NkiCapacityError(
                f"more PSUM live than {PSUM_BANKS} banks: {self.psum_banks_used} PSUM tiles live "
                f"(each takes one {PSUM_BANK_BYTES}-byte bank per partition).\n"
                + self._live_listing("psum")
            )

    # -- allocation ---------------------------------------------------------------------------

    def allocate(self, shape: Any, dtype: Any, buffer: Buffer, name: str = "") -> Tensor:
        if not isinstance(buffer, Buffer):
            # NKI 0.3 release notes: "String buffer names no longer accepted. Use buffer objects".
            raise NkiMemorySpaceError(
                f"unknown buffer {buffer!r}: use nl.sbuf, nl.psum, nl.hbm or nl.shared_hbm"
            )
        if isinstance(shape, (int, np.integer)):
            shape = (shape,)
        try:
            shape = tuple(int(s) for s in shape)
        except TypeError as exc:  # inferred: shapes are compile-time ints
            raise NkiShapeError(f"shape must be a tuple of ints, got {shape!r}") from exc
        dt = as_dtype(dtype, f"nl.ndarray({shape}, buffer={buffer!r})")
        if any(s < 0 for s in shape):  # inferred
            raise NkiShapeError(f"negative dimension in shape {shape}")
        sbuf_bytes = 0
        psum_banks = 0
        if buffer.on_chip:
            if not shape or any(s == 0 for s in shape):  # inferred: a tile has a partition axis
                raise NkiShapeError(
                    f"on-chip tiles need a partition axis and non-empty dims, got shape {shape}"
                )
            if shape[0] > PARTITIONS:
                # The architecture guides: SBUF and PSUM have 128 partitions; ISA pages: "partition
                # axis <= 128".
                raise NkiLimitError(
                    f"partition axis > {PARTITIONS}: {buffer.name} tile of shape {shape} puts "
                    f"{shape[0]} on axis 0 (the partition axis)"
                )
            per_partition = int(np.prod(shape[1:], dtype=np.int64)) * dt.itemsize
            if buffer is PSUM:
                if per_partition > PSUM_BANK_BYTES:
                    # nc_matmul page: 512 fp32 "per PSUM bank"; a tile in one bank (inferred for
                    # non-matmul PSUM tiles; NeuronCore-v4 matmuls may span banks, not emulated).
                    raise NkiLimitError(
                        f"PSUM tile over 2 KiB per partition: shape {shape} {dt.name} needs "
                        f"{per_partition} bytes per partition, one bank holds {PSUM_BANK_BYTES}"
                    )
                psum_banks = 1
            else:
                sbuf_bytes = per_partition
        if buffer is SHARED_HBM:
            shared = self._shared_storage(shape, dt, name)
            if shared is not None:
                return Tensor(shared, shared.data, shared.init, 0)
        data = np.empty(shape, dt)
        if dt in FLOAT_DTYPES:
            data.fill(np.nan)  # what the real simulator does; e5m2/e4m3 have NaN encodings too
        else:
            data.view(np.uint8).fill(0xA5)
        st = _Storage(data, np.zeros(shape, bool), buffer, name or "", None)
        if buffer is SHARED_HBM:
            self.launch.shared.append(st)
        elif self.loop_scopes:
            # A weak reference: the scope must not keep a tile alive (its charge ends with it).
            self.loop_scopes[-1].append(weakref.ref(st))
        if buffer.on_chip:
            st.ctx = self
            self._charge(
                st,
                f"{buffer.name} {name or 'tile'} {shape} {dt.name} "
                f"({sbuf_bytes or PSUM_BANK_BYTES} B/partition) allocated at {_user_site()}",
            )
        return Tensor(st, data, st.init, 0)

    def _shared_storage(self, shape: tuple, dt: np.dtype, name: str) -> _Storage | None:
        """The shared-HBM storage program 0 allocated at this point, for programs 1.. (or None)."""
        index = self._shared_seen
        self._shared_seen += 1
        if self.program_id == 0:
            return None
        if index >= len(self.launch.shared):
            # lnc.rst: the program on each core is "the same"; outputs live in shared HBM.
            raise NkiUnsupportedError(
                f"program {self.program_id} allocates shared_hbm tensor #{index} {shape}, which "
                "program 0 did not: SPMD programs must allocate the same shared_hbm tensors in the "
                "same order (nki/get-started/about/lnc.rst: the program on each core is the same)"
            )
        st = self.launch.shared[index]
        if st.data.shape != shape or st.data.dtype != dt:
            raise NkiShapeError(
                f"program {self.program_id} allocates shared_hbm tensor #{index} as {shape} "
                f"{dt.name}, program 0 as {st.data.shape} {st.data.dtype.name}: SPMD programs "
                "share their shared_hbm outputs (nki/get-started/about/lnc.rst)"
            )
        return st

    def wrap_input(self, array: np.ndarray, position: str) -> Tensor:
        """A kernel argument: an HBM tensor holding a copy of ``array``, fully initialised."""
        dt = as_dtype(array.dtype, f"kernel argument {position}")
        data = np.array(array, dtype=dt, copy=True, order="C")
        st = _Storage(data, np.ones(data.shape, bool), HBM, position, None)
        return Tensor(st, data, st.init, 0)


class _Storage:
    """One allocation: data, initialised mask, buffer; releases its on-chip charge when collected."""

    __slots__ = ("data", "init", "buffer", "name", "ctx", "sbuf_bytes", "psum_banks", "closed_by",
                 "__weakref__")

    def __init__(self, data, init, buffer, name, ctx):
        self.closed_by = None  # set when the fori_loop body that allocated it has ended
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
        if n_ellipsis > 1:  # inferred (numpy indexing)
            raise NkiShapeError("at most one Ellipsis in an index")
        if n_ellipsis:
            pos = next(i for i, k in enumerate(key) if k is Ellipsis)
            fill = len(shape) - (len(key) - 1)
            key = key[:pos] + (slice(None),) * fill + key[pos + 1 :]
        if len(key) > len(shape):
            # Inferred: an access outside a tensor is an error (the docs leave it undefined).
            raise NkiOutOfBoundsError(
                f"access outside a tensor: {len(key)} indices for {self.describe()}"
            )
        on_chip = self._st.buffer.on_chip
        p0 = self._p0
        norm: list[Any] = []
        for axis, (k, dim) in enumerate(zip(key, shape)):
            if _is_int(k):
                k = int(k)
                if not 0 <= k < dim:  # inferred: no wrap-around of negative indices
                    raise NkiOutOfBoundsError(
                        f"access outside a tensor: index {k} on axis {axis} of size {dim} "
                        f"({self.describe()}; negative indices are not accepted)"
                    )
                if axis == 0 and on_chip:
                    # Inferred: on-chip tiles keep axis 0 as the partition axis (tiling guide).
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
                if start < 0 or stop > dim or start >= stop:  # inferred, as above
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
        if int(np.prod(shape, dtype=np.int64)) != self._data.size:  # inferred (numpy reshape)
            raise NkiShapeError(f"cannot reshape {self.shape} into {shape}")
        return Tensor(self._st, self._data.reshape(shape), self._mask.reshape(shape), 0)

    def ap(
        self,
        pattern: Any,
        offset: int = 0,
        scalar_offset: Any = None,
        vector_offset: Tensor | None = None,
        indirect_dim: int = 0,
        **kwargs: Any,
    ) -> AccessPattern:
        """A hardware access pattern over this (whole) tensor (``nki/deep-dives/nki-aps.rst``).

        ``pattern`` is ``[[stride, count], ...]``, outermost first, strides in elements of the
        row-major tensor; element ``(i0, i1, ...)`` reads flat index
        ``offset + sum(i_k * stride_k)``.

        * ``scalar_offset``: a ``[1, 1]`` integer SBUF tile or a ``nisa.VirtualRegister`` holding
          ``s``; the access starts ``s * prod(shape[indirect_dim + 1:])`` elements further.
        * ``vector_offset=idx_tile``: a row gather (HBM tensors, ``indirect_dim=0`` only): index
          ``i0`` is replaced by the row ``idx_tile[i0]`` (``dma_copy``: a ``[count0, 1]`` tile;
          ``dma_transpose``: the 2-D uint32 index tile its page describes).
        """
        if kwargs:
            raise NkiUnsupportedError(f"tensor.ap arguments not emulated: {sorted(kwargs)}")
        return AccessPattern(self, pattern, offset, vector_offset, indirect_dim, scalar_offset)

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
    """``tensor.ap(...)``: an explicit (possibly indirect) access pattern, a DMA operand."""

    __slots__ = (
        "base", "pattern", "offset", "vector_offset", "indirect_dim", "scalar_offset", "shape",
    )  # fmt: skip

    def __init__(
        self, base: Tensor, pattern: Any, offset: Any, vector_offset: Any, indirect_dim: Any,
        scalar_offset: Any = None,
    ):  # fmt: skip
        st = base._st
        if base._data.shape != st.data.shape or base._p0 != 0:
            # NKI 0.3 (nki-aps.rst, "ap" on a tensor): .ap is a method of an nl.ndarray (an
            # argument or an allocation), not of an already indexed view.
            raise NkiUnsupportedError(
                f"tensor.ap on a view is not emulated: call it on the whole tensor "
                f"({base.describe()}) and fold the view into offset/pattern"
            )
        # nki-aps.rst: pattern is a list of [step, num] pairs, offset an element count >= 0; the
        # 5-pair limit, positive counts and non-negative steps are inferred.
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
            # dma_copy page: "The tensor being indexed (the one .ap() is called on) must be in HBM."
            raise NkiMemorySpaceError(
                f"operand in the wrong memory: an indirect (vector_offset) access pattern gathers "
                f"HBM rows, {base.describe()} is on chip"
            )
        if st.buffer.on_chip:
            # The kernels use access patterns on HBM only; the partition-step convention of
            # on-chip patterns is not modelled, so refuse rather than guess (inferred).
            raise NkiUnsupportedError(
                f"tensor.ap on an on-chip tensor is not emulated ({base.describe()}); slice it"
            )
        if vector_offset is not None and scalar_offset is not None:
            # nki-aps.rst: "At most one of the scalar_offset and vector_offset can be specified."
            raise NkiShapeError("tensor.ap: scalar_offset and vector_offset are mutually exclusive")
        if not _is_int(indirect_dim) or not 0 <= indirect_dim < st.data.ndim:  # nki-aps.rst
            raise NkiShapeError(
                f"tensor.ap: indirect_dim={indirect_dim!r} is not an axis of {st.data.shape}"
            )
        if scalar_offset is not None:
            _check_scalar_offset(scalar_offset)
        if vector_offset is not None:
            if indirect_dim != 0:
                # nki-aps.rst: "Currently, only indirect_dim=0 is supported" for vector_offset.
                raise NkiUnsupportedError(
                    f"indirect_dim={indirect_dim}: vector_offset supports indirect_dim=0 only "
                    "(nki/deep-dives/nki-aps.rst)"
                )
            if not isinstance(vector_offset, Tensor) or vector_offset.buffer is not SBUF:
                # dma_copy page: the index tensor is an SBUF tensor.
                raise NkiMemorySpaceError(
                    "operand in the wrong memory: vector_offset must be an SBUF tile of row indices"
                )
            if vector_offset.dtype.kind not in "iu":  # dma_copy page: row indices
                raise NkiDtypeError(
                    f"vector_offset must hold integers, got {vector_offset.dtype.name}"
                )
            row = int(np.prod(st.data.shape[1:], dtype=np.int64))
            if pairs[0][0] != row:
                # nki-aps.rst: "The stride on the leading dimension must be the total number of
                # elements to the right of the leading dimension in the base tensor".
                raise NkiShapeError(
                    f"indirect ap: the leading stride {pairs[0][0]} must equal the row stride "
                    f"{row} of the gathered tensor {st.data.shape}"
                )
        self.base = base
        self.pattern = pairs
        self.offset = int(offset)
        self.vector_offset = vector_offset
        self.scalar_offset = scalar_offset
        self.indirect_dim = int(indirect_dim)
        self.shape = tuple(c for _, c in pairs)

    @property
    def dtype(self) -> np.dtype:
        return self.base.dtype

    @property
    def buffer(self) -> Buffer:
        return self.base.buffer

    @property
    def is_indirect(self) -> bool:
        """A vector_offset gather (the form that needs the software DGE, NeuronCore-v3+)."""
        return self.vector_offset is not None

    def describe(self) -> str:
        kind = (
            "indirect ap" if self.vector_offset is not None
            else "scalar-offset ap" if self.scalar_offset is not None
            else "ap"
        )  # fmt: skip
        return f"{kind} {self.pattern} offset {self.offset} over {self.base.describe()}"

    def check_dma_copy_indices(self, instr: str) -> None:
        """dma_copy's vector_offset is one row index per partition: a ``[count0, 1]`` tile."""
        if self.vector_offset is not None and self.vector_offset.shape != (self.pattern[0][1], 1):
            # dma_copy page: "an SBUF tensor of shape (P, 1) containing one row index per partition".
            raise NkiShapeError(
                f"{instr}: vector_offset shape {self.vector_offset.shape} must be (count of the "
                f"first pattern pair, 1) = ({self.pattern[0][1]}, 1)"
            )

    def resolve(
        self, instr: str, skip_oob: bool = False, rows: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Flat element indices ``[*shape]`` into the base, and the rows/elements to transfer.

        ``rows``: the gathered row of each index ``i0`` (default: the ``[count0, 1]``
        vector_offset tile). The second result is None when everything transfers, else a boolean
        mask over axis 0 (gathers) or over the whole access (scalar offsets) of what does;
        out-of-range indices or addresses raise unless ``skip_oob`` (``oob_mode=skip``).
        """
        n = len(self.pattern)
        size = self.base._st.data.size
        flat = np.full((1,) * n, self.offset, np.int64)
        first = 1 if self.vector_offset is not None else 0
        for axis in range(first, n):
            stride, count = self.pattern[axis]
            shape = [1] * n
            shape[axis] = count
            flat = flat + (np.arange(count, dtype=np.int64) * stride).reshape(shape)
        ok = None
        if self.vector_offset is not None:
            if rows is None:
                rows = read(self.vector_offset, instr, "vector_offset").astype(np.int64).reshape(-1)
            nrows = self.base._st.data.shape[0]
            bad = (rows < 0) | (rows >= nrows)
            if bad.any():
                # dma_copy page: "By default a runtime error is raised (oob_mode=oob_mode.error)
                # ... skip the DMA transfer for a given dynamic address or index when it is out
                # of bound using oob_mode=oob_mode.skip."
                if not skip_oob:
                    p = int(np.flatnonzero(bad)[0])
                    raise NkiOutOfBoundsError(
                        f"out-of-range gather index: {instr} vector_offset[{p}] = {int(rows[p])} "
                        f"is outside the {nrows} rows of {self.base.describe()} "
                        f"({int(bad.sum())} bad indices; oob_mode=error)"
                    )
                ok = ~bad
                rows = np.where(bad, 0, rows)
            shape = [1] * n
            shape[0] = rows.size
            flat = flat + (rows * self.pattern[0][0]).reshape(shape)
        elif self.scalar_offset is not None:
            value = _scalar_offset_value(self.scalar_offset, instr)
            step = int(np.prod(self.base._st.data.shape[self.indirect_dim + 1 :], dtype=np.int64))
            # nki-aps.rst: the access starts at offset + scalar_offset * prod(shape[indirect_dim+1:]).
            flat = flat + value * step
            whole = np.broadcast_to(flat, self.shape)
            if whole.size and (whole.min() < 0 or whole.max() >= size):
                if not skip_oob:
                    raise NkiOutOfBoundsError(
                        f"out-of-range dynamic address: {instr} {self.describe()} with "
                        f"scalar_offset {value} reaches flat index {int(whole.max())} of {size} "
                        "(oob_mode=error)"
                    )
                # Inferred: the whole transfer of an out-of-range scalar address is skipped.
                return np.zeros(self.shape, np.int64), np.zeros(self.shape, bool)
        flat = np.broadcast_to(flat, self.shape)
        if flat.size and (flat.min() < 0 or flat.max() >= size):
            raise NkiOutOfBoundsError(
                f"access outside a tensor: {instr} {self.describe()} reaches flat index "
                f"{int(flat.max())} of {size}"
            )
        return flat, ok


def _check_scalar_offset(value: Any) -> None:
    from .isa import VirtualRegister
    from .language import LoopIndex

    if isinstance(value, LoopIndex):
        value._refuse()
    if isinstance(value, VirtualRegister):
        return
    # nki-aps.rst / dma_copy page: a (1, 1) SBUF tensor or a VirtualRegister.
    if not isinstance(value, Tensor) or value.buffer is not SBUF:
        raise NkiMemorySpaceError(
            "operand in the wrong memory: scalar_offset must be a [1, 1] SBUF tile or a "
            f"nisa.VirtualRegister, got {getattr(value, 'describe', lambda: type(value).__name__)()}"
        )
    if value.dtype.kind not in "iu" or value.shape not in ((1, 1), (1,)):  # nki-aps.rst: (1, 1)
        raise NkiShapeError(
            f"scalar_offset must be a [1, 1] integer SBUF tile, got {value.describe()}"
        )


def _scalar_offset_value(value: Any, instr: str) -> int:
    from .isa import VirtualRegister

    if isinstance(value, VirtualRegister):
        return value.read(f"{instr} scalar_offset")
    return int(read(value, instr, "scalar_offset").reshape(-1)[0])


# --------------------------------------------------------------------------------------------
# reading and writing


def check_in_scope(st: _Storage, instr: str, arg: str) -> None:
    """A tensor allocated in an ``nl.fori_loop`` body is dead once that iteration has ended."""
    if st.closed_by is not None:
        # nki.language.fori_loop page and nki/migration (0.6): the body returns nothing and
        # carries loop state "through SBUF/HBM" allocated outside it; no tensor escapes the body.
        raise NkiUnsupportedError(
            f"tensor escapes a loop body: {instr} uses {arg} = {st.buffer.name} "
            f"{st.name or 'tile'} {st.data.shape}, allocated inside an nl.fori_loop body "
            f"({st.closed_by}) after that iteration ended; allocate loop-carried state before the "
            "loop (nki.language.fori_loop page)"
        )


def read(t: Tensor, instr: str, arg: str) -> np.ndarray:
    """The values of ``t`` (a view, do not mutate); raises on any element never written."""
    check_in_scope(t._st, instr, arg)
    mask = t._mask
    if not mask.all():
        # Inferred: allocation does not zero memory (fresh tiles hold garbage, NaN in the
        # emulator), so reading what was never written is an error, never a silent zero.
        missing = np.argwhere(~mask)
        raise NkiUninitializedReadError(
            f"read of memory never written: {instr} reads {arg} = {t.describe()}, "
            f"{len(missing)} of {mask.size} elements were never written (first at index "
            f"{tuple(int(i) for i in missing[0])}); fresh allocations hold garbage"
        )
    return t._data


def write(t: Tensor, values: np.ndarray) -> None:
    """Store ``values`` (already of ``t.shape``) into ``t``, rounding to its dtype (RNE for floats)."""
    check_in_scope(t._st, "a write", "dst")
    t._data[...] = values
    t._mask[...] = True


def read_ap(
    ap: AccessPattern, instr: str, arg: str, skip_oob: bool, rows: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """The values ``ap`` reads, and the mask of what transfers (None: everything)."""
    check_in_scope(ap.base._st, instr, arg)
    flat, ok = ap.resolve(instr, skip_oob, rows)
    st = ap.base._st
    init = st.init.reshape(-1)[flat]
    if ok is not None:
        init = init | ~ok.reshape(ok.shape + (1,) * (init.ndim - ok.ndim))
    if not init.all():  # inferred, as in read(): allocation does not zero memory
        raise NkiUninitializedReadError(
            f"read of memory never written: {instr} reads {arg} = {ap.describe()}, "
            f"{int((~init).sum())} elements were never written"
        )
    return st.data.reshape(-1)[flat], ok


def write_ap(ap: AccessPattern, values: np.ndarray, instr: str, skip_oob: bool = False) -> None:
    """Store ``values`` where ``ap`` points; a ``vector_offset`` dst scatters the rows (dma_copy
    page, v2.32.0: "scatter (write to dynamic rows)"), an out-of-range row skipped under
    ``oob_mode=skip``."""
    check_in_scope(ap.base._st, instr, "dst")
    flat, ok = ap.resolve(instr, skip_oob)
    if ok is not None:
        if ap.vector_offset is None:
            return  # an out-of-range scalar address with oob_mode=skip: nothing is written
        flat, values = flat[ok], np.asarray(values)[ok]  # the rows that stay in range
    if np.unique(flat).size != flat.size:
        # Inferred: a DMA writes each element once (the order of two writes to one address is
        # not documented, so a scatter with repeated rows is refused rather than guessed).
        raise NkiShapeError(f"{instr}: destination {ap.describe()} writes some elements twice")
    st = ap.base._st
    st.data.reshape(-1)[flat] = values
    st.init.reshape(-1)[flat] = True
