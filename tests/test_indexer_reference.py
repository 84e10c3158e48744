"""The indexer reference's streaming selection: bit-identical results whatever the token chunk,
row block and buffer sizes (the selection is exact, and each score's arithmetic does not depend
on them), its pieces against numpy, and a compiled program that holds nothing of size [T, R]."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from indexer_oracle import check_selection, scores_f64, valid_rows
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


@pytest.mark.parametrize("ratio", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_bit_identical_across_chunk_plans(rng, ratio):
    T, Hi, Di, R, topk = 21, 4, 16, 300, 24
    q, w, k, ks = _inputs(rng, T, Hi, Di, R)
    positions = jnp.asarray(np.concatenate([rng.integers(0, R * ratio, T - 2), [-5, 10**9]]),
                            jnp.int32)
    results = []
    for plan in [None] + PLANS:
        run = jax.jit(lambda *a, plan=plan: reference.indexer_topk_reference(
            *a, topk=topk, compress_ratio=ratio, plan=plan))
        results.append([np.asarray(x) for x in run(q, w, k, ks, positions)])
    s, bound = scores_f64(q, w, k, scale=1.0)  # the reference takes the scale folded into w
    for idx, scores in results[1:]:
        if cpu_products.products_by_eigen():
            # XLA:CPU's Eigen kernels (jax 0.7) may sum a product in another order for another
            # block shape (docs/indexer.md, "Determinism"): each plan is still exact on its scores.
            check_selection(idx, scores, s, bound, valid_rows(positions, R, ratio), topk)
            np.testing.assert_array_max_ulp(scores, results[0][1], maxulp=4)
            continue
        np.testing.assert_array_equal(idx, results[0][0])
        np.testing.assert_array_equal(scores, results[0][1])
    check_selection(*results[0], s, bound, valid_rows(positions, R, ratio), topk)


def test_order_keys_are_monotone_and_invertible():
    x = np.array([-np.inf, -3e38, -1.5, -1e-37, -0.0, 0.0, 1e-37, 2.0, 3e38, np.inf, np.nan],
                 np.float32)
    keys = np.asarray(reference.order_keys(jnp.asarray(x)))
    assert np.all(np.diff(keys[:4]) > 0) and keys[4] == keys[5] and np.all(np.diff(keys[5:10]) > 0)
    assert keys[-1] == reference.NAN_KEY and keys[-1] < keys[0] and keys[-1] > reference.INVALID_KEY
    back = np.asarray(reference.scores_of_keys(jnp.asarray(keys)))
    np.testing.assert_array_equal(back[:-1], np.where(x[:-1] == 0, np.float32(0), x[:-1]))
    assert np.isnan(back[-1])


@pytest.mark.parametrize("M", [1, 2, 5, 300, 4096])
def test_sort_best_first_against_numpy(rng, M):
    keys = rng.integers(-20, 20, (6, M)).astype(np.int32)  # many ties
    keys[0] = rng.integers(-(2**31), 2**31 - 1, M)
    rows = np.broadcast_to(np.arange(M, dtype=np.int32) * 3, keys.shape)
    got_k, got_r = (np.asarray(a) for a in reference.sort_best_first(jnp.asarray(keys),
                                                                      jnp.asarray(rows)))
    order = np.lexsort((np.arange(M)[None].repeat(6, 0), -keys.astype(np.int64)), axis=1)
    np.testing.assert_array_equal(got_k, np.take_along_axis(keys, order, 1))
    np.testing.assert_array_equal(got_r, np.take_along_axis(rows, order, 1))


def test_nothing_of_size_tokens_by_rows_is_built(rng):
    T, Hi, Di, topk = 64, 4, 16, 32
    R = 4 * reference.MAX_BLOCK_ROWS
    args = [jax.ShapeDtypeStruct(s, d) for s, d in [((T, Hi, Di), jnp.bfloat16),
            ((T, Hi), jnp.float32), ((R, Di), jnp.bfloat16), ((R,), jnp.float32),
            ((T,), jnp.int32)]]
    run = jax.jit(lambda *a: reference.indexer_topk_reference(*a, topk=topk, compress_ratio=1))
    text = run.lower(*args).compile().as_text()
    shapes = set(re.findall(r"\[([0-9,]+)\]", text))
    with_rows = {s for s in shapes if str(R) in s.split(",")}
    assert with_rows == {f"{R},{Di}", f"{R}"}, with_rows  # the operands themselves, nothing more
