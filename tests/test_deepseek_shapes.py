"""The DeepSeek-shaped arguments: ``topk_length``, ``value_dim`` and a second cache (``extra_kv``).

Every result is held to the float64 oracles of ``tests/oracle.py`` (or to the single-cache call on
the concatenation, bit for bit, where the contract says so); rows that no real slot selects hold
NaN, so any read of them would show.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_attn as jsa
from oracle import BF16, attention_bf16_contract, attention_f64, gather, lse_f64, within_one_ulp

IMPLEMENTATIONS = ["reference", "nki_emulated"]


def _case(rng, T=3, H=4, D=64, R=50, K=20):
    q = rng.standard_normal((T, H, D)).astype(BF16)
    kv = rng.standard_normal((R, D)).astype(BF16)
    idx = rng.integers(-1, R, size=(T, K)).astype(np.int32)
    sink = rng.standard_normal(H).astype(np.float32)
    return q, kv, idx, sink


def _poison_unselected(kv, idx, valid):
    """kv with NaN in every row that no valid slot selects."""
    kv = np.array(kv)
    used = np.zeros(len(kv), bool)
    used[idx[valid]] = True
    kv[~used] = np.nan
    return kv


# --- topk_length ---------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_topk_length_empties_the_tail_slots(rng, implementation):
    q, kv, idx, sink = _case(rng)
    T, K = idx.shape
    lengths = np.array([0, 7, K + 5], np.int64)  # none, some, all (beyond K: all)
    real = (np.arange(K)[None, :] < lengths[:, None]) & (idx >= 0)
    kv = _poison_unselected(kv, idx, real)
    out, lse = jsa.gathered_attn_idx(q, kv, idx, sink, topk_length=lengths, return_lse=True,
                                     implementation=implementation)
    x, valid = gather(kv, idx)
    valid &= real
    x[~valid] = 0
    assert within_one_ulp(np.asarray(out), attention_bf16_contract(q, x, valid, sink)) >= 0.999
    np.testing.assert_allclose(np.asarray(lse), lse_f64(q, x, valid, sink), rtol=1e-5, atol=1e-5)
    assert not np.asarray(out[0]).any()  # length 0: exactly 0

    g = np.where(real[..., None], gather(kv, idx)[0], np.nan).astype(BF16)  # tail rows NaN
    empty = np.where(idx >= 0, 0.0, -np.inf).astype(np.float32)  # idx's -1 slots
    out_g = jsa.gathered_attn(q, g, sink, bias=empty, topk_length=lengths,
                              implementation=implementation)
    np.testing.assert_array_equal(np.asarray(out_g, np.float32), np.asarray(out, np.float32))


def test_topk_length_gradient_never_reaches_tail_rows(rng):
    q, kv, idx, sink = _case(rng)
    idx = np.tile(np.arange(20, dtype=np.int32), (3, 1))
    lengths = np.array([3, 10, 20])

    def loss(q, kv):
        out = jsa.gathered_attn_idx(q, kv, idx, sink, topk_length=lengths)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    dq, dkv = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, kv)
    assert not np.asarray(dkv[20:]).any()  # never selected
    assert np.asarray(dkv[:20], np.float32).any()
    # The same gradient as the call with the tail slots set to -1 (the index rewrite it replaces).
    rewritten = np.where(np.arange(20)[None, :] < lengths[:, None], idx, -1)
    dq2, dkv2 = jax.jit(jax.grad(
        lambda q, kv: jnp.sum(jsa.gathered_attn_idx(q, kv, rewritten, sink).astype(jnp.float32) ** 2),
        argnums=(0, 1)))(q, kv)
    np.testing.assert_array_equal(np.asarray(dq, np.float32), np.asarray(dq2, np.float32))
    np.testing.assert_array_equal(np.asarray(dkv, np.float32), np.asarray(dkv2, np.float32))


def test_topk_length_under_vmap_and_fp8(rng):
    q, kv, idx, sink = _case(rng)
    B = 2
    qs, idxs = np.stack([q, q[::-1]]), np.stack([idx, idx[::-1]])
    lengths = np.array([[1, 5, 20], [20, 0, 3]])
    got = jax.vmap(lambda q, i, n: jsa.gathered_attn_idx(q, kv, i, sink, topk_length=n))(
        qs, idxs, lengths)
    for b in range(B):
        want = jsa.gathered_attn_idx(qs[b], kv, np.where(np.arange(20) < lengths[b][:, None],
                                                          idxs[b], -1), sink)
        np.testing.assert_array_equal(np.asarray(got[b], np.float32), np.asarray(want, np.float32))
    kv8 = np.asarray(kv, np.float32).astype(jnp.float8_e4m3fn)
    scale = np.ones(len(kv), np.float32)
    got8 = jsa.gathered_attn_idx(q, kv8, idx, sink, kv_scale=scale, topk_length=lengths[0])
    want8 = jsa.gathered_attn_idx(q, kv8, np.where(np.arange(20) < lengths[0][:, None], idx, -1),
                                  sink, kv_scale=scale)
    np.testing.assert_array_equal(np.asarray(got8, np.float32), np.asarray(want8, np.float32))


def test_topk_length_bad_input_names_the_argument(rng):
    q, kv, idx, sink = _case(rng)
    with pytest.raises(ValueError, match="topk_length must have shape"):
        jsa.gathered_attn_idx(q, kv, idx, topk_length=np.array([1, 2]))
    with pytest.raises(TypeError, match="topk_length must have an integer dtype"):
        jsa.gathered_attn_idx(q, kv, idx, topk_length=np.array([1.0, 2.0, 3.0]))


# --- value_dim ------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("D, V", [(80, 64), (200, 129), (64, 1)])
def test_value_dim_output_is_the_first_columns(rng, implementation, D, V):
    q, kv, idx, sink = _case(rng, D=D)
    kv[:, V:][rng.random(kv[:, V:].shape) < 0.3] = 0  # values beyond V never matter, logits do
    out, lse = jsa.gathered_attn_idx(q, kv, idx, sink, value_dim=V, return_lse=True,
                                     implementation=implementation)
    assert out.shape == (3, 4, V) and out.dtype == jnp.bfloat16
    x, valid = gather(kv, idx)
    assert within_one_ulp(np.asarray(out), attention_bf16_contract(q, x, valid, sink,
                                                                   value_dim=V)) >= 0.999
    np.testing.assert_allclose(np.asarray(lse), lse_f64(q, x, valid, sink), rtol=1e-5, atol=1e-5)
    g_out = jsa.gathered_attn(q, x, sink, bias=np.where(valid, 0, -np.inf), value_dim=V,
                              implementation=implementation)
    np.testing.assert_array_equal(np.asarray(g_out, np.float32), np.asarray(out, np.float32))


def test_value_dim_gradients_match_float64(rng):
    from oracle import central_differences

    T, H, D, R, K, V = 2, 2, 12, 9, 5, 8
    q = rng.standard_normal((T, H, D))
    kv = rng.standard_normal((R, D))
    idx = rng.integers(-1, R, size=(T, K))
    sink = rng.standard_normal(H)
    ct = rng.standard_normal((T, H, V))
    ct_lse = rng.standard_normal((T, H))

    def value(a):
        x, valid = gather(a["kv"], idx)
        return (np.sum(attention_f64(a["q"], x, valid, a["sink"], value_dim=V) * ct)
                + np.sum(lse_f64(a["q"], x, valid, a["sink"]) * ct_lse))

    want = central_differences(value, {"q": q, "kv": kv, "sink": sink}, ["q", "kv", "sink"])
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    op = lambda q, kv, s: jsa.gathered_attn_idx(q, kv, idx, s, value_dim=V, return_lse=True)  # noqa: E731
    # jitted: one program (eagerly, each operation of the rules compiles on its own)
    dq, dkv, dsink = jax.jit(lambda q, kv, s, c: jax.vjp(op, q, kv, s)[1](c))(
        f32(q), f32(kv), f32(sink), (f32(ct), f32(ct_lse)))
    for got, name in ((dq, "q"), (dkv, "kv"), (dsink, "sink")):
        np.testing.assert_allclose(np.asarray(got), want[name], rtol=2e-3, atol=2e-4, err_msg=name)
    # jvp: the directional derivative along q and kv.
    dirs = (rng.standard_normal(q.shape), rng.standard_normal(kv.shape))
    _, tangent = jax.jit(lambda p, t: jax.jvp(
        lambda q, kv: jsa.gathered_attn_idx(q, kv, idx, f32(sink), value_dim=V), p, t))(
            (f32(q), f32(kv)), tuple(map(f32, dirs)))
    eps = 1e-6
    x_p, valid = gather(kv + eps * dirs[1], idx)
    x_m, _ = gather(kv - eps * dirs[1], idx)
    fd = (attention_f64(q + eps * dirs[0], x_p, valid, sink, value_dim=V)
          - attention_f64(q - eps * dirs[0], x_m, valid, sink, value_dim=V)) / (2 * eps)
    np.testing.assert_allclose(np.asarray(tangent), fd, rtol=2e-3, atol=2e-4)


@pytest.mark.slow  # several seconds: CI runs it with the slow tests
def test_value_dim_vmap_merge_and_fp8(rng):
    q, kv, idx, sink = _case(rng, D=80)
    V = 64
    qs = np.stack([q, q[::-1]])
    kvs = np.stack([kv, kv[::-1]])
    got = jax.vmap(lambda q, kv: jsa.gathered_attn_idx(q, kv, idx, sink, value_dim=V))(qs, kvs)
    for b in range(2):
        want = jsa.gathered_attn_idx(qs[b], kvs[b], idx, sink, value_dim=V)
        np.testing.assert_array_equal(np.asarray(got[b], np.float32), np.asarray(want, np.float32))
    # Two halves of the slots merged by lse: the attention over all of them (float64 oracle).
    half = idx.shape[1] // 2
    a = jsa.gathered_attn_idx(q, kv, idx[:, :half], sink, value_dim=V, return_lse=True)
    b = jsa.gathered_attn_idx(q, kv, idx[:, half:], None, value_dim=V, return_lse=True)
    merged, _ = jsa.merge_attention([a[0], b[0]], [a[1], b[1]])
    x, valid = gather(kv, idx)
    np.testing.assert_allclose(np.asarray(merged, np.float64),
                               attention_f64(q, x, valid, sink, value_dim=V), atol=2e-2)
    # FP8: the value_dim columns of the dequantised rows.
    kv8 = np.asarray(kv, np.float32).astype(jnp.float8_e4m3fn)
    scale = rng.uniform(0.5, 2, size=(len(kv), 5)).astype(np.float32)  # G = 16
    for implementation in IMPLEMENTATIONS:
        out8 = jsa.gathered_attn_idx(q, kv8, idx, sink, kv_scale=scale, value_dim=V,
                                     implementation=implementation)
        deq = (kv8.astype(np.float32).reshape(len(kv), 5, 16) * scale[:, :, None]).reshape(
            len(kv), 80).astype(BF16)
        x, valid = gather(deq, idx)
        assert out8.shape == (3, 4, V)
        assert within_one_ulp(np.asarray(out8), attention_bf16_contract(q, x, valid, sink,
                                                                        value_dim=V)) >= 0.999


def test_value_dim_gradient_under_fp8_and_bad_values(rng):
    q, kv, idx, sink = _case(rng, D=80)
    kv8 = np.asarray(kv, np.float32).astype(jnp.float8_e4m3fn)
    dq = jax.jit(jax.grad(lambda q: jnp.sum(jsa.gathered_attn_idx(
        q, kv8, idx, sink, kv_scale=np.ones(len(kv), np.float32), value_dim=64,
        implementation="nki_emulated").astype(jnp.float32))))(q)
    dq_ref = jax.jit(jax.grad(lambda q: jnp.sum(jsa.gathered_attn_idx(
        q, kv8.astype(BF16), idx, sink, value_dim=64).astype(jnp.float32))))(q)
    np.testing.assert_allclose(np.asarray(dq, np.float32), np.asarray(dq_ref, np.float32),
                               rtol=1e-2, atol=1e-2)
    for bad in (0, 81, -1):
        with pytest.raises(ValueError, match="value_dim"):
            jsa.gathered_attn_idx(q, kv, idx, value_dim=bad)
    with pytest.raises(TypeError, match="value_dim"):
        jsa.gathered_attn(q, gather(kv, idx)[0], value_dim=64.0)


# --- two caches in one call ----------------------------------------------------------------------


def _two_caches(rng, T=3, H=4, D=64, R=50, K=20, R2=30, K2=7, dtype=BF16):
    q = rng.standard_normal((T, H, D)).astype(dtype)
    kv = rng.standard_normal((R, D)).astype(dtype)
    kv2 = rng.standard_normal((R2, D)).astype(dtype)
    idx = rng.integers(-1, R, size=(T, K)).astype(np.int32)
    idx2 = rng.integers(-1, R2, size=(T, K2)).astype(np.int32)
    sink = rng.standard_normal(H).astype(np.float32)
    return q, kv, kv2, idx, idx2, sink


def _concatenated(kv, kv2, idx, idx2):
    """The single-cache form of two caches (numpy): one cache, the extra indices moved by R."""
    R = len(kv)
    return np.concatenate([kv, kv2]), np.concatenate([idx, np.where(idx2 >= 0, idx2 + R, -1)], 1)


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_two_caches_equal_the_call_on_the_concatenation_bit_for_bit(rng, implementation):
    q, kv, kv2, idx, idx2, sink = _two_caches(rng)
    # Rows no slot selects, in either cache, hold NaN.
    kv = _poison_unselected(kv, idx, idx >= 0)
    kv2 = _poison_unselected(kv2, idx2, idx2 >= 0)
    T, K, K2 = 3, idx.shape[1], idx2.shape[1]
    bias = rng.standard_normal((T, K + K2)).astype(np.float32)
    bias[0, K + 1] = -np.inf
    lengths, lengths2 = np.array([K, 3, 0]), np.array([0, K2, 2])
    got = jsa.gathered_attn_idx(q, kv, idx, sink, bias=bias, extra_kv=kv2, extra_idx=idx2,
                                topk_length=lengths, extra_topk_length=lengths2, value_dim=48,
                                return_lse=True, implementation=implementation)
    cat, idx_cat = _concatenated(kv, kv2, idx, idx2)
    lengths_cat = np.concatenate([np.arange(K)[None] < lengths[:, None],
                                  np.arange(K2)[None] < lengths2[:, None]], 1)
    idx_cat = np.where(lengths_cat, idx_cat, -1)
    want = jsa.gathered_attn_idx(q, cat, idx_cat, sink, bias=bias, value_dim=48, return_lse=True,
                                 implementation=implementation)
    # Bit for bit on both paths (on nki_emulated the kernel's arithmetic is the same whichever
    # way its rows arrive).
    _same_bits(got[0], want[0])
    _same_bits(got[1], want[1])
    x, valid = gather(cat, idx_cat)
    x[~valid] = 0
    assert within_one_ulp(np.asarray(got[0]), attention_bf16_contract(
        q, x, valid, sink, bias, value_dim=48)) >= 0.999
    assert np.isfinite(np.asarray(got[0], np.float32)).all()


@pytest.mark.parametrize("target", [pytest.param("trn2", marks=pytest.mark.slow), "trn1"])
def test_the_kernel_reads_both_caches_where_it_has_indirect_dma(rng, monkeypatch, target):
    # K = 100: the first 128-slot tile holds 100 main slots and 28 of the window's, so it reads
    # both caches; NaN in every row no slot selects. On trn1 (no indirect DMA) XLA gathers.
    from jax_sparse_attn import nki_emulator
    from jax_sparse_attn.attention import kernel

    monkeypatch.setenv(nki_emulator.TARGET_ENV, target)
    jax.clear_caches()
    q, kv, kv2, idx, idx2, sink = _two_caches(rng, T=2, R=120, K=100, R2=40, K2=60)
    kv = _poison_unselected(kv, idx, idx >= 0)
    kv2 = _poison_unselected(kv2, idx2, idx2 >= 0)
    tiles = []
    sources = kernel._tile_sources
    monkeypatch.setattr(kernel, "_tile_sources", lambda src, index, tile, *only: tiles.append(
        (tile, src.extra_rows is not None, len(sources(src, index, tile, *only))))
        or sources(src, index, tile, *only))
    out, lse = jsa.gathered_attn_idx(q, kv, idx, sink, extra_kv=kv2, extra_idx=idx2,
                                     return_lse=True, implementation="nki_emulated")
    # Each token: tile 0 from both caches, tile 1 from the window alone.
    assert set(tiles) == ({(0, True, 2), (1, True, 1)} if target == "trn2" else set())
    cat, idx_cat = _concatenated(kv, kv2, idx, idx2)
    want = jsa.gathered_attn_idx(q, cat, idx_cat, sink, return_lse=True,
                                 implementation="nki_emulated")
    _same_bits(out, want[0])
    _same_bits(lse, want[1])
    x, valid = gather(cat, idx_cat)
    x[~valid] = 0
    assert within_one_ulp(np.asarray(out), attention_bf16_contract(q, x, valid, sink)) >= 0.999
    jax.clear_caches()


@pytest.mark.slow  # several seconds: CI runs it with the slow tests
def test_two_caches_gradients_reach_both(rng):
    q, kv, kv2, idx, idx2, sink = _two_caches(rng, dtype=np.float32)
    unselected = np.ones(len(kv2), bool)
    unselected[idx2[idx2 >= 0]] = False
    kv2[unselected] = np.nan
    T, K2 = 3, idx2.shape[1]
    bias = rng.standard_normal((T, idx.shape[1] + K2)).astype(np.float32)

    def loss(q, kv, kv2, sink, bias):
        out, lse = jsa.gathered_attn_idx(q, kv, idx, sink, bias=bias, extra_kv=kv2,
                                         extra_idx=idx2, return_lse=True)
        return jnp.sum(out ** 2) + jnp.sum(jnp.sin(lse))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, kv, kv2, sink, bias)
    cat, idx_cat = _concatenated(kv, kv2, idx, idx2)

    def loss_cat(q, cat, sink, bias):
        out, lse = jsa.gathered_attn_idx(q, cat, idx_cat, sink, bias=bias, return_lse=True)
        return jnp.sum(out ** 2) + jnp.sum(jnp.sin(lse))

    dq, dcat, dsink, dbias = jax.jit(jax.grad(loss_cat, argnums=(0, 1, 2, 3)))(q, cat, sink, bias)
    assert np.isfinite(np.asarray(grads[2])).all()
    assert not np.asarray(grads[2])[unselected].any() and np.asarray(grads[2]).any()
    for got, want in ((grads[0], dq), (np.concatenate([grads[1], grads[2]]), dcat),
                      (grads[3], dsink), (grads[4], dbias)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # And against float64 central differences of the union's attention, for the second cache.
    from oracle import central_differences

    ct = rng.standard_normal((3, 4, 64))

    def value(a):
        c, i = _concatenated(kv, a["kv2"], idx, idx2)
        x, valid = gather(c, i)
        return np.sum(attention_f64(q, x, valid, sink, bias) * ct)

    small = {"kv2": np.where(unselected[:, None], 0.0, kv2).astype(np.float64)}
    fd = central_differences(value, small, ["kv2"])["kv2"]
    _, vjp = jax.vjp(lambda kv2: jsa.gathered_attn_idx(q, kv, idx, sink, bias=bias, extra_kv=kv2,
                                                       extra_idx=idx2), kv2)
    np.testing.assert_allclose(np.asarray(vjp(jnp.asarray(ct, jnp.float32))[0])[~unselected],
                               fd[~unselected], rtol=2e-3, atol=2e-4)


@pytest.mark.slow  # several seconds: CI runs it with the slow tests
def test_two_caches_under_vmap_and_jvp(rng):
    q, kv, kv2, idx, idx2, sink = _two_caches(rng, dtype=np.float32)
    B = 2
    kvs2 = np.stack([kv2, kv2[::-1]])
    qs = np.stack([q, q[::-1]])
    f = lambda q, kv2: jsa.gathered_attn_idx(q, kv, idx, sink, extra_kv=kv2, extra_idx=idx2)  # noqa: E731
    got = jax.vmap(f)(qs, kvs2)
    for b in range(B):
        np.testing.assert_array_equal(np.asarray(got[b]), np.asarray(f(qs[b], kvs2[b])))
    grads = jax.vmap(jax.grad(lambda q, kv2: jnp.sum(f(q, kv2) ** 2), argnums=1))(qs, kvs2)
    for b in range(B):
        one = jax.grad(lambda kv2: jnp.sum(f(qs[b], kv2) ** 2))(kvs2[b])
        np.testing.assert_allclose(np.asarray(grads[b]), np.asarray(one), rtol=1e-6, atol=1e-7)
    d = rng.standard_normal(kv2.shape).astype(np.float32)
    _, tangent = jax.jvp(lambda kv2: f(q, kv2), (kv2,), (d,))
    eps = 1e-3
    fd = (np.asarray(f(q, kv2 + eps * d), np.float64) - np.asarray(f(q, kv2 - eps * d))) / (2 * eps)
    np.testing.assert_allclose(np.asarray(tangent), fd, rtol=1e-2, atol=1e-3)


def test_two_caches_bad_input_names_the_argument(rng):
    q, kv, kv2, idx, idx2, sink = _two_caches(rng)
    with pytest.raises(ValueError, match="extra_kv needs extra_idx"):
        jsa.gathered_attn_idx(q, kv, idx, extra_kv=kv2)
    with pytest.raises(ValueError, match="extra_idx is for a second cache"):
        jsa.gathered_attn_idx(q, kv, idx, extra_idx=idx2)
    with pytest.raises(ValueError, match="extra_topk_length is for a second cache"):
        jsa.gathered_attn_idx(q, kv, idx, extra_topk_length=np.ones(3, int))
    with pytest.raises(ValueError, match="extra_kv must have shape"):
        jsa.gathered_attn_idx(q, kv, idx, extra_kv=kv2[:, :8], extra_idx=idx2)
    with pytest.raises(ValueError, match="extra_idx must have shape"):
        jsa.gathered_attn_idx(q, kv, idx, extra_kv=kv2, extra_idx=idx2[:2])
    # An FP8 second cache sits beside an FP8 main cache only (the primitive's forms).
    with pytest.raises(TypeError, match="an FP8 extra_kv .* needs an FP8 kv"):
        jsa.gathered_attn_idx(q, kv, idx, extra_kv=kv2.astype(jnp.float8_e4m3fn), extra_idx=idx2,
                              extra_kv_scale=np.ones(len(kv2), np.float32))
    for name in ("extra_kv_scale", "extra_kv_rope"):
        with pytest.raises(ValueError, match=f"{name} is for a second cache"):
            jsa.gathered_attn_idx(q, kv, idx, **{name: np.ones((4, 2), np.float32)})
    with pytest.raises(ValueError, match=r"bias must have shape \[T, K\] = \(3, 27\)"):
        jsa.gathered_attn_idx(q, kv, idx, bias=np.zeros((3, 20)), extra_kv=kv2, extra_idx=idx2)


# --- FP8 as an operand of the primitive; DeepSeek's split rows -------------------------------------


@pytest.fixture
def kernel_reads_operands(monkeypatch):
    """trn2, and a context in which XLA's pre-gather for the Neuron kernel raises: what runs in it
    is a kernel that reads the op's operands itself."""
    from jax_sparse_attn import nki_emulator
    from jax_sparse_attn.attention import neuron

    monkeypatch.setenv(nki_emulator.TARGET_ENV, "trn2")
    jax.clear_caches()

    def no_xla_gather(*args):
        raise AssertionError("the slots were gathered by XLA")

    @contextlib.contextmanager
    def without_xla_gather():
        with monkeypatch.context() as m:
            m.setattr(neuron, "_pregathered_slots", no_xla_gather)
            yield

    yield without_xla_gather
    jax.clear_caches()


def _split_rows(rng, R, D8, Dr, G, power_of_two=False):
    """An FP8 cache [R, D8] with f32 scales per G columns and 16-bit rope columns [R, Dr]; returns
    them and the logical rows [dequantised | rope] (numpy, bf16)."""
    kv8 = rng.standard_normal((R, D8)).astype(np.float32).astype(jnp.float8_e4m3fn)
    if power_of_two:  # V4: ue8m0 scales
        scale = np.exp2(rng.integers(-4, 3, size=(R, D8 // G))).astype(np.float32)
    else:
        scale = rng.uniform(0.01, 0.1, size=(R, D8 // G)).astype(np.float32)
    rope = rng.standard_normal((R, Dr)).astype(BF16)
    dequant = (kv8.astype(np.float32).reshape(R, -1, G) * scale[:, :, None]).reshape(R, D8)
    logical = np.concatenate([dequant.astype(BF16), rope], axis=1)
    return kv8, scale, rope, logical


def _split_case(rng, layout, K, v32_fp8_columns):
    """A split-row cache in V3.2's layout (``v32_fp8_columns`` FP8 columns, a scale per 128) or
    V4's (448, power-of-two scales per 64), 64 bf16 columns, R = 40, and ``q [3, 4, D]``,
    ``idx [3, K]``; garbage in every row no slot selects (FP8 NaN bytes, inf scales, NaN rope)."""
    D8, G, pow2 = (v32_fp8_columns, 128, False) if layout == "v3.2" else (448, 64, True)
    R, T, H = 40, 3, 4
    kv8, scale, rope, logical = _split_rows(rng, R, D8, 64, G, pow2)
    q = rng.standard_normal((T, H, D8 + 64)).astype(BF16)
    idx = rng.integers(-1, R, size=(T, K)).astype(np.int32)
    used = np.zeros(R, bool)
    used[idx[idx >= 0]] = True
    kv8.view(np.uint8)[~used] = 0x7F
    scale[~used] = np.inf
    rope[~used] = np.nan
    return kv8, scale, rope, logical, q, idx, used, pow2


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("layout", ["v3.2", "v4"])
def test_split_fp8_rows_follow_the_contract_on_the_logical_rows(rng, implementation, layout):
    kv8, scale, rope, logical, q, idx, used, pow2 = _split_case(rng, layout, 24, 256)
    (T, H, _), D8 = q.shape, kv8.shape[1]
    sink = rng.standard_normal(H).astype(np.float32)
    out, lse = jsa.gathered_attn_idx(q, kv8, idx, sink, kv_scale=scale, kv_rope=rope,
                                     value_dim=D8, return_lse=True, implementation=implementation)
    assert out.shape == (T, H, D8)
    x, valid = gather(logical, idx)
    assert within_one_ulp(np.asarray(out), attention_bf16_contract(q, x, valid, sink,
                                                                   value_dim=D8)) >= 0.999
    np.testing.assert_allclose(np.asarray(lse), lse_f64(q, x, valid, sink), rtol=1e-5, atol=1e-5)
    if pow2 and implementation == "reference":
        # Power-of-two scales dequantise exactly: bit for bit the op on the 16-bit logical rows.
        plain = jsa.gathered_attn_idx(q, np.where(used[:, None], logical, 0).astype(BF16), idx,
                                      sink, value_dim=D8, return_lse=True)
        _same_bits(out, plain[0])
        _same_bits(lse, plain[1])


@pytest.mark.parametrize("layout", ["v3.2", "v4"])
def test_the_fp8_kernel_reads_split_rows_itself(rng, kernel_reads_operands, layout):
    # On trn2 the split kernel gathers the FP8 columns and the rope columns by indirect DMA (XLA
    # gathers nothing) and dequantises on chip: the bf16 kernel's result on the logical rows,
    # bit for bit, also with scales that are not powers of two (both round (kv * scale) once to
    # bf16). 150 slots: two tiles, one partial.
    kv8, scale, rope, logical, q, idx, used, _ = _split_case(rng, layout, 150, 512)

    with kernel_reads_operands():
        out, lse = jsa.gathered_attn_idx(q, kv8, idx, kv_scale=scale, kv_rope=rope,
                                         return_lse=True, implementation="nki_emulated")
    logical = np.where(used[:, None], logical, 0).astype(BF16)
    want = jsa.gathered_attn_idx(q, logical, idx, return_lse=True, implementation="nki_emulated")
    _same_bits(out, want[0])
    _same_bits(lse, want[1])
    x, valid = gather(logical, idx)
    assert within_one_ulp(np.asarray(out), attention_bf16_contract(q, x, valid)) >= 0.999


@pytest.mark.slow  # about 5 s
def test_fp8_goes_through_the_primitive_and_its_gradient(rng):
    kv8, scale, rope, logical = _split_rows(rng, 30, 128, 64, 64)
    q = rng.standard_normal((2, 4, 192)).astype(np.float32)
    idx = rng.integers(-1, 30, size=(2, 10)).astype(np.int32)
    f = lambda q: jsa.gathered_attn_idx(q, kv8, idx, kv_scale=scale, kv_rope=rope)  # noqa: E731
    jaxpr = jax.make_jaxpr(f)(q)
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive is jsa.gathered_attn_idx_p]
    assert [np.dtype(v.aval.dtype) for v in eqn.invars[1:2]] == [np.dtype(jnp.float8_e4m3fn)]
    assert len(eqn.invars) == 8  # q, kv, idx, sink, bias, scale, kv_scale, kv_rope
    got = jax.jit(jax.grad(lambda q: jnp.sum(f(q) ** 2)))(q)
    # f32 q: the FP8 columns dequantise to f32 (q's dtype), not to bf16.
    dequant = (kv8.astype(np.float32).reshape(30, -1, 64) * scale[:, :, None]).reshape(30, 128)
    rows_f32 = np.concatenate([dequant, rope.astype(np.float32)], axis=1)
    want = jax.jit(jax.grad(lambda q: jnp.sum(jsa.gathered_attn_idx(q, rows_f32, idx) ** 2)))(q)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # vmap over sequences with their own split caches.
    qs, kvs8 = np.stack([q, q[::-1]]), np.stack([kv8, kv8[::-1]])
    scales, ropes = np.stack([scale, scale[::-1]]), np.stack([rope, rope[::-1]])
    got = jax.vmap(lambda q, k, s, r: jsa.gathered_attn_idx(q, k, idx, kv_scale=s, kv_rope=r))(
        qs, kvs8, scales, ropes)
    for b in range(2):
        one = jsa.gathered_attn_idx(qs[b], kvs8[b], idx, kv_scale=scales[b], kv_rope=ropes[b])
        np.testing.assert_array_equal(np.asarray(got[b]), np.asarray(one))


@pytest.mark.slow  # 4-6 s a case; the default run checks the forward through README's V4 snippet
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("rows", ["split", "whole"])
def test_fp8_cache_beside_a_16_bit_window_is_one_softmax(rng, implementation, rows):
    # V4: FP8 compressed rows (power-of-two scales per 64, rope columns in bf16) and a bf16 window
    # as the second cache. Power-of-two scales dequantise exactly, so the call equals the
    # single-cache one on [logical rows; window] bit for bit.
    T, H, R, K, R2, K2 = 3, 4, 40, 16, 12, 5
    D8, Dr = (192, 64) if rows == "split" else (256, 0)
    kv8, scale, rope, logical = _split_rows(rng, R, D8, max(Dr, 1), 64, power_of_two=True)
    if rows == "whole":
        rope, logical = None, logical[:, :D8]
    q = rng.standard_normal((T, H, D8 + Dr)).astype(BF16)
    kv2 = rng.standard_normal((R2, D8 + Dr)).astype(BF16)
    idx = rng.integers(-1, R, size=(T, K)).astype(np.int32)
    idx2 = rng.integers(-1, R2, size=(T, K2)).astype(np.int32)
    sink = rng.standard_normal(H).astype(np.float32)
    bias = rng.standard_normal((T, K + K2)).astype(np.float32)
    bias[1, K + 2] = -np.inf
    used = np.zeros(R, bool)
    used[idx[idx >= 0]] = True
    kv8.view(np.uint8)[~used] = 0x7F  # garbage in unselected rows of both caches
    scale[~used] = np.inf
    if rope is not None:
        rope[~used] = np.nan
    kv2 = _poison_unselected(kv2, idx2, idx2 >= 0)
    call = functools.partial(jsa.gathered_attn_idx, sink=sink, bias=bias, extra_idx=idx2,
                             kv_scale=scale, kv_rope=rope, return_lse=True,
                             implementation=implementation)
    out, lse = call(q, kv8, idx, extra_kv=kv2)
    cat, idx_cat = _concatenated(np.where(used[:, None], logical, 0).astype(BF16), kv2, idx, idx2)
    want = jsa.gathered_attn_idx(q, cat, idx_cat, sink, bias=bias, return_lse=True,
                                 implementation=implementation)
    _same_bits(out, want[0])
    _same_bits(lse, want[1])
    x, valid = gather(cat, idx_cat)
    x[~valid] = 0
    assert within_one_ulp(np.asarray(out), attention_bf16_contract(q, x, valid, sink, bias)) >= 0.999
    if implementation != "reference":
        return
    # Gradients reach q and the window, not the FP8 rows; as the single-cache call's.
    loss = lambda q, kv2: jnp.sum(call(q, kv8, idx, extra_kv=kv2)[0].astype(jnp.float32) ** 2)  # noqa: E731
    dq, dkv2 = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, kv2)
    cat_loss = lambda q, cat: jnp.sum(jsa.gathered_attn_idx(  # noqa: E731
        q, cat, idx_cat, sink, bias=bias).astype(jnp.float32) ** 2)
    want_dq, want_dcat = jax.jit(jax.grad(cat_loss, argnums=(0, 1)))(q, cat)
    _same_bits(dq, want_dq)
    _same_bits(dkv2, want_dcat[R:])
    assert np.isfinite(np.asarray(dq, np.float32)).all()
    # vmap over sequences with their own FP8 caches and windows.
    got = jax.vmap(lambda q, k, s, w: call(q, k, idx, kv_scale=s, extra_kv=w)[0])(
        np.stack([q, q]), np.stack([kv8, kv8]), np.stack([scale, scale]), np.stack([kv2, kv2[::-1]]))
    _same_bits(got[0], out)
    _same_bits(got[1], call(q, kv8, idx, extra_kv=kv2[::-1])[0])


def _two_fp8_caches(rng, rows):
    """V4 in FP8: both caches split (448 FP8 columns with power-of-two scales per 64, then 64
    bf16) or whole FP8 rows with scales per 128 (not powers of two); garbage in every row that no
    slot selects. Returns the call's arguments and each cache's logical rows."""
    T, H, R, K, R2, K2 = 3, 4, 40, 16, 12, 5
    D8, Dr, G, pow2 = (448, 64, 64, True) if rows == "split" else (256, 0, 128, False)
    q = rng.standard_normal((T, H, D8 + Dr)).astype(BF16)
    idx = rng.integers(-1, R, size=(T, K)).astype(np.int32)
    idx2 = rng.integers(-1, R2, size=(T, K2)).astype(np.int32)
    caches = []
    for n, i in ((R, idx), (R2, idx2)):
        kv8, scale, rope, logical = _split_rows(rng, n, D8, max(Dr, 1), G, pow2)
        used = np.zeros(n, bool)
        used[i[i >= 0]] = True
        kv8.view(np.uint8)[~used] = 0x7F  # FP8 NaN bytes, inf scales, NaN rope columns
        scale[~used] = np.inf
        rope[~used] = np.nan
        logical = np.where(used[:, None], logical, 0).astype(BF16)
        caches.append((kv8, scale, rope if Dr else None, logical if Dr else logical[:, :D8]))
    (kv8, scale, rope, logical), (kv8_2, scale2, rope2, logical2) = caches
    args = dict(q=q, kv=kv8, idx=idx, kv_scale=scale, kv_rope=rope, extra_kv=kv8_2,
                extra_idx=idx2, extra_kv_scale=scale2, extra_kv_rope=rope2)
    return args, logical, logical2


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("rows", ["split", "whole"])
def test_two_fp8_caches_are_one_softmax_over_their_logical_rows(rng, implementation, rows):
    # V4 keeps both the compressed rows and the window in FP8, each with its own scales.
    args, logical, logical2 = _two_fp8_caches(rng, rows)
    T, H = args["q"].shape[:2]
    sink = rng.standard_normal(H).astype(np.float32)
    bias = rng.standard_normal((T, args["idx"].shape[1] + args["extra_idx"].shape[1]))
    bias[0, -1] = -np.inf
    out, lse = jsa.gathered_attn_idx(**args, sink=sink, bias=bias, return_lse=True,
                                     implementation=implementation)
    cat, idx_cat = _concatenated(logical, logical2, args["idx"], args["extra_idx"])
    x, valid = gather(cat, idx_cat)
    valid &= np.isfinite(bias)
    x[~valid] = 0
    assert within_one_ulp(np.asarray(out), attention_bf16_contract(args["q"], x, valid, sink,
                                                                   bias)) >= 0.999
    np.testing.assert_allclose(np.asarray(lse), lse_f64(args["q"], x, valid, sink, bias),
                               rtol=1e-5, atol=1e-5)
    if rows == "split":
        # Power-of-two scales dequantise exactly: bit for bit the single-cache call on the
        # concatenated logical rows.
        want = jsa.gathered_attn_idx(args["q"], cat, idx_cat, sink, bias=bias, return_lse=True,
                                     implementation=implementation)
        _same_bits(out, want[0])
        _same_bits(lse, want[1])


@pytest.mark.parametrize("window", ["fp8", "bf16"])
@pytest.mark.parametrize("rows", ["split", "whole"])
def test_the_kernel_reads_fp8_rows_beside_a_window(rng, kernel_reads_operands, rows, window):
    # V4 on trn2: FP8 compressed rows (split, or FP8 in every column) beside a window in the same
    # FP8 layout or in bf16. One kernel reads both caches (XLA gathers nothing) and equals, bit
    # for bit, the bf16 kernel on the concatenated logical rows (also with scales that are not
    # powers of two: both round kv * scale once to bf16). K = 16: the first tile holds both
    # caches' slots.
    args, logical, logical2 = _two_fp8_caches(rng, rows)
    if window == "bf16":  # the window's logical rows as a bf16 cache (NaN where unselected)
        used = np.zeros(len(logical2), bool)
        used[args["extra_idx"][args["extra_idx"] >= 0]] = True
        args.update(extra_kv=np.where(used[:, None], logical2, np.nan).astype(BF16),
                    extra_kv_scale=None, extra_kv_rope=None)

    with kernel_reads_operands():
        out, lse = jsa.gathered_attn_idx(**args, return_lse=True, implementation="nki_emulated")
    cat, idx_cat = _concatenated(logical, logical2, args["idx"], args["extra_idx"])
    want = jsa.gathered_attn_idx(args["q"], cat, idx_cat, return_lse=True,
                                 implementation="nki_emulated")
    _same_bits(out, want[0])
    _same_bits(lse, want[1])


@pytest.mark.slow  # about 6 s: a jitted gradient and a vmap
def test_two_fp8_caches_gradient_and_vmap(rng):
    args, logical, logical2 = _two_fp8_caches(rng, "split")
    cat, idx_cat = _concatenated(logical, logical2, args["idx"], args["extra_idx"])
    q = args.pop("q")
    loss = lambda q: jnp.sum(jsa.gathered_attn_idx(q, **args).astype(jnp.float32) ** 2)  # noqa: E731
    cat_loss = lambda q: jnp.sum(jsa.gathered_attn_idx(q, cat, idx_cat).astype(jnp.float32) ** 2)  # noqa: E731
    dq = jax.jit(jax.grad(loss))(q)
    _same_bits(dq, jax.jit(jax.grad(cat_loss))(q))
    assert np.isfinite(np.asarray(dq, np.float32)).all()
    # vmap over sequences with their own FP8 windows and scales.
    window = lambda q, w, s: jsa.gathered_attn_idx(  # noqa: E731
        q, **dict(args, extra_kv=w, extra_kv_scale=s))
    w, s = args["extra_kv"], args["extra_kv_scale"]
    got = jax.vmap(window)(np.stack([q, q]), np.stack([w, w[::-1]]), np.stack([s, s[::-1]]))
    _same_bits(got[0], jsa.gathered_attn_idx(q, **args))
    _same_bits(got[1], window(q, w[::-1], s[::-1]))


@pytest.mark.parametrize("empty", ["kv", "extra_kv"])
def test_an_empty_fp8_cache_beside_the_other_is_the_other_alone(rng, empty):
    # An FP8 cache of 0 rows (nothing compressed yet, or no window) beside a full one: every slot
    # of the empty cache is empty; the gradient too runs (a gather from 0 rows is not valid XLA).
    args, logical, logical2 = _two_fp8_caches(rng, "whole")
    args[empty] = args[empty][:0]
    args[empty + "_scale"] = args[empty + "_scale"][:0]
    q = args.pop("q")
    out = jsa.gathered_attn_idx(q, **args)
    kept, kept_idx = (logical2, args["extra_idx"]) if empty == "kv" else (logical, args["idx"])
    x, valid = gather(kept, kept_idx)
    assert within_one_ulp(np.asarray(out), attention_bf16_contract(q, x, valid)) >= 0.999
    dq = jax.grad(lambda q: jnp.sum(jsa.gathered_attn_idx(q, **args).astype(jnp.float32)))(q)
    assert np.isfinite(np.asarray(dq, np.float32)).all()


def test_two_fp8_caches_bad_input_names_the_argument(rng):
    args, _, _ = _two_fp8_caches(rng, "split")
    with pytest.raises(ValueError, match="needs extra_kv_scale"):
        jsa.gathered_attn_idx(**dict(args, extra_kv_scale=None))
    with pytest.raises(ValueError, match=r"extra_kv_scale must have shape \[R\] = \(12,\)"):
        jsa.gathered_attn_idx(**dict(args, extra_kv_scale=args["extra_kv_scale"][:5]))
    with pytest.raises(ValueError, match="extra_kv_rope must have shape"):
        jsa.gathered_attn_idx(**dict(args, extra_kv_rope=args["extra_kv_rope"][:, :32]))
    with pytest.raises(ValueError, match="extra_kv must have shape"):
        jsa.gathered_attn_idx(**dict(args, extra_kv_rope=None))
    with pytest.raises(TypeError, match="extra_kv_scale is for FP8 caches"):
        jsa.gathered_attn_idx(**dict(args, extra_kv=np.zeros((12, 448), BF16)))
    with pytest.raises(ValueError, match="extra_kv_rope is the unquantised part"):
        jsa.gathered_attn_idx(**dict(args, extra_kv=np.zeros((12, 448), BF16),
                                     extra_kv_scale=None))


def test_kv_rope_bad_input_names_the_argument(rng):
    kv8, scale, rope, _ = _split_rows(rng, 30, 128, 64, 64)
    q = rng.standard_normal((2, 4, 192)).astype(BF16)
    idx = np.zeros((2, 3), np.int32)
    with pytest.raises(ValueError, match="kv_rope must have shape"):
        jsa.gathered_attn_idx(q, kv8, idx, kv_scale=scale, kv_rope=rope[:, :32])
    with pytest.raises(TypeError, match="kv_rope must be a 16-bit float"):
        jsa.gathered_attn_idx(q, kv8, idx, kv_scale=scale, kv_rope=rope.astype(np.float32))
    with pytest.raises(ValueError, match="kv_rope is the unquantised part of an FP8 cache"):
        jsa.gathered_attn_idx(q, np.zeros((30, 128), BF16), idx, kv_rope=rope)
