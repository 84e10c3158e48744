"""Gradients through V4Attention and V32Attention (docs/deepseek.md, "Gradients").

``nnx.grad`` of ``sum(layer(x) * r)`` at f32 layers with plain f32 weights, for every parameter and
for ``x``, against the same gradient of the differentiable float64 oracles
(tests/deepseek_grad_oracle.py: the numpy oracles' forwards in jax.numpy with x64, each FP8 / FP4
simulation ``x + stop_gradient(q(x) - x)``), the selections taken from the numpy oracles. The
layers run their token chunks small, so that the backward's recomputed chunks (the last one
overlapping the one before it) are exercised. Then what is refused: FP8 weights, gradients
through a cache; and what is not: the other parameters with the FP8 weights left out, ``x``
through an FP8 layer.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

flax = pytest.importorskip("flax")
from flax import nnx  # noqa: E402

import deepseek_grad_oracle as grad_oracle  # noqa: E402
import deepseek_v32_oracle as v32_oracle  # noqa: E402
import deepseek_v4_oracle as v4_oracle  # noqa: E402
from jax_sparse_attn.deepseek import V4Attention, V4Config, V32Attention, V32Config, v4, v32  # noqa: E402
from jax_sparse_attn.deepseek.layers import NotDifferentiableError, is_fp8_weight  # noqa: E402

V4_CONFIG = v4_oracle.tiny_v4_config(compress_ratios=[0, 4, 128])
V32_CONFIG = v32_oracle.tiny_v32_config()
# Each parameter's (and x's) gradient within REL of its largest element: f32 against float64.
REL = 1e-4
# Tokens per chunk in these tests: several chunks per call, the last overlapping the one before.
CHUNK = 16
# A selection whose k-th and (k+1)-th scores lie this close may differ between f32 and float64.
TIE_MARGIN = 1e-4


def enable_x64():
    if hasattr(jax, "enable_x64"):  # jax >= 0.8
        return jax.enable_x64(True)
    from jax.experimental import enable_x64 as context

    return context()


def f32_weights(weights):
    return {name: np.asarray(w).astype(np.float32) for name, w in weights.items()}


def flat(state) -> dict:
    """An nnx State as ``{DeepSeek name: numpy array}``."""
    return {".".join(str(k) for k in path): np.asarray(v[...])
            for path, v in nnx.to_flat_state(state)}


def loss(layer, x, r):
    return jnp.sum(layer(x).astype(jnp.float32) * r)


_gradients = nnx.jit(nnx.grad(loss, argnums=(0, 1)))


def layer_gradients(layer, x, r):
    g_layer, g_x = _gradients(layer, jnp.asarray(x, jnp.float32), jnp.asarray(r, jnp.float32))
    return flat(g_layer), np.asarray(g_x)


def oracle_gradients(forward, weights, x, r, selections):
    """The oracle's gradients of ``sum(y * r)`` over the sequences, by parameter name and for x."""
    with enable_x64():
        params = {name: jnp.asarray(w, jnp.float64) for name, w in weights.items()}

        def total(params, x):
            return sum(jnp.sum(forward(params, x[b], selections[b]) * r[b]) for b in range(len(x)))

        g_params, g_x = jax.grad(total, argnums=(0, 1))(params, jnp.asarray(x, jnp.float64))
        return {n: np.asarray(g) for n, g in g_params.items()}, np.asarray(g_x)


def assert_gradients_close(got, want, name):
    err = np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want))
    assert err <= REL, (name, err)


def check_against_oracle(layer, weights, forward, x, r, selections, indexer_names=()):
    got, got_x = layer_gradients(layer, x, r)
    want, want_x = oracle_gradients(forward, {n: w for n, w in weights.items()
                                              if n not in indexer_names}, x, r, selections)
    for name, g in want.items():
        assert np.max(np.abs(g)) > 0, name  # every parameter the loss reads moves it
        assert_gradients_close(got[name], g, name)
    assert_gradients_close(got_x, want_x, "x")
    # The selection is integer: the attention's loss gives the indexer exactly nothing.
    for name in indexer_names:
        assert not np.any(got[name]), name
    assert set(got) == set(want) | set(indexer_names)


def sequences(n, s, dim, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, s, dim)).astype(np.float32)
    r = rng.standard_normal((n, s, dim)).astype(np.float32)
    return x, r


def v4_case(layer_id, s, seed=5):
    weights = f32_weights(v4_oracle.random_v4_weights(V4_CONFIG, layer_id,
                                                      np.random.default_rng(seed), fp8=False))
    layer = V4Attention(V4Config.from_dict(V4_CONFIG), layer_id, dtype=jnp.float32,
                        cache_dtype="float32")
    layer.load_weights(weights)
    x, r = sequences(2, s, V4_CONFIG["dim"], seed)
    selections = []
    for b in range(len(x)):
        _, aux = v4_oracle.v4_attention_f64(x[b], weights, V4_CONFIG, layer_id, round_bf16=False)
        if aux["index_margin"] is not None:
            assert min(aux["index_margin"]) > TIE_MARGIN  # the f32 layer selects the same blocks
        selections.append(aux["selected"])
    return layer, weights, x, r, selections


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(v4, "TOKEN_CHUNK", CHUNK)
    monkeypatch.setattr(v32, "TOKEN_CHUNK", CHUNK)


def v4_indexer_names(weights):
    return tuple(n for n in weights if n.startswith("indexer."))


# The comparisons with the oracle compile a layer's backward (tens of seconds each): slow set. The
# default run traces the refusals (no compilation).
@pytest.mark.slow
@pytest.mark.parametrize("layer_id", [0, 1, 2], ids=["window", "indexed", "ratio-128"])
def test_v4_gradients_match_the_oracle(small_chunks, layer_id):
    # 40 tokens: 3 chunks of 16 (the last overlapping), 10 blocks of 4 and top 4; ratio 128:
    # 136 tokens, one complete block.
    layer, weights, x, r, selections = v4_case(layer_id, 136 if layer_id == 2 else 40)

    def forward(params, x_b, selected):
        return grad_oracle.v4_forward(params, x_b, V4_CONFIG, layer_id, selected)

    check_against_oracle(layer, weights, forward, x, r, selections, v4_indexer_names(weights))


@pytest.mark.slow
def test_v32_gradients_match_the_oracle(small_chunks):
    weights = f32_weights(v32_oracle.random_v32_weights(V32_CONFIG, np.random.default_rng(5),
                                                        fp8=False))
    layer = V32Attention(V32Config.from_dict(V32_CONFIG), dtype=jnp.float32, cache_dtype="float32")
    layer.load_weights(weights)
    x, r = sequences(2, 40, V32_CONFIG["dim"], 5)
    selections = []
    for b in range(len(x)):
        _, aux = v32_oracle.v32_attention_f64(x[b], weights, V32_CONFIG, round_bf16=False)
        assert min(aux["index_margin"]) > TIE_MARGIN
        selections.append(aux["selected"])

    def forward(params, x_b, selected):
        return grad_oracle.v32_forward(params, x_b, V32_CONFIG, selected)

    indexer = tuple(n for n in weights if n.startswith("indexer."))
    check_against_oracle(layer, weights, forward, x, r, selections, indexer)


# --- FP8 weights and caches: what is refused, and what is not ---------------------------------

def fp8_v4_layer(layer_id=1, dtype=jnp.float32, cache_dtype="float32"):
    weights = v4_oracle.random_v4_weights(V4_CONFIG, layer_id, np.random.default_rng(5))
    layer = V4Attention(V4Config.from_dict(V4_CONFIG), layer_id, dtype=dtype,
                        cache_dtype=cache_dtype)
    layer.load_weights(weights)
    return layer, weights


def fp8_v32_layer():
    weights = v32_oracle.random_v32_weights(V32_CONFIG, np.random.default_rng(6))
    layer = V32Attention(V32Config.from_dict(V32_CONFIG), dtype=jnp.float32, cache_dtype="float32")
    layer.load_weights(weights)
    return layer, weights


def only(*names):
    """An nnx filter: the Params at these DeepSeek names."""
    return nnx.All(nnx.Param, lambda path, _: ".".join(map(str, path)) in names)


NOT_FP8 = nnx.All(nnx.Param, nnx.Not(is_fp8_weight))


def traced_gradient(fn, wrt, layer, *args):
    """Traces ``nnx.grad(fn)`` over the Params ``wrt`` (no compilation): what it refuses raises."""
    return nnx.eval_shape(nnx.grad(fn, argnums=nnx.DiffState(0, wrt)), layer, *args)


SLOW = pytest.mark.slow


@pytest.mark.parametrize("make, wrt, name", [
    (fp8_v4_layer, nnx.Param, "wq_a.weight"),
    (fp8_v4_layer, only("wkv.scale"), "wkv.scale"),
    pytest.param(fp8_v4_layer, only("indexer.wq_b.weight"), "indexer.wq_b.weight", marks=SLOW),
    pytest.param(fp8_v32_layer, only("wkv_b.weight"), "wkv_b.weight", marks=SLOW),
    pytest.param(fp8_v32_layer, only("wo.scale"), "wo.scale", marks=SLOW),
], ids=["v4-all", "v4-scale", "v4-indexer", "v32-wkv_b", "v32-scale"])
def test_a_gradient_of_an_fp8_weight_raises_naming_it(make, wrt, name):
    layer, _ = make()
    x, r = sequences(1, 12, layer.config.dim, 0)
    with pytest.raises(NotDifferentiableError, match=f"no gradient for {name}: FP8 weights are not"):
        traced_gradient(loss, wrt, layer, jnp.asarray(x), jnp.asarray(r))


@pytest.mark.slow
@pytest.mark.parametrize("make", [fp8_v4_layer, fp8_v32_layer], ids=["v4", "v32"])
def test_the_other_parameters_of_an_fp8_layer_are_differentiable(make):
    layer, _ = make()
    x, r = sequences(1, 12, layer.config.dim, 0)
    grads = traced_gradient(loss, NOT_FP8, layer, jnp.asarray(x), jnp.asarray(r))
    names = set(flat_shapes(grads))
    assert names and not any(n.endswith(".scale") for n in names)
    assert "q_norm.weight" in names and "wq_a.weight" not in names
    jax.eval_shape(jax.grad(lambda x: loss(layer, x, jnp.asarray(r))), jnp.asarray(x))  # x alone


def flat_shapes(state) -> dict:
    return {".".join(str(k) for k in path): v for path, v in nnx.to_flat_state(state)}


@pytest.mark.parametrize("make, wrt, what", [
    (fp8_v4_layer, only("kv_norm.weight"), "the KV rows"),
    pytest.param(fp8_v4_layer, only("compressor.ape"), "the compressed rows", marks=SLOW),
    pytest.param(fp8_v4_layer, only("indexer.compressor.norm.weight"), "the indexer's keys",
                 marks=SLOW),
    pytest.param(fp8_v32_layer, only("kv_norm.weight"), "the rows", marks=SLOW),
], ids=["v4-window", "v4-compressed", "v4-index-keys", "v32"])
def test_a_gradient_through_a_cache_raises(make, wrt, what):
    layer, _ = make()
    x, r = sequences(1, 12, layer.config.dim, 0)

    def cached_loss(layer, x, r):
        y, _ = layer(x, layer.init_cache(1, 16))
        return jnp.sum(y * r)

    with pytest.raises(NotDifferentiableError, match=f"no gradient for {what}.*cached call"):
        traced_gradient(cached_loss, wrt, layer, jnp.asarray(x), jnp.asarray(r))
    with pytest.raises(NotDifferentiableError, match="no gradient for the .*cached call"):
        jax.eval_shape(jax.grad(lambda x: cached_loss(layer, x, jnp.asarray(r))), jnp.asarray(x))
    # The query path does not go through the cache.
    traced_gradient(cached_loss, only("q_norm.weight"), layer, jnp.asarray(x), jnp.asarray(r))


def test_dequantize_weights_gives_convert_py_weights_that_train():
    layer, weights = fp8_v4_layer()
    layer.dequantize_weights(jnp.float32)
    got = layer.export_weights()
    assert not any(n.endswith(".scale") for n in got)
    for name in ("wq_a.weight", "wkv.weight", "indexer.wq_b.weight"):
        want = v4_oracle.dequant_weight(weights[name], weights[name[:-len("weight")] + "scale"])
        assert got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], want)
    with pytest.raises(ValueError, match="dtype must be bfloat16 or float32"):
        layer.dequantize_weights(jnp.float16)


@pytest.mark.slow
def test_x_and_the_plain_parameters_of_an_fp8_layer_match_the_oracle(small_chunks):
    # x's gradient passes straight through the FP8 linears' activation rounding.
    layer_id = 1
    layer, weights = fp8_v4_layer(layer_id)
    x, r = sequences(2, 40, V4_CONFIG["dim"], 7)
    selections = []
    for b in range(len(x)):
        _, aux = v4_oracle.v4_attention_f64(x[b], weights, V4_CONFIG, layer_id, round_bf16=False)
        assert min(aux["index_margin"]) > TIE_MARGIN
        selections.append(aux["selected"])
    fp8 = tuple(n[:-len(".scale")] for n in weights if n.endswith(".scale"))
    dequantised = {n: v4_oracle.dequant_weight(w, weights.get(n[:-len("weight")] + "scale"))
                   for n, w in weights.items() if not n.endswith(".scale")}
    f32 = [n for n, w in weights.items() if w.dtype == np.float32 and not n.startswith("indexer.")]

    def forward(params, x_b, selected):
        return grad_oracle.v4_forward(params, x_b, V4_CONFIG, layer_id, selected, fp8)

    grads = nnx.jit(nnx.grad(loss, argnums=(nnx.DiffState(0, only(*f32)), 1)))
    g_layer, g_x = grads(layer, jnp.asarray(x), jnp.asarray(r))
    got = flat(g_layer)
    want, want_x = oracle_gradients(forward, {n: w for n, w in dequantised.items()
                                              if not n.startswith("indexer.")}, x, r, selections)
    assert set(got) == set(f32)
    for name in f32:
        assert_gradients_close(got[name], want[name], name)
    assert_gradients_close(np.asarray(g_x), want_x, "x")
