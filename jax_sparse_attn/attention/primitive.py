"""The two JAX primitives and their rules: abstract eval, lowerings, and the vmap rule.

Operands are already normalised by :mod:`jax_sparse_attn.api` (which owns argument checking):

``gathered_attn_p``:      q [T, H, D], g [T, K, D], sink [H] f32, bias [T, K] f32, scale [T] f32
``gathered_attn_idx_p``:  q [T, H, D], kv [R, D], idx [T, K] int32, sink [H] f32, bias [T, K] f32,
                          scale [T] f32, and optionally a second cache: extra_kv [R2, D],
                          extra_idx [T, K2] int32, extra_bias [T, K2] f32

With the second cache the op attends to the union of both caches' slots in one softmax (main slots
first, then the extra ones, exactly as one cache ``[kv; extra_kv]`` with the extra indices moved by
R would): nothing is concatenated but each token's gathered slots. An FP8 cache instead comes with
one more operand, ``kv_scale [R, n]`` f32 (its dequantisation scales, one per group of ``D // n``
columns), and every path reads the FP8 rows itself. The operand count says which form a bind has
(``operand_names``): 6, 7 (FP8), 8 (FP8 with ``kv_rope [R, Dr]``, the 16-bit columns after the FP8
ones: the logical row is ``[dequantised kv | kv_rope]``), 9 (two caches), 10 and 11 (an FP8
main cache, split or not, beside a 16-bit second one: V4's compressed rows and window), or 13 (two
FP8 caches, each with its scales and rope columns, ``extra_kv_scale [R2, n2]`` and
``extra_kv_rope [R2, Dr2]``; a rope of zero columns stands for none, so that one form serves).

Both primitives return two results, ``out [T, H, value_dim]`` in q's dtype and ``lse [T, H]`` f32 (the
log-sum-exp of each token and head's logits with the sink). They always do, and the public
functions drop ``lse`` unless ``return_lse=True``: one signature keeps a single vmap rule, a single
sharding layout list and a single pair of autodiff primitives (the lse's tangent and cotangent are
one extra term of the output's, see autodiff.py), where a static ``return_lse`` parameter would
double each. The lse costs ``T * H`` values from statistics the softmax computes anyway, and an
unused one is dead code that XLA removes.

``sink = -inf`` means no sink and ``bias = -inf`` marks an empty slot, so ``None`` needs no special
case here. The scale travels per token so that a vmapped scale folds into the token axis like
everything else. Two parameters: ``implementation``, the user's choice (``None``,
``"reference"``, ``"nki"`` or ``"nki_emulated"``), and ``value_dim`` (an int, ``1 <= value_dim <=
D``): the logits use all D columns of each slot row, the values and the output only the first
``value_dim`` (V3.2's absorbed MLA: D = 576, value_dim = 512). Every path takes it as a keyword.

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

from .. import cache_sharding, sharding
from . import reference
from ..constants import MAX_ROWS

gathered_attn_p = Primitive("gathered_attn")
gathered_attn_idx_p = Primitive("gathered_attn_idx")
gathered_attn_p.__doc__ = """The primitive of :func:`jax_sparse_attn.gathered_attn`.

Operands ``q [T, H, D], g [T, K, D], sink [H] f32, bias [T, K] f32, scale [] f32`` (the defaults
already filled in); parameters ``implementation``, ``value_dim``. Results ``out [T, H, value_dim]``
in q's dtype and ``lse [T, H]`` f32."""
gathered_attn_idx_p.__doc__ = """The primitive of :func:`jax_sparse_attn.gathered_attn_idx`.

Operands ``q [T, H, D], kv [R, D], idx [T, K] int32, sink [H] f32, bias [T, K] f32, scale [] f32``,
then the optional groups of ``OPERANDS``' neighbours in this module (FP8 scales and rope columns, a
second cache); parameters ``implementation``, ``value_dim``. Results ``out [T, H, value_dim]`` in
q's dtype and ``lse [T, H]`` f32."""

IMPLEMENTATIONS = ("reference", "nki", "nki_emulated")

# Operand names of each primitive, by ``indexed``: False for gathered_attn_p, True for
# gathered_attn_idx_p.
OPERANDS = {
    False: ("q", "g", "sink", "bias", "scale"),
    True: ("q", "kv", "idx", "sink", "bias", "scale"),
}
# The second cache of gathered_attn_idx_p (two caches in one softmax), after the six above (and
# after an FP8 main cache's operands).
EXTRA_OPERANDS = ("extra_kv", "extra_idx", "extra_bias")
# The scales of an FP8 cache, after the six, and the 16-bit columns that follow its FP8 ones in a
# split row (DeepSeek's layouts: kv_rope).
FP8_OPERANDS = ("kv_scale",)
FP8_SPLIT_OPERANDS = ("kv_scale", "kv_rope")
# An FP8 second cache's scales and rope columns, after its three operands (beside an FP8 main
# cache in its split form only: the count then tells the form apart).
EXTRA_FP8_OPERANDS = ("extra_kv_scale", "extra_kv_rope")
# The caches among the operands, and the index operand of each.
CACHE_INDEX = {"kv": "idx", "extra_kv": "extra_idx"}
# Operands stacked along with a cache when vmap folds it (its rows are the cache's rows).
CACHE_COMPANION = {"kv_scale": "kv", "kv_rope": "kv",
                   "extra_kv_scale": "extra_kv", "extra_kv_rope": "extra_kv"}


# gathered_attn_idx_p's forms by operand count (6 to 11, and 13): the six, then an FP8 cache's
# scales (and kv_rope), then the second cache (and its own scales and rope).
_INDEXED_FORMS = {len(f): f for f in (OPERANDS[True] + fp8_names + extra
                                      for fp8_names in ((), FP8_OPERANDS, FP8_SPLIT_OPERANDS)
                                      for extra in ((), EXTRA_OPERANDS))}
_INDEXED_FORMS[13] = OPERANDS[True] + FP8_SPLIT_OPERANDS + EXTRA_OPERANDS + EXTRA_FP8_OPERANDS


def operand_names(indexed: bool, count: int) -> tuple:
    """The names of a bind's ``count`` operands (``_INDEXED_FORMS``). A count of no form is a
    bind this package never makes: an error, not the six-operand names."""
    forms = _INDEXED_FORMS if indexed else {len(OPERANDS[False]): OPERANDS[False]}
    if count not in forms:
        raise ValueError(f"gathered_attn{'_idx' if indexed else ''}_p has no form of {count} "
                         f"operands (forms: {sorted(forms)})")
    return forms[count]


# Host-runnable data paths by implementation name: (gathered_fn, gathered_idx_fn), each taking the
# primitive's operands and the keyword ``value_dim``, and returning ``(out, lse)``. The Neuron package registers "nki_emulated".
_PATHS: dict[str, tuple[Callable, Callable]] = {
    "reference": (reference.gathered_attn_reference, reference.gathered_attn_idx_reference),
}


def register_path(name: str, gathered_fn: Callable, gathered_idx_fn: Callable) -> None:
    """Makes ``implementation=name`` lower through the given jnp-traceable functions."""
    _PATHS[name] = (gathered_fn, gathered_idx_fn)


def path(name: str, indexed: bool) -> Callable:
    """The jnp-traceable function that ``implementation=name`` lowers to (operands as above)."""
    return _PATHS[name][1 if indexed else 0]


# --- abstract evaluation ------------------------------------------------------------------------


def _abstract_eval(q, *_, implementation, value_dim):
    del implementation
    # Keeps q's token/head sharding in the type under explicit mesh axes (see sharding.py).
    return [
        sharding.result_aval(q, q.shape[:2] + (value_dim,), q.dtype, sharding.LAYOUTS["out"]),
        sharding.result_aval(q, q.shape[:2], jnp.float32, sharding.LAYOUTS["lse"]),
    ]


gathered_attn_p.multiple_results = True
gathered_attn_idx_p.multiple_results = True


gathered_attn_p.def_abstract_eval(_abstract_eval)
gathered_attn_idx_p.def_abstract_eval(_abstract_eval)
gathered_attn_p.def_impl(functools.partial(xla.apply_primitive, gathered_attn_p))
gathered_attn_idx_p.def_impl(functools.partial(xla.apply_primitive, gathered_attn_idx_p))


# --- default lowering (every platform) ----------------------------------------------------------


RESULTS = ("out", "lse")


def _absent_rope(name: str, x) -> bool:
    """A rope operand of zero columns: the 13-operand form's stand-in for an FP8 cache whose rows
    are FP8 in every column (the paths then see no rope)."""
    return name in ("kv_rope", "extra_kv_rope") and x.shape[1] == 0


def run_shard_local(path_fn: Callable, indexed: bool, *args, value_dim: int):
    """Calls a path on the primitive's operands (and ``value_dim``), on each device's block of tokens and heads under
    a multi-device jit (see sharding.py). Every lowering rule of the primitives goes through it.
    Returns ``(out, lse)``. With a cache split over its rows, gathered_attn_idx runs on each
    device's rows and merges the partial results (cache_sharding.py)."""
    names = operand_names(indexed, len(args))
    layouts = [sharding.LAYOUTS[n] for n in names]
    results = [sharding.LAYOUTS[n] for n in RESULTS]

    def fn(*a):  # the paths take the first six operands by position and the others by name
        named = {n: x for n, x in zip(names[6:], a[6:]) if not _absent_rope(n, x)}
        return tuple(path_fn(*a[:6], **named, value_dim=value_dim))

    if not indexed:
        return tuple(sharding.shard_local(fn, layouts, results)(*args))
    if "kv_scale" in names:  # an FP8 cache split over its rows: its scales (and rope) follow
        rows = [i for i, n in enumerate(names) if n in ("kv", "kv_scale", "kv_rope")]
        run = cache_sharding.shard_local_rows(
            fn, layouts, results, row_operands=rows,
            make_local=cache_sharding.fp8_row_local(split="kv_rope" in names))
        return tuple(run(*args))
    return tuple(cache_sharding.shard_local_rows(fn, layouts, results)(*args))


def _default_rule(indexed: bool):
    def rule(*args, implementation, value_dim=None):
        name = "reference" if implementation is None else implementation
        if name not in _PATHS:
            raise NotImplementedError(
                f"implementation={implementation!r} cannot run on this platform; the Neuron "
                "kernel needs a Trainium device (use 'nki_emulated' to run it on the host)."
            )
        return run_shard_local(path(name, indexed), indexed, *args, value_dim=value_dim)

    return rule


sharding.register_device_aware(gathered_attn_p, gathered_attn_idx_p)
mlir.register_lowering(gathered_attn_p, mlir.lower_fun(_default_rule(False), multiple_results=True))
mlir.register_lowering(
    gathered_attn_idx_p, mlir.lower_fun(_default_rule(True), multiple_results=True)
)


# --- vmap: fold every batch axis into the token axis --------------------------------------------


def _to_front(x, dim, size):
    """Moves the batch axis to 0, or broadcasts an unbatched operand to ``size`` copies."""
    if dim is None:
        return jnp.broadcast_to(x, (size,) + x.shape)
    return jnp.moveaxis(x, dim, 0)


def _fold(x):
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _role(name: str) -> str:
    """An operand's role: 't' indexed by token, 'r' a cache (kv or extra_kv), 'h' per head (the
    sink)."""
    return "r" if name in CACHE_INDEX or name in CACHE_COMPANION else sharding.LAYOUTS[name].split()[0]


def _map_over_batch(prim, args, dims, params):
    """Fallback for a batched sink (one sink vector per batch element): one call per element."""
    batched = [i for i, d in enumerate(dims) if d is not None]

    def one(slices):
        full = list(args)
        for i, s in zip(batched, slices):
            full[i] = s
        return prim.bind(*full, **params)

    out = jax.lax.map(one, [jnp.moveaxis(args[i], dims[i], 0) for i in batched])
    return (out, [0] * len(out)) if prim.multiple_results else (out, 0)


def _offset_per_sequence(idx, rows: int, size: int):
    """Indices into ``size`` stacked caches of ``rows`` rows: element b's valid indices move by
    ``b * rows``; empty slots stay -1 (so -1 never becomes the previous cache's last row)."""
    if size * rows > MAX_ROWS:
        raise ValueError(
            f"vmap over kv: {size} caches of {rows} rows exceed int32 indexing once folded"
        )
    valid = (idx >= 0) & (idx < rows)
    offset = (jnp.arange(size, dtype=jnp.int32) * rows)[:, None, None]
    return jnp.where(valid, idx + offset, jnp.int32(-1))


def make_batcher(prim, indexed: bool, names_of: Callable, always_fold_cache: Callable):
    """The vmap rule shared by this package's primitives: every batch axis folds into tokens.

    ``names_of(params, count)`` names the ``count`` operands (keys of ``sharding.LAYOUTS``).
    Token-indexed operands move their batch axis to the front (unbatched ones are broadcast) and
    fold into the token axis. A batched cache (or one named in ``always_fold_cache(params)``) is
    stacked into one ``[B*R, D]`` cache with per-sequence offsets of its indices; each of the two
    caches folds on its own. A batched sink falls back to one call per batch element. Results come
    back with the batch axis at 0.
    """

    def rule(args, dims, **params):
        names = names_of(params, len(args))
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        roles = [_role(n) for n in names]
        if any(r == "h" and d is not None for r, d in zip(roles, dims)):
            return _map_over_batch(prim, args, dims, params)
        forced = set(always_fold_cache(params))
        forced |= {CACHE_COMPANION[n] for n, d in zip(names, dims)
                   if n in CACHE_COMPANION and d is not None}  # batched scales: per-cache scales
        fold_caches = {n for n, d in zip(names, dims) if n in CACHE_INDEX and (d is not None
                                                                                or n in forced)}
        folds = [r == "t" or n in fold_caches or CACHE_COMPANION.get(n) in fold_caches
                 for n, r in zip(names, roles)]
        args = [_to_front(a, d, size) if f else a for a, d, f in zip(args, dims, folds)]
        for cache in fold_caches if indexed else ():
            k = names.index(CACHE_INDEX[cache])
            args[k] = _offset_per_sequence(args[k], args[names.index(cache)].shape[1], size)
        args = [_fold(a) if f else a for a, f in zip(args, folds)]
        outs = prim.bind(*args, **params)
        single = not prim.multiple_results
        outs = [outs] if single else list(outs)
        outs = [o.reshape((size, o.shape[0] // size) + o.shape[1:]) for o in outs]
        return (outs[0], 0) if single else (outs, [0] * len(outs))

    return rule


for _indexed, _prim in ((False, gathered_attn_p), (True, gathered_attn_idx_p)):
    batching.primitive_batchers[_prim] = make_batcher(
        _prim, _indexed, lambda params, count, _i=_indexed: operand_names(_i, count),
        lambda params: (),
    )
