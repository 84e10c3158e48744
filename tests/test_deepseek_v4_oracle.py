"""Self-tests of the DeepSeek V4 float64 oracle (tests/deepseek_v4_oracle.py) on hand-checkable cases.

The expected values here are worked out by hand or written from DeepSeek's own vectorised prefill code
(``overlap_transform``, ``get_window_topk_idxs``, ``get_compress_topk_idxs``), not from the oracle."""

import math

import numpy as np
import pytest

from deepseek_v4_oracle import (BF16, E4M3, E8M0, act_quant, bf16, compressor_f64, dequant_weight,
                                fake_fp4, fake_fp8, hadamard, linear, pool_blocks, pow2_scale,
                                random_v4_weights, rope, rope_angles, rope_freqs, sparse_attention,
                                tiny_v4_config, v4_attention_f64, window_positions)


def test_fp8_scale_is_power_of_two_from_f32_bits():
    # 448 * f32(1/448) rounds to exactly 1.0 in f32, so amax 448 keeps scale 1; just above needs 2.
    assert pow2_scale(448.0, 1 / 448) == 1.0
    assert pow2_scale(450.0, 1 / 448) == 2.0
    assert pow2_scale(224.0, 1 / 448) == 0.5
    assert pow2_scale(1e-4, 1 / 448) == 2.0 ** -22  # 1e-4 / 448 = 2^-22.1
    assert pow2_scale(6.0, 1 / 6) == 1.0 and pow2_scale(6.5, 1 / 6) == 2.0


def test_act_quant_known_values():
    x = np.zeros((2, 256))
    x[0, :6] = [448.0, 1 + 1 / 16, 1 + 3 / 16, -3.3, 0.0009, 17.0]  # block 0: scale 1
    x[0, 128] = 1e-6                                                  # block 1: amax clamped to 1e-4
    x[1, :3] = [900.0, 3.0, 5.0]                                      # scale 4: 900/4 = 225, 3/4 -> 0.75
    q, s = act_quant(x, 128)
    np.testing.assert_array_equal(s, [[1.0, 2.0 ** -22], [4.0, 2.0 ** -22]])
    # e4m3: ties to even (1.0625 -> 1, 1.1875 -> 1.25), -3.3 -> -3.25, 0.0009 below 2^-10 -> 0, 17 -> 16
    np.testing.assert_array_equal(q[0, :6], [448.0, 1.0, 1.25, -3.25, 0.0, 16.0])
    assert q[0, 128] == 4.0  # 1e-6 / 2^-22 = 4.19 -> 4 (e4m3 step 0.5 in [4, 8))
    np.testing.assert_array_equal(q[1, :3], [224.0, 0.75, 1.25])
    y = fake_fp8(x, 128)
    np.testing.assert_array_equal(y[1, :3], [896.0, 3.0, 5.0])
    assert y[0, 128] == 4.0 * 2.0 ** -22


def test_fake_fp8_blocks_of_64_are_independent():
    x = np.zeros(128)
    x[0], x[1], x[2], x[64], x[65] = 96.0, 1.1, 100.0, 0.5, 0.3
    y = fake_fp8(x, 64)
    # block 0: scale 2^ceil(log2(100/448)) = 0.25; 1.1/0.25 = 4.4 -> 4.5 (e4m3 step 0.5 in [4, 8));
    # 100/0.25 = 400, a tie between 384 and 416 (step 32) -> 384 (even)
    # block 1: scale 2^ceil(log2(0.5/448)) = 2^-9; 0.3 * 512 = 153.6 -> 160 (step 16 in [128, 256))
    np.testing.assert_array_equal(y[[0, 1, 2, 64, 65]], [96.0, 1.125, 96.0, 0.5, 160 / 512])


def test_fake_fp4_known_values():
    x = np.zeros((3, 32))
    x[0, :6] = [6.0, 0.25, 0.75, 1.25, 2.5, 5.0]  # scale 1; e2m1 ties to even
    x[1, :3] = [12.0, 7.0, -1.0]                  # scale 2: 3.5 -> 4 (even), -0.5 stays
    x[2, :3] = [3.0, 1.3, 0.1]                    # scale 0.5: 2.6 -> 3, 0.2 -> 0
    y = fake_fp4(x, 32)
    np.testing.assert_array_equal(y[0, :6], [6.0, 0.0, 1.0, 1.0, 2.0, 4.0])
    np.testing.assert_array_equal(y[1, :3], [12.0, 8.0, -1.0])
    np.testing.assert_array_equal(y[2, :3], [3.0, 1.5, 0.0])


def test_fp8_linear_is_blockwise_w8a8():
    rng = np.random.default_rng(1)
    w = random_v4_weights(tiny_v4_config(), 0, rng)
    assert w["wkv.weight"].dtype == E4M3 and w["wkv.scale"].dtype == E8M0 and w["wkv.scale"].shape == (1, 2)
    x = bf16(rng.standard_normal((3, 256)) * 3)
    w8 = w["wkv.weight"].astype(np.float64)
    ws = w["wkv.scale"].astype(np.float64)
    expect = np.zeros((3, 128))
    for m in range(3):
        for kb in range(2):
            blk = x[m, kb * 128:(kb + 1) * 128]
            sa = 2.0 ** math.ceil(math.log2(max(np.abs(blk).max(), 1e-4) / 448))
            a8 = np.clip(blk / sa, -448, 448).astype(E4M3).astype(np.float64)
            expect[m] += (w8[:, kb * 128:(kb + 1) * 128] @ a8) * sa * ws[0, kb]
    np.testing.assert_allclose(linear(x, w, "wkv", False), expect, rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(linear(x, w, "wkv", True), bf16(expect))
    # f32 block scales are accepted too
    w32 = dict(w, **{"wkv.scale": ws.astype(np.float32)})
    np.testing.assert_allclose(linear(x, w32, "wkv", False), expect, rtol=1e-13, atol=1e-13)
    assert np.allclose(dequant_weight(w["wo_a.weight"]), w["wo_a.weight"].astype(np.float64))


def test_hadamard_is_orthogonal_sylvester():
    h = hadamard(8)
    np.testing.assert_allclose(h @ h.T, np.eye(8), atol=1e-15)
    np.testing.assert_array_equal(np.abs(h), np.full((8, 8), 8 ** -0.5))
    np.testing.assert_array_equal(np.sign(h[:2]), [[1] * 8, [1, -1] * 4])
    np.testing.assert_array_equal(np.sign(h[:, 7]), [1, -1, -1, 1, -1, 1, 1, -1])
    with pytest.raises(AssertionError):
        hadamard(12)


def test_rope_interleaved_inverse_and_position_zero():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 64))
    ang = rng.uniform(-10, 10, (5, 32))
    y = rope(x, ang)
    np.testing.assert_allclose(rope(y, ang, inverse=True), x, atol=1e-13)
    np.testing.assert_allclose(np.hypot(y[:, 0::2], y[:, 1::2]), np.hypot(x[:, 0::2], x[:, 1::2]))
    e = np.zeros(4)
    e[0] = 1.0  # pair (x0, x1) = (1, 0) rotates to (cos, sin)
    np.testing.assert_allclose(rope(e, np.array([0.3, 0.0])), [math.cos(0.3), math.sin(0.3), 0, 0])
    cfg = tiny_v4_config()
    np.testing.assert_array_equal(rope(x[:1], rope_angles(cfg, 1, [0])), x[:1])


def test_rope_frequencies_plain_and_yarn():
    f32 = np.float32
    plain = rope_freqs(64, 0, 10000.0, 16, 32, 1)
    ref = (1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)).astype(f32)
    assert np.max(np.abs(plain.view(np.int32) - ref.view(np.int32))) <= 1  # within an f32 ulp
    # YaRN, Flash's values: low = floor(15.46) = 15, high = ceil(24.7) = 25; pairs below low keep their
    # frequency, pairs from high on are divided by rope_factor, the ramp (i - 15) / 10 between.
    base = rope_freqs(64, 0, 160000.0, 16, 32, 1)
    yarn = rope_freqs(64, 65536, 160000.0, 16, 32, 1)
    np.testing.assert_array_equal(yarn[:16], base[:16])
    np.testing.assert_array_equal(yarn[25:], base[25:] / f32(16))
    i = 20
    mid = base[i] / f32(16) * f32(0.5) + base[i] * f32(0.5)
    assert yarn[i] == mid
    # layer kinds: ratio 0 uses rope_theta without YaRN, compressed layers compress_rope_theta with it
    cfg = tiny_v4_config()
    t = 1000
    np.testing.assert_array_equal(rope_angles(cfg, 0, [t])[0], (f32(t) * plain).astype(np.float64))
    np.testing.assert_array_equal(rope_angles(cfg, 2, [t])[0], (f32(t) * yarn).astype(np.float64))


def test_pool_one_block_by_hand():
    rng = np.random.default_rng(3)
    kv, sc = rng.standard_normal((7, 6)), rng.standard_normal((7, 6))
    # ratio 4 with overlap (d = 3): block 0 sees only its own rows on channels [3:]; 3 trailing tokens dropped
    out = pool_blocks(kv, sc, 4)
    assert out.shape == (1, 3)
    for c in range(3):
        e = [math.exp(sc[t, 3 + c]) for t in range(4)]
        assert abs(out[0, c] - sum(e[t] * kv[t, 3 + c] for t in range(4)) / sum(e)) < 1e-14
    # ratio 3 without overlap (d = 6): plain per-channel softmax pooling over 3 rows; 2 blocks
    out = pool_blocks(kv, sc, 3)
    assert out.shape == (2, 6)
    for j in range(2):
        for c in range(6):
            e = [math.exp(sc[3 * j + t, c]) for t in range(3)]
            assert abs(out[j, c] - sum(e[t] * kv[3 * j + t, c] for t in range(3)) / sum(e)) < 1e-14


def test_pool_overlap_matches_deepseek_prefill_form():
    """Block j >= 1 pools block j-1's rows on [:d] and block j's on [d:]: DeepSeek's overlap_transform."""
    rng = np.random.default_rng(4)
    S, r, d = 13, 4, 5
    kv, sc = rng.standard_normal((S, 2 * d)), rng.standard_normal((S, 2 * d))
    n = S // r
    kvb, scb = kv[: n * r].reshape(n, r, 2 * d), sc[: n * r].reshape(n, r, 2 * d)

    def overlap_transform(t, value):
        new = np.full((n, 2 * r, d), value)
        new[:, r:] = t[:, :, d:]
        new[1:, :r] = t[:-1, :, :d]
        return new

    k2, s2 = overlap_transform(kvb, 0.0), overlap_transform(scb, -np.inf)
    p = np.exp(s2 - s2.max(1, keepdims=True))
    expect = (k2 * p / p.sum(1, keepdims=True)).sum(1)
    np.testing.assert_allclose(pool_blocks(kv, sc, r), expect, rtol=1e-14, atol=1e-14)


def test_compressor_one_block_post_processing_by_hand():
    cfg = tiny_v4_config()
    rng = np.random.default_rng(5)
    w = random_v4_weights(cfg, 2, rng)  # ratio 8, no overlap, head_dim 128
    x = bf16(rng.standard_normal((9, 256)))
    ang = rope_angles(cfg, 2, np.arange(9))
    out = compressor_f64(x, w, "compressor.", 8, ang, cfg, rotate=False, round_bf16=False)
    assert out.shape == (1, 128)
    kv = x[:8] @ w["compressor.wkv.weight"].astype(np.float64).T
    sc = x[:8] @ w["compressor.wgate.weight"].astype(np.float64).T + w["compressor.ape"].astype(np.float64)
    p = np.exp(sc - sc.max(0))
    c = (p / p.sum(0) * kv).sum(0)
    c = w["compressor.norm.weight"] * c / np.sqrt(np.mean(c * c) + 1e-6)  # position 0: RoPE is identity
    np.testing.assert_allclose(out[0, 64:], c[64:], rtol=1e-13)
    np.testing.assert_array_equal(out[0, :64], fake_fp8(c[:64], 64))
    # the indexer's compressor: Hadamard over all 128 columns, then FP4 in blocks of 32
    wi = random_v4_weights(cfg, 1, rng)
    out = compressor_f64(x[:4], wi, "indexer.compressor.", 4, ang, cfg, rotate=True, round_bf16=False)
    kv = x[:4] @ wi["indexer.compressor.wkv.weight"].astype(np.float64).T
    sc = (x[:4] @ wi["indexer.compressor.wgate.weight"].astype(np.float64).T
          + wi["indexer.compressor.ape"].astype(np.float64))
    p = np.exp(sc[:, 128:] - sc[:, 128:].max(0))
    c = (p / p.sum(0) * kv[:, 128:]).sum(0)
    c = wi["indexer.compressor.norm.weight"] * c / np.sqrt(np.mean(c * c) + 1e-6)
    np.testing.assert_allclose(out[0], fake_fp4(hadamard(128) @ c, 32), rtol=1e-12)


def test_sparse_attention_sink_in_denominator_only():
    rows = np.arange(12.0).reshape(3, 4)
    q = np.zeros((2, 4))  # equal logits: weights 1 / (3 + e^sink)
    o = sparse_attention(q, rows, np.array([0.0, -np.inf]), 0.5)
    np.testing.assert_allclose(o[0], rows.sum(0) / 4)
    np.testing.assert_allclose(o[1], rows.mean(0))
    q = np.array([[0.0, 0.0, 0.0, 2.0]])  # logits 3*0.5*[0.. ] -> with the scale, logits = [3, 7, 11]
    lg = np.array([3.0, 7.0, 11.0])
    expect = (np.exp(lg - 11) @ rows) / (np.exp(lg - 11).sum() + np.exp(1.0 - 11))
    np.testing.assert_allclose(sparse_attention(q, rows, np.array([1.0]), 0.5)[0], expect, rtol=1e-14)


def deepseek_window_idxs(win, seqlen):
    """model.py get_window_topk_idxs, prefill branch (start_pos 0), in numpy."""
    base = np.arange(seqlen)[:, None]
    m = np.clip(base - win + 1, 0, None) + np.arange(min(seqlen, win))
    return np.where(m > base, -1, m)


def deepseek_compress_idxs(ratio, seqlen):
    """model.py get_compress_topk_idxs, prefill branch (offset 0), in numpy."""
    m = np.tile(np.arange(seqlen // ratio), (seqlen, 1))
    return np.where(m >= (np.arange(1, seqlen + 1) // ratio)[:, None], -1, m)


@pytest.fixture(scope="module")
def layers():
    cfg = tiny_v4_config()
    rng = np.random.default_rng(6)
    x = rng.standard_normal((21, cfg["dim"]))
    out = {}
    for layer in range(3):
        w = random_v4_weights(cfg, layer, rng)
        out[layer] = (x, w) + v4_attention_f64(x, w, cfg, layer)
    return cfg, out


def test_window_and_compressed_visibility(layers):
    cfg, out = layers
    S, win = 21, cfg["window_size"]
    ref = deepseek_window_idxs(win, S)
    for p in range(S):
        np.testing.assert_array_equal(window_positions(p, win), ref[p][ref[p] >= 0])
    _, _, _, aux = out[0]
    assert all(len(s) == 0 for s in aux["selected"]) and aux["compressed_kv"].shape == (0, 128)
    _, _, _, aux = out[2]  # ratio 8: every complete block
    ref = deepseek_compress_idxs(8, S)
    for p in range(S):
        np.testing.assert_array_equal(aux["selected"][p], ref[p][ref[p] >= 0])
    assert aux["compressed_kv"].shape == (2, 128) and aux["index_scores"] is None
    _, _, _, aux = out[1]  # ratio 4: the indexer's top min(4, complete blocks)
    assert aux["compressed_kv"].shape == (5, 128) and aux["index_kv"].shape == (5, 128)
    for p in range(S):
        n = (p + 1) // 4
        sc, sel = aux["index_scores"][p], aux["selected"][p]
        assert len(sc) == n and len(sel) == min(4, n) and len(set(sel)) == len(sel)
        rest = np.setdiff1d(np.arange(n), sel)
        if len(rest):
            assert sc[sel].min() - sc[rest].max() == aux["index_margin"][p] >= 0
        w, q, k = aux["index_weights"][p], aux["index_q"][p], aux["index_kv"][:n]
        np.testing.assert_allclose(sc, (w[:, None] * np.maximum(q @ k.T, 0)).sum(0), rtol=1e-12, atol=1e-12)


def test_layer_attention_rows_from_aux(layers):
    cfg, out = layers
    for layer, (x, w, y, aux) in out.items():
        assert y.shape == (21, 256) and np.all(np.isfinite(y))
        np.testing.assert_array_equal(y, bf16(y))
        # key rows: rope columns bf16, non-rope columns on the FP8 grid (blocks of 64)
        np.testing.assert_array_equal(aux["kv"][:, :64], fake_fp8(aux["kv"][:, :64], 64))
        np.testing.assert_allclose(np.sqrt(np.mean(aux["q"] ** 2, -1)), 1.0, rtol=1e-2)
        for p in (0, 7, 20):
            rows = np.concatenate([aux["kv"][aux["window"][p]], aux["compressed_kv"][aux["selected"][p]]])
            logits = aux["q"][p] @ rows.T / math.sqrt(128)
            full = np.concatenate([logits, w["attn_sink"].astype(np.float64)[:, None]], 1)
            prob = np.exp(full - full.max(1, keepdims=True))
            prob /= prob.sum(1, keepdims=True)
            np.testing.assert_allclose(aux["attn_out"][p], prob[:, :-1] @ rows, rtol=1e-2, atol=1e-3)


def test_weights_layout_and_unrounded_mode():
    cfg = tiny_v4_config()
    rng = np.random.default_rng(7)
    w = random_v4_weights(cfg, 1, rng)
    assert w["wq_b.weight"].shape == (512, 128) and w["wq_b.scale"].shape == (4, 1)
    assert w["wo_a.weight"].dtype == BF16 and w["wo_a.weight"].shape == (128, 256)
    assert w["wo_b.scale"].shape == (2, 1) and w["indexer.wq_b.scale"].dtype == E8M0
    assert w["compressor.wkv.weight"].shape == (256, 256) and w["compressor.ape"].shape == (4, 256)
    assert w["indexer.compressor.ape"].shape == (4, 256) and w["attn_sink"].dtype == np.float32
    assert w["indexer.weights_proj.weight"].dtype == BF16
    x = rng.standard_normal((9, 256))
    y, aux = v4_attention_f64(x, w, cfg, 1, round_bf16=False)
    assert np.all(np.isfinite(y)) and not np.array_equal(y, bf16(y))
    w16 = random_v4_weights(cfg, 2, rng, fp8=False)
    assert w16["wq_a.weight"].dtype == BF16 and "wq_a.scale" not in w16
    y, aux = v4_attention_f64(x, w16, cfg, 2)
    assert np.all(np.isfinite(y)) and aux["compressed_kv"].shape == (1, 128)
