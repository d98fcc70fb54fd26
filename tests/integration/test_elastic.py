"""Elastic operation on a real etcd: spares, leaving, stray keys, a frozen etcd.

Handlers run as threads of this process (each its own client) unless a test needs a
process to exit; rendezvous with every node a process (``etcd_rdzv.testing.Fleet``)
are in ``test_handler.py``, and under churn in ``tests/faults/test_churn.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
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
from etcd_rdzv.runs.status import read_run
from etcd_rdzv.testing import EtcdServer, wait_until

Params = Callable[..., RendezvousParameters]
HANG = 60.0  # a generous bound that only catches hangs


def _handler(made: list[EtcdRendezvousHandler], params: RendezvousParameters) -> Any:
    h = etcd_rdzv.create_handler(params)
    made.append(h)
    return h


def _results(futures: list[Future[RendezvousResult]]) -> list[RendezvousResult]:
    return [f.result(timeout=HANG) for f in futures]


def _die(h: EtcdRendezvousHandler) -> None:
    """As if the node's process was SIGKILLed: its heartbeats stop, its key stays until
    its TTL runs out."""
    h._session.vanish()  # nothing is deleted or revoked on the way out


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
    wait_until(lambda: a.num_nodes_waiting() > 0, 10, what="a sees b gone", interval=0.02)
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
        wait_until(
            lambda: a.num_nodes_waiting() > 0,
            10,
            what="a sees b dead despite the stray keys",
            interval=0.02,
        )
        status = read_run(kv, etcd_key_prefix, "stray")
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
        took = wait_until(
            lambda: a.num_nodes_waiting() > 0, 14, what="a sees the node gone", interval=0.02
        )
        assert took < 2.0, f"the exit was seen after {took:.1f}s (TTL 15 s)"
    finally:
        proc.kill()
        proc.wait()


FREEZE_JOIN_TIMEOUT = 8  # the join that must give up while etcd is frozen
FREEZE_STORE_TIMEOUT = 2  # the store read that must give up while etcd is frozen
SLACK = 3.0  # beyond a bound: scheduling on a busy machine, not a hang


@pytest.mark.etcd_variants("v2", "v3")
def test_with_etcd_frozen_calls_raise_within_their_bounds_and_work_after_the_thaw(
    etcd_api: str, etcd_key_prefix: str
) -> None:
    """Only a frozen etcd explains each outcome: a read of a key written before the
    freeze, and a join of a one-node run, both succeed at once on a healthy etcd; here
    they must fail within their bounds. A second one-node join, started in the freeze,
    must still be waiting at the thaw and complete after it."""
    with EtcdServer("frozen", enable_v2=etcd_api == "v2") as server:

        def params(run_id: str, join_timeout: int) -> RendezvousParameters:
            made = server.params(
                run_id, api=etcd_api, key_prefix=etcd_key_prefix, read_timeout=30,
                join_timeout=join_timeout, min_nodes=1, max_nodes=1,
            )  # fmt: skip
            return RendezvousParameters("etcd-rdzv", made.endpoint, run_id, 1, 1, **made.config)

        gives_up = etcd_rdzv.create_handler(params("frozen-a", FREEZE_JOIN_TIMEOUT))
        waits = etcd_rdzv.create_handler(params("frozen-b", int(HANG)))
        _backend, store = etcd_rdzv.create_backend(params("frozen-store", int(HANG)))
        store.set("before", b"written before the freeze")
        assert store.get("before") == b"written before the freeze"  # healthy: at once
        store.set_timeout(FREEZE_STORE_TIMEOUT)
        failed: dict[str, tuple[type[BaseException], float]] = {}
        returned: dict[str, tuple[RendezvousResult, float]] = {}

        def timed(name: str, fn: Callable[[], Any]) -> threading.Thread:
            def run() -> None:
                started = time.monotonic()
                try:
                    result = fn()
                except Exception as exc:
                    failed[name] = (type(exc), time.monotonic() - started)
                else:
                    returned[name] = (result, time.monotonic())

            thread = threading.Thread(target=run, name=f"frozen-{name}", daemon=True)
            thread.start()
            return thread

        try:
            server.pause()
            bounded = [
                timed("join", gives_up.next_rendezvous),
                timed("store.get", lambda: store.get("before")),
            ]
            joining = timed("join after the thaw", waits.next_rendezvous)
            for thread in bounded:
                thread.join(HANG)
            # Still frozen here: the bounded calls ended, the other join still waits.
            assert joining.is_alive(), f"a join returned with etcd frozen: {returned}"
            thawed = time.monotonic()
        finally:
            server.resume()
        try:
            joining.join(HANG)
        finally:
            gives_up.shutdown()
            waits.shutdown()

        kind, took = failed.get("join", (type(None), 0.0))
        assert issubclass(kind, (RendezvousTimeoutError, RendezvousConnectionError)), (
            f"the join of a one-node run ended with {kind.__name__} ({returned.get('join')})"
        )
        assert took < FREEZE_JOIN_TIMEOUT + SLACK, f"the join took {took:.1f}s (join_timeout 8)"
        kind, took = failed.get("store.get", (type(None), 0.0))
        assert issubclass(kind, StoreTimeoutError), (
            f"reading a key written before the freeze ended with {kind.__name__}"
        )
        assert took < FREEZE_STORE_TIMEOUT + SLACK, f"store.get took {took:.1f}s (timeout 2)"
        assert "join after the thaw" not in failed, failed
        result, at = returned["join after the thaw"]
        assert (result.rank, result.world_size) == (0, 1)
        assert thawed <= at < thawed + 15.0, f"the join returned {at - thawed:.1f}s after the thaw"
