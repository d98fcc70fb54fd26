"""``create_client`` against a hostile endpoint: a server on loopback that answers the
first requests (the probe, then the diagnosis) with what etcd never sends, for both
APIs.

Each case runs ``create_client`` in a child process whose address space is capped
(``RLIMIT_AS``: an unbounded read must fail there, not eat the machine) and checks that
it fails with one of our errors naming the endpoint, within a few read timeouts, and
that the child's peak memory grew by less than the transport's answer bound plus a
margin. Every case fails without the hardening it stands for: the answer bound (a
flood, a huge length, a large body), the total deadline (a trickle), strict lengths,
the nesting cap and the shape checks (a bare Python exception, or a client that
"connects" to something that is not etcd).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv._kv._http import DEFAULT_MAX_RESPONSE_BYTES

READ_TIMEOUT = 3
MAX_ELAPSED = 3 * READ_TIMEOUT  # the probe and the diagnosis each end by read_timeout
MAX_GROWTH_KB = (DEFAULT_MAX_RESPONSE_BYTES + 48 * 2**20) // 1024  # the bound + margin
AS_HEADROOM = 2 * 2**30  # bytes of address space the child may add: a flood fails in it
_PACKAGE_ROOT = str(Path(etcd_rdzv.__file__).resolve().parent.parent)

# -- the hostile server -----------------------------------------------------------------

Hostile = Callable[[socket.socket], None]


def _hold(conn: socket.socket) -> None:
    """Keep the connection open until the client gives up."""
    conn.settimeout(60)
    try:
        while conn.recv(65536):
            pass
    except OSError:
        pass


def _send(data: bytes) -> Hostile:
    def answer(conn: socket.socket) -> None:
        conn.sendall(data)
        _hold(conn)

    return answer


def _endless(head: bytes, piece: bytes) -> Hostile:
    def answer(conn: socket.socket) -> None:
        conn.sendall(head)
        while True:
            conn.sendall(piece)

    return answer


def _body(head: bytes, size: int, chunked: bool = False) -> Hostile:
    block = b"x" * 2**20
    if chunked:  # each block a chunk of its own, all well framed
        block = b"%x\r\n%s\r\n" % (len(block), block)

    def answer(conn: socket.socket) -> None:
        conn.sendall(head)
        for _ in range(size // 2**20):
            conn.sendall(block)
        if chunked:
            conn.sendall(b"0\r\n\r\n")
        _hold(conn)

    return answer


def _trickle(data: bytes, pace: float) -> Hostile:
    def answer(conn: socket.socket) -> None:
        for at in range(len(data)):
            conn.sendall(data[at : at + 1])
            time.sleep(pace)
        _hold(conn)

    return answer


def _reset(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")


def _ok(body: bytes, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\n%sContent-Length: %d\r\n\r\n%s" % (status, extra, len(body), body)


_CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
_DEEP = b"[" * 200_000 + b"]" * 200_000
_BIG = 400 * 2**20

#: name: (what the server answers, a text the error must hold besides the endpoint)
CASES: dict[str, tuple[Hostile, str]] = {
    # New: these failed before the hardening.
    "endless-chunked": (_endless(_CHUNKED, b"10000\r\n" + b"x" * 0x10000 + b"\r\n"), "over"),
    "huge-length": (_send(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000000\r\n\r\n{}"), "over"),
    "big-body-chunked": (_body(_CHUNKED, _BIG, chunked=True), "over"),
    "big-body-to-close": (_body(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", _BIG), "over"),
    "wrong-shape": (_send(_ok(b'{"action":"get","node":"x","header":"x"}')), "not etcd's"),
    "wrong-field-type": (
        _send(_ok(b'{"action":"get","node":{"key":"/k","modifiedIndex":"1"},"header":[]}')),
        "not etcd's",
    ),
    "deep-json": (_send(_ok(_DEEP)), "nested deeper than"),
    "negative-length": (
        _send(b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n{}"),
        "Content-Length",
    ),
    "odd-length": (_send(b"HTTP/1.1 200 OK\r\nContent-Length: 0_2\r\n\r\n{}"), "Content-Length"),
    "plus-length": (_send(b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\n{}"), "Content-Length"),
    "proxy-503": (_send(_ok(b"upstream busy", b"503 Service Unavailable")), "503"),
    "proxy-503-json": (_send(_ok(b'{"reason":"busy"}', b"503 Service Unavailable")), "503"),
    "trickled-body": (_trickle(_ok(b'{"header":{}}' + b" " * 2000), 0.05), "timed out"),
    "endless-headers": (_endless(b"HTTP/1.1 200 OK\r\n", b"X-A: b\r\n"), "header lines"),
    # Floods of small well-formed parts: only the request's total deadline ends them.
    "endless-interim": (_endless(b"", b"HTTP/1.1 100 Continue\r\n\r\n"), "timed out"),
    "endless-trailers": (_endless(_CHUNKED + b"0\r\n", b"X-T: 1\r\n"), "timed out"),
    # Held before: kept so they stay held.
    "silence": (_hold, "timed out"),
    "long-header-line": (_endless(b"HTTP/1.1 200 OK\r\nX-A: ", b"b" * 65536), "over 65536"),
    "garbage": (_send(b"\x16\x03\x01 not http at all\r\n\r\n"), "status line"),
    "bad-chunk-size": (_send(_CHUNKED + b"zz\r\n"), "chunk size"),
    "reset": (_reset, ""),
    "not-json": (_send(_ok(b"<html>hello</html>")), ""),
}


class _Server:
    """Accepts connections on a free loopback port; reads each request's head and body,
    then lets ``hostile`` answer on a thread of its own."""

    def __init__(self, hostile: Hostile) -> None:
        self._hostile = hostile
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.endpoint = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(30)
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 65536:
                more = conn.recv(65536)
                if not more:
                    return
                head += more
            self._hostile(conn)
        except OSError:
            pass  # the client gave up
        finally:
            conn.close()

    def close(self) -> None:
        self._sock.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def hostile() -> Iterator[Callable[[Hostile], _Server]]:
    servers: list[_Server] = []

    def start(answer: Hostile) -> _Server:
        servers.append(_Server(answer))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


# -- the client, in a capped child process ----------------------------------------------

_CHILD = """
import json, resource, sys, time

endpoint, api, headroom, read_timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
extra = json.loads(sys.argv[5])
import etcd_rdzv
from etcd_rdzv import RendezvousConnectionError, RendezvousParameters, RendezvousStateError
from etcd_rdzv.client import _diagnose, _probe  # what the call imports
from etcd_rdzv._kv import v3 as _v3
if api == "v2":
    import etcd
    from etcd_rdzv._kv import v2 as _v2

def vm_size():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")

cap = vm_size() + headroom
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
params = RendezvousParameters(
    backend="etcd-rdzv", endpoint=endpoint, run_id="x", min_nodes=1, max_nodes=1,
    read_timeout=read_timeout, api=api, **extra,
)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
began = time.monotonic()
outcome = {"type": None, "ours": False, "message": ""}
try:
    etcd_rdzv.create_client(params).close()
except BaseException as exc:
    outcome = {
        "type": type(exc).__module__ + "." + type(exc).__qualname__,
        "ours": isinstance(exc, (RendezvousConnectionError, RendezvousStateError)),
        "message": str(exc)[:4000],
    }
outcome["elapsed"] = time.monotonic() - began
outcome["grew_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps(outcome))
"""


def _create_client_in_child(endpoint: str, api: str, **config: Any) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": _PACKAGE_ROOT}
    argv = [endpoint, api, str(AS_HEADROOM), str(READ_TIMEOUT), json.dumps(config)]
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, (done.returncode, done.stdout, done.stderr[-3000:])
    outcome: dict[str, Any] = json.loads(lines[-1])
    return outcome


@pytest.mark.parametrize("api", ["v3", "v2"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_endpoint_fails_create_client_in_bounds(
    hostile: Callable[[Hostile], _Server], case: str, api: str
) -> None:
    answer, says = CASES[case]
    server = hostile(answer)
    outcome = _create_client_in_child(server.endpoint, api)
    message = outcome["message"]
    assert outcome["ours"], outcome
    assert f"http://{server.endpoint}" in message, outcome
    assert says in message, outcome
    assert "None : None" not in message, outcome
    assert outcome["elapsed"] < MAX_ELAPSED, outcome
    assert outcome["grew_kb"] < MAX_GROWTH_KB, outcome


@pytest.mark.parametrize("api", ["v3", "v2"])
def test_the_answer_bound_is_the_max_response_bytes_option(
    hostile: Callable[[Hostile], _Server], api: str
) -> None:
    """A 1 MiB answer is far below the default bound, and refused under a bound of
    64 KiB set by the option: the error names the bound."""
    server = hostile(_send(_ok(b"{" + b" " * 2**20 + b"}")))
    outcome = _create_client_in_child(server.endpoint, api, max_response_bytes=65536)
    assert outcome["ours"] and f"http://{server.endpoint}" in outcome["message"], outcome
    assert "65536" in outcome["message"], outcome
    assert outcome["elapsed"] < MAX_ELAPSED, outcome
