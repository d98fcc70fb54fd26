"""The coordinator of one round: it follows the membership and completes the round.

One node per round holds ``rdzv/r<N>/coord``. It lists the ``rdzv`` directory once,
then applies etcd's watch events to that picture (:class:`~.watch.RoundView`) and
re-decides after each (:func:`.decisions.decide`, a pure function). When the round is
complete it creates ``rdzv/r<N>/result`` (create-if-absent: exactly one write wins)
and *announces* it: it writes the result into its coordinator key, which every
follower watches, and deletes that key; the result writer's chores (the round hint,
old rounds' keys) run in a short-lived thread, so its own join returns at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .. import _keys
from .._kv import KV, Event, Record, WatchCompacted, Watcher
from ..config.params import HandlerSettings
from ..errors import RendezvousConnectionError, RendezvousStateError
from . import completion, records
from . import decisions as D
from .progress import Progress
from .records import Outcome
from .roster import bucket_count, read_whole, write_roster
from .session import OtherAPIRefused, Session
from .watch import RoundView

__all__ = ["Coordinated", "coordinate"]

log = logging.getLogger(__name__)

#: Watch events in a row that etcd already held when their long poll reached it, above
#: which the coordinator lists the run instead (see _CatchUp).
_CATCH_UP = 4
#: After a listing, the coordinator reads events one by one for at least this many
#: times as long as the listing took before it lists again (see _CatchUp).
_LIST_PACE = 2.0


@dataclass(frozen=True)
class Coordinated:
    """How a coordination ended: the action (Joined, NextRound, Failed, Closed,
    TimedOut, or TakeOver when this node lost the coordinator key), the participants
    last seen, and for a final outcome the outcome and its announcement's revision."""

    action: D.Action
    participants: int
    outcome: Outcome | None = None
    announced_at: int | None = None


def coordinate(
    session: Session,
    round_no: int,
    key: str,
    value: str,
    deadline: float,
    progress: Progress | None,
) -> Coordinated:
    """Follow round ``round_no``'s membership and complete it; then announce it.
    ``key`` and ``value``: this node's join key in the round and what it holds."""
    kv, s = session.kv, session.s
    rdzv = _keys.rdzv_dir(s.key_prefix, s.run_id)
    with kv.watcher(rdzv, prefix=True) as watcher:
        return _Round(session, round_no, key, value, deadline, progress, watcher).run()


class _CatchUp:
    """When a coordinator that reads the run's changes one long poll at a time (v2)
    lists the whole run instead: once it is far behind, as in a burst of joins, one
    listing beats a request per change. A watch stream (v3) delivers every change
    anyway, and is never behind this way.

    Behind is told event by event: etcd answers a long poll with the first change
    from its index on, and with its own index when the poll reached it (a v2 answer's
    ``X-Etcd-Index``, :attr:`Event.current`); a change at or below that index was
    already there, waiting (held). More than :data:`_CATCH_UP` held in a row is a
    backlog. Not the distance from the change to etcd's index, as before: every v2
    heartbeat's refresh moves that index without a change here, so at 4,096 nodes,
    where every change was waiting, that distance was always over the bound, and the
    coordinator listed the whole run (hundreds of KB for etcd to send and for the node
    to read) after each change it read. And not more often than :data:`_LIST_PACE`
    times the last listing's own time allows: a loaded etcd's listings take long, and
    listed back to back, the run's keys cost etcd and the node most of their time
    again and again for the few changes between two listings.
    """

    def __init__(self) -> None:
        self.backlog = 0  # held changes in a row
        self._after = 0.0  # when the next listing may be

    def listed(self, began: float, ended: float) -> None:
        """A listing ran from ``began`` to ``ended`` (``time.monotonic()``)."""
        self.backlog = 0
        self._after = ended + _LIST_PACE * (ended - began)

    def behind(self, events: list[Event], now: float) -> bool:
        """Whether to list the run now, after the long poll that brought ``events``."""
        if any(event.current == 0 for event in events):  # the API does not say
            return True
        held = sum(1 for event in events if event.record.revision <= event.current)
        self.backlog = self.backlog + held if held else 0
        return self.backlog > _CATCH_UP and now >= self._after


class _Round:
    """One coordination: the picture of the round and the loop over it."""

    def __init__(
        self,
        session: Session,
        round_no: int,
        key: str,
        value: str,
        deadline: float,
        progress: Progress | None,
        watcher: Watcher,
    ) -> None:
        self.session, self.kv, self.s = session, session.kv, session.s
        self.key, self.value = key, value
        self.me = session.node_id
        self.round_no, self.deadline, self.progress = round_no, deadline, progress
        self.watcher = watcher
        self.rdzv = _keys.rdzv_dir(self.s.key_prefix, self.s.run_id)
        self.result_key = _keys.result_key(self.s.key_prefix, self.s.run_id, round_no)
        self.view = RoundView(self.rdzv, round_no)
        self.wrote_result = False
        self.regroup_since: float | None = None  # see decisions.regroup_since
        # Whole results of slim ones, by (coordinator, decision's revision).
        self.whole: dict[tuple[str, int | None], Outcome] = {}
        #: Whether the run formed a round in this API's keyspace (see _established).
        self.established = False
        self.catch_up = _CatchUp()

    def relist(self) -> int:
        began = time.monotonic()
        found, revision = self.watcher.reread(lambda: self.kv.list_tree(self.rdzv))
        self.view.load(found)
        self.established = self.established or _established(self.rdzv, found)
        self.catch_up.listed(began, time.monotonic())
        return revision

    def write_result(self, text: str, as_of: int | None = None) -> bool:
        """Create the round's result (or fault) once; adopt another coordinator's if
        it was faster. ``as_of``: the revision of the picture a completion was decided
        from; it is created only if no node gave up on the round after it (see
        :func:`.completion.withdraw`). Returns ``False`` when one did: the
        picture is out of date."""
        if as_of is None:
            created = self.kv.create(self.result_key, text, records.META_TTL)
            current = None
        else:
            s = self.s
            created, current = completion.create_unless_gone(
                self.kv,
                self.result_key,
                text,
                records.META_TTL,
                _keys.gone_dir(s.key_prefix, s.run_id, self.round_no),
                as_of,
                s.node_ttl,
            )
            if created is None and current is None:
                log.info(
                    "run %s: round %d: a node gave up after the picture at revision %d; "
                    "deciding again",
                    s.run_id,
                    self.round_no,
                    as_of,
                )
                return False
        if created is not None:
            self.view.apply(Event("put", created))
            self.wrote_result = True
            return True
        if current is None:
            current, _ = self.kv.get(self.result_key)
        if current is not None:
            self.view.apply(Event("put", current))
        return True

    def join_view(
        self, now: float, min_reached: float | None, conflict_since: float | None
    ) -> tuple[D.JoinView, Outcome | None]:
        s, view = self.s, self.view
        outcome = records.parse_result(view.result) if view.result is not None else None
        if outcome is not None and outcome.buckets:
            outcome = self._whole(outcome)
        return D.JoinView(
            me=self.me,
            closed=view.closed,
            result=outcome.members if outcome is not None else None,
            participants=view.admitted(),
            prev_round_live=len(view.live_prev()),
            min_nodes=s.min_nodes,
            max_nodes=s.max_nodes,
            now=now,
            min_reached=min_reached,
            last_call_timeout=s.last_call_timeout,
            deadline=self.deadline,
            failed=outcome.error if outcome is not None else None,
            static=s.rank is not None,
            prev=tuple(p for p in view.live_prev().values() if p is not None),
            conflict_since=conflict_since,
            node_ttl=s.node_ttl,
            node_unit=s.node_unit,
            rejoin_grace=s.rejoin_grace,
            regroup_since=self.regroup_since,
            prev_members=view.prev_members,
        ), outcome

    def run(self) -> Coordinated:
        s, view, session = self.s, self.view, self.session
        revision = self.relist()
        self._check_run()
        min_reached: float | None = None
        conflict_since: float | None = None
        told_prev = False
        log.info("run %s: node %s coordinates round %d", s.run_id, self.me, self.round_no)
        while True:
            if view.result is None and view.coordinator() != self.me:
                # Our key expired (this node was paused) or another node holds it now.
                log.warning("run %s: node %s lost the coordinator key", s.run_id, self.me)
                session.release_coord(delete=False)
                return Coordinated(D.TakeOver(), len(view.nodes))
            self._resolve_prev()
            now = time.monotonic()
            # The last call starts once a whole world can form: min_nodes rounded up
            # to a multiple of node_unit.
            low = D.unit_bounds(s.min_nodes, s.max_nodes, s.node_unit)[0]
            participants = view.admitted()
            min_reached = D.reached_at(min_reached, len(participants), low, now)
            self.regroup_since = D.regroup_since(
                self.regroup_since, participants, view.prev_members, now
            )
            prev = tuple(p for p in view.live_prev().values() if p is not None)
            if s.rank is not None and D.rank_conflicts(participants, prev):
                conflict_since = now if conflict_since is None else conflict_since
            else:
                conflict_since = None
            join_view, outcome = self.join_view(now, min_reached, conflict_since)
            action = D.decide(join_view)
            if isinstance(action, D.Wait):
                if view.live_prev() and not told_prev:
                    told_prev = True
                    self._tell_prev()
                if conflict_since == now:
                    self._tell_conflict(participants)
                if self.progress is not None:
                    self.progress.coordinating(self.round_no, join_view, action)
                revision = self._wait(action.until - now, revision)
            elif isinstance(action, D.Complete):
                addr_of = {p.node_id: p.addr for p in participants}
                addrs = tuple(addr_of.get(m, "") for m in action.members)
                host_of = {p.node_id: p.host or "" for p in participants}
                hosts = tuple(host_of.get(m, "") for m in action.members)
                whole = Outcome(
                    action.members,
                    addrs,
                    revision,
                    s.max_nodes,
                    None,
                    s.node_unit,
                    hosts=hosts if any(hosts) else (),
                )
                if not self.write_result(self._result_text(whole), as_of=revision):
                    # A node gave up after this picture: its withdrawal is on its way.
                    revision = self._wait(self.deadline - time.monotonic(), revision)
            elif isinstance(action, D.Fail):
                log.error("run %s: round %d fails: %s", s.run_id, self.round_no, action.reason)
                self.write_result(records.fault_record(action.reason, action.nodes))
            elif isinstance(action, (D.Joined, D.NextRound, D.Failed)):
                assert outcome is not None and view.result is not None
                announced_at = announce(
                    session,
                    self.round_no,
                    records.announcement(self.me, result=view.result.value),
                    len(outcome.members) if self.wrote_result else None,
                )
                return Coordinated(action, len(view.nodes), outcome, announced_at)
            elif isinstance(action, D.Rejoin):
                record = self.kv.put_owned(self.key, self.value, session.node_lease())
                session.listener.on_key_written(self.round_no, self.key)
                view.apply(Event("put", record))
            elif isinstance(action, D.Closed):
                announce(session, self.round_no, records.announcement(self.me, closed=True))
                return Coordinated(action, len(view.nodes))
            else:  # TimedOut: let another node (with a later deadline) take over
                session.release_coord(delete=True)
                return Coordinated(action, len(view.nodes))

    def _result_text(self, whole: Outcome) -> str:
        """The result to write: ``whole``, or for a large round its slim form, once
        its lists are in this node's roster directory (see :mod:`.roster`)."""
        s = self.s
        assert whole.as_of is not None and whole.max_nodes is not None
        text = records.result_record(
            whole.members, whole.addrs, whole.as_of, whole.max_nodes, whole.node_unit, whole.hosts
        )
        if not bucket_count(len(whole.members)):
            return text
        try:
            buckets = write_roster(self.kv, s.key_prefix, s.run_id, self.round_no, whole, self.me)
        except RendezvousConnectionError as exc:
            log.warning("run %s: round %d's result is whole: %s", s.run_id, self.round_no, exc)
            return text
        self.whole[(self.me, whole.as_of)] = whole
        return records.slim_record(whole, buckets, self.me)

    def _whole(self, slim: Outcome) -> Outcome:
        """The whole result of a slim one: as this node wrote it, or read once."""
        key = (slim.by, slim.as_of)
        found = self.whole.get(key)
        if found is None:
            s = self.s
            found = self.whole[key] = read_whole(
                self.kv, s.key_prefix, s.run_id, self.round_no, slim
            )
        return found

    def _resolve_prev(self) -> None:
        """The previous round's members, when its result is slim (one read of its
        list); unreadable, nobody counts as a member that re-joined."""
        slim = self.view.prev_slim
        if slim is None:
            return
        self.view.prev_slim = None
        s = self.s
        try:
            whole = read_whole(self.kv, s.key_prefix, s.run_id, self.round_no - 1, slim)
        except RendezvousStateError as exc:
            log.warning("run %s: the members of round %d: %s", s.run_id, self.round_no - 1, exc)
            return
        self.view.prev_members = frozenset(whole.members)

    def _check_run(self) -> None:
        """Once per coordination, what each client would otherwise check at connect:
        that this node is not on the wrong API (:func:`etcd_rdzv.client._probe.check_one_api`:
        the run has keys in the other keyspace and has formed no round in this one).
        A node refused writes nothing more: it leaves (its keys deleted, its lease
        revoked) and raises; the others in the round take over one by one and find
        the same. Keys in the other keyspace of a run established here are only
        logged: they never end the run."""
        checks = self.session.checks
        if checks is None or self.view.result is not None:
            return  # the client checked at connect, or the round is complete already
        problem = checks.other_api(self.established)
        if problem is None:
            return
        self.session.leave()
        raise OtherAPIRefused(problem)

    def _wait(self, timeout: float, revision: int) -> int:
        """Apply the next watch events (up to ``timeout`` seconds); the revision seen."""
        try:
            events = self.watcher.next(max(timeout, 0.0))
        except WatchCompacted:
            return self.relist()
        for event in events:
            self.view.apply(event)
            revision = max(revision, event.record.revision)
        if events and self.watcher.polls and self.catch_up.behind(events, time.monotonic()):
            revision = self.relist()
        return revision

    def _tell_prev(self) -> None:
        s = self.s
        log.info(
            "run %s: round %d waits for %d member(s) of round %d to leave it; "
            "a member that died leaves when its key expires (within %ds)",
            s.run_id,
            self.round_no,
            len(self.view.live_prev()),
            self.round_no - 1,
            s.node_ttl,
        )

    def _tell_conflict(self, participants: tuple[D.Participant, ...]) -> None:
        s = self.s
        log.warning(
            "run %s: a static rank is claimed twice in round %d; if no key "
            "expires within %ds (a dead node's), the round fails: %s",
            s.run_id,
            self.round_no,
            s.node_ttl,
            D.describe_ranks(participants, s.max_nodes),
        )


def _established(rdzv: str, found: list[Record]) -> bool:
    """Whether the listing ``found`` of the ``rdzv`` directory shows a round formed in
    this keyspace: the round hint (written once a round completed), or a round's
    result that names members. Not join keys or a coordinator key: nodes on the wrong
    API write those too, before their coordinator checks the other keyspace."""
    hint = rdzv + "/round"
    for record in found:
        if record.key == hint:
            return True
        where = _keys.round_of(rdzv, record.key)
        if where is None or where[1] != "result":
            continue
        try:
            if records.parse_result(record).error is None:
                return True
        except RendezvousStateError:  # untrusted: not a round formed here
            continue
    return False


def announce(
    session: Session, round_no: int, message: str, completed: int | None = None
) -> int | None:
    """Tell the followers the outcome: write it into the coordinator key; then, in a
    thread of their own so that this node's join returns at once, delete the key and
    (``completed``: this node wrote the round's result, of that many members) do the
    result writer's chores. Only final facts are announced (a result, which is
    create-if-absent, or the closed run), so this may overwrite a key another
    coordinator just took (or delete it: the next coordinator then finds the result).
    If it fails, the heartbeat deletes the key once etcd answers again, and followers
    read the result themselves. Returns the announcement's revision (``None``: it
    failed)."""
    kv, s = session.kv, session.s
    coord = session.coord or _keys.coord_key(s.key_prefix, s.run_id, round_no)
    session.release_coord(delete=False)
    try:
        record = kv.put(coord, message, s.node_ttl)
    except RendezvousConnectionError as exc:
        log.warning("run %s: announcing round %d failed: %s", s.run_id, round_no, exc)
        # Followers then read the result once the key is gone: it may share the join
        # key's lifetime (see claim), so delete it rather than wait for that.
        if session.heart is not None:
            session.heart.delete_later(coord)
        if completed is not None:
            after_round(kv, s, session.node_id, round_no, completed, None, _sweep_of(session))
        return None
    # Not a method of the session: the thread holds no reference to it.
    session.start_chores(
        threading.Thread(
            target=after_round,
            args=(kv, s, session.node_id, round_no, completed, coord, _sweep_of(session)),
            name=f"etcd-rdzv-chores:{s.run_id}:{round_no}",
            daemon=True,
        )
    )
    return record.revision


def _sweep_of(session: Session) -> Callable[[], None] | None:
    return session.checks.sweep if session.checks is not None else None


def after_round(
    kv: KV,
    s: HandlerSettings,
    node_id: str,
    round_no: int,
    completed: int | None,
    coord: str | None,
    sweep: Callable[[], None] | None = None,
) -> None:
    """After an announcement: delete the coordinator key (``coord``) and, for the node
    that wrote the round's result of ``completed`` members, advance the round hint,
    drop round N-2's keys and ``sweep`` (v2's empty directories, at most hourly).
    Housekeeping, bounded by ``close_timeout``: what fails here expires by itself (the
    hint is only a hint: a node that reads an old one finds the round complete and
    moves on)."""
    try:
        with kv.bounded(time.monotonic() + s.close_timeout):
            if coord is not None:
                kv.delete(coord)
            if completed is None:
                return
            log.info(
                "run %s: node %s completed round %d with %d member(s)",
                s.run_id,
                node_id,
                round_no,
                completed,
            )
            kv.put(_keys.hint_key(s.key_prefix, s.run_id), str(round_no + 1), records.META_TTL)
            if round_no > 2:
                kv.delete_prefix(_keys.round_dir(s.key_prefix, s.run_id, round_no - 2))
                kv.delete_prefix(f"{_keys.store_dir(s.key_prefix, s.run_id)}/r{round_no - 2}")
                roster = f"{_keys.run_dir(s.key_prefix, s.run_id)}/roster/r{round_no - 2}"
                kv.delete_prefix(roster)
            if sweep is not None:
                sweep()
    except RendezvousConnectionError as exc:  # housekeeping only
        log.warning("run %s: housekeeping after round %d failed: %s", s.run_id, round_no, exc)
    except Exception:  # a thread never ends silently
        log.warning("run %s: housekeeping after round %d failed", s.run_id, round_no, exc_info=True)
