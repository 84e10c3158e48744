"""Runs the checks of test_indexer_sharding.py on 8 host CPU devices; own process.

``python tests/indexer_sharding_checks.py`` with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
prints one JSON record per check: the collectives of the compiled program with their shapes, and
whether the sharded result equals the single-device one bit for bit.
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

T, HI, DI, R, TOPK = 16, 4, 32, 2048, 40


def make_inputs():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((T, HI, DI)).astype(jnp.bfloat16)
    w = rng.standard_normal((T, HI)).astype(np.float32)
    keys = rng.standard_normal((R, DI)).astype(jnp.bfloat16)
    keys[100] = keys[1900]  # an exact tie across two row shards
    key_scale = rng.uniform(0.5, 2.0, R).astype(np.float32)
    positions = np.concatenate([rng.integers(0, R, T - 3), [-1, 5, 4 * R]]).astype(np.int32)
    return {"q": q, "w": w, "keys": keys, "key_scale": key_scale, "positions": positions}


def check(records, name, mesh, specs, compress_ratio=1):
    inputs = make_inputs()

    def f(q, w, keys, key_scale, positions):
        return jsa.indexer_topk(q, w, keys, positions, TOPK, key_scale=key_scale,
                                compress_ratio=compress_ratio, return_scores=True)

    fn = jax.jit(f)
    single = fn(*(jax.device_put(v, jax.devices()[0]) for v in inputs.values()))
    placed = [jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in inputs.items()]
    got = fn(*placed)
    record = {"check": name, "collectives": collectives(fn, *placed),
              "idx_equal": bool(np.array_equal(np.asarray(got[0]), np.asarray(single[0]))),
              "scores_equal": bool(np.array_equal(np.asarray(got[1]), np.asarray(single[1]))),
              "selected": int(np.sum(np.asarray(single[0]) >= 0))}
    print(json.dumps(record), flush=True)
    records.append(record)


SEQUENCES, SEQ_T, SEQ_R = 16, 4, 512


def check_sequences(records, name, mesh):
    """vmap over sequences with their own caches, the batch axis split over the mesh: the
    selection and the scores' gradients (q and keys) against one device's, bit for bit."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((SEQUENCES, SEQ_T, HI, DI)).astype(np.float32)
    w = rng.standard_normal((SEQUENCES, SEQ_T, HI)).astype(np.float32)
    keys = rng.standard_normal((SEQUENCES, SEQ_R, DI)).astype(np.float32)
    positions = rng.integers(-1, SEQ_R, (SEQUENCES, SEQ_T)).astype(np.int32)
    select = jax.vmap(lambda q, w, k, p: jsa.indexer_topk(q, w, k, p, TOPK, return_scores=True))

    def both(q, w, keys, positions):
        idx, scores = select(q, w, keys, positions)
        grads = jax.grad(lambda q, k: jnp.where(idx >= 0, select(q, w, k, positions)[1], 0).sum(),
                         argnums=(0, 1))(q, keys)
        return idx, scores, *grads

    fn = jax.jit(both)
    inputs = (q, w, keys, positions)
    single = fn(*(jax.device_put(v, jax.devices()[0]) for v in inputs))
    placed = [jax.device_put(v, NamedSharding(mesh, P("x"))) for v in inputs]
    got = fn(*placed)
    found = collectives(fn, *placed)
    equal = [bool(np.array_equal(np.asarray(a), np.asarray(b))) for a, b in zip(got, single)]
    record = {"check": name, "collectives": found, "idx_equal": equal[0],
              "scores_equal": equal[1], "grads_equal": equal[2] and equal[3],
              "selected": int(np.sum(np.asarray(single[0]) >= 0))}
    print(json.dumps(record), flush=True)
    records.append(record)


def check_layer(records, name, mesh, compress_ratio):
    """The Flax layer with its batch split over the mesh: a prefill into a cache and a decode step
    (the cache and x split alike, the parameters replicated), against one device's outputs and
    selected rows."""
    from flax import nnx

    from jax_sparse_attn.flax import SparseAttention

    B, T, E = 8, 12, 32
    layer = SparseAttention(E, 2, 16, 4, index_heads=2, index_dim=8, compress_ratio=compress_ratio,
                            window=2 if compress_ratio > 1 else None, rngs=nnx.Rngs(0))
    x = np.asarray(jax.random.normal(jax.random.key(1), (B, T, E)))
    prefill = nnx.jit(lambda m, x, c: m(x, c))
    select = nnx.jit(lambda m, x, c: m.select_rows(x, c))

    def run_on(put, layer):
        cache = jax.tree.map(put, layer.init_cache(B, 16))
        y0, cache = prefill(layer, put(x[:, :8]), cache)
        rows = select(layer, put(x[:, 8:9]), cache)
        y1, _ = prefill(layer, put(x[:, 8:9]), cache)
        return [np.asarray(a) for a in (y0, y1, rows)]

    single = run_on(lambda a: jax.device_put(a, jax.devices()[0]), layer)
    graph, state = nnx.split(layer)
    state = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P())), state)
    got = run_on(lambda a: jax.device_put(a, NamedSharding(mesh, P("x"))), nnx.merge(graph, state))
    record = {"check": name,
              "max_abs_diff": max(float(np.max(np.abs(a - b))) for a, b in zip(got[:2], single)),
              "rows_equal": bool(np.array_equal(got[2], single[2])),
              "selected": int(np.sum(single[2] >= 0))}
    print(json.dumps(record), flush=True)
    records.append(record)


def run():
    records = []
    for axis_type in ("Auto", "Explicit"):
        kind = getattr(AxisType, axis_type)
        mesh = jax.make_mesh((8,), ("x",), axis_types=(kind,))
        check(records, f"tokens/{axis_type}", mesh,
              {"q": P("x"), "w": P("x"), "keys": P(), "key_scale": P(), "positions": P("x")})
        check(records, f"rows/{axis_type}", mesh,
              {"q": P(), "w": P(), "keys": P("x"), "key_scale": P("x"), "positions": P()})
        check(records, f"rows/ratio4/{axis_type}", mesh,
              {"q": P(), "w": P(), "keys": P("x"), "key_scale": P("x"), "positions": P()}, 4)
        check_sequences(records, f"sequences/{axis_type}", mesh)
        for ratio in (1, 2):
            check_layer(records, f"layer/ratio{ratio}/{axis_type}", mesh, ratio)
        mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(kind, kind))
        check(records, f"tokens+rows/{axis_type}", mesh,
              {"q": P("x"), "w": P("x"), "keys": P("y"), "key_scale": P("y"),
               "positions": P("x")})
    return records


if __name__ == "__main__":
    if jax.device_count() != 8:
        sys.exit(f"needs 8 devices; XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}")
    run()
