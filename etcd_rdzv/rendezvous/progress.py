"""Progress of a waiting join: what it waits for, told to the handler's listeners and
logged.

The join's loops tell a :class:`Progress` the latest picture (no I/O); its own daemon
thread reports, so a slow listener never holds up the join, and a report costs no
etcd request. It holds neither the handler nor the join.

Two schedules: the listeners hear (and this module's logger shows at DEBUG) every
change of the picture and a line every ``PERIOD`` seconds; the events logger
(:data:`.listener.EVENTS`, INFO) gets a line once the join has waited ``FIRST``
seconds, then every ``EVERY`` seconds, so that an agent waiting at a default log
level says what for without filling its log.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable

from . import decisions as D
from . import waiting
from .listener import Listener, events

__all__ = ["EVERY", "FIRST", "Progress"]

log = logging.getLogger(__name__)

PERIOD = 5.0  # seconds between reports of what a waiting join waits for ...
GAP = 1.0  # ... and at least this between two when the picture changes
FIRST = 10.0  # seconds a join waits before its first event line ...
EVERY = 30.0  # ... and between two event lines after it


def _report(run_id: str, node_id: str, listener: Listener, text: str) -> None:
    log.debug("run %s: node %s: %s", run_id, node_id, text)
    listener.on_progress(text)


def _tell(run_id: str, node_id: str, text: str, waited: float) -> None:
    events.info("run %s: node %s has waited %.0fs: %s", run_id, node_id, waited, text)


class Progress:
    """Reports what a join waits for: when the picture changes (at most once per
    ``GAP`` seconds, and not in the join's first such gap, so a round that completes
    at once says nothing) and every ``PERIOD`` seconds."""

    def __init__(
        self,
        report: Callable[[str], None],
        name: str,
        tell: Callable[[str, float], None] | None = None,
        last_round: int = 0,
    ) -> None:
        self._report = report
        self._tell = tell
        # The last round this node was a member of: a follower of a later round than
        # the next says it waits beside a running group.
        self._last_round = last_round
        self._started = time.monotonic()
        self._told_at: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._what: tuple[tuple[object, ...], Callable[[float], str]] | None = None
        self._shown: tuple[object, ...] | None = None
        self._shown_at = time.monotonic()
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-rdzv-progress:{name}", daemon=True
        )
        self._thread.start()

    @classmethod
    def start(cls, run_id: str, node_id: str, listener: Listener, last_round: int = 0) -> Progress:
        """A reporter to the log and ``listener`` (not a method of the handler: the
        thread holds no reference to it); ``last_round``: the last round the node was a
        member of (0: none)."""
        return cls(
            functools.partial(_report, run_id, node_id, listener),
            run_id,
            functools.partial(_tell, run_id, node_id),
            last_round,
        )

    @staticmethod
    def logged() -> bool:
        """Whether a join's progress shows in the log (the events logger at INFO, or
        this module's at DEBUG): else a join nobody listens to starts no thread."""
        return events.isEnabledFor(logging.INFO) or log.isEnabledFor(logging.DEBUG)

    def waiting(self, counts: tuple[object, ...], describe: Callable[[float], str]) -> None:
        """The join waits: ``describe(now)`` says for what; ``counts`` change when
        the picture does."""
        with self._lock:
            self._what = (counts, describe)

    def coordinating(self, round_no: int, view: D.JoinView, wait: D.Wait) -> None:
        """The join coordinates ``round_no`` and waits, as ``view`` shows and
        :func:`~.decisions.decide` said (``wait``, with its reason)."""
        counts = waiting.coordinator(view, wait).counts

        def describe(now: float) -> str:
            text = waiting.coordinator(dataclasses.replace(view, now=now), wait).text
            return f"round {round_no}: {text}"

        self.waiting((round_no, *counts), describe)

    def following(self, round_no: int, leader: str | None, deadline: float) -> None:
        """The join follows ``leader`` (the coordinator of ``round_no``, if known)."""
        counts = waiting.follower(leader, 0.0, deadline).counts

        beside = round_no - 1 if round_no > 1 and self._last_round != round_no - 1 else None

        def describe(now: float) -> str:
            text = f"round {round_no}: {waiting.follower(leader, now, deadline).text}"
            if beside is not None:
                text += (
                    f"; this node was not in round {beside}: it waits beside that "
                    "round's group, as a spare or to enlarge it"
                )
            return text

        self.waiting((round_no, *counts), describe)

    def busy(self) -> None:
        """The join does not wait (it reads or writes etcd): nothing to report."""
        with self._lock:
            self._what = None

    def _tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self._what is None:
                return
            counts, describe = self._what
            since = now - self._shown_at
            report = since >= PERIOD or (counts != self._shown and since >= GAP)
            if report:
                self._shown, self._shown_at = counts, now
            told = self._told_at
            tell = self._tell is not None and (
                now - self._started >= FIRST if told is None else now - told >= EVERY
            )
            if tell:
                self._told_at = now
        if not (report or tell):
            return
        try:
            text = describe(now)
            if report:
                self._report(text)
            if tell and self._tell is not None:
                self._tell(text, now - self._started)
        except Exception:  # never end the thread: the next tick tries again
            log.warning("reporting the progress of a join failed", exc_info=True)

    def _run(self) -> None:
        while not self._stop.wait(GAP):
            self._tick()

    def stop(self) -> None:
        self._stop.set()
