"""NKI kernels (NKI >= 0.3) for top-k sparse attention with per-head sinks.

Three kernels share one body (docs/neuron-kernel.md describes the interface, the variants and
the instruction pattern); they differ in how q and a token's slot rows reach SBUF:

- ``gathered_attn_idx_kernel(q2, kv, idx, bias, sink)`` (trn2, trn3): the kernel gathers the rows
  of the cache ``kv [R, D]`` itself, one indirect DMA per 128 slots driven by ``idx [T, Kp]``
  uint32, with ``oob_mode=skip`` into a zeroed tile: an empty or padding slot carries an index
  outside the cache and reads nothing (nki.isa.dma_copy page, "oob_mode"). q is transposed by
  ``dma_transpose``.
- ``gathered_attn_kernel(q2, g2, bias, sink)`` (trn2, trn3): the slots are pre-gathered in HBM,
  ``g2 [T*Kp, D]`` with row ``t*Kp + j`` and every empty or padding slot's row zero (the packing
  writes those zeros); each 128-slot tile is one plain DMA. q by ``dma_transpose``.
- ``gathered_attn_trn1_kernel(q2, g2, bias, sink)`` (every target, the one for trn1): as the
  pre-gathered kernel, but q is transposed on the TensorEngine, so it needs neither
  ``dma_transpose`` nor indirect DMA, which the NKI docs give for NeuronCore-v3 and later only.

Common interface::

    q2    [T*H, D]          bf16   query rows, row t*H + h
    bias  [T, 16 + Kp]      f32    column SCALE_COL (0) = softmax scale of token t,
                                   columns BIAS_PREFIX_COLS (16).. = per-slot logit bias;
                                   an empty slot has bias EMPTY_LOGIT (-1e30)
    sink  [H, 1]            f32    per-head sink logit (-inf = none, +inf = zero output)
    ->    out [T*H, D] bf16 and lse [T*H, 1] f32, both in shared HBM

``lse = m + log(den)``: the slot max and the fp32 denominator (sink term included) of the softmax.
Requirements: ``D % 128 == 0``, ``Kp % 128 == 0``, ``H <= 128``, ``R > 0``. A row whose slots are
all empty has no meaningful output or lse (the packing overwrites both).

Per token (one pass when the token's slots fit in SBUF, else a pass per chunk of slots for the
logits and their max, then a second pass for exp and the values, so the arithmetic is the same):

1. q rows of the token transposed into ``qT [128 (d), D/128, H]``;
2. per chunk: the slot rows ``[128 (slot), C/128, D]`` (plain or indirect DMA), transposed on the
   PE into ``[128 (d), D/128, C]``; logits by ``nc_matmul`` accumulating over the D/128 chunks into
   PSUM ``[H, <=512]``; the logit saturation rule (docs/contract.md) and the bias on the way to
   SBUF; the chunk max;
3. ``activation(exp, bias=-max)`` per chunk with an add-reduction into the fp32 denominator, plus
   ``exp(sink - max)``;
4. probabilities rounded to bf16 and transposed into ``[128 (slot), C/128, H]``; values by
   ``nc_matmul`` accumulating over all slot tiles into PSUM ``[H, <=512]`` per 512-column block of
   D (one fp32 PSUM bank each), multiplied by ``1 / den`` into a bf16 row; lse; store.

The raw functions below are plain Python: ``nki.jit`` is applied where they are called on Neuron
(:mod:`jax_sparse_attn.neuron.lowering`), the project's emulator and ``nki.simulate`` take them as
they are. Importing this module never needs the Neuron SDK.
"""

from __future__ import annotations

import dataclasses

from ..constants import (
    BIAS_PREFIX_COLS,
    DMA_TRANSPOSE_ALIGN_ELEMS,
    FLT_MAX,
    KERNEL_TILE,
    LOGIT_LIMIT,
    MATMUL_MAX_N,
    MAX_HEADS_PER_CALL,
    PSUM_BANKS,
    SBUF_BYTES_PER_PARTITION,
    SCALE_COL,
    TARGETS_WITH_DGE,
)

try:  # The Neuron SDK only exists on a Trainium host (Neuron pip repository).
    import nki
    import nki.isa as nisa
    import nki.language as nl
except ImportError:
    nki = nl = nisa = None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def aligned_heads(heads: int) -> int:
    """Head axis of the transposed q tile: ``dma_transpose`` needs 32-byte aligned destinations."""
    return _ceil_div(heads, DMA_TRANSPOSE_ALIGN_ELEMS) * DMA_TRANSPOSE_ALIGN_ELEMS


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
    *, q_on_pe: bool = False,
) -> int:
    """SBUF bytes per partition that one token's live tiles occupy at their peak.

    ``dim`` and ``slots`` are the padded kernel sizes (multiples of 128); ``chunk`` the slots per
    chunk (default: all). The token keeps its transposed q, scale and (if ``scores_in_sbuf``) its
    fp32 logits (``4 * Kp``) throughout; on top of that the first pass holds a chunk's rows and
    their transpose (about ``4 * C * D / 128``) and its bias (``8 * C``), the second pass the
    rows, the probabilities in fp32, bf16 and transposed (about ``8 * C`` with 128 heads) and the
    output row. 67 KiB at Kp = C = 2048, D = 640, H = 128.
    """
    chunk = slots if chunk is None else chunk
    chunks = _ceil_div(slots, chunk)
    k_tiles, d_tiles = chunk // KERNEL_TILE, dim // KERNEL_TILE
    q_transposed = d_tiles * aligned_heads(heads) * 2
    prefix = 2 * BIAS_PREFIX_COLS * 4  # the loaded scale row and its broadcast to H heads
    columns = 4 * (2 + 2 * chunks)  # sink, -max; chunk maxima and sums
    token = q_transposed + prefix + columns + (slots * 4 if scores_in_sbuf else 0)
    rows = k_tiles * dim * 2 + 2 * 4  # bf16 rows + the uint32 index columns in flight
    spilled_chunk = 0 if scores_in_sbuf else chunk * 4
    first_pass = rows + d_tiles * chunk * 2 + 2 * chunk * 4 + MATMUL_MAX_N * 4 + spilled_chunk
    second_pass = (
        rows + spilled_chunk + chunk * 4 + chunk * 2 + k_tiles * heads * 2 + dim * 2 + 6 * 4
    )
    q_on_the_pe = dim * 2 if q_on_pe else 0  # the [H, D] q rows, before the first pass
    return token + max(first_pass, second_pass, q_on_the_pe)


def plan_slots(
    heads: int, dim: int, slots: int, *, max_chunk: int | None = None, q_on_pe: bool = False,
    budget: int = SBUF_BYTES_PER_PARTITION,
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
            need = sbuf_bytes_per_partition(
                heads, dim, slots, chunk, scores_in_sbuf, q_on_pe=q_on_pe
            )
            if need <= budget:
                return SlotPlan(slots=slots, chunk=chunk, scores_in_sbuf=scores_in_sbuf)
    raise ValueError(
        f"head dim D={dim} is too large for the NKI kernel: one 128-slot chunk of rows and its "
        f"transpose with {heads} heads need "
        f"{sbuf_bytes_per_partition(heads, dim, slots, KERNEL_TILE, False, q_on_pe=q_on_pe)} bytes "
        f"of SBUF per partition, more than {budget}; use implementation='reference'"
    )


def _check_interface(q2, slot_rows, bias, sink, tokens: int, slots: int):
    """Trace-time checks of the kernel interface; returns (heads, dim)."""
    rows, dim = q2.shape
    assert tokens > 0 and rows % tokens == 0, f"q2 {q2.shape} is not [T*H, D] for T={tokens}"
    heads = rows // tokens
    assert 0 < heads <= MAX_HEADS_PER_CALL, f"H={heads} must be in [1, {MAX_HEADS_PER_CALL}]"
    assert dim % KERNEL_TILE == 0, f"D={dim} must be a multiple of {KERNEL_TILE}"
    assert slots > 0 and slots % KERNEL_TILE == 0, f"Kp={slots} must be a multiple of {KERNEL_TILE}"
    assert slot_rows.shape[0] > 0 and slot_rows.shape[1] == dim, (
        f"slot rows {slot_rows.shape} must be [R > 0, D={dim}]"
    )
    assert tuple(bias.shape) == (tokens, BIAS_PREFIX_COLS + slots), (
        f"bias {bias.shape} must be [T, {BIAS_PREFIX_COLS} + Kp] = ({tokens}, "
        f"{BIAS_PREFIX_COLS + slots})"
    )
    assert tuple(sink.shape) == (heads, 1), f"sink {sink.shape} must be [H, 1] = ({heads}, 1)"
    return heads, dim


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where the kernel reads from: its HBM operands and its variant."""

    q2: object
    slot_rows: object  # kv [R, D] (indexed) or g2 [T*Kp, D]
    idx: object  # [T, Kp] uint32 (indexed) or None
    bias: object
    heads: int
    dim: int
    slots: int
    q_on_pe: bool  # transpose q on the TensorEngine (trn1) instead of dma_transpose

    @property
    def indexed(self) -> bool:
        return self.idx is not None


def _transposed_q(src: _Source, t: int):
    """q rows of token t as ``[128 (d), D/128, Ha]`` bf16: the contraction dim on the partitions."""
    heads, d_tiles = src.heads, src.dim // KERNEL_TILE
    first = t * heads
    q_t = nl.ndarray((KERNEL_TILE, d_tiles, aligned_heads(heads)), dtype=nl.bfloat16, buffer=nl.sbuf)
    if src.q_on_pe:
        # NeuronCore-v2 has no dma_transpose: load the [H, D] rows and transpose each 128-column
        # block through PSUM on the TensorEngine.
        q_rows = nl.load(src.q2[first : first + heads, :])
        q_psum = nl.ndarray((KERNEL_TILE, heads), dtype=nl.bfloat16, buffer=nl.psum)
        for dc in nl.static_range(d_tiles):
            nisa.nc_transpose(dst=q_psum, data=q_rows[:, dc * KERNEL_TILE : (dc + 1) * KERNEL_TILE])
            nisa.tensor_copy(dst=q_t[:, dc, 0:heads], src=q_psum)
    else:
        for dc in nl.static_range(d_tiles):
            nisa.dma_transpose(
                dst=q_t[:, dc, 0:heads],
                src=src.q2[first : first + heads, dc * KERNEL_TILE : (dc + 1) * KERNEL_TILE],
            )
    return q_t


def _fetch_slot_rows(src: _Source, t: int, c0: int, width: int):
    """Slots ``c0 .. c0 + width`` of token t as ``[128 (slot), width/128, D]`` bf16 in SBUF.

    Indexed: each 128-slot tile is one indirect DMA whose partition p reads row
    ``idx[t, c0 + kc*128 + p]`` of the cache. An empty or padding slot's index is out of range
    (``EMPTY_SLOT_INDEX``): ``oob_mode=skip`` leaves its row as the zeros written just before,
    so no unselected cache row is ever read (nki.isa.dma_copy page, "oob_mode"; the same page's
    gather example takes uint32 indices). Pre-gathered: the contiguous block of rows
    ``t*Kp + c0 ..`` of ``g2``, whose unselected rows the packing zeroed.
    """
    k_tiles, dim = width // KERNEL_TILE, src.dim
    rows = nl.ndarray((KERNEL_TILE, k_tiles, dim), dtype=nl.bfloat16, buffer=nl.sbuf)
    if src.indexed:
        nisa.memset(dst=rows, value=0.0)
    for kc in nl.static_range(k_tiles):
        first = t * src.slots + c0 + kc * KERNEL_TILE
        if src.indexed:
            # One index per partition: 128 consecutive uint32 of idx, partition stride 1.
            row_index = nl.ndarray((KERNEL_TILE, 1), dtype=nl.uint32, buffer=nl.sbuf)
            nisa.dma_copy(
                dst=row_index, src=src.idx.ap(pattern=[[1, KERNEL_TILE], [1, 1]], offset=first)
            )
            nisa.dma_copy(
                dst=rows[:, kc, :],
                src=src.slot_rows.ap(
                    pattern=[[dim, KERNEL_TILE], [1, dim]],
                    offset=0,
                    vector_offset=row_index,
                    indirect_dim=0,
                ),
                oob_mode=nisa.oob_mode.skip,
            )
        else:
            nisa.dma_copy(dst=rows[:, kc, :], src=src.slot_rows[first : first + KERNEL_TILE, :])
    return rows


def _transposed_rows(src: _Source, rows, width: int):
    """``[128 (slot), width/128, D]`` rows -> ``[128 (d), D/128, width]`` through the PE."""
    k_tiles, d_tiles = width // KERNEL_TILE, src.dim // KERNEL_TILE
    rows_t = nl.ndarray((KERNEL_TILE, d_tiles, width), dtype=nl.bfloat16, buffer=nl.sbuf)
    transpose_psum = nl.ndarray((KERNEL_TILE, KERNEL_TILE), dtype=nl.bfloat16, buffer=nl.psum)
    for kc in nl.static_range(k_tiles):
        for dc in nl.static_range(d_tiles):
            nisa.nc_transpose(
                dst=transpose_psum, data=rows[:, kc, dc * KERNEL_TILE : (dc + 1) * KERNEL_TILE]
            )
            nisa.tensor_copy(
                dst=rows_t[:, dc, kc * KERNEL_TILE : (kc + 1) * KERNEL_TILE], src=transpose_psum
            )
    return rows_t


def _chunk_logits(src: _Source, q_t, rows_t, scale_col, t: int, c0: int, width: int, dst):
    """Logits of slots ``c0 .. c0 + width`` of token t into ``dst [H, width]`` f32 (SBUF).

    ``q . x`` accumulates in fp32 PSUM over the D/128 chunks, at most 512 slots per matmul (one
    PSUM bank). Then the saturation rule of docs/contract.md, in fp32: ``a`` clamped to
    ``+-FLT_MAX`` (an overflowed accumulator is +-inf), ``a * scale`` clamped to
    ``+-LOGIT_LIMIT``, plus the bias. The scale never touches bf16 q.
    """
    heads, d_tiles = src.heads, src.dim // KERNEL_TILE
    bias_row = nl.load(
        src.bias[t : t + 1, BIAS_PREFIX_COLS + c0 : BIAS_PREFIX_COLS + c0 + width]
    )
    bias_heads = nl.broadcast_to(bias_row, shape=(heads, width))
    score_psum = nl.ndarray((heads, MATMUL_MAX_N), dtype=nl.float32, buffer=nl.psum)
    saturated = nl.ndarray((heads, MATMUL_MAX_N), dtype=nl.float32, buffer=nl.sbuf)
    for nb in nl.static_range(_ceil_div(width, MATMUL_MAX_N)):
        n0 = nb * MATMUL_MAX_N
        n = min(MATMUL_MAX_N, width - n0)
        for dc in nl.static_range(d_tiles):
            nisa.nc_matmul(
                dst=score_psum[:, 0:n],
                stationary=q_t[:, dc, 0:heads],
                moving=rows_t[:, dc, n0 : n0 + n],
                accumulate=dc > 0,
            )
        nisa.tensor_scalar(
            dst=saturated[:, 0:n], data=score_psum[:, 0:n],
            op0=nl.maximum, operand0=-FLT_MAX, op1=nl.minimum, operand1=FLT_MAX,
        )  # fmt: skip
        nisa.tensor_scalar(
            dst=saturated[:, 0:n], data=saturated[:, 0:n],
            op0=nl.multiply, operand0=scale_col, op1=nl.maximum, operand1=-LOGIT_LIMIT,
        )  # fmt: skip
        nisa.scalar_tensor_tensor(
            dst=dst[:, n0 : n0 + n], data=saturated[:, 0:n],
            op0=nl.minimum, operand0=LOGIT_LIMIT, op1=nl.add, operand1=bias_heads[:, n0 : n0 + n],
        )  # fmt: skip


def _transposed_probs(heads: int, probs_bf16, width: int):
    """``[H, width]`` bf16 probabilities -> ``[128 (slot), width/128, H]`` through the PE."""
    k_tiles = width // KERNEL_TILE
    probs_t = nl.ndarray((KERNEL_TILE, k_tiles, heads), dtype=nl.bfloat16, buffer=nl.sbuf)
    probs_psum = nl.ndarray((KERNEL_TILE, heads), dtype=nl.bfloat16, buffer=nl.psum)
    for kc in nl.static_range(k_tiles):
        nisa.nc_transpose(
            dst=probs_psum, data=probs_bf16[:, kc * KERNEL_TILE : (kc + 1) * KERNEL_TILE]
        )
        nisa.tensor_copy(dst=probs_t[:, kc, :], src=probs_psum)
    return probs_t


def _attend_one_token(src: _Source, plan: SlotPlan, sink_col, out, lse, scratch, t: int):
    """Computes ``out[t*H : (t+1)*H, :]`` and ``lse[t*H : (t+1)*H]`` (module docstring, 1-4)."""
    heads, dim = src.heads, src.dim
    chunks = plan.chunks
    bounds = [(c * plan.chunk, min(plan.chunk, plan.slots - c * plan.chunk)) for c in range(chunks)]

    q_t = _transposed_q(src, t)
    # The token's scale (column SCALE_COL), broadcast to the H head partitions.
    prefix = nl.broadcast_to(
        nl.load(src.bias[t : t + 1, 0:BIAS_PREFIX_COLS]), shape=(heads, BIAS_PREFIX_COLS)
    )
    scale_col = prefix[:, SCALE_COL : SCALE_COL + 1]

    # Pass 1: logits and their max (the max runs over the slots only, never the sink).
    scores = None
    if plan.scores_in_sbuf:
        scores = nl.ndarray((heads, plan.slots), dtype=nl.float32, buffer=nl.sbuf)
    chunk_max = nl.ndarray((heads, chunks), dtype=nl.float32, buffer=nl.sbuf)
    rows = None
    for c, (c0, width) in enumerate(bounds):
        rows = _fetch_slot_rows(src, t, c0, width)
        rows_t = _transposed_rows(src, rows, width)
        if plan.scores_in_sbuf:
            chunk_scores = scores[:, c0 : c0 + width]
        else:
            chunk_scores = nl.ndarray((heads, width), dtype=nl.float32, buffer=nl.sbuf)
        _chunk_logits(src, q_t, rows_t, scale_col, t, c0, width, chunk_scores)
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
    value_blocks = _ceil_div(dim, MATMUL_MAX_N)
    out_rows = nl.ndarray((heads, dim), dtype=nl.bfloat16, buffer=nl.sbuf)
    chunk_sum = nl.ndarray((heads, chunks), dtype=nl.float32, buffer=nl.sbuf)
    inv_denominator = nl.ndarray((heads, 1), dtype=nl.float32, buffer=nl.sbuf)
    denominator = nl.ndarray((heads, 1), dtype=nl.float32, buffer=nl.sbuf)
    for g0 in nl.static_range(0, value_blocks, VALUE_PSUM_BANKS):
        group = list(range(g0, min(value_blocks, g0 + VALUE_PSUM_BANKS)))
        value_psum = [
            nl.ndarray((heads, MATMUL_MAX_N), dtype=nl.float32, buffer=nl.psum) for _ in group
        ]
        for c, (c0, width) in enumerate(bounds):
            if chunks > 1:
                rows = _fetch_slot_rows(src, t, c0, width)
            if plan.scores_in_sbuf:
                chunk_scores = scores[:, c0 : c0 + width]
            else:
                chunk_scores = nl.load(scratch[:, c0 : c0 + width])
            probs = nl.ndarray((heads, width), dtype=nl.float32, buffer=nl.sbuf)
            if g0 == 0:
                # reduce_cmd=reset_reduce: since NKI 0.3 the default (idle) leaves the Scalar
                # Engine's accumulator registers alone; reset_reduce zeroes them and sums this
                # instruction's output (nki.isa.activation page).
                nisa.activation(
                    dst=probs, op=nl.exp, data=chunk_scores, bias=neg_max, scale=1.0,
                    reduce_op=nl.add, reduce_res=chunk_sum[:, c : c + 1],
                    reduce_cmd=nisa.reduce_cmd.reset_reduce,
                )  # fmt: skip
            else:
                nisa.activation(dst=probs, op=nl.exp, data=chunk_scores, bias=neg_max, scale=1.0)
            probs_bf16 = nl.ndarray((heads, width), dtype=nl.bfloat16, buffer=nl.sbuf)
            nisa.tensor_copy(dst=probs_bf16, src=probs)
            probs_t = _transposed_probs(heads, probs_bf16, width)
            for i, vb in enumerate(group):
                v0 = vb * MATMUL_MAX_N
                n = min(MATMUL_MAX_N, dim - v0)
                for kc in nl.static_range(width // KERNEL_TILE):
                    nisa.nc_matmul(
                        dst=value_psum[i][:, 0:n],
                        stationary=probs_t[:, kc, :],
                        moving=rows[:, kc, v0 : v0 + n],
                        accumulate=c > 0 or kc > 0,
                    )
            del probs, probs_bf16, probs_t, chunk_scores
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
        for i, vb in enumerate(group):
            v0 = vb * MATMUL_MAX_N
            n = min(MATMUL_MAX_N, dim - v0)
            nisa.tensor_scalar(
                dst=out_rows[:, v0 : v0 + n], data=value_psum[i][:, 0:n],
                op0=nl.multiply, operand0=inv_denominator,
            )  # fmt: skip
        del value_psum
    first = t * heads
    nl.store(out[first : first + heads, :], value=out_rows)

    # lse = max + log(den) = log(den) - (-max).
    log_den = nl.ndarray((heads, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=log_den, op=nl.log, data=denominator)
    lse_col = nl.ndarray((heads, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=lse_col, data=log_den, op0=nl.subtract, operand0=neg_max)
    nl.store(lse[first : first + heads, :], value=lse_col)


def _sparse_attn_kernel_body(q2, slot_rows, idx, bias, sink, slots, q_on_pe, max_chunk):
    tokens = bias.shape[0]
    heads, dim = _check_interface(q2, slot_rows, bias, sink, tokens, slots)
    src = _Source(q2, slot_rows, idx, bias, heads, dim, slots, q_on_pe)
    plan = plan_slots(heads, dim, slots, max_chunk=max_chunk, q_on_pe=q_on_pe)
    out = nl.ndarray((tokens * heads, dim), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    lse = nl.ndarray((tokens * heads, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    scratch = None
    if not plan.scores_in_sbuf:
        # The token's logits between the passes, when even they do not fit in SBUF.
        scratch = nl.ndarray((heads, slots), dtype=nl.float32, buffer=nl.hbm)
    sink_col = nl.load(sink)
    for t in nl.static_range(tokens):
        _attend_one_token(src, plan, sink_col, out, lse, scratch, t)
    return out, lse


def gathered_attn_idx_kernel(q2, kv, idx, bias, sink, max_chunk=None):
    """Sparse attention gathering the slot rows of ``kv`` inside the kernel (trn2, trn3).

    Args:
      q2: ``[T*H, D]`` bf16, row ``t*H + h``. kv: ``[R, D]`` bf16 cache (R > 0).
      idx: ``[T, Kp]`` uint32; an index ``>= R`` (``EMPTY_SLOT_INDEX``) is an empty slot whose
        row is never read.
      bias: ``[T, 16 + Kp]`` f32: column 0 the scale, columns 16.. the per-slot bias.
      sink: ``[H, 1]`` f32.
      max_chunk: optional cap on the slots per chunk (a compile-time constant; tests).
    Returns ``(out [T*H, D] bf16, lse [T*H, 1] f32)`` in shared HBM.
    """
    assert tuple(idx.shape) == (bias.shape[0], bias.shape[1] - BIAS_PREFIX_COLS), (
        f"idx {idx.shape} must be [T, Kp] to match bias {bias.shape}"
    )
    return _sparse_attn_kernel_body(q2, kv, idx, bias, sink, idx.shape[1], False, max_chunk)


def _pre_gathered(q2, g2, bias, sink, q_on_pe, max_chunk):
    tokens, slots = bias.shape[0], bias.shape[1] - BIAS_PREFIX_COLS
    assert g2.shape[0] == tokens * slots, f"g2 {g2.shape} must be [T*Kp, D] = [{tokens * slots}, D]"
    return _sparse_attn_kernel_body(q2, g2, None, bias, sink, slots, q_on_pe, max_chunk)


def gathered_attn_kernel(q2, g2, bias, sink, max_chunk=None):
    """Sparse attention over pre-gathered slot rows (trn2, trn3: q by ``dma_transpose``).

    Args:
      q2: ``[T*H, D]`` bf16, row ``t*H + h``. g2: ``[T*Kp, D]`` bf16, row ``t*Kp + j``; the rows
        of empty and padding slots hold zeros.
      bias: ``[T, 16 + Kp]`` f32: column 0 the scale, columns 16.. the per-slot bias.
      sink: ``[H, 1]`` f32. max_chunk: as :func:`gathered_attn_idx_kernel`.
    Returns ``(out [T*H, D] bf16, lse [T*H, 1] f32)`` in shared HBM.
    """
    return _pre_gathered(q2, g2, bias, sink, False, max_chunk)


def gathered_attn_trn1_kernel(q2, g2, bias, sink, max_chunk=None):
    """:func:`gathered_attn_kernel` without ``dma_transpose`` and indirect DMA (any target, trn1).

    q is transposed on the TensorEngine; operands and result as :func:`gathered_attn_kernel`.
    """
    return _pre_gathered(q2, g2, bias, sink, True, max_chunk)


def kernel_for(target: str, indexed: bool):
    """The raw kernel for an NKI target and primitive, and whether XLA gathers the rows first.

    On trn2 and trn3 the indexed primitive gathers inside the kernel; on trn1 (no indirect DMA,
    no ``dma_transpose``) both primitives run :func:`gathered_attn_trn1_kernel` on rows gathered
    by XLA. Returns ``(kernel, gathers_in_xla)``.
    """
    if target in TARGETS_WITH_DGE:
        if indexed:
            return gathered_attn_idx_kernel, False
        return gathered_attn_kernel, False
    return gathered_attn_trn1_kernel, indexed
