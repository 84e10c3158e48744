"""The sweeps that ``python -m jax_sparse_attn.bench --plot PATH`` measures and ``plots.py`` draws:
the op against the naive jnp version (:mod:`jax_sparse_attn.plots` draws).

The sweeps (sizes in :data:`SWEEPS`, smaller ones with ``quick=True``):

- time against K: a decode step (T=16, H=64, D=512, R=8192) with K from 256 to 4096;
- time against T: a prefill (H=16, D=512, K=2048, R=65536) with T from 16 to 512;
- peak memory against T: one prefill call in a fresh process, for the op up to T=4096 and for the
  naive version up to T=512 (it materialises the gathered slots, ``T K D`` elements, which the
  chart also draws as a computed line).

Times are medians of interleaved rounds of the op and the naive version (``attention.bench_shape``);
memory is the peak resident-set growth of the call (``attention.run_memory_check`` for the op,
:func:`naive_memory_child` in a fresh process for the naive version).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from typing import Optional, Sequence

import numpy as np

from . import attention, common

# Sweep sizes: the fixed dimensions and the swept values. "quick" is a smoke run (about a minute on
# 2 busy cores, mostly the start of the memory-measuring processes).
SWEEPS = {
    "full": {
        "time_vs_K": {"fixed": dict(T=16, H=64, D=512, R=8192), "K": [256, 512, 1024, 2048, 4096]},
        "time_vs_T": {"fixed": dict(H=16, D=512, K=2048, R=65536), "T": [16, 64, 128, 256, 512]},
        "memory_vs_T": {"fixed": dict(H=16, D=512, K=2048, R=65536),
                        "T": [512, 1024, 2048, 4096], "naive_T": [128, 256, 512]},
    },
    "quick": {
        "time_vs_K": {"fixed": dict(T=4, H=8, D=128, R=2048), "K": [64, 512]},
        "time_vs_T": {"fixed": dict(H=8, D=128, K=256, R=4096), "T": [8, 128]},
        "memory_vs_T": {"fixed": dict(H=8, D=128, K=256, R=4096), "T": [256], "naive_T": [256]},
    },
}
TIMING_REPEATS = {"full": 5, "quick": 2}


def _shape(name: str, **dims) -> attention.Shape:
    return attention.Shape(name, dims["T"], dims["H"], dims["D"], dims["K"], dims["R"])


def naive_memory_child(shape: attention.Shape, dtype_name: str) -> dict:
    """Runs in a fresh process: peak RSS growth of one call of the naive version (inputs excluded,
    compilation and output included), measured as ``attention.memory_child`` measures the op."""
    import jax

    q, kv, idx, sink = attention._inputs(shape, common.DTYPES[dtype_name])
    scale = shape.D**-0.5
    common.reset_peak_rss()
    rss_before = common.rss_bytes()
    naive = jax.jit(lambda q, kv, idx, sink: attention.naive_attention(q, kv, idx, sink, scale))
    jax.block_until_ready(naive(q, kv, idx, sink))
    return {"shape": dataclasses.asdict(shape), "dtype": dtype_name,
            "growth_bytes": common.peak_rss_bytes() - rss_before}


def _run_naive_memory(shape: attention.Shape, dtype_name: str, timeout: float = 900) -> dict:
    cmd = [sys.executable, "-m", "jax_sparse_attn.bench.sweeps", "--naive-memory-child",
           f"{shape.T},{shape.H},{shape.D},{shape.K},{shape.R}", "--dtype", dtype_name]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"naive memory check failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def sweep(quick: bool = False, implementation: str = "none", dtype_name: str = "bf16",
          log=print) -> dict:
    """Measures the three sweeps; returns ``{"environment", "time_vs_K", "time_vs_T",
    "memory_vs_T"}`` with one record per point (``attention.bench_shape`` records for the times;
    ``{"T", "op_growth_bytes"}`` / ``{"T", "naive_growth_bytes"}`` for memory)."""
    sizes = SWEEPS["quick" if quick else "full"]
    repeats = TIMING_REPEATS["quick" if quick else "full"]
    result: dict = {"environment": common.environment(), "implementation": implementation,
                    "dtype": dtype_name, "sizes": sizes}
    for key, axis in (("time_vs_K", "K"), ("time_vs_T", "T")):
        records = []
        for value in sizes[key][axis]:
            shape = _shape(f"{key}-{value}", **sizes[key]["fixed"], **{axis: value})
            rec = attention.bench_shape(shape, dtype_name, implementation, repeats, warmup=1, gemm=False)
            records.append(rec)
            log(f"{key}: {shape.describe()}: op {rec['median_s']['op'] * 1e3:.2f} ms, "
                f"naive {rec['median_s']['naive'] * 1e3:.2f} ms")
        result[key] = records
    memory = sizes["memory_vs_T"]
    points = []
    for T in sorted(set(memory["T"]) | set(memory["naive_T"])):
        shape = _shape(f"memory-{T}", **memory["fixed"], T=T)
        itemsize = np.dtype(common.DTYPES[dtype_name]).itemsize
        point = {"T": T, "shape": dataclasses.asdict(shape),
                 "gathered_slot_bytes": shape.T * shape.K * shape.D * itemsize}
        if T in memory["T"]:
            op = attention.run_memory_check(shape, dtype_name, implementation)
            point["op_growth_bytes"] = op["growth_bytes"]
        if T in memory["naive_T"]:
            point["naive_growth_bytes"] = _run_naive_memory(shape, dtype_name)["growth_bytes"]
        points.append(point)
        log(f"memory_vs_T: {shape.describe()}: " + ", ".join(
            f"{k.split('_')[0]} {v / 2**30:.3f} GiB"
            for k, v in point.items() if k.endswith("_growth_bytes")))
    result["memory_vs_T"] = points
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The child process of the naive memory measurement (``bench --plot`` is the command)."""
    p = argparse.ArgumentParser(prog="python -m jax_sparse_attn.bench.sweeps",
                                description=main.__doc__)
    p.add_argument("--naive-memory-child", metavar="T,H,D,K,R", required=True)
    p.add_argument("--dtype", choices=sorted(common.DTYPES), default="bf16")
    a = p.parse_args(argv)
    T, H, D, K, R = (int(v) for v in a.naive_memory_child.split(","))
    print(json.dumps(naive_memory_child(attention.Shape("memory-naive", T, H, D, K, R), a.dtype)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
