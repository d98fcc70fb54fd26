"""What a waiting join reports (rendezvous.waiting: coordinator, follower), with plain data;
when its log hears it (rendezvous.progress), and the words of a round formed."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from etcd_rdzv._commands import closed_message
from etcd_rdzv.cli import _wants_export
from etcd_rdzv.rendezvous import decisions as D
from etcd_rdzv.rendezvous import progress, waiting
from etcd_rdzv.rendezvous.listener import formed

from ._views import join_view, told
from .test_decisions_regroup import CASES as REGROUP_CASES

P = D.Participant


view = join_view


def static(*ranks: int, **kw: Any) -> D.JoinView:
    nodes = tuple(P(f"n{i}", "h", i, rank=r) for i, r in enumerate(ranks))
    return join_view(*nodes, me="n0", static=True, **kw)


@pytest.mark.parametrize(
    ("v", "text"),
    [
        (
            view(),
            "1 of 2 node(s) joined (min 2, max 4); waiting for more (600s left of join_timeout)",
        ),
        (
            view(participants=(P("a", "h", 1), P("b", "h", 2)), min_reached=95.0),
            "2 node(s) joined (min 2, max 4): last call, the round completes in 25s "
            "(at once if 4 join)",
        ),
        # the last call never outlasts the join deadline
        (
            view(participants=(P("a", "h", 1), P("b", "h", 2)), min_reached=95.0, deadline=110),
            "2 node(s) joined (min 2, max 4): last call, the round completes in 10s "
            "(at once if 4 join)",
        ),
        (
            view(prev_round_live=2),
            "1 node(s) joined; waiting for 2 member(s) of the previous round to leave it "
            "(600s left of join_timeout)",
        ),
        # a whole group at max_nodes: the waiting nodes are spares
        (
            view(prev_round_live=4),
            "1 spare node(s) wait: the previous round runs with 4 live member(s), "
            "max_nodes=4; a spare takes the place of a member that leaves or dies "
            "(600s left of join_timeout)",
        ),
        (
            static(0, 2),
            "static ranks: 2 of 4 present, missing 1, 3 (600s left of join_timeout)",
        ),
        (
            static(0, 0, 1, 2, 3),
            "static ranks: 4 of 4 present; claimed twice: 0 (600s left of join_timeout)",
        ),
    ],
)
def test_the_coordinator_says_what_it_waits_for(v: D.JoinView, text: str) -> None:
    assert told(v).text == text


def test_a_wait_told_again_later_counts_down_to_zero() -> None:
    # The progress thread tells the same wait again as the clock moves on.
    later = waiting.coordinator(replace(view(), now=800.0), D.decide(view()))
    assert later.text == (
        "1 of 2 node(s) joined (min 2, max 4); waiting for more (0s left of join_timeout)"
    )


def test_many_missing_ranks_are_cut_short() -> None:
    text = told(static(0, max_nodes=100)).text
    assert "missing 1, 2, 3, 4, 5, 6, 7, 8 and 91 more" in text


def test_counts_change_with_the_picture_not_with_the_clock() -> None:
    two = view(participants=(P("a", "h", 1), P("b", "h", 2)))
    assert told(view()).counts == told(view(now=500.0)).counts
    assert told(view()).counts != told(two).counts
    later = replace(two, min_reached=99.0)
    assert told(two).counts != told(later).counts
    assert told(view()).counts != told(view(prev_round_live=1)).counts
    assert told(static(0)).counts != told(static(0, 1)).counts


def test_a_follower_names_its_coordinator_escaped() -> None:
    got = waiting.follower("evil\nfake line", 100.0, 160.4)
    assert got.text == (
        "waiting for coordinator 'evil\\nfake line' to complete the round "
        "(60s left of join_timeout)"
    )
    assert "\n" not in got.text
    assert waiting.follower(None, 0.0, 1.0).text.startswith("waiting for the round's coordinator")
    assert got.counts == waiting.follower("evil\nfake line", 150.0, 160.4).counts
    assert got.counts != waiting.follower("other", 100.0, 160.4).counts


def test_the_closed_message_names_the_delete_command() -> None:
    assert closed_message("job 1", "/etcd_rdzv", "v3") == (
        "The rendezvous of run 'job 1' is closed. To start the job again, use a new run id "
        "(torchrun: --rdzv-id), or delete the closed run first: etcd-rdzv delete --run-id "
        "'job 1' (with the job's etcd options)."
    )
    assert "delete --run-id j --key-prefix /jobs --api v2 (" in closed_message("j", "/jobs", "v2")


@pytest.mark.parametrize(
    ("argv", "wanted"),
    [
        (["join", "--run-id", "x", "--export"], True),
        (["join", "--exp"], True),
        (["join", "--ex"], True),
        (["join", "--e"], False),  # ambiguous for argparse: --endpoint too
        (["join", "--run-id", "x"], False),
        (["join", "--", "--export"], False),
    ],
)
def test_which_command_lines_ask_for_export(argv: list[str], wanted: bool) -> None:
    assert _wants_export(argv) is wanted


def test_a_re_forming_group_says_how_long_it_still_waits() -> None:
    back = (D.Participant("a", "h", 10, prev_rank=0), D.Participant("s", "h", 5))
    v = join_view(
        *back,
        prev_round_live=1,
        regroup_since=99.0,
        rejoin_grace=2.0,
        prev_members=frozenset({"a", "b"}),
    )
    got = told(v)
    assert got.text == (
        "2 node(s) here, the group re-forming; waiting 1s more (rejoin_grace) for 1 "
        "member(s) of the previous round, then completing without them"
    )
    assert got.counts == ("regroup", 2, 1)


# -- the reason of a wait: one rule says Wait and picks the words -------------------------

TWO = (P("a", "h", 1), P("b", "h", 2))
BACK = (P("a", "h", 10, prev_rank=0), P("s", "h", 5))  # a re-joined, s a spare
REFORMING = {"prev_members": frozenset({"a", "b"}), "rejoin_grace": 2.0}

#: Views a coordinator waits at, with the reason decide() gives; with the waits of the
#: re-forming table (test_decisions_regroup), every reason a coordinator can give.
WAITS = [
    ("below min", view(), D.Why.JOINED),
    ("min never seen", view(*TWO), D.Why.JOINED),
    ("last call", view(*TWO, min_reached=95.0), D.Why.LAST_CALL),
    ("last call cut by the deadline", view(*TWO, min_reached=95.0, deadline=110), D.Why.LAST_CALL),
    ("beside a running group", view(prev_round_live=2), D.Why.PREVIOUS),
    ("spares", view(prev_round_live=4), D.Why.PREVIOUS),
    (
        "re-forming",
        view(*BACK, prev_round_live=1, regroup_since=99.0, **REFORMING),
        D.Why.REGROUP,
    ),
    (
        "re-forming, grace over, below min",
        view(*BACK[:1], prev_round_live=1, regroup_since=90.0, **REFORMING),
        D.Why.JOINED,
    ),
    ("static ranks missing", static(0, 2), D.Why.RANKS),
    ("static rank twice", static(0, 0, 1, 2, 3, node_ttl=5.0), D.Why.CONFLICT),
    ("static beside a running group", static(0, 1, 2, 3, prev_round_live=1), D.Why.PREVIOUS),
    ("static rank twice beside a group", static(0, 0, 1, prev_round_live=1), D.Why.CONFLICT),
] + [
    (f"re-forming table: {name}", v, expected.why)
    for name, v, expected in REGROUP_CASES
    if isinstance(expected, D.Wait)
]

#: What the words of each reason say.
WORDS = {
    D.Why.JOINED: "waiting for more",
    D.Why.LAST_CALL: ": last call, the round completes in",
    D.Why.PREVIOUS: "the previous round",
    D.Why.REGROUP: "the group re-forming; waiting",
    D.Why.RANKS: "static ranks:",
    D.Why.CONFLICT: "; claimed twice:",
}


@pytest.mark.parametrize(("name", "v", "why"), WAITS, ids=[w[0] for w in WAITS])
def test_the_words_follow_the_reason_decide_gives(name: str, v: D.JoinView, why: D.Why) -> None:
    action = D.decide(v)
    assert isinstance(action, D.Wait) and action.why is why, action
    got = told(v)
    assert got.counts[0] == why.value
    assert WORDS[why] in got.text, got.text
    # The reason and the action are one rule: a count-down ends at ``until`` (then the
    # round completes, fails, or waits for something else); the rest wait for etcd.
    now_on = replace(v, now=action.until, conflict_since=v.now)
    if why in (D.Why.LAST_CALL, D.Why.REGROUP, D.Why.CONFLICT):
        if action.until < v.deadline:
            after = D.decide(now_on)
            assert not (isinstance(after, D.Wait) and after.why is why), after
    else:
        assert action.until == v.deadline


def test_the_table_covers_every_reason() -> None:
    # A new reason in decide() needs its words, and a row here (a follower's: see
    # waiting.follower).
    assert {why for _, _, why in WAITS} == set(D.Why) - {D.Why.COORDINATOR, D.Why.SUCCESSION}
    assert set(WORDS) == set(D.Why) - {D.Why.COORDINATOR, D.Why.SUCCESSION}
    follows = D.follow(
        D.FollowView(me="a", closed=False, result=None, coordinated=True, now=1.0, deadline=9.0)
    )
    assert follows == D.Wait(9.0, D.Why.COORDINATOR)
    with pytest.raises(ValueError, match="does not wait for"):
        waiting.coordinator(view(), follows)  # a follower's reason has no coordinator words


# -- the log's schedule and the events' words ----------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _stopped(clock: _Clock, **kw: Any) -> tuple[progress.Progress, list[str], list[str]]:
    """A Progress whose thread is stopped: the test ticks it on its own clock."""
    reports: list[str] = []
    told: list[str] = []
    p = progress.Progress(
        reports.append, "t", lambda text, waited: told.append(f"{waited:.0f} {text}"), **kw
    )
    p.stop()
    p._thread.join(5.0)
    return p, reports, told


def test_the_log_hears_a_wait_after_ten_seconds_then_every_thirty(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    p, reports, told = _stopped(clock)
    p.waiting(("joined", 1), lambda now: f"1 of 2 at {now - 1000:.0f}")
    for second in range(1, 101):
        clock.now = 1000.0 + second
        p._tick()
    assert told == ["10 1 of 2 at 10", "40 1 of 2 at 40", "70 1 of 2 at 70", "100 1 of 2 at 100"]
    # The listeners still hear every PERIOD seconds.
    assert len(reports) == 100 // int(progress.PERIOD)


def test_a_join_that_does_not_wait_tells_the_log_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    p, reports, told = _stopped(clock)
    p.busy()
    for second in range(1, 40):
        clock.now = 1000.0 + second
        p._tick()
    assert (reports, told) == ([], [])


def test_a_follower_of_a_later_round_says_it_waits_beside_the_running_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    fresh, _, told = _stopped(clock)
    fresh.following(3, "c", 1600.0)
    clock.now += progress.FIRST
    fresh._tick()
    assert told == [
        "10 round 3: waiting for coordinator 'c' to complete the round (590s left of "
        "join_timeout); this node was not in round 2: it waits beside that round's group, "
        "as a spare or to enlarge it"
    ]
    member, _, told = _stopped(clock, last_round=2)  # a member of round 2 re-joins
    member.following(3, "c", 1600.0)
    clock.now += progress.FIRST
    member._tick()
    assert told == [
        "10 round 3: waiting for coordinator 'c' to complete the round (580s left of join_timeout)"
    ]


def test_a_round_formed_names_the_members_not_back() -> None:
    before = (4, ("a", "b", "c"), ("10.0.0.1", "10.0.0.2", "10.0.0.3"), ("h1", "h2", ""))
    now = (("a", "c", "d"), ("10.0.0.1", "10.0.0.3", "10.0.0.4"), ("h1", "", "h4"))
    assert formed(5, 1, 3, 2.345, now, before) == (
        "round 5 formed: world size 3, this node is rank 1 (2.3s); not back from round 4: "
        "'b' (host 'h2', address '10.0.0.2'): gone, or slower to re-join than rejoin_grace; "
        "1 node(s) new since round 4"
    )
    # A host unknown (a result of an older version): the address alone.
    nameless = (4, before[1], before[2], ("", "", ""))
    assert "'b' (address '10.0.0.2'): gone" in formed(5, 1, 3, 1.0, now, nameless)
    # The first round, or a large one (its list is not known here): the counts alone.
    assert formed(1, 0, 2, 0.04, now, None) == (
        "round 1 formed: world size 2, this node is rank 0 (0.0s)"
    )
    assert formed(5, 0, 300, 1.0, None, before).endswith("rank 0 (1.0s)")
    many = (1, tuple(f"n{i}" for i in range(12)), (), ())
    text = formed(2, 0, 1, 1.0, (("n0",), ("x",), ("",)), many)
    assert "'n1', 'n2', 'n3', 'n4', 'n5', 'n6', 'n7', 'n8' and 3 more" in text
    assert "\n" not in formed(
        2, 0, 1, 1.0, (("a",), ("x",), ("",)), (1, ("a", "b\nX"), ("", ""), ("", ""))
    )
