"""The NKI kernel source, run by the project's NKI emulator (and by ``nki.simulate`` where the
Neuron SDK is installed), against a numpy model of the bf16 contract written out below.

Kernel-level tests feed the kernel interface directly (inputs built here in numpy), launched as
on each target (``kernel[2]`` on trn2/trn3, one program on trn1; trn3 only in the slow run);
API-level tests run ``implementation="nki_emulated"``, the whole Neuron data path (packing, the
kernel under the emulator through a host callback, unpacking), inside ``jax.jit`` and ``jax.vmap``,
with ``NEURON_PLATFORM_TARGET_OVERRIDE`` naming trn1 and trn2 in turn.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_sparse_attn as jsa
from jax_sparse_attn.constants import (
    BIAS_PREFIX_COLS, EMPTY_LOGIT, EMPTY_SLOT_INDEX, SCALE_COL, UP_COLS,
)  # fmt: skip
from jax_sparse_attn.attention import kernel as kernels
from jax_sparse_attn.nki_emulator import versions

BF16 = ml_dtypes.bfloat16


# The data path through JAX (the nki_emulated implementation) has no branch on the NKI version.
THROUGH_JAX = "test_emulated_"


def pytest_generate_tests(metafunc):
    """The kernels' own simulations run under each NKI version the kernels support
    (docs/guides/trainium.md, "Running on Trainium"): the newest in the default run, the others in the slow run. They run
    no JAX (the emulator and the kernels are numpy): jax_free, so CI runs them with one JAX. The
    data path through JAX (``test_emulated_*``) runs under the default version only."""
    if metafunc.function.__name__.startswith(THROUGH_JAX):
        params = [versions.DEFAULT_VERSION]
    else:
        params = [pytest.param(v, marks=[pytest.mark.jax_free] + (
            [] if v == versions.DEFAULT_VERSION else [pytest.mark.slow]))
            for v in versions.SUPPORTED_VERSIONS]
    metafunc.parametrize("nki_version", params, indirect=True)


@pytest.fixture(autouse=True)
def nki_version(request, monkeypatch):
    """The NKI version of the test (``pytest_generate_tests``), set in the environment variable
    (not a thread-local) so that the host callbacks of nki_emulated see it too."""
    monkeypatch.setenv(versions.VERSION_ENV, request.param)
    return request.param


def bf16(x):
    """Rounds to bf16 (nearest even) and back to float32 values."""
    return np.asarray(x, np.float32).astype(BF16).astype(np.float32)


# --- the numpy model of docs/contract.md ---------------------------------------------------------

FLT_MAX = np.float32(np.finfo(np.float32).max)
LOGIT_LIMIT = np.float32(1e29)


def contract_model(q, x, valid, sink, bias, scale, *, with_lse=False):
    """bf16 sparse attention, step by step as docs/contract.md states it.

    q [T, H, D] and x [T, K, D] hold bf16 values (the gathered slot rows; an empty slot's row is
    never used); valid [T, K] bool; sink [H]; bias [T, K]; scale [T]. Returns [T, H, D] float32
    holding bf16 values (and, with ``with_lse``, lse [T, H] float64: the sink for a row with no
    valid slot).
    """
    T, H, D = q.shape
    out = np.zeros((T, H, D), np.float32)
    lse = np.tile(np.asarray(sink, np.float64), (T, 1))
    for t in range(T):
        if not valid[t].any():
            continue  # a row with no valid slot is exactly 0, whatever the sink
        xt = np.where(valid[t][:, None], x[t], 0).astype(np.float64)
        qt = q[t].astype(np.float64)
        # 1. bf16 products are exact in float64; one rounding to the fp32 accumulator, which an
        # overflow saturates at +-FLT_MAX.
        with np.errstate(over="ignore", invalid="ignore"):
            a = np.clip((qt @ xt.T).astype(np.float32), -FLT_MAX, FLT_MAX)
            # 2. scale on the logits, clamped to +-1e29, then the bias (-1e30 for an empty slot).
            b = np.where(valid[t], bias[t], EMPTY_LOGIT).astype(np.float32)
            s = np.clip(a * np.float32(scale[t]), -LOGIT_LIMIT, LOGIT_LIMIT) + b[None, :]
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
        with np.errstate(divide="ignore"):
            lse[t] = m.astype(np.float64) + np.log(den.astype(np.float64))
    return (out, lse) if with_lse else out


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

# The NKI targets and the kernels that run on each (docs/neuron-kernel.md, "Variants"); trn3 runs
# the trn2 kernels with a larger SBUF, so it is only in the slow run.
TARGET_KERNELS = {
    "trn1": ("gathered",),
    "trn2": ("idx", "gathered"),
    "trn3": ("idx", "gathered"),
}
TARGETS = ["trn1", "trn2", pytest.param("trn3", marks=pytest.mark.slow)]
# The launch grid on each target: one program per physical core of the logical core.
PROGRAMS = {"trn1": 1, "trn2": 2, "trn3": 2}


def simulate_with_emulator(kernel, *arrays, target="trn2", programs=1, **options):
    from jax_sparse_attn.nki_emulator import simulate

    out, lse = simulate(kernel, target=target)[programs](*arrays, **options)
    return np.asarray(out).astype(np.float32), np.asarray(lse, np.float64)


def run_kernel(runner, kernel, *arrays, target="trn2", programs=1, **options):
    """Runs ``kernel`` on numpy arrays with the emulator, or with the real ``nki.simulate``,
    launched as ``kernel[programs]``.

    Returns ``(out as float32, lse as float64)``. Under ``nki.simulate`` the result is also
    compared with the emulator's, so a divergence of the emulator from the Neuron SDK shows up
    wherever the SDK is installed.
    """
    if runner == "emulator":
        return simulate_with_emulator(kernel, *arrays, target=target, programs=programs, **options)
    nki = pytest.importorskip(
        "nki",
        reason="the Neuron SDK (nki 0.6 or 0.7) is only installable on a Trainium host from the Neuron "
        "pip repository; the kernels run under the project's emulator here",
    )
    import os

    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = target
    real_out, real_lse = nki.simulate(nki.jit(kernel)[programs])(*arrays, **options)
    real = np.asarray(real_out).astype(np.float32), np.asarray(real_lse, np.float64)
    emulated = simulate_with_emulator(kernel, *arrays, target=target, programs=programs, **options)
    assert_matches_contract(emulated[0], real[0])
    return real


def kernel_inputs(rng, T, H, D, Kp, R, empty_fraction=0.25, sink=None, poison=None):
    """Numpy operands of the kernel interface, and what the model needs to check the result.

    Empty slots are sent as index ``EMPTY_SLOT_INDEX`` with bias -1e30, their pre-gathered rows as
    zeros, as the interface says. Columns 1..15 of the bias prefix hold junk the kernel must
    ignore; columns UP_COLS are 1 (q not scaled down). ``poison``: a value written into every cache row that no valid slot selects (and into
    row 0, which then is never selected).
    """
    q = bf16(rng.standard_normal((T, H, D)))
    kv = bf16(rng.standard_normal((R, D)))
    idx = rng.integers(0, R, (T, Kp)).astype(np.int64)
    valid = rng.random((T, Kp)) >= empty_fraction
    valid[:, 0] = True
    if poison is not None:
        idx = np.where(idx == 0, 1 % R, idx)
        unused = np.ones(R, bool)
        unused[idx[valid]] = False
        kv[unused] = poison
    slot_bias = rng.normal(0, 0.5, (T, Kp)).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, T).astype(np.float32) * np.float32(D**-0.5)
    if sink is None:
        sink = rng.normal(0, 1, H).astype(np.float32)
    bias = np.full((T, BIAS_PREFIX_COLS + Kp), 7.0, np.float32)
    bias[:, SCALE_COL] = scale
    bias[:, list(UP_COLS)] = 1.0  # q is not scaled down here
    bias[:, BIAS_PREFIX_COLS:] = np.where(valid, slot_bias, EMPTY_LOGIT)
    x = np.where(valid[:, :, None], kv[np.where(valid, idx, 0)], 0).astype(np.float32)
    case = dict(q=q, x=x, valid=valid, sink=sink, bias=slot_bias, scale=scale)
    sent_idx = np.where(valid, idx, EMPTY_SLOT_INDEX).astype(np.uint32)
    operands = dict(
        q=q.astype(BF16),
        kv=kv.astype(BF16),
        # [T, 128, Kp/128]: slot kc*128 + p at [t, p, kc].
        idx=np.ascontiguousarray(sent_idx.reshape(T, Kp // 128, 128).transpose(0, 2, 1)),
        bias=bias,
        sink=sink.reshape(H, 1).astype(np.float32),
        g=x.astype(BF16),
    )
    return operands, case


def run_kernels(runner, ops, target, programs=None, **options):
    """Every kernel of ``target`` on the same operands, launched on the target's logical core
    when the tokens split evenly: ``{name: (out [T*H, D], lse)}``."""
    T = ops["q"].shape[0]
    if programs is None:
        programs = PROGRAMS[target] if T % PROGRAMS[target] == 0 else 1
    calls = {
        "idx": lambda: run_kernel(
            runner, kernels.gathered_attn_idx_kernel, ops["q"], ops["kv"], ops["idx"],
            ops["bias"], ops["sink"], target=target, programs=programs, **options),
        "gathered": lambda: run_kernel(
            runner, kernels.gathered_attn_kernel, ops["q"], ops["g"], ops["bias"], ops["sink"],
            target=target, programs=programs, **options),
    }  # fmt: skip
    results = {name: calls[name]() for name in TARGET_KERNELS[target]}
    return {name: (out.reshape(-1, out.shape[-1]), lse) for name, (out, lse) in results.items()}


def assert_lse_matches(lse, expected, valid):
    """lse of the rows that have a valid slot, to 1e-6 relative (fp32 arithmetic)."""
    T, H = expected.shape
    lse = lse.reshape(T, H)
    rows = valid.any(axis=1)
    np.testing.assert_allclose(lse[rows], expected[rows], rtol=2e-6, atol=1e-6)


# (T, H, D, Kp, R): between them every kernel-level limit is exercised: one and many 128-slot
# tiles, score matmuls split at 512 slots (Kp 2048), the value accumulator split across PSUM banks
# (D 576, 1024), head dims that are not multiples of 128 (576, 100), H from 1 to 128, a cache
# smaller than K (duplicated indices), a token count the two programs of trn2 cannot split (3).
KERNEL_SHAPES = [
    pytest.param(2, 64, 128, 128, 300, id="H64-D128-K128"),
    pytest.param(2, 128, 512, 2048, 4096, id="H128-D512-K2048"),
    pytest.param(2, 16, 1024, 256, 64, id="H16-D1024-K256-dup"),
    pytest.param(3, 1, 576, 128, 1000, id="H1-D576-K128"),
    pytest.param(4, 8, 100, 256, 500, id="H8-D100-K256"),
]


@pytest.mark.parametrize("version", versions.KNOWN_VERSIONS)
def test_kernels_under_each_nki_version(version):
    """The kernels run under every supported NKI version (the default run checks them all on one
    small shape), and an older NKI rejects them for the loop it lacks, with the emulator's
    message naming it (docs/neuron-kernel.md, "NKI versions")."""
    from jax_sparse_attn.nki_emulator import NkiUnsupportedError, simulate

    rng = np.random.default_rng(7)
    ops, case = kernel_inputs(rng, 2, 16, 128, 256, 500)
    run = simulate(kernels.gathered_attn_idx_kernel, target="trn2", nki_version=version)[2]
    args = (ops["q"], ops["kv"], ops["idx"], ops["bias"], ops["sink"])
    if version not in versions.SUPPORTED_VERSIONS:
        with pytest.raises(NkiUnsupportedError, match="nl.fori_loop needs NKI >= 0.6"):
            run(*args)
        return
    out, lse = run(*args)
    expected, expected_lse = contract_model(**case, with_lse=True)
    assert_matches_contract(np.asarray(out).astype(np.float32).reshape(-1, 128),
                            expected.reshape(-1, 128))  # fmt: skip
    assert_lse_matches(np.asarray(lse, np.float64), expected_lse, case["valid"])
    assert run.last_run.nki_version == version


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("T, H, D, Kp, R", KERNEL_SHAPES)
def test_kernels_meet_the_bf16_contract(runner, target, T, H, D, Kp, R):
    rng = np.random.default_rng(T * 1000 + H + D + Kp)
    ops, case = kernel_inputs(rng, T, H, D, Kp, R)
    expected, expected_lse = contract_model(**case, with_lse=True)
    results = run_kernels(runner, ops, target)
    for out, lse in results.values():
        assert_matches_contract(out, expected.reshape(T * H, D))
        assert_lse_matches(lse, expected_lse, case["valid"])
    # The kernels of one target run the same instructions once the rows are in SBUF: same bits.
    first = next(iter(results.values()))
    for out, lse in results.values():
        np.testing.assert_array_equal(out, first[0])
        np.testing.assert_array_equal(lse, first[1])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf, 3e38])
def test_unselected_cache_rows_never_reach_the_output(target, poison):
    """NaN, inf or a huge finite value in every row that no valid slot selects (row 0 among them,
    the row an empty slot used to read) changes no output or lse bit."""
    T, H, D, Kp, R = 2, 16, 128, 256, 400

    def inputs(value):
        return kernel_inputs(np.random.default_rng(9), T, H, D, Kp, R, empty_fraction=0.5,
                             poison=value)  # fmt: skip

    clean_ops, case = inputs(0.0)
    ops, _ = inputs(poison)
    poisoned_rows = ~np.all(ops["kv"].astype(np.float32) == clean_ops["kv"].astype(np.float32), 1)
    assert poisoned_rows[0] and 0 < poisoned_rows.sum() < R
    clean = run_kernels("emulator", clean_ops, target)
    poisoned = run_kernels("emulator", ops, target)
    for name in poisoned:
        np.testing.assert_array_equal(poisoned[name][0], clean[name][0])
        np.testing.assert_array_equal(poisoned[name][1], clean[name][1])
        assert_matches_contract(poisoned[name][0], contract_model(**case).reshape(T * H, D))


@pytest.mark.parametrize("poison", [None, np.nan])
def test_dma_transposed_rows_variant_keeps_the_contract(monkeypatch, poison):
    """The variant that gathers the logits' operand by indirect dma_transpose instead of PE
    transposes (ROW_TRANSPOSES = "dma", kept for the cost comparison of docs/neuron-kernel.md):
    the same contract, and a poisoned unselected row still reaches nothing."""
    monkeypatch.setattr(kernels, "ROW_TRANSPOSES", "dma")
    T, H, D, Kp, R = 2, 8, 192, 256, 500  # D: a full and a narrower 128-column block
    ops, case = kernel_inputs(np.random.default_rng(11), T, H, D, Kp, R, empty_fraction=0.5,
                              poison=poison)  # fmt: skip
    out, lse = run_kernel("emulator", kernels.gathered_attn_idx_kernel, ops["q"], ops["kv"],
                          ops["idx"], ops["bias"], ops["sink"], target="trn2", programs=2)
    expected, expected_lse = contract_model(**case, with_lse=True)
    assert_matches_contract(out.reshape(T * H, D), expected.reshape(T * H, D))
    assert_lse_matches(lse, expected_lse, case["valid"])


def overflowing_rows(rng, rows, dim):
    """Rows whose dot products with a q of +1e19 overflow fp32 in any summation order (+-1e19,
    constant sign per row), stay finite but exceed LOGIT_LIMIT once scaled (+-1e15), or are
    ordinary: the saturation rule decides each of them (docs/contract.md)."""
    sign = np.where(rng.random((rows, 1)) < 0.5, -1.0, 1.0)
    magnitude = rng.choice([1e19, 1e15, 0.0], size=(rows, 1))
    ordinary = rng.standard_normal((rows, dim))
    return bf16(np.where(magnitude > 0, sign * magnitude, ordinary) * np.ones((rows, dim)))


@pytest.mark.parametrize("target", TARGETS)
def test_logits_that_overflow_fp32_saturate(target):
    """q . x beyond FLT_MAX gives an fp32 accumulator of +-inf, q . x * scale beyond 1e29 a logit
    that would outrank everything: both saturate (docs/contract.md), so no NaN, ties between the
    saturated slots, and the model's result."""
    rng = np.random.default_rng(11)
    T, H, D, Kp, R = 2, 8, 128, 128, 50
    ops, case = kernel_inputs(rng, T, H, D, Kp, R)
    case["q"] = bf16(np.full((T, H, D), 1e19))
    ops["q"] = case["q"].astype(BF16)
    kv = overflowing_rows(rng, R, D)
    idx = ops["idx"].transpose(0, 2, 1).reshape(T, Kp).astype(np.int64)
    valid = case["valid"]
    ops["kv"] = kv.astype(BF16)
    case["x"] = np.where(valid[:, :, None], kv[np.where(valid, idx, 0)], 0).astype(np.float32)
    ops["g"] = case["x"].astype(BF16)
    expected, expected_lse = contract_model(**case, with_lse=True)
    assert np.abs(expected).max() > 1e18  # the saturated slots carry the weight
    for out, lse in run_kernels("emulator", ops, target).values():
        assert np.isfinite(out).all() and np.isfinite(lse).all()
        assert_matches_contract(out, expected.reshape(T * H, D))
        assert_lse_matches(lse, expected_lse, case["valid"])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(
    "T, H, D, Kp, max_chunk",
    [
        pytest.param(2, 16, 256, 1024, 512, id="2chunks"),
        pytest.param(1, 8, 1152, 640, 256, id="3chunks-uneven-D1152"),
        pytest.param(1, 4, 3072, 256, 128, id="2chunks-2value-passes"),
    ],
)
def test_slots_in_chunks_keep_the_contract(target, T, H, D, Kp, max_chunk):
    """The two-pass form (logits and max per chunk, then exp and values per chunk) at small
    shapes: same arithmetic as one pass, so the model still holds to one bf16 ulp."""
    rng = np.random.default_rng(D + Kp)
    ops, case = kernel_inputs(rng, T, H, D, Kp, 3000)
    plan = kernels.plan_slots(H, D, Kp, max_chunk=max_chunk)
    assert plan.chunks > 1
    expected, expected_lse = contract_model(**case, with_lse=True)
    for out, lse in run_kernels("emulator", ops, target, max_chunk=max_chunk).values():
        assert_matches_contract(out, expected.reshape(T * H, D))
        assert_lse_matches(lse, expected_lse, case["valid"])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(
    "H, D, Kp",
    [
        pytest.param(128, 640, 8192, id="H128-D576-K8192"),
        pytest.param(1, 128, 65536, id="H1-K65536-logits-in-HBM"),
    ],
)
def test_large_shapes_run_in_chunks(target, H, D, Kp):
    """Shapes whose slots do not fit in SBUF at once: FlashMLA's K=8192 with D=576, and K=65536,
    whose fp32 logits alone exceed SBUF and wait in HBM between the passes."""
    rng = np.random.default_rng(H + Kp)
    ops, case = kernel_inputs(rng, 1, H, D, Kp, 2 * Kp)
    plan = kernels.plan_slots(H, D, Kp, indexed=target != "trn1")
    assert plan.chunks > 1
    assert plan.scores_in_sbuf == (Kp < 65536)
    expected, expected_lse = contract_model(**case, with_lse=True)
    for out, lse in run_kernels("emulator", ops, target).values():
        assert_matches_contract(out, expected.reshape(H, D))
        assert_lse_matches(lse, expected_lse, case["valid"])


@pytest.mark.parametrize("target", TARGETS)
def test_compiled_instructions_do_not_grow_with_tokens(target):
    """Tokens run in a hardware loop (nl.fori_loop): the compiled program of each core holds
    one token's instructions whatever T is, while the executed count grows with T."""
    from jax_sparse_attn.nki_emulator import simulate

    compiled, executed = [], []
    for T in (2, 4, 16):
        ops, _ = kernel_inputs(np.random.default_rng(T), T, 16, 128, 256, 300)
        kernel, rows = ((kernels.gathered_attn_kernel, ops["g"]) if target == "trn1"
                        else (kernels.gathered_attn_idx_kernel, ops["kv"]))  # fmt: skip
        args = (ops["q"], rows) + ((ops["idx"],) if target != "trn1" else ()) + (
            ops["bias"], ops["sink"])  # fmt: skip
        _, stats = simulate(kernel, target=target, stats=True)[PROGRAMS[target]](*args)
        assert stats.grid == PROGRAMS[target]
        compiled.append(stats.compiled_instructions_per_program)
        executed.append(stats.instructions)
    assert compiled[0] == compiled[1] == compiled[2]
    assert executed[2] > 6 * executed[0]


@pytest.mark.parametrize("runner", RUNNERS)
def test_kernel_sink_edge_values(runner):
    """+inf sink -> that head is 0 and its lse +inf; -inf sink -> no sink term; a finite sink
    joins the denominator only (never the max), so a very large sink shrinks the head's output
    without NaN."""
    rng = np.random.default_rng(5)
    T, H, D, Kp = 2, 4, 128, 128
    sink = np.array([np.inf, -np.inf, 0.0, 30.0], np.float32)
    ops, case = kernel_inputs(rng, T, H, D, Kp, 50, sink=sink)
    expected, expected_lse = contract_model(**case, with_lse=True)
    out, lse = run_kernels(runner, ops, "trn2")["idx"]
    out = out.reshape(T, H, D)
    np.testing.assert_array_equal(out[:, 0], 0)
    assert np.all(lse.reshape(T, H)[:, 0] == np.inf)
    assert_matches_contract(out, expected)
    finite = np.isfinite(expected_lse)
    np.testing.assert_allclose(lse.reshape(T, H)[finite], expected_lse[finite], rtol=2e-6)
    assert np.abs(out[:, 3]).max() < np.abs(out[:, 2]).max()


@pytest.mark.parametrize("runner", RUNNERS)
def test_kernel_zeroes_an_empty_row_when_a_finite_sink_overflows(runner):
    """All slots empty + finite sink: exp(sink + 1e30) = inf in the denominator, output exactly 0.
    Without a sink the kernel gives no meaningful value for such a row (the packing zeroes it)."""
    rng = np.random.default_rng(6)
    T, H, D, Kp = 2, 8, 128, 128
    ops, _ = kernel_inputs(rng, T, H, D, Kp, 40)
    ops["bias"][1, BIAS_PREFIX_COLS:] = EMPTY_LOGIT
    ops["idx"][1] = EMPTY_SLOT_INDEX
    out, _ = run_kernel(runner, kernels.gathered_attn_idx_kernel, ops["q"], ops["kv"], ops["idx"],
                        ops["bias"], ops["sink"])  # fmt: skip
    out = out.reshape(T, H, D)
    np.testing.assert_array_equal(out[1], 0)
    assert np.abs(out[0]).max() > 0


@pytest.mark.parametrize(
    "H, D, Kp, max_chunk, indexed",
    [(128, 576, 2048, None, True), (1, 128, 128, None, False), (16, 1024, 1024, 256, True),
     (64, 512, 1024, 512, False)],
)  # fmt: skip
def test_sbuf_estimate_bounds_the_emulated_peak(H, D, Kp, max_chunk, indexed):
    """The slot chunks are sized by ``kernels.sbuf_bytes_per_partition``: it must not be below
    what the kernel really keeps live (as the emulator counts it), nor far above."""
    from jax_sparse_attn.nki_emulator import simulate

    rng = np.random.default_rng(8)
    ops, _ = kernel_inputs(rng, 2, H, D, Kp, 300)
    if indexed:
        run = simulate(kernels.gathered_attn_idx_kernel, target="trn2")
        run(ops["q"], ops["kv"], ops["idx"], ops["bias"], ops["sink"], max_chunk=max_chunk)
    else:
        run = simulate(kernels.gathered_attn_kernel, target="trn1")
        run(ops["q"], ops["g"], ops["bias"], ops["sink"], max_chunk=max_chunk)
    peak = run.last_stats["sbuf_peak_bytes_per_partition"]
    plan = kernels.plan_slots(H, D, Kp, max_chunk=max_chunk, indexed=indexed)
    estimate = kernels.sbuf_bytes_per_partition(H, D, Kp, plan.chunk, plan.scores_in_sbuf,
                                                indexed=indexed)  # fmt: skip
    assert peak <= estimate <= 1.1 * peak


def test_value_product_arrangement_follows_the_matmul_cost():
    """With few heads the value product runs transposed (the rows stationary, H moving columns),
    which the nc_matmul cost formula makes cheaper; with 128 heads the plain arrangement."""
    assert all(u.transposed for u in kernels._value_units(64, 512, 2048))
    assert all(u.transposed for u in kernels._value_units(16, 576, 2048))
    assert not any(u.transposed for u in kernels._value_units(128, 512, 2048))
    # Every output column is in exactly one accumulator.
    for H, D in [(64, 576), (8, 1100), (128, 1024)]:
        columns = sorted(c for u in kernels._value_units(H, D, 256) for d0, n in u.blocks
                         for c in range(d0, d0 + n))  # fmt: skip
        assert columns == list(range(D))


def test_every_shape_gets_a_plan_that_fits_the_smallest_sbuf():
    from jax_sparse_attn.constants import SBUF_BYTES_PER_PARTITION

    for H, D, Kp in [(128, 640, 2048), (128, 640, 8192), (128, 1024, 16384), (1, 128, 1 << 17),
                     (128, 4096, 2048)]:  # fmt: skip
        plan = kernels.plan_slots(H, D, Kp)
        need = kernels.sbuf_bytes_per_partition(H, D, Kp, plan.chunk, plan.scores_in_sbuf)
        assert need <= SBUF_BYTES_PER_PARTITION
        assert plan.chunk % 128 == 0 and plan.chunks * plan.chunk >= Kp
    # DeepSeek-like decode fits in one pass.
    assert kernels.plan_slots(128, 640, 2048).chunks == 1


# --- the whole Neuron data path through the public API -------------------------------------------


@pytest.fixture(params=["trn1", "trn2"])
def target(request, monkeypatch):
    """Runs the test with ``NEURON_PLATFORM_TARGET_OVERRIDE`` naming each target in turn. The
    variant is chosen when a call is compiled, so JAX's caches are cleared around the test."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", request.param)
    jax.clear_caches()
    yield request.param
    jax.clear_caches()


def flashmla_invalid(R):
    """FlashMLA's test set of invalid indices for a cache of R rows (docs/contract.md)."""
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


def idx_model(q, kv, idx, sink, bias, scale, **options):
    R = kv.shape[0]
    valid = (idx >= 0) & (idx < R) & (bias != -np.inf)
    x = kv[np.where(valid, idx, 0)]
    T = q.shape[0]
    scales = np.full(T, scale, np.float32)
    return contract_model(q, x, valid, sink, np.where(valid, bias, 0), scales, **options)


def gathered_model(q, g, sink, bias, scale, **options):
    valid = bias != -np.inf
    T = q.shape[0]
    scales = np.full(T, scale, np.float32)
    return contract_model(q, g, valid, sink, np.where(valid, bias, 0), scales, **options)


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
def test_emulated_path_jit_idx(target, T, H, D, K, R):
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
    [
        pytest.param(3, 200, 64, 1, id="H200-D64-K1"),
        pytest.param(2, 64, 576, 100, id="H64-D576-K100"),
    ],
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


POISONS = [pytest.param(np.nan, id="nan"), pytest.param(np.inf, id="inf"),
           pytest.param(3e38, id="3e38")]  # fmt: skip


def poisoned_idx_case(rng, poison, T=3, H=8, D=64, K=100, R=60):
    """An indexed call whose every unselected cache row holds ``poison``: rows no index selects,
    row 0 (which only masked slots and invalid indices point at), rows that only slots masked by
    a ``-inf`` bias select; K=100 pads to 128 slots. Returns the inputs and the same cache with
    those rows set to zero."""
    q, kv, idx, bias, sink = api_inputs(rng, T, H, D, K, R)
    idx = np.where((idx == 0) | (idx == R - 1), 1, idx)  # rows 0 and R - 1: never selected
    bias[:, :10] = -np.inf
    idx[:, :10] = 0  # masked slots point at row 0 ...
    idx[0, 10:20] = R - 1  # ... and at a row that a masked slot selects, for token 0 only
    bias[0, 10:20] = -np.inf
    valid = (idx >= 0) & (idx < R) & (bias != -np.inf)
    unselected = np.ones(R, bool)
    unselected[idx[valid]] = False
    assert unselected[0] and unselected[R - 1]
    clean = kv.copy()
    clean[unselected] = 0
    kv = kv.copy()
    kv[unselected] = poison
    return q, kv, clean, idx, bias, sink


@pytest.mark.parametrize("poison", POISONS)
def test_emulated_path_never_reads_an_unselected_row(target, poison):
    """docs/contract.md: a row that no valid slot selects never influences an output bit, whatever
    it holds; on every target (in-kernel gather with oob skip, and XLA gather for trn1)."""
    q, kv, clean, idx, bias, sink = poisoned_idx_case(np.random.default_rng(60), poison)

    def attend(kv):
        out = jsa.gathered_attn_idx(as_bf16(q), as_bf16(kv), idx, sink, bias=bias,
                                    implementation="nki_emulated")  # fmt: skip
        return np.asarray(out, np.float32)

    out = attend(kv)
    np.testing.assert_array_equal(out, attend(clean))
    assert_matches_contract(out, idx_model(q, clean, idx, sink, bias, q.shape[2] ** -0.5))


@pytest.mark.parametrize("poison", POISONS)
def test_emulated_gathered_path_never_reads_a_masked_row(target, poison):
    """The pre-gathered op: rows of slots masked by a ``-inf`` bias hold ``poison``."""
    rng = np.random.default_rng(61)
    T, H, D, K = 2, 8, 64, 100
    q = bf16(rng.standard_normal((T, H, D)))
    g = bf16(rng.standard_normal((T, K, D)))
    bias = rng.normal(0, 0.5, (T, K)).astype(np.float32)
    bias[:, ::3] = -np.inf
    clean = np.where(np.isneginf(bias)[:, :, None], 0, g)
    poisoned = np.where(np.isneginf(bias)[:, :, None], poison, g)
    sink = rng.normal(0, 1, H).astype(np.float32)

    def attend(g):
        out = jsa.gathered_attn(as_bf16(q), as_bf16(g), sink, bias=bias,
                                implementation="nki_emulated")  # fmt: skip
        return np.asarray(out, np.float32)

    out = attend(poisoned)
    np.testing.assert_array_equal(out, attend(clean))
    assert_matches_contract(out, gathered_model(q, clean, sink, bias, D**-0.5))


@pytest.mark.parametrize("poison", POISONS[:1])
def test_emulated_path_gradient_ignores_unselected_rows(poison):
    """The gradients through nki_emulated (the backward is jnp) with poisoned unselected rows: the
    same bits as with zeros there, for q, the sink and every selected row."""
    q, kv, clean, idx, bias, sink = poisoned_idx_case(np.random.default_rng(62), poison)
    rng = np.random.default_rng(63)
    target_out = rng.standard_normal(q.shape).astype(np.float32)

    def loss(q, kv, sink):
        out = jsa.gathered_attn_idx(q, kv, idx, sink, bias=bias, implementation="nki_emulated")
        return jnp.sum(out.astype(jnp.float32) * target_out)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))  # one compile for both caches
    grads = lambda kv: grad(as_bf16(q), as_bf16(kv), jnp.asarray(sink))  # noqa: E731

    dq, dkv, dsink = grads(kv)
    dq0, dkv0, dsink0 = grads(clean)
    np.testing.assert_array_equal(np.asarray(dq, np.float32), np.asarray(dq0, np.float32))
    np.testing.assert_array_equal(np.asarray(dsink), np.asarray(dsink0))
    selected = np.zeros(kv.shape[0], bool)
    selected[np.unique(idx[(idx >= 0) & (idx < kv.shape[0]) & (bias != -np.inf)])] = True
    np.testing.assert_array_equal(np.asarray(dkv, np.float32)[selected],
                                  np.asarray(dkv0, np.float32)[selected])  # fmt: skip


def test_emulated_path_saturates_logits_that_overflow(target):
    """Finite bf16 q of 1e19 against rows of +-1e19, +-1e15 and ordinary values: dot products
    beyond FLT_MAX and scaled logits beyond 1e29. No NaN, and the model's result."""
    rng = np.random.default_rng(64)
    T, H, D, K, R = 2, 4, 64, 20, 30
    q = bf16(np.full((T, H, D), 1e19))
    kv = overflowing_rows(rng, R, D)
    idx = rng.integers(0, R, (T, K))
    sink = np.zeros(H, np.float32)
    out = jsa.gathered_attn_idx(as_bf16(q), as_bf16(kv), idx, sink, implementation="nki_emulated")
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    zeros = np.zeros((T, K), np.float32)
    assert_matches_contract(out, idx_model(q, kv, idx, sink, zeros, D**-0.5))


@pytest.mark.slow
def test_emulated_lse_functions(target):
    """The ``*_lse`` functions of the Neuron data path (for ``return_lse``): lse [T, H] f32 =
    max + log(den) to 1e-6 relative, the sink for a row with no valid slot (-inf without one)."""
    from jax_sparse_attn.attention import neuron

    rng = np.random.default_rng(65)
    T, H, D, K, R = 4, 6, 64, 40, 50
    q, kv, idx, bias, sink = api_inputs(rng, T, H, D, K, R)
    idx[2] = -1  # no valid slot
    scale = np.full(T, 0.15, np.float32)
    for with_sink in (True, False):
        s = sink if with_sink else np.full(H, -np.inf, np.float32)
        out, lse = jax.jit(neuron.emulated_gathered_attn_idx_lse)(
            as_bf16(q), as_bf16(kv), jnp.asarray(idx, jnp.int32), jnp.asarray(s),
            jnp.asarray(bias), jnp.asarray(scale))  # fmt: skip
        expected, expected_lse = idx_model(q, kv, idx, s, bias, 0.15, with_lse=True)
        assert lse.shape == (T, H) and lse.dtype == jnp.float32
        assert_matches_contract(np.asarray(out, np.float32), expected)
        lse = np.asarray(lse, np.float64)
        np.testing.assert_array_equal(lse[2], s)
        np.testing.assert_allclose(lse, expected_lse, rtol=2e-6)
        x = kv[np.clip(idx, 0, R - 1)]
        g_out, g_lse = neuron.emulated_gathered_attn_lse(
            as_bf16(q), as_bf16(x), jnp.asarray(s),
            jnp.asarray(np.where((idx >= 0) & (idx < R), bias, -np.inf)), jnp.asarray(scale))  # fmt: skip
        np.testing.assert_array_equal(np.asarray(g_lse, np.float64), lse)
        np.testing.assert_array_equal(np.asarray(g_out, np.float32), np.asarray(out, np.float32))


def test_emulated_path_h200_k4096_d576(target):
    """H=200 (two kernel calls of 100 heads) with K=4096 and D=576 through the whole data path."""
    rng = np.random.default_rng(66)
    T, H, D, K, R = 1, 200, 576, 4096, 10000
    q, kv, idx, bias, sink = api_inputs(rng, T, H, D, K, R)
    out = jsa.gathered_attn_idx(as_bf16(q), as_bf16(kv), idx, sink, bias=bias,
                                implementation="nki_emulated")  # fmt: skip
    assert_matches_contract(np.asarray(out, np.float32), idx_model(q, kv, idx, sink, bias, D**-0.5))


# --- the FP8 kernel (trn2, trn3): FP8 rows gathered and dequantised on chip -----------------------

FP8_DTYPES = [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]


def fp8_kernel_inputs(rng, T, H, D, Kp, R, fp8, groups, poison=None):
    """Operands of ``gathered_attn_idx_fp8_kernel`` and the case of the bf16 contract model on
    ``kv_dequant = bf16(kv.astype(f32) * scale)``, computed here plainly in numpy. ``groups``
    scales per row (1: per-row), sent per slot as the interface says (0 for an empty slot).
    ``poison``: written into the FP8 rows of every row no valid slot selects (and of row 0)."""
    ops, case = kernel_inputs(rng, T, H, D, Kp, R)
    kv = (rng.standard_normal((R, D)) * 40).astype(fp8)
    scale = rng.uniform(2.0**-9, 2.0**-4, (R, groups)).astype(np.float32)
    full_scale = np.repeat(scale, D // groups, axis=1)
    kv_dequant = bf16(kv.astype(np.float32) * full_scale)
    sent = ops["idx"].transpose(0, 2, 1).reshape(T, Kp)  # back to [T, Kp]
    valid = case["valid"]
    rows = np.where(valid, sent, 0).astype(np.int64)
    if poison is not None:
        unused = np.ones(R, bool)
        unused[rows[valid]] = False
        unused[0] = not np.any(rows[valid] == 0)
        kv[unused] = poison
    x = np.where(valid[:, :, None], kv_dequant[rows], 0).astype(np.float32)
    case = dict(case, x=x)
    slot_scale = np.where(valid[:, :, None], scale[rows], 0).astype(np.float32)  # [T, Kp, n]
    # [T, 128, Kp/128 * n]: slot kc*128 + p's group g at [t, p, kc*n + g].
    slot_scale = slot_scale.reshape(T, Kp // 128, 128, groups).transpose(0, 2, 1, 3)
    ops = dict(ops, kv=kv, slot_scale=np.ascontiguousarray(slot_scale.reshape(T, 128, -1)),
               kv_dequant=kv_dequant.astype(BF16))  # fmt: skip
    return ops, case


def run_fp8_kernel(ops, target="trn2", **options):
    return run_kernel("emulator", kernels.gathered_attn_idx_fp8_kernel, ops["q"], ops["kv"],
                      ops["slot_scale"], ops["idx"], ops["bias"], ops["sink"], target=target,
                      programs=PROGRAMS[target], **options)  # fmt: skip


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize(
    "T, H, D, Kp, R, groups, max_chunk",
    [
        pytest.param(2, 64, 128, 256, 300, 1, None, id="per-row"),
        pytest.param(2, 16, 576, 384, 500, 576 // 64, None, id="groups-of-64-D576"),
        pytest.param(2, 8, 256, 512, 200, 2, 128, id="groups-of-128-chunked"),
    ],
)
def test_fp8_kernel_meets_the_contract_on_the_dequantised_cache(T, H, D, Kp, R, groups, max_chunk, fp8):
    rng = np.random.default_rng(T + H + D + Kp + groups)
    ops, case = fp8_kernel_inputs(rng, T, H, D, Kp, R, fp8, groups)
    expected, expected_lse = contract_model(**case, with_lse=True)
    options = {} if max_chunk is None else {"max_chunk": max_chunk}
    out, lse = run_fp8_kernel(ops, **options)
    assert_matches_contract(out.reshape(T * H, D), expected.reshape(T * H, D))
    assert_lse_matches(lse, expected_lse, case["valid"])
    # Once dequantised, the rows run the bf16 kernel's instructions: the same bits as that
    # kernel on kv_dequant.
    bf16_out, bf16_lse = run_kernel("emulator", kernels.gathered_attn_idx_kernel, ops["q"],
                                    ops["kv_dequant"], ops["idx"], ops["bias"], ops["sink"],
                                    programs=2, **options)  # fmt: skip
    np.testing.assert_array_equal(out, bf16_out)
    np.testing.assert_array_equal(lse, bf16_lse)


@pytest.mark.parametrize("poison", [np.nan, np.inf, 3e38])
def test_fp8_kernel_never_reads_an_unselected_row(poison):
    T, H, D, Kp, R = 2, 16, 128, 256, 400
    clean_ops, case = fp8_kernel_inputs(np.random.default_rng(5), T, H, D, Kp, R,
                                        ml_dtypes.float8_e5m2, 2)  # fmt: skip
    ops, _ = fp8_kernel_inputs(np.random.default_rng(5), T, H, D, Kp, R, ml_dtypes.float8_e5m2, 2,
                               poison=poison)  # fmt: skip
    assert not np.isfinite(ops["kv"].astype(np.float32)).all() or poison == 3e38
    clean, poisoned = run_fp8_kernel(clean_ops), run_fp8_kernel(ops)
    np.testing.assert_array_equal(poisoned[0], clean[0])
    np.testing.assert_array_equal(poisoned[1], clean[1])
    assert_matches_contract(poisoned[0].reshape(T * H, D), contract_model(**case).reshape(T * H, D))


def test_fp8_kernel_reads_half_the_row_bytes():
    """The HBM bytes of the gathered rows in the cost model: one byte per element instead of two
    (plus the token's f32 scales, one DMA per token)."""
    from jax_sparse_attn.nki_emulator import simulate

    T, H, D, Kp, R = 2, 16, 512, 512, 1000
    ops, _ = fp8_kernel_inputs(np.random.default_rng(3), T, H, D, Kp, R, ml_dtypes.float8_e4m3fn, 1)
    fp8_run = simulate(kernels.gathered_attn_idx_fp8_kernel, target="trn2", cost=True)[2]
    fp8_run(ops["q"], ops["kv"], ops["slot_scale"], ops["idx"], ops["bias"], ops["sink"])
    bf16_run = simulate(kernels.gathered_attn_idx_kernel, target="trn2", cost=True)[2]
    bf16_run(ops["q"], ops["kv_dequant"], ops["idx"], ops["bias"], ops["sink"])
    fp8_bytes = sum(p.cost.hbm_bytes for p in fp8_run.last_run.programs)
    bf16_bytes = sum(p.cost.hbm_bytes for p in bf16_run.last_run.programs)
    rows = int(np.sum(ops["idx"] != EMPTY_SLOT_INDEX))  # gathered rows; empty slots move nothing
    # The bf16 kernel reads 2*D bytes per gathered row, the FP8 kernel D; and T*Kp f32 scales.
    assert bf16_bytes - fp8_bytes == rows * D - T * Kp * 4


def fp8_api_case(rng, T, H, D, K, R, fp8, groups):
    q, _, idx, bias, sink = api_inputs(rng, T, H, D, K, R)
    kv = (rng.standard_normal((R, D)) * 40).astype(fp8)
    kv_scale = rng.uniform(2.0**-9, 2.0**-4, (R, groups)).astype(np.float32)
    if groups == 1:  # a per-row scale in its [R] form
        kv_scale = kv_scale[:, 0]
    kv_dequant = bf16(kv.astype(np.float32) * np.repeat(kv_scale.reshape(R, -1), D // groups, 1))
    return q, kv, kv_scale, kv_dequant, idx, bias, sink


def emulated_fp8_call(q, kv, kv_scale, idx, bias, sink, scale=0.1):
    fn = jax.jit(lambda q, kv, s, idx, sink, bias: jsa.gathered_attn_idx(
        q, kv, idx, sink, bias=bias, scale=scale, kv_scale=s, implementation="nki_emulated",
        return_lse=True))  # fmt: skip
    return fn(as_bf16(q), jnp.asarray(kv), jnp.asarray(kv_scale), jnp.asarray(idx),
              jnp.asarray(sink), jnp.asarray(bias))  # fmt: skip


@pytest.mark.parametrize("fp8, groups", [(ml_dtypes.float8_e4m3fn, 1), (ml_dtypes.float8_e5m2, 4)],
                         ids=["e4m3fn-per-row", "e5m2-groups-of-128"])  # fmt: skip
def test_emulated_fp8_path_reads_fp8_rows_on_trn2(target, fp8, groups):
    """nki_emulated on an FP8 cache: the op on kv_dequant (docs/contract.md model), every edge
    rule kept; on trn2 the kernel itself reads the FP8 rows (half the row bytes of the same call
    on the bf16 kv_dequant), on trn1 XLA dequantises the slots first (the same bytes as bf16)."""
    from jax_sparse_attn import nki_emulator

    T, H, D, K, R = 3, 16, 512, 200, 300
    q, kv, kv_scale, kv_dequant, idx, bias, sink = fp8_api_case(
        np.random.default_rng(70 + groups), T, H, D, K, R, fp8, groups)  # fmt: skip
    bias[0, :2] = -np.inf
    with nki_emulator.recording(cost=True) as rec:
        out, lse = emulated_fp8_call(q, kv, kv_scale, idx, bias, sink)
    expected, expected_lse = idx_model(q, kv_dequant, idx, sink, bias, 0.1, with_lse=True)
    assert_matches_contract(np.asarray(out, np.float32), expected)
    rows = ((idx >= 0) & (idx < R) & (bias != -np.inf)).any(axis=1)
    np.testing.assert_allclose(np.asarray(lse)[rows], expected_lse[rows], rtol=2e-6, atol=1e-6)
    with nki_emulator.recording(cost=True) as rec_bf16:
        bf16_out = jsa.gathered_attn_idx(as_bf16(q), as_bf16(kv_dequant), jnp.asarray(idx),
                                         jnp.asarray(sink), bias=jnp.asarray(bias), scale=0.1,
                                         implementation="nki_emulated")  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(bf16_out, np.float32))

    def dma_bytes(r):
        return sum(p.cost.hbm_bytes for run in r.runs for p in run.programs)

    gathered = int(np.sum((idx >= 0) & (idx < R) & (bias != -np.inf)))
    if target == "trn2":  # HBM: D bytes per gathered row instead of 2 * D, plus the slots' scales
        Kp, Tp = -(-K // 128) * 128, -(-T // 2) * 2  # tokens padded to the 2 programs
        assert dma_bytes(rec_bf16) - dma_bytes(rec) == gathered * D - Tp * Kp * 4 * groups
    else:
        assert dma_bytes(rec_bf16) == dma_bytes(rec)


def test_emulated_fp8_path_never_reads_an_unselected_row_or_scale(target):
    T, H, D, K, R = 2, 8, 256, 150, 400
    q, kv, kv_scale, _, idx, bias, sink = fp8_api_case(np.random.default_rng(80), T, H, D, K, R,
                                                       ml_dtypes.float8_e5m2, 2)  # fmt: skip
    selected = np.zeros(R, bool)
    selected[idx[(idx >= 0) & (idx < R)]] = True
    poisoned_kv, poisoned_scale = kv.copy(), kv_scale.copy()
    poisoned_kv[~selected] = np.nan
    poisoned_scale[~selected] = np.inf
    clean = emulated_fp8_call(q, kv, kv_scale, idx, bias, sink)
    poisoned = emulated_fp8_call(q, poisoned_kv, poisoned_scale, idx, bias, sink)
    for a, b in zip(clean, poisoned):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.slow  # several seconds: CI runs it with the slow tests
def test_emulated_fp8_path_gradient_and_vmap():
    """Gradients of q and the sink through the FP8 kernel path equal those of the op on
    kv_dequant; vmap over sequences with their own caches runs the kernel per sequence."""
    T, H, D, K, R = 2, 8, 128, 64, 100
    q, kv, kv_scale, kv_dequant, idx, bias, sink = fp8_api_case(
        np.random.default_rng(90), T, H, D, K, R, ml_dtypes.float8_e4m3fn, 1)  # fmt: skip
    w = np.random.default_rng(91).standard_normal(q.shape).astype(np.float32)

    def loss(q, sink, kv, kv_scale, implementation):
        out = jsa.gathered_attn_idx(q, kv, idx, sink, bias=bias, kv_scale=kv_scale,
                                    implementation=implementation)  # fmt: skip
        return jnp.sum(out.astype(jnp.float32) * w)

    dq, dsink = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=4)(
        as_bf16(q), jnp.asarray(sink), jnp.asarray(kv), jnp.asarray(kv_scale), "nki_emulated")
    dq0, dsink0 = jax.jit(jax.grad(lambda q, s: jnp.sum(jsa.gathered_attn_idx(
        q, as_bf16(kv_dequant), idx, s, bias=bias, implementation="reference").astype(jnp.float32) * w),
        argnums=(0, 1)))(as_bf16(q), jnp.asarray(sink))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(dq, np.float32), np.asarray(dq0, np.float32))
    np.testing.assert_array_equal(np.asarray(dsink), np.asarray(dsink0))

    batched = jax.vmap(lambda q, kv, s: jsa.gathered_attn_idx(
        q, kv, idx, sink, bias=bias, kv_scale=s, implementation="nki_emulated"))(
        jnp.stack([as_bf16(q)] * 2), jnp.stack([jnp.asarray(kv), jnp.asarray(kv)[::-1]]),
        jnp.stack([jnp.asarray(kv_scale), jnp.asarray(kv_scale)[::-1]]))  # fmt: skip
    single = jsa.gathered_attn_idx(as_bf16(q), jnp.asarray(kv)[::-1], idx, sink, bias=bias,
                                   kv_scale=jnp.asarray(kv_scale)[::-1],
                                   implementation="nki_emulated")  # fmt: skip
    np.testing.assert_array_equal(np.asarray(batched[1], np.float32), np.asarray(single, np.float32))
    assert_matches_contract(np.asarray(batched[0], np.float32),
                            idx_model(q, kv_dequant, idx, sink, bias, D**-0.5))  # fmt: skip


@pytest.mark.parametrize("H, D, Kp, groups, max_chunk",
                         [(128, 576, 2048, 1, None), (16, 1024, 1024, 8, 256)])  # fmt: skip
def test_sbuf_estimate_bounds_the_fp8_kernels_peak(H, D, Kp, groups, max_chunk):
    """The FP8 kernel's extra tiles (raw rows, zero tile, the token's scales) are in the estimate."""
    from jax_sparse_attn.nki_emulator import simulate

    ops, _ = fp8_kernel_inputs(np.random.default_rng(8), 2, H, D, Kp, 300, ml_dtypes.float8_e5m2,
                               groups)  # fmt: skip
    run = simulate(kernels.gathered_attn_idx_fp8_kernel, target="trn2")
    run(ops["q"], ops["kv"], ops["slot_scale"], ops["idx"], ops["bias"], ops["sink"],
        max_chunk=max_chunk)  # fmt: skip
    peak = run.last_stats["sbuf_peak_bytes_per_partition"]
    plan = kernels.plan_slots(H, D, Kp, max_chunk=max_chunk, fp8_scale_groups=groups)
    estimate = kernels.sbuf_bytes_per_partition(H, D, Kp, plan.chunk, plan.scores_in_sbuf,
                                                fp8_scale_groups=groups)  # fmt: skip
    assert peak <= estimate <= 1.1 * peak


def test_fp8_kernel_compiled_instructions_do_not_grow_with_tokens():
    """The FP8 kernel keeps the hardware token loop: its zero tile is set once per program, the
    token's scales and rows are fetched inside the loop body."""
    from jax_sparse_attn.nki_emulator import simulate

    compiled, executed = [], []
    for T in (2, 4, 16):
        ops, _ = fp8_kernel_inputs(np.random.default_rng(T), T, 16, 128, 256, 300,
                                   ml_dtypes.float8_e4m3fn, 1)  # fmt: skip
        _, stats = simulate(kernels.gathered_attn_idx_fp8_kernel, target="trn2", stats=True)[2](
            ops["q"], ops["kv"], ops["slot_scale"], ops["idx"], ops["bias"], ops["sink"])
        compiled.append(stats.compiled_instructions_per_program)
        executed.append(stats.instructions)
    assert compiled[0] == compiled[1] == compiled[2]
    assert executed[2] > 6 * executed[0]
