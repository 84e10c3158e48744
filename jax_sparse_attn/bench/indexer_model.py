"""Modelled Trainium time of the indexer's NKI kernel:
``python -m jax_sparse_attn.bench --model trn2 --op indexer --shape T,R,Hi,Di,K``.

A MODEL, NOT A MEASUREMENT. Each shape runs :func:`jax_sparse_attn.indexer.neuron.indexer_topk_neuron`
with ``emulated=True`` (packing, the kernel source under the project's NKI emulator, unpacking)
for the last ``T`` tokens of a causal sequence of ``R`` rows (positions ``R - T .. R - 1``),
``NEURON_PLATFORM_TARGET_OVERRIDE`` set to the target, and records every launch's modelled cost
(:mod:`jax_sparse_attn.nki_emulator.cost`; docs/nki-emulator.md, "Cost model").

Bounds, per logical core (the target's LNC physical cores), docs/indexer-kernel.md:

* ``hbm_bound_us``: the key bytes that must be read, ``rows_read * Di * itemsize`` (the rows
  valid for at least one token: all ``R`` here), over the HBM bandwidth;
* ``pe_bound_us``: the score matmuls over the valid rows, ``2 * Hi * Di`` flops per (token,
  valid row), at the BF16 TensorE peak.
"""

from __future__ import annotations

import time
from typing import Iterable, Optional

import numpy as np

from .common import run_model_cases

NOTES = [
    "the last T tokens of a causal sequence of R rows (positions R-T .. R-1), bf16 q "
    "and keys, no key_scale",
    "modelled_us: busiest engine of each program (perfect overlap), programs of a "
    "launch in parallel, launches in sequence",
    "hbm_bound_us: the key rows valid for some token, read once (bf16); pe_bound_us: "
    "2*Hi*Di flops per (token, valid row) at the BF16 TensorE peak; both per logical "
    "core",
    "instructions: compiled instructions of the largest program (hardware-loop "
    "bodies count once; a 0-or-1-trip branch first taken after a loop's first "
    "iteration is not counted)",
]
DEFAULT_SHAPES = ((1, 131072, 64, 128, 2048), (16, 131072, 64, 128, 2048),
                  (128, 32768, 64, 128, 2048))  # fmt: skip


def indexer_bounds(target: str, T: int, R: int, Hi: int, Di: int, *, itemsize: int = 2) -> dict:
    """``hbm_bound_us`` and ``pe_bound_us`` of the last ``T`` tokens of a causal sequence of
    ``R`` rows (module docstring), per logical core of ``target``."""
    from ..nki_emulator.cost import HARDWARE

    hw = HARDWARE[target]
    positions = np.arange(R - T, R)
    valid = np.clip(positions + 1, 0, R)
    rows_read = int(valid.max()) if T else 0
    nbytes = rows_read * Di * itemsize
    flops = 2 * Hi * Di * int(valid.sum())
    return {
        "hbm_bound_us": nbytes / (hw.hbm_gbps_per_core * hw.lnc * 1e3),
        "pe_bound_us": flops / (hw.pe_bf16_tflops_per_core * hw.lnc * 1e6),
        "bound_bytes": nbytes,
        "bound_flops": flops,
        "cores": hw.lnc,
    }


def _inputs(T: int, R: int, Hi: int, Di: int, seed: int = 0):
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((T, Hi, Di), np.float32), jnp.bfloat16)
    keys = jnp.asarray(rng.standard_normal((R, Di), np.float32), jnp.bfloat16)
    weights = jnp.asarray(rng.standard_normal((T, Hi), np.float32) * (Hi * Di) ** -0.5)
    positions = jnp.arange(R - T, R, dtype=jnp.int32)
    return q, weights, keys, positions


def model_indexer_shape(target: str, T: int, R: int, Hi: int, Di: int, K: int,
                        kernel: Optional[str] = None) -> dict:  # fmt: skip
    """The modelled figures of one ``indexer_topk`` call on ``target`` (module docstring), with
    the kernel the routing picks (``kernel=None``) or the one named (``"tiled"``, ``"decode"``)."""
    from .. import nki_emulator
    from ..attention.neuron import launch_programs
    from ..indexer.neuron import choose_kernel, indexer_topk_neuron

    if kernel is None:
        kernel = choose_kernel(target, launch_programs(target), T, Hi, Di, R, K)[0]
    start = time.perf_counter()
    q, weights, keys, positions = _inputs(T, R, Hi, Di)
    with nki_emulator.recording_on(target) as rec:
        idx, _ = indexer_topk_neuron(q, weights, keys, None, positions, topk=K, compress_ratio=1,
                                     emulated=True, kernel=kernel)
        np.asarray(idx)
    figures = nki_emulator.launch_figures(rec.runs)
    bounds = indexer_bounds(target, T, R, Hi, Di)
    bound = max(bounds["hbm_bound_us"], bounds["pe_bound_us"])
    return {
        "target": target,
        "shape": {"T": T, "R": R, "Hi": Hi, "Di": Di, "K": K},
        "kernel": kernel,
        "hbm_bound_us": bounds["hbm_bound_us"],
        "pe_bound_us": bounds["pe_bound_us"],
        "modelled_over_bound": figures["modelled_us"] / bound if bound else None,
        **figures,
        "host_seconds": time.perf_counter() - start,
    }


def _row(r: dict) -> str:
    s = r["shape"]
    shape = f"T={s['T']} R={s['R']} Hi={s['Hi']} Di={s['Di']} K={s['K']}"
    if "error" in r:
        return f"{r['target']:<5} {shape:<38} error: {r['error']}"
    engines = " ".join(f"{e}={v:.1f}" for e, v in r["per_engine_us"].items())
    return (f"{r['target']:<5} {shape:<38} {r['modelled_us']:10.1f} {r['hbm_bound_us']:9.1f} "
            f"{r['pe_bound_us']:9.1f} {r['modelled_over_bound']:7.2f}x {r['instructions']:8d} "
            f"{r['busiest_engine']:<7} {r['kernel']:<6} [{engines}]")  # fmt: skip


def run_indexer_model(target: str, shapes: Optional[Iterable[tuple]] = None,
                      json_path: Optional[str] = None, kernel: Optional[str] = None) -> int:  # fmt: skip
    """Model every ``(T, R, Hi, Di, K)`` shape on ``target`` with ``kernel`` (None: the one the
    routing picks); print a table, optionally write JSON; 0 if every shape ran."""

    def case(T, R, Hi, Di, K):
        shape = {"T": T, "R": R, "Hi": Hi, "Di": Di, "K": K}
        return shape, lambda: model_indexer_shape(target, T, R, Hi, Di, K, kernel), {}

    header = (f"{'tgt':<5} {'shape':<38} {'model us':>10} {'HBM us':>9} {'PE us':>9} {'/bound':>8} "
              f"{'instrs':>8} busiest kernel [per engine us]")  # fmt: skip
    return run_model_cases("indexer", target, [case(*s) for s in shapes or DEFAULT_SHAPES], _row,
                           header, NOTES, json_path)
