"""What every etcd member of the test helpers has in common, local or in a container.

:class:`EtcdMember` is one etcd member whose client port is on ``127.0.0.1``: its
address, rendezvous parameters, readiness probe (``/health``), life cycle and fault
methods. :class:`EtcdMemberCluster` is members started together, with ``leader()``.
The local helpers (:mod:`._server`: a process per member) and the container helpers
(:mod:`._containers`: a Docker container per member) subclass both; a test written
against this surface runs on either.
"""

from __future__ import annotations

import abc
import json
import socket
import ssl
import time
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

from ..config.params import DYNAMIC_HANDLER_NAME, RendezvousParameters

__all__ = [
    "EtcdMember",
    "EtcdMemberCluster",
    "EtcdNoLeaderError",
    "EtcdStartError",
    "free_ports",
]

#: The initial-cluster token of a member started on its own.
SINGLE_MEMBER_TOKEN = "etcd-rdzv-test"

_M = TypeVar("_M", bound="EtcdMember")
_C = TypeVar("_C", bound="EtcdMemberCluster[Any]")


class EtcdStartError(RuntimeError):
    """etcd did not start or did not become ready in time; the message has its log."""


class EtcdNoLeaderError(RuntimeError):
    """No member of a cluster reports being leader (within the time allowed)."""


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports that are free on ``127.0.0.1`` now."""
    # Hold all sockets open until every port is chosen so they are distinct.
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def consecutive_free_ports(count: int) -> int:
    """A port ``p`` such that ``p .. p+count-1`` are free on ``127.0.0.1`` now (for
    programs that take a base port and add to it, as NVRx's example does)."""
    for _ in range(100):
        base = free_ports(1)[0]
        if base + count > 65536:
            continue
        held: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def _attempts(timeout: float) -> Iterator[None]:
    """Yield at once, then again after pauses growing from 20 ms to 250 ms, until
    ``timeout`` seconds have passed; the last attempt is at the deadline."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        yield
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        time.sleep(min(delay, remaining))
        delay = min(delay * 1.5, 0.25)


class EtcdMember(abc.ABC):
    """One etcd member, its client port on ``127.0.0.1``.

    Subclasses say how the member runs (:meth:`launch`, :meth:`stop`, :meth:`kill`,
    :meth:`pause`, :meth:`resume`, :meth:`close`, :meth:`log_tail`, :attr:`running`);
    the rest is shared: addresses, :meth:`params`, the readiness probe
    (:meth:`health`, :meth:`wait_ready`), :meth:`start`, :meth:`restart`, and use as
    a context manager (started on entry, closed on exit, and closed again when the
    start fails).

    Members use a 50 ms heartbeat and a 500 ms election timeout, so elections after a
    fault are quick.
    """

    def __init__(
        self,
        name: str,
        *,
        enable_v2: bool,
        extra_args: Sequence[str],
        startup_timeout: float,
        client_port: int,
        membership: tuple[str, str] | None,
    ) -> None:
        self.name = name
        self.enable_v2 = enable_v2
        self.extra_args = list(extra_args)
        self.startup_timeout = startup_timeout
        self.client_port = client_port
        # (initial-cluster, token) of a cluster member; None: a cluster of its own.
        self._membership = membership
        # "existing" once the member was replaced (it joins a running cluster then).
        self._cluster_state = "new"

    # -- addresses ----------------------------------------------------------------------

    @property
    def protocol(self) -> str:
        """``http``, or ``https`` where the member serves TLS."""
        return "http"

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:port``, as the ``endpoint`` rendezvous option wants it."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{self.protocol}://{self.endpoint}"

    @property
    @abc.abstractmethod
    def peer_url(self) -> str:
        """The peer URL the member advertises to the other members."""

    def params(self, run_id: str = "test-run", **config: Any) -> RendezvousParameters:
        """Rendezvous parameters pointing at this member.

        ``min_nodes`` (default 1), ``max_nodes`` (default ``min_nodes``) and ``backend``
        (default ``etcd-rdzv-dynamic``) may be among ``config``; the rest are options.
        """
        min_nodes = config.pop("min_nodes", 1)
        max_nodes = config.pop("max_nodes", max(min_nodes, 1))
        backend = config.pop("backend", DYNAMIC_HANDLER_NAME)
        return RendezvousParameters(backend, self.endpoint, run_id, min_nodes, max_nodes, **config)

    def _etcd_flags(self, *, data_dir: str, listen_client: str, listen_peer: str) -> list[str]:
        """The etcd flags every member gets (before its own and ``extra_args``)."""
        initial_cluster, token = self._membership or (
            f"{self.name}={self.peer_url}",
            SINGLE_MEMBER_TOKEN,
        )
        flags = [
            f"--name={self.name}",
            f"--data-dir={data_dir}",
            f"--listen-client-urls={listen_client}",
            # What clients, and etcd's member list, see.
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={listen_peer}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={initial_cluster}",
            f"--initial-cluster-token={token}",
            f"--initial-cluster-state={self._cluster_state}",
            "--heartbeat-interval=50",
            "--election-timeout=500",
        ]
        if self.enable_v2:
            flags.append("--enable-v2")
        return flags

    # -- asking the member ----------------------------------------------------------------

    def _ssl_context(self) -> ssl.SSLContext | None:
        return None

    def _ask(self, path: str, timeout: float, body: bytes | None = None) -> Any:
        """The JSON answer of ``path`` (a POST when ``body`` is given)."""
        request = urllib.request.Request(
            f"{self.client_url}{path}",
            data=body,
            headers={"Content-Type": "application/json"} if body is not None else {},
            method="GET" if body is None else "POST",
        )
        with urllib.request.urlopen(request, timeout=timeout, context=self._ssl_context()) as resp:
            return json.loads(resp.read())

    def health(self, timeout: float = 1.0) -> bool:
        """Whether ``/health`` answers true now (a member with a leader)."""
        try:
            answer = self._ask("/health", timeout)
        except (OSError, ValueError):
            return False
        return isinstance(answer, dict) and answer.get("health") == "true"

    def _can_answer(self) -> bool:
        """Whether the member may answer a request now (cheap: no request is sent)."""
        return self.running

    def _leads(self, timeout: float = 1.0) -> bool:
        """Whether the member answers, is healthy and says it is the leader.

        Asked over the v3 JSON gateway (``/v3/maintenance/status``), which every etcd
        serves with or without the v2 API. Only a healthy member is believed: one cut
        off from its peers may still think it leads.
        """
        if not self._can_answer() or not self.health(timeout):
            return False
        try:
            status = self._ask("/v3/maintenance/status", timeout, body=b"{}")
        except (OSError, ValueError):
            return False
        if not isinstance(status, dict) or not isinstance(status.get("header"), dict):
            return False
        member = str(status["header"].get("member_id") or "")
        return bool(member) and str(status.get("leader") or "") == member

    # -- life cycle ---------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def running(self) -> bool:
        """Whether the member runs (see the subclass for a paused one)."""

    @property
    @abc.abstractmethod
    def _label(self) -> str:
        """What error messages call the member, e.g. ``etcd m0``."""

    @abc.abstractmethod
    def _not_starting(self) -> str | None:
        """Why the member cannot become ready (it exited, ...), or None."""

    @abc.abstractmethod
    def launch(self) -> None:
        """Start the member (or start it again) without waiting for readiness."""

    def wait_ready(self, timeout: float | None = None) -> None:
        """Poll ``/health`` (the readiness probe) until it answers true.

        Args:
            timeout: seconds; default ``startup_timeout``. ``0`` probes once.

        Raises:
            EtcdStartError: with the log tail, if the member stops or is not healthy in
                time.
        """
        timeout = self.startup_timeout if timeout is None else timeout
        for _ in _attempts(timeout):
            if self.health():
                return
            reason = self._not_starting()
            if reason is not None:
                raise EtcdStartError(f"{self._label} {reason}.\n{self.log_tail()}")
        raise EtcdStartError(
            f"{self._label} was not healthy at {self.client_url} within the timeout "
            f"({timeout:g} s).\n{self.log_tail()}"
        )

    def start(self: _M) -> _M:
        """Start (or start again) and wait until etcd reports healthy.

        Raises:
            EtcdStartError: with the log tail, if it stops or is not ready in time.
        """
        self.launch()
        self.wait_ready()
        return self

    @abc.abstractmethod
    def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully (SIGTERM, SIGKILL after ``timeout``); the data is kept."""

    @abc.abstractmethod
    def kill(self) -> None:
        """SIGKILL: the member dies at once, as in a crash; the data is kept."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Freeze the member: connections stay open but nothing answers."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Thaw the member after :meth:`pause`."""

    def unpause(self) -> None:
        """The same as :meth:`resume` (Docker's name for it)."""
        self.resume()

    def restart(self) -> None:
        """Stop (if running) and start again on the same endpoint and data."""
        self.stop()
        self.start()

    @abc.abstractmethod
    def close(self) -> None:
        """Remove the member and its data (no graceful stop: nothing is kept)."""

    @abc.abstractmethod
    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of etcd's log."""

    def __enter__(self: _M) -> _M:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


class EtcdMemberCluster(abc.ABC, Generic[_M]):
    """Members (named ``m0``, ``m1``, ...) started together as one etcd cluster.

    ``members[i]`` (also iteration) are the members: kill, pause, resume or restart
    them to inject faults. Use as a context manager, or call :meth:`start` and
    :meth:`close`.
    """

    def __init__(self, members: list[_M]) -> None:
        self.members = members

    @staticmethod
    def _member_names(size: int) -> list[str]:
        if size < 1:
            raise ValueError(f"A cluster needs at least one member, got size={size!r}.")
        return [f"m{i}" for i in range(size)]

    @property
    def endpoint(self) -> str:
        """Every member's ``127.0.0.1:port``, comma-separated."""
        return ",".join(m.endpoint for m in self.members)

    def params(self, run_id: str = "test-run", **config: Any) -> RendezvousParameters:
        """Rendezvous parameters listing every member (see :meth:`EtcdMember.params`)."""
        params = self.members[0].params(run_id, **config)
        params.endpoint = self.endpoint
        return params

    def _prepare(self) -> None:
        """What must exist before the members launch (the subclass's)."""

    def _release(self) -> None:
        """What :meth:`close` removes after the members (the subclass's)."""

    def start(self: _C) -> _C:
        """Start every member and wait until each is healthy.

        Raises:
            EtcdStartError: as :meth:`EtcdMember.start`; the cluster is closed then
                (whatever was created is removed again).
        """
        try:
            self._prepare()
            for m in self.members:  # all at once: the first needs the others for quorum
                m.launch()
            for m in self.members:
                m.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def leader(self, timeout: float = 0.0) -> _M:
        """The member that leads now: one that answers, is healthy and says it leads
        (asked over the v3 API, so this works with or without the v2 API).

        Args:
            timeout: seconds to wait for one, as while an election runs; ``0`` asks
                every member once.

        Raises:
            EtcdNoLeaderError: no member reports being leader in time.
        """
        for _ in _attempts(timeout):
            for m in self.members:
                if m._leads():
                    return m
        raise EtcdNoLeaderError(f"No member of {self.endpoint} reports being leader.")

    def close(self) -> None:
        """Remove every member (data included) and what the cluster created."""
        for m in self.members:
            m.close()
        self._release()

    def __enter__(self: _C) -> _C:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[_M]:
        return iter(self.members)

    def __len__(self) -> int:
        return len(self.members)
