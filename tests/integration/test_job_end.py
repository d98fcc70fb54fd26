"""A job's end: a member that leaves after the run is closed makes no other restart.

Nodes of one job finish at different times. Under torchrun the first node's agent
calls ``shutdown()``, which closes the run and deletes its key; the others' workers
still run. Their ``num_nodes_waiting()`` must stay 0 (a positive count makes torch's
agent stop the healthy workers and re-join, and the join is refused: the run is
closed), while a member that dies in an open run still counts (see test_handler.py).

Handlers run as threads of this process, each with its own client, on v2 and v3.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

import etcd_rdzv
from etcd_rdzv import EtcdRendezvousHandler, RendezvousParameters, _keys
from etcd_rdzv.errors import RendezvousClosedError
from etcd_rdzv.testing import wait_until

Params = Callable[..., RendezvousParameters]

HOLD = 3.0  # seconds the survivor is watched after its watcher saw the run closed


def _pair(
    params: RendezvousParameters, pool: ThreadPoolExecutor, handlers: list[EtcdRendezvousHandler]
) -> tuple[EtcdRendezvousHandler, EtcdRendezvousHandler]:
    first, second = etcd_rdzv.create_handler(params), etcd_rdzv.create_handler(params)
    handlers.append(second)  # the first is shut down by the test
    results = list(pool.map(lambda h: h.next_rendezvous(), (first, second)))
    assert sorted((r.rank, r.world_size) for r in results) == [(0, 2), (1, 2)]
    return first, second


def _seen_closed(handler: EtcdRendezvousHandler) -> bool:
    watch = handler._session.watch  # the member watcher of the completed round
    return watch is not None and watch.closed


def test_a_member_that_finishes_first_makes_no_other_restart(
    etcd_api_params: Params,
    handlers: list[EtcdRendezvousHandler],
    pool: ThreadPoolExecutor,
) -> None:
    params = etcd_api_params(
        "drift", min_nodes=2, max_nodes=2, keep_alive_interval=1, join_timeout=30
    )
    first, second = _pair(params, pool, handlers)
    assert second.num_nodes_waiting() == 0

    first.close_on_shutdown = True  # as torchrun's entry point builds it
    assert first.shutdown()
    assert second.is_closed()

    # Every reading until the survivor's watcher saw the closure (and the key's
    # deletion after it), and for a while after, is 0.
    readings: list[int] = []

    def seen() -> bool:
        readings.append(second.num_nodes_waiting())
        return _seen_closed(second)

    wait_until(seen, 15, what="the survivor's watcher to see the run closed", interval=0.02)
    end = time.monotonic() + HOLD
    while time.monotonic() < end:
        readings.append(second.num_nodes_waiting())
        time.sleep(0.02)
    assert set(readings) == {0}, f"the survivor would restart: num_nodes_waiting {readings}"

    # Its own next join is refused, as for any node once the run is closed.
    with pytest.raises(RendezvousClosedError):
        second.next_rendezvous()


def test_a_member_that_leaves_an_open_run_still_counts(
    etcd_api_params: Params,
    handlers: list[EtcdRendezvousHandler],
    pool: ThreadPoolExecutor,
) -> None:
    """The other side: without the closure, the same leave is a member gone."""
    params = etcd_api_params(
        "leave-open", min_nodes=2, max_nodes=2, keep_alive_interval=1, join_timeout=30
    )
    first, second = _pair(params, pool, handlers)
    assert first.shutdown()  # close_on_shutdown is off: the run stays open
    wait_until(
        lambda: second.num_nodes_waiting() == 1, 15, what="the survivor to count the member gone"
    )
    assert not _seen_closed(second)


def test_a_member_that_finished_stays_finished_when_the_closed_marker_goes(
    etcd_api_params: Params,
    handlers: list[EtcdRendezvousHandler],
    pool: ThreadPoolExecutor,
    etcd_key_prefix: str,
) -> None:
    """The run's closed marker deleted later (expired, or deleted for a new job under
    the same run id): the member that left after the closure still finished, it is
    not counted gone."""
    params = etcd_api_params(
        "drift-reopened", min_nodes=2, max_nodes=2, keep_alive_interval=1, join_timeout=30
    )
    first, second = _pair(params, pool, handlers)
    first.close_on_shutdown = True
    assert first.shutdown()
    wait_until(lambda: _seen_closed(second), 15, what="the survivor's watcher to see it closed")
    kv = etcd_rdzv.create_client(params)
    try:
        kv.delete(_keys.closed_key(etcd_key_prefix, "drift-reopened"))
    finally:
        kv.close()
    wait_until(lambda: not _seen_closed(second), 15, what="the survivor's watcher to see it open")
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        assert second.num_nodes_waiting() == 0
        time.sleep(0.02)
