"""The package's modules import each other without a circle, lazy imports included.

An import circle (two modules that each need the other, even through a function-level
import) is what made ``_factory`` and ``torch`` depend on import order; the layering in
docs/architecture.md says which way each edge goes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import etcd_rdzv

ROOT = Path(etcd_rdzv.__file__).resolve().parent


def _module_of(path: Path) -> str:
    parts = ["etcd_rdzv", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    files = {_module_of(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # ``from x import y``: the module x.y if there is one, else x itself.
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names
                ]
            graph[module] |= {t for t in targets if t in files and t != module}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle() -> None:
    graph = _graph()
    # A package's __init__ re-exports its modules: only edges into other modules count.
    for module in graph:
        graph[module] = {t for t in graph[module] if not module.startswith(t + ".")}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_graph_sees_lazy_imports() -> None:
    # _factory imports etcd_rdzv.torch inside a function: the graph must include it,
    # or the test above would pass for the wrong reason.
    assert "etcd_rdzv.torch" in _graph()["etcd_rdzv._factory"]
    assert "etcd_rdzv._factory" not in _graph()["etcd_rdzv.torch"]
