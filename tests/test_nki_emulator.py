"""The NKI emulator: each instruction against plain numpy, each rejection rule, and simulate().

Oracles are float64 numpy written out here; bf16 rounding is checked against a bit-level
round-to-nearest-even written here too, not against ml_dtypes.
"""

from __future__ import annotations

import types

import ml_dtypes
import numpy as np
import pytest

from jax_sparse_attn import nki_emulator
from jax_sparse_attn.nki_emulator import isa as nisa
from jax_sparse_attn.nki_emulator import language as nl
from jax_sparse_attn.nki_emulator import simulate, versions
from jax_sparse_attn.nki_emulator.errors import (
    NkiCapacityError,
    NkiDtypeError,
    NkiEmulatorError,
    NkiLimitError,
    NkiMemorySpaceError,
    NkiOutOfBoundsError,
    NkiShapeError,
    NkiUninitializedReadError,
    NkiUnsupportedError,
)
from jax_sparse_attn.nki_emulator.versions import NkiDeprecationWarning

# The emulator's own rules: no JAX program runs (CI runs these with one JAX, the newest).
pytestmark = pytest.mark.jax_free

BF16 = ml_dtypes.bfloat16
F32_TOL = dict(rtol=2e-6, atol=1e-6)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def bf16_rne(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bf16 (ties to even), returned as float64, by bit arithmetic."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32).astype(np.float64)


def as64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def copy_out(tile):
    """Kernel helper: a shared-HBM output holding the on-chip ``tile`` (via SBUF)."""
    out = nl.ndarray(tile.shape, tile.dtype, buffer=nl.shared_hbm)
    if tile.buffer is nl.psum:
        staged = nl.ndarray(tile.shape, tile.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=staged, src=tile)
        tile = staged
    nl.store(out, value=tile)
    return out


# ------------------------------------------------------------------------------------------------
# simulate and binding


def test_simulate_binds_nki_names_over_guarded_imports():
    # A kernel module whose `import nki` failed: its globals hold None for all three names, and the
    # kernel calls a helper of the same module.
    module = types.ModuleType("guarded_kernel_module")
    exec(
        "nki = nl = nisa = None\n"
        "def _double(tile):\n"
        "    return nl.add(tile, tile)\n"
        "def kernel(x):\n"
        "    out = nki.language.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)\n"
        "    nl.store(out, value=_double(nl.load(x)))\n"
        "    return out\n",
        module.__dict__,
    )
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(simulate(module.kernel)(x), 2 * x)
    assert module.nl is None  # the module itself is left alone


def test_simulate_unwraps_kernel_objects_and_returns_tuples():
    class Jitted:  # what a decorator such as nki.jit may return
        def __init__(self, func):
            self.func = func

    def two_outputs(x):
        a = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        b = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.shared_hbm)
        t = nl.load(x)
        nl.store(a, value=t)
        nl.store(b, value=t)
        return a, b

    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    a, b = simulate(Jitted(two_outputs))(x)
    assert a.dtype == np.float32 and b.dtype == BF16
    np.testing.assert_array_equal(a, x)
    np.testing.assert_array_equal(as64(b), bf16_rne(x))


def test_jit_is_a_passthrough_decorator():
    def f(x):
        return x

    assert nki_emulator.jit(f) is f
    assert nki_emulator.jit(mode="simulation")(f) is f


def test_kernel_inputs_are_copies_and_host_arrays_untouched():
    def kernel(x):
        t = nl.load(x)
        nl.store(x, value=nl.negative(t))  # writes the HBM copy of the argument
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=nl.load(x))
        return out

    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(simulate(kernel)(x), -x)
    np.testing.assert_array_equal(x, np.ones((2, 3)))


def test_calls_outside_simulate_are_rejected():
    with pytest.raises(NkiEmulatorError, match="outside a simulated kernel"):
        nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)


def test_float64_inputs_are_rejected():
    def kernel(x):
        return x

    with pytest.raises(NkiDtypeError, match="unsupported dtype"):
        simulate(kernel)(np.zeros((2, 2)))


def test_unknown_target_is_rejected():
    with pytest.raises(ValueError, match="trn1"):
        simulate(lambda x: x, target="trn9")


# ------------------------------------------------------------------------------------------------
# data movement


def test_load_store_round_bf16_to_nearest_even(rng):
    # Values exactly halfway between two bf16 numbers, plus random ones.
    halfway = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(2 + 2**-7), 3 * 2**-8], np.float32)
    x = np.concatenate([halfway, rng.standard_normal(124).astype(np.float32)]).reshape(4, 32)

    def kernel(x):
        out = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.shared_hbm)
        nl.store(out, value=nl.load(x))
        return out

    got = as64(simulate(kernel)(x))
    np.testing.assert_array_equal(got, bf16_rne(x))
    assert list(got.reshape(-1)[:4]) == [1.0, 1 + 2**-6, -2.0, 3 * 2**-8]


def test_load_with_dtype_and_copy_cast(rng):
    x = rng.standard_normal((8, 16)).astype(np.float32)

    def kernel(x):
        t = nl.load(x, dtype=nl.bfloat16)
        return copy_out(nl.copy(t, dtype=nl.float32))

    np.testing.assert_array_equal(as64(simulate(kernel)(x)), bf16_rne(x))


def test_broadcast_to_partition_and_free_axes(rng):
    row = rng.standard_normal((1, 6)).astype(np.float32)
    col = rng.standard_normal((5, 1)).astype(np.float32)

    def kernel(row, col):
        a = nl.broadcast_to(nl.load(row), shape=(5, 6))
        b = nl.broadcast_to(nl.load(col), shape=(5, 6))
        return copy_out(a), copy_out(b)

    a, b = simulate(kernel)(row, col)
    np.testing.assert_array_equal(a, np.repeat(row, 5, axis=0))
    np.testing.assert_array_equal(b, np.repeat(col, 6, axis=1))


def test_views_write_through_to_their_allocation(rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)

    def kernel(x):
        tile = nl.ndarray((4, 2, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile[:, 1, :], src=x)
        nisa.dma_copy(dst=tile[:, 0, 0:4], src=x[:, 4:8])
        nisa.dma_copy(dst=tile[:, 0, 4:8], src=x[:, 0:4])
        out = nl.ndarray((4, 16), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[:, 0:8], src=tile[:, 0, :])
        nisa.dma_copy(dst=out[:, 8:16], src=tile[:, 1, :])
        return out

    got = simulate(kernel)(x)
    np.testing.assert_array_equal(got, np.concatenate([x[:, 4:], x[:, :4], x], axis=1))


def test_dma_copy_converts_dtype(rng):
    x = rng.standard_normal((8, 8)).astype(np.float32)

    def kernel(x):
        tile = nl.ndarray((8, 8), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x)
        out = nl.ndarray((8, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=tile)
        return out

    np.testing.assert_array_equal(as64(simulate(kernel)(x)), bf16_rne(x))


@pytest.mark.parametrize("removed", [{"dst_rmw_op": nl.add}, {"unique_indices": True}])
def test_reject_dma_copy_arguments_removed_in_nki_0_3(removed):
    def kernel(x):
        tile = nl.ndarray((8, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x, **removed)

    _reject(kernel, np.zeros((8, 8), np.float32), error=NkiUnsupportedError,
            match=f"{next(iter(removed))} was removed in NKI 0.3")  # fmt: skip


def test_dma_copy_direct_access_pattern(rng):
    # Partition p reads idx[t, first + p]: an [N, 1] column out of a row-major [T, K] tensor.
    idx = rng.integers(0, 100, (3, 40)).astype(np.int32)

    def kernel(idx):
        col = nl.ndarray((16, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=col, src=idx.ap(pattern=[[1, 16], [1, 1]], offset=1 * 40 + 8))
        # Every other element of row 2, as one partition.
        strided = nl.ndarray((1, 20), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=strided, src=idx.ap(pattern=[[40, 1], [2, 20]], offset=80))
        return copy_out(col), copy_out(strided)

    col, strided = simulate(kernel)(idx)
    np.testing.assert_array_equal(col[:, 0], idx[1, 8:24])
    np.testing.assert_array_equal(strided[0], idx[2, ::2])


def test_dma_copy_indirect_row_gather(rng):
    kv = rng.standard_normal((50, 24)).astype(BF16)
    idx = np.array([3, 49, 0, 3, 17, 3, 22, 8], np.int32)  # duplicates gather twice

    def kernel(kv, idx):
        rows = nl.ndarray((8, 2, 24), nl.bfloat16, buffer=nl.sbuf)
        index = nl.load(idx.reshape(8, 1))
        nisa.dma_copy(
            dst=rows[:, 1, :],
            src=kv.ap(pattern=[[24, 8], [1, 24]], offset=0, vector_offset=index, indirect_dim=0),
        )
        out = nl.ndarray((8, 24), nl.bfloat16, buffer=nl.shared_hbm)
        nl.store(out, value=nl.copy(rows[:, 1, :]))
        return out

    np.testing.assert_array_equal(simulate(kernel)(kv, idx), kv[idx])


def test_gather_with_oob_skip_leaves_bad_rows_untouched(rng):
    kv = rng.standard_normal((10, 4)).astype(np.float32)
    idx = np.array([[2], [10], [-1], [9]], np.int32)

    def kernel(kv, idx):
        rows = nl.zeros((4, 4), nl.float32)
        nisa.dma_copy(
            dst=rows,
            src=kv.ap(pattern=[[4, 4], [1, 4]], vector_offset=nl.load(idx)),
            oob_mode=nisa.oob_mode.skip,
        )
        return copy_out(rows)

    got = simulate(kernel)(kv, idx)
    np.testing.assert_array_equal(got, np.stack([kv[2], np.zeros(4), np.zeros(4), kv[9]]))


def test_dma_transpose_into_aligned_view(rng):
    x = rng.standard_normal((16, 128)).astype(BF16)

    def kernel(x):
        q_t = nl.ndarray((128, 2, 32), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_transpose(dst=q_t[:, 1, 16:32], src=x)  # starts 96 bytes into each partition
        out = nl.ndarray((128, 16), nl.bfloat16, buffer=nl.shared_hbm)
        nl.store(out, value=nl.copy(q_t[:, 1, 16:32]))
        return out

    np.testing.assert_array_equal(simulate(kernel)(x), x.T)


def test_tensor_copy_through_psum_with_casts(rng):
    x = rng.standard_normal((32, 64)).astype(np.float32)

    def kernel(x):
        p = nl.ndarray((32, 64), nl.bfloat16, buffer=nl.psum)
        nisa.tensor_copy(dst=p, src=nl.load(x))
        back = nl.ndarray((32, 64), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=back, src=p)
        return copy_out(back)

    np.testing.assert_array_equal(as64(simulate(kernel)(x)), bf16_rne(x))


# ------------------------------------------------------------------------------------------------
# Tensor Engine


def test_nc_matmul_contracts_partitions_and_accumulate_semantics(rng):
    a1 = rng.standard_normal((128, 96)).astype(BF16)
    b1 = rng.standard_normal((128, 512)).astype(BF16)
    a2 = rng.standard_normal((64, 96)).astype(BF16)
    b2 = rng.standard_normal((64, 512)).astype(BF16)

    def kernel(a1, b1, a2, b2):
        acc = nl.ndarray((96, 512), nl.float32, buffer=nl.psum)
        ta1, tb1, ta2, tb2 = nl.load(a1), nl.load(b1), nl.load(a2), nl.load(b2)
        nisa.nc_matmul(acc, ta2, tb2, accumulate=False)  # overwritten below
        first = copy_out(acc)
        nisa.nc_matmul(acc, ta1, tb1, accumulate=False)
        nisa.nc_matmul(acc, ta2, tb2, accumulate=True)
        return first, copy_out(acc)

    first, total = simulate(kernel)(a1, b1, a2, b2)
    expect_first = as64(a2).T @ as64(b2)
    expect_total = as64(a1).T @ as64(b1) + expect_first
    np.testing.assert_allclose(first, expect_first, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(total, expect_total, rtol=1e-5, atol=1e-4)


def test_nc_transpose(rng):
    x = rng.standard_normal((128, 48)).astype(BF16)

    def kernel(x):
        t = nl.ndarray((48, 128), nl.bfloat16, buffer=nl.psum)
        nisa.nc_transpose(dst=t, data=nl.load(x))
        return copy_out(t)

    np.testing.assert_array_equal(simulate(kernel)(x), x.T)


# ------------------------------------------------------------------------------------------------
# Scalar and Vector Engines


def test_activation_scale_bias_and_add_reduction(rng):
    x = rng.standard_normal((16, 40)).astype(np.float32)
    bias = rng.standard_normal((16, 1)).astype(np.float32)
    scale = rng.uniform(0.5, 2, (16, 1)).astype(np.float32)

    def kernel(x, bias, scale):
        xt, bt, st = nl.load(x), nl.load(bias), nl.load(scale)
        y = nl.ndarray((16, 40), nl.float32, buffer=nl.sbuf)
        s = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y, op=nl.exp, data=xt, bias=bt, scale=st, reduce_op=nl.add,
                        reduce_res=s, reduce_cmd=nisa.reduce_cmd.reset_reduce)  # fmt: skip
        z = nl.ndarray((16, 40), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=z, op=nl.exp, data=xt, scale=0.5)
        # `reduce` keeps adding on top of the registers: the sum of both activations.
        both = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=z, op=nl.exp, data=xt, scale=0.5, reduce_op=nl.add,
                        reduce_res=both, reduce_cmd=nisa.reduce_cmd.reduce)  # fmt: skip
        return copy_out(y), copy_out(s), copy_out(z), copy_out(both)

    y, s, z, both = simulate(kernel)(x, bias, scale)
    expect_y = np.exp(as64(x) * as64(scale) + as64(bias))
    np.testing.assert_allclose(y, expect_y, rtol=1e-5)
    np.testing.assert_allclose(s[:, 0], expect_y.sum(1), rtol=1e-5)
    np.testing.assert_allclose(z, np.exp(as64(x) * 0.5), rtol=1e-5)
    np.testing.assert_allclose(both[:, 0], expect_y.sum(1) + np.exp(as64(x) * 0.5).sum(1), rtol=1e-5)


def test_activation_computes_in_fp32_and_rounds_once():
    # bf16 data 1.0 plus a bias of 2**-9: representable in fp32, lost if added in bf16.
    x = np.ones((4, 8), BF16)

    def kernel(x):
        xt = nl.load(x)
        wide = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=wide, op=nl.copy, data=xt, bias=2.0**-9)
        narrow = nl.ndarray((4, 8), nl.bfloat16, buffer=nl.sbuf)
        nisa.activation(dst=narrow, op=nl.copy, data=xt, bias=3 * 2.0**-9)
        return copy_out(wide), copy_out(narrow)

    wide, narrow = simulate(kernel)(x)
    assert np.all(wide == 1 + 2**-9)
    assert np.all(as64(narrow) == bf16_rne(np.float32(1 + 3 * 2**-9)))  # 1 + 2**-7: rounded once


def test_tensor_scalar_two_ops_with_reverse_and_columns(rng):
    x = rng.standard_normal((8, 10)).astype(np.float32)
    col = rng.standard_normal((8, 1)).astype(np.float32)

    def kernel(x, col):
        xt, ct = nl.load(x), nl.load(col)
        y = nl.ndarray((8, 10), nl.float32, buffer=nl.sbuf)
        # (col - x) * 3
        nisa.tensor_scalar(y, xt, nl.subtract, ct, reverse0=True, op1=nl.multiply, operand1=3.0)
        z = nl.ndarray((8, 10), nl.float32, buffer=nl.sbuf)
        # 2 - max(x, col)
        nisa.tensor_scalar(z, xt, nl.maximum, ct, op1=nl.subtract, operand1=2.0, reverse1=True)
        return copy_out(y), copy_out(z)

    y, z = simulate(kernel)(x, col)
    np.testing.assert_allclose(y, (as64(col) - as64(x)) * 3, **F32_TOL)
    np.testing.assert_allclose(z, 2 - np.maximum(as64(x), as64(col)), **F32_TOL)


def test_scalar_tensor_tensor_reads_psum_and_sbuf(rng):
    a = rng.standard_normal((16, 128)).astype(BF16)
    b = rng.standard_normal((16, 64)).astype(BF16)
    row = rng.standard_normal((1, 80)).astype(np.float32)

    def kernel(a, b, row):
        acc = nl.ndarray((128, 64), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc, nl.load(a), nl.load(b), accumulate=False)
        wide = nl.broadcast_to(nl.load(row), shape=(128, 80))
        out = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=out, data=acc, op0=nl.multiply, operand0=wide[:, 0:1],
                                  op1=nl.add, operand1=wide[:, 16:80])  # fmt: skip
        return copy_out(out)

    got = simulate(kernel)(a, b, row)
    scores = as64(a).T @ as64(b)
    np.testing.assert_allclose(got, scores * row[0, 0] + as64(row[:, 16:80]), rtol=1e-5, atol=1e-4)


def test_tensor_tensor_reduce_reciprocal_memset(rng):
    x = rng.uniform(0.5, 2, (8, 3, 5)).astype(np.float32)
    y = rng.uniform(0.5, 2, (8, 3, 5)).astype(np.float32)

    def kernel(x, y):
        xt, yt = nl.load(x), nl.load(y)
        prod = nl.ndarray((8, 3, 5), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(prod, xt, yt, nl.multiply)
        neg_max = nl.ndarray((8, 3), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(neg_max, nl.max, prod, axis=2, negate=True)
        total = nl.ndarray((8, 1, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(total, nl.add, prod, axis=(1, 2), keepdims=True)
        inv = nl.ndarray((8, 3, 5), nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(inv, xt)
        filled = nl.ndarray((8, 4), nl.int32, buffer=nl.sbuf)
        nisa.memset(filled, 7)
        return copy_out(neg_max), copy_out(total), copy_out(inv), copy_out(filled)

    neg_max, total, inv, filled = simulate(kernel)(x, y)
    p = as64(x) * as64(y)
    np.testing.assert_allclose(neg_max, -p.max(2), **F32_TOL)
    np.testing.assert_allclose(total[:, 0, 0], p.sum((1, 2)), rtol=1e-6)
    np.testing.assert_allclose(inv, 1 / as64(x), **F32_TOL)
    np.testing.assert_array_equal(filled, np.full((8, 4), 7))


def test_nl_elementwise_reductions_and_operators(rng):
    x = rng.standard_normal((8, 2, 6)).astype(np.float32)
    col = rng.standard_normal((8, 1, 1)).astype(np.float32)

    def kernel(x, col):
        xt, ct = nl.load(x), nl.load(col)
        m = nl.max(xt, axis=(1, 2), keepdims=True)
        e = nl.exp(nl.add(xt, nl.broadcast_to(nl.negative(m), shape=xt.shape)))
        s = nl.sum(e, axis=2)
        mixed = (xt * nl.broadcast_to(ct, shape=xt.shape) - 1.0) * 0.5
        low = nl.min(nl.multiply(xt, 2.0, dtype=nl.bfloat16), axis=-1)
        return copy_out(e), copy_out(s), copy_out(mixed), copy_out(low)

    e, s, mixed, low = simulate(kernel)(x, col)
    x64 = as64(x)
    expect_e = np.exp(x64 - x64.max(axis=(1, 2), keepdims=True))
    np.testing.assert_allclose(e, expect_e, rtol=1e-6)
    np.testing.assert_allclose(s, expect_e.sum(2), rtol=1e-6)
    np.testing.assert_allclose(mixed, (x64 * as64(col) - 1) / 2, **F32_TOL)
    assert low.dtype == BF16
    np.testing.assert_array_equal(as64(low), bf16_rne(2 * x).min(-1))


# ------------------------------------------------------------------------------------------------
# end to end


def tiled_softmax_kernel(x):
    """Row softmax of ``x [N*128, F]`` bf16 -> bf16, 128 rows per tile."""
    out = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.shared_hbm)
    for i in range(x.shape[0] // 128):
        rows = nl.load(x[i * 128 : (i + 1) * 128, :])
        neg_max = nl.negative(nl.max(rows, axis=1, keepdims=True))
        probs = nl.ndarray(rows.shape, nl.float32, buffer=nl.sbuf)
        den = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=probs, op=nl.exp, data=rows, bias=neg_max, reduce_op=nl.add,
                        reduce_res=den, reduce_cmd=nisa.reduce_cmd.reset_reduce)  # fmt: skip
        inv = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(inv, den)
        normalised = nl.ndarray(rows.shape, nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_scalar(normalised, probs, nl.multiply, inv)
        nl.store(out[i * 128 : (i + 1) * 128, :], value=normalised)
    return out


def tiled_matmul_kernel(a_t, b):
    """``a_t.T @ b`` for ``a_t [K, M<=128]``, ``b [K, N]`` bf16, K a multiple of 128 -> f32."""
    k_total, m = a_t.shape
    n = b.shape[1]
    out = nl.ndarray((m, n), nl.float32, buffer=nl.shared_hbm)
    for n0 in range(0, n, 512):
        width = min(512, n - n0)
        acc = nl.ndarray((m, width), nl.float32, buffer=nl.psum)
        for k in range(k_total // 128):
            stationary = nl.load(a_t[k * 128 : (k + 1) * 128, :])
            moving = nl.load(b[k * 128 : (k + 1) * 128, n0 : n0 + width])
            nisa.nc_matmul(acc, stationary, moving, accumulate=k > 0)
        staged = nl.ndarray((m, width), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=staged, src=acc)
        nl.store(out[:, n0 : n0 + width], value=staged)
    return out


def test_end_to_end_tiled_softmax(rng):
    x = (3 * rng.standard_normal((256, 1000))).astype(BF16)
    run = simulate(tiled_softmax_kernel)
    got = as64(run(x))
    x64 = as64(x)
    expect = np.exp(x64 - x64.max(1, keepdims=True))
    expect /= expect.sum(1, keepdims=True)
    # One bf16 rounding of an fp32 result: within one bf16 ulp (2**-8 relative).
    np.testing.assert_allclose(got, expect, rtol=2**-8, atol=1e-30)
    assert run.last_stats["instructions"] > 0
    assert run.last_stats["sbuf_peak_bytes_per_partition"] < 192 * 1024


def test_end_to_end_tiled_matmul(rng):
    a_t = rng.standard_normal((384, 100)).astype(BF16)
    b = rng.standard_normal((384, 700)).astype(BF16)
    got = simulate(tiled_matmul_kernel)(a_t, b)
    np.testing.assert_allclose(got, as64(a_t).T @ as64(b), rtol=1e-5, atol=1e-3)


# ------------------------------------------------------------------------------------------------
# rejection rules


def _reject(kernel, *args, error=NkiEmulatorError, match, target="trn2"):
    with pytest.raises(error, match=match):
        simulate(kernel, target=target)(*args)


def test_reject_partition_axis_over_128():
    def alloc(x):
        nl.ndarray((129, 4), nl.float32, buffer=nl.sbuf)

    def load_tall(x):
        nl.load(x)

    _reject(alloc, np.zeros((1, 1), np.float32), error=NkiLimitError, match="partition axis > 128")
    _reject(load_tall, np.zeros((200, 2), np.float32), error=NkiLimitError, match="partition axis > 128")


def test_reject_psum_tile_over_2kib():
    def kernel(x):
        nl.ndarray((128, 513), nl.float32, buffer=nl.psum)

    _reject(kernel, np.zeros(1, np.float32), error=NkiLimitError, match="PSUM tile over 2 KiB")


def test_reject_more_than_8_psum_banks_but_free_rebound_tiles():
    def nine_live(x):
        tiles = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum) for _ in range(9)]
        nl.load(x)
        return tiles

    def rebound_in_loop(x):
        for _ in range(20):
            acc = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
            nisa.memset(acc, 0.0)
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=nl.load(x))
        return out

    x = np.zeros((1, 1), np.float32)
    _reject(nine_live, x, error=NkiCapacityError, match="more PSUM live than 8 banks")
    run = simulate(rebound_in_loop)
    run(x)
    assert run.last_stats["psum_peak_banks"] <= 2


@pytest.mark.parametrize(
    "target, fits_kib, over_kib", [("trn1", 192, 200), ("trn2", 224, 232), ("trn3", 256, 264)]
)
def test_reject_sbuf_over_budget_per_target(target, fits_kib, over_kib):
    # Two fp32 tiles of kib/2 KiB per partition each: the target's whole SBUF fits, 8 KiB more not.
    def kernel(x, kib):
        cols = kib * 1024 // 2 // 4
        a = nl.ndarray((128, cols), nl.float32, buffer=nl.sbuf)
        b = nl.ndarray((128, cols), nl.float32, buffer=nl.sbuf)
        nisa.memset(a, 0.0)
        nisa.memset(b, 1.0)
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=b[0:1, 0:1])
        return out

    x = np.zeros((1, 1), np.float32)
    _reject(kernel, x, over_kib, error=NkiCapacityError, match="SBUF over its budget", target=target)
    assert simulate(kernel, target=target)(x, fits_kib)[0, 0] == 1.0


def test_reject_matmul_sizes_memories_and_dtypes():
    def kernel_m(x):
        st = nl.zeros((128, 129), nl.bfloat16)
        mv = nl.zeros((128, 512), nl.bfloat16)
        nisa.nc_matmul(nl.ndarray((128, 512), nl.float32, buffer=nl.psum), st, mv, accumulate=False)

    def kernel_n(x):
        st = nl.zeros((128, 128), nl.bfloat16)
        mv = nl.zeros((128, 513), nl.bfloat16)
        nisa.nc_matmul(nl.ndarray((128, 512), nl.float32, buffer=nl.psum), st, mv, accumulate=False)

    def kernel_memory(x):
        st = nl.zeros((128, 128), nl.bfloat16, buffer=nl.psum)
        mv = nl.zeros((128, 128), nl.bfloat16)
        nisa.nc_matmul(nl.ndarray((128, 128), nl.float32, buffer=nl.psum), st, mv, accumulate=False)

    def kernel_dst_in_sbuf(x):
        st = nl.zeros((128, 128), nl.bfloat16)
        nisa.nc_matmul(nl.ndarray((128, 128), nl.float32, buffer=nl.sbuf), st, st, accumulate=False)

    def kernel_dst_shape(x):
        st = nl.zeros((128, 64), nl.bfloat16)
        mv = nl.zeros((128, 32), nl.bfloat16)
        nisa.nc_matmul(nl.ndarray((64, 64), nl.float32, buffer=nl.psum), st, mv, accumulate=False)

    def kernel_implicit_accumulate(x):
        st = nl.zeros((128, 64), nl.bfloat16)
        nisa.nc_matmul(nl.ndarray((64, 64), nl.float32, buffer=nl.psum), st, st)

    x = np.zeros(1, np.float32)
    _reject(kernel_m, x, error=NkiLimitError, match="matmul K/M/N over 128/128/512")
    _reject(kernel_n, x, error=NkiLimitError, match="matmul K/M/N over 128/128/512")
    _reject(kernel_memory, x, error=NkiMemorySpaceError, match="operand in the wrong memory")
    _reject(kernel_dst_in_sbuf, x, error=NkiMemorySpaceError, match="operand in the wrong memory")
    _reject(kernel_dst_shape, x, error=NkiShapeError, match="shape mismatch between dst")
    _reject(kernel_implicit_accumulate, x, error=NkiUnsupportedError, match="accumulate")


def test_reject_transpose_over_128x128():
    def kernel(x):
        data = nl.zeros((128, 129), nl.bfloat16)
        nisa.nc_transpose(dst=nl.ndarray((128, 128), nl.bfloat16, buffer=nl.psum), data=data)

    _reject(kernel, np.zeros(1, np.float32), error=NkiLimitError, match="transpose over 128 x 128")


def test_reject_dma_transpose_rules():
    def four_byte(x):
        nisa.dma_transpose(dst=nl.ndarray((8, 4), nl.float32, buffer=nl.sbuf), src=x)

    def wide_source(x):
        nisa.dma_transpose(dst=nl.ndarray((8, 256), nl.bfloat16, buffer=nl.sbuf), src=x)

    def misaligned(x):
        q_t = nl.ndarray((8, 40), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_transpose(dst=q_t[:, 1:5], src=x)

    def from_sbuf(x):
        nisa.dma_transpose(dst=nl.ndarray((8, 4), nl.bfloat16, buffer=nl.sbuf), src=nl.load(x))

    _reject(four_byte, np.zeros((4, 8), np.float32), error=NkiDtypeError,
            match="dma_transpose of a 4-byte dtype")  # fmt: skip
    _reject(wide_source, np.zeros((256, 8), BF16).T.copy(), error=NkiLimitError,
            match="source free size over 128")  # fmt: skip
    _reject(misaligned, np.zeros((4, 8), BF16), error=NkiLimitError, match="32-byte aligned")
    _reject(from_sbuf, np.zeros((4, 8), BF16), error=NkiMemorySpaceError, match="wrong memory")


def test_reject_reductions_over_the_partition_axis():
    def nl_max(x):
        nl.max(nl.load(x), axis=0)

    def isa_reduce(x):
        nisa.tensor_reduce(nl.ndarray((1,), nl.float32, buffer=nl.sbuf), nl.add, nl.load(x), axis=(0, 1))

    x = np.ones((4, 4), np.float32)
    _reject(nl_max, x, error=NkiShapeError, match="reduction over the partition axis")
    _reject(isa_reduce, x, error=NkiShapeError, match="reduction over the partition axis")


def test_reject_shape_mismatch_between_dst_and_value():
    def copy_wider(x):
        nisa.tensor_copy(dst=nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf), src=nl.load(x))

    def activation_broadcast(x):
        dst = nl.ndarray((4, 4, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=dst, op=nl.exp, data=nl.load(x))

    def store_mismatch(x):
        out = nl.ndarray((4, 3), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, value=nl.load(x))

    x = np.ones((4, 4), np.float32)
    for kernel in (copy_wider, activation_broadcast, store_mismatch):
        _reject(kernel, x, error=NkiShapeError, match="shape mismatch between dst and the computed value")


def test_reject_out_of_range_gather_indices():
    kv = np.zeros((10, 4), np.float32)

    def kernel(kv, idx):
        rows = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows, src=kv.ap(pattern=[[4, 4], [1, 4]], vector_offset=nl.load(idx)))

    for bad in (10, -1, 2**31 - 1):
        idx = np.array([[0], [bad], [1], [2]], np.int32)
        _reject(kernel, kv, idx, error=NkiOutOfBoundsError, match="out-of-range gather index")


def test_reject_reading_memory_never_written():
    def fresh_tile(x):
        nl.copy(nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf))

    def half_written(x):
        t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:, 0:4], src=x)
        nl.exp(t)

    def accumulate_into_fresh_psum(x):
        st = nl.load(x)
        acc = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc, st, st, accumulate=True)

    def output_not_fully_written(x):
        out = nl.ndarray((8, 4), nl.float32, buffer=nl.shared_hbm)
        nl.store(out[0:4, :], value=nl.load(x))
        return out

    def reduce_registers_never_reset(x):
        res = nl.ndarray((4, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf), op=nl.exp,
                        data=nl.load(x), reduce_res=res)  # fmt: skip

    def reduce_onto_registers_never_reset(x):
        nisa.activation(dst=nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf), op=nl.exp,
                        data=nl.load(x), reduce_op=nl.add, reduce_cmd=nisa.reduce_cmd.reduce)  # fmt: skip

    x = np.ones((4, 4), np.float32)
    for kernel in (fresh_tile, half_written, accumulate_into_fresh_psum, output_not_fully_written,
                   reduce_registers_never_reset, reduce_onto_registers_never_reset):  # fmt: skip
        _reject(kernel, x, error=NkiUninitializedReadError, match="never written")


def test_reject_activation_reduce_without_reduce_cmd():
    def kernel(x):
        res = nl.ndarray((4, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf), op=nl.exp,
                        data=nl.load(x), reduce_op=nl.add, reduce_res=res)  # fmt: skip

    _reject(kernel, np.ones((4, 4), np.float32), match="reduce_cmd=nisa.reduce_cmd.reset_reduce")


def test_reject_access_outside_a_tensor():
    def slice_past_end(x):
        nl.load(x[0:5, :])

    def index_past_end(x):
        nl.load(x[4])

    def negative_index(x):
        nl.load(x[-1:, :])

    def ap_past_end(x):
        t = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x.ap(pattern=[[4, 4], [1, 4]], offset=1))

    x = np.ones((4, 4), np.float32)
    for kernel in (slice_past_end, index_past_end, negative_index, ap_past_end):
        _reject(kernel, x, error=NkiOutOfBoundsError, match="access outside a tensor")


def test_reject_other_memory_rules():
    def dma_from_psum(x):
        p = nl.zeros((4, 4), nl.float32, buffer=nl.psum)
        nisa.dma_copy(dst=nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf), src=p)

    def output_in_hbm_scratch(x):
        out = nl.ndarray((4, 4), nl.float32, buffer=nl.hbm)
        nl.store(out, value=nl.load(x))
        return out

    def gather_from_sbuf(x):
        t = nl.load(x)
        t.ap(pattern=[[4, 4], [1, 4]], vector_offset=nl.zeros((4, 1), nl.int32))

    def both_inputs_in_psum(x):
        p = nl.zeros((4, 4), nl.float32, buffer=nl.psum)
        nisa.tensor_tensor(nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf), p, p, nl.add)

    x = np.ones((4, 4), np.float32)
    _reject(dma_from_psum, x, error=NkiMemorySpaceError, match="cannot read PSUM")
    _reject(output_in_hbm_scratch, x, error=NkiMemorySpaceError, match="shared_hbm")
    _reject(gather_from_sbuf, x, error=NkiMemorySpaceError, match="wrong memory")
    _reject(both_inputs_in_psum, x, error=NkiMemorySpaceError, match="may not both be in PSUM")


def test_reject_inputs_at_different_base_partitions():
    def kernel(x):
        t = nl.load(x)
        nisa.tensor_tensor(nl.ndarray((2, 4), nl.float32, buffer=nl.sbuf), t[0:2, :], t[2:4, :], nl.add)

    _reject(kernel, np.ones((4, 4), np.float32), error=NkiShapeError, match="different base partitions")


def test_reject_integer_index_dropping_the_partition_axis():
    def kernel(x):
        nl.exp(nl.load(x)[0])

    _reject(kernel, np.ones((4, 4), np.float32), error=NkiShapeError, match="partition axis")


# ------------------------------------------------------------------------------------------------
# targets, SPMD launch grid, instruction counts, dynamic loops


def test_current_target_reads_neuron_platform_target_override(monkeypatch):
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    assert nki_emulator.current_target() == "trn2"
    for value, expected in (("trn1", "trn1"), ("gen4", "trn3"), ("TRN3", "trn3")):
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", value)
        assert nki_emulator.current_target() == expected
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
    assert simulate(lambda x: x).target.name == "trn1"
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "inf9")
    with pytest.raises(ValueError, match="NEURON_PLATFORM_TARGET_OVERRIDE"):
        nki_emulator.current_target()


def _halves_kernel(x):
    """Program p negates rows [p*R/n, (p+1)*R/n) of x (R rows, n programs)."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    n = nl.num_programs()
    p = nl.program_id(0)
    rows = x.shape[0] // n
    tile = nl.load(x[p * rows : (p + 1) * rows, :])
    nl.store(out[p * rows : (p + 1) * rows, :], value=nl.multiply(tile, -1.0 - p))
    return out


def test_spmd_grid_runs_every_program_with_its_own_id(rng):
    x = rng.standard_normal((8, 4)).astype(np.float32)
    expected = np.concatenate([-x[:4], -2 * x[4:]])
    run = simulate(_halves_kernel, target="trn2")[2]
    np.testing.assert_array_equal(run(x), expected)
    assert [p.program_id for p in run.last_run.programs] == [0, 1]
    assert run.last_run.grid == 2
    out, stats = simulate(_halves_kernel, target="trn2", grid=2, stats=True)(x)
    np.testing.assert_array_equal(out, expected)
    assert [p.instructions for p in stats.programs] == [3, 3]  # load, multiply, store
    assert stats.instructions == 6
    np.testing.assert_array_equal(simulate(_halves_kernel)(x), -x)  # no grid: one program


def test_spmd_grid_rules():
    x = np.zeros((8, 4), np.float32)
    with pytest.raises(NkiLimitError, match="launch grid over the logical core size"):
        simulate(_halves_kernel, target="trn1")[2]
    with pytest.raises(NkiLimitError, match="launch grid over the logical core size"):
        simulate(_halves_kernel, target="trn2", grid=4)
    with pytest.raises(NkiUnsupportedError, match="one number"):
        simulate(_halves_kernel, target="trn2")[2, 1]

    def other_output(x):
        out = nl.ndarray((8, 4 + nl.program_id(0)), x.dtype, buffer=nl.shared_hbm)
        return out

    with pytest.raises(NkiShapeError, match="shared_hbm tensor #0"):
        simulate(other_output, target="trn2")[2](x)


@pytest.fixture
def nki_0_6():
    """Models NKI 0.6 (SDK 2.32), the last version with nl.dynamic_range, which it deprecates."""
    with versions.using("0.6"), pytest.warns(NkiDeprecationWarning, match="dynamic_range"):
        yield


def _rows_kernel(x, dynamic):
    """Copies the rows of x one 1-row DMA pair at a time; a dynamic loop or an unrolled one."""
    rows, cols = x.shape
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    if dynamic == "fori_loop":

        def body(i):
            tile = nl.ndarray((1, cols), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=tile, src=x.ap([[cols, 1], [1, cols]], scalar_offset=i))
            nisa.dma_copy(dst=out.ap([[cols, 1], [1, cols]], scalar_offset=i), src=tile)
            nisa.memset(dst=tile, value=0.0)  # a third instruction, as the counter update below

        nl.zeros((1, 1), nl.int32)  # the same instruction count as the dynamic_range form
        nl.fori_loop(0, rows, body)
    elif dynamic:
        counter = nl.zeros((1, 1), nl.int32)
        for _ in nl.dynamic_range(rows):
            tile = nl.ndarray((1, cols), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=tile, src=x.ap([[cols, 1], [1, cols]], scalar_offset=counter))
            nisa.dma_copy(dst=out.ap([[cols, 1], [1, cols]], scalar_offset=counter), src=tile)
            nisa.tensor_scalar(dst=counter, data=counter, op0=nl.add, operand0=1)
    else:
        for r in nl.static_range(rows):
            tile = nl.ndarray((1, cols), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=tile, src=x[r : r + 1, :])
            nisa.dma_copy(dst=out[r : r + 1, :], src=tile)
    return out


@pytest.mark.parametrize("rows", [1, 3, 7])
def test_dynamic_range_body_counts_once_per_compiled_body(rows, rng, nki_0_6):
    x = rng.standard_normal((rows, 5)).astype(np.float32)
    dynamic = simulate(_rows_kernel)
    unrolled = simulate(_rows_kernel)
    np.testing.assert_array_equal(dynamic(x, True), x)
    np.testing.assert_array_equal(unrolled(x, False), x)
    d, u = dynamic.last_run.programs[0], unrolled.last_run.programs[0]
    assert d.compiled_instructions == 1 + 3  # nl.zeros, then one body of three instructions
    assert d.instructions == 1 + 3 * rows
    assert d.ops["nisa.tensor_scalar"] == rows
    assert u.compiled_instructions == u.instructions == 2 * rows


@pytest.mark.parametrize("rows", [1, 3, 7])
def test_fori_loop_body_counts_once_per_compiled_body(rows, rng):
    x = rng.standard_normal((rows, 5)).astype(np.float32)
    run = simulate(_rows_kernel)
    np.testing.assert_array_equal(run(x, "fori_loop"), x)
    p = run.last_run.programs[0]
    assert run.last_run.nki_version == "0.7"
    assert p.compiled_instructions == 1 + 3  # nl.zeros, then one body of three instructions
    assert p.instructions == 1 + 3 * rows
    assert p.ops["nisa.memset"] == rows


def test_each_version_rejects_the_loops_it_lacks_or_removed(rng):
    x = rng.standard_normal((3, 5)).astype(np.float32)
    # NKI 0.7 removed dynamic_range (release notes); 0.3 to 0.5 have no fori_loop.
    with pytest.raises(NkiUnsupportedError, match="removed in this NKI version: nl.dynamic_range"):
        simulate(_rows_kernel, nki_version="0.7")(x, True)
    for old in ("0.3", "0.4", "0.5"):
        with pytest.raises(NkiUnsupportedError, match=r"nl.fori_loop needs NKI >= 0.6.*NKI " + old):
            simulate(_rows_kernel, nki_version=old)(x, "fori_loop")
    # 0.6 has both; dynamic_range and static_range warn there (deprecated).
    with pytest.warns(NkiDeprecationWarning, match="dynamic_range is deprecated since NKI 0.6"):
        np.testing.assert_array_equal(simulate(_rows_kernel, nki_version="0.6")(x, True), x)
    np.testing.assert_array_equal(simulate(_rows_kernel, nki_version="0.6")(x, "fori_loop"), x)
    with pytest.warns(NkiDeprecationWarning, match="static_range is deprecated since NKI 0.6"):
        simulate(_rows_kernel, nki_version="0.7")(x, False)


def test_version_comes_from_the_environment(monkeypatch, rng):
    x = rng.standard_normal((2, 5)).astype(np.float32)
    monkeypatch.setenv(versions.VERSION_ENV, "0.5")
    assert versions.nki_version() == "0.5" and versions.sdk_of() == "2.31"
    with pytest.raises(NkiUnsupportedError, match="NKI 0.5"):
        simulate(_rows_kernel)(x, "fori_loop")
    monkeypatch.setenv(versions.VERSION_ENV, "0.6.0")
    run = simulate(_rows_kernel)
    run(x, "fori_loop")
    assert run.last_run.nki_version == "0.6"
    with versions.using("0.7"):  # a using() block wins over the variable
        assert versions.nki_version() == "0.7"
    monkeypatch.setenv(versions.VERSION_ENV, "0.8")
    with pytest.raises(ValueError, match="JAX_SPARSE_ATTN_NKI_VERSION='0.8'"):
        versions.nki_version()
    with pytest.raises(ValueError, match="NKI version must be one of"):
        simulate(_rows_kernel, nki_version="1.0")


def test_fori_loop_rules():
    x = np.arange(8, dtype=np.float32).reshape(2, 4)

    def returns_a_value(x):
        nl.fori_loop(0, 2, lambda i: nl.zeros((1, 4), nl.float32))

    def tile_escapes(x):
        kept = []

        def body(i):
            t = nl.ndarray((1, 4), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x.ap([[4, 1], [1, 4]], scalar_offset=i))
            kept.append(t)

        nl.fori_loop(0, 2, body)
        out = nl.ndarray((1, 4), x.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=kept[-1])
        return out

    def writes_the_induction_variable(x):
        nl.fori_loop(0, 2, lambda i: nisa.register_move(i, 0))

    def step_zero(x):
        nl.fori_loop(0, 2, lambda i: None, step=0)

    _reject(returns_a_value, x, error=NkiUnsupportedError, match="a fori_loop body returns nothing")
    _reject(tile_escapes, x, error=NkiUnsupportedError, match="tensor escapes a loop body")
    _reject(writes_the_induction_variable, x, error=NkiUnsupportedError,
            match="write to a loop's induction variable")  # fmt: skip
    _reject(step_zero, x, error=NkiUnsupportedError, match="step must be a compile-time positive")

    def carried_state(x):
        # State allocated before the loop and updated inside it (fori_loop page: "carry any other
        # loop state through SBUF/HBM") survives it.
        out = nl.ndarray((1, 4), x.dtype, buffer=nl.shared_hbm)
        acc = nl.zeros((1, 4), nl.float32)

        def body(i):
            t = nl.ndarray((1, 4), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x.ap([[4, 1], [1, 4]], scalar_offset=i))
            nisa.tensor_tensor(dst=acc, data1=acc, data2=t, op=nl.add)

        nl.fori_loop(0, 2, body)
        nl.store(out, value=acc)
        return out

    np.testing.assert_array_equal(simulate(carried_state)(x)[0], x.sum(axis=0))


def test_dynamic_range_loop_variable_is_a_register_from_nki_0_4(rng):
    x = rng.standard_normal((3, 4)).astype(np.float32)

    def kernel(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        for i in nl.dynamic_range(3):
            t = nl.ndarray((1, 4), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x.ap([[4, 1], [1, 4]], scalar_offset=i))
            nisa.dma_copy(dst=out.ap([[4, 1], [1, 4]], scalar_offset=i), src=t)
        return out

    for version in ("0.4", "0.5"):
        np.testing.assert_array_equal(simulate(kernel, nki_version=version)(x), x)
    with pytest.raises(NkiUnsupportedError, match="loop variable cannot be used"):
        simulate(kernel, nki_version="0.3")(x)


def test_dynamic_range_loop_variable_is_opaque(monkeypatch):
    monkeypatch.setenv(versions.VERSION_ENV, "0.3")  # NKI 0.3: the variable cannot address memory

    def index_with_it(x):
        for i in nl.dynamic_range(2):
            nl.load(x[i : i + 1, :])

    def offset_with_it(x):
        for i in nl.dynamic_range(2):
            nisa.dma_copy(dst=nl.ndarray((1, 4), x.dtype, buffer=nl.sbuf),
                          src=x.ap([[4, 1], [1, 4]], scalar_offset=i))  # fmt: skip

    def register_step(x):
        for _ in nl.dynamic_range(0, 4, nisa.register_alloc(2)):
            pass

    x = np.zeros((2, 4), np.float32)
    _reject(index_with_it, x, error=NkiUnsupportedError, match="loop variable cannot be used")
    _reject(offset_with_it, x, error=NkiUnsupportedError, match="loop variable cannot be used")
    _reject(register_step, x, error=NkiUnsupportedError, match="step must be a compile-time")


def test_registers_bound_dynamic_loops_and_offset_accesses(rng, nki_0_6):
    x = rng.standard_normal((6, 4)).astype(np.float32)

    def kernel(x, n):
        out = nl.ndarray((1, 4), x.dtype, buffer=nl.shared_hbm)
        bound = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.memset(bound, n)
        trips = nisa.register_alloc()
        nisa.register_load(trips, bound)
        row = nisa.register_alloc(0)
        nisa.register_move(row, 4)  # read row 4 through a register offset
        acc = nl.zeros((1, 4), nl.float32)
        for _ in nl.dynamic_range(trips):
            tile = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=tile, src=x.ap([[4, 1], [1, 4]], scalar_offset=row))
            nisa.tensor_tensor(dst=acc, data1=acc, data2=tile, op=nl.add)
        stored = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.register_store(stored, trips)
        nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=stored)
        nl.store(out, value=acc)
        return out

    run = simulate(kernel)
    got = run(x, 3)
    np.testing.assert_allclose(as64(got[0]), 3 * as64(x[4]) + 3, **F32_TOL)
    assert run.last_run.programs[0].compiled_instructions == run.last_run.programs[0].instructions - 4


def test_scalar_offset_out_of_range_raises_or_skips():
    x = np.arange(8, dtype=np.float32).reshape(2, 4)

    def kernel(x, mode):
        out = nl.ndarray((1, 4), x.dtype, buffer=nl.shared_hbm)
        tile = nl.full((1, 4), 7.0, nl.float32)
        nisa.dma_copy(dst=tile, src=x.ap([[4, 1], [1, 4]], scalar_offset=nisa.register_alloc(2)),
                      oob_mode=mode)  # fmt: skip
        nl.store(out, value=tile)
        return out

    _reject(kernel, x, nisa.oob_mode.error, error=NkiOutOfBoundsError, match="out-of-range dynamic address")
    np.testing.assert_array_equal(simulate(kernel)(x, nisa.oob_mode.skip), np.full((1, 4), 7.0))


# ------------------------------------------------------------------------------------------------
# indirect DMA: out-of-bounds skip, generation rules, indirect dma_transpose


def _gather_kernel(kv, idx, mode):
    rows = nl.ndarray(idx.shape[:1] + kv.shape[1:], kv.dtype, buffer=nl.sbuf)
    nisa.memset(rows, 0.0)
    index = nl.load(idx)
    nisa.dma_copy(dst=rows, src=kv.ap([[kv.shape[1], idx.shape[0]], [1, kv.shape[1]]],
                                      vector_offset=index, indirect_dim=0), oob_mode=mode)  # fmt: skip
    return copy_out(rows)


def test_indirect_dma_oob_skip_leaves_the_destination_row(rng):
    kv = rng.standard_normal((10, 4)).astype(np.float32)
    idx = np.array([[3], [10], [0], [-1], [2**31 - 1], [9]], np.int32)
    got = simulate(_gather_kernel)(kv, idx, nisa.oob_mode.skip)
    expected = np.zeros((6, 4))
    for p, r in enumerate(idx[:, 0]):
        if 0 <= r < 10:
            expected[p] = kv[r]
    np.testing.assert_array_equal(as64(got), expected)
    with pytest.raises(NkiOutOfBoundsError, match="oob_mode=error"):
        simulate(_gather_kernel)(kv, idx, nisa.oob_mode.error)


def test_trn1_rejects_neuroncore_v3_dma_forms():
    kv = np.zeros((10, 4), np.float32)
    idx = np.zeros((4, 1), np.int32)
    _reject(_gather_kernel, kv, idx, nisa.oob_mode.error, error=NkiUnsupportedError,
            match="not available on trn1: nisa.dma_copy with an indirect", target="trn1")  # fmt: skip

    def hwdge(x):
        dst = nl.ndarray((2, 4), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=dst, src=x, dge_mode=nisa.dge_mode.hwdge)
        return copy_out(dst)

    def transpose(x):
        dst = nl.ndarray((4, 2), x.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=dst, src=x)
        return copy_out(dst)

    _reject(hwdge, kv[:2], error=NkiUnsupportedError, match="not available on trn1.*hwdge", target="trn1")
    _reject(transpose, np.zeros((2, 4), BF16), error=NkiUnsupportedError,
            match="not available on trn1: nisa.dma_transpose", target="trn1")  # fmt: skip
    simulate(hwdge, target="trn2")(kv[:2])
    simulate(transpose, target="trn3")(np.zeros((2, 4), BF16))


def _gather_transpose_kernel(kv, idx, rows, col0, width, mode, fill):
    """dst[b, a] = kv[idx.T.flatten()[a], col0 + b] for a < rows, b < width."""
    dst = nl.ndarray((width, rows), kv.dtype, buffer=nl.sbuf)
    nisa.memset(dst, fill)
    index = nl.ndarray(idx.shape, nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=index, src=idx)
    src = kv.ap([[kv.shape[1], rows], [1, width]], offset=col0, vector_offset=index, indirect_dim=0)
    nisa.dma_transpose(dst=dst, src=src, oob_mode=mode)
    return copy_out(dst)


@pytest.mark.parametrize("idx_shape, rows", [((16, 1), 16), ((128, 1), 96), ((128, 3), 320)])
def test_indirect_dma_transpose_gathers_and_transposes(idx_shape, rows, rng):
    kv = rng.standard_normal((500, 160)).astype(BF16)
    idx = rng.integers(0, 500, idx_shape).astype(np.uint32)
    got = simulate(_gather_transpose_kernel)(kv, idx, rows, 32, 128, nisa.oob_mode.error, 0.0)
    order = [int(idx[a % idx_shape[0], a // idx_shape[0]]) for a in range(rows)]
    expected = np.array([[float(kv[r, 32 + b]) for r in order] for b in range(128)])
    np.testing.assert_array_equal(as64(got), expected)


def test_indirect_dma_transpose_oob_skip_keeps_destination_columns(rng):
    kv = rng.standard_normal((40, 8)).astype(BF16)
    idx = rng.integers(0, 40, (16, 1)).astype(np.uint32)
    idx[[2, 7], 0] = [40, 2**32 - 1]
    got = simulate(_gather_transpose_kernel)(kv, idx, 16, 0, 8, nisa.oob_mode.skip, -3.0)
    for a in range(16):
        col = np.full(8, -3.0) if a in (2, 7) else as64(kv[int(idx[a, 0])])
        np.testing.assert_array_equal(as64(got[:, a]), col)
    with pytest.raises(NkiOutOfBoundsError, match="out-of-range gather index"):
        simulate(_gather_transpose_kernel)(kv, idx, 16, 0, 8, nisa.oob_mode.error, 0.0)


@pytest.mark.parametrize(
    "kv_dtype, idx_shape, idx_dtype, rows, width, error, match",
    [
        (np.float32, (16, 1), np.uint32, 16, 8, NkiDtypeError, "2-byte"),
        (BF16, (16, 1), np.int32, 16, 8, NkiDtypeError, "must be uint32"),
        (BF16, (16, 1), np.uint32, 16, 129, NkiLimitError, "free size over 128"),
        (BF16, (24, 1), np.uint32, 16, 8, NkiShapeError, r"\[16, 128\] and a multiple of 16"),
        (BF16, (64, 2), np.uint32, 64, 8, NkiShapeError, "exactly 128 partitions"),
        (BF16, (16, 1), np.uint32, 24, 8, NkiShapeError, "multiple of 16"),
        (BF16, (16, 1), np.uint32, 32, 8, NkiShapeError, "fewer than the 32"),
    ],
)
def test_reject_indirect_dma_transpose_rules(kv_dtype, idx_shape, idx_dtype, rows, width, error, match):
    kv = np.zeros((50, 140), kv_dtype)
    idx = np.zeros(idx_shape, idx_dtype)

    def kernel(kv, idx):
        dst = nl.ndarray((min(width, 128), rows), kv.dtype, buffer=nl.sbuf)
        index = nl.ndarray(idx.shape, idx.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=index, src=idx)
        src = kv.ap([[140, rows], [1, width]], vector_offset=index, indirect_dim=0)
        nisa.dma_transpose(dst=dst, src=src)

    _reject(kernel, kv, idx, error=error, match=match)


def test_reject_nl_rules_of_nki_0_3():
    x = np.ones((4, 4), np.float32)

    def broadcast_add(x):
        t = nl.load(x)
        nl.add(t, nl.max(t, axis=1, keepdims=True))

    def divide(x):
        t = nl.load(x)
        nl.divide(t, t)

    def true_divide(x):
        t = nl.load(x)
        return t / 2.0

    def mod(x):
        nl.mod(nl.load(x), 2.0)

    def fmod(x):
        nl.fmod(nl.load(x), 2.0)

    def copy_psum(x):
        acc = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
        nisa.tensor_copy(dst=acc, src=nl.load(x))
        nl.copy(acc)

    def memset_float_into_int(x):
        nisa.memset(nl.ndarray((4, 1), nl.int32, buffer=nl.sbuf), 2.0)

    _reject(broadcast_add, x, error=NkiShapeError, match="do not broadcast")
    for kernel in (divide, true_divide, mod, fmod):
        _reject(kernel, x, error=NkiUnsupportedError, match="no hardware instruction")
    with versions.using("0.5"):  # nl.copy reads PSUM from NKI 0.6 (test_version_dependent_forms)
        _reject(copy_psum, x, error=NkiMemorySpaceError, match="nl.copy x must be in sbuf")
    _reject(memset_float_into_int, x, error=NkiDtypeError, match="matching types")


def test_iota_against_its_formula():
    def kernel(x):
        t = nl.ndarray((4, 2, 3), nl.int32, buffer=nl.sbuf)
        nisa.iota(t, [[10, 2], [1, 3]], offset=5, channel_multiplier=100)
        return copy_out(t)

    got = simulate(kernel)(np.zeros(1, np.float32))
    c, w, x = np.meshgrid(np.arange(4), np.arange(2), np.arange(3), indexing="ij")
    np.testing.assert_array_equal(got, 5 + 100 * c + 10 * w + x)


def test_nested_dynamic_loops_compile_their_bodies_once(nki_0_6):
    def kernel(x, outer, inner):
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        acc = nl.zeros((1, 1), nl.float32)
        for _ in nl.dynamic_range(outer):
            nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
            for _ in nl.dynamic_range(inner):
                nisa.tensor_scalar(dst=acc, data=acc, op0=nl.multiply, operand0=2.0)
        nl.store(out, value=acc)
        return out

    for outer, inner in ((1, 1), (3, 2), (5, 4)):
        out, stats = simulate(kernel, stats=True)(np.zeros(1, np.float32), outer, inner)
        expected = 0.0
        for _ in range(outer):
            expected = (expected + 1) * 2**inner
        assert out[0, 0] == expected
        (p,) = stats.programs
        assert p.compiled_instructions == 4  # zeros, two tensor_scalar, store
        assert p.instructions == 2 + outer * (1 + inner)


@pytest.mark.parametrize("fp8", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2])
def test_fp8_rows_gathered_and_dequantised_on_chip(rng, fp8):
    # nl.float8_e4m3fn (language pages, NKI >= 0.2.0) holds the OCP format, up to 448 (the IEEE-
    # style float8_e4m3 stops at 240); an fp8 tile scaled by a [P, 1] f32 column in tensor_scalar
    # is computed in fp32 and rounded once to the bf16 dst (tensor_scalar page, "Data types").
    kv = (rng.standard_normal((12, 32)) * 60).astype(fp8)
    kv[5, 3] = 448 if fp8 is ml_dtypes.float8_e4m3fn else 57344
    scale = rng.uniform(0.01, 3.0, (12, 1)).astype(np.float32)
    idx = np.array([[5], [12], [0], [5]], np.uint32)  # 12 is out of range: skipped

    def kernel(kv, scale, idx):
        index = nl.load(idx)
        rows = nl.ndarray((4, 32), kv.dtype, buffer=nl.sbuf)
        col = nl.ndarray((4, 1), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=rows, value=0.0)
        nisa.memset(dst=col, value=0.0)
        nisa.dma_copy(dst=rows, src=kv.ap(pattern=[[32, 4], [1, 32]], vector_offset=index,
                                          indirect_dim=0), oob_mode=nisa.oob_mode.skip)
        nisa.dma_copy(dst=col, src=scale.ap(pattern=[[1, 4], [1, 1]], vector_offset=index,
                                            indirect_dim=0), oob_mode=nisa.oob_mode.skip)
        deq = nl.ndarray((4, 32), nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=deq, data=rows, op0=nl.multiply, operand0=col,
                           engine=nisa.engine.scalar)
        return copy_out(deq)

    got = as64(simulate(kernel)(kv, scale, idx))
    rows = np.where(idx < 12, idx, 0)[:, 0]
    want = bf16_rne(kv[rows].astype(np.float64).astype(np.float32) * scale[rows])
    want[1] = 0.0
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got).all() and got[0, 3] == bf16_rne(np.float32(kv[5, 3]) * scale[5])[0]


def test_nc_matmul_refuses_float8_e4m3fn():
    # The nc_matmul page lists float8_e4m3 and float8_e5m2 as fp8 inputs, not float8_e4m3fn.
    def kernel(x):
        a = nl.load(x)
        acc = nl.ndarray((8, 8), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=a, moving=a, accumulate=False)

    _reject(kernel, np.zeros((8, 8), ml_dtypes.float8_e4m3fn), error=NkiDtypeError,
            match="float8_e4m3fn is not a matmul input dtype")


# --- engine rules of the ISA pages ---------------------------------------------------------------


def _from_psum_kernel(x, engine, instr):
    """x.T through PSUM (a TensorE transpose), moved to SBUF by ``instr`` on ``engine``."""
    rows = nl.load(x)
    psum = nl.ndarray(x.shape[::-1], x.dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=psum, data=rows)
    staged = nl.ndarray(x.shape[::-1], x.dtype, buffer=nl.sbuf)
    eng = getattr(nisa.engine, engine)
    if instr == "tensor_copy":
        nisa.tensor_copy(dst=staged, src=psum, engine=eng)
    elif instr == "activation":
        nisa.activation(dst=staged, op=nl.copy, data=psum)
    else:
        nisa.tensor_scalar(dst=staged, data=psum, op0=nl.multiply, operand0=1.0, engine=eng)
    out = nl.ndarray(x.shape[::-1], x.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=staged)
    return out


@pytest.mark.parametrize("instr", ["tensor_copy", "tensor_scalar"])
@pytest.mark.parametrize("target", ["trn1", "trn2", "trn3"])
def test_gpsimd_cannot_access_psum(instr, target, rng):
    x = rng.standard_normal((8, 16)).astype(np.float32)
    # tensor_copy page: "GpSimd Engine cannot access PSUM".
    _reject(_from_psum_kernel, x, "gpsimd", instr, error=NkiMemorySpaceError,
            match="GpSimd Engine cannot access PSUM", target=target)  # fmt: skip
    got = simulate(_from_psum_kernel, target=target)(x, "vector", instr)
    np.testing.assert_array_equal(got, x.T)


def test_tensor_copy_is_not_on_the_scalar_engine_of_trn1(rng):
    x = rng.standard_normal((8, 16)).astype(np.float32)
    # tensor_copy page: not supported on the NeuronCore-v2 Scalar engine; activation(copy) is.
    _reject(_from_psum_kernel, x, "scalar", "tensor_copy", error=NkiUnsupportedError,
            match="not available on trn1: nisa.tensor_copy on the Scalar engine", target="trn1")
    for target in ("trn2", "trn3"):
        got = simulate(_from_psum_kernel, target=target)(x, "scalar", "tensor_copy")
        np.testing.assert_array_equal(got, x.T)
    np.testing.assert_array_equal(
        simulate(_from_psum_kernel, target="trn1")(x, "scalar", "activation"), x.T)


@pytest.mark.parametrize("target", ["trn1", "trn2", "trn3"])
def test_scalar_engine_tensor_scalar_takes_three_operator_pairs(target, rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)

    def kernel(x, op0, op1):
        t = nl.load(x)
        res = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=res, data=t, op0=op0, operand0=3.0, op1=op1,
                           operand1=None if op1 is None else 0.5, engine=nisa.engine.scalar)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=res)
        return out

    # tensor_scalar page: the Scalar Engine on trn2 takes (multiply, add), (multiply), (add).
    x64 = x.astype(np.float64)
    for op0, op1, expected in ((nl.multiply, nl.add, x64 * 3 + 0.5), (nl.multiply, None, x64 * 3),
                               (nl.add, None, x64 + 3)):  # fmt: skip
        np.testing.assert_allclose(simulate(kernel, target=target)(x, op0, op1), expected, **F32_TOL)
    for op0, op1 in ((nl.multiply, nl.multiply), (nl.maximum, nl.minimum), (nl.add, nl.add),
                     (nl.subtract, None), (nl.maximum, None)):  # fmt: skip
        _reject(kernel, x, op0, op1, error=NkiUnsupportedError,
                match="operators the Scalar engine lacks", target=target)  # fmt: skip
    # The other engines take them all.
    def on_vector(x):
        t = nl.load(x)
        res = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=res, data=t, op0=nl.maximum, operand0=-1.0, op1=nl.minimum,
                           operand1=1.0, engine=nisa.engine.vector)  # fmt: skip
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=res)
        return out

    np.testing.assert_array_equal(simulate(on_vector, target=target)(x), np.clip(x, -1, 1))


def test_version_dependent_forms(rng):
    """nl.copy reads PSUM from NKI 0.6 (on VectorE; ScalarE and SBUF only before); nc_matmul
    writes a bf16 PSUM dst on NeuronCore-v4 only; the indirect dma_transpose takes fewer than 128
    columns from NKI 0.4."""
    x = rng.standard_normal((8, 16)).astype(np.float32)

    def copy_from_psum(x):
        psum = nl.ndarray((16, 8), x.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=psum, data=nl.load(x))
        out = nl.ndarray((16, 8), x.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=nl.copy(psum))
        return out

    got, stats = simulate(copy_from_psum, nki_version="0.6", stats=True, cost=True)(x)
    np.testing.assert_array_equal(got, x.T)
    assert stats.programs[0].cost.by_instruction["nl.copy"][1] > 0
    assert stats.programs[0].cost.engine_us["scalar"] == 0  # nl.copy on VectorE from 0.6
    with pytest.raises(NkiMemorySpaceError, match="nl.copy x must be in sbuf"):
        simulate(copy_from_psum, nki_version="0.5")(x)

    a = rng.standard_normal((16, 8)).astype(BF16)
    b = rng.standard_normal((16, 32)).astype(BF16)

    def matmul_bf16_dst(a, b):
        acc = nl.ndarray((8, 32), nl.bfloat16, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=nl.load(a), moving=nl.load(b), accumulate=False)
        staged = nl.ndarray((8, 32), nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=staged, src=acc)
        out = nl.ndarray((8, 32), nl.bfloat16, buffer=nl.shared_hbm)
        nl.store(out, value=staged)
        return out

    expected = bf16_rne((as64(a).T @ as64(b)).astype(np.float32))
    np.testing.assert_array_equal(as64(simulate(matmul_bf16_dst, target="trn3")(a, b)), expected)
    for target in ("trn1", "trn2"):
        _reject(matmul_bf16_dst, a, b, error=NkiDtypeError, match="must be float32", target=target)

    kv = rng.standard_normal((64, 100)).astype(BF16)
    idx = rng.integers(0, 64, (16, 1)).astype(np.uint32)

    def gather_transpose(kv, idx):
        xt = nl.ndarray((64, 16), kv.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=xt, src=kv.ap([[100, 16], [1, 64]], offset=0,
                                             vector_offset=nl.load(idx), indirect_dim=0))
        out = nl.ndarray((64, 16), kv.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=xt)
        return out

    got = simulate(gather_transpose, nki_version="0.4")(kv, idx)
    np.testing.assert_array_equal(as64(got), as64(kv[idx[:, 0], :64]).T)
    with pytest.raises(NkiShapeError, match=r"src.shape\[-1\] == 128 in NKI 0.3"):
        simulate(gather_transpose, nki_version="0.3")(kv, idx)
