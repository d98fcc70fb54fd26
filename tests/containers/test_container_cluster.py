"""A 3-member etcd cluster in containers: a member cut off the network, a member
killed and restarted.

The partition tests run once per API: ``v2`` on members started with
``--enable-v2``, ``v3`` on members without it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousConnectionError
from etcd_rdzv.testing import EtcdContainerCluster, EtcdNoLeaderError

READ_TIMEOUT = 2


@pytest.fixture(params=["v2", "v3"])
def api(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def cluster(etcd_container_image: str, api: str) -> Iterator[EtcdContainerCluster]:
    with EtcdContainerCluster(3, image=etcd_container_image, enable_v2=api == "v2") as c:
        yield c


def test_partitioned_member_clients_with_all_endpoints_carry_on(
    cluster: EtcdContainerCluster, api: str, etcd_key_prefix: str
) -> None:
    options = {"key_prefix": etcd_key_prefix, "read_timeout": READ_TIMEOUT, "api": api}
    backend, store = etcd_rdzv.create_backend(cluster.params("r", **options))
    _, token, _ = backend.set_state(b"one")  # type: ignore[misc]
    for i in range(3):
        store.add("n", 1)
        store.set(f"k{i}", "v")

    isolated = cluster.members[0]  # the endpoint the client uses first
    isolated.disconnect()
    try:
        # The first request goes to the isolated member and gets no answer; the
        # client moves on, and a write whose answer was lost is resolved on the
        # next member: nothing is applied twice, totals stay exact.
        state, token2, has_set = backend.set_state(b"two", token)  # type: ignore[misc]
        assert (state, has_set) == (b"two", True)
        for _ in range(5):
            store.add("n", 1)
        assert store.get("n") == b"8"
        assert store.check([f"k{i}" for i in range(3)])
        assert backend.get_state() == (b"two", token2)
        store.set("last", "written during the partition")
        assert not isolated.health()  # it really is cut off: no leader
    finally:
        isolated.reconnect()

    isolated.wait_ready()
    # A client of the rejoined member alone sees everything written without it.
    lone_backend, lone_store = etcd_rdzv.create_backend(isolated.params("r", **options))
    assert lone_store.get("last") == b"written during the partition"  # waits for catch-up
    assert lone_store.get("n") == b"8"
    assert lone_backend.get_state() == (b"two", token2)


def test_client_of_only_the_partitioned_member_fails_clearly(
    cluster: EtcdContainerCluster, api: str, etcd_key_prefix: str
) -> None:
    member = cluster.members[1]
    options = {"key_prefix": etcd_key_prefix, "read_timeout": READ_TIMEOUT, "api": api}
    backend, store = etcd_rdzv.create_backend(member.params("r", **options))
    store.set("before", "1")

    member.disconnect()
    try:
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match=member.endpoint):
            store.set("during", "x")  # no quorum behind this member: no answer
        took = time.monotonic() - started
        assert took < READ_TIMEOUT + 3, f"took {took:.1f}s: a hang, not a timeout"
        if api == "v3":
            # v3 reads are linearizable, so they need the quorum too. (v2 reads are
            # answered from the member's own copy, which may be stale.)
            started = time.monotonic()
            with pytest.raises(RendezvousConnectionError, match=member.endpoint):
                backend.get_state()
            took = time.monotonic() - started
            assert took < READ_TIMEOUT + 3, f"took {took:.1f}s: a hang, not a timeout"
    finally:
        member.reconnect()

    member.wait_ready()
    store.set("after", "2")  # the same client works again once the member is back
    assert store.get("after") == b"2"
    assert store.get("before") == b"1"


def test_killed_leader_restarts_and_catches_up(
    etcd_container_cluster: EtcdContainerCluster, etcd_key_prefix: str
) -> None:
    cluster = etcd_container_cluster
    leader = cluster.leader()
    others = [m for m in cluster.members if m is not leader]
    params = cluster.params("r", key_prefix=etcd_key_prefix, read_timeout=3)
    params.endpoint = ",".join(m.endpoint for m in [leader, *others])  # the leader first
    backend, store = etcd_rdzv.create_backend(params)
    _, token, _ = backend.set_state(b"one")  # type: ignore[misc]
    assert store.add("n", 1) == 1

    leader.kill()
    assert leader.status() == "exited"

    state, token2, has_set = backend.set_state(b"two", token)  # type: ignore[misc]
    assert (state, has_set) == (b"two", True)
    assert store.add("n", 1) == 2
    store.set("last", "written while it was down")
    assert cluster.leader() in others  # the two left elected one of them

    leader.start()  # same container: same data, same endpoint
    lone_params = leader.params("r", key_prefix=etcd_key_prefix, read_timeout=3)
    lone_backend, lone_store = etcd_rdzv.create_backend(lone_params)
    assert lone_store.get("last") == b"written while it was down"  # waits for catch-up
    assert lone_store.get("n") == b"2"
    assert lone_backend.get_state() == (b"two", token2)


def test_leader_without_one_raises_the_shared_error(
    etcd_container_cluster: EtcdContainerCluster,
) -> None:
    cluster = etcd_container_cluster
    for member in cluster:
        member.pause()
    try:
        assert [m.status() for m in cluster] == ["paused"] * len(cluster)
        # The error, and its message, are those of the local EtcdCluster.
        with pytest.raises(EtcdNoLeaderError, match="reports being leader") as info:
            cluster.leader()
        assert cluster.endpoint in str(info.value)
    finally:
        for member in cluster:
            member.unpause()  # resume() by its Docker name
    assert cluster.leader(timeout=30) in cluster.members  # waits out the election
