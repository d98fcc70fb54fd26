"""Our own rendezvous handler, with torch's ``RendezvousHandler`` interface: the facade.

How a round forms (keys in :mod:`etcd_rdzv._keys`):

* each node writes its **own** join key ``rdzv/r<N>/nodes/<node>`` with a TTL and keeps
  it alive with heartbeats: no key that every node must win a compare-and-set on;
* one node per round, the **coordinator** (:mod:`.coordinator`), holds
  ``rdzv/r<N>/coord``. Only it follows the membership, and it writes the round's
  result (create-if-absent: exactly one write wins) and announces it in its key;
* every other node, a **follower** (:mod:`.follower`), watches nothing but the
  coordinator key, and adopts the announced result;
* a coordinator that dies lets its key expire; followers see the expiry, read the
  result (the coordinator may have finished), and otherwise one of them takes over;
* a node that is not in the result joins round ``N+1`` and *waits*: members see it
  through :meth:`EtcdRendezvousHandler.num_nodes_waiting`. Round ``N+1`` forms only
  after every member of round ``N`` left it (re-joined or died), so two groups never
  run side by side;
* after completion members keep heartbeating; a member whose key expires (it died)
  makes ``num_nodes_waiting()`` positive on the others, so their agent re-rendezvouses.

A follower's join is one transaction (its key written, the coordinator key read, its
previous round's key swapped out) and one watch; the coordinator makes one listing
and follows a watch. So a round of N nodes costs O(N) etcd requests in all.

The pieces: a :class:`~.session.Session` owns what the node holds (lease, heart, keys,
watchers, the finalizer's clean-up); each :meth:`~EtcdRendezvousHandler.next_rendezvous`
creates a :class:`~.join.Join`; listeners (:mod:`.listener`) hear events, progress and
join-key writes. State is JSON. Liveness is etcd's TTL, never a wall clock compared
across hosts.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import _keys
from .._kv import KV
from ..admission.health import HealthCheckError, gate
from ..admission.hosts import HostExcluded
from ..admission.quarantine import check_in
from ..client import connect_handler
from ..config._node import node_address
from ..config.params import (
    HANDLER_NAME,
    LEAVE_GRACE,
    STATIC_HANDLER_NAME,
    HandlerSettings,
    Settings,
)
from ..errors import RendezvousConnectionError
from ..store import EtcdStore
from .incarnation import close_run, look_ahead
from .join import Join
from .listener import HandlerEvent, Listener, Listeners, State, events, formed
from .progress import Progress
from .roster import Roster
from .session import OtherAPIRefused, RunChecks, Session

__all__ = [
    "HANDLER_NAME",
    "STATIC_HANDLER_NAME",
    "EtcdRendezvousHandler",
    "RendezvousResult",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RendezvousResult:
    """What :meth:`EtcdRendezvousHandler.next_rendezvous` returns without torch."""

    rank: int
    world_size: int
    store: EtcdStore
    round: int
    roster: Roster = field(repr=False)

    @property
    def members(self) -> tuple[str, ...]:
        """Node ids in rank order. A member of a large round learns only its own rank
        when it joins: the list is then read from etcd when first asked (which may
        raise RendezvousConnectionError or RendezvousStateError)."""
        return self.roster.members

    @property
    def addrs(self) -> tuple[str, ...]:
        """Their addresses, in rank order (as :attr:`members`)."""
        return self.roster.addrs


class EtcdRendezvousHandler:
    """The native etcd rendezvous handler (backend name ``etcd-rdzv``).

    Build it with :func:`etcd_rdzv.create_handler`. Thread-safe for the agent's use:
    one thread calls :meth:`next_rendezvous`, others may call the rest.

    While a join waits, what it waits for (nodes joined of min/max, the last call's
    count-down, spares, static ranks missing; a follower: its coordinator) is told to
    the listeners (:meth:`add_listener`) every few seconds and when it changes, and
    logged on the events logger (``etcd_rdzv.events``, INFO) after 10 s of waiting and
    every 30 s after; so are each round formed and each member seen gone.
    """

    def __init__(
        self,
        kv: KV,
        settings: HandlerSettings,
        store_factory: Callable[[str], EtcdStore],
        local_addr: str | None = None,
        node_id: str | None = None,
        close_on_shutdown: bool = False,
        checks: RunChecks | None = None,
    ) -> None:
        #: Whether :meth:`shutdown` also closes the run (torchrun's entry point sets it).
        self.close_on_shutdown = close_on_shutdown
        self._kv = kv
        self._s = settings
        self._store_factory = store_factory
        self._addr = local_addr or socket.getfqdn()
        self._id = node_id or f"{socket.gethostname()}_{uuid.uuid4().hex[:12]}"
        self._lock = threading.Lock()
        self._listeners = Listeners()
        self._session = Session(kv, settings, self._id, self._listeners, checks)
        # A handler dropped without shutdown() (or alive at interpreter exit) still
        # leaves at once: the finalizer releases the session, which never references
        # the handler.
        self._finalizer = weakref.finalize(self, self._session.release)
        #: Whether the last join failed its health check or was refused because its
        #: host is excluded: the run goes on without this node, so its shutdown does
        #: not close it for the others.
        self._kept_out = False
        # Quarantine: this handler's agent checks in (writes its life) once, at its
        # first join, and never after shutdown(): a join racing the agent's exit must
        # not leave a life behind that its host's next agent would count as a death.
        self._checked_in = False
        self._shut_down = False
        # The last round this node was a member of, with its members, addresses and
        # hosts (not known for a large round): the next round's event names who is not
        # back.
        self._before: tuple[int, tuple[str, ...], tuple[str, ...], tuple[str, ...]] | None = None

    # -- small accessors ----------------------------------------------------------------

    @classmethod
    def from_settings(
        cls, settings: Settings, store_cls: type[EtcdStore] = EtcdStore
    ) -> EtcdRendezvousHandler:
        """A handler of this class for ``settings`` (already validated), its rounds'
        stores of ``store_cls``, connected and with its first join prepared.

        Raises:
            RendezvousConnectionError: etcd did not answer the first requests (with
                the diagnosis of what was wrong, as a probe would give it).
        """
        addr = node_address(settings.local_addr, settings.handler.max_nodes, settings.run_id)
        kv, checks = connect_handler(settings.client)
        ttl = settings.store_ttl

        def store_factory(prefix: str) -> EtcdStore:
            return store_cls(kv, prefix, ttl=ttl)

        try:
            if kv.api == "v2":  # v2 prepares nothing from etcd: one read probes it
                kv.probe(settings.client.key_prefix)
            handler = cls(kv, settings.handler, store_factory, local_addr=addr, checks=checks)
            # The first join then needs its lease and one transaction (v3: the watch of
            # its round is opened and the run read here). These are the handler's first
            # requests: an etcd that does not answer them fails the build, as a probe
            # would.
            handler.prepare_join()
        except RendezvousConnectionError as exc:
            kv.close()
            raise checks.diagnosed(exc) from exc
        except BaseException:
            kv.close()
            raise
        return handler

    def get_backend(self) -> str:
        """``etcd-rdzv`` (``etcd-rdzv-static`` with a fixed rank): the name torchrun
        knows this handler by."""
        return HANDLER_NAME if self._s.rank is None else STATIC_HANDLER_NAME

    def get_run_id(self) -> str:
        return self._s.run_id

    @property
    def node_id(self) -> str:
        return self._id

    @property
    def address(self) -> str:
        """The address this node publishes to the others."""
        return self._addr

    @property
    def settings(self) -> HandlerSettings:
        return self._s

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The etcd endpoints this handler talks to, the one in use first."""
        return tuple(str(e) for e in self._kv.endpoints)

    @property
    def round(self) -> int:
        """The last round this node joined (0: none yet)."""
        return self._session.round

    @property
    def use_agent_store(self) -> bool:
        """False: workers bootstrap from ``MASTER_ADDR``/``MASTER_PORT`` set by rank 0."""
        return False

    def add_listener(self, listener: Listener) -> None:
        """Let ``listener`` hear this handler's events, progress, join-key writes and
        completed rounds, from now on."""
        self._listeners.add(listener)

    def remove_listener(self, listener: Listener) -> None:
        self._listeners.remove(listener)

    def prepare_join(self) -> None:
        """Do now what the next join does first and costs etcd no raft proposal:
        start the watch of the round it tries first, start the thread that will keep
        its key alive, and read the run (v3: the join of a started run is then guarded
        by its incarnation; an unstarted one is started from this read, with no refused
        write first). The join's lease is granted by the join (one request, none while
        the heart keeps an earlier one fresh). The handler factories call it when they
        build a handler; a watch older than ``read_timeout`` is opened again by the
        join. Not while a join runs.

        Raises:
            RendezvousConnectionError: etcd did not answer (the join then does it all).
        """
        self._session.prepare()
        look_ahead(self._session)

    def _event(self, method: str, message: str, state: State = "RUNNING") -> None:
        self._listeners.on_event(HandlerEvent(self._s.run_id, self._id, method, message, state))

    # -- closing ------------------------------------------------------------------------

    def is_closed(self) -> bool:
        """Whether :meth:`set_closed` was called for this run (by any node)."""
        try:
            record, _ = self._kv.get(_keys.closed_key(self._s.key_prefix, self._s.run_id))
        except Exception as exc:
            self._event("is_closed", f"{type(exc).__name__}: {exc}", "FAILED")
            raise
        return record is not None

    def set_closed(self) -> None:
        """Close the run: every later join fails with RendezvousClosedError."""
        self._session.note_closed()  # this node never starts the run again
        try:
            close_run(self._kv, self._s.key_prefix, self._s.run_id)
        except Exception as exc:
            self._event("set_closed", f"{type(exc).__name__}: {exc}", "FAILED")
            raise
        log.info("run %s closed by node %s", self._s.run_id, self._id)
        self._event(
            "set_closed",
            f"The node {self._id!r} closed the rendezvous {self._s.run_id!r}.",
            "SUCCEEDED",
        )

    # -- membership signals -------------------------------------------------------------

    def num_nodes_waiting(self) -> int:
        """Nodes that want in (waiting for the next round), plus members of the current
        round that died or left; non-zero means the agent should re-rendezvous.

        Nodes waiting that a new round could not take (the group has ``max_nodes``
        members, or they are short of a whole ``node_unit``) are *spares* and do not
        count; they count once a member is gone. This node's own key lost, or the
        watcher unable to read the run, counts too: the handler fails towards a
        re-rendezvous, never towards silence. Once the run is closed it is 0 (a
        member that finished first closes the run and leaves; a re-rendezvous could
        only fail). No etcd request: a watcher thread keeps the counts."""
        return self._session.num_waiting()

    def live_peers(self) -> int:
        """Members of this node's running round besides itself whose keys its watcher
        still sees (0: not a member now, or the run is closed); no etcd request."""
        return self._session.live_peers()

    # -- the join ----------------------------------------------------------------------

    def next_rendezvous(self) -> Any:
        """Join the next round and block until it completes.

        Returns:
            :class:`RendezvousResult` (with torch: torch's ``RendezvousInfo``).

        Raises:
            RendezvousClosedError: the run is closed.
            RendezvousTimeoutError: the round did not complete within ``join_timeout``.
            RendezvousConnectionError: etcd could not be reached.
            HealthCheckError: the ``health_check`` failed until ``join_timeout`` was
                spent; this node did not join (nor, under torchrun, closes the run).
            HostExcluded: this node's host is excluded (by an operator, or
                quarantined now: see :mod:`.quarantine`); it did not join.
        """
        with self._lock:
            return self._join()

    def _join(self) -> RendezvousResult:
        s, session = self._s, self._session
        started = time.monotonic()
        deadline = started + s.join_timeout
        try:
            if not (self._checked_in or self._shut_down):  # a host that keeps dying stays out
                with self._kv.bounded(deadline):
                    session.hold_life(check_in(self._kv, s, self._id))
                self._checked_in = True
                if self._shut_down:  # shutdown() ran while this join checked in
                    session.drop_life()
            # The health gate: no join key (so no round) before the check passed.
            gate(self._kv, s, self._id, deadline)
        except (HealthCheckError, HostExcluded) as exc:
            self._kept_out = True
            self._event("next_rendezvous", f"{type(exc).__name__}: {exc}", "FAILED")
            raise
        self._kept_out = False
        progress = None
        if self._listeners.hears_progress() or Progress.logged():
            last = session.round if session.is_member else 0
            progress = Progress.start(s.run_id, self._id, self._listeners, last)
        try:
            # Every request of the join ends by the deadline (plus a moment to leave
            # cleanly), whatever etcd does: join_timeout is a bound, not a hint.
            with self._kv.bounded(deadline + LEAVE_GRACE):
                joined = Join(session, self._addr, deadline, progress).run()
        except (HostExcluded, OtherAPIRefused):
            self._kept_out = True  # the run goes on without this host (or this API)
            raise
        finally:
            if progress is not None:
                progress.stop()
        round_no, listed = joined.round, joined.listed
        store = self._store_factory(f"{_keys.store_dir(s.key_prefix, s.run_id)}/r{round_no}")
        took = time.monotonic() - started
        line = formed(round_no, joined.rank, joined.world_size, took, listed, self._before)
        events.info("run %s: node %s: %s", s.run_id, self._id, line)
        self._before = None if listed is None else (round_no, *listed)
        return RendezvousResult(joined.rank, joined.world_size, store, round_no, joined.roster)

    # -- shutdown -----------------------------------------------------------------------

    def shutdown(self) -> bool:
        """Leave: stop heartbeats and watches and delete this node's key.

        With :attr:`close_on_shutdown` it first closes the run (unless its last join
        failed its health check or was refused because its host is excluded: the
        others go on without it), as torch's own handlers do: torch's launcher calls
        ``shutdown()`` only when its agent is done (never when a signal killed it),
        and an agent that arrives later must then get RendezvousClosedError instead
        of starting the job again.
        """
        ok = True
        self._shut_down = True
        if self.close_on_shutdown and not self._kept_out:
            try:
                with self._kv.bounded(time.monotonic() + self._s.close_timeout):
                    self.set_closed()
            except RendezvousConnectionError as exc:
                log.warning("run %s: node %s could not close it: %s", self._s.run_id, self._id, exc)
                ok = False
        if not self._session.leave():
            log.warning("run %s: shutdown of node %s incomplete", self._s.run_id, self._id)
            self._event(
                "shutdown",
                f"The node {self._id!r} failed to shut down the rendezvous {self._s.run_id!r}.",
                "FAILED",
            )
            return False
        self._event(
            "shutdown",
            f"The node {self._id!r} left the rendezvous {self._s.run_id!r}.",
            "SUCCEEDED",
        )
        if not ok:
            self._event(
                "shutdown",
                f"The node {self._id!r} could not close the rendezvous {self._s.run_id!r}.",
                "FAILED",
            )
        return ok
