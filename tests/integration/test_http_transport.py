"""The v3 client's HTTP transport: kept-alive connections against a real etcd, and
what it does with answers etcd would never send (a proxy's, a cut connection), served
by a socket server of the test's own."""

from __future__ import annotations

import base64
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from etcd_rdzv._kv._failover import not_sent
from etcd_rdzv._kv._http import BadResponse, ConnectFailed, Transport
from etcd_rdzv.testing import EtcdServer

BOUND = 10.0  # seconds: a hang, not a timing goal
JSON = {"Content-Type": "application/json"}


def _range(key: str) -> bytes:
    return json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()


@pytest.fixture
def connections(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every connection the transport opens (socket.create_connection wrapped)."""
    opened: list[Any] = []
    real = socket.create_connection

    def counting(*args: Any, **kwargs: Any) -> socket.socket:
        sock = real(*args, **kwargs)
        opened.append(sock)
        return sock

    monkeypatch.setattr(socket, "create_connection", counting)
    return opened


def test_requests_reuse_one_connection(etcd_server: EtcdServer, connections: list[Any]) -> None:
    transport = Transport()
    try:
        for _ in range(20):
            resp, data = transport.request(
                etcd_server.client_url, "/v3/kv/range", _range("/x"), JSON, BOUND
            )
            assert resp.status == 200
            assert "header" in json.loads(data or b"")
        assert len(connections) == 1
    finally:
        transport.close()


def test_stream_answer_arrives_chunk_by_chunk(etcd_server: EtcdServer) -> None:
    """A watch stream: its confirmation, then an event, each read as it comes."""
    transport = Transport()
    key = base64.b64encode(b"/stream-key").decode()
    body = json.dumps({"create_request": {"key": key}}).encode()
    resp, unread = transport.request(
        etcd_server.client_url, "/v3/watch", body, JSON, BOUND, stream=True
    )
    assert unread is None and resp.status == 200
    chunks = resp.chunks()
    created = json.loads(next(chunks))
    assert created["result"]["created"] is True
    put = {"key": key, "value": base64.b64encode(b"v").decode()}
    transport.request(etcd_server.client_url, "/v3/kv/put", json.dumps(put).encode(), JSON, BOUND)
    event = json.loads(next(chunks))
    assert event["result"]["events"][0]["kv"]["key"] == key
    resp.close()
    transport.close()


def test_refused_connection_is_not_sent() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ConnectFailed) as info:
        Transport().request(f"http://127.0.0.1:{port}", "/v3/kv/range", b"{}", JSON, BOUND)
    assert not_sent(info.value)
    assert f"127.0.0.1:{port}" in str(info.value)


# -- a server of the test's own ----------------------------------------------------------


class _Server:
    """Accepts connections; each request (head and body read) is answered by
    ``answer(index)`` — bytes to send, then ``close`` or keep the connection."""

    def __init__(self, answer: Callable[[int], tuple[bytes, bool]], pace: float = 0.0) -> None:
        self._answer = answer
        self._pace = pace  # seconds between two bytes of a body (0: all at once)
        self.requests = 0
        self.accepted = 0
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(8)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        file = conn.makefile("rb")
        with conn:
            while True:
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    line = file.readline()
                    if not line:
                        return
                    head += line
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                file.read(length)
                index = self.requests
                self.requests += 1
                data, close = self._answer(index)
                # The head at once; the body (paced) a byte at a time.
                head_end = data.find(b"\r\n\r\n") + 4 if self._pace else len(data)
                conn.sendall(data[:head_end])
                for at in range(head_end, len(data)):
                    try:
                        conn.sendall(data[at : at + 1])
                    except OSError:
                        return  # the client gave up
                    time.sleep(self._pace)
                if close:
                    return

    def close(self) -> None:
        self._sock.close()


@pytest.fixture
def serve() -> Iterator[Callable[..., _Server]]:
    servers: list[_Server] = []

    def start(answer: Callable[[int], tuple[bytes, bool]], pace: float = 0.0) -> _Server:
        servers.append(_Server(answer, pace))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _ok(body: bytes = b'{"ok":1}') -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def test_connection_closed_by_the_server_is_not_reused(serve: Any) -> None:
    """The server hangs up after each answer (as after an idle timeout): the next
    request opens a new connection instead of failing on the dead one."""
    server = serve(lambda i: (_ok(), True))
    transport = Transport()
    for _ in range(3):
        resp, data = transport.request(server.url, "/p", b"{}", JSON, BOUND)
        assert (resp.status, data) == (200, b'{"ok":1}')
        time.sleep(0.05)  # the hang-up reaches us
    assert server.accepted == 3


def test_connection_close_header_is_honoured(serve: Any) -> None:
    answer = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"
    server = serve(lambda i: (answer, False))
    transport = Transport()
    for _ in range(2):
        assert transport.request(server.url, "/p", b"{}", JSON, BOUND)[1] == b"{}"
    assert server.accepted == 2


def test_chunked_answer_is_joined(serve: Any) -> None:
    answer = (
        b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n1;ext=1\r\n \r\n5\r\nworld\r\n0\r\nX-Trailer: 1\r\n\r\n"
    )
    server = serve(lambda i: (answer, False))
    transport = Transport()
    resp, data = transport.request(server.url, "/p", b"{}", JSON, BOUND)
    assert (resp.status, data) == (503, b"hello world")
    # Read to its end, the connection serves the next request.
    assert transport.request(server.url, "/p", b"{}", JSON, BOUND)[1] == b"hello world"
    assert server.accepted == 1


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", BadResponse),
        (b"HTTP/1.1 abc OK\r\n\r\n", BadResponse),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", http.client.IncompleteRead),
        (b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n", BadResponse),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", BadResponse),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\nabc", BadResponse),
        (b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70000 + b"\r\n\r\n", BadResponse),
        (b"", http.client.RemoteDisconnected),
    ],
    ids=[
        "not-http",
        "bad-status",
        "cut-body",
        "bad-length",
        "bad-chunk",
        "cut-chunk",
        "long-header",
        "hang-up",
    ],
)
def test_malformed_answer_fails_and_drops_the_connection(
    serve: Any, answer: bytes, error: type[Exception]
) -> None:
    server = serve(lambda i: (answer, True) if i == 0 else (_ok(), False))
    transport = Transport()
    with pytest.raises(error):
        transport.request(server.url, "/p", b"{}", JSON, BOUND)
    # The next request does not read the rest of the broken answer.
    assert transport.request(server.url, "/p", b"{}", JSON, BOUND)[1] == b'{"ok":1}'
    assert server.accepted == 2


def test_silent_server_times_out(serve: Any) -> None:
    server = serve(lambda i: (b"", False))  # reads the request, never answers
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        Transport().request(server.url, "/p", b"{}", JSON, 0.5)
    assert time.monotonic() - began < BOUND


def test_trickling_answer_ends_by_the_deadline(serve: Any) -> None:
    """An answer whose body comes a byte every 50 ms (10 s in all) fails at the request's
    deadline: each read may wait only for what is left of it, not the whole timeout."""
    server = serve(lambda i: (_ok(b"x" * 200), False), pace=0.05)
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        Transport().request(server.url, "/p", b"{}", JSON, 0.6)
    assert 0.5 < time.monotonic() - began < 2.0


def _chunked(*chunks: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks)
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"


def test_a_stream_is_read_in_windows_and_a_timeout_loses_nothing(serve: Any) -> None:
    """A watch stream is read by its waiting thread a window at a time: ``read_by``
    moves the deadline on (past the request's own), and a read that times out in the
    middle of a chunk loses none of its bytes."""
    answer = _chunked(b"a" * 10, b"b" * 10, b"c" * 10)  # about 1.3 s at 20 ms a byte
    server = serve(lambda i: (answer, False), pace=0.02)
    transport = Transport()
    resp, _ = transport.request(server.url, "/w", b"{}", JSON, 0.5, stream=True)
    began = time.monotonic()
    parts, timeouts = [], 0
    while time.monotonic() - began < 10:
        resp.read_by(time.monotonic() + 0.07)
        try:
            part = resp.read_some()
        except TimeoutError:
            timeouts += 1
            continue
        if not part:
            break
        parts.append(part)
    assert b"".join(parts) == b"a" * 10 + b"b" * 10 + b"c" * 10
    assert timeouts >= 3  # windows ended inside chunks (and size lines), and nothing was lost
    assert time.monotonic() - began > 0.5  # past the request's own deadline
    resp, _ = transport.request(server.url, "/w", b"{}", JSON, BOUND, stream=True)
    resp.read_by(time.monotonic() + 0.5)
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        list(resp.chunks())
    assert time.monotonic() - began < 1.5
    resp.close()


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"5\r\nabcdefg\r\n0\r\n\r\n", "longer than its size"),
        (b"-5\r\nabcde\r\n0\r\n\r\n", "not a chunk size"),
        (b"0x5\r\nabcde\r\n0\r\n\r\n", "not a chunk size"),
        (b"5\r\nabc", "ended inside"),
        (b"f" * 70000, "over 65536 bytes"),
    ],
)
def test_a_malformed_chunked_body_is_refused(serve: Any, body: bytes, reason: str) -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    server = serve(lambda i: (head + body, True))
    with pytest.raises(BadResponse, match=reason):
        Transport().request(server.url, "/p", b"{}", JSON, BOUND)


def test_bytes_after_a_chunked_answer_keep_its_connection_from_reuse(serve: Any) -> None:
    """A server that sends anything after the end of an answer is not to be trusted
    with the next request on that connection."""
    answer = _chunked(b"done") + b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    server = serve(lambda i: (answer, False))
    transport = Transport()
    for _ in range(2):
        resp, data = transport.request(server.url, "/p", b"{}", JSON, BOUND)
        assert (resp.status, data) == (200, b"done")
    assert server.accepted == 2


def test_interim_answer_is_skipped(serve: Any) -> None:
    server = serve(lambda i: (b"HTTP/1.1 100 Continue\r\n\r\n" + _ok(), False))
    assert Transport().request(server.url, "/p", b"{}", JSON, BOUND)[1] == b'{"ok":1}'


# -- untrusted answers: lengths, sizes --------------------------------------------------


@pytest.mark.parametrize(
    "length",
    [b"0_2", b"+5", b"-5", b" 5 5", b"5, 6", b"0x5", b"\xd9\xa3", b"1" * 19],
    ids=[
        "underscore",
        "plus",
        "negative",
        "inner-space",
        "differing",
        "hex",
        "arabic",
        "19-digits",
    ],
)
def test_a_content_length_is_ascii_digits_only(serve: Any, length: bytes) -> None:
    """Python's ``int`` takes ``0_2``, ``+5``, ``-5`` and other scripts' digits; HTTP
    does not. And the connection of such an answer is not used again."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: " + length + b"\r\n\r\n{}"
    server = serve(lambda i: (answer, False) if i == 0 else (_ok(), False))
    transport = Transport()
    with pytest.raises(BadResponse, match=f"{server.url} answered an invalid Content-Length"):
        transport.request(server.url, "/p", b"{}", JSON, BOUND)
    assert transport.request(server.url, "/p", b"{}", JSON, BOUND)[1] == b'{"ok":1}'
    assert server.accepted == 2


def test_repeated_equal_lengths_are_one_length(serve: Any) -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2, 2\r\n\r\n{}"
    server = serve(lambda i: (answer, False))
    assert Transport().request(server.url, "/p", b"{}", JSON, BOUND)[1] == b"{}"


def test_a_connection_after_a_negative_length_is_not_reused(serve: Any) -> None:
    """Read as Python reads ``-5`` (``file.read(-5)``: to the end), the answer would
    have swallowed what came after it and gone back to the pool."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n{}"
    server = serve(lambda i: (answer, False) if i == 0 else (_ok(), False))
    transport = Transport()
    with pytest.raises(BadResponse):
        transport.request(server.url, "/p", b"{}", JSON, BOUND)
    assert not transport._idle.get(transport._endpoint(server.url))
    transport.request(server.url, "/p", b"{}", JSON, BOUND)
    assert server.accepted == 2


def test_a_huge_announced_length_fails_at_once(serve: Any) -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000000\r\n\r\n{}"
    server = serve(lambda i: (answer, False))
    began = time.monotonic()
    with pytest.raises(BadResponse, match=r"announced an answer of 1000000000000 bytes, over 4096"):
        Transport(max_response_bytes=4096).request(server.url, "/p", b"{}", JSON, BOUND)
    assert time.monotonic() - began < 1.0


@pytest.mark.parametrize("framing", ["chunked", "until-close", "length"])
def test_a_body_over_the_bound_is_refused(serve: Any, framing: str) -> None:
    body = b"x" * 5000
    if framing == "chunked":
        answer = _chunked(*[body[i : i + 100] for i in range(0, len(body), 100)])
    elif framing == "until-close":
        answer = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body
    else:
        answer = _ok(body)
    server = serve(lambda i: (answer, True))
    with pytest.raises(BadResponse, match=f"{server.url} .*over 4096"):
        Transport(max_response_bytes=4096).request(server.url, "/p", b"{}", JSON, BOUND)
    # Within the bound, the same answers are read.
    assert Transport(max_response_bytes=5000).request(server.url, "/p", b"{}", JSON, BOUND)[1] == (
        body
    )


def test_a_chunk_over_the_bound_is_refused(serve: Any) -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    server = serve(lambda i: (head + b"ffffffffffff\r\nabc", True))
    with pytest.raises(BadResponse, match="announced a chunk of 281474976710655 bytes"):
        Transport().request(server.url, "/p", b"{}", JSON, BOUND, stream=True)[0].read_some()


def test_an_unknown_transfer_coding_is_refused(serve: Any) -> None:
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"
    server = serve(lambda i: (answer, True))
    with pytest.raises(BadResponse, match="Transfer-Encoding"):
        Transport().request(server.url, "/p", b"{}", JSON, BOUND)


# -- parsing what comes back: nesting, shape, errors, stream messages -----------------------


def test_nesting_is_bounded_before_the_decoder_sees_it() -> None:
    from etcd_rdzv._kv._json import MAX_DEPTH, loads, too_deep

    assert loads(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH, "x") is not None
    for deep in (b"[" * 200_000 + b"]" * 200_000, b'{"a":' * 5000 + b"1" + b"}" * 5000):
        began = time.monotonic()
        with pytest.raises(
            BadResponse, match=f"http://e answered JSON nested deeper than {MAX_DEPTH}"
        ):
            loads(deep, "http://e")
        assert time.monotonic() - began < 1.0
    # Brackets inside strings are text, not nesting; many shallow ones are fine too.
    assert not too_deep(b'["' + b"[" * 1000 + b'"]')
    assert not too_deep(b'["\\"' + b"[" * 1000 + b'"]')
    assert not too_deep(b"[" + b"[]," * 10_000 + b"[]]")
    assert too_deep(b"[" * (MAX_DEPTH + 1))  # unclosed: no JSON either
    with pytest.raises(BadResponse, match="http://e answered what is not JSON"):
        loads(b"\xff\xfe", "http://e")


@pytest.mark.parametrize(
    "answer",
    [
        {"header": "x"},
        {"header": {"revision": "1_0"}},
        {"header": {"revision": True}},
        {"kvs": "abc"},
        {"kvs": [1]},
        {"kvs": [{"key": "not base64!"}]},
        {"responses": [{"response_put": []}]},
        {"succeeded": "yes"},
        {"result": {"events": [{"kv": {"mod_revision": {}}}]}},
        {"error": 5},
        {"keys": ["YQ==", 1]},
    ],
)
def test_an_answer_of_the_wrong_shape_is_refused(answer: dict[str, Any]) -> None:
    from etcd_rdzv._kv.v3._shape import checked

    with pytest.raises(BadResponse, match="http://e answered what is not etcd's answer"):
        checked(answer, "http://e")


def test_answers_etcd_sends_pass_the_shape_check(etcd_server: EtcdServer) -> None:
    from etcd_rdzv._kv.v3._shape import checked

    transport = Transport()
    put = {"key": base64.b64encode(b"/shape").decode(), "value": "dg==", "prev_kv": True}
    for path, body in [
        ("/v3/kv/put", put),
        ("/v3/kv/put", put),
        ("/v3/kv/range", {"key": put["key"]}),
        ("/v3/lease/grant", {"TTL": "30"}),
        ("/v3/kv/txn", {"success": [{"request_range": {"key": put["key"]}}]}),
    ]:
        _, data = transport.request(
            etcd_server.client_url, path, json.dumps(body).encode(), JSON, BOUND
        )
        answer = json.loads(data or b"")
        assert checked(answer, "x") is answer
    transport.close()


def _gateway() -> Any:
    from etcd_rdzv._kv.v3 import V3KV

    return V3KV(["http://e:1"], 1.0)


@pytest.mark.parametrize(
    ("status", "body", "code", "message"),
    [
        # etcd >= 3.6: no top-level "error" in unary errors.
        (400, b'{"code":9,"message":"etcdserver: key not found"}', 9, "etcdserver: key not found"),
        # etcd 3.5: both.
        (400, b'{"error":"etcdserver: x","code":3,"message":"etcdserver: x"}', 3, "etcdserver: x"),
        # Streams.
        (200, b'{"error":{"code":14,"message":"unavailable","details":[]}}', 14, "unavailable"),
    ],
)
def test_gateway_errors_are_read_by_code_and_message(
    status: int, body: bytes, code: int, message: str
) -> None:
    from etcd_rdzv._kv.v3._wire import EtcdError

    with pytest.raises(EtcdError) as info:
        _gateway()._decode(0, status, body, None)
    assert (info.value.code, info.value.message) == (code, message)


@pytest.mark.parametrize("body", [b'{"reason":"busy"}', b"<html>busy</html>", b"[" * 10_000])
def test_a_5xx_that_is_not_etcds_error_is_a_bad_answer(body: bytes) -> None:
    with pytest.raises(BadResponse, match="http://e:1"):
        _gateway()._decode(0, 503, body, None)


def test_one_stream_message_is_bounded(serve: Any) -> None:
    """A watch stream that never ends its line grows no buffer past the bound."""
    from etcd_rdzv._kv.v3._wire import Messages

    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    line = _chunked(b'{"result":{}}\n')[len(head) : -5]
    endless = head + line + b"".join(b"400\r\n" + b"x" * 1024 + b"\r\n" for _ in range(64))
    server = serve(lambda i: (endless, False))
    resp, _ = Transport(max_response_bytes=8192).request(
        server.url, "/w", b"{}", JSON, BOUND, stream=True
    )
    messages = Messages(resp)
    assert messages.next() == {"result": {}}
    with pytest.raises(BadResponse, match=f"{server.url} sent a stream message over 8192 bytes"):
        messages.next()
