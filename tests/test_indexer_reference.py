"""The indexer reference's streaming selection: the same results whatever the token chunk, row
block and buffer sizes (bit-identical where the CPU's products are shape-invariant, exact on each
plan's scores everywhere), its pieces against numpy, and a compiled program that holds nothing of
size [T, R]."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from indexer_oracle import check_selection, scores_f64, topk_f64, valid_rows
from jax_sparse_attn import cpu_products
from jax_sparse_attn.indexer import reference


def _inputs(rng, T, Hi, Di, R, dtype=jnp.bfloat16):
    q = jnp.asarray(rng.standard_normal((T, Hi, Di)), dtype)
    w = jnp.asarray(rng.standard_normal((T, Hi)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((R, Di)), dtype)
    k = k.at[7].set(k[250]).at[130].set(k[250])  # exact ties, in different blocks
    return q, w, k, jnp.ones((R,), jnp.float32)


# Row blocks are whole multiples of 16 rows, as chunk_plan makes them (reference.BLOCK_ALIGN).
PLANS = [reference.ChunkPlan(1, 16, 24 + 16), reference.ChunkPlan(5, 64, 24 + 64),
         reference.ChunkPlan(16, 288, 24 + 288), reference.ChunkPlan(3, 48, 24 + 100)]


# Compressed blocks (ratio 4) take the same selection code as ratio 1 on other rows; their
# compilations are the slowest of the default run, so CI runs them (slow) and the default run not.
RATIO_4 = pytest.param(4, marks=pytest.mark.slow)


# form: None is this process's CPU product form; "f32" forces the widened one, which CI runners
# without native bf16 products take, so that any machine runs what they run.
@pytest.mark.parametrize("ratio, form", [(1, None), (1, "f32"), (4, None)])
@pytest.mark.slow
def test_bit_identical_across_chunk_plans(rng, ratio, form):
    T, Hi, Di, R, topk = 21, 4, 16, 300, 24
    q, w, k, ks = _inputs(rng, T, Hi, Di, R)
    positions = jnp.asarray(np.concatenate([rng.integers(0, R * ratio, T - 2), [-5, 10**9]]),
                            jnp.int32)
    chosen = cpu_products.parse_form(form) if form else cpu_products.cpu_form()
    results = []
    # Every plan at ratio 1; at ratio 4 (whose rule only changes the rows' limits) two of them,
    # one token per chunk and several: each plan is a compile of several seconds.
    with cpu_products.forced(chosen):
        for plan in [None] + (PLANS if ratio == 1 else PLANS[::2]):
            run = jax.jit(lambda *a, plan=plan: reference.indexer_topk_reference(
                *a, topk=topk, compress_ratio=ratio, plan=plan))
            results.append([np.asarray(x) for x in run(q, w, k, ks, positions)])
    s, bound = scores_f64(q, w, k, scale=1.0)  # the reference takes the scale folded into w
    for idx, scores in results[1:]:
        if not cpu_products.shape_invariant(chosen):
            # XLA:CPU's f32 products, its Eigen kernels (jax 0.7) and YNNPACK with AMX may sum a
            # product in another order for another block shape (docs/indexer.md, "Determinism"):
            # each plan is still exact on its own scores, and they agree to their last bits.
            check_selection(idx, scores, s, bound, valid_rows(positions, R, ratio), topk)
            np.testing.assert_array_max_ulp(scores, results[0][1], maxulp=4)
            continue
        np.testing.assert_array_equal(idx, results[0][0])
        np.testing.assert_array_equal(scores, results[0][1])
    check_selection(*results[0], s, bound, valid_rows(positions, R, ratio), topk)


@pytest.mark.slow
def test_lanes_select_as_one_lane(rng, monkeypatch):
    T, Hi, Di, R, topk = 37, 2, 16, 200, 8  # 37 chunks of one token: two lanes and a padded one
    q, w, k, ks = _inputs(rng, T, Hi, Di, R)
    positions = jnp.asarray(rng.integers(-3, R, T), jnp.int32)
    plan = reference.ChunkPlan(1, 64, topk + 16 + 64)
    results = []
    for lanes in (1, 2):
        monkeypatch.setattr(reference, "LANES", lanes)
        results.append([np.asarray(x) for x in jax.jit(lambda *a: reference.indexer_topk_reference(
            *a, topk=topk, compress_ratio=1, plan=plan))(q, w, k, ks, positions)])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    s, bound = scores_f64(q, w, k, scale=1.0)
    check_selection(*results[1], s, bound, valid_rows(positions, R), topk)


def test_order_keys_are_monotone_and_invertible():
    x = np.array([-np.inf, -3e38, -1.5, -1e-37, -0.0, 0.0, 1e-37, 2.0, 3e38, np.inf, np.nan],
                 np.float32)
    keys = np.asarray(reference.order_keys(jnp.asarray(x)))
    assert np.all(np.diff(keys[:4]) > 0) and keys[4] == keys[5] and np.all(np.diff(keys[5:10]) > 0)
    assert keys[-1] == reference.NAN_KEY and keys[-1] < keys[0] and keys[-1] > reference.INVALID_KEY
    back = np.asarray(reference.scores_of_keys(jnp.asarray(keys)))
    np.testing.assert_array_equal(back[:-1], np.where(x[:-1] == 0, np.float32(0), x[:-1]))
    assert np.isnan(back[-1])


def _best_first_order(keys):
    """numpy: each row's positions best first (key descending, position ascending)."""
    M = keys.shape[1]
    return np.lexsort((np.arange(M)[None].repeat(len(keys), 0), -keys.astype(np.int64)), axis=1)


@pytest.mark.parametrize("M", [1, 2, 5, 300, 4096])
def test_sort_best_first_against_numpy(rng, M):
    keys = rng.integers(-20, 20, (6, M)).astype(np.int32)  # many ties
    keys[0] = rng.integers(-(2**31), 2**31 - 1, M)
    rows = np.broadcast_to(np.arange(M, dtype=np.int32) * 3, keys.shape)
    # jitted: eagerly, each of its operations would compile on its own (4 times the time).
    got_k, got_r = (np.asarray(a) for a in jax.jit(reference.sort_best_first)(
        jnp.asarray(keys), jnp.asarray(rows)))
    order = _best_first_order(keys)
    np.testing.assert_array_equal(got_k, np.take_along_axis(keys, order, 1))
    np.testing.assert_array_equal(got_r, np.take_along_axis(rows, order, 1))


def _hard_key_rows(rng, M):
    """Rows of keys that stress the one-pass sort's codes and the k-th search: clustered scores
    beside an outlier (many share a code), scores across zero, NaN, +-inf and invalid entries,
    exact ties, full-range integers, all equal, a long run that shares a code."""
    keys = lambda x: np.asarray(reference.order_keys(jnp.asarray(np.float32(x))))
    rows = [
        keys(np.r_[1e30, rng.uniform(1, 1.0001, M)][:M]),
        keys(rng.standard_normal(M)),
        keys(np.r_[np.inf, -np.inf, np.nan, rng.standard_normal(M)][:M]),
        np.where(rng.random(M) < 0.4, reference.INVALID_KEY, keys(rng.standard_normal(M) + 3)),
        rng.integers(-3, 3, M),
        rng.integers(-(2**31) + 1, 2**31 - 1, M),
        np.full(M, 5),
        # Distinct keys a few bits apart beside the extremes: they share one code, worst first.
        np.r_[-(2**31) + 1, 2**31 - 1, 1000 + 3 * np.arange(M)][:M],
    ]
    return np.stack([np.roll(r, int(rng.integers(M))) for r in rows]).astype(np.int32)


@pytest.mark.parametrize("M", [2, 7, 2048])
def test_sort_best_first_on_hard_keys(rng, M):
    hard = _hard_key_rows(rng, M)
    # Together (one row's runs of equal codes send the whole call to the two-pass sort) and each
    # row alone (most take the one pass with its pair swaps).
    for keys in [hard] + [hard[i:i + 1] for i in range(len(hard))]:
        rows = np.broadcast_to(np.arange(M, dtype=np.int32) + 100, keys.shape)
        got_k, got_r = (np.asarray(a) for a in jax.jit(reference.sort_best_first)(
            jnp.asarray(keys), jnp.asarray(rows)))
        order = _best_first_order(keys)
        np.testing.assert_array_equal(got_k, np.take_along_axis(keys, order, 1))
        np.testing.assert_array_equal(got_r, np.take_along_axis(rows, order, 1))


@pytest.mark.parametrize("M, k", [(1, 1), (7, 1), (7, 7), (300, 24), (4096, 2048)])
def test_kth_largest_against_numpy(rng, M, k):
    keys = _hard_key_rows(rng, M)
    want = -np.sort(-keys.astype(np.int64), axis=1)[:, k - 1]
    got = jax.jit(reference.kth_largest, static_argnums=1)(jnp.asarray(keys), k)
    np.testing.assert_array_equal(np.asarray(got), want)
    # From a known lower bound (a key with at least k at or above it), as the cuts call it.
    below = np.maximum(want - rng.integers(0, 3, len(want)), -(2**31)).astype(np.int32)
    got = jax.jit(lambda x, b: reference.kth_largest(x, k, b))(jnp.asarray(keys), below)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("M, k, cap", [(7, 1, 1), (7, 3, 5), (300, 24, 40), (4096, 2048, 2112)])
def test_cut_threshold_against_numpy(rng, M, k, cap):
    keys = _hard_key_rows(rng, M)
    valid = keys != reference.INVALID_KEY
    best = -np.sort(-np.where(valid, keys, -(2**31)).astype(np.int64), axis=1)
    kth = best[:, k - 1]
    for below in [None, np.where(valid.sum(1) >= k, kth - rng.integers(0, 3, len(kth)),
                                 reference.INVALID_KEY).astype(np.int32)]:
        got = np.asarray(jax.jit(lambda x, b: reference.cut_threshold(x, k, cap, b))(
            jnp.asarray(keys), None if below is None else jnp.asarray(below)))
        assert (got > reference.INVALID_KEY).all()
        n = (valid & (keys >= got[:, None])).sum(1)
        np.testing.assert_array_equal(n >= np.minimum(k, valid.sum(1)), True)
        # At most cap, unless the keys equal to the k-th key alone go past it: then x is it.
        over = n > cap
        np.testing.assert_array_equal(got[over], kth[over])
        assert ((keys[over] > kth[over, None]).sum(1) < k).all()


@pytest.mark.parametrize("M, k, cap", [(7, 3, 5), (4096, 2048, 2112)])
def test_cut_keeps_the_best_in_buffer_order(rng, M, k, cap):
    keys = _hard_key_rows(rng, M)
    rows = rng.permutation(M * len(keys)).reshape(keys.shape).astype(np.int32)
    pairs = jnp.stack([jnp.asarray(keys), jnp.asarray(rows)], axis=-1)
    out, count, tau = (np.asarray(a) for a in jax.jit(
        lambda p: reference.cut(p, k, cap, cap + 3))(pairs))
    order = _best_first_order(keys)
    for i in range(len(keys)):
        n_valid = int((keys[i] != reference.INVALID_KEY).sum())
        assert min(k, n_valid) <= count[i] <= cap
        kept = out[i, :count[i]]
        assert (out[i, count[i]:, 0] == reference.INVALID_KEY).all()
        # The kept entries: a subset of the row in its order, holding its best min(k, valid).
        pos = {int(r): j for j, r in enumerate(rows[i])}
        where = np.array([pos[int(r)] for r in kept[:, 1]])
        assert (np.diff(where) > 0).all()
        np.testing.assert_array_equal(kept[:, 0], keys[i, where])
        assert set(order[i, :min(k, n_valid)]) <= set(where)
        if count[i] >= k:  # tau: a key that k kept entries reach
            assert (kept[:, 0] >= tau[i]).sum() >= k
        else:
            assert tau[i] == reference.INVALID_KEY


# Buffers up to WHOLE_SORT_MAX are sorted whole; longer ones are cut, then sorted whole (at most
# FINAL_WHOLE_SORT_MAX entries: k <= 32) or in one pass.
@pytest.mark.parametrize("M, k", [(40, 24), (reference.WHOLE_SORT_MAX, 13),
                                  (reference.WHOLE_SORT_MAX + 1, 13),
                                  (reference.WHOLE_SORT_MAX + 1, 33),
                                  pytest.param(4096, 2048, marks=pytest.mark.slow)])
def test_best_first_against_numpy(rng, M, k):
    keys = _hard_key_rows(rng, M)
    rows = np.broadcast_to(np.arange(M, dtype=np.int32) * 7, keys.shape)
    got_k, got_r = (np.asarray(a) for a in jax.jit(lambda p: reference.best_first(p, k))(
        jnp.stack([jnp.asarray(keys), jnp.asarray(rows)], axis=-1)))
    order = _best_first_order(keys)[:, :k]
    np.testing.assert_array_equal(got_k, np.take_along_axis(keys, order, 1))
    np.testing.assert_array_equal(got_r, np.take_along_axis(rows, order, 1))


@pytest.mark.parametrize("L", [1, 31, 300, 4608])
def test_prefix_counts_and_compact_against_numpy(rng, L):
    mask = rng.random((5, L)) < np.array([0.0, 0.1, 0.5, 0.9, 1.0])[:, None]
    np.testing.assert_array_equal(np.asarray(reference.prefix_counts(jnp.asarray(mask))),
                                  np.cumsum(mask, axis=1))
    pairs = rng.integers(-100, 100, (5, L, 2)).astype(np.int32)
    start = rng.integers(0, 4, 5).astype(np.int32)
    size = L + 3
    old = rng.integers(-100, 100, (5, size, 2)).astype(np.int32)
    got, count = (np.asarray(a) for a in reference.compact(
        jnp.asarray(pairs), jnp.asarray(mask), size, offset=(jnp.asarray(start), jnp.asarray(old))))
    for i in range(5):
        want = np.concatenate([old[i, :start[i]], pairs[i][mask[i]]])[:size]
        assert count[i] == len(want)
        np.testing.assert_array_equal(got[i, :len(want)], want)
        np.testing.assert_array_equal(got[i, len(want):], old[i, len(want):])


@pytest.mark.parametrize("L, size", [(32, 32), (256, 40), (4096, 700)])
def test_compact_positions_against_numpy(rng, L, size):
    # Rows of several densities (none, a few, full groups, at most size), and keys gathered by
    # the positions equal numpy's boolean selection in order.
    density = np.array([0.0, 0.02, 0.3, 1.0])[:, None]
    keep = rng.random((4, L)) < density
    for i in range(4):  # at most size per row: the first size of a dense row
        keep[i, np.flatnonzero(keep[i])[size:]] = False
    keep[1, :32] = True  # one full group
    keep[1, np.flatnonzero(keep[1])[size:]] = False
    src, live = (np.asarray(a) for a in jax.jit(
        lambda m: reference.compact_positions(reference.bit_masks(m), size))(jnp.asarray(keep)))
    for i in range(4):
        want = np.flatnonzero(keep[i])
        assert live[i].sum() == len(want) and live[i, :len(want)].all(), i
        np.testing.assert_array_equal(src[i, :len(want)], want)
        assert ((src[i] >= 0) & (src[i] < L)).all(), i


@pytest.mark.parametrize("L", [32, 4096])
def test_first_set_bits_against_numpy(rng, L):
    # Each row keeps its first n true entries (n from none to past its count, and a cut inside a
    # full word and at a word's last bit).
    keep = rng.random((6, L)) < np.array([0.0, 0.05, 0.5, 1.0, 1.0, 0.5])[:, None]
    n = np.array([3, 7, L // 3, 31, 32, L + 5], np.int32)
    got = np.asarray(jax.jit(lambda m, n: reference.first_set_bits(reference.bit_masks(m), n))(
        jnp.asarray(keep), jnp.asarray(n)))
    for i in range(6):
        want = keep[i] & (np.cumsum(keep[i]) <= n[i])
        bits = ((got[i][:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(bool).reshape(-1)
        np.testing.assert_array_equal(bits, want, err_msg=str(i))


# The whole-rows selection on small shapes: chunks of 8 and 5 tokens, products of 64 and 48 rows,
# rows 512 and 1536 wide (multiples of COMPACT_GROUP * ROWS_WIDTHS).
ROWS_PLANS = [reference.RowsPlan(8, 64, 512, 64), reference.RowsPlan(5, 48, 512, 48)]


@pytest.mark.slow
@pytest.mark.parametrize("ratio", [1, RATIO_4])
def test_rows_selection_is_exact_with_ties_nan_and_garbage(rng, ratio):
    # topk 24 of 300 rows: every token's valid rows fit the candidates' room, so it keeps them all.
    results, _ = _exact_with_ties_nan_and_garbage(
        rng, 21, ratio, reference.indexer_topk_reference, [PLANS[2]] + ROWS_PLANS)
    if cpu_products.shape_invariant(cpu_products.cpu_form()):
        for streamed, *rows in results.values():
            for got in rows:
                for a, b in zip(got, streamed):
                    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("case", [pytest.param("plain", marks=pytest.mark.slow),
                                  pytest.param("tied", marks=pytest.mark.slow),
                                  pytest.param("skewed", marks=pytest.mark.slow)])
def test_rows_selection_takes_its_sample_floor_or_cuts_whole_rows(rng, case):
    # 1000 to 1450 valid rows against a room of 192 (topk 8) or 832 (topk 300): the sample's
    # floor picks the candidates. "tied": 500 rows share one key, so a floor tied by more keys
    # than the room keeps only the earliest ties it needs. "skewed": the unsampled rows (not
    # multiples of 8) score higher, so the floor lets too many through and the chunk cuts its
    # whole rows. topk 1200's room holds every valid row. Against float64, ties in row order,
    # rows past the positions garbage, and the stream's result from the same scores.
    T, Hi, Di, R = 12, 4, 16, 1500
    q, w, k, ks = _inputs(rng, T, Hi, Di, R)
    if case == "tied":
        k = k.at[100:600].set(k[50])
    if case == "skewed":
        ks = jnp.where(jnp.arange(R) % reference.ROWS_SAMPLE == 0, 1.0, 4.0)
    k = k.at[1450:].set(jnp.nan)
    positions = jnp.asarray(np.concatenate([rng.integers(1000, 1449, T - 2), [-1, 5]]), jnp.int32)
    s, bound = scores_f64(q, w, k, ks, scale=1.0)
    valid = valid_rows(positions, R)
    plan = reference.RowsPlan(6, 64, 1536, 64)
    for topk in (8, 300, 1200):
        room = reference._sample_reach(topk)[2]
        assert (valid.sum(1)[:-2] > room).all() == (topk < 1200)
        run = lambda p: jax.jit(lambda *a: reference.indexer_topk_reference(
            *a, topk=topk, compress_ratio=1, plan=p))(q, w, k, ks, positions)
        idx, scores = (np.asarray(a) for a in run(plan))
        check_selection(idx, scores, s, bound, valid, topk)
        if case == "tied":  # the tied rows that are kept are the lowest ones
            for t in range(T):
                tied_rows = [r for r in range(100, 600) if valid[t, r]]
                kept = sorted(r for r in idx[t] if 100 <= r < 600)
                assert kept == tied_rows[: len(kept)], t
        if cpu_products.shape_invariant(cpu_products.cpu_form()):
            for a, b in zip((idx, scores), run(PLANS[2])):
                np.testing.assert_array_equal(a, np.asarray(b))


def test_rows_plan_takes_prefill_chunks_whose_rows_fit():
    plan = reference.rows_plan
    # The small indexer's prefill (issue 17): chunks of 32 tokens, rows of 32,768 keys (4 MiB).
    p = plan(32768, 4, 32768, 2048)
    assert isinstance(p, reference.RowsPlan) and p.tokens == 32 and p.buffer == 32768
    assert 4 * p.tokens * p.buffer <= reference.ROWS_BYTES
    assert 4 * p.tokens * 4 * p.piece <= reference.DOT_BYTES and p.piece % 16 == 0
    # 64 heads: fewer tokens, so that a product keeps at least ROWS_MIN_PIECE rows.
    p = plan(8192, 64, 8192, 2048)
    assert p.piece >= reference.ROWS_MIN_PIECE and p.tokens == 32
    assert plan(8192, 4, 8192, reference.ROWS_MIN_TOPK - 1) is None  # small topk: the stream
    assert plan(8, 4, 8192, 2048) is None  # a decode step's few tokens: the stream
    assert plan(4096, 4, 2**17, 2048) is None  # rows too long for more than 8 tokens
    assert reference.cpu_selection(4096, 4, 2**16, 2048)[1] is reference._select_rows
    assert reference.cpu_selection(4096, 4, 2**16, 64)[1] is reference._select_chunk


# topk 32 streams; topk 256 keeps each chunk's whole rows, within ROWS_BYTES.
@pytest.mark.parametrize("topk", [32, 256])
@pytest.mark.slow
def test_nothing_of_size_tokens_by_rows_is_built(rng, topk):
    T, Hi, Di = 64, 4, 16
    R = 4 * reference.MAX_BLOCK_ROWS
    args = [jax.ShapeDtypeStruct(s, d) for s, d in [((T, Hi, Di), jnp.bfloat16),
            ((T, Hi), jnp.float32), ((R, Di), jnp.bfloat16), ((R,), jnp.float32),
            ((T,), jnp.int32)]]
    run = jax.jit(lambda *a: reference.indexer_topk_reference(*a, topk=topk, compress_ratio=1))
    text = run.lower(*args).compile().as_text()
    shapes = set(re.findall(r"\[([0-9,]+)\]", text))
    with_rows = {s for s in shapes if str(R) in s.split(",")}
    operands = {f"{R},{Di}", f"{R}"}
    if topk < reference.ROWS_MIN_TOPK:
        assert with_rows == operands, with_rows  # the operands themselves, nothing more
        return
    chunk = reference.rows_plan(T, Hi, R, topk).tokens
    assert chunk < T and f"{chunk},{R}" in with_rows
    # Each chunk's rows of int32 keys within ROWS_BYTES; jax 0.7's XLA:CPU also materialises a
    # count pass's f32 masks, two rows of them at once in the search's count at zero.
    for shape in with_rows - operands:
        assert 4 * np.prod([int(n) for n in shape.split(",")]) <= 2 * reference.ROWS_BYTES, shape


@pytest.mark.slow
def test_no_f32_copy_of_all_queries_in_the_f32_form():
    # The f32 form widens each chunk's queries once. XLA:CPU used to widen the whole 16-bit q
    # outside the token loop (twice q's bytes: 2 GiB for a 65,536-token V3.2 prefill) and then
    # each block's piece widened its chunk again.
    T, Hi, Di, R, topk = 512, 8, 32, 2048, 32
    args = [jax.ShapeDtypeStruct(s, d) for s, d in [((T, Hi, Di), jnp.bfloat16),
            ((T, Hi), jnp.float32), ((R, Di), jnp.bfloat16), ((R,), jnp.float32),
            ((T,), jnp.int32)]]
    run = jax.jit(lambda *a: reference.indexer_topk_reference(*a, topk=topk, compress_ratio=1))
    with cpu_products.forced(cpu_products.parse_form("f32")):
        text = run.lower(*args).compile().as_text()
    f32_shapes = [[int(n) for n in s.split(",")] for s in re.findall(r"f32\[([0-9,]+)\]", text)]
    copies = [s for s in f32_shapes if s[-2:] == [Hi, Di] and np.prod(s) >= T * Hi * Di]
    assert not copies, copies


def _materialised(text, shape):
    """The instructions of a compiled program's text that produce an f32 array of ``shape`` as
    a buffer of their own (outside the fused computations, whose values are never stored)."""
    found, fused = [], False
    for line in text.splitlines():
        header = re.match(r"(ENTRY )?%([\w.-]+) \(", line)
        if header:
            fused = header.group(2).startswith(("fused_computation", "wrapped_"))
        elif not fused and re.search(rf"= f32\[{shape}\]", line):
            found.append(line.strip()[:160])
    return found


@pytest.mark.parametrize("form", ["native", "f32"])
def test_no_f32_copy_of_the_key_cache_at_a_decode_step(form):
    # A decode step's blocks are single pieces: XLA:CPU hoisted their keys' conversion out of the
    # block loop as one f32 copy of the whole cache, then narrowed each block's slice back: three
    # quarters of a decode step over 1M rows with Hi = 4 (105 ms; 37 ms without, Sapphire Rapids).
    T, Hi, Di, R, topk = 1, 4, 64, 65536, 256
    plan = reference.chunk_plan(T, Hi, R, topk)
    assert reference.dot_rows(plan, Hi) == reference.block_rows(plan, Hi) < R  # single pieces
    copies = _f32_key_cache_copies(T, Hi, Di, R, topk, form)
    assert not copies, copies


def _f32_key_cache_copies(T, Hi, Di, R, topk, form):
    """The f32 ``[R, Di]`` buffers in the compiled reference's program (``_materialised``) for
    bf16 operands of these sizes, under the product form ``form``."""
    args = [jax.ShapeDtypeStruct(s, d) for s, d in [((T, Hi, Di), jnp.bfloat16),
            ((T, Hi), jnp.float32), ((R, Di), jnp.bfloat16), ((R,), jnp.float32),
            ((T,), jnp.int32)]]
    run = jax.jit(lambda *a: reference.indexer_topk_reference(*a, topk=topk, compress_ratio=1))
    with cpu_products.forced(cpu_products.parse_form(form)):
        text = run.lower(*args).compile().as_text()
    return _materialised(text, f"{R},{Di}")


@pytest.mark.parametrize("form", [pytest.param("native", marks=pytest.mark.slow), "f32"])
def test_no_f32_copy_of_the_key_cache_in_a_whole_rows_prefill(form):
    # The whole-rows form scores the stream's pieces, each in its cond: scored outside one,
    # XLA:CPU carried an f32 copy of the whole cache through the piece loop in both forms.
    T, Hi, Di, R, topk = 64, 4, 64, 8192, 256
    assert isinstance(reference.cpu_selection(T, Hi, R, topk)[0], reference.RowsPlan)
    copies = _f32_key_cache_copies(T, Hi, Di, R, topk, form)
    assert not copies, copies


def test_streamed_scores_alone_give_each_tokens_best_score(rng):
    # The bench's measure of the selection's share (bench/indexer.py, scores_alone_fn): the
    # same streaming with no selection. Each token's kept score is its best valid score.
    T, Hi, Di, R, topk = 21, 4, 16, 300, 24
    q, w, k, ks = _inputs(rng, T, Hi, Di, R)
    positions = jnp.asarray(np.concatenate([rng.integers(0, R, T - 1), [-5]]), jnp.int32)
    _, best = jax.jit(lambda *a: reference.streamed_scores_alone(
        *a, topk=topk, compress_ratio=1))(q, w, k, ks, positions)
    best = np.asarray(best)
    assert (best == best[:, :1]).all()  # one score per token, broadcast to topk slots
    s, bound = scores_f64(q, w, k, scale=1.0)
    valid = valid_rows(positions, R)
    for t in range(T):
        if not valid[t].any():
            assert best[t, 0] == -np.inf
            continue
        r = np.flatnonzero(valid[t])
        top = r[np.argmax(s[t, r])]
        assert abs(best[t, 0] - s[t, top]) <= bound[t, top] + np.max(bound[t, r]), t


# --- the form on GPU and TPU: merges by top_k, few large steps ---------------------------------


MERGE_PLANS = [None, reference.ChunkPlan(1, 16, 0, 16), reference.ChunkPlan(4, 32, 0, 32),
               reference.ChunkPlan(16, 48, 0, 48)]


def _exact_with_ties_nan_and_garbage(rng, T, ratio, select, plans):
    """``select(topk, ratio, plan)`` (a reference form) for each plan at topk 24 of 300 rows and
    350 (beyond the rows: -1 padding): row 3 scores NaN for every token, rows 7, 130 and 250 tie
    exactly (across blocks), the rows past every token's limit hold NaN and inf. Each plan's
    selection is checked against float64, its ties in row order, and unchanged by the garbage.
    Returns ``{topk: [(idx, scores) per plan]}`` and the case's operands."""
    Hi, Di, R = 4, 16, 300
    q, w, k, ks = _inputs(rng, T, Hi, Di, R)
    positions = jnp.asarray(np.concatenate([rng.integers(0, 250 * ratio, T - 2), [-5, 40]]),
                            jnp.int32)
    k = k.at[3].set(jnp.nan)
    dirty = k.at[250:].set(jnp.nan).at[260].set(jnp.inf)
    s, bound = scores_f64(q, w, k, scale=1.0)
    valid = valid_rows(positions, R, ratio)
    results = {}
    for topk in (24, 350):
        results[topk] = []
        for plan in plans:
            run = jax.jit(lambda *a, plan=plan: select(*a, topk=topk, compress_ratio=ratio,
                                                       plan=plan))
            idx, scores = (np.asarray(x) for x in run(q, w, k, ks, positions))
            check_selection(idx, scores, s, bound, valid, topk)
            for t in range(T):  # the tied rows in row order, the lower ones kept
                tied = [r for r in (7, 130, 250) if valid[t, r]]
                kept = [r for r in idx[t] if r in tied]
                assert kept == tied[: len(kept)], (t, kept)
            for a, b in zip((idx, scores), run(q, w, dirty, ks, positions)):
                np.testing.assert_array_equal(a, np.asarray(b))
            results[topk].append((idx, scores))
    return results, (q, w, k, ks, positions)


@pytest.mark.slow
@pytest.mark.parametrize("ratio", [1, RATIO_4])
def test_merging_form_is_exact_with_ties_nan_and_garbage(rng, ratio):
    results, operands = _exact_with_ties_nan_and_garbage(
        rng, 21, ratio, reference.indexer_topk_by_merging, MERGE_PLANS)
    for topk, per_plan in results.items():
        # The streaming form's selection from the same scores: the same rows, ties included.
        stream = [np.asarray(x) for x in jax.jit(lambda *a: reference.indexer_topk_reference(
            *a, topk=topk, compress_ratio=ratio))(*operands)]
        # (Elsewhere each plan's products may round differently: each is exact on its own.)
        if cpu_products.shape_invariant(cpu_products.cpu_form()):
            for idx, scores in per_plan:
                np.testing.assert_array_equal(idx, stream[0])
                np.testing.assert_array_equal(scores, stream[1])


# A small call is selected whole (no loop); PLANS[1] forces the streaming selection.
@pytest.mark.parametrize("ratio", [1, RATIO_4])
def test_whole_selection_is_exact_with_ties_nan_and_garbage(rng, ratio):
    T = 13
    assert all(reference.whole_plan(T, 4, 300, topk) is not None for topk in (24, 350))
    results, _ = _exact_with_ties_nan_and_garbage(
        rng, T, ratio, reference.indexer_topk_reference, (None, PLANS[1]))
    if cpu_products.shape_invariant(cpu_products.cpu_form()):
        for whole, streamed in results.values():
            for a, b in zip(whole, streamed):
                np.testing.assert_array_equal(a, b)


def test_whole_selection_compiles_no_loop_and_stops_at_its_bounds():
    text = jax.jit(lambda *a: reference.indexer_topk_reference(*a, topk=8, compress_ratio=1)).lower(
        jnp.zeros((16, 4, 16), jnp.bfloat16), jnp.ones((16, 4)), jnp.zeros((1000, 16), jnp.bfloat16),
        jnp.ones((1000,)), jnp.arange(16)).compile().as_text()
    assert " while(" not in text and " sort(" in text
    plan = reference.whole_plan
    assert plan(1, 4, reference.WHOLE_ROWS, 8) is not None
    assert plan(1, 4, reference.WHOLE_ROWS + 1, 8) is None  # rows round up to 16
    assert plan(reference.WHOLE_PAIRS // 256, 4, 256, 128) is not None
    assert plan(reference.WHOLE_PAIRS // 256 + 1, 4, 256, 128) is None
    # Beyond WHOLE_ANY_PAIRS only few rows: at most WHOLE_FEW_ROWS, or 2 topk.
    few = reference.WHOLE_FEW_ROWS
    assert plan(reference.WHOLE_PAIRS // few, 4, few, 8) is not None
    assert plan(reference.WHOLE_ANY_PAIRS // (2 * few) + 1, 4, 2 * few, few - 1) is None
    assert plan(reference.WHOLE_ANY_PAIRS // (2 * few) + 1, 4, 2 * few, few) is not None
    # The products [T, Hi, R] f32 within CHUNK_BYTES: 64 heads take fewer pairs.
    assert plan(64, 64, 256, 128) is not None
    assert plan(128, 64, 256, 128) is None


@pytest.mark.parametrize("plan", [None, PLANS[1], reference.RowsPlan(5, 48, 256, 48)])
def test_sequences_with_own_caches_read_only_their_rows(rng, plan):
    # The primitive's call over S sequences' caches (vmap), selected whole, streamed and by whole
    # rows: each
    # sequence's rows past its tokens' positions are NaN, so a read of another's would show.
    S, T, Hi, Di, R, topk = 3, 5, 4, 16, 100, 12
    q = jnp.asarray(rng.standard_normal((S * T, Hi, Di)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((S * T, Hi)), jnp.float32)
    positions = rng.integers(-1, R - 10, S * T)
    k = rng.standard_normal((S, R, Di))
    last = positions.reshape(S, T).max(-1)
    k[np.arange(R)[None, :] > last[:, None]] = np.nan
    k = jnp.asarray(k, jnp.bfloat16)
    ks = jnp.asarray(rng.uniform(0.5, 2.0, (S, R)), jnp.float32)
    idx, scores = jax.jit(lambda *a: reference.indexer_topk_over_sequences(
        *a, topk=topk, compress_ratio=1, plan=plan))(
        q.reshape(S, T, Hi, Di), w.reshape(S, T, Hi), k, ks,
        jnp.asarray(positions, jnp.int32).reshape(S, T))
    assert idx.shape == scores.shape == (S, T, topk)
    for i in range(S):
        part = slice(i * T, (i + 1) * T)
        s, bound = scores_f64(q[part], w[part], k[i], ks[i], scale=1.0)
        check_selection(idx[i], scores[i], s, bound, valid_rows(positions[part], R), topk)


def test_merging_form_breaks_exact_ties_by_row_across_blocks(rng):
    # Every row's key is one of three: ties within a block and across blocks, the running best
    # set full of them before later blocks arrive.
    T, Hi, Di, R, topk = 6, 2, 16, 400, 50
    q = jnp.asarray(rng.standard_normal((T, Hi, Di)), jnp.bfloat16)
    w = jnp.abs(jnp.asarray(rng.standard_normal((T, Hi)), jnp.float32))
    three = jnp.asarray(rng.standard_normal((3, Di)), jnp.bfloat16)
    k = three[jnp.asarray(rng.integers(0, 3, R))]
    positions = jnp.asarray(rng.integers(100, R, T), jnp.int32)
    s, _ = scores_f64(q, w, k, scale=1.0)
    want = topk_f64(s, valid_rows(positions, R), topk)
    for plan in MERGE_PLANS:
        idx, _ = jax.jit(lambda *a, plan=plan: reference.indexer_topk_by_merging(
            *a, topk=topk, compress_ratio=1, plan=plan))(q, w, k, jnp.ones((R,)), positions)
        np.testing.assert_array_equal(np.asarray(idx), want)


def test_candidate_lists_merge_alike_by_top_k_and_by_sorting(rng):
    # The merge of selections over disjoint row ranges (row-sharded caches, the Flax layer's
    # decode step): GPUs and TPUs take lax.top_k, CPUs the sort. Scores of three values (ties
    # within and across the lists), NaN, -inf and empty slots; the lists in row order.
    from jax_sparse_attn.indexer import sharding

    T, n, topk = 7, 40, 24
    values = np.array([0.5, -1.0, 2.0, np.nan, -np.inf], np.float32)
    scores = values[rng.integers(0, 5, (T, 2 * n))]
    rows = np.concatenate([np.sort(rng.choice(100, (T, n)), 1),  # rows 0..99, then 100..199
                           100 + np.sort(rng.choice(100, (T, n)), 1)], 1).astype(np.int32)
    rows[:, n - 5:n] = -1  # empty slots
    keys = np.where(rows >= 0, np.asarray(reference.order_keys(jnp.asarray(scores))),
                    reference.INVALID_KEY)
    by_top_k = sharding.best_by_top_k(jnp.asarray(keys), jnp.asarray(rows), topk)
    by_sorting = reference.best_first(jnp.stack([jnp.asarray(keys), jnp.asarray(rows)], -1), topk)
    for a, b in zip(by_top_k, by_sorting):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Against numpy: best score first (NaN below -inf, empty slots last), then the lower row.
    rank = np.where(rows < 0, 3, np.where(np.isnan(scores), 2, 0))
    for t in range(T):
        order = np.lexsort((rows[t], -np.nan_to_num(scores[t], nan=0.0), rank[t]))[:topk]
        want = np.where(rows[t, order] < 0, -1, rows[t, order])
        got = np.asarray(by_top_k[1])[t]
        np.testing.assert_array_equal(np.where(np.asarray(by_top_k[0])[t] == reference.INVALID_KEY,
                                               -1, got), want)


def _lowered_for(platform, fn, *args):
    jitted = jax.jit(fn)
    if hasattr(jitted, "trace"):
        return jitted.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    return jax.export.export(jitted, platforms=(platform,))(*args).mlir_module()  # older JAX


@pytest.mark.parametrize("T, R", [(8192, 8192), (1, 2**20)])
def test_accelerators_merge_in_few_steps_and_cpus_stream(T, R):
    # DeepSeek V3.2's indexer (Hi = 64, Di = 128, K = 2048): a prefill and a decode step.
    Hi, Di, topk = 64, 128, 2048
    args = (jax.ShapeDtypeStruct((T, Hi, Di), jnp.bfloat16),
            jax.ShapeDtypeStruct((T, Hi), jnp.float32),
            jax.ShapeDtypeStruct((R, Di), jnp.bfloat16), jax.ShapeDtypeStruct((R,), jnp.float32),
            jax.ShapeDtypeStruct((T,), jnp.int32))
    fn = lambda *a: reference.indexer_topk_reference(*a, topk=topk, compress_ratio=1)
    gpu, cpu = _lowered_for("cuda", fn, *args), _lowered_for("cpu", fn, *args)
    plan = reference.accelerator_plan(T, Hi, R, topk)
    assert "chlo.top_k" in gpu and "chlo.top_k" not in cpu
    # No data-dependent loop on the GPU: the chunk loop (a decode step has none) and the blocks'.
    assert gpu.count("stablehlo.while") == (1 if T == plan.tokens else 2)
    assert "stablehlo.sort" not in gpu and "stablehlo.sort" in cpu
    assert cpu.count("stablehlo.while") > gpu.count("stablehlo.while")


def test_accelerator_plan_fills_its_budget_in_square_prefill_tiles():
    budget = 17 * 2**30  # an eighth of an H200's 141 GiB
    Hi, topk = 64, 2048
    prefill = reference.accelerator_plan(8192, Hi, 8192, topk, budget)
    assert prefill.tokens == prefill.rows == 8192 // reference.ACCELERATOR_TOKEN_CHUNKS
    decode = reference.accelerator_plan(1, Hi, 2**20, topk, budget)
    assert decode.tokens == 1 and decode.rows == 2**20  # the whole cache in one step
    small = reference.accelerator_plan(1, Hi, 2**20, topk, 2**28)  # a 2 GiB device
    assert small.rows % reference.BLOCK_ALIGN == 0 and small.rows < 2**20
    assert 4 * (Hi + 4) * small.rows + 24 * (topk + small.rows) <= 2**28
    tight = reference.accelerator_plan(65536, Hi, 65536, topk, 2**30)
    assert tight.tokens * (4 * (Hi + 4) * tight.rows + 24 * (topk + tight.rows)) <= 2**30
