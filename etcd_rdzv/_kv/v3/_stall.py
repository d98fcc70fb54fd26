"""Requests stuck behind a dead leader: found, and given up, within seconds.

A member forwards a proposal (a write, a lease grant) to its leader. If that leader
dies with the proposal, the member answers only at etcd's own request timeout (5 s
plus two election timeouts: 7 s by default), long after a new leader was elected.
Every answer's header carries the cluster's raft term, and an election raises it. So
a request that waits looks, every :data:`LOOK` seconds, at the highest term this
client's other answers brought since it was sent (its watch's messages, its
heartbeats': free); once the term went up, the request is given up
(:class:`Stalled`) and the failover loop sends it again: a read or a plain write as
it is, a conditional write through its read-back (it may have landed).

A client with no other answer coming asks its member for the term
(``/v3/maintenance/status``, answered without the leader) once a request has waited
:meth:`Terms.patience`: :data:`ASK` seconds, or four times as long as this client's
answers take on average, whichever is longer, and at most once per patience for all
of the client's requests. A loaded etcd, whose answers all come late, is not asked
more the slower it gets (measured: asking after one second added three requests per
node to a 1,024-node cold start on a 3-member cluster, and made it slower).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from .._http import Transport
from .._json import loads
from ._shape import checked

__all__ = ["ASK", "LOOK", "Stalled", "Terms"]

log = logging.getLogger(__name__)

#: Seconds between two looks of a waiting request at the term of this client's answers.
LOOK = 0.25
#: Seconds a request waits, at least, before its client asks the member for the term.
ASK = 3.0
_SLOW = 4.0  # times this client's average answer: what waiting long means
_WEIGHT = 0.2  # of the newest answer in the moving average


class Stalled(OSError):
    """The cluster elected a new leader while a request waited for its answer: the
    request may have gone to the old one, and then would be answered only at etcd's
    request timeout. The failover loop treats it as a transient error (send again)."""


def _number(value: object) -> int:
    """A raft term or member id as etcd sends it (decimal text or a number); 0 if it
    is neither."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20:
        return int(value)
    return 0


class Terms:
    """The highest raft term this client's answers carried, and the check that gives
    up on a request sent before an election."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self.term = 0  # 0: none seen yet (no check: nothing to compare with)
        self._lock = threading.Lock()
        self._asked_at = -math.inf  # when the member was last asked for the term
        self._latency: float | None = None  # the moving average of answers, seconds

    def seen(self, header: object) -> None:
        """Note the term in an answer's ``header`` (checked already)."""
        if isinstance(header, dict):
            self.term = max(self.term, _number(header.get("raft_term")))

    def took(self, seconds: float) -> None:
        """Note how long a unary request took to be answered."""
        latency = self._latency
        self._latency = seconds if latency is None else latency + (seconds - latency) * _WEIGHT

    @property
    def patience(self) -> float:
        """Seconds a request waits before its client asks the member for the term."""
        return max(ASK, (self._latency or 0.0) * _SLOW)

    def checker(self, url: str, headers: dict[str, str], what: str) -> Callable[[], None] | None:
        """The check for a request of ``what`` to ``url`` sent now, to be called every
        :data:`LOOK` seconds while it waits (``None`` before any term is known)."""
        sent = self.term
        if not sent:
            return None
        began = time.monotonic()

        def check() -> None:
            term, source = self.term, "in this client's answers"
            if term <= sent and time.monotonic() - began >= self.patience:
                term, source = self._ask(url, headers), f"in the status of {url}"
            if term > sent:
                raise Stalled(
                    f"the etcd cluster elected a new leader (raft term {sent} -> {term}, "
                    f"seen {source}) while {what} waited for its answer; sending it again"
                )

        return check

    def _ask(self, url: str, headers: dict[str, str]) -> int:
        """The member's raft term if it has a leader, at most one request per
        :meth:`patience` for all of this client's waiting requests; else (not asked,
        no leader, no answer in time: no verdict) the term known."""
        if not self._lock.acquire(blocking=False):
            return self.term  # another request is asking
        try:
            patience = self.patience
            if time.monotonic() - self._asked_at < patience:
                return self.term
            self._asked_at = time.monotonic()
            try:
                _resp, data = self._transport.request(
                    url, "/v3/maintenance/status", b"{}", headers, patience / 2
                )
                obj = loads(data or b"", url)
                # Only the header and the leader are read (a status answer's other
                # fields are not a key-value answer's).
                header = obj.get("header") if isinstance(obj, dict) else None
                if not isinstance(header, dict):
                    return self.term
                checked(header, url)
            except Exception as exc:  # no answer is no verdict
                log.debug("status of %s for a waiting request: %s", url, exc)
                return self.term
            if _number(obj.get("leader")):
                self.seen(header)
            return self.term
        finally:
            self._lock.release()
