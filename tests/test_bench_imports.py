"""The benchmark modules import one another one way only: their import graph, read from the source
with ``ast`` (imports inside functions included), has no cycle, and its layers hold (the helpers
import no benchmark; only the command line imports the command line)."""

import ast
import pathlib

import jax_sparse_attn

PACKAGE_DIR = pathlib.Path(jax_sparse_attn.__file__).parent


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path, wanted) -> dict:
    """``{module: set of modules it imports}`` over the modules of the package at ``root`` for
    which ``wanted(name)`` holds; every import statement of a module counts, wherever it is."""
    paths = {_module_name(p, root): p for p in root.rglob("*.py")}
    nodes = {name for name in paths if wanted(name)}
    graph = {}
    for name in sorted(nodes):
        path = paths[name]
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")
                if node.level:
                    base = base[: len(base) - (node.level - 1)]
                    base = base + node.module.split(".") if node.module else base
                else:
                    base = node.module.split(".")
                base_name = ".".join(base)
                for alias in node.names:  # `from pkg import module` imports pkg.module
                    sub = f"{base_name}.{alias.name}"
                    targets.add(sub if sub in paths else base_name)
        graph[name] = {t for t in targets if t in nodes and t != name}
    return graph


def find_cycle(graph: dict):
    """One cycle of ``graph`` as a list of modules (first == last), or None."""
    state = {}  # absent: unvisited, 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [node])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def _is_benchmark(name: str) -> bool:
    # Every benchmark module wherever it lives, and the charts they draw with.
    return "bench" in name or name == "jax_sparse_attn.plots"


def test_the_cycle_finder_finds_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .c import g\n")
    (pkg / "c.py").write_text("from pkg import a\n")
    (pkg / "d.py").write_text("from .a import x\n")
    graph = import_graph(pkg, lambda name: True)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a"} and graph["pkg.d"] == {"pkg.a"}
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"pkg.a", "pkg.b", "pkg.c"}
    (pkg / "c.py").write_text("import os\n")
    assert find_cycle(import_graph(pkg, lambda name: True)) is None


def test_benchmark_modules_have_no_import_cycle():
    graph = import_graph(PACKAGE_DIR, _is_benchmark)
    assert "jax_sparse_attn.bench.cli" in graph and "jax_sparse_attn.bench.indexer" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_benchmark_layers_import_one_way():
    graph = import_graph(PACKAGE_DIR, _is_benchmark)
    # The bottom layer: the helpers import no benchmark module.
    assert graph["jax_sparse_attn.bench.common"] == set()
    assert graph["jax_sparse_attn.bench.records"] == set()
    # The top: only `python -m jax_sparse_attn.bench` imports the command line.
    cli = "jax_sparse_attn.bench.cli"
    assert {name for name, targets in graph.items() if cli in targets} == {"jax_sparse_attn.bench.__main__"}
    # The package's namespace imports nothing: importing one module brings no other with it.
    assert graph["jax_sparse_attn.bench"] == set()
    # The charts never import a benchmark (the benchmarks import them, to draw).
    assert graph["jax_sparse_attn.plots"] == set()


def test_the_library_imports_no_benchmark():
    # The library's own modules never depend on its benchmarks; the demo (``python -m
    # jax_sparse_attn``) alone reuses the attention benchmark's shapes and baseline.
    graph = import_graph(PACKAGE_DIR, lambda name: True)
    importers = {name for name, targets in graph.items() if not _is_benchmark(name)
                 and any(_is_benchmark(t) and t != "jax_sparse_attn.plots" for t in targets)}
    assert importers == {"jax_sparse_attn.__main__"}
