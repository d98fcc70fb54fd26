"""Rendezvous of node processes while cluster members die: the round still completes,
with complete, unique ranks and one member list, and clients move to live members."""

from __future__ import annotations

import time
from collections.abc import Callable

from etcd_rdzv import RendezvousParameters
from etcd_rdzv.testing import EtcdCluster
from etcd_rdzv.testing.history import check, from_fleet
from fleet import Fleet

from ._harness import READY_TIMEOUT, RETRIES, assert_round, leader_of

NODES = 8
ROUND_TIMEOUT = 60.0  # seconds for a round to complete after the last join
FAST = {
    "backend": "etcd-rdzv",
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 5,  # a node's key lives 5 s: longer than any fault here
    "last_call_timeout": 2,
    "join_timeout": 90,
}


def test_leader_killed_while_nodes_join(
    cluster: EtcdCluster, cluster_params: Callable[..., RendezvousParameters], fleet: Fleet
) -> None:
    # Each node starts at a different member, so some talk to the leader when it dies.
    nodes = [
        fleet.start(f"n{i}", cluster_params(min_nodes=NODES, max_nodes=NODES, first=i, **FAST))
        for i in range(NODES)
    ]
    fleet.ready(timeout=READY_TIMEOUT)
    leader = leader_of(cluster)
    on_leader = [n for n in nodes if n.endpoint == leader.client_url]
    fleet.check(bool(on_leader), f"no node starts at the leader {leader.client_url}")

    # Half join and wait in the round; the leader dies; the other half join.
    early, late = nodes[: NODES // 2], nodes[NODES // 2 :]
    for node in early:
        node.join(retries=RETRIES)
    for node in early:
        fleet.wait(node, "key-written", 30, lambda e: e["round"] == 1)
    fleet.check(not any(n.events("round") for n in early), "the round completed before the kill")
    leader.kill()
    killed_at = time.monotonic()
    for node in late:
        node.join(retries=RETRIES)

    results = [fleet.wait(n, "round", ROUND_TIMEOUT) for n in nodes]
    assert_round(fleet, results, {n.node_id for n in nodes if n.node_id})
    fleet.check(all(r["round"] == 1 for r in results), f"not all in round 1: {results}")
    fleet.check(not any(n.events("error") for n in nodes), "a node reported an error")
    moved = {r["endpoint"] for r in results}
    fleet.check(
        leader.client_url not in moved,
        f"a node still uses the killed member {leader.client_url}: {moved}",
    )
    print(
        f"{NODES} nodes completed {max(r['t'] for r in results) - killed_at:.2f} s after "
        f"the leader was killed; {len(on_leader)} had started on it"
    )

    # The killed member comes back, the new leader dies: round 2, same nodes, same ranks.
    leader.start()
    second = leader_of(cluster)
    second.kill()
    killed_at = time.monotonic()
    for node in nodes:
        node.join(retries=RETRIES)
    again = [fleet.wait(n, "round", ROUND_TIMEOUT, lambda e: e["round"] == 2) for n in nodes]
    assert_round(fleet, again, {n.node_id for n in nodes if n.node_id})
    ranks = {r["node_id"]: r["rank"] for r in results}
    fleet.check(
        all(ranks[r["node_id"]] == r["rank"] for r in again),
        f"ranks changed between rounds: {results} -> {again}",
    )
    fleet.check(
        second.client_url not in {r["endpoint"] for r in again},
        f"a node still uses the killed member {second.client_url}",
    )
    print(f"round 2 completed {max(r['t'] for r in again) - killed_at:.2f} s after the 2nd kill")
    check(from_fleet(nodes), complete=True)  # both rounds, every node's outcome


def test_paused_leader_rounds_carry_on(
    cluster: EtcdCluster, cluster_params: Callable[..., RendezvousParameters], fleet: Fleet
) -> None:
    # Every node starts at the leader; it freezes (SIGSTOP) while they wait in a round.
    leader = leader_of(cluster)
    first = cluster.members.index(leader)
    params = cluster_params(min_nodes=3, max_nodes=3, first=first, read_timeout=2, **FAST)
    nodes = [fleet.start(f"n{i}", params) for i in range(3)]
    fleet.ready(timeout=READY_TIMEOUT)
    early, last = nodes[:2], nodes[2]
    for node in early:
        node.join(retries=RETRIES)
    for node in early:
        fleet.wait(node, "key-written", 30, lambda e: e["round"] == 1)
    leader.pause()
    try:
        paused_at = time.monotonic()
        last.join(retries=RETRIES)
        results = [fleet.wait(n, "round", ROUND_TIMEOUT) for n in nodes]
        assert_round(fleet, results, {n.node_id for n in nodes if n.node_id})
        took = max(r["t"] for r in results) - paused_at
        print(f"3 nodes completed {took:.2f} s after their member was paused (read_timeout 2)")
        # A watch on a frozen member fails over within 2 x read_timeout (see
        # docs/operations.md); the rest is an election and the round itself.
        fleet.check(took < 2 * 2 + 10, f"the round took {took:.2f} s with a paused member")
        fleet.check(
            leader.client_url not in {r["endpoint"] for r in results},
            "a node still uses the paused member",
        )
        # A second round while the old leader is still frozen.
        for node in nodes:
            node.join(retries=RETRIES)
        again = [fleet.wait(n, "round", ROUND_TIMEOUT, lambda e: e["round"] == 2) for n in nodes]
        assert_round(fleet, again, {n.node_id for n in nodes if n.node_id})
    finally:
        leader.resume()
    fleet.check(not any(n.events("error") for n in nodes), "a node reported an error")
