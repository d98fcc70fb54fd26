"""A run's life: which job uses the run id now, its closing, and its starting again.

A job that ends closes its run (torchrun's agents do at shutdown), and every later
join of that run fails with RendezvousClosedError: an agent of the finished job that
comes late (a spare, an agent restarting its workers) must not start it again. But a
re-created Kubernetes job or a requeued Slurm job reuses its run id; it should start,
and without anyone deleting keys in etcd. The rule that tells the two apart:

* each run has an **incarnation**, a random id under ``rdzv/incarnation``, created
  (create-if-absent) by the first node that joins it. A handler learns it before its
  first join (:func:`admit`) and keeps it for its life: every later join key it writes
  is written on the condition that the run's incarnation is still its own (one
  transaction on v3; on v2 checked again right after the write, see
  :func:`confirm`). A handler whose incarnation is not the run's belongs to a job that
  finished: RendezvousClosedError (:func:`restarted_error`), whatever the new job does;
* a handler that has not joined yet (a new process) and finds the run closed starts
  it again (:func:`admit`), once no node of the finished job is alive (no join key in
  any round: keys on the nodes' leases, so a killed node's goes within its TTL). It
  deletes the closed marker, the rounds (their results, hint and keys) and the round
  stores, and writes a new incarnation, all in one step whose conditions are that the
  marker is the one it read and that no key of the rounds was written since its
  listing (:func:`reset_run`: one transaction on v3; on v2 a hold on the marker
  first). Two new nodes that race: one reset wins, the other reads its
  incarnation and joins it. Host records (exclusions, health checks, deaths) stay;
* while a node of the finished job is alive (it still trains, or was killed and its
  key has not expired), a new node waits one node TTL (``keep_alive_interval x
  keep_alive_max_attempt``) for the keys to go; after that (or ``join_timeout``) it
  gets RendezvousClosedError naming those nodes. So a late agent of a job that is
  still ending is refused as before, and a job re-created right after its nodes were
  killed starts.

Liveness is etcd's (lease and TTL of the join keys); no clock is compared across
hosts. ``restart_closed_run=false`` keeps the strict rule: a closed run refuses every
node until its marker expires or ``etcd-rdzv delete`` removes it.
"""

from __future__ import annotations

import contextlib
import logging
import random
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from .. import _keys
from .._commands import closed_message
from .._kv import (
    KV,
    Condition,
    Delete,
    DeletePrefix,
    Get,
    Op,
    Put,
    Quiet,
    Record,
    Revision,
    WatchCompacted,
)
from ..errors import RendezvousClosedError, RendezvousStateError
from . import records
from .session import OtherAPIRefused, Session

__all__ = [
    "HOLD_TTL",
    "Reset",
    "Unstarted",
    "admit",
    "alive_in",
    "close_run",
    "closed_text",
    "confirm",
    "parse_incarnation",
    "reset_run",
    "restarted_error",
]

log = logging.getLogger(__name__)

#: v2: seconds a reset in steps holds the closed marker (it takes a few requests).
HOLD_TTL = 30
_HOLD = "resetting by "  # v2: the held marker's value, followed by the node id
_INCARNATION = re.compile(r"^[0-9a-f]{32}\Z")
_SHOWN = 5  # live nodes named in an error
# A first start's nodes wait a random moment, up to this many seconds per node of
# max_nodes (at most _SPREAD_MAX), before one of them makes the run's incarnation.
_SPREAD_PER_NODE = 0.0005
_SPREAD_MAX = 2.0
_SPREAD_LEAST = 0.005  # seconds: a shorter wait is no wait (no watch is opened)


@dataclass(frozen=True)
class Reset:
    """What :func:`reset_run` replaces, and on which conditions.

    ``guard`` (a key as read) is deleted, with every key whose name starts with
    ``quiet`` and every directory in ``drop`` (each with everything under it), and
    ``key`` is written to ``value`` for ``ttl`` seconds: if ``guard`` is unchanged
    since it was read and no key whose name starts with ``quiet`` was written after
    revision ``as_of``. ``drop`` must name every directory under ``quiet`` that
    exists (v2 has no prefix ranges and deletes those); ``key`` must be outside them.
    """

    guard: Record
    quiet: str
    as_of: int
    drop: tuple[str, ...]
    key: str
    value: str
    ttl: int


def reset_run(
    kv: KV, reset: Reset, hold: str, hold_ttl: int, still_quiet: Callable[[], bool]
) -> bool:
    """Replace ``reset.guard`` and the keys under it by ``reset.key`` (see
    :class:`Reset`); whether it was done.

    v3: one transaction (``hold`` and ``still_quiet`` are not used); a resend whose
    first try landed finds the key it wrote, and is done. v2 (no transactions), in
    steps whose order keeps the guard standing until the new key is written:
    ``guard`` is compare-and-set to ``hold`` for ``hold_ttl`` seconds (a reader takes
    it for the guard, and a second reset is refused); then ``still_quiet()`` must
    confirm the condition on ``quiet`` (else the guard is written back as it was, for
    ``reset.ttl`` seconds, and nothing else changes); then ``reset.key`` is written,
    the directories are deleted, and the held guard last. A reset cut short leaves
    the hold to expire.

    Raises:
        RendezvousConnectionError: etcd did not answer.
    """
    guard = reset.guard
    if kv.atomic_txn:
        deletes: list[Op] = [Delete(guard.key), DeletePrefix(reset.quiet)]
        for directory in reset.drop:
            if not directory.startswith(reset.quiet):  # gone with the range above
                deletes += [Delete(directory), DeletePrefix(directory + "/")]
        compares: list[Condition] = [
            Revision(guard.key, guard.revision),
            Quiet(reset.quiet, reset.as_of),
        ]
        put = Put(reset.key, reset.value, ttl=reset.ttl)
        return kv.txn(compares, [*deletes, put]).succeeded
    held = kv.compare_and_set(guard.key, hold, guard.revision, hold_ttl)
    if held is None:
        return False
    if not still_quiet():
        kv.compare_and_set(guard.key, guard.value, held.revision, reset.ttl)
        return False
    kv.put(reset.key, reset.value, reset.ttl)
    for directory in reset.drop:
        kv.delete_prefix(directory)
    kv.delete(guard.key)
    return True


def parse_incarnation(record: Record) -> str:
    """The incarnation a key holds. Untrusted: anything but 32 hex digits is an error
    naming the key."""
    if not _INCARNATION.match(record.value):
        raise RendezvousStateError(
            f"The key {record.key!r} does not hold a run incarnation (32 hex digits): "
            f"{record.value[:40]!r}. Corrupt or foreign state: delete it (etcd-rdzv delete)."
        )
    return record.value


def alive_in(found: Sequence[Record], rdzv: str) -> list[str]:
    """The nodes with a join key in any round of a listing of ``rdzv``, named (by
    id and address; a key that does not parse by its name)."""
    joined = records.join_keys(found, rdzv)
    return [f"{records.named(node, key)} (round {n})" for n, node, key in joined]


def _dropped(found: Sequence[Record], key_prefix: str, run_id: str) -> tuple[str, ...]:
    """What a reset deletes besides the marker: every round directory seen, the round
    hint, the round stores and the large rounds' rosters."""
    rdzv = _keys.rdzv_dir(key_prefix, run_id)
    rounds = sorted({w[0] for w in (_keys.round_of(rdzv, r.key) for r in found) if w is not None})
    return (
        *(_keys.round_dir(key_prefix, run_id, n) for n in rounds),
        _keys.hint_key(key_prefix, run_id),
        _keys.store_dir(key_prefix, run_id),
        _keys.rosters_dir(key_prefix, run_id),
    )


def _wait(kv: KV, key: str, after: int, until: float, *, prefix: bool = False) -> None:
    """Wait for a change of ``key`` (under it, with ``prefix``) after revision
    ``after``, until the ``time.monotonic()`` instant ``until``."""
    left = until - time.monotonic()
    if left <= 0:
        return
    # A compacted history: the caller reads again anyway.
    with contextlib.suppress(WatchCompacted):
        kv.watch(key, after + 1, left, prefix=prefix)


@dataclass(frozen=True)
class Unstarted:
    """A read (a first join's refused transaction) that found the run open and with
    no incarnation: :func:`admit` goes on from it instead of reading again."""

    revision: int  # the read's
    established: bool | None  # whether the round hint was there (None: not read)


@dataclass(frozen=True)
class _RunRead:
    """The run's keys that decide a first join, as of one revision."""

    closed: Record | None  # the closed marker
    current: Record | None  # the incarnation
    ended: Record | None  # the marker that a job ended the run moments ago
    established: bool  # whether the round hint was there
    revision: int


def _read_run(session: Session) -> _RunRead:
    """One transaction of reads on v3 (v2: one listing): the closed marker, the
    incarnation and the ended marker as of one revision, and the round hint for the
    check of the other API."""
    s = session.s
    read = session.kv.txn(
        [],
        [
            Get(_keys.closed_key(s.key_prefix, s.run_id)),
            Get(_keys.incarnation_key(s.key_prefix, s.run_id)),
            Get(_keys.ended_key(s.key_prefix, s.run_id)),
            Get(_keys.hint_key(s.key_prefix, s.run_id)),
        ],
    )
    closed, current, ended, hint = read.records
    return _RunRead(closed, current, ended, hint is not None, read.revision)


def look_ahead(session: Session) -> None:
    """At a handler's build (v3), read the run as :func:`admit` would: the node learns
    the run's incarnation there (its first join is then guarded by it), or the session
    notes that the run is open and has none (:meth:`.Session.note_unstarted`), and the
    first join starts from that read in :func:`admit` instead of sending its join's
    transaction first. That transaction is a write, a raft proposal whether or not its
    guard holds: at a job's first start every node's would be refused (measured at
    1,024 nodes: 767 of the 1,024 first joins refused, each a proposal), while this
    read is not one. A closed run, and an incarnation key that holds something else,
    are left to the join, as before.

    Raises:
        RendezvousConnectionError: etcd did not answer.
    """
    if session.incarnation is not None or not session.kv.atomic_txn:
        return
    read = _read_run(session)
    if read.closed is not None:
        return
    if read.current is None:
        session.note_unstarted(read.revision, read.established)
        return
    try:
        incarnation = parse_incarnation(read.current)
    except RendezvousStateError:
        return  # not the build's to report: the join meets it and says so
    session.learn_incarnation(incarnation)


def _refuse_wrong_api(session: Session, established: bool | None) -> bool:
    """Before a node writes a run's first incarnation, the check a round's coordinator
    makes (see :meth:`.coordinator.Coordinator._check_run`): a node on the wrong API
    (the run has keys in the other keyspace and no round in this one) writes nothing,
    not even the incarnation. One request (the other keyspace), two if
    ``established`` (whether the run has a round hint) is not known; made only while
    the run has no incarnation.

    Returns: whether it asked etcd (``False``: the client checked at connect)."""
    s, checks = session.s, session.checks
    if checks is None:
        return False  # the client checked at connect
    if established is None:
        established = session.kv.get(_keys.hint_key(s.key_prefix, s.run_id))[0] is not None
    problem = checks.other_api(established)
    if problem is not None:
        session.leave()
        raise OtherAPIRefused(problem)
    return True


def admit(session: Session, deadline: float, unstarted: Unstarted | None = None) -> None:
    """Learn the run's incarnation before this node's first join, into
    ``session.incarnation``: the run's own, a new one for a run that has none, or,
    for a closed run, a new one by starting the run again (see the module docstring).
    ``unstarted``: the run was just read open and without one; no first read.

    A closed run is left as it is, and ``session.incarnation`` unset (the join then
    meets the closed run), when ``restart_closed_run`` is off or this node closed it
    (``set_closed()``, then ``next_rendezvous()``: torch's handlers raise
    RendezvousClosedError).

    Raises:
        RendezvousClosedError: the run is closed and a node of the job that closed it
            is still alive after one node TTL (or at ``deadline``).
        RendezvousStateError: the incarnation key holds something else.
        RendezvousConnectionError: etcd could not be reached.
    """
    s, kv = session.s, session.kv
    closed_key = _keys.closed_key(s.key_prefix, s.run_id)
    key = _keys.incarnation_key(s.key_prefix, s.run_id)
    rdzv = _keys.rdzv_dir(s.key_prefix, s.run_id)
    waited_until: float | None = None  # the end of the wait for the old nodes to go
    spread = True  # a first-time node that finds no incarnation waits a moment first
    api_checked = False
    while True:
        if unstarted is not None:
            closed = current = ended = None
            revision, established = unstarted.revision, unstarted.established
            unstarted = None
        else:
            read = _read_run(session)
            closed, current, ended = read.closed, read.current, read.ended
            revision, established = read.revision, read.established
        if closed is None:
            if current is not None:
                session.learn_incarnation(parse_incarnation(current))
                return
            if spread:
                # A job's first start: all its nodes find no incarnation at about the
                # same moment. One makes it; the others learn it from a watch, instead
                # of each making a refused create, a lease grant and a read again
                # (thousands of raft proposals at once, at N=4096). The first of the
                # random waits ends about window / N after the start, so the round
                # waits no longer for it; a node alone waits up to the window.
                spread = False
                window = min(_SPREAD_MAX, s.max_nodes * _SPREAD_PER_NODE)
                wait = min(window * random.random(), deadline - time.monotonic())
                if wait >= _SPREAD_LEAST:  # (a small job's nodes just create it)
                    event = kv.watch(key, revision + 1, wait)
                    if event is not None and event.kind == "put":
                        session.learn_incarnation(parse_incarnation(event.record))
                        return
                    if event is not None:
                        continue  # not a creation: read again
            if not api_checked:  # before the run's first write
                api_checked = True
                if _refuse_wrong_api(session, established):
                    # Its requests took time, in which another node may have made the
                    # incarnation: read again first. At a first start under load, the
                    # nodes whose waits ended before the first one's create landed
                    # then learn it by this read, not by a lease grant, a refused
                    # create and the read.
                    continue
            made = kv.create(key, uuid.uuid4().hex, records.META_TTL)
            if made is not None:
                session.learn_incarnation(made.value)
                return
            continue  # another node made it first: read it
        if not s.restart_closed_run or session.closed_it or ended is not None:
            return  # closed for good, or moments ago (status.ENDED_TTL): it stays closed
        if closed.value.startswith(_HOLD):  # v2: another node starts the run again
            log.info("run %s: node %s waits while %s", s.run_id, session.node_id, closed.value)
            _wait(kv, closed_key, closed.revision, min(deadline, time.monotonic() + HOLD_TTL))
            continue
        found, at = kv.list_tree(rdzv)
        alive = alive_in(found, rdzv)
        if alive:
            now = time.monotonic()
            if waited_until is None:
                waited_until = min(deadline, now + s.node_ttl + 1)
                log.info(
                    "run %s is closed and %d node(s) of the job that closed it are alive "
                    "(%s): node %s waits up to %.0fs for them to leave before it starts "
                    "the run again",
                    s.run_id,
                    len(alive),
                    ", ".join(alive[:_SHOWN]),
                    session.node_id,
                    waited_until - now,
                )
            if now >= waited_until:
                raise _still_alive(session, alive)
            _wait(kv, rdzv, at, waited_until, prefix=True)
            continue
        reset = Reset(
            closed,
            rdzv + "/r",  # the rounds and the round hint
            at,
            _dropped(found, s.key_prefix, s.run_id),
            key,
            uuid.uuid4().hex,
            records.META_TTL,
        )

        def still_quiet() -> bool:
            return not alive_in(kv.list_tree(rdzv)[0], rdzv)

        # Within half the hold's TTL: a v2 reset whose hold expired midway would
        # delete keys of a run that readers already take for open.
        with kv.bounded(time.monotonic() + HOLD_TTL / 2):
            done = reset_run(kv, reset, _HOLD + session.node_id, HOLD_TTL, still_quiet)
        if done:
            log.info(
                "run %s was closed by a job that ended: node %s starts it again "
                "(incarnation %s; its rounds and stores deleted)",
                s.run_id,
                session.node_id,
                reset.value,
            )
            session.learn_incarnation(reset.value)
            return
        # Refused: another node started it again, or a node joined meanwhile: look again.


def confirm(session: Session) -> Literal["closed", "restarted"] | None:
    """v2 (no transactions), right after this node wrote a join key: whether the run
    is still open and the node's incarnation is the run's. Read in this order (the
    marker, then the incarnation) against :func:`reset_run`'s (the incarnation written
    before the marker goes), a key written while the run was started again is seen.

    Returns:
        ``None`` (go on), ``"closed"`` (the run is closed: the join ends as a closed
        run's does), or ``"restarted"`` (another job uses the run now:
        :func:`restarted_error`).
    """
    s, kv = session.s, session.kv
    # Both at one revision (v2: one listing of the run's directory), which is at least
    # as good as reading them in that order.
    closed, current = kv.txn(
        [],
        [
            Get(_keys.closed_key(s.key_prefix, s.run_id)),
            Get(_keys.incarnation_key(s.key_prefix, s.run_id)),
        ],
    ).records
    if closed is not None:
        return "closed"
    if current is None or current.value != session.incarnation:
        return "restarted"
    return None


def restarted_error(session: Session) -> RendezvousClosedError:
    """The error of a node whose job finished after it joined, now that the run id
    was started again by another job."""
    s = session.s
    message = (
        f"The rendezvous of run {s.run_id!r} was closed, and started again by a new job, "
        f"since node {session.node_id!r} joined it: this node belongs to the job that "
        "ended and does not join the new one."
    )
    return RendezvousClosedError(message)


def _still_alive(session: Session, alive: list[str]) -> RendezvousClosedError:
    s = session.s
    more = len(alive) - _SHOWN
    shown = ", ".join(alive[:_SHOWN]) + (f" and {more} more" if more > 0 else "")
    message = (
        f"The rendezvous of run {s.run_id!r} is closed and {len(alive)} node(s) of the job "
        f"that closed it are still alive: {shown}. A job started again under this run id "
        "starts once they have left (a killed node's key expires within its TTL, "
        f"{s.node_ttl}s here); to run beside them, use a new run id (torchrun: --rdzv-id)."
    )
    return RendezvousClosedError(message)


def closed_text(session: Session) -> str:
    """The error of a join into a closed run, with what to do about it."""
    s = session.s
    if not s.restart_closed_run:
        return closed_message(s.run_id, s.key_prefix, session.kv.api)
    return (
        f"The rendezvous of run {s.run_id!r} is closed: its job ended. A job started "
        f"again under this run id starts it anew once every node of this one has left "
        f"and {records.ENDED_TTL}s have passed since the run was closed (restart_closed_run)."
    )


def close_run(kv: KV, key_prefix: str, run_id: str) -> bool:
    """Close ``run_id``: every later join fails with RendezvousClosedError.

    Returns:
        Whether the run was closed already.
    """
    key = _keys.closed_key(key_prefix, run_id)
    before, _ = kv.get(key)
    kv.put(key, "1", records.META_TTL)
    # A fresh lease (not a shared clean-up one): the marker goes ENDED_TTL after this
    # close, as etcd counts. While it stands no new process starts the run again.
    kv.put_owned(_keys.ended_key(key_prefix, run_id), "1", kv.grant(records.ENDED_TTL))
    return before is not None
