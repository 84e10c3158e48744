"""A strict host (numpy) emulator of the NKI subset the project's kernels use.

The Neuron SDK (and with it ``nki.simulate``) cannot be installed here, so this package runs the
project's NKI kernel source on the host, for CI and debugging. It mirrors the real simulator's entry
point::

    from jax_sparse_attn import nki_emulator
    out = nki_emulator.simulate(kernel)(q_np, kv_np, ...)          # numpy in, numpy out
    out = nki_emulator.simulate(kernel, target="trn2")(...)        # 224 KiB SBUF budget

``simulate`` runs ``kernel`` with the names ``nki``, ``nl`` and ``nisa`` bound to this package,
:mod:`.language` and :mod:`.isa`, whatever the kernel's module imported (kernel modules guard
``import nki``, so their own globals may hold ``None``). Functions of the kernel's module (and of
other modules it refers to that use those names) are rebound too, so helpers called by the kernel
see the emulator. Kernel arguments that are arrays become HBM tensors holding a copy; the kernel
returns tensors it allocated in ``nl.shared_hbm``, which come back as numpy arrays (one, or a tuple).

What is emulated (see /work/shared/spec/NKI_SUBSET.md for the rules):

* ``nl``: dtypes (``bfloat16`` is ``ml_dtypes.bfloat16``, rounded to nearest even), buffers
  (``sbuf``, ``psum``, ``hbm``, ``shared_hbm``), ``ndarray``, ``zeros``, ``full``, ``load``,
  ``store``, ``copy``, ``broadcast_to``, elementwise ``add``/``subtract``/``multiply``/``divide``/
  ``maximum``/``minimum``/``negative``/``exp``/..., free-axis reductions ``max``/``min``/``sum``,
  ``affine_range``/``static_range`` (plain ranges).
* ``nisa``: ``dma_copy`` (with ``tensor.ap(...)`` patterns, including the indirect row gather),
  ``dma_transpose``, ``tensor_copy``, ``nc_matmul``, ``nc_transpose``, ``activation`` (and
  ``activation_reduce``), ``tensor_scalar``, ``scalar_tensor_tensor``, ``tensor_tensor``,
  ``tensor_reduce``, ``reciprocal``, ``memset``.

Memory model. Every allocation is a numpy array plus an *initialised* mask; fresh memory holds
garbage (NaN for floats) and reading any element never written raises. Tensors are views (python
ints and slices) that write through. On-chip memory is charged while the Python object that owns it
is alive (CPython frees a tile when its last reference goes, e.g. when a loop rebinds the name) and
capacity is checked at the start of every instruction: SBUF bytes per partition against the target's
budget (192 KiB trn1, 224 KiB trn2; a tile costs ``prod(shape[1:]) * itemsize`` whatever its
partition count) and PSUM tiles against its 8 banks (one bank per tile). The Scalar Engine reduce
registers of ``nisa.activation`` are emulated per run.

Strictness. Anything the compiler or hardware would reject raises an :class:`NkiEmulatorError`
subclass whose message starts with the rule: partition axis > 128, PSUM tile over 2 KiB per
partition, SBUF over its budget / more PSUM live than 8 banks, matmul K/M/N over 128/128/512,
operands in the wrong memory, transpose over 128 x 128, dma_transpose of a 4-byte dtype (and its
size/alignment rules), reductions over the partition axis, shape mismatches between dst and the
computed value, out-of-range gather indices, reads of memory never written, accesses outside a
tensor, and inputs of one instruction at different base partitions (compiler error NCC_IBIR297).
Where the NKI docs are ambiguous the stricter reading is taken and written next to the code.

Numerics. Compute instructions read fp32, compute in fp32 and round once to the destination dtype;
matmuls accumulate in fp32 (numpy's summation order, not the PE array's: expect last-bit fp32
differences from hardware); free-axis sums accumulate in float64 and round once to fp32.
Float-to-integer conversions truncate toward zero (numpy's cast); the hardware's rounding mode
for such casts is not modelled.

Not emulated (raises :class:`NkiUnsupportedError`): masks, ``tensor.ap`` on on-chip tensors or
on views, scatter (indirect destinations), ``t[...] = value`` assignment, and the NKI functions
not listed above.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable

import numpy as np

from . import isa, language
from ._blas import single_threaded_blas
from ._core import SHARED_HBM, SBUF_BYTES_PER_PARTITION, Context, Tensor
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

__all__ = [
    "simulate",
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


def simulate(kernel: Callable, *, target: str = "trn1") -> Callable:
    """Like ``nki.simulate(kernel)``: a callable running ``kernel`` on numpy arrays on the host.

    Args:
      kernel: the NKI kernel function (or a wrapper exposing it as ``__wrapped__`` or ``.func``).
      target: ``"trn1"`` (192 KiB SBUF per partition) or ``"trn2"`` (224 KiB).

    The returned callable takes the kernel's arguments (numpy arrays become HBM tensors; other
    values pass through) and returns the kernel's ``nl.shared_hbm`` outputs as numpy arrays: one
    array, or a tuple if the kernel returns several. After a call, ``.last_stats`` holds the run's
    instruction count and SBUF/PSUM peaks.
    """
    if target not in SBUF_BYTES_PER_PARTITION:
        raise ValueError(f"target must be one of {sorted(SBUF_BYTES_PER_PARTITION)}, got {target!r}")
    func = _unwrap(kernel)

    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> Any:
        ctx = Context(target)
        bound = _rebind(func, {})

        def wrap(value: Any, position: str) -> Any:
            if isinstance(value, Tensor):
                raise TypeError("pass numpy arrays to a simulated kernel, not emulator tensors")
            if isinstance(value, np.ndarray) or hasattr(value, "__array__"):
                return ctx.wrap_input(np.asarray(value), position)
            return value

        call_args = [wrap(a, f"argument {i}") for i, a in enumerate(args)]
        call_kwargs = {k: wrap(v, k) for k, v in kwargs.items()}
        with ctx, single_threaded_blas():
            result = bound(*call_args, **call_kwargs)
            ctx.check_capacity()
            out = _to_numpy(result)
        run.last_stats = {
            "instructions": ctx.instructions,
            "sbuf_peak_bytes_per_partition": ctx.sbuf_peak,
            "psum_peak_banks": ctx.psum_peak,
            "target": target,
        }
        return out

    run.last_stats = None
    return run
