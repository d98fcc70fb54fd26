"""The one factory of :class:`~etcd_rdzv.rendezvous.decisions.JoinView` for the
decision tests: a coordinator's view with plain data, every field given a value that
decides nothing by itself, changed by keyword."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from etcd_rdzv.rendezvous import decisions as D
from etcd_rdzv.rendezvous import waiting

P = D.Participant

#: Node "a" coordinates round 1 alone, at local time 100, with 600 s of join_timeout
#: left; min 2, max 4 nodes, a 30 s last call that has not started.
BASE = D.JoinView(
    me="a",
    closed=False,
    result=None,
    participants=(P("a", "h", 1),),
    prev_round_live=0,
    min_nodes=2,
    max_nodes=4,
    now=100.0,
    min_reached=None,
    last_call_timeout=30.0,
    deadline=700.0,
)


def join_view(*participants: D.Participant, **changes: Any) -> D.JoinView:
    """:data:`BASE` with ``changes``; ``participants``, when given, replace its one."""
    if participants:
        changes["participants"] = participants
    return replace(BASE, **changes)


def told(view: D.JoinView) -> waiting.Progress:
    """What the coordinator seeing ``view`` says it waits for: the words of the
    :class:`~etcd_rdzv.rendezvous.decisions.Wait` that :func:`decide` gives (a view
    for which it does not wait fails the test)."""
    action = D.decide(view)
    assert isinstance(action, D.Wait), action
    return waiting.coordinator(view, action)
