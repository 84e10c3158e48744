"""How the Neuron path plugs into JAX on a machine without Neuron: a clean import, a clear error
for implementation="nki", the lazy "neuron" rule registration, and the emulated path's host
callback."""

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_attn as jsa
from jax_sparse_attn.attention import primitive
from jax_sparse_attn.attention import neuron


def test_import_never_warns_or_imports_the_neuron_sdk():
    code = (
        "import sys, jax_sparse_attn\n"
        "assert 'nki' not in sys.modules, 'the Neuron SDK was imported eagerly'\n"
        "assert 'jax_sparse_attn.nki_emulator' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True)


@pytest.mark.parametrize("indexed", [False, True])
def test_nki_without_the_sdk_is_a_clear_error_at_trace_time(indexed):
    q = jnp.ones((2, 4, 64), jnp.bfloat16)
    kv = jnp.ones((8, 64), jnp.bfloat16)
    idx = jnp.zeros((2, 3), jnp.int32)

    def f(q, kv, idx):
        if indexed:
            return jsa.gathered_attn_idx(q, kv, idx, implementation="nki")
        return jsa.gathered_attn(q, kv[idx], implementation="nki")

    with pytest.raises(RuntimeError, match=r"Neuron pip repository.*nki_emulated"):
        jax.eval_shape(f, q, kv, idx)


def test_nki_emulated_is_a_registered_path():
    assert primitive.path("nki_emulated", False) is neuron.emulated_gathered_attn_lse
    assert primitive.path("nki_emulated", True) is neuron.emulated_gathered_attn_idx_lse


def test_emulated_path_runs_through_a_host_callback():
    q = jnp.ones((2, 4, 64), jnp.bfloat16)
    kv = jnp.ones((8, 64), jnp.bfloat16)
    idx = jnp.zeros((2, 3), jnp.int32)
    f = jax.jit(lambda q, kv, idx: jsa.gathered_attn_idx(q, kv, idx, implementation="nki_emulated"))
    jaxpr = str(jax.make_jaxpr(f)(q, kv, idx))
    assert "gathered_attn_idx" in jaxpr  # the primitive stays visible
    hlo = f.lower(q, kv, idx).as_text()
    assert "callback" in hlo.lower()
    reference = jax.jit(lambda q, kv, idx: jsa.gathered_attn_idx(q, kv, idx))
    assert "callback" not in reference.lower(q, kv, idx).as_text().lower()


def test_neuron_rules_wait_for_jax_to_know_the_platform(monkeypatch):
    """Registration is attempted from JAX's plugin callbacks; for an unknown platform JAX raises
    NotImplementedError, which must be swallowed (and retried at the next plugin)."""
    calls = []

    def register_lowering(prim, rule, platform=None):
        calls.append((prim, platform))
        if not known:
            raise NotImplementedError(f"Registering a lowering for an unknown platform {platform}")

    monkeypatch.setattr(neuron.mlir, "register_lowering", register_lowering)
    monkeypatch.setattr(neuron, "_neuron_lowerings_registered", False)

    known = False
    assert neuron.register_neuron_lowerings(c_api=object()) is False
    known = True
    calls.clear()
    assert neuron.register_neuron_lowerings(c_api=object()) is True
    assert calls == [
        (primitive.gathered_attn_p, "neuron"),
        (primitive.gathered_attn_idx_p, "neuron"),
    ]
    calls.clear()
    assert neuron.register_neuron_lowerings(c_api=object()) is True  # once only
    assert calls == []


def test_on_this_machine_no_neuron_rule_is_registered():
    assert neuron.register_neuron_lowerings() is False


@pytest.mark.slow
def test_neuron_rule_dispatch(monkeypatch):
    """On the "neuron" platform: None and "nki" take the kernel path, the others their own path."""
    seen = []
    monkeypatch.setattr(neuron, "nki_gathered_attn_idx_lse",
                        lambda q, kv, idx, sink, *a, value_dim=None, **named:
                        seen.append("kernel") or (q, sink))
    rule = functools.partial(neuron._neuron_rule, layout=primitive.Layout(), value_dim=64)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((8, 64)), jnp.bfloat16)
    idx = jnp.asarray([[0, 1, -1], [2, -1, -1]], jnp.int32)
    sink = jnp.full((4,), -jnp.inf, jnp.float32)
    bias = jnp.zeros((2, 3), jnp.float32)
    scale = jnp.full((2,), 0.125, jnp.float32)
    args = (q, kv, idx, sink, bias, scale)

    rule(*args, implementation=None)
    rule(*args, implementation="nki")
    assert seen == ["kernel", "kernel"]
    # Every rule returns (out, lse).
    for got, want in zip(rule(*args, implementation="reference"),
                         primitive.path("reference", True)(*args, value_dim=64)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert seen == ["kernel", "kernel"]


@pytest.mark.parametrize("indexed", [False, True])
def test_nki_emulated_on_the_neuron_platform_is_a_clear_error(indexed):
    """JAX on Neuron has no host callbacks: the "neuron" rule refuses nki_emulated, naming the
    limitation and the CPU backend."""
    layout = primitive.Layout() if indexed else primitive.PREGATHERED
    q = jnp.ones((2, 4, 64), jnp.bfloat16)
    args = (q, jnp.ones((8, 64), jnp.bfloat16)) + ((jnp.zeros((2, 3), jnp.int32),) if indexed else ())
    args += (jnp.zeros((4,)), jnp.zeros((2, 3)), jnp.ones((2,)))
    with pytest.raises(NotImplementedError, match=r"host callbacks.*Neuron.*jax\.devices\('cpu'\)"):
        neuron._neuron_rule(*args, layout=layout, implementation="nki_emulated", value_dim=64)


@pytest.mark.parametrize(
    "value, target",
    [(None, "trn2"), ("", "trn2"), ("trn1", "trn1"), ("gen2", "trn1"), ("trn2", "trn2"),
     ("gen3", "trn2"), ("TRN3", "trn3"), ("gen4", "trn3")],
)  # fmt: skip
def test_neuron_target_follows_the_nki_variable(monkeypatch, value, target):
    if value is None:
        monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    else:
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", value)
    assert neuron.neuron_target() == target


def test_neuron_target_rejects_an_unknown_value(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "inf2")
    with pytest.raises(ValueError, match="NEURON_PLATFORM_TARGET_OVERRIDE"):
        neuron.neuron_target()


@pytest.mark.parametrize("value, programs", [(None, 2), ("1", 1), ("2", 2)])
def test_launch_grid_matches_the_logical_core(monkeypatch, value, programs):
    """kernel[n] with n the physical cores of a logical core: 2 on trn2/trn3 by default (LNC=2),
    NEURON_LOGICAL_NC_CONFIG when set; trn1 has no logical cores."""
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    if value is None:
        monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    else:
        monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", value)
    assert neuron.launch_programs("trn2") == programs
    assert neuron.launch_programs("trn3") == programs
    assert neuron.launch_programs("trn1") == 1


@pytest.mark.parametrize("flags, env, programs", [
    ("--lnc=1", None, 1), ("--lnc 1", None, 1), ("-O1 --logical-nc-config 1", None, 1),
    ("-lnc=2 --verbose", None, 2), ("--lnc=1", "1", 1), ("--lnc=2", "2", 2), ("-O2", "1", 1),
])  # fmt: skip
def test_launch_grid_is_the_compilers_lnc(monkeypatch, flags, env, programs):
    """The launch grid follows neuronx-cc's --lnc in NEURON_CC_FLAGS as well as
    NEURON_LOGICAL_NC_CONFIG (NKI 0.7: a kernel LNC other than the compiler's is NCC_EVRF066)."""
    monkeypatch.setenv("NEURON_CC_FLAGS", flags)
    if env is None:
        monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    else:
        monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", env)
    assert neuron.launch_programs("trn2") == programs
    assert neuron.launch_programs("trn3") == programs


@pytest.mark.parametrize("flags, env, match", [
    ("--lnc=1", "2", "passes --lnc=1 to neuronx-cc but NEURON_LOGICAL_NC_CONFIG=2"),
    ("--lnc=2", "1", "passes --lnc=2 to neuronx-cc but NEURON_LOGICAL_NC_CONFIG=1"),
    ("--lnc", None, "NEURON_CC_FLAGS='--lnc': --lnc has no value"),
    ("--lnc=4", None, "NEURON_CC_FLAGS='--lnc=4' .--lnc.: the LNC degree is 1 or 2"),
    ("--lnc=$LNC", None, "the LNC degree is 1 or 2, got '\\$LNC'"),
    ("--lnc=1 -lnc=2", None, "sets the LNC degree twice"),
    ("'--lnc=1", None, "NEURON_CC_FLAGS=.* cannot be parsed"),
    (None, "3", "NEURON_LOGICAL_NC_CONFIG='3': the LNC degree is 1 or 2"),
])  # fmt: skip
def test_launch_grid_refuses_a_mismatch_or_an_unknown_lnc(monkeypatch, flags, env, match):
    """A mismatch between the compiler's and the runtime's LNC, or a setting that cannot be read,
    is a clear error naming the variable, never a kernel of the wrong LNC."""
    for name, value in (("NEURON_CC_FLAGS", flags), ("NEURON_LOGICAL_NC_CONFIG", env)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        neuron.launch_programs("trn2")


def test_trn1_refuses_a_compiler_lnc_of_2(monkeypatch):
    monkeypatch.setenv("NEURON_CC_FLAGS", "--lnc=2")
    with pytest.raises(ValueError, match="NCC_EARG001"):
        neuron.launch_programs("trn1")
    monkeypatch.setenv("NEURON_CC_FLAGS", "--lnc=1")
    assert neuron.launch_programs("trn1") == 1


def test_trn1_runs_only_the_kernel_without_indirect_dma():
    """Under the emulator's trn1 target (which rejects indirect DMA and dma_transpose) the
    pre-gathered kernel runs and the indexed one is refused."""
    from jax_sparse_attn.attention import kernel as kernels
    from jax_sparse_attn.nki_emulator import NkiEmulatorError, simulate

    rng = np.random.default_rng(1)
    T, H, D, Kp, R = 2, 8, 128, 128, 50
    bias = np.zeros((T, 16 + Kp), np.float32)
    bias[:, 0] = 0.1
    q = rng.standard_normal((T, H, D)).astype(jnp.bfloat16)
    sink = np.zeros((H, 1), np.float32)
    g = rng.standard_normal((T, Kp, D)).astype(jnp.bfloat16)
    out, lse = simulate(kernels.gathered_attn_kernel, target="trn1")(q, g, bias, sink)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    kv = rng.standard_normal((R, D)).astype(jnp.bfloat16)
    idx = rng.integers(0, R, (T, 128, Kp // 128)).astype(np.uint32)
    with pytest.raises(NkiEmulatorError):
        simulate(kernels.gathered_attn_idx_kernel, target="trn1")(q, kv, idx, bias, sink)


def test_the_neuron_extra_is_the_supported_range():
    """pyproject's `neuron` extra, the install hint and the emulator's version table say the same
    (docs/guides/trainium.md, "Running on Trainium"): one list, NEURON_REQUIREMENTS."""
    tomllib = pytest.importorskip("tomllib")
    from pathlib import Path

    from jax_sparse_attn.nki_emulator import versions

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert tuple(extras["neuron"]) == versions.NEURON_REQUIREMENTS
    for requirement in versions.NEURON_REQUIREMENTS:
        assert f"'{requirement}'" in neuron.install_hint()
    assert set(versions.SDK_RELEASES) == set(versions.SUPPORTED_VERSIONS)
    for version, release in versions.SDK_RELEASES.items():
        assert release.nki.startswith(version + ".")
        assert release.sdk.startswith(versions.SDK_OF_VERSION[version] + ".")
        assert f"{release.sdk} (NKI {release.nki})" in neuron.install_hint()


def test_one_table_picks_the_kernel_by_layout_and_target():
    """neuron.KERNELS: the kernel that reads a layout's operands on trn2/trn3; on trn1, for an
    empty cache, or an FP8 second cache laid out unlike the main one, XLA gathers the slots for
    the pre-gathered kernel (None). Each entry's arguments are its kernel's required ones."""
    import inspect

    from jax_sparse_attn.attention import kernel as kernels

    S = jax.ShapeDtypeStruct
    T, K, R = 2, 3, 8
    f32, bf16, fp8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn

    def ops(D=192, **parts):
        return primitive.AttnOperands(q=S((T, 4, D), bf16), sink=S((4,), f32),
                                      bias=S((T, K), f32), scale=S((T,), f32), **parts)

    def fp8_cache(prefix="", rows=R, groups=2, rope=64):
        parts = {prefix + "kv": S((rows, 128), fp8), prefix + "kv_scale": S((rows, groups), f32),
                 prefix + "kv_rope": S((rows, rope), bf16)}
        return parts | {"extra_idx": S((T, K), jnp.int32), "extra_bias": S((T, K), f32)} \
            if prefix else parts | {"idx": S((T, K), jnp.int32)}

    def name(target, operands):
        variant = neuron.kernel_reading(target, operands)
        return None if variant is None else variant.name

    plain = {"kv": S((R, 192), bf16), "idx": S((T, K), jnp.int32)}
    window = {"extra_kv": S((16, 192), bf16), "extra_idx": S((T, K), jnp.int32),
              "extra_bias": S((T, K), f32)}
    for target in ("trn1", "trn2", "trn3"):
        assert name(target, ops(g=S((T, K, 192), bf16))) == "gathered_attn_kernel"
    assert name("trn1", ops(**plain)) is None
    assert name("trn1", ops(**fp8_cache(), **window)) is None
    assert name("trn2", ops(**plain)) == "gathered_attn_idx_kernel"
    assert name("trn3", ops(**plain, **window)) == "gathered_attn_idx_two_caches_kernel"
    assert name("trn2", ops(**fp8_cache())) == "gathered_attn_idx_fp8_split_kernel"
    assert name("trn2", ops(**fp8_cache(), **window)) == (
        "gathered_attn_idx_fp8_split_beside_16bit_kernel")
    assert name("trn2", ops(**fp8_cache(), **fp8_cache("extra_"))) == (
        "gathered_attn_idx_fp8_split_two_caches_kernel")
    # An FP8 second cache of other scale groups or rope width, or an empty cache: XLA gathers.
    assert name("trn2", ops(**fp8_cache(), **fp8_cache("extra_", groups=4))) is None
    assert name("trn2", ops(**fp8_cache(), **fp8_cache("extra_", rope=32))) is None
    assert name("trn2", ops(**fp8_cache(rows=0))) is None
    for variant in neuron.KERNELS.values():
        parameters = inspect.signature(getattr(kernels, variant.name)).parameters.values()
        required = [p for p in parameters if p.default is inspect.Parameter.empty]
        assert len(required) == len(variant.args), variant.name
