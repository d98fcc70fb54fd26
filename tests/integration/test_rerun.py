"""A job started again under the run id of a finished job (a re-created Kubernetes job,
a requeued Slurm job) starts without ``etcd-rdzv delete``, and never mixes with the
finished job's nodes (see :mod:`etcd_rdzv.rendezvous.incarnation`).

* a finished job (its run closed, its nodes gone) and a new job of two under the same
  run id: the new job forms round 1, the finished job's rounds and stores are gone;
* a handler of the finished job that joins again after the new job started gets
  RendezvousClosedError, writes nothing, and the new job sees no one waiting; on v2
  also when the new job starts between its guard's read and its write;
* three new nodes racing to start the run again end in one round of three;
* a closed run with a node of its job alive is not started again under it: a new node
  waits one node TTL and gets RendezvousClosedError naming it; the live node's round
  and keys are untouched; once it left, a new node starts the run;
* a node killed without leaving (its key alive until its TTL ends): a new node waits
  for the key to expire and starts the run;
* ``restart_closed_run=false``: a closed run refuses a new node at once;
* a node that closed the run itself never starts it again (torch's contract);
* two resets from the same reading of the run: exactly one is done (``incarnation.reset_run``);
* an incarnation key that holds something else is an error naming the key.

Handlers run as threads of this process, each with its own client, on v2 and v3.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import (
    EtcdRendezvousHandler,
    RendezvousClosedError,
    RendezvousParameters,
    RendezvousStateError,
    _keys,
)
from etcd_rdzv._kv import KV
from etcd_rdzv.rendezvous import incarnation, records
from etcd_rdzv.rendezvous.handler import RendezvousResult
from etcd_rdzv.rendezvous.incarnation import Reset, reset_run
from etcd_rdzv.testing import wait_until

Params = Callable[..., RendezvousParameters]
ALSO_ON_34 = pytest.mark.etcd_variants("v2", "v3", "v3-3.4")
HANG = 60.0  # a generous bound that only catches hangs
# Node TTL 2 s: a node killed without leaving is gone 2 s after its last beat.
# join_timeout 20 s: a join that should be refused and is not fails the test, soon.
FAST = {"keep_alive_interval": 1, "keep_alive_max_attempt": 2, "join_timeout": 20}


def _join_all(
    pool: ThreadPoolExecutor, nodes: list[EtcdRendezvousHandler]
) -> list[RendezvousResult]:
    futures = [pool.submit(h.next_rendezvous) for h in nodes]
    return [f.result(timeout=HANG) for f in futures]


def _kv(params: RendezvousParameters) -> KV:
    return etcd_rdzv.create_client(params)


def _names(kv: KV, directory: str) -> list[str]:
    """The keys under ``directory`` (v2: but a round's seal, which expires by itself)."""
    found, _ = kv.list_tree(directory)
    return sorted(r.key[len(directory) :] for r in found if not r.key.endswith("-seal"))


def _finished_job(
    params: RendezvousParameters,
    pool: ThreadPoolExecutor,
    handlers: list[EtcdRendezvousHandler],
    n: int = 2,
) -> list[EtcdRendezvousHandler]:
    """A job of ``n`` nodes that formed a round, wrote into its store and ended as
    torchrun's agents end: the run closed, every node gone."""
    old = [etcd_rdzv.create_handler(params) for _ in range(n)]
    handlers.extend(old)
    results = _join_all(pool, old)
    assert sorted(r.rank for r in results) == list(range(n))
    results[0].store.set("from-the-old-job", b"1")
    old[0].set_closed()
    _ended_window_passes(params)
    for h in old:
        assert h.shutdown()
    _ended_window_passes(params)
    return old


def _ended_window_passes(params: RendezvousParameters) -> None:
    """What the 15 s after a close bring (``records.ENDED_TTL``, in which a closed run
    stays closed for every node): the marker of a recent close gone. Tested for real in
    ``test_a_run_closed_moments_ago_stays_closed_for_new_processes``."""
    kv = _kv(params)
    try:
        kv.delete(_keys.ended_key(_prefix(params), params.run_id))
    finally:
        kv.close()


def _prefix(params: RendezvousParameters) -> str:
    return str(params.get("key_prefix"))


@ALSO_ON_34  # the reset compares a key range
def test_a_finished_job_s_run_id_starts_again_without_delete(
    etcd_api_params: Params, pool: ThreadPoolExecutor, handlers: list[EtcdRendezvousHandler]
) -> None:
    params = etcd_api_params("again", min_nodes=2, max_nodes=2, **FAST)
    prefix, run = _prefix(params), params.run_id
    kv = _kv(params)
    old = _finished_job(params, pool, handlers)
    closed = _keys.closed_key(prefix, run)
    assert kv.get(closed)[0] is not None, "the finished job did not close its run"
    first, _ = kv.get(_keys.incarnation_key(prefix, run))
    assert first is not None, "the first job wrote no incarnation"

    new = [etcd_rdzv.create_handler(params) for _ in range(2)]
    handlers.extend(new)
    results = _join_all(pool, new)
    assert sorted(r.rank for r in results) == [0, 1]
    assert {r.round for r in results} == {1}, "the new job did not start at round 1"
    assert {r.world_size for r in results} == {2}
    assert set(results[0].members) == {h.node_id for h in new}
    assert not set(results[0].members) & {h.node_id for h in old}
    assert kv.get(closed)[0] is None, "the run is still closed"
    second, _ = kv.get(_keys.incarnation_key(prefix, run))
    assert second is not None and second.value != first.value, "no new incarnation"
    # The finished job's round store went with its rounds: round 1 is the new job's.
    assert not results[0].store.check(["from-the-old-job"]), "the old round store is left"
    assert not new[0].is_closed()


def test_a_node_of_the_finished_job_is_refused_by_the_new_one(
    etcd_api_params: Params, pool: ThreadPoolExecutor, handlers: list[EtcdRendezvousHandler]
) -> None:
    params = etcd_api_params("old-node", min_nodes=2, max_nodes=3, last_call_timeout=1, **FAST)
    prefix, run = _prefix(params), params.run_id
    kv = _kv(params)
    old = _finished_job(params, pool, handlers)
    new = [etcd_rdzv.create_handler(params) for _ in range(2)]
    handlers.extend(new)
    results = _join_all(pool, new)
    assert {r.round for r in results} == {1}

    # An agent of the finished job comes back (it restarts its workers): refused,
    # although the new job's round has room for it.
    started = time.monotonic()
    with pytest.raises(RendezvousClosedError, match="started again by a new job"):
        old[1].next_rendezvous()
    assert time.monotonic() - started < 10
    rdzv = _keys.rdzv_dir(prefix, run)
    keys = _names(kv, rdzv)
    assert not [k for k in keys if _keys.b64_key(old[1].node_id) in k], keys
    time.sleep(1.5)  # a waiting node would show in the members' counts by now
    assert [h.num_nodes_waiting() for h in new] == [0, 0]
    # It stays refused: its next try too.
    with pytest.raises(RendezvousClosedError):
        old[1].next_rendezvous()


@pytest.mark.etcd_variants("v2")  # v3 writes a join key in one transaction with its guard
def test_v2_a_node_of_the_finished_job_writing_as_the_run_starts_again_is_refused(
    etcd_api_params: Params, pool: ThreadPoolExecutor, handlers: list[EtcdRendezvousHandler]
) -> None:
    """On v2 the join's guard is read before the join key is written: a new job that
    starts the run in between does not get the old node, which reads again after its
    write."""
    params = etcd_api_params("between", min_nodes=2, max_nodes=2, **FAST)
    prefix, run = _prefix(params), params.run_id
    old = _finished_job(params, pool, handlers)
    starter = etcd_rdzv.create_handler(
        etcd_api_params(run, min_nodes=1, max_nodes=2, last_call_timeout=0, **FAST)
    )
    handlers.append(starter)
    key, hint = _keys.incarnation_key(prefix, run), _keys.hint_key(prefix, run)
    late = old[1]
    kv: Any = late._kv
    read, listing = kv.get, kv.list_prefix
    started: list[RendezvousResult] = []

    def start() -> None:
        started.append(starter.next_rendezvous())
        # The new job's round hint names round 2, the round the old node tries
        # (so its guard passes and it writes): the chores write it after round 1.
        wait_until(lambda: getattr(read(hint)[0], "value", None) == "2")

    def get(name: str) -> Any:  # the old node's guard read, then the new job starts
        found = read(name)
        if name == key and not started:
            start()
        return found

    def list_prefix(directory: str) -> Any:  # the guard read as one listing (v2)
        found = listing(directory)
        if directory == key.rsplit("/", 1)[0] and not started:
            start()
        return found

    kv.get, kv.list_prefix = get, list_prefix
    with pytest.raises(RendezvousClosedError, match="started again by a new job"):
        late.next_rendezvous()
    assert started and started[0].round == 1
    keys = _names(_kv(params), _keys.rdzv_dir(prefix, run))
    assert not [k for k in keys if _keys.b64_key(late.node_id) in k], keys
    time.sleep(1.5)  # a waiting node would show in the member's count by now
    assert starter.num_nodes_waiting() == 0


def test_new_nodes_racing_to_start_the_run_again_form_one_round(
    etcd_api_params: Params, pool: ThreadPoolExecutor, handlers: list[EtcdRendezvousHandler]
) -> None:
    params = etcd_api_params("race", min_nodes=3, max_nodes=3, **FAST)
    prefix, run = _prefix(params), params.run_id
    _finished_job(params, pool, handlers, 3)
    for attempt in range(2):  # the second time, the run the first new job closed
        new = [etcd_rdzv.create_handler(params) for _ in range(3)]
        handlers.extend(new)
        results = _join_all(pool, new)
        assert sorted(r.rank for r in results) == [0, 1, 2], attempt
        assert {r.round for r in results} == {1}, attempt
        assert {tuple(r.members) for r in results} == {tuple(results[0].members)}
        new[0].set_closed()
        _ended_window_passes(params)
        for h in new:
            h.shutdown()
    kv = _kv(params)
    assert kv.get(_keys.closed_key(prefix, run))[0] is not None


def test_a_closed_run_is_not_started_again_under_a_live_node(
    etcd_api_params: Params, pool: ThreadPoolExecutor, handlers: list[EtcdRendezvousHandler]
) -> None:
    params = etcd_api_params("alive", min_nodes=2, max_nodes=2, **FAST)
    prefix, run = _prefix(params), params.run_id
    kv = _kv(params)
    a, b = etcd_rdzv.create_handler(params), etcd_rdzv.create_handler(params)
    handlers.extend([a, b])
    _join_all(pool, [a, b])
    a.set_closed()
    _ended_window_passes(params)
    assert a.shutdown()  # a finished; b still trains
    rdzv = _keys.rdzv_dir(prefix, run)
    before = _names(kv, rdzv)

    late = etcd_rdzv.create_handler(
        etcd_api_params(run, min_nodes=1, max_nodes=2, last_call_timeout=0, **FAST)
    )
    handlers.append(late)
    started = time.monotonic()
    with pytest.raises(RendezvousClosedError, match="still alive") as refused:
        late.next_rendezvous()
    waited = time.monotonic() - started
    assert b.node_id in str(refused.value)
    assert 1.5 <= waited <= 8, f"refused after {waited:.1f}s (node TTL 2 s)"
    after = _names(kv, rdzv)
    assert after == before, f"the run changed under its live node: {before} -> {after}"
    assert b.is_closed()

    # b's job ends: a new node starts the run.
    assert b.shutdown()
    again = etcd_rdzv.create_handler(
        etcd_api_params(run, min_nodes=1, max_nodes=2, last_call_timeout=0, **FAST)
    )
    handlers.append(again)
    got = again.next_rendezvous()
    assert (got.round, got.rank, got.world_size) == (1, 0, 1)


def test_a_node_killed_without_leaving_delays_the_new_job_by_its_ttl(
    etcd_api_params: Params, pool: ThreadPoolExecutor, handlers: list[EtcdRendezvousHandler]
) -> None:
    params = etcd_api_params("killed", min_nodes=2, max_nodes=2, **FAST)
    run = params.run_id
    a, b = etcd_rdzv.create_handler(params), etcd_rdzv.create_handler(params)
    handlers.extend([a, b])
    _join_all(pool, [a, b])
    a.set_closed()
    _ended_window_passes(params)
    assert a.shutdown()
    b._session.stop_threads()  # as if killed: its key lives until its TTL runs out

    new = etcd_rdzv.create_handler(
        etcd_api_params(run, min_nodes=1, max_nodes=2, last_call_timeout=0, **FAST)
    )
    handlers.append(new)
    started = time.monotonic()
    got = new.next_rendezvous()
    waited = time.monotonic() - started
    assert (got.round, got.rank, got.world_size) == (1, 0, 1)
    assert waited <= 2 + 3, f"started after {waited:.1f}s (node TTL 2 s)"


def test_restart_closed_run_false_keeps_a_closed_run_closed(
    etcd_api_params: Params, pool: ThreadPoolExecutor, handlers: list[EtcdRendezvousHandler]
) -> None:
    params = etcd_api_params("strict", min_nodes=2, max_nodes=2, restart_closed_run="false")
    _finished_job(params, pool, handlers)
    new = etcd_rdzv.create_handler(params)
    handlers.append(new)
    started = time.monotonic()
    with pytest.raises(RendezvousClosedError, match="delete"):
        new.next_rendezvous()
    assert time.monotonic() - started < 10
    assert new.is_closed()


def test_a_node_that_closed_the_run_does_not_start_it_again(
    etcd_api_params: Params, handlers: list[EtcdRendezvousHandler]
) -> None:
    """torch's contract: ``set_closed()``, then ``next_rendezvous()`` raises
    RendezvousClosedError, though the node never joined and nobody is alive."""
    params = etcd_api_params("closer", min_nodes=1, max_nodes=1, **FAST)
    h = etcd_rdzv.create_handler(params)
    handlers.append(h)
    h.set_closed()
    with pytest.raises(RendezvousClosedError, match="is closed"):
        h.next_rendezvous()
    assert h.is_closed()


@ALSO_ON_34  # the reset compares a key range
def test_of_two_resets_from_one_reading_one_is_done(etcd_api_params: Params) -> None:
    params = etcd_api_params("resets", min_nodes=1, max_nodes=1)
    prefix, run = _prefix(params), params.run_id
    kv = _kv(params)
    closed = _keys.closed_key(prefix, run)
    kv.put(_keys.node_key(prefix, run, 1, "gone") + "x", "old", 60)  # not a join key
    kv.put(_keys.result_key(prefix, run, 1), "old", 60)
    kv.put(closed, "1", 60)
    found, at = kv.list_tree(_keys.rdzv_dir(prefix, run))
    guard = next(r for r in found if r.key == closed)
    rounds = _keys.rdzv_dir(prefix, run) + "/r"
    incarnation = _keys.incarnation_key(prefix, run)

    def reset(value: str) -> bool:
        drop = (_keys.round_dir(prefix, run, 1),)
        return reset_run(
            kv, Reset(guard, rounds, at, drop, incarnation, value, 60), "hold", 30, lambda: True
        )

    assert reset("a" * 32)
    assert not reset("b" * 32)
    assert kv.get(incarnation)[0].value == "a" * 32  # type: ignore[union-attr]
    assert kv.get(closed)[0] is None
    assert _names(kv, _keys.round_dir(prefix, run, 1)) == []

    # A key of the rounds written after the reading refuses a reset made from it.
    kv.put(closed, "1", 60)
    found, at = kv.list_tree(_keys.rdzv_dir(prefix, run))
    guard = next(r for r in found if r.key == closed)
    kv.put(_keys.node_key(prefix, run, 2, "late"), "{}", 60)
    still = lambda: not kv.list_tree(rounds + "2")[0]  # noqa: E731 - v2's re-check
    assert not reset_run(
        kv, Reset(guard, rounds, at, (), incarnation, "c" * 32, 60), "hold", 30, still
    )
    assert kv.get(closed)[0] is not None, "a refused reset opened the run"
    assert kv.get(incarnation)[0].value == "a" * 32  # type: ignore[union-attr]


def test_an_incarnation_that_is_not_one_is_an_error_naming_its_key(
    etcd_api_params: Params, handlers: list[EtcdRendezvousHandler]
) -> None:
    params = etcd_api_params("foreign", min_nodes=1, max_nodes=1)
    key = _keys.incarnation_key(_prefix(params), params.run_id)
    _kv(params).put(key, "not an incarnation", 60)
    h = etcd_rdzv.create_handler(params)
    handlers.append(h)
    with pytest.raises(RendezvousStateError, match=key):
        h.next_rendezvous()


def test_a_run_closed_moments_ago_stays_closed_for_new_processes(
    etcd_api_params: Params, pool: ThreadPoolExecutor, handlers: list[EtcdRendezvousHandler]
) -> None:
    """A node of the job that ended, started before the close but slow to reach etcd
    (a spare), meets the closed run: for ``records.ENDED_TTL`` seconds after a close
    (etcd's lease, not a clock) no new process starts the run again; then one does."""
    params = etcd_api_params("recent", min_nodes=1, max_nodes=1, **FAST)
    old = etcd_rdzv.create_handler(params)
    handlers.append(old)
    assert old.next_rendezvous().round == 1
    old.set_closed()
    assert old.shutdown()
    closed_at = time.monotonic()
    slow = etcd_rdzv.create_handler(params)
    handlers.append(slow)
    with pytest.raises(RendezvousClosedError, match=f"{records.ENDED_TTL}s have passed"):
        slow.next_rendezvous()
    assert time.monotonic() - closed_at < records.ENDED_TTL  # well inside the window
    kv = _kv(params)
    try:
        ended = _keys.ended_key(_prefix(params), params.run_id)
        wait_until(lambda: kv.get(ended)[0] is None, 3 * records.ENDED_TTL, what="the window")
    finally:
        kv.close()
    assert time.monotonic() - closed_at >= records.ENDED_TTL - 1
    new = etcd_rdzv.create_handler(params)
    handlers.append(new)
    got = new.next_rendezvous()
    assert (got.round, got.rank, got.world_size) == (1, 0, 1)


def test_a_node_that_checked_the_api_while_another_made_the_incarnation_learns_it(
    etcd_api_params: Params,
    handlers: list[EtcdRendezvousHandler],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before it makes a new run's incarnation a node checks the other keyspace (two
    requests). Another node's create may land meanwhile: at a first start under load,
    for the nodes whose waits ended before the first create landed. The node then
    reads the incarnation and learns it: no lease grant, no refused create."""
    params = etcd_api_params("checked", min_nodes=1, max_nodes=1, **FAST)
    key = _keys.incarnation_key(_prefix(params), params.run_id)
    node = etcd_rdzv.create_handler(params)
    handlers.append(node)
    theirs = "ab" * 16
    other = _kv(params)
    checks: Any = node._session.checks
    check = checks.other_api

    def meanwhile(established: bool) -> Any:
        if other.get(key)[0] is None:  # (the round's coordinator checks again)
            assert other.create(key, theirs, records.META_TTL) is not None  # theirs lands
        return check(established)

    monkeypatch.setattr(checks, "other_api", meanwhile)
    kv: Any = node._kv
    tries: list[str] = []
    create = kv.create

    def counted(name: str, *args: Any, **kwargs: Any) -> Any:
        tries.append(name)
        return create(name, *args, **kwargs)

    kv.create = counted
    try:
        got = node.next_rendezvous()
    finally:
        other.close()
    assert (got.round, got.rank, got.world_size) == (1, 0, 1)
    assert node._session.incarnation == theirs
    assert key not in tries, tries


def test_a_first_start_makes_the_incarnation_once_not_once_per_node(
    etcd_api_params: Params,
    handlers: list[EtcdRendezvousHandler],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """All the nodes of a new job find no incarnation at once: one makes it, the
    others learn it from a watch, instead of each sending a refused create (a write, a
    lease grant and a read again each: thousands at once at N=4096). (Without the
    spread, 4 of these 16 nodes tried, here.)"""
    n = 16
    monkeypatch.setattr(incarnation, "_SPREAD_PER_NODE", 0.2)  # a window of 3.2 s
    params = etcd_api_params("first", min_nodes=n, max_nodes=n, **FAST)
    key = _keys.incarnation_key(_prefix(params), params.run_id)
    nodes = [etcd_rdzv.create_handler(params) for _ in range(n)]
    handlers.extend(nodes)
    tries: list[str] = []
    for node in nodes:
        kv: Any = node._kv
        create = kv.create

        def counted(name: str, *args: Any, create: Any = create, **kwargs: Any) -> Any:
            if name == key:
                tries.append(name)
            return create(name, *args, **kwargs)

        kv.create = counted
    with ThreadPoolExecutor(max_workers=n) as everyone:
        results = _join_all(everyone, nodes)
    assert sorted(r.rank for r in results) == list(range(n))
    assert len({node._session.incarnation for node in nodes}) == 1
    assert 1 <= len(tries) <= 2, len(tries)  # (a slow create may let a second node try)
