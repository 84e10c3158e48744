"""Packing for the NKI kernels and unpacking of their output, against plain numpy loops."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_sparse_attn.constants import BIAS_PREFIX_COLS, EMPTY_LOGIT, EMPTY_SLOT_INDEX, SCALE_COL, UP_COLS
from jax_sparse_attn.attention import packing

BF16 = ml_dtypes.bfloat16


def flashmla_invalid(R):
    """FlashMLA's test set of invalid indices for a cache of R rows (docs/contract.md)."""
    return [-(2**31), -123456, -1, R, R + 114514, 2**31 - 1]


def to_bf16(x):
    return np.asarray(x, np.float32).astype(BF16)


@pytest.mark.parametrize(
    "H, groups, per_group", [(1, 1, 1), (64, 1, 64), (128, 1, 128), (129, 2, 65), (130, 2, 65),
                             (200, 2, 100), (256, 2, 128), (300, 3, 100)]
)
def test_head_groups_have_at_most_128_heads(H, groups, per_group):
    layout = packing.kernel_layout(3, H, 64, 10)
    assert (layout.head_groups, layout.heads_per_group) == (groups, per_group)
    assert layout.heads_per_group <= 128
    assert layout.head_groups * layout.heads_per_group >= H
    # Padding heads never fill a whole group.
    assert layout.head_groups * layout.heads_per_group - H < layout.head_groups


@pytest.mark.parametrize("D, Dp", [(0, 1), (1, 1), (64, 64), (576, 576), (1024, 1024)])
@pytest.mark.parametrize("K, Kp", [(1, 128), (100, 128), (128, 128), (129, 256), (2048, 2048)])
def test_slots_padded_to_tiles_and_dim_kept(D, Dp, K, Kp):
    layout = packing.kernel_layout(2, 4, D, K)
    assert (layout.dim_padded, layout.slots_padded) == (Dp, Kp)


@pytest.mark.parametrize("T, programs, Tp", [(1, 1, 1), (1, 2, 2), (3, 2, 4), (16, 2, 16)])
def test_tokens_padded_to_the_launch_grid(T, programs, Tp):
    assert packing.kernel_layout(T, 4, 64, 10, programs).tokens_padded == Tp


def _inputs(rng, T, H, D, K):
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    sink = rng.standard_normal(H).astype(np.float32)
    bias = rng.standard_normal((T, K)).astype(np.float32)
    scale = rng.uniform(0.05, 0.2, T).astype(np.float32)
    return q, sink, bias, scale


def _check_common(packed, layout, q, sink, bias, scale, valid):
    """q groups, sink groups and the bias tensor, element by element."""
    T, H, D = q.shape
    K = bias.shape[1]
    G, Hg = layout.head_groups, layout.heads_per_group
    Dp, Kp = layout.dim_padded, layout.slots_padded
    Tp = layout.tokens_padded
    q_groups = np.asarray(packed.q_groups)
    assert q_groups.shape == (G, Tp, Hg, Dp) and q_groups.dtype == BF16
    np.testing.assert_array_equal(q_groups[:, T:].astype(np.float32), 0)  # padding tokens
    sink_groups = np.asarray(packed.sink_groups)
    assert sink_groups.shape == (G, Hg, 1) and sink_groups.dtype == np.float32
    packed_bias = np.asarray(packed.bias)
    # The dot products' overflow guard (docs/contract.md): q[t] scaled down by 2**k, k the smallest
    # with max |q[t]| * 2**-k < 1 / (2 D) (k >= 0); the kernel multiplies back by up1 * up2 = 2**k.
    up = packed_bias[:T, UP_COLS[0]].astype(np.float64) * packed_bias[:T, UP_COLS[1]]
    for t in range(T):
        top = np.abs(to_bf16(q[t]).astype(np.float64)).max()
        k = int(np.log2(up[t]))
        assert up[t] == 2.0**k and k >= 0
        assert top / up[t] < 1 / (2 * D) and (k == 0 or top / up[t] * 2 >= 1 / (4 * D))
    for g in range(G):
        for h in range(Hg):
            head = g * Hg + h
            for t in range(T):
                row = q_groups[g, t, h].astype(np.float32)
                if head < H:
                    scaled = (to_bf16(q[t, head]).astype(np.float64) / up[t]).astype(np.float32)
                    np.testing.assert_array_equal(row[:D], scaled)
                else:
                    np.testing.assert_array_equal(row[:D], 0)
                np.testing.assert_array_equal(row[D:], 0)
            expected_sink = sink[head] if head < H else -np.inf
            assert sink_groups[g, h, 0] == expected_sink

    assert packed_bias.shape == (Tp, BIAS_PREFIX_COLS + Kp) and packed_bias.dtype == np.float32
    np.testing.assert_array_equal(packed_bias[T:, BIAS_PREFIX_COLS:], np.float32(EMPTY_LOGIT))
    for t in range(T):
        assert packed_bias[t, SCALE_COL] == scale[t]
        others = [c for c in range(BIAS_PREFIX_COLS) if c not in (SCALE_COL, *UP_COLS)]
        np.testing.assert_array_equal(packed_bias[t, others], 0)
        for j in range(Kp):
            expected = bias[t, j] if j < K and valid[t, j] else EMPTY_LOGIT
            assert packed_bias[t, BIAS_PREFIX_COLS + j] == np.float32(expected)
    np.testing.assert_array_equal(np.asarray(packed.row_has_slot), valid.any(axis=1))


@pytest.mark.parametrize(
    "T, H, D, K, programs", [(2, 130, 64, 100, 1),
                             pytest.param(3, 1, 576, 1, 2, marks=pytest.mark.slow),
                             pytest.param(1, 200, 128, 129, 2, marks=pytest.mark.slow)]
)
def test_pack_gathered(T, H, D, K, programs):
    rng = np.random.default_rng(0)
    q, sink, bias, scale = _inputs(rng, T, H, D, K)
    g = rng.standard_normal((T, K, D)).astype(np.float32)
    bias[0, 0] = -np.inf  # an empty slot by bias
    bias[T - 1, :] = -np.inf  # a token with no valid slot
    g[np.isneginf(bias)] = np.nan  # rows of empty slots: never reach the kernel
    packed, layout = packing.pack_for_kernel(
        jnp.asarray(q), jnp.asarray(g), jnp.asarray(sink), jnp.asarray(bias), jnp.asarray(scale),
        programs=programs,
    )
    valid = bias != -np.inf
    _check_common(packed, layout, q, sink, bias, scale, valid)
    assert packed.idx is None
    Kp, Dp, Tp = layout.slots_padded, layout.dim_padded, layout.tokens_padded
    assert Tp % programs == 0 and Tp - T < programs
    rows = np.asarray(packed.slot_rows)
    assert rows.shape == (Tp, Kp, Dp) and rows.dtype == BF16
    for t in range(Tp):
        for j in range(Kp):
            row = rows[t, j].astype(np.float32)
            if t < T and j < K and valid[t, j]:
                np.testing.assert_array_equal(row, to_bf16(g[t, j]).astype(np.float32))
            else:
                np.testing.assert_array_equal(row, 0)  # empty, padding slot or token: zeros


def _idx_case(rng, T, H, D, K, R):
    q, sink, bias, scale = _inputs(rng, T, H, D, K)
    kv = rng.standard_normal((R, D)).astype(np.float32)
    idx = rng.integers(0, R, (T, K)).astype(np.int64)
    invalid = np.array(flashmla_invalid(R), np.int64)
    for j, bad in enumerate(invalid[: min(K, len(invalid))]):
        idx[0, j] = bad
    idx[1, :] = invalid[np.arange(K) % len(invalid)]  # token 1: no valid slot at all
    bias[T - 1, K - 1] = -np.inf  # a valid index made empty by its bias
    # The primitive receives int32 with -1 for every out-of-range index (api._normalise_idx).
    prim_idx = np.where((idx >= 0) & (idx < R), idx, -1).astype(np.int32)
    valid = (idx >= 0) & (idx < R) & (bias != -np.inf)
    return q, sink, bias, scale, kv, idx, prim_idx, valid


@pytest.mark.parametrize("T, H, D, K, R", [(2, 130, 64, 100, 37),
                                           pytest.param(4, 64, 576, 7, 5, marks=pytest.mark.slow)])
def test_pack_idx_gathered_by_xla_for_trn1_zeroes_empty_slots(T, H, D, K, R):
    """trn1: the rows are gathered before the kernel; an empty slot's row is zeros, never a row of
    the cache (row 0 holds NaN here)."""
    rng = np.random.default_rng(4)
    q, sink, bias, scale, kv, idx, prim_idx, valid = _idx_case(rng, T, H, D, K, R)
    kv[0] = np.nan
    masked_row_0 = (idx == 0) & valid
    bias = np.where(masked_row_0, -np.inf, bias).astype(np.float32)  # row 0 is never selected
    valid &= ~masked_row_0
    packed, layout = packing.pack_for_kernel(
        jnp.asarray(q), jnp.asarray(kv), jnp.asarray(sink), jnp.asarray(bias), jnp.asarray(scale),
        idx=jnp.asarray(prim_idx), gather_in_xla=True,
    )
    _check_common(packed, layout, q, sink, bias, scale, valid)
    assert packed.idx is None
    Kp, Dp = layout.slots_padded, layout.dim_padded
    rows = np.asarray(packed.slot_rows).astype(np.float32)
    assert rows.shape == (T, Kp, Dp)
    for t in range(T):
        for j in range(Kp):
            if j < K and valid[t, j]:
                np.testing.assert_array_equal(rows[t, j], to_bf16(kv[idx[t, j]]).astype(np.float32))
            else:
                np.testing.assert_array_equal(rows[t, j], 0)


@pytest.mark.parametrize("T, H, D, K, R", [(2, 130, 64, 100, 37), (4, 64, 576, 7, 5)])
def test_pack_idx_sends_every_empty_slot_as_an_out_of_range_index(T, H, D, K, R):
    rng = np.random.default_rng(1)
    q, sink, bias, scale, kv, idx, prim_idx, valid = _idx_case(rng, T, H, D, K, R)
    packed, layout = packing.pack_for_kernel(
        jnp.asarray(q), jnp.asarray(kv), jnp.asarray(sink), jnp.asarray(bias), jnp.asarray(scale),
        idx=jnp.asarray(prim_idx),
    )
    _check_common(packed, layout, q, sink, bias, scale, valid)
    assert not np.asarray(packed.row_has_slot)[1]

    Kp, Dp = layout.slots_padded, layout.dim_padded
    packed_idx = np.asarray(packed.idx)
    assert packed_idx.shape == (T, 128, Kp // 128) and packed_idx.dtype == np.uint32
    for t in range(T):
        for j in range(Kp):
            expected = idx[t, j] if j < K and valid[t, j] else EMPTY_SLOT_INDEX
            # Slot j = kc*128 + p sits at [t, p, kc]: one DMA per token reads a partition's slots.
            assert packed_idx[t, j % 128, j // 128] == expected
    # Out of range of any cache the uint32 indices can address (at most 2**31 - 1 rows).
    assert EMPTY_SLOT_INDEX >= 2**31
    rows = np.asarray(packed.slot_rows)
    # The cache itself, never copied to pad its head dim.
    assert rows.shape == (R, D) and rows.dtype == BF16
    np.testing.assert_array_equal(rows.astype(np.float32), to_bf16(kv).astype(np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
@pytest.mark.parametrize("T, H, D, programs", [(3, 200, 576, 2), (2, 1, 64, 1), (1, 128, 128, 2)])
def test_unpack_reassembles_heads_crops_and_zeroes_empty_rows(T, H, D, programs, dtype):
    rng = np.random.default_rng(2)
    layout = packing.kernel_layout(T, H, D, 10, programs)
    G, Hg, Dp, Tp = layout.head_groups, layout.heads_per_group, layout.dim_padded, layout.tokens_padded
    out_groups = to_bf16(rng.standard_normal((G, Tp, Hg, Dp)))
    lse_groups = rng.standard_normal((G, Tp, Hg, 1)).astype(np.float32)
    has_slot = np.arange(T) % 2 == 0
    sink = rng.standard_normal(H).astype(np.float32)
    sink[0] = -np.inf
    out, lse = packing.unpack_from_kernel(jnp.asarray(out_groups), jnp.asarray(lse_groups), layout,
                                          jnp.asarray(has_slot), jnp.asarray(sink), dtype)  # fmt: skip
    assert out.shape == (T, H, D) and out.dtype == dtype
    assert lse.shape == (T, H) and lse.dtype == jnp.float32
    out, lse = np.asarray(out), np.asarray(lse)
    for t in range(T):
        for head in range(H):
            g, h = divmod(head, Hg)
            kernel_row = out_groups[g, t, h, :D] if has_slot[t] else np.zeros(D, BF16)
            # One cast from the kernel's bf16 to q's dtype.
            np.testing.assert_array_equal(out[t, head], kernel_row.astype(np.dtype(dtype)))
            # A row with no valid slot has the sink as its lse (-inf without one).
            expected_lse = lse_groups[g, t, h, 0] if has_slot[t] else sink[head]
            assert lse[t, head] == expected_lse


def test_pack_then_unpack_of_q_is_the_bf16_query():
    """Feeding the packed q, multiplied back by its guard's factors, as if it were the kernel's
    output recovers bf16(q)."""
    rng = np.random.default_rng(3)
    T, H, D, K = 3, 257, 100, 5
    q, sink, bias, scale = _inputs(rng, T, H, D, K)
    g = rng.standard_normal((T, K, D)).astype(np.float32)

    @jax.jit
    def round_trip(q, g, sink, bias, scale):
        packed, layout = packing.pack_for_kernel(q, g, sink, bias, scale)
        lse = jnp.zeros(packed.q_groups.shape[:3] + (1,), jnp.float32)
        up = packed.bias[:, UP_COLS[0]] * packed.bias[:, UP_COLS[1]]
        q_back = (packed.q_groups.astype(jnp.float32) * up[None, :, None, None]).astype(jnp.bfloat16)
        return packing.unpack_from_kernel(q_back, lse, layout, packed.row_has_slot, sink, q.dtype)[0]

    out = round_trip(q, g, sink, bias, scale)
    np.testing.assert_array_equal(np.asarray(out), to_bf16(q).astype(np.float32))


def test_sbuf_estimate_grows_with_slots_and_dim():
    from jax_sparse_attn.attention.kernel import sbuf_bytes_per_partition

    base = sbuf_bytes_per_partition(64, 512, 2048)
    # Slot rows and their transpose dominate: 2 * Kp * Dp * 2 bytes over 128 partitions.
    assert base >= 2 * 2048 * 512 * 2 // 128
    assert sbuf_bytes_per_partition(64, 512, 4096) > base
    assert sbuf_bytes_per_partition(64, 1024, 2048) > base
    # Chunks of slots shrink it.
    assert sbuf_bytes_per_partition(64, 512, 4096, 1024) < sbuf_bytes_per_partition(64, 512, 4096)
