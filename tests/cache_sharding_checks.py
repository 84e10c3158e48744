"""Runs the checks of test_cache_sharding.py (a KV cache split over its rows); own process.

``python tests/cache_sharding_checks.py`` with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
prints one JSON record per check: the collectives of the compiled program with the shapes of their
operands and results, and the error of the result against the float64 oracle next to the error of
the same call on one device.
"""

import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_sparse_attn as jsa
from oracle import attention_f64, gather, lse_f64, within_one_ulp

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
T, H, D, R, K = 16, 8, 64, 4096, 96


def make_inputs(dtype=jnp.bfloat16):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((T, H, D)).astype(dtype)
    kv = rng.standard_normal((R, D)).astype(dtype)
    idx = rng.integers(-3, R + 3, (T, K)).astype(np.int32)
    idx[5] = rng.integers(0, R // 8, K)  # a token whose slots all sit on the first row shard
    idx[6] = -1  # a token with no valid slot
    sink = rng.standard_normal(H).astype(np.float32)
    sink[1] = -np.inf
    bias = rng.standard_normal((T, K)).astype(np.float32)
    return {"q": q, "kv": kv, "idx": idx, "sink": sink, "bias": bias}


def attention(implementation=None):
    def f(q, kv, idx, sink, bias):
        return jsa.gathered_attn_idx(q, kv, idx, sink, bias=bias, return_lse=True,
                                     implementation=implementation)

    return f


def collectives(jitted, *args, **kwargs):
    """Each collective instruction of the compiled program: its kind and the shapes on its line."""
    text = jitted.lower(*args, **kwargs).compile().as_text()
    found = []
    for line in text.splitlines():
        kind = next((c for c in COLLECTIVES if re.search(rf"\b{c}(-start)?\(", line)), None)
        if kind:
            shapes = [[int(d) for d in dims.split(",") if d]
                      for dims in re.findall(r"[a-z0-9]+\[([0-9,]*)\]", line)]
            found.append({"kind": kind, "shapes": shapes})
    return found


def errors(got, inputs):
    out, lse = (np.asarray(a, np.float64) for a in got)
    x, valid = gather(inputs["kv"], inputs["idx"])
    args = (inputs["q"], x, valid, inputs["sink"], inputs["bias"])
    err = np.abs(out - attention_f64(*args))
    want_lse = lse_f64(*args)
    finite = np.isfinite(want_lse)
    lse_ok = bool(np.array_equal(lse[~finite], want_lse[~finite]))
    lse_rel = float(np.max(np.abs(lse[finite] - want_lse[finite]) / np.maximum(np.abs(want_lse[finite]), 1)))
    return {"max_err": float(err.max()), "mean_err": float(err.mean()), "lse_rel_err": lse_rel,
            "lse_inf_exact": lse_ok, "finite": bool(np.all(np.isfinite(out)))}


def spec_names(x):
    """The mesh axis of each dimension of ``x`` ("" when replicated)."""
    spec = tuple(x.sharding.spec) + (None,) * x.ndim
    return [str(e or "") for e in spec[: x.ndim]]


def check(records, name, mesh, specs, implementation=None):
    inputs = make_inputs()
    fn = jax.jit(attention(implementation))
    single = fn(*(jax.device_put(v, jax.devices()[0]) for v in inputs.values()))
    placed = [jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in inputs.items()]
    got = fn(*placed)
    lse, lse_single = np.asarray(got[1], np.float64), np.asarray(single[1], np.float64)
    finite = np.isfinite(lse_single)
    record = {"check": name, "collectives": collectives(fn, *placed),
              "out_within_one_ulp": within_one_ulp(np.asarray(got[0]), np.asarray(single[0])),
              "lse_rel_diff": float(np.max(np.abs(lse[finite] - lse_single[finite])
                                           / np.maximum(np.abs(lse_single[finite]), 1))),
              "lse_inf_same": bool(np.array_equal(lse[~finite], lse_single[~finite])),
              "single": errors(single, inputs), "sharded": errors(got, inputs),
              "out_sharding": spec_names(got[0]), "lse_sharding": spec_names(got[1])}
    print(json.dumps(record), flush=True)
    records.append(record)


def check_fp8(records, name, mesh, window=None, split=False):
    """An FP8 cache split over its rows; with ``window`` ("bf16" or "fp8"), beside a replicated
    second cache of that kind (an FP8 one with its own scales); with ``split``, DeepSeek's split
    rows (the last 16 columns in bf16, ``kv_rope``, split over the rows with the cache)."""
    import ml_dtypes

    inputs = make_inputs()
    rng = np.random.default_rng(1)
    D8 = D - 16 if split else D
    inputs["kv"] = (rng.standard_normal((R, D8)) * 4).astype(ml_dtypes.float8_e4m3fn)
    inputs["kv_scale"] = rng.uniform(0.01, 0.1, (R, 2)).astype(np.float32)
    specs = {"q": P(), "kv": P("y"), "idx": P(), "sink": P(), "bias": P(), "kv_scale": P("y")}
    if split:
        inputs["kv_rope"] = rng.standard_normal((R, 16)).astype(jnp.bfloat16)
        specs.update(kv_rope=P("y"))
    if window:
        W = 8
        inputs["extra_kv"] = rng.standard_normal((T * W, D)).astype(jnp.bfloat16)
        inputs["extra_idx"] = (np.arange(T)[:, None] * W + np.arange(W)).astype(np.int32)
        inputs["bias"] = np.concatenate([inputs["bias"], np.zeros((T, W), np.float32)], 1)
        specs.update(extra_kv=P(), extra_idx=P())
        if window == "fp8":
            inputs["extra_kv"] = inputs["extra_kv"].astype(ml_dtypes.float8_e4m3fn)
            inputs["extra_kv_scale"] = rng.uniform(0.5, 2, T * W).astype(np.float32)
            specs.update(extra_kv_scale=P())

    def f(q, kv, idx, sink, bias, kv_scale, kv_rope=None, extra_kv=None, extra_idx=None,
          extra_kv_scale=None):
        return jsa.gathered_attn_idx(q, kv, idx, sink, bias=bias, kv_scale=kv_scale,
                                     kv_rope=kv_rope, extra_kv=extra_kv, extra_idx=extra_idx,
                                     extra_kv_scale=extra_kv_scale)

    fn = jax.jit(f)
    single = fn(**{k: jax.device_put(v, jax.devices()[0]) for k, v in inputs.items()})
    placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in inputs.items()}
    got = fn(**placed)
    record = {"check": name, "collectives": collectives(fn, **placed),
              "exact": bool(np.array_equal(np.asarray(got), np.asarray(single)))}
    print(json.dumps(record), flush=True)
    records.append(record)


def check_grad(records, name, mesh, specs):
    inputs = make_inputs(np.float32)

    def loss(q, kv, idx, sink, bias):
        out, lse = attention()(q, kv, idx, sink, bias)
        return jnp.sum(out**2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 3)))
    want = grad(*(jax.device_put(v, jax.devices()[0]) for v in inputs.values()))
    got = grad(*(jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in inputs.items()))
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(got, want))
    record = {"check": name, "max_abs_diff": diff,
              "finite": all(bool(np.all(np.isfinite(np.asarray(a)))) for a in got)}
    print(json.dumps(record), flush=True)
    records.append(record)


def run():
    records = []
    for axis_type in ("Auto", "Explicit"):
        kind = getattr(AxisType, axis_type)
        mesh = jax.make_mesh((8,), ("y",), axis_types=(kind,))
        rows = {"q": P(), "kv": P("y"), "idx": P(), "sink": P(), "bias": P()}
        check(records, f"rows/{axis_type}", mesh, rows)
        mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(kind, kind))
        check(records, f"tokens+rows/{axis_type}", mesh,
              {"q": P("x"), "kv": P("y"), "idx": P("x"), "sink": P(), "bias": P("x")})
        check(records, f"heads+rows/{axis_type}", mesh,
              {"q": P(None, "x"), "kv": P("y"), "idx": P(), "sink": P("x"), "bias": P()})
        # An FP8 cache split over its rows: the gathered bytes are summed over the devices.
        check_fp8(records, f"fp8/rows/{axis_type}", jax.make_mesh((8,), ("y",), axis_types=(kind,)))
        for window in ("bf16", "fp8"):
            check_fp8(records, f"fp8+{window}-window/rows/{axis_type}",
                      jax.make_mesh((8,), ("y",), axis_types=(kind,)), window=window)
        check_fp8(records, f"fp8-split/rows/{axis_type}",
                  jax.make_mesh((8,), ("y",), axis_types=(kind,)), split=True)
        # The lse with a replicated cache, tokens or heads split: local, like the output.
        mesh = jax.make_mesh((8,), ("x",), axis_types=(kind,))
        check(records, f"lse/tokens/{axis_type}", mesh,
              {"q": P("x"), "kv": P(), "idx": P("x"), "sink": P(), "bias": P("x")})
        check(records, f"lse/heads/{axis_type}", mesh,
              {"q": P(None, "x"), "kv": P(), "idx": P(), "sink": P("x"), "bias": P()})
        # Gradients (the backward pass runs with the cache replicated): same as on one device.
        mesh = jax.make_mesh((8,), ("y",), axis_types=(kind,))
        check_grad(records, f"grad/rows/{axis_type}", mesh, rows)
    # The emulated Neuron path with Explicit axes (a host callback per device).
    mesh = jax.make_mesh((8,), ("y",), axis_types=(AxisType.Explicit,))
    check(records, "rows/Explicit/nki_emulated", mesh,
          {"q": P(), "kv": P("y"), "idx": P(), "sink": P(), "bias": P()}, "nki_emulated")
    return records


if __name__ == "__main__":
    if jax.device_count() != 8:
        sys.exit(f"needs 8 devices; XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}")
    run()
