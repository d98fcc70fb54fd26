"""Cluster helpers for the fault tests (the node processes are
:mod:`fleet`'s): who leads, what each member holds, and checks of a
round's results. Every wait has a deadline."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from typing import Any

from etcd_rdzv.testing import EtcdCluster, EtcdServer
from fleet import Event, Fleet

READY_TIMEOUT = 60.0  # several interpreters starting at once on 2 busy cores
MAX_LIFE = 300.0  # seconds a node process lives, should the test process die
RETRIES = 2  # a node gives up a join after 3 failed next_rendezvous() in a row


def rotated_endpoint(cluster: EtcdCluster, first: int) -> str:
    """Every member's endpoint, starting with member ``first % size``."""
    members = cluster.members
    n = first % len(members)
    return ",".join(m.endpoint for m in members[n:] + members[:n])


def _status(member: EtcdServer, timeout: float) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{member.client_url}/v3/maintenance/status", data=b"{}", method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        status: dict[str, Any] = json.loads(resp.read())
    return status


def leader_of(cluster: EtcdCluster, timeout: float = 15.0) -> EtcdServer:
    """The member that leads now, asked over the v3 status API (served with or without
    the v2 API, unlike the v2 stats that ``EtcdCluster.leader()`` asks)."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        for member in cluster.members:
            if not member.running:
                continue
            with contextlib.suppress(OSError, ValueError, KeyError):
                status = _status(member, 1.0)
                if status["header"]["member_id"] == status["leader"]:
                    return member
        if time.monotonic() >= deadline:
            raise RuntimeError(f"no member of {cluster.endpoint} reports being leader")
        time.sleep(delay)  # back-off while an election runs, bounded by the deadline
        delay = min(delay * 1.5, 0.25)


def etcd_version(member: EtcdServer) -> tuple[int, ...]:
    """The etcd server version of ``member``, e.g. ``(3, 5, 1)``."""
    with urllib.request.urlopen(f"{member.client_url}/version", timeout=5) as resp:
        text = str(json.loads(resp.read())["etcdserver"])
    return tuple(int(part) for part in text.split(".")[:3])


def describe_members(cluster: EtcdCluster) -> str:
    """Each member's view (revision, raft index, leader): members that applied the same
    raft index but report different revisions hold different data."""
    lines = []
    for member in cluster.members:
        try:
            status = _status(member, 2.0)
            header = status.get("header", {})
            lines.append(
                f"{member.name}: revision {header.get('revision')}, raft index "
                f"{status.get('raftIndex')}, applied {status.get('raftAppliedIndex')}, "
                f"member {header.get('member_id')}, leader {status.get('leader')}"
            )
        except (OSError, ValueError) as exc:
            lines.append(f"{member.name}: no status ({exc})")
    return "\n".join(lines)


def wait_healthy(cluster: EtcdCluster, timeout: float = 30.0) -> None:
    """Wait until every running member reports healthy (it has a leader again)."""
    for member in cluster.members:
        if member.running:
            member.wait_ready(timeout)


def assert_round(fleet: Fleet, results: list[Event], expected: set[str] | None) -> tuple[str, ...]:
    """Every result of one round agrees on the members; ranks are 0..n-1, each its own;
    with ``expected``, the members are exactly those node ids."""
    lists = {tuple(r["members"]) for r in results}
    fleet.check(len(lists) == 1, f"members differ between nodes: {lists}")
    (members,) = lists
    n = len(members)
    fleet.check(
        len(set(members)) == n
        and sorted(r["rank"] for r in results) == list(range(len(results)))
        and all(r["world_size"] == n for r in results)
        and all(members[r["rank"]] == r["node_id"] for r in results),
        f"ranks are not 0..{n - 1}, one per member in member-list order: {results}",
    )
    if expected is not None:
        fleet.check(set(members) == expected, f"members {members}, expected {sorted(expected)}")
    return members
