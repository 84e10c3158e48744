"""Oracles of ``indexer_kl`` (docs/indexer-kl.md), written plainly from the definition: a float64
numpy loop over tokens, and the same definition in jax.numpy for autodiff under x64 (the tests
enable x64 around it) whose gradients the op's are compared with."""

from __future__ import annotations

import numpy as np


def _logsumexp(x):
    m = np.max(x)
    if m == -np.inf:
        return -np.inf
    if m == np.inf:
        return np.inf
    return m + np.log(np.sum(np.exp(x - m)))


def candidates(t, positions, idx, R, *, sparse, ratio):
    """Token t's candidate rows (a list; in the sparse form its valid slots in order, repeats
    kept) and its top-k's set of valid rows."""
    visible = [r for r in range(R) if (r + 1) * ratio <= int(positions[t]) + 1]
    slots = [int(j) for j in idx[t] if 0 <= int(j) < R and int(j) in visible]
    return (slots if sparse else visible), set(slots)


def indexer_kl_numpy(q, kv, index_q, index_weights, index_keys, positions, idx, *, sparse, scale,
                     index_scale=None, key_scale=None, compress_ratio=1, lse_extra=None):
    """``(kl [T], mass [T])`` float64 by the definition, token by token."""
    q, kv, iq, w, ik = (np.asarray(a, np.float64) for a in
                        (q, kv, index_q, index_weights, index_keys))
    T, H, _ = q.shape
    R = kv.shape[0]
    Hi, Di = iq.shape[1:]
    index_scale = (Hi * Di) ** -0.5 if index_scale is None else float(index_scale)
    ks = np.ones(R) if key_scale is None else np.asarray(key_scale, np.float64)
    extra = np.full((T, H), -np.inf) if lse_extra is None else np.asarray(lse_extra, np.float64)
    kl, mass = np.zeros(T), np.zeros(T)
    for t in range(T):
        cand, topk = candidates(t, positions, idx, R, sparse=sparse, ratio=compress_ratio)
        if not cand:
            continue
        logits = float(scale) * q[t] @ kv[cand].T  # [H, n]
        a = np.zeros(len(cand))
        for h in range(H):
            if extra[t, h] == np.inf:
                continue  # this head's denominator is infinite: it adds nothing
            log_z = _logsumexp(np.concatenate([[extra[t, h]], logits[h]]))
            a += np.exp(logits[h] - log_z)
        if a.sum() == 0:
            continue
        p = a / a.sum()
        scores = index_scale * ks[cand] * (np.maximum(iq[t] @ ik[cand].T, 0.0) * w[t][:, None]
                                           ).sum(0)
        log_s = scores - _logsumexp(scores)
        kl[t] = sum(pj * (np.log(pj) - ls) for pj, ls in zip(p, log_s) if pj > 0)
        if sparse:
            mass[t] = p.sum()
        else:
            mass[t] = sum(pj for pj, r in zip(p, cand) if r in topk)
    return kl, mass


def indexer_kl_jnp(q, kv, index_q, index_weights, index_keys, positions, idx, *, sparse, scale,
                   index_scale=None, key_scale=None, compress_ratio=1, lse_extra=None):
    """The same definition in jax.numpy over ``[T, H, R]`` masks (small shapes only), for
    autodiff under x64: ``kl [T]``. Sparse candidates are the top-k's valid rows (no repeats)."""
    import jax
    import jax.numpy as jnp

    T, H, _ = q.shape
    R = kv.shape[0]
    Hi, Di = index_q.shape[1:]
    index_scale = (Hi * Di) ** -0.5 if index_scale is None else index_scale
    ks = jnp.ones(R) if key_scale is None else jnp.asarray(key_scale, jnp.float64)
    extra = jnp.full((T, H), -jnp.inf) if lse_extra is None else jnp.asarray(lse_extra)
    cand = np.zeros((T, R), bool)
    for t in range(T):
        rows, _ = candidates(t, positions, idx, R, sparse=sparse, ratio=compress_ratio)
        cand[t, rows] = True
    cand = jnp.asarray(cand)
    kv0 = jnp.where(cand.any(0)[:, None], kv, 0.0)  # rows no token sees may hold anything
    ik0 = jnp.where(cand.any(0)[:, None], index_keys, 0.0)
    logits = scale * jnp.einsum("thd,rd->thr", q, kv0)
    logits = jnp.where(cand[:, None, :], logits, -jnp.inf)
    log_z = jax.nn.logsumexp(jnp.concatenate([extra[..., None], logits], axis=-1), axis=-1)
    adds = jnp.isfinite(log_z)
    a = jnp.sum(jnp.where(adds[..., None], jnp.exp(logits - jnp.where(adds, log_z, 0.0)[..., None]),
                          0.0), axis=1)
    total = a.sum(-1, keepdims=True)
    live = (total > 0)[:, 0]
    p = jnp.where(cand, a / jnp.where(total > 0, total, 1.0), 0.0)
    z = jnp.einsum("tid,rd->tir", index_q, ik0)
    scores = index_scale * ks * jnp.einsum("tir,ti->tr", jnp.maximum(z, 0.0), index_weights)
    scores = jnp.where(cand, scores, -jnp.inf)
    log_s = scores - jax.nn.logsumexp(jnp.where(live[:, None], scores, 0.0), axis=-1,
                                      keepdims=True)
    terms = jnp.where(p > 0, p * (jnp.log(jnp.where(p > 0, p, 1.0)) - jnp.where(cand, log_s, 0.0)),
                      0.0)
    return jnp.where(live, terms.sum(-1), 0.0)
