"""The indexer's Neuron path: pack (jnp) -> the NKI kernel (:mod:`.kernel`) -> unpack.

:func:`indexer_topk_neuron` takes the primitive's operands (docs/indexer.md): ``emulated=True``
runs the kernel source under the project's NKI emulator on the host (``jax.pure_callback``, as
``jax_sparse_attn/attention/neuron.py`` does for the attention op); ``emulated=False`` calls it
through ``nki.jit`` (NKI's own ``nki_call``) on a Neuron device. docs/indexer-kernel.md describes
the packing, the kernel and its cost.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..constants import round_up as _round_up
from . import decode_kernel as _decode
from . import kernel as _kernel
from .reference import key_rows

# Row numbers travel through the kernel as fp32 (its row ids and the n_valid bound): exact below
# 2**24 rows.
MAX_KERNEL_ROWS = 2**24


def valid_rows(positions, rows: int, compress_ratio: int):
    """``[T]`` int32: how many rows each token may select (docs/indexer.md, "Validity"):
    ``min(R, floor((position + 1) / ratio))``, 0 for a negative position (written without
    ``position + 1``, which would overflow at INT32_MAX)."""
    pos = positions.astype(jnp.int32)
    ratio = jnp.int32(compress_ratio)
    whole = pos // ratio  # complete blocks before the position's own
    # The position's own block counts when it is complete; capped at R before adding, so that
    # INT32_MAX // 1 + 1 cannot wrap.
    n = jnp.where(whole >= rows, rows, whole + (pos % ratio == ratio - 1).astype(jnp.int32))
    return jnp.where(pos < 0, 0, jnp.minimum(n, rows)).astype(jnp.int32)


def _pack(plan, shares: int, programs: int, q, weights, keys, key_scale, n_valid):
    """The first kernel's operands (kernel module docstring, "Interface"); the tiles padded to a
    multiple of the merge kernel's ``programs``."""
    T, Hi, Di = q.shape
    tt = plan.tile_tokens
    tiles = _round_up(-(-T // tt), programs)
    tokens = tiles * tt
    pad_t = tokens - T
    q_p = jnp.pad(q, ((0, pad_t), (0, 0), (0, 0)))
    q_t = q_p.reshape(tiles, tt, Hi, Di).transpose(0, 3, 1, 2).reshape(tiles, Di, tt * Hi)
    w = jnp.pad(weights.astype(jnp.float32), ((0, pad_t), (0, 0)))
    w_t = w.reshape(tiles, tt, Hi).transpose(0, 2, 1)
    R = keys.shape[0]
    pad_r = plan.rows_padded - R
    keys_t = jnp.pad(keys, ((0, pad_r), (0, 0))).T.reshape(Di, plan.chunks, plan.chunk)
    scale = jnp.ones((R,), jnp.float32) if key_scale is None else key_scale.astype(jnp.float32)
    scale = jnp.pad(scale, (0, pad_r), constant_values=1.0).reshape(plan.chunks, plan.chunk)
    nv = jnp.pad(n_valid, (0, pad_t)).reshape(tiles, tt)
    # Chunks holding a valid row for some token of the tile; share s scores chunks
    # [s * per_share, end_s): the rows split between the programs.
    needed = -(-jnp.max(nv, axis=1) // plan.chunk)
    per_share = plan.chunks // shares
    starts = jnp.arange(shares)[:, None] * per_share
    ends = jnp.clip(needed[None, :], starts, starts + per_share).astype(jnp.int32)
    operands = (q_t, w_t, keys_t, scale, nv.astype(jnp.float32)[..., None], ends[..., None])
    return operands, tiles


def scores_from_keys(keys, idx):
    """The kernel's selection keys back to f32 scores (kernel module docstring, step 2):
    ``NEG_INF_KEY`` -> -inf, ``NAN_KEY`` -> NaN, else ``key / KEY_FACTOR``; -0 -> +0; ``-inf``
    where ``idx`` is -1."""
    score = keys * jnp.float32(1.0 / _kernel.KEY_FACTOR)
    score = jnp.where(keys == jnp.float32(_kernel.NEG_INF_KEY), -jnp.inf, score)
    score = jnp.where(keys == jnp.float32(_kernel.NAN_KEY), jnp.nan, score) + jnp.float32(0.0)
    return jnp.where(idx < 0, -jnp.inf, score).astype(jnp.float32)


def _finish_on_host(part_keys, part_rows, topk: int):
    """One share's partial selection is the result: keys and ``idx`` (row, or -1 at MARKER)."""
    keys = part_keys[0][..., :topk]
    idx = np.where(keys > np.float32(_kernel.MARKER), part_rows[0][..., :topk], -1.0)
    return keys, idx.astype(np.int32)


def _run_on_host(target: str, shares: int, programs: int, topk: int, chunk: int, *arrays):
    from ..nki_emulator import simulate

    match = _kernel.selection_variant(target)
    first = simulate(_kernel.indexer_topk_kernel, target=target)[shares]
    part_keys, part_rows = first(*[np.asarray(a) for a in arrays], topk=topk, chunk=chunk,
                                 match_indices=match)  # fmt: skip
    if shares > 1:
        merge = simulate(_kernel.indexer_merge_kernel, target=target)[programs]
        keys_out, idx = merge(part_keys, part_rows, topk=topk, match_indices=match)
    else:
        keys_out, idx = _finish_on_host(part_keys, part_rows, topk)
    # One f32 result (row numbers are exact in f32 below 2**24): JAX 0.7 cannot lower a
    # pure_callback with two results inside shard_map.
    return np.concatenate([keys_out, idx.astype(np.float32)], axis=-1)


def _call_emulated(target, shares, programs, plan, operands, tiles):
    tt, k = plan.tile_tokens, plan.topk
    result = jax.ShapeDtypeStruct((tiles, tt, 2 * k), jnp.float32)
    packed = jax.pure_callback(
        functools.partial(_run_on_host, target, shares, programs, k, plan.chunk), result,
        *operands, vmap_method="sequential",
    )  # fmt: skip
    return packed[..., :k], packed[..., k:].astype(jnp.int32)


def _call_nki(target, shares, programs, plan, operands):
    from ..attention.neuron import jitted_kernel  # the shared nki.jit cache and install hint

    match = _kernel.selection_variant(target)
    first = jitted_kernel(_kernel.indexer_topk_kernel)
    if shares > 1:
        first = first[shares]  # one program per physical core (LNC=2), each a share of the rows
    part_keys, part_rows = first(*operands, topk=plan.topk, chunk=plan.chunk, match_indices=match)
    if shares == 1:
        keys = part_keys[0][..., : plan.topk]
        idx = jnp.where(keys > jnp.float32(_kernel.MARKER), part_rows[0][..., : plan.topk], -1.0)
        return keys, idx.astype(jnp.int32)
    merge = jitted_kernel(_kernel.indexer_merge_kernel)
    if programs > 1:
        merge = merge[programs]
    return merge(part_keys, part_rows, topk=plan.topk, match_indices=match)


def decode_group(T: int, Hi: int, programs: int) -> int:
    """Tokens per group of the row-spread kernel: 2 (sharing each ``d`` matmul's 128 stationary
    columns) where two tokens' heads fit and each program has more than one token, else 1."""
    return 2 if 2 * Hi <= _kernel.KERNEL_TILE and T > programs else 1


def decode_splits_rows(T: int, programs: int, chunks: int) -> bool:
    """Whether the row-spread kernel runs in two launches (``decode_kernel``'s phases): the
    programs split each token's ``chunks`` to score them, then each ranks and places a share of
    the token's list. Where the
    tokens are fewer than the programs (a decode step), a program would otherwise sit idle while
    the other reads every key row alone; it needs a chunk for each program."""
    return 1 < programs <= chunks and T < programs


def decode_span(T: int, group: int, programs: int) -> int:
    """Groups per span of the row-spread kernel: 2 (sharing each read of a chunk of keys, which
    a pair of tokens would otherwise repeat) where every program has two pairs or more, else 1."""
    return 2 if group == 2 and T >= 2 * group * programs else 1


def _pack_decode(plan, programs: int, q, weights, keys, key_scale, n_valid):
    """The row-spread kernel's operands (:mod:`.decode_kernel`, "Interface"), the tokens in
    groups (:func:`decode_group`) and spans (:func:`decode_span`) padded to a multiple of the
    programs."""
    T, Hi, Di = q.shape
    g = decode_group(T, Hi, programs)
    s = decode_span(T, g, programs)
    tokens = _round_up(T, programs * g * s)
    pad_t = tokens - T
    spans = tokens // (g * s)
    # [spans, s, Di, g Hi]: a group's tokens side by side on the stationary columns.
    q_t = jnp.pad(q, ((0, pad_t), (0, 0), (0, 0))).reshape(spans, s, g * Hi, Di).transpose(0, 1, 3, 2)
    w_t = jnp.pad(weights.astype(jnp.float32), ((0, pad_t), (0, 0))).reshape(spans, s, g * Hi, 1)
    R = keys.shape[0]
    n, c = plan.chunks, plan.chunk
    pad_r = plan.rows_padded - R
    keys_t = jnp.pad(keys, ((0, pad_r), (0, 0))).T.reshape(Di, n, c)
    scale = jnp.ones((R,), jnp.float32) if key_scale is None else key_scale.astype(jnp.float32)
    # [p, j] = scale[128 j + p]: the partitions' rows, as the kernel lays the scores out.
    scale_t = jnp.pad(scale, (0, pad_r), constant_values=1.0).reshape(plan.columns, _decode.P).T
    nv = jnp.pad(n_valid, (0, pad_t))
    ends = (-(-nv // c)).astype(jnp.int32)
    operands = (q_t, w_t, keys_t, scale_t, nv.astype(jnp.float32).reshape(spans, s * g, 1),
                ends.reshape(1, spans, s * g))  # fmt: skip
    return operands, tokens


def _run_decode_on_host(target: str, programs: int, score_programs: int, score_on_vector: int,
                        *arrays, **statics):
    from ..nki_emulator import simulate

    arrays = [np.asarray(a) for a in arrays]
    if score_programs:  # two launches: the programs split the rows to score them, then the list
        scoring, selecting = _split_launch_keywords(statics, score_on_vector)
        staged = simulate(_decode.indexer_decode_score_kernel, target=target)[score_programs](
            *arrays, **scoring)  # fmt: skip
        keys_out, idx, _ = simulate(_decode.indexer_decode_select_kernel, target=target)[programs](
            *arrays, *staged, **selecting)  # fmt: skip
        keys_out, idx = merge_copies(keys_out, idx, programs)
    else:
        keys_out, idx, _ = simulate(_decode.indexer_decode_kernel, target=target)[programs](
            *arrays, **statics)  # fmt: skip
    return np.concatenate([keys_out, idx.astype(np.float32)], axis=-1)


def _split_launch_keywords(statics: dict, score_on_vector: int):
    """The two launches' keywords from the one launch's: the scoring launch's, the selecting's."""
    scoring = dict(topk=statics["topk"], depth=statics["depth"], on_vector=score_on_vector,
                   signed=statics["signed"])  # fmt: skip
    selecting = {k: statics[k] for k in ("topk", "depth", "split", "steps", "offload")}
    return scoring, selecting


def merge_copies(keys_out, idx, copies: int):
    """The selecting launch's result from its programs' copies (``[copies S, slots, K]``): each
    slot is placed by one program and holds ``MARKER`` / -1 in the others (below every placed
    key and row), so the result is their maximum."""
    xp = np if isinstance(keys_out, np.ndarray) else jnp
    keys_out = keys_out.reshape((copies, -1) + tuple(keys_out.shape[1:])).max(axis=0)
    idx = idx.reshape((copies, -1) + tuple(idx.shape[1:])).max(axis=0)
    return xp.asarray(keys_out), xp.asarray(idx)


def _call_decode(target, programs, plan, operands, tokens, emulated, split_rows=False):
    """The row-spread kernel on the packed ``operands``: one launch of ``programs``, or with
    ``split_rows`` (:func:`decode_splits_rows`; operands packed for one program) two launches
    of ``programs``: the scoring, then the selecting (each program builds the same list and
    ranks and places its share of it; :func:`merge_copies`)."""
    k = plan.topk
    spans, slots = operands[4].shape[:2]
    g = slots // operands[0].shape[1]  # tokens per group: slots over the groups of a span
    # The kernel's compile-time arguments.
    on_vector = head_sums_on_vector(target, plan, g)
    signed = not split_rows and signed_head_sums(target, plan, g, on_vector)
    # The selecting launch's programs each rank a share of the list's columns.
    offload = rank_offload(target, plan, g, on_vector, programs if split_rows else 1, signed)
    statics = dict(topk=k, depth=plan.depth, split=plan.split, steps=plan.steps,
                   on_vector=on_vector, offload=offload, signed=signed)  # fmt: skip
    score_programs = programs if split_rows else 0
    score_on_vector = scoring_on_vector(target, plan, g, programs) if split_rows else 0
    if emulated:
        result = jax.ShapeDtypeStruct((spans, slots, 2 * k), jnp.float32)
        packed = jax.pure_callback(
            functools.partial(_run_decode_on_host, target, programs, score_programs,
                              score_on_vector, **statics),
            result,
            *operands, vmap_method="sequential",
        )  # fmt: skip
        return packed[..., :k], packed[..., k:].astype(jnp.int32)
    from ..attention.neuron import jitted_kernel

    if split_rows:
        scoring, selecting = _split_launch_keywords(statics, score_on_vector)
        staged = jitted_kernel(_decode.indexer_decode_score_kernel)[score_programs](
            *operands, **scoring)  # fmt: skip
        keys_out, idx, _ = jitted_kernel(_decode.indexer_decode_select_kernel)[programs](
            *operands, *staged, **selecting)  # fmt: skip
        return merge_copies(keys_out, idx, programs)
    run = jitted_kernel(_decode.indexer_decode_kernel)
    if programs > 1:
        run = run[programs]
    keys_out, idx, _ = run(*operands, **statics)
    return keys_out, idx


def decode_plan(target: str, Hi: int, Di: int, R: int, topk: int):
    """:func:`decode_kernel.plan_decode` for ``target``'s SBUF, with step 3b's ``split`` (rank
    columns as GpSimd compares and ScalarE sums) balancing the VectorE's count passes against the
    ScalarE's sums and relu by the target's clocks (the cost formulas: ``M + MIN_II`` cycles a
    column on either engine, the relu one ScalarE cycle per scored row)."""
    from ..nki_emulator.cost import HARDWARE, MIN_II
    from ..nki_emulator.targets import TARGETS

    plan = _decode.plan_decode(Hi, Di, R, topk, TARGETS[target].sbuf_bytes_per_partition)
    if plan is None:
        return None
    hw = HARDWARE[target]
    column = plan.candidates + MIN_II
    relu_us = plan.rows_padded / hw.scalar_ghz
    split = ((plan.depth * column / hw.vector_ghz - relu_us)
             / (column / hw.vector_ghz + column / hw.scalar_ghz))  # fmt: skip
    return dataclasses.replace(plan, split=int(min(max(round(split), 0), plan.depth)))


def rank_offload(target: str, plan, group: int, on_vector: int, programs: int = 1,
                 signed: bool = False) -> int:
    """The kernel's ``offload`` (:func:`list_offload_columns`) for tokens in groups of ``group``
    with ``on_vector`` head-sum blocks per chunk on the VectorE (and the TensorE's head sums
    ``signed`` or by sign); ``programs > 1``: the two-launch form's selecting launch, which
    scores nothing."""
    if programs > 1:
        return list_offload_columns(target, plan, programs)
    return list_offload_columns(
        target, plan, relu_cycles=_decode_relu_cycles(plan, group, on_vector),
        scoring_cycles=_decode_scoring_vector_cycles(plan, group, on_vector, signed))


def rank_pass_widths(plan, programs: int = 1) -> list:
    """The elements per partition of each of one program's rank passes over the pivot's list
    (``decode_kernel`` step 3a), widest first. One program ranking the whole list compares each
    pair once: block ``c``'s pass covers the entries from ``128 c`` on. A share of the list's
    columns (``programs > 1``, the larger share) takes two passes per column over the shifted
    list's ``cap + 128`` together."""
    cap_cols = plan.compact // _decode.P
    if programs == 1:
        return [plan.compact - c * _decode.P for c in range(cap_cols)]
    return [plan.compact + _decode.LIST_PAD] * -(-cap_cols // programs)


def _selection_tensor_cycles(plan) -> float:
    """TensorE cycles of one token's selection on the pivot's path, by the nc_matmul and
    nc_transpose formulas: the candidates' counts summed over the partitions (an fp32 matmul,
    ``ones`` stationary) for the bound and each of the first halvings, the row-order grid's two
    bf16 matmuls per block of up to 512 columns, two fp32 broadcasts of one value and four
    transposes of a column."""
    from ..nki_emulator.cost import MATMUL_FP32_FACTOR, MATMUL_MIN_STATIONARY

    fp32_sum = MATMUL_MIN_STATIONARY * MATMUL_FP32_FACTOR
    counts = min(plan.steps, _decode.EARLY_BISECT_STEPS) + 1
    grid_block = min(_decode.ROWS_PER_MATMUL, plan.columns)
    grid = 2 * -(-plan.columns // grid_block) * grid_block
    return (counts + 2) * fp32_sum + grid + 4 * _decode.P


def _rank_tensor_cycles(plan) -> float:
    """TensorE cycles of one token's ranks over its whole list (one launch): per pair of blocks
    one bf16 matmul with the earlier block's ``[128, 128]`` tile stationary and a column of ones
    moving (``MIN`` stationary cycles by the nc_matmul formula)."""
    from ..nki_emulator.cost import MATMUL_MIN_STATIONARY

    cap_cols = plan.compact // _decode.P
    return cap_cols * (cap_cols - 1) / 2 * MATMUL_MIN_STATIONARY


@functools.lru_cache(maxsize=1024)
def list_offload_columns(target: str, plan, programs: int = 1, relu_cycles: float = 0.0,
                         scoring_cycles: float = 0.0) -> int:
    """Of the pivot list's rank passes (``decode_kernel`` step 3a) that one program makes
    (:func:`rank_pass_widths`), the last (narrowest) ones counted as GpSimd compares and ScalarE
    sums: the count that evens one token's work on the VectorE, the GpSimd and the ScalarE
    (:func:`selection_engines_us`). Cached: the routing and the call ask for the same splits
    (each head-sum split and form they weigh), at every trace."""
    passes = len(rank_pass_widths(plan, programs))
    return min(range(passes + 1), key=lambda x: max(selection_engines_us(
        target, plan, x, programs, relu_cycles, scoring_cycles)))  # fmt: skip


def selection_engines_us(target: str, plan, offload: int, programs: int = 1,
                         relu_cycles: float = 0.0, scoring_cycles: float = 0.0) -> tuple:
    """One token's modelled ``(VectorE, GpSimd, ScalarE)`` microseconds in the row-spread
    kernel by the cost formulas (:mod:`..nki_emulator.cost`), with the last ``offload`` of the
    rank passes (:func:`rank_pass_widths`) as GpSimd compares and ScalarE sums.
    ``programs > 1``: the selecting launch of the two-launch form, where each program ranks and
    places its share of the list's columns (the larger share here) and the scoring launch did
    select_key and each share's candidates. Per token, over ``F`` columns:

    - VectorE: the scoring's ``scoring_cycles``, :func:`_selection_vector_cycles`, and per rank
      pass kept a compare-and-count ``tensor_scalar_reduce`` (two and a sum per column of the
      shifted list);
    - GpSimd: in one launch ``8 F`` (the key-scale product ``2F``, the keys' copy, select_key's
      halving, NaN test ``2F`` and validity, the rows' iota); the scatter DMAs' descriptors
      (``GPSIMD_START`` + 128 each, the cost model's assumption:
      ``decode_kernel.scattered_columns`` for the list's pairs, one per placed column); and per
      offloaded pass its compares;
    - ScalarE: the relu's ``relu_cycles`` and per offloaded pass a sum."""
    from ..nki_emulator.cost import GPSIMD_START, HARDWARE, MIN_II

    hw = HARDWARE[target]
    widths = rank_pass_widths(plan, programs)
    kept, offloaded = widths[: len(widths) - offload], widths[len(widths) - offload :]
    columns = -(-(plan.compact // _decode.P) // programs)
    # Per pass beside its width: the VectorE's and the GpSimd's instruction overheads (the
    # shifted list's column: two passes and a sum on the VectorE, two compares on the GpSimd).
    vector_extra, gpsimd_extra = (3 * MIN_II, 2 * MIN_II) if programs > 1 else (MIN_II, 0)
    vector = _selection_vector_cycles(plan, programs) + scoring_cycles + sum(
        max(MIN_II, w) + vector_extra for w in kept)  # fmt: skip
    scatters = _decode.scattered_columns(plan) + columns
    gpsimd = ((8 * plan.columns if programs == 1 else 0) + scatters * (GPSIMD_START + _decode.P)
              + 25 * MIN_II + sum(max(MIN_II, w) + gpsimd_extra for w in offloaded))  # fmt: skip
    scalar = relu_cycles + sum(max(MIN_II, w) + MIN_II for w in offloaded)
    return (vector / hw.vector_ghz / 1e3, gpsimd / hw.gpsimd_ghz / 1e3,
            scalar / hw.scalar_ghz / 1e3)  # fmt: skip


def _selection_vector_cycles(plan, programs: int = 1) -> float:
    """VectorE cycles of one token's selection on the pivot's path, but for the list's rank
    columns, by the cost formulas: the max8 ``N`` and match_replace8 ``N + 144`` rounds over the
    row (over the shares' candidates where ``programs > 1``, the two-launch form's selecting
    launch) and the best left ``N``; in one launch select_key's two selects (``2F``; the
    key-scale product is the GpSimd's); the row-order grid's mask, running sum ``2F`` and two
    sums (``5F``); the pivot's halvings; and about 75 small instructions at ``MIN_II`` (an
    estimate from the kernel's code)."""
    from ..nki_emulator.cost import MATCH_REPLACE8_OVERHEAD, MIN_II

    F = plan.columns
    rounds = plan.depth // _kernel.SELECTED_PER_ROUND
    row = F if programs == 1 else programs * _decode.share_depth(plan, programs)
    return (rounds * (2 * row + MATCH_REPLACE8_OVERHEAD) + row + (2 * F if programs == 1 else 0)
            + 5 * F + _bisection_cycles(plan) + 75 * MIN_II)  # fmt: skip


def _bisection_cycles(plan) -> float:
    """VectorE cycles of the pivot's halvings for a token that finds its window in the first
    ``decode_kernel.EARLY_BISECT_STEPS`` (most tokens; the rest run the others too): per
    halving about 7 small instructions at ``MIN_II`` and a count over the ``depth`` candidates,
    and two more for the bound and the window."""
    from ..nki_emulator.cost import MIN_II

    halvings = min(plan.steps, _decode.EARLY_BISECT_STEPS) + 2
    return halvings * (7 * MIN_II + max(MIN_II, plan.depth))


def _decode_tensor_cycles(plan, group: int, on_vector: int, signed: bool = False) -> float:
    """TensorE cycles of one token's scores in the row-spread kernel, by the cost model's
    nc_matmul formula: on the TensorE's blocks, per 512 rows one bf16 matmul per 128 of ``Di``
    (q stationary, shared by the ``group``'s tokens) and per 128 rows one fp32 head sum for the
    group (``relu(|w'| d)`` stationary, the 0/1 sign columns moving, flagged one-zero; with
    ``signed``, the weights moving at the full fp32 cost); on the
    ``on_vector`` blocks, per 128 rows one bf16 matmul per 128 of ``Di`` (the rows stationary,
    the group's q moving)."""
    from ..nki_emulator.cost import (
        MATMUL_FP32_FACTOR,
        MATMUL_MIN_STATIONARY,
        MATMUL_ONEZERO_SPEEDUP,
    )

    d_tiles = -(-plan.dim // _kernel.KERNEL_TILE)
    rows = _decode.ROWS_PER_MATMUL
    blocks = plan.chunk // rows
    per_block = rows // _decode.P
    dots = d_tiles * max(min(MATMUL_MIN_STATIONARY, group * plan.heads), rows) / group
    head_sums = (per_block * max(MATMUL_MIN_STATIONARY, 2 * group) * MATMUL_FP32_FACTOR
                 / (1 if signed else MATMUL_ONEZERO_SPEEDUP) / group)  # fmt: skip
    rows_first = per_block * d_tiles * max(MATMUL_MIN_STATIONARY, group * plan.heads) / group
    return plan.chunks * ((blocks - on_vector) * (dots + head_sums) + on_vector * rows_first)


def _decode_relu_cycles(plan, group: int, on_vector: int) -> float:
    """ScalarE cycles of one token's relu in the row-spread kernel: ``[group Hi, 512]`` per 512
    rows of the TensorE's blocks, shared by the group's tokens."""
    blocks = plan.chunk // _decode.ROWS_PER_MATMUL
    return plan.chunks * (blocks - on_vector) * _decode.ROWS_PER_MATMUL / group


def _decode_head_sum_cycles(plan, on_vector: int) -> float:
    """VectorE cycles of one token's head sums on ``on_vector`` blocks per chunk: per 128 rows
    an fp32 scalar_tensor_tensor ``2 Hi`` and a reduce ``Hi``."""
    return plan.chunks * on_vector * (_decode.ROWS_PER_MATMUL // _decode.P) * 3 * plan.heads


def _decode_scoring_vector_cycles(plan, group: int, on_vector: int, signed: bool) -> float:
    """The VectorE's share of one token's scoring: the head sums of ``on_vector`` blocks per
    chunk (:func:`_decode_head_sum_cycles`), the chunks' scores out of PSUM (a copy and a
    subtraction, ``2 F``; with ``signed`` a copy) and its share of each chunk's NaN check (a
    count over the group's scores and three small instructions; none for one token's signed
    sums)."""
    from ..nki_emulator.cost import MIN_II

    head_sums = _decode_head_sum_cycles(plan, on_vector)
    nan_check = 0.0 if signed and group == 1 else plan.chunks * (
        max(MIN_II, group * plan.chunk_columns) + 3 * MIN_II) / group  # fmt: skip
    scores_out = (1 if signed else 2) * plan.columns
    return head_sums + scores_out + nan_check


def decode_token_us(target: str, plan, group: int, on_vector: int, signed: bool = False) -> float:
    """One token's modelled time in the row-spread kernel (one launch) by the cost formulas:
    its busiest engine of the TensorE (the scores, the selection's sums and transposes, the
    whole list's rank sums) and those of
    :func:`selection_engines_us` (the scoring's VectorE and ScalarE work beside the selection)
    with the rank passes split as the kernel splits them (:func:`rank_offload`). A short cache
    (every row a candidate) takes the list too: its halvings start at the partitions' floor,
    not at ``U*`` (MARKER)."""
    from ..nki_emulator.cost import HARDWARE

    hw = HARDWARE[target]
    offload = rank_offload(target, plan, group, on_vector, signed=signed)
    tensor = (_decode_tensor_cycles(plan, group, on_vector, signed) + _rank_tensor_cycles(plan)
              + _selection_tensor_cycles(plan))  # fmt: skip
    return max(tensor / hw.tensor_ghz / 1e3, *selection_engines_us(
        target, plan, offload, 1, _decode_relu_cycles(plan, group, on_vector),
        _decode_scoring_vector_cycles(plan, group, on_vector, signed)))  # fmt: skip


def scoring_on_vector(target: str, plan, group: int, programs: int) -> int:
    """:func:`head_sums_on_vector` for the scoring launch of the two-launch form, where the
    VectorE's other work is the program's share of the scoring
    (:func:`_decode_scoring_vector_cycles`) and of step 2, over ``Fs = F / programs`` columns:
    the share's zero fill ``Fs``, select_key's two selects ``2 Fs`` (the key-scale product is
    the GpSimd's), max8 ``Fs`` and match_replace8 ``Fs + 144`` rounds for the share's depth, the
    best left ``Fs``. The count that evens one program's TensorE and VectorE."""
    from ..nki_emulator.cost import HARDWARE, MATCH_REPLACE8_OVERHEAD

    hw = HARDWARE[target]
    blocks = plan.chunk // _decode.ROWS_PER_MATMUL
    share = plan.columns // programs
    rounds = _decode.share_depth(plan, programs) // _kernel.SELECTED_PER_ROUND
    selection = 4 * share + rounds * (2 * share + MATCH_REPLACE8_OVERHEAD)
    return min(range(blocks + 1), key=lambda v: max(
        _decode_tensor_cycles(plan, group, v) / programs / hw.tensor_ghz,
        (_decode_scoring_vector_cycles(plan, group, v, False) / programs + selection)
        / hw.vector_ghz))  # fmt: skip


def head_sums_on_vector(target: str, plan, group: int) -> int:
    """The 512-row blocks per chunk whose head sums run on the VectorE: the count that gives the
    least time per token by the cost formulas (ties at their expected share)."""
    blocks = plan.chunk // _decode.ROWS_PER_MATMUL
    return min(range(blocks + 1), key=lambda v: min(
        decode_token_us(target, plan, group, v, signed) for signed in (False, True)))


def signed_head_sums(target: str, plan, group: int, on_vector: int) -> bool:
    """Whether the TensorE's head sums take the signed weights (full fp32 cost, no subtraction:
    where the TensorE has time to spare) rather than the 0/1 sign columns, by the cost
    formulas (``decode_kernel._score_chunk``)."""
    return (decode_token_us(target, plan, group, on_vector, True)
            < decode_token_us(target, plan, group, on_vector, False))  # fmt: skip


def choose_kernel(target: str, programs: int, T: int, Hi: int, Di: int, R: int, topk: int):
    """``("decode", plan)`` where the row-spread kernel takes the shape and the cost model's
    formulas give it less time per program (its busiest engine, :func:`decode_token_us`) than
    the tiled kernel's VectorE merges (with the merge launch's, where the programs split the rows), else
    ``("tiled", None)``. It needs the indirect (scatter)
    DMA, NeuronCore-v3+: never on trn1."""
    from ..nki_emulator.cost import HARDWARE, MATCH_REPLACE8_OVERHEAD
    from ..nki_emulator.targets import TARGETS

    if target == "trn1":
        return "tiled", None
    budget = TARGETS[target].sbuf_bytes_per_partition
    plan = decode_plan(target, Hi, Di, R, int(topk))
    if plan is None:
        return "tiled", None
    shares = shares_for(programs, int(topk))
    tiled = _kernel.plan_indexer(T, Hi, Di, R, int(topk), shares=shares, budget=budget)
    tiles = -(-T // tiled.tile_tokens)
    rounds = tiled.topk8 // _kernel.SELECTED_PER_ROUND
    tiled_cycles = (tiles * (tiled.chunks // shares) * rounds
                    * (2 * (tiled.topk8 + tiled.chunk) + MATCH_REPLACE8_OVERHEAD))  # fmt: skip
    if shares > 1:  # the merge launch: a program's tiles, each one merge of shares * K8
        tiled_cycles += (-(-tiles // programs) * rounds
                         * (2 * shares * tiled.topk8 + MATCH_REPLACE8_OVERHEAD))  # fmt: skip
    hw = HARDWARE[target]
    group = decode_group(T, Hi, programs)
    on_vector = head_sums_on_vector(target, plan, group)
    signed = signed_head_sums(target, plan, group, on_vector)
    decode_us = -(-T // programs) * decode_token_us(target, plan, group, on_vector, signed)
    tiled_us = tiled_cycles / hw.vector_ghz / 1e3
    return ("decode", plan) if decode_us < tiled_us else ("tiled", None)


def shares_for(programs: int, topk: int) -> int:
    """How many programs split the rows: all of the launch grid, unless their partial
    selections together exceed what one max8 merge reads (``programs * K8 > 16384``)."""
    topk8 = -(-max(topk, 1) // _kernel.SELECTED_PER_ROUND) * _kernel.SELECTED_PER_ROUND
    return programs if programs * topk8 <= _kernel.SELECT_MAX_ELEMENTS else 1


def indexer_topk_neuron(q, weights, keys, key_scale, positions, *, topk, compress_ratio, emulated,
                        kernel=None):
    """The indexer on the NKI kernel: the primitive's operands in, ``(idx, scores)`` out.

    Args:
      q: ``[T, Hi, Di]`` bf16, f16 or f32 (the kernel's matmul dtype; ``Hi <= 128``).
      weights: ``[T, Hi]`` f32, already multiplied by the scale.
      keys: ``[R, Di]`` in q's dtype (bf16 also as ``uint16`` bit patterns).
      key_scale: ``[R]`` f32 or None.
      positions: ``[T]`` int32.
      topk: static int >= 0; compress_ratio: static int >= 1.
      emulated: True runs the kernel under the NKI emulator on the host, False on Neuron.
      kernel: None picks the kernel (:func:`choose_kernel`); ``"tiled"`` or ``"decode"`` (the
        row-spread kernel) forces one, for tests and comparisons.
    Returns ``(idx [T, topk] int32, scores [T, topk] f32)``: the valid rows with the highest
    scores, best first, exact ties to the lower row, NaN below every number; ``-1`` / ``-inf``
    past the valid rows (docs/indexer.md). Raises ``ValueError`` naming the argument for shapes
    the kernel cannot take.
    """
    from ..attention.neuron import launch_programs, neuron_target

    T, Hi, Di = q.shape
    R = keys.shape[0]
    keys = key_rows(keys)  # the kernel reads bf16 keys (a view of bit patterns is a copy)
    if not isinstance(topk, (int, np.integer)) or topk < 0:
        raise ValueError(f"topk must be a static int >= 0, got {topk!r}")
    if not isinstance(compress_ratio, (int, np.integer)) or compress_ratio < 1:
        raise ValueError(f"compress_ratio must be a static int >= 1, got {compress_ratio!r}")
    if T == 0 or topk == 0 or R == 0:
        idx = jnp.full((T, topk), -1, jnp.int32)
        return idx, jnp.full((T, topk), -jnp.inf, jnp.float32)
    if Di == 0 or Hi == 0:
        # Every score is an empty sum, 0: the valid rows in order (ties to the lower row).
        rows = jnp.arange(topk, dtype=jnp.int32)[None, :]
        nv = valid_rows(positions, R, int(compress_ratio))[:, None]
        idx = jnp.where(rows < nv, rows, -1)
        return idx, jnp.where(idx >= 0, 0.0, -jnp.inf).astype(jnp.float32)
    if R >= MAX_KERNEL_ROWS:
        raise ValueError(f"keys has {R} rows; the indexer kernel takes fewer than 2**24")
    from ..nki_emulator.targets import TARGETS

    if kernel not in (None, "tiled", "decode"):
        raise ValueError(f"kernel must be None, 'tiled' or 'decode', got {kernel!r}")
    target = neuron_target()
    programs = launch_programs(target)
    n_valid = valid_rows(positions, R, int(compress_ratio))
    if kernel is None:
        kernel, spread = choose_kernel(target, programs, T, Hi, Di, R, int(topk))
    elif kernel == "decode":
        spread = None if target == "trn1" else decode_plan(target, Hi, Di, R, int(topk))
        if spread is None:
            raise ValueError(f"the row-spread kernel cannot take this shape on {target}")
    if kernel == "decode":
        split_rows = decode_splits_rows(T, programs, spread.chunks)
        operands, tokens = _pack_decode(spread, 1 if split_rows else programs, q, weights, keys,
                                        key_scale, n_valid)  # fmt: skip
        keys_out, idx = _call_decode(target, programs, spread, operands, tokens, emulated,
                                     split_rows)  # fmt: skip
        keys_out = keys_out.reshape(-1, topk)[:T]
        idx = idx.reshape(-1, topk)[:T]
        return idx, scores_from_keys(keys_out, idx)
    shares = shares_for(programs, int(topk))
    merge_programs = programs if shares > 1 else 1
    plan = _kernel.plan_indexer(T, Hi, Di, R, int(topk), shares=shares,
                                budget=TARGETS[target].sbuf_bytes_per_partition)  # fmt: skip
    operands, tiles = _pack(plan, shares, merge_programs, q, weights, keys, key_scale, n_valid)
    if emulated:
        keys_out, idx = _call_emulated(target, shares, merge_programs, plan, operands, tiles)
    else:
        keys_out, idx = _call_nki(target, shares, merge_programs, plan, operands)
    keys_out = keys_out.reshape(-1, topk)[:T]
    idx = idx.reshape(-1, topk)[:T]
    return idx, scores_from_keys(keys_out, idx)
