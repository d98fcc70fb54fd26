"""An HTTP/2 client connection (RFC 9113), as little of it as one gRPC stream needs.

etcd serves gRPC (HTTP/2) on its client port: in the clear with prior knowledge
(h2c), and over TLS where ALPN picks ``h2``. :meth:`H2Connection.open` makes such a
connection; :meth:`~H2Connection.request` opens a stream, :meth:`~H2Connection.send`
sends on it, and :meth:`~H2Connection.wait` reads frames until the stream has
something new. There is no reader thread: frames are read by the caller that waits,
which answers what the protocol asks of it on the way (SETTINGS and PING
acknowledgements, WINDOW_UPDATEs for the data it read).

What the server sends is untrusted, as the HTTP/1.1 transport's answers are: every
read ends by the caller's deadline, a frame may be at most :data:`MAX_FRAME` bytes
(what this client announces), a stream may buffer at most ``max_buffer`` bytes, and a
frame that breaks the protocol (a bad length for its type, padding past its end, a
header block interrupted, a flow-control window overrun, a push) closes the
connection with a :class:`~.._http.BadResponse` naming the endpoint. A peer that does
not speak HTTP/2 at all (an HTTP/1.1 proxy, an ALPN refusal) is :class:`NotH2`, so
that the caller can use the JSON gateway there instead.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .._answer import BadResponse
from .._failover import ConnectFailed, TLSFailed
from ._hpack import MAX_HEADER_LIST, Decoder, HpackError, encode

__all__ = ["MAX_FRAME", "H2Connection", "NotH2", "Stream"]

#: The largest frame payload this client takes (HTTP/2's default, which it announces).
MAX_FRAME = 16384
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_WINDOW = 65535  # the initial flow-control windows (HTTP/2's default, both ways)
_MAX_WINDOW = 2**31 - 1

_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS = 0, 1, 2, 3, 4
_PUSH_PROMISE, _PING, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION = 5, 6, 7, 8, 9
_END_STREAM = _ACK = 0x1
_END_HEADERS, _PADDED, _PRIORITY_FLAG = 0x4, 0x8, 0x20

_SETTINGS_HEADER_TABLE_SIZE, _SETTINGS_ENABLE_PUSH = 1, 2
_SETTINGS_INITIAL_WINDOW_SIZE, _SETTINGS_MAX_FRAME_SIZE = 4, 5
_SETTINGS_MAX_HEADER_LIST_SIZE = 6
_CANCEL = 0x8

_HEAD = struct.Struct(">I B I")  # 24-bit length (in the top of the word), type, flags, id


class NotH2(ConnectFailed):
    """The endpoint does not speak HTTP/2 (nothing was sent on a stream)."""


@dataclass
class Stream:
    """One stream of a connection, as read so far."""

    id: int
    send_window: int
    data: bytearray = field(default_factory=bytearray)
    headers: list[tuple[str, str]] | None = None  # the answer's headers
    trailers: list[tuple[str, str]] | None = None  # headers that ended the stream
    ended: bool = False  # the server ended its side (END_STREAM)
    reset: int | None = None  # RST_STREAM's error code, or GOAWAY's refusal
    unacked: int = 0  # bytes of DATA read and not yet given back by WINDOW_UPDATE


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream)
        + payload
    )


class H2Connection:
    """One HTTP/2 connection to one endpoint. Not thread-safe: its owner serializes.

    Any error closes it (:attr:`closed`); a GOAWAY from the server marks it
    :attr:`going_away` (streams it still serves finish; open no more).

    Args:
        sock: a connected socket (TLS done), the preface not yet sent.
        where: the endpoint's URL, for messages.
        max_buffer: the most bytes of DATA one stream may hold unread.
    """

    def __init__(self, sock: socket.socket, where: str, max_buffer: int) -> None:
        self._sock = sock
        self.where = where
        self._max_buffer = max_buffer
        self._in = bytearray()
        self._decoder = Decoder()
        self._streams: dict[int, Stream] = {}
        self._next_id = 1
        self._send_window = _WINDOW  # the connection's, towards the server
        self._stream_window = _WINDOW  # the server's initial window for new streams
        self._unacked = 0  # bytes of DATA read on the connection, not yet given back
        self._block: tuple[int, int, bytearray] | None = None  # (stream, flags, fragments)
        self.closed = False
        self.going_away = False

    # -- opening ------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        url: str,
        host: str,
        port: int,
        context: ssl.SSLContext | None,
        timeout: float,
        max_buffer: int,
    ) -> H2Connection:
        """Connect to ``host:port`` (TLS with ``context``, which must offer ALPN ``h2``)
        and exchange the prefaces within ``timeout`` seconds.

        Raises:
            ConnectFailed, TLSFailed: no connection.
            NotH2: the endpoint answered, but not in HTTP/2.
            OSError: no answer in time.
        """
        deadline = time.monotonic() + timeout
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise ConnectFailed(f"could not connect to {host}:{port}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if context is not None:
                try:
                    sock = context.wrap_socket(sock, server_hostname=host)
                except ssl.SSLError as exc:
                    raise TLSFailed(str(exc)) from exc
                except OSError as exc:
                    raise ConnectFailed(f"TLS handshake with {host}:{port} failed: {exc}") from exc
                chosen = sock.selected_alpn_protocol()
                if chosen != "h2":
                    raise NotH2(f"{url} chose no HTTP/2 in the TLS handshake (ALPN: {chosen})")
            conn = cls(sock, url, max_buffer)
            conn._handshake(deadline)
        except BaseException:
            sock.close()
            raise
        return conn

    def _handshake(self, deadline: float) -> None:
        settings = struct.pack(
            ">HIHI", _SETTINGS_ENABLE_PUSH, 0, _SETTINGS_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST
        )
        self._write(_PREFACE + _frame(_SETTINGS, 0, 0, settings), deadline)
        try:
            self._fill(9, deadline)
        except (ConnectionError, BadResponse) as exc:
            raise NotH2(f"{self.where} closed the connection on the HTTP/2 preface") from exc
        length = int.from_bytes(self._in[:3], "big")
        if self._in[3] != _SETTINGS or self._in[4] & _ACK or length % 6 or length > MAX_FRAME:
            raise NotH2(
                f"{self.where} answered the HTTP/2 preface with no SETTINGS frame: "
                f"{bytes(self._in[:16])!r}"
            )

    # -- writing ------------------------------------------------------------------------

    def _write(self, data: bytes, deadline: float) -> None:
        try:
            self._sock.settimeout(max(deadline - time.monotonic(), 0.001))
            self._sock.sendall(data)
        except BaseException:
            self.close()
            raise

    def request(self, headers: list[tuple[str, str]], deadline: float) -> Stream:
        """Open a stream: send ``headers`` (pseudo-headers first) without ending it."""
        if self.closed or self.going_away:
            raise ConnectionError(f"the HTTP/2 connection to {self.where} is closing")
        block = encode(headers)
        if len(block) > MAX_FRAME:
            raise ValueError(f"request headers of {len(block)} bytes: over one frame")
        stream = Stream(self._next_id, self._stream_window)
        self._next_id += 2
        self._streams[stream.id] = stream
        self._write(_frame(_HEADERS, _END_HEADERS, stream.id, block), deadline)
        return stream

    def send(
        self,
        stream: Stream,
        data: bytes,
        deadline: float,
        check: Callable[[], float | None] | None = None,
    ) -> None:
        """Send ``data`` on ``stream`` (one frame: callers send small messages), once
        the flow-control windows let it."""
        if len(data) > MAX_FRAME:
            raise ValueError(f"{len(data)} bytes: over one frame")
        while min(self._send_window, stream.send_window) < len(data):
            if stream.reset is not None or stream.ended:
                return  # the answer tells the caller
            self._read_frame(deadline, check)
        self._send_window -= len(data)
        stream.send_window -= len(data)
        self._write(_frame(_DATA, 0, stream.id, data), deadline)

    def cancel(self, stream: Stream) -> None:
        """End ``stream`` (RST_STREAM CANCEL) if it is open; the connection stays."""
        self._streams.pop(stream.id, None)
        if not (stream.reset is not None or self.closed):
            stream.reset = _CANCEL
            with contextlib.suppress(OSError):  # then closed by _write
                self._write(
                    _frame(_RST_STREAM, 0, stream.id, struct.pack(">I", _CANCEL)),
                    time.monotonic() + 1.0,
                )

    def reusable(self) -> bool:
        """Whether a new request may go on this connection: not closed or going away,
        and not closed by the server meanwhile (what it sent since is kept for the
        next read)."""
        if self.closed or self.going_away:
            return False
        try:
            while len(self._in) <= 4 * MAX_FRAME:
                pending = isinstance(self._sock, ssl.SSLSocket) and self._sock.pending()
                if not pending and not select.select([self._sock], [], [], 0)[0]:
                    return True
                self._sock.settimeout(0)
                data = self._sock.recv(65536)
                if not data:
                    self.close()
                    return False
                self._in += data
        except (ssl.SSLWantReadError, BlockingIOError):
            return True
        except (OSError, ValueError):
            self.close()
            return False
        return True

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self._sock.close()

    # -- reading ------------------------------------------------------------------------

    def wait(
        self,
        stream: Stream,
        ready: Callable[[Stream], bool],
        deadline: float,
        check: Callable[[], float | None] | None = None,
        check_every: float = 1.0,
    ) -> None:
        """Read frames until ``ready(stream)``, the stream ended or was reset, or the
        deadline passed (TimeoutError). ``check`` is called every ``check_every``
        seconds of waiting; what it raises ends the wait."""
        while not (ready(stream) or stream.ended or stream.reset is not None):
            self._read_frame(deadline, check, check_every)

    def _fill(
        self,
        n: int,
        deadline: float,
        check: Callable[[], float | None] | None = None,
        check_every: float = 1.0,
    ) -> None:
        """Read until :attr:`_in` holds ``n`` bytes, by ``deadline``. A deadline that
        passes closes nothing: what was read stays in :attr:`_in`, whole frames or not,
        so the connection may go on (the caller cancels the stream it waited on)."""
        while len(self._in) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.where} did not answer on its HTTP/2 stream in time")
            self._sock.settimeout(min(left, check_every) if check else left)
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                if check is not None:
                    try:
                        later = check()
                    except BaseException:
                        self.close()
                        raise
                    if later is not None:  # when the check next needs to look
                        check_every = max(later, 0.01)
                continue
            except BaseException:
                self.close()
                raise
            if not data:
                self.close()
                raise ConnectionResetError(f"{self.where} closed the HTTP/2 connection")
            self._in += data

    def _bad(self, what: str) -> BadResponse:
        self.close()
        return BadResponse(f"{self.where} broke HTTP/2: {what}")

    def _read_frame(
        self,
        deadline: float,
        check: Callable[[], float | None] | None = None,
        check_every: float = 1.0,
    ) -> None:
        self._fill(9, deadline, check, check_every)
        word, flags, stream_id = _HEAD.unpack_from(self._in)
        length, kind, stream_id = word >> 8, word & 0xFF, stream_id & 0x7FFFFFFF
        if length > MAX_FRAME:
            raise self._bad(f"a frame of {length} bytes (the most this client takes: {MAX_FRAME})")
        self._fill(9 + length, deadline, check, check_every)
        payload = bytes(self._in[9 : 9 + length])
        del self._in[: 9 + length]
        if self._block is not None and kind != _CONTINUATION:
            raise self._bad("a header block interrupted by another frame")
        handler = _HANDLERS.get(kind)
        if handler is not None:
            handler(self, flags, stream_id, payload, deadline)
        # Unknown frame types are ignored (RFC 9113 4.1).

    @staticmethod
    def _unpad(conn: H2Connection, flags: int, payload: bytes) -> bytes:
        if not flags & _PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise conn._bad("padding longer than its frame")
        return payload[1 : len(payload) - payload[0]]

    def _on_data(self, flags: int, stream_id: int, payload: bytes, deadline: float) -> None:
        if not stream_id:
            raise self._bad("DATA on stream 0")
        self._unacked += len(payload)
        if self._unacked > _WINDOW:
            raise self._bad("DATA over the connection's flow-control window")
        stream = self._streams.get(stream_id)
        body = self._unpad(self, flags, payload)
        updates = b""
        if stream is not None:
            stream.unacked += len(payload)
            if stream.unacked > _WINDOW:
                raise self._bad(f"DATA over stream {stream_id}'s flow-control window")
            stream.data += body
            if len(stream.data) > self._max_buffer:
                raise self._bad(f"over {self._max_buffer} bytes unread on stream {stream_id}")
            if flags & _END_STREAM:
                stream.ended = True
            elif stream.unacked >= _WINDOW // 2:
                updates += _frame(_WINDOW_UPDATE, 0, stream_id, struct.pack(">I", stream.unacked))
                stream.unacked = 0
        if self._unacked >= _WINDOW // 2:
            updates += _frame(_WINDOW_UPDATE, 0, 0, struct.pack(">I", self._unacked))
            self._unacked = 0
        if updates:
            self._write(updates, deadline)

    def _on_headers(self, flags: int, stream_id: int, payload: bytes, deadline: float) -> None:
        if not stream_id:
            raise self._bad("HEADERS on stream 0")
        fragment = self._unpad(self, flags, payload)
        if flags & _PRIORITY_FLAG:
            if len(fragment) < 5:
                raise self._bad("a HEADERS frame too short for its priority")
            fragment = fragment[5:]
        self._block = (stream_id, flags, bytearray(fragment))
        if flags & _END_HEADERS:
            self._end_block()

    def _on_continuation(self, flags: int, stream_id: int, payload: bytes, deadline: float) -> None:
        if self._block is None or self._block[0] != stream_id:
            raise self._bad("a CONTINUATION frame that continues no header block")
        self._block[2].extend(payload)
        if len(self._block[2]) > MAX_HEADER_LIST:
            raise self._bad(f"a header block over {MAX_HEADER_LIST} bytes")
        if flags & _END_HEADERS:
            self._end_block()

    def _end_block(self) -> None:
        assert self._block is not None
        stream_id, flags, block = self._block
        self._block = None
        try:
            # Decoded even for a stream this client dropped: the table is shared.
            headers = self._decoder.decode(bytes(block))
        except HpackError as exc:
            raise self._bad(f"a header block is not valid HPACK ({exc})") from exc
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        if stream.headers is None and not flags & _END_STREAM:
            stream.headers = headers
        elif flags & _END_STREAM:
            if stream.headers is None:  # a trailers-only answer: both in one
                stream.headers = headers
            stream.trailers = headers
        else:
            raise self._bad(f"a second header block on stream {stream_id} that does not end it")
        if flags & _END_STREAM:
            stream.ended = True

    def _on_rst_stream(self, flags: int, stream_id: int, payload: bytes, deadline: float) -> None:
        if not stream_id or len(payload) != 4:
            raise self._bad("a malformed RST_STREAM frame")
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            stream.reset = int.from_bytes(payload, "big")

    def _on_settings(self, flags: int, stream_id: int, payload: bytes, deadline: float) -> None:
        if stream_id or len(payload) % 6 or (flags & _ACK and payload):
            raise self._bad("a malformed SETTINGS frame")
        if flags & _ACK:
            return
        for offset in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == _SETTINGS_ENABLE_PUSH and value > 1:
                raise self._bad(f"SETTINGS_ENABLE_PUSH = {value}")
            if key == _SETTINGS_INITIAL_WINDOW_SIZE:
                if value > _MAX_WINDOW:
                    raise self._bad(f"SETTINGS_INITIAL_WINDOW_SIZE = {value}")
                delta, self._stream_window = value - self._stream_window, value
                for stream in self._streams.values():
                    stream.send_window += delta
            if key == _SETTINGS_MAX_FRAME_SIZE and not MAX_FRAME <= value < 2**24:
                raise self._bad(f"SETTINGS_MAX_FRAME_SIZE = {value}")
            # HEADER_TABLE_SIZE bounds the encoder's table, which this client never uses.
        self._write(_frame(_SETTINGS, _ACK, 0), deadline)

    def _on_ping(self, flags: int, stream_id: int, payload: bytes, deadline: float) -> None:
        if stream_id or len(payload) != 8:
            raise self._bad("a malformed PING frame")
        if not flags & _ACK:
            self._write(_frame(_PING, _ACK, 0, payload), deadline)

    def _on_goaway(self, flags: int, stream_id: int, payload: bytes, deadline: float) -> None:
        if stream_id or len(payload) < 8:
            raise self._bad("a malformed GOAWAY frame")
        last, code = struct.unpack_from(">II", payload)
        last &= 0x7FFFFFFF
        self.going_away = True
        for sid, stream in list(self._streams.items()):
            if sid > last or code:  # never processed; or the connection failed
                stream.reset = code or _CANCEL
                del self._streams[sid]

    def _on_window_update(
        self, flags: int, stream_id: int, payload: bytes, deadline: float
    ) -> None:
        if len(payload) != 4:
            raise self._bad("a malformed WINDOW_UPDATE frame")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if not increment:
            raise self._bad("a WINDOW_UPDATE of 0")
        if not stream_id:
            self._send_window += increment
            if self._send_window > _MAX_WINDOW:
                raise self._bad("the connection's send window over 2**31-1")
            return
        stream = self._streams.get(stream_id)
        if stream is not None:
            stream.send_window += increment
            if stream.send_window > _MAX_WINDOW:
                raise self._bad(f"stream {stream_id}'s send window over 2**31-1")

    def _on_push_promise(self, flags: int, stream_id: int, payload: bytes, deadline: float) -> None:
        raise self._bad("a PUSH_PROMISE (this client disabled push)")

    def _on_priority(self, flags: int, stream_id: int, payload: bytes, deadline: float) -> None:
        if len(payload) != 5:
            raise self._bad("a malformed PRIORITY frame")


_Handler = Callable[[H2Connection, int, int, bytes, float], None]
_HANDLERS: dict[int, _Handler] = {
    _DATA: H2Connection._on_data,
    _HEADERS: H2Connection._on_headers,
    _PRIORITY: H2Connection._on_priority,
    _RST_STREAM: H2Connection._on_rst_stream,
    _SETTINGS: H2Connection._on_settings,
    _PUSH_PROMISE: H2Connection._on_push_promise,
    _PING: H2Connection._on_ping,
    _GOAWAY: H2Connection._on_goaway,
    _WINDOW_UPDATE: H2Connection._on_window_update,
    _CONTINUATION: H2Connection._on_continuation,
}
