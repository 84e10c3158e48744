"""V32Attention against the float64 oracle of DeepSeek's V3.2 layer (tests/deepseek_v32_oracle.py).

The oracle follows DeepSeek-V3.2-Exp's inference code in float64 (the FP8 simulations included, as
they are the model). In f32 (``dtype=float32``, ``round_bf16=False``) the layer agrees with it to f32
rounding; in bf16 to bf16 rounding, where a rounding that lands on the other side of an FP8 step
moves single elements by one of their steps. The selection may differ from the oracle's only among
near-tied indexer scores: tokens whose k-th and (k+1)-th best scores lie within ``TIE_MARGIN`` are
left out of the comparison (the oracle reports each token's margin), and the tests check that few
are.
"""

import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

flax = pytest.importorskip("flax")
from flax import nnx  # noqa: E402

import deepseek_v32_oracle as oracle  # noqa: E402
from jax_sparse_attn.deepseek import (V32_EXP, V32Attention, V32Cache, V32Config,  # noqa: E402
                                      read_attention_weights, write_checkpoint)

CONFIG = oracle.tiny_v32_config()  # index_topk 8: tokens 0..7 read every row, later ones 8 rows
TIE_MARGIN = 1e-4


def make_layer(dtype=jnp.float32, cache_dtype="float32", seed=0, fp8=True, **overrides):
    cfg = dict(CONFIG, **overrides)
    weights = oracle.random_v32_weights(cfg, np.random.default_rng(seed), fp8=fp8)
    layer = V32Attention(V32Config.from_dict(cfg), dtype=dtype, cache_dtype=cache_dtype)
    layer.load_weights(weights)
    return layer, weights, cfg


# Jitted calls: a layer compiles faster as one program than op by op.
_whole = nnx.jit(lambda layer, x: layer(x))
_with_cache = nnx.jit(lambda layer, x, cache, num_tokens=None: layer(x, cache, num_tokens=num_tokens))


def tokens(n, seed=1):
    return np.random.default_rng(seed).standard_normal((n, CONFIG["dim"]))


def assert_close_per_token(y, want, aux, rel, *, margin=TIE_MARGIN):
    """Every token's worst element within ``rel`` of that token's largest output (tokens with a
    selection tied within ``margin`` set aside); returns how many were set aside."""
    y, want = np.asarray(y, np.float64), np.asarray(want, np.float64)
    keep = np.asarray(aux["index_margin"]) > margin
    err = np.abs(y - want).max(-1) / np.abs(want).max(-1)
    assert np.all(err[keep] <= rel), (np.flatnonzero(err > rel), err.max())
    return int((~keep).sum())


def test_matches_the_oracle_in_f32():
    layer, weights, cfg = make_layer()
    x = tokens(24)
    y = _whole(layer, jnp.asarray(x[None], jnp.float32))[0]
    want, aux = oracle.v32_attention_f64(x, weights, cfg, round_bf16=False)
    assert [len(r) for r in aux["selected"]] == list(range(1, 9)) + [8] * 16
    assert assert_close_per_token(y, want, aux, 2e-6) <= 2


def test_matches_the_oracle_in_bf16_with_the_fp8_cache():
    layer, weights, cfg = make_layer(jnp.bfloat16, "fp8")
    x = tokens(24)
    y = np.asarray(_whole(layer, jnp.asarray(x[None], jnp.bfloat16))[0], np.float64)
    want, aux = oracle.v32_attention_f64(x, weights, cfg, round_bf16=True)
    # bf16: single elements move by an FP8 step where a rounding crosses one; the bulk within a
    # few bf16 ulps. A bf16 rounding may also reorder index scores within a few 1e-3.
    assert assert_close_per_token(y, want, aux, 0.04, margin=1e-2) <= 4
    assert np.median(np.abs(y - want)) <= 1e-3 * np.abs(want).max()


def test_the_rows_each_token_reads_are_the_indexers():
    layer, weights, cfg = make_layer()
    x = tokens(24)
    rows = np.asarray(nnx.jit(lambda layer, x: layer.selected_rows(x))(layer, jnp.asarray(x[None], jnp.float32))[0])
    _, aux = oracle.v32_attention_f64(x, weights, cfg, round_bf16=False)
    assert rows.shape == (24, cfg["index_topk"])
    for p, (want, margin) in enumerate(zip(aux["selected"], aux["index_margin"])):
        assert np.all(rows[p, len(want):] == -1)  # min(index_topk, p + 1) rows
        if margin > TIE_MARGIN:  # best first, as DeepSeek's top-k orders them
            np.testing.assert_array_equal(rows[p, : len(want)], want, err_msg=f"token {p}")


def test_short_contexts_read_every_row_whatever_the_indexer_says():
    layer, weights, cfg = make_layer()
    x = jnp.asarray(tokens(24)[None], jnp.float32)
    before = np.asarray(_whole(layer, x)[0])
    # other indexer weights: tokens 0..7 (at most index_topk rows before them) read every row
    # anyway, the later ones read other rows
    scrambled = oracle.random_v32_weights(cfg, np.random.default_rng(7))
    layer.load_weights(dict(weights, **{k: v for k, v in scrambled.items() if k.startswith("indexer.")}))
    after = np.asarray(_whole(layer, x)[0])
    np.testing.assert_array_equal(after[:8], before[:8])
    assert np.all(np.abs(after[8:] - before[8:]).max(-1) > 1e-3)


def run_in_calls(layer, x, sizes, max_len=32):
    """``x [B, S, dim]`` through ``layer`` in calls of ``sizes`` tokens each, from a fresh cache."""
    cache = layer.init_cache(x.shape[0], max_len)
    ys, start = [], 0
    for n in sizes:
        y, cache = _with_cache(layer, x[:, start:start + n], cache)
        ys.append(y)
        start += n
    assert int(cache.length[0]) == start
    return jnp.concatenate(ys, axis=1), cache


@pytest.mark.slow
def test_chunked_prefill_and_decode_equal_one_call():
    layer, weights, cfg = make_layer()
    x = tokens(24)
    want, aux = oracle.v32_attention_f64(x, weights, cfg, round_bf16=False)
    whole = _whole(layer, jnp.asarray(x[None], jnp.float32))[0]
    # a prefill in two chunks (the second crosses index_topk), then decode steps
    got, _ = run_in_calls(layer, jnp.asarray(x[None], jnp.float32), [8, 8] + [1] * 8)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(whole), rtol=0, atol=2e-6 * np.abs(whole).max())
    assert_close_per_token(got[0], want, aux, 2e-6)


@pytest.mark.slow
def test_long_calls_run_in_token_chunks(monkeypatch):
    from jax_sparse_attn.deepseek import v32

    layer, _, _ = make_layer()
    x = jnp.asarray(tokens(29)[None], jnp.float32)
    whole = _whole(layer, x)
    monkeypatch.setattr(v32, "TOKEN_CHUNK", 8)  # 4 chunks, the last one overlapping the third
    chunked = nnx.jit(lambda layer, x: layer(x))(layer, x)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), rtol=0,
                               atol=1e-6 * np.abs(np.asarray(whole)).max())


@pytest.mark.slow
def test_a_batch_at_different_lengths():
    layer, weights, cfg = make_layer()
    a, b = tokens(22, seed=2), tokens(14, seed=3)
    x = np.zeros((2, 17, CONFIG["dim"]))
    x[0], x[1, :9] = a[:17], b[:9]
    cache = layer.init_cache(2, 32)
    y, cache = _with_cache(layer, jnp.asarray(x, jnp.float32), cache, jnp.array([17, 9]))
    assert np.all(np.asarray(y[1, 9:]) == 0)  # padding gives zeros
    got = {0: [y[0]], 1: [y[1, :9]]}
    # decode: sequence 0 at positions 17.., sequence 1 at 9.. (sitting out one step)
    pos_b = 9
    for pos_a, nb in zip(range(17, 22), [1, 0, 1, 1, 1]):
        xb = b[pos_b] if nb else np.full(CONFIG["dim"], np.nan)  # a padded token's input is never read
        y, cache = _with_cache(layer, jnp.asarray(np.stack([a[pos_a], xb])[:, None], jnp.float32),
                               cache, jnp.array([1, nb]))
        got[0].append(y[0])
        if nb:
            got[1].append(y[1])
            pos_b += 1
        else:
            assert np.all(np.asarray(y[1]) == 0)
    assert list(np.asarray(cache.length)) == [22, 13]
    for seq, full in ((0, a), (1, b[:13])):
        want, aux = oracle.v32_attention_f64(full, weights, cfg, round_bf16=False)
        assert_close_per_token(jnp.concatenate(got[seq]), want, aux, 2e-6)


def _garbage(a, rng):
    """``a`` with random bits: NaN and inf patterns included for float storage."""
    if a.dtype == jnp.float32:
        bits = rng.integers(0, 2**32, a.shape, dtype=np.uint64).astype(np.uint32)
        return jnp.asarray(bits.view(np.float32))
    return jnp.asarray(rng.integers(0, np.iinfo(a.dtype).max, a.shape, dtype=np.uint64).astype(a.dtype))


@pytest.mark.parametrize("cache_dtype", [pytest.param("fp8", marks=pytest.mark.slow), "float32"])
def test_unwritten_rows_never_change_an_output(cache_dtype):
    layer, _, _ = make_layer(cache_dtype=cache_dtype)
    x = jnp.asarray(tokens(8)[None], jnp.float32)
    clean, clean_cache = _with_cache(layer, x, layer.init_cache(1, 32))
    # Every row is unwritten before the first call: random bits, NaN and inf included.
    rng = np.random.default_rng(5)
    dirty = jax.tree.map(lambda a: a if a.dtype == jnp.int32 else _garbage(a, rng), layer.init_cache(1, 32))
    got, got_cache = _with_cache(layer, x, dirty)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(clean))
    # and a decode step, whose later rows still hold garbage
    x2 = jnp.asarray(tokens(1, seed=9)[None], jnp.float32)
    np.testing.assert_array_equal(np.asarray(_with_cache(layer, x2, got_cache)[0]),
                                  np.asarray(_with_cache(layer, x2, clean_cache)[0]))


def test_the_fp8_cache_holds_deepseeks_rows():
    layer, weights, cfg = make_layer(cache_dtype="fp8")
    x = tokens(9)
    _, cache = run_in_calls(layer, jnp.asarray(x[None], jnp.float32), [8, 1])  # a prefill, a decode step
    _, aux = oracle.v32_attention_f64(x, weights, cfg, round_bf16=False)
    L, rd, n = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], 9
    rows = cache.latent.floats()
    # FlashMLA's layout: e4m3 latent, an f32 scale per 128 columns, bf16 rope columns
    assert rows.values.dtype == jnp.float8_e4m3fn and rows.values.shape == (1, 32, L)
    assert rows.scale.shape == (1, 32, L // 128) and rows.rope.dtype == jnp.bfloat16
    bytes_per_row = L + 4 * (L // 128) + 2 * rd
    assert sum(a.nbytes for a in cache.latent) == 32 * bytes_per_row
    scale = np.asarray(rows.scale[0, :n])
    assert np.all(np.log2(scale) == np.round(np.log2(scale)))  # powers of two (ue8m0)
    np.testing.assert_array_equal(np.asarray(rows.values[0, :n], np.float64), aux["latent_fp8"])
    np.testing.assert_array_equal(scale, aux["latent_scale"])
    np.testing.assert_allclose(np.asarray(rows.rope[0, :n], np.float64), aux["rope_key"], rtol=2**-8,
                               atol=1e-6)
    # the indexer's keys: e4m3 and one f32 scale a row (132 bytes at V3.2's 128 columns)
    keys = np.asarray(cache.index_keys[0, :n]).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    assert cache.index_keys.dtype == jnp.uint8 and cache.index_scale.dtype == jnp.float32
    np.testing.assert_array_equal(keys, aux["index_keys"])
    np.testing.assert_array_equal(np.asarray(cache.index_scale[0, :n]), aux["index_key_scale"])


@pytest.mark.slow
def test_a_donated_decode_step_writes_in_place():
    layer, _, _ = make_layer(jnp.bfloat16, "fp8")
    x = jnp.asarray(tokens(12)[None], jnp.bfloat16)
    _, cache = _with_cache(layer, x[:, :11], layer.init_cache(1, 32))
    want, want_cache = _with_cache(layer, x[:, 11:], cache)
    step = nnx.jit(lambda m, x, c: m(x, c), donate_argnums=2)
    old = cache.latent.values
    got, got_cache = step(layer, x[:, 11:], cache)
    assert old.is_deleted()  # the cache was donated
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_yarn_switches_on_past_original_seq_len():
    # max_seq_len <= original_seq_len: plain RoPE frequencies and the plain softmax scale
    layer, weights, cfg = make_layer(max_seq_len=64)
    assert not layer.config.yarn and layer.config.softmax_scale == 128 ** -0.5
    x = tokens(24)
    y = _whole(layer, jnp.asarray(x[None], jnp.float32))[0]
    want, aux = oracle.v32_attention_f64(x, weights, cfg, round_bf16=False)
    assert_close_per_token(y, want, aux, 2e-6)
    yarn, _ = oracle.v32_attention_f64(x, weights, dict(cfg, max_seq_len=65), round_bf16=False)
    assert np.abs(yarn - want).max() > 0.05 * np.abs(want).max()  # the switch matters
    on = V32Config.from_dict(dict(cfg, max_seq_len=65))
    assert on.yarn and math.isclose(on.softmax_scale, 128 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)


@pytest.mark.slow
def test_bf16_weights_are_plain_products():
    layer, weights, cfg = make_layer(fp8=False)
    assert layer.wq_a.scale is None and layer.wq_a.weight[...].dtype == jnp.bfloat16
    x = tokens(24)
    y = _whole(layer, jnp.asarray(x[None], jnp.float32))[0]
    want, aux = oracle.v32_attention_f64(x, weights, cfg, round_bf16=False)
    assert_close_per_token(y, want, aux, 2e-6)


def test_the_program_runs_on_the_ops_and_nothing_dense():
    layer, _, _ = make_layer()
    T, R = 9, 61  # shapes no other axis has: an array with both would be a dense [T, R] one
    jaxpr = jax.make_jaxpr(lambda x, c: layer(x, c))(jnp.zeros((1, T, CONFIG["dim"]), jnp.float32),
                                                     layer.init_cache(1, R))
    ops = ("indexer_topk", "gathered_attn_idx")

    def equations(jx):
        """Every equation, those of nested programs (loops, vmapped calls) included."""
        for eqn in jx.eqns:
            yield eqn
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        yield from equations(sub)

    eqns = list(equations(jaxpr.jaxpr))
    for op in ops:
        assert any(e.primitive.name == op for e in eqns), op
    assert not any(e.primitive.name == "compress_pool" for e in eqns)
    # outside the two ops (whose memory is their own contract), no array of T x R elements
    dense = [(e.primitive.name, v.aval.shape) for e in eqns if e.primitive.name not in ops
             for v in e.outvars if T in getattr(v.aval, "shape", ()) and R in getattr(v.aval, "shape", ())]
    assert not dense, dense


def test_load_weights_checks_names_shapes_and_dtypes():
    layer, weights, _ = make_layer()
    x = jnp.asarray(tokens(24)[None], jnp.float32)
    before = np.asarray(_whole(layer, x))
    for broken, message in [
        ({k: v for k, v in weights.items() if k != "indexer.k_norm.bias"}, "indexer.k_norm.bias"),
        (dict(weights, **{"indexer.bias": np.zeros(3)}), "indexer.bias"),
        (dict(weights, **{"wkv_b.weight": weights["wkv_b.weight"][:-1]}), "wkv_b.weight"),
        ({k: v for k, v in weights.items() if k != "wq_b.scale"}, "wq_b.scale"),
        (dict(weights, **{"wo.scale": np.ones((9, 9), np.float32)}), "wo.scale"),
        (dict(weights, **{"kv_norm.weight": np.zeros(5, np.float32)}), "kv_norm.weight"),
        (dict(weights, **{"q_norm.weight": np.zeros(CONFIG["q_lora_rank"], np.int32)}), "q_norm.weight"),
        (dict(weights, **{"q_a_proj.weight": weights["wq_a.weight"]}), "q_a_proj.weight"),  # twice
    ]:
        with pytest.raises((ValueError, TypeError), match=message.replace(".", r"\.")):
            layer.load_weights(broken)
    np.testing.assert_array_equal(np.asarray(_whole(layer, x)), before)  # a refused load changes nothing
    # the released (Hugging Face) names
    layer.load_weights(oracle.released_names(weights))
    np.testing.assert_array_equal(np.asarray(_whole(layer, x)), before)
    assert layer.wq_a.weight[...].dtype == jnp.float8_e4m3fn  # FP8 stays FP8
    assert layer.wq_a.scale[...].dtype == jnp.float32


def test_reads_a_released_checkpoint(tmp_path):
    layer, weights, _ = make_layer()
    # the released layout: Hugging Face names under "model.layers.{i}.self_attn.", weight_scale_inv,
    # norms and weights_proj in bf16, beside another layer's tensors
    released = {f"model.layers.3.self_attn.{k}": (v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32
                                                 and "scale" not in k else v)
                for k, v in oracle.released_names(weights).items()}
    released["model.layers.4.self_attn.q_a_proj.weight"] = np.zeros((2, 2), np.float32)
    write_checkpoint(tmp_path, released, max_shard_bytes=100_000)
    tensors = read_attention_weights(tmp_path, 3)
    assert "kv_b_proj.weight_scale_inv" in tensors and "indexer.wk.weight_scale_inv" in tensors
    fresh = V32Attention(V32Config.from_dict(CONFIG), dtype=jnp.float32, cache_dtype="float32",
                         rngs=nnx.Rngs(3))
    fresh.load_weights(tensors)
    got = fresh.export_weights()
    assert set(got) == set(weights) and set(fresh.weight_shapes()) == {k for k in weights if "scale" not in k}
    for name, value in weights.items():
        want = np.asarray(value).astype(np.float64)
        if name.endswith("norm.weight") or name.endswith("norm.bias"):
            want = want.astype(ml_dtypes.bfloat16).astype(np.float64)  # stored in bf16
        np.testing.assert_array_equal(np.asarray(got[name]).astype(np.float64), want, err_msg=name)
    assert got["wkv_b.weight"].dtype == ml_dtypes.float8_e4m3fn and got["wkv_b.scale"].dtype == np.float32


def test_config_from_deepseeks_json(tmp_path):
    # DeepSeek-V3.2-Exp's inference/config_671B_v3.2.json
    released = {"vocab_size": 129280, "dim": 7168, "inter_dim": 18432, "moe_inter_dim": 2048,
                "n_layers": 61, "n_dense_layers": 3, "n_heads": 128, "n_routed_experts": 256,
                "n_shared_experts": 1, "n_activated_experts": 8, "n_expert_groups": 8,
                "n_limited_groups": 4, "route_scale": 2.5, "score_func": "sigmoid", "q_lora_rank": 1536,
                "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                "dtype": "fp8", "scale_fmt": "ue8m0", "index_n_heads": 64, "index_head_dim": 128,
                "index_topk": 2048}
    (tmp_path / "config_671B_v3.2.json").write_text(json.dumps(released))
    config = V32Config.from_json(tmp_path / "config_671B_v3.2.json")
    assert config == V32_EXP
    # ModelArgs' runtime default max_seq_len 16384 > original_seq_len 4096: YaRN on
    assert config.yarn and math.isclose(config.softmax_scale, 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert not V32Config.from_json(tmp_path / "config_671B_v3.2.json", max_seq_len=4096).yarn
    with pytest.raises(TypeError, match="no_such_field"):
        V32Config.from_json(tmp_path / "config_671B_v3.2.json", no_such_field=1)
    with pytest.raises(ValueError, match="q_lora_rank"):
        V32Attention(V32Config())  # ModelArgs' default q_lora_rank is 0
    with pytest.raises(ValueError, match="kv_lora_rank"):
        V32Attention(V32_EXP.replace(kv_lora_rank=500))
    with pytest.raises(ValueError, match="index_head_dim"):
        V32Attention(V32_EXP.replace(index_head_dim=64))


def test_bad_calls_name_the_argument():
    layer, _, _ = make_layer()
    cache = layer.init_cache(2, 8)
    assert isinstance(cache, V32Cache)
    for call, message in [
        (lambda: layer(jnp.zeros((2, 3, 5))), "x must have shape"),
        (lambda: layer(jnp.zeros((2, 3, CONFIG["dim"]), jnp.int32)), "x must be a float"),
        (lambda: layer(jnp.zeros((1, 3, CONFIG["dim"])), cache), "cache is for 2"),
        (lambda: layer(jnp.zeros((2, 3, CONFIG["dim"])), cache, num_tokens=jnp.ones(3, jnp.int32)),
         "num_tokens"),
        (lambda: layer(jnp.zeros((2, 3, CONFIG["dim"])), num_tokens=jnp.ones(2, jnp.int32)), "num_tokens"),
        (lambda: layer(jnp.zeros((2, 3, CONFIG["dim"])), make_layer(cache_dtype="fp8")[0].init_cache(2, 8)),
         "cache_dtype"),
        (lambda: layer.init_cache(0, 8), "batch_size"),
        (lambda: V32Attention(V32Config.from_dict(CONFIG), dtype=jnp.float16), "dtype"),
    ]:
        with pytest.raises((ValueError, TypeError), match=message):
            call()


def test_fp8_values_round_once_to_nearest_even():
    # every e4m3 value, the midpoints between neighbours (ties go to the even one) and just off
    # them: fp8_quantize (scale 1) must match ml_dtypes' single rounding on every JAX version
    from jax_sparse_attn.deepseek import quant

    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.sort(grid[np.isfinite(grid)])
    mid = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    x = np.concatenate([grid, mid, np.nextafter(mid, np.float32(1e9)), np.nextafter(mid, np.float32(-1e9))])
    body = np.zeros((-(-x.size // 127), 127), np.float32)
    body.reshape(-1)[: x.size] = x
    blocks = np.concatenate([np.full((len(body), 1), 448.0, np.float32), body], 1)  # amax 448: scale 1
    values, scale = jax.jit(lambda b: quant.fp8_quantize(b, 128))(jnp.asarray(blocks))
    assert np.all(np.asarray(scale) == 1.0)
    np.testing.assert_array_equal(np.asarray(values)[:, 1:].reshape(-1)[: x.size].astype(np.float32),
                                  x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


@pytest.mark.slow
def test_the_docs_walk_through_runs():
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "deepseek.md").read_text()
    (code,) = [c for c in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "V32Attention" in c]
    ns = {"__name__": "docs_walk_through"}
    exec(compile(code, "docs/deepseek.md", "exec"), ns)
    whole = np.asarray(nnx.jit(lambda m, x: m(x))(ns["layer"], ns["x"]), np.float32)[0]
    parts = np.concatenate([np.asarray(ns["y_prompt"], np.float32)[0]]
                           + [np.asarray(y, np.float32)[0] for y in ns["decoded"]])
    assert np.abs(parts - whole).max() <= 0.02 * np.abs(whole).max()  # bf16: one program or several
    rows = ns["rows"]
    assert rows.shape == (40, 16) and all(np.all(r[r >= 0] <= t) for t, r in enumerate(rows))
