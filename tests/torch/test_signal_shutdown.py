"""A torchrun agent that dies of a signal leaves the run without closing it.

torch's launcher never calls the handler's ``shutdown()`` when its agent dies of a
signal; torch 2.6 and 2.7 call it anyway, from the agent's own ``_shutdown()``, while
the agent handles the ``SignalException`` that torch's signal handler raised. Our
handler then leaves without closing the run, on every torch release; any other
``shutdown()`` under torchrun closes it, as torch's handlers do. The handlers here are
built by the ``etcd-rdzv`` entry point, as torchrun builds them, and shut down as torch
2.6's agent does, in threads of this process (the torchrun run is
``test_torchrun_spares.py``'s SIGTERM test).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import entry_points
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv.testing import wait_until

pytestmark = pytest.mark.torch

Params = Callable[..., etcd_rdzv.RendezvousParameters]
TIMEOUT = 90.0  # seconds for a join; they normally take a few
# A 15 s key TTL (5 s x 3): a node seen gone within a few seconds deleted its key.
CONF = {
    "join_timeout": 60,
    "last_call_timeout": 1,
    "keep_alive_interval": 5,
    "keep_alive_max_attempt": 3,
}


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as executor:
        yield executor


def _torchrun_handler(params: etcd_rdzv.RendezvousParameters) -> Any:
    """The handler torchrun builds for ``--rdzv-backend=etcd-rdzv``."""
    (point,) = entry_points(group="torchrun.handlers", name="etcd-rdzv")
    return point.load()()(params)


def test_shutdown_while_the_agent_handles_a_signal_leaves_the_run_open(
    torch_required: None, etcd_params: Params, pool: ThreadPoolExecutor
) -> None:
    from torch.distributed.elastic.multiprocessing import SignalException

    params = etcd_params("signal-leave", min_nodes=2, max_nodes=3, **CONF)
    a, b = _torchrun_handler(params), _torchrun_handler(params)
    handlers = [a, b]
    try:
        joins = [pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)]
        assert [j.result(TIMEOUT).world_size for j in joins] == [2, 2]
        assert a.num_nodes_waiting() == 0

        left = time.monotonic()
        try:  # as torch 2.6's agent.run(): except SignalException: self._shutdown()
            raise SignalException("Process 1 got signal: 15", signal.SIGTERM)
        except SignalException:
            assert b.shutdown()
        assert not a.is_closed(), "the dying agent closed the run for everyone"
        wait_until(lambda: a.num_nodes_waiting() > 0, timeout=30, what="b seen gone by a")
        seen_gone = time.monotonic() - left
        assert seen_gone < 10, f"b seen gone after {seen_gone:.1f}s: its key was left to expire"

        # The run goes on: a new node and the survivor complete the next round.
        c = _torchrun_handler(params)
        handlers.append(c)
        joins = [pool.submit(a.next_rendezvous), pool.submit(c.next_rendezvous)]
        assert sorted(j.result(TIMEOUT).rank for j in joins) == [0, 1]
    finally:
        for handler in handlers:
            handler.shutdown()


@pytest.mark.parametrize("in_flight", [None, RuntimeError("the workers failed")])
def test_any_other_shutdown_under_torchrun_closes_the_run(
    torch_required: None, etcd_params: Params, in_flight: Exception | None
) -> None:
    params = etcd_params("other-shutdown", min_nodes=2, max_nodes=2, **CONF)
    done, other = _torchrun_handler(params), _torchrun_handler(params)
    try:
        if in_flight is None:
            assert done.shutdown()
        else:
            try:
                raise in_flight
            except RuntimeError:
                assert done.shutdown()
        assert other.is_closed()
    finally:
        other.shutdown()
