"""FP8 caches with per-row or per-group f32 scales: the op equals the op on the dequantised cache
(and the numpy model of the contract on it), keeps every edge rule, and never dequantises the
whole cache."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_sparse_attn as jsa
from oracle import BF16, attention_bf16_contract, gather, invalid_indices, lse_f64, within_one_ulp

FP8 = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def make_case(rng, fp8, groups, T=6, H=8, D=256, R=300, K=64, dtype=BF16):
    q = rng.standard_normal((T, H, D)).astype(dtype)
    kv = (rng.standard_normal((R, D)) * 4).astype(FP8[fp8])
    scale_shape = (R,) if groups is None else (R, groups)
    kv_scale = rng.uniform(0.01, 0.1, scale_shape).astype(np.float32)
    idx = rng.integers(0, R, (T, K)).astype(np.int32)
    bad = rng.random((T, K)) < 0.2
    idx[bad] = rng.choice(invalid_indices(R), bad.sum())
    idx[1] = -1  # a token with no valid slot
    sink = rng.standard_normal(H).astype(np.float32)
    bias = (0.5 * rng.standard_normal((T, K))).astype(np.float32)
    return q, kv, kv_scale, idx, sink, bias


def dequantise(kv, kv_scale, dtype):
    """numpy: ``(kv.astype(f32) * scale).astype(dtype)``, the scale broadcast over its group."""
    x = np.asarray(kv).astype(np.float32)
    R, D = x.shape
    s = kv_scale.reshape(R, -1)
    x = (x.reshape(R, s.shape[1], -1) * s[:, :, None]).reshape(R, D)
    return x.astype(dtype)


@pytest.mark.parametrize("fp8", sorted(FP8))
@pytest.mark.parametrize("groups", [None, 2, 4], ids=["per-row", "G128", "G64"])
def test_equals_the_op_on_the_dequantised_cache(rng, fp8, groups):
    q, kv, kv_scale, idx, sink, bias = make_case(rng, fp8, groups)
    f = jax.jit(lambda q, kv, s, idx, sink, bias: jsa.gathered_attn_idx(
        q, kv, idx, sink, bias=bias, kv_scale=s, return_lse=True))
    out, lse = f(q, kv, kv_scale, idx, sink, bias)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32

    kv_dequant = dequantise(kv, kv_scale, BF16)
    want, want_lse = jsa.gathered_attn_idx(q, kv_dequant, idx, sink, bias=bias, return_lse=True)
    assert within_one_ulp(np.asarray(out), np.asarray(want)) >= 0.999
    x, valid = gather(kv_dequant, idx)
    model = attention_bf16_contract(q, x, valid, sink, bias)
    assert within_one_ulp(np.asarray(out), model) >= 0.999
    assert np.all(np.asarray(out)[1] == 0)  # no valid slot
    expected_lse = lse_f64(q, x, valid, sink, bias)
    np.testing.assert_allclose(np.asarray(lse), expected_lse, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(lse)[1], sink)


def test_unselected_rows_and_scales_are_never_read(rng):
    q, kv, kv_scale, idx, sink, bias = make_case(rng, "e4m3fn", None)
    chosen = np.unique(idx[(idx >= 0) & (idx < kv.shape[0])])
    unused = np.setdiff1d(np.arange(kv.shape[0]), chosen)
    poisoned_kv = np.asarray(kv).copy()
    poisoned_kv.view(np.uint8)[unused] = 0x7F  # NaN in float8_e4m3fn
    poisoned_scale = kv_scale.copy()
    poisoned_scale[unused] = np.inf
    clean = jsa.gathered_attn_idx(q, kv, idx, sink, bias=bias, kv_scale=kv_scale)
    dirty = jsa.gathered_attn_idx(q, poisoned_kv, idx, sink, bias=bias, kv_scale=poisoned_scale)
    np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))


def test_the_whole_cache_is_never_dequantised(rng):
    q, kv, kv_scale, idx, sink, bias = make_case(rng, "e4m3fn", 2, R=1000)
    jaxpr = jax.make_jaxpr(lambda q, kv, s: jsa.gathered_attn_idx(q, kv, idx, sink, kv_scale=s))(
        q, kv, kv_scale)
    shapes = [(v.aval.shape, v.aval.dtype) for eqn in jaxpr.jaxpr.eqns for v in eqn.outvars]
    wide = [s for s in shapes if s[0] == kv.shape and np.dtype(s[1]).itemsize > 1]
    assert not wide, wide


@pytest.mark.slow
def test_gradient_of_q_equals_the_one_on_the_dequantised_cache(rng):
    q, kv, kv_scale, idx, sink, bias = make_case(rng, "e4m3fn", 2, dtype=np.float32)
    kv_dequant = dequantise(kv, kv_scale, np.float32)

    def loss(q, sink, cache, **kw):
        return jnp.sum(jsa.gathered_attn_idx(q, cache, idx, sink, bias=bias, **kw) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    got = grad(q, sink, kv, kv_scale=kv_scale)
    want = grad(q, sink, kv_dequant)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_vmap_over_sequences_with_their_own_caches(rng):
    cases = [make_case(rng, "e5m2", 2, T=3, R=50, K=16) for _ in range(3)]
    q, kv, kv_scale, idx, sink, bias = (np.stack(c) for c in zip(*cases))
    f = jax.vmap(lambda q, kv, s, idx, b: jsa.gathered_attn_idx(q, kv, idx, sink[0], bias=b,
                                                               kv_scale=s))
    out = jax.jit(f)(q, kv, kv_scale, idx, bias)
    for b in range(3):
        x, valid = gather(dequantise(kv[b], kv_scale[b], BF16), idx[b])
        assert within_one_ulp(np.asarray(out[b]),
                              attention_bf16_contract(q[b], x, valid, sink[0], bias[b])) >= 0.999


def test_emulated_kernel_path(rng):
    q, kv, kv_scale, idx, sink, bias = make_case(rng, "e4m3fn", 2, T=3, H=4, K=32)
    out = jsa.gathered_attn_idx(q, kv, idx, sink, bias=bias, kv_scale=kv_scale,
                                implementation="nki_emulated")
    x, valid = gather(dequantise(kv, kv_scale, BF16), idx)
    assert within_one_ulp(np.asarray(out), attention_bf16_contract(q, x, valid, sink, bias)) >= 0.999


def test_argument_errors(rng):
    q, kv, kv_scale, idx, sink, bias = make_case(rng, "e4m3fn", None, T=2, R=10, K=4)
    with pytest.raises(ValueError, match="needs kv_scale"):
        jsa.gathered_attn_idx(q, kv, idx)
    with pytest.raises(ValueError, match="kv_scale must have shape"):
        jsa.gathered_attn_idx(q, kv, idx, kv_scale=np.ones((10, 3), np.float32))
    with pytest.raises(TypeError, match="FP8 caches"):
        jsa.gathered_attn_idx(q, np.asarray(kv, np.float32), idx, kv_scale=kv_scale)


@pytest.mark.parametrize("implementation", ["reference", "nki_emulated"])
def test_empty_fp8_cache(implementation):
    """R = 0: every slot is empty; the output is 0 and the lse the sink, as for a bf16 cache."""
    q = jnp.ones((2, 4, 64), jnp.bfloat16)
    sink = jnp.array([0.5, -jnp.inf, 1.0, 2.0], jnp.float32)
    out, lse = jsa.gathered_attn_idx(q, jnp.zeros((0, 64), jnp.float8_e4m3fn),
                                     jnp.zeros((2, 8), jnp.int32), sink,
                                     kv_scale=jnp.zeros((0,), jnp.float32),
                                     implementation=implementation, return_lse=True)  # fmt: skip
    assert out.shape == (2, 4, 64) and not np.asarray(out, np.float32).any()
    np.testing.assert_array_equal(np.asarray(lse), np.tile(np.asarray(sink), (2, 1)))


@pytest.mark.parametrize("implementation", ["reference", "nki_emulated"])
def test_a_rope_of_no_columns_is_whole_fp8_rows(rng, implementation):
    """kv_rope [R, 0] beside whole FP8 rows adds no column: the op against the contract on the
    dequantised cache, as without kv_rope (the rope is left out of the operands, not read)."""
    q, kv, kv_scale, idx, sink, bias = make_case(rng, "e4m3fn", 2, T=3, H=4, K=32)
    out, lse = jsa.gathered_attn_idx(q, kv, idx, sink, bias=bias, kv_scale=kv_scale,
                                     kv_rope=np.zeros((kv.shape[0], 0), BF16),
                                     implementation=implementation, return_lse=True)
    x, valid = gather(dequantise(kv, kv_scale, BF16), idx)
    assert within_one_ulp(np.asarray(out), attention_bf16_contract(q, x, valid, sink, bias)) >= 0.999
    np.testing.assert_allclose(np.asarray(lse), lse_f64(q, x, valid, sink, bias), rtol=1e-5,
                               atol=1e-6)
