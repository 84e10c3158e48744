"""The indexer's pure-jnp reference: exact, deterministic top-k in bounded memory.

It computes the contract of ``docs/indexer.md`` (scores in f32, an exact integer ranking of them)
without building anything of size ``[T, R]`` beyond a small call: on CPU by streaming blocks of
rows through per-token candidate buffers (``_select_chunk``), a small call whole
(``_select_whole``) and a prefill chunk from its whole rows (``_select_rows``); on GPU and TPU
by merging blocks with ``lax.top_k`` (``_select_by_merging``). ``docs/indexer.md``, "How the
reference selects, in bounded memory", describes each and defines the terms used here (order
keys, buffers, cuts, floors, pieces, lanes).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import cpu_products
from ..attention.reference import (EXACT, accelerator_chunk_bytes, from_bits, per_platform,
                                   to_bits)
from ..constants import round_up

# A row that no token may select; below every real key.
INVALID_KEY = np.int32(-(2**31))


def _key_of(x: float) -> int:
    bits = int(np.float32(x).view(np.int32))
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


# A NaN score ranks just below -inf (and above the invalid rows).
NAN_KEY = np.int32(_key_of(-np.inf) - 1)

# Bounds a block's rows (``[8, Hi, Rb]`` f32 within it) and a decode step's wide blocks' products.
CHUNK_BYTES = 4 * 2**20
# Longest row ``sort_best_first`` takes: the LSD sort packs a position in 16 bits.
MAX_SORT = 2**16
# Largest topk the API accepts: the final sort takes topk + FINAL_SLACK entries.
MAX_TOPK = MAX_SORT // 2
MIN_BLOCK_ROWS = 256
# Blocks score a multiple of 16 rows: XLA:CPU's f32 dot sums in another order for other row
# counts, which would break bit-identity across plans (docs/indexer.md, "Tuning figures").
BLOCK_ALIGN = 16
# Working-set target of one product ``[Tc, Hi, rows]`` f32 (a block is scored in such pieces).
DOT_BYTES = 2**20
MAX_BLOCK_ROWS = 8192
MAX_CHUNK_TOKENS = 256
MAX_WIDE_BLOCK_ROWS = 16384
# Chunks of at most this many tokens (decode steps) take blocks of up to MAX_WIDE_BLOCK_ROWS.
WIDE_BLOCK_TOKENS = 8
# A chunk's candidate buffer ``[Tc, topk + cut_slack + Rb, 2]`` int32 within this: the cuts and
# compactions pass over it.
BUFFER_BYTES = 2 * 2**20
# With at most FEW_HEADS heads the selection, not the scores, is the cost: buffers with room for
# this many blocks cut half as often.
FEW_HEADS = 16
FEW_HEADS_BUFFER_BLOCKS = 2
# Token chunks selected side by side in each step of the chunk loop (independent work that
# XLA:CPU overlaps in part), where a call has at least LANES_MIN_CHUNKS chunks: a second lane
# adds compile time that a short call would not win back.
LANES = 2
LANES_MIN_CHUNKS = 16
# A small call is selected in one step with no loop on CPU (``whole_plan``, ``_select_whole``),
# which compiles in a fraction of the streaming program's time but sorts every row twice: it takes
# a call of at most WHOLE_PAIRS (token, row) pairs over at most WHOLE_ROWS rows whose rows are
# few (at most WHOLE_FEW_ROWS, or 2 topk), or of at most WHOLE_ANY_PAIRS pairs whatever its rows.
WHOLE_PAIRS = 2**16
WHOLE_ROWS = 4096
WHOLE_ANY_PAIRS = 2**14
WHOLE_FEW_ROWS = 256


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
    desc = ~_unsigned(keys)
    pos = jnp.broadcast_to(jnp.arange(M, dtype=jnp.uint32), keys.shape)
    first = jax.lax.sort((desc & jnp.uint32(0xFFFF)) << pos_bits | pos, dimension=1) & mask
    high = jnp.take_along_axis(desc >> 16, first.astype(jnp.int32), axis=1)
    second = jax.lax.sort(high << pos_bits | pos, dimension=1) & mask
    perm = jnp.take_along_axis(first, second.astype(jnp.int32), axis=1).astype(jnp.int32)
    return jnp.take_along_axis(keys, perm, axis=1), jnp.take_along_axis(rows, perm, axis=1)


def _rank_codes(keys, code_bits: int):
    """uint32 codes below ``2**code_bits``, non-decreasing from the best key to the worst: +inf
    first, the finite scores by their keys' bits between the row's largest and least finite one
    (shifted right to fit ``code_bits - 1`` bits), then -inf, NaN, and ``INVALID_KEY`` last.
    Equal codes mean close scores: within a relative ``2**-23`` times the shift's power of two,
    so scores that cluster near 0 or at one magnitude stay apart."""
    u = _unsigned(keys)
    s = scores_of_keys(keys)
    finite = jnp.isfinite(s)
    top = jnp.max(jnp.where(finite, u, jnp.uint32(0)), axis=1, keepdims=True)
    bottom = jnp.min(jnp.where(finite, u, jnp.uint32(0xFFFFFFFF)), axis=1, keepdims=True)
    span = jnp.where(top > bottom, top - bottom, jnp.uint32(0))
    shift = jnp.maximum(32 - jax.lax.clz(span).astype(jnp.int32) - (code_bits - 1), 0)
    code = 1 + (jnp.where(finite, top - u, jnp.uint32(0)) >> shift.astype(jnp.uint32))
    code = jnp.where(s == jnp.inf, jnp.uint32(0), code)
    code = jnp.where(s == -jnp.inf, jnp.uint32((1 << code_bits) - 4), code)
    code = jnp.where(keys == NAN_KEY, jnp.uint32((1 << code_bits) - 3), code)
    return jnp.where(keys == INVALID_KEY, jnp.uint32((1 << code_bits) - 1), code)


def _out_of_order(keys, pos, next_keys=None, next_pos=None):
    """``[N, M - 1]``: whether entries i and i + 1 are out of best-first order (ties by
    position, which never repeats); of ``(keys, pos)`` and ``(next_keys, next_pos)`` where
    those are given."""
    if next_keys is None:
        keys, pos, next_keys, next_pos = keys[:, :-1], pos[:, :-1], keys[:, 1:], pos[:, 1:]
    return (keys < next_keys) | ((keys == next_keys) & (pos >= next_pos))


def sort_best_first(keys, rows):
    """Sorts each row of ``keys [N, M]`` int32 descending, ties by position; ``rows`` follow.

    XLA's single-operand integer sort is its fast path on CPU, and a uint32 holds the position
    and ``32 - log2 M`` more bits: one pass sorts a code that follows the keys' bits
    (``_rank_codes``) packed with the position. Scores that share a code come out in position
    order, and a few rounds of odd-even transposition put such runs in order; where
    ``FIX_ROUNDS`` rounds do not suffice (a long run: scores that span a wide range), the exact
    two-pass LSD sort of the keys.
    """
    M = keys.shape[-1]
    if M > MAX_SORT:
        raise ValueError(f"sort_best_first sorts at most {MAX_SORT} entries; got {M}")
    if M <= 1:
        return keys, rows
    pos_bits = (M - 1).bit_length()
    code = _rank_codes(keys, 32 - pos_bits)
    pos = jnp.broadcast_to(jnp.arange(M, dtype=jnp.uint32), keys.shape)
    perm = (jax.lax.sort(code << pos_bits | pos, dimension=1)
            & jnp.uint32((1 << pos_bits) - 1)).astype(jnp.int32)
    k1 = jnp.take_along_axis(keys, perm, axis=1)

    def cond(state):
        step, _, _, bad = state
        return (step < FIX_ROUNDS) & bad

    def body(state):
        step, k, p, _ = state
        k, p = _exchange_pairs(*_exchange_pairs(k, p, 0), 1)
        return step + 1, k, p, jnp.any(_out_of_order(k, p))

    _, k2, fixed, bad = jax.lax.while_loop(
        cond, body, (jnp.int32(0), k1, perm, jnp.any(_out_of_order(k1, perm))))
    return jax.lax.cond(bad, lambda: _sort_lsd(keys, rows, pos_bits),
                        lambda: (k2, jnp.take_along_axis(rows, fixed, axis=1)))


# Rounds of odd-even transposition after the one-pass sort: a run of n entries that share a code
# is in order after n rounds.
FIX_ROUNDS = 8


def _exchange_pairs(keys, pos, first: int):
    """One phase of odd-even transposition: entries ``(i, i + 1)`` for ``i = first, first + 2,
    ...`` swap where out of best-first order (ties by ``pos``, which never repeats)."""
    N, M = keys.shape
    n = (M - first) // 2
    if n == 0:
        return keys, pos
    end = first + 2 * n
    k = keys[:, first:end].reshape(N, n, 2)
    p = pos[:, first:end].reshape(N, n, 2)
    swap = _out_of_order(k[..., 0], p[..., 0], k[..., 1], p[..., 1])

    def exchanged(x):
        a, b = x[..., 0], x[..., 1]
        pair = jnp.stack([jnp.where(swap, b, a), jnp.where(swap, a, b)], axis=-1)
        return pair.reshape(N, 2 * n)

    def put(x, mid):
        return jnp.concatenate([x[:, :first], mid, x[:, end:]], axis=1)

    return put(keys, exchanged(k)), put(pos, exchanged(p))


# Segment length of ``prefix_counts``' triangular products (the fastest, "Tuning figures").
PREFIX_SEGMENT = 32


def prefix_counts(mask):
    """Inclusive prefix counts of ``mask [N, L]`` bool (or prefix sums of small non-negative
    integers) along its rows -> int32 ``[N, L]``.

    XLA:CPU's ``cumsum`` is slow (a reduce-window); this is two small products instead: within
    segments of ``PREFIX_SEGMENT`` entries by an upper-triangular matrix of ones, then the
    segment totals by a strictly upper-triangular one (exact: integer sums below 2**24 in f32).
    """
    N, L = mask.shape
    S = min(PREFIX_SEGMENT, L)
    G = -(-L // S)
    m = mask.astype(jnp.float32)
    if G * S != L:
        m = jnp.pad(m, ((0, 0), (0, G * S - L)))
    tri = jnp.triu(jnp.ones((S, S), jnp.float32))
    within = jnp.einsum("ngs,su->ngu", m.reshape(N, G, S), tri, precision=EXACT)
    # The totals of the segments before each one, by a strictly triangular product as well.
    before = jnp.einsum("ng,gh->nh", within[:, :, -1], jnp.triu(jnp.ones((G, G), jnp.float32), 1),
                        precision=EXACT)
    out = (within + before[:, :, None]).astype(jnp.int32)
    return out.reshape(N, G * S)[:, :L]


def _unsigned(keys):
    """int32 order keys -> uint32 in the same order (``INVALID_KEY`` -> 0)."""
    return jax.lax.bitcast_convert_type(keys, jnp.uint32) ^ jnp.uint32(0x80000000)


def count_true(mask):
    """The number of true entries of each row of ``mask [N, M]`` -> int32 ``[N]``: a product
    with a vector of ones (exact: f32 sums of fewer than 2**24 ones), which XLA:CPU runs faster
    than its row reduction."""
    ones = jnp.ones((mask.shape[1],), jnp.float32)
    return jnp.dot(mask.astype(jnp.float32), ones, precision=EXACT).astype(jnp.int32)


def _score_of_unsigned(u):
    return scores_of_keys(jax.lax.bitcast_convert_type(u ^ jnp.uint32(0x80000000), jnp.int32))


def _search(u, k: int, cap: int, lo):
    """The search loop of ``kth_largest`` and ``cut_threshold`` on ``u [N, M]`` uint32 keys, from
    ``lo [N]``: returns ``(lo, hi, c_lo, c_hi)``, where ``c_lo`` keys lie at or above ``lo`` and
    ``c_hi < k`` above ``hi``, once ``k <= c_lo <= cap``, ``c_hi == k - 1``, ``lo == hi``, or
    (from a ``lo`` that fewer than k keys reach) ``c_lo < k``.

    Each step is one fused compare-and-count over the row (XLA's sorts and ``top_k`` are far
    slower on CPU) at a point that interpolates the count linearly between ``lo`` and ``hi``
    (aiming at the middle of ``[k, cap]``), with the Illinois rule against skewed scores (an end
    that stays twice counts half as far from the target), and every ``BISECT_EVERY``-th step a
    bisection of the keys' bits. The loop stops as soon as every row is done.
    """
    target = jnp.float32((k + cap) / 2 if cap > k else k - 0.5)
    k = jnp.int32(k)
    count = lambda x: count_true(u >= x[:, None])

    def finished(lo, hi, c_lo, c_hi):
        return (lo >= hi) | ((c_lo >= k) & (c_lo <= cap)) | (c_hi == k - 1) | (c_lo < k)

    def cond(state):
        step, lo, hi, c_lo, c_hi, _, _, _ = state
        return jnp.any(~finished(lo, hi, c_lo, c_hi))

    def body(state):
        step, lo, hi, c_lo, c_hi, f_lo, f_hi, moved = state
        active = ~finished(lo, hi, c_lo, c_hi)
        gap = jnp.where(active, hi - lo, jnp.uint32(1))  # >= 1 where active
        # The score where the count would reach the target if it fell linearly from lo's score
        # to hi's, f_lo and f_hi above and below it (by the keys' bits where a score is not
        # finite).
        frac = f_lo / jnp.maximum(f_lo - f_hi, jnp.float32(1e-30))
        s_lo, s_hi = _score_of_unsigned(lo), _score_of_unsigned(hi)
        by_value = jnp.isfinite(s_lo) & jnp.isfinite(s_hi)
        s_mid = s_lo + frac * jnp.where(by_value, s_hi - s_lo, jnp.float32(0))
        from_value = _unsigned(order_keys(jnp.where(jnp.isfinite(s_mid), s_mid, s_lo))) - lo
        by_bits = jnp.minimum(frac * gap.astype(jnp.float32), jnp.float32(4294967040.0))
        guess = jnp.where(by_value & (from_value <= gap), from_value, by_bits.astype(jnp.uint32))
        offset = jnp.where(step % BISECT_EVERY == BISECT_EVERY - 1, gap // 2,
                           jnp.maximum(guess, 1) - 1)
        mid = lo + 1 + jnp.minimum(offset, gap - 1)
        c = count(mid)
        up = active & (c >= k)
        down = active & (c < k)
        f = c.astype(jnp.float32) - target
        # Illinois: the end that stays while the other moves again counts half as far.
        f_hi = jnp.where(up & (moved == 1), f_hi * 0.5, f_hi)
        f_lo = jnp.where(down & (moved == -1), f_lo * 0.5, f_lo)
        return (step + 1, jnp.where(up, mid, lo), jnp.where(down, mid - 1, hi),
                jnp.where(up, c, c_lo), jnp.where(down, c, c_hi),
                jnp.where(up, jnp.maximum(f, 0.5), f_lo), jnp.where(down, f, f_hi),
                jnp.where(up, 1, jnp.where(down, -1, moved)))

    hi = jnp.max(u, axis=1)
    c_lo, c_hi = count(lo), jnp.zeros(u.shape[:1], jnp.int32)
    # Scores of exactly 0 (every head's relu at 0) are a point mass that the search would only
    # close in on bit by bit: one pass counts the keys at or above 0 and above 0, and the range
    # shrinks to one side of it (to 0 itself where the k-th key is 0).
    zero = _unsigned(order_keys(jnp.float32(0)))
    c_zero, c_above = count_true(jnp.concatenate([u >= zero, u > zero])).reshape(2, -1)
    for point, c in ((zero, c_zero), (zero + 1, c_above)):
        up = (c >= k) & (point > lo)
        lo, c_lo = jnp.where(up, point, lo), jnp.where(up, c, c_lo)
        down = (c < k) & (point - 1 < hi)
        hi, c_hi = jnp.where(down, point - 1, hi), jnp.where(down, c, c_hi)
    to_target = lambda c: c.astype(jnp.float32) - target
    state = (jnp.int32(0), lo, hi, c_lo, c_hi, jnp.maximum(to_target(c_lo), 0.5), to_target(c_hi),
             jnp.zeros(u.shape[:1], jnp.int32))
    _, lo, hi, c_lo, c_hi, _, _, _ = jax.lax.while_loop(cond, body, state)
    return lo, hi, c_lo, c_hi


# Every BISECT_EVERY-th step of the search halves the range of keys (a bound on its steps).
BISECT_EVERY = 4


def _largest_at_or_below(u, hi):
    return jnp.max(jnp.where(u <= hi[:, None], u, jnp.uint32(0)), axis=1)


def _key_of_unsigned(u):
    return jax.lax.bitcast_convert_type(u ^ jnp.uint32(0x80000000), jnp.int32)


def kth_largest(keys, k: int, below=None):
    """The k-th largest key of each row of ``keys [N, M]`` int32 (``INVALID_KEY`` entries count;
    ``k <= M``): the largest ``x`` with ``count(keys >= x) >= k``. ``below [N]``, when given, is a
    key known to satisfy that count (the search starts there).

    A search of compare-and-count passes (``_search``); a row is done once ``lo == hi``, or once
    exactly k keys lie at or above ``lo`` (the answer is their least) or exactly k - 1 above
    ``hi`` (the answer is the largest key at or below it).
    """
    u = _unsigned(keys)
    lo = jnp.min(u, axis=1)  # all M >= k keys lie at or above it
    lo = lo if below is None else jnp.maximum(lo, _unsigned(below))
    lo, hi, c_lo, c_hi = _search(u, k, k, lo)
    least_above = jnp.min(jnp.where(u >= lo[:, None], u, jnp.uint32(0xFFFFFFFF)), axis=1)
    answer = jnp.where(c_lo == k, least_above,
                       jnp.where(c_hi == k - 1, _largest_at_or_below(u, hi), lo))
    return _key_of_unsigned(answer)


def cut_threshold(keys, k: int, cap: int, below=None):
    """A threshold ``x [N]`` (an int32 key above ``INVALID_KEY``) for each row of ``keys [N, M]``:
    at least ``k`` valid keys lie at or above it (all of them where fewer than k are valid), and
    at most ``cap`` unless more than ``cap - k`` keys equal the k-th largest. ``below``: a key
    that at least k keys reach, when known.

    A cut needs no more: keeping the keys at or above ``x`` keeps the best k. The window of
    ``cap - k + 1`` counts ends the search in fewer passes than the exact k-th largest."""
    u = _unsigned(keys)
    # The least valid key (a real score, for the interpolation; above all if there is none),
    # or the known bound where every row has one.
    least = lambda: jnp.min(jnp.where(u > 0, u, jnp.uint32(0xFFFFFFFF)), axis=1)
    if below is None:
        lo = least()
    else:
        b = _unsigned(below)
        lo = jax.lax.cond(jnp.all(b > 0), lambda: b, lambda: jnp.maximum(least(), b))
    lo, hi, c_lo, c_hi = _search(u, k, cap, lo)
    in_window = (c_lo >= k) & (c_lo <= cap)
    use_below = ~in_window & (c_lo >= k) & (c_hi == k - 1)
    return _key_of_unsigned(jax.lax.cond(
        jnp.any(use_below), lambda: jnp.where(use_below, _largest_at_or_below(u, hi), lo),
        lambda: lo))


def compact(pairs, keep, size: int, offset=None):
    """The entries of ``pairs [N, L, 2]`` (key, row) where ``keep [N, L]``, moved to the front in
    their order (after the first ``offset[0] [N]`` entries of ``offset[1] [N, size, 2]``, when
    given); ``size`` wide, the rest ``(INVALID_KEY, 0)``; entries past ``size`` are dropped.
    Returns ``(pairs [N, size, 2], count [N])``, count the entries now held."""
    N = pairs.shape[0]
    ranks = prefix_counts(keep)
    if offset is None:
        start, out = jnp.zeros((N,), jnp.int32), jnp.stack(
            [jnp.full((N, size), INVALID_KEY, jnp.int32), jnp.zeros((N, size), jnp.int32)], -1)
    else:
        start, out = offset
    dest = ranks - 1 + start[:, None]
    tok = jnp.arange(N, dtype=jnp.int32)[:, None]
    # One scatter of (key, row) pairs on flat indices: XLA:CPU's scatter costs per index, not
    # per byte, and one index per pair is faster than two.
    flat = jnp.where(keep & (dest < size), tok * size + dest, N * size)
    out = out.reshape(N * size, 2).at[flat.reshape(-1)].set(
        pairs.reshape(-1, 2), mode="drop", unique_indices=True).reshape(N, size, 2)
    return out, jnp.minimum(start + ranks[:, -1], size)


def cut(pairs, k: int, cap: int, size: int, below=None):
    """Keeps each row's entries of ``pairs [N, M, 2]`` (key, row) at or above a ``cut_threshold``
    x (at least its best ``k``, at most ``cap``) in their buffer order, ``size >= cap`` wide.
    Where equal keys at x would keep more than ``cap``, x is the k-th key, and only the earliest
    of them that the best k need are kept. Returns ``(pairs, count, tau)``: ``tau`` is a key that
    at least k kept entries reach (later entries equal to it rank below them), ``INVALID_KEY``
    where fewer than k are valid."""
    x = cut_threshold(pairs[..., 0], k, cap, below)
    out, count = compact(pairs, keep_at_or_above(pairs[..., 0], x, k, cap), size)
    return out, count, jnp.where(count >= k, x, INVALID_KEY)


def keep_at_or_above(keys, x, k: int, cap: int):
    """Which entries of ``keys [N, M]`` a cut at ``x [N]`` (a ``cut_threshold``, above
    ``INVALID_KEY``) keeps: those at or above x, or where more than ``cap`` are, those above x
    and as many of the earliest equal to x as the best ``k`` need."""
    above = keys > x[:, None]
    at = keys == x[:, None]
    n_above = count_true(above)
    n = n_above + count_true(at)

    def trim_ties(_):  # as many of the earliest ties as the best k need (all rows: still >= k)
        return above | (at & (prefix_counts(at) <= (k - n_above)[:, None]))

    return jax.lax.cond(jnp.any(n > cap), trim_ties, lambda _: above | at, None)


# A buffer of at most this many entries is sorted whole by the exact two-pass sort: at this size
# it runs about as fast as a cut and the one-pass sort, and compiles in a tenth of the time.
WHOLE_SORT_MAX = 512
# The final cut keeps up to topk + FINAL_SLACK entries for the sort (which takes the best topk):
# a few more entries to sort, fewer passes to find the threshold.
FINAL_SLACK = 64
# A cut buffer of at most this many entries is sorted by the exact two-pass sort too (about as
# fast, far less to compile): calls with topk <= 32 compile no one-pass sort.
FINAL_WHOLE_SORT_MAX = 96


def best_first(pairs, k: int, below=None):
    """The best ``k`` entries of each row of ``pairs [N, M, 2]`` (key, row; ``M >= k``;
    ``INVALID_KEY`` for none), best first, ties by position: ``(keys [N, k], rows [N, k])``.
    ``below``: a key that at least k entries reach, when known."""
    M = pairs.shape[1]
    if M <= WHOLE_SORT_MAX:
        keys, rows = _sort_lsd(pairs[..., 0], pairs[..., 1], max(M - 1, 1).bit_length())
        return keys[:, :k], rows[:, :k]
    width = round_up(k + FINAL_SLACK, BLOCK_ALIGN)
    if M > width:
        pairs, _, _ = cut(pairs, k, width, width, below)
    if pairs.shape[1] <= FINAL_WHOLE_SORT_MAX:
        keys, rows = _sort_lsd(pairs[..., 0], pairs[..., 1], (pairs.shape[1] - 1).bit_length())
    else:
        keys, rows = sort_best_first(pairs[..., 0], pairs[..., 1])
    return keys[:, :k], rows[:, :k]


def cut_slack(block: int) -> int:
    """How many entries beyond topk a cut in the stream may keep: a wider window ends the
    threshold's search sooner, and the buffer holds that many more."""
    return round_up(max(block // 4, 1), BLOCK_ALIGN)


class ChunkPlan(NamedTuple):
    tokens: int  # Tc: tokens per chunk
    rows: int  # Rb: cache rows per block
    buffer: int  # M: candidate buffer per token
    piece: int = 0  # rows per product (0: as many as DOT_BYTES holds, ``dot_rows``)


def chunk_plan(num_tokens: int, heads: int, rows: int, topk: int,
               budget: int = CHUNK_BYTES) -> ChunkPlan:
    """Chunk and block sizes: blocks of at least ``MIN_BLOCK_ROWS`` rows (fewer only for a
    smaller cache), of about ``topk`` rows where several tokens share a chunk and of at most
    ``budget / (32 Hi)``, a candidate buffer of ``topk + cut_slack(Rb) + Rb`` entries (a cut
    always makes room for one block; for two with at most ``FEW_HEADS`` heads), and as many
    tokens as keep the chunk's buffers within ``BUFFER_BYTES``. A chunk of at most
    ``WIDE_BLOCK_TOKENS`` tokens (a decode step) takes one block's room and blocks of up to
    ``MAX_WIDE_BLOCK_ROWS`` rows with ``[Tc, Hi, Rb]`` f32 within ``budget``. Blocks are scored
    in pieces of ``DOT_BYTES`` (``dot_rows``)."""
    Rb = int(min(max(rows, 1), MAX_BLOCK_ROWS))
    if Rb > MIN_BLOCK_ROWS:
        Rb = max(MIN_BLOCK_ROWS, min(Rb, budget // (4 * max(heads, 1) * 8),
                                     round_up(max(topk, 1), BLOCK_ALIGN)))
    if Rb > BLOCK_ALIGN:
        # XLA:CPU's products take another summation order for a block narrower than a few
        # vectors; blocks of whole multiples keep every score's bits the same for every plan.
        Rb -= Rb % BLOCK_ALIGN
    # The products are bounded by their pieces (dot_rows), so the buffers bound the chunk: more
    # tokens per chunk spread each step's fixed costs.
    blocks = FEW_HEADS_BUFFER_BLOCKS if heads <= FEW_HEADS else 1
    Tc = BUFFER_BYTES // (8 * (topk + blocks * Rb + cut_slack(Rb)))
    Tc = int(max(1, min(num_tokens, MAX_CHUNK_TOKENS, Tc)))
    if Tc <= WIDE_BLOCK_TOKENS:
        blocks = 1
        # A small chunk (a decode step) takes longer blocks, scored in pieces: fewer loop steps.
        wide = min(max(rows, 1), MAX_WIDE_BLOCK_ROWS, budget // (4 * max(heads, 1) * Tc))
        Rb = max(Rb, wide)
    Rb = max(Rb, 1)
    return ChunkPlan(Tc, Rb, topk + blocks * Rb + cut_slack(Rb))


def accelerator_plan(num_tokens: int, heads: int, rows: int, topk: int,
                     budget: int | None = None) -> ChunkPlan:
    """Chunk and block sizes on GPU and TPU, where each loop step costs a launch and a sync
    rather than cache misses: one block is one product, and a step's working set (the
    ``[Tc, Hi, Rb]`` f32 products with the block's keys, rows and the running ``[Tc, topk]``
    selection merged with them) fills ``budget`` (default: ``accelerator_chunk_bytes``, a
    fraction of the device's memory). A prefill runs in square tiles of at most
    ``1 / ACCELERATOR_TOKEN_CHUNKS`` of its tokens, so that it scores little more than its
    causally valid pairs (``(n + 1) / 2n`` of the dense ones for n chunks); a decode step (at
    most ``WIDE_BLOCK_TOKENS`` tokens) takes the longest blocks that fit."""
    budget = accelerator_chunk_bytes() if budget is None else budget
    # Bytes per (token, row) of a block and per (token, entry) of the merge (keys and rows, the
    # concatenation, top_k's values and positions, the gathered rows).
    per_pair = 4 * (max(heads, 1) + 4)
    per_entry = 24
    rows_fit = lambda tokens: (budget // tokens - per_entry * topk) // (per_pair + per_entry)
    whole = rows if rows < BLOCK_ALIGN else rows - rows % BLOCK_ALIGN  # blocks within the cache
    if num_tokens <= WIDE_BLOCK_TOKENS:
        Tc = num_tokens
    else:
        Tc = round_up(-(-num_tokens // ACCELERATOR_TOKEN_CHUNKS), BLOCK_ALIGN)
        while Tc > BLOCK_ALIGN and rows_fit(Tc) < Tc:
            Tc -= BLOCK_ALIGN
        Tc = min(Tc, num_tokens)
    Rb = int(max(1, min(whole, rows_fit(Tc) if num_tokens <= WIDE_BLOCK_TOKENS else Tc)))
    if Rb > BLOCK_ALIGN:
        Rb -= Rb % BLOCK_ALIGN
    return ChunkPlan(int(Tc), Rb, topk + Rb, Rb)


# A prefill on an accelerator runs in token chunks of at least 1 / ACCELERATOR_TOKEN_CHUNKS of its
# tokens (``accelerator_plan``): 8 chunks score 56% of the dense pairs in 8 * 4.5 steps.
ACCELERATOR_TOKEN_CHUNKS = 8


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
    d = jnp.einsum("thi,ri->thr", q, keys, preferred_element_type=jnp.float32, precision=EXACT)
    # The head sum in a fixed order (an unrolled chain of adds), whatever the chunk shape.
    h = w[:, 0, None] * jax.nn.relu(d[:, 0])
    for j in range(1, d.shape[1]):
        h = h + w[:, j, None] * jax.nn.relu(d[:, j])
    return h * key_scale[None, :]


class SequenceRows(NamedTuple):
    """Sequence ``seq``'s rows of a batch of caches ``array [S, R, ...]`` (keys or key scales),
    read block by block. A slice of the sequence's whole cache would be a new buffer: one copy of
    it per call, since XLA:CPU gives every loop operand a buffer of its own."""

    array: jax.Array
    seq: jax.Array  # int32 scalar

    @property
    def shape(self) -> tuple:
        return self.array.shape[1:]


def _rows_at(x, lo, n: int):
    """Rows ``lo .. lo + n - 1`` of keys or key scales: an array, or a ``SequenceRows``."""
    if isinstance(x, SequenceRows):
        start = (x.seq, lo) + (0,) * (x.array.ndim - 2)
        return jax.lax.dynamic_slice(x.array, start, (1, n) + x.array.shape[2:])[0]
    return jax.lax.dynamic_slice_in_dim(x, lo, n, axis=0)


def key_rows(keys):
    """Rows of the keys operand as floats: the keys themselves, or the bf16 values of ``uint16``
    bit patterns (read per block, never the whole cache at once)."""
    return from_bits(keys, jnp.bfloat16) if keys.dtype == jnp.uint16 else keys


def dot_rows(plan: ChunkPlan, heads: int) -> int:
    """Rows per product of a block: ``[Tc, Hi, rows]`` f32 within ``DOT_BYTES``, a multiple of
    ``BLOCK_ALIGN``; a block is scored in such pieces (those past every token's last valid
    row are skipped, so a causal chunk scores little more than its valid rows)."""
    if plan.piece:
        return plan.piece
    rows = round_up(max(plan.rows, 1), BLOCK_ALIGN)
    pieces = -(-4 * plan.tokens * max(heads, 1) * rows // DOT_BYTES)
    return round_up(-(-rows // pieces), BLOCK_ALIGN)


def block_rows(plan: ChunkPlan, heads: int) -> int:
    """The rows a block really selects from: ``plan.rows`` rounded up to whole products."""
    return round_up(plan.rows, dot_rows(plan, heads))


def _known_kth_bound(count, tau, k: int):
    """A key with at least ``k`` buffer entries at or above it: ``tau`` once ``k`` entries are in
    (every entry joined above ``tau``, or above a floor that ``k`` entries reach), else the
    lowest key."""
    return jnp.where(count >= k, tau, INVALID_KEY)


def _block_keys(q, w, limit, keys, key_scale, b, *, Rb: int, Rd: int, widen: bool,
                cond_pieces: bool = True):
    """Block ``b``'s order keys in pieces of ``Rd`` rows: ``(pieces [Tc, Rd] each, their first
    rows, whether each is live)``; rows not valid for a token (or before the block: the last
    block may overlap the one before it) are ``INVALID_KEY``. A piece past every token's last
    valid row is not scored (``live`` is None where every piece is scored).

    ``cond_pieces``: each piece is scored in a ``cond`` on its liveness, even a block's only piece
    (always live there). On CPU that keeps the keys' 16-bit-to-f32 conversion in the loop: for a
    piece outside a ``cond`` XLA:CPU hoisted it out of the block loop as one f32 copy of the
    whole cache (``test_no_f32_copy_of_the_key_cache_at_a_decode_step``). GPUs and TPUs pass
    False: there each ``cond`` costs a device sync."""
    Tc = q.shape[0]
    R = keys.shape[0]
    last = jnp.max(limit)
    first = b * Rb
    start = jnp.minimum(first, R - Rb)
    piece_row = jnp.arange(Rd, dtype=jnp.int32)[None, :]

    def piece(lo):
        rows = lo + piece_row
        kb = key_rows(_rows_at(keys, lo, Rd))
        sb = _rows_at(key_scale, lo, Rd)
        new = order_keys(block_scores(q, w, kb, sb, widen))
        return jnp.where((rows < limit[:, None]) & (rows >= first), new, INVALID_KEY)

    los = [start + i for i in range(0, Rb, Rd)]
    live = [None if Rd == Rb and not cond_pieces else lo < last for lo in los]
    pieces = [piece(lo) if on is None else jax.lax.cond(
        on, piece, lambda _: jnp.full((Tc, Rd), INVALID_KEY, jnp.int32), lo)
        for lo, on in zip(los, live)]
    return pieces, los, live


def _select_chunk(q, w, limit, keys, key_scale, *, topk: int, plan: ChunkPlan, widen: bool):
    """Exact top-k of one token chunk: q ``[Tc, Hi, Di]``, w ``[Tc, Hi]``, limit ``[Tc]`` ->
    ``(keys [Tc, topk] int32, rows [Tc, topk] int32)`` best first. ``keys`` has at least
    ``block_rows(plan)`` rows."""
    Tc = q.shape[0]
    R, Di = keys.shape
    Rb = block_rows(plan, q.shape[1])
    Rd = dot_rows(plan, q.shape[1])
    slack = cut_slack(Rb)
    M = max(plan.buffer, topk + slack + Rb)
    last = jnp.max(limit)
    nblocks = (last + Rb - 1) // Rb
    piece_row = jnp.arange(Rd, dtype=jnp.int32)[None, :]

    def step(b, state):
        buf, count, tau, uniform = state
        pieces, los, live = _block_keys(q, w, limit, keys, key_scale, b, Rb=Rb, Rd=Rd,
                                        widen=widen)
        if Rb // 2 >= topk:
            # Before a token's first cut: the k-th best of the block's pair maxima bounds its k-th
            # best key from below (k distinct rows reach it), so the block's first flood of
            # candidates shrinks to about topk.
            floor = jax.lax.cond(
                jnp.any(tau == INVALID_KEY),
                lambda ps: kth_largest(jnp.concatenate(
                    [jnp.maximum(n[:, 0::2], n[:, 1::2]) for n in ps], axis=1), topk),
                lambda ps: jnp.full((Tc,), INVALID_KEY, jnp.int32), pieces)
            pieces = [jnp.where(n >= floor[:, None], n, INVALID_KEY) for n in pieces]
        else:
            floor = None
        def cut_buffers(state):
            buf, count, tau = state
            return cut(buf, topk, topk + slack, M, _known_kth_bound(count, tau, topk))

        if -(-R // Rb) * Rb > M:  # else every valid row fits: no cut to compile
            def overflows(_):
                arrivals = sum(count_true(n > tau[:, None]) for n in pieces)
                return jnp.any(count + arrivals > M)

            # Uniform buffers take the whole block (its rows that do not beat tau as holes).
            full = jax.lax.cond(uniform, lambda _: count[0] + Rb > M, overflows, None)
            buf, count, tau = jax.lax.cond(full, cut_buffers, lambda s: s, (buf, count, tau))
            uniform = uniform & ~full

        def append(args):
            buf, count, new, lo = args
            pairs = jnp.stack([new, jnp.broadcast_to(lo + piece_row, new.shape)], axis=-1)
            return compact(pairs, new > tau[:, None], M, offset=(count, buf))

        def append_in_place(args):
            # Every buffer holds the same count until the chunk's first cut: the piece goes in
            # at that offset as it is, a copy instead of a compaction (a scatter per entry).
            buf, count, new, lo = args
            pairs = jnp.stack([jnp.where(new > tau[:, None], new, INVALID_KEY),
                               jnp.broadcast_to(lo + piece_row, new.shape)], axis=-1)
            return jax.lax.dynamic_update_slice(buf, pairs, (0, count[0], 0)), count + Rd

        def add(args):
            return jax.lax.cond(uniform, append_in_place, append, args)

        for new, lo, on in zip(pieces, los, live):
            args = (buf, count, new, lo)
            buf, count = add(args) if on is None else jax.lax.cond(on, add, lambda a: a[:2], args)
        if floor is not None:  # a later row equal to the floor loses to the k rows before it
            tau = jnp.maximum(tau, floor)
        return buf, count, tau, uniform

    state = (
        jnp.stack([jnp.full((Tc, M), INVALID_KEY, jnp.int32), jnp.zeros((Tc, M), jnp.int32)], -1),
        jnp.zeros((Tc,), jnp.int32),
        jnp.full((Tc,), INVALID_KEY, jnp.int32),
        jnp.bool_(True),
    )
    buf, count, tau, _ = jax.lax.fori_loop(0, nblocks, step, state)
    return best_first(buf, topk, _known_kth_bound(count, tau, topk))


def whole_plan(num_tokens: int, heads: int, rows: int, topk: int) -> ChunkPlan | None:
    """The plan of a call small enough to select all its rows at once (the bounds beside
    ``WHOLE_PAIRS``): one chunk of every token and one block of every row (a multiple of
    ``BLOCK_ALIGN``, as ``chunk_plan``'s blocks, so each score's arithmetic is the same), its
    products ``[T, Hi, R]`` f32 within ``CHUNK_BYTES``; None for a larger call."""
    Rb = round_up(max(rows, 1), BLOCK_ALIGN)
    pairs = max(num_tokens, 1) * Rb
    if Rb > WHOLE_ROWS or pairs > WHOLE_PAIRS or 4 * pairs * max(heads, 1) > CHUNK_BYTES:
        return None
    if pairs > WHOLE_ANY_PAIRS and Rb > max(WHOLE_FEW_ROWS, 2 * topk):
        return None
    return ChunkPlan(max(num_tokens, 1), Rb, Rb, Rb)


def _select_whole(q, w, limit, keys, key_scale, *, topk: int, plan: ChunkPlan, widen: bool):
    """``_select_chunk``'s result for a ``whole_plan``: every row's order key at once (invalid
    rows at ``INVALID_KEY``), sorted best first by the exact two-pass LSD sort (stable, so ties
    keep row order), the first ``topk`` kept. No loop, cut or buffer to compile."""
    Rb = plan.rows
    rows = jnp.arange(Rb, dtype=jnp.int32)

    def scored(_):
        new = order_keys(block_scores(q, w, key_rows(_rows_at(keys, 0, Rb)),
                                      _rows_at(key_scale, 0, Rb), widen))
        return jnp.where(rows[None, :] < limit[:, None], new, INVALID_KEY)

    # Scored in a branch of its own (skipped where no token has a valid row), as the stream scores
    # in its loop: at the program's top level jax 0.7's XLA:CPU laid the product out otherwise in
    # a jitted caller than in an eager call, and a score's last bit moved between the two.
    new = jax.lax.cond(jnp.max(limit) > 0, scored,
                       lambda _: jnp.full((q.shape[0], Rb), INVALID_KEY, jnp.int32), None)
    best, best_rows = _sort_lsd(new, jnp.broadcast_to(rows, new.shape), (Rb - 1).bit_length())
    if topk > Rb:  # more slots than rows: the rest select nothing
        pad = ((0, 0), (0, topk - Rb))
        return (jnp.pad(best, pad, constant_values=INVALID_KEY), jnp.pad(best_rows, pad))
    return best[:, :topk], best_rows[:, :topk]


# --- prefill chunks with their whole rows ----------------------------------------------------

# A prefill chunk keeps its tokens' whole rows of keys (``rows_plan``, ``_select_rows``) within
# ROWS_BYTES: a chunk of more than WIDE_BLOCK_TOKENS tokens, so up to 65,536 rows.
ROWS_BYTES = 4 * 2**20
# Its selection samples one row in ROWS_SAMPLE to find a floor that 1.2 to 1.4 topk keys reach,
# which needs topk / ROWS_SAMPLE well above 1: smaller topk take the stream.
ROWS_MIN_TOPK = 256
ROWS_SAMPLE = 8
# The keys' passes count over the chunk's live width, in steps of 1 / ROWS_WIDTHS of the row (a
# causal chunk's last valid row: about half the row on average).
ROWS_WIDTHS = 8
# Entries per word of the compaction's bit masks.
COMPACT_GROUP = 32
# Rows per product at least: a product of fewer rows runs far below the GEMM rate.
ROWS_MIN_PIECE = 128


class RowsPlan(ChunkPlan):
    """A ``ChunkPlan`` for ``_select_rows``: ``tokens`` per chunk, products of ``piece`` rows
    (``rows == piece``, one piece per block) and a key buffer ``buffer`` rows wide."""


def rows_plan(num_tokens: int, heads: int, rows: int, topk: int) -> RowsPlan | None:
    """The plan of ``_select_rows`` for a call whose chunks of more than ``WIDE_BLOCK_TOKENS``
    tokens hold their whole rows of int32 keys within ``ROWS_BYTES`` (and ``topk >=
    ROWS_MIN_TOPK``); None otherwise. Products ``[Tc, Hi, piece]`` f32 within ``DOT_BYTES``, of
    at least ``ROWS_MIN_PIECE`` rows (fewer tokens where the heads are many)."""
    width = round_up(max(rows, 1), COMPACT_GROUP * ROWS_WIDTHS)
    heads = max(heads, 1)
    Tc = min(num_tokens, ROWS_BYTES // (4 * width), MAX_CHUNK_TOKENS,
             DOT_BYTES // (4 * heads * ROWS_MIN_PIECE))
    if topk < ROWS_MIN_TOPK or Tc <= WIDE_BLOCK_TOKENS:
        return None
    piece = DOT_BYTES // (4 * Tc * heads)
    piece = min(round_up(max(rows, 1), BLOCK_ALIGN), piece - piece % BLOCK_ALIGN)
    return RowsPlan(Tc, piece, width, piece)


def bit_masks(keep):
    """``keep [N, L]`` bool (``L`` a multiple of ``COMPACT_GROUP``) as ``[N, L / 32]`` uint32
    words, entry ``32 g + b`` at bit b of word g: an OR reduction of the shifted bits, which
    XLA:CPU runs several times as fast as their sum."""
    N, L = keep.shape
    bits = (keep.reshape(N, L // COMPACT_GROUP, COMPACT_GROUP).astype(jnp.uint32)
            << jnp.arange(COMPACT_GROUP, dtype=jnp.uint32))
    return jax.lax.reduce(bits, jnp.uint32(0), jax.lax.bitwise_or, (2,))


def _nth_set_bit(words, nth):
    """The position of each word's set bit with ``nth`` set bits below it (``nth`` below the
    word's count): five population counts of its low bits."""
    at = jnp.zeros_like(nth)
    for step in (16, 8, 4, 2, 1):
        below = words & ((jnp.uint32(1) << (at + step).astype(jnp.uint32)) - 1)
        at = jnp.where(jax.lax.population_count(below).astype(jnp.int32) <= nth, at + step, at)
    return at


def first_set_bits(words, n):
    """``words [N, G]`` uint32 bit masks with only each row's first ``n [N]`` set bits kept (in
    entry order, ``bit_masks``' order)."""
    counts = jax.lax.population_count(words).astype(jnp.int32)
    need = n[:, None] - (prefix_counts(counts) - counts)  # still wanted at each word
    last = _nth_set_bit(words, jnp.clip(need - 1, 0, COMPACT_GROUP - 1))
    # Bits up to the last one wanted (2 << 31 wraps to 0, so a last bit of 31 keeps them all).
    partial = words & ((jnp.uint32(2) << last.astype(jnp.uint32)) - 1)
    return jnp.where(need >= counts, words, jnp.where(need <= 0, jnp.uint32(0), partial))


def compact_positions(words, size: int):
    """The positions of the set bits of ``words [N, G]`` (``bit_masks``; at most ``size`` set
    per row) in entry order: ``(src [N, size] int32, live [N, size] bool)``, ``live`` false
    past each row's count (``src`` there is a valid position, not a kept one).

    A gather's positions, not a scatter of the entries: XLA:CPU's scatter costs several times its
    gather per index. Slot j's word is the number of words whose
    prefix count ends at or before j (a scatter-add of one index per word, then prefix sums),
    and its entry the (j - word's start)-th set bit of that word (``_nth_set_bit``)."""
    N, G = words.shape
    counts = jax.lax.population_count(words).astype(jnp.int32)
    end = prefix_counts(counts)
    tok = jnp.arange(N, dtype=jnp.int32)[:, None]
    flat = jnp.where(end < size, tok * size + end, N * size)
    ends = jnp.zeros((N * size,), jnp.int32).at[flat.reshape(-1)].add(1, mode="drop")
    group = jnp.minimum(prefix_counts(ends.reshape(N, size)), G - 1)
    slot = jnp.arange(size, dtype=jnp.int32)[None, :]
    start = jnp.take_along_axis(end - counts, group, axis=1, mode="promise_in_bounds")
    word = jnp.take_along_axis(words, group, axis=1, mode="promise_in_bounds")
    return group * COMPACT_GROUP + _nth_set_bit(word, slot - start), slot < end[:, -1:]


def _take(x, src, live, fill):
    return jnp.where(live, jnp.take_along_axis(x, src, axis=1, mode="promise_in_bounds"), fill)


def _sample_reach(topk: int):
    """The sample's rank ``r`` and window ``d`` of ``_select_rows``' floor, and the candidates'
    room: the floor is a key that between r and r + d sampled keys reach, about ``ROWS_SAMPLE``
    times as many of the whole row; r is ``topk / ROWS_SAMPLE`` plus three standard deviations of
    a sample's count, and the room adds three to the whole row's expected count at r + d."""
    mean = topk / ROWS_SAMPLE
    d = int(3 * mean ** 0.5) + 2
    r = int(np.ceil(mean)) + d
    expected = ROWS_SAMPLE * (r + d)
    room = expected + 3 * (ROWS_SAMPLE * (ROWS_SAMPLE - 1) * (r + d)) ** 0.5
    return r, d, round_up(max(int(room), 2 * topk), COMPACT_GROUP)


def _select_rows(q, w, limit, keys, key_scale, *, topk: int, plan: RowsPlan, widen: bool):
    """``_select_chunk``'s result for a ``RowsPlan``: the chunk's whole rows of order keys in a
    ``[Tc, plan.buffer]`` buffer (scored in pieces up to the last valid row, the rest
    ``INVALID_KEY``), then:

    - a floor that about 1.2 to 1.4 ``topk`` keys of each row reach, from a sample of one key
      in ``ROWS_SAMPLE`` (``cut_threshold`` on the sample), checked by one count of the row; the
      keys at or above it become the candidates (``compact_positions``, a gather). A floor tied
      by more than ``room`` keys keeps those above it and the earliest ties the best topk need;
      where a row's count still misses ``[topk, room]`` (skewed scores), the chunk cuts its
      whole rows instead. A row of at most ``room`` valid keys keeps them all.
    - the candidates' cut to ``topk + FINAL_SLACK`` (``cut_threshold``, ``keep_at_or_above``,
      compacted again) and ``sort_best_first``.

    No scatter per entry and no buffer cuts in a loop, which are the stream's cost where the
    heads are few. Same scores, same exact ranking."""
    Tc = q.shape[0]
    R = keys.shape[0]
    Rd, W = plan.piece, plan.buffer
    last = jnp.max(limit)

    def score_piece(p, buf):
        # The stream's pieces (each in its cond, so that XLA:CPU keeps the keys' conversion in
        # the loop). The last may overlap the one before it: its rows before p * Rd come as
        # INVALID_KEY, below the keys already there, and the rest of the buffer is still
        # INVALID_KEY, so the maximum writes each key once.
        (new,), (lo,), _ = _block_keys(q, w, limit, keys, key_scale, p, Rb=Rd, Rd=Rd, widen=widen)
        old = jax.lax.dynamic_slice_in_dim(buf, lo, Rd, axis=1)
        return jax.lax.dynamic_update_slice_in_dim(buf, jnp.maximum(old, new), lo, axis=1)

    buf = jax.lax.fori_loop(0, (last + Rd - 1) // Rd, score_piece,
                            jnp.full((Tc, W), INVALID_KEY, jnp.int32))
    size = round_up(topk + FINAL_SLACK, BLOCK_ALIGN)
    r, d, room = _sample_reach(topk)
    step = W // ROWS_WIDTHS
    live = jnp.clip((last + step - 1) // step, 1, ROWS_WIDTHS) - 1

    def count(x):  # over the live width only
        return jax.lax.switch(live, [lambda n=n: count_true(buf[:, :n] >= x[:, None])
                                     for n in range(step, W + 1, step)])

    n_valid = jnp.minimum(limit, R)
    floor = jnp.where(n_valid <= room, NAN_KEY,
                      cut_threshold(buf[:, ::ROWS_SAMPLE], r, r + d))
    c = count(floor)
    reached = c >= jnp.minimum(n_valid, topk)

    def whole_rows(_):  # skewed scores: the whole rows' cut
        x = cut_threshold(buf, topk, size)
        return compact_positions(bit_masks(keep_at_or_above(buf, x, topk, size)), room)

    def tied_floor(_):
        # A floor tied by more keys than the room (a point mass: relu puts every score whose
        # heads all miss at exactly 0) keeps the keys above it and only the earliest of its ties
        # that the best topk need.
        above = count(floor + 1)

        def above_and_ties(_):
            ties = first_set_bits(bit_masks(buf == floor[:, None]), jnp.maximum(topk - above, 0))
            return compact_positions(bit_masks(buf > floor[:, None]) | ties, room)

        return jax.lax.cond(jnp.all(above <= room), above_and_ties, whole_rows, None)  # reached

    src, held = jax.lax.cond(
        jnp.all(reached & (c <= room)),
        lambda _: compact_positions(bit_masks(buf >= floor[:, None]), room),
        lambda _: jax.lax.cond(jnp.all(reached), tied_floor, whole_rows, None), None)
    cand = _take(buf, src, held, INVALID_KEY)
    x = cut_threshold(cand, topk, size)
    src2, held2 = compact_positions(bit_masks(keep_at_or_above(cand, x, topk, size)), size)
    best, rows = sort_best_first(_take(cand, src2, held2, INVALID_KEY), _take(src, src2, held2, 0))
    return best[:, :topk], rows[:, :topk]


def cpu_selection(num_tokens: int, heads: int, rows: int, topk: int):
    """The CPU's default ``(plan, select)`` for a call of one sequence: ``_select_whole`` where
    ``whole_plan`` takes the call, ``_select_rows`` where ``rows_plan`` does, else
    ``_select_chunk`` streaming over ``chunk_plan``."""
    plan = whole_plan(num_tokens, heads, rows, topk)
    if plan is not None:
        return plan, _select_whole
    plan = rows_plan(num_tokens, heads, rows, topk)
    if plan is not None:
        return plan, _select_rows
    return chunk_plan(num_tokens, heads, rows, topk), _select_chunk


def indexer_topk_reference(q, weights, keys, key_scale, positions, *, topk: int,
                           compress_ratio: int, plan: ChunkPlan | None = None):
    """The reference lowering of ``indexer_topk_p`` for one sequence (``docs/indexer.md``).

    Args:
      q: ``[T, Hi, Di]`` bf16, f16 or f32. weights: ``[T, Hi]`` f32 (scale folded in).
      keys: ``[R, Di]`` in q's dtype (bf16 also as ``uint16`` bit patterns). key_scale: ``[R]``
        f32. positions: ``[T]`` int32.
      topk, compress_ratio: static ints. plan: chunk and block sizes of the streaming selection
        on CPU, or a ``RowsPlan`` for the whole-rows one (default: ``cpu_selection``'s, which
        selects a small call whole and a prefill chunk by its whole rows where they fit); GPU
        and TPU take ``accelerator_plan``'s and merge (``indexer_topk_by_merging``).
    Returns ``(idx [T, topk] int32, scores [T, topk] f32)``: -1 and -inf in empty slots.
    """
    T, Hi, Di = q.shape
    R = keys.shape[0]
    if T == 0 or topk == 0 or R == 0:
        return _nothing_selected(T, topk)
    plan, select = _plan_and_select(plan, T, Hi, R, topk)
    return _on_each_platform(q, weights, keys, key_scale, positions, topk, compress_ratio, plan,
                             select, _select_by_merging)


def indexer_topk_over_sequences(q, weights, keys, key_scale, positions, *, topk: int,
                                compress_ratio: int, plan: ChunkPlan | None = None):
    """``indexer_topk_reference`` for each of S sequences with their own caches, one after the
    other: q ``[S, T, Hi, Di]``, weights ``[S, T, Hi]``, keys ``[S, R, Di]``, key_scale
    ``[S, R]``, positions ``[S, T]`` -> ``(idx, scores)`` ``[S, T, topk]``. Each sequence's rows
    are read block by block out of the whole batch (``SequenceRows``): a slice of a sequence's
    cache would be a copy of it, since XLA:CPU gives every loop operand a buffer of its own."""
    S, T, Hi, Di = q.shape
    R = keys.shape[1]
    if T == 0 or topk == 0 or R == 0:
        return tuple(x.reshape(S, T, topk) for x in _nothing_selected(S * T, topk))
    plan, select = _plan_and_select(plan, T, Hi, R, topk)
    Rb = block_rows(plan, Hi)
    if R < Rb:
        # A cache smaller than one block: padded here, as _chunked pads a single one (a small
        # copy), and positions capped at the cache's last row so that no padding row is valid.
        keys = jnp.pad(keys, ((0, 0), (0, Rb - R), (0, 0)))
        key_scale = jnp.pad(key_scale, ((0, 0), (0, Rb - R)))
        cap = min(R * compress_ratio - 1, 2**31 - 1)
        positions = jnp.minimum(positions, jnp.int32(cap))

    def one(args):
        s, q_s, w_s, p_s = args
        return _on_each_platform(q_s, w_s, SequenceRows(keys, s), SequenceRows(key_scale, s), p_s,
                                 topk, compress_ratio, plan, select, _select_by_merging)

    return jax.lax.map(one, (jnp.arange(S, dtype=jnp.int32), q, weights, positions))


def _plan_and_select(plan, num_tokens: int, heads: int, rows: int, topk: int):
    """``plan`` and its selection on CPU, ``cpu_selection``'s where ``plan`` is None."""
    if plan is None:
        return cpu_selection(num_tokens, heads, rows, topk)
    return plan, _select_rows if isinstance(plan, RowsPlan) else _select_chunk


def _nothing_selected(T: int, topk: int):
    return jnp.full((T, topk), -1, jnp.int32), jnp.full((T, topk), -jnp.inf, jnp.float32)


def indexer_topk_by_merging(q, weights, keys, key_scale, positions, *, topk: int,
                            compress_ratio: int, plan: ChunkPlan | None = None):
    """The reference's form on GPU and TPU, on any platform (tests run it on CPU): operands and
    results as ``indexer_topk_reference``; ``plan`` defaults to ``accelerator_plan``."""
    T, Hi, _ = q.shape
    R = keys.shape[0]
    if T == 0 or topk == 0 or R == 0:
        return _nothing_selected(T, topk)
    plan = accelerator_plan(T, Hi, R, topk) if plan is None else plan
    return _run(topk, compress_ratio, plan, _select_by_merging, _cpu_widens(q))(
        q, weights, keys, key_scale, positions)


def _select_by_merging(q, w, limit, keys, key_scale, *, topk: int, plan: ChunkPlan,
                       widen: bool):
    """``_select_chunk``'s result by another route, for GPU and TPU: each block's keys are merged
    with the running best ``topk`` by ``lax.top_k`` on the int32 order keys, which puts equal
    values in index order (JAX's ``lax.top_k`` documentation); the running entries come first and
    hold lower rows than the block's, so ties still go to the lower row. Few, large steps: no
    buffers, cuts or data-dependent loops, each of which costs a device sync there."""
    Tc = q.shape[0]
    Rb = block_rows(plan, q.shape[1])

    def step(b, state):
        best, rows = state
        pieces, los, _ = _block_keys(q, w, limit, keys, key_scale, b, Rb=Rb, Rd=Rb, widen=widen,
                                     cond_pieces=False)
        block_row = jnp.broadcast_to(los[0] + jnp.arange(Rb, dtype=jnp.int32), (Tc, Rb))
        best, at = jax.lax.top_k(jnp.concatenate([best, pieces[0]], axis=1), topk)
        return best, jnp.take_along_axis(jnp.concatenate([rows, block_row], axis=1), at, axis=1)

    state = (jnp.full((Tc, topk), INVALID_KEY, jnp.int32), jnp.zeros((Tc, topk), jnp.int32))
    return jax.lax.fori_loop(0, (jnp.max(limit) + Rb - 1) // Rb, step, state)


def _max_chunk(q, w, limit, keys, key_scale, *, topk: int, plan: ChunkPlan, widen: bool):
    """The scores of ``_select_chunk``'s blocks and pieces, each token reduced to its best key
    (broadcast to ``[Tc, topk]``, rows 0) instead of selected: the streaming scores alone."""
    Rb = block_rows(plan, q.shape[1])
    Rd = dot_rows(plan, q.shape[1])

    def step(b, best):
        pieces, _, _ = _block_keys(q, w, limit, keys, key_scale, b, Rb=Rb, Rd=Rd, widen=widen)
        return jnp.maximum(best, jnp.max(jnp.stack(pieces), axis=(0, 2)))

    best = jax.lax.fori_loop(0, (jnp.max(limit) + Rb - 1) // Rb, step,
                             jnp.full((q.shape[0],), INVALID_KEY, jnp.int32))
    shape = (q.shape[0], topk)
    return jnp.broadcast_to(best[:, None], shape), jnp.zeros(shape, jnp.int32)


def streamed_scores_alone(q, weights, keys, key_scale, positions, *, topk: int,
                          compress_ratio: int):
    """The reference's streaming of scores with no selection (same plan, blocks, pieces, product
    form and chunk lanes; each token keeps only its best key): what the selection adds to
    ``indexer_topk_reference`` is its time less this one's (``bench --cases indexer``)."""
    T, Hi, _ = q.shape
    return _on_each_platform(q, weights, keys, key_scale, positions, topk, compress_ratio,
                             chunk_plan(T, Hi, keys.shape[0], topk), _max_chunk, _max_chunk)


def _on_each_platform(q, weights, keys, key_scale, positions, topk, compress_ratio, cpu_plan,
                      cpu_select, accelerator_select):
    """``cpu_select`` over ``cpu_plan``'s chunks in a program lowered for the CPU (in the CPU's
    product form), ``accelerator_select`` over ``accelerator_plan``'s on every other platform."""
    T, Hi, _ = q.shape
    accelerator = accelerator_plan(T, Hi, keys.shape[0], topk)
    return per_platform(_run(topk, compress_ratio, cpu_plan, cpu_select, _cpu_widens(q)),
                        _run(topk, compress_ratio, accelerator, accelerator_select, False),
                        q, weights, keys, key_scale, positions)


def _cpu_widens(q) -> bool:
    """Whether the CPU's products widen 16-bit operands to f32 (``cpu_products``)."""
    return q.dtype != jnp.float32 and _products_form() == "f32"


def _run(topk, compress_ratio, plan, select, widen: bool):
    def fn(q, weights, keys, key_scale, positions):
        return _chunked(q, weights, keys, key_scale, positions, topk, compress_ratio, plan,
                        widen, select)
    return fn


def _chunked(q, weights, keys, key_scale, positions, topk, ratio, plan, widen, select):
    T = q.shape[0]
    R = keys.shape[0]
    Tc = plan.tokens
    limit = row_limits(positions, ratio, R)
    dtype = q.dtype
    # The queries travel through the token loop as raw bits: XLA:CPU otherwise widens a 16-bit q
    # to f32 outside it (a copy twice q's size) and each block's product widens its chunk again.
    q = to_bits(q)
    n = -(-T // Tc)
    lanes = LANES if n >= LANES_MIN_CHUNKS else 1
    n = round_up(n, lanes)
    pad = n * Tc - T
    if pad:  # padded tokens have no valid row
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
        # one [T, topk] array, not the keys and rows besides. The lanes' chunks are independent
        # work, which XLA:CPU overlaps only in part (docs/indexer.md: one program's sorts and
        # scatters run one at a time; CPU devices, one per core, run side by side).
        out = []
        for q_c, w_c, l_c in zip(*args):
            q_c = from_bits(q_c, dtype)
            if widen:  # once per chunk, not per block (exact: a 16-bit value in f32)
                q_c = q_c.astype(jnp.float32)
            k, r = select(q_c, w_c, l_c, keys, key_scale, topk=topk, plan=plan, widen=widen)
            out.append((jnp.where(k == INVALID_KEY, -1, r), scores_of_keys(k)))
        return tuple(jnp.stack(x) for x in zip(*out))

    steps = n // lanes
    chunks = (q.reshape(steps, lanes, Tc, Hi, Di), weights.reshape(steps, lanes, Tc, Hi),
              limit.reshape(steps, lanes, Tc))
    if steps == 1:
        idx, scores = one(tuple(c[0] for c in chunks))
    else:
        idx, scores = jax.lax.map(one, chunks)
    return idx.reshape(n * Tc, topk)[:T], scores.reshape(n * Tc, topk)[:T]
