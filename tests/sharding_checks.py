"""Runs the multi-device checks of test_sharding.py; meant to run in its own process.

``python tests/sharding_checks.py`` with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
prints one JSON record per check: the collectives found in the compiled program and how the
values compare with the same function run on one device.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_sparse_attn as jsa

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
T, H, D, R, K, B = 16, 8, 32, 40, 12, 8

# Which operand is split in each layout (None: replicated). Operands: q, src, idx, sink, bias.
LAYOUTS = {
    "tokens": {"q": P("x"), "src_idx": P(), "src_gathered": P("x"), "idx": P("x"),
               "sink": P(), "bias": P("x")},
    "heads": {"q": P(None, "x"), "src_idx": P(), "src_gathered": P(), "idx": P(),
              "sink": P("x"), "bias": P()},
}
# Gradients that need no communication at all in each layout (the others are sums over devices).
LOCAL_GRADS = {"tokens": ("q", "bias"), "heads": ("q", "sink")}
ARG_NAMES = ("q", "src", "sink", "bias")


def make_inputs(form, dtype):
    rng = np.random.default_rng(0)
    inputs = {
        "q": rng.standard_normal((T, H, D)),
        "src": rng.standard_normal((R, D) if form == "idx" else (T, K, D)),
        "idx": rng.integers(-3, R + 3, (T, K)).astype(np.int32),
        "sink": rng.standard_normal(H).astype(np.float32),
        "bias": rng.standard_normal((T, K)).astype(np.float32),
    }
    inputs["sink"][0] = np.inf
    inputs["bias"][2, :] = -np.inf  # a token with no valid slot
    inputs["q"] = inputs["q"].astype(dtype)
    inputs["src"] = inputs["src"].astype(dtype)
    return inputs


def attention(form, implementation):
    def f(q, src, idx, sink, bias):
        if form == "idx":
            return jsa.gathered_attn_idx(
                q, src, idx, sink, bias=bias, implementation=implementation
            )
        return jsa.gathered_attn(q, src, sink, bias=bias, implementation=implementation)

    return f


def collectives(jitted, *args):
    text = jitted.lower(*args).compile().as_text()
    return sorted(c for c in COLLECTIVES if c in text)


def compare(got, want):
    got, want = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    exact = all(bool(np.array_equal(np.asarray(a), np.asarray(b))) for a, b in zip(got, want))
    diff = max(
        float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0))
        for a, b in zip(got, want)
    )
    finite = all(bool(np.all(np.isfinite(np.asarray(a, np.float64)))) for a in got)
    return {"exact": exact, "max_abs_diff": diff, "finite": finite}


def specs_of(form, layout):
    """PartitionSpec of each input (q, src, idx, sink, bias) for a layout of LAYOUTS."""
    specs = LAYOUTS[layout]
    return {name: specs[f"src_{form}" if name == "src" else name]
            for name in ("q", "src", "idx", "sink", "bias")}


def place(inputs, mesh, specs):
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in inputs.items()}


def one_device(inputs):
    device = jax.devices()[0]
    return {k: jax.device_put(v, device) for k, v in inputs.items()}


# One-device results by the check's name less its mesh and layout, which they do not depend on:
# each is compiled once, not once per axis type and layout.
_SINGLE_DEVICE = {}


def _single_device_key(name, per_layout):
    dropped = ("Auto", "Explicit") + (() if per_layout else tuple(LAYOUTS))
    return "/".join(p for p in name.split("/") if p not in dropped)


def check(records, name, fn, inputs, mesh, specs, single_device_fn=None, per_layout=False):
    """``per_layout``: the function itself depends on the layout (the gradients it takes)."""
    jitted = jax.jit(fn)
    key = _single_device_key(name, per_layout)
    if key not in _SINGLE_DEVICE:
        _SINGLE_DEVICE[key] = jax.jit(single_device_fn or fn)(*one_device(inputs).values())
    want = _SINGLE_DEVICE[key]
    sharded = place(inputs, mesh, specs)
    record = {"check": name, "collectives": collectives(jitted, *sharded.values())}
    record.update(compare(jitted(*sharded.values()), want))
    _emit(records, record)


def _emit(records, record):
    records.append(record)
    print(json.dumps(record), flush=True)  # as it goes: a crash still leaves what ran before


def deepseek_shapes(q, src, idx, sink, bias):
    """value_dim below D and a second cache (half the rows of src, reversed, with its own slots):
    the arguments of issue 20, through the same sharding rules."""
    extra_idx = idx[:, :5] // 2
    bias = jnp.concatenate([bias, jnp.zeros((bias.shape[0], 5), bias.dtype)], axis=1)
    return jsa.gathered_attn_idx(q, src, idx, sink, bias=bias, value_dim=D - 8,
                                 extra_kv=src[::-2] * 0.5, extra_idx=extra_idx)


def deepseek_grad(q, src, idx, sink, bias):
    w = jnp.asarray(np.random.default_rng(2).standard_normal((T, H, D - 8)), jnp.float32)
    return jax.grad(lambda q, src, sink, bias: jnp.sum(
        deepseek_shapes(q, src, idx, sink, bias).astype(jnp.float32) * w), argnums=(0, 1, 2, 3))(
            q, src, sink, bias)


def grad_of(form, implementation, wrt):
    f = attention(form, implementation)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((T, H, D)), jnp.float32)
    argnums = tuple(ARG_NAMES.index(n) for n in wrt)

    def loss(q, src, sink, bias, idx):
        return jnp.sum(f(q, src, idx, sink, bias).astype(jnp.float32) * w)

    grad = jax.grad(loss, argnums=argnums)
    return lambda q, src, idx, sink, bias: grad(q, src, sink, bias, idx)


def run(implementations):
    records = []
    for axis_type in ("Auto", "Explicit"):
        mesh = jax.make_mesh((8,), ("x",), axis_types=(getattr(AxisType, axis_type),))
        for form in ("idx", "gathered"):
            for layout in LAYOUTS:
                tag = f"{axis_type}/{form}/{layout}"
                for implementation in implementations:
                    inputs = make_inputs(form, jnp.bfloat16)
                    check(records, f"forward/{implementation}/{tag}",
                          attention(form, implementation), inputs, mesh, specs_of(form, layout))
                inputs = make_inputs(form, np.float32)
                specs = specs_of(form, layout)
                check(records, f"grad_local/{tag}",
                      grad_of(form, None, LOCAL_GRADS[layout]), inputs, mesh, specs,
                      per_layout=True)
                if "nki_emulated" in implementations and (form, layout) == ("idx", "tokens"):
                    # The forward pass of the gradient runs the emulated kernel.
                    check(records, f"grad_local_emulated/{tag}",
                          grad_of(form, "nki_emulated", LOCAL_GRADS[layout]),
                          inputs, mesh, specs, per_layout=True)
                check(records, f"grad_all/{tag}",
                      grad_of(form, None, ARG_NAMES), inputs, mesh, specs)
        for layout in LAYOUTS:
            specs = specs_of("idx", layout)
            check(records, f"deepseek_forward/{axis_type}/{layout}", deepseek_shapes,
                  make_inputs("idx", jnp.bfloat16), mesh, specs)
            check(records, f"deepseek_grad/{axis_type}/{layout}", deepseek_grad,
                  make_inputs("idx", np.float32), mesh, specs)
        # vmap over a sharded batch axis folds into a sharded token axis.
        inputs = make_inputs("idx", jnp.bfloat16)
        batched = {k: np.stack([v] * B) if k in ("q", "idx") else v for k, v in inputs.items()}
        fn = jax.vmap(attention("idx", None), in_axes=(0, None, 0, None, None))
        specs = {"q": P("x"), "src": P(), "idx": P("x"), "sink": P(), "bias": P()}
        check(records, f"vmap/{axis_type}", fn, batched, mesh, specs)
    # The reference chunked over tokens (a loop over token blocks, as for long sequences): left
    # to the partitioner, a loop over a split axis would gather it.
    chunk_bytes = jsa.attention.reference.CHUNK_BYTES
    jsa.attention.reference.CHUNK_BYTES = 1
    jax.clear_caches()
    for axis_type in ("Auto", "Explicit"):
        mesh = jax.make_mesh((8,), ("x",), axis_types=(getattr(AxisType, axis_type),))
        specs = specs_of("idx", "tokens")
        check(records, f"chunked_forward/{axis_type}", attention("idx", None),
              make_inputs("idx", jnp.bfloat16), mesh, specs)
        check(records, f"chunked_grad_local/{axis_type}",
              grad_of("idx", None, LOCAL_GRADS["tokens"]), make_inputs("idx", np.float32),
              mesh, specs)
    jsa.attention.reference.CHUNK_BYTES = chunk_bytes
    jax.clear_caches()
    # A 2-D mesh: tokens over "x" and heads over "y" at once.
    for axis_type in ("Auto", "Explicit"):
        types = (getattr(AxisType, axis_type),) * 2
        mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=types)
        specs = {"q": P("x", "y"), "src": P(), "idx": P("x"), "sink": P("y"), "bias": P("x")}
        check(records, f"mesh2d_forward/{axis_type}", attention("idx", None),
              make_inputs("idx", jnp.bfloat16), mesh, specs)
        check(records, f"mesh2d_grad_all/{axis_type}", grad_of("idx", None, ARG_NAMES),
              make_inputs("idx", np.float32), mesh, specs)
    # A user's own shard_map around the op (automatic mesh axes): every implementation is local.
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    inputs = make_inputs("idx", jnp.bfloat16)
    for implementation in implementations:
        fn = jax.shard_map(
            attention("idx", implementation), mesh=mesh,
            in_specs=(P("x"), P(), P("x"), P(), P("x")), out_specs=P("x"),
        )
        check(records, f"shard_map/{implementation}", fn, inputs, mesh,
              specs_of("idx", "tokens"), single_device_fn=attention("idx", implementation))
    return records


if __name__ == "__main__":
    if jax.device_count() != 8:
        sys.exit(f"needs 8 devices; XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}")
    implementations = [None if name == "None" else name for name in sys.argv[1:]] or [None]
    run(implementations)
