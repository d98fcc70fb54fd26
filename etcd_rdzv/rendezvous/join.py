"""One ``next_rendezvous()`` call: a :class:`Join` and the state it alone needs.

A join writes this node's key in a round (first the round after its last, if the
round hint agrees), then coordinates the round (:mod:`.coordinator`) if it gets the
coordinator key, or follows it (:mod:`.follower`). A round it is not a member of
sends it to the next one. An etcd outage is ridden out within ``join_timeout``, in
the same round; a join that gives up leaves the round, so no coordinator counts a
node that will never take its rank.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

from .. import _keys
from .._commands import include_command
from .._kv import Compare, Condition, Delete, Get, Op, Present, Put, Record, TxnResult, Watcher
from ..admission.hosts import HostExcluded, duration_text, parse_exclusion, refusal_text
from ..config.params import LEAVE_GRACE
from ..errors import (
    LOGGED_AND_RAISED,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from . import completion, records
from . import decisions as D
from .coordinator import Coordinated, coordinate
from .follower import Followed, follow, from_result
from .incarnation import (
    Unstarted,
    admit,
    closed_text,
    confirm,
    parse_incarnation,
    restarted_error,
)
from .listener import HandlerEvent, RoundDone, State
from .progress import Progress
from .records import Outcome
from .roster import Membership, Roster
from .session import Listed, Session

__all__ = ["Join", "JoinOutcome"]

log = logging.getLogger(__name__)

_OUTAGE_BACKOFF = 0.5  # seconds before a join retries after an etcd request failed ...
_OUTAGE_BACKOFF_MAX = 4.0  # ... doubling up to this (with jitter), until join_timeout


@dataclass(frozen=True)
class JoinOutcome:
    """What a completed join gives this node: the round, its rank and the world size,
    the round's members (``roster``: maybe read when first asked) and, when the whole
    list is known here (not a large round's), its members, addresses and hosts."""

    round: int
    rank: int
    world_size: int
    roster: Roster
    listed: Listed | None


@dataclass(frozen=True)
class _Readmit:
    """The run was started again by a new job before this node's first join key was
    written: learn the new incarnation and join that."""


@dataclass(frozen=True)
class _HintSays:
    """A guarded join key was not written: the round hint names round ``hint``."""

    hint: int


def _listed(outcome: Outcome) -> Listed | None:
    """The members, addresses and hosts of a whole result (hosts ``""`` where a result
    of an older version names none); ``None`` for a slim one."""
    if outcome.buckets:
        return None
    hosts = outcome.hosts or ("",) * len(outcome.members)
    return outcome.members, outcome.addrs, hosts


def _watch_from(outcome: Outcome, announced_at: int | None, result_writes: int) -> int | None:
    """Where a member's watcher starts: the revision the round was decided at, or the
    announcement's when the only writes since the decision were the coordinator's
    for the round (a slim round's member list and rank buckets, then its result, v2's
    seal first, and its announcement). Then no member's key changed in between, and the watcher need
    not fetch the result and the announcement back."""
    as_of = outcome.as_of
    own = result_writes + 1 + (outcome.buckets + 1 if outcome.buckets else 0)
    if as_of is not None and announced_at is not None and announced_at == as_of + own:
        return announced_at
    return as_of


class Join:
    """The state of one join; :meth:`run` drives it to the round it completes."""

    def __init__(
        self, session: Session, addr: str, deadline: float, progress: Progress | None
    ) -> None:
        self.session, self.kv, self.s = session, session.kv, session.s
        self.me, self.addr = session.node_id, addr
        self.deadline, self.progress = deadline, progress
        self.prev_rank = session.rank
        self.since: int | None = None  # the revision of this join's first key
        self.outcome: Outcome | None = None
        self.announced_at: int | None = None  # the revision of the outcome's announcement
        self.told = False  # whether the join was logged (and its event recorded)
        # A node's first join learns the run's incarnation in its own transaction
        # where the API has them (see join_round); once: after a refusal, admit().
        self.learn = session.incarnation is None and self.kv.atomic_txn
        self.unstarted: Unstarted | None = None  # what a refused learning found
        if self.learn:
            found = session.take_unstarted()
            if found is not None:  # the build found the run unstarted: admit() from there
                self.unstarted, self.learn = Unstarted(*found), False

    def event(self, message: str, state: State = "RUNNING", rank: int | None = None) -> None:
        self.session.listener.on_event(
            HandlerEvent(self.s.run_id, self.me, "next_rendezvous", message, state, rank)
        )

    # -- the rounds --------------------------------------------------------------------

    def run(self) -> JoinOutcome:
        """Join rounds until one completes with this node; it is then the round's
        member (:meth:`.Session.become_member`: its member watcher runs)."""
        session = self.session
        session.start_join()
        # First the round after this node's last, on the condition that the round hint
        # agrees (one request where the API allows); else the round the hint names.
        round_no, guarded = session.round + 1, True
        pause = _OUTAGE_BACKOFF
        admitted = session.incarnation is not None
        try:
            while True:
                try:
                    if not admitted and not self.learn:
                        self._admit()
                    admitted = True
                    action = self.join_round(round_no, guarded)
                    self.learn = False
                    if isinstance(action, _Readmit):
                        admitted, round_no, guarded = False, session.round + 1, True
                        continue
                    if isinstance(action, _HintSays):
                        round_no, guarded = max(action.hint, session.round + 1), False
                        continue
                except RendezvousConnectionError as exc:
                    # etcd failed a request (no endpoint answered, or no leader in
                    # time): ride the outage out within join_timeout, in the same
                    # round, keeping this node's keys: the heart goes on renewing
                    # them (the key is written again on the next try). A pause that
                    # let them lapse would turn one slow answer of a loaded etcd into
                    # a revoke, a grant and a write more, which load it further.
                    wait = pause * (1 + random.random())
                    if time.monotonic() + wait >= self.deadline:
                        raise
                    log.warning(
                        "run %s: node %s: etcd request failed while joining round %s; "
                        "trying again in %.1fs: %s",
                        self.s.run_id,
                        self.me,
                        round_no,
                        wait,
                        exc,
                    )
                    time.sleep(wait)
                    pause = min(pause * 2, _OUTAGE_BACKOFF_MAX)
                    if session.holds_key:
                        # Its key may be in the round (and alive): the round may have
                        # completed with it meanwhile and moved the hint on. So the key
                        # goes into this round again, whatever the hint says, and the
                        # node follows the round to its outcome (a member of it, or
                        # on to the next), never past a round that counts it.
                        guarded = False
                    continue
                if isinstance(action, D.Joined):
                    break
                round_no, guarded = round_no + 1, False
        except BaseException as exc:
            # A node that gave up must not stay in the round: a coordinator would count
            # it, and the round could complete with a member that never takes its rank.
            # Withdrawn first, so that no result made after this moment counts it.
            if not isinstance(exc, RendezvousTimeoutError):  # withdrew already
                session.withdraw(round_no, LEAVE_GRACE)
            session.leave()
            self.event(
                f"The node {self.me!r} failed to join the rendezvous {self.s.run_id!r}: "
                f"{type(exc).__name__}: {exc}",
                "SUCCEEDED" if isinstance(exc, RendezvousGracefulExitError) else "FAILED",
            )
            raise
        outcome = self.outcome
        assert outcome is not None
        s, listed = self.s, _listed(outcome)
        session.become_member(
            round_no,
            action.rank,
            Membership.of(self.kv, s.key_prefix, s.run_id, round_no, outcome, self.announced_at),
            _watch_from(outcome, self.announced_at, completion.result_writes(self.kv)),
            listed,
        )
        roster = Roster.of(self.kv, s.key_prefix, s.run_id, round_no, outcome, self.announced_at)
        done = RoundDone(round_no, action.rank, action.world_size, roster)
        session.listener.on_round(done)
        self.event(
            f"The node {self.me!r} completed round {round_no} of the rendezvous "
            f"{self.s.run_id!r}: rank {action.rank} of {action.world_size}.",
            "SUCCEEDED",
            rank=action.rank,
        )
        return JoinOutcome(round_no, action.rank, action.world_size, roster, listed)

    def _tell(self, round_no: int) -> None:
        """Log the join (and record its event) once, when its first key is written."""
        if self.told:
            return
        self.told = True
        s = self.s
        log.info("run %s: node %s joins round %d", s.run_id, self.me, round_no)
        if s.rank is not None:
            log.info(
                "run %s: node %s claims static rank %d of %d (from %s)",
                s.run_id,
                self.me,
                s.rank,
                s.max_nodes,
                s.rank_source,
            )
        self.event(f"The node {self.me!r} joins round {round_no} of the rendezvous {s.run_id!r}.")

    def _admit(self) -> None:
        """Learn the run's incarnation before the first join (start a closed run again
        for a new job): :func:`.incarnation.admit`."""
        unstarted, self.unstarted = self.unstarted, None
        try:
            admit(self.session, self.deadline, unstarted)
        except RendezvousClosedError as exc:
            log.error("%s", exc, extra={LOGGED_AND_RAISED: True})
            raise

    def _restarted(self) -> RendezvousClosedError:
        error = restarted_error(self.session)
        log.error("%s", error, extra={LOGGED_AND_RAISED: True})
        return error

    def join_round(self, round_no: int, guarded: bool) -> D.Action | _HintSays | _Readmit:
        """Write this node's key in ``round_no``, coordinate or follow the round to its
        outcome: Joined or NextRound (others raise). ``guarded``: write only if the
        round hint names ``round_no`` (absent: round 1), else return what it names."""
        s, kv, session = self.s, self.kv, self.session
        key = _keys.node_key(s.key_prefix, s.run_id, round_no, self.me)
        coord = _keys.coord_key(s.key_prefix, s.run_id, round_no)
        value = records.node_record(
            self.me, self.addr, self.prev_rank, s.rank, s.node_group, s.host_id or None
        )
        participants: int | None = None  # as the coordinator last saw them
        # Most nodes find a coordinator already there: a read tells them so without the
        # consensus write a refused create would cost (on v3 the read goes with the
        # write of the join key, in one transaction). After a TakeOver, claim at once.
        # The watcher of the coordinator key starts with that read: a follower misses
        # nothing the coordinator writes after it.
        session.hold(key, value)
        # A node moving on from a round swaps its old join key for the new one in the
        # same transaction (both on the node's lease: no lease grant), so no reader
        # sees both keys or neither.
        old = session.moved_from
        ops: list[Op] = [Put(key, value, session.node_lease()), Get(coord)]
        if old is not None:
            ops.append(Delete(old))
        # Guarded: only if the round hint names this round (absent: round 1).
        hint = _keys.hint_key(s.key_prefix, s.run_id)
        guard: list[Condition] = (
            [Compare(hint, None if round_no == 1 else str(round_no))] if guarded else []
        )
        # Not from an excluded host: checked first, in the same transaction (one read
        # more on v2, where the compares are reads, and stop at the first that fails).
        excluded = _keys.excluded_key(s.key_prefix, s.run_id, s.host_id) if s.host_id else None
        if excluded is not None:
            guard.insert(0, Compare(excluded, None))
        # Only into this node's own job's run (see .incarnation): checked first.
        incarnation = session.incarnation
        incarnation_key = _keys.incarnation_key(s.key_prefix, s.run_id)
        learn = incarnation is None and self.learn
        if incarnation is not None:
            guard.insert(0, Compare(incarnation_key, incarnation))
        elif learn:
            # A node's first join (v3): the run open and started, the incarnation read
            # in the same transaction, so the join is one request, not two (at
            # N=4096, 4,096 fewer transactions in a cold start). A closed run, or one
            # not started yet, is refused: admit() sees to it, as before.
            guard[:0] = [Compare(_keys.closed_key(s.key_prefix, s.run_id), None)]
            guard[1:1] = [Present(incarnation_key)]
            ops.append(Get(incarnation_key))

        def write() -> tuple[TxnResult, int]:
            done = kv.txn(guard, ops)
            return done, done.revision

        with session.take_ready(coord) or kv.watcher(coord) as watcher:
            done, _ = watcher.reread(write)
            if not done.succeeded:  # nothing was written
                session.unhold()
                compared = list(done.compared)
                if learn:
                    closed, theirs = compared.pop(0), compared.pop(0)
                    if closed is None and theirs is None:
                        # A new run: admit() goes on from this read, with the round
                        # hint as read when the guard compared it (the last compare).
                        established = (compared[-1] is not None) if guarded else None
                        self.unstarted = Unstarted(done.revision, established)
                    if closed is not None or theirs is None:
                        return _Readmit()
                    session.learn_incarnation(parse_incarnation(theirs))
                elif incarnation is not None:
                    theirs = compared.pop(0)
                    if theirs is None or theirs.value != incarnation:
                        if session.incarnation_fixed:
                            raise self._restarted()
                        session.forget_incarnation()  # it never joined: learn the new one
                        return _Readmit()
                if excluded is not None:
                    mine = compared.pop(0)
                    if mine is not None:
                        raise self._excluded(mine)
                # The hint names another round.
                return _HintSays(records.hint_of(compared[0]) or 1)
            mine, holder = done.records[0], done.records[1]
            assert mine is not None
            if learn:  # before the key counts as entered (under this incarnation)
                learnt = done.records[-1]
                if learnt is None:  # only a resend whose first try landed reads it again
                    raise RendezvousStateError(
                        f"The key {incarnation_key!r} was gone once node {self.me!r} had "
                        "written its join key (the run was deleted meanwhile?): the node "
                        "withdraws. Start it again."
                    )
                session.learn_incarnation(parse_incarnation(learnt))
            if incarnation is not None and not kv.atomic_txn:
                # v2: the guard was read before the write; read again after it.
                wrong = confirm(session)
                if wrong is not None:
                    session.leave()  # its key goes: no round of either job counts it
                    raise self._closed() if wrong == "closed" else self._restarted()
            session.listener.on_key_written(round_no, key)
            self._tell(round_no)
            if self.since is None:  # the first key of this join: it waits from here
                self.since = mine.revision
            session.entered(round_no, key, old)
            while True:
                action, participants = self._play(
                    round_no, key, value, watcher, holder, participants
                )
                holder = None
                log.debug("run %s round %d node %s: %s", s.run_id, round_no, self.me, action)
                if not isinstance(action, D.TakeOver):
                    break
                # TakeOver: nobody coordinates (any more); try to.
        if isinstance(action, (D.Joined, D.NextRound)):
            if isinstance(action, D.NextRound):
                session.move_on()  # its key goes once the next round's key is written
            return action
        if isinstance(action, D.Failed):
            session.leave()
            raise RendezvousError(f"Run {s.run_id!r}, round {round_no}: {action.reason}")
        if isinstance(action, D.Closed):
            session.leave()
            raise self._closed()
        assert isinstance(action, D.TimedOut), action
        ranks = self._describe_ranks(round_no) if s.rank is not None else ""
        # Out of the round before giving up, unless it completed meanwhile: then this
        # node is in its result (a member, which returns its rank) or not.
        found = session.withdraw(round_no)
        if found is not None:
            followed = from_result(session, round_no, found)
            if isinstance(followed.action, D.Joined):
                log.info(
                    "run %s: node %s: round %d completed as its join timed out; it is a member",
                    s.run_id,
                    self.me,
                    round_no,
                )
                self._adopt(followed)
                return followed.action
        if s.rank is not None:
            session.leave()
            raise RendezvousTimeoutError(
                f"Run {s.run_id!r}: static round {round_no} did not complete within "
                f"join_timeout={s.join_timeout}s: {ranks}."
            )
        session.leave()
        joined = "" if participants is None else f" ({participants} node(s) joined)"
        raise RendezvousTimeoutError(
            f"Run {s.run_id!r}: round {round_no} did not complete within "
            f"join_timeout={s.join_timeout}s{joined}; min_nodes={s.min_nodes}."
        )

    def _play(
        self,
        round_no: int,
        key: str,
        value: str,
        watcher: Watcher,
        holder: Record | None,
        participants: int | None,
    ) -> tuple[D.Action, int | None]:
        """Coordinate the round if this node gets (or still holds) the coordinator key,
        else follow it. Returns the action and the participants the coordinator saw."""
        session = self.session
        coord = watcher.key
        mine: Record | None = None
        if holder is None:
            # On the node's lease, beside its join key (so the many refused claims of
            # a burst grant nothing).
            mine = self.kv.create(
                coord, records.coordinator_record(self.me), None, lease=session.node_lease()
            )
        elif session.coord == coord and records.coordinator_of(holder) == self.me:
            mine = holder  # held before an etcd request failed: coordinate on
        if mine is None:
            followed = follow(session, round_no, watcher, self.deadline, holder, self.progress)
            self._adopt(followed)
            return followed.action, participants
        session.hold_coord(round_no, key, coord)
        coordinated = coordinate(session, round_no, key, value, self.deadline, self.progress)
        self._adopt(coordinated)
        return coordinated.action, coordinated.participants

    def _adopt(self, ended: Coordinated | Followed) -> None:
        if ended.outcome is not None:
            self.outcome, self.announced_at = ended.outcome, ended.announced_at

    # -- the errors ----------------------------------------------------------------------

    def _excluded(self, record: Record) -> HostExcluded:
        """The error of a join from an excluded host (logged at WARNING)."""
        s = self.s
        try:
            why = parse_exclusion(record, _keys.excluded_dir(s.key_prefix, s.run_id))
            said = f"by {why.by}" + (f" for {duration_text(why.seconds)}" if why.seconds else "")
            said += f" at {why.at}" + (f": {why.reason}" if why.reason else "")
        except RendezvousStateError as exc:
            said = f"(its record is unreadable: {exc})"
        include = include_command(s.run_id, s.host_id, s.key_prefix, self.kv.api)
        text = refusal_text(s.run_id, s.host_id, self.me, said, include)
        log.warning("run %s: %s", s.run_id, text, extra={LOGGED_AND_RAISED: True})
        return HostExcluded(text)

    def _closed(self) -> RendezvousError:
        s = self.s
        if self.prev_rank is None and self._closed_since(self.since):
            # A spare (or a late node) that waited while the group ran: the job ended
            # without needing it. torch's agent exits cleanly on this.
            return RendezvousGracefulExitError(
                f"The rendezvous of run {s.run_id!r} was closed while node {self.me} "
                "waited to join: the job ended without it."
            )
        message = closed_text(self.session)
        # Logged as well as raised: under torchrun the agent's log shows this line,
        # where the error itself comes last, after torch's long traceback.
        log.error("%s", message, extra={LOGGED_AND_RAISED: True})
        return RendezvousClosedError(message)

    def _describe_ranks(self, round_no: int) -> str:
        """For a static round that timed out: which ranks came, held by whom, and
        which did not (one listing, best effort)."""
        s = self.s
        nodes = _keys.round_dir(s.key_prefix, s.run_id, round_no) + "/nodes"
        try:
            with self.kv.bounded(time.monotonic() + LEAVE_GRACE):
                found, _ = self.kv.list_prefix(nodes)
            return D.describe_ranks([records.parse_node(r) for r in found], s.max_nodes)
        except RendezvousError as exc:
            return f"the round's nodes could not be read ({exc})"

    def _closed_since(self, revision: int | None) -> bool:
        """Whether the run was closed after ``revision`` (not before this node came)."""
        if revision is None:
            return False
        try:
            record, _ = self.kv.get(_keys.closed_key(self.s.key_prefix, self.s.run_id))
        except RendezvousConnectionError:
            return False
        return record is not None and (record.created or record.revision) > revision
