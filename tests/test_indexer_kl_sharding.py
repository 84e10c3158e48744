"""indexer_kl on 8 host CPU devices (subprocess: indexer_kl_sharding_checks.py).

Tokens and the teacher's heads split together (Auto and Explicit mesh axes), and the heads alone: the kl, the
mass and the gradients of the indexer's operands (for a mean over the tokens with a candidate,
the scaled residuals, and for a per-token cotangent, the fused pass again) equal the
single-device call's to f32 rounding (the head sums are summed across devices in another order).
With heads split the head sums take all-reduces (psum) before they are normalised; nothing of the
rows' or the tokens' full size travels.
"""

import pytest

import indexer_kl_sharding_checks as checks
from conftest import run_on_8_devices

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def records():
    return run_on_8_devices("indexer_kl_sharding_checks.py")


CASES = [f"{'sparse' if sparse else 'dense'}/{axis}/{layout}"
         for sparse, axis, layout in checks.CHECKS]


@pytest.mark.parametrize("name", CASES)
def test_split_gives_the_single_device_loss_and_gradients(records, name):
    r = records[name]
    assert r["finite"] and r["live_tokens"] >= checks.T - 2, r
    assert max(r["relative_errors"]) < 3e-6, r


@pytest.mark.parametrize("name", CASES)
def test_only_head_sums_and_key_gradients_travel(records, name):
    r = records[name]
    assert set(r["collectives"]) <= {"all-reduce"}, r
    if "heads" in name:
        assert r["collectives"] == ["all-reduce"], r  # the head sums
    # The largest: the keys' gradient [R, Di] (or a block of the head sums), never [T, H, ...].
    assert r["largest_collective"] <= max(checks.R * checks.DI, checks.T * checks.R), r
