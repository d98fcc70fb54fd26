"""The rendezvous decision table, with plain data (no etcd, no clock)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from etcd_rdzv import _decisions as D

P = D.Participant


def view(**kw: object) -> D.JoinView:
    base = D.JoinView(
        me="a",
        closed=False,
        result=None,
        participants=(P("a", "h", 1), P("b", "h", 2)),
        prev_round_live=0,
        min_nodes=2,
        max_nodes=4,
        now=100.0,
        min_reached=None,
        max_reached=None,
        last_call_timeout=30.0,
        deadline=700.0,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("v", "expected"),
    [
        # closed beats everything, even a completed round
        (view(closed=True, result=("a",)), D.Closed()),
        # round completed with me / without me
        (view(result=("b", "a")), D.Joined(1, 2, ("b", "a"))),
        (view(result=("b", "c")), D.NextRound()),
        # join deadline passed
        (view(now=700.0), D.TimedOut()),
        # my key is gone: write it again
        (view(participants=(P("b", "h", 2),)), D.Rejoin()),
        # the previous group still runs: wait, whatever the count
        (
            view(prev_round_live=1, participants=tuple(P(n, "h", i) for i, n in enumerate("abcd"))),
            D.Wait(700.0),
        ),
        # below min: wait for the deadline (or a change)
        (view(min_nodes=3), D.Wait(700.0)),
        # min reached, last call running: the leader (first arrival) waits for its end
        (view(min_reached=95.0), D.Wait(125.0)),
        # last call over: the leader completes, ranks in arrival order
        (view(min_reached=60.0), D.Complete(("a", "b"))),
        # a follower completes only after a grace period past the last call
        (view(me="b", min_reached=69.5), D.Wait(100.5)),
        (view(me="b", min_reached=69.0), D.Complete(("a", "b"))),
        # max reached: the leader completes at once
        (view(max_nodes=2, max_reached=100.0), D.Complete(("a", "b"))),
        (view(me="b", max_nodes=2, max_reached=100.0), D.Wait(101.0)),
        # the wait never goes past the join deadline
        (view(min_reached=95.0, deadline=110.0), D.Wait(110.0)),
    ],
)
def test_decide(v: D.JoinView, expected: object) -> None:
    assert D.decide(v) == expected


def test_more_than_max_keeps_the_first_arrivals() -> None:
    people = tuple(P(n, "h", i) for i, n in enumerate("abcde"))
    action = D.decide(view(participants=people, max_nodes=4, max_reached=0.0))
    assert action == D.Complete(("a", "b", "c", "d"))
    late = D.decide(view(me="e", participants=people, result=("a", "b", "c", "d")))
    assert late == D.NextRound()


def test_ranks_are_kept_where_possible() -> None:
    people = [
        P("new1", "h", 1),
        P("old2", "h", 2, prev_rank=2),
        P("old0", "h", 3, prev_rank=0),
        P("old5", "h", 4, prev_rank=5),  # rank 5 no longer exists
    ]
    assert D.assign_ranks(people, 4) == ("old0", "new1", "old2", "old5")


def test_rank_clash_goes_to_the_first_arrival() -> None:
    people = [P("x", "h", 1, prev_rank=0), P("y", "h", 2, prev_rank=0)]
    assert D.assign_ranks(people, 2) == ("x", "y")


def test_ranks_cover_zero_to_n() -> None:
    people = [P(f"n{i}", "h", 10 - i, prev_rank=(i * 7) % 5) for i in range(9)]
    members = D.assign_ranks(people, 9)
    assert sorted(members) == sorted(p.node_id for p in people)
    assert len(set(members)) == 9


@pytest.mark.parametrize(
    ("previous", "count", "expected"),
    [(None, 1, None), (None, 2, 5.0), (3.0, 2, 3.0), (3.0, 1, None)],
)
def test_reached_at(previous: float | None, count: int, expected: float | None) -> None:
    assert D.reached_at(previous, count, 2, 5.0) == expected
