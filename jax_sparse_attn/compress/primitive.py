"""The pooling primitive ``compress_pool_p`` and its rules: abstract eval, lowering, vmap, JVP.

Operands, already checked by :mod:`jax_sparse_attn.compress.api` (``docs/compress.md``)::

    kv [..., T, C], score [..., T, C], ape [..., r, C]
    and with overlap, optionally: prev_kv [..., r, C], prev_score [..., r, C]

any float dtypes, one set of leading dims ``...`` for all of them (the API broadcasts ape). Three
operands or five: the count says whether the rows before block 0 are given. Static parameters:
``overlap`` (bool) and ``implementation`` (None, ``"reference"``, ``"nki"`` or
``"nki_emulated"``). One result, ``[..., T // r, C]`` f32, or ``[..., T // r, C // 2]`` with
overlap.

- Lowering: the jnp reference (``reference.py``), or the NKI kernel for ``"nki"`` /
  ``"nki_emulated"`` and on the ``"neuron"`` platform for ``None`` (``neuron.py``), run on each
  device's blocks under multi-device jit (``compress/sharding.py``).
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
from ..platforms import NEURON_PLATFORM, register_on_discovery
from . import sharding as compress_sharding

compress_pool_p = Primitive("compress_pool")
compress_pool_p.__doc__ = """The primitive of :func:`jax_sparse_attn.compress_pool`.

Operands ``kv [..., T, C], score [..., T, C], ape [r, C]`` and, with ``overlap``, optionally
``prev_kv, prev_score [..., r, C]``; parameters ``overlap``, ``implementation``. Result
``[..., T // r, C]`` f32 (``C // 2`` with overlap)."""


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
    """Every platform: ``None`` / ``"reference"`` the reference, ``"nki"`` / ``"nki_emulated"``
    the NKI kernel (``compress/neuron.py``), on each device's blocks."""
    return compress_sharding.run(kv, score, ape, *prev, ratio=ape.shape[-2], overlap=overlap,
                                 implementation=implementation)


def _lower_neuron(kv, score, ape, *prev, overlap, implementation):
    """The ``"neuron"`` platform: ``None`` means the kernel there (as for the other ops);
    ``"nki_emulated"`` needs a host callback, which JAX on Neuron does not have."""
    if implementation == "nki_emulated":
        from ..attention.neuron import NO_HOST_CALLBACKS_ON_NEURON

        raise NotImplementedError(NO_HOST_CALLBACKS_ON_NEURON)
    if implementation is None:
        implementation = "nki"
    return _lower(kv, score, ape, *prev, overlap=overlap, implementation=implementation)


mlir.register_lowering(compress_pool_p, mlir.lower_fun(_lower, multiple_results=False))
# Returns whether the "neuron" rule is registered (it is once JAX knows that platform).
register_neuron_lowering = register_on_discovery(lambda: mlir.register_lowering(
    compress_pool_p, mlir.lower_fun(_lower_neuron, multiple_results=False),
    platform=NEURON_PLATFORM))


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
