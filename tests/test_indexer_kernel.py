"""The indexer's NKI kernel under the emulator against a float64 numpy oracle (docs/indexer.md).

Integer-valued inputs make every score exact in f32 and in float64, so the kernel's selection
must equal the oracle's exactly, ties (to the lower row) and order included; random inputs are
compared wherever the scores are farther apart than f32 rounding can explain.
"""

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from jax_sparse_attn.indexer import kernel as indexer_kernel
from oracle import within_one_ulp
from jax_sparse_attn.indexer.neuron import indexer_topk_neuron

BF16 = ml_dtypes.bfloat16


def oracle_scores(q, weights, keys, key_scale=None):
    """float64 ``I[t, r] = sum_j w[t, j] relu(q[t, j] . k[r]) * key_scale[r]``."""
    q = np.asarray(q, np.float64)
    k = np.asarray(keys, np.float64)
    with np.errstate(all="ignore"):
        d = np.einsum("tjd,rd->tjr", q, k)
        h = np.einsum("tj,tjr->tr", np.asarray(weights, np.float64), np.maximum(d, 0.0))
        if key_scale is not None:
            h = h * np.asarray(key_scale, np.float64)[None, :]
    return h


def oracle_topk(scores, positions, topk, ratio=1):
    """Rows by score descending, NaN below every number, ties to the lower row; -1 padded."""
    T, R = scores.shape
    out = np.full((T, topk), -1, np.int64)
    for t in range(T):
        n = 0 if positions[t] < 0 else min(R, (int(positions[t]) + 1) // ratio)
        rows = list(range(n))
        rows.sort(key=lambda r: (np.isnan(scores[t, r]), -np.nan_to_num(scores[t, r], nan=0.0,
                                                                         neginf=-np.inf), r))
        picked = rows[:topk]
        out[t, : len(picked)] = picked
    return out


def run_kernel(q, weights, keys, positions, topk, ratio=1, key_scale=None, dtype=BF16, kernel=None,
               emulated=True):
    import jax.numpy as jnp

    idx, scores = indexer_topk_neuron(
        jnp.asarray(np.asarray(q, dtype)), jnp.asarray(np.asarray(weights, np.float32)),
        jnp.asarray(np.asarray(keys, dtype)),
        None if key_scale is None else jnp.asarray(np.asarray(key_scale, np.float32)),
        jnp.asarray(np.asarray(positions, np.int32)), topk=topk, compress_ratio=ratio,
        emulated=emulated, kernel=kernel,
    )  # fmt: skip
    return np.asarray(idx), np.asarray(scores)


def random_case(rng, T, Hi, Di, R):
    """Random f32 q and keys, small positive weights, and the sign pattern that raises a key's
    scores for every token (``toward``: a key of ``toward * c`` scores high)."""
    q = rng.standard_normal((T, Hi, Di)).astype(np.float32)
    keys = rng.standard_normal((R, Di)).astype(np.float32)
    w = np.abs(rng.standard_normal((T, Hi)) * 0.1).astype(np.float32)
    return q, w, keys, np.sign(q.sum(axis=(0, 1)))[None, :]


def integer_case(rng, T, Hi, Di, R, levels=2):
    q = rng.integers(-levels, levels + 1, (T, Hi, Di)).astype(np.float32)
    keys = rng.integers(-levels, levels + 1, (R, Di)).astype(np.float32)
    weights = rng.choice([-1.0, 0.5, 1.0, 2.0], (T, Hi)).astype(np.float32)
    return q, weights, keys


@pytest.fixture(params=["trn2", "trn3", "trn1"])
def target(request, monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", request.param)
    return request.param


def test_exact_integer_scores_match_the_oracle_with_ties(target):
    rng = np.random.default_rng(0)
    T, Hi, Di, R, K = 5, 4, 16, 700, 24
    q, w, keys = integer_case(rng, T, Hi, Di, R)
    positions = np.array([699, 3, 650, 40, -1])
    idx, scores = run_kernel(q, w, keys, positions, K)
    s64 = oracle_scores(q, w, keys)
    want = oracle_topk(s64, positions, K)
    np.testing.assert_array_equal(idx, want)
    got = np.where(want >= 0, s64[np.arange(T)[:, None], np.maximum(want, 0)], -np.inf)
    np.testing.assert_array_equal(scores, got.astype(np.float32))


@pytest.mark.slow
def test_several_chunks_and_compressed_blocks(monkeypatch):
    """R spread over several chunks (a running selection across merges) and ratio 4."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.setattr(indexer_kernel, "SELECT_MAX_ELEMENTS", 1024 + 16)
    rng = np.random.default_rng(1)
    T, Hi, Di, R, K = 3, 2, 8, 2300, 16
    q, w, keys = integer_case(rng, T, Hi, Di, R, levels=1)
    positions = np.array([9199, 5000, 12])
    idx, _ = run_kernel(q, w, keys, positions, K, ratio=4)
    np.testing.assert_array_equal(idx, oracle_topk(oracle_scores(q, w, keys), positions, K, 4))


@pytest.mark.slow
def test_random_scores_agree_where_f32_separates_them(target):
    rng = np.random.default_rng(2)
    T, Hi, Di, R, K = 4, 8, 160, 900, 40  # Di > 128: the contraction runs in two chunks
    q = rng.standard_normal((T, Hi, Di)).astype(BF16)
    keys = rng.standard_normal((R, Di)).astype(BF16)
    w = (rng.standard_normal((T, Hi)) * 0.1).astype(np.float32)
    ks = rng.uniform(0.5, 2.0, R).astype(np.float32)
    positions = np.array([899, 500, 100, 30])
    idx, scores = run_kernel(q, w, keys, positions, K, key_scale=ks)
    s64 = oracle_scores(q, w, keys, ks)
    tol = 1e-5 * np.abs(s64).max()
    for t in range(T):
        n = min(R, positions[t] + 1)
        chosen = idx[t][idx[t] >= 0]
        assert len(chosen) == min(K, n) and len(set(chosen)) == len(chosen)
        assert chosen.max() < n
        kth = np.sort(s64[t, :n])[::-1][min(K, n) - 1]
        must = set(np.flatnonzero(s64[t, :n] > kth + tol))
        never = set(np.flatnonzero(s64[t, :n] < kth - tol))
        assert must <= set(chosen) and not (never & set(chosen))
        np.testing.assert_allclose(scores[t, : len(chosen)], s64[t, chosen], rtol=0, atol=tol)
        assert np.all(np.diff(scores[t, : len(chosen)]) <= 0)


@pytest.mark.slow
def test_garbage_in_invalid_rows_never_matters():
    rng = np.random.default_rng(3)
    T, Hi, Di, R, K = 2, 4, 8, 600, 12
    q, w, keys = integer_case(rng, T, Hi, Di, R)
    positions = np.array([300, 17])
    clean, clean_scores = run_kernel(q, w, keys, positions, K)
    dirty = keys.copy()
    dirty[301:] = np.nan
    dirty[400:, :3] = np.inf
    got, got_scores = run_kernel(q, w, dirty, positions, K)
    np.testing.assert_array_equal(got, clean)
    np.testing.assert_array_equal(got_scores, clean_scores)


def test_nan_and_minus_inf_scores_rank_as_the_contract_says():
    """-inf is a score like any other (selected, below every number), NaN ranks below -inf."""
    rng = np.random.default_rng(4)
    T, Hi, Di, R, K = 1, 2, 4, 40, 40
    q = np.abs(rng.integers(1, 3, (T, Hi, Di))).astype(np.float32)
    keys = rng.integers(-2, 3, (R, Di)).astype(np.float32)
    keys[[5, 9]] = np.inf  # d = +inf, weights negative: score -inf
    keys[[2, 30], 1] = np.nan
    w = np.array([[-1.0, -0.5]], np.float32)
    positions = np.array([R - 1])
    idx, scores = run_kernel(q, w, keys, positions, K)
    s64 = oracle_scores(q, w, keys)
    assert np.isneginf(s64[0, [5, 9]]).all() and np.isnan(s64[0, [2, 30]]).all()
    np.testing.assert_array_equal(idx, oracle_topk(s64, positions, K))
    np.testing.assert_array_equal(idx[0, -4:], [5, 9, 2, 30])
    assert np.isneginf(scores[0, -4:-2]).all() and np.isnan(scores[0, -2:]).all()


@pytest.mark.slow
def test_topk_beyond_the_valid_rows_pads_with_minus_one():
    rng = np.random.default_rng(5)
    q, w, keys = integer_case(rng, 2, 2, 8, 10)
    idx, scores = run_kernel(q, w, keys, np.array([3, 9]), 13)
    assert (idx[0, 4:] == -1).all() and np.isneginf(scores[0, 4:]).all()
    assert (idx[1, 10:] == -1).all() and sorted(idx[1, :10]) == list(range(10))


@pytest.mark.slow
def test_compiled_program_does_not_grow_with_tokens_or_rows(monkeypatch):
    from jax_sparse_attn import nki_emulator

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.setattr(indexer_kernel, "SELECT_MAX_ELEMENTS", 512 + 8)
    monkeypatch.setattr(indexer_kernel, "TILE_TOKENS_MAX", 2)
    rng = np.random.default_rng(6)
    counts = []
    for T, R in ((4, 512), (12, 2048)):  # 2 and 6 tiles of 2 tokens; 2 and 4 chunks
        q, w, keys = integer_case(rng, T, 64, 8, R)
        positions = np.full(T, R - 1) - np.arange(T) * 37
        with nki_emulator.recording() as rec:
            idx, _ = run_kernel(q, w, keys, positions, 8)
        counts.append(max(r.compiled_instructions_per_program for r in rec.runs))
        np.testing.assert_array_equal(idx, oracle_topk(oracle_scores(q, w, keys), positions, 8))
    assert counts[0] == counts[1]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_f16_and_f32_operands(dtype, monkeypatch):
    """The matmuls run in q's dtype (f32 inputs: the fp32 matmul), exact on integer inputs."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    rng = np.random.default_rng(8)
    q, w, keys = integer_case(rng, 3, 4, 16, 600, levels=3)
    positions = np.array([599, 100, 7])
    idx, _ = run_kernel(q, w, keys, positions, 16, dtype=dtype)
    np.testing.assert_array_equal(idx, oracle_topk(oracle_scores(q, w, keys), positions, 16))


def test_indexer_topk_nki_emulated_equals_the_reference_through_the_primitive(monkeypatch):
    """implementation="nki_emulated" of the public op (jitted) runs this kernel and equals
    implementation="reference" (the scores are integers: exact in every backend)."""
    import jax
    import jax.numpy as jnp

    from jax_sparse_attn import indexer_topk, nki_emulator

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    rng = np.random.default_rng(7)
    q, w, keys = integer_case(rng, 6, 4, 16, 300)
    positions = jnp.asarray([299, 0, 150, -3, 77, 298], jnp.int32)
    args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(w), jnp.asarray(keys, jnp.bfloat16), positions)
    run = jax.jit(lambda *a: indexer_topk(*a, 20, scale=1.0, return_scores=True,
                                          implementation="nki_emulated"))  # fmt: skip
    with nki_emulator.recording(cost=False) as rec:
        idx, scores = run(*args)
        idx = np.asarray(idx)
    assert rec.runs, "the kernel did not run"
    want_idx, want_scores = indexer_topk(*args, 20, scale=1.0, return_scores=True,
                                         implementation="reference")  # fmt: skip
    np.testing.assert_array_equal(idx, np.asarray(want_idx))
    np.testing.assert_array_equal(np.asarray(scores), np.asarray(want_scores))


def test_public_op_vmap_over_own_caches_runs_the_kernel_per_sequence(monkeypatch):
    """vmap over sequences with their own caches under implementation="nki_emulated": one kernel
    run per sequence on its own keys (integer scores: exact), each the float64 oracle's rows."""
    import jax
    import jax.numpy as jnp

    from jax_sparse_attn import indexer_topk, nki_emulator

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    rng = np.random.default_rng(8)
    S, T, Hi, Di, R, K = 3, 4, 4, 16, 200, 12
    cases = [integer_case(rng, T, Hi, Di, R) for _ in range(S)]
    q, w, keys = (np.stack(x) for x in zip(*cases))
    positions = rng.integers(-1, R, (S, T)).astype(np.int32)
    run = jax.jit(jax.vmap(lambda *a: indexer_topk(*a, K, scale=1.0,
                                                   implementation="nki_emulated")))
    with nki_emulator.recording(cost=False) as rec:
        idx = np.asarray(run(jnp.asarray(q, jnp.bfloat16), jnp.asarray(w),
                             jnp.asarray(keys, jnp.bfloat16), jnp.asarray(positions)))
    assert len(rec.runs) >= S, "the kernel did not run once per sequence"
    for s in range(S):
        want = oracle_topk(oracle_scores(q[s], w[s], keys[s]), positions[s], K)
        np.testing.assert_array_equal(idx[s], want)
    # One kernel call in a loop over the sequences: the program does not grow with the batch.
    sizes = []
    for n in (2, 6):
        args = [jax.ShapeDtypeStruct((n,) + x.shape[1:], d)
                for x, d in ((q, jnp.bfloat16), (w, jnp.float32), (keys, jnp.bfloat16),
                             (positions, jnp.int32))]
        sizes.append(run.lower(*args).as_text().count("callback"))
    assert sizes[0] == sizes[1] > 0, sizes


def test_valid_rows_follow_the_rule_without_overflow():
    import jax.numpy as jnp

    from jax_sparse_attn.indexer.neuron import valid_rows

    pos = np.array([-(2**31), -5, -1, 0, 2, 3, 6, 7, 1000, 2**31 - 1], np.int64)
    for ratio in (1, 4):
        want = [0 if p < 0 else min(50, (int(p) + 1) // ratio) for p in pos]
        got = np.asarray(valid_rows(jnp.asarray(pos, jnp.int32), 50, ratio))
        np.testing.assert_array_equal(got, want)


def test_kernel_limits_are_clear_errors():
    from jax_sparse_attn.indexer.kernel import plan_indexer

    with pytest.raises(ValueError, match="topk"):
        plan_indexer(1, 64, 128, 1000, 16000)
    with pytest.raises(ValueError, match="heads"):
        plan_indexer(1, 129, 128, 1000, 8)


@pytest.mark.parametrize("heads, dim", [(0, 8), (3, 0)])
def test_empty_head_sum_selects_the_first_valid_rows(heads, dim):
    """No heads or an empty contraction: every score is 0, so the valid rows in order."""
    q = np.zeros((3, heads, dim), np.float32)
    keys = np.ones((20, dim), np.float32)
    positions = np.array([5, -1, 30])
    idx, scores = run_kernel(q, np.zeros((3, heads), np.float32), keys, positions, 8)
    want = oracle_topk(oracle_scores(q, np.zeros((3, heads)), keys), positions, 8)
    np.testing.assert_array_equal(idx, want)
    np.testing.assert_array_equal(scores, np.where(want >= 0, 0.0, -np.inf))


@pytest.mark.slow
def test_both_kernels_end_to_end_equal_the_reference(monkeypatch):
    """indexer_topk then gathered_attn_idx, both implementation="nki_emulated" (the two NKI
    kernels under the emulator), equal the reference pipeline where the selections agree (integer
    indexer inputs: they agree exactly)."""
    import jax.numpy as jnp

    from jax_sparse_attn import gathered_attn_idx, indexer_topk

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    rng = np.random.default_rng(9)
    T, R, K = 6, 400, 32
    iq, iw, ik = integer_case(rng, T, 4, 16, R)
    q = jnp.asarray(rng.standard_normal((T, 8, 64)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((R, 64)), jnp.bfloat16)
    positions = jnp.asarray([399, 3, 200, 0, 150, 398], jnp.int32)
    args = (jnp.asarray(iq, jnp.bfloat16), jnp.asarray(iw), jnp.asarray(ik, jnp.bfloat16), positions)
    outs = []
    for impl in ("nki_emulated", "reference"):
        idx = indexer_topk(*args, K, scale=1.0, implementation=impl)
        outs.append((np.asarray(idx), np.asarray(gathered_attn_idx(q, kv, idx, implementation=impl))))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    # The attention kernel and the reference agree to one bf16 step (docs/neuron-kernel.md).
    assert within_one_ulp(outs[0][1], outs[1][1]) == 1.0


def _row_spread_direct(q, w, keys, positions, topk, target="trn2", steps=None):
    """The row-spread kernel under the emulator, called directly: ``(idx, path)``; ``steps=0``
    turns the pivot's bisection off (every token ranks all candidates)."""
    import jax.numpy as jnp

    from jax_sparse_attn.indexer import decode_kernel, neuron
    from jax_sparse_attn.nki_emulator import simulate

    T, Hi, Di = q.shape
    plan = neuron.decode_plan(target, Hi, Di, keys.shape[0], topk)
    n_valid = neuron.valid_rows(jnp.asarray(positions, jnp.int32), keys.shape[0], 1)
    operands, _ = neuron._pack_decode(plan, 1, jnp.asarray(q), jnp.asarray(w), jnp.asarray(keys),
                                      None, n_valid)  # fmt: skip
    _, idx, path = simulate(decode_kernel.indexer_decode_kernel, target=target)(
        *[np.asarray(a) for a in operands], topk=topk, depth=plan.depth, split=plan.split,
        offload=neuron.rank_offload(target, plan, neuron.decode_group(T, Hi, 1), 0),
        steps=plan.steps if steps is None else steps)
    return idx.reshape(-1, topk)[:T], path.reshape(-1)[:T]


@pytest.mark.parametrize("steps", [None, 0])
@pytest.mark.parametrize("case", ["distinct", "ties", "duplicated", "spread_tie", "clustered",
                                  "wide_tie"])  # fmt: skip
def test_row_spread_kernel_matches_the_oracle(monkeypatch, case, steps):
    """The row-spread (decode) kernel, forced through the kernel's entry point and called directly:
    distinct random scores are ranked as they are; integer scores with many exact ties, and a
    few best rows repeated in other partitions, have their ties broken; best rows crowded into
    one partition (rows 128 j, more than its depth of candidates), and one score shared by more
    best rows than step 4's list holds, take its exact fallback. With and without the pivot (the
    list of the best, or all candidates ranked). Every path equals the oracle."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    import jax.numpy as jnp

    rng = np.random.default_rng(5)
    T, Hi, Di, R, K = 3, 8, 32, 5000, 64
    if case == "ties":
        q, w, keys = integer_case(rng, T, Hi, Di, R, 2)
    else:
        q, w, keys, toward = random_case(rng, T, Hi, Di, R)
        if case == "clustered":  # 30 rows of partition 0, each far above the rest, all distinct
            keys[128 * np.arange(30)] = toward * (4.0 + np.arange(30)[:, None] / 8)
        elif case == "duplicated":  # row 5 (high) again in partitions 2, 4 and 57
            keys[5] = toward[0] * 4.0
            keys[[130, 260, 3001]] = keys[5]
        elif case == "spread_tie":  # three best rows tie, in partitions 127, 2 and 0: by
            keys[[127, 2050, 4992]] = toward[0] * 4.0  # partition the reverse of row order
        elif case == "wide_tie":  # 300 rows, two or three per partition, share the best score
            keys[np.arange(300) * 16 + 3] = toward[0] * 4.0
    q, keys = np.asarray(q, BF16), np.asarray(keys, BF16)
    positions = np.array([4999, 70, 3000])
    s64 = oracle_scores(np.asarray(q, np.float32), w, np.asarray(keys, np.float32))
    want = oracle_topk(s64, positions, K)
    idx, scores = indexer_topk_neuron(
        jnp.asarray(q), jnp.asarray(w), jnp.asarray(keys), None,
        jnp.asarray(positions, jnp.int32), topk=K, compress_ratio=1, emulated=True,
        kernel="decode")  # fmt: skip
    np.testing.assert_array_equal(np.asarray(idx), want)
    direct, path = _row_spread_direct(q, w, keys, positions, K, steps=steps)
    np.testing.assert_array_equal(direct, want)
    # Paths: 0 all M ranked, 1 and ties broken, 2 the fallback, 3 the list at the pivot ranked,
    # 4 and ties within a block of it broken; steps=0 finds no pivot. Token 1 sees rows < 71
    # only: one crowded row, no overload, five of the wide tie.
    want_path = {"distinct": [0, 0, 0], "ties": [1, 1, 1], "duplicated": [1, 0, 1],
                 "spread_tie": [1, 0, 1], "clustered": [2, 0, 2], "wide_tie": [2, 1, 2]}[case]
    if steps is None:  # a pivot wherever the bound holds and no tie is wider than the list;
        # at K=64 the list is two blocks, and the tied best rows share one of them.
        want_path = [{0: 3, 1: 4}.get(p, p) for p in want_path]
    np.testing.assert_array_equal(path, want_path)


@pytest.mark.parametrize("R", [2048, 4096, 8192])
def test_row_spread_kernel_finds_a_pivot_over_a_short_cache(monkeypatch, R):
    """A short cache at K=2048 (or an early token, 4001 valid rows of 8192, within the 40
    candidates per partition): every valid row is a candidate and ``U*`` is MARKER. The pivot's
    halvings start at the partitions' floor, so every token takes the list (path 4: the
    integer scores tie within its blocks): those past
    the list's room (more valid rows than cap's 2176), one selecting all its valid rows (2048
    of 2048: the floor is the pivot). Without a pivot (steps=0) the ranking of all M
    candidates broadcasts M keys into a wider tile (2048 rows: M = 2048 < cap + 128). Integer
    scores with ties, against the oracle."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    rng = np.random.default_rng(0)
    K = 2048
    q, w, keys = integer_case(rng, 4, 8, 32, R, levels=6)
    positions = np.array([R - 1, min(R, 4400) - 400, K - 1, 700])
    want = oracle_topk(oracle_scores(q, w, keys), positions, K)
    for steps, want_path in ((None, 4), (0, 1)):  # steps=0: all M ranked, then ties broken
        idx, path = _row_spread_direct(q, w, keys, positions, K, steps=steps)
        np.testing.assert_array_equal(idx, want)
        np.testing.assert_array_equal(path, [want_path] * 4)


@pytest.mark.parametrize("T", [1, 3])
def test_row_spread_list_takes_a_partition_with_more_listed_than_usual(monkeypatch, T):
    """At K=512 a partition lists about 5 candidates, so the list's scatters past its first 16
    candidate columns run only where some partition lists more (a 0-or-1-trip loop): 20 of the
    best rows in partition 3 take them. One token (two launches) and three (one launch) equal
    the oracle, on the pivot's list (path 3)."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    rng = np.random.default_rng(41)
    Hi, Di, R, K = 8, 32, 8000, 512
    q, w, keys, toward = random_case(rng, T, Hi, Di, R)
    keys[128 * np.arange(20) + 3] = toward * (4.0 + np.arange(20)[:, None] / 8)
    q, keys = np.asarray(q, BF16), np.asarray(keys, BF16)
    positions = R - 1 - np.arange(T) * 7
    s64 = oracle_scores(np.asarray(q, np.float32), w, np.asarray(keys, np.float32))
    want = oracle_topk(s64, positions, K)
    idx, _ = run_kernel(q, w, keys, positions, K, kernel="decode")
    np.testing.assert_array_equal(idx, want)
    if T > 1:
        direct, path = _row_spread_direct(q, w, keys, positions, K)
        np.testing.assert_array_equal(direct, want)
        np.testing.assert_array_equal(path, [3] * T)


@pytest.mark.parametrize("apart", [True, False])
def test_row_spread_whole_list_ranks_ties_by_row(monkeypatch, apart):
    """A program ranking the whole pivot list compares each pair of its entries once: the
    earlier block's pass tells the later entry whether it was beaten, so an equal key at a
    lower row wins across blocks (path 3), while ties within one block leave the later entry a
    rank short, which the ranks' check catches and the block's tie pass mends (path 4). Eight
    pairs of the best rows share their keys, 4000 rows apart (K=512: the list's five blocks of
    128 entries span about 1600 rows each) or adjacent. Equal to the oracle."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    rng = np.random.default_rng(47)
    T, Hi, Di, R, K = 3, 8, 32, 8000, 512
    q, w, keys, toward = random_case(rng, T, Hi, Di, R)
    first = np.arange(8) * 300 + 50
    keys[first] = toward * (4.0 + np.arange(8)[:, None] / 8)
    keys[first + (4000 if apart else 1)] = keys[first]
    q, keys = np.asarray(q, BF16), np.asarray(keys, BF16)
    positions = np.array([7999, 7990, 7980])
    s64 = oracle_scores(np.asarray(q, np.float32), w, np.asarray(keys, np.float32))
    want = oracle_topk(s64, positions, K)
    direct, path = _row_spread_direct(q, w, keys, positions, K)
    np.testing.assert_array_equal(direct, want)
    np.testing.assert_array_equal(path, [3 if apart else 4] * T)


def test_row_spread_pivot_far_below_an_outlier_takes_the_later_halvings(monkeypatch):
    """One row scores hundreds of times above the rest, so the pivot's bracket [U*, best] is so
    wide that the first 8 halvings leave every token's count out of the window; the later ones
    (a 0-or-1-trip loop) find the pivot's list (path 3, not 0), equal to the oracle."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    from jax_sparse_attn.indexer import decode_kernel

    rng = np.random.default_rng(43)
    T, Hi, Di, R, K = 3, 8, 32, 5000, 64
    q, w, keys, toward = random_case(rng, T, Hi, Di, R)
    keys[17] = toward[0] * 300.0
    q, keys = np.asarray(q, BF16), np.asarray(keys, BF16)
    positions = np.array([4999, 4000, 3000])
    want = oracle_topk(oracle_scores(np.asarray(q, np.float32), w, np.asarray(keys, np.float32)),
                       positions, K)  # fmt: skip
    early = decode_kernel.EARLY_BISECT_STEPS
    for steps, want_path in ((early, [0] * T), (None, [3] * T)):
        direct, path = _row_spread_direct(q, w, keys, positions, K, steps=steps)
        np.testing.assert_array_equal(direct, want)
        np.testing.assert_array_equal(path, want_path)


def _poisson_above(mean, n):
    """P(X > n), X ~ Poisson(mean), summed in log space (math.lgamma)."""
    import math

    return 1.0 - sum(math.exp(i * math.log(mean) - mean - math.lgamma(i + 1)) for i in range(n + 1))


@pytest.mark.parametrize("shares", [1, 2])
@pytest.mark.parametrize("topk", [64, 512, 2048])
def test_candidate_depth_is_the_least_multiple_of_8_within_the_fallback_rate(topk, shares):
    """Per partition, or per share of its columns (the two-launch form's scoring programs: 128
    shares partitions, each holding a Poisson share of the best with mean K / (128 shares))."""
    from jax_sparse_attn.indexer import decode_kernel

    depth = decode_kernel.candidate_depth(topk, columns=10**6, shares=shares)
    parts = 128 * shares
    mean = topk / parts
    assert depth % 8 == 0
    assert parts * _poisson_above(mean, depth) <= decode_kernel.FALLBACK_RATE
    assert depth == 8 or parts * _poisson_above(mean, depth - 8) > decode_kernel.FALLBACK_RATE
    assert decode_kernel.candidate_depth(2048, columns=16) == 16  # every row a candidate


def test_a_kernel_that_does_not_exist_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    q, w, keys = integer_case(np.random.default_rng(0), 1, 2, 8, 40)
    with pytest.raises(ValueError, match="kernel must be"):
        run_kernel(q, w, keys, [39], 8, kernel="fast")


def test_routing_takes_the_row_spread_kernel_for_decode_only_where_it_can_run():
    from jax_sparse_attn.indexer import neuron

    shape = dict(Hi=64, Di=128, R=131072, topk=2048)
    assert neuron.choose_kernel("trn2", 1, 1, **shape)[0] == "decode"
    assert neuron.choose_kernel("trn1", 1, 1, **shape) == ("tiled", None)  # no scatter DMA
    # A prefill over a short cache on one core: the tiled kernel's merges of few rows are
    # cheaper than the row-spread kernel's fixed work per token at 2048 rows, not at 4096
    # (modelled at T=256 with LNC=1: 4.47 ms against 4.68 ms, and 6.66 ms against 5.63 ms).
    assert neuron.choose_kernel("trn2", 1, 4096, Hi=64, Di=128, R=2048, topk=2048)[0] == "tiled"
    assert neuron.choose_kernel("trn2", 1, 4096, Hi=64, Di=128, R=4096, topk=2048)[0] == "decode"
    # On trn2's two cores the tiled kernel's programs split the rows and a merge launch joins
    # them, while the row-spread kernel's split the tokens: it wins over short caches too
    # (modelled at T=256 over 4096 rows: 4.1 ms against 6.7 ms), where every row is a candidate
    # and its pivot's halvings start at the partitions' floor.
    for R in (1024, 4096):
        assert neuron.choose_kernel("trn2", 2, 4096, Hi=64, Di=128, R=R, topk=2048)[0] == "decode"
    assert neuron.choose_kernel("trn2", 1, 1, Hi=64, Di=128, R=131072, topk=8192) == ("tiled", None)


@pytest.mark.parametrize("group", [1, 2])
def test_row_spread_kernel_one_token_or_two_per_matmul(monkeypatch, group):
    """Tokens alone or in pairs sharing the d matmuls (an odd count: the pair's second token
    padded) give the oracle's selection, ties included."""
    from jax_sparse_attn.indexer import neuron

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.setattr(neuron, "decode_group", lambda T, Hi, programs: group)
    rng = np.random.default_rng(12)
    q, w, keys = integer_case(rng, 5, 4, 16, 900)
    positions = np.array([899, 0, 450, -2, 600])
    idx, _ = run_kernel(q, w, keys, positions, 24, kernel="decode")
    np.testing.assert_array_equal(idx, oracle_topk(oracle_scores(q, w, keys), positions, 24))


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("case", ["compressed", "garbage", "nan_and_inf", "beyond_valid",
                                  "key_scale", "f32"])  # fmt: skip
def test_row_spread_kernel_keeps_the_contract(monkeypatch, case, group, signed):
    """The row-spread kernel, forced, on the contract's cases: compressed blocks, garbage in
    rows no token may select, -inf and NaN scores, topk beyond the valid rows, a key_scale, f32
    operands; one token per d matmul or two, with the head sums of the first 512 rows (one
    token) or 1024 (two) of each chunk on the VectorE; the TensorE's head sums by sign or with
    the signed weights. Integer inputs (and power-of-two scales) make the oracle exact."""
    from jax_sparse_attn.indexer import neuron

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    monkeypatch.setattr(neuron, "decode_group", lambda T, Hi, programs: group)
    monkeypatch.setattr(neuron, "head_sums_on_vector", lambda target, plan, g: g)
    monkeypatch.setattr(neuron, "signed_head_sums", lambda target, plan, g, v: signed)
    rng = np.random.default_rng(11)
    ratio, key_scale, dtype, K = 1, None, BF16, 16
    q, w, keys = integer_case(rng, 3, 4, 8, 700)
    positions = np.array([699, 40, 3])
    if case == "compressed":
        ratio, positions = 4, np.array([2799, 1000, 12])
    elif case == "garbage":
        positions = np.array([300, 17, 650])
        keys[301:650] = np.nan
        keys[660:, :3] = np.inf
    elif case == "nan_and_inf":
        q = np.abs(q) + 1
        keys[[5, 9]] = np.inf  # d = +inf, weights negative: score -inf
        keys[[2, 30], 1] = np.nan
        w = -np.abs(w) - 0.5
        positions, K = np.array([39, 39, 9]), 40
    elif case == "beyond_valid":
        K = 13
    elif case == "key_scale":
        key_scale = rng.choice([0.25, 0.5, 1.0, 2.0], 700).astype(np.float32)
    else:
        dtype = np.float32
    s64 = oracle_scores(q, w, keys, key_scale)
    limited = [min(700, (p + 1) // ratio) for p in positions]
    if case == "garbage":  # the oracle of rows beyond each limit is never read
        s64 = np.where(np.arange(700)[None, :] < np.array(limited)[:, None], s64, 0.0)
    want = oracle_topk(s64, positions, K, ratio)
    idx, scores = run_kernel(q, w, keys, positions, K, ratio, key_scale, dtype, kernel="decode")
    np.testing.assert_array_equal(idx, want)
    picked = np.take_along_axis(s64, np.maximum(want, 0), axis=1)
    np.testing.assert_array_equal(scores, np.where(want >= 0, picked, -np.inf))


@pytest.mark.slow
def test_row_spread_program_does_not_grow_with_tokens_or_rows(monkeypatch):
    """The row-spread kernel's compiled program (hardware loops over the tokens and the chunks)
    is the same for 8 tokens over 20000 rows and 16 over 50000, and both equal the oracle. (The
    head sums' split is a compile-time count, at most a chunk's 32 blocks, and so is the rank
    passes' split, at most the list's blocks: fixed here; so are the tokens per group and the
    groups per span, 2 and 2 from 8 tokens on two programs.)"""
    from jax_sparse_attn import nki_emulator
    from jax_sparse_attn.indexer import neuron

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.setattr(neuron, "head_sums_on_vector", lambda target, plan, g: 2)
    monkeypatch.setattr(neuron, "rank_offload", lambda *args, **kwargs: 1)
    rng = np.random.default_rng(13)
    counts = []
    for T, R in ((8, 20000), (16, 50000)):
        q = rng.standard_normal((T, 8, 32)).astype(np.float32)
        keys = rng.standard_normal((R, 32)).astype(np.float32)
        w = np.abs(rng.standard_normal((T, 8))).astype(np.float32)
        q, keys = np.asarray(q, BF16), np.asarray(keys, BF16)
        positions = R - 1 - np.arange(T) * 97
        with nki_emulator.recording() as rec:
            idx, _ = run_kernel(q, w, keys, positions, 64, kernel="decode")
        counts.append(max(r.compiled_instructions_per_program for r in rec.runs))
        s64 = oracle_scores(np.asarray(q, np.float32), w, np.asarray(keys, np.float32))
        np.testing.assert_array_equal(idx, oracle_topk(s64, positions, 64))
    assert counts[0] == counts[1]


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("on_vector", [0, 1])
def test_paired_head_sums_keep_one_tokens_overflow_from_its_partner(monkeypatch, on_vector, signed):
    """Two tokens share each head-sum matmul (the weights block-diagonal), where a zero weight
    meets the partner's relu(d). Token 1's d overflows to +inf at row 600 (its q and the key both
    2**126 in one dimension, no other token or row touching that dimension), so 0 * inf would
    make token 0's finite score there NaN and rank it last; the chunk is scored again unpaired,
    and both tokens equal the oracle. Also with the first 512 rows' head sums on the VectorE
    (row 600 is in the second block, paired either way), and with the signed weights moving
    instead of the 0/1 sign columns."""
    from jax_sparse_attn.indexer import neuron

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.setattr(neuron, "decode_group", lambda T, Hi, programs: 2)
    monkeypatch.setattr(neuron, "head_sums_on_vector", lambda target, plan, g: on_vector)
    monkeypatch.setattr(neuron, "signed_head_sums", lambda target, plan, g, v: signed)
    rng = np.random.default_rng(21)
    q, w, keys = integer_case(rng, 2, 4, 8, 700)
    w = np.abs(w)
    q[:, :, 0] = 0.0
    keys[:, 0] = 0.0
    big = 2.0**126  # exact in bf16; big * big overflows f32, not float64
    keys[600, 0] = big
    q[1, 0, 0] = big
    positions = np.array([699, 699])
    K = 700
    s64 = oracle_scores(q, w, keys)
    assert np.isfinite(s64[0, 600]) and s64[1, 600] > np.finfo(np.float32).max
    idx, scores = run_kernel(q, w, keys, positions, K, kernel="decode")
    np.testing.assert_array_equal(idx, oracle_topk(s64, positions, K))
    assert idx[1, 0] == 600 and scores[1, 0] == np.inf
    assert not np.isnan(scores).any()


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("case", ["zero_weight_meets_minus_inf", "inf_weight", "nan_weight"])
def test_head_sums_split_by_sign_take_the_exact_form_where_they_differ(monkeypatch, case, group,
                                                                       signed):
    """The matmuls' head sums scale the relu by |w'| and add each sign's heads apart:
    relu(|w'| d) is |w' relu(d)| but for a zero weight meeting d = -inf (NaN, where the contract
    has 0 * relu(-inf) = 0) and a non-finite weight (inf * relu(d) is NaN for d <= 0 in the
    contract, relu(inf * d) is 0 for d < 0). Those chunks are scored again in the exact form, so
    the selection equals the oracle's, NaN scores ranked last. Token 0's head 1 has weight 0 and
    d = -2**252 at row 600 (-inf in f32, finite in float64), or head 2's weight is inf or NaN;
    token 1 is plain. One token per head-sum matmul or two; the signed weights moving instead
    (exact for one token, a pair's 0 * inf scored again) hold to the same."""
    from jax_sparse_attn.indexer import neuron

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.setattr(neuron, "decode_group", lambda T, Hi, programs: group)
    monkeypatch.setattr(neuron, "signed_head_sums", lambda target, plan, g, v: signed)
    rng = np.random.default_rng(31)
    q, w, keys = integer_case(rng, 2, 4, 8, 700)
    q[:, :, 0] = 0.0
    keys[:, 0] = 0.0
    if case == "zero_weight_meets_minus_inf":
        keys[600, 0] = 2.0**126  # exact in bf16
        q[0, 1, 0] = -(2.0**126)
        w[0, 1] = 0.0
    else:
        w[0, 2] = np.inf if case == "inf_weight" else np.nan
    positions = np.array([699, 699])
    K = 700  # every row, so that a NaN ranked last where the oracle has a number shows
    s64 = oracle_scores(q, w, keys)
    if case == "zero_weight_meets_minus_inf":
        assert np.isfinite(s64[0]).all()
    idx, scores = run_kernel(q, w, keys, positions, K, kernel="decode")
    np.testing.assert_array_equal(idx, oracle_topk(s64, positions, K))
    want = s64[np.arange(2)[:, None], idx].astype(np.float32)
    np.testing.assert_array_equal(np.isnan(scores), np.isnan(want))


@pytest.mark.parametrize("case", ["distinct", "ties", "no_pivot", "clustered", "garbage",
                                  "nan_and_inf", "compressed"])  # fmt: skip
def test_one_token_scored_by_both_programs_then_selected(monkeypatch, case):
    """A decode step (one token, two programs on trn2): the programs split the token's rows to
    score them, then both build the same list and each ranks and places its share of it (two
    launches of two). Distinct scores, integer ties (at K=400: five list columns, two and
    three), the same without a pivot (program 0 alone ranks all candidates), a crowded partition
    (the exact fallback), garbage past the valid rows, -inf and NaN scores and compressed blocks
    all equal the oracle."""
    from jax_sparse_attn import nki_emulator

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    rng = np.random.default_rng(23)
    R, K, ratio, position = 40000, 64, 1, 18700  # three chunks of 16384 rows, split 1 and 2
    if case in ("ties", "no_pivot", "garbage", "nan_and_inf", "compressed"):
        q, w, keys = integer_case(rng, 1, 4, 8, R)
        K = 400 if case in ("ties", "no_pivot") else K
    else:
        q = rng.standard_normal((1, 8, 32)).astype(np.float32)
        keys = rng.standard_normal((R, 32)).astype(np.float32)
        w = np.abs(rng.standard_normal((1, 8)) * 0.1).astype(np.float32)
        if case == "clustered":  # 30 rows of partition 0, far above the rest: past its depth
            toward = np.sign(q.sum(axis=(0, 1)))[None, :]
            keys[128 * np.arange(30)] = toward * (4.0 + np.arange(30)[:, None] / 8)
    if case == "no_pivot":  # no halvings: step 3b ranks all candidates
        from jax_sparse_attn.indexer import neuron

        plan_with_pivot = neuron.decode_plan
        monkeypatch.setattr(neuron, "decode_plan", lambda *a: dataclasses.replace(
            plan_with_pivot(*a), steps=0))  # fmt: skip
    if case == "garbage":
        keys[position + 1 :] = np.nan
        keys[19000:, :3] = np.inf
    elif case == "nan_and_inf":
        q = np.abs(q) + 1
        w = -np.abs(w) - 0.5
        keys[[5, 9000]] = np.inf  # d = +inf, weights negative: score -inf
        keys[[2, 17100], 1] = np.nan
    elif case == "compressed":
        ratio, position = 4, 4 * 4321 + 2
    q, keys = np.asarray(q, BF16), np.asarray(keys, BF16)
    s64 = oracle_scores(np.asarray(q, np.float32), w, np.asarray(keys, np.float32))
    limit = min(R, (position + 1) // ratio)
    if case == "garbage":  # the oracle of rows beyond the limit is never read
        s64 = np.where(np.arange(R)[None, :] < limit, s64, 0.0)
    want = oracle_topk(s64, [position], K, ratio)
    with nki_emulator.recording() as rec:
        idx, scores = run_kernel(q, w, keys, [position], K, ratio, kernel="decode")
    np.testing.assert_array_equal(idx, want)
    picked = np.where(want >= 0, np.take_along_axis(s64, np.maximum(want, 0), axis=1), -np.inf)
    if case in ("distinct", "clustered"):  # f32 sums of random products: within rounding
        np.testing.assert_allclose(scores, picked, rtol=1e-5)
    else:  # integer inputs: every score exact
        np.testing.assert_array_equal(scores, picked.astype(np.float32))
    assert [r.grid for r in rec.runs] == [2, 2]


class _JitOnEmulator:
    """A stand-in for ``nki.jit(kernel)`` (``kernel[n](...)`` included) that runs the kernel under
    the emulator: the Neuron path's own launches, arguments and result handling run as written."""

    def __init__(self, kernel, grid=1):
        self.kernel, self.grid = kernel, grid

    def __getitem__(self, grid):
        return _JitOnEmulator(self.kernel, grid)

    def __call__(self, *args, **kwargs):
        from jax_sparse_attn.nki_emulator import simulate

        run = simulate(self.kernel)[self.grid]
        return run(*[np.asarray(a) for a in args],
                   **{k: np.asarray(v) if hasattr(v, "shape") else v for k, v in kwargs.items()})


@pytest.mark.parametrize("T, R, kernel", [(1, 20000, "decode"), (5, 3000, "decode"),
                                          (5, 3000, "tiled")])  # fmt: skip
def test_neuron_path_launches_equal_the_oracle(monkeypatch, T, R, kernel):
    """``emulated=False`` (the path that calls ``nki.jit`` on a Trainium host) with nki.jit
    standing in as the emulator: a decode step's two launches (scoring on both programs, then
    selecting), the row-spread kernel's one launch, and the tiled kernel with its merge launch
    all pass their operands as the kernels take them and equal the oracle."""
    from jax_sparse_attn.attention import neuron as attention_neuron

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.setattr(attention_neuron, "jitted_kernel", _JitOnEmulator)
    rng = np.random.default_rng(29)
    q, w, keys = integer_case(rng, T, 4, 8, R)
    positions = R - 1 - 7 * np.arange(T)
    K = 24
    idx, scores = run_kernel(q, w, keys, positions, K, kernel=kernel, emulated=False)
    s64 = oracle_scores(q, w, keys)
    want = oracle_topk(s64, positions, K)
    np.testing.assert_array_equal(idx, want)
    np.testing.assert_array_equal(scores, np.take_along_axis(s64, want, axis=1).astype(np.float32))


def test_two_pairs_share_each_read_of_keys(monkeypatch):
    """Eight tokens on two programs: each program's two pairs share every chunk of keys it
    reads (a span of two groups). Integer inputs with ties, garbage past some tokens' rows, a
    token with no valid row and one token's overflow next to its partner's finite scores all
    equal the oracle."""
    from jax_sparse_attn.indexer import neuron

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    rng = np.random.default_rng(31)
    T, Hi, Di, R, K = 8, 4, 8, 20000, 24
    assert neuron.decode_span(T, neuron.decode_group(T, Hi, 2), 2) == 2
    q, w, keys = integer_case(rng, T, Hi, Di, R)
    w = np.abs(w)
    q[:, :, 0] = 0.0
    keys[:, 0] = 0.0
    keys[9000, 0] = 2.0**126  # token 5's d overflows there (its q too), not its partner's
    q[5, 0, 0] = 2.0**126
    positions = np.array([19999, 18000, 9500, -1, 0, 12000, 19999, 3000])
    keys[19000:, 1:] = np.nan  # garbage for every token but 0 and 6, which see it as NaN rows
    s64 = oracle_scores(q, w, keys)
    want = oracle_topk(s64, positions, K)
    idx, _ = run_kernel(q, w, keys, positions, K, kernel="decode")
    np.testing.assert_array_equal(idx, want)


@pytest.mark.parametrize("T", [1, 8])
def test_row_spread_sbuf_estimate_bounds_the_emulated_peak(monkeypatch, T):
    """The routing keeps a shape off the row-spread kernel by ``sbuf_bytes_per_partition``: it
    must not be below what the emulator measures on any program, in a decode step's two launches
    (one token) and in spans of two pairs (eight tokens)."""
    from jax_sparse_attn import nki_emulator
    from jax_sparse_attn.indexer import decode_kernel, neuron

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    rng = np.random.default_rng(37)
    Hi, Di, R, K = 16, 64, 40000, 256
    q, w, keys = integer_case(rng, T, Hi, Di, R)
    with nki_emulator.recording() as rec:
        run_kernel(q, w, keys, R - 1 - np.arange(T), K, kernel="decode")
    peak = max(p.sbuf_peak_bytes_per_partition for r in rec.runs for p in r.programs)
    plan = neuron.decode_plan("trn2", Hi, Di, R, K)
    assert peak <= decode_kernel.sbuf_bytes_per_partition(plan)


def test_neuron_rule_waits_for_the_platform_and_picks_the_kernel(monkeypatch):
    """Registered once JAX knows "neuron" (never on this machine); there ``None`` means the
    kernel ("nki"), as for the other two ops, and ``"nki_emulated"`` is a clear error."""
    from jax_sparse_attn.indexer import primitive

    assert primitive.register_neuron_lowering() is False  # no Neuron plugin here
    seen = []
    monkeypatch.setattr(primitive, "_lower", lambda *a, topk, compress_ratio, implementation: (
        seen.append(implementation)))  # fmt: skip
    for implementation in (None, "reference", "nki"):
        primitive._lower_neuron(None, topk=4, compress_ratio=1, implementation=implementation)
    assert seen == ["nki", "reference", "nki"]
    with pytest.raises(NotImplementedError, match="host callback"):
        primitive._lower_neuron(None, topk=4, compress_ratio=1, implementation="nki_emulated")
