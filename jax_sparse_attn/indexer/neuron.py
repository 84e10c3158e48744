"""The indexer's Neuron path: pack (jnp) -> the NKI kernel (:mod:`.kernel`) -> unpack.

:func:`indexer_topk_neuron` takes the primitive's operands (docs/indexer.md): ``emulated=True``
runs the kernel source under the project's NKI emulator on the host (``jax.pure_callback``, as
``jax_sparse_attn/attention/neuron.py`` does for the attention op); ``emulated=False`` calls it
through ``nki.jit`` (NKI's own ``nki_call``) on a Neuron device. docs/indexer-kernel.md describes
the packing, the kernel and its cost.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import kernel as _kernel

# Row numbers travel through the kernel as fp32 (its row ids and the n_valid bound): exact below
# 2**24 rows.
MAX_KERNEL_ROWS = 2**24


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def valid_rows(positions, rows: int, compress_ratio: int):
    """``[T]`` int32: how many rows each token may select (docs/indexer.md, "Validity"):
    ``min(R, floor((position + 1) / ratio))``, 0 for a negative position (written without
    ``position + 1``, which would overflow at INT32_MAX)."""
    pos = positions.astype(jnp.int32)
    ratio = jnp.int32(compress_ratio)
    whole = pos // ratio  # complete blocks before the position's own
    # The position's own block counts when it is complete; capped at R before adding, so that
    # INT32_MAX // 1 + 1 cannot wrap.
    n = jnp.where(whole >= rows, rows, whole + (pos % ratio == ratio - 1).astype(jnp.int32))
    return jnp.where(pos < 0, 0, jnp.minimum(n, rows)).astype(jnp.int32)


def _pack(plan, shares: int, programs: int, q, weights, keys, key_scale, n_valid):
    """The first kernel's operands (kernel module docstring, "Interface"); the tiles padded to a
    multiple of the merge kernel's ``programs``."""
    T, Hi, Di = q.shape
    tt = plan.tile_tokens
    tiles = _round_up(-(-T // tt), programs)
    tokens = tiles * tt
    pad_t = tokens - T
    q_p = jnp.pad(q, ((0, pad_t), (0, 0), (0, 0)))
    q_t = q_p.reshape(tiles, tt, Hi, Di).transpose(0, 3, 1, 2).reshape(tiles, Di, tt * Hi)
    w = jnp.pad(weights.astype(jnp.float32), ((0, pad_t), (0, 0)))
    w_t = w.reshape(tiles, tt, Hi).transpose(0, 2, 1)
    R = keys.shape[0]
    pad_r = plan.rows_padded - R
    keys_t = jnp.pad(keys, ((0, pad_r), (0, 0))).T.reshape(Di, plan.chunks, plan.chunk)
    scale = jnp.ones((R,), jnp.float32) if key_scale is None else key_scale.astype(jnp.float32)
    scale = jnp.pad(scale, (0, pad_r), constant_values=1.0).reshape(plan.chunks, plan.chunk)
    nv = jnp.pad(n_valid, (0, pad_t)).reshape(tiles, tt)
    # Chunks holding a valid row for some token of the tile; share s scores chunks
    # [s * per_share, end_s): the rows split between the programs.
    needed = -(-jnp.max(nv, axis=1) // plan.chunk)
    per_share = plan.chunks // shares
    starts = jnp.arange(shares)[:, None] * per_share
    ends = jnp.clip(needed[None, :], starts, starts + per_share).astype(jnp.int32)
    operands = (q_t, w_t, keys_t, scale, nv.astype(jnp.float32)[..., None], ends[..., None])
    return operands, tiles


def scores_from_keys(keys, idx):
    """The kernel's selection keys back to f32 scores (kernel module docstring, step 2):
    ``NEG_INF_KEY`` -> -inf, ``NAN_KEY`` -> NaN, else ``key / KEY_FACTOR``; -0 -> +0; ``-inf``
    where ``idx`` is -1."""
    score = keys * jnp.float32(1.0 / _kernel.KEY_FACTOR)
    score = jnp.where(keys == jnp.float32(_kernel.NEG_INF_KEY), -jnp.inf, score)
    score = jnp.where(keys == jnp.float32(_kernel.NAN_KEY), jnp.nan, score) + jnp.float32(0.0)
    return jnp.where(idx < 0, -jnp.inf, score).astype(jnp.float32)


def _finish_on_host(part_keys, part_rows, topk: int):
    """One share's partial selection is the result: keys and ``idx`` (row, or -1 at MARKER)."""
    keys = part_keys[0][..., :topk]
    idx = np.where(keys > np.float32(_kernel.MARKER), part_rows[0][..., :topk], -1.0)
    return keys, idx.astype(np.int32)


def _run_on_host(target: str, shares: int, programs: int, topk: int, chunk: int, *arrays):
    from ..nki_emulator import simulate

    match = _kernel.selection_variant(target)
    first = simulate(_kernel.indexer_topk_kernel, target=target)[shares]
    part_keys, part_rows = first(*[np.asarray(a) for a in arrays], topk=topk, chunk=chunk,
                                 match_indices=match)  # fmt: skip
    if shares > 1:
        merge = simulate(_kernel.indexer_merge_kernel, target=target)[programs]
        keys_out, idx = merge(part_keys, part_rows, topk=topk, match_indices=match)
    else:
        keys_out, idx = _finish_on_host(part_keys, part_rows, topk)
    # One f32 result (row numbers are exact in f32 below 2**24): JAX 0.7 cannot lower a
    # pure_callback with two results inside shard_map.
    return np.concatenate([keys_out, idx.astype(np.float32)], axis=-1)


def _call_emulated(target, shares, programs, plan, operands, tiles):
    tt, k = plan.tile_tokens, plan.topk
    result = jax.ShapeDtypeStruct((tiles, tt, 2 * k), jnp.float32)
    packed = jax.pure_callback(
        functools.partial(_run_on_host, target, shares, programs, k, plan.chunk), result,
        *operands, vmap_method="sequential",
    )  # fmt: skip
    return packed[..., :k], packed[..., k:].astype(jnp.int32)


def _call_nki(target, shares, programs, plan, operands):
    from ..attention.neuron import jitted_kernel  # the shared nki.jit cache and install hint

    match = _kernel.selection_variant(target)
    first = jitted_kernel(_kernel.indexer_topk_kernel)
    if shares > 1:
        first = first[shares]  # one program per physical core (LNC=2), each a share of the rows
    part_keys, part_rows = first(*operands, topk=plan.topk, chunk=plan.chunk, match_indices=match)
    if shares == 1:
        keys = part_keys[0][..., : plan.topk]
        idx = jnp.where(keys > jnp.float32(_kernel.MARKER), part_rows[0][..., : plan.topk], -1.0)
        return keys, idx.astype(jnp.int32)
    merge = jitted_kernel(_kernel.indexer_merge_kernel)
    if programs > 1:
        merge = merge[programs]
    return merge(part_keys, part_rows, topk=plan.topk, match_indices=match)


def shares_for(programs: int, topk: int) -> int:
    """How many programs split the rows: all of the launch grid, unless their partial
    selections together exceed what one max8 merge reads (``programs * K8 > 16384``)."""
    topk8 = -(-max(topk, 1) // _kernel.SELECTED_PER_ROUND) * _kernel.SELECTED_PER_ROUND
    return programs if programs * topk8 <= _kernel.SELECT_MAX_ELEMENTS else 1


def indexer_topk_neuron(q, weights, keys, key_scale, positions, *, topk, compress_ratio, emulated):
    """The indexer on the NKI kernel: the primitive's operands in, ``(idx, scores)`` out.

    Args:
      q: ``[T, Hi, Di]`` bf16, f16 or f32 (the kernel's matmul dtype; ``Hi <= 128``).
      weights: ``[T, Hi]`` f32, already multiplied by the scale.
      keys: ``[R, Di]`` in q's dtype.
      key_scale: ``[R]`` f32 or None.
      positions: ``[T]`` int32.
      topk: static int >= 0; compress_ratio: static int >= 1.
      emulated: True runs the kernel under the NKI emulator on the host, False on Neuron.
    Returns ``(idx [T, topk] int32, scores [T, topk] f32)``: the valid rows with the highest
    scores, best first, exact ties to the lower row, NaN below every number; ``-1`` / ``-inf``
    past the valid rows (docs/indexer.md). Raises ``ValueError`` naming the argument for shapes
    the kernel cannot take.
    """
    from ..attention.neuron import launch_programs, neuron_target

    T, Hi, Di = q.shape
    R = keys.shape[0]
    if not isinstance(topk, (int, np.integer)) or topk < 0:
        raise ValueError(f"topk must be a static int >= 0, got {topk!r}")
    if not isinstance(compress_ratio, (int, np.integer)) or compress_ratio < 1:
        raise ValueError(f"compress_ratio must be a static int >= 1, got {compress_ratio!r}")
    if T == 0 or topk == 0 or R == 0:
        idx = jnp.full((T, topk), -1, jnp.int32)
        return idx, jnp.full((T, topk), -jnp.inf, jnp.float32)
    if Di == 0 or Hi == 0:
        # Every score is an empty sum, 0: the valid rows in order (ties to the lower row).
        rows = jnp.arange(topk, dtype=jnp.int32)[None, :]
        nv = valid_rows(positions, R, int(compress_ratio))[:, None]
        idx = jnp.where(rows < nv, rows, -1)
        return idx, jnp.where(idx >= 0, 0.0, -jnp.inf).astype(jnp.float32)
    if R >= MAX_KERNEL_ROWS:
        raise ValueError(f"keys has {R} rows; the indexer kernel takes fewer than 2**24")
    from ..nki_emulator.targets import TARGETS

    target = neuron_target()
    programs = launch_programs(target)
    shares = shares_for(programs, int(topk))
    merge_programs = programs if shares > 1 else 1
    plan = _kernel.plan_indexer(T, Hi, Di, R, int(topk), shares=shares,
                                budget=TARGETS[target].sbuf_bytes_per_partition)  # fmt: skip
    n_valid = valid_rows(positions, R, int(compress_ratio))
    operands, tiles = _pack(plan, shares, merge_programs, q, weights, keys, key_scale, n_valid)
    if emulated:
        keys_out, idx = _call_emulated(target, shares, merge_programs, plan, operands, tiles)
    else:
        keys_out, idx = _call_nki(target, shares, merge_programs, plan, operands)
    keys_out = keys_out.reshape(-1, topk)[:T]
    idx = idx.reshape(-1, topk)[:T]
    return idx, scores_from_keys(keys_out, idx)
