"""Client behaviour when etcd members fail: failover, clear errors, no hangs.

These use a local 3-member cluster (etcd_rdzv.testing.EtcdCluster), once per etcd
variant: v2, v3 on etcd 3.5 and v3 on Debian's etcd 3.4 (without the v2 API).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousConnectionError
from etcd_rdzv._kv import Event
from etcd_rdzv.testing import EtcdCluster
from etcd_rdzv.testing.pytest_plugin import variant_server_options

pytestmark = pytest.mark.etcd_variants("v2", "v3", "v3-3.4")


@pytest.fixture
def cluster(etcd_variant: str) -> Iterator[EtcdCluster]:
    with EtcdCluster(3, **variant_server_options(etcd_variant)) as c:
        yield c


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def test_unreachable_etcd_fails_within_read_timeout(etcd_api: str) -> None:
    params = etcd_rdzv.RendezvousParameters(
        "etcd-rdzv-dynamic", f"127.0.0.1:{_closed_port()}", "r", 1, 1, read_timeout=2, api=etcd_api
    )
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=r"127\.0\.0\.1"):
        etcd_rdzv.create_client(params)
    assert time.monotonic() - started < 4


def test_first_endpoint_down_uses_the_next(
    cluster: EtcdCluster, etcd_key_prefix: str, etcd_api: str
) -> None:
    dead = f"127.0.0.1:{_closed_port()}"
    params = cluster.params("r", key_prefix=etcd_key_prefix, read_timeout=3, api=etcd_api)
    params.endpoint = f"{dead},{cluster.endpoint}"
    backend, store = etcd_rdzv.create_backend(params)
    backend.set_state(b"ok")
    assert backend.get_state()[0] == b"ok"  # type: ignore[index]
    assert store._kv.endpoints[0] != f"http://{dead}"  # it moved on and stays moved


def test_member_killed_mid_run_fails_over(
    cluster: EtcdCluster, etcd_key_prefix: str, etcd_api: str
) -> None:
    params = cluster.params("r", key_prefix=etcd_key_prefix, read_timeout=3, api=etcd_api)
    backend, store = etcd_rdzv.create_backend(params)
    _, token, _ = backend.set_state(b"one")  # type: ignore[misc]
    store.set("before", "1")
    assert store.add("count", 1) == 1

    cluster.members[0].kill()  # the endpoint the client uses first

    state, token2, has_set = backend.set_state(b"two", token)  # type: ignore[misc]
    assert (state, has_set) == (b"two", True)
    assert store.get("before") == b"1"  # written before the fault, readable after
    assert store.add("count", 1) == 2
    assert backend.get_state() == (b"two", token2)


def test_paused_member_with_all_endpoints_carries_on(
    cluster: EtcdCluster, etcd_key_prefix: str, etcd_api: str
) -> None:
    params = cluster.params("r", key_prefix=etcd_key_prefix, read_timeout=2, api=etcd_api)
    _backend, store = etcd_rdzv.create_backend(params)
    for i in range(5):
        store.add("n", 1)
        store.set(f"k{i}", "v")
    cluster.members[0].pause()
    try:
        # Writes whose answer is lost on the frozen member are resolved by reading
        # back on the next one: totals stay exact.
        for _ in range(5):
            store.add("n", 1)
        assert store.get("n") == b"10"
        assert all(store.check([f"k{i}"]) for i in range(5))
    finally:
        cluster.members[0].resume()


def test_only_endpoint_paused_gives_connection_error_not_hang(
    cluster: EtcdCluster, etcd_key_prefix: str, etcd_api: str
) -> None:
    member = cluster.members[1]
    params = member.params("r", key_prefix=etcd_key_prefix, read_timeout=2, api=etcd_api)
    backend, _store = etcd_rdzv.create_backend(params)
    backend.set_state(b"x")
    member.pause()
    try:
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match=member.endpoint):
            backend.get_state()
        assert time.monotonic() - started < 6
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError):
            etcd_rdzv.create_client(params)
        assert time.monotonic() - started < 6
    finally:
        member.resume()


def test_member_killed_under_a_watch_the_watch_carries_on(
    cluster: EtcdCluster, etcd_key_prefix: str, etcd_api: str
) -> None:
    """A watch waiting on a member that dies moves to another member, from the same
    revision, and still sees the write made after the kill."""
    params = cluster.params("r", key_prefix=etcd_key_prefix, read_timeout=3, api=etcd_api)
    kv = etcd_rdzv.create_client(params)
    writer = etcd_rdzv.create_client(params)
    key = f"{etcd_key_prefix}/watched"
    events: list[Event | None] = []
    try:
        _, revision = kv.get(key)
        watcher = threading.Thread(
            target=lambda: events.append(kv.watch(key, revision + 1, timeout=20))
        )
        watcher.start()
        first = cluster.members[0]
        first.kill()  # the member every client starts on, the watch's included
        writer.put(key, "after the kill", None)
        watcher.join(30)
        assert not watcher.is_alive()
        assert len(events) == 1 and events[0] is not None
        assert (events[0].kind, events[0].record.value) == ("put", "after the kill")
        assert kv.endpoints[0] != first.client_url
    finally:
        kv.close()
        writer.close()


def test_handlers_built_before_their_member_froze_still_complete_the_round(
    cluster: EtcdCluster, etcd_key_prefix: str, etcd_api: str
) -> None:
    """A built handler holds the watch of its first join open (v3) on the member it
    talks to. That member freezes (SIGSTOP) before the join: the joins go to another
    member, the silent watch is opened again there, and the round completes."""
    params = cluster.params(
        "r",
        key_prefix=etcd_key_prefix,
        read_timeout=2,
        api=etcd_api,
        backend="etcd-rdzv",
        min_nodes=2,
        max_nodes=2,
        join_timeout=60,
    )
    handlers = [etcd_rdzv.create_handler(params) for _ in range(2)]
    frozen = cluster.members[0]  # every handler's first endpoint: where its watch is
    results: list[object] = []

    def join(handler: etcd_rdzv.EtcdRendezvousHandler) -> None:
        try:
            results.append(handler.next_rendezvous())
        except Exception as exc:  # reported by the assertion below
            results.append(exc)

    frozen.pause()
    try:
        threads = [threading.Thread(target=join, args=(h,)) for h in handlers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)  # generous: a hang fails here, not in CI's overall timeout
        assert not any(t.is_alive() for t in threads)
        ranks = sorted(getattr(r, "rank", r) for r in results)
        assert ranks == [0, 1], results
    finally:
        frozen.resume()
        for h in handlers:
            h.shutdown()
