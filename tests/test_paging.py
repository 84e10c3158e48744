"""paged_indices against a plain numpy loop over the vLLM mapping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_attn import gathered_attn_idx, paged_indices
from oracle import attention_f64, gather


def paged_oracle(idx, table, block_size):
    """``table[i // bs] * bs + i % bs`` entry by entry; -1 for every index that names no row."""
    idx = np.asarray(idx, np.int64)
    table = np.asarray(table, np.int64)
    out = np.full(idx.shape, -1, np.int64)
    for pos, i in np.ndenumerate(idx):
        if i < 0 or i // block_size >= len(table):
            continue
        page = table[i // block_size]
        if page < 0 or page * block_size + block_size - 1 > 2**31 - 1:
            continue
        out[pos] = page * block_size + i % block_size
    return out


def test_matches_the_mapping_with_every_empty_case(rng):
    block_size, pages = 16, 7
    table = rng.permutation(40)[:pages].astype(np.int32)
    table[3] = -1  # an unallocated page
    idx = rng.integers(-3, pages * block_size + 20, size=(5, 33)).astype(np.int32)
    idx[0, :4] = [-1, pages * block_size, 3 * block_size + 2, 2**31 - 1]
    got = np.asarray(paged_indices(idx, table, block_size))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, paged_oracle(idx, table, block_size))
    assert got[0, 0] == -1 and got[0, 1] == -1 and got[0, 2] == -1 and got[0, 3] == -1


def test_jit_int64_host_indices_and_huge_pages():
    table = np.array([2, 2**30, 5], np.int64)  # page 2**30 * 8 overflows int32: empty
    idx = np.array([[0, 9, 17, 2**33 + 1, -5]], np.int64)
    want = paged_oracle(idx, table, 8)
    np.testing.assert_array_equal(np.asarray(paged_indices(idx, table, 8)), want)
    jitted = jax.jit(paged_indices, static_argnums=2)
    np.testing.assert_array_equal(
        np.asarray(jitted(jnp.asarray(idx[:, :3], jnp.int32), jnp.asarray(table, jnp.int32), 8)),
        want[:, :3],
    )
    assert want.tolist() == [[16, -1, 41, -1, -1]]


def test_batched_tables_under_vmap(rng):
    B, block_size = 3, 4
    tables = rng.integers(-1, 20, size=(B, 5)).astype(np.int32)
    idx = rng.integers(-1, 24, size=(B, 2, 6)).astype(np.int32)
    got = jax.vmap(lambda i, t: paged_indices(i, t, block_size))(idx, tables)
    for b in range(B):
        np.testing.assert_array_equal(np.asarray(got[b]), paged_oracle(idx[b], tables[b], block_size))


def test_empty_table_and_bad_arguments():
    np.testing.assert_array_equal(
        np.asarray(paged_indices(np.array([[0, 3]]), np.zeros((0,), np.int32), 4)), [[-1, -1]])
    with pytest.raises(ValueError, match="block_size"):
        paged_indices(np.array([[0]]), np.array([0]), 0)
    with pytest.raises(TypeError, match="block_size"):
        paged_indices(np.array([[0]]), np.array([0]), 4.0)
    with pytest.raises(TypeError, match="block_table"):
        paged_indices(np.array([[0]]), np.array([0.5]), 4)
    with pytest.raises(TypeError, match="idx"):
        paged_indices(np.array([[0.5]]), np.array([0]), 4)
    with pytest.raises(ValueError, match="block_table must have rank 1"):
        paged_indices(np.array([[0]]), np.zeros((2, 3), np.int32), 4)


def test_paged_decode_attends_to_the_sequence_rows(rng):
    """A paged pool with NaN in every page no sequence owns: the result equals attention over the
    logical rows (float64 oracle)."""
    T, H, D, block_size = 2, 4, 32, 8
    pool = rng.standard_normal((10 * block_size, D)).astype(np.float32)
    table = np.array([7, 2, 5], np.int32)
    owned = np.zeros(len(pool), bool)
    for p in table:
        owned[p * block_size:(p + 1) * block_size] = True
    pool[~owned] = np.nan
    logical = np.concatenate([pool[p * block_size:(p + 1) * block_size] for p in table])
    idx = rng.integers(-1, len(logical) + 3, size=(T, 12)).astype(np.int32)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    out = gathered_attn_idx(q, pool, paged_indices(idx, table, block_size))
    x, valid = gather(logical, idx)
    np.testing.assert_allclose(np.asarray(out), attention_f64(q, x, valid), rtol=1e-5, atol=1e-5)
