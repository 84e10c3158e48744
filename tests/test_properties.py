"""Property-based tests over random shapes and random (often invalid) indices."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_sparse_attn as jsa
from oracle import BF16, attention_bf16_contract, attention_f64, gather, invalid_indices, within_one_ulp

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw):
    T = draw(st.integers(0, 3))
    H = draw(st.integers(1, 200))
    D = draw(st.integers(1, 640))
    K = draw(st.integers(0, 300))
    R = draw(st.integers(1, 400))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    pool = invalid_indices(R) + list(rng.integers(0, R, 8))
    idx = rng.choice(np.array(pool, np.int64), (T, K))
    keep_valid = rng.random((T, K)) < draw(st.sampled_from([0.0, 0.5, 0.9]))
    idx[keep_valid] = rng.integers(0, R, keep_valid.sum())
    sink = rng.choice(np.array([-np.inf, np.inf, 0.0, 1.5, -3.0], np.float32), H)
    with_sink = draw(st.booleans())
    return dict(
        q=rng.standard_normal((T, H, D)),
        kv=rng.standard_normal((R, D)),
        idx=idx,
        sink=sink if with_sink else None,
        bias=rng.standard_normal((T, K)).astype(np.float32) if draw(st.booleans()) else None,
    )


@pytest.mark.slow  # several seconds: CI runs it with the slow tests
@SETTINGS
@given(cases())
def test_f32_matches_float64_oracle(case):
    q, kv = case["q"].astype(np.float32), case["kv"].astype(np.float32)
    out = np.asarray(jsa.gathered_attn_idx(q, kv, case["idx"], case["sink"], bias=case["bias"]))
    assert out.shape == q.shape and np.all(np.isfinite(out))
    x, valid = gather(kv, case["idx"])
    want = attention_f64(q, x, valid, case["sink"], case["bias"])
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # several seconds: CI runs it with the slow tests
@SETTINGS
@given(cases())
def test_bf16_follows_the_contract(case):
    q, kv = case["q"].astype(BF16), case["kv"].astype(BF16)
    out = np.asarray(jsa.gathered_attn_idx(q, kv, case["idx"], case["sink"], bias=case["bias"]))
    assert out.dtype == BF16 and np.all(np.isfinite(out.astype(np.float32)))
    x, valid = gather(kv, case["idx"])
    want = attention_bf16_contract(q, x, valid, case["sink"], case["bias"])
    # One bf16 ulp almost everywhere; small cases have too few elements for a 99.9% quantile.
    assert within_one_ulp(out, want) >= 0.99
    empty_rows = ~valid.any(axis=1) if valid.size else np.ones(q.shape[0], bool)
    assert np.all(out[empty_rows].astype(np.float32) == 0)
