"""Large rounds on a real etcd: announced slim, each member reading its own rank.

A round of ``roster.SLIM_FROM`` members or more is announced without its member list
(see :mod:`etcd_rdzv.rendezvous.roster`). These tests lower that threshold and the
bucket size (``slim`` fixture) so that a handful of handlers, threads of this process,
take the large rounds' path, on the v2 and the v3 API.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import EtcdRendezvousHandler, RendezvousParameters, _keys
from etcd_rdzv._kv import KV, Record
from etcd_rdzv.rendezvous import records, roster
from etcd_rdzv.rendezvous.records import Outcome
from etcd_rdzv.runs.status import read_run

Params = Callable[..., RendezvousParameters]
HANG = 60.0  # seconds: a generous bound that only catches hangs
N = 6


@pytest.fixture
def slim(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds of 3 members or more go slim, 2 members per bucket."""
    monkeypatch.setattr(roster, "SLIM_FROM", 3)
    monkeypatch.setattr(roster, "BUCKET", 2)


@pytest.fixture
def kv(etcd_api_params: Params) -> Iterator[KV]:
    client = etcd_rdzv.create_client(etcd_api_params("slim-kv"))
    yield client
    client.close()


def _params(
    etcd_api_params: Params, run_id: str, n: int = N, **config: object
) -> RendezvousParameters:
    config.setdefault("min_nodes", n)
    return etcd_api_params(
        run_id,
        max_nodes=n,
        keep_alive_interval=1,
        keep_alive_max_attempt=3,
        join_timeout=60,
        local_addr="127.0.0.1",
        **config,
    )


def _join_all(handlers: list[EtcdRendezvousHandler]) -> list[etcd_rdzv.RendezvousResult]:
    results: list[etcd_rdzv.RendezvousResult | BaseException] = [RuntimeError("hung")] * len(
        handlers
    )

    def join(i: int) -> None:
        try:
            results[i] = handlers[i].next_rendezvous()
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(handlers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG)
    done = [r for r in results if isinstance(r, etcd_rdzv.RendezvousResult)]
    assert len(done) == len(handlers), results
    return done


def test_a_large_round_is_announced_slim_and_every_member_finds_its_rank(
    slim: None, etcd_api_params: Params, kv: KV
) -> None:
    params = _params(etcd_api_params, "slim-round")
    handlers = [etcd_rdzv.create_handler(params) for _ in range(N)]
    try:
        results = _join_all(handlers)
        assert sorted(r.rank for r in results) == list(range(N))
        assert {r.world_size for r in results} == {N}
        # Followers got only their rank: their member lists are read when first asked.
        unread = [r for r in results if r.roster._members is None]
        assert len(unread) >= N - 1, "the round was announced whole"
        prefix = str(params.config["key_prefix"])
        result, _ = kv.get(_keys.result_key(prefix, "slim-round", 1))
        assert result is not None
        slim = records.parse_result(result)
        assert slim.buckets == 3 and slim.world == N and not slim.members  # 2 per bucket
        lists, _ = kv.list_prefix(_keys.roster_dir(prefix, "slim-round", 1, slim.by))
        assert len(lists) == 1 + 3  # the member list and the buckets
        members = roster.read_whole(kv, prefix, "slim-round", 1, slim).members
        # What operators see: the members, read from the list.
        status = read_run(kv, prefix, "slim-round")
        assert tuple(m.node for m in status.members) == members and not status.problems
        for handler, result in zip(handlers, results, strict=True):
            assert result.members == members
            assert members[result.rank] == handler.node_id
            assert result.addrs == ("127.0.0.1",) * N
    finally:
        for handler in handlers:
            handler.shutdown()


def test_members_read_the_roster_at_the_announcements_revision(
    slim: None, etcd_api_params: Params, kv: KV, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The announcement comes after the roster's writes: a read at its revision is
    # answered by any member that has it (v3: without the leader), so thousands of
    # members reading their ranks go on through an election.
    cls = type(kv)
    at_reads: list[tuple[str, int]] = []
    now_reads: list[str] = []
    get_at, get = cls.get_at, cls.get

    inside = threading.local()  # v2's get_at is its get

    def spy_at(self: KV, key: str, revision: int) -> tuple[Record | None, int]:
        at_reads.append((key, revision))
        inside.at = True
        try:
            return get_at(self, key, revision)
        finally:
            inside.at = False

    def spy(self: KV, key: str) -> tuple[Record | None, int]:
        if not getattr(inside, "at", False):
            now_reads.append(key)
        return get(self, key)

    monkeypatch.setattr(cls, "get_at", spy_at)
    monkeypatch.setattr(cls, "get", spy)
    params = _params(etcd_api_params, "slim-at")
    handlers = [etcd_rdzv.create_handler(params) for _ in range(N)]
    try:
        results = _join_all(handlers)
        for result in results:
            assert len(result.members) == N  # the member lists too (read when asked)
    finally:
        for handler in handlers:
            handler.shutdown()
    prefix = str(params.config["key_prefix"])
    result, _ = get(kv, _keys.result_key(prefix, "slim-at", 1))
    assert result is not None
    roster_dir = _keys.roster_dir(prefix, "slim-at", 1, records.parse_result(result).by)
    assert [k for k in now_reads if k.startswith(roster_dir)] == []
    read = [(k, r) for k, r in at_reads if k.startswith(roster_dir)]
    assert len(read) >= 2 * (N - 1), at_reads  # a bucket and the list per follower
    written = max(r.revision for r in kv.list_prefix(roster_dir)[0])
    assert all(r >= written for _, r in read), (written, read)


def _each_other_counts_one_gone(handlers: list[EtcdRendezvousHandler], left: int) -> None:
    """Wait until every member but ``handlers[left]`` (which has left) counts one node
    waiting, and assert it."""
    deadline = time.monotonic() + HANG
    while time.monotonic() < deadline:
        counts = [h.num_nodes_waiting() for i, h in enumerate(handlers) if i != left]
        if all(c == 1 for c in counts):
            break
        time.sleep(0.1)
    assert counts == [1] * (N - 1)


def test_members_of_a_slim_round_see_a_member_go_and_not_a_stranger(
    slim: None, etcd_api_params: Params, kv: KV
) -> None:
    params = _params(etcd_api_params, "slim-watch")
    handlers = [etcd_rdzv.create_handler(params) for _ in range(N)]
    try:
        _join_all(handlers)
        prefix = str(params.config["key_prefix"])
        # A key in the round's directory that no member holds (written by something
        # else after the round completed) comes and goes: no member counts it.
        stranger = _keys.node_key(prefix, "slim-watch", 1, "not-a-member")
        kv.put(stranger, records.node_record("not-a-member", "x", None), None)
        kv.delete(stranger)
        time.sleep(3.0)  # the member watchers start within 1-2 s and catch up
        assert [h.num_nodes_waiting() for h in handlers] == [0] * N
        # A member leaves: every other member counts it, from its bucket.
        handlers[2].shutdown()
        _each_other_counts_one_gone(handlers, 2)
    finally:
        for handler in handlers:
            handler.shutdown()


def test_a_members_key_written_again_costs_the_others_no_roster_read(
    slim: None, etcd_api_params: Params, kv: KV, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member's heart writes its key again when its lease ran out (an overloaded
    etcd): every other member's watcher sees the put. A put never makes a member gone,
    so no watcher reads the key's roster bucket to tell whose it is (at N=4096 under
    overload, those reads came to 3-5 per node). A member that leaves is still
    counted, from its bucket."""
    params = _params(etcd_api_params, "slim-put")
    handlers = [etcd_rdzv.create_handler(params) for _ in range(N)]
    reads: list[int] = []
    read_bucket = roster._read_bucket

    def counted(*args: Any, **kwargs: Any) -> Any:
        reads.append(args[4])
        return read_bucket(*args, **kwargs)

    monkeypatch.setattr(roster, "_read_bucket", counted)
    try:
        _join_all(handlers)
        prefix = str(params.config["key_prefix"])
        time.sleep(3.0)  # the member watchers start within 1-2 s and catch up
        before = len(reads)
        for handler in handlers[:3]:  # keys in more than one bucket
            key = _keys.node_key(prefix, "slim-put", 1, handler.node_id)
            record, _ = kv.get(key)
            assert record is not None
            kv.put(key, record.value, None)
        time.sleep(2.0)
        assert reads[before:] == [], "members read buckets for keys written again"
        assert [h.num_nodes_waiting() for h in handlers] == [0] * N
        handlers[4].shutdown()  # a member leaves: the others read its bucket
        _each_other_counts_one_gone(handlers, 4)
    finally:
        for handler in handlers:
            handler.shutdown()


def test_a_follower_whose_bucket_is_gone_or_corrupt_reads_the_whole_result(
    slim: None, etcd_api_params: Params, kv: KV
) -> None:
    prefix = str(etcd_api_params().config["key_prefix"])
    members = tuple(f"node-{i}" for i in range(N))
    whole = Outcome(members, ("a",) * N, 1, N)
    count = roster.write_roster(kv, prefix, "slim-fallback", 1, whole, "coord")
    slim_outcome = Outcome((), (), 1, N, None, 1, count, N, "a", "coord")
    directory = _keys.roster_dir(prefix, "slim-fallback", 1, "coord")
    for node in members:
        rank, kept = roster.read_rank(kv, prefix, "slim-fallback", 1, slim_outcome, node)
        assert (rank, kept) == (members.index(node), slim_outcome)
    assert roster.read_rank(kv, prefix, "slim-fallback", 1, slim_outcome, "stranger")[0] is None

    gone = roster.bucket_of("node-4", count)
    kv.delete(f"{directory}/{gone}")
    rank, kept = roster.read_rank(kv, prefix, "slim-fallback", 1, slim_outcome, "node-4")
    assert rank == 4 and kept.members == members and not kept.buckets
    kv.put(f"{directory}/{gone}", '{"ranks": {"node-4": 99}}', None)
    rank, kept = roster.read_rank(kv, prefix, "slim-fallback", 1, slim_outcome, "node-4")
    assert rank == 4 and kept.members == members
    # Without the list either: an error that names the key, not a bare exception.
    kv.delete(f"{directory}/members")
    with pytest.raises(etcd_rdzv.RendezvousStateError, match=f"{directory}/members"):
        roster.read_rank(kv, prefix, "slim-fallback", 1, slim_outcome, "node-4")


def test_a_slim_round_reforms_without_a_member_at_once(slim: None, etcd_api_params: Params) -> None:
    # The next round's coordinator reads the slim round's member list: once every
    # live member re-joined, it completes without waiting for the last call (30 s).
    params = _params(etcd_api_params, "slim-reform", min_nodes=3, last_call_timeout=30)
    handlers = [etcd_rdzv.create_handler(params) for _ in range(N)]
    try:
        first = _join_all(handlers)
        assert {r.world_size for r in first} == {N}
        handlers[0].shutdown()
        began = time.monotonic()
        second = _join_all(handlers[1:])
        took = time.monotonic() - began
        assert sorted(r.rank for r in second) == list(range(N - 1))
        assert {(r.round, r.world_size) for r in second} == {(2, N - 1)}
        assert took < 20.0, f"the re-formed round waited for its last call ({took:.1f}s)"
    finally:
        for handler in handlers:
            handler.shutdown()
