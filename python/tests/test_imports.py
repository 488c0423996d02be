"""The package's modules import one another one way: no circle, type-only
imports (under ``if TYPE_CHECKING:``) and imports inside functions
included, and the results module at the bottom. Read from the sources
with ast, without importing them."""
import ast
import os

import pytest

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nanguard")


def modules(package_dir=PACKAGE_DIR, package="nanguard"):
    """{dotted name: path} of the package's Python modules (``__init__.py``
    named by its package), and the set of every module name an import may
    name there (the extension's too, by its stub)."""
    found, names = {}, set()
    for folder, _, files in os.walk(package_dir):
        parts = [package] + os.path.relpath(folder, package_dir).split(os.sep)
        parts = [p for p in parts if p != "."]
        for f in files:
            stem, ext = os.path.splitext(f)
            if ext not in (".py", ".pyi"):
                continue
            name = ".".join(parts if stem == "__init__" else parts + [stem])
            names.add(name)
            if ext == ".py":
                found[name] = os.path.join(folder, f)
    return found, names


def imports(name, path, known):
    """The modules of ``known`` that module ``name`` (at ``path``) imports,
    anywhere in it: ``from . import x`` names the submodule x where there is
    one, else the package."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = ".".join(p for p in (base if node.level else "", node.module or "") if p)
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in out if m in known and m != name}


def graph(package_dir=PACKAGE_DIR, package="nanguard"):
    """{module: the package's Python modules it imports}."""
    found, known = modules(package_dir, package)
    return {name: imports(name, path, known) & set(found) for name, path in found.items()}


def cycles(edges):
    """The circles (lists of modules, the first again at the end) of each
    group of modules that reach one another (Tarjan's strongly connected
    components): the shortest through each of its modules, each once; sorted."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(set(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    found = []
    for group in groups:  # through each module of the group, a shortest way back to it
        for start in sorted(group):
            paths, seen = [[start]], {start}
            while paths:
                path = paths.pop(0)
                nxt = sorted(w for w in edges[path[-1]] if w in group)
                if start in nxt:
                    if not any(set(path) == set(c[:-1]) for c in found):
                        found.append(path + [start])
                    break
                for w in nxt:
                    if w not in seen:
                        seen.add(w)
                        paths.append(path + [w])
    return sorted(found)


def test_no_module_imports_one_that_imports_it_back():
    circles = cycles(graph())
    assert not circles, "import circles in python/nanguard: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_check_reads_every_kind_of_import_and_names_a_circle(tmp_path):
    """The test above would see a circle through a type-only import, an
    import inside a function, ``from . import x`` and ``from ..x import y``."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .a import A\n")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\nA = 1\n")
    (package / "b.py").write_text("def f():\n    from . import c\nB = 2\n")
    (package / "c.py").write_text("import os\nfrom .sub.d import D\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "d.py").write_text("from ..a import A\nD = 3\n")
    (package / "ext.pyi").write_text("X: int\n")
    (package / "e.py").write_text("from . import ext\n")
    edges = graph(str(package), "pkg")
    assert edges["pkg"] == {"pkg.a"} and edges["pkg.e"] == set()
    assert cycles(edges) == [["pkg.a", "pkg.b", "pkg.c", "pkg.sub.d", "pkg.a"]]


def test_the_results_are_the_bottom_module():
    """StepResult, Finding, NonFiniteError and NanGuardWarning come from a
    module that imports none of nanguard's Python (only the extension), so
    that every other module can name them."""
    assert graph()["nanguard._results"] == set()


@pytest.mark.parametrize("module, expected", [
    ("nanguard._guard", {"nanguard._results", "nanguard._options", "nanguard._batches", "nanguard._lr_schedulers",
                         "nanguard._hosts", "nanguard.tensorboard", "nanguard._compile"}),
    ("nanguard.tensorboard", {"nanguard._results"}),
    ("nanguard._trace", {"nanguard._results", "nanguard._compile"}),
])
def test_the_graph_holds_the_imports_it_should(module, expected):
    assert expected <= graph()[module]
