"""How the v3 client talks to etcd's JSON gateway: codecs, one POST and its answer
decoded, auth tokens, and how a failed request is judged for failover.

Keys and values travel base64-encoded, 64-bit integers as strings. Answers are
untrusted: :meth:`GatewayKV._decode` (and :class:`Messages`, for streams) is the one
place they are parsed, with :func:`~.._json.loads` (bounded nesting) and
:func:`~._shape.checked` (every field this client reads has the type etcd gives it), so the
code that reads them later meets no surprise; anything else is a
:class:`~.._http.BadResponse` naming the endpoint, which the failover loop treats as a
lost answer. Errors come back as JSON with a gRPC status code, read from ``code`` and
``message`` (etcd 3.6 dropped the top-level ``error`` of unary answers; streams send
``{"error": {"code", "message"}}``); :class:`EtcdError` carries them until
:meth:`GatewayKV._classify` turns them into a retry, a failover or one of our errors.
With a username, a token from ``/v3/auth/authenticate`` goes in the
``Authorization`` header; an expired token is replaced once and the request sent
again. Requests go over :mod:`._http`, which never retries by itself.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import threading
import time
from typing import Any

from ...errors import RendezvousConnectionError
from .._base import Record
from .._failover import FailoverKV, Failure, Verdict, clip, describe, hold, not_sent
from .._http import BadResponse, Response, Transport
from .._json import loads
from .._stall import SETTLE, Stalled, Terms, number
from ._shape import checked

__all__ = [
    "EtcdError",
    "GatewayKV",
    "LeaseGone",
    "Messages",
    "cancel_error",
    "dec",
    "enc",
    "header_revision",
    "prefix_range",
    "record",
    "under",
]

log = logging.getLogger(__name__)

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

# -- codecs ----------------------------------------------------------------------------


def enc(text: str) -> str:
    """``text`` as the gateway takes keys and values: base64 of its UTF-8."""
    return base64.b64encode(text.encode("utf-8")).decode("ascii")


def dec(data: str | None) -> str:
    """A key or value as the gateway sends it, as text."""
    # Keys and values we write are UTF-8; anything else was written by someone else.
    return base64.b64decode(data or "").decode("utf-8", "replace")


def _range_end(prefix: str) -> str:
    """The end of the key range holding every key that starts with ``prefix``."""
    raw = bytearray(prefix.encode("utf-8"))
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return enc("\0")  # every key from the start
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode("ascii")


def prefix_range(prefix: str) -> dict[str, str]:
    """The range of every key whose name starts with ``prefix``."""
    return {"key": enc(prefix), "range_end": _range_end(prefix)}


def under(directory: str) -> dict[str, str]:
    """The range of every key below the directory ``directory`` (``directory/...``)."""
    return {"key": enc(directory + "/"), "range_end": _range_end(directory + "/")}


def record(kv: dict[str, Any]) -> Record:
    """A ``kv`` of a range or watch answer as a :class:`Record`."""
    return Record(
        dec(kv.get("key")),
        dec(kv.get("value")),
        int(kv.get("mod_revision") or 0),
        int(kv.get("create_revision") or 0),
    )


def header_revision(data: dict[str, Any]) -> int:
    """The store revision in an answer's header (0 if none)."""
    return int((data.get("header") or {}).get("revision") or 0)


def _code(value: Any) -> int:
    """An error code as etcd sent it, 0 if it is not a number (never ValueError: the
    callers above treat that as "request too large")."""
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


# -- errors ----------------------------------------------------------------------------


class LeaseGone(Exception):
    """etcd answered "requested lease not found": the lease expired or was revoked."""


class EtcdError(Exception):
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
    def overload(self) -> bool:
        """etcd gave up on the request itself (its request timeout) or refused it as
        too many: a member that is behind, not an election."""
        text = self.message.lower()
        timed_out = "request timed out" in text and "leader" not in text  # not an election's
        return timed_out or "too many requests" in text

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
    def lease_exists(self) -> bool:
        """A grant of a lease id that etcd already holds."""
        return self.code == _FAILED_PRECONDITION and "lease already exists" in self.message

    @property
    def too_large(self) -> bool:
        """etcd's --max-request-bytes ("request is too large") or gRPC's message size
        limit ("larger than max"): no endpoint would take this request."""
        return "request is too large" in self.message or "larger than max" in self.message


def cancel_error(result: dict[str, Any], token: str | None) -> EtcdError:
    """The error of a watch etcd cancelled (``cancel_reason`` is a gRPC status text:
    ``rpc error: code = PermissionDenied desc = etcdserver: permission denied``)."""
    reason = str(result.get("cancel_reason") or "the watch was cancelled")
    code = 0
    if "code = " in reason:
        name = reason.split("code = ", 1)[1].split(" ", 1)[0]
        code = _CODE_NAMES.get(name, 0)
    message = reason.split("desc = ", 1)[1] if "desc = " in reason else reason
    return EtcdError(code, message, 200, token)


# -- streamed answers ------------------------------------------------------------------


class Messages:
    """The JSON objects of a streamed answer, one per line, read as they arrive.

    A read that fails with TimeoutError (the response's :meth:`~._http.Response.read_by`
    deadline) loses nothing: the next :meth:`next` goes on where it stopped.
    """

    def __init__(self, resp: Response) -> None:
        self.resp = resp
        self._where = resp.where
        self._max = resp.max_bytes  # the most one message may hold
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer known to hold no newline

    def next(self) -> dict[str, Any] | None:
        """The next object; ``None`` once the answer ended."""
        buffer = self._buffer
        while True:
            end = buffer.find(b"\n", self._scanned)
            if end >= 0:
                line = bytes(buffer[:end])
                del buffer[: end + 1]
                self._scanned = 0
                if line.strip():
                    return self._message(line)
                continue
            self._scanned = len(buffer)
            if len(buffer) > self._max:
                raise BadResponse(
                    f"{self._where} sent a stream message over {self._max} bytes (the most "
                    "this client reads)"
                )
            data = self.resp.read_some()
            if not data:
                if not buffer.strip():
                    return None
                line = bytes(buffer)
                buffer.clear()
                self._scanned = 0
                return self._message(line)
            buffer += data

    def _message(self, line: bytes) -> dict[str, Any]:
        obj = loads(line, self._where)
        if not isinstance(obj, dict):
            # Not etcd talking (a proxy?), or a cut stream: a failed request, not an answer.
            raise BadResponse(f"{self._where} sent an unexpected stream line: {line[:200]!r}")
        return checked(obj, self._where)


# -- requests --------------------------------------------------------------------------


class GatewayKV(FailoverKV):
    """The requests of the v3 client: one POST to one endpoint, decoded, with its
    auth token; failover from :class:`~etcd_rdzv._kv._failover.FailoverKV`.

    Args:
        urls: the base URL of each endpoint, preferred first.
        read_timeout: seconds one request may take.
        username, password: etcd credentials (v3 auth), both or neither.
        transport: the connections the requests go over, TLS settings and answer
            bound included (default: new ones, the system's trust store for ``https``).
        key_prefix: the key prefix of the keys this client touches, if one: a request
            refused for want of a permission names it (what the role must cover).
    """

    # A member without a leader (partitioned, stopping) may stay so: ask the next one,
    # which may see the majority.
    _transient_moves_on = True

    def __init__(
        self,
        urls: list[str],
        read_timeout: float,
        username: str | None = None,
        password: str | None = None,
        transport: Transport | None = None,
        key_prefix: str | None = None,
    ) -> None:
        if not urls:
            raise ValueError("V3KV needs at least one endpoint URL.")
        if (username is None) != (password is None):
            raise ValueError("V3KV needs both a username and a password, or neither.")
        super().__init__(urls, read_timeout)
        self._transport = Transport() if transport is None else transport
        self._username = username
        self._password = password
        self._key_prefix = key_prefix
        # None: not authenticated yet; "": etcd has auth off, send no token.
        self._token: str | None = None
        self._auth_lock = threading.Lock()
        self._cluster_id: str | None = None
        # Requests stuck behind a dead leader or a frozen member.
        self._terms = Terms(self._status_term, self._urls)

    @property
    def answer_time(self) -> float:
        return self._terms.answer_time

    # -- one HTTP request -------------------------------------------------------------

    def _headers(self, index: int, timeout: float, auth: bool) -> tuple[dict[str, str], str | None]:
        """The headers of a request to endpoint ``index`` and the token among them
        (authenticating first if there is none yet)."""
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
            EtcdError: etcd answered with an error.
            ConnectFailed: the request was never sent.
            OSError, http.client.HTTPException: the request or its answer was lost.
        """
        headers, token = self._headers(index, timeout, auth)
        url, terms = self._urls[index], self._terms
        sent = time.monotonic()
        # The token request may have used up part of the bounded scope's time.
        timeout = clip(timeout)
        resp, data = self._transport.request(
            url,
            path,
            json.dumps(body).encode("utf-8"),
            headers,
            timeout,
            check=terms.checker(url, headers, path, sent + timeout),
            check_every=SETTLE,  # the check says when to look next
        )
        took = time.monotonic() - sent
        try:
            return self._decode(index, resp.status, data or b"", token)  # notes its term
        finally:
            terms.took(took)

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
        """:meth:`_post` with failover: ``what`` of ``key`` names it in messages."""

        def fn(index: int, timeout: float) -> dict[str, Any]:
            return self._post(index, path, body, timeout)

        return self._call(what, key, fn, idempotent=idempotent, deadline=deadline)

    def _decode(self, index: int, status: int, data: bytes, token: str | None) -> dict[str, Any]:
        """The JSON object of an answer from endpoint ``index``, checked (see
        :func:`~._shape.checked`).

        Raises:
            EtcdError: etcd answered with an error.
            BadResponse: not etcd's answer (malformed, or a proxy's 5xx).
            RendezvousConnectionError: no v3 API there, or another cluster.
        """
        where = self._urls[index]
        # Streamed answers (lease keep-alive) are one JSON object per line.
        first = data.strip().split(b"\n", 1)[0]
        try:
            obj = loads(first, where) if first else {}
        except BadResponse as exc:
            if status == 200 or status >= 500:
                raise BadResponse(f"HTTP {status}: {exc}") from None
            obj = None
        if not isinstance(obj, dict):
            if status == 404:
                raise RendezvousConnectionError(
                    f"etcd at {where} does not serve the v3 API under /v3/ (HTTP 404): is "
                    "this etcd's client port (2379 by default), of etcd 3.4 or newer?"
                )
            if status == 200 or status >= 500:  # a proxy or a dying member: try another
                raise BadResponse(
                    f"{where} answered HTTP {status} that is not etcd's: {first[:200]!r}"
                )
            raise EtcdError(0, f"HTTP {status}: {first[:200]!r}", status, token)
        checked(obj, where)
        result = obj.get("result")
        if isinstance(result, dict):
            obj = result
        error = obj.get("error")
        if status != 200 or error:
            # etcd >= 3.6 sends {"code", "message"} (no "error") in unary answers, and
            # {"error": {"code", "message"}} in streams.
            body = error if isinstance(error, dict) else obj
            code = _code(body.get("code") or body.get("grpc_code"))
            message = body.get("message") or (error if isinstance(error, str) else "")
            if not message and not code and status >= 500:  # JSON, but not etcd's error
                raise BadResponse(
                    f"{where} answered HTTP {status} that is not etcd's: {first[:200]!r}"
                )
            raise EtcdError(code, str(message or f"HTTP {status}"), status, token)
        self._check_cluster(index, obj)
        return obj

    def _check_cluster(self, index: int, obj: dict[str, Any]) -> None:
        header = obj.get("header") or {}
        if isinstance(header, dict):
            self._terms.note(number(header.get("raft_term")))
        cluster = header.get("cluster_id")
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

    def _status_term(self, url: str, headers: dict[str, str], timeout: float) -> int:
        """The raft term of the member at ``url`` if it has a leader, else 0: from its
        status (``/v3/maintenance/status``, answered without the leader)."""
        _resp, data = self._transport.request(
            url, "/v3/maintenance/status", b"{}", headers, timeout
        )
        obj = loads(data or b"", url)
        # Only the header and the leader are read (a status answer's other fields are
        # not a key-value answer's).
        header = obj.get("header") if isinstance(obj, dict) else None
        if not isinstance(header, dict):
            return 0
        checked(header, url)
        return number(header.get("raft_term")) if number(obj.get("leader")) else 0

    # -- authentication ---------------------------------------------------------------

    def _token_for(self, index: int, timeout: float) -> str | None:
        if self._username is None:
            return None
        # Another thread may be authenticating (against a frozen member, say): inside a
        # bounded scope, wait for it only until the deadline.
        with hold(self._auth_lock):
            if self._token is None:
                try:
                    data = self._post(
                        index,
                        "/v3/auth/authenticate",
                        {"name": self._username, "password": self._password},
                        timeout,
                        auth=False,
                    )
                except EtcdError as exc:
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

    def _forget_token(self, token: str | None, what: str, key: str) -> None:
        """Drop ``token`` (rejected by etcd) so the next request authenticates again;
        a token another thread has already replaced is left alone."""
        with hold(self._auth_lock, lambda: self._deadline_passed(what, key)):
            if self._token == (token or ""):
                self._token = None

    def _refused(self, url: str, what: str, key: str, exc: EtcdError) -> RendezvousConnectionError:
        text = exc.message.lower()
        if self._username is None:
            return RendezvousConnectionError(
                f"etcd at {url} refused {what} of {key!r} for anonymous access: etcd requires "
                f"authentication or a permission is missing; set 'username' and 'password' "
                f"({exc.message})."
            )
        if "authentication failed" in text:
            reason = "wrong username or password"
        elif exc.code == _PERMISSION_DENIED or "permission denied" in text:
            # Refused after a fresh token (see _classify): etcd took the user and
            # password, so what it lacks is a permission on the key.
            prefix = self._key_prefix
            if prefix is None or not (key == prefix or key.startswith(prefix + "/")):
                prefix = key  # not under the prefix: the key itself is what to grant
            if key == prefix:
                where = f"the keys under {prefix}/" if what == "probe read" else repr(key)
            else:
                where = f"{key!r}, under the key prefix {prefix}/"
            return RendezvousConnectionError(
                f"etcd at {url} refused {what} of {key!r} for user {self._username!r}: its "
                f"password is right, but the user has no permission on {where} "
                f"({exc.message}). Set 'key_prefix' (--key-prefix) to the prefix its role "
                "may read and write, or widen the role's key range (etcdctl role "
                f"grant-permission ROLE --prefix=true readwrite {prefix}/)."
            )
        else:
            reason = "wrong username or password, or no permission on that key"
        return RendezvousConnectionError(
            f"etcd at {url} refused {what} of {key!r} for user {self._username!r}: {reason} "
            f"({exc.message})."
        )

    # -- how failures are judged ------------------------------------------------------

    def _classify(
        self, exc: Exception, url: str, what: str, key: str, resent: bool
    ) -> Failure | None:
        if isinstance(exc, EtcdError):
            if exc.auth and self._username is not None and not resent:
                # An expired token (simple tokens expire when unused, JWTs at their
                # exp): authenticate once more and send the request again.
                log.info("etcd at %s: %s; authenticating again", url, exc.message)
                self._forget_token(exc.token, what, key)
                return Failure(Verdict.AGAIN, exc.message)
            if exc.auth or "authentication failed" in exc.message:
                raise self._refused(url, what, key, exc) from exc
            if exc.lease_gone:
                raise LeaseGone(exc.message) from exc
            if exc.too_large:  # bad input, not a connection problem
                raise ValueError(
                    f"etcd at {url} refused {what} of {key!r}: the request is too large "
                    f"({exc.message}); etcd takes requests up to its --max-request-bytes "
                    "(1.5 MiB by default), and v3 values travel base64-encoded."
                ) from exc
            if exc.transient:
                return Failure(Verdict.TRANSIENT, exc.message, overload=exc.overload)
            raise RendezvousConnectionError(
                f"etcd at {url} failed {what} of {key!r}: {exc.message}"
            ) from exc
        if isinstance(exc, Stalled):  # stuck behind a dead leader: send it again
            return Failure(Verdict.TRANSIENT, str(exc))
        if isinstance(exc, (http.client.HTTPException, OSError)):
            return Failure(Verdict.NOT_SENT if not_sent(exc) else Verdict.LOST, describe(exc))
        return None
