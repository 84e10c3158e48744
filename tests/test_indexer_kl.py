"""indexer_kl against the float64 oracles of tests/indexer_kl_oracle.py (docs/indexer-kl.md).

Both forms, compress ratios 1 and 4, a window-and-sink lse_extra (a head at +inf, a token at
-inf), key scales, empty and invisible slots, tokens with no candidate; the reference's chunks and
blocks made small (``small_plan``) so that T is not a multiple of a chunk nor R of a block."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from indexer_kl_oracle import candidates, indexer_kl_jnp, indexer_kl_numpy
from jax_sparse_attn import indexer_kl
from jax_sparse_attn.indexer_kl import reference

T, H, D, R, HI, DI, K = 11, 3, 8, 13, 2, 4, 4
SCALE, INDEX_SCALE = 0.35, 0.6


def _enable_x64():
    if hasattr(jax, "enable_x64"):  # jax >= 0.8
        return jax.enable_x64(True)
    from jax.experimental import enable_x64

    return enable_x64()


@pytest.fixture(scope="module", autouse=True)
def small_plan():
    """Chunks of 3 tokens (11 = 3 + 3 + 3 + 2: the last chunk overlaps) and blocks of 5 rows
    (13 = 5 + 5 + 3: the last block overlaps). Every program here is traced under it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reference, "MAX_CHUNK_TOKENS", 3)
        mp.setattr(reference, "DENSE_BLOCK_ROWS", 5)
        jax.clear_caches()
        yield
    jax.clear_caches()


def make_case(ratio, seed=0):
    rng = np.random.default_rng(seed)
    f32 = np.float32
    q = rng.normal(size=(T, H, D)).astype(f32)
    kv = rng.normal(size=(R, D)).astype(f32)
    iq = rng.normal(size=(T, HI, DI)).astype(f32)
    w = rng.normal(size=(T, HI)).astype(f32)
    ik = rng.normal(size=(R, DI)).astype(f32)
    ks = rng.uniform(0.5, 2.0, R).astype(f32)
    # Positions: token 3 sees nothing (-1); the others a growing prefix, not all of the rows.
    pos = (np.arange(T) * ratio + rng.integers(0, ratio, T) + 1).astype(np.int32)
    pos[3] = -1
    seen = np.array([(pos[t] + 1) // ratio for t in range(T)])
    idx = np.full((T, K), -1, np.int32)
    for t in range(T):
        if seen[t] > 0:
            rows = rng.permutation(seen[t])[:K - 1]
            idx[t, :len(rows)] = rows
    idx[5] = -1  # no slot: no candidate in the sparse form
    idx[6, 3] = R + 2  # out of range: empty
    idx[7, 3] = min(seen[7] + 1, R - 1)  # not visible: empty
    # lse_extra: a window's lse with a sink (numpy), a head at +inf, a token with none.
    window = rng.normal(size=(T, H, 3)).astype(f32)
    sink = rng.normal(size=H).astype(f32)
    lse_extra = np.log(np.exp(sink)[None] + np.exp(window).sum(-1)).astype(f32)
    lse_extra[1, 0] = np.inf
    lse_extra[2] = -np.inf
    return dict(q=q, kv=kv, index_q=iq, index_weights=w, index_keys=ik, positions=pos, idx=idx,
                key_scale=ks, lse_extra=lse_extra)


def call(case, sparse, ratio, **overrides):
    c = dict(case, **overrides)
    return indexer_kl(c["q"], c["kv"], c["index_q"], c["index_weights"], c["index_keys"],
                      c["positions"], c["idx"], sparse=sparse, scale=SCALE,
                      index_scale=INDEX_SCALE, key_scale=c["key_scale"], compress_ratio=ratio,
                      lse_extra=c["lse_extra"])


STUDENT = ("index_q", "index_weights", "index_keys")


@functools.lru_cache(maxsize=None)
def program(sparse, ratio):
    """One compiled program per form and ratio: kl, mass, and the student's gradients for a
    per-token cotangent and for the mean over the tokens with a candidate."""

    def run(case, ct, mean):
        def kl_of(student):
            return call(dict(case, **dict(zip(STUDENT, student))), sparse, ratio)

        (kl, mass), pullback = jax.vjp(kl_of, tuple(case[n] for n in STUDENT))
        zero = jnp.zeros_like(mass)
        return kl, mass, pullback((ct, zero))[0], pullback((mean, zero))[0]

    return jax.jit(run)


def run_program(case, sparse, ratio, ct):
    """``program``'s results, the second gradient that of the layers' loss: the mean of kl over
    the tokens with a candidate (the same cotangent on each)."""
    has = np.array([bool(candidates(t, case["positions"], case["idx"], R, sparse=sparse,
                                    ratio=ratio)[0]) for t in range(T)], np.float32)
    return program(sparse, ratio)(case, ct, has / max(has.sum(), 1.0)) + (has,)


def oracle_grads(case, sparse, ratio, weights):
    """The gradients of ``sum(weights * kl)`` by autodiff of the jnp oracle under x64."""
    with _enable_x64():
        x64 = {k: jnp.asarray(v, jnp.float64) if v.dtype.kind == "f" else v
               for k, v in case.items()}

        def loss(*student):
            c = dict(x64, **dict(zip(STUDENT, student)))
            kl = indexer_kl_jnp(c["q"], c["kv"], *student, c["positions"], c["idx"],
                                sparse=sparse, scale=SCALE, index_scale=INDEX_SCALE,
                                key_scale=c["key_scale"], compress_ratio=ratio,
                                lse_extra=c["lse_extra"])
            return jnp.sum(jnp.asarray(weights, jnp.float64) * kl)

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return [np.asarray(g) for g in grad(*(x64[n] for n in STUDENT))]


FORMS = [(True, 1), (False, 4), pytest.param(False, 1, marks=pytest.mark.slow),
         pytest.param(True, 4, marks=pytest.mark.slow)]


@pytest.mark.parametrize("sparse,ratio", FORMS)
def test_values_and_gradients_match_the_oracles(sparse, ratio):
    case = make_case(ratio)
    ct = np.random.default_rng(1).normal(size=T).astype(np.float32)
    kl, mass, g_ct, g_mean, has = run_program(case, sparse, ratio, ct)
    want_kl, want_mass = indexer_kl_numpy(
        case["q"], case["kv"], case["index_q"], case["index_weights"], case["index_keys"],
        case["positions"], case["idx"], sparse=sparse, scale=SCALE, index_scale=INDEX_SCALE,
        key_scale=case["key_scale"], compress_ratio=ratio, lse_extra=case["lse_extra"])
    np.testing.assert_allclose(kl, want_kl, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(mass, want_mass, rtol=2e-5, atol=2e-6)
    # The case has tokens with candidates and tokens without (kl 0, mass 0, never NaN).
    assert (want_kl > 1e-3).sum() >= 4 and (want_kl == 0).sum() >= (2 if sparse else 1)
    assert kl[3] == 0 and mass[3] == 0
    if sparse:
        assert kl[5] == 0 and mass[5] == 0
        np.testing.assert_allclose(mass[want_kl > 0], 1.0, rtol=1e-6)
    else:
        assert mass[5] == 0 and np.any((0 < mass) & (mass < 0.9))  # the top-k's share
    for got, weights in ((g_ct, ct), (g_mean, has / has.sum())):
        want = oracle_grads(case, sparse, ratio, weights)
        for name, g, w in zip(STUDENT, got, want):
            assert np.all(np.isfinite(g)), name
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-6 * np.abs(w).max(),
                                       err_msg=name)
        assert np.all(np.asarray(got[0])[3] == 0)  # no candidate: no gradient


@pytest.mark.slow
def test_default_plan_matches_the_oracle():
    # The default plan (one chunk, one block) at a shape of its own.
    case = make_case(4, seed=3)
    case = {k: (v[:9] if k not in ("kv", "index_keys", "key_scale") else v)
            for k, v in case.items()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reference, "MAX_CHUNK_TOKENS", 1024)
        mp.setattr(reference, "DENSE_BLOCK_ROWS", 512)
        for sparse in (True, False):
            kl, mass = call(case, sparse, 4)
            want = indexer_kl_numpy(
                case["q"], case["kv"], case["index_q"], case["index_weights"],
                case["index_keys"], case["positions"], case["idx"], sparse=sparse, scale=SCALE,
                index_scale=INDEX_SCALE, key_scale=case["key_scale"], compress_ratio=4,
                lse_extra=case["lse_extra"])
            np.testing.assert_allclose(kl, want[0], rtol=2e-5, atol=2e-6)
            np.testing.assert_allclose(mass, want[1], rtol=2e-5, atol=2e-6)
    jax.clear_caches()


DEFAULT = [(True, 1), (False, 4)]  # the forms whose programs the default run compiles


def unseen_rows(case, sparse, ratio):
    """Rows that are no token's candidate: beyond every token's view, and in the sparse form also
    every row no slot selects."""
    seen = max((int(p) + 1) // ratio for p in case["positions"])
    rows = set(range(seen, R))
    if sparse:
        rows |= set(range(R)) - {int(j) for j in case["idx"].ravel() if 0 <= j < seen}
    return sorted(rows)


@pytest.mark.parametrize("sparse,ratio", DEFAULT)
def test_garbage_in_rows_that_are_no_candidate_changes_nothing(sparse, ratio):
    case = make_case(ratio)
    ct = np.random.default_rng(1).normal(size=T).astype(np.float32)
    clean = run_program(case, sparse, ratio, ct)
    rows = unseen_rows(case, sparse, ratio)
    assert rows
    dirty = dict(case)
    for name, bad in (("kv", np.nan), ("index_keys", np.inf)):
        dirty[name] = case[name].copy()
        dirty[name][rows] = bad
    dirty["key_scale"] = case["key_scale"].copy()
    dirty["key_scale"][rows] = np.nan
    got = run_program(dirty, sparse, ratio, ct)
    for a, b in zip(jax.tree_util.tree_leaves(clean), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("sparse,ratio", DEFAULT)
def test_two_runs_give_the_same_bits(sparse, ratio):
    # Many tokens select the same rows (the keys' gradient is a scatter in the sparse form).
    case = make_case(ratio, seed=5)
    case["idx"][:, 0] = np.where(case["idx"][:, 0] >= 0, 0, -1)
    ct = np.random.default_rng(2).normal(size=T).astype(np.float32)
    first = run_program(case, sparse, ratio, ct)
    second = run_program(case, sparse, ratio, ct)
    for a, b in zip(jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(second)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_vmap_and_vmap_of_the_gradient():
    # A batch of two: index_q batched, index_keys batched (its own rows per element), the rest
    # shared (in_axes None); each element equals its own call.
    sparse, ratio = DEFAULT[0]
    cases = [make_case(ratio, seed=s) for s in (0, 7)]
    ct = np.random.default_rng(3).normal(size=T).astype(np.float32)
    shared = {k: v for k, v in cases[0].items() if k not in ("index_q", "index_keys")}

    def one(iq, ik):
        def kl_of(student):
            return call(dict(shared, index_q=student[0], index_keys=student[1]), sparse,
                        ratio)[0]

        kl, pullback = jax.vjp(kl_of, (iq, ik))
        return kl, pullback(ct)[0]

    stack = lambda n: np.stack([c[n] for c in cases])  # noqa: E731
    kl, (g_iq, g_ik) = jax.jit(jax.vmap(one))(stack("index_q"), stack("index_keys"))
    for b, c in enumerate(cases):
        want_kl, _, want, _, _ = run_program(
            dict(shared, index_q=c["index_q"], index_keys=c["index_keys"]), sparse, ratio, ct)
        np.testing.assert_allclose(kl[b], want_kl, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(g_iq[b], want[0], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(g_ik[b], want[2], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("sparse", [True, False])
def test_vmap_with_shared_rows_and_no_gradient_for_the_teacher(sparse):
    # Rows shared by the batch (the batch joins the tokens), the queries batched.
    case = make_case(1, seed=2)
    qs = np.stack([case["q"], -case["q"]])
    iqs = np.stack([case["index_q"], 0.5 * case["index_q"]])
    kl, mass = jax.vmap(lambda q, iq: call(case, sparse, 1, q=q, index_q=iq))(qs, iqs)
    for b in range(2):
        want = indexer_kl_numpy(
            qs[b], case["kv"], iqs[b], case["index_weights"], case["index_keys"],
            case["positions"], case["idx"], sparse=sparse, scale=SCALE,
            index_scale=INDEX_SCALE, key_scale=case["key_scale"], compress_ratio=1,
            lse_extra=case["lse_extra"])
        np.testing.assert_allclose(kl[b], want[0], rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(mass[b], want[1], rtol=2e-5, atol=2e-6)
    teacher = jax.grad(lambda q, kv, extra: jnp.sum(
        call(case, sparse, 1, q=q, kv=kv, lse_extra=extra)[0]), argnums=(0, 1, 2))(
        case["q"], case["kv"], case["lse_extra"])
    assert all(not np.any(np.asarray(g)) for g in teacher)


@pytest.mark.parametrize("order", ["grad of grad", "jvp of grad", "jvp of jvp"])
def test_a_second_derivative_is_refused_by_name(order):
    # First derivatives only: a derivative of one raises an error that names the op, never a zero.
    sparse, ratio = DEFAULT[0]
    case = make_case(ratio)

    def loss(iq):
        return jnp.sum(call(dict(case, index_q=iq), sparse, ratio)[0])

    iq = jnp.asarray(case["index_q"])
    second = {
        "grad of grad": lambda: jax.grad(lambda v: jnp.sum(jax.grad(loss)(v)))(iq),
        "jvp of grad": lambda: jax.jvp(jax.grad(loss), (iq,), (jnp.ones_like(iq),)),
        "jvp of jvp": lambda: jax.jvp(lambda v: jax.jvp(loss, (v,), (jnp.ones_like(v),))[1],
                                      (iq,), (jnp.ones_like(iq),)),
    }[order]
    with pytest.raises(NotImplementedError, match="indexer_kl has first derivatives only"):
        second()


def good_args(**overrides):
    case = make_case(1)
    args = dict(q=case["q"], kv=case["kv"], index_q=case["index_q"],
                index_weights=case["index_weights"], index_keys=case["index_keys"],
                positions=case["positions"], idx=case["idx"], sparse=True, scale=SCALE)
    args.update(overrides)
    return args


BAD = [
    (dict(sparse="yes"), TypeError, "sparse must be a bool"),
    (dict(sparse=1), TypeError, "sparse must be a bool"),
    (dict(q=np.zeros((T, H), np.float32)), ValueError, "q must have rank 3"),
    (dict(kv=np.zeros((R, D + 1), np.float32)), ValueError, "kv must have shape"),
    (dict(index_q=np.zeros((T + 1, HI, DI), np.float32)), ValueError, "index_q must have shape"),
    (dict(index_weights=np.zeros((T, HI + 1), np.float32)), ValueError,
     "index_weights must have shape"),
    (dict(index_keys=np.zeros((R, DI + 1), np.float32)), ValueError, "index_keys must have shape"),
    (dict(index_keys=np.zeros((R, DI), np.int32)), TypeError, "index_keys must be a floating"),
    (dict(positions=np.zeros(T, np.float32)), TypeError, "positions must have an integer"),
    (dict(idx=np.zeros((T + 1, K), np.int32)), ValueError, "idx must have shape"),
    (dict(idx=np.zeros((T, K), np.float32)), TypeError, "idx must have an integer"),
    (dict(scale="big"), TypeError, "scale must be a real"),
    (dict(scale=None), TypeError, "scale must be a real"),
    (dict(index_scale=np.ones(2)), ValueError, "index_scale must be a scalar"),
    (dict(key_scale=np.ones(R + 1, np.float32)), ValueError, "key_scale must have shape"),
    (dict(lse_extra=np.zeros((T, H + 1), np.float32)), ValueError, "lse_extra must have shape"),
    (dict(compress_ratio=0), ValueError, "compress_ratio must be at least 1"),
    (dict(compress_ratio=2.5), TypeError, "compress_ratio must be a Python integer"),
    (dict(implementation="nki"), ValueError, "implementation must be None or 'reference'"),
]


@pytest.mark.parametrize("override,error,message", BAD)
def test_bad_input_is_refused_with_its_name(override, error, message):
    args = good_args(**override)
    with pytest.raises(error, match=message):
        indexer_kl(**args)


@pytest.mark.slow
@pytest.mark.parametrize("sparse", [False, True])
def test_memory_grows_linearly_in_tokens(sparse):
    # XLA's own account of the compiled value-and-gradient's temporaries at T and 4 T (no run),
    # with bf16 operands as the layers pass them: linear in T (the residual gradients of index_q),
    # never a [T, R] or [T, H, R] tensor, and never a whole f32 copy of q (XLA:CPU widens a bf16
    # array that a loop slices whole, unless the slice is taken in a cond: cpu_products.loop_slices).
    Hs, Ds, His, Dis, Ks = 16, 64, 8, 32, 64

    def temp(T):
        sd = jax.ShapeDtypeStruct
        bf16 = jnp.bfloat16
        args = (sd((T, Hs, Ds), bf16), sd((T, Ds), bf16), sd((T, His, Dis), bf16),
                sd((T, His), jnp.float32), sd((T, Dis), bf16), sd((T,), jnp.int32),
                sd((T, Ks), jnp.int32))

        def loss(q, kv, iq, w, ik, pos, idx):
            kl, mass = indexer_kl(q, kv, iq, w, ik, pos, idx, sparse=sparse, scale=0.1)
            return jnp.mean(kl), jnp.mean(mass)

        fn = jax.jit(jax.value_and_grad(loss, argnums=(2, 3, 4), has_aux=True))
        return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes

    with pytest.MonkeyPatch.context() as mp:  # the default plan (the module's is tiny)
        mp.setattr(reference, "MAX_CHUNK_TOKENS", 1024)
        mp.setattr(reference, "DENSE_BLOCK_ROWS", 256)
        small, large = temp(2048), temp(8192)
    jax.clear_caches()
    per_token = (large - small) / (8192 - 2048)
    assert per_token < 6 * His * Dis * 4, (small, large)  # a few f32 rows of index_q
    assert per_token < Hs * Ds * 4, (small, large)  # what an f32 copy of q alone would add
    assert large < 8192 * 8192 * 4 // 2, (small, large)  # half a [T, R] f32 tensor


def test_no_neuron_rules_without_the_neuron_platform():
    from jax_sparse_attn.indexer_kl import primitive

    assert primitive.register_neuron_lowering() is False  # no Neuron plugin here


@pytest.mark.slow
@pytest.mark.parametrize("sparse,ratio", DEFAULT[:1])
def test_bf16_operands_are_their_values_and_get_bf16_gradients(sparse, ratio):
    # bf16 operands are exact in f32: the result is the f32 call's on the same values, and the
    # cotangents of index_q and index_keys come back in their dtype.
    case = make_case(ratio, seed=9)
    low = {k: (v.astype(jnp.bfloat16) if k in ("q", "kv", "index_q", "index_keys") else v)
           for k, v in case.items()}
    same = {k: (np.asarray(v, np.float32) if k in ("q", "kv", "index_q", "index_keys") else v)
            for k, v in low.items()}
    ct = np.random.default_rng(4).normal(size=T).astype(np.float32)
    got = jax.jit(lambda c: jax.vjp(lambda *s: call(dict(c, **dict(zip(STUDENT, s))), sparse,
                                                     ratio)[0],
                                    *(c[n] for n in STUDENT))[1](ct))(low)
    want = run_program(same, sparse, ratio, ct)[2]
    assert [g.dtype for g in got] == [jnp.bfloat16, jnp.float32, jnp.bfloat16]
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=1e-2, atol=1e-2 * float(np.abs(w).max()))
    kl = call(low, sparse, ratio)[0]
    np.testing.assert_allclose(kl, run_program(same, sparse, ratio, ct)[0], rtol=1e-5, atol=1e-6)
