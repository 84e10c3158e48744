"""The jnp reference of ``indexer_kl``: the KL from the main attention's head-summed probabilities
to the indexer's softmax over each token's candidates, and its gradient (docs/indexer-kl.md).

One sequence's operands (the primitive loops over sequences)::

    q [T, H, D], kv [R, D]                    the teacher, any float dtype (f32 in the products)
    index_q [T, Hi, Di], index_keys [R, Di]   the student, any float dtype
    weights [T, Hi] f32 (index_scale folded in), key_scale [R] f32
    positions [T] int32, idx [T, K] int32, lse_extra [T, H] f32, scale [] f32

Both forms run over chunks of tokens in a ``fori_loop`` (a chunk's start is clamped so that the
last chunk stays inside ``T``; a token that two chunks hold adds to the keys' gradient once):

- **sparse**: a chunk gathers its candidates' rows (``[Tc, K, D]``) and computes everything in
  one go: O(T K) memory.
- **dense**: per chunk, two passes over blocks of ``Rb`` rows, only as far as the chunk's last
  visible row (``while_loop``): pass 1 the per-head log-sum-exp over the candidates and the
  student's, online; pass 2 the KL (with the gradient in the same pass for the backward). The
  largest temporaries are a block's ``[Tc, H, Rb]`` f32 logits: no ``[T, R]`` tensor.

``mode`` picks what pass 2 returns: ``"value"`` (kl, mass), ``"grad"`` (kl and the cotangents of
index_q, weights, index_keys for a given per-token cotangent), ``"tangent"`` (the KL's tangent for
given tangents of the three). The keys' gradient accumulates in one ``[R, Di]`` f32 array in loop
order (a fixed order: same bits on every run).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..cpu_products import loop_slices

_einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)

# Dense form: rows per block, and the byte budget of a block's [Tc, H, Rb] f32 logits that sets
# the tokens per chunk (a chunk's GEMM is [Tc H, D] x [D, Rb]: large on both sides).
DENSE_BLOCK_ROWS = 256
DENSE_BLOCK_BYTES = 16 * 2**20
# Sparse form: the byte budget of a chunk's gathered rows and [Tc, H, K] logits.
SPARSE_CHUNK_BYTES = 32 * 2**20
MAX_CHUNK_TOKENS = 1024


def visible_rows(positions, compress_ratio: int, rows: int):
    """How many rows each token sees: row ``r`` is visible iff ``(r + 1) * ratio <= p + 1``, i.e.
    ``r < floor((p + 1) / ratio)``, written without ``p + 1`` (which overflows at int32's max)."""
    n = positions // compress_ratio + (positions % compress_ratio == compress_ratio - 1)
    return jnp.clip(n, 0, rows).astype(jnp.int32)


def dense_plan(T: int, H: int, Hi: int, R: int) -> tuple[int, int]:
    """``(tokens per chunk, rows per block)`` of the dense form."""
    Rb = max(1, min(R, DENSE_BLOCK_ROWS))
    Tc = DENSE_BLOCK_BYTES // max(1, (H + 2 * Hi) * Rb * 4)
    return max(1, min(T, MAX_CHUNK_TOKENS, Tc)), Rb


def sparse_plan(T: int, H: int, D: int, Hi: int, Di: int, K: int) -> int:
    """Tokens per chunk of the sparse form."""
    per_token = K * (D + 2 * Di + 2 * H + 3 * Hi) * 4
    return max(1, min(T, MAX_CHUNK_TOKENS, SPARSE_CHUNK_BYTES // max(1, per_token)))


# --- the arithmetic shared by both forms ---------------------------------------------------------


def _online(m, s, x, axis):
    """One step of an online log-sum-exp: running max ``m`` and sum ``s`` (of ``exp(. - m)``)
    updated with the values ``x`` (``-inf`` for nothing) along ``axis``."""
    m_new = jnp.maximum(m, jnp.max(x, axis=axis))
    safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    s = s * jnp.exp(m - safe) + jnp.sum(jnp.exp(x - jnp.expand_dims(safe, axis)), axis=axis)
    return m_new, s


def _lse(m, s):
    return jnp.where(s > 0, m + jnp.log(jnp.where(s > 0, s, 1.0)), -jnp.inf)


def head_sum(x, axis, head_axes):
    """The sum over the heads (``axis``), over all devices when the heads are split over
    ``head_axes`` (mesh axes): a head sum is complete before anything is normalised by it."""
    x = jnp.sum(x, axis=axis)
    return jax.lax.psum(x, head_axes) if head_axes else x


def _teacher_norms(lse_cand, lse_extra, head_axes=()):
    """From the per-head lse over the candidates ``[c, H]``: the heads' subtrahend (``log Z_h``,
    ``+inf`` for a head that adds nothing) and ``N = sum_h sum_{j in C} a_h(j)`` ``[c]``."""
    log_z = jnp.logaddexp(lse_extra, lse_cand)
    adds = (lse_cand > -jnp.inf) & (log_z < jnp.inf)
    log_z = jnp.where(adds, log_z, jnp.inf)
    n = head_sum(jnp.where(adds, jnp.exp(lse_cand - jnp.where(adds, log_z, 0.0)), 0.0), 1,
                 head_axes)
    return log_z, n


def _teacher_logits(q, rows, scale, cand):
    """``scale * q . rows`` over ``[c, H, n]`` (``rows [n, D]`` shared by the chunk, or
    ``[c, n, D]`` per token), ``-inf`` off the candidates ``cand [c, n]``."""
    if rows.ndim == 2:
        l = _einsum("thd,rd->thr", q, rows.astype(jnp.float32))
    else:
        l = _einsum("thd,trd->thr", q, rows.astype(jnp.float32))
    return jnp.where(cand[:, None, :], l * scale, -jnp.inf)


def _student_products(iq, keys):
    """``index_q . index_keys`` ``[c, Hi, n]`` f32."""
    if keys.ndim == 2:
        return _einsum("tid,rd->tir", iq, keys.astype(jnp.float32))
    return _einsum("tid,trd->tir", iq, keys.astype(jnp.float32))


def _scores(z, w, ks, cand):
    """The indexer score ``ks * sum_i w_i relu(z_i)`` ``[c, n]``, ``-inf`` off the candidates."""
    s = jnp.einsum("tir,ti->tr", jax.nn.relu(z), w, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(cand, s * ks, -jnp.inf)


def _pass2_terms(l, I, cand, log_z, n, lse_s, head_axes=()):
    """The teacher ``p``, the student ``s`` and the KL's terms over ``[c, n]`` (0 off the
    candidates and where ``p`` is 0)."""
    live = n > 0
    a = head_sum(jnp.exp(l - log_z[:, :, None]), 1, head_axes)  # [c, n]: sum_h a_h(j)
    n_safe = jnp.where(live, n, 1.0)
    p = jnp.where(cand & live[:, None], a / n_safe[:, None], 0.0)
    log_p = jnp.log(jnp.where(a > 0, a, 1.0)) - jnp.log(n_safe)[:, None]
    log_s = I - lse_s[:, None]
    term = jnp.where(p > 0, p * (log_p - jnp.where(cand, log_s, 0.0)), 0.0)
    s = jnp.where(cand & live[:, None], jnp.exp(jnp.where(cand, log_s, -jnp.inf)), 0.0)
    return p, s, term


def _student_grads(g_i, z, w, ks, iq, keys, fresh, cand):
    """Cotangents from ``g_i = d loss / d I`` ``[c, n]`` (0 off the candidates): of the weights
    ``[c, Hi]``, of index_q ``[c, Hi, Di]``, and per row ``[n, Di]`` (or per slot ``[c, n, Di]``)
    of the keys, from the tokens where ``fresh [c]`` only (a token that an earlier chunk held
    has added its share)."""
    iq = jnp.where(fresh[:, None, None], iq, 0.0)
    # d / d (sum_i w_i relu(z_i)); selects, not products, off the candidates (0 * NaN is NaN).
    g_s = jnp.where(cand, g_i * ks, 0.0)
    relu = jnp.where(cand[:, None, :], jax.nn.relu(z), 0.0)
    g_w = jnp.einsum("tr,tir->ti", g_s, relu, precision=jax.lax.Precision.HIGHEST)
    g_z = jnp.where(z > 0, g_s[:, None, :] * w[:, :, None], 0.0)
    if keys.ndim == 2:
        g_q = _einsum("tir,rd->tid", g_z, keys.astype(jnp.float32))
        g_k = _einsum("tir,tid->rd", g_z, iq)
    else:
        g_q = _einsum("tir,trd->tid", g_z, keys.astype(jnp.float32))
        g_k = _einsum("tir,tid->trd", g_z, iq)
    return g_w, g_q, g_k


def _tangent_of_scores(z, w, ks, iq, keys, d_iq, d_w, d_keys):
    """The tangent of the scores ``[c, n]`` for tangents of index_q, weights and the keys (at the
    same rows as ``keys``)."""
    dz = _student_products(d_iq, keys) + _student_products(iq, d_keys)
    ds = jnp.einsum("tir,ti->tr", jax.nn.relu(z), d_w, precision=jax.lax.Precision.HIGHEST)
    ds = ds + jnp.einsum("tir,ti->tr", jnp.where(z > 0, dz, 0.0), w,
                         precision=jax.lax.Precision.HIGHEST)
    return ds * ks


# --- the loop over token chunks ------------------------------------------------------------------


def indexer_kl_one(q, kv, index_q, weights, index_keys, key_scale, positions, idx, lse_extra,
                   scale, *, sparse: bool, compress_ratio: int, mode: str = "value", ct=None,
                   tangents=None, head_axes: tuple = (), index_q_grad_dtype=jnp.float32):
    """One sequence (the module docstring). Returns ``(kl [T], mass [T])`` f32 for ``"value"``;
    ``(kl, mass, live [T], g_index_q [T, Hi, Di], g_weights [T, Hi], g_index_keys [R, Di])`` f32
    for ``"grad"`` (``ct [T]``, the cotangent of kl; ``live`` 1 where the token has a candidate
    with teacher mass; ``g_index_q`` in ``index_q_grad_dtype``); ``dkl [T]`` for ``"tangent"``
    (``tangents``: those of index_q, weights, index_keys)."""
    T, H, D = q.shape
    R = kv.shape[0]
    Hi, Di = index_q.shape[1:]
    K = idx.shape[1]
    f32 = jnp.float32
    scale = jnp.asarray(scale, f32)
    weights = weights.astype(f32)
    key_scale = key_scale.astype(f32)
    lse_extra = lse_extra.astype(f32)
    # index_q's gradient is written a chunk at a time, once per token: stored in its final dtype,
    # it is rounded once, as a cast of the whole would round it, without an f32 [T, Hi, Di] copy.
    zeros_grad = (jnp.zeros((T, Hi, Di), index_q_grad_dtype), jnp.zeros((T, Hi), f32),
                  jnp.zeros((R, Di), f32))
    if T == 0 or R == 0 or (sparse and K == 0):
        kl = jnp.zeros((T,), f32)
        if mode == "value":
            return kl, kl
        return (kl,) * 3 + zeros_grad if mode == "grad" else kl
    if ct is None:
        ct = jnp.zeros((T,), f32)
    if tangents is None:
        tangents = (jnp.zeros((0, Hi, Di), f32), jnp.zeros((0, Hi), f32), jnp.zeros((0, Di), f32))
    n_vis = visible_rows(positions, compress_ratio, R)
    token_arrays = [q, index_q, weights, positions, idx, lse_extra, ct.astype(f32), n_vis]
    if mode == "tangent":
        token_arrays += [tangents[0], tangents[1]]
    if sparse:
        Tc = sparse_plan(T, H, D, Hi, Di, K)
        chunk = functools.partial(_sparse_chunk, kv=kv, index_keys=index_keys,
                                  key_scale=key_scale, scale=scale, mode=mode,
                                  d_keys=tangents[2], head_axes=head_axes)
    else:
        Tc, Rb = dense_plan(T, H, Hi, R)
        chunk = functools.partial(_dense_chunk, kv=kv, index_keys=index_keys,
                                  key_scale=key_scale, scale=scale, mode=mode, rows_per_block=Rb,
                                  d_keys=tangents[2], head_axes=head_axes)
    n_chunks = -(-T // Tc)

    def body(c, carry):
        outs, g_keys = carry
        start = jnp.minimum(c * Tc, T - Tc)
        fresh = start + jnp.arange(Tc) >= c * Tc  # tokens no earlier chunk held
        pieces = loop_slices(token_arrays, start, Tc)
        results, g_k = chunk(*pieces, fresh=fresh)
        outs = tuple(jax.lax.dynamic_update_slice_in_dim(o, r.astype(o.dtype), start, axis=0)
                     for o, r in zip(outs, results))
        if g_k is not None:
            g_keys = g_keys + g_k  # a fixed order: chunk by chunk
        return outs, g_keys

    if mode == "value":
        outs0 = (jnp.zeros((T,), f32), jnp.zeros((T,), f32))
    elif mode == "grad":
        outs0 = (jnp.zeros((T,), f32),) * 3 + zeros_grad[:2]
    else:
        outs0 = (jnp.zeros((T,), f32),)
    outs, g_keys = jax.lax.fori_loop(0, n_chunks, body, (outs0, zeros_grad[2]))
    if mode == "value":
        return outs
    if mode == "grad":
        return outs + (g_keys,)
    return outs[0]


def _sparse_chunk(q, iq, w, positions, idx, lse_extra, ct, n_vis, *d_token, fresh, kv,
                  index_keys, key_scale, scale, mode, d_keys, head_axes):
    """One chunk of the sparse form: all of its tokens' candidates at once (gathered rows)."""
    R = kv.shape[0]
    del positions
    cand = (idx >= 0) & (idx < n_vis[:, None])  # n_vis <= R
    rows = jnp.where(cand, idx, 0)
    x = jnp.where(cand[..., None], kv[rows], jnp.zeros((), kv.dtype))  # never a row's garbage
    keys = jnp.where(cand[..., None], index_keys[rows], jnp.zeros((), index_keys.dtype))
    ks = jnp.where(cand, key_scale[rows], 0.0)
    qf = q.astype(jnp.float32)
    iqf = iq.astype(jnp.float32)
    l = _teacher_logits(qf, x, scale, cand)  # [c, H, K]
    m = jnp.max(l, axis=-1)
    lse_cand = _lse(*_online(jnp.full(m.shape, -jnp.inf), jnp.zeros(m.shape), l, -1))
    log_z, n = _teacher_norms(lse_cand, lse_extra, head_axes)
    z = _student_products(iqf, keys)
    I = _scores(z, w, ks, cand)
    lse_s = jax.nn.logsumexp(I, axis=-1)
    lse_s = jnp.where(jnp.any(cand, axis=-1), lse_s, 0.0)
    p, s, term = _pass2_terms(l, I, cand, log_z, n, lse_s, head_axes)
    kl = jnp.sum(term, axis=-1)
    mass = jnp.sum(p, axis=-1)
    if mode == "value":
        return (kl, mass), None
    if mode == "tangent":
        d_iq, d_w = d_token
        dk = jnp.where(cand[..., None], d_keys[rows], 0.0)
        dI = _tangent_of_scores(z, w, ks, iqf, keys, d_iq.astype(jnp.float32), d_w, dk)
        return (jnp.sum(jnp.where(cand, (s - p) * dI, 0.0), axis=-1),), None
    g_i = ct[:, None] * (s - p)
    g_w, g_q, g_k = _student_grads(g_i, z, w, ks, iqf, keys, fresh, cand)
    # Empty slots are out of range: dropped.
    target = jnp.where(cand, idx, R)
    g_keys = jnp.zeros((R, keys.shape[-1]), jnp.float32).at[target.reshape(-1)].add(
        g_k.reshape(-1, keys.shape[-1]), mode="drop")
    return (kl, mass, (n > 0).astype(jnp.float32), g_q, g_w), g_keys


def _dense_chunk(q, iq, w, positions, idx, lse_extra, ct, n_vis, *d_token, fresh, kv, index_keys,
                 key_scale, scale, mode, rows_per_block, d_keys, head_axes):
    """One chunk of the dense form: two passes over blocks of rows, up to the chunk's last
    visible row."""
    del positions
    R, Di = index_keys.shape
    c, H, _ = q.shape
    Rb = rows_per_block
    qf = q.astype(jnp.float32)
    iqf = iq.astype(jnp.float32)
    last = jnp.max(n_vis)  # rows [0, last) are visible to some token of the chunk
    blocks = (last + Rb - 1) // Rb

    def block(b):
        start = jnp.minimum(b * Rb, R - Rb)  # the last block may overlap the one before
        rows = start + jnp.arange(Rb)
        cand = (rows[None, :] < n_vis[:, None]) & (rows >= b * Rb)[None, :]
        seen = (rows < last)[:, None]  # rows no token sees hold anything: never multiplied
        x = jax.lax.dynamic_slice_in_dim(kv, start, Rb, axis=0)
        keys = jax.lax.dynamic_slice_in_dim(index_keys, start, Rb, axis=0)
        keys = jnp.where(seen, keys, jnp.zeros((), keys.dtype))
        ks = jax.lax.dynamic_slice_in_dim(key_scale, start, Rb, axis=0)
        l = _teacher_logits(qf, x, scale, cand)
        z = _student_products(iqf, keys)
        I = _scores(z, w, ks[None, :], cand)
        return start, rows, cand, keys, ks, l, z, I

    def pass1(b, state):
        m, s, m_s, s_s = state
        _, _, _, _, _, l, _, I = block(b)
        m, s = _online(m, s, l, -1)
        m_s, s_s = _online(m_s, s_s, I, -1)
        return m, s, m_s, s_s

    neg = jnp.full((c, H), -jnp.inf)
    state = (neg, jnp.zeros((c, H)), neg[:, 0], jnp.zeros((c,)))
    m, s, m_s, s_s = jax.lax.fori_loop(0, blocks, pass1, state)
    log_z, n = _teacher_norms(_lse(m, s), lse_extra, head_axes)
    lse_s = jnp.where(s_s > 0, _lse(m_s, s_s), 0.0)
    valid = (idx >= 0) & (idx < n_vis[:, None])
    # The top-k as a [c, R] membership (a scatter: repeated slots count once).
    member = jnp.zeros((c, R + 1), bool).at[
        jnp.arange(c)[:, None], jnp.where(valid, idx, R)].set(True)[:, :R]

    def pass2(b, state):
        start, rows, cand, keys, ks, l, z, I = block(b)
        p, s, term = _pass2_terms(l, I, cand, log_z, n, lse_s, head_axes)
        kl = state[0] + jnp.sum(term, axis=-1)
        if mode == "tangent":
            d_iq, d_w = d_token
            dk = jax.lax.dynamic_slice_in_dim(d_keys, start, Rb, axis=0)
            dk = jnp.where((rows < last)[:, None], dk, 0.0)
            dI = _tangent_of_scores(z, w, ks[None, :], iqf, keys, d_iq.astype(jnp.float32), d_w,
                                    dk)
            return (state[0] + jnp.sum(jnp.where(cand, (s - p) * dI, 0.0), axis=-1),)
        top = jax.lax.dynamic_slice_in_dim(member, start, Rb, axis=1)
        mass = state[1] + jnp.sum(jnp.where(top, p, 0.0), axis=-1)
        if mode == "value":
            return kl, mass
        g_q, g_w, g_keys = state[2:]
        g_i = ct[:, None] * (s - p)
        gw, gq, gk = _student_grads(g_i, z, w, ks[None, :], iqf, keys, fresh, cand)
        # Rows before b * Rb (an overlapping last block) have no candidate: gk is 0 there.
        old = jax.lax.dynamic_slice_in_dim(g_keys, start, Rb, axis=0)
        g_keys = jax.lax.dynamic_update_slice_in_dim(g_keys, old + gk, start, axis=0)
        return kl, mass, g_q + gq, g_w + gw, g_keys

    zero = jnp.zeros((c,))
    if mode == "value":
        kl, mass = jax.lax.fori_loop(0, blocks, pass2, (zero, zero))
        return (kl, mass), None
    if mode == "tangent":
        (dkl,) = jax.lax.fori_loop(0, blocks, pass2, (zero,))
        return (dkl,), None
    Hi = iq.shape[1]
    state = (zero, zero, jnp.zeros((c, Hi, Di)), jnp.zeros((c, Hi)), jnp.zeros((R, Di)))
    kl, mass, g_q, g_w, g_keys = jax.lax.fori_loop(0, blocks, pass2, state)
    return (kl, mass, (n > 0).astype(jnp.float32), g_q, g_w), g_keys
