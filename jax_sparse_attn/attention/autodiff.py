"""Differentiation rules of the attention primitives (``jax.grad``, ``jax.vjp``, ``jax.jvp``,
``jacfwd``, ``jacrev``).

The forward's JVP binds the forward itself (so the chosen implementation runs, the NKI kernel on
Neuron) and a linear tangent primitive, whose transpose is a third primitive, the cotangent (the
backward pass). Both are jnp formulas on every platform, chunked over tokens and run
shard-locally (sharding.py); they recompute the probabilities from the operands, which are the
only residuals. The formulas, their finiteness bound and which operands get no gradient:
docs/contract.md, "Gradient formulas". Derivatives of order two raise ``NotImplementedError``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir, xla

from . import primitive, reference
from .. import sharding
from ..cpu_products import cpu_form

# Operands that have a gradient, and the layout of each cotangent the backward primitive returns.
# The sink's cotangent is returned per token and summed over tokens outside the primitive, so
# that batching and token sharding stay trivial.
DIFFERENTIABLE = ("q", "g", "kv", "sink", "bias", "scale", "extra_kv", "extra_bias")
COTANGENT_LAYOUTS = {
    "q": sharding.LAYOUTS["q"],
    "g": sharding.LAYOUTS["g"],
    "kv": sharding.LAYOUTS["kv"],
    "extra_kv": sharding.LAYOUTS["extra_kv"],
    "extra_bias": sharding.LAYOUTS["extra_bias"],
    "sink": sharding.LAYOUTS["sink_per_token"],
    "bias": sharding.LAYOUTS["bias"],
    "scale": sharding.LAYOUTS["scale"],
}


# f32 formulas in full f32 on every platform (GPUs would otherwise use TF32 for f32 products).
_einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


# --- formulas -----------------------------------------------------------------------------------


def _softmax_parts(q, x, valid, sink, bias, scale, extra=None, x_first=False):
    """Recomputes the forward's probabilities for a chunk of tokens, in f32.

    Args: q ``[c, H, D]`` in the input dtype, x ``[c, K, D]`` f32 slot rows (the input dtype's
    values, exactly), valid ``[c, K]`` bool, sink ``[H]``, bias ``[c, K]``, scale ``[c]``; ``extra``
    ``[c, M, D]`` f32 rows whose products with the slots ``extra . x_j`` are wanted as well (the
    cotangent's ``u``): they share one matrix product with the logits, which reads the slot rows
    once. The products of 16-bit values are exact in f32, so the logits are those of the
    forward's product up to the order of the sum. ``x_first``: the product's form
    (``reference.slot_products``).
    Returns: z ``[c, H, K]`` (q . x), p ``[c, H, K]``, p_sink ``[c, H]``, all f32, and the
    ``[c, M, K]`` products of ``extra`` (None without it).
    """
    H = q.shape[1]
    q_scaled, up = reference.prescale_queries(q)
    rows = q_scaled.astype(jnp.float32)
    if extra is not None:
        rows = jnp.concatenate([rows, extra], axis=1)
    zu = reference.slot_products(x, rows, x_first)
    z = reference.scale_up(zu[:, :H], up)
    s = reference.saturated_logits(z, valid[:, None, :], bias[:, None, :], scale[:, None, None])
    sink_wins = sink == jnp.inf  # that head's output is exactly 0
    sink_finite = jnp.where(sink_wins, 0.0, sink)  # -inf stays: exp(-inf - m) = 0
    m = jnp.maximum(jnp.max(s, axis=-1), sink_finite[None, :])
    e = jnp.where(valid[:, None, :], jnp.exp(s - m[..., None]), 0.0)
    e_sink = jnp.exp(sink_finite[None, :] - m)
    den = jnp.sum(e, axis=-1) + e_sink
    den = jnp.where(den > 0, den, 1.0)  # 0 only when there is nothing to normalise
    live = jnp.any(valid, axis=-1)[:, None] & ~sink_wins[None, :]
    p = jnp.where(live[..., None], e / den[..., None], 0.0)
    p_sink = jnp.where(live, e_sink / den, 0.0)
    return z, p, p_sink, (None if extra is None else zu[:, H:])


def _lse_sink_weight(valid, sink, p_sink, live):
    """d lse / d sink ``[c, H]``: ``p_sink`` where the token has a valid slot; where it has none,
    the lse is the sink itself (1 for a finite sink, 0 for +-inf). ``live``: non-padding tokens."""
    alone = (~jnp.any(valid, axis=-1) & live)[:, None] & jnp.isfinite(sink)[None, :]
    return jnp.where(alone, 1.0, p_sink)


def _slots(indexed, src, idx, bias, live):
    """Slot rows (in src's dtype) and validity for a chunk; ``live`` is False for padding tokens.

    Empty, masked and padding slots never read a row: their rows are zeros (a gather that fills
    out-of-range rows, or a select on the pre-gathered slots), so whatever the unselected rows
    hold cannot reach a gradient. ``rows`` is ``R`` (out of range) for such slots.
    """
    valid = (bias != -jnp.inf) & live[:, None]
    if not indexed:
        return _zero_unselected(src, valid), valid, None
    valid = valid & (idx >= 0) & (idx < src.shape[0])
    rows = jnp.where(valid, idx, src.shape[0])
    return _gather_slots(src, rows), valid, rows


def _gather_slots(src, rows):
    """``src[rows]`` with zeros for out-of-range rows (never reads an unselected row).

    The rows move as raw bits (``reference.gather_bits``): XLA:CPU would otherwise widen a 16-bit
    cache to f32 as a whole before gathering, on every call. A cache of 0 rows (one of two caches
    may be) gives zeros.
    """
    if src.shape[0] == 0:
        return jnp.zeros(rows.shape + src.shape[1:], src.dtype)
    return reference.gather_bits(src, rows)


def _zero_unselected(g, valid):
    """Pre-gathered slots ``[c, K, D]`` with the rows of invalid slots set to zero."""
    return jnp.where(valid[..., None], g, jnp.zeros((), g.dtype))


def _dequantised(primal, prefix, x, rows, dtype):
    """The slots ``x`` of cache ``prefix + "kv"`` as its logical rows: for an FP8 cache (with
    ``kv_scale``), dequantised to ``dtype`` (``reference.dequantise_slots``) with the 16-bit
    ``kv_rope`` columns after them; a 16-bit cache's slots as they are."""
    if prefix + "kv_scale" not in primal:
        return x
    if primal[prefix + "kv"].shape[0] == 0:  # an empty cache: no slot reads (nor gathers) a row
        return jnp.zeros(rows.shape + (primal["q"].shape[-1],), dtype)
    scales = primal[prefix + "kv_scale"].at[rows].get(mode="fill", fill_value=0)
    x = reference.from_bits(reference.dequantise_slots(reference.to_bits(x), scales, x.dtype,
                                                       dtype), dtype)
    rope = primal.get(prefix + "kv_rope")
    if rope is not None:  # a split row: the 16-bit columns after the FP8 ones
        x = jnp.concatenate([x, _gather_slots(primal[prefix + "kv_rope"].astype(dtype), rows)], -1)
    return x


def _recompute(indexed, primal, live, extra=None, x_first=False):
    """The forward's intermediates for a chunk (f32): q, slot rows x, validity, gather rows,
    scale, and ``_softmax_parts``'s z, p, p_sink and products of ``extra``. ``primal``: the
    operands by name."""
    q = primal["q"]
    x, valid, rows = _slots(indexed, primal["kv" if indexed else "g"], primal.get("idx"),
                            primal["bias"], live)
    bias = primal["bias"]
    x = _dequantised(primal, "", x, rows, q.dtype)
    if "extra_kv" in primal:
        # The second cache's slots after the main ones: one softmax over both (the gather rows
        # become a pair, main then extra).
        x2, valid2, rows2 = _slots(True, primal["extra_kv"], primal["extra_idx"],
                                   primal["extra_bias"], live)
        x2 = _dequantised(primal, "extra_", x2, rows2, q.dtype)
        x = jnp.concatenate([x, x2.astype(x.dtype)], axis=1)
        valid = jnp.concatenate([valid, valid2], axis=1)
        bias = jnp.concatenate([bias, primal["extra_bias"]], axis=1)
        rows = (rows, rows2)
    x = x.astype(q.dtype).astype(jnp.float32)
    scale = primal["scale"]
    z, p, p_sink, products = _softmax_parts(q, x, valid, primal["sink"], bias, scale,
                                            extra, x_first)
    return q.astype(jnp.float32), x, valid, rows, scale, z, p, p_sink, products


def _tangent_chunk(indexed, active, primal, tangent, live, x_first=False, value_dim=None):
    """Tangents of the output ``[c, H, value_dim]`` and of the lse ``[c, H]`` (f32) for a chunk.
    ``primal``/``tangent``: dicts by name."""
    q, x, valid, rows, scale, z, p, p_sink, _ = _recompute(indexed, primal, live, None, x_first)
    v = x[..., :value_dim]  # the values: the first value_dim columns of each slot row
    o = _einsum("thk,tkd->thd", p, v)

    src_name = "kv" if indexed else "g"
    dx = None
    two = "extra_kv" in primal
    if src_name in active or "extra_kv" in active:
        if two:  # the tangent of each cache at its own slots (zeros for one that has none)
            dx = jnp.concatenate([
                _gather_slots(tangent[n], r).astype(jnp.float32) if n in active
                else jnp.zeros(r.shape + x.shape[-1:], jnp.float32)
                for n, r in zip(("kv", "extra_kv"), rows)], axis=1)
        else:
            dsrc = tangent[src_name]
            dx = (_gather_slots(dsrc, rows) if indexed else _zero_unselected(dsrc, valid))
        dx = dx.astype(jnp.float32)
    ds = jnp.zeros_like(z)
    if "q" in active:
        ds = ds + _einsum("thd,tkd->thk", tangent["q"].astype(jnp.float32), x)
    if dx is not None:
        ds = ds + _einsum("thd,tkd->thk", q, dx)
    ds = ds * scale[:, None, None]
    if "scale" in active:
        ds = ds + tangent["scale"][:, None, None] * z
    if "bias" in active or "extra_bias" in active:
        if two:
            db = jnp.concatenate([
                tangent[n] if n in active else jnp.zeros(primal[n].shape, jnp.float32)
                for n in ("bias", "extra_bias")], axis=1)
        else:
            db = tangent["bias"]
        ds = ds + jnp.where(valid, db, 0.0)[:, None, :]
    pds = p * ds
    weight = jnp.sum(pds, axis=-1)
    dlse = weight
    if "sink" in active:
        weight = weight + p_sink * tangent["sink"][None, :]
        sink_weight = _lse_sink_weight(valid, primal["sink"], p_sink, live)
        dlse = dlse + sink_weight * tangent["sink"][None, :]
    do = _einsum("thk,tkd->thd", pds, v) - weight[..., None] * o
    if dx is not None:
        do = do + _einsum("thk,tkd->thd", p, dx[..., :value_dim])
    return do, dlse


def _cotangent_chunk(indexed, wanted, primal, ct, live, x_first=False):
    """Cotangents for a chunk: dict by name; ``kv`` is the chunk's ``(rows, dx)`` scatter input.
    ``ct``: the cotangents of the output ``[c, H, value_dim]`` and of the lse ``[c, H]``."""
    ct, ct_lse = ct[0].astype(jnp.float32), ct[1].astype(jnp.float32)
    D = primal["q"].shape[-1]
    if ct.shape[-1] < D:
        # value_dim < D: the columns beyond value_dim carry no value, so their output cotangent is
        # 0; padded, u = do . x_j is do . v_j and dx_j's term p_j do stays 0 there.
        ct = jnp.pad(ct, [(0, 0), (0, 0), (0, D - ct.shape[-1])])
    q, x, valid, rows, scale, z, p, p_sink, u = _recompute(indexed, primal, live, ct, x_first)
    # delta = do . o = sum_j p_j (do . x_j): from u, without recomputing o (one product fewer)
    delta = jnp.sum(p * u, axis=-1)
    dS = p * (u - delta[..., None] + ct_lse[..., None])
    out = {}
    if "q" in wanted:
        out["q"] = scale[:, None, None] * _einsum("thk,tkd->thd", dS, x)
    two = "extra_kv" in primal
    K = primal["bias"].shape[1]  # the main cache's slots (the extra ones follow)
    if "g" in wanted or "kv" in wanted or "extra_kv" in wanted:
        # sum_h (p do + c dS q) as one product over 2H rows: [p | c dS]^T [do | q]
        weights = jnp.concatenate([p, scale[:, None, None] * dS], axis=1)
        dx = _einsum("thk,thd->tkd", weights, jnp.concatenate([ct, q], axis=1))
        if two:
            # Each cache's share of the slots scatters into that cache.
            out["kv"] = (rows[0], dx[:, :K])
            out["extra_kv"] = (rows[1], dx[:, K:])
        elif indexed:
            # Empty slots are out of range (rows == R) and dropped by the scatter.
            out["kv"] = (rows, dx)
        else:
            out["g"] = dx
    if "sink" in wanted:
        sink_weight = _lse_sink_weight(valid, primal["sink"], p_sink, live)
        out["sink"] = -p_sink * delta + sink_weight * ct_lse
    if "bias" in wanted or "extra_bias" in wanted:
        dbias = jnp.sum(dS, axis=1)
        out["bias"], out["extra_bias"] = dbias[:, :K], dbias[:, K:]
    if "scale" in wanted:
        out["scale"] = jnp.sum(dS * z, axis=(1, 2))
    return out


# --- chunking over tokens -----------------------------------------------------------------------


def _chunk_size(q, num_slots, budget=None):
    """Tokens per chunk of the backward: its working set near ``budget`` bytes (default: the CPU's
    ``reference.CHUNK_BYTES``)."""
    T, H, D = q.shape
    # f32 slot rows and their tangent/cotangent, four [H, K] f32 maps, four [H, D] f32 rows.
    per_token = 2 * num_slots * D * 4 + 4 * H * num_slots * 4 + 4 * H * D * 4
    budget = reference.CHUNK_BYTES if budget is None else budget
    return int(max(1, min(T, budget // max(per_token, 1))))


def _over_chunks_per_platform(step, token_arrays, q, num_slots, carry):
    """``_over_token_chunks`` with the CPU's chunk and product form when lowering for CPU, and on
    GPU / TPU a chunk that follows the device's memory (``reference.per_platform``).
    ``step(x_first)`` gives the loop's step for a product form (``reference.slot_products``)."""
    cpu_chunk = _chunk_size(q, num_slots)
    accelerator_chunk = _chunk_size(q, num_slots, reference.accelerator_chunk_bytes())
    # The backward's products are f32 in every form (the slots are widened chunk by chunk in
    # _recompute); only the dot products' layout follows the CPU's form.
    cpu_step = step(cpu_form().x_first)
    return reference.per_platform(
        lambda a, c: _over_token_chunks(cpu_step, a, cpu_chunk, c),
        lambda a, c: _over_token_chunks(step(False), a, accelerator_chunk, c),
        token_arrays, carry,
    )


def _over_token_chunks(step, token_arrays, chunk: int, carry):
    """Runs ``step(carry, chunk_arrays, live) -> (carry, outputs)`` over chunks of tokens.

    ``token_arrays`` is a pytree of arrays with a leading token axis. The token axis is padded to
    a multiple of ``chunk``; padding tokens have ``live`` False, so they contribute nothing, and
    their outputs are cut off again.
    """
    T = jax.tree_util.tree_leaves(token_arrays)[0].shape[0]
    if chunk >= T:
        return step(carry, token_arrays, jnp.ones((T,), bool))
    n = -(-T // chunk)
    pad = n * chunk - T

    def split(a):
        a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape((n, chunk) + a.shape[1:])

    # 16-bit floats cross the loop as raw bits: XLA:CPU would otherwise widen the whole array to
    # f32 on every step to take one chunk's slice (reference._map_tokens does the same).
    dtypes = jax.tree_util.tree_map(lambda a: a.dtype, token_arrays)
    bits = jax.tree_util.tree_map(_to_bits_if_16, token_arrays)

    def bits_step(c, chunk_bits, live):
        chunk_arrays = jax.tree_util.tree_map(_from_bits_if_16, chunk_bits, dtypes)
        return step(c, chunk_arrays, live)

    xs = (jax.tree_util.tree_map(split, bits), split(jnp.ones((T,), bool)))
    carry, outs = jax.lax.scan(lambda c, a: bits_step(c, *a), carry, xs)
    outs = jax.tree_util.tree_map(lambda a: a.reshape((n * chunk,) + a.shape[2:])[:T], outs)
    return carry, outs


def _to_bits_if_16(a):
    """A 16-bit float array as its raw bits (``uint16``); anything else unchanged."""
    if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize == 2:
        return reference.to_bits(a)
    return a


def _from_bits_if_16(a, dtype):
    """Inverse of ``_to_bits_if_16``."""
    return reference.from_bits(a, dtype) if a.dtype != dtype else a


def _by_role(named: dict):
    """Splits operands into those with a token axis (chunked) and those shared by all tokens."""
    token = {n: v for n, v in named.items() if sharding.LAYOUTS[n].startswith("t")}
    shared = {n: v for n, v in named.items() if n not in token}
    return token, shared


def _is_empty(primal) -> bool:
    T, H, _ = primal["q"].shape
    K = _num_slots(primal)
    rows = sum(primal[n].shape[0] for n in ("kv", "extra_kv") if n in primal)
    return T == 0 or H == 0 or K == 0 or ("kv" in primal and rows == 0)


def _num_slots(primal) -> int:
    """Slots per token: the main cache's, plus the second cache's when there is one."""
    return primal["bias"].shape[1] + (primal["extra_bias"].shape[1] if "extra_bias" in primal
                                      else 0)


def _tangent(layout, active, value_dim, *operands):
    """Tangents of the output (q's dtype) and of the lse (f32). Operands: the primal operands,
    then the active tangents."""
    indexed, names = layout.indexed, layout.names
    primal = dict(zip(names, operands[: len(names)]))
    tangent = dict(zip(active, operands[len(names):]))
    q = primal["q"]
    if _is_empty(primal):
        return jnp.zeros(q.shape[:2] + (value_dim,), q.dtype), jnp.zeros(q.shape[:2], jnp.float32)
    primal_token, primal_shared = _by_role(primal)
    tangent_token, tangent_shared = _by_role(tangent)

    def step(x_first):
        def run(carry, chunk, live):
            p, t = chunk
            do = _tangent_chunk(indexed, active, {**p, **primal_shared},
                                {**t, **tangent_shared}, live, x_first, value_dim)
            return carry, do

        return run

    num_slots = _num_slots(primal)
    _, (do, dlse) = _over_chunks_per_platform(step, (primal_token, tangent_token), q, num_slots,
                                              ())
    return do.astype(q.dtype), dlse


def _cotangent(layout, wanted, *operands):
    """Cotangents of the ``wanted`` operands, all f32. Operands: the primal operands, then the
    cotangents of the output and of the lse. The sink's is per token ``[T, H]``; the cache's is
    summed into ``[R, D]`` (each cache's into its own rows)."""
    indexed, names = layout.indexed, layout.names
    primal = dict(zip(names, operands[: len(names)]))
    ct = tuple(operands[len(names):])
    if _is_empty(primal):
        return tuple(jnp.zeros(_cotangent_shape(layout, n, operands)[0]) for n in wanted)
    primal_token, primal_shared = _by_role(primal)
    caches = tuple(n for n in ("kv", "extra_kv") if n in wanted)

    def step(x_first):
        def run(sums, chunk, live):
            p, ct_chunk = chunk
            out = _cotangent_chunk(indexed, wanted, {**p, **primal_shared}, ct_chunk, live,
                                   x_first)
            sums = list(sums)
            for i, n in enumerate(caches):
                rows, dx = out.pop(n)
                sums[i] = sums[i].at[rows].add(dx, mode="drop")
            for n in ("kv", "extra_kv", "bias", "extra_bias"):
                if n not in wanted:
                    out.pop(n, None)
            return tuple(sums), out

        return run

    sums = tuple(jnp.zeros(primal[n].shape, jnp.float32) for n in caches)
    sums, results = _over_chunks_per_platform(
        step, (primal_token, ct), primal["q"], _num_slots(primal), sums
    )
    results = dict(results, **dict(zip(caches, sums)))
    return tuple(results[n] for n in wanted)


# --- the tangent and cotangent primitives -------------------------------------------------------

tangent_p = {
    False: Primitive("gathered_attn_tangent"),
    True: Primitive("gathered_attn_idx_tangent"),
}
cotangent_p = {
    False: Primitive("gathered_attn_cotangent"),
    True: Primitive("gathered_attn_idx_cotangent"),
}
for _p in (*tangent_p.values(), *cotangent_p.values()):
    _p.multiple_results = True
sharding.register_device_aware(*tangent_p.values(), *cotangent_p.values())


def _tangent_abstract_eval(*avals, layout, active, value_dim):
    q = avals[0]
    return [
        sharding.result_aval(q, q.shape[:2] + (value_dim,), q.dtype, sharding.LAYOUTS["out"]),
        sharding.result_aval(q, q.shape[:2], jnp.float32, sharding.LAYOUTS["lse"]),
    ]


def _cotangent_shape(layout, name, operands):
    """Shape and dtype of the cotangent of operand ``name`` (operands or their avals)."""
    primal = dict(zip(layout.names, operands))
    if name == "sink":
        return primal["q"].shape[:2], jnp.float32  # per token: [T, H]
    return primal[name].shape, primal[name].dtype


def _cotangent_abstract_eval(*avals, layout, wanted, value_dim):
    q = avals[0]
    return [sharding.result_aval(q, *_cotangent_shape(layout, n, avals), COTANGENT_LAYOUTS[n])
            for n in wanted]


def _tangent_lowering(*operands, layout, active, value_dim):
    layouts = [sharding.LAYOUTS[n] for n in layout.names + active]
    fn = functools.partial(_tangent, layout, active, value_dim)
    results = [sharding.LAYOUTS[n] for n in primitive.RESULTS]
    return sharding.shard_local(fn, layouts, results)(*operands)


def _cotangent_lowering(*operands, layout, wanted, value_dim):
    del value_dim  # the output cotangent's own width says it
    layouts = [sharding.LAYOUTS[n] for n in layout.names + primitive.RESULTS]
    fn = functools.partial(_cotangent, layout, wanted)
    results = [COTANGENT_LAYOUTS[n] for n in wanted]
    # Partial sums over devices are added in f32; the cast to the operand's dtype comes last.
    cts = sharding.shard_local(fn, layouts, results)(*operands)
    return [ct.astype(_cotangent_shape(layout, n, operands)[1]) for n, ct in zip(wanted, cts)]


for _indexed in (False, True):
    for _p in (tangent_p[_indexed], cotangent_p[_indexed]):
        _p.def_impl(functools.partial(xla.apply_primitive, _p))
    tangent_p[_indexed].def_abstract_eval(_tangent_abstract_eval)
    cotangent_p[_indexed].def_abstract_eval(_cotangent_abstract_eval)
    mlir.register_lowering(tangent_p[_indexed],
                           mlir.lower_fun(_tangent_lowering, multiple_results=True))
    mlir.register_lowering(cotangent_p[_indexed],
                           mlir.lower_fun(_cotangent_lowering, multiple_results=True))


# --- vmap: fold batch axes into tokens, as the forward does -------------------------------------


for _indexed in (False, True):
    batching.primitive_batchers[tangent_p[_indexed]] = primitive.make_batcher(
        tangent_p[_indexed], lambda params: params["layout"].names + params["active"],
        lambda params: (),
    )
    batching.primitive_batchers[cotangent_p[_indexed]] = primitive.make_batcher(
        cotangent_p[_indexed], lambda params: params["layout"].names + primitive.RESULTS,
        # Per-example cache gradients need one cache per batch element.
        lambda params: tuple(n for n in ("kv", "extra_kv") if n in params["wanted"]),
    )


# --- JVP of the forward primitives, transpose of the tangent ------------------------------------


def _forward_jvp(prim):
    def rule(primals, tangents, *, layout, implementation, value_dim):
        names = layout.names
        outs = prim.bind(*primals, layout=layout, implementation=implementation,
                         value_dim=value_dim)
        active = tuple(
            n for n, t in zip(names, tangents) if n in DIFFERENTIABLE and type(t) is not ad.Zero
        )
        if not active:
            return outs, [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in outs]
        by_name = dict(zip(names, tangents))
        tangent_outs = tangent_p[layout.indexed].bind(
            *primals, *(by_name[n] for n in active), layout=layout, active=active,
            value_dim=value_dim,
        )
        return outs, tangent_outs

    return rule


def _tangent_transpose(ct, *args, layout, active, value_dim):
    count = len(layout.names)
    primals, tangents = args[:count], args[count:]
    if any(ad.is_undefined_primal(p) for p in primals):
        raise NotImplementedError(
            "gathered_attn: the tangent is linear in the tangents only; transposing it with "
            "respect to a primal operand (a derivative of order two) is not supported"
        )
    undefined = [ad.is_undefined_primal(t) for t in tangents]
    wanted = tuple(n for n, u in zip(active, undefined) if u)
    if all(type(c) is ad.Zero for c in ct) or not wanted:
        zeros = [ad.Zero(t.aval) if u else None for t, u in zip(tangents, undefined)]
        return [None] * len(primals) + zeros
    # ct = (output's, lse's); a missing one (only out or only lse used) is zeros.
    ct = [ad.instantiate_zeros(c) for c in ct]
    cts = dict(zip(wanted, cotangent_p[layout.indexed].bind(*primals, *ct, layout=layout,
                                                            wanted=wanted, value_dim=value_dim)))
    if "sink" in cts:
        cts["sink"] = jnp.sum(cts["sink"], axis=0)
    by_name = dict(zip(active, tangents))
    for n in cts:  # e.g. a cache split over its rows on an explicit axis: same type back
        cts[n] = sharding.like_aval(cts[n], by_name[n].aval)
    return [None] * len(primals) + [cts[n] if u else None for n, u in zip(active, undefined)]


def _no_higher_order(name):
    def rule(primals, tangents, **params):
        raise NotImplementedError(
            f"{name}: derivatives of order two and higher (e.g. jax.hessian, grad of grad) are "
            "not implemented for gathered_attn / gathered_attn_idx"
        )

    return rule


for _indexed in (False, True):
    _fwd = primitive.gathered_attn_idx_p if _indexed else primitive.gathered_attn_p
    ad.primitive_jvps[_fwd] = _forward_jvp(_fwd)
    ad.primitive_transposes[tangent_p[_indexed]] = _tangent_transpose
    ad.primitive_jvps[tangent_p[_indexed]] = _no_higher_order(tangent_p[_indexed].name)
    ad.primitive_jvps[cotangent_p[_indexed]] = _no_higher_order(cotangent_p[_indexed].name)
