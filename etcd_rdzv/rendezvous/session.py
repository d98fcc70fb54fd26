"""What a node holds, owned by one object: the :class:`Session`.

As etcd's ``concurrency.Session``: the session owns the node's liveness (its lease,
:class:`~etcd_rdzv._kv.Lease`, which every key it holds is on, from round to round,
and the :class:`~.heart.Heart` that renews it), the keys it wrote (its join key, the
coordinator key while it coordinates, join keys of rounds it moves on from), the
member watcher of the round it is in, and what a built handler prepared for its first
join (a started watch, a heart). Its :meth:`release` stops every thread,
revokes the lease and deletes every key; the handler's finalizer calls it, so a
handler dropped without ``shutdown()`` (or alive when the interpreter exits) still
leaves at once, rather than when its key expires. The session never references the
handler.

It also holds the node's standing between joins (the last round, its rank, whether it
is a member now, the run's incarnation it belongs to): the state that outlives one
``next_rendezvous()`` call. What one call needs lives in its :class:`~.join.Join`.

Its surface is closed: its fields are private, others read them through properties
and change them only through its methods (:meth:`~Session.prepare`,
:meth:`~Session.hold` and :meth:`~Session.entered` for a join key,
:meth:`~Session.hold_coord`, :meth:`~Session.become_member`,
:meth:`~Session.withdraw`, :meth:`~Session.move_on`, :meth:`~Session.leave`,
:meth:`~Session.release`). The handler changes nothing in it but through those.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import NoReturn, Protocol

from .. import _keys
from .._kv import KV, Compare, Lease, Put, Record, Watcher
from ..config.params import HandlerSettings
from ..errors import RendezvousConnectionError, RendezvousError, RendezvousStateError
from . import completion, records
from . import decisions as D
from .heart import Heart
from .listener import Listener
from .roster import Membership
from .watch import MemberWatch

__all__ = ["Listed", "OtherAPIRefused", "RunChecks", "Session"]

log = logging.getLogger(__name__)

META_REFRESH = 600.0  # seconds between refreshes of the current result by rank 0
_WATCH_SPREAD = 1.0  # seconds over which the members' watchers of a new round start

#: A round's members, their addresses and hosts (``""`` where unknown), in rank order.
Listed = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]


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
        self._kv, self._s, self._node_id, self._listener = kv, settings, node_id, listener
        self._checks = checks
        self._timeout = settings.close_timeout
        # The keys this node holds.
        self._key: str | None = None  # this node's join key
        self._value = ""  # what the join key holds
        self._coord: str | None = None  # the coordinator key, while this node holds it
        self._old: list[str] = []  # join keys of rounds this node moves on from
        self._lease: Lease | None = None  # the lease of every key above
        # Quarantine: this node's life key (on no lease: only a leave deletes it).
        self._life: str | None = None
        # Keys whose delete failed (an etcd outage): the next heart deletes them, as
        # on v3 the lease would keep them alive for as long as the node lives.
        self._undeleted: list[str] = []
        # Its threads.
        self._heart: Heart | None = None
        self._watch: MemberWatch | None = None
        self._ready: Watcher | None = None  # the watch of the next join, started early
        self._spare_heart: Heart | None = None  # the heart of the next join, started early
        # A coordinator's housekeeping after its announcement (the round hint, old
        # rounds' keys): a leave waits for it, so nothing is written after a shutdown.
        self._chores: list[threading.Thread] = []
        self._released = False  # by release() (shutdown, a finalizer) since the join began
        # Its standing.
        self._round = 0  # the last round this node joined (0: none)
        self._rank: int | None = None
        self._joined = False  # whether the round of the join key completed with this node
        self._incarnation: str | None = None
        self._incarnation_fixed = False
        # (when, revision, round hint there) of a read that found the run unstarted.
        self._unstarted: tuple[float, int, bool] | None = None
        self._closed_it = False
        self._meta_refreshed = 0.0

    # -- what others read --------------------------------------------------------------

    @property
    def kv(self) -> KV:
        return self._kv

    @property
    def s(self) -> HandlerSettings:
        """The handler's settings."""
        return self._s

    @property
    def node_id(self) -> str:
        return self._node_id

    @property
    def listener(self) -> Listener:
        """Who hears the node's events, progress, key writes and rounds."""
        return self._listener

    @property
    def checks(self) -> RunChecks | None:
        """The checks a coordinator makes for the run (``None``: the client made them
        when it connected)."""
        return self._checks

    @property
    def round(self) -> int:
        """The last round this node joined (0: none)."""
        return self._round

    @property
    def rank(self) -> int | None:
        """This node's rank in :attr:`round` (``None``: it was never a member)."""
        return self._rank

    @property
    def is_member(self) -> bool:
        """Whether :attr:`round` completed with this node, and it has not moved on
        from it (nor left)."""
        return self._joined

    @property
    def incarnation(self) -> str | None:
        """The run's incarnation as this node learnt it before its first join (see
        :mod:`.incarnation`; ``None``: not yet)."""
        return self._incarnation

    @property
    def incarnation_fixed(self) -> bool:
        """Whether a join key was written under :attr:`incarnation`: the node belongs
        to that job for good."""
        return self._incarnation_fixed

    @property
    def closed_it(self) -> bool:
        """Whether this node closed the run (``set_closed()``): it never starts it
        again."""
        return self._closed_it

    @property
    def coord(self) -> str | None:
        """The coordinator key, while this node holds it."""
        return self._coord

    @property
    def heart(self) -> Heart | None:
        """The thread that keeps this node's keys alive (``None``: between joins)."""
        return self._heart

    @property
    def watch(self) -> MemberWatch | None:
        """The member watcher of :attr:`round`, while this node is its member."""
        return self._watch

    @property
    def holds_key(self) -> bool:
        """Whether this node holds a join key (written, or being written) in the round
        it joins now."""
        return self._key is not None

    @property
    def moved_from(self) -> str | None:
        """The join key of the last round this node moved on from, which its next
        write swaps out (``None``: none left)."""
        return self._old[-1] if self._old else None

    # -- what the handler tells it -----------------------------------------------------

    def hold_life(self, life: str | None) -> None:
        """Quarantine: this node's life key (``None``: none); only a leave deletes it."""
        self._life = life

    def note_closed(self) -> None:
        """This node closes the run (``set_closed()``): it never starts it again."""
        self._closed_it = True

    # -- the run's incarnation (see .incarnation) ------------------------------------------

    def learn_incarnation(self, incarnation: str) -> None:
        """The run's incarnation this node joins (before its first join key)."""
        self._incarnation = incarnation

    def note_unstarted(self, revision: int, established: bool) -> None:
        """A read at revision ``revision`` found the run open and with no incarnation
        (``established``: whether the round hint was there); see
        :func:`.incarnation.look_ahead`."""
        self._unstarted = (time.monotonic(), revision, established)

    def take_unstarted(self) -> tuple[int, bool] | None:
        """``(revision, established)`` of :meth:`note_unstarted`, once, if it was noted
        less than half a node TTL ago (an older read would only be read again)."""
        noted, self._unstarted = self._unstarted, None
        if noted is None or time.monotonic() - noted[0] > self.s.node_ttl / 2:
            return None
        return noted[1], noted[2]

    def forget_incarnation(self) -> None:
        """The run was started again before this node wrote a join key under the
        incarnation it learnt: learn the new one."""
        assert not self._incarnation_fixed
        self._incarnation = None

    # -- preparing a join ------------------------------------------------------------

    def prepare(self) -> None:
        """Start what the next join needs first and costs etcd no raft proposal (the
        watch of the round it tries first, the heart), so the join is its lease (if
        the node holds none fresh) and one transaction.

        The lease is not granted here: a grant is a proposal through raft, and one
        made before the join only helps a handler built long before it joins, which
        an agent's is not (it joins at once, and later joins keep their lease). A
        lease granted ahead ran out unused wherever the join came more than a TTL
        later (at a loaded first start of 4,096 nodes here: up to 0.6 grants per node
        more, each also revoked by etcd through raft when it expired).

        Raises:
            RendezvousConnectionError: etcd did not answer (the join then does it all).
        """
        s = self.s
        self.take_ready(None)
        watcher = self.kv.watcher(_keys.coord_key(s.key_prefix, s.run_id, self._round + 1))
        try:
            watcher.start()
        except BaseException:
            watcher.close()
            raise
        self._ready = watcher
        if self._spare_heart is None:
            # It beats nothing until a join gives it the join key.
            self._spare_heart = self._new_heart()

    def node_lease(self) -> Lease:
        """The node's lease, fit to carry a new key for a whole TTL: the one it holds
        (renewed first if its last renewal is older than half its TTL), or a new one
        (v3: one request; none while the heart keeps it fresh)."""
        self._lease = self.kv.grant(self.s.node_ttl, reuse=self._lease)
        return self._lease

    def take_ready(self, key: str | None) -> Watcher | None:
        """The watcher started ahead of a join if it watches ``key``; closed if not."""
        ready, self._ready = self._ready, None
        if ready is not None and ready.key != key:
            ready.close()
            return None
        return ready

    def _take_heart(self) -> Heart:
        """The heart of the join key just written: the one that beats already (the
        join tried again after a failed request), the prepared one, or a new one."""
        if self._heart is None:
            heart, self._spare_heart = self._spare_heart, None
            self._heart = heart if heart is not None else self._new_heart()
        undeleted, self._undeleted = self._undeleted, []
        for key in undeleted:
            self._heart.delete_later(key)
        return self._heart

    def _new_heart(self) -> Heart:
        s = self.s
        return Heart(
            self.kv,
            s.run_id,
            s.renew_every,
            s.heartbeat_timeout,
            on_beat=self._refresh_meta,
        )

    # -- the keys ----------------------------------------------------------------------

    def hold(self, key: str, value: str) -> None:
        """This node's join key is (about to be) ``key``, holding ``value``: deleted
        when the node leaves, from here on."""
        self._key, self._value, self._joined = key, value, False

    def unhold(self) -> None:
        """The key :meth:`hold` named was not written (a guard of its write failed)."""
        self._key = None

    def entered(self, round_no: int, key: str, swapped: str | None) -> None:
        """The join key ``key`` (held by :meth:`hold`) is written in round
        ``round_no``, in the transaction that deleted ``swapped`` (the key it moved on
        from, if any): the node belongs to the incarnation it wrote under for good,
        leaves the rounds it moved on from, and its heart keeps the key alive (and
        writes it again should it go before the round completes).

        Raises:
            RendezvousError: the handler was shut down meanwhile (the key is deleted).
        """
        self._incarnation_fixed = self._incarnation is not None
        if swapped is not None:
            self._old.remove(swapped)
        self._drop_old()  # this node is in the new round now: leave the old
        heart = self._take_heart()
        if self._released:
            heart.stop()
            self._abandon(round_no, key)
        heart.keep(key, self.node_lease(), on_gone=self._write_again, required=True)

    def _write_again(self, key: str) -> bool:
        """The heart found the join key gone. Before completion, write it again (the
        node rejoins the round as a new arrival); after it, report the loss."""
        if self._joined or self._key != key:
            return False
        log.warning("run %s: join key %s expired; writing it again", self.s.run_id, key)
        s = self.s
        if self._incarnation is None:
            self.kv.put_owned(key, self._value, self.node_lease())
        else:
            # Only into its own job's run: the run may have been started again by a
            # new job while this node was away (frozen past its TTL).
            same = Compare(_keys.incarnation_key(s.key_prefix, s.run_id), self._incarnation)
            if not self.kv.txn([same], [Put(key, self._value, self.node_lease())]).succeeded:
                log.warning(
                    "run %s: node %s does not write its join key again: the run was "
                    "started again by a new job",
                    s.run_id,
                    self._node_id,
                )
                return False
        where = _keys.round_of(_keys.rdzv_dir(self.s.key_prefix, self.s.run_id), key)
        if where is not None:
            self.listener.on_key_written(where[0], key)
        return True

    def hold_coord(self, round_no: int, key: str, coord: str) -> None:
        """This node holds ``coord``, the coordinator key of round ``round_no`` (its
        join key there: ``key``): its heart keeps it alive with the join key.

        Raises:
            RendezvousError: the handler was shut down meanwhile (both keys are deleted).
        """
        self._coord = coord
        heart = self._heart
        if heart is None or self._released:
            self._abandon(round_no, key, coord)
        heart.keep(coord, self.node_lease())

    def release_coord(self, delete: bool) -> None:
        """Stop holding the coordinator key (``delete``: delete it now)."""
        coord, self._coord = self._coord, None
        if coord is None:
            return
        if self._heart is not None:
            self._heart.drop(coord)
        if self._lease is not None:
            self._lease.forget(coord)
        if delete:
            try:
                self.kv.delete(coord)
            except RendezvousConnectionError as exc:  # it expires by itself
                log.warning("could not delete %s: %s", coord, exc)

    def _abandon(self, round_no: int, *keys: str) -> NoReturn:
        """The handler was shut down (or finalized at exit) by another thread while a
        join ran: delete what the join wrote since, and end it."""
        self._coord = None
        lease, self._lease = self._lease, None
        if lease is not None:  # granted after the release, for the join's writes
            try:
                self.kv.revoke(lease, time.monotonic() + self._timeout)
            except RendezvousConnectionError as exc:  # it expires by itself
                log.warning("could not revoke %r: %s", lease, exc)
        for key in keys:
            try:
                self.kv.delete(key)
            except RendezvousConnectionError as exc:  # it expires by itself
                log.warning("could not delete %s: %s", key, exc)
        raise RendezvousError(
            f"Run {self.s.run_id!r}: node {self._node_id!r} was shut down while it joined "
            f"round {round_no}."
        )

    # -- moving between rounds ---------------------------------------------------------

    def stop_heart(self) -> None:
        heart, self._heart = self._heart, None
        if heart is not None:
            heart.stop()

    def start_chores(self, thread: threading.Thread) -> None:
        """Start ``thread``, a round's housekeeping that must not delay the join's
        return; :meth:`release` waits for it (it holds no reference to the session)."""
        self._chores = [t for t in self._chores if t.is_alive()]
        self._chores.append(thread)
        thread.start()

    def stop_threads(self) -> None:
        self.stop_heart()
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()

    def vanish(self) -> None:
        """As if the node's process was killed (tests): stop its threads and forget
        its keys and lease, deleting and revoking nothing; they expire by their TTL."""
        self.stop_threads()
        self._key = self._coord = self._lease = None

    def start_join(self) -> None:
        """A ``next_rendezvous()`` begins: a release before it is past (the join may
        run after a shutdown), and the node moves on from its round (:meth:`move_on`)."""
        self._released = False
        self.move_on()

    def move_on(self) -> None:
        """Leave the current round for the next: stop the threads, but keep the join
        key until the key of the next round is written (:meth:`drop_old`). So a member
        that re-joins is never absent from both rounds, and the next round's
        coordinator, which waits until the previous round's keys are gone, always sees
        it before it decides: a restart never swaps a member for a spare."""
        self._joined = False
        self.stop_threads()
        self._delete([self._coord])
        self._coord = None
        if self._key is not None:
            self._old.append(self._key)
            self._key = None

    def _drop_old(self) -> bool:
        """Delete the join keys of the rounds this node moved on from."""
        old, self._old = self._old, []
        return self._delete(old)

    def drop_life(self) -> bool:
        """Delete this node's life key (quarantine): the agent left."""
        life, self._life = self._life, None
        return self._delete([life])

    def withdraw(self, round_no: int, timeout: float | None = None) -> Record | None:
        """Give up on round ``round_no``: take this node's join key out of the round
        unless the round's result exists (:func:`.completion.withdraw`), so no
        result made later counts a node that will never take its rank. Returns the
        result found (the key stays: the caller sees whether it is a member), else
        ``None``. Best effort within ``timeout`` (default ``close_timeout``): when etcd
        does not answer, :meth:`leave` deletes the key as before."""
        key, s = self._key, self.s
        if key is None:
            return None
        self._key = None  # the heart must not write it again meanwhile
        try:
            bound = self._timeout if timeout is None else timeout
            with self.kv.bounded(time.monotonic() + bound):
                withdrawn, result = completion.withdraw(
                    self.kv,
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
            self._key = key
            return None
        if withdrawn:
            if self._lease is not None:
                self._lease.forget(key)
            return None
        self._key = key
        return result

    def leave(self) -> bool:
        """Not a member any more: stop the threads and delete the keys (within
        ``close_timeout``; a key that cannot be deleted expires by itself). Returns
        whether all went."""
        self._joined = False
        return self.release()

    def release(self) -> bool:
        """Stop every thread, revoke the lease and delete every key (the finalizer's
        call too). Housekeeping begun after a round (:meth:`start_chores`) is waited
        for first, within the same ``close_timeout``: once this returns, this node
        writes nothing more (an operator's ``delete`` right after a job ends removes
        the run for good)."""
        self._released = True
        deadline = time.monotonic() + self._timeout
        chores, self._chores = self._chores, []
        for thread in chores:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        self.stop_threads()
        self.take_ready(None)
        spare, self._spare_heart = self._spare_heart, None
        if spare is not None:
            spare.stop()
        keys = [self._coord, self._key, *self._old, self._life]
        self._coord = self._key = self._life = None
        self._old = []
        lease, self._lease = self._lease, None
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
            deadline = time.monotonic() + self._timeout
        for key in keys:
            if key is None:
                continue
            if self._lease is not None:
                self._lease.forget(key)
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

    def become_member(
        self,
        round_no: int,
        rank: int,
        membership: Membership,
        watch_from: int | None,
        listed: Listed | None,
    ) -> None:
        """Round ``round_no`` completed with this node at ``rank``: it is a member
        now, and its member watcher follows the round (``membership``: who its members
        are; from revision ``watch_from``; ``listed``: the members, addresses and hosts
        when the whole list is known here, to name a member gone)."""
        s = self.s
        self._round, self._rank, self._joined = round_no, rank, True
        self._watch = MemberWatch(
            self.kv,
            _keys.rdzv_dir(s.key_prefix, s.run_id),
            s.run_id,
            round_no,
            membership,
            watch_from,
            spread=min(_WATCH_SPREAD, s.keep_alive_interval / 2),
            addrs=None if listed is None else dict(zip(listed[0], listed[1], strict=False)),
            hosts=None if listed is None else dict(zip(listed[0], listed[2], strict=False)),
        )

    def live_peers(self) -> int:
        """Members of this node's running round besides itself whose keys its watcher
        still sees (0: not a member now, or the run is closed); no etcd request."""
        watch = self._watch
        if watch is None or watch.closed:
            return 0
        return max(watch.world_size - watch.missing - 1, 0)

    def num_waiting(self) -> int:
        """Nodes that want in, members gone, and this node's own loss (see
        :meth:`EtcdRendezvousHandler.num_nodes_waiting`); no etcd request. 0 once the
        run is closed: a re-rendezvous could only fail, and would stop this node's
        workers (a member that finished first closes the run and leaves)."""
        watch, heart = self._watch, self._heart
        if watch is None or watch.closed:
            return 0
        lost = 1 if heart is not None and heart.lost.is_set() else 0
        broken = 1 if watch.broken else 0
        s = self.s
        waiting = D.nodes_waiting(
            watch.world_size, s.max_nodes, watch.waiting, watch.missing, s.node_unit
        )
        return waiting + lost + broken

    def _refresh_meta(self) -> None:
        """Rank 0 keeps the round's result and the hint alive while the round runs
        (called by the heart after each beat)."""
        if not self._joined or self._rank != 0:
            return
        if time.monotonic() - self._meta_refreshed < META_REFRESH:
            return
        s = self.s
        self._meta_refreshed = time.monotonic()
        self.kv.refresh(_keys.result_key(s.key_prefix, s.run_id, self._round), records.META_TTL)
        self.kv.refresh(_keys.hint_key(s.key_prefix, s.run_id), records.META_TTL)
        self.kv.refresh(_keys.incarnation_key(s.key_prefix, s.run_id), records.META_TTL)
