"""How soon a request etcd answered "not now" is sent again, and how spread out.

An endpoint that answers every request with etcd's own error for a while (a member
that is overloaded: "etcdserver: request timed out"; one in an election: "leader
changed") stands in for etcd; it records when each request arrives. Under overload
the client waits about a second before it asks again; after an election, about a
tenth; and the clients that failed together do not come back together (the pauses
are jittered), as thousands of nodes that met one overload must not.
"""

from __future__ import annotations

import base64
import json
import statistics
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from etcd_rdzv import RendezvousConnectionError, RendezvousParameters
from etcd_rdzv._kv import KV
from etcd_rdzv.client import build_kv
from etcd_rdzv.config.params import Settings


class Refusing(ThreadingHTTPServer):
    """Answers each request with etcd's gateway error ``message`` (gRPC code 14,
    Unavailable; HTTP 503) and records when each arrived, by client (its path's key)."""

    daemon_threads = True
    # Twenty clients connect at once: socketserver's default backlog of 5 drops the
    # rest of the burst on a loaded machine, and a dropped connect is tried again by
    # TCP only after a second (a CI run saw one client never reach the server).
    request_queue_size = 64

    def __init__(self, message: str) -> None:
        self.message = message
        self.arrivals: dict[str, list[float]] = {}
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: Refusing

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.arrivals.setdefault(body.get("key", ""), []).append(time.monotonic())
        data = json.dumps(
            {"error": self.server.message, "code": 14, "message": self.server.message}
        ).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def refusing(request: pytest.FixtureRequest) -> Iterator[Refusing]:
    server = Refusing(request.param)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def _client(server: Refusing, read_timeout: int) -> KV:
    params = RendezvousParameters(
        "etcd-rdzv",
        f"127.0.0.1:{server.server_address[1]}",
        "r",
        1,
        1,
        read_timeout=read_timeout,
    )
    return build_kv(Settings.from_params(params).client)  # no request yet


def _gaps(server: Refusing, clients: int, read_timeout: int) -> tuple[list[float], list[float]]:
    """``clients`` clients read one key each at the same moment, until they give up
    (``read_timeout``): the pauses before each one's first resend, and the moments of
    those first resends."""
    kvs = [_client(server, read_timeout) for _ in range(clients)]
    go = threading.Event()

    def read(kv: KV, i: int) -> None:
        go.wait()
        with pytest.raises(RendezvousConnectionError):
            kv.get(f"key{i}")

    threads = [threading.Thread(target=read, args=(kv, i)) for i, kv in enumerate(kvs)]
    for thread in threads:
        thread.start()
    go.set()
    for thread in threads:
        thread.join(read_timeout + 10)
    for kv in kvs:
        kv.close()
    firsts, resends = [], []
    for i in range(clients):
        seen = server.arrivals[base64.b64encode(f"key{i}".encode()).decode()]
        assert len(seen) >= 2, f"client {i} never sent its read again: {seen}"
        firsts.append(seen[1] - seen[0])
        resends.append(seen[1])
    return firsts, resends


@pytest.mark.parametrize("refusing", ["etcdserver: request timed out"], indirect=True)
def test_an_overloaded_etcd_is_asked_again_after_about_a_second_spread_out(
    refusing: Refusing,
) -> None:
    firsts, resends = _gaps(refusing, 20, read_timeout=3)
    assert min(firsts) >= 0.45, firsts  # 0.5-1.5 s (the clock of a loaded machine aside)
    assert statistics.median(firsts) < 2.0, firsts
    # Twenty clients refused at once come back over most of a second, not at once.
    assert max(resends) - min(resends) > 0.4, sorted(r - min(resends) for r in resends)


@pytest.mark.parametrize("refusing", ["etcdserver: leader changed"], indirect=True)
def test_after_an_election_a_request_is_sent_again_within_a_fraction_of_a_second(
    refusing: Refusing,
) -> None:
    firsts, resends = _gaps(refusing, 20, read_timeout=2)
    assert min(firsts) >= 0.04, firsts
    assert statistics.median(firsts) < 0.5, firsts
    assert max(resends) - min(resends) > 0.03, sorted(r - min(resends) for r in resends)
