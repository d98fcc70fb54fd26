"""The HTTP/1.1 client of both KV layers: the v3 layer's POSTs to etcd's JSON gateway,
answered at once or streamed (watches), and the v2 layer's requests (python-etcd's,
through :mod:`.v2._pool`), over kept-alive connections.

It speaks the little of HTTP that etcd needs (a request with a body of known length;
an answer with ``Content-Length`` or chunked) and nothing else: no redirects, proxies,
retries or compression. A general client parses every answer's headers into a
message object and builds each request through several layers; at a rendezvous of a
thousand nodes on a few cores that was most of the client's CPU (measured in
``docs/benchmarks.md``). What it must get right it does: a connection is reused only
while idle and open, any failure closes it, an answer is read by the request's
deadline however slowly it comes, and a failure before the request left this process
says so (:class:`ConnectFailed`), because only then may a write go to another endpoint.

What comes back is untrusted: an answer read whole may be at most ``max_response_bytes``
long (announced or not), a streamed one may not run longer than that without a line
break (one watch message), and a ``Content-Length`` must be plain ASCII digits (one
value). Anything else fails with :class:`BadResponse`, naming the endpoint (and the
bound, where one was passed), and the connection it came on is closed, never reused.
A flood ends at the request's deadline or at the bound, whichever comes first.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from ..config._options import option
from ._answer import (
    MAX_LINE,
    BadResponse,
    Connection,
    Endpoint,
    Response,
    content_length,
    read_headers,
)
from ._failover import ConnectFailed, TLSFailed

__all__ = [
    "DEFAULT_MAX_RESPONSE_BYTES",
    "BadResponse",
    "ConnectFailed",
    "Response",
    "TLSFailed",
    "Transport",
]

#: The most bytes an answer read whole may hold, and one message of a stream (a watch
#: event): far above what etcd sends (its requests are at most 1.5 MiB by default,
#: but a range over a large prefix, base64-encoded, may be many times that), far below
#: what would hurt a node's process.
DEFAULT_MAX_RESPONSE_BYTES: int = option("max_response_bytes").default

_MAX_IDLE = 16  # idle connections kept per endpoint


def _endpoint(url: str) -> Endpoint:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL with a host: {url!r}")
    tls = parts.scheme == "https"
    base = f"{parts.scheme}://{parts.netloc}"
    return Endpoint(tls, parts.hostname, parts.port or (443 if tls else 80), parts.netloc, base)


class Transport:
    """Connections to the endpoints of one client, kept alive between requests.
    Thread-safe: a request takes an idle connection (or opens one) and gives it back
    when its answer was read to the end.

    Args:
        ssl_context: for ``https`` endpoints (default: the system's trust store).
        max_response_bytes: the most bytes an answer read whole, or one message of a
            streamed answer, may hold (:data:`DEFAULT_MAX_RESPONSE_BYTES`).
        h2_context: the same TLS settings as ``ssl_context``, offering HTTP/2 (ALPN
            ``h2``), for the v3 client's gRPC stream (see
            :mod:`etcd_rdzv._kv.v3._keepalive_stream`); without one, that stream is
            not used over TLS. A separate context, because ALPN is set per context and
            this transport's own connections must stay HTTP/1.1.
    """

    def __init__(
        self,
        ssl_context: ssl.SSLContext | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        h2_context: ssl.SSLContext | None = None,
    ) -> None:
        if max_response_bytes < 1:
            raise ValueError(f"max_response_bytes must be positive, got {max_response_bytes}")
        self._ssl_context = ssl_context
        self.h2_context = h2_context
        self.max_response_bytes = max_response_bytes
        self._idle: dict[Endpoint, list[Connection]] = {}
        self._endpoints: dict[str, Endpoint] = {}
        self._lock = threading.Lock()

    def _endpoint(self, url: str) -> Endpoint:
        found = self._endpoints.get(url)
        if found is None:
            found = self._endpoints[url] = _endpoint(url)
        return found

    def _take(self, endpoint: Endpoint) -> Connection | None:
        while True:
            with self._lock:
                idle = self._idle.get(endpoint)
                conn = idle.pop() if idle else None
            if conn is None or conn.reusable():
                return conn
            conn.close()

    def _give_back(self, endpoint: Endpoint, conn: Connection) -> None:
        with self._lock:
            idle = self._idle.setdefault(endpoint, [])
            if len(idle) < _MAX_IDLE:
                idle.append(conn)
                return
        conn.close()

    def _connect(self, endpoint: Endpoint, timeout: float) -> Connection:
        where = f"{endpoint.host}:{endpoint.port}"
        try:
            sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout)
        except OSError as exc:
            raise ConnectFailed(f"could not connect to {where}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if endpoint.tls:
                context = self._ssl_context or ssl.create_default_context()
                sock = context.wrap_socket(sock, server_hostname=endpoint.host)
        except ssl.SSLError as exc:
            sock.close()
            raise TLSFailed(str(exc)) from exc
        except OSError as exc:  # the handshake timed out, or the peer hung up
            sock.close()
            raise ConnectFailed(f"TLS handshake with {where} failed: {exc}") from exc
        return Connection(sock)

    def request(
        self,
        url: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        timeout: float,
        *,
        stream: bool = False,
        method: str = "POST",
        check: Callable[[], float | None] | None = None,
        check_every: float = 1.0,
    ) -> tuple[Response, bytes | None]:
        """Send ``body`` to ``path`` (with its query, if any) of the endpoint ``url``
        within ``timeout`` seconds: the answer and its whole body, or (``stream``) the
        answer with its body unread, to be read (and closed) by the caller.

        ``check``: called ``check_every`` seconds after the request was sent while
        the answer does not come, then again as many seconds later as it returns
        (``None``: ``check_every``); what it raises ends the request (its connection
        closed), as a timeout would, but sooner.

        Raises:
            ConnectFailed: no connection: the request was never sent.
            BadResponse: the answer is malformed or over :attr:`max_response_bytes`.
            OSError (``TimeoutError`` among them), http.client.HTTPException: the
                request was (or may have been) sent and its answer lost.
        """
        deadline = time.monotonic() + timeout
        endpoint = self._endpoint(url)
        conn = self._take(endpoint) or self._connect(endpoint, timeout)
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {endpoint.netloc}\r\n"
            f"Content-Length: {len(body)}\r\n"
            + "".join(f"{name}: {value}\r\n" for name, value in headers.items())
            + "\r\n"
        )
        try:
            # The answer is read by the deadline, however slowly it comes.
            conn.raw.deadline = deadline
            conn.sock.settimeout(max(deadline - time.monotonic(), 0.001))
            conn.sock.sendall(head.encode("latin-1") + body)
            conn.raw.check, conn.raw.check_every = check, check_every
            try:
                resp = self._answer(endpoint, conn)
                return resp, (None if stream else resp.read())
            finally:
                conn.raw.check = None
        except BaseException:
            conn.close()
            raise

    def _answer(self, endpoint: Endpoint, conn: Connection) -> Response:
        file = conn.file
        while True:
            line = file.readline(MAX_LINE + 1)
            if not line:
                raise http.client.RemoteDisconnected(
                    f"{endpoint.url} closed the connection unanswered"
                )
            parts = line.split(None, 2)
            if (
                len(parts) < 2
                or not parts[0].startswith(b"HTTP/1.")
                or len(parts[1]) != 3
                or not parts[1].isdigit()
            ):
                raise BadResponse(f"{endpoint.url} answered no HTTP/1.x status line: {line[:80]!r}")
            status = int(parts[1])
            headers = read_headers(file, endpoint.url)
            if status >= 200:
                break  # 1xx: an interim answer; the real one follows
        keep = parts[0] != b"HTTP/1.0" and headers.get(b"connection", b"").lower() != b"close"
        length = None
        coding = headers.get(b"transfer-encoding")
        chunked = coding is not None
        if coding is not None:
            if coding.lower() != b"chunked":  # no compression, nothing else
                raise BadResponse(
                    f"{endpoint.url} answered a Transfer-Encoding this client does not "
                    f"read: {coding[:80]!r}"
                )
            if b"content-length" in headers:
                keep = False  # both: the chunks count (RFC 9112 6.3), but trust no more
        elif (length_text := headers.get(b"content-length")) is not None:
            length = content_length(length_text, endpoint.url)
            if length > self.max_response_bytes:
                raise BadResponse(
                    f"{endpoint.url} announced an answer of {length} bytes, over "
                    f"{self.max_response_bytes} (the most this client reads)"
                )
        if status in (204, 304):
            length, chunked = 0, False
        return Response(
            self._give_back,
            endpoint,
            conn,
            status,
            headers,
            length,
            chunked,
            keep,
            self.max_response_bytes,
        )

    def close(self) -> None:
        """Close the idle connections (streams still open close when they end)."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
