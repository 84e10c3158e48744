"""The charts (jax_sparse_attn/plots.py, ``bench --plot``): they draw the measured values, the
sweep measures what it says, and the core package never imports matplotlib."""

import json
import subprocess
import sys

import numpy as np
import pytest

from jax_sparse_attn import bench

pytest.importorskip("matplotlib")
from jax_sparse_attn import plots  # noqa: E402  (after the skip: plots needs matplotlib to draw)


def test_core_package_never_imports_matplotlib():
    code = ("import sys, jax_sparse_attn, jax_sparse_attn.bench, jax_sparse_attn.__main__; "
            "print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _record(axis, value, op_s, naive_s, fixed):
    shape = dict(fixed, **{axis: value})
    return {"shape": shape, "median_s": {"op": op_s, "naive": naive_s}}


def test_figures_draw_the_sweep_values(rng):
    sizes = plots.SWEEPS["quick"]
    op_k, naive_k = rng.uniform(1e-4, 1e-2, (2, 4))
    op_t, naive_t = rng.uniform(1e-4, 1e-2, (2, 3))
    result = {
        "environment": bench.environment(), "implementation": "none", "dtype": "bf16", "sizes": sizes,
        "time_vs_K": [_record("K", k, o, n, sizes["time_vs_K"]["fixed"])
                      for k, o, n in zip(sizes["time_vs_K"]["K"], op_k, naive_k)],
        "time_vs_T": [_record("T", t, o, n, sizes["time_vs_T"]["fixed"])
                      for t, o, n in zip(sizes["time_vs_T"]["T"], op_t, naive_t)],
        "memory_vs_T": [{"T": 64, "shape": dict(sizes["memory_vs_T"]["fixed"], T=64),
                         "gathered_slot_bytes": 2**22, "op_growth_bytes": 3 * 2**20,
                         "naive_growth_bytes": 5 * 2**20}],
    }
    fig = plots.time_figure(result)
    (op_line, naive_line), (op_line_t, _) = fig.axes[0].lines, fig.axes[1].lines
    np.testing.assert_allclose(op_line.get_ydata(), op_k * 1e3)
    np.testing.assert_allclose(naive_line.get_ydata(), naive_k * 1e3)
    np.testing.assert_allclose(op_line_t.get_xdata(), sizes["time_vs_T"]["T"])
    np.testing.assert_allclose(op_line_t.get_ydata(), op_t * 1e3)
    ratios = [t.get_text() for t in fig.axes[0].texts]
    assert ratios == [f"{n / o:.1f}x" for o, n in zip(op_k, naive_k)]
    op_mem, naive_mem, slots = plots.memory_figure(result).axes[0].lines
    assert (op_mem.get_ydata()[0], naive_mem.get_ydata()[0], slots.get_ydata()[0]) == (
        3 / 1024, 5 / 1024, 4 / 1024)


@pytest.mark.slow  # measures a small sweep: a minute on a busy 2-core machine
def test_bench_plot_writes_a_png_and_the_sweep(tmp_path):
    png, sweep_json = tmp_path / "charts.png", tmp_path / "sweep.json"
    assert bench.main(["--plot", str(png), "--quick", "--json", str(sweep_json)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(sweep_json.read_text())
    sizes = plots.SWEEPS["quick"]
    assert [r["shape"]["K"] for r in result["time_vs_K"]] == sizes["time_vs_K"]["K"]
    assert [r["shape"]["T"] for r in result["time_vs_T"]] == sizes["time_vs_T"]["T"]
    for rec in result["time_vs_K"] + result["time_vs_T"]:
        assert rec["median_s"]["op"] > 0 and rec["median_s"]["naive"] > 0
        assert rec["contract_check"]["within_one_ulp"] >= 0.999
    for point in result["memory_vs_T"]:
        # The naive version materialises the gathered slots: its peak holds at least them.
        assert point["naive_growth_bytes"] >= point["gathered_slot_bytes"]
        assert point["op_growth_bytes"] > 0
