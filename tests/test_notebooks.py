"""Executes every notebook in notebooks/ with nbclient; a cell that raises fails the test.

The kernel is the interpreter running the tests: a kernelspec for ``sys.executable`` is written into a
temporary directory and found through ``JUPYTER_PATH``, so this works in a fresh virtual environment
without touching the user's Jupyter setup, and the notebooks import this checkout of the package.

``python tests/test_notebooks.py [NAME ...]`` re-executes the notebooks in place (outputs included),
which is how the committed outputs are produced.
"""

import os
import pathlib
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
kernelspec = pytest.importorskip("ipykernel.kernelspec")
pytest.importorskip("flax")

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL_NAME = "jax-sparse-attn-tests"
CELL_TIMEOUT_S = 300


def kernel_environment(directory: pathlib.Path) -> dict:
    """Installs a kernelspec for this interpreter under ``directory``; returns the env to set."""
    kernelspec.install(prefix=str(directory), kernel_name=KERNEL_NAME, display_name="Python 3")
    path = os.environ.get("PYTHONPATH")
    return {
        "JUPYTER_PATH": str(directory / "share" / "jupyter"),
        # The notebooks must import this checkout, installed or not.
        "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""),
    }


def execute(notebook_path: pathlib.Path):
    """Runs every cell of the notebook (from its own directory); returns the executed notebook."""
    nb = nbformat.read(notebook_path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name=KERNEL_NAME,
        timeout=CELL_TIMEOUT_S,
        record_timing=False,
        resources={"metadata": {"path": str(notebook_path.parent)}},
    )
    client.execute()
    return nb


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS] == [
        "01_quickstart.ipynb",
        "02_flax_model.ipynb",
        "03_neuron_path.ipynb",
        "04_performance.ipynb",
        "05_long_context.ipynb",
        "06_long_context_indexer.ipynb",
        "07_deepseek_v4.ipynb",
        "08_training_sparse_attention.ipynb",
    ]


def png_outputs(nb) -> int:
    """Number of inline PNG images among the notebook's outputs."""
    return sum("image/png" in out.get("data", {})
               for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", []))


# The figures each notebook shows (loss curve, rows selected per token; time against K and T,
# memory against T; the rows a V4 token reads, V4 decode time and memory against the context; the
# indexer's KL and its top-k's share of the teacher's mass over the training steps):
# committed with their outputs, so they render where the notebook is read.
FIGURES = {"02_flax_model": 2, "04_performance": 2, "06_long_context_indexer": 1, "07_deepseek_v4": 2,
           "08_training_sparse_attention": 1}

# Set for the notebooks under the test: a notebook that reads it runs its cells at toy sizes (02
# trains a tenth of its steps, 06 runs toy shapes, 07 a narrower V4 layer over shorter sequences,
# 08 a tenth of its warm-up and two sparse steps over shorter sequences);
# a user who runs one gets the real sizes, and so do its committed outputs.
SMALL_SIZES_ENV = "JAX_SPARSE_ATTN_NOTEBOOK_SMALL"


@pytest.mark.parametrize("name, count", sorted(FIGURES.items()))
def test_committed_notebooks_show_their_figures(name, count):
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    assert png_outputs(nb) == count


@pytest.mark.slow  # a kernel start and a whole notebook each: 10 to 20 s
@pytest.mark.parametrize("notebook_path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(notebook_path, tmp_path, monkeypatch):
    for name, value in kernel_environment(tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(SMALL_SIZES_ENV, "1")
    nb = execute(notebook_path)
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
    assert not errors
    assert png_outputs(nb) == FIGURES.get(notebook_path.stem, 0)


if __name__ == "__main__":
    import tempfile

    wanted = set(sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(kernel_environment(pathlib.Path(tmp)))
        for notebook_path in NOTEBOOKS:
            if wanted and notebook_path.stem not in wanted and notebook_path.name not in wanted:
                continue
            start = time.perf_counter()
            nb = execute(notebook_path)
            # Keep the committed file stable: a fixed kernelspec name, no per-run metadata.
            nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
            nbformat.write(nb, notebook_path)
            print(f"{notebook_path.name}: {time.perf_counter() - start:.1f} s")
