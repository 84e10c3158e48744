"""The indexer primitive ``indexer_topk_p`` and its rules: abstract eval, lowerings, vmap, JVP.

Operands, already normalised by :mod:`jax_sparse_attn.indexer.api` (``docs/indexer.md``)::

    q [T, Hi, Di] (bf16, f16 or f32), weights [T, Hi] f32 (the scale folded in),
    keys [R, Di] in q's dtype (bf16 also as uint16 bit patterns), key_scale [R] f32,
    positions [T] int32

Static parameters: ``topk``, ``compress_ratio``, ``implementation``, ``sequences``. Two results,
always: ``idx [T, topk]`` int32 (-1 for an empty slot) and ``scores [T, topk]`` f32 (-inf there).
With ``sequences = S > 1`` (only from vmap over caches) the T tokens are S sequences' tokens one
after the other, each with its own cache: keys ``[S, R, Di]``, key_scale ``[S, R]``.

- Lowerings: the jnp reference on every platform (``reference.py``), the NKI kernel for
  ``"nki"`` / ``"nki_emulated"`` (``indexer/neuron.py``), each run shard-locally
  (``indexer/sharding.py``).
- vmap: a batch axis on the token operands only (sequences sharing one key cache) folds into the
  tokens; a batched key cache (each sequence its own) becomes ``sequences``: one call, whose
  reference reads each sequence's blocks out of the whole batch of caches (a per-sequence slice
  would copy each sequence's cache), so a token never scans another sequence's rows.
- JVP: the scores' tangent is that of the score formula at the selected rows, recomputed in
  token chunks; the indices have none. Its transpose (the gradient) is derived by JAX.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir, xla

from ..attention import primitive as attention_primitives
from .. import sharding as shared_sharding
from . import reference
from . import sharding as indexer_sharding

indexer_topk_p = Primitive("indexer_topk")
indexer_topk_p.multiple_results = True
indexer_topk_p.__doc__ = """The primitive of :func:`jax_sparse_attn.indexer_topk`.

Operands ``q [T, Hi, Di], weights [T, Hi] f32 (the scale folded in), keys [R, Di],
key_scale [R] f32, positions [T] int32`` (``OPERANDS``); parameters ``topk``, ``compress_ratio``,
``implementation``, ``sequences``. Results ``idx [T, topk]`` int32 and ``scores [T, topk]`` f32."""

OPERANDS = ("q", "weights", "keys", "key_scale", "positions")
# Operands indexed by token (their batch axis folds into the tokens) and by cache row.
TOKEN_OPERANDS = (0, 1, 4)
ROW_OPERANDS = (2, 3)


def _abstract_eval(q, weights, keys, key_scale, positions, *, topk, compress_ratio,
                   implementation, sequences=1):
    del weights, keys, key_scale, positions, compress_ratio, implementation, sequences
    shape = (q.shape[0], topk)
    return [
        shared_sharding.result_aval(q, shape, jnp.int32, indexer_sharding.LAYOUTS["idx"]),
        shared_sharding.result_aval(q, shape, jnp.float32, indexer_sharding.LAYOUTS["scores"]),
    ]


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


def path(implementation, *, topk: int, compress_ratio: int, sequences: int = 1):
    """The jnp-traceable function of the five operands that ``implementation`` lowers to."""
    if implementation in ("nki", "nki_emulated"):
        kernel = _neuron_path(emulated=implementation == "nki_emulated")
        if kernel is not None:
            kernel = functools.partial(kernel, topk=topk, compress_ratio=compress_ratio)
            return kernel if sequences == 1 else functools.partial(_each_sequence, kernel, sequences)
        import warnings

        warnings.warn(
            f"implementation={implementation!r}: the indexer's NKI kernel is not part of this "
            "version; indexer_topk runs the jnp reference instead", stacklevel=3)
    return functools.partial(reference.indexer_topk_reference, topk=topk,
                             compress_ratio=compress_ratio, sequences=sequences)


def _each_sequence(fn, sequences, q, weights, keys, key_scale, positions):
    """``fn`` (of one sequence's operands) over ``sequences`` sequences, one call each, in a loop
    (``lax.map``): the program holds one kernel call whatever the batch."""
    q, weights, positions = (reference.per_sequence(x, sequences) for x in (q, weights, positions))
    outs = jax.lax.map(lambda a: fn(*a), (q, weights, keys, key_scale, positions))
    return tuple(x.reshape((-1,) + x.shape[2:]) for x in outs)


def _lower(q, weights, keys, key_scale, positions, *, topk, compress_ratio, implementation,
           sequences=1):
    if sequences > 1:  # a vmap's batch of caches
        return indexer_sharding.run_over_sequences(
            lambda s: path(implementation, topk=topk, compress_ratio=compress_ratio, sequences=s),
            sequences, q, weights, keys, key_scale, positions,
            host_callbacks=implementation == "nki_emulated")
    fn = path(implementation, topk=topk, compress_ratio=compress_ratio)
    return indexer_sharding.run_shard_local(fn, topk, compress_ratio, q, weights, keys, key_scale,
                                            positions)


mlir.register_lowering(indexer_topk_p, mlir.lower_fun(_lower, multiple_results=True))


# --- vmap ---------------------------------------------------------------------------------------


def _batcher(args, dims, **params):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    S = params.get("sequences", 1)
    if any(dims[i] is not None for i in ROW_OPERANDS):
        # One key cache per sequence: the batch's caches become ``sequences`` (S each before).
        args = [attention_primitives._to_front(a, d, size) for a, d in zip(args, dims)]
        batched = next(args[i] for i in ROW_OPERANDS if dims[i] is not None)
        args = [a if d is not None else indexer_sharding.split_like_batch(a, batched)
                for a, d in zip(args, dims)]
        for i in TOKEN_OPERANDS:
            args[i] = attention_primitives._fold(args[i])
        for i in ROW_OPERANDS:
            if S > 1:
                args[i] = attention_primitives._fold(args[i])
            elif size == 1:  # one sequence: its cache as it is (a reshape, no copy)
                args[i] = args[i].reshape(args[i].shape[1:])
        outs = indexer_topk_p.bind(*args, **dict(params, sequences=size * S))
        return [o.reshape((size, o.shape[0] // size) + o.shape[1:]) for o in outs], [0, 0]
    if S > 1:  # shared caches over a batch of per-sequence calls: one call per batch element
        return attention_primitives._map_over_batch(indexer_topk_p, args, dims, params)
    args = list(args)
    for i in TOKEN_OPERANDS:
        x = attention_primitives._to_front(args[i], dims[i], size)
        args[i] = attention_primitives._fold(x)
    outs = indexer_topk_p.bind(*args, **params)
    outs = [o.reshape((size, o.shape[0] // size) + o.shape[1:]) for o in outs]
    return outs, [0, 0]


batching.primitive_batchers[indexer_topk_p] = _batcher


# --- JVP ----------------------------------------------------------------------------------------

# Working set of one token chunk of the tangent: the gathered key rows and their products.
TANGENT_CHUNK_BYTES = 32 * 2**20


def selected_scores(q, weights, keys, key_scale, idx):
    """The score formula at given rows, differentiably: ``idx [T, K]`` (-1: empty, score 0) ->
    ``[T, K]`` f32. Token chunks of about ``TANGENT_CHUNK_BYTES`` bound the gathered keys."""
    T, Hi, Di = q.shape
    K = idx.shape[1]
    if T == 0 or K == 0:
        return jnp.zeros((T, K), jnp.float32)
    valid = idx >= 0
    rows = jnp.where(valid, idx, 0)

    def one(q_t, w_t, rows_t, valid_t):
        x = reference.key_rows(keys[rows_t]).astype(jnp.float32)  # [K, Di]
        d = jnp.einsum("hd,kd->hk", q_t.astype(jnp.float32), x, precision=reference._EXACT)
        s = jnp.einsum("hk,h->k", jax.nn.relu(d), w_t, precision=reference._EXACT)
        return jnp.where(valid_t, s * key_scale[rows_t], 0.0)

    chunk = max(1, min(T, TANGENT_CHUNK_BYTES // max(1, K * (Di + Hi) * 4)))
    return jax.lax.map(lambda a: one(*a), (q, weights, rows, valid), batch_size=chunk)


def _jvp(primals, tangents, *, topk, compress_ratio, implementation, sequences=1):
    q, weights, keys, key_scale, positions = primals
    idx, scores = indexer_topk_p.bind(*primals, topk=topk, compress_ratio=compress_ratio,
                                      implementation=implementation, sequences=sequences)
    dq, dw, dk = (ad.instantiate_zeros(t) for t in tangents[:3])
    if sequences == 1:
        fn = lambda q_, w_, k_: selected_scores(q_, w_, k_, key_scale, idx)  # noqa: E731
    else:
        def fn(q_, w_, k_):
            per = functools.partial(reference.per_sequence, sequences=sequences)
            s = jax.vmap(selected_scores)(per(q_), per(w_), k_, key_scale, per(idx))
            return s.reshape(idx.shape)
    _, dscores = jax.jvp(fn, (q, weights, keys), (dq, dw, dk))
    return (idx, scores), (ad.Zero(jax.typeof(idx).to_tangent_aval()), dscores)


ad.primitive_jvps[indexer_topk_p] = _jvp
