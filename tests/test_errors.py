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


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda: jsa.gathered_attn_idx(q, kv, idx, scale="0.1"), r"scale must be a real number.*str"),
        (lambda: jsa.gathered_attn_idx(q, kv, idx, scale=b"1"), r"scale must be a real number"),
        (lambda: jsa.gathered_attn_idx(q, kv, idx, scale=[0.1]), r"scale must be a real number.*list"),
        (lambda: jsa.gathered_attn_idx(q, kv, idx, scale=jnp.ones((), jnp.complex64)), r"scale must be a real number.*complex64"),
        (lambda: jsa.gathered_attn_idx([[["a"]]], kv, idx), r"q must be an array of numbers.*list"),
        (lambda: jsa.gathered_attn_idx(q, [[1.0, 2.0], [3.0]], idx), r"kv must be an array"),
        (lambda: jsa.gathered_attn_idx(q, kv, [[0, 1], "ab"]), r"idx must be an array"),
        (lambda: jsa.gathered_attn_idx(q, kv, idx, ("a", "b")), r"sink must be an array of numbers"),
        (lambda: jsa.gathered_attn_idx(q, kv, idx, bias=[[None]]), r"bias must be an array of numbers"),
        (lambda: jsa.gathered_attn([[[1.0]]], [["x"]]), r"g must be an array of numbers"),
    ],
)
def test_bad_python_values_name_the_argument(call, pattern):
    with pytest.raises(TypeError, match=pattern):
        call()


def test_python_lists_and_tuples_are_accepted_as_arrays():
    rng = np.random.default_rng(0)
    qn = rng.standard_normal((2, 3, 4)).astype(np.float32)
    kvn = rng.standard_normal((5, 4)).astype(np.float32)
    idxn = np.array([[0, 4, -1], [2, 2, 7]])
    sinkn = np.array([0.0, -1.0, 0.5], np.float32)
    biasn = np.array([[0.0, -np.inf, 1.0], [0.5, 0.0, 0.0]], np.float32)
    want = jsa.gathered_attn_idx(qn, kvn, idxn, sinkn, bias=biasn)
    got = jsa.gathered_attn_idx(qn.tolist(), kvn.tolist(), idxn.tolist(), tuple(sinkn.tolist()), bias=biasn.tolist())
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    gn = kvn[np.clip(idxn, 0, 4)]
    want_g = jsa.gathered_attn(qn, gn, sinkn)
    got_g = jsa.gathered_attn(qn.tolist(), gn.tolist(), sinkn.tolist())
    np.testing.assert_array_equal(np.asarray(got_g), np.asarray(want_g))
    # a list index beyond int32 is an empty slot, as a numpy int64 index is
    wide = jsa.gathered_attn_idx(qn, kvn, [[0, 2**32 + 4, -1], [2, 2, 7]])
    np.testing.assert_array_equal(np.asarray(wide), np.asarray(jsa.gathered_attn_idx(qn, kvn, [[0, -1, -1], [2, 2, -1]])))


def test_a_bind_of_no_known_layout_is_an_error():
    # The primitives' rules name their operands by the bind's static layout: operands that do not
    # match it (a bind this package never makes), or a layout of parts without their cache, fail
    # loudly rather than being read under other names.
    from jax_sparse_attn.attention import primitive

    assert primitive.Layout().names == ("q", "kv", "idx", "sink", "bias", "scale")
    assert primitive.Layout(fp8=True, extra=True).names[-3:] == ("extra_kv", "extra_idx",
                                                                  "extra_bias")
    assert primitive.PREGATHERED.names == ("q", "g", "sink", "bias", "scale")
    with pytest.raises(ValueError, match="has 6 operands"):
        primitive.Layout().unflatten((1, 2, 3, 4, 5))
    for flags, message in ((dict(split=True), "split needs fp8"),
                           (dict(extra_fp8=True), "extra_fp8 needs extra"),
                           (dict(indexed=False, fp8=True), "take no cache")):
        with pytest.raises(ValueError, match=message):
            primitive.Layout(**flags)
