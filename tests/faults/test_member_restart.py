"""A cluster member killed and started again comes back consistent with its peers.

etcd 3.5.0-3.5.2 can bring a member killed under load back with data and revisions
that differ from its peers' (etcd#13766); a rendezvous then sees one key at two
revisions. The test cluster therefore brings such a member back as a new, empty member
that its peers send the data to.
"""

from __future__ import annotations

import base64
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from etcd_rdzv.testing import EtcdCluster, wait_until
from etcd_rdzv.testing._server import EtcdServer, crash_can_diverge

CATCH_UP = 30.0  # seconds a restarted member may take to hold its peers' writes


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _call(member: EtcdServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = member._ask(path, 5, json.dumps(body).encode())
    assert isinstance(answer, dict), answer
    return answer


def _member_id(member: EtcdServer) -> str:
    return str(_call(member, "/v3/maintenance/status", {})["header"]["member_id"])


def _local_read(member: EtcdServer, key: str) -> tuple[str, int]:
    """The key as this member holds it itself (a serializable read: no leader asked)."""
    answer = _call(member, "/v3/kv/range", {"key": _b64(key), "serializable": True})
    kv = (answer.get("kvs") or [{}])[0]
    return base64.b64decode(kv.get("value") or "").decode(), int(kv.get("mod_revision") or 0)


@pytest.fixture
def cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster(3, enable_v2=False) as c:
        yield c


def test_a_killed_member_comes_back_with_its_peers_data(cluster: EtcdCluster) -> None:
    victim = cluster.leader(timeout=15)  # the worst case: the leader crashes
    first, third = (m for m in cluster.members if m is not victim)
    _call(first, "/v3/kv/put", {"key": _b64("/t/before"), "value": _b64("1")})
    old_id = _member_id(victim)

    victim.kill()
    first = cluster.leader(timeout=15)
    third = next(m for m in cluster.members if m not in (first, victim))
    for i in range(50):  # writes it misses while it is down
        _call(first, "/v3/kv/put", {"key": _b64("/t/during"), "value": _b64(str(i))})
    victim.start()

    replaced = crash_can_diverge(victim.binary)
    assert (_member_id(victim) != old_id) == replaced, (
        f"replaced={replaced}: member id {old_id} -> {_member_id(victim)}"
    )
    written = _call(first, "/v3/kv/put", {"key": _b64("/t/after"), "value": _b64("x")})
    at = int(written["header"]["revision"])
    # The restarted member catches up asynchronously: wait until it holds the last
    # write (it applies the log in order, so then it holds every write before it).
    for member in cluster.members:
        wait_until(
            lambda m=member: _local_read(m, "/t/after")[1] >= at,
            CATCH_UP,
            what=f"{member.name} holds the write at revision {at}",
            interval=0.05,
        )
    for key, value in (("/t/before", "1"), ("/t/during", "49"), ("/t/after", "x")):
        seen = {m.name: _local_read(m, key) for m in (first, third, victim)}
        assert len(set(seen.values())) == 1 and seen[first.name][0] == value, (key, seen)


@pytest.mark.parametrize(
    ("version", "diverges"),
    [("3.5.0", True), ("3.5.1", True), ("3.5.2", True), ("3.5.3", False), ("3.4.23", False)],
)
def test_which_etcd_versions_come_back_as_new_members(
    tmp_path: Path, version: str, diverges: bool
) -> None:
    fake = tmp_path / f"etcd-{version}"
    fake.write_text(f"#!/bin/sh\necho 'etcd Version: {version}'\necho 'Git SHA: 0'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    assert crash_can_diverge(os.fspath(fake)) is diverges
