"""A strict host (numpy) emulator of the NKI subset the project's kernels use.

The Neuron SDK (and with it ``nki.simulate``) cannot be installed off a Trainium host, so this
package runs the project's NKI kernel source on the host, for CI, debugging and the cost model.
It mirrors the real simulator's entry point::

    from jax_sparse_attn import nki_emulator
    out = nki_emulator.simulate(kernel)(q_np, kv_np, ...)          # numpy in, numpy out
    out = nki_emulator.simulate(kernel, target="trn2")[2](...)     # LNC=2 launch grid
    out, stats = nki_emulator.simulate(kernel, stats=True, cost=True)(...)

The rules it enforces, each with the NKI documentation page it comes from, the targets, and the
cost model are described in ``docs/nki-emulator.md`` (in this repository).

``simulate`` runs ``kernel`` with the names ``nki``, ``nl`` and ``nisa`` bound to this package,
:mod:`.language` and :mod:`.isa`, whatever the kernel's module imported (kernel modules guard
``import nki``, so their own globals may hold ``None``). Functions of the kernel's module (and of
other modules it refers to that use those names) are rebound too, so helpers called by the kernel
see the emulator. Kernel arguments that are arrays become HBM tensors holding a copy; the kernel
returns tensors it allocated in ``nl.shared_hbm``, which come back as numpy arrays (one, or a tuple).

What is emulated:

* Targets ``trn1``/``trn2``/``trn3`` (:mod:`.targets`; default from NKI's
  ``NEURON_PLATFORM_TARGET_OVERRIDE``): SBUF size, the NeuronCore-v3-only DMA forms, the launch grid.
* NKI versions 0.3 to 0.7 (:mod:`.versions`; default 0.7, ``JAX_SPARSE_ATTN_NKI_VERSION`` or
  ``simulate(kernel, nki_version=...)`` selects another): what the version removed or lacks raises,
  what it deprecates warns.
* Launch: ``simulate(kernel)[n]`` with ``nl.program_id`` / ``nl.num_programs``; per-program
  instruction counts, with hardware-loop bodies (``nl.fori_loop``, ``nl.dynamic_range``) counted
  once per compiled body.
* ``nl``: dtypes (``bfloat16`` is ``ml_dtypes.bfloat16``, rounded to nearest even), buffers
  (``sbuf``, ``psum``, ``hbm``, ``shared_hbm``), ``ndarray``, ``zeros``, ``full``, ``load``,
  ``store``, ``copy``, ``broadcast_to``, elementwise ``add``/``subtract``/``multiply``/
  ``maximum``/``minimum``/``negative``/``exp``/..., free-axis reductions ``max``/``min``/``sum``,
  ``static_range``/``affine_range``/``sequential_range`` (unrolled; deprecated from 0.6),
  ``fori_loop`` (0.6+) and ``dynamic_range`` (0.3 to 0.6), not unrolled.
* ``nisa``: ``dma_copy`` (``tensor.ap(...)`` patterns with ``scalar_offset`` or an indirect
  ``vector_offset`` row gather, ``oob_mode``), ``dma_transpose`` (direct and indirect),
  ``tensor_copy``, ``nc_matmul``, ``nc_transpose``, ``activation`` (and ``activation_reduce``),
  ``tensor_scalar``, ``scalar_tensor_tensor``, ``tensor_tensor``, ``tensor_reduce``,
  ``reciprocal``, ``memset``, ``iota``, virtual registers (``register_alloc/load/move/store``).

Memory model. Every allocation is a numpy array plus an *initialised* mask; fresh memory holds
garbage (NaN for floats) and reading any element never written raises. Tensors are views (python
ints and slices) that write through. On-chip memory is charged while the Python object that owns it
is alive (CPython frees a tile when its last reference goes, e.g. when a loop rebinds the name) and
capacity is checked at the start of every instruction: SBUF bytes per partition against the
target's budget (a tile costs ``prod(shape[1:]) * itemsize`` whatever its partition count) and PSUM
tiles against its 8 banks (one bank per tile). The Scalar Engine reduce registers of
``nisa.activation`` are emulated per program.

Strictness. Anything the compiler or hardware would reject raises an :class:`NkiEmulatorError`
subclass whose message starts with the rule. Where the NKI docs are ambiguous the stricter
reading is taken and written next to the code ("inferred").

Numerics. Compute instructions read fp32, compute in fp32 and round once to the destination dtype;
matmuls accumulate in fp32 (numpy's summation order, not the PE array's: expect last-bit fp32
differences from hardware); free-axis sums accumulate in float64 and round once to fp32.
Float-to-integer conversions truncate toward zero (numpy's cast); the hardware's rounding mode
for such casts is not modelled.

Not emulated (raises :class:`NkiUnsupportedError`): masks, ``tensor.ap`` on on-chip tensors or
on views, scatter (indirect destinations), ``t[...] = value`` assignment, ``while`` loops over
registers and ``nl.while_loop``, NKI 0.7's ``NkiScalar`` arithmetic, and the NKI functions not
listed above.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from . import isa, language, versions
from ._blas import single_threaded_blas
from ._core import SHARED_HBM, SBUF_BYTES_PER_PARTITION, Context, Launch, Tensor
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
from .targets import TARGET_ENV, TARGETS, Target, current_target, resolve_target
from .versions import NkiDeprecationWarning, nki_version

__all__ = [
    "simulate",
    "SimulatedKernel",
    "recording",
    "recording_on",
    "launch_figures",
    "Recording",
    "RunStats",
    "ProgramStats",
    "current_target",
    "resolve_target",
    "TARGETS",
    "TARGET_ENV",
    "versions",
    "nki_version",
    "NkiDeprecationWarning",
    "jit",
    "language",
    "isa",
    "SBUF_BYTES_PER_PARTITION",
    "NkiEmulatorError",
    "NkiLimitError",
    "NkiCapacityError",
    "NkiMemorySpaceError",
    "NkiShapeError",
    "NkiDtypeError",
    "NkiOutOfBoundsError",
    "NkiUninitializedReadError",
    "NkiUnsupportedError",
]

# The names a kernel module uses for the NKI modules, and what they are bound to.
_NKI_NAMES = ("nki", "nl", "nisa")


def jit(func: Callable | None = None, **kwargs: Any) -> Callable:
    """``@nki.jit`` stand-in: returns the function unchanged (with or without arguments)."""
    if func is None:
        return lambda f: f
    return func


def _unwrap(kernel: Any) -> types.FunctionType:
    """The plain Python function behind ``kernel`` (a function, or a simple wrapper of one)."""
    seen = 0
    while not isinstance(kernel, types.FunctionType):
        inner = getattr(kernel, "__wrapped__", None) or getattr(kernel, "func", None)
        if inner is None or seen > 8:
            raise TypeError(
                f"simulate needs a plain Python kernel function (or a wrapper exposing it as "
                f"__wrapped__ / .func), got {type(kernel).__name__}"
            )
        kernel = inner
        seen += 1
    return kernel


def _uses_nki_names(namespace: dict) -> bool:
    return any(name in namespace for name in _NKI_NAMES)


def _rebind(func: types.FunctionType, cache: dict[int, dict]) -> types.FunctionType:
    """A copy of ``func`` whose globals see the emulator as ``nki``/``nl``/``nisa``.

    Other functions the module's globals hold are rebound as well (once per module, through
    ``cache``) when their own module uses those names, so the kernel's helpers see the emulator.
    """
    original = func.__globals__
    namespace = cache.get(id(original))
    if namespace is None:
        namespace = dict(original)
        namespace.update(nki=sys.modules[__name__], nl=language, nisa=isa)
        cache[id(original)] = namespace
        for name, value in original.items():
            if (
                isinstance(value, types.FunctionType)
                and value is not func
                and _uses_nki_names(value.__globals__)
                and not value.__module__.startswith(__name__)
            ):
                namespace[name] = _rebind(value, cache)
    copy = types.FunctionType(
        func.__code__, namespace, func.__name__, func.__defaults__, func.__closure__
    )
    copy.__kwdefaults__ = func.__kwdefaults__
    copy.__dict__.update(func.__dict__)
    copy.__qualname__ = func.__qualname__
    return copy


def _to_numpy(result: Any) -> Any:
    if isinstance(result, (tuple, list)):
        return tuple(_to_numpy(r) for r in result)
    if not isinstance(result, Tensor):
        raise NkiUnsupportedError(
            f"a kernel returns the tensors it allocated in nl.shared_hbm, got {type(result).__name__}"
        )
    if result.buffer is not SHARED_HBM:
        raise NkiMemorySpaceError(
            f"operand in the wrong memory: kernel outputs live in nl.shared_hbm (required from "
            f"NKI 0.3), the kernel returned {result.describe()}"
        )
    mask = result._mask
    if not mask.all():
        raise NkiUninitializedReadError(
            f"read of memory never written: the kernel returned {result.describe()} with "
            f"{int((~mask).sum())} of {mask.size} elements never written"
        )
    return np.array(result._data, copy=True)


@dataclass
class ProgramStats:
    """What one program instance (one physical core) executed.

    ``instructions``: every instruction executed. ``compiled_instructions``: the instructions of
    the compiled program text: an ``nl.fori_loop`` or ``nl.dynamic_range`` body (a hardware loop,
    never unrolled) counts once however often it runs, while Python loops and
    ``nl.static_range``/``affine_range``/``sequential_range`` (unrolled) count every iteration. ``ops``: executed instructions by name (``"nisa.nc_matmul"``, ``"nl.load"``, ...).
    ``cost``: the program's :class:`cost.CostRecord` when the run recorded costs, else None.
    """

    program_id: int
    instructions: int
    compiled_instructions: int
    ops: dict[str, int]
    sbuf_peak_bytes_per_partition: int
    psum_peak_banks: int
    cost: Any = None


@dataclass
class RunStats:
    """Statistics of one simulated launch: the target, the grid and each program's counts."""

    target: str
    grid: int
    nki_version: str = versions.DEFAULT_VERSION  # the NKI version the launch was modelled under
    programs: list[ProgramStats] = field(default_factory=list)

    @property
    def instructions(self) -> int:
        """Instructions executed by all programs together."""
        return sum(p.instructions for p in self.programs)

    @property
    def compiled_instructions_per_program(self) -> int:
        """The largest compiled program (instructions of one program's compiled text)."""
        return max(p.compiled_instructions for p in self.programs)

    @property
    def sbuf_peak_bytes_per_partition(self) -> int:
        return max(p.sbuf_peak_bytes_per_partition for p in self.programs)

    @property
    def psum_peak_banks(self) -> int:
        return max(p.psum_peak_banks for p in self.programs)

    def as_dict(self) -> dict:
        """The legacy ``last_stats`` dictionary (totals over the programs)."""
        return {
            "instructions": self.instructions,
            "compiled_instructions_per_program": self.compiled_instructions_per_program,
            "sbuf_peak_bytes_per_partition": self.sbuf_peak_bytes_per_partition,
            "psum_peak_banks": self.psum_peak_banks,
            "target": self.target,
            "grid": self.grid,
            "nki_version": self.nki_version,
        }


def _check_grid(grid: Any, target: Target) -> int:
    """The launch grid as a number of programs (nki/get-started/about/lnc.rst)."""
    if isinstance(grid, tuple) and len(grid) == 1:
        grid = grid[0]
    if isinstance(grid, tuple):
        # lnc.rst (NKI 0.3): "The bracket syntax must contain only one number, the number of
        # cores to use." Multi-dimensional grids (nl.nc, nl.spmd_dim) are pre-0.3 API.
        raise NkiUnsupportedError(
            f"launch grid {grid}: NKI >= 0.3 launches kernel[n] with one number, the physical "
            "cores per logical core (nki/get-started/about/lnc.rst); for a loop that is not "
            "unrolled use nl.fori_loop (NKI >= 0.6, nki.language.fori_loop page)"
        )
    if isinstance(grid, bool) or not isinstance(grid, (int, np.integer)) or grid < 1:
        raise NkiUnsupportedError(f"launch grid must be a positive int, got {grid!r}")
    if grid > target.lnc_max:
        # lnc.rst: a number too large for the architecture is an error; LNC is 1 or 2 and
        # applies to trn2/trn3 only (about-neuron/arch/neuron-features/logical-neuroncore-config.rst).
        raise NkiLimitError(
            f"launch grid over the logical core size: kernel[{grid}] on {target.name}, whose "
            f"logical cores have at most {target.lnc_max} physical core(s) "
            "(logical-neuroncore-config.rst: LNC is 1 or 2, 2 only on trn2/trn3)"
        )
    return int(grid)


class Recording:
    """The launches simulated inside a ``with recording():`` block, in order (see :func:`recording`)."""

    def __init__(self, cost: bool):
        self.cost = cost
        self.runs: list[RunStats] = []


_RECORDINGS: list[Recording] = []
_RECORDINGS_LOCK = threading.Lock()


@contextlib.contextmanager
def recording(cost: bool = True):
    """Collect the :class:`RunStats` of every simulated launch in the block (any thread).

    With ``cost=True`` every launch records its modelled cost, even launches made deep inside
    the library (for example ``implementation="nki_emulated"``, whose host callback may run on
    another thread)::

        with nki_emulator.recording() as rec:
            jax_sparse_attn.gathered_attn_idx(q, kv, idx, implementation="nki_emulated")
        rec.runs  # [RunStats, ...]
    """
    rec = Recording(cost)
    with _RECORDINGS_LOCK:
        _RECORDINGS.append(rec)
    try:
        yield rec
    finally:
        with _RECORDINGS_LOCK:
            _RECORDINGS.remove(rec)


@contextlib.contextmanager
def recording_on(target: str):
    """:func:`recording` (with costs) while the emulator runs as ``target``: the op's
    ``implementation="nki_emulated"`` calls in the block launch for that target. JAX's caches are
    cleared before and after, so that no trace made for another target is reused."""
    import os

    import jax

    previous = os.environ.get(TARGET_ENV)
    os.environ[TARGET_ENV] = target
    jax.clear_caches()
    try:
        with recording(cost=True) as rec:
            yield rec
    finally:
        if previous is None:
            os.environ.pop(TARGET_ENV, None)
        else:
            os.environ[TARGET_ENV] = previous
        jax.clear_caches()


def launch_figures(runs) -> dict:
    """The modelled figures of a call's launches (:class:`RunStats` with costs): launches run one
    after another, the programs of one launch in parallel (each figure is the slowest program's).
    ``busiest_program_us_by_instruction`` adds up, per instruction, the slowest program of each
    launch, largest first."""
    from .cost import ENGINES

    per_engine = dict.fromkeys(ENGINES, 0.0)
    modelled = 0.0
    by_instruction: dict = {}
    for run in runs:
        costs = [p.cost for p in run.programs]
        modelled += max(c.modelled_us for c in costs)
        for e in ENGINES:
            per_engine[e] += max(c.engine_us[e] for c in costs)
        busiest = max(costs, key=lambda c: c.modelled_us)
        for name, (count, us) in busiest.by_instruction.items():
            entry = by_instruction.setdefault(name, [0, 0.0])
            entry[0] += count
            entry[1] += us
    return {
        "modelled_us": modelled,
        "instructions": max(r.compiled_instructions_per_program for r in runs),
        "instructions_executed": sum(r.instructions for r in runs),
        "busiest_engine": max(per_engine, key=per_engine.get),
        "per_engine_us": per_engine,
        "busiest_program_us_by_instruction": {
            k: round(v[1], 3) for k, v in sorted(by_instruction.items(), key=lambda kv: -kv[1][1])
        },
        "launches": len(runs),
        "grid": max(r.grid for r in runs),
    }


class SimulatedKernel:
    """``simulate(kernel)``: call it with numpy arrays; ``[n]`` sets the launch grid.

    After a call, ``last_run`` holds the :class:`RunStats` and ``last_stats`` the same as a dict.
    """

    def __init__(self, func: types.FunctionType, target: Target, grid: int, stats: bool, cost: bool,
                 nki_version: str | None = None):  # fmt: skip
        self._func = func
        self.nki_version = nki_version  # None: versions.nki_version() at each call
        self.target = target
        self.grid = grid
        self._stats = stats
        self._cost = cost
        self.last_run: RunStats | None = None
        self.last_stats: dict | None = None
        functools.update_wrapper(self, func)

    def __getitem__(self, grid: Any) -> SimulatedKernel:
        """``simulate(kernel)[2]``: the same kernel launched on a grid of 2 programs (LNC=2)."""
        return SimulatedKernel(
            self._func, self.target, _check_grid(grid, self.target), self._stats, self._cost,
            self.nki_version,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        launch = Launch(self.target, self.grid, versions.resolve_version(self.nki_version))
        run_stats = RunStats(self.target.name, self.grid, launch.nki_version)
        # Inputs live in HBM shared by all programs (lnc.rst: "the inputs and outputs of the
        # kernel should be stored in the Shared HBM").
        host = Context(self.target, 0, launch)

        def wrap(value: Any, position: str) -> Any:
            if isinstance(value, Tensor):
                raise TypeError("pass numpy arrays to a simulated kernel, not emulator tensors")
            if isinstance(value, np.ndarray) or hasattr(value, "__array__"):
                return host.wrap_input(np.asarray(value), position)
            return value

        call_args = [wrap(a, f"argument {i}") for i, a in enumerate(args)]
        call_kwargs = {k: wrap(v, k) for k, v in kwargs.items()}
        with _RECORDINGS_LOCK:
            recordings = list(_RECORDINGS)
        record_cost = self._cost or any(r.cost for r in recordings)
        out = None
        first_result = None
        with single_threaded_blas():
            for pid in range(self.grid):
                ctx = Context(self.target, pid, launch)
                if record_cost:
                    from . import cost as cost_model

                    ctx.cost = cost_model.CostRecord(self.target.name)
                bound = _rebind(self._func, {})
                with ctx:
                    result = bound(*call_args, **call_kwargs)
                    ctx.check_capacity()
                    del bound
                if pid == 0:
                    first_result = result
                elif not _same_outputs(first_result, result):
                    raise NkiUnsupportedError(
                        f"program {pid} returned other tensors than program 0: SPMD programs "
                        "return the same shared_hbm outputs (nki/get-started/about/lnc.rst)"
                    )
                run_stats.programs.append(
                    ProgramStats(
                        pid, ctx.instructions, ctx.compiled_instructions, dict(ctx.ops),
                        ctx.sbuf_peak, ctx.psum_peak, ctx.cost,
                    )
                )
                del result, ctx
            out = _to_numpy(first_result)
        self.last_run = run_stats
        self.last_stats = run_stats.as_dict()
        for rec in recordings:
            rec.runs.append(run_stats)
        if self._stats:
            return out, run_stats
        return out


def _same_outputs(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_outputs(x, y) for x, y in zip(a, b))
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a._st is b._st and a.shape == b.shape
    return False


def simulate(
    kernel: Callable,
    *,
    target: str | None = None,
    grid: Any = 1,
    stats: bool = False,
    cost: bool = False,
    nki_version: str | None = None,
) -> SimulatedKernel:
    """Like ``nki.simulate(kernel)``: a callable running ``kernel`` on numpy arrays on the host.

    Args:
      kernel: the NKI kernel function (or a wrapper exposing it as ``__wrapped__`` or ``.func``).
      target: ``"trn1"``, ``"trn2"`` or ``"trn3"``; default :func:`current_target` (NKI's
        ``NEURON_PLATFORM_TARGET_OVERRIDE``, else ``"trn2"``).
      grid: the SPMD launch grid, one number: the physical cores of the logical core (1, or 2 on
        trn2/trn3). ``simulate(kernel)[2]`` is the same as ``simulate(kernel, grid=2)``. Each
        program instance runs the kernel with its own ``nl.program_id(0)``;
        ``nl.num_programs()`` is the grid. The programs share inputs and ``nl.shared_hbm``
        outputs, and each has its own SBUF, PSUM and counters.
      stats: if True, a call returns ``(outputs, RunStats)`` instead of the outputs alone.
      cost: record each instruction's modelled cost (see :mod:`.cost`) in
        ``RunStats.programs[i].cost``.
      nki_version: the NKI version to model (``"0.3"`` .. ``"0.7"``, :mod:`.versions`); default
        :func:`versions.nki_version` when the kernel is called (``JAX_SPARSE_ATTN_NKI_VERSION``,
        else ``"0.7"``). What that version removed or lacks raises.

    The returned callable takes the kernel's arguments (numpy arrays become HBM tensors; other
    values pass through) and returns the kernel's ``nl.shared_hbm`` outputs as numpy arrays: one
    array, or a tuple if the kernel returns several. After a call, ``.last_run`` holds the
    :class:`RunStats` (per program: instructions executed, instructions of the compiled body,
    instructions by name, SBUF/PSUM peaks) and ``.last_stats`` a dict summary.
    """
    info = resolve_target(target)
    version = None if nki_version is None else versions.resolve_version(nki_version)
    return SimulatedKernel(_unwrap(kernel), info, _check_grid(grid, info), stats, cost, version)
