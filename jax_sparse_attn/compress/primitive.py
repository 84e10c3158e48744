"""The pooling primitive ``compress_pool_p`` and its rules: abstract eval, lowering, vmap, JVP.

Operands, already checked by :mod:`jax_sparse_attn.compress.api` (``docs/compress.md``)::

    kv [..., T, C], score [..., T, C], ape [..., r, C]
    and with overlap, optionally: prev_kv [..., r, C], prev_score [..., r, C]

any float dtypes, one set of leading dims ``...`` for all of them (the API broadcasts ape). Three
operands or five: the count says whether the rows before block 0 are given. Static parameters:
``overlap`` (bool) and ``implementation`` (None or ``"reference"``). One result,
``[..., T // r, C]`` f32, or ``[..., T // r, C // 2]`` with overlap.

- Lowering: the jnp reference on every platform (``reference.py``), run on each device's blocks
  under multi-device jit (``compress/sharding.py``).
- vmap: the primitive takes any leading dims, so a batch axis moves to the front of every operand
  (unbatched ones broadcast) and the primitive binds again.
- JVP: the primal from the primitive; the tangent is the reference's (linear jnp operations of the
  tangents, which JAX transposes for the gradient), split over Explicit mesh axes as the lowering
  splits the primal.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir, xla

from .. import sharding as shared_sharding
from . import sharding as compress_sharding

compress_pool_p = Primitive("compress_pool")


def result_shape(kv_shape, ratio: int, overlap: bool) -> tuple:
    """``[..., T // r, C]``, or ``[..., T // r, C // 2]`` with overlap."""
    *lead, T, C = kv_shape
    return tuple(lead) + (T // ratio, C // 2 if overlap else C)


def _abstract_eval(kv, score, ape, *prev, overlap, implementation):
    del score, prev, implementation
    ratio = ape.shape[-2]
    return compress_sharding.result_aval(kv, result_shape(kv.shape, ratio, overlap), ratio,
                                         overlap)


compress_pool_p.def_abstract_eval(_abstract_eval)
compress_pool_p.def_impl(functools.partial(xla.apply_primitive, compress_pool_p))
shared_sharding.register_device_aware(compress_pool_p)


# --- lowering -----------------------------------------------------------------------------------


def _lower(kv, score, ape, *prev, overlap, implementation):
    del implementation  # only the reference exists (the API refuses the NKI names)
    return compress_sharding.run(kv, score, ape, *prev, ratio=ape.shape[-2], overlap=overlap)


mlir.register_lowering(compress_pool_p, mlir.lower_fun(_lower, multiple_results=False))


# --- vmap ---------------------------------------------------------------------------------------


def _batcher(args, dims, **params):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    front = [jnp.broadcast_to(a, (size,) + a.shape) if d is None else jnp.moveaxis(a, d, 0)
             for a, d in zip(args, dims)]
    return compress_pool_p.bind(*front, **params), 0


batching.primitive_batchers[compress_pool_p] = _batcher


# --- JVP ----------------------------------------------------------------------------------------


def _jvp(primals, tangents, *, overlap, implementation):
    out = compress_pool_p.bind(*primals, overlap=overlap, implementation=implementation)
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    fn = functools.partial(compress_sharding.split_like_lowering, overlap=overlap)
    _, dout = jax.jvp(fn, tuple(primals), tuple(tangents))
    return out, dout


ad.primitive_jvps[compress_pool_p] = _jvp
