"""Unselected rows never reach the output, and NaN only comes from NaN (docs/contract.md).

- A cache row that no valid slot selects (empty, masked by a ``-inf`` bias, padding) changes no
  output bit and no gradient element, whatever it holds.
- For finite inputs no output is NaN, whatever the magnitudes (the logit saturation rule and the
  overflow guards of both products); gradients are NaN-free within the documented bound.
- A NaN output element traces back to a NaN in an input that element depends on.

Every case runs on the reference and, at small shapes, on the emulated Neuron path
(``implementation="nki_emulated"``); FlashMLA's sparse decode test is re-created at the end.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_sparse_attn as jsa
from oracle import BF16, attention_f64, gather, invalid_indices

IMPLEMENTATIONS = ["reference", "nki_emulated"]
FLT_MAX = float(np.finfo(np.float32).max)
BF16_MAX = float(ml_dtypes.finfo(BF16).max)
POISONS = [np.nan, np.inf, -np.inf, 3e38]


def _settings(implementation, n=15):
    # The emulated kernel costs milliseconds per token: fewer examples.
    return settings(
        max_examples=n if implementation == "reference" else max(n // 3, 5),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


def _bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _assert_same_bits(actual, expected, what):
    assert actual.shape == expected.shape, what
    same = _bits(actual) == _bits(expected)
    assert same.all(), f"{what}: {np.size(same) - same.sum()} of {np.size(same)} elements differ"


# --- poisoned unselected rows ------------------------------------------------------------------


@st.composite
def poisoned_cases(draw, small):
    """A case whose unselected rows hold ``poison``: slots are valid, empty (FlashMLA's invalid
    set) or masked by a ``-inf`` bias (pointing at any row, poisoned ones included)."""
    T = draw(st.integers(1, 3 if small else 5))
    H = draw(st.integers(1, 4 if small else 9))
    D = draw(st.sampled_from([8, 32, 64] if small else [1, 8, 40, 64, 130]))
    K = draw(st.integers(1, 9 if small else 20))
    R = draw(st.integers(2, 12 if small else 40))
    dtype = BF16 if small else draw(st.sampled_from([BF16, np.float32]))
    poison = draw(st.sampled_from(POISONS))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    used = rng.choice(R, size=draw(st.integers(1, R - 1)), replace=False)
    kind = rng.choice(3, (T, K), p=[0.5, 0.3, 0.2])  # 0 valid, 1 empty, 2 masked
    if draw(st.booleans()):
        kind[0] = 1  # a token with no valid slot
    idx = np.where(kind == 0, rng.choice(used, (T, K)), rng.integers(0, R, (T, K))).astype(np.int64)
    idx = np.where(kind == 1, rng.choice(np.array(invalid_indices(R), np.int64), (T, K)), idx)
    bias = rng.standard_normal((T, K)).astype(np.float32)
    bias[kind == 2] = -np.inf
    selected = np.zeros(R, bool)
    selected[idx[kind == 0]] = True
    kv = rng.standard_normal((R, D)).astype(dtype)
    poisoned = kv.copy()
    with np.errstate(over="ignore"):
        poisoned[~selected] = np.asarray(poison, np.float32).astype(dtype)
    return dict(
        q=rng.standard_normal((T, H, D)).astype(dtype),
        kv=kv,
        poisoned=poisoned,
        selected=selected,
        idx=idx,
        bias=bias,
        sink=rng.choice(np.array([-np.inf, np.inf, 0.0, 1.5], np.float32), H),
        scale=np.float32(rng.uniform(0.05, 0.5)),
    )


def _loss_and_grads(idx, q_shape, implementation):
    """``(out, grads of q, kv, sink, bias, scale)`` of a weighted sum of ``gathered_attn_idx``
    over this ``idx`` as one program of ``(q, kv, sink, bias, scale)``: idx stays a host constant,
    at full width, and a case calls it on its clean and its poisoned cache (one compile)."""
    w = jnp.asarray(np.random.default_rng(1).standard_normal(q_shape), jnp.float32)

    def loss(q, kv, sink, bias, scale):
        out = jsa.gathered_attn_idx(q, kv, idx, sink, bias=bias, scale=scale, implementation=implementation)
        return jnp.sum(out.astype(jnp.float32) * w), out

    # An eager gradient would compile each operation of the rules on its own.
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))

    def run(q, kv, sink, bias, scale):
        (_, out), grads = grad(*map(jnp.asarray, (q, kv, sink, bias, scale)))
        return np.asarray(out), [np.asarray(g) for g in grads]

    return run


def _jitted_op(idx, implementation):
    """``gathered_attn_idx`` over this ``idx`` (a host constant, at full width) as one program of
    ``(q, kv, sink, bias, scale)``."""
    return jax.jit(lambda q, kv, sink, bias, scale: jsa.gathered_attn_idx(
        q, kv, idx, sink, bias=bias, scale=scale, implementation=implementation))


@pytest.mark.slow
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_poisoned_unselected_rows_change_no_bit(implementation):
    small = implementation != "reference"

    @_settings(implementation)
    @given(poisoned_cases(small))
    def check(case):
        args = (case["q"], case["idx"], case["sink"], case["bias"], case["scale"])
        q, idx, sink, bias, scale = args
        op = _jitted_op(idx, implementation)
        out = op(q, case["kv"], sink, bias, scale)
        bad = op(q, case["poisoned"], sink, bias, scale)
        _assert_same_bits(np.asarray(bad), np.asarray(out), "output")
        assert np.all(np.isfinite(np.asarray(bad, np.float32)))

    check()


@pytest.mark.slow
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_poisoned_unselected_rows_change_no_gradient(implementation):
    small = implementation != "reference"

    @_settings(implementation, n=10)
    @given(poisoned_cases(small))
    def check(case):
        q, idx, sink, bias, scale = case["q"], case["idx"], case["sink"], case["bias"], case["scale"]
        run = _loss_and_grads(idx, q.shape, implementation)
        out, grads = run(q, case["kv"], sink, bias, scale)
        bad_out, bad_grads = run(q, case["poisoned"], sink, bias, scale)
        _assert_same_bits(bad_out, out, "output")
        for name, g, b in zip(("q", "kv", "sink", "bias", "scale"), grads, bad_grads):
            _assert_same_bits(b, g, f"d{name}")
            assert np.all(np.isfinite(np.asarray(b, np.float32))), f"d{name}"
        dkv = bad_grads[1].astype(np.float32)
        assert np.all(dkv[~case["selected"]] == 0)

    check()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("poison", POISONS)
def test_masked_pregathered_slots_are_never_read(rng, implementation, poison):
    T, H, D, K = 3, 4, 32, 6
    q = rng.standard_normal((T, H, D)).astype(BF16)
    g = rng.standard_normal((T, K, D)).astype(BF16)
    bias = rng.standard_normal((T, K)).astype(np.float32)
    bias[:, 1] = bias[2] = -np.inf  # one masked slot per token, and a token with none valid
    bad = g.copy()
    bad[np.isneginf(bias)] = np.asarray(poison, np.float32).astype(BF16)
    sink = np.float32([0.0, -np.inf, 1.0, np.inf])

    def run(g):
        def loss(q, g, sink, bias):
            out = jsa.gathered_attn(q, g, sink, bias=bias, implementation=implementation)
            return jnp.sum(out.astype(jnp.float32) ** 2), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, g, sink, bias)
        return [np.asarray(out)] + [np.asarray(x) for x in grads]

    for name, a, b in zip(("out", "dq", "dg", "dsink", "dbias"), run(g), run(bad)):
        _assert_same_bits(b, a, name)
    assert np.all(run(bad)[2].astype(np.float32)[np.isneginf(bias)] == 0)


# --- finite inputs never give NaN --------------------------------------------------------------


@st.composite
def extreme_cases(draw, dtypes):
    """Finite inputs of any magnitude, including FLT_MAX-sized biases and sinks and huge scales."""
    dtype = draw(st.sampled_from(dtypes))
    top = BF16_MAX if dtype is BF16 else FLT_MAX
    T = draw(st.integers(1, 3))
    H = draw(st.integers(1, 4))
    D = draw(st.sampled_from([1, 16, 64]))
    K = draw(st.integers(1, 8))
    R = draw(st.integers(1, 10))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def values(shape, magnitudes):
        m = rng.choice(np.array(magnitudes), shape)
        return np.clip(rng.standard_normal(shape) * m, -top, top).astype(dtype)

    mags = [1e-30, 1.0, 1e19, 1e30, top]
    q = values((T, H, D), draw(st.sampled_from([mags, [top], [1e19]])))
    kv = values((R, D), draw(st.sampled_from([mags, [top], [1e19]])))
    # rows at exactly +-max in every column: the value product's sum overflows without its guard
    if draw(st.booleans()):
        kv[: R // 2 + 1] = np.asarray(top, np.float32).astype(dtype) * rng.choice([-1, 1], (R // 2 + 1, 1)).astype(dtype)
    pool = invalid_indices(R) + list(range(R)) * 3
    idx = rng.choice(np.array(pool, np.int64), (T, K))
    specials = np.array([0.0, -1.0, 3e38, -3e38, 1e30, -1e30, np.inf, -np.inf], np.float32)
    bias = None
    if draw(st.booleans()):
        bias = rng.choice(specials, (T, K))
    sink = None
    if draw(st.booleans()):
        sink = rng.choice(specials, H)
    scale = draw(st.sampled_from([None, 1e-30, 1.0, 1e30, -1e30, 3e38, float(np.inf), -float(np.inf)]))
    return q, kv, idx, sink, bias, scale


@pytest.mark.slow
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_finite_inputs_never_give_nan(implementation):
    dtypes = [BF16, np.float32] if implementation == "reference" else [BF16]

    @_settings(implementation, n=30)
    @given(extreme_cases(dtypes))
    def check(case):
        q, kv, idx, sink, bias, scale = case
        out = np.asarray(_jitted_op(idx, implementation)(q, kv, sink, bias, scale), np.float64)
        assert not np.isnan(out).any()
        # The output is a convex combination of the selected rows (sink weight aside), so it
        # never exceeds their largest magnitude beyond the bf16 rounding of the probabilities.
        x, valid = gather(kv, idx)
        if bias is not None:
            valid &= ~np.isneginf(bias)
        top = np.abs(np.where(valid[..., None], x.astype(np.float64), 0)).max(axis=(1, 2))
        limit = (top * (1 + 2.0**-7) if q.dtype == BF16 else top * (1 + 1e-5))[:, None, None]
        within = np.abs(out) <= limit
        if q.dtype == BF16:
            assert np.isfinite(out).all()
        else:  # f32 rows within rounding of FLT_MAX may give an output that rounds to inf
            within |= np.isinf(out) & (limit > FLT_MAX)
        assert within.all()

    check()


def _saturation_setup(rng, dtype, magnitude, T=3, H=2, D=64):
    v = rng.standard_normal(D)
    v /= np.linalg.norm(v)
    w = rng.standard_normal(D)
    w -= (w @ v) * v
    w /= np.linalg.norm(w)
    q = np.broadcast_to(v * magnitude, (T, H, D)).astype(dtype)
    # rows: along q (its logit overflows upwards), against q (downwards), nearly orthogonal and
    # tiny (an ordinary logit), and against q again
    kv = np.stack([v * magnitude, -v * magnitude, w * 1e-20, -(v + w) * magnitude]).astype(dtype)
    return q, kv


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("magnitude", [1e19, 1e30, BF16_MAX / 8])
def test_overflowing_logits_saturate_to_a_hard_max(rng, implementation, magnitude):
    # q . kv[0] overflows f32 upwards, q . kv[1] and q . kv[3] downwards: the rule saturates them
    # (FLT_MAX, then LOGIT_LIMIT after the scale), so row 0 takes all the weight, exactly.
    q, kv = _saturation_setup(rng, BF16, magnitude)
    idx = np.array([[1, 0, 3, 2, -1], [0, -1, 1, 1, 3], [3, 1, 0, 0, 114514]])
    out = np.asarray(jsa.gathered_attn_idx(q, kv, idx, np.float32([0.0, -np.inf]), implementation=implementation))
    # token 2 selects row 0 twice: two equal weights, still exactly row 0
    _assert_same_bits(out, np.broadcast_to(kv[0], q.shape), "output")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_plus_inf_bias_is_flt_max(rng, implementation):
    T, H, D, R = 2, 3, 32, 6
    q = rng.standard_normal((T, H, D)).astype(BF16)
    kv = rng.standard_normal((R, D)).astype(BF16)
    idx = np.array([[0, 1, 2, 3], [4, 5, 1, 2]])
    bias = np.float32([[0.0, np.inf, 0.0, 50.0], [np.inf, 1e30, np.inf, -np.inf]])
    sink = np.float32([0.0, 1e38, np.inf])
    out = np.asarray(jsa.gathered_attn_idx(q, kv, idx, sink, bias=bias, implementation=implementation), np.float64)
    # token 0: slot 1 alone reaches FLT_MAX; token 1: slots 0 and 2 tie at FLT_MAX (the 1e30 bias
    # stays 1e29 + ... below): each gets half. A sink below FLT_MAX adds exp(-huge) = 0; +inf
    # zeroes its head.
    want0 = kv[1].astype(np.float64)
    want1 = (kv[4].astype(np.float64) + kv[1].astype(np.float64)) / 2
    for h in range(2):
        np.testing.assert_array_equal(out[0, h], want0)
        np.testing.assert_allclose(out[1, h], want1, rtol=2**-8, atol=1e-6)
    assert np.all(out[:, 2] == 0)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_value_product_of_rows_at_the_dtype_max_does_not_overflow(implementation):
    top = np.asarray(BF16_MAX, np.float32).astype(BF16)
    T, H, D, K = 2, 2, 16, 8
    q = np.zeros((T, H, D), BF16)  # every logit 0: uniform weights
    kv = np.stack([np.full(D, top), np.full(D, -top)]).astype(BF16)
    idx = np.array([[0, 0, 0, 0, 0, 0, 0, 0], [0, 1, 0, 1, 0, 1, 1, 0]])
    out = np.asarray(jsa.gathered_attn_idx(q, kv, idx, implementation=implementation), np.float32)
    np.testing.assert_array_equal(out[0], np.full((H, D), BF16_MAX, np.float32))
    np.testing.assert_array_equal(out[1], np.zeros((H, D), np.float32))


def test_gradients_are_finite_within_the_documented_bound(rng):
    # 4 (T + K) H D^2 max(1,|scale|) max(1,|ct|) max(1,|q|) max(1,|x|)^2 <= FLT_MAX: here about
    # 4 * 12 * 3 * 4096 * 10 * 1 * 1e6 * 1e12, with saturated logits, FLT_MAX biases and sinks.
    T, H, D, R, K = 4, 3, 64, 9, 8
    q = (rng.standard_normal((T, H, D)) * 1e6).astype(np.float32)
    kv = (rng.standard_normal((R, D)) * 1e6).astype(np.float32)
    idx = rng.choice(np.array(invalid_indices(R) + list(range(R)) * 2), (T, K))
    bias = rng.choice(np.float32([0.0, np.inf, -np.inf, 3e38, -3e38]), (T, K))
    sink = np.float32([3e38, -np.inf, -3e38])

    def loss(q, kv, sink, bias, scale):
        out = jsa.gathered_attn_idx(q, kv, idx, sink, bias=bias, scale=scale)
        return jnp.sum(out * 0.5)

    grads = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, kv, sink, bias, jnp.float32(10.0))
    for name, g in zip(("q", "kv", "sink", "bias", "scale"), grads):
        assert np.all(np.isfinite(np.asarray(g))), f"d{name}"


# --- NaN only from NaN -------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("where", ["q", "selected_row", "sink", "bias", "scale"])
def test_a_nan_reaches_only_the_outputs_that_depend_on_it(rng, implementation, where):
    T, H, D, R, K = 4, 3, 32, 10, 5
    q = rng.standard_normal((T, H, D)).astype(BF16)
    kv = rng.standard_normal((R, D)).astype(BF16)
    idx = np.array([[1, 2, 3, -1, 12], [4, 5, 4, 6, -7], [1, 7, 8, 9, 2], [-1] * 5])
    sink = np.float32([0.0, 1.0, -np.inf])
    bias = np.zeros((T, K), np.float32)
    scale = np.float32(0.1)
    allowed = np.zeros((T, H, D), bool)  # the outputs that depend on the poisoned input
    if where == "q":
        q[1, 2, 5] = np.nan
        allowed[1] = True
    elif where == "selected_row":
        kv[4] = np.nan
        allowed[1] = True
    elif where == "sink":
        sink[1] = np.nan
        allowed[:, 1] = True
    elif where == "bias":
        bias[2, 3] = np.nan
        allowed[2] = True
    else:
        scale = np.float32(np.nan)
        allowed[:] = True
    out = np.asarray(jsa.gathered_attn_idx(q, kv, idx, sink, bias=bias, scale=scale, implementation=implementation), np.float32)
    nan = np.isnan(out)
    assert not np.any(nan & ~allowed)
    assert nan.any()  # and it does reach them (the token with no valid slot stays 0)
    assert np.all(out[3] == 0)


# --- FlashMLA's sparse decode test, in this project's terms -------------------------------------


def _flashmla_decode_case(seed, H, D, topk, rows, batch, tokens_per_seq):
    """Inputs shaped like FlashMLA's sparse decode test: q from a standard normal clamped to
    [-1, 1]; per sequence a cache of ``rows`` rows drawn from a normal of deviation 0.1 clamped
    to [-1, 1]; each token's indices are valid
    rows or FlashMLA's invalid set; a top-k length per token whose tail is ``-1``; one token with
    every index invalid; every row that no valid index selects is NaN; sinks standard normal, set
    to ``+inf`` where a second draw exceeds 0.5 and to ``-inf`` where it is below -0.5."""
    rng = np.random.default_rng(seed)
    T = tokens_per_seq
    q = np.clip(rng.standard_normal((batch, T, H, D)), -1, 1).astype(BF16)
    kv = np.clip(rng.standard_normal((batch, rows, D)) / 10, -1, 1).astype(BF16)
    idx = np.stack([np.stack([rng.permutation(rows)[:topk] for _ in range(T)]) for _ in range(batch)])
    idx = idx.astype(np.int64)
    invalid = rng.random(idx.shape) < 0.1
    idx[invalid] = rng.choice(np.array(invalid_indices(rows), np.int64), invalid.sum())
    lengths = rng.integers(1, topk + 1, (batch, T))
    idx[np.arange(topk)[None, None, :] >= lengths[..., None]] = -1
    idx[0, 0] = rng.choice(np.array(invalid_indices(rows), np.int64), topk)  # all invalid
    for b in range(batch):
        selected = np.zeros(rows, bool)
        valid = (idx[b] >= 0) & (idx[b] < rows)
        selected[idx[b][valid]] = True
        kv[b, ~selected] = np.nan
    sink = rng.standard_normal(H).astype(np.float32)
    draw = rng.standard_normal(H)
    sink[draw > 0.5] = np.inf
    sink[draw < -0.5] = -np.inf
    return q, kv, idx, sink


def _flashmla_allclose(actual, expected, abs_tol, rel_tol, cos_diff_tol):
    """FlashMLA's comparison: inf/-inf/NaN at the same places, every element within the absolute
    OR the relative tolerance (relative error ``|a - e| / (|e| + 1e-6)``), and a cosine
    difference ``1 - 2 sum(a e) / sum(a^2 + e^2)`` within ``cos_diff_tol``."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    for special in (np.inf, -np.inf):
        np.testing.assert_array_equal(actual == special, expected == special)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    finite = np.isfinite(expected)
    err = np.abs(actual[finite] - expected[finite])
    ok = (err < abs_tol) | (err / (np.abs(expected[finite]) + 1e-6) < rel_tol)
    assert ok.all(), f"{(~ok).sum()} of {ok.size} elements outside FlashMLA's tolerance; max abs err {err.max()}"
    a, e = actual[finite], expected[finite]
    denominator = np.sum(a * a + e * e)
    cos_diff = 0.0 if denominator == 0 else 1 - 2 * np.sum(a * e) / denominator
    assert abs(cos_diff) <= cos_diff_tol, cos_diff


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("H, topk, seed", [(64, 64, 0), (128, 128, 1), (64, 200, 2)])
def test_flashmla_sparse_decode_regression(implementation, H, topk, seed):
    D, rows, batch, T = 512, 512, 2, 3
    q, kv, idx, sink = _flashmla_decode_case(seed, H, D, topk, rows, batch, T)
    scale = D**-0.5
    attn = jax.vmap(lambda q, kv, idx: jsa.gathered_attn_idx(q, kv, idx, sink, scale=scale, implementation=implementation))
    out = np.asarray(attn(q, kv, idx.astype(np.int32)))  # FlashMLA's invalid set fits int32
    for b in range(batch):
        x, valid = gather(kv[b], idx[b])  # zeros for every unselected row: the oracle never reads NaN
        want = attention_f64(q[b], x, valid, sink, scale=scale)
        # FlashMLA's tolerance for its sparse kernels' bf16 output against an fp32 reference
        _flashmla_allclose(out[b].astype(np.float64), want, abs_tol=8e-4, rel_tol=3.01 / 128, cos_diff_tol=7e-6)
    assert np.all(out[0, 0].astype(np.float32) == 0)
