"""The choice of the reference's CPU product form (jax_sparse_attn.cpu_products): from the CPU's
flags, once per process, with an override by environment variable."""

import numpy as np
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


@pytest.mark.parametrize("axis", [0, 1])
def test_loop_slices_take_the_rows_and_never_widen_a_whole_bf16_array(axis):
    # Each chunk is the array's own rows (bits included), and the compiled loop's temporaries hold
    # no f32 copy of the whole bf16 array (XLA:CPU makes and hoists one for a plain dynamic slice).
    import jax
    import jax.numpy as jnp

    from jax_sparse_attn.cpu_products import loop_slices

    shape = [4, 4, 64]
    shape[axis] = 1024
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    bits = jnp.asarray(x, jnp.bfloat16)
    ids = np.arange(1024, dtype=np.int32).reshape([-1 if a == axis else 1 for a in range(3)])
    ids = np.broadcast_to(ids, shape)
    size = 64

    def chunk_sums(a, i):
        def body(c, out):
            part, idx = loop_slices([a, i], c * size, size, axis=axis)
            assert part.dtype == a.dtype and idx.dtype == i.dtype
            return out.at[c].set(jnp.sum(part.astype(jnp.float32) * 2.0) + jnp.sum(idx))
        return jax.lax.fori_loop(0, 1024 // size, body, jnp.zeros(1024 // size))

    fn = jax.jit(chunk_sums)
    got = np.asarray(fn(bits, jnp.asarray(ids)))
    want_x = np.asarray(bits.astype(jnp.float32), np.float64)
    for c in range(1024 // size):
        sl = [slice(None)] * 3
        sl[axis] = slice(c * size, (c + 1) * size)
        want = 2.0 * want_x[tuple(sl)].sum() + ids[tuple(sl)].sum()
        np.testing.assert_allclose(got[c], want, rtol=1e-5)
    temp = fn.lower(bits, jnp.asarray(ids)).compile().memory_analysis().temp_size_in_bytes
    assert temp < x.size * 4 // 2, temp  # half of an f32 copy of the whole array
