"""The two JAX primitives and their rules: abstract eval, lowerings, and the vmap rule.

Operands are already normalised by :mod:`jax_sparse_attn.api` (which owns argument checking):

``gathered_attn_p``:      q [T, H, D], g [T, K, D], sink [H] f32, bias [T, K] f32, scale [T] f32
``gathered_attn_idx_p``:  q [T, H, D], kv [R, D], idx [T, K] int32, sink [H] f32, bias [T, K] f32,
                          scale [T] f32

``sink = -inf`` means no sink and ``bias = -inf`` marks an empty slot, so ``None`` needs no special
case here. The scale travels per token so that a vmapped scale folds into the token axis like
everything else. The single parameter ``implementation`` is the user's choice (``None``,
``"reference"``, ``"nki"`` or ``"nki_emulated"``).

Lowerings: a default rule for every platform runs the jnp reference (or the emulated Neuron path);
the Neuron package adds a ``"neuron"`` rule once JAX knows that platform.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir, xla

from . import reference, sharding

gathered_attn_p = Primitive("gathered_attn")
gathered_attn_idx_p = Primitive("gathered_attn_idx")

IMPLEMENTATIONS = ("reference", "nki", "nki_emulated")

# Operand names of each primitive, by ``indexed`` (False: gathered_attn_p, True: gathered_attn_idx_p).
OPERANDS = {
    False: ("q", "g", "sink", "bias", "scale"),
    True: ("q", "kv", "idx", "sink", "bias", "scale"),
}

# Host-runnable data paths by implementation name: (gathered_fn, gathered_idx_fn), each taking the
# primitive's operands and returning the output. The Neuron package registers "nki_emulated".
_PATHS: dict[str, tuple[Callable, Callable]] = {
    "reference": (reference.gathered_attn_reference, reference.gathered_attn_idx_reference),
}


def register_path(name: str, gathered_fn: Callable, gathered_idx_fn: Callable) -> None:
    """Makes ``implementation=name`` lower through the given jnp-traceable functions."""
    _PATHS[name] = (gathered_fn, gathered_idx_fn)


def path(name: str, indexed: bool) -> Callable:
    return _PATHS[name][1 if indexed else 0]


# --- abstract evaluation ------------------------------------------------------------------------


def _abstract_eval(q, *_, implementation):
    del implementation
    # Keeps q's token/head sharding in the type under explicit mesh axes (see sharding.py).
    return sharding.result_aval(q, q.shape, q.dtype, sharding.LAYOUTS["out"])


gathered_attn_p.def_abstract_eval(_abstract_eval)
gathered_attn_idx_p.def_abstract_eval(_abstract_eval)
gathered_attn_p.def_impl(functools.partial(xla.apply_primitive, gathered_attn_p))
gathered_attn_idx_p.def_impl(functools.partial(xla.apply_primitive, gathered_attn_idx_p))


# --- default lowering (every platform) ----------------------------------------------------------


def _default_rule(indexed: bool):
    def rule(*args, implementation):
        name = "reference" if implementation is None else implementation
        if name not in _PATHS:
            raise NotImplementedError(
                f"implementation={implementation!r} cannot run on this platform; the Neuron "
                "kernel needs a Trainium device (use 'nki_emulated' to run it on the host)."
            )
        # Shard-local under multi-device jit: see sharding.py.
        path_fn = path(name, indexed)
        layouts = [sharding.LAYOUTS[n] for n in OPERANDS[indexed]]
        run = sharding.shard_local(lambda *a: (path_fn(*a),), layouts, [sharding.LAYOUTS["out"]])
        return run(*args)[0]

    return rule


sharding.register_device_aware(gathered_attn_p, gathered_attn_idx_p)
mlir.register_lowering(gathered_attn_p, mlir.lower_fun(_default_rule(False), multiple_results=False))
mlir.register_lowering(
    gathered_attn_idx_p, mlir.lower_fun(_default_rule(True), multiple_results=False)
)


# --- vmap: fold every batch axis into the token axis --------------------------------------------


def _to_front(x, dim, size):
    """Moves the batch axis to 0, or broadcasts an unbatched operand to ``size`` copies."""
    if dim is None:
        return jnp.broadcast_to(x, (size,) + x.shape)
    return jnp.moveaxis(x, dim, 0)


def _fold(x):
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _map_over_batch(prim, args, dims, size, implementation):
    """Fallback for a batched sink (one sink vector per batch element): one call per element."""
    batched = [i for i, d in enumerate(dims) if d is not None]
    xs = [jnp.moveaxis(args[i], dims[i], 0) for i in batched]

    def one(slices):
        full = list(args)
        for i, s in zip(batched, slices):
            full[i] = s
        return prim.bind(*full, implementation=implementation)

    return jax.lax.map(one, xs), 0


def _gathered_batcher(args, dims, *, implementation):
    q, g, sink, bias, scale = args
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    if dims[2] is not None:
        return _map_over_batch(gathered_attn_p, args, dims, size, implementation)
    qd, gd, _, bd, sd = dims
    q, g, bias, scale = (_to_front(x, d, size) for x, d in zip((q, g, bias, scale), (qd, gd, bd, sd)))
    out = gathered_attn_p.bind(
        _fold(q), _fold(g), sink, _fold(bias), _fold(scale), implementation=implementation
    )
    return out.reshape(q.shape), 0


def _gathered_idx_batcher(args, dims, *, implementation):
    q, kv, idx, sink, bias, scale = args
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    if dims[3] is not None:
        return _map_over_batch(gathered_attn_idx_p, args, dims, size, implementation)
    qd, kvd, id_, _, bd, sd = dims
    q, idx, bias, scale = (
        _to_front(x, d, size) for x, d in zip((q, idx, bias, scale), (qd, id_, bd, sd))
    )
    if kvd is not None:
        # One cache per batch element: stack them and offset each element's indices by b * R.
        kv = jnp.moveaxis(kv, kvd, 0)
        rows = kv.shape[1]
        if size * rows > 2**31 - 1:
            raise ValueError(
                f"vmap over kv: {size} caches of {rows} rows exceed int32 indexing once folded"
            )
        valid = (idx >= 0) & (idx < rows)
        offset = (jnp.arange(size, dtype=jnp.int32) * rows)[:, None, None]
        idx = jnp.where(valid, idx + offset, jnp.int32(-1))
        kv = _fold(kv)
    out = gathered_attn_idx_p.bind(
        _fold(q), kv, _fold(idx), sink, _fold(bias), _fold(scale), implementation=implementation
    )
    return out.reshape(q.shape), 0


batching.primitive_batchers[gathered_attn_p] = _gathered_batcher
batching.primitive_batchers[gathered_attn_idx_p] = _gathered_idx_batcher
