"""A layer's cache never loses a row in silence (docs/guides/caches.md, "A layer cache's capacity").

For V4Attention, V32Attention and SparseAttention: an eager call that would take a sequence past
``max_len`` raises CacheOverflowError before anything is written; under ``jit`` (a donated decode
step, as the docs show, with check_cache inside under checkify) the tokens past it get NaN outputs
and write nothing, ``length > capacity`` records them and ``check_cache`` raises; the tokens before
it match the float64 oracles (V4, V3.2) or the cacheless call (SparseAttention), and the other
sequences of the batch keep their bits.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx  # noqa: E402
from jax.experimental import checkify  # noqa: E402

import deepseek_v4_oracle as oracle4  # noqa: E402
import deepseek_v32_oracle as oracle32  # noqa: E402
from jax_sparse_attn import CacheOverflowError, check_cache  # noqa: E402
from jax_sparse_attn.deepseek import V4Attention, V4Config, V32Attention, V32Config  # noqa: E402
from jax_sparse_attn.flax import SparseAttention  # noqa: E402

CAPACITY = 16
V4_CONFIG, V32_CONFIG = oracle4.tiny_v4_config(), oracle32.tiny_v32_config()
# Sequence 0 runs HEAD tokens alone, then the others join it until it has STEPS tokens: its last
# STEPS - CAPACITY go past the capacity; the others end with room left.
HEAD, STEPS = 6, 20


# Each kind: the layer as built (random weights), and its weights for the oracle (None: the
# SparseAttention layer, whose reference is its cacheless call).
LAYERS = {
    "v4-indexed": (lambda: V4Attention(V4Config.from_dict(V4_CONFIG), 1, dtype=jnp.float32,
                                       cache_dtype="float32"), 1),
    "v4-window": (lambda: V4Attention(V4Config.from_dict(V4_CONFIG), 0, dtype=jnp.float32,
                                      cache_dtype="float32"), 0),
    "v4-bf16-fp8": (lambda: V4Attention(V4Config.from_dict(V4_CONFIG), 1), 1),
    "v32": (lambda: V32Attention(V32Config.from_dict(V32_CONFIG), dtype=jnp.float32,
                                 cache_dtype="float32"), None),
    "v32-bf16-fp8": (lambda: V32Attention(V32Config.from_dict(V32_CONFIG)), None),
    "sparse": (lambda: SparseAttention(16, 4, 8, 3, index_heads=3, index_dim=8, selection="dense",
                                       rngs=nnx.Rngs(0)), None),
    "sparse-compressed-window": (lambda: SparseAttention(
        16, 4, 8, 3, index_heads=3, index_dim=8, compress_ratio=4, window=2, selection="dense",
        rngs=nnx.Rngs(0)), None),
    "sparse-bf16": (lambda: SparseAttention(16, 4, 8, 3, index_heads=3, index_dim=8,
                                            dtype=jnp.bfloat16, selection="dense",
                                            rngs=nnx.Rngs(0)), None),
}
# The decode loops that run by default (each compiles its layer's step: seconds); the rest are slow.
DEFAULT_LOOPS = ("sparse",)


def abstract(kind):
    """The layer with abstract weights (``nnx.eval_shape``: nothing computed): enough for a call
    that must refuse before it computes anything."""
    return nnx.eval_shape(LAYERS[kind][0])


@functools.cache
def built(kind):
    """``(layer, weights)``: the layer with DeepSeek-layout random weights loaded (V4, V3.2)."""
    layer = LAYERS[kind][0]()
    if isinstance(layer, V4Attention):
        weights = oracle4.random_v4_weights(V4_CONFIG, LAYERS[kind][1], np.random.default_rng(1))
    elif isinstance(layer, V32Attention):
        weights = oracle32.random_v32_weights(V32_CONFIG, np.random.default_rng(0))
    else:
        return layer, None
    layer.load_weights(weights)
    return layer, weights


def tokens(n, dim, seed):
    return np.random.default_rng(seed).standard_normal((n, dim))


def dim_of(layer):
    return layer.features if isinstance(layer, SparseAttention) else layer.config.dim


def leaves(cache):
    """The cache's arrays as numpy, by their tree paths (``length`` left out)."""
    return {jax.tree_util.keystr(path): np.asarray(a)
            for path, a in jax.tree_util.tree_leaves_with_path(cache)
            if jax.tree_util.keystr(path) != ".length"}


# --- eager calls ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", LAYERS)
def test_an_eager_call_past_the_capacity_raises_and_writes_nothing(kind):
    layer = abstract(kind)  # the call refuses before it reads a weight
    cache = layer.init_cache(3, CAPACITY)
    assert np.all(np.asarray(cache.capacity) == CAPACITY)
    cache = cache._replace(length=jnp.array([10, 13, 9], jnp.int32))
    before = {"length": np.asarray(cache.length), **leaves(cache)}
    x = jnp.ones((3, 4, dim_of(layer)), jnp.float32)
    with pytest.raises(CacheOverflowError) as caught:
        layer(x, cache)
    message = str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert "capacity of 16 tokens" in message
    assert "sequence 1 holds 13 and the call brings 4 (to 17)" in message
    assert "sequence 0" not in message and "sequence 2" not in message
    # The cache is as it was (nothing was written, nothing donated).
    after = {"length": np.asarray(cache.length), **leaves(cache)}
    assert before.keys() == after.keys()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def test_padding_does_not_count():
    # Sequence 0 is full and sits out; sequence 1 brings 4 real tokens of 6.
    x = jnp.ones((2, 6, V4_CONFIG["dim"]), jnp.float32)
    layer = abstract("v4-indexed")
    cache = layer.init_cache(2, CAPACITY)._replace(length=jnp.array([16, 13], jnp.int32))
    with pytest.raises(CacheOverflowError, match=re.escape("sequence 1 holds 13 and the call brings "
                                                           "4 (to 17)")) as caught:
        layer(x, cache, num_tokens=jnp.array([0, 4]))
    assert "sequence 0" not in str(caught.value)


@pytest.mark.parametrize("kind", ["v32", "sparse"])
def test_selected_rows_refuse_a_call_past_the_capacity(kind):
    layer = abstract(kind)
    cache = layer.init_cache(1, CAPACITY)._replace(length=jnp.array([15], jnp.int32))
    x = jnp.ones((1, 2, dim_of(layer)), jnp.float32)
    select = layer.select_rows if kind == "sparse" else layer.selected_rows
    with pytest.raises(CacheOverflowError, match=re.escape("sequence 0 holds 15 and the call brings "
                                                           "2 (to 17)")):
        select(x, cache)


# --- jitted decode loops -------------------------------------------------------------------------

def _checked(layer, x, cache, num_tokens):
    """A decode step with check_cache inside, under checkify: ``(error, (y, cache))``."""
    def call(x, cache, num_tokens):
        if isinstance(layer, SparseAttention):
            y, cache = layer(x, cache)
        else:
            y, cache = layer(x, cache, num_tokens=num_tokens)
        check_cache(cache)
        return y, cache
    return checkify.checkify(call)(x, cache, num_tokens)


_step = nnx.jit(_checked, donate_argnums=2)


def decode_loop(layer, a, b, late_a=False):
    """One token per step over a batch of two: sequence 1 takes ``b`` from step ``HEAD`` on,
    sequence 0 ``a`` from the first step (``late_a``: from ``HEAD`` on, as sequence 1). Returns
    each sequence's outputs, every step's checkify error, the final cache and sequence 0's cache
    (numpy) after its ``CAPACITY``-th token."""
    cache = layer.init_cache(2, CAPACITY)
    got, errors, full = {0: [], 1: []}, [], None
    for t in range(STEPS):
        real = [t >= HEAD or not late_a, t >= HEAD]
        x = np.zeros((2, 1, a.shape[1]), np.float32)
        if real[0]:
            x[0, 0] = a[t - HEAD * late_a]
        if real[1]:
            x[1, 0] = b[t - HEAD]
        if isinstance(layer, SparseAttention) and t == HEAD:
            # No num_tokens: a late sequence ran zeros so far and starts now at length 0 (the
            # rows past a length are never read).
            cache = cache._replace(length=jnp.where(jnp.array([late_a, True]), 0, cache.length))
        error, (y, cache) = _step(layer, jnp.asarray(x), cache, jnp.array(real, jnp.int32))
        errors.append(error.get())
        y = np.asarray(y, np.float32)
        for seq in (0, 1):
            if real[seq]:
                got[seq].append(y[seq, 0])
        if len(got[0]) == CAPACITY and full is None:
            full = jax.tree.map(lambda leaf: np.asarray(leaf)[0], cache)
    return {k: np.stack(v) for k, v in got.items()}, errors, cache, full


def reference(kind, layer, weights, xs):
    """Each token's output without a cache, for each ``x [n, dim]`` of ``xs``: the float64
    oracle (V4, V3.2), or the cacheless call (SparseAttention; one batch, causal)."""
    if kind.startswith("v4"):
        return [oracle4.v4_attention_f64(x, weights, V4_CONFIG, layer.layer_id,
                                         round_bf16=layer.dtype == jnp.bfloat16)[0] for x in xs]
    if kind.startswith("v32"):
        return [oracle32.v32_attention_f64(x, weights, V32_CONFIG,
                                           round_bf16=layer.dtype == jnp.bfloat16)[0] for x in xs]
    n = max(len(x) for x in xs)
    batch = np.stack([np.pad(x, ((0, n - len(x)), (0, 0))) for x in xs])
    y = np.asarray(nnx.jit(lambda m, x: m(x))(layer, jnp.asarray(batch, jnp.float32)), np.float64)
    return [y[i, : len(x)] for i, x in enumerate(xs)]


def assert_matches(y, want, bf16):
    # f32: rounding (and a near-tied selection) only; bf16: single elements move by an FP8 step.
    err = np.abs(y - want).max(-1) / np.abs(want).max(-1)
    assert np.median(err) <= (2e-2 if bf16 else 1e-5) and err.max() <= (0.1 if bf16 else 1e-3), err


@pytest.mark.parametrize("kind", [k if k in DEFAULT_LOOPS else pytest.param(k, marks=pytest.mark.slow)
                                  for k in LAYERS])
def test_a_jitted_decode_loop_past_the_capacity(kind):
    layer, weights = built(kind)
    dim = dim_of(layer)
    bf16 = layer.dtype == jnp.bfloat16
    a, b = tokens(STEPS, dim, seed=2), tokens(STEPS - HEAD, dim, seed=3)
    got, errors, cache, full = decode_loop(layer, a, b)
    want_a, want_b = reference(kind, layer, weights, [a[:CAPACITY], b])

    # Sequence 0: its tokens within the capacity as without a cache, the ones past it NaN.
    assert np.isfinite(got[0][:CAPACITY]).all()
    assert np.isnan(got[0][CAPACITY:]).all()
    assert_matches(got[0][:CAPACITY], want_a, bf16)
    # The cache records it; check_cache raises, inside the step (checkify) and eagerly after.
    assert np.asarray(cache.length).tolist() == [STEPS, STEPS - HEAD]
    assert errors[:CAPACITY] == [None] * CAPACITY
    assert all("lengths [17 11], capacity [16 16]" in errors[CAPACITY] and "lengths [" in e
               for e in errors[CAPACITY:]), errors[CAPACITY:]
    with pytest.raises(CacheOverflowError, match=re.escape("sequence 0 was given 20 tokens, 4 past it")):
        check_cache(cache)
    # Nothing past the capacity was written: sequence 0's rows, window ring and compressor state
    # are as they were when it held CAPACITY tokens.
    final = leaves(jax.tree.map(lambda leaf: np.asarray(leaf)[0], cache))
    for name, rows in leaves(full).items():
        np.testing.assert_array_equal(final[name], rows, err_msg=name)

    # Sequence 1 had room: right outputs, and bit for bit (outputs and cache) those of the same
    # batch whose sequence 0 stays within the capacity (it starts late too).
    assert np.isfinite(got[1]).all()
    assert_matches(got[1], want_b, bf16)
    other, other_errors, other_cache, _ = decode_loop(layer, a, b, late_a=True)
    assert other_errors == [None] * STEPS
    np.testing.assert_array_equal(other[1], got[1])
    rows = [leaves(jax.tree.map(lambda leaf: np.asarray(leaf)[1], c)) for c in (cache, other_cache)]
    for name in rows[0]:
        np.testing.assert_array_equal(rows[0][name], rows[1][name], err_msg=name)


def test_check_cache_passes_a_cache_within_its_capacity():
    layer = abstract("sparse")
    cache = layer.init_cache(2, 4)._replace(length=jnp.array([4, 3], jnp.int32))
    check_cache(cache)
    err, _ = jax.jit(checkify.checkify(check_cache))(cache)
    err.throw()
    with pytest.raises(ValueError, match="checkify"):
        jax.jit(check_cache)(cache)  # traced without checkify: an error, never a silent pass
