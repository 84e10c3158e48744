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

Independently, the layout of the dot products follows the library that XLA:CPU runs them with
(``products_by_eigen``): Eigen is far faster at ``x rows^T`` than at ``rows x^T`` with either
operand type (docs/guides/performance.md). ``cpu_form()`` holds both halves (``ProductForm``) and is the
one place the attention reference, its backward and the indexer ask; ``forced`` sets a form for
the programs traced inside it (benchmarks, tests).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from typing import NamedTuple

import jax
import jax.numpy as jnp

ENV_VAR = "JAX_SPARSE_ATTN_CPU_PRODUCTS"
FORMS = ("native", "f32")

# /proc/cpuinfo flags that mean native bf16 dot products (x86: "flags", Arm: "Features").
_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def cpu_reports_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU lists a native bf16 dot-product unit.

    Reads ``/proc/cpuinfo`` (Linux; ``cpuinfo`` overrides its text, for tests). On macOS, Apple
    silicon from M2 on reports ``hw.optional.arm.FEAT_BF16``. Anything unreadable counts as no.
    """
    if cpuinfo is None and platform.system() == "Darwin":
        return _darwin_feature("hw.optional.arm.FEAT_BF16")
    return bool(_BF16_FLAGS & _cpu_flags(cpuinfo))


def cpu_reports_amx(cpuinfo: str | None = None) -> bool:
    """Whether the CPU lists Intel's AMX tiles for bf16 (``amx_bf16``: Sapphire Rapids and later)."""
    return "amx_bf16" in _cpu_flags(cpuinfo)


def _cpu_flags(cpuinfo: str | None) -> set:
    """The CPU's flags (x86 ``flags``, Arm ``Features``) from ``/proc/cpuinfo`` or the given
    text; empty where unreadable."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return set(value.split())
    return set()


def _darwin_feature(name: str) -> bool:
    import subprocess

    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() == "1"
    except Exception:
        return False


def cpu_product_form() -> str:
    """``"native"`` or ``"f32"``: the environment variable if set, else what the CPU reports (read
    once per process); a ``forced`` form while one is in effect."""
    return "f32" if cpu_form().widen else "native"


@functools.lru_cache(maxsize=None)
def _chosen_operands() -> str:
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced:
        if forced not in FORMS:
            raise ValueError(f"{ENV_VAR} must be one of {FORMS}; got {forced!r}")
        return forced
    return "native" if cpu_reports_native_bf16() else "f32"


@functools.lru_cache(maxsize=None)
def products_by_eigen() -> bool:
    """Whether XLA:CPU runs matrix products with its Eigen kernels rather than YNNPACK.

    jax 0.10 hands them to YNNPACK by default; earlier releases (0.7 among them), and 0.10 with
    ``XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=``, use Eigen. Found once per process by
    compiling one small bf16 product for the CPU and looking for YNNPACK's fusion in the program.
    """
    import jax
    import jax.numpy as jnp

    try:
        cpu = jax.devices("cpu")[0]
        sharding = jax.sharding.SingleDeviceSharding(cpu)
        a = jax.ShapeDtypeStruct((16, 64), jnp.bfloat16, sharding=sharding)
        b = jax.ShapeDtypeStruct((32, 64), jnp.bfloat16, sharding=sharding)
        product = jax.jit(lambda a, b: jnp.einsum("md,kd->mk", a, b,
                                                  preferred_element_type=jnp.float32))
        return "__ynn_fusion" not in product.lower(a, b).compile().as_text()
    except Exception:  # no CPU backend, or a JAX without these APIs: keep the default form
        return False


class ProductForm(NamedTuple):
    """How the reference lays out its matrix products (``reference.slot_products``).

    ``widen``: 16-bit operands are widened to f32 chunk by chunk and multiplied in f32 (the
    ``"f32"`` form); otherwise they are multiplied as they are (``"native"``). ``x_first``: the
    dot products run as ``x rows^T`` and are transposed after, for XLA:CPU's Eigen kernels (the
    f32 form's logits product also takes that layout for few heads: ``logits_x_first``).
    """

    widen: bool = False
    x_first: bool = False


# In the f32 form, a token of at most this many heads takes the x-first layout for its logits
# product (``logits_x_first``): the plain layout transposes each token's widened slots for only
# 2 H K D flops, which costs more than it saves below about 64 heads (docs/guides/performance.md).
X_FIRST_MAX_HEADS = 64


def logits_x_first(form: ProductForm, heads: int) -> bool:
    """Whether the logits product of a token with ``heads`` query heads runs x-first
    (``reference.slot_products``): always in an ``-x-first`` form, and in the f32 form for at
    most ``X_FIRST_MAX_HEADS`` heads."""
    return form.x_first or (form.widen and heads <= X_FIRST_MAX_HEADS)


def shape_invariant(form: ProductForm) -> bool:
    """Whether the CPU's products in ``form`` give each f32 element the same bits whatever the
    product's shape (how many rows and columns are multiplied at once), so that the results do not
    depend on chunk and block sizes. Only the native form on YNNPACK without AMX: f32 products
    and Eigen's kernels sum in an order that follows the block shape, and with AMX YNNPACK
    multiplies products of few rows with other kernels (docs/contract.md, "Layouts").
    """
    return not (form.widen or products_by_eigen() or cpu_reports_amx())


# GPUs and TPUs multiply 16-bit operands natively, in the plain form.
ACCELERATOR_FORM = ProductForm()


_forced: list = []  # a stack of forms set by ``forced`` (benchmarks and tests)


def cpu_form() -> ProductForm:
    """The form of the reference's products in programs lowered for the CPU: the one place the
    reference and its backward ask, when they are traced. Fixed once per process
    (``cpu_product_form()`` and ``products_by_eigen()``) unless ``forced`` says otherwise."""
    if _forced:
        return _forced[-1]
    return _detected_form()


@functools.lru_cache(maxsize=None)
def _detected_form() -> ProductForm:
    return ProductForm(widen=_chosen_operands() == "f32", x_first=products_by_eigen())


@contextlib.contextmanager
def forced(form: ProductForm):
    """Programs traced inside take ``form`` on CPU (to time or test either form on any machine).
    Programs already compiled keep theirs: ``jax.clear_caches()`` before tracing again."""
    _forced.append(form)
    try:
        yield form
    finally:
        _forced.pop()


def form_name(form: ProductForm) -> str:
    """``"native"`` or ``"f32"``, with ``"-x-first"`` for the Eigen layout."""
    return ("f32" if form.widen else "native") + ("-x-first" if form.x_first else "")


def parse_form(name: str) -> ProductForm:
    """Inverse of ``form_name``; ``"auto"`` is the detected form."""
    if name == "auto":
        return _detected_form()
    operands, _, layout = name.partition("-")
    if operands not in FORMS or layout not in ("", "x-first"):
        raise ValueError(f"a CPU product form is native or f32, optionally with -x-first; got "
                         f"{name!r}")
    return ProductForm(widen=operands == "f32", x_first=bool(layout))


def loop_slices(arrays, start, size: int, axis: int = 0) -> list:
    """``[start, start + size)`` of each array along ``axis``, for the body of a loop.

    XLA:CPU slices a bf16 or f16 array in f32, from a converted copy of the whole array, and then
    hoists that copy out of the loop: a loop that slices a bf16 ``[T, H, D]`` operand a chunk at a
    time would hold a whole f32 copy of it. Inside a ``cond``'s branch the conversion fuses into
    the slice, so only the slice is converted. Only programs lowered for the CPU take the ``cond``
    (elsewhere a ``cond`` per step may cost a device sync); other dtypes are sliced as they are."""
    def take(*arrays):
        return [jax.lax.dynamic_slice_in_dim(a, start, size, axis=axis) for a in arrays]

    if not any(jnp.dtype(a.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
               for a in arrays):
        return take(*arrays)

    def never(*arrays):  # start >= 0 always: the second branch only completes the cond
        return [jnp.zeros(a.shape[:axis] + (size,) + a.shape[axis + 1:], a.dtype) for a in arrays]

    def in_cond(*arrays):
        return jax.lax.cond(start >= 0, take, never, *arrays)

    return jax.lax.platform_dependent(*arrays, cpu=in_cond, default=take)
