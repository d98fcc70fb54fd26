"""Progress of a waiting join: what it waits for, logged at INFO and told to the
handler's listeners.

The join's loops tell a :class:`Progress` the latest picture (no I/O); its own daemon
thread reports, so a slow listener never holds up the join, and a report costs no
etcd request. It holds neither the handler nor the join.
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
from .listener import Listener

__all__ = ["Progress"]

log = logging.getLogger(__name__)

PERIOD = 5.0  # seconds between reports of what a waiting join waits for ...
GAP = 1.0  # ... and at least this between two when the picture changes


def _report(run_id: str, node_id: str, listener: Listener, text: str) -> None:
    log.info("run %s: node %s: %s", run_id, node_id, text)
    listener.on_progress(text)


class Progress:
    """Reports what a join waits for: when the picture changes (at most once per
    ``GAP`` seconds, and not in the join's first such gap, so a round that completes
    at once says nothing) and every ``PERIOD`` seconds."""

    def __init__(self, report: Callable[[str], None], name: str) -> None:
        self._report = report
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
    def start(cls, run_id: str, node_id: str, listener: Listener) -> Progress:
        """A reporter to the log and ``listener`` (not a method of the handler: the
        thread holds no reference to it)."""
        return cls(functools.partial(_report, run_id, node_id, listener), run_id)

    def waiting(self, counts: tuple[object, ...], describe: Callable[[float], str]) -> None:
        """The join waits: ``describe(now)`` says for what; ``counts`` change when
        the picture does."""
        with self._lock:
            self._what = (counts, describe)

    def coordinating(self, round_no: int, view: D.JoinView) -> None:
        """The join coordinates ``round_no`` and waits, as ``view`` shows."""
        counts = waiting.coordinator(view).counts

        def describe(now: float) -> str:
            text = waiting.coordinator(dataclasses.replace(view, now=now)).text
            return f"round {round_no}: {text}"

        self.waiting((round_no, *counts), describe)

    def following(self, round_no: int, leader: str | None, deadline: float) -> None:
        """The join follows ``leader`` (the coordinator of ``round_no``, if known)."""
        counts = waiting.follower(leader, 0.0, deadline).counts

        def describe(now: float) -> str:
            return f"round {round_no}: {waiting.follower(leader, now, deadline).text}"

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
            if since < PERIOD and (counts == self._shown or since < GAP):
                return
            self._shown, self._shown_at = counts, now
        try:
            self._report(describe(now))
        except Exception:  # never end the thread: the next tick tries again
            log.warning("reporting the progress of a join failed", exc_info=True)

    def _run(self) -> None:
        while not self._stop.wait(GAP):
            self._tick()

    def stop(self) -> None:
        self._stop.set()
