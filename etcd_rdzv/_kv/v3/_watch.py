"""v3 watches: one streamed ``/v3/watch`` request per call, or a stream kept open.

* :meth:`Watches.events` sends one watch request from a start revision, reads it
  until the first event or the deadline, and cancels it by closing the connection;
  each request is capped at ``read_timeout``, so a frozen member cannot hold it.
* :class:`StreamWatcher` keeps its stream open instead, read by a thread of its own,
  and opens it *before* the read it follows: etcd delivers a watch that starts in the
  past only when its background sync runs (every 100 ms), one that starts now at once.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from .._base import Event, Record, WatchCompacted, Watcher
from .._failover import clip, describe
from ._http import BadResponse, Response
from ._wire import GatewayKV, cancel_error, dec, enc, header_revision, messages, record, under

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
    """A confirmed watch stream: its response, its message iterator, the endpoint
    index and auth token it was opened with, and the store revision at creation."""

    resp: Response
    messages: Iterator[dict[str, Any]]
    index: int
    token: str | None
    created: int


class Watches:
    """The watch requests of the v3 client ``kv``, and the streams it keeps open."""

    def __init__(self, kv: GatewayKV) -> None:
        self._kv = kv
        self._streams: weakref.WeakSet[_Stream] = weakref.WeakSet()

    def _send(
        self, index: int, body: dict[str, Any], timeout: float
    ) -> tuple[Response, str | None]:
        """POST the watch ``body`` to endpoint ``index``; the answer, unread, and the
        auth token the request carried."""
        kv = self._kv
        headers, token = kv._headers(index, timeout, True)
        # The token request may have used up part of the scope's time.
        resp, _ = kv._transport.request(
            kv._urls[index],
            "/v3/watch",
            json.dumps(body).encode("utf-8"),
            headers,
            clip(timeout),
            stream=True,
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
            for message in messages(resp):
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
                stream = messages(resp)
                for message in stream:
                    result = self.result(index, message, token, key, start)
                    if result.get("created"):
                        # From here silence is a quiet key, up to read_timeout.
                        resp.settimeout(self._kv._read_timeout)
                        return _Opened(resp, stream, index, token, header_revision(result))
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


class _Stream:
    """One watch stream and the thread that reads it into :attr:`queue`.

    The thread puts each batch of events (one revision or more) on the queue, or the
    error that ended it (:class:`WatchCompacted`, or RendezvousConnectionError once
    no endpoint would open the stream again). A stream that breaks, or stays silent
    for ``read_timeout`` (a quiet key, or a frozen member: a new stream tells them
    apart, as etcd must confirm it), is opened again from the revision after the last
    event, on the next endpoint if need be. The thread runs outside any bounded scope
    of the thread that opened the stream.
    """

    def __init__(self, watches: Watches, key: str, prefix: bool, start: int) -> None:
        self._watches, self._key, self._prefix = watches, key, prefix
        self.queue: queue.SimpleQueue[list[Event] | BaseException] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        opened = watches.open(key, prefix, start)
        #: The store revision when etcd confirmed the stream.
        self.created = opened.created
        self._resp: Response | None = opened.resp
        position = opened.created if start == 0 else start - 1
        watches._streams.add(self)
        self._thread = threading.Thread(
            target=self._run, args=(opened, position), name=f"etcd-rdzv-watch:{key}", daemon=True
        )
        self._thread.start()

    def _run(self, opened: _Opened, position: int) -> None:
        quick_failures = 0
        while True:
            opened_at = time.monotonic()
            try:
                for message in opened.messages:
                    result = self._watches.result(
                        opened.index, message, opened.token, self._key, position + 1
                    )
                    events = _events(result, position + 1)
                    if events:
                        position = max(e.record.revision for e in events)
                        self.queue.put(events)
                        quick_failures = 0
                raise BadResponse(f"the watch stream of {self._key!r} ended")
            except WatchCompacted as exc:
                self.queue.put(exc)
                return
            except Exception as exc:  # broke or went silent: open it again
                if self._stopped.is_set():
                    return
                log.debug("watch stream of %s: %s; opening it again", self._key, describe(exc))
            finally:
                opened.resp.close()
            if time.monotonic() - opened_at < 0.1:
                quick_failures += 1  # no hot loop on a stream that keeps ending at once
                self._stopped.wait(min(0.05 * 2**quick_failures, 1.0))
            if self._stopped.is_set():
                return
            try:
                opened = self._watches.open(self._key, self._prefix, position + 1)
            except BaseException as exc:
                self.queue.put(exc)
                return
            with self._lock:
                self._resp = opened.resp
                if self._stopped.is_set():
                    opened.resp.close()
                    return

    def stop(self) -> None:
        """Stop the thread: its blocked read ends when the socket is shut down."""
        self._stopped.set()
        with self._lock:
            resp, self._resp = self._resp, None
        if resp is not None:
            resp.shutdown()


class StreamWatcher(Watcher):
    """:class:`~etcd_rdzv._kv.Watcher` over one open watch stream.

    :meth:`reread` opens the stream from *now* and then reads, so the stream is in
    sync at once (etcd holds back a watch that starts in the past until its sync loop
    catches it up, every 100 ms) and the read, being linearizable, is at or after the
    stream's start: events up to the read's revision are skipped.
    """

    polls = False

    def __init__(self, watches: Watches, key: str, prefix: bool) -> None:
        super().__init__(watches._kv, key, prefix)
        self._watches = watches
        self._v3 = watches._kv
        self._stream: _Stream | None = None

    def _stop_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.stop()

    def reread(self, read: Callable[[], tuple[T, int]]) -> tuple[T, int]:
        self._stop_stream()
        stream = _Stream(self._watches, self.key, self.prefix, 0)
        self._stream = stream
        try:
            result, revision = read()
        except BaseException:
            self._stop_stream()
            raise
        if revision < stream.created:  # an older state than the stream starts after
            self._stop_stream()
            self._stream = _Stream(self._watches, self.key, self.prefix, revision + 1)
        self.after = revision
        return result, revision

    def next(self, timeout: float | None) -> list[Event]:
        if self._stream is None:
            self._stream = _Stream(self._watches, self.key, self.prefix, self.after + 1)
        stream = self._stream
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                return []
            # Raises once a bounded scope's deadline has passed.
            wait = self._v3._wait_bound(wait, "watch", self.key)
            try:
                item = stream.queue.get(timeout=wait)
            except queue.Empty:
                continue  # the timeout or the scope's deadline passed: see above
            if isinstance(item, BaseException):
                self._stop_stream()  # the next call opens a new one
                raise item
            events = [e for e in item if e.record.revision > self.after]
            if events:
                self.after = max(e.record.revision for e in events)
                return events

    def close(self) -> None:
        self._stop_stream()
