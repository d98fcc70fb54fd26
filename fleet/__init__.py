"""Rendezvous nodes as processes, driven through pipes: for tests and benchmarks.

A development package of this repository (tests and benchmarks share it); the wheel
does not ship it. Its node processes find it, and etcd_rdzv, through ``PYTHONPATH``
(:func:`.processes.child_env`).

A :class:`Fleet` starts node processes (``python -m fleet.node``), sends
them commands and waits, always within a deadline, for the events they report::

    from etcd_rdzv.testing import EtcdServer
    from fleet import Fleet

    with EtcdServer() as etcd, Fleet(tmp_path) as fleet:
        params = etcd.params("job", min_nodes=2, max_nodes=2)
        nodes = [fleet.start(f"n{i}", params) for i in range(2)]
        fleet.ready()                      # every node built its handler
        for node in nodes:
            node.join()                    # one next_rendezvous() each
        rounds = fleet.wait_each(nodes, "round", timeout=30)
        assert sorted(r["rank"] for r in rounds) == [0, 1]

Every node process runs in a session of its own (a kill reaches whatever it
started), writes its log to ``<workdir>/<name>.stderr``, and exits by itself after
``max_life`` seconds should the driving process die. A failed wait raises
:class:`FleetError` with every process's last events and log lines.
:meth:`Fleet.run` starts any other command (``torchrun`` agents, say) the same way,
its stdout in ``<workdir>/<name>.stdout``.

The kinds of node (``Fleet.start(kind=...)``), the commands (:meth:`Node.send`) and
the events (:meth:`Node.events`, the waits), with all their fields, are listed in
:mod:`fleet.protocol`; their names are the ``Literal`` types
:data:`NodeKind`, :data:`CommandName` and :data:`EventName`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from etcd_rdzv.config.params import RendezvousParameters

from .processes import Node, Process, _EventReader, _NewEvents, child_env
from .protocol import ANSWERS, CommandName, Event, EventName, NodeKind, NodeSpec, ParamsSpec

__all__ = [
    "CommandName",
    "Event",
    "EventName",
    "Fleet",
    "FleetError",
    "Node",
    "NodeKind",
    "Process",
    "child_env",
]

T = TypeVar("T")

_CHECK_GAP = 0.02  # seconds between two checks of a wait, at least
_POLL = 0.05  # seconds between looks at conditions no event announces (files, exits)


class FleetError(AssertionError):
    """A node failed, exited or did not report in time; the message shows every process."""


def _params_spec(params: RendezvousParameters) -> ParamsSpec:
    return {
        "backend": params.backend,
        "endpoint": params.endpoint,
        "run_id": params.run_id,
        "min_nodes": params.min_nodes,
        "max_nodes": params.max_nodes,
        "local_addr": params.local_addr,
        "config": dict(params.config),
    }


class Fleet:
    """The processes of one test or measurement: started, driven, waited for, killed.

    Args:
        workdir: where every process runs and writes its output files.
        env: the environment of the processes (default :func:`child_env`).
        max_life: seconds after which a node process exits on its own.

    Use it as a context manager: leaving the block SIGKILLs whatever still runs.
    """

    def __init__(
        self, workdir: Path, *, env: Mapping[str, str] | None = None, max_life: float = 300.0
    ) -> None:
        self.workdir = Path(workdir)
        self.env = dict(child_env() if env is None else env)
        self.max_life = max_life
        self.processes: list[Process] = []
        self._cond = threading.Condition()
        self._reader = _EventReader(self._cond)
        # One pipe that every node can read its start signal from (see go()).
        self._go_read, self._go_write = os.pipe()

    @property
    def nodes(self) -> list[Node]:
        """The node processes, in the order they were started."""
        return [p for p in self.processes if isinstance(p, Node)]

    # -- starting ------------------------------------------------------------------

    def start(
        self,
        name: str,
        params: RendezvousParameters,
        *,
        kind: NodeKind = "ours",
        nodes: int = 1,
        poll: float | None = None,
        rejoin: RendezvousParameters | None = None,
        detail: bool = True,
        host: bool = False,
        timeout: float | None = None,
        log_level: str = "INFO",
        env: Mapping[str, str] | None = None,
        cold: bool = False,
    ) -> Node:
        """Start a node process.

        Args:
            name: names its files (``<name>.stderr``) and its part of failure reports.
            params: the rendezvous (or store) parameters of its nodes.
            kind: what each node builds (see :mod:`fleet.protocol`).
            nodes: how many nodes the process runs (one thread each): large fleets
                of torch's handlers fit in memory only so.
            poll: seconds between ``num_nodes_waiting()`` calls after a node's first
                round (``waiting`` events), as torch's agent polls; ``None``: none.
            rejoin: with ``poll``, once ``num_nodes_waiting()`` turns positive the
                node shuts its handler down and joins the next round with a second
                handler built (at start) from these parameters.
            detail: report the member list and the rest of the detail in ``round``
                events, and ``key-written`` events; ``False`` keeps a measured node
                from doing anything the measurement did not ask for.
            host: the first node of this process hosts c10d's TCPStore.
            timeout: the store timeout, in seconds (store kinds).
            log_level: the node's logging level (its log goes to ``<name>.stderr``).
            env: this process's environment instead of the fleet's.
            cold: each node builds its handler in its first join (after the go
                signal, inside the clock), not when the process starts; its
                ``ready`` details then have no node id.

        Returns:
            The node; wait for :meth:`ready` before relying on its ids.
        """
        spec: NodeSpec = {
            "kind": kind,
            "params": _params_spec(params),
            "nodes": nodes,
            "poll": poll,
            "rejoin": None if rejoin is None else _params_spec(rejoin),
            "detail": detail,
            "host": host,
            "timeout": timeout,
            "log_level": log_level,
            "go_fd": self._go_read,
            "max_life": self.max_life,
            "cold": cold,
        }
        node = Node(name, spec, self.workdir, self.env if env is None else env, reader=self._reader)
        self.processes.append(node)
        return node

    def run(
        self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> Process:
        """Start any command (no stdin; stdout and stderr to files)."""
        proc = Process(name, argv, self.workdir, self.env if env is None else env)
        self.processes.append(proc)
        return proc

    # -- waiting -------------------------------------------------------------------

    def describe(self, limit: int | None = None) -> str:
        """Every process's state and last output (the first ``limit`` processes)."""
        shown = self.processes if limit is None else self.processes[:limit]
        more = len(self.processes) - len(shown)
        return "\n".join(p.describe() for p in shown) + (f"\n({more} more)" if more else "")

    def check(self, condition: bool, message: str) -> None:
        """Raise :class:`FleetError` with ``message`` and :meth:`describe` unless ``condition``."""
        if not condition:
            raise FleetError(f"{message}\n{self.describe()}")

    def _await(self, what: str, found: Callable[[], T | None], timeout: float) -> T:
        """Wait on the event condition until ``found()`` returns something; it raises
        :class:`FleetError` itself when the wait is hopeless."""
        deadline = time.monotonic() + timeout
        while True:
            checked = time.monotonic()
            with self._cond:
                result = found()
                if result is not None:
                    return result
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise FleetError(f"{what}: not within {timeout:.1f} s\n{self.describe()}")
                self._cond.wait(min(remaining, 1.0))
            self._pace(checked)

    @staticmethod
    def _pace(checked: float) -> None:
        """At most one check of a wait per _CHECK_GAP: a check reads every event so far,
        and a large fleet reports thousands at once (checking after each cost the parent
        seconds of CPU at N=1024, beside the nodes it measures). Events carry their
        nodes' own times, so a later check measures nothing later."""
        time.sleep(max(_CHECK_GAP - (time.monotonic() - checked), 0.0))

    def _gone(self, node: Node, what: str) -> FleetError:
        return FleetError(f"{node.name} exited without {what}\n{self.describe()}")

    def wait(
        self,
        node: Node,
        kind: EventName,
        timeout: float,
        match: Callable[[Event], bool] | None = None,
    ) -> Event:
        """The first ``kind`` event of ``node`` that ``match`` accepts.

        Raises:
            FleetError: the node exited first, or ``timeout`` seconds passed.
        """
        return self.wait_each([node], kind, timeout, match=match)[0]

    def wait_each(
        self,
        nodes: Iterable[Node],
        kind: EventName,
        timeout: float,
        *,
        match: Callable[[Event], bool] | None = None,
        count: int = 1,
    ) -> list[Event]:
        """Wait until each of ``nodes`` reported ``count`` matching ``kind`` events,
        within one deadline; returns the ``count``-th of each, in the nodes' order.

        Raises:
            FleetError: a node exited first, or ``timeout`` seconds passed.
        """
        nodes = list(nodes)
        what = f"{count} {kind!r} event(s)"
        news = _NewEvents(nodes)
        matching: list[list[Event]] = [[] for _ in nodes]

        def found() -> list[Event] | None:
            for i, event in news.read():
                if event["event"] == kind and (match is None or match(event)):
                    matching[i].append(event)
            events = []
            for node, hits in zip(nodes, matching, strict=True):
                if len(hits) >= count:
                    events.append(hits[count - 1])
                elif node._closed:
                    raise self._gone(node, what)
                else:
                    return None
            return events

        names = ", ".join(n.name for n in nodes)
        return self._await(f"{what} from each of {names}", found, timeout)

    def wait_total(
        self,
        kind: EventName,
        count: int,
        timeout: float,
        *,
        nodes: Iterable[Node] | None = None,
        match: Callable[[Event], bool] | None = None,
        fail_on: Collection[EventName] = (),
    ) -> list[Event]:
        """The first ``count`` matching ``kind`` events of ``nodes`` (default: all)
        together, by arrival per node.

        Raises:
            FleetError: an event of a kind in ``fail_on`` came first, every node
                exited, or ``timeout`` seconds passed.
        """
        chosen = self.nodes if nodes is None else list(nodes)
        news = _NewEvents(chosen)
        events: list[Event] = []
        bad: list[tuple[Node, Event]] = []

        def found() -> list[Event] | None:
            for i, event in news.read():
                if event["event"] == kind and (match is None or match(event)):
                    events.append(event)
                elif event["event"] in fail_on:
                    bad.append((chosen[i], event))
            if len(events) >= count:
                return sorted(events, key=lambda e: e["t"])[:count]
            if bad:
                node, event = bad[0]
                raise FleetError(f"{node.name}: {event}\n{self.describe(limit=8)}")
            if all(node._closed for node in chosen):
                raise FleetError(
                    f"every node exited after {len(events)} of {count} {kind!r} events\n"
                    f"{self.describe(limit=8)}"
                )
            return None

        return self._await(f"{count} {kind!r} events", found, timeout)

    def wait_until(
        self,
        what: str,
        check: Callable[[], T | None],
        timeout: float,
        *,
        alive: Iterable[Process] = (),
        details: Callable[[], str] | None = None,
    ) -> T:
        """Call ``check`` (on each event, at least every 50 ms) until it returns
        something other than ``None``, and return that.

        Raises:
            FleetError: a process of ``alive`` exited first, or ``timeout`` seconds
                passed; the message starts with ``what`` and ends with ``details()``.
        """
        watched = list(alive)
        deadline = time.monotonic() + timeout

        def fail(reason: str) -> FleetError:
            extra = f"\n{details()}" if details is not None else ""
            return FleetError(f"{what}: {reason}{extra}\n{self.describe()}")

        while True:
            checked = time.monotonic()
            result = check()
            if result is not None:
                return result
            gone = [p.name for p in watched if not p.alive]
            if gone:
                raise fail(f"{gone} exited first")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise fail(f"not within {timeout:.1f} s")
            with self._cond:
                self._cond.wait(min(remaining, _POLL))
            self._pace(checked)

    def ready(self, nodes: Iterable[Node] | None = None, timeout: float = 60.0) -> None:
        """Wait until every node process (default: all) built its nodes; learn their
        ids and endpoints.

        Raises:
            FleetError: a process exited first, built fewer nodes, or ``timeout``
                seconds passed.
        """
        chosen = self.nodes if nodes is None else list(nodes)
        for node, event in zip(chosen, self.wait_each(chosen, "ready", timeout), strict=True):
            details = event["details"]
            self.check(len(details) == node.size, f"{node.name} built {len(details)} nodes")
            node.node_ids = [d.get("node_id") for d in details]
            node.endpoint = details[0].get("endpoint") if details else None

    def request(
        self,
        node: Node,
        do: CommandName,
        answer: EventName | None = None,
        timeout: float = 10.0,
        **fields: Any,
    ) -> Event:
        """Send ``do`` to ``node`` and return its answer reported after the request was
        sent: the event ``answer``, by default the one that ends the command's work
        (``_protocol.ANSWERS``: ``status`` answers ``status``, ``close`` ``closed``).

        Raises:
            ValueError: ``do`` has no answer (``finish``) and ``answer`` is not given.
            FleetError: the node exited first, or ``timeout`` seconds passed.
        """
        expected = ANSWERS.get(do) if answer is None else answer
        if expected is None:
            raise ValueError(f"the command {do!r} has no answer to wait for")
        asked_at = time.monotonic()
        node.send(do, **fields)
        return self.wait(node, expected, timeout, lambda e: e["t"] >= asked_at)

    def go(self, timeout: float = 60.0) -> float:
        """Start every ``join(go=True)`` at the same moment and return that moment
        (``time.monotonic()``), taken once each of those nodes waits for it.

        Each process waiting takes one byte of a pipe they all block on, written at
        once: no process learns of the start later than another by the order of
        writes.
        """
        pending = [n for n in self.nodes if n._go_pending]
        for node in pending:
            self.wait_each([node], "armed", timeout, count=node._go_pending)
        started = time.monotonic()
        os.write(self._go_write, b"g" * sum(n._go_pending for n in pending))
        for node in pending:
            node._go_pending = 0
        return started

    def wait_exit(self, procs: Iterable[Process] | None = None, timeout: float = 60.0) -> bool:
        """Wait until every one of ``procs`` (default: all) exited, or one of them
        failed (then the others are killed: they would only wait for it).

        Returns:
            ``False`` if ``timeout`` passed first (they are all killed then).
        """
        chosen = self.processes if procs is None else list(procs)
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.returncode for p in chosen]
            if all(code is not None for code in codes):
                return True
            if any(code not in (None, 0) for code in codes):
                for proc in chosen:
                    proc.kill()
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                for proc in chosen:
                    proc.kill()
                return False
            running = next(p for p, code in zip(chosen, codes, strict=True) if code is None)
            with contextlib.suppress(subprocess.TimeoutExpired):
                running.popen.wait(timeout=min(0.2, remaining))

    # -- ending --------------------------------------------------------------------

    def stop(self, timeout: float = 30.0) -> None:
        """Ask every node to shut its handlers down and exit; kill whatever still runs
        after ``timeout`` seconds (other commands at once)."""
        for node in self.nodes:
            node.exit()
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
        self.kill_all()

    def kill_all(self) -> None:
        """SIGKILL every process still running, and release the go pipe."""
        for proc in self.processes:
            proc.kill()
        for fd in (self._go_read, self._go_write):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._go_read = self._go_write = -1

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()
