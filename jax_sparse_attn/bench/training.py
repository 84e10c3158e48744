"""Training DeepSeek's attention blocks on the CPU (``python -m jax_sparse_attn.bench --train
...``; issue 55's speed and memory): bf16 weights and activations, B = 1, every case in a fresh
process.

- ``step``: one training step of a layer over whole sequences: ``y = layer(x)``, the LM loss
  ``sum(y * r)`` and its gradient with respect to the main parameters and ``x``, then the sparse
  indexer loss ``layer.indexer_loss(x, sparse=True)`` and its gradient with respect to the
  indexer's parameters (layers with an indexer). Kinds: ``ratio4`` and ``ratio128`` (V4-Flash's
  layers 2 and 3) and ``v32`` (V3.2-Exp's layer), with bf16 weights (the configs' ``dtype="bf16"``:
  the FP8 projections built as plain bf16 ones). The first step's peak RSS growth, from before
  ``x`` exists (x, r, y, the gradients and the compilation included), against the issue's bounds;
  then, where ``--repeats`` asks, the step and the forward ``layer(x)`` timed alternately in the
  same rounds (step / forward at most 5).
- ``dense-kl``: ``indexer_kl(..., sparse=False)`` with its gradient with respect to the
  indexer's operands at V3.2's shapes (8,192 tokens, 128 heads of 576, 64 index heads of 128,
  bf16 operands): the peak growth of its first call, with and without the inputs, the latter
  (what the loss adds to a step) within 2 GiB,
  and its rate against an f32 GEMM timed in the same rounds (at least 0.5), counting the
  teacher's logits twice (its two passes) and the student's scores three times over every
  visible pair (:func:`dense_kl_flops`).

``--quick`` runs narrowed layers at a few hundred tokens and a small dense shape (seconds).
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

from . import common

GIB = 2**30
KINDS = ("ratio4", "ratio128", "v32")
# V4-Flash's layer 2 has ratio 4 (compressor and indexer), layer 3 ratio 128 (every block).
V4_LAYERS = {"ratio4": 2, "ratio128": 3}
# The bounds: the process's growth over one step, by kind and tokens, and the step's time
# over the forward's (a backward that recomputes costs about 3.5x to 4x).
STEP_MEMORY_LIMITS = {
    "ratio4": {16384: 6 * GIB, 65536: 12 * GIB},
    "ratio128": {16384: 6 * GIB, 65536: 12 * GIB},
    "v32": {8192: 6 * GIB},
}
STEP_OVER_FORWARD_LIMIT = 5.0
# The tokens measured by default (memory against T; the step timed up to TIMED_TOKENS).
STEP_TOKENS = {"ratio4": (4096, 16384, 65536), "ratio128": (4096, 16384, 65536), "v32": (2048, 8192)}
TIMED_TOKENS = 16384
QUICK_STEP_TOKENS = (128, 320)
# The dense indexer loss: within 2 GiB, and at least half an f32 GEMM's rate.
DENSE_KL_MEMORY_LIMIT = 2 * GIB
DENSE_KL_GEMM_FRACTION = 0.5
# The f32 GEMM baseline: at most this side (2 n^3 FLOPs per call), enough to reach its rate.
GEMM_MAX_SIDE = 2048


@dataclasses.dataclass(frozen=True)
class DenseKLShape:
    """The dense indexer loss's case: T tokens = R rows (a causal prefill, one row per token as
    V3.2's), H teacher heads of D, Hi index heads of Di, the indexer's top K (for the mass)."""

    name: str
    T: int
    H: int
    D: int
    Hi: int
    Di: int
    K: int

    @property
    def visible_pairs(self) -> int:
        """The (token, row) pairs a causal prefill sees: T (T + 1) / 2."""
        return self.T * (self.T + 1) // 2

    def describe(self) -> str:
        return f"T=R={self.T} H={self.H} D={self.D} Hi={self.Hi} Di={self.Di} K={self.K}"


DENSE_KL_SHAPE = DenseKLShape("v32-dense-kl", 8192, 128, 576, 64, 128, 2048)
QUICK_DENSE_KL_SHAPE = DenseKLShape("quick-dense-kl", 256, 8, 64, 4, 32, 16)


def dense_kl_flops(shape: DenseKLShape) -> int:
    """The FLOPs the dense loss with its gradient is credited with: over every visible pair, the
    teacher's logits twice (``2 H D`` each: its two passes) and the student's scores three times
    (``2 Hi Di`` each: two passes and the gradient)."""
    per_pair = 2 * (2 * shape.H * shape.D) + 3 * (2 * shape.Hi * shape.Di)
    return shape.visible_pairs * per_pair


# --- the layers -----------------------------------------------------------------------------------


def layer_config(kind: str, quick: bool = False):
    """The config of ``kind`` with bf16 weights: V4-Flash's (``ratio4``, ``ratio128``) or
    V3.2-Exp's (``v32``); ``quick``: narrowed to run in seconds."""
    from ..deepseek import V4_FLASH, V32_EXP

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}; got {kind!r}")
    if kind == "v32":
        config = V32_EXP.replace(dtype="bf16")
        if quick:
            config = config.replace(dim=512, n_heads=4, q_lora_rank=256, index_n_heads=4,
                                    index_topk=16)
        return config
    config = V4_FLASH.replace(dtype="bf16")
    if quick:
        config = config.replace(dim=256, n_heads=4, head_dim=128, q_lora_rank=128, o_groups=2,
                                o_lora_rank=64, index_n_heads=4, index_head_dim=64, index_topk=16,
                                window_size=32)
    return config


def make_layer(kind: str, quick: bool = False):
    """A bf16 layer of ``kind`` (random weights; rows FP8-simulated as deployed)."""
    from flax import nnx

    from ..deepseek import V4Attention, V32Attention

    config = layer_config(kind, quick)
    if kind == "v32":
        return V32Attention(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    return V4Attention(config, V4_LAYERS[kind], dtype=jnp.bfloat16, rngs=nnx.Rngs(0))


def training_functions(layer, sparse: bool = True):
    """``(forward, step, params, parts)`` for ``layer``, pure and unjitted: ``forward(*params, x)
    -> y`` and ``step(*params, x, r) -> dict``: the LM loss ``sum(y * r)`` (f32) with its
    gradients with respect to the main parameters and ``x``, and (layers with an indexer) the
    indexer loss with its stats and its gradient with respect to the indexer's parameters;
    ``parts``: ``{"lm": fn, "indexer": fn}``, each half of the step alone (same arguments)."""
    from flax import nnx

    from ..deepseek import INDEXER_PARAMS, MAIN_PARAMS

    graphdef, indexer_params, main_params, rest = nnx.split(layer, INDEXER_PARAMS, MAIN_PARAMS, ...)
    has_indexer = getattr(layer, "indexer", None) is not None

    def module(main, indexer, rest):
        return nnx.merge(graphdef, indexer, main, rest)

    def forward(main, indexer, rest, x):
        return module(main, indexer, rest)(x)

    def lm_part(main, indexer, rest, x, r):
        def lm_loss(main, x):
            y = module(main, indexer, rest)(x)
            return jnp.sum(y.astype(jnp.float32) * r.astype(jnp.float32))

        loss, (g_main, g_x) = jax.value_and_grad(lm_loss, argnums=(0, 1))(main, x)
        return dict(lm_loss=loss, main_grads=g_main, x_grad=g_x)

    def indexer_part(main, indexer, rest, x, r):
        def indexer_loss(indexer):
            return module(main, indexer, rest).indexer_loss(x, sparse=sparse)

        (kl, stats), g_indexer = jax.value_and_grad(indexer_loss, has_aux=True)(indexer)
        return dict(indexer_loss=kl, indexer_stats=stats, indexer_grads=g_indexer)

    def step(*args):
        out = lm_part(*args)
        if has_indexer:
            out.update(indexer_part(*args))
        return out

    parts = dict(lm=lm_part, indexer=indexer_part) if has_indexer else {}
    return forward, step, (main_params, indexer_params, rest), parts


def _param_count(tree) -> int:
    return int(sum(a.size for a in jax.tree.leaves(tree)))


def _tokens_input(tokens: int, dim: int, seed: int):
    """``[1, tokens, dim]`` bf16 standard normals, drawn in pieces (a whole f32 draw would be
    twice the array)."""
    rng = np.random.default_rng(seed)
    pieces = [jnp.asarray(rng.standard_normal((1, min(4096, tokens - i), dim), np.float32),
                          jnp.bfloat16) for i in range(0, tokens, 4096)]
    return jax.block_until_ready(jnp.concatenate(pieces, axis=1))


def _finite_sample(a, samples: int = 64) -> bool:
    a = a.reshape(-1, a.shape[-1]) if a.ndim > 1 else a[None]
    return bool(jnp.all(jnp.isfinite(a[:: max(a.shape[0] // samples, 1)].astype(jnp.float32))))


def xla_account(compiled, resident_bytes: int) -> dict:
    """XLA's own buffer assignment for a compiled program (its ``memory_analysis()``: what it
    allocates, not a measurement), and the growth it implies: the arguments less those already
    resident (the parameters), the outputs and the temporaries."""
    m = compiled.memory_analysis()
    account = dict(arguments=int(m.argument_size_in_bytes), outputs=int(m.output_size_in_bytes),
                   temp=int(m.temp_size_in_bytes))
    account["growth"] = account["arguments"] - resident_bytes + account["outputs"] + account["temp"]
    return account


def step_child(kind: str, tokens: int, repeats: int, warmup: int, quick: bool = False,
               parts: bool = False, compile_only: bool = False) -> dict:
    """In a fresh process: the peak RSS growth of a layer's first training step from before x
    exists (compilation, x, r, y, the gradients), then (``repeats > 0``) the step and the forward
    timed alternately in the same rounds; with ``parts``, also each half of the step alone (the
    LM loss's value and gradient, the indexer loss's) in the same rounds. Every record has XLA's
    account of the step (:func:`xla_account`); ``compile_only`` stops there (for steps longer
    than the machine can run: the bounds are then checked on the account, so labelled)."""
    layer = make_layer(kind, quick)
    forward, step, params, halves = training_functions(layer)
    dim = layer.config.dim
    spec = jax.ShapeDtypeStruct((1, tokens, dim), jnp.bfloat16)
    step_jit = jax.jit(step)
    base = common.rss_bytes()
    common.reset_peak_rss()
    start = time.perf_counter()
    compiled = step_jit.lower(*params, spec, spec).compile()
    compile_s = time.perf_counter() - start
    compile_growth = common.peak_rss_bytes() - base
    account = xla_account(compiled, int(sum(a.nbytes for a in jax.tree.leaves(params))))
    limit = STEP_MEMORY_LIMITS.get(kind, {}).get(tokens) if not quick else None
    if compile_only:
        return dict(case="train-step", kind=kind, layer_id=V4_LAYERS.get(kind), tokens=tokens,
                    quick=quick, config=dataclasses.asdict(layer.config), compile_only=True,
                    xla_account=account, compile_growth_bytes=compile_growth, limit_bytes=limit,
                    x_bytes=tokens * dim * jnp.dtype(jnp.bfloat16).itemsize,
                    within_limit=None if limit is None else account["growth"] <= limit,
                    compile_s=compile_s, finite=True)
    common.reset_peak_rss()
    x = _tokens_input(tokens, dim, 0)
    r = _tokens_input(tokens, dim, 1)
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(*params, x, r))
    first_s = time.perf_counter() - start
    run_growth = common.peak_rss_bytes() - base
    growth = max(compile_growth, run_growth)
    rec = dict(
        case="train-step", kind=kind, layer_id=V4_LAYERS.get(kind), tokens=tokens, quick=quick,
        config=dataclasses.asdict(layer.config), indexer_loss="indexer_loss" in out,
        xla_account=account,
        main_params=_param_count(params[0]), indexer_params=_param_count(params[1]),
        growth_bytes=growth, compile_growth_bytes=compile_growth, run_growth_bytes=run_growth,
        x_bytes=x.nbytes, limit_bytes=limit, within_limit=None if limit is None else growth <= limit,
        compile_s=compile_s, first_step_s=first_s,
        lm_loss=float(out["lm_loss"]), finite=_finite_sample(out["x_grad"][0]) and all(
            bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in jax.tree.leaves(out["main_grads"])))
    if "indexer_loss" in out:
        rec.update(indexer_loss_value=float(out["indexer_loss"]),
                   indexer_mass=float(out["indexer_stats"]["mass"]),
                   finite=rec["finite"] and bool(jnp.isfinite(out["indexer_loss"])) and all(
                       bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(out["indexer_grads"])))
    del out
    print(json.dumps(rec), flush=True)  # the memory, should the rounds be stopped
    if repeats > 0:
        forward_jit = jax.jit(forward)
        start = time.perf_counter()
        jax.block_until_ready(forward_jit(*params, x))
        rec["forward_first_call_s"] = time.perf_counter() - start
        cpu: dict = {}
        load_before = common.load_average()
        timed = {"step": (compiled, (*params, x, r)), "forward": (forward_jit, (*params, x))}
        if parts:  # compiled (and run once) before the rounds, as the step and the forward are
            for name, fn in halves.items():
                half = jax.jit(fn).lower(*params, spec, spec).compile()
                jax.block_until_ready(half(*params, x, r))
                timed[name] = (half, (*params, x, r))
        times = common.time_rounds(timed, repeats, warmup, cpu)
        med = {k: float(np.median(v)) for k, v in times.items()}
        med_cpu = {k: float(np.median(v)) for k, v in cpu.items()}
        rec.update(
            seconds=times, cpu_seconds=cpu, median_s=med, median_cpu_s=med_cpu,
            step_over_forward=med["step"] / med["forward"],
            # Each round's own ratio: the step and the forward under the same load.
            step_over_forward_by_round=[s / f for s, f in zip(times["step"], times["forward"])],
            step_over_forward_cpu=med_cpu["step"] / med_cpu["forward"],
            limit_step_over_forward=STEP_OVER_FORWARD_LIMIT,
            load_average={"before": load_before, "after": common.load_average()})
    return rec


# --- the dense indexer loss -------------------------------------------------------------------------


def _dense_kl_inputs(shape: DenseKLShape, seed: int = 0) -> dict:
    """bf16 operands of a V3.2-like causal prefill: teacher queries and rows, the indexer's
    queries, weights and keys, the current top-k (random visible rows)."""
    T, H, D, Hi, Di, K = shape.T, shape.H, shape.D, shape.Hi, shape.Di, shape.K
    rng = np.random.default_rng(seed)

    def normal(shape_, scale=1.0):
        # Drawn 256 tokens at a time into bf16: a whole f32 draw of q ([T, H, D]) would be 2x it.
        out = np.empty(shape_, jnp.bfloat16)
        for i in range(0, shape_[0], 256):
            piece = rng.standard_normal((min(256, shape_[0] - i),) + shape_[1:], np.float32)
            out[i:i + 256] = piece * np.float32(scale)
        return jnp.asarray(out)

    positions = np.arange(T, dtype=np.int32)
    picks = rng.integers(0, 2**30, (T, K)) % (positions + 1)[:, None]
    idx = np.where(np.arange(K) < (positions + 1)[:, None], picks, -1).astype(np.int32)
    return jax.block_until_ready(dict(
        q=normal((T, H, D)), kv=normal((T, D)), index_q=normal((T, Hi, Di)),
        index_weights=normal((T, Hi), Hi ** -0.5), index_keys=normal((T, Di)),
        positions=jnp.asarray(positions), idx=jnp.asarray(idx)))


def dense_kl_function(shape: DenseKLShape):
    """The dense loss (the mean of ``kl`` over tokens with a candidate, as the layers take it)
    with its gradient with respect to index_q, index_weights and index_keys: jitted
    ``fn(inputs) -> ((loss, mass), grads)``."""
    from ..api import indexer_kl

    scale = shape.D ** -0.5

    def loss(index_q, index_weights, index_keys, a):
        kl, mass = indexer_kl(a["q"], a["kv"], index_q, index_weights, index_keys, a["positions"],
                              a["idx"], sparse=False, scale=scale)
        return jnp.mean(kl), jnp.mean(mass)

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    return jax.jit(lambda a: grad(a["index_q"], a["index_weights"], a["index_keys"], a))


def dense_kl_child(shape: DenseKLShape, repeats: int, warmup: int) -> dict:
    """In a fresh process: the dense loss's first call's peak RSS growth (from before the inputs
    exist, and from after), then its rate against an f32 GEMM timed in the same rounds."""
    fn = dense_kl_function(shape)
    base = common.rss_bytes()
    common.reset_peak_rss()
    inputs = _dense_kl_inputs(shape)
    input_bytes = int(sum(a.nbytes for a in jax.tree.leaves(inputs)))
    after_inputs = common.rss_bytes()
    common.reset_peak_rss()
    start = time.perf_counter()
    (loss, mass), grads = jax.block_until_ready(fn(inputs))
    first_s = time.perf_counter() - start
    peak = common.peak_rss_bytes()
    flops = dense_kl_flops(shape)
    rec = dict(case="train-dense-kl", shape=dataclasses.asdict(shape), dtype="bf16",
               input_bytes=input_bytes, growth_bytes=peak - base,
               growth_without_inputs_bytes=peak - after_inputs,
               limit_bytes=DENSE_KL_MEMORY_LIMIT, first_call_s=first_s, flops=flops,
               loss=float(loss), mass=float(mass),
               finite=bool(jnp.isfinite(loss)) and all(bool(jnp.all(jnp.isfinite(g))) for g in grads))
    # The bound is on what the loss adds: its inputs (1.32 GiB at V3.2's shapes, q alone 1.13)
    # are the model's activations, there before it in any step; both growths are recorded.
    rec["within_limit"] = rec["growth_without_inputs_bytes"] <= DENSE_KL_MEMORY_LIMIT
    del grads
    print(json.dumps(rec), flush=True)  # the memory, should the rounds be stopped
    if repeats > 0:
        n = min(GEMM_MAX_SIDE, max(16, int(round((flops / 2) ** (1 / 3) / 16)) * 16))
        gemm, gemm_args, gemm_flops = common.square_gemm(2 * n**3)
        cpu: dict = {}
        load_before = common.load_average()
        times = common.time_rounds({"dense_kl": (fn, (inputs,)), "gemm_f32": (gemm, gemm_args)},
                                   repeats, warmup, cpu)
        med = {k: float(np.median(v)) for k, v in times.items()}
        med_cpu = {k: float(np.median(v)) for k, v in cpu.items()}
        rate, gemm_rate = flops / med["dense_kl"], gemm_flops / med["gemm_f32"]
        rec.update(seconds=times, cpu_seconds=cpu, median_s=med, median_cpu_s=med_cpu,
                   gemm_flops=gemm_flops, gflops=rate / 1e9, gemm_gflops=gemm_rate / 1e9,
                   fraction_of_gemm_f32=rate / gemm_rate,
                   fraction_of_gemm_f32_per_cpu_s=(flops / med_cpu["dense_kl"])
                   / (gemm_flops / med_cpu["gemm_f32"]),
                   limit_fraction_of_gemm_f32=DENSE_KL_GEMM_FRACTION,
                   load_average={"before": load_before, "after": common.load_average()})
    return rec


# --- the command line -------------------------------------------------------------------------------


def _child(spec: dict, timeout: Optional[float] = None) -> dict:
    """Runs a case in a fresh process. Past ``timeout`` seconds the process is stopped and the
    record it printed after its first call (the memory) is returned, marked ``timed_out``."""
    cmd = [sys.executable, "-m", "jax_sparse_attn.bench", "--train-child", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        out = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        lines = out.strip().splitlines()
        if not lines:
            raise RuntimeError(f"{' '.join(cmd)}: no record within {timeout} s") from None
        return dict(json.loads(lines[-1]), timed_out=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_main(spec: str) -> int:
    spec = json.loads(spec)
    fn = spec.pop("fn")
    if fn == "step":
        rec = step_child(**spec)
    else:
        rec = dense_kl_child(DenseKLShape(**spec.pop("shape")), **spec)
    print(json.dumps(rec))
    return 0


def format_step(rec: dict) -> str:
    limit = rec.get("limit_bytes")
    if rec.get("compile_only"):
        acc = rec["xla_account"]
        return (f"train step {rec['kind']} T={rec['tokens']}: compiled, not run; XLA's account "
                f"(its buffer assignment, not a measurement) grows the process by "
                f"{acc['growth'] / GIB:.2f} GiB" + (f" (limit {limit / GIB:.0f})" if limit else "")
                + f" (temp {acc['temp'] / GIB:.2f}, outputs {acc['outputs'] / GIB:.2f}); "
                f"compile {rec['compile_s']:.0f} s")
    text = (f"train step {rec['kind']} T={rec['tokens']}: grew the process by "
            f"{rec['growth_bytes'] / GIB:.2f} GiB"
            + (f" (limit {limit / GIB:.0f})" if limit else "")
            + f" (compile {rec['compile_growth_bytes'] / GIB:.2f}, run {rec['run_growth_bytes'] / GIB:.2f}; "
            f"x {rec['x_bytes'] / GIB:.3f}); compile {rec['compile_s']:.0f} s, first step "
            f"{rec['first_step_s']:.1f} s; XLA's account {rec['xla_account']['growth'] / GIB:.2f} GiB")
    if "step_over_forward" in rec:
        m = rec["median_s"]
        halves = "".join(f", {k} alone {v:.2f} s" for k, v in m.items() if k not in ("step", "forward"))
        text += (f"; step {m['step']:.2f} s, forward {m['forward']:.2f} s{halves}: step / forward = "
                 f"{rec['step_over_forward']:.2f} (CPU seconds: {rec['step_over_forward_cpu']:.2f}; "
                 f"limit {STEP_OVER_FORWARD_LIMIT:g})")
    return text


def format_dense_kl(rec: dict) -> str:
    s = DenseKLShape(**rec["shape"])
    text = (f"dense indexer loss + grad {s.describe()} bf16: grew the process by "
            f"{rec['growth_bytes'] / GIB:.2f} GiB with its inputs "
            f"({rec['input_bytes'] / GIB:.2f} GiB), {rec['growth_without_inputs_bytes'] / GIB:.2f} "
            f"without (limit {DENSE_KL_MEMORY_LIMIT / GIB:.0f}); first call {rec['first_call_s']:.1f} s")
    if "fraction_of_gemm_f32" in rec:
        text += (f"; {rec['median_s']['dense_kl']:.2f} s per call, {rec['gflops']:.1f} GFLOP/s = "
                 f"{rec['fraction_of_gemm_f32']:.2f} of the f32 GEMM's {rec['gemm_gflops']:.1f} "
                 f"(per CPU second {rec['fraction_of_gemm_f32_per_cpu_s']:.2f}; limit "
                 f"{DENSE_KL_GEMM_FRACTION:g})")
    return text


def _ints(text: Optional[str]) -> Optional[list]:
    return [int(v) for v in text.split(",") if v.strip()] if text else None


def main(cases: list, a) -> int:
    """``--train CASES`` (step, dense-kl); ``--train-kinds``, ``--train-tokens``, ``--repeats``,
    ``--quick``; ``--json PATH`` records; ``--train-plot PATH`` draws memory against T."""
    env = common.environment()
    print(f"# jax {env['jax']}; CPU: {env['cpu'].get('model name', '?')} x{env['cpu_count']}; "
          f"load {common.load_average()}", flush=True)
    records, ok = [], True
    repeats = 2 if a.repeats is None else a.repeats
    warmup = min(a.warmup, 1)
    for case in cases:
        if case == "step":
            kinds = [k.strip() for k in a.train_kinds.split(",")]
            for kind in kinds:
                if kind not in KINDS:
                    raise ValueError(f"--train-kinds: unknown kind {kind!r} ({', '.join(KINDS)})")
                tokens = _ints(a.train_tokens) or (QUICK_STEP_TOKENS if a.quick else STEP_TOKENS[kind])
                timed = a.train_timed_tokens or TIMED_TOKENS
                for T in tokens:
                    rec = _child(dict(fn="step", kind=kind, tokens=T, quick=a.quick,
                                      repeats=repeats if T <= timed else 0, warmup=warmup,
                                      parts=a.train_parts, compile_only=a.train_compile_only),
                                 a.train_timeout)
                    print(format_step(rec), flush=True)
                    ok &= rec["finite"] and rec["within_limit"] is not False
                    if "step_over_forward" in rec and not a.quick:
                        ok &= rec["step_over_forward"] <= STEP_OVER_FORWARD_LIMIT
                    records.append(rec)
        elif case == "dense-kl":
            shape = QUICK_DENSE_KL_SHAPE if a.quick else DENSE_KL_SHAPE
            if a.train_dense_tokens:
                shape = dataclasses.replace(shape, name=f"{shape.name}-{a.train_dense_tokens}",
                                            T=a.train_dense_tokens)
            rec = _child(dict(fn="dense-kl", shape=dataclasses.asdict(shape), repeats=repeats,
                              warmup=warmup), a.train_timeout)
            print(format_dense_kl(rec), flush=True)
            ok &= rec["finite"]
            if shape == DENSE_KL_SHAPE:
                ok &= rec["within_limit"] and rec.get("fraction_of_gemm_f32", 1.0) >= DENSE_KL_GEMM_FRACTION
            records.append(rec)
        else:
            raise ValueError(f"--train: unknown case {case!r} (step, dense-kl)")
    print(f"# load {common.load_average()}", flush=True)
    if a.json:
        common.write_records(records, a.json)
    if a.train_plot and any(r["case"] == "train-step" for r in records):
        from ..plots import training_memory_figure

        fig = training_memory_figure({"environment": env, "records": records})
        fig.savefig(a.train_plot, dpi=100)
        print(f"# wrote {a.train_plot}", flush=True)
    return 0 if ok else 1
