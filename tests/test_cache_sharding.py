"""A KV cache split over its rows on 8 host CPU devices (subprocess: cache_sharding_checks.py).

Each device attends to the rows it holds and the partial results are merged by lse: the compiled
program's only collective is one all-gather of ``tokens x heads x (D + 1)`` values per device,
never anything with the cache's R rows; the result is within 2x of the single-device call's error
against the float64 oracle (max and mean), and the lse within 1e-5. Mesh axes Auto and Explicit;
rows alone, and rows with tokens or heads of q split over a second mesh axis.
"""

import pytest

import cache_sharding_checks as checks
from conftest import run_on_8_devices

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def records():
    return run_on_8_devices("cache_sharding_checks.py")


CASES = [f"{layout}/{axis_type}" for axis_type in ("Auto", "Explicit")
         for layout in ("rows", "tokens+rows", "heads+rows")] + ["rows/Explicit/nki_emulated"]
# Row shards of each case: 8 on the 1-D mesh, 4 on the (2, 4) mesh.
ROW_SHARDS = {"rows": 8, "tokens+rows": 4, "heads+rows": 4}


@pytest.mark.parametrize("name", CASES)
def test_only_the_merge_communicates(records, name):
    r = records[name]
    shards = ROW_SHARDS[name.split("/")[0]]
    per_device = checks.T * checks.H * (checks.D + 1)  # at most: less when q is split too
    assert [c["kind"] for c in r["collectives"]] == ["all-gather"], r["collectives"]
    for c in r["collectives"]:
        for shape in c["shapes"]:
            assert checks.R not in shape and checks.R // shards not in shape, c
            size = 1
            for n in shape:
                size *= n
            assert size <= shards * per_device, c


@pytest.mark.parametrize("name", CASES)
def test_error_within_twice_the_single_device_call(records, name):
    r = records[name]
    single, sharded = r["single"], r["sharded"]
    assert sharded["finite"] and sharded["lse_inf_exact"], r
    assert sharded["max_err"] <= 2 * single["max_err"], r
    assert sharded["mean_err"] <= 2 * single["mean_err"], r
    assert sharded["lse_rel_err"] <= 1e-5, r


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_results_keep_the_token_and_head_split(records, axis_type):
    assert records[f"tokens+rows/{axis_type}"]["out_sharding"] == ["x", "", ""]
    assert records[f"tokens+rows/{axis_type}"]["lse_sharding"] == ["x", ""]
    assert records[f"heads+rows/{axis_type}"]["out_sharding"] == ["", "x", ""]
    assert records[f"heads+rows/{axis_type}"]["lse_sharding"] == ["", "x"]


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_gradients_with_a_row_split_cache(records, axis_type):
    # The backward pass replicates the cache; its values are the single-device ones.
    r = records[f"grad/rows/{axis_type}"]
    assert r["finite"] and r["max_abs_diff"] < 1e-5, r


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("layout, spec", [("tokens", ["x", ""]), ("heads", ["", "x"])])
def test_lse_of_a_token_or_head_split_stays_local(records, axis_type, layout, spec):
    # A replicated cache: no communication at all; the single-device output and lse up to the
    # last place (XLA blocks the products and vectorises the log differently for other shapes).
    r = records[f"lse/{layout}/{axis_type}"]
    assert r["collectives"] == [] and r["out_within_one_ulp"] == 1.0 and r["lse_inf_same"], r
    assert r["lse_rel_diff"] <= 1e-6, r
    assert r["lse_sharding"] == spec, r


@pytest.mark.parametrize("form", ["fp8", "fp8+bf16-window", "fp8+fp8-window", "fp8-split"])
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_fp8_cache_split_over_rows(records, axis_type, form):
    # The gathered FP8 slots (T x K x D bytes) and their scales are summed over the devices; the
    # cache itself never moves, and the result is the single-device one (also beside a second,
    # replicated cache: V4's window, in bf16 or in FP8 with its own scales; and DeepSeek's split
    # rows, whose bf16 columns are split over the rows with the cache).
    r = records[f"{form}/rows/{axis_type}"]
    assert r["exact"], r
    assert {c["kind"] for c in r["collectives"]} == {"all-reduce"}, r
    for c in r["collectives"]:
        for shape in c["shapes"]:
            assert checks.R not in shape and checks.R // 8 not in shape, c
            assert shape[:2] == [checks.T, checks.K], c
