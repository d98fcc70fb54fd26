"""When a coordinator that reads the run's changes one long poll at a time (v2) lists
the run instead: after a backlog of changes etcd already held, not after each change
that etcd's index ran ahead of (v2 heartbeats move the index without a change), and
not more often than its listings' own time allows (see ``coordinator._CatchUp``)."""

from __future__ import annotations

from etcd_rdzv._kv import Event, Record
from etcd_rdzv.rendezvous.coordinator import _CATCH_UP, _LIST_PACE, _CatchUp


def _change(revision: int, current: int) -> list[Event]:
    """The answer to one long poll: a join key written at ``revision``, etcd at
    ``current`` when the poll reached it."""
    return [Event("put", Record(f"/run/r1/nodes/n{revision}", "{}", revision), current)]


def test_a_held_change_that_etcd_index_ran_far_ahead_of_is_no_backlog() -> None:
    catch_up = _CatchUp()
    catch_up.listed(0.0, 0.1)
    # Changes that came after their poll reached etcd (it waited for them).
    for i in range(1, 21):
        assert not catch_up.behind(_change(1_000 * i + 1_001, 1_000 * i), 10.0)
    # A change that was waiting, with a thousand heartbeats' refreshes after it by the
    # time the poll came: before, that distance made the coordinator list the whole
    # run (and at 4,096 nodes every change was waiting). Now one is no backlog.
    assert not catch_up.behind(_change(30_000, 31_000), 10.0)
    assert not catch_up.behind(_change(32_000, 31_500), 10.0)
    assert catch_up.backlog == 0


def test_held_changes_in_a_row_make_a_backlog() -> None:
    catch_up = _CatchUp()
    catch_up.listed(0.0, 0.1)
    verdicts = [catch_up.behind(_change(100 + i, 500), 10.0) for i in range(_CATCH_UP + 1)]
    assert verdicts == [False] * _CATCH_UP + [True]
    catch_up.listed(10.0, 10.1)  # the listing read them all
    assert catch_up.backlog == 0
    assert not catch_up.behind(_change(501, 900), 11.0)


def test_listings_are_paced_by_their_own_time() -> None:
    catch_up = _CatchUp()
    catch_up.listed(10.0, 11.0)  # a listing of a loaded etcd took a second
    held = [catch_up.behind(_change(100 + i, 500), 11.5) for i in range(10)]
    assert not any(held)  # backlog, but too soon after a listing that long
    assert catch_up.backlog == 10
    assert catch_up.behind(_change(200, 500), 11.0 + _LIST_PACE * 1.0)


def test_an_answer_without_etcd_index_lists_at_once() -> None:
    catch_up = _CatchUp()
    catch_up.listed(0.0, 0.1)
    assert catch_up.behind(_change(5, 0), 10.0)
