"""indexer_topk against the float64 oracle (tests/indexer_oracle.py): the selection, its tie and
NaN rules, garbage in invalid rows, dtypes, the validity rule, jit and vmap, gradients of the
scores, and bad arguments."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from indexer_oracle import as_f64, check_selection, scores_f64, valid_rows
from jax_sparse_attn import gathered_attn_idx, indexer_topk
from jax_sparse_attn.storage import Bf16Bits


def make(rng, T, Hi, Di, R, dtype=jnp.bfloat16):
    q = jnp.asarray(rng.standard_normal((T, Hi, Di)), dtype)
    w = jnp.asarray(rng.standard_normal((T, Hi)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((R, Di)), dtype)
    return q, w, k


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow),
                                   pytest.param(jnp.float32, marks=pytest.mark.slow)])
@pytest.mark.parametrize("T,Hi,Di,R,topk", [
    (13, 4, 32, 300, 16), pytest.param(3, 8, 64, 2000, 128, marks=pytest.mark.slow), (7, 2, 16, 40, 64)])
def test_selection_matches_float64(rng, dtype, T, Hi, Di, R, topk):
    q, w, k = make(rng, T, Hi, Di, R, dtype)
    positions = rng.integers(-3, R + 10, T)
    idx, scores = jax.jit(lambda *a: indexer_topk(*a, topk, return_scores=True))(q, w, k, positions)
    assert idx.shape == (T, topk) and idx.dtype == jnp.int32 and scores.dtype == jnp.float32
    s, bound = scores_f64(q, w, k)
    check_selection(idx, scores, s, bound, valid_rows(positions, R), topk)


@pytest.mark.parametrize("ratio", [pytest.param(1, marks=pytest.mark.slow), 4, 128])
def test_compress_ratio_validity(rng, ratio):
    T, R, topk = 11, 64, 8
    q, w, k = make(rng, T, 4, 16, R)
    positions = np.array([-1, 0, ratio - 2, ratio - 1, ratio, 2 * ratio - 1, 5 * ratio + 2,
                          R * ratio - 1, R * ratio, 10**6, 2**31 - 1])
    idx, scores = indexer_topk(q, w, k, positions, topk, compress_ratio=ratio, return_scores=True)
    s, bound = scores_f64(q, w, k)
    valid = valid_rows(positions, R, ratio)
    check_selection(idx, scores, s, bound, valid, topk)
    # Only complete blocks: position ratio - 2 has none, ratio - 1 has exactly row 0.
    assert (np.asarray(idx)[2] == -1).all() and np.asarray(idx)[3, 0] == 0
    assert (np.asarray(idx)[3, 1:] == -1).all()


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64, np.int8])
def test_positions_of_any_integer_dtype(rng, dtype):
    # Unsigned positions have no -1 of their own dtype (NumPy 2.5 refuses one: OverflowError).
    T, R, topk = 4, 300, 8
    q, w, k = make(rng, T, 2, 8, R)
    positions = np.array([0, 5, 100, 255] if dtype != np.int8 else [0, 5, 100, -1]).astype(dtype)
    s, bound = scores_f64(q, w, k)
    valid = valid_rows(positions.astype(np.int64), R)
    for given in (positions, jnp.asarray(positions)):  # host and device arrays
        idx, scores = indexer_topk(q, w, k, given, topk, return_scores=True)
        check_selection(idx, scores, s, bound, valid, topk)


def test_int64_positions_beyond_int32_are_not_wrapped(rng):
    q, w, k = make(rng, 2, 2, 8, 10)
    positions = np.array([2**32 + 1, -(2**32) + 3], np.int64)  # wrapped: 1 and 3
    idx = np.asarray(indexer_topk(q, w, k, positions, 10))
    assert (idx[0] >= 0).all() and (idx[1] == -1).all()


def test_exact_ties_go_to_the_lower_row(rng):
    T, Hi, Di, R = 4, 2, 8, 40
    q, w, k = make(rng, T, Hi, Di, R)
    k = k.at[5].set(k[30]).at[17].set(k[30]).at[33].set(k[30])  # four equal rows
    q = jnp.broadcast_to(q[:1], q.shape)
    w = jnp.broadcast_to(jnp.abs(w[:1]), w.shape)
    s, _ = scores_f64(q, w, k)
    rank = int(np.sum(s[0] > s[0, 30]))
    # Token t's topk ends t + 1 entries into the tie group: its lower rows are the ones kept.
    for t in (0, 2):  # each topk compiles anew: two cuts into the group
        idx = np.asarray(indexer_topk(q, w, k, [R - 1] * T, rank + t + 1))[t]
        assert list(idx[rank:]) == [5, 17, 30, 33][: t + 1], (t, idx)


@pytest.mark.slow
def test_nan_ranks_below_every_number_and_minus_inf_is_selected(rng):
    T, Hi, Di, R = 3, 2, 4, 12
    q = jnp.ones((T, Hi, Di), jnp.float32)
    w = jnp.full((T, Hi), -1.0, jnp.float32)  # negative weights: scores <= 0
    k = jnp.asarray(rng.uniform(0.5, 1.0, (R, Di)), jnp.float32)
    k = k.at[3].set(jnp.nan).at[8].set(1e38)  # row 3: NaN score; row 8: -inf (overflow)
    idx, scores = indexer_topk(q, w, k, [R - 1] * T, R, return_scores=True)
    idx, scores = np.asarray(idx)[0], np.asarray(scores)[0]
    assert idx[-1] == 3 and np.isnan(scores[-1])
    assert idx[-2] == 8 and scores[-2] == -np.inf
    assert np.all(np.diff(scores[:-2]) <= 0)
    # With room for all but one, the NaN row is the one left out.
    idx = np.asarray(indexer_topk(q, w, k, [R - 1] * T, R - 1))[0]
    assert 3 not in idx and 8 in idx


def test_garbage_in_rows_no_token_may_select(rng):
    T, Hi, Di, R, topk = 6, 4, 16, 500, 32
    q, w, k = make(rng, T, Hi, Di, R)
    positions = np.array([0, 5, 40, 100, 199, 250])
    poisoned = np.asarray(k.astype(jnp.float32)).copy()
    poisoned[251:] = np.nan
    poisoned[260] = np.inf
    poisoned[400:420] = -np.inf
    poisoned = jnp.asarray(poisoned, jnp.bfloat16)
    clean = indexer_topk(q, w, k, positions, topk, return_scores=True)
    dirty = indexer_topk(q, w, poisoned, positions, topk, return_scores=True)
    for a, b in zip(clean, dirty):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fp8_queries_and_keys_with_scales(rng):
    T, Hi, Di, R, topk = 5, 4, 32, 200, 20
    q = jnp.asarray(rng.standard_normal((T, Hi, Di)), jnp.float8_e4m3fn)
    k = jnp.asarray(rng.standard_normal((R, Di)), jnp.float8_e4m3fn)
    ks = jnp.asarray(rng.uniform(0.1, 2.0, R), jnp.float32)
    w = jnp.asarray(rng.standard_normal((T, Hi)), jnp.float32)
    positions = np.array([3, 50, 120, 199, 500])
    idx, scores = indexer_topk(q, w, k, positions, topk, key_scale=ks, scale=0.7,
                               return_scores=True)
    s, bound = scores_f64(q, w, k, ks, scale=0.7)
    check_selection(idx, scores, s, bound, valid_rows(positions, R), topk)


@pytest.mark.slow
def test_bit_identical_across_runs_and_under_jit(rng):
    q, w, k = make(rng, 9, 4, 32, 700)
    positions = np.arange(691, 700)
    eager = indexer_topk(q, w, k, positions, 64, return_scores=True)
    jitted = jax.jit(lambda *a: indexer_topk(*a, 64, return_scores=True))(q, w, k, positions)
    for a, b in zip(eager, jitted):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("q_dtype", [jnp.bfloat16, jnp.float32])
def test_keys_as_bits_are_the_bf16_keys(rng, q_dtype):
    # A cache stored as bf16 bit patterns (the Flax layer's), passed as Bf16Bits, selects as its
    # bf16 values do, the scores bit for bit, jitted or not, with gradients of the scores with
    # respect to q.
    T, Hi, Di, R, topk = 9, 4, 32, 700, 24
    q, w, k = make(rng, T, Hi, Di, R)
    q = q.astype(q_dtype)
    k = k.at[R - 3:].set(jnp.nan)  # garbage past every token's rows
    bits = jax.lax.bitcast_convert_type(k, jnp.uint16)
    positions = rng.integers(-1, R - 3, T)
    idx, scores = jax.jit(lambda q, w, b, p: indexer_topk(q, w, Bf16Bits(b), p, topk,
                                                          return_scores=True))(
        q, w, bits, positions)
    s, bound = scores_f64(q, w, k)
    check_selection(idx, scores, s, bound, valid_rows(positions, R), topk)
    want = indexer_topk(q, w, k, positions, topk, return_scores=True)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(scores), np.asarray(want[1]))
    if q_dtype == jnp.float32:
        grad = jax.grad(lambda q_: indexer_topk(q_, w, Bf16Bits(bits), positions, topk,
                                                return_scores=True)[1].sum())(q)
        want_grad = jax.grad(lambda q_: indexer_topk(q_, w, k, positions, topk,
                                                     return_scores=True)[1].sum())(q)
        np.testing.assert_array_equal(np.asarray(grad), np.asarray(want_grad))


def test_keys_as_bits_flag_is_deprecated_and_still_works(rng):
    # The old flag, kept for one release: a DeprecationWarning, and the same bits as Bf16Bits
    # (jitted and under vmap, as the layers called it); no warning without it.
    T, Hi, Di, R, topk = 9, 4, 32, 700, 24
    q, w, k = make(rng, T, Hi, Di, R)
    bits = jax.lax.bitcast_convert_type(jnp.stack([k, k[::-1]]), jnp.uint16)
    positions = rng.integers(-1, R, T)
    with pytest.warns(DeprecationWarning, match="keys_as_bits.*deprecated.*Bf16Bits"):
        old = jax.jit(jax.vmap(lambda b: indexer_topk(q, w, b, positions, topk, return_scores=True,
                                                      keys_as_bits=True)))(bits)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        new = jax.jit(jax.vmap(lambda b: indexer_topk(q, w, Bf16Bits(b), positions, topk,
                                                      return_scores=True)))(bits)
    for a, b in zip(old, new):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(new[0][0]),
                                  np.asarray(indexer_topk(q, w, k, positions, topk)))


def test_empty_shapes(rng):
    q, w, k = make(rng, 4, 2, 8, 16)
    assert indexer_topk(q, w, k, [1, 2, 3, 4], 0).shape == (4, 0)
    assert indexer_topk(q[:0], w[:0], k, np.zeros(0, np.int32), 5).shape == (0, 5)
    idx, scores = indexer_topk(q, w, k[:0], [1, 2, 3, 4], 3, return_scores=True)
    assert (np.asarray(idx) == -1).all() and np.isneginf(np.asarray(scores)).all()


def test_feeds_gathered_attn_idx(rng):
    T, R, H, D, topk = 6, 64, 4, 32, 8
    q, w, k = make(rng, T, 2, 16, R)
    positions = np.arange(T) * 3
    idx = indexer_topk(q, w, k, positions, topk)
    qa = jnp.asarray(rng.standard_normal((T, H, D)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((R, D)), jnp.bfloat16)
    out = gathered_attn_idx(qa, kv, idx, None)
    assert out.shape == (T, H, D) and np.isfinite(np.asarray(out, np.float32)).all()


@pytest.mark.slow
def test_vmap_shared_and_own_caches(rng):
    B, T, Hi, Di, R, topk = 3, 5, 4, 16, 90, 12
    q = jnp.asarray(rng.standard_normal((B, T, Hi, Di)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((B, T, Hi)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((B, R, Di)), jnp.bfloat16)
    positions = rng.integers(0, R, (B, T))
    own = jax.vmap(lambda q, w, k, p: indexer_topk(q, w, k, p, topk))(q, w, keys, positions)
    shared = jax.vmap(lambda q, w, p: indexer_topk(q, w, keys[1], p, topk), in_axes=(0, 0, 0))(
        q, w, positions)
    moved = jax.vmap(lambda q, w, p: indexer_topk(q, w, keys[0], p, topk), in_axes=(1, 1, 1),
                     out_axes=1)(jnp.moveaxis(q, 0, 1), jnp.moveaxis(w, 0, 1), positions.T)
    for b in range(B):
        np.testing.assert_array_equal(own[b], indexer_topk(q[b], w[b], keys[b], positions[b], topk))
        np.testing.assert_array_equal(shared[b],
                                      indexer_topk(q[b], w[b], keys[1], positions[b], topk))
        np.testing.assert_array_equal(moved[:, b],
                                      indexer_topk(q[b], w[b], keys[0], positions[b], topk))


def test_vmap_folds_into_one_call_over_the_sequences():
    # The batching rule: each sequence's own cache joins the primitive's leading axis of
    # sequences, a cache shared by the batch folds the batch into each sequence's tokens; one
    # call either way, whose parameters do not depend on the batch.
    from jax_sparse_attn import indexer_topk_p

    A, B, T, Hi, Di, R = 2, 3, 5, 4, 16, 90
    q = jax.ShapeDtypeStruct((A, B, T, Hi, Di), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((A, B, T, Hi), jnp.float32)
    k = jax.ShapeDtypeStruct((B, R, Di), jnp.bfloat16)
    p = jax.ShapeDtypeStruct((A, B, T), jnp.int32)
    shared_outer = jax.vmap(jax.vmap(lambda *a: indexer_topk(*a, 8)), in_axes=(0, 0, None, 0))
    eqns = [e for e in jax.make_jaxpr(shared_outer)(q, w, k, p).jaxpr.eqns
            if e.primitive is indexer_topk_p]
    assert len(eqns) == 1
    assert [v.aval.shape for v in eqns[0].invars] == [
        (B, A * T, Hi, Di), (B, A * T, Hi), (B, R, Di), (B, R), (B, A * T)]
    assert [v.aval.shape for v in eqns[0].outvars] == [(B, A * T, 8)] * 2
    assert set(eqns[0].params) == {"topk", "compress_ratio", "implementation"}
    own = jax.vmap(jax.vmap(lambda *a: indexer_topk(*a, 8)))
    k_own = jax.ShapeDtypeStruct((A, B, R, Di), jnp.bfloat16)
    eqns = [e for e in jax.make_jaxpr(own)(q, w, k_own, p).jaxpr.eqns
            if e.primitive is indexer_topk_p]
    assert len(eqns) == 1
    assert [v.aval.shape for v in eqns[0].invars] == [
        (A * B, T, Hi, Di), (A * B, T, Hi), (A * B, R, Di), (A * B, R), (A * B, T)]


@pytest.mark.parametrize("R", [90, 700])  # a cache below one block (padded), and above
def test_vmap_over_own_caches_reads_only_each_sequences_rows(rng, R):
    # Nested vmap over sequences with their own caches and key scales: one call reads every
    # sequence's blocks out of the whole batch. Each sequence's rows past its tokens' positions
    # are NaN, so a read of a neighbour's rows or of a padding row would show.
    A, B, T, Hi, Di, topk = 2, 3, 4, 4, 16, 12
    q = jnp.asarray(rng.standard_normal((A, B, T, Hi, Di)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((A, B, T, Hi)), jnp.float32)
    k = rng.standard_normal((A, B, R, Di))
    ks = rng.uniform(0.5, 2.0, (A, B, R)).astype(np.float32)
    positions = rng.integers(-1, R - 10, (A, B, T))
    last = positions.max(-1)
    k[np.arange(R)[None, None, :] > last[..., None]] = np.nan
    k = jnp.asarray(k, jnp.bfloat16)
    run = jax.jit(jax.vmap(jax.vmap(lambda *a: indexer_topk(*a[:4], topk, key_scale=a[4],
                                                            return_scores=True))))
    idx, scores = run(q, w, k, positions, ks)
    for a in range(A):
        for b in range(B):
            s, bound = scores_f64(q[a, b], w[a, b], k[a, b], ks[a, b])
            check_selection(idx[a, b], scores[a, b], s, bound, valid_rows(positions[a, b], R),
                            topk)
    # Gradients of the scores with respect to the batched keys: each sequence's own.
    grad = jax.grad(lambda k_: jax.vmap(jax.vmap(lambda *a: indexer_topk(
        *a[:4], topk, key_scale=a[4], return_scores=True)[1]))(q, w, k_, positions, ks).sum())(
        jnp.nan_to_num(k.astype(jnp.float32)))
    for a in range(A):
        for b in range(B):
            want = _score_grads_f64(q[a, b], w[a, b], jnp.nan_to_num(k[a, b]), ks[a, b],
                                    (Hi * Di) ** -0.5, np.asarray(idx[a, b]),
                                    np.ones((T, topk)))[2]
            np.testing.assert_allclose(np.asarray(grad[a, b]), want, rtol=1e-4, atol=1e-4)


def _score_grads_f64(q, w, k, ks, scale, idx, ct):
    """d/d(q, w, k) of sum(ct * scores) at the selected rows, by hand in float64."""
    q, w, k = as_f64(q), as_f64(w), as_f64(k)
    gq, gw, gk = np.zeros_like(q), np.zeros_like(w), np.zeros_like(k)
    T, K = idx.shape
    for t in range(T):
        for j in range(K):
            r = idx[t, j]
            if r < 0:
                continue
            d = q[t] @ k[r]  # [Hi]
            on = (d > 0).astype(np.float64)
            c = ct[t, j] * scale * ks[r]
            gw[t] += c * np.maximum(d, 0)
            gq[t] += c * (w[t] * on)[:, None] * k[r][None, :]
            gk[r] += c * (w[t] * on) @ q[t]
    return gq, gw, gk


@pytest.mark.slow
def test_score_gradients_against_float64(rng):
    T, Hi, Di, R, topk = 5, 3, 8, 30, 6
    q, w, k = make(rng, T, Hi, Di, R, jnp.float32)
    ks = jnp.asarray(rng.uniform(0.5, 2.0, R), jnp.float32)
    positions = np.array([2, 8, 15, 29, 29])
    ct = rng.standard_normal((T, topk))

    def loss(q, w, k):
        idx, s = indexer_topk(q, w, k, positions, topk, key_scale=ks, scale=0.5,
                              return_scores=True)
        return jnp.sum(jnp.where(idx >= 0, s, 0.0) * ct)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, w, k)
    idx = np.asarray(indexer_topk(q, w, k, positions, topk, key_scale=ks, scale=0.5))
    want = _score_grads_f64(q, w, k, np.asarray(ks, np.float64), 0.5, idx, ct)
    for g, x in zip(grads, want):
        np.testing.assert_allclose(np.asarray(g), x, rtol=1e-4, atol=1e-5)


def test_jvp_of_scores_against_float64(rng):
    T, Hi, Di, R, topk = 4, 2, 8, 20, 5
    q, w, k = make(rng, T, Hi, Di, R, jnp.float32)
    dq, dw, dk = (jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (q, w, k))
    positions = np.array([4, 9, 19, 19])
    fn = lambda q, w, k: indexer_topk(q, w, k, positions, topk, return_scores=True)[1]  # noqa
    _, tangent = jax.jvp(fn, (q, w, k), (dq, dw, dk))
    eps = 1e-3
    plus = scores_f64(q + eps * dq, w + eps * dw, k + eps * dk)[0]
    minus = scores_f64(q - eps * dq, w - eps * dw, k - eps * dk)[0]
    idx = np.asarray(indexer_topk(q, w, k, positions, topk))
    central = np.where(idx >= 0, np.take_along_axis((plus - minus) / (2 * eps),
                                                    np.maximum(idx, 0), axis=1), 0.0)
    np.testing.assert_allclose(np.where(idx >= 0, np.asarray(tangent), 0.0), central,
                               rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("call,err,match", [
    (lambda q, w, k: indexer_topk(q[0], w, k, [0, 1], 4), ValueError, "q must have rank 3"),
    (lambda q, w, k: indexer_topk(q, w[:, :1], k, [0, 1], 4), ValueError, "weights must have shape"),
    (lambda q, w, k: indexer_topk(q, w, k[:, :3], [0, 1], 4), ValueError, "keys must have shape"),
    (lambda q, w, k: indexer_topk(q, w, k, [0], 4), ValueError, "positions must have shape"),
    (lambda q, w, k: indexer_topk(q, w, k, [0.5, 1.0], 4), TypeError, "positions must have an integer"),
    (lambda q, w, k: indexer_topk(q, w, k, [0, 1], -1), ValueError, "topk must be"),
    (lambda q, w, k: indexer_topk(q, w, k, [0, 1], True), TypeError, "topk must be an integer"),
    (lambda q, w, k: indexer_topk(q, w, k, [0, 1], 2.0), TypeError, "topk must be a Python integer"),
    (lambda q, w, k: indexer_topk(q, w, k, [0, 1], 4, compress_ratio=0), ValueError, "compress_ratio"),
    (lambda q, w, k: indexer_topk(q, w, k, [0, 1], 4, key_scale=jnp.ones(3)), ValueError, "key_scale must have shape"),
    (lambda q, w, k: indexer_topk(q, w, k.astype(jnp.float8_e4m3fn), [0, 1], 4), ValueError, "needs key_scale"),
    (lambda q, w, k: indexer_topk(q, w, k.astype(jnp.float16), [0, 1], 4), TypeError, "share a 16-bit dtype"),
    (lambda q, w, k: indexer_topk(q.astype(jnp.int8), w, k, [0, 1], 4), TypeError, "q must be a floating"),
    (lambda q, w, k: indexer_topk(q, w, k, [0, 1], 4, scale="big"), TypeError, "scale must be a real"),
    (lambda q, w, k: indexer_topk(q, w, k, [0, 1], 4, implementation="gpu"), ValueError, "implementation"),
    (lambda q, w, k: indexer_topk(q, w, "keys", [0, 1], 4), TypeError, "keys"),
    (lambda q, w, k: indexer_topk(q, w, jax.lax.bitcast_convert_type(k, jnp.uint16), [0, 1], 4),
     TypeError, "keys must be a floating.*Bf16Bits"),
    (lambda q, w, k: indexer_topk(q, w, Bf16Bits(k), [0, 1], 4), TypeError,
     "Bf16Bits hold uint16 bit patterns"),
    (lambda q, w, k: indexer_topk(q.astype(jnp.float16), w, Bf16Bits(
        jax.lax.bitcast_convert_type(k, jnp.uint16)), [0, 1], 4), TypeError, "share a 16-bit dtype"),
    (lambda q, w, k: indexer_topk(q, w, k, [0, 1], 4, keys_as_bits=True), TypeError,
     "keys_as_bits=True takes keys as uint16"),
    (lambda q, w, k: indexer_topk(q.astype(jnp.float16), w, jax.lax.bitcast_convert_type(
        k, jnp.uint16), [0, 1], 4, keys_as_bits=True), TypeError, "share a 16-bit dtype"),
    (lambda q, w, k: indexer_topk(q, w, k, [0, 1], 4, keys_as_bits=1), TypeError, "keys_as_bits"),
])
@pytest.mark.filterwarnings("ignore:indexer_topk.keys_as_bits:DeprecationWarning")
def test_bad_arguments_name_the_argument(rng, call, err, match):
    q, w, k = make(rng, 2, 2, 8, 10)
    with pytest.raises(err, match=match):
        call(q, w, k)
