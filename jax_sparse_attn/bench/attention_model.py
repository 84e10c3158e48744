"""Modelled Trainium time of the project's NKI kernel: ``python -m jax_sparse_attn.bench --model trn2``.

A MODEL, NOT A MEASUREMENT. Each shape runs ``gathered_attn_idx(..., implementation="nki_emulated")``
(the whole Neuron data path, with the kernel source run by the project's NKI emulator) with
``NEURON_PLATFORM_TARGET_OVERRIDE`` set to the target, and every kernel launch records its
instructions and their modelled cost (:mod:`jax_sparse_attn.nki_emulator.cost`: the ISA
reference's per-instruction formulas, DMA bytes over the documented bandwidth; the busiest engine
of each program is its time, programs of a launch run in parallel, launches one after another).

Emulating a long prefill instruction by instruction is far too slow on a host, so a shape with more
than ``2 * probe`` tokens is modelled from two runs of ``probe`` and ``2 * probe`` tokens and scaled
linearly in T: ``cost(T) = cost(P) + (T - P) * (cost(2P) - cost(P)) / P``. That is exact when the
kernel's cost is affine in T, i.e. when every block of tokens (and every program of the grid) costs
the same, which holds for kernels whose blocks are identical and whose block size divides ``probe``;
the output says which shapes were scaled and from which token counts.

Per shape it reports ``modelled_us``, the bounds ``hbm_bound_us`` / ``pe_bound_us`` (per logical
core; see :func:`jax_sparse_attn.nki_emulator.cost.attention_bounds`), ``instructions`` (the
compiled instructions of the largest program: an ``nl.fori_loop`` body counts once),
``instructions_executed``, ``busiest_engine`` and ``per_engine_us``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import sys
import time
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from .common import MODEL_LABEL, TARGETS, cpu_model_name, emulator_error_message, write_json

DEFAULT_PROBE_TOKENS = 16


def default_shapes() -> list[tuple[str, int, int, int, int, int]]:
    """``(name, T, H, D, K, R)``: decode T=16/128 x H=64/128 x D=512/576, prefill T=4096."""
    shapes = []
    for T in (16, 128):
        for H in (64, 128):
            for D in (512, 576):
                shapes.append((f"decode-T{T}", T, H, D, 2048, 65536))
    for H in (16, 128):
        shapes.append(("prefill", 4096, H, 512, 2048, 65536))
    return shapes


KV_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def _inputs(T: int, H: int, D: int, K: int, R: int, seed: int = 0, kv_dtype: str = "bfloat16",
            scale_groups: int = 1):  # fmt: skip
    """q, kv, idx, sink and (for an FP8 ``kv_dtype``) ``kv_scale [R, scale_groups]``."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((T, H, D), np.float32), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((R, D), np.float32), getattr(jnp, kv_dtype))
    idx = jnp.asarray(rng.integers(0, R, (T, K)), jnp.int32)
    sink = jnp.asarray(rng.standard_normal(H, np.float32))
    kv_scale = None
    if kv_dtype != "bfloat16":
        kv_scale = jnp.asarray(rng.uniform(0.5, 2.0, (R, scale_groups)), jnp.float32)
    return q, kv, idx, sink, kv_scale


def _model_call(target: str, T: int, H: int, D: int, K: int, R: int, kv_dtype: str = "bfloat16",
                scale_groups: int = 1, value_dim: Optional[int] = None) -> dict:  # fmt: skip
    """Run one call under the emulator with cost recording; the launches' combined figures."""
    import jax

    from .. import gathered_attn_idx, nki_emulator
    from ..nki_emulator.cost import ENGINES

    q, kv, idx, sink, kv_scale = _inputs(T, H, D, K, R, kv_dtype=kv_dtype, scale_groups=scale_groups)
    previous = os.environ.get(nki_emulator.TARGET_ENV)
    os.environ[nki_emulator.TARGET_ENV] = target
    jax.clear_caches()  # a trace made for another target must not be reused
    try:
        with _quiet_callback_errors(), nki_emulator.recording(cost=True) as rec:
            np.asarray(gathered_attn_idx(q, kv, idx, sink, kv_scale=kv_scale, value_dim=value_dim,
                                         implementation="nki_emulated"))  # fmt: skip
    finally:
        if previous is None:
            os.environ.pop(nki_emulator.TARGET_ENV, None)
        else:
            os.environ[nki_emulator.TARGET_ENV] = previous
        jax.clear_caches()
    if not rec.runs:
        raise RuntimeError("the call launched no kernel under the emulator")
    per_engine = dict.fromkeys(ENGINES, 0.0)
    modelled = 0.0
    dma_bytes = hbm_bytes = 0
    for run in rec.runs:  # launches run one after another; programs of one launch in parallel
        costs = [p.cost for p in run.programs]
        modelled += max(c.modelled_us for c in costs)
        for e in ENGINES:
            per_engine[e] += max(c.engine_us[e] for c in costs)
        dma_bytes += sum(c.dma_bytes for c in costs)
        hbm_bytes += sum(c.hbm_bytes for c in costs)
    return {
        "modelled_us": modelled,
        "per_engine_us": per_engine,
        "instructions": max(r.compiled_instructions_per_program for r in rec.runs),
        "instructions_executed": sum(r.instructions for r in rec.runs),
        "dma_bytes": dma_bytes,
        "hbm_bytes": hbm_bytes,
        "launches": len(rec.runs),
        "grid": max(r.grid for r in rec.runs),
        "nki_version": rec.runs[0].nki_version,
    }


@contextlib.contextmanager
def _quiet_callback_errors():
    """JAX logs a host callback's traceback before re-raising it; the error is reported anyway."""
    logger = logging.getLogger("jax._src.callback")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _scale(small: dict, large: dict, p: int, T: int) -> dict:
    """Affine extrapolation in T from runs at p and 2p tokens."""

    def lin(a: float, b: float) -> float:
        return a + (T - p) * (b - a) / p

    out = dict(large)
    out["modelled_us"] = lin(small["modelled_us"], large["modelled_us"])
    out["per_engine_us"] = {
        e: lin(small["per_engine_us"][e], large["per_engine_us"][e]) for e in small["per_engine_us"]
    }
    for key in ("instructions", "instructions_executed", "dma_bytes", "hbm_bytes", "launches"):
        if key in small:
            out[key] = int(round(lin(small[key], large[key])))
    return out


def model_shape(target: str, T: int, H: int, D: int, K: int, R: int, probe: int = DEFAULT_PROBE_TOKENS,
                kv_dtype: str = "bfloat16", scale_groups: int = 1,
                value_dim: Optional[int] = None) -> dict:  # fmt: skip
    """The modelled figures of one call at ``[T, H, D]`` queries, K slots, R cache rows, the cache
    in ``kv_dtype`` (an FP8 cache with ``scale_groups`` f32 scales per row), ``value_dim`` value
    columns (default D)."""
    from ..nki_emulator.cost import attention_bounds

    start = time.perf_counter()
    cache = dict(kv_dtype=kv_dtype, scale_groups=scale_groups, value_dim=value_dim)
    if T <= 2 * probe:
        fig = _model_call(target, T, H, D, K, R, **cache)
        scaled_from = None
    else:
        small = _model_call(target, probe, H, D, K, R, **cache)
        large = _model_call(target, 2 * probe, H, D, K, R, **cache)
        fig = _scale(small, large, probe, T)
        scaled_from = [probe, 2 * probe]
    fp8 = kv_dtype != "bfloat16"
    bounds = attention_bounds(target, T, H, D, K, row_itemsize=1 if fp8 else 2,
                              scales_per_row=scale_groups if fp8 else 0,
                              value_dim=value_dim)  # fmt: skip
    busiest = max(fig["per_engine_us"], key=fig["per_engine_us"].get)
    bound = max(bounds["hbm_bound_us"], bounds["pe_bound_us"])
    return {
        "target": target,
        "shape": {"T": T, "H": H, "D": D, "K": K, "R": R},
        "kv_dtype": kv_dtype,
        "scale_groups": scale_groups if fp8 else None,
        "value_dim": D if value_dim is None else value_dim,
        "modelled_us": fig["modelled_us"],
        "hbm_bound_us": bounds["hbm_bound_us"],
        "pe_bound_us": bounds["pe_bound_us"],
        "modelled_over_bound": fig["modelled_us"] / bound,
        "instructions": fig["instructions"],
        "instructions_executed": fig["instructions_executed"],
        "busiest_engine": busiest,
        "per_engine_us": fig["per_engine_us"],
        "dma_bytes": fig["dma_bytes"],
        "hbm_bytes": fig["hbm_bytes"],
        "launches": fig["launches"],
        "grid": fig["grid"],
        "nki_version": fig["nki_version"],
        "scaled_from_tokens": scaled_from,
        "host_seconds": time.perf_counter() - start,
    }


def _row(r: dict) -> str:
    s = r["shape"]
    shape = f"T={s['T']} H={s['H']} D={s['D']} K={s['K']} R={s['R']}"
    if r.get("value_dim") not in (None, s["D"]):
        shape += f" V={r['value_dim']}"
    if "error" in r:
        return f"{r['target']:<5} {shape:<36} error: {r['error']}"
    scaled = f" (scaled from T={r['scaled_from_tokens']})" if r["scaled_from_tokens"] else ""
    engines = " ".join(f"{e}={v:.1f}" for e, v in r["per_engine_us"].items())
    return (
        f"{r['target']:<5} {shape:<36} {r['modelled_us']:10.1f} {r['hbm_bound_us']:9.1f} "
        f"{r['pe_bound_us']:9.1f} {r['modelled_over_bound']:6.2f}x {r['instructions']:8d} "
        f"{r['busiest_engine']:<7} [{engines}]{scaled}"
    )


def run_model(
    target: str,
    shapes: Optional[Iterable[Any]] = None,
    json_path: Optional[str] = None,
    probe: int = DEFAULT_PROBE_TOKENS,
    kv_dtype: str = "bfloat16",
    scale_groups: int = 1,
    row_transposes: str | None = None,
    value_dim: Optional[int] = None,
) -> int:
    """Model every shape on ``target``, print a table and optionally write JSON; 0 if all ran.

    With ``value_dim`` (< D) each shape is modelled twice, with all D value columns and with
    ``value_dim``, and the ratio of the modelled times is printed.

    ``shapes``: objects with ``T, H, D, K, R`` attributes or ``(name, T, H, D, K, R)`` tuples
    (default :func:`default_shapes`). ``row_transposes``: ``"tensor"`` or ``"dma"`` overrides
    the kernel's ``ROW_TRANSPOSES`` for this run (the variant comparison of docs/neuron-kernel.md).
    """
    from ..attention import kernel as kernels

    if row_transposes is None:
        row_transposes = kernels.ROW_TRANSPOSES
    if row_transposes not in ("tensor", "dma"):
        raise ValueError(f"row_transposes must be 'tensor' or 'dma', got {row_transposes!r}")
    previous = kernels.ROW_TRANSPOSES
    kernels.ROW_TRANSPOSES = row_transposes
    try:
        return _run_model(target, shapes, json_path, probe, kv_dtype, scale_groups, row_transposes,
                          value_dim)
    finally:
        kernels.ROW_TRANSPOSES = previous


def _run_model(target, shapes, json_path, probe, kv_dtype, scale_groups, row_transposes,
               value_dim=None) -> int:
    if target not in TARGETS:
        raise ValueError(f"--model wants one of {TARGETS}, got {target!r}")
    cases = []
    for s in shapes or default_shapes():
        if isinstance(s, tuple):
            cases.append(tuple(s[1:]))
        else:
            cases.append((s.T, s.H, s.D, s.K, s.R))
    cache = "" if kv_dtype == "bfloat16" else f"; FP8 cache {kv_dtype}, {scale_groups} scale(s) per row"
    cache += "" if row_transposes == "tensor" else f"; row transposes by {row_transposes}"
    from ..nki_emulator.versions import nki_version

    print(f"# {MODEL_LABEL}; target {target}{cache}; NKI {nki_version()} (emulated); host CPU: {cpu_model_name()}",
          flush=True)  # fmt: skip
    print(f"# {'tgt':<5} {'shape':<36} {'model us':>10} {'HBM us':>9} {'PE us':>9} {'/bound':>7} "
          f"{'instrs':>8} busiest [per engine us]", flush=True)  # fmt: skip
    records = []
    ok = True
    for T, H, D, K, R in cases:
        widths = [None] if value_dim in (None, D) else [None, value_dim]
        pair = []
        for width in widths:
            try:
                rec = model_shape(target, T, H, D, K, R, probe, kv_dtype, scale_groups, width)
            except Exception as err:  # noqa: BLE001 - a kernel the emulator rejects is a result too
                ok = False
                rec = {"target": target, "shape": {"T": T, "H": H, "D": D, "K": K, "R": R},
                       "error": emulator_error_message(err)}  # fmt: skip
            records.append(rec)
            pair.append(rec)
            print(_row(rec), flush=True)
        if len(pair) == 2 and all("error" not in r for r in pair):
            ratio = pair[1]["modelled_us"] / pair[0]["modelled_us"]
            pair[1]["modelled_over_all_value_columns"] = ratio
            print(f"#   value_dim={value_dim} of D={D}: {ratio:.3f}x the modelled time with all "
                  f"D value columns (a MODEL)", flush=True)
    if json_path:
        result = {
            "kind": MODEL_LABEL,
            "target": target,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host_cpu": cpu_model_name(),
            "probe_tokens": probe,
            "kv_dtype": kv_dtype,
            "nki_version": nki_version(),
            "row_transposes": row_transposes,
            "notes": [
                "modelled_us: busiest engine of each program (perfect overlap), programs of a "
                "launch in parallel, launches in sequence",
                "hbm_bound_us / pe_bound_us: per logical core (LNC physical cores); bytes = q, "
                "gathered slot rows, output (bf16) and the f32 bias; flops = 4*T*H*K*D",
                "instructions: compiled instructions of the largest program (a hardware loop's "
                "body, nl.fori_loop, counts once); instructions_executed: all programs, all "
                "launches",
                "scaled_from_tokens: modelled from two emulated runs and scaled linearly in T "
                "(exact when every block of tokens costs the same)",
            ],
            "records": records,
        }
        write_json(result, json_path)
    return 0 if ok else 1


def _parse_shape(text: str) -> tuple:
    try:
        T, H, D, K, R = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape wants T,H,D,K,R (five integers); got {text!r}")
    return ("custom", T, H, D, K, R)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_sparse_attn.bench.attention_model", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=TARGETS, default="trn2", help="target to model")
    p.add_argument("--shape", type=_parse_shape, action="append", help="T,H,D,K,R (repeatable)")
    p.add_argument("--json", metavar="PATH", help="also write the records as JSON")
    p.add_argument("--probe-tokens", type=int, default=DEFAULT_PROBE_TOKENS,
                   help="shapes with T > 2*P are scaled from runs at P and 2P tokens")  # fmt: skip
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="bfloat16",
                   help="the cache dtype (an FP8 cache comes with f32 scales)")  # fmt: skip
    p.add_argument("--scale-groups", type=int, default=1,
                   help="FP8 cache: f32 scales per row (1: per row; D/128: FlashMLA's groups)")
    p.add_argument("--row-transposes", choices=("tensor", "dma"), default=None,
                   help="the kernel's ROW_TRANSPOSES variant to model (default: the kernel's)")
    p.add_argument("--value-dim", type=int, default=None,
                   help="value columns (<= D); each shape is also modelled with all D, for the ratio")
    a = p.parse_args(argv)
    return run_model(a.model, a.shape, a.json, a.probe_tokens, a.kv_dtype, a.scale_groups,
                     a.row_transposes, a.value_dim)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
