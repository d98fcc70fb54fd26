"""What a completed round costs the members and what its coordinator leaves behind.

* A member's watcher (``num_nodes_waiting``) does not fetch back the round's two
  largest records (the result and its announcement: every member's id and address)
  when nothing else was written between the decision and the announcement; it still
  sees a member that dies afterwards. On v3 it follows the run on one stream: later
  changes, and idle waits, cost no new watch request.
* On v3 a node's first join into a started run is one transaction, with no
  admission read before it; at a job's first start, no node's first join is a
  refused write.
* The coordinator's ``next_rendezvous()`` returns right after its announcement; its
  chores (deleting the coordinator key, advancing the round hint, dropping round
  N-2's keys) still happen, in a thread of their own; a shutdown waits for them, so
  a run deleted right after its nodes shut down stays deleted.

Handlers run as threads of this process, each with its own client, on v2 and v3.
"""

from __future__ import annotations

import base64
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import pytest

import etcd_rdzv
from etcd_rdzv import EtcdRendezvousHandler, RendezvousParameters, _keys
from etcd_rdzv.rendezvous import coordinator, join, watch
from etcd_rdzv.runs.delete import delete_run

from ._waits import until

Params = Callable[..., RendezvousParameters]
HANG = 60.0  # a generous bound that only catches hangs


_until = functools.partial(until, timeout=15.0)


def _record_watched(h: EtcdRendezvousHandler) -> list[str]:
    """The keys of the watch events this handler's member watcher receives (after the
    join, the only caller of ``watcher`` on the handler's own client)."""
    seen: list[str] = []
    kv: Any = h._kv
    make = kv.watcher

    def watcher(*args: Any, **kwargs: Any) -> Any:
        made = make(*args, **kwargs)
        take = made.next

        def recorded(*args: Any, **kwargs: Any) -> Any:
            events = take(*args, **kwargs)
            seen.extend(e.record.key for e in events)
            return events

        made.next = recorded
        return made

    kv.watcher = watcher
    return seen


def test_member_watchers_skip_the_announcement_and_still_see_a_death(
    etcd_api_params: Params, handlers: list[EtcdRendezvousHandler]
) -> None:
    # keep_alive_interval 1: the watchers start within 0.5-1 s of the ranks.
    params = etcd_api_params("skip", min_nodes=3, max_nodes=3, keep_alive_interval=1)
    nodes = [etcd_rdzv.create_handler(params) for _ in range(3)]
    handlers.extend(nodes)
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = [f.result(timeout=HANG) for f in [pool.submit(h.next_rendezvous) for h in nodes]]
    # The watchers start 0.5-1 s after the ranks; the join's own watches are over.
    seen = [_record_watched(h) for h in nodes]
    assert sorted(r.rank for r in results) == [0, 1, 2]
    prefix = str(params.get("key_prefix"))
    rdzv = _keys.rdzv_dir(prefix, params.run_id)
    result_key = _keys.result_key(prefix, params.run_id, 1)
    coord_key = _keys.coord_key(prefix, params.run_id, 1)
    assert result_key.startswith(rdzv) and coord_key.startswith(rdzv)

    # A member dies: the other two count it (their watchers follow the run).
    victim = next(h for h, r in zip(nodes, results, strict=True) if r.rank == 2)
    survivors = [h for h in nodes if h is not victim]
    victim.shutdown()
    for h in survivors:
        _until(f"{h.node_id} sees the member gone", lambda h=h: h.num_nodes_waiting() == 1)

    for h, keys in zip(nodes, seen, strict=True):
        if h is victim:
            continue
        # The watcher caught up from the announcement, not from the decision: the
        # result and the announcement (a put of the coordinator key) never came back.
        assert result_key not in keys, f"{h.node_id} fetched the result back: {keys}"
        assert keys.count(coord_key) <= 1, keys  # its deletion, at most
        assert any(k.endswith(_keys.b64_key(victim.node_id)) for k in keys), keys


def test_the_coordinator_returns_and_its_chores_still_happen(
    etcd_api_params: Params, handlers: list[EtcdRendezvousHandler]
) -> None:
    params = etcd_api_params("chores", min_nodes=2, max_nodes=2, keep_alive_interval=1)
    prefix = str(params.get("key_prefix"))
    nodes = [etcd_rdzv.create_handler(params) for _ in range(2)]
    handlers.extend(nodes)
    kv: Any = nodes[0]._kv
    with ThreadPoolExecutor(max_workers=2) as pool:
        for round_no in (1, 2, 3):
            for f in [pool.submit(h.next_rendezvous) for h in nodes]:
                assert f.result(timeout=HANG).round == round_no
            coord = _keys.coord_key(prefix, params.run_id, round_no)
            hint = _keys.hint_key(prefix, params.run_id)
            _until(
                f"round {round_no}'s coordinator key deleted", lambda c=coord: kv.get(c)[0] is None
            )
            _until(
                f"the hint advanced past round {round_no}",
                lambda h=hint, n=round_no: (
                    (r := kv.get(h)[0]) is not None and r.value == str(n + 1)
                ),
            )
    # Round 3's result writer dropped round 1's keys (round N-2).
    round_1 = _keys.round_dir(prefix, params.run_id, 1)
    _until("round 1's keys dropped", lambda: kv.list_tree(round_1)[0] == [])
    assert kv.list_tree(_keys.round_dir(prefix, params.run_id, 3))[0] != []


def test_a_shutdown_waits_for_the_chores_so_a_deleted_run_stays_deleted(
    etcd_api_params: Params, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The chores are slowed down (as under load): without the wait, the round hint
    # they write lands after the delete, and the run has a key again.
    slow = 1.0
    chores = coordinator.after_round

    def slowed(*args: Any, **kwargs: Any) -> None:
        time.sleep(slow)
        chores(*args, **kwargs)

    monkeypatch.setattr(coordinator, "after_round", slowed)
    params = etcd_api_params("gone", min_nodes=1, max_nodes=1)
    prefix = str(params.get("key_prefix"))
    handler = etcd_rdzv.create_handler(params)
    kv = etcd_rdzv.create_client(params)
    try:
        handler.next_rendezvous()
        started = time.monotonic()
        assert handler.shutdown()
        assert time.monotonic() - started < slow + HANG  # bounded (close_timeout)
        assert not [t for t in threading.enumerate() if t.name.startswith("etcd-rdzv-chores")]
        assert delete_run(kv, prefix, params.run_id).keys > 0
        time.sleep(0.2)
        assert kv.list_tree(f"{prefix}/{params.run_id}")[0] == []
    finally:
        handler.shutdown()
        kv.close()


def test_a_v3_member_watcher_follows_the_run_on_one_stream(
    etcd_params: Params, handlers: list[EtcdRendezvousHandler], monkeypatch: pytest.MonkeyPatch
) -> None:
    # At N=4096 the members that had their ranks first each opened a new watch
    # request for every change in the run (the coordinator key deleted, a key gone)
    # before the last rank, and every idle member one each IDLE_WATCH: a member's
    # watcher keeps one stream for all of them.
    monkeypatch.setattr(watch, "IDLE_WATCH", 0.2)
    params = etcd_params("stream", min_nodes=2, max_nodes=2, keep_alive_interval=1)
    nodes = [etcd_rdzv.create_handler(params) for _ in range(2)]
    handlers.extend(nodes)
    with ThreadPoolExecutor(max_workers=2) as pool:
        for f in [pool.submit(h.next_rendezvous) for h in nodes]:
            assert f.result(timeout=HANG).world_size == 2
    # The member watchers start 0.5-1 s after the ranks: count from before that.
    member = nodes[0]
    seen = _record_watched(member)
    kv: Any = member._kv
    transport = kv._transport
    watches: list[str] = []
    request = transport.request

    def counted(url: str, path: str, *args: Any, **kwargs: Any) -> Any:
        if path == "/v3/watch":
            watches.append(url)
        return request(url, path, *args, **kwargs)

    transport.request = counted
    prefix = str(params.get("key_prefix"))
    later = [f"{_keys.round_dir(prefix, params.run_id, 9)}/nodes/n{i}" for i in range(5)]
    other = etcd_rdzv.create_client(params)
    try:
        _until("the member watcher started", lambda: len(watches) == 1)
        for key in later:  # changes the member watcher sees, one at a time
            other.put(key, "x", 60)
            time.sleep(0.1)
        time.sleep(1.0)  # five idle waits
        assert len(watches) == 1, f"{len(watches)} watch requests for 5 changes and 1 s idle"
        _until("the watcher saw every change", lambda: set(later) <= set(seen))
    finally:
        other.close()


def test_a_v3_first_join_into_a_started_run_is_one_transaction(
    etcd_params: Params, handlers: list[EtcdRendezvousHandler], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A node built for a started run learns its incarnation at the build (the read
    # that also tells a node of an unstarted run so): its first join is one
    # transaction, guarded by it, with no admission read before it.
    # The node that finds a new run starts it from what its build read: no admission
    # read, no read of the round hint for the check of the other API; it reads the
    # run once, after that check, before it creates the incarnation.
    params = etcd_params("first", min_nodes=2, max_nodes=2)
    prefix = str(params.get("key_prefix"))
    first = etcd_rdzv.create_handler(params)
    handlers.append(first)
    admitted: list[str] = []
    admit = join.admit

    def spied(session: Any, deadline: float, unstarted: Any = None) -> None:
        admitted.append(session.node_id)
        admit(session, deadline, unstarted)

    monkeypatch.setattr(join, "admit", spied)
    other = etcd_rdzv.create_client(params)
    sent: dict[str, list[tuple[str, bytes]]] = {first.node_id: []}

    def count(h: EtcdRendezvousHandler) -> None:
        transport = cast(Any, h)._kv._transport
        request = transport.request

        def counted(url: str, path: str, body: bytes, *args: Any, **kwargs: Any) -> Any:
            sent[h.node_id].append((path, body))
            return request(url, path, body, *args, **kwargs)

        transport.request = counted

    def b64(key: str) -> bytes:
        return base64.b64encode(key.encode())

    # The admission read is the one transaction that reads the run's ended marker.
    ended, hint = (
        b64(_keys.ended_key(prefix, params.run_id)),
        b64(_keys.hint_key(prefix, params.run_id)),
    )
    try:
        count(first)
        with ThreadPoolExecutor(max_workers=2) as pool:
            waiting = pool.submit(first.next_rendezvous)  # starts the run: admitted
            incarnation = _keys.incarnation_key(prefix, params.run_id)
            _until("the run started", lambda: other.get(incarnation)[0] is not None)
            second = etcd_rdzv.create_handler(params)
            handlers.append(second)
            sent[second.node_id] = []
            count(second)
            joined = second.next_rendezvous()
            assert waiting.result(timeout=HANG).world_size == joined.world_size == 2
        assert admitted == [first.node_id]  # the run did not exist: admit() started it
        reads = [b for p, b in sent[first.node_id] if p == "/v3/kv/txn" and ended in b]
        assert len(reads) == 1, f"the starting node read the run {len(reads)} times"
        ranges = [b for p, b in sent[first.node_id] if p == "/v3/kv/range" and hint in b]
        assert not ranges, "the round hint read again for the check of the other API"
        txns = [b for p, b in sent[second.node_id] if p == "/v3/kv/txn"]
        assert len(txns) == 1, f"{len(txns)} transactions for a follower's first join"
        # The incarnation learnt is the run's: its later joins are guarded by it.
        assert second._session.incarnation == other.get(incarnation)[0].value
    finally:
        other.close()


def test_a_v3_first_start_sends_no_refused_join(
    etcd_params: Params, handlers: list[EtcdRendezvousHandler]
) -> None:
    """Every node of a new job is built before the run exists (a job's first start):
    each one's join key is written by one transaction. A first join sent before the
    run's incarnation exists would be refused, and a refused write is still a raft
    proposal: at 1,024 nodes, 767 of them. The build's read of the run tells the node
    to start it (or wait for it) first."""
    n = 6
    params = etcd_params("cold", min_nodes=n, max_nodes=n)
    prefix = str(params.get("key_prefix"))
    nodes = [etcd_rdzv.create_handler(params) for _ in range(n)]
    handlers.extend(nodes)
    puts: dict[str, int] = {}

    def count(h: EtcdRendezvousHandler) -> None:
        transport = cast(Any, h)._kv._transport
        request = transport.request
        mine = base64.b64encode(_keys.node_key(prefix, params.run_id, 1, h.node_id).encode())

        def counted(url: str, path: str, body: bytes, *args: Any, **kwargs: Any) -> Any:
            if path == "/v3/kv/txn" and mine in body:
                puts[h.node_id] = puts.get(h.node_id, 0) + 1
            return request(url, path, body, *args, **kwargs)

        transport.request = counted

    for node in nodes:
        count(node)
    with ThreadPoolExecutor(max_workers=n) as pool:
        results = [f.result(timeout=HANG) for f in [pool.submit(h.next_rendezvous) for h in nodes]]
    assert sorted(r.rank for r in results) == list(range(n))
    assert puts == {h.node_id: 1 for h in nodes}, puts
