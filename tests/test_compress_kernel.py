"""compress_pool's NKI kernel under the emulator against the float64 oracle of
tests/test_compress_pool.py (docs/compress.md's contract, docs/compress-kernel.md).

The ``jax_free`` tests pack the windows in numpy (as ``compress/neuron.py`` does in jnp: the f32
row scores, the overlap's windows, kv zeroed at masked rows, channel-major tiles) and run the
kernel source alone; the others go through ``compress_pool(..., implementation="nki_emulated")``:
packing, tails, the rows before block 0, batch dims, jit and vmap.
"""

import numpy as np
import pytest

from jax_sparse_attn.compress import kernel as compress_kernel
from jax_sparse_attn.nki_emulator import simulate
from test_compress_pool import FLT_MAX, assert_matches, make


def f32_scores(score, ape):
    """The contract's first line in f32: ``min(f32(score) + f32(ape), FLT_MAX)``."""
    with np.errstate(over="ignore", invalid="ignore"):
        s = np.asarray(score, np.float32) + np.asarray(ape, np.float32)
    return np.minimum(s, np.float32(FLT_MAX))


def np_windows(kv, score, ape, overlap, prev_kv=None, prev_score=None):
    """``(kv_w, s_w)`` ``[W, n, Co]`` f32 in window order, kv 0 at masked rows (module
    docstring), and the leading shape ``lead + (N, Co)`` of the result."""
    kv = np.asarray(kv, np.float32)
    r, C = np.shape(ape)
    *lead, T, _ = kv.shape
    N = T // r
    kv_b = kv[..., :N * r, :].reshape(-1, N, r, C)
    s_b = f32_scores(np.asarray(score)[..., :N * r, :].reshape(-1, N, r, C), ape)
    if overlap:
        d = C // 2
        B = kv_b.shape[0]
        if prev_kv is None:
            before_kv = np.zeros((B, r, C), np.float32)
            before_s = np.full((B, r, C), -np.inf, np.float32)
        else:
            before_kv = np.asarray(prev_kv, np.float32).reshape(B, r, C)
            before_s = f32_scores(np.asarray(prev_score).reshape(B, r, C), ape)

        def window(blocks, before):
            previous = np.concatenate([before[:, None, :, :d], blocks[:, :-1, :, :d]], axis=1)
            return np.concatenate([previous, blocks[..., d:]], axis=2)

        kv_b, s_b = window(kv_b, before_kv), window(s_b, before_s)
    kv_b = np.where(s_b == -np.inf, np.float32(0), kv_b)
    n, Co = kv_b.shape[-2:]
    return kv_b.reshape(-1, n, Co), s_b.reshape(-1, n, Co), tuple(lead) + (N, Co)


def run_kernel(kv, score, ape, overlap=False, prev_kv=None, prev_score=None, target="trn2",
               programs=2):
    """The kernel on numpy-packed windows -> ``([..., N, Co] f32, RunStats)``."""
    kv_w, s_w, shape = np_windows(kv, score, ape, overlap, prev_kv, prev_score)
    W, n, Co = kv_w.shape
    plan = compress_kernel.plan_compress(W, n, programs)
    pad = plan.windows_padded - W

    def pack(x):
        x = np.pad(x, ((0, pad), (0, 0), (0, 0)))
        return np.ascontiguousarray(x.transpose(2, 0, 1).reshape(Co, plan.tiles, plan.group * n))

    run = simulate(compress_kernel.compress_pool_kernel, target=target)[programs]
    out = run(pack(kv_w), pack(s_w), rows=n)
    out = np.asarray(out).reshape(Co, plan.windows_padded)[:, :W].T.reshape(shape)
    return out, run.last_run


# --- the kernel alone (no JAX program) -----------------------------------------------------------


@pytest.mark.jax_free
@pytest.mark.parametrize("overlap,ratio,C,T", [
    (True, 4, 128, 18), (True, 4, 256, 41), (False, 4, 128, 23), (False, 128, 128, 300),
    (True, 128, 256, 130), (False, 1, 64, 5), (False, 3, 200, 10), (True, 2, 260, 9),
    (True, 4, 1024, 37), (False, 128, 512, 257), (False, 128, 1024, 130), (False, 4, 300, 5),
])  # fmt: skip
def test_kernel_matches_oracle(overlap, ratio, C, T):
    """Ratios 4 and 128 (and others), widths 64 to 1024 (partial channel tiles included),
    token counts that are not a multiple of the ratio, the first block's missing rows; one
    window, whose channel tiles the two programs share (C = 1024 and 300 without overlap)."""
    rng = np.random.default_rng(ratio * 1000 + C + T)
    kv, score, ape = make(rng, (T, C), ratio)
    got, _ = run_kernel(kv, score, ape, overlap)
    assert_matches(got, kv, score, ape, overlap)


@pytest.mark.jax_free
@pytest.mark.parametrize("target", ["trn1", "trn2", "trn3"])
def test_kernel_targets_and_rows_before(target):
    """Each target (trn1 launches one program), with the rows before block 0 and batch dims."""
    rng = np.random.default_rng(7)
    kv, score, ape = make(rng, (2, 13, 256), 4)
    prev_kv, prev_score, _ = make(rng, (2, 4, 256), 4)
    programs = 1 if target == "trn1" else 2
    got, _ = run_kernel(kv, score, ape, True, prev_kv, prev_score, target, programs)
    assert_matches(got, kv, score, ape, True, prev_kv, prev_score)


def force_form(monkeypatch, form):
    """Run the kernel's per-row or per-window form whatever the tile (``kernel.per_window``)."""
    if form is not None:
        monkeypatch.setattr(compress_kernel, "per_window", lambda group, rows: form == "windows")


@pytest.mark.jax_free
@pytest.mark.parametrize("form", ["rows", "windows"])
@pytest.mark.parametrize("overlap,ratio,C,T", [(True, 4, 128, 41), (False, 128, 192, 390)])
def test_kernel_both_forms(monkeypatch, form, overlap, ratio, C, T):
    rng = np.random.default_rng(ratio + C + T)
    kv, score, ape = make(rng, (T, C), ratio)
    force_form(monkeypatch, form)
    got, _ = run_kernel(kv, score, ape, overlap)
    assert_matches(got, kv, score, ape, overlap)


@pytest.mark.jax_free
@pytest.mark.parametrize("form", ["rows", "windows"])
@pytest.mark.parametrize("overlap", [False, True])
def test_kernel_edge_rules(monkeypatch, overlap, form):
    """-inf rows (NaN kv there never read), whole windows masked (0), +inf scores (FLT_MAX: an
    even split), a NaN score (its window's channel only), a NaN kv at a live row; in both forms."""
    force_form(monkeypatch, form)
    rng = np.random.default_rng(3)
    r, C = 4, 8
    kv, score, ape = make(rng, (6 * r, C), r)
    score[0:2, 1] = -np.inf
    kv[0:2, 1] = np.nan  # masked: never read
    score[4:8, 2] = -np.inf  # block 1 fully masked on channel 2
    score[4:8, 6] = -np.inf
    kv[4:8, 2] = np.inf
    score[9, 3] = np.inf
    score[10, 3] = np.inf  # two rows at FLT_MAX share the weight
    ape[:, 3] = 0.0
    score[13, 0] = np.nan  # block 3, channel 0: NaN
    kv[17, 5] = np.nan  # block 4, channel 5: a live NaN row
    got, _ = run_kernel(kv, score, ape, overlap)
    assert_matches(got, kv, score, ape, overlap)
    if not overlap:
        assert got[1, 2] == 0.0 and np.isnan(got[3, 0]) and np.isnan(got[4, 5])
        assert np.isfinite(np.delete(got[3], 0)).all()


@pytest.mark.slow
@pytest.mark.jax_free
def test_instruction_count_does_not_grow_with_tokens():
    """The tiles run in a hardware loop: the compiled program is the same for 8x the tokens
    (whole tiles of G = 512 windows of 8 rows per program), while the executed count grows."""
    rng = np.random.default_rng(5)
    counts, executed = [], []
    for T in (4 * 1024, 4 * 8192 + 3):
        kv, score, ape = make(rng, (T, 16), 4)
        got, stats = run_kernel(kv, score, ape, True)
        assert_matches(got, kv, score, ape, True)
        counts.append(stats.compiled_instructions_per_program)
        executed.append(stats.instructions)
    assert counts[0] == counts[1], counts
    assert executed[1] > 4 * executed[0], executed


@pytest.mark.jax_free
def test_form_choice():
    """Prefill tiles (many windows) run per row, a decode step's (one window) per window."""
    assert not compress_kernel.per_window(512, 8) and not compress_kernel.per_window(32, 128)
    assert compress_kernel.per_window(1, 8) and compress_kernel.per_window(1, 128)


@pytest.mark.jax_free
def test_plan():
    plan = compress_kernel.plan_compress(512, 128, 2)
    assert (plan.group, plan.tiles) == (32, 16)
    plan = compress_kernel.plan_compress(1, 8, 2)  # decode: one window, its channels split
    assert (plan.group, plan.tiles, plan.windows_padded) == (1, 1, 1)
    plan = compress_kernel.plan_compress(2, 8, 2)  # one window per program
    assert (plan.group, plan.tiles, plan.windows_padded) == (1, 2, 2)
    plan = compress_kernel.plan_compress(16384, 8, 2)
    assert (plan.group, plan.tiles) == (512, 32)


# --- through compress_pool (packing in jnp, a host callback) -------------------------------------


@pytest.mark.parametrize("overlap,ratio,shape", [
    (True, 4, (2, 19, 128)), (False, 128, (1, 257, 128)), (False, 4, (2, 3, 10, 64)),
])  # fmt: skip
def test_op_nki_emulated(overlap, ratio, shape):
    """The whole path, batch dims, a tail of NaN (never read: it reaches no output), jit."""
    import jax

    from jax_sparse_attn import compress_pool

    rng = np.random.default_rng(11)
    kv, score, ape = make(rng, shape, ratio)
    T = shape[-2]
    kv[..., T - T % ratio:, :] = np.nan
    score[..., T - T % ratio:, :] = np.nan
    fn = jax.jit(lambda k, s, a: compress_pool(k, s, a, overlap=overlap,
                                               implementation="nki_emulated"))  # fmt: skip
    got = np.asarray(fn(kv, score, ape))
    assert not np.isnan(got).any()
    assert_matches(got, kv, score, ape, overlap)


def test_op_nki_emulated_prev_vmap_bf16():
    """bf16 operands, the rows before block 0 given, under vmap; a decode step (one block) is the
    same call with T = r."""
    import jax
    import jax.numpy as jnp

    from jax_sparse_attn import compress_pool

    rng = np.random.default_rng(12)
    kv, score, ape = make(rng, (3, 4, 64), 4)
    prev_kv, prev_score, _ = make(rng, (3, 4, 64), 4)
    kv, score = (jnp.asarray(x, jnp.bfloat16) for x in (kv, score))
    got = jax.vmap(lambda k, s, pk, ps: compress_pool(
        k, s, ape, overlap=True, prev_kv=pk, prev_score=ps, implementation="nki_emulated"))(
        kv, score, prev_kv, prev_score)  # fmt: skip
    assert got.shape == (3, 1, 32)
    assert_matches(got, np.asarray(kv, np.float32), np.asarray(score, np.float32), ape, True,
                   prev_kv, prev_score)  # fmt: skip


class _JitOnEmulator:
    """Stands in for ``nki.jit(kernel)`` on the host: ``[n]`` sets the grid, a call runs the
    emulator on the (concrete) arrays."""

    def __init__(self, kernel, grid=1):
        self.kernel, self.grid = kernel, grid

    def __getitem__(self, grid):
        return _JitOnEmulator(self.kernel, grid)

    def __call__(self, *args, **kwargs):
        return simulate(self.kernel)[self.grid](*[np.asarray(a) for a in args], **kwargs)


@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_neuron_path_launch(monkeypatch, target):
    """``emulated=False`` (the path that calls ``nki.jit`` on a Trainium host) with nki.jit
    standing in as the emulator: the launch grid and the operands as the kernel takes them."""
    import jax.numpy as jnp

    from jax_sparse_attn.attention import neuron as attention_neuron
    from jax_sparse_attn.compress.neuron import compress_pool_neuron

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    monkeypatch.setattr(attention_neuron, "jitted_kernel", _JitOnEmulator)
    rng = np.random.default_rng(31)
    kv, score, ape = make(rng, (2, 21, 128), 4)
    prev_kv, prev_score, _ = make(rng, (2, 4, 128), 4)
    got = compress_pool_neuron(*(jnp.asarray(x) for x in (kv, score, ape, prev_kv, prev_score)),
                               overlap=True, emulated=False)  # fmt: skip
    assert_matches(got, kv, score, ape, True, prev_kv, prev_score)


@pytest.mark.slow
def test_sharded_kernel_equals_one_device():
    """On 8 host devices (tests/compress_sharding_checks.py with the kernel): batch, token (the
    overlap's halo), channel and unaligned splits, Auto and Explicit axes, each equal bit for bit
    to the single-device kernel; the gradients (the reference's tangent) finite."""
    from conftest import run_on_8_devices

    records = run_on_8_devices("compress_sharding_checks.py", "nki_emulated")
    assert len(records) >= 20, sorted(records)
    for name, r in records.items():
        assert r["equal"], name
        assert r["grads_finite"], name


# --- a V4 layer on the three kernels -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("layer_id", [1, 2])  # ratio 4 (overlap, indexer), ratio 8 (every block)
def test_v4_layer_runs_the_three_kernels(layer_id):
    """``V4Attention(..., implementation="nki_emulated")`` in V4's own form (bf16, FP8 cache) at
    the tiny config of tests/test_deepseek_v4.py: the compressors, the indexer and the attention
    run their kernels under the emulator, and the layer equals the reference layer within the
    bf16 tolerance the reference itself meets against the float64 oracle."""
    flax = pytest.importorskip("flax")
    import jax.numpy as jnp

    import deepseek_v4_oracle as oracle
    from jax_sparse_attn import nki_emulator
    from jax_sparse_attn.deepseek import V4Attention, V4Config

    config = oracle.tiny_v4_config()
    weights = oracle.random_v4_weights(config, layer_id, np.random.default_rng(layer_id), fp8=True)
    x = np.random.default_rng(1).standard_normal((37, config["dim"]))
    ys, launches = {}, {}
    for impl in (None, "nki_emulated"):
        layer = V4Attention(V4Config.from_dict(config), layer_id, dtype=jnp.bfloat16,
                            cache_dtype="fp8", implementation=impl)  # fmt: skip
        layer.load_weights(weights)
        with nki_emulator.recording(cost=False) as rec:
            y = flax.nnx.jit(lambda lay, t: lay(t))(layer, jnp.asarray(x[None], jnp.bfloat16))
            ys[impl] = np.asarray(y[0], np.float64)
        launches[impl] = [r.programs[0].ops for r in rec.runs]
    assert launches[None] == []
    ops = launches["nki_emulated"]
    pooling = [o for o in ops if "nisa.nc_matmul" not in o and "nisa.tensor_reduce" in o]
    # ratio 4: the main and the indexer's compressors; ratio 8: the main one (no indexer)
    assert len(pooling) == (2 if layer_id == 1 else 1)
    assert len(ops) > len(pooling)  # the indexer's and the attention's kernels
    ref, got = ys[None], ys["nki_emulated"]
    err = np.abs(got - ref).max(-1) / np.abs(ref).max(-1)
    assert err.max() <= 0.06, err.max()
    assert np.median(np.abs(got - ref)) <= 4e-3 * np.abs(ref).max()


# --- the "neuron" platform rule ------------------------------------------------------------------


def test_neuron_rule_waits_for_the_platform_and_dispatches(monkeypatch):
    """Registered once JAX knows "neuron" (never on this machine); there ``None`` means the
    kernel ("nki") and ``"nki_emulated"`` is a clear error (no host callbacks on Neuron)."""
    from jax_sparse_attn.compress import primitive

    assert primitive.register_neuron_lowering() is False  # no Neuron plugin here
    seen = []
    monkeypatch.setattr(primitive, "_lower", lambda *a, overlap, implementation: seen.append(
        implementation))  # fmt: skip
    primitive._lower_neuron(None, None, None, overlap=False, implementation=None)
    primitive._lower_neuron(None, None, None, overlap=False, implementation="reference")
    assert seen == ["nki", "reference"]
    with pytest.raises(NotImplementedError, match="host callback"):
        primitive._lower_neuron(None, None, None, overlap=False, implementation="nki_emulated")


@pytest.mark.jax_free
@pytest.mark.parametrize("overlap", [False, True])
def test_cost_model_bound_counts_each_pooled_value_once(overlap):
    """``--model trn2 --op compress_pool``'s HBM bound: a window pools r rows of C values (with
    overlap, the previous block's low half and its own high half), kv and score f32, and writes
    Co results; B sequences of T tokens (the trailing partial block is never read)."""
    from jax_sparse_attn.bench.compress_model import compress_bounds
    from jax_sparse_attn.nki_emulator.cost import HARDWARE

    ratio, C, T, B = 4, 1024, 4 * 3 + 1, 5
    windows = B * (T // ratio)
    read = windows * 2 * ratio * C * 4  # kv and scores, f32
    written = windows * (C // 2 if overlap else C) * 4
    got = compress_bounds("trn2", ratio, C, overlap, T, B)
    assert got["bound_bytes"] == read + written
    hw = HARDWARE["trn2"]
    assert got["hbm_bound_us"] == pytest.approx((read + written) / (hw.hbm_gbps_per_core * 2e3))
