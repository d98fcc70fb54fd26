"""python-etcd over this package's transport (``etcd_rdzv._kv.v2._pool``): what
python-etcd asks of urllib3's pool, answered the same way, against a real etcd with
the v2 API.

python-etcd tells a long poll that timed out from a failed request by urllib3's
``ReadTimeoutError``, reads an answer's headers by name, and sends its parameters in
the query (GET, DELETE) or form-encoded (PUT, POST); a key that needs
percent-encoding is encoded as urllib3 did it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import etcd
import pytest

import etcd_rdzv
from etcd_rdzv._kv import Compare, Get, Put
from etcd_rdzv._kv._failover import not_sent
from etcd_rdzv._kv._http import ConnectFailed, Transport
from etcd_rdzv._kv.v2._pool import Pool
from etcd_rdzv.testing import EtcdServer

pytestmark = pytest.mark.etcd_variants("v2")

BOUND = 10.0  # seconds: a hang, not a timing goal


def _client(url: str, pool: Pool) -> Any:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    client = etcd.Client(
        host=host, port=int(port), read_timeout=5, allow_reconnect=False, allow_redirect=False
    )
    client.http.clear()
    client.http = pool
    return client


@pytest.fixture
def client(etcd_api_server: EtcdServer) -> Iterator[Any]:
    pool = Pool(Transport())
    yield _client(etcd_api_server.client_url, pool)
    pool.clear()


def test_writes_reads_and_conditions_go_through(client: Any, etcd_key_prefix: str) -> None:
    key = f"{etcd_key_prefix}/k"
    # A value that form encoding must escape: separators, a newline, non-ASCII.
    value = "a=1&b=2+3 %41\nünïcödé"
    created = client.write(key, value, prevExist=False, ttl=60)
    assert created.newKey and created.value == value and 0 < created.ttl <= 60
    assert created.etcd_index >= created.modifiedIndex  # from the X-Etcd-Index header
    assert client.read(key).value == value
    with pytest.raises(etcd.EtcdAlreadyExist):
        client.write(key, "again", prevExist=False)
    with pytest.raises(etcd.EtcdCompareFailed):
        client.write(key, "x", prevIndex=created.modifiedIndex + 1000)
    client.write(key, "y", prevIndex=created.modifiedIndex)
    client.delete(key)
    with pytest.raises(etcd.EtcdKeyNotFound):
        client.read(key)


def test_a_long_poll_that_times_out_is_a_watch_timeout(client: Any, etcd_key_prefix: str) -> None:
    key = f"{etcd_key_prefix}/quiet"
    index = client.write(key, "v").modifiedIndex
    began = time.monotonic()
    with pytest.raises(etcd.EtcdWatchTimedOut):
        client.read(key, wait=True, waitIndex=index + 1, timeout=0.5)
    assert time.monotonic() - began < BOUND
    # The next request works (the timed-out connection was dropped, not reused).
    assert client.read(key).value == "v"


def test_no_answer_at_all_is_a_failed_request_not_a_quiet_key() -> None:
    """A member that accepts the connection and says nothing (paused, say): a long poll
    to it fails (the watch then moves to another endpoint) instead of looking like a
    quiet key forever; etcd sends a watch's headers at once."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        client = _client(f"http://127.0.0.1:{server.getsockname()[1]}", Pool(Transport()))
        began = time.monotonic()
        with pytest.raises(etcd.EtcdConnectionFailed) as info:
            client.read("/k", wait=True, waitIndex=5, timeout=0.5)
        assert not isinstance(info.value, etcd.EtcdWatchTimedOut)
        assert isinstance(info.value.cause, TimeoutError), repr(info.value.cause)
        assert time.monotonic() - began < BOUND


def test_a_long_poll_returns_the_change(client: Any, etcd_key_prefix: str) -> None:
    key = f"{etcd_key_prefix}/watched"
    index = client.write(key, "one").modifiedIndex
    client.write(key, "two")
    event = client.read(key, wait=True, waitIndex=index + 1, timeout=BOUND)
    assert (event.value, event.modifiedIndex) == ("two", index + 1)


def test_a_key_that_needs_encoding_is_the_key_urllib3_wrote(
    client: Any, etcd_key_prefix: str, etcd_api_server: EtcdServer
) -> None:
    """Keys this package writes are base64 or plain names; any other key is
    percent-encoded as urllib3 (python-etcd's own pool) encodes it."""
    import urllib3

    key = f"{etcd_key_prefix}/a key/ü"
    client.write(key, "ours")
    theirs = _client(etcd_api_server.client_url, urllib3.PoolManager())  # type: ignore[arg-type]
    assert theirs.read(key).value == "ours"
    theirs.write(key, "theirs")
    assert client.read(key).value == "theirs"


def test_a_refused_connection_was_never_sent() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = _client(f"http://127.0.0.1:{port}", Pool(Transport()))
    with pytest.raises(etcd.EtcdConnectionFailed) as info:
        client.write("/k", "v")
    assert isinstance(info.value.cause, ConnectFailed) and not_sent(info.value.cause)


def test_a_request_needs_a_timeout() -> None:
    with pytest.raises(ValueError, match="needs a timeout"):
        Pool(Transport()).request("GET", "http://127.0.0.1:1/v2/keys/k", timeout=None)


# -- what the pool takes and what it lets through ------------------------------------------


def test_keyword_arguments_are_taken_deliberately() -> None:
    pool = Pool(Transport())
    url = "http://127.0.0.1:1/v2/keys/k"
    with pytest.raises(ValueError, match="follows no redirects"):
        pool.request("GET", url, timeout=1, redirect=True)
    with pytest.raises(ValueError, match="form-encodes"):
        pool.request_encode_body("PUT", url, {"value": "v"}, timeout=1, encode_multipart=True)
    with pytest.raises(TypeError):
        pool.request("GET", url, timeout=1, retries=3)  # type: ignore[call-arg]


def test_a_read_timeout_is_urllib3s_type_and_pickles() -> None:
    import pickle

    import urllib3.exceptions as u3exc

    from etcd_rdzv._kv.v2._pool import ReadTimedOut

    error = ReadTimedOut("http://h:1/v2/keys/k", "Read timed out. (read timeout=1)")
    assert isinstance(error, u3exc.ReadTimeoutError)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is ReadTimedOut and str(again) == str(error)
    assert "http://h:1/v2/keys/k" in str(again)


def _urllib3_errors() -> list[tuple[BaseException, bool, str]]:
    """urllib3's errors (python-etcd's vocabulary), whether each means "never sent",
    and how the failover loop describes it."""
    import urllib3.exceptions as u3exc

    refused = u3exc.NewConnectionError(None, "Failed to establish a new connection: refused")
    return [
        (refused, True, "connection failed ("),
        (u3exc.ConnectTimeoutError("connect timed out"), True, "connection failed ("),
        (
            u3exc.SSLError("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"),
            True,
            "TLS error: certificate verify failed",
        ),
        (u3exc.ReadTimeoutError(None, "http://h:1", "Read timed out."), False, "timed out ("),
        (
            u3exc.MaxRetryError(None, "http://h:1/v2/keys/k", reason=refused),
            True,
            "connection failed (",
        ),
        (u3exc.ProtocolError("Connection aborted."), False, "ProtocolError: Connection aborted."),
    ]


@pytest.mark.parametrize(("error", "never_sent", "said"), _urllib3_errors())
def test_urllib3s_errors_become_ours_at_the_v2_edge(
    error: BaseException, never_sent: bool, said: str
) -> None:
    """The failover loop both APIs share knows no urllib3 type (v3 runs without
    urllib3): the v2 layer maps python-etcd's causes to the transport's types first."""
    from etcd_rdzv._kv._failover import describe
    from etcd_rdzv._kv.v2._requests import root_cause

    wrapped = etcd.EtcdConnectionFailed("Connection to etcd failed", cause=error)
    cause = root_cause(wrapped)
    assert not_sent(cause) is never_sent
    assert describe(cause).startswith(said), describe(cause)


def _one_answer_server(answer: bytes) -> tuple[socket.socket, str]:
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    return server, f"http://127.0.0.1:{server.getsockname()[1]}"


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 11\r\n\r\nupstream 42",
            "answered HTTP 503 without etcd's error: b'upstream 42'",
        ),
        (
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\n\r\n{}",
            "answered HTTP 503 without etcd's error",
        ),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n[1,2,3]",
            "answered HTTP 200 that is not etcd's",
        ),
        (
            b'HTTP/1.1 200 OK\r\nContent-Length: 30\r\n\r\n{"action":"get","node":"oops"}',
            "answered HTTP 200 that is not etcd's",
        ),
        (
            b"HTTP/1.1 200 OK\r\nX-Etcd-Index: 0_2\r\nContent-Length: 2\r\n\r\n{}",
            "answered an invalid X-Etcd-Index",
        ),
    ],
    ids=["503-text", "503-json", "list", "node-str", "index"],
)
def test_an_answer_that_is_not_etcds_is_refused_naming_the_endpoint(
    answer: bytes, says: str
) -> None:
    server, url = _one_answer_server(answer)
    try:
        with pytest.raises(etcd.EtcdConnectionFailed) as info:
            _client(url, Pool(Transport())).read("/k")
        assert f"{url} {says}" in str(info.value.cause)
    finally:
        server.close()


def _slow_proxy(upstream: str, delay: float) -> tuple[socket.socket, str]:
    """A TCP proxy to ``upstream`` (``host:port``) whose answers arrive ``delay`` late
    (a loaded etcd, say): its listening socket and its ``host:port``."""
    host, port = upstream.rsplit(":", 1)
    listener = socket.create_server(("127.0.0.1", 0))

    def pipe(src: socket.socket, dst: socket.socket, wait: float) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                time.sleep(wait)
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = listener.accept()
                server = socket.create_connection((host, int(port)))
                threading.Thread(target=pipe, args=(client, server, 0.0), daemon=True).start()
                threading.Thread(target=pipe, args=(server, client, delay), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener, f"127.0.0.1:{listener.getsockname()[1]}"


def test_a_watch_its_caller_cuts_short_finds_nothing_rather_than_failing(
    etcd_api_params: Any, etcd_key_prefix: str
) -> None:
    """A long poll whose wait the caller's deadline cut below ``read_timeout`` (a
    coordinator's last moments on a loaded etcd): no answer yet is a quiet key, not a
    failed member, which only a whole ``read_timeout`` of silence shows. (A round once
    failed with "No etcd endpoint completed watch" in CI.)"""
    params = etcd_api_params(read_timeout=5)
    listener, params.endpoint = _slow_proxy(params.endpoint, 0.2)
    kv = etcd_rdzv.create_client(params)
    try:
        record = kv.put(f"{etcd_key_prefix}/k", "1", None)
        for _ in range(3):
            began = time.monotonic()
            assert kv.watch(f"{etcd_key_prefix}/k", record.revision + 1, 0.05) is None
            assert time.monotonic() - began < BOUND
    finally:
        kv.close()
        listener.close()


def test_a_v2_transaction_reads_keys_of_one_directory_in_one_listing(
    etcd_api_params: Any, etcd_key_prefix: str
) -> None:
    """The compares and the reads before the first write of a v2 transaction, where
    two or more share a directory, are one listing of it (a join reads its run's
    markers so), with the results the reads one by one give."""
    kv = etcd_rdzv.create_client(etcd_api_params())
    d = f"{etcd_key_prefix}/run"
    try:
        a = kv.put(f"{d}/a", "1", None)
        kv.put(f"{d}/sub/x", "2", None)  # a directory beside them: not a key of the listing
        calls: list[str] = []
        get, listing = kv.get, kv.list_prefix
        kv.get = lambda key: (calls.append(f"get {key}"), get(key))[1]
        kv.list_prefix = lambda key: (calls.append(f"list {key}"), listing(key))[1]
        done = kv.txn(
            [Compare(f"{d}/a", "1"), Compare(f"{d}/absent", None)],
            [Get(f"{d}/a"), Get(f"{d}/b"), Put(f"{d}/b", "3"), Get(f"{d}/b")],
        )
        assert done.succeeded
        found = [r.value if r else None for r in done.records]
        assert found == ["1", None, "3", "3"]
        assert done.records[0] == a
        # One listing for the four early reads; the read after the write is its own.
        assert calls == [f"list {d}", f"get {d}/b"], calls
        calls.clear()
        refused = kv.txn([Compare(f"{d}/a", "2"), Compare(f"{d}/b", "3")], [Put(f"{d}/c", "4")])
        assert not refused.succeeded and calls == [f"list {d}"], calls
        assert [r.value if r else None for r in refused.compared] == ["1"]  # the first fails
        assert kv.get(f"{d}/c")[0] is None
    finally:
        kv.close()
