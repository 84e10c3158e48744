"""float64 numpy oracles of the indexer (docs/indexer.md), written plainly, never calling the
library: the scores, the valid rows, the exact selection, and the rounding bound within which
a backend's f32 scores may differ from the float64 ones."""

import numpy as np

F32_UNIT = 2.0**-24  # unit roundoff of f32


def as_f64(x):
    return np.asarray(np.asarray(x).astype(np.float32), np.float64)


def valid_rows(positions, rows: int, ratio: int = 1):
    """``[T, R]`` bool: row r is valid for token t iff (r + 1) * ratio <= position + 1."""
    p = np.asarray(positions, np.int64)[:, None]
    r = np.arange(rows, dtype=np.int64)[None, :]
    return (r + 1) * ratio <= p + 1


def scores_f64(q, weights, keys, key_scale=None, scale=None):
    """``I [T, R]`` float64 and the per-entry rounding bound of an f32 evaluation of it.

    I = scale * ks[r] * sum_j w[t, j] relu(q[t, j] . k[r]). The bound covers f32 sums of Di
    products and of Hi terms and three multiplications, in any order: ``(Di + Hi + 3) u`` times
    the same sums of absolute values.
    """
    q, keys, w = as_f64(q), as_f64(keys), as_f64(weights)
    T, Hi, Di = q.shape
    scale = (Hi * Di) ** -0.5 if scale is None else float(scale)
    ks = np.ones(keys.shape[0]) if key_scale is None else as_f64(key_scale)
    d = np.einsum("thi,ri->thr", q, keys)
    d_abs = np.einsum("thi,ri->thr", np.abs(q), np.abs(keys))
    s = np.einsum("thr,th->tr", np.maximum(d, 0), w) * scale * ks[None, :]
    mag = np.einsum("thr,th->tr", d_abs, np.abs(w)) * abs(scale) * np.abs(ks)[None, :]
    return s, (Di + Hi + 3) * F32_UNIT * mag


def topk_f64(s, valid, topk: int):
    """The exact selection: the valid rows by score descending, NaN last, ties to the lower row;
    ``[T, topk]`` int with -1 padding."""
    T, R = s.shape
    out = -np.ones((T, topk), np.int64)
    for t in range(T):
        rows = np.flatnonzero(valid[t])
        rank = [(1 if np.isnan(s[t, r]) else 0, -s[t, r] if not np.isnan(s[t, r]) else 0.0, r)
                for r in rows]
        chosen = [r for *_, r in sorted(rank)][:topk]
        out[t, : len(chosen)] = chosen
    return out


def check_rows(idx, s, bound, valid, topk: int):
    """Asserts that ``idx`` (a backend's selection) is correct for float64 scores ``s`` with
    rounding bound ``bound``: the right count, distinct valid rows, -1 padding, best first to
    within rounding, and a set that differs from the exact one only among rows whose float64
    score lies within rounding of the k-th score."""
    idx = np.asarray(idx)
    exact = topk_f64(s, valid, topk)
    for t in range(s.shape[0]):
        n = min(topk, int(valid[t].sum()))
        got = idx[t]
        assert (got[n:] == -1).all(), (t, got)
        rows = got[:n]
        assert (rows >= 0).all() and len(set(rows.tolist())) == n, (t, rows)
        assert valid[t, rows].all(), (t, rows)
        if n == 0:
            continue
        ranked = s[t, rows]
        ok = ~np.isnan(ranked)
        assert ok[: ok.sum()].all(), t  # NaN scores come last
        slack = bound[t, rows][ok][:-1] + bound[t, rows][ok][1:]
        assert np.all(np.diff(ranked[ok]) <= slack), t
        want = exact[t, :n]
        kth = s[t, want[-1]]
        for r in set(rows.tolist()) ^ set(want.tolist()):
            assert abs(s[t, r] - kth) <= bound[t, r] + bound[t, want[-1]], (t, r, s[t, r], kth)


def check_selection(idx, scores, s, bound, valid, topk: int):
    """``check_rows``, and the returned ``scores``: each within the bound of its float64 value,
    non-increasing with NaN last, ``-inf`` at the empty slots."""
    check_rows(idx, s, bound, valid, topk)
    idx, scores = np.asarray(idx), np.asarray(scores, np.float64)
    for t in range(s.shape[0]):
        n = min(topk, int(valid[t].sum()))
        assert np.isneginf(scores[t, n:]).all(), t
        rows = idx[t, :n]
        finite = np.isfinite(s[t, rows])
        assert np.all(np.abs(scores[t, :n][finite] - s[t, rows][finite])
                      <= bound[t, rows][finite]), t
        order = scores[t, :n]
        ok = ~np.isnan(order)
        assert np.all(np.diff(order[ok]) <= 0) and ok[: ok.sum()].all(), t
