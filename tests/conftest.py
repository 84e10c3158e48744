import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(params=["x_first", "rows_first"])
def cpu_product_form(request, monkeypatch):
    """Runs a test under each of the reference's two forms of the dot products on CPU
    (``reference.slot_products``): the one for XLA's Eigen kernels (jax 0.7, or YNNPACK off) and
    the one for YNNPACK (jax 0.10), whichever this JAX would pick by itself."""
    import jax

    from jax_sparse_attn import reference

    monkeypatch.setattr(reference, "cpu_products_by_eigen", lambda: request.param == "x_first")
    jax.clear_caches()  # the primitives' lowerings are cached per shape
    yield request.param
    jax.clear_caches()


def run_on_8_devices(script: str, *args: str) -> dict:
    """Runs ``tests/<script>`` in a subprocess with 8 host CPU devices (this session keeps its one
    device) and returns the JSON records it prints, by their ``check`` name."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
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
