"""A float64 numpy oracle for one DeepSeek V3.2 attention layer, written from DeepSeek's inference code.

Source: DeepSeek-V3.2-Exp ``inference/model.py`` and ``kernel.py`` after commit 8631a81 "fix indexer
rope" (the indexer's RoPE on halves, an f32 ``weights_proj``, MLA's latent through FP8, the attention
products in bf16); GitHub copy memfarbic/DeepSeek-V3.2-Exp @ 87e509a. Each function names the
DeepSeek function it mirrors. The arithmetic V3.2 shares with V4 (``act_quant``, the FP8 ``linear``,
RMSNorm, Hadamard, the YaRN frequencies, interleaved RoPE) is the V4 oracle's
(tests/deepseek_v4_oracle.py, with its own checks). This file never imports jax_sparse_attn or JAX:
it is the independent reference that the library's Flax ``V32Attention`` is tested against.

Precision. ``round_bf16=True`` rounds to bfloat16 wherever DeepSeek's bf16 model stores a bf16 tensor
(the layer input, linear outputs, norms, RoPE, Hadamard, the latent after its FP8 round trip, the
dequantised ``wkv_b``, the absorbed query, the attention output and its value projection); between
those points everything is float64 (DeepSeek: f32). The softmax, its logits and the index scores are
float64 (DeepSeek: bf16 logits and probabilities; f32 index scores). ``round_bf16=False`` drops the
bf16 roundings. The FP8 simulations always apply: they are part of the model.

Two forms of the attention (``form``): ``"absorbed"``, DeepSeek's decode (``q_nope`` times ``wkv_b``'s
key half against the cached latent, values the latent, then ``wkv_b``'s value half), and ``"mha"``,
DeepSeek's prefill (keys and values from ``wkv_b(latent)``, an FP8 product). They differ by rounding
only (a self-test holds them equal in float64).
"""

import math

import numpy as np

from deepseek_v4_oracle import (BF16, E4M3, FP8_MAX, act_quant, bf16, dequant_weight, fake_fp8,
                                hadamard, linear, rms_norm, rope, rope_freqs)

__all__ = ["BF16", "E4M3", "tiny_v32_config", "yarn_on", "softmax_scale", "rope_angles", "rope_half",
           "layer_norm", "index_scores", "select_rows", "v32_attention_f64", "random_v32_weights",
           "released_names"]


def tiny_v32_config(**overrides):
    """A small V3.2 config (DeepSeek ``ModelArgs`` field names; V3.2's rope width, indexer head width
    and YaRN values, with ``original_seq_len`` 64 so that ``max_seq_len`` 256 turns YaRN on)."""
    cfg = dict(dim=256, n_heads=4, q_lora_rank=128, kv_lora_rank=256, qk_nope_head_dim=64,
               qk_rope_head_dim=64, v_head_dim=32, index_n_heads=4, index_head_dim=128, index_topk=8,
               original_seq_len=64, max_seq_len=256, rope_theta=10000.0, rope_factor=40.0,
               beta_fast=32, beta_slow=1, mscale=1.0, dtype="fp8", scale_fmt="ue8m0", norm_eps=1e-6)
    cfg.update(overrides)
    return cfg


def yarn_on(cfg):
    """model.py ``precompute_freqs_cis`` and ``MLA.__init__``: YaRN and mscale only when
    ``max_seq_len > original_seq_len``."""
    return cfg["max_seq_len"] > cfg["original_seq_len"]


def softmax_scale(cfg):
    """``MLA.__init__``: (qk_nope + qk_rope)^-1/2, times (0.1 * mscale * ln(rope_factor) + 1)^2 with YaRN."""
    scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    if yarn_on(cfg):
        scale *= (0.1 * cfg["mscale"] * math.log(cfg["rope_factor"]) + 1.0) ** 2
    return scale


def rope_angles(cfg, positions):
    """The f32 angles float32(t) * freq of ``precompute_freqs_cis`` (``torch.outer``), [len, rd/2]
    float64; YaRN's frequencies when ``yarn_on``."""
    freqs = rope_freqs(cfg["qk_rope_head_dim"], cfg["original_seq_len"] if yarn_on(cfg) else 0,
                       cfg["rope_theta"], cfg["rope_factor"], cfg["beta_fast"], cfg["beta_slow"])
    t = np.asarray(positions, np.float32)[:, None]
    return (t * freqs[None, :]).astype(np.float64)


def rope_half(x, angles):
    """model.py ``apply_rotary_emb(x, freqs_cis, interleaved=False)``: pairs (x[i], x[i + d/2]) times
    e^{i angle_i}; the rotated real parts fill the first half, the imaginary parts the second."""
    x = np.asarray(x, np.float64)
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    c, s = np.cos(angles), np.sin(angles)
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def layer_norm(x, weight, bias, eps):
    """model.py ``LayerNorm.forward`` (``F.layer_norm`` in f32 there): (x - mean) / sqrt(var + eps)
    * w + b, the biased variance."""
    x = np.asarray(x, np.float64)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * np.asarray(weight, np.float64) + np.asarray(bias, np.float64)


def index_scores(q8, weights, k8, k_scale):
    """kernel.py ``fp8_index``: I[s, t] = k_scale[t] * sum_h weights[s, h] * relu(q8[s, h] . k8[t]).
    q8 [S, Hi, Di] and k8 [T, Di] on the e4m3 grid; weights [S, Hi] (the query scales folded in)."""
    logits = np.maximum(np.einsum("shd,td->sht", q8, k8), 0.0)
    return np.einsum("sh,sht->st", weights, logits) * np.asarray(k_scale)[None, :]


def select_rows(scores, p, topk):
    """``Indexer.forward``'s top-k for the token at position p (the causal mask makes rows after p
    -inf): the top min(topk, p + 1) rows t <= p by descending score, ties to the lower row. Returns
    (rows, margin), margin = k-th minus (k+1)-th best score (inf when every row is picked)."""
    sc = scores[: p + 1]
    k = min(topk, p + 1)
    order = np.argsort(-sc, kind="stable")
    margin = sc[order[k - 1]] - sc[order[k]] if 0 < k < p + 1 else np.inf
    return order[:k], margin


def v32_attention_f64(x, weights, cfg, *, round_bf16=True, form="absorbed"):
    """model.py ``MLA.forward`` with ``Indexer.forward`` for one sequence x [S, dim] from position 0
    (rounded to bf16 first when ``round_bf16``). Returns (y [S, dim], aux):

    - ``q_nope`` [S, H, nope], ``q_rope`` [S, H, rd] (after RoPE), ``qr`` [S, q_lora_rank];
    - ``latent`` [S, L] (after kv_norm and the FP8 round trip), ``latent_fp8`` / ``latent_scale``
      (its e4m3 values and per-128 scales), ``rope_key`` [S, rd];
    - ``index_keys`` [S, Di] (e4m3 values) and ``index_key_scale`` [S], ``index_q`` [S, Hi, Di] (e4m3
      values) and ``index_q_scale`` [S, Hi], ``index_weights`` [S, Hi] (query scales folded in);
    - ``index_scores`` [S, S] (row t of token p valid for t <= p), ``selected`` (per token, rows by
      descending score) and ``index_margin`` (per token, as ``select_rows``);
    - ``attn_out`` [S, H, v] (before ``wo``); ``q_latent`` [S, H, L], the absorbed query
      (``form="absorbed"``; else None).
    """
    rb = bf16 if round_bf16 else (lambda a: a)
    fmt = cfg.get("scale_fmt", "ue8m0")
    eps = cfg.get("norm_eps", 1e-6)
    H, L = cfg["n_heads"], cfg["kv_lora_rank"]
    nope, rd, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    Hi, Di = cfg["index_n_heads"], cfg["index_head_dim"]
    x = rb(np.asarray(x, np.float64))
    S = x.shape[0]
    ang = rope_angles(cfg, np.arange(S))

    # query: wq_a -> q_norm -> wq_b, per head [nope | rope]; RoPE (interleaved) on the rope columns
    qr = rb(rms_norm(linear(x, weights, "wq_a", round_bf16, fmt), weights["q_norm.weight"], eps))
    q = linear(qr, weights, "wq_b", round_bf16, fmt).reshape(S, H, nope + rd)
    q_nope, q_rope = q[..., :nope], rb(rope(q[..., nope:], ang[:, None, :]))

    # latent and rope key: wkv_a -> [latent | rope]; kv_norm, FP8 per 128; RoPE (interleaved)
    kv = linear(x, weights, "wkv_a", round_bf16, fmt)
    c = rb(rms_norm(kv[:, :L], weights["kv_norm.weight"], eps))
    c_fp8, c_scale = act_quant(c, 128, fmt)
    c = rb(fake_fp8(c, 128, fmt))
    k_rope = rb(rope(kv[:, L:], ang))

    # indexer: q from qr, k from x through LayerNorm; RoPE on halves of the FIRST rd columns;
    # Hadamard; FP8 per 128 (one block per head); weights in f32 with the query scale folded in
    iq = linear(qr, weights, "indexer.wq_b", round_bf16, fmt).reshape(S, Hi, Di)
    iq[..., :rd] = rb(rope_half(iq[..., :rd], ang[:, None, :]))
    ik = rb(layer_norm(linear(x, weights, "indexer.wk", round_bf16, fmt),
                       weights["indexer.k_norm.weight"], weights["indexer.k_norm.bias"], eps))
    ik[:, :rd] = rb(rope_half(ik[:, :rd], ang))
    q8, q_scale = act_quant(rb(iq @ hadamard(Di).T), 128, fmt)
    k8, k_scale = act_quant(rb(ik @ hadamard(Di).T), 128, fmt)
    w = linear(x, weights, "indexer.weights_proj", False) * Hi ** -0.5   # f32 in DeepSeek: no bf16
    w = w * q_scale[..., 0] * Di ** -0.5
    scores = index_scores(q8, w, k8, k_scale[:, 0])
    picks = [select_rows(scores[p], p, cfg["index_topk"]) for p in range(S)]

    scale = softmax_scale(cfg)
    wkv_b = dequant_weight(weights["wkv_b.weight"], weights.get("wkv_b.scale"))
    o = np.zeros((S, H, dv))
    q_latent = None
    if form == "absorbed":
        # DeepSeek's decode: weight_dequant(wkv_b) to the model dtype (bf16)
        wkv_b = rb(wkv_b).reshape(H, nope + dv, L)
        q_latent = rb(np.einsum("shd,hdl->shl", q_nope, wkv_b[:, :nope]))
        for p, (rows, _) in enumerate(picks):
            logits = (q_latent[p] @ c[rows].T + q_rope[p] @ k_rope[rows].T) * scale
            e = np.exp(logits - logits.max(-1, keepdims=True))
            o_latent = rb((e / e.sum(-1, keepdims=True)) @ c[rows])                # [H, L]
            o[p] = rb(np.einsum("hl,hvl->hv", o_latent, wkv_b[:, nope:]))
    elif form == "mha":
        # DeepSeek's prefill: k_nope and v from wkv_b(latent), an FP8 linear
        kvb = linear(c, weights, "wkv_b", round_bf16, fmt).reshape(S, H, nope + dv)
        for p, (rows, _) in enumerate(picks):
            logits = (np.einsum("hd,thd->ht", q_nope[p], kvb[rows, :, :nope])
                      + q_rope[p] @ k_rope[rows].T) * scale
            e = np.exp(logits - logits.max(-1, keepdims=True))
            o[p] = rb(np.einsum("ht,thv->hv", e / e.sum(-1, keepdims=True), kvb[rows, :, nope:]))
    else:
        raise ValueError(f"form must be 'absorbed' or 'mha'; got {form!r}")
    y = linear(o.reshape(S, H * dv), weights, "wo", round_bf16, fmt)
    aux = dict(qr=qr, q_nope=q_nope, q_rope=q_rope, latent=c, latent_fp8=c_fp8, latent_scale=c_scale,
               rope_key=k_rope, index_q=q8, index_q_scale=q_scale[..., 0], index_weights=w, index_keys=k8, index_key_scale=k_scale[:, 0],
               index_scores=scores, selected=[r for r, _ in picks], index_margin=[m for _, m in picks],
               attn_out=o, q_latent=q_latent)
    return y, aux


# ---------------------------------------------------------------- random weights

def _fp8_weight(rng, out_f, in_f, std):
    """An e4m3 weight with f32 [ceil(out/128), ceil(in/128)] block scales amax / 448 (V3.2's released
    scales are f32, not powers of two); the blocks' magnitudes vary by powers of two (1/2, 1, 2)."""
    w = rng.standard_normal((out_f, in_f)) * std
    bo, bi = -(-out_f // 128), -(-in_f // 128)
    w *= np.kron(2.0 ** rng.integers(-1, 2, (bo, bi)), np.ones((128, 128)))[:out_f, :in_f]
    scale = np.zeros((bo, bi), np.float32)
    for i in range(bo):
        for j in range(bi):
            scale[i, j] = np.abs(w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]).max() / FP8_MAX
    full = np.kron(scale.astype(np.float64), np.ones((128, 128)))[:out_f, :in_f]
    return np.clip(w / full, -FP8_MAX, FP8_MAX).astype(E4M3), scale


def random_v32_weights(cfg, rng, *, fp8=True):
    """Random weights of one layer in DeepSeek's inference names, layouts and dtypes: e4m3 with f32
    block scales for wq_a, wq_b, wkv_a, wkv_b, wo, indexer.wq_b and indexer.wk (bf16 when
    ``fp8=False``); bf16 indexer.weights_proj (as on disk); f32 norms and the indexer's LayerNorm
    bias. Scaled 1/sqrt(fan_in) so that activations stay O(1)."""
    dim, H, L = cfg["dim"], cfg["n_heads"], cfg["kv_lora_rank"]
    nope, rd, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    Hi, Di = cfg["index_n_heads"], cfg["index_head_dim"]
    w = {}

    def big(name, out_f, in_f):
        if fp8:
            w[name + ".weight"], w[name + ".scale"] = _fp8_weight(rng, out_f, in_f, in_f ** -0.5)
        else:
            w[name + ".weight"] = (rng.standard_normal((out_f, in_f)) * in_f ** -0.5).astype(BF16)

    def norm(name, n):
        w[name] = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    big("wq_a", cfg["q_lora_rank"], dim)
    norm("q_norm.weight", cfg["q_lora_rank"])
    big("wq_b", H * (nope + rd), cfg["q_lora_rank"])
    big("wkv_a", L + rd, dim)
    norm("kv_norm.weight", L)
    big("wkv_b", H * (nope + dv), L)
    big("wo", dim, H * dv)
    big("indexer.wq_b", Hi * Di, cfg["q_lora_rank"])
    big("indexer.wk", Di, dim)
    norm("indexer.k_norm.weight", Di)
    w["indexer.k_norm.bias"] = (0.1 * rng.standard_normal(Di)).astype(np.float32)
    w["indexer.weights_proj.weight"] = (rng.standard_normal((Hi, dim)) * dim ** -0.5).astype(BF16)
    return w


# convert.py's mapping, read backwards: the released (Hugging Face) names of MLA's tensors.
_RELEASED = {"wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj", "wkv_a": "kv_a_proj_with_mqa",
             "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}


def released_names(weights):
    """``weights`` (inference names) under the released files' names: MLA's tensors renamed, every
    ``.scale`` as ``.weight_scale_inv``, the indexer's names kept."""
    out = {}
    for name, value in weights.items():
        if name.endswith(".scale"):
            name = name[: -len("scale")] + "weight_scale_inv"
        head, _, rest = name.partition(".")
        out[_RELEASED.get(head, head) + "." + rest] = value
    return out
