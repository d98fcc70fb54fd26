"""v3 watches: one streamed ``/v3/watch`` request per call, or a stream kept open.

* :meth:`Watches.events` sends one watch request from a start revision, reads it
  until the first event or the deadline, and cancels it by closing the connection;
  each request is capped at ``read_timeout``, so a frozen member cannot hold it.
* :class:`StreamWatcher` keeps its stream open instead, and opens it *before* the
  read it follows: etcd delivers a watch that starts in the past only when its
  background sync runs (every 100 ms), one that starts now at once. The stream is
  read by the thread that waits for its events, in :meth:`StreamWatcher.next`, and
  by no thread of its own: at a rendezvous of a thousand node processes on a few
  cores, a reader thread per node (its start, its hand-offs, its wake-ups) cost
  about as much CPU as the rest of a follower's join (``docs/benchmarks.md``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ...errors import RendezvousConnectionError
from .._base import Event, Record, WatchCompacted, Watcher
from .._failover import clip, describe
from .._http import BadResponse, Response
from .._stall import SETTLE
from ._wire import GatewayKV, Messages, cancel_error, dec, enc, header_revision, record, under

__all__ = ["StreamWatcher", "Watches"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def _create_request(key: str, prefix: bool, start: int) -> dict[str, Any]:
    """The body that opens a watch of ``key`` (or below it) from revision ``start``
    (0: from now)."""
    create: dict[str, Any] = under(key) if prefix else {"key": enc(key)}
    if start > 0:
        create["start_revision"] = str(start)
    return {"create_request": create}


def _events(result: dict[str, Any], from_revision: int) -> list[Event]:
    """The events of one watch answer at or after ``from_revision``."""
    current = header_revision(result)
    events = []
    for event in result.get("events") or []:
        kv = event.get("kv") or {}
        mod_revision = int(kv.get("mod_revision") or 0)
        if mod_revision < from_revision:
            continue
        if event.get("type") == "DELETE":
            events.append(Event("delete", Record(dec(kv.get("key")), "", mod_revision), current))
        else:
            events.append(Event("put", record(kv), current))
    return events


@dataclass
class _Opened:
    """A confirmed watch stream: its response, its message reader, the endpoint
    index and auth token it was opened with, the store revision at creation, and
    when it was opened (``time.monotonic()``)."""

    resp: Response
    messages: Messages
    index: int
    token: str | None
    created: int
    at: float


class Watches:
    """The watch requests of the v3 client ``kv``, and the streams it keeps open."""

    def __init__(self, kv: GatewayKV) -> None:
        self._kv = kv
        self._streams: weakref.WeakSet[StreamWatcher] = weakref.WeakSet()

    def _send(
        self, index: int, body: dict[str, Any], timeout: float
    ) -> tuple[Response, str | None]:
        """POST the watch ``body`` to endpoint ``index``; the answer, unread, and the
        auth token the request carried."""
        kv = self._kv
        headers, token = kv._headers(index, timeout, True)
        # The token request may have used up part of the scope's time.
        timeout = clip(timeout)
        url = kv._urls[index]
        # etcd confirms a new watch at once (its "created" message comes with the
        # headers): until then the request is checked like any other, so a frozen
        # member does not hold it for the whole timeout.
        resp, _ = kv._transport.request(
            url,
            "/v3/watch",
            json.dumps(body).encode("utf-8"),
            headers,
            timeout,
            stream=True,
            check=kv._terms.checker(url, headers, "/v3/watch", time.monotonic() + timeout),
            check_every=SETTLE,
        )
        return resp, token

    def result(
        self, index: int, message: dict[str, Any], token: str | None, key: str, start: int
    ) -> dict[str, Any]:
        """The ``result`` of one watch stream message from endpoint ``index``.

        Raises:
            EtcdError: etcd reported an error, or cancelled the watch.
            WatchCompacted: the history from ``start`` is gone.
        """
        if "error" in message:
            self._kv._decode(index, 500, json.dumps(message).encode(), token)  # raises
        result: dict[str, Any] = message.get("result") or {}
        self._kv._check_cluster(index, result)
        compacted = int(result.get("compact_revision") or 0)
        if compacted:
            raise WatchCompacted(f"{key}: history from {start} is gone (compacted at {compacted})")
        if result.get("canceled"):
            raise cancel_error(result, token)
        return result

    # -- one request per call ---------------------------------------------------------

    def events(
        self, key: str, from_revision: int, timeout: float | None, prefix: bool
    ) -> list[Event]:
        """Every event of the first answer that has any, from ``from_revision``;
        ``[]`` when ``timeout`` passed (see :meth:`KV.watch_events
        <etcd_rdzv._kv.KV.watch_events>`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        body = _create_request(key, prefix, from_revision)
        while True:
            # Each request is capped at read_timeout so a frozen member cannot hold a
            # watch forever; the loop carries on to the caller's deadline.
            step = self._kv._read_timeout
            if deadline is not None:
                step = min(step, deadline - time.monotonic())
                if step <= 0:
                    return []
            until = time.monotonic() + self._kv._wait_bound(step, "watch", key)

            def fn(index: int, timeout: float, until: float = until) -> list[Event]:
                return self._once(index, key, body, from_revision, timeout, until)

            events = self._kv._call("watch", key, fn, idempotent=True)
            if events:
                return events

    def _once(
        self,
        index: int,
        key: str,
        body: dict[str, Any],
        from_revision: int,
        timeout: float,
        until: float,
    ) -> list[Event]:
        """One watch request: the events of the first answer that has any, before
        ``until``, or ``[]``.

        etcd confirms a watch at once (``created``); that answer must come within
        ``timeout`` like any other, and only then is silence a quiet key.
        """
        resp, token = self._send(index, body, timeout)
        created = False
        try:
            if resp.status != 200:
                self._kv._decode(index, resp.status, resp.read(), token)  # raises
            reader = Messages(resp)
            while (message := reader.next()) is not None:
                result = self.result(index, message, token, key, from_revision)
                events = _events(result, from_revision)
                if events:
                    return events
                if result.get("created"):
                    created = True
                if until - time.monotonic() <= 0:
                    return []
                resp.read_by(until)
            raise BadResponse(f"the watch stream of {key!r} ended without an event")
        except TimeoutError:
            if created:
                return []  # a quiet key: no event in this window
            raise
        finally:
            resp.close()

    # -- streams kept open ------------------------------------------------------------

    def open(self, key: str, prefix: bool, start: int) -> _Opened:
        """Open a watch stream from revision ``start`` (0: from now) and wait until
        etcd confirms it; fails over like any request."""
        body = _create_request(key, prefix, start)

        def fn(index: int, timeout: float) -> _Opened:
            resp, token = self._send(index, body, timeout)
            try:
                if resp.status != 200:
                    self._kv._decode(index, resp.status, resp.read(), token)  # raises
                reader = Messages(resp)
                while (message := reader.next()) is not None:
                    result = self.result(index, message, token, key, start)
                    if result.get("created"):
                        revision = header_revision(result)
                        return _Opened(resp, reader, index, token, revision, time.monotonic())
                raise BadResponse(f"the watch stream of {key!r} ended unconfirmed")
            except BaseException:
                resp.close()
                raise

        return self._kv._call("watch", key, fn, idempotent=True)

    def watcher(self, key: str, prefix: bool) -> StreamWatcher:
        """A :class:`StreamWatcher` of ``key`` (or below it)."""
        return StreamWatcher(self, key, prefix)

    def stop(self) -> None:
        """Stop every stream still open (the client is closing)."""
        for stream in list(self._streams):
            stream.stop()


class StreamWatcher(Watcher):
    """:class:`~etcd_rdzv._kv.Watcher` over one open watch stream, read in :meth:`next`.

    :meth:`reread` opens the stream from *now* and then reads, so the stream is in
    sync at once (etcd holds back a watch that starts in the past until its sync loop
    catches it up, every 100 ms) and the read, being linearizable, is at or after the
    stream's start: events up to the read's revision are skipped. After
    :meth:`start` (within ``read_timeout``), the stream it opened serves instead: the
    same order, one request earlier.

    A stream that breaks, or stays silent for ``read_timeout`` (a quiet key, or a
    frozen member: a new stream tells them apart, as etcd must confirm it), is opened
    again from the revision after the last event, on the next endpoint if need be,
    within the caller's wait. Between calls of :meth:`next` its events wait in the
    connection. Closing the client ends a wait under way with
    RendezvousConnectionError.
    """

    polls = False

    def __init__(self, watches: Watches, key: str, prefix: bool) -> None:
        super().__init__(watches._kv, key, prefix)
        self._watches = watches
        self._v3 = watches._kv
        self._opened: _Opened | None = None
        self._heard = 0.0  # when the stream last said anything (time.monotonic())
        self._quick_failures = 0  # streams in a row that ended at once
        self._lock = threading.Lock()  # for stop() from another thread
        self._stopped = False
        self._started = False  # opened by start(), not yet positioned by a reread
        watches._streams.add(self)

    def _open(self, start: int) -> _Opened:
        opened = self._watches.open(self.key, self.prefix, start)
        with self._lock:
            if self._stopped:
                opened.resp.close()
                raise self._stopped_error()
            self._opened = opened
        self._heard = opened.at
        return opened

    def _drop(self) -> None:
        with self._lock:
            opened, self._opened = self._opened, None
        if opened is not None:
            opened.resp.close()

    def _stopped_error(self) -> RendezvousConnectionError:
        return RendezvousConnectionError(
            f"The watch of {self.key!r} was stopped: its etcd client was closed."
        )

    def start(self) -> None:
        """Open the stream from now, for the next :meth:`reread` to use as it is if it
        comes within ``read_timeout`` (a handler opens the watch of its first join when
        built, so the join itself is one request)."""
        self._drop()
        self._open(0)
        self._started = True

    def reread(self, read: Callable[[], tuple[T, int]]) -> tuple[T, int]:
        opened = self._opened
        started, self._started = self._started, False
        if (
            not started
            or opened is None
            or time.monotonic() - self._heard >= self._v3._read_timeout
        ):
            self._drop()
            opened = self._open(0)
        try:
            result, revision = read()
        except BaseException:
            self._drop()
            raise
        if revision < opened.created:  # an older state than the stream starts after
            self._drop()
            self._open(revision + 1)
        self.after = revision
        return result, revision

    def next(self, timeout: float | None) -> list[Event]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            now = time.monotonic()
            wait = None if deadline is None else deadline - now
            if wait is not None and wait <= 0:
                return []
            # Raises once a bounded scope's deadline has passed.
            wait = self._v3._wait_bound(wait, "watch", self.key)
            opened = self._opened or self._open(self.after + 1)
            silent_by = self._heard + self._v3._read_timeout
            opened.resp.read_by(silent_by if wait is None else min(silent_by, now + wait))
            try:
                message = opened.messages.next()
                if message is None:
                    raise BadResponse(f"the watch stream of {self.key!r} ended")
                self._heard = time.monotonic()
                result = self._watches.result(
                    opened.index, message, opened.token, self.key, self.after + 1
                )
            except WatchCompacted:
                self._drop()  # the next call opens a new one, after a reread
                raise
            except TimeoutError:
                if time.monotonic() < silent_by:
                    continue  # the caller's wait (or the scope) is over: see above
                self._reopen(opened, "silent for read_timeout")
                continue
            except Exception as exc:
                self._reopen(opened, describe(exc), deadline)
                continue
            events = _events(result, self.after + 1)
            if events:
                self._quick_failures = 0
                self.after = max(e.record.revision for e in events)
                return events

    def _reopen(self, opened: _Opened, why: str, deadline: float | None = None) -> None:
        """Drop a stream that broke or went silent; the next read opens a new one
        (after a pause, bounded by ``deadline``, if streams keep ending at once)."""
        self._drop()
        if self._stopped:
            raise self._stopped_error()
        log.debug("watch stream of %s: %s; opening it again", self.key, why)
        if time.monotonic() - opened.at < 0.1:
            self._quick_failures += 1  # no hot loop on a stream that keeps ending at once
            pause = min(0.05 * 2**self._quick_failures, 1.0)
            if deadline is not None:
                pause = min(pause, max(deadline - time.monotonic(), 0.0))
            time.sleep(self._v3._wait_bound(pause, "watch", self.key))
        else:
            self._quick_failures = 0

    def stop(self) -> None:
        """End the stream from another thread (the client is closing): a read under
        way fails at once, and so does every later one."""
        with self._lock:
            self._stopped = True
            opened = self._opened
        if opened is not None:
            opened.resp.shutdown()

    def close(self) -> None:
        self._drop()
