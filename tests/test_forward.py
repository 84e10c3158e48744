"""Forward values against the float64 oracle and the numpy model of the bf16 contract."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_attn as jsa
from oracle import (
    BF16,
    attention_bf16_contract,
    attention_f64,
    gather,
    invalid_indices,
    within_one_ulp,
)


def make_case(rng, T=5, H=4, D=32, R=40, K=24, dtype=np.float32, invalid_fraction=0.2):
    q = rng.standard_normal((T, H, D)).astype(dtype)
    kv = rng.standard_normal((R, D)).astype(dtype)
    idx = rng.integers(0, R, (T, K)).astype(np.int64)
    bad = rng.random((T, K)) < invalid_fraction
    idx[bad] = rng.choice(invalid_indices(R), bad.sum())
    sink = rng.standard_normal(H).astype(np.float32)
    bias = (0.5 * rng.standard_normal((T, K))).astype(np.float32)
    return q, kv, idx, sink, bias


@pytest.mark.parametrize("use_sink", [False, True])
@pytest.mark.parametrize("use_bias", [False, True])
def test_f32_matches_float64_oracle(rng, use_sink, use_bias):
    q, kv, idx, sink, bias = make_case(rng)
    sink = sink if use_sink else None
    bias = bias if use_bias else None
    out = jax.jit(jsa.gathered_attn_idx)(q, kv, idx, sink, bias=bias)
    x, valid = gather(kv, idx)
    want = attention_f64(q, x, valid, sink, bias)
    assert out.dtype == jnp.float32 and out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-6)


def test_gathered_f32_matches_float64_oracle(rng):
    q, kv, idx, sink, bias = make_case(rng, invalid_fraction=0.0)
    x, _ = gather(kv, idx)
    bias[:, ::5] = -np.inf  # a -inf bias empties the slot
    out = jax.jit(jsa.gathered_attn)(q, x, sink, bias=bias, scale=0.3)
    want = attention_f64(q, x, np.ones(bias.shape, bool), sink, bias, scale=0.3)
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("fn", ["idx", "gathered"])
def test_bf16_within_one_ulp_of_contract(rng, fn):
    q, kv, idx, sink, bias = make_case(rng, T=8, H=16, D=128, R=300, K=256, dtype=BF16)
    x, valid = gather(kv, idx)
    if fn == "idx":
        out = jax.jit(jsa.gathered_attn_idx)(q, kv, idx, sink, bias=bias)
    else:
        bias = np.where(valid, bias, -np.inf).astype(np.float32)
        out = jax.jit(jsa.gathered_attn)(q, x, sink, bias=bias)
    assert out.dtype == jnp.bfloat16
    want = attention_bf16_contract(q, x, valid, sink, bias)
    assert within_one_ulp(np.asarray(out), want) >= 0.999
    # and close to the exact result, as the field's tolerances expect
    exact = attention_f64(q, x, valid, sink, bias)
    np.testing.assert_allclose(np.asarray(out, np.float64), exact, atol=1e-2, rtol=1e-2)


def test_f16_inputs_follow_the_contract_in_f16(rng):
    q, kv, idx, sink, bias = make_case(rng, T=4, H=8, D=64, R=100, K=64, dtype=np.float16)
    out = jsa.gathered_attn_idx(q, kv, idx, sink, bias=bias)
    assert out.dtype == jnp.float16
    x, valid = gather(kv, idx)
    want = attention_bf16_contract(q, x, valid, sink, bias, dtype=np.float16)
    assert within_one_ulp(np.asarray(out), want, dtype=np.float16) >= 0.999


def test_scale_multiplies_logits_not_q(rng):
    """A scale applied to bf16 q would round q; the contract scales the fp32 logits."""
    q, kv, idx, sink, _ = make_case(rng, T=4, H=8, D=64, R=64, K=64, dtype=BF16, invalid_fraction=0)
    x, valid = gather(kv, idx)
    scale = 0.1234567
    out = jsa.gathered_attn_idx(q, kv, idx, sink, scale=scale)
    want = attention_bf16_contract(q, x, valid, sink, scale=scale)
    assert within_one_ulp(np.asarray(out), want) >= 0.999


def test_traced_scale(rng):
    q, kv, idx, sink, _ = make_case(rng)
    f = jax.jit(lambda s: jsa.gathered_attn_idx(q, kv, idx, sink, scale=s))
    x, valid = gather(kv, idx)
    np.testing.assert_allclose(
        np.asarray(f(jnp.float32(0.7))), attention_f64(q, x, valid, sink, scale=0.7), rtol=2e-5, atol=2e-6
    )


def test_default_scale_is_inverse_sqrt_d(rng):
    q, kv, idx, sink, _ = make_case(rng, D=48)
    a = jsa.gathered_attn_idx(q, kv, idx, sink)
    b = jsa.gathered_attn_idx(q, kv, idx, sink, scale=48**-0.5)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mixed_dtypes_compute_in_q_dtype(rng):
    q, kv, idx, sink, _ = make_case(rng, dtype=BF16)
    out = jsa.gathered_attn_idx(q, kv.astype(np.float32), idx, sink)
    same = jsa.gathered_attn_idx(q, kv, idx, sink)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out), np.asarray(same))


def test_gathered_and_indexed_forms_agree(rng):
    q, kv, idx, sink, bias = make_case(rng, dtype=BF16)
    x, valid = gather(kv, idx)
    a = jsa.gathered_attn_idx(q, kv, idx, sink, bias=bias)
    b = jsa.gathered_attn(q, x, sink, bias=np.where(valid, bias, -np.inf))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_primitive_is_visible_in_jaxpr(rng):
    q, kv, idx, sink, _ = make_case(rng)
    jaxpr = str(jax.make_jaxpr(jsa.gathered_attn_idx)(q, kv, idx, sink))
    assert "gathered_attn_idx[" in jaxpr
    x, _ = gather(kv, idx)
    assert "gathered_attn[" in str(jax.make_jaxpr(jsa.gathered_attn)(q, x, sink))
    assert "callback" not in jaxpr


def test_eval_shape(rng):
    q = jax.ShapeDtypeStruct((7, 3, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((100, 64), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((7, 9), jnp.int16)
    out = jax.eval_shape(jsa.gathered_attn_idx, q, kv, idx)
    assert out.shape == (7, 3, 64) and out.dtype == jnp.bfloat16
    g = jax.ShapeDtypeStruct((7, 9, 64), jnp.float32)
    out = jax.eval_shape(jsa.gathered_attn, jax.ShapeDtypeStruct((7, 3, 64), jnp.float32), g)
    assert out.shape == (7, 3, 64) and out.dtype == jnp.float32


def test_eager_and_jit_agree(rng):
    q, kv, idx, sink, bias = make_case(rng, dtype=BF16)
    a = jsa.gathered_attn_idx(q, kv, idx, sink, bias=bias)
    b = jax.jit(jsa.gathered_attn_idx)(q, kv, idx, sink, bias=bias)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
