"""The indexer primitive ``indexer_topk_p`` and its rules: abstract eval, lowerings, vmap, JVP.

Every operand has a leading axis of sequences, each with its own cache (``docs/indexer.md``,
"The primitive"); ``indexer_topk`` binds it with one. Results: ``idx [S, T, topk]`` int32 and
``scores [S, T, topk]`` f32.
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
from ..attention.reference import EXACT
from . import reference
from . import sharding as indexer_sharding

indexer_topk_p = Primitive("indexer_topk")
indexer_topk_p.multiple_results = True
indexer_topk_p.__doc__ = """The primitive of :func:`jax_sparse_attn.indexer_topk`.

Operands ``q [T, Hi, Di], weights [T, Hi] f32 (the scale folded in), keys [R, Di],
key_scale [R] f32, positions [T] int32`` (``OPERANDS``); parameters ``topk``, ``compress_ratio``,
``implementation``, ``sequences``. Results ``idx [T, topk]`` int32 and ``scores [T, topk]`` f32."""

# q [S, T, Hi, Di], weights [S, T, Hi], keys [S, R, Di], key_scale [S, R], positions [S, T].
OPERANDS = ("q", "weights", "keys", "key_scale", "positions")
# Operands indexed by token, and by cache row.
TOKEN_OPERANDS = (0, 1, 4)
ROW_OPERANDS = (2, 3)


def _abstract_eval(q, weights, keys, key_scale, positions, *, topk, compress_ratio,
                   implementation):
    del weights, keys, key_scale, positions, compress_ratio, implementation
    shape = q.shape[:2] + (topk,)
    return [indexer_sharding.result_aval(q, shape, jnp.int32),
            indexer_sharding.result_aval(q, shape, jnp.float32)]


indexer_topk_p.def_abstract_eval(_abstract_eval)
indexer_topk_p.def_impl(functools.partial(xla.apply_primitive, indexer_topk_p))
shared_sharding.register_device_aware(indexer_topk_p)


# --- lowering -----------------------------------------------------------------------------------


def _neuron_path(emulated: bool):
    """The NKI kernel's path, or None while ``indexer/neuron.py`` is absent."""
    try:
        from . import neuron
    except ImportError:
        return None
    return functools.partial(neuron.indexer_topk_neuron, emulated=emulated)


def path(implementation, *, topk: int, compress_ratio: int):
    """``(one, each)``: the jnp-traceable functions that ``implementation`` lowers to, of one
    sequence's operands (no leading axis) and of a batch of sequences' (the primitive's)."""
    if implementation in ("nki", "nki_emulated"):
        kernel = _neuron_path(emulated=implementation == "nki_emulated")
        if kernel is not None:
            kernel = functools.partial(kernel, topk=topk, compress_ratio=compress_ratio)
            # One kernel call in a loop: the program holds one call whatever the batch.
            return kernel, lambda *operands: jax.lax.map(lambda a: kernel(*a), operands)
        import warnings

        warnings.warn(
            f"implementation={implementation!r}: the indexer's NKI kernel is not part of this "
            "version; indexer_topk runs the jnp reference instead", stacklevel=3)
    params = dict(topk=topk, compress_ratio=compress_ratio)
    return (functools.partial(reference.indexer_topk_reference, **params),
            functools.partial(reference.indexer_topk_over_sequences, **params))


def _lower(q, weights, keys, key_scale, positions, *, topk, compress_ratio, implementation):
    operands = (q, weights, keys, key_scale, positions)
    one, each = path(implementation, topk=topk, compress_ratio=compress_ratio)
    if keys.shape[0] == 1:  # its tokens, and its cache's rows, may be split over the devices
        outs = indexer_sharding.run_shard_local(one, topk, compress_ratio,
                                                *(x[0] for x in operands))
        return [o[None] for o in outs]
    return indexer_sharding.run_over_sequences(one, each, *operands,
                                               host_callbacks=implementation == "nki_emulated")


def _lower_neuron(*operands, topk, compress_ratio, implementation):
    """The ``"neuron"`` platform: ``None`` means the kernel there (as for the other ops);
    ``"nki_emulated"`` needs a host callback, which JAX on Neuron does not have."""
    if implementation == "nki_emulated":
        from ..attention.neuron import NO_HOST_CALLBACKS_ON_NEURON

        raise NotImplementedError(NO_HOST_CALLBACKS_ON_NEURON)
    return _lower(*operands, topk=topk, compress_ratio=compress_ratio,
                  implementation="nki" if implementation is None else implementation)


mlir.register_lowering(indexer_topk_p, mlir.lower_fun(_lower, multiple_results=True))
# Returns whether the "neuron" rule is registered (it is once JAX knows that platform).
register_neuron_lowering = register_on_discovery(lambda: mlir.register_lowering(
    indexer_topk_p, mlir.lower_fun(_lower_neuron, multiple_results=True),
    platform=NEURON_PLATFORM))


# --- vmap ---------------------------------------------------------------------------------------


def _batcher(args, dims, **params):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    if any(dims[i] is not None for i in ROW_OPERANDS):
        # A cache per batch element: the batch joins the sequences.
        args = [shared_batching.to_front(a, d, size) for a, d in zip(args, dims)]
        batched = next(args[i] for i in ROW_OPERANDS if dims[i] is not None)
        args = [a if d is not None else indexer_sharding.split_like_batch(a, batched)
                for a, d in zip(args, dims)]
        outs = indexer_topk_p.bind(*(shared_batching.fold(a) for a in args), **params)
        return [o.reshape((size, o.shape[0] // size) + o.shape[1:]) for o in outs], [0, 0]
    # Caches shared by the batch: the batch joins each sequence's tokens.
    args = list(args)
    for i in TOKEN_OPERANDS:
        x = jnp.moveaxis(shared_batching.to_front(args[i], dims[i], size), 0, 1)  # [S, B, T...]
        args[i] = x.reshape((x.shape[0], size * x.shape[2]) + x.shape[3:])
    outs = indexer_topk_p.bind(*args, **params)
    return [o.reshape((o.shape[0], size, o.shape[1] // size) + o.shape[2:]) for o in outs], [1, 1]


batching.primitive_batchers[indexer_topk_p] = _batcher


# --- JVP ----------------------------------------------------------------------------------------

# Working set of one token chunk of the tangent: the gathered key rows and their products.
TANGENT_CHUNK_BYTES = 32 * 2**20


def selected_scores(q, weights, keys, key_scale, idx):
    """The score formula at given rows of one sequence's cache, differentiably: ``idx [T, K]``
    (-1: empty, score 0) -> ``[T, K]`` f32. Token chunks of about ``TANGENT_CHUNK_BYTES`` bound
    the gathered keys."""
    T, Hi, Di = q.shape
    K = idx.shape[1]
    if T == 0 or K == 0:
        return jnp.zeros((T, K), jnp.float32)
    valid = idx >= 0
    rows = jnp.where(valid, idx, 0)

    def one(q_t, w_t, rows_t, valid_t):
        x = reference.key_rows(keys[rows_t]).astype(jnp.float32)  # [K, Di]
        d = jnp.einsum("hd,kd->hk", q_t.astype(jnp.float32), x, precision=EXACT)
        s = jnp.einsum("hk,h->k", jax.nn.relu(d), w_t, precision=EXACT)
        return jnp.where(valid_t, s * key_scale[rows_t], 0.0)

    chunk = max(1, min(T, TANGENT_CHUNK_BYTES // max(1, K * (Di + Hi) * 4)))
    return jax.lax.map(lambda a: one(*a), (q, weights, rows, valid), batch_size=chunk)


def _jvp(primals, tangents, **params):
    # The scores' tangent is that of the score formula at the selected rows (the indices have
    # none); JAX derives its transpose.
    q, weights, keys, key_scale, positions = primals
    idx, scores = indexer_topk_p.bind(*primals, **params)
    dq, dw, dk = (ad.instantiate_zeros(t) for t in tangents[:3])
    fn = lambda q_, w_, k_: jax.vmap(selected_scores)(q_, w_, k_, key_scale, idx)  # noqa: E731
    _, dscores = jax.jvp(fn, (q, weights, keys), (dq, dw, dk))
    return (idx, scores), (ad.Zero(jax.typeof(idx).to_tangent_aval()), dscores)


ad.primitive_jvps[indexer_topk_p] = _jvp
