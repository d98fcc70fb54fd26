"""What a waiting join waits for, in words: pure functions of what the node sees and
of the :class:`~.decisions.Wait` it was told.

:mod:`.progress` reports these texts (to the log and the listeners); :mod:`.decisions`
decides, and says why it waits (:class:`~.decisions.Why`): the words follow that
reason and never re-derive a rule of their own. Nothing here does I/O or reads a
clock (``tests/unit/test_progress.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from . import decisions as D

__all__ = ["Progress", "coordinator", "follower"]


@dataclass(frozen=True)
class Progress:
    """What a waiting node reports: ``text`` says what it waits for, as of the view's
    ``now``; ``counts`` change exactly when the picture does (a report is due then,
    not when only a count-down moved)."""

    counts: tuple[object, ...]
    text: str


def _left(view_now: float, until: float) -> str:
    return f"{max(until - view_now, 0.0):.0f}s"


def _few(numbers: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(n) for n in numbers[:limit])
    return shown + (f" and {len(numbers) - limit} more" if len(numbers) > limit else "")


def coordinator(view: D.JoinView, wait: D.Wait) -> Progress:
    """What the coordinator of a forming round waits for, as :func:`decide` said
    ``wait`` for ``view`` (its reason picks the words, its ``until`` the count-down):
    nodes joined of min/max, the last call's count-down, the previous group (spares
    wait for a member to go), the re-forming group's grace, or the static ranks still
    missing or claimed twice. The text may be told again later: ``view.now`` moves,
    nothing else does."""
    count = len(view.participants)
    left = f"{_left(view.now, view.deadline)} left of join_timeout"
    why = wait.why
    if why is D.Why.REGROUP:
        text = (
            f"{count} node(s) here, the group re-forming; waiting {_left(view.now, wait.until)} "
            f"more (rejoin_grace) for {view.prev_round_live} member(s) of the previous "
            "round, then completing without them"
        )
        return Progress((why.value, count, view.prev_round_live), text)
    if why is D.Why.PREVIOUS:
        if not D.nodes_waiting(view.prev_round_live, view.max_nodes, count, 0, view.node_unit):
            # nodes_waiting() says whether these nodes could enlarge the group by a
            # whole unit (up to max_nodes): if not, they are spares.
            unit = f", node_unit={view.node_unit}" if view.node_unit > 1 else ""
            text = (
                f"{count} spare node(s) wait: the previous round runs with "
                f"{view.prev_round_live} live member(s), max_nodes={view.max_nodes}{unit}; a "
                f"spare takes the place of a member that leaves or dies ({left})"
            )
        else:
            text = (
                f"{count} node(s) joined; waiting for {view.prev_round_live} member(s) "
                f"of the previous round to leave it ({left})"
            )
        return Progress((why.value, count, view.prev_round_live), text)
    if why is D.Why.RANKS or why is D.Why.CONFLICT:
        ranks = sorted({p.rank for p in view.participants if p.rank is not None})
        missing = [r for r in range(view.max_nodes) if r not in ranks]
        twice = sorted(D.rank_conflicts(view.participants, view.prev))
        text = f"static ranks: {len(ranks)} of {view.max_nodes} present"
        if missing:
            text += f", missing {_few(missing)}"
        if twice:
            text += f"; claimed twice: {_few(twice)}"
        return Progress((why.value, tuple(ranks), tuple(twice), count), f"{text} ({left})")
    bounds = f"min {view.min_nodes}, max {view.max_nodes}"
    low, high = view.min_nodes, view.max_nodes
    if view.node_unit > 1:
        bounds += f", in units of {view.node_unit}"
        low, high = D.unit_bounds(view.min_nodes, view.max_nodes, view.node_unit)
    if why is D.Why.LAST_CALL:
        text = (
            f"{count} node(s) joined ({bounds}): last call, the round completes in "
            f"{_left(view.now, wait.until)} (at once if {high} join)"
        )
        return Progress((why.value, count), text)
    if why is D.Why.JOINED:
        text = f"{count} of {low} node(s) joined ({bounds}); waiting for more ({left})"
        return Progress((why.value, count), text)
    raise ValueError(f"a coordinator does not wait for {why}")


def follower(coordinator: str | None, now: float, deadline: float) -> Progress:
    """What a follower waits for: only the coordinator knows the counts."""
    who = "the round's coordinator" if coordinator is None else f"coordinator {coordinator!r}"
    return Progress(
        ("follower", coordinator),
        f"waiting for {who} to complete the round ({_left(now, deadline)} left of join_timeout)",
    )
