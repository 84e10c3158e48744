"""Bytes gathered from the cache and time of gathered_attn_idx with an FP8 cache (per-row and
per-128-column scales) against the same call on a bf16 cache, jitted on the current backend.

    python benchmarks/fp8_cache.py --json benchmarks/records/cpu-2core-jax0.10.2-fp8-cache.json
    python benchmarks/fp8_cache.py --split-layouts   # DeepSeek's split rows (kv_rope), V3.2 and V4

``--split-layouts`` instead measures DeepSeek's split rows against a bf16 cache of the same width:
V3.2, 512 FP8 columns with a scale per 128 and 64 bf16 (D = 576), and V4, 448 FP8 columns with
power-of-two scales per 64 and 64 bf16 (D = 512); bytes per gathered row are the gathered bytes
over T * K.

Gathered bytes are read from the compiled program: the sum of the result sizes of its gather
instructions (the rows of the cache, and for FP8 the scales), not a formula. Times: medians of
interleaved rounds after warm-up; the check compares each FP8 result with the bf16 call on the
dequantised cache (fraction of elements within one bf16 ulp).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np


def gathered_bytes(compiled_text: str) -> int:
    """Sum of the result sizes of the gather instructions in an HLO module's text."""
    sizes = {"u8": 1, "s8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "u16": 2, "bf16": 2, "f16": 2,
             "f32": 4, "u32": 4, "s32": 4}
    total = 0
    for line in compiled_text.splitlines():
        m = re.search(r"=\s*([a-z0-9]+)\[([0-9,]*)\][^=]*\bgather\(", line)
        if m and m.group(1) in sizes:
            total += sizes[m.group(1)] * int(np.prod([int(d) for d in m.group(2).split(",") if d]))
    return total


def within_one_bf16_ulp(a, b) -> float:
    """Fraction of elements whose bf16 encodings differ by at most one step (+0 == -0)."""
    def ordered(x):
        bits = np.asarray(x, ml_dtypes.bfloat16).view(np.uint16).astype(np.int32)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits & 0x7FFF)

    return float(np.mean(np.abs(ordered(a) - ordered(b)) <= 1))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="16,64,576,2048,65536", help="T,H,D,K,R")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None)
    parser.add_argument("--split-layouts", action="store_true",
                        help="DeepSeek's split rows (FP8 + kv_rope) against bf16, V3.2 and V4")
    args = parser.parse_args(argv)
    if args.split_layouts:
        return split_layouts(args)
    import jax_sparse_attn as jsa
    from jax_sparse_attn.bench.common import environment

    T, H, D, K, R = (int(v) for v in args.shape.split(","))
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(0, R, (T, K)), jnp.int32)
    sink = jnp.zeros((H,), jnp.float32)
    kv8 = (rng.standard_normal((R, D)) * 8).astype(ml_dtypes.float8_e4m3fn)
    scales = {"fp8 per row": rng.uniform(0.01, 0.1, R).astype(np.float32),
              "fp8 per 128 columns": rng.uniform(0.01, 0.1, (R, D // 128)).astype(np.float32)}

    def dequant(s):
        x = kv8.astype(np.float32).reshape(R, -1, D // (s.size // R)) * s.reshape(R, -1, 1)
        return x.reshape(R, D).astype(ml_dtypes.bfloat16)

    attn = jax.jit(lambda q, kv, idx, sink, s: jsa.gathered_attn_idx(q, kv, idx, sink, kv_scale=s))
    plain = jax.jit(jsa.gathered_attn_idx)
    cases = {"bf16": (plain, (q, jnp.asarray(dequant(scales["fp8 per row"])), idx, sink))}
    for name, s in scales.items():
        cases[name] = (attn, (q, jnp.asarray(kv8), idx, sink, jnp.asarray(s)))
    result = {"shape": {"T": T, "H": H, "D": D, "K": K, "R": R}, "environment": environment(),
              "cases": {}}
    for name, (fn, a) in cases.items():
        text = fn.lower(*a).compile().as_text()
        jax.block_until_ready(fn(*a))
        result["cases"][name] = {"gathered_bytes": gathered_bytes(text), "seconds": []}
    for _ in range(args.rounds):
        for name, (fn, a) in cases.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*a))
            result["cases"][name]["seconds"].append(time.perf_counter() - start)
    for name, s in scales.items():
        want = plain(q, jnp.asarray(dequant(s)), idx, sink)
        got = cases[name][0](*cases[name][1])
        result["cases"][name]["within_one_ulp_of_bf16_on_dequantised"] = within_one_bf16_ulp(
            np.asarray(got), np.asarray(want))
    base = result["cases"]["bf16"]
    for name, c in result["cases"].items():
        c["median_seconds"] = statistics.median(c["seconds"])
        c["gathered_bytes_vs_bf16"] = c["gathered_bytes"] / base["gathered_bytes"]
        c["time_vs_bf16"] = c["median_seconds"] / statistics.median(base["seconds"])
        print(f"{name:22s} gathered {c['gathered_bytes'] / 2**20:7.2f} MiB "
              f"({c['gathered_bytes_vs_bf16']:.3f} of bf16), median {c['median_seconds'] * 1e3:.1f} ms "
              f"({c['time_vs_bf16']:.2f} of bf16)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        from jax_sparse_attn.bench.records import index_if_indexed

        index_if_indexed(args.json, "python benchmarks/fp8_cache.py", argv)
    return result


def split_layouts(args) -> dict:
    """V3.2 (D = 576: 512 FP8 + 4 f32 scales + 64 bf16) and V4 (D = 512: 448 FP8 + 7 power-of-two
    f32 scales + 64 bf16) split rows against a bf16 cache of the same width: gathered bytes per
    row from the compiled program, and time (medians of interleaved rounds)."""
    import jax_sparse_attn as jsa
    from jax_sparse_attn.bench.common import environment

    T, H, _, K, R = (int(v) for v in args.shape.split(","))
    rng = np.random.default_rng(0)
    idx = jnp.asarray(rng.integers(0, R, (T, K)), jnp.int32)
    sink = jnp.zeros((H,), jnp.float32)
    split = jax.jit(lambda q, kv, idx, sink, s, rope: jsa.gathered_attn_idx(
        q, kv, idx, sink, kv_scale=s, kv_rope=rope))
    plain = jax.jit(jsa.gathered_attn_idx)
    result = {"shape": {"T": T, "H": H, "K": K, "R": R}, "environment": environment(),
              "layouts": {}}
    cases = {}
    for name, D8, G, pow2 in (("v3.2", 512, 128, False), ("v4", 448, 64, True)):
        D = D8 + 64
        q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.bfloat16)
        kv8 = (rng.standard_normal((R, D8)) * 8).astype(ml_dtypes.float8_e4m3fn)
        if pow2:
            s = np.exp2(rng.integers(-7, -2, (R, D8 // G))).astype(np.float32)
        else:
            s = rng.uniform(0.01, 0.1, (R, D8 // G)).astype(np.float32)
        rope = rng.standard_normal((R, 64)).astype(ml_dtypes.bfloat16)
        x = (kv8.astype(np.float32).reshape(R, -1, G) * s[:, :, None]).reshape(R, D8)
        logical = np.concatenate([x.astype(ml_dtypes.bfloat16), rope], axis=1)
        cases[f"{name} bf16"] = (plain, (q, jnp.asarray(logical), idx, sink))
        cases[f"{name} split"] = (split, (q, jnp.asarray(kv8), idx, sink, jnp.asarray(s),
                                          jnp.asarray(rope)))
    record = {}
    for name, (fn, a) in cases.items():
        text = fn.lower(*a).compile().as_text()
        jax.block_until_ready(fn(*a))
        record[name] = {"gathered_bytes": gathered_bytes(text), "seconds": []}
    for _ in range(args.rounds):
        for name, (fn, a) in cases.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*a))
            record[name]["seconds"].append(time.perf_counter() - start)
    for name in ("v3.2", "v4"):
        base, got = record[f"{name} bf16"], record[f"{name} split"]
        same = within_one_bf16_ulp(np.asarray(cases[f"{name} split"][0](*cases[f"{name} split"][1])),
                                   np.asarray(cases[f"{name} bf16"][0](*cases[f"{name} bf16"][1])))
        layout = {
            "bf16_bytes_per_row": base["gathered_bytes"] / (T * K),
            "split_bytes_per_row": got["gathered_bytes"] / (T * K),
            "bytes_vs_bf16": got["gathered_bytes"] / base["gathered_bytes"],
            "time_vs_bf16": statistics.median(got["seconds"]) / statistics.median(base["seconds"]),
            "within_one_ulp_of_bf16_on_logical_rows": same,
            "raw": {"bf16": base, "split": got},
        }
        result["layouts"][name] = layout
        print(f"{name:5s} split rows: {layout['split_bytes_per_row']:.0f} bytes per gathered row "
              f"against {layout['bf16_bytes_per_row']:.0f} for bf16 ({layout['bytes_vs_bf16']:.3f}); "
              f"time {layout['time_vs_bf16']:.2f} of bf16 (medians of {args.rounds} rounds); "
              f"within one ulp of bf16 on the logical rows: {same:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        from jax_sparse_attn.bench.records import index_if_indexed

        index_if_indexed(args.json, "python benchmarks/fp8_cache.py")
    return result


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
