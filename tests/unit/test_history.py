"""The history checker finds each broken invariant, and nothing in a good history."""

from __future__ import annotations

import pytest

from etcd_rdzv.testing.history import GaveUp, History, HistoryError, Joined, check, violations


def _good() -> list[Joined | GaveUp]:
    members = ("a", "b", "c")
    return [Joined(n, 1, r, 3, members) for r, n in enumerate(members)] + [
        Joined("a", 2, 0, 2, ("a", "b")),
        Joined("b", 2, 1, 2, ("a", "b")),
        GaveUp("c", "RendezvousTimeoutError: round 2 did not complete", 2),
    ]


def test_a_good_history_passes() -> None:
    assert violations(_good(), complete=True) == []
    check(_good(), rounds={2: ("a", "b")}, complete=True)


@pytest.mark.parametrize(
    ("extra", "rounds", "says"),
    [
        ([Joined("d", 2, 1, 2)], None, "a rank reported twice"),
        ([Joined("d", 2, 2, 3)], None, "world sizes"),
        ([Joined("d", 2, 5, 2)], None, "outside"),
        ([Joined("a", 1, 0, 3)], None, "do not only go up"),
        ([Joined("d", 2, 1, 2, ("a", "d"))], None, "different member lists"),
        ([], {2: ("a", "c")}, "different member lists"),
        # c gave up on round 2, and etcd lists it: the race this checker exists for
        ([], {3: ("c",)}, "gave up"),
        ([], {3: ("z",)}, "never returned that round"),
    ],
)
def test_each_broken_invariant_is_named(
    extra: list[Joined | GaveUp], rounds: dict[int, tuple[str, ...]] | None, says: str
) -> None:
    found = violations(_good() + extra, rounds=rounds, complete=True)
    assert any(says in v for v in found), found
    with pytest.raises(HistoryError, match="violation"):
        check(_good() + extra, rounds=rounds, complete=True)


def test_an_incomplete_history_holds_only_the_nodes_that_gave_up() -> None:
    partial = [Joined("a", 1, 0, 2), GaveUp("c", "timeout")]
    assert violations(partial, rounds={1: ("a", "b")}) == []  # b did not report: not complete
    assert "never returned" in violations(partial, rounds={1: ("a", "b")}, complete=True)[-1]
    assert "gave up" in violations(partial, rounds={1: ("a", "c")})[0]
    assert violations(partial, rounds={1: ("a", "c")}, killed=["c"]) == []


def test_the_recorder_keeps_every_outcome() -> None:
    history = History()
    history.joined("a", 1, 0, 1, ["a"])
    history.gave_up("b", TimeoutError("late"), 1)
    assert history.entries == [Joined("a", 1, 0, 1, ("a",)), GaveUp("b", "TimeoutError: late", 1)]
