"""Demo: ``python -m jax_sparse_attn`` (``--help`` lists the options).

Runs ``gathered_attn_idx`` jitted on the default JAX backend at one of the shapes of the
performance guide's table (docs/guides/performance.md; by default the DeepSeek-like decode step:
16 tokens, 64 heads, head dim 512, top-2048 of an 8192-row cache), and prints:

- which implementation ran (the NKI kernel on Trainium, the jnp reference elsewhere, or the one you
  asked for), read from the compiled program;
- its median time next to a naive jnp implementation timed in the same rounds, and the ratio;
- its accuracy: against an exact float64 attention with FlashMLA's acceptance bound, and against a
  float64 model of the bf16 arithmetic contract (``docs/contract.md``) in bf16 ulps.

The demo exits with status 1 when fewer than 99.9% of the elements are within one ulp of the
contract's model (the project's own tolerance, ``docs/contract.md#tolerances``). FlashMLA's
bound is reported, not enforced: at small K an output element near zero can exceed its 8e-4
absolute part while still matching the contract.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import ml_dtypes
import numpy as np

from . import gathered_attn_idx
from .bench import attention as attention_bench
from .bench.common import DTYPES

# The cases of the performance guide's table (docs/guides/performance.md) (the benchmark's default shapes), by the demo's names.
SHAPES = {
    name: dataclasses.replace(shape, name=name)
    for name, shape in (("decode", attention_bench.SHAPES["decode"][0]),
                        ("decode-large-cache", attention_bench.SHAPES["decode"][1]),
                        ("prefill", attention_bench.SHAPES["prefill"][0]))
}
IMPLEMENTATIONS = {"auto": None, "reference": "reference", "nki": "nki", "nki_emulated": "nki_emulated"}

# FlashMLA's acceptance bound for a bf16 attention output against an fp32 reference (its sparse
# tests): |out - exact| <= FLASHMLA_ABS_TOL + FLASHMLA_REL_TOL * |exact|. See docs/contract.md#tolerances.
FLASHMLA_ABS_TOL = 8e-4
FLASHMLA_REL_TOL = 3.01 / 128

# The project's tolerance against the float64 model of the contract (docs/contract.md#tolerances):
# 16-bit outputs within one ulp on at least this share of elements; f32 outputs within this relative
# error of the largest output.
MIN_WITHIN_ONE_ULP = 0.999
MAX_REL_ERROR_F32 = 1e-5

# Tokens checked against the float64 computations (evenly spaced; all of them when T is smaller).
CHECKED_TOKENS = 16


def float64_attention(q, kv, idx, sink, scale):
    """Exact softmax attention with a sink, in float64, written independently of the library.

    q ``[T, H, D]``, kv ``[R, D]``, idx ``[T, K]`` (out-of-range entries are empty slots),
    sink ``[H]`` -> ``[T, H, D]`` float64; a token with no valid slot gives 0.
    """
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


# What each path is called in the report.
PATH_DESCRIPTIONS = {
    "nki": "the NKI kernel on a NeuronCore",
    "nki_emulated": "nki_emulated: the Neuron data path with the kernel run by the host NKI emulator",
    "reference": "the jnp reference (jax_sparse_attn/attention/reference.py)",
}


def implementation_that_ran(compiled_text: str, requested) -> str:
    """The path in a compiled program: ``"nki"`` (the NKI kernel's custom call), ``"nki_emulated"``
    (asked for, and the emulator's host callback is there) or ``"reference"`` (neither)."""
    if "AwsNeuronCustomNativeKernel" in compiled_text:
        return "nki"
    if requested == "nki_emulated" and "callback" in compiled_text:
        return "nki_emulated"
    return "reference"


def _parse_shape(text: str) -> attention_bench.Shape:
    if text in SHAPES:
        return SHAPES[text]
    try:
        T, H, D, K, R = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--shape wants one of {', '.join(SHAPES)} or T,H,D,K,R (five integers); got {text!r}")
    if min(T, H, D, K, R) < 1:
        raise argparse.ArgumentTypeError(f"--shape: every size must be at least 1; got {text!r}")
    return attention_bench.Shape("custom", T, H, D, K, R)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jax_sparse_attn",
        description="Runs gathered_attn_idx once jitted, times it against a naive jnp implementation "
        "in the same rounds, and checks it against float64.",
        epilog="Shapes (T tokens, H heads, D head dim, K slots per token, R cache rows): "
        + "; ".join(f"{name}: {s.T},{s.H},{s.D},{s.K},{s.R}" for name, s in SHAPES.items()),
    )
    p.add_argument("--implementation", choices=list(IMPLEMENTATIONS), default="auto",
                   help="auto (implementation=None: the NKI kernel on Trainium, the jnp reference "
                   "elsewhere), reference, nki (Trainium only) or nki_emulated (the Neuron data path "
                   "under the host emulator: slow, use a small --shape); default: auto")
    p.add_argument("--shape", type=_parse_shape, default=SHAPES["decode"], metavar="NAME|T,H,D,K,R",
                   help=f"a case of the performance guide's table ({', '.join(SHAPES)}) or five integers; "
                   "default: decode")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16",
                   help="dtype of q and the cache (the output has q's dtype); default: bf16")
    p.add_argument("--rounds", type=lambda v: max(1, int(v)), default=10,
                   help="timed rounds, each calling the op and the naive version once; default: 10")
    a = p.parse_args(argv)
    shape = a.shape
    implementation = IMPLEMENTATIONS[a.implementation]
    T, H, D, K, R = shape.T, shape.H, shape.D, shape.K, shape.R

    # The benchmark's operands: normal q, cache and sinks, uniform indices, the last few of each
    # token's slots empty (-1).
    args = attention_bench._inputs(shape, DTYPES[a.dtype])
    q, kv, idx, sink = (np.asarray(x) for x in args)
    scale = D**-0.5
    op = jax.jit(lambda q, kv, idx, sink: gathered_attn_idx(
        q, kv, idx, sink, scale=scale, implementation=implementation))
    naive = jax.jit(lambda q, kv, idx, sink: attention_bench.naive_attention(q, kv, idx, sink, scale))
    compiled = op.lower(*args).compile()
    ran = implementation_that_ran(compiled.as_text(), implementation)
    out = jax.block_until_ready(compiled(*args))
    jax.block_until_ready(naive(*args))  # compile + warm-up
    times = {"op": [], "naive": []}
    for _ in range(a.rounds):
        for name, fn in (("op", compiled), ("naive", naive)):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    op_s, naive_s = (float(np.median(times[k])) for k in ("op", "naive"))

    # The Neuron data path is bf16-only: it rounds f32 / f16 inputs to bf16 (docs/contract.md#arithmetic),
    # so its accuracy is judged against the exact attention of the rounded inputs.
    rounded = ran in ("nki", "nki_emulated") and a.dtype != "bf16"
    q_seen, kv_seen = (x.astype(ml_dtypes.bfloat16) for x in (q, kv)) if rounded else (q, kv)
    pick = np.unique(np.linspace(0, T - 1, min(CHECKED_TOKENS, T)).astype(int))
    want = float64_attention(q_seen[pick], kv_seen, idx[pick], sink, scale)
    got = np.asarray(out, np.float64)[pick]
    err = np.abs(got - want)
    within = err <= FLASHMLA_ABS_TOL + FLASHMLA_REL_TOL * np.abs(want)
    # On that path the result is bf16 cast to q's dtype: compared as the bf16 it was.
    out_seen = np.asarray(out).astype(ml_dtypes.bfloat16) if rounded else out
    contract = attention_bench.check_contract(out_seen, q_seen, kv_seen, idx, sink, scale, tokens=CHECKED_TOKENS)

    print(f"jax-sparse-attn demo (jax {jax.__version__}, backend {jax.default_backend()}: "
          f"{jax.devices()[0].device_kind})")
    print(f"shape          : {shape.name}: q [{T}, {H}, {D}] "
          f"{a.dtype}, kv [{R}, {D}] {a.dtype}, idx [{T}, {K}] int32 ({int((idx < 0).sum(1).max())} of each token's slots empty), "
          f"sink [{H}] f32")
    print(f"implementation : {PATH_DESCRIPTIONS[ran]}"
          + ("" if implementation is None else f" (asked for implementation={implementation!r})"))
    print(f"time           : {op_s * 1e3:.2f} ms per call (median of {a.rounds} rounds, jitted, "
          f"after warm-up); {shape.flops / op_s / 1e9:.1f} GFLOP/s")
    print(f"naive jnp      : {naive_s * 1e3:.2f} ms per call in the same rounds (one gather, two "
          f"einsums): the op is "
          + (f"{naive_s / op_s:.2f}x faster" if naive_s >= op_s else f"{op_s / naive_s:.2f}x slower"))
    print(f"vs exact       : {len(pick)} tokens against float64 attention: max |err| "
          f"{err.max():.2e}; {within.mean() * 100:.2f}% of elements "
          f"within FlashMLA's bound |err| <= {FLASHMLA_ABS_TOL:g} + {FLASHMLA_REL_TOL:.4f} |exact|")
    print("                 (the bound FlashMLA's tests accept for a bf16 output: 8e-4 absolute plus "
          "about 3 bf16 ulps relative)")
    if rounded:
        print(f"                 ({a.dtype} inputs rounded to bf16 by the Neuron data path; both checks "
              "use the rounded inputs)")
    if "within_one_ulp" in contract:
        print(f"vs contract    : {contract['within_one_ulp'] * 100:.2f}% of elements within 1 {'bf16' if rounded else a.dtype} "
              "ulp of a float64 model of the arithmetic contract (docs/contract.md#arithmetic)")
    else:
        print(f"vs contract    : max relative error {contract['max_rel_error']:.1e} against a float64 "
              "model of the contract (docs/contract.md#arithmetic)")
    if contract.get("within_one_ulp", 1.0) < MIN_WITHIN_ONE_ULP or \
            contract.get("max_rel_error", 0.0) > MAX_REL_ERROR_F32:
        print("FAILED: the output does not follow the arithmetic contract")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
