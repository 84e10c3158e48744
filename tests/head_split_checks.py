"""Runs the checks of test_head_split_sharding.py; meant to run in its own process with 8 host
devices. Prints one JSON record per check: whether the sharded call's output bits equal the
single-device call's, and whether this CPU's product form promises that
(``cpu_products.shape_invariant``)."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_sparse_attn as jsa
from jax_sparse_attn import cpu_products

# The shape (two heads per device) and one head per device.
SHAPES = {"H16": dict(T=64, H=16, D=128, K=256, R=4096),
          "H8": dict(T=64, H=8, D=128, K=256, R=4096)}
LAYOUTS = {"heads": (P(None, "x"), P(), P(), P("x")), "tokens": (P("x"), P(), P("x"), P())}


def inputs(T, H, D, K, R, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((T, H, D)), jnp.bfloat16),
            jnp.asarray(rng.standard_normal((R, D)), jnp.bfloat16),
            jnp.asarray(rng.integers(-1, R, (T, K)), jnp.int32),
            jnp.asarray(rng.standard_normal(H), jnp.float32))


def run():
    invariant = cpu_products.shape_invariant(cpu_products.cpu_form())
    attend = jax.jit(lambda q, kv, idx, sink: jsa.gathered_attn_idx(q, kv, idx, sink))
    for shape_name, shape in SHAPES.items():
        args = inputs(**shape)
        want = np.asarray(attend(*(jax.device_put(a, jax.devices()[0]) for a in args)))
        for axis_type in ("Auto", "Explicit"):
            mesh = jax.make_mesh((8,), ("x",), axis_types=(getattr(AxisType, axis_type),))
            for layout, specs in LAYOUTS.items():
                placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
                got = np.asarray(attend(*placed))
                record = {"check": f"{shape_name}/{axis_type}/{layout}",
                          "exact": bool(np.array_equal(got, want)),
                          "differing": int(np.sum(got != want)),
                          "shape_invariant": invariant}
                print(json.dumps(record), flush=True)


if __name__ == "__main__":
    if jax.device_count() != 8:
        sys.exit(f"needs 8 devices; XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}")
    run()
