"""The fleet: its event reader (one thread reads every node's stdout, whole lines only),
its protocol's lines and names, and what its node program imports."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any

from fleet import protocol
from fleet.processes import _EventReader

# Writes a line in two pieces, a line that is not JSON, a JSON value that is not an
# object, and a last line without its newline, then exits.
_WRITER = r"""
import sys, time
out = sys.stdout.buffer
def put(b):
    out.write(b); out.flush(); time.sleep(0.05)
put(b'{"event": "a", "t": 1}\n{"event": "b",')
put(b' "t": 2}\nnot json\n')
put(b'[1, 2]\n\n')
put(b'{"event": "c", "t": 3}')
"""


class _Listener:
    """What the reader fills in: a node's events and whether its stream ended."""

    def __init__(self) -> None:
        self._events: list[dict[str, Any]] = []
        self._closed = False


def _start(
    count: int,
) -> tuple[threading.Condition, list[_Listener], list[subprocess.Popen[bytes]]]:
    cond = threading.Condition()
    reader = _EventReader(cond)
    listeners, procs = [], []
    for _ in range(count):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER], stdout=subprocess.PIPE)
        assert proc.stdout is not None
        listener = _Listener()
        reader.add(listener, proc.stdout)  # type: ignore[arg-type]
        listeners.append(listener)
        procs.append(proc)
    return cond, listeners, procs


def _wait_closed(cond: threading.Condition, listeners: list[_Listener]) -> None:
    deadline = time.monotonic() + 60
    with cond:
        while not all(listener._closed for listener in listeners):
            assert cond.wait(deadline - time.monotonic()), "streams not ended within 60 s"


def test_every_stream_gives_its_whole_lines_in_order_and_ends() -> None:
    cond, listeners, procs = _start(20)
    _wait_closed(cond, listeners)
    for proc in procs:
        assert proc.wait(timeout=30) == 0
    for listener in listeners:
        kinds = [e["event"] for e in listener._events]
        assert kinds == ["a", "b", "unparsed", "unparsed", "c"]
        assert listener._events[1]["t"] == 2
        assert [e["line"] for e in listener._events if e["event"] == "unparsed"] == [
            "not json",
            "[1, 2]",
        ]


def test_the_reader_thread_ends_with_the_last_stream_and_comes_back() -> None:
    def readers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "fleet-events"]

    before = len(readers())
    for _ in range(2):
        cond, listeners, procs = _start(2)
        _wait_closed(cond, listeners)
        for proc in procs:
            proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while len(readers()) > before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(readers()) == before
        assert [e["event"] for e in listeners[0]._events] == ["a", "b", "unparsed", "unparsed", "c"]


def test_every_command_has_one_place_that_runs_it() -> None:
    from fleet import node as _node
    from fleet.node_kinds import HandlerNode
    from fleet.node_stores import StoreNode

    by_process = set(_node._PROCESS_COMMANDS)
    by_nodes = set(HandlerNode.COMMANDS) | set(StoreNode.COMMANDS)
    assert by_process | by_nodes == set(protocol.COMMAND_NAMES)
    assert not by_process & by_nodes
    assert set(protocol.ANSWERS) <= protocol.COMMAND_NAMES
    assert set(protocol.ANSWERS.values()) <= protocol.EVENT_NAMES


def test_command_and_event_lines() -> None:
    line = protocol.encode_command("write", {"tag": "k", "count": 2})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert protocol.decode_command(line.decode()) == {"do": "write", "tag": "k", "count": 2}
    assert protocol.decode_command("[1]") is None
    assert protocol.decode_command("not json") is None
    assert protocol.is_command_name("join") and not protocol.is_command_name("jion")
    event = protocol.decode_event(protocol.encode_event("ack", 1.5, {"key": "k"}).encode())
    assert event == {"event": "ack", "t": 1.5, "key": "k"}
    unparsed = protocol.decode_event(b'"a string"')
    assert unparsed["event"] == "unparsed" and unparsed["line"] == '"a string"'


def test_the_node_program_loads_without_torch() -> None:
    # The kinds ours and store hide torch: nothing the program imports may need it.
    code = "import sys; sys.modules['torch'] = None; import fleet.node, fleet.node_stores"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
