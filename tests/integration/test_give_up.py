"""A node that gave up is never a member: the join timeout and the round's completion agree.

A node whose ``next_rendezvous()`` raises (its join timed out) is in no round that
completes after it gave up, and every member of a completed round returned that
round. The race sits between a coordinator's decision (from its picture of the round
at some revision) and its result write: a node whose deadline passes in between.
These tests hold the coordinator exactly there (the coordinator's write waits until
the node gave up), on v2 and v3, and check every node's outcome with the history
checker (:mod:`etcd_rdzv.testing.history`) against etcd's own member list.

Handlers run as threads of this process, each with its own client. The tests of the
result's create also run on Debian's etcd 3.4 (v3): it compares a whole key range (the
gone markers).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import EtcdRendezvousHandler, RendezvousParameters, _keys
from etcd_rdzv._kv import KV
from etcd_rdzv.errors import RendezvousTimeoutError
from etcd_rdzv.rendezvous import coordinator
from etcd_rdzv.rendezvous.completion import create_unless_gone, seal_key, withdraw
from etcd_rdzv.rendezvous.watch import RoundView
from etcd_rdzv.runs.status import read_run
from etcd_rdzv.testing import wait_until
from etcd_rdzv.testing.history import History, check

#: The tests of the result's create, which compares a key range on v3: also on 3.4.
ALSO_ON_34 = pytest.mark.etcd_variants("v2", "v3", "v3-3.4")

Params = Callable[..., RendezvousParameters]
HANG = 60.0  # a generous bound that only catches hangs
SHORT = 3  # join_timeout of the node that gives up
HOLD = 15.0  # seconds a node that gave up may take to withdraw and raise, at most


@pytest.fixture
def kv(etcd_api_params: Params) -> Iterator[KV]:
    client = etcd_rdzv.create_client(etcd_api_params())
    yield client
    client.close()


class _Run:
    """Handlers of one run, joined in threads; each outcome recorded in ``history``."""

    def __init__(self, params: Params, handlers: list[EtcdRendezvousHandler]) -> None:
        self.params, self.handlers = params, handlers
        self.history = History()
        self.pool = ThreadPoolExecutor(max_workers=6)
        self.prefix = str(params().get("key_prefix"))

    def join(self, name: str, **config: Any) -> tuple[EtcdRendezvousHandler, Future[Any]]:
        params = self.params("giveup", min_nodes=3, max_nodes=3, keep_alive_interval=1, **config)
        handler = etcd_rdzv.create_handler(params)
        self.handlers.append(handler)
        node = handler.node_id

        def run() -> Any:
            try:
                result = handler.next_rendezvous()
            except BaseException as exc:
                self.history.gave_up(node, exc)
                raise
            self.history.joined(node, result.round, result.rank, result.world_size, result.members)
            return result

        return handler, self.pool.submit(run)

    def keys(self, kv: KV, what: str) -> list[str]:
        found, _ = kv.list_prefix(_keys.round_dir(self.prefix, "giveup", 1) + "/" + what)
        return [r.key for r in found]

    def coordinated(self, kv: KV) -> bool:
        return kv.get(_keys.coord_key(self.prefix, "giveup", 1))[0] is not None

    def etcd_rounds(self, kv: KV) -> dict[int, tuple[str, ...]]:
        status = read_run(kv, self.prefix, "giveup")
        assert status.completed_round is not None
        return {status.completed_round: tuple(m.node for m in status.members)}

    def outcomes(self, kv: KV, futures: dict[str, Future[Any]]) -> dict[int, tuple[str, ...]]:
        """Once etcd holds a completed round: its member list, after each member's
        ``next_rendezvous()`` ended (``futures``: by node id), so that the history
        checker sees every member's outcome, whatever the round's members are."""
        wait_until(
            lambda: read_run(kv, self.prefix, "giveup").completed_round is not None,
            20.0,
            what="the round completes",
            interval=0.05,
        )
        rounds = self.etcd_rounds(kv)
        (members,) = rounds.values()
        wait([futures[m] for m in members if m in futures], timeout=HANG)
        return rounds


@pytest.fixture
def run(etcd_api_params: Params, handlers: list[EtcdRendezvousHandler]) -> Iterator[_Run]:
    made = _Run(etcd_api_params, handlers)
    yield made
    made.pool.shutdown(wait=False, cancel_futures=True)


@ALSO_ON_34
def test_a_node_that_gives_up_before_the_result_is_written_is_not_a_member(
    run: _Run, kv: KV, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The coordinator (b) decides to complete the round with a, b and c, and is held
    # before its result write until a's join timed out; a's withdrawal comes after the
    # picture the decision was made from, so the write is refused and the round
    # completes with b, c and a later node d instead.
    gave_up = threading.Event()
    held: list[int] = []
    write_result = coordinator._Round.write_result

    def held_write(self: Any, text: str, as_of: int | None = None) -> bool:
        if as_of is not None and not held:
            held.append(as_of)
            assert gave_up.wait(HANG), "node a did not give up"
        return write_result(self, text, as_of)

    monkeypatch.setattr(coordinator._Round, "write_result", held_write)
    b, fb = run.join("b", join_timeout=60)
    wait_until(lambda: run.coordinated(kv), 20.0, what="b coordinates", interval=0.02)
    a, fa = run.join("a", join_timeout=SHORT)
    wait_until(lambda: len(run.keys(kv, "nodes")) == 2, 20.0, what="a joined", interval=0.02)
    c, fc = run.join("c", join_timeout=60)
    with pytest.raises(RendezvousTimeoutError):
        fa.result(timeout=SHORT + HOLD)
    gave_up.set()
    assert held, "the coordinator never decided to complete the round"
    d, fd = run.join("d", join_timeout=60)
    # The history checker first: a round completed with a as a member (a withdrawal
    # that did not keep it out) is named as such, as soon as the round is in etcd.
    futures = {a.node_id: fa, b.node_id: fb, c.node_id: fc, d.node_id: fd}
    check(run.history.entries, rounds=run.outcomes(kv, futures), complete=True)
    # a's withdrawal is in etcd: its gone marker, and no join key.
    gone = run.keys(kv, "gone")
    assert [k.rsplit("/", 1)[1] for k in gone] == [_keys.b64_key(a.node_id)]
    results = [f.result(timeout=HANG) for f in (fb, fc, fd)]
    assert {r.round for r in results} == {1}
    members = set(results[0].members)
    assert members == {b.node_id, c.node_id, d.node_id}


def test_a_node_whose_deadline_passes_after_the_result_is_a_member(
    run: _Run, kv: KV, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The result is written, but its announcement (what followers watch) waits until
    # a's deadline passed: a finds the result as it gives up, sees itself in it, and
    # returns its rank like the others.
    announce = coordinator.announce
    past = threading.Event()

    def late_announce(*args: Any, **kwargs: Any) -> Any:
        if not past.is_set():
            time.sleep(SHORT + 1.0)  # beyond a's join deadline
            past.set()
        return announce(*args, **kwargs)

    monkeypatch.setattr(coordinator, "announce", late_announce)
    _, fb = run.join("b", join_timeout=60)
    wait_until(lambda: run.coordinated(kv), 20.0, what="b coordinates", interval=0.02)
    _, fa = run.join("a", join_timeout=SHORT)
    wait_until(lambda: len(run.keys(kv, "nodes")) == 2, 20.0, what="a joined", interval=0.02)
    _, fc = run.join("c", join_timeout=60)
    results = [f.result(timeout=HANG) for f in (fa, fb, fc)]
    assert past.is_set()
    assert sorted(r.rank for r in results) == [0, 1, 2]
    assert {r.round for r in results} == {1}
    assert run.keys(kv, "gone") == [], "a withdrew although the round had completed"
    check(run.history.entries, rounds=run.etcd_rounds(kv), complete=True)


# -- the two operations themselves ----------------------------------------------------


@ALSO_ON_34
def test_a_result_is_refused_after_a_withdrawal_newer_than_its_picture(
    kv: KV, etcd_api_params: Params
) -> None:
    prefix = str(etcd_api_params().get("key_prefix"))
    node = _keys.node_key(prefix, "w", 1, "n1")
    result = _keys.result_key(prefix, "w", 1)
    gone_dir = _keys.gone_dir(prefix, "w", 1)
    picture = kv.put(node, "n1", 60).revision
    withdrawn, found = withdraw(kv, node, result, _keys.gone_key(prefix, "w", 1, "n1"), "n1", 60, 5)
    assert (withdrawn, found) == (True, None)
    assert kv.get(node)[0] is None
    assert create_unless_gone(kv, result, "r", 60, gone_dir, picture, 5) == (None, None)
    assert kv.get(result)[0] is None
    # A picture that holds the withdrawal: created.
    now = kv.get(gone_dir + "/x")[1]
    created, existing = create_unless_gone(kv, result, "r", 60, gone_dir, now, 5)
    assert created is not None and created.value == "r" and existing is None
    # Once more: the result exists.
    again, existing = create_unless_gone(kv, result, "s", 60, gone_dir, now, 5)
    assert again is None and existing is not None and existing.value == "r"


def test_a_node_finds_the_result_instead_of_withdrawing(kv: KV, etcd_api_params: Params) -> None:
    prefix = str(etcd_api_params().get("key_prefix"))
    node = _keys.node_key(prefix, "w", 1, "n1")
    result = _keys.result_key(prefix, "w", 1)
    kv.put(node, "n1", 60)
    kv.create(result, "r", 60)
    withdrawn, found = withdraw(kv, node, result, _keys.gone_key(prefix, "w", 1, "n1"), "n1", 60, 5)
    assert not withdrawn and found is not None and found.value == "r"
    assert kv.get(node)[0] is not None, "the key of a member was deleted"


def test_a_join_key_refreshed_after_its_gone_marker_stays_out_of_the_picture(
    kv: KV, etcd_api_params: Params
) -> None:
    # v2's heart refreshes a join key's TTL; one refresh that lands between the node's
    # gone marker and its key's delete must not bring the node back into a
    # coordinator's picture (a result made from it would count a node that gave up).
    prefix = str(etcd_api_params().get("key_prefix"))
    node = _keys.node_key(prefix, "w", 1, "n1")
    kv.put(node, json.dumps({"id": "n1", "addr": "h-n1", "prev_rank": None}), 60)
    kv.put(_keys.gone_key(prefix, "w", 1, "n1"), "n1", 60)
    assert kv.refresh(node, 60)
    view = RoundView(_keys.rdzv_dir(prefix, "w"), 1)
    view.load(kv.list_tree(_keys.rdzv_dir(prefix, "w"))[0])
    assert list(view.nodes) == [node] and view.admitted() == ()


@pytest.mark.etcd_variants("v2")  # v3 orders the two in one transaction each
def test_v2_a_node_waits_for_the_result_of_a_round_sealed_before_it_gave_up(
    kv: KV, etcd_api_params: Params
) -> None:
    assert kv.api == "v2"
    prefix = str(etcd_api_params().get("key_prefix"))
    node = _keys.node_key(prefix, "w", 1, "n1")
    result = _keys.result_key(prefix, "w", 1)
    kv.put(node, "n1", 60)
    kv.create(seal_key(result), "sealed", 60)  # a coordinator sealed the round first
    with ThreadPoolExecutor(max_workers=1) as pool:
        gone = _keys.gone_key(prefix, "w", 1, "n1")
        pending = pool.submit(withdraw, kv, node, result, gone, "n1", 60, 30)
        time.sleep(1.0)
        assert not pending.done(), "the node did not wait for the sealed round's result"
        kv.create(result, "r", 60)
        withdrawn, found = pending.result(timeout=HANG)
    assert not withdrawn and found is not None and found.value == "r"
    assert kv.get(node)[0] is not None


# -- many nodes at the edge, nothing held --------------------------------------------

SLOW_WRITE = 1.0  # seconds the first result write of each run takes here


def test_many_nodes_whose_deadlines_pass_as_the_round_completes(
    etcd_api_params: Params,
    handlers: list[EtcdRendezvousHandler],
    kv: KV,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 16 nodes join 0.3 s apart with a 3 s join timeout (the first, 10 s); 4 start the
    # last call (2 s),
    # so the round completes about when the first nodes' deadlines pass: some give up
    # just before it, some just after. Three runs; every node's outcome and etcd's
    # member list go to the history checker. Nothing waits for anything, but the
    # first result write of each run is slow (SLOW_WRITE, as on a loaded etcd): the
    # first nodes' deadlines pass between the decision and its write, which their
    # withdrawals must refuse (else they are members that gave up).
    write_result = coordinator._Round.write_result
    slowed: set[str] = set()
    refused: list[str] = []

    def slow_write(self: Any, text: str, as_of: int | None = None) -> bool:
        if as_of is not None and self.s.run_id not in slowed:
            slowed.add(self.s.run_id)
            time.sleep(SLOW_WRITE)
        written = write_result(self, text, as_of)
        if not written:
            refused.append(self.s.run_id)
        return written

    monkeypatch.setattr(coordinator._Round, "write_result", slow_write)
    history = History()
    listed: dict[int, tuple[str, ...]] = {}
    prefix = str(etcd_api_params().get("key_prefix"))
    for attempt in range(3):
        run_id = f"edge{attempt}"
        options: dict[str, Any] = {
            "min_nodes": 4,
            "max_nodes": 16,
            "last_call_timeout": 2,
            "keep_alive_interval": 1,
        }
        # The first node coordinates; it waits longer, so that it is still there to
        # decide again when its slow write was refused.
        nodes = [
            etcd_rdzv.create_handler(
                etcd_api_params(run_id, join_timeout=10 if i == 0 else 3, **options)
            )
            for i in range(16)
        ]
        handlers.extend(nodes)

        def run(h: EtcdRendezvousHandler, delay: float, attempt: int = attempt) -> None:
            time.sleep(delay)
            try:
                r = h.next_rendezvous()
            except RendezvousTimeoutError as exc:
                history.gave_up(f"{attempt}:{h.node_id}", exc)
                return
            history.joined(
                f"{attempt}:{h.node_id}",
                100 * attempt + r.round,
                r.rank,
                r.world_size,
                [f"{attempt}:{m}" for m in r.members],
            )

        with ThreadPoolExecutor(max_workers=16) as pool:
            done = [pool.submit(run, h, 0.3 * i) for i, h in enumerate(nodes)]
            for f in done:
                f.result(timeout=HANG)
        status = read_run(kv, prefix, run_id)
        if status.completed_round is not None:
            listed[100 * attempt + status.completed_round] = tuple(
                f"{attempt}:{m.node}" for m in status.members
            )
    check(history.entries, rounds=listed)
    kinds = {type(e).__name__ for e in history.entries}
    assert kinds == {"Joined", "GaveUp"}, f"the runs did not reach the edge: {kinds}"
    # The edge was reached: a node gave up between a decision and its result write.
    assert refused, f"no result write was refused for a withdrawal (slowed: {sorted(slowed)})"
    print(
        f"\n{sum(e.__class__.__name__ == 'GaveUp' for e in history.entries)} gave up, "
        f"{sum(e.__class__.__name__ == 'Joined' for e in history.entries)} joined, "
        f"completed rounds {sorted(listed)}, writes refused in {refused}"
    )


@pytest.mark.etcd_variants("v2")  # no seal on v3
def test_v2_a_seal_stops_other_coordinators_but_not_its_own(
    kv: KV, etcd_api_params: Params
) -> None:
    assert kv.api == "v2"
    prefix = str(etcd_api_params().get("key_prefix"))
    result = _keys.result_key(prefix, "w", 1)
    gone_dir = _keys.gone_dir(prefix, "w", 1)
    at = kv.create(seal_key(result), "theirs", 60)
    assert at is not None
    assert create_unless_gone(kv, result, "mine", 60, gone_dir, at.revision, 5) == (None, None)
    kv.delete(seal_key(result))
    # A try of ours that failed after its seal (etcd went away) is taken up again.
    kv.create(seal_key(result), "mine", 60)
    created, _ = create_unless_gone(kv, result, "mine", 60, gone_dir, at.revision, 5)
    assert created is not None and kv.get(result)[0] is not None
