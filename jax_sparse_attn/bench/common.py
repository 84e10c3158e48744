"""What every benchmark shares: the run's environment, the timing loop, memory readings, the
JSON writer and the cost model's label and error text.

The bottom layer of :mod:`jax_sparse_attn.bench`: it imports no other module of the package, and
every other module may import it (benchmarks/README.md, "Code").
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import sys
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from .. import cpu_products

IMPLEMENTATIONS = ("none", "reference", "nki", "nki_emulated")
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}

# The Trainium targets of the cost model, and the label every modelled record carries.
TARGETS = ("trn1", "trn2", "trn3")
MODEL_LABEL = "MODEL (not a measurement): NKI emulator cost model, see docs/nki-emulator.md"


# --- the machine ----------------------------------------------------------------------------------


def cpu_info() -> dict:
    """The CPU's model name, family, model and the vector flags that pick XLA's code paths, from
    /proc/cpuinfo (Linux); elsewhere the model name from ``platform``."""
    cpu = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in cpu:
                    cpu[key] = value.strip()
                if key == "flags" and "flags" not in cpu:
                    flags = value.split()
                    cpu["flags"] = " ".join(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))
    except OSError:
        cpu["model name"] = platform.processor()
    return cpu


def cpu_model_name() -> str:
    """The CPU's model name (the host that ran a model or a measurement)."""
    return cpu_info().get("model name") or platform.processor() or platform.machine()


def environment() -> dict:
    """Where the figures come from."""
    device = jax.devices()[0]
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "jaxlib": _jaxlib_version(),
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "cpu": cpu_info(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        # e.g. --xla_cpu_max_isa=AVX2 to measure what an AVX2-only CPU would run
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        # The reference's CPU product form this process picks (a record's own form is its
        # "cpu_products"), why, and the override.
        "cpu_products": {
            "auto": cpu_products.form_name(cpu_products.cpu_form()),
            "cpu_reports_native_bf16": cpu_products.cpu_reports_native_bf16(),
            "products_by_eigen": cpu_products.products_by_eigen(),
            cpu_products.ENV_VAR: os.environ.get(cpu_products.ENV_VAR),
        },
    }


def _jaxlib_version() -> Optional[str]:
    try:
        import jaxlib

        return jaxlib.__version__
    except (ImportError, AttributeError):
        return None


def load_average() -> Optional[list]:
    """The 1, 5 and 15 minute load averages (Unix), or None."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


# --- timing ---------------------------------------------------------------------------------------


def implementation_arg(name: str) -> Optional[str]:
    """The ``--implementation`` choice as the API takes it ('none' is ``None``)."""
    return None if name == "none" else name


def square_gemm(flops: int, seed: int = 1):
    """An f32 ``[n, n] @ [n, n]`` with ``2 n^3`` close to ``flops``; returns (fn, args, its FLOPs)."""
    n = max(16, int(round((flops / 2) ** (1 / 3) / 16)) * 16)
    a, b = jax.random.normal(jax.random.key(seed), (2, n, n), jnp.float32)
    return jax.jit(jnp.matmul), (a, b), 2 * n**3


def time_rounds(fns: dict[str, tuple[Callable, tuple]], repeats: int, warmup: int,
                cpu_times: Optional[dict] = None) -> dict:
    """Runs each function ``warmup`` times, then ``repeats`` interleaved rounds; seconds per call.

    ``cpu_times``, when given, is filled with the process's CPU seconds (all threads, user +
    system) spent in each call: on a shared machine the wall time depends on what else runs,
    while CPU time per call, and CPU time over wall time (the cores a call kept busy), do much
    less.
    """
    for fn, args in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {k: [] for k in fns}
    if cpu_times is not None:
        cpu_times.update({k: [] for k in fns})
    for _ in range(repeats):
        for name, (fn, args) in fns.items():
            cpu_start = time.process_time()
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
            if cpu_times is not None:
                cpu_times[name].append(time.process_time() - cpu_start)
    return times


# --- memory ---------------------------------------------------------------------------------------


def _status_bytes(field: str) -> Optional[int]:
    """A ``kB`` field of /proc/self/status (Linux), in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_rss() -> bool:
    """Resets the kernel's peak RSS to the current RSS (Linux >= 4.0); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_bytes() -> int:
    """Current resident set size; the peak so far where the current one is unavailable."""
    current = _status_bytes("VmRSS")
    return current if current is not None else peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set size: VmHWM (which ``reset_peak_rss`` resets), else ru_maxrss."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


# --- records and errors ---------------------------------------------------------------------------


def write_json(result: dict, json_path: str) -> None:
    """Writes a benchmark's record (``--json``) and says where."""
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"# wrote {json_path}", flush=True)


def write_records(records: list, json_path: str) -> None:
    """Writes ``records`` with this run's environment block (``--json``) and says where."""
    write_json({"environment": environment(), "records": records}, json_path)


def emulator_error_message(err: Exception) -> str:
    """The emulator's own message when the kernel was rejected inside the host callback."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for line in reversed(lines):
        if "Nki" in line and "Error: " in line:
            return line.split("nki_emulator.errors.", 1)[-1]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def run_model_cases(op: str, target: str, cases, row: Callable, header: str, notes: list,
                    json_path: Optional[str]) -> int:
    """The cost-model command of one op. Each case is ``(shape, run, extra)``: ``run()`` gives its
    record (a case the kernel rejects gives ``{"target", "shape", "error"}``), ``extra`` joins
    it, and ``row`` prints it under ``header``; with ``json_path``, the records in one labelled
    file. 0 if every case ran."""
    if target not in TARGETS:
        raise ValueError(f"--model wants one of {TARGETS}, got {target!r}")
    print(f"# {MODEL_LABEL}; op {op}; target {target}; host CPU: {cpu_model_name()}", flush=True)
    print(f"# {header}", flush=True)
    records, ok = [], True
    for shape, run, extra in cases:
        try:
            rec = run()
        except Exception as err:  # noqa: BLE001 - a shape the kernel rejects is a result too
            ok = False
            rec = {"target": target, "shape": shape, "error": emulator_error_message(err)}
        rec.update(extra)
        records.append(rec)
        print(row(rec), flush=True)
    if json_path:
        write_json({
            "kind": MODEL_LABEL,
            "op": op,
            "target": target,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host_cpu": cpu_model_name(),
            "notes": notes,
            "records": records,
        }, json_path)
    return 0 if ok else 1
