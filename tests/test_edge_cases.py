"""The edge semantics (docs/contract.md, "Edge semantics"), identical on every backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_attn as jsa
from oracle import BF16, attention_f64, gather, invalid_indices

DTYPES = [np.float32, BF16]


def setup(rng, dtype, T=4, H=3, D=16, R=12, K=6):
    q = rng.standard_normal((T, H, D)).astype(dtype)
    kv = rng.standard_normal((R, D)).astype(dtype)
    idx = rng.integers(0, R, (T, K))
    return q, kv, idx


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", invalid_indices(12))
def test_each_flashmla_invalid_index_is_an_empty_slot(rng, dtype, bad):
    q, kv, idx = setup(rng, dtype)
    idx = idx.astype(np.int64)
    with_bad = idx.copy()
    with_bad[:, 2] = bad
    out = jsa.gathered_attn_idx(q, kv, with_bad, np.zeros(3, np.float32))
    # removing the slot altogether must give the same result
    dropped = jsa.gathered_attn_idx(q, kv, np.delete(idx, 2, axis=1), np.zeros(3, np.float32))
    if dtype is np.float32:
        # The empty slot adds exact zeros to both sums, but XLA may order a sum of K terms
        # differently from one of K - 1 (jax 0.7's CPU backend does): f32 sums can move by their
        # rounding, which for an output near 0 is many of its own ulps. A slot that were not
        # empty would move the output by the size of a row.
        K = idx.shape[1]
        tol = 4 * K * np.finfo(np.float32).eps * float(np.max(np.abs(kv)))
        np.testing.assert_allclose(np.asarray(out), np.asarray(dropped), rtol=0, atol=tol)
    else:
        np.testing.assert_array_equal(np.asarray(out), np.asarray(dropped))
    x, valid = gather(kv, with_bad)
    want = attention_f64(q, x, valid, np.zeros(3))
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2e-2, atol=2e-2)


def _enable_x64():
    if hasattr(jax, "enable_x64"):  # jax >= 0.8
        return jax.enable_x64(True)
    from jax.experimental import enable_x64

    return enable_x64()


def test_invalid_indices_as_int64_jax_array_under_x64(rng):
    q, kv, idx = setup(rng, np.float32)
    with _enable_x64():
        big = jnp.asarray(np.array([[2**32 + 1, 2**40, -(2**40), 3, 12, -1]] * 4, np.int64))
        out = jax.jit(jsa.gathered_attn_idx)(q, kv, big)
    x, valid = gather(kv, np.array([[-1, -1, -1, 3, -1, -1]] * 4))
    np.testing.assert_allclose(np.asarray(out), attention_f64(q, x, valid), rtol=2e-5, atol=2e-6)


def test_numpy_int64_indices_beyond_int32_are_empty_not_wrapped(rng):
    q, kv, _ = setup(rng, np.float32)
    idx = np.array([[2**32 + 5, 5]] * 4, np.int64)  # 2**32 + 5 would wrap to row 5
    out = jsa.gathered_attn_idx(q, kv, idx)
    only5 = jsa.gathered_attn_idx(q, kv, idx[:, 1:])
    np.testing.assert_array_equal(np.asarray(out), np.asarray(only5))


@pytest.mark.parametrize("idx_dtype", [np.int8, np.int16, np.uint8, np.uint16, np.int32, np.uint32, np.int64])
def test_any_integer_index_dtype(rng, idx_dtype):
    q, kv, idx = setup(rng, np.float32, R=100)
    idx[:, 0] = 99
    if np.issubdtype(idx_dtype, np.signedinteger):
        idx[:, 1] = -1
    out = jsa.gathered_attn_idx(q, kv, idx.astype(idx_dtype))
    x, valid = gather(kv, idx)
    np.testing.assert_allclose(np.asarray(out), attention_f64(q, x, valid), rtol=2e-5, atol=2e-6)
    traced = jax.jit(jsa.gathered_attn_idx)(q, kv, jnp.asarray(idx.astype(idx_dtype)))
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(out))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sink", [None, 0.0, 3.0, 1e30, np.inf, -np.inf])
def test_row_with_no_valid_slot_is_exactly_zero(rng, dtype, sink):
    q, kv, idx = setup(rng, dtype)
    idx[1] = -1  # token 1: all empty by index
    bias = np.zeros(idx.shape, np.float32)
    bias[2] = -np.inf  # token 2: all empty by bias
    sinks = None if sink is None else np.full(3, sink, np.float32)
    out = np.asarray(jsa.gathered_attn_idx(q, kv, idx, sinks, bias=bias), np.float32)
    assert np.all(out[1] == 0) and np.all(out[2] == 0)
    assert np.all(np.isfinite(out))
    x, _ = gather(kv, idx)
    out_g = np.asarray(jsa.gathered_attn(q, x, sinks, bias=np.where(idx >= 0, bias, -np.inf)))
    assert np.all(out_g[1] == 0) and np.all(out_g[2] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sink_plus_inf_zeroes_that_head_only(rng, dtype):
    q, kv, idx = setup(rng, dtype)
    sink = np.array([0.0, np.inf, -1.0], np.float32)
    out = np.asarray(jsa.gathered_attn_idx(q, kv, idx, sink), np.float32)
    assert np.all(out[:, 1] == 0)
    assert np.all(np.abs(out[:, 0]).sum(-1) > 0) and np.all(np.abs(out[:, 2]).sum(-1) > 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sink_minus_inf_is_no_sink(rng, dtype):
    q, kv, idx = setup(rng, dtype)
    a = jsa.gathered_attn_idx(q, kv, idx, np.full(3, -np.inf, np.float32))
    b = jsa.gathered_attn_idx(q, kv, idx, None)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    x, valid = gather(kv, idx)
    np.testing.assert_allclose(np.asarray(b, np.float64), attention_f64(q, x, valid), rtol=2e-2, atol=2e-2)


def test_sink_lowers_the_output_by_its_denominator_share(rng):
    q, kv, idx = setup(rng, np.float32)
    sink = np.array([-2.0, 0.5, 4.0], np.float32)
    x, valid = gather(kv, idx)
    out = jsa.gathered_attn_idx(q, kv, idx, sink)
    np.testing.assert_allclose(np.asarray(out), attention_f64(q, x, valid, sink), rtol=2e-5, atol=2e-6)


def test_duplicates_count_twice(rng):
    q, kv, _ = setup(rng, np.float32)
    idx = np.array([[3, 3, 7]] * 4)
    out = np.asarray(jsa.gathered_attn_idx(q, kv, idx))
    x, valid = gather(kv, idx)
    np.testing.assert_allclose(out, attention_f64(q, x, valid), rtol=2e-5, atol=2e-6)
    deduplicated = np.asarray(jsa.gathered_attn_idx(q, kv, np.array([[3, 7]] * 4)))
    assert np.abs(out - deduplicated).max() > 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_nan_or_inf_whatever_idx_holds(rng, dtype):
    R = 50
    q = (10 * rng.standard_normal((16, 8, 32))).astype(dtype)
    kv = (10 * rng.standard_normal((R, 32))).astype(dtype)
    idx = rng.choice(invalid_indices(R) + list(range(R)), (16, 40)).astype(np.int64)
    idx[:3] = -1
    sink = np.array([0, np.inf, -np.inf, 88.0, -88.0, 1e30, -1e30, 2.0], np.float32)
    bias = (5 * rng.standard_normal((16, 40))).astype(np.float32)
    bias[rng.random(bias.shape) < 0.3] = -np.inf
    for fn in (jsa.gathered_attn_idx, jax.jit(jsa.gathered_attn_idx)):
        out = np.asarray(fn(q, kv, idx, sink, bias=bias), np.float32)
        assert np.all(np.isfinite(out))
        assert np.all(out[:3] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_tokens(rng, dtype):
    q = np.zeros((0, 3, 16), dtype)
    kv = rng.standard_normal((5, 16)).astype(dtype)
    out = jax.jit(jsa.gathered_attn_idx)(q, kv, np.zeros((0, 4), np.int32))
    assert out.shape == (0, 3, 16) and out.dtype == q.dtype
    out = jsa.gathered_attn(q, np.zeros((0, 4, 16), dtype))
    assert out.shape == (0, 3, 16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_slots_is_all_empty(rng, dtype):
    q, kv, _ = setup(rng, dtype)
    sink = np.ones(3, np.float32)
    out = jax.jit(jsa.gathered_attn_idx)(q, kv, np.zeros((4, 0), np.int32), sink)
    assert out.shape == q.shape and np.all(np.asarray(out, np.float32) == 0)
    out = jsa.gathered_attn(q, np.zeros((4, 0, 16), dtype), sink)
    assert np.all(np.asarray(out, np.float32) == 0)


def test_empty_cache_is_all_empty(rng):
    q, _, idx = setup(rng, np.float32)
    out = jsa.gathered_attn_idx(q, np.zeros((0, 16), np.float32), idx)
    assert np.all(np.asarray(out) == 0)


@pytest.mark.parametrize("implementation", ["reference", "nki_emulated"])
@pytest.mark.parametrize("mask_value", [-1e30, -1e31, float(np.finfo(np.float32).min)])
def test_huge_negative_bias_never_lets_empty_slots_in(rng, implementation, mask_value):
    """A finite bias used as a mask (-1e30, finfo.min) must still rank above an empty slot."""
    q, kv, _ = setup(rng, np.float32)
    idx = np.array([[0, 1, 1, -1, 12, 5]] * 4)
    bias = np.full(idx.shape, mask_value, np.float32)
    bias[1:, 5] = 0.0  # tokens 1.. have one ordinary slot; token 0 has only masked ones
    out = jsa.gathered_attn_idx(q, kv, idx, bias=bias, implementation=implementation)
    x, valid = gather(kv, idx)
    want = attention_f64(q, x, valid, None, np.maximum(bias, -1e29))
    tol = dict(rtol=2e-5, atol=2e-6) if implementation == "reference" else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(out), want, **tol)
    # token 0 averages rows 0, 1, 1, 5 (all masked alike), never the empty slots' stand-in row
    np.testing.assert_allclose(np.asarray(out[0, 0]), (kv[0] + 2 * kv[1] + kv[5]) / 4, **tol)


def test_integer_scale_is_accepted_everywhere(rng):
    q, kv, idx = setup(rng, np.float32)
    x, valid = gather(kv, idx)
    want = attention_f64(q, x, valid, scale=2.0)
    for scale in (2, np.int32(2), jnp.array(2), 2.0):
        out = jsa.gathered_attn_idx(q, kv, idx, scale=scale)
        np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-6)
    traced = jax.jit(lambda s: jsa.gathered_attn_idx(q, kv, idx, scale=s))(jnp.int32(2))
    np.testing.assert_allclose(np.asarray(traced), want, rtol=2e-5, atol=2e-6)


def test_vmap_over_too_many_rows_for_int32_is_refused():
    q = jax.ShapeDtypeStruct((3, 2, 1, 8), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((3, 2**30, 8), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((3, 2, 4), jnp.int32)
    with pytest.raises(ValueError, match="exceed int32 indexing"):
        jax.eval_shape(jax.vmap(jsa.gathered_attn_idx), q, kv, idx)
