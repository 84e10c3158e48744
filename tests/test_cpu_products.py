"""The choice of the reference's CPU product form (jax_sparse_attn.cpu_products): from the CPU's
flags, once per process, with an override by environment variable."""

import pytest

from jax_sparse_attn import cpu_products

ZEN3 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma bmi2\n"
ZEN4 = "flags\t\t: avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni\n"
ICE_LAKE = "flags\t\t: avx2 fma avx512f avx512bw avx512_vnni\n"  # AVX-512, no BF16
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f amx_bf16 amx_tile\n"
NEOVERSE_V1 = "Features\t: fp asimd sve bf16 i8mm\n"
NEOVERSE_N1 = "Features\t: fp asimd crc32 atomics\n"


@pytest.mark.parametrize("cpuinfo, native", [
    (ZEN3, False), (ZEN4, True), (ICE_LAKE, False), (SAPPHIRE_RAPIDS, True),
    (NEOVERSE_V1, True), (NEOVERSE_N1, False), ("", False),
])
def test_native_bf16_is_read_from_the_cpu_flags(cpuinfo, native):
    assert cpu_products.cpu_reports_native_bf16(cpuinfo) is native


@pytest.mark.parametrize("cpuinfo, amx", [(ZEN4, False), (SAPPHIRE_RAPIDS, True), ("", False)])
def test_amx_is_read_from_the_cpu_flags(cpuinfo, amx):
    assert cpu_products.cpu_reports_amx(cpuinfo) is amx


def test_only_native_products_without_amx_or_eigen_are_shape_invariant(monkeypatch):
    monkeypatch.setattr(cpu_products, "products_by_eigen", lambda: False)
    for amx in (False, True):
        monkeypatch.setattr(cpu_products, "cpu_reports_amx", lambda cpuinfo=None, amx=amx: amx)
        assert cpu_products.shape_invariant(cpu_products.parse_form("native")) is not amx
        assert not cpu_products.shape_invariant(cpu_products.parse_form("f32"))
    monkeypatch.setattr(cpu_products, "products_by_eigen", lambda: True)
    assert not cpu_products.shape_invariant(cpu_products.parse_form("native"))


def with_env(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(cpu_products.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(cpu_products.ENV_VAR, value)
    cpu_products._chosen_operands.cache_clear()
    cpu_products._detected_form.cache_clear()


@pytest.fixture
def fresh_choice(monkeypatch):
    yield lambda value: with_env(monkeypatch, value)
    monkeypatch.undo()
    cpu_products._chosen_operands.cache_clear()
    cpu_products._detected_form.cache_clear()


@pytest.mark.parametrize("value", ["native", "f32", " F32 "])
def test_environment_variable_overrides_the_cpu(fresh_choice, value):
    fresh_choice(value)
    assert cpu_products.cpu_product_form() == value.strip().lower()
    assert cpu_products.cpu_form().widen is (value.strip().lower() == "f32")
    with cpu_products.forced(cpu_products.parse_form("native" if "f32" in value.lower() else "f32")):
        assert cpu_products.cpu_product_form() != value.strip().lower()  # forced wins


def test_without_override_the_cpu_decides(fresh_choice, monkeypatch):
    fresh_choice(None)
    monkeypatch.setattr(cpu_products, "cpu_reports_native_bf16", lambda cpuinfo=None: True)
    assert cpu_products.cpu_product_form() == "native"
    cpu_products._chosen_operands.cache_clear()
    cpu_products._detected_form.cache_clear()
    monkeypatch.setattr(cpu_products, "cpu_reports_native_bf16", lambda cpuinfo=None: False)
    assert cpu_products.cpu_product_form() == "f32"


def test_bad_override_names_the_variable(fresh_choice):
    fresh_choice("bf16")
    with pytest.raises(ValueError, match=cpu_products.ENV_VAR):
        cpu_products.cpu_product_form()


def test_form_names_round_trip_and_forced_nests():
    for name in ("native", "f32", "native-x-first", "f32-x-first"):
        assert cpu_products.form_name(cpu_products.parse_form(name)) == name
    with pytest.raises(ValueError, match="native or f32"):
        cpu_products.parse_form("f32-rows")
    outer, inner = cpu_products.parse_form("f32"), cpu_products.parse_form("native-x-first")
    before = cpu_products.cpu_form()
    with cpu_products.forced(outer):
        with cpu_products.forced(inner):
            assert cpu_products.cpu_form() == inner
        assert cpu_products.cpu_form() == outer
    assert cpu_products.cpu_form() == before
