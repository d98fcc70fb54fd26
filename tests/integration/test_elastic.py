"""Elastic operation on a real etcd: spares, leaving, stray keys, a frozen etcd.

Handlers run as threads of this process (each its own client) unless a test needs a
process to exit; the process fleets are in ``test_elastic_fleet.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import (
    EtcdRendezvousHandler,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousParameters,
    RendezvousResult,
    RendezvousTimeoutError,
    StoreTimeoutError,
    _keys,
)
from etcd_rdzv.testing import EtcdServer

Params = Callable[..., RendezvousParameters]
HANG = 60.0  # a generous bound that only catches hangs


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=8) as executor:
        yield executor


def _handler(made: list[EtcdRendezvousHandler], params: RendezvousParameters) -> Any:
    h = etcd_rdzv.create_handler(params)
    made.append(h)
    return h


def _results(futures: list[Future[RendezvousResult]]) -> list[RendezvousResult]:
    return [f.result(timeout=HANG) for f in futures]


def _until(what: str, condition: Callable[[], bool], timeout: float) -> float:
    """Seconds until ``condition()`` holds; fails after ``timeout``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - started


def _die(h: EtcdRendezvousHandler) -> None:
    """As if the node's process was SIGKILLed: its heartbeats stop, its key stays until
    its TTL runs out."""
    session = h._session
    session.stop_heart()
    if session.watch is not None:
        session.watch.stop()
    session.key = session.coord = None  # nothing is deleted on the way out


def test_a_spare_is_not_counted_and_takes_a_dead_members_place(
    etcd_api_params: Params, pool: ThreadPoolExecutor, handlers: list[EtcdRendezvousHandler]
) -> None:
    params = etcd_api_params(
        "spare", min_nodes=1, max_nodes=2, keep_alive_interval=1, last_call_timeout=30
    )
    a, b, spare = (_handler(handlers, params) for _ in range(3))
    first = _results([pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)])
    assert sorted(r.rank for r in first) == [0, 1]
    rank_a = first[0].rank
    waiting = pool.submit(spare.next_rendezvous)

    # The group is at max_nodes: for 10 s nobody is told to restart for the spare.
    end = time.monotonic() + 10
    while time.monotonic() < end:
        assert (a.num_nodes_waiting(), b.num_nodes_waiting()) == (0, 0)
        assert not waiting.done()
        time.sleep(0.1)

    _die(b)  # b is killed: its key expires after 3 s
    _until("a sees b gone", lambda: a.num_nodes_waiting() > 0, timeout=10)
    started = time.monotonic()
    again = pool.submit(a.next_rendezvous)
    second = _results([again, waiting])
    took = time.monotonic() - started
    # The spare completes the group at max_nodes at once: no 30 s last call.
    assert took < 15, f"the new round took {took:.1f}s (waited for the last call?)"
    assert [r.world_size for r in second] == [2, 2]
    assert second[0].rank == rank_a, "the survivor keeps its rank"
    assert second[0].members == second[1].members
    assert sorted(second[0].members) == sorted([a.node_id, spare.node_id])


def test_members_restarting_with_a_spare_waiting_keep_their_ranks(
    etcd_api_params: Params, pool: ThreadPoolExecutor, handlers: list[EtcdRendezvousHandler]
) -> None:
    params = etcd_api_params("restart", min_nodes=2, max_nodes=2, keep_alive_interval=1)
    spare = _handler(handlers, params)
    a, b = _handler(handlers, params), _handler(handlers, params)
    first = _results([pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)])
    # The spare joins the next round while the group runs (its key is older than the
    # members' keys in that round: arrival order alone would pick it).
    waiting = pool.submit(spare.next_rendezvous)
    time.sleep(1.0)
    ranks = {r.members[r.rank]: r.rank for r in first}
    for round_no in range(3):  # the workers failed: both agents restart, three times
        again = _results([pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)])
        assert {r.members[r.rank]: r.rank for r in again} == ranks, f"restart {round_no}"
        assert spare.node_id not in again[0].members
        assert not waiting.done()
        assert (a.num_nodes_waiting(), b.num_nodes_waiting()) == (0, 0)
    a.set_closed()
    with pytest.raises(RendezvousGracefulExitError, match="waited"):
        waiting.result(timeout=HANG)


def test_stray_keys_do_not_stop_the_detection_of_a_death(
    etcd_api_params: Params,
    etcd_key_prefix: str,
    pool: ThreadPoolExecutor,
    handlers: list[EtcdRendezvousHandler],
) -> None:
    params = etcd_api_params("stray", min_nodes=2, max_nodes=2, keep_alive_interval=1)
    a, b = _handler(handlers, params), _handler(handlers, params)
    _results([pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)])
    rdzv = _keys.rdzv_dir(etcd_key_prefix, "stray")
    kv = etcd_rdzv.create_client(params)
    try:
        for key in (
            f"{rdzv}/r\u00b2/nodes/x",
            f"{rdzv}/r{'9' * 5000}/nodes/x",
            f"{rdzv}/r7/nodes/x/y",
            f"{rdzv}/junk",
        ):
            kv.put(key, "not a record", 60)
        kv.put(f"{rdzv}/round", "\u00b2", 60)
        time.sleep(1.0)  # the watchers have seen them
        assert (a.num_nodes_waiting(), b.num_nodes_waiting()) == (0, 0)
        _die(b)
        _until("a sees b dead despite the stray keys", lambda: a.num_nodes_waiting() > 0, 10)
        status = etcd_rdzv.rendezvous.status.read_run(kv, etcd_key_prefix, "stray")
        assert status.completed_round == 1
    finally:
        kv.close()


def test_a_process_that_exits_is_seen_gone_at_once(
    etcd_api_params: Params, pool: ThreadPoolExecutor, handlers: list[EtcdRendezvousHandler]
) -> None:
    """keep_alive 5 s x 3: the key's TTL is 15 s; leaving must not wait for it."""
    params = etcd_api_params("leave", min_nodes=2, max_nodes=2, keep_alive_interval=5)
    code = f"""
import sys, etcd_rdzv
params = etcd_rdzv.RendezvousParameters(
    "etcd-rdzv", {params.endpoint!r}, "leave", 2, 2, **{params.config!r}
)
handler = etcd_rdzv.create_handler(params)
print("rank", handler.next_rendezvous().rank, flush=True)
sys.stdin.readline()
sys.exit(0)  # no shutdown(): the process just ends
"""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        a = _handler(handlers, params)
        _results([pool.submit(a.next_rendezvous)])
        assert proc.stdout is not None and proc.stdout.readline().startswith("rank")
        time.sleep(1.0)
        assert a.num_nodes_waiting() == 0
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=HANG) == 0
        took = _until("a sees the node gone", lambda: a.num_nodes_waiting() > 0, timeout=14)
        assert took < 2.0, f"the exit was seen after {took:.1f}s (TTL 15 s)"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.etcd_variants("v2", "v3")
def test_with_etcd_frozen_calls_raise_within_their_bounds(
    etcd_api: str, etcd_key_prefix: str
) -> None:
    with EtcdServer("frozen", enable_v2=etcd_api == "v2") as server:
        params = server.params(
            "frozen",
            api=etcd_api,
            key_prefix=etcd_key_prefix,
            read_timeout=30,
            join_timeout=8,
            min_nodes=2,
            max_nodes=2,
        )
        params = RendezvousParameters("etcd-rdzv", params.endpoint, "frozen", 2, 2, **params.config)
        handler = etcd_rdzv.create_handler(params)
        _backend, store = etcd_rdzv.create_backend(params)
        store.set_timeout(2)
        outcome: dict[str, tuple[type[BaseException], float]] = {}

        def timed(name: str, fn: Callable[[], Any]) -> threading.Thread:
            def run() -> None:
                started = time.monotonic()
                try:
                    fn()
                except Exception as exc:
                    outcome[name] = (type(exc), time.monotonic() - started)

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            return thread

        try:
            server.pause()
            threads = [
                timed("next_rendezvous", handler.next_rendezvous),
                timed("store.get", lambda: store.get("never")),
            ]
            for t in threads:
                t.join(HANG)
        finally:
            server.resume()
            handler.shutdown()
        kind, took = outcome["next_rendezvous"]
        assert issubclass(kind, (RendezvousTimeoutError, RendezvousConnectionError)), kind
        assert took < 8 + 3, f"next_rendezvous took {took:.1f}s with join_timeout=8"
        kind, took = outcome["store.get"]
        assert issubclass(kind, StoreTimeoutError), kind
        assert took < 2 + 3, f"store.get took {took:.1f}s with a 2 s timeout"
