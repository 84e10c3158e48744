"""The pure-jnp reference: the bf16 arithmetic contract (CONTRACT section 2), chunked over tokens.

This is the default lowering of both primitives on every platform. It reproduces the Neuron
kernel's arithmetic step by step, so the two agree to about one bf16 ulp:

1. logits ``s = q . x`` with operands in the input dtype and an fp32 accumulator;
2. ``s = s * scale + b`` in fp32 (the scale multiplies logits, never ``q``); ``b`` is the user bias,
   or ``EMPTY_LOGIT`` for an empty slot;
3. ``m = max_j s`` over the slots only (the sink never enters the max);
4. ``e = exp(s - m)`` and ``den = sum_j e + exp(sink - m)`` in fp32;
5. ``o = sum_j cast(e_j) x_j / den``: probabilities rounded to the input dtype for the value
   product (fp32 accumulator), the denominator from the fp32 ones; one final rounding.

For f32 inputs step 5's cast is the identity, so everything stays in f32.

Both functions also return the log-sum-exp ``lse [T, H]`` f32 of each token and head,
``log(exp(sink) + sum over valid slots of exp(s))``, from the same logits (``_lse``).

Rows with no valid slot are exactly 0. Work runs in token chunks (``lax.map``) whose gathered
slots and logits stay within ``CHUNK_BYTES``: small enough to stay in the CPU caches, and a bound
on memory however many tokens there are. Chunking does not change a single bit, since every token
is computed independently (``tests/test_reference_chunking.py``).

Memory beyond the inputs and the output, for ``gathered_attn_idx``: one chunk's working set, plus
either all tokens' gathered slots when they are at most ``PREGATHER_MAX_BYTES`` and smaller than
the cache, or else one copy of the cache's bits (the loop reads the cache as raw bits, see
``_map_tokens``). For ``gathered_attn``: one chunk's working set plus one copy of ``g``'s bits
when there is more than one chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .constants import EMPTY_LOGIT

# Target working set of one token chunk (gathered slots + fp32 logits/probabilities). Small on
# purpose: a chunk that stays in the CPU caches keeps the gather and both products out of DRAM, which
# measured about twice as fast as one big batch (README, Performance), and it bounds the memory of a
# long prefill (the gathered slots of T=4096, K=2048, D=512 alone would be 8 GiB).
CHUNK_BYTES = 4 * 2**20

# Largest gather of all tokens' slots done up front, outside the token loop. Up to this size, and
# when the cache is bigger than the slots, one gather beats the loop's copy of the cache's bits.
PREGATHER_MAX_BYTES = 64 * 2**20

# f32 inputs are computed in f32 throughout: without this, GPUs run f32 products in TF32 (10-bit
# mantissa). bf16 and f16 products are exact in the fp32 accumulator either way.
_EXACT = jax.lax.Precision.HIGHEST


def token_chunk_size(num_tokens: int, heads: int, slots: int, dim: int, itemsize: int) -> int:
    """Tokens per chunk so that one chunk's working set stays near ``CHUNK_BYTES`` (at least 1)."""
    per_token = slots * dim * itemsize + 3 * heads * slots * 4 + heads * dim * 4
    return int(max(1, min(num_tokens, CHUNK_BYTES // max(per_token, 1))))


def _bits_dtype(dtype) -> np.dtype:
    """The unsigned integer dtype with ``dtype``'s width."""
    return np.dtype(f"uint{8 * np.dtype(dtype).itemsize}")


def _to_bits(x):
    return jax.lax.bitcast_convert_type(x, _bits_dtype(x.dtype))


def _from_bits(bits, dtype):
    return jax.lax.bitcast_convert_type(bits, dtype)


def _gather_rows(kv_bits, rows):
    """``kv[rows]`` on bit patterns: kv_bits ``[R, D]`` unsigned, rows ``[..., K]`` int32, all in
    range -> ``[..., K, D]`` unsigned.

    XLA:CPU widens a bf16 gather to f32; inside the token loop it hoists that conversion of the whole
    cache out of the loop (an f32 copy of ``kv``, twice its size, on every call). Raw bits move as
    they are.
    """
    return kv_bits.at[rows].get(mode="promise_in_bounds")


def _attend_one_token(q, x, valid, sink, bias, scale):
    """One token. q [H, D], x [K, D] (q's dtype), valid [K] bool, sink [H] f32, bias [K] f32,
    scale [] f32 -> (out [H, D] in q's dtype, lse [H] f32)."""
    s = jnp.einsum("hd,kd->hk", q, x, preferred_element_type=jnp.float32, precision=_EXACT)
    s = s * scale + jnp.where(valid, bias, jnp.float32(EMPTY_LOGIT))[None, :]
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - m)
    sum_e = jnp.sum(e, axis=-1)
    den = sum_e + jnp.exp(sink - m[:, 0])
    num = jnp.einsum(
        "hk,kd->hd", e.astype(q.dtype), x, preferred_element_type=jnp.float32, precision=_EXACT
    )
    o = num / den[:, None]
    any_valid = jnp.any(valid)
    out = jnp.where(any_valid, o, jnp.float32(0)).astype(q.dtype)
    return out, _lse(any_valid, m[:, 0], sum_e, sink)


def _lse(any_valid, m, sum_e, sink):
    """log(exp(sink) + sum_j exp(s_j)) from the softmax statistics: ``sum_e = sum_j exp(s_j - m)``
    is at least 1, so ``m + log(sum_e)`` is exact and finite; the sink joins by ``logaddexp``, which
    stays exact when ``sink - m`` would overflow ``exp`` in the denominator. No valid slot: the
    sink alone (``-inf`` without one)."""
    return jnp.where(any_valid, jnp.logaddexp(m + jnp.log(sum_e), sink), sink)


def _map_tokens(fn, token_args, shared_args, chunk):
    """Applies per-token ``fn(*token_slices, *shared)`` over the leading token axis, ``chunk``
    tokens at a time (``lax.map``); one ``vmap`` when a single chunk covers every token.

    Tokens are independent, so the chunk size never changes a result bit. Floating operands travel
    through the loop as unsigned bit patterns and ``fn`` returns bits: XLA:CPU otherwise widens
    every bf16 slice and update of the loop to f32, converting the whole output once per chunk.
    """
    if chunk >= token_args[0].shape[0]:
        return jax.vmap(lambda *a: fn(*a, *shared_args))(*token_args)
    return jax.lax.map(lambda a: fn(*a, *shared_args), token_args, batch_size=chunk)


def _empty_result(q, sink):
    """No slot at all: output 0, and the lse is the sink alone."""
    T, H, _ = q.shape
    return jnp.zeros(q.shape, q.dtype), jnp.broadcast_to(sink, (T, H)).astype(jnp.float32)


def _attend_bits(dtype):
    """Per-token attention on bit patterns: (q bits [H, D], slot bits [K, D], valid [K], bias [K],
    scale [], sink [H]) -> (output bits [H, D], lse [H] f32)."""

    def one(q_bits, x_bits, valid, bias_t, scale_t, sink):
        q_t, x = _from_bits(q_bits, dtype), _from_bits(x_bits, dtype)
        out, lse = _attend_one_token(q_t, x, valid, sink, bias_t, scale_t)
        return _to_bits(out), lse

    return one


def _gathered_chunks(q, g_bits, valid, sink, bias, scale):
    """Runs the contract over slots that are already gathered, ``g_bits [T, K, D]`` as bits."""
    T, H, D = q.shape
    K = g_bits.shape[1]
    one = _attend_bits(q.dtype)
    chunk = token_chunk_size(T, H, K, D, np.dtype(q.dtype).itemsize)
    out_bits, lse = _map_tokens(one, (_to_bits(q), g_bits, valid, bias, scale), (sink,), chunk)
    return _from_bits(out_bits, q.dtype), lse


def gathered_attn_reference(q, g, sink, bias, scale):
    """Reference for pre-gathered slots.

    Args:
      q: ``[T, H, D]`` float. g: ``[T, K, D]`` in q's dtype. sink: ``[H]`` f32 (``-inf`` = none).
      bias: ``[T, K]`` f32 (``-inf`` = empty slot). scale: ``[T]`` f32.
    Returns ``(out [T, H, D] in q's dtype, lse [T, H] f32)``.
    """
    T, H, D = q.shape
    K = g.shape[1]
    if T == 0 or K == 0 or H == 0:
        return _empty_result(q, sink)
    valid = bias != -jnp.inf
    return _gathered_chunks(q, _to_bits(g.astype(q.dtype)), valid, sink, bias, scale)


def gathered_attn_idx_reference(q, kv, idx, sink, bias, scale):
    """Reference that gathers rows of ``kv`` by ``idx``.

    When all tokens' slots fit in ``PREGATHER_MAX_BYTES`` and are smaller than the cache (decode),
    they are gathered in one step and the products run by token chunks; otherwise (prefill) each
    chunk of tokens gathers its own slots inside the loop, so memory stays bounded.

    Args:
      q: ``[T, H, D]`` float. kv: ``[R, D]`` in q's dtype. idx: ``[T, K]`` int32; a slot is empty when
      ``idx < 0`` or ``idx >= R``. sink: ``[H]`` f32. bias: ``[T, K]`` f32. scale: ``[T]`` f32.
    Returns ``(out [T, H, D] in q's dtype, lse [T, H] f32)``.
    """
    T, H, D = q.shape
    R = kv.shape[0]
    K = idx.shape[1]
    if T == 0 or K == 0 or H == 0 or R == 0:
        return _empty_result(q, sink)
    dtype = q.dtype
    itemsize = np.dtype(dtype).itemsize
    kv_bits = _to_bits(kv.astype(dtype))
    valid = (idx >= 0) & (idx < R) & (bias != -jnp.inf)
    rows = jnp.where(valid, idx, 0)

    slot_bytes = T * K * D * itemsize
    if slot_bytes <= PREGATHER_MAX_BYTES and slot_bytes < R * D * itemsize:
        return _gathered_chunks(q, _gather_rows(kv_bits, rows), valid, sink, bias, scale)

    attend = _attend_bits(dtype)

    def one(q_bits, rows_t, valid_t, bias_t, scale_t, kv_bits_, sink_):
        return attend(q_bits, _gather_rows(kv_bits_, rows_t), valid_t, bias_t, scale_t, sink_)

    chunk = token_chunk_size(T, H, K, D, itemsize)
    out_bits, lse = _map_tokens(
        one, (_to_bits(q), rows, valid, bias, scale), (kv_bits, sink), chunk
    )
    return _from_bits(out_bits, dtype), lse
