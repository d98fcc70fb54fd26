"""Quarantine on a real etcd, every node a process: a host whose agents keep dying is
kept out, and the run goes on without it.

Every test runs on the etcd v2 API and on the v3 API (``etcd_api_params``); nodes are
processes of :class:`fleet.Fleet` (an agent killed is a process
killed with SIGKILL), ``etcd-rdzv status`` and ``include`` are commands.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import etcd_rdzv
from etcd_rdzv import RendezvousParameters, _keys
from etcd_rdzv.testing import EtcdRdzvCli
from fleet import Fleet, Node

from ._cli_where import cli_where

Params = Callable[..., RendezvousParameters]
READY_TIMEOUT = 45.0
HANG = 60.0  # seconds: a generous bound that only catches hangs


def _params(etcd_api_params: Params, run_id: str, deaths: int) -> Callable[[str], Any]:
    def params(host: str) -> RendezvousParameters:
        return etcd_api_params(
            run_id,
            min_nodes=2,
            max_nodes=3,
            keep_alive_interval=1,
            keep_alive_max_attempt=2,
            last_call_timeout=1,
            join_timeout=30,
            host_id=host,
            quarantine_deaths=deaths,
            quarantine_window=600,
            quarantine_time=900,
        )

    return params


def _agent(fleet: Fleet, name: str, params: RendezvousParameters) -> Node:
    """A node that joins as torch's agent does: again once num_nodes_waiting() > 0."""
    node = fleet.start(name, params)
    fleet.ready([node], timeout=READY_TIMEOUT)
    node.join(rounds=0, agent=True, poll=0.05)
    return node


def _rounds(nodes: list[Node]) -> list[int]:
    return [len(n.events("round")) for n in nodes]


def test_a_host_killed_k_times_is_quarantined_and_the_rounds_go_on(
    fleet: Fleet, etcd_api_params: Params, etcd_rdzv_cli: EtcdRdzvCli
) -> None:
    params = _params(etcd_api_params, "flapping", deaths=2)
    run_id, where = params("h1").run_id, cli_where(params("h1"))
    survivors = [_agent(fleet, h, params(h)) for h in ("h1", "h2")]
    flapper = _agent(fleet, "h3", params("h3"))
    # The survivors may have formed a round of 2 before the flapper came (min_nodes=2):
    # count their rounds from the first with all three.
    base = fleet.wait(flapper, "round", HANG)["round"] - 1
    fleet.wait_each(survivors, "round", HANG, count=base + 1)

    # Death 1: the survivors re-form without it; its next agent finds the death,
    # records it and joins (one death is below quarantine_deaths).
    flapper.kill()
    assert {e["world_size"] for e in fleet.wait_each(survivors, "round", HANG, count=base + 2)} == {
        2
    }
    second = _agent(fleet, "h3-second", params("h3"))
    third = fleet.wait_each(survivors, "round", HANG, count=base + 3)
    assert {e["world_size"] for e in third} == {3}
    assert second.node_id in third[0]["members"]
    status = etcd_rdzv_cli.status(run_id, *where)
    assert [(d["host"], d["node"]) for d in status["deaths"]] == [("h3", flapper.node_id)]
    assert status["excluded"] == []

    # Death 2: its next agent quarantines the host and does not join.
    second.kill()
    assert {e["world_size"] for e in fleet.wait_each(survivors, "round", HANG, count=base + 4)} == {
        2
    }
    third_agent = _agent(fleet, "h3-third", params("h3"))
    error = fleet.wait(third_agent, "error", HANG)
    assert any(k.endswith("HostExcluded") for k in error["kinds"]), error
    assert "2 death(s) of its agents within 10m" in error["message"], error
    assert "etcd-rdzv include" in error["message"], error
    assert not third_agent.events("key-written"), "a quarantined host wrote a join key"
    status = etcd_rdzv_cli.status(run_id, *where)
    assert [(e["host"], e["by"], e["for"]) for e in status["excluded"]] == [
        ("h3", "quarantine", 900)
    ]
    assert "2 death(s)" in status["excluded"][0]["reason"]
    assert status["deaths"] == [], "the count starts anew after a quarantine"
    assert len(status["members"]) == 2

    # An operator's include brings it back: its next agent joins, and the group grows.
    done = etcd_rdzv_cli.run("include", "--host", "h3", "--run-id", run_id, *where)
    assert done.returncode == 0, done.stderr
    back = _agent(fleet, "h3-back", params("h3"))
    joined = fleet.wait(back, "round", HANG)["round"]
    grown = fleet.wait_each(survivors, "round", HANG, match=lambda e: e["round"] == joined)
    assert {e["world_size"] for e in grown} == {3}
    assert back.node_id in grown[0]["members"]
    # The quarantined host cost no re-rendezvous: the survivors' next round after the
    # one without it is the one that let the host back in.
    assert _rounds(survivors) == [base + 5] * 2, "the quarantined host cost a re-rendezvous"


def test_agents_that_leave_are_not_deaths(
    fleet: Fleet, etcd_api_params: Params, etcd_rdzv_cli: EtcdRdzvCli
) -> None:
    # quarantine_deaths=1: a single death quarantines. Two agents of the host leave
    # (one shuts down, one is done when its process exits) and neither counts; the
    # one killed after them does.
    params = _params(etcd_api_params, "leavers", deaths=1)
    run_id, where = params("h1").run_id, cli_where(params("h1"))
    survivors = [_agent(fleet, h, params(h)) for h in ("h1", "h2")]
    for name in ("h3-shuts-down", "h3-exits"):
        node = _agent(fleet, name, params("h3"))
        fleet.wait_each([node], "round", HANG)
        if name == "h3-shuts-down":
            node.exit()  # shutdown(), then the process exits
        else:
            node.send("leave")  # the process exits; the handler's finalizer leaves
        fleet.wait(node, "exit", HANG)
    killed = _agent(fleet, "h3-killed", params("h3"))
    with_killed = fleet.wait_each([killed], "round", HANG)[0]["round"]
    status = etcd_rdzv_cli.status(run_id, *where)
    assert status["excluded"] == [] and status["deaths"] == [], status
    killed.kill()
    last = _agent(fleet, "h3-after-death", params("h3"))
    error = fleet.wait(last, "error", HANG)
    assert any(k.endswith("HostExcluded") for k in error["kinds"]), error
    assert "1 death(s)" in error["message"], error
    status = etcd_rdzv_cli.status(run_id, *where)
    assert [(e["host"], e["by"]) for e in status["excluded"]] == [("h3", "quarantine")]
    # The survivors go on: once the killed agent's key expired (its TTL, 2 s), they
    # form a round of their own (how soon after the refusal depends on the machine).
    rounds = fleet.wait_until(
        "the survivors' round without h3",
        lambda: next((e for e in survivors[0].events("round") if e["round"] > with_killed), None),
        HANG,
        alive=survivors,
    )
    assert all(n.alive for n in survivors)
    status = etcd_rdzv_cli.status(run_id, *where)
    assert rounds["world_size"] == 2, rounds
    assert status["round"] >= rounds["round"] and len(status["members"]) == 2, status


def test_quarantine_off_counts_nothing(
    fleet: Fleet, etcd_api_params: Params, etcd_rdzv_cli: EtcdRdzvCli
) -> None:
    # Without quarantine_deaths, a killed agent's host comes back every time, and
    # nothing is recorded.
    def params(host: str) -> RendezvousParameters:
        return etcd_api_params(
            "no-quarantine",
            min_nodes=1,
            max_nodes=2,
            keep_alive_interval=1,
            keep_alive_max_attempt=2,
            last_call_timeout=1,
            join_timeout=30,
            host_id=host,
        )

    _agent(fleet, "h1", params("h1"))
    for name in ("h2", "h2-again", "h2-third"):
        node = _agent(fleet, name, params("h2"))
        fleet.wait_each([node], "round", HANG)
        node.kill()
    status = etcd_rdzv_cli.status("no-quarantine", *cli_where(params("h1")))
    assert status["excluded"] == [] and status["deaths"] == []


def test_foreign_records_count_as_deaths_and_a_bad_death_record_is_reported(
    fleet: Fleet, etcd_api_params: Params, etcd_rdzv_cli: EtcdRdzvCli
) -> None:
    # Keys this package did not write: under a host's lives a key's presence is a
    # death (whatever it holds); a death record that does not parse is counted, and
    # status names it among its problems.
    params = _params(etcd_api_params, "foreign-lives", deaths=2)
    prefix = str(params("h1").config["key_prefix"])
    kv = etcd_rdzv.create_client(params("h1"))
    try:
        kv.put(_keys.lives_dir(prefix, "foreign-lives", "h3") + "/not-base64!", "{oops", None)
        bad = _keys.deaths_dir(prefix, "foreign-lives", "h4") + "/eA"
        kv.put(bad, '{"host": 7}', None)
    finally:
        kv.close()
    status = etcd_rdzv_cli.status("foreign-lives", *cli_where(params("h1")))
    assert status["deaths"] == []
    assert any(bad in p and "death record" in p for p in status["problems"]), status
    _agent(fleet, "h1", params("h1"))
    second = _agent(fleet, "h3", params("h3"))  # one death found: it joins
    assert {e["world_size"] for e in fleet.wait_each([second], "round", HANG)} == {2}
    status = etcd_rdzv_cli.status("foreign-lives", *cli_where(params("h1")))
    assert [(d["host"], d["node"], d["started"]) for d in status["deaths"]] == [
        ("h3", "not-base64!", "")
    ]
    # With quarantine_deaths=1 for its agent, the unreadable record is the one death.
    h4 = _agent(fleet, "h4", _params(etcd_api_params, "foreign-lives", deaths=1)("h4"))
    error = fleet.wait(h4, "error", HANG)
    assert "1 death(s)" in error["message"], error


def test_a_join_after_shutdown_leaves_no_life_behind(etcd_api_params: Params) -> None:
    # An agent checks in once: a join that starts after shutdown() (a thread of an
    # agent that is exiting, say) writes no life, so the process ending without a
    # second shutdown is not a death of its host.
    params = etcd_api_params(
        "join-after-shutdown",
        min_nodes=1,
        max_nodes=1,
        last_call_timeout=0,
        join_timeout=30,
        host_id="h1",
        quarantine_deaths=1,
    )
    prefix = str(params.config["key_prefix"])
    lives = _keys.lives_dir(prefix, "join-after-shutdown", "h1")
    handler = etcd_rdzv.create_handler(params)
    kv = etcd_rdzv.create_client(params)
    try:
        assert handler.next_rendezvous().world_size == 1
        assert len(kv.list_tree(lives)[0]) == 1  # checked in: one life
        assert handler.shutdown()
        assert kv.list_tree(lives)[0] == []
        assert handler.next_rendezvous().world_size == 1
        assert kv.list_tree(lives)[0] == []
    finally:
        handler.shutdown()
        kv.close()
