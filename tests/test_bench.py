"""The benchmark's own pieces: its naive baseline and contract model agree with the test oracle,
and the command line runs end to end and writes its JSON."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_attn.bench import attention, cli
from oracle import BF16, attention_bf16_contract, attention_f64, gather, within_one_ulp


def test_naive_baseline_and_contract_model_follow_the_contract(rng):
    T, H, D, K, R = 3, 4, 64, 48, 90
    q = rng.standard_normal((T, H, D)).astype(BF16)
    kv = rng.standard_normal((R, D)).astype(BF16)
    idx = rng.integers(-5, R + 5, (T, K)).astype(np.int32)
    sink = rng.standard_normal(H).astype(np.float32)
    x, valid = gather(kv, idx)
    want = attention_bf16_contract(q, x, valid, sink, scale=0.125)
    naive = jax.jit(attention.naive_attention, static_argnums=4)(q, kv, idx, sink, 0.125)
    model = attention.contract_model(q, kv, idx, sink, 0.125, BF16)
    assert naive.dtype == jnp.bfloat16
    assert within_one_ulp(np.asarray(naive), want) >= 0.999
    assert within_one_ulp(model, want) >= 0.999


@pytest.mark.slow  # the quick cases' compilations: 6-9 s
def test_command_line_writes_json(tmp_path, capsys):
    path = tmp_path / "attention.json"
    code = cli.main(["--shape", "2,4,64,32,128", "--repeats", "2", "--warmup", "1",
                       "--json", str(path)])
    assert code == 0
    table = capsys.readouterr().out
    assert "T=2 H=4 D=64 K=32 R=128" in table
    result = json.loads(path.read_text())
    (rec,) = result["records"]
    assert rec["flops"] == 4 * 2 * 4 * 32 * 64
    assert len(rec["times_s"]["op"]) == len(rec["times_s"]["naive"]) == 2
    assert rec["naive_over_op"] > 0 and rec["op_fraction_of_gemm_f32"] > 0
    assert rec["contract_check"]["within_one_ulp"] >= 0.999
    assert result["environment"]["backend"] == jax.default_backend()
    # CPU time per call is recorded next to wall time, and with it the load the run saw
    assert len(rec["cpu_times_s"]["op"]) == len(rec["cpu_times_s"]["gemm_f32"]) == 2
    assert all(t >= 0 for t in rec["cpu_times_s"]["op"])
    assert set(rec["cores_busy"]) <= {"op", "naive", "gemm_f32"}
    assert all(c >= 0 for c in rec["cores_busy"].values())
    if hasattr(os, "getloadavg"):
        assert len(rec["load_average"]["before"]) == len(rec["load_average"]["after"]) == 3


@pytest.mark.slow  # several seconds: CI runs it with the slow tests
def test_grad_command_line_times_the_kv_scatter_baseline(tmp_path, capsys):
    path = tmp_path / "grad.json"
    code = cli.main(["--shape", "2,4,64,32,128", "--grad", "--repeats", "2", "--warmup", "1",
                       "--json", str(path)])
    assert code == 0
    assert "d kv accumulation" in capsys.readouterr().out
    (rec,) = json.loads(path.read_text())["records"]
    assert rec["flops"] == int(attention.GRAD_FLOPS_FACTOR * 4 * 2 * 4 * 32 * 64)
    assert len(rec["times_s"]["kv_scatter"]) == 2
    assert rec["kv_scatter_over_op"] > 0
    assert 0 < rec["gemm_fraction_bound_given_kv_scatter"] < 1


def test_kv_scatter_baseline_adds_every_token_rows():
    shape = attention.Shape("tiny", 3, 1, 8, 5, 7)
    fn, (rows, values) = attention._kv_scatter(shape)
    rows, values = np.asarray(rows), np.asarray(values, np.float64)
    want = np.zeros((7, 8))
    for t in range(3):
        np.add.at(want, rows[t], values * float(rows[t, 0]))
    got = np.asarray(fn(rows, values), np.float64)
    np.testing.assert_allclose(got, want, rtol=2**-8, atol=1e-6)


@pytest.mark.slow
def test_cpu_products_flag_times_each_form_in_the_same_rounds(tmp_path):
    path = tmp_path / "forms.json"
    code = cli.main(["--shape", "2,4,64,32,128", "--repeats", "2", "--warmup", "0",
                       "--no-naive", "--no-gemm", "--cpu-products", "native,f32-x-first",
                       "--json", str(path)])
    assert code == 0
    result = json.loads(path.read_text())
    env = result["environment"]["cpu_products"]
    assert env["auto"] in ("native", "f32", "native-x-first", "f32-x-first")
    rec = result["records"][0]
    assert rec["cpu_products"] == "native"
    assert len(rec["times_s"]["op"]) == len(rec["times_s"]["op[f32-x-first]"]) == 2
    other = rec["other_cpu_products"]["f32-x-first"]
    assert rec["contract_check"]["within_one_ulp"] >= 0.999
    assert other["contract_check"]["within_one_ulp"] >= 0.999
    assert other["median_s"] > 0 and other["op_over_this"] > 0
    for bad in (["--cpu-products", "bf16"], ["--memory", "--cpu-products", "f32"]):
        with pytest.raises(SystemExit):
            cli.main(bad)


def test_sdpa_baseline_is_attention_without_a_sink(rng):
    T, H, D, K, R = 3, 4, 32, 16, 40
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    kv = rng.standard_normal((R, D)).astype(np.float32)
    idx = rng.integers(-3, R, (T, K)).astype(np.int32)
    idx[:, 0] = 5  # every token keeps one valid slot
    x, valid = gather(kv, idx)
    want = attention_f64(q, x, valid, np.full(H, -np.inf, np.float32), scale=0.25)
    got = jax.jit(attention.sdpa_attention, static_argnums=3)(q, kv, idx, 0.25)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)


@pytest.mark.slow
def test_sdpa_flag_times_the_baseline(tmp_path, capsys):
    path = tmp_path / "sdpa.json"
    code = cli.main(["--shape", "2,4,64,32,128", "--repeats", "2", "--warmup", "1", "--sdpa",
                       "--no-gemm", "--json", str(path)])
    assert code == 0
    assert "dot_product_attention" in capsys.readouterr().out
    (rec,) = json.loads(path.read_text())["records"]
    assert len(rec["times_s"]["sdpa"]) == 2 and rec["sdpa_over_op"] > 0


@pytest.mark.slow  # five programs to compile and time: several seconds
def test_two_caches_command_line_times_the_alternatives(tmp_path, capsys):
    path = tmp_path / "two.json"
    code = cli.main(["--two-caches", "--shape", "2,64,512,512,1024", "--repeats", "1",
                       "--warmup", "0", "--json", str(path)])
    assert code == 0
    rec = json.loads(path.read_text())["two_caches"]
    assert rec["shape"]["T"] == 2 and rec["shape"]["R"] == 1024 and rec["shape"]["window"] == 128
    assert set(rec["median_s"]) == {"op", "concat", "merge", "fp8_op", "fp8_merge"}
    assert rec["op_same_bits_as_concat"] is True
    # Two roundings against one: close, not necessarily equal.
    assert 0 <= rec["max_abs_diff_merge_vs_op"] < 0.05
    assert 0 <= rec["max_abs_diff_fp8_merge_vs_fp8_op"] < 0.05
    assert rec["fp8_op_over_op"] > 0 and rec["fp8_merge_over_fp8_op"] > 0
    assert "concatenate then call" in capsys.readouterr().out


def test_indexer_cases_count_the_causal_pairs_and_check_against_float64(rng):
    from jax_sparse_attn.bench import indexer as bi

    prefill = bi.IndexerShape("p", 6, 2, 4, 3, 6)
    decode = bi.IndexerShape("d", 1, 2, 4, 3, 10)
    assert prefill.valid_pairs == 6 * 7 // 2 and decode.valid_pairs == 10
    assert prefill.flops == 2 * 2 * 4 * 21
    # check_selection: the f64 top-k passes; a wrong row is counted out.
    q = rng.standard_normal((6, 2, 4)).astype(np.float32)
    w = rng.standard_normal((6, 2)).astype(np.float32)
    keys = rng.standard_normal((6, 4)).astype(np.float32)
    positions = prefill.positions
    idx = np.full((6, 3), -1, np.int32)
    for t in range(6):
        s = np.maximum(q[t].astype(np.float64) @ keys[: t + 1].T.astype(np.float64), 0).T @ w[t]
        top = np.argsort(-s, kind="stable")[:3]
        idx[t, : len(top)] = top
    good = bi.check_selection(idx, q, w, keys, positions, 3, tokens=6)
    assert good["rows_in_f64_topk"] == 1.0 and good["max_gap_rel"] == 0.0
    bad = idx.copy()
    last = int(np.setdiff1d(np.arange(6), idx[5])[0])
    bad[5, 2] = last
    assert bi.check_selection(bad, q, w, keys, positions, 3, tokens=6)["rows_in_f64_topk"] < 1.0


@pytest.mark.slow  # compiles the indexer and a layer decode step: tens of seconds
def test_indexer_command_line_writes_json(tmp_path, capsys):
    out = tmp_path / "indexer.json"
    assert cli.main(["--cases", "indexer,layer-decode", "--quick", "--repeats", "2",
                       "--json", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert [r["case"] for r in records] == ["indexer", "indexer", "layer-decode"]
    for rec in records[:2]:
        assert rec["selection_check"]["rows_in_f64_topk"] == 1.0
        assert rec["dense_same_rows"] == 1.0 and rec["op_fraction_of_gemm_f32"] > 0
        # The scores alone (no selection) in the same rounds: the selection's share of the op.
        assert rec["scores_alone_fraction_of_gemm_f32"] > 0 and rec["selection_share_of_op"] < 1
    assert records[2]["step_over_parts"] > 0
    assert "layer-decode" in capsys.readouterr().out


def test_token_split_deals_tokens_out_in_turn_and_puts_results_back():
    from jax_sparse_attn.bench import indexer as bi

    split = bi.TokenSplit(3)
    order = split.order(9)
    # Device d's share (contiguous in the split operands) is tokens d, d + 3, d + 6.
    assert order.tolist() == [0, 3, 6, 1, 4, 7, 2, 5, 8]
    rows = np.arange(9 * 2).reshape(9, 2)
    np.testing.assert_array_equal(split.unsplit(rows[order]), rows)
    # A causal prefill's (token, row) pairs: the devices' shares differ by one token's worth.
    shape = bi.IndexerShape("p", 96, 2, 4, 3, 96)
    dealt = split.order(shape.T)
    pairs = [int(np.sum(shape.positions[dealt[d * 32:(d + 1) * 32]] + 1)) for d in range(3)]
    assert max(pairs) - min(pairs) <= 2 * 32 and sum(pairs) == shape.valid_pairs
    assert split.applies(shape) and not split.applies(bi.IndexerShape("d", 1, 2, 4, 3, 96))
    assert not bi.TokenSplit(1).applies(shape)


def test_cpu_devices_flag_refuses_what_it_cannot_split(capsys):
    # Only the indexer cases split; and JAX's CPU devices are fixed once its backends started
    # (as in this test session).
    with pytest.raises(SystemExit):
        cli.main(["--cases", "decode", "--cpu-devices", "2"])
    assert "applies to --cases indexer and layer-prefill alone" in capsys.readouterr().err
    jax.devices()
    with pytest.raises(SystemExit):
        cli.main(["--cases", "indexer", "--quick", "--cpu-devices", "2"])
    assert "--cpu-devices" in capsys.readouterr().err


@pytest.mark.slow  # a fresh process with two CPU devices compiling the indexer's quick cases
def test_cpu_devices_flag_splits_a_prefill_over_the_devices(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "indexer.json"
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, "-m", "jax_sparse_attn.bench", "--cases",
                           "indexer,layer-prefill", "--quick", "--repeats", "1", "--cpu-devices",
                           "2", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    prefill, decode, layer = json.loads(out.read_text())["records"]
    assert prefill["cpu_devices"] == 2 and decode["cpu_devices"] == 1  # T = 1 does not split
    for rec in (prefill, decode):  # the float64 top-k, and the dense path's rows, either way
        assert rec["selection_check"]["rows_in_f64_topk"] == 1.0
        assert rec["dense_same_rows"] == 1.0
    assert prefill["split_over_one_device"] > 0 and "split_over_one_device" not in decode
    assert "tokens dealt over 2 CPU devices" in proc.stdout
    # The layer's prefill with its batch over the two devices: the one-device output, bit for bit.
    assert layer["case"] == "layer-prefill" and layer["cpu_devices"] == 2
    assert layer["split_same_bits"] and layer["finite"] and layer["split_over_one_device"] > 0
    # The one-device layer's weights stay on one device through the rounds (a layer shared with
    # the split calls had its weights replicated, and its "one device" call ran on both).
    assert layer["one_device_weights_on"] == 1
    assert "batch over 2 CPU devices" in proc.stdout


@pytest.mark.slow
def test_layer_memory_flag_measures_a_fresh_process(tmp_path):
    pytest.importorskip("flax")
    out = tmp_path / "layer-memory.json"
    assert cli.main(["--layer-memory", "512", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())["layer_memory"]
    assert rec["T"] == 512 and rec["length"] == 512 and rec["finite"]
    assert 0 < rec["growth_bytes"] <= rec["limit_bytes"]


# --- training (bench --train; jax_sparse_attn/bench/training.py) ------------------------------------


def test_dense_kl_flops_credit_every_visible_pair():
    from jax_sparse_attn.bench import training

    shape = training.DenseKLShape("t", 5, 3, 8, 2, 4, 2)
    pairs = sum(1 for t in range(5) for r in range(5) if r <= t)
    teacher, student = 2 * 3 * 8, 2 * 2 * 4  # FLOPs of one pair's logits over the heads
    assert training.dense_kl_flops(shape) == pairs * (2 * teacher + 3 * student)
    # V3.2's case: 8192 tokens, 128 heads of 576, 64 index heads of 128
    big = training.DENSE_KL_SHAPE
    assert (big.T, big.H, big.D, big.Hi, big.Di) == (8192, 128, 576, 64, 128)


def test_train_flag_refuses_unknown_cases_and_kinds():
    with pytest.raises(ValueError, match="unknown case 'forward'"):
        cli.main(["--train", "forward"])
    with pytest.raises(ValueError, match="unknown kind 'ratio8'"):
        cli.main(["--train", "step", "--train-kinds", "ratio8"])


@pytest.mark.slow  # two fresh processes compiling a narrowed layer's step and the dense loss
def test_train_command_line_measures_a_step_and_the_dense_loss(tmp_path):
    from flax import nnx

    from jax_sparse_attn.bench import training
    from indexer_kl_oracle import indexer_kl_numpy

    out = tmp_path / "train.json"
    assert cli.main(["--train", "step,dense-kl", "--quick", "--train-kinds", "ratio4",
                     "--train-tokens", "128", "--repeats", "1", "--warmup", "0",
                     "--json", str(out)]) == 0
    step, dense = json.loads(out.read_text())["records"]
    layer = training.make_layer("ratio4", quick=True)
    params = nnx.state(layer, nnx.Param).flat_state()
    on_indexer = sum(v[...].size for path, v in params if "indexer" in path)
    assert step["indexer_params"] == on_indexer > 0
    assert step["main_params"] + on_indexer == sum(v[...].size for _, v in params)
    assert step["finite"] and step["indexer_loss"] and step["indexer_loss_value"] >= 0
    assert 0 <= step["indexer_mass"] <= 1 + 1e-6
    assert step["growth_bytes"] >= step["x_bytes"] > 0 and step["limit_bytes"] is None
    assert len(step["seconds"]["step"]) == len(step["seconds"]["forward"]) == 1
    assert step["step_over_forward"] > 0
    # XLA's account of the same step: x and r among its arguments, the gradients among its outputs.
    account = step["xla_account"]
    assert account["growth"] == (account["arguments"] - sum(
        v[...].nbytes for _, v in nnx.state(layer).flat_state()) + account["outputs"]
        + account["temp"])
    assert account["outputs"] >= step["x_bytes"] and account["temp"] > 0
    # Compiled only (steps too long to run): the account alone, against the bounds where set.
    only = tmp_path / "only.json"
    assert cli.main(["--train", "step", "--quick", "--train-kinds", "ratio4", "--train-tokens",
                     "128", "--train-compile-only", "--json", str(only)]) == 0
    (counted,) = json.loads(only.read_text())["records"]
    assert counted["compile_only"] and "growth_bytes" not in counted and "seconds" not in counted
    assert counted["xla_account"] == account
    # The dense loss's value is the float64 oracle's mean KL on the same inputs.
    a = {k: np.asarray(v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v)
         for k, v in training._dense_kl_inputs(training.QUICK_DENSE_KL_SHAPE).items()}
    kl, mass = indexer_kl_numpy(a["q"], a["kv"], a["index_q"], a["index_weights"], a["index_keys"],
                                a["positions"], a["idx"], sparse=False,
                                scale=training.QUICK_DENSE_KL_SHAPE.D ** -0.5)
    np.testing.assert_allclose(dense["loss"], kl.mean(), rtol=1e-4)
    np.testing.assert_allclose(dense["mass"], mass.mean(), rtol=1e-4)
    assert dense["flops"] == training.dense_kl_flops(training.QUICK_DENSE_KL_SHAPE)
    assert dense["growth_bytes"] >= dense["growth_without_inputs_bytes"] > 0
    assert dense["fraction_of_gemm_f32"] > 0 and dense["finite"]
