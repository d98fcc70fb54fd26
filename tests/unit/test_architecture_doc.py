"""docs/architecture.md stays true to the code: its map names every module of the
package, names no module that does not exist, and gives each one's size roughly."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "etcd_rdzv"
DOC = ROOT / "docs" / "architecture.md"
ROW = re.compile(r"^\| `([^`]+\.py)` \| (\d+) \|")


def _rows() -> dict[str, int]:
    rows: dict[str, int] = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        found = ROW.match(line)
        if found:
            assert found.group(1) not in rows, f"{found.group(1)} is listed twice"
            rows[found.group(1)] = int(found.group(2))
    return rows


def _modules() -> dict[str, int]:
    return {
        str(path.relative_to(PACKAGE)): len(path.read_text(encoding="utf-8").splitlines())
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def test_the_map_lists_every_module_and_only_modules_that_exist() -> None:
    rows, modules = _rows(), _modules()
    assert rows, "no module table found in docs/architecture.md"
    assert sorted(set(modules) - set(rows)) == [], "modules missing from the map"
    assert sorted(set(rows) - set(modules)) == [], "the map names modules that do not exist"


def test_the_map_gives_each_modules_size_roughly() -> None:
    rows, modules = _rows(), _modules()
    off = {
        name: (rows[name], lines)
        for name, lines in modules.items()
        if name in rows and abs(rows[name] - lines) > max(25, lines // 5)
    }
    assert off == {}, "sizes in docs/architecture.md (documented, actual) are stale"
