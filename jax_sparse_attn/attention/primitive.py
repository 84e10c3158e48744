"""The attention op's two JAX primitives, their operands as one named pytree, and the rules that
every platform shares: abstract eval, the default lowering and the vmap rule.

A bind carries an :class:`AttnOperands` flattened, and its static :class:`Layout` (which optional
operands are there) as the ``layout`` parameter; every rule rebuilds the named operands from the
two. The operands, the results ``(out, lse)`` and the parameters are defined in docs/contract.md,
"Operand layout".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir, xla

from .. import cache_sharding, sharding
from ..batching import fold as _fold, map_over_batch as _map_over_batch, to_front as _to_front
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

# Every operand of the two primitives, in bind order; a bind carries those its layout holds.
OPERAND_ORDER = ("q", "g", "kv", "idx", "sink", "bias", "scale", "kv_scale", "kv_rope",
                 "extra_kv", "extra_idx", "extra_bias", "extra_kv_scale", "extra_kv_rope")
# The caches among the operands, and the index operand of each.
CACHE_INDEX = {"kv": "idx", "extra_kv": "extra_idx"}
# Operands whose rows are a cache's rows: stacked along with it when vmap folds it.
CACHE_COMPANION = {"kv_scale": "kv", "kv_rope": "kv",
                   "extra_kv_scale": "extra_kv", "extra_kv_rope": "extra_kv"}
RESULTS = ("out", "lse")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which operands a bind carries: static and hashable (a primitive parameter).

    ``indexed``: the slots are rows of a cache ``kv`` picked by ``idx`` (else pre-gathered,
    ``g``). ``fp8``: ``kv`` is FP8 with ``kv_scale``; ``split``: its rows go on in the 16-bit
    ``kv_rope``. ``extra``: a second cache (``extra_kv``, ``extra_idx``, ``extra_bias``), with
    ``extra_fp8`` and ``extra_split`` as the main cache's.
    """

    indexed: bool = True
    fp8: bool = False
    split: bool = False
    extra: bool = False
    extra_fp8: bool = False
    extra_split: bool = False

    def __post_init__(self):
        needs = (("split", "fp8"), ("extra_fp8", "extra"), ("extra_split", "extra_fp8"))
        for flag, required in needs:
            if getattr(self, flag) and not getattr(self, required):
                raise ValueError(f"Layout: {flag} needs {required} ({self})")
        if not self.indexed and (self.fp8 or self.extra):
            raise ValueError(f"Layout: pre-gathered slots (indexed=False) take no cache ({self})")

    @property
    def names(self) -> tuple[str, ...]:
        """The operand names of a bind of this layout, in bind order."""
        present = {"q", "sink", "bias", "scale"}
        present |= {"kv", "idx"} if self.indexed else {"g"}
        present |= {"kv_scale"} if self.fp8 else set()
        present |= {"kv_rope"} if self.split else set()
        present |= {"extra_kv", "extra_idx", "extra_bias"} if self.extra else set()
        present |= {"extra_kv_scale"} if self.extra_fp8 else set()
        present |= {"extra_kv_rope"} if self.extra_split else set()
        return tuple(n for n in OPERAND_ORDER if n in present)

    def unflatten(self, leaves) -> "AttnOperands":
        """The named operands of a bind's flat operands (or of anything laid out as they are)."""
        names = self.names
        if len(leaves) != len(names):
            raise ValueError(f"{self} has {len(names)} operands {names}; got {len(leaves)}")
        return AttnOperands(**dict(zip(names, leaves)))


PREGATHERED = Layout(indexed=False)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class AttnOperands:
    """The normalised operands of one attention bind (shapes in docs/contract.md, "Operand
    layout"); an absent part is None. A pytree whose static part is its :class:`Layout`."""

    q: Any
    sink: Any
    bias: Any
    scale: Any
    g: Optional[Any] = None
    kv: Optional[Any] = None
    idx: Optional[Any] = None
    kv_scale: Optional[Any] = None
    kv_rope: Optional[Any] = None
    extra_kv: Optional[Any] = None
    extra_idx: Optional[Any] = None
    extra_bias: Optional[Any] = None
    extra_kv_scale: Optional[Any] = None
    extra_kv_rope: Optional[Any] = None

    @property
    def layout(self) -> Layout:
        return Layout(indexed=self.kv is not None, fp8=self.kv_scale is not None,
                      split=self.kv_rope is not None, extra=self.extra_kv is not None,
                      extra_fp8=self.extra_kv_scale is not None,
                      extra_split=self.extra_kv_rope is not None)

    def named(self) -> dict:
        """The present operands by name (every path takes them as keywords)."""
        return {n: getattr(self, n) for n in self.layout.names}

    def replace(self, **changes) -> "AttnOperands":
        return dataclasses.replace(self, **changes)

    def tree_flatten(self):
        layout = self.layout
        return tuple(getattr(self, n) for n in layout.names), layout

    @classmethod
    def tree_unflatten(cls, layout, leaves):
        return layout.unflatten(tuple(leaves))


def bind(operands: AttnOperands, *, implementation, value_dim: int):
    """Binds the primitive of ``operands``' layout; returns ``(out, lse)``."""
    leaves, layout = operands.tree_flatten()
    prim = gathered_attn_idx_p if layout.indexed else gathered_attn_p
    return prim.bind(*leaves, layout=layout, implementation=implementation, value_dim=value_dim)


# Host-runnable data paths by implementation name: (pre-gathered, indexed), each taking the
# operands by name and the keyword ``value_dim`` and returning ``(out, lse)``. The Neuron package
# registers "nki_emulated".
_PATHS: dict[str, tuple[Callable, Callable]] = {
    "reference": (reference.gathered_attn_reference, reference.gathered_attn_idx_reference),
}


def register_path(name: str, gathered_fn: Callable, gathered_idx_fn: Callable) -> None:
    """Makes ``implementation=name`` lower through the given jnp-traceable functions."""
    _PATHS[name] = (gathered_fn, gathered_idx_fn)


def path(name: str, indexed: bool) -> Callable:
    """The jnp-traceable function that ``implementation=name`` lowers to."""
    return _PATHS[name][1 if indexed else 0]


# --- abstract evaluation ------------------------------------------------------------------------


def _abstract_eval(*avals, layout, implementation, value_dim):
    del implementation
    q = layout.unflatten(avals).q
    # Keeps q's token/head sharding in the type under explicit mesh axes (see sharding.py).
    return [
        sharding.result_aval(q, q.shape[:2] + (value_dim,), q.dtype, sharding.LAYOUTS["out"]),
        sharding.result_aval(q, q.shape[:2], jnp.float32, sharding.LAYOUTS["lse"]),
    ]


for _prim in (gathered_attn_p, gathered_attn_idx_p):
    _prim.multiple_results = True
    _prim.def_abstract_eval(_abstract_eval)
    _prim.def_impl(functools.partial(xla.apply_primitive, _prim))


# --- default lowering (every platform) ----------------------------------------------------------


def run_shard_local(path_fn: Callable, operands: AttnOperands, *, value_dim: int):
    """Calls a path on the operands, on each device's block of tokens and heads (sharding.py);
    every lowering rule of the primitives goes through it. Returns ``(out, lse)``. A cache split
    over its rows runs on each device's rows, merged by lse (cache_sharding.py)."""
    layout = operands.layout
    names = layout.names
    layouts = [sharding.LAYOUTS[n] for n in names]
    results = [sharding.LAYOUTS[n] for n in RESULTS]

    def fn(*leaves):
        return tuple(path_fn(**layout.unflatten(leaves).named(), value_dim=value_dim))

    leaves = operands.tree_flatten()[0]
    if not layout.indexed:
        return tuple(sharding.shard_local(fn, layouts, results)(*leaves))
    # An FP8 cache's scales (and rope columns) are split along with its rows.
    rows = [names.index(n) for n in ("kv", "kv_scale", "kv_rope") if n in names]
    make_local = (cache_sharding.fp8_row_local if layout.fp8 else cache_sharding.row_local)(layout)
    run = cache_sharding.shard_local_rows(fn, layouts, results, row_operands=rows,
                                          make_local=make_local)
    return tuple(run(*leaves))


def _default_rule(*args, layout, implementation, value_dim):
    name = "reference" if implementation is None else implementation
    if name not in _PATHS:
        raise NotImplementedError(
            f"implementation={implementation!r} cannot run on this platform; the Neuron "
            "kernel needs a Trainium device (use 'nki_emulated' to run it on the host)."
        )
    return run_shard_local(path(name, layout.indexed), layout.unflatten(args),
                           value_dim=value_dim)


sharding.register_device_aware(gathered_attn_p, gathered_attn_idx_p)
for _prim in (gathered_attn_p, gathered_attn_idx_p):
    mlir.register_lowering(_prim, mlir.lower_fun(_default_rule, multiple_results=True))


# --- vmap: fold every batch axis into the token axis --------------------------------------------


def _role(name: str) -> str:
    """An operand's role: 't' indexed by token, 'r' a cache's rows, 'h' per head (the sink)."""
    if name in CACHE_INDEX or name in CACHE_COMPANION:
        return "r"
    return sharding.LAYOUTS[name].split()[0]


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


def make_batcher(prim, names_of: Callable, always_fold_cache: Callable):
    """The vmap rule shared by this package's attention primitives: every batch axis folds into
    tokens.

    ``names_of(params)`` names the bind's operands (keys of ``sharding.LAYOUTS``). Token-indexed
    operands move their batch axis to the front (unbatched ones are broadcast) and fold into the
    token axis. A batched cache (or one named in ``always_fold_cache(params)``) is stacked into
    one ``[B*R, D]`` cache with per-sequence offsets of its indices; each of the two caches folds
    on its own. A batched sink falls back to one call per batch element. Results come back with
    the batch axis at 0.
    """

    def rule(args, dims, **params):
        names = names_of(params)  # a tangent's name repeats its primal's
        batched = {n for n, d in zip(names, dims) if d is not None}
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        if "sink" in batched:
            return _map_over_batch(prim, args, dims, params)
        forced = set(always_fold_cache(params))
        # Batched scales or rope columns: one set per sequence, so one cache per sequence too.
        forced |= {CACHE_COMPANION[n] for n in batched if n in CACHE_COMPANION}
        fold_caches = {c for c in CACHE_INDEX if c in names and (c in batched or c in forced)}
        folds = [_role(n) == "t" or n in fold_caches or CACHE_COMPANION.get(n) in fold_caches
                 for n in names]
        args = [_to_front(a, d, size) if f else a for a, d, f in zip(args, dims, folds)]
        for cache in fold_caches:
            k = names.index(CACHE_INDEX[cache])
            args[k] = _offset_per_sequence(args[k], args[names.index(cache)].shape[1], size)
        args = [_fold(a) if f else a for a, f in zip(args, folds)]
        outs = prim.bind(*args, **params)
        single = not prim.multiple_results
        outs = [outs] if single else list(outs)
        outs = [o.reshape((size, o.shape[0] // size) + o.shape[1:]) for o in outs]
        return (outs[0], 0) if single else (outs, [0] * len(outs))

    return rule


for _prim in (gathered_attn_p, gathered_attn_idx_p):
    batching.primitive_batchers[_prim] = make_batcher(
        _prim, lambda params: params["layout"].names, lambda params: ())
