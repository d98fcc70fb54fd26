"""Lease keep-alives over one gRPC stream per client, instead of a gateway request each.

A keep-alive through etcd's JSON gateway is an HTTP/1.1 request that etcd turns into
a gRPC stream of its own, opened and closed for that one message: about 0.6 ms of
etcd's CPU per beat on a 3-member cluster, measured (``docs/api.md``). etcd serves gRPC on the same
client port, and its ``Lease/LeaseKeepAlive`` call is a stream that takes any
number of renewals: :class:`KeepAliveStream` keeps one open (on one HTTP/2
connection, :mod:`._h2`) and sends each renewal on it as one small protobuf message
(``LeaseKeepAliveRequest{ID}``); etcd answers ``LeaseKeepAliveResponse{header, ID,
TTL}``, with TTL 0 for a lease it does not know (gone). The gateway itself cannot hold
such a stream: over HTTP/1.1 it reads the whole request before it answers.

The stream is opened on the endpoint of etcd's leader when that is one of the
client's endpoints and the cluster answers the client promptly (a follower forwards
each keep-alive to the leader, at a cost to both; a loaded cluster is left alone:
:meth:`KeepAliveStream._leader`), else on the endpoint the failover loop picked,
with the client's auth token (the ``token`` metadata of etcd's gRPC), and again when
it moves, the token changes, or anything went wrong with it (a renewal not answered in
time cancels its stream, whose late answer is then dropped, and keeps the connection;
any other failure closes the connection: nothing stale is read as a later answer). An endpoint that
does not speak HTTP/2 (a plain HTTP proxy in front of etcd, TLS without ALPN ``h2``)
or not gRPC is renewed through the gateway instead, and the stream is tried there
again :data:`RETRY_STREAM` seconds later; which one is used is logged at INFO.

Answers are untrusted: a gRPC message may be at most :data:`MAX_MESSAGE` bytes,
uncompressed, and its protobuf is parsed strictly (known wire types, bounded varints,
lengths within the message); a header is checked like a gateway answer's (cluster id)
and its raft term goes to the stall check (:class:`~._stall.Terms`). A gRPC error
status becomes the :class:`~._wire.EtcdError` the gateway's error would have been,
so that the failover loop judges it the same way.
"""

from __future__ import annotations

import http.client
import logging
import random
import threading
import time
from typing import Any
from urllib.parse import unquote, urlsplit

from .._answer import BadResponse
from .._failover import hold
from .._json import loads
from .._stall import SETTLE, number
from ._h2 import H2Connection, NotH2, Stream
from ._shape import checked
from ._wire import EtcdError, GatewayKV

__all__ = [
    "MAX_MESSAGE",
    "RESOLVE_EVERY",
    "RETRY_STREAM",
    "KeepAliveStream",
    "decode_answer",
    "encode_request",
]

log = logging.getLogger(__name__)

#: The most bytes one gRPC message of the stream may hold (an answer is under 100).
MAX_MESSAGE = 4096
#: Seconds after which an endpoint found without HTTP/2 or gRPC is tried again.
RETRY_STREAM = 300.0
#: Seconds after which the leader's endpoint is looked for again, if it was not
#: found or not reached (an election looks for it at once).
RESOLVE_EVERY = 30.0
#: Seconds (from, to) before a client first looks for the leader: drawn at random.
FIRST_LOOK = (5.0, 30.0)
#: Seconds (from, to) after a client saw an election before it looks for the new
#: leader: drawn at random. Meanwhile renewals go where they went (a member that is
#: no longer the leader forwards them).
AFTER_ELECTION = (2.0, 15.0)
_PATH = "/etcdserverpb.Lease/LeaseKeepAlive"
_OK = 0
_MAX_VARINT = 10


# -- protobuf ----------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    value &= 2**64 - 1  # int64: two's complement
    out = bytearray()
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_request(lease: int) -> bytes:
    """``LeaseKeepAliveRequest{ID: lease}`` as one gRPC message (length-prefixed)."""
    message = b"\x08" + _varint(lease)
    return b"\x00" + len(message).to_bytes(4, "big") + message


class _Reader:
    """The fields of one protobuf message: (number, wire type, value)."""

    def __init__(self, data: bytes, where: str) -> None:
        self.data, self.pos, self.where = data, 0, where

    def bad(self, what: str) -> BadResponse:
        return BadResponse(f"{self.where} sent a keep-alive answer that is not protobuf: {what}")

    def varint(self) -> int:
        value = shift = 0
        for _ in range(_MAX_VARINT):
            if self.pos >= len(self.data):
                raise self.bad("it ends inside a varint")
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 127) << shift
            shift += 7
            if not byte & 128:
                return value & (2**64 - 1)
        raise self.bad("a varint longer than 10 bytes")

    def fields(self) -> list[tuple[int, int, Any]]:
        found: list[tuple[int, int, Any]] = []
        while self.pos < len(self.data):
            key = self.varint()
            number, wire = key >> 3, key & 7
            if not number:
                raise self.bad("field number 0")
            if wire == 0:
                value: Any = self.varint()
            elif wire in (1, 5):
                size = 8 if wire == 1 else 4
                if self.pos + size > len(self.data):
                    raise self.bad("it ends inside a fixed-size field")
                value = int.from_bytes(self.data[self.pos : self.pos + size], "little")
                self.pos += size
            elif wire == 2:
                size = self.varint()
                if size > len(self.data) - self.pos:
                    raise self.bad("a field runs past the message")
                value = self.data[self.pos : self.pos + size]
                self.pos += size
            else:
                raise self.bad(f"wire type {wire}")
            found.append((number, wire, value))
        return found


def _id(value: object) -> int:
    """A member id as the gateway sends it (decimal text); 0 if it is not one."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20:
        return int(value)
    return 0


def _int64(value: int) -> int:
    return value - 2**64 if value >= 2**63 else value


def decode_answer(message: bytes, where: str) -> tuple[dict[str, int], int, int]:
    """``LeaseKeepAliveResponse`` -> (its header as the gateway names the fields, lease
    id, TTL). Unknown fields are skipped; a known one of the wrong wire type is an
    error.

    Raises:
        BadResponse: not such a message.
    """
    reader = _Reader(message, where)
    header: dict[str, int] = {}
    lease = ttl = 0
    for field, wire, value in reader.fields():
        if field == 1:
            if wire != 2:
                raise reader.bad("the header is not a message")
            names = {1: "cluster_id", 2: "member_id", 3: "revision", 4: "raft_term"}
            for inner, inner_wire, inner_value in _Reader(value, where).fields():
                if inner in names:
                    if inner_wire != 0:
                        raise reader.bad(f"header field {inner} is not a varint")
                    header[names[inner]] = inner_value
        elif field in (2, 3):
            if wire != 0:
                raise reader.bad(f"field {field} is not a varint")
            if field == 2:
                lease = _int64(value)
            else:
                ttl = _int64(value)
    return header, lease, ttl


# -- the stream --------------------------------------------------------------------------


class _UseGateway(Exception):
    """The endpoint answered, but it is no gRPC server: renew through the gateway."""


class KeepAliveStream:
    """The lease keep-alive stream of the client ``kv``. Thread-safe: one renewal at a
    time goes over it (a waiting caller holds it, until its bounded scope's deadline
    at most)."""

    def __init__(self, kv: GatewayKV) -> None:
        self._kv = kv
        self._lock = threading.Lock()
        self._conn: H2Connection | None = None
        self._stream: Stream | None = None
        self._url = ""  # of the connection
        self._token: str | None = None  # the stream was opened with
        self._gateway: dict[str, float] = {}  # url -> when to try the stream again
        self._said: dict[str, str] = {}  # url -> what was last logged for it
        self._closed = False
        self._leader_index: int | None = None  # the leader's endpoint, when known
        self._leader_term = 0  # the raft term known when it was looked for
        self._members: dict[int, int] = {}  # member id -> the index of its endpoint
        # The first look for the leader waits a random FIRST_LOOK seconds: the nodes of
        # a job start together, and their status requests (one per member each) would
        # come at once, inside the first round; until then renewals go where requests go.
        self._resolve_after = time.monotonic() + random.uniform(*FIRST_LOOK)
        self._leader_said = ""  # what was last logged about it
        self._relook_at: float | None = None  # when to look again after an election

    def _say(self, url: str, how: str, why: str = "") -> None:
        if self._said.get(url) != how:
            self._said[url] = how
            if how == "stream":
                log.info("lease keep-alives to %s go over one gRPC stream", url)
            else:
                log.info("lease keep-alives to %s go through the JSON gateway: %s", url, why)

    def renew(self, lease: int, index: int, timeout: float) -> int | None:
        """Renew ``lease`` within ``timeout`` seconds: on the leader's endpoint if it is
        one of the client's (see :meth:`_leader`), else on endpoint ``index``. Its TTL
        (0: gone), or ``None`` when endpoint ``index`` is renewed through the gateway
        (the caller sends that request).

        Raises:
            EtcdError: etcd ended the stream with an error status.
            ConnectFailed: no connection (never sent).
            OSError, http.client.HTTPException: the renewal or its answer was lost.
        """
        deadline = time.monotonic() + timeout
        headers, token = self._kv._headers(index, timeout, True)
        with hold(
            self._lock, lambda: self._kv._deadline_passed("lease keep-alive", f"lease {lease:x}")
        ):
            if self._closed:
                raise ConnectionError("the keep-alive stream is closed")
            leader = self._leader(index, headers, deadline)
            if leader != index:
                try:
                    ttl = self._renew_on(lease, leader, headers, token, deadline)
                except (OSError, http.client.HTTPException) as exc:
                    log.info(
                        "lease keep-alives: the leader's endpoint %s failed (%s); using %s",
                        self._kv._urls[leader],
                        exc,
                        self._kv._urls[index],
                    )
                    self._leader_index = None
                    self._resolve_after = time.monotonic() + RESOLVE_EVERY
                else:
                    if ttl is not None:
                        return ttl
                if time.monotonic() >= deadline:
                    raise TimeoutError("no time left for a keep-alive on the next endpoint")
            return self._renew_on(lease, index, headers, token, deadline)

    def _renew_on(
        self, lease: int, index: int, headers: dict[str, str], token: str | None, deadline: float
    ) -> int | None:
        url = self._kv._urls[index]
        if time.monotonic() < self._gateway.get(url, 0.0):
            return None
        stream = self._open(url, token, deadline)
        if stream is None:
            return None
        assert self._conn is not None
        conn = self._conn
        check = self._kv._terms.checker(url, headers, "lease keep-alive", deadline)
        sent = time.monotonic()
        try:
            conn.send(stream, encode_request(lease), deadline, check)
            while True:
                message = self._message(conn, stream, deadline, check)
                header, answered, ttl = decode_answer(message, url)
                if answered == lease:
                    break
                # Another lease's answer (from a renewal given up): not ours.
        except _UseGateway:
            self._drop()
            return None
        except TimeoutError:
            # No answer in time (a loaded etcd, a frozen member): the stream goes, and
            # the connection stays if it is whole (a read that ran out of time keeps
            # what it read), so the next renewal opens no connection. Under load,
            # 4,096 nodes whose renewals timed out each connected again on every try,
            # about 1,000 connections a second, and etcd never caught up (measured).
            if conn.closed:
                self._drop()
            else:
                self._drop_stream()
            raise
        except BaseException:
            self._drop()
            raise
        self._kv._check_cluster(index, {"header": header})  # notes its term first
        self._kv._terms.took(time.monotonic() - sent)
        return ttl

    # -- the leader's endpoint ----------------------------------------------------------

    def _leader(self, index: int, headers: dict[str, str], deadline: float) -> int:
        """The index of the endpoint of the cluster's leader, if one of the client's
        endpoints is it; else ``index``.

        A keep-alive that reaches a follower is forwarded to the leader, over an HTTP
        request between the members: measured on a 3-member cluster, 0.35 ms of etcd
        CPU per keep-alive in all, against 0.08 ms sent to the leader. So the stream
        goes to the leader. It is found by asking the members for their status (each
        names itself and its leader: no guess from URLs, which a member may advertise
        under other names), a random :data:`FIRST_LOOK` seconds after the stream was
        first opened, again a random :data:`AFTER_ELECTION` seconds after answers
        carried a newer raft term (an election), and :data:`RESOLVE_EVERY` seconds
        after the leader could not be found or reached; but only while the cluster
        answers this client promptly (:attr:`~.._stall.Terms.prompt`). A loaded
        cluster is not asked, and its clients' streams stay spread over the members:
        measured at 4,096 nodes on a 3-member cluster here, rounds whose streams
        moved to the leader saw 1-9 elections and 0.7-4.1 status requests per node
        (18.3-27.5 s, or no round); looking only while answers came promptly, 0-2
        elections and under 0.1 status requests per node from the looks (17.6-27.6 s).
        """
        urls = self._kv._urls
        term = self._kv._terms.term
        if len(urls) == 1:
            return index
        if not self._leader_term and time.monotonic() < self._resolve_after:
            return index  # not looked for yet: a random moment after the start (FIRST_LOOK)
        if term <= self._leader_term:  # no election since it was looked for
            if self._leader_index is not None:
                return self._leader_index
            if time.monotonic() < self._resolve_after:
                return index
        elif self._leader_term:
            # An election: every node of a job sees it at once, and thousands of status
            # requests and new connections then (measured: 5.8 status requests per node
            # in a 4,096-node round with ten elections) are load on a cluster that just
            # lost its leader, maybe for being busy. Look a random moment later.
            if self._relook_at is None:
                self._relook_at = time.monotonic() + random.uniform(*AFTER_ELECTION)
            if time.monotonic() < self._relook_at:
                return self._leader_index if self._leader_index is not None else index
        if not self._kv._terms.prompt:
            # The cluster answers this client late: a loaded one. A look then costs a
            # status request per member, and every client that finds the leader moves
            # its stream there, onto the member that must also keep raft going
            # (measured: 4,096 nodes whose streams went to the leader during their
            # round saw up to 9 elections). Renewals stay where they go; look later.
            later = time.monotonic() + random.uniform(*AFTER_ELECTION)
            if self._relook_at is not None:
                self._relook_at = later
            else:
                self._resolve_after = later
            return self._leader_index if self._leader_index is not None else index
        self._relook_at = None
        self._resolve_after = time.monotonic() + RESOLVE_EVERY
        self._leader_index = None
        order = [index] + [j for j in range(len(urls)) if j != index]
        leader = 0
        for j in order:
            status = self._status(j, headers, deadline)
            if status is None:
                continue
            member, named = status
            self._members[member] = j  # a member's id does not change: kept for later
            leader = leader or named
            if leader and member == leader:
                self._leader_index = j
                break
            if leader in self._members:
                # Named by the first answer, and an endpoint known from an earlier look:
                # after an election one request finds the new leader, not one per member.
                self._leader_index = self._members[leader]
                break
        self._leader_term = self._kv._terms.term
        found = self._leader_index
        said = (
            f"lease keep-alives go to etcd's leader at {urls[found]}"
            if found is not None
            else (
                "lease keep-alives: no endpoint of this client is etcd's leader now; they go to "
                "the endpoint requests go to"
            )
        )
        if said != self._leader_said:  # said when it changes
            self._leader_said = said
            log.info("%s", said)
        return index if found is None else found

    def _status(
        self, index: int, headers: dict[str, str], deadline: float
    ) -> tuple[int, int] | None:
        """(member id, its leader's id) of endpoint ``index``; ``None`` if it did not
        answer in a third of the time left, or answered something else."""
        url = self._kv._urls[index]
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            _resp, data = self._kv._transport.request(
                url, "/v3/maintenance/status", b"{}", headers, min(left / 3, 1.0)
            )
            obj = loads(data or b"", url)
            # Only the header and the leader are read (a status answer's other fields
            # are not a key-value answer's).
            header = obj.get("header") if isinstance(obj, dict) else None
            if not isinstance(header, dict):
                return None
            checked(header, url)
            assert isinstance(obj, dict)
            member, leader = _id(header.get("member_id")), _id(obj.get("leader"))
        except Exception as exc:  # no answer is no verdict
            log.debug("status of %s for the keep-alive stream: %s", url, exc)
            return None
        self._kv._terms.note(number(header.get("raft_term")))
        return (member, leader) if member and leader else None

    def _open(self, url: str, token: str | None, deadline: float) -> Stream | None:
        """The stream to ``url`` with ``token``: the one open, or a new one; ``None``
        if ``url`` does not serve it (then renewed through the gateway)."""
        if self._conn is not None and (
            self._url != url or self._token != token or not self._conn.reusable()
        ):
            self._drop()
        if self._stream is not None and (self._stream.ended or self._stream.reset is not None):
            self._drop_stream()
        if self._conn is None:
            endpoint = self._kv._transport._endpoint(url)
            context = None
            if endpoint.tls:
                context = self._kv._transport.h2_context
                if context is None:
                    self._fall_back(url, "no TLS context offers HTTP/2 (ALPN h2)")
                    return None
            try:
                self._conn = H2Connection.open(
                    url,
                    endpoint.host,
                    endpoint.port,
                    context,
                    max(deadline - time.monotonic(), 0.001),
                    MAX_MESSAGE + 5,
                )
            except NotH2 as exc:
                self._fall_back(url, str(exc))
                return None
            self._url = url
        if self._stream is None:
            host = urlsplit(url).netloc
            scheme = "https" if url.startswith("https:") else "http"
            headers = [
                (":method", "POST"),
                (":scheme", scheme),
                (":path", _PATH),
                (":authority", host),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ]
            if token:
                headers.append(("token", token))
            self._stream = self._conn.request(headers, deadline)
            self._token = token
        return self._stream

    def _fall_back(self, url: str, why: str) -> None:
        self._gateway[url] = time.monotonic() + RETRY_STREAM
        self._say(url, "gateway", why)

    def _message(self, conn: H2Connection, stream: Stream, deadline: float, check: Any) -> bytes:
        """The next gRPC message of ``stream``.

        Raises:
            EtcdError: the stream ended with an error status.
            BadResponse: not a gRPC answer, or over :data:`MAX_MESSAGE`.
        """
        url = conn.where

        def ready(s: Stream) -> bool:
            return len(s.data) >= 5 and len(s.data) >= 5 + int.from_bytes(s.data[1:5], "big")

        conn.wait(stream, lambda s: s.headers is not None and ready(s), deadline, check, SETTLE)
        if stream.headers is not None:
            self._check_headers(url, stream.headers)
        if stream.headers is not None and ready(stream):
            data = stream.data
            if data[0] != 0:
                raise BadResponse(f"{url} sent a compressed gRPC message (none was asked for)")
            size = int.from_bytes(data[1:5], "big")
            message = bytes(data[5 : 5 + size])
            del data[: 5 + size]
            self._say(url, "stream")
            return message
        if len(stream.data) >= 5 and int.from_bytes(stream.data[1:5], "big") > MAX_MESSAGE:
            raise BadResponse(f"{url} sent a gRPC message over {MAX_MESSAGE} bytes")
        if stream.reset is not None:
            raise ConnectionResetError(
                f"{url} reset the keep-alive stream (HTTP/2 error code {stream.reset})"
            )
        # Ended: the status is in the trailers.
        trailers = dict(stream.trailers or [])
        status = trailers.get("grpc-status")
        message_text = unquote(trailers.get("grpc-message", ""))
        if status is None or not status.isascii() or not status.isdigit() or len(status) > 3:
            raise BadResponse(f"{url} ended the keep-alive stream without a gRPC status")
        code = int(status)
        if code == _OK:
            raise ConnectionResetError(f"{url} ended the keep-alive stream")
        if code == 12:  # UNIMPLEMENTED: no gRPC lease service here
            self._fall_back(url, f"gRPC status 12 ({message_text})")
            raise _UseGateway()
        raise EtcdError(code, message_text or f"gRPC status {code}", 200, self._token)

    def _check_headers(self, url: str, headers: list[tuple[str, str]]) -> None:
        found = dict(headers)
        status = found.get(":status")
        kind = found.get("content-type", "")
        if status != "200" or not kind.startswith("application/grpc"):
            # An HTTP/2 server that is not etcd's gRPC: use the gateway there.
            self._fall_back(url, f"it answered HTTP/2 status {status}, content-type {kind!r}")
            raise _UseGateway()

    def _drop_stream(self) -> None:
        if self._stream is not None and self._conn is not None and not self._conn.closed:
            self._conn.cancel(self._stream)
        self._stream = None

    def _drop(self) -> None:
        """Close the connection (and its stream)."""
        self._stream = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        """Close the stream and its connection; no renewal goes over it after this."""
        with self._lock:
            self._closed = True
            self._drop()
