"""The DeepSeek-shaped arguments: ``topk_length``, ``value_dim`` and a second cache (``extra_kv``).

Every result is held to the float64 oracles of ``tests/oracle.py`` (or to the single-cache call on
the concatenation, bit for bit, where the contract says so); rows that no real slot selects hold
NaN, so any read of them would show.
"""

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
    assert within_one_ulp(np.asarray(out), attention_bf16_contract(q, x, valid, sink)) == 1.0
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

    dq, dkv = jax.grad(loss, argnums=(0, 1))(q, kv)
    assert not np.asarray(dkv[20:]).any()  # never selected
    assert np.asarray(dkv[:20], np.float32).any()
    # The same gradient as the call with the tail slots set to -1 (the index rewrite it replaces).
    rewritten = np.where(np.arange(20)[None, :] < lengths[:, None], idx, -1)
    dq2, dkv2 = jax.grad(
        lambda q, kv: jnp.sum(jsa.gathered_attn_idx(q, kv, rewritten, sink).astype(jnp.float32) ** 2),
        argnums=(0, 1))(q, kv)
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
