"""Every option the package reads is declared in the option table, and every declared
option is read: by the settings (asked of the parameters) and then by the code it
configures. A read of an undeclared option would otherwise only show at run time."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from etcd_rdzv.config import _options
from etcd_rdzv.config.params import DYNAMIC_HANDLER_NAME, RendezvousParameters, Settings

PACKAGE = Path(__file__).resolve().parents[2] / "etcd_rdzv"
CONFIG = PACKAGE / "config"
DECLARED = {o.name for o in _options.OPTIONS}
#: The methods that read an option of rendezvous parameters (ours and torch's).
_PARAMS_READS = {"get", "get_as_int", "get_as_bool"}
#: The methods of a declaration that read or parse a value (not ``default``, ...).
_OPTION_READS = {"get", "parse", "absent"}
#: The settings objects that hold the options' values.
_HOLDERS = {"ClientConfig", "HandlerSettings", "Settings"}


def _modules() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(encoding="utf-8"), str(path))


def _name(node: ast.expr) -> str:
    """The last name of ``params``, ``self.params``, ``p``: what a value is called."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _literal(call: ast.Call) -> str | None:
    if call.args and isinstance(call.args[0], ast.Constant):
        value = call.args[0].value
        return value if isinstance(value, str) else None
    return None


def _is_params(node: ast.expr) -> bool:
    """Whether ``node`` names rendezvous parameters (``params``, ``rdzv_params``, or
    their ``config`` dict)."""
    name = _name(node)
    if name == "config" and isinstance(node, ast.Attribute):
        return _is_params(node.value)
    return name.endswith("params") or name == "parameters"


def option_reads(tree: ast.Module) -> Iterator[tuple[int, str, str]]:
    """``(line, how, name)`` for each option read by name in ``tree``: the parameters
    asked for it (``params.get("name")``, ``get_as_int``, ``params.config["name"]``) or
    its declaration looked up (``option("name")``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = _literal(node)
            if name is None:
                continue
            if _name(func) == "option":
                yield node.lineno, "option", name
            elif (
                isinstance(func, ast.Attribute)
                and func.attr in _PARAMS_READS
                and _is_params(func.value)
            ):
                yield node.lineno, func.attr, name
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Load)
            and _name(node.value) == "config"
            and _is_params(node.value)
        ):
            key = node.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                yield node.lineno, "[]", key.value


def test_every_option_the_package_reads_by_name_is_declared() -> None:
    undeclared = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {how}({name!r})"
        for path, tree in _modules()
        for line, how, name in option_reads(tree)
        if name not in DECLARED
    ]
    assert undeclared == [], (
        "options read but not declared in etcd_rdzv/config/_options.py: " + "; ".join(undeclared)
    )


def test_the_scan_sees_each_way_of_reading_an_option() -> None:
    """The scan itself: each way of reading, declared or not, is found."""
    source = """
params.get("a"); self.params.get_as_int("b", 1); rdzv_params.get_as_bool("c")
option("d").get(params); _options.option("e").default; params.config["f"]
data.get("not_an_option"); params.get(name); params["written"] = 1
"""
    found = {(how, name) for _, how, name in option_reads(ast.parse(source))}
    assert found == {
        ("get", "a"),
        ("get_as_int", "b"),
        ("get_as_bool", "c"),
        ("option", "d"),
        ("option", "e"),
        ("[]", "f"),
    }


class RecordingParams(RendezvousParameters):
    """Parameters that remember every option asked of them, however named."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.asked.add(key)
        return super().get(key, default)


@pytest.mark.parametrize(
    ("backend", "config"),
    [
        ("etcd-rdzv", {}),
        ("etcd-rdzv", {"node_unit": "2", "node_group": "rack-1", "quarantine_deaths": "3"}),
        ("etcd-rdzv-static", {"rank": "1"}),
        (DYNAMIC_HANDLER_NAME, {"health_check": "true"}),
    ],
)
def test_the_settings_ask_for_declared_options_only_and_for_every_one(
    backend: str, config: dict[str, str]
) -> None:
    """What the static scan cannot see: options asked for under a computed name."""
    given = RecordingParams(backend, "127.0.0.1:2379", "run", 2, 4, **config)
    Settings.from_params(given)
    assert given.asked - DECLARED == set(), "asked for undeclared options"
    assert DECLARED - given.asked == set(), "declared options the settings never read"


def _attribute_reads(tree: ast.AST) -> set[str]:
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
    }


def _derived_reads(tree: ast.Module) -> set[str]:
    """Fields a settings object's own methods read (``node_ttl`` reads
    ``keep_alive_max_attempt``); not ``__repr__`` and the like, which read them all."""
    found: set[str] = set()
    holders = [c for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name in _HOLDERS]
    for holder in holders:
        for method in holder.body:
            if isinstance(method, ast.FunctionDef) and not method.name.startswith("__"):
                found |= {
                    a.attr
                    for a in ast.walk(method)
                    if isinstance(a, ast.Attribute) and _name(a.value) == "self"
                }
    return found


def _rule_reads(tree: ast.Module) -> set[str]:
    """Options a rule of the configuration reads itself: ``option("x").get(...)``,
    ``.parse``, ``.absent``, or ``params.get("x")``."""
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        inner = node.func.value
        if node.func.attr in _OPTION_READS and isinstance(inner, ast.Call):
            name = _literal(inner)
            if _name(inner.func) == "option" and name is not None:
                found.add(name)
        elif node.func.attr in _PARAMS_READS and _is_params(inner):
            name = _literal(node)
            if name is not None:
                found.add(name)
    return found


def test_every_declared_option_is_used_by_the_code_it_configures() -> None:
    """An option with a settings field: the field is read outside the configuration
    (by the client, the stores, the handlers, the CLI) or by a property of its
    settings object that is; one without a field: a rule of the configuration reads it
    (``password_file``, into ``password``)."""
    outside: set[str] = set()
    rules: set[str] = set()
    for path, tree in _modules():
        if CONFIG in path.parents:
            rules |= _rule_reads(tree)
            outside |= _derived_reads(tree)
        else:
            outside |= _attribute_reads(tree)
    unused = [o.name for o in _options.OPTIONS if o.name not in (outside if o.field else rules)]
    assert unused == [], f"declared options nothing reads: {unused}"
