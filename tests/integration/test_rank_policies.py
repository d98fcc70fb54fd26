"""Rank policies on a real etcd, every node a process: ``node_group`` and ``node_unit``.

Nodes are processes of :class:`fleet.Fleet` (kind ``ours``: torch
hidden, the torch-free path); ``etcd-rdzv status`` and ``etcd-rdzv join`` run as
commands. Every test runs on the etcd v2 API and on the v3 API (``etcd_api_params``).
Every wait has a deadline that only catches hangs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from etcd_rdzv import RendezvousParameters
from etcd_rdzv.config.params import ENV_NODE_GROUP
from etcd_rdzv.testing import EtcdRdzvCli
from fleet import Event, Fleet, Node, child_env

from ._cli_where import cli_where

Params = Callable[..., RendezvousParameters]
READY_TIMEOUT = 45.0  # several processes importing at once on 2 cores
HANG = 60.0  # seconds: a generous bound that only catches hangs
POLL = 0.05  # seconds between num_nodes_waiting() calls of a member ("waiting" events)


def _params(etcd_api_params: Params, **config: Any) -> RendezvousParameters:
    config.setdefault("backend", "etcd-rdzv")
    config.setdefault("keep_alive_interval", 1)
    config.setdefault("keep_alive_max_attempt", 2)
    config.setdefault("join_timeout", 60)
    config.setdefault("read_timeout", 10)
    return etcd_api_params("ranks", **config)


def _agreed(fleet: Fleet, rounds: list[Event], world_size: int) -> tuple[str, ...]:
    lists = {tuple(e["members"]) for e in rounds}
    fleet.check(len(lists) == 1, f"members differ between nodes: {lists}")
    (members,) = lists
    fleet.check(
        len(members) == world_size
        and sorted(e["rank"] for e in rounds) == list(range(world_size))
        and all(members[e["rank"]] == e["node_id"] for e in rounds),
        f"expected ranks 0..{world_size - 1}, each its member's: {rounds}",
    )
    return members


def test_eight_nodes_in_two_groups_get_contiguous_ranks_per_group(
    fleet: Fleet, etcd_api_params: Params, etcd_rdzv_cli: EtcdRdzvCli
) -> None:
    # Group b arrives first and the groups interleave (b, a, b, a, ...); a's nodes
    # name their group by option, b's by $ETCD_RDZV_NODE_GROUP.
    params = _params(etcd_api_params, min_nodes=8, max_nodes=8)
    group_a = _params(etcd_api_params, min_nodes=8, max_nodes=8, node_group="a")
    b_env = child_env(**{ENV_NODE_GROUP: "b"})
    nodes: list[tuple[Node, str]] = []
    for i in range(4):
        nodes.append((fleet.start(f"b{i}", params, env=b_env), "b"))
        nodes.append((fleet.start(f"a{i}", group_a), "a"))
    fleet.ready(timeout=READY_TIMEOUT)
    for node, _ in nodes:  # one after another: the arrival order is the start order
        node.join()
        fleet.wait(node, "key-written", HANG)
    rounds = fleet.wait_each([n for n, _ in nodes], "round", HANG)
    members = _agreed(fleet, rounds, 8)
    group_of = {n.node_id: g for n, g in nodes}
    assert [group_of[m] for m in members] == ["a"] * 4 + ["b"] * 4, members
    # Within a group, by arrival.
    assert list(members[:4]) == [n.node_id for n, g in nodes if g == "a"]
    assert list(members[4:]) == [n.node_id for n, g in nodes if g == "b"]

    status = etcd_rdzv_cli.status(params.run_id, *cli_where(params))
    assert [(m["rank"], m["group"]) for m in status["members"]] == [
        (r, "ab"[r // 4]) for r in range(8)
    ]
    text = etcd_rdzv_cli.run("status", "--run-id", params.run_id, *cli_where(params))
    assert text.returncode == 0, text.stderr
    header = next(line.split() for line in text.stdout.splitlines() if "rank" in line.split())
    assert header == ["rank", "node", "address", "alive", "group", "host"]


def test_a_unit_of_four_with_ten_nodes_forms_eight_and_keeps_two_spare(
    fleet: Fleet, etcd_api_params: Params, etcd_rdzv_cli: EtcdRdzvCli
) -> None:
    params = _params(etcd_api_params, min_nodes=4, max_nodes=12, node_unit=4, last_call_timeout=2)
    nodes = [fleet.start(f"n{i}", params, poll=POLL) for i in range(10)]
    fleet.ready(timeout=READY_TIMEOUT)
    for node in nodes:  # as torch's agent: re-rendezvous when num_nodes_waiting() > 0
        node.join(rounds=2, agent=True, poll=POLL)
    members = fleet.wait_total("round", 8, HANG)
    _agreed(fleet, members, 8)
    ids = {e["node_id"] for e in members}
    done = [n for n in nodes if n.node_id in ids]
    spares = [n for n in nodes if n.node_id not in ids]
    assert len(spares) == 2
    for spare in spares:  # they wait in round 2, not in a round of their own
        fleet.wait(spare, "key-written", HANG, lambda e: e["round"] == 2)
        fleet.check(not spare.events("round"), f"spare {spare.name} completed a round")

    # Two waiting nodes could not make a larger world (10 rounds down to 8): no member
    # counts them, so none restarts.
    status = etcd_rdzv_cli.status(params.run_id, *cli_where(params))
    assert len(status["members"]) == 8 and all(m["alive"] for m in status["members"])
    assert [(w["round"], w["spare"]) for w in status["waiting"]] == [(2, True), (2, True)]
    for node in done:
        waiting = fleet.request(node, "status")["waiting"]
        fleet.check(waiting == 0, f"{node.name} counts the spares: {waiting}")
    text = etcd_rdzv_cli.run("status", "--run-id", params.run_id, *cli_where(params)).stdout
    assert "waiting: 2 node(s), 2 of them spare(s)" in text, text

    fleet.check(all(len(n.events("round")) == 1 for n in done), "a member restarted for the spares")

    # Two more make a whole unit: the members restart into a world of 12, keeping
    # their ranks; the spares and the new nodes take ranks 8-11.
    late = [fleet.start(f"late{i}", params) for i in range(2)]
    fleet.ready(late, timeout=READY_TIMEOUT)
    for node in late:
        node.join()
    second = fleet.wait_each([*nodes, *late], "round", HANG, match=lambda e: e["round"] == 2)
    _agreed(fleet, second, 12)
    before = {e["node_id"]: e["rank"] for e in members}
    after = {e["node_id"]: e["rank"] for e in second}
    assert all(after[n] == r for n, r in before.items()), (before, after)


def test_etcd_rdzv_join_takes_the_group_and_the_unit(
    etcd_api_params: Params, etcd_rdzv_cli: EtcdRdzvCli
) -> None:
    params = _params(etcd_api_params)
    run = ["join", "--run-id", "cli", "--min-nodes", "2", "--max-nodes", "3", "--node-unit", "2"]
    where = [*cli_where(params), "--keep-alive-interval", "1", "-q"]
    # Whichever arrives first, group y gets rank 0 (groups in the order of their names);
    # with a unit of 2 and max 3, the world of 2 completes at once.
    joins = [
        etcd_rdzv_cli.start(*run, "--node-group", group, "--local-addr", group, *where)
        for group in ("z", "y")
    ]
    done = [p.finish(HANG) for p in joins]
    outputs = [(d.stdout, d.stderr) for d in done]
    assert [d.returncode for d in done] == [0, 0], outputs
    ranks = [dict(line.split(": ", 1) for line in out.splitlines())["rank"] for out, _ in outputs]
    assert ranks == ["1", "0"], outputs
    assert "peers: y z" in outputs[0][0]
    bad = etcd_rdzv_cli.run(
        "join", "--run-id", "cli", "--min-nodes", "2", "--node-unit", "3", *cli_where(params)
    )
    assert bad.returncode == 2
    assert "--node-unit=3 with min_nodes=2, max_nodes=2" in bad.stderr
