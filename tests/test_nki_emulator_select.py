"""The emulator's selection instructions (max8, nc_find_index8, nc_match_replace8, nc_n_gather,
select_reduce, comparison operators) against plain numpy, and the rules they enforce."""

import ml_dtypes
import numpy as np
import pytest

from jax_sparse_attn import nki_emulator
from jax_sparse_attn.nki_emulator import NkiEmulatorError, NkiLimitError, NkiShapeError

# The emulator's own rules: no JAX program runs (CI runs these with one JAX, the newest).
pytestmark = pytest.mark.jax_free


def _run(body, *arrays, target="trn2"):
    return nki_emulator.simulate(body, target=target)(*arrays)


def _kernel(fn, out_shape, out_dtype):
    """A kernel loading its inputs to SBUF, running ``fn(nl, nisa, tiles)`` into an SBUF tile."""

    def kernel(*inputs):
        from jax_sparse_attn.nki_emulator import isa as nisa, language as nl

        tiles = [nl.load(x) for x in inputs]
        out = nl.ndarray(out_shape, dtype=out_dtype, buffer=nl.sbuf)
        fn(nl, nisa, tiles, out)
        result = nl.ndarray(out_shape, dtype=out_dtype, buffer=nl.shared_hbm)
        nl.store(result, value=out)
        return result

    return kernel


@pytest.mark.parametrize("target", ["trn1", "trn2", "trn3"])
def test_max8_is_the_eight_largest_descending_with_duplicates(target):
    rng = np.random.default_rng(0)
    x = rng.integers(-5, 6, (16, 40)).astype(np.float32)
    x[3, :] = -np.inf
    x[3, 7] = np.inf
    got = _run(_kernel(lambda nl, nisa, t, o: nisa.max8(dst=o, src=t[0]), (16, 8), np.float32),
               x, target=target)  # fmt: skip
    np.testing.assert_array_equal(got, -np.sort(-x, axis=1)[:, :8])


def test_max8_compares_bf16_as_fp32_and_refuses_nan_and_size_limits():
    x = np.array([[1.0, 1.0078125, 3.0, -2.0, 0.5, 0.25, 7.0, 9.0, -1.0]], ml_dtypes.bfloat16)
    got = _run(_kernel(lambda nl, nisa, t, o: nisa.max8(dst=o, src=t[0]), (1, 8), np.float32), x)
    np.testing.assert_array_equal(got, -np.sort(-x.astype(np.float32), axis=1)[:, :8])
    bad = np.zeros((1, 9), np.float32)
    bad[0, 4] = np.nan
    with pytest.raises(NkiEmulatorError, match="NaN"):
        _run(_kernel(lambda nl, nisa, t, o: nisa.max8(dst=o, src=t[0]), (1, 8), np.float32), bad)
    with pytest.raises(NkiLimitError, match="8 to 16384"):
        _run(_kernel(lambda nl, nisa, t, o: nisa.max8(dst=o, src=t[0]), (1, 8), np.float32),
             np.zeros((1, 7), np.float32))  # fmt: skip
    with pytest.raises(NkiShapeError):
        _run(_kernel(lambda nl, nisa, t, o: nisa.max8(dst=o, src=t[0]), (1, 4), np.float32),
             np.zeros((1, 9), np.float32))  # fmt: skip


def _first_positions(data, vals, ascending=True):
    """numpy: each val takes the next unused occurrence (ascending pairing), -1 if none."""
    out = np.full(vals.shape, -1, np.int64)
    for p in range(data.shape[0]):
        used = set()
        order = range(vals.shape[1]) if ascending else range(vals.shape[1] - 1, -1, -1)
        for i in order:
            for j in range(data.shape[1]):
                if data[p, j] == vals[p, i] and j not in used:
                    out[p, i] = j
                    used.add(j)
                    break
    return out


def test_find_index8_first_occurrences_ascending_for_duplicates_and_sentinel():
    data = np.array([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8], [5, 5, 1, 0, 0, 0, 0, 0, 0, 0, 0]],
                    np.float32)  # fmt: skip
    vals = np.array([[3, 8, 8, 8, 8, 8, 8, 8], [5, 5, 5, 1, 0, 9, np.nan, 0]], np.float32)
    got = _run(_kernel(lambda nl, nisa, t, o: nisa.nc_find_index8(dst=o, data=t[0], vals=t[1]),
                       (2, 8), np.uint32), data, vals)  # fmt: skip
    want = _first_positions(data, vals)
    want[want < 0] = 0xFFFFFFFF  # the page's all-ones sentinel; NaN never matches
    np.testing.assert_array_equal(got, want.astype(np.uint32))
    np.testing.assert_array_equal(got[0], [2, 4, 5, 6, 7, 8, 9, 10])


def test_match_replace8_reverse_order_for_duplicates_and_indices():
    data = np.array([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8]], np.float32)
    vals = np.array([[3, 8, 8, 8, 8, 8, 8, 8]], np.float32)

    def body(nl, nisa, t, o):
        idx = nl.ndarray((1, 8), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.nc_match_replace8(dst=t[0], data=t[0], vals=t[1], imm=-1.0, dst_idx=idx)
        nisa.tensor_copy(dst=o[:, 0:8], src=idx)
        nisa.tensor_copy(dst=o[:, 8:19], src=t[0])

    got = _run(_kernel(body, (1, 19), np.float32), data, vals)
    # The page's example: dst_idx = [2, 10, 9, 8, 7, 6, 5, 4].
    np.testing.assert_array_equal(got[0, :8], [2, 10, 9, 8, 7, 6, 5, 4])
    want = data.copy()
    want[0, _first_positions(data, vals, ascending=False)[0]] = -1.0
    np.testing.assert_array_equal(got[:, 8:], want)


def test_match_replace8_refuses_values_not_present_and_nan():
    for missing in (99.0, np.nan):
        data = np.arange(12, dtype=np.float32)[None, :]
        vals = np.array([[0, 1, 2, 3, 4, 5, 6, missing]], np.float32)
        body = lambda nl, nisa, t, o: nisa.nc_match_replace8(dst=o, data=t[0], vals=t[1], imm=0.0)  # noqa: E731
        with pytest.raises(NkiEmulatorError, match="not in data"):
            _run(_kernel(body, (1, 12), np.float32), data, vals)


def test_n_gather_within_partitions_and_range_check():
    rng = np.random.default_rng(1)
    data = rng.standard_normal((4, 30)).astype(np.float32)
    where = rng.integers(0, 30, (4, 9)).astype(np.uint32)
    body = lambda nl, nisa, t, o: nisa.nc_n_gather(dst=o, data=t[0], indices=t[1])  # noqa: E731
    got = _run(_kernel(body, (4, 9), np.float32), data, where)
    np.testing.assert_array_equal(got, np.take_along_axis(data, where.astype(np.int64), axis=1))
    where[2, 3] = 30
    with pytest.raises(NkiEmulatorError, match="outside"):
        _run(_kernel(body, (4, 9), np.float32), data, where)


def test_select_reduce_never_lets_a_rejected_nan_through_and_comparisons():
    x = np.array([[1.0, np.nan, np.inf, -2.0, np.nan]], np.float32)
    limit = np.array([[3.0]], np.float32)

    def body(nl, nisa, t, o):
        ok = nl.ndarray((1, 5), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=ok, data1=t[0], data2=t[0], op=nl.equal)  # False for NaN
        nisa.select_reduce(dst=o, predicate=ok, on_true=t[0], on_false=-7.0)
        rows = nl.ndarray((1, 5), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=rows, pattern=[[1, 5]], offset=0)
        nisa.tensor_scalar(dst=ok, data=rows, op0=nl.less, operand0=t[1])
        nisa.select_reduce(dst=o, predicate=ok, on_true=o, on_false=-9.0)

    got = _run(_kernel(body, (1, 5), np.float32), x, limit)
    np.testing.assert_array_equal(got, [[1.0, -7.0, np.inf, -9.0, -9.0]])


def test_selection_costs_follow_the_cost_table():
    from jax_sparse_attn.nki_emulator import cost

    x = np.arange(4096, dtype=np.float32)[None, :].repeat(8, 0)
    body = lambda nl, nisa, t, o: nisa.max8(dst=o, src=t[0])  # noqa: E731
    run = nki_emulator.simulate(_kernel(body, (8, 8), np.float32), target="trn2", cost=True)
    run(x)
    record = run.last_run.programs[0].cost
    us = record.by_instruction["nisa.max8"][1]
    assert us == pytest.approx(4096 / (cost.HARDWARE["trn2"].vector_ghz * 1e3))


def _topk_kernel(n, k):
    def kernel(x):
        from jax_sparse_attn.nki_emulator import isa as nisa, language as nl

        src = nl.load(x)
        vals = nl.ndarray((x.shape[0], k), dtype=nl.bfloat16, buffer=nl.sbuf)
        idx = nl.ndarray((x.shape[0], k), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.topk(val_dst=vals, idx_dst=idx, src=src, n=n)
        out_v = nl.ndarray(vals.shape, dtype=nl.bfloat16, buffer=nl.shared_hbm)
        out_i = nl.ndarray(idx.shape, dtype=nl.uint32, buffer=nl.shared_hbm)
        nl.store(out_v, value=vals)
        nl.store(out_i, value=idx)
        return out_v, out_i

    return kernel


def test_topk_reads_a_16_partition_snake_and_returns_ascending():
    rng = np.random.default_rng(2)
    n, k = 70, 6
    snakes = [rng.permutation(200)[:n].astype(np.float32) for _ in range(2)]  # distinct values
    x = np.zeros((32, 5), ml_dtypes.bfloat16)
    for g, s in enumerate(snakes):
        padded = np.concatenate([s, np.zeros(80 - n, np.float32)])
        x[16 * g : 16 * (g + 1)] = padded.reshape(5, 16).T  # element e: partition e % 16
    vals, idx = nki_emulator.simulate(_topk_kernel(n, k), target="trn2")(x)
    for g, s in enumerate(snakes):
        want = np.argsort(s)[-k:]
        np.testing.assert_array_equal(idx[16 * g], want)
        np.testing.assert_array_equal(vals[16 * g].astype(np.float32), s[want])
        assert (idx[16 * g : 16 * (g + 1)] == idx[16 * g]).all()


def test_topk_needs_nki_0_6_and_refuses_ties_at_the_cut():
    from jax_sparse_attn.nki_emulator import versions

    x = np.ones((16, 2), ml_dtypes.bfloat16)
    with pytest.raises(NkiEmulatorError, match="tie"):
        nki_emulator.simulate(_topk_kernel(20, 4), target="trn2")(x)
    with versions.using("0.3"), pytest.raises(NkiEmulatorError, match="NKI >= 0.6"):
        nki_emulator.simulate(_topk_kernel(20, 4), target="trn2")(np.arange(32).reshape(16, 2).astype(ml_dtypes.bfloat16))


def test_tensor_scalar_reduce_counts_and_folds_like_numpy():
    rng = np.random.default_rng(3)
    x = rng.integers(-4, 5, (8, 50)).astype(np.float32)
    col = rng.integers(-4, 5, (8, 1)).astype(np.float32)

    def body(nl, nisa, t, o):
        cmp = nl.ndarray(t[0].shape, dtype=np.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(dst=cmp, data=t[0], op0=nl.greater, operand0=t[1],
                                  reduce_op=nl.add, reduce_res=o[:, 0:1])  # fmt: skip
        nisa.tensor_scalar_reduce(dst=cmp, data=t[0], op0=nl.multiply, operand0=2.0,
                                  reduce_op=nl.max, reduce_res=o[:, 1:2],
                                  reduce_res_negate=True)  # fmt: skip

    got = _run(_kernel(body, (8, 2), np.float32), x, col)
    np.testing.assert_array_equal(got[:, 0], (x > col).sum(axis=1))
    np.testing.assert_array_equal(got[:, 1], -(2 * x).max(axis=1))


def test_tensor_tensor_scan_follows_its_page_like_a_python_loop():
    """The page's loop written plainly: a running sum (op0 add, op1 multiply by ones), a
    reversed subtract from a per-partition initial column, in fp32; both inputs in PSUM refused."""
    rng = np.random.default_rng(4)
    a = rng.integers(-3, 4, (8, 20)).astype(np.float32)
    b = rng.integers(1, 3, (8, 20)).astype(np.float32)
    init = rng.integers(-5, 6, (8, 1)).astype(np.float32)

    def body(nl, nisa, t, o):
        nisa.tensor_tensor_scan(dst=o[:, 0:20], data0=t[0], data1=t[1], initial=0.0,
                                op0=nl.add, op1=nl.multiply)  # fmt: skip
        nisa.tensor_tensor_scan(dst=o[:, 20:40], data0=t[0], data1=t[1], initial=t[2],
                                op0=nl.subtract, op1=nl.add, reverse0=True)  # fmt: skip

    got = _run(_kernel(body, (8, 40), np.float32), a, b, init)
    want = np.zeros((8, 40), np.float64)
    for p in range(8):
        state = 0.0
        for i in range(20):
            state = (a[p, i] + state) * b[p, i]
            want[p, i] = state
        state = init[p, 0]
        for i in range(20):
            state = (state - a[p, i]) + b[p, i]  # reverse0: the running state is op0's lhs
            want[p, 20 + i] = state
    np.testing.assert_array_equal(got, want.astype(np.float32))

    def both_psum(nl, nisa, t, o):
        ps = nl.ndarray((8, 20), dtype=np.float32, buffer=nl.psum)
        nisa.tensor_copy(dst=ps, src=t[0])
        nisa.tensor_tensor_scan(dst=o, data0=ps, data1=ps, initial=0.0, op0=nl.add, op1=nl.add)

    with pytest.raises(NkiEmulatorError, match="PSUM"):
        _run(_kernel(both_psum, (8, 20), np.float32), a)


def test_tensor_scalar_reduce_refuses_what_it_does_not_emulate():
    def chained(nl, nisa, t, o):
        cmp = nl.ndarray(t[0].shape, dtype=np.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(dst=cmp, data=t[0], op0=nl.add, operand0=1.0, reduce_op=nl.add,
                                  reduce_res=o, reduce_cmd=nisa.reduce_cmd.reduce)  # fmt: skip

    with pytest.raises(NkiEmulatorError, match="reset_reduce"):
        _run(_kernel(chained, (4, 1), np.float32), np.zeros((4, 8), np.float32))

    def wide(nl, nisa, t, o):
        cmp = nl.ndarray(t[0].shape, dtype=np.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(dst=cmp, data=t[0], op0=nl.add, operand0=1.0, reduce_op=nl.add,
                                  reduce_res=o)  # fmt: skip

    with pytest.raises(NkiShapeError, match="reduce_res"):
        _run(_kernel(wide, (4, 2), np.float32), np.zeros((4, 8), np.float32))


def _scatter_kernel(rows: int):
    def kernel(src, idx):
        from jax_sparse_attn.nki_emulator import isa as nisa, language as nl

        p, f = src.shape
        out = nl.ndarray((rows, f), dtype=src.dtype, buffer=nl.shared_hbm)
        fill = nl.ndarray((rows, f), dtype=src.dtype, buffer=nl.sbuf)
        nisa.memset(dst=fill, value=-1.0)
        nisa.dma_copy(dst=out, src=fill)
        s = nl.ndarray((p, f), dtype=src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=s, src=src)
        i = nl.ndarray((p, 1), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.dma_copy(dst=i, src=idx)
        nisa.dma_copy(dst=out.ap(pattern=[[f, p], [1, f]], vector_offset=i, indirect_dim=0),
                      src=s, oob_mode=nisa.oob_mode.skip)  # fmt: skip
        return out

    return kernel


def test_dma_scatter_writes_each_partition_to_its_row_and_skips_out_of_range():
    src = np.arange(12, dtype=np.float32).reshape(4, 3)
    idx = np.array([[5], [0], [9], [2]], np.uint32)  # row 9 is outside the 6 rows
    got = nki_emulator.simulate(_scatter_kernel(6), target="trn2")(src, idx)
    want = np.full((6, 3), -1.0, np.float32)
    for p, r in enumerate(idx[:, 0]):
        if r < 6:
            want[r] = src[p]
    np.testing.assert_array_equal(got, want)


def test_dma_scatter_refuses_repeated_rows_and_trn1():
    src = np.ones((2, 3), np.float32)
    with pytest.raises(NkiShapeError, match="twice"):
        nki_emulator.simulate(_scatter_kernel(4), target="trn2")(src, np.array([[1], [1]], np.uint32))
    with pytest.raises(NkiEmulatorError, match="indirect"):
        nki_emulator.simulate(_scatter_kernel(4), target="trn1")(src, np.array([[0], [1]], np.uint32))
