"""The emulator's cost model: single instructions against the documented formulas, by hand.

Each expected figure is written out from the formula the NKI ISA reference gives ("Estimated
instruction cost") and the documented clocks and bandwidths (see
jax_sparse_attn/nki_emulator/cost.py for the sources), not computed by the code under test.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from jax_sparse_attn.nki_emulator import cost, simulate
from jax_sparse_attn.nki_emulator.errors import NkiEmulatorError
from jax_sparse_attn.nki_emulator import isa as nisa
from jax_sparse_attn.nki_emulator import language as nl

# The cost model: no JAX program runs (CI runs these with one JAX, the newest).
pytestmark = pytest.mark.jax_free

BF16 = ml_dtypes.bfloat16
GHZ = {  # (tensor, vector, scalar, gpsimd) clocks from the architecture guides
    "trn1": (2.8, 1.12, 1.4, 1.4),
    "trn2": (2.4, 0.96, 1.2, 1.2),
    "trn3": (2.4, 1.2, 1.2, 1.2),
}


def _costed(kernel, *args, target="trn2"):
    """Run ``kernel`` with cost recording; the cost record of its one program."""
    run = simulate(kernel, target=target, cost=True)
    run(*args)
    return run.last_run.programs[0].cost


def _only(record, instr):
    count, us = record.by_instruction[instr]
    assert count == 1
    return us


def _out(tile):
    out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
    staged = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=staged, src=tile[0:1, 0:1])
    nl.store(out, value=staged)
    return out


@pytest.mark.parametrize("target", ["trn1", "trn2", "trn3"])
@pytest.mark.parametrize(
    "dtype, m, n, cycles",
    [(BF16, 128, 512, 512), (BF16, 128, 32, 64), (BF16, 16, 8, 16), (np.float32, 128, 512, 2048)],
)
def test_nc_matmul_cost(target, dtype, m, n, cycles):
    # max(min(64, N_stationary), N_moving) TensorE cycles, x4 for fp32 inputs.
    def kernel(x):
        st = nl.ndarray((128, m), dtype, buffer=nl.sbuf)
        mv = nl.ndarray((128, n), dtype, buffer=nl.sbuf)
        nisa.memset(st, 1.0)
        nisa.memset(mv, 1.0)
        acc = nl.ndarray((m, n), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc, st, mv, accumulate=False)
        return _out(acc)

    record = _costed(kernel, np.zeros(1, np.float32), target=target)
    assert _only(record, "nisa.nc_matmul") == pytest.approx(cycles / (GHZ[target][0] * 1e3))


@pytest.mark.parametrize("flags, cycles", [((False, False), 2048), ((False, True), 1024),
                                           ((True, True), 512)])  # fmt: skip
def test_nc_matmul_one_zero_operands_halve_the_fp32_factor(flags, cycles):
    # nc_matmul page: is_*_onezero "could lead to 2x better performance" for an fp32 operand of
    # ones and zeros; the model halves the x4 per flagged fp32 operand. A false flag is refused.
    def kernel(x, values):
        st = nl.ndarray((128, 128), nl.float32, buffer=nl.sbuf)
        mv = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
        nisa.memset(st, 1.0)
        nisa.dma_copy(dst=mv, src=values)
        acc = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc, st, mv, is_stationary_onezero=flags[0], is_moving_onezero=flags[1],
                       accumulate=False)  # fmt: skip
        return _out(acc)

    ones_zeros = (np.arange(128 * 512).reshape(128, 512) % 3 == 0).astype(np.float32)
    record = _costed(kernel, np.zeros(1, np.float32), ones_zeros, target="trn2")
    assert _only(record, "nisa.nc_matmul") == pytest.approx(cycles / (GHZ["trn2"][0] * 1e3))
    if flags[1]:
        with pytest.raises(NkiEmulatorError, match="is_moving_onezero"):
            _costed(kernel, np.zeros(1, np.float32), ones_zeros * 0.5, target="trn2")


def test_scalar_engine_costs():
    def kernel(x):
        data = nl.ndarray((128, 1000), nl.float32, buffer=nl.sbuf)
        nisa.memset(data, 0.5)
        dst = nl.ndarray((128, 1000), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=dst, op=nl.exp, data=data)
        total = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        small = nl.ndarray((128, 10), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=small, op=nl.exp, data=data[:, 0:10], reduce_op=nl.add,
                        reduce_res=total, reduce_cmd=nisa.reduce_cmd.reset_reduce)  # fmt: skip
        copied = nl.ndarray((128, 1000), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=copied, src=data, engine=nisa.engine.scalar)
        return _out(dst)

    record = _costed(kernel, np.zeros(1, np.float32))
    # activation: max(MIN_II, N) = 1000 cycles; with a reduction max(MIN_II, 10) + MIN_II = 128;
    # tensor_copy on the Scalar Engine max(MIN_II, N) = 1000; all at 1.2 GHz.
    assert record.by_instruction["nisa.activation"] == [2, pytest.approx((1000 + 128) / 1.2e3)]
    assert record.engine_us["scalar"] == pytest.approx((1000 + 128 + 1000) / 1.2e3)


def test_vector_and_gpsimd_engine_costs():
    def kernel(x):
        a = nl.ndarray((128, 300), nl.float32, buffer=nl.sbuf)
        nisa.memset(a, 1.0)  # fp32: max(64, 300) = 300
        b = nl.ndarray((128, 300), nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(b, 0)  # zero into bf16: max(64, 300/2) = 150
        c = nl.ndarray((128, 300), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=c, data1=a, data2=a, op=nl.add)  # fp32 SBUF+SBUF: 2N = 600
        d = nl.ndarray((128, 300), nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=d, data1=b, data2=b, op=nl.multiply)  # all bf16 SBUF: N = 300
        e = nl.ndarray((128, 10), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=e, data=a[:, 0:10], op0=nl.add, operand0=1.0)  # MIN_II = 64
        r = nl.ndarray((128, 100), nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=r, data=a[:, 0:100])  # max(64, 8 * 100) = 800
        m = nl.ndarray((128, 1), nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=m, op=nl.max, data=b, axis=1, keepdims=True)  # bf16 max: N/2 = 150
        s = nl.ndarray((128, 300), nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=s, data=a, op0=nl.multiply, operand0=2.0, op1=nl.add,
                                  operand1=c)  # 2N = 600  # fmt: skip
        i = nl.ndarray((128, 40), nl.int32, buffer=nl.sbuf)
        nisa.iota(i, [[1, 40]])  # GpSimd 150 + N = 190
        return _out(c)

    record = _costed(kernel, np.zeros(1, np.float32))
    vector_cycles = 300 + 150 + 600 + 300 + 64 + 800 + 150 + 600 + 64  # + _out's tensor_copy
    assert record.engine_us["vector"] == pytest.approx(vector_cycles / 0.96e3)
    assert record.engine_us["gpsimd"] == pytest.approx(190 / 1.2e3)
    assert record.by_instruction["nisa.tensor_tensor"][1] == pytest.approx(900 / 0.96e3)


def test_nc_transpose_cost():
    def kernel(x):
        data = nl.ndarray((128, 96), nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(data, 0)
        dst = nl.ndarray((96, 128), nl.bfloat16, buffer=nl.psum)
        nisa.nc_transpose(dst=dst, data=data)  # max(P, min(64, F)) = 128 TensorE cycles
        return _out_bf16(dst)

    def _out_bf16(tile):
        out = nl.ndarray((1, 1), nl.bfloat16, buffer=nl.shared_hbm)
        staged = nl.ndarray((1, 1), nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=staged, src=tile[0:1, 0:1])
        nl.store(out, value=staged)
        return out

    record = _costed(kernel, np.zeros(1, np.float32))
    assert _only(record, "nisa.nc_transpose") == pytest.approx(128 / 2.4e3)


@pytest.mark.parametrize("target, gbps", [("trn1", 272), ("trn2", 368), ("trn3", 528)])
def test_dma_cost_is_bytes_over_bandwidth_plus_chunk_overhead(target, gbps):
    x = np.zeros((128, 1024), BF16)

    def kernel(x):
        tile = nl.ndarray((128, 1024), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x)
        out = nl.ndarray((128, 1024), nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=tile)
        return out

    record = _costed(kernel, x, target=target)
    # 262144 bytes at the per-core DMA bandwidth (GB/s = bytes/ns), plus 128 chunks (one per
    # partition) x 20 ns spread over 16 DMA engines.
    expected_ns = 262144 / gbps + 128 * 20 / 16
    assert record.by_instruction["nisa.dma_copy"] == [2, pytest.approx(2 * expected_ns / 1e3)]
    assert record.busiest_engine == "dma"
    assert record.modelled_us == pytest.approx(2 * expected_ns / 1e3)


def test_indirect_gather_charges_moved_rows_and_swdge_descriptors():
    kv = np.zeros((100, 64), BF16)
    idx = np.arange(128, dtype=np.int32).reshape(128, 1)  # rows 100..127 out of range: skipped

    def kernel(kv, idx):
        rows = nl.ndarray((128, 64), nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(rows, 0)
        index = nl.load(idx)
        nisa.dma_copy(dst=rows, src=kv.ap([[64, 128], [1, 64]], vector_offset=index),
                      oob_mode=nisa.oob_mode.skip)  # fmt: skip
        out = nl.ndarray((128, 64), nl.bfloat16, buffer=nl.shared_hbm)
        nl.store(out, value=rows)
        return out

    record = _costed(kernel, kv, idx)
    # 100 rows of 128 bytes moved, one chunk each; GpSimd generates 128 descriptors: 150 + 128.
    assert _only(record, "nisa.dma_copy") == pytest.approx((100 * 128 / 368 + 100 * 20 / 16) / 1e3)
    assert _only(record, "nisa.dma_copy (swdge)") == pytest.approx((150 + 128) / 1.2e3)


def test_programs_of_a_grid_have_their_own_costs():
    def kernel(x):
        out = nl.ndarray((128, 512), nl.float32, buffer=nl.shared_hbm)
        p = nl.program_id(0)
        tile = nl.ndarray((128, 256), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x[:, p * 256 : (p + 1) * 256])
        nisa.dma_copy(dst=out[:, p * 256 : (p + 1) * 256], src=tile)
        return out

    run = simulate(kernel, target="trn2", grid=2, cost=True)
    run(np.zeros((128, 512), np.float32))
    per_program = [p.cost.engine_us["dma"] for p in run.last_run.programs]
    # Each program moves 128 rows of 1 KiB twice, 128 chunks each way (strided HBM rows).
    expected = 2 * (131072 / 368 + 128 * 20 / 16) / 1e3
    assert per_program == [pytest.approx(expected), pytest.approx(expected)]


def test_attention_bounds_by_hand():
    T, H, D, K = 16, 64, 512, 2048
    b = cost.attention_bounds("trn2", T, H, D, K)
    nbytes = 2 * (T * H * D) * 2 + T * K * D * 2 + T * K * 4  # q, out, slot rows (bf16), bias f32
    # trn2: 3 TB/s over 8 physical cores, two per logical core; 79 TFLOPS per core.
    assert b["hbm_bound_us"] == pytest.approx(nbytes / (2 * 375e3))
    assert b["pe_bound_us"] == pytest.approx(4 * T * H * K * D / (2 * 79e6))
    b1 = cost.attention_bounds("trn1", T, H, D, K)
    assert b1["hbm_bound_us"] == pytest.approx(nbytes / 410e3)  # 820 GB/s over 2 cores, LNC=1
    assert b1["pe_bound_us"] == pytest.approx(4 * T * H * K * D / 92e6)


def test_an_instruction_without_a_formula_is_named():
    with pytest.raises(KeyError, match="no cost formula for nisa.frobnicate"):
        cost._cost_key("nisa.frobnicate", 1, 1)


def test_bench_model_cli_writes_labelled_json(tmp_path, capsys):
    import json

    from jax_sparse_attn.bench import cli

    path = tmp_path / "model.json"
    assert cli.main(["--model", "trn2", "--shape", "2,4,128,128,256", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "MODEL (not a measurement)" in printed
    result = json.loads(path.read_text())
    assert result["kind"].startswith("MODEL") and result["target"] == "trn2"
    (rec,) = result["records"]
    assert rec["shape"] == {"T": 2, "H": 4, "D": 128, "K": 128, "R": 256}
    nbytes = 2 * (2 * 4 * 128) * 2 + 2 * 128 * 128 * 2 + 2 * 128 * 4
    assert rec["hbm_bound_us"] == pytest.approx(nbytes / (2 * 375e3))
    assert rec["pe_bound_us"] == pytest.approx(4 * 2 * 4 * 128 * 128 / (2 * 79e6))
    assert set(rec["per_engine_us"]) == {"tensor", "vector", "scalar", "gpsimd", "dma"}
    assert rec["modelled_us"] == pytest.approx(max(rec["per_engine_us"].values()))
    assert rec["busiest_engine"] == max(rec["per_engine_us"], key=rec["per_engine_us"].get)
    assert rec["instructions"] > 0 and rec["instructions_executed"] >= rec["instructions"]
    assert rec["scaled_from_tokens"] is None


def test_bench_model_scaling_is_affine_in_tokens():
    from jax_sparse_attn.bench import attention_model

    small = {"modelled_us": 10.0, "per_engine_us": {"dma": 10.0, "tensor": 4.0},
             "instructions": 100, "instructions_executed": 300, "dma_bytes": 1000, "launches": 1}
    large = {"modelled_us": 16.0, "per_engine_us": {"dma": 16.0, "tensor": 6.0},
             "instructions": 100, "instructions_executed": 500, "dma_bytes": 1800, "launches": 1}
    # P = 8 tokens and 2P = 16: per token 0.75 us, 25 instructions, 100 bytes; T = 4096.
    got = attention_model._scale(small, large, 8, 4096)
    assert got["modelled_us"] == pytest.approx(10.0 + 4088 * 0.75)
    assert got["per_engine_us"]["tensor"] == pytest.approx(4.0 + 4088 * 0.25)
    assert got["instructions"] == 100  # a compiled body that does not grow stays as it is
    assert got["instructions_executed"] == 300 + 4088 * 25
    assert got["dma_bytes"] == 1000 + 4088 * 100


def test_integer_tensor_tensor_defaults_to_gpsimd():
    def kernel(x):
        a = nl.ndarray((128, 100), nl.int32, buffer=nl.sbuf)
        nisa.memset(a, 3)
        b = nl.ndarray((128, 100), nl.int32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=b, data1=a, data2=a, op=nl.add)  # int32: GpSimd, 2N = 200
        out = nl.ndarray((1, 1), nl.int32, buffer=nl.shared_hbm)
        nl.store(out, value=b[0:1, 0:1])
        return out

    record = _costed(kernel, np.zeros(1, np.float32))
    assert record.engine_us["gpsimd"] == pytest.approx(200 / 1.2e3)


@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_runtime_address_dma_costs_its_descriptor_generation(target):
    x = np.zeros((4, 256), np.float32)

    def kernel(x):
        tile = nl.ndarray((1, 256), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x.ap([[256, 1], [1, 256]], scalar_offset=nisa.register_alloc(2)))
        out = nl.ndarray((1, 256), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=tile)
        return out

    record = _costed(kernel, x, target=target)
    gbps = {"trn1": 272, "trn2": 368}[target]
    transfer_ns = 1024 / gbps + 1 * 20 / 16
    count, us = record.by_instruction["nisa.dma_copy"]
    if target == "trn2":  # hardware DGE: 600 ns over two DGE instances, on the DMA queues
        assert us == pytest.approx((transfer_ns + 300) / 1e3)
        assert "nisa.dma_copy (swdge)" not in record.by_instruction
    else:  # no hardware DGE on trn1: GpSimd generates the one descriptor, 150 + 1 cycles
        assert us == pytest.approx(transfer_ns / 1e3)
        assert record.by_instruction["nisa.dma_copy (swdge)"][1] == pytest.approx(151 / 1.4e3)


def test_recording_collects_costed_runs_of_any_launch():
    from jax_sparse_attn import nki_emulator

    def kernel(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=nl.load(x))
        return out

    x = np.ones((128, 64), np.float32)
    with nki_emulator.recording() as rec:
        simulate(kernel, target="trn2")(x)
        simulate(kernel, target="trn3")[2](x)
    simulate(kernel)(x)  # outside the block: not recorded
    assert [(r.target, r.grid) for r in rec.runs] == [("trn2", 1), ("trn3", 2)]
    assert all(p.cost is not None and p.cost.dma_bytes == 2 * 128 * 64 * 4
               for r in rec.runs for p in r.programs)  # fmt: skip


def test_hbm_bytes_count_the_hbm_side_only():
    """A DMA from HBM to SBUF counts its bytes as HBM bytes (at the HBM dtype); SBUF to SBUF
    moves none; both count as DMA bytes (at the wider dtype)."""

    def kernel(x):
        a = nl.ndarray((4, 32), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=x)  # 128 fp8 elements from HBM, converted to bf16
        b = nl.ndarray((4, 32), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=b, src=a)  # on chip
        out = nl.ndarray((4, 32), nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=b)
        return out

    run = simulate(kernel, target="trn2", cost=True)
    run(np.zeros((4, 32), ml_dtypes.float8_e4m3fn))
    cost = run.last_run.programs[0].cost
    assert cost.hbm_bytes == 128 * 1 + 128 * 2
    assert cost.dma_bytes == 3 * 128 * 2


def test_bench_model_value_dim_models_both_widths(tmp_path, capsys):
    import json

    from jax_sparse_attn.bench import cli

    path = tmp_path / "model.json"
    assert cli.main(["--model", "trn2", "--shape", "2,4,256,128,256", "--value-dim", "128",
                       "--json", str(path)]) == 0
    assert "value_dim=128 of D=256" in capsys.readouterr().out
    full, narrow = json.loads(path.read_text())["records"]
    assert (full["value_dim"], narrow["value_dim"]) == (256, 128)
    # Half the value columns: fewer value matmuls on the PE, fewer output bytes, a smaller bound.
    assert narrow["per_engine_us"]["tensor"] < full["per_engine_us"]["tensor"]
    assert narrow["hbm_bytes"] < full["hbm_bytes"]
    assert narrow["pe_bound_us"] == pytest.approx(2 * 2 * 4 * 128 * (256 + 128) / (2 * 79e6))
    assert narrow["modelled_over_all_value_columns"] == pytest.approx(
        narrow["modelled_us"] / full["modelled_us"])
