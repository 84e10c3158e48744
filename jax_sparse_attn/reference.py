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

Rows with no valid slot are exactly 0. Work is split into token chunks (``lax.map``) so that the
gathered slots and the logits of one chunk stay within ``CHUNK_BYTES``; chunking does not change a
single bit, since every token is computed independently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .constants import EMPTY_LOGIT

# Target working set of one token chunk (gathered slots + fp32 logits/probabilities).
CHUNK_BYTES = 64 * 2**20


def token_chunk_size(num_tokens: int, heads: int, slots: int, dim: int, itemsize: int) -> int:
    """Tokens per chunk so that one chunk's working set stays near ``CHUNK_BYTES``."""
    per_token = slots * dim * itemsize + 3 * heads * slots * 4 + heads * dim * 4
    return int(max(1, min(num_tokens, CHUNK_BYTES // max(per_token, 1))))


def _attend_one_token(q, x, valid, sink, bias, scale):
    """One token. q [H, D], x [K, D] (q's dtype), valid [K] bool, sink [H] f32, bias [K] f32,
    scale [] f32 -> [H, D] in q's dtype."""
    s = jnp.einsum("hd,kd->hk", q, x, preferred_element_type=jnp.float32)
    s = s * scale + jnp.where(valid, bias, jnp.float32(EMPTY_LOGIT))[None, :]
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - m)
    den = jnp.sum(e, axis=-1) + jnp.exp(sink - m[:, 0])
    num = jnp.einsum("hk,kd->hd", e.astype(q.dtype), x, preferred_element_type=jnp.float32)
    o = num / den[:, None]
    return jnp.where(jnp.any(valid), o, jnp.float32(0)).astype(q.dtype)


def _map_tokens(fn, token_args, shared_args, chunk):
    """Applies per-token ``fn(*token_slices, *shared)`` over the leading token axis in chunks."""
    if chunk >= token_args[0].shape[0]:
        return jax.vmap(lambda *a: fn(*a, *shared_args))(*token_args)
    return jax.lax.map(lambda a: fn(*a, *shared_args), token_args, batch_size=chunk)


def _empty_result(q):
    return jnp.zeros(q.shape, q.dtype)


def gathered_attn_reference(q, g, sink, bias, scale):
    """Reference for pre-gathered slots.

    Args:
      q: ``[T, H, D]`` float. g: ``[T, K, D]`` in q's dtype. sink: ``[H]`` f32 (``-inf`` = none).
      bias: ``[T, K]`` f32 (``-inf`` = empty slot). scale: ``[T]`` f32.
    Returns ``[T, H, D]`` in q's dtype.
    """
    T, H, D = q.shape
    K = g.shape[1]
    if T == 0 or K == 0 or H == 0:
        return _empty_result(q)
    g = g.astype(q.dtype)

    def one(q_t, g_t, bias_t, scale_t, sink_):
        valid = bias_t != -jnp.inf
        return _attend_one_token(q_t, g_t, valid, sink_, bias_t, scale_t)

    chunk = token_chunk_size(T, H, K, D, np.dtype(q.dtype).itemsize)
    return _map_tokens(one, (q, g, bias, scale), (sink,), chunk)


def gathered_attn_idx_reference(q, kv, idx, sink, bias, scale):
    """Reference that gathers rows of ``kv`` by ``idx`` (one chunk of tokens at a time).

    Args:
      q: ``[T, H, D]`` float. kv: ``[R, D]`` in q's dtype. idx: ``[T, K]`` int32; a slot is empty when
      ``idx < 0`` or ``idx >= R``. sink: ``[H]`` f32. bias: ``[T, K]`` f32. scale: ``[T]`` f32.
    Returns ``[T, H, D]`` in q's dtype.
    """
    T, H, D = q.shape
    R = kv.shape[0]
    K = idx.shape[1]
    if T == 0 or K == 0 or H == 0 or R == 0:
        return _empty_result(q)
    kv = kv.astype(q.dtype)

    def one(q_t, idx_t, bias_t, scale_t, kv_, sink_):
        valid = (idx_t >= 0) & (idx_t < R) & (bias_t != -jnp.inf)
        rows = jnp.where(valid, idx_t, 0)
        x = kv_.at[rows].get(mode="promise_in_bounds")
        return _attend_one_token(q_t, x, valid, sink_, bias_t, scale_t)

    chunk = token_chunk_size(T, H, K, D, np.dtype(q.dtype).itemsize)
    return _map_tokens(one, (q, idx, bias, scale), (kv, sink), chunk)
