"""The torch flavour of our handler records torch's rendezvous events.

Events are caught where torchelastic's own event handlers get them: the logging
handler registered for the ``dynamic_rendezvous`` destination in
``torch.distributed.elastic.events.handlers`` (a ``NullHandler`` unless a deployment
installs one; torch then builds its events logger with it on the first event). The
nodes are threads of this process, each with its own client, on a real etcd.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import etcd_rdzv

pytestmark = pytest.mark.torch

Params = Callable[..., etcd_rdzv.RendezvousParameters]

NAME = "torch.py:TorchEtcdRendezvousHandler."  # torch prefixes the recording file's name


@pytest.fixture
def rdzv_events(torch_required: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Every rendezvous event torch records while the test runs (``RdzvEvent`` s)."""
    from torch.distributed.elastic import events
    from torch.distributed.elastic.events import handlers
    from torch.distributed.elastic.events.api import RdzvEvent

    recorded: list[Any] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            recorded.append(RdzvEvent.deserialize(record.getMessage()))

    capture = Capture()
    monkeypatch.delenv("LOGLEVEL", raising=False)  # torch's events logger level
    monkeypatch.setitem(handlers._log_handlers, "dynamic_rendezvous", capture)
    # torch creates the destination's logger once, with the handler registered then.
    monkeypatch.delitem(events._events_loggers, "dynamic_rendezvous", raising=False)
    yield recorded
    logging.getLogger("torchelastic-events-dynamic_rendezvous").removeHandler(capture)


def _join_all(handlers: list[Any]) -> list[Any]:
    results: list[Any] = [None] * len(handlers)

    def join(i: int) -> None:
        try:
            results[i] = handlers[i].next_rendezvous()
        except BaseException as exc:  # reported below
            results[i] = exc

    threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a join did not return"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def test_a_round_close_and_a_refused_join_are_torch_events(
    rdzv_events: list[Any], etcd_params: Params
) -> None:
    from torch.distributed.elastic.events.api import NodeState
    from torch.distributed.elastic.rendezvous import api

    from etcd_rdzv.torch import create_native_handler

    run_id = f"events-{uuid.uuid4().hex[:8]}"
    params = etcd_params(
        run_id, min_nodes=2, max_nodes=2, backend="etcd-rdzv", join_timeout=30, last_call_timeout=1
    )
    nodes = [create_native_handler(params) for _ in range(2)]
    late = None
    try:
        infos = _join_all(nodes)
        nodes[0].set_closed()
        late = create_native_handler(params)
        with pytest.raises(api.RendezvousClosedError):
            late.next_rendezvous()
        for node in nodes:
            assert node.shutdown()
    finally:
        for node in nodes:
            node.shutdown()
        if late is not None:
            late.shutdown()

    events = [e for e in rdzv_events if e.run_id == run_id]
    assert len({n.local_id for n in [*nodes, late]}) == 3

    def of(node: Any, method: str, state: Any) -> list[Any]:
        return [
            e
            for e in events
            if e.local_id == node.local_id and e.name == NAME + method and e.node_state == state
        ]

    for node, info in zip(nodes, infos, strict=True):
        round_no = node.round
        joins = of(node, "next_rendezvous", NodeState.RUNNING)
        assert joins, events
        assert f"round {round_no}" in joins[-1].message and node.node_id in joins[-1].message
        done = of(node, "next_rendezvous", NodeState.SUCCEEDED)
        assert len(done) == 1, events
        assert done[0].rank == info.rank
        assert f"round {round_no}" in done[0].message
        assert f"rank {info.rank} of 2" in done[0].message
        # The join is recorded when its key is written, before the round completes.
        assert events.index(joins[0]) < events.index(done[0]), events
        for e in joins + done:
            assert (e.hostname, e.pid, e.master_endpoint) == (node.address, os.getpid(), "")
        assert len(of(node, "shutdown", NodeState.SUCCEEDED)) >= 1, events
    assert sorted(info.rank for info in infos) == [0, 1]

    closed = of(nodes[0], "set_closed", NodeState.SUCCEEDED)
    assert len(closed) == 1 and "closed" in closed[0].message, events
    assert of(nodes[1], "set_closed", NodeState.SUCCEEDED) == []

    refused = of(late, "next_rendezvous", NodeState.FAILED)
    assert len(refused) == 1, events
    assert "RendezvousClosedError" in refused[0].message
    assert "RendezvousClosedError" in refused[0].error_trace  # torch adds the traceback
    assert refused[0].rank is None


def test_a_failing_event_recorder_does_not_fail_the_rendezvous(
    rdzv_events: list[Any],
    etcd_params: Params,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import etcd_rdzv.torch

    def broken(**_: Any) -> None:
        raise RuntimeError("the event sink is down")

    monkeypatch.setattr(etcd_rdzv.torch, "construct_and_record_rdzv_event", broken)
    caplog.set_level(logging.WARNING, logger="etcd_rdzv.torch")
    handler = etcd_rdzv.torch.create_native_handler(
        etcd_params(f"events-broken-{uuid.uuid4().hex[:8]}", backend="etcd-rdzv", join_timeout=30)
    )
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        handler.set_closed()
    finally:
        assert handler.shutdown()
    assert "could not record a torch rendezvous event" in caplog.text
    assert "the event sink is down" in caplog.text


def test_a_failing_call_is_a_failed_event(rdzv_events: list[Any], etcd_params: Params) -> None:
    """As torch's handler does, a call that raises is recorded as FAILED under its name."""
    from torch.distributed.elastic.events.api import NodeState

    from etcd_rdzv.torch import create_native_handler

    run_id = f"events-failing-{uuid.uuid4().hex[:8]}"
    handler = create_native_handler(etcd_params(run_id, backend="etcd-rdzv", join_timeout=30))
    kv_get = handler._kv.get

    def unreachable(*_: Any, **__: Any) -> Any:
        raise etcd_rdzv.RendezvousConnectionError("etcd at http://nowhere:1 is unreachable")

    handler._kv.get = unreachable  # type: ignore[method-assign]
    try:
        with pytest.raises(etcd_rdzv.RendezvousConnectionError):
            handler.is_closed()
    finally:
        handler._kv.get = kv_get  # type: ignore[method-assign]
        handler.shutdown()
    failed = [e for e in rdzv_events if e.run_id == run_id and e.node_state == NodeState.FAILED]
    assert [e.name for e in failed] == [NAME + "is_closed"], rdzv_events
    assert "unreachable" in failed[0].message


def test_a_join_is_recorded_while_it_waits(rdzv_events: list[Any], etcd_params: Params) -> None:
    from torch.distributed.elastic.events.api import NodeState

    from etcd_rdzv.torch import create_native_handler

    run_id = f"events-wait-{uuid.uuid4().hex[:8]}"
    params = etcd_params(run_id, min_nodes=2, max_nodes=2, backend="etcd-rdzv", join_timeout=30)
    first, second = (create_native_handler(params) for _ in range(2))
    try:
        waiting = threading.Thread(target=first.next_rendezvous, daemon=True)
        waiting.start()
        deadline = time.monotonic() + 20
        while not [
            e
            for e in rdzv_events
            if e.run_id == run_id and e.node_state == NodeState.RUNNING and "round 1" in e.message
        ]:
            assert time.monotonic() < deadline, f"no join event while it waits: {rdzv_events}"
            assert waiting.is_alive(), "the join returned without a second node"
            time.sleep(0.02)
        assert waiting.is_alive()
        second.next_rendezvous()
        waiting.join(timeout=30)
        assert not waiting.is_alive()
    finally:
        first.shutdown()
        second.shutdown()
