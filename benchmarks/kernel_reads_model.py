"""Modelled NKI cost (a MODEL, not a measurement) of the kernels that read DeepSeek's operands
themselves, against the pre-gathered kernel on the slots XLA gathers first (the path that trn1,
and every form those kernels do not take, runs):

- ``--case two-caches``: two bf16 caches in one call, read by the two-cache kernel; default shape
  V4's decode, T = 16 tokens, H = 64, D = 512, top-512 of R = 262144 compressed rows beside a
  window of W = 128 rows per token.
- ``--case split-rows``: DeepSeek's split FP8 rows (``kv_rope``), read by the split kernel;
  default shape V3.2's decode, T = 16, H = 64, 512 FP8 columns with a scale per 128 and 64 bf16
  ones (D = 576), top-2048 of R = 65536 rows (W is unused).
- ``--case two-fp8-caches``: V4's FP8 layout in both caches (448 FP8 columns with power-of-two
  scales per 64, then 64 bf16), read by one kernel; V4's decode shape as for ``two-caches``.
- ``--case fp8-beside-bf16-window``: the compressed rows in that FP8 layout, the window in bf16.

    python benchmarks/kernel_reads_model.py --case two-caches --json benchmarks/records/model-trn2-two-caches.json
    python benchmarks/kernel_reads_model.py --case split-rows --json benchmarks/records/model-trn2-split-rows.json
    python benchmarks/kernel_reads_model.py --case two-fp8-caches --json benchmarks/records/model-trn2-two-fp8-caches.json
    python benchmarks/kernel_reads_model.py --case fp8-beside-bf16-window --json benchmarks/records/model-trn2-fp8-beside-bf16-window.json

Both paths run under the project's emulator with cost recording (docs/nki-emulator.md, "Cost
model"); XLA's gather for the pre-gathered kernel is outside the model, so it is reported as the
bytes it moves (``xla_gather_bytes_not_modelled``: the slots' rows read, and written as bf16).
The two outputs are compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np

import jax_sparse_attn as jsa
from jax_sparse_attn import nki_emulator
from jax_sparse_attn.attention import neuron


def modelled(fn) -> tuple[np.ndarray, dict]:
    """Runs ``fn()`` under cost recording; its output and the launches' combined figures."""
    with nki_emulator.recording(cost=True) as rec:
        out = np.asarray(fn())
    engines = rec.runs[0].programs[0].cost.engine_us
    return out, {
        "modelled_us": sum(max(p.cost.modelled_us for p in r.programs) for r in rec.runs),
        "per_engine_us": {e: sum(max(p.cost.engine_us[e] for p in r.programs) for r in rec.runs)
                          for e in engines},
        "kernel_dma_bytes": sum(p.cost.dma_bytes for r in rec.runs for p in r.programs),
        "instructions": max(r.compiled_instructions_per_program for r in rec.runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="two-caches",
                        choices=["two-caches", "split-rows", "two-fp8-caches",
                                 "fp8-beside-bf16-window"])
    parser.add_argument("--target", default="trn2", choices=["trn2", "trn3"])
    parser.add_argument("--shape", help="T,H,D,K,R,W: tokens, heads, width, top-k, rows, window "
                        "(default: the case's DeepSeek shape)")
    parser.add_argument("--json", help="write the record here")
    args = parser.parse_args()
    two = args.case != "split-rows"
    shape = args.shape or ("16,64,512,512,262144,128" if two else "16,64,576,2048,65536,0")
    T, H, D, K, R, W = (int(v) for v in shape.split(","))
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(0, R, (T, K)), jnp.int32)
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    os.environ[nki_emulator.TARGET_ENV] = args.target
    jax.clear_caches()
    zero_bias = jnp.zeros((T, K), jnp.float32)
    if args.case in ("two-fp8-caches", "fp8-beside-bf16-window"):
        # V4: 448 FP8 columns, power-of-two scales per 64, 64 bf16
        D8 = D - 64

        def split_cache(rows):
            return (jnp.asarray(rng.standard_normal((rows, D8)), jnp.float8_e4m3fn),
                    jnp.asarray(np.exp2(rng.integers(-4, 3, (rows, D8 // 64))), jnp.float32),
                    jnp.asarray(rng.standard_normal((rows, 64)), jnp.bfloat16))

        (kv, kv_scale, rope), (window, window_scale, window_rope) = split_cache(R), split_cache(T * W)
        window_idx = jnp.asarray(np.arange(T)[:, None] * W + np.arange(W), jnp.int32)
        window_bytes = D8 + 4 * (D8 // 64) + 64 * 2
        if args.case == "fp8-beside-bf16-window":
            window = jnp.asarray(rng.standard_normal((T * W, D)), jnp.bfloat16)
            window_scale = window_rope = None
            window_bytes = D * 2
        native = lambda: jsa.gathered_attn_idx(  # noqa: E731
            q, kv, idx, sink, kv_scale=kv_scale, kv_rope=rope, extra_kv=window,
            extra_idx=window_idx, extra_kv_scale=window_scale, extra_kv_rope=window_rope,
            implementation="nki_emulated")
        g, bias = neuron._pregathered_slots(q.dtype, kv, idx, zero_bias, window, window_idx,
                                            jnp.zeros((T, W), jnp.float32), kv_scale, rope,
                                            window_scale, window_rope)
        # XLA reads each slot's row (FP8 bytes, scales and rope, or bf16) and writes it as bf16.
        xla_bytes = T * (K * (D8 + 4 * (D8 // 64) + 64 * 2) + W * window_bytes + (K + W) * D * 2)
    elif two:
        kv = jnp.asarray(rng.standard_normal((R, D)), jnp.bfloat16)
        window = jnp.asarray(rng.standard_normal((T * W, D)), jnp.bfloat16)
        window_idx = jnp.asarray(np.arange(T)[:, None] * W + np.arange(W), jnp.int32)
        native = lambda: jsa.gathered_attn_idx(  # noqa: E731
            q, kv, idx, sink, extra_kv=window, extra_idx=window_idx, implementation="nki_emulated")
        g, bias = neuron._pregathered_slots(q.dtype, kv, idx, zero_bias, window, window_idx,
                                            jnp.zeros((T, W), jnp.float32), None, None)
        xla_bytes = T * (K + W) * D * 2 * 2
    else:  # V3.2: 512 FP8 columns (a scale per 128), then 64 bf16
        D8 = D - 64
        kv = jnp.asarray(rng.standard_normal((R, D8)), jnp.float8_e4m3fn)
        kv_scale = jnp.asarray(rng.uniform(0.01, 0.1, (R, D8 // 128)), jnp.float32)
        rope = jnp.asarray(rng.standard_normal((R, 64)), jnp.bfloat16)
        native = lambda: jsa.gathered_attn_idx(  # noqa: E731
            q, kv, idx, sink, kv_scale=kv_scale, kv_rope=rope, implementation="nki_emulated")
        g, bias = neuron._fp8_slots(kv, kv_scale, rope, idx, zero_bias)
        xla_bytes = T * K * (D8 + 4 * (D8 // 128) + 64 * 2 + D * 2)
    out_native, modelled_native = modelled(native)
    scale = jnp.full((T,), D ** -0.5, jnp.float32)
    out_pre, pre = modelled(lambda: neuron.emulated_gathered_attn_lse(q, g, sink, bias, scale)[0])
    record = {
        "kind": "MODEL (not a measurement): NKI emulator cost model, see docs/nki-emulator.md",
        "case": args.case, "target": args.target, "shape": dict(T=T, H=H, D=D, K=K, R=R, W=W),
        "host": platform.processor() or platform.machine(),
        "kernel_reading_the_operands": modelled_native, "pregathered_kernel": pre,
        "xla_gather_bytes_not_modelled": xla_bytes,
        "same_bits": bool(np.array_equal(out_native.view(np.uint16), out_pre.view(np.uint16))),
    }
    print(json.dumps(record, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        from jax_sparse_attn.bench.records import index_if_indexed

        index_if_indexed(args.json, "python benchmarks/kernel_reads_model.py")


if __name__ == "__main__":
    main()
