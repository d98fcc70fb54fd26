"""The static rendezvous (``etcd-rdzv-static``) on a real etcd, v2 and v3.

Each node brings its rank; the world is ``max_nodes``. Handlers run as threads of this
process, each with its own client; a killed node is simulated by stopping its threads
without deleting its keys (as SIGKILL leaves them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

import etcd_rdzv
from etcd_rdzv import (
    EtcdRendezvousHandler,
    RendezvousClosedError,
    RendezvousError,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from etcd_rdzv.testing import wait_until

from .test_elastic import HANG, _die, _results

Params = Callable[..., RendezvousParameters]


@pytest.fixture
def static(etcd_api_params: Params) -> Iterator[Callable[..., EtcdRendezvousHandler]]:
    made: list[EtcdRendezvousHandler] = []

    def make(run_id: str, rank: int, **config: object) -> EtcdRendezvousHandler:
        config.setdefault("keep_alive_interval", 1)
        params = etcd_api_params(run_id, backend="etcd-rdzv-static", rank=rank, **config)
        h = etcd_rdzv.create_handler(params)
        made.append(h)
        return h

    yield make
    for h in made:
        h.shutdown()


def test_ranks_are_the_given_ones_whatever_the_arrival_order(
    static: Callable[..., EtcdRendezvousHandler], pool: ThreadPoolExecutor
) -> None:
    nodes = [static("order", rank, min_nodes=3, max_nodes=3) for rank in (2, 0, 1)]
    assert nodes[0].get_backend() == "etcd-rdzv-static"
    futures = []
    for h in nodes:  # rank 2 first, then 0, then 1
        futures.append(pool.submit(h.next_rendezvous))
        time.sleep(0.2)
    results = _results(futures)
    assert [r.rank for r in results] == [2, 0, 1]
    assert {r.world_size for r in results} == {3}
    assert results[0].members == tuple(nodes[i].node_id for i in (1, 2, 0))
    # the store is shared by the round's members
    results[0].store.set("k", b"from rank 2")
    assert results[1].store.get("k") == b"from rank 2"


def test_a_rank_claimed_twice_fails_every_claimant_naming_the_rank(
    static: Callable[..., EtcdRendezvousHandler], pool: ThreadPoolExecutor
) -> None:
    a, b = (
        static("twice", 0, max_nodes=2, min_nodes=2),
        static("twice", 0, max_nodes=2, min_nodes=2),
    )
    started = time.monotonic()
    futures = [pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)]
    for f in futures:
        with pytest.raises(RendezvousError, match="Rank 0 is claimed by more than one") as info:
            f.result(timeout=HANG)
        assert a.node_id in str(info.value) and b.node_id in str(info.value)
    took = time.monotonic() - started
    # confirmed after one node TTL (1 s x 3) and a second of slack: not a join_timeout
    assert took < 20, f"the conflict took {took:.1f}s"
    # the run is not stuck: with the ranks fixed, the next attempt completes
    a2, b2 = (
        static("twice", 0, max_nodes=2, min_nodes=2),
        static("twice", 1, max_nodes=2, min_nodes=2),
    )
    results = _results([pool.submit(a2.next_rendezvous), pool.submit(b2.next_rendezvous)])
    assert [r.rank for r in results] == [0, 1]


def test_a_missing_rank_times_out_naming_it(
    static: Callable[..., EtcdRendezvousHandler], pool: ThreadPoolExecutor
) -> None:
    nodes = [static("missing", r, min_nodes=4, max_nodes=4, join_timeout=3) for r in (0, 2)]
    futures = [pool.submit(h.next_rendezvous) for h in nodes]
    for rank, h, f in zip((0, 2), nodes, futures, strict=True):
        with pytest.raises(RendezvousTimeoutError, match="static round 1 did not complete") as info:
            f.result(timeout=HANG)
        # Each names itself present and ranks 1 and 3 missing (the other claimant may
        # have left already: both time out at about the same moment).
        text = str(info.value)
        assert f"{rank} (node '{h.node_id}'" in text
        missing = text.rsplit("missing: ", 1)[1].rstrip(".").split(", ")
        assert {"1", "3"} <= set(missing) and str(rank) not in missing


def test_one_node_restarting_takes_the_whole_group_into_the_next_round(
    static: Callable[..., EtcdRendezvousHandler], pool: ThreadPoolExecutor
) -> None:
    a, b, c = (static("restart", r, min_nodes=3, max_nodes=3) for r in range(3))
    first = _results([pool.submit(h.next_rendezvous) for h in (a, b, c)])
    assert [r.round for r in first] == [first[0].round] * 3
    assert (a.num_nodes_waiting(), c.num_nodes_waiting()) == (0, 0)
    again_b = pool.submit(b.next_rendezvous)  # b's workers failed: its agent restarts
    wait_until(
        lambda: a.num_nodes_waiting() and c.num_nodes_waiting(),
        10,
        what="a and c see b leave",
        interval=0.02,
    )
    second = _results([pool.submit(a.next_rendezvous), again_b, pool.submit(c.next_rendezvous)])
    assert [r.rank for r in second] == [0, 1, 2]
    assert {r.round for r in second} == {first[0].round + 1}


def test_a_killed_node_restarted_with_its_rank_rejoins_once_its_old_key_expires(
    static: Callable[..., EtcdRendezvousHandler],
    pool: ThreadPoolExecutor,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="etcd_rdzv")
    a, b = (
        static("crash", 0, min_nodes=2, max_nodes=2),
        static("crash", 1, min_nodes=2, max_nodes=2),
    )
    _results([pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)])
    _die(b)  # SIGKILL: b's key stays for its TTL (3 s)
    b_again = static("crash", 1, min_nodes=2, max_nodes=2)  # its new process, the same rank
    started = time.monotonic()
    rejoin = pool.submit(b_again.next_rendezvous)
    wait_until(lambda: a.num_nodes_waiting() > 0, 10, what="a sees b gone", interval=0.02)
    second = _results([pool.submit(a.next_rendezvous), rejoin])
    took = time.monotonic() - started
    assert [r.rank for r in second] == [0, 1]
    assert second[0].members == (a.node_id, b_again.node_id)
    assert took < 15, f"the rejoin took {took:.1f}s"
    assert "a member that died leaves when its key expires" in caplog.text


def test_set_closed_ends_the_run_for_everyone(
    static: Callable[..., EtcdRendezvousHandler], pool: ThreadPoolExecutor
) -> None:
    a, b = (
        static("close", 0, min_nodes=2, max_nodes=2),
        static("close", 1, min_nodes=2, max_nodes=2),
    )
    _results([pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)])
    a.set_closed()
    assert b.is_closed()
    with pytest.raises(RendezvousClosedError):
        b.next_rendezvous()
    late = static("close", 1, min_nodes=2, max_nodes=2)
    with pytest.raises(RendezvousClosedError):
        late.next_rendezvous()


def test_a_bad_rank_fails_before_any_network_call(etcd_api_params: Params) -> None:
    params = etcd_api_params("bad", backend="etcd-rdzv-static", rank=2, min_nodes=2, max_nodes=2)
    params.endpoint = "127.0.0.1:9"  # nothing listens: a network call would fail differently
    with pytest.raises(ValueError, match=r"option rank must be an integer in 0\.\.1.*got 2"):
        etcd_rdzv.create_handler(params)
