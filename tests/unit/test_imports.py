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


#: The parts of the package, bottom first: a module may import its own part and the
#: parts below it, never one above (docs/architecture.md, "Who may import whom").
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "_keys", "_torch_range"),
    ("config",),
    ("_commands",),
    ("_kv",),
    ("client",),
    ("store", "_store_codec"),
    ("backend",),
    ("admission",),
    ("rendezvous",),
    ("runs",),
    ("torch",),
    ("_factory",),
    ("etcd_rdzv",),  # the package's own __init__: the public names
    ("inprocess",),
    ("testing",),
    ("cli", "__main__"),
)


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _layer(part: str) -> int:
    for level, names in enumerate(LAYERS):
        if part in names:
            return level
    raise AssertionError(f"{part!r} is in no layer of LAYERS: add it (and to the docs' map)")


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if not module.startswith(target + ".")  # a package's __init__ re-exporting
        and _layer(_part(target)) > _layer(_part(module))
    )


def test_each_part_imports_only_parts_below_it() -> None:
    upward = _upward(_graph())
    assert upward == [], "imports that climb a layer:\n" + "\n".join(upward)


def test_the_layer_check_sees_an_upward_import() -> None:
    # Admission (the health gate) importing the rendezvous core, as it once did for a
    # log constant, is what the check must refuse; the other way round is the rule.
    graph = {
        "etcd_rdzv.admission.health": {"etcd_rdzv.rendezvous.join"},
        "etcd_rdzv.rendezvous.join": {"etcd_rdzv.admission.hosts"},
    }
    assert _upward(graph) == ["etcd_rdzv.admission.health -> etcd_rdzv.rendezvous.join"]


def test_the_package_imports_nothing_the_wheel_leaves_out() -> None:
    # fleet/, benchmarks/ and tests/ live in the checkout only: a module of the wheel
    # (the public test harness included) that imported one would fail for users.
    outside = {"fleet", "benchmarks", "tests"}
    found = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] in outside]
    assert found == []
