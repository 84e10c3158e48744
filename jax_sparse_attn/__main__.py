"""Demo: ``python -m jax_sparse_attn``.

Runs ``gathered_attn_idx`` jitted on the default backend at a DeepSeek-like decode shape
(T=16 tokens, H=64 heads, D=512, K=2048 slots), checks it against an independent float64 numpy
computation, and reports the throughput.
"""

from __future__ import annotations

import argparse
import time

import jax
import ml_dtypes
import numpy as np

from . import gathered_attn_idx


def float64_attention(q, kv, idx, sink, scale):
    """Plain float64 softmax attention with a sink, written independently of the library."""
    q, kv = q.astype(np.float64), kv.astype(np.float64)
    out = np.zeros(q.shape)
    for t in range(q.shape[0]):
        rows = idx[t][(idx[t] >= 0) & (idx[t] < kv.shape[0])]
        if rows.size == 0:
            continue
        x = kv[rows]
        logits = q[t] @ x.T * scale
        m = logits.max(axis=1, keepdims=True)
        e = np.exp(logits - m)
        out[t] = (e @ x) / (e.sum(axis=1) + np.exp(sink - m[:, 0]))[:, None]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m jax_sparse_attn", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--rows", type=int, default=16384, help="rows in the KV cache")
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args(argv)
    T, H, D, K, R = a.tokens, a.heads, a.dim, a.topk, a.rows

    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    q = rng.standard_normal((T, H, D)).astype(bf16)
    kv = rng.standard_normal((R, D)).astype(bf16)
    idx = rng.integers(0, R, (T, K)).astype(np.int32)
    idx[:, -K // 8 :] = -1  # the last eighth of each token's slots is empty (e.g. a short context)
    sink = rng.standard_normal(H).astype(np.float32)
    scale = D**-0.5

    fn = jax.jit(lambda q, kv, idx, sink: gathered_attn_idx(q, kv, idx, sink, scale=scale))
    args = [jax.device_put(x) for x in (q, kv, idx, sink)]
    out = fn(*args).block_until_ready()  # compile + warm-up
    times = []
    for _ in range(a.iters):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    median = float(np.median(times))

    want = float64_attention(q, kv, idx, sink, scale)
    got = np.asarray(out, np.float64)
    err = np.abs(got - want)
    tol = 8e-4 + (3.01 / 128) * np.abs(want)  # FlashMLA's bf16 tolerance
    flops = 4.0 * T * H * K * D  # scores + values
    gathered = T * K * D * 2  # bytes of bf16 rows gathered

    print(f"jax-sparse-attn demo  (jax {jax.__version__})")
    print(f"backend      : {jax.default_backend()} ({jax.devices()[0].device_kind})")
    print(f"shapes       : q [{T}, {H}, {D}] bf16, kv [{R}, {D}] bf16, idx [{T}, {K}] int32, sink [{H}] f32")
    print(f"output       : {tuple(out.shape)} {out.dtype}")
    print(f"vs float64   : max |err| {err.max():.2e}, mean |err| {err.mean():.2e}, "
          f"{np.mean(err <= tol) * 100:.2f}% within FlashMLA's bf16 tolerance")
    print(f"median time  : {median * 1e3:.2f} ms over {a.iters} runs")
    print(f"throughput   : {flops / median / 1e9:.1f} GFLOP/s, {T / median:.0f} tokens/s, "
          f"gather {gathered / median / 1e9:.2f} GB/s")
    if not np.all(err <= tol):
        raise SystemExit("FAILED: result outside tolerance")


if __name__ == "__main__":
    main()
