"""NKI kernels (NKI >= 0.3) for top-k sparse attention with per-head sinks.

Two kernels share one body and differ only in how a token's slot rows reach SBUF:

- ``gathered_attn_kernel(q2, g2, bias, sink)``: the slots are pre-gathered in HBM,
  ``g2 [T*Kp, D] bf16`` with row ``t*Kp + j``; each 128-slot tile is one plain DMA.
- ``gathered_attn_idx_kernel(q2, kv, idx, bias, sink)``: the kernel gathers rows of the cache
  ``kv [R, D] bf16`` itself, by an indirect DMA driven by ``idx [T, Kp] int32``.

Common interface (CONTRACT section 4)::

    q2    [T*H, D]          bf16   query rows, row t*H + h
    bias  [T, 16 + Kp]      f32    column SCALE_COL (0) = softmax scale of token t,
                                   columns BIAS_PREFIX_COLS (16).. = per-slot logit bias;
                                   an empty slot has bias EMPTY_LOGIT (-1e30)
    sink  [H, 1]            f32    per-head sink logit (-inf = none, +inf = zero output)
    ->    [T*H, D]          bf16   in shared HBM

Requirements: ``D % 128 == 0``, ``Kp % 128 == 0``, ``H <= 128``, ``R > 0``, every index in
``[0, R)`` (an empty slot is sent as index 0 with bias -1e30, so its probability is exactly 0).
A row whose slots are all empty is zeroed by the kernel only when a finite sink makes
``exp(sink + 1e30)`` overflow the denominator; the Neuron packing zeroes such rows in every case.

Per token (the instruction pattern of CONTRACT section 4):

1. ``dma_transpose`` the token's q rows into ``qT [128 (d), D/128, H]``;
2. fetch the slot rows ``[128 (slot), K/128, D]`` (plain or indirect DMA);
3. transpose them on the PE (``nc_transpose``, via PSUM) into ``[128 (d), D/128, Kp]``;
4. scores: ``nc_matmul`` accumulating over the D/128 chunks into PSUM ``[H, <=512]``, then
   ``scalar_tensor_tensor`` applies ``* scale + bias`` in fp32 on the way to SBUF;
5. row max (the sink is not in it); ``activation(exp, bias=-max)`` with an add-reduction into the
   fp32 denominator, plus ``exp(sink - max)``;
6. probabilities rounded to bf16 and transposed into ``[128 (slot), K/128, H]``;
7. values: ``nc_matmul`` accumulating over K/128 into PSUM ``[H, <=512]`` per 512-column block of
   D (one fp32 PSUM bank each), multiplied by ``1 / den`` on the way to a bf16 tile; store.

The raw functions below are plain Python: ``nki.jit`` is applied where they are called on Neuron
(:mod:`jax_sparse_attn.neuron.lowering`), the project's emulator and ``nki.simulate`` take them as
they are. Importing this module never needs the Neuron SDK.
"""

from __future__ import annotations

from ..constants import (
    BIAS_PREFIX_COLS,
    DMA_TRANSPOSE_ALIGN_ELEMS,
    KERNEL_TILE,
    MATMUL_MAX_N,
    MAX_HEADS_PER_CALL,
    SCALE_COL,
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


def sbuf_bytes_per_partition(heads: int, dim: int, slots: int) -> int:
    """SBUF bytes per partition that one token's tiles occupy (no reuse between them assumed).

    ``dim`` and ``slots`` are the padded kernel sizes (multiples of 128). About
    ``4 * Kp * D / 128`` bytes for the slot rows and their transpose, plus about ``20 * Kp`` for the
    bias row, the fp32 logits and probabilities (with 128 heads): 83 KiB at Kp = 2048, D = 640.
    """
    k_tiles, d_tiles = slots // KERNEL_TILE, dim // KERNEL_TILE
    q_transposed = d_tiles * aligned_heads(heads) * 2
    slot_rows = k_tiles * dim * 2 + k_tiles * 4  # bf16 rows + their int32 index column
    slot_columns = d_tiles * slots * 2
    bias_rows = 2 * (BIAS_PREFIX_COLS + slots) * 4  # the loaded row and its broadcast to H heads
    scores_and_probs = slots * 4 + slots * 4 + slots * 2 + k_tiles * heads * 2
    per_head_columns = 7 * 4  # sink, max, -max, slot sum, sink term, den, 1/den
    out_row = dim * 2
    return (
        q_transposed + slot_rows + slot_columns + bias_rows + scores_and_probs + per_head_columns
        + out_row
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


def _fetch_slot_rows(slot_rows, idx, t, slots, dim, indexed):
    """Token t's slot rows as ``[128 (slot), Kp/128, D]`` bf16 in SBUF.

    ``indexed``: ``slot_rows`` is the cache ``kv [R, D]`` and each 128-slot tile is one indirect
    DMA whose partition p reads row ``idx[t, kc*128 + p]``. Otherwise ``slot_rows`` is
    ``g2 [T*Kp, D]`` and the tile is the contiguous block of rows ``t*Kp + kc*128 ..``.
    """
    k_tiles = slots // KERNEL_TILE
    rows = nl.ndarray((KERNEL_TILE, k_tiles, dim), dtype=nl.bfloat16, buffer=nl.sbuf)
    for kc in nl.static_range(k_tiles):
        first = t * slots + kc * KERNEL_TILE
        if indexed:
            # One index per partition: 128 consecutive int32 of idx, partition stride 1.
            row_index = nl.ndarray((KERNEL_TILE, 1), dtype=nl.int32, buffer=nl.sbuf)
            nisa.dma_copy(
                dst=row_index, src=idx.ap(pattern=[[1, KERNEL_TILE], [1, 1]], offset=first)
            )
            nisa.dma_copy(
                dst=rows[:, kc, :],
                src=slot_rows.ap(
                    pattern=[[dim, KERNEL_TILE], [1, dim]],
                    offset=0,
                    vector_offset=row_index,
                    indirect_dim=0,
                ),
            )
        else:
            nisa.dma_copy(dst=rows[:, kc, :], src=slot_rows[first : first + KERNEL_TILE, :])
    return rows


def _attend_one_token(q2, slot_rows, idx, bias, sink_col, out, t, heads, dim, slots, indexed):
    """Computes ``out[t*H : (t+1)*H, :]`` for token t (see the module docstring, steps 1-7)."""
    k_tiles, d_tiles = slots // KERNEL_TILE, dim // KERNEL_TILE
    score_blocks = _ceil_div(slots, MATMUL_MAX_N)
    value_blocks = _ceil_div(dim, MATMUL_MAX_N)
    q_first = t * heads

    # 1. q rows of the token, transposed: contraction dim d on the partitions.
    q_t = nl.ndarray(
        (KERNEL_TILE, d_tiles, aligned_heads(heads)), dtype=nl.bfloat16, buffer=nl.sbuf
    )
    for dc in nl.static_range(d_tiles):
        nisa.dma_transpose(
            dst=q_t[:, dc, 0:heads],
            src=q2[q_first : q_first + heads, dc * KERNEL_TILE : (dc + 1) * KERNEL_TILE],
        )

    # Scale (column SCALE_COL) and per-slot bias of the token, one row broadcast to the H head
    # partitions: both operands of the scale+bias instruction then start at the same partition.
    bias_row = nl.load(bias[t : t + 1, :])
    bias_heads = nl.broadcast_to(bias_row, shape=(heads, BIAS_PREFIX_COLS + slots))

    # 2-3. Slot rows, then their transpose [128 (d), D/128, Kp] through the PE.
    rows = _fetch_slot_rows(slot_rows, idx, t, slots, dim, indexed)
    rows_t = nl.ndarray((KERNEL_TILE, d_tiles, slots), dtype=nl.bfloat16, buffer=nl.sbuf)
    transpose_psum = nl.ndarray((KERNEL_TILE, KERNEL_TILE), dtype=nl.bfloat16, buffer=nl.psum)
    for kc in nl.static_range(k_tiles):
        for dc in nl.static_range(d_tiles):
            nisa.nc_transpose(
                dst=transpose_psum, data=rows[:, kc, dc * KERNEL_TILE : (dc + 1) * KERNEL_TILE]
            )
            nisa.tensor_copy(
                dst=rows_t[:, dc, kc * KERNEL_TILE : (kc + 1) * KERNEL_TILE], src=transpose_psum
            )

    # 4. Logits: q . x with an fp32 PSUM accumulator over the D/128 chunks, at most 512 slots per
    # matmul (one PSUM bank); then s * scale + bias in fp32 (the scale never touches bf16 q).
    scores = nl.ndarray((heads, slots), dtype=nl.float32, buffer=nl.sbuf)
    score_psum = nl.ndarray((heads, MATMUL_MAX_N), dtype=nl.float32, buffer=nl.psum)
    for nb in nl.static_range(score_blocks):
        n0 = nb * MATMUL_MAX_N
        width = min(MATMUL_MAX_N, slots - n0)
        for dc in nl.static_range(d_tiles):
            nisa.nc_matmul(
                dst=score_psum[:, 0:width],
                stationary=q_t[:, dc, 0:heads],
                moving=rows_t[:, dc, n0 : n0 + width],
                accumulate=dc > 0,
            )
        nisa.scalar_tensor_tensor(
            dst=scores[:, n0 : n0 + width],
            data=score_psum[:, 0:width],
            op0=nl.multiply,
            operand0=bias_heads[:, SCALE_COL : SCALE_COL + 1],
            op1=nl.add,
            operand1=bias_heads[:, BIAS_PREFIX_COLS + n0 : BIAS_PREFIX_COLS + n0 + width],
        )

    # 5. Softmax statistics in fp32. The max runs over the slots only (never the sink).
    row_max = nl.max(scores, axis=1, keepdims=True)
    neg_max = nl.negative(row_max)
    probs = nl.ndarray((heads, slots), dtype=nl.float32, buffer=nl.sbuf)
    slot_sum = nl.ndarray((heads, 1), dtype=nl.float32, buffer=nl.sbuf)
    # reduce_cmd=reset_reduce: since NKI 0.3 the default (idle) leaves the Scalar Engine's
    # accumulator registers alone; reset_reduce zeroes them and sums this instruction's output
    # (the documented equivalent of the older activation_reduce).
    nisa.activation(
        dst=probs,
        op=nl.exp,
        data=scores,
        bias=neg_max,
        scale=1.0,
        reduce_op=nl.add,
        reduce_res=slot_sum,
        reduce_cmd=nisa.reduce_cmd.reset_reduce,
    )
    sink_term = nl.ndarray((heads, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=sink_term, op=nl.exp, data=sink_col, bias=neg_max, scale=1.0)
    denominator = nl.add(slot_sum, sink_term)
    inv_denominator = nl.ndarray((heads, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=inv_denominator, data=denominator)

    # 6. bf16 probabilities, transposed to [128 (slot), K/128, H] for the value matmul.
    probs_bf16 = nl.ndarray((heads, slots), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(dst=probs_bf16, src=probs)
    probs_t = nl.ndarray((KERNEL_TILE, k_tiles, heads), dtype=nl.bfloat16, buffer=nl.sbuf)
    probs_psum = nl.ndarray((KERNEL_TILE, heads), dtype=nl.bfloat16, buffer=nl.psum)
    for kc in nl.static_range(k_tiles):
        nisa.nc_transpose(
            dst=probs_psum, data=probs_bf16[:, kc * KERNEL_TILE : (kc + 1) * KERNEL_TILE]
        )
        nisa.tensor_copy(dst=probs_t[:, kc, :], src=probs_psum)

    # 7. Values: one fp32 PSUM bank holds at most 512 columns, so D > 512 is split into blocks,
    # each accumulated over the K/128 slot tiles, then scaled by 1/den into the bf16 output row.
    out_rows = nl.ndarray((heads, dim), dtype=nl.bfloat16, buffer=nl.sbuf)
    value_psum = nl.ndarray((heads, MATMUL_MAX_N), dtype=nl.float32, buffer=nl.psum)
    for vb in nl.static_range(value_blocks):
        v0 = vb * MATMUL_MAX_N
        width = min(MATMUL_MAX_N, dim - v0)
        for kc in nl.static_range(k_tiles):
            nisa.nc_matmul(
                dst=value_psum[:, 0:width],
                stationary=probs_t[:, kc, :],
                moving=rows[:, kc, v0 : v0 + width],
                accumulate=kc > 0,
            )
        nisa.tensor_scalar(
            dst=out_rows[:, v0 : v0 + width],
            data=value_psum[:, 0:width],
            op0=nl.multiply,
            operand0=inv_denominator,
        )
    nl.store(out[q_first : q_first + heads, :], value=out_rows)


def _sparse_attn_kernel_body(q2, slot_rows, idx, bias, sink, slots, indexed):
    tokens = bias.shape[0]
    heads, dim = _check_interface(q2, slot_rows, bias, sink, tokens, slots)
    out = nl.ndarray((tokens * heads, dim), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    sink_col = nl.load(sink)
    for t in nl.affine_range(tokens):
        _attend_one_token(q2, slot_rows, idx, bias, sink_col, out, t, heads, dim, slots, indexed)
    return out


def gathered_attn_idx_kernel(q2, kv, idx, bias, sink):
    """Sparse attention gathering the slot rows of ``kv`` inside the kernel.

    Args:
      q2: ``[T*H, D]`` bf16, row ``t*H + h``. kv: ``[R, D]`` bf16 cache (R > 0).
      idx: ``[T, Kp]`` int32, every entry in ``[0, R)``.
      bias: ``[T, 16 + Kp]`` f32: column 0 the scale, columns 16.. the per-slot bias.
      sink: ``[H, 1]`` f32.
    Returns ``[T*H, D]`` bf16 in shared HBM.
    """
    assert tuple(idx.shape) == (bias.shape[0], bias.shape[1] - BIAS_PREFIX_COLS), (
        f"idx {idx.shape} must be [T, Kp] to match bias {bias.shape}"
    )
    return _sparse_attn_kernel_body(q2, kv, idx, bias, sink, idx.shape[1], True)


def gathered_attn_kernel(q2, g2, bias, sink):
    """Sparse attention over pre-gathered slot rows.

    Args:
      q2: ``[T*H, D]`` bf16, row ``t*H + h``. g2: ``[T*Kp, D]`` bf16, row ``t*Kp + j``.
      bias: ``[T, 16 + Kp]`` f32: column 0 the scale, columns 16.. the per-slot bias.
      sink: ``[H, 1]`` f32.
    Returns ``[T*H, D]`` bf16 in shared HBM.
    """
    tokens, slots = bias.shape[0], bias.shape[1] - BIAS_PREFIX_COLS
    assert g2.shape[0] == tokens * slots, f"g2 {g2.shape} must be [T*Kp, D] = [{tokens * slots}, D]"
    return _sparse_attn_kernel_body(q2, g2, None, bias, sink, slots, False)
