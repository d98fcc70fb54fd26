"""Recovery in seconds, in-process (handlers as threads, each its own client), both
APIs: a group re-forming after a completed round waits neither for the last call nor
for a dead member's key, only ``rejoin_grace``.

The settings make both long (a 30 s last call, a 30 s node TTL), so a round that
waited for either would take 30 s; torchrun runs of the same faults are in
``tests/torch/test_torchrun_recovery.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import etcd_rdzv
from etcd_rdzv import EtcdRendezvousHandler, RendezvousParameters, RendezvousResult

Params = Callable[..., RendezvousParameters]
HANG = 60.0  # a generous bound that only catches hangs
SLOW = {"last_call_timeout": 30, "keep_alive_interval": 5, "keep_alive_max_attempt": 6}
# The all-re-join test's last call: its first round (3 of at most 4) waits it out.
LAST_CALL = 10


def _results(futures: list[Future[RendezvousResult]]) -> list[RendezvousResult]:
    return [f.result(timeout=HANG) for f in futures]


def _killed(h: EtcdRendezvousHandler) -> None:
    """As if the node's process was SIGKILLed: its heartbeats stop and its keys stay
    until the lease's TTL (30 s here) runs out."""
    h._session.vanish()  # nothing deleted or revoked


def _three(
    params: RendezvousParameters, made: list[EtcdRendezvousHandler], pool: ThreadPoolExecutor
) -> tuple[list[EtcdRendezvousHandler], list[RendezvousResult]]:
    nodes = [etcd_rdzv.create_handler(params) for _ in range(3)]
    made.extend(nodes)
    first = _results([pool.submit(h.next_rendezvous) for h in nodes])
    assert sorted(r.rank for r in first) == [0, 1, 2]
    return nodes, first


def test_survivors_of_a_killed_member_re_form_after_the_grace_not_its_ttl(
    etcd_api_params: Params,
    pool: ThreadPoolExecutor,
    handlers: list[EtcdRendezvousHandler],
) -> None:
    params = etcd_api_params("killed", min_nodes=2, max_nodes=3, rejoin_grace=2, **SLOW)
    nodes, first = _three(params, handlers, pool)
    victim = next(h for h, r in zip(nodes, first, strict=True) if r.rank == 1)
    survivors = [h for h in nodes if h is not victim]
    _killed(victim)
    # Their workers failed (a peer's connection closed): their agents re-join at once.
    started = time.monotonic()
    second = _results([pool.submit(h.next_rendezvous) for h in survivors])
    took = time.monotonic() - started
    assert [r.world_size for r in second] == [2, 2]
    assert second[0].members == second[1].members
    assert sorted(second[0].members) == sorted(h.node_id for h in survivors)
    # The dead member's key was alive all along: the round waited the grace (2 s),
    # not its TTL or the last call (30 s each).
    assert 2.0 <= took < 15, f"the re-formed round took {took:.1f}s"


def test_a_fraction_of_a_second_of_grace_is_waited_as_given(
    etcd_api_params: Params,
    pool: ThreadPoolExecutor,
    handlers: list[EtcdRendezvousHandler],
) -> None:
    """``rejoin_grace=0.4``: the re-formed round waits 0.4 s for the dead member's key,
    neither nothing (rounded down) nor a second (rounded up), nor the TTL (30 s)."""
    params = etcd_api_params("fraction", min_nodes=2, max_nodes=3, rejoin_grace=0.4, **SLOW)
    nodes, first = _three(params, handlers, pool)
    victim = next(h for h, r in zip(nodes, first, strict=True) if r.rank == 2)
    survivors = [h for h in nodes if h is not victim]
    _killed(victim)
    started = time.monotonic()
    second = _results([pool.submit(h.next_rendezvous) for h in survivors])
    took = time.monotonic() - started
    assert [r.world_size for r in second] == [2, 2]
    assert 0.4 <= took < 0.95, f"the re-formed round took {took:.2f}s"


def test_a_group_whose_members_all_re_join_completes_at_once(
    etcd_api_params: Params,
    pool: ThreadPoolExecutor,
    handlers: list[EtcdRendezvousHandler],
) -> None:
    """One member's worker failed and every member re-joins (none died): nothing to
    wait for, neither the grace (20 s here) nor the last call (10 s here: the first
    round, 3 of at most 4 nodes, waits it out once; 30 s would make that wait 30 s)."""
    slow = {**SLOW, "last_call_timeout": LAST_CALL}
    params = etcd_api_params("all-back", min_nodes=2, max_nodes=4, rejoin_grace=20, **slow)
    nodes, first = _three(params, handlers, pool)
    started = time.monotonic()
    second = _results([pool.submit(h.next_rendezvous) for h in nodes])
    took = time.monotonic() - started
    assert [r.world_size for r in second] == [3, 3, 3]
    assert {r.rank for r in second} == {0, 1, 2}
    # Every member keeps its rank.
    by_node = {h.node_id: r.rank for h, r in zip(nodes, first, strict=True)}
    assert all(by_node[h.node_id] == r.rank for h, r in zip(nodes, second, strict=True))
    assert took < LAST_CALL - 2, f"the re-formed round took {took:.1f}s"


def test_a_spare_takes_a_killed_members_place_within_the_grace(
    etcd_api_params: Params,
    pool: ThreadPoolExecutor,
    handlers: list[EtcdRendezvousHandler],
) -> None:
    params = etcd_api_params("spare", min_nodes=3, max_nodes=3, rejoin_grace=2, **SLOW)
    nodes, first = _three(params, handlers, pool)
    spare = etcd_rdzv.create_handler(params)
    handlers.append(spare)
    waiting = pool.submit(spare.next_rendezvous)
    time.sleep(1.0)  # the spare waits beside the running group
    assert not waiting.done() and all(h.num_nodes_waiting() == 0 for h in nodes)
    victim = next(h for h, r in zip(nodes, first, strict=True) if r.rank == 0)
    survivors = [h for h in nodes if h is not victim]
    _killed(victim)
    started = time.monotonic()
    second = _results([*(pool.submit(h.next_rendezvous) for h in survivors), waiting])
    took = time.monotonic() - started
    assert [r.world_size for r in second] == [3, 3, 3]
    assert sorted(second[0].members) == sorted(h.node_id for h in [*survivors, spare])
    assert 2.0 <= took < 15, f"the re-formed round took {took:.1f}s"
