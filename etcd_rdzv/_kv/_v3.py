"""The KV layer on etcd's v3 API, through its JSON gateway (``/v3/...``) over urllib3.

No client library: each primitive is one or two POSTs to the gateway that etcd 3.4
and newer serve on their client port (see ``docs/api.md`` for why not etcd3gw). Keys
and values travel base64-encoded, 64-bit integers as strings.

* compare-and-set is a transaction comparing the key's ``mod_revision``; create is a
  transaction comparing its ``create_revision`` with 0;
* a TTL is a lease: a write with ``ttl=T`` attaches the key to this client's clean-up
  lease of TTL ``T`` (one per distinct ``T``, granted on first use), which the write
  first keeps alive when its last grant or keep-alive is older than ``T/10``; those
  leases are never revoked, they expire ``T`` after this client stops writing.
  A liveness key (:meth:`V3KV.put_owned`, :meth:`V3KV.claim`) gets an *owned* lease
  of its own, so it expires ``T`` after its own last refresh, like a v2 key TTL;
  :meth:`V3KV.close` revokes the owned leases, so liveness keys vanish at once on
  shutdown;
* a watch is one streamed ``/v3/watch`` request from a start revision, read until the
  first event or the deadline, and cancelled by closing the connection. A
  :meth:`V3KV.watcher` keeps its stream open instead, read by a thread of its own,
  and opens it *before* the read it follows: etcd delivers a watch that starts in
  the past only when its background sync runs (every 100 ms), one that starts now at
  once;
* with a username, a token from ``/v3/auth/authenticate`` goes in the
  ``Authorization`` header; an expired token is replaced once and the request sent
  again.

Failover is ours, as in :mod:`._v2`: one request goes to one endpoint at a time; a
request that provably never left (refused, connect timeout, TLS) moves to the next;
a create or compare-and-set whose response was lost is resolved by reading the key
back; leader elections are waited out until ``read_timeout``. urllib3 never retries by
itself (``retries=False``) and its errors become ours in this module, with the
endpoint and key in the message.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import queue
import random
import socket
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import urllib3
import urllib3.exceptions as u3exc

from ..errors import RendezvousConnectionError
from ._base import KV, Event, Landed, Record, WatchCompacted, Watcher

__all__ = ["V3KV"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT_BACKOFF = 0.05  # seconds; first pause after a leader election / raft error

# gRPC status codes, as the gateway reports them in error bodies.
_INVALID_ARGUMENT = 3
_DEADLINE_EXCEEDED = 4
_NOT_FOUND = 5
_PERMISSION_DENIED = 7
_RESOURCE_EXHAUSTED = 8
_FAILED_PRECONDITION = 9
_UNAVAILABLE = 14
_UNAUTHENTICATED = 16
_CODE_NAMES = {
    "InvalidArgument": _INVALID_ARGUMENT,
    "DeadlineExceeded": _DEADLINE_EXCEEDED,
    "NotFound": _NOT_FOUND,
    "PermissionDenied": _PERMISSION_DENIED,
    "ResourceExhausted": _RESOURCE_EXHAUSTED,
    "FailedPrecondition": _FAILED_PRECONDITION,
    "Unavailable": _UNAVAILABLE,
    "Unauthenticated": _UNAUTHENTICATED,
}


def _enc(text: str) -> str:
    return base64.b64encode(text.encode("utf-8")).decode("ascii")


def _dec(data: str | None) -> str:
    # Keys and values we write are UTF-8; anything else was written by someone else.
    return base64.b64decode(data or "").decode("utf-8", "replace")


def _range_end(prefix: str) -> str:
    """The end of the key range holding every key that starts with ``prefix``."""
    raw = bytearray(prefix.encode("utf-8"))
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return _enc("\0")  # every key from the start
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode("ascii")


def _under(directory: str) -> dict[str, str]:
    """The range of every key below the directory ``directory`` (``directory/...``)."""
    return {"key": _enc(directory + "/"), "range_end": _range_end(directory + "/")}


class _Ambiguous(Exception):
    """A write may or may not have been applied: its response was lost."""


class _LeaseGone(Exception):
    """etcd answered "requested lease not found": the lease expired or was revoked."""


class _EtcdError(Exception):
    """An error etcd answered with (the request reached it).

    ``token`` is the auth token the request carried, so that only the first thread to
    see a token rejected replaces it.
    """

    def __init__(self, code: int, message: str, status: int, token: str | None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        self.token = token

    @property
    def transient(self) -> bool:
        """A leader election, a raft timeout or an overloaded member: try again."""
        text = self.message.lower()
        return (
            self.code in (_UNAVAILABLE, _DEADLINE_EXCEEDED)
            or "too many requests" in text
            or "leader" in text
        )

    @property
    def auth(self) -> bool:
        """A token problem that a fresh token may cure (3.5 reports an expired token
        on a watch as "permission denied")."""
        text = self.message.lower()
        return (
            self.code in (_UNAUTHENTICATED, _PERMISSION_DENIED)
            or "invalid auth token" in text
            or "user name is empty" in text
        )

    @property
    def lease_gone(self) -> bool:
        return self.code == _NOT_FOUND and "lease not found" in self.message

    @property
    def too_large(self) -> bool:
        """etcd's --max-request-bytes ("request is too large") or gRPC's message size
        limit ("larger than max"): no endpoint would take this request."""
        return "request is too large" in self.message or "larger than max" in self.message


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
    if isinstance(cause, u3exc.MaxRetryError) and cause.reason is not None:
        cause = cause.reason
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
        elif "EOF occurred" in text or "UNEXPECTED_EOF" in text:
            # etcd 3.4 hangs up mid-handshake instead of sending an alert.
            hint = (
                " (etcd closed the connection during the TLS handshake: it may require a "
                "client certificate ('ssl_cert'/'ssl_cert_key') or reject ours)"
            )
        return f"TLS error: {text}{hint}"
    if isinstance(cause, u3exc.NewConnectionError):  # a subclass of ConnectTimeoutError
        return f"connection failed ({cause})"
    if isinstance(cause, (u3exc.ReadTimeoutError, socket.timeout, u3exc.ConnectTimeoutError)):
        return f"timed out ({cause})"
    return f"{type(cause).__name__}: {cause}"


@dataclass
class _Lease:
    """A lease this client granted. ``renewed``: monotonic time its last grant or
    keep-alive was sent (so it lives at least ``ttl`` seconds from then)."""

    id: int
    ttl: int
    renewed: float


def _record(kv: dict[str, Any]) -> Record:
    return Record(
        _dec(kv.get("key")),
        _dec(kv.get("value")),
        int(kv.get("mod_revision") or 0),
        int(kv.get("create_revision") or 0),
    )


def _int(value: Any) -> int:
    """An error code as etcd sent it, 0 if it is not a number (never ValueError: the
    callers above treat that as "request too large")."""
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def _revision(data: dict[str, Any]) -> int:
    return int((data.get("header") or {}).get("revision") or 0)


class V3KV(KV):
    """:class:`~etcd_rdzv._kv.KV` on the etcd v3 API (JSON gateway).

    Args:
        urls: the base URL of each endpoint, preferred first.
        read_timeout: seconds one request may take.
        pool: the connection pool (TLS settings included) from :mod:`etcd_rdzv.client`.
        username, password: etcd credentials (v3 auth), both or neither.
    """

    api = "v3"

    def __init__(
        self,
        urls: list[str],
        read_timeout: float,
        pool: urllib3.PoolManager,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        if not urls:
            raise ValueError("V3KV needs at least one endpoint URL.")
        if (username is None) != (password is None):
            raise ValueError("V3KV needs both a username and a password, or neither.")
        self._urls = list(urls)
        self._read_timeout = read_timeout
        self._pool = pool
        self._username = username
        self._password = password
        self._current = 0
        self._closed = False
        # None: not authenticated yet; "": etcd has auth off, send no token.
        self._token: str | None = None
        self._auth_lock = threading.Lock()
        self._cluster_id: str | None = None
        # (False, ttl) -> this client's clean-up lease of that TTL: it holds shared
        # state and simply expires.
        self._leases: dict[tuple[bool, int], _Lease] = {}
        # key -> the lease of each liveness key this client owns (one lease per key).
        self._owned: dict[str, int] = {}
        self._lease_lock = threading.Lock()
        self._streams: weakref.WeakSet[_Stream] = weakref.WeakSet()

    @property
    def endpoints(self) -> list[str]:
        n = self._current
        return self._urls[n:] + self._urls[:n]

    # -- one HTTP request -------------------------------------------------------------

    def _headers(self, index: int, timeout: float, auth: bool) -> tuple[dict[str, str], str | None]:
        headers = {"Content-Type": "application/json"}
        token = self._token_for(index, timeout) if auth else None
        if token:
            headers["Authorization"] = token
        return headers, token

    def _post(
        self, index: int, path: str, body: dict[str, Any], timeout: float, *, auth: bool = True
    ) -> dict[str, Any]:
        """POST ``body`` to ``path`` on endpoint ``index``; the decoded answer.

        Raises:
            _EtcdError: etcd answered with an error.
            urllib3 / OSError: the request or its response was lost.
        """
        headers, token = self._headers(index, timeout, auth)
        resp = self._pool.request(
            "POST",
            self._urls[index] + path,
            body=json.dumps(body).encode("utf-8"),
            headers=headers,
            timeout=urllib3.Timeout(total=timeout),
            retries=False,
        )
        return self._decode(index, resp.status, resp.data, token)

    def _decode(self, index: int, status: int, data: bytes, token: str | None) -> dict[str, Any]:
        text = data.decode("utf-8", "replace").strip()
        # Streamed answers (lease keep-alive) are one JSON object per line.
        first = text.splitlines()[0] if text else ""
        try:
            obj = json.loads(first) if first else {}
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            if status == 404:
                raise RendezvousConnectionError(
                    f"etcd at {self._urls[index]} does not serve the v3 API under /v3/ "
                    "(etcd 3.4 or newer is needed; older releases use api=v2)."
                )
            if status >= 500:  # a proxy or a dying member, not etcd's answer: try another
                raise u3exc.ProtocolError(f"HTTP {status}: {text[:200]!r}")
            raise _EtcdError(0, f"HTTP {status}: {text[:200]!r}", status, token)
        if "result" in obj and isinstance(obj["result"], dict):
            obj = obj["result"]
        error = obj.get("error")
        if status != 200 or error:
            if isinstance(error, dict):  # the stream error shape of some gateways
                code = _int(error.get("grpc_code") or error.get("code"))
                message = str(error.get("message") or error)
            else:
                code = _int(obj.get("code"))
                message = str(obj.get("message") or error or f"HTTP {status}")
            raise _EtcdError(code, message, status, token)
        self._check_cluster(index, obj)
        return obj

    def _check_cluster(self, index: int, obj: dict[str, Any]) -> None:
        cluster = (obj.get("header") or {}).get("cluster_id")
        if not cluster:
            return
        if self._cluster_id is None:
            self._cluster_id = str(cluster)
        elif self._cluster_id != str(cluster):
            raise RendezvousConnectionError(
                f"etcd at {self._urls[index]} belongs to cluster {cluster}, but an earlier "
                f"answer came from cluster {self._cluster_id}: the endpoints point at "
                "different clusters."
            )

    # -- authentication ---------------------------------------------------------------

    def _token_for(self, index: int, timeout: float) -> str | None:
        if self._username is None:
            return None
        with self._auth_lock:
            if self._token is None:
                try:
                    data = self._post(
                        index,
                        "/v3/auth/authenticate",
                        {"name": self._username, "password": self._password},
                        timeout,
                        auth=False,
                    )
                except _EtcdError as exc:
                    if "authentication is not enabled" not in exc.message:
                        raise
                    log.debug("etcd at %s has auth off; no token needed", self._urls[index])
                    self._token = ""
                else:
                    self._token = str(data.get("token") or "")
                    log.debug(
                        "authenticated to etcd at %s as %r", self._urls[index], self._username
                    )
            return self._token

    def _forget_token(self, token: str | None) -> None:
        """Drop ``token`` (rejected by etcd) so the next request authenticates again;
        a token another thread has already replaced is left alone."""
        with self._auth_lock:
            if self._token == (token or ""):
                self._token = None

    def _refused(self, url: str, what: str, key: str, exc: _EtcdError) -> RendezvousConnectionError:
        text = exc.message.lower()
        if self._username is None:
            return RendezvousConnectionError(
                f"etcd at {url} refused {what} of {key!r} for anonymous access: etcd requires "
                f"authentication or a permission is missing; set 'username' and 'password' "
                f"({exc.message})."
            )
        if "authentication failed" in text:
            reason = "wrong username or password"
        else:
            reason = "wrong username or password, or no permission on that key"
        return RendezvousConnectionError(
            f"etcd at {url} refused {what} of {key!r} for user {self._username!r}: {reason} "
            f"({exc.message})."
        )

    # -- the one place requests are sent ------------------------------------------------

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

        Raises:
            _Ambiguous: a non-idempotent request was sent but its answer was lost.
            _LeaseGone: the lease the request named no longer exists.
            RendezvousConnectionError: no endpoint answered, or etcd refused us.
        """
        if self._closed:
            raise RendezvousConnectionError(f"The etcd client for {self._urls} is closed.")
        failures: list[str] = []
        n = len(self._urls)
        start = self._current
        backoff = _TRANSIENT_BACKOFF
        # Transient cluster errors (leader election, raft timeouts) are retried with
        # back-off until this deadline; unreachable endpoints are each tried once.
        transient_deadline = time.monotonic() + self._read_timeout
        if deadline is not None:
            transient_deadline = min(transient_deadline, deadline)
        reauthenticated = False
        attempt = 0
        turn = 0  # transient errors move on to the next member without using up attempts
        while attempt < n:
            index = (start + attempt + turn) % n
            url = self._urls[index]
            timeout = self._read_timeout
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                timeout = min(timeout, max(remaining / (n - attempt), 0.05))
            try:
                result = fn(index, timeout)
            except _EtcdError as exc:
                if exc.auth and self._username is not None and not reauthenticated:
                    # An expired token (simple tokens expire when unused, JWTs at
                    # their exp): authenticate once more and send the request again.
                    log.info("etcd at %s: %s; authenticating again", url, exc.message)
                    reauthenticated = True
                    self._forget_token(exc.token)
                    continue
                if exc.auth or "authentication failed" in exc.message:
                    raise self._refused(url, what, key, exc) from exc
                if exc.lease_gone:
                    raise _LeaseGone(exc.message) from exc
                if exc.too_large:  # bad input, not a connection problem
                    raise ValueError(
                        f"etcd at {url} refused {what} of {key!r}: the request is too large "
                        f"({exc.message}); etcd takes requests up to its --max-request-bytes "
                        "(1.5 MiB by default), and v3 values travel base64-encoded."
                    ) from exc
                if exc.transient:
                    failures.append(f"{url}: {exc.message}")
                    if not idempotent:  # a timed-out proposal may still be applied
                        raise _Ambiguous(f"{url}: {exc.message}") from exc
                    pause = backoff * (1 + random.random())
                    if time.monotonic() + pause > transient_deadline:
                        break
                    log.info("etcd at %s: %s; retrying in %.2fs", url, exc.message, pause)
                    time.sleep(pause)
                    backoff = min(backoff * 2, 1.0)
                    # A member without a leader (partitioned, stopping) may stay so: ask
                    # the next one, which may see the majority.
                    turn += 1
                    continue
                raise RendezvousConnectionError(
                    f"etcd at {url} failed {what} of {key!r}: {exc.message}"
                ) from exc
            except (u3exc.HTTPError, http.client.HTTPException, OSError) as exc:
                failures.append(f"{url}: {_describe(exc)}")
                self._advance(index, url, exc)
                if not idempotent and not _not_sent(exc):
                    raise _Ambiguous(f"{url}: {_describe(exc)}") from exc
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

    def _advance(self, index: int, url: str, cause: BaseException) -> None:
        nxt = (index + 1) % len(self._urls)
        if len(self._urls) > 1:
            log.warning(
                "etcd endpoint %s failed (%s); moving on to %s",
                url,
                _describe(cause),
                self._urls[nxt],
            )
        self._current = nxt

    def _request(
        self,
        what: str,
        key: str,
        path: str,
        body: dict[str, Any],
        *,
        idempotent: bool = True,
        deadline: float | None = None,
    ) -> dict[str, Any]:
        def fn(index: int, timeout: float) -> dict[str, Any]:
            return self._post(index, path, body, timeout)

        return self._call(what, key, fn, idempotent=idempotent, deadline=deadline)

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

        ``still_possible(current)`` tells whether the write's condition still holds, in
        which case it is sent again (to the next endpoint).
        """
        # One deadline for the write and its read-backs: the whole call, lost
        # responses included, ends within read_timeout.
        deadline = time.monotonic() + self._read_timeout
        last: _Ambiguous | None = None
        for _ in range(len(self._urls) + 1):
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

    # -- leases -----------------------------------------------------------------------

    def _grant(self, ttl: int) -> int:
        # A grant whose answer was lost leaves a lease nobody uses; it expires after
        # ttl, so sending the grant again is harmless.
        data = self._request("lease grant", f"ttl={ttl}", "/v3/lease/grant", {"TTL": str(ttl)})
        lease = int(data.get("ID") or 0)
        if not lease:
            raise RendezvousConnectionError(f"etcd granted no lease for TTL {ttl}: {data}")
        log.debug("granted lease %x (TTL %s s)", lease, data.get("TTL"))
        return lease

    def _keepalive(self, lease: int, deadline: float | None = None) -> int:
        """Keep ``lease`` alive once; its TTL now, 0 if it is gone."""
        data = self._request(
            "lease keep-alive",
            f"lease {lease:x}",
            "/v3/lease/keepalive",
            {"ID": str(lease)},
            deadline=deadline,
        )
        return int(data.get("TTL") or 0)

    def _lease_for(self, ttl: int, owned: bool) -> int:
        """This client's lease for ``ttl`` (owned or clean-up), kept alive if its last
        renewal is older than ``ttl / 10``, granted if there is none (or it is gone)."""
        slot = (owned, ttl)
        with self._lease_lock:
            lease = self._leases.get(slot)
            if lease is not None and time.monotonic() - lease.renewed > ttl / 10:
                sent = time.monotonic()
                if self._keepalive(lease.id) > 0:
                    lease.renewed = sent
                else:
                    log.info("lease %x (TTL %d s) expired; granting a new one", lease.id, ttl)
                    lease = None
            if lease is None:
                sent = time.monotonic()
                lease = _Lease(self._grant(ttl), ttl, sent)
                self._leases[slot] = lease
            return lease.id

    def _drop_lease(self, lease_id: int) -> None:
        with self._lease_lock:
            for slot, lease in list(self._leases.items()):
                if lease.id == lease_id:
                    del self._leases[slot]

    def _leased(
        self,
        ttl: int | None,
        owned: bool,
        send: Callable[[int], T],
        key: str = "",
        beside: str | None = None,
    ) -> T:
        """``send(lease id)`` (0: no lease); once more with a new lease if etcd says
        the lease is gone (it expired while this client was idle or paused).

        An owned key (``owned``: ``key``) gets a lease of its own, granted for this
        write: it expires ``ttl`` after its own last refresh, whatever happens to this
        client's other keys, as a v2 key TTL would (a lease shared by all of them would
        keep a key the handler dropped alive for as long as the node lives); or the
        lease of the owned key ``beside``, when the caller drops the two together.
        """
        if not ttl:
            return send(0)
        if owned:
            with self._lease_lock:
                previous = self._owned.get(key)
                shared = self._owned.get(beside) if beside else None
            for _ in range(2):
                lease, shared = shared or self._grant(ttl), None
                self._own(key, lease)
                try:
                    result = send(lease)
                except _LeaseGone:  # just granted: a cluster that lost it; once more
                    log.info("lease %x is gone; writing again with a new one", lease)
                    continue
                if result is None:  # a refused create: the key is not on this lease
                    self._own(key, previous)
                return result
            raise RendezvousConnectionError(f"etcd dropped every lease granted for {key!r}")
        lease = self._lease_for(ttl, owned)
        try:
            return send(lease)
        except _LeaseGone:
            log.info("lease %x is gone; writing again with a new one", lease)
            self._drop_lease(lease)
            return send(self._lease_for(ttl, owned))

    def _own(self, key: str, lease: int | None) -> None:
        """Record ``lease`` as the owned lease of ``key`` (None: it has none now). A
        lease replaced here holds no key any more and simply expires."""
        with self._lease_lock:
            if lease is None:
                self._owned.pop(key, None)
            else:
                self._owned[key] = lease

    # -- KV ---------------------------------------------------------------------------

    def get(self, key: str) -> tuple[Record | None, int]:
        return self._get(key, None)

    def _get(self, key: str, deadline: float | None) -> tuple[Record | None, int]:
        data = self._request("read", key, "/v3/kv/range", {"key": _enc(key)}, deadline=deadline)
        kvs = data.get("kvs") or []
        return (_record(kvs[0]) if kvs else None), _revision(data)

    def _range(self, what: str, prefix: str) -> tuple[list[Record], int]:
        data = self._request(what, prefix, "/v3/kv/range", _under(prefix))
        return [_record(kv) for kv in data.get("kvs") or []], _revision(data)

    def list_prefix(self, prefix: str) -> tuple[list[Record], int]:
        records, revision = self._range("list", prefix)
        start = len(prefix) + 1
        return [r for r in records if "/" not in r.key[start:]], revision

    def list_tree(self, prefix: str) -> tuple[list[Record], int]:
        return self._range("list", prefix)

    def _txn_put(
        self,
        what: str,
        key: str,
        value: str,
        compare: dict[str, str],
        ttl: int | None,
        still_possible: Callable[[Record | None], bool],
        owned: bool = False,
        refused_at: list[int] | None = None,
        landed: Landed | None = None,
        beside: str | None = None,
    ) -> Record | None:
        def send(lease: int) -> Record | None:
            put: dict[str, Any] = {"key": _enc(key), "value": _enc(value), "prev_kv": True}
            if lease:
                put["lease"] = str(lease)
            body = {"compare": [compare], "success": [{"request_put": put}]}

            def fn(index: int, timeout: float) -> Record | None:
                data = self._post(index, "/v3/kv/txn", body, timeout)
                if not data.get("succeeded"):
                    if refused_at is not None:
                        refused_at.append(_revision(data))
                    return None
                revision = _revision(data)
                responses = data.get("responses") or [{}]
                prev = (responses[0].get("response_put") or {}).get("prev_kv") or {}
                return Record(key, value, revision, int(prev.get("create_revision") or revision))

            return self._resolve(what, key, value, fn, still_possible, landed)

        record = self._leased(ttl, owned, send, key, beside)
        if not owned and record is not None:
            self._own(key, None)  # no longer on a lease of its own
        return record

    def create(
        self, key: str, value: str, ttl: int | None, landed: Landed | None = None
    ) -> Record | None:
        compare = {"key": _enc(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        return self._txn_put(
            "create", key, value, compare, ttl, lambda current: current is None, landed=landed
        )

    def claim(
        self, key: str, value: str, ttl: int, beside: str | None = None
    ) -> tuple[Record | None, int]:
        """Create ``key`` if absent, on an owned lease of TTL ``ttl`` (see
        :meth:`put_owned`): the lease of the owned key ``beside`` if it has one, else
        one of its own. A refusal reports the revision the key existed at."""
        compare = {"key": _enc(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        refused: list[int] = []
        record = self._txn_put(
            "create",
            key,
            value,
            compare,
            ttl,
            lambda current: current is None,
            owned=True,
            refused_at=refused,
            beside=beside,
        )
        return record, 0 if record is not None or not refused else refused[-1]

    def compare_and_set(
        self, key: str, value: str, revision: int, ttl: int | None, landed: Landed | None = None
    ) -> Record | None:
        compare = {
            "key": _enc(key),
            "target": "MOD",
            "result": "EQUAL",
            "mod_revision": str(revision),
        }
        return self._txn_put(
            "compare-and-set",
            key,
            value,
            compare,
            ttl,
            lambda current: current is not None and current.revision == revision,
            landed=landed,
        )

    def _put(self, key: str, value: str, ttl: int | None, owned: bool) -> Record:
        def send(lease: int) -> Record:
            body: dict[str, Any] = {"key": _enc(key), "value": _enc(value), "prev_kv": True}
            if lease:
                body["lease"] = str(lease)
            # An unconditional write may simply be sent again.
            data = self._request("write", key, "/v3/kv/put", body)
            revision = _revision(data)
            prev = data.get("prev_kv") or {}
            return Record(key, value, revision, int(prev.get("create_revision") or revision))

        if not owned:
            self._own(key, None)  # no longer on a lease of its own
        return self._leased(ttl, owned, send, key)

    def put(self, key: str, value: str, ttl: int | None) -> Record:
        return self._put(key, value, ttl, owned=False)

    def put_owned(self, key: str, value: str, ttl: int) -> Record:
        """Write ``key`` on an owned lease of its own, of TTL ``ttl``: it lives while
        :meth:`refresh` keeps it, and is deleted at once by :meth:`close`."""
        return self._put(key, value, ttl, owned=True)

    def put_owned_and_get(
        self, key: str, value: str, ttl: int, other: str
    ) -> tuple[tuple[Record, Record | None], int]:
        """One transaction: write ``key`` on the owned lease, read ``other``."""

        def send(lease: int) -> tuple[tuple[Record, Record | None], int]:
            put = {"key": _enc(key), "value": _enc(value), "prev_kv": True, "lease": str(lease)}
            body = {"success": [{"request_put": put}, {"request_range": {"key": _enc(other)}}]}
            # Unconditional: it may simply be sent again.
            data = self._request("write", key, "/v3/kv/txn", body)
            revision = _revision(data)
            responses = (data.get("responses") or []) + [{}, {}]
            prev = (responses[0].get("response_put") or {}).get("prev_kv") or {}
            written = Record(key, value, revision, int(prev.get("create_revision") or revision))
            kvs = (responses[1].get("response_range") or {}).get("kvs") or []
            return (written, _record(kvs[0]) if kvs else None), revision

        return self._leased(ttl, True, send, key)

    def delete(self, key: str) -> bool:
        self._own(key, None)  # its lease, if it had one of its own, now holds nothing
        data = self._request("delete", key, "/v3/kv/deleterange", {"key": _enc(key)})
        return int(data.get("deleted") or 0) > 0

    def delete_prefix(self, prefix: str) -> None:
        body = {
            "success": [
                {"request_delete_range": {"key": _enc(prefix)}},
                {"request_delete_range": _under(prefix)},
            ]
        }
        self._request("delete", prefix, "/v3/kv/txn", body)

    def refresh(self, key: str, ttl: int) -> bool:
        """Keep the lease of ``key`` alive (whatever TTL it was granted with).

        A key without a lease is attached to the clean-up lease of ``ttl`` (that write
        is a new revision of the key, unlike a keep-alive). ``False`` if the key or its
        lease is gone.
        """
        data = self._request("refresh", key, "/v3/kv/range", {"key": _enc(key)})
        kvs = data.get("kvs") or []
        if not kvs:
            return False
        lease_id = int(kvs[0].get("lease") or 0)
        if lease_id:
            sent = time.monotonic()
            if self._keepalive(lease_id) <= 0:
                return False
            for lease in list(self._leases.values()):
                if lease.id == lease_id:
                    lease.renewed = sent
            return True
        revision = str(kvs[0].get("mod_revision"))

        def send(lease: int) -> bool:
            compare = {
                "key": _enc(key),
                "target": "MOD",
                "result": "EQUAL",
                "mod_revision": revision,
            }
            put = {"key": _enc(key), "ignore_value": True, "lease": str(lease)}
            body = {"compare": [compare], "success": [{"request_put": put}]}
            # Repeatable: the compare fails if the first try landed, and the key then
            # exists with the lease, which is what was asked.
            return bool(self._request("refresh", key, "/v3/kv/txn", body).get("succeeded"))

        if self._leased(ttl, False, send):
            return True
        record, _ = self.get(key)
        return record is not None

    def watch(
        self, key: str, from_revision: int, timeout: float | None, *, prefix: bool = False
    ) -> Event | None:
        events = self.watch_events(key, from_revision, timeout, prefix=prefix)
        return events[0] if events else None

    def watch_events(
        self, key: str, from_revision: int, timeout: float | None, *, prefix: bool = False
    ) -> list[Event]:
        """Every event of the first answer that has any (etcd sends the changes of a
        revision range together), each with ``current`` set to the store revision of
        that answer; ``[]`` when ``timeout`` passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        create: dict[str, Any] = _under(key) if prefix else {"key": _enc(key)}
        if from_revision > 0:
            create["start_revision"] = str(from_revision)
        body = {"create_request": create}
        while True:
            # Each request is capped at read_timeout so a frozen member cannot hold a
            # watch forever; the loop carries on to the caller's deadline.
            step = self._read_timeout
            if deadline is not None:
                step = min(step, deadline - time.monotonic())
                if step <= 0:
                    return []
            until = time.monotonic() + step

            def fn(index: int, timeout: float, until: float = until) -> list[Event]:
                return self._watch_once(index, key, body, from_revision, timeout, until)

            events = self._call("watch", key, fn, idempotent=True)
            if events:
                return events

    def _watch_once(
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
        headers, token = self._headers(index, timeout, True)
        resp = self._pool.request(
            "POST",
            self._urls[index] + "/v3/watch",
            body=json.dumps(body).encode("utf-8"),
            headers=headers,
            timeout=urllib3.Timeout(connect=timeout, read=timeout),
            retries=False,
            preload_content=False,
        )
        created = False
        try:
            if resp.status != 200:
                self._decode(index, resp.status, resp.read(), token)  # raises
            for message in _messages(resp):
                result = self._watch_result(index, message, token, key, from_revision)
                events = _events(result, from_revision)
                if events:
                    return events
                if result.get("created"):
                    created = True
                remaining = until - time.monotonic()
                if remaining <= 0:
                    return []
                _set_read_timeout(resp, remaining)
            raise u3exc.ProtocolError(f"the watch stream of {key!r} ended without an event")
        except u3exc.ReadTimeoutError:
            if created:
                return []  # a quiet key: no event in this window
            raise
        finally:
            resp.close()
            resp.release_conn()

    def _watch_result(
        self, index: int, message: dict[str, Any], token: str | None, key: str, start: int
    ) -> dict[str, Any]:
        """The ``result`` of one watch stream message.

        Raises:
            _EtcdError: etcd reported an error, or cancelled the watch.
            WatchCompacted: the history from ``start`` is gone.
        """
        if "error" in message:
            self._decode(index, 500, json.dumps(message).encode(), token)  # raises
        result: dict[str, Any] = message.get("result") or {}
        self._check_cluster(index, result)
        compacted = int(result.get("compact_revision") or 0)
        if compacted:
            raise WatchCompacted(f"{key}: history from {start} is gone (compacted at {compacted})")
        if result.get("canceled"):
            raise _cancel_error(result, token)
        return result

    def _open_watch(self, key: str, prefix: bool, start: int) -> _Opened:
        """Open a watch stream from revision ``start`` (0: from now) and wait until
        etcd confirms it; fails over like any request."""
        create: dict[str, Any] = _under(key) if prefix else {"key": _enc(key)}
        if start > 0:
            create["start_revision"] = str(start)
        body = json.dumps({"create_request": create}).encode("utf-8")

        def fn(index: int, timeout: float) -> _Opened:
            headers, token = self._headers(index, timeout, True)
            resp = self._pool.request(
                "POST",
                self._urls[index] + "/v3/watch",
                body=body,
                headers=headers,
                timeout=urllib3.Timeout(connect=timeout, read=timeout),
                retries=False,
                preload_content=False,
            )
            try:
                if resp.status != 200:
                    self._decode(index, resp.status, resp.read(), token)  # raises
                messages = _messages(resp)
                for message in messages:
                    result = self._watch_result(index, message, token, key, start)
                    if result.get("created"):
                        # From here silence is a quiet key, up to read_timeout.
                        _set_read_timeout(resp, self._read_timeout)
                        return _Opened(resp, messages, index, token, _revision(result))
                raise u3exc.ProtocolError(f"the watch stream of {key!r} ended unconfirmed")
            except BaseException:
                _drop(resp)
                raise

        return self._call("watch", key, fn, idempotent=True)

    def watcher(self, key: str, *, prefix: bool = False) -> Watcher:
        """A watcher that keeps one watch stream open (see :class:`_StreamWatcher`)."""
        return _StreamWatcher(self, key, prefix)

    def probe(self, key: str = "/") -> None:
        deadline = time.monotonic() + self._read_timeout
        # Below the key, not the key itself: etcd users are usually granted a prefix
        # ("/etcd_rdzv/"), which is all the other operations touch.
        body = {**_under(key), "count_only": True, "limit": "1"}
        self._request("probe read", key, "/v3/kv/range", body, deadline=deadline)

    def close(self) -> None:
        """Revoke the owned leases (their keys vanish now), then drop connections.

        Clean-up leases are left to expire: they hold state other nodes still use.
        """
        if self._closed:
            return
        deadline = time.monotonic() + self._read_timeout
        with self._lease_lock:
            owned = sorted(set(self._owned.values()))
            self._owned.clear()
            self._leases.clear()
        for lease_id in owned:
            try:
                self._request(
                    "lease revoke",
                    f"lease {lease_id:x}",
                    "/v3/lease/revoke",
                    {"ID": str(lease_id)},
                    deadline=deadline,
                )
            except _LeaseGone:
                pass
            except RendezvousConnectionError as exc:
                log.warning("could not revoke lease %x (it expires by itself): %s", lease_id, exc)
        for stream in list(self._streams):
            stream.stop()
        self._closed = True
        self._pool.clear()

    # -- the other keyspace -----------------------------------------------------------

    def has_keys_under(self, directory: str) -> bool:
        """Whether any key lies below ``directory`` (one count-only read)."""
        body = {**_under(directory), "count_only": True, "limit": "1"}
        data = self._request("list", directory, "/v3/kv/range", body)
        return int(data.get("count") or 0) > 0

    def v2_has_keys_under(self, directory: str) -> bool | None:
        """Whether etcd's v2 keyspace holds a key below ``directory``; ``None`` when
        that cannot be told (no v2 API, no permission, no answer). One request to the
        current endpoint, never failed over: it is a check, not an operation."""
        url = self._urls[self._current]
        headers: dict[str, str] = {}
        if self._username is not None:
            headers = urllib3.util.make_headers(basic_auth=f"{self._username}:{self._password}")
        path = urllib.parse.quote(directory, safe="/~._-")
        try:
            resp = self._pool.request(
                "GET",
                f"{url}/v2/keys{path}?recursive=true",
                headers=headers,
                timeout=urllib3.Timeout(total=self._read_timeout),
                retries=False,
            )
            if resp.status != 200:
                return False if resp.status == 404 and b'"errorCode"' in resp.data else None
            node = json.loads(resp.data).get("node") or {}
        except (u3exc.HTTPError, http.client.HTTPException, OSError, ValueError) as exc:
            log.debug("could not read the v2 keyspace at %s: %s", url, exc)
            return None
        return _has_leaf(node)


@dataclass
class _Opened:
    """A confirmed watch stream: its response, its message iterator, the endpoint
    index and auth token it was opened with, and the store revision at creation."""

    resp: urllib3.BaseHTTPResponse
    messages: Iterator[dict[str, Any]]
    index: int
    token: str | None
    created: int


def _drop(resp: urllib3.BaseHTTPResponse) -> None:
    """Close a streamed answer's connection (it cannot be reused mid-stream)."""
    resp.close()
    resp.release_conn()


class _Stream:
    """One watch stream and the thread that reads it into :attr:`queue`.

    The thread puts each batch of events (one revision or more) on the queue, or the
    error that ended it (:class:`WatchCompacted`, or RendezvousConnectionError once
    no endpoint would open the stream again). A stream that breaks, or stays silent
    for ``read_timeout`` (a quiet key, or a frozen member: a new stream tells them
    apart, as etcd must confirm it), is opened again from the revision after the last
    event, on the next endpoint if need be.
    """

    def __init__(self, kv: V3KV, key: str, prefix: bool, start: int) -> None:
        self._kv, self._key, self._prefix = kv, key, prefix
        self.queue: queue.SimpleQueue[list[Event] | BaseException] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        opened = kv._open_watch(key, prefix, start)
        #: The store revision when etcd confirmed the stream.
        self.created = opened.created
        self._resp: urllib3.BaseHTTPResponse | None = opened.resp
        position = opened.created if start == 0 else start - 1
        kv._streams.add(self)
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
                    result = self._kv._watch_result(
                        opened.index, message, opened.token, self._key, position + 1
                    )
                    events = _events(result, position + 1)
                    if events:
                        position = max(e.record.revision for e in events)
                        self.queue.put(events)
                        quick_failures = 0
                raise u3exc.ProtocolError(f"the watch stream of {self._key!r} ended")
            except WatchCompacted as exc:
                self.queue.put(exc)
                return
            except Exception as exc:  # broke or went silent: open it again
                if self._stopped.is_set():
                    return
                log.debug("watch stream of %s: %s; opening it again", self._key, _describe(exc))
            finally:
                _drop(opened.resp)
            if time.monotonic() - opened_at < 0.1:
                quick_failures += 1  # no hot loop on a stream that keeps ending at once
                self._stopped.wait(min(0.05 * 2**quick_failures, 1.0))
            if self._stopped.is_set():
                return
            try:
                opened = self._kv._open_watch(self._key, self._prefix, position + 1)
            except BaseException as exc:
                self.queue.put(exc)
                return
            with self._lock:
                self._resp = opened.resp
                if self._stopped.is_set():
                    _drop(opened.resp)
                    return

    def stop(self) -> None:
        """Stop the thread: its blocked read ends when the socket is shut down."""
        self._stopped.set()
        with self._lock:
            resp, self._resp = self._resp, None
        if resp is not None:
            conn = getattr(resp, "connection", None) or getattr(resp, "_connection", None)
            sock = getattr(conn, "sock", None)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


class _StreamWatcher(Watcher):
    """:class:`~etcd_rdzv._kv.Watcher` over one open watch stream.

    :meth:`reread` opens the stream from *now* and then reads, so the stream is in
    sync at once (etcd holds back a watch that starts in the past until its sync loop
    catches it up, every 100 ms) and the read, being linearizable, is at or after the
    stream's start: events up to the read's revision are skipped.
    """

    polls = False

    def __init__(self, kv: V3KV, key: str, prefix: bool) -> None:
        super().__init__(kv, key, prefix)
        self._v3 = kv
        self._stream: _Stream | None = None

    def _stop_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.stop()

    def reread(self, read: Callable[[], tuple[T, int]]) -> tuple[T, int]:
        self._stop_stream()
        stream = _Stream(self._v3, self.key, self.prefix, 0)
        self._stream = stream
        try:
            result, revision = read()
        except BaseException:
            self._stop_stream()
            raise
        if revision < stream.created:  # an older state than the stream starts after
            self._stop_stream()
            self._stream = _Stream(self._v3, self.key, self.prefix, revision + 1)
        self.after = revision
        return result, revision

    def next(self, timeout: float | None) -> list[Event]:
        if self._stream is None:
            self._stream = _Stream(self._v3, self.key, self.prefix, self.after + 1)
        stream = self._stream
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                return []
            try:
                item = stream.queue.get(timeout=wait)
            except queue.Empty:
                return []
            if isinstance(item, BaseException):
                self._stop_stream()  # the next call opens a new one
                raise item
            events = [e for e in item if e.record.revision > self.after]
            if events:
                self.after = max(e.record.revision for e in events)
                return events

    def close(self) -> None:
        self._stop_stream()


def _events(result: dict[str, Any], from_revision: int) -> list[Event]:
    """The events of one watch answer at or after ``from_revision``."""
    current = _revision(result)
    events = []
    for event in result.get("events") or []:
        kv = event.get("kv") or {}
        revision = int(kv.get("mod_revision") or 0)
        if revision < from_revision:
            continue
        if event.get("type") == "DELETE":
            events.append(Event("delete", Record(_dec(kv.get("key")), "", revision), current))
        else:
            events.append(Event("put", _record(kv), current))
    return events


def _has_leaf(node: dict[str, Any]) -> bool:
    if not node.get("dir"):
        return True
    return any(_has_leaf(child) for child in node.get("nodes") or [])


def _cancel_error(result: dict[str, Any], token: str | None) -> _EtcdError:
    """The error of a watch etcd cancelled (``cancel_reason`` is a gRPC status text:
    ``rpc error: code = PermissionDenied desc = etcdserver: permission denied``)."""
    reason = str(result.get("cancel_reason") or "the watch was cancelled")
    code = 0
    if "code = " in reason:
        name = reason.split("code = ", 1)[1].split(" ", 1)[0]
        code = _CODE_NAMES.get(name, 0)
    message = reason.split("desc = ", 1)[1] if "desc = " in reason else reason
    return _EtcdError(code, message, 200, token)


def _messages(resp: urllib3.BaseHTTPResponse) -> Iterator[dict[str, Any]]:
    """The JSON objects of a streamed answer, one per line, as they arrive."""
    buffer = b""
    for chunk in resp.stream(65536):
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield _json_line(line)
    if buffer.strip():
        yield _json_line(buffer)


def _json_line(line: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        # Not etcd talking (a proxy?), or a cut stream: a failed request, not an answer.
        raise u3exc.ProtocolError(f"unexpected line in a watch stream: {line[:200]!r}")
    return obj


def _set_read_timeout(resp: urllib3.BaseHTTPResponse, seconds: float) -> None:
    """Bound the next reads of a streamed answer by ``seconds`` (the watch's own
    deadline, shorter than the ``read_timeout`` its first answer had)."""
    conn = getattr(resp, "connection", None) or getattr(resp, "_connection", None)
    sock = getattr(conn, "sock", None)
    if sock is not None:
        sock.settimeout(max(seconds, 0.001))
