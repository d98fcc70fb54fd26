"""The events logger (``etcd_rdzv.events``) on a real etcd, both APIs: a member that
leaves is named once by each member that sees it go (with its address), a member that
re-joins is not taken for a loss, the next round names who is not back, and nothing
is said of members leaving a closed run (the job ended)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

import etcd_rdzv
from etcd_rdzv import EtcdRendezvousHandler, RendezvousParameters
from etcd_rdzv.rendezvous.listener import EVENTS

from ._waits import until

Params = Callable[..., RendezvousParameters]
HANG = 60.0  # seconds: only a hang takes this long


def _events(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == EVENTS]


_until = functools.partial(until, timeout=HANG, pause=0.05)


def test_members_gone_and_rounds_formed_are_named_once(
    etcd_api_params: Params,
    handlers: list[EtcdRendezvousHandler],
    pool: ThreadPoolExecutor,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=EVENTS)
    made = [
        etcd_rdzv.create_handler(
            etcd_api_params(
                "ev",
                backend="etcd-rdzv",
                min_nodes=2,
                max_nodes=3,
                last_call_timeout=1,
                keep_alive_interval=1,
                join_timeout=20,  # a failed test's pending join ends soon
                local_addr=f"10.9.0.{i}",
                host_id=f"gpu-{i}",
            )
        )
        for i in range(3)
    ]
    handlers.extend(made)
    a, b, c = made
    joins = [pool.submit(h.next_rendezvous) for h in made]
    assert sorted(j.result(timeout=HANG).world_size for j in joins) == [3, 3, 3]
    assert sum("round 1 formed: world size 3" in e for e in _events(caplog)) == 3

    c.shutdown()  # c leaves (the run stays open: no torchrun here)
    _until(
        "both members counting c gone", lambda: a.num_nodes_waiting() == b.num_nodes_waiting() == 1
    )
    _until(
        "each member naming c", lambda: len([e for e in _events(caplog) if " is gone" in e]) == 2
    )
    gone = [e for e in _events(caplog) if " is gone" in e]
    assert all(
        f"member {c.node_id!r} (host 'gpu-2', address '10.9.0.2') is gone" in e for e in gone
    ), gone

    # a re-joins first: b sees a's key leave round 1 for round 2, which is no loss.
    again = pool.submit(a.next_rendezvous)
    time.sleep(1.5)  # b's watcher sees a's move (one watch event) well within this
    assert not any(a.node_id in e and " is gone" in e for e in _events(caplog)), _events(caplog)
    assert b.next_rendezvous().world_size == 2
    assert again.result(timeout=HANG).world_size == 2
    formed = [e for e in _events(caplog) if "round 2 formed: world size 2" in e]
    assert len(formed) == 2, _events(caplog)
    assert all(
        f"not back from round 1: {c.node_id!r} (host 'gpu-2', address '10.9.0.2')" in e
        for e in formed
    )

    # The job ends: a closes the run and leaves; b hears of no loss.
    before = len(_events(caplog))
    a.set_closed()
    a.shutdown()
    time.sleep(1.5)
    assert not any(" is gone" in e for e in _events(caplog)[before:]), _events(caplog)
