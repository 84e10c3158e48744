"""Benchmarks: ``python -m jax_sparse_attn.bench``.

Times ``gathered_attn_idx`` jitted on the current backend over decode and prefill shapes, after
warm-up, and reports medians over interleaved rounds. Every figure that depends on the machine is
also given as a ratio to a baseline measured in the same run, on the same machine, in the same
rounds (so that a noisy, shared machine slows both alike):

- ``vs naive``: time of a naive jnp implementation (one gather and two einsums with a softmax in
  between, written below, the same contract arithmetic) divided by the op's time; above 1 means
  the op is faster.
- ``of f32 GEMM``: the op's GFLOP/s over the GFLOP/s of a square f32 matrix product with about
  the same FLOPs.

It also reports GFLOP/s (``4 T H K D`` FLOPs: two products), the effective gather bandwidth (the
``T K D`` slot bytes read from the cache, per second of the op), and checks a few tokens of the
output against a float64 numpy model of the bf16 contract (fraction within one bf16 ulp).

``--memory`` measures, in a fresh subprocess, the peak resident memory growth of one call at a
long prefill (T=4096, K=2048, D=512, H=16 by default; the gathered slots alone would be 8 GiB),
and checks a few output rows against the same tokens computed without chunking.

``--plot PATH`` instead sweeps K and T (time, op against naive) and T (memory) and writes the charts
as one PNG (measured by ``bench_sweeps.py``, drawn by ``plots.py``; needs matplotlib, the ``plot``
extra).

``--two-caches`` times the two-cache call (``extra_kv``) at a DeepSeek V4 decode shape (a sliding
window of 128 rows per token beside compressed rows picked by top-k) against its two
alternatives: concatenating the caches and making one call, and two calls merged by lse.

``--model trn1|trn2|trn3`` reports the modelled (not measured) Trainium time of the NKI kernel
instead, from the emulator's cost model (:mod:`jax_sparse_attn.bench_model`).

``--implementation`` is passed to the public API as is: ``None`` (the default: the NKI kernel on
Trainium, the jnp reference elsewhere), ``reference``, ``nki`` or ``nki_emulated``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import cpu_products, gathered_attn_idx
from .attention import reference

IMPLEMENTATIONS = ("none", "reference", "nki", "nki_emulated")
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}
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


def _square_gemm(flops: int, seed: int = 1):
    """An f32 ``[n, n] @ [n, n]`` with ``2 n^3`` close to ``flops``; returns (fn, args, its FLOPs)."""
    n = max(16, int(round((flops / 2) ** (1 / 3) / 16)) * 16)
    a, b = jax.random.normal(jax.random.key(seed), (2, n, n), jnp.float32)
    return jax.jit(jnp.matmul), (a, b), 2 * n**3


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


def _time_rounds(fns: dict[str, tuple[Callable, tuple]], repeats: int, warmup: int,
                 cpu_times: Optional[dict] = None) -> dict:
    """Runs each function ``warmup`` times, then ``repeats`` interleaved rounds; seconds per call.

    ``cpu_times``, when given, is filled with the process's CPU seconds (all threads, user +
    system) spent in each call: on a shared machine the wall time depends on what else runs,
    while CPU time per call, and CPU time over wall time (the cores a call kept busy), do much
    less.
    """
    for fn, args in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {k: [] for k in fns}
    if cpu_times is not None:
        cpu_times.update({k: [] for k in fns})
    for _ in range(repeats):
        for name, (fn, args) in fns.items():
            cpu_start = time.process_time()
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
            if cpu_times is not None:
                cpu_times[name].append(time.process_time() - cpu_start)
    return times


def _load_average() -> Optional[list]:
    """The 1, 5 and 15 minute load averages (Unix), or None."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _implementation_arg(name: str) -> Optional[str]:
    return None if name == "none" else name


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
    dtype = DTYPES[dtype_name]
    q, kv, idx, sink = _inputs(shape, dtype)
    args = (q, kv, idx, sink)
    scale = shape.D**-0.5
    impl = _implementation_arg(implementation)

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
        gemm_fn, gemm_args, gemm_flops = _square_gemm(flops)
        fns["gemm_f32"] = (gemm_fn, gemm_args)
    if grad:
        fns["kv_scatter"] = _kv_scatter(shape, dtype)
    load_before = _load_average()
    cpu_times: dict = {}
    times = _time_rounds(fns, repeats, warmup, cpu_times)
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
        "load_average": {"before": load_before, "after": _load_average()},
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
    from . import merge_attention

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
    dtype = DTYPES[dtype_name]
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
    load_before = _load_average()
    times = _time_rounds(fns, repeats, warmup)
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
        "load_average": {"before": load_before, "after": _load_average()},
    }


# --- memory ---------------------------------------------------------------------------------------


def _status_bytes(field: str) -> Optional[int]:
    """A ``kB`` field of /proc/self/status (Linux), in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_peak_rss() -> bool:
    """Resets the kernel's peak RSS to the current RSS (Linux >= 4.0); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_bytes() -> int:
    """Current resident set size; the peak so far where the current one is unavailable."""
    current = _status_bytes("VmRSS")
    return current if current is not None else _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    """Peak resident set size: VmHWM (which ``_reset_peak_rss`` resets), else ru_maxrss."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


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
    dtype = DTYPES[dtype_name]
    q, kv, idx, sink = _inputs(shape, dtype)
    scale = shape.D**-0.5
    impl = _implementation_arg(implementation)
    fp8_kw: dict = {}
    if kv_dtype != "bfloat16":
        groups = max(1, shape.D // 128) if shape.D % 128 == 0 else 1
        kv_scale = jax.random.uniform(jax.random.key(9), (shape.R, groups), jnp.float32, 0.5, 2.0)
        kv = jax.block_until_ready(kv.astype(getattr(jnp, kv_dtype)))
        fp8_kw = {"kv_scale": jax.block_until_ready(kv_scale)}
    peak_reset = _reset_peak_rss()
    rss_before = _rss_bytes()
    peak_before = _peak_rss_bytes()
    start = time.perf_counter()
    if grad:
        cotangent = jnp.ones(q.shape, jnp.float32)
        jax.block_until_ready(_grad_op(impl, scale, cotangent)(q, kv, idx, sink))
        seconds = time.perf_counter() - start
        growth = _peak_rss_bytes() - rss_before
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
    peak_after = _peak_rss_bytes()
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


def write_records(records: list, json_path: str) -> None:
    """Writes ``records`` with this run's environment block (``--json``) and says where."""
    from .bench_model import write_json

    write_json({"environment": environment(), "records": records}, json_path)


def environment() -> dict:
    """Where the figures come from."""
    cpu = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in cpu:
                    cpu[key] = value.strip()
                if key == "flags" and "flags" not in cpu:
                    flags = value.split()
                    cpu["flags"] = " ".join(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))
    except OSError:
        cpu["model name"] = platform.processor()
    device = jax.devices()[0]
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "jaxlib": _jaxlib_version(),
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        # e.g. --xla_cpu_max_isa=AVX2 to measure what an AVX2-only CPU would run
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        # The reference's CPU product form this process picks (a record's own form is its
        # "cpu_products"), why, and the override.
        "cpu_products": {
            "auto": cpu_products.form_name(cpu_products.cpu_form()),
            "cpu_reports_native_bf16": cpu_products.cpu_reports_native_bf16(),
            "products_by_eigen": cpu_products.products_by_eigen(),
            cpu_products.ENV_VAR: os.environ.get(cpu_products.ENV_VAR),
        },
    }


def _jaxlib_version() -> Optional[str]:
    try:
        import jaxlib

        return jaxlib.__version__
    except (ImportError, AttributeError):
        return None


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
    return np.dtype(DTYPES[record["dtype"]]).itemsize


def _parse_shape(text: str) -> Shape:
    try:
        T, H, D, K, R = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape wants T,H,D,K,R (five integers); got {text!r}")
    return Shape("custom", T, H, D, K, R)


def _parse_forms(text: str) -> list:
    forms = [f.strip() for f in text.split(",") if f.strip()]
    try:
        for f in forms:
            cpu_products.parse_form(f)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err))
    return forms or ["auto"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_sparse_attn.bench",
                                description="Times gathered_attn_idx (jitted, after warm-up, medians of "
                                "interleaved rounds) against a naive jnp implementation and an f32 GEMM "
                                "measured in the same run; --memory measures the peak memory of a long "
                                "prefill in a subprocess.")
    p.add_argument("--cases", default="decode,prefill",
                   help="comma-separated groups of shapes: decode, prefill, mla, grad (default: "
                   "decode,prefill; use grad with --grad); indexer (indexer_topk against an f32 "
                   "GEMM and the dense path), layer-decode (the Flax layer's donated decode "
                   "step against the indexer and the op alone) and layer-prefill (the layer's "
                   "causal prefill of a batch): see bench_indexer.py")
    p.add_argument("--shape", type=_parse_shape, action="append",
                   help="a custom shape T,H,D,K,R (repeatable; replaces --cases)")
    p.add_argument("--quick", action="store_true",
                   help="small shapes and few rounds: a smoke run in seconds (CI)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--implementation", choices=IMPLEMENTATIONS, default="none",
                   help="passed to the API; 'none' = implementation=None (the default)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 15; 3 quick)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls after compiling")
    p.add_argument("--no-naive", action="store_true", help="skip the naive baseline")
    p.add_argument("--sdpa", action="store_true",
                   help="also time jax.nn.dot_product_attention on the gathered slots (no sink), "
                   "recorded as sdpa_over_op")
    p.add_argument("--no-gemm", action="store_true", help="skip the f32 GEMM baseline")
    p.add_argument("--cpu-products", type=_parse_forms, default=["auto"], metavar="FORMS",
                   help="comma-separated forms of the reference's products on CPU, each timed in "
                   "the same rounds (the first is the table's main row): native (16-bit operands "
                   "as they are) or f32 (widened in cache), each optionally with -x-first (the "
                   "layout for XLA's Eigen kernels), or auto: what this process picks "
                   "(cpu_products.cpu_form; JAX_SPARSE_ATTN_CPU_PRODUCTS overrides it). "
                   "E.g. --cpu-products native,f32")
    p.add_argument("--grad", action="store_true",
                   help="time jax.grad with respect to q, kv and sink instead of the forward, "
                   f"against an f32 GEMM of {GRAD_FLOPS_FACTOR}x the forward's FLOPs")
    p.add_argument("--memory", action="store_true",
                   help="measure peak memory growth of one long prefill call in a subprocess")
    p.add_argument("--check-tokens", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", metavar="PATH", help="also write every record and the environment")
    p.add_argument("--plot", metavar="PATH", help="instead: sweep K and T (time) and T (memory), "
                   "op against naive, and write the charts as one PNG (needs matplotlib; see plots.py)")
    p.add_argument("--two-caches", action="store_true",
                   help="time the two-cache call (extra_kv) at a V4 decode shape against "
                   "concatenate-then-call and two calls merged by lse (T and R: --shape T,H,D,K,R "
                   "overrides T and R only)")
    p.add_argument("--model", choices=("trn1", "trn2", "trn3"),
                   help="instead of timing: the MODELLED Trainium time of the NKI kernel under the "
                   "emulator's cost model (see jax_sparse_attn/bench_model.py)")
    p.add_argument("--kv-dtype", choices=("bfloat16", "float8_e4m3fn", "float8_e5m2"),
                   default="bfloat16", help="with --model or --memory: the cache dtype (FP8 with "
                   "f32 scales)")
    p.add_argument("--scale-groups", type=int, default=1,
                   help="with --model and an FP8 --kv-dtype: f32 scales per cache row")
    p.add_argument("--indexer-sweep", action="store_true",
                   help="instead: time and peak memory of indexer_topk and the dense path against "
                   "T (prefill) and R (decode), each point in a fresh process (--json to keep it; "
                   "python -m jax_sparse_attn.plots --indexer-sweep JSON --png PATH draws it)")
    p.add_argument("--max-size", type=int, default=None,
                   help="with --indexer-sweep: skip the prefill points with T above this")
    p.add_argument("--indexer-sweep-child", metavar="SHAPE_JSON", help=argparse.SUPPRESS)
    p.add_argument("--indexer-path", choices=("op", "dense"), default="op", help=argparse.SUPPRESS)
    p.add_argument("--indexer-only", metavar="NAMES",
                   help="with --cases indexer: only these cases (comma-separated names, e.g. "
                   "idx-v32-prefill,idx-v32-decode,idx-small-prefill)")
    p.add_argument("--layer-memory", type=int, nargs="?", const=-1, default=None, metavar="T",
                   help="instead: peak memory growth of the Flax layer's causal prefill of T "
                   "tokens (default 65536, issue 17's case) in a fresh process")
    p.add_argument("--layer-memory-child", type=int, metavar="T", help=argparse.SUPPRESS)
    p.add_argument("--layer-sizes", metavar="JSON", help=argparse.SUPPRESS)
    p.add_argument("--layer-selection", default="streaming", help=argparse.SUPPRESS)
    p.add_argument("--v4", metavar="CASES",
                   help="DeepSeek V4 attention at V4-Flash's shapes (bench_v4.py): decode, prefill, "
                   "memory, sweep (comma-separated)")
    p.add_argument("--v4-kinds", default="ratio4,ratio128",
                   help="--v4: the layer kinds (ratio4: window + indexer; ratio128: every block; "
                        "v32: DeepSeek V3.2's layer at V3.2-Exp's shapes)")
    p.add_argument("--v4-context", type=int, default=None,
                   help="--v4 decode: the context (default 2**20, v32 2**17); sweep: the largest context")
    p.add_argument("--v4-tokens", type=int, default=None,
                   help="--v4 prefill (default 8192) and memory (default 65536, v32 32768): tokens per call")
    p.add_argument("--v4-plot", metavar="PATH", help="--v4 sweep: also draw time and memory")
    p.add_argument("--v4-child", metavar="SPEC", help=argparse.SUPPRESS)
    p.add_argument("--value-dim", type=int, default=None,
                   help="with --model: the value columns (value_dim <= D; default D); each "
                   "shape is modelled with all D columns of values too, for the ratio")
    p.add_argument("--cpu-devices", type=int, default=1, metavar="N",
                   help="--cases indexer, layer-prefill: give JAX N CPU devices (one per core) "
                   "and also time each prefill split over them, its tokens dealt out (indexer) or "
                   "its batch (layer), in the same rounds (XLA:CPU runs one program's sorts and "
                   "scatters on one core at a time; N devices run N programs side by side)")
    p.add_argument("--op", choices=("attention", "indexer", "compress_pool"), default="attention",
                   help="with --model: the op to model; for indexer, --shape is T,R,Hi,Di,K "
                   "(jax_sparse_attn/indexer/bench_model.py); compress_pool models V4-Flash's "
                   "compressor shapes (jax_sparse_attn/compress/bench_model.py)")
    p.add_argument("--indexer-kernel", choices=("auto", "tiled", "decode"), default="auto",
                   help="with --model and --op indexer: the kernel to model (auto: the one the "
                   "routing picks; decode is the row-spread kernel)")
    a = p.parse_args(argv)
    if a.v4_child:
        from . import bench_v4

        return bench_v4.child_main(a.v4_child)
    if a.v4:
        from . import bench_v4

        return bench_v4.main([c.strip() for c in a.v4.split(",")], a)
    if a.cpu_devices != 1:
        _use_cpu_devices(p, a)

    if a.model and a.op == "indexer":
        from .indexer.bench_model import run_indexer_model

        # --shape parses five integers; for the indexer they are T, R, Hi, Di, K.
        shapes = [(s.T, s.H, s.D, s.K, s.R) for s in a.shape] if a.shape else None
        return run_indexer_model(a.model, shapes, a.json,
                                 None if a.indexer_kernel == "auto" else a.indexer_kernel)

    if a.model and a.op == "compress_pool":
        from .compress.bench_model import run_compress_model

        return run_compress_model(a.model, None, a.json)

    if a.layer_memory_child:
        from . import bench_indexer

        print(json.dumps(bench_indexer.layer_memory_child(
            a.layer_memory_child, json.loads(a.layer_sizes), a.dtype, a.layer_selection)))
        return 0
    if a.layer_memory is not None:
        from . import bench_indexer

        return bench_indexer.layer_memory_main(a.layer_memory, a.dtype, a.json)
    if a.indexer_sweep_child or a.indexer_sweep:
        return _indexer_sweep_main(a)

    if a.model:
        from .bench_model import run_model

        return run_model(a.model, a.shape, a.json, kv_dtype=a.kv_dtype, scale_groups=a.scale_groups,
                         value_dim=a.value_dim)

    if a.plot:
        from . import bench_sweeps, plots  # matplotlib is optional: imported only for --plot

        plots.pyplot()  # fails now, not after minutes of measuring, where matplotlib is missing
        result = bench_sweeps.sweep(quick=a.quick, implementation=a.implementation,
                                    dtype_name=a.dtype)
        plots.write_png(result, a.plot)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)
        print(f"# wrote {a.plot}")
        return 0

    if a.memory_child:
        shape = dataclasses.replace(a.shape[0], name="memory") if a.shape else MEMORY_SHAPE
        print(json.dumps(memory_child(shape, a.dtype, a.implementation, a.check_tokens, a.grad,
                                      a.kv_dtype)))
        return 0

    env = environment()
    print(f"# jax {env['jax']} on {env['backend']} ({env['device']}); "
          f"CPU: {env['cpu'].get('model name', '?')} x{env['cpu_count']}", flush=True)
    result: dict = {"environment": env, "records": []}
    if a.memory and a.cpu_products != ["auto"]:
        p.error(f"--cpu-products times forms side by side and does not apply to --memory (a fresh "
                f"process); set {cpu_products.ENV_VAR}=native or f32 instead")
    if a.two_caches:
        custom = a.shape[0] if a.shape else None
        rec = bench_two_caches(a.repeats or (3 if a.quick else 15), a.warmup, a.dtype,
                               T=custom.T if custom else (4 if a.quick else None),
                               R=custom.R if custom else (8192 if a.quick else None))
        result["two_caches"] = rec
        s, m = rec["shape"], rec["median_s"]
        print(f"two caches  T={s['T']} H={s['H']} D={s['D']} window={s['window']} "
              f"top-k={s['topk']} R={s['R']} {a.dtype}: one call {m['op'] * 1e3:.2f} ms; "
              f"concatenate then call {m['concat'] * 1e3:.2f} ms ({rec['concat_over_op']:.2f}x); "
              f"two calls + merge {m['merge'] * 1e3:.2f} ms ({rec['merge_over_op']:.2f}x); "
              f"same bits as the concatenation: {rec['op_same_bits_as_concat']}; FP8 split rows "
              f"beside the window: one call {m['fp8_op'] * 1e3:.2f} ms "
              f"({rec['fp8_op_over_op']:.2f}x of bf16), two calls + merge "
              f"{rec['fp8_merge_over_fp8_op']:.2f}x of it; load "
              f"{rec['load_average']}", flush=True)
        ok = rec["op_same_bits_as_concat"]
    elif a.memory:
        shape = a.shape[0] if a.shape else (QUICK_SHAPES[1] if a.quick else MEMORY_SHAPE)
        rec = run_memory_check(shape, a.dtype, a.implementation, grad=a.grad, kv_dtype=a.kv_dtype)
        result["memory"] = rec
        gib = 2**30
        if a.grad:
            print(f"memory  {shape.describe()} {a.dtype}, grad wrt q, kv, sink: peak RSS growth "
                  f"{rec['growth_bytes'] / gib:.3f} GiB (limit {rec['limit_bytes'] / gib:.1f} GiB; "
                  f"inputs {rec['input_bytes'] / gib:.3f} GiB) in {rec['seconds_first_call']:.1f} s",
                  flush=True)
        else:
            print(f"memory  {shape.describe()} {a.dtype}, kv {a.kv_dtype}: peak RSS growth "
                  f"{rec['growth_bytes'] / gib:.3f} GiB (limit {rec['limit_bytes'] / gib:.1f} GiB; "
                  f"inputs {rec['input_bytes'] / gib:.3f} GiB; gathered slots would be "
                  f"{rec['gathered_slot_bytes'] / gib:.1f} GiB) in {rec['seconds_first_call']:.1f} s; "
                  f"{rec['rows_checked']} rows same bits as unchunked: "
                  f"{rec['rows_same_bits_as_unchunked']}", flush=True)
        ok = rec["within_limit"] and rec.get("rows_same_bits_as_unchunked", True)
    else:
        groups = [group.strip() for group in a.cases.split(",")]
        indexer_groups = [g for g in groups if g in ("indexer", "layer-decode", "layer-prefill")]
        groups = [g for g in groups if g not in indexer_groups]
        if a.shape:
            shapes = a.shape
        elif a.quick and not indexer_groups:
            shapes = QUICK_SHAPES
        else:
            shapes = [s for group in groups for s in SHAPES[group]]
        repeats = a.repeats or (3 if a.quick else 15)
        for shape in shapes:
            try:
                rec = bench_shape(shape, a.dtype, a.implementation, repeats, a.warmup,
                                  naive=not a.no_naive, gemm=not a.no_gemm, grad=a.grad,
                                  sdpa=a.sdpa, forms=a.cpu_products)
            except (RuntimeError, NotImplementedError, ValueError) as err:
                # e.g. implementation="nki" without the Neuron SDK: the library's message says why.
                print(f"bench: {shape.name} ({shape.describe()}): {err}", file=sys.stderr)
                return 2
            result["records"].append(rec)
            table = format_table([rec]).splitlines()
            print("\n".join(table[2:] if len(result["records"]) > 1 else table), flush=True)
            if "sdpa_over_op" in rec:
                print(f"  {shape.name}: jax.nn.dot_product_attention on the gathered slots (no "
                      f"sink) takes {rec['median_s']['sdpa'] * 1e3:.2f} ms, "
                      f"{rec['sdpa_over_op']:.2f}x the op's time", flush=True)
            if "kv_scatter_over_op" in rec:
                bound = rec.get("gemm_fraction_bound_given_kv_scatter")
                print(f"  {shape.name}: the bare d kv accumulation (T K rows of D f32 into [R, D]) "
                      f"takes {rec['median_s']['kv_scatter'] * 1e3:.1f} ms, "
                      f"{rec['kv_scatter_over_op']:.2f} of the op's time"
                      + (f"; with everything else at the GEMM's rate the op would reach "
                         f"{bound:.2f} of it" if bound is not None else ""), flush=True)
        if indexer_groups:
            result["records"] += _indexer_cases(indexer_groups, a)
        ok = True
    if a.json:
        from .bench_model import write_json

        write_json(result, a.json)
    return 0 if ok else 1


def _use_cpu_devices(p, a) -> None:
    """``--cpu-devices N``: JAX's CPU devices, set before its backends start (else an error)."""
    from .bench_indexer import CPU_DEVICE_CASES

    cases = {group.strip() for group in a.cases.split(",")}
    if (a.cpu_devices < 1 or not cases <= CPU_DEVICE_CASES or a.model or a.indexer_sweep
            or a.memory):
        p.error(f"--cpu-devices N (N >= 1) applies to --cases "
                f"{' and '.join(sorted(CPU_DEVICE_CASES))} alone")
    try:
        jax.config.update("jax_num_cpu_devices", a.cpu_devices)
    except RuntimeError as err:  # JAX's backends already started in this process
        p.error(f"--cpu-devices: {err}")
    if jax.default_backend() != "cpu" or jax.device_count() != a.cpu_devices:
        p.error(f"--cpu-devices splits tokens over CPU devices; JAX runs on "
                f"{jax.default_backend()} with {jax.device_count()} devices")


def _indexer_cases(groups, a) -> list:
    """The indexer and layer-decode cases (bench_indexer.py), printed as they finish."""
    from . import bench_indexer as bi

    records = []
    repeats = a.repeats or 3
    if "indexer" in groups:
        shapes = bi.QUICK_INDEXER_SHAPES if a.quick else bi.INDEXER_SHAPES
        if a.indexer_only:
            wanted = {name.strip() for name in a.indexer_only.split(",")}
            shapes = [s for s in shapes if s.name in wanted]
        done = []
        for shape in shapes:
            rec = bi.bench_indexer_shape(shape, a.dtype, a.implementation, repeats,
                                         min(a.warmup, 1), gemm=not a.no_gemm,
                                         cpu_devices=a.cpu_devices)
            done.append(rec)
            table = bi.format_indexer_table(done).splitlines()
            print("\n".join(table if len(done) == 1 else table[-1:]), flush=True)
            if a.cpu_devices > 1:
                print(f"  {shape.name}: {bi.format_token_split(rec, shape.T)}", flush=True)
            if "dense_skipped" in rec:
                print(f"  {shape.name}: dense path skipped: {rec['dense_skipped']}", flush=True)
        records += done
    if "layer-prefill" in groups:
        sizes = bi.QUICK_LAYER_PREFILL if a.quick else bi.LAYER_PREFILL
        rec = bi.bench_layer_prefill(sizes, a.dtype, a.implementation, a.repeats or 3,
                                     min(a.warmup, 1), a.cpu_devices)
        print(bi.format_layer_prefill(rec), flush=True)
        records.append(rec)
    if "layer-decode" in groups:
        sizes = bi.QUICK_LAYER_DECODE if a.quick else bi.LAYER_DECODE
        rec = bi.bench_layer_decode(sizes, a.dtype, a.implementation, a.repeats or 7, a.warmup)
        print(bi.format_layer_decode(rec), flush=True)
        records.append(rec)
    return records


def _indexer_sweep_main(a) -> int:
    from . import bench_indexer as bi

    if a.indexer_sweep_child:
        shape = bi.IndexerShape(**json.loads(a.indexer_sweep_child))
        print(json.dumps(bi.sweep_child(shape, a.indexer_path, a.dtype, a.repeats or 3)))
        return 0
    result = bi.sweep(quick=a.quick, dtype_name=a.dtype, max_size=a.max_size, repeats=a.repeats)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"# wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
