"""Hosts on a real etcd, every node a process: a node is known by its host.

Every test runs on the etcd v2 API and on the v3 API (``etcd_api_params``); nodes are
processes of :class:`etcd_rdzv.testing.fleet.Fleet`, ``etcd-rdzv status`` a command.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from etcd_rdzv import RendezvousParameters
from etcd_rdzv.params import ENV_HOST_ID
from etcd_rdzv.testing import EtcdRdzvCli
from etcd_rdzv.testing.fleet import Fleet, child_env

Params = Callable[..., RendezvousParameters]
READY_TIMEOUT = 45.0
HANG = 60.0  # seconds: a generous bound that only catches hangs


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with Fleet(tmp_path, max_life=150.0) as nodes:
        yield nodes


def _where(params: RendezvousParameters) -> list[str]:
    config = params.config
    return [
        "--endpoint",
        params.endpoint,
        "--key-prefix",
        str(config["key_prefix"]),
        "--api",
        str(config["api"]),
    ]


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
    status = etcd_rdzv_cli.status(params().run_id, *_where(params()))
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
    status = etcd_rdzv_cli.status(params().run_id, *_where(params()))
    hosts = {m["node"]: m["host"] for m in status["members"]}
    assert b2.node_id != b.node_id and hosts == {a.node_id: "gpu-a", b2.node_id: "gpu-b"}
    text = etcd_rdzv_cli.run("status", "--run-id", params().run_id, *_where(params()))
    assert text.returncode == 0, text.stderr
    header = next(line.split() for line in text.stdout.splitlines() if "rank" in line.split())
    assert header[-1] == "host" and "gpu-b" in text.stdout
