"""Benchmarks of the indexer (``indexer_topk``) and of the Flax layer's decode step.

Run through the benchmark's command line (``python -m jax_sparse_attn.bench``):

- ``--cases indexer``: the indexer at DeepSeek V3.2's shape (Hi=64, Di=128, K=2048) for a causal
  prefill at T=R=8192 and a decode step (T=1) over R=1M rows, and a small indexer (Hi=4, Di=64,
  K=2048) at T=R=32768. Each case is timed in interleaved rounds with an f32 GEMM (the rate
  baseline, ``of f32 GEMM``) and, where its ``[T, Hi, R]`` products fit in
  ``dense_budget_bytes()``, the dense path (``flax.indexer_scores`` + ``flax.select_topk_rows``, the
  layer's form before the op). FLOPs: ``2 Hi Di`` per valid (token, row) pair (the products; the
  relu and head sum are not counted). A few tokens' selections are checked against float64
  numpy scores. On the jnp reference the same rounds also time its streaming of the scores with
  no selection (``scores alone``: the rate the op would reach if selecting cost nothing;
  ``selection_share_of_op`` in the JSON). ``--cpu-devices N`` gives JAX N CPU devices and deals
  each prefill's tokens out over them (``TokenSplit``): XLA:CPU runs a program's sorts and
  scatters one after another on one core, so one device selects on one core at a time, while N
  devices run N programs side by side (docs/guides/performance.md, "The indexer on CPU").
- ``--cases layer-decode``: one decode step of ``SparseAttention`` (E=512, H=16, D=128, K=2048,
  Hi=4, Di=64, bf16) over a 1M-row cache, jitted with the cache donated, against the indexer call
  and the attention op alone at the same shapes, in the same rounds (target: the step within
  ``LAYER_STEP_TARGET`` times the sum of the two).
- ``--cases layer-prefill``: a causal prefill of ``SparseAttention`` over a batch of B = 2
  sequences of T = 8192 tokens (same layer sizes), jitted; with ``--cpu-devices N`` (N dividing B)
  also with the batch split over N CPU devices, in the same rounds, and the two outputs compared
  bit for bit.
- ``--indexer-sweep``: time and peak memory of one call against T (causal prefill, T=R) and
  against R (decode, T=1) from 4k to 128k, for the op and the dense path, each point in a fresh
  process. ``python -m jax_sparse_attn.plots --indexer-sweep JSON --png PATH`` draws it.

Every figure that depends on the machine is a ratio to a baseline measured in the same run.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from . import common
from ..attention.reference import accelerator_memory_bytes

# The dense path is run only where its [T, Hi, R] f32 products and [T, R] scores stay within this
# on CPU (the machine's processes are kept under ~4 GiB), and within this fraction of an
# accelerator's memory on GPU and TPU.
DENSE_BUDGET_BYTES = 3 * 2**30
DENSE_ACCELERATOR_MEMORY_FRACTION = 1 / 2


def dense_budget_bytes() -> int:
    """Where the dense path runs: ``DENSE_BUDGET_BYTES`` on CPU (or an accelerator that does not
    report its memory), ``DENSE_ACCELERATOR_MEMORY_FRACTION`` of the device's memory elsewhere."""
    limit = accelerator_memory_bytes()
    return int(limit * DENSE_ACCELERATOR_MEMORY_FRACTION) if limit else DENSE_BUDGET_BYTES
# The GEMM baseline's FLOPs are capped (its rate is stable from n ~ 2000 on): the indexer cases
# have up to 550 GFLOP and the GEMM would otherwise take as long as the op.
GEMM_MAX_FLOPS = 2 * 3072**3
# Issue 17's targets: the op's rate over the f32 GEMM's, per case.
GEMM_FRACTION_TARGETS = {"idx-v32-prefill": 0.6, "idx-v32-decode": 0.6, "idx-small-prefill": 0.2}
# The layer's decode step at most this multiple of (indexer call + attention op).
LAYER_STEP_TARGET = 1.5


@dataclasses.dataclass(frozen=True)
class IndexerShape:
    """One indexer case: T tokens at the last T positions of R rows (a causal prefill when T = R,
    a decode step when T = 1), Hi heads of Di, top-K."""

    name: str
    T: int
    Hi: int
    Di: int
    K: int
    R: int

    @property
    def positions(self) -> np.ndarray:
        return np.arange(self.R - self.T, self.R, dtype=np.int32)

    @property
    def valid_pairs(self) -> int:
        """(token, row) pairs with row <= position: what a causal indexer must score."""
        return int(np.minimum(self.positions.astype(np.int64) + 1, self.R).sum())

    @property
    def flops(self) -> int:
        return 2 * self.Hi * self.Di * self.valid_pairs

    @property
    def dense_bytes(self) -> int:
        """The dense path's f32 products [T, Hi, R] and scores [T, R] (its largest buffers)."""
        return 4 * self.T * self.R * (self.Hi + 1)

    def describe(self) -> str:
        return f"T={self.T} Hi={self.Hi} Di={self.Di} K={self.K} R={self.R}"


INDEXER_SHAPES = [
    IndexerShape("idx-v32-prefill", 8192, 64, 128, 2048, 8192),
    IndexerShape("idx-v32-decode", 1, 64, 128, 2048, 2**20),
    IndexerShape("idx-small-prefill", 32768, 4, 64, 2048, 32768),
]
QUICK_INDEXER_SHAPES = [
    IndexerShape("idx-quick-prefill", 512, 4, 64, 64, 512),
    IndexerShape("idx-quick-decode", 1, 8, 64, 64, 8192),
]

# The cases that ``--cpu-devices N`` also times split over N CPU devices.
CPU_DEVICE_CASES = {"indexer", "layer-prefill"}

# The layer's causal prefill of a batch (``--cases layer-prefill``), same layer sizes.
LAYER_PREFILL = dict(E=512, H=16, D=128, K=2048, Hi=4, Di=64, B=2, T=8192)
QUICK_LAYER_PREFILL = dict(E=64, H=4, D=32, K=64, Hi=2, Di=16, B=2, T=512)

# The layer's decode case (issue 17's user report): E=512, H=16, D=128, K=2048, Hi=4, Di=64.
LAYER_DECODE = dict(E=512, H=16, D=128, K=2048, Hi=4, Di=64, R=2**20)
QUICK_LAYER_DECODE = dict(E=64, H=4, D=32, K=64, Hi=2, Di=16, R=8192)

# The sweep: a small indexer (Hi=4, Di=64, K=2048). Points above dense_budget_bytes() skip the dense
# path; the largest prefills run one timed call.
SWEEP = {
    "full": {"fixed": dict(Hi=4, Di=64, K=2048),
             "prefill_T": [4096, 8192, 16384, 32768, 65536, 131072],
             "decode_R": [4096, 8192, 16384, 32768, 65536, 131072]},
    "quick": {"fixed": dict(Hi=2, Di=32, K=64),
              "prefill_T": [512], "decode_R": [4096]},
}


@dataclasses.dataclass(frozen=True)
class TokenSplit:
    """A prefill's tokens dealt out over ``devices`` CPU devices in turn (token t to device
    t mod N), so that each device holds as many late, long tokens of a causal prefill as the
    others; the op takes its tokens in any order, as each carries its position."""

    devices: int

    def applies(self, shape: IndexerShape) -> bool:
        return self.devices > 1 and shape.T % self.devices == 0

    def order(self, T: int) -> np.ndarray:
        """The tokens' order in the split operands: each device's share is contiguous."""
        return np.concatenate([np.arange(d, T, self.devices) for d in range(self.devices)])

    def mesh(self):
        return jax.make_mesh((self.devices,), ("tokens",))

    def operands(self, q, weights, keys, positions):
        """The operands with their tokens in ``order`` and split over the mesh's devices."""
        mesh = self.mesh()
        order = self.order(q.shape[0])
        tokens, whole = NamedSharding(mesh, P("tokens")), NamedSharding(mesh, P())
        return jax.block_until_ready((
            jax.device_put(q[order], tokens), jax.device_put(weights[order], tokens),
            jax.device_put(keys, whole), jax.device_put(positions[order], tokens)))

    def per_device(self, fn):
        """``fn(q, w, keys, positions) -> [T, ...]``, jitted, on each device's tokens (plain jnp
        code: its conds' branches are not typed for a manual axis, hence no ``check_vma``)."""
        tokens = P("tokens")
        return jax.jit(jax.shard_map(fn, mesh=self.mesh(), in_specs=(tokens, tokens, P(), tokens),
                                     out_specs=tokens, check_vma=False))

    def unsplit(self, x) -> np.ndarray:
        """A result in the split order, back in the tokens' own order."""
        x = np.asarray(x)
        out = np.empty_like(x)
        out[self.order(x.shape[0])] = x
        return out


def _inputs(shape: IndexerShape, dtype, seed: int = 0):
    """Random indexer operands: q [T, Hi, Di], weights [T, Hi] f32, keys [R, Di], positions [T]."""
    k_q, k_w, k_k = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(k_q, (shape.T, shape.Hi, shape.Di), dtype)
    weights = jax.random.normal(k_w, (shape.T, shape.Hi), jnp.float32)
    keys = jax.random.normal(k_k, (shape.R, shape.Di), dtype)
    return jax.block_until_ready((q, weights, keys, jnp.asarray(shape.positions)))


def op_fn(shape: IndexerShape, implementation: Optional[str] = None):
    """The op, jitted: ``(q, weights, keys, positions) -> idx [T, K]``."""
    from .. import indexer_topk

    return jax.jit(lambda q, w, k, p: indexer_topk(q, w, k, p, shape.K,
                                                   implementation=implementation))


def scores_alone_fn(shape: IndexerShape, split: Optional[TokenSplit] = None):
    """The reference's streaming of the scores without the selection, jitted, same signature
    (``reference.streamed_scores_alone`` on the op's own operands): the op's time less this
    one's is the selection's. ``split``: on each device's tokens."""
    from ..indexer import api, reference

    def scores(q, w, k, p):
        operands, params = api.primitive_operands(q, w, k, p, shape.K)
        return reference.streamed_scores_alone(
            *operands, topk=params["topk"], compress_ratio=params["compress_ratio"])[1]

    return split.per_device(scores) if split else jax.jit(scores)


def dense_fn(shape: IndexerShape, split: Optional[TokenSplit] = None):
    """The dense path (the layer's selection before the op), jitted, same signature and output
    width ``min(K, R)``. Needs flax (it lives in ``jax_sparse_attn.flax``). ``split``: on each
    device's tokens."""
    from ..flax import indexer_scores, select_topk_rows

    def dense(q, w, k, p):
        scores = indexer_scores(q[None], w[None], k[None], p[None])
        return select_topk_rows(scores, shape.K)[0]

    return split.per_device(dense) if split else jax.jit(dense)


def check_selection(idx, q, weights, keys, positions, k: int, tokens: int = 4) -> dict:
    """Compares a few tokens' selections with float64 numpy scores (the contract's math).

    ``rows_in_f64_topk``: the share of selected rows that are among the float64 top-k.
    ``max_gap_rel``: the largest amount by which a selected row's float64 score falls below the
    float64 k-th score, relative to the largest |score| (rounding of near-ties: ~1e-6 and below).
    """
    T = q.shape[0]
    pick = np.unique(np.linspace(0, T - 1, min(tokens, T)).astype(int))
    q64 = np.asarray(q, np.float64)
    keys64 = np.asarray(keys, np.float64)
    w64 = np.asarray(weights, np.float64) * (q.shape[1] * q.shape[2]) ** -0.5
    inside, total, gap = 0, 0, 0.0
    for t in pick:
        n = int(positions[t]) + 1
        s = np.maximum(q64[t] @ keys64[:n].T, 0).T @ w64[t]  # [n]
        kk = min(k, n)
        kth = np.partition(s, n - kk)[n - kk]
        top = set(np.argsort(-s, kind="stable")[:kk].tolist())
        got = [int(r) for r in np.asarray(idx[t]) if r >= 0]
        inside += sum(r in top for r in got)
        total += max(len(got), kk)
        if got:
            gap = max(gap, float((kth - s[got].min()) / (np.abs(s).max() + 1e-30)))
    return {"tokens_checked": len(pick), "rows_in_f64_topk": inside / max(total, 1),
            "max_gap_rel": max(gap, 0.0)}


def bench_indexer_shape(shape: IndexerShape, dtype_name: str, implementation: str, repeats: int,
                        warmup: int, dense: bool = True, gemm: bool = True,
                        cpu_devices: int = 1) -> dict:
    """Times the op (and, where it fits, the dense path, and the f32 GEMM) at one shape.
    ``cpu_devices > 1``: the tokens split over that many devices (``TokenSplit``; the op under
    ``jit`` on split operands, as a user would call it), where T divides; the GEMM on one."""
    dtype = common.DTYPES[dtype_name]
    q, w, keys, positions = _inputs(shape, dtype)
    split = TokenSplit(cpu_devices)
    split = split if split.applies(shape) else None
    args = split.operands(q, w, keys, positions) if split else (q, w, keys, positions)
    impl = common.implementation_arg(implementation)
    op = op_fn(shape, impl)
    start = time.perf_counter()
    idx = jax.block_until_ready(op(*args))
    first_call_s = time.perf_counter() - start
    fns = {"op": (op, args)}
    if split:  # the same call on one device, in the same rounds (compiled before them)
        fns["op_one_device"] = (op, (q, w, keys, positions))
        jax.block_until_ready(op(q, w, keys, positions))
    if impl in (None, "reference"):  # the jnp reference: its scores alone, in the same rounds
        fns["scores_alone"] = (scores_alone_fn(shape, split), args)
    dense_skipped = None
    if dense:
        budget = dense_budget_bytes()
        if shape.dense_bytes > budget:
            dense_skipped = (f"dense products and scores need {shape.dense_bytes / 2**30:.1f} GiB "
                             f"> {budget / 2**30:.0f} GiB")
        else:
            try:
                fns["dense"] = (dense_fn(shape, split), args)
            except ImportError as err:
                dense_skipped = f"needs flax: {err}"
    gemm_flops = None
    if gemm:
        gemm_fn, gemm_args, gemm_flops = common.square_gemm(min(shape.flops, GEMM_MAX_FLOPS))
        fns["gemm_f32"] = (gemm_fn, gemm_args)
    load_before = common.load_average()
    cpu_times: dict = {}
    times = common.time_rounds(fns, repeats, warmup, cpu_times)
    med = {k: float(np.median(v)) for k, v in times.items()}
    cpu_med = {k: float(np.median(v)) for k, v in cpu_times.items()}
    rec = {
        "case": "indexer",
        "shape": dataclasses.asdict(shape),
        "dtype": dtype_name,
        "implementation": implementation,
        "valid_pairs": shape.valid_pairs,
        "flops": shape.flops,
        "first_call_s": first_call_s,
        "times_s": times,
        "median_s": med,
        "op_gflops": shape.flops / med["op"] / 1e9,
        "cpu_devices": split.devices if split else 1,
        "selection_check": check_selection(split.unsplit(idx) if split else idx, q, w, keys,
                                           shape.positions, shape.K),
        "load_average": {"before": load_before, "after": common.load_average()},
        "cpu_times_s": cpu_times,
        "median_cpu_s": cpu_med,
        "cores_busy": {k: cpu_med[k] / med[k] for k in med if med[k] > 0},
    }
    if "scores_alone" in med:
        rec["selection_share_of_op"] = 1 - med["scores_alone"] / med["op"]
    if split:
        rec["split_over_one_device"] = med["op"] / med["op_one_device"]
    if dense_skipped:
        rec["dense_skipped"] = dense_skipped
    if "dense" in med:
        rec["dense_over_op"] = med["dense"] / med["op"]
        same = np.asarray(fns["dense"][0](*args))
        got = np.asarray(idx)[:, : same.shape[1]]
        rec["dense_same_rows"] = float(np.mean(np.sort(same, 1) == np.sort(got, 1)))
    if gemm:
        rec["gemm_f32_flops"] = gemm_flops
        rec["gemm_f32_gflops"] = gemm_flops / med["gemm_f32"] / 1e9
        rec["op_fraction_of_gemm_f32"] = rec["op_gflops"] / rec["gemm_f32_gflops"]
        if "scores_alone" in med:
            # The rate the op would reach if the selection were free (same FLOPs).
            rec["scores_alone_fraction_of_gemm_f32"] = (
                shape.flops / med["scores_alone"] / 1e9 / rec["gemm_f32_gflops"])
        if cpu_med["op"] > 0 and cpu_med["gemm_f32"] > 0:
            rec["op_fraction_of_gemm_f32_per_cpu_s"] = (
                (shape.flops / cpu_med["op"]) / (gemm_flops / cpu_med["gemm_f32"]))
        if split:
            rec["op_one_device_fraction_of_gemm_f32"] = (
                shape.flops / med["op_one_device"] / 1e9 / rec["gemm_f32_gflops"])
        if shape.name in GEMM_FRACTION_TARGETS:
            rec["target_fraction_of_gemm_f32"] = GEMM_FRACTION_TARGETS[shape.name]
    return rec


def format_token_split(rec: dict, T: int) -> str:
    """One line on an indexer record's token split (``--cpu-devices``)."""
    if rec["cpu_devices"] == 1:
        return f"T = {T} does not split: one device"
    line = (f"tokens dealt over {rec['cpu_devices']} CPU devices: "
            f"{rec['split_over_one_device']:.2f}x the one-device time in the same rounds")
    if "op_one_device_fraction_of_gemm_f32" in rec:
        line += (f"; on one device {rec['op_one_device_fraction_of_gemm_f32']:.2f} of the f32 "
                 f"GEMM (which runs on one device throughout)")
    return line


def format_indexer_table(records) -> str:
    head = (f"{'case':<18} {'shape':<36} {'op ms':>9} {'dense ms':>9} {'dense/op':>8} "
            f"{'GFLOP/s':>8} {'of f32 GEMM':>11} {'target':>6} {'scores alone':>12} "
            f"{'in f64 top-k':>12}")
    lines = [head, "-" * len(head)]
    for r in records:
        s = IndexerShape(**r["shape"])
        med = r["median_s"]
        dense = f"{med['dense'] * 1e3:9.1f}" if "dense" in med else f"{'-':>9}"
        ratio = f"{r['dense_over_op']:7.2f}x" if "dense_over_op" in r else f"{'-':>8}"
        gemm = (f"{r['op_fraction_of_gemm_f32']:11.2f}" if "op_fraction_of_gemm_f32" in r
                else f"{'-':>11}")
        target = r.get("target_fraction_of_gemm_f32")
        target = f"{target:6.2f}" if target is not None else f"{'-':>6}"
        alone = r.get("scores_alone_fraction_of_gemm_f32")
        alone = f"{alone:12.2f}" if alone is not None else f"{'-':>12}"
        lines.append(f"{s.name:<18} {s.describe():<36} {med['op'] * 1e3:9.1f} {dense} {ratio} "
                     f"{r['op_gflops']:8.1f} {gemm} {target} {alone} "
                     f"{r['selection_check']['rows_in_f64_topk']:12.4f}")
    return "\n".join(lines)


# --- the layer's decode step ------------------------------------------------------------------------


def _layer(sizes: dict, dtype, **options):
    """``SparseAttention`` of the bench's sizes (E, H, D, K, Hi, Di) with ``options``, seeded:
    the same weights on every call."""
    from flax import nnx

    from ..flax import SparseAttention

    return SparseAttention(sizes["E"], sizes["H"], sizes["D"], sizes["K"], index_heads=sizes["Hi"],
                           index_dim=sizes["Di"], dtype=dtype, rngs=nnx.Rngs(0), **options)


def bench_layer_decode(sizes: dict, dtype_name: str, implementation: str, repeats: int,
                       warmup: int) -> dict:
    """One decode step of ``SparseAttention`` over an ``R``-row cache (jitted, cache donated),
    the indexer call alone and the attention op alone at the same shapes, in the same rounds."""
    from flax import nnx

    from .. import gathered_attn_idx, indexer_topk

    dtype = common.DTYPES[dtype_name]
    impl = common.implementation_arg(implementation)
    E, H, D, K, Hi, Di, R = (sizes[k] for k in ("E", "H", "D", "K", "Hi", "Di", "R"))
    layer = _layer(sizes, dtype, implementation=impl)
    position = R - 2  # a full cache: the indexer scores R - 1 rows
    cache = layer.init_cache(1, R)._replace(length=jnp.array([position], jnp.int32))
    x = jax.random.normal(jax.random.key(1), (1, 1, E), dtype)
    step = nnx.jit(lambda m, x, c: m(x, c), donate_argnums=2)
    held = {"cache": cache}

    def decode_step():
        y, new = step(layer, x, held["cache"])
        # The same position each round: the work of one step, not of a growing context.
        held["cache"] = new._replace(length=new.length - 1)
        return y

    k_q, k_w, k_k, k_kv, k_a = jax.random.split(jax.random.key(2), 5)
    iq = jax.random.normal(k_q, (1, Hi, Di), dtype)
    iw = jax.random.normal(k_w, (1, Hi), jnp.float32)
    keys = jax.random.normal(k_k, (R, Di), dtype)
    kv = jax.random.normal(k_kv, (R, D), dtype)
    q = jax.random.normal(k_a, (1, H, D), dtype)
    pos = jnp.array([position], jnp.int32)
    indexer = jax.jit(lambda q, w, k, p: indexer_topk(q, w, k, p, K, implementation=impl))
    idx = jax.block_until_ready(indexer(iq, iw, keys, pos))
    sink = jnp.zeros((H,), jnp.float32)
    attend = jax.jit(lambda q, kv, idx, s: gathered_attn_idx(q, kv, idx, s, implementation=impl))
    start = time.perf_counter()
    jax.block_until_ready(decode_step())
    first_call_s = time.perf_counter() - start
    fns = {"step": (decode_step, ()), "indexer": (indexer, (iq, iw, keys, pos)),
           "attention": (attend, (q, kv, idx, sink))}
    load_before = common.load_average()
    times = common.time_rounds(fns, repeats, warmup)
    med = {k: float(np.median(v)) for k, v in times.items()}
    parts = med["indexer"] + med["attention"]
    return {
        "case": "layer-decode",
        "sizes": dict(sizes),
        "dtype": dtype_name,
        "implementation": implementation,
        "first_call_s": first_call_s,
        "times_s": times,
        "median_s": med,
        "step_over_parts": med["step"] / parts,
        "step_over_parts_per_round_median": float(np.median(
            np.array(times["step"]) / (np.array(times["indexer"]) + np.array(times["attention"])))),
        "target_step_over_parts": LAYER_STEP_TARGET,
        "load_average": {"before": load_before, "after": common.load_average()},
    }


def format_layer_decode(rec: dict) -> str:
    med, s = rec["median_s"], rec["sizes"]
    return (f"layer-decode  E={s['E']} H={s['H']} D={s['D']} K={s['K']} Hi={s['Hi']} Di={s['Di']} "
            f"R={s['R']} {rec['dtype']}: step {med['step'] * 1e3:.1f} ms, indexer "
            f"{med['indexer'] * 1e3:.1f} ms, attention {med['attention'] * 1e3:.2f} ms; step / "
            f"(indexer + attention) = {rec['step_over_parts']:.2f} (per-round median "
            f"{rec['step_over_parts_per_round_median']:.2f}; target <= {LAYER_STEP_TARGET})")


def bench_layer_prefill(sizes: dict, dtype_name: str, implementation: str, repeats: int,
                        warmup: int, cpu_devices: int = 1) -> dict:
    """A causal prefill of ``SparseAttention`` (no cache) over ``[B, T, E]``, jitted, on one
    device and, where ``cpu_devices`` divides B, with the batch split over that many devices (each
    selects and attends for its own sequences), in the same rounds."""
    from flax import nnx

    dtype = common.DTYPES[dtype_name]
    impl = common.implementation_arg(implementation)
    B, T, E = sizes["B"], sizes["T"], sizes["E"]
    x = jax.block_until_ready(jax.random.normal(jax.random.key(1), (B, T, E), dtype))
    prefill = nnx.jit(lambda m, x: m(x))
    # One layer per placement: a call on the split batch leaves its layer's weights replicated
    # over the mesh, and the one-device call would then run on every device.
    one_device = _layer(sizes, dtype, implementation=impl)
    fns = {"one_device": (prefill, (one_device, x))}
    split = cpu_devices > 1 and B % cpu_devices == 0
    if split:
        mesh = jax.make_mesh((cpu_devices,), ("batch",))
        fns["split"] = (prefill, (_layer(sizes, dtype, implementation=impl),
                                  jax.device_put(x, NamedSharding(mesh, P("batch")))))
    outs = {k: np.asarray(jax.block_until_ready(fn(*args))) for k, (fn, args) in fns.items()}
    load_before = common.load_average()
    times = common.time_rounds(fns, repeats, warmup)
    med = {k: float(np.median(v)) for k, v in times.items()}
    rec = {"case": "layer-prefill", "sizes": dict(sizes), "dtype": dtype_name,
           "implementation": implementation, "cpu_devices": cpu_devices if split else 1,
           "times_s": times, "median_s": med, "finite": bool(np.isfinite(outs["one_device"]).all()),
           "one_device_weights_on": len(jax.tree.leaves(nnx.state(one_device))[0].devices()),
           "load_average": {"before": load_before, "after": common.load_average()}}
    if split:
        rec["split_over_one_device"] = med["split"] / med["one_device"]
        rec["split_same_bits"] = bool(np.array_equal(outs["split"], outs["one_device"]))
    return rec


def format_layer_prefill(rec: dict) -> str:
    med, s = rec["median_s"], rec["sizes"]
    line = (f"layer-prefill  B={s['B']} T={s['T']} E={s['E']} H={s['H']} D={s['D']} K={s['K']} "
            f"Hi={s['Hi']} Di={s['Di']} {rec['dtype']}: one device {med['one_device']:.2f} s")
    if "split" in med:
        line += (f"; batch over {rec['cpu_devices']} CPU devices {med['split']:.2f} s "
                 f"({rec['split_over_one_device']:.2f}x), same bits: {rec['split_same_bits']}")
    return line


# --- the sweep: time and memory against T and R -------------------------------------------------------


def sweep_child(shape: IndexerShape, path: str, dtype_name: str, repeats: int) -> dict:
    """Runs in a fresh process: peak memory growth of the first call (compilation included, inputs
    excluded) of ``path`` ("op" or "dense"), then the median time of ``repeats`` more calls. The
    memory is the process's RSS on CPU, the device's peak bytes in use on an accelerator."""
    dtype = common.DTYPES[dtype_name]
    args = _inputs(shape, dtype)
    peak_reset = common.reset_peak_rss()
    rss_before = common.rss_bytes()
    device_before = accelerator_memory_bytes("bytes_in_use")
    fn = op_fn(shape) if path == "op" else dense_fn(shape)
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    if device_before is None:
        growth = common.peak_rss_bytes() - rss_before
    else:  # a fresh process: its peak so far is the inputs and this call
        growth = accelerator_memory_bytes("peak_bytes_in_use") - device_before
        peak_reset = True
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return {"shape": dataclasses.asdict(shape), "path": path, "dtype": dtype_name,
            "growth_bytes": growth, "peak_reset": peak_reset, "first_call_s": first,
            "times_s": times, "median_s": float(np.median(times)) if times else first}


def run_sweep_child(shape: IndexerShape, path: str, dtype_name: str, repeats: int,
                    timeout: float = 1800) -> dict:
    cmd = [sys.executable, "-m", "jax_sparse_attn.bench", "--indexer-sweep-child",
           json.dumps(dataclasses.asdict(shape)), "--indexer-path", path, "--dtype", dtype_name,
           "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"indexer sweep point failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def sweep(quick: bool = False, dtype_name: str = "bf16", max_size: Optional[int] = None,
          repeats: Optional[int] = None, log=print) -> dict:
    """Time and peak memory of the op and the dense path against T (causal prefill, T = R) and
    against R (decode, T = 1). Returns ``{"environment", "sizes", "prefill", "decode"}``, each
    a list of ``{"T", "R", "op": sweep_child record, "dense": record or None, "dense_skipped"}``.
    ``max_size`` drops the prefills with a larger T (a shorter run; the decode points are cheap)."""
    sizes = SWEEP["quick" if quick else "full"]
    fixed = sizes["fixed"]
    result: dict = {"environment": common.environment(), "dtype": dtype_name, "sizes": sizes,
                    "dense_budget_bytes": dense_budget_bytes()}
    for key, points in (("prefill", [(n, n) for n in sizes["prefill_T"]]),
                        ("decode", [(1, n) for n in sizes["decode_R"]])):
        records = []
        for T, R in points:
            if max_size is not None and key == "prefill" and T > max_size:
                continue
            shape = IndexerShape(f"sweep-{key}-{max(T, R)}", T, fixed["Hi"], fixed["Di"],
                                 fixed["K"], R)
            # Timed calls after the first: 3, or as given (1 for a shorter run of the prefills).
            n = 3 if repeats is None or key == "decode" else repeats
            point = {"T": T, "R": R, "flops": shape.flops, "dense_bytes": shape.dense_bytes,
                     "op": run_sweep_child(shape, "op", dtype_name, n)}
            if shape.dense_bytes <= result["dense_budget_bytes"]:
                point["dense"] = run_sweep_child(shape, "dense", dtype_name, n)
            else:
                point["dense"] = None
                point["dense_skipped"] = (f"needs {shape.dense_bytes / 2**30:.1f} GiB > "
                                          f"{result['dense_budget_bytes'] / 2**30:.0f} GiB")
            records.append(point)
            gib = 2**30
            dense = point["dense"]
            log(f"{key} {shape.describe()}: op {point['op']['median_s'] * 1e3:.1f} ms, "
                f"{point['op']['growth_bytes'] / gib:.3f} GiB; dense "
                + (f"{dense['median_s'] * 1e3:.1f} ms, {dense['growth_bytes'] / gib:.3f} GiB"
                   if dense else point["dense_skipped"]))
        result[key] = records
    return result


# --- the layer's long prefill: peak memory ------------------------------------------------------------

# Issue 17: a causal prefill of T = 65,536 with the layer grows the process by at most 3 GiB.
LAYER_PREFILL_T = 65536
LAYER_PREFILL_LIMIT_BYTES = 3 * 2**30


def layer_memory_child(T: int, sizes: dict, dtype_name: str = "bf16",
                       selection: str = "streaming") -> dict:
    """Runs in a fresh process: peak RSS growth of one jitted causal prefill of ``T`` tokens into
    an empty cache of ``T`` rows (compilation, projections, selection, attention and the output
    included; the input, the parameters and the empty cache excluded), and its time (compilation
    included)."""
    from flax import nnx

    dtype = common.DTYPES[dtype_name]
    layer = _layer(sizes, dtype, selection=selection)
    x = jax.block_until_ready(jax.random.normal(jax.random.key(1), (1, T, sizes["E"]), dtype))
    cache = jax.block_until_ready(layer.init_cache(1, T))
    prefill = nnx.jit(lambda m, x, c: m(x, c), donate_argnums=2)
    peak_reset = common.reset_peak_rss()
    rss_before = common.rss_bytes()
    start = time.perf_counter()
    y, cache = prefill(layer, x, cache)
    y = jax.block_until_ready(y)
    seconds = time.perf_counter() - start
    growth = common.peak_rss_bytes() - rss_before
    return {"T": T, "sizes": dict(sizes), "dtype": dtype_name, "selection": selection,
            "growth_bytes": growth,
            "limit_bytes": LAYER_PREFILL_LIMIT_BYTES, "peak_reset": peak_reset,
            "seconds_first_call": seconds, "finite": bool(np.isfinite(np.asarray(y, np.float32)).all()),
            "length": int(cache.length[0]),
            # The dense selection's [T, Hi, T] f32 products alone (what the op avoids).
            "dense_products_bytes": 4 * T * sizes["Hi"] * T}


def run_layer_memory_check(T: int = LAYER_PREFILL_T, sizes: Optional[dict] = None,
                           dtype_name: str = "bf16", timeout: float = 1800,
                           selection: str = "streaming") -> dict:
    """:func:`layer_memory_child` in a fresh Python process; returns its record."""
    sizes = LAYER_DECODE if sizes is None else sizes
    cmd = [sys.executable, "-m", "jax_sparse_attn.bench", "--layer-memory-child", str(T),
           "--layer-sizes", json.dumps(sizes), "--dtype", dtype_name,
           "--layer-selection", selection]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"layer memory check failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def layer_memory_main(T: int, dtype_name: str, json_path: Optional[str]) -> int:
    """``--layer-memory [T]``: :func:`run_layer_memory_check` (T < 0: ``LAYER_PREFILL_T``), printed
    against ``LAYER_PREFILL_LIMIT_BYTES``; exit status 1 above it."""
    T = LAYER_PREFILL_T if T < 0 else T
    env = common.environment()
    rec = run_layer_memory_check(T, dtype_name=dtype_name)
    gib = 2**30
    s = rec["sizes"]
    print(f"# jax {env['jax']}; CPU: {env['cpu'].get('model name', '?')} x{env['cpu_count']}")
    print(f"layer prefill T={T} (E={s['E']} H={s['H']} D={s['D']} K={s['K']} Hi={s['Hi']} "
          f"Di={s['Di']}, {dtype_name}): peak RSS growth {rec['growth_bytes'] / gib:.2f} GiB "
          f"(limit {rec['limit_bytes'] / gib:.1f} GiB; the dense selection's products alone "
          f"{rec['dense_products_bytes'] / gib:.1f} GiB) in {rec['seconds_first_call']:.1f} s",
          flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"environment": env, "layer_memory": rec}, f, indent=1)
    return 0 if rec["growth_bytes"] <= rec["limit_bytes"] else 1
