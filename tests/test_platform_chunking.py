"""Platform-aware chunking: CPU cache-sized token chunks, GPU/TPU chunks that follow device memory.

The programs are lowered for a platform other than the host's (no GPU is needed to lower for
``cuda``), and their loop structure is read from the StableHLO text: the number of
``stablehlo.while`` loops and the trip count in the loop's condition.
"""

import re

import jax
import jax.numpy as jnp
import pytest

import jax_sparse_attn as jsa
from jax_sparse_attn.attention import autodiff, reference

H, D, K, R = 16, 512, 2048, 65536


def _lowered_text(fn, args, platform):
    jitted = jax.jit(lambda *a: fn(*a))  # a new function: no trace cached under another budget
    if hasattr(jitted, "trace"):
        return jitted.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    return jax.export.export(jitted, platforms=(platform,))(*args).mlir_module()  # older JAX


def _forward_args(T):
    return (
        jax.ShapeDtypeStruct((T, H, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((R, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((T, K), jnp.int32),
    )


def _trip_counts(text):
    """The constant bound of every ``while`` loop's ``i < n`` condition, in order."""
    counts = []
    for match in re.finditer(r"stablehlo\.while", text):
        cond = text[match.start(): match.start() + 2000]
        bound = re.search(r"cond \{\s*%(\w+) = stablehlo\.constant dense<(\d+)>", cond)
        counts.append(int(bound.group(2)) if bound else None)
    return counts


def _forward(q, kv, idx):
    return jsa.gathered_attn_idx(q, kv, idx, implementation="reference")


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_prefill_that_fits_is_one_batched_call_on_accelerators(platform):
    # T=512, H=16, D=512, K=2048: about 1.2 GiB of working set, within the default budget
    assert reference.token_chunk_size(512, H, K, D, 2, reference.ACCELERATOR_CHUNK_BYTES_DEFAULT) == 512
    text = _lowered_text(_forward, _forward_args(512), platform)
    assert _trip_counts(text) == []


def test_cpu_runs_cache_sized_chunks():
    text = _lowered_text(_forward, _forward_args(512), "cpu")
    chunk = reference.token_chunk_size(512, H, K, D, 2)
    assert chunk < 512
    assert _trip_counts(text) == [512 // chunk]  # lax.map: whole chunks in the loop


def test_long_prefill_on_accelerators_runs_few_large_chunks():
    T = 4096
    chunk = reference.token_chunk_size(T, H, K, D, 2, reference.ACCELERATOR_CHUNK_BYTES_DEFAULT)
    assert 1 < T // chunk < 10
    text = _lowered_text(_forward, _forward_args(T), "cuda")
    assert _trip_counts(text) == [T // chunk]


def test_accelerator_chunk_follows_device_memory(monkeypatch):
    T = 4096
    # an accelerator with 141 GiB: an eighth of it holds every token's working set at once
    monkeypatch.setattr(reference, "accelerator_chunk_bytes", lambda: int(141 * 2**30 / 8))
    assert _trip_counts(_lowered_text(_forward, _forward_args(T), "cuda")) == []
    # one with 2 GiB: 256 MiB chunks
    monkeypatch.setattr(reference, "accelerator_chunk_bytes", lambda: 2**28)
    chunk = reference.token_chunk_size(T, H, K, D, 2, 2**28)
    assert _trip_counts(_lowered_text(_forward, _forward_args(T), "cuda")) == [T // chunk]


class _FakeDevice:
    platform = "gpu"

    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit}


def test_accelerator_budget_is_a_fraction_of_the_device_memory(monkeypatch):
    monkeypatch.setattr(jax, "devices", lambda *a: [_FakeDevice(80 * 2**30)])
    assert reference.accelerator_chunk_bytes() == int(80 * 2**30 * reference.ACCELERATOR_MEMORY_FRACTION)
    monkeypatch.setattr(jax, "devices", lambda *a: [_FakeDevice(None)])
    assert reference.accelerator_chunk_bytes() == reference.ACCELERATOR_CHUNK_BYTES_DEFAULT


def test_backward_chunks_follow_the_platform():
    T = 512

    def grad(q, kv, idx):
        return jax.grad(lambda q, kv: jnp.sum(_forward(q, kv, idx).astype(jnp.float32)), argnums=(0, 1))(q, kv)

    cpu_chunk = autodiff._chunk_size(jax.ShapeDtypeStruct((T, H, D), jnp.bfloat16), K)
    accelerator_chunk = autodiff._chunk_size(
        jax.ShapeDtypeStruct((T, H, D), jnp.bfloat16), K, reference.ACCELERATOR_CHUNK_BYTES_DEFAULT
    )
    assert cpu_chunk < accelerator_chunk
    cpu_loops = _trip_counts(_lowered_text(grad, _forward_args(T), "cpu"))
    cuda_loops = _trip_counts(_lowered_text(grad, _forward_args(T), "cuda"))
    assert -(-T // cpu_chunk) in cpu_loops  # the backward's scan (beside the forward's loop)
    assert -(-T // accelerator_chunk) in cuda_loops
    assert -(-T // cpu_chunk) not in cuda_loops
