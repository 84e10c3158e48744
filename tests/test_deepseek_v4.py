"""V4Attention against the float64 oracle of DeepSeek's V4 layer (tests/deepseek_v4_oracle.py).

The oracle follows DeepSeek's inference code in float64 (the FP8 / FP4 simulations included, as
they are the model). In f32 (``dtype=float32``, ``round_bf16=False``) the layer agrees with it to
f32 rounding; in bf16 to bf16 rounding, where a rounding that lands on the other side of an FP8 or
FP4 step moves single elements by one of their steps. A ratio-4 layer's selection may differ
from the oracle's only among near-tied indexer scores: tokens whose k-th and (k+1)-th best scores
lie within ``TIE_MARGIN`` are left out of the comparison (the oracle reports each token's margin),
and the tests check that few are.
"""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

flax = pytest.importorskip("flax")
from flax import nnx  # noqa: E402

import deepseek_v4_oracle as oracle  # noqa: E402
from jax_sparse_attn.deepseek import (V4_FLASH, V4Attention, V4Config, read_attention_weights,  # noqa: E402
                                      write_checkpoint)

CONFIG = oracle.tiny_v4_config()  # layers: ratio 0, 4 (indexer), 8 (every block)
LAYERS = {"window": 0, "indexed": 1, "every-block": 2}
TIE_MARGIN = 1e-4


def make_layer(layer_id, dtype=jnp.float32, cache_dtype="float32", seed=None, fp8=True):
    weights = oracle.random_v4_weights(CONFIG, layer_id, np.random.default_rng(
        layer_id if seed is None else seed), fp8=fp8)
    layer = V4Attention(V4Config.from_dict(CONFIG), layer_id, dtype=dtype, cache_dtype=cache_dtype)
    layer.load_weights(weights)
    return layer, weights


# Jitted calls: a V4 layer compiles faster as one program than op by op.
_whole = nnx.jit(lambda layer, x: layer(x))
_with_cache = nnx.jit(lambda layer, x, cache, num_tokens=None: layer(x, cache, num_tokens=num_tokens))


def tokens(n, seed=1):
    return np.random.default_rng(seed).standard_normal((n, CONFIG["dim"]))


def assert_close_per_token(y, want, aux, rel, *, skip_ties=True):
    """Every token's worst element within ``rel`` of that token's largest output (tokens with a
    near-tied selection set aside); returns how many were set aside."""
    y, want = np.asarray(y, np.float64), np.asarray(want, np.float64)
    keep = np.ones(len(want), bool)
    if skip_ties and aux["index_margin"] is not None:
        keep = np.asarray(aux["index_margin"]) > TIE_MARGIN
    err = np.abs(y - want).max(-1) / np.abs(want).max(-1)
    assert np.all(err[keep] <= rel), (np.flatnonzero(err > rel), err.max())
    return int((~keep).sum())


@pytest.mark.parametrize("kind", LAYERS)
def test_matches_the_oracle_in_f32(kind):
    layer, weights = make_layer(LAYERS[kind])
    x = tokens(37)  # 4 windows and a partial compressed block past the last complete one
    y = _whole(layer, jnp.asarray(x[None], jnp.float32))[0]
    want, aux = oracle.v4_attention_f64(x, weights, CONFIG, LAYERS[kind], round_bf16=False)
    ties = assert_close_per_token(y, want, aux, 2e-6)
    assert ties <= 2


def test_a_sequence_shorter_than_the_window_and_a_block():
    # 3 tokens: a window of 8 holds them all, no compressed block is complete, and the
    # compressor's previous block is block -1 (kv 0, score -inf).
    layer, weights = make_layer(LAYERS["indexed"])
    x = tokens(3, seed=4)
    y = _whole(layer, jnp.asarray(x[None], jnp.float32))[0]
    want, aux = oracle.v4_attention_f64(x, weights, CONFIG, LAYERS["indexed"], round_bf16=False)
    assert_close_per_token(y, want, aux, 2e-6)


@pytest.mark.slow
def test_bf16_weights_match_the_oracle():
    layer, weights = make_layer(LAYERS["indexed"], fp8=False)
    assert layer.wq_b.scale is None
    x = tokens(21)
    y = _whole(layer, jnp.asarray(x[None], jnp.float32))[0]
    want, aux = oracle.v4_attention_f64(x, weights, CONFIG, LAYERS["indexed"], round_bf16=False)
    assert_close_per_token(y, want, aux, 2e-6)


@pytest.mark.parametrize("kind", [pytest.param("window", marks=pytest.mark.slow), "indexed",
                                  pytest.param("every-block", marks=pytest.mark.slow)])
def test_matches_the_oracle_in_bf16_with_the_fp8_cache(kind):
    layer, weights = make_layer(LAYERS[kind], jnp.bfloat16, "fp8")
    x = tokens(37)
    y = np.asarray(_whole(layer, jnp.asarray(x[None], jnp.bfloat16))[0], np.float64)
    want, aux = oracle.v4_attention_f64(x, weights, CONFIG, LAYERS[kind], round_bf16=True)
    # bf16: single elements move by an FP8 step where a rounding crosses one; the bulk within a
    # few bf16 ulps.
    assert_close_per_token(y, want, aux, 0.06)
    assert np.median(np.abs(y - want)) <= 4e-3 * np.abs(want).max()


def run_in_calls(layer, x, sizes, max_len=64):
    """``x [B, S, dim]`` through ``layer`` in calls of ``sizes`` tokens each, from a fresh cache."""
    cache = layer.init_cache(x.shape[0], max_len)
    ys, start = [], 0
    for n in sizes:
        y, cache = _with_cache(layer, x[:, start:start + n], cache)
        ys.append(y)
        start += n
    assert int(cache.length[0]) == start
    return jnp.concatenate(ys, axis=1), cache


@pytest.mark.parametrize("kind", [pytest.param("indexed", marks=pytest.mark.slow),
                                  pytest.param("window", marks=pytest.mark.slow),
                                  pytest.param("every-block", marks=pytest.mark.slow)])
def test_chunked_prefill_and_decode_equal_one_call(kind):
    layer, weights = make_layer(LAYERS[kind])
    x = tokens(29)
    want, aux = oracle.v4_attention_f64(x, weights, CONFIG, LAYERS[kind], round_bf16=False)
    whole = _whole(layer, jnp.asarray(x[None], jnp.float32))[0]
    # chunks that start and end inside compressed blocks and windows, then decode steps
    got, _ = run_in_calls(layer, jnp.asarray(x[None], jnp.float32), [5, 11, 1, 6, 1, 1, 1, 1, 1, 1])
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(whole), rtol=0, atol=2e-6 * np.abs(whole).max())
    assert_close_per_token(got[0], want, aux, 2e-6)


@pytest.mark.slow
def test_long_calls_run_in_token_chunks(monkeypatch):
    from jax_sparse_attn.deepseek import v4

    layer, weights = make_layer(LAYERS["indexed"])
    x = jnp.asarray(tokens(29)[None], jnp.float32)
    whole = _whole(layer, x)
    monkeypatch.setattr(v4, "TOKEN_CHUNK", 8)  # 4 chunks, the last one overlapping the third
    chunked = nnx.jit(lambda layer, x: layer(x))(layer, x)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), rtol=0,
                               atol=1e-6 * np.abs(np.asarray(whole)).max())


@pytest.mark.slow  # V3.2's twin runs by default
def test_a_batch_at_different_lengths():
    layer, weights = make_layer(LAYERS["indexed"])
    a, b = tokens(23, seed=2), tokens(14, seed=3)
    x = np.zeros((2, 17, CONFIG["dim"]))
    x[0], x[1, :9] = a[:17], b[:9]
    cache = layer.init_cache(2, 40)
    y, cache = _with_cache(layer, jnp.asarray(x, jnp.float32), cache, jnp.array([17, 9]))
    assert np.all(np.asarray(y[1, 9:]) == 0)  # padding gives zeros
    got = {0: [y[0]], 1: [y[1, :9]]}
    # decode: sequence 0 at positions 17.., sequence 1 at 9.. (sitting out one step)
    pos_b = 9
    for pos_a, nb in zip(range(17, 23), [1, 0, 1, 1, 1, 1]):
        xb = b[pos_b] if nb else np.full(CONFIG["dim"], np.nan)  # a padded token's input is never read
        y, cache = _with_cache(layer, jnp.asarray(np.stack([a[pos_a], xb])[:, None], jnp.float32),
                               cache, jnp.array([1, nb]))
        got[0].append(y[0])
        if nb:
            got[1].append(y[1])
            pos_b += 1
    assert list(np.asarray(cache.length)) == [23, 14]
    for seq, full in ((0, a), (1, b)):
        want, aux = oracle.v4_attention_f64(full, weights, CONFIG, LAYERS["indexed"], round_bf16=False)
        assert_close_per_token(jnp.concatenate(got[seq]), want, aux, 2e-6)


def _garbage(a, rng):
    """``a`` with random bits: NaN and inf patterns included for float storage."""
    if a.dtype == jnp.float32:
        bits = rng.integers(0, 2**32, a.shape, dtype=np.uint64).astype(np.uint32)
        return jnp.asarray(bits.view(np.float32))
    return jnp.asarray(rng.integers(0, np.iinfo(a.dtype).max, a.shape, dtype=np.uint64).astype(a.dtype))


@pytest.mark.slow
@pytest.mark.parametrize("cache_dtype", ["fp8", "float32"])
def test_unwritten_rows_never_change_an_output(cache_dtype):
    layer, _ = make_layer(LAYERS["indexed"], cache_dtype=cache_dtype)
    x = jnp.asarray(tokens(15)[None], jnp.float32)
    clean, clean_cache = _with_cache(layer, x, layer.init_cache(1, 48))
    rng = np.random.default_rng(5)
    cache = layer.init_cache(1, 48)
    # Every row that no token of this call may read: the window ring (empty), the compressed rows
    # and index keys (none written), and the compressors' state (nothing before position 0).
    dirty = jax.tree.map(lambda a: a if a.dtype == jnp.int32 else _garbage(a, rng), cache)
    got, got_cache = _with_cache(layer, x, dirty)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(clean))
    # and the next call, whose window and blocks now hold this call's rows only
    x2 = jnp.asarray(tokens(6, seed=9)[None], jnp.float32)
    np.testing.assert_array_equal(np.asarray(_with_cache(layer, x2, got_cache)[0]),
                                  np.asarray(_with_cache(layer, x2, clean_cache)[0]))


def test_the_fp8_cache_holds_deepseeks_rows():
    layer, weights = make_layer(LAYERS["every-block"], cache_dtype="fp8")
    x = tokens(35)
    _, cache = _with_cache(layer, jnp.asarray(x[None], jnp.float32), layer.init_cache(1, 64))
    _, aux = oracle.v4_attention_f64(x, weights, CONFIG, LAYERS["every-block"], round_bf16=False)
    rd, D = CONFIG["rope_head_dim"], CONFIG["head_dim"]
    rows = cache.compressed.floats()
    assert rows.values.dtype == jnp.float8_e4m3fn and rows.values.shape == (1, 8, D - rd)
    assert rows.scale.shape == (1, 8, (D - rd) // 64) and rows.rope.dtype == jnp.bfloat16
    n = 35 // 8
    scale = np.asarray(rows.scale[0, :n])
    assert np.all(np.log2(scale) == np.round(np.log2(scale)))  # powers of two (ue8m0)
    deq = np.asarray(rows.values[0, :n], np.float64) * np.repeat(scale, 64, axis=-1)
    np.testing.assert_array_equal(deq, aux["compressed_kv"][:n, :-rd])
    np.testing.assert_allclose(np.asarray(rows.rope[0, :n], np.float64), aux["compressed_kv"][:n, -rd:],
                               rtol=2**-8)
    # the window ring: positions 27..34 at slots p % 8
    ring = cache.window.floats()
    for p in range(27, 35):
        deq = np.asarray(ring.values[0, p % 8], np.float64) * np.repeat(np.asarray(ring.scale[0, p % 8]), 64)
        np.testing.assert_array_equal(deq, aux["kv"][p, :-rd])


@pytest.mark.slow
def test_a_donated_decode_step_writes_in_place():
    layer, _ = make_layer(LAYERS["indexed"], jnp.bfloat16, "fp8")
    x = jnp.asarray(tokens(12)[None], jnp.bfloat16)
    _, cache = _with_cache(layer, x[:, :11], layer.init_cache(1, 32))
    want, want_cache = _with_cache(layer, x[:, 11:], cache)
    step = nnx.jit(lambda m, x, c: m(x, c), donate_argnums=2)
    old = cache.compressed.values
    got, got_cache = step(layer, x[:, 11:], cache)
    assert old.is_deleted()  # the cache was donated
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_jaxpr_runs_on_the_three_ops():
    layer, _ = make_layer(LAYERS["indexed"])
    cache = layer.init_cache(1, 64)
    x = jnp.zeros((1, 9, CONFIG["dim"]), jnp.float32)
    text = str(jax.make_jaxpr(lambda x, c: layer(x, c))(x, cache))
    for op in ("compress_pool", "indexer_topk", "gathered_attn_idx"):
        assert op in text


def test_load_weights_checks_names_shapes_and_dtypes():
    layer, weights = make_layer(LAYERS["indexed"])
    x = jnp.asarray(tokens(9)[None], jnp.float32)
    before = np.asarray(_whole(layer, x))
    for broken, message in [
        ({k: v for k, v in weights.items() if k != "indexer.compressor.ape"}, "indexer.compressor.ape"),
        (dict(weights, **{"compressor.bias": np.zeros(3)}), "compressor.bias"),
        (dict(weights, **{"wq_b.weight": weights["wq_b.weight"][:-1]}), "wq_b.weight"),
        ({k: v for k, v in weights.items() if k != "wkv.scale"}, "wkv.scale"),
        (dict(weights, **{"wkv.scale": np.ones((9, 9), np.float32)}), "wkv.scale"),
        (dict(weights, **{"attn_sink": np.zeros(5, np.float32)}), "attn_sink"),
        (dict(weights, **{"q_norm.weight": np.zeros(CONFIG["q_lora_rank"], np.int32)}), "q_norm.weight"),
    ]:
        with pytest.raises((ValueError, TypeError), match=message.replace(".", r"\.")):
            layer.load_weights(broken)
    np.testing.assert_array_equal(np.asarray(_whole(layer, x)), before)  # a refused load changes nothing
    # the released spelling of the scales, and bf16 weights in place of FP8 ones
    released = {k.replace(".scale", ".weight_scale_inv"): v for k, v in weights.items()}
    layer.load_weights(released)
    np.testing.assert_array_equal(np.asarray(_whole(layer, x)), before)
    assert layer.wq_a.weight[...].dtype == jnp.float8_e4m3fn  # FP8 stays FP8
    bf16_layer, bf16_weights = make_layer(LAYERS["indexed"], fp8=False)
    assert bf16_layer.wq_a.scale is None and bf16_layer.wq_a.weight[...].dtype == jnp.bfloat16


def test_reads_a_released_checkpoint(tmp_path):
    layer_id = LAYERS["indexed"]
    layer, weights = make_layer(layer_id)
    # the released layout: "layers.{i}.attn." names, weight_scale_inv, wo_a in FP8, beside other layers
    released = {f"layers.{layer_id}.attn.{k.replace('.scale', '.weight_scale_inv')}": v
                for k, v in weights.items()}
    wo_a = np.asarray(weights["wo_a.weight"], np.float32)
    released[f"layers.{layer_id}.attn.wo_a.weight"] = wo_a.astype(ml_dtypes.float8_e4m3fn)
    released[f"layers.{layer_id}.attn.wo_a.weight_scale_inv"] = np.ones(
        (-(-wo_a.shape[0] // 128), -(-wo_a.shape[1] // 128)), ml_dtypes.float8_e8m0fnu)
    released[f"layers.{layer_id + 1}.attn.wq_a.weight"] = np.zeros((2, 2), np.float32)
    write_checkpoint(tmp_path, released, max_shard_bytes=200_000)
    tensors = read_attention_weights(tmp_path, layer_id)
    assert "wq_a.weight_scale_inv" in tensors and "wq_a.scale" not in tensors
    layer.load_weights(tensors)
    assert layer.wo_a.weight[...].dtype == jnp.bfloat16  # dequantised, as DeepSeek's convert.py does
    np.testing.assert_array_equal(
        np.asarray(layer.wo_a.weight[...], np.float32),
        np.asarray(wo_a.astype(ml_dtypes.float8_e4m3fn).astype(ml_dtypes.bfloat16), np.float32))


def test_config_from_deepseeks_json(tmp_path):
    fields = {f: getattr(V4_FLASH, f) for f in V4_FLASH.__dataclass_fields__}
    fields["compress_ratios"] = list(fields["compress_ratios"])
    # the model's other fields (MoE, hyper-connections) are not the attention's
    fields.update(vocab_size=129280, n_routed_experts=256, hc_mult=4, score_func="sqrtsoftplus")
    (tmp_path / "config.json").write_text(json.dumps(fields))
    assert V4Config.from_json(tmp_path) == V4_FLASH
    # 43 layers, and one more ratio for the multi-token-prediction layer
    assert V4_FLASH.compress_ratios[:4] == (0, 0, 4, 128) and len(V4_FLASH.compress_ratios) == 44
    with pytest.raises(TypeError, match="no_such_field"):
        V4Config.from_json(tmp_path, no_such_field=1)
    with pytest.raises(ValueError, match="layer_id"):
        V4Attention(V4_FLASH, 44)
