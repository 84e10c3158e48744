"""The tiled NKI kernel of the indexer (``indexer_topk``): tokens on the partitions, scores on the
TensorEngine and an exact running top-k on the VectorEngine, the programs of a launch splitting
the rows, then :func:`indexer_merge_kernel` merging their partial selections. Its merge and key
helpers also serve the row-spread kernel (:mod:`.decode_kernel`).

docs/indexer-kernel.md has the packing, the steps per tile and chunk, the selection keys, the
variants per target and the modelled cost. The functions are plain Python: ``nki.jit`` is applied
where they are called on Neuron, the project's emulator runs them as they are. Importing this
module never needs the Neuron SDK.
"""

from __future__ import annotations

import dataclasses

from ..constants import (
    FLT_MAX,
    KERNEL_TILE,
    MAX8_ELEMENTS,
    PSUM_BANK_FP32,
    SBUF_BYTES_PER_PARTITION,
)
from ..constants import ceil_div as _ceil_div, round_up as _round_up

try:  # The Neuron SDK only exists on a Trainium host (Neuron pip repository).
    import nki
    import nki.isa as nisa
    import nki.language as nl
except ImportError:
    nki = nl = nisa = None

# The replace marker and the fill of invalid rows: below every key (docs/indexer-kernel.md,
# "Per tile and chunk", step 2). -FLT_MAX, not -inf: a real -inf score has its own key above it.
MARKER = -FLT_MAX
# Keys of the non-finite scores, below every halved finite score (>= -FLT_MAX / 2) and above
# MARKER, in the contract's order: a -inf score ranks above a NaN score.
NEG_INF_KEY = -0.625 * FLT_MAX
NAN_KEY = -0.75 * FLT_MAX
# Finite scores enter as score * KEY_FACTOR (exact for |score| >= 2**-125; below that a tie
# within one subnormal step can appear).
KEY_FACTOR = 0.5
# The running selection plus a chunk must fit what max8 / nc_find_index8 / nc_match_replace8 read.
SELECT_MAX_ELEMENTS = MAX8_ELEMENTS
ROWS_PER_MATMUL = PSUM_BANK_FP32  # one fp32 PSUM bank of scores per matmul
SELECTED_PER_ROUND = 8  # max8 finds 8 values per round
# Tokens per tile: the partitions of the score tile and of the running selection.
TILE_TOKENS_MAX = KERNEL_TILE


@dataclasses.dataclass(frozen=True)
class IndexerPlan:
    """Compile-time sizes of one kernel launch.

    ``tile_tokens`` (TT) tokens per tile, ``heads``/``dim`` (Hi, Di), ``topk`` (K) and ``topk8`` (K rounded up to 8), ``chunk`` (C)
    rows per chunk (a multiple of 512), ``chunks`` of them covering the padded rows.
    """

    tile_tokens: int
    heads: int
    dim: int
    topk: int
    topk8: int
    chunk: int
    chunks: int

    @property
    def rows_padded(self) -> int:
        return self.chunk * self.chunks


def sbuf_bytes_per_partition(tile_tokens: int, heads: int, dim: int, topk8: int, chunk: int) -> int:
    """SBUF bytes per partition of the kernel's live tiles at their peak (an upper estimate).

    q (16-bit, ``D/128 * TT*Hi``), the weights (f32, ``TT``), the candidates and their rows
    (f32, ``2 * (K8 + C)``), the merge's tiles (five 4-byte ``K8`` rows: keys, positions, rows,
    reversed positions, their index), a chunk of keys (16-bit, ``D/128 * C``), then the larger of
    a chunk's work tiles (a ``C``-byte predicate, a relu and a key-scale tile) and the output's
    (``9 * K8``), and a few columns.
    """
    d_tiles = _ceil_div(dim, KERNEL_TILE)
    q = d_tiles * tile_tokens * heads * 2
    weights = tile_tokens * 4
    candidates = 2 * 4 * (topk8 + chunk)
    merge = 5 * 4 * topk8 + 2 * 4 * SELECTED_PER_ROUND
    keys = d_tiles * chunk * 2
    work = max(chunk + 2 * 4 * ROWS_PER_MATMUL, 9 * topk8)
    return q + weights + candidates + merge + keys + work + 64


def plan_indexer(tokens: int, heads: int, dim: int, rows: int, topk: int,
                 budget: int = SBUF_BYTES_PER_PARTITION, shares: int = 1) -> IndexerPlan:  # fmt: skip
    """The sizes for ``tokens`` tokens (in tiles of up to 128), split over ``shares`` programs by
    rows (the chunk count a multiple of ``shares``), ``heads`` x ``dim`` queries, ``rows`` keys and
    ``topk``: the largest chunk (a multiple of 512, at most what max8 allows beside the running
    selection) whose working set fits ``budget`` SBUF bytes per partition (the target's:
    ``nki_emulator.targets``; a larger chunk means fewer merges), then the chunk evened out over
    the rows. Raises ``ValueError`` naming the argument when no chunk fits."""
    if not 0 < heads <= KERNEL_TILE:
        raise ValueError(f"the indexer kernel takes 1 to {KERNEL_TILE} heads, got Hi={heads}")
    tile_tokens = min(TILE_TOKENS_MAX, max(tokens, 1))
    topk8 = _round_up(max(topk, 1), SELECTED_PER_ROUND)
    rows_needed = _round_up(max(rows, 1), ROWS_PER_MATMUL)
    cap = (SELECT_MAX_ELEMENTS - topk8) // ROWS_PER_MATMUL * ROWS_PER_MATMUL
    if cap < ROWS_PER_MATMUL:
        raise ValueError(
            f"topk={topk} is too large for the indexer kernel: max8 reads at most "
            f"{SELECT_MAX_ELEMENTS} candidates per partition (ISA max8 page), so topk <= "
            f"{SELECT_MAX_ELEMENTS - ROWS_PER_MATMUL}"
        )
    chunk = min(cap, rows_needed)
    while chunk > ROWS_PER_MATMUL and sbuf_bytes_per_partition(
        tile_tokens, heads, dim, topk8, chunk
    ) > budget:
        chunk -= ROWS_PER_MATMUL
    if sbuf_bytes_per_partition(tile_tokens, heads, dim, topk8, chunk) > budget:
        raise ValueError(
            f"the indexer kernel does not fit SBUF at Hi={heads}, Di={dim}, topk={topk}: "
            f"{sbuf_bytes_per_partition(tile_tokens, heads, dim, topk8, chunk)} bytes per "
            f"partition, {budget} available"
        )
    chunks = _round_up(_ceil_div(rows_needed, chunk), shares)
    chunk = _round_up(_ceil_div(rows_needed, chunks), ROWS_PER_MATMUL)  # even the chunks out
    return IndexerPlan(tile_tokens, heads, dim, topk, topk8, chunk, chunks)


def _d_chunks(dim: int):
    """``(dc, d0, width)`` of the contraction's chunks of at most 128 rows."""
    return [(dc, dc * KERNEL_TILE, min(KERNEL_TILE, dim - dc * KERNEL_TILE))
            for dc in range(_ceil_div(dim, KERNEL_TILE))]  # fmt: skip


def _tile_block(tensor, tile, rows: int, cols: int, offset: int = 0, row_stride=None):
    """``tensor[tile]``'s ``rows x cols`` block at ``offset`` (a runtime address: the access
    pattern's ``scalar_offset`` moves it by ``tile * prod(tensor.shape[1:])``,
    nki/deep-dives/nki-aps.rst); ``row_stride=0`` repeats one row on every partition."""
    stride = cols if row_stride is None else row_stride
    return tensor.ap(pattern=[[stride, rows], [1, cols]], offset=offset, scalar_offset=tile,
                     indirect_dim=0)  # fmt: skip


def _score_chunk(plan: IndexerPlan, q_sb, w_sb, keys_sb, key_scale, chunk_index, cand, c_base):
    """The chunk's scores ``I = (sum_j w'_j relu(q_j . k)) * key_scale`` into
    ``cand[:, c_base : c_base + C]`` (f32), 512 rows at a time (docs/indexer-kernel.md, "Per
    tile and chunk", step 1).

    One token per matmul pair: its head sum must not meet another token's dot products, since
    ``0 * inf`` is NaN (a row holding inf would make a zero weight of another token poison it).
    """
    tt, heads = plan.tile_tokens, plan.heads
    for s in range(plan.chunk // ROWS_PER_MATMUL):
        r0 = s * ROWS_PER_MATMUL
        scores = nl.ndarray((tt, ROWS_PER_MATMUL), dtype=nl.float32, buffer=nl.psum)
        for t in range(tt):
            dots = nl.ndarray((heads, ROWS_PER_MATMUL), dtype=nl.float32, buffer=nl.psum)
            for dc, _, dw in _d_chunks(plan.dim):
                nisa.nc_matmul(dst=dots, stationary=q_sb[0:dw, dc, t * heads : (t + 1) * heads],
                               moving=keys_sb[0:dw, dc, r0 : r0 + ROWS_PER_MATMUL],
                               accumulate=dc > 0)  # fmt: skip
            relu = nl.ndarray((heads, ROWS_PER_MATMUL), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=relu, op=nl.relu, data=dots)
            # The head sum on the TensorEngine, the weights stationary: fp32 operands keep the
            # products exact in fp32; the result is the token's partition of the score tile.
            nisa.nc_matmul(dst=scores[t : t + 1, :], stationary=w_sb[:, t : t + 1], moving=relu,
                           accumulate=False)  # fmt: skip
        scale_row = nl.ndarray((tt, ROWS_PER_MATMUL), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=scale_row, src=key_scale.ap(
            pattern=[[0, tt], [1, ROWS_PER_MATMUL]], offset=r0, scalar_offset=chunk_index,
            indirect_dim=0))  # fmt: skip
        nisa.tensor_tensor(dst=cand[:, c_base + r0 : c_base + r0 + ROWS_PER_MATMUL],
                           data1=scores, data2=scale_row, op=nl.multiply)  # fmt: skip


def select_key(keys, rows, n_valid_col):
    """Scores -> selection keys in place (docs/indexer-kernel.md, "Per tile and chunk", step 2).

    ``keys [P, C]`` f32 scores, ``rows [P, C]`` f32 their row numbers, ``n_valid_col [P, 1]``
    the valid rows of each partition's token. Every replacement is a select, so a NaN or inf in
    a row that is invalid never matters.
    """
    tt, c = keys.shape
    # Halved, and -inf lifted to its key (max with NEG_INF_KEY; NaN stays NaN here).
    nisa.tensor_scalar(dst=keys, data=keys, op0=nl.multiply, operand0=KEY_FACTOR,
                       op1=nl.maximum, operand1=NEG_INF_KEY, engine=nisa.engine.gpsimd)  # fmt: skip
    predicate = nl.ndarray((tt, c), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=predicate, data1=keys, data2=keys, op=nl.equal,
                       engine=nisa.engine.gpsimd)  # NaN != NaN  # fmt: skip
    nisa.select_reduce(dst=keys, predicate=predicate, on_true=keys, on_false=NAN_KEY)
    nisa.tensor_scalar(dst=predicate, data=rows, op0=nl.less, operand0=n_valid_col,
                       engine=nisa.engine.gpsimd)  # fmt: skip
    nisa.select_reduce(dst=keys, predicate=predicate, on_true=keys, on_false=MARKER)


def _merge(plan: IndexerPlan, cand, cand_rows, sel):
    """The running ``K8`` best of ``cand`` (keys) and their rows, back into ``cand[:, :K8]`` and
    ``cand_rows[:, :K8]`` (docs/indexer-kernel.md, step 3). ``sel`` holds the merge's tiles and the
    variant (:class:`_Selection`)."""
    positions = extract_best(cand, sel, plan.topk8)
    nisa.nc_n_gather(dst=sel.best_rows, data=cand_rows, indices=positions)
    nisa.tensor_copy(dst=cand[:, 0:plan.topk8], src=sel.best_keys, engine=nisa.engine.gpsimd)
    nisa.tensor_copy(dst=cand_rows[:, 0:plan.topk8], src=sel.best_rows, engine=nisa.engine.gpsimd)


def extract_best(cand, sel, k8: int):
    """``k8 / 8`` rounds of max8 over ``cand`` (each partition on its own): ``sel.best_keys``
    gets each partition's ``k8`` best keys, descending, the returned tile their positions (first
    occurrences: ties to the lower position), and those positions of ``cand`` become ``MARKER``."""
    for i in range(k8 // SELECTED_PER_ROUND):
        cols = slice(i * SELECTED_PER_ROUND, (i + 1) * SELECTED_PER_ROUND)
        nisa.max8(dst=sel.best_keys[:, cols], src=cand)
        if sel.match_indices:
            # The round's 8 keys reversed (ascending): nc_match_replace8 pairs duplicate vals with
            # positions from its highest column down (its page, v2.32.0), so on the reversed keys
            # the lowest position lands on the best column once the positions are reversed back.
            nisa.nc_n_gather(dst=sel.keys_reversed, data=sel.best_keys[:, cols],
                             indices=sel.reverse8)  # fmt: skip
            nisa.nc_match_replace8(dst=cand, data=cand, vals=sel.keys_reversed, imm=MARKER,
                                   dst_idx=sel.positions[:, cols])  # fmt: skip
        else:
            # First occurrences, duplicates in ascending order (nc_find_index8, as the
            # nc_match_replace8 page of v2.32.0 describes it), then the replacement.
            nisa.nc_find_index8(dst=sel.positions[:, cols], data=cand, vals=sel.best_keys[:, cols])
            nisa.nc_match_replace8(dst=cand, data=cand, vals=sel.best_keys[:, cols], imm=MARKER)
    if not sel.match_indices:
        return sel.positions
    nisa.nc_n_gather(dst=sel.positions_fixed, data=sel.positions, indices=sel.reverse_groups)
    return sel.positions_fixed


@dataclasses.dataclass
class _Selection:
    """The merge's tiles. ``match_indices``: positions from ``nc_match_replace8(dst_idx=)`` (trn2,
    trn3: two VectorE passes per round) instead of ``nc_find_index8`` (three passes; the trn1
    variant: nki-library's own sort takes ``dst_idx`` on NeuronCore-v3+ only, so trn1 keeps to
    find_index8, an inference, the ISA pages name no generation)."""

    match_indices: bool
    best_keys: object
    positions: object
    best_rows: object
    keys_reversed: object = None
    reverse8: object = None
    positions_fixed: object = None
    reverse_groups: object = None


def _selection_tiles(tt: int, topk8: int, match_indices: bool, fill: bool = True) -> _Selection:
    """The merge's tiles; ``fill=False`` leaves their constants to :func:`fill_selection_constants`
    (for a merge that runs only on a rare path, which then pays for them alone)."""
    sel = _Selection(
        match_indices,
        nl.ndarray((tt, topk8), dtype=nl.float32, buffer=nl.sbuf),
        nl.ndarray((tt, topk8), dtype=nl.uint32, buffer=nl.sbuf),
        nl.ndarray((tt, topk8), dtype=nl.float32, buffer=nl.sbuf),
    )  # fmt: skip
    if match_indices:
        sel.keys_reversed = nl.ndarray((tt, SELECTED_PER_ROUND), dtype=nl.float32, buffer=nl.sbuf)
        sel.reverse8 = nl.ndarray((tt, SELECTED_PER_ROUND), dtype=nl.uint32, buffer=nl.sbuf)
        sel.positions_fixed = nl.ndarray((tt, topk8), dtype=nl.uint32, buffer=nl.sbuf)
        sel.reverse_groups = nl.ndarray((tt, topk8), dtype=nl.uint32, buffer=nl.sbuf)
        if fill:
            fill_selection_constants(sel)
    return sel


def fill_selection_constants(sel: _Selection):
    """The reversal indices of the ``dst_idx`` variant (``7 .. 0``, and per group of 8)."""
    if not sel.match_indices:
        return
    topk8 = sel.reverse_groups.shape[1]
    nisa.iota(dst=sel.reverse8, pattern=[[-1, SELECTED_PER_ROUND]], offset=SELECTED_PER_ROUND - 1)
    nisa.iota(dst=sel.reverse_groups, offset=SELECTED_PER_ROUND - 1,
              pattern=[[SELECTED_PER_ROUND, topk8 // SELECTED_PER_ROUND],
                       [-1, SELECTED_PER_ROUND]])  # fmt: skip


def _store_partial(part, program: int, tile, src, tt: int, width: int):
    """``part[program, tile] = src`` (``part [P, tiles, TT, width]``; ``tile`` a register:
    ``scalar_offset`` on axis 1 moves by ``TT * width`` per tile, nki/deep-dives/nki-aps.rst)."""
    tiles = part.shape[1]
    nisa.dma_copy(dst=part.ap(pattern=[[width, tt], [1, width]],
                              offset=program * tiles * tt * width, scalar_offset=tile,
                              indirect_dim=1), src=src)  # fmt: skip


def _load_partial(dst, part, program: int, tile, tt: int, width: int):
    tiles = part.shape[1]
    nisa.dma_copy(dst=dst, src=part.ap(pattern=[[width, tt], [1, width]],
                                       offset=program * tiles * tt * width, scalar_offset=tile,
                                       indirect_dim=1))  # fmt: skip


def indexer_topk_kernel(q_t, w_t, keys_t, key_scale, n_valid, chunk_ends, topk, chunk,
                        match_indices=True):
    """The indexer's running top-k over each program's share of the rows.

    Operands (prepared by :mod:`jax_sparse_attn.indexer.neuron`; ``TT`` tokens per tile,
    ``Hi <= 128``)::

        q_t          [tiles, Di, TT*Hi]  bf16   q of the tile's tokens transposed: column
                                                t*Hi + j holds q[t, j, :]
        w_t          [tiles, Hi, TT]     f32    the weights w' (scale folded in), transposed
        keys_t       [Di, n_chunks, C]   bf16   the keys transposed, padded to n_chunks * C rows
        key_scale    [n_chunks, C]       f32    (ones when the op has none)
        n_valid      [tiles, TT, 1]      f32    valid rows of each token (rows 0 .. n_valid-1)
        chunk_ends   [P, tiles, 1]       int32  program p scores chunks p * n_chunks / P up to
                                                chunk_ends[p, tile] (exclusive)

    The programs of an LNC=2 launch split the rows, not the tokens (the VectorE's selection costs
    the same for 1 or 128 token partitions). ``topk`` (K) and ``chunk`` (C) are compile-time ints;
    ``match_indices`` the selection variant (:func:`selection_variant`).
    Launch as ``kernel[P]``. Returns ``(part_keys, part_rows)``, each ``[P, tiles, TT, K8]`` f32
    in shared HBM: every program's running ``K8`` best keys (descending) and their rows;
    :func:`indexer_merge_kernel` merges them (with one program they are the result).
    """
    tiles, dim, cols = q_t.shape
    heads, tt = w_t.shape[1:]
    n_chunks = keys_t.shape[1]
    topk8 = _round_up(max(topk, 1), SELECTED_PER_ROUND)
    plan = IndexerPlan(tt, heads, dim, topk, topk8, chunk, n_chunks)
    assert cols == tt * heads and heads <= KERNEL_TILE and tuple(w_t.shape) == (tiles, heads, tt), (
        f"w_t {w_t.shape} does not match q_t {q_t.shape}"
    )
    assert tuple(keys_t.shape) == (dim, n_chunks, chunk), f"keys_t {keys_t.shape} vs chunk {chunk}"
    assert tuple(key_scale.shape) == (n_chunks, chunk), f"key_scale {key_scale.shape}"
    programs, program = nl.num_programs(), nl.program_id(0)
    assert tuple(n_valid.shape) == (tiles, tt, 1)
    assert tuple(chunk_ends.shape) == (programs, tiles, 1), f"chunk_ends {chunk_ends.shape}"
    assert chunk % ROWS_PER_MATMUL == 0 and topk8 + chunk <= SELECT_MAX_ELEMENTS
    assert n_chunks % programs == 0, f"{n_chunks} chunks must be a multiple of {programs} programs"
    first_chunk = program * (n_chunks // programs)

    part_keys = nl.ndarray((programs, tiles, tt, topk8), dtype=nl.float32, buffer=nl.shared_hbm)
    part_rows = nl.ndarray((programs, tiles, tt, topk8), dtype=nl.float32, buffer=nl.shared_hbm)
    d_tiles = _ceil_div(dim, KERNEL_TILE)
    # State carried through the loops (allocated outside them: a fori_loop body's tensors die
    # with its iteration, nki.language.fori_loop page).
    q_sb = nl.ndarray((KERNEL_TILE, d_tiles, cols), dtype=q_t.dtype, buffer=nl.sbuf)
    w_sb = nl.ndarray((heads, tt), dtype=nl.float32, buffer=nl.sbuf)
    n_valid_col = nl.ndarray((tt, 1), dtype=nl.float32, buffer=nl.sbuf)
    row_base = nl.ndarray((tt, 1), dtype=nl.float32, buffer=nl.sbuf)
    end = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    cand = nl.ndarray((tt, topk8 + chunk), dtype=nl.float32, buffer=nl.sbuf)
    cand_rows = nl.ndarray((tt, topk8 + chunk), dtype=nl.float32, buffer=nl.sbuf)
    sel = _selection_tiles(tt, topk8, match_indices)
    keys_sb = nl.ndarray((KERNEL_TILE, d_tiles, chunk), dtype=keys_t.dtype, buffer=nl.sbuf)

    def one_chunk(c):
        for dc, d0, dw in _d_chunks(dim):
            nisa.dma_copy(dst=keys_sb[0:dw, dc, :], src=keys_t.ap(
                pattern=[[n_chunks * chunk, dw], [1, chunk]], offset=d0 * n_chunks * chunk,
                scalar_offset=c, indirect_dim=1))  # fmt: skip
        _score_chunk(plan, q_sb, w_sb, keys_sb, key_scale, c, cand, topk8)
        rows = cand_rows[:, topk8 : topk8 + chunk]
        nisa.iota(dst=rows, pattern=[[1, chunk]], offset=0)
        nisa.tensor_scalar(dst=rows, data=rows, op0=nl.add, operand0=row_base,
                           engine=nisa.engine.gpsimd)  # fmt: skip
        select_key(cand[:, topk8 : topk8 + chunk], rows, n_valid_col)
        _merge(plan, cand, cand_rows, sel)
        nisa.tensor_scalar(dst=row_base, data=row_base, op0=nl.add, operand0=float(chunk),
                           engine=nisa.engine.gpsimd)  # fmt: skip

    def one_tile(tile):
        for dc, d0, dw in _d_chunks(dim):
            nisa.dma_copy(dst=q_sb[0:dw, dc, :], src=_tile_block(q_t, tile, dw, cols, d0 * cols))
        nisa.dma_copy(dst=w_sb, src=_tile_block(w_t, tile, heads, tt))
        nisa.dma_copy(dst=n_valid_col, src=_tile_block(n_valid, tile, tt, 1))
        nisa.dma_copy(dst=end, src=chunk_ends.ap(pattern=[[1, 1], [1, 1]], offset=program * tiles,
                                                 scalar_offset=tile, indirect_dim=1))  # fmt: skip
        chunks_end = nisa.register_alloc(None)
        nisa.register_load(chunks_end, end)
        nisa.memset(dst=cand[:, 0:topk8], value=MARKER)
        nisa.memset(dst=cand_rows[:, 0:topk8], value=0.0)
        nisa.memset(dst=row_base, value=float(first_chunk * chunk))
        nl.fori_loop(first_chunk, chunks_end, one_chunk)
        _store_partial(part_keys, program, tile, cand[:, 0:topk8], tt, topk8)
        _store_partial(part_rows, program, tile, cand_rows[:, 0:topk8], tt, topk8)

    nl.fori_loop(0, tiles, one_tile)
    return part_keys, part_rows


def _emit(cand, cand_rows, keys_out, idx_out, tile, tt: int, topk: int, topk8: int, offset: int = 0):
    """``keys_out[tile]`` and ``idx_out[tile]`` (row where the key is a real row's, above
    ``MARKER``, else -1; from element ``offset`` of the block) from the running part of ``cand`` /
    ``cand_rows``."""
    valid = nl.ndarray((tt, topk8), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=valid, data=cand[:, 0:topk8], op0=nl.greater, operand0=MARKER,
                       engine=nisa.engine.gpsimd)  # fmt: skip
    chosen = nl.ndarray((tt, topk8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.select_reduce(dst=chosen, predicate=valid, on_true=cand_rows[:, 0:topk8], on_false=-1.0)
    chosen_i32 = nl.ndarray((tt, topk8), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=chosen_i32, src=chosen, engine=nisa.engine.gpsimd)
    nisa.dma_copy(dst=_tile_block(keys_out, tile, tt, topk, offset), src=cand[:, 0:topk])
    nisa.dma_copy(dst=_tile_block(idx_out, tile, tt, topk, offset), src=chosen_i32[:, 0:topk])


def indexer_merge_kernel(part_keys, part_rows, topk, match_indices=True):
    """Merges the ``S`` partial selections of :func:`indexer_topk_kernel` (``[S, tiles, TT, K8]``
    keys and rows, program ``s`` holding rows below program ``s+1``'s) into ``(keys_out, idx)``,
    each ``[tiles, TT, K]`` (f32, int32) in shared HBM: one merge over the ``S * K8`` candidates
    per tile, concatenated in row order so first occurrences stay the lower rows. Launch as
    ``kernel[n]``; ``tiles`` a multiple of ``n`` (each program merges its share of the tiles)."""
    shares, tiles, tt, topk8 = part_keys.shape
    assert tuple(part_rows.shape) == tuple(part_keys.shape)
    assert shares * topk8 <= SELECT_MAX_ELEMENTS, f"{shares} x {topk8} candidates exceed max8's"
    programs, program = nl.num_programs(), nl.program_id(0)
    assert tiles % programs == 0, f"{tiles} tiles must be a multiple of the {programs} programs"
    per_program = tiles // programs
    plan = IndexerPlan(tt, 1, 1, topk, topk8, (shares - 1) * topk8, 1)
    keys_out = nl.ndarray((tiles, tt, topk), dtype=nl.float32, buffer=nl.shared_hbm)
    idx_out = nl.ndarray((tiles, tt, topk), dtype=nl.int32, buffer=nl.shared_hbm)
    cand = nl.ndarray((tt, shares * topk8), dtype=nl.float32, buffer=nl.sbuf)
    cand_rows = nl.ndarray((tt, shares * topk8), dtype=nl.float32, buffer=nl.sbuf)
    sel = _selection_tiles(tt, topk8, match_indices)

    def one_tile(tile):
        for s in range(shares):
            cols = slice(s * topk8, (s + 1) * topk8)
            _load_partial(cand[:, cols], part_keys, s, tile, tt, topk8)
            _load_partial(cand_rows[:, cols], part_rows, s, tile, tt, topk8)
        _merge(plan, cand, cand_rows, sel)
        _emit(cand, cand_rows, keys_out, idx_out, tile, tt, topk, topk8)

    nl.fori_loop(program * per_program, (program + 1) * per_program, one_tile)
    return keys_out, idx_out


def selection_variant(target: str) -> bool:
    """``match_indices`` for an NKI target: True on trn2/trn3, False (nc_find_index8) on trn1."""
    return target != "trn1"
