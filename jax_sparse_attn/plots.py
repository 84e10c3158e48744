"""Charts of the benchmarks' results: the op against the naive jnp version (time against K and T,
peak memory against T), the indexer's sweep (time and memory against T and R) and DeepSeek V4's
decode step against the context.

This module only draws: it takes the result dicts (or saved JSON) that the benchmarks write, and
imports nothing from them. ``python -m jax_sparse_attn.bench --plot PATH`` measures the sweeps
(:mod:`jax_sparse_attn.bench.sweeps`) and draws them here (:func:`write_png`); the notebooks draw
the same charts from a saved sweep (``benchmarks/records/sweep-*.json``). Drawing needs
matplotlib, from the ``plot`` extra (``pip install ".[plot]"`` in a clone); the core package
never imports this module.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence


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


# --- the indexer: time and memory against T and R (data: bench.indexer.sweep) ----------------------


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
    memory columns. ``result`` as from ``bench.indexer.sweep`` (or its JSON)."""
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


def v4_sweep_figure(records: Sequence[dict]):
    """DeepSeek V4's decode step against the context (``bench --v4 sweep`` records): time, and the
    cache's bytes beside the process's growth, one line per layer kind."""
    plt = pyplot()
    fig, (ax_time, ax_memory) = plt.subplots(1, 2, figsize=(10, 4))
    for kind in sorted({r["kind"] for r in records}):
        points = sorted((r for r in records if r["kind"] == kind), key=lambda r: r["context"])
        context = [r["context"] for r in points]
        ax_time.plot(context, [r["median_s"] * 1e3 for r in points], "o-", label=kind)
        ax_memory.plot(context, [r["growth_bytes"] / 2**30 for r in points], "o-",
                       label=f"{kind}: process growth")
        ax_memory.plot(context, [r["cache_bytes"] / 2**30 for r in points], "x--",
                       label=f"{kind}: cache")
    for ax, title, unit in ((ax_time, "V4 decode step", "ms"), (ax_memory, "memory", "GiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        _plain_log_axes(ax)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def training_memory_figure(result: dict):
    """A layer's training step against T (``bench --train step`` records): the process's peak
    growth over one step (x, r, y, gradients and compilation included) where it was run, and
    XLA's account of the step (its buffer assignment; dashed) where it was compiled, one colour
    per layer kind, the issue's bounds marked, beside x's own size."""
    plt = pyplot()
    gib = 2**30
    records = [r for r in result["records"] if r["case"] == "train-step"]
    fig, ax = plt.subplots(figsize=(6.5, 4.4))
    for kind in sorted({r["kind"] for r in records}):
        points = sorted((r for r in records if r["kind"] == kind), key=lambda r: r["tokens"])
        run = [r for r in points if "growth_bytes" in r]
        line = None
        if run:
            line, = ax.plot([r["tokens"] for r in run], [r["growth_bytes"] / gib for r in run],
                            "o-", label=f"{kind}: process growth (run)")
        counted = {r["tokens"]: r["xla_account"]["growth"] for r in points if "xla_account" in r}
        if counted:
            line2, = ax.plot(sorted(counted), [counted[t] / gib for t in sorted(counted)], "x--",
                             color=line.get_color() if line else None,
                             label=f"{kind}: XLA's account (compiled)")
            line = line or line2
        bounds = [(r["tokens"], r["limit_bytes"] / gib) for r in points if r.get("limit_bytes")]
        if bounds:
            ax.plot(*zip(*bounds), "v", color=line.get_color(), fillstyle="none",
                    markersize=9, label=f"{kind}: bound")
    points = sorted({r["tokens"]: r["x_bytes"] for r in records}.items())
    ax.plot([t for t, _ in points], [b / gib for _, b in points], ":", color="gray",
            label="x alone (bf16)")
    ticks = sorted({r["tokens"] for r in records})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ticks, [f"{t // 1024}k" if t >= 1024 else str(t) for t in ticks])
    _plain_log_axes(ax)
    ax.set_xlabel("tokens per step (B = 1)")
    ax.set_ylabel("peak RSS growth of one step (GiB)")
    ax.set_title("Training step: forward, LM-loss backward, indexer loss and its backward",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    env = result.get("environment", {})
    cpu = env.get("cpu", {})
    fig.suptitle(f"{cpu.get('model name', '?')}, {env.get('cpu_count', '?')} cores; "
                 f"jax {env.get('jax', '?')}; bf16 weights and activations", fontsize=9)
    fig.tight_layout()
    return fig


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``--indexer-sweep JSON --png PATH``: draws a saved indexer sweep (``python -m
    jax_sparse_attn.bench --indexer-sweep --json JSON`` measures it); ``--train-memory JSON``
    the training steps' memory against T (``python -m jax_sparse_attn.bench --train step --json
    JSON``)."""
    p = argparse.ArgumentParser(prog="python -m jax_sparse_attn.plots", description=__doc__.splitlines()[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--indexer-sweep", metavar="JSON", help="a saved indexer sweep to draw")
    what.add_argument("--train-memory", metavar="JSON", nargs="+",
                      help="saved training-step records to draw (several files: their records "
                      "together, under the first one's environment)")
    p.add_argument("--png", metavar="PATH", required=True, help="where to write the chart")
    a = p.parse_args(argv)
    if a.indexer_sweep:
        with open(a.indexer_sweep) as f:
            write_indexer_png(json.load(f), a.png)
    else:
        results = []
        for path in a.train_memory:
            with open(path) as f:
                results.append(json.load(f))
        result = dict(results[0], records=[r for res in results for r in res["records"]])
        fig = training_memory_figure(result)
        fig.savefig(a.png, dpi=100)
        pyplot().close(fig)
    print(f"# wrote {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
