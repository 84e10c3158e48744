"""The indexer's pure-jnp reference: exact, deterministic top-k in bounded memory.

The arithmetic is the contract of ``docs/indexer.md``: per token ``t`` and cache row ``r``::

    d[t, j, r] = q[t, j] . keys[r]                  16-bit operands, exact products, f32 sums
    h[t, r]    = sum_j w[t, j] * relu(d[t, j, r])   f32 (w already holds the scale)
    I[t, r]    = h[t, r] * key_scale[r]             f32

and the selection is exact on those f32 scores: the ``topk`` valid rows with the highest scores,
best first, exact ties to the lower row, NaN below every number.

Nothing of size ``[T, R]`` is built. Tokens run in chunks (``lax.map``); for each chunk a loop
streams over blocks of cache rows, only as many as the chunk's last valid row needs (a causal
prefill scores about half of the dense pairs), and keeps each token's running selection:

- every score becomes an int32 *order key* (``order_keys``: a monotone map of the f32 bits, NaN
  just below ``-inf``, invalid rows at ``INVALID_KEY``), so ranking is exact integer comparison;
- a row joins the token's candidate buffer only if its key beats the token's threshold ``tau``,
  the k-th best key seen so far (strictly: a later row that ties loses to the earlier ones);
- before a token's first cut, a block of at least ``2 topk`` rows also drops the rows below the
  k-th best of its pair maxima (a floor that k distinct rows reach), so the first block does not
  flood the buffer;
- candidates are appended in row order (``prefix_counts``: triangular products, not XLA:CPU's slow
  ``cumsum``; one scatter of (key, row) pairs); when a token's buffer would overflow, every buffer
  of the chunk is cut back to its best ``topk`` and ``tau`` rises to the k-th best key
  (``_cut_to_topk``: the threshold by a search of compare-and-count passes, interpolating between
  bisection steps, not a sort; then an order-keeping compaction, so buffer positions stay in row
  order among equal keys);
- blocks are scored in pieces of about ``DOT_BYTES`` of products; pieces past every token's last
  valid row are skipped;
- at the end each buffer is cut to ``topk`` and sorted best first (``sort_best_first``: one pass
  of an integer sort on a code linear in the score, packed with the buffer position, and a fix of
  lone pairs that shared a code; an exact two-pass LSD sort where that does not suffice), ties
  broken by buffer position, that is by row.

Every token is computed independently and each score's arithmetic does not depend on the chunk or
block sizes, so the result is bit-identical across them (``tests/test_indexer_reference.py``). On
CPU the products take the form that ``cpu_products.cpu_product_form`` picks (16-bit operands, or
widened to f32 in cache: same contract, another summation order).

Memory beyond the inputs and outputs: one chunk's working set, ``O(Tc (Hi Rb + topk + Rb))``
(``chunk_plan``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import cpu_products

# f32 products at full precision (GPUs would otherwise run f32 products in TF32).
_EXACT = jax.lax.Precision.HIGHEST

# A row that no token may select; below every real key.
INVALID_KEY = np.int32(-(2**31))


def _key_of(x: float) -> int:
    bits = int(np.float32(x).view(np.int32))
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


# A NaN score ranks just below -inf (and above the invalid rows).
NAN_KEY = np.int32(_key_of(-np.inf) - 1)

# Working-set target of one chunk's products ``[Tc, Hi, Rb]`` f32: small enough to stay in the CPU
# caches between the product, the relu and the head sum (as the attention reference's chunks).
CHUNK_BYTES = 4 * 2**20
# Largest candidate buffer per token: the LSD sort packs a buffer position in 16 bits.
MAX_BUFFER = 2**16
# Largest topk the API accepts: a buffer of topk candidates plus one block must fit MAX_BUFFER.
MAX_TOPK = MAX_BUFFER // 2
MIN_BLOCK_ROWS = 256
# Blocks score a multiple of 16 rows: XLA:CPU's f32 dot sums in another order when the row count
# is not one (measured on jaxlib 0.10, AVX2: blocks of 1000 or 3000 rows differ from 512 or 2048
# in 25-45% of the scores), which would break bit-identity across plans.
BLOCK_ALIGN = 16
# Working-set target of one product ``[Tc, Hi, rows]`` f32 (a block is scored in such pieces).
DOT_BYTES = 2**20
MAX_BLOCK_ROWS = 8192
MAX_CHUNK_TOKENS = 256
MAX_WIDE_BLOCK_ROWS = 16384
# Chunks of at most this many tokens (decode steps) take blocks of up to MAX_WIDE_BLOCK_ROWS.
WIDE_BLOCK_TOKENS = 8
# A chunk's candidate keys and rows ``2 [Tc, topk + Rb]`` int32 within this (the cuts and
# compactions pass over them; measured fastest with Hi = 4, K = 2048 on a Zen 3: Tc = 64).
BUFFER_BYTES = 2 * 2**20


def order_keys(scores):
    """f32 scores -> int32 keys in the same order: ``-0.0`` counts as ``+0.0``, NaN as ``NAN_KEY``
    (below every number). Monotone: ``a < b`` iff ``key(a) < key(b)`` for non-NaN floats."""
    s = jnp.where(scores == 0, jnp.float32(0), scores)
    bits = jax.lax.bitcast_convert_type(s, jnp.int32)
    keys = bits ^ ((bits >> 31) & jnp.int32(0x7FFFFFFF))
    return jnp.where(jnp.isnan(s), NAN_KEY, keys)


def scores_of_keys(keys):
    """Inverse of ``order_keys``: NaN for ``NAN_KEY``, ``-inf`` for ``INVALID_KEY``."""
    bits = keys ^ ((keys >> 31) & jnp.int32(0x7FFFFFFF))
    s = jax.lax.bitcast_convert_type(bits, jnp.float32)
    s = jnp.where(keys == NAN_KEY, jnp.float32(jnp.nan), s)
    return jnp.where(keys == INVALID_KEY, jnp.float32(-jnp.inf), s)


def _sort_lsd(keys, rows, pos_bits: int):
    """Two stable passes of an integer sort on 16-bit digits (least significant first), each
    digit packed with the element's position into one uint32 (XLA's fast single-operand sort)."""
    M = keys.shape[-1]
    mask = jnp.uint32((1 << pos_bits) - 1)
    desc = ~(jax.lax.bitcast_convert_type(keys, jnp.uint32) ^ jnp.uint32(0x80000000))
    pos = jnp.broadcast_to(jnp.arange(M, dtype=jnp.uint32), keys.shape)
    first = jax.lax.sort((desc & jnp.uint32(0xFFFF)) << pos_bits | pos, dimension=1) & mask
    high = jnp.take_along_axis(desc >> 16, first.astype(jnp.int32), axis=1)
    second = jax.lax.sort(high << pos_bits | pos, dimension=1) & mask
    perm = jnp.take_along_axis(first, second.astype(jnp.int32), axis=1).astype(jnp.int32)
    return jnp.take_along_axis(keys, perm, axis=1), jnp.take_along_axis(rows, perm, axis=1)


def _rank_codes(keys, code_bits: int):
    """uint32 codes below ``2**code_bits``, non-decreasing from the best key to the worst: +inf
    first, the finite scores linearly in their value between the row's largest and least
    finite one, then -inf, NaN, and ``INVALID_KEY`` last. Equal codes mean close scores."""
    s = scores_of_keys(keys)
    finite = jnp.isfinite(s)
    top = jnp.max(jnp.where(finite, s, -jnp.inf), axis=1, keepdims=True)
    bottom = jnp.min(jnp.where(finite, s, jnp.inf), axis=1, keepdims=True)
    levels = jnp.float32((1 << code_bits) - 6)
    # f32 rounding is monotone, so the codes keep the scores' order (ties in code aside).
    scale = jnp.where(top > bottom, levels / (top - bottom), jnp.float32(0))
    scale = jnp.where(jnp.isfinite(scale), scale, jnp.float32(0))
    value = jnp.clip((top - jnp.where(finite, s, top)) * scale, 0, levels)
    code = 1 + value.astype(jnp.uint32)
    code = jnp.where(s == jnp.inf, jnp.uint32(0), code)
    code = jnp.where(s == -jnp.inf, jnp.uint32((1 << code_bits) - 4), code)
    code = jnp.where(keys == NAN_KEY, jnp.uint32((1 << code_bits) - 3), code)
    return jnp.where(keys == INVALID_KEY, jnp.uint32((1 << code_bits) - 1), code)


def _out_of_order(keys, pos):
    """``[N, M - 1]``: whether entries i and i + 1 are out of best-first order (ties by
    position, which never repeats)."""
    a_k, b_k, a_p, b_p = keys[:, :-1], keys[:, 1:], pos[:, :-1], pos[:, 1:]
    return (a_k < b_k) | ((a_k == b_k) & (a_p >= b_p))


def sort_best_first(keys, rows):
    """Sorts each row of ``keys [N, M]`` int32 descending, ties by position; ``rows`` follow.

    XLA's single-operand integer sort is its fast path on CPU, and a uint32 holds the position
    and ``32 - log2 M`` more bits: one pass sorts a code linear in the score (``_rank_codes``)
    packed with the position. Scores that share a code come out in position order; a lone
    misordered pair is swapped. Where a run of three or more shares a code (rare unless the scores
    span a wide range), the chunk takes the exact two-pass LSD sort of the keys instead.
    """
    M = keys.shape[-1]
    if M > MAX_BUFFER:
        raise ValueError(f"sort_best_first sorts at most {MAX_BUFFER} entries; got {M}")
    if M <= 1:
        return keys, rows
    pos_bits = (M - 1).bit_length()
    code = _rank_codes(keys, 32 - pos_bits)
    pos = jnp.broadcast_to(jnp.arange(M, dtype=jnp.uint32), keys.shape)
    perm = (jax.lax.sort(code << pos_bits | pos, dimension=1)
            & jnp.uint32((1 << pos_bits) - 1)).astype(jnp.int32)
    k1 = jnp.take_along_axis(keys, perm, axis=1)
    bad = _out_of_order(k1, perm)
    none = jnp.zeros((keys.shape[0], 1), bool)
    # Only lone pairs swap (the result stays a permutation); longer runs are caught below.
    lone = bad & ~jnp.concatenate([none, bad[:, :-1]], axis=1) & ~jnp.concatenate(
        [bad[:, 1:], none], axis=1)
    swap_next = jnp.concatenate([lone, none], axis=1)  # entry i takes i + 1
    swap_prev = jnp.concatenate([none, lone], axis=1)  # entry i takes i - 1
    i = jnp.arange(M, dtype=jnp.int32)
    fixed = jnp.take_along_axis(perm, jnp.where(swap_next, i + 1, jnp.where(swap_prev, i - 1, i)),
                                axis=1)
    k2 = jnp.take_along_axis(keys, fixed, axis=1)
    return jax.lax.cond(
        jnp.any(_out_of_order(k2, fixed)),
        lambda: _sort_lsd(keys, rows, pos_bits),
        lambda: (k2, jnp.take_along_axis(rows, fixed, axis=1)))


# Segment length of ``prefix_counts``' triangular products (exact: f32 sums of at most 64 ones).
PREFIX_SEGMENT = 64


def prefix_counts(mask):
    """Inclusive prefix counts of ``mask [N, L]`` bool along its rows -> int32 ``[N, L]``.

    XLA:CPU's ``cumsum`` is slow (a reduce-window); this is two small products instead: within
    segments of ``PREFIX_SEGMENT`` entries by an upper-triangular matrix of ones (exact: integer
    sums below 2**24 in f32), then the segment totals' running sum.
    """
    N, L = mask.shape
    S = min(PREFIX_SEGMENT, L)
    G = -(-L // S)
    m = mask.astype(jnp.float32)
    if G * S != L:
        m = jnp.pad(m, ((0, 0), (0, G * S - L)))
    tri = jnp.triu(jnp.ones((S, S), jnp.float32))
    within = jnp.einsum("ngs,su->ngu", m.reshape(N, G, S), tri, precision=_EXACT)
    totals = within[:, :, -1].astype(jnp.int32)
    before = jnp.cumsum(totals, axis=1) - totals
    out = within.astype(jnp.int32) + before[:, :, None]
    return out.reshape(N, G * S)[:, :L]


def _unsigned(keys):
    """int32 order keys -> uint32 in the same order (``INVALID_KEY`` -> 0)."""
    return jax.lax.bitcast_convert_type(keys, jnp.uint32) ^ jnp.uint32(0x80000000)


def count_true(mask):
    """The number of true entries of each row of ``mask [N, M]`` -> int32 ``[N]``: a product
    with a vector of ones (exact: f32 sums of at most ``MAX_BUFFER`` ones), which XLA:CPU runs
    about 1.7 times as fast as its row reduction."""
    ones = jnp.ones((mask.shape[1],), jnp.float32)
    return jnp.dot(mask.astype(jnp.float32), ones, precision=_EXACT).astype(jnp.int32)


def _score_of_unsigned(u):
    return scores_of_keys(jax.lax.bitcast_convert_type(u ^ jnp.uint32(0x80000000), jnp.int32))


def kth_largest(keys, k: int, below=None):
    """The k-th largest key of each row of ``keys [N, M]`` int32 (``INVALID_KEY`` entries count;
    ``k <= M``): the largest ``x`` with ``count(keys >= x) >= k``. ``below [N]``, when given, is a
    key known to satisfy that count (the search starts there).

    A search on the key's 32 bits, each step one fused compare-and-count over the row (XLA's
    sorts and ``top_k`` are far slower on CPU). It keeps ``lo`` (at least k keys at or above) and
    ``hi`` (fewer than k above it) with their counts, and alternates a step that interpolates the
    count linearly between them with a bisection step (so it never takes more than twice the
    bisection's steps); a row is done once ``lo == hi``, or once exactly k keys lie at or above
    ``lo`` (the answer is their least) or exactly k - 1 above ``hi`` (the answer is the largest
    key at or below it). The loop stops as soon as every row is done.
    """
    u = _unsigned(keys)
    k = jnp.int32(k)
    count = lambda x: count_true(u >= x[:, None])

    def finished(lo, hi, c_lo, c_hi):
        return (lo >= hi) | (c_lo == k) | (c_hi == k - 1)

    def cond(state):
        step, lo, hi, c_lo, c_hi = state
        return jnp.any(~finished(lo, hi, c_lo, c_hi))

    def body(state):
        step, lo, hi, c_lo, c_hi = state
        active = ~finished(lo, hi, c_lo, c_hi)
        gap = jnp.where(active, hi - lo, jnp.uint32(1))  # >= 1 where active
        # The score where the count would cross k - 1/2 if it fell linearly from c_lo at lo's
        # score to c_hi at hi's (by the keys' bits where a score is not finite).
        frac = (c_lo - k).astype(jnp.float32) + 0.5
        frac = frac / (c_lo - c_hi).astype(jnp.float32)
        s_lo, s_hi = _score_of_unsigned(lo), _score_of_unsigned(hi)
        by_value = jnp.isfinite(s_lo) & jnp.isfinite(s_hi)
        s_mid = s_lo + frac * jnp.where(by_value, s_hi - s_lo, jnp.float32(0))
        from_value = _unsigned(order_keys(jnp.where(jnp.isfinite(s_mid), s_mid, s_lo))) - lo
        by_bits = jnp.minimum(frac * gap.astype(jnp.float32), jnp.float32(4294967040.0))
        guess = jnp.where(by_value & (from_value <= gap), from_value, by_bits.astype(jnp.uint32))
        offset = jnp.where(step % 3 == 2, gap // 2, jnp.maximum(guess, 1) - 1)
        mid = lo + 1 + jnp.minimum(offset, gap - 1)
        c = count(mid)
        up = active & (c >= k)
        down = active & (c < k)
        return (step + 1, jnp.where(up, mid, lo), jnp.where(down, mid - 1, hi),
                jnp.where(up, c, c_lo), jnp.where(down, c, c_hi))

    lo = jnp.min(u, axis=1)  # all M >= k keys lie at or above it
    lo = lo if below is None else jnp.maximum(lo, _unsigned(below))
    hi = jnp.max(u, axis=1)
    state = (jnp.int32(0), lo, hi, count(lo), jnp.zeros(keys.shape[:1], jnp.int32))
    _, lo, hi, c_lo, c_hi = jax.lax.while_loop(cond, body, state)
    least_above = jnp.min(jnp.where(u >= lo[:, None], u, jnp.uint32(0xFFFFFFFF)), axis=1)
    largest_below = jnp.max(jnp.where(u <= hi[:, None], u, jnp.uint32(0)), axis=1)
    answer = jnp.where(c_lo == k, least_above, jnp.where(c_hi == k - 1, largest_below, lo))
    return jax.lax.bitcast_convert_type(answer ^ jnp.uint32(0x80000000), jnp.int32)


def compact(keys, rows, keep, size: int, offset=None):
    """The entries where ``keep``, moved to the front in their order (after ``offset`` [N]
    entries of ``out``, when given as ``(offset, out_keys, out_rows)``); ``size`` wide, the rest
    ``INVALID_KEY``. Returns ``(keys, rows)``."""
    N = keys.shape[0]
    dest = prefix_counts(keep) - 1
    if offset is None:
        out_k = jnp.full((N, size), INVALID_KEY, jnp.int32)
        out_r = jnp.zeros((N, size), jnp.int32)
    else:
        count, out_k, out_r = offset
        dest = dest + count[:, None]
    dest = jnp.where(keep, dest, size)
    tok = jnp.arange(N, dtype=jnp.int32)[:, None]
    # One scatter of (key, row) pairs: XLA:CPU's scatter costs per index, not per byte.
    out = jnp.stack([out_k, out_r], axis=-1).at[tok, dest].set(
        jnp.stack([keys, rows], axis=-1), mode="drop", unique_indices=True)
    return out[..., 0], out[..., 1]


def _cut_to_topk(keys, rows, k: int, size: int, below=None):
    """Keeps each row's best ``k`` entries in their buffer order (ties: the earlier positions),
    ``size`` wide. Returns ``(keys, rows, count, tau)`` with ``tau`` the k-th best key.
    ``below``: as for ``kth_largest``."""
    tau = kth_largest(keys, k, below)
    above = keys > tau[:, None]
    ties = (keys == tau[:, None]) & (keys != INVALID_KEY)
    room = k - jnp.sum(above, axis=1, dtype=jnp.int32)
    n_ties = jnp.sum(ties, axis=1, dtype=jnp.int32)

    def trim_ties(_):  # more ties at tau than room: the earliest ones
        return above | (ties & (prefix_counts(ties) <= room[:, None]))

    keep = jax.lax.cond(jnp.any(n_ties > room), trim_ties, lambda _: above | ties, None)
    out_k, out_r = compact(keys, rows, keep, size)
    count = jnp.minimum(jnp.sum(keep, axis=1, dtype=jnp.int32), size)
    return out_k, out_r, count, tau


class ChunkPlan(NamedTuple):
    tokens: int  # Tc: tokens per chunk
    rows: int  # Rb: cache rows per block
    buffer: int  # M: candidate buffer per token


def chunk_plan(num_tokens: int, heads: int, rows: int, topk: int,
               budget: int = CHUNK_BYTES) -> ChunkPlan:
    """Chunk and block sizes: the products of one chunk and block ``[Tc, Hi, Rb]`` f32 near
    ``budget`` bytes, blocks of at least ``MIN_BLOCK_ROWS`` rows (fewer only for a smaller
    cache) and of about ``topk`` rows where several tokens share a chunk, a candidate buffer of
    ``topk + Rb`` entries (a cut always makes room for one block), and the chunk's buffers within
    ``BUFFER_BYTES``."""
    Rb = int(min(max(rows, 1), MAX_BLOCK_ROWS))
    if Rb > MIN_BLOCK_ROWS:
        Rb = max(MIN_BLOCK_ROWS, min(Rb, budget // (4 * max(heads, 1) * 8),
                                     _round_up(topk, BLOCK_ALIGN)))
    Rb = min(Rb, MAX_BUFFER - topk) if topk < MAX_BUFFER else 1
    if Rb > BLOCK_ALIGN:
        # XLA:CPU's products take another summation order for a block narrower than a few
        # vectors; blocks of whole multiples keep every score's bits the same for every plan.
        Rb -= Rb % BLOCK_ALIGN
    Tc = budget // (4 * max(heads, 1) * Rb)
    Tc = min(Tc, BUFFER_BYTES // (8 * (topk + Rb)))
    Tc = int(max(1, min(num_tokens, MAX_CHUNK_TOKENS, Tc)))
    if Tc <= WIDE_BLOCK_TOKENS and topk < MAX_BUFFER:
        # A small chunk (a decode step) takes longer blocks, scored in pieces: fewer loop steps.
        wide = min(max(rows, 1), MAX_WIDE_BLOCK_ROWS, budget // (4 * max(heads, 1) * Tc))
        Rb = max(Rb, min(wide, MAX_BUFFER - topk))
    return ChunkPlan(Tc, max(Rb, 1), topk + max(Rb, 1))


def row_limits(positions, compress_ratio: int, rows: int):
    """Rows ``r < limit[t]`` are valid for token t: ``(r + 1) * ratio <= position + 1`` without
    int32 overflow; 0 for a negative position, at most ``rows``."""
    p = positions.astype(jnp.int32)
    # floor((p + 1) / ratio), written so that p = 2**31 - 1 does not overflow.
    base = p // compress_ratio
    full = jnp.where(base >= rows, rows, base + (p % compress_ratio == compress_ratio - 1))
    return jnp.where(p >= 0, full, 0).astype(jnp.int32)


def _products_form() -> str:
    return cpu_products.cpu_product_form()


def block_scores(q, w, keys, key_scale, widen: bool):
    """Scores of one chunk and block: q ``[Tc, Hi, Di]``, w ``[Tc, Hi]`` f32, keys ``[Rb, Di]``,
    key_scale ``[Rb]`` f32 -> ``[Tc, Rb]`` f32. ``widen``: the products run on operands widened to
    f32 (exact for 16-bit inputs)."""
    if widen:
        q, keys = q.astype(jnp.float32), keys.astype(jnp.float32)
    d = jnp.einsum("thi,ri->thr", q, keys, preferred_element_type=jnp.float32, precision=_EXACT)
    # The head sum in a fixed order (an unrolled chain of adds), whatever the chunk shape.
    h = w[:, 0, None] * jax.nn.relu(d[:, 0])
    for j in range(1, d.shape[1]):
        h = h + w[:, j, None] * jax.nn.relu(d[:, j])
    return h * key_scale[None, :]


def _round_up(n: int, m: int) -> int:
    return -(-max(n, 1) // m) * m


def dot_rows(plan: ChunkPlan, heads: int) -> int:
    """Rows per product of a block: ``[Tc, Hi, rows]`` f32 within ``DOT_BYTES``, a multiple of
    ``BLOCK_ALIGN``; a block is scored in such pieces (those past every token's last valid
    row are skipped, so a causal chunk scores little more than its valid rows)."""
    rows = _round_up(plan.rows, BLOCK_ALIGN)
    pieces = -(-4 * plan.tokens * max(heads, 1) * rows // DOT_BYTES)
    return _round_up(-(-rows // pieces), BLOCK_ALIGN)


def block_rows(plan: ChunkPlan, heads: int) -> int:
    """The rows a block really selects from: ``plan.rows`` rounded up to whole products."""
    return _round_up(plan.rows, dot_rows(plan, heads))


def _known_kth_bound(count, tau, k: int):
    """A key with at least ``k`` buffer entries at or above it: ``tau`` once ``k`` entries are in
    (every entry joined above ``tau``, or above a floor that ``k`` entries reach), else the
    lowest key."""
    return jnp.where(count >= k, tau, INVALID_KEY)


def _select_chunk(q, w, limit, keys, key_scale, *, topk: int, plan: ChunkPlan, widen: bool):
    """Exact top-k of one token chunk: q ``[Tc, Hi, Di]``, w ``[Tc, Hi]``, limit ``[Tc]`` ->
    ``(keys [Tc, topk] int32, rows [Tc, topk] int32)`` best first. ``keys`` has at least
    ``block_rows(plan)`` rows."""
    Tc = q.shape[0]
    R, Di = keys.shape
    Rb = block_rows(plan, q.shape[1])
    Rd = dot_rows(plan, q.shape[1])
    M = max(plan.buffer, topk + Rb)
    last = jnp.max(limit)
    nblocks = (jnp.max(limit) + Rb - 1) // Rb
    block_row = jnp.arange(Rb, dtype=jnp.int32)[None, :]

    def step(b, state):
        buf_k, buf_r, count, tau = state
        first = b * Rb
        start = jnp.minimum(first, R - Rb)  # the last block may overlap the one before it
        rows = start + block_row
        valid = (rows < limit[:, None]) & (rows >= first)

        def piece(lo):
            def score(_):
                kb = jax.lax.dynamic_slice_in_dim(keys, lo, Rd, axis=0)
                sb = jax.lax.dynamic_slice_in_dim(key_scale, lo, Rd, axis=0)
                return order_keys(block_scores(q, w, kb, sb, widen))
            if Rd == Rb:
                return score(None)
            return jax.lax.cond(lo < last, score,
                                lambda _: jnp.full((Tc, Rd), INVALID_KEY, jnp.int32), None)

        scored = [piece(start + i) for i in range(0, Rb, Rd)]
        scored = scored[0] if len(scored) == 1 else jnp.concatenate(scored, axis=1)
        new = jnp.where(valid, scored, INVALID_KEY)
        if Rb // 2 >= topk:
            # Before a token's first cut: the k-th best of the block's pair maxima bounds its k-th
            # best key from below (k distinct rows reach it), so the block's first flood of
            # candidates shrinks to about topk.
            floor = jax.lax.cond(
                jnp.any(tau == INVALID_KEY),
                lambda n: kth_largest(jnp.maximum(n[:, 0::2], n[:, 1::2]), topk),
                lambda n: jnp.full((Tc,), INVALID_KEY, jnp.int32), new)
            new = jnp.where(new >= floor[:, None], new, INVALID_KEY)
        else:
            floor = None
        arrivals = jnp.sum(new > tau[:, None], axis=1, dtype=jnp.int32)

        def cut(state):
            buf_k, buf_r, count, tau = state
            return _cut_to_topk(buf_k, buf_r, topk, M, _known_kth_bound(count, tau, topk))

        buf_k, buf_r, count, tau = jax.lax.cond(
            jnp.any(count + arrivals > M), cut, lambda s: s, (buf_k, buf_r, count, tau)
        )
        take = new > tau[:, None]
        buf_k, buf_r = compact(new, jnp.broadcast_to(rows, new.shape), take, M,
                               offset=(count, buf_k, buf_r))
        count = count + jnp.sum(take, axis=1, dtype=jnp.int32)
        if floor is not None:  # a later row equal to the floor loses to the k rows before it
            tau = jnp.maximum(tau, floor)
        return buf_k, buf_r, count, tau

    state = (
        jnp.full((Tc, M), INVALID_KEY, jnp.int32),
        jnp.zeros((Tc, M), jnp.int32),
        jnp.zeros((Tc,), jnp.int32),
        jnp.full((Tc,), INVALID_KEY, jnp.int32),
    )
    buf_k, buf_r, count, tau = jax.lax.fori_loop(0, nblocks, step, state)
    if M > topk:
        buf_k, buf_r, _, _ = _cut_to_topk(buf_k, buf_r, topk, topk,
                                          _known_kth_bound(count, tau, topk))
    return sort_best_first(buf_k, buf_r)


def indexer_topk_reference(q, weights, keys, key_scale, positions, *, topk: int,
                           compress_ratio: int, plan: ChunkPlan | None = None):
    """The reference lowering of ``indexer_topk_p`` (operands as in ``docs/indexer.md``).

    Args:
      q: ``[T, Hi, Di]`` bf16, f16 or f32. weights: ``[T, Hi]`` f32 (scale folded in).
      keys: ``[R, Di]`` in q's dtype. key_scale: ``[R]`` f32. positions: ``[T]`` int32.
      topk, compress_ratio: static ints. plan: chunk and block sizes (default ``chunk_plan``).
    Returns ``(idx [T, topk] int32, scores [T, topk] f32)``: -1 and -inf in empty slots.
    """
    T, Hi, Di = q.shape
    R = keys.shape[0]
    if T == 0 or topk == 0 or R == 0:
        return (jnp.full((T, topk), -1, jnp.int32), jnp.full((T, topk), -jnp.inf, jnp.float32))
    plan = chunk_plan(T, Hi, R, topk) if plan is None else plan
    widen = q.dtype != jnp.float32

    def run(widen_products: bool):
        def fn(q, weights, keys, key_scale, positions):
            return _chunked(q, weights, keys, key_scale, positions, topk, compress_ratio, plan,
                            widen_products)
        return fn

    cpu_widen = widen and _products_form() == "f32"
    return jax.lax.platform_dependent(
        q, weights, keys, key_scale, positions, cpu=run(cpu_widen), default=run(False)
    )


def _chunked(q, weights, keys, key_scale, positions, topk, ratio, plan, widen):
    T = q.shape[0]
    R = keys.shape[0]
    Tc = plan.tokens
    limit = row_limits(positions, ratio, R)
    n = -(-T // Tc)
    pad = n * Tc - T
    if pad:
        q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
        limit = jnp.pad(limit, (0, pad))
    Hi, Di = q.shape[1:]
    Rb = block_rows(plan, Hi)
    if R < Rb:  # a cache smaller than one block: pad it (never valid rows)
        keys = jnp.pad(keys, ((0, Rb - R), (0, 0)))
        key_scale = jnp.pad(key_scale, (0, Rb - R))

    def one(args):
        # Each chunk returns its final (idx, scores): a caller that drops the scores then holds
        # one [T, topk] array, not the keys and rows besides.
        q_c, w_c, l_c = args
        k, r = _select_chunk(q_c, w_c, l_c, keys, key_scale, topk=topk, plan=plan, widen=widen)
        return jnp.where(k == INVALID_KEY, -1, r), scores_of_keys(k)

    chunks = (q.reshape(n, Tc, Hi, Di), weights.reshape(n, Tc, Hi), limit.reshape(n, Tc))
    if n == 1:
        idx, scores = one(tuple(c[0] for c in chunks))
    else:
        idx, scores = jax.lax.map(one, chunks)
        idx, scores = idx.reshape(n * Tc, topk), scores.reshape(n * Tc, topk)
    return idx[:T], scores[:T]
