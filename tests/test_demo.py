"""The demo, ``python -m jax_sparse_attn``: its options, and what it reports."""

import re

import pytest

from jax_sparse_attn import __main__ as demo
from jax_sparse_attn.bench import attention


def test_help_documents_implementation_shape_and_dtype(capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--implementation", "--shape", "--dtype", "nki_emulated", "decode-large-cache", "bf16"):
        assert option in text


def test_default_shape_is_the_decode_case_of_the_performance_table():
    page = (demo.__file__.rsplit("/jax_sparse_attn/", 1)[0] + "/docs/guides/performance.md")
    row = re.search(r"^\| decode \| ([0-9, ]+) \|", open(page).read(), flags=re.M)
    T, H, D, K, R = (int(v) for v in row.group(1).split(","))
    shape = demo.SHAPES["decode"]
    assert (shape.T, shape.H, shape.D, shape.K, shape.R) == (T, H, D, K, R) == (
        attention.SHAPES["decode"][0].T, attention.SHAPES["decode"][0].H, attention.SHAPES["decode"][0].D,
        attention.SHAPES["decode"][0].K, attention.SHAPES["decode"][0].R)


@pytest.mark.parametrize("implementation, dtype, says", [
    ("auto", "bf16", "the jnp reference"),
    ("nki_emulated", "bf16", "nki_emulated: the Neuron data path"),
    # The Neuron path rounds f16 to bf16: the demo checks the bf16 it computed.
    ("nki_emulated", "f16", "nki_emulated: the Neuron data path"),
])
def test_reports_the_implementation_the_naive_baseline_and_the_accuracy(capsys, implementation, dtype,
                                                                         says):
    code = demo.main(["--shape", "3,4,128,40,100", "--rounds", "2", "--implementation", implementation,
                      "--dtype", dtype])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"^implementation : " + re.escape(says), out, flags=re.M), out
    ratio = re.search(r"naive jnp +: ([0-9.]+) ms .* the op is ([0-9.]+)x (faster|slower)", out)
    assert ratio and float(ratio.group(1)) > 0, out
    flashmla = float(re.search(r"([0-9.]+)% of elements within FlashMLA's bound", out).group(1))
    assert flashmla >= 99.0
    within_ulp = float(re.search(r"vs contract +: ([0-9.]+)% of elements within 1 bf16 ulp", out).group(1))
    assert within_ulp >= 99.9


def test_refuses_an_empty_shape(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--shape", "0,4,128,40,100"])
    assert "at least 1" in capsys.readouterr().err
