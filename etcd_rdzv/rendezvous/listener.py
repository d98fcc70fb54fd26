"""What a handler tells those who observe it: one listener interface.

A :class:`Listener` receives the handler's events (a state change of the node's
rendezvous, named after the public method it belongs to), the progress lines of a
waiting join, each write of the node's join key, and each completed round. The torch
flavour records torch's rendezvous events through it, the CLI prints progress through
it, and the test harness observes a node through it; nobody needs the handler's
private parts.

Listeners are called from the handler's threads (the joining thread, the progress
thread, the heart); they must return quickly. One that raises is logged and does not
disturb the rendezvous.

People read the same story in the log: the events a person running a job wants to see
(a round formed, a member gone, a join still waiting) go to the logger
:data:`EVENTS` (``etcd_rdzv.events``) at INFO. Like every logger of the package it
has no handler of its own; the ``torchrun`` entry points show it at INFO when nobody
configured logging (see :func:`etcd_rdzv._factory.show_logs_under_torchrun`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from .roster import Roster

__all__ = [
    "EVENTS",
    "HandlerEvent",
    "Listener",
    "Listeners",
    "RoundDone",
    "events",
    "few",
    "formed",
]

log = logging.getLogger(__name__)

#: The logger of the events a person follows a job by (INFO: a round formed, a member
#: gone, a join's progress; problems are WARNING on the modules' own loggers).
EVENTS = "etcd_rdzv.events"
events = logging.getLogger(EVENTS)

#: torch's ``NodeState`` names.
State = Literal["RUNNING", "SUCCEEDED", "FAILED"]


@dataclass(frozen=True)
class HandlerEvent:
    """A state change of a node's rendezvous.

    ``method`` is the public handler method it belongs to (``next_rendezvous``,
    ``set_closed``, ``is_closed``, ``shutdown``); ``rank`` is set on a completed round.
    """

    run_id: str
    node_id: str
    method: str
    message: str
    state: State = "RUNNING"
    rank: int | None = None


@dataclass(frozen=True)
class RoundDone:
    """A round this node completed as a member."""

    round: int
    rank: int
    world_size: int
    roster: Roster = field(repr=False)

    @property
    def members(self) -> tuple[str, ...]:
        """Node ids in rank order (a large round's are read from etcd when first
        asked: see :class:`~.roster.Roster`)."""
        return self.roster.members

    @property
    def addrs(self) -> tuple[str, ...]:
        """Their addresses, in rank order (as :attr:`members`)."""
        return self.roster.addrs


class Listener:
    """Observes one handler; every method does nothing unless overridden."""

    def on_event(self, event: HandlerEvent) -> None:
        """A state change (see :class:`HandlerEvent`)."""

    def on_progress(self, text: str) -> None:
        """What a waiting join waits for (every few seconds, and when it changes)."""

    def hears_progress(self) -> bool:
        """Whether :meth:`on_progress` does anything (a join that nobody hears and
        whose INFO lines are off starts no progress thread)."""
        return type(self).on_progress is not Listener.on_progress

    def on_key_written(self, round_no: int, key: str) -> None:
        """This node's join key of ``round_no`` was just written (each write)."""

    def on_round(self, done: RoundDone) -> None:
        """``next_rendezvous`` completed a round with this node as a member."""


class Listeners(Listener):
    """The listeners of one handler, called in the order they were added; one that
    raises is logged and the others still hear."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._all: tuple[Listener, ...] = ()

    def add(self, listener: Listener) -> None:
        with self._lock:
            self._all = (*self._all, listener)

    def remove(self, listener: Listener) -> None:
        with self._lock:
            self._all = tuple(one for one in self._all if one is not listener)

    def hears_progress(self) -> bool:
        return any(one.hears_progress() for one in self._all)

    def _each(self, name: str, *args: object) -> None:
        for one in self._all:
            try:
                getattr(one, name)(*args)
            except Exception:  # an observer never fails the rendezvous
                log.warning("a rendezvous listener failed in %s", name, exc_info=True)

    def on_event(self, event: HandlerEvent) -> None:
        log.debug(
            "run %s node %s [%s] %s: %s",
            event.run_id,
            event.node_id,
            event.state,
            event.method,
            event.message,
        )
        self._each("on_event", event)

    def on_progress(self, text: str) -> None:
        self._each("on_progress", text)

    def on_key_written(self, round_no: int, key: str) -> None:
        self._each("on_key_written", round_no, key)

    def on_round(self, done: RoundDone) -> None:
        self._each("on_round", done)


def few(items: Sequence[str], limit: int = 8) -> str:
    """``items`` joined by commas, the first ``limit`` of them and how many more."""
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _at(addr: str | None, host: str | None = None) -> str:
    where = ([f"host {host!r}"] if host else []) + ([f"address {addr!r}"] if addr else [])
    return f" ({', '.join(where)})" if where else ""


def formed(
    round_no: int,
    rank: int,
    world_size: int,
    took: float,
    now: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] | None,
    before: tuple[int, tuple[str, ...], tuple[str, ...], tuple[str, ...]] | None,
) -> str:
    """The event line of a round this node completed: its world size, this node's rank,
    how long the join took, and which members of the node's previous round
    (``before``: that round, its members, addresses and hosts, ``""`` where unknown)
    are not in it (``now``: its members, addresses and hosts; ``None`` when not known
    here, a large round's)."""
    text = (
        f"round {round_no} formed: world size {world_size}, this node is rank {rank} ({took:.1f}s)"
    )
    if before is None or now is None:
        return text
    prev_round, members, addrs, hosts = before
    here = set(now[0])
    where = dict(zip(members, addrs, strict=False))
    host_of = dict(zip(members, hosts, strict=False))
    gone = [f"{m!r}{_at(where.get(m), host_of.get(m))}" for m in members if m not in here]
    came = len(here - set(members))
    if gone:
        text += (
            f"; not back from round {prev_round}: {few(gone)}: gone, or slower to re-join "
            "than rejoin_grace"
        )
    if came:
        text += f"; {came} node(s) new since round {prev_round}"
    return text
