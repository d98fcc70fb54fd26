"""The session keeps its own state: a closed surface (no server).

Its fields are private and read through properties; the rest of the rendezvous core
(the handler, the join, the coordinator...) changes it only through its methods, which
an assignment to a session's attribute anywhere outside ``session.py`` would bypass.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from etcd_rdzv import RendezvousParameters
from etcd_rdzv.client import build_kv
from etcd_rdzv.config.params import Settings
from etcd_rdzv.rendezvous import session as session_module
from etcd_rdzv.rendezvous.listener import Listeners
from etcd_rdzv.rendezvous.session import Session

CORE = Path(session_module.__file__).parent


@pytest.fixture
def session() -> Iterator[Session]:
    settings = Settings.from_params(RendezvousParameters("etcd-rdzv", "127.0.0.1:1", "r", 1, 2))
    kv = build_kv(settings.client)  # no network I/O
    yield Session(kv, settings.handler, "n", Listeners())
    kv.close()


def test_a_session_has_no_public_field(session: Session) -> None:
    assert [name for name in vars(session) if not name.startswith("_")] == []
    # What others read is a property, and read-only.
    for name in ("round", "rank", "is_member", "incarnation", "watch", "coord", "heart"):
        assert isinstance(getattr(Session, name), property), name
        with pytest.raises(AttributeError):
            setattr(session, name, None)
    assert (session.round, session.rank, session.is_member) == (0, None, False)


def _writes_to_a_session(path: Path) -> list[str]:
    """Assignments (plain, augmented, annotated, deletions) to an attribute of an
    object named ``session`` or ``_session``, or to one of its attributes."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for part in ast.walk(target):
                if not isinstance(part, ast.Attribute):
                    continue
                owner = part.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if name in ("session", "_session"):
                    found.append(f"{path.name}:{part.lineno}: {ast.unparse(part)}")
    return found


def test_no_module_of_the_core_writes_a_session_field() -> None:
    modules = sorted(p for p in CORE.glob("*.py") if p.name != "session.py")
    assert any(p.name == "handler.py" for p in modules)
    assert [w for p in modules for w in _writes_to_a_session(p)] == []


def test_the_check_finds_a_write(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f(self, session):\n"
        "    session.round = 1\n"
        "    self._session.joined, x = True, 2\n"
        "    session.old += []\n"
    )
    assert len(_writes_to_a_session(probe)) == 3
