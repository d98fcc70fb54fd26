"""What a handler tells its listeners: events named after their public method, the
progress of a waiting join, each write of its join key, each completed round; and a
listener that raises does not disturb the rendezvous."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import etcd_rdzv
from etcd_rdzv import EtcdRendezvousHandler, RendezvousParameters, _keys
from etcd_rdzv.rendezvous import HandlerEvent, Listener, RoundDone

Params = Callable[..., RendezvousParameters]
HANG = 60.0  # seconds: only a hang takes this long


class _Heard(Listener):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[HandlerEvent] = []
        self.progress: list[str] = []
        self.keys: list[tuple[int, str]] = []
        self.rounds: list[RoundDone] = []

    def on_event(self, event: HandlerEvent) -> None:
        with self.lock:
            self.events.append(event)

    def on_progress(self, text: str) -> None:
        with self.lock:
            self.progress.append(text)

    def on_key_written(self, round_no: int, key: str) -> None:
        with self.lock:
            self.keys.append((round_no, key))

    def on_round(self, done: RoundDone) -> None:
        with self.lock:
            self.rounds.append(done)


class _Broken(Listener):
    calls = 0

    def _fail(self) -> None:
        _Broken.calls += 1
        raise RuntimeError("a listener that fails")

    def on_event(self, event: HandlerEvent) -> None:
        self._fail()

    def on_progress(self, text: str) -> None:
        self._fail()

    def on_key_written(self, round_no: int, key: str) -> None:
        self._fail()

    def on_round(self, done: RoundDone) -> None:
        self._fail()


def test_listeners_hear_events_progress_key_writes_and_rounds(
    etcd_api_params: Params, etcd_key_prefix: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    # The second node comes after 2.5 s: the first one's join waits long enough to
    # report its progress (at most once a second, not in the first second).
    params = etcd_api_params("heard", min_nodes=2, max_nodes=2, last_call_timeout=1)
    first, second = (etcd_rdzv.create_handler(params) for _ in range(2))
    handlers.extend([first, second])
    heard, broken = _Heard(), _Broken()
    first.add_listener(broken)  # first: the next listener still hears everything
    first.add_listener(heard)
    with ThreadPoolExecutor(max_workers=1) as pool:
        joining = pool.submit(first.next_rendezvous)
        threading.Event().wait(2.5)
        assert not joining.done()
        second.next_rendezvous()
        result = joining.result(timeout=HANG)

    rdzv = _keys.rdzv_dir(etcd_key_prefix, params.run_id)
    assert heard.keys == [(1, _keys.node_key(etcd_key_prefix, params.run_id, 1, first.node_id))]
    assert all(key.startswith(rdzv) for _, key in heard.keys)
    assert heard.progress and all(text.startswith("round 1: ") for text in heard.progress)
    assert [(d.round, d.rank, d.world_size) for d in heard.rounds] == [(1, result.rank, 2)]
    assert heard.rounds[0].members == result.members and first.node_id in result.members
    assert [(e.method, e.state) for e in heard.events] == [
        ("next_rendezvous", "RUNNING"),
        ("next_rendezvous", "SUCCEEDED"),
    ]
    assert heard.events[1].rank == result.rank
    assert all(e.node_id == first.node_id and e.run_id == params.run_id for e in heard.events)
    assert _Broken.calls >= 4, "the broken listener was called, and its errors swallowed"

    first.set_closed()
    first.shutdown()
    methods = [(e.method, e.state) for e in heard.events[2:]]
    assert methods[0] == ("set_closed", "SUCCEEDED")
    assert ("shutdown", "SUCCEEDED") in methods

    # Removed, a listener hears nothing more.
    first.remove_listener(heard)
    count = len(heard.events)
    first.is_closed()
    first.set_closed()
    assert len(heard.events) == count
