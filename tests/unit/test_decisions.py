"""The rendezvous decision table, with plain data (no etcd, no clock)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from etcd_rdzv import _keys
from etcd_rdzv._kv import Event, Record
from etcd_rdzv.rendezvous import decisions as D
from etcd_rdzv.rendezvous.watch import RoundView

from ._views import join_view

P = D.Participant


def view(**kw: Any) -> D.JoinView:
    """Nodes a and b in round 1, a coordinating."""
    kw.setdefault("participants", (P("a", "h", 1), P("b", "h", 2)))
    return join_view(**kw)


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
            D.Wait(700.0, D.Why.PREVIOUS),
        ),
        # below min: wait for the deadline (or a change)
        (view(min_nodes=3), D.Wait(700.0, D.Why.JOINED)),
        # min reached, last call running: the coordinator waits for its end
        (view(min_reached=95.0), D.Wait(125.0, D.Why.LAST_CALL)),
        # last call over: complete, ranks in arrival order
        (view(min_reached=60.0), D.Complete(("a", "b"))),
        (view(min_reached=70.0), D.Complete(("a", "b"))),
        # the coordinator need not be the first arrival: no grace period for anyone
        (view(me="b", min_reached=70.0), D.Complete(("a", "b"))),
        (view(me="b", min_reached=70.5), D.Wait(100.5, D.Why.LAST_CALL)),
        # max reached: complete at once
        (view(max_nodes=2), D.Complete(("a", "b"))),
        (view(me="b", max_nodes=2), D.Complete(("a", "b"))),
        # the wait never goes past the join deadline
        (view(min_reached=95.0, deadline=110.0), D.Wait(110.0, D.Why.LAST_CALL)),
    ],
)
def test_decide(v: D.JoinView, expected: object) -> None:
    assert D.decide(v) == expected


def test_more_than_max_keeps_the_first_arrivals() -> None:
    people = tuple(P(n, "h", i) for i, n in enumerate("abcde"))
    action = D.decide(view(participants=people, max_nodes=4))
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


def follower(**kw: object) -> D.FollowView:
    base = D.FollowView(
        me="a", closed=False, result=None, coordinated=True, now=100.0, deadline=700.0
    )
    return replace(base, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("v", "expected"),
    [
        # the coordinator announced the run closed: that beats a result
        (follower(closed=True, result=("a",)), D.Closed()),
        # it announced the result, with me / without me
        (follower(result=("b", "a")), D.Joined(1, 2, ("b", "a"))),
        (follower(result=("b", "c")), D.NextRound()),
        # a result counts even when the coordinator is gone
        (follower(result=("a",), coordinated=False), D.Joined(0, 1, ("a",))),
        # join deadline passed
        (follower(now=700.0), D.TimedOut()),
        # ... but the round's result names me (found as I gave up): a member
        (follower(now=700.0, result=("b", "a")), D.Joined(1, 2, ("b", "a"))),
        (follower(now=700.0, placed=3, world=300), D.Joined(3, 300, ())),
        (follower(now=700.0, coordinated=False), D.TimedOut()),
        # nobody coordinates (any more) and no result: take over
        (follower(coordinated=False), D.TakeOver()),
        # ... once this node's place in the succession comes (capped by the deadline)
        (follower(coordinated=False, claim_at=150.0), D.Wait(150.0, D.Why.SUCCESSION)),
        (follower(coordinated=False, claim_at=100.0), D.TakeOver()),
        (follower(coordinated=False, claim_at=900.0), D.Wait(700.0, D.Why.SUCCESSION)),
        (follower(coordinated=False, claim_at=900.0, now=700.0), D.TimedOut()),
        # a coordinator there: its place does not matter
        (follower(claim_at=150.0), D.Wait(700.0, D.Why.COORDINATOR)),
        (follower(coordinated=False, claim_at=150.0, result=("a",)), D.Joined(0, 1, ("a",))),
        # otherwise wait for the announcement, up to the deadline
        (follower(), D.Wait(700.0, D.Why.COORDINATOR)),
        # a slim announcement (a large round): this node's rank from its bucket, or none
        (follower(placed=3, world=300), D.Joined(3, 300, ())),
        (follower(placed=-1, world=300), D.NextRound()),
        (follower(placed=0, world=300, coordinated=False), D.Joined(0, 300, ())),
        (follower(placed=3, world=300, closed=True), D.Closed()),
    ],
)
def test_follow(v: D.FollowView, expected: object) -> None:
    assert D.follow(v) == expected


# -- the coordinator's picture of its round, from a listing and then events ------------

RDZV = _keys.rdzv_dir("/p", "job")


def _join_record(round_no: int, node: str, revision: int) -> Record:
    value = json.dumps({"id": node, "addr": f"h-{node}", "prev_rank": None})
    return Record(_keys.node_key("/p", "job", round_no, node), value, revision, revision)


def test_round_view_follows_events() -> None:
    v = RoundView(RDZV, 2)
    v.load([_join_record(1, "old", 3), _join_record(2, "a", 5), Record(RDZV + "/round", "2", 6)])
    assert (sorted(p.node_id for p in v.nodes.values()), len(v.prev)) == (["a"], 1)

    v.apply(Event("put", _join_record(2, "b", 7)))
    v.apply(Event("put", _join_record(3, "later", 8)))  # another round: not ours
    v.apply(Event("delete", Record(_join_record(1, "old", 3).key, "", 9)))
    assert sorted(p.node_id for p in v.nodes.values()) == ["a", "b"]
    assert [p.joined for p in sorted(v.nodes.values(), key=lambda p: p.joined)] == [5, 7]
    assert not v.prev

    v.apply(Event("put", Record(RDZV + "/closed", "1", 10)))
    coord = Record(_keys.coord_key("/p", "job", 2), json.dumps({"id": "a"}), 11)
    v.apply(Event("put", coord))
    assert v.closed and v.coordinator() == "a"

    # deleting a directory removes everything under it
    v.apply(Event("delete", Record(_keys.round_dir("/p", "job", 2), "", 12)))
    assert not v.nodes and v.coordinator() is None and v.closed
    v.apply(Event("delete", Record(RDZV, "", 13)))
    assert not v.closed


def _gone_record(round_no: int, node: str, revision: int) -> Record:
    return Record(_keys.gone_key("/p", "job", round_no, node), node, revision, revision)


@pytest.mark.parametrize("reverse", [False, True])
def test_round_view_leaves_out_the_nodes_that_gave_up(reverse: bool) -> None:
    # v2 writes a node's gone marker before deleting its key: the marker alone leaves
    # it out; a key written after the marker (the node joined again) counts again. In
    # any listing order (v2 lists a directory's keys unsorted).
    v = RoundView(RDZV, 2)
    listing = [_join_record(2, "a", 5), _join_record(2, "b", 6), _gone_record(2, "a", 8)]
    listing += [_join_record(2, "c", 9), _gone_record(2, "c", 7)]  # c: back after its marker
    v.load(listing[::-1] if reverse else listing)
    assert sorted(p.node_id for p in v.admitted()) == ["b", "c"]
    v.apply(Event("put", _gone_record(2, "b", 10)))
    assert sorted(p.node_id for p in v.admitted()) == ["c"]
    v.apply(Event("put", _join_record(2, "a", 11)))
    assert sorted(p.node_id for p in v.admitted()) == ["a", "c"]
    v.apply(Event("put", _gone_record(3, "c", 12)))  # another round's marker: not ours
    assert sorted(p.node_id for p in v.admitted()) == ["a", "c"]


@pytest.mark.parametrize("reverse", [False, True])
def test_round_view_a_refresh_after_the_gone_marker_is_no_new_arrival(reverse: bool) -> None:
    # v2's heart refreshes a join key's TTL (a new modified index, the same created
    # index); one that lands between the node's gone marker and its key's delete must
    # not bring the node back into the picture a result is made from.
    v = RoundView(RDZV, 2)
    a, b = _join_record(2, "a", 5), _join_record(2, "b", 6)
    refreshed = Record(a.key, a.value, 9, a.created)
    listing = [a, b, _gone_record(2, "a", 8), refreshed]
    v.load(listing[::-1] if reverse else listing)
    assert [p.node_id for p in v.admitted()] == ["b"]
    v.apply(Event("put", _gone_record(2, "b", 10)))
    v.apply(Event("put", Record(b.key, b.value, 11, b.created)))
    assert v.admitted() == ()
    v.apply(Event("put", _join_record(2, "b", 12)))  # written again: b joined again
    assert [p.node_id for p in v.admitted()] == ["b"]


def test_round_view_knows_the_members_of_the_previous_round() -> None:
    from etcd_rdzv.rendezvous import records

    v = RoundView(RDZV, 3)
    prev = records.result_record(("a", "b"), ("h", "h"), 40, 4)
    v.load([Record(_keys.result_key("/p", "job", 2), prev, 41), _join_record(3, "a", 50)])
    assert v.prev_members == frozenset({"a", "b"})
    # an older round's result, or a corrupt one, names no previous member
    v.load([Record(_keys.result_key("/p", "job", 1), prev, 41)])
    assert v.prev_members == frozenset()
    v.apply(Event("put", Record(_keys.result_key("/p", "job", 2), "{not json", 60)))
    assert v.prev_members == frozenset()


def test_round_view_rejects_foreign_join_records() -> None:
    from etcd_rdzv.errors import RendezvousStateError

    v = RoundView(RDZV, 1)
    bad = Record(_keys.node_key("/p", "job", 1, "x"), "not json", 2, 2)
    with pytest.raises(RendezvousStateError, match="does not hold a node record"):
        v.apply(Event("put", bad))


# -- spares: who counts as waiting, who gets in --------------------------------------


@pytest.mark.parametrize(
    ("world_size", "max_nodes", "waiting", "missing", "expected"),
    [
        (2, 2, 1, 0, 0),  # a full group: the waiting node is a spare, no restart
        (2, 2, 5, 0, 0),
        (2, 2, 1, 1, 2),  # a member is gone: the spare counts, so the group re-forms
        (2, 2, 0, 1, 1),
        (2, 4, 1, 0, 1),  # room to grow: a waiting node is a scale-up signal
        (1, 2, 0, 0, 0),
    ],
)
def test_nodes_waiting(
    world_size: int, max_nodes: int, waiting: int, missing: int, expected: int
) -> None:
    assert D.nodes_waiting(world_size, max_nodes, waiting, missing) == expected


def test_a_restart_never_swaps_a_member_for_a_spare() -> None:
    # The spare arrived first (its key is oldest), but the previous members come first.
    people = [P("spare", "h", 1), P("m1", "h", 5, prev_rank=1), P("m0", "h", 6, prev_rank=0)]
    full = view(me="m0", participants=tuple(people), max_nodes=2)
    assert D.decide(full) == D.Complete(("m0", "m1"))
    # Once a member is gone, the spare takes its place and the survivor keeps its rank.
    survivors = [people[0], people[1]]
    assert D.assign_ranks(survivors, 2) == ("spare", "m1")


@pytest.mark.parametrize(
    ("as_of", "buckets", "announced_at", "writes", "expected"),
    [
        (10, 0, 12, 1, 12),  # only the result (11) and the announcement (12) in between
        (10, 0, 13, 1, 10),  # a third write (a join, a death) came in between: from the decision
        (10, 0, 13, 2, 13),  # v2: its seal (11), the result (12), the announcement (13)
        (10, 0, 14, 2, 10),
        (10, 0, None, 1, 10),  # the result was read, not announced: from the decision
        (None, 0, 12, 1, None),  # no decision revision: list first
        # a slim round: its list (11), 3 buckets (12-14), result (15), announcement (16)
        (10, 3, 16, 1, 16),
        (10, 3, 17, 1, 10),
        (10, 3, 12, 1, 10),
    ],
)
def test_a_member_watcher_skips_the_announcement_only_when_nothing_else_changed(
    as_of: int | None, buckets: int, announced_at: int | None, writes: int, expected: int | None
) -> None:
    from etcd_rdzv.rendezvous.join import _watch_from
    from etcd_rdzv.rendezvous.records import Outcome

    outcome = Outcome((), (), as_of, None, None, 1, buckets, 300 if buckets else 0)
    assert _watch_from(outcome, announced_at, writes) == expected
