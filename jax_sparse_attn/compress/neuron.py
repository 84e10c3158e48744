"""The compressor's Neuron path: pack (jnp) -> the NKI kernel (:mod:`.kernel`) -> unpack.

:func:`pool_rows_neuron` has :func:`reference.pool_rows`'s signature and result (the pooled
blocks of one device's run of whole blocks), so the op's sharding rules (``compress/sharding.py``)
run it per device as they run the reference. ``emulated=True`` runs the kernel source under the
project's NKI emulator on the host (``jax.pure_callback``, as the other ops' ``neuron.py``);
``emulated=False`` calls it through ``nki.jit`` (NKI's own ``nki_call``) on a Neuron device.

The packing (one XLA fusion over the whole blocks; docs/compress-kernel.md, "Packing"): the rows'
scores ``s = min(f32(score) + f32(ape), FLT_MAX)`` (the contract's first line, as the reference
computes them), the windows (with overlap: block ``j - 1``'s low channels then block ``j``'s high
ones, block -1 the rows before), kv zeroed at masked rows (``s = -inf``: the contract's ``t = +0``
there, whatever kv holds), all transposed channel-major and padded to whole tiles. The ``T % r``
trailing rows are sliced off first: they never reach the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import kernel as _kernel
from . import reference


def _windows(kv, score, ape, overlap: bool, before_kv, before_s):
    """``(kv_w, s_w)``: ``[..., N, n, Co]`` in window order (kv in its dtype, or f32 where the
    rows before are f32; s f32), kv zeroed where s is -inf."""
    ratio = ape.shape[-2]
    kv_b = reference.blocks_of(kv, ratio)
    s_b = reference.row_scores(reference.blocks_of(score, ratio), ape)
    if overlap:
        d = kv.shape[-1] // 2
        dtype = jnp.result_type(kv.dtype, before_kv.dtype)
        kv_b = kv_b.astype(dtype)

        def window(blocks, before):
            previous = jnp.concatenate([before[..., None, :, :d], blocks[..., :-1, :, :d]], axis=-3)
            return jnp.concatenate([previous, blocks[..., d:]], axis=-2)

        kv_b, s_b = window(kv_b, before_kv.astype(dtype)), window(s_b, before_s)
    kv_b = jnp.where(s_b == -jnp.inf, jnp.zeros((), kv_b.dtype), kv_b)
    return kv_b, s_b


def _pack(plan, kv_w, s_w):
    """``[W, n, Co]`` -> ``[Co, tiles, G n]`` each, the windows padded to ``plan`` (padding
    windows: kv 0, s 0; their results are dropped)."""
    W, n, Co = kv_w.shape
    pad = plan.windows_padded - W

    def one(x):
        x = jnp.pad(x, ((0, pad), (0, 0), (0, 0)))
        return x.transpose(2, 0, 1).reshape(Co, plan.tiles, plan.group * n)

    return one(kv_w), one(s_w)


def _run_on_host(target: str, programs: int, rows: int, kv_w, s_w):
    from ..nki_emulator import simulate

    run = simulate(_kernel.compress_pool_kernel, target=target)[programs]
    return np.asarray(run(np.asarray(kv_w), np.asarray(s_w), rows=rows), np.float32)


def _call(target: str, programs: int, plan, kv_p, s_p, emulated: bool):
    if emulated:
        result = jax.ShapeDtypeStruct((kv_p.shape[0], plan.tiles, plan.group), jnp.float32)
        return jax.pure_callback(
            functools.partial(_run_on_host, target, programs, plan.rows), result, kv_p, s_p,
            vmap_method="sequential")  # fmt: skip
    from ..attention.neuron import jitted_kernel  # the shared nki.jit cache and install hint

    run = jitted_kernel(_kernel.compress_pool_kernel)
    if programs > 1:
        run = run[programs]  # one program per physical core (LNC=2)
    return run(kv_p, s_p, rows=plan.rows)


def pool_rows_neuron(kv, score, ape, *, overlap: bool, before_kv=None, before_s=None,
                     emulated: bool):
    """:func:`reference.pool_rows` on the NKI kernel: kv, score ``[..., T, C]`` (any float), ape
    ``[..., r, C]``, with ``overlap`` the rows before the first block (``before_kv``,
    ``before_s``: ``[..., r, C]`` f32, as ``reference.rows_before`` makes them) -> ``[..., T //
    r, C]`` f32, or ``[..., T // r, C // 2]`` with overlap."""
    from ..attention.neuron import launch_programs, neuron_target

    ratio = ape.shape[-2]
    lead = kv.shape[:-2]
    N = kv.shape[-2] // ratio
    Co = kv.shape[-1] // 2 if overlap else kv.shape[-1]
    if N == 0 or Co == 0:
        return jnp.zeros(lead + (N, Co), jnp.float32)
    kv_w, s_w = _windows(kv, score, ape, overlap, before_kv, before_s)
    n = kv_w.shape[-2]
    W = int(np.prod(lead, dtype=np.int64)) * N
    target = neuron_target()
    programs = launch_programs(target)
    plan = _kernel.plan_compress(W, n, programs)
    kv_p, s_p = _pack(plan, kv_w.reshape(W, n, Co), s_w.reshape(W, n, Co))
    out = _call(target, programs, plan, kv_p, s_p, emulated)
    return out.reshape(Co, plan.windows_padded)[:, :W].T.reshape(lead + (N, Co))


def compress_pool_neuron(kv, score, ape, prev_kv=None, prev_score=None, *, overlap: bool,
                         emulated: bool):
    """The whole op on one device on the kernel (``reference.compress_pool_reference``'s
    signature and result)."""
    if not overlap:
        return pool_rows_neuron(kv, score, ape, overlap=False, emulated=emulated)
    before_kv, before_s = reference.rows_before(score, ape, prev_kv, prev_score)
    return pool_rows_neuron(kv, score, ape, overlap=True, before_kv=before_kv, before_s=before_s,
                            emulated=emulated)
