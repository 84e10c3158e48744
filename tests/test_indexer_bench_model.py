"""``python -m jax_sparse_attn.bench --model trn2 --op indexer``: the record's fields and bounds."""

import json

import pytest

from jax_sparse_attn.nki_emulator.cost import HARDWARE


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["tiled", "decode"])
def test_indexer_model_record_and_bounds(tmp_path, kernel):
    from jax_sparse_attn.bench.cli import main

    path = tmp_path / "model.json"
    assert main(["--model", "trn2", "--op", "indexer", "--shape", "3,1000,4,16,16",
                 "--indexer-kernel", kernel, "--json", str(path)]) == 0  # fmt: skip
    record = json.loads(path.read_text())["records"][0]
    for key in ("modelled_us", "hbm_bound_us", "pe_bound_us", "instructions", "busiest_engine",
                "per_engine_us"):  # fmt: skip
        assert key in record
    assert record["shape"] == {"T": 3, "R": 1000, "Hi": 4, "Di": 16, "K": 16}
    hw = HARDWARE["trn2"]
    # The last 3 tokens of 1000 rows: positions 997..999, all 1000 rows read once (bf16).
    assert record["hbm_bound_us"] == pytest.approx(1000 * 16 * 2 / (hw.hbm_gbps_per_core * 2 * 1e3))
    flops = 2 * 4 * 16 * (998 + 999 + 1000)
    assert record["pe_bound_us"] == pytest.approx(flops / (hw.pe_bf16_tflops_per_core * 2 * 1e6))
    assert record["busiest_engine"] == max(record["per_engine_us"], key=record["per_engine_us"].get)
    # Launches run one after another, each as long as its busiest engine: at least the busiest
    # engine's total.
    assert record["modelled_us"] >= record["per_engine_us"][record["busiest_engine"]] * (1 - 1e-12)
    assert record["kernel"] == kernel
    # Tiled: the row shares' selection, then their merge; row-spread: one launch.
    assert record["launches"] == (2 if kernel == "tiled" else 1)


@pytest.mark.slow
def test_indexer_model_records_the_kernel_the_routing_picks(tmp_path):
    from jax_sparse_attn.bench.cli import main
    from jax_sparse_attn.indexer import neuron

    path = tmp_path / "model.json"
    assert main(["--model", "trn2", "--op", "indexer", "--shape", "3,1000,4,16,16",
                 "--json", str(path)]) == 0  # fmt: skip
    record = json.loads(path.read_text())["records"][0]
    assert record["kernel"] == neuron.choose_kernel("trn2", 2, 3, 4, 16, 1000, 16)[0]
