"""Which form the jnp reference's 16-bit matrix products take on CPU.

Two forms compute the same contract (16-bit operands, exact products, an f32 accumulator; only the
summation order differs between them):

- ``"native"``: the products take the 16-bit operands as they are (``preferred_element_type=f32``).
  Fast where the CPU multiplies bf16 natively (AVX-512 BF16, AMX, Arm's BF16 extension).
- ``"f32"``: each chunk's 16-bit operands are widened to f32 in cache and multiplied in f32. A bf16
  or f16 product is exact in f32, so the contract holds. On CPUs without native bf16 products
  (AVX2-only x86, Ice Lake's AVX-512 without BF16) XLA:CPU's f32 GEMM is far faster than its
  emulated bf16 one.

The choice is made once per process from what the CPU reports, unless the environment variable
``JAX_SPARSE_ATTN_CPU_PRODUCTS`` is ``native`` or ``f32``. It only concerns programs lowered for
the CPU: GPUs and TPUs always take the native form.
"""

from __future__ import annotations

import functools
import os
import platform

ENV_VAR = "JAX_SPARSE_ATTN_CPU_PRODUCTS"
FORMS = ("native", "f32")

# /proc/cpuinfo flags that mean native bf16 dot products (x86: "flags", Arm: "Features").
_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def cpu_reports_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU lists a native bf16 dot-product unit.

    Reads ``/proc/cpuinfo`` (Linux; ``cpuinfo`` overrides its text, for tests). On macOS, Apple
    silicon from M2 on reports ``hw.optional.arm.FEAT_BF16``. Anything unreadable counts as no.
    """
    if cpuinfo is None:
        if platform.system() == "Darwin":
            return _darwin_feature("hw.optional.arm.FEAT_BF16")
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features") and _BF16_FLAGS & set(value.split()):
            return True
    return False


def _darwin_feature(name: str) -> bool:
    import subprocess

    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() == "1"
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def cpu_product_form() -> str:
    """``"native"`` or ``"f32"``: the environment variable if set, else what the CPU reports."""
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced:
        if forced not in FORMS:
            raise ValueError(f"{ENV_VAR} must be one of {FORMS}; got {forced!r}")
        return forced
    return "native" if cpu_reports_native_bf16() else "f32"
