"""The Flax NNX layer: jit, prefill/decode against the full sequence, gradients, and a float64 oracle.

The oracles here are plain numpy (float64) written from the math in the layer's docstring: the
projections are matrix products with the layer's weights, the indexer score is
``sum_j w_j relu(iq_j . ik_r) / sqrt(Hi Di)``, and attention is a causal softmax whose denominator
includes ``exp(sink)``.
"""

import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_sparse_attn.flax as flax_layer  # noqa: E402
from jax_sparse_attn.flax import (  # noqa: E402
    SparseAttention,
    SparseAttentionCache,
    indexer_scores,
    select_topk_rows,
)

E, H, D, HI, DI = 16, 4, 8, 3, 8


# The layer's default selection is the streaming indexer_topk; each distinct shape compiles its
# streaming loop (seconds), so most tests here check the layer's mechanics with the dense
# selection, and the tests marked STREAMING run the default one (selections equal: tested).
SELECTION = "dense"
STREAMING = "streaming"


def make_layer(topk, seed=0, dtype=None, sink=None, selection=None, **options):
    layer = SparseAttention(
        E, H, D, topk, index_heads=HI, index_dim=DI, dtype=dtype,
        selection=selection or SELECTION, rngs=nnx.Rngs(seed), **options
    )
    if sink is not None:
        layer.sink[...] = jnp.asarray(sink, jnp.float32)
    return layer


def inputs(B, T, seed=1):
    return jax.random.normal(jax.random.key(seed), (B, T, E), jnp.float32)


def weights(layer):
    def w(linear):
        return np.asarray(linear.kernel[...], np.float64)

    return {
        "q": w(layer.query),
        "kv": w(layer.kv),
        "iq": w(layer.index_query),
        "ik": w(layer.index_key),
        "iw": w(layer.index_weights),
        "o": w(layer.out),
        "sink": np.asarray(layer.sink[...], np.float64),
    }


def oracle_index_scores(wt, x):
    """[B, T, R=T] float64 indexer scores; -inf on rows after the token."""
    B, T, _ = x.shape
    iq = (x @ wt["iq"]).reshape(B, T, HI, DI)
    ik = x @ wt["ik"]
    iw = x @ wt["iw"]
    scores = np.full((B, T, T), -np.inf)
    for b in range(B):
        for t in range(T):
            for r in range(t + 1):
                relu = np.maximum(iq[b, t] @ ik[b, r], 0.0)
                scores[b, t, r] = (iw[b, t] * relu).sum() / np.sqrt(HI * DI)
    return scores


def oracle_layer(wt, x, rows_of):
    """float64 layer output; ``rows_of(b, t)`` lists the cache rows token (b, t) attends to."""
    x = np.asarray(x, np.float64)
    B, T, _ = x.shape
    q = (x @ wt["q"]).reshape(B, T, H, D)
    kv = x @ wt["kv"]
    o = np.zeros((B, T, H, D))
    for b in range(B):
        for t in range(T):
            x_rows = kv[b, list(rows_of(b, t))]
            for h in range(H):
                logits = x_rows @ q[b, t, h] * D**-0.5
                m = max(logits.max(), wt["sink"][h])
                e = np.exp(logits - m)
                o[b, t, h] = e @ x_rows / (e.sum() + np.exp(wt["sink"][h] - m))
    return o.reshape(B, T, H * D) @ wt["o"]


SINK = [0.5, -1.0, 2.0, 0.0]


@pytest.mark.slow  # several seconds: CI runs it with the slow tests
@pytest.mark.parametrize("dtype, tol", [(None, 2e-5), (jnp.bfloat16, 6e-2)])
def test_topk_covering_the_sequence_is_dense_causal_attention(dtype, tol):
    B, T = 2, 6
    layer = make_layer(topk=T + 2, dtype=dtype, sink=SINK)
    x = inputs(B, T)
    y = nnx.jit(lambda m, x: m(x))(layer, x)
    assert y.shape == (B, T, E)
    assert y.dtype == (dtype or jnp.float32)
    want = oracle_layer(weights(layer), np.asarray(x), lambda b, t: range(t + 1))
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=tol, atol=tol)
    # The same through a cache larger than the sequence (rows past T are never written).
    cache = layer.init_cache(B, T + 3)
    # bf16 rows are stored as their uint16 bit patterns (in-place updates on XLA:CPU).
    assert cache.kv.dtype == (jnp.uint16 if dtype == jnp.bfloat16 else jnp.float32)
    assert cache.values().kv.dtype == (dtype or jnp.float32)
    y_cached, cache = nnx.jit(lambda m, x, c: m(x, c))(layer, x, cache)
    np.testing.assert_allclose(np.asarray(y_cached, np.float64), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("selection", [pytest.param("dense", marks=pytest.mark.slow), STREAMING])
def test_sparse_selection_matches_numpy_oracle(selection):
    B, T, K = 2, 9, 3
    layer = make_layer(topk=K, seed=3, sink=SINK, selection=selection)
    x = inputs(B, T, seed=4)
    wt = weights(layer)
    scores = oracle_index_scores(wt, np.asarray(x, np.float64))

    def rows_of(b, t):
        # Highest scores first, lower row first on ties (the layer's documented order).
        order = sorted(range(t + 1), key=lambda r: (-scores[b, t, r], r))
        chosen = order[:K]
        if len(order) > K:
            # The case must not sit on a float32 near-tie at the boundary, or the test is luck.
            gap = scores[b, t, order[K - 1]] - scores[b, t, order[K]]
            assert gap == 0 or gap > 1e-4, f"degenerate test data at b={b}, t={t}"
        return chosen

    want = oracle_layer(wt, np.asarray(x), rows_of)
    picked = np.asarray(layer.select_rows(x))
    assert picked.shape == (B, T, K)
    for b in range(B):
        for t in range(T):
            chosen = rows_of(b, t)
            assert picked[b, t].tolist() == chosen + [-1] * (K - len(chosen)), (b, t)
    y = nnx.jit(lambda m, x: m(x))(layer, x)
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-5, atol=2e-5)
    # A sparse selection really differs from dense attention here.
    dense = oracle_layer(wt, np.asarray(x), lambda b, t: range(t + 1))
    assert np.abs(dense - want).max() > 1e-2


def test_indexer_scores_and_topk_rows():
    rng = np.random.default_rng(5)
    B, T, R, K = 2, 3, 5, 4
    iq = rng.standard_normal((B, T, HI, DI)).astype(np.float32)
    iw = rng.standard_normal((B, T, HI)).astype(np.float32)
    ik = rng.standard_normal((B, R, DI)).astype(np.float32)
    positions = np.array([[0, 1, 2], [2, 3, 4]], np.int32)
    got = np.asarray(indexer_scores(iq, iw, ik, positions))
    for b in range(B):
        for t in range(T):
            for r in range(R):
                if r > positions[b, t]:
                    assert got[b, t, r] == -np.inf
                else:
                    dots = iq[b, t].astype(np.float64) @ ik[b, r].astype(np.float64)
                    want = (iw[b, t] * np.maximum(dots, 0)).sum() / np.sqrt(HI * DI)
                    np.testing.assert_allclose(got[b, t, r], want, rtol=1e-5, atol=1e-6)
    idx = np.asarray(select_topk_rows(jnp.asarray(got), K))
    assert idx.shape == (B, T, K) and idx.dtype == np.int32
    for b in range(B):
        for t in range(T):
            valid = positions[b, t] + 1
            order = sorted(range(valid), key=lambda r: (-got[b, t, r], r))[:K]
            want = order + [-1] * (K - len(order))
            assert idx[b, t].tolist() == want
    # topk larger than the cache: one slot per row.
    assert select_topk_rows(jnp.asarray(got), 50).shape == (B, T, R)


@pytest.mark.parametrize("prefill, selection",
                         [(1, "dense"), pytest.param(5, STREAMING, marks=pytest.mark.slow)])
def test_prefill_then_decode_matches_the_full_sequence(prefill, selection):
    B, T, K, max_len = 2, 9, 3, 12
    layer = make_layer(topk=K, seed=6, sink=SINK, selection=selection)
    x = inputs(B, T, seed=7)
    full = nnx.jit(lambda m, x: m(x))(layer, x)

    step = nnx.jit(lambda m, x, c: m(x, c))
    cache = layer.init_cache(B, max_len)
    y, cache = step(layer, x[:, :prefill], cache)
    pieces = [y]
    for t in range(prefill, T):
        y, cache = step(layer, x[:, t : t + 1], cache)
        pieces.append(y)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(pieces, 1)), np.asarray(full), atol=1e-5)
    assert cache.length.tolist() == [T] * B
    # Rows past the written length are still the zeros of init_cache.
    assert not np.asarray(cache.kv[:, T:]).any()


@pytest.mark.slow
def test_sequences_at_different_positions_use_their_own_cache():
    T, K, max_len = 6, 4, 8
    layer = make_layer(topk=K, seed=8, sink=SINK)
    x = inputs(2, T, seed=9)
    step = nnx.jit(lambda m, x, c: m(x, c))
    # Sequence 0 prefilled with 4 tokens, sequence 1 with 2: fill separately, then stack.
    c0 = step(layer, x[:1, :4], layer.init_cache(1, max_len))[1]
    c1 = step(layer, x[1:, :2], layer.init_cache(1, max_len))[1]
    both = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), c0, c1)
    new = jnp.stack([x[0, 4], x[1, 2]])[:, None]
    y, both = step(layer, new, both)
    assert both.length.tolist() == [5, 3]
    want0 = nnx.jit(lambda m, x: m(x))(layer, x[:1, :5])[:, 4]
    want1 = nnx.jit(lambda m, x: m(x))(layer, x[1:, :3])[:, 2]
    np.testing.assert_allclose(np.asarray(y[:, 0]), np.concatenate([want0, want1]), atol=1e-5)


def test_tokens_beyond_the_cache_are_not_stored_and_give_nan():
    layer = make_layer(topk=4, seed=10)
    x = inputs(1, 5, seed=11)
    step = nnx.jit(lambda m, x, c: m(x, c))
    _, cache = step(layer, x[:, :4], layer.init_cache(1, 4))
    y, after = step(layer, x[:, 4:], cache)
    np.testing.assert_array_equal(np.asarray(after.kv), np.asarray(cache.kv))
    np.testing.assert_array_equal(np.asarray(after.index_keys), np.asarray(cache.index_keys))
    # Its row was not stored: a finite output would be a wrong one (tests/test_cache_capacity.py).
    assert np.isnan(np.asarray(y)).all()
    assert after.length.tolist() == [5] and after.capacity == 4


def dense_layer_jnp(params, x):
    """Dense causal attention with sinks in plain jnp (independent of the op), for gradients."""
    B, T, _ = x.shape
    q = (x @ params["q"]).reshape(B, T, H, D)
    kv = x @ params["kv"]
    logits = jnp.einsum("bthd,brd->bthr", q, kv) * D**-0.5
    causal = jnp.tril(jnp.ones((T, T), bool))[None, :, None, :]
    logits = jnp.where(causal, logits, -jnp.inf)
    sink = jnp.broadcast_to(params["sink"][None, None, :, None], (B, T, H, 1))
    p = jax.nn.softmax(jnp.concatenate([logits, sink], -1), -1)[..., :T]
    o = jnp.einsum("bthr,brd->bthd", p, kv)
    return o.reshape(B, T, H * D) @ params["o"]


@pytest.mark.slow  # several seconds: CI runs it with the slow tests
def test_gradients_with_flax_transforms():
    B, T = 2, 5
    layer = make_layer(topk=T, seed=12, sink=SINK)
    x = inputs(B, T, seed=13)
    target = jax.random.normal(jax.random.key(14), (B, T, E))

    def loss(model, x):
        return jnp.mean((model(x) - target) ** 2)

    value, grads = nnx.jit(nnx.value_and_grad(loss))(layer, x)
    g = {
        "q": grads.query.kernel[...],
        "kv": grads.kv.kernel[...],
        "o": grads.out.kernel[...],
        "sink": grads.sink[...],
    }
    for name, grad in g.items():
        assert np.isfinite(np.asarray(grad)).all(), name
        assert np.abs(np.asarray(grad)).max() > 0, name
    # The top-k indices carry no gradient: the indexer learns only from a separate loss.
    for linear in (grads.index_query, grads.index_key, grads.index_weights):
        assert not np.asarray(linear.kernel[...]).any()

    # topk covers the sequence, so the gradients are those of dense causal attention with sinks.
    params = {k: jnp.asarray(v, jnp.float32) for k, v in weights(layer).items()}
    want_value, want = jax.value_and_grad(
        lambda p: jnp.mean((dense_layer_jnp(p, x) - target) ** 2)
    )(params)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for name in g:
        np.testing.assert_allclose(
            np.asarray(g[name]), np.asarray(want[name]), rtol=1e-4, atol=1e-6, err_msg=name
        )

    # nnx.grad works too (same gradient as value_and_grad).
    sink_grad = nnx.grad(loss)(layer, x).sink[...]
    np.testing.assert_allclose(np.asarray(sink_grad), np.asarray(g["sink"]), rtol=1e-6)


def test_clear_errors():
    layer = make_layer(topk=2)
    with pytest.raises(ValueError, match=r"x must have shape \[B, T, E\] with E = 16"):
        layer(jnp.zeros((3, E)))
    with pytest.raises(ValueError, match=r"cache.kv must have shape \(2, 4, 8\)"):
        bad = SparseAttentionCache(
            jnp.zeros((2, 4, 7)), jnp.zeros((2, 4, DI)), jnp.zeros((2,), jnp.int32)
        )
        layer(jnp.zeros((2, 1, E)), bad)
    with pytest.raises(ValueError, match="topk must be a positive integer"):
        SparseAttention(E, H, D, 0, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="sparse must be a bool"):
        layer.indexer_loss(jnp.zeros((1, 2, E)), sparse="yes")


# A +inf sink's head adds nothing (tests/test_indexer_kl.py checks that rule by default).
@pytest.mark.parametrize("sink", [SINK, pytest.param([np.inf] + list(SINK[1:]),
                                                     marks=pytest.mark.slow)],
                         ids=["finite", "plus_inf"])
def test_indexer_loss_matches_numpy_and_trains_only_the_indexer(sink):
    B, T, K = 2, 7, 3
    layer = make_layer(topk=K, seed=15, sink=sink)
    x = inputs(B, T, seed=16)
    wt = weights(layer)
    xs = np.asarray(x, np.float64)
    scores = oracle_index_scores(wt, xs)
    q = (xs @ wt["q"]).reshape(B, T, H, D)
    kv = xs @ wt["kv"]
    want_loss, want_mass = 0.0, 0.0
    for b in range(B):
        for t in range(T):
            target = np.zeros(t + 1)
            for h in range(H):
                if wt["sink"][h] == np.inf:
                    continue  # the sink takes all of this head's attention: nothing to distil
                logits = kv[b, : t + 1] @ q[b, t, h] * D**-0.5
                m = max(logits.max(), wt["sink"][h])
                e = np.exp(logits - m)
                target += e / (e.sum() + np.exp(wt["sink"][h] - m))
            target /= target.sum()
            s = scores[b, t, : t + 1]
            log_pred = s - s.max() - np.log(np.exp(s - s.max()).sum())
            want_loss += (target * (np.log(target) - log_pred)).sum() / (B * T)
            chosen = sorted(range(t + 1), key=lambda r: (-s[r], r))[:K]
            want_mass += target[chosen].sum() / (B * T)

    (loss, mass), grads = nnx.jit(nnx.value_and_grad(lambda m, x: m.indexer_loss(x), has_aux=True))(
        layer, x
    )
    np.testing.assert_allclose(loss, want_loss, rtol=1e-4)
    np.testing.assert_allclose(mass, want_mass, rtol=1e-5)
    assert 0 < float(mass) < 1
    for linear in (grads.index_query, grads.index_key, grads.index_weights):
        grad = np.asarray(linear.kernel[...])
        assert np.isfinite(grad).all() and np.abs(grad).max() > 0
    for linear in (grads.query, grads.kv, grads.out):
        assert not np.asarray(linear.kernel[...]).any()
    assert not np.asarray(grads.sink[...]).any()


# --- compressed rows, the sliding window, the bf16 cache, the sparse indexer loss -----------------


def pooled(a, ratio):
    """[B, N, X] float64 -> [B, N // ratio, X]: means of consecutive blocks of ``ratio`` rows."""
    B, N, X = a.shape
    n = N // ratio
    return a[:, : n * ratio].reshape(B, n, ratio, X).mean(2)


def oracle_parts(wt, x, ratio):
    """float64 projections: q [B,T,H,D], raw rows [B,T,D], selectable rows and their indexer keys
    (pooled when ratio > 1), iq [B,T,HI,DI], iw [B,T,HI]."""
    B, T, _ = x.shape
    q = (x @ wt["q"]).reshape(B, T, H, D)
    raw = x @ wt["kv"]
    ik = x @ wt["ik"]
    rows, keys = (raw, ik) if ratio == 1 else (pooled(raw, ratio), pooled(ik, ratio))
    return q, raw, rows, keys, (x @ wt["iq"]).reshape(B, T, HI, DI), x @ wt["iw"]


def oracle_selection(keys, iq, iw, ratio, K):
    """Top-K selectable rows per token (float64 scores, ties to the lower row), with a check that
    the test data has no float32 near-tie at the boundary."""
    B, T = iq.shape[:2]
    chosen = {}
    for b in range(B):
        for t in range(T):
            n = min((t + 1) // ratio, keys.shape[1])
            s = [(iw[b, t] * np.maximum(iq[b, t] @ keys[b, r], 0)).sum() / np.sqrt(HI * DI)
                 for r in range(n)]
            order = sorted(range(n), key=lambda r: (-s[r], r))
            if n > K:
                gap = s[order[K - 1]] - s[order[K]]
                assert gap == 0 or gap > 1e-4, f"degenerate test data at b={b}, t={t}"
            chosen[b, t] = order[:K]
    return chosen


def oracle_attention(wt, q, attended):
    """float64 layer output; ``attended[b, t]`` is the [n, D] matrix of rows token (b, t) attends
    to (each row once); softmax with the sink in the denominator."""
    B, T = q.shape[:2]
    o = np.zeros((B, T, H, D))
    for b in range(B):
        for t in range(T):
            rows = attended[b, t]
            for h in range(H):
                logits = rows @ q[b, t, h] * D**-0.5
                m = max(logits.max(initial=-np.inf), wt["sink"][h])
                e = np.exp(logits - m)
                o[b, t, h] = e @ rows / (e.sum() + np.exp(wt["sink"][h] - m))
    return o.reshape(B, T, H * D) @ wt["o"]


def oracle_v4_layer(wt, x, ratio, window, K):
    """The layer with compress_ratio and window, in float64: selected (compressed) rows and the
    window's raw rows; with ratio 1 the union of the two sets of rows (no row twice)."""
    x = np.asarray(x, np.float64)
    q, raw, rows, keys, iq, iw = oracle_parts(wt, x, ratio)
    chosen = oracle_selection(keys, iq, iw, ratio, K)
    attended = {}
    for (b, t), sel in chosen.items():
        win = list(range(max(0, t - window + 1), t + 1)) if window else []
        if ratio == 1:
            attended[b, t] = raw[b, sorted(set(sel) | set(win))]
        else:
            attended[b, t] = np.concatenate([rows[b, sel], raw[b, win]]).reshape(-1, D)
    return oracle_attention(wt, q, attended), chosen


@pytest.mark.parametrize("ratio, window, selection", [
    pytest.param(4, None, "dense", marks=pytest.mark.slow),
    pytest.param(1, 3, "dense", marks=pytest.mark.slow),
    pytest.param(3, 4, "dense", marks=pytest.mark.slow),
    pytest.param(3, 4, STREAMING, marks=pytest.mark.slow)],
    ids=["compressed", "window", "compressed+window", "compressed+window-streaming"])
def test_compressed_rows_and_window_match_numpy_oracle(ratio, window, selection):
    B, T, K = 2, 13, 2
    layer = make_layer(topk=K, seed=21, sink=SINK, compress_ratio=ratio, window=window,
                       selection=selection)
    x = inputs(B, T, seed=22)
    want, chosen = oracle_v4_layer(weights(layer), x, ratio, window, K)
    picked = np.asarray(layer.select_rows(x))
    for (b, t), sel in chosen.items():
        assert picked[b, t].tolist() == sel + [-1] * (K - len(sel)), (b, t)
    y = nnx.jit(lambda m, x: m(x))(layer, x)
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-5, atol=2e-5)
    # A real difference from plain top-k over raw rows (the options do something).
    plain = make_layer(topk=K, seed=21, sink=SINK)
    assert np.abs(np.asarray(plain(x)) - want).max() > 1e-3

    # Through a cache, prefill then one token at a time (blocks complete across calls).
    step = nnx.jit(lambda m, x, c: m(x, c))
    cache = layer.init_cache(B, 16)
    pieces = []
    for lo, hi in [(0, 5)] + [(t, t + 1) for t in range(5, T)]:
        y_part, cache = step(layer, x[:, lo:hi], cache)
        pieces.append(y_part)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(pieces, 1)), want, rtol=2e-5, atol=2e-5)
    if ratio > 1:
        # The cached compressed rows are the block means of the raw rows written so far.
        raw = np.asarray(x, np.float64) @ weights(layer)["kv"]
        got = np.asarray(cache.kv)[:, : T // ratio]
        np.testing.assert_allclose(got, pooled(raw, ratio), rtol=1e-5, atol=1e-6)
        assert not np.asarray(cache.kv)[:, T // ratio:].any()  # incomplete block: not written


@pytest.mark.slow
def test_bf16_cache_is_stored_as_bits_and_decodes_like_the_full_sequence():
    B, T, K = 1, 7, 3
    layer = make_layer(topk=K, seed=23, dtype=jnp.bfloat16, sink=SINK, compress_ratio=2, window=2)
    x = inputs(B, T, seed=24).astype(jnp.bfloat16)
    full = nnx.jit(lambda m, x: m(x))(layer, x)
    step = nnx.jit(lambda m, x, c: m(x, c), donate_argnums=2)
    cache = layer.init_cache(B, 8)
    assert {a.dtype for a in (cache.kv, cache.index_keys, cache.raw_kv)} == {jnp.dtype(jnp.uint16)}
    pieces = []
    for t in range(T):
        y, cache = step(layer, x[:, t : t + 1], cache)
        pieces.append(y)
    np.testing.assert_array_equal(np.asarray(jnp.concatenate(pieces, 1), np.float32),
                                  np.asarray(full, np.float32))
    # The stored bits are the bf16 rows of the projection.
    rows = np.asarray(layer.kv(x), np.float32)
    np.testing.assert_array_equal(np.asarray(cache.values().raw_kv[:, :T], np.float32), rows)


@pytest.mark.slow
@pytest.mark.parametrize("ratio, window", [(1, None), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_streaming_decode_over_a_bf16_cache_matches_the_full_sequence(ratio, window, monkeypatch):
    # A decode step selects among the cache's rows as stored (bits) and its own rows apart, then
    # merges; the 3-token prefill (above the limit set here) writes its keys first and selects
    # over the written cache. Both: the same rows and outputs as the whole sequence at once.
    monkeypatch.setattr(flax_layer, "SPLIT_SELECTION_MAX_TOKENS", 2)
    B, T, K = 2, 9, 3
    layer = make_layer(topk=K, seed=25, dtype=jnp.bfloat16, sink=SINK, selection=STREAMING,
                       compress_ratio=ratio, window=window)
    x = inputs(B, T, seed=26).astype(jnp.bfloat16)
    full = nnx.jit(lambda m, x: m(x))(layer, x)
    rows = nnx.jit(lambda m, x: m.select_rows(x))(layer, x)
    step = nnx.jit(lambda m, x, c: m(x, c), donate_argnums=2)
    select = nnx.jit(lambda m, x, c: m.select_rows(x, c))
    cache = layer.init_cache(B, 12)
    y, cache = step(layer, x[:, :3], cache)
    pieces = [y]
    for t in range(3, T):
        np.testing.assert_array_equal(np.asarray(select(layer, x[:, t : t + 1], cache)),
                                      np.asarray(rows[:, t : t + 1]))
        y, cache = step(layer, x[:, t : t + 1], cache)
        pieces.append(y)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(pieces, 1), np.float32),
                               np.asarray(full, np.float32), rtol=2e-2, atol=2e-2)
    keys = np.asarray(layer.index_key(x), np.float32)
    if ratio == 1:  # the index keys are written after the selection, as the rows they are
        np.testing.assert_array_equal(np.asarray(cache.values().index_keys[:, :T], np.float32),
                                      keys)


@pytest.mark.parametrize("ratio", [1, 2])
def test_cached_selection_gives_ties_to_the_lower_row_across_the_call(ratio):
    # Every score 0 (zero index weights): a token selects its first valid rows in order, the
    # cache's rows before the call's own (which come from the other selection of the merge).
    K, L, T = 6, 5, 4
    layer = make_layer(topk=K, seed=27, selection=STREAMING, compress_ratio=ratio)
    layer.index_weights.kernel[...] = jnp.zeros_like(layer.index_weights.kernel[...])
    x = inputs(1, L + T, seed=28)
    _, cache = nnx.jit(lambda m, x, c: m(x, c))(layer, x[:, :L], layer.init_cache(1, 16))
    got = np.asarray(nnx.jit(lambda m, x, c: m.select_rows(x, c))(layer, x[:, L:], cache))
    for t in range(T):
        valid = (L + t + 1) // ratio  # complete rows at position L + t
        want = [r if r < valid else -1 for r in range(K)]
        assert got[0, t].tolist() == want, (t, got[0, t])


@pytest.mark.parametrize("ratio, batch", [pytest.param(1, 1, marks=pytest.mark.slow), (4, 1),
                                          pytest.param(1, 3, marks=pytest.mark.slow)])
def test_a_decode_step_never_copies_the_index_key_cache(ratio, batch):
    # A donated decode step reads the key cache in place (its bits, block by block) and updates it
    # in place. Selecting over the written cache, XLA:CPU made a bf16 view of the whole cache (a
    # copy) and kept another to order the update after the read: 28 of 74 ms at 1M rows. With
    # several sequences, the vmap rule's per-sequence calls copied each sequence's keys.
    R, Di = 2**18, 64
    layer = SparseAttention(64, 2, 32, 256, index_heads=4, index_dim=Di, dtype=jnp.bfloat16,
                            compress_ratio=ratio, rngs=nnx.Rngs(0))
    cache = layer.init_cache(batch, R * ratio)
    graph, state = nnx.split(layer)
    step = jax.jit(lambda s, x, c: nnx.merge(graph, s)(x, c), donate_argnums=2)
    compiled = step.lower(state, jnp.zeros((batch, 1, 64), jnp.bfloat16), cache).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < R * Di * 2 // 2, f"{temp / 2**20:.1f} MiB of temporaries (the keys: 32 MiB)"


def test_v4_options_are_checked():
    with pytest.raises(ValueError, match="compress_ratio must be a positive integer"):
        make_layer(topk=2, compress_ratio=0)
    with pytest.raises(ValueError, match="window must be a positive integer"):
        make_layer(topk=2, window=0)
    with pytest.raises(ValueError, match="selection must be one of"):
        make_layer(topk=2, selection="approximate")
    layer = make_layer(topk=2, compress_ratio=4)
    with pytest.raises(ValueError, match="max_len must be at least compress_ratio = 4"):
        layer.init_cache(1, 3)
    plain_cache = make_layer(topk=2).init_cache(1, 8)
    with pytest.raises(ValueError, match="needs raw_kv and raw_index_keys"):
        layer(jnp.zeros((1, 1, E)), plain_cache)
    with pytest.raises(ValueError, match="belongs to a layer with compress_ratio > 1"):
        make_layer(topk=2)(jnp.zeros((1, 1, E)), layer.init_cache(1, 8))


def oracle_sparse_indexer_loss(wt, x, ratio, K):
    """float64 sparse indexer loss: per token, over its selected rows S, the layer's attention
    (sink in each head's denominator) summed over heads and normalised, against the softmax of
    the indexer scores over S; KL averaged over the tokens with a selected row. Also the mean of
    exp(-KL) over them (the agreement of the two distributions)."""
    x = np.asarray(x, np.float64)
    q, _, rows, keys, iq, iw = oracle_parts(wt, x, ratio)
    chosen = oracle_selection(keys, iq, iw, ratio, K)
    count = sum(1 for sel in chosen.values() if sel)
    loss, agreement = 0.0, 0.0
    for (b, t), sel in chosen.items():
        if not sel:
            continue
        r = rows[b, sel]
        target = np.zeros(len(sel))
        for h in range(H):
            if wt["sink"][h] == np.inf:
                continue
            logits = r @ q[b, t, h] * D**-0.5
            m = max(logits.max(), wt["sink"][h])
            e = np.exp(logits - m)
            target += e / (e.sum() + np.exp(wt["sink"][h] - m))
        target /= target.sum()
        s = np.array([(iw[b, t] * np.maximum(iq[b, t] @ keys[b, j], 0)).sum() / np.sqrt(HI * DI)
                      for j in sel])
        log_pred = s - s.max() - np.log(np.exp(s - s.max()).sum())
        kl = (target * (np.log(target) - log_pred)).sum()
        loss += kl / count
        agreement += np.exp(-kl) / count
    return loss, agreement


@pytest.mark.parametrize("ratio, selection", [
    (1, "dense"), (1, STREAMING), pytest.param(2, STREAMING, marks=pytest.mark.slow)],
    ids=["dense-selection", "streaming", "compressed-streaming"])
def test_sparse_indexer_loss_matches_numpy_and_trains_only_the_indexer(ratio, selection):
    B, T, K = 2, 9, 3
    layer = make_layer(topk=K, seed=25, sink=SINK, compress_ratio=ratio, selection=selection)
    x = inputs(B, T, seed=26)
    want_loss, want_agreement = oracle_sparse_indexer_loss(weights(layer), x, ratio, K)
    (loss, agreement), grads = nnx.jit(nnx.value_and_grad(
        lambda m, x: m.indexer_loss(x, sparse=True), has_aux=True))(layer, x)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-4)
    np.testing.assert_allclose(agreement, want_agreement, rtol=1e-5)
    assert want_loss > 1e-3 and 0 < float(agreement) < 1
    for linear in (grads.index_query, grads.index_key, grads.index_weights):
        grad = np.asarray(linear.kernel[...])
        assert np.isfinite(grad).all() and np.abs(grad).max() > 0
    for linear in (grads.query, grads.kv, grads.out):
        assert not np.asarray(linear.kernel[...]).any()
    assert not np.asarray(grads.sink[...]).any()


@pytest.mark.slow  # several seconds: CI runs it with the slow tests
def test_sparse_indexer_loss_gradient_is_the_oracle_gradient():
    # d loss / d W_iw by central differences of the float64 oracle, against jax.grad.
    B, T, K = 1, 7, 3
    layer = make_layer(topk=K, seed=27, sink=SINK)
    x = inputs(B, T, seed=28)
    grads = nnx.grad(lambda m, x: m.indexer_loss(x, sparse=True)[0])(layer, x)
    got = np.asarray(grads.index_weights.kernel[...], np.float64)
    wt = weights(layer)
    rng = np.random.default_rng(0)
    direction = rng.standard_normal(wt["iw"].shape)
    eps = 1e-5

    def at(shift):
        moved = dict(wt, iw=wt["iw"] + shift * direction)
        return oracle_sparse_indexer_loss(moved, x, 1, K)[0]

    want = (at(eps) - at(-eps)) / (2 * eps)
    np.testing.assert_allclose((got * direction).sum(), want, rtol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 3])
def test_long_calls_run_in_token_blocks_with_the_same_result(window, monkeypatch):
    import jax_sparse_attn.flax as layer_module

    B, T, K = 2, 11, 3
    layer = make_layer(topk=K, seed=29, sink=SINK, window=window)
    x = inputs(B, T, seed=30)
    want, _ = oracle_v4_layer(weights(layer), x, 1, window, K)
    monkeypatch.setattr(layer_module, "PREFILL_BLOCK_TOKENS", 4)  # read while tracing: 3 blocks
    y = nnx.jit(lambda m, x: m(x))(layer, x)
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-5, atol=2e-5)
    y_cached, _ = nnx.jit(lambda m, x, c: m(x, c))(layer, x, layer.init_cache(B, 16))
    np.testing.assert_allclose(np.asarray(y_cached), want, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
def test_dense_indexer_loss_over_compressed_rows_matches_numpy():
    # compress_ratio = 2: the target is the dense attention over the complete compressed rows;
    # token 0 (no complete block yet) is left out of the mean, with finite gradients.
    B, T, K, ratio = 1, 7, 2, 2
    layer = make_layer(topk=K, seed=31, sink=SINK, compress_ratio=ratio)
    x = inputs(B, T, seed=32)
    wt = weights(layer)
    q, _, rows, keys, iq, iw = oracle_parts(wt, np.asarray(x, np.float64), ratio)
    want = 0.0
    for t in range(T):
        n = (t + 1) // ratio
        if n == 0:
            continue
        target = np.zeros(n)
        for h in range(H):
            logits = rows[0, :n] @ q[0, t, h] * D**-0.5
            m = max(logits.max(), wt["sink"][h])
            e = np.exp(logits - m)
            target += e / (e.sum() + np.exp(wt["sink"][h] - m))
        target /= target.sum()
        s = np.array([(iw[0, t] * np.maximum(iq[0, t] @ keys[0, j], 0)).sum() / np.sqrt(HI * DI)
                      for j in range(n)])
        log_pred = s - s.max() - np.log(np.exp(s - s.max()).sum())
        want += (target * (np.log(target) - log_pred)).sum() / (T - (ratio - 1))
    (loss, _), grads = nnx.value_and_grad(lambda m, x: m.indexer_loss(x), has_aux=True)(layer, x)
    np.testing.assert_allclose(loss, want, rtol=1e-4)
    assert np.isfinite(np.asarray(grads.index_query.kernel[...])).all()


@pytest.mark.slow  # both NKI kernels under the host emulator
def test_layer_runs_both_kernels_emulated_and_matches_the_reference_layer():
    # implementation="nki_emulated" reaches the indexer's kernel and the attention's kernel; where
    # the two selections agree (here: everywhere) the outputs agree.
    x = jax.random.normal(jax.random.key(0), (1, 12, 32), jnp.float32)
    make = lambda impl: SparseAttention(32, 2, 16, 4, index_heads=2, index_dim=8,  # noqa: E731
                                        dtype=jnp.bfloat16, implementation=impl, rngs=nnx.Rngs(0))
    ref, emu = make(None), make("nki_emulated")
    np.testing.assert_array_equal(np.asarray(emu.select_rows(x)), np.asarray(ref.select_rows(x)))
    np.testing.assert_allclose(np.asarray(emu(x), np.float32), np.asarray(ref(x), np.float32),
                               atol=1e-2)
