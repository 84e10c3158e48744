"""The indexer's row-spread kernel: one token at a time, its rows over the 128 partitions
(docs/indexer-kernel.md, "The row-spread kernel").

The tiled kernel (:mod:`.kernel`) puts tokens on the partitions, so a decode step's one token
leaves 127 of them idle while ``max8`` rounds walk its whole row. Here row ``r`` of a token's
cache lives in partition ``r % 128``, column ``r // 128``, and the selection is:

1. **Scores** on the TensorEngine: ``d = q . k`` per 512 rows as in the tiled kernel (q
   stationary; two tokens side by side where their heads fit, ``2 Hi <= 128``, so they share
   each matmul), the ScalarE's relu scaled by ``|w'|`` per head (``relu(|w'| d)``, the fp32
   product ``|w' relu(d)|``), then the head sums with those columns stationary and each
   token's 0/1 columns of heads with ``w' >= 0`` and the rest moving (an fp32 matmul flagged
   ``is_moving_onezero``, half the cost), so each sign's sum lands as a ``[128 rows, 1]``
   column and the score is their difference; the group's tokens share each head-sum matmul,
   and a chunk with a NaN score (``0 * inf`` from one token's zero column meeting the other's
   relu, a non-finite weight, a zero weight meeting ``d = -inf``, or a real NaN) is scored
   again in the exact form, each token's ``relu(d)`` against its own fp32 weights (where the
   TensorE has time to spare, ``signed``: the weights moving, no subtraction);
   ``on_vector`` blocks per chunk instead with the rows stationary and the head sums on the
   VectorE; times ``key_scale``; staged through HBM, then ``select_key`` on the ``[128, F]``
   tile.
2. **A threshold** from ``depth / 8`` rounds of ``max8`` per partition: each partition's
   ``depth`` best keys are candidates, and ``U*``, the best key left anywhere, bounds every row
   that is not. If at least ``Kv = min(K, n_valid)`` candidates are strictly above ``U*`` (or
   nothing valid is left), the top ``Kv`` rows are all candidates.
3. **A pivot and a list** (step 3a): bisection between ``U*`` (or the floor, the lowest of the
   partitions' ``ceil(K / 128)``-th best keys, where that is higher: a short cache, whose ``U*``
   is MARKER) and the best key for a pivot ``v``
   with ``Kv <= #(candidates >= v) <= cap`` (``cap = K8 + 128``; one compare-and-count pass over
   the ``[128, depth]`` candidates and a matmul sum per halving) and ``v > U*``, so the rows
   ``>= v`` are exactly the listed candidates. They are scattered into a compact list in row
   order (each one's place: the rows ``>= v`` before it, counted on the ``[128, F]`` grid by a
   running sum over its columns and a matmul over its partitions), and each entry's rank is
   how many entries beat it, earlier entries (lower rows) at an equal key included. A program
   ranking the whole list compares each pair of entries once: every partition holds the list,
   and block ``c``'s pass (entry ``128 c + p`` on partition ``p``, a ``tensor_scalar_reduce``
   with ``>`` over the entries from ``128 c`` on) counts those strictly above each of its
   entries; its 0/1 tile, summed over the partitions by one ``[128, 128]`` matmul per later
   block, counts for each later entry the block's entries it beats strictly, and the other
   ones beat it (an equal key at a lower row wins). Only ties within a block are missed: the
   ranks' check below finds them, and a pass per block adds each entry's equal keys at lower
   rows of its block (path 4). A program ranking a share of the list's columns (a decode
   step's selecting launch) reads the list shifted instead, partition ``p`` from entry
   ``p - 128`` on (``LIST_PAD`` MARKER keys before and after it in HBM), so the entries of a
   block of 128 all sit at column ``128 c + 128`` of their partitions: one compare-and-count
   pass with ``>=`` before that column and one with ``>`` from it on rank the block exactly in
   the contract's order, exact ties by row included, with no check. Where no pivot is
   found in ``steps`` halvings (step 3b), every partition holds all ``M = 128 depth``
   candidates (broadcast through HBM) and each candidate's rank is counted among all ``M``
   (strictly greater keys); the chosen (rank ``< Kv``) then form the list where they need step
   4. Ties would share a rank there: the ranks of the ``Kv`` chosen are exactly ``0 .. Kv-1``
   iff their count is ``Kv`` and their sum ``Kv (Kv - 1) / 2`` (sums of integers, exact in fp32
   for ``K <= MAX_TOPK``).
4. **Ties** (exact ties among the best are common: thousands of f32 scores in a narrow range):
   without a pivot, where that check fails, each entry's rank gains the count of entries with an
   equal key and a lower row over the whole list (an equality pass, a compare-and-multiply pass
   and a sum per 128 entries): the ranks become distinct and follow the contract's order.
5. **Placement**: each entry (or candidate) of rank ``< Kv`` is scattered to its slot by DMA
   (``vector_offset`` on the destination).
6. **Fallback**: where step 2's bound fails (a partition holding more than ``depth`` of the
   best, or NaN / infinite keys shared by more rows than that), or, without a pivot, more than
   ``cap`` candidates share the best ranks (a tie across the cut that large), the token's keys go
   to HBM in row order and the tiled kernel's exact merge runs over them (``path`` records it).
   Steps 3 to 6 run as hardware loops of 0 or 1 trips; a token with no valid row takes none.

Interface (prepared by :mod:`jax_sparse_attn.indexer.neuron`): the tokens in groups of ``g`` (1
or 2, sharing each ``d`` matmul), the groups in ``S`` spans of ``s`` (1 or 2, sharing each read
of a chunk of keys); slot ``g i + m`` of a span is member ``m`` of its group ``i``; ``S`` a
multiple of the programs::

    q_t          [S, s, Di, g Hi]     16-bit  q transposed, a group's tokens side by side
    w_t          [S, s, g Hi, 1]      f32     the weights w' (scale folded in), likewise
    keys_t       [Di, n_chunks, C]    16-bit  the keys transposed, C rows per chunk
    key_scale_t  [128, F]             f32     key_scale[128 j + p] at [p, j] (F = n_chunks C / 128)
    n_valid      [S, s g, 1]          f32     valid rows of each token
    chunk_ends   [1, S, s g]          int32   chunks holding a valid row of the token
    -> keys [S, s g, K] f32, idx [S, s g, K] int32, path [S, s g] int32 (0 all M ranked, 1 and
       ties broken, 2 fallback, 3 the list at the pivot ranked, 4 and ties within its blocks
       broken)

The programs of a launch split the spans. Where the tokens are fewer than the programs (a decode
step), two launches instead (``phase``): the programs split each token's chunks to score them and
find each share's candidates, then every program builds the same list from the staged keys and
candidates and ranks and places its share of the list's columns, so neither core reads every key
row or ranks every entry alone.
Nothing here needs the Neuron SDK to import.
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
# counts); a token that finds none ranks all M candidates (step 3). Past the first
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
    is their difference; module docstring, step 1). The group's tokens share each ``d`` matmul
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
    """The tiled kernel's exact merge over one token's keys in row order (module step 6)."""

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


def indexer_decode_kernel(q_t, w_t, keys_t, key_scale_t, n_valid, chunk_ends, staged_scores=None,
                          staged_candidates=None, *,
                          topk, depth, split=0, steps=None, on_vector=0, offload=None, signed=False,
                          phase="all"):  # fmt: skip
    """The row-spread selection (module docstring) of each of the program's tokens.

    Args: as the module docstring's interface; ``topk`` (K), ``depth`` (candidates per
    partition, a multiple of 8) and ``split`` (rank columns counted on GpSimd + ScalarE)
    compile-time ints, keyword arguments. Launch as ``kernel[n]`` with the spans ``S`` a multiple
    of ``n``; ``steps`` (``BISECT_STEPS`` where None; 0: no pivot) the pivot's halvings;
    ``on_vector`` the 512-row blocks per chunk whose head sums run on the VectorE; ``signed``
    the TensorE's head sums with the signed weights (``_score_chunk``); ``offload``
    the pivot list's rank passes (the last, narrowest, of the whole list's; or of the columns of
    the program's share) counted as GpSimd compares and ScalarE sums (None: half of them; the
    caller balances them, ``neuron.list_offload_columns``).
    A span's groups share each read of a chunk of keys (one DMA, scored by each group in turn).
    Returns ``(keys, idx, path)`` in shared HBM: the selection keys (descending, ``MARKER`` past the
    valid rows), their rows (-1 there), and each token's path (the interface's codes).

    ``phase`` splits the work over two launches where the tokens are fewer than the programs
    (a decode step). ``"score"``: the programs split each group's chunks (not the groups) and
    return ``(staged [S, g, 128, F], candidates [S, g, 128, n W])`` f32 (spans of one group; n
    programs): the selection keys (times key_scale, select_key applied; row ``128 j + p`` at
    ``[p, j]``) and step 2 on each program's share of the columns, ``W = 2 d + 1`` per program
    and partition: its ``d`` best keys, their rows and the best key left (``d``:
    :func:`share_depth`). ``"select"`` takes them as ``staged_scores`` and ``staged_candidates``
    (q, w and the keys are then read for their shapes only): every program takes the ``depth``
    best of the shares' candidates and runs steps 2 to 4 alike, ranks and places its share of
    the list's columns, and returns its own copy of the slots, ``keys [n S, s g, K]`` (copy ``i``
    at ``[i S, (i + 1) S)``; MARKER / -1 where another program placed the entry, so the result
    is their maximum, ``neuron.merge_copies``); program 0 alone takes step 3b and the fallback
    and writes ``path``. ``"all"`` does everything in one launch.
    """
    assert phase in ("all", "score", "select"), f"phase {phase!r}"
    assert (staged_scores is not None) == (staged_candidates is not None) == (phase == "select"), (
        "staged_scores and staged_candidates are the select phase's inputs")  # fmt: skip
    spans, span, dim, group_heads = q_t.shape
    slots = n_valid.shape[1]  # tokens per span: slot i g + m is member m of its group i
    group = slots // span  # tokens per group: 1, or 2 sharing the d matmuls
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
    columns, m = plan.columns, plan.candidates
    assert depth <= columns <= MAX8_ELEMENTS
    programs, program = nl.num_programs(), nl.program_id(0)
    assert span == 1 or phase == "all", f"a span of {span} groups in phase {phase!r}"
    assert phase != "all" or spans % programs == 0, (
        f"{spans} spans of token groups must be a multiple of the {programs} programs")  # fmt: skip
    per_program = spans // programs
    if phase == "all":
        program_spans = program * per_program
    else:  # every program takes every span: its share of their chunks, or of their list's ranks
        per_program, program_spans = spans, 0
    if phase == "score":
        assert n_chunks >= programs, f"{n_chunks} chunks for {programs} programs"
        chunk_lo, chunk_hi = program * n_chunks // programs, (program + 1) * n_chunks // programs

    # The selecting launch: one copy per program, each holding the slots it placed (MARKER / -1
    # elsewhere), so the caller takes their maximum: copy i's spans at [i S, (i + 1) S).
    copies = programs if phase == "select" else 1
    keys_out = nl.ndarray((copies * spans, slots, topk), dtype=nl.float32, buffer=nl.shared_hbm)
    idx_out = nl.ndarray((copies * spans, slots, topk), dtype=nl.int32, buffer=nl.shared_hbm)
    out_offset = program * spans * slots * topk if copies > 1 else 0  # this program's copy
    path_out = nl.ndarray((spans, slots), dtype=nl.int32, buffer=nl.shared_hbm)
    # The two-launch form's staging: each token's selection keys, and each program's share of
    # its candidates ([keys | rows | the best key left], depth_of_share of each per partition).
    shares = programs if phase != "all" else 1
    depth_of_share = share_depth(plan, shares)
    share_width = 2 * depth_of_share + 1
    staged_shape = (spans, slots, P, n_chunks * chunk_columns)
    candidates_shape = (spans, slots, P, shares * share_width)
    if phase == "score":
        staged_out = nl.ndarray(staged_shape, dtype=nl.float32, buffer=nl.shared_hbm)
        candidates_out = nl.ndarray(candidates_shape, dtype=nl.float32, buffer=nl.shared_hbm)
    elif phase == "select":
        assert tuple(staged_scores.shape) == staged_shape, f"staged_scores {staged_scores.shape}"
        assert tuple(staged_candidates.shape) == candidates_shape, (
            f"staged_candidates {staged_candidates.shape}")  # fmt: skip
        assert shares * depth_of_share >= depth
    # HBM staging: each token's scores by chunk, its candidates (the broadcast's source), and the
    # ranked selection before it goes to keys_out/idx_out.
    scores_hbm = [nl.ndarray((P, n_chunks, chunk_columns), dtype=nl.float32, buffer=nl.hbm)
                  for _ in range(slots)]  # fmt: skip
    cand_hbm = nl.ndarray((P, depth), dtype=nl.float32, buffer=nl.hbm)
    cap = plan.compact
    cap_cols = cap // P
    # The bisection's floor is the lowest of the partitions' floor_rank-th best keys: 128
    # floor_rank >= K, or (a short cache) every row.
    floor_rank = min(_ceil_div(topk, P), depth)
    # The list's columns this program ranks and places (the selecting launch's share); only
    # program 0 of that launch takes the rare paths (all M ranked, the fallback) and the codes.
    ranked_cols = (range(program * cap_cols // programs, (program + 1) * cap_cols // programs)
                   if phase == "select" else range(cap_cols))  # fmt: skip
    lead = phase != "select" or program == 0
    # Ranking the whole list (not a share of it), a program compares each pair of entries once.
    whole_list = phase != "select"
    # Step 4's list: keys, rows and ranks, one array each (contiguous for the broadcasts); the
    # keys between two runs of 128 MARKER (LIST_PAD), read whole (a program ranking the whole
    # list) or shifted by partition (a share of it) for the ranks.
    list_hbm = [nl.ndarray((cap + 2 * LIST_PAD * (f == 0), 1), dtype=nl.float32, buffer=nl.hbm)
                for f in range(3)]  # fmt: skip
    # The pivot list's (key, row) pairs: one scatter DMA per candidate column for both.
    list_pairs_hbm = nl.ndarray((cap, 2), dtype=nl.float32, buffer=nl.hbm)
    # The ranked selection as (key, row) pairs: one scatter DMA per column for both.
    ranked_pairs = nl.ndarray((topk, 2), dtype=nl.float32, buffer=nl.hbm)

    d_tiles = _ceil_div(dim, KERNEL_TILE)
    # Loop-carried state, allocated outside the loops (nki.language.fori_loop page).
    # Per group of the span: q, the weights, their magnitudes (the relu's scale), the head-sum
    # matmul's moving columns (each token's 0/1 columns of heads with w' >= 0 and the rest, or
    # with ``signed`` its weights), the weights on every partition (the VectorE's head sums).
    q_sbs = [nl.ndarray((KERNEL_TILE, d_tiles, group_heads), dtype=q_t.dtype, buffer=nl.sbuf)
             for _ in range(span)]  # fmt: skip
    w_sbs = [nl.ndarray((group_heads, 1), dtype=nl.float32, buffer=nl.sbuf) for _ in range(span)]
    w_abs = [nl.ndarray((group_heads, 1), dtype=nl.float32, buffer=nl.sbuf) for _ in range(span)]
    w_moving = [nl.ndarray((group_heads, 2 * group), dtype=nl.float32, buffer=nl.sbuf)
               for _ in range(span)]  # fmt: skip
    w_rows_all = [nl.ndarray((P, group_heads), dtype=nl.float32, buffer=nl.sbuf)
                  for _ in range(span)]  # fmt: skip
    assert 0 <= on_vector <= chunk // ROWS_PER_MATMUL, f"on_vector {on_vector}"
    keys_sb = nl.ndarray((KERNEL_TILE, d_tiles, chunk), dtype=keys_t.dtype, buffer=nl.sbuf)
    chunk_sb_all = nl.ndarray((P, group, chunk_columns), dtype=nl.float32, buffer=nl.sbuf)
    chunk_sbs = [chunk_sb_all[:, g, :] for g in range(group)]
    chunk_ps = nl.ndarray((P, 2 * group * chunk_columns), dtype=nl.float32, buffer=nl.psum)
    nan_mask = nl.ndarray((P, group, chunk_columns), dtype=nl.float32, buffer=nl.sbuf)
    nan_col = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nan_flag = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    keys_tile = nl.ndarray((P, columns), dtype=nl.float32, buffer=nl.sbuf)
    work = nl.ndarray((P, columns), dtype=nl.float32, buffer=nl.sbuf)
    nv_col = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    kv_col = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    end = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    ends = nl.ndarray((1, slots), dtype=nl.int32, buffer=nl.sbuf)
    ends_f = nl.ndarray((1, slots), dtype=nl.float32, buffer=nl.sbuf)
    end_f = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    sel = _selection_tiles(P, depth_of_share if phase == "score" else depth, True)
    # The shares' candidates: as staged (keys | rows | best left per share), then side by side.
    union = nl.ndarray((P, shares * share_width), dtype=nl.float32, buffer=nl.sbuf)
    union_keys = nl.ndarray((P, shares * depth_of_share), dtype=nl.float32, buffer=nl.sbuf)
    union_rows = nl.ndarray((P, shares * depth_of_share), dtype=nl.float32, buffer=nl.sbuf)
    left8 = nl.ndarray((P, SELECTED_PER_ROUND), dtype=nl.float32, buffer=nl.sbuf)
    partition = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    cand_pos = nl.ndarray((P, depth), dtype=nl.float32, buffer=nl.sbuf)
    cand_rows = nl.ndarray((P, depth), dtype=nl.float32, buffer=nl.sbuf)
    ranks = nl.ndarray((P, depth), dtype=nl.float32, buffer=nl.sbuf)
    chosen = nl.ndarray((P, depth), dtype=nl.float32, buffer=nl.sbuf)
    spare = nl.ndarray((P, depth), dtype=nl.float32, buffer=nl.sbuf)
    slot = nl.ndarray((P, depth), dtype=nl.float32, buffer=nl.sbuf)
    slot_u32 = nl.ndarray((P, depth), dtype=nl.uint32, buffer=nl.sbuf)
    column = nl.ndarray((P, depth), dtype=nl.float32, buffer=nl.sbuf)  # j
    place_u32 = nl.ndarray((P, depth), dtype=nl.uint32, buffer=nl.sbuf)
    before = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    lower = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)  # [k, i] = k < i
    # The list as [128, cap / 128] tiles (entry cap_cols p + c at [p, c], so each partition's
    # entries are one DMA run): keys, rows, ranks.
    listed = [nl.ndarray((P, cap_cols), dtype=nl.float32, buffer=nl.sbuf) for _ in range(3)]
    listed_gain = nl.ndarray((P, cap_cols), dtype=nl.float32, buffer=nl.sbuf)
    listed_slot = nl.ndarray((P, cap_cols), dtype=nl.uint32, buffer=nl.sbuf)
    listed_pairs = nl.ndarray((P, cap_cols, 2), dtype=nl.float32, buffer=nl.sbuf)
    # The list's blocks of 128 entries, one per partition: as pairs, then one field.
    blocks_pairs = nl.ndarray((cap_cols, 2 * P), dtype=nl.float32, buffer=nl.sbuf)
    blocks_field = nl.ndarray((cap_cols, P), dtype=nl.float32, buffer=nl.sbuf)
    # Wide enough for step 3b's M candidates and for step 3a's shifted list (cap + LIST_PAD).
    wide = max(m, cap + LIST_PAD)
    all_keys = nl.ndarray((P, wide), dtype=nl.float32, buffer=nl.sbuf)
    beaten = nl.ndarray((P, wide), dtype=nl.float32, buffer=nl.sbuf)
    beaten_alt = nl.ndarray((P, wide), dtype=nl.float32, buffer=nl.sbuf)
    # Step 4's broadcast list and its passes reuse step 3's tiles (cap <= M).
    list_keys, list_rows, equal = all_keys[:, 0:cap], beaten[:, 0:cap], beaten_alt[:, 0:cap]
    # Step 3a's shifted list (after build_list, which reads the broadcast) and its passes.
    shifted, shifted_scratch = all_keys[:, 0 : cap + LIST_PAD], beaten_alt[:, 0 : cap + LIST_PAD]
    # Step 3a's 0/1 compare tiles (exact in bf16): the shifted list's GpSimd passes, or every
    # pass over the whole list, two in turn (one feeds the TensorE's sums while the next fills).
    rank_cmp = [nl.ndarray((P, cap + LIST_PAD), dtype=nl.bfloat16, buffer=nl.sbuf)
                for _ in range(2)]  # fmt: skip
    # The whole list's ranks: 128 b for block b (its entries' count of earlier blocks' entries).
    block_base = nl.ndarray((P, cap_cols), dtype=nl.float32, buffer=nl.sbuf)
    list_pads = nl.ndarray((2, LIST_PAD), dtype=nl.float32, buffer=nl.sbuf)
    ones_row = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf)
    ones_col = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    left_col = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    longest = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)  # the most listed on a partition
    best_key = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)  # across_partitions
    stats = nl.ndarray((P, 2), dtype=nl.float32, buffer=nl.sbuf)
    totals = nl.ndarray((1, 2), dtype=nl.float32, buffer=nl.sbuf)
    flags = nl.ndarray((1, 5), dtype=nl.float32, buffer=nl.sbuf)
    kv_one = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)  # Kv
    kv_sum = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)  # Kv (Kv - 1) / 2
    path_f = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    fb_f = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    reg_i32 = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    # [128, 1] columns, equal on every partition: the bound, the bisection, the counts.
    bound, window, lo, hi, mid, half, count_col, total_col = (
        nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf) for _ in range(8))
    below_u8 = nl.ndarray((P, 1), dtype=nl.uint8, buffer=nl.sbuf)
    above_u8 = nl.ndarray((P, 1), dtype=nl.uint8, buffer=nl.sbuf)
    ones_pp = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
    in_list = nl.ndarray((P, depth), dtype=nl.float32, buffer=nl.sbuf)
    chosen_work = nl.ndarray((P, depth), dtype=nl.float32, buffer=nl.sbuf)
    rank_before = nl.ndarray((P, cap_cols), dtype=nl.float32, buffer=nl.sbuf)
    # Step 3a's row-order places: the [128, F] grid of rows at or above the pivot, in blocks of
    # up to 512 columns (one matmul each) through HBM, so that a hardware loop takes them.
    grid_block = min(ROWS_PER_MATMUL, columns)
    grid_blocks = _ceil_div(columns, grid_block)
    grid_width = grid_blocks * grid_block
    # The grid's work blocks, in step 3b's broadcast (free before the list is built; M >= 1024).
    running_block, places_block = all_keys[:, 0:grid_block], all_keys[:, grid_block : 2 * grid_block]
    grid_hbm = nl.ndarray((P, grid_blocks, grid_block), dtype=nl.bfloat16, buffer=nl.hbm)
    places_hbm = nl.ndarray((P, grid_blocks, grid_block), dtype=nl.float32, buffer=nl.hbm)
    grid_mask = nl.ndarray((P, grid_width), dtype=nl.bfloat16, buffer=nl.sbuf)
    mask_block = nl.ndarray((P, grid_block), dtype=nl.bfloat16, buffer=nl.sbuf)
    carry = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    above_ps = nl.ndarray((P, grid_block), dtype=nl.float32, buffer=nl.psum)
    column_sums_ps = nl.ndarray((P, grid_block), dtype=nl.float32, buffer=nl.psum)
    # The whole list's ranks (after the grid): earlier entries beaten, ties within a block.
    beats_ps, ties_ps = above_ps[:, 0:cap_cols], column_sums_ps[:, 0:cap_cols]
    lower_bf = nl.ndarray((P, P), dtype=nl.bfloat16, buffer=nl.sbuf)  # [k, i] = k < i
    ones_bf = nl.ndarray((P, P), dtype=nl.bfloat16, buffer=nl.sbuf)
    cand_pos_u32 = nl.ndarray((P, depth), dtype=nl.uint32, buffer=nl.sbuf)
    cand_pairs = nl.ndarray((P, depth, 2), dtype=nl.float32, buffer=nl.sbuf)
    empty_pairs = nl.ndarray((P, 2 * cap_cols), dtype=nl.float32, buffer=nl.sbuf)
    column_ps = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.psum)
    row_ps = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.psum)
    totals_ps = nl.ndarray((1, 2), dtype=nl.float32, buffer=nl.psum)
    chunk_nan_ps = totals_ps[:, 0:1]  # the scoring's NaN count (PSUM holds 8 banks)
    # The slots' fill, spread over the partitions (a memset costs its elements per partition):
    # ``fill_rows_n`` rows of ``fill_cols``, then a row of ``fill_tail``.
    fill_cols = _ceil_div(topk, P)
    fill_rows_n, fill_tail = divmod(topk, fill_cols)
    fill_pairs = nl.ndarray((P, 2 * fill_cols), dtype=nl.float32, buffer=nl.sbuf)
    out_pairs = nl.ndarray((P, 2 * fill_cols), dtype=nl.float32, buffer=nl.sbuf)
    out_keys = nl.ndarray((P, fill_cols), dtype=nl.float32, buffer=nl.sbuf)
    out_rows = nl.ndarray((P, fill_cols), dtype=nl.int32, buffer=nl.sbuf)
    fb = _fallback_tiles(plan)

    nisa.memset(dst=ones_col, value=1.0)
    nisa.iota(dst=partition, pattern=[[0, 1]], offset=0, channel_multiplier=1)
    if phase != "score":  # the selection's constants
        nisa.memset(dst=ones_row, value=1.0)
        nisa.memset(dst=ones_pp, value=1.0)
        nisa.iota(dst=column, pattern=[[1, depth]], offset=0)
        nisa.iota(dst=lower, pattern=[[1, P]], offset=0, channel_multiplier=-1)  # i - k
        nisa.tensor_scalar(dst=lower, data=lower, op0=nl.greater, operand0=0.0)
        nisa.memset(dst=fill_pairs[:, 0::2], value=MARKER)
        nisa.memset(dst=fill_pairs[:, 1::2], value=-1.0)
        nisa.memset(dst=out_pairs, value=0.0)  # past the slots' blocks: read, never written out
        nisa.tensor_copy(dst=lower_bf, src=lower)
        nisa.iota(dst=block_base, pattern=[[P, cap_cols]], offset=0)
        nisa.memset(dst=ones_bf, value=1.0)
        nisa.memset(dst=empty_pairs[:, 0::2], value=MARKER)
        nisa.memset(dst=empty_pairs[:, 1::2], value=-1.0)
        nisa.memset(dst=list_pads, value=MARKER)
        nisa.dma_copy(dst=list_hbm[0].ap(pattern=[[LIST_PAD + cap, 2], [1, LIST_PAD]], offset=0),
                      src=list_pads)  # fmt: skip
        if grid_width > columns:  # the columns past F stay 0
            nisa.memset(dst=grid_mask[:, columns:grid_width], value=0.0)
    if phase != "select":
        # Chunks past a token's last valid row are never scored: they hold zeros (or an earlier
        # token's scores) in HBM, and select_key turns those rows into MARKER. The scoring
        # launch's programs each fill their own chunks.
        own_first, own_width = (chunk_lo * chunk_columns, (chunk_hi - chunk_lo) * chunk_columns) if (
            phase == "score") else (0, columns)  # fmt: skip
        nisa.memset(dst=keys_tile[:, 0:own_width], value=0.0)
        for staged in scores_hbm:
            nisa.dma_copy(dst=staged.ap(pattern=[[columns, P], [1, own_width]], offset=own_first),
                          src=keys_tile[:, 0:own_width])  # fmt: skip

    def one_chunk(c):
        for dc, d0, dw in _d_chunks(dim):
            nisa.dma_copy(dst=keys_sb[0:dw, dc, :], src=keys_t.ap(
                pattern=[[n_chunks * chunk, dw], [1, chunk]], offset=d0 * n_chunks * chunk,
                scalar_offset=c, indirect_dim=1))  # fmt: skip
        for i in range(span):
            score_chunk_of_group(i, c)

    def score_chunk_of_group(i, c):
        tiles = (q_sbs[i], w_sbs[i], w_abs[i], w_moving[i], w_rows_all[i], keys_sb, chunk_ps,
                 on_vector)  # fmt: skip
        _score_chunk(plan, *tiles, False, signed)
        # The columns whose first sums are whole (the VectorE's, or all with the signed
        # weights); the rest are the matmuls' sign pairs. NaN counted from ``checked`` on.
        whole = chunk_columns if signed else on_vector * (ROWS_PER_MATMUL // P)
        checked = 0 if signed else whole

        def scores_out():
            step = 2 * group
            for g, chunk_sb in enumerate(chunk_sbs):
                if whole:
                    nisa.tensor_copy(dst=chunk_sb[:, 0:whole],
                                     src=chunk_ps[:, 2 * g : step * whole : step])  # fmt: skip
                if whole < chunk_columns:
                    # score = (heads with w' >= 0) - (the rest); tensor_tensor reads at most
                    # one operand from PSUM (its page), so the second goes through SBUF.
                    rest = chunk_sb[:, whole:chunk_columns]
                    nisa.tensor_copy(dst=rest, src=chunk_ps[:, step * whole + 2 * g + 1 :: step])
                    nisa.tensor_tensor(dst=rest, data1=chunk_ps[:, step * whole + 2 * g :: step],
                                       data2=rest, op=nl.subtract)  # fmt: skip

        def exact_again(_):
            nisa.memset(dst=chunk_ps[:, 1::2], value=0.0)  # the pairs' second columns
            _score_chunk(plan, *tiles, True, signed)
            scores_out()

        scores_out()
        # (One token's signed head sums are the exact form already.)
        if checked < chunk_columns and not (signed and group == 1):
            # A NaN among the matmuls' scores (a 0 * inf of a pair's head sums, a non-finite
            # weight, a -inf d of a zero weight, inf - inf): the chunk again in the exact form
            # (0 or 1 trips), which gives the contract's scores. x >= -inf holds for every
            # number, not for NaN: the group's scores, counted.
            counted = chunk_sb_all[:, :, checked:chunk_columns]
            nisa.tensor_scalar_reduce(dst=nan_mask[:, :, checked:chunk_columns], data=counted,
                                      op0=nl.greater_equal, operand0=-math.inf, reduce_op=nl.add,
                                      reduce_res=nan_col,
                                      reduce_cmd=nisa.reduce_cmd.reset_reduce)  # fmt: skip
            nisa.nc_matmul(dst=chunk_nan_ps, stationary=ones_col, moving=nan_col, accumulate=False)
            nisa.tensor_scalar(dst=nan_flag, data=chunk_nan_ps, op0=nl.less,
                               operand0=float(P * group * (chunk_columns - checked)))  # fmt: skip
            nl.fori_loop(0, load_register(nan_flag), exact_again)
        for staged, chunk_sb in zip(scores_hbm[i * group : (i + 1) * group], chunk_sbs):
            nisa.dma_copy(dst=staged.ap(pattern=[[columns, P], [1, chunk_columns]], offset=0,
                                        scalar_offset=c, indirect_dim=1), src=chunk_sb)  # fmt: skip

    def count_ranks(out, data, keys, on_gpsimd: int, scratch, scratch_gpsimd, shifted_by=None,
                    columns=None):
        # out[:, c] = #(data > keys[:, c]): a VectorE compare-and-count pass per column, the last
        # ``on_gpsimd`` columns as a GpSimd compare and a ScalarE sum (the engines share passes).
        # ``shifted_by`` (step 3a: partition p's data is the list from entry p - shifted_by on,
        # column c its entries 128 c + p): the columns before the entry's own count at ``>=``
        # (lower rows win ties), so the ranks follow the contract's order, exact ties included;
        # the two counts of a VectorE column are summed after.
        # ``columns``: those of keys / out counted (all where None).
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
                                              reduce_res=(out if n == 0 else rank_before)[:, c : c + 1],
                                              reduce_cmd=nisa.reduce_cmd.reset_reduce)  # fmt: skip
                if first:
                    nisa.tensor_tensor(dst=out[:, c : c + 1], data1=out[:, c : c + 1],
                                       data2=rank_before[:, c : c + 1], op=nl.add)  # fmt: skip
                continue
            for part, op in parts:
                nisa.tensor_scalar(dst=scratch_gpsimd[:, part], data=data[:, part], op0=op,
                                   operand0=key, engine=nisa.engine.gpsimd)
            nisa.activation(dst=scratch_gpsimd, op=nl.copy, data=scratch_gpsimd, reduce_op=nl.add,
                            reduce_res=out[:, c : c + 1], reduce_cmd=nisa.reduce_cmd.reset_reduce)

    def scatter_to_slots(slots_u32, pairs_src):
        # Column c's (key, row) pairs to ranked_pairs rows slots_u32[:, c] (past: skipped).
        for c in range(slots_u32.shape[1]):
            nisa.dma_copy(dst=ranked_pairs.ap(pattern=[[2, P], [1, 2]], offset=0,
                                              vector_offset=slots_u32[:, c : c + 1], indirect_dim=0),
                          src=pairs_src[:, c, :], oob_mode=nisa.oob_mode.skip)  # fmt: skip

    def choose(out, ranks_tile, keys_tile, scratch):
        # out = (rank < Kv) * (a real row's key).
        nisa.tensor_scalar(dst=out, data=ranks_tile, op0=nl.less, operand0=kv_col)
        nisa.tensor_scalar(dst=scratch, data=keys_tile, op0=nl.greater, operand0=MARKER)
        nisa.tensor_tensor(dst=out, data1=out, data2=scratch, op=nl.multiply)

    def build_list(mask, counts, with_ranks: bool, placed: bool = False):
        """Step 4's list: the candidates where ``mask`` (a prefix of each partition's, ``counts``
        per partition) at distinct places, the chosen of the partitions before plus the column
        (a prefix sum by matmul), or (``placed``) at the places already in ``place_u32``; keys,
        rows and (``with_ranks``) ranks, then the broadcasts. The ``listed`` tiles hold entry
        ``128 c + p`` at ``[p, c]``, so a column is a block of 128 consecutive entries."""
        if not placed:
            nisa.nc_matmul(dst=column_ps, stationary=lower, moving=counts, accumulate=False)
            nisa.tensor_copy(dst=before, src=column_ps)
            nisa.tensor_scalar(dst=spare, data=mask, op0=nl.multiply, operand0=-float(2 * cap),
                               op1=nl.add, operand1=float(2 * cap))  # fmt: skip
            nisa.scalar_tensor_tensor(dst=spare, data=column, op0=nl.add, operand0=before,
                                      op1=nl.add, operand1=spare)  # fmt: skip
            nisa.tensor_copy(dst=place_u32, src=spare)
        # The list starts empty: MARKER keys, row -1 (the pairs' fill), a rank past the slots.
        # Keys and rows go as pairs, one scatter per candidate column (each scatter DMA pays its
        # descriptors on the GpSimd).
        nisa.dma_copy(dst=list_pairs_hbm.ap(pattern=[[2 * cap_cols, P], [1, 2 * cap_cols]],
                                            offset=0), src=empty_pairs)  # fmt: skip

        def scatter_columns(first, stop):
            for j in range(first, stop):
                nisa.dma_copy(dst=list_pairs_hbm.ap(pattern=[[2, P], [1, 2]], offset=0,
                                                    vector_offset=place_u32[:, j : j + 1],
                                                    indirect_dim=0),
                              src=cand_pairs[:, j, :], oob_mode=nisa.oob_mode.skip)  # fmt: skip

        # A partition's listed candidates are a prefix of its best (descending), ``counts`` long:
        # columns from ``scattered`` on hold one only where some partition lists more (a 0-or-1
        # trip loop), so most tokens skip their scatters' descriptors.
        scattered = scattered_columns(plan)
        scatter_columns(0, scattered)
        if scattered < depth:
            nisa.nc_transpose(dst=row_ps, data=counts)
            nisa.tensor_reduce(dst=longest, op=nl.max, data=row_ps, axis=1, keepdims=True)
            nisa.tensor_scalar(dst=longest, data=longest, op0=nl.greater, operand0=float(scattered))
            nl.fori_loop(0, load_register(longest), lambda _: scatter_columns(scattered, depth))
        # The pairs of each block of 128 entries on a partition (a run each), apart on chip, the
        # keys contiguous in HBM (the broadcasts' source), and each field by column (a transpose
        # of its blocks: entry 128 c + p at [p, c]).
        by_block = [[2 * P, cap_cols], [1, 2 * P]]
        nisa.dma_copy(dst=blocks_pairs, src=list_pairs_hbm.ap(pattern=by_block, offset=0))
        for f, hbm in enumerate(list_hbm[0:2]):
            nisa.activation(dst=blocks_field, op=nl.copy, data=blocks_pairs[:, f::2])
            nisa.dma_copy(dst=hbm.ap(pattern=[[P, cap_cols], [1, P]], offset=LIST_PAD * (f == 0)),
                          src=blocks_field)  # fmt: skip
            nisa.nc_transpose(dst=above_ps[:, 0:cap_cols], data=blocks_field)
            nisa.tensor_copy(dst=listed[f], src=above_ps[:, 0:cap_cols])
        if with_ranks:  # no broadcast to take them from: scattered, then read by column
            rank_hbm = list_hbm[2]
            nisa.memset(dst=listed[2], value=float(2 * cap + topk))
            nisa.dma_copy(dst=rank_hbm.ap(pattern=[[cap_cols, P], [1, cap_cols]], offset=0),
                          src=listed[2])  # fmt: skip
            for j in range(depth):
                nisa.dma_copy(dst=rank_hbm.ap(pattern=[[1, P], [1, 1]], offset=0,
                                              vector_offset=place_u32[:, j : j + 1], indirect_dim=0),
                              src=ranks[:, j : j + 1], oob_mode=nisa.oob_mode.skip)  # fmt: skip
            nisa.dma_copy(dst=listed[2], src=rank_hbm.ap(pattern=[[1, P], [P, cap_cols]], offset=0))
            # Step 4's tie break compares every entry with all of them: the broadcasts.
            nisa.dma_copy(dst=list_keys, src=list_hbm[0].ap(pattern=[[0, P], [1, cap]],
                                                            offset=LIST_PAD))  # fmt: skip
            nisa.dma_copy(dst=list_rows, src=list_hbm[1].ap(pattern=[[0, P], [1, cap]], offset=0))

    def row_order_places():
        """``place_u32``: each listed candidate's place in row order (the number of rows at or
        above the pivot before its row), ``2 cap`` (skipped) for the others. Row ``128 j + p``
        comes after the rows of columns ``< j`` (a running sum of the grid's column counts) and
        after those of its column on partitions ``< p`` (a matmul with ``lower``)."""
        nisa.tensor_scalar(dst=grid_mask[:, 0:columns], data=keys_tile, op0=nl.greater_equal,
                           operand0=mid)  # fmt: skip
        grid = [[grid_width, P], [1, grid_block]]
        nisa.dma_copy(dst=grid_hbm.ap(pattern=[[grid_width, P], [1, grid_width]], offset=0),
                      src=grid_mask)  # fmt: skip
        nisa.memset(dst=carry, value=0.0)

        def one_block(b):
            nisa.dma_copy(dst=mask_block, src=grid_hbm.ap(pattern=grid, offset=0, scalar_offset=b,
                                                          indirect_dim=1))  # fmt: skip
            nisa.nc_matmul(dst=above_ps, stationary=lower_bf, moving=mask_block, accumulate=False)
            nisa.nc_matmul(dst=column_sums_ps, stationary=ones_bf, moving=mask_block,
                           accumulate=False)  # fmt: skip
            # A running sum of the column counts: max(count + sum so far, mask) is the sum, since
            # a marked cell's column counts at least 1 (a [128, 512] zero tile, spared).
            nisa.tensor_tensor_scan(dst=running_block, data0=column_sums_ps, data1=mask_block,
                                    initial=carry, op0=nl.add, op1=nl.maximum)  # fmt: skip
            nisa.tensor_copy(dst=carry, src=running_block[:, grid_block - 1 : grid_block])
            nisa.tensor_tensor(dst=places_block, data1=running_block, data2=column_sums_ps,
                               op=nl.subtract)  # fmt: skip
            nisa.tensor_tensor(dst=places_block, data1=places_block, data2=above_ps, op=nl.add)
            nisa.dma_copy(dst=places_hbm.ap(pattern=grid, offset=0, scalar_offset=b,
                                            indirect_dim=1), src=places_block)  # fmt: skip

        nl.fori_loop(0, grid_blocks, one_block)
        nisa.dma_copy(dst=work, src=places_hbm.ap(pattern=[[grid_width, P], [1, columns]], offset=0))
        nisa.nc_n_gather(dst=slot, data=work, indices=cand_pos_u32)
        nisa.scalar_tensor_tensor(dst=spare, data=slot, op0=nl.subtract, operand0=float(2 * cap),
                                  op1=nl.multiply, operand1=in_list)  # fmt: skip
        nisa.tensor_scalar(dst=spare, data=spare, op0=nl.add, operand0=float(2 * cap))
        nisa.tensor_copy(dst=place_u32, src=spare)

    def break_ties(_):
        # rank += #(entries with an equal key and a lower row): the contract's order.
        for c in range(cap_cols):
            nisa.tensor_scalar(dst=equal, data=list_keys, op0=nl.equal,
                               operand0=listed[0][:, c : c + 1], engine=nisa.engine.gpsimd)
            nisa.scalar_tensor_tensor(dst=equal, data=list_rows, op0=nl.less,
                                      operand0=listed[1][:, c : c + 1], op1=nl.multiply,
                                      operand1=equal)  # fmt: skip
            nisa.activation(dst=equal, op=nl.copy, data=equal, reduce_op=nl.add,
                            reduce_res=listed_gain[:, c : c + 1],
                            reduce_cmd=nisa.reduce_cmd.reset_reduce)  # fmt: skip
        nisa.tensor_tensor(dst=listed[2], data1=listed[2], data2=listed_gain, op=nl.add)

    def place_list(cols=range(cap_cols)):
        # Step 5 from the list's ``cols``: slot = rank (an empty entry past every slot; past topk:
        # skipped).
        cols = slice(cols.start, cols.stop)
        gain, slot_u32, pairs = listed_gain[:, cols], listed_slot[:, cols], listed_pairs[:, cols, :]
        nisa.tensor_scalar(dst=gain, data=listed[0][:, cols], op0=nl.greater, operand0=MARKER)
        nisa.tensor_scalar(dst=gain, data=gain, op0=nl.multiply, operand0=-float(2 * cap + topk),
                           op1=nl.add, operand1=float(2 * cap + topk))  # fmt: skip
        nisa.tensor_tensor(dst=gain, data1=gain, data2=listed[2][:, cols], op=nl.add)
        nisa.tensor_copy(dst=slot_u32, src=gain)
        nisa.tensor_copy(dst=pairs[:, :, 0], src=listed[0][:, cols])
        nisa.tensor_copy(dst=pairs[:, :, 1], src=listed[1][:, cols])
        scatter_to_slots(slot_u32, pairs)

    def tie_free(chosen_tile, ranks_tile):
        """1.0 in ``flags[:, 0:1]`` where the chosen ranks are exactly 0 .. Kv-1 (count Kv, sum
        Kv (Kv - 1) / 2), and in ``flags[:, 3:4]`` where not; ``flags[:, 1:2]``: the chosen
        count."""
        nisa.tensor_reduce(dst=stats[:, 0:1], op=nl.add, data=chosen_tile, axis=1, keepdims=True)
        nisa.tensor_tensor(dst=chosen_tile, data1=chosen_tile, data2=ranks_tile, op=nl.multiply)
        nisa.tensor_reduce(dst=stats[:, 1:2], op=nl.add, data=chosen_tile, axis=1, keepdims=True)
        nisa.nc_matmul(dst=totals_ps, stationary=ones_col, moving=stats, accumulate=False)
        nisa.tensor_copy(dst=totals, src=totals_ps)
        nisa.tensor_tensor(dst=flags[:, 0:1], data1=totals[:, 0:1], data2=kv_one, op=nl.equal)
        nisa.tensor_tensor(dst=flags[:, 2:3], data1=totals[:, 1:2], data2=kv_sum, op=nl.equal)
        nisa.tensor_tensor(dst=flags[:, 0:1], data1=flags[:, 0:1], data2=flags[:, 2:3],
                           op=nl.multiply)  # fmt: skip
        nisa.tensor_copy(dst=flags[:, 1:2], src=totals[:, 0:1])
        nisa.tensor_scalar(dst=flags[:, 3:4], data=flags[:, 0:1], op0=nl.multiply, operand0=-1.0,
                           op1=nl.add, operand1=1.0)  # fmt: skip

    def across_partitions(col, op):
        # col [128, 1] becomes ``op`` of its partitions, on every partition: a transpose, a
        # reduce, and a broadcast by matmul with a row of ones.
        nisa.nc_transpose(dst=row_ps, data=col)
        nisa.tensor_reduce(dst=best_key, op=op, data=row_ps, axis=1, keepdims=True)
        nisa.nc_matmul(dst=column_ps, stationary=ones_row, moving=best_key, accumulate=False)
        nisa.tensor_copy(dst=col, src=column_ps)

    def load_register(value):
        nisa.tensor_copy(dst=reg_i32, src=value)
        reg = nisa.register_alloc(None)
        nisa.register_load(reg, reg_i32)
        return reg

    def list_path(_):
        # Steps 4-5 for the candidates at or above the pivot: ranked within the list alone.
        nisa.tensor_scalar(dst=in_list, data=sel.best_keys, op0=nl.greater_equal, operand0=mid)
        row_order_places()
        build_list(in_list, count_col, with_ranks=False, placed=True)
        if whole_list:
            # Every partition holds the list; each pair of blocks is compared once.
            nisa.dma_copy(dst=list_keys, src=list_hbm[0].ap(pattern=[[0, P], [1, cap]],
                                                            offset=LIST_PAD))  # fmt: skip
            on_gpsimd = cap_cols // 2 if offload is None else min(offload, cap_cols)
            count_ranks_paired(on_gpsimd)
            nisa.memset(dst=path_f, value=3.0)
            # Ties within a block leave the later entry one short: the check, then the fix.
            choose(listed_gain, listed[2], listed[0], rank_before)
            tie_free(listed_gain, listed[2])
            nl.fori_loop(0, load_register(flags[:, 3:4]), break_block_ties)
        else:
            # The list shifted by partition (partition p from entry p - LIST_PAD on): a column's
            # entries all sit at one column of it, so >= before and > from there ranks them in
            # the contract's order, exact ties by row, with no tie pass. The runs overlap in HBM
            # (a partition stride of 1, as the broadcasts' 0: nki-aps page, [stride, size] per
            # dimension; overlapping reads inferred).
            nisa.dma_copy(dst=shifted, src=list_hbm[0].ap(pattern=[[1, P], [1, cap + LIST_PAD]],
                                                          offset=0))  # fmt: skip
            on_gpsimd = (len(ranked_cols) // 2 if offload is None
                         else min(offload, len(ranked_cols)))  # fmt: skip
            count_ranks(listed[2], shifted, listed[0], on_gpsimd, shifted_scratch, rank_cmp[1],
                        shifted_by=LIST_PAD, columns=ranked_cols)  # fmt: skip
            nisa.memset(dst=path_f, value=3.0)
        place_list(ranked_cols)

    def count_ranks_paired(on_gpsimd: int):
        """``listed[2]``: the rank of each entry of the whole list, from one compare per pair
        of entries. Block ``c``'s pass compares its entries (one per partition) with every entry
        from ``128 c`` on: its count is theirs strictly above (its own block's included), and
        its 0/1 tile, summed over the partitions by a matmul per later block, counts for each
        later entry the entries of block ``c`` it beats strictly; the other ``128`` minus
        those beat it (an equal key at a lower row wins). The last ``on_gpsimd`` blocks (the
        narrowest) are GpSimd compares and ScalarE sums. A tie within a block is left out."""
        for c in range(cap_cols):
            beaten_by = rank_cmp[c % 2][:, 0 : cap - c * P]
            key = listed[0][:, c : c + 1]
            if c < cap_cols - on_gpsimd:
                nisa.tensor_scalar_reduce(dst=beaten_by, data=list_keys[:, c * P : cap],
                                          op0=nl.greater, operand0=key, reduce_op=nl.add,
                                          reduce_res=listed[2][:, c : c + 1],
                                          reduce_cmd=nisa.reduce_cmd.reset_reduce)  # fmt: skip
            else:
                nisa.tensor_scalar(dst=beaten_by, data=list_keys[:, c * P : cap], op0=nl.greater,
                                   operand0=key, engine=nisa.engine.gpsimd)  # fmt: skip
                nisa.activation(dst=beaten_by, op=nl.copy, data=beaten_by, reduce_op=nl.add,
                                reduce_res=listed[2][:, c : c + 1],
                                reduce_cmd=nisa.reduce_cmd.reset_reduce)  # fmt: skip
            for b in range(c + 1, cap_cols):
                nisa.nc_matmul(dst=beats_ps[:, b : b + 1],
                               stationary=beaten_by[:, (b - c) * P : (b - c + 1) * P],
                               moving=ones_bf[:, 0:1], accumulate=c > 0)  # fmt: skip
        if cap_cols > 1:  # rank += 128 b - (earlier entries beaten)
            later = slice(1, cap_cols)
            nisa.tensor_tensor(dst=rank_before[:, later], data1=block_base[:, later],
                               data2=beats_ps[:, later], op=nl.subtract)  # fmt: skip
            nisa.tensor_tensor(dst=listed[2][:, later], data1=listed[2][:, later],
                               data2=rank_before[:, later], op=nl.add)  # fmt: skip

    def break_block_ties(_):
        # rank += #(entries of its block with an equal key and a lower row): [p, q] is
        # key_q == key_p with p < q (``lower``), summed over the partitions p.
        for c in range(cap_cols):
            tied = rank_cmp[c % 2][:, 0:P]
            nisa.scalar_tensor_tensor(dst=tied, data=list_keys[:, c * P : (c + 1) * P],
                                      op0=nl.equal, operand0=listed[0][:, c : c + 1],
                                      op1=nl.multiply, operand1=lower)  # fmt: skip
            nisa.nc_matmul(dst=ties_ps[:, c : c + 1], stationary=tied, moving=ones_bf[:, 0:1],
                           accumulate=False)  # fmt: skip
        nisa.tensor_tensor(dst=listed[2], data1=ties_ps, data2=listed[2], op=nl.add)
        nisa.memset(dst=path_f, value=4.0)

    def tie_list(_):
        build_list(chosen, stats[:, 0:1], with_ranks=True)
        break_ties(0)
        place_list()

    def full_path(_):
        # Step 3: every candidate's rank among all M (strictly greater keys).
        nisa.dma_copy(dst=cand_hbm, src=sel.best_keys)
        nisa.dma_copy(dst=all_keys[:, 0:m], src=cand_hbm.ap(pattern=[[0, P], [1, m]], offset=0))
        count_ranks(ranks, all_keys[:, 0:m], sel.best_keys, split, beaten[:, 0:m],
                    beaten_alt[:, 0:m])  # fmt: skip
        choose(chosen, ranks, sel.best_keys, spare)
        nisa.tensor_copy(dst=chosen_work, src=chosen)
        tie_free(chosen_work, ranks)
        # flags: 0 tie free; 3 tied, 4 the chosen fit the list; tied and fitting: break the
        # ties in the list; tied and not: fall back.
        nisa.tensor_scalar(dst=flags[:, 4:5], data=flags[:, 1:2], op0=nl.less_equal,
                           operand0=float(cap))  # fmt: skip
        nisa.tensor_tensor(dst=flags[:, 4:5], data1=flags[:, 3:4], data2=flags[:, 4:5],
                           op=nl.multiply)  # fmt: skip
        nisa.tensor_tensor(dst=fb_f, data1=flags[:, 3:4], data2=flags[:, 4:5], op=nl.subtract)
        nisa.scalar_tensor_tensor(dst=path_f, data=fb_f, op0=nl.multiply, operand0=2.0,
                                  op1=nl.add, operand1=flags[:, 4:5])  # fmt: skip
        nl.fori_loop(0, load_register(flags[:, 0:1]), place)
        nl.fori_loop(0, load_register(flags[:, 4:5]), tie_list)

    def place(_):
        # Slot = rank where chosen, else past the topk rows (skipped): (1 - chosen) * K + rank.
        nisa.tensor_scalar(dst=slot, data=chosen, op0=nl.multiply, operand0=-float(topk),
                           op1=nl.add, operand1=float(topk))  # fmt: skip
        nisa.tensor_tensor(dst=slot, data1=slot, data2=ranks, op=nl.add)
        nisa.tensor_copy(dst=slot_u32, src=slot)
        scatter_to_slots(slot_u32, cand_pairs)

    def count_above(op, value):
        # count_col: each partition's candidates ``op`` value; total_col: all of them, everywhere.
        nisa.tensor_scalar_reduce(dst=spare, data=sel.best_keys, op0=op, operand0=value,
                                  reduce_op=nl.add, reduce_res=count_col,
                                  reduce_cmd=nisa.reduce_cmd.reset_reduce)  # fmt: skip
        nisa.nc_matmul(dst=column_ps, stationary=ones_pp, moving=count_col, accumulate=False)
        nisa.tensor_copy(dst=total_col, src=column_ps)

    def one_span(t):
        if phase != "select":
            score_span(t)
        if phase == "score":
            # The program's chunks of each token as selection keys (scored, or zeros / an
            # earlier group's scores past the group's last valid row, which select_key turns
            # into MARKER), so that the selecting launch's programs need not each redo them.
            first, width = chunk_lo * chunk_columns, (chunk_hi - chunk_lo) * chunk_columns
            region = [[columns, P], [1, width]]
            for member in range(group):
                own_keys, own_work = keys_tile[:, 0:width], work[:, 0:width]
                load_valid_rows(t, member)
                nisa.dma_copy(dst=own_keys, src=scores_hbm[member].ap(pattern=region, offset=first))
                selection_keys(own_keys, own_work, first)
                nisa.dma_copy(dst=staged_out.ap(pattern=region, offset=member * P * columns + first,
                                                scalar_offset=t, indirect_dim=0),
                              src=own_keys)  # fmt: skip
                # Step 2 on the program's share: its best depth_of_share per partition (rows
                # 128 (first + pos) + p) and the best key left in it.
                positions = extract_best(own_keys, sel, depth_of_share)
                keys_part = union[:, 0:depth_of_share]
                rows_part = union[:, depth_of_share : 2 * depth_of_share]
                nisa.tensor_copy(dst=keys_part, src=sel.best_keys)
                nisa.tensor_copy(dst=rows_part, src=positions, engine=nisa.engine.gpsimd)
                nisa.tensor_scalar(dst=rows_part, data=rows_part, op0=nl.add, operand0=float(first),
                                   op1=nl.multiply, operand1=float(P),
                                   engine=nisa.engine.gpsimd)  # fmt: skip
                nisa.tensor_scalar(dst=rows_part, data=rows_part, op0=nl.add, operand0=partition,
                                   engine=nisa.engine.gpsimd)  # fmt: skip
                nisa.max8(dst=left8, src=own_keys)
                nisa.tensor_copy(dst=union[:, 2 * depth_of_share : share_width], src=left8[:, 0:1])
                nisa.dma_copy(dst=candidates_out.ap(
                    pattern=[[shares * share_width, P], [1, share_width]],
                    offset=member * P * shares * share_width + program * share_width,
                    scalar_offset=t, indirect_dim=0), src=union[:, 0:share_width])  # fmt: skip
            return
        for slot in range(slots):
            select_token(t, slot)

    def score_span(t):
        # Step 1 for the span's tokens together, up to the last chunk any of them needs.
        for i in range(span):
            first = i * dim * group_heads
            for dc, d0, dw in _d_chunks(dim):
                nisa.dma_copy(dst=q_sbs[i][0:dw, dc, :], src=_tile_block(
                    q_t, t, dw, group_heads, first + d0 * group_heads))  # fmt: skip
            nisa.dma_copy(dst=w_sbs[i], src=_tile_block(w_t, t, group_heads, 1, i * group_heads))
            # |w'| = max(-w', w'), then NaN where w' is not finite (|w'| - |w'| is NaN there,
            # 0 elsewhere), so that its chunks take the exact form. Each token's 0/1 columns:
            # w' >= 0, then the rest (NaN among them); zeros on the other token's heads. Signed:
            # the token's weights in its first column instead, no |w'|.
            if not signed:
                nisa.tensor_scalar(dst=w_abs[i], data=w_sbs[i], op0=nl.multiply, operand0=-1.0,
                                   op1=nl.maximum, operand1=w_sbs[i])  # fmt: skip
                nisa.tensor_scalar(dst=w_abs[i], data=w_abs[i], op0=nl.subtract,
                                   operand0=w_abs[i], op1=nl.add, operand1=w_abs[i])  # fmt: skip
            nisa.memset(dst=w_moving[i], value=0.0)
            for m in range(group):
                heads_m = slice(m * heads, (m + 1) * heads)
                plus = w_moving[i][heads_m, 2 * m : 2 * m + 1]
                if signed:
                    nisa.tensor_copy(dst=plus, src=w_sbs[i][heads_m, :])
                    continue
                nisa.tensor_scalar(dst=plus, data=w_sbs[i][heads_m, :], op0=nl.greater_equal,
                                   operand0=0.0)  # fmt: skip
                nisa.tensor_scalar(dst=w_moving[i][heads_m, 2 * m + 1 : 2 * m + 2], data=plus,
                                   op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0)
            nisa.dma_copy(dst=w_rows_all[i], src=_tile_block(w_t, t, P, group_heads, i * group_heads,
                                                             row_stride=0))  # fmt: skip
        nisa.dma_copy(dst=ends, src=chunk_ends.ap(pattern=[[slots, 1], [1, slots]], offset=0,
                                              scalar_offset=t, indirect_dim=1))  # fmt: skip
        nisa.tensor_copy(dst=ends_f, src=ends)
        nisa.tensor_reduce(dst=end_f, op=nl.max, data=ends_f, axis=1, keepdims=True)
        nisa.tensor_copy(dst=end, src=end_f)
        if phase == "score":  # this program's chunks only: chunk_lo .. min(chunk_hi, end)
            nisa.tensor_scalar(dst=end_f, data=end_f, op0=nl.minimum, operand0=float(chunk_hi),
                               op1=nl.maximum, operand1=float(chunk_lo))  # fmt: skip
            nisa.tensor_copy(dst=end, src=end_f)
        chunks_end = nisa.register_alloc(None)
        nisa.register_load(chunks_end, end)
        nl.fori_loop(chunk_lo if phase == "score" else 0, chunks_end, one_chunk)

    def load_valid_rows(t, member):
        nisa.dma_copy(dst=nv_col, src=n_valid.ap(pattern=[[0, P], [1, 1]], offset=member,
                                              scalar_offset=t, indirect_dim=0))  # fmt: skip

    def selection_keys(scores, scratch, first: int):
        # Scores of columns first .. (``[128, w]``) -> selection keys in place: times key_scale,
        # then select_key with the rows 128 j + p (``scratch`` holds the scales, then the rows).
        width = scores.shape[1]
        nisa.dma_copy(dst=scratch, src=key_scale_t.ap(pattern=[[columns, P], [1, width]],
                                                      offset=first))  # fmt: skip
        # On the GpSimd, which the selection leaves the least busy (SBUF operands only).
        nisa.tensor_tensor(dst=scores, data1=scores, data2=scratch, op=nl.multiply,
                           engine=nisa.engine.gpsimd)  # fmt: skip
        nisa.iota(dst=scratch, pattern=[[P, width]], offset=P * first, channel_multiplier=1)
        select_key(scores, scratch, nv_col)

    def select_token(t, member):  # member: the token's slot in its span
        load_valid_rows(t, member)
        if phase == "select":  # the scoring launch's selection keys
            nisa.dma_copy(dst=keys_tile, src=_tile_block(staged_scores, t, P, columns,
                                                         member * P * columns))  # fmt: skip
        else:
            nisa.dma_copy(dst=keys_tile,
                          src=scores_hbm[member].ap(pattern=[[columns, P], [1, columns]], offset=0))
            selection_keys(keys_tile, work, 0)

        # Step 2: each partition's depth best (positions -> rows 128 pos + p), and the best left.
        if phase == "select":  # the best depth of the shares' candidates (the scoring launch's)
            nisa.dma_copy(dst=union, src=_tile_block(staged_candidates, t, P, shares * share_width,
                                                     member * P * shares * share_width))  # fmt: skip
            for i in range(shares):
                first = i * share_width
                cols = slice(i * depth_of_share, (i + 1) * depth_of_share)
                nisa.tensor_copy(dst=union_keys[:, cols],
                                 src=union[:, first : first + depth_of_share])  # fmt: skip
                nisa.tensor_copy(dst=union_rows[:, cols], engine=nisa.engine.gpsimd,
                                 src=union[:, first + depth_of_share : first + 2 * depth_of_share])
            positions = extract_best(union_keys, sel, depth)
            nisa.nc_n_gather(dst=cand_rows, data=union_rows, indices=positions)
            # The best left: among the shares' candidates not taken, or in a share's rest.
            nisa.max8(dst=left8, src=union_keys)
            for i in range(shares):
                best_of_share = union[:, (i + 1) * share_width - 1 : (i + 1) * share_width]
                nisa.tensor_tensor(dst=left8[:, 0:1], data1=left8[:, 0:1], data2=best_of_share,
                                   op=nl.maximum)  # fmt: skip
            nisa.tensor_scalar(dst=cand_pos, data=cand_rows, op0=nl.subtract, operand0=partition,
                               op1=nl.multiply, operand1=1.0 / P,
                               engine=nisa.engine.gpsimd)  # fmt: skip
            nisa.tensor_copy(dst=cand_pos_u32, src=cand_pos, engine=nisa.engine.gpsimd)
        else:
            nisa.tensor_copy(dst=work, src=keys_tile, engine=nisa.engine.gpsimd)
            positions = extract_best(work, sel, depth)
            nisa.max8(dst=left8, src=work)
            nisa.tensor_copy(dst=cand_pos, src=positions, engine=nisa.engine.gpsimd)
            nisa.tensor_copy(dst=cand_pos_u32, src=positions, engine=nisa.engine.gpsimd)
            nisa.tensor_scalar(dst=cand_rows, data=cand_pos, op0=nl.multiply, operand0=float(P),
                               op1=nl.add, operand1=partition, engine=nisa.engine.gpsimd)  # fmt: skip
        nisa.tensor_copy(dst=cand_pairs[:, :, 0], src=sel.best_keys)
        nisa.tensor_copy(dst=cand_pairs[:, :, 1], src=cand_rows)
        nisa.tensor_copy(dst=left_col, src=left8[:, 0:1])
        across_partitions(left_col, nl.max)
        nisa.tensor_scalar(dst=kv_col, data=nv_col, op0=nl.minimum, operand0=float(topk),
                           engine=nisa.engine.gpsimd)  # fmt: skip
        nisa.tensor_copy(dst=kv_one, src=kv_col[0:1, :])
        nisa.tensor_scalar(dst=kv_sum, data=kv_one, op0=nl.subtract, operand0=1.0,
                           op1=nl.multiply, operand1=0.5)  # fmt: skip
        nisa.tensor_tensor(dst=kv_sum, data1=kv_sum, data2=kv_one, op=nl.multiply)
        # The bound: at least Kv candidates strictly above U*, or no valid row left (U* MARKER).
        count_above(nl.greater, left_col)
        nisa.tensor_tensor(dst=bound, data1=total_col, data2=kv_col, op=nl.greater_equal)
        nisa.tensor_scalar(dst=window, data=left_col, op0=nl.equal, operand0=MARKER)
        nisa.tensor_tensor(dst=bound, data1=bound, data2=window, op=nl.maximum)

        # Step 3a: a pivot with Kv <= #(candidates >= pivot) <= cap, by bisection between U*
        # and the best key (``steps`` halvings; where none is found, step 3 ranks all M).
        nisa.tensor_copy(dst=hi, src=sel.best_keys[:, 0:1])
        across_partitions(hi, nl.max)
        nisa.tensor_copy(dst=lo, src=left_col)

        def from_floor(_):
            # Where U* is MARKER (every valid row a candidate: a short cache, an early token),
            # halvings from it never reach the window. The floor, the lowest of the partitions'
            # floor_rank-th best keys, has at least Kv candidates at or above it: where it is
            # above U*, it is the bracket's low end, or (at most cap at or above it) the pivot.
            nisa.tensor_copy(dst=mid, src=sel.best_keys[:, floor_rank - 1 : floor_rank])
            across_partitions(mid, nl.min)
            count_above(nl.greater_equal, mid)
            nisa.tensor_tensor(dst=below_u8, data1=mid, data2=left_col, op=nl.greater)
            nisa.tensor_scalar(dst=above_u8, data=total_col, op0=nl.less_equal,
                               operand0=float(cap))  # fmt: skip
            nisa.tensor_tensor(dst=above_u8, data1=above_u8, data2=below_u8, op=nl.multiply)
            nisa.select_reduce(dst=lo, predicate=below_u8, on_true=mid, on_false=lo)
            nisa.select_reduce(dst=hi, predicate=above_u8, on_true=mid, on_false=hi)

        if steps:  # (steps=0, no halvings, forces step 3b; window holds U* == MARKER here)
            nl.fori_loop(0, load_register(window[0:1, :]), from_floor)
        nisa.tensor_copy(dst=mid, src=lo)

        def halvings(n):
            # Each keeps the bracket's end whose count is out of the window; inside it (Kv <=
            # count <= cap) neither moves, so mid, count_col and total_col stay the pivot's.
            for _ in range(n):
                nisa.tensor_scalar(dst=half, data=hi, op0=nl.multiply, operand0=0.5)
                nisa.scalar_tensor_tensor(dst=mid, data=lo, op0=nl.multiply, operand0=0.5,
                                          op1=nl.add, operand1=half)  # fmt: skip
                count_above(nl.greater_equal, mid)
                nisa.tensor_tensor(dst=below_u8, data1=total_col, data2=kv_col, op=nl.less)
                nisa.tensor_scalar(dst=above_u8, data=total_col, op0=nl.greater,
                                   operand0=float(cap))  # fmt: skip
                nisa.select_reduce(dst=hi, predicate=below_u8, on_true=mid, on_false=hi)
                nisa.select_reduce(dst=lo, predicate=above_u8, on_true=mid, on_false=lo)

        def in_window():
            nisa.tensor_tensor(dst=window, data1=total_col, data2=kv_col, op=nl.greater_equal)
            nisa.tensor_scalar(dst=half, data=total_col, op0=nl.less_equal, operand0=float(cap))
            nisa.tensor_tensor(dst=window, data1=window, data2=half, op=nl.multiply)

        # The first halvings always; the rest (a 0-or-1-trip loop) only where the count is still
        # out of the window, which the first leave to few tokens.
        first = min(steps, EARLY_BISECT_STEPS)
        if first:
            halvings(first)
        else:
            count_above(nl.greater_equal, mid)
        if steps > first:
            in_window()
            nisa.tensor_scalar(dst=half, data=window, op0=nl.multiply, operand0=-1.0,
                               op1=nl.add, operand1=1.0)  # fmt: skip
            nl.fori_loop(0, load_register(half[0:1, :]), lambda _: halvings(steps - first))
        in_window()
        # A pivot above U*: then the rows at or above it are exactly the listed candidates.
        nisa.tensor_tensor(dst=half, data1=mid, data2=left_col, op=nl.greater)
        nisa.tensor_tensor(dst=window, data1=window, data2=half, op=nl.multiply)
        # Paths (0 or 1 trips each): the list (window), all M ranked (no window), the fallback
        # (no bound); the path code starts as the fallback's where the bound fails. A token with
        # no valid row (a padding token too) takes none: its slots stay MARKER / -1.
        nisa.tensor_tensor(dst=window, data1=window, data2=bound, op=nl.multiply)
        nisa.tensor_tensor(dst=half, data1=bound, data2=window, op=nl.subtract)
        nisa.tensor_scalar(dst=lo, data=kv_col, op0=nl.greater, operand0=0.0)
        nisa.tensor_tensor(dst=window, data1=window, data2=lo, op=nl.multiply)
        nisa.tensor_tensor(dst=half, data1=half, data2=lo, op=nl.multiply)
        nisa.tensor_scalar(dst=fb_f, data=bound[0:1, :], op0=nl.multiply, operand0=-1.0,
                           op1=nl.add, operand1=1.0)  # fmt: skip
        nisa.tensor_scalar(dst=path_f, data=fb_f, op0=nl.multiply, operand0=2.0)
        # Step 5's slots start as MARKER / -1 past Kv.
        # ranked_pairs as blocks of SBUF rows: rows 0 .. n-1 hold cols slots each, row n the tail.
        blocks = [(slice(0, fill_rows_n), 2 * fill_cols, 0)] + (
            [(slice(fill_rows_n, fill_rows_n + 1), 2 * fill_tail, 2 * fill_rows_n * fill_cols)]
            if fill_tail else [])  # fmt: skip
        for rows, width, first in blocks:
            nisa.dma_copy(dst=ranked_pairs.ap(pattern=[[width, rows.stop - rows.start], [1, width]],
                                              offset=first),
                          src=fill_pairs[rows, 0:width])  # fmt: skip
        nl.fori_loop(0, load_register(window[0:1, :]), list_path)
        if lead:
            nl.fori_loop(0, load_register(half[0:1, :]), full_path)
        # The pairs apart on chip (rows to int32 on the copy), then each output in blocks.
        for rows, width, first in blocks:
            nisa.dma_copy(dst=out_pairs[rows, 0:width], src=ranked_pairs.ap(
                pattern=[[width, rows.stop - rows.start], [1, width]], offset=first))  # fmt: skip
        nisa.tensor_copy(dst=out_keys, src=out_pairs[:, 0::2])
        nisa.tensor_copy(dst=out_rows, src=out_pairs[:, 1::2])
        for rows, width, first in blocks:
            for out, tile in ((keys_out, out_keys), (idx_out, out_rows)):
                nisa.dma_copy(dst=_tile_block(out, t, rows.stop - rows.start, width // 2,
                                              out_offset + member * topk + first // 2),
                              src=tile[rows, 0 : width // 2])  # fmt: skip
        if not lead:
            return
        # Step 6 (0 or 1 trips): the exact merge overwrites the token's result.
        nl.fori_loop(0, load_register(fb_f), lambda _: _run_fallback(
            fb, keys_tile, keys_out, idx_out, t, member, topk))  # fmt: skip
        nisa.tensor_copy(dst=reg_i32, src=path_f)
        nisa.dma_copy(dst=_tile_block(path_out, t, 1, 1, member), src=reg_i32)

    nl.fori_loop(program_spans, program_spans + per_program, one_span)
    if phase == "score":
        return staged_out, candidates_out
    return keys_out, idx_out, path_out
