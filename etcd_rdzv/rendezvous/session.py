"""What a node holds, owned by one object: the :class:`Session`.

As etcd's ``concurrency.Session``: the session owns the node's liveness (its lease,
:class:`~etcd_rdzv._kv.Lease`, which every key it holds is on, from round to round,
and the :class:`~.heart.Heart` that renews it), the keys it wrote (its join key, the
coordinator key while it coordinates, join keys of rounds it moves on from), the
member watcher of the round it is in, and what a built handler prepared for its first
join (the lease, a started watch, a heart). Its :meth:`release` stops every thread,
revokes the lease and deletes every key; the handler's finalizer calls it, so a
handler dropped without ``shutdown()`` (or alive when the interpreter exits) still
leaves at once, rather than when its key expires. The session never references the
handler.

It also holds the node's standing between joins (the last round, its rank, whether it
is a member now): the state that outlives one ``next_rendezvous()`` call. What one
call needs lives in its :class:`~.join.Join`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import NoReturn, Protocol

from .. import _keys
from .._kv import KV, Compare, Lease, Put, Record, Watcher
from ..config.params import HandlerSettings
from ..errors import RendezvousConnectionError, RendezvousError, RendezvousStateError
from . import decisions as D
from . import records
from .heart import Heart
from .listener import Listener
from .watch import MemberWatch

__all__ = ["OtherAPIRefused", "RunChecks", "Session"]

log = logging.getLogger(__name__)

META_REFRESH = 600.0  # seconds between refreshes of the current result by rank 0


class OtherAPIRefused(RendezvousStateError):
    """This node's run lives in the other API's keyspace (see
    :func:`etcd_rdzv.client._probe.check_one_api`): it left the round, having written nothing
    the others see; the run goes on without it (so its shutdown does not close it)."""


class RunChecks(Protocol):
    """The checks a client defers to its handler's rounds (see
    :class:`etcd_rdzv.client._probe.RunChecks`): made by each round's coordinator (the other
    keyspace) and by the node that completed it (the v2 sweep), not by every node."""

    def other_api(self, established: bool) -> str | None:
        """Why this node cannot join the run on this API (the run lives in the other
        keyspace, and is not ``established`` in this one), or ``None``; never raises."""

    def sweep(self) -> None:
        """Sweep what keys leaving by TTL left behind (v2); never raises."""


class Session:
    """The keys, threads and standing of one node (see the module docstring)."""

    def __init__(
        self,
        kv: KV,
        settings: HandlerSettings,
        node_id: str,
        listener: Listener,
        checks: RunChecks | None = None,
    ) -> None:
        self.kv, self.s, self.node_id, self.listener = kv, settings, node_id, listener
        #: The checks a coordinator makes for the run (``None``: the client made them
        #: when it connected).
        self.checks = checks
        self.timeout = settings.close_timeout
        # The keys this node holds.
        self.key: str | None = None  # this node's join key
        self.value = ""  # what the join key holds
        self.coord: str | None = None  # the coordinator key, while this node holds it
        self.old: list[str] = []  # join keys of rounds this node moves on from
        self.lease: Lease | None = None  # the lease of every key above
        # Quarantine: this node's life key (on no lease: only a leave deletes it).
        self.life: str | None = None
        # Keys whose delete failed (an etcd outage): the next heart deletes them, as
        # on v3 the lease would keep them alive for as long as the node lives.
        self._undeleted: list[str] = []
        # Its threads.
        self.heart: Heart | None = None
        self.watch: MemberWatch | None = None
        self.ready: Watcher | None = None  # the watch of the next join, started early
        self.spare_heart: Heart | None = None  # the heart of the next join, started early
        self.released = False  # by release() (shutdown, a finalizer) since the join began
        # Its standing.
        self.round = 0  # the last round this node joined (0: none)
        self.rank: int | None = None
        self.joined = False  # whether the round of the join key completed with this node
        #: The run's incarnation as this node learnt it before its first join (see
        #: :mod:`.incarnation`; ``None``: not yet); kept once a join key was written
        #: under it (``incarnation_fixed``): the node belongs to that job for good.
        self.incarnation: str | None = None
        self.incarnation_fixed = False
        #: Whether this node closed the run (``set_closed()``): it never starts it again.
        self.closed_it = False
        self._meta_refreshed = 0.0

    # -- preparing a join ------------------------------------------------------------

    def prepare(self) -> None:
        """Start what the next join needs first (the watch of the round it tries
        first, the node's lease, the heart), so the join is one request.

        Raises:
            RendezvousConnectionError: etcd did not answer (the join then does it all).
        """
        s = self.s
        self.take_ready(None)
        watcher = self.kv.watcher(_keys.coord_key(s.key_prefix, s.run_id, self.round + 1))
        try:
            watcher.start()
            # The grant after the watch: the stream keeps the connection it was opened
            # on, and the grant leaves its own idle for the join's transaction (in the
            # other order the join opened a connection, on both sides, in its window).
            self.node_lease()
        except BaseException:
            watcher.close()
            raise
        self.ready = watcher
        if self.spare_heart is None:
            # It beats nothing until a join gives it the join key.
            self.spare_heart = self._new_heart()

    def node_lease(self) -> Lease:
        """The node's lease, fit to carry a new key for a whole TTL: the one it holds
        (renewed first if its last renewal is older than half its TTL), or a new one
        (v3: one request; none while the heart keeps it fresh)."""
        self.lease = self.kv.grant(self.s.node_ttl, reuse=self.lease)
        return self.lease

    def take_ready(self, key: str | None) -> Watcher | None:
        """The watcher started ahead of a join if it watches ``key``; closed if not."""
        ready, self.ready = self.ready, None
        if ready is not None and ready.key != key:
            ready.close()
            return None
        return ready

    def take_heart(self) -> Heart:
        """The heart of the join key just written: the prepared one, or a new one."""
        heart, self.spare_heart = self.spare_heart, None
        self.heart = heart if heart is not None else self._new_heart()
        undeleted, self._undeleted = self._undeleted, []
        for key in undeleted:
            self.heart.delete_later(key)
        return self.heart

    def _new_heart(self) -> Heart:
        s = self.s
        return Heart(
            self.kv,
            s.run_id,
            s.keep_alive_interval,
            s.heartbeat_timeout,
            on_beat=self.refresh_meta,
        )

    # -- the keys ----------------------------------------------------------------------

    def hold(self, key: str, value: str) -> None:
        """This node's join key is (about to be) ``key``, holding ``value``: deleted
        when the node leaves, from here on."""
        self.key, self.value, self.joined = key, value, False

    def write_again(self, key: str) -> bool:
        """The heart found the join key gone. Before completion, write it again (the
        node rejoins the round as a new arrival); after it, report the loss."""
        if self.joined or self.key != key:
            return False
        log.warning("run %s: join key %s expired; writing it again", self.s.run_id, key)
        s = self.s
        if self.incarnation is None:
            self.kv.put_owned(key, self.value, self.node_lease())
        else:
            # Only into its own job's run: the run may have been started again by a
            # new job while this node was away (frozen past its TTL).
            same = Compare(_keys.incarnation_key(s.key_prefix, s.run_id), self.incarnation)
            if not self.kv.txn([same], [Put(key, self.value, self.node_lease())]).succeeded:
                log.warning(
                    "run %s: node %s does not write its join key again: the run was "
                    "started again by a new job",
                    s.run_id,
                    self.node_id,
                )
                return False
        where = _keys.round_of(_keys.rdzv_dir(self.s.key_prefix, self.s.run_id), key)
        if where is not None:
            self.listener.on_key_written(where[0], key)
        return True

    def release_coord(self, delete: bool) -> None:
        """Stop holding the coordinator key (``delete``: delete it now)."""
        coord, self.coord = self.coord, None
        if coord is None:
            return
        if self.heart is not None:
            self.heart.drop(coord)
        if self.lease is not None:
            self.lease.forget(coord)
        if delete:
            try:
                self.kv.delete(coord)
            except RendezvousConnectionError as exc:  # it expires by itself
                log.warning("could not delete %s: %s", coord, exc)

    def abandon(self, round_no: int, *keys: str) -> NoReturn:
        """The handler was shut down (or finalized at exit) by another thread while a
        join ran: delete what the join wrote since, and end it."""
        self.coord = None
        lease, self.lease = self.lease, None
        if lease is not None:  # granted after the release, for the join's writes
            try:
                self.kv.revoke(lease, time.monotonic() + self.timeout)
            except RendezvousConnectionError as exc:  # it expires by itself
                log.warning("could not revoke %r: %s", lease, exc)
        for key in keys:
            try:
                self.kv.delete(key)
            except RendezvousConnectionError as exc:  # it expires by itself
                log.warning("could not delete %s: %s", key, exc)
        raise RendezvousError(
            f"Run {self.s.run_id!r}: node {self.node_id!r} was shut down while it joined "
            f"round {round_no}."
        )

    # -- moving between rounds ---------------------------------------------------------

    def stop_heart(self) -> None:
        heart, self.heart = self.heart, None
        if heart is not None:
            heart.stop()

    def stop_threads(self) -> None:
        self.stop_heart()
        watch, self.watch = self.watch, None
        if watch is not None:
            watch.stop()

    def move_on(self) -> None:
        """Leave the current round for the next: stop the threads, but keep the join
        key until the key of the next round is written (:meth:`drop_old`). So a member
        that re-joins is never absent from both rounds, and the next round's
        coordinator, which waits until the previous round's keys are gone, always sees
        it before it decides: a restart never swaps a member for a spare."""
        self.joined = False
        self.stop_threads()
        self._delete([self.coord])
        self.coord = None
        if self.key is not None:
            self.old.append(self.key)
            self.key = None

    def drop_old(self) -> bool:
        """Delete the join keys of the rounds this node moved on from."""
        old, self.old = self.old, []
        return self._delete(old)

    def drop_life(self) -> bool:
        """Delete this node's life key (quarantine): the agent left."""
        life, self.life = self.life, None
        return self._delete([life])

    def withdraw(self, round_no: int, timeout: float | None = None) -> Record | None:
        """Give up on round ``round_no``: take this node's join key out of the round
        unless the round's result exists (:meth:`~etcd_rdzv._kv.KV.withdraw`), so no
        result made later counts a node that will never take its rank. Returns the
        result found (the key stays: the caller sees whether it is a member), else
        ``None``. Best effort within ``timeout`` (default ``close_timeout``): when etcd
        does not answer, :meth:`leave` deletes the key as before."""
        key, s = self.key, self.s
        if key is None:
            return None
        self.key = None  # the heart must not write it again meanwhile
        try:
            bound = self.timeout if timeout is None else timeout
            with self.kv.bounded(time.monotonic() + bound):
                withdrawn, result = self.kv.withdraw(
                    key,
                    _keys.result_key(s.key_prefix, s.run_id, round_no),
                    _keys.gone_key(s.key_prefix, s.run_id, round_no, self.node_id),
                    self.node_id,
                    records.META_TTL,
                    s.node_ttl,
                )
        except RendezvousError as exc:
            log.warning(
                "run %s: node %s could not withdraw from round %d: %s",
                s.run_id,
                self.node_id,
                round_no,
                exc,
            )
            self.key = key
            return None
        if withdrawn:
            if self.lease is not None:
                self.lease.forget(key)
            return None
        self.key = key
        return result

    def leave(self) -> bool:
        """Not a member any more: stop the threads and delete the keys (within
        ``close_timeout``; a key that cannot be deleted expires by itself). Returns
        whether all went."""
        self.joined = False
        return self.release()

    def release(self) -> bool:
        """Stop every thread, revoke the lease and delete every key (the finalizer's
        call too)."""
        self.released = True
        self.stop_threads()
        self.take_ready(None)
        spare, self.spare_heart = self.spare_heart, None
        if spare is not None:
            spare.stop()
        keys = [self.coord, self.key, *self.old, self.life]
        self.coord = self.key = self.life = None
        self.old = []
        deadline = time.monotonic() + self.timeout
        lease, self.lease = self.lease, None
        went: list[str] = []
        if lease is not None:
            try:
                with self.kv.bounded(deadline):
                    went = self.kv.revoke(lease, deadline)
            except Exception:  # a finalizer at exit, say; the keys are deleted below
                log.warning("could not revoke %r", lease, exc_info=True)
        ok = self._delete([k for k in keys if k not in went], deadline)
        self._undeleted = []  # the lease is renewed no more: they expire with it
        return ok

    def _delete(self, keys: Sequence[str | None], deadline: float | None = None) -> bool:
        ok = True
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        for key in keys:
            if key is None:
                continue
            if self.lease is not None:
                self.lease.forget(key)
            try:
                with self.kv.bounded(deadline):
                    self.kv.delete(key)
            except RendezvousConnectionError as exc:
                log.warning("could not delete %s (trying again later): %s", key, exc)
                self._undeleted.append(key)
                ok = False
            except Exception:  # a finalizer at exit, say, after the client was closed
                log.warning("could not delete %s", key, exc_info=True)
                ok = False
        return ok

    # -- as a member -------------------------------------------------------------------

    def num_waiting(self) -> int:
        """Nodes that want in, members gone, and this node's own loss (see
        :meth:`EtcdRendezvousHandler.num_nodes_waiting`); no etcd request. 0 once the
        run is closed: a re-rendezvous could only fail, and would stop this node's
        workers (a member that finished first closes the run and leaves)."""
        watch, heart = self.watch, self.heart
        if watch is None or watch.closed:
            return 0
        lost = 1 if heart is not None and heart.lost.is_set() else 0
        broken = 1 if watch.broken else 0
        s = self.s
        waiting = D.nodes_waiting(
            watch.world_size, s.max_nodes, watch.waiting, watch.missing, s.node_unit
        )
        return waiting + lost + broken

    def refresh_meta(self) -> None:
        """Rank 0 keeps the round's result and the hint alive while the round runs
        (called by the heart after each beat)."""
        if not self.joined or self.rank != 0:
            return
        if time.monotonic() - self._meta_refreshed < META_REFRESH:
            return
        s = self.s
        self._meta_refreshed = time.monotonic()
        self.kv.refresh(_keys.result_key(s.key_prefix, s.run_id, self.round), records.META_TTL)
        self.kv.refresh(_keys.hint_key(s.key_prefix, s.run_id), records.META_TTL)
        self.kv.refresh(_keys.incarnation_key(s.key_prefix, s.run_id), records.META_TTL)
