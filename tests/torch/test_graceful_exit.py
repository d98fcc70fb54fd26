"""A spare whose job ended: what ``next_rendezvous()`` raises, in-process.

Built by hand, the torch flavour raises ``RendezvousGracefulExitError`` (torch's type);
as the ``torchrun`` entry points build it (:func:`etcd_rdzv.torch.exit_gracefully`),
``GracefulExit``: a ``SystemExit`` with code 0, which torch's agent and launcher let
through and torchrun's ``main`` turns into exit status 0 (the torchrun runs are in
``test_torchrun_spares.py``). A node that comes after the run closed still gets
``RendezvousClosedError``, a failure. The nodes are handlers in threads of this process.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

import etcd_rdzv

pytestmark = pytest.mark.torch

Params = Callable[..., etcd_rdzv.RendezvousParameters]
TIMEOUT = 90.0  # seconds for a join; they normally take a few
CONF = {"join_timeout": 60, "last_call_timeout": 1, "keep_alive_interval": 1}


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as executor:
        yield executor


def _waiting(pool: ThreadPoolExecutor, handler: Any) -> Future[Any]:
    """``handler``'s join, which must still wait a moment later (a spare)."""
    joined = pool.submit(handler.next_rendezvous)
    with pytest.raises(TimeoutError):
        joined.result(2.0)
    return joined


def test_graceful_exit_is_a_system_exit_with_code_0(torch_required: None) -> None:
    from etcd_rdzv.torch import GracefulExit

    exc = GracefulExit("the job ended without node n1")
    assert isinstance(exc, SystemExit)
    assert not isinstance(exc, Exception)  # torch's `except Exception` lets it through
    assert (exc.code, str(exc)) == (0, "the job ended without node n1")
    again = pickle.loads(pickle.dumps(exc))
    assert (type(again), again.code, str(again)) == (GracefulExit, 0, str(exc))


def test_exit_gracefully_refuses_a_foreign_handler(torch_required: None) -> None:
    from etcd_rdzv.torch import exit_gracefully

    with pytest.raises(TypeError, match="one of our handlers"):
        exit_gracefully(object())  # type: ignore[arg-type]


def test_native_spares_exit_by_their_flavour_and_a_late_node_fails(
    torch_required: None, etcd_params: Params, pool: ThreadPoolExecutor
) -> None:
    from torch.distributed.elastic.rendezvous import api

    from etcd_rdzv.torch import GracefulExit, create_native_handler, exit_gracefully

    params = etcd_params("native-spares", min_nodes=2, max_nodes=2, **CONF)
    handlers = [create_native_handler(params) for _ in range(4)]
    a, b, by_hand, as_torchrun = handlers
    assert exit_gracefully(as_torchrun) is as_torchrun
    try:
        for joined in [pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)]:
            assert joined.result(TIMEOUT).world_size == 2
        spares = [_waiting(pool, by_hand), _waiting(pool, as_torchrun)]
        a.set_closed()

        with pytest.raises(api.RendezvousGracefulExitError, match="waited to join"):
            spares[0].result(TIMEOUT)
        with pytest.raises(GracefulExit, match="waited to join") as exited:
            spares[1].result(TIMEOUT)
        assert exited.value.code == 0
        assert isinstance(exited.value.__cause__, api.RendezvousGracefulExitError)

        # A node that comes after the run closed is refused: a failure, as before.
        late = exit_gracefully(create_native_handler(params))
        handlers.append(late)
        with pytest.raises(api.RendezvousClosedError):
            late.next_rendezvous()
    finally:
        for handler in handlers:
            handler.shutdown()


def test_a_spare_of_torchs_dynamic_handler_exits_gracefully(
    torch_required: None, etcd_params: Params, pool: ThreadPoolExecutor
) -> None:
    from torch.distributed.elastic.rendezvous import api
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

    from etcd_rdzv.torch import GracefulExit, create_dynamic_handler, exit_gracefully

    # torch's keep-alive defaults (a node is taken for dead 15 s after its last beat):
    # with CONF's 1 s (3 s), on a loaded machine (load average 20 on 2 cores) torch
    # took the members for dead at times and moved its spare to the wait list, which
    # gets RendezvousClosedError at the close (torch's decision, not the one tested).
    params = etcd_params(
        "dyn-spare",
        backend="etcd-rdzv-dynamic",
        min_nodes=2,
        max_nodes=2,
        join_timeout=60,
        last_call_timeout=1,
    )
    handlers = []
    for addr in ["127.0.0.1", "127.0.0.2", "127.0.0.3"]:  # torch names nodes by address
        params.local_addr = addr
        handlers.append(exit_gracefully(create_dynamic_handler(params)))
    a, b, spare = handlers
    assert isinstance(spare, DynamicRendezvousHandler)
    assert exit_gracefully(spare) is spare  # twice is fine
    try:
        for joined in [pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)]:
            assert joined.result(TIMEOUT).world_size == 2
        waiting = _waiting(pool, spare)
        a.set_closed()
        with pytest.raises(GracefulExit, match="is closed") as exited:
            waiting.result(TIMEOUT)
        assert exited.value.code == 0
        assert isinstance(exited.value.__cause__, api.RendezvousGracefulExitError)
    finally:
        for handler in handlers:
            handler.shutdown()
