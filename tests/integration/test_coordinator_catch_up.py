"""On v2 a coordinator that fell behind on the run's changes (a burst of joins) still
lists the run, now that behind means changes etcd held, several in a row, rather than
etcd's index far ahead (the rule itself: tests/unit/test_coordinator_catch_up.py).

The coordinator reads the run's changes one long poll at a time. Here writes outside
the run move etcd's index, as heartbeats do, the coordinator's polls go late (as on a
loaded machine), the other nodes join at once, and the listings of the run that the
nodes' clients send are counted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import etcd_rdzv
from etcd_rdzv import EtcdRendezvousHandler, RendezvousParameters, _keys

Params = Callable[..., RendezvousParameters]
HANG = 60.0  # a generous bound that only catches hangs
BURST = 16  # nodes in the burst


def _count_listings(
    h: EtcdRendezvousHandler, run_dir: str, listings: list[str], poll_after: float
) -> None:
    """Record each listing of ``run_dir``'s tree that ``h``'s client sends; send each
    of its long polls of that tree ``poll_after`` seconds late."""
    kv: Any = h._kv
    list_tree, watch = kv.list_tree, kv.watch
    lock = threading.Lock()

    def counted(prefix: str) -> Any:
        if prefix == run_dir:
            with lock:
                listings.append(h.node_id)
        return list_tree(prefix)

    def late(key: str, *args: Any, **kwargs: Any) -> Any:
        if key == run_dir:
            time.sleep(poll_after)
        return watch(key, *args, **kwargs)

    kv.list_tree, kv.watch = counted, late


def _round(
    etcd_params: Params,
    etcd_key_prefix: str,
    handlers: list[EtcdRendezvousHandler],
    nodes: int,
    poll_after: float,
) -> list[str]:
    """One round of ``nodes`` v2 nodes, the first alone first, the others all at once
    after it, while writes outside the run move etcd's index (and the coordinator's
    long polls go ``poll_after`` seconds late): the listings of the run the nodes
    sent."""
    params = etcd_params(
        "catch-up", api="v2", min_nodes=nodes, max_nodes=nodes, join_timeout=int(HANG)
    )
    run_dir = _keys.rdzv_dir(etcd_key_prefix, params.run_id)
    made = [etcd_rdzv.create_handler(params) for _ in range(nodes)]
    handlers.extend(made)
    listings: list[str] = []
    for h in made:
        _count_listings(h, run_dir, listings, poll_after)
    noise = etcd_rdzv.create_client(etcd_params("noise", api="v2"))
    stop = threading.Event()

    def move_the_index() -> None:
        writes = 0
        while not stop.wait(0.01):  # 100 a second, as 450 nodes' heartbeats
            noise.put(f"{etcd_key_prefix}/elsewhere", str(writes), None)
            writes += 1

    mover = threading.Thread(target=move_the_index, daemon=True)
    mover.start()
    try:
        with ThreadPoolExecutor(max_workers=nodes) as pool:
            joins: list[Future[Any]] = [pool.submit(made[0].next_rendezvous)]
            deadline = time.monotonic() + HANG
            while not listings and time.monotonic() < deadline:  # it coordinates
                time.sleep(0.05)
            joins += [pool.submit(h.next_rendezvous) for h in made[1:]]
            ranks = sorted(f.result(timeout=HANG).rank for f in joins)
    finally:
        stop.set()
        mover.join(HANG)
        noise.close()
    assert ranks == list(range(nodes))
    return listings


def test_a_burst_of_joins_still_makes_the_coordinator_list_the_run(
    etcd_params: Params, etcd_key_prefix: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    # The coordinator polls 0.2 s late, so the joins come faster than one poll each.
    listings = _round(etcd_params, etcd_key_prefix, handlers, BURST, 0.2)
    # The first listing, and at least one more: events that etcd already held.
    assert len(listings) >= 2, listings
    assert len(set(listings)) == 1, listings  # the coordinator's alone
