"""Liveness keys (``KV.put_owned``, ``KV.claim``) expire one by one, on every API.

The handler lets a key it no longer needs expire while it keeps its other keys alive
(a coordinator key it gave up, a previous round's key whose delete failed during an
etcd outage). On v2 every key has its own TTL; on v3 every liveness key must have a
lease of its own, or refreshing the node's current join key would keep the dropped
key alive for as long as the node lives, and the next round would wait for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousParameters

pytestmark = pytest.mark.etcd_variants("v2", "v3", "v3-3.4")

TTL = 2  # seconds: etcd's minimum lease TTL with its default election timeout


def test_a_dropped_liveness_key_expires_while_another_is_refreshed(
    etcd_api_params: Callable[..., RendezvousParameters], etcd_key_prefix: str
) -> None:
    kv = etcd_rdzv.create_client(etcd_api_params(read_timeout=5))
    kept, dropped, coord = (f"{etcd_key_prefix}/{name}" for name in ("kept", "dropped", "coord"))
    try:
        kv.put_owned(dropped, "old round", TTL)
        claimed, _ = kv.claim(coord, "me", TTL)
        assert claimed is not None
        kv.put_owned(kept, "this round", TTL)
        _, revision = kv.get(dropped)
        # Refresh only ``kept``, as the heartbeat does, until both others expired.
        gone: set[str] = set()
        deadline = time.monotonic() + 4 * TTL + 5
        while gone != {dropped, coord} and time.monotonic() < deadline:
            assert kv.refresh(kept, TTL), "the refreshed key expired"
            event = kv.watch(etcd_key_prefix, revision + 1, timeout=0.5, prefix=True)
            if event is not None:
                revision = event.record.revision
                if event.kind == "delete":
                    gone.add(event.record.key)
        assert gone == {dropped, coord}, f"still there after {4 * TTL + 5} s: {gone}"
        record, _ = kv.get(kept)
        assert record is not None and record.value == "this round"
    finally:
        kv.close()
