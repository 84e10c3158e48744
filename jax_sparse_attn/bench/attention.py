"""The attention op's benchmarks: ``gathered_attn_idx`` timed against a naive jnp version and an
f32 GEMM (``bench_shape``), the two-cache call (``bench_two_caches``) and the peak memory of a long
prefill in a fresh process (``run_memory_check``). ``python -m jax_sparse_attn.bench`` runs them
(:mod:`jax_sparse_attn.bench.cli`).

Every figure that depends on the machine is also given as a ratio to a baseline measured in the
same run, on the same machine, in the same rounds (so that a noisy, shared machine slows both
alike):

- ``vs naive``: time of a naive jnp implementation (one gather and two einsums with a softmax in
  between, written below, the same contract arithmetic) divided by the op's time; above 1 means
  the op is faster.
- ``of f32 GEMM``: the op's GFLOP/s over the GFLOP/s of a square f32 matrix product with about
  the same FLOPs.

It also reports GFLOP/s (``4 T H K D`` FLOPs: two products), the effective gather bandwidth (the
``T K D`` slot bytes read from the cache, per second of the op), and checks a few tokens of the
output against a float64 numpy model of the bf16 contract (fraction within one bf16 ulp).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import cpu_products, gathered_attn_idx
from ..attention import reference
from . import common

MEMORY_LIMIT_BYTES = int(1.5 * 2**30)
GRAD_MEMORY_LIMIT_BYTES = 2 * 2**30  # the backward at the same shape (--memory --grad)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark case: T tokens, H heads, D head dim, K slots per token, R cache rows."""

    name: str
    T: int
    H: int
    D: int
    K: int
    R: int

    @property
    def flops(self) -> int:
        return 4 * self.T * self.H * self.K * self.D  # logits and values: 2 T H K D each

    def describe(self) -> str:
        return f"T={self.T} H={self.H} D={self.D} K={self.K} R={self.R}"


# DeepSeek V3.2-like sizes: 64 heads at decode (absorbed MLA, D=512, top-2048), a prefill chunk
# with fewer heads per device.
SHAPES = {
    "decode": [
        Shape("decode-R8k", 16, 64, 512, 2048, 8192),
        Shape("decode-R64k", 16, 64, 512, 2048, 65536),
    ],
    "prefill": [Shape("prefill-T512", 512, 16, 512, 2048, 65536)],
    # DeepSeek V3.2's MLA width (512 + 64 rope columns) with all 128 heads on one device
    "mla": [Shape("prefill-mla", 256, 128, 576, 2048, 65536)],
    # the backward pass (--grad): jax.grad with respect to q, kv and sink
    "grad": [Shape("grad-T256", 256, 16, 512, 2048, 65536)],
}
# The backward's FLOPs, counted as this multiple of the forward's (issue convention: two products
# forward, five backward, the forward recomputed in part).
GRAD_FLOPS_FACTOR = 2.5
QUICK_SHAPES = [
    Shape("decode-quick", 4, 16, 128, 256, 4096),
    Shape("prefill-quick", 64, 8, 128, 256, 4096),
]
MEMORY_SHAPE = Shape("memory-prefill", 4096, 16, 512, 2048, 65536)


# --- the baseline ---------------------------------------------------------------------------------


def naive_attention(q, kv, idx, sink, scale):
    """What one writes without this library: one gather, two einsums, a softmax in between.

    q ``[T, H, D]``, kv ``[R, D]`` (q's dtype), idx ``[T, K]`` int32, sink ``[H]`` f32, scale a
    float -> ``[T, H, D]`` in q's dtype. Same arithmetic as the contract (fp32 accumulation,
    fp32 softmax, probabilities in q's dtype for the value product); a row with no valid slot is
    not special-cased.
    """
    valid = (idx >= 0) & (idx < kv.shape[0])
    g = kv[jnp.where(valid, idx, 0)]
    s = jnp.einsum("thd,tkd->thk", q, g, preferred_element_type=jnp.float32) * scale
    s = jnp.where(valid[:, None, :], s, jnp.float32(-1e30))
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - m)
    den = jnp.sum(e, axis=-1) + jnp.exp(sink[None, :] - m[..., 0])
    o = jnp.einsum("thk,tkd->thd", e.astype(q.dtype), g, preferred_element_type=jnp.float32)
    return (o / den[..., None]).astype(q.dtype)


def sdpa_attention(q, kv, idx, scale):
    """``jax.nn.dot_product_attention`` on the gathered slots: each token is a batch element with
    one query of H heads against its K slots as one shared key/value head (multi-query), empty
    slots masked. JAX's own fused attention (cuDNN on GPU where it applies), for comparison; it
    has no sink, so it does slightly less work than the op. Same operands as ``naive_attention``.
    """
    valid = (idx >= 0) & (idx < kv.shape[0])
    g = kv[jnp.where(valid, idx, 0)][:, :, None, :]  # [T, K, 1, D]
    out = jax.nn.dot_product_attention(q[:, None], g, g, scale=scale,
                                       mask=valid[:, None, None, :])  # [T, 1, H, D]
    return out[:, 0]


# --- an independent model of the contract, for a few tokens ----------------------------------------


def contract_model(q, kv, idx, sink, scale, dtype):
    """numpy model of the arithmetic contract (docs/contract.md, "Arithmetic") for the given
    tokens (float64 products, exact for bf16 operands, rounded to fp32 as an fp32 accumulator
    would be to within its own rounding)."""
    q64 = np.asarray(q, np.float64)
    kv_np = np.asarray(kv)
    out = np.zeros(q.shape, dtype)
    for t in range(q.shape[0]):
        valid = (idx[t] >= 0) & (idx[t] < kv_np.shape[0])
        if not valid.any():
            continue
        x = kv_np[np.where(valid, idx[t], 0)].astype(np.float64)
        s = (q64[t] @ x.T).astype(np.float32) * np.float32(scale)
        s = s + np.where(valid, np.float32(0), np.float32(-1e30))[None, :]
        m = s.max(axis=1, keepdims=True)
        e = np.exp(s - m, dtype=np.float32)
        den = e.sum(axis=1, dtype=np.float32) + np.exp(sink - m[:, 0], dtype=np.float32)
        p = e.astype(dtype).astype(np.float64)
        out[t] = ((p @ x).astype(np.float32) / den[:, None]).astype(dtype)
    return out


def fraction_within_one_ulp(actual, expected) -> float:
    """Fraction of 16-bit float elements whose encodings are at most one step apart."""

    def ordered(a):
        bits = np.asarray(a).view(np.uint16).astype(np.int32)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits & 0x7FFF)

    return float(np.mean(np.abs(ordered(actual) - ordered(expected)) <= 1))


def check_contract(out, q, kv, idx, sink, scale, tokens: int = 16) -> dict:
    """Compares ``tokens`` evenly spaced output tokens with the numpy model of the contract."""
    T = q.shape[0]
    pick = np.unique(np.linspace(0, T - 1, min(tokens, T)).astype(int))
    q_np = np.asarray(q)[pick]
    want = contract_model(q_np, kv, np.asarray(idx)[pick], np.asarray(sink), scale, q_np.dtype)
    got = np.asarray(out)[pick]
    if got.dtype.itemsize == 2:
        return {"tokens_checked": len(pick), "within_one_ulp": fraction_within_one_ulp(got, want)}
    err = np.abs(got.astype(np.float64) - want) / (np.abs(want).max() + 1e-30)
    return {"tokens_checked": len(pick), "max_rel_error": float(err.max())}


# --- timing ---------------------------------------------------------------------------------------


def _inputs(shape: Shape, dtype, seed: int = 0):
    """Random operands on the default device: a quarter of the last eighth of slots empty."""
    T, H, D, K, R = shape.T, shape.H, shape.D, shape.K, shape.R
    k_q, k_kv, k_idx, k_sink = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(k_q, (T, H, D), dtype)
    kv = jax.random.normal(k_kv, (R, D), dtype)
    idx = jax.random.randint(k_idx, (T, K), 0, R, jnp.int32)
    idx = idx.at[:, -max(K // 32, 1) :].set(-1)  # some empty slots, as a short context has
    sink = jax.random.normal(k_sink, (H,), jnp.float32)
    return jax.block_until_ready((q, kv, idx, sink))



def _kv_scatter(shape: Shape, dtype=jnp.bfloat16, seed: int = 2):
    """The cache gradient's bare accumulation, a baseline for ``--grad``: for each of T tokens, K
    rows of D f32 values (already computed) added into an f32 ``[R, D]`` array at the token's
    slot rows, then cast to the cache's ``dtype``. Any backward that returns ``d kv`` in f32
    accuracy does at least this memory traffic (a read-modify-write of T K rows of D f32 at rows
    spread over the cache). Returns (fn, args)."""
    T, K, D, R = shape.T, shape.K, shape.D, shape.R
    rows = jax.random.randint(jax.random.key(seed), (T, K), 0, R, jnp.int32)
    values = jax.random.normal(jax.random.key(seed + 1), (K, D), jnp.float32)

    def scatter(rows, values):
        def step(acc, rows_t):  # each token's values differ (scaled by its first row index)
            return acc.at[rows_t].add(values * rows_t[0].astype(jnp.float32), mode="drop"), None
        acc, _ = jax.lax.scan(step, jnp.zeros((R, D), jnp.float32), rows)
        return acc.astype(dtype)

    return jax.jit(scatter), (rows, values)



def _grad_op(impl, scale, cotangent):
    """``jax.grad`` of ``sum(out * cotangent)`` with respect to q, kv and sink."""

    def loss(q, kv, idx, sink):
        out = gathered_attn_idx(q, kv, idx, sink, scale=scale, implementation=impl)
        return jnp.sum(out.astype(jnp.float32) * cotangent)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 3)))


def _compiled_in_form(fn, args, form: str):
    """``fn`` jitted and compiled for ``args`` with the reference's CPU products in ``form``
    (``cpu_products.parse_form``), whatever the CPU would pick."""
    with cpu_products.forced(cpu_products.parse_form(form)):
        jax.clear_caches()  # lowerings are cached per shape, not per form
        compiled = jax.jit(fn).lower(*args).compile()
    jax.clear_caches()
    return compiled


def bench_shape(shape: Shape, dtype_name: str, implementation: str, repeats: int, warmup: int,
                naive: bool = True, gemm: bool = True, grad: bool = False,
                sdpa: bool = False, forms: Sequence[str] = ("auto",)) -> dict:
    """Times the op (and, unless disabled, the naive baseline and the f32 GEMM) at one shape.
    With ``grad``: the gradient with respect to q, kv and sink instead, against an f32 GEMM of
    ``GRAD_FLOPS_FACTOR`` times the forward's FLOPs, and no naive baseline.

    ``forms``: the reference's CPU product forms to time (``cpu_products.form_name``, or
    ``auto``), all in the same rounds. The first is the record's ``op``; each further one is
    timed as ``op[form]`` and summarised under ``other_cpu_products``."""
    dtype = common.DTYPES[dtype_name]
    q, kv, idx, sink = _inputs(shape, dtype)
    args = (q, kv, idx, sink)
    scale = shape.D**-0.5
    impl = common.implementation_arg(implementation)

    def forward(q, kv, idx, sink):
        return gathered_attn_idx(q, kv, idx, sink, scale=scale, implementation=impl)

    op = forward
    if grad:
        cotangent = jax.random.normal(jax.random.key(7), q.shape, jnp.float32)
        op, naive = _grad_op(impl, scale, cotangent), False
    names = [cpu_products.form_name(cpu_products.parse_form(f)) for f in forms]
    fns, outs, compile_s = {}, {}, {}
    for i, name in enumerate(names):
        key = "op" if i == 0 else f"op[{name}]"
        compile_start = time.perf_counter()
        fns[key] = (_compiled_in_form(op, args, name), args)
        jax.block_until_ready(fns[key][0](*args))
        compile_s[key] = time.perf_counter() - compile_start
        outs[key] = (_compiled_in_form(forward, args, name)(*args) if grad
                     else fns[key][0](*args))
    out = outs["op"]
    if naive:
        fns["naive"] = (jax.jit(lambda q, kv, idx, sink: naive_attention(q, kv, idx, sink, scale)),
                        (q, kv, idx, sink))
    if sdpa and not grad:
        fns["sdpa"] = (jax.jit(lambda q, kv, idx, sink: sdpa_attention(q, kv, idx, scale)),
                       (q, kv, idx, sink))
    gemm_flops = None
    flops = int(shape.flops * (GRAD_FLOPS_FACTOR if grad else 1))
    if gemm:
        gemm_fn, gemm_args, gemm_flops = common.square_gemm(flops)
        fns["gemm_f32"] = (gemm_fn, gemm_args)
    if grad:
        fns["kv_scatter"] = _kv_scatter(shape, dtype)
    load_before = common.load_average()
    cpu_times: dict = {}
    times = common.time_rounds(fns, repeats, warmup, cpu_times)
    med = {k: float(np.median(v)) for k, v in times.items()}
    cpu_med = {k: float(np.median(v)) for k, v in cpu_times.items()}
    itemsize = np.dtype(dtype).itemsize
    rec = {
        "shape": dataclasses.asdict(shape),
        "dtype": dtype_name,
        "implementation": implementation,
        "pass": "grad wrt q, kv, sink" if grad else "forward",
        "flops": flops,
        "cpu_products": names[0],
        "first_call_s": compile_s["op"],
        "times_s": times,
        "median_s": med,
        "op_gflops": flops / med["op"] / 1e9,
        "gather_gbytes_per_s": shape.T * shape.K * shape.D * itemsize / med["op"] / 1e9,
        "contract_check": check_contract(out, q, kv, idx, sink, scale),
        # Contention: the load averages before and after the timed rounds (os.cpu_count() cores).
        "load_average": {"before": load_before, "after": common.load_average()},
        "cpu_times_s": cpu_times,
        "median_cpu_s": cpu_med,
        # Cores each call kept busy on average (CPU seconds over wall seconds, medians).
        "cores_busy": {k: cpu_med[k] / med[k] for k in med if med[k] > 0},
    }
    if naive:
        rec["naive_over_op"] = med["naive"] / med["op"]
        # Ratio of the per-round ratios: less sensitive to a slow round than the ratio of medians.
        rec["naive_over_op_per_round_median"] = float(
            np.median(np.array(times["naive"]) / np.array(times["op"])))
    if "sdpa" in med:
        rec["sdpa_over_op"] = med["sdpa"] / med["op"]
    if grad:
        # How much of the op's time the cache gradient's bare accumulation alone takes, and the
        # GEMM fraction the op could reach if everything else ran at the GEMM's rate.
        rec["kv_scatter_over_op"] = med["kv_scatter"] / med["op"]
        if gemm:
            rec["gemm_fraction_bound_given_kv_scatter"] = med["gemm_f32"] / (
                med["gemm_f32"] + med["kv_scatter"])
    if gemm:
        rec["gemm_f32_flops"] = gemm_flops
        rec["gemm_f32_gflops"] = gemm_flops / med["gemm_f32"] / 1e9
        rec["op_fraction_of_gemm_f32"] = rec["op_gflops"] / rec["gemm_f32_gflops"]
        # The same ratio per CPU second: the work efficiency of the op against the GEMM, whatever
        # number of cores each got. Equal to the wall-time ratio when both keep as many cores busy.
        if cpu_med["op"] > 0 and cpu_med["gemm_f32"] > 0:
            rec["op_fraction_of_gemm_f32_per_cpu_s"] = (
                (flops / cpu_med["op"]) / (gemm_flops / cpu_med["gemm_f32"]))
    others = {}
    for key in fns:
        if key.startswith("op["):
            other = {"median_s": med[key], "first_call_s": compile_s[key],
                     "op_gflops": flops / med[key] / 1e9,
                     # op's time over this form's, the median of the per-round ratios
                     "op_over_this": float(np.median(np.array(times["op"])
                                                     / np.array(times[key]))),
                     "contract_check": check_contract(outs[key], q, kv, idx, sink, scale)}
            if gemm:
                other["op_fraction_of_gemm_f32"] = other["op_gflops"] / rec["gemm_f32_gflops"]
            others[key[3:-1]] = other
    if others:
        rec["other_cpu_products"] = others
    return rec


# --- two caches (DeepSeek V4: sliding window + compressed rows) ----------------------------------

# V4 decode (docs: FlashMLA's tests and the V4 reference): a window of 128 raw rows per token and
# the top-512 of 256k compressed rows, 64 heads, D = 512.
V4_DECODE = {"T": 16, "H": 64, "D": 512, "window": 128, "topk": 512, "R": 262144}


def _merged_by_lse(a, b):
    """The output of two ``(out, lse)`` calls merged by their lse: the two-calls alternative."""
    from .. import merge_attention

    return merge_attention([a[0], b[0]], [a[1], b[1]])[0]


def bench_two_caches(repeats: int, warmup: int, dtype_name: str = "bf16", T: Optional[int] = None,
                     R: Optional[int] = None) -> dict:
    """Times ``gathered_attn_idx(q, window, window_idx, sink, extra_kv=compressed, extra_idx=...)``
    (one softmax over both caches) against (a) concatenating the two caches and one call on the
    concatenation, and (b) two calls (the sink in the first) merged by ``merge_attention``; and
    V4's FP8 split rows as the main cache beside the window, one call and two calls merged; all
    jitted, interleaved rounds. Returns the record with ``concat_over_op``, ``merge_over_op``,
    ``fp8_op_over_op`` and ``fp8_merge_over_fp8_op``.
    """
    shape = dict(V4_DECODE, **({"T": T} if T else {}), **({"R": R} if R else {}))
    T, H, D, W, K, R = (shape[k] for k in ("T", "H", "D", "window", "topk", "R"))
    dtype = common.DTYPES[dtype_name]
    keys = jax.random.split(jax.random.key(3), 6)
    q = jax.random.normal(keys[0], (T, H, D), dtype)
    window = jax.random.normal(keys[1], (T * W, D), dtype)  # each token's own 128 rows
    compressed = jax.random.normal(keys[2], (R, D), dtype)
    window_idx = (jnp.arange(T, dtype=jnp.int32)[:, None] * W
                  + jnp.arange(W, dtype=jnp.int32)[None, :])  # fmt: skip
    topk_idx = jax.random.randint(keys[3], (T, K), 0, R, jnp.int32)
    sink = jax.random.normal(keys[4], (H,), jnp.float32)
    args = jax.block_until_ready((q, window, window_idx, compressed, topk_idx, sink))

    def two_caches(q, window, window_idx, compressed, topk_idx, sink):
        return gathered_attn_idx(q, window, window_idx, sink, extra_kv=compressed,
                                 extra_idx=topk_idx)

    def concatenated(q, window, window_idx, compressed, topk_idx, sink):
        kv = jnp.concatenate([window, compressed])  # a copy of every row, each step
        idx = jnp.concatenate([window_idx, topk_idx + window.shape[0]], axis=1)
        return gathered_attn_idx(q, kv, idx, sink)

    def merged(q, window, window_idx, compressed, topk_idx, sink):
        return _merged_by_lse(gathered_attn_idx(q, window, window_idx, sink, return_lse=True),
                              gathered_attn_idx(q, compressed, topk_idx, None, return_lse=True))

    # V4's FP8 compressed rows (448 FP8 columns, power-of-two scales per 64, 64 bf16 rope columns)
    # as the main cache beside the bf16 window: one call, and two calls merged.
    fp8_cols = D - 64
    fp8_args = jax.block_until_ready((
        q, window, window_idx, compressed[:, :fp8_cols].astype(jnp.float8_e4m3fn),
        jnp.exp2(jax.random.randint(keys[5], (R, fp8_cols // 64), -6, 0)).astype(jnp.float32),
        compressed[:, fp8_cols:], topk_idx, sink))

    def fp8_two_caches(q, window, window_idx, kv8, scales, rope, topk_idx, sink):
        return gathered_attn_idx(q, kv8, topk_idx, sink, kv_scale=scales, kv_rope=rope,
                                 extra_kv=window, extra_idx=window_idx)

    def fp8_merged(q, window, window_idx, kv8, scales, rope, topk_idx, sink):
        return _merged_by_lse(gathered_attn_idx(q, kv8, topk_idx, sink, kv_scale=scales,
                                                kv_rope=rope, return_lse=True),
                              gathered_attn_idx(q, window, window_idx, None, return_lse=True))

    fns = {name: (jax.jit(fn), a) for name, fn, a in
           (("op", two_caches, args), ("concat", concatenated, args), ("merge", merged, args),
            ("fp8_op", fp8_two_caches, fp8_args), ("fp8_merge", fp8_merged, fp8_args))}
    outs = {name: np.asarray(jax.block_until_ready(fn(*a)), np.float32)
            for name, (fn, a) in fns.items()}
    load_before = common.load_average()
    times = common.time_rounds(fns, repeats, warmup)
    med = {k: float(np.median(v)) for k, v in times.items()}
    bits = np.dtype(f"uint{8 * np.dtype(dtype).itemsize}")
    same_as_concat = bool(np.array_equal(
        np.asarray(jnp.asarray(outs["op"], dtype)).view(bits),
        np.asarray(jnp.asarray(outs["concat"], dtype)).view(bits)))
    return {
        "case": "two caches, V4 decode", "shape": shape, "dtype": dtype_name,
        "times_s": times, "median_s": med,
        "concat_over_op": med["concat"] / med["op"],
        "merge_over_op": med["merge"] / med["op"],
        "fp8_op_over_op": med["fp8_op"] / med["op"],
        "fp8_merge_over_fp8_op": med["fp8_merge"] / med["fp8_op"],
        "op_same_bits_as_concat": same_as_concat,
        "max_abs_diff_merge_vs_op": float(np.abs(outs["merge"] - outs["op"]).max()),
        "max_abs_diff_fp8_merge_vs_fp8_op": float(np.abs(outs["fp8_merge"] - outs["fp8_op"]).max()),
        "load_average": {"before": load_before, "after": common.load_average()},
    }


# --- memory ---------------------------------------------------------------------------------------



def memory_child(shape: Shape, dtype_name: str, implementation: str, check_tokens: int,
                 grad: bool = False, kv_dtype: str = "bfloat16") -> dict:
    """Runs in a fresh process: peak RSS growth of compiling and running one call.

    The growth is the peak after the call minus the resident size once the inputs exist, so the
    inputs are excluded and everything else (compilation, the cache's bits, chunk buffers, the
    output) is included. Creating the inputs has its own transient peak, so the kernel's peak
    counter is reset once they exist (where it cannot be, the growth is an upper bound). Then a few tokens are recomputed as a small separate call traced with
    the reference's chunking switched off (one batch, no loop, slots gathered up front) and
    compared bit for bit with the same rows of the long call. With ``grad``: the peak growth of one
    ``jax.grad`` call with respect to q, kv and sink instead (limit ``GRAD_MEMORY_LIMIT_BYTES``;
    the gradients themselves, kv's in f32, are included), without the bit comparison. With an FP8
    ``kv_dtype`` the cache is FP8 with one f32 scale per 128 columns (``kv_scale``), and the contract
    check runs on the dequantised cache.
    """
    dtype = common.DTYPES[dtype_name]
    q, kv, idx, sink = _inputs(shape, dtype)
    scale = shape.D**-0.5
    impl = common.implementation_arg(implementation)
    fp8_kw: dict = {}
    if kv_dtype != "bfloat16":
        groups = max(1, shape.D // 128) if shape.D % 128 == 0 else 1
        kv_scale = jax.random.uniform(jax.random.key(9), (shape.R, groups), jnp.float32, 0.5, 2.0)
        kv = jax.block_until_ready(kv.astype(getattr(jnp, kv_dtype)))
        fp8_kw = {"kv_scale": jax.block_until_ready(kv_scale)}
    peak_reset = common.reset_peak_rss()
    rss_before = common.rss_bytes()
    peak_before = common.peak_rss_bytes()
    start = time.perf_counter()
    if grad:
        cotangent = jnp.ones(q.shape, jnp.float32)
        jax.block_until_ready(_grad_op(impl, scale, cotangent)(q, kv, idx, sink))
        seconds = time.perf_counter() - start
        growth = common.peak_rss_bytes() - rss_before
        return {
            "shape": dataclasses.asdict(shape), "dtype": dtype_name, "implementation": implementation,
            "pass": "grad wrt q, kv, sink", "peak_reset": peak_reset, "growth_bytes": growth,
            "limit_bytes": GRAD_MEMORY_LIMIT_BYTES, "within_limit": growth <= GRAD_MEMORY_LIMIT_BYTES,
            "input_bytes": int(sum(x.nbytes for x in (q, kv, idx, sink))),
            "seconds_first_call": seconds,
        }
    out = jax.jit(lambda q, kv, idx, sink: gathered_attn_idx(
        q, kv, idx, sink, scale=scale, implementation=impl, **fp8_kw))(q, kv, idx, sink)
    out = jax.block_until_ready(out)
    seconds = time.perf_counter() - start
    peak_after = common.peak_rss_bytes()
    growth = peak_after - rss_before

    pick = np.unique(np.linspace(0, shape.T - 1, check_tokens).astype(int))
    budgets = reference.CHUNK_BYTES, reference.PREGATHER_MAX_BYTES
    reference.CHUNK_BYTES = reference.PREGATHER_MAX_BYTES = 2**62  # read while tracing
    try:
        few = jax.jit(lambda q, kv, idx, sink: gathered_attn_idx(
            q, kv, idx, sink, scale=scale, implementation=impl, **fp8_kw))(
                q[pick], kv, idx[pick], sink)
        few = jax.block_until_ready(few)
    finally:
        reference.CHUNK_BYTES, reference.PREGATHER_MAX_BYTES = budgets
    bits = np.dtype(f"uint{8 * np.dtype(dtype).itemsize}")
    same = bool(np.array_equal(np.asarray(out)[pick].view(bits), np.asarray(few).view(bits)))
    kv_for_check = kv
    if fp8_kw:  # the contract on the dequantised cache (a numpy copy, outside the measurement)
        s = np.asarray(fp8_kw["kv_scale"])
        x = np.asarray(kv).astype(np.float32).reshape(shape.R, s.shape[1], -1) * s[:, :, None]
        kv_for_check = jnp.asarray(x.reshape(shape.R, shape.D), dtype)
    return {
        "shape": dataclasses.asdict(shape),
        "kv_dtype": kv_dtype,
        "dtype": dtype_name,
        "implementation": implementation,
        "input_bytes": int(sum(x.nbytes for x in (q, kv, idx, sink))),
        "gathered_slot_bytes": shape.T * shape.K * shape.D * np.dtype(dtype).itemsize,
        "rss_before_bytes": rss_before,
        "peak_before_bytes": peak_before,
        "peak_reset": peak_reset,
        "peak_after_bytes": peak_after,
        "growth_bytes": growth,
        "limit_bytes": MEMORY_LIMIT_BYTES,
        "within_limit": growth <= MEMORY_LIMIT_BYTES,
        "seconds_first_call": seconds,
        "rows_checked": len(pick),
        "rows_same_bits_as_unchunked": same,
        "contract_check": check_contract(out, q, kv_for_check, idx, sink, scale),
    }


def run_memory_check(shape: Shape, dtype_name: str, implementation: str,
                     check_tokens: int = 4, timeout: float = 900, grad: bool = False,
                     kv_dtype: str = "bfloat16") -> dict:
    """Runs :func:`memory_child` in a fresh Python process and returns its record."""
    cmd = [sys.executable, "-m", "jax_sparse_attn.bench", "--memory-child",
           "--shape", f"{shape.T},{shape.H},{shape.D},{shape.K},{shape.R}",
           "--dtype", dtype_name, "--implementation", implementation,
           "--check-tokens", str(check_tokens), "--kv-dtype", kv_dtype] + (
               ["--grad"] if grad else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"memory check failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- reporting ------------------------------------------------------------------------------------


def format_table(records: Sequence[dict]) -> str:
    head = (f"{'case':<14} {'shape':<34} {'impl':<10} {'products':<14} {'op ms':>8} {'naive ms':>9} {'vs naive':>9} "
            f"{'GFLOP/s':>8} {'of f32 GEMM':>11} {'per CPU s':>9} {'cores op/GEMM':>13} "
            f"{'gather GB/s':>11} {'ulp<=1':>7}")
    lines = [head, "-" * len(head)]
    for r in records:
        s = Shape(**r["shape"])
        med = r["median_s"]
        naive = f"{med['naive'] * 1e3:9.2f}" if "naive" in med else f"{'-':>9}"
        ratio = f"{r['naive_over_op']:8.2f}x" if "naive_over_op" in r else f"{'-':>9}"
        gemm = f"{r['op_fraction_of_gemm_f32']:11.2f}" if "op_fraction_of_gemm_f32" in r else f"{'-':>11}"
        per_cpu = (f"{r['op_fraction_of_gemm_f32_per_cpu_s']:9.2f}"
                   if "op_fraction_of_gemm_f32_per_cpu_s" in r else f"{'-':>9}")
        cores = r.get("cores_busy", {})
        busy = (f"{cores['op']:6.2f}/{cores['gemm_f32']:<6.2f}" if "gemm_f32" in cores
                else f"{'-':>13}")
        check = r["contract_check"]
        ulp = f"{check['within_one_ulp']:7.4f}" if "within_one_ulp" in check else f"{check['max_rel_error']:7.1e}"
        products = r.get("cpu_products", "-")
        lines.append(f"{s.name:<14} {s.describe():<34} {r['implementation']:<10} {products:<14} "
                     f"{med['op'] * 1e3:8.2f} "
                     f"{naive} {ratio} {r['op_gflops']:8.1f} {gemm} {per_cpu} {busy} "
                     f"{r['gather_gbytes_per_s']:11.2f} {ulp}")
        for name, o in r.get("other_cpu_products", {}).items():  # timed in the same rounds
            o_gemm = (f"{o['op_fraction_of_gemm_f32']:11.2f}" if "op_fraction_of_gemm_f32" in o
                      else f"{'-':>11}")
            o_check = o["contract_check"]
            o_ulp = (f"{o_check['within_one_ulp']:7.4f}" if "within_one_ulp" in o_check
                     else f"{o_check['max_rel_error']:7.1e}")
            lines.append(f"{'':<14} {'':<34} {'':<10} {name:<14} {o['median_s'] * 1e3:8.2f} "
                         f"{'-':>9} {'-':>9} {o['op_gflops']:8.1f} {o_gemm} {'-':>9} {'-':>13} "
                         f"{s.T * s.K * s.D * itemsize(r) / o['median_s'] / 1e9:11.2f} "
                         f"{o_ulp}")
    return "\n".join(lines)


def itemsize(record: dict) -> int:
    """Bytes per element of a record's dtype."""
    return np.dtype(common.DTYPES[record["dtype"]]).itemsize


