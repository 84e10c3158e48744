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
- candidates are appended in row order (``cumsum`` positions, one scatter); when a token's buffer
  would overflow, every buffer of the chunk is cut back to its best ``topk`` and ``tau`` rises to
  the k-th best key (``_cut_to_topk``: one integer sort for the threshold, an order-keeping
  compaction, so buffer positions stay in row order among equal keys);
- at the end each buffer is cut to ``topk`` and sorted best first by a two-pass LSD sort of
  16-bit digits (``sort_best_first``), ties broken by buffer position, that is by row.

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
MAX_BLOCK_ROWS = 8192
MAX_CHUNK_TOKENS = 256
BLOCK_ALIGN = 16


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


def sort_best_first(keys, rows):
    """Sorts each row of ``keys [N, M]`` int32 descending, ties by position; ``rows`` follow.

    Two stable passes of an integer sort on 16-bit digits (least significant first), each digit
    packed with the element's position into one uint32 so that XLA sorts a single integer
    operand (its fast path) and ties keep their order.
    """
    M = keys.shape[-1]
    if M > MAX_BUFFER:
        raise ValueError(f"sort_best_first sorts at most {MAX_BUFFER} entries; got {M}")
    if M <= 1:
        return keys, rows
    pos_bits = (M - 1).bit_length()
    mask = jnp.uint32((1 << pos_bits) - 1)
    desc = ~(jax.lax.bitcast_convert_type(keys, jnp.uint32) ^ jnp.uint32(0x80000000))
    pos = jnp.broadcast_to(jnp.arange(M, dtype=jnp.uint32), keys.shape)
    first = jax.lax.sort((desc & jnp.uint32(0xFFFF)) << pos_bits | pos, dimension=1) & mask
    high = jnp.take_along_axis(desc >> 16, first.astype(jnp.int32), axis=1)
    second = jax.lax.sort(high << pos_bits | pos, dimension=1) & mask
    perm = jnp.take_along_axis(first, second.astype(jnp.int32), axis=1).astype(jnp.int32)
    return jnp.take_along_axis(keys, perm, axis=1), jnp.take_along_axis(rows, perm, axis=1)


def kth_largest(keys, k: int):
    """The k-th largest key of each row of ``keys [N, M]`` (``INVALID_KEY`` rows count)."""
    return jax.lax.sort(keys, dimension=1)[:, keys.shape[1] - k]


def compact(keys, rows, keep, size: int):
    """The entries where ``keep``, moved to the front in their order; ``size`` wide, the rest
    ``INVALID_KEY``. Returns ``(keys, rows, count)``."""
    N = keys.shape[0]
    dest = jnp.cumsum(keep.astype(jnp.int32), axis=1) - 1
    dest = jnp.where(keep, dest, size)
    tok = jnp.arange(N, dtype=jnp.int32)[:, None]
    out_k = jnp.full((N, size), INVALID_KEY, jnp.int32).at[tok, dest].set(keys, mode="drop")
    out_r = jnp.zeros((N, size), jnp.int32).at[tok, dest].set(rows, mode="drop")
    return out_k, out_r, jnp.minimum(jnp.sum(keep, axis=1, dtype=jnp.int32), size)


def _cut_to_topk(keys, rows, k: int, size: int):
    """Keeps each row's best ``k`` entries in their buffer order (ties: the earlier positions),
    ``size`` wide. Returns ``(keys, rows, count, tau)`` with ``tau`` the k-th best key."""
    tau = kth_largest(keys, k)
    above = keys > tau[:, None]
    ties = keys == tau[:, None]
    room = k - jnp.sum(above, axis=1, dtype=jnp.int32)
    keep = above | (ties & (jnp.cumsum(ties.astype(jnp.int32), axis=1) <= room[:, None]))
    keep = keep & (keys != INVALID_KEY)
    out_k, out_r, count = compact(keys, rows, keep, size)
    return out_k, out_r, count, tau


class ChunkPlan(NamedTuple):
    tokens: int  # Tc: tokens per chunk
    rows: int  # Rb: cache rows per block
    buffer: int  # M: candidate buffer per token


def chunk_plan(num_tokens: int, heads: int, rows: int, topk: int,
               budget: int = CHUNK_BYTES) -> ChunkPlan:
    """Chunk and block sizes: the products of one chunk and block ``[Tc, Hi, Rb]`` f32 near
    ``budget`` bytes, blocks of at least ``MIN_BLOCK_ROWS`` rows (fewer only for a smaller
    cache), and a candidate buffer of ``topk + Rb`` entries (a cut always makes room for one
    block)."""
    Rb = int(min(max(rows, 1), MAX_BLOCK_ROWS))
    if Rb > MIN_BLOCK_ROWS:
        Rb = max(MIN_BLOCK_ROWS, min(Rb, budget // (4 * max(heads, 1) * 8)))
    Rb = min(Rb, MAX_BUFFER - topk) if topk < MAX_BUFFER else 1
    if Rb > BLOCK_ALIGN:
        # XLA:CPU's products take another summation order for a block narrower than a few
        # vectors; blocks of whole multiples keep every score's bits the same for every plan.
        Rb -= Rb % BLOCK_ALIGN
    Tc = budget // (4 * max(heads, 1) * Rb)
    Tc = int(max(1, min(num_tokens, MAX_CHUNK_TOKENS, Tc)))
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


def _select_chunk(q, w, limit, keys, key_scale, *, topk: int, plan: ChunkPlan, widen: bool):
    """Exact top-k of one token chunk: q ``[Tc, Hi, Di]``, w ``[Tc, Hi]``, limit ``[Tc]`` ->
    ``(keys [Tc, topk] int32, rows [Tc, topk] int32)`` best first."""
    Tc = q.shape[0]
    R, Di = keys.shape
    Rb, M = plan.rows, plan.buffer
    nblocks = (jnp.max(limit) + Rb - 1) // Rb
    tok = jnp.arange(Tc, dtype=jnp.int32)[:, None]
    block_rows = jnp.arange(Rb, dtype=jnp.int32)[None, :]

    def step(b, state):
        buf_k, buf_r, count, tau = state
        first = b * Rb
        start = jnp.minimum(first, R - Rb)  # the last block may overlap the one before it
        kb = jax.lax.dynamic_slice_in_dim(keys, start, Rb, axis=0)
        sb = jax.lax.dynamic_slice_in_dim(key_scale, start, Rb, axis=0)
        rows = start + block_rows
        valid = (rows < limit[:, None]) & (rows >= first)
        new = jnp.where(valid, order_keys(block_scores(q, w, kb, sb, widen)), INVALID_KEY)
        arrivals = jnp.sum(new > tau[:, None], axis=1, dtype=jnp.int32)

        def cut(state):
            buf_k, buf_r, _, _ = state
            return _cut_to_topk(buf_k, buf_r, topk, M)

        buf_k, buf_r, count, tau = jax.lax.cond(
            jnp.any(count + arrivals > M), cut, lambda s: s, (buf_k, buf_r, count, tau)
        )
        take = new > tau[:, None]
        dest = jnp.where(take, count[:, None] + jnp.cumsum(take.astype(jnp.int32), axis=1) - 1, M)
        buf_k = buf_k.at[tok, dest].set(new, mode="drop")
        buf_r = buf_r.at[tok, dest].set(jnp.broadcast_to(rows, new.shape), mode="drop")
        count = count + jnp.sum(take, axis=1, dtype=jnp.int32)
        return buf_k, buf_r, count, tau

    state = (
        jnp.full((Tc, M), INVALID_KEY, jnp.int32),
        jnp.zeros((Tc, M), jnp.int32),
        jnp.zeros((Tc,), jnp.int32),
        jnp.full((Tc,), INVALID_KEY, jnp.int32),
    )
    buf_k, buf_r, _, _ = jax.lax.fori_loop(0, nblocks, step, state)
    if M > topk:
        buf_k, buf_r, _, _ = _cut_to_topk(buf_k, buf_r, topk, topk)
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

    def one(args):
        q_c, w_c, l_c = args
        return _select_chunk(q_c, w_c, l_c, keys, key_scale, topk=topk, plan=plan, widen=widen)

    chunks = (q.reshape(n, Tc, Hi, Di), weights.reshape(n, Tc, Hi), limit.reshape(n, Tc))
    if n == 1:
        k, r = one(tuple(c[0] for c in chunks))
    else:
        k, r = jax.lax.map(one, chunks)
        k, r = k.reshape(n * Tc, topk), r.reshape(n * Tc, topk)
    k, r = k[:T], r[:T]
    return jnp.where(k == INVALID_KEY, -1, r), scores_of_keys(k)
