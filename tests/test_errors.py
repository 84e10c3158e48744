"""Bad arguments fail at trace time, naming the argument and the shapes or dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_attn as jsa

q = jnp.zeros((4, 2, 8), jnp.bfloat16)
kv = jnp.zeros((10, 8), jnp.bfloat16)
idx = jnp.zeros((4, 3), jnp.int32)
g = jnp.zeros((4, 3, 8), jnp.bfloat16)


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda: jsa.gathered_attn_idx(q[0], kv, idx), ValueError, r"q must have rank 3 .*\(2, 8\)"),
        (lambda: jsa.gathered_attn_idx(q, kv[None], idx), ValueError, r"kv must have rank 2 .*\(1, 10, 8\)"),
        (lambda: jsa.gathered_attn_idx(q, kv, idx[0]), ValueError, r"idx must have rank 2 .*\(3,\)"),
        (lambda: jsa.gathered_attn_idx(q, kv[:, :4], idx), ValueError, r"kv must have shape .*\(R, 8\).*\(10, 4\)"),
        (lambda: jsa.gathered_attn_idx(q, kv, idx[:3]), ValueError, r"idx must have shape .*\(4, K\).*\(3, 3\)"),
        (lambda: jsa.gathered_attn_idx(q, kv, idx.astype(jnp.float32)), TypeError, r"idx must have an integer dtype; got float32"),
        (lambda: jsa.gathered_attn_idx(q, kv, idx.astype(bool)), TypeError, r"idx must have an integer dtype; got bool"),
        (lambda: jsa.gathered_attn_idx(q.astype(jnp.int32), kv, idx), TypeError, r"q must be a floating dtype.*int32"),
        (lambda: jsa.gathered_attn_idx(q, kv.astype(jnp.int8), idx), TypeError, r"kv must be a floating dtype.*int8"),
        (lambda: jsa.gathered_attn_idx(q, kv, idx, jnp.zeros(3)), ValueError, r"sink must have shape \[H\] = \(2,\).*\(3,\)"),
        (lambda: jsa.gathered_attn_idx(q, kv, idx, jnp.zeros((1, 2))), ValueError, r"sink must have shape .*\(1, 2\)"),
        (lambda: jsa.gathered_attn_idx(q, kv, idx, jnp.zeros(2, jnp.int32)), TypeError, r"sink must be a floating dtype"),
        (lambda: jsa.gathered_attn_idx(q, kv, idx, bias=jnp.zeros((4, 4))), ValueError, r"bias must have shape \[T, K\] = \(4, 3\).*\(4, 4\)"),
        (lambda: jsa.gathered_attn_idx(q, kv, idx, scale=jnp.ones(2)), ValueError, r"scale must be a scalar.*\(2,\)"),
        (lambda: jsa.gathered_attn_idx(q, kv, idx, implementation="cuda"), ValueError, r"implementation must be one of .*'cuda'"),
        (lambda: jsa.gathered_attn_idx(q[:, :, :0], kv[:, :0], idx), ValueError, r"D = 0"),
        (lambda: jsa.gathered_attn(q, g[:, :, :4]), ValueError, r"g must have shape \[T, K, D\] = \(4, K, 8\).*\(4, 3, 4\)"),
        (lambda: jsa.gathered_attn(q, g[:2]), ValueError, r"g must have shape .*\(2, 3, 8\)"),
        (lambda: jsa.gathered_attn(q, g[0]), ValueError, r"g must have rank 3"),
        (lambda: jsa.gathered_attn(q, g.astype(jnp.int32)), TypeError, r"g must be a floating dtype"),
        (lambda: jsa.gathered_attn(q, g, bias=jnp.zeros((3, 4))), ValueError, r"bias must have shape .*\(4, 3\).*\(3, 4\)"),
        (lambda: jsa.gathered_attn(q, g, implementation="fast"), ValueError, r"implementation must be one of"),
    ],
)
def test_bad_arguments(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_errors_are_raised_at_trace_time():
    with pytest.raises(ValueError, match="sink must have shape"):
        jax.jit(jsa.gathered_attn_idx).lower(q, kv, idx, jnp.zeros(5))
    with pytest.raises(ValueError, match="kv must have shape"):
        jax.eval_shape(jsa.gathered_attn_idx, q, jnp.zeros((10, 3), jnp.bfloat16), idx)
