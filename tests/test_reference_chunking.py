"""Token chunking of the reference: the same bits as one unchunked pass, in every regime.

The reference splits tokens into chunks (``lax.map``) so that memory stays bounded and each chunk
stays in the CPU caches. Tokens are independent, so chunking must not change a single bit. These
tests force tiny chunks (2 tokens out of 7, which leaves a remainder chunk of 1) by lowering the
module's ``CHUNK_BYTES`` while the function is traced, and compare with a pass where one chunk
covers every token. A fresh ``jax.jit(lambda ...)`` per call makes JAX trace (and read the budget)
again instead of reusing a compiled executable. Each runs under every form of the CPU's
products (``cpu_product_form`` in ``conftest.py``): chunking keeps the bits within one form.
"""

import re

import jax
import numpy as np
import pytest

import jax_sparse_attn as jsa
from jax_sparse_attn import cpu_products
from jax_sparse_attn.attention import reference
from oracle import BF16, attention_bf16_contract, attention_f64, gather, within_one_ulp

T, H, D, K = 7, 3, 32, 24
TOKENS_PER_CHUNK = 2
BITS = {np.dtype(BF16): np.uint16, np.dtype(np.float32): np.uint32}


def per_token_bytes(dtype, widen=False):
    """The working set that ``reference.token_chunk_size`` budgets for one token (``widen``: with
    the slots widened to f32 as well)."""
    itemsize = np.dtype(dtype).itemsize
    row_bytes = itemsize + (4 if widen and itemsize < 4 else 0)
    return K * D * row_bytes + 3 * H * K * 4 + H * D * 4


def make_case(rng, rows, dtype):
    q = rng.standard_normal((T, H, D)).astype(dtype)
    kv = rng.standard_normal((rows, D)).astype(dtype)
    idx = rng.integers(0, rows, (T, K)).astype(np.int32)
    idx[rng.random((T, K)) < 0.2] = -1  # empty slots
    idx[1, 3] = idx[1, 4]  # a duplicate counts twice
    idx[4] = -1  # a token with no valid slot: exactly 0
    bias = (0.5 * rng.standard_normal((T, K))).astype(np.float32)
    bias[2, ::3] = -np.inf  # -inf bias empties the slot
    sink = rng.standard_normal(H).astype(np.float32)
    return q, kv, idx, sink, bias


def traced(monkeypatch, fn, args, chunk_bytes, pregather_bytes):
    """Traces and runs ``fn(*args)`` under the given budgets: (output, whether it loops)."""
    monkeypatch.setattr(reference, "CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(reference, "PREGATHER_MAX_BYTES", pregather_bytes)
    jitted = jax.jit(lambda *a: fn(*a))
    has_loop = "while" in jitted.lower(*args).as_text()
    return np.asarray(jitted(*args)), has_loop


def skip_f32_operands_widened(dtype, form):
    """f32 operands are the same in the f32 form (widening is the identity): nothing new to test."""
    if np.dtype(dtype) == np.float32 and form.startswith("f32"):
        pytest.skip("f32 inputs: the f32 form is the native one")


def same_bits(a, b):
    bits = BITS[np.dtype(a.dtype)]
    return a.dtype == b.dtype and np.array_equal(a.view(bits), b.view(bits))


# f32 inputs in the slow run (CI): bf16 is the common case and the one with two product forms.
@pytest.mark.parametrize("dtype", [BF16, pytest.param(np.float32, marks=pytest.mark.slow)],
                         ids=["bf16", "f32"])
@pytest.mark.parametrize(
    "regime, rows, pregather_bytes",
    [
        # More slots than cache rows: each chunk gathers its own slots inside the loop.
        ("gather-in-loop", 50, 2**40),
        # A cache bigger than all the slots, but pre-gathering disabled: also the in-loop gather.
        pytest.param("gather-in-loop-big-cache", 400, 0, marks=pytest.mark.slow),
        # A cache bigger than all the slots: one gather up front, then the products by chunks.
        ("pregather", 400, 2**40),
    ],
)
def test_idx_chunked_is_bit_identical_to_unchunked(monkeypatch, rng, dtype, regime, rows, pregather_bytes,
                                                   cpu_product_form):
    skip_f32_operands_widened(dtype, cpu_product_form)
    q, kv, idx, sink, bias = make_case(rng, rows, dtype)
    args = (q, kv, idx, sink, bias)

    def fn(q, kv, idx, sink, bias):
        return jsa.gathered_attn_idx(q, kv, idx, sink, bias=bias, scale=0.2)

    # 7 tokens: 3 chunks of 2, a remainder of 1
    small = per_token_bytes(dtype, cpu_product_form.startswith("f32")) * TOKENS_PER_CHUNK
    chunked, chunked_loops = traced(monkeypatch, fn, args, small, pregather_bytes)
    whole, whole_loops = traced(monkeypatch, fn, args, 2**40, pregather_bytes)
    assert chunked_loops and not whole_loops, "the budgets did not force the intended chunking"
    assert same_bits(chunked, whole)

    x, valid = gather(kv, idx)
    if dtype is BF16:
        want = attention_bf16_contract(q, x, valid, sink, bias, scale=0.2)
        assert within_one_ulp(chunked, want) >= 0.999
    else:
        want = attention_f64(q, x, valid, sink, bias, scale=0.2)
        np.testing.assert_allclose(chunked, want, rtol=2e-5, atol=2e-6)
    assert not chunked[4].any()


@pytest.mark.parametrize("dtype", [BF16, pytest.param(np.float32, marks=pytest.mark.slow)],
                         ids=["bf16", "f32"])
def test_gathered_chunked_is_bit_identical_to_unchunked(monkeypatch, rng, dtype, cpu_product_form):
    skip_f32_operands_widened(dtype, cpu_product_form)
    q, kv, idx, sink, bias = make_case(rng, 50, dtype)
    x, valid = gather(kv, idx)
    bias = np.where(valid, bias, -np.inf).astype(np.float32)  # empty slots, as the gathered form says
    args = (q, x, sink, bias)

    def fn(q, g, sink, bias):
        return jsa.gathered_attn(q, g, sink, bias=bias)

    small = per_token_bytes(dtype, cpu_product_form.startswith("f32")) * TOKENS_PER_CHUNK
    chunked, chunked_loops = traced(monkeypatch, fn, args, small, 2**40)
    whole, whole_loops = traced(monkeypatch, fn, args, 2**40, 2**40)
    assert chunked_loops and not whole_loops, "the budgets did not force the intended chunking"
    assert same_bits(chunked, whole)
    if dtype is BF16:
        want = attention_bf16_contract(q, x, np.ones(bias.shape, bool), sink, bias)
        assert within_one_ulp(chunked, want) >= 0.999


def test_chunk_size_follows_the_budget(monkeypatch):
    per_token = per_token_bytes(BF16)
    monkeypatch.setattr(reference, "CHUNK_BYTES", 3 * per_token)
    assert reference.token_chunk_size(100, H, K, D, 2) == 3
    assert reference.token_chunk_size(2, H, K, D, 2) == 2  # never more than the tokens
    monkeypatch.setattr(reference, "CHUNK_BYTES", per_token // 2)
    assert reference.token_chunk_size(100, H, K, D, 2) == 1  # never fewer than one token
    # the f32 form's chunk also holds its slots in f32; f32 slots are not widened again
    monkeypatch.setattr(reference, "CHUNK_BYTES", 3 * per_token_bytes(BF16, widen=True))
    assert reference.token_chunk_size(100, H, K, D, 2, widen=True) == 3
    assert reference.token_chunk_size(100, H, K, D, 4, widen=True) == reference.token_chunk_size(
        100, H, K, D, 4)


def test_eigen_form_is_x_times_rows_behind_a_barrier(monkeypatch, rng):
    """The form for XLA's Eigen kernels keeps its [K, H] product apart from the transpose (an
    optimization barrier in the CPU program); the native form has none, and the f32 form has one
    up to ``X_FIRST_MAX_HEADS`` heads only."""
    q, kv, idx, sink, bias = make_case(rng, 50, BF16)
    many = cpu_products.X_FIRST_MAX_HEADS + 1
    q_many = np.repeat(q[:, :1], many, axis=1)

    def program(form, q=q, sink=sink):
        jax.clear_caches()
        with cpu_products.forced(cpu_products.parse_form(form)):
            return jax.jit(lambda *a: jsa.gathered_attn_idx(*a)).lower(q, kv, idx, sink).as_text()

    for widened in ("native", "f32"):
        assert "optimization_barrier" in program(widened + "-x-first")
    assert "optimization_barrier" not in program("native")
    assert "optimization_barrier" in program("f32")  # H = 3
    assert "optimization_barrier" not in program("f32", q_many, np.zeros(many, np.float32))
    jax.clear_caches()


def dot_operand_types(program: str):
    """The element types of each ``dot_general``'s operands in a StableHLO program."""
    found = re.findall(r"stablehlo\.dot_general.*?: \(tensor<([^>]*)>, tensor<([^>]*)>\)", program)
    return [tuple(t.split("x")[-1] for t in pair) for pair in found]


@pytest.mark.parametrize("fn", ["idx", "gathered"])
def test_f32_form_multiplies_widened_operands(rng, fn):
    """The f32 form's products (logits and values) take f32 operands only; the native form's
    take the bf16 operands as they are. Either form on any CPU (cpu_products.forced)."""
    q, kv, idx, sink, bias = make_case(rng, 50, BF16)
    x, _ = gather(kv, idx)

    def program(form):
        jax.clear_caches()
        with cpu_products.forced(cpu_products.parse_form(form)):
            if fn == "idx":
                return jax.jit(jsa.gathered_attn_idx).lower(q, kv, idx, sink).as_text()
            return jax.jit(jsa.gathered_attn).lower(q, x, sink).as_text()

    widened, native = dot_operand_types(program("f32")), dot_operand_types(program("native"))
    jax.clear_caches()
    assert len(widened) >= 2 and all(pair == ("f32", "f32") for pair in widened), widened
    assert len(native) >= 2 and all(pair == ("bf16", "bf16") for pair in native), native

