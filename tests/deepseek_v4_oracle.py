"""A float64 numpy oracle for one DeepSeek V4 attention layer, written from DeepSeek's inference code.

Source: DeepSeek-V4-Flash ``inference/model.py`` and ``kernel.py`` (GitHub copy
Mockingjay1316/deepseek-v4-flash-spark @ 0825add). Each function names the DeepSeek function it
mirrors. This file never imports jax_sparse_attn or JAX: it is the independent reference that the
library's Flax ``V4Attention`` is tested against.

Precision. ``round_bf16=True`` rounds to bfloat16 wherever DeepSeek's bf16 model stores a bf16 tensor
(the layer input, linear outputs, norms, RoPE, Hadamard, attention output, the ``wo_a`` einsum);
everything between those points is float64 (DeepSeek: f32), and the attention softmax and the index
scores are float64 (DeepSeek: bf16 probabilities before P.V, bf16 index scores). ``round_bf16=False``
drops the bf16 roundings. The FP8/FP4 simulations always apply: they are part of the model.

The KV rows' in-place FP8 simulation rounds to e4m3 (as DeepSeek-V4-Pro's ``kernel_tilelang.py`` and
the deployed FP8 caches do). Flash 0825add's ``act_quant_kernel`` casts the in-place value to
``out_dtype``, which it has just set to ``in_dtype`` (bf16) (kernel.py lines 55 and 86-91), so that
text only clamps and does not round.
"""

import math

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu
E2M1 = ml_dtypes.float4_e2m1fn
FP8_MAX, FP4_MAX = 448.0, 6.0


def tiny_v4_config(**overrides):
    """A small V4 config (DeepSeek ``ModelArgs`` field names; Flash's rope/YaRN values).
    Layer 0 is window-only, layer 1 ratio 4 (compressor + indexer), layer 2 ratio 8 (every block)."""
    cfg = dict(dim=256, n_heads=4, head_dim=128, rope_head_dim=64, q_lora_rank=128, o_groups=2,
               o_lora_rank=64, window_size=8, compress_ratios=[0, 4, 8], compress_rope_theta=160000.0,
               original_seq_len=65536, rope_theta=10000.0, rope_factor=16, beta_fast=32, beta_slow=1,
               index_n_heads=4, index_head_dim=128, index_topk=4, norm_eps=1e-6, scale_fmt="ue8m0",
               max_seq_len=256)
    cfg.update(overrides)
    return cfg


def bf16(x):
    """Round to bfloat16 (nearest even) and back to float64."""
    return np.asarray(x, np.float64).astype(BF16).astype(np.float64)


# ---------------------------------------------------------------- quantisation (kernel.py)

def pow2_scale(amax, max_inv):
    """kernel.py ``fast_round_scale``: 2^ceil(log2(amax * max_inv)), the product an f32 one (``max_inv``
    is an f32 constant), ceil(log2) read from the IEEE exponent and mantissa bits (``fast_log2_ceil``)."""
    a = np.asarray(amax, np.float32) * np.float32(max_inv)
    bits = a.view(np.uint32).astype(np.int64)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0)
    return np.ldexp(1.0, e)


def act_quant(x, block=128, scale_fmt="ue8m0"):
    """kernel.py ``act_quant`` (not in place): per row and block of ``block`` columns, amax clamped to 1e-4,
    scale s (a power of two with ue8m0), q = e4m3(clamp(x / s, +-448)). Returns (q, s) as float64,
    q [..., N] on the e4m3 grid and s [..., N / block]."""
    x = np.asarray(x, np.float64)
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = np.maximum(np.abs(xb).max(-1, initial=0.0), 1e-4)
    if scale_fmt:
        s = pow2_scale(amax, 1 / FP8_MAX)
    else:
        s = (amax.astype(np.float32) * np.float32(1 / FP8_MAX)).astype(np.float64)
    q = np.clip(xb / s[..., None], -FP8_MAX, FP8_MAX).astype(E4M3).astype(np.float64)
    return q.reshape(x.shape), s


def fake_fp8(x, block=64, scale_fmt="ue8m0"):
    """kernel.py ``act_quant(x, block, scale_fmt, inplace=True)``: quantise to e4m3 and scale back."""
    q, s = act_quant(x, block, scale_fmt)
    return (q.reshape(*s.shape, block) * s[..., None]).reshape(q.shape)


def fake_fp4(x, block=32):
    """kernel.py ``fp4_act_quant(x, 32, inplace=True)``: amax clamped to 6 * 2^-126, s a power of two
    (``fast_round_scale(amax, 1/6)``), e2m1(clamp(x / s, +-6)) * s."""
    x = np.asarray(x, np.float64)
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = np.maximum(np.abs(xb).max(-1, initial=0.0), FP4_MAX * 2.0 ** -126)
    s = pow2_scale(amax, 1 / FP4_MAX)[..., None]
    q = np.clip(xb / s, -FP4_MAX, FP4_MAX).astype(E2M1).astype(np.float64)
    return (q * s).reshape(x.shape)


def dequant_weight(w, scale=None):
    """An FP8 weight times its [ceil(out/128), ceil(in/128)] block scales (e8m0 or f32); others as float64."""
    w64 = np.asarray(w).astype(np.float64)
    if scale is None:
        return w64
    s = np.asarray(scale).astype(np.float64)
    full = np.kron(s, np.ones((128, 128)))[: w64.shape[0], : w64.shape[1]]
    return w64 * full


def linear(x, weights, name, round_bf16, scale_fmt="ue8m0"):
    """model.py ``linear``: an e4m3 weight is ``fp8_gemm(act_quant(x, 128), W8, scale)`` (W8A8, both
    operands dequantised, the sum in float64); any other weight is a plain ``F.linear``. The output is
    stored in the model dtype (bf16)."""
    w = weights[name + ".weight"]
    if w.dtype == E4M3:
        q, s = act_quant(x, 128, scale_fmt)
        x = (q.reshape(*s.shape, 128) * s[..., None]).reshape(q.shape)
        y = x @ dequant_weight(w, weights[name + ".scale"]).T
    else:
        y = np.asarray(x, np.float64) @ dequant_weight(w).T
    return bf16(y) if round_bf16 else y


def rms_norm(x, weight, eps):
    """model.py ``RMSNorm.forward``: w * x / sqrt(mean(x^2) + eps) (f32 there, float64 here)."""
    x = np.asarray(x, np.float64)
    return np.asarray(weight, np.float64) * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def hadamard(d):
    """The Sylvester Hadamard matrix scaled by d^-1/2 (``rotate_activation``; d a power of two)."""
    assert d & (d - 1) == 0, "Hadamard needs a power of two"
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h * d ** -0.5


# ---------------------------------------------------------------- RoPE (model.py)

def rope_freqs(dim, original_seq_len, base, factor, beta_fast, beta_slow):
    """model.py ``precompute_freqs_cis`` frequencies, float32 step by step (pow rounded from float64);
    YaRN whenever ``original_seq_len > 0`` (V4 does not compare it with max_seq_len)."""
    f32 = np.float32
    expo = np.arange(0, dim, 2, dtype=f32) / f32(dim)
    freqs = f32(1.0) / (f32(base) ** expo.astype(np.float64)).astype(f32)
    if original_seq_len > 0:
        def corr(rot):
            return dim * math.log(original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1).astype(f32)
        smooth = f32(1) - ramp
        freqs = freqs / f32(factor) * (f32(1) - smooth) + freqs * smooth
    return freqs.astype(f32)


def rope_angles(cfg, layer_id, positions):
    """The f32 angle float32(t) * freq that ``torch.outer(t, freqs)`` gives, as [len, rd/2] float64.
    Ratio-0 layers: rope_theta, no YaRN; compressed layers: compress_rope_theta with YaRN."""
    ratio = cfg["compress_ratios"][layer_id]
    orig, base = (cfg["original_seq_len"], cfg["compress_rope_theta"]) if ratio else (0, cfg["rope_theta"])
    freqs = rope_freqs(cfg["rope_head_dim"], orig, base, cfg["rope_factor"], cfg["beta_fast"], cfg["beta_slow"])
    t = np.asarray(positions, np.float32)[:, None]
    return (t * freqs[None, :]).astype(np.float64)


def rope(x, angles, inverse=False):
    """model.py ``apply_rotary_emb``: interleaved pairs (x[2i], x[2i+1]) times e^{i angle} (conjugate when
    ``inverse``). ``angles`` broadcasts against x[..., ::2]."""
    x = np.asarray(x, np.float64)
    c, s = np.cos(angles), np.sin(angles) * (-1.0 if inverse else 1.0)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


# ---------------------------------------------------------------- compressor, indexer, attention

def pool_blocks(kv, score, ratio):
    """The pooling of model.py ``Compressor.forward`` (prefill branch; ``overlap_transform`` at ratio 4).

    kv, score: [S, w] with the ape already added to score; block j = tokens j*r .. j*r+r-1, a partial
    trailing block is dropped. No overlap (w = d): c_j = sum over the block's r rows of
    softmax_rows(score) * kv, per channel. Overlap (ratio 4, w = 2d): block j pools block j-1's rows on
    channels [:d] and its own rows on channels [d:], 2r rows in one softmax per channel; block 0's
    previous rows are kv 0, score -inf. Returns [S // r, d]."""
    n_blocks = kv.shape[0] // ratio
    d = kv.shape[1] // 2 if ratio == 4 else kv.shape[1]
    out = np.zeros((n_blocks, d))
    for j in range(n_blocks):
        cur = slice(j * ratio, (j + 1) * ratio)
        if ratio == 4:
            if j > 0:
                prev = slice((j - 1) * ratio, j * ratio)
                pkv, psc = kv[prev, :d], score[prev, :d]
            else:
                pkv, psc = np.zeros((ratio, d)), np.full((ratio, d), -np.inf)
            rows, sc = np.concatenate([pkv, kv[cur, d:]]), np.concatenate([psc, score[cur, d:]])
        else:
            rows, sc = kv[cur], score[cur]
        p = np.exp(sc - sc.max(0))
        out[j] = (p / p.sum(0) * rows).sum(0)
    return out


def compressor_f64(x, weights, prefix, ratio, angles, cfg, *, rotate, round_bf16=True):
    """model.py ``Compressor.forward`` over a whole sequence from position 0.

    kv = wkv(x), score = wgate(x) + ape[p mod r] (f32 there, float64 here), pooled by ``pool_blocks``;
    then ``kv.to(bf16)``, RMSNorm, RoPE at position j*r on the last rope_head_dim columns, and the
    quantisation simulation: fake FP8 (blocks of 64) on the non-rope columns, or with ``rotate`` (the
    indexer's compressor) Hadamard then fake FP4 (blocks of 32) on all columns.
    x: [S, dim] (already bf16-rounded by the caller); angles: [S, rd/2]. Returns [S // r, d]."""
    rb = bf16 if round_bf16 else (lambda a: a)
    rd, eps = cfg["rope_head_dim"], cfg["norm_eps"]
    x = np.asarray(x, np.float64)
    ape = np.asarray(weights[prefix + "ape"], np.float64)
    kv = x @ dequant_weight(weights[prefix + "wkv.weight"]).T
    score = x @ dequant_weight(weights[prefix + "wgate.weight"]).T + ape[np.arange(x.shape[0]) % ratio]
    out = pool_blocks(kv, score, ratio)
    n_blocks, d = out.shape
    out = rb(rms_norm(rb(out), weights[prefix + "norm.weight"], eps))
    out[:, -rd:] = rb(rope(out[:, -rd:], angles[: n_blocks * ratio : ratio]))
    if rotate:
        return fake_fp4(rb(out @ hadamard(d).T), 32)
    out[:, :-rd] = fake_fp8(out[:, :-rd], 64, cfg.get("scale_fmt", "ue8m0"))
    return out


def window_positions(p, window_size):
    """model.py ``get_window_topk_idxs`` (prefill): raw rows max(0, p - win + 1) .. p."""
    return np.arange(max(0, p - window_size + 1), p + 1)


def sparse_attention(q, rows, sink, scale):
    """kernel.py ``sparse_attn`` for one token: q [H, D], rows [T, D] (key = value), sink [H] in the
    denominator only (not in the max). float64."""
    logits = q @ rows.T * scale
    m = logits.max(-1, keepdims=True)
    e = np.exp(logits - m)
    denom = e.sum(-1) + np.exp(np.asarray(sink, np.float64) - m[:, 0])
    return (e @ rows) / denom[:, None]


def v4_attention_f64(x, weights, cfg, layer_id, *, round_bf16=True):
    """model.py ``Attention.forward`` (with ``Indexer.forward`` on ratio-4 layers) for one sequence
    x [S, dim] from position 0 (rounded to bf16 first when ``round_bf16``). Returns (y [S, dim], aux):

    - ``qr`` [S, q_lora_rank] (the low-rank query after q_norm), ``q`` [S, H, D] (after the per-head
      RMS and RoPE), ``kv`` [S, D] raw rows as attended (FP8 sim),
      ``compressed_kv`` [S // r, D] compressed rows as attended ([0, D] at ratio 0);
    - ``window`` / ``selected``: per token, the raw positions and compressed block ids attended
      (ratio 4: the indexer's picks by descending score, ties to the lower id);
    - ``index_scores`` (ratio 4, else None): per token, float64 scores over its complete blocks;
      ``index_margin``: per token, k-th minus (k+1)-th best score (inf when every block is picked);
      ``index_q`` [S, Hi, Di], ``index_kv`` [S // 4, Di], ``index_weights`` [S, Hi];
    - ``attn_out`` [S, H, D] (before the inverse RoPE), ``wo_a_out`` [S, G * R].

    Where this differs from DeepSeek beyond float64-vs-f32: the per-head query RMS is float64 then one
    bf16 rounding (model.py line 498 runs square, mean, rsqrt and the product in bf16); the index
    weights are bf16(weights_proj(x)) times the scale in float64 (DeepSeek rounds the product to bf16);
    the softmax probabilities are not rounded to bf16 before P.V (kernel.py line 340)."""
    rb = bf16 if round_bf16 else (lambda a: a)
    fmt = cfg.get("scale_fmt", "ue8m0")
    H, D, rd, eps = cfg["n_heads"], cfg["head_dim"], cfg["rope_head_dim"], cfg.get("norm_eps", 1e-6)
    cfg = dict(cfg, norm_eps=eps)
    ratio, win = cfg["compress_ratios"][layer_id], cfg["window_size"]
    x = rb(np.asarray(x, np.float64))
    S = x.shape[0]
    ang = rope_angles(cfg, layer_id, np.arange(S))

    # q: wq_a -> q_norm -> wq_b -> per-head RMS (no weight) -> RoPE on the last rd columns
    qr = rb(rms_norm(linear(x, weights, "wq_a", round_bf16, fmt), weights["q_norm.weight"], eps))
    q = linear(qr, weights, "wq_b", round_bf16, fmt).reshape(S, H, D)
    q = rb(q / np.sqrt(np.mean(q * q, -1, keepdims=True) + eps))
    q[..., -rd:] = rb(rope(q[..., -rd:], ang[:, None, :]))

    # raw kv rows: wkv -> kv_norm -> RoPE -> fake FP8 on the non-rope columns
    kv = rb(rms_norm(linear(x, weights, "wkv", round_bf16, fmt), weights["kv_norm.weight"], eps))
    kv[:, -rd:] = rb(rope(kv[:, -rd:], ang))
    kv[:, :-rd] = fake_fp8(kv[:, :-rd], 64, fmt)

    aux = dict(qr=qr, q=q, kv=kv, compressed_kv=np.zeros((0, D)), index_scores=None, index_margin=None,
               window=[window_positions(p, win) for p in range(S)], selected=[])
    nb = [(p + 1) // ratio if ratio else 0 for p in range(S)]  # complete blocks visible to token p
    if ratio:
        aux["compressed_kv"] = compressor_f64(x, weights, "compressor.", ratio, ang, cfg, rotate=False,
                                              round_bf16=round_bf16)
    if ratio == 4:  # the indexer picks the top min(index_topk, complete blocks) blocks
        Hi, Di = cfg["index_n_heads"], cfg["index_head_dim"]
        iq = linear(qr, weights, "indexer.wq_b", round_bf16, fmt).reshape(S, Hi, Di)
        iq[..., -rd:] = rb(rope(iq[..., -rd:], ang[:, None, :]))
        iq = fake_fp4(rb(iq @ hadamard(Di).T), 32)
        ik = compressor_f64(x, weights, "indexer.compressor.", 4, ang, cfg, rotate=True, round_bf16=round_bf16)
        w = linear(x, weights, "indexer.weights_proj", round_bf16) * (Di ** -0.5 * Hi ** -0.5)
        scores = np.einsum("sh,shn->sn", w, np.maximum(np.einsum("shd,nd->shn", iq, ik), 0.0))
        aux.update(index_q=iq, index_kv=ik, index_weights=w, index_scores=[], index_margin=[])
        for p in range(S):
            sc = scores[p, : nb[p]]
            k = min(cfg["index_topk"], nb[p])
            order = np.argsort(-sc, kind="stable")
            aux["index_scores"].append(sc)
            aux["selected"].append(order[:k])
            aux["index_margin"].append(sc[order[k - 1]] - sc[order[k]] if 0 < k < nb[p] else np.inf)
    else:
        aux["selected"] = [np.arange(n) for n in nb]

    o = np.zeros((S, H, D))
    sink = np.asarray(weights["attn_sink"], np.float64)
    for p in range(S):
        rows = np.concatenate([kv[aux["window"][p]], aux["compressed_kv"][aux["selected"][p]]])
        o[p] = sparse_attention(q[p], rows, sink, D ** -0.5)
    o = rb(o)
    aux["attn_out"] = o.copy()
    o[..., -rd:] = rb(rope(o[..., -rd:], ang[:, None, :], inverse=True))

    # grouped low-rank output: o [S, G, H*D/G] against wo_a [G, R, H*D/G], then wo_b
    G, R = cfg["o_groups"], cfg["o_lora_rank"]
    wo_a = dequant_weight(weights["wo_a.weight"]).reshape(G, R, H * D // G)
    oa = rb(np.einsum("sgd,grd->sgr", o.reshape(S, G, H * D // G), wo_a)).reshape(S, G * R)
    aux["wo_a_out"] = oa
    return linear(oa, weights, "wo_b", round_bf16, fmt), aux


# ---------------------------------------------------------------- random weights

def _fp8_weight(rng, out_f, in_f, std):
    """An e4m3 weight with e8m0 [ceil(out/128), ceil(in/128)] block scales; the blocks' magnitudes vary
    by powers of two (1/2, 1, 2) so that the scales differ."""
    w = rng.standard_normal((out_f, in_f)) * std
    bo, bi = -(-out_f // 128), -(-in_f // 128)
    w *= np.kron(2.0 ** rng.integers(-1, 2, (bo, bi)), np.ones((128, 128)))[:out_f, :in_f]
    amax = np.zeros((bo, bi))
    for i in range(bo):
        for j in range(bi):
            amax[i, j] = np.abs(w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]).max()
    scale = np.ldexp(1.0, np.ceil(np.log2(amax / FP8_MAX)).astype(int))
    q = np.clip(w / np.kron(scale, np.ones((128, 128)))[:out_f, :in_f], -FP8_MAX, FP8_MAX)
    return q.astype(E4M3), scale.astype(E8M0)


def random_v4_weights(cfg, layer_id, rng, *, fp8=True):
    """Random weights for layer ``layer_id`` in DeepSeek's inference names, layouts and dtypes: FP8 e4m3 +
    e8m0 block scales for wq_a, wq_b, wkv, wo_b, indexer.wq_b (bf16 when ``fp8=False``); bf16 wo_a,
    indexer.weights_proj and compressor wkv/wgate (as on disk); f32 norms, ape and attn_sink. Scaled
    1/sqrt(fan_in) so that activations stay O(1)."""
    dim, H, D = cfg["dim"], cfg["n_heads"], cfg["head_dim"]
    G, R, ratio = cfg["o_groups"], cfg["o_lora_rank"], cfg["compress_ratios"][layer_id]
    w = {}

    def big(name, out_f, in_f):
        if fp8:
            w[name + ".weight"], w[name + ".scale"] = _fp8_weight(rng, out_f, in_f, in_f ** -0.5)
        else:
            w[name + ".weight"] = (rng.standard_normal((out_f, in_f)) * in_f ** -0.5).astype(BF16)

    def small(name, out_f, in_f):
        w[name] = (rng.standard_normal((out_f, in_f)) * in_f ** -0.5).astype(BF16)

    def norm(name, n):
        w[name] = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def compressor(prefix, d):
        coff = 2 if ratio == 4 else 1
        small(prefix + "wkv.weight", coff * d, dim)
        small(prefix + "wgate.weight", coff * d, dim)
        w[prefix + "ape"] = (0.5 * rng.standard_normal((ratio, coff * d))).astype(np.float32)
        norm(prefix + "norm.weight", d)

    big("wq_a", cfg["q_lora_rank"], dim)
    norm("q_norm.weight", cfg["q_lora_rank"])
    big("wq_b", H * D, cfg["q_lora_rank"])
    big("wkv", D, dim)
    norm("kv_norm.weight", D)
    small("wo_a.weight", G * R, H * D // G)
    big("wo_b", dim, G * R)
    w["attn_sink"] = rng.standard_normal(H).astype(np.float32)
    if ratio:
        compressor("compressor.", D)
    if ratio == 4:
        big("indexer.wq_b", cfg["index_n_heads"] * cfg["index_head_dim"], cfg["q_lora_rank"])
        small("indexer.weights_proj.weight", cfg["index_n_heads"], dim)
        compressor("indexer.compressor.", cfg["index_head_dim"])
    return w
