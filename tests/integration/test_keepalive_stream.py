"""v3 lease keep-alives go over one gRPC stream per client, counted at etcd.

etcd counts its gRPC streams (``grpc_server_started_total``) and the messages they
received (``grpc_server_msg_received_total``) by method; a keep-alive through the
JSON gateway is a LeaseKeepAlive stream of its own, one per request. So "renewals
over the stream" is: the message count rises by one per renewal while the stream
count rises by at most one in all. Then: a revoked lease is reported gone, the
stream comes back after etcd restarts, an endpoint that speaks no HTTP/2 (an
HTTP/1.1 proxy in front of etcd) is renewed through the gateway, and an endpoint
that speaks broken HTTP/2 (garbage, a huge frame, silence) ends in our error within
the read timeout, never a hang.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousParameters
from etcd_rdzv._kv import KV, _stall
from etcd_rdzv._kv.v3 import _keepalive_stream
from etcd_rdzv._kv.v3._hpack import encode
from etcd_rdzv.errors import RendezvousConnectionError
from etcd_rdzv.testing import EtcdCluster, EtcdServer, TLSFiles
from etcd_rdzv.testing.pytest_plugin import skip_or_fail

from ._certs import find_openssl, generate
from ._rawkv import v3_post

pytestmark = pytest.mark.etcd_variants("v3", "v3-3.4")

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty SETTINGS frame


def lease_streams(url: str, context: ssl.SSLContext | None = None) -> tuple[int, int]:
    """etcd's LeaseKeepAlive (streams started, messages received) so far."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5, context=context) as resp:
        text = resp.read().decode()
    counts = []
    for metric in ("grpc_server_started_total", "grpc_server_msg_received_total"):
        found = re.search(
            rf'^{metric}{{[^}}]*grpc_method="LeaseKeepAlive"[^}}]*}} (\S+)$', text, re.M
        )
        counts.append(int(float(found.group(1))) if found else 0)
    return counts[0], counts[1]


def revoke(url: str, lease_id: int) -> None:
    body = json.dumps({"ID": str(lease_id)}).encode()
    request = urllib.request.Request(f"{url}/v3/lease/revoke", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=5) as resp:
        resp.read()


def test_renewals_go_over_one_stream(
    etcd_api_server: EtcdServer, etcd_api_params: Callable[..., RendezvousParameters]
) -> None:
    kv = etcd_rdzv.create_client(etcd_api_params(read_timeout=5))
    try:
        lease = kv.grant(10)
        streams, messages = lease_streams(etcd_api_server.client_url)
        for _ in range(10):
            assert kv.keep_alive(lease) == []
        streams_now, messages_now = lease_streams(etcd_api_server.client_url)
        assert messages_now - messages == 10
        assert streams_now - streams == 1, "a stream per renewal: the gateway was used"
    finally:
        kv.close()


def test_a_revoked_lease_is_reported_gone(
    etcd_api_server: EtcdServer,
    etcd_api_params: Callable[..., RendezvousParameters],
    etcd_key_prefix: str,
) -> None:
    kv = etcd_rdzv.create_client(etcd_api_params(read_timeout=5))
    key = f"{etcd_key_prefix}/alive"
    try:
        lease = kv.grant(10)
        kv.put_owned(key, "here", lease)
        assert kv.keep_alive(lease) == []  # the stream is open
        streams, _ = lease_streams(etcd_api_server.client_url)
        revoke(etcd_api_server.client_url, lease.id)
        assert kv.keep_alive(lease) == [key]
        assert lease.id == 0
        assert lease_streams(etcd_api_server.client_url)[0] == streams  # the same stream
    finally:
        kv.close()


def test_the_stream_comes_back_after_etcd_restarts() -> None:
    with EtcdServer("restarted", enable_v2=False) as etcd:
        kv = etcd_rdzv.create_client(etcd.params(api="v3", read_timeout=5))
        try:
            lease = kv.grant(30)
            assert kv.keep_alive(lease) == []
            etcd.stop()
            with pytest.raises(RendezvousConnectionError, match=re.escape(etcd.client_url)):
                kv.keep_alive(lease)
            etcd.start()
            streams, messages = lease_streams(etcd.client_url)
            assert kv.keep_alive(lease) == []  # the lease survived the restart
            assert kv.keep_alive(lease) == []
            assert lease_streams(etcd.client_url) == (streams + 1, messages + 2)
        finally:
            kv.close()


def test_a_renewal_not_answered_in_time_keeps_the_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """etcd paused past a renewal's time: the renewal fails, its stream is cancelled,
    and the connection stays, so the renewals after it open no connection again
    (under load, thousands of nodes connecting again on every failed renewal kept etcd
    from catching up). The cancelled stream's late answer is not read as a later one's:
    the next renewal goes on a new stream, answered once each."""
    opened: list[str] = []
    open_connection = _keepalive_stream.H2Connection.open

    def counted(url: str, *args: object, **kwargs: object) -> object:
        opened.append(url)
        return open_connection(url, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_keepalive_stream.H2Connection, "open", staticmethod(counted))
    with EtcdServer("paused", enable_v2=False) as etcd:
        kv = etcd_rdzv.create_client(etcd.params(api="v3", read_timeout=1))
        try:
            lease = kv.grant(30)
            assert kv.keep_alive(lease) == []
            assert len(opened) == 1
            streams, messages = lease_streams(etcd.client_url)
            etcd.pause()
            try:
                with pytest.raises(RendezvousConnectionError, match="lease keep-alive"):
                    kv.keep_alive(lease)
            finally:
                etcd.unpause()
            for _ in range(3):
                assert kv.keep_alive(lease) == []
            assert len(opened) == 1, f"connected again: {opened}"
            streams_now, messages_now = lease_streams(etcd.client_url)
            # The paused renewal's stream, and one new stream for the three after it.
            assert streams_now - streams == 1, (streams, streams_now)
            assert messages_now - messages == 4, (messages, messages_now)
        finally:
            kv.close()


def test_over_tls_with_client_certificates(
    tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """ALPN h2 with the client's TLS settings (CA, client certificate)."""
    openssl = find_openssl()
    if openssl is None:
        skip_or_fail("the openssl CLI is needed to make test certificates")
    certs = generate(tmp_path_factory.mktemp("certs"), openssl)
    tls = TLSFiles(certs.server_cert, certs.server_key, certs.ca, client_ca=certs.ca)
    context = ssl.create_default_context(cafile=certs.ca)
    context.load_cert_chain(certs.client_cert, certs.client_key)
    caplog.set_level("INFO", logger="etcd_rdzv._kv.v3._keepalive_stream")
    with EtcdServer("mtls", enable_v2=False, tls=tls) as etcd:
        params = etcd.params(
            api="v3", ssl_cert=certs.client_cert, ssl_cert_key=certs.client_key, read_timeout=5
        )
        _renewals_go_over_one_stream(etcd, params, context)
    assert f"keep-alives to {etcd.client_url} go over one gRPC stream" in caplog.text


def test_with_auth() -> None:
    """With auth on, the stream carries the client's token (gRPC metadata)."""
    with EtcdServer("auth", enable_v2=False) as etcd:
        url = etcd.client_url
        v3_post(url, "/v3/auth/user/add", {"name": "root", "password": "rootpw"})
        v3_post(url, "/v3/auth/user/grant", {"user": "root", "role": "root"})
        v3_post(url, "/v3/auth/enable", {})
        params = etcd.params(api="v3", username="root", password="rootpw", read_timeout=5)
        _renewals_go_over_one_stream(etcd, params, None)


def _renewals_go_over_one_stream(
    etcd: EtcdServer, params: RendezvousParameters, context: ssl.SSLContext | None
) -> None:
    kv = etcd_rdzv.create_client(params)
    try:
        lease = kv.grant(10)
        kv.put_owned("/keepalive/alive", "yes", lease)
        streams, messages = lease_streams(etcd.client_url, context)
        for _ in range(5):
            assert kv.keep_alive(lease) == []
        assert lease_streams(etcd.client_url, context) == (streams + 1, messages + 5)
    finally:
        kv.close()


def prompt_answers(kv: KV) -> None:
    """Answers enough for the client to judge how promptly the cluster answers (the
    stream looks for the leader only then)."""
    for _ in range(_stall.KNOWN):
        kv.get("/prompt")


def test_on_a_cluster_renewals_go_to_the_leader_and_follow_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A keep-alive sent to a follower is forwarded to the leader (costing both): the
    stream goes to the leader, found among the client's endpoints, and to the next
    one after the leader dies. (The first look waits a random few seconds, so that
    a job's nodes do not all ask at once: not here.)"""
    monkeypatch.setattr(_keepalive_stream, "FIRST_LOOK", (0.0, 0.0))
    monkeypatch.setattr(_keepalive_stream, "AFTER_ELECTION", (0.0, 0.0))
    with EtcdCluster(3, enable_v2=False) as cluster:
        leader = cluster.leader(10)
        followers = [m for m in cluster.members if m is not leader]
        endpoints = ",".join(m.endpoint for m in [*followers, leader])  # the leader last
        params = RendezvousParameters("etcd-rdzv", endpoints, "run", 1, 1, api="v3", read_timeout=5)
        kv = etcd_rdzv.create_client(params)

        try:
            lease = kv.grant(30)
            prompt_answers(kv)
            before = renewals(cluster)
            for _ in range(5):
                assert kv.keep_alive(lease) == []
            after = renewals(cluster)
            assert after[leader.name] - before[leader.name] == 5
            assert all(after[m.name] == before[m.name] for m in followers)

            leader.kill()
            new = cluster.leader(10)
            until = time.monotonic() + 10
            while True:  # the first renewals may meet the election
                try:
                    assert kv.keep_alive(lease) == []
                    break
                except RendezvousConnectionError:
                    assert time.monotonic() < until
            before = renewals(cluster)
            for _ in range(5):
                assert kv.keep_alive(lease) == []
            after = renewals(cluster)
            assert after[new.name] - before[new.name] == 5, (new.name, before, after)
        finally:
            kv.close()


def renewals(cluster: EtcdCluster) -> dict[str, int]:
    """The LeaseKeepAlive messages each running member of ``cluster`` received so far."""
    return {m.name: lease_streams(m.client_url)[1] for m in cluster.members if m.running}


def _grpc_count(url: str, method: str, metric: str = "grpc_server_started_total") -> int:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found = re.search(rf'^{metric}{{[^}}]*grpc_method="{method}"[^}}]*}} (\S+)$', text, re.M)
    return int(float(found.group(1))) if found else 0


def test_after_an_election_renewals_go_where_they_went_and_the_leader_is_looked_for_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every node of a job sees an election at once: its status requests and new
    connections would all come then, on a cluster that just lost its leader. The
    stream stays where it is (the old leader forwards) and looks for the new leader
    a random AFTER_ELECTION seconds later (fixed here)."""
    monkeypatch.setattr(_keepalive_stream, "FIRST_LOOK", (0.0, 0.0))
    monkeypatch.setattr(_keepalive_stream, "AFTER_ELECTION", (3.0, 3.0))
    with EtcdCluster(3, enable_v2=False) as cluster:
        leader = cluster.leader(10)
        followers = [m for m in cluster.members if m is not leader]
        endpoints = ",".join(m.endpoint for m in [*followers, leader])
        params = RendezvousParameters("etcd-rdzv", endpoints, "run", 1, 1, api="v3", read_timeout=5)
        kv = etcd_rdzv.create_client(params)
        ids = {
            m.name: v3_post(m.client_url, "/v3/maintenance/status", {})["header"]["member_id"]
            for m in cluster.members
        }

        def counts(method: str, metric: str = "grpc_server_started_total") -> dict[str, int]:
            return {m.name: _grpc_count(m.client_url, method, metric) for m in cluster.members}

        try:
            lease = kv.grant(30)
            prompt_answers(kv)
            assert kv.keep_alive(lease) == []  # the first look: the stream is on the leader
            new = followers[0]
            v3_post(
                leader.client_url,
                "/v3/maintenance/transfer-leadership",
                {"targetID": ids[new.name]},
            )
            assert kv.keep_alive(lease) == []  # its answer carries the new term
            asked, before = counts("Status"), renewals(cluster)
            for _ in range(5):
                assert kv.keep_alive(lease) == []
            assert counts("Status") == asked, "the stream looked for the leader at once"
            after = renewals(cluster)
            assert after[leader.name] - before[leader.name] == 5, (before, after)

            time.sleep(3.2)
            before = renewals(cluster)
            for _ in range(5):
                assert kv.keep_alive(lease) == []
            after = renewals(cluster)
            assert after[new.name] - before[new.name] == 5, (new.name, before, after)
            looked = sum(counts("Status").values()) - sum(asked.values())
            assert looked == 1, "one status answer names the new leader among known members"
        finally:
            kv.close()


def test_a_cluster_that_answers_late_is_not_asked_for_its_leader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A loaded cluster answers late; asking its members for their status then is
    load of its own (thousands of clients ask), and moving every stream to the leader
    puts them all on the member that must keep raft going. So while this client's
    latest answers came late (its member frozen for a moment during each), renewals
    go where requests go and no member is asked; once KNOWN answers in a row came
    promptly, the stream looks for the leader and goes there."""
    monkeypatch.setattr(_keepalive_stream, "FIRST_LOOK", (0.0, 0.0))
    monkeypatch.setattr(_keepalive_stream, "AFTER_ELECTION", (0.0, 0.0))
    with EtcdCluster(3, enable_v2=False) as cluster:
        leader = cluster.leader(10)
        first, second = [m for m in cluster.members if m is not leader]
        endpoints = ",".join(m.endpoint for m in [first, second, leader])
        params = RendezvousParameters("etcd-rdzv", endpoints, "run", 1, 1, api="v3", read_timeout=5)
        kv = etcd_rdzv.create_client(params)

        def asked() -> int:
            return sum(_grpc_count(m.client_url, "Status") for m in cluster.members)

        try:
            lease = kv.grant(30)
            for _ in range(_stall.KNOWN):  # each answer comes 0.8 s late
                first.pause()
                resume = threading.Timer(0.8, first.resume)
                resume.start()
                try:
                    began = time.monotonic()
                    kv.get("/late")
                    assert time.monotonic() - began > _stall.PROMPT
                finally:
                    resume.join()
            status, before = asked(), renewals(cluster)
            for _ in range(_stall.KNOWN):  # the answers before the last KNOWN were late
                assert kv.keep_alive(lease) == []
            after = renewals(cluster)
            assert asked() == status, "a member was asked while answers came late"
            assert after[first.name] - before[first.name] == _stall.KNOWN, (before, after)
            assert after[leader.name] == before[leader.name], (before, after)

            before = renewals(cluster)
            for _ in range(3):  # now KNOWN prompt answers in a row: the look
                assert kv.keep_alive(lease) == []
            after = renewals(cluster)
            assert asked() > status
            assert after[leader.name] - before[leader.name] == 3, (leader.name, before, after)
        finally:
            kv.close()


# -- endpoints that are not etcd's gRPC ----------------------------------------------------


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def front(etcd: EtcdServer, on_h2: Callable[[socket.socket], None]) -> Iterator[str]:
    """A proxy on loopback in front of ``etcd``: HTTP/1.1 connections are passed on,
    a connection that opens with the HTTP/2 preface is handed to ``on_h2``. Yields
    its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    conns: list[socket.socket] = []

    def serve(conn: socket.socket) -> None:
        conn.settimeout(30)
        with contextlib.suppress(OSError):
            head = b""
            while len(head) < len(_PREFACE) and (data := conn.recv(len(_PREFACE) - len(head))):
                head += data
            if head == _PREFACE:
                on_h2(conn)
                return
            upstream = socket.create_connection(("127.0.0.1", etcd.client_port))
            conns.append(upstream)
            upstream.sendall(head)
            threading.Thread(target=_pipe, args=(upstream, conn), daemon=True).start()
            _pipe(conn, upstream)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                conns.append(conn)
                threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.close()


def _http1_proxy(conn: socket.socket) -> None:
    """What a proxy that speaks only HTTP/1.1 answers to the HTTP/2 preface."""
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    conn.close()


def _hold(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while conn.recv(65536):
            pass


def _silent(conn: socket.socket) -> None:
    """Reads what the client sends, answers nothing."""
    _hold(conn)


def _garbage(conn: socket.socket) -> None:
    """SETTINGS, then a PING frame of 3 bytes (they are 8)."""
    conn.sendall(_SETTINGS + b"\x00\x00\x03\x06\x00\x00\x00\x00\x00abc")
    _hold(conn)


def _huge_frame(conn: socket.socket) -> None:
    """SETTINGS, then a DATA frame announced at 16 MiB, and a flood of it."""
    conn.sendall(_SETTINGS + b"\xff\xff\xff\x00\x00\x00\x00\x00\x01")
    with contextlib.suppress(OSError):
        for _ in range(1024):
            conn.sendall(b"x" * 16384)
    _hold(conn)


def _settings_then_silence(conn: socket.socket) -> None:
    conn.sendall(_SETTINGS)
    _hold(conn)


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload
    )


def _grpc_status(
    code: int, message: str, *, trailers_only: bool
) -> Callable[[socket.socket], None]:
    """An HTTP/2 server that ends the client's first stream with a gRPC status."""

    def answer(conn: socket.socket) -> None:
        conn.sendall(_SETTINGS)
        time.sleep(0.1)  # the client's HEADERS (stream 1) and DATA
        status = [("grpc-status", str(code)), ("grpc-message", message.replace(" ", "%20"))]
        head = [(":status", "200"), ("content-type", "application/grpc")]
        if trailers_only:
            conn.sendall(_frame(1, 0x5, 1, encode(head + status)))
        else:
            conn.sendall(_frame(1, 0x4, 1, encode(head)) + _frame(1, 0x5, 1, encode(status)))
        _hold(conn)

    return answer


def test_a_grpc_error_status_is_etcds_error(
    etcd_api_server: EtcdServer, etcd_key_prefix: str
) -> None:
    """ "no leader" in the trailers: retried as the gateway's error would be (transient),
    until the read timeout, then our error with etcd's message."""
    hostile = _grpc_status(14, "etcdserver: no leader", trailers_only=False)
    with front(etcd_api_server, hostile) as endpoint:
        params = RendezvousParameters(
            "etcd-rdzv", endpoint, "run", 1, 1, api="v3", key_prefix=etcd_key_prefix, read_timeout=2
        )
        kv = etcd_rdzv.create_client(params)
        try:
            lease = kv.grant(10)
            started = time.monotonic()
            with pytest.raises(RendezvousConnectionError, match="etcdserver: no leader"):
                kv.keep_alive(lease)
            assert time.monotonic() - started < 2 + 1.5
        finally:
            kv.close()


def test_an_endpoint_without_the_grpc_service_is_renewed_through_the_gateway(
    etcd_api_server: EtcdServer, etcd_key_prefix: str
) -> None:
    """UNIMPLEMENTED (12) in a trailers-only answer: the gateway, at once."""
    hostile = _grpc_status(12, "unknown service", trailers_only=True)
    with front(etcd_api_server, hostile) as endpoint:
        params = RendezvousParameters(
            "etcd-rdzv", endpoint, "run", 1, 1, api="v3", key_prefix=etcd_key_prefix
        )
        kv = etcd_rdzv.create_client(params)
        try:
            lease = kv.grant(10)
            streams, messages = lease_streams(etcd_api_server.client_url)
            for _ in range(2):
                assert kv.keep_alive(lease) == []
            assert lease_streams(etcd_api_server.client_url) == (streams + 2, messages + 2)
        finally:
            kv.close()


def test_without_quorum_renewals_fail_within_the_read_timeout() -> None:
    with EtcdCluster(3, enable_v2=False) as cluster:
        leader = cluster.leader(10)
        params = RendezvousParameters(
            "etcd-rdzv", cluster.endpoint, "run", 1, 1, api="v3", read_timeout=2
        )
        kv = etcd_rdzv.create_client(params)
        try:
            lease = kv.grant(30)
            assert kv.keep_alive(lease) == []
            # Killed: a leader stopped gracefully hands its leadership over first.
            leader.kill()
            next(m for m in cluster.members if m.running).kill()
            started = time.monotonic()
            with pytest.raises(RendezvousConnectionError, match="lease keep-alive"):
                kv.keep_alive(lease)
            assert time.monotonic() - started < 2 + 1.5
        finally:
            kv.close()


def test_an_endpoint_without_http2_is_renewed_through_the_gateway(
    etcd_api_server: EtcdServer, etcd_key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="etcd_rdzv._kv.v3._keepalive_stream")
    with front(etcd_api_server, _http1_proxy) as endpoint:
        params = RendezvousParameters(
            "etcd-rdzv", endpoint, "run", 1, 1, api="v3", key_prefix=etcd_key_prefix
        )
        kv = etcd_rdzv.create_client(params)
        try:
            lease = kv.grant(10)
            streams, messages = lease_streams(etcd_api_server.client_url)
            for _ in range(3):
                assert kv.keep_alive(lease) == []
            assert lease_streams(etcd_api_server.client_url) == (streams + 3, messages + 3)
        finally:
            kv.close()
    assert "go through the JSON gateway" in caplog.text


@pytest.mark.parametrize(
    ("hostile", "error"),
    [
        (_silent, "did not answer"),
        (_garbage, "malformed PING"),
        (_huge_frame, "a frame of 16777215 bytes"),
        (_settings_then_silence, "did not answer"),
    ],
    ids=["silent", "garbage", "huge-frame", "settings-then-silence"],
)
def test_a_hostile_http2_endpoint_fails_in_time(
    etcd_api_server: EtcdServer,
    etcd_key_prefix: str,
    hostile: Callable[[socket.socket], None],
    error: str,
) -> None:
    read_timeout = 2
    with front(etcd_api_server, hostile) as endpoint:
        params = RendezvousParameters(
            "etcd-rdzv",
            endpoint,
            "run",
            1,
            1,
            api="v3",
            key_prefix=etcd_key_prefix,
            read_timeout=read_timeout,
        )
        kv = etcd_rdzv.create_client(params)
        try:
            lease = kv.grant(10)
            started = time.monotonic()
            with pytest.raises(RendezvousConnectionError, match=re.escape(endpoint)) as failed:
                kv.keep_alive(lease)
            assert time.monotonic() - started < read_timeout + 1.5
            assert error in str(failed.value)
        finally:
            kv.close()
