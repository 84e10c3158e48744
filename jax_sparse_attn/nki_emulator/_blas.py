"""Run the emulator's matmuls on one BLAS thread.

The emulated matmuls are small (at most 128 x 128 x 512). A multi-threaded OpenBLAS spins its
threads for each of them, which on a loaded or small host made a kernel run ~20x slower than on one
thread, and its results depend on the thread count (summation order). So ``simulate`` pins the BLAS
numpy uses to one thread for the duration of a run and restores it afterwards. Best effort: with
``threadpoolctl`` installed it is used; otherwise the OpenBLAS loaded by numpy is found in
``/proc/self/maps`` (Linux) and driven through its ``*_set_num_threads`` entry point; elsewhere
nothing changes.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Iterator

_SET_NAMES = (
    "scipy_openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "openblas_set_num_threads",
)
_unresolved = object()
_controls: object = _unresolved


def _find_openblas() -> tuple | None:
    """``(set_num_threads, get_num_threads)`` of the OpenBLAS numpy loaded, or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "openblas" in line.lower()})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for set_name in _SET_NAMES:
            get_name = set_name.replace("set_num_threads", "get_num_threads")
            if hasattr(lib, set_name) and hasattr(lib, get_name):
                setter, getter = getattr(lib, set_name), getattr(lib, get_name)
                setter.argtypes, setter.restype = [ctypes.c_int], None
                getter.argtypes, getter.restype = [], ctypes.c_int
                return setter, getter
    return None


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    global _controls
    try:
        import threadpoolctl
    except ImportError:
        threadpoolctl = None
    if threadpoolctl is not None:
        with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
            yield
        return
    if _controls is _unresolved:
        import numpy  # noqa: F401  (numpy's BLAS must be loaded to be found)

        _controls = _find_openblas()
    if _controls is None:
        yield
        return
    setter, getter = _controls
    before = getter()
    setter(1)
    try:
        yield
    finally:
        setter(before)
