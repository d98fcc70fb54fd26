"""Requests stuck behind a dead leader: found, and given up, within seconds.

A member forwards a proposal (a write, a lease grant or keep-alive) to its leader. If
that leader dies with the proposal, the member answers only at etcd's own request
timeout (5 s plus two election timeouts: 7 s by default), long after a new leader was
elected. Every answer's header carries the cluster's raft term, and an election
raises it; so a request that has waited :data:`STALL_CHECK` seconds asks its member
for the term (``/v3/maintenance/status``, which the member answers by itself, without
its leader). When the term went up since the request was sent and the member has a
leader again, the request is given up (:class:`Stalled`) and the failover loop sends
it again: a read or a plain write as it is, a conditional write through its read-back
(it may have landed). A request that merely waits (a loaded etcd) costs at most one
status request per client per :data:`STALL_CHECK`.
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

__all__ = ["STALL_CHECK", "Stalled", "Terms"]

log = logging.getLogger(__name__)

#: Seconds a request waits for its answer before (and between) asking whether the
#: leader changed meanwhile.
STALL_CHECK = 1.0


class Stalled(OSError):
    """The cluster elected a new leader while a request waited for its answer: the
    request went to the old one and will be answered only at etcd's request timeout.
    The failover loop treats it as a transient error (send again)."""


def _term_of(value: object) -> int:
    """A raft term or member id as etcd sends it (decimal text or a number); 0 if it
    is neither."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20:
        return int(value)
    return 0


class Terms:
    """The highest raft term this client's answers carried, and the check that gives
    up on a request whose member has seen an election since it was sent."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self.term = 0  # 0: none seen yet (no check: nothing to compare with)
        self._lock = threading.Lock()
        self._asked_at = -math.inf  # when a status answer last came
        self._asked: tuple[int, int] = (0, 0)  # its (term, leader)

    def seen(self, header: object) -> None:
        """Note the term in an answer's ``header`` (checked already)."""
        if isinstance(header, dict):
            term = _term_of(header.get("raft_term"))
            self.term = max(self.term, term)

    def checker(self, url: str, headers: dict[str, str], what: str) -> Callable[[], None] | None:
        """The check for a request of ``what`` to ``url`` sent now (``None`` before any
        term is known)."""
        sent = self.term
        if not sent:
            return None

        def check() -> None:
            term, leader = self._status(url, headers)
            if term > sent and leader:
                raise Stalled(
                    f"the etcd cluster elected a new leader (raft term {sent} -> {term}) "
                    f"while {what} waited for its answer; sending it again"
                )

        return check

    def _status(self, url: str, headers: dict[str, str]) -> tuple[int, int]:
        """The member's (raft term, leader id), at most one request per
        :data:`STALL_CHECK` for all of this client's waiting requests; (0, 0) when the
        member does not answer in time (no verdict: the request goes on waiting)."""
        with self._lock:
            if time.monotonic() - self._asked_at < STALL_CHECK:
                return self._asked
            try:
                _resp, data = self._transport.request(
                    url, "/v3/maintenance/status", b"{}", headers, STALL_CHECK / 2
                )
                obj = loads(data or b"", url)
                # Only the header and the leader are read (a status answer's other
                # fields are not a key-value answer's).
                header = obj.get("header") if isinstance(obj, dict) else None
                if not isinstance(header, dict):
                    return (0, 0)
                checked(header, url)
            except Exception as exc:  # no answer is no verdict
                log.debug("status of %s for a waiting request: %s", url, exc)
                return (0, 0)
            term = _term_of(header.get("raft_term"))
            self._asked_at = time.monotonic()
            self._asked = (term, _term_of(obj.get("leader")))
            self.seen(header)
            return self._asked
