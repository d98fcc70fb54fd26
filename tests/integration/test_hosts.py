"""Hosts on a real etcd, every node a process: a node is known by its host.

Every test runs on the etcd v2 API and on the v3 API (``etcd_api_params``); nodes are
processes of :class:`fleet.Fleet`, ``etcd-rdzv status`` a command.
"""

from __future__ import annotations

from collections.abc import Callable

import etcd_rdzv
from etcd_rdzv import RendezvousParameters, _keys
from etcd_rdzv.config.params import ENV_HOST_ID
from etcd_rdzv.testing import EtcdRdzvCli
from fleet import Event, Fleet, Node, child_env

from ._cli_where import cli_where

Params = Callable[..., RendezvousParameters]
READY_TIMEOUT = 45.0
HANG = 60.0  # seconds: a generous bound that only catches hangs


def test_status_names_each_nodes_host_across_a_restart(
    fleet: Fleet, etcd_api_params: Params, etcd_rdzv_cli: EtcdRdzvCli
) -> None:
    # One host named by option, one by $ETCD_RDZV_HOST_ID; the second host's agent
    # restarts (a new process, a new node id) and is the same host.
    def params(**config: object) -> RendezvousParameters:
        return etcd_api_params(
            "hosts",
            min_nodes=2,
            max_nodes=2,
            keep_alive_interval=1,
            keep_alive_max_attempt=2,
            join_timeout=60,
            **config,
        )

    a = fleet.start("a", params(host_id="gpu-a"))
    b = fleet.start("b", params(), env=child_env(**{ENV_HOST_ID: "gpu-b"}))
    fleet.ready(timeout=READY_TIMEOUT)
    for node in (a, b):
        node.join()
    fleet.wait_each([a, b], "round", HANG)
    status = etcd_rdzv_cli.status(params().run_id, *cli_where(params()))
    assert {m["node"]: m["host"] for m in status["members"]} == {
        a.node_id: "gpu-a",
        b.node_id: "gpu-b",
    }
    b.kill()
    b2 = fleet.start("b2", params(), env=child_env(**{ENV_HOST_ID: "gpu-b"}))
    fleet.ready([b2], timeout=READY_TIMEOUT)
    b2.join()
    a.join()  # a member re-joins, as its agent does once a member is gone
    fleet.wait_each([a], "round", HANG, count=2)
    fleet.wait_each([b2], "round", HANG)
    status = etcd_rdzv_cli.status(params().run_id, *cli_where(params()))
    hosts = {m["node"]: m["host"] for m in status["members"]}
    assert b2.node_id != b.node_id and hosts == {a.node_id: "gpu-a", b2.node_id: "gpu-b"}
    text = etcd_rdzv_cli.run("status", "--run-id", params().run_id, *cli_where(params()))
    assert text.returncode == 0, text.stderr
    header = next(line.split() for line in text.stdout.splitlines() if "rank" in line.split())
    assert header[-1] == "host" and "gpu-b" in text.stdout


def _three(etcd_api_params: Params, run_id: str) -> Callable[[str], RendezvousParameters]:
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
        )

    return params


def _excluded_error(fleet: Fleet, node: Node, reason: str) -> Event:
    error = fleet.wait(node, "error", HANG)
    assert any(k.endswith("HostExcluded") for k in error["kinds"]), error
    assert reason in error["message"] and "etcd-rdzv include" in error["message"], error
    return error


def test_an_excluded_host_never_enters_a_round_and_is_not_waiting(
    fleet: Fleet, etcd_api_params: Params, etcd_rdzv_cli: EtcdRdzvCli
) -> None:
    params = _three(etcd_api_params, "excluded-early")
    where = ["--run-id", params("h1").run_id, *cli_where(params("h1"))]
    # h3 has not joined yet: excluding it takes --force.
    done = etcd_rdzv_cli.run("exclude", "--host", "h3", "--reason", "bad NIC", "--force", *where)
    assert done.returncode == 0, done.stderr
    nodes = [fleet.start(h, params(h), poll=0.05) for h in ("h1", "h2", "h3")]
    fleet.ready(timeout=READY_TIMEOUT)
    for node in nodes:
        node.join()
    rounds = fleet.wait_each(nodes[:2], "round", HANG)
    assert {e["world_size"] for e in rounds} == {2}
    assert nodes[2].node_id not in rounds[0]["members"]
    _excluded_error(fleet, nodes[2], "bad NIC")
    assert not nodes[2].events("key-written"), "an excluded host wrote a join key"
    status = etcd_rdzv_cli.status(params("h1").run_id, *cli_where(params("h1")))
    assert [(e["host"], e["reason"], e["by"]) for e in status["excluded"]] == [
        ("h3", "bad NIC", "operator")
    ]
    assert status["waiting"] == []
    # A late node of another host: the members see it waiting, and it is the first
    # waiting node they ever saw (they never counted the excluded host).
    late = fleet.start("h4", params("h4"))
    fleet.ready([late], timeout=READY_TIMEOUT)
    late.join()
    fleet.wait_each(nodes[:2], "waiting", HANG, match=lambda e: e["n"] > 0)
    for node in nodes[:2]:  # each change of num_nodes_waiting() is an event
        counts = [e["n"] for e in node.events("waiting")]
        assert counts == [0, 1], f"{node.name} saw waiting nodes: {counts}"


def test_excluding_a_member_reforms_without_it_and_include_lets_it_back(
    fleet: Fleet, etcd_api_params: Params, etcd_rdzv_cli: EtcdRdzvCli
) -> None:
    params = _three(etcd_api_params, "excluded-member")
    where = ["--run-id", params("h1").run_id, *cli_where(params("h1"))]
    nodes = [fleet.start(h, params(h)) for h in ("h1", "h2", "h3")]
    fleet.ready(timeout=READY_TIMEOUT)
    for node in nodes:  # as torch's agents: again once num_nodes_waiting() > 0
        node.join(rounds=0, agent=True, poll=0.05)
    fleet.wait_each(nodes, "round", HANG)
    done = etcd_rdzv_cli.run(
        "exclude", "--host", "h3", "--reason", "GPU 5 Xid 79", "--for", "10m", *where
    )
    assert done.returncode == 0, done.stderr
    second = fleet.wait_each(nodes[:2], "round", HANG, count=2)
    assert {e["world_size"] for e in second} == {2}
    assert nodes[2].node_id not in second[0]["members"]
    _excluded_error(fleet, nodes[2], "GPU 5 Xid 79")
    status = etcd_rdzv_cli.status(params("h1").run_id, *cli_where(params("h1")))
    assert [(e["host"], e["for"]) for e in status["excluded"]] == [("h3", 600)]
    assert len(status["members"]) == 2

    done = etcd_rdzv_cli.run("include", "--host", "h3", *where)
    assert done.returncode == 0, done.stderr
    nodes[2].join(rounds=0, agent=True, poll=0.05)
    last = max(e["round"] for e in second)
    third = fleet.wait_each(nodes, "round", HANG, match=lambda e: e["round"] > last)
    assert {(e["round"], e["world_size"]) for e in third} == {(last + 1, 3)}
    # One re-rendezvous for the exclusion, not more: the next round is the one that
    # lets h3 back in.
    assert [len(n.events("round")) for n in nodes[:2]] == [3, 3]
    status = etcd_rdzv_cli.status(params("h1").run_id, *cli_where(params("h1")))
    assert status["excluded"] == [] and len(status["members"]) == 3


def test_a_foreign_record_under_an_exclusion_key_still_excludes_and_is_reported(
    fleet: Fleet, etcd_api_params: Params, etcd_rdzv_cli: EtcdRdzvCli
) -> None:
    # Written by something else (etcdctl, say): the key is what counts.
    params = _three(etcd_api_params, "excluded-foreign")
    kv = etcd_rdzv.create_client(params("h1"))
    try:
        key = _keys.excluded_key(str(params("h1").config["key_prefix"]), "excluded-foreign", "h3")
        kv.put(key, "{not json", None)
    finally:
        kv.close()
    nodes = [fleet.start(h, params(h)) for h in ("h1", "h2", "h3")]
    fleet.ready(timeout=READY_TIMEOUT)
    for node in nodes:
        node.join()
    assert {e["world_size"] for e in fleet.wait_each(nodes[:2], "round", HANG)} == {2}
    _excluded_error(fleet, nodes[2], "unreadable")
    status = etcd_rdzv_cli.status("excluded-foreign", *cli_where(params("h1")))
    assert status["excluded"] == []
    assert any(key in p and "exclusion record" in p for p in status["problems"]), status
