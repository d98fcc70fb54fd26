"""A follower of one round: it watches nothing but the coordinator key.

The coordinator announces the round's outcome by writing it into its key; the
follower adopts it from the event (:func:`.decisions.follow`). When the key goes
without an announcement (its holder left or died), the follower reads the round's
result (the coordinator may have finished), and otherwise returns TakeOver: it tries
to coordinate itself.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from .. import _keys
from .._kv import Event, Record, WatchCompacted, Watcher
from . import decisions as D
from . import records
from .progress import Progress
from .records import Outcome
from .roster import read_rank
from .session import Session

__all__ = ["Followed", "follow", "from_result"]


@dataclass(frozen=True)
class Followed:
    """How following ended: the action (Joined, NextRound, Failed, Closed, TimedOut,
    or TakeOver when nobody coordinates), and for a final outcome the outcome and the
    revision of its announcement (``None`` when it was read from the result)."""

    action: D.Action
    outcome: Outcome | None = None
    announced_at: int | None = None


def follow(
    session: Session,
    round_no: int,
    watcher: Watcher,
    deadline: float,
    holder: Record | None,
    progress: Progress | None,
) -> Followed:
    """Wait for the announcement of round ``round_no``'s coordinator, watching only
    its key (``holder``: the key as last read, if it was there). Should the key go,
    this node claims the round when its place in the succession comes (a place drawn
    at random: see :func:`.decisions.succession_delay`), unless it saw another node's
    claim first."""
    kv, s = session.kv, session.s
    coord = watcher.key
    coordinated = True  # the key exists (read, or our create of it was refused)
    closed, outcome = records.parse_announcement(holder) if holder is not None else (False, None)
    announced_at = holder.revision if outcome is not None and holder is not None else None
    leader = records.coordinator_of(holder) if holder is not None else None
    placed: int | None = None  # this node's rank in a slim outcome (-1: not a member)
    claim_at: float | None = None  # when this node may claim the round (None: at once)
    while True:
        now = time.monotonic()
        if outcome is not None and outcome.buckets and placed is None:
            rank, outcome = read_rank(
                kv, s.key_prefix, s.run_id, round_no, outcome, session.node_id, announced_at
            )
            if outcome.buckets:  # else the whole result was read instead
                placed = -1 if rank is None else rank
        slim = outcome is not None and outcome.buckets > 0
        action = D.follow(
            D.FollowView(
                me=session.node_id,
                closed=closed,
                result=outcome.members if outcome is not None and not slim else None,
                coordinated=coordinated,
                now=now,
                deadline=deadline,
                failed=outcome.error if outcome is not None else None,
                placed=placed,
                world=outcome.size if outcome is not None else 0,
                claim_at=claim_at,
            )
        )
        if not isinstance(action, D.Wait):
            if isinstance(action, (D.Joined, D.NextRound, D.Failed)):
                return Followed(action, outcome, announced_at)
            return Followed(action)
        if progress is not None:
            # (Nobody coordinates while this node waits for its place to claim.)
            progress.following(round_no, leader if coordinated else None, deadline)
        was_coordinated = coordinated
        try:
            events = watcher.next(max(action.until - now, 0.0))
        except WatchCompacted:
            record, _ = watcher.reread(lambda: kv.get(coord))
            events = [] if record is None else [Event("put", record)]
            coordinated = record is not None
        for event in events:
            coordinated = event.kind == "put"
            if coordinated:
                closed, announced = records.parse_announcement(event.record)
                if outcome is None and announced is not None:
                    outcome, announced_at = announced, event.record.revision
                leader = records.coordinator_of(event.record)
                claim_at = None
        if not was_coordinated or coordinated:
            continue
        # The key went: this node's place among the followers that may claim it.
        place = random.randint(1, max(s.max_nodes, 1))
        delay = D.succession_delay(place, kv.answer_time, s.max_nodes)
        claim_at = time.monotonic() + delay
        if outcome is None and not closed:
            # The coordinator left or died: maybe after completing the round (read
            # once: while this node waits for its place, nobody coordinates, so
            # nobody writes the result).
            record, _ = kv.get(_keys.result_key(s.key_prefix, s.run_id, round_no))
            if record is not None:
                outcome = records.parse_result(record)


def from_result(session: Session, round_no: int, record: Record) -> Followed:
    """What round ``round_no``'s result ``record`` means for this node, read after it
    gave up on the round and found the round complete: Joined when the result names
    it (it is a member, whatever its deadline), else NextRound or Failed."""
    s = session.s
    outcome = records.parse_result(record)
    placed: int | None = None
    if outcome.buckets:
        rank, outcome = read_rank(
            session.kv, s.key_prefix, s.run_id, round_no, outcome, session.node_id, record.revision
        )
        if outcome.buckets:
            placed = -1 if rank is None else rank
    now = time.monotonic()
    action = D.follow(
        D.FollowView(
            me=session.node_id,
            closed=False,
            result=outcome.members if not outcome.buckets else None,
            coordinated=True,
            now=now,
            deadline=now,
            failed=outcome.error,
            placed=placed,
            world=outcome.size,
        )
    )
    return Followed(action, outcome)
