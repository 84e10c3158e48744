"""Charts of the op against the naive jnp version: time against K and T, peak memory against T.

``python -m jax_sparse_attn.bench --plot PATH`` measures three sweeps (:func:`sweep`) and writes
them as one PNG (:func:`write_png`); the notebooks draw the same charts from a saved sweep
(``benchmarks/sweep-*.json``). Drawing needs matplotlib, from the ``plot`` extra
(``pip install ".[plot]"`` in a clone); the core package never imports this module.

The sweeps (sizes in :data:`SWEEPS`, smaller ones with ``quick=True``):

- time against K: a decode step (T=16, H=64, D=512, R=8192) with K from 256 to 4096;
- time against T: a prefill (H=16, D=512, K=2048, R=65536) with T from 16 to 512;
- peak memory against T: one prefill call in a fresh process, for the op up to T=4096 and for the
  naive version up to T=512 (it materialises the gathered slots, ``T K D`` elements, which the
  chart also draws as a computed line).

Times are medians of interleaved rounds of the op and the naive version (``bench.bench_shape``);
memory is the peak resident-set growth of the call (``bench.run_memory_check`` for the op).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from typing import Optional, Sequence

import numpy as np

from . import bench

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


def _shape(name: str, **dims) -> bench.Shape:
    return bench.Shape(name, dims["T"], dims["H"], dims["D"], dims["K"], dims["R"])


def naive_memory_child(shape: bench.Shape, dtype_name: str) -> dict:
    """Runs in a fresh process: peak RSS growth of one call of the naive version (inputs excluded,
    compilation and output included), measured as ``bench.memory_child`` measures the op."""
    import jax

    q, kv, idx, sink = bench._inputs(shape, bench.DTYPES[dtype_name])
    scale = shape.D**-0.5
    bench._reset_peak_rss()
    rss_before = bench._rss_bytes()
    naive = jax.jit(lambda q, kv, idx, sink: bench.naive_attention(q, kv, idx, sink, scale))
    jax.block_until_ready(naive(q, kv, idx, sink))
    return {"shape": dataclasses.asdict(shape), "dtype": dtype_name,
            "growth_bytes": bench._peak_rss_bytes() - rss_before}


def _run_naive_memory(shape: bench.Shape, dtype_name: str, timeout: float = 900) -> dict:
    cmd = [sys.executable, "-m", "jax_sparse_attn.plots", "--naive-memory-child",
           f"{shape.T},{shape.H},{shape.D},{shape.K},{shape.R}", "--dtype", dtype_name]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"naive memory check failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def sweep(quick: bool = False, implementation: str = "none", dtype_name: str = "bf16",
          log=print) -> dict:
    """Measures the three sweeps; returns ``{"environment", "time_vs_K", "time_vs_T",
    "memory_vs_T"}`` with one record per point (``bench.bench_shape`` records for the times;
    ``{"T", "op_growth_bytes"}`` / ``{"T", "naive_growth_bytes"}`` for memory)."""
    sizes = SWEEPS["quick" if quick else "full"]
    repeats = TIMING_REPEATS["quick" if quick else "full"]
    result: dict = {"environment": bench.environment(), "implementation": implementation,
                    "dtype": dtype_name, "sizes": sizes}
    for key, axis in (("time_vs_K", "K"), ("time_vs_T", "T")):
        records = []
        for value in sizes[key][axis]:
            shape = _shape(f"{key}-{value}", **sizes[key]["fixed"], **{axis: value})
            rec = bench.bench_shape(shape, dtype_name, implementation, repeats, warmup=1, gemm=False)
            records.append(rec)
            log(f"{key}: {shape.describe()}: op {rec['median_s']['op'] * 1e3:.2f} ms, "
                f"naive {rec['median_s']['naive'] * 1e3:.2f} ms")
        result[key] = records
    memory = sizes["memory_vs_T"]
    points = []
    for T in sorted(set(memory["T"]) | set(memory["naive_T"])):
        shape = _shape(f"memory-{T}", **memory["fixed"], T=T)
        itemsize = np.dtype(bench.DTYPES[dtype_name]).itemsize
        point = {"T": T, "shape": dataclasses.asdict(shape),
                 "gathered_slot_bytes": shape.T * shape.K * shape.D * itemsize}
        if T in memory["T"]:
            op = bench.run_memory_check(shape, dtype_name, implementation)
            point["op_growth_bytes"] = op["growth_bytes"]
        if T in memory["naive_T"]:
            point["naive_growth_bytes"] = _run_naive_memory(shape, dtype_name)["growth_bytes"]
        points.append(point)
        log(f"memory_vs_T: {shape.describe()}: " + ", ".join(
            f"{k.split('_')[0]} {v / 2**30:.3f} GiB"
            for k, v in point.items() if k.endswith("_growth_bytes")))
    result["memory_vs_T"] = points
    return result


# --- drawing ----------------------------------------------------------------------------------------


def pyplot():
    """matplotlib.pyplot (the Agg backend outside a notebook); an ImportError naming the extra
    where matplotlib is missing."""
    try:
        import matplotlib

        if "matplotlib.pyplot" not in sys.modules and not _in_notebook():
            matplotlib.use("Agg")  # files only; a notebook keeps its inline backend
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(
            "the charts need matplotlib: pip install 'matplotlib>=3.7' (or '.[plot]' in a clone)"
        ) from err
    return plt


def _in_notebook() -> bool:
    return "ipykernel" in sys.modules


def _subtitle(result: dict) -> str:
    env = result["environment"]
    cpu = env.get("cpu", {})
    flags = cpu.get("flags", "")
    bf16 = "AVX-512 BF16" if "avx512_bf16" in flags else ("AVX2, no AVX-512 BF16" if "avx2" in flags else "?")
    return (f"{cpu.get('model name', env.get('device', '?'))}, {env.get('cpu_count', '?')} cores ({bf16}); "
            f"jax {env['jax']}, {result['dtype']}")


def _plain_log_axes(ax) -> None:
    """Log scales with plain numbers (0.2, 10, 300) instead of powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def draw_time(ax, records: Sequence[dict], axis: str, title: str) -> None:
    """Median time of the op and the naive version against ``axis`` ("K" or "T"), log-log."""
    x = [r["shape"][axis] for r in records]
    op = [r["median_s"]["op"] * 1e3 for r in records]
    naive = [r["median_s"]["naive"] * 1e3 for r in records]
    ax.plot(x, op, "o-", label="gathered_attn_idx")
    ax.plot(x, naive, "s--", label="naive jnp (gather + 2 einsums)")
    for xi, o, n in zip(x, op, naive):
        ax.annotate(f"{n / o:.1f}x", (xi, max(o, n)), textcoords="offset points", xytext=(0, 7),
                    ha="center", fontsize=8)
    ax.margins(y=0.15)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(x, [str(v) for v in x])
    _plain_log_axes(ax)
    ax.set_xlabel(axis)
    ax.set_ylabel("ms per call (median)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def draw_memory(ax, points: Sequence[dict]) -> None:
    """Peak memory growth of one call against T: op, naive, and the gathered slots' size."""
    gib = 2**30
    for key, style, label in (("op_growth_bytes", "o-", "gathered_attn_idx (measured)"),
                              ("naive_growth_bytes", "s--", "naive jnp (measured)")):
        xs = [p["T"] for p in points if key in p]
        ax.plot(xs, [p[key] / gib for p in points if key in p], style, label=label)
    ax.plot([p["T"] for p in points], [p["gathered_slot_bytes"] / gib for p in points], ":",
            color="gray", label="gathered slots T*K*D (computed)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = [p["T"] for p in points]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    _plain_log_axes(ax)
    ax.set_xlabel("T")
    ax.set_ylabel("peak RSS growth of one call (GiB)")
    dims = points[0]["shape"]
    ax.set_title(f"Memory against T (H={dims['H']}, D={dims['D']}, K={dims['K']}, R={dims['R']})",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def _draw_time_panels(ax_k, ax_t, result: dict) -> None:
    fk, ft = result["sizes"]["time_vs_K"]["fixed"], result["sizes"]["time_vs_T"]["fixed"]
    draw_time(ax_k, result["time_vs_K"], "K",
              f"Decode: time against K (T={fk['T']}, H={fk['H']}, D={fk['D']}, R={fk['R']})")
    draw_time(ax_t, result["time_vs_T"], "T",
              f"Prefill: time against T (H={ft['H']}, D={ft['D']}, K={ft['K']}, R={ft['R']})")


def time_figure(result: dict):
    """Time against K and against T, side by side (a matplotlib Figure)."""
    fig, (ax_k, ax_t) = pyplot().subplots(1, 2, figsize=(11, 4.2))
    _draw_time_panels(ax_k, ax_t, result)
    fig.suptitle(_subtitle(result) + "; labels: naive time / op time", fontsize=9)
    fig.tight_layout()
    return fig


def memory_figure(result: dict):
    """Peak memory growth against T (a matplotlib Figure)."""
    fig, ax = pyplot().subplots(figsize=(6, 4.2))
    draw_memory(ax, result["memory_vs_T"])
    fig.suptitle(_subtitle(result), fontsize=9)
    fig.tight_layout()
    return fig


def write_png(result: dict, path: str, dpi: int = 90) -> None:
    """The three charts of a :func:`sweep` result side by side, as one PNG at ``path``."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    _draw_time_panels(axes[0], axes[1], result)
    draw_memory(axes[2], result["memory_vs_T"])
    fig.suptitle(_subtitle(result) + "; labels: naive time / op time", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


# --- the indexer: time and memory against T and R (data: bench_indexer.sweep) -----------------------


def _indexer_sweep_points(points: Sequence[dict], axis: str, path: str, field: str):
    xs = [p[axis] for p in points if p.get(path)]
    return xs, [p[path][field] for p in points if p.get(path)]


def draw_indexer_sweep(ax_time, ax_memory, points: Sequence[dict], axis: str, title: str) -> None:
    """Median time and peak memory growth of one call against ``axis`` ("T" or "R"): the
    streaming ``indexer_topk`` and the dense path (``indexer_scores`` + ``select_topk_rows``);
    the dense path's points that would not fit are marked with their computed size."""
    gib = 2**30
    for path, style, label in (("op", "o-", "indexer_topk (streaming)"),
                               ("dense", "s--", "dense scores + lax.top_k")):
        xs, t = _indexer_sweep_points(points, axis, path, "median_s")
        ax_time.plot(xs, t, style, label=label)
        xs, m = _indexer_sweep_points(points, axis, path, "growth_bytes")
        ax_memory.plot(xs, [v / gib for v in m], style, label=label + " (measured)")
    skipped = [p for p in points if not p.get("dense")]
    if skipped:
        ax_memory.plot([p[axis] for p in skipped], [p["dense_bytes"] / gib for p in skipped], "x",
                       color="tab:orange", label="dense products + scores (computed; not run)")
    ticks = [p[axis] for p in points]
    for ax, ylabel in ((ax_time, "s per call (median)"),
                       (ax_memory, "peak RSS growth of one call (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ticks, [f"{v // 1024}k" if v >= 1024 else str(v) for v in ticks])
        _plain_log_axes(ax)
        ax.set_xlabel(axis)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)


def indexer_figure(result: dict):
    """The indexer sweep as a 2 x 2 figure: prefill (T = R) and decode (T = 1) rows, time and
    memory columns. ``result`` as from ``bench_indexer.sweep`` (or its JSON)."""
    fig, axes = pyplot().subplots(2, 2, figsize=(12, 8))
    f = result["sizes"]["fixed"]
    dims = f"Hi={f['Hi']}, Di={f['Di']}, K={f['K']}"
    draw_indexer_sweep(axes[0, 0], axes[0, 1], result["prefill"], "T",
                       f"Causal prefill, T = R ({dims})")
    draw_indexer_sweep(axes[1, 0], axes[1, 1], result["decode"], "R",
                       f"Decode, T = 1 ({dims})")
    fig.suptitle(_subtitle(result), fontsize=9)
    fig.tight_layout()
    return fig


def write_indexer_png(result: dict, path: str, dpi: int = 90) -> None:
    fig = indexer_figure(result)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The child process of the naive memory measurement (``bench --plot`` is the command), or
    ``--indexer-sweep JSON --png PATH``: draws a saved indexer sweep
    (``python -m jax_sparse_attn.bench --indexer-sweep --json JSON`` measures it)."""
    p = argparse.ArgumentParser(prog="python -m jax_sparse_attn.plots", description=__doc__.splitlines()[0])
    p.add_argument("--naive-memory-child", metavar="T,H,D,K,R")
    p.add_argument("--indexer-sweep", metavar="JSON", help="a saved indexer sweep to draw")
    p.add_argument("--png", metavar="PATH", help="with --indexer-sweep: where to write the chart")
    p.add_argument("--dtype", choices=sorted(bench.DTYPES), default="bf16")
    a = p.parse_args(argv)
    if a.indexer_sweep:
        if not a.png:
            p.error("--indexer-sweep needs --png PATH")
        with open(a.indexer_sweep) as f:
            write_indexer_png(json.load(f), a.png)
        print(f"# wrote {a.png}")
        return 0
    if not a.naive_memory_child:
        p.error("give --naive-memory-child T,H,D,K,R or --indexer-sweep JSON --png PATH")
    T, H, D, K, R = (int(v) for v in a.naive_memory_child.split(","))
    print(json.dumps(naive_memory_child(bench.Shape("memory-naive", T, H, D, K, R), a.dtype)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
