"""The KV layer on etcd's v2 API, through python-etcd.

This module and :mod:`etcd_rdzv.client` are the only places that touch python-etcd;
its exceptions (and urllib3's beneath them) become ours here, with the endpoint and
key in the message.

Failover: one python-etcd client per endpoint, all sharing one connection pool, and
our own rotation between them. python-etcd's built-in reconnection is not used: it
drops every endpoint it failed on for good, asks the cluster for advertised URLs that
may not be reachable from here, and silently re-sends writes whose response was lost.
Here a request that failed before it was sent (connection refused, connect timeout)
moves to the next endpoint; a write whose response was lost is resolved by reading
the key back (see :class:`~etcd_rdzv._kv.KV`).
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import etcd
import urllib3
import urllib3.exceptions as u3exc

from ..errors import RendezvousConnectionError
from ._base import KV, Event, Landed, Record, WatchCompacted

__all__ = ["V2KV"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class _QuietFailedRequests(logging.Filter):
    """python-etcd logs every failed request at ERROR; this layer retries or reports
    them itself, so they are demoted to DEBUG (nothing at ERROR that is retried)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.getMessage().startswith(
            ("Request to server", "Unexpected request failure")
        ):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


logging.getLogger("etcd.client").addFilter(_QuietFailedRequests())

_PUT_ACTIONS = frozenset({"set", "create", "update", "compareAndSwap"})
_TRANSIENT_BACKOFF = 0.05  # seconds; first pause after a leader election / raft error
_RAFT_INTERNAL = 300  # v2 errorCode: the proposal timed out (often a leader change)
_INVALID_FORM = 210  # v2 errorCode: the request form could not be parsed


class _Ambiguous(Exception):
    """A write may or may not have been applied: its response was lost."""


def _root_cause(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None) or exc.__cause__
    if isinstance(cause, u3exc.MaxRetryError) and cause.reason is not None:
        return cause.reason
    return cause if cause is not None else exc


def _not_sent(cause: BaseException) -> bool:
    """True when the request provably never reached the server."""
    return isinstance(
        cause,
        (
            u3exc.NewConnectionError,
            u3exc.ConnectTimeoutError,
            u3exc.SSLError,
            ConnectionRefusedError,
        ),
    )


def _describe(cause: BaseException) -> str:
    if isinstance(cause, u3exc.SSLError):
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
        return f"TLS error: {text}{hint}"
    if isinstance(cause, u3exc.NewConnectionError):  # a subclass of ConnectTimeoutError
        return f"connection failed ({cause})"
    if isinstance(cause, (u3exc.ReadTimeoutError, socket.timeout, u3exc.ConnectTimeoutError)):
        return f"timed out ({cause})"
    return f"{type(cause).__name__}: {cause}"


def _send(client: Any, method: str, key: str, params: dict[str, Any], timeout: float) -> Any:
    """One v2 write or delete with its own timeout.

    python-etcd's ``write()``, ``delete()`` and ``refresh()`` always wait the client's
    whole ``read_timeout``; a write that must finish by a deadline (and leave time to
    try the next endpoint) needs a shorter one, so the request is built here the way
    those methods build it.
    """
    path = client.key_endpoint + (key if key.startswith("/") else "/" + key)
    return client._result_from_response(
        client.api_execute(path, method, params=params, timeout=timeout)
    )


def _put_params(value: str | None, ttl: int | None, **conditions: str) -> dict[str, Any]:
    params: dict[str, Any] = dict(conditions)
    if value is not None:
        params["value"] = value
    if ttl is not None:
        params["ttl"] = ttl
    return params


class V2KV(KV):
    """:class:`~etcd_rdzv._kv.KV` on the etcd v2 API.

    Args:
        clients: one python-etcd client per endpoint, preferred first.
        urls: the base URL of each client, for messages.
        read_timeout: seconds one request may take.
        username: for messages about rejected credentials.
    """

    api = "v2"

    def __init__(
        self,
        clients: list[Any],
        urls: list[str],
        read_timeout: float,
        pool: urllib3.PoolManager,
        username: str | None = None,
    ) -> None:
        if not clients or len(clients) != len(urls):
            raise ValueError("V2KV needs one client per endpoint URL.")
        self._clients = clients
        self._urls = urls
        self._read_timeout = read_timeout
        self._pool = pool
        self._username = username
        self._current = 0
        self._closed = False
        self._lock = threading.Lock()

    @property
    def endpoints(self) -> list[str]:
        n = self._current
        return self._urls[n:] + self._urls[:n]

    # -- the one place requests are sent ------------------------------------------------

    def _call(
        self,
        what: str,
        key: str,
        fn: Callable[[Any, float], T],
        *,
        idempotent: bool,
        deadline: float | None = None,
    ) -> T:
        """Run ``fn(client, timeout)`` on the current endpoint, failing over to the next.

        Raises:
            _Ambiguous: a non-idempotent request was sent but its answer was lost.
            RendezvousConnectionError: no endpoint answered.
        """
        if self._closed:
            raise RendezvousConnectionError(f"The etcd client for {self._urls} is closed.")
        failures: list[str] = []
        n = len(self._clients)
        start = self._current
        backoff = _TRANSIENT_BACKOFF
        # Transient cluster errors (leader election, raft timeouts) are retried with
        # back-off until this deadline; unreachable endpoints are each tried once.
        transient_deadline = time.monotonic() + self._read_timeout
        if deadline is not None:
            transient_deadline = min(transient_deadline, deadline)
        attempt = 0
        while attempt < n:
            index = (start + attempt) % n
            url = self._urls[index]
            timeout = self._read_timeout
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                timeout = min(timeout, max(remaining / (n - attempt), 0.05))
            try:
                result = fn(self._clients[index], timeout)
            except etcd.EtcdWatchTimedOut:
                raise
            except etcd.EtcdConnectionFailed as exc:
                cause = _root_cause(exc)
                failures.append(f"{url}: {_describe(cause)}")
                if not idempotent and not _not_sent(cause):
                    self._advance(index, url, cause)
                    raise _Ambiguous(f"{url}: {_describe(cause)}") from exc
                self._advance(index, url, cause)
                attempt += 1
                continue
            except (etcd.EtcdLeaderElectionInProgress, etcd.EtcdWatcherCleared) as exc:
                if self._transient(exc, url, failures, idempotent, transient_deadline, backoff):
                    backoff = min(backoff * 2, 1.0)
                    continue
                break
            except etcd.EtcdInsufficientPermissions as exc:
                who = f"user {self._username!r}" if self._username else "anonymous access"
                raise RendezvousConnectionError(
                    f"etcd at {url} refused {what} of {key!r} for {who}: wrong username or "
                    f"password, or no permission on that key ({exc})."
                ) from exc
            except etcd.EtcdClusterIdChanged as exc:
                raise RendezvousConnectionError(
                    f"The etcd cluster behind {url} changed its cluster id during {what} of "
                    f"{key!r}; the endpoints may point at different clusters ({exc})."
                ) from exc
            except etcd.EtcdException as exc:
                if "404 page not found" in str(exc):
                    raise RendezvousConnectionError(
                        f"etcd at {url} does not serve the v2 API ({what} of {key!r}): use "
                        "api=v3, or start etcd with --enable-v2."
                    ) from exc
                payload = exc.payload if isinstance(exc.payload, dict) else {}
                if payload.get("errorCode") == _INVALID_FORM and "too large" in str(
                    payload.get("cause")
                ):
                    # A bad input, not a connection problem: no endpoint would take it.
                    raise ValueError(
                        f"etcd at {url} refused {what} of {key!r}: the request is too large "
                        f"({payload.get('cause')}); etcd's v2 API parses request bodies of "
                        "up to 10 MiB, and values travel form-encoded."
                    ) from exc
                if payload.get("errorCode") == _RAFT_INTERNAL:
                    if self._transient(exc, url, failures, idempotent, transient_deadline, backoff):
                        backoff = min(backoff * 2, 1.0)
                        continue
                    break
                raise RendezvousConnectionError(
                    f"etcd at {url} failed {what} of {key!r}: {exc}"
                ) from exc
            except (u3exc.HTTPError, http.client.HTTPException, OSError) as exc:
                # python-etcd leaves some body-read errors unwrapped.
                failures.append(f"{url}: {_describe(exc)}")
                if not idempotent:
                    self._advance(index, url, exc)
                    raise _Ambiguous(f"{url}: {_describe(exc)}") from exc
                self._advance(index, url, exc)
                attempt += 1
                continue
            else:
                if index != self._current:
                    self._current = index
                return result
        raise RendezvousConnectionError(
            f"No etcd endpoint completed {what} of {key!r}; tried "
            + "; ".join(failures or self._urls)
        )

    def _transient(
        self,
        exc: Exception,
        url: str,
        failures: list[str],
        idempotent: bool,
        deadline: float,
        backoff: float,
    ) -> bool:
        """Handle a transient cluster error: pause and return True to retry the same
        member, or return False when out of time. Writes raise ``_Ambiguous``: a
        timed-out proposal may still be applied."""
        failures.append(f"{url}: {exc}")
        if not idempotent:
            raise _Ambiguous(f"{url}: {exc}") from exc
        pause = backoff * (1 + random.random())
        if time.monotonic() + pause > deadline:
            return False
        log.info("etcd at %s: %s; retrying in %.2fs", url, exc, pause)
        time.sleep(pause)
        return True

    def _advance(self, index: int, url: str, cause: BaseException) -> None:
        nxt = (index + 1) % len(self._clients)
        if len(self._clients) > 1:
            log.warning(
                "etcd endpoint %s failed (%s); moving on to %s",
                url,
                _describe(cause),
                self._urls[nxt],
            )
        self._current = nxt

    def _write(
        self,
        what: str,
        key: str,
        value: str,
        fn: Callable[[Any, float], Any],
        still_possible: Callable[[Record | None], bool],
        landed: Landed | None = None,
    ) -> Any:
        """Send a conditional write, resolving lost responses by reading back.

        ``still_possible(current)`` tells whether the write's condition still holds, in
        which case it is sent again (to the next endpoint).
        """
        # One deadline for the write and its read-backs: the whole call, lost
        # responses included, ends within read_timeout.
        deadline = time.monotonic() + self._read_timeout
        last: _Ambiguous | None = None
        for _ in range(len(self._clients) + 1):
            try:
                return self._call(what, key, fn, idempotent=False, deadline=deadline)
            except _Ambiguous as exc:
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
        raise RendezvousConnectionError(f"etcd did not confirm {what} of {key!r}: {last}")

    # -- KV ---------------------------------------------------------------------------

    @staticmethod
    def _record(result: Any) -> Record:
        return Record(
            str(result.key),
            result.value or "",
            int(result.modifiedIndex),
            int(result.createdIndex or 0),
        )

    def get(self, key: str) -> tuple[Record | None, int]:
        return self._get(key, None)

    def _get(self, key: str, deadline: float | None) -> tuple[Record | None, int]:
        def fn(client: Any, timeout: float) -> tuple[Record | None, int]:
            try:
                result = client.read(key, timeout=timeout)
            except etcd.EtcdKeyNotFound as exc:
                payload = exc.payload if isinstance(exc.payload, dict) else {}
                return None, int(payload.get("index") or 0)
            if result.dir:
                return None, int(result.etcd_index)
            return self._record(result), int(result.etcd_index)

        return self._call("read", key, fn, idempotent=True, deadline=deadline)

    def list_prefix(self, prefix: str) -> tuple[list[Record], int]:
        return self._list(prefix, recursive=False)

    def list_tree(self, prefix: str) -> tuple[list[Record], int]:
        return self._list(prefix, recursive=True)

    def _list(self, prefix: str, recursive: bool) -> tuple[list[Record], int]:
        def fn(client: Any, timeout: float) -> tuple[list[Record], int]:
            try:
                result = client.read(prefix, recursive=recursive, timeout=timeout)
            except etcd.EtcdKeyNotFound as exc:
                payload = exc.payload if isinstance(exc.payload, dict) else {}
                return [], int(payload.get("index") or 0)
            records = [self._record(r) for r in result.leaves if not r.dir]
            return records, int(result.etcd_index)

        return self._call("list", prefix, fn, idempotent=True)

    def create(
        self, key: str, value: str, ttl: int | None, landed: Landed | None = None
    ) -> Record | None:
        def fn(client: Any, timeout: float) -> Record | None:
            try:
                return self._record(
                    _send(client, "PUT", key, _put_params(value, ttl, prevExist="false"), timeout)
                )
            except etcd.EtcdAlreadyExist:
                return None

        result: Record | None = self._write(
            "create", key, value, fn, lambda current: current is None, landed
        )
        return result

    def claim(
        self, key: str, value: str, ttl: int, beside: str | None = None
    ) -> tuple[Record | None, int]:
        # As create(), but a refusal reports the etcd index it was refused at. v2 TTLs
        # are per key: ``beside`` changes nothing.
        seen = 0

        def fn(client: Any, timeout: float) -> Record | None:
            nonlocal seen
            try:
                return self._record(
                    _send(client, "PUT", key, _put_params(value, ttl, prevExist="false"), timeout)
                )
            except etcd.EtcdAlreadyExist as exc:
                payload = exc.payload if isinstance(exc.payload, dict) else {}
                seen = int(payload.get("index") or 0)
                return None

        result: Record | None = self._write(
            "create", key, value, fn, lambda current: current is None
        )
        return result, 0 if result is not None else seen

    def compare_and_set(
        self, key: str, value: str, revision: int, ttl: int | None, landed: Landed | None = None
    ) -> Record | None:
        def fn(client: Any, timeout: float) -> Record | None:
            try:
                params = _put_params(value, ttl, prevIndex=str(revision))
                return self._record(_send(client, "PUT", key, params, timeout))
            except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
                return None

        result: Record | None = self._write(
            "compare-and-set",
            key,
            value,
            fn,
            lambda current: current is not None and current.revision == revision,
            landed,
        )
        return result

    def put(self, key: str, value: str, ttl: int | None) -> Record:
        def fn(client: Any, timeout: float) -> Record:
            return self._record(_send(client, "PUT", key, _put_params(value, ttl), timeout))

        # An unconditional write may simply be sent again.
        return self._call("write", key, fn, idempotent=True)

    def delete(self, key: str) -> bool:
        def fn(client: Any, timeout: float) -> bool:
            try:
                _send(client, "DELETE", key, {}, timeout)
            except etcd.EtcdKeyNotFound:
                return False
            return True

        return self._call("delete", key, fn, idempotent=True)

    def delete_prefix(self, prefix: str) -> None:
        def fn(client: Any, timeout: float) -> None:
            with contextlib.suppress(etcd.EtcdKeyNotFound):
                _send(client, "DELETE", prefix, {"recursive": "true", "dir": "true"}, timeout)

        self._call("delete", prefix, fn, idempotent=True)

    def refresh(self, key: str, ttl: int) -> bool:
        def fn(client: Any, timeout: float) -> bool:
            try:
                params = _put_params(None, ttl, prevExist="true", refresh="true")
                _send(client, "PUT", key, params, timeout)
            except etcd.EtcdKeyNotFound:
                return False
            return True

        return self._call("refresh", key, fn, idempotent=True)

    def watch(
        self, key: str, from_revision: int, timeout: float | None, *, prefix: bool = False
    ) -> Event | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # Each request is capped at read_timeout so a frozen member cannot hold a
            # watch forever; the loop carries on to the caller's deadline.
            step = self._read_timeout
            if deadline is not None:
                step = min(step, deadline - time.monotonic())
                if step <= 0:
                    return None
            step = max(step, 0.001)

            def fn(client: Any, _timeout: float, step: float = step) -> Any:
                try:
                    return client.read(
                        key,
                        wait=True,
                        waitIndex=from_revision,
                        recursive=prefix,
                        timeout=step,
                    )
                except etcd.EtcdEventIndexCleared as exc:
                    raise WatchCompacted(f"{key}: history from {from_revision} is gone") from exc

            try:
                result = self._call("watch", key, fn, idempotent=True)
            except etcd.EtcdWatchTimedOut:
                continue
            revision = int(result.modifiedIndex)
            current = int(result.etcd_index or 0)
            if result.action in _PUT_ACTIONS:
                record = Record(
                    str(result.key), result.value or "", revision, int(result.createdIndex or 0)
                )
                return Event("put", record, current)
            return Event("delete", Record(str(result.key), "", revision), current)

    def probe(self, key: str = "/") -> None:
        deadline = time.monotonic() + self._read_timeout

        def fn(client: Any, timeout: float) -> None:
            with contextlib.suppress(etcd.EtcdKeyNotFound):
                client.read(key, timeout=timeout)

        self._call("probe read", key, fn, idempotent=True, deadline=deadline)

    def close(self) -> None:
        self._closed = True
        self._pool.clear()
