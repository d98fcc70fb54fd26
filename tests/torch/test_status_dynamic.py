"""``etcd-rdzv status`` of runs of torch's own DynamicRendezvousHandler over our backend
(torchrun ``etcd-rdzv-dynamic``), on a real etcd: the state torch 2.13 writes is read by
the restricted decoder, members with their ranks, a node beyond ``max_nodes`` as a
spare, a late node below ``max_nodes`` as waiting.

The nodes are torch handlers in threads of this process (each its own node to torch:
the pid and a per-handler local id name it), each with its own client. Their addresses
are distinct loopback addresses (127.0.0.0/8): torch connects to rank 0's for its
TCPStore.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousParameters
from etcd_rdzv.runs.status import DYNAMIC, RunStatus, read_run
from etcd_rdzv.testing import EtcdRdzvCli, wait_until

pytestmark = pytest.mark.torch

Params = Callable[..., RendezvousParameters]
TIMEOUT = 90.0  # seconds for a join or a CLI call; they normally take a few


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as executor:
        yield executor


def _handlers(params: RendezvousParameters, addrs: list[str]) -> list[Any]:
    """A torch dynamic handler per address (torch names the node after it)."""
    from etcd_rdzv.torch import create_dynamic_handler

    handlers = []
    for addr in addrs:
        params.local_addr = addr
        handlers.append(create_dynamic_handler(params))
    return handlers


def _status_json(cli: EtcdRdzvCli, params: RendezvousParameters, run_id: str) -> dict[str, Any]:
    """``etcd-rdzv status --json`` of the run, which must not need torch."""
    key_prefix = params.config["key_prefix"]
    done = cli.run(
        *("status", "--run-id", run_id, "--json"),
        *("--endpoint", params.endpoint, "--key-prefix", key_prefix),
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    assert "torch" not in done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def _close_and_release(handlers: list[Any], late: Future[Any]) -> None:
    """Close the run, so the late node's join ends."""
    from torch.distributed.elastic.rendezvous import api

    handlers[0].set_closed()
    # A waiting node gets a closed error, a spare a graceful exit.
    with pytest.raises((api.RendezvousClosedError, api.RendezvousGracefulExitError)):
        late.result(TIMEOUT)
    for handler in handlers:
        handler.shutdown()


def test_status_shows_torch_members_ranks_and_a_spare(
    etcd_rdzv_cli: EtcdRdzvCli, torch_required: None, etcd_params: Params, pool: ThreadPoolExecutor
) -> None:
    params = etcd_params(
        "dyn-spare",
        backend="etcd-rdzv-dynamic",
        min_nodes=2,
        max_nodes=2,
        join_timeout=60,
        last_call_timeout=1,
    )
    addrs = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    handlers = _handlers(params, addrs)
    infos = [f.result(TIMEOUT) for f in [pool.submit(h.next_rendezvous) for h in handlers[:2]]]
    # (rank, address) of the two members, as torch told each of them.
    ranked = sorted((info.rank, addr) for addr, info in zip(addrs, infos, strict=False))
    assert [rank for rank, _ in ranked] == [0, 1]
    late = pool.submit(handlers[2].next_rendezvous)
    try:
        kv = etcd_rdzv.create_client(params)
        try:
            seen: list[RunStatus] = []

            def shows_the_spare() -> bool:
                seen.append(read_run(kv, params.config["key_prefix"], "dyn-spare"))
                return any(w.spare for w in seen[-1].waiting)

            wait_until(shows_the_spare, TIMEOUT, what="status shows the spare", interval=0.2)
            status = seen[-1]
        finally:
            kv.close()
        assert status.handler == DYNAMIC and status.problems == ()
        assert status.completed_round == status.round
        assert [(m.rank, m.addr) for m in status.members] == ranked
        assert [(w.addr, w.spare, w.round) for w in status.waiting] == [
            ("127.0.0.3", True, status.round + 1)
        ]
        assert all(m.last_heartbeat is not None for m in status.members)

        data = _status_json(etcd_rdzv_cli, params, "dyn-spare")
        assert data["handler"] == "dynamic"
        assert [(m["rank"], m["addr"]) for m in data["members"]] == ranked
        # torch's node names: <addr>_<pid>_<local id>, this process's pid.
        assert [m["node"].rsplit("_", 2)[:2] for m in data["members"]] == [
            [addr, str(os.getpid())] for _, addr in ranked
        ]
        assert [(w["addr"], w["spare"]) for w in data["waiting"]] == [("127.0.0.3", True)]
    finally:
        _close_and_release(handlers, late)


def test_status_shows_a_late_node_below_max_as_waiting(
    etcd_rdzv_cli: EtcdRdzvCli, torch_required: None, etcd_params: Params, pool: ThreadPoolExecutor
) -> None:
    params = etcd_params(
        "dyn-wait",
        backend="etcd-rdzv-dynamic",
        min_nodes=2,
        max_nodes=3,
        join_timeout=60,
        last_call_timeout=1,
    )
    handlers = _handlers(params, ["127.0.1.1", "127.0.1.2", "127.0.1.3"])
    for future in [pool.submit(h.next_rendezvous) for h in handlers[:2]]:
        assert future.result(TIMEOUT).world_size == 2
    late = pool.submit(handlers[2].next_rendezvous)
    try:
        shown: list[dict[str, Any]] = []

        def shows_a_waiting_node() -> bool:
            shown.append(_status_json(etcd_rdzv_cli, params, "dyn-wait"))
            return bool(shown[-1]["waiting"])

        wait_until(shows_a_waiting_node, TIMEOUT, what="a waiting node", interval=0.2)
        data = shown[-1]
        assert sorted(m["rank"] for m in data["members"]) == [0, 1]
        assert [(w["addr"], w["spare"]) for w in data["waiting"]] == [("127.0.1.3", False)]
        assert data["waiting"][0]["round"] == data["round"] + 1
        # The node that waits is what torch counts as waiting (the scale-up signal;
        # torch caches its state for a second).
        wait_until(
            lambda: handlers[0].num_nodes_waiting() == 1,
            TIMEOUT,
            what="torch counts the waiting node",
            interval=0.2,
        )
    finally:
        _close_and_release(handlers, late)
