"""The v3 client against answers that leave out every zero-valued field.

etcd 3.7's JSON gateway marshals with protojson's ``EmitUnpopulated: false``: a count
of 0, an empty ``kvs``, ``succeeded: false``, a ``deleted`` of 0, a lease ``TTL`` of 0,
an empty value, an event of type ``PUT`` (the enum's zero) are not in its answers at
all. Here a proxy in front of a real etcd parses every answer (and every message of
a streamed one) and drops each such field, at every depth; the same sequence of
requests, run once straight to etcd and once through the proxy, must give the same
results, and the answers the client met must lack each such field.

etcd 3.4's and 3.5's gateways (gogo jsonpb without ``EmitDefaults``) already leave out
every zero-valued field of these answers: run against them, the proxy finds nothing to
drop (``stripped`` stays empty), and the test pins that the client copes with that shape
on every etcd it supports; the proxy keeps the shape for an etcd that would send zeros.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousParameters
from etcd_rdzv._kv import KV, Compare, Delete, DeletePrefix, Get, Put, Quiet
from etcd_rdzv._kv._records import Event, Record
from etcd_rdzv._kv._txn import TxnResult
from etcd_rdzv._kv.v3 import V3KV
from etcd_rdzv.testing import EtcdServer
from etcd_rdzv.testing.pytest_plugin import debian_etcd_binary

from ._rawkv import revoke

pytestmark = pytest.mark.etcd_variants("v3", "v3-3.4")

_ZEROS: tuple[Any, ...] = (0, "0", "", False, [], None)


class StrippingProxy:
    """An HTTP proxy to ``upstream`` that drops every zero-valued field of each JSON
    answer, as protojson does without ``EmitUnpopulated``; ``stripped`` counts the
    dropped fields by name."""

    def __init__(self, upstream: str) -> None:
        parts = urllib.parse.urlsplit(upstream)
        self.upstream = (str(parts.hostname), int(parts.port or 80))
        self.stripped: collections.Counter[str] = collections.Counter()
        #: (path, the JSON object passed on) of every answer and stream message.
        self.answers: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        self._open: set[http.client.HTTPConnection] = set()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                proxy._forward(self)

            def do_GET(self) -> None:
                proxy._forward(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _strip(self, value: Any) -> Any:
        if isinstance(value, list):
            return [self._strip(item) for item in value]
        if not isinstance(value, dict):
            return value
        kept = {}
        for name, raw in value.items():
            item = self._strip(raw)
            zero = any(type(item) is type(z) and item == z for z in _ZEROS)
            if zero or (name == "type" and item == "PUT"):
                with self._lock:
                    self.stripped[name] += 1
            else:
                kept[name] = item
        return kept

    def _rewrite(self, path: str, line: bytes) -> bytes:
        try:
            obj = self._strip(json.loads(line))
        except ValueError:
            return line
        with self._lock:
            self.answers.append((path, obj))
        return json.dumps(obj).encode()

    def _forward(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else None
        headers = {
            name: value
            for name, value in handler.headers.items()
            if name.lower() in ("content-type", "authorization")
        }
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        with self._lock:
            self._open.add(conn)
        try:
            conn.request(handler.command, handler.path, body, headers)
            resp = conn.getresponse()
            handler.send_response(resp.status)
            handler.send_header("Content-Type", resp.getheader("Content-Type") or "")
            if resp.getheader("Content-Length") is not None:
                data = self._rewrite(handler.path, resp.read())
                handler.send_header("Content-Length", str(len(data)))
                handler.end_headers()
                handler.wfile.write(data)
                return
            # A stream (a watch, a keep-alive): one JSON message per line, each passed
            # on as its own chunk.
            handler.send_header("Transfer-Encoding", "chunked")
            handler.end_headers()
            buffer = b""
            while data := resp.read1(65536):
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    self._chunk(handler, self._rewrite(handler.path, line) + b"\n")
            if buffer.strip():
                self._chunk(handler, self._rewrite(handler.path, buffer))
            handler.wfile.write(b"0\r\n\r\n")
        except OSError:
            handler.close_connection = True
        finally:
            with self._lock:
                self._open.discard(conn)
            conn.close()

    @staticmethod
    def _chunk(handler: BaseHTTPRequestHandler, data: bytes) -> None:
        handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        handler.wfile.flush()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        with self._lock:
            for conn in list(self._open):
                with contextlib.suppress(OSError):
                    if conn.sock is not None:  # wakes the thread reading a stream
                        conn.sock.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def own_server(etcd_variant: str) -> Iterator[EtcdServer]:
    """A member of the variant's etcd for this test alone: the two runs compare
    revisions, which another test's write (or a thread it left) would shift."""
    binary = debian_etcd_binary() if etcd_variant == "v3-3.4" else None
    with EtcdServer("zero-fields", enable_v2=False, binary=binary) as server:
        yield server


@pytest.fixture
def proxy(own_server: EtcdServer) -> Iterator[StrippingProxy]:
    server = StrippingProxy(own_server.client_url)
    yield server
    server.close()


def _normal(prefix: str, base: int) -> Callable[[Any], Any]:
    """What a result says, with keys relative to ``prefix`` and revisions to ``base``
    (the two runs use different prefixes, one after the other)."""

    def rel(revision: int) -> int:
        return revision - base if revision else 0

    def normal(value: Any) -> Any:
        if isinstance(value, Record):
            key = value.key.removeprefix(prefix)
            return ("record", key, value.value, rel(value.revision), rel(value.created))
        if isinstance(value, Event):
            return ("event", value.kind, normal(value.record), rel(value.current))
        if isinstance(value, TxnResult):
            records = normal(list(value.records))
            compared = normal(list(value.compared))
            return ("txn", value.succeeded, records, compared, rel(value.revision), value.deleted)
        if isinstance(value, (list, tuple)):
            return [normal(item) for item in value]
        if isinstance(value, str):
            return value.removeprefix(prefix)
        return value

    return normal


def _scenario(kv: KV, url: str, prefix: str) -> list[tuple[str, Any]]:
    """Every request the v3 client makes, in an order whose revisions do not depend
    on the run; what each returned, normalised."""
    assert isinstance(kv, V3KV)
    out: list[tuple[str, Any]] = []
    absent, base = kv.get(f"{prefix}/absent")
    normal = _normal(prefix, base)

    def note(what: str, value: Any) -> None:
        out.append((what, normal(value)))

    def note_at(what: str, read: tuple[Any, int]) -> None:
        """A read and the store revision it was made at."""
        out.append((what, (normal(read[0]), normal(Record("", "", read[1])))))

    note("get absent", absent)
    note_at("list empty", kv.list_prefix(prefix))
    note("keys_under empty", kv.keys_under(prefix, 10))
    kv.probe(prefix)
    note("time_left absent", kv.time_left(f"{prefix}/absent"))
    note("delete absent", kv.delete(f"{prefix}/absent"))
    a = kv.create(f"{prefix}/a", "1", None)
    note("create", a)
    note("create again", kv.create(f"{prefix}/a", "2", None))
    assert a is not None
    note("cas stale", kv.compare_and_set(f"{prefix}/a", "2", a.revision + 100, None))
    note("cas", kv.compare_and_set(f"{prefix}/a", "2", a.revision, None))
    note("put ttl", kv.put(f"{prefix}/b", "3", 600))
    c = kv.put(f"{prefix}/c", "", None)
    note("put empty", c)
    note_at("get empty", kv.get(f"{prefix}/c"))
    note_at("get", kv.get(f"{prefix}/a"))
    note_at("list", kv.list_prefix(prefix))
    note_at("list tree", kv.list_tree(prefix))
    note("keys_under", kv.keys_under(prefix, 2))
    left = kv.time_left(f"{prefix}/b")
    note("time_left", left is not None and 590 <= left <= 600)
    note("time_left no lease", kv.time_left(f"{prefix}/a"))
    note(
        "txn ok",
        kv.txn(
            [Compare(f"{prefix}/a", "2"), Compare(f"{prefix}/none", None)],
            [Put(f"{prefix}/d", "4"), Get(f"{prefix}/a"), Get(f"{prefix}/none")],
        ),
    )
    note(
        "txn deletes nothing",
        kv.txn([], [Delete(f"{prefix}/none"), DeletePrefix(f"{prefix}/none/")]),
    )
    note(
        "txn refused",
        kv.txn(
            [Compare(f"{prefix}/a", "nope"), Compare(f"{prefix}/none", None)],
            [Put(f"{prefix}/d", "5"), Get(f"{prefix}/none")],
        ),
    )
    _, now = kv.get(f"{prefix}/a")
    note("txn quiet", kv.txn([Quiet(prefix, now)], [Put(f"{prefix}/e", "")]))
    note("txn not quiet", kv.txn([Quiet(prefix, now)], [Put(f"{prefix}/e", "6")]))
    note("refresh leased", kv.refresh(f"{prefix}/b", 600))
    note("refresh unleased", kv.refresh(f"{prefix}/c", 600))
    note("refresh absent", kv.refresh(f"{prefix}/absent", 600))
    note("delete", kv.delete(f"{prefix}/d"))
    _, deleted_at = kv.get(f"{prefix}/d")

    lease = kv.grant(30)
    note("put owned", kv.put_owned(f"{prefix}/o", "7", lease))
    note("keep alive", kv.keep_alive(lease))
    note("revoke", kv.revoke(lease, time.monotonic() + 10))
    gone = kv.grant(30)
    note("put owned gone", kv.put_owned(f"{prefix}/g", "8", gone))
    revoke(url, gone.id)
    note("keep alive gone", kv.keep_alive(gone))
    note("revoke gone", kv.revoke(gone, time.monotonic() + 10))

    _, now = kv.get(f"{prefix}/a")
    note("watch quiet", kv.watch_events(f"{prefix}/a", now + 1, 0.5))
    note("watch put", kv.watch_events(f"{prefix}/a", a.revision, 5))
    # From c's own revision, not 1: other tests compact the shared etcd.
    note("watch empty put", kv.watch(f"{prefix}/c", c.revision, 5))
    note("watch delete", kv.watch_events(f"{prefix}/d", deleted_at, 5))
    with kv.watcher(prefix, prefix=True) as watcher:
        watcher.start()
        note_at("watcher reread", watcher.reread(lambda: kv.list_tree(prefix)))
        note("watcher quiet", watcher.next(0.5))
        kv.put(f"{prefix}/w", "", None)
        kv.delete(f"{prefix}/w")
        # The stream may hand the put over before the delete is made: both, in order.
        events: list[Event] = []
        until = time.monotonic() + 5
        while len(events) < 2 and time.monotonic() < until:
            events += watcher.next(until - time.monotonic())
        note("watcher", events)

    kv.delete_prefix(prefix)
    note_at("list deleted", kv.list_tree(prefix))
    note("keys_under deleted", kv.keys_under(prefix, 10))
    note_at("get deleted", kv.get(f"{prefix}/a"))
    return out


def test_answers_without_zero_fields_give_the_same_results(
    own_server: EtcdServer, etcd_key_prefix: str, proxy: StrippingProxy
) -> None:
    url = own_server.client_url
    to_etcd = own_server.params("run", key_prefix=etcd_key_prefix, api="v3", read_timeout=5)
    direct = etcd_rdzv.create_client(to_etcd)
    try:
        expected = _scenario(direct, url, f"{etcd_key_prefix}/direct")
    finally:
        direct.close()
    params = RendezvousParameters(
        to_etcd.backend,
        proxy.url.removeprefix("http://"),
        to_etcd.run_id,
        to_etcd.min_nodes,
        to_etcd.max_nodes,
        **to_etcd.config,
    )
    stripped = etcd_rdzv.create_client(params)
    try:
        got = _scenario(stripped, url, f"{etcd_key_prefix}/stripped")
    finally:
        stripped.close()
    for (what, want), (_, have) in zip(expected, got, strict=True):
        assert have == want, what
    # The client met each zero field left out (by the proxy, or already by etcd).
    missing = [shape for shape, seen in _SHAPES.items() if not _seen(proxy.answers, seen)]
    assert not missing, missing


def test_the_proxy_drops_every_zero_valued_field() -> None:
    """What the proxy does to an answer that has them (etcd 3.4 and 3.5 send none)."""
    proxy = StrippingProxy("http://127.0.0.1:9")  # no request goes through it
    try:
        answer = {
            "header": {"revision": "0", "raft_term": "2"},
            "kvs": [],
            "count": "0",
            "succeeded": False,
            "responses": [{"response_delete_range": {"deleted": "0", "prev_kvs": []}}],
            "events": [{"type": "PUT", "kv": {"key": "YQ==", "value": "", "version": 0}}],
        }
        assert proxy._strip(answer) == {
            "header": {"raft_term": "2"},
            "responses": [{"response_delete_range": {}}],
            "events": [{"kv": {"key": "YQ=="}}],
        }
        assert set(proxy.stripped) == {
            "revision",
            "kvs",
            "count",
            "succeeded",
            "deleted",
            "prev_kvs",
            "type",
            "value",
            "version",
        }
    finally:
        proxy.close()


def _result(obj: Any) -> Any:
    return obj.get("result", obj) if isinstance(obj, dict) else {}


def _seen(answers: list[tuple[str, Any]], shape: Callable[[str, Any], bool]) -> bool:
    return any(shape(path, _result(obj)) for path, obj in answers)


def _kvs(obj: Any) -> list[Any]:
    found = list(obj.get("kvs", []))
    for response in obj.get("responses", []):
        found += response.get("response_range", {}).get("kvs", [])
    for event in obj.get("events", []):
        found.append(event.get("kv", {}))
    return found


#: Answers of etcd 3.7's shape the scenario must have met: name -> (path, answer) test.
_SHAPES: dict[str, Callable[[str, Any], bool]] = {
    "a range without kvs or count": lambda path, obj: (
        path == "/v3/kv/range" and "header" in obj and not {"kvs", "count"} & set(obj)
    ),
    "a refused txn without succeeded": lambda path, obj: (
        path == "/v3/kv/txn" and "header" in obj and "succeeded" not in obj
    ),
    "a delete without deleted": lambda path, obj: any(
        "response_delete_range" in r and "deleted" not in r["response_delete_range"]
        for r in obj.get("responses", [])
    ),
    "a txn read without kvs": lambda path, obj: any(
        "response_range" in r and "kvs" not in r["response_range"] for r in obj.get("responses", [])
    ),
    "a key without value": lambda path, obj: any(
        "key" in kv and "value" not in kv for kv in _kvs(obj)
    ),
    "a keep-alive of a gone lease without TTL": lambda path, obj: (
        path == "/v3/lease/keepalive" and "ID" in obj and "TTL" not in obj
    ),
    "a watch answer without events": lambda path, obj: (
        path == "/v3/watch" and obj.get("created") is True and "events" not in obj
    ),
    "a put event without type": lambda path, obj: any(
        "type" not in event for event in obj.get("events", [])
    ),
    "a delete event without version or create_revision": lambda path, obj: any(
        event.get("type") == "DELETE" and not {"version", "create_revision"} & set(event["kv"])
        for event in obj.get("events", [])
    ),
}
