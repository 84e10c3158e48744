"""Gradients (vjp, grad, jvp, jacfwd, jacrev) against float64 finite differences of the oracle.

The oracle (``oracle.attention_f64``) is plain float64 numpy; derivatives are central differences of
it around the very f32 inputs the op receives. An input that is infinite (a ``+-inf`` sink, a
``-inf`` bias) is left unperturbed: the function is flat there, and the op must say 0.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_attn as jsa
from jax_sparse_attn import cpu_products
from jax_sparse_attn.attention import reference
from oracle import BF16, attention_f64, central_differences, gather, moved_along

T, H, D, R, K = 6, 3, 4, 6, 5
SCALE = 0.4
FLOAT_ARGS = ("q", "src", "sink", "bias", "scale")


def make_inputs(rng, form, edges):
    """f32 inputs; ``edges`` adds empty rows, sinks +-inf, masked slots, duplicates, bad indices."""
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    sink = rng.standard_normal(H).astype(np.float32)
    bias = (0.5 * rng.standard_normal((T, K))).astype(np.float32)
    if form == "idx":
        src = rng.standard_normal((R, D)).astype(np.float32)
        idx = rng.integers(0, R, (T, K)).astype(np.int32)
    else:
        src = rng.standard_normal((T, K, D)).astype(np.float32)
        idx = None
    if edges:
        sink[:2] = [np.inf, -np.inf]
        bias[1, :] = -np.inf  # a token whose slots are all masked
        bias[3, [0, 4]] = -np.inf
        if form == "idx":
            idx[0] = [-1, R, R + 3, -7, 2**31 - 1]  # a token with no valid index
            idx[2] = [3, 3, 3, 1, 1]  # duplicates count twice
            idx[4, 1] = R + 1
        else:
            bias[0, :] = -np.inf
            src[2, 1] = src[2, 0]
    return {"q": q, "src": src, "idx": idx, "sink": sink, "bias": bias, "scale": np.float32(SCALE)}


def op(form, q, src, idx, sink, bias, scale, **kw):
    if form == "idx":
        return jsa.gathered_attn_idx(q, src, idx, sink, bias=bias, scale=scale, **kw)
    return jsa.gathered_attn(q, src, sink, bias=bias, scale=scale, **kw)


def oracle(form, q, src, idx, sink, bias, scale):
    if form == "idx":
        x, valid = gather(src, idx)
    else:
        x, valid = src, np.ones(src.shape[:2], bool)
    return attention_f64(q, x, valid, sink, bias, float(scale))


def finite_difference_vjp(form, inputs, cotangent, eps=1e-6):
    """d/d(arg) of sum(oracle * cotangent) for every float argument, by central differences."""
    base = {k: (None if v is None else np.asarray(v, np.float64)) for k, v in inputs.items()}
    base["idx"] = inputs["idx"]
    return central_differences(
        lambda args: np.sum(oracle(form, **args) * cotangent), base, FLOAT_ARGS, eps
    )


def vjp_of_op(form, inputs, cotangent, **kw):
    idx = inputs["idx"]

    def f(q, src, sink, bias, scale):
        return op(form, q, src, idx, sink, bias, scale, **kw)

    def out_and_vjp(*args):  # one program: eagerly, each operation of the rules compiles alone
        out, vjp = jax.vjp(f, *args)
        return out, vjp(jnp.asarray(cotangent, out.dtype))

    out, grads = jax.jit(out_and_vjp)(*[jnp.asarray(inputs[n]) for n in FLOAT_ARGS])
    return out, dict(zip(FLOAT_ARGS, grads))


@pytest.mark.parametrize("form", ["idx", pytest.param("gathered", marks=pytest.mark.slow)])
@pytest.mark.parametrize("edges", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["random", "edges"])
def test_vjp_matches_float64_finite_differences(rng, form, edges, cpu_product_layout):
    inputs = make_inputs(rng, form, edges)
    cotangent = rng.standard_normal((T, H, D)).astype(np.float32)
    _, got = vjp_of_op(form, inputs, cotangent)
    want = finite_difference_vjp(form, inputs, cotangent)
    for name in FLOAT_ARGS:
        g = np.asarray(got[name])
        assert g.shape == np.shape(inputs[name]), name
        assert np.all(np.isfinite(g)), f"non-finite gradient for {name}"
        np.testing.assert_allclose(g, want[name], rtol=1e-4, atol=2e-5, err_msg=name)
    if edges:
        # Empty tokens and the +inf-sink head see no gradient at all.
        empty_tokens = [0, 1]
        assert np.all(np.asarray(got["q"])[empty_tokens] == 0)
        assert np.all(np.asarray(got["q"])[:, 0] == 0)
        assert np.all(np.asarray(got["bias"])[empty_tokens] == 0)


@pytest.mark.parametrize("form", ["idx", "gathered"])
def test_jvp_matches_float64_finite_differences(rng, form, cpu_product_layout):
    inputs = make_inputs(rng, form, edges=True)
    idx = inputs["idx"]
    primals = [jnp.asarray(inputs[n]) for n in FLOAT_ARGS]
    directions = [rng.standard_normal(np.shape(p)).astype(np.float32) for p in primals]

    def f(q, src, sink, bias, scale):
        return op(form, q, src, idx, sink, bias, scale)

    _, tangent = jax.jvp(f, primals, [jnp.asarray(d) for d in directions])
    eps = 1e-6
    plus, minus = moved_along(lambda args: oracle(form, **args), inputs, FLOAT_ARGS, directions,
                              eps)
    want = (plus - minus) / (2 * eps)
    assert np.all(np.isfinite(np.asarray(tangent)))
    np.testing.assert_allclose(np.asarray(tangent), want, rtol=1e-4, atol=2e-5)


@pytest.mark.slow  # several seconds: CI runs it with the slow tests
@pytest.mark.parametrize("form", ["idx", "gathered"])
def test_jacfwd_equals_jacrev(rng, form):
    inputs = make_inputs(rng, form, edges=True)
    idx = inputs["idx"]

    def f(q, src, sink):
        return op(form, q, src, idx, sink, inputs["bias"], SCALE)

    args = [jnp.asarray(inputs[n]) for n in ("q", "src", "sink")]
    forward = jax.jacfwd(f, argnums=(0, 1, 2))(*args)
    reverse = jax.jacrev(f, argnums=(0, 1, 2))(*args)
    for a, b in zip(forward, reverse):
        assert np.all(np.isfinite(np.asarray(a)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", [pytest.param("idx", marks=pytest.mark.slow), "gathered"])
def test_grad_under_jit_matches_eager(rng, form):
    inputs = make_inputs(rng, form, edges=True)
    idx = inputs["idx"]
    w = jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32)

    def loss(q, src, sink, bias):
        return jnp.sum(op(form, q, src, idx, sink, bias, SCALE) * w)

    args = [jnp.asarray(inputs[n]) for n in ("q", "src", "sink", "bias")]
    eager = jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
    jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    for a, b in zip(eager, jitted):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "cache_axis, sink_axis", [(None, None), (0, None), (None, 0)],
    ids=["shared-cache", "per-sequence-cache", "per-sequence-sink"],
)
def test_vmap_of_grad_matches_per_example_grads(rng, cache_axis, sink_axis):
    B = 3
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    kv = rng.standard_normal((B, R, D) if cache_axis == 0 else (R, D)).astype(np.float32)
    idx = rng.integers(-1, R + 1, (B, T, K)).astype(np.int32)
    sink = rng.standard_normal((B, H) if sink_axis == 0 else (H,)).astype(np.float32)
    w = rng.standard_normal((B, T, H, D)).astype(np.float32)

    def loss(q, kv, idx, sink, w):
        return jnp.sum(jsa.gathered_attn_idx(q, kv, idx, sink) * w)

    grad = jax.grad(loss, argnums=(0, 1, 3))
    in_axes = (0, cache_axis, 0, sink_axis, 0)
    batched = jax.jit(jax.vmap(grad, in_axes=in_axes))(q, kv, idx, sink, w)

    def element(a, axis, b):
        return a if axis is None else a[b]

    for b in range(B):
        inputs = {
            "q": q[b], "src": element(kv, cache_axis, b), "idx": idx[b],
            "sink": element(sink, sink_axis, b), "bias": np.zeros((T, K), np.float32),
            "scale": np.float32(D**-0.5),
        }
        want = finite_difference_vjp("idx", inputs, w[b])
        for got, name in zip(batched, ("q", "src", "sink")):
            np.testing.assert_allclose(np.asarray(got[b]), want[name], rtol=1e-4, atol=2e-5)


@pytest.mark.slow
def test_vmap_of_grad_gathered(rng):
    B = 2
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    g = rng.standard_normal((B, T, K, D)).astype(np.float32)
    sink = rng.standard_normal(H).astype(np.float32)

    def loss(q, g, sink):
        return jnp.sum(jnp.sin(jsa.gathered_attn(q, g, sink)))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    batched = jax.jit(jax.vmap(grad, in_axes=(0, 0, None)))(q, g, sink)
    single_fn = jax.jit(grad)
    for b in range(B):
        single = single_fn(q[b], g[b], sink)
        for a, s in zip(batched, single):
            np.testing.assert_allclose(np.asarray(a[b]), np.asarray(s), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("form", ["idx", "gathered"])
def test_bf16_gradients_are_finite_and_close_to_f32(rng, form):
    inputs = make_inputs(rng, form, edges=True)
    cotangent = rng.standard_normal((T, H, D)).astype(np.float32)
    low = dict(inputs, q=inputs["q"].astype(BF16), src=inputs["src"].astype(BF16))
    _, got = vjp_of_op(form, low, cotangent.astype(BF16))
    # The derivative of the bf16 op at the bf16 inputs, in float64.
    wide = dict(low, q=low["q"].astype(np.float32), src=low["src"].astype(np.float32))
    want = finite_difference_vjp(form, wide, cotangent.astype(BF16).astype(np.float32))
    assert got["q"].dtype == jnp.bfloat16 and got["src"].dtype == jnp.bfloat16
    for name in FLOAT_ARGS:
        g = np.asarray(got[name]).astype(np.float32)
        assert np.all(np.isfinite(g)), name
        np.testing.assert_allclose(g, want[name], rtol=3e-2, atol=3e-2, err_msg=name)


@pytest.mark.slow  # several seconds: CI runs it with the slow tests
@pytest.mark.parametrize("form", ["idx", "gathered"])
def test_bf16_backward_is_the_same_in_both_operand_forms(rng, form):
    """The backward multiplies widened f32 operands in every form: the native and f32 forms give
    the same gradient bits (``cpu_products.ProductForm.widen`` concerns the forward only)."""
    inputs = make_inputs(rng, form, edges=False)
    low = dict(inputs, q=inputs["q"].astype(BF16), src=inputs["src"].astype(BF16))
    cotangent = rng.standard_normal((T, H, D)).astype(BF16)
    grads = {}
    for name in ("native", "f32"):
        jax.clear_caches()
        with cpu_products.forced(cpu_products.parse_form(name)):
            grads[name] = vjp_of_op(form, low, cotangent)[1]
    jax.clear_caches()
    for arg in FLOAT_ARGS:
        a, b = np.asarray(grads["native"][arg]), np.asarray(grads["f32"][arg])
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), arg


@pytest.mark.parametrize("form", ["idx", pytest.param("gathered", marks=pytest.mark.slow)])
def test_token_chunked_backward_matches_one_chunk(rng, form, monkeypatch):
    tokens = 7  # not a multiple of the chunk: the padding tokens must contribute nothing
    q = rng.standard_normal((tokens, H, D)).astype(np.float32)
    src_shape = (R, D) if form == "idx" else (tokens, K, D)
    src = rng.standard_normal(src_shape).astype(np.float32)
    idx = rng.integers(-1, R, (tokens, K)).astype(np.int32) if form == "idx" else None
    sink = rng.standard_normal(H).astype(np.float32)

    def loss(q, src, sink):
        return jnp.sum(jnp.sin(op(form, q, src, idx, sink, None, None)))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    whole = jax.jit(grad)(q, src, sink)
    monkeypatch.setattr(reference, "CHUNK_BYTES", 1)  # one token per chunk
    jax.clear_caches()  # lowerings are cached per shape
    chunked_fn = jax.jit(grad)
    assert "while" in chunked_fn.lower(q, src, sink).as_text()
    chunked = chunked_fn(q, src, sink)
    jax.clear_caches()
    for a, b in zip(whole, chunked):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tokens, slots", [(0, K), (T, 0)], ids=["T=0", "K=0"])
def test_empty_shapes_have_zero_gradients(rng, tokens, slots):
    q = rng.standard_normal((tokens, H, D)).astype(np.float32)
    kv = rng.standard_normal((R, D)).astype(np.float32)
    idx = np.zeros((tokens, slots), np.int32)
    sink = rng.standard_normal(H).astype(np.float32)

    def loss(q, kv, sink):
        return jnp.sum(jsa.gathered_attn_idx(q, kv, idx, sink))

    gq, gkv, gsink = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, sink)
    assert gq.shape == q.shape and gkv.shape == kv.shape and gsink.shape == sink.shape
    for g in (gq, gkv, gsink):
        assert not np.any(np.asarray(g))


def test_forward_under_grad_still_binds_the_primitive(rng):
    inputs = make_inputs(rng, "idx", edges=False)

    def loss(q, kv):
        out = jsa.gathered_attn_idx(q, kv, inputs["idx"], implementation="reference")
        return jnp.sum(out)

    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(inputs["q"], inputs["src"])
    names = [str(e.primitive) for e in jaxpr.jaxpr.eqns]
    assert "gathered_attn_idx" in names
    forward = next(e for e in jaxpr.jaxpr.eqns if str(e.primitive) == "gathered_attn_idx")
    assert forward.params["implementation"] == "reference"


@pytest.mark.slow
def test_second_order_raises_a_clear_error(rng):
    inputs = make_inputs(rng, "idx", edges=False)

    def loss(q):
        return jnp.sum(jsa.gathered_attn_idx(q, inputs["src"], inputs["idx"]) ** 2)

    with pytest.raises(NotImplementedError, match="order two"):
        jax.hessian(loss)(inputs["q"])


@pytest.mark.parametrize("form", ["idx", "gathered"])
def test_emulated_kernel_gradients(rng, form):
    """implementation="nki_emulated": the forward runs the kernel under the NKI emulator, the
    backward the same formulas, so gradients equal the reference's and the FD oracle's."""
    inputs = make_inputs(rng, form, edges=True)
    inputs = dict(inputs, q=inputs["q"].astype(BF16), src=inputs["src"].astype(BF16))
    cotangent = rng.standard_normal((T, H, D)).astype(BF16)
    _, got = vjp_of_op(form, inputs, cotangent, implementation="nki_emulated")
    _, reference_grads = vjp_of_op(form, inputs, cotangent, implementation="reference")
    wide = dict(inputs, q=inputs["q"].astype(np.float32), src=inputs["src"].astype(np.float32))
    want = finite_difference_vjp(form, wide, cotangent.astype(np.float32))
    for name in FLOAT_ARGS:
        g = np.asarray(got[name]).astype(np.float32)
        assert np.all(np.isfinite(g)), name
        np.testing.assert_allclose(g, want[name], rtol=3e-2, atol=3e-2, err_msg=name)
        # The backward never reads the forward's output: it is the same for every implementation.
        np.testing.assert_array_equal(g, np.asarray(reference_grads[name]).astype(np.float32))
