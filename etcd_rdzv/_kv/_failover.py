"""Endpoint rotation, back-off and lost-answer read-back: the one failover loop of
both APIs.

:class:`FailoverKV` sends one request to one endpoint at a time. What an API
supplies is how to send a request (a function of the endpoint index and a timeout)
and how to judge what went wrong (:meth:`FailoverKV._classify`):

* the request provably never left (refused, connect timeout, TLS): the next endpoint;
* it was sent but its answer was lost: the next endpoint, except that a write whose
  answer was lost may have been applied (:class:`Ambiguous`), which
  :meth:`FailoverKV._resolve` settles by reading the key back;
* etcd answered "not now" (leader election, raft timeout, overload): wait with
  back-off and send again, until ``read_timeout``;
* etcd asked for the request to be sent again at once (v3: an expired auth token);
* anything else is final: the API raises its own error.

Deadlines are ``time.monotonic()`` instants. Inside :meth:`KV.bounded
<etcd_rdzv._kv.KV.bounded>` every request, pause and failover ends by the scope's
deadline too; a call cut short by it raises a
:class:`~etcd_rdzv.errors.RendezvousConnectionError` that says so.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import http.client
import logging
import random
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar, overload

from ..errors import RendezvousConnectionError
from ._base import KV, Landed, Record, current_bound

__all__ = [
    "Ambiguous",
    "DeadlinePassed",
    "FailoverKV",
    "Failure",
    "Verdict",
    "clip",
    "describe",
    "grouped",
    "hold",
    "not_sent",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Pauses before a request etcd answered "not now" is sent again: the first scaled by
# _TRANSIENT_BACKOFF (an election is over in about a second), doubling up to
# _TRANSIENT_CAP, each drawn from 0.5-1.5 times the scale (thousands of clients that
# met one election or one overload must not come back at the same moment); an answer
# that says etcd is overloaded (its own request timeout, "too many requests") starts
# at _OVERLOAD_BACKOFF.
_TRANSIENT_BACKOFF = 0.1  # seconds
_OVERLOAD_BACKOFF = 1.0  # seconds
_TRANSIENT_CAP = 2.0  # seconds
_MIN_TIMEOUT = 0.001  # seconds; sockets take no zero timeout
_MOVING_ON = "etcd endpoint %s failed (%s); moving on to %s"
# The codes around an ssl error's text: "[SSL: REASON] " in front, " (_ssl.c:1006)" behind.
_SSL_DETAIL = re.compile(r"\[[A-Z0-9_]+: [A-Z0-9_]+\] | \(_ssl\.c:\d+\)")


class Ambiguous(Exception):
    """A write may or may not have been applied: its response was lost."""


class DeadlinePassed(Exception):
    """The deadline of a :meth:`KV.bounded <etcd_rdzv._kv.KV.bounded>` scope passed
    while a request waited for something of this client (a lock) before it was sent."""


class ConnectFailed(OSError):
    """No connection to the endpoint (raised by the v3 transport): never sent."""


class TLSFailed(ConnectFailed):
    """The TLS handshake failed (the message is the TLS library's): never sent."""


class Verdict(enum.Enum):
    """What the failover loop does about a failed request."""

    #: It provably never reached etcd: try the next endpoint (writes too).
    NOT_SENT = "not sent"
    #: It was sent and its answer lost: the next endpoint; a write is ambiguous.
    LOST = "lost"
    #: etcd answered "not now": pause and send again; a write is ambiguous.
    TRANSIENT = "transient"
    #: Send it again to the same endpoint at once, once per call.
    AGAIN = "again"


@dataclass(frozen=True)
class Failure:
    """A failed request as the loop sees it: the verdict and a description for
    messages and logs (without the endpoint, which the loop adds)."""

    verdict: Verdict
    text: str
    #: etcd said it is overloaded (TRANSIENT only): the retry waits longer.
    overload: bool = False


def not_sent(cause: BaseException) -> bool:
    """True when the request provably never reached the server."""
    if isinstance(cause, ssl.SSLError) and not isinstance(
        cause, (ssl.SSLEOFError, ssl.SSLZeroReturnError)
    ):
        # A TLS alert (TLS 1.3 servers refuse a client certificate after the
        # handshake, on the first read): the peer refused the session, not the request.
        return True
    return isinstance(cause, (ConnectFailed, ConnectionRefusedError))


def describe(cause: BaseException) -> str:
    """A transport error (the transport's, sockets, TLS) in words, with a hint where a
    setting is the likely cause. Without the endpoint (the caller names it), so that
    endpoints that failed alike can share one description. A client library's own
    types are mapped to these at its edge (v2: :func:`.v2._requests.root_cause`), never
    here."""
    if isinstance(cause, (TLSFailed, ssl.SSLError)):
        text, hint = str(cause), ""
        if "CERTIFICATE_VERIFY_FAILED" in text:
            hint = (
                " (etcd's certificate was not accepted: check 'ca_cert', the endpoint host "
                "name and the certificate's dates)"
            )
        elif any(
            s in text for s in ("ALERT_BAD_CERTIFICATE", "CERTIFICATE_REQUIRED", "ALERT_UNKNOWN_CA")
        ):
            hint = (
                " (etcd rejected our client certificate or requires one: set "
                "'ssl_cert'/'ssl_cert_key')"
            )
        elif "EOF occurred" in text or "UNEXPECTED_EOF" in text:
            # etcd 3.4 hangs up mid-handshake instead of sending an alert.
            hint = (
                " (the connection closed during the TLS handshake: the server may serve "
                "plain HTTP (then use protocol=http), or etcd may require a client "
                "certificate ('ssl_cert'/'ssl_cert_key') or reject ours)"
            )
        return f"TLS error: {_tls_text(text)}{hint}"
    if isinstance(cause, ConnectFailed):
        return f"connection failed ({cause})"
    if isinstance(cause, socket.timeout):
        return f"timed out ({cause})"
    if isinstance(cause, http.client.RemoteDisconnected):
        # Our transport's text names the endpoint, which the caller does already.
        return "RemoteDisconnected: the connection closed unanswered"
    return f"{type(cause).__name__}: {cause}"


def _tls_text(text: str) -> str:
    """The TLS library's message without its codes: ``[SSL: CERTIFICATE_VERIFY_FAILED]
    certificate verify failed: ... (_ssl.c:1006)`` -> ``certificate verify failed: ...``."""
    return _SSL_DETAIL.sub("", text).strip() or text


def grouped(failures: Sequence[tuple[str, str]]) -> str:
    """``(endpoint, what went wrong)`` pairs in words, endpoints that failed alike
    named together (in their order): ``"a, b: refused; c: timed out"``."""
    by_text: dict[str, list[str]] = {}
    for url, text in failures:
        by_text.setdefault(text, []).append(url)
    return "; ".join(f"{', '.join(urls)}: {text}" for text, urls in by_text.items())


def clip(timeout: float) -> float:
    """``timeout``, shortened to the time left in the thread's bounded scope (at
    least a millisecond, so a request sent late fails at once rather than not at all).
    For the requests a send function makes beyond the one it was given a timeout for
    (v3: fetching an auth token first)."""
    bound = current_bound()
    if bound is None:
        return timeout
    return min(timeout, max(bound - time.monotonic(), _MIN_TIMEOUT))


@contextlib.contextmanager
def hold(
    lock: threading.Lock, passed: Callable[[], BaseException] = DeadlinePassed
) -> Iterator[None]:
    """Hold ``lock``; inside a bounded scope wait for it only until the deadline (a
    request waits for a lock held over another thread's request).

    Raises:
        DeadlinePassed: the scope's deadline passed first; or what ``passed()`` makes.
    """
    bound = current_bound()
    if bound is None:
        lock.acquire()
    elif not lock.acquire(timeout=max(bound - time.monotonic(), 0.0)):
        raise passed()
    try:
        yield
    finally:
        lock.release()


class FailoverKV(KV):
    """A :class:`~etcd_rdzv._kv.KV` whose requests go to one endpoint at a time.

    Subclasses send requests through :meth:`_call` (reads, and writes that may simply
    be sent again) or :meth:`_resolve` (conditional writes), and implement
    :meth:`_classify` and :meth:`_get`.

    Args:
        urls: the base URL of each endpoint, preferred first.
        read_timeout: seconds one request may take; also how long transient errors
            are retried, and the most a conditional write may take in all.
    """

    #: Whether a transient error moves on to the next endpoint (v3: a member without
    #: a leader may stay so; another one may see the majority) or stays on it (v2).
    _transient_moves_on = False

    def __init__(self, urls: list[str], read_timeout: float) -> None:
        self._urls = list(urls)
        self._read_timeout = read_timeout
        self._current = 0
        self._closed = False
        self._answered = False  # whether a request of this client was answered

    @property
    def endpoints(self) -> list[str]:
        n = self._current
        return self._urls[n:] + self._urls[:n]

    # -- what an API supplies ---------------------------------------------------------

    @abc.abstractmethod
    def _classify(
        self, exc: Exception, url: str, what: str, key: str, resent: bool
    ) -> Failure | None:
        """Judge ``exc``, raised by a request of ``what`` of ``key`` to ``url``.

        ``resent``: the request was already sent :attr:`Verdict.AGAIN` in this call.

        Returns:
            The :class:`Failure` the loop acts on, or ``None`` to let ``exc`` through
            unchanged (a watch timeout, compacted history, one of our errors).

        Raises:
            The final error, when no endpoint or retry would help (refused
            credentials, a request too large, a wrong API).
        """

    @abc.abstractmethod
    def _get(self, key: str, deadline: float | None) -> tuple[Record | None, int]:
        """:meth:`get`, ending by ``deadline`` (read-backs of :meth:`_resolve`)."""

    # -- the loop ---------------------------------------------------------------------

    def _call(
        self,
        what: str,
        key: str,
        fn: Callable[[int, float], T],
        *,
        idempotent: bool,
        deadline: float | None = None,
    ) -> T:
        """Run ``fn(endpoint index, timeout)`` on the current endpoint, failing over.

        With ``deadline``, the time left is shared out between the endpoints not yet
        tried, so that each of them gets its turn. Until one request of this client
        was answered, its moves from a failed endpoint to the next are logged (at
        WARNING) when the call ends, unless its error names every failure (no
        endpoint completed it): the first requests of a client built with wrong
        settings print one error, not a warning per endpoint before it.

        Raises:
            Ambiguous: a non-idempotent request was sent but its answer was lost.
            RendezvousConnectionError: no endpoint answered (or the bounded scope's
                deadline passed); also what :meth:`_classify` raises.
        """
        if self._closed:
            raise RendezvousConnectionError(f"The etcd client for {self._urls} is closed.")
        bound = current_bound()
        failures: list[tuple[str, str]] = []
        moves: list[tuple[str, str, str]] | None = None if self._answered else []
        n = len(self._urls)
        start = self._current
        backoff = _TRANSIENT_BACKOFF
        # Transient cluster errors (leader election, raft timeouts) are retried with
        # back-off until this deadline; unreachable endpoints are each tried once.
        transient_deadline = time.monotonic() + self._read_timeout
        if deadline is not None:
            transient_deadline = min(transient_deadline, deadline)
        if bound is not None:
            transient_deadline = min(transient_deadline, bound)
        resent = False
        attempt = 0
        turn = 0  # transient errors may move on without using up attempts
        while attempt < n:
            index = (start + attempt + turn) % n
            url = self._urls[index]
            timeout = self._read_timeout
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                timeout = min(timeout, max(remaining / (n - attempt), 0.05))
            if bound is not None:
                left = bound - time.monotonic()
                if left <= 0:
                    break
                timeout = min(timeout, left)
            try:
                result = fn(index, timeout)
            except DeadlinePassed:
                self._log_moves(moves, told=True)
                raise self._deadline_passed(what, key, grouped(failures)) from None
            except Exception as exc:
                try:
                    failure = self._classify(exc, url, what, key, resent)
                except BaseException:  # a final error, about this endpoint only
                    self._log_moves(moves)
                    raise
                if failure is None:
                    self._log_moves(moves)
                    raise
                if failure.verdict is Verdict.AGAIN:
                    if resent:  # once per call
                        self._log_moves(moves)
                        raise RendezvousConnectionError(
                            f"etcd at {url} failed {what} of {key!r}: {failure.text}"
                        ) from exc
                    resent = True
                    continue
                failures.append((url, failure.text))
                # A request the scope's deadline cut short says nothing against the
                # endpoint: no failover.
                cut_short = bound is not None and time.monotonic() >= bound
                transient = failure.verdict is Verdict.TRANSIENT
                if not transient and not cut_short:
                    self._advance(index, url, failure.text, moves)
                if not idempotent and failure.verdict is not Verdict.NOT_SENT:
                    # Lost, or a timed-out proposal: either may still be applied.
                    self._log_moves(moves)
                    raise Ambiguous(f"{url}: {failure.text}") from exc
                if cut_short:
                    break
                if transient:
                    if failure.overload:
                        backoff = max(backoff, _OVERLOAD_BACKOFF)
                    pause = backoff * (0.5 + random.random())
                    if time.monotonic() + pause > transient_deadline:
                        break
                    log.info("etcd at %s: %s; retrying in %.2fs", url, failure.text, pause)
                    time.sleep(pause)
                    backoff = min(backoff * 2, _TRANSIENT_CAP)
                    if self._transient_moves_on:
                        turn += 1
                    continue
                attempt += 1
                continue
            if index != self._current:
                self._current = index
            self._answered = True
            self._log_moves(moves)
            return result
        self._log_moves(moves, told=True)
        if bound is not None and time.monotonic() >= bound:
            raise self._deadline_passed(what, key, grouped(failures))
        raise RendezvousConnectionError(
            f"No etcd endpoint completed {what} of {key!r}; tried "
            + (grouped(failures) or "; ".join(self._urls))
        )

    def _advance(
        self, index: int, url: str, why: str, moves: list[tuple[str, str, str]] | None = None
    ) -> None:
        """Make the endpoint after ``index`` the current one; the move is logged now,
        or added to ``moves`` (see :meth:`_log_moves`)."""
        nxt = (index + 1) % len(self._urls)
        if len(self._urls) > 1:
            if moves is None:
                log.warning(_MOVING_ON, url, why, self._urls[nxt])
            else:
                moves.append((url, why, self._urls[nxt]))
        self._current = nxt

    @staticmethod
    def _log_moves(moves: list[tuple[str, str, str]] | None, *, told: bool = False) -> None:
        """Log the moves a call held back: at WARNING, or at DEBUG when its error
        ``told`` them all (no endpoint completed it)."""
        for move in moves or ():
            log.log(logging.DEBUG if told else logging.WARNING, _MOVING_ON, *move)

    def _deadline_passed(self, what: str, key: str, tried: str = "") -> RendezvousConnectionError:
        """The error of a call that the bounded scope's deadline cut short (``tried``:
        the endpoints' failures, in words)."""
        tried = f"; tried {tried}" if tried else ""
        return RendezvousConnectionError(
            f"The caller's deadline passed before etcd completed {what} of {key!r} "
            f"(endpoints {', '.join(self._urls)}){tried}"
        )

    @overload
    def _wait_bound(self, seconds: float, what: str, key: str) -> float: ...

    @overload
    def _wait_bound(self, seconds: float | None, what: str, key: str) -> float | None: ...

    def _wait_bound(self, seconds: float | None, what: str, key: str) -> float | None:
        """``seconds`` (``None``: no limit), shortened to the time left in the
        thread's bounded scope: for waits that are not requests (a watch's window).

        Raises:
            RendezvousConnectionError: the scope's deadline has passed.
        """
        bound = current_bound()
        if bound is None:
            return seconds
        left = bound - time.monotonic()
        if left <= 0:
            raise self._deadline_passed(what, key)
        return left if seconds is None else min(seconds, left)

    def _resolve(
        self,
        what: str,
        key: str,
        value: str,
        fn: Callable[[int, float], Record | None],
        still_possible: Callable[[Record | None], bool],
        landed: Landed | None = None,
    ) -> Record | None:
        """Send a conditional write, resolving lost responses by reading back.

        ``fn`` returns the write's result, ``None`` when etcd refused it.
        ``landed(current)`` decides from the key as read back whether a lost write
        was applied (by default: the key holds exactly ``value``); then the key as read
        is returned. ``still_possible(current)`` tells whether the write's condition
        still holds, in which case it is sent again (to the next endpoint); if not,
        ``None``.

        Raises:
            RendezvousConnectionError: etcd did not confirm the write in time.
        """
        # One deadline for the write and its read-backs: the whole call, lost
        # responses included, ends within read_timeout (and the bounded scope).
        bound = current_bound()
        deadline = time.monotonic() + self._read_timeout
        if bound is not None:
            deadline = min(deadline, bound)
        last: Ambiguous | None = None
        for _ in range(len(self._urls) + 1):
            try:
                return self._call(what, key, fn, idempotent=False, deadline=deadline)
            except Ambiguous as exc:
                last = exc
                if time.monotonic() >= deadline:
                    break
                current, _rev = self._get(key, deadline)
                if landed(current) if landed else current is not None and current.value == value:
                    log.info("%s of %s: response lost, but the write landed", what, key)
                    return current
                if not still_possible(current):
                    return None
                log.info("%s of %s: response lost and the write did not land; again", what, key)
        if bound is not None and time.monotonic() >= bound:
            raise self._deadline_passed(what, key, f"the write may have been applied: {last}")
        raise RendezvousConnectionError(f"etcd did not confirm {what} of {key!r}: {last}")
