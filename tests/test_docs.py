"""The documentation site: every public name has a docstring of its own and a place in the API
reference (docs/api.md), and the site builds with warnings as errors (docs/README.md)."""

import importlib
import inspect
import pathlib
import re
import subprocess
import sys

import pytest

import jax_sparse_attn

ROOT = pathlib.Path(__file__).resolve().parent.parent
API_PAGE = (ROOT / "docs" / "api.md").read_text()
MODULES = ["jax_sparse_attn", "jax_sparse_attn.deepseek", "jax_sparse_attn.flax"]


def public_names():
    """(module, name) of every public name: each module's ``__all__``, less the version string."""
    for module in MODULES:
        for name in importlib.import_module(module).__all__:
            if name != "__version__":
                yield module, name


def own_docstring(module, name):
    """The docstring written for this name: a function's or class's own ``__doc__`` (not one it
    inherits), a primitive's, or for a module-level constant its ``#:`` comment, as autodoc reads
    it."""
    obj = getattr(importlib.import_module(module), name)
    if inspect.isclass(obj):
        doc = vars(obj).get("__doc__")
        # dataclasses and NamedTuples without a docstring get their signature as one
        return None if doc and doc.startswith(f"{name}(") else doc
    if inspect.isfunction(obj) or type(obj).__name__ == "Primitive":
        return obj.__doc__
    # A constant (a config): its `#:` comment in the module that defines its class.
    source = inspect.getsource(inspect.getmodule(type(obj)))
    comment = re.search(rf"((?:^#:.*\n)+)^{re.escape(name)} = ", source, flags=re.M)
    return comment and comment.group(1)


@pytest.mark.parametrize("module, name", list(public_names()))
def test_every_public_name_has_a_docstring(module, name):
    doc = own_docstring(module, name)
    assert doc and doc.strip(), f"{module}.{name} has no docstring of its own"


@pytest.mark.parametrize("module, name", list(public_names()))
def test_every_public_name_is_in_the_api_reference(module, name):
    # Each module's names follow its `.. module::` line, up to the next one.
    section = API_PAGE.split(f".. module:: {module}\n", 1)[1].split(".. module::", 1)[0]
    assert re.search(rf"^\.\. auto(function|class|data):: {re.escape(name)}$", section, flags=re.M), (
        f"docs/api.md does not document {module}.{name}")


def test_the_primitives_are_documented_with_their_functions():
    for function in ("gathered_attn", "gathered_attn_idx", "indexer_topk", "compress_pool"):
        primitive = getattr(jax_sparse_attn, f"{function}_p")
        assert f":func:`jax_sparse_attn.{function}`" in primitive.__doc__


@pytest.mark.slow  # about 10 s: Sphinx imports the package and Flax, and renders every page
def test_the_site_builds_with_warnings_as_errors(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_nb")
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           str(ROOT / "docs"), str(tmp_path / "html")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    for page in ("index", "api", "guides/semantics", "notebooks/07_deepseek_v4"):
        assert (tmp_path / "html" / f"{page}.html").is_file(), page
    api = (tmp_path / "html" / "api.html").read_text()
    assert "gathered_attn_idx_p" in api and "V4Attention" in api and "SparseAttention" in api
