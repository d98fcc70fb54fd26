"""The rendezvous decisions, as pure functions of what a node sees.

One node per round, the *coordinator*, follows the round's membership: it keeps a
:class:`JoinView` up to date from etcd's events, asks :func:`decide` what to do, does
it, and repeats. Every other node, a *follower*, only waits for the coordinator's
announcement and asks :func:`follow`. Nothing here does I/O or reads a clock, so the
whole decision table is tested with plain data (``tests/unit/test_decisions.py``).

Times are the *local* monotonic clock of the deciding node: no wall clock is ever
compared across hosts. Liveness comes from etcd (a node's key expires when its
heartbeats stop), not from timestamps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Closed",
    "Complete",
    "FollowView",
    "JoinView",
    "Joined",
    "NextRound",
    "Participant",
    "Rejoin",
    "TakeOver",
    "TimedOut",
    "Wait",
    "assign_ranks",
    "decide",
    "follow",
    "reached_at",
]


@dataclass(frozen=True)
class Participant:
    """A node whose join key is alive in the round being formed."""

    node_id: str
    addr: str
    joined: int  # etcd creation revision of its key: the arrival order
    prev_rank: int | None = None


@dataclass(frozen=True)
class JoinView:
    """What the coordinator knows about the round it coordinates."""

    me: str
    closed: bool
    result: tuple[str, ...] | None  # member ids in rank order once the round completed
    participants: tuple[Participant, ...]  # live join keys, any order
    prev_round_live: int  # members of the previous round still holding their key there
    min_nodes: int
    max_nodes: int
    now: float
    min_reached: float | None  # when this node first saw >= min_nodes (local clock)
    last_call_timeout: float
    deadline: float  # join deadline (local clock)


@dataclass(frozen=True)
class FollowView:
    """What a follower knows: only what the coordinator announced, and whether one is
    there at all."""

    me: str
    closed: bool  # the coordinator announced that the run is closed
    result: tuple[str, ...] | None  # member ids in rank order once the round completed
    coordinated: bool  # a node holds the round's coordinator key
    now: float
    deadline: float  # join deadline (local clock)


@dataclass(frozen=True)
class Wait:
    """Wait for a change in etcd, or until ``until`` (local clock)."""

    until: float


@dataclass(frozen=True)
class Complete:
    """Write the result of the round: ``members[i]`` gets rank ``i``."""

    members: tuple[str, ...]


@dataclass(frozen=True)
class Joined:
    """The round completed with this node in it."""

    rank: int
    world_size: int
    members: tuple[str, ...]


@dataclass(frozen=True)
class NextRound:
    """The round completed without this node: join the next one (as a waiting node)."""


@dataclass(frozen=True)
class Rejoin:
    """This node's join key is gone (it missed its heartbeats): write it again."""


@dataclass(frozen=True)
class TakeOver:
    """No node coordinates the round (the coordinator left or died): try to become
    its coordinator."""


@dataclass(frozen=True)
class Closed:
    """The rendezvous is closed."""


@dataclass(frozen=True)
class TimedOut:
    """The join deadline passed."""


Action = Wait | Complete | Joined | NextRound | Rejoin | TakeOver | Closed | TimedOut


def reached_at(previous: float | None, count: int, threshold: int, now: float) -> float | None:
    """When the round first had ``threshold`` live participants, as seen here.

    Resets to ``None`` when the count drops below it again (a participant died), so
    the last call starts over once the minimum is back.
    """
    if count < threshold:
        return None
    return now if previous is None else previous


def assign_ranks(participants: Sequence[Participant], world_size: int) -> tuple[str, ...]:
    """Choose ``world_size`` members by arrival and give them ranks.

    A member keeps its rank from the previous round when that rank still exists and
    no one else claimed it first; the others fill the free ranks in arrival order.
    """
    chosen = sorted(participants, key=lambda p: (p.joined, p.node_id))[:world_size]
    slots: list[str | None] = [None] * len(chosen)
    rest: list[Participant] = []
    for p in chosen:
        if p.prev_rank is not None and 0 <= p.prev_rank < len(slots) and slots[p.prev_rank] is None:
            slots[p.prev_rank] = p.node_id
        else:
            rest.append(p)
    free = iter(i for i, s in enumerate(slots) if s is None)
    for p in rest:
        slots[next(free)] = p.node_id
    return tuple(s for s in slots if s is not None)


def _outcome(me: str, result: tuple[str, ...]) -> Joined | NextRound:
    if me in result:
        return Joined(result.index(me), len(result), result)
    return NextRound()


def decide(view: JoinView) -> Action:
    """The coordinator's next step. Only the coordinator decides when the round is
    complete, so it completes at the moment the rules allow, with no grace period;
    should two nodes briefly both coordinate (one was paused past its key's TTL),
    the result is written create-if-absent and both adopt whichever landed."""
    if view.closed:
        return Closed()
    if view.result is not None:
        return _outcome(view.me, view.result)
    if view.now >= view.deadline:
        return TimedOut()
    if all(p.node_id != view.me for p in view.participants):
        return Rejoin()
    if view.prev_round_live > 0:
        # Exclusivity: the previous group still runs; this round forms only once all
        # of its members have left it (re-joined here, or died).
        return Wait(view.deadline)

    count = len(view.participants)
    if count >= view.max_nodes:
        return Complete(assign_ranks(view.participants, view.max_nodes))
    if count >= view.min_nodes and view.min_reached is not None:
        complete_at = view.min_reached + view.last_call_timeout
        if view.now >= complete_at:
            return Complete(assign_ranks(view.participants, count))
        return Wait(min(complete_at, view.deadline))
    return Wait(view.deadline)


def follow(view: FollowView) -> Action:
    """A follower's next step: adopt the announced outcome, take over a round nobody
    coordinates, or wait for the coordinator."""
    if view.closed:
        return Closed()
    if view.result is not None:
        return _outcome(view.me, view.result)
    if view.now >= view.deadline:
        return TimedOut()
    if not view.coordinated:
        return TakeOver()
    return Wait(view.deadline)
