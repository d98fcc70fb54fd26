"""Rendezvous nodes as processes, driven through pipes: for tests and benchmarks.

A :class:`Fleet` starts node processes (``python -m etcd_rdzv.testing._node``), sends
them commands and waits, always within a deadline, for the events they report::

    from etcd_rdzv.testing import EtcdServer
    from etcd_rdzv.testing.fleet import Fleet

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

**Kinds** of node (``Fleet.start(kind=...)``); the first two never import torch:

* ``ours``: ``etcd_rdzv.create_handler(params, use_torch=False)`` with torch hidden
  (the torch-free path, as on a machine without torch);
* ``ours-torch``: ``etcd_rdzv.create_handler(params, use_torch=True)`` where torch is
  installed (torch's flavour, what torchrun runs), else as ``ours`` but torch visible;
* ``store``: an :class:`~etcd_rdzv.EtcdStore` over ``create_client(params)``, in the
  run's store directory;
* ``dynamic``: torch's ``DynamicRendezvousHandler`` over ``create_backend(params)``;
* ``torch``: torch's own handler named ``params.backend`` (``c10d``, ``etcd-v2``,
  ``etcd``) from torch's registry; with ``host=True`` the first node of the process
  hosts c10d's store;
* ``torch-store``: torch's ``EtcdStore`` (python-etcd) in the same place as ``store``.

**Commands** (:meth:`Node.send`; each is one JSON object on the node's stdin, ``do``
naming it; ``node=i`` addresses one node of a process that runs several, the default
is all of them). A node runs its commands in order; ``status``, ``finish`` and
``exit`` are answered at once:

* ``join`` (``rounds=1``, ``retries=0``, ``go=False``, ``agent=False``, ``poll=0.1``):
  call ``next_rendezvous()`` until it returned ``rounds`` times (``0``: until the
  ``finish`` round), trying again after up to ``retries`` failures in a row; with
  ``go``, first wait for :meth:`Fleet.go`; with ``agent``, between rounds wait (as
  torch's agent does) until ``num_nodes_waiting()`` turns positive, polling every
  ``poll`` seconds. Ends with ``done``;
* ``prepare``: our handlers prepare their next join again now, as when they were
  built (the lease of the join key, the watch of its round: made earlier than half
  the key's TTL, or than ``read_timeout``, before the join, they would be made anew
  inside it); ends with ``prepared``;
* ``finish`` (``round``): ``join`` with ``rounds=0`` ends after that round;
* ``status``, ``close`` (``set_closed()``), ``shutdown``;
* ``allreduce``: a gloo all-reduce of ``rank + 1`` over the last round's store
  (torch kinds, one node per process);
* ``write`` (``tag``, ``count``): set keys ``<tag>-<i>`` to unique values (stores);
* ``add`` (``key``, ``count``): ``add(key, 1)`` that many times (stores);
* ``get`` (``key``): a blocking ``get`` (stores);
* ``exit``: shut every handler down and exit 0 (so does closing stdin);
* ``leave``: exit 0 at once without ``shutdown()`` (the handlers' finalizers clean up).

**Events** (:meth:`Node.events`): one JSON object each, with ``event``, ``t``
(the node's ``time.monotonic()``: one clock for every process on Linux and macOS, so
comparable with the driver's) and ``node`` (the node's index in its process):

* ``ready``: handlers built: ``nodes``, ``pid``, ``torch`` (etcd_rdzv's torch
  integration is loaded), ``details`` (per node: ``node_id``, ``endpoint``,
  ``handler_type``; ``store_type``, ``store_is_torch``, ``backend_name`` where known);
* ``key-written``: our handler just wrote its join key: ``round``, ``key``;
* ``round``: ``next_rendezvous()`` returned: ``round``, ``rank``, ``world_size``,
  ``elapsed``; with ``detail`` also ``node_id``, ``members`` (node ids in rank
  order), ``endpoint``, ``info_type``, ``torch``, and for torch's handlers
  ``backend``, ``store_is_prefix``, ``store_wraps_ours``, ``master_port``; after a
  rejoin (``rejoin=``) ``rejoined`` and ``detected`` (when the waiting node was seen);
* ``waiting``: ``num_nodes_waiting()`` changed (``poll=``): ``n``, ``round``;
* ``error``: a call raised: ``op``, ``kinds`` (its classes, ``module.qualname``),
  ``message``, ``elapsed``;
* ``done``: a ``join``, ``write`` or ``add`` ended: ``command``, ``elapsed``;
* ``prepared``, ``status`` (``waiting``, ``is_closed``, ``round``), ``closed``, ``shutdown``
  (``ok``), ``allreduce`` (``rank``, ``value``), ``ack`` (``key``, ``value``,
  ``started``), ``added`` (``total``), ``getting`` and ``got`` (``key``): answers;
* ``armed`` (waits for the go signal), ``exit``, ``watchdog`` (``max_life`` passed),
  ``unknown`` (a command it does not know).
"""

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
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Literal, TypeVar

from ..params import RendezvousParameters

__all__ = ["Event", "Fleet", "FleetError", "Node", "NodeKind", "Process", "child_env"]

Event = dict[str, Any]
NodeKind = Literal["ours", "ours-torch", "store", "dynamic", "torch", "torch-store"]
T = TypeVar("T")

log = logging.getLogger(__name__)

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent
_NODE_MODULE = "etcd_rdzv.testing._node"
_CHECK_GAP = 0.02  # seconds between two checks of a wait, at least
_POLL = 0.05  # seconds between looks at conditions no event announces (files, exits)


class FleetError(AssertionError):
    """A node failed, exited or did not report in time; the message shows every process."""


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child: this ``etcd_rdzv`` importable, unbuffered output, one
    OpenMP thread (torch), gloo on loopback (Linux); ``extra`` added last."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    if sys.platform.startswith("linux"):
        # Everything runs on this machine: keep gloo off interfaces a sandbox may block.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.update(extra)
    return env


def _params_spec(params: RendezvousParameters) -> dict[str, Any]:
    return {
        "backend": params.backend,
        "endpoint": params.endpoint,
        "run_id": params.run_id,
        "min_nodes": params.min_nodes,
        "max_nodes": params.max_nodes,
        "local_addr": params.local_addr,
        "config": dict(params.config),
    }


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
    is ready, parses the complete lines, and notifies the fleet's condition once per
    batch. It runs while any stream is open and ends with the last.
    """

    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
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
        with self._cond:
            for node, events in arrived:
                node._events.extend(events)
            for node in ended:
                node._closed = True
            self._cond.notify_all()


class _Stream:
    """A node's event stream and the start of a line not yet complete."""

    def __init__(self, node: Node, file: IO[bytes]) -> None:
        self.node = node
        self.file = file
        self._partial = b""

    def lines(self, chunk: bytes) -> list[Event]:
        """The events of the lines that ``chunk`` completes."""
        *complete, self._partial = (self._partial + chunk).split(b"\n")
        return [_event(raw) for raw in complete if raw.strip()]


def _event(raw: bytes) -> Event:
    try:
        event = json.loads(raw)
    except ValueError:
        event = None
    if not isinstance(event, dict):
        event = {"event": "unparsed", "t": time.monotonic(), "line": raw.decode(errors="replace")}
    return event


class Node(Process):
    """A node process: commands go to its stdin, the fleet's reader thread collects its events.

    Started by :meth:`Fleet.start`. The attributes from its ``ready`` event
    (``node_ids``, ``node_id``, ``endpoint``) are set by :meth:`Fleet.ready`.
    """

    def __init__(
        self, fleet: Fleet, name: str, spec: dict[str, Any], env: Mapping[str, str]
    ) -> None:
        argv = [sys.executable, "-m", _NODE_MODULE, json.dumps(spec)]
        super().__init__(
            name,
            argv,
            fleet.workdir,
            env,
            stdin=subprocess.PIPE,
            stdout_pipe=True,
            pass_fds=(fleet._go_read,),
        )
        self.kind: str = spec["kind"]
        self.size: int = spec["nodes"]
        self.node_ids: list[str | None] = []
        self.endpoint: str | None = None
        self._fleet = fleet
        self._events: list[Event] = []
        self._closed = False  # the event stream ended: the process exited
        self._go_pending = 0  # joins sent with go=True that Fleet.go() has not released
        assert self.popen.stdout is not None
        fleet._reader.add(self, self.popen.stdout)

    @property
    def node_id(self) -> str | None:
        """The node id of the (first) node, once :meth:`Fleet.ready` returned."""
        return self.node_ids[0] if self.node_ids else None

    def events(self, kind: str | None = None) -> list[Event]:
        """A copy of the events reported so far (of ``kind``, if given), oldest first."""
        with self._fleet._cond:
            return [e for e in self._events if kind is None or e["event"] == kind]

    def send(self, do: str, **fields: Any) -> None:
        """Send the command ``do`` with ``fields`` (see the module's list). A node that
        has exited ignores it: waits for its answer fail, saying it exited."""
        line = json.dumps({"do": do, **fields}) + "\n"
        assert self.popen.stdin is not None
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            self.popen.stdin.write(line.encode())
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
        with self._fleet._cond:
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
    ) -> Node:
        """Start a node process.

        Args:
            name: names its files (``<name>.stderr``) and its part of failure reports.
            params: the rendezvous (or store) parameters of its nodes.
            kind: what each node builds (see the module's list).
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

        Returns:
            The node; wait for :meth:`ready` before relying on its ids.
        """
        spec = {
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
        }
        node = Node(self, name, spec, self.env if env is None else env)
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
        kind: str,
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
        kind: str,
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
        kind: str,
        count: int,
        timeout: float,
        *,
        nodes: Iterable[Node] | None = None,
        match: Callable[[Event], bool] | None = None,
        fail_on: Collection[str] = (),
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
        self, node: Node, do: str, answer: str | None = None, timeout: float = 10.0, **fields: Any
    ) -> Event:
        """Send ``do`` to ``node`` and return its answer (the event ``answer``, default
        named as the command) reported after the request was sent."""
        asked_at = time.monotonic()
        node.send(do, **fields)
        return self.wait(node, answer or do, timeout, lambda e: e["t"] >= asked_at)

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
