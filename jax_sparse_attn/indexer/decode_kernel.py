"""The indexer's row-spread kernel: one token at a time, row ``r`` of its cache on partition
``r % 128``, column ``r // 128``, for decode steps and short caches where the tiled kernel
(:mod:`.kernel`) would leave most partitions idle.

Three entries, one per launch mode: :func:`indexer_decode_kernel` (one launch, the programs
split the tokens), and for a decode step whose tokens are fewer than the programs,
:func:`indexer_decode_score_kernel` then :func:`indexer_decode_select_kernel` (the programs split
each token's chunks, then each ranks a share of its list). Each is a sequence of named stages
over explicitly passed tiles. The algorithm, its steps and the terms used here (``U*``, ``Kv``,
``cap``, the pivot's list, the path codes) are in docs/indexer-kernel.md, "The row-spread
kernel". Nothing here needs the Neuron SDK to import.
"""

from __future__ import annotations

import dataclasses
import math

from ..constants import KERNEL_TILE, MAX8_ELEMENTS, PSUM_BANK_FP32
from ..constants import ceil_div as _ceil_div, round_up as _round_up
# The helpers by name: the emulator rebinds the kernel module's global functions (not attributes
# of an imported module) to see it as nki/nisa/nl.
from .kernel import (
    MARKER,
    SELECTED_PER_ROUND,
    IndexerPlan,
    _d_chunks,
    _emit,
    _merge,
    _selection_tiles,
    _tile_block,
    extract_best,
    fill_selection_constants,
    select_key,
)

try:  # The Neuron SDK only exists on a Trainium host (Neuron pip repository).
    import nki
    import nki.isa as nisa
    import nki.language as nl
except ImportError:
    nki = nl = nisa = None

P = KERNEL_TILE
ROWS_PER_MATMUL = PSUM_BANK_FP32
# Rows scored per chunk (a hardware loop step): a multiple of CHUNK_ALIGN, at most MAX_CHUNK (a
# chunk's keys are one DMA, and each DMA with a runtime address pays the DGE's fixed cost).
CHUNK_ALIGN = 4 * ROWS_PER_MATMUL
MAX_CHUNK = 32 * ROWS_PER_MATMUL
# Rows per merge of the fallback (the tiled kernel's merge over [1, K8 + FALLBACK_CHUNK]).
FALLBACK_CHUNK = 2048
# The tie check sums the selected ranks, Kv (Kv - 1) / 2, which fp32 holds exactly below 2**24.
MAX_TOPK = 4096


# MARKER keys before and after the list in HBM: partition p reads it from entry p - LIST_PAD on
# (step 3a's ranks), so every partition's own entry sits at the same column.
LIST_PAD = P

# Halvings of [U* or the floor, best key] that look for step 3a's pivot (a window of 128
# counts); a token that finds none ranks all M candidates (step 3b). Past the first
# EARLY_BISECT_STEPS they run only for a token whose count is still out of the window.
BISECT_STEPS = 16
EARLY_BISECT_STEPS = 8


# Step 2's bound fails when a partition holds more than ``depth`` of the best rows. The depth is
# sized so that this happens to at most this fraction of tokens when the best rows fall on the
# partitions at random (an assumption: clustered rows, such as recent ones, are spread by the
# interleave r % 128).
FALLBACK_RATE = 1e-4


def _poisson_tail(mean: float, n: int) -> float:
    """P(X > n) for X ~ Poisson(mean)."""
    term, below = math.exp(-mean), 0.0
    for i in range(n + 1):
        below += term
        term *= mean / (i + 1)
    return max(0.0, 1.0 - below)


def candidate_depth(topk: int, columns: int, shares: int = 1) -> int:
    """Candidates per partition (per share of its columns where ``shares`` programs each take
    one): the least multiple of 8 with ``128 shares P(share > depth) <= FALLBACK_RATE`` for a
    share ~ Poisson(topk / (128 shares)) (the count of the best rows one partition, or one share
    of it, holds), at most the columns (then every row is a candidate)."""
    depth, parts = SELECTED_PER_ROUND, P * shares
    while depth < columns and parts * _poisson_tail(topk / parts, depth) > FALLBACK_RATE:
        depth += SELECTED_PER_ROUND
    return min(depth, columns)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Compile-time sizes: ``heads``/``dim`` (Hi, Di), ``topk`` (K, ``topk8`` rounded up to 8),
    ``chunks`` of ``chunk`` rows, ``depth`` candidates per partition, ``split`` of whose rank
    columns are counted by GpSimd compares and ScalarE sums instead of the VectorE (balancing
    the two engines' shares by the cost model's formulas)."""

    heads: int
    dim: int
    topk: int
    topk8: int
    chunk: int
    chunks: int
    depth: int
    split: int = 0
    steps: int = BISECT_STEPS

    @property
    def chunk_columns(self) -> int:
        return self.chunk // P

    @property
    def columns(self) -> int:  # F: a token's rows per partition
        return self.chunks * self.chunk_columns

    @property
    def candidates(self) -> int:  # M
        return P * self.depth

    @property
    def rows_padded(self) -> int:
        return self.chunks * self.chunk

    @property
    def compact(self) -> int:  # cap: step 4's list, whole columns of 128, at most M
        return min(_round_up(self.topk8, P) + P, self.candidates)


def share_depth(plan: DecodePlan, shares: int) -> int:
    """Candidates per partition of each program's share of the columns in the two-launch form
    (the scoring launch's step 2): the fallback rate's depth for a share (:func:`candidate_depth`),
    at most a share's columns, and enough that the shares together hold ``depth``."""
    if shares == 1:
        return plan.depth
    own = (plan.chunks // shares) * plan.chunk_columns
    return max(min(candidate_depth(plan.topk, plan.columns, shares), own),
               _round_up(_ceil_div(plan.depth, shares), SELECTED_PER_ROUND))  # fmt: skip


def scattered_columns(plan: DecodePlan) -> int:
    """The candidate columns whose scatters build the pivot's list on every token (step 3a): a
    partition lists about ``cap / 128`` of its best, so beyond that and 8 more the scatters run
    only where some partition lists more."""
    return min(plan.depth, _round_up(plan.compact // P + SELECTED_PER_ROUND, SELECTED_PER_ROUND))


def sbuf_bytes_per_partition(plan: DecodePlan) -> int:
    """SBUF bytes per partition of the kernel's tiles (an upper estimate): a span's four tokens'
    q and weights and a chunk of keys (16-bit), the relu block, the ``[128, F]`` scores, their
    working copy, row numbers and predicate, the row-order grid (16-bit, padded to whole blocks
    of 512) and a block of it, the candidates' tiles (about 20 ``depth``-wide rows), two
    programs' shares of them as staged and side by side (the two-launch form), the broadcast
    candidates and the count passes' outputs (``3 M``, or the shifted list's ``cap + 128`` if
    wider; step 4 reuses them), step 4's columns (about 12 per 128 of ``cap``), its blocks
    (three rows of 128) and two ``cap + 128``-wide 16-bit compare tiles, five ``[128, 128]``
    matrices, and the fallback's merge (the tiled kernel's tiles for ``K8 + FALLBACK_CHUNK``
    candidates on one partition) and the slots' fill."""
    d_tiles = _ceil_div(plan.dim, KERNEL_TILE)
    # Four tokens' q, weights on every partition and chunk scores, the chunk's NaN check.
    scoring = (d_tiles * 2 * plan.heads * 4 + d_tiles * plan.chunk * 2 + 4 * ROWS_PER_MATMUL
               + 4 * 4 * plan.heads + 3 * 4 * 2 * plan.chunk_columns + 64)  # fmt: skip
    scores = 2 * 4 * plan.columns + plan.columns
    grid = 2 * _round_up(plan.columns, ROWS_PER_MATMUL) + 2 * ROWS_PER_MATMUL
    two_shares = 2 * share_depth(plan, 2)
    shares = 4 * (2 * (two_shares + 1) + 2 * two_shares)
    list_width = plan.compact + LIST_PAD
    candidates = (20 * 4 * plan.depth + shares + 3 * 4 * max(plan.candidates, list_width)
                  + 12 * 4 * plan.compact // P + 4 * 3 * P + 4 * list_width
                  + 5 * 4 * P)  # fmt: skip
    k8 = plan.topk8
    fallback = 2 * 4 * (k8 + FALLBACK_CHUNK) + 5 * 4 * k8 + 9 * k8
    fill = 2 * 4 * _ceil_div(plan.topk, P)  # the slots' fill, spread over the partitions
    return scoring + scores + grid + candidates + fallback + fill + 256


def plan_decode(heads: int, dim: int, rows: int, topk: int, budget: int) -> DecodePlan | None:
    """The sizes for ``rows`` keys, or None where this kernel cannot take the shape (then the
    tiled kernel runs): ``topk`` above ``MAX_TOPK``, a token's row beyond max8's 16384 columns,
    or more SBUF than ``budget`` bytes per partition. ``split`` stays 0: the routing
    (:mod:`.neuron`) sets it from the target's cost formulas."""
    if not 0 < heads <= KERNEL_TILE or not 0 < topk <= MAX_TOPK:
        return None
    for largest in (MAX_CHUNK, MAX_CHUNK // 2):  # the larger chunk where SBUF holds it
        chunk = min(largest, _round_up(max(rows, 1), CHUNK_ALIGN))
        chunks = _ceil_div(max(rows, 1), chunk)
        topk8 = _round_up(topk, SELECTED_PER_ROUND)
        columns = chunks * chunk // P
        depth = candidate_depth(topk, columns)
        plan = DecodePlan(heads, dim, topk, topk8, chunk, chunks, depth)
        if columns > MAX8_ELEMENTS or topk8 + FALLBACK_CHUNK > MAX8_ELEMENTS:
            return None
        if sbuf_bytes_per_partition(plan) <= budget:
            return plan
    return None


def _score_chunk(plan: DecodePlan, q_sb, w_sb, w_abs, w_moving, w_rows, keys_sb, sums,
                 on_vector: int, exact: bool, signed: bool):
    """A chunk's head sums into the PSUM tile ``sums [128, 2 g C/128]`` (f32): for token ``m``
    of the group and row ``128 j + p`` of the chunk, at partition ``p``, column ``2 (g j + m)``
    the sum of its heads with ``w' >= 0`` and the next column that of its other heads (the score
    is their difference; docs/indexer-kernel.md, step 1). The group's tokens share each ``d`` matmul
    (their q side by side, ``g Hi <= 128`` stationary columns: one matmul's cost, whatever that
    count).

    The ScalarE's relu scales by ``w_abs`` (``|w'|`` per head): ``relu(|w'| d)`` is
    ``|w' relu(d)|``, the fp32 product rounded once, wherever ``w'`` is finite and ``d`` is not
    ``-inf`` with ``w' = 0``. The head sums are then fp32 matmuls, ``relu`` of 128 rows
    stationary and ``w_moving`` moving (ones and zeros only: each token's heads of either
    sign; one matmul for the group's tokens), flagged ``is_moving_onezero``: half an fp32
    matmul's cost (its page). There a zero of one token's columns meets the other's ``relu``, and
    ``0 * inf`` is NaN; the exceptions above give NaN too (``w_abs`` is NaN for a non-finite
    ``w'``). The caller checks the sums for NaN and, where there is one, scores the chunk again
    with ``exact``: per token, ``relu(d)`` stationary and ``w'`` moving (the contract's
    products, ``w' * relu(d)``, on the token's own partitions) into the first column of its
    pair, the second zeroed by the caller. The first ``on_vector`` 512-row blocks take another
    form: ``d`` with 128 rows stationary (rows on the partitions), then ``relu(d) * w'`` and the
    head sum on the VectorE (``w_rows``: the weights on every partition) into the first column
    of the pair (the second is not read).

    ``signed`` (where the TensorE has time to spare, as over short caches): the relu unscaled
    and ``w_moving`` holding each token's weights in its first column (zeros elsewhere, not
    flagged): whole head sums at the full fp32 cost, with no subtraction after."""
    heads, group = plan.heads, sums.shape[1] // (2 * plan.chunk_columns)
    blocks = plan.chunk // ROWS_PER_MATMUL
    per_block = ROWS_PER_MATMUL // P
    for s in range(on_vector, blocks):
        r0 = s * ROWS_PER_MATMUL
        dots = nl.ndarray((group * heads, ROWS_PER_MATMUL), dtype=nl.float32, buffer=nl.psum)
        for dc, _, dw in _d_chunks(plan.dim):
            nisa.nc_matmul(dst=dots, stationary=q_sb[0:dw, dc, :],
                           moving=keys_sb[0:dw, dc, r0 : r0 + ROWS_PER_MATMUL],
                           accumulate=dc > 0)  # fmt: skip
        relu = nl.ndarray((group * heads, ROWS_PER_MATMUL), dtype=nl.float32, buffer=nl.sbuf)
        if exact or signed:
            nisa.activation(dst=relu, op=nl.relu, data=dots)
        else:
            nisa.activation(dst=relu, op=nl.relu, data=dots, scale=w_abs)
        for i in range(per_block):
            col = s * per_block + i
            rows = slice(i * P, (i + 1) * P)
            # relu of 128 rows stationary: the sums of those rows land on the partitions.
            if not exact:
                nisa.nc_matmul(dst=sums[:, 2 * group * col : 2 * group * (col + 1)],
                               stationary=relu[:, rows], moving=w_moving,
                               is_moving_onezero=not signed, accumulate=False)  # fmt: skip
                continue
            for g in range(group):
                heads_g = slice(g * heads, (g + 1) * heads)  # the token's partitions, in both
                first = 2 * (group * col + g)
                nisa.nc_matmul(dst=sums[:, first : first + 1], stationary=relu[heads_g, rows],
                               moving=w_sb[heads_g, :], accumulate=False)  # fmt: skip
    for col in range(on_vector * per_block):
        rows = slice(col * P, (col + 1) * P)
        dots_t = nl.ndarray((P, group * heads), dtype=nl.float32, buffer=nl.psum)
        for dc, _, dw in _d_chunks(plan.dim):
            nisa.nc_matmul(dst=dots_t, stationary=keys_sb[0:dw, dc, rows], moving=q_sb[0:dw, dc, :],
                           accumulate=dc > 0)  # fmt: skip
        for g in range(group):
            heads_g = slice(g * heads, (g + 1) * heads)
            products = nl.ndarray((P, heads), dtype=nl.float32, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=products, data=dots_t[:, heads_g], op0=nl.maximum,
                                      operand0=0.0, op1=nl.multiply, operand1=w_rows[:, heads_g])
            first = 2 * (group * col + g)
            nisa.tensor_reduce(dst=sums[:, first : first + 1], op=nl.add, data=products, axis=1,
                               keepdims=True)  # fmt: skip


@dataclasses.dataclass
class _Fallback:
    """The tiled kernel's exact merge over one token's keys in row order (step 6)."""

    plan: object
    cand: object
    cand_rows: object
    sel: object
    row_base: object
    keys_rows: object  # HBM [chunks, FALLBACK_CHUNK]: the token's keys in row order


def _fallback_tiles(plan: DecodePlan) -> _Fallback:
    k8 = plan.topk8
    n = _ceil_div(plan.rows_padded, FALLBACK_CHUNK)
    merge_plan = IndexerPlan(1, 1, 1, plan.topk, k8, FALLBACK_CHUNK, n)
    return _Fallback(
        merge_plan,
        nl.ndarray((1, k8 + FALLBACK_CHUNK), dtype=nl.float32, buffer=nl.sbuf),
        nl.ndarray((1, k8 + FALLBACK_CHUNK), dtype=nl.float32, buffer=nl.sbuf),
        _selection_tiles(1, k8, True, fill=False),  # filled where the fallback runs
        nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf),
        nl.ndarray((n, FALLBACK_CHUNK), dtype=nl.float32, buffer=nl.hbm),
    )  # fmt: skip


def _run_fallback(fb: _Fallback, keys_tile, keys_out, idx_out, group, member: int, topk: int):
    """Exact: ``keys_tile [128, F]`` to HBM in row order, then merges of ``FALLBACK_CHUNK``
    rows as the tiled kernel's, emitted into ``keys_out[group, member]`` (and ``idx_out``)."""
    plan = fb.plan
    k8, c = plan.topk8, plan.chunk
    columns = keys_tile.shape[1]
    assert fb.keys_rows.shape[0] * c == P * columns  # chunks are multiples of FALLBACK_CHUNK
    nisa.dma_copy(dst=fb.keys_rows.ap(pattern=[[1, P], [P, columns]], offset=0), src=keys_tile)
    fill_selection_constants(fb.sel)
    nisa.memset(dst=fb.cand[:, 0:k8], value=MARKER)
    nisa.memset(dst=fb.cand_rows[:, 0:k8], value=0.0)
    nisa.memset(dst=fb.row_base, value=0.0)

    def one_chunk(i):
        nisa.dma_copy(dst=fb.cand[:, k8 : k8 + c], src=fb.keys_rows.ap(
            pattern=[[c, 1], [1, c]], offset=0, scalar_offset=i, indirect_dim=0))  # fmt: skip
        rows = fb.cand_rows[:, k8 : k8 + c]
        nisa.iota(dst=rows, pattern=[[1, c]], offset=0)
        nisa.tensor_scalar(dst=rows, data=rows, op0=nl.add, operand0=fb.row_base,
                           engine=nisa.engine.gpsimd)  # fmt: skip
        _merge(plan, fb.cand, fb.cand_rows, fb.sel)
        nisa.tensor_scalar(dst=fb.row_base, data=fb.row_base, op0=nl.add, operand0=float(c),
                           engine=nisa.engine.gpsimd)  # fmt: skip

    nl.fori_loop(0, fb.keys_rows.shape[0], one_chunk)
    _emit(fb.cand, fb.cand_rows, keys_out, idx_out, group, 1, topk, k8, member * topk)




def _sbuf(shape, dtype=None):
    """An SBUF tile (f32 unless ``dtype``)."""
    return nl.ndarray(shape, dtype=nl.float32 if dtype is None else dtype, buffer=nl.sbuf)


def _psum(shape):
    return nl.ndarray(shape, dtype=nl.float32, buffer=nl.psum)


def _hbm(shape, dtype=None):
    return nl.ndarray(shape, dtype=nl.float32 if dtype is None else dtype, buffer=nl.hbm)


# ---- The launch: what a program does, fixed at trace time --------------------------------------


@dataclasses.dataclass(frozen=True)
class _Launch:
    """One program's part of a launch (the entries differ only here): the interface's sizes, the
    spans it takes, the chunks it scores and the list's columns it ranks."""

    plan: DecodePlan
    spans: int  # S
    span: int  # groups per span
    group: int  # tokens per group
    program: int
    programs: int
    first_span: int  # the program's spans: first_span .. first_span + span_count
    span_count: int
    shares: int  # programs whose candidates the selecting launch merges (1: one launch)
    share_depth: int  # candidates per partition of each share
    ranked_cols: range  # the list's columns this program ranks and places
    ranks_whole_list: bool  # every column: each pair compared once, then the ranks' check
    takes_rare_paths: bool  # all M ranked, the fallback and the path codes (one program)
    copies: int  # copies of the slots, one per program placing a share of them
    on_vector: int = 0
    signed: bool = False
    offload: int | None = None

    @property
    def slots(self) -> int:  # tokens per span: slot g i + m is member m of group i
        return self.span * self.group

    @property
    def columns(self) -> int:
        return self.plan.columns

    @property
    def cap_cols(self) -> int:
        return self.plan.compact // P

    @property
    def share_width(self) -> int:  # a share's staged keys, rows and best key left
        return 2 * self.share_depth + 1

    @property
    def out_offset(self) -> int:  # this program's copy of the slots
        return self.program * self.spans * self.slots * self.plan.topk if self.copies > 1 else 0


def _plan_launch(q_t, w_t, keys_t, key_scale_t, n_valid, chunk_ends, topk, depth, split, steps):
    """The plan from the operands' shapes (the module interface), each shape checked."""
    spans, span, dim, group_heads = q_t.shape
    slots = n_valid.shape[1]
    group = slots // span
    heads = group_heads // group
    _, n_chunks, chunk = keys_t.shape
    chunk_columns = chunk // P
    assert tuple(key_scale_t.shape) == (P, n_chunks * chunk_columns), f"key_scale_t {key_scale_t.shape}"
    assert chunk % CHUNK_ALIGN == 0 and chunk % FALLBACK_CHUNK == 0, f"keys_t {keys_t.shape}"
    assert group_heads <= KERNEL_TILE and group_heads == group * heads, f"q_t {q_t.shape}"
    assert tuple(w_t.shape) == (spans, span, group_heads, 1), f"w_t {w_t.shape}"
    assert tuple(n_valid.shape) == (spans, slots, 1) and slots == span * group, f"n_valid {n_valid.shape}"
    assert tuple(chunk_ends.shape) == (1, spans, slots), f"chunk_ends {chunk_ends.shape}"
    assert 0 < topk <= MAX_TOPK and depth % SELECTED_PER_ROUND == 0 and 0 <= split <= depth
    topk8 = _round_up(topk, SELECTED_PER_ROUND)
    steps = BISECT_STEPS if steps is None else steps
    plan = DecodePlan(heads, dim, topk, topk8, chunk, n_chunks, depth, split, steps)
    assert depth <= plan.columns <= MAX8_ELEMENTS
    return plan, spans, span, group


# ---- Tiles, by the stage that fills them -------------------------------------------------------
# Allocated once per launch, outside the hardware loops (nki.language.fori_loop page), and passed
# to the stages that use them.


@dataclasses.dataclass
class _Common:
    """Tiles both the scoring and the selection read."""

    ones_col: object  # [128, 1] of 1: sums over the partitions by matmul
    partition: object  # [128, 1]: p
    register_staging: object  # [1, 1] int32: a value on its way to a register


def _common_tiles() -> _Common:
    return _Common(ones_col=_sbuf((P, 1)), partition=_sbuf((P, 1)),
                   register_staging=_sbuf((1, 1), nl.int32))  # fmt: skip


def _fill_common(common: _Common):
    nisa.memset(dst=common.ones_col, value=1.0)
    nisa.iota(dst=common.partition, pattern=[[0, 1]], offset=0, channel_multiplier=1)


def _load_register(common: _Common, value):
    nisa.tensor_copy(dst=common.register_staging, src=value)
    reg = nisa.register_alloc(None)
    nisa.register_load(reg, common.register_staging)
    return reg


@dataclasses.dataclass
class _Scoring:
    """Step 1's tiles: per group of the span its q, weights, their magnitudes (the relu's
    scale), the head-sum matmul's moving columns (each token's 0/1 columns of heads with
    ``w' >= 0`` and the rest, or with ``signed`` its weights) and the weights on every partition
    (the VectorE's head sums); a chunk of keys, its scores, their NaN check; the chunks' end."""

    q: list
    w: list
    w_abs: list
    w_moving: list
    w_rows: list
    keys: object  # [128, d_tiles, C]
    chunk_scores: object  # [128, g, C / 128]
    head_sums: object  # PSUM [128, 2 g C / 128]
    nan_mask: object
    nan_col: object
    nan_count: object  # PSUM [1, 1]
    chunk_has_nan: object  # [1, 1]: 1.0 where a score of the chunk is NaN
    ends: object
    ends_f: object
    end_f: object
    end: object
    # HBM per slot of the span: the token's scores by chunk, [128, n_chunks, C / 128].
    staged: list


def _scoring_tiles(launch: _Launch, q_dtype, keys_dtype, nan_count) -> _Scoring:
    plan, group = launch.plan, launch.group
    group_heads, chunk_columns = group * plan.heads, plan.chunk_columns
    d_tiles = _ceil_div(plan.dim, KERNEL_TILE)
    assert 0 <= launch.on_vector <= plan.chunk // ROWS_PER_MATMUL, f"on_vector {launch.on_vector}"

    def per_group(shape, dtype=None):
        return [_sbuf(shape, dtype) for _ in range(launch.span)]

    return _Scoring(
        q=per_group((KERNEL_TILE, d_tiles, group_heads), q_dtype),
        w=per_group((group_heads, 1)), w_abs=per_group((group_heads, 1)),
        w_moving=per_group((group_heads, 2 * group)), w_rows=per_group((P, group_heads)),
        keys=_sbuf((KERNEL_TILE, d_tiles, plan.chunk), keys_dtype),
        chunk_scores=_sbuf((P, group, chunk_columns)),
        head_sums=_psum((P, 2 * group * chunk_columns)),
        nan_mask=_sbuf((P, group, chunk_columns)), nan_col=_sbuf((P, 1)), nan_count=nan_count,
        chunk_has_nan=_sbuf((1, 1)), ends=_sbuf((1, launch.slots), nl.int32),
        ends_f=_sbuf((1, launch.slots)), end_f=_sbuf((1, 1)), end=_sbuf((1, 1), nl.int32),
        staged=[_hbm((P, plan.chunks, chunk_columns)) for _ in range(launch.slots)],
    )  # fmt: skip


@dataclasses.dataclass
class _Token:
    """One token's selection keys and step 2: its candidates, their rows, the best key left
    (``U*``), ``Kv``, and the counts over the candidates that the bound and the pivot take."""

    keys: object  # [128, F]: the selection keys, row 128 j + p at [p, j]
    work: object  # [128, F]
    valid_rows: object  # [128, 1]: n_valid on every partition
    kv: object  # [128, 1]: Kv = min(K, n_valid)
    kv_count: object  # [1, 1]: Kv
    kv_rank_sum: object  # [1, 1]: Kv (Kv - 1) / 2, the sum of exact ranks 0 .. Kv-1
    sel: object  # the merge's tiles; sel.best_keys [128, depth] the candidates
    left8: object
    best_left: object  # [128, 1]: U* on every partition
    cand_pos: object
    cand_pos_u32: object
    cand_rows: object
    cand_pairs: object  # [128, depth, 2]: (key, row)
    spare: object  # [128, depth] scratch
    count_col: object  # [128, 1]: each partition's candidates counted
    total_col: object  # [128, 1]: all partitions' count, on every partition
    column_ps: object  # PSUM [128, 1]
    row_ps: object  # PSUM [1, 128]
    reduced: object  # [1, 1]: a column reduced over the partitions


def _token_tiles(plan: DecodePlan, depth: int) -> _Token:
    """``depth``: the candidates per partition this launch's step 2 takes (a share's in the
    scoring launch)."""
    of_row, of_candidates = (P, plan.columns), (P, plan.depth)
    return _Token(
        keys=_sbuf(of_row), work=_sbuf(of_row), valid_rows=_sbuf((P, 1)), kv=_sbuf((P, 1)),
        kv_count=_sbuf((1, 1)), kv_rank_sum=_sbuf((1, 1)), sel=_selection_tiles(P, depth, True),
        left8=_sbuf((P, SELECTED_PER_ROUND)), best_left=_sbuf((P, 1)),
        cand_pos=_sbuf(of_candidates), cand_pos_u32=_sbuf(of_candidates, nl.uint32),
        cand_rows=_sbuf(of_candidates), cand_pairs=_sbuf((P, plan.depth, 2)),
        spare=_sbuf(of_candidates), count_col=_sbuf((P, 1)), total_col=_sbuf((P, 1)),
        column_ps=_psum((P, 1)), row_ps=_psum((1, P)), reduced=_sbuf((1, 1)),
    )  # fmt: skip


@dataclasses.dataclass
class _Shares:
    """The two-launch form's shares of a token's candidates: as staged (keys | rows | best key
    left, per share), then each field side by side."""

    staged: object  # [128, shares (2 d + 1)]
    keys: object  # [128, shares d]
    rows: object


def _share_tiles(launch: _Launch) -> _Shares:
    width = launch.shares * launch.share_depth
    return _Shares(staged=_sbuf((P, launch.shares * launch.share_width)), keys=_sbuf((P, width)),
                   rows=_sbuf((P, width)))  # fmt: skip


@dataclasses.dataclass
class _Pivot:
    """Step 2's bound and step 3's bisection: ``[128, 1]`` columns equal on every partition,
    and the flags that pick the token's path."""

    lo: object
    hi: object
    mid: object  # the pivot, where one is found
    half: object
    below: object  # uint8 predicates of the bracket's moves
    above: object
    rows_bounded: object  # step 2's bound holds (else the fallback)
    no_row_left: object  # U* is MARKER: every valid row is a candidate
    in_window: object  # Kv <= #(candidates >= mid) <= cap
    within_cap: object
    out_of_window: object
    above_left: object  # mid > U*
    has_valid: object  # Kv > 0
    takes_list: object  # the pivot's list
    takes_all_ranked: object  # all M candidates ranked (no pivot)
    falls_back: object  # [1, 1]
    path: object  # [1, 1]: the path code


def _pivot_tiles() -> _Pivot:
    def column(dtype=None):
        return _sbuf((P, 1), dtype)

    return _Pivot(lo=column(), hi=column(), mid=column(), half=column(), below=column(nl.uint8),
                  above=column(nl.uint8), rows_bounded=column(), no_row_left=column(),
                  in_window=column(), within_cap=column(), out_of_window=column(),
                  above_left=column(), has_valid=column(), takes_list=column(),
                  takes_all_ranked=column(), falls_back=_sbuf((1, 1)),
                  path=_sbuf((1, 1)))  # fmt: skip


@dataclasses.dataclass
class _RankCheck:
    """The ranks' check: whether the chosen ranks are exactly ``0 .. Kv-1``."""

    stats: object  # [128, 2]: each partition's chosen count and rank sum
    totals: object  # [1, 2]
    totals_ps: object  # PSUM [1, 2]
    ranks_exact: object  # [1, 1] flags
    chosen_count: object
    rank_sum_matches: object
    ranks_tied: object
    tied_fit_list: object  # tied, and the chosen fit the list: its tie pass


def _rank_check_tiles() -> _RankCheck:
    return _RankCheck(stats=_sbuf((P, 2)), totals=_sbuf((1, 2)), totals_ps=_psum((1, 2)),
                      ranks_exact=_sbuf((1, 1)), chosen_count=_sbuf((1, 1)),
                      rank_sum_matches=_sbuf((1, 1)), ranks_tied=_sbuf((1, 1)),
                      tied_fit_list=_sbuf((1, 1)))  # fmt: skip


@dataclasses.dataclass
class _AllRanked:
    """Step 3 without a pivot: every candidate's rank among all ``M``; its wide tiles hold the
    list's broadcasts and the row-order grid's blocks at other times."""

    cand_hbm: object  # HBM [128, depth]: the broadcast's source
    all_keys: object  # [128, max(M, cap + 128)]
    beaten: object
    beaten_alt: object
    ranks: object  # [128, depth]
    chosen: object
    chosen_work: object
    slot: object
    slot_u32: object


def _all_ranked_tiles(plan: DecodePlan) -> _AllRanked:
    wide, of_candidates = (P, max(plan.candidates, plan.compact + LIST_PAD)), (P, plan.depth)
    return _AllRanked(cand_hbm=_hbm(of_candidates), all_keys=_sbuf(wide), beaten=_sbuf(wide),
                      beaten_alt=_sbuf(wide), ranks=_sbuf(of_candidates),
                      chosen=_sbuf(of_candidates), chosen_work=_sbuf(of_candidates),
                      slot=_sbuf(of_candidates),
                      slot_u32=_sbuf(of_candidates, nl.uint32))  # fmt: skip


@dataclasses.dataclass
class _Listing:
    """Steps 3 and 4's compact list of ``cap`` entries and its ranks, and the row-order grid that
    places the pivot's list. The ``listed`` tiles hold entry ``128 c + p`` at ``[p, c]``, so a
    column is a block of 128 consecutive entries."""

    hbm: list  # HBM keys (between two LIST_PAD runs of MARKER), rows, ranks
    pairs_hbm: object  # HBM [cap, 2]: (key, row), one scatter per candidate column for both
    listed: list  # [128, cap / 128]: keys, rows, ranks
    gain: object
    slot_u32: object
    pairs: object  # [128, cap / 128, 2]
    blocks_pairs: object  # [cap / 128, 256]: a block of pairs per partition
    blocks_field: object
    rank_cmp: list  # two bf16 0/1 compare tiles, one filling while the TensorE sums the other
    rank_before: object
    in_list: object  # [128, depth]: candidates at or above the pivot
    place_u32: object  # [128, depth]: each candidate's place in the list (2 cap: none)
    before: object
    most_listed: object  # [1, 1]: the most candidates one partition lists
    lists_past_scattered: object  # [1, 1] flag: a partition lists past the scattered columns
    # Views of the step-3 tiles (free by then): the broadcast list and its passes, the shifted
    # list and its scratch, the row-order grid's work blocks.
    keys: object
    rows: object
    equal: object
    shifted: object
    shifted_scratch: object
    running_block: object
    places_block: object
    grid_hbm: object
    places_hbm: object
    grid_mask: object
    mask_block: object
    carry: object
    above_ps: object  # PSUM: the grid's counts, then the transposes and whole-list sums
    column_sums_ps: object
    beats_ps: object
    ties_ps: object


def _grid_sizes(plan: DecodePlan):
    """The row-order grid in blocks of up to 512 columns (one matmul each): block, blocks."""
    block = min(ROWS_PER_MATMUL, plan.columns)
    return block, _ceil_div(plan.columns, block)


def _listing_tiles(plan: DecodePlan, ranked: _AllRanked) -> _Listing:
    cap = plan.compact
    cap_cols = cap // P
    block, blocks = _grid_sizes(plan)
    above_ps, column_sums_ps = _psum((P, block)), _psum((P, block))
    return _Listing(
        hbm=[_hbm((cap + 2 * LIST_PAD * (f == 0), 1)) for f in range(3)],
        pairs_hbm=_hbm((cap, 2)), listed=[_sbuf((P, cap_cols)) for _ in range(3)],
        gain=_sbuf((P, cap_cols)), slot_u32=_sbuf((P, cap_cols), nl.uint32),
        pairs=_sbuf((P, cap_cols, 2)), blocks_pairs=_sbuf((cap_cols, 2 * P)),
        blocks_field=_sbuf((cap_cols, P)),
        rank_cmp=[_sbuf((P, cap + LIST_PAD), nl.bfloat16) for _ in range(2)],
        rank_before=_sbuf((P, cap_cols)), in_list=_sbuf((P, plan.depth)),
        place_u32=_sbuf((P, plan.depth), nl.uint32), before=_sbuf((P, 1)),
        most_listed=_sbuf((1, 1)), lists_past_scattered=_sbuf((1, 1)),
        keys=ranked.all_keys[:, 0:cap], rows=ranked.beaten[:, 0:cap],
        equal=ranked.beaten_alt[:, 0:cap], shifted=ranked.all_keys[:, 0 : cap + LIST_PAD],
        shifted_scratch=ranked.beaten_alt[:, 0 : cap + LIST_PAD],
        running_block=ranked.all_keys[:, 0:block],
        places_block=ranked.all_keys[:, block : 2 * block],
        grid_hbm=_hbm((P, blocks, block), nl.bfloat16), places_hbm=_hbm((P, blocks, block)),
        grid_mask=_sbuf((P, blocks * block), nl.bfloat16),
        mask_block=_sbuf((P, block), nl.bfloat16),
        carry=_sbuf((P, 1)), above_ps=above_ps, column_sums_ps=column_sums_ps,
        beats_ps=above_ps[:, 0:cap_cols], ties_ps=column_sums_ps[:, 0:cap_cols],
    )  # fmt: skip


@dataclasses.dataclass
class _Constants:
    """The selection's constant tiles, filled once per launch."""

    ones_row: object  # [1, 128]
    ones_pp: object  # [128, 128]
    column: object  # [128, depth]: j
    lower: object  # [128, 128]: [k, i] = k < i
    lower_bf: object
    ones_bf: object
    block_base: object  # [128, cap / 128]: 128 c
    empty_pairs: object  # MARKER / -1 pairs: the list's start
    fill_pairs: object  # MARKER / -1 pairs: the slots' start
    list_pads: object  # [2, LIST_PAD] of MARKER


def _constant_tiles(plan: DecodePlan, fill_cols: int) -> _Constants:
    cap_cols = plan.compact // P
    return _Constants(ones_row=_sbuf((1, P)), ones_pp=_sbuf((P, P)),
                      column=_sbuf((P, plan.depth)), lower=_sbuf((P, P)),
                      lower_bf=_sbuf((P, P), nl.bfloat16), ones_bf=_sbuf((P, P), nl.bfloat16),
                      block_base=_sbuf((P, cap_cols)), empty_pairs=_sbuf((P, 2 * cap_cols)),
                      fill_pairs=_sbuf((P, 2 * fill_cols)),
                      list_pads=_sbuf((2, LIST_PAD)))  # fmt: skip


@dataclasses.dataclass
class _Slots:
    """Step 5's slots: the ranked (key, row) pairs in HBM, then the outputs in blocks of SBUF
    rows (``fill_rows`` rows of ``fill_cols`` slots, then a row of the rest)."""

    ranked_pairs: object  # HBM [K, 2]
    out_pairs: object
    out_keys: object
    out_rows: object
    blocks: list  # (SBUF rows, width in floats, first float)
    keys_out: object
    idx_out: object
    path_out: object


def _slot_blocks(topk: int):
    fill_cols = _ceil_div(topk, P)
    fill_rows, fill_tail = divmod(topk, fill_cols)
    blocks = [(slice(0, fill_rows), 2 * fill_cols, 0)] + (
        [(slice(fill_rows, fill_rows + 1), 2 * fill_tail, 2 * fill_rows * fill_cols)]
        if fill_tail else [])  # fmt: skip
    return fill_cols, blocks


def _slot_tiles(launch: _Launch, keys_out, idx_out, path_out) -> _Slots:
    topk = launch.plan.topk
    fill_cols, blocks = _slot_blocks(topk)
    return _Slots(ranked_pairs=_hbm((topk, 2)), out_pairs=_sbuf((P, 2 * fill_cols)),
                  out_keys=_sbuf((P, fill_cols)), out_rows=_sbuf((P, fill_cols), nl.int32),
                  blocks=blocks, keys_out=keys_out, idx_out=idx_out, path_out=path_out)  # fmt: skip


def _fill_constants(plan: DecodePlan, consts: _Constants, listing: _Listing, slots: _Slots):
    """The selection's constants, the list's MARKER runs and the grid's columns past F."""
    cap = plan.compact
    nisa.memset(dst=consts.ones_row, value=1.0)
    nisa.memset(dst=consts.ones_pp, value=1.0)
    nisa.iota(dst=consts.column, pattern=[[1, plan.depth]], offset=0)
    nisa.iota(dst=consts.lower, pattern=[[1, P]], offset=0, channel_multiplier=-1)  # i - k
    nisa.tensor_scalar(dst=consts.lower, data=consts.lower, op0=nl.greater, operand0=0.0)
    nisa.memset(dst=consts.fill_pairs[:, 0::2], value=MARKER)
    nisa.memset(dst=consts.fill_pairs[:, 1::2], value=-1.0)
    nisa.memset(dst=slots.out_pairs, value=0.0)  # past the slots' blocks: read, never written out
    nisa.tensor_copy(dst=consts.lower_bf, src=consts.lower)
    nisa.iota(dst=consts.block_base, pattern=[[P, cap // P]], offset=0)
    nisa.memset(dst=consts.ones_bf, value=1.0)
    nisa.memset(dst=consts.empty_pairs[:, 0::2], value=MARKER)
    nisa.memset(dst=consts.empty_pairs[:, 1::2], value=-1.0)
    nisa.memset(dst=consts.list_pads, value=MARKER)
    nisa.dma_copy(dst=listing.hbm[0].ap(pattern=[[LIST_PAD + cap, 2], [1, LIST_PAD]], offset=0),
                  src=consts.list_pads)  # fmt: skip
    grid_width = listing.grid_mask.shape[1]
    if grid_width > plan.columns:  # the columns past F stay 0
        nisa.memset(dst=listing.grid_mask[:, plan.columns : grid_width], value=0.0)


# ---- Step 1: scores ----------------------------------------------------------------------------


def _zero_staged_scores(plan: DecodePlan, scoring: _Scoring, scratch, first: int, width: int):
    """Chunks past a token's last valid row are never scored: they hold zeros (or an earlier
    token's scores) in HBM, and select_key turns those rows into MARKER."""
    nisa.memset(dst=scratch[:, 0:width], value=0.0)
    for staged in scoring.staged:
        nisa.dma_copy(dst=staged.ap(pattern=[[plan.columns, P], [1, width]], offset=first),
                      src=scratch[:, 0:width])  # fmt: skip


def _load_group_weights(launch: _Launch, scoring: _Scoring, q_t, w_t, t, i: int):
    """Group ``i`` of span ``t``: q, the weights and the head-sum matmul's moving columns."""
    plan, group = launch.plan, launch.group
    heads, group_heads = plan.heads, group * plan.heads
    w_sb, w_abs, w_moving = scoring.w[i], scoring.w_abs[i], scoring.w_moving[i]
    first = i * plan.dim * group_heads
    for dc, d0, dw in _d_chunks(plan.dim):
        nisa.dma_copy(dst=scoring.q[i][0:dw, dc, :], src=_tile_block(
            q_t, t, dw, group_heads, first + d0 * group_heads))  # fmt: skip
    nisa.dma_copy(dst=w_sb, src=_tile_block(w_t, t, group_heads, 1, i * group_heads))
    # |w'| = max(-w', w'), then NaN where w' is not finite (|w'| - |w'| is NaN there, 0
    # elsewhere), so that its chunks take the exact form. Each token's 0/1 columns: w' >= 0,
    # then the rest (NaN among them); zeros on the other token's heads. Signed: the token's
    # weights in its first column instead, no |w'|.
    if not launch.signed:
        nisa.tensor_scalar(dst=w_abs, data=w_sb, op0=nl.multiply, operand0=-1.0,
                           op1=nl.maximum, operand1=w_sb)  # fmt: skip
        nisa.tensor_scalar(dst=w_abs, data=w_abs, op0=nl.subtract, operand0=w_abs, op1=nl.add,
                           operand1=w_abs)  # fmt: skip
    nisa.memset(dst=w_moving, value=0.0)
    for m in range(group):
        heads_m = slice(m * heads, (m + 1) * heads)
        plus = w_moving[heads_m, 2 * m : 2 * m + 1]
        if launch.signed:
            nisa.tensor_copy(dst=plus, src=w_sb[heads_m, :])
            continue
        nisa.tensor_scalar(dst=plus, data=w_sb[heads_m, :], op0=nl.greater_equal, operand0=0.0)
        nisa.tensor_scalar(dst=w_moving[heads_m, 2 * m + 1 : 2 * m + 2], data=plus,
                           op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0)  # fmt: skip
    nisa.dma_copy(dst=scoring.w_rows[i], src=_tile_block(w_t, t, P, group_heads, i * group_heads,
                                                         row_stride=0))  # fmt: skip


def _score_span(launch: _Launch, common: _Common, scoring: _Scoring, q_t, w_t, keys_t, chunk_ends,
                t, own_chunks=None):
    """Step 1 for span ``t``'s tokens together, up to the last chunk any of them needs (of
    ``own_chunks``, ``(first, stop)``, where the programs split the chunks)."""
    for i in range(launch.span):
        _load_group_weights(launch, scoring, q_t, w_t, t, i)
    slots = launch.slots
    nisa.dma_copy(dst=scoring.ends, src=chunk_ends.ap(pattern=[[slots, 1], [1, slots]], offset=0,
                                                      scalar_offset=t, indirect_dim=1))  # fmt: skip
    nisa.tensor_copy(dst=scoring.ends_f, src=scoring.ends)
    nisa.tensor_reduce(dst=scoring.end_f, op=nl.max, data=scoring.ends_f, axis=1, keepdims=True)
    nisa.tensor_copy(dst=scoring.end, src=scoring.end_f)
    if own_chunks is not None:  # this program's chunks only: first .. min(stop, end)
        first, stop = own_chunks
        nisa.tensor_scalar(dst=scoring.end_f, data=scoring.end_f, op0=nl.minimum,
                           operand0=float(stop), op1=nl.maximum, operand1=float(first))  # fmt: skip
        nisa.tensor_copy(dst=scoring.end, src=scoring.end_f)
    chunks_end = nisa.register_alloc(None)
    nisa.register_load(chunks_end, scoring.end)
    plan = launch.plan

    def one_chunk(c):
        for dc, d0, dw in _d_chunks(plan.dim):
            nisa.dma_copy(dst=scoring.keys[0:dw, dc, :], src=keys_t.ap(
                pattern=[[plan.chunks * plan.chunk, dw], [1, plan.chunk]],
                offset=d0 * plan.chunks * plan.chunk, scalar_offset=c, indirect_dim=1))  # fmt: skip
        for i in range(launch.span):
            _score_chunk_of_group(launch, common, scoring, i, c)

    nl.fori_loop(0 if own_chunks is None else own_chunks[0], chunks_end, one_chunk)


def _score_chunk_of_group(launch: _Launch, common: _Common, scoring: _Scoring, i: int, c):
    """Chunk ``c``'s scores for group ``i`` of the span, to its tokens' staged scores."""
    plan, group, signed = launch.plan, launch.group, launch.signed
    chunk_columns, head_sums = plan.chunk_columns, scoring.head_sums
    tiles = (scoring.q[i], scoring.w[i], scoring.w_abs[i], scoring.w_moving[i],
             scoring.w_rows[i], scoring.keys, head_sums, launch.on_vector)  # fmt: skip
    chunk_sbs = [scoring.chunk_scores[:, g, :] for g in range(group)]
    _score_chunk(plan, *tiles, False, signed)
    # The columns whose first sums are whole (the VectorE's, or all with the signed weights);
    # the rest are the matmuls' sign pairs. NaN counted from ``checked`` on.
    whole = chunk_columns if signed else launch.on_vector * (ROWS_PER_MATMUL // P)
    checked = 0 if signed else whole

    def scores_out():
        step = 2 * group
        for g, chunk_sb in enumerate(chunk_sbs):
            if whole:
                nisa.tensor_copy(dst=chunk_sb[:, 0:whole],
                                 src=head_sums[:, 2 * g : step * whole : step])  # fmt: skip
            if whole < chunk_columns:
                # score = (heads with w' >= 0) - (the rest); tensor_tensor reads at most one
                # operand from PSUM (its page), so the second goes through SBUF.
                rest = chunk_sb[:, whole:chunk_columns]
                nisa.tensor_copy(dst=rest, src=head_sums[:, step * whole + 2 * g + 1 :: step])
                nisa.tensor_tensor(dst=rest, data1=head_sums[:, step * whole + 2 * g :: step],
                                   data2=rest, op=nl.subtract)  # fmt: skip

    def exact_again(_):
        nisa.memset(dst=head_sums[:, 1::2], value=0.0)  # the pairs' second columns
        _score_chunk(plan, *tiles, True, signed)
        scores_out()

    scores_out()
    # (One token's signed head sums are the exact form already.)
    if checked < chunk_columns and not (signed and group == 1):
        # A NaN among the matmuls' scores (a 0 * inf of a pair's head sums, a non-finite weight,
        # a -inf d of a zero weight, inf - inf): the chunk again in the exact form (0 or 1
        # trips). x >= -inf holds for every number, not for NaN: the group's scores, counted.
        counted = scoring.chunk_scores[:, :, checked:chunk_columns]
        nisa.tensor_scalar_reduce(dst=scoring.nan_mask[:, :, checked:chunk_columns], data=counted,
                                  op0=nl.greater_equal, operand0=-math.inf, reduce_op=nl.add,
                                  reduce_res=scoring.nan_col,
                                  reduce_cmd=nisa.reduce_cmd.reset_reduce)  # fmt: skip
        nisa.nc_matmul(dst=scoring.nan_count, stationary=common.ones_col, moving=scoring.nan_col,
                       accumulate=False)  # fmt: skip
        nisa.tensor_scalar(dst=scoring.chunk_has_nan, data=scoring.nan_count, op0=nl.less,
                           operand0=float(P * group * (chunk_columns - checked)))  # fmt: skip
        nl.fori_loop(0, _load_register(common, scoring.chunk_has_nan), exact_again)
    for staged, chunk_sb in zip(scoring.staged[i * group : (i + 1) * group], chunk_sbs):
        nisa.dma_copy(dst=staged.ap(pattern=[[plan.columns, P], [1, chunk_columns]], offset=0,
                                    scalar_offset=c, indirect_dim=1), src=chunk_sb)  # fmt: skip


def _load_valid_rows(tok: _Token, n_valid, t, member: int):
    nisa.dma_copy(dst=tok.valid_rows, src=n_valid.ap(pattern=[[0, P], [1, 1]], offset=member,
                                                     scalar_offset=t, indirect_dim=0))  # fmt: skip


def _selection_keys(plan: DecodePlan, tok: _Token, key_scale_t, scores, scratch, first: int):
    """Scores of columns ``first ..`` (``[128, w]``) -> selection keys in place: times
    key_scale, then select_key with the rows 128 j + p (``scratch`` holds the scales, then the
    rows)."""
    width = scores.shape[1]
    nisa.dma_copy(dst=scratch, src=key_scale_t.ap(pattern=[[plan.columns, P], [1, width]],
                                                  offset=first))  # fmt: skip
    # On the GpSimd, which the selection leaves the least busy (SBUF operands only).
    nisa.tensor_tensor(dst=scores, data1=scores, data2=scratch, op=nl.multiply,
                       engine=nisa.engine.gpsimd)  # fmt: skip
    nisa.iota(dst=scratch, pattern=[[P, width]], offset=P * first, channel_multiplier=1)
    select_key(scores, scratch, tok.valid_rows)


# ---- Step 2: candidates, from the token's own scores or the scoring launch's shares ------------


def _stage_share(launch: _Launch, common: _Common, scoring: _Scoring, tok: _Token,
                 shares: _Shares, key_scale_t, n_valid, staged_out, candidates_out, t):
    """The scoring launch's result for span ``t``: the program's chunks of each token as
    selection keys (so that the selecting launch's programs need not each redo them), and step 2
    on its share: each partition's ``share_depth`` best (rows ``128 (first + pos) + p``) and the
    best key left in it."""
    plan, d, width = launch.plan, launch.share_depth, launch.share_width
    columns, chunk_columns = plan.columns, plan.chunk_columns
    chunk_lo, chunk_hi = _own_chunks(launch)
    first, own = chunk_lo * chunk_columns, (chunk_hi - chunk_lo) * chunk_columns
    region = [[columns, P], [1, own]]
    for member in range(launch.group):
        own_keys, own_work = tok.keys[:, 0:own], tok.work[:, 0:own]
        _load_valid_rows(tok, n_valid, t, member)
        nisa.dma_copy(dst=own_keys, src=scoring.staged[member].ap(pattern=region, offset=first))
        _selection_keys(plan, tok, key_scale_t, own_keys, own_work, first)
        nisa.dma_copy(dst=staged_out.ap(pattern=region, offset=member * P * columns + first,
                                        scalar_offset=t, indirect_dim=0), src=own_keys)  # fmt: skip
        positions = extract_best(own_keys, tok.sel, d)
        keys_part, rows_part = shares.staged[:, 0:d], shares.staged[:, d : 2 * d]
        nisa.tensor_copy(dst=keys_part, src=tok.sel.best_keys)
        nisa.tensor_copy(dst=rows_part, src=positions, engine=nisa.engine.gpsimd)
        nisa.tensor_scalar(dst=rows_part, data=rows_part, op0=nl.add, operand0=float(first),
                           op1=nl.multiply, operand1=float(P), engine=nisa.engine.gpsimd)  # fmt: skip
        nisa.tensor_scalar(dst=rows_part, data=rows_part, op0=nl.add, operand0=common.partition,
                           engine=nisa.engine.gpsimd)  # fmt: skip
        nisa.max8(dst=tok.left8, src=own_keys)
        nisa.tensor_copy(dst=shares.staged[:, 2 * d : width], src=tok.left8[:, 0:1])
        nisa.dma_copy(dst=candidates_out.ap(
            pattern=[[launch.shares * width, P], [1, width]],
            offset=member * P * launch.shares * width + launch.program * width,
            scalar_offset=t, indirect_dim=0), src=shares.staged[:, 0:width])  # fmt: skip


def _own_candidates(launch: _Launch, common: _Common, scoring: _Scoring, tok: _Token,
                    key_scale_t, member: int):
    """The token's selection keys from its staged scores, then step 2 over its row: each
    partition's ``depth`` best (positions -> rows 128 pos + p) and the best left."""
    plan = launch.plan
    columns = plan.columns
    nisa.dma_copy(dst=tok.keys,
                  src=scoring.staged[member].ap(pattern=[[columns, P], [1, columns]], offset=0))
    _selection_keys(plan, tok, key_scale_t, tok.keys, tok.work, 0)
    nisa.tensor_copy(dst=tok.work, src=tok.keys, engine=nisa.engine.gpsimd)
    positions = extract_best(tok.work, tok.sel, plan.depth)
    nisa.max8(dst=tok.left8, src=tok.work)
    nisa.tensor_copy(dst=tok.cand_pos, src=positions, engine=nisa.engine.gpsimd)
    nisa.tensor_copy(dst=tok.cand_pos_u32, src=positions, engine=nisa.engine.gpsimd)
    nisa.tensor_scalar(dst=tok.cand_rows, data=tok.cand_pos, op0=nl.multiply, operand0=float(P),
                       op1=nl.add, operand1=common.partition, engine=nisa.engine.gpsimd)  # fmt: skip


def _staged_candidates(launch: _Launch, common: _Common, tok: _Token, shares: _Shares,
                       staged_scores, staged_candidates, t, member: int):
    """The scoring launch's selection keys, and step 2 from its shares: the ``depth`` best of
    their candidates per partition; the best left among those not taken, or in a share's rest."""
    plan, n, d, width = launch.plan, launch.shares, launch.share_depth, launch.share_width
    columns = plan.columns
    nisa.dma_copy(dst=tok.keys, src=_tile_block(staged_scores, t, P, columns, member * P * columns))
    nisa.dma_copy(dst=shares.staged, src=_tile_block(staged_candidates, t, P, n * width,
                                                     member * P * n * width))  # fmt: skip
    for i in range(n):
        first = i * width
        cols = slice(i * d, (i + 1) * d)
        nisa.tensor_copy(dst=shares.keys[:, cols], src=shares.staged[:, first : first + d])
        nisa.tensor_copy(dst=shares.rows[:, cols], engine=nisa.engine.gpsimd,
                         src=shares.staged[:, first + d : first + 2 * d])  # fmt: skip
    positions = extract_best(shares.keys, tok.sel, plan.depth)
    nisa.nc_n_gather(dst=tok.cand_rows, data=shares.rows, indices=positions)
    nisa.max8(dst=tok.left8, src=shares.keys)
    for i in range(n):
        best_of_share = shares.staged[:, (i + 1) * width - 1 : (i + 1) * width]
        nisa.tensor_tensor(dst=tok.left8[:, 0:1], data1=tok.left8[:, 0:1], data2=best_of_share,
                           op=nl.maximum)  # fmt: skip
    nisa.tensor_scalar(dst=tok.cand_pos, data=tok.cand_rows, op0=nl.subtract,
                       operand0=common.partition, op1=nl.multiply, operand1=1.0 / P,
                       engine=nisa.engine.gpsimd)  # fmt: skip
    nisa.tensor_copy(dst=tok.cand_pos_u32, src=tok.cand_pos, engine=nisa.engine.gpsimd)


def _across_partitions(tok: _Token, consts: _Constants, col, op):
    """``col [128, 1]`` becomes ``op`` of its partitions, on every partition: a transpose, a
    reduce, and a broadcast by matmul with a row of ones."""
    nisa.nc_transpose(dst=tok.row_ps, data=col)
    nisa.tensor_reduce(dst=tok.reduced, op=op, data=tok.row_ps, axis=1, keepdims=True)
    nisa.nc_matmul(dst=tok.column_ps, stationary=consts.ones_row, moving=tok.reduced,
                   accumulate=False)  # fmt: skip
    nisa.tensor_copy(dst=col, src=tok.column_ps)


def _count_above(tok: _Token, consts: _Constants, op, value):
    """``count_col``: each partition's candidates ``op`` value; ``total_col``: all of them,
    everywhere."""
    nisa.tensor_scalar_reduce(dst=tok.spare, data=tok.sel.best_keys, op0=op, operand0=value,
                              reduce_op=nl.add, reduce_res=tok.count_col,
                              reduce_cmd=nisa.reduce_cmd.reset_reduce)  # fmt: skip
    nisa.nc_matmul(dst=tok.column_ps, stationary=consts.ones_pp, moving=tok.count_col,
                   accumulate=False)  # fmt: skip
    nisa.tensor_copy(dst=tok.total_col, src=tok.column_ps)


def _bound(plan: DecodePlan, tok: _Token, consts: _Constants, piv: _Pivot):
    """U* on every partition, Kv and its rank sum, and step 2's bound: at least Kv candidates
    strictly above U*, or no valid row left (U* MARKER)."""
    nisa.tensor_copy(dst=tok.cand_pairs[:, :, 0], src=tok.sel.best_keys)
    nisa.tensor_copy(dst=tok.cand_pairs[:, :, 1], src=tok.cand_rows)
    nisa.tensor_copy(dst=tok.best_left, src=tok.left8[:, 0:1])
    _across_partitions(tok, consts, tok.best_left, nl.max)
    nisa.tensor_scalar(dst=tok.kv, data=tok.valid_rows, op0=nl.minimum, operand0=float(plan.topk),
                       engine=nisa.engine.gpsimd)  # fmt: skip
    nisa.tensor_copy(dst=tok.kv_count, src=tok.kv[0:1, :])
    nisa.tensor_scalar(dst=tok.kv_rank_sum, data=tok.kv_count, op0=nl.subtract, operand0=1.0,
                       op1=nl.multiply, operand1=0.5)  # fmt: skip
    nisa.tensor_tensor(dst=tok.kv_rank_sum, data1=tok.kv_rank_sum, data2=tok.kv_count,
                       op=nl.multiply)  # fmt: skip
    _count_above(tok, consts, nl.greater, tok.best_left)
    nisa.tensor_tensor(dst=piv.rows_bounded, data1=tok.total_col, data2=tok.kv, op=nl.greater_equal)
    nisa.tensor_scalar(dst=piv.no_row_left, data=tok.best_left, op0=nl.equal, operand0=MARKER)
    nisa.tensor_tensor(dst=piv.rows_bounded, data1=piv.rows_bounded, data2=piv.no_row_left,
                       op=nl.maximum)  # fmt: skip


# ---- Step 3: the pivot ------------------------------------------------------------------------


def _find_pivot(plan: DecodePlan, common: _Common, tok: _Token, consts: _Constants, piv: _Pivot):
    """``mid``: a pivot with Kv <= #(candidates >= mid) <= cap, by bisection between U* (or the
    floor) and the best key in ``plan.steps`` halvings; ``in_window`` where one is found."""
    cap, steps = plan.compact, plan.steps
    # The floor is the lowest of the partitions' floor_rank-th best keys: 128 floor_rank >= K,
    # or (a short cache) every row.
    floor_rank = min(_ceil_div(plan.topk, P), plan.depth)
    nisa.tensor_copy(dst=piv.hi, src=tok.sel.best_keys[:, 0:1])
    _across_partitions(tok, consts, piv.hi, nl.max)
    nisa.tensor_copy(dst=piv.lo, src=tok.best_left)

    def from_floor(_):
        # Where U* is MARKER (every valid row a candidate: a short cache, an early token),
        # halvings from it never reach the window. The floor has at least Kv candidates at or
        # above it: where it is above U*, it is the bracket's low end, or (at most cap at or
        # above it) the pivot.
        nisa.tensor_copy(dst=piv.mid, src=tok.sel.best_keys[:, floor_rank - 1 : floor_rank])
        _across_partitions(tok, consts, piv.mid, nl.min)
        _count_above(tok, consts, nl.greater_equal, piv.mid)
        nisa.tensor_tensor(dst=piv.below, data1=piv.mid, data2=tok.best_left, op=nl.greater)
        nisa.tensor_scalar(dst=piv.above, data=tok.total_col, op0=nl.less_equal,
                           operand0=float(cap))  # fmt: skip
        nisa.tensor_tensor(dst=piv.above, data1=piv.above, data2=piv.below, op=nl.multiply)
        nisa.select_reduce(dst=piv.lo, predicate=piv.below, on_true=piv.mid, on_false=piv.lo)
        nisa.select_reduce(dst=piv.hi, predicate=piv.above, on_true=piv.mid, on_false=piv.hi)

    if steps:  # (steps=0, no halvings, forces the ranking of all M)
        nl.fori_loop(0, _load_register(common, piv.no_row_left[0:1, :]), from_floor)
    nisa.tensor_copy(dst=piv.mid, src=piv.lo)

    def halvings(n):
        # Each keeps the bracket's end whose count is out of the window; inside it (Kv <= count
        # <= cap) neither moves, so mid, count_col and total_col stay the pivot's.
        for _ in range(n):
            nisa.tensor_scalar(dst=piv.half, data=piv.hi, op0=nl.multiply, operand0=0.5)
            nisa.scalar_tensor_tensor(dst=piv.mid, data=piv.lo, op0=nl.multiply, operand0=0.5,
                                      op1=nl.add, operand1=piv.half)  # fmt: skip
            _count_above(tok, consts, nl.greater_equal, piv.mid)
            nisa.tensor_tensor(dst=piv.below, data1=tok.total_col, data2=tok.kv, op=nl.less)
            nisa.tensor_scalar(dst=piv.above, data=tok.total_col, op0=nl.greater,
                               operand0=float(cap))  # fmt: skip
            nisa.select_reduce(dst=piv.hi, predicate=piv.below, on_true=piv.mid, on_false=piv.hi)
            nisa.select_reduce(dst=piv.lo, predicate=piv.above, on_true=piv.mid, on_false=piv.lo)

    def in_window():
        nisa.tensor_tensor(dst=piv.in_window, data1=tok.total_col, data2=tok.kv,
                           op=nl.greater_equal)  # fmt: skip
        nisa.tensor_scalar(dst=piv.within_cap, data=tok.total_col, op0=nl.less_equal,
                           operand0=float(cap))  # fmt: skip
        nisa.tensor_tensor(dst=piv.in_window, data1=piv.in_window, data2=piv.within_cap,
                           op=nl.multiply)  # fmt: skip

    # The first halvings always; the rest (a 0-or-1-trip loop) only where the count is still out
    # of the window, which the first leave to few tokens.
    first = min(steps, EARLY_BISECT_STEPS)
    if first:
        halvings(first)
    else:
        _count_above(tok, consts, nl.greater_equal, piv.mid)
    if steps > first:
        in_window()
        nisa.tensor_scalar(dst=piv.out_of_window, data=piv.in_window, op0=nl.multiply,
                           operand0=-1.0, op1=nl.add, operand1=1.0)  # fmt: skip
        nl.fori_loop(0, _load_register(common, piv.out_of_window[0:1, :]),
                     lambda _: halvings(steps - first))  # fmt: skip
    in_window()


def _choose_path(tok: _Token, piv: _Pivot):
    """The token's path flags (0-or-1-trip loops): the pivot's list (a pivot above U*: the rows
    at or above it are exactly the listed candidates), all M ranked (no pivot), the fallback (no
    bound); the path code starts as the fallback's. A token with no valid row (a padding token
    too) takes none: its slots stay MARKER / -1."""
    nisa.tensor_tensor(dst=piv.above_left, data1=piv.mid, data2=tok.best_left, op=nl.greater)
    nisa.tensor_tensor(dst=piv.takes_list, data1=piv.in_window, data2=piv.above_left,
                       op=nl.multiply)  # fmt: skip
    nisa.tensor_tensor(dst=piv.takes_list, data1=piv.takes_list, data2=piv.rows_bounded,
                       op=nl.multiply)  # fmt: skip
    nisa.tensor_tensor(dst=piv.takes_all_ranked, data1=piv.rows_bounded, data2=piv.takes_list,
                       op=nl.subtract)  # fmt: skip
    nisa.tensor_scalar(dst=piv.has_valid, data=tok.kv, op0=nl.greater, operand0=0.0)
    nisa.tensor_tensor(dst=piv.takes_list, data1=piv.takes_list, data2=piv.has_valid,
                       op=nl.multiply)  # fmt: skip
    nisa.tensor_tensor(dst=piv.takes_all_ranked, data1=piv.takes_all_ranked, data2=piv.has_valid,
                       op=nl.multiply)  # fmt: skip
    nisa.tensor_scalar(dst=piv.falls_back, data=piv.rows_bounded[0:1, :], op0=nl.multiply,
                       operand0=-1.0, op1=nl.add, operand1=1.0)  # fmt: skip
    nisa.tensor_scalar(dst=piv.path, data=piv.falls_back, op0=nl.multiply, operand0=2.0)


# ---- Steps 3 and 4: the list and its ranks ------------------------------------------------------


def _count_ranks(out, data, keys, on_gpsimd: int, scratch, scratch_gpsimd, second_counts,
                 shifted_by=None, columns=None):
    """``out[:, c] = #(data > keys[:, c])``: a VectorE compare-and-count pass per column, the
    last ``on_gpsimd`` columns as a GpSimd compare and a ScalarE sum (the engines share passes).
    ``shifted_by`` (partition p's data is the list from entry p - shifted_by on, column c its
    entries 128 c + p): the columns before the entry's own count at ``>=`` (lower rows win ties),
    so the ranks follow the contract's order, exact ties included; a VectorE column's two counts
    (the second in ``second_counts``) are summed after. ``columns``: those of keys / out counted
    (all where None)."""
    width = data.shape[1]
    columns = range(keys.shape[1]) if columns is None else columns
    cols = len(columns)
    for n_col, c in enumerate(columns):
        key = keys[:, c : c + 1]
        first = 0 if shifted_by is None else c * P + shifted_by
        parts = [(slice(first, width), nl.greater)] + (
            [(slice(0, first), nl.greater_equal)] if first else [])  # fmt: skip
        if n_col < cols - on_gpsimd:
            for n, (part, op) in enumerate(parts):
                nisa.tensor_scalar_reduce(dst=scratch[:, part], data=data[:, part], op0=op,
                                          operand0=key, reduce_op=nl.add,
                                          reduce_res=(out if n == 0 else second_counts)[:, c : c + 1],
                                          reduce_cmd=nisa.reduce_cmd.reset_reduce)  # fmt: skip
            if first:
                nisa.tensor_tensor(dst=out[:, c : c + 1], data1=out[:, c : c + 1],
                                   data2=second_counts[:, c : c + 1], op=nl.add)  # fmt: skip
            continue
        for part, op in parts:
            nisa.tensor_scalar(dst=scratch_gpsimd[:, part], data=data[:, part], op0=op,
                               operand0=key, engine=nisa.engine.gpsimd)
        nisa.activation(dst=scratch_gpsimd, op=nl.copy, data=scratch_gpsimd, reduce_op=nl.add,
                        reduce_res=out[:, c : c + 1], reduce_cmd=nisa.reduce_cmd.reset_reduce)


def _choose(tok: _Token, out, ranks, keys, scratch):
    """``out = (rank < Kv) * (a real row's key)``."""
    nisa.tensor_scalar(dst=out, data=ranks, op0=nl.less, operand0=tok.kv)
    nisa.tensor_scalar(dst=scratch, data=keys, op0=nl.greater, operand0=MARKER)
    nisa.tensor_tensor(dst=out, data1=out, data2=scratch, op=nl.multiply)


def _check_ranks(tok: _Token, common: _Common, check: _RankCheck, chosen, ranks):
    """``ranks_exact`` where the chosen ranks are exactly 0 .. Kv-1 (count Kv, sum Kv (Kv - 1) /
    2), ``ranks_tied`` where not; ``chosen_count``. ``chosen`` is overwritten."""
    nisa.tensor_reduce(dst=check.stats[:, 0:1], op=nl.add, data=chosen, axis=1, keepdims=True)
    nisa.tensor_tensor(dst=chosen, data1=chosen, data2=ranks, op=nl.multiply)
    nisa.tensor_reduce(dst=check.stats[:, 1:2], op=nl.add, data=chosen, axis=1, keepdims=True)
    nisa.nc_matmul(dst=check.totals_ps, stationary=common.ones_col, moving=check.stats,
                   accumulate=False)  # fmt: skip
    nisa.tensor_copy(dst=check.totals, src=check.totals_ps)
    nisa.tensor_tensor(dst=check.ranks_exact, data1=check.totals[:, 0:1], data2=tok.kv_count,
                       op=nl.equal)  # fmt: skip
    nisa.tensor_tensor(dst=check.rank_sum_matches, data1=check.totals[:, 1:2],
                       data2=tok.kv_rank_sum, op=nl.equal)  # fmt: skip
    nisa.tensor_tensor(dst=check.ranks_exact, data1=check.ranks_exact,
                       data2=check.rank_sum_matches, op=nl.multiply)  # fmt: skip
    nisa.tensor_copy(dst=check.chosen_count, src=check.totals[:, 0:1])
    nisa.tensor_scalar(dst=check.ranks_tied, data=check.ranks_exact, op0=nl.multiply,
                       operand0=-1.0, op1=nl.add, operand1=1.0)  # fmt: skip


def _scatter_to_slots(slots: _Slots, slot_u32, pairs):
    """Column c's (key, row) pairs to the ranked pairs' rows ``slot_u32[:, c]`` (past K:
    skipped)."""
    for c in range(slot_u32.shape[1]):
        nisa.dma_copy(dst=slots.ranked_pairs.ap(pattern=[[2, P], [1, 2]], offset=0,
                                                vector_offset=slot_u32[:, c : c + 1], indirect_dim=0),
                      src=pairs[:, c, :], oob_mode=nisa.oob_mode.skip)  # fmt: skip


def _build_list(plan: DecodePlan, common: _Common, tok: _Token, consts: _Constants, lst: _Listing,
                mask, counts, with_ranks: bool, placed: bool = False, ranks=None):
    """The list: the candidates where ``mask`` (a prefix of each partition's, ``counts`` per
    partition) at distinct places, the chosen of the partitions before plus the column (a prefix
    sum by matmul), or (``placed``) at the places already in ``place_u32``; keys, rows and
    (``with_ranks``: ``ranks``) ranks, then the broadcasts."""
    cap, depth = plan.compact, plan.depth
    cap_cols = cap // P
    if not placed:
        nisa.nc_matmul(dst=tok.column_ps, stationary=consts.lower, moving=counts, accumulate=False)
        nisa.tensor_copy(dst=lst.before, src=tok.column_ps)
        nisa.tensor_scalar(dst=tok.spare, data=mask, op0=nl.multiply, operand0=-float(2 * cap),
                           op1=nl.add, operand1=float(2 * cap))  # fmt: skip
        nisa.scalar_tensor_tensor(dst=tok.spare, data=consts.column, op0=nl.add,
                                  operand0=lst.before, op1=nl.add, operand1=tok.spare)  # fmt: skip
        nisa.tensor_copy(dst=lst.place_u32, src=tok.spare)
    # The list starts empty: MARKER keys, row -1, a rank past the slots. Keys and rows go as
    # pairs, one scatter per candidate column (each scatter DMA pays its descriptors on the GpSimd).
    nisa.dma_copy(dst=lst.pairs_hbm.ap(pattern=[[2 * cap_cols, P], [1, 2 * cap_cols]], offset=0),
                  src=consts.empty_pairs)  # fmt: skip

    def scatter_columns(first, stop):
        for j in range(first, stop):
            nisa.dma_copy(dst=lst.pairs_hbm.ap(pattern=[[2, P], [1, 2]], offset=0,
                                               vector_offset=lst.place_u32[:, j : j + 1],
                                               indirect_dim=0),
                          src=tok.cand_pairs[:, j, :], oob_mode=nisa.oob_mode.skip)  # fmt: skip

    # A partition's listed candidates are a prefix of its best (descending), ``counts`` long:
    # columns from ``scattered`` on hold one only where some partition lists more (a 0-or-1 trip
    # loop), so most tokens skip their scatters' descriptors.
    scattered = scattered_columns(plan)
    scatter_columns(0, scattered)
    if scattered < depth:
        nisa.nc_transpose(dst=tok.row_ps, data=counts)
        nisa.tensor_reduce(dst=lst.most_listed, op=nl.max, data=tok.row_ps, axis=1, keepdims=True)
        nisa.tensor_scalar(dst=lst.lists_past_scattered, data=lst.most_listed, op0=nl.greater,
                           operand0=float(scattered))  # fmt: skip
        nl.fori_loop(0, _load_register(common, lst.lists_past_scattered),
                     lambda _: scatter_columns(scattered, depth))  # fmt: skip
    # The pairs of each block of 128 entries on a partition (a run each), apart on chip, the keys
    # contiguous in HBM (the broadcasts' source), and each field by column (a transpose of its
    # blocks: entry 128 c + p at [p, c]).
    by_block = [[2 * P, cap_cols], [1, 2 * P]]
    nisa.dma_copy(dst=lst.blocks_pairs, src=lst.pairs_hbm.ap(pattern=by_block, offset=0))
    for f, hbm in enumerate(lst.hbm[0:2]):
        nisa.activation(dst=lst.blocks_field, op=nl.copy, data=lst.blocks_pairs[:, f::2])
        nisa.dma_copy(dst=hbm.ap(pattern=[[P, cap_cols], [1, P]], offset=LIST_PAD * (f == 0)),
                      src=lst.blocks_field)  # fmt: skip
        nisa.nc_transpose(dst=lst.above_ps[:, 0:cap_cols], data=lst.blocks_field)
        nisa.tensor_copy(dst=lst.listed[f], src=lst.above_ps[:, 0:cap_cols])
    if with_ranks:  # no broadcast to take them from: scattered, then read by column
        rank_hbm = lst.hbm[2]
        nisa.memset(dst=lst.listed[2], value=float(2 * cap + plan.topk))
        nisa.dma_copy(dst=rank_hbm.ap(pattern=[[cap_cols, P], [1, cap_cols]], offset=0),
                      src=lst.listed[2])  # fmt: skip
        for j in range(depth):
            nisa.dma_copy(dst=rank_hbm.ap(pattern=[[1, P], [1, 1]], offset=0,
                                          vector_offset=lst.place_u32[:, j : j + 1], indirect_dim=0),
                          src=ranks[:, j : j + 1], oob_mode=nisa.oob_mode.skip)  # fmt: skip
        nisa.dma_copy(dst=lst.listed[2], src=rank_hbm.ap(pattern=[[1, P], [P, cap_cols]], offset=0))
        # The tie break compares every entry with all of them: the broadcasts.
        nisa.dma_copy(dst=lst.keys, src=lst.hbm[0].ap(pattern=[[0, P], [1, cap]], offset=LIST_PAD))
        nisa.dma_copy(dst=lst.rows, src=lst.hbm[1].ap(pattern=[[0, P], [1, cap]], offset=0))


def _row_order_places(plan: DecodePlan, tok: _Token, consts: _Constants, piv: _Pivot,
                      lst: _Listing, ranked: _AllRanked):
    """``place_u32``: each listed candidate's place in row order (the number of rows at or above
    the pivot before its row), ``2 cap`` (skipped) for the others. Row ``128 j + p`` comes after
    the rows of columns ``< j`` (a running sum of the grid's column counts) and after those of
    its column on partitions ``< p`` (a matmul with ``lower``). The grid goes through HBM in
    blocks of up to 512 columns, so that a hardware loop takes them."""
    cap, columns = plan.compact, plan.columns
    block, blocks = _grid_sizes(plan)
    width = blocks * block
    nisa.tensor_scalar(dst=lst.grid_mask[:, 0:columns], data=tok.keys, op0=nl.greater_equal,
                       operand0=piv.mid)  # fmt: skip
    grid = [[width, P], [1, block]]
    nisa.dma_copy(dst=lst.grid_hbm.ap(pattern=[[width, P], [1, width]], offset=0),
                  src=lst.grid_mask)  # fmt: skip
    nisa.memset(dst=lst.carry, value=0.0)

    def one_block(b):
        nisa.dma_copy(dst=lst.mask_block, src=lst.grid_hbm.ap(pattern=grid, offset=0,
                                                              scalar_offset=b, indirect_dim=1))
        nisa.nc_matmul(dst=lst.above_ps, stationary=consts.lower_bf, moving=lst.mask_block,
                       accumulate=False)  # fmt: skip
        nisa.nc_matmul(dst=lst.column_sums_ps, stationary=consts.ones_bf, moving=lst.mask_block,
                       accumulate=False)  # fmt: skip
        # A running sum of the column counts: max(count + sum so far, mask) is the sum, since a
        # marked cell's column counts at least 1 (a [128, 512] zero tile, spared).
        nisa.tensor_tensor_scan(dst=lst.running_block, data0=lst.column_sums_ps,
                                data1=lst.mask_block, initial=lst.carry, op0=nl.add,
                                op1=nl.maximum)  # fmt: skip
        nisa.tensor_copy(dst=lst.carry, src=lst.running_block[:, block - 1 : block])
        nisa.tensor_tensor(dst=lst.places_block, data1=lst.running_block,
                           data2=lst.column_sums_ps, op=nl.subtract)  # fmt: skip
        nisa.tensor_tensor(dst=lst.places_block, data1=lst.places_block, data2=lst.above_ps,
                           op=nl.add)  # fmt: skip
        nisa.dma_copy(dst=lst.places_hbm.ap(pattern=grid, offset=0, scalar_offset=b,
                                            indirect_dim=1), src=lst.places_block)  # fmt: skip

    nl.fori_loop(0, blocks, one_block)
    nisa.dma_copy(dst=tok.work, src=lst.places_hbm.ap(pattern=[[width, P], [1, columns]], offset=0))
    nisa.nc_n_gather(dst=ranked.slot, data=tok.work, indices=tok.cand_pos_u32)
    nisa.scalar_tensor_tensor(dst=tok.spare, data=ranked.slot, op0=nl.subtract,
                              operand0=float(2 * cap), op1=nl.multiply, operand1=lst.in_list)
    nisa.tensor_scalar(dst=tok.spare, data=tok.spare, op0=nl.add, operand0=float(2 * cap))
    nisa.tensor_copy(dst=lst.place_u32, src=tok.spare)


def _count_ranks_paired(plan: DecodePlan, consts: _Constants, lst: _Listing, on_gpsimd: int):
    """``listed[2]``: the rank of each entry of the whole list, from one compare per pair of
    entries. Block ``c``'s pass compares its entries (one per partition) with every entry from
    ``128 c`` on: its count is theirs strictly above (its own block's included), and its 0/1
    tile, summed over the partitions by a matmul per later block, counts for each later entry
    the entries of block ``c`` it beats strictly; the other ``128`` minus those beat it (an equal
    key at a lower row wins). The last ``on_gpsimd`` blocks (the narrowest) are GpSimd compares
    and ScalarE sums. A tie within a block is left out."""
    cap = plan.compact
    cap_cols = cap // P
    ranks = lst.listed[2]
    for c in range(cap_cols):
        beaten_by = lst.rank_cmp[c % 2][:, 0 : cap - c * P]
        key = lst.listed[0][:, c : c + 1]
        if c < cap_cols - on_gpsimd:
            nisa.tensor_scalar_reduce(dst=beaten_by, data=lst.keys[:, c * P : cap], op0=nl.greater,
                                      operand0=key, reduce_op=nl.add,
                                      reduce_res=ranks[:, c : c + 1],
                                      reduce_cmd=nisa.reduce_cmd.reset_reduce)  # fmt: skip
        else:
            nisa.tensor_scalar(dst=beaten_by, data=lst.keys[:, c * P : cap], op0=nl.greater,
                               operand0=key, engine=nisa.engine.gpsimd)  # fmt: skip
            nisa.activation(dst=beaten_by, op=nl.copy, data=beaten_by, reduce_op=nl.add,
                            reduce_res=ranks[:, c : c + 1],
                            reduce_cmd=nisa.reduce_cmd.reset_reduce)  # fmt: skip
        for b in range(c + 1, cap_cols):
            nisa.nc_matmul(dst=lst.beats_ps[:, b : b + 1],
                           stationary=beaten_by[:, (b - c) * P : (b - c + 1) * P],
                           moving=consts.ones_bf[:, 0:1], accumulate=c > 0)  # fmt: skip
    if cap_cols > 1:  # rank += 128 b - (earlier entries beaten)
        later = slice(1, cap_cols)
        nisa.tensor_tensor(dst=lst.rank_before[:, later], data1=consts.block_base[:, later],
                           data2=lst.beats_ps[:, later], op=nl.subtract)  # fmt: skip
        nisa.tensor_tensor(dst=ranks[:, later], data1=ranks[:, later],
                           data2=lst.rank_before[:, later], op=nl.add)  # fmt: skip


def _break_block_ties(plan: DecodePlan, consts: _Constants, lst: _Listing, piv: _Pivot):
    """rank += #(entries of its block with an equal key and a lower row): ``[p, q]`` is
    ``key_q == key_p`` with ``p < q`` (``lower``), summed over the partitions p (path 4)."""
    cap_cols = plan.compact // P
    for c in range(cap_cols):
        tied = lst.rank_cmp[c % 2][:, 0:P]
        nisa.scalar_tensor_tensor(dst=tied, data=lst.keys[:, c * P : (c + 1) * P], op0=nl.equal,
                                  operand0=lst.listed[0][:, c : c + 1], op1=nl.multiply,
                                  operand1=consts.lower)  # fmt: skip
        nisa.nc_matmul(dst=lst.ties_ps[:, c : c + 1], stationary=tied,
                       moving=consts.ones_bf[:, 0:1], accumulate=False)  # fmt: skip
    nisa.tensor_tensor(dst=lst.listed[2], data1=lst.ties_ps, data2=lst.listed[2], op=nl.add)
    nisa.memset(dst=piv.path, value=4.0)


def _break_ties(plan: DecodePlan, lst: _Listing):
    """rank += #(entries with an equal key and a lower row) over the whole list: the contract's
    order (step 4)."""
    for c in range(plan.compact // P):
        nisa.tensor_scalar(dst=lst.equal, data=lst.keys, op0=nl.equal,
                           operand0=lst.listed[0][:, c : c + 1], engine=nisa.engine.gpsimd)
        nisa.scalar_tensor_tensor(dst=lst.equal, data=lst.rows, op0=nl.less,
                                  operand0=lst.listed[1][:, c : c + 1], op1=nl.multiply,
                                  operand1=lst.equal)  # fmt: skip
        nisa.activation(dst=lst.equal, op=nl.copy, data=lst.equal, reduce_op=nl.add,
                        reduce_res=lst.gain[:, c : c + 1], reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.tensor_tensor(dst=lst.listed[2], data1=lst.listed[2], data2=lst.gain, op=nl.add)


def _place_list(plan: DecodePlan, lst: _Listing, slots: _Slots, cols: range):
    """Step 5 from the list's columns ``cols``: slot = rank (an empty entry past every slot; past
    K: skipped)."""
    bound = float(2 * plan.compact + plan.topk)
    cols = slice(cols.start, cols.stop)
    gain, slot_u32, pairs = lst.gain[:, cols], lst.slot_u32[:, cols], lst.pairs[:, cols, :]
    nisa.tensor_scalar(dst=gain, data=lst.listed[0][:, cols], op0=nl.greater, operand0=MARKER)
    nisa.tensor_scalar(dst=gain, data=gain, op0=nl.multiply, operand0=-bound, op1=nl.add,
                       operand1=bound)  # fmt: skip
    nisa.tensor_tensor(dst=gain, data1=gain, data2=lst.listed[2][:, cols], op=nl.add)
    nisa.tensor_copy(dst=slot_u32, src=gain)
    nisa.tensor_copy(dst=pairs[:, :, 0], src=lst.listed[0][:, cols])
    nisa.tensor_copy(dst=pairs[:, :, 1], src=lst.listed[1][:, cols])
    _scatter_to_slots(slots, slot_u32, pairs)


@dataclasses.dataclass
class _TokenSelection:
    """Every tile the selection of one token (steps 2 to 6) reads or writes, by stage."""

    common: _Common
    tok: _Token
    consts: _Constants
    piv: _Pivot
    check: _RankCheck
    ranked: _AllRanked
    lst: _Listing
    slots: _Slots
    fallback: _Fallback


def _token_selection_tiles(launch: _Launch, keys_out, idx_out, path_out, common: _Common,
                           tok: _Token) -> _TokenSelection:
    plan = launch.plan
    ranked = _all_ranked_tiles(plan)
    fill_cols, _ = _slot_blocks(plan.topk)
    return _TokenSelection(common=common, tok=tok, consts=_constant_tiles(plan, fill_cols),
                           piv=_pivot_tiles(), check=_rank_check_tiles(), ranked=ranked,
                           lst=_listing_tiles(plan, ranked),
                           slots=_slot_tiles(launch, keys_out, idx_out, path_out),
                           fallback=_fallback_tiles(plan))  # fmt: skip


def _list_path(launch: _Launch, s: _TokenSelection):
    """Steps 3 to 5 for the candidates at or above the pivot: listed in row order and ranked
    within the list alone, the whole of it or the program's share of its columns."""
    plan, tok, lst, piv = launch.plan, s.tok, s.lst, s.piv
    cap, cap_cols = plan.compact, launch.cap_cols
    nisa.tensor_scalar(dst=lst.in_list, data=tok.sel.best_keys, op0=nl.greater_equal,
                       operand0=piv.mid)  # fmt: skip
    _row_order_places(plan, tok, s.consts, piv, lst, s.ranked)
    _build_list(plan, s.common, tok, s.consts, lst, lst.in_list, tok.count_col, with_ranks=False,
                placed=True)  # fmt: skip
    offload = launch.offload
    if launch.ranks_whole_list:
        # Every partition holds the list; each pair of blocks is compared once.
        nisa.dma_copy(dst=lst.keys, src=lst.hbm[0].ap(pattern=[[0, P], [1, cap]], offset=LIST_PAD))
        on_gpsimd = cap_cols // 2 if offload is None else min(offload, cap_cols)
        _count_ranks_paired(plan, s.consts, lst, on_gpsimd)
        nisa.memset(dst=piv.path, value=3.0)
        # Ties within a block leave the later entry one short: the check, then the fix.
        _choose(tok, lst.gain, lst.listed[2], lst.listed[0], lst.rank_before)
        _check_ranks(tok, s.common, s.check, lst.gain, lst.listed[2])
        nl.fori_loop(0, _load_register(s.common, s.check.ranks_tied),
                     lambda _: _break_block_ties(plan, s.consts, lst, piv))  # fmt: skip
    else:
        # The list shifted by partition (partition p from entry p - LIST_PAD on): a column's
        # entries all sit at one column of it, so >= before and > from there ranks them in the
        # contract's order, exact ties by row, with no tie pass. The runs overlap in HBM (a
        # partition stride of 1, as the broadcasts' 0: nki-aps page, [stride, size] per
        # dimension; overlapping reads inferred).
        nisa.dma_copy(dst=lst.shifted, src=lst.hbm[0].ap(pattern=[[1, P], [1, cap + LIST_PAD]],
                                                         offset=0))  # fmt: skip
        ranked_cols = launch.ranked_cols
        on_gpsimd = len(ranked_cols) // 2 if offload is None else min(offload, len(ranked_cols))
        _count_ranks(lst.listed[2], lst.shifted, lst.listed[0], on_gpsimd, lst.shifted_scratch,
                     lst.rank_cmp[1], lst.rank_before, shifted_by=LIST_PAD,
                     columns=ranked_cols)  # fmt: skip
        nisa.memset(dst=piv.path, value=3.0)
    _place_list(plan, lst, s.slots, launch.ranked_cols)


def _all_ranked_path(plan: DecodePlan, s: _TokenSelection):
    """Step 3 without a pivot: every candidate's rank among all M (strictly greater keys), then
    placed where the ranks are exact, the ties broken in the list where the chosen fit it, or
    the fallback's code."""
    tok, ranked, check, piv = s.tok, s.ranked, s.check, s.piv
    m = plan.candidates
    nisa.dma_copy(dst=ranked.cand_hbm, src=tok.sel.best_keys)
    nisa.dma_copy(dst=ranked.all_keys[:, 0:m], src=ranked.cand_hbm.ap(pattern=[[0, P], [1, m]],
                                                                      offset=0))  # fmt: skip
    _count_ranks(ranked.ranks, ranked.all_keys[:, 0:m], tok.sel.best_keys, plan.split,
                 ranked.beaten[:, 0:m], ranked.beaten_alt[:, 0:m], s.lst.rank_before)  # fmt: skip
    _choose(tok, ranked.chosen, ranked.ranks, tok.sel.best_keys, tok.spare)
    nisa.tensor_copy(dst=ranked.chosen_work, src=ranked.chosen)
    _check_ranks(tok, s.common, check, ranked.chosen_work, ranked.ranks)
    nisa.tensor_scalar(dst=check.tied_fit_list, data=check.chosen_count, op0=nl.less_equal,
                       operand0=float(plan.compact))  # fmt: skip
    nisa.tensor_tensor(dst=check.tied_fit_list, data1=check.ranks_tied, data2=check.tied_fit_list,
                       op=nl.multiply)  # fmt: skip
    nisa.tensor_tensor(dst=piv.falls_back, data1=check.ranks_tied, data2=check.tied_fit_list,
                       op=nl.subtract)  # fmt: skip
    nisa.scalar_tensor_tensor(dst=piv.path, data=piv.falls_back, op0=nl.multiply, operand0=2.0,
                              op1=nl.add, operand1=check.tied_fit_list)  # fmt: skip
    nl.fori_loop(0, _load_register(s.common, check.ranks_exact), lambda _: _place_ranked(plan, s))
    nl.fori_loop(0, _load_register(s.common, check.tied_fit_list), lambda _: _tie_list(plan, s))


def _place_ranked(plan: DecodePlan, s: _TokenSelection):
    """Slot = rank where chosen, else past the K rows (skipped): ``(1 - chosen) K + rank``."""
    ranked = s.ranked
    nisa.tensor_scalar(dst=ranked.slot, data=ranked.chosen, op0=nl.multiply,
                       operand0=-float(plan.topk), op1=nl.add, operand1=float(plan.topk))
    nisa.tensor_tensor(dst=ranked.slot, data1=ranked.slot, data2=ranked.ranks, op=nl.add)
    nisa.tensor_copy(dst=ranked.slot_u32, src=ranked.slot)
    _scatter_to_slots(s.slots, ranked.slot_u32, s.tok.cand_pairs)


def _tie_list(plan: DecodePlan, s: _TokenSelection):
    """Step 4: the chosen as a list (not in row order), their ties broken over all of it."""
    _build_list(plan, s.common, s.tok, s.consts, s.lst, s.ranked.chosen, s.check.stats[:, 0:1],
                with_ranks=True, ranks=s.ranked.ranks)  # fmt: skip
    _break_ties(plan, s.lst)
    _place_list(plan, s.lst, s.slots, range(plan.compact // P))


def _select_token(launch: _Launch, s: _TokenSelection, t, member: int):
    """Steps 2 to 6 for the token in slot ``member`` of span ``t``, its candidates in hand."""
    plan, tok, piv, slots = launch.plan, s.tok, s.piv, s.slots
    _bound(plan, tok, s.consts, piv)
    _find_pivot(plan, s.common, tok, s.consts, piv)
    _choose_path(tok, piv)
    # Step 5's slots start as MARKER / -1 past Kv.
    for rows, width, first in slots.blocks:
        block = [[width, rows.stop - rows.start], [1, width]]
        nisa.dma_copy(dst=slots.ranked_pairs.ap(pattern=block, offset=first),
                      src=s.consts.fill_pairs[rows, 0:width])  # fmt: skip
    nl.fori_loop(0, _load_register(s.common, piv.takes_list[0:1, :]),
                 lambda _: _list_path(launch, s))  # fmt: skip
    if launch.takes_rare_paths:
        nl.fori_loop(0, _load_register(s.common, piv.takes_all_ranked[0:1, :]),
                     lambda _: _all_ranked_path(plan, s))  # fmt: skip
    # The pairs apart on chip (rows to int32 on the copy), then each output in blocks.
    for rows, width, first in slots.blocks:
        nisa.dma_copy(dst=slots.out_pairs[rows, 0:width], src=slots.ranked_pairs.ap(
            pattern=[[width, rows.stop - rows.start], [1, width]], offset=first))  # fmt: skip
    nisa.tensor_copy(dst=slots.out_keys, src=slots.out_pairs[:, 0::2])
    nisa.tensor_copy(dst=slots.out_rows, src=slots.out_pairs[:, 1::2])
    for rows, width, first in slots.blocks:
        for out, tile in ((slots.keys_out, slots.out_keys), (slots.idx_out, slots.out_rows)):
            nisa.dma_copy(dst=_tile_block(out, t, rows.stop - rows.start, width // 2,
                                          launch.out_offset + member * plan.topk + first // 2),
                          src=tile[rows, 0 : width // 2])  # fmt: skip
    if not launch.takes_rare_paths:
        return
    # Step 6 (0 or 1 trips): the exact merge overwrites the token's result.
    nl.fori_loop(0, _load_register(s.common, piv.falls_back), lambda _: _run_fallback(
        s.fallback, tok.keys, slots.keys_out, slots.idx_out, t, member, plan.topk))  # fmt: skip
    nisa.tensor_copy(dst=s.common.register_staging, src=piv.path)
    nisa.dma_copy(dst=_tile_block(slots.path_out, t, 1, 1, member), src=s.common.register_staging)


def _own_chunks(launch: _Launch):
    """The scoring launch's chunks of this program: ``(first, stop)``."""
    n = launch.plan.chunks
    return launch.program * n // launch.programs, (launch.program + 1) * n // launch.programs


def _slot_outputs(copies: int, spans: int, slots: int, topk: int):
    """The selection's outputs in shared HBM: keys, rows (``copies`` of them, one per program
    placing a share of the slots) and the path codes."""
    keys_out = nl.ndarray((copies * spans, slots, topk), dtype=nl.float32, buffer=nl.shared_hbm)
    idx_out = nl.ndarray((copies * spans, slots, topk), dtype=nl.int32, buffer=nl.shared_hbm)
    path_out = nl.ndarray((spans, slots), dtype=nl.int32, buffer=nl.shared_hbm)
    return keys_out, idx_out, path_out


# ---- The entries, one per launch mode ----------------------------------------------------------


def indexer_decode_kernel(q_t, w_t, keys_t, key_scale_t, n_valid, chunk_ends, *, topk, depth,
                          split=0, steps=None, on_vector=0, offload=None, signed=False):  # fmt: skip
    """The row-spread selection of each of the program's tokens, in one launch.

    Operands (prepared by :mod:`jax_sparse_attn.indexer.neuron`): the tokens in groups of ``g``
    (1 or 2, sharing each ``d`` matmul), the groups in ``S`` spans of ``s`` (1 or 2, sharing each
    read of a chunk of keys); slot ``g i + m`` of a span is member ``m`` of its group ``i``::

        q_t          [S, s, Di, g Hi]     16-bit  q transposed, a group's tokens side by side
        w_t          [S, s, g Hi, 1]      f32     the weights w' (scale folded in), likewise
        keys_t       [Di, n_chunks, C]    16-bit  the keys transposed, C rows per chunk
        key_scale_t  [128, F]             f32     key_scale[128 j + p] at [p, j]
        n_valid      [S, s g, 1]          f32     valid rows of each token
        chunk_ends   [1, S, s g]          int32   chunks holding a valid row of the token

    Compile-time keywords: ``topk`` (K), ``depth`` (candidates per partition, a multiple of 8),
    ``split`` (step 3's rank columns counted on GpSimd + ScalarE), ``steps`` (the pivot's
    halvings; ``BISECT_STEPS`` where None, 0: no pivot), ``on_vector`` (the 512-row blocks per
    chunk whose head sums run on the VectorE), ``signed`` (the TensorE's head sums with the
    signed weights, :func:`_score_chunk`), ``offload`` (the pivot list's narrowest rank passes
    counted as GpSimd compares and ScalarE sums; None: half of them;
    ``neuron.list_offload_columns``). Launch as ``kernel[n]`` with ``S`` a multiple of ``n``.

    Returns ``(keys, idx, path)`` in shared HBM: ``keys [S, s g, K]`` f32, the selection keys
    (descending, ``MARKER`` past the valid rows), ``idx`` their rows (-1 there), ``path [S, s g]``
    int32 each token's path code (docs/indexer-kernel.md).
    """
    plan, spans, span, group = _plan_launch(q_t, w_t, keys_t, key_scale_t, n_valid, chunk_ends,
                                            topk, depth, split, steps)  # fmt: skip
    programs, program = nl.num_programs(), nl.program_id(0)
    assert spans % programs == 0, (
        f"{spans} spans of token groups must be a multiple of the {programs} programs")  # fmt: skip
    per_program = spans // programs
    launch = _Launch(plan, spans, span, group, program, programs,
                     first_span=program * per_program, span_count=per_program, shares=1,
                     share_depth=plan.depth, ranked_cols=range(plan.compact // P),
                     ranks_whole_list=True, takes_rare_paths=True, copies=1,
                     on_vector=on_vector, signed=signed, offload=offload)  # fmt: skip
    outputs = _slot_outputs(1, spans, launch.slots, topk)
    common = _common_tiles()
    tok = _token_tiles(plan, plan.depth)
    s = _token_selection_tiles(launch, *outputs, common, tok)
    scoring = _scoring_tiles(launch, q_t.dtype, keys_t.dtype, s.check.totals_ps[:, 0:1])
    _fill_common(common)
    _fill_constants(plan, s.consts, s.lst, s.slots)
    _zero_staged_scores(plan, scoring, tok.keys, 0, plan.columns)

    def one_span(t):
        _score_span(launch, common, scoring, q_t, w_t, keys_t, chunk_ends, t)
        for member in range(launch.slots):
            _load_valid_rows(tok, n_valid, t, member)
            _own_candidates(launch, common, scoring, tok, key_scale_t, member)
            _select_token(launch, s, t, member)

    nl.fori_loop(launch.first_span, launch.first_span + launch.span_count, one_span)
    return outputs


def indexer_decode_score_kernel(q_t, w_t, keys_t, key_scale_t, n_valid, chunk_ends, *, topk,
                                depth, on_vector=0, signed=False):  # fmt: skip
    """The first of a decode step's two launches (tokens fewer than the programs): the programs
    split each token's chunks (spans of one group, every program taking every span), score them
    and run step 2 on their share of the columns.

    Operands and keywords as :func:`indexer_decode_kernel`'s. Returns ``(staged [S, g, 128, F],
    candidates [S, g, 128, n W])`` f32 in shared HBM (``n`` programs): the selection keys (times
    key_scale, select_key applied; row ``128 j + p`` at ``[p, j]``) and, ``W = 2 d + 1`` per
    program and partition, its ``d`` best keys, their rows and the best key left (``d``:
    :func:`share_depth`)."""
    plan, spans, span, group = _plan_launch(q_t, w_t, keys_t, key_scale_t, n_valid, chunk_ends,
                                            topk, depth, 0, None)  # fmt: skip
    programs, program = nl.num_programs(), nl.program_id(0)
    assert span == 1, f"a span of {span} groups in the scoring launch"
    assert plan.chunks >= programs, f"{plan.chunks} chunks for {programs} programs"
    d = share_depth(plan, programs)
    launch = _Launch(plan, spans, span, group, program, programs, first_span=0,
                     span_count=spans, shares=programs, share_depth=d, ranked_cols=range(0),
                     ranks_whole_list=False, takes_rare_paths=False, copies=1,
                     on_vector=on_vector, signed=signed)  # fmt: skip
    columns, width = plan.columns, launch.share_width
    staged_out = nl.ndarray((spans, launch.slots, P, columns), dtype=nl.float32,
                            buffer=nl.shared_hbm)  # fmt: skip
    candidates_out = nl.ndarray((spans, launch.slots, P, programs * width), dtype=nl.float32,
                                buffer=nl.shared_hbm)  # fmt: skip
    common = _common_tiles()
    tok = _token_tiles(plan, d)
    shares = _share_tiles(launch)
    nan_count = _psum((1, 1))
    scoring = _scoring_tiles(launch, q_t.dtype, keys_t.dtype, nan_count)
    _fill_common(common)
    chunk_lo, chunk_hi = _own_chunks(launch)
    _zero_staged_scores(plan, scoring, tok.keys, chunk_lo * plan.chunk_columns,
                        (chunk_hi - chunk_lo) * plan.chunk_columns)  # fmt: skip

    def one_span(t):
        _score_span(launch, common, scoring, q_t, w_t, keys_t, chunk_ends, t, (chunk_lo, chunk_hi))
        _stage_share(launch, common, scoring, tok, shares, key_scale_t, n_valid, staged_out,
                     candidates_out, t)  # fmt: skip

    nl.fori_loop(0, spans, one_span)
    return staged_out, candidates_out


def indexer_decode_select_kernel(q_t, w_t, keys_t, key_scale_t, n_valid, chunk_ends,
                                 staged_scores, staged_candidates, *, topk, depth, split=0,
                                 steps=None, offload=None):  # fmt: skip
    """The second of a decode step's two launches: every program takes the ``depth`` best of the
    shares' candidates (``staged_scores`` and ``staged_candidates``, the scoring launch's
    result; q, w and the keys are read for their shapes only), runs steps 2 to 4 alike, and ranks
    and places its share of the list's columns. Program 0 alone takes the ranking of all M
    candidates and the fallback, and writes ``path``. Keywords as :func:`indexer_decode_kernel`'s
    (those of the scoring aside).

    Returns ``(keys [n S, s g, K], idx, path)``: each program's own copy of the slots (copy ``i``
    at ``[i S, (i + 1) S)``; MARKER / -1 where another program placed the entry, so the result
    is their maximum, ``neuron.merge_copies``)."""
    plan, spans, span, group = _plan_launch(q_t, w_t, keys_t, key_scale_t, n_valid, chunk_ends,
                                            topk, depth, split, steps)  # fmt: skip
    programs, program = nl.num_programs(), nl.program_id(0)
    assert span == 1, f"a span of {span} groups in the selecting launch"
    d = share_depth(plan, programs)
    cap_cols = plan.compact // P
    ranked_cols = range(program * cap_cols // programs, (program + 1) * cap_cols // programs)
    launch = _Launch(plan, spans, span, group, program, programs, first_span=0,
                     span_count=spans, shares=programs, share_depth=d, ranked_cols=ranked_cols,
                     ranks_whole_list=False, takes_rare_paths=program == 0, copies=programs,
                     offload=offload)  # fmt: skip
    staged_shape = (spans, launch.slots, P, plan.columns)
    candidates_shape = (spans, launch.slots, P, programs * launch.share_width)
    assert tuple(staged_scores.shape) == staged_shape, f"staged_scores {staged_scores.shape}"
    assert tuple(staged_candidates.shape) == candidates_shape, (
        f"staged_candidates {staged_candidates.shape}")  # fmt: skip
    assert programs * d >= depth
    outputs = _slot_outputs(programs, spans, launch.slots, topk)
    common = _common_tiles()
    tok = _token_tiles(plan, plan.depth)
    shares = _share_tiles(launch)
    s = _token_selection_tiles(launch, *outputs, common, tok)
    _fill_common(common)
    _fill_constants(plan, s.consts, s.lst, s.slots)

    def one_span(t):
        for member in range(launch.slots):
            _load_valid_rows(tok, n_valid, t, member)
            _staged_candidates(launch, common, tok, shares, staged_scores, staged_candidates, t,
                               member)  # fmt: skip
            _select_token(launch, s, t, member)

    nl.fori_loop(0, spans, one_span)
    return outputs
