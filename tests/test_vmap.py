"""The vmap rule: batch axes at any position, unbatched operands, per-sequence caches, nesting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_attn as jsa
from oracle import attention_f64, gather, invalid_indices

T, H, D, R, K, B = 3, 2, 8, 10, 5, 4


@pytest.fixture
def batch(rng):
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    kv = rng.standard_normal((B, R, D)).astype(np.float32)
    idx = rng.integers(0, R, (B, T, K))
    idx[rng.random(idx.shape) < 0.3] = -1
    idx[0, 1, :] = rng.choice(invalid_indices(R), K)  # a token with no valid slot
    sink = rng.standard_normal((B, H)).astype(np.float32)
    bias = rng.standard_normal((B, T, K)).astype(np.float32)
    return q, kv, idx, sink, bias


def expected(q, kv, idx, sink, bias):
    """Per-element oracle; arguments are per-batch-element (already indexed)."""
    x, valid = gather(kv, idx)
    return attention_f64(q, x, valid, sink, bias)


def check(out, q, kv, idx, sink, bias, axes):
    """``axes``: for each operand, True if it carries the batch axis (at 0) in the inputs."""
    for b in range(B):
        args = [a[b] if batched else a for a, batched in zip((q, kv, idx, sink, bias), axes)]
        np.testing.assert_allclose(np.asarray(out[b]), expected(*args), rtol=2e-5, atol=2e-6)


AXES_CASES = [
    (0, 0, 0, None, None),
    (0, None, 0, None, None),  # one shared cache
    (None, 0, 0, None, None),  # shared queries, per-sequence caches
    (0, 0, None, None, None),  # shared indices
    (None, 0, None, None, None),  # only the cache batched
    (0, None, None, None, 0),
    (0, 0, 0, None, 0),
    (0, 0, 0, 0, 0),  # per-batch sinks
    (None, None, None, 0, None),
]


@pytest.mark.parametrize("in_axes", AXES_CASES)
def test_gathered_attn_idx_in_axes(batch, in_axes):
    q, kv, idx, sink, bias = batch
    args = [a if ax is not None else a[0] for a, ax in zip(batch, in_axes)]
    fn = lambda q, kv, idx, sink, bias: jsa.gathered_attn_idx(q, kv, idx, sink, bias=bias)
    out = jax.vmap(fn, in_axes=in_axes)(*args)
    assert out.shape == (B, T, H, D)
    check(out, *args, [ax is not None for ax in in_axes])


@pytest.mark.parametrize("position", [1, 2, -1])
def test_batch_axis_at_any_position(batch, position):
    q, kv, idx, sink, bias = batch
    moved = [np.moveaxis(a, 0, position) for a in (q, kv, idx, bias)]
    fn = lambda q, kv, idx, bias: jsa.gathered_attn_idx(q, kv, idx, sink[0], bias=bias)
    out = jax.vmap(fn, in_axes=position, out_axes=0)(*moved)
    check(out, q, kv, idx, sink[0], bias, [True, True, True, False, True])


def test_gathered_form_in_axes(batch):
    q, kv, idx, sink, bias = batch
    x = np.stack([gather(kv[b], idx[b])[0] for b in range(B)])
    valid = np.stack([gather(kv[b], idx[b])[1] for b in range(B)])
    bias = np.where(valid, bias, -np.inf).astype(np.float32)
    out = jax.vmap(lambda q, g, b: jsa.gathered_attn(q, g, sink[1], bias=b), in_axes=(None, 1, 0))(
        q[0], np.moveaxis(x, 0, 1), bias
    )
    for b in range(B):
        want = attention_f64(q[0], x[b], np.ones_like(valid[b]), sink[1], bias[b])
        np.testing.assert_allclose(np.asarray(out[b]), want, rtol=2e-5, atol=2e-6)


def test_per_sequence_cache_keeps_empty_slots_empty(batch):
    """Offsetting by b * R must not turn -1 of sequence 1 into row R - 1 of sequence 0."""
    q, kv, idx, sink, bias = batch
    idx = idx.copy()
    idx[1:, :, 0] = -1
    idx[1:, :, 1] = R  # would be row 0 of the next sequence after naive offsetting
    out = jax.vmap(jsa.gathered_attn_idx)(q, kv, idx)
    check(out, q, kv, idx, None, None, [True, True, True, False, False])


def test_nested_vmap(rng):
    q = rng.standard_normal((2, 3, T, H, D)).astype(np.float32)
    kv = rng.standard_normal((2, R, D)).astype(np.float32)
    idx = rng.integers(-2, R + 2, (3, T, K))
    f = jax.vmap(jax.vmap(jsa.gathered_attn_idx, in_axes=(0, None, 0)), in_axes=(0, 0, None))
    out = f(q, kv, idx)
    for a in range(2):
        for b in range(3):
            np.testing.assert_allclose(
                np.asarray(out[a, b]), expected(q[a, b], kv[a], idx[b], None, None), rtol=2e-5, atol=2e-6
            )


def test_jit_of_vmap_and_vmap_of_jit(batch):
    q, kv, idx, sink, bias = batch
    a = jax.jit(jax.vmap(jsa.gathered_attn_idx))(q, kv, idx, sink)
    b = jax.vmap(jax.jit(jsa.gathered_attn_idx))(q, kv, idx, sink)
    check(a, q, kv, idx, sink, None, [True] * 4 + [False])
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_vmap_over_scale(batch):
    q, kv, idx, sink, bias = batch
    scales = jnp.array([0.1, 0.5, 1.0, 2.0], jnp.float32)
    out = jax.vmap(lambda s: jsa.gathered_attn_idx(q[0], kv[0], idx[0], scale=s))(scales)
    for b in range(B):
        x, valid = gather(kv[0], idx[0])
        want = attention_f64(q[0], x, valid, None, None, scale=float(scales[b]))
        np.testing.assert_allclose(np.asarray(out[b]), want, rtol=2e-5, atol=2e-6)


def test_vmap_zero_tokens(rng):
    q = np.zeros((2, 0, H, D), np.float32)
    kv = rng.standard_normal((2, R, D)).astype(np.float32)
    out = jax.vmap(jsa.gathered_attn_idx)(q, kv, np.zeros((2, 0, K), np.int32))
    assert out.shape == (2, 0, H, D)
