"""Client behaviour when etcd members fail: failover, clear errors, no hangs.

These use a local 3-member cluster (etcd_rdzv.testing.EtcdCluster).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousConnectionError
from etcd_rdzv.testing import EtcdCluster


@pytest.fixture
def cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster(3) as c:
        yield c


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def test_unreachable_etcd_fails_within_read_timeout() -> None:
    params = etcd_rdzv.RendezvousParameters(
        "etcd-rdzv-dynamic", f"127.0.0.1:{_closed_port()}", "r", 1, 1, read_timeout=2
    )
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=r"127\.0\.0\.1"):
        etcd_rdzv.create_client(params)
    assert time.monotonic() - started < 4


def test_first_endpoint_down_uses_the_next(cluster: EtcdCluster, etcd_key_prefix: str) -> None:
    dead = f"127.0.0.1:{_closed_port()}"
    params = cluster.params("r", key_prefix=etcd_key_prefix, read_timeout=3)
    params.endpoint = f"{dead},{cluster.endpoint}"
    backend, store = etcd_rdzv.create_backend(params)
    backend.set_state(b"ok")
    assert backend.get_state()[0] == b"ok"  # type: ignore[index]
    assert store._kv.endpoints[0] != f"http://{dead}"  # it moved on and stays moved


def test_member_killed_mid_run_fails_over(cluster: EtcdCluster, etcd_key_prefix: str) -> None:
    params = cluster.params("r", key_prefix=etcd_key_prefix, read_timeout=3)
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
    cluster: EtcdCluster, etcd_key_prefix: str
) -> None:
    params = cluster.params("r", key_prefix=etcd_key_prefix, read_timeout=2)
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
    cluster: EtcdCluster, etcd_key_prefix: str
) -> None:
    member = cluster.members[1]
    params = member.params("r", key_prefix=etcd_key_prefix, read_timeout=2)
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


def test_v2_disabled_is_reported_clearly(etcd_key_prefix: str) -> None:
    from etcd_rdzv.testing import EtcdServer

    with (
        EtcdServer("nov2", enable_v2=False) as server,
        pytest.raises(RendezvousConnectionError, match="--enable-v2"),
    ):
        etcd_rdzv.create_client(server.params("r", key_prefix=etcd_key_prefix))
