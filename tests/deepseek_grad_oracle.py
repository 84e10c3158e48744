"""Differentiable float64 oracles of one DeepSeek V4 and one V3.2 attention layer, in jax.numpy.

The forwards of tests/deepseek_v4_oracle.py and tests/deepseek_v32_oracle.py (``round_bf16=False``:
no bf16 roundings, float64 throughout), rewritten in ``jax.numpy`` so that JAX differentiates
them, with every quantisation simulation written as ``x + stop_gradient(q(x) - x)``: its forward
value is the rounding, its derivative the identity (DeepSeek's quantisation-aware training). The
selections (the indexer's top-k, every complete block) are integers, taken from the numpy
oracles: the attention's loss does not depend on the indexer's parameters. The weights are plain
(float64 arithmetic); a linear named in ``fp8`` is DeepSeek's ``fp8_gemm`` on its dequantised
weight, its activation through FP8 per 128 columns, straight through.

Call these inside ``jax.enable_x64(True)``. This file never imports jax_sparse_attn: it is the
independent reference that the layers' gradients are tested against.
"""

import jax
import jax.numpy as jnp
import numpy as np

import deepseek_v32_oracle as v32_oracle
import deepseek_v4_oracle as v4_oracle

FP8_MAX, FP8_AMAX_FLOOR = 448.0, 1e-4
FP4_MAX, FP4_AMAX_FLOOR = 6.0, 6.0 * 2.0 ** -126
# (explicit mantissa bits, smallest normal value) of e4m3 and e2m1.
E4M3, E2M1 = (3, 2.0 ** -6), (1, 1.0)


def straight_through(x, q):
    """``q(x)`` forward, the identity backward."""
    return x + jax.lax.stop_gradient(q(x) - x)


def round_to_format(y, mantissa_bits, min_normal):
    """``y`` (float64, within the format's range) to the nearest (ties to even) value of a narrow
    float format: steps of ``2^(e - mantissa_bits)`` in the binade ``[2^e, 2^(e+1))``, of
    ``min_normal * 2^-mantissa_bits`` below ``min_normal``."""
    _, e = jnp.frexp(jnp.maximum(jnp.abs(y), min_normal))  # |y| in [2^(e-1), 2^e)
    step = jnp.ldexp(jnp.ones_like(y), e - 1 - mantissa_bits)
    return jnp.round(y / step) * step


def pow2_scale(amax, max_value):
    """kernel.py ``fast_round_scale``: ``2^ceil(log2(amax * (1 / max)))``, the product in f32."""
    a = (amax.astype(jnp.float32) * jnp.float32(1.0 / max_value)).astype(jnp.float64)
    m, e = jnp.frexp(a)  # a = m 2^e, m in [0.5, 1): a power of two when m == 0.5
    return jnp.ldexp(jnp.ones_like(a), jnp.where(m == 0.5, e - 1, e))


def _fake(x, block, max_value, floor, grid):
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    s = pow2_scale(jnp.maximum(jnp.abs(xb).max(-1), floor), max_value)[..., None]
    return (round_to_format(jnp.clip(xb / s, -max_value, max_value), *grid) * s).reshape(x.shape)


def fake_fp8(x, block):
    """kernel.py ``act_quant(..., inplace=True)`` with ue8m0 scales, straight through."""
    return straight_through(x, lambda a: _fake(a, block, FP8_MAX, FP8_AMAX_FLOOR, E4M3))


def fake_fp4(x, block=32):
    """kernel.py ``fp4_act_quant(..., inplace=True)``, straight through."""
    return straight_through(x, lambda a: _fake(a, block, FP4_MAX, FP4_AMAX_FLOOR, E2M1))


def linear(x, p, name, fp8):
    """model.py ``linear``: ``x @ W.T``, the activation through FP8 first if ``name in fp8``."""
    if name in fp8:
        x = fake_fp8(x, 128)
    return x @ p[name + ".weight"].T


def rms_norm(x, weight, eps):
    return weight * x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps)


def rope(x, angles, inverse=False):
    """Interleaved pairs ``(x[2i], x[2i+1])`` times ``e^{i angle}`` (the conjugate when ``inverse``)."""
    c, s = jnp.cos(angles), jnp.sin(angles) * (-1.0 if inverse else 1.0)
    a, b = x[..., 0::2], x[..., 1::2]
    return jnp.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(x.shape)


def with_rope_last(x, rd, angles, inverse=False):
    return jnp.concatenate([x[..., :-rd], rope(x[..., -rd:], angles, inverse)], axis=-1)


def attention(q, rows, allowed, sink, scale, value_dim=None):
    """Per token ``t``: softmax over the rows ``allowed[t]`` (``[S, R]`` bool, numpy) of
    ``q[t] . rows * scale``, the sink (or none) in the denominator only; values the rows' first
    ``value_dim`` columns. q ``[S, H, D]``, rows ``[R, D]``."""
    logits = jnp.einsum("shd,rd->shr", q, rows) * scale
    mask = jnp.asarray(allowed)[:, None, :]
    m = jax.lax.stop_gradient(jnp.max(jnp.where(mask, logits, -jnp.inf), -1, keepdims=True))
    e = jnp.where(mask, jnp.exp(jnp.where(mask, logits - m, 0.0)), 0.0)
    denom = e.sum(-1)
    if sink is not None:
        denom = denom + jnp.exp(sink[None, :] - m[..., 0])
    values = rows if value_dim is None else rows[:, :value_dim]
    return jnp.einsum("shr,rv->shv", e, values) / denom[..., None]


# ---------------------------------------------------------------- V4

def pool_blocks(kv, score, ratio):
    """tests/deepseek_v4_oracle.py ``pool_blocks``: ``[S, w]`` -> ``[S // ratio, d]``, block j's
    rows in one softmax per channel (with block j - 1's on the first half at ratio 4)."""
    n = kv.shape[0] // ratio
    kv, score = kv[: n * ratio].reshape(n, ratio, -1), score[: n * ratio].reshape(n, ratio, -1)
    if ratio == 4:
        d = kv.shape[-1] // 2
        prev_kv = jnp.concatenate([jnp.zeros((1, ratio, d)), kv[:-1, :, :d]])
        prev_score = jnp.concatenate([jnp.full((1, ratio, d), -jnp.inf), score[:-1, :, :d]])
        kv = jnp.concatenate([prev_kv, kv[:, :, d:]], axis=1)
        score = jnp.concatenate([prev_score, score[:, :, d:]], axis=1)
    e = jnp.exp(score - jax.lax.stop_gradient(score.max(1, keepdims=True)))
    return (e / e.sum(1, keepdims=True) * kv).sum(1)


def v4_forward(p, x, cfg, layer_id, selected, fp8=()):
    """model.py ``Attention.forward`` for one sequence ``x [S, dim]`` from position 0, float64.

    ``p``: the layer's parameters by DeepSeek's names (float64 arrays, FP8 weights dequantised;
    the indexer's are not read). ``selected``: per token, the compressed blocks it attends (numpy;
    the numpy oracle's ``aux["selected"]``). ``fp8``: the names of the FP8 linears. Returns
    ``y [S, dim]``."""
    H, D, rd, eps = cfg["n_heads"], cfg["head_dim"], cfg["rope_head_dim"], cfg["norm_eps"]
    ratio, W = cfg["compress_ratios"][layer_id], cfg["window_size"]
    S = x.shape[0]
    ang = jnp.asarray(v4_oracle.rope_angles(cfg, layer_id, np.arange(S)))

    qr = rms_norm(linear(x, p, "wq_a", fp8), p["q_norm.weight"], eps)
    q = linear(qr, p, "wq_b", fp8).reshape(S, H, D)
    q = with_rope_last(q / jnp.sqrt(jnp.mean(q * q, -1, keepdims=True) + eps), rd, ang[:, None])
    kv = with_rope_last(rms_norm(linear(x, p, "wkv", fp8), p["kv_norm.weight"], eps), rd, ang)
    kv = jnp.concatenate([fake_fp8(kv[:, :-rd], 64), kv[:, -rd:]], axis=-1)

    positions = np.arange(S)
    allowed = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - W)
    rows = kv
    if ratio:
        ape = p["compressor.ape"]
        ckv = x @ p["compressor.wkv.weight"].T
        score = x @ p["compressor.wgate.weight"].T + ape[np.arange(S) % ratio]
        c = rms_norm(pool_blocks(ckv, score, ratio), p["compressor.norm.weight"], eps)
        c = with_rope_last(c, rd, ang[: c.shape[0] * ratio: ratio])
        c = jnp.concatenate([fake_fp8(c[:, :-rd], 64), c[:, -rd:]], axis=-1)
        picked = np.zeros((S, c.shape[0]), bool)
        for t, blocks in enumerate(selected):
            picked[t, np.asarray(blocks, int)] = True
        rows = jnp.concatenate([kv, c])
        allowed = np.concatenate([allowed, picked], axis=1)
    o = attention(q, rows, allowed, p["attn_sink"], D ** -0.5)
    o = with_rope_last(o, rd, ang[:, None], inverse=True)
    G, R = cfg["o_groups"], cfg["o_lora_rank"]
    wo_a = p["wo_a.weight"].reshape(G, R, H * D // G)
    oa = jnp.einsum("sgd,grd->sgr", o.reshape(S, G, H * D // G), wo_a).reshape(S, G * R)
    return linear(oa, p, "wo_b", fp8)


# ---------------------------------------------------------------- V3.2

def v32_forward(p, x, cfg, selected, fp8=()):
    """model.py ``MLA.forward`` in DeepSeek's absorbed (decode) form for one sequence ``x [S, dim]``
    from position 0, float64. ``selected``: per token, the rows it attends (the numpy oracle's
    ``aux["selected"]``); ``p`` and ``fp8`` as :func:`v4_forward`'s (``wkv_b`` is never a linear:
    its dequantised weight is read as it is). Returns ``y [S, dim]``."""
    H, L, eps = cfg["n_heads"], cfg["kv_lora_rank"], cfg["norm_eps"]
    nope, rd, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    S = x.shape[0]
    ang = jnp.asarray(v32_oracle.rope_angles(cfg, np.arange(S)))

    qr = rms_norm(linear(x, p, "wq_a", fp8), p["q_norm.weight"], eps)
    q = linear(qr, p, "wq_b", fp8).reshape(S, H, nope + rd)
    q_nope, q_rope = q[..., :nope], rope(q[..., nope:], ang[:, None])
    kv = linear(x, p, "wkv_a", fp8)
    c = fake_fp8(rms_norm(kv[:, :L], p["kv_norm.weight"], eps), 128)
    k_rope = rope(kv[:, L:], ang)

    wkv_b = p["wkv_b.weight"].reshape(H, nope + dv, L)
    q_latent = jnp.einsum("shd,hdl->shl", q_nope, wkv_b[:, :nope])
    allowed = np.zeros((S, S), bool)
    for t, rows in enumerate(selected):
        allowed[t, np.asarray(rows, int)] = True
    o = attention(jnp.concatenate([q_latent, q_rope], -1), jnp.concatenate([c, k_rope], -1),
                  allowed, None, v32_oracle.softmax_scale(cfg), value_dim=L)
    o = jnp.einsum("shl,hvl->shv", o, wkv_b[:, nope:])
    return linear(o.reshape(S, H * dv), p, "wo", fp8)
