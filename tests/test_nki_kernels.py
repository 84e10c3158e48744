"""The NKI kernel source, run by the project's NKI emulator (and by ``nki.simulate`` where the
Neuron SDK is installed), against a numpy model of the bf16 contract written out below.

Kernel-level tests feed the kernel interface directly (inputs built here in numpy); API-level
tests run ``implementation="nki_emulated"``, the whole Neuron data path (packing, the kernel under
the emulator through a host callback, unpacking), inside ``jax.jit`` and ``jax.vmap``.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_sparse_attn as jsa
from jax_sparse_attn.constants import BIAS_PREFIX_COLS, EMPTY_LOGIT, SCALE_COL
from jax_sparse_attn.neuron import kernels

BF16 = ml_dtypes.bfloat16


def bf16(x):
    """Rounds to bf16 (nearest even) and back to float32 values."""
    return np.asarray(x, np.float32).astype(BF16).astype(np.float32)


# --- the numpy model of CONTRACT section 2 -------------------------------------------------------


def contract_model(q, x, valid, sink, bias, scale):
    """bf16 sparse attention, step by step as CONTRACT section 2 states it.

    q [T, H, D] and x [T, K, D] hold bf16 values (the gathered slot rows); valid [T, K] bool;
    sink [H]; bias [T, K]; scale [T]. Returns [T, H, D] float32 holding bf16 values.
    """
    T, H, D = q.shape
    out = np.zeros((T, H, D), np.float32)
    for t in range(T):
        if not valid[t].any():
            continue  # a row with no valid slot is exactly 0, whatever the sink
        qt, xt = q[t].astype(np.float64), x[t].astype(np.float64)
        # 1. bf16 products are exact in float64; one rounding to the fp32 accumulator.
        s = (qt @ xt.T).astype(np.float32)
        # 2. scale on the logits, then the bias (EMPTY_LOGIT for an empty slot), fp32.
        b = np.where(valid[t], bias[t], EMPTY_LOGIT).astype(np.float32)
        s = s * np.float32(scale[t]) + b[None, :]
        # 3. max over the slots only.
        m = s.max(axis=1)
        # 4. fp32 exponentials; the denominator sums the fp32 values plus the sink term.
        e = np.exp(s - m[:, None])
        with np.errstate(over="ignore"):
            sink_term = np.exp((sink.astype(np.float32) - m).astype(np.float32))
        den = e.astype(np.float64).sum(axis=1).astype(np.float32) + sink_term
        # 5. bf16 probabilities in the value product, fp32 accumulation, one final rounding.
        num = (bf16(e).astype(np.float64) @ xt).astype(np.float32)
        out[t] = bf16(num / den[:, None])
    return out


def bf16_ulp(x):
    """Spacing of bf16 numbers at |x| (8 significant bits)."""
    exponent = np.floor(np.log2(np.maximum(np.abs(x), 2.0**-126)))
    return 2.0 ** (exponent - 7)


def assert_matches_contract(out, expected, *, min_fraction=0.999):
    """At least ``min_fraction`` of the elements within one bf16 ulp of the model, none far off."""
    out = np.asarray(out, np.float32)
    assert out.shape == expected.shape
    assert np.isfinite(out).all(), "NaN or inf in the output"
    diff = np.abs(out.astype(np.float64) - expected)
    within = np.mean(diff <= bf16_ulp(expected))
    assert within >= min_fraction, f"only {within:.5f} of the elements within one bf16 ulp"
    # A real bug moves elements by about their own size; accumulation order moves them by fp32
    # rounding of the terms, far below this bound.
    bound = 2.0**-7 * np.abs(expected) + 2.0**-12 * np.abs(expected).max()
    worst = np.max(diff - bound)
    assert worst <= 0, f"an element is off by {worst + bound.flat[np.argmax(diff - bound)]:.3g}"


# --- running the kernel ---------------------------------------------------------------------------


RUNNERS = ["emulator", "nki.simulate"]


def simulate_with_emulator(kernel, *arrays):
    from jax_sparse_attn.nki_emulator import simulate

    return np.asarray(simulate(kernel)(*arrays)).astype(np.float32)


def run_kernel(runner, kernel, *arrays):
    """Runs ``kernel`` on numpy arrays with the emulator, or with the real ``nki.simulate``.

    Under ``nki.simulate`` the result is also compared with the emulator's, so a divergence of the
    emulator from the Neuron SDK shows up wherever the SDK is installed.
    """
    if runner == "emulator":
        return simulate_with_emulator(kernel, *arrays)
    nki = pytest.importorskip(
        "nki",
        reason="the Neuron SDK (nki >= 0.3) is only installable on a Trainium host from the Neuron "
        "pip repository; the kernels run under the project's emulator here",
    )
    real = np.asarray(nki.simulate(kernel)(*arrays)).astype(np.float32)
    emulated = simulate_with_emulator(kernel, *arrays)
    assert_matches_contract(emulated, real)
    return real


def kernel_inputs(rng, T, H, D, Kp, R, empty_fraction=0.25, sink=None):
    """Numpy operands of the kernel interface, and what the model needs to check the result.

    Empty slots are sent as index 0 with bias -1e30, as the interface says. Columns 1..15 of the
    bias prefix hold junk the kernel must ignore.
    """
    q = bf16(rng.standard_normal((T, H, D)))
    kv = bf16(rng.standard_normal((R, D)))
    idx = rng.integers(0, R, (T, Kp)).astype(np.int32)
    valid = rng.random((T, Kp)) >= empty_fraction
    valid[:, 0] = True
    slot_bias = rng.normal(0, 0.5, (T, Kp)).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, T).astype(np.float32) * np.float32(D**-0.5)
    if sink is None:
        sink = rng.normal(0, 1, H).astype(np.float32)
    bias = np.full((T, BIAS_PREFIX_COLS + Kp), 7.0, np.float32)
    bias[:, SCALE_COL] = scale
    bias[:, BIAS_PREFIX_COLS:] = np.where(valid, slot_bias, EMPTY_LOGIT)
    sent_idx = np.where(valid, idx, 0).astype(np.int32)
    case = dict(q=q, x=kv[sent_idx], valid=valid, sink=sink, bias=slot_bias, scale=scale)
    operands = dict(
        q2=q.reshape(T * H, D).astype(BF16),
        kv=kv.astype(BF16),
        idx=sent_idx,
        bias=bias,
        sink=sink.reshape(H, 1).astype(np.float32),
        g2=kv[sent_idx].reshape(T * Kp, D).astype(BF16),
    )
    return operands, case


def run_both_kernels(runner, ops):
    """The indexed kernel and the pre-gathered kernel on the same operands."""
    by_index = run_kernel(
        runner, kernels.gathered_attn_idx_kernel, ops["q2"], ops["kv"], ops["idx"], ops["bias"],
        ops["sink"],
    )
    pre_gathered = run_kernel(
        runner, kernels.gathered_attn_kernel, ops["q2"], ops["g2"], ops["bias"], ops["sink"]
    )
    return by_index, pre_gathered


# (T, H, D, Kp, R): between them every kernel-level limit is exercised: one and many 128-slot
# tiles, score matmuls split at 512 slots (Kp 2048), the value accumulator split across PSUM banks
# (D 640, 1024), H from 1 to 128, a cache smaller than K (duplicated indices).
KERNEL_SHAPES = [
    pytest.param(2, 64, 128, 128, 300, id="H64-D128-K128"),
    pytest.param(1, 128, 512, 2048, 4096, id="H128-D512-K2048"),
    pytest.param(2, 16, 1024, 256, 64, id="H16-D1024-K256-dup"),
    pytest.param(3, 1, 640, 128, 1000, id="H1-D640-K128"),
]


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("T, H, D, Kp, R", KERNEL_SHAPES)
def test_kernels_meet_the_bf16_contract(runner, T, H, D, Kp, R):
    rng = np.random.default_rng(T * 1000 + H + D + Kp)
    ops, case = kernel_inputs(rng, T, H, D, Kp, R)
    expected = contract_model(**case).reshape(T * H, D)
    by_index, pre_gathered = run_both_kernels(runner, ops)
    assert_matches_contract(by_index, expected)
    assert_matches_contract(pre_gathered, expected)
    # Both kernels run the same instructions once the rows are in SBUF: identical bits.
    np.testing.assert_array_equal(by_index, pre_gathered)


@pytest.mark.parametrize("runner", RUNNERS)
def test_kernel_sink_edge_values(runner):
    """+inf sink -> that head is 0; -inf sink -> no sink term; a finite sink joins the denominator
    only (never the max), so a very large sink shrinks the head's output without NaN."""
    rng = np.random.default_rng(5)
    T, H, D, Kp = 2, 4, 128, 128
    sink = np.array([np.inf, -np.inf, 0.0, 30.0], np.float32)
    ops, case = kernel_inputs(rng, T, H, D, Kp, 50, sink=sink)
    expected = contract_model(**case)
    by_index, _ = run_both_kernels(runner, ops)
    out = by_index.reshape(T, H, D)
    np.testing.assert_array_equal(out[:, 0], 0)
    assert_matches_contract(out, expected)
    assert np.abs(out[:, 3]).max() < np.abs(out[:, 2]).max()


@pytest.mark.parametrize("runner", RUNNERS)
def test_kernel_zeroes_an_empty_row_when_a_finite_sink_overflows(runner):
    """All slots empty + finite sink: exp(sink + 1e30) = inf in the denominator, output exactly 0.
    Without a sink the kernel gives no meaningful value for such a row (the packing zeroes it)."""
    rng = np.random.default_rng(6)
    T, H, D, Kp = 2, 8, 128, 128
    ops, _ = kernel_inputs(rng, T, H, D, Kp, 40)
    ops["bias"][1, BIAS_PREFIX_COLS:] = EMPTY_LOGIT
    ops["idx"][1, :] = 0
    out = run_kernel(runner, kernels.gathered_attn_idx_kernel, ops["q2"], ops["kv"], ops["idx"],
                     ops["bias"], ops["sink"]).reshape(T, H, D)
    np.testing.assert_array_equal(out[1], 0)
    assert np.abs(out[0]).max() > 0


def test_emulator_rejects_an_out_of_range_index():
    """The indirect gather reads only rows inside kv: the packing must never send an invalid index."""
    from jax_sparse_attn.nki_emulator.errors import NkiEmulatorError

    rng = np.random.default_rng(7)
    ops, _ = kernel_inputs(rng, 1, 4, 128, 128, 10)
    ops["idx"][0, 5] = 10
    with pytest.raises(NkiEmulatorError):
        simulate_with_emulator(kernels.gathered_attn_idx_kernel, ops["q2"], ops["kv"], ops["idx"],
                               ops["bias"], ops["sink"])


# --- the whole Neuron data path through the public API -------------------------------------------


def flashmla_invalid(R):
    """FlashMLA's test set of invalid indices for a cache of R rows (CONTRACT section 5)."""
    return np.array([-(2**31), -123456, -1, R, R + 114514, 2**31 - 1], np.int64)


def api_inputs(rng, T, H, D, K, R):
    q = bf16(rng.standard_normal((T, H, D)))
    kv = bf16(rng.standard_normal((R, D)))
    idx = rng.integers(0, R, (T, K)).astype(np.int64)
    invalid = flashmla_invalid(R)
    where_invalid = rng.random((T, K)) < 0.3
    idx[where_invalid] = invalid[rng.integers(0, len(invalid), where_invalid.sum())]
    bias = rng.normal(0, 0.5, (T, K)).astype(np.float32)
    sink = rng.normal(0, 1, H).astype(np.float32)
    sink[: H // 8] = -np.inf
    sink[H // 8 : H // 4] = np.inf
    return q, kv, idx, bias, sink


def idx_model(q, kv, idx, sink, bias, scale):
    R = kv.shape[0]
    valid = (idx >= 0) & (idx < R) & (bias != -np.inf)
    x = kv[np.where(valid, idx, 0)]
    T = q.shape[0]
    return contract_model(q, x, valid, sink, np.where(valid, bias, 0), np.full(T, scale, np.float32))


def gathered_model(q, g, sink, bias, scale):
    valid = bias != -np.inf
    T = q.shape[0]
    return contract_model(q, g, valid, sink, np.where(valid, bias, 0), np.full(T, scale, np.float32))


def as_bf16(x):
    return jnp.asarray(x, jnp.bfloat16)


@pytest.mark.parametrize(
    "T, H, D, K, R",
    [
        pytest.param(2, 130, 576, 100, 37, id="H130-D576-K100"),
        pytest.param(3, 200, 64, 1, 5, id="H200-D64-K1"),
        pytest.param(1, 1, 1024, 2048, 3000, id="H1-D1024-K2048"),
    ],
)
def test_emulated_path_jit_idx(T, H, D, K, R):
    rng = np.random.default_rng(10 + H)
    q, kv, idx, bias, sink = api_inputs(rng, T, H, D, K, R)
    bias[0, :2] = -np.inf  # empty by bias, whatever the index
    scale = 0.1
    fn = jax.jit(lambda q, kv, idx, sink, bias: jsa.gathered_attn_idx(
        q, kv, idx, sink, bias=bias, scale=scale, implementation="nki_emulated"))
    out = fn(as_bf16(q), as_bf16(kv), jnp.asarray(idx), jnp.asarray(sink), jnp.asarray(bias))
    assert out.shape == (T, H, D) and out.dtype == jnp.bfloat16
    assert_matches_contract(np.asarray(out, np.float32), idx_model(q, kv, idx, sink, bias, scale))


@pytest.mark.parametrize(
    "T, H, D, K",
    [pytest.param(3, 200, 64, 1, id="H200-D64-K1"), pytest.param(2, 64, 576, 100, id="H64-D576-K100")],
)
def test_emulated_path_jit_gathered(T, H, D, K):
    rng = np.random.default_rng(20 + H)
    q = bf16(rng.standard_normal((T, H, D)))
    g = bf16(rng.standard_normal((T, K, D)))
    bias = rng.normal(0, 0.5, (T, K)).astype(np.float32)
    bias[0, K // 2 :] = -np.inf
    sink = rng.normal(0, 1, H).astype(np.float32)
    fn = jax.jit(lambda q, g, sink, bias: jsa.gathered_attn(
        q, g, sink, bias=bias, implementation="nki_emulated"))
    out = fn(as_bf16(q), as_bf16(g), jnp.asarray(sink), jnp.asarray(bias))
    assert_matches_contract(np.asarray(out, np.float32), gathered_model(q, g, sink, bias, D**-0.5))


@pytest.mark.parametrize("with_sink", [True, False])
def test_emulated_path_rows_without_a_valid_slot_are_exactly_zero(with_sink):
    rng = np.random.default_rng(30)
    T, H, D, K, R = 4, 64, 128, 128, 50
    q, kv, idx, bias, sink = api_inputs(rng, T, H, D, K, R)
    sink = np.zeros(H, np.float32)
    idx[1] = flashmla_invalid(R)[np.arange(K) % 6]  # every index invalid
    bias[3] = -np.inf  # every slot masked by its bias
    out = jsa.gathered_attn_idx(as_bf16(q), as_bf16(kv), idx, sink if with_sink else None,
                                bias=bias, implementation="nki_emulated")
    out = np.asarray(out, np.float32)
    np.testing.assert_array_equal(out[1], 0)
    np.testing.assert_array_equal(out[3], 0)
    no_sink = np.full(H, -np.inf, np.float32)
    expected = idx_model(q, kv, idx, sink if with_sink else no_sink, bias, D**-0.5)
    assert_matches_contract(out, expected)


def test_emulated_path_under_vmap():
    """Batches fold into tokens before lowering: shared kv (in_axes None), a batched cache, and the
    pre-gathered op, each against the model of the unbatched op per batch element."""
    rng = np.random.default_rng(40)
    B, T, H, D, K, R = 2, 2, 8, 64, 20, 30
    qs = bf16(rng.standard_normal((B, T, H, D)))
    kvs = bf16(rng.standard_normal((B, R, D)))
    idxs = rng.integers(-3, R + 3, (B, T, K))
    sink = rng.normal(0, 1, H).astype(np.float32)
    bias = np.zeros((T, K), np.float32)

    def attend(q, kv, idx):
        return jsa.gathered_attn_idx(q, kv, idx, sink, implementation="nki_emulated")

    shared = jax.jit(jax.vmap(attend, in_axes=(0, None, 0)))(as_bf16(qs), as_bf16(kvs[0]), idxs)
    per_cache = jax.jit(jax.vmap(attend))(as_bf16(qs), as_bf16(kvs), idxs)
    for b in range(B):
        assert_matches_contract(np.asarray(shared[b], np.float32),
                                idx_model(qs[b], kvs[0], idxs[b], sink, bias, D**-0.5))
        assert_matches_contract(np.asarray(per_cache[b], np.float32),
                                idx_model(qs[b], kvs[b], idxs[b], sink, bias, D**-0.5))

    gs = bf16(rng.standard_normal((B, T, K, D)))
    gathered = jax.jit(jax.vmap(lambda q, g: jsa.gathered_attn(
        q, g, sink, implementation="nki_emulated")))(as_bf16(qs), as_bf16(gs))
    for b in range(B):
        assert_matches_contract(np.asarray(gathered[b], np.float32),
                                gathered_model(qs[b], gs[b], sink, bias, D**-0.5))


def test_emulated_path_casts_f32_inputs_to_bf16():
    """The kernel is bf16-only: f32 q and kv go through it rounded to bf16, the result comes back
    in f32 holding bf16 values."""
    rng = np.random.default_rng(50)
    T, H, D, K, R = 2, 4, 128, 16, 40
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    kv = rng.standard_normal((R, D)).astype(np.float32)
    idx = rng.integers(0, R, (T, K))
    out = jsa.gathered_attn_idx(q, kv, idx, implementation="nki_emulated")
    assert out.dtype == jnp.float32
    out = np.asarray(out)
    np.testing.assert_array_equal(out, bf16(out))
    zeros = np.zeros((T, K), np.float32)
    assert_matches_contract(out, idx_model(bf16(q), bf16(kv), idx, np.full(H, -np.inf, np.float32),
                                           zeros, D**-0.5))


def test_emulated_path_empty_shapes():
    q = jnp.ones((0, 4, 64), jnp.bfloat16)
    assert jsa.gathered_attn_idx(q, jnp.ones((5, 64), jnp.bfloat16), jnp.zeros((0, 3), jnp.int32),
                                 implementation="nki_emulated").shape == (0, 4, 64)
    q = jnp.ones((2, 4, 64), jnp.bfloat16)
    out = jsa.gathered_attn_idx(q, jnp.ones((5, 64), jnp.bfloat16), jnp.zeros((2, 0), jnp.int32),
                                implementation="nki_emulated")
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0)
