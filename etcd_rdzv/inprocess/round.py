"""One round as the training function sees it: its rank, world size and store, the
process group built on that store, the check at step boundaries, and its teardown.

A :class:`Round` is made by :func:`etcd_rdzv.inprocess.run` for each call of the
function; the function builds its group through :meth:`Round.init_process_group`,
which records the group's connections (:mod:`.sockets`) and starts the round's
:class:`~.guard.Guard`.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from . import sockets
from .guard import Guard, round_broken

if TYPE_CHECKING:
    from ..rendezvous import EtcdRendezvousHandler
    from ..torch import TorchEtcdStore

__all__ = ["DEFAULT_PG_TIMEOUT", "Regroup", "Round", "RoundBroken"]

log = logging.getLogger(__name__)

#: Seconds a collective of a round's process group may block (gloo's default is 30 min).
DEFAULT_PG_TIMEOUT = 30.0


class RoundBroken(RuntimeError):
    """A member of the round is gone (died, froze past its lease, or left): the
    function should end; :func:`~etcd_rdzv.inprocess.run` forms the next round."""


class Regroup(RuntimeError):
    """Nodes wait to join (a scale-up, or a repaired host): the function should end
    at this step boundary so that the next round takes them in."""


def etcd_addresses(endpoints: Iterable[tuple[str, int]]) -> tuple[set[tuple[str, int]], set[int]]:
    """The addresses of the etcd endpoints (never cut); the ports of those whose host
    does not resolve (then every connection to such a port is left alone)."""
    addrs: set[tuple[str, int]] = set()
    ports: set[int] = set()
    for host, port in endpoints:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            ports.add(port)
            continue
        for info in infos:
            addrs.add((str(info[4][0]), port))
    return addrs, ports


class Round:
    """A round of the job, for one call of the training function.

    Attributes:
        rank: this process's rank, ``0 .. world_size - 1``.
        world_size: the members of the round.
        round: the rendezvous round's number (grows through the job).
        call: which call of the function this is in this process (0 first).
        failures: this process's own failures so far (a peer's do not count).
        store: the round's ``torch.distributed.Store`` over etcd, under a directory
            of its own; no host holds it.
        members: the members' node ids, in rank order.
        pg_timeout: the seconds a collective of :meth:`init_process_group`'s group
            may block.
    """

    def __init__(
        self,
        handler: EtcdRendezvousHandler,
        *,
        rank: int,
        world_size: int,
        round_no: int,
        call: int,
        failures: int,
        store: TorchEtcdStore,
        members: tuple[str, ...],
        pg_timeout: float,
        etcd: tuple[set[tuple[str, int]], set[int]],
        guard: bool = True,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.round = round_no
        self.call = call
        self.failures = failures
        self.store = store
        self.members = members
        self.pg_timeout = pg_timeout
        self._handler = handler
        self._etcd = etcd
        self._use_guard = guard
        self._lock = threading.Lock()
        self._conns: dict[int, sockets.Conn] = {}
        self._cut = False
        self._guard: Guard | None = None

    def __repr__(self) -> str:
        return (
            f"Round(rank={self.rank}, world_size={self.world_size}, round={self.round}, "
            f"call={self.call})"
        )

    # -- the function's calls -----------------------------------------------------------

    def init_process_group(self, backend: str = "gloo", **kwargs: Any) -> None:
        """Build torch's default process group for this round: on :attr:`store`, with
        :attr:`rank`, :attr:`world_size` and ``timeout=pg_timeout`` (``kwargs`` go to
        ``torch.distributed.init_process_group``). Its connections are recorded, to
        be cut when the round breaks (Linux; elsewhere ``pg_timeout`` bounds a
        collective blocked on a frozen peer).

        Raises:
            ValueError: ``store``, ``rank``, ``world_size`` or ``timeout`` given: the
                round sets them.
            RuntimeError: torch's (a default group exists already, a peer failed).
        """
        taken = {"store", "rank", "world_size", "timeout", "init_method"} & set(kwargs)
        if taken:
            raise ValueError(
                f"Round.init_process_group sets {sorted(taken)} itself; give "
                "pg_timeout to run() for the timeout."
            )
        from .. import torch as torch_integration

        before = sockets.snapshot()
        torch_integration.init_group(
            self.store, self.rank, self.world_size, backend, self.pg_timeout, **kwargs
        )
        self._record(before)
        if self._use_guard:
            self._start_guard()

    def check(self) -> None:
        """Raise if the round should end (no etcd request: the handler's counts).
        Call it at step boundaries.

        Raises:
            RoundBroken: a member is gone.
            Regroup: nodes wait to join; or this node lost its lease, or its watch of
                the run failed (the handler fails towards a new round, never towards
                silence).
        """
        waiting, live = self._counts()
        guard = self._guard
        if (guard is not None and guard.fired.is_set()) or round_broken(
            self.world_size, waiting, live
        ):
            raise RoundBroken(
                f"round {self.round}: a member is gone ({live + 1} of {self.world_size} left)"
            )
        if waiting > 0:
            raise Regroup(f"round {self.round}: {waiting} node(s) wait to join")

    @property
    def broken(self) -> bool:
        """Whether the round is broken now (see :meth:`check`)."""
        guard = self._guard
        if guard is not None and guard.fired.is_set():
            return True
        return round_broken(self.world_size, *self._counts())

    # -- for run() ----------------------------------------------------------------------

    @property
    def guard_fired(self) -> bool:
        guard = self._guard
        return guard is not None and guard.fired.is_set()

    def closed_by_peer(self) -> bool:
        """Whether a peer closed one of the group's connections (read before this
        process cuts them itself): the round failed because of a peer."""
        with self._lock:
            if self._cut or not self._conns:
                return False
            try:
                table = sockets.read_tcp_table()
            except (OSError, ValueError) as exc:
                log.info("could not read the TCP table: %s", exc)
                return False
            return sockets.closed_by_peer(self._conns, table)

    def cut(self) -> int:
        """Shut down this process's connections of the group (once); returns how many."""
        with self._lock:
            if self._cut:
                return 0
            self._cut = True
            return sum(sockets.cut(fd, c.inode) for fd, c in self._conns.items())

    def teardown(self) -> None:
        """End the round in this process: stop the guard, cut the group's connections
        (so peers blocked with this process fail at once, whoever still holds the old
        group), and destroy every process group."""
        if self._guard is not None:
            self._guard.stop()
        self.cut()
        from .. import torch as torch_integration

        # Every group, whoever built it: the next call builds the default group again.
        torch_integration.destroy_groups()

    def _counts(self) -> tuple[int, int]:
        return self._handler.num_nodes_waiting(), self._handler.live_peers()

    def _record(self, before: set[int] | None) -> None:
        fds = sockets.open_sockets()
        if before is None or fds is None:
            log.info("no /proc here: a collective blocked on a frozen peer ends at pg_timeout")
            return
        try:
            table = sockets.read_tcp_table()
        except (OSError, ValueError) as exc:
            log.warning("could not read the TCP table (%s): collectives end at pg_timeout", exc)
            return
        addrs, ports = self._etcd
        with self._lock:
            self._conns = sockets.group_connections(before, fds, table, addrs, ports)
        log.debug("round %s: %d connection(s) of the group", self.round, len(self._conns))

    def _start_guard(self) -> None:
        def on_broken() -> None:
            n = self.cut()
            log.info("round %s broken: cut %d connection(s) of its group", self.round, n)

        self._guard = Guard(self.world_size, self._counts, on_broken)
        self._guard.start()
