"""The charts (jax_sparse_attn/plots.py, ``bench --plot``): they draw the measured values, the
sweep (jax_sparse_attn/bench/sweeps.py) measures what it says, the core package never imports
matplotlib, and the charts never import the benchmarks (nor the reverse at import time)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from jax_sparse_attn.bench import cli, common, sweeps

pytest.importorskip("matplotlib")
from jax_sparse_attn import plots  # noqa: E402  (after the skip: plots needs matplotlib to draw)


def test_core_package_never_imports_matplotlib():
    code = ("import sys, jax_sparse_attn, jax_sparse_attn.bench.cli, jax_sparse_attn.__main__; "
            "print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _record(axis, value, op_s, naive_s, fixed):
    shape = dict(fixed, **{axis: value})
    return {"shape": shape, "median_s": {"op": op_s, "naive": naive_s}}


def test_figures_draw_the_sweep_values(rng):
    sizes = sweeps.SWEEPS["quick"]
    op_k, naive_k = rng.uniform(1e-4, 1e-2, (2, len(sizes["time_vs_K"]["K"])))
    op_t, naive_t = rng.uniform(1e-4, 1e-2, (2, len(sizes["time_vs_T"]["T"])))
    result = {
        "environment": common.environment(), "implementation": "none", "dtype": "bf16", "sizes": sizes,
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
    assert cli.main(["--plot", str(png), "--quick", "--json", str(sweep_json)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(sweep_json.read_text())
    sizes = sweeps.SWEEPS["quick"]
    assert [r["shape"]["K"] for r in result["time_vs_K"]] == sizes["time_vs_K"]["K"]
    assert [r["shape"]["T"] for r in result["time_vs_T"]] == sizes["time_vs_T"]["T"]
    records = result["time_vs_K"] + result["time_vs_T"]
    checked = []  # (fraction within one ulp, elements checked) per record
    for rec in records:
        assert rec["median_s"]["op"] > 0 and rec["median_s"]["naive"] > 0
        shape, check = rec["shape"], rec["contract_check"]
        checked.append((check["within_one_ulp"], check["tokens_checked"] * shape["H"] * shape["D"]))
    # docs/contract.md, "Tolerances": 99.9% of the elements within one ulp, over the whole sweep. A
    # record of 4 tokens checks 4096 elements, and one probability that rounds the other way moves
    # a (token, head) row of D of them, 0.25%: alone it would fail on the summation order. Each
    # record still stays far above what a wrong result gives.
    fractions, elements = np.array(checked).T
    assert (fractions * elements).sum() / elements.sum() >= 0.999
    assert fractions.min() >= 0.99
    for point in result["memory_vs_T"]:
        # The naive version materialises the gathered slots: its peak holds at least them.
        assert point["naive_growth_bytes"] >= point["gathered_slot_bytes"]
        assert point["op_growth_bytes"] > 0


def _indexer_point(axis_T, axis_R, op, dense):
    point = {"T": axis_T, "R": axis_R, "dense_bytes": 4 * axis_T * axis_R * 5,
             "op": {"median_s": op[0], "growth_bytes": op[1]}}
    point["dense"] = None if dense is None else {"median_s": dense[0], "growth_bytes": dense[1]}
    return point


def test_indexer_figure_draws_the_sweep_values(rng):
    sizes = {"fixed": dict(Hi=4, Di=64, K=2048), "prefill_T": [4096, 8192], "decode_R": [4096]}
    op = rng.uniform(0.1, 2.0, (3, 2))
    dense = rng.uniform(0.1, 2.0, (2, 2))
    result = {"environment": common.environment(), "dtype": "bf16", "sizes": sizes,
              "prefill": [_indexer_point(4096, 4096, op[0] * [1, 2**30], dense[0] * [1, 2**30]),
                          _indexer_point(8192, 8192, op[1] * [1, 2**30], None)],
              "decode": [_indexer_point(1, 4096, op[2] * [1, 2**30], dense[1] * [1, 2**30])]}
    fig = plots.indexer_figure(result)
    time_prefill, memory_prefill, time_decode, _ = fig.axes
    op_t, dense_t = time_prefill.lines
    np.testing.assert_allclose(op_t.get_xdata(), [4096, 8192])
    np.testing.assert_allclose(op_t.get_ydata(), op[:2, 0])
    np.testing.assert_allclose(dense_t.get_ydata(), [dense[0, 0]])  # 8192 did not fit
    op_m, dense_m, computed = memory_prefill.lines
    np.testing.assert_allclose(op_m.get_ydata(), op[:2, 1])
    np.testing.assert_allclose(dense_m.get_ydata(), [dense[0, 1]])
    np.testing.assert_allclose(computed.get_ydata(), [4 * 8192 * 8192 * 5 / 2**30])
    np.testing.assert_allclose(time_decode.lines[0].get_xdata(), [4096])


def test_benchmarks_never_import_the_plotting_module():
    # bench --plot imports plots when it draws, so plots must not import back from the benchmarks.
    code = ("import sys, jax_sparse_attn.bench.cli, jax_sparse_attn.bench.indexer, "
            "jax_sparse_attn.bench.sweeps, jax_sparse_attn.bench.v4; print('jax_sparse_attn.plots' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_plotting_module_imports_no_benchmark():
    code = ("import sys, jax_sparse_attn.plots; "
            "print(sorted(m for m in sys.modules if m.startswith('jax_sparse_attn.bench')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow  # four fresh processes, each compiling one small indexer call
def test_indexer_sweep_writes_json_and_the_chart_draws_it(tmp_path):
    sweep_json, png = tmp_path / "sweep.json", tmp_path / "indexer.png"
    assert cli.main(["--indexer-sweep", "--quick", "--json", str(sweep_json)]) == 0
    result = json.loads(sweep_json.read_text())
    from jax_sparse_attn.bench import indexer

    sizes = indexer.SWEEP["quick"]
    assert [p["T"] for p in result["prefill"]] == sizes["prefill_T"]
    assert [p["R"] for p in result["decode"]] == sizes["decode_R"]
    for point in result["prefill"] + result["decode"]:
        assert point["op"]["median_s"] > 0 and point["op"]["growth_bytes"] > 0
        assert point["dense"]["median_s"] > 0  # the quick sizes all fit
    assert plots.main(["--indexer-sweep", str(sweep_json), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_training_memory_figure_draws_each_kind_and_its_bounds(tmp_path, monkeypatch):
    gib = 2**30
    records = [{"case": "train-step", "kind": kind, "tokens": T, "growth_bytes": g * gib,
                "limit_bytes": limit, "x_bytes": T * 4096 * 2}
               for kind, T, g, limit in (("ratio4", 4096, 1.5, None), ("ratio4", 16384, 3.0, 6 * gib),
                                         ("ratio128", 4096, 1.0, None))]
    records[1]["xla_account"] = {"growth": 2.5 * gib}  # run, and XLA's account of it
    # Compiled, not run: XLA's account alone.
    records.append({"case": "train-step", "kind": "ratio4", "tokens": 65536, "compile_only": True,
                    "xla_account": {"growth": 8.0 * gib}, "limit_bytes": 12 * gib,
                    "x_bytes": 65536 * 4096 * 2})
    records.append({"case": "train-dense-kl", "growth_bytes": gib})  # not a step: not drawn
    env = {"cpu": {"model name": "a CPU"}, "cpu_count": 2, "jax": "0"}
    ax = plots.training_memory_figure({"environment": env, "records": records}).axes[0]
    r128, r4, r4_account, r4_bound, x_alone = ax.lines
    np.testing.assert_allclose(r4.get_xdata(), [4096, 16384])
    np.testing.assert_allclose(r4.get_ydata(), [1.5, 3.0])
    np.testing.assert_allclose(r4_account.get_xdata(), [16384, 65536])
    np.testing.assert_allclose(r4_account.get_ydata(), [2.5, 8.0])
    assert r4_account.get_color() == r4.get_color()
    np.testing.assert_allclose(r128.get_ydata(), [1.0])
    np.testing.assert_allclose(r4_bound.get_xdata(), [16384, 65536])  # only where the issue sets one
    np.testing.assert_allclose(r4_bound.get_ydata(), [6.0, 12.0])
    np.testing.assert_allclose(x_alone.get_ydata(), [T * 4096 * 2 / gib for T in (4096, 16384, 65536)])
    # From saved records, several runs' files together (python -m jax_sparse_attn.plots).
    first, second, png = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "train.png"
    first.write_text(json.dumps({"environment": env, "records": records[:2]}))
    second.write_text(json.dumps({"environment": env, "records": records[2:]}))
    drawn, draw = [], plots.training_memory_figure
    monkeypatch.setattr(plots, "training_memory_figure", lambda result: drawn.append(result) or draw(result))
    assert plots.main(["--train-memory", str(first), str(second), "--png", str(png)]) == 0
    assert drawn[0]["records"] == records
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
