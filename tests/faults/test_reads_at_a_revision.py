"""Reads at a revision the client saw applied (``KV.get_at``, a round's roster): any
member that has that revision answers them, so they go on through an election and
even without a quorum, where a linearizable read waits for a leader. On v3 a member
behind that revision, or a revision compacted away, is read anew."""

from __future__ import annotations

import time

import pytest

import etcd_rdzv
from etcd_rdzv.errors import RendezvousConnectionError
from etcd_rdzv.testing import EtcdCluster

from ..integration._rawkv import v3_post


def test_a_read_at_a_seen_revision_needs_no_quorum(
    cluster: EtcdCluster, api: str, etcd_key_prefix: str
) -> None:
    leader = cluster.leader(timeout=15)
    follower, other = (m for m in cluster.members if m is not leader)
    params = cluster.params("at", api=api, key_prefix=etcd_key_prefix, read_timeout=2)
    params.endpoint = follower.endpoint  # this client talks to one follower only
    kv = etcd_rdzv.create_client(params)
    key = f"{etcd_key_prefix}/at/roster"
    try:
        written = kv.put(key, "ranks", None)
        # The follower has applied the write once it answers a read of it.
        deadline = time.monotonic() + 10
        while kv.get_at(key, written.revision)[0] is None:
            assert time.monotonic() < deadline
        leader.pause()
        other.pause()  # no quorum, no leader: a linearizable read cannot be answered
        try:
            began = time.monotonic()
            record, _ = kv.get_at(key, written.revision)
            took = time.monotonic() - began
            assert record is not None and record.value == "ranks"
            assert took < 1.0, f"the read waited {took:.2f}s"
            if api == "v3":  # (v2 reads are a member's own anyway)
                with pytest.raises(RendezvousConnectionError), kv.bounded(time.monotonic() + 3):
                    kv.get(key)
        finally:
            leader.resume()
            other.resume()
    finally:
        kv.close()


@pytest.mark.parametrize("api", ["v3"])
def test_a_read_at_a_revision_the_member_lacks_or_lost_reads_anew(
    cluster: EtcdCluster, api: str, etcd_key_prefix: str
) -> None:
    params = cluster.params("at", api=api, key_prefix=etcd_key_prefix, read_timeout=5)
    kv = etcd_rdzv.create_client(params)
    key = f"{etcd_key_prefix}/at/roster"
    try:
        first = kv.put(key, "old", None)
        second = kv.put(key, "new", None)
        record, _ = kv.get_at(key, first.revision)
        assert record is not None and record.value == "old"  # as it was then
        # A revision no member has yet: read as it is now.
        record, _ = kv.get_at(key, second.revision + 1000)
        assert record is not None and record.value == "new"
        # Compacted away: read as it is now.
        v3_post(
            cluster.members[0].client_url,
            "/v3/kv/compaction",
            {"revision": str(second.revision), "physical": True},
        )
        record, _ = kv.get_at(key, first.revision)
        assert record is not None and record.value == "new"
    finally:
        kv.close()
