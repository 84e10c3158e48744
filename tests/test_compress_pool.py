"""compress_pool against a float64 oracle written out below: the pooling with and without overlap,
the rows before block 0, the tail that is never read, the -inf / +inf / NaN rules, dtypes, jit,
vmap, gradients (check_grads and finite differences of the oracle), bad arguments, and, on 8 host
devices, the sharded call against the single-device one (docs/compress.md)."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import compress_sharding_checks as sharding_checks
from conftest import run_on_8_devices
from jax_sparse_attn import compress_pool, compress_pool_p

FLT_MAX = float(np.finfo(np.float32).max)
U = 2.0 ** -24  # f32's unit roundoff


# --- the float64 oracle: docs/compress.md, "Contract", in plain numpy ----------------------------


def pool_window(kv_rows, s_rows):
    """One window: ``n`` rows of kv and of scores (score + ape), each ``[X]`` float64 -> the pooled
    ``[X]``, and how far an f32 result may be from it (``tol``)."""
    kv = np.stack(kv_rows)
    s = np.minimum(np.stack(s_rows), FLT_MAX)  # +inf counts as FLT_MAX
    masked = s == -np.inf
    out = np.zeros(kv.shape[1])
    tol = np.zeros(kv.shape[1])
    for c in range(kv.shape[1]):
        live = ~masked[:, c]
        if not live.any():
            continue  # every row masked: 0
        if np.isnan(s[live, c]).any():
            out[c] = np.nan
            continue
        e = np.exp(s[live, c] - s[live, c].max())
        w = e / e.sum()
        out[c] = np.sum(w * kv[live, c])
        # Rounding score + ape to f32 moves a row's exp by up to u |s| relative (its own and the
        # max row's; none for a clamped one); the exps, the sums and the division add about
        # n + 8 roundings of their own, relative to sum w |kv|.
        a = np.where(np.abs(s[live, c]) < FLT_MAX, np.abs(s[live, c]), 0)
        a_max = a[np.argmax(s[live, c])]
        tol[c] = U * np.sum(w * np.abs(kv[live, c]) * (2 * len(kv_rows) + 16 + 2 * a + 2 * a_max))
    return out, tol


def oracle(kv, score, ape, overlap=False, prev_kv=None, prev_score=None):
    """``(out, tol)`` in float64 for any leading dims: an f32 result must lie within ``tol`` of
    ``out`` (``pool_window``)."""
    kv, score, ape = (np.asarray(a, np.float64) for a in (kv, score, ape))
    r = ape.shape[0]
    *lead, T, C = kv.shape
    N, d = T // r, C // 2
    kv, score = kv.reshape(-1, T, C), score.reshape(-1, T, C)
    if prev_kv is not None:
        prev_kv = np.asarray(prev_kv, np.float64).reshape(-1, r, C)
        prev_score = np.asarray(prev_score, np.float64).reshape(-1, r, C)
    width = d if overlap else C
    out = np.zeros((kv.shape[0], N, width))
    tol = np.zeros_like(out)
    for b in range(kv.shape[0]):
        for j in range(N):
            rows = range(j * r, j * r + r)
            if not overlap:
                window = ([kv[b, t] for t in rows], [score[b, t] + ape[t - j * r] for t in rows])
            else:
                if j > 0:
                    before = [(kv[b, t, :d], score[b, t, :d] + ape[t - (j - 1) * r, :d])
                              for t in range((j - 1) * r, j * r)]
                elif prev_kv is not None:
                    before = [(prev_kv[b, i, :d], prev_score[b, i, :d] + ape[i, :d])
                              for i in range(r)]
                else:
                    before = []  # no rows before block 0
                own = [(kv[b, t, d:], score[b, t, d:] + ape[t - j * r, d:]) for t in rows]
                window = ([k for k, _ in before + own], [s for _, s in before + own])
            with np.errstate(invalid="ignore", over="ignore"):
                out[b, j], tol[b, j] = pool_window(*window)
    return out.reshape(*lead, N, width), tol.reshape(*lead, N, width)


def assert_matches(got, kv, score, ape, overlap=False, prev_kv=None, prev_score=None):
    want, tol = oracle(kv, score, ape, overlap, prev_kv, prev_score)
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    err, tol = np.abs(got[ok] - want[ok]), tol[ok]
    assert (err <= tol).all(), (err.max(), err[err > tol][:5], tol[err > tol][:5])


def make(rng, shape, ratio, dtype=np.float32, score_scale=3.0):
    C = shape[-1]
    kv = rng.standard_normal(shape).astype(dtype)
    score = (score_scale * rng.standard_normal(shape)).astype(dtype)
    ape = rng.standard_normal((ratio, C)).astype(np.float32)
    return kv, score, ape


# --- values --------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("shape,ratio", [((16, 8), 4), ((2, 19, 6), 4), ((2, 3, 10, 4), 2),
                                         ((7, 6), 1), ((3, 13, 4), 13)])
def test_matches_float64(rng, shape, ratio, overlap):
    kv, score, ape = make(rng, shape, ratio)
    out = jax.jit(compress_pool, static_argnames="overlap")(kv, score, ape, overlap=overlap)
    C = shape[-1]
    assert out.shape == shape[:-2] + (shape[-2] // ratio, C // 2 if overlap else C)
    assert out.dtype == jnp.float32
    assert_matches(out, kv, score, ape, overlap)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_dtypes_compute_in_f32(rng, dtype):
    kv, score, ape = make(rng, (2, 12, 8), 4)
    kv, score = kv.astype(dtype), score.astype(dtype)
    ape16 = ape.astype(dtype)
    for overlap in (False, True):
        out = compress_pool(kv, score, ape16, overlap=overlap)
        assert out.dtype == jnp.float32
        # The oracle reads the same (rounded) inputs: only f32 arithmetic separates them.
        assert_matches(out, np.asarray(kv, np.float32), np.asarray(score, np.float32),
                       np.asarray(ape16, np.float32), overlap)
    # Mixed dtypes are fine: each operand is read as f32.
    mixed = compress_pool(kv, np.asarray(score, np.float32), ape)
    assert_matches(mixed, np.asarray(kv, np.float32), np.asarray(score, np.float32), ape)


def test_deepseek_ratios(rng):
    # V4's compressors: ratio 4 with overlap, ratio 128 without (one block of 128 rows here).
    kv, score, ape = make(rng, (2, 9, 16), 4)
    assert_matches(compress_pool(kv, score, ape, overlap=True), kv, score, ape, True)
    kv, score, ape = make(rng, (260, 4), 128)
    out = jax.jit(compress_pool)(kv, score, ape)
    assert out.shape == (2, 4)
    assert_matches(out, kv, score, ape)


@pytest.mark.parametrize("overlap", [False, True])
def test_tail_rows_are_never_read(rng, overlap):
    kv, score, ape = make(rng, (2, 14, 6), 4)  # 3 blocks and 2 rows of tail
    whole = compress_pool(kv[:, :12], score[:, :12], ape, overlap=overlap)
    for junk in (np.nan, np.inf, -np.inf, 3e38):
        kv2, score2 = kv.copy(), score.copy()
        kv2[:, 12:], score2[:, 12:] = junk, junk
        out = compress_pool(kv2, score2, ape, overlap=overlap)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(whole))
        assert np.isfinite(np.asarray(out)).all()


def test_fewer_rows_than_a_block(rng):
    kv, score, ape = make(rng, (2, 3, 6), 4)
    assert compress_pool(kv, score, ape).shape == (2, 0, 6)
    assert compress_pool(kv, score, ape, overlap=True).shape == (2, 0, 3)
    kv, score, ape = make(rng, (8, 0), 4)
    assert compress_pool(kv, score, ape, overlap=True).shape == (2, 0)


def test_overlap_block_0_without_prev_pools_its_own_rows(rng):
    # No rows before block 0: its window is its own rows on the second half of the channels.
    kv, score, ape = make(rng, (12, 8), 4)
    out = np.asarray(compress_pool(kv, score, ape, overlap=True))
    alone = np.asarray(compress_pool(kv[:4, 4:], score[:4, 4:], ape[:, 4:]))
    np.testing.assert_allclose(out[0], alone[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("with_prev", [False, True])
def test_prev_is_the_block_before(rng, with_prev):
    # A stream cut at a block boundary: the second part with the first part's last block as prev
    # gives the same blocks as the whole call, bit for bit (the same windows in the same order).
    kv, score, ape = make(rng, (2, 24, 8), 4)
    kw = {}
    if with_prev:
        prev_kv, prev_score, _ = make(rng, (2, 4, 8), 4)
        kw = dict(prev_kv=prev_kv, prev_score=prev_score)
    whole = np.asarray(compress_pool(kv, score, ape, overlap=True, **kw))
    first = np.asarray(compress_pool(kv[:, :12], score[:, :12], ape, overlap=True, **kw))
    rest = np.asarray(compress_pool(kv[:, 12:], score[:, 12:], ape, overlap=True,
                                    prev_kv=kv[:, 8:12], prev_score=score[:, 8:12]))
    np.testing.assert_array_equal(np.concatenate([first, rest], axis=1), whole)
    assert_matches(whole, kv, score, ape, True, kw.get("prev_kv"), kw.get("prev_score"))


# --- edge rules (docs/compress.md, "Edge rules") -------------------------------------------------


def test_all_masked_channel_gives_zero(rng):
    kv, score, ape = make(rng, (12, 6), 4)
    score[4:8, 2] = -np.inf
    kv[4:8, 2] = np.nan  # a masked row's kv is never read
    out = np.asarray(compress_pool(kv, score, ape))
    assert out[1, 2] == 0 and np.isfinite(out).all()
    assert_matches(out, kv, score, ape)
    # An ape of -inf masks its row position in every block.
    ape2 = ape.copy()
    ape2[:, 5] = -np.inf
    out = np.asarray(compress_pool(kv, score, ape2))
    assert (out[:, 5] == 0).all()
    # With overlap and no prev, block 0's missing rows stay masked even under an ape of +inf.
    ape3 = ape.copy()
    ape3[:, 1] = np.inf
    out = np.asarray(compress_pool(kv[:, :4], score[:, :4], ape3[:, :4], overlap=True))
    assert np.isfinite(out).all()
    assert_matches(out, kv[:, :4], score[:, :4], ape3[:, :4], True)


def test_masked_rows_take_no_part(rng):
    kv, score, ape = make(rng, (8, 4), 4)
    masked = score.copy()
    masked[1, :] = -np.inf
    kv_junk = kv.copy()
    kv_junk[1, :] = np.nan
    out = np.asarray(compress_pool(kv_junk, masked, ape))
    assert np.isfinite(out).all()
    assert_matches(out, kv, masked, ape)


def test_plus_inf_scores_share_the_block(rng):
    # +inf counts as FLT_MAX: the rows at +inf split the weight evenly, the others get none.
    kv, score, ape = make(rng, (8, 4), 4)
    score[1, 0] = score[3, 0] = np.inf
    score[5, 1] = np.inf
    score[6, 2] = 3e38
    ape[2, 2] = 3e38  # f32 overflow of score + ape: FLT_MAX too
    out = np.asarray(compress_pool(kv, score, ape))
    np.testing.assert_allclose(out[0, 0], (kv[1, 0] + kv[3, 0]) / 2, rtol=1e-6)
    assert out[1, 1] == kv[5, 1]
    assert out[1, 2] == kv[6, 2]
    assert_matches(out, kv, score, ape)


@pytest.mark.parametrize("overlap", [False, True])
def test_nan_reaches_only_its_windows(rng, overlap):
    kv, score, ape = make(rng, (16, 8), 4)
    score[5, 1] = np.nan  # block 1, channel 1
    kv[10, 6] = np.nan  # block 2, channel 6
    score[13, 2] = -np.inf  # a masked row: no NaN
    out = np.asarray(compress_pool(kv, score, ape, overlap=overlap))
    nan = np.argwhere(np.isnan(out)).tolist()
    if overlap:  # channel 1 (< d) is read by the next block's window; channel 6 by its own, as 2
        assert nan == [[2, 1], [2, 2]]
    else:
        assert nan == [[1, 1], [2, 6]]
    assert_matches(out, kv, score, ape, overlap)


def test_minus_inf_plus_inf_is_nan(rng):
    kv, score, ape = make(rng, (8, 4), 4)
    score[2, 3], ape[2, 3] = -np.inf, np.inf  # NaN in block 0; block 1's row 2 is at FLT_MAX
    out = np.asarray(compress_pool(kv, score, ape))
    assert np.argwhere(np.isnan(out)).tolist() == [[0, 3]]
    assert out[1, 3] == kv[6, 3]


def test_nan_in_prev_reaches_block_0_only(rng):
    kv, score, ape = make(rng, (12, 8), 4)
    prev_kv, prev_score, _ = make(rng, (4, 8), 4)
    prev_kv[2, 1] = np.nan
    prev_kv[2, 5] = np.nan  # the second half of prev is never read
    out = np.asarray(compress_pool(kv, score, ape, overlap=True, prev_kv=prev_kv,
                                   prev_score=prev_score))
    assert np.argwhere(np.isnan(out)).tolist() == [[0, 1]]


# --- transforms ----------------------------------------------------------------------------------


def test_primitive_in_jaxpr_and_eval_shape(rng):
    kv, score, ape = make(rng, (2, 8, 4), 4)
    jaxpr = jax.make_jaxpr(lambda *a: compress_pool(*a, overlap=True))(kv, score, ape)
    assert any(e.primitive is compress_pool_p for e in jaxpr.jaxpr.eqns)
    shape = jax.eval_shape(lambda *a: compress_pool(*a, overlap=True), kv, score, ape)
    assert shape.shape == (2, 2, 2) and shape.dtype == jnp.float32
    eager = compress_pool(kv, score, ape, overlap=True)
    np.testing.assert_array_equal(np.asarray(jax.jit(compress_pool, static_argnames="overlap")(
        kv, score, ape, overlap=True)), np.asarray(eager))


@pytest.mark.parametrize("in_axes", [(0, 0, None), (1, 1, None), (None, 0, None), (0, None, 0),
                                     (None, None, 0)])
def test_vmap_stays_one_primitive(rng, in_axes):
    B = 3
    kv, score, ape = make(rng, (2, 8, 6), 4)
    full = {"kv": np.stack([kv + i for i in range(B)]),
            "score": np.stack([score * i for i in range(B)]),
            "ape": np.stack([ape - i for i in range(B)])}
    args = [full[n] if ax is not None else base
            for n, ax, base in zip(("kv", "score", "ape"), in_axes, (kv, score, ape))]
    args = [np.moveaxis(a, 0, ax) if ax else a for a, ax in zip(args, in_axes)]
    fn = jax.vmap(lambda k, s, a: compress_pool(k, s, a, overlap=True), in_axes=in_axes)
    jaxpr = jax.make_jaxpr(fn)(*args)
    assert [e.primitive for e in jaxpr.jaxpr.eqns].count(compress_pool_p) == 1
    out = np.asarray(fn(*args))
    for b in range(B):
        one = [np.take(a, b, axis=ax) if ax is not None else a for a, ax in zip(args, in_axes)]
        np.testing.assert_array_equal(out[b], np.asarray(compress_pool(*one, overlap=True)))


def test_vmap_with_prev(rng):
    kv, score, ape = make(rng, (3, 8, 6), 4)
    prev_kv, prev_score, _ = make(rng, (3, 4, 6), 4)
    fn = jax.vmap(lambda k, s, pk, ps: compress_pool(k, s, ape, overlap=True, prev_kv=pk,
                                                      prev_score=ps))
    out = fn(kv, score, prev_kv, prev_score)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(
        compress_pool(kv, score, ape, overlap=True, prev_kv=prev_kv, prev_score=prev_score)))


@pytest.mark.parametrize("overlap", [False, True])
def test_check_grads(rng, overlap):
    kv, score, ape = make(rng, (2, 6, 4), 2, score_scale=1.0)
    args = [kv, score, ape]
    kw = {}
    if overlap:
        prev_kv, prev_score, _ = make(rng, (2, 2, 4), 2, score_scale=1.0)
        args += [prev_kv, prev_score]

    def f(kv, score, ape, *prev):
        if prev:
            return compress_pool(kv, score, ape, overlap=True, prev_kv=prev[0], prev_score=prev[1])
        return compress_pool(kv, score, ape, overlap=overlap, **kw)

    check_grads(f, args, order=1, modes=("fwd", "rev"), eps=1e-2, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("overlap", [False, True])
def test_gradients_match_float64_finite_differences(rng, overlap):
    r = 2
    kv, score, ape = make(rng, (2, 5, 4), r, score_scale=1.0)  # one tail row
    prev_kv, prev_score, _ = make(rng, (2, r, 4), r, score_scale=1.0)
    score[0, 1, 3] = -np.inf  # a masked row: no gradient through it, no NaN
    names = ["kv", "score", "ape"] + (["prev_kv", "prev_score"] if overlap else [])
    args = [kv, score, ape] + ([prev_kv, prev_score] if overlap else [])
    cot = rng.standard_normal(oracle(*args[:3], overlap)[0].shape)

    def f(*a):
        prev = dict(zip(("prev_kv", "prev_score"), a[3:]))
        return jnp.sum(compress_pool(*a[:3], overlap=overlap, **prev) * cot)

    grads = jax.grad(f, argnums=tuple(range(len(args))))(*args)
    for name, x, g in zip(names, args, grads):
        g = np.asarray(g, np.float64)
        assert g.shape == x.shape and np.isfinite(g).all(), name
        h = 1e-6
        want = np.zeros(x.shape)
        for i in np.ndindex(x.shape):
            if not np.isfinite(x[i]):
                continue  # the masked row's score: no derivative
            plus, minus = [np.asarray(a, np.float64).copy() for a in args], \
                [np.asarray(a, np.float64).copy() for a in args]
            k = names.index(name)
            plus[k][i] += h
            minus[k][i] -= h
            fp = np.sum(oracle(*plus[:3], overlap, *plus[3:])[0] * cot)
            fm = np.sum(oracle(*minus[:3], overlap, *minus[3:])[0] * cot)
            want[i] = (fp - fm) / (2 * h)
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5, err_msg=name)
    # The tail row and the masked row's kv have no gradient.
    assert (np.asarray(grads[0])[:, 4] == 0).all() and (np.asarray(grads[1])[:, 4] == 0).all()
    assert np.asarray(grads[0])[0, 1, 3] == 0


def test_grad_under_vmap_and_jit(rng):
    kv, score, ape = make(rng, (3, 8, 4), 4, score_scale=1.0)
    loss = lambda k, s, a: jnp.sum(compress_pool(k, s, a, overlap=True) ** 2)  # noqa: E731
    per = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, 0, None)))(kv, score, ape)
    for b in range(3):
        one = jax.grad(loss, argnums=(0, 1, 2))(kv[b], score[b], ape)
        for got, want in zip(per, one):
            np.testing.assert_allclose(np.asarray(got)[b], np.asarray(want), rtol=1e-6, atol=1e-7)


# --- arguments -----------------------------------------------------------------------------------

kv0 = jnp.zeros((2, 8, 6), jnp.bfloat16)
ape0 = jnp.zeros((4, 6), jnp.float32)
prev0 = jnp.zeros((2, 4, 6), jnp.float32)


@pytest.mark.parametrize("call, error, pattern", [
    (lambda: compress_pool(kv0[0, 0], kv0[0, 0], ape0), ValueError, r"kv must have rank 2 or more.*\(6,\)"),
    (lambda: compress_pool(kv0, kv0[0], ape0), ValueError, r"score must have kv's shape.*\(2, 8, 6\).*\(8, 6\)"),
    (lambda: compress_pool(kv0, kv0, ape0[None]), ValueError, r"ape must have rank 2 \(\[ratio, C\]\).*\(1, 4, 6\)"),
    (lambda: compress_pool(kv0, kv0, ape0[:, :4]), ValueError, r"ape must have shape \[ratio, C\] = \(4, 6\).*\(4, 4\)"),
    (lambda: compress_pool(kv0, kv0, ape0[:0]), ValueError, r"ape must have at least one row.*ratio >= 1.*\(0, 6\)"),
    (lambda: compress_pool(kv0[..., :5], kv0[..., :5], ape0[:, :5], overlap=True), ValueError, r"C must be even.*\(2, 8, 5\)"),
    (lambda: compress_pool(kv0, kv0, ape0, prev_kv=prev0, prev_score=prev0), ValueError, r"prev_kv and prev_score only apply with overlap=True"),
    (lambda: compress_pool(kv0, kv0, ape0, prev_score=prev0), ValueError, r"prev_score only apply with overlap=True"),
    (lambda: compress_pool(kv0, kv0, ape0, overlap=True, prev_kv=prev0), ValueError, r"prev_kv needs prev_score"),
    (lambda: compress_pool(kv0, kv0, ape0, overlap=True, prev_kv=prev0[0], prev_score=prev0[0]), ValueError, r"prev_kv must have shape \[..., ratio, C\] = \(2, 4, 6\).*\(4, 6\)"),
    (lambda: compress_pool(kv0, kv0, ape0, overlap=True, prev_kv=prev0, prev_score=prev0[:, :3]), ValueError, r"prev_score must have shape .*\(2, 3, 6\)"),
    (lambda: compress_pool(kv0.astype(jnp.int32), kv0, ape0), TypeError, r"kv must be a floating dtype.*int32"),
    (lambda: compress_pool(kv0, kv0.astype(bool), ape0), TypeError, r"score must be a floating dtype.*bool"),
    (lambda: compress_pool(kv0, kv0, ape0.astype(jnp.int8)), TypeError, r"ape must be a floating dtype.*int8"),
    (lambda: compress_pool(kv0, kv0, ape0, overlap=True, prev_kv=prev0.astype(jnp.int32), prev_score=prev0), TypeError, r"prev_kv must be a floating dtype"),
    (lambda: compress_pool(kv0, kv0, ape0, overlap=1), TypeError, r"overlap must be a bool"),
    (lambda: compress_pool("kv", kv0, ape0), TypeError, r"kv must be an array; got a str"),
    (lambda: compress_pool([[["a"]]], kv0, ape0), TypeError, r"kv must be an array of numbers"),
    pytest.param(lambda: compress_pool(kv0, kv0, ape0, implementation="nki"), RuntimeError, r"implementation='nki'.*Neuron SDK",
                 marks=pytest.mark.skipif(importlib.util.find_spec("nki") is not None, reason="the Neuron SDK is installed here")),
    (lambda: compress_pool(kv0, kv0, ape0, implementation="cuda"), ValueError, r"implementation must be one of None, 'reference', 'nki', 'nki_emulated'.*'cuda'"),
])
def test_bad_arguments(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_reference_implementation_and_lists():
    out = compress_pool([[1.0, 2.0], [3.0, 4.0]], [[0.0, 0.0], [0.0, 0.0]], [[0.0, 0.0]] * 2,
                        implementation="reference")
    np.testing.assert_allclose(np.asarray(out), [[2.0, 3.0]])


# --- 8 devices -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def records():
    return run_on_8_devices("compress_sharding_checks.py")


SHARDING_CASES = [f"{layout}/{axis}" for axis in ("Auto", "Explicit") for layout in (
    "batch/plain", "batch/overlap", "tokens/plain", "tokens/overlap", "tokens/overlap/prev",
    "tokens-two-axes/overlap/prev", "channels/plain", "channels/overlap",
    "tokens-unaligned/plain", "tokens-unaligned/overlap", "tokens-with-tail/overlap",
    "all-three/plain", "all-three/overlap")]


@pytest.mark.slow
@pytest.mark.oldest_jax_too
@pytest.mark.parametrize("name", SHARDING_CASES)
def test_sharded_equals_one_device(records, name):
    # Batch, tokens (whole blocks; with overlap the halo of one block) and channels split over 8
    # devices, Auto and Explicit mesh axes: the same bits as one device, and gradients within f32
    # rounding of one device's.
    r = records[name]
    assert r["equal"], r
    assert r["grads_finite"] and r["grad_eps_diff"] < 16, r
    kinds = {c["kind"] for c in r["collectives"]}
    layout = name.rsplit("/", 1)[0]
    if layout in ("batch/plain", "batch/overlap", "tokens/plain", "channels/plain",
                  "all-three/plain"):
        assert kinds == set(), r["collectives"]  # each device pools its own blocks and channels
    if layout.startswith("tokens/overlap") or layout.startswith("tokens-two-axes"):
        # The halo: one block of kv and of its scores to the next device, nothing else.
        assert kinds == {"collective-permute"}, r["collectives"]
        for c in r["collectives"]:
            assert all(shape[-2] == sharding_checks.RATIO for shape in c["shapes"]), c
    if layout.startswith("tokens-unaligned") or layout.startswith("tokens-with-tail"):
        assert kinds == {"all-gather"}, r["collectives"]  # not whole blocks: gathered


@pytest.mark.slow
@pytest.mark.oldest_jax_too
@pytest.mark.parametrize("axis", ["Auto", "Explicit"])
def test_sharded_result_keeps_the_split(records, axis):
    assert records[f"all-three/plain/{axis}"]["spec"] == ["x", "y", "z"]
    assert records[f"tokens/overlap/{axis}"]["spec"] == ["", "x", ""]
    assert records[f"batch/overlap/{axis}"]["spec"] == ["x", "", ""]
    # An overlap call split over channels: split the same way in d (with Auto axes the
    # propagator gathers it unless the caller asks for a sharding: docs/compress.md).
    if axis == "Explicit":
        assert records[f"channels/overlap/{axis}"]["spec"] == ["", "", "x"]
