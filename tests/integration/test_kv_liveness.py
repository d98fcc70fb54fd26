"""A node's liveness keys share its lease (``KV.grant``, ``KV.put_owned``,
``KV.create`` on a lease, ``KV.keep_alive``), on every API.

The heart renews the node's lease once per beat, whatever the number of keys on it
(v3: one keep-alive; v2 refreshes each key's TTL); every key on it lives while it is
renewed, and all of them go when the renewals stop. A key taken off the lease (the
node deleted it) is no longer renewed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousParameters

pytestmark = pytest.mark.etcd_variants("v2", "v3", "v3-3.4")

TTL = 2  # seconds: etcd's minimum lease TTL with its default election timeout


def test_keys_on_a_lease_live_while_it_is_renewed_and_go_together(
    etcd_api_params: Callable[..., RendezvousParameters], etcd_key_prefix: str
) -> None:
    kv = etcd_rdzv.create_client(etcd_api_params(read_timeout=5))
    join, coord, deleted = (f"{etcd_key_prefix}/{name}" for name in ("join", "coord", "deleted"))
    try:
        lease = kv.grant(TTL)
        kv.put_owned(join, "this round", lease)
        claimed = kv.create(coord, "me", None, lease=lease)
        assert claimed is not None
        kv.put_owned(deleted, "old round", lease)
        assert set(lease.keys()) == {join, coord, deleted}
        kv.delete(deleted)
        lease.forget(deleted)  # as the session does when it deletes a key
        _, revision = kv.get(join)
        # Renewed for three TTLs: both keys are still there.
        until = time.monotonic() + 3 * TTL
        while time.monotonic() < until:
            assert kv.keep_alive(lease) == []
            time.sleep(TTL / 4)
        assert {r.key for r in kv.list_prefix(etcd_key_prefix)[0]} == {join, coord}
        # No renewal any more: both go.
        gone: set[str] = set()
        deadline = time.monotonic() + 4 * TTL + 5
        while gone != {join, coord} and time.monotonic() < deadline:
            # (v3 deletes the keys of an expired lease in one revision.)
            for event in kv.watch_events(etcd_key_prefix, revision + 1, 0.5, prefix=True):
                revision = event.record.revision
                if event.kind == "delete":
                    gone.add(event.record.key)
        assert gone == {join, coord}, f"not all gone after {4 * TTL + 5} s: {gone}"
        assert sorted(kv.keep_alive(lease)) == sorted([coord, join])
        assert lease.keys() == {}
    finally:
        kv.close()
