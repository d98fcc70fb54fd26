"""etcd's v2 API keeps its last 1,000 events only, and every heartbeat of every node
(a TTL refresh) is one of them: at 4,096 nodes beating every 3 s, under a second of
history. A member watcher's idle watch request then always ends out of it; it goes on
from etcd's index, not from a listing of every member's key (4,096 nodes listing
4,096 keys every idle period drowned etcd), and still sees a member go."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import etcd_rdzv
from etcd_rdzv._kv import KV
from etcd_rdzv.rendezvous import watch
from etcd_rdzv.testing import EtcdServer

HANG = 60.0  # seconds: only a hang takes this long


def test_a_v2_member_watcher_goes_on_past_the_short_history_without_listing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(watch, "IDLE_WATCH", 0.5)
    with EtcdServer("short-history", enable_v2=True) as server:
        params = server.params(
            "hist",
            api="v2",
            min_nodes=2,
            max_nodes=2,
            keep_alive_interval=1,
            join_timeout=20,
            key_prefix="/short",
        )
        a, b = (etcd_rdzv.create_handler(params) for _ in range(2))
        other = etcd_rdzv.create_client(params)
        try:
            with ThreadPoolExecutor(2) as pool:
                joins = [pool.submit(h.next_rendezvous) for h in (a, b)]
                assert sorted(j.result(timeout=HANG).world_size for j in joins) == [2, 2]
            time.sleep(1.5)  # the member watchers started (after a spread) and watch
            cls = type(other)
            listed: list[str] = []
            list_tree = cls.list_tree

            def spy(self: KV, prefix: str) -> object:
                if threading.current_thread().name.startswith("etcd-rdzv-watch:"):
                    listed.append(prefix)
                return list_tree(self, prefix)

            monkeypatch.setattr(cls, "list_tree", spy)
            key = "/short/elsewhere"
            other.put(key, "x", 60)
            for _ in range(1100):  # more than etcd's history holds
                assert other.refresh(key, 60)
            time.sleep(2.0)  # the watchers' idle requests end past the history, go on
            assert listed == [], "a member watcher listed the run after an idle watch"

            b.shutdown()  # b leaves: a's watcher, past the history, still sees it
            deadline = time.monotonic() + HANG
            while a.num_nodes_waiting() != 1:
                assert time.monotonic() < deadline, "a did not see b go"
                time.sleep(0.05)
            assert listed == []
        finally:
            a.shutdown()
            b.shutdown()
            other.close()
