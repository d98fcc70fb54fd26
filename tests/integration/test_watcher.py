"""``KV.watcher``: the changes after a read, batch by batch, on every etcd variant.

The handler's coordinator and followers wait through a watcher. On v2 each batch is a
long poll; on v3 one watch stream stays open (read by the thread that waits, no
thread of its own) and is opened *before* the read, so etcd delivers its events at
once instead of after its 100 ms catch-up loop. What must hold either way: nothing
after the read is missed, nothing up to it comes back, a quiet key outlives
``read_timeout``, a dead member's stream moves to another endpoint, and closing the
client ends a wait under way.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousParameters
from etcd_rdzv._kv import (
    KV,
    Compare,
    Delete,
    Event,
    Get,
    Lease,
    Op,
    Present,
    Put,
    TxnResult,
    WatchCompacted,
    Watcher,
)
from etcd_rdzv.errors import RendezvousConnectionError
from etcd_rdzv.testing import EtcdCluster, EtcdServer
from etcd_rdzv.testing.pytest_plugin import variant_server_options

from ._rawkv import compact

pytestmark = pytest.mark.etcd_variants("v2", "v3", "v3-3.4")

Params = Callable[..., RendezvousParameters]


@pytest.fixture
def kv(etcd_api_params: Params) -> Iterator[KV]:
    client = etcd_rdzv.create_client(etcd_api_params(read_timeout=5))
    yield client
    client.close()


def _collect(watcher: Watcher, count: int, timeout: float = 10.0) -> list[Event]:
    """At least ``count`` events, within ``timeout`` seconds."""
    events: list[Event] = []
    deadline = time.monotonic() + timeout
    while len(events) < count and time.monotonic() < deadline:
        events += watcher.next(max(deadline - time.monotonic(), 0.01))
    return events


def _watch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("etcd-rdzv-watch:")]


def test_every_change_after_the_read_once_in_order(kv: KV, etcd_key_prefix: str) -> None:
    d = f"{etcd_key_prefix}/dir"
    kv.put(f"{d}/before", "old", None)
    with kv.watcher(d, prefix=True) as watcher:
        records, revision = watcher.reread(lambda: kv.list_tree(d))
        assert [r.key for r in records] == [f"{d}/before"]
        a = kv.put(f"{d}/a", "1", None)
        b = kv.put(f"{d}/b/c", "2", None)
        kv.delete(f"{d}/before")
        events = _collect(watcher, 3)
        assert [(e.kind, e.record.key) for e in events] == [
            ("put", f"{d}/a"),
            ("put", f"{d}/b/c"),
            ("delete", f"{d}/before"),
        ]
        assert [e.record.revision for e in events[:2]] == [a.revision, b.revision]
        assert all(e.record.revision > revision for e in events)
        assert watcher.next(0.3) == []  # nothing twice, nothing invented
        assert watcher.after == events[-1].record.revision


def test_a_change_made_during_the_read_is_in_the_read_not_in_the_events(
    kv: KV, etcd_key_prefix: str
) -> None:
    d = f"{etcd_key_prefix}/dir"

    def read() -> tuple[list[str], int]:
        kv.put(f"{d}/during", "x", None)  # after the watcher started, before the read
        records, revision = kv.list_tree(d)
        return [r.key for r in records], revision

    with kv.watcher(d, prefix=True) as watcher:
        keys, _ = watcher.reread(read)
        assert keys == [f"{d}/during"]
        kv.put(f"{d}/after", "y", None)
        events = _collect(watcher, 1)
        assert [e.record.key for e in events] == [f"{d}/after"]
        assert watcher.next(0.3) == []


def test_a_watcher_started_before_the_read_misses_nothing_after_it(
    kv: KV, etcd_key_prefix: str
) -> None:
    """``start()`` (a handler opens the watch of its first join when built): what
    changed between the start and the read is in the read, not in the events."""
    key = f"{etcd_key_prefix}/coord"
    with kv.watcher(key) as watcher:
        watcher.start()
        kv.put(key, "between", None)
        record, revision = watcher.reread(lambda: kv.get(key))
        assert record is not None and record.value == "between"
        kv.put(key, "after", None)
        kv.delete(key)
        events = _collect(watcher, 2)
        assert [(e.kind, e.record.value) for e in events] == [("put", "after"), ("delete", "")]
        assert all(e.record.revision > revision for e in events)
        assert watcher.next(0.3) == []


def test_next_returns_empty_on_its_timeout_and_a_quiet_key_outlives_read_timeout(
    etcd_api_params: Params, etcd_key_prefix: str
) -> None:
    kv = etcd_rdzv.create_client(etcd_api_params(read_timeout=2))
    key = f"{etcd_key_prefix}/k"
    try:
        with kv.watcher(key) as watcher:
            watcher.reread(lambda: kv.get(key))
            started = time.monotonic()
            assert watcher.next(0.3) == []
            assert time.monotonic() - started < 1.5  # its own timeout, not read_timeout
            timer = threading.Timer(2.6, kv.put, args=(key, "late", None))
            timer.start()
            events = watcher.next(10)  # silence beyond read_timeout, then the change
            timer.join()
            assert [(e.kind, e.record.value) for e in events] == [("put", "late")]
    finally:
        kv.close()


def test_a_watcher_holds_no_thread_and_closing_the_client_ends_a_wait(
    etcd_api_params: Params, etcd_key_prefix: str
) -> None:
    before = set(_watch_threads())
    kv = etcd_rdzv.create_client(etcd_api_params(read_timeout=5))
    key = f"{etcd_key_prefix}/k"
    first = kv.watcher(key)
    first.reread(lambda: kv.get(key))
    second = kv.watcher(key)
    second.reread(lambda: kv.get(key))
    assert first.next(0.1) == []
    assert set(_watch_threads()) - before == set()
    first.close()
    waited: list[object] = []

    def wait() -> None:
        began = time.monotonic()
        try:
            waited.append(second.next(30))
        except RendezvousConnectionError as exc:
            waited.append(exc)
        waited.append(time.monotonic() - began)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)  # the wait is under way
    kv.close()  # second was never closed
    waiter.join(15)
    assert not waiter.is_alive()
    if kv.api == "v3":
        # The stream's read ends at once; v2's long poll ends with its request.
        outcome, took = waited
        assert isinstance(outcome, RendezvousConnectionError), outcome
        assert "client was closed" in str(outcome)
        assert isinstance(took, float) and took < 5
    assert set(_watch_threads()) - before == set()


@pytest.mark.etcd_variants("v3", "v3-3.4")  # v2 has no compaction, only an event window
def test_compacted_history_raises_and_reread_recovers(
    kv: KV, etcd_api_server: EtcdServer, etcd_key_prefix: str
) -> None:
    key = f"{etcd_key_prefix}/k"
    one = kv.put(key, "v1", None)
    two = kv.put(key, "v2", None)
    compact(etcd_api_server.client_url, two.revision)
    watcher = kv.watcher(key)
    try:
        watcher.after = one.revision - 1  # a position from before the compaction
        with pytest.raises(WatchCompacted):
            watcher.next(5)
        record, revision = watcher.reread(lambda: kv.get(key))
        assert record is not None and record.value == "v2" and revision >= two.revision
        kv.put(key, "v3", None)
        assert [e.record.value for e in _collect(watcher, 1)] == ["v3"]
    finally:
        watcher.close()


@pytest.fixture
def cluster(etcd_variant: str) -> Iterator[EtcdCluster]:
    with EtcdCluster(3, **variant_server_options(etcd_variant)) as c:
        yield c


def test_the_watch_moves_on_when_its_member_dies(
    cluster: EtcdCluster, etcd_api: str, etcd_key_prefix: str
) -> None:
    kv = etcd_rdzv.create_client(
        cluster.params("r", key_prefix=etcd_key_prefix, read_timeout=3, api=etcd_api)
    )
    d = f"{etcd_key_prefix}/dir"
    try:
        with kv.watcher(d, prefix=True) as watcher:
            watcher.reread(lambda: kv.list_tree(d))
            kv.put(f"{d}/1", "before", None)
            assert [e.record.value for e in _collect(watcher, 1)] == ["before"]
            current = kv.endpoints[0]  # the member the stream (or the long poll) uses
            (member,) = [m for m in cluster.members if m.client_url == current]
            member.kill()
            written = [kv.put(f"{d}/{i}", f"after-{i}", None) for i in range(2, 5)]
            events = _collect(watcher, 3, timeout=20)
            assert [(e.record.key, e.record.revision) for e in events] == [
                (r.key, r.revision) for r in written
            ]
            assert kv.endpoints[0] != current
    finally:
        kv.close()


def test_the_watch_moves_on_when_its_member_freezes(
    cluster: EtcdCluster, etcd_api: str, etcd_key_prefix: str
) -> None:
    """A paused member keeps its connections open and says nothing: the stream (or
    long poll) looks like a quiet key until ``read_timeout`` of silence, and then
    the watcher must find the changes on another member, none lost."""
    kv = etcd_rdzv.create_client(
        cluster.params("r", key_prefix=etcd_key_prefix, read_timeout=2, api=etcd_api)
    )
    d = f"{etcd_key_prefix}/dir"
    frozen = None
    try:
        with kv.watcher(d, prefix=True) as watcher:
            watcher.reread(lambda: kv.list_tree(d))
            kv.put(f"{d}/1", "before", None)
            assert [e.record.value for e in _collect(watcher, 1)] == ["before"]
            current = kv.endpoints[0]
            (frozen,) = [m for m in cluster.members if m.client_url == current]
            frozen.pause()
            live = next(m for m in cluster.members if m is not frozen)
            writer = etcd_rdzv.create_client(
                live.params("w", key_prefix=etcd_key_prefix, read_timeout=2, api=etcd_api)
            )
            try:
                written = [writer.put(f"{d}/{i}", f"after-{i}", None) for i in range(2, 5)]
            finally:
                writer.close()
            events = _collect(watcher, 3, timeout=30)
            assert [(e.record.key, e.record.revision) for e in events] == [
                (r.key, r.revision) for r in written
            ]
    finally:
        if frozen is not None:
            frozen.resume()
        kv.close()


_LEASES: weakref.WeakKeyDictionary[KV, Lease] = weakref.WeakKeyDictionary()


def _txn(kv: KV, guard: list[Compare], key: str, other: str, old: str | None = None) -> Any:
    """The join's transaction: its key written, the coordinator key read, the key of
    the round it moves on from deleted."""
    lease = _LEASES.get(kv) or _LEASES.setdefault(kv, kv.grant(30))
    ops: list[Op] = [Put(key, "me", lease), Get(other)]
    if old is not None:
        ops.append(Delete(old))
    return kv.txn(guard, ops)


def test_a_txn_writes_reads_and_positions_a_watcher(
    etcd_api_params: Params, etcd_api: str, etcd_key_prefix: str
) -> None:
    kv = etcd_rdzv.create_client(etcd_api_params(read_timeout=5))
    other, key = f"{etcd_key_prefix}/other", f"{etcd_key_prefix}/mine"
    kv.put(other, "there", None)
    try:
        with kv.watcher(other) as watcher:

            def write() -> tuple[TxnResult, int]:
                done = _txn(kv, [], key, other)
                return done, done.revision

            done, revision = watcher.reread(write)
            written, read = done.records
            assert done.succeeded and written is not None
            assert (written.key, written.value) == (key, "me")
            assert read is not None and read.value == "there"
            assert revision >= written.revision
            assert kv.refresh(key, 30)  # a liveness key, like put_owned's
            kv.put(other, "changed", None)
            assert [e.record.value for e in _collect(watcher, 1)] == ["changed"]
        absent = kv.txn([], [Put(key, "again", _LEASES[kv]), Get(f"{etcd_key_prefix}/none")])
        assert absent.succeeded and absent.records[1] is None
    finally:
        kv.close()
    probe = etcd_rdzv.create_client(etcd_api_params(read_timeout=5))
    try:
        left, _ = probe.get(key)
        # v3 revokes a node lease in use on close; on v2 the key waits for its TTL.
        assert (left is None) == (etcd_api == "v3"), left
    finally:
        probe.close()


def test_a_txn_guarded_by_a_key_being_there_holds_for_any_value(
    etcd_api_params: Params, etcd_key_prefix: str
) -> None:
    """A first join: only into a run that has an incarnation, whatever it is; refused
    while the key is absent (nothing written, the key read as absent)."""
    kv = etcd_rdzv.create_client(etcd_api_params(read_timeout=5))
    marker, other = f"{etcd_key_prefix}/incarnation", f"{etcd_key_prefix}/coord"
    first, second = f"{etcd_key_prefix}/r1/a", f"{etcd_key_prefix}/r1/b"
    try:
        refused = _txn(kv, [Present(marker)], first, other)
        assert not refused.succeeded and refused.compared == (None,)
        assert kv.get(first)[0] is None, "a refused guard wrote nothing"
        for value in ("x", ""):  # any value, the empty one too
            kv.put(marker, value, None)
            done = _txn(kv, [Present(marker)], first if value else second, other)
            assert done.succeeded, value
            assert kv.get(first if value else second)[0] is not None
        kv.delete(marker)
        third = f"{etcd_key_prefix}/r1/c"  # (a key holding the Put's value: a resend)
        assert not _txn(kv, [Present(marker)], third, other).succeeded
        assert kv.get(third)[0] is None
    finally:
        kv.close()


def test_a_guarded_txn_writes_only_while_its_guard_holds(
    etcd_api_params: Params, etcd_key_prefix: str
) -> None:
    """The join's first write: only if the round hint names the round (absent: round
    1); refused, nothing is written and the hint is returned."""
    kv = etcd_rdzv.create_client(etcd_api_params(read_timeout=5))
    hint, other = f"{etcd_key_prefix}/hint", f"{etcd_key_prefix}/coord"
    one, two, three = (f"{etcd_key_prefix}/r{i}/me" for i in (1, 2, 3))
    kv.put(other, "there", None)
    try:
        # No hint: a guard of "absent" holds.
        with kv.watcher(other) as watcher:

            def write() -> tuple[TxnResult, int]:
                done = _txn(kv, [Compare(hint, None)], one, other)
                return done, done.revision

            done, revision = watcher.reread(write)
            assert done.succeeded and done.compared == ()
            written, read = done.records
            assert written is not None and (written.key, written.value) == (one, "me")
            assert read is not None and read.value == "there" and revision >= written.revision
            kv.put(other, "changed", None)
            assert [e.record.value for e in _collect(watcher, 1)] == ["changed"]
        assert kv.refresh(one, 30)  # a liveness key, like put_owned's
        # The hint names round 3: a guard expecting it absent, or "2", is refused.
        kv.put(hint, "3", None)
        for expected in (None, "2"):
            refused = _txn(kv, [Compare(hint, expected)], two, other)
            assert not refused.succeeded and refused.records == ()
            assert refused.revision >= written.revision
            (current,) = refused.compared
            assert current is not None and current.value == "3"
            assert kv.get(two)[0] is None, "a refused guard wrote nothing"
        done = _txn(kv, [Compare(hint, "3")], three, other, old=one)
        assert done.succeeded and done.records[0] is not None
        assert done.records[0].key == three
        assert kv.get(three)[0] is not None
        assert kv.get(one)[0] is None, "the Delete ran"
    finally:
        kv.close()
