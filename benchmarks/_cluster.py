"""The large part on a cluster of etcd members: each node process's order of the
members, what the members cost together, and the leader killed in the middle of a
round.

A row's etcd cost is summed over the members, each scraped (``/metrics``) before and
after; a member killed during the row counts up to the scrape just before its kill:

* requests: as :func:`benchmarks._etcd.counts` on each member, added up (a request
  is counted where it arrived);
* writes: v3 as requests (a write call is counted where it arrived); v2 the most any
  member counted (``etcd_debugging_store_writes_total`` counts what the member's own
  store applied, and every member applies every write);
* bytes etcd sent to clients: v3 ``etcd_network_client_grpc_sent_bytes_total``
  (every member's gRPC server: unary answers and stream messages, as protobuf; the
  JSON gateway our client talks to turns them into larger JSON after this count);
  v2 none: etcd counts no bytes of its v2 HTTP answers;
* etcd CPU: each member's ``process_cpu_seconds_total``.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from typing import Any

from etcd_rdzv import RendezvousParameters
from etcd_rdzv.testing import EtcdNoLeaderError

from ._etcd import Member, Metrics, by_method, counts, cpu_seconds, scrape

__all__ = [
    "BYTES_SENT_V3",
    "ELECTION_POLL",
    "LeaderKill",
    "Snapshot",
    "cost",
    "leader_name",
    "rotated",
    "snapshot",
    "with_endpoint",
]

BYTES_SENT_V3 = "etcd_network_client_grpc_sent_bytes_total"
ELECTION_POLL = 0.05  # seconds between two looks for the new leader

Snapshot = dict[str, Metrics]
"""Each member's metrics at one moment, by member name."""


def rotated(endpoint: str, index: int) -> str:
    """``endpoint``'s members (``host:port,...``) rotated by ``index``: node process
    ``i`` lists them from member ``i % size`` on, as operators spread agents over the
    members (a client talks to its first member until that one fails)."""
    parts = endpoint.split(",")
    k = index % len(parts)
    return ",".join(parts[k:] + parts[:k])


def with_endpoint(params: RendezvousParameters, endpoint: str) -> RendezvousParameters:
    """A copy of ``params`` with another ``endpoint`` (its config is shared, unchanged)."""
    out = copy.copy(params)
    out.endpoint = endpoint
    return out


def snapshot(member: Member, kept: Snapshot | None = None) -> Snapshot:
    """Every member's metrics now; a member that does not answer is left out, or
    given its metrics in ``kept`` (a killed member: its scrape just before the kill)."""
    out: Snapshot = {}
    for name, url in member.sites.items():
        try:
            out[name] = scrape(url)
        except (OSError, ValueError):
            if kept is not None and name in kept:
                out[name] = kept[name]
    return out


def _total(metrics: Metrics, metric: str) -> float | None:
    found = [value for name, _, value in metrics if name == metric]
    return sum(found) if found else None


def cost(before: Snapshot, after: Snapshot, api: str) -> dict[str, Any]:
    """What the members scraped both times counted between the two snapshots:
    ``requests``, ``writes``, ``bytes_sent`` (None on v2), ``cpu`` (seconds by
    member; a member that does not report its CPU left out), ``members`` (the
    names counted) and ``by_member`` (requests by member: how the nodes spread)."""
    names = [name for name in before if name in after]
    each = [counts(before[name], after[name], api) for name in names]
    requests = sum(c.requests for c in each)
    if api == "v2":
        writes = max((c.writes for c in each), default=0.0)
    else:
        writes = sum(c.writes for c in each)
    sent: float | None = None
    if api == "v3":
        sent = 0.0
        for name in names:
            start, end = _total(before[name], BYTES_SENT_V3), _total(after[name], BYTES_SENT_V3)
            if start is not None and end is not None:
                sent += end - start
    cpu: dict[str, float] = {}
    for name in names:
        start, end = cpu_seconds(before[name]), cpu_seconds(after[name])
        if start is not None and end is not None:
            cpu[name] = end - start
    kinds: dict[str, float] = {}
    for name in names:
        for kind, value in by_method(before[name], after[name], api).items():
            kinds[kind] = kinds.get(kind, 0.0) + value
    # Raft: proposals committed (the leader's count, the cluster's log) and elections.
    committed = [
        end - start
        for name in names
        if (start := _total(before[name], "etcd_server_proposals_committed_total")) is not None
        and (end := _total(after[name], "etcd_server_proposals_committed_total")) is not None
    ]
    changes = [
        end - start
        for name in names
        if (start := _total(before[name], "etcd_server_leader_changes_seen_total")) is not None
        and (end := _total(after[name], "etcd_server_leader_changes_seen_total")) is not None
    ]
    return {
        "requests": requests,
        "writes": writes,
        "bytes_sent": sent,
        "cpu": cpu,
        "members": names,
        "by_member": {name: c.requests for name, c in zip(names, each, strict=True)},
        "by_method": kinds,
        "proposals": max(committed, default=None),
        "leader_changes": max(changes, default=None),
    }


def leader_name(member: Member, timeout: float = 10.0) -> str | None:
    """The name of the cluster's leader now (None: a single member, or none found)."""
    if member.cluster is None:
        return None
    try:
        return member.cluster.leader(timeout=timeout).name
    except EtcdNoLeaderError:
        return None


class LeaderKill:
    """SIGKILLs a cluster's leader at ``go + after`` (seconds, ``time.monotonic()``)
    from a thread of its own, then looks for the new leader every
    :data:`ELECTION_POLL` seconds: a surviving member whose ``/metrics`` say
    ``etcd_server_is_leader 1``.

    :meth:`finish` gives ``member`` (the one killed), ``at`` (seconds from go to the
    kill), ``new_leader``, ``elected`` (seconds from go to the first look that saw
    it; up to one poll and one scrape late) and ``election`` (from the kill), or
    ``error``. :attr:`kept` holds the killed member's metrics scraped just before
    its kill (for :func:`snapshot`).
    """

    def __init__(
        self, member: Member, leader: str, go: float, after: float, timeout: float = 15.0
    ) -> None:
        assert member.cluster is not None
        self.servers = {m.name: m for m in member.cluster.members}
        self.leader = leader
        self.go = go
        self.after = after
        self.timeout = timeout
        self.kept: Snapshot = {}
        self.result: dict[str, Any] = {"member": leader}
        self._thread = threading.Thread(target=self._run, name="bench-leader-kill", daemon=True)

    def start(self) -> LeaderKill:
        self._thread.start()
        return self

    def finish(self) -> dict[str, Any]:
        """Wait for the kill and the election (at most their time plus the timeout)."""
        wait = max(self.go + self.after - time.monotonic(), 0.0) + self.timeout + 5.0
        self._thread.join(wait)
        if self._thread.is_alive():
            self.result.setdefault("error", "the leader kill did not end in time")
        return dict(self.result)

    def _run(self) -> None:
        try:
            self._kill_and_watch()
        except Exception as exc:  # reported in the row, never lost
            self.result["error"] = f"{type(exc).__name__}: {exc}"

    def _kill_and_watch(self) -> None:
        time.sleep(max(self.go + self.after - time.monotonic(), 0.0))
        server = self.servers[self.leader]
        with contextlib.suppress(OSError, ValueError):  # then counted to its last scrape
            self.kept[self.leader] = scrape(server.client_url)
        server.kill()
        killed = time.monotonic()
        self.result["at"] = killed - self.go
        survivors = [m for name, m in self.servers.items() if name != self.leader]
        while time.monotonic() - killed < self.timeout:
            for m in survivors:
                try:
                    leads = _total(scrape(m.client_url), "etcd_server_is_leader")
                except (OSError, ValueError):
                    continue
                if leads == 1:
                    now = time.monotonic()
                    self.result.update(
                        new_leader=m.name, elected=now - self.go, election=now - killed
                    )
                    return
            time.sleep(ELECTION_POLL)
        self.result["error"] = f"no new leader within {self.timeout:g} s of the kill"
