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

import pytest

import etcd_rdzv
from etcd_rdzv import EtcdRendezvousHandler, RendezvousParameters, _keys
from etcd_rdzv._kv import KV
from etcd_rdzv.rendezvous import records, roster
from etcd_rdzv.rendezvous.records import Outcome

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
    return etcd_api_params(
        run_id,
        min_nodes=n,
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
        buckets, _ = kv.list_prefix(f"{_keys.round_dir(prefix, 'slim-round', 1)}/ranks")
        assert len(buckets) == 3  # 6 members, 2 per bucket
        whole, _ = kv.get(_keys.result_key(prefix, "slim-round", 1))
        assert whole is not None
        members = records.parse_result(whole).members
        for handler, result in zip(handlers, results, strict=True):
            assert result.members == members
            assert members[result.rank] == handler.node_id
            assert result.addrs == ("127.0.0.1",) * N
    finally:
        for handler in handlers:
            handler.shutdown()


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
        deadline = time.monotonic() + HANG
        while time.monotonic() < deadline:
            counts = [h.num_nodes_waiting() for i, h in enumerate(handlers) if i != 2]
            if all(c == 1 for c in counts):
                break
            time.sleep(0.1)
        assert counts == [1] * (N - 1)
    finally:
        for handler in handlers:
            handler.shutdown()


def test_a_follower_whose_bucket_is_gone_or_corrupt_reads_the_whole_result(
    slim: None, etcd_api_params: Params, kv: KV
) -> None:
    prefix = str(etcd_api_params().config["key_prefix"])
    members = tuple(f"node-{i}" for i in range(N))
    result = records.result_record(members, ("a",) * N, 1, N)
    kv.put(_keys.result_key(prefix, "slim-fallback", 1), result, None)
    count = roster.write_buckets(kv, prefix, "slim-fallback", 1, members)
    slim_outcome = Outcome((), (), 1, N, None, 1, count, N, "a")
    for node in members:
        rank, kept = roster.read_rank(kv, prefix, "slim-fallback", 1, slim_outcome, node)
        assert (rank, kept) == (members.index(node), slim_outcome)
    assert roster.read_rank(kv, prefix, "slim-fallback", 1, slim_outcome, "stranger")[0] is None

    gone = roster.bucket_of("node-4", count)
    kv.delete(_keys.ranks_key(prefix, "slim-fallback", 1, gone))
    rank, kept = roster.read_rank(kv, prefix, "slim-fallback", 1, slim_outcome, "node-4")
    assert rank == 4 and kept.members == members and not kept.buckets
    kv.put(_keys.ranks_key(prefix, "slim-fallback", 1, gone), '{"ranks": {"node-4": 99}}', None)
    rank, kept = roster.read_rank(kv, prefix, "slim-fallback", 1, slim_outcome, "node-4")
    assert rank == 4 and kept.members == members
