"""A recorded history of rendezvous outcomes, and one checker of its invariants.

A test (or a benchmark) records what each node saw: every completed round it
returned from ``next_rendezvous()`` (round, rank, world size, the member list if
known) and every call that raised (the error, the round it was in if known). Then
:func:`check` verifies over all of them what the rendezvous promises, as etcd's own
robustness tests check a recorded history rather than each step:

- in each round, ranks are unique and below the world size, every node reports the
  same world size, and one member list (each member at its rank);
- each node's rounds only go up;
- a node listed in a round returned that round: no member gave up on it (when not
  every node's outcome was recorded, this is checked for the nodes that gave up);
- with every node's outcome recorded (``complete``), the ranks of each round are
  exactly ``0..world-1``.

Member lists come from the nodes' reports and, optionally, from etcd (``rounds``:
each completed round's list as etcd holds it, e.g. from ``etcd-rdzv status``). ::

    history = History()
    result = handler.next_rendezvous()          # in each node
    history.joined(node_id, result.round, result.rank, result.world_size, result.members)
    ...                                         # or, when it raised:
    history.gave_up(node_id, exc)
    check(history.entries, complete=True)
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["GaveUp", "History", "HistoryError", "Joined", "check", "from_fleet", "violations"]


@dataclass(frozen=True)
class Joined:
    """A node's ``next_rendezvous()`` returned round ``round`` with this rank."""

    node: str
    round: int
    rank: int
    world: int
    members: tuple[str, ...] | None = None


@dataclass(frozen=True)
class GaveUp:
    """A node's ``next_rendezvous()`` raised ``error`` (in round ``round``, if known)."""

    node: str
    error: str
    round: int | None = None


Entry = Joined | GaveUp


class HistoryError(AssertionError):
    """The history breaks an invariant; the message lists every violation."""


class History:
    """Outcomes recorded by many threads, in the order they were recorded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.entries: list[Entry] = []

    def record(self, entry: Entry) -> None:
        with self._lock:
            self.entries.append(entry)

    def joined(
        self,
        node: str,
        round_no: int,
        rank: int,
        world: int,
        members: Sequence[str] | None = None,
    ) -> None:
        self.record(
            Joined(node, round_no, rank, world, None if members is None else tuple(members))
        )

    def gave_up(self, node: str, error: BaseException | str, round_no: int | None = None) -> None:
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.record(GaveUp(node, text, round_no))


def from_fleet(nodes: Iterable[Any]) -> list[Entry]:
    """The history that the node processes of a :class:`~fleet.Fleet`
    reported: each ``round`` event a :class:`Joined`, each failed
    ``next_rendezvous()`` a :class:`GaveUp` (node ids as the processes reported them
    when ready)."""
    entries: list[Entry] = []
    for proc in nodes:
        ids = list(getattr(proc, "node_ids", None) or [])
        for event in proc.events():
            index = int(event.get("node") or 0)
            node = event.get("node_id") or (ids[index] if index < len(ids) else None)
            node = str(node if node is not None else f"{proc.name}#{index}")
            if event["event"] == "round" and event.get("round") is not None:
                members = event.get("members")
                entries.append(
                    Joined(
                        node,
                        int(event["round"]),
                        int(event["rank"]),
                        int(event["world_size"]),
                        None if members is None else tuple(members),
                    )
                )
            elif event["event"] == "error" and event.get("op") == "next_rendezvous":
                entries.append(GaveUp(node, str(event.get("message"))))
    return entries


def violations(
    entries: Iterable[Entry],
    *,
    rounds: Mapping[int, Sequence[str]] | None = None,
    complete: bool = False,
    killed: Iterable[str] = (),
) -> list[str]:
    """Every invariant the history breaks, one sentence each (empty: none).

    Args:
        entries: the recorded outcomes, each node's in the order they happened.
        rounds: completed rounds' member lists (rank order) as etcd holds them.
        complete: every node's outcome of every call is in ``entries``.
        killed: nodes killed during the run (they return nothing: not held to the
            rule that a listed node returned its round).
    """
    found: list[str] = []
    joined: dict[int, list[Joined]] = defaultdict(list)
    by_node: dict[str, list[Entry]] = defaultdict(list)
    for entry in entries:
        by_node[entry.node].append(entry)
        if isinstance(entry, Joined):
            joined[entry.round].append(entry)
    lists: dict[int, set[tuple[str, ...]]] = defaultdict(set)
    for round_no, members in (rounds or {}).items():
        lists[round_no].add(tuple(members))
    for round_no, seen in joined.items():
        for entry in seen:
            if entry.members is not None:
                lists[round_no].add(entry.members)
    for round_no in sorted(set(joined) | set(lists)):
        found += _round_violations(round_no, joined.get(round_no, []), lists[round_no], complete)
    gave_up = {node for node, mine in by_node.items() if any(isinstance(e, GaveUp) for e in mine)}
    dead = set(killed)
    for node, mine in sorted(by_node.items()):
        numbers = [e.round for e in mine if isinstance(e, Joined)]
        if any(b <= a for a, b in itertools.pairwise(numbers)):
            found.append(f"node {node}: its rounds do not only go up: {numbers}")
    reported = {(e.node, e.round) for seen in joined.values() for e in seen}
    for round_no, kinds in sorted(lists.items()):
        if len(kinds) != 1:
            continue
        for member in next(iter(kinds)):
            if (member, round_no) in reported or member in dead:
                continue
            if member in gave_up:
                found.append(
                    f"round {round_no}: node {member} is a member, but it gave up "
                    f"({_errors(by_node[member])}) and never returned that round"
                )
            elif complete:
                found.append(f"round {round_no}: member {member} never returned that round")
    return found


def _round_violations(
    round_no: int, seen: list[Joined], kinds: set[tuple[str, ...]], complete: bool
) -> list[str]:
    found: list[str] = []
    if len(kinds) > 1:
        found.append(f"round {round_no}: {len(kinds)} different member lists")
    worlds = {e.world for e in seen}
    if len(worlds) > 1:
        found.append(f"round {round_no}: world sizes {sorted(worlds)}")
    ranks = sorted(e.rank for e in seen)
    if len(set(ranks)) != len(ranks):
        found.append(f"round {round_no}: a rank reported twice: {ranks}")
    world = max(worlds) if worlds else None
    if world is not None and any(not 0 <= r < world for r in ranks):
        found.append(f"round {round_no}: ranks {ranks} outside 0..{world - 1}")
    if complete and world is not None and ranks != list(range(world)):
        found.append(f"round {round_no}: ranks {ranks}, not 0..{world - 1}")
    if len(kinds) == 1:
        members = next(iter(kinds))
        if world is not None and len(members) != world:
            found.append(f"round {round_no}: {len(members)} members, world size {world}")
        wrong = [e.node for e in seen if e.rank >= len(members) or members[e.rank] != e.node]
        if wrong:
            found.append(f"round {round_no}: node(s) not at their rank in the list: {wrong[:5]}")
    return found


def _errors(mine: list[Entry]) -> str:
    return "; ".join(e.error for e in mine if isinstance(e, GaveUp))[:300]


def check(
    entries: Iterable[Entry],
    *,
    rounds: Mapping[int, Sequence[str]] | None = None,
    complete: bool = False,
    killed: Iterable[str] = (),
) -> None:
    """Raise :class:`HistoryError` listing every violation (see :func:`violations`)."""
    found = violations(entries, rounds=rounds, complete=complete, killed=killed)
    if found:
        raise HistoryError(f"{len(found)} violation(s):\n" + "\n".join(found[:50]))
