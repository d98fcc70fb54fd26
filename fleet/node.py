"""The node program of :mod:`fleet`: one process, one or more nodes.

Started by :class:`~fleet.Fleet` as ``python -m
fleet.node '<json spec>'``, never by hand; the spec, the commands and
the events are described in :mod:`fleet.protocol`, what each kind of
node builds and does in :mod:`fleet.node_kinds`. Each node of the
process runs its commands in order in a thread of its own, so the main thread always
reads stdin (``status``, ``finish`` and ``exit`` are answered at once, even while a
node waits in a round).

The kinds ``ours`` and ``store`` hide torch from the process (an installed torch is
never imported, as on a machine without it); the other kinds import torch here, in
the node process, never in the process that drives the fleet.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TextIO

from .node_kinds import HandlerNode, Role
from .node_stores import StoreNode
from .protocol import (
    STORE_KINDS,
    TORCH_FREE,
    Command,
    CommandName,
    EventName,
    NodeSpec,
    decode_command,
    encode_event,
    is_command_name,
)

# Answered by the main thread at once, not queued behind a node's running command.
_IMMEDIATE: frozenset[CommandName] = frozenset({"status"})


class Events:
    """The event stream to the parent: one JSON object per line on the original stdout.

    File descriptor 1 is then pointed at stderr, so nothing else that prints (torch,
    a stray ``print``) can break a line of the stream.
    """

    def __init__(self) -> None:
        sys.stdout.flush()
        self._out: TextIO = os.fdopen(os.dup(1), "w", encoding="utf-8")
        os.dup2(2, 1)
        self._lock = threading.Lock()

    def __call__(self, event: EventName, t: float | None = None, **fields: Any) -> None:
        """Report ``event``; ``t`` (``time.monotonic()``) defaults to now."""
        line = encode_event(event, time.monotonic() if t is None else t, fields)
        try:
            with self._lock:
                self._out.write(line)
                self._out.flush()
        except (BrokenPipeError, OSError):
            os._exit(71)  # nobody reads the events any more: the fleet is gone


def kinds(exc: BaseException) -> list[str]:
    """The exception's classes, most specific first, as ``module.qualname``."""
    return [f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__]


class Process:
    """What the nodes of this process share: the spec, the event stream, the stop
    signal, the start gate and the round to finish after."""

    def __init__(self, spec: NodeSpec, emit: Events) -> None:
        self.spec = spec
        self.emit = emit
        self.stop = threading.Event()
        self.finish: int | None = None  # ``join`` with ``rounds=0`` ends after this round
        self._go_fd = spec.get("go_fd")

    def gate(self) -> threading.Event:
        """An event set once this process took its byte from the fleet's go pipe; says
        ``armed`` just before it blocks on the pipe."""
        opened = threading.Event()
        fd = self._go_fd

        def wait() -> None:
            if fd is not None:
                self.emit("armed")
                os.read(fd, 1)
            opened.set()

        threading.Thread(target=wait, name="go", daemon=True).start()
        return opened

    def finished(self, round_no: int) -> bool:
        return self.finish is not None and round_no >= self.finish


class Node:
    """One node of the process: it runs its commands in order, in a thread of its own,
    by the table of its role, and is that role's
    :class:`~fleet.node_kinds.Host` (what the role reports through)."""

    def __init__(self, index: int, proc: Process) -> None:
        self.index = index
        self.proc = proc
        self.commands: queue.Queue[Command | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=f"node{index}", daemon=True)
        role: type[Role] = StoreNode if proc.spec["kind"] in STORE_KINDS else HandlerNode
        self.role = role(self)

    @property
    def spec(self) -> NodeSpec:
        return self.proc.spec

    @property
    def stop(self) -> threading.Event:
        return self.proc.stop

    def finished(self, round_no: int) -> bool:
        return self.proc.finished(round_no)

    def start(self) -> None:
        self._thread.start()

    def emit(self, event: EventName, t: float | None = None, **fields: Any) -> None:
        self.proc.emit(event, t, node=self.index, **fields)

    def error(self, op: str, exc: BaseException, began: float) -> None:
        now = time.monotonic()
        self.emit("error", now, op=op, kinds=kinds(exc), message=str(exc), elapsed=now - began)

    def run(self, command: Command) -> None:
        """Run one command now (in the calling thread): ``unknown`` if this node's role
        has no such command; errors become ``error`` events."""
        name = command.get("do")
        action = self.role.COMMANDS.get(name) if is_command_name(name) else None
        if action is None:
            self.emit("unknown", command=command)
            return
        began = time.monotonic()
        try:
            action(self.role, command)
        except Exception as exc:
            self.error(str(name), exc, began)

    def _serve(self) -> None:
        while (command := self.commands.get()) is not None:
            self.run(command)

    def describe(self) -> dict[str, Any]:
        """This node for the ``ready`` event."""
        return self.role.describe()

    def close(self) -> None:
        """Release what the node holds (the process is about to exit)."""
        self.role.close()


def _watchdog(seconds: float, emit: Events) -> None:
    time.sleep(seconds)
    emit("watchdog", after=seconds)
    os._exit(70)


def _exit(proc: Process, command: Command) -> bool:
    return True


def _leave(proc: Process, command: Command) -> bool:
    # The process ends without shutdown(), as an agent's does on a signal it
    # handles: what is left to clean up is up to the handlers' finalizers.
    proc.emit("exit")
    sys.exit(0)


def _finish(proc: Process, command: Command) -> bool:
    proc.finish = int(command["round"])
    return False


# The commands to the process, not to its nodes (every other goes to the nodes): the
# main thread runs them at once. True: stop reading commands.
_PROCESS_COMMANDS: Mapping[CommandName, Callable[[Process, Command], bool]] = {
    "exit": _exit,
    "leave": _leave,
    "finish": _finish,
}


def serve(proc: Process, nodes: list[Node], lines: Iterable[str]) -> None:
    """Read commands until ``exit`` or the end of input; hand each to its nodes."""
    for line in lines:
        if not line.strip():
            continue
        command = decode_command(line)
        if command is None:
            proc.emit("unknown", command=line.strip())
            continue
        do = command.get("do")
        name: CommandName | None = do if is_command_name(do) else None  # None: unknown
        for_process = None if name is None else _PROCESS_COMMANDS.get(name)
        if for_process is not None:
            if for_process(proc, command):
                return
            continue
        index = command.get("node")
        if index is not None and not (isinstance(index, int) and 0 <= index < len(nodes)):
            proc.emit("unknown", command=command)
            continue
        targets = nodes if index is None else [nodes[index]]
        if name == "join" and command.get("go"):
            command["gate"] = proc.gate()  # one byte of the go pipe for this process
        for node in targets:
            if name in _IMMEDIATE:
                node.run(command)
            else:
                node.commands.put(command)


def main(argv: list[str]) -> int:
    spec: NodeSpec = json.loads(argv[0])
    switch = os.environ.get("FLEET_SWITCH_INTERVAL")
    if switch:  # many nodes as threads: fewer GIL hand-overs between them
        sys.setswitchinterval(float(switch))
    if spec["kind"] in TORCH_FREE:
        sys.modules["torch"] = None  # type: ignore[assignment]  # find_spec("torch") -> None
    emit = Events()
    threading.Thread(
        target=_watchdog, args=(float(spec.get("max_life", 300)), emit), daemon=True
    ).start()
    logging.basicConfig(
        level=str(spec.get("log_level", "INFO")),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s",
    )
    proc = Process(spec, emit)
    nodes = [Node(i, proc) for i in range(int(spec.get("nodes", 1)))]
    for node in nodes:
        node.start()
    emit(
        "ready",
        nodes=len(nodes),
        pid=os.getpid(),
        torch=sys.modules.get("etcd_rdzv.torch") is not None,
        details=[node.describe() for node in nodes],
    )
    serve(proc, nodes, sys.stdin)
    proc.stop.set()
    for node in nodes:
        node.close()
    emit("exit")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
