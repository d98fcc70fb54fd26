"""What only the v3 KV layer does: leases for TTLs and liveness, watches from a
revision (and compaction), auth tokens that expire, and the rule that a job's nodes
all use one API. Runs on etcd 3.5 and on Debian's etcd 3.4, both without the v2 API.

Expiry is observed through etcd itself (watches, lease TTLs), never by sleeping for
a TTL and hoping; the sleeps below are the idle time a token or lease needs to age.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousConnectionError, RendezvousParameters
from etcd_rdzv._keys import coord_key, node_key
from etcd_rdzv._kv import KV, Compare, Delete, Get, Put, WatchCompacted
from etcd_rdzv._kv.v3 import _lease as v3_lease
from etcd_rdzv.testing import EtcdServer
from etcd_rdzv.testing.pytest_plugin import variant_server_options
from fleet import Fleet

from ._losing_proxy import LosingProxy, in_front_of
from ._rawkv import compact, lease_ttl, raw_get, revoke, v3_post, watch_streams_started

pytestmark = pytest.mark.etcd_variants("v3", "v3-3.4")

Params = Callable[..., RendezvousParameters]


@pytest.fixture
def kv(etcd_api_params: Params) -> Iterator[KV]:
    client = etcd_rdzv.create_client(etcd_api_params(read_timeout=5))
    yield client
    client.close()


@pytest.fixture
def url(etcd_api_server: EtcdServer) -> str:
    return etcd_api_server.client_url


def _raw(url: str, key: str) -> tuple[int, int, int] | None:
    """``(lease, seconds left, granted TTL)`` of ``key`` as etcd holds it."""
    raw = raw_get(url, "v3", key)
    if raw is None:
        return None
    return raw.lease, raw.ttl or 0, raw.granted or 0


# -- the client ------------------------------------------------------------------------


def test_v3_client_never_imports_python_etcd(etcd_api_server: EtcdServer) -> None:
    code = (
        "import sys, etcd_rdzv\n"
        f"p = etcd_rdzv.RendezvousParameters('x', {etcd_api_server.endpoint!r}, 'r', 1, 1, "
        "api='v3')\n"
        "kv = etcd_rdzv.create_client(p); kv.put('/imports', 'ok', None); kv.close()\n"
        "print('etcd' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["False"], out.stderr


# -- TTLs as leases --------------------------------------------------------------------


def test_writes_share_one_clean_up_lease_per_ttl(kv: KV, url: str, etcd_key_prefix: str) -> None:
    kv.put(f"{etcd_key_prefix}/a", "1", 600)
    kv.create(f"{etcd_key_prefix}/b", "2", 600)
    kv.put(f"{etcd_key_prefix}/c", "3", 300)
    kv.put(f"{etcd_key_prefix}/forever", "4", None)
    a, b, c = (_raw(url, f"{etcd_key_prefix}/{k}") for k in "abc")
    assert a is not None and b is not None and c is not None
    assert a[0] == b[0] != c[0]  # one lease per TTL
    assert (a[2], c[2]) == (600, 300)  # granted with the TTL asked for
    forever = raw_get(url, "v3", f"{etcd_key_prefix}/forever")
    assert forever is not None and forever.lease == 0 and forever.ttl is None


def test_the_node_lease_is_revoked_on_close_a_clean_up_lease_is_not(
    etcd_api_params: Params, url: str, etcd_key_prefix: str
) -> None:
    kv = etcd_rdzv.create_client(etcd_api_params(read_timeout=5))
    lease = kv.grant(60)
    kv.put(f"{etcd_key_prefix}/shared", "state", 60)
    kv.put_owned(f"{etcd_key_prefix}/mine", "alive", lease)
    shared, mine = _raw(url, f"{etcd_key_prefix}/shared"), _raw(url, f"{etcd_key_prefix}/mine")
    assert shared is not None and mine is not None
    assert mine[0] == lease.id != shared[0]  # same TTL, but liveness is the node's lease
    kv.close()
    assert raw_get(url, "v3", f"{etcd_key_prefix}/mine") is None  # gone at once
    assert lease_ttl(url, mine[0])[0] == -1
    after = _raw(url, f"{etcd_key_prefix}/shared")
    assert after is not None and after[0] == shared[0] and after[1] > 0  # left to expire


def _leases(url: str) -> set[int]:
    return {int(x["ID"]) for x in v3_post(url, "/v3/lease/leases", {}).get("leases") or []}


def test_every_key_of_a_node_is_on_its_one_lease_and_a_refused_claim_grants_nothing(
    etcd_api_params: Params, url: str, etcd_key_prefix: str
) -> None:
    kv = etcd_rdzv.create_client(etcd_api_params(read_timeout=5))
    join, coord = f"{etcd_key_prefix}/join", f"{etcd_key_prefix}/coord"
    try:
        before = _leases(url)
        lease = kv.grant(60)
        assert _leases(url) - before == {lease.id}
        kv.put_owned(join, "me", lease)
        created = kv.create(coord, "me", None, lease=lease)
        assert created is not None and created.value == "me"
        assert kv.create(coord, "other", None, lease=lease) is None
        held = {k: _raw(url, k) for k in (join, coord)}
        assert all(v is not None and v[0] == lease.id for v in held.values()), (lease, held)
        assert _leases(url) - before == {lease.id}  # nothing granted since
        assert set(lease.keys()) == {join, coord}
    finally:
        kv.close()
    assert all(raw_get(url, "v3", k) is None for k in (join, coord))


def test_a_join_key_that_replaces_another_stays_on_the_lease_in_one_revision(
    etcd_api_params: Params, url: str, etcd_key_prefix: str
) -> None:
    """A node moving to the next round: the new join key goes on the node's lease
    (no lease grant), the old key is deleted at the same revision; a lease that is
    gone meanwhile is replaced by a new grant."""
    kv = etcd_rdzv.create_client(etcd_api_params(read_timeout=5))
    r1, r2, r3, coord = (f"{etcd_key_prefix}/{k}" for k in ("r1", "r2", "r3", "coord"))
    try:
        lease = kv.grant(60)
        first = kv.put_owned(r1, "me", lease)
        granted = lease.id
        kv.put(coord, "them", 60)
        with kv.watcher(etcd_key_prefix, prefix=True) as watcher:
            watcher.reread(lambda: kv.list_tree(etcd_key_prefix))
            done = kv.txn([], [Put(r2, "me", lease), Get(coord), Delete(r1)])
            events = watcher.next(5)
        written, read, _ = done.records
        assert done.succeeded and written is not None
        assert read is not None and read.value == "them"
        assert raw_get(url, "v3", r1) is None
        now = _raw(url, r2)
        assert now is not None and now[0] == granted, (granted, now)
        assert set(lease.keys()) == {r2}
        # One revision: a reader never sees both keys or neither.
        assert {(e.kind, e.record.key) for e in events} == {("delete", r1), ("put", r2)}
        assert {e.record.revision for e in events} == {written.revision} != {first.revision}
        # The lease was revoked behind our back: a new one is granted, and the key
        # written on the old one is reported gone at the next keep-alive.
        revoke(url, granted)
        kv.txn([], [Put(r3, "me", lease), Get(coord)])
        again = _raw(url, r3)
        assert again is not None and again[0] == lease.id not in (0, granted) and again[1] > 0
        assert raw_get(url, "v3", r2) is None
        assert kv.keep_alive(lease) == [r2]
        assert set(lease.keys()) == {r3}
    finally:
        kv.close()
    assert raw_get(url, "v3", r3) is None  # the node lease was revoked on close


def test_a_lease_is_reused_while_fresh_renewed_when_stale_granted_when_gone(
    etcd_api_params: Params, url: str, etcd_key_prefix: str
) -> None:
    """What a join takes (``KV.grant(ttl, reuse=...)``): the node's lease as it is while
    its last renewal is recent (no request), after one keep-alive when it is older
    than half its TTL, a new lease on the same handle when it is gone."""
    kv = etcd_rdzv.create_client(etcd_api_params(read_timeout=5))
    try:
        before = _leases(url)
        lease = kv.grant(60)
        granted = lease.id
        assert kv.grant(60, reuse=lease) is lease and lease.id == granted
        lease.renewed -= 40  # older than half the TTL
        assert kv.grant(60, reuse=lease) is lease and lease.id == granted
        assert time.monotonic() - lease.renewed < 5  # renewed by a keep-alive
        revoke(url, granted)
        lease.renewed -= 40
        assert kv.grant(60, reuse=lease) is lease and lease.id not in (0, granted)
        assert _leases(url) - before == {lease.id}
        other = kv.grant(30, reuse=lease)  # another TTL: another lease
        assert other is not lease and other.id != lease.id and other.ttl == 30
    finally:
        kv.close()


@pytest.fixture
def losing(etcd_api_server: EtcdServer) -> Iterator[LosingProxy]:
    with in_front_of(etcd_api_server) as proxy:
        yield proxy


# etcd's answer to a proposal that its request timeout ended (gRPC Unavailable).
_TIMED_OUT = json.dumps(
    {
        "error": "etcdserver: request timed out",
        "code": 14,
        "message": "etcdserver: request timed out",
    }
).encode()
_TIMED_OUT_REPLY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_TIMED_OUT), _TIMED_OUT)
)


def _grants(url: str) -> int:
    """The lease grants etcd has served (its gRPC metrics: the gateway's too)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found = re.search(
        r'^grpc_server_started_total{[^}]*grpc_method="LeaseGrant"[^}]*} (\S+)$', text, re.M
    )
    return int(float(found.group(1))) if found else 0


@pytest.mark.parametrize("answer", ["lost", "request timed out"])
def test_a_grant_sent_again_makes_one_lease(
    etcd_api_params: Params,
    etcd_api_server: EtcdServer,
    url: str,
    losing: LosingProxy,
    answer: str,
) -> None:
    """A lease grant that etcd applied but whose answer the client did not get (lost,
    or etcd's "request timed out" for a proposal that was applied after all) is sent
    again and finds the lease its first send made: etcd holds one lease, the
    client's. (A second one would live its TTL unrenewed and cost etcd a revoke.)"""
    params = etcd_api_params(read_timeout=5)
    params.endpoint = f"127.0.0.1:{losing.port},{etcd_api_server.endpoint}"
    kv = etcd_rdzv.create_client(params)
    try:
        kv.get("/warm-up")  # the client's probe, before the proxy is armed
        before = _leases(url)
        reply = _TIMED_OUT_REPLY if answer != "lost" else b""
        losing.arm(b"/v3/lease/grant", lambda: None, reply=reply)
        grants = _grants(url)
        lease = kv.grant(60)
        assert losing.lost == 1
        assert _leases(url) - before == {lease.id}
        assert lease_ttl(url, lease.id)[0] > 50
        # The second send asked whether the lease was there before it granted again:
        # etcd saw one grant (a raft proposal), not two.
        assert _grants(url) - grants == 1
    finally:
        kv.close()


def test_a_lease_id_taken_in_etcd_is_not_taken_over(
    kv: KV, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lease ids are chosen by the client (so that a grant sent again is recognised);
    an id that etcd already holds for someone else is left to its owner, and another
    one is granted."""
    taken = int(v3_post(url, "/v3/lease/grant", {"TTL": "60"})["ID"])
    ids = iter([taken, 12345678901])
    monkeypatch.setattr(v3_lease, "_new_lease_id", lambda: next(ids))
    before = _leases(url)
    lease = kv.grant(30)
    assert lease.id == 12345678901
    assert _leases(url) - before == {lease.id}
    assert lease_ttl(url, taken)[0] > 50  # untouched: not renewed, not revoked by us
    assert lease_ttl(url, lease.id) == (lease_ttl(url, lease.id)[0], 30)


def test_a_refused_guarded_join_puts_nothing_on_the_lease(
    etcd_api_params: Params, url: str, etcd_key_prefix: str
) -> None:
    """A join whose guard (the round hint) is refused wrote nothing: the lease holds
    no key, and the join key written next goes on it without a grant."""
    kv = etcd_rdzv.create_client(etcd_api_params(read_timeout=5))
    hint, coord = f"{etcd_key_prefix}/hint", f"{etcd_key_prefix}/coord"
    try:
        kv.put(hint, "4", 60)
        before = _leases(url)
        lease = kv.grant(60)
        refused = kv.txn(
            [Compare(hint, None)], [Put(f"{etcd_key_prefix}/r1/me", "me", lease), Get(coord)]
        )
        (current,) = refused.compared
        assert not refused.succeeded and current is not None and current.value == "4"
        assert raw_get(url, "v3", f"{etcd_key_prefix}/r1/me") is None
        assert lease.keys() == {}
        kv.txn([Compare(hint, "4")], [Put(f"{etcd_key_prefix}/r4/me", "me", lease), Get(coord)])
        held = _raw(url, f"{etcd_key_prefix}/r4/me")
        assert held is not None and held[0] == lease.id, (lease, held)
        assert _leases(url) - before == {lease.id}
    finally:
        kv.close()


def test_a_built_handler_holds_no_lease_until_its_first_join_grants_one(
    etcd_api_params: Params, url: str, etcd_key_prefix: str
) -> None:
    """The build grants no lease (a grant is a raft proposal, and one made ahead of
    the join ran out unused under load): the first join grants the node's lease, and
    its key is on it."""
    before = _leases(url)
    params = etcd_api_params(backend="etcd-rdzv")
    handler = etcd_rdzv.create_handler(params)
    try:
        assert _leases(url) - before == set()
        result = handler.next_rendezvous()
        key = node_key(etcd_key_prefix, params.run_id, result.round, handler.node_id)
        held = _raw(url, key)
        assert held is not None and held[0] in _leases(url) - before, held
    finally:
        handler.shutdown()


def test_a_started_watcher_serves_the_reread_that_follows_within_read_timeout(
    etcd_api_params: Params, url: str, etcd_key_prefix: str
) -> None:
    """``start()`` opens the stream; a reread within ``read_timeout`` uses it (no new
    stream), a later one opens a new one, and an unstarted watcher opens one per
    reread. Nothing between the start and the read is lost or comes twice."""
    kv = etcd_rdzv.create_client(etcd_api_params(read_timeout=1))
    key = f"{etcd_key_prefix}/coord"
    try:
        with kv.watcher(key) as watcher:
            s0 = watch_streams_started(url)
            watcher.start()
            kv.put(key, "between", None)  # after the start, before the read: in the read
            record, revision = watcher.reread(lambda: kv.get(key))
            assert watch_streams_started(url) == s0 + 1
            assert record is not None and record.value == "between"
            kv.put(key, "after", None)
            events = watcher.next(5)
            assert [(e.kind, e.record.value) for e in events] == [("put", "after")]
            assert events[0].record.revision > revision
            watcher.reread(lambda: kv.get(key))  # not started: a new stream
            assert watch_streams_started(url) == s0 + 2
        with kv.watcher(key) as watcher:
            watcher.start()
            time.sleep(1.3)  # older than read_timeout: it may be dead; a new one
            watcher.reread(lambda: kv.get(key))
            assert watch_streams_started(url) == s0 + 4
            kv.put(key, "last", None)
            assert [e.record.value for e in watcher.next(5)] == ["last"]
    finally:
        kv.close()


def test_a_built_handler_has_the_watch_of_its_first_join_open(
    etcd_api_params: Params, url: str, etcd_key_prefix: str
) -> None:
    """Built, a handler opens the watch its first join needs. This node is the run's
    first: its build read the run (no incarnation yet), so it starts the run before
    its first join, which uses that watch; then comes the coordinator's watch of the
    round (the node is alone, so it coordinates). A node joining a started run uses
    the watch it opened when built too (see the follower's test below)."""
    params = etcd_api_params(backend="etcd-rdzv", keep_alive_interval=10)
    s0 = watch_streams_started(url)
    handler = etcd_rdzv.create_handler(params)
    try:
        assert watch_streams_started(url) == s0 + 1
        result = handler.next_rendezvous()
        # The member watcher starts a second or more after the rank: not counted yet.
        assert watch_streams_started(url) == s0 + 2
        assert result.rank == 0 and result.world_size == 1
    finally:
        handler.shutdown()


def test_a_built_handler_joins_as_a_follower_over_connections_it_opened_before(
    etcd_api_params: Params, url: str, etcd_key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A built follower's join is its transaction and the watch it started when built:
    it opens no connection (the lease's grant left one idle for the transaction)."""
    params = etcd_api_params(backend="etcd-rdzv", min_nodes=2, max_nodes=2)
    first, second = etcd_rdzv.create_handler(params), etcd_rdzv.create_handler(params)
    opened: list[object] = []
    transport = second._kv._transport  # type: ignore[attr-defined]
    connect = transport._connect

    def counting(*args: object, **kwargs: object) -> object:
        opened.append(args)
        return connect(*args, **kwargs)

    monkeypatch.setattr(transport, "_connect", counting)
    results: list[object] = []
    coordinating = threading.Thread(target=lambda: results.append(first.next_rendezvous()))
    try:
        coordinating.start()
        coord = coord_key(etcd_key_prefix, params.run_id, 1)
        deadline = time.monotonic() + 30
        while raw_get(url, "v3", coord) is None:
            assert time.monotonic() < deadline, "the first handler never coordinated"
            time.sleep(0.01)
        joined = second.next_rendezvous()
        coordinating.join(30)
        assert (joined.rank, joined.world_size) == (1, 2)
        assert opened == []
    finally:
        first.shutdown()
        second.shutdown()


def test_a_fleet_node_prepares_its_join_without_a_lease(
    etcd_api_params: Params, url: str, etcd_key_prefix: str, tmp_path: Path
) -> None:
    """The fleet's ``prepare`` (the benchmark sends it just before its go signal, as
    a fleet of 1024 processes takes minutes to start) opens the watch again and
    grants nothing, as the build did not: the join grants the lease its key goes on."""
    params = etcd_api_params(backend="etcd-rdzv")
    before = _leases(url)
    with Fleet(tmp_path, max_life=60) as fleet:
        node = fleet.start("n0", params, kind="ours", log_level="WARNING")
        fleet.ready(timeout=60)
        assert _leases(url) - before == set()
        node.send("prepare")
        fleet.wait(node, "prepared", 30)
        assert _leases(url) - before == set()
        node.join()
        (joined,) = fleet.wait_each([node], "round", 30)
        key = node_key(etcd_key_prefix, params.run_id, joined["round"], node.node_ids[0] or "")
        held = _raw(url, key)
        assert held is not None and held[0] in _leases(url) - before, held


def test_too_large_a_value_is_a_value_error(kv: KV, etcd_key_prefix: str) -> None:
    for size in (1_600_000, 3_000_000):  # etcd's request limit; gRPC's message limit
        with pytest.raises(ValueError, match="too large") as info:
            kv.put(f"{etcd_key_prefix}/big", "x" * size, None)
        assert not isinstance(info.value, RendezvousConnectionError)
        assert f"{etcd_key_prefix}/big" in str(info.value)
    assert kv.get(f"{etcd_key_prefix}/big")[0] is None


def test_keep_alive_keeps_the_keys_of_a_lease_past_its_ttl(
    kv: KV, url: str, etcd_key_prefix: str
) -> None:
    key = f"{etcd_key_prefix}/node"
    lease = kv.grant(2)
    record = kv.put_owned(key, "me", lease)
    started = time.monotonic()
    while time.monotonic() - started < 3.5:  # well past the TTL of 2 s
        assert kv.keep_alive(lease) == []
        time.sleep(0.4)  # a heartbeat interval
    alive = raw_get(url, "v3", key)
    assert alive is not None and alive.revision == record.revision  # kept, not rewritten
    # No more heartbeats: etcd deletes the key when the lease runs out.
    event = kv.watch(key, record.revision + 1, timeout=15)
    assert event is not None and event.kind == "delete"
    assert kv.keep_alive(lease) == [key] and lease.id == 0


def test_refresh_is_false_for_a_missing_key_or_a_revoked_lease(
    kv: KV, url: str, etcd_key_prefix: str
) -> None:
    assert kv.refresh(f"{etcd_key_prefix}/never", 5) is False
    key = f"{etcd_key_prefix}/node"
    kv.put_owned(key, "me", kv.grant(30))
    lease = _raw(url, key)
    assert lease is not None
    revoke(url, lease[0])
    assert kv.refresh(key, 30) is False


def test_refresh_attaches_a_key_without_lease(kv: KV, url: str, etcd_key_prefix: str) -> None:
    key = f"{etcd_key_prefix}/plain"
    kv.put(key, "v", None)
    assert kv.refresh(key, 300) is True
    raw = _raw(url, key)
    assert raw is not None and raw[0] != 0 and raw[2] == 300
    record, _ = kv.get(key)
    assert record is not None and record.value == "v"


def test_a_write_keeps_its_clean_up_lease_alive(kv: KV, url: str, etcd_key_prefix: str) -> None:
    kv.put(f"{etcd_key_prefix}/old", "1", 10)
    time.sleep(1.5)  # older than TTL/10: the next write renews the lease first
    before = _raw(url, f"{etcd_key_prefix}/old")
    kv.put(f"{etcd_key_prefix}/new", "2", 10)
    after = _raw(url, f"{etcd_key_prefix}/old")
    assert before is not None and after is not None
    assert after[0] == before[0]  # the same lease ...
    assert after[1] > before[1]  # ... kept alive: the old key lives on too


def test_write_after_the_lease_expired_grants_a_new_one(
    kv: KV, url: str, etcd_key_prefix: str
) -> None:
    first = kv.put(f"{etcd_key_prefix}/a", "1", 1)
    lease = _raw(url, f"{etcd_key_prefix}/a")
    assert lease is not None
    event = kv.watch(f"{etcd_key_prefix}/a", first.revision + 1, timeout=15)
    assert event is not None and event.kind == "delete"  # the lease expired
    kv.put(f"{etcd_key_prefix}/b", "2", 1)
    again = _raw(url, f"{etcd_key_prefix}/b")
    assert again is not None and again[0] not in (0, lease[0])


@pytest.mark.parametrize("write", ["put", "create", "compare_and_set", "put_owned"])
def test_write_after_the_lease_was_revoked_behind_our_back(
    kv: KV, url: str, etcd_key_prefix: str, write: str
) -> None:
    """etcd answers "requested lease not found": the write is sent again on a new lease."""
    key = f"{etcd_key_prefix}/k"
    node_lease = kv.grant(600)
    if write == "put_owned":
        kv.put_owned(f"{etcd_key_prefix}/first", "1", node_lease)
    else:
        kv.put(f"{etcd_key_prefix}/first", "1", 600)
    lease = _raw(url, f"{etcd_key_prefix}/first")
    assert lease is not None
    revoke(url, lease[0])  # fresh in the client's eyes: it will not check before writing
    if write == "put":
        kv.put(key, "v", 600)
    elif write == "put_owned":
        kv.put_owned(key, "v", node_lease)
    elif write == "create":
        assert kv.create(key, "v", 600) is not None
    else:
        record = kv.put(f"{key}-plain", "v0", None)
        key = f"{key}-plain"
        assert kv.compare_and_set(key, "v", record.revision, 600) is not None
    now = _raw(url, key)
    assert now is not None and now[0] not in (0, lease[0]) and now[1] > 0
    assert raw_get(url, "v3", key).value == "v"  # type: ignore[union-attr]


# -- watches ---------------------------------------------------------------------------


def test_watch_from_a_past_revision_returns_history(kv: KV, etcd_key_prefix: str) -> None:
    key = f"{etcd_key_prefix}/k"
    one = kv.put(key, "v1", None)
    kv.put(key, "v2", None)
    kv.delete(key)
    events = []
    revision = one.revision
    for _ in range(3):
        event = kv.watch(key, revision, timeout=5)
        assert event is not None
        events.append((event.kind, event.record.value))
        revision = event.record.revision + 1
    assert events == [("put", "v1"), ("put", "v2"), ("delete", "")]
    assert kv.watch(key, revision, timeout=0.2) is None


def test_watch_events_returns_every_change_already_there(kv: KV, etcd_key_prefix: str) -> None:
    d = f"{etcd_key_prefix}/dir"
    _, revision = kv.get(d)
    written = [kv.put(f"{d}/{i}", str(i), None) for i in range(3)]
    kv.delete(f"{d}/0")
    events = kv.watch_events(d, revision + 1, timeout=5, prefix=True)
    assert [(e.kind, e.record.key) for e in events] == [
        ("put", f"{d}/0"),
        ("put", f"{d}/1"),
        ("put", f"{d}/2"),
        ("delete", f"{d}/0"),
    ]
    assert [e.record.revision for e in events[:3]] == [r.revision for r in written]
    assert all(e.current >= events[-1].record.revision for e in events)
    assert kv.watch_events(d, events[-1].record.revision + 1, timeout=0.2, prefix=True) == []


def test_watch_on_compacted_history_raises(kv: KV, url: str, etcd_key_prefix: str) -> None:
    key = f"{etcd_key_prefix}/k"
    one = kv.put(key, "v1", None)
    two = kv.put(key, "v2", None)
    compact(url, two.revision)
    with pytest.raises(WatchCompacted):
        kv.watch(key, one.revision, timeout=5)
    event = kv.watch(key, two.revision, timeout=5)  # from the compaction point on it works
    assert event is not None and event.record.value == "v2"


def test_watch_is_bounded_and_re_armed_past_read_timeout(
    etcd_api_params: Params, etcd_key_prefix: str
) -> None:
    kv = etcd_rdzv.create_client(etcd_api_params(read_timeout=2))
    try:
        key = f"{etcd_key_prefix}/k"
        _, revision = kv.get(key)
        started = time.monotonic()
        assert kv.watch(key, revision + 1, timeout=0.3) is None
        assert time.monotonic() - started < 1.5  # its own timeout, not read_timeout
        timer = threading.Timer(2.6, kv.put, args=(key, "late", None))
        timer.start()
        started = time.monotonic()
        event = kv.watch(key, revision + 1, timeout=10)  # outlives one read_timeout
        timer.join()
        assert event is not None and event.record.value == "late"
        assert 2.3 < time.monotonic() - started < 6
    finally:
        kv.close()


def test_prefix_watch_sees_keys_below_the_directory_only(kv: KV, etcd_key_prefix: str) -> None:
    directory = f"{etcd_key_prefix}/dir"
    _, revision = kv.get(directory)
    kv.put(directory + "x", "sibling", None)  # shares the prefix, not the directory
    kv.put(directory + "/a/b", "inside", None)
    event = kv.watch(directory, revision + 1, timeout=5, prefix=True)
    assert event is not None and event.record.key == directory + "/a/b"


def test_lists_and_delete_prefix_respect_directories(kv: KV, etcd_key_prefix: str) -> None:
    d = f"{etcd_key_prefix}/dir"
    for key in (d, f"{d}/a", f"{d}/b/c", f"{d}x"):
        kv.put(key, "v", None)
    assert [r.key for r in kv.list_prefix(d)[0]] == [f"{d}/a"]
    assert [r.key for r in kv.list_tree(d)[0]] == [f"{d}/a", f"{d}/b/c"]
    kv.delete_prefix(d)
    assert kv.list_tree(d)[0] == []
    assert kv.get(d)[0] is None
    assert kv.get(f"{d}x")[0] is not None  # a sibling, not below the directory


# -- auth ------------------------------------------------------------------------------


def _v3_auth(url: str, path: str, body: dict[str, object], token: str | None = None) -> None:
    request = urllib.request.Request(
        f"{url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **({"Authorization": token} if token else {})},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=5):
        return


@pytest.fixture
def short_token_server(etcd_variant: str) -> Iterator[EtcdServer]:
    """v3 auth with simple tokens that expire after 2 s unused; users ``root`` (all) and
    ``limited`` (read/write below ``/allowed/`` only)."""
    extra = ["--auth-token", "simple", "--auth-token-ttl", "2"]
    options = variant_server_options(etcd_variant)
    with EtcdServer("short-token", extra_args=extra, **options) as server:
        url = server.client_url
        v3_post(url, "/v3/auth/user/add", {"name": "root", "password": "rootpw"})
        v3_post(url, "/v3/auth/user/grant", {"user": "root", "role": "root"})
        v3_post(url, "/v3/auth/user/add", {"name": "limited", "password": "pw"})
        v3_post(url, "/v3/auth/role/add", {"name": "allowed"})
        permission = {"permType": "READWRITE", "key": "L2FsbG93ZWQv", "range_end": "L2FsbG93ZWQw"}
        v3_post(url, "/v3/auth/role/grant", {"name": "allowed", "perm": permission})
        v3_post(url, "/v3/auth/user/grant", {"user": "limited", "role": "allowed"})
        v3_post(url, "/v3/auth/enable", {})
        yield server


def test_expired_token_is_replaced(
    short_token_server: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="etcd_rdzv")
    params = short_token_server.params(
        "tok", api="v3", username="root", password="rootpw", read_timeout=5, key_prefix="/t"
    )
    kv = etcd_rdzv.create_client(params)
    try:
        first = kv.put("/t/k", "v1", 30)
        old = kv._token  # type: ignore[attr-defined]
        assert old
        time.sleep(3.5)  # idle past the token TTL (2 s; etcd checks every second)
        with pytest.raises(urllib.error.HTTPError) as expired:
            _v3_auth(short_token_server.client_url, "/v3/kv/range", {"key": "L3Qvaw=="}, old)
        assert expired.value.code == 401  # the old token is really gone
        record, _ = kv.get("/t/k")  # a unary request: "invalid auth token", once
        assert record is not None and record.value == "v1"
        assert kv._token not in (None, old)  # type: ignore[attr-defined]
        assert "authenticating again" in caplog.text
        time.sleep(3.5)  # expired again; now a watch is the first to notice
        event = kv.watch("/t/k", first.revision, timeout=5)
        assert event is not None and event.record.value == "v1"
    finally:
        kv.close()


def test_missing_permission_names_user_and_key(short_token_server: EtcdServer) -> None:
    params = short_token_server.params(
        "r", api="v3", username="limited", password="pw", read_timeout=5, key_prefix="/allowed"
    )
    kv = etcd_rdzv.create_client(params)
    try:
        kv.put("/allowed/k", "ok", 30)
        with pytest.raises(RendezvousConnectionError) as info:
            kv.put("/elsewhere/k", "no", None)
    finally:
        kv.close()
    message = str(info.value)
    assert "refused" in message and "user 'limited'" in message
    assert "/elsewhere/k" in message and "permission" in message
    assert "pw" not in message.replace("password", "")


# -- one API per job (the mixed cases: test_mixed_api.py) ------------------------------


def test_v2_client_on_an_etcd_without_v2_is_told_to_use_v3(etcd_api_server: EtcdServer) -> None:
    params = etcd_api_server.params("r", api="v2", read_timeout=5)
    with pytest.raises(RendezvousConnectionError, match=r"does not serve the v2 API.*api=v3"):
        etcd_rdzv.create_client(params)
