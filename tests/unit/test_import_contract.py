"""The package's import contract, checked over its source (nothing is imported to check it).

1. The engine's surface: a module outside ``lightning_zero/zero/`` reaches the data path only through
   ``lightning_zero.zero`` (its ``__init__``), never one of its modules, so that what other layers use
   is stated in one place and the rest of ``zero/`` can change freely.
2. No import cycle anywhere in the package, counting imports inside functions and type-only
   (``if TYPE_CHECKING:``) imports: a cycle that only a lazy or type-only import hides still ties two
   layers together, and it becomes a real one the day someone moves the import to the top.

The graph is built from the syntax tree: ``from a.b import c`` is an edge to ``a.b.c`` when that is a
module of the package, else to ``a.b``; relative imports are resolved against the importing module.
A package's implicit import of its parent (Python runs ``a/__init__`` before ``a.b``) is not an edge:
every subpackage would otherwise form a cycle with its parent.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "lightning_zero"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE
ENGINE = f"{PACKAGE}.zero"
# compiled modules (setup.py builds them; a clean checkout may not have them yet): leaves of the graph
EXTENSIONS = (f"{PACKAGE}._C",)


def module_names(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> source file for every module of the package (a package is its ``__init__``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([package, *parts])] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports anywhere in its source (top level, functions, TYPE_CHECKING)."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            # ``import a.b.c`` binds ``a`` but loads ``a.b.c``: the deepest package module named is the edge
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    modules = module_names()
    graph = {name: imports_of(name, path, modules | dict.fromkeys(EXTENSIONS, path)) for name, path in modules.items()}
    return graph | {name: set() for name in EXTENSIONS}


def private_engine_imports(graph: dict[str, set[str]]) -> list[str]:
    """``importer -> target`` for every module outside ``zero/`` that imports a module inside it."""
    inside = f"{ENGINE}."
    return sorted(
        f"{src} -> {dst}"
        for src, targets in graph.items()
        if src != ENGINE and not src.startswith(inside)
        for dst in targets
        if dst.startswith(inside)
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; each holds a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(root: str) -> None:
        # iterative: the graph is deep enough (package -> strategy -> ...) to make recursion fragile
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for dst in edges:
                if dst not in index:
                    index[dst] = low[dst] = len(index)
                    stack.append(dst)
                    on_stack.add(dst)
                    work.append((dst, iter(sorted(graph[dst]))))
                    break
                if dst in on_stack:
                    low[node] = min(low[node], index[dst])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_outside_modules_use_only_the_engine_surface():
    bad = private_engine_imports(import_graph())
    assert not bad, (
        f"{len(bad)} import(s) reach into {ENGINE}'s private modules; import the name from {ENGINE} "
        "instead (export it in zero/__init__.py if another layer really needs it):\n  " + "\n  ".join(bad)
    )


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, (
        "import cycles (type-only and function-level imports count): move the shared name to the lower "
        "layer, or type against a Protocol:\n  " + "\n  ".join(" <-> ".join(c) for c in found)
    )


def test_the_checker_sees_what_it_must(tmp_path):
    """The checks above pass on an empty list; this shows they find a private import, a type-only
    cycle and a relative-import cycle when there is one."""
    pkg = tmp_path / "pkg"
    (pkg / "zero").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "zero" / "__init__.py").write_text("from pkg.zero.engine import Engine\n")
    (pkg / "zero" / "engine.py").write_text("from ..layout import Layout\nclass Engine: ...\n")
    (pkg / "layout.py").write_text("class Layout: ...\n")
    (pkg / "zero" / "flat.py").write_text("from . import engine\n")
    (pkg / "config.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.strategy import Strategy\n"
    )
    (pkg / "strategy.py").write_text("import pkg.zero.flat\nfrom pkg import config\n")
    modules = module_names(pkg, "pkg")
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert graph["pkg.zero.engine"] == {"pkg.layout"}
    assert graph["pkg.zero.flat"] == {"pkg.zero.engine"}
    assert graph["pkg.strategy"] == {"pkg.zero.flat", "pkg.config"}
    outside = sorted(
        f"{s} -> {d}"
        for s, ts in graph.items()
        if not s.startswith("pkg.zero")
        for d in ts
        if d.startswith("pkg.zero.")
    )
    assert outside == ["pkg.strategy -> pkg.zero.flat"]
    assert cycles(graph) == [["pkg.config", "pkg.strategy"]]
