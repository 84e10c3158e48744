"""Runs the checks of test_compress_pool.py's multi-device tests on 8 host CPU devices; own process.

``python tests/compress_sharding_checks.py`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` prints one JSON record per check: whether
the sharded result equals the single-device one bit for bit, its sharding, the collectives of the
compiled program, and how far the sharded gradients are from one device's (in epsilons of their
largest magnitude). ``python tests/compress_sharding_checks.py nki_emulated`` runs the same
checks on the NKI kernel under the emulator.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_sparse_attn as jsa
from cache_sharding_checks import collectives

B, T, C, RATIO = 8, 64, 16, 4


# The implementation under test: the first argument ("nki_emulated": the NKI kernel under the
# emulator, tests/test_compress_kernel.py), else None (the reference).
IMPLEMENTATION = sys.argv[1] if len(sys.argv) > 1 else None


def make_inputs(T=T, with_prev=False):
    rng = np.random.default_rng(0)
    inputs = {"kv": rng.standard_normal((B, T, C)).astype(jnp.bfloat16),
              "score": (3 * rng.standard_normal((B, T, C))).astype(np.float32),
              "ape": rng.standard_normal((RATIO, C)).astype(np.float32)}
    inputs["score"][1, 5, 3] = np.inf  # the edge rules hold on every layout too
    inputs["score"][2, 8:12, 9] = -np.inf
    if with_prev:
        inputs["prev_kv"] = rng.standard_normal((B, RATIO, C)).astype(np.float32)
        inputs["prev_score"] = rng.standard_normal((B, RATIO, C)).astype(np.float32)
    return inputs


def spec_of(x):
    spec = tuple(x.sharding.spec) + (None,) * x.ndim
    return [str(e) if e else "" for e in spec[: x.ndim]]


def check(records, name, mesh, kv_spec, overlap, with_prev=False, tokens=T):
    inputs = make_inputs(tokens, with_prev)
    rows_spec = P(*kv_spec)  # kv, score and prev_* (their rows replicated) alike
    block_spec = P(*(tuple(kv_spec)[:1] + (None,) + tuple(kv_spec)[2:]))
    specs = {"kv": rows_spec, "score": rows_spec, "ape": P(), "prev_kv": block_spec,
             "prev_score": block_spec}

    def f(kv, score, ape, *prev):
        kw = dict(prev_kv=prev[0], prev_score=prev[1]) if prev else {}
        return jsa.compress_pool(kv, score, ape, overlap=overlap, implementation=IMPLEMENTATION,
                                 **kw)  # fmt: skip

    def loss(*args):
        out = f(*args)
        return jnp.sum(jnp.where(jnp.isfinite(out), out, 0) * jnp.cos(out))

    fn = jax.jit(f)
    grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(inputs)))))
    single_args = [jax.device_put(v, jax.devices()[0]) for v in inputs.values()]
    placed = [jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in inputs.items()]
    single, got = fn(*single_args), fn(*placed)
    single_grads, got_grads = grad(*single_args), grad(*placed)
    # Gradients: the largest difference from one device's, in units of the dtype's epsilon times
    # the gradient's largest magnitude (kv's is bf16).
    def eps_diff(a, b):
        a, b, eps = np.asarray(a, np.float64), np.asarray(b, np.float64), jnp.finfo(b.dtype).eps
        return float(np.max(np.abs(a - b)) / (float(eps) * max(float(np.max(np.abs(b))), 1e-30)))

    grad_diff = max(eps_diff(a, b) for a, b in zip(got_grads, single_grads))
    record = {"check": name, "equal": bool(np.array_equal(np.asarray(got), np.asarray(single),
                                                          equal_nan=True)),
              "shape": list(got.shape), "spec": spec_of(got),
              "collectives": collectives(fn, *placed), "grad_eps_diff": grad_diff,
              "grads_finite": all(bool(np.isfinite(np.asarray(g, np.float32)).all())
                                  for g in got_grads)}
    print(json.dumps(record), flush=True)
    records.append(record)


def run():
    records = []
    for axis_type in ("Auto", "Explicit"):
        kind = getattr(AxisType, axis_type)
        mesh = jax.make_mesh((8,), ("x",), axis_types=(kind,))
        for overlap in (False, True):
            tag = f"{'overlap' if overlap else 'plain'}/{axis_type}"
            check(records, f"batch/{tag}", mesh, ("x", None, None), overlap)
            check(records, f"tokens/{tag}", mesh, (None, "x", None), overlap)
            check(records, f"channels/{tag}", mesh, (None, None, "x"), overlap)
            # 72 tokens: 9 rows a device, not whole blocks; the tokens are gathered instead.
            check(records, f"tokens-unaligned/{tag}", mesh, (None, "x", None), overlap,
                  tokens=T + 8)
        check(records, f"tokens/overlap/prev/{axis_type}", mesh, (None, "x", None), True, True)
        mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(kind, kind))
        check(records, f"tokens-two-axes/overlap/prev/{axis_type}", mesh, (None, ("x", "y"), None),
              True, True)
        # 66 tokens over 2 devices: a tail of 2 rows that no block holds; gathered, as above.
        check(records, f"tokens-with-tail/overlap/{axis_type}", mesh, ("y", "x", None), True,
              tokens=T + 2)
        mesh = jax.make_mesh((2, 2, 2), ("x", "y", "z"), axis_types=(kind,) * 3)
        for overlap in (False, True):
            tag = f"{'overlap' if overlap else 'plain'}/{axis_type}"
            check(records, f"all-three/{tag}", mesh, ("x", "y", "z"), overlap, overlap)
    return records


if __name__ == "__main__":
    if jax.device_count() != 8:
        sys.exit(f"needs 8 devices; XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}")
    run()
