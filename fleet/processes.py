"""The driver's side of a fleet's processes: a child process (:class:`Process`), a node
process (:class:`Node`: commands to its stdin), the one thread that reads every node's
events (:class:`_EventReader`) and what a wait reads of them (:class:`_NewEvents`).
:class:`~fleet.Fleet` starts them and waits on what they report."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from etcd_rdzv.testing._cli_runner import child_env as testing_child_env

from .protocol import (
    CommandName,
    Event,
    EventName,
    NodeKind,
    NodeSpec,
    decode_event,
    encode_command,
)

log = logging.getLogger(__name__)

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # where fleet is
_NODE_MODULE = "fleet.node"
_POLL = 0.05  # seconds the reader waits for output before it looks at its streams again


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a node process: the test harness's (this ``etcd_rdzv``
    importable, unbuffered output, one OpenMP thread, gloo on loopback), with this
    ``fleet`` importable too; ``extra`` added last."""
    env = testing_child_env()
    env["PYTHONPATH"] = os.pathsep.join((str(_PACKAGE_ROOT), env["PYTHONPATH"]))
    env.update(extra)
    return env


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(none)"


class Process:
    """A child process in a session of its own; stderr (and stdout, unless the
    subclass reads it) go to files in the fleet's work directory."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        workdir: Path,
        env: Mapping[str, str],
        *,
        stdin: int = subprocess.DEVNULL,
        stdout_pipe: bool = False,
        pass_fds: Sequence[int] = (),
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.stdout_path = workdir / f"{name}.stdout"
        self.stderr_path = workdir / f"{name}.stderr"
        with contextlib.ExitStack() as files:
            err = files.enter_context(open(self.stderr_path, "wb"))
            out: Any = subprocess.PIPE
            if not stdout_pipe:
                out = files.enter_context(open(self.stdout_path, "wb"))
            self.popen = subprocess.Popen(
                self.argv,
                stdin=stdin,
                stdout=out,
                stderr=err,
                env=dict(env),
                cwd=str(workdir),
                pass_fds=tuple(pass_fds),
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit code (negative: killed by that signal), ``None`` while it runs."""
        return self.popen.poll()

    def _signal(self, sig: int) -> None:
        # Only while the child runs unreaped: its pid is then surely still its group's id.
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, sig)

    def kill(self) -> float:
        """SIGKILL the process and everything in its session; returns the moment
        (``time.monotonic()``) just before the signal."""
        killed_at = time.monotonic()
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        return killed_at

    def pause(self) -> None:
        """SIGSTOP the process's session (it keeps its keys until their TTL ends)."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT what :meth:`pause` stopped."""
        self._signal(signal.SIGCONT)

    def stdout(self) -> str:
        """Its stdout so far (``""`` for a node, whose stdout is its event stream)."""
        try:
            return self.stdout_path.read_text(errors="replace")
        except OSError:
            return ""

    def stderr(self) -> str:
        """Its stderr (a node's log) so far."""
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def describe(self, tail: int = 30) -> str:
        return (
            f"=== {self.name}: exit code {self.returncode}; argv {self.argv}\n"
            f"--- stdout (last {tail} lines)\n{_tail(self.stdout_path, tail)}\n"
            f"--- stderr (last {tail} lines)\n{_tail(self.stderr_path, tail)}"
        )


class _EventReader:
    """One thread that reads the event streams of a fleet's node processes.

    A thread per node cost the driving process a thread wake-up (and a turn of the
    interpreter lock) per event: about 0.3 s of CPU over a round of 1024 nodes, spent
    on the same cores as the nodes it measures. This thread wakes once for whatever
    is ready, parses the complete lines, and notifies :attr:`cond` once per batch. It
    runs while any stream is open and ends with the last.

    Args:
        cond: notified after each batch; held while a node's ``_events`` grow and
            its ``_closed`` is set, so read those with it held.
    """

    def __init__(self, cond: threading.Condition) -> None:
        self.cond = cond
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, node: Node, stream: IO[bytes]) -> None:
        """Read ``node``'s events from ``stream`` (its stdout) until it ends."""
        os.set_blocking(stream.fileno(), False)
        with self._lock:
            self._selector.register(stream, selectors.EVENT_READ, _Stream(node, stream))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fleet-events", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._selector.get_map():
                    self._thread = None
                    return
            try:
                self._read_ready()
            except Exception:  # never end silently: the fleet's waits would time out
                log.warning("reading the nodes' events failed", exc_info=True)
                time.sleep(_POLL)

    def _read_ready(self) -> None:
        ready = self._selector.select(timeout=_POLL)
        arrived: list[tuple[Node, list[Event]]] = []
        ended: list[Node] = []
        for key, _ in ready:
            stream: _Stream = key.data
            try:
                chunk = os.read(stream.file.fileno(), 1 << 16)
            except BlockingIOError:
                continue
            except (OSError, ValueError):  # as good as the end: nothing more comes
                chunk = b""
            if chunk:
                arrived.append((stream.node, stream.lines(chunk)))
                continue
            arrived.append((stream.node, stream.lines(b"\n")))
            ended.append(stream.node)
            with self._lock, contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(key.fileobj)
            stream.file.close()
        if not arrived:
            return
        with self.cond:
            for node, events in arrived:
                node._events.extend(events)
            for node in ended:
                node._closed = True
            self.cond.notify_all()


class _Stream:
    """A node's event stream and the start of a line not yet complete."""

    def __init__(self, node: Node, file: IO[bytes]) -> None:
        self.node = node
        self.file = file
        self._partial = b""

    def lines(self, chunk: bytes) -> list[Event]:
        """The events of the lines that ``chunk`` completes."""
        *complete, self._partial = (self._partial + chunk).split(b"\n")
        return [decode_event(raw) for raw in complete if raw.strip()]


class Node(Process):
    """A node process: commands go to its stdin, the fleet's reader thread collects its events.

    Started by :meth:`Fleet.start <fleet.Fleet.start>`. The attributes
    from its ``ready`` event (``node_ids``, ``node_id``, ``endpoint``) are set by
    :meth:`Fleet.ready <fleet.Fleet.ready>`.

    Args:
        name: names its files and its part of failure reports.
        spec: the node program's argument.
        workdir: where it runs and writes its log.
        env: its environment.
        reader: the fleet's reader, which collects its events.
    """

    def __init__(
        self,
        name: str,
        spec: NodeSpec,
        workdir: Path,
        env: Mapping[str, str],
        *,
        reader: _EventReader,
    ) -> None:
        argv = [sys.executable, "-m", _NODE_MODULE, json.dumps(spec)]
        go_fd = spec["go_fd"]
        super().__init__(
            name,
            argv,
            workdir,
            env,
            stdin=subprocess.PIPE,
            stdout_pipe=True,
            pass_fds=() if go_fd is None else (go_fd,),
        )
        self.kind: NodeKind = spec["kind"]
        self.size: int = spec["nodes"]
        self.node_ids: list[str | None] = []
        self.endpoint: str | None = None
        self._cond = reader.cond
        self._events: list[Event] = []  # grown by the reader, with _cond held
        self._closed = False  # the event stream ended: the process exited
        self._go_pending = 0  # joins sent with go=True that Fleet.go() has not released
        assert self.popen.stdout is not None
        reader.add(self, self.popen.stdout)

    @property
    def node_id(self) -> str | None:
        """The node id of the (first) node, once :meth:`Fleet.ready` returned."""
        return self.node_ids[0] if self.node_ids else None

    def events(self, kind: EventName | None = None) -> list[Event]:
        """A copy of the events reported so far (of ``kind``, if given), oldest first."""
        with self._cond:
            return [e for e in self._events if kind is None or e["event"] == kind]

    def send(self, do: CommandName, **fields: Any) -> None:
        """Send the command ``do`` with ``fields`` (see :mod:`fleet.protocol`).
        A node that has exited ignores it: waits for its answer fail, saying it exited."""
        line = encode_command(do, fields)
        assert self.popen.stdin is not None
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            self.popen.stdin.write(line)
            self.popen.stdin.flush()

    def join(
        self,
        rounds: int = 1,
        *,
        retries: int = 0,
        go: bool = False,
        agent: bool = False,
        poll: float = 0.1,
    ) -> None:
        """Send ``join``: ``rounds`` rounds (``0``: until ``finish``), ``retries``
        failures in a row tolerated; ``go``: start on :meth:`Fleet.go`; ``agent``:
        between rounds wait for ``num_nodes_waiting() > 0``, as torch's agent does."""
        if go:
            self._go_pending += 1
        self.send("join", rounds=rounds, retries=retries, go=go, agent=agent, poll=poll)

    def exit(self) -> None:
        """Ask the process to shut its handlers down and exit (closes its stdin)."""
        if self.popen.stdin is not None:
            with contextlib.suppress(OSError):
                self.popen.stdin.close()

    def kill(self) -> float:
        killed_at = super().kill()
        self.exit()
        return killed_at

    def describe(self, tail: int = 30) -> str:
        with self._cond:
            events = [json.dumps(e) for e in self._events[-tail // 2 :]]
        ids = ", ".join(str(i) for i in self.node_ids) or "not ready"
        return (
            f"=== {self.name} ({self.kind}; {ids}): exit code {self.returncode}\n"
            f"--- events (last {len(events)})\n" + "\n".join(events) + "\n"
            f"--- stderr (last {tail} lines)\n{_tail(self.stderr_path, tail)}"
        )


class _NewEvents:
    """The events of some nodes that arrived since the last :meth:`read`.

    A wait checks its condition after each batch of events; reading only the new ones
    keeps a check's cost to what arrived. Reading every event every time cost the
    driving process a fifth of a second of CPU over one round of 1024 nodes, on the
    cores the nodes it measured ran on. Read with the fleet's condition held.
    """

    def __init__(self, nodes: Sequence[Node]) -> None:
        self._nodes = nodes
        self._seen = [0] * len(nodes)

    def read(self) -> Iterator[tuple[int, Event]]:
        """``(index of the node in nodes, event)`` for each event not read before."""
        for i, node in enumerate(self._nodes):
            events = node._events
            if len(events) > self._seen[i]:
                start, self._seen[i] = self._seen[i], len(events)
                for event in events[start:]:
                    yield i, event
