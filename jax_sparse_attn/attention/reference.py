"""The pure-jnp reference of both attention primitives, their default lowering on every platform:
the arithmetic contract (docs/contract.md, "Arithmetic") step by step as the Neuron kernel computes
it, so the two agree to about one bf16 ulp, with the log-sum-exp of each token and head.

It runs in token chunks whose size follows the platform; how it chunks, reads a cache and bounds its
memory is docs/contract.md, "The reference's chunks and memory". The CPU product forms are
:mod:`jax_sparse_attn.cpu_products`'s.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..constants import EMPTY_LOGIT, FLT_MAX, LOGIT_LIMIT, value_shift
from ..cpu_products import ACCELERATOR_FORM, ProductForm, cpu_form, logits_x_first

# Target working set of one token chunk (gathered slots + fp32 logits/probabilities). Small on
# purpose: a chunk that stays in the CPU caches keeps the gather and both products out of DRAM
# (docs/guides/performance.md), and it bounds the memory of a long prefill.
CHUNK_BYTES = 4 * 2**20

# Largest gather of all tokens' slots done up front, outside the token loop. Up to this size, and
# when the cache is bigger than the slots, one gather beats the loop's copy of the cache's bits.
PREGATHER_MAX_BYTES = 64 * 2**20

# f32 inputs are computed in f32 throughout: without this, GPUs run f32 products in TF32 (10-bit
# mantissa). bf16 and f16 products are exact in the fp32 accumulator either way.
EXACT = jax.lax.Precision.HIGHEST


# On GPU and TPU the chunk follows the device's memory instead of CPU caches: one chunk's working
# set may use this fraction of the accelerator's memory (``memory_stats()["bytes_limit"]``), so
# that a prefill that fits runs as one batched call and a longer one in a few large steps.
ACCELERATOR_MEMORY_FRACTION = 1 / 8
# The budget when the device's memory is unknown: lowering for a platform that is not attached
# (export, AOT compilation) or a backend without ``memory_stats``. An assumption, sized for a
# 16 GiB accelerator.
ACCELERATOR_CHUNK_BYTES_DEFAULT = 2 * 2**30


def token_chunk_size(
    num_tokens: int, heads: int, slots: int, dim: int, itemsize: int, budget: int | None = None,
    widen: bool = False,
) -> int:
    """Tokens per chunk so that one chunk's working set stays near ``budget`` (default
    ``CHUNK_BYTES``, the CPU budget), at least 1 and at most ``num_tokens``. ``widen``: the
    chunk also holds its slots widened to f32 (``ProductForm.widen``)."""
    row_bytes = itemsize + (4 if widen and itemsize < 4 else 0)
    per_token = slots * dim * row_bytes + 3 * heads * slots * 4 + heads * dim * 4
    budget = CHUNK_BYTES if budget is None else budget
    return int(max(1, min(num_tokens, budget // max(per_token, 1))))


def accelerator_memory_bytes(stat: str = "bytes_limit") -> int | None:
    """A memory statistic of JAX's first device when it is an accelerator that reports it
    (``memory_stats()[stat]``: ``bytes_limit``, the memory JAX may use, or ``bytes_in_use``,
    ``peak_bytes_in_use``); None on CPU (whose memory is the process's) or where unknown."""
    try:
        device = jax.devices()[0]
        if device.platform != "cpu":
            return (device.memory_stats() or {}).get(stat)
    except Exception:  # no backend, or no memory_stats
        pass
    return None


def accelerator_chunk_bytes() -> int:
    """The working-set budget of one token chunk on GPU / TPU (bytes).

    ``ACCELERATOR_MEMORY_FRACTION`` of the first accelerator's memory when JAX has one attached and
    reports its size, else ``ACCELERATOR_CHUNK_BYTES_DEFAULT``. Read at trace time.
    """
    limit = accelerator_memory_bytes()
    if not limit:
        return ACCELERATOR_CHUNK_BYTES_DEFAULT
    return int(limit * ACCELERATOR_MEMORY_FRACTION)


def per_platform(cpu_fn, accelerator_fn, *args):
    """``cpu_fn(*args)`` when lowering for CPU, ``accelerator_fn(*args)`` for every other platform
    (GPU, TPU, ...): the choice is made when the program is lowered, so a program lowered for one
    platform contains only that platform's loop structure."""
    return jax.lax.platform_dependent(*args, cpu=cpu_fn, default=accelerator_fn)


def _bits_dtype(dtype) -> np.dtype:
    """The unsigned integer dtype with ``dtype``'s width."""
    return np.dtype(f"uint{8 * np.dtype(dtype).itemsize}")


def to_bits(x):
    """``x``'s raw bit patterns (the unsigned integer type of its width). Loops carry 16-bit floats
    this way: XLA:CPU widens a 16-bit operand of a loop to f32 as a whole on every step."""
    return jax.lax.bitcast_convert_type(x, _bits_dtype(x.dtype))


def from_bits(bits, dtype):
    """Inverse of ``to_bits``."""
    return jax.lax.bitcast_convert_type(bits, dtype)


def _gather_rows(kv_bits, rows):
    """``kv[rows]`` on bit patterns, zeros for an out-of-range row: kv_bits ``[R, D]`` unsigned,
    rows ``[..., K]`` int32 (``R`` for a slot that selects nothing) -> ``[..., K, D]`` unsigned.

    An empty, masked or padding slot never reads a cache row: its row is all-zero bits (+0.0), so
    NaN, inf or garbage in rows that no valid slot selects cannot reach the output.

    XLA:CPU widens a bf16 gather to f32; inside the token loop it hoists that conversion of the whole
    cache out of the loop (an f32 copy of ``kv``, twice its size, on every call). Raw bits move as
    they are.
    """
    return kv_bits.at[rows].get(mode="fill", fill_value=0)


def gather_bits(src, rows):
    """``src[rows]`` for a float array ``src [R, D]``, zeros for out-of-range rows, gathered as
    raw bits (``_gather_rows``)."""
    return from_bits(_gather_rows(to_bits(src), rows), src.dtype)


def prescale_queries(q):
    """The dot products' guard against f32 overflow: q ``[..., H, D]`` -> ``(q_scaled, up)``.

    ``q_scaled = q * 2**-k`` per token (the leading axes; exact: a power of two) with
    ``k = max(0, e + ceil(log2 D) + 1)`` where ``max_{h,d} |q| = f * 2**e``, ``0.5 <= f < 1``. Then
    ``max |q_scaled| < 1 / (2 D)``, so no partial sum of ``q_scaled . x`` can exceed ``FLT_MAX / 2``
    (times rounding) whatever the rows hold: the fp32 accumulator never overflows, and never
    meets ``inf - inf``. ``scale_up(z, up)`` multiplies the products back by ``2**k``, saturating.
    No bit changes unless an element of ``q`` or a product lies more than ``2**(126 - k)`` below
    the smallest normal f32 once scaled (elements over ``2**100`` times smaller than q's largest).
    ``up`` is a pair of f32 powers of two (each at most ``2**80``) with product ``2**k``; shape
    ``q.shape[:-2]``. For f16 (whose products cannot overflow f32) ``k = 0``.
    """
    one = jnp.float32(1)
    top = float(jnp.finfo(q.dtype).max)
    if top * top * q.shape[-1] <= FLT_MAX / 2:
        # f16: no product of its values can overflow f32 (nor would its narrow exponent range
        # survive the scaling). The guard is the identity.
        return q, (jnp.ones(q.shape[:-2], jnp.float32), jnp.ones(q.shape[:-2], jnp.float32))
    qmax = jnp.max(jnp.abs(q.astype(jnp.float32)), axis=(-2, -1))
    _, e = jnp.frexp(qmax)
    k = jnp.clip(e + (max(q.shape[-1] - 1, 0).bit_length() + 1), 0, 2 * 80)
    k1 = k // 2
    k2 = k - k1
    down1, down2 = jnp.ldexp(one, -k1), jnp.ldexp(one, -k2)
    q_scaled = q * down1[..., None, None].astype(q.dtype) * down2[..., None, None].astype(q.dtype)
    return q_scaled, (jnp.ldexp(one, k1), jnp.ldexp(one, k2))


def scale_up(z, up):
    """``clamp(z * 2**k, +-FLT_MAX)`` for the ``up`` of ``prescale_queries`` (broadcast over the
    trailing ``[H, K]`` of z); an overflow saturates, NaN stays NaN."""
    up1, up2 = up
    return jnp.clip(z * up1[..., None, None] * up2[..., None, None], -FLT_MAX, FLT_MAX)


def slot_products(x, rows, x_first=False):
    """``rows . x_j`` for every slot: x ``[..., K, D]`` slot rows, rows ``[..., M, D]`` in the same
    dtype -> ``[..., M, K]`` f32 (an f32 accumulator; 16-bit products are exact in it).

    ``x_first``: computed as ``x rows^T`` (``[K, D] x [D, M]``) and then transposed, for XLA:CPU's
    Eigen kernels (``cpu_products.products_by_eigen``), which run that product two to five times faster
    than ``rows x^T`` (``[M, D] x [D, K]``) at attention's shapes (M = 16 to 128, K = 2048,
    D = 512). The optimization barrier keeps XLA from folding the transpose back into the
    product; the transpose touches only ``M K`` f32 values. YNNPACK and GPUs run ``rows x^T`` as
    fast or faster, so it is the default.
    """
    if not x_first:
        return jnp.einsum("...md,...kd->...mk", rows, x, preferred_element_type=jnp.float32,
                          precision=EXACT)
    products = jnp.einsum("...kd,...md->...km", x, rows, preferred_element_type=jnp.float32,
                          precision=EXACT)
    return jnp.swapaxes(jax.lax.optimization_barrier(products), -1, -2)


def saturated_logits(z, valid, bias, scale):
    """The logit saturation rule (docs/contract.md), f32: a ``[..., K]`` dot products already
    clamped to ``+-FLT_MAX`` (``scale_up``), valid and bias broadcastable to a, scale
    broadcastable to a.

    ``s = clamp(a * scale, +-LOGIT_LIMIT) + bias`` for a valid slot, ``EMPTY_LOGIT`` for an empty
    one. For finite inputs ``s`` is finite, and a real slot's logit (>= -2 LOGIT_LIMIT) always
    outranks an empty slot's. NaN stays NaN (min/max propagate it).
    """
    s = jnp.clip(z * scale, -LOGIT_LIMIT, LOGIT_LIMIT) + bias
    return jnp.where(valid, s, jnp.float32(EMPTY_LOGIT))


class TokenAttention(NamedTuple):
    """One token's result and the softmax statistics behind it (all heads)."""

    out: jax.Array  # [H, value_dim] f32, before the final rounding; 0 for a token with no valid slot
    max: jax.Array  # [H] f32: max_j s_j over the slots (the sink excluded)
    den: jax.Array  # [H] f32: sum_j exp(s_j - max) + exp(sink - max)


def attend_token(q, x, valid, sink, bias, scale,
                 form: ProductForm = ACCELERATOR_FORM, value_dim=None) -> TokenAttention:
    """The contract for one token. q [H, D], x [K, D] (q's dtype; rows of empty slots are zero),
    valid [K] bool, sink [H] f32, bias [K] f32, scale [] f32; ``form``: how the products run
    (``cpu_products.ProductForm``; widened 16-bit operands give the same products, exactly);
    ``value_dim``: the value product reads only the first ``value_dim`` columns of x (default
    all D).

    Neither product can overflow f32 however large the inputs are, and neither guard changes a bit
    in the normal range: the dot products run on ``q`` scaled by a power of two and are scaled
    back with saturation (``prescale_queries``), and the value product runs on probabilities
    scaled by ``2**-value_shift(K)`` with its result scaled back after the division
    (``constants.value_shift``).
    """
    if q.shape[-2] == 1:
        # One head makes both products matrix-vector products, which XLA:CPU sums in another
        # order than the same head among others (a device holding one head of a heads split,
        # docs/contract.md, "Layouts"). A zero second head keeps them matrix products; it leaves
        # the real head's arithmetic unchanged (q's largest element is the same).
        two = attend_token(jnp.concatenate([q, jnp.zeros_like(q)]), x, valid,
                           jnp.concatenate([sink, sink]), bias, scale, form, value_dim)
        return TokenAttention(*(a[:1] for a in two))
    K = x.shape[0]
    q_scaled, up = prescale_queries(q)
    operand = _widened if form.widen else (lambda a: a)
    x_op = operand(x)  # under vmap: the whole chunk's slots at once
    z = slot_products(x_op, operand(q_scaled), logits_x_first(form, q.shape[-2]))
    s = saturated_logits(scale_up(z, up), valid[None, :], bias[None, :], scale)
    m = jnp.max(s, axis=-1)
    e = jnp.exp(s - m[:, None])
    den = jnp.sum(e, axis=-1) + jnp.exp(sink - m)
    shift = value_shift(K, q.dtype)
    p = (e * jnp.float32(2.0**-shift)).astype(q.dtype)
    values = x_op if value_dim is None else x_op[:, :value_dim]
    num = jnp.einsum("hk,kd->hd", operand(p), values, preferred_element_type=jnp.float32,
                     precision=EXACT)
    o = (num / den[:, None]) * jnp.float32(2.0**shift)
    o = jnp.where(jnp.any(valid), o, jnp.float32(0))
    return TokenAttention(o, m, den)


def _widened(a):
    """``a`` in f32: a 16-bit float's value exactly. The product of two widened 16-bit values is
    exact in f32, as in a 16-bit product with an f32 accumulator."""
    return a.astype(jnp.float32)


def _lse(any_valid, m, den, sink):
    """``log(exp(sink) + sum_j exp(s_j))`` from one token's softmax statistics (``m`` the max over
    the slots, ``den`` the denominator with the sink): ``m + log(den)``. ``den`` is ``+inf`` only
    when ``exp(sink - m)`` overflows (the slots' sum is at most K), and then the lse is the sink
    to f32 precision (a ``+inf`` sink gives ``+inf``). No valid slot: the sink alone (``-inf``
    without one)."""
    lse = jnp.where(den == jnp.inf, sink, m + jnp.log(den))
    return jnp.where(any_valid, lse, sink)


def _map_tokens(fn, token_args, shared_args, chunk):
    """Applies per-token ``fn(*token_slices, *shared)`` over the leading token axis, ``chunk``
    tokens at a time (``lax.map``); one ``vmap`` when a single chunk covers every token.

    Tokens are independent, so the chunk size does not change a result bit. Floating operands
    travel through the loop as unsigned bit patterns and ``fn`` returns bits: XLA:CPU otherwise
    widens every bf16 slice and update of the loop to f32, converting the whole output once per
    chunk.
    """
    T = token_args[0].shape[0]
    if chunk >= T:
        return jax.vmap(lambda *a: fn(*a, *shared_args))(*token_args)
    return jax.lax.map(lambda a: fn(*a, *shared_args), token_args, batch_size=chunk)


def _empty_result(q, sink, value_dim):
    """No slot at all: output 0, and the lse is the sink alone."""
    T, H, _ = q.shape
    return jnp.zeros((T, H, value_dim), q.dtype), jnp.broadcast_to(sink, (T, H)).astype(jnp.float32)


def _attend_bits(dtype, form, value_dim=None):
    """Per-token attention on bit patterns: (q bits [H, D], slot bits [K, D], valid [K], bias [K],
    scale [], sink [H]) -> (output bits [H, value_dim], lse [H] f32). ``form``: see
    ``attend_token``."""

    def one(q_bits, x_bits, valid, bias_t, scale_t, sink):
        q_t, x = from_bits(q_bits, dtype), from_bits(x_bits, dtype)
        token = attend_token(q_t, x, valid, sink, bias_t, scale_t, form, value_dim)
        return to_bits(token.out.astype(dtype)), _lse(jnp.any(valid), token.max, token.den, sink)

    return one


def _gathered_chunks(q, g_bits, valid, sink, bias, scale, budget=None, value_dim=None):
    """Runs the contract over slots that are already gathered, ``g_bits [T, K, D]`` as bits;
    ``budget``: a chunk's working set in bytes (default: the CPU's ``CHUNK_BYTES`` and product
    form)."""
    T, H, D = q.shape
    K = g_bits.shape[1]
    form = cpu_form() if budget is None else ACCELERATOR_FORM
    one = _attend_bits(q.dtype, form, value_dim)
    chunk = token_chunk_size(T, H, K, D, np.dtype(q.dtype).itemsize, budget, form.widen)
    out_bits, lse = _map_tokens(one, (to_bits(q), g_bits, valid, bias, scale), (sink,), chunk)
    return from_bits(out_bits, q.dtype), lse


def gathered_attn_reference(q, g, sink, bias, scale, *, value_dim=None):
    """Reference for pre-gathered slots.

    Args:
      q: ``[T, H, D]`` float. g: ``[T, K, D]`` in q's dtype. sink: ``[H]`` f32 (``-inf`` = none).
      bias: ``[T, K]`` f32 (``-inf`` = empty slot). scale: ``[T]`` f32. value_dim: the columns of
      each row that enter the value product (default D).
    Returns ``(out [T, H, value_dim] in q's dtype, lse [T, H] f32)``.
    """
    T, H, D = q.shape
    K = g.shape[1]
    value_dim = D if value_dim is None else value_dim
    if T == 0 or K == 0 or H == 0:
        return _empty_result(q, sink, value_dim)
    valid = bias != -jnp.inf
    # A masked slot's row is never read: its bits become zero (one select, fused with the cast).
    g_bits = jnp.where(valid[:, :, None], to_bits(g.astype(q.dtype)), 0)
    return per_platform(
        lambda *a: _gathered_chunks(*a, value_dim=value_dim),
        lambda *a: _gathered_chunks(*a, budget=accelerator_chunk_bytes(), value_dim=value_dim),
        q, g_bits, valid, sink, bias, scale,
    )


def _gather_union(caches_bits, rows, dim: int):
    """The slots of one or more caches side by side: ``caches_bits`` a tuple of ``[R_i, D]`` bit
    arrays, ``rows`` a tuple of ``[..., K_i]`` (``R_i`` for a slot that selects nothing) ->
    ``[..., sum K_i, D]`` bits. A cache of 0 rows gives zero rows (a gather from it is not valid
    XLA)."""
    parts = [
        _gather_rows(c, r) if c.shape[0] else jnp.zeros(r.shape + (dim,), c.dtype)
        for c, r in zip(caches_bits, rows)
    ]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-2)


def dequantise_slots(bits, slot_scale, fp8_dtype, dtype):
    """FP8 slot rows to ``dtype``: ``bits [..., K, D]`` the rows' raw bytes, ``slot_scale
    [..., K, n]`` f32 (one scale per group of ``D // n`` columns; 0 for an empty slot) ->
    ``(rows.astype(f32) * scale).astype(dtype)`` as ``dtype``'s bits (fp8.py's rule)."""
    D, n = bits.shape[-1], slot_scale.shape[-1]
    x = from_bits(bits, fp8_dtype).astype(jnp.float32)
    x = x.reshape(x.shape[:-1] + (n, D // n)) * slot_scale[..., None]
    return to_bits(x.reshape(bits.shape).astype(dtype))


def gathered_attn_idx_reference(q, kv, idx, sink, bias, scale, extra_kv=None, extra_idx=None,
                                extra_bias=None, *, kv_scale=None, kv_rope=None,
                                extra_kv_scale=None, extra_kv_rope=None, value_dim=None):
    """Reference that gathers rows of ``kv`` by ``idx`` (and of a second cache ``extra_kv`` by
    ``extra_idx``: one softmax over both caches' slots, main first).

    When all tokens' slots fit in ``PREGATHER_MAX_BYTES`` and are smaller than the cache (decode),
    they are gathered in one step and the products run by token chunks; otherwise (prefill) each
    chunk of tokens gathers its own slots inside the loop, so memory stays bounded. With two caches
    each token's slots are gathered from both, side by side; the caches are never concatenated.

    Args:
      q: ``[T, H, D]`` float. kv: ``[R, D]`` in q's dtype. idx: ``[T, K]`` int32; a slot is empty when
      ``idx < 0`` or ``idx >= R``. sink: ``[H]`` f32. bias: ``[T, K]`` f32. scale: ``[T]`` f32.
      extra_kv, extra_idx, extra_bias: ``[R2, D]``, ``[T, K2]`` int32, ``[T, K2]`` f32, or None;
      ``extra_kv`` is in q's dtype (also beside an FP8 ``kv``), or FP8 with its own
      ``extra_kv_scale`` and ``extra_kv_rope`` (as ``kv_scale`` and ``kv_rope`` below).
      kv_scale: ``[R, n]`` f32 for an FP8 ``kv`` (``float8_e4m3fn`` / ``float8_e5m2``): each chunk
      of tokens gathers its FP8 rows (one byte per element) and their scales and dequantises
      them (``dequantise_slots``), so memory stays within the bound of a 16-bit cache; the cache
      is never dequantised as a whole.
      kv_rope: ``[R, Dr]`` 16-bit, or None: with an FP8 ``kv [R, D - Dr]``, the columns of each
      row that are not quantised (DeepSeek's split rows); the logical row is
      ``[dequantised kv | kv_rope]``.
      value_dim: the columns of each row that enter the value product (default D).
    Returns ``(out [T, H, value_dim] in q's dtype, lse [T, H] f32)``.
    """
    T, H, D = q.shape
    value_dim = D if value_dim is None else value_dim
    caches = (kv,) if extra_kv is None else (kv, extra_kv)
    indices = (idx,) if extra_kv is None else (idx, extra_idx)
    biases = (bias,) if extra_kv is None else (bias, extra_bias)
    K = sum(i.shape[1] for i in indices)
    R = sum(c.shape[0] for c in caches)
    if T == 0 or K == 0 or H == 0 or R == 0:
        return _empty_result(q, sink, value_dim)
    dtype = q.dtype
    itemsize = np.dtype(dtype).itemsize
    # Per cache: (its bits, and for an FP8 cache its f32 scales and its rope bits, or None): the
    # FP8 raw bytes travel and are dequantised after each gather.
    fp8_dtypes = (kv.dtype if kv_scale is not None else None,
                  extra_kv.dtype if extra_kv_scale is not None else None)[:len(caches)]
    kv_bits = tuple(
        (to_bits(c.astype(dtype)), None, None) if s is None else
        (to_bits(c), s.astype(jnp.float32), None if r is None else to_bits(r.astype(dtype)))
        for c, s, r in zip(caches, (kv_scale, extra_kv_scale), (kv_rope, extra_kv_rope)))
    valids = [(i >= 0) & (i < c.shape[0]) & (b != -jnp.inf) for c, i, b in zip(caches, indices, biases)]
    # Out of range: the gather fills the slot with zeros.
    rows = tuple(jnp.where(v, i, c.shape[0]) for c, i, v in zip(caches, indices, valids))
    valid = valids[0] if len(valids) == 1 else jnp.concatenate(valids, axis=1)
    bias = biases[0] if len(biases) == 1 else jnp.concatenate(biases, axis=1)

    def gather_one(cache_bits, scales, rope, fp8_dtype, rows_c):
        if scales is None:
            return _gather_union((cache_bits,), (rows_c,), D)
        if cache_bits.shape[0] == 0:  # an empty FP8 cache (a gather from it is not valid XLA)
            return jnp.zeros(rows_c.shape + (D,), _bits_dtype(dtype))
        slot_scale = scales.at[rows_c].get(mode="fill", fill_value=0)
        x = dequantise_slots(_gather_rows(cache_bits, rows_c), slot_scale, fp8_dtype, dtype)
        if rope is not None:  # the 16-bit columns after the FP8 ones
            x = jnp.concatenate([x, _gather_rows(rope, rows_c)], axis=-1)
        return x

    def gather(kv_bits_, rows_t):
        """The slots' rows as q's dtype's bits (dequantised FP8 rows with their scales), each
        cache's side by side, main first."""
        if all(s is None for _, s, _ in kv_bits_):
            return _gather_union(tuple(b for b, _, _ in kv_bits_), rows_t, D)
        parts = [gather_one(*c, f, r) for c, f, r in zip(kv_bits_, fp8_dtypes, rows_t)]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-2)

    def gather_and_attend(form):
        attend = _attend_bits(dtype, form, value_dim)

        def one(q_bits, rows_t, valid_t, bias_t, scale_t, kv_bits_, sink_):
            return attend(q_bits, gather(kv_bits_, rows_t), valid_t, bias_t, scale_t, sink_)

        return one

    def cpu(q, kv_bits, rows, valid, sink, bias, scale):
        slot_bytes = T * K * D * itemsize
        if slot_bytes <= PREGATHER_MAX_BYTES and slot_bytes < R * D * itemsize:
            return _gathered_chunks(q, gather(kv_bits, rows), valid, sink, bias, scale,
                                    value_dim=value_dim)
        return _indexed_chunks(q, kv_bits, rows, valid, sink, bias, scale, CHUNK_BYTES,
                               cpu_form())

    def accelerator(q, kv_bits, rows, valid, sink, bias, scale):
        # Device memory, not caches, sets the chunk: one batched call when everything fits.
        budget = accelerator_chunk_bytes()
        return _indexed_chunks(q, kv_bits, rows, valid, sink, bias, scale, budget,
                               ACCELERATOR_FORM)

    # FP8: a slot element is its byte, its f32 dequantisation and its rounding to q's dtype.
    slot_itemsize = itemsize if kv_scale is None and extra_kv_scale is None else 1 + 4 + itemsize

    def _indexed_chunks(q, kv_bits, rows, valid, sink, bias, scale, budget, form):
        chunk = token_chunk_size(T, H, K, D, slot_itemsize, budget, form.widen)
        token_args = (to_bits(q), rows, valid, bias, scale)
        out_bits, lse = _map_tokens(gather_and_attend(form), token_args, (kv_bits, sink),
                                    chunk)
        return from_bits(out_bits, dtype), lse

    return per_platform(cpu, accelerator, q, kv_bits, rows, valid, sink, bias, scale)
