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

from ._views import join_view

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
        (
            view(now=800.0),
            "1 of 2 node(s) joined (min 2, max 4); waiting for more (0s left of join_timeout)",
        ),
    ],
)
def test_the_coordinator_says_what_it_waits_for(v: D.JoinView, text: str) -> None:
    assert waiting.coordinator(v).text == text


def test_many_missing_ranks_are_cut_short() -> None:
    text = waiting.coordinator(static(0, max_nodes=100)).text
    assert "missing 1, 2, 3, 4, 5, 6, 7, 8 and 91 more" in text


def test_counts_change_with_the_picture_not_with_the_clock() -> None:
    two = view(participants=(P("a", "h", 1), P("b", "h", 2)))
    assert waiting.coordinator(view()).counts == waiting.coordinator(view(now=500.0)).counts
    assert waiting.coordinator(view()).counts != waiting.coordinator(two).counts
    later = replace(two, min_reached=99.0)
    assert waiting.coordinator(two).counts != waiting.coordinator(later).counts
    assert waiting.coordinator(view()).counts != waiting.coordinator(view(prev_round_live=1)).counts
    assert waiting.coordinator(static(0)).counts != waiting.coordinator(static(0, 1)).counts


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
    got = waiting.coordinator(v)
    assert got.text == (
        "2 node(s) here, the group re-forming; waiting 1s more (rejoin_grace) for 1 "
        "member(s) of the previous round, then completing without them"
    )
    assert got.counts == ("regroup", 2, 1)


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
