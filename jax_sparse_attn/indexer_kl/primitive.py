"""The primitives of ``indexer_kl`` and their rules: abstract eval, lowerings, vmap, JVP and
transpose (docs/indexer-kl.md, "The primitives").

Every operand has a leading axis of sequences, each with its own rows (``OPERANDS``);
``indexer_kl`` binds them with one. Three primitives:

- ``indexer_kl_p`` (``mode="value"``): ``kl [S, T]`` and ``mass [S, T]``. Under differentiation
  its JVP binds it with ``mode="fused"``, which adds the residuals of one fused pass: ``live
  [S, T]`` and the gradients of the three student operands for a cotangent of 1 on every token.
- ``indexer_kl_tangent_p``: the KL's tangent, linear in the student operands' tangents.
- ``indexer_kl_grad_p``, its transpose: the student operands' cotangents. Where the cotangent is
  the same on every live token (a mean or a sum of the KL: the common case) they are the fused
  pass's residuals times it, with no teacher product; else one more fused pass with the
  cotangent (a ``cond`` per sequence).

The teacher operands, positions, idx, key_scale, lse_extra and the scale are never
differentiated (``indexer_kl`` stops their gradients).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir, xla

from .. import batching as shared_batching
from .. import sharding as shared_sharding
from ..platforms import NEURON_PLATFORM, register_on_discovery
from . import reference
from . import sharding as kl_sharding

# q [S, T, H, D], kv [S, R, D], index_q [S, T, Hi, Di], weights [S, T, Hi] f32 (index_scale
# folded in), index_keys [S, R, Di], key_scale [S, R] f32, positions [S, T] int32,
# idx [S, T, K] int32, lse_extra [S, T, H] f32, scale [S] f32.
OPERANDS = ("q", "kv", "index_q", "weights", "index_keys", "key_scale", "positions", "idx",
            "lse_extra", "scale")
# Operands indexed by token; the rest belong to a sequence as a whole (its rows, its scale).
TOKEN_OPERANDS = (0, 2, 3, 6, 7, 8)
STUDENT = (2, 3, 4)  # index_q, weights, index_keys: the differentiable operands
# The fused mode's residuals: live [S, T] f32, then the unit cotangents of the student operands.
RESIDUALS = 4

indexer_kl_p = Primitive("indexer_kl")
indexer_kl_p.multiple_results = True
indexer_kl_p.__doc__ = """The primitive of :func:`jax_sparse_attn.indexer_kl`.

Operands (``OPERANDS``, leading axis of sequences) ``q, kv, index_q, weights, index_keys,
key_scale, positions, idx, lse_extra, scale``; parameters ``sparse``, ``compress_ratio``,
``implementation``, ``mode`` (``"value"``: ``kl, mass [S, T]`` f32; ``"fused"``: those and the
residuals ``live [S, T]`` f32 and the cotangents of index_q, weights, index_keys for a cotangent
of 1 on every token)."""

indexer_kl_tangent_p = Primitive("indexer_kl_tangent")
indexer_kl_tangent_p.__doc__ = """The tangent of ``indexer_kl_p``'s kl: operands the tangents of
index_q, weights and index_keys (linear), the fused residuals, then ``OPERANDS``. ``[S, T]``
f32."""

indexer_kl_grad_p = Primitive("indexer_kl_grad")
indexer_kl_grad_p.multiple_results = True
indexer_kl_grad_p.__doc__ = """The transpose of ``indexer_kl_tangent_p``: operands the kl's
cotangent ``[S, T]``, the fused residuals, then ``OPERANDS``. The cotangents of index_q (its
dtype), weights (f32) and index_keys (its dtype)."""


# --- abstract evaluation ------------------------------------------------------------------------


def _abstract_eval(*operands, sparse, compress_ratio, implementation, mode):
    del sparse, compress_ratio, implementation
    q = operands[0]
    out = [kl_sharding.token_aval(q), kl_sharding.token_aval(q)]
    if mode == "fused":
        out += [kl_sharding.token_aval(q)] + kl_sharding.student_avals(
            q, operands[2], operands[3], operands[4], (jnp.float32,) * 3)
    return out


def _tangent_abstract_eval(*args, sparse, compress_ratio, implementation):
    del sparse, compress_ratio, implementation
    return kl_sharding.token_aval(args[3 + RESIDUALS])


def _grad_abstract_eval(*args, sparse, compress_ratio, implementation):
    del sparse, compress_ratio, implementation
    operands = args[1 + RESIDUALS:]
    dtypes = (operands[2].dtype, jnp.float32, operands[4].dtype)
    return kl_sharding.student_avals(operands[0], operands[2], operands[3], operands[4], dtypes)


indexer_kl_p.def_abstract_eval(_abstract_eval)
indexer_kl_tangent_p.def_abstract_eval(_tangent_abstract_eval)
indexer_kl_grad_p.def_abstract_eval(_grad_abstract_eval)
for _p in (indexer_kl_p, indexer_kl_tangent_p, indexer_kl_grad_p):
    _p.def_impl(functools.partial(xla.apply_primitive, _p))
shared_sharding.register_device_aware(indexer_kl_p, indexer_kl_tangent_p, indexer_kl_grad_p)


# --- lowering: one sequence at a time, on each device's block ----------------------------------


def _over_sequences(one, *arrays):
    """``one`` (of one sequence's arrays) over the leading axis; one sequence runs directly."""
    if arrays[0].shape[0] == 1:
        outs = one(*(a[0] for a in arrays))
        return [o[None] for o in (outs if isinstance(outs, (tuple, list)) else (outs,))]
    outs = jax.lax.map(lambda a: one(*a), arrays)
    return list(outs) if isinstance(outs, (tuple, list)) else [outs]


def value_one(*operands, sparse, compress_ratio, mode, head_axes=()):
    """One sequence: ``(kl, mass)``, or with ``mode="fused"`` also the residuals."""
    params = dict(sparse=sparse, compress_ratio=compress_ratio, head_axes=head_axes)
    if mode == "value":
        return reference.indexer_kl_one(*operands, **params)
    T = operands[0].shape[0]
    return reference.indexer_kl_one(*operands, mode="grad", ct=jnp.ones((T,), jnp.float32),
                                    **params)


def tangent_one(d_iq, d_w, d_keys, *operands, sparse, compress_ratio, head_axes=()):
    """One sequence's KL tangent (a fused pass)."""
    return reference.indexer_kl_one(*operands, sparse=sparse, compress_ratio=compress_ratio,
                                    mode="tangent", tangents=(d_iq, d_w, d_keys),
                                    head_axes=head_axes)


def uniform_cotangent(ct, live, token_axes=()):
    """``(c, same)``: the cotangent of the first live token, and whether every live token (on
    every device along ``token_axes``) has exactly that one, so that the gradients are ``c``
    times the unit residuals."""
    any_live = jnp.any(live > 0)
    c = ct[jnp.argmax(live > 0)]
    same = jnp.all(jnp.where(live > 0, ct == c, True))
    if not token_axes:
        return jnp.where(any_live, c, 0.0), same
    low = jax.lax.pmin(jnp.where(any_live, c, jnp.inf), token_axes)
    high = jax.lax.pmax(jnp.where(any_live, c, -jnp.inf), token_axes)
    same = jax.lax.pmin(same.astype(jnp.int32), token_axes) > 0
    return jnp.where(low < jnp.inf, low, 0.0), same & ((low == high) | (low == jnp.inf))


def grad_one(ct, live, u_iq, u_w, u_keys, *operands, sparse, compress_ratio, head_axes=(),
             token_axes=(), mesh_shape=None):
    """One sequence's cotangents of index_q, weights, index_keys (in their dtypes). With the
    tokens split, ``u_keys`` is the sum over every device's tokens: the scaled form counts it
    on the first token device only (``kl_sharding.first_along``)."""
    dtypes = (operands[2].dtype, jnp.float32, operands[4].dtype)
    ct = ct.astype(jnp.float32)
    c, same = uniform_cotangent(ct, live, token_axes)

    # Each branch returns the final dtypes: a cast after the cond would hold f32 copies.
    def scaled(_):
        (keys,) = kl_sharding.first_along(token_axes, mesh_shape, (u_keys * c,))
        return tuple(g.astype(d) for g, d in zip((u_iq * c, u_w * c, keys), dtypes))

    def again(_):
        grads = reference.indexer_kl_one(
            *operands, sparse=sparse, compress_ratio=compress_ratio, mode="grad", ct=ct,
            head_axes=head_axes, index_q_grad_dtype=dtypes[0])[3:]
        return tuple(g.astype(d) for g, d in zip(grads, dtypes))

    return jax.lax.cond(same, scaled, again, None)


def _make_value_local(sparse, compress_ratio, mode):
    def make_local(axes, mesh_shape):
        one = functools.partial(value_one, sparse=sparse, compress_ratio=compress_ratio,
                                mode=mode, head_axes=axes["h"])
        return lambda *operands: kl_sharding.first_along(
            axes["h"], mesh_shape, _over_sequences(one, *operands))
    return make_local


def _make_tangent_local(sparse, compress_ratio):
    def make_local(axes, mesh_shape):
        one = functools.partial(tangent_one, sparse=sparse, compress_ratio=compress_ratio,
                                head_axes=axes["h"])

        def local(*args):  # OPERANDS, then the three tangents
            operands, tangents = args[:len(OPERANDS)], args[len(OPERANDS):]
            return kl_sharding.first_along(axes["h"], mesh_shape,
                                           _over_sequences(one, *tangents, *operands))
        return local
    return make_local


def _make_grad_local(sparse, compress_ratio):
    def make_local(axes, mesh_shape):
        one = functools.partial(grad_one, sparse=sparse, compress_ratio=compress_ratio,
                                head_axes=axes["h"], token_axes=axes["t"], mesh_shape=mesh_shape)

        def local(*args):  # OPERANDS, then the cotangent and the residuals
            operands, rest = args[:len(OPERANDS)], args[len(OPERANDS):]
            return kl_sharding.first_along(axes["h"], mesh_shape,
                                           _over_sequences(one, *rest, *operands))
        return local
    return make_local


def _lower(*operands, sparse, compress_ratio, implementation, mode):
    del implementation  # no kernel yet: the reference on every platform
    results = kl_sharding.FUSED_RESULTS if mode == "fused" else kl_sharding.VALUE_RESULTS
    return list(kl_sharding.run(_make_value_local(sparse, compress_ratio, mode), operands,
                                kl_sharding.OPERAND_LAYOUTS, results))


def _lower_tangent(*args, sparse, compress_ratio, implementation):
    del implementation
    tangents, operands = args[:3], args[3 + RESIDUALS:]  # the residuals are not needed
    return kl_sharding.run(_make_tangent_local(sparse, compress_ratio), operands + tangents,
                           kl_sharding.OPERAND_LAYOUTS + kl_sharding.STUDENT_LAYOUTS,
                           ("s t",))[0]


def _lower_grad(*args, sparse, compress_ratio, implementation):
    del implementation
    rest, operands = args[:1 + RESIDUALS], args[1 + RESIDUALS:]
    return list(kl_sharding.run(_make_grad_local(sparse, compress_ratio), operands + rest,
                                kl_sharding.OPERAND_LAYOUTS + ("s t",)
                                + kl_sharding.RESIDUAL_LAYOUTS, kl_sharding.STUDENT_LAYOUTS))


LOWERINGS = ((indexer_kl_p, _lower, True), (indexer_kl_tangent_p, _lower_tangent, False),
             (indexer_kl_grad_p, _lower_grad, True))
for _p, _fn, _multiple in LOWERINGS:
    mlir.register_lowering(_p, mlir.lower_fun(_fn, multiple_results=_multiple))


def _register_neuron():
    # No NKI kernel yet: the reference runs on Trainium too (docs/indexer-kl.md).
    for p, fn, multiple in LOWERINGS:
        mlir.register_lowering(p, mlir.lower_fun(fn, multiple_results=multiple),
                               platform=NEURON_PLATFORM)


# Returns whether the "neuron" rules are registered (they are once JAX knows that platform).
register_neuron_lowering = register_on_discovery(_register_neuron)


# --- vmap ---------------------------------------------------------------------------------------


def _fold_sequences(prim, args, dims, params):
    """The batch joins the sequences: every operand gets it in front (broadcast where unbatched)
    and ``[B, S, ...]`` becomes ``[B S, ...]``; results come back ``[B, S, ...]``."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [shared_batching.fold(shared_batching.to_front(a, d, size)) for a, d in zip(args, dims)]
    outs = prim.bind(*args, **params)
    single = not prim.multiple_results
    outs = [outs] if single else outs
    outs = [o.reshape((size, o.shape[0] // size) + o.shape[1:]) for o in outs]
    return (outs[0], 0) if single else (outs, [0] * len(outs))


def _batcher(args, dims, **params):
    if params["mode"] == "fused" or any(dims[i] is not None for i in range(len(OPERANDS))
                                        if i not in TOKEN_OPERANDS):
        # Rows (or a scale) per batch element, or per-sequence residuals: more sequences.
        return _fold_sequences(indexer_kl_p, args, dims, params)
    # Rows shared by the batch: the batch joins each sequence's tokens (no copy of the rows).
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = list(args)
    for i in TOKEN_OPERANDS:
        x = jnp.moveaxis(shared_batching.to_front(args[i], dims[i], size), 0, 1)  # [S, B, T...]
        args[i] = x.reshape((x.shape[0], size * x.shape[2]) + x.shape[3:])
    outs = indexer_kl_p.bind(*args, **params)
    return [o.reshape((o.shape[0], size, o.shape[1] // size)) for o in outs], [1, 1]


batching.primitive_batchers[indexer_kl_p] = _batcher
for _p in (indexer_kl_tangent_p, indexer_kl_grad_p):
    batching.primitive_batchers[_p] = (
        lambda args, dims, _prim=_p, **params: _fold_sequences(_prim, args, dims, params))


# --- differentiation ----------------------------------------------------------------------------


def _zero_like(x):
    return ad.Zero(jax.typeof(x).to_tangent_aval())


SECOND_ORDER = ("indexer_kl has first derivatives only (its JVP and VJP with respect to index_q, "
                "index_weights and index_keys): a derivative of its derivative is not defined here")


def _no_second_order(*args, **params):
    raise NotImplementedError(SECOND_ORDER)


def _jvp(primals, tangents, *, sparse, compress_ratio, implementation, mode):
    student = [tangents[i] for i in STUDENT]
    params = dict(sparse=sparse, compress_ratio=compress_ratio, implementation=implementation)
    if mode != "value" and not all(type(t) is ad.Zero for t in student):
        _no_second_order()  # "fused" is bound only inside a first derivative
    if mode != "value" or all(type(t) is ad.Zero for t in student):
        outs = indexer_kl_p.bind(*primals, mode=mode, **params)
        return outs, [_zero_like(o) for o in outs]
    kl, mass, *residuals = indexer_kl_p.bind(*primals, mode="fused", **params)
    student = [ad.instantiate_zeros(t) for t in student]
    dkl = indexer_kl_tangent_p.bind(*student, *residuals, *primals, **params)
    return [kl, mass], [dkl, _zero_like(mass)]


def _tangent_transpose(ct, *args, sparse, compress_ratio, implementation):
    residuals = args[3:3 + RESIDUALS]
    operands = args[3 + RESIDUALS:]
    params = dict(sparse=sparse, compress_ratio=compress_ratio, implementation=implementation)
    if type(ct) is ad.Zero:
        grads = [None] * 3
    else:
        grads = indexer_kl_grad_p.bind(ct, *residuals, *operands, **params)
        grads = [shared_sharding.like_aval(g, a.aval) if isinstance(a, ad.UndefinedPrimal) else g
                 for g, a in zip(grads, args[:3])]
        grads = [g if isinstance(a, ad.UndefinedPrimal) else None for g, a in zip(grads, args[:3])]
    return grads + [None] * (len(args) - 3)


ad.primitive_jvps[indexer_kl_p] = _jvp
# A named error rather than JAX's own "rule not implemented" for a second derivative.
ad.primitive_jvps[indexer_kl_tangent_p] = _no_second_order
ad.primitive_jvps[indexer_kl_grad_p] = _no_second_order
ad.primitive_transposes[indexer_kl_tangent_p] = _tangent_transpose
