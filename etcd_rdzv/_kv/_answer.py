"""One answer of etcd over HTTP/1.1, read strictly: the connection it comes on, its
status line and headers, and its body (whole, with ``Content-Length`` or chunked, or
streamed in windows), each bounded in size and read by the request's deadline. The
transport (:mod:`._http`) sends the requests; everything that reads what came back is
here. Anything malformed is a :class:`BadResponse` naming the endpoint.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import select
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

__all__ = [
    "MAX_LINE",
    "BadResponse",
    "Connection",
    "Endpoint",
    "Response",
    "content_length",
    "read_headers",
]

_MAX_LENGTH_DIGITS = 18  # a Content-Length or chunk size longer than this is no answer
MAX_LINE = 65536  # bytes in a status, header or chunk-size line
_MAX_HEADERS = 100
_READ_SIZE = 65536  # bytes asked of the socket at a time when streaming

_HEX = b"0123456789abcdefABCDEF"

# The parts of a chunked body (see Response.read_some).
_SIZE, _DATA, _CRLF, _TRAILER = range(4)


class BadResponse(http.client.HTTPException):
    """The answer is not one this client can read: malformed, too large, or cut short.
    The message names the endpoint."""


@dataclass(frozen=True)
class Endpoint:
    tls: bool
    host: str
    port: int
    netloc: str  # for the Host header
    url: str  # for messages


def content_length(value: bytes, where: str) -> int:
    """A ``Content-Length`` value: ASCII digits, nothing else (no sign, no ``_``, no
    spaces inside); repeated values (``5, 5``, or the header twice) must agree."""
    if value.isdigit() and len(value) <= _MAX_LENGTH_DIGITS:  # ASCII digits, for bytes
        return int(value)
    first, *more = value.split(b",")
    first = first.strip()
    if (
        not first.isdigit()  # ASCII digits only, for bytes
        or len(first) > _MAX_LENGTH_DIGITS
        or any(other.strip() != first for other in more)
    ):
        raise BadResponse(f"{where} answered an invalid Content-Length: {value[:80]!r}")
    return int(first)


class _Readable:
    """Whether a socket can be read at once (without waiting): a ``poll`` object
    registered once, so each check is one call (``select`` where there is no ``poll``)."""

    __slots__ = ("_poller", "_sock")

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._poller: Any = None
        if hasattr(select, "poll"):
            self._poller = select.poll()
            self._poller.register(sock, select.POLLIN)

    def __call__(self) -> bool:
        if self._poller is not None:
            return bool(self._poller.poll(0))
        readable, _, _ = select.select([self._sock], [], [], 0)
        return bool(readable)


class _Raw(io.RawIOBase):
    """A socket as its buffered reader sees it. With a ``deadline`` (a
    ``time.monotonic()`` instant), each receive may wait only for what is left of it:
    an answer that trickles in a byte at a time still ends by then."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock
        self.deadline: float | None = None
        # While nothing comes: ``check()`` every ``check_every`` seconds (or as many as
        # it returns: when it next needs to look); it may raise to give up on the
        # answer (the request is stuck, and sending it again helps).
        self.check: Callable[[], float | None] | None = None
        self.check_every = 0.0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while True:
            wait: float | None = None
            if self.deadline is not None:
                wait = self.deadline - time.monotonic()
                if wait <= 0:
                    raise TimeoutError("timed out")
            check = self.check
            sliced = check is not None and (wait is None or wait > self.check_every)
            if sliced:
                wait = self.check_every
            self.sock.settimeout(wait)
            try:
                return self.sock.recv_into(buffer)
            except TimeoutError:
                if not sliced or check is None:
                    raise
            later = check()
            if later is not None:
                self.check_every = max(later, 0.01)


class Connection:
    """One socket and its buffered reader."""

    __slots__ = ("_readable", "file", "raw", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.raw = _Raw(sock)
        self.file = io.BufferedReader(self.raw)
        self._readable: _Readable | None = None  # made when first asked

    def reusable(self) -> bool:
        """An idle connection is usable while nothing can be read from it: readable,
        it was closed by the server (or holds bytes nobody asked for)."""
        try:
            if self._readable is None:
                self._readable = _Readable(self.sock)
            return not self._readable()
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(OSError):
            self.sock.close()


class Response:
    """An answer: its status, its headers (``{lower-case name: value}``, as bytes),
    and its body read whole (:meth:`read`) or chunk by chunk as it arrives
    (:meth:`chunks`, streamed answers)."""

    def __init__(
        self,
        give_back: Callable[[Endpoint, Connection], None],
        endpoint: Endpoint,
        conn: Connection,
        status: int,
        headers: dict[bytes, bytes],
        length: int | None,
        chunked: bool,
        keep: bool,
        max_bytes: int,
    ) -> None:
        self.status = status
        self.headers = headers
        #: The endpoint's base URL, for messages.
        self.where = endpoint.url
        #: The most bytes the body read whole (or one message of a stream) may hold.
        self.max_bytes = max_bytes
        self._give_back, self._endpoint, self._conn = give_back, endpoint, conn
        self._length, self._chunked, self._keep = length, chunked, keep
        self._done = False
        # Where a chunked body's decoding stands, kept between calls so that a read
        # that times out loses nothing: what came but is not yet decoded, and the
        # part of the framing it is in (chunk-size line, data, the CRLF after the
        # data, or the trailer after the last chunk).
        self._unread = bytearray()
        self._part = _SIZE
        self._left = 0  # bytes of the current chunk's data still to come

    def read_by(self, deadline: float) -> None:
        """End every further read by ``deadline`` (a ``time.monotonic()`` instant)."""
        self._conn.raw.deadline = deadline

    def read(self) -> bytes:
        """The whole body; the connection goes back to the pool if it can be reused.

        Raises:
            BadResponse: the body is longer than :attr:`max_bytes`, or malformed.
            TimeoutError: it did not come by the deadline.
        """
        if not self._chunked:
            try:
                data = self._read_plain()
            except BaseException:
                self.close()
                raise
            self._finish()
            return data
        parts = []
        size = 0
        try:
            while part := self.read_some():
                size += len(part)
                if size > self.max_bytes:
                    raise self._too_large()
                parts.append(part)
        except BaseException:
            self.close()
            raise
        return b"".join(parts)

    def _too_large(self) -> BadResponse:
        return BadResponse(
            f"{self.where} sent an answer over {self.max_bytes} bytes (the most this client reads)"
        )

    def _read_plain(self) -> bytes:
        file = self._conn.file
        if self._length is None:
            self._keep = False  # the body ends where the connection does
            body = bytearray()
            while more := file.read1(_READ_SIZE):  # each wait ends by the deadline
                body += more
                if len(body) > self.max_bytes:
                    raise self._too_large()
            return bytes(body)
        data = file.read(self._length)  # at most max_bytes: checked with the headers
        if len(data) < self._length:
            raise http.client.IncompleteRead(data, self._length - len(data))
        return data

    def chunks(self) -> Iterator[bytes]:
        """The body's parts as they arrive (one, for an answer that is not chunked);
        the connection goes back to the pool once the last one was read."""
        while data := self.read_some():
            yield data

    def read_some(self) -> bytes:
        """The next part of the body, as soon as some of it came; ``b""`` once it
        was read to its end (then the connection goes back to the pool).

        A read that fails with TimeoutError (:meth:`read_by`'s deadline) loses
        nothing: the next call goes on where it stopped, so one stream can be read
        in windows. Any other failure closes the connection.
        """
        if self._done:
            return b""
        try:
            if not self._chunked:
                data = self._read_plain()
                self._finish()
                return data
            return self._read_chunked()
        except TimeoutError:
            raise
        except BaseException:
            self.close()
            raise

    def _read_chunked(self) -> bytes:
        unread = self._unread
        while True:
            if self._part == _DATA and unread:
                data = bytes(unread[: self._left])
                del unread[: len(data)]
                self._left -= len(data)
                if not self._left:
                    self._part = _CRLF
                return data
            if self._part == _CRLF and len(unread) >= 2:
                if unread[:2] != b"\r\n":
                    raise BadResponse(f"{self.where} sent a chunk longer than its size says")
                del unread[:2]
                self._part = _SIZE
                continue
            end = unread.find(b"\r\n") if self._part in (_SIZE, _TRAILER) else -1
            if end >= 0:
                line = bytes(unread[:end])
                del unread[: end + 2]
                if self._part == _TRAILER:
                    if not line:  # the blank line that ends the answer
                        if unread:  # bytes nobody asked for: never reuse this one
                            self._keep = False
                        self._finish()
                        return b""
                    continue  # a trailer field: nothing this client needs
                self._left = self._chunk_size(line)
                self._part = _DATA if self._left else _TRAILER
                continue
            if end < 0 and self._part in (_SIZE, _TRAILER) and len(unread) > MAX_LINE:
                raise BadResponse(
                    f"{self.where} sent a chunk-size or trailer line over {MAX_LINE} bytes"
                )
            # Only here may the read wait (and time out): everything decoded so far
            # is kept above, and read1 consumes nothing when it fails.
            more = self._conn.file.read1(_READ_SIZE)
            if not more:
                raise BadResponse(f"{self.where}: the answer ended inside its chunked body")
            unread += more

    def _chunk_size(self, line: bytes) -> int:
        """The size on a chunk-size line (hexadecimal digits, maybe extensions after);
        at most :attr:`max_bytes`."""
        digits = line.split(b";", 1)[0].strip()
        if not digits or len(digits) > _MAX_LENGTH_DIGITS or digits.strip(_HEX):
            raise BadResponse(f"{self.where} sent what is not a chunk size: {line[:80]!r}")
        size = int(digits, 16)
        if size > self.max_bytes:
            raise BadResponse(
                f"{self.where} announced a chunk of {size} bytes, over {self.max_bytes} "
                "(the most this client reads)"
            )
        return size

    def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        if self._keep:
            self._give_back(self._endpoint, self._conn)
        else:
            self._conn.close()

    def close(self) -> None:
        """Close the connection unless the body was read to its end (and it was kept)."""
        if not self._done:
            self._done = True
            self._conn.close()

    def shutdown(self) -> None:
        """End a read blocked in another thread (it fails at once)."""
        if not self._done:
            with contextlib.suppress(OSError):
                self._conn.sock.shutdown(socket.SHUT_RDWR)


def read_headers(file: BinaryIO, where: str) -> dict[bytes, bytes]:
    """Header lines up to the blank line, as ``{lower-case name: value}``; a header
    that came more than once has its values joined by ``, `` (as HTTP reads them)."""
    headers: dict[bytes, bytes] = {}
    for _ in range(_MAX_HEADERS + 1):
        line = file.readline(MAX_LINE + 1)
        if line in (b"\r\n", b"\n"):
            return headers
        if not line:
            raise BadResponse(f"{where}: the answer ended inside its headers")
        if len(line) > MAX_LINE:
            raise BadResponse(f"{where} sent a header line over {MAX_LINE} bytes")
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip()
        if name in headers:
            value = headers[name] + b", " + value
        headers[name] = value
    raise BadResponse(f"{where} sent more than {_MAX_HEADERS} header lines")
