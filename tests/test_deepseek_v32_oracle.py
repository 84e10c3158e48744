"""Self-tests of the DeepSeek V3.2 float64 oracle (tests/deepseek_v32_oracle.py) on hand-checkable cases.

The expected values are worked out by hand or written from DeepSeek's own formulation (its
view / transpose form of the non-interleaved RoPE, its MHA-form prefill), not from the oracle's code.
The arithmetic V3.2 shares with V4 is checked in tests/test_deepseek_v4_oracle.py."""

import math

import numpy as np
import pytest

import deepseek_v32_oracle as oracle
from deepseek_v4_oracle import act_quant, fake_fp8


def test_rope_half_is_deepseeks_non_interleaved_form():
    rng = np.random.default_rng(0)
    x, ang = rng.standard_normal((3, 64)), rng.uniform(-3, 3, (3, 32))
    # model.py apply_rotary_emb(interleaved=False): x.view(2, -1).transpose as complex pairs, times
    # e^{i angle}, view_as_real, then cat(y[0::2], y[1::2])
    z = x.reshape(3, 2, 32).transpose(0, 2, 1)
    z = (z[..., 0] + 1j * z[..., 1]) * np.exp(1j * ang)
    y = np.stack([z.real, z.imag], -1).reshape(3, 64)
    np.testing.assert_allclose(oracle.rope_half(x, ang), np.concatenate([y[:, 0::2], y[:, 1::2]], -1),
                               rtol=0, atol=1e-14)
    # by hand: column 0 pairs with column 32
    e = np.zeros(64)
    e[0] = 1.0
    out = oracle.rope_half(e, np.full(32, math.pi / 2))
    assert abs(out[0]) < 1e-15 and out[32] == pytest.approx(1.0)


def test_layer_norm_by_hand():
    y = oracle.layer_norm([1.0, 2.0, 3.0, 4.0], np.ones(4), np.full(4, 0.5), 0.0)
    np.testing.assert_allclose(y, (np.array([-1.5, -0.5, 0.5, 1.5]) / math.sqrt(1.25)) + 0.5, rtol=1e-15)


def test_index_scores_and_selection_by_hand():
    q8 = np.array([[[1.0, 0.0], [0.0, 2.0]]])            # one token, two heads
    k8 = np.array([[1.0, 1.0], [-1.0, 1.0], [2.0, -1.0]])
    w = np.array([[0.5, -1.0]])
    # row 0: 0.5 * 1 - 1 * 2 = -1.5; row 1: 0.5 * relu(-1) - 1 * 2 = -2; row 2: 0.5 * 2 - 0 = 1
    scores = oracle.index_scores(q8, w, k8, np.array([1.0, 2.0, 0.5]))
    np.testing.assert_allclose(scores, [[-1.5, -4.0, 0.5]])
    rows, margin = oracle.select_rows(scores[0], 2, topk=2)
    assert list(rows) == [2, 0] and margin == pytest.approx(2.5)
    # causal: a token at position 1 sees rows 0 and 1 only; with topk >= p + 1 it reads them all
    rows, margin = oracle.select_rows(scores[0], 1, topk=8)
    assert sorted(rows) == [0, 1] and margin == np.inf
    # ties go to the lower row
    rows, _ = oracle.select_rows(np.array([1.0, 3.0, 3.0, 3.0]), 3, topk=2)
    assert list(rows) == [1, 2]


def test_softmax_scale_and_yarn_switch():
    v32 = dict(qk_nope_head_dim=128, qk_rope_head_dim=64, original_seq_len=4096, rope_factor=40.0,
               mscale=1.0, rope_theta=10000.0, beta_fast=32, beta_slow=1)
    # MLA.__init__: 192^-1/2, times (0.1 ln 40 + 1)^2 = 1.36889^2 when max_seq_len > original_seq_len
    assert oracle.softmax_scale(dict(v32, max_seq_len=4096)) == 192 ** -0.5
    assert oracle.softmax_scale(dict(v32, max_seq_len=16384)) == pytest.approx(192 ** -0.5 * 1.873854, rel=1e-6)
    plain = oracle.rope_angles(dict(v32, max_seq_len=4096), [1])[0]
    np.testing.assert_allclose(plain, 10000.0 ** (-np.arange(0, 64, 2) / 64), rtol=1e-6)
    yarn = oracle.rope_angles(dict(v32, max_seq_len=16384), [1])[0]
    # the fastest frequencies are kept, the slowest divided by rope_factor
    assert yarn[0] == plain[0] and yarn[-1] == pytest.approx(plain[-1] / 40, rel=1e-6)


def test_the_latent_round_trip_is_idempotent():
    # why the MHA form's FP8 wkv_b product reads the latent exactly: act_quant of an FP8-simulated
    # row (power-of-two scales) gives back the same values
    c = fake_fp8(np.random.default_rng(1).standard_normal((5, 256)) * 3, 128)
    q, s = act_quant(c, 128)
    np.testing.assert_array_equal(q * np.repeat(s, 128, -1), c)


def test_absorbed_and_mha_forms_agree():
    cfg = oracle.tiny_v32_config()
    w = oracle.random_v32_weights(cfg, np.random.default_rng(0))
    x = np.random.default_rng(1).standard_normal((20, cfg["dim"]))
    _, a = oracle.v32_attention_f64(x, w, cfg, round_bf16=False)
    _, m = oracle.v32_attention_f64(x, w, cfg, round_bf16=False, form="mha")
    np.testing.assert_allclose(a["attn_out"], m["attn_out"], rtol=0, atol=1e-12)
    # in bf16 they differ by rounding: DeepSeek rounds the absorbed query, the MHA form k_nope and v
    _, a = oracle.v32_attention_f64(x, w, cfg, round_bf16=True)
    _, m = oracle.v32_attention_f64(x, w, cfg, round_bf16=True, form="mha")
    assert np.abs(a["attn_out"] - m["attn_out"]).max() < 0.05 * np.abs(m["attn_out"]).max()


def test_the_indexer_weights_fold_the_query_scales():
    cfg = oracle.tiny_v32_config()
    w = oracle.random_v32_weights(cfg, np.random.default_rng(2))
    x = np.random.default_rng(3).standard_normal((3, cfg["dim"]))
    _, aux = oracle.v32_attention_f64(x, w, cfg, round_bf16=True)
    xb = x.astype(oracle.BF16).astype(np.float64)
    # Indexer.forward: weights_proj(x.float()) * 64^-1/2 ... here 4 heads: * 4^-1/2, f32 (no bf16
    # rounding), then * the head's FP8 query scale * 128^-1/2
    proj = xb @ w["indexer.weights_proj.weight"].astype(np.float64).T * 0.5
    q_scale = aux["index_weights"] / proj / 128 ** -0.5
    assert np.all(np.log2(q_scale) == np.round(np.log2(q_scale)))  # ue8m0: powers of two
    scores = oracle.index_scores(aux["index_q"], aux["index_weights"], aux["index_keys"], aux["index_key_scale"])
    np.testing.assert_array_equal(scores, aux["index_scores"])


def test_released_names_follow_convert_py():
    names = oracle.released_names({"wq_a.weight": 0, "wq_a.scale": 0, "q_norm.weight": 0, "wkv_a.weight": 0,
                                   "kv_norm.weight": 0, "wkv_b.scale": 0, "wo.weight": 0,
                                   "indexer.wk.scale": 0, "indexer.k_norm.bias": 0})
    assert sorted(names) == sorted(["q_a_proj.weight", "q_a_proj.weight_scale_inv", "q_a_layernorm.weight",
                                    "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight",
                                    "kv_b_proj.weight_scale_inv", "o_proj.weight",
                                    "indexer.wk.weight_scale_inv", "indexer.k_norm.bias"])
    w = oracle.random_v32_weights(oracle.tiny_v32_config(), np.random.default_rng(0))
    assert w["wkv_b.scale"].dtype == np.float32 and w["wkv_b.weight"].dtype == oracle.E4M3
