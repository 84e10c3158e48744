"""``merge_attention``: partial results over disjoint slot sets combine into the attention over
their union (float64 oracle), with the sink in one part; edge rules; gradients; jit and vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_attn as jsa
from oracle import BF16, attention_f64, gather, lse_f64


def split_case(rng, T=64, H=16, D=128, R=4096, K=256, dtype=BF16):
    q = rng.standard_normal((T, H, D)).astype(dtype)
    kv = rng.standard_normal((R, D)).astype(dtype)
    idx = rng.integers(-1, R, (T, K)).astype(np.int32)
    sink = rng.standard_normal(H).astype(np.float32)
    bias = (0.5 * rng.standard_normal((T, K))).astype(np.float32)
    # Each token's slots go to part A or part B at random: the other part sees them empty.
    in_a = rng.random((T, K)) < 0.5
    return q, kv, idx, sink, bias, in_a


def errors(got, want):
    err = np.abs(np.asarray(got, np.float64) - want)
    return err.max(), err.mean()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=["bf16", "f32"])
def test_merge_of_two_halves_is_as_accurate_as_one_call(rng, dtype):
    q, kv, idx, sink, bias, in_a = split_case(rng, dtype=dtype)
    f = jax.jit(lambda q, kv, idx, sink, bias: jsa.gathered_attn_idx(
        q, kv, idx, sink, bias=bias, return_lse=True))
    whole, whole_lse = f(q, kv, idx, sink, bias)
    part_a = f(q, kv, np.where(in_a, idx, -1), sink, bias)  # the sink in part A only
    part_b = f(q, kv, np.where(in_a, -1, idx), None, bias)
    out, lse = jax.jit(jsa.merge_attention)([part_a[0], part_b[0]], [part_a[1], part_b[1]])
    assert out.dtype == q.dtype and lse.dtype == jnp.float32

    x, valid = gather(kv, idx)
    want = attention_f64(q, x, valid, sink, bias)
    single_max, single_mean = errors(whole, want)
    merged_max, merged_mean = errors(out, want)
    assert merged_max <= 2 * single_max, (merged_max, single_max)
    assert merged_mean <= 2 * single_mean, (merged_mean, single_mean)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(whole_lse), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), lse_f64(q, x, valid, sink, bias), rtol=1e-5,
                               atol=1e-6)


def test_sink_as_a_partial_of_its_own(rng):
    q, kv, idx, sink, bias, in_a = split_case(rng, T=8, H=4, D=32, R=64, K=16, dtype=np.float32)
    out_a, lse_a = jsa.gathered_attn_idx(q, kv, np.where(in_a, idx, -1), return_lse=True)
    out_b, lse_b = jsa.gathered_attn_idx(q, kv, np.where(in_a, -1, idx), return_lse=True)
    sink_lse = jnp.broadcast_to(sink, lse_a.shape)
    out, lse = jsa.merge_attention(
        jnp.stack([out_a, out_b, jnp.zeros_like(out_a)]), jnp.stack([lse_a, lse_b, sink_lse])
    )
    x, valid = gather(kv, idx)
    np.testing.assert_allclose(np.asarray(out), attention_f64(q, x, valid, sink), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), lse_f64(q, x, valid, sink), rtol=1e-5, atol=1e-6)


def test_minus_inf_partials_contribute_nothing():
    o = jnp.array([[[1.0, 2.0]], [[30.0, 40.0]], [[5.0, 6.0]]])  # N=3, T=1 (H folded), D=2
    lse = jnp.array([[0.5], [-jnp.inf], [0.5]])
    out, total = jsa.merge_attention(o, lse)
    np.testing.assert_allclose(np.asarray(out), [[3.0, 4.0]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(total), [0.5 + np.log(2.0)], rtol=1e-6)


@pytest.mark.slow
def test_all_minus_inf_gives_zero_and_no_nan():
    o = jnp.ones((2, 3, 4, 5), jnp.bfloat16)
    lse = jnp.full((2, 3, 4), -jnp.inf)
    out, total = jsa.merge_attention(o, lse)
    assert out.dtype == jnp.bfloat16
    assert np.all(np.asarray(out) == 0) and np.all(np.asarray(total) == -np.inf)

    def loss(o, lse):
        out, total = jsa.merge_attention(o, lse)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(total), total, 0))

    grads = jax.grad(loss, argnums=(0, 1))(o.astype(jnp.float32), lse)
    for g in grads:
        assert np.all(np.asarray(g) == 0)


def test_plus_inf_partial_gives_zero_output():
    o = jnp.array([[[1.0, 2.0]], [[3.0, 4.0]]])
    lse = jnp.array([[jnp.inf], [0.0]])
    out, total = jsa.merge_attention(o, lse)
    np.testing.assert_array_equal(np.asarray(out), [[0.0, 0.0]])
    assert np.asarray(total)[0] == np.inf
    g = jax.grad(lambda o, l: jnp.sum(jsa.merge_attention(o, l)[0]), argnums=(0, 1))(o, lse)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in g)


@pytest.mark.slow
def test_gradient_matches_float64_finite_differences(rng):
    N, T, H, D = 3, 2, 2, 3
    o = rng.standard_normal((N, T, H, D))
    lse = rng.standard_normal((N, T, H))
    lse[1, 0, 0] = -np.inf  # an empty partial: its entries get gradient 0
    lse[:, 1, 1] = -np.inf  # everything empty
    w_out = rng.standard_normal((T, H, D))
    w_lse = rng.standard_normal((T, H))

    def merged_f64(o, lse):
        top = lse.max(axis=0)
        finite = np.isfinite(top)
        safe_top = np.where(finite, top, 0.0)
        w = np.where(finite, np.exp(lse - safe_top), 0.0)
        total = w.sum(axis=0)
        out = np.where(finite[..., None], (w[..., None] * o).sum(0) / np.where(finite, total, 1)[..., None], 0)
        return out, np.where(finite, safe_top + np.log(np.where(finite, total, 1)), 0.0)

    def value(o, lse):
        out, total = merged_f64(o, lse)
        return np.sum(out * w_out) + np.sum(total * w_lse)

    def loss(o, lse):
        out, total = jsa.merge_attention(o, lse)
        return jnp.sum(out * w_out) + jnp.sum(jnp.where(jnp.isfinite(total), total, 0) * w_lse)

    g_o, g_lse = jax.grad(loss, argnums=(0, 1))(jnp.asarray(o, jnp.float32),
                                                jnp.asarray(lse, jnp.float32))
    eps = 1e-6
    for arr, got in ((o, g_o), (lse, g_lse)):
        want = np.zeros(arr.shape)
        for j in np.ndindex(arr.shape):
            if not np.isfinite(arr[j]):
                continue
            saved = arr[j]
            arr[j] = saved + eps
            plus = value(o, lse)
            arr[j] = saved - eps
            minus = value(o, lse)
            arr[j] = saved
            want[j] = (plus - minus) / (2 * eps)
        assert np.all(np.isfinite(np.asarray(got)))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def test_vmap_and_sequences(rng):
    o = rng.standard_normal((4, 3, 5, 2, 6)).astype(np.float32)  # batch 4, N=3
    lse = rng.standard_normal((4, 3, 5, 2)).astype(np.float32)
    out, total = jax.jit(jax.vmap(jsa.merge_attention))(o, lse)
    for b in range(4):
        one, one_lse = jsa.merge_attention(list(o[b]), list(lse[b]))
        np.testing.assert_allclose(np.asarray(out[b]), np.asarray(one), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(total[b]), np.asarray(one_lse), rtol=1e-6)
        w = np.exp(lse[b].astype(np.float64))
        want = (w[..., None] * o[b]).sum(0) / w.sum(0)[..., None]
        np.testing.assert_allclose(np.asarray(one), want, rtol=1e-5)


def test_shape_errors():
    with pytest.raises(ValueError, match="lses must have the shape"):
        jsa.merge_attention(jnp.zeros((2, 3, 4, 5)), jnp.zeros((2, 3, 5)))
    with pytest.raises(ValueError, match="at least one"):
        jsa.merge_attention([], [])
