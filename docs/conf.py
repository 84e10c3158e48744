"""Sphinx configuration of jax-sparse-attn's documentation site (docs/README.md says how to build it)."""

import inspect
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's package, as the tests import it

project = "jax-sparse-attn"
author = "the jax-sparse-attn authors"
copyright = "2026, the jax-sparse-attn authors"

extensions = [
    "myst_nb",  # MyST pages and notebooks (it loads myst_parser itself)
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the package's docstrings use Google-style sections (Args:, Returns:)
]

# The notebooks render from their stored outputs: executing them would need Flax, multi-device
# subprocesses and minutes of CPU, and tests/test_notebooks.py already runs them (docs/README.md).
nb_execution_mode = "off"
myst_heading_anchors = 4  # `page.md#section` links resolve, and -W fails the build where they do not
myst_enable_extensions = ["dollarmath"]

root_doc = "index"
exclude_patterns = ["_build", "README.md", ".ipynb_checkpoints"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # a class's Attributes: as fields, not a second description of its members

html_theme = "alabaster"
html_title = "jax-sparse-attn"


def _warn_if_undocumented(app, what, name, obj, options, lines):
    # autodoc renders an object without a docstring silently; under -W this warning fails the build.
    if what in ("function", "class", "method", "data") and not inspect.getdoc(obj) and not any(
            line.strip() for line in lines):
        from sphinx.util import logging

        logging.getLogger(__name__).warning("%s %s has no docstring", what, name)


def setup(app):
    app.connect("autodoc-process-docstring", _warn_if_undocumented)
