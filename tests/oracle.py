"""Independent oracles for the tests, written plainly in numpy (never calling the library).

``attention_f64``: the mathematical definition in float64.
``attention_bf16_contract``: a numpy model of the arithmetic contract (docs/contract.md,
"Arithmetic") for 16-bit inputs (bf16 operands, fp32 logits/softmax/denominator, bf16
probabilities in the value product, one final rounding).
``within_one_ulp``: the fraction of elements that agree to one unit in the last place of bf16.
"""

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
FLASHMLA_INVALID = (-(2**31), -123456, -1)  # plus R, R + 114514, 2**31 - 1, which depend on R


def invalid_indices(rows):
    """FlashMLA's test set of invalid indices for a cache of ``rows`` rows."""
    return list(FLASHMLA_INVALID) + [rows, rows + 114514, 2**31 - 1]


def gather(kv, idx):
    """``x[t, j] = kv[idx[t, j]]`` for valid slots, zeros elsewhere; also returns the validity."""
    kv = np.asarray(kv)
    idx = np.asarray(idx).astype(np.int64)
    valid = (idx >= 0) & (idx < kv.shape[0])
    x = np.zeros(idx.shape + kv.shape[1:], kv.dtype)
    x[valid] = kv[idx[valid]]
    return x, valid


def _f64_operands(q, x, valid, sink, bias, scale):
    """The float64 oracles' operands: q, x in float64, valid without the ``-inf`` bias slots, sink
    ``[H]`` (``-inf`` for none), bias ``[T, K]`` (0 for none), scale (``D ** -0.5`` for none)."""
    q = np.asarray(q, np.float64)
    x = np.asarray(x, np.float64)
    T, H, D = q.shape
    K = x.shape[1]
    valid = np.asarray(valid, bool).copy()
    bias = np.zeros((T, K)) if bias is None else np.asarray(bias, np.float64)
    valid &= ~np.isneginf(bias)
    sink = np.full(H, -np.inf) if sink is None else np.asarray(sink, np.float64)
    scale = D**-0.5 if scale is None else float(scale)
    return q, x, valid, sink, bias, scale


def attention_f64(q, x, valid, sink=None, bias=None, scale=None, value_dim=None):
    """float64 softmax attention with a sink in the denominator.

    q [T, H, D], x [T, K, D], valid [T, K] bool, sink [H] or None, bias [T, K] or None;
    value_dim: the logits use all D columns of x, the values its first value_dim (default D).
    """
    q, x, valid, sink, bias, scale = _f64_operands(q, x, valid, sink, bias, scale)
    T, H, D = q.shape
    V = D if value_dim is None else value_dim
    out = np.zeros((T, H, V))
    for t in range(T):
        if not valid[t].any():
            continue
        xs = x[t][valid[t]]  # [k, D]
        logits = (q[t] @ xs.T) * scale + bias[t][valid[t]][None, :]  # [H, k]
        m = logits.max(axis=1, keepdims=True)
        e = np.exp(logits - m)
        with np.errstate(over="ignore"):
            den = e.sum(axis=1) + np.exp(sink - m[:, 0])
        out[t] = (e @ xs[:, :V]) / den[:, None]
    return out


def attention_bf16_contract(q, x, valid, sink=None, bias=None, scale=None, dtype=BF16,
                            value_dim=None):
    """numpy model of the contract's arithmetic for 16-bit float inputs (returns ``dtype``);
    ``value_dim`` as in ``attention_f64``."""
    q = np.asarray(q).astype(np.float64)
    x = np.asarray(x).astype(np.float64)
    T, H, D = q.shape
    K = x.shape[1]
    valid = np.asarray(valid, bool).copy()
    bias = np.zeros((T, K), np.float32) if bias is None else np.asarray(bias, np.float32)
    valid &= ~np.isneginf(bias)
    sink = np.full(H, -np.inf, np.float32) if sink is None else np.asarray(sink, np.float32)
    scale = np.float32(D**-0.5 if scale is None else scale)
    V = D if value_dim is None else value_dim
    out = np.zeros((T, H, V), dtype)
    for t in range(T):
        if not valid[t].any():
            continue
        s = (q[t] @ x[t].T).astype(np.float32)  # exact products, fp32 result
        b = np.where(valid[t], bias[t], np.float32(-1e30)).astype(np.float32)
        s = (s * scale).astype(np.float32) + b[None, :]
        m = s.max(axis=1, keepdims=True)
        e = np.exp(s - m).astype(np.float32)
        with np.errstate(over="ignore"):
            den = e.sum(axis=1, dtype=np.float32) + np.exp(sink - m[:, 0]).astype(np.float32)
        p = e.astype(dtype).astype(np.float64)
        num = (p @ x[t][:, :V]).astype(np.float32)
        out[t] = (num / den[:, None]).astype(dtype)
    return out


def _ordered_bits(a, dtype):
    bits = np.asarray(a, dtype).view(np.uint16).astype(np.int32)
    magnitude = bits & 0x7FFF
    return np.where(bits & 0x8000, -magnitude, magnitude)


def within_one_ulp(actual, expected, dtype=BF16):
    """Fraction of elements whose 16-bit encodings differ by at most one step (+0 == -0)."""
    a = _ordered_bits(actual, dtype)
    e = _ordered_bits(np.asarray(expected).astype(dtype), dtype)
    if a.size == 0:
        return 1.0
    return float(np.mean(np.abs(a - e) <= 1))


def lse_f64(q, x, valid, sink=None, bias=None, scale=None):
    """float64 ``log(exp(sink[h]) + sum over valid slots j of exp(s[t, h, j]))``, ``[T, H]``.

    Same arguments as ``attention_f64``. No valid slot: the sink alone (``-inf`` without one).
    """
    q, x, valid, sink, bias, scale = _f64_operands(q, x, valid, sink, bias, scale)
    T, H, D = q.shape
    out = np.zeros((T, H))
    for t in range(T):
        logits = (q[t] @ x[t][valid[t]].T) * scale + bias[t][valid[t]][None, :]  # [H, k]
        terms = np.concatenate([logits, sink[:, None]], axis=1)
        top = terms.max(axis=1)
        for h in range(H):
            if not np.isfinite(top[h]):
                out[t, h] = top[h]  # -inf: nothing at all; +inf: a +inf sink
            else:
                out[t, h] = top[h] + np.log(np.sum(np.exp(terms[h] - top[h])))
    return out


def central_differences(value, base, names, eps=1e-6):
    """``d value(args) / d args[name]`` for each of ``names``, by central differences.

    ``value`` maps a dict of arguments to a float64 scalar; ``base`` holds float64 arrays (and
    anything else ``value`` needs, passed through). Non-finite entries of an argument get 0.
    """
    grads = {}
    for name in names:
        v = base[name]
        grad = np.zeros(np.shape(v))
        for j in np.ndindex(np.shape(v)):
            if not np.isfinite(v[j]):
                continue
            plus, minus = dict(base), dict(base)
            plus[name], minus[name] = v.copy(), v.copy()
            plus[name][j] += eps
            minus[name][j] -= eps
            grad[j] = (value(plus) - value(minus)) / (2 * eps)
        grads[name] = grad
    return grads


def moved_along(value, base, names, directions, eps=1e-6):
    """``(value(base + eps d), value(base - eps d))``: ``value`` maps a dict of arguments to float64
    values; ``base`` holds the arguments (anything not in ``names`` passed through), ``directions``
    one array per name. Non-finite entries of an argument are not moved. Halve the difference of
    the two over ``eps`` for a directional derivative (a jvp)."""
    moved = []
    for sign in (1, -1):
        args = dict(base)
        for name, d in zip(names, directions):
            p = np.asarray(base[name], np.float64)
            args[name] = p + np.where(np.isfinite(p), sign * eps * d, 0.0)
        moved.append(value(args))
    return tuple(moved)
