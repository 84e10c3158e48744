"""Multi-device sharding on 8 host CPU devices: no collectives, and the single-device values.

The checks run in a subprocess (``sharding_checks.py``) started with
``--xla_force_host_platform_device_count=8``, so that this test session keeps its one device.
Layouts: tokens split (q, idx, bias, and g for the gathered form; kv and sink replicated) and heads
split (q and sink). Both kinds of mesh axes are covered: Auto (custom_partitioning) and Explicit
(shard_map; the default of ``jax.make_mesh`` in JAX 0.10).
"""

import pytest

import sharding_checks as checks
from conftest import run_on_8_devices

# One subprocess with 8 host devices compiles every layout: about 30 s on 2 cores.
pytestmark = [pytest.mark.slow, pytest.mark.oldest_jax_too]

IMPLEMENTATIONS = [None, "nki_emulated"]
AXIS_TYPES = ("Auto", "Explicit")
FORMS = ("idx", "gathered")


@pytest.fixture(scope="module")
def records():
    return run_on_8_devices("sharding_checks.py", *map(str, IMPLEMENTATIONS))


def _cases(prefix, with_implementation=False):
    return [
        f"{prefix}/{impl}/{a}/{f}/{lay}" if with_implementation else f"{prefix}/{a}/{f}/{lay}"
        for impl in (IMPLEMENTATIONS if with_implementation else [None])
        for a in AXIS_TYPES
        for f in FORMS
        for lay in checks.LAYOUTS
    ]


@pytest.mark.parametrize("name", _cases("forward", with_implementation=True))
def test_forward_is_collective_free_and_exact(records, name):
    r = records[name]
    assert r["exact"], r
    if name.startswith("forward/nki_emulated/Auto/") and name.endswith("/heads"):
        # A Python host callback cannot run inside a custom_partitioning body (JAX limitation),
        # so with automatic axes the emulated path is split over tokens whatever the operands'
        # layout: heads-split operands are resharded. Explicit axes keep every layout local.
        assert "all-reduce" not in r["collectives"], r
        return
    assert r["collectives"] == [], r


@pytest.mark.parametrize("name", _cases("grad_local"))
def test_local_gradients_need_no_communication(records, name):
    # q's gradient in both layouts, plus bias (tokens) or sink (heads): all stay on their device.
    r = records[name]
    assert r["collectives"] == [], r
    assert r["finite"] and r["max_abs_diff"] < 1e-5, r


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_gradient_of_the_emulated_kernel_is_local(records, axis_type):
    r = records[f"grad_local_emulated/{axis_type}/idx/tokens"]
    assert r["collectives"] == [], r
    assert r["finite"] and r["max_abs_diff"] < 1e-5, r


@pytest.mark.parametrize("name", _cases("grad_all"))
def test_all_gradients_only_sum_partials(records, name):
    # Gradients of replicated operands (kv, sink over tokens; kv, bias over heads) are sums over
    # devices: one all-reduce each, and never a gather of activations.
    r = records[name]
    assert r["collectives"] == ["all-reduce"], r
    assert r["finite"] and r["max_abs_diff"] < 1e-5, r


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_token_chunked_reference_stays_local(records, axis_type):
    # A loop over token blocks (long sequences) is what the partitioner cannot split by itself:
    # without the op's own partitioning this gathers the tokens.
    for name in (f"chunked_forward/{axis_type}", f"chunked_grad_local/{axis_type}"):
        r = records[name]
        assert r["collectives"] == [], r
        assert r["finite"] and r["max_abs_diff"] < 1e-5, r


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_two_dimensional_mesh_tokens_and_heads(records, axis_type):
    forward = records[f"mesh2d_forward/{axis_type}"]
    assert forward["collectives"] == [] and forward["exact"], forward
    grads = records[f"mesh2d_grad_all/{axis_type}"]
    assert grads["collectives"] == ["all-reduce"], grads
    assert grads["finite"] and grads["max_abs_diff"] < 1e-5, grads


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_vmap_over_a_sharded_batch_stays_local(records, axis_type):
    r = records[f"vmap/{axis_type}"]
    assert r["collectives"] == [], r
    assert r["exact"], r


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_inside_a_user_shard_map(records, implementation):
    r = records[f"shard_map/{implementation}"]
    assert r["collectives"] == [], r
    assert r["exact"], r


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("layout", ["tokens", "heads"])
def test_value_dim_and_two_caches_shard_like_the_plain_op(records, axis_type, layout):
    # value_dim < D and a second cache: the forward stays collective-free and exact, and the
    # gradients (q, both caches through src, sink, bias) only sum partials.
    forward = records[f"deepseek_forward/{axis_type}/{layout}"]
    assert forward["collectives"] == [] and forward["exact"], forward
    grad = records[f"deepseek_grad/{axis_type}/{layout}"]
    assert set(grad["collectives"]) <= {"all-reduce"} and grad["finite"], grad
    assert grad["max_abs_diff"] < 1e-4, grad
