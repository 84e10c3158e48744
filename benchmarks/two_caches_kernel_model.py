"""Modelled NKI cost (a MODEL, not a measurement) of two caches in one call: the two-cache kernel,
which reads both bf16 caches by indirect DMA, against the pre-gathered kernel on the slots XLA
gathers from both caches first (the path that FP8 rows and trn1 take).

    python benchmarks/two_caches_kernel_model.py --json benchmarks/model-trn2-two-caches.json

The default shape is V4's decode: T = 16 tokens, H = 64, D = 512, top-512 of R = 262144 compressed
rows beside a window of 128 rows per token. Both paths run under the project's emulator with cost
recording (docs/nki-emulator.md, "Cost model"); the gather XLA does for the pre-gathered kernel is
outside the model, so it is reported as the bytes it moves, ``T * (K + W) * D * 2`` read and
written. The two outputs are compared bit for bit.
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
    parser.add_argument("--target", default="trn2", choices=["trn2", "trn3"])
    parser.add_argument("--shape", default="16,64,512,512,262144,128",
                        help="T,H,D,K,R,W: tokens, heads, width, top-k, compressed rows, window")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args()
    T, H, D, K, R, W = (int(v) for v in args.shape.split(","))
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((R, D)), jnp.bfloat16)
    window = jnp.asarray(rng.standard_normal((T * W, D)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(0, R, (T, K)), jnp.int32)
    window_idx = jnp.asarray(np.arange(T)[:, None] * W + np.arange(W), jnp.int32)
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    os.environ[nki_emulator.TARGET_ENV] = args.target
    jax.clear_caches()

    two_caches = lambda: jsa.gathered_attn_idx(q, kv, idx, sink, extra_kv=window,  # noqa: E731
                                               extra_idx=window_idx, implementation="nki_emulated")
    out_two, two = modelled(two_caches)
    # The pre-gathered path as the op takes it for FP8 rows and on trn1: XLA gathers the slots.
    zero_bias = jnp.zeros((T, K), jnp.float32)
    g, bias = neuron._pregathered_slots(q.dtype, kv, idx, zero_bias, window, window_idx,
                                        jnp.zeros((T, W), jnp.float32), None, None)
    scale = jnp.full((T,), D ** -0.5, jnp.float32)
    out_pre, pre = modelled(lambda: neuron.emulated_gathered_attn_lse(q, g, sink, bias, scale)[0])
    record = {
        "kind": "MODEL (not a measurement): NKI emulator cost model, see docs/nki-emulator.md",
        "target": args.target, "shape": dict(T=T, H=H, D=D, K=K, R=R, W=W),
        "host": platform.processor() or platform.machine(),
        "two_cache_kernel": two, "pregathered_kernel": pre,
        "xla_gather_bytes_not_modelled": 2 * T * (K + W) * D * 2,
        "same_bits": bool(np.array_equal(out_two.view(np.uint16), out_pre.view(np.uint16))),
    }
    print(json.dumps(record, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
