"""Modelled Trainium time of the compressor's NKI kernel:
``python -m jax_sparse_attn.bench --model trn2 --op compress_pool``.

A MODEL, NOT A MEASUREMENT. Each shape runs ``compress_pool(..., implementation="nki_emulated")``
(the jnp packing, the kernel source under the project's NKI emulator, the unpacking) with
``NEURON_PLATFORM_TARGET_OVERRIDE`` set to the target, and records the kernel launch's modelled
cost (:mod:`jax_sparse_attn.nki_emulator.cost`; docs/nki-emulator.md, "Cost model"). The
packing (an XLA transpose of the windows, docs/compress-kernel.md) is outside the model.

The bound, per logical core (the target's LNC physical cores): ``hbm_bound_us``, the bytes the
op must move over the HBM bandwidth: the kv and scores each window pools, read once, and the
result written. A window reads ``r x C`` values of each: without overlap its block's rows; with
overlap the low half of the previous block's (or the rows before block 0) and its own high half.

Shapes: DeepSeek V4-Flash's compressors, f32 kv and scores (V4 computes ``wkv`` and ``wgate``
in f32, docs/deepseek.md): ratio 4 with overlap on the main cache (``C = 2 x 512``) and on the
indexer's (``C = 2 x 128``), ratio 128 without (``C = 512``); a 65,536-token prefill of one
sequence, and a decode step that completes one block (with the rows before it) in each of 1 or
64 sequences.
"""

from __future__ import annotations

import time
from typing import Iterable, Optional

import numpy as np

from .common import run_model_cases

NOTES = [
    "DeepSeek V4-Flash's compressors, B sequences of T tokens, f32 kv and scores; overlap calls "
    "get the rows before block 0 (prev_kv, prev_score)",
    "modelled_us: busiest engine of each program (perfect overlap), programs of a launch in "
    "parallel; the jnp packing (an XLA transpose) is outside the model",
    "hbm_bound_us: the r x C kv and scores each window pools read once (with overlap the previous "
    "block's low half and its own high half), the result written, per logical core",
    "instructions: compiled instructions of the largest program (hardware-loop bodies count once)",
]
# (name, ratio, C, overlap, T, B): B sequences of T tokens each.
DEFAULT_SHAPES = (
    ("ratio4-main-prefill", 4, 1024, True, 65536, 1),
    ("ratio4-index-prefill", 4, 256, True, 65536, 1),
    ("ratio128-prefill", 128, 512, False, 65536, 1),
    ("ratio4-main-decode", 4, 1024, True, 4, 1),
    ("ratio4-index-decode", 4, 256, True, 4, 1),
    ("ratio128-decode", 128, 512, False, 128, 1),
    ("ratio4-main-decode-b64", 4, 1024, True, 4, 64),
    ("ratio4-index-decode-b64", 4, 256, True, 4, 64),
    ("ratio128-decode-b64", 128, 512, False, 128, 64),
)


def compress_bounds(target: str, ratio: int, C: int, overlap: bool, T: int, B: int = 1,
                    itemsize: int = 4) -> dict:  # fmt: skip
    """``hbm_bound_us`` of a call on ``B`` sequences of ``T`` tokens (module docstring), per
    logical core."""
    from ..nki_emulator.cost import HARDWARE

    hw = HARDWARE[target]
    N = T // ratio
    nbytes = B * N * (2 * ratio * C * itemsize + (C // 2 if overlap else C) * 4)
    return {"hbm_bound_us": nbytes / (hw.hbm_gbps_per_core * hw.lnc * 1e3),
            "bound_bytes": nbytes, "cores": hw.lnc}  # fmt: skip


def model_compress_shape(target: str, ratio: int, C: int, overlap: bool, T: int,
                         B: int = 1) -> dict:  # fmt: skip
    """The modelled figures of one ``compress_pool`` call on ``target`` (module docstring)."""
    import jax.numpy as jnp

    from .. import nki_emulator
    from ..api import compress_pool

    start = time.perf_counter()
    rng = np.random.default_rng(0)
    kv, score = (jnp.asarray(rng.standard_normal((B, T, C), np.float32)) for _ in range(2))
    ape = jnp.asarray(rng.standard_normal((ratio, C), np.float32))
    prev = {}
    if overlap:
        prev = {"prev_kv": jnp.asarray(rng.standard_normal((B, ratio, C), np.float32)),
                "prev_score": jnp.asarray(rng.standard_normal((B, ratio, C), np.float32))}
    with nki_emulator.recording_on(target) as rec:
        np.asarray(compress_pool(kv, score, ape, overlap=overlap, **prev, implementation="nki_emulated"))
    figures = nki_emulator.launch_figures(rec.runs)
    bounds = compress_bounds(target, ratio, C, overlap, T, B)
    return {
        "target": target,
        "shape": {"ratio": ratio, "C": C, "overlap": overlap, "T": T, "B": B},
        "hbm_bound_us": bounds["hbm_bound_us"],
        "bound_bytes": bounds["bound_bytes"],
        "modelled_over_bound": figures["modelled_us"] / bounds["hbm_bound_us"],
        **figures,
        "host_seconds": time.perf_counter() - start,
    }


def _row(r: dict) -> str:
    name = r["name"]
    if "error" in r:
        return f"{r['target']:<5} {name:<22} error: {r['error']}"
    engines = " ".join(f"{e}={v:.1f}" for e, v in r["per_engine_us"].items())
    return (f"{r['target']:<5} {name:<22} {r['modelled_us']:10.2f} {r['hbm_bound_us']:9.2f} "
            f"{r['modelled_over_bound']:7.2f}x {r['instructions']:6d} {r['busiest_engine']:<7} "
            f"[{engines}]")  # fmt: skip


def run_compress_model(target: str, shapes: Optional[Iterable[tuple]] = None,
                       json_path: Optional[str] = None) -> int:  # fmt: skip
    """Model every ``(name, ratio, C, overlap, T, B)`` shape on ``target``; print a table,
    optionally write JSON; 0 if every shape ran."""

    def case(name, ratio, C, overlap, T, B):
        shape = {"ratio": ratio, "C": C, "overlap": overlap, "T": T, "B": B}
        return shape, lambda: model_compress_shape(target, ratio, C, overlap, T, B), {"name": name}

    header = (f"{'tgt':<5} {'shape':<22} {'model us':>10} {'HBM us':>9} {'/bound':>8} "
              f"{'instrs':>6} busiest [per engine us]")  # fmt: skip
    return run_model_cases("compress_pool", target, [case(*s) for s in shapes or DEFAULT_SHAPES],
                           _row, header, NOTES, json_path)
