"""``return_lse=True``: the log-sum-exp against a float64 oracle, its edge rules, jit / vmap, its
gradients (against float64 finite differences), and the emulated Neuron path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_attn as jsa
from oracle import (BF16, attention_f64, central_differences, gather, invalid_indices, lse_f64,
                    moved_along)

T, H, D, R, K = 6, 3, 8, 10, 5
SCALE = 0.4
FLOAT_ARGS = ("q", "src", "sink", "bias", "scale")


def make_inputs(rng, form, edges, dtype=np.float32, shape=(T, H, D, R, K)):
    T_, H_, D_, R_, K_ = shape
    q = rng.standard_normal((T_, H_, D_)).astype(dtype)
    sink = rng.standard_normal(H_).astype(np.float32)
    bias = (0.5 * rng.standard_normal((T_, K_))).astype(np.float32)
    if form == "idx":
        src = rng.standard_normal((R_, D_)).astype(dtype)
        idx = rng.integers(0, R_, (T_, K_)).astype(np.int32)
    else:
        src = rng.standard_normal((T_, K_, D_)).astype(dtype)
        idx = None
    if edges:
        sink[:2] = [np.inf, -np.inf]
        bias[1, :] = -np.inf  # a token whose slots are all masked
        bias[3, [0, K_ - 1]] = -np.inf
        if form == "idx":
            idx[0] = np.resize(invalid_indices(R_), K_)  # a token with no valid index
            idx[2] = np.resize([3, 3, 3, 1, 1], K_)  # duplicates count twice
        else:
            bias[0, :] = -np.inf
    return {"q": q, "src": src, "idx": idx, "sink": sink, "bias": bias, "scale": np.float32(SCALE)}


def op(form, q, src, idx, sink, bias, scale, **kw):
    if form == "idx":
        return jsa.gathered_attn_idx(q, src, idx, sink, bias=bias, scale=scale, return_lse=True, **kw)
    return jsa.gathered_attn(q, src, sink, bias=bias, scale=scale, return_lse=True, **kw)


def slots(form, src, idx):
    if form == "idx":
        return gather(src, idx)
    return src, np.ones(src.shape[:2], bool)


def oracle_lse(form, q, src, idx, sink, bias, scale):
    x, valid = slots(form, src, idx)
    return lse_f64(q, x, valid, sink, bias, float(scale))


def assert_lse_close(got, want, rtol=1e-5):
    got = np.asarray(got, np.float64)
    assert got.dtype == np.float64 and got.shape == want.shape
    same_inf = np.isinf(want)
    np.testing.assert_array_equal(got[same_inf], want[same_inf])
    np.testing.assert_allclose(got[~same_inf], want[~same_inf], rtol=rtol, atol=rtol * 1e-1)


@pytest.mark.parametrize("form", ["idx", "gathered"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("edges", [False, True], ids=["random", "edges"])
def test_lse_matches_float64_oracle(rng, form, dtype, edges):
    inputs = make_inputs(rng, form, edges, dtype, shape=(9, 5, 64, 300, 40))
    out, lse = jax.jit(lambda *a: op(form, *a))(*inputs.values())
    assert lse.dtype == jnp.float32 and lse.shape == (9, 5)
    assert_lse_close(lse, oracle_lse(form, **inputs))
    # The output is the same as without return_lse, bit for bit.
    plain = inputs
    if form == "idx":
        alone = jsa.gathered_attn_idx(plain["q"], plain["src"], plain["idx"], plain["sink"],
                                      bias=plain["bias"], scale=plain["scale"])
    else:
        alone = jsa.gathered_attn(plain["q"], plain["src"], plain["sink"], bias=plain["bias"],
                                  scale=plain["scale"])
    np.testing.assert_array_equal(np.asarray(out), np.asarray(alone))


def test_lse_of_large_logits_and_a_dominant_sink(rng):
    # Logits near 200 and a sink 150 above them: exp overflows f32, the lse must not.
    q = np.full((2, 2, 4), 10.0, np.float32)
    kv = np.full((3, 4), 10.0, np.float32)
    idx = np.array([[0, 1], [2, -1]], np.int32)
    sink = np.array([350.0, -np.inf], np.float32)
    out, lse = jsa.gathered_attn_idx(q, kv, idx, sink, scale=0.5, return_lse=True)
    x, valid = gather(kv, idx)
    assert_lse_close(lse, lse_f64(q, x, valid, sink, None, 0.5))
    np.testing.assert_allclose(np.asarray(out), attention_f64(q, x, valid, sink, None, 0.5),
                               atol=1e-6)


@pytest.mark.parametrize("form", ["idx", "gathered"])
def test_no_valid_slot_gives_sink_or_minus_inf(rng, form):
    inputs = make_inputs(rng, form, edges=False)
    inputs["bias"][[1, 4], :] = -np.inf
    inputs["sink"][:] = [0.5, -np.inf, np.inf]
    out, lse = op(form, **inputs)
    out, lse = np.asarray(out), np.asarray(lse)
    for t in (1, 4):
        assert np.all(out[t] == 0)
        np.testing.assert_array_equal(lse[t], [0.5, -np.inf, np.inf])
    assert not np.any(np.isnan(lse))


def test_empty_shapes():
    q = np.zeros((3, 2, 4), np.float32)
    out, lse = jsa.gathered_attn_idx(q, np.zeros((5, 4), np.float32), np.zeros((3, 0), np.int32),
                                     np.array([1.0, -np.inf], np.float32), return_lse=True)
    assert lse.shape == (3, 2) and np.all(np.asarray(out) == 0)
    np.testing.assert_array_equal(np.asarray(lse), [[1.0, -np.inf]] * 3)
    out, lse = jsa.gathered_attn(np.zeros((0, 2, 4), np.float32), np.zeros((0, 3, 4), np.float32),
                                 return_lse=True)
    assert out.shape == (0, 2, 4) and lse.shape == (0, 2)


def test_vmap_of_return_lse_matches_each_element(rng):
    B = 3
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    kv = rng.standard_normal((B, R, D)).astype(np.float32)
    idx = rng.integers(-2, R + 2, (B, T, K)).astype(np.int32)
    sink = rng.standard_normal(H).astype(np.float32)
    f = jax.jit(jax.vmap(lambda q, kv, idx: jsa.gathered_attn_idx(q, kv, idx, sink, return_lse=True)))
    out, lse = f(q, kv, idx)
    assert lse.shape == (B, T, H)
    for b in range(B):
        x, valid = gather(kv[b], idx[b])
        assert_lse_close(lse[b], lse_f64(q[b], x, valid, sink))
        np.testing.assert_allclose(np.asarray(out[b]), attention_f64(q[b], x, valid, sink),
                                   rtol=2e-5, atol=2e-6)


# --- gradients ------------------------------------------------------------------------------


def finite_difference_vjp(form, inputs, w_lse, w_out=None, eps=1e-6):
    """d/d(arg) of sum(lse * w_lse) (+ sum(out * w_out)) of the float64 oracle, by central
    differences; infinite lse entries (a +inf sink) are flat and add nothing."""
    base = {k: (None if v is None else np.asarray(v, np.float64)) for k, v in inputs.items()}
    base["idx"] = inputs["idx"]

    def value(args):
        x, valid = slots(form, args["src"], args["idx"])
        rest = (args["sink"], args["bias"], float(args["scale"]))
        lse = lse_f64(args["q"], x, valid, *rest)
        total = np.sum(np.where(np.isfinite(lse), lse, 0.0) * w_lse)
        if w_out is not None:
            total += np.sum(attention_f64(args["q"], x, valid, *rest) * w_out)
        return total

    return central_differences(value, base, FLOAT_ARGS, eps)


@pytest.mark.parametrize("form", ["idx", "gathered"])
@pytest.mark.parametrize("with_out", [False, True], ids=["lse", "lse+out"])
def test_vjp_through_lse_matches_finite_differences(rng, form, with_out):
    inputs = make_inputs(rng, form, edges=True)
    w_lse = rng.standard_normal((T, H)).astype(np.float32)
    w_out = rng.standard_normal((T, H, D)).astype(np.float32) if with_out else None
    idx = inputs["idx"]

    def loss(q, src, sink, bias, scale):
        out, lse = op(form, q, src, idx, sink, bias, scale)
        total = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)
        return total + (jnp.sum(out * w_out) if with_out else 0.0)

    args = [jnp.asarray(inputs[n]) for n in FLOAT_ARGS]
    got = jax.jit(jax.grad(loss, argnums=tuple(range(5))))(*args)
    want = finite_difference_vjp(form, inputs, w_lse, w_out)
    for name, g in zip(FLOAT_ARGS, got):
        g = np.asarray(g)
        assert np.all(np.isfinite(g)), name
        np.testing.assert_allclose(g, want[name], rtol=1e-4, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("form", ["idx", "gathered"])
def test_jvp_of_lse_matches_finite_differences(rng, form):
    inputs = make_inputs(rng, form, edges=True)
    idx = inputs["idx"]
    primals = [jnp.asarray(inputs[n]) for n in FLOAT_ARGS]
    directions = [rng.standard_normal(np.shape(p)).astype(np.float32) for p in primals]

    def f(q, src, sink, bias, scale):
        return op(form, q, src, idx, sink, bias, scale)[1]

    lse, tangent = jax.jvp(f, primals, [jnp.asarray(d) for d in directions])
    eps = 1e-6
    plus, minus = moved_along(lambda args: oracle_lse(form, **args), inputs, FLOAT_ARGS,
                              directions, eps)
    finite = np.isfinite(plus)
    want = np.where(finite, (plus - np.where(finite, minus, 0)) / (2 * eps), 0.0)
    tangent = np.asarray(tangent)
    assert np.all(np.isfinite(tangent))
    np.testing.assert_allclose(tangent, want, rtol=1e-4, atol=2e-5)


# --- the emulated Neuron path ----------------------------------------------------------------


def test_emulated_path_returns_the_lse(rng):
    inputs = make_inputs(rng, "idx", edges=True, dtype=BF16)
    out, lse = op("idx", **inputs, implementation="nki_emulated")
    assert_lse_close(lse, oracle_lse("idx", **inputs))
    x, valid = gather(inputs["src"], inputs["idx"])
    want = attention_f64(inputs["q"], x, valid, inputs["sink"], inputs["bias"], SCALE)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=2e-2)


def test_vmap_with_a_sink_per_sequence(rng):
    # A batched sink runs one call per batch element (primitives.py); the lse comes back batched.
    B = 2
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    kv = rng.standard_normal((R, D)).astype(np.float32)
    idx = rng.integers(-2, R + 2, (B, T, K)).astype(np.int32)
    sink = rng.standard_normal((B, H)).astype(np.float32)
    f = jax.vmap(lambda q, idx, s: jsa.gathered_attn_idx(q, kv, idx, s, return_lse=True))
    out, lse = jax.jit(f)(q, idx, sink)
    for b in range(B):
        x, valid = gather(kv, idx[b])
        assert_lse_close(lse[b], lse_f64(q[b], x, valid, sink[b]))
