"""Runs the checks of test_indexer_kl_sharding.py on 8 host CPU devices; own process.

``python tests/indexer_kl_sharding_checks.py`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` prints one JSON record per check: the
largest difference of the split call's kl, mass and gradients (a mean over the tokens with a
candidate, and a per-token cotangent) from the single-device call's, relative to their size.
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

T, H, D, R, HI, DI, K = 32, 8, 16, 40, 4, 8, 6


def make_inputs():
    rng = np.random.default_rng(0)
    f32 = np.float32
    positions = np.arange(T, dtype=np.int32) + 4
    positions[3] = -1  # no candidate
    idx = np.stack([rng.permutation(max(K, min(R, p + 1)))[:K] for p in positions])
    idx = np.where(rng.random((T, K)) < 0.2, -1, idx).astype(np.int32)
    lse_extra = rng.normal(size=(T, H)).astype(f32)
    lse_extra[:, 1] = np.inf  # a head that adds nothing
    return dict(q=rng.normal(size=(T, H, D)).astype(f32), kv=rng.normal(size=(R, D)).astype(f32),
                index_q=rng.normal(size=(T, HI, DI)).astype(f32),
                index_weights=rng.normal(size=(T, HI)).astype(f32),
                index_keys=rng.normal(size=(R, DI)).astype(f32), positions=positions, idx=idx,
                lse_extra=lse_extra, ct=rng.normal(size=T).astype(f32))


def program(sparse):
    def run(q, kv, index_q, index_weights, index_keys, positions, idx, lse_extra, ct):
        def kl_of(iq, w, keys):
            return jsa.indexer_kl(q, kv, iq, w, keys, positions, idx, sparse=sparse, scale=0.3,
                                  lse_extra=lse_extra)

        (kl, mass), pullback = jax.vjp(kl_of, index_q, index_weights, index_keys)
        has = (jnp.sum(idx >= 0, axis=1) > 0) if sparse else positions >= 0
        mean = has / jnp.sum(has)
        zero = jnp.zeros_like(mass)
        return (kl, mass) + pullback((mean, zero)) + pullback((ct, zero))

    return jax.jit(run)


LAYOUTS = {  # mesh shape, q's spec (tokens, heads)
    "tokens+heads": ((2, 4), ("x", "y"), P("x", "y")),
    "heads": ((8,), ("x",), P(None, "x")),  # one head per device
}
# Which checks run (each compiles the program for its mesh): both splits together in every form
# and axis type, the eight-way heads split once.
CHECKS = [(sparse, axis, layout) for sparse in (True, False) for axis in ("Auto", "Explicit")
          for layout in ("tokens+heads",)] + [(False, "Auto", "heads")]


def run():
    inputs = make_inputs()
    for sparse in (True, False):
        fn = program(sparse)
        want = fn(*(jax.device_put(v, jax.devices()[0]) for v in inputs.values()))
        for axis_type in ("Auto", "Explicit"):
            for layout, (shape, names, q_spec) in LAYOUTS.items():
                if (sparse, axis_type, layout) not in CHECKS:
                    continue
                mesh = jax.make_mesh(shape, names,
                                     axis_types=(getattr(AxisType, axis_type),) * len(names))
                tokens = P(q_spec[0])
                specs = dict(q=q_spec, kv=P(), index_q=tokens, index_weights=tokens,
                             index_keys=P(), positions=tokens, idx=tokens, lse_extra=q_spec,
                             ct=tokens)
                placed = [jax.device_put(v, NamedSharding(mesh, specs[k]))
                          for k, v in inputs.items()]
                got = fn(*placed)
                errors = [float(np.max(np.abs(np.asarray(g) - np.asarray(w)))
                                / max(1e-30, float(np.max(np.abs(np.asarray(w))))))
                          for g, w in zip(got, want)]
                finite = all(bool(np.all(np.isfinite(np.asarray(g)))) for g in got)
                found = collectives(fn, *placed)
                record = {"check": f"{'sparse' if sparse else 'dense'}/{axis_type}/{layout}",
                          "relative_errors": errors, "finite": finite,
                          "live_tokens": int(np.sum(np.asarray(want[0]) != 0)),
                          "collectives": sorted({c["kind"] for c in found}),
                          "largest_collective": max((int(np.prod(shape)) for c in found
                                                     for shape in c["shapes"]), default=0)}
                print(json.dumps(record), flush=True)


if __name__ == "__main__":
    if jax.device_count() != 8:
        sys.exit(f"needs 8 devices; XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}")
    run()
