import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

TESTS = Path(__file__).resolve().parent

# Most of the tests' time is XLA compiling small programs, and most of that is LLVM optimising the
# machine code. The tests (and the subprocesses they start, which inherit the environment) compile
# with LLVM's optimisation off: XLA's own passes still run, so the programs are the same, and only
# how fast they run and f32's last bit can differ (measured up to 2.4e-7; FMA contraction,
# inferred). The fresh-process memory checks, which run long shapes, compile at XLA's default
# level (`xla_default_optimization`).
# The suite checks the CPU's programs (its product forms, chunk budgets and loop structure) as
# well as behaviour, so it runs on the CPU even where JAX has a GPU, unless JAX_PLATFORMS says
# otherwise: `JAX_PLATFORMS=cuda,cpu` runs the behavioural files there (benchmarks/gpu_records.sh).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAG}".strip()


@pytest.fixture
def xla_default_optimization(monkeypatch):
    """Subprocesses started in this test compile at XLA's default optimisation level: the memory
    checks' long shapes run several times slower without LLVM's optimisation."""
    flags = os.environ.get("XLA_FLAGS", "").replace(FAST_COMPILE_FLAG, "").strip()
    if flags:
        monkeypatch.setenv("XLA_FLAGS", flags)
    else:
        monkeypatch.delenv("XLA_FLAGS", raising=False)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# The reference's CPU product forms (jax_sparse_attn.cpu_products): operands widened to f32 or
# not, each in the layout for YNNPACK and in the one for XLA's Eigen kernels (those in the slow
# run: the default run keeps the two that current jaxlib picks, CI runs all four).
CPU_PRODUCT_FORMS = ["native", "f32", pytest.param("native-x-first", marks=pytest.mark.slow),
                     pytest.param("f32-x-first", marks=pytest.mark.slow)]


def _under_form(name):
    import jax

    from jax_sparse_attn import cpu_products

    jax.clear_caches()  # the primitives' lowerings are cached per shape, not per form
    with cpu_products.forced(cpu_products.parse_form(name)):
        yield name
    jax.clear_caches()


@pytest.fixture(params=CPU_PRODUCT_FORMS)
def cpu_product_form(request):
    """Runs a test under each form of the reference's products on CPU, whatever this CPU and JAX
    would pick by themselves (``cpu_products.forced``)."""
    yield from _under_form(request.param)


@pytest.fixture(params=["native", pytest.param("f32-x-first", marks=pytest.mark.slow)])
def cpu_product_layout(request):
    """For the backward, whose products are f32 in every form: each of its two layouts (the
    forward it differentiates runs in the paired form; the Eigen layout in the slow run)."""
    yield from _under_form(request.param)


def run_on_8_devices(script: str, *args: str, default_optimization: bool = False) -> dict:
    """Runs ``tests/<script>`` in a subprocess with 8 host CPU devices (this session keeps its one
    device) and returns the JSON records it prints, by their ``check`` name.
    ``default_optimization``: compile at XLA's default level, as users do, where the script
    compares two programs' f32 bits (without LLVM's optimisation their last bits may differ)."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if default_optimization:
        flags = flags.replace(FAST_COMPILE_FLAG, "")
    env["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS.parent), str(TESTS),
                                                      env.get("PYTHONPATH")]))
    env.pop("JAX_NUM_CPU_DEVICES", None)
    # XLA's CPU client sizes its thread pool by the host's cores. With 8 virtual devices on a
    # small host, 8 per-device host callbacks (nki_emulated) can hold every pool thread while
    # JAX's callback wrapper waits on a copy that needs one more: a deadlock seen on 2 cores.
    env.setdefault("PJRT_NPROC", "16")
    proc = subprocess.run([sys.executable, str(TESTS / script), *args], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["check"]: r for r in found}

