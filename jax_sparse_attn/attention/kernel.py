"""NKI kernels of top-k sparse attention with sinks (NKI 0.6 and 0.7, Neuron SDK 2.32 and 2.33).

One body, :func:`_sparse_attn_kernel_body`, under entries that differ in how a token's slot rows
reach SBUF: gathered by the kernel itself by indirect DMA (``gathered_attn_idx_kernel`` and its
FP8, split-row and two-cache forms; trn2, trn3), or pre-gathered by XLA (``gathered_attn_kernel``,
every target, the only one on trn1). docs/neuron-kernel.md has the interface, the variants per
target, the launch, the instruction pattern and the FP8 forms ("FP8 caches"); a row whose slots
are all empty has no meaningful output or lse (the packing overwrites both).

The functions are plain Python: ``nki.jit`` is applied where they are called on Neuron
(:mod:`jax_sparse_attn.attention.neuron`); the project's emulator and ``nki.simulate`` take them as
they are. Importing this module never needs the Neuron SDK.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from ..constants import (
    BIAS_PREFIX_COLS,
    FLT_MAX,
    KERNEL_TILE,
    LOGIT_LIMIT,
    MATMUL_MAX_N,
    MAX_HEADS_PER_CALL,
    PSUM_BANK_FP32,
    PSUM_BANKS,
    SBUF_BYTES_PER_PARTITION,
    SCALE_COL,
    UP_COLS,
)
from ..constants import ceil_div as _ceil_div

try:  # The Neuron SDK only exists on a Trainium host (Neuron pip repository).
    import nki
    import nki.isa as nisa
    import nki.language as nl
except ImportError:
    nki = nl = nisa = None


# PSUM banks the value accumulators of one pass may hold: the others hold the logits tile and the
# two transpose tiles (one bank each). More value blocks than this run as several value passes.
VALUE_PSUM_BANKS = PSUM_BANKS - 3


@dataclasses.dataclass(frozen=True)
class SlotPlan:
    """How a token's ``Kp`` slots are processed: in chunks of ``chunk`` slots (the last may be
    smaller), the token's fp32 logits kept in SBUF (``scores_in_sbuf``) or spilled to a private
    HBM scratch tensor between the two passes."""

    slots: int
    chunk: int
    scores_in_sbuf: bool

    @property
    def chunks(self) -> int:
        return _ceil_div(self.slots, self.chunk)


def sbuf_bytes_per_partition(
    heads: int, dim: int, slots: int, chunk: int | None = None, scores_in_sbuf: bool = True,
    *, indexed: bool = True, fp8_scale_groups: int = 0, index_sets: int = 1,
) -> int:
    """SBUF bytes per partition that one token's live tiles occupy at their peak.

    ``dim`` is the head dim, ``slots`` the padded slot count (a multiple of 128), ``chunk`` the
    slots per chunk (default: all). The token keeps its transposed q, scale, indices and (if
    ``scores_in_sbuf``) its fp32 logits (``4 * Kp``) throughout; on top of that the first pass
    holds a chunk's rows and their transpose (about ``4 * C * D / 128``) and its bias
    (``4 * C``), the second pass the rows, the bf16 probabilities and their transpose (about
    ``4 * C`` with 128 heads) and the output row. 57 KiB at Kp = C = 2048, D = 576, H = 128.
    ``fp8_scale_groups`` (the FP8 kernel: ``n`` scales per row) adds the FP8 zero tile and the
    token's f32 scales, and the raw FP8 rows (one byte per element) while a chunk is fetched.
    ``index_sets`` is 2 with two caches (each its own indices of the token's slots).
    """
    chunk = slots if chunk is None else chunk
    chunks = _ceil_div(slots, chunk)
    k_tiles, d_tiles = chunk // KERNEL_TILE, _ceil_div(dim, KERNEL_TILE)
    q_transposed = d_tiles * heads * 2
    indices = 4 * (slots // KERNEL_TILE) * index_sets if indexed else 0
    columns = 4 * (2 + chunks)  # sink, -max; chunk maxima
    token = q_transposed + BIAS_PREFIX_COLS * 4 + indices + columns
    token += slots * 4 if scores_in_sbuf else 0
    rows = k_tiles * dim * 2
    fp8_fetch = 0
    if fp8_scale_groups:  # the zero tile and the token's scales; the raw rows while fetching
        token += k_tiles * dim + 4 * fp8_scale_groups * (slots // KERNEL_TILE)
        fp8_fetch = rows + k_tiles * dim + chunk * 4
    spilled_chunk = 0 if scores_in_sbuf else chunk * 4
    first_pass = rows + d_tiles * chunk * 2 + chunk * 4 + MATMUL_MAX_N * 4 + spilled_chunk
    second_pass = (
        rows + spilled_chunk + chunk * 2 + k_tiles * heads * 2 + dim * 2 + 4 * (chunks + 4)
    )
    q_rows = dim * 2  # the [H, D] q rows, before the first pass
    return token + max(first_pass, second_pass, q_rows, fp8_fetch)


def plan_slots(
    heads: int, dim: int, slots: int, *, max_chunk: int | None = None, indexed: bool = True,
    budget: int = SBUF_BYTES_PER_PARTITION, fp8_scale_groups: int = 0, index_sets: int = 1,
) -> SlotPlan:
    """The largest slot chunk whose working set fits ``budget`` SBUF bytes per partition.

    The default budget is the smallest target's (trn1), so the plan holds on every target. The
    logits of the whole token stay in SBUF unless even 128-slot chunks do not fit beside them.
    Chunks are multiples of 512 slots (one full PSUM bank of logits) down to 512, then 384, 256,
    128. ``max_chunk`` caps the chunk (tests use it to run the two-pass form at small shapes).
    """
    cap = slots if max_chunk is None else min(slots, max_chunk)
    candidates = [cap] + [c for c in range(cap - cap % MATMUL_MAX_N, 0, -MATMUL_MAX_N) if c < cap]
    candidates += [c for c in (384, 256, 128) if c < min(cap, MATMUL_MAX_N)]
    for scores_in_sbuf in (True, False):
        for chunk in candidates:
            need = sbuf_bytes_per_partition(heads, dim, slots, chunk, scores_in_sbuf,
                                            indexed=indexed, fp8_scale_groups=fp8_scale_groups,
                                            index_sets=index_sets)  # fmt: skip
            if need <= budget:
                return SlotPlan(slots=slots, chunk=chunk, scores_in_sbuf=scores_in_sbuf)
    smallest = sbuf_bytes_per_partition(heads, dim, slots, KERNEL_TILE, False, indexed=indexed,
                                        fp8_scale_groups=fp8_scale_groups,
                                        index_sets=index_sets)  # fmt: skip
    raise ValueError(
        f"head dim D={dim} is too large for the NKI kernel: one 128-slot chunk of rows and its "
        f"transpose with {heads} heads need {smallest} bytes of SBUF per partition, more than "
        f"{budget}; use implementation='reference'"
    )


def _check_interface(q, slot_rows, bias, sink, indexed: bool, row_dim: int | None = None):
    """Trace-time checks of the kernel interface; returns (tokens, heads, dim, slots).
    ``row_dim``: the cache's columns when they are fewer than q's (split FP8 rows)."""
    tokens, heads, dim = q.shape
    row_dim = dim if row_dim is None else row_dim
    slots = bias.shape[1] - BIAS_PREFIX_COLS
    assert tokens > 0, f"q {q.shape} must be [T > 0, H, D]"
    assert 0 < heads <= MAX_HEADS_PER_CALL, f"H={heads} must be in [1, {MAX_HEADS_PER_CALL}]"
    assert dim > 0, f"D={dim} must be positive"
    assert slots > 0 and slots % KERNEL_TILE == 0, f"Kp={slots} must be a multiple of {KERNEL_TILE}"
    assert tuple(bias.shape) == (tokens, BIAS_PREFIX_COLS + slots), (
        f"bias {bias.shape} must be [T, {BIAS_PREFIX_COLS} + Kp] with T={tokens}"
    )
    assert tuple(sink.shape) == (heads, 1), f"sink {sink.shape} must be [H, 1] = ({heads}, 1)"
    if indexed:
        assert slot_rows.ndim == 2 and slot_rows.shape[0] > 0 and slot_rows.shape[1] == row_dim, (
            f"kv {slot_rows.shape} must be [R > 0, {row_dim}]"
        )
    else:
        assert tuple(slot_rows.shape) == (tokens, slots, dim), (
            f"g {slot_rows.shape} must be [T, Kp, D] = ({tokens}, {slots}, {dim})"
        )
    return tokens, heads, dim, slots


class _Engines:
    """Round-robin choice of the engine for copies and elementwise work that any of several
    engines can do (the compiler would pick one; the kernel spreads them so that no engine's
    queue is the bottleneck: docs/neuron-kernel.md, "Engines")."""

    def __init__(self, names):
        self.names = names
        self.next = 0

    def __call__(self) -> str:
        name = self.names[self.next % len(self.names)]
        self.next += 1
        return name


@dataclasses.dataclass
class _Source:
    """The kernel's HBM operands, sizes and engine choices; ``token`` is set per loop iteration."""

    q: object  # [T, H, D]
    slot_rows: object  # kv [R, D] (indexed) or g [T, Kp, D]
    idx: object  # [T, 128, Kp/128] uint32 (indexed) or None
    bias: object  # [T, 16 + Kp]
    heads: int
    dim: int
    slots: int
    token: object  # the loop's register: the token this iteration computes (None outside it)
    psum_engine: object  # engines that read PSUM tiles out, in turn (PSUM_READ_ENGINES)
    clamp_engine: object
    value_shift: int  # the value product's guard: probabilities scaled by 2**-value_shift
    row_scale: object = None  # FP8 kernel: the slots' scales [T, 128, Kp/128 * n] f32 in HBM
    dequant_engine: object = None  # engines of the on-chip dequantisation, in turn
    scale_groups: int = 0  # FP8 kernel: scales per row (n)
    fp8_zeros: object = None  # FP8 kernel: a zero FP8 tile [128, C/128, D], set once per program
    token_scales: object = None  # FP8 kernel: this token's scales [128, Kp/128 * n] f32 (SBUF)
    rope_rows: object = None  # FP8 split rows: the 16-bit columns [R, D - D8] after the FP8 ones
    value_dim: int = 0  # the output's columns: the first value_dim of each row (0: all D)
    extra_rows: object = None  # two caches: the second cache [R2, D] in HBM
    extra_idx: object = None  # and its indices [T, 128, Kp/128] uint32, laid out as idx
    extra_rope: object = None  # two FP8 caches of split rows: the second one's rope columns
    extra_16bit: bool = False  # an FP8 main cache beside a 16-bit second one of whole rows
    main_slots: int = 0  # two caches: slots 0 .. main_slots - 1 are kv's, the others extra_rows'

    @property
    def values(self) -> int:
        """Columns of each slot row that enter the value product and the output."""
        return self.value_dim or self.dim

    @property
    def indexed(self) -> bool:
        return self.idx is not None

    def token_rows(self, tensor, rows: int, cols: int, offset: int = 0, row_stride: int | None = None):
        """``tensor[token]``'s ``rows x cols`` block at ``offset`` (a runtime address: the
        access pattern's ``scalar_offset`` moves it by ``token * prod(tensor.shape[1:])``,
        nki/deep-dives/nki-aps.rst). ``row_stride=0`` broadcasts one row to every partition."""
        stride = cols if row_stride is None else row_stride
        return tensor.ap(
            pattern=[[stride, rows], [1, cols]], offset=offset, scalar_offset=self.token,
            indirect_dim=0,
        )  # fmt: skip


def _d_chunks(dim: int):
    """``(dc, d0, width)`` of the head dim's chunks of at most 128 columns (the last may be
    narrower: D needs no padding; a narrower contraction costs the same matmul cycles)."""
    return [(dc, dc * KERNEL_TILE, min(KERNEL_TILE, dim - dc * KERNEL_TILE))
            for dc in range(_ceil_div(dim, KERNEL_TILE))]  # fmt: skip


def _from_psum(src: _Source, dst, psum, scale=1.0):
    """``dst = psum * scale`` out of PSUM (``scale`` a number or an ``[P, 1]`` column: a power of
    two, or ``(1 / den) * 2**c``), on the next engine of ``PSUM_READ_ENGINES``.

    The Scalar engine by ``activation(op=nl.copy)``, which every target has (``tensor_copy`` is not
    supported on the NeuronCore-v2 Scalar engine; its page names ``activation`` with ``nl.copy``
    instead), or the Vector engine by ``tensor_copy`` / ``tensor_scalar``. Never GpSimd: "GpSimd
    Engine cannot access PSUM" (nki.isa.tensor_copy page)."""
    engine = src.psum_engine()
    if engine == "scalar":
        nisa.activation(dst=dst, op=nl.copy, data=psum, scale=scale)
    elif isinstance(scale, float) and scale == 1.0:
        nisa.tensor_copy(dst=dst, src=psum, engine=nisa.engine.vector)
    else:
        nisa.tensor_scalar(dst=dst, data=psum, op0=nl.multiply, operand0=scale,
                           engine=nisa.engine.vector)  # fmt: skip


def _transposed_q(src: _Source):
    """The token's q as ``[128 (d), D/128, H]`` bf16: the contraction dim on the partitions.

    q arrives by one DMA at a runtime address (the token counter) and is transposed on the
    TensorEngine: NKI's ``dma_transpose`` takes no runtime address and does not exist on trn1.
    """
    heads, d_tiles = src.heads, _ceil_div(src.dim, KERNEL_TILE)
    q_rows = nl.ndarray((heads, src.dim), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=q_rows, src=src.token_rows(src.q, heads, src.dim))
    q_t = nl.ndarray((KERNEL_TILE, d_tiles, heads), dtype=nl.bfloat16, buffer=nl.sbuf)
    q_psum = nl.ndarray((KERNEL_TILE, heads), dtype=nl.bfloat16, buffer=nl.psum)
    for dc, d0, dw in _d_chunks(src.dim):
        nisa.nc_transpose(dst=q_psum[0:dw, :], data=q_rows[:, d0 : d0 + dw])
        _from_psum(src, q_t[0:dw, dc, :], q_psum[0:dw, :])
    return q_t


def _tile_sources(src: _Source, row_index, tile: int, only: str | None = None):
    """``(cache, its rope columns or None, index column [128, 1])`` for each cache that 128-slot
    tile ``tile`` has slots of: the one cache, or with two caches (``row_index`` a pair) the main
    one for slots below ``main_slots`` and the second for the others, both for a tile across the
    boundary (each DMA then skips the other cache's slots, whose indices it holds as
    ``EMPTY_SLOT_INDEX``). ``only`` (``"main"`` or ``"extra"``) keeps one of the two."""
    if src.extra_rows is None:
        return [(src.slot_rows, src.rope_rows, row_index[:, tile : tile + 1])]
    main_index, extra_index = row_index
    first, sources = tile * KERNEL_TILE, []
    if first < src.main_slots and only != "extra":
        sources.append((src.slot_rows, src.rope_rows, main_index[:, tile : tile + 1]))
    if first + KERNEL_TILE > src.main_slots and only != "main":
        sources.append((src.extra_rows, src.extra_rope, extra_index[:, tile : tile + 1]))
    return sources


def _gather_tiles(src: _Source, row_index, first_tile: int, k_tiles: int, dst_of, columns: int,
                  rope: bool = False, only: str | None = None):
    """Tiles ``first_tile ..`` of the token's slots: per 128-slot tile ``kc``, one indirect DMA
    into ``dst_of(kc)`` (``[128, columns]``) from each cache it has slots of (``_tile_sources``,
    ``only`` as there; ``rope``: from that cache's rope columns), ``oob_mode=skip``, so an empty
    slot reads nothing."""
    for kc in range(k_tiles):
        for cache, rope_rows, index in _tile_sources(src, row_index, first_tile + kc, only):
            nisa.dma_copy(
                dst=dst_of(kc),
                src=(rope_rows if rope else cache).ap(pattern=[[columns, KERNEL_TILE], [1, columns]],
                                                      offset=0, vector_offset=index,
                                                      indirect_dim=0),
                oob_mode=nisa.oob_mode.skip,
            )  # fmt: skip


def _fetch_slot_rows(src: _Source, row_index, c0: int, width: int):
    """Slots ``c0 .. c0 + width`` of the token as ``[128 (slot), width/128, D]`` bf16 in SBUF.

    Indexed: each 128-slot tile is one indirect DMA whose partition p reads cache row
    ``row_index[p, kc]``. An empty or padding slot's index is out of range
    (``EMPTY_SLOT_INDEX``): ``oob_mode=skip`` leaves its row as the zeros written just before, so
    no unselected cache row is ever read (nki.isa.dma_copy page, "oob_mode"; the same page's
    gather example takes uint32 indices). Pre-gathered: one DMA of the chunk's rows of ``g``,
    whose unselected rows the packing zeroed.
    """
    k_tiles, dim = width // KERNEL_TILE, src.dim
    if src.row_scale is not None:
        return _fetch_fp8_slot_rows(src, row_index, c0, width)
    rows = nl.ndarray((KERNEL_TILE, k_tiles, dim), dtype=nl.bfloat16, buffer=nl.sbuf)
    if not src.indexed:
        # Slot c0 + kc*128 + p of the token lands on partition p, tile kc.
        nisa.dma_copy(
            dst=rows,
            src=src.slot_rows.ap(
                pattern=[[dim, KERNEL_TILE], [KERNEL_TILE * dim, k_tiles], [1, dim]],
                offset=c0 * dim, scalar_offset=src.token, indirect_dim=0,
            ),
        )  # fmt: skip
        return rows
    # GpSimd: the VectorEngine carries more of the elementwise work.
    nisa.memset(dst=rows, value=0.0, engine=nisa.engine.gpsimd)
    _gather_tiles(src, row_index, c0 // KERNEL_TILE, k_tiles, lambda kc: rows[:, kc, :], dim)
    return rows


def _fetch_fp8_slot_rows(src: _Source, row_index, c0: int, width: int):
    """FP8 cache: slots ``c0 .. c0 + width`` as dequantised ``[128 (slot), width/128, D]`` bf16.

    Each 128-slot tile is one indirect DMA of FP8 rows (one byte per element: half the HBM bytes
    of a bf16 cache) with ``oob_mode=skip`` into a zeroed tile, so an empty slot reads nothing
    and its row stays 0. The tile is zeroed by a DMA from a zero tile set once per program
    (``src.fp8_zeros``): a memset of FP8 costs ``N`` cycles, not the ``N/2`` of a bf16 zero (ISA
    memset page, "Estimated instruction cost"), and the DMA queues carry what the halved row
    bytes freed. Then one ``tensor_scalar`` multiply per tile and scale group (``G = D / n``
    columns by the ``[128, 1]`` scale column of that slot tile and group, from the token's
    scales, ``src.token_scales``, zero for an empty slot): the engine computes in fp32 and rounds
    once to the bf16 dst (nki.isa.tensor_scalar page, "Data types"), exactly
    ``(kv.astype(f32) * scale).astype(bf16)``.
    """
    k_tiles, dim = width // KERNEL_TILE, src.slot_rows.shape[1]  # the FP8 columns (D8 <= D)
    groups = src.scale_groups
    group_width = dim // groups
    raw = nl.ndarray((KERNEL_TILE, k_tiles, dim), dtype=src.slot_rows.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=raw, src=src.fp8_zeros[:, 0:k_tiles, :])
    first_tile = c0 // KERNEL_TILE
    fp8 = "main" if src.extra_16bit else None  # beside a 16-bit cache: the main one's FP8 rows
    _gather_tiles(src, row_index, first_tile, k_tiles, lambda kc: raw[:, kc, :], dim, only=fp8)
    rows = nl.ndarray((KERNEL_TILE, k_tiles, src.dim), dtype=nl.bfloat16, buffer=nl.sbuf)
    if src.rope_rows is not None:
        # Split rows: the 16-bit columns by their own indirect DMA into the tile's last columns,
        # zeroed first (VectorE: GpSimd makes the DMAs' descriptors) so that an empty slot's
        # stay 0 (the same indices, oob_mode=skip).
        nisa.memset(dst=rows[:, :, dim : src.dim], value=0.0, engine=nisa.engine.vector)
        _gather_tiles(src, row_index, first_tile, k_tiles, lambda kc: rows[:, kc, dim : src.dim],
                      src.dim - dim, rope=True, only=fp8)  # fmt: skip
    for kc in range(k_tiles):
        for g in range(groups):
            cols = slice(g * group_width, (g + 1) * group_width)
            column = (first_tile + kc) * groups + g
            nisa.tensor_scalar(dst=rows[:, kc, cols], data=raw[:, kc, cols], op0=nl.multiply,
                               operand0=src.token_scales[:, column : column + 1],
                               engine=getattr(nisa.engine, src.dequant_engine()))  # fmt: skip
    if src.extra_16bit:
        # The second cache's whole 16-bit rows, over the zeros that the dequantisation wrote for
        # its slots (scale 0); each DMA skips the main cache's slots.
        _gather_tiles(src, row_index, first_tile, k_tiles, lambda kc: rows[:, kc, :], src.dim,
                      only="extra")  # fmt: skip
    return rows


# Transposes of 128 x 128 bf16 blocks gathered in one PSUM tile before one copy to SBUF: four
# blocks are 1 KiB per partition, within one 2 KiB bank.
TRANSPOSES_PER_COPY = 4


def _transposed_rows(src: _Source, rows, width: int):
    """``[128 (slot), width/128, D]`` rows -> ``[128 (d), D/128, width]`` through the PE."""
    k_tiles, d_tiles = width // KERNEL_TILE, _ceil_div(src.dim, KERNEL_TILE)
    rows_t = nl.ndarray((KERNEL_TILE, d_tiles, width), dtype=nl.bfloat16, buffer=nl.sbuf)
    group = min(TRANSPOSES_PER_COPY, k_tiles)
    psum = nl.ndarray((KERNEL_TILE, group * KERNEL_TILE), dtype=nl.bfloat16, buffer=nl.psum)
    for dc, d0, dw in _d_chunks(src.dim):
        for k0 in range(0, k_tiles, group):
            n = min(group, k_tiles - k0)
            for i in range(n):
                nisa.nc_transpose(
                    dst=psum[0:dw, i * KERNEL_TILE : (i + 1) * KERNEL_TILE],
                    data=rows[:, k0 + i, d0 : d0 + dw],
                )
            _from_psum(src, rows_t[0:dw, dc, k0 * KERNEL_TILE : (k0 + n) * KERNEL_TILE],
                       psum[0:dw, 0 : n * KERNEL_TILE])
    return rows_t


def _gathered_transposed_rows(src: _Source, row_index, c0: int, width: int):
    """The variant without TensorEngine row transposes (``ROW_TRANSPOSES = "dma"``, indexed bf16
    kernel only): ``[128 (d), D/128, width]`` gathered and transposed from the cache by one
    indirect ``dma_transpose`` per 128 slots and 128 columns (nki.isa.dma_transpose, "DMA Indirect
    Transpose Constraints": 2-byte dtype, ``src.shape[-1] <= 128`` from NKI 0.4, uint32 indices
    ``[128, 1]``, software DGE, trn2+), into a zeroed tile with ``oob_mode=skip`` so that an empty
    slot's column stays 0. The rows are still gathered slot-major for the value product: every
    selected row crosses the DMA queues twice. Slower under the cost model (docs/neuron-kernel.md,
    "Modelled cost"), so not the default.
    """
    k_tiles, d_tiles = width // KERNEL_TILE, _ceil_div(src.dim, KERNEL_TILE)
    rows_t = nl.ndarray((KERNEL_TILE, d_tiles, width), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.memset(dst=rows_t, value=0.0, engine=nisa.engine.gpsimd)
    first_tile = c0 // KERNEL_TILE
    for dc, d0, dw in _d_chunks(src.dim):
        for kc in range(k_tiles):
            for cache, _, index in _tile_sources(src, row_index, first_tile + kc):
                nisa.dma_transpose(
                    dst=rows_t[0:dw, dc, kc * KERNEL_TILE : (kc + 1) * KERNEL_TILE],
                    src=cache.ap(pattern=[[src.dim, KERNEL_TILE], [1, dw]], offset=d0,
                                 vector_offset=index, indirect_dim=0),
                    oob_mode=nisa.oob_mode.skip,
                )  # fmt: skip
    return rows_t


def _bias_row(src: _Source, c0: int, width: int, with_prefix: bool):
    """The token's bias columns for slots ``c0 .. c0 + width`` as one ``[1, n]`` f32 row (one DMA
    at the token's runtime address); with ``with_prefix`` the 16 prefix columns (the scale) lead."""
    first = 0 if with_prefix else BIAS_PREFIX_COLS + c0
    n = BIAS_PREFIX_COLS + c0 + width - first
    row = nl.ndarray((1, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=row, src=src.token_rows(src.bias, 1, n, first))
    return row


def _chunk_logits(src: _Source, q_t, rows_t, prefix, bias_heads, width: int, dst):
    """Logits of a chunk of ``width`` slots into ``dst [H, width]`` f32 (SBUF).

    ``q . x`` accumulates in fp32 PSUM over the D/128 chunks, at most 512 slots per matmul (one
    PSUM bank); q arrives scaled down by a power of two so that no partial sum can overflow
    (docs/contract.md, "Overflow guards"). Then in fp32: the sum multiplied back by that power of
    two (the two factors of ``prefix[:, UP_COLS]``) and clamped to ``+-FLT_MAX``; ``a * scale``
    clamped to ``+-LOGIT_LIMIT``; plus the bias (``bias_heads [H, width]``): the saturation rule.
    The scale never touches bf16 q. The steps run on the Scalar, GpSimd and Vector engines, which
    share the load.
    """
    scale_col = prefix[:, SCALE_COL : SCALE_COL + 1]
    up1, up2 = (prefix[:, c : c + 1] for c in UP_COLS)
    heads = src.heads
    score_psum = nl.ndarray((heads, MATMUL_MAX_N), dtype=nl.float32, buffer=nl.psum)
    saturated = nl.ndarray((heads, MATMUL_MAX_N), dtype=nl.float32, buffer=nl.sbuf)
    for nb in range(_ceil_div(width, MATMUL_MAX_N)):
        n0 = nb * MATMUL_MAX_N
        n = min(MATMUL_MAX_N, width - n0)
        for dc, _, dw in _d_chunks(src.dim):
            nisa.nc_matmul(
                dst=score_psum[:, 0:n],
                stationary=q_t[0:dw, dc, :],
                moving=rows_t[0:dw, dc, n0 : n0 + n],
                accumulate=dc > 0,
            )
        sat = saturated[:, 0:n]
        # Out of PSUM on the Vector engine, multiplied back by both factors: GpSimd cannot read
        # PSUM and the Scalar engine's tensor_scalar has no (multiply, multiply) pair (nki.isa
        # tensor_copy and tensor_scalar pages). The clamps then run on SBUF, on GpSimd.
        nisa.tensor_scalar(dst=sat, data=score_psum[:, 0:n], op0=nl.multiply, operand0=up1,
                           op1=nl.multiply, operand1=up2, engine=nisa.engine.vector)
        nisa.tensor_scalar(dst=sat, data=sat, op0=nl.maximum, operand0=-FLT_MAX,
                           op1=nl.minimum, operand1=FLT_MAX,
                           engine=getattr(nisa.engine, src.clamp_engine()))  # fmt: skip
        nisa.tensor_scalar(dst=sat, data=sat, op0=nl.multiply, operand0=scale_col,
                           op1=nl.maximum, operand1=-LOGIT_LIMIT, engine=nisa.engine.gpsimd)
        nisa.scalar_tensor_tensor(
            dst=dst[:, n0 : n0 + n], data=sat,
            op0=nl.minimum, operand0=LOGIT_LIMIT, op1=nl.add, operand1=bias_heads[:, n0 : n0 + n],
        )  # fmt: skip


def _transposed_probs(src: _Source, probs_bf16, width: int):
    """``[H, width]`` bf16 probabilities -> ``[128 (slot), width/128, H]`` through the PE."""
    heads, k_tiles = src.heads, width // KERNEL_TILE
    probs_t = nl.ndarray((KERNEL_TILE, k_tiles, heads), dtype=nl.bfloat16, buffer=nl.sbuf)
    group = min(TRANSPOSES_PER_COPY, k_tiles)
    psum = nl.ndarray((KERNEL_TILE, group, heads), dtype=nl.bfloat16, buffer=nl.psum)
    for k0 in range(0, k_tiles, group):
        n = min(group, k_tiles - k0)
        for i in range(n):
            kc = k0 + i
            nisa.nc_transpose(
                dst=psum[:, i, :], data=probs_bf16[:, kc * KERNEL_TILE : (kc + 1) * KERNEL_TILE]
            )
        # The value product's overflow guard: probabilities enter it scaled by 2**-value_shift
        # (exact: a power of two), on the way out of PSUM at the cost of the copy.
        _from_psum(src, probs_t[:, k0 : k0 + n, :], psum[:, 0:n, :], 2.0**-src.value_shift)
    return probs_t


@dataclasses.dataclass(frozen=True)
class _ValueUnit:
    """One PSUM accumulator of the value product and the output columns it holds.

    ``transposed=False``: ``[H, <=512]`` holding columns ``blocks[0] = (d0, n)`` of ``out``
    (stationary the probabilities ``[128 (slot), H]``, moving the rows' columns). ``True``:
    ``[128, len(blocks), H]`` holding ``out.T`` for the 128-column blocks ``blocks`` (stationary
    the rows' columns, moving the probabilities): cheaper when H is small, since a matmul costs
    ``max(min(64, stationary columns), moving columns)`` cycles (nki.isa.nc_matmul, "Estimated
    instruction cost", as docs/nki-emulator.md quotes it).
    """

    transposed: bool
    blocks: tuple
    psum_shape: tuple


def _value_units(heads: int, dim: int, slots: int):
    """The value accumulators for H heads and D columns, in the arrangement with fewer PE
    cycles per token (each arrangement's cycles from the nc_matmul and nc_transpose costs)."""
    k_tiles = slots // KERNEL_TILE
    plain = [(v0, min(MATMUL_MAX_N, dim - v0)) for v0 in range(0, dim, MATMUL_MAX_N)]
    plain_cycles = k_tiles * sum(max(min(64, heads), n) for _, n in plain)
    chunks = [(d0, dw) for _, d0, dw in _d_chunks(dim)]
    transposed_cycles = sum(
        k_tiles * max(min(64, dw), heads) + max(dw, min(64, heads)) for _, dw in chunks
    )
    if transposed_cycles >= plain_cycles:
        return [_ValueUnit(False, (b,), (heads, MATMUL_MAX_N)) for b in plain]
    per_bank = max(1, (PSUM_BANK_FP32 // heads))  # [128, n, H] fp32 within one 2 KiB bank
    return [
        _ValueUnit(True, tuple(chunks[i : i + per_bank]),
                   (KERNEL_TILE, len(chunks[i : i + per_bank]), heads))
        for i in range(0, len(chunks), per_bank)
    ]  # fmt: skip


def _value_matmul(unit: _ValueUnit, acc, probs_tile, rows_tile, accumulate: bool):
    """Adds one 128-slot tile's contribution to the accumulator ``acc`` of ``unit``."""
    if not unit.transposed:
        d0, n = unit.blocks[0]
        nisa.nc_matmul(dst=acc[:, 0:n], stationary=probs_tile, moving=rows_tile[:, d0 : d0 + n],
                       accumulate=accumulate)  # fmt: skip
        return
    for j, (d0, dw) in enumerate(unit.blocks):
        nisa.nc_matmul(dst=acc[0:dw, j, :], stationary=rows_tile[:, d0 : d0 + dw],
                       moving=probs_tile, accumulate=accumulate)  # fmt: skip


def _value_epilogue(src: _Source, unit: _ValueUnit, acc, out_scale, out_rows):
    """``out_rows[:, columns] = bf16(value * out_scale)`` for the columns of ``unit``, with
    ``out_scale = (1 / den) * 2**value_shift`` (``[H, 1]``; exact: a power of two): one multiply,
    so the Scalar engine can take it out of PSUM as well as the Vector engine.

    A transposed accumulator ``[d, H]`` goes to SBUF and back through a PE transpose (fp32,
    bit-exact from NeuronCore-v3, nki.isa.nc_transpose page) so that ``out_scale`` is a
    per-partition column again; one rounding to bf16 either way.
    """
    heads = src.heads
    if not unit.transposed:
        d0, n = unit.blocks[0]
        _from_psum(src, out_rows[:, d0 : d0 + n], acc[:, 0:n], out_scale)
        return
    values_t = nl.ndarray((KERNEL_TILE, heads), dtype=nl.float32, buffer=nl.sbuf)
    values_psum = nl.ndarray((heads, KERNEL_TILE), dtype=nl.float32, buffer=nl.psum)
    for j, (d0, dw) in enumerate(unit.blocks):
        _from_psum(src, values_t[0:dw, :], acc[0:dw, j, :])
        nisa.nc_transpose(dst=values_psum[:, 0:dw], data=values_t[0:dw, :])
        _from_psum(src, out_rows[:, d0 : d0 + dw], values_psum[:, 0:dw], out_scale)


def _attend_one_token(src: _Source, plan: SlotPlan, sink_col, out, lse, scratch):
    """Computes ``out[token]`` and ``lse[token]`` (docs/neuron-kernel.md, "Instruction pattern")."""
    heads = src.heads
    # The body is compiled once (a hardware loop): every token must use the same engines, so the
    # round-robin choices restart here (the emulator runs the Python body once per token).
    src.psum_engine.next = src.clamp_engine.next = 0
    if src.dequant_engine is not None:
        src.dequant_engine.next = 0
    chunks = plan.chunks
    bounds = [(c * plan.chunk, min(plan.chunk, plan.slots - c * plan.chunk)) for c in range(chunks)]

    q_t = _transposed_q(src)
    row_index = None
    if src.indexed:
        # All the token's indices in one DMA: partition p holds slots p, 128 + p, 256 + p, ...
        k_all = plan.slots // KERNEL_TILE
        row_index = nl.ndarray((KERNEL_TILE, k_all), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.dma_copy(dst=row_index, src=src.token_rows(src.idx, KERNEL_TILE, k_all))
        if src.extra_rows is not None:  # the second cache's indices of the same slots
            extra_index = nl.ndarray((KERNEL_TILE, k_all), dtype=nl.uint32, buffer=nl.sbuf)
            nisa.dma_copy(dst=extra_index, src=src.token_rows(src.extra_idx, KERNEL_TILE, k_all))
            row_index = (row_index, extra_index)
        if src.row_scale is not None:
            # The scales of the token's slots in one DMA, laid out as the indices (zero for an
            # empty slot: the packing gathers them without reading a row no slot selects).
            n = k_all * src.scale_groups
            src.token_scales = nl.ndarray((KERNEL_TILE, n), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=src.token_scales, src=src.token_rows(src.row_scale, KERNEL_TILE, n))

    # Pass 1: logits and their max (the max runs over the slots only, never the sink).
    scores = None
    if plan.scores_in_sbuf:
        scores = nl.ndarray((heads, plan.slots), dtype=nl.float32, buffer=nl.sbuf)
    chunk_max = nl.ndarray((heads, chunks), dtype=nl.float32, buffer=nl.sbuf)
    rows = None
    prefix = None
    for c, (c0, width) in enumerate(bounds):
        # The bias row (with the scale in front for the first chunk), broadcast to the H head
        # partitions: both operands of an instruction then start at partition 0 (two SBUF
        # inputs at different base partitions are compiler error NCC_IBIR297).
        bias_row = _bias_row(src, c0, width, with_prefix=c == 0)
        if c == 0:
            prefix = nl.broadcast_to(bias_row[:, 0:BIAS_PREFIX_COLS], shape=(heads, BIAS_PREFIX_COLS))
        first = BIAS_PREFIX_COLS if c == 0 else 0
        bias_heads = nl.broadcast_to(bias_row[:, first : first + width], shape=(heads, width))
        del bias_row
        rows = _fetch_slot_rows(src, row_index, c0, width)
        if ROW_TRANSPOSES == "dma" and src.indexed and src.row_scale is None:
            rows_t = _gathered_transposed_rows(src, row_index, c0, width)
        else:
            rows_t = _transposed_rows(src, rows, width)
        if plan.scores_in_sbuf:
            chunk_scores = scores[:, c0 : c0 + width]
        else:
            chunk_scores = nl.ndarray((heads, width), dtype=nl.float32, buffer=nl.sbuf)
        _chunk_logits(src, q_t, rows_t, prefix, bias_heads, width, chunk_scores)
        del bias_heads
        nisa.tensor_reduce(
            dst=chunk_max[:, c : c + 1], op=nl.max, data=chunk_scores, axis=1, keepdims=True
        )
        if not plan.scores_in_sbuf:
            nisa.dma_copy(dst=scratch[:, c0 : c0 + width], src=chunk_scores)
        del rows_t, chunk_scores
        if chunks > 1:
            del rows  # the second pass fetches each chunk again
    neg_max = nl.ndarray((heads, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=neg_max, op=nl.max, data=chunk_max, axis=1, negate=True, keepdims=True)

    # Pass 2: fp32 exponentials and their sum, bf16 probabilities into the value product. The value
    # accumulators of one pass occupy at most VALUE_PSUM_BANKS banks; wider D runs more passes.
    # Only the first src.values columns are values (value_dim): no value work on the others.
    units = _value_units(heads, src.values, plan.slots)
    out_rows = nl.ndarray((heads, src.values), dtype=nl.bfloat16, buffer=nl.sbuf)
    chunk_sum = nl.ndarray((heads, chunks), dtype=nl.float32, buffer=nl.sbuf)
    inv_denominator = nl.ndarray((heads, 1), dtype=nl.float32, buffer=nl.sbuf)
    out_scale = nl.ndarray((heads, 1), dtype=nl.float32, buffer=nl.sbuf)
    denominator = nl.ndarray((heads, 1), dtype=nl.float32, buffer=nl.sbuf)
    for g0 in range(0, len(units), VALUE_PSUM_BANKS):
        group = units[g0 : g0 + VALUE_PSUM_BANKS]
        value_psum = [nl.ndarray(u.psum_shape, dtype=nl.float32, buffer=nl.psum) for u in group]
        for c, (c0, width) in enumerate(bounds):
            if chunks > 1:
                rows = _fetch_slot_rows(src, row_index, c0, width)
            if plan.scores_in_sbuf:
                chunk_scores = scores[:, c0 : c0 + width]
            else:
                chunk_scores = nl.load(scratch[:, c0 : c0 + width])
            # exp in fp32, written as bf16 probabilities; the reduction sums the fp32 values
            # before that rounding (nki.isa.activation page: reduce_cmd=reset_reduce zeroes the
            # accumulator registers and sums this instruction's output; since NKI 0.3 the
            # default, idle, leaves them alone).
            probs_bf16 = nl.ndarray((heads, width), dtype=nl.bfloat16, buffer=nl.sbuf)
            if g0 == 0:
                nisa.activation(
                    dst=probs_bf16, op=nl.exp, data=chunk_scores, bias=neg_max, scale=1.0,
                    reduce_op=nl.add, reduce_res=chunk_sum[:, c : c + 1],
                    reduce_cmd=nisa.reduce_cmd.reset_reduce,
                )  # fmt: skip
            else:
                nisa.activation(dst=probs_bf16, op=nl.exp, data=chunk_scores, bias=neg_max)
            probs_t = _transposed_probs(src, probs_bf16, width)
            for unit, acc in zip(group, value_psum):
                for kc in range(width // KERNEL_TILE):
                    _value_matmul(unit, acc, probs_t[:, kc, :], rows[:, kc, :], c > 0 or kc > 0)
            del probs_bf16, probs_t, chunk_scores
            if chunks > 1:
                del rows
        if g0 == 0:
            # den = sum of the fp32 exponentials + exp(sink - max), in fp32.
            slot_sum = nl.ndarray((heads, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=slot_sum, op=nl.add, data=chunk_sum, axis=1, keepdims=True)
            sink_term = nl.ndarray((heads, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=sink_term, op=nl.exp, data=sink_col, bias=neg_max, scale=1.0)
            nisa.tensor_tensor(dst=denominator, data1=slot_sum, data2=sink_term, op=nl.add)
            nisa.reciprocal(dst=inv_denominator, data=denominator)
            nisa.tensor_scalar(dst=out_scale, data=inv_denominator, op0=nl.multiply,
                               operand0=2.0**src.value_shift)  # fmt: skip
        for unit, acc in zip(group, value_psum):
            _value_epilogue(src, unit, acc, out_scale, out_rows)
        del value_psum
    nisa.dma_copy(dst=src.token_rows(out, heads, src.values), src=out_rows)

    # lse = max + log(den) = log(den) - (-max).
    log_den = nl.ndarray((heads, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=log_den, op=nl.log, data=denominator)
    lse_col = nl.ndarray((heads, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=lse_col, data=log_den, op0=nl.subtract, operand0=neg_max)
    nisa.dma_copy(dst=src.token_rows(lse, heads, 1), src=lse_col)


# Engines that read PSUM tiles out to SBUF, in turn (_from_psum): Scalar (activation) or Vector;
# GpSimd cannot access PSUM (nki.isa.tensor_copy page). All on the Scalar engine: the Vector
# engine carries the logits' first step, their max, the bias broadcast and the bias add, and the
# cost model puts every engine below the TensorEngine at H=128 decode this way (docs/neuron-kernel.md).
PSUM_READ_ENGINES = ("scalar",)
# Engines that clamp the multiplied-back dot products (SBUF only), in turn (tensor_scalar runs on
# Vector, Scalar or GpSimd, nki.isa.tensor_scalar page; (max, min) is not a Scalar-engine pair).
CLAMP_ENGINES = ("gpsimd",)
# How the logits' operand [128 (d), D/128, C] is made from the gathered rows: "tensor" (PE
# transposes of the slot-major rows, the default) or "dma" (the indexed bf16 kernel gathers it a
# second time by indirect dma_transpose, _gathered_transposed_rows). The default is the one that
# models faster (docs/neuron-kernel.md, "Modelled cost").
ROW_TRANSPOSES = "tensor"
# Engines that dequantise FP8 rows (SBUF only), in turn (tensor_scalar multiply: Vector, Scalar or
# GpSimd). Weighted towards GpSimd, which the FP8 kernel frees of the rows' memset, and away from
# the Vector and Scalar engines, which carry the logits' first step and every PSUM read (11 : 3 : 2
# GpSimd : Scalar : Vector in 16; chosen under the cost model at decode, K=2048, H=64 and 128).
DEQUANT_ENGINES = ("gpsimd", "gpsimd", "scalar", "gpsimd", "vector", "gpsimd", "gpsimd", "scalar",
                   "gpsimd", "gpsimd", "vector", "gpsimd", "gpsimd", "scalar", "gpsimd", "gpsimd")
# The same for split rows, whose GpSimd also generates the rope columns' DMA descriptors: evener
# (6 : 5 : 5; docs/neuron-kernel.md, "FP8 caches", has the modelled comparison).
SPLIT_DEQUANT_ENGINES = ("gpsimd", "gpsimd", "scalar", "vector") + ("gpsimd", "scalar", "vector") * 4


class _SecondCache(NamedTuple):
    """A second cache for the kernel body: its rows and their indices (laid out as the main
    ones'), the main cache's slot count, its rope columns (split FP8 rows), and whether it holds
    whole 16-bit rows beside an FP8 main cache."""

    rows: object
    idx: object
    main_slots: int
    rope: object = None
    whole_16bit: bool = False


def _sparse_attn_kernel_body(q, slot_rows, idx, bias, sink, value_shift, max_chunk,
                             slot_scale=None, scale_groups=0, value_dim=None,
                             second: _SecondCache | None = None, rope=None):  # fmt: skip
    indexed = idx is not None
    row_dim = None if rope is None else slot_rows.shape[1]
    tokens, heads, dim, slots = _check_interface(q, slot_rows, bias, sink, indexed, row_dim)
    if rope is not None:  # split FP8 rows: [R, D8] FP8 and [R, D - D8] 16-bit
        assert tuple(rope.shape) == (slot_rows.shape[0], dim - slot_rows.shape[1]), (
            f"kv_rope {rope.shape} must be [R, D - D8] = ({slot_rows.shape[0]}, "
            f"{dim - slot_rows.shape[1]})"
        )
    if second is not None:  # as the main cache, or whole 16-bit rows beside FP8 ones
        _check_interface(q, second.rows, bias, sink, indexed,
                         None if second.whole_16bit else row_dim)  # fmt: skip
        assert tuple(second.idx.shape) == tuple(idx.shape), (
            f"extra_idx {second.idx.shape} must be {idx.shape}"
        )
        assert isinstance(second.main_slots, int) and 0 <= second.main_slots <= slots, (
            f"main_slots={second.main_slots!r}"
        )
        if not second.whole_16bit:
            assert second.rows.dtype == slot_rows.dtype, (
                f"extra_kv {second.rows.dtype} must be {slot_rows.dtype}"
            )
        if second.rope is not None:
            assert tuple(second.rope.shape) == (second.rows.shape[0], dim - row_dim), (
                f"extra_kv_rope {second.rope.shape} must be [R2, D - D8]"
            )
    # SPMD launch (nki/get-started/about/lnc.rst): kernel[n] runs n programs, one per physical core
    # of the logical core (n = 2 on trn2/trn3 by default, LNC=2); program p takes the p-th share
    # of the tokens. The form of AWS's nki-library kernels (nl.num_programs / nl.program_id).
    programs, program = nl.num_programs(), nl.program_id(0)
    assert tokens % programs == 0, f"T={tokens} must be a multiple of the {programs} programs"
    per_program = tokens // programs
    plan = plan_slots(heads, dim, slots, max_chunk=max_chunk, indexed=indexed,
                      fp8_scale_groups=scale_groups,
                      index_sets=1 if second is None else 2)  # fmt: skip
    assert value_dim is None or (isinstance(value_dim, int) and 0 < value_dim <= dim), (
        f"value_dim={value_dim!r} must be an int in [1, D={dim}]"
    )
    values = dim if value_dim is None else value_dim
    out = nl.ndarray((tokens, heads, values), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    lse = nl.ndarray((tokens, heads, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    scratch = None
    if not plan.scores_in_sbuf:
        # The token's logits between the passes, when even they do not fit in SBUF; one slice
        # per program.
        scratch = nl.ndarray((programs, heads, slots), dtype=nl.float32, buffer=nl.hbm)
        scratch = scratch[program]
    sink_col = nl.load(sink)
    assert isinstance(value_shift, int) and 0 <= value_shift < 64, f"value_shift={value_shift!r}"
    src = _Source(q, slot_rows, idx, bias, heads, dim, slots, None, _Engines(PSUM_READ_ENGINES),
                  _Engines(CLAMP_ENGINES), value_shift, slot_scale,
                  (_Engines(DEQUANT_ENGINES if rope is None else SPLIT_DEQUANT_ENGINES)
                   if slot_scale is not None else None),
                  scale_groups, value_dim=0 if values == dim else values)  # fmt: skip
    if second is not None:
        src.extra_rows, src.extra_idx, src.main_slots, src.extra_rope, src.extra_16bit = second
    src.rope_rows = rope
    if slot_scale is not None:
        src.fp8_zeros = nl.ndarray((KERNEL_TILE, plan.chunk // KERNEL_TILE, slot_rows.shape[1]),
                                   dtype=slot_rows.dtype, buffer=nl.sbuf)  # fmt: skip
        nisa.memset(dst=src.fp8_zeros, value=0.0, engine=nisa.engine.gpsimd)

    # A hardware loop over the program's tokens (nl.fori_loop, NKI >= 0.6): its body is compiled
    # once, so the kernel's size does not grow with T. The induction variable is a register
    # holding the token (nki.language.fori_loop page), the scalar_offset of every access to the
    # token's data. The body returns nothing; what outlives it (out, lse, scratch) was allocated
    # before the loop.
    def token_body(token):
        _attend_one_token(dataclasses.replace(src, token=token), plan, sink_col, out, lse, scratch)

    nl.fori_loop(program * per_program, (program + 1) * per_program, token_body)
    return out, lse


def gathered_attn_idx_kernel(q, kv, idx, bias, sink, value_shift=0, max_chunk=None,
                             value_dim=None):  # fmt: skip
    """Sparse attention gathering the slot rows of ``kv`` inside the kernel (trn2, trn3).

    Args:
      q: ``[T, H, D]`` bf16. kv: ``[R, D]`` bf16 cache (R > 0).
      idx: ``[T, 128, Kp/128]`` uint32, ``idx[t, p, kc]`` the row of slot ``kc*128 + p``; an
        index ``>= R`` (``EMPTY_SLOT_INDEX``) is an empty slot whose row is never read.
      bias: ``[T, 16 + Kp]`` f32: column 0 the scale, columns 1 and 2 the factors that multiply
        the dot products back (q comes scaled down by their product; 1.0 when it is not), columns
        16.. the per-slot bias.
      sink: ``[H, 1]`` f32.
      value_shift: compile-time int ``c``: the value product runs on probabilities scaled by
        ``2**-c`` and its result is scaled back by ``2**c`` (``constants.value_shift(K)``).
      max_chunk: optional cap on the slots per chunk (a compile-time constant; tests).
      value_dim: compile-time int in ``[1, D]`` or ``None`` (D): the logits use all D columns of
        each row, the value product and the output only the first ``value_dim``.
    Returns ``(out [T, H, value_dim] bf16, lse [T, H, 1] f32)`` in shared HBM. Launch it as
    ``kernel[n]`` with ``n`` the physical cores per logical core (T a multiple of n).
    """
    slots = bias.shape[1] - BIAS_PREFIX_COLS
    assert tuple(idx.shape) == (bias.shape[0], KERNEL_TILE, slots // KERNEL_TILE), (
        f"idx {idx.shape} must be [T, 128, Kp/128] to match bias {bias.shape}"
    )
    return _sparse_attn_kernel_body(q, kv, idx, bias, sink, value_shift, max_chunk,
                                    value_dim=value_dim)  # fmt: skip


def gathered_attn_idx_fp8_kernel(q, kv, slot_scale, idx, bias, sink, value_shift=0, max_chunk=None,
                                 value_dim=None):  # fmt: skip
    """:func:`gathered_attn_idx_kernel` on an FP8 cache, dequantised on chip (trn2, trn3).

    Args:
      kv: ``[R, D]`` ``float8_e4m3fn`` or ``float8_e5m2`` (R > 0).
      slot_scale: ``[T, 128, Kp/128 * n]`` f32, laid out as ``idx``: ``slot_scale[t, p, kc*n + g]``
        scales columns ``g*D/n .. (g+1)*D/n`` of the row of slot ``kc*128 + p`` (``n`` dividing
        D; ``n = 1``: one scale per row); 0 for an empty slot. The kernel computes on
        ``(kv.astype(f32) * scale).astype(bf16)`` of the gathered rows only; the row of an empty
        slot is never read. Other arguments and the result as :func:`gathered_attn_idx_kernel`.
    """
    groups = _fp8_scale_groups(kv, slot_scale, idx, bias)
    return _sparse_attn_kernel_body(q, kv, idx, bias, sink, value_shift, max_chunk, slot_scale,
                                    groups, value_dim)  # fmt: skip


def _fp8_scale_groups(kv, slot_scale, idx, bias, q=None) -> int:
    """Trace-time checks of an FP8 kernel's cache, scales and indices; the scale groups ``n``.
    With ``q`` (split rows), the FP8 columns must be fewer than q's."""
    k_tiles = (bias.shape[1] - BIAS_PREFIX_COLS) // KERNEL_TILE
    assert tuple(idx.shape) == (bias.shape[0], KERNEL_TILE, k_tiles), (
        f"idx {idx.shape} must be [T, 128, Kp/128] to match bias {bias.shape}"
    )
    fp8_dtypes = (nl.float8_e4m3fn, nl.float8_e5m2)  # nki.language dtypes (nl is bound late)
    assert kv.ndim == 2 and kv.dtype in fp8_dtypes, f"kv {kv.shape} {kv.dtype} must be FP8"
    groups = slot_scale.shape[2] // k_tiles if slot_scale.ndim == 3 else 0
    assert (slot_scale.ndim == 3 and tuple(slot_scale.shape[:2]) == tuple(idx.shape[:2])
            and groups > 0 and slot_scale.shape[2] == k_tiles * groups
            and kv.shape[1] % groups == 0), (
        f"slot_scale {slot_scale.shape} must be [T, 128, Kp/128 * n] with n dividing D={kv.shape[1]}"
    )  # fmt: skip
    if q is not None:
        assert 0 < kv.shape[1] < q.shape[2], f"kv {kv.shape} must be [R, D8], 0 < D8 < D={q.shape[2]}"
    return groups


def gathered_attn_idx_fp8_split_kernel(q, kv, kv_rope, slot_scale, idx, bias, sink, value_shift=0,
                                       max_chunk=None, value_dim=None):  # fmt: skip
    """:func:`gathered_attn_idx_fp8_kernel` on DeepSeek's split rows (trn2, trn3).

    Args:
      kv: ``[R, D8]`` FP8, the quantised columns; ``slot_scale``'s ``n`` groups divide ``D8``.
      kv_rope: ``[R, D - D8]`` bf16, the columns after them (``D`` is q's width); gathered with
        the same indices, so the kernel computes on the logical rows
        ``[(kv.astype(f32) * scale).astype(bf16) | kv_rope]`` of the slots only.
    Other arguments and the result as :func:`gathered_attn_idx_fp8_kernel`.
    """
    groups = _fp8_scale_groups(kv, slot_scale, idx, bias, q)
    return _sparse_attn_kernel_body(q, kv, idx, bias, sink, value_shift, max_chunk, slot_scale,
                                    groups, value_dim, rope=kv_rope)  # fmt: skip


def _beside_a_second_cache(q, kv, kv_rope, slot_scale, idx, bias, sink, value_shift, max_chunk,
                           value_dim, second: _SecondCache):  # fmt: skip
    """The body call of the FP8 two-cache kernels below (the body checks the second cache)."""
    groups = _fp8_scale_groups(kv, slot_scale, idx, bias, None if kv_rope is None else q)
    return _sparse_attn_kernel_body(q, kv, idx, bias, sink, value_shift, max_chunk, slot_scale,
                                    groups, value_dim, second=second, rope=kv_rope)  # fmt: skip


def gathered_attn_idx_fp8_split_two_caches_kernel(q, kv, kv_rope, extra_kv, extra_rope, slot_scale,
                                                  idx, extra_idx, bias, sink, value_shift=0,
                                                  max_chunk=None, value_dim=None,
                                                  main_slots=0):  # fmt: skip
    """Two caches of split FP8 rows in one softmax (V4 keeps both so; trn2, trn3): each as
    :func:`gathered_attn_idx_fp8_split_kernel` reads its one, placed as
    :func:`gathered_attn_idx_two_caches_kernel` places two caches' slots.

    Args:
      kv, extra_kv: ``[R, D8]``, ``[R2, D8]``, one FP8 dtype; kv_rope, extra_rope: ``[R, D - D8]``,
        ``[R2, D - D8]`` bf16. slot_scale: ``[T, 128, Kp/128 * n]`` f32, each slot's scales from
        its own cache (the same ``n`` groups). idx, extra_idx, main_slots: as
        :func:`gathered_attn_idx_two_caches_kernel`.
    Other arguments and the result as :func:`gathered_attn_idx_fp8_kernel`.
    """
    return _beside_a_second_cache(q, kv, kv_rope, slot_scale, idx, bias, sink, value_shift,
                                  max_chunk, value_dim,
                                  _SecondCache(extra_kv, extra_idx, main_slots, extra_rope))


def gathered_attn_idx_fp8_two_caches_kernel(q, kv, extra_kv, slot_scale, idx, extra_idx, bias, sink,
                                            value_shift=0, max_chunk=None, value_dim=None,
                                            main_slots=0):  # fmt: skip
    """Two FP8 caches of whole rows ``[R, D]``, ``[R2, D]`` (one FP8 dtype, the same ``n`` scale
    groups) in one softmax (trn2, trn3): :func:`gathered_attn_idx_fp8_split_two_caches_kernel`
    without rope columns."""
    return _beside_a_second_cache(q, kv, None, slot_scale, idx, bias, sink, value_shift, max_chunk,
                                  value_dim, _SecondCache(extra_kv, extra_idx, main_slots))


def gathered_attn_idx_fp8_beside_16bit_kernel(q, kv, extra_kv, slot_scale, idx, extra_idx, bias,
                                              sink, value_shift=0, max_chunk=None, value_dim=None,
                                              main_slots=0):  # fmt: skip
    """An FP8 cache of whole rows beside a 16-bit second cache in one softmax (trn2, trn3):
    :func:`gathered_attn_idx_fp8_split_beside_16bit_kernel` without rope columns."""
    return _beside_a_second_cache(
        q, kv, None, slot_scale, idx, bias, sink, value_shift, max_chunk, value_dim,
        _SecondCache(extra_kv, extra_idx, main_slots, whole_16bit=True))


def gathered_attn_idx_fp8_split_beside_16bit_kernel(q, kv, kv_rope, extra_kv, slot_scale, idx,
                                                    extra_idx, bias, sink, value_shift=0,
                                                    max_chunk=None, value_dim=None,
                                                    main_slots=0):  # fmt: skip
    """Split FP8 rows beside a 16-bit second cache in one softmax (V4's FP8 compressed rows and a
    bf16 window; trn2, trn3): the main cache's slots as :func:`gathered_attn_idx_fp8_split_kernel`
    reads them, the second cache's whole bf16 rows ``extra_kv [R2, D]`` by their own indirect DMA
    into the same tiles after the dequantisation (their scales are 0 in ``slot_scale``), placed
    as :func:`gathered_attn_idx_two_caches_kernel` places two caches' slots.
    """
    return _beside_a_second_cache(
        q, kv, kv_rope, slot_scale, idx, bias, sink, value_shift, max_chunk, value_dim,
        _SecondCache(extra_kv, extra_idx, main_slots, whole_16bit=True))


def gathered_attn_idx_two_caches_kernel(q, kv, idx, extra_kv, extra_idx, bias, sink, value_shift=0,
                                        max_chunk=None, value_dim=None, main_slots=0):  # fmt: skip
    """:func:`gathered_attn_idx_kernel` over two bf16 caches in one softmax (trn2, trn3).

    Args:
      kv: ``[R, D]`` bf16, the main cache; extra_kv: ``[R2, D]`` bf16, the second (R, R2 > 0).
      idx, extra_idx: ``[T, 128, Kp/128]`` uint32 each, laid out as ``idx`` of
        :func:`gathered_attn_idx_kernel`: slot ``j < main_slots`` reads row ``idx`` of ``kv``, slot
        ``j >= main_slots`` row ``extra_idx`` of ``extra_kv``; every other entry (and an empty
        slot's) is ``EMPTY_SLOT_INDEX``, read by no DMA.
      main_slots: compile-time int, the main cache's slots ``K`` (the second cache's follow, as in
        the single-cache call on ``[kv; extra_kv]``: the same slots in the same places).
    Other arguments and the result as :func:`gathered_attn_idx_kernel`.
    """
    slots = bias.shape[1] - BIAS_PREFIX_COLS
    assert tuple(idx.shape) == (bias.shape[0], KERNEL_TILE, slots // KERNEL_TILE), (
        f"idx {idx.shape} must be [T, 128, Kp/128] to match bias {bias.shape}"
    )
    return _sparse_attn_kernel_body(q, kv, idx, bias, sink, value_shift, max_chunk,
                                    value_dim=value_dim,
                                    second=_SecondCache(extra_kv, extra_idx, main_slots))  # fmt: skip


def gathered_attn_kernel(q, g, bias, sink, value_shift=0, max_chunk=None, value_dim=None):
    """Sparse attention over pre-gathered slot rows; runs on every target (trn1 included: it
    uses neither ``dma_transpose`` nor indirect DMA).

    Args:
      q: ``[T, H, D]`` bf16. g: ``[T, Kp, D]`` bf16; the rows of empty and padding slots hold
        zeros. bias: ``[T, 16 + Kp]`` f32: column 0 the scale, columns 16.. the per-slot bias.
      sink: ``[H, 1]`` f32. value_shift, max_chunk, value_dim: as :func:`gathered_attn_idx_kernel`.
    Returns ``(out [T, H, value_dim] bf16, lse [T, H, 1] f32)`` in shared HBM; launch as
    :func:`gathered_attn_idx_kernel`.
    """
    return _sparse_attn_kernel_body(q, g, None, bias, sink, value_shift, max_chunk,
                                    value_dim=value_dim)  # fmt: skip
