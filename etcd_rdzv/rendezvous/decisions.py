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

import enum
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "SUCCESSION_PER_NODE",
    "SUCCESSION_UNIT",
    "SUCCESSION_UNIT_MAX",
    "Closed",
    "Complete",
    "Fail",
    "Failed",
    "FollowView",
    "JoinView",
    "Joined",
    "NextRound",
    "Participant",
    "Rejoin",
    "TakeOver",
    "TimedOut",
    "Wait",
    "Why",
    "assign_ranks",
    "decide",
    "describe_ranks",
    "follow",
    "nodes_waiting",
    "rank_conflicts",
    "reached_at",
    "regroup_since",
    "rejoined",
    "succession_delay",
    "unit_bounds",
]


@dataclass(frozen=True)
class Participant:
    """A node whose join key is alive in the round being formed."""

    node_id: str
    addr: str
    joined: int  # etcd creation revision of its key: the arrival order
    prev_rank: int | None = None
    rank: int | None = None  # the static handler: the rank this node was given
    group: str | None = None  # node_group: ranks are contiguous within a group
    host: str | None = None  # host_id (None: a record of an older version)


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
    failed: str | None = None  # the round's result is a fault: why it failed
    # The static handler (every node has a fixed rank; the world is max_nodes):
    static: bool = False
    prev: tuple[Participant, ...] = ()  # the previous round's live join keys, parsed
    conflict_since: float | None = None  # when a rank claimed twice was first seen here
    node_ttl: float = 0.0  # seconds a dead node's key outlives it
    node_unit: int = 1  # the world size is a multiple of this (the native handler)
    # Seconds the previous round's keys are waited for once its members re-join:
    rejoin_grace: float = 0.0
    # When this node first saw a previous member re-join here (see regroup_since):
    regroup_since: float | None = None
    # The members of the previous round (its result), as far as this node read it:
    prev_members: frozenset[str] = frozenset()


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
    failed: str | None = None  # the announced result is a fault: why the round failed
    # A slim announcement (a large round: see .roster): this node's rank, read from
    # its bucket (-1: not a member), and the world size; ``result`` is then None.
    placed: int | None = None
    world: int = 0
    # When this node may claim a round nobody coordinates (its place in the
    # succession: see succession_delay); None: at once.
    claim_at: float | None = None


class Why(enum.Enum):
    """Why a node waits: the rule of :func:`decide` (or :func:`follow`) that said
    :class:`Wait`, a closed set. The progress text (:mod:`.waiting`) reads it, so the
    words always follow the rule. Counting down to a :attr:`Wait.until` before the
    deadline: LAST_CALL, REGROUP, CONFLICT; the others wait for a change in etcd."""

    #: Too few nodes for a round (below ``min_nodes``, or the minimum never seen).
    JOINED = "joined"
    #: Enough nodes: the last call runs until ``until``.
    LAST_CALL = "last call"
    #: The previous round's group runs (nobody of it re-joined): nodes here wait
    #: beside it, as spares or to enlarge it.
    PREVIOUS = "previous"
    #: The group re-forms: the members not back get ``rejoin_grace`` until ``until``.
    REGROUP = "regroup"
    #: A static round: ranks are missing (or the previous round's keys are alive).
    RANKS = "static"
    #: A static rank is claimed twice: a dead node's key may expire by ``until``.
    CONFLICT = "conflict"
    #: A follower: the coordinator has not announced the round's outcome.
    COORDINATOR = "coordinator"
    #: A follower: the coordinator key went; followers of earlier places claim the
    #: round first (see :func:`succession_delay`), until ``until``.
    SUCCESSION = "succession"


@dataclass(frozen=True)
class Wait:
    """Wait for a change in etcd, or until ``until`` (local clock); ``why``: the rule
    that says so."""

    until: float
    why: Why


@dataclass(frozen=True)
class Complete:
    """Write the result of the round: ``members[i]`` gets rank ``i``."""

    members: tuple[str, ...]


@dataclass(frozen=True)
class Fail:
    """Write a fault as the round's result: ``nodes`` (the participants) fail with
    ``reason``; nodes that come later join the next round."""

    reason: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Failed:
    """The round failed with this node in it (a configuration error, such as a rank
    claimed twice): raise ``reason``."""

    reason: str


@dataclass(frozen=True)
class Joined:
    """The round completed with this node in it (``members``: in rank order; empty
    when a slim announcement gave only this node's rank)."""

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


Action = (
    Wait | Complete | Fail | Failed | Joined | NextRound | Rejoin | TakeOver | Closed | TimedOut
)

#: Seconds past a node TTL before a rank claimed twice counts as a real conflict:
#: the older claim may be the key of a dead process, which expires within one TTL.
CONFLICT_SLACK = 1.0


def reached_at(previous: float | None, count: int, threshold: int, now: float) -> float | None:
    """When the round first had ``threshold`` live participants, as seen here.

    Resets to ``None`` when the count drops below it again (a participant died), so
    the last call starts over once the minimum is back.
    """
    if count < threshold:
        return None
    return now if previous is None else previous


def rejoined(participants: Sequence[Participant], prev_members: frozenset[str]) -> bool:
    """Whether a member of the previous round re-joined here: the group is re-forming
    (a member died, left or lost its worker), not merely gaining nodes. A member of
    an older round (a host that froze and woke up after the group moved on) does
    not count: it is a new node for this round."""
    return any(p.node_id in prev_members for p in participants)


def regroup_since(
    previous: float | None,
    participants: Sequence[Participant],
    prev_members: frozenset[str],
    now: float,
) -> float | None:
    """When this coordinator first saw the group re-forming (a previous member
    re-joined here): the start of the re-join grace for the members not back yet.
    ``None`` while nobody re-joined."""
    if not rejoined(participants, prev_members):
        return None
    return now if previous is None else previous


def unit_bounds(min_nodes: int, max_nodes: int, node_unit: int = 1) -> tuple[int, int]:
    """The smallest and largest world sizes a round may have with ``node_unit``:
    ``min_nodes`` rounded *up* to a multiple of the unit, ``max_nodes`` rounded down.

    With ``node_unit=1`` these are ``(min_nodes, max_nodes)``. The settings refuse a
    unit for which the lower bound exceeds the upper one (no multiple in between), so
    a caller with validated settings may assume ``low <= high``.
    """
    unit = max(node_unit, 1)
    return -(-min_nodes // unit) * unit, max_nodes // unit * unit


def _blocks(chosen: Sequence[Participant]) -> list[list[Participant]]:
    """The members by ``group``: groups in the order of their names, the nodes
    without a group last (one block, which is all of them when nobody has a group)."""
    by_group: dict[str | None, list[Participant]] = {}
    for p in chosen:
        by_group.setdefault(p.group, []).append(p)
    names = sorted(g for g in by_group if g is not None)
    order: list[str | None] = [*names, None] if None in by_group else list(names)
    return [by_group[g] for g in order]


def assign_ranks(participants: Sequence[Participant], world_size: int) -> tuple[str, ...]:
    """Choose ``world_size`` members and give them ranks.

    Members of an earlier round (a ``prev_rank``) come first, then the others by
    arrival: when more nodes want in than fit, a restart never swaps a member for a
    spare. The ranks of each ``group`` are contiguous, the groups in the order of
    their names (nodes without a group after them): the order is the same in every
    round, whoever arrived first. Within its group's block of ranks, a member keeps
    its rank from the previous round when that rank is still in the block and no one
    else claimed it first; the others fill the block's free ranks in arrival order.
    So members keep their ranks whenever their group keeps its place and size (with
    no groups at all: whenever their rank still exists).
    """
    chosen = sorted(participants, key=lambda p: (p.prev_rank is None, p.joined, p.node_id))
    chosen = chosen[:world_size]
    slots: list[str | None] = [None] * len(chosen)
    start = 0
    for block in _blocks(chosen):
        block.sort(key=lambda p: (p.joined, p.node_id))
        end = start + len(block)
        rest: list[Participant] = []
        for p in block:
            rank = p.prev_rank
            if rank is not None and start <= rank < end and slots[rank] is None:
                slots[rank] = p.node_id
            else:
                rest.append(p)
        free = iter(i for i in range(start, end) if slots[i] is None)
        for p in rest:
            slots[next(free)] = p.node_id
        start = end
    return tuple(s for s in slots if s is not None)


def nodes_waiting(
    world_size: int, max_nodes: int, waiting: int, missing: int, node_unit: int = 1
) -> int:
    """What a member's ``num_nodes_waiting()`` reports (non-zero: re-rendezvous).

    ``waiting``: nodes with a join key in a later round; ``missing``: members of this
    round whose key is gone (they died or left). Waiting nodes count only when a new
    round with them could have a larger world: at most ``max_nodes`` and a multiple of
    ``node_unit``, so at least a whole unit more than ``world_size``. Otherwise they
    are *spares*, or the members would restart into the same world again and again.
    Once a member is missing, the group is below its size and the spares count again.
    """
    if missing > 0:
        return missing + waiting
    unit = max(node_unit, 1)
    larger = min(world_size + waiting, max_nodes) // unit * unit
    return waiting if larger > world_size else 0


def _outcome(me: str, result: tuple[str, ...], failed: str | None) -> Joined | Failed | NextRound:
    if me not in result:
        return NextRound()
    if failed is not None:
        return Failed(failed)
    return Joined(result.index(me), len(result), result)


def _who(p: Participant) -> str:
    return f"node {p.node_id!r}" + (f" at {p.addr}" if p.addr else "")


def rank_conflicts(
    participants: Sequence[Participant], prev: Sequence[Participant] = ()
) -> dict[int, tuple[Participant, ...]]:
    """Static ranks claimed by more than one node: in this round, or here and by a
    live key of the previous round (a node still running there). A node's own key in
    both rounds counts once."""
    claims: dict[int, dict[str, Participant]] = {}
    for p in (*participants, *prev):
        if p.rank is not None:
            claims.setdefault(p.rank, {}).setdefault(p.node_id, p)
    mine = {p.rank for p in participants}
    return {
        rank: tuple(sorted(by_node.values(), key=lambda p: (p.joined, p.node_id)))
        for rank, by_node in sorted(claims.items())
        if len(by_node) > 1 and rank in mine
    }


def describe_ranks(participants: Sequence[Participant], world_size: int) -> str:
    """Which static ranks are present (and held by whom) and which are missing."""
    held = {p.rank: p for p in sorted(participants, key=lambda p: p.joined)}
    present = [f"{r} ({_who(held[r])})" for r in range(world_size) if r in held]
    missing = [str(r) for r in range(world_size) if r not in held]
    return (
        f"rank(s) present: {', '.join(present) or 'none'}; missing: {', '.join(missing) or 'none'}"
    )


def _decide_static(view: JoinView) -> Action:
    """A static round: every node brings its rank; complete when ranks
    ``0..max_nodes-1`` are all there, each once."""
    nodes = tuple(p.node_id for p in view.participants)
    for p in view.participants:
        if p.rank is None:
            return Fail(
                f"{_who(p).capitalize()} joined the static rendezvous without a rank: "
                "does a non-static handler use the same run id?",
                nodes,
            )
        if not 0 <= p.rank < view.max_nodes:
            return Fail(
                f"{_who(p).capitalize()} claims rank {p.rank}, outside 0..{view.max_nodes - 1} "
                f"(max_nodes={view.max_nodes}): do the nodes disagree on --nnodes?",
                nodes,
            )
    conflicts = rank_conflicts(view.participants, view.prev)
    if conflicts:
        # A node restarted after a crash claims the rank that its dead predecessor's
        # key still holds, until that key expires: only a claim that outlives a TTL
        # is a second live node with the same rank.
        since = view.now if view.conflict_since is None else view.conflict_since
        confirm_at = since + view.node_ttl + CONFLICT_SLACK
        if view.now >= confirm_at:
            rank, holders = next(iter(conflicts.items()))
            return Fail(
                f"Rank {rank} is claimed by more than one live node: "
                + " and ".join(_who(p) for p in holders)
                + ". Give each node its own rank.",
                nodes,
            )
        return Wait(min(confirm_at, view.deadline), Why.CONFLICT)
    if view.prev_round_live > 0:
        return Wait(view.deadline, Why.PREVIOUS)
    ranks = {p.rank for p in view.participants}
    if ranks == set(range(view.max_nodes)):
        by_rank = sorted(view.participants, key=lambda p: p.rank or 0)
        return Complete(tuple(p.node_id for p in by_rank))
    return Wait(view.deadline, Why.RANKS)


def decide(view: JoinView) -> Action:
    """The coordinator's next step. Only the coordinator decides when the round is
    complete, so it completes at the moment the rules allow, with no grace period;
    should two nodes briefly both coordinate (one was paused past its key's TTL),
    the result is written create-if-absent and both adopt whichever landed."""
    if view.closed:
        return Closed()
    if view.result is not None:
        return _outcome(view.me, view.result, view.failed)
    if view.now >= view.deadline:
        return TimedOut()
    if all(p.node_id != view.me for p in view.participants):
        return Rejoin()
    if view.static:
        return _decide_static(view)
    regrouping = rejoined(view.participants, view.prev_members)
    if view.prev_round_live > 0:
        # Exclusivity: the previous group still runs; spares and new nodes wait until
        # it re-forms. Once a member re-joined, the members still missing get a short
        # grace (rejoin_grace), not their keys' TTL: a member that died holds its key
        # until the TTL runs out, and one that lives re-joins later as a waiting node.
        if not regrouping or view.regroup_since is None:
            return Wait(view.deadline, Why.PREVIOUS)
        grace_ends = view.regroup_since + view.rejoin_grace
        if view.now < grace_ends:
            return Wait(min(grace_ends, view.deadline), Why.REGROUP)

    # node_unit: the world is a multiple of the unit; the nodes beyond the largest
    # multiple the live ones allow wait for the next round as spares.
    low, high = unit_bounds(view.min_nodes, view.max_nodes, view.node_unit)
    count = len(view.participants)
    unit = max(view.node_unit, 1)
    if count >= high:
        return Complete(assign_ranks(view.participants, high))
    if regrouping and count >= low:
        # A group re-forming after a completed round: the members that re-joined and
        # the spares are who the job has; no last call (nodes that come later are
        # waiting nodes and scale it up in a round of their own).
        return Complete(assign_ranks(view.participants, count // unit * unit))
    if count >= low and view.min_reached is not None:
        complete_at = view.min_reached + view.last_call_timeout
        if view.now >= complete_at:
            return Complete(assign_ranks(view.participants, count // unit * unit))
        return Wait(min(complete_at, view.deadline), Why.LAST_CALL)
    return Wait(view.deadline, Why.JOINED)


def follow(view: FollowView) -> Action:
    """A follower's next step: adopt the announced outcome, take over a round nobody
    coordinates, or wait for the coordinator."""
    if view.closed:
        return Closed()
    if view.placed is not None:  # a slim outcome: the node's rank, or none
        return NextRound() if view.placed < 0 else Joined(view.placed, view.world, ())
    if view.result is not None:
        return _outcome(view.me, view.result, view.failed)
    if view.now >= view.deadline:
        return TimedOut()
    if not view.coordinated:
        if view.claim_at is not None and view.now < view.claim_at:
            return Wait(min(view.claim_at, view.deadline), Why.SUCCESSION)
        return TakeOver()
    return Wait(view.deadline, Why.COORDINATOR)


#: Seconds, at least, between two places of a succession (see
#: :func:`succession_delay`): a fast etcd answers within milliseconds.
SUCCESSION_UNIT = 0.05
#: Seconds between two places of a succession per node of ``max_nodes`` (the unit
#: is at least this long): a large job's writes land late under its own load, which
#: the answers to its reads (served by any member, at once) do not show.
SUCCESSION_PER_NODE = 0.0005
#: Seconds, at most, between two places: a request that waited out an election
#: leaves no node waiting long for its place should the places before it be empty.
SUCCESSION_UNIT_MAX = 2.0


def succession_delay(place: int, answer_time: float, max_nodes: int) -> float:
    """Seconds a follower waits, once it saw its round's coordinator key go, before
    it claims the round: 0 for ``place`` 1, then one unit more each time ``place``
    doubles (2-3: one unit, 4-7: two, ..., 4,096: twelve).

    Each follower draws its place at random from 1 to ``max_nodes``, so about one
    follower holds each of the first places, two share the next unit, four the one
    after: the followers of a unit claim only once the claims of the units before
    had time to land and be seen in their watch, and whoever sees a claim follows
    it. A unit is twice ``answer_time`` (how long this node's requests lately took)
    or ``max_nodes`` x :data:`SUCCESSION_PER_NODE`, whichever is longer, within
    :data:`SUCCESSION_UNIT` and :data:`SUCCESSION_UNIT_MAX`.

    Before, every follower claimed at once, and every claim is a raft proposal,
    refused or not: at 4,096 nodes on v2 under load each loss of the coordinator key
    was some 4,000 refused creates, the load that made the next coordinator lose
    its key."""
    if place <= 1:
        return 0.0
    unit = max(SUCCESSION_UNIT, 2 * answer_time, max_nodes * SUCCESSION_PER_NODE)
    return min(unit, SUCCESSION_UNIT_MAX) * (place.bit_length() - 1)
