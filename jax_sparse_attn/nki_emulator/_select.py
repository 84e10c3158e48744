"""Selection instructions of ``nki.isa`` (bound into :mod:`.isa`): ``max8``, ``nc_find_index8``,
``nc_match_replace8``, ``nc_n_gather``, ``select_reduce``.

Sources: the ISA pages in ``nki/api/nki/isa/__init__.py`` of aws-neuron/aws-neuron-sdk at tag
v2.32.0 (NKI 0.6) unless stated; the cost formulas in ``nki_emulator/cost.py``. Every rule below
cites its page; "inferred" marks what the pages leave open, where the emulator takes the strict
reading (it raises rather than guess a value the hardware might produce).

Numerics shared by the three "8" instructions: they compare in fp32 (max8 page: "converts them to
fp32 internally"; the same is inferred for find_index8 / match_replace8), so bf16 data compares
exactly as its fp32 value and an fp32 kernel marker must be exactly representable in the data's
dtype. NaN never equals anything (IEEE), so a NaN in ``vals`` never matches (inferred; the pages
are silent); a NaN in max8's input has no documented order, so the emulator refuses it
(inferred). ``+-inf`` are ordinary ordered values (inferred).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from ..constants import MAX8_ELEMENTS
from ._core import F32, ON_CHIP, PSUM, SBUF, Tensor, read, write
from .errors import (
    NkiDtypeError,
    NkiEmulatorError,
    NkiLimitError,
    NkiMemorySpaceError,
    NkiShapeError,
    NkiUnsupportedError,
)
from .language import begin, no_extra, same_base_partition, tensor_arg

# max8 / nc_find_index8 pages: "between 8 and 16,384 elements per partition"; nc_match_replace8
# page: "no more than 16,384 elements per partition".
MAX8_MIN_ELEMENTS = 8
MAX8_MAX_ELEMENTS = MAX8_ELEMENTS
# The "8" of max8 / find_index8 / match_replace8: values per partition in and out.
EIGHT = 8


def _charge(ctx: Any, instr: str, dst: Any, inputs: list) -> None:
    if ctx.cost is not None:
        ctx.cost.compute(instr, None, dst, inputs)


def _per_partition(t: Tensor) -> int:
    return int(np.prod(t.shape[1:], dtype=np.int64)) if t.ndim > 1 else 1


def _check_partitions(instr: str, *tiles: Tensor) -> None:
    parts = {t.shape[0] for t in tiles}
    if len(parts) != 1:
        # max8 page: "The source and output must have the same partition dimension size";
        # find_index8 / match_replace8 pages: data and vals "must have the same number of
        # partitions".
        raise NkiShapeError(
            f"{instr}: partition sizes differ: {[t.describe() for t in tiles]}"
        )


def _check_eight(instr: str, t: Tensor, arg: str) -> None:
    if t.ndim != 2 or t.shape[1] != EIGHT:
        # max8 / find_index8 pages: dst "[par_dim, 8]"; vals "exactly 8 elements per partition"
        # (a 2-D [P, 8] tile here; the pages allow up to 3-D vals: not emulated).
        raise NkiShapeError(f"{instr}: {arg} must be a [P, 8] tile, got {t.describe()}")


def _read_values(t: Tensor, instr: str, arg: str) -> np.ndarray:
    values = read(t, instr, arg)
    return values.reshape(values.shape[0], -1).astype(F32, copy=False)


def max8(dst: Tensor, src: Tensor, **kwargs: Any) -> None:
    """``dst[p, :] = the 8 largest values of src[p, ...]``, descending (duplicates kept).

    ISA max8 page (v2.32.0): inputs converted to fp32 internally, 8 to 16,384 elements per
    partition, ``dst`` ``[par_dim, 8]`` in ``dst.dtype``. SBUF or PSUM input (inferred: the page
    names no memory). A NaN input raises (inferred: no documented order).
    """
    instr = "nisa.max8"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    tensor_arg(src, instr, "src", ON_CHIP)
    tensor_arg(dst, instr, "dst", ON_CHIP)
    _check_eight(instr, dst, "dst")
    _check_partitions(instr, dst, src)
    n = _per_partition(src)
    if not MAX8_MIN_ELEMENTS <= n <= MAX8_MAX_ELEMENTS:
        # max8 page: "The number of elements read per partition must be between 8 and 16,384".
        raise NkiLimitError(
            f"max8 reads 8 to {MAX8_MAX_ELEMENTS} elements per partition: {src.describe()} has {n}"
        )
    values = _read_values(src, instr, "src")
    if np.isnan(values).any():
        raise NkiEmulatorError(
            f"max8 input holds NaN ({src.describe()}): the max8 page gives NaN no order "
            "(inferred: refused; map NaN to a finite key first)"
        )
    # Descending, duplicates kept ("the 8 largest values ... in descending order").
    part = np.partition(values, n - EIGHT, axis=1)[:, n - EIGHT :]
    top = -np.sort(-part, axis=1)
    write(dst, top)
    _charge(ctx, instr, dst, [src])


def _first_match(values: np.ndarray, column: np.ndarray, taken: np.ndarray):
    """Per partition, the first position of ``values [P, N]`` equal to ``column [P]`` (fp32
    compare: NaN never equal) and not yet ``taken``; returns ``(position [P], found [P])``."""
    hit = (values == column[:, None]) & ~taken
    return np.argmax(hit, axis=1), hit.any(axis=1)


def nc_find_index8(dst: Tensor, data: Tensor, vals: Tensor, **kwargs: Any) -> None:
    """``dst[p, i]`` = the position in ``data[p]`` (flattened) of ``vals[p, i]``.

    ISA nc_find_index8 page (v2.32.0): the first occurrence of each value, 8 to 16,384 data
    elements per partition, exactly 8 vals, ``dst`` ``[P, 8]`` uint16 or uint32; a value not in
    ``data`` gives the all-ones sentinel (``0xFFFFFFFF`` / ``0xFFFF``; the v2.25.0 page called it
    undefined). Duplicate vals take successive occurrences in ascending order across the columns
    (the nc_match_replace8 page, v2.32.0: find_index8 "pairs duplicate vals with their matching
    positions in ascending order across dst_idx columns"). NaN never matches (inferred).
    """
    instr = "nisa.nc_find_index8"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    tensor_arg(data, instr, "data", ON_CHIP)
    tensor_arg(vals, instr, "vals", ON_CHIP)
    tensor_arg(dst, instr, "dst", ON_CHIP)
    _check_eight(instr, vals, "vals")
    _check_eight(instr, dst, "dst")
    _check_partitions(instr, dst, data, vals)
    same_base_partition(instr, data, vals)
    if dst.dtype not in (np.dtype(np.uint32), np.dtype(np.uint16)):
        # find_index8 page: "will be uint16 or uint32 type".
        raise NkiDtypeError(f"{instr}: dst must be uint16 or uint32, got {dst.dtype.name}")
    n = _per_partition(data)
    if not MAX8_MIN_ELEMENTS <= n <= MAX8_MAX_ELEMENTS:
        raise NkiLimitError(
            f"nc_find_index8 reads 8 to {MAX8_MAX_ELEMENTS} elements per partition: "
            f"{data.describe()} has {n}"
        )
    values = _read_values(data, instr, "data")
    wanted = _read_values(vals, instr, "vals")
    sentinel = np.iinfo(dst.dtype).max
    out = np.full((values.shape[0], EIGHT), sentinel, np.int64)
    taken = np.zeros(values.shape, bool)
    rows = np.arange(values.shape[0])
    for i in range(EIGHT):  # ascending: column i takes the next unused occurrence
        pos, found = _first_match(values, wanted[:, i], taken)
        out[found, i] = pos[found]
        taken[rows[found], pos[found]] = True
    write(dst, out.astype(dst.dtype))
    _charge(ctx, instr, dst, [data])


def nc_match_replace8(
    dst: Tensor, data: Tensor, vals: Tensor, imm: float, dst_idx: Tensor | None = None,
    **kwargs: Any,
) -> None:  # fmt: skip
    """``dst = data`` with the first occurrence of each of the 8 ``vals`` replaced by ``imm``.

    ISA nc_match_replace8 page (v2.32.0; the numpy equivalent of v2.25.0): at most 16,384 data
    elements per partition, data and vals in SBUF or PSUM, 8 vals per partition; ``dst_idx``
    (``[P, 8]``, uint32) gets each matched position. Duplicate vals are processed in reverse
    (``i = 7 .. 0``): the first matched position goes to the highest column among the duplicates.
    A value absent from ``data`` (a NaN never matches) is undefined behaviour (v2.25.0 page:
    "Behavior is undefined if vals tensor contains values that are not in the data tensor"):
    refused. ``imm`` is an fp32 constant, stored in ``dst.dtype``.
    """
    instr = "nisa.nc_match_replace8"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    tensor_arg(data, instr, "data", ON_CHIP)  # page: "Both input tensors can come from SBUF or PSUM"
    tensor_arg(vals, instr, "vals", ON_CHIP)
    tensor_arg(dst, instr, "dst", ON_CHIP)
    _check_eight(instr, vals, "vals")
    _check_partitions(instr, dst, data, vals)
    same_base_partition(instr, data, vals)
    if tuple(dst.shape) != tuple(data.shape):  # page: "the same shape as the input data tensor"
        raise NkiShapeError(f"{instr}: dst {dst.describe()} must have data's shape {data.shape}")
    if isinstance(imm, bool) or not isinstance(imm, (int, float, np.integer, np.floating)):
        raise NkiUnsupportedError(f"{instr}: imm must be a float constant, got {imm!r}")
    n = _per_partition(data)
    if n > MAX8_MAX_ELEMENTS:
        raise NkiLimitError(
            f"nc_match_replace8 reads at most {MAX8_MAX_ELEMENTS} elements per partition: "
            f"{data.describe()} has {n}"
        )
    if dst_idx is not None:
        tensor_arg(dst_idx, instr, "dst_idx", ON_CHIP)
        _check_eight(instr, dst_idx, "dst_idx")
        if dst_idx.dtype.kind not in "iu":  # page: "indices of matched values"
            raise NkiDtypeError(f"{instr}: dst_idx must be an integer tile, got {dst_idx.dtype.name}")
    values = _read_values(data, instr, "data").copy()
    wanted = _read_values(vals, instr, "vals")
    positions = np.zeros((values.shape[0], EIGHT), np.int64)
    taken = np.zeros(values.shape, bool)
    rows = np.arange(values.shape[0])
    for i in range(EIGHT - 1, -1, -1):  # the page: vals processed in reverse order
        pos, found = _first_match(values, wanted[:, i], taken)
        if not found.all():
            p = int(np.flatnonzero(~found)[0])
            raise NkiEmulatorError(
                f"nc_match_replace8: vals[{p}, {i}] = {wanted[p, i]!r} is not in data "
                f"({data.describe()}): undefined behaviour (nc_match_replace8 page, v2.25.0); "
                "NaN never matches"
            )
        positions[:, i] = pos
        taken[rows, pos] = True
    values[taken] = np.float32(imm)
    write(dst, values.reshape(dst.shape))
    if dst_idx is not None:
        write(dst_idx, positions.astype(dst_idx.dtype))
    _charge(ctx, instr, dst, [data])


def nc_n_gather(dst: Tensor, data: Tensor, indices: Tensor, **kwargs: Any) -> None:
    """``dst[p, j] = data[p].flatten()[indices[p, j]]`` on the GpSimd engine, within partitions.

    ISA nc_n_gather page (v2.32.0): ``data``, ``indices`` and ``dst`` in SBUF ("GpSimd Engine
    cannot access PSUM"), same partitions (<= 128), ``dst`` of ``data``'s dtype, ``indices``
    uint32 in ``[0, elements per partition of data)``, as many elements per partition in ``dst``
    as in ``indices``.
    """
    instr = "nisa.nc_n_gather"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    for arg, t in (("dst", dst), ("data", data), ("indices", indices)):
        tensor_arg(t, instr, arg, (SBUF,))
    _check_partitions(instr, dst, data, indices)
    same_base_partition(instr, data, indices)
    if indices.dtype != np.dtype(np.uint32):
        raise NkiDtypeError(f"{instr}: indices must be uint32, got {indices.dtype.name}")
    if dst.dtype != data.dtype:
        raise NkiDtypeError(f"{instr}: dst dtype {dst.dtype.name} must equal data's {data.dtype.name}")
    if _per_partition(dst) != _per_partition(indices):
        raise NkiShapeError(
            f"{instr}: dst {dst.describe()} and indices {indices.describe()} differ in elements "
            "per partition"
        )
    values = read(data, instr, "data").reshape(data.shape[0], -1)
    where = read(indices, instr, "indices").reshape(indices.shape[0], -1).astype(np.int64)
    if where.size and (where.min() < 0 or where.max() >= values.shape[1]):
        raise NkiEmulatorError(
            f"{instr}: an index is outside [0, {values.shape[1]}) (page: indices must be within "
            f"the range [0, data.size / data.shape[0])), got max {int(where.max())}"
        )
    write(dst, np.take_along_axis(values, where, axis=1).reshape(dst.shape))
    _charge(ctx, instr, dst, [dst])


def select_reduce(
    dst: Tensor, predicate: Tensor, on_true: Tensor, on_false: Any, reduce_res: Any = None,
    reduce_cmd: Any = None, reduce_op: Any = None, reverse_pred: bool = False, **kwargs: Any,
) -> None:  # fmt: skip
    """``dst = where(predicate, on_true, on_false)`` on the Vector engine (a select, so whatever
    ``on_true`` holds where the predicate is false, NaN included, never reaches ``dst``).

    ISA select_reduce page (v2.32.0): ``on_true``, ``dst`` and ``predicate`` of identical shapes;
    ``predicate`` an integer tile (int8/uint8/int16/uint16); ``on_true`` not int32/uint32;
    ``on_false`` an fp32 scalar or a ``[P, 1]`` column; ``on_true`` and ``predicate`` not both in
    PSUM. The optional max reduction is not emulated (``reduce_res`` must be None, ``reduce_cmd``
    idle).
    """
    from .isa import reduce_cmd as _RC

    instr = "nisa.select_reduce"
    no_extra(kwargs, instr)
    ctx = begin(instr)
    if reduce_res is not None or reduce_cmd not in (None, _RC.idle):
        raise NkiUnsupportedError(f"{instr}: the reduction (reduce_res / reduce_cmd) is not emulated")
    tensor_arg(dst, instr, "dst", ON_CHIP)
    tensor_arg(predicate, instr, "predicate", ON_CHIP)
    tensor_arg(on_true, instr, "on_true", ON_CHIP)
    if predicate.buffer is PSUM and on_true.buffer is PSUM:
        raise NkiMemorySpaceError(
            f"operand in the wrong memory: {instr} on_true and predicate may not both be in PSUM"
        )
    if not (tuple(dst.shape) == tuple(predicate.shape) == tuple(on_true.shape)):
        raise NkiShapeError(
            f"{instr}: dst, predicate and on_true need identical shapes, got {dst.shape}, "
            f"{predicate.shape}, {on_true.shape}"
        )
    if predicate.dtype not in tuple(np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16)):
        raise NkiDtypeError(
            f"{instr}: predicate must be int8/uint8/int16/uint16, got {predicate.dtype.name}"
        )
    if on_true.dtype in (np.dtype(np.int32), np.dtype(np.uint32)):
        raise NkiDtypeError(f"{instr}: on_true cannot be {on_true.dtype.name}")
    inputs = [on_true, predicate]
    if isinstance(on_false, Tensor):
        tensor_arg(on_false, instr, "on_false", ON_CHIP)
        if on_false.shape != (on_true.shape[0], 1):
            raise NkiShapeError(f"{instr}: on_false must be a scalar or a [P, 1] column")
        inputs.append(on_false)
        fill = read(on_false, instr, "on_false").astype(F32).reshape(
            (on_true.shape[0],) + (1,) * (on_true.ndim - 1))
    elif isinstance(on_false, (int, float, np.integer, np.floating)) and not isinstance(on_false, bool):
        fill = np.float32(on_false)
    else:
        raise NkiUnsupportedError(f"{instr}: on_false of type {type(on_false).__name__}")
    same_base_partition(instr, *inputs)
    keep = read(predicate, instr, "predicate") != 0
    if reverse_pred:
        keep = ~keep
    values = read(on_true, instr, "on_true").astype(F32, copy=False)
    write(dst, np.where(keep, values, fill))
    _charge(ctx, instr, dst, [on_true])


__all__ = ["max8", "nc_find_index8", "nc_match_replace8", "nc_n_gather", "select_reduce",
           "MAX8_MAX_ELEMENTS"]  # fmt: skip


# topk page (v2.32.0): "partition dim must be a multiple of 16" (the snake spans 16 partitions).
TOPK_SNAKE_PARTITIONS = 16
TOPK_MAX_N = 65536  # "8 <= n < 65536"
TOPK_MAX_K = 32768  # "1 <= K < 32768 and K <= n"


def topk(val_dst: Tensor, idx_dst: Tensor, src: Tensor, n: int, **kwargs: Any) -> None:
    """The K largest of ``n`` bf16 values laid out as a 16-partition snake (GpSimd; NKI 0.6+).

    ISA topk page (v2.32.0): element ``e`` of a snake sits at partition ``e % 16`` (of its group
    of 16), column ``e // 16``; ``n`` active elements, ``8 <= n < 65536``; ``src``, ``val_dst``
    bf16 and ``idx_dst`` uint32 in SBUF; ``val_dst``/``idx_dst`` ``[par_dim, K]`` with
    ``1 <= K < 32768``, ``K <= n``; ``src`` at least ``ceil(n / 16)`` columns; partitions a
    multiple of 16. ``val_dst`` gets the K largest values in ascending order, ``idx_dst`` their
    0-based snake indices. Inferred (the page is terse): each group of 16 partitions is one
    problem and all 16 partitions of the group receive its result; a tie at the K-th value
    between a kept and a dropped element has no documented winner, so the emulator refuses it,
    as it refuses NaN. The 0.7 form ``sorted=False`` is not emulated.
    """
    from . import versions

    instr = "nisa.topk"
    no_extra(kwargs, instr)
    versions.requires("nisa.topk")
    ctx = begin(instr)
    for arg, t in (("val_dst", val_dst), ("idx_dst", idx_dst), ("src", src)):
        tensor_arg(t, instr, arg, (SBUF,))
    bf16 = np.dtype(ml_dtypes.bfloat16)
    if src.dtype != bf16 or val_dst.dtype != bf16:
        raise NkiDtypeError(f"{instr}: src and val_dst must be bfloat16, got {src.dtype.name}, "
                            f"{val_dst.dtype.name}")  # fmt: skip
    if idx_dst.dtype != np.dtype(np.uint32):
        raise NkiDtypeError(f"{instr}: idx_dst must be uint32, got {idx_dst.dtype.name}")
    parts = src.shape[0]
    if parts % TOPK_SNAKE_PARTITIONS or src.ndim != 2:
        raise NkiShapeError(f"{instr}: src must be [16*g, x] (partitions a multiple of 16), got "
                            f"{src.describe()}")  # fmt: skip
    k = val_dst.shape[1] if val_dst.ndim == 2 else 0
    if val_dst.shape != (parts, k) or idx_dst.shape != (parts, k):
        raise NkiShapeError(f"{instr}: val_dst and idx_dst must be [{parts}, K]")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 8 <= n < TOPK_MAX_N:
        raise NkiLimitError(f"{instr}: n must be an int with 8 <= n < {TOPK_MAX_N}, got {n!r}")
    if not 1 <= k < TOPK_MAX_K or k > n:
        raise NkiLimitError(f"{instr}: K={k} must satisfy 1 <= K < {TOPK_MAX_K} and K <= n={n}")
    if src.shape[1] * TOPK_SNAKE_PARTITIONS < n:
        raise NkiShapeError(f"{instr}: src has {src.shape[1]} columns, n={n} needs "
                            f"{-(-n // TOPK_SNAKE_PARTITIONS)}")  # fmt: skip
    values = read(src, instr, "src").astype(F32)
    vals_out = np.zeros((parts, k), F32)
    idx_out = np.zeros((parts, k), np.int64)
    for g in range(parts // TOPK_SNAKE_PARTITIONS):
        block = values[g * TOPK_SNAKE_PARTITIONS : (g + 1) * TOPK_SNAKE_PARTITIONS]
        snake = block.T.reshape(-1)[:n]  # element e: partition e % 16, column e // 16
        if np.isnan(snake).any():
            raise NkiEmulatorError(f"{instr}: the snake of group {g} holds NaN (no documented order)")
        order = np.argsort(-snake, kind="stable")
        if k < n and snake[order[k - 1]] == snake[order[k]]:
            raise NkiEmulatorError(
                f"{instr}: a tie at the K-th value ({snake[order[k - 1]]}) in group {g}: the topk "
                "page documents no tie order (inferred: refused)"
            )
        chosen = order[:k][::-1]  # ascending
        rows = slice(g * TOPK_SNAKE_PARTITIONS, (g + 1) * TOPK_SNAKE_PARTITIONS)
        vals_out[rows] = snake[chosen]
        idx_out[rows] = chosen
    write(val_dst, vals_out)
    write(idx_dst, idx_out.astype(np.uint32))
    if ctx.cost is not None:
        ctx.cost.compute(instr, None, val_dst, [src], value=n)


__all__ += ["topk"]
