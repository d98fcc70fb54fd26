"""The re-forming rule (recovery in seconds), as a table of plain data.

A round that follows a completed one, once a member of that round re-joined it, is
the group re-forming: it completes at once, without the last call, when every
previous member whose key is still alive is back (with the spares), and waits for
the ones not back only ``rejoin_grace`` seconds from the first re-join, not their
keys' TTL. A round where nobody re-joined (spares and new nodes waiting beside a
running group, or a first round) follows the old rules.
"""

from __future__ import annotations

from typing import Any

import pytest

from etcd_rdzv.rendezvous import decisions as D

from ._views import join_view

P = D.Participant

# Members a and b of the previous round re-joined (their ranks 0 and 1); s is a spare
# (or a new node) that waited here; the coordinator is "a" at local time 100.
A, B, S = P("a", "h", 10, prev_rank=0), P("b", "h", 11, prev_rank=1), P("s", "h", 5)


def regroup(*people: D.Participant, **kw: Any) -> D.JoinView:
    kw.setdefault("prev_members", frozenset({"a", "b", "x"}))  # x: the one that died
    kw.setdefault("rejoin_grace", 2.0)
    kw.setdefault("min_nodes", 2)
    kw.setdefault("max_nodes", 3)
    return join_view(*people, **kw)


CASES = [
    # every live previous member is back (no previous key alive): complete at once,
    # no last call, the members first, then the spare
    ("all back, spare", regroup(A, B, S, regroup_since=99.0), D.Complete(("a", "b", "s"))),
    ("all back", regroup(A, B, regroup_since=99.9), D.Complete(("a", "b"))),
    # a previous member's key is still alive: wait for it, but only the grace
    (
        "one missing, in grace",
        regroup(A, S, prev_round_live=1, regroup_since=99.0),
        D.Wait(101.0, D.Why.REGROUP),
    ),
    (
        "one missing, grace over",
        regroup(A, S, prev_round_live=1, regroup_since=98.0),
        D.Complete(("a", "s")),
    ),
    # the grace never outlasts the join deadline
    (
        "grace past the deadline",
        regroup(A, S, prev_round_live=1, regroup_since=99.0, deadline=100.5),
        D.Wait(100.5, D.Why.REGROUP),
    ),
    # grace over but below min_nodes: wait for more nodes (no last call once they come)
    (
        "below min after grace",
        regroup(A, prev_round_live=1, regroup_since=90.0),
        D.Wait(700.0, D.Why.JOINED),
    ),
    ("min reached later", regroup(A, S, regroup_since=90.0), D.Complete(("a", "s"))),
    # nobody re-joined: spares and new nodes wait while the previous group runs
    (
        "spares beside a group",
        regroup(S, P("t", "h", 6), me="s", prev_round_live=2),
        D.Wait(700.0, D.Why.PREVIOUS),
    ),
    # ... and a round without previous members keeps its last call
    (
        "first round",
        regroup(P("a", "h", 1), P("b", "h", 2), min_reached=95.0, prev_members=frozenset()),
        D.Wait(125.0, D.Why.LAST_CALL),
    ),
    # a member of an older round (it froze, and woke up after the group moved on) is
    # a new node here: while the group runs, it waits, and forms no group of its own
    (
        "woken member of an older round",
        regroup(
            P("w", "h", 7, prev_rank=2), me="w", min_nodes=1, prev_round_live=2, regroup_since=None
        ),
        D.Wait(700.0, D.Why.PREVIOUS),
    ),
    # node_unit: the world is the largest whole multiple of the unit
    (
        "unit of two",
        regroup(A, B, S, regroup_since=99.0, max_nodes=4, node_unit=2),
        D.Complete(("a", "b")),
    ),
    # max_nodes: the previous members first, then spares by arrival
    (
        "more than max",
        regroup(A, B, S, P("t", "h", 6), regroup_since=99.0),
        D.Complete(("a", "b", "s")),
    ),
    # the static handler keeps its own rule: all ranks, previous keys gone
    (
        "static waits for the previous keys",
        regroup(
            P("a", "h", 10, prev_rank=0, rank=0),
            P("s", "h", 5, rank=1),
            static=True,
            max_nodes=2,
            prev_round_live=1,
            regroup_since=90.0,
        ),
        D.Wait(700.0, D.Why.PREVIOUS),
    ),
]


@pytest.mark.parametrize(("name", "v", "expected"), CASES, ids=[c[0] for c in CASES])
def test_regroup(name: str, v: D.JoinView, expected: object) -> None:
    assert D.decide(v) == expected, name


def test_the_grace_starts_at_the_first_rejoin_and_holds() -> None:
    prev = frozenset({"a", "b"})
    assert D.regroup_since(None, (S,), prev, 50.0) is None  # nobody re-joined
    assert D.regroup_since(None, (S, A), prev, 50.0) == 50.0
    assert D.regroup_since(50.0, (S, A, B), prev, 60.0) == 50.0
    # a node with a rank from an older round is no previous member
    woken = P("w", "h", 7, prev_rank=2)
    assert D.regroup_since(None, (S, woken), prev, 50.0) is None
