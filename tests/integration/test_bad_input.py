"""Bad inputs against a real etcd: each gets a clear error, and nothing is half written.

Every error case checks etcd afterwards: the key tree under the test's prefix (values and
revisions) is exactly what it was before. Cases run on both etcd APIs
(``etcd_api_params``, ``etcd_api``); only the two checks of the parameters object
itself need no etcd.

Sections:

* options that are rejected before any network call (``ValueError``);
* TLS and credentials that etcd or the client refuses (``RendezvousConnectionError``
  within ``read_timeout`` plus slack);
* corrupt or foreign values under the run's keys (``RendezvousStateError`` /
  ``ValueError``, the value left as found);
* a state or store value larger than etcd accepts;
* run ids and store keys with ``/``, spaces and non-ASCII characters, which must work
  and stay apart.
"""

from __future__ import annotations

import base64
import importlib
import importlib.util
import json
import socket
import ssl
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import urllib3

import etcd_rdzv
from etcd_rdzv import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousParameters,
    RendezvousStateError,
    _keys,
)
from etcd_rdzv.testing import EtcdServer, TLSFiles

from ._certs import CertFiles, find_openssl, generate

Params = Callable[..., RendezvousParameters]
Tree = dict[str, tuple[str, int]]

READ_TIMEOUT = 3
SLACK = 5.0  # seconds a refused connection may take beyond read_timeout on a busy machine
PASSWORD = "rootpw"


# -- helpers ----------------------------------------------------------------------------


def _tree(params: RendezvousParameters) -> Tree:
    """Every key under the prefix of ``params``: ``{key: (value, revision)}``."""
    kv = etcd_rdzv.create_client(params)
    try:
        records, _ = kv.list_tree(str(params.get("key_prefix")))
    finally:
        kv.close()
    return {r.key: (r.value, r.revision) for r in records}


def _plant(params: RendezvousParameters, key: str, value: str) -> None:
    """Write ``value`` verbatim at ``key``, as a foreign writer would."""
    kv = etcd_rdzv.create_client(params)
    try:
        kv.put(key, value, None)
    finally:
        kv.close()


def _with(params: RendezvousParameters, **changes: Any) -> RendezvousParameters:
    """A copy of ``params`` with options (or ``endpoint``/``run_id``/...) changed."""
    fields: dict[str, Any] = {
        "backend": params.backend,
        "endpoint": params.endpoint,
        "run_id": params.run_id,
        "min_nodes": params.min_nodes,
        "max_nodes": params.max_nodes,
    }
    config = dict(params.config)
    for name, value in changes.items():
        if name in fields:
            fields[name] = value
        elif value is None:
            config.pop(name, None)
        else:
            config[name] = value
    return RendezvousParameters(**fields, **config)


@dataclass
class Seeded:
    """A run with a state and a store key written, and the tree that made."""

    params: RendezvousParameters
    tree: Tree


@pytest.fixture
def seeded(etcd_api_params: Params) -> Seeded:
    params = etcd_api_params("run", read_timeout=READ_TIMEOUT)
    backend, store = etcd_rdzv.create_backend(params)
    backend.set_state(b"previous")
    store.set("k", "v")
    tree = _tree(params)
    assert len(tree) == 2, tree
    return Seeded(params, tree)


# -- options rejected before any network call ------------------------------------------

CLIENT = "client"  # checked by create_client, create_backend and create_handler
RUN = "run"  # checked by create_backend and create_handler (a client has no run)
HANDLER = "handler"  # checked by create_handler


@dataclass(frozen=True)
class Case:
    changes: dict[str, Any]
    match: str
    scope: str = CLIENT


def _files(tmp: Path, certs: CertFiles | None) -> dict[str, str]:
    garbage = tmp / "garbage.pem"
    garbage.write_text("not a certificate\n")
    empty = tmp / "empty.pem"
    empty.write_text("")
    paths = {"garbage": str(garbage), "empty": str(empty), "dir": str(tmp), "missing": "/nope.pem"}
    if certs is not None:
        paths.update(client_cert=certs.client_cert, server_key=certs.server_key, ca=certs.ca)
    return paths


OPTION_CASES: dict[str, Case] = {
    # endpoints
    "endpoint-comma-only": Case({"endpoint": ","}, "empty entry"),
    "endpoint-empty-entry": Case({"endpoint": "a:1,,b:2"}, "empty entry"),
    "endpoint-host-colon": Case({"endpoint": "host:"}, "port '' in 'host:' is not a number"),
    "endpoint-colon-port": Case({"endpoint": ":2379"}, "'' in ':2379' is not a valid host"),
    "endpoint-open-bracket": Case({"endpoint": "[::1"}, "no closing ']'"),
    "endpoint-bracket-not-ipv6": Case({"endpoint": "[db1]:2379"}, "not an IPv6 address"),
    "endpoint-junk-after-bracket": Case({"endpoint": "[::1]x"}, "unexpected 'x'"),
    "endpoint-bare-ipv6": Case({"endpoint": "::1"}, "in brackets"),
    "endpoint-url-scheme": Case({"endpoint": "http://db:2379"}, "URL scheme"),
    "endpoint-port-text": Case({"endpoint": "db:http"}, "not a number"),
    "endpoint-port-zero": Case({"endpoint": "db:0"}, "out of range"),
    "endpoint-port-too-big": Case({"endpoint": "db:65536"}, "out of range"),
    "endpoint-space-in-host": Case({"endpoint": "my db:2379"}, "not a valid host name"),
    "endpoint-duplicate": Case({"endpoint": "db:1,db:1"}, "listed twice"),
    # protocol, api, prefix
    "protocol-unknown": Case({"protocol": "ftp"}, "'protocol' must be 'http' or 'https'"),
    "protocol-empty": Case({"protocol": ""}, "'protocol' must be"),
    "api-unknown": Case({"api": "v4"}, "Option 'api' must be one of"),
    "key-prefix-relative": Case({"key_prefix": "etcd_rdzv"}, "'key_prefix'"),
    "key-prefix-root": Case({"key_prefix": "/"}, "'key_prefix'"),
    "key-prefix-double-slash": Case({"key_prefix": "/a//b"}, "'key_prefix'"),
    "key-prefix-non-ascii": Case({"key_prefix": "/é"}, "'key_prefix'"),
    # timeouts and counts
    "read-timeout-zero": Case({"read_timeout": 0}, "'read_timeout' must be a positive"),
    "read-timeout-negative": Case({"read_timeout": -5}, "'read_timeout' must be a positive"),
    "read-timeout-text": Case({"read_timeout": "soon"}, "'read_timeout' must be an integer"),
    "read-timeout-fraction": Case({"read_timeout": "1.5"}, "'read_timeout' must be an integer"),
    "store-ttl-negative": Case({"store_ttl": -1}, "'store_ttl' must be a non-negative", RUN),
    "join-timeout-zero": Case({"join_timeout": 0}, "'join_timeout' must be a positive", HANDLER),
    "join-timeout-negative": Case({"join_timeout": -1}, "'join_timeout'", HANDLER),
    "last-call-negative": Case(
        {"last_call_timeout": -1}, "'last_call_timeout' must be a non-negative", HANDLER
    ),
    "keep-alive-interval-zero": Case(
        {"keep_alive_interval": 0}, "'keep_alive_interval' must be a positive", HANDLER
    ),
    "keep-alive-max-attempt-zero": Case(
        {"keep_alive_max_attempt": 0}, "'keep_alive_max_attempt'", HANDLER
    ),
    "heartbeat-timeout-zero": Case({"heartbeat_timeout": 0}, "'heartbeat_timeout'", HANDLER),
    "close-timeout-zero": Case({"close_timeout": 0}, "'close_timeout'", HANDLER),
    "run-id-empty": Case({"run_id": ""}, "run id must be a non-empty string", RUN),
    # credentials
    "username-without-password": Case({"username": "root"}, "'password' is missing"),
    "password-without-username": Case({"password": "pw"}, "'username' is missing"),
    # TLS options
    "ca-cert-with-http": Case({"ca_cert": "@ca"}, "need protocol 'https'"),
    "tls-insecure-with-http": Case({"tls_insecure": "true"}, "need protocol 'https'"),
    "tls-insecure-not-bool": Case(
        {"protocol": "https", "tls_insecure": "maybe"}, "'tls_insecure' must be a boolean"
    ),
    "ca-cert-missing-file": Case(
        {"protocol": "https", "ca_cert": "@missing"}, "'ca_cert': file '/nope.pem'"
    ),
    "ca-cert-directory": Case({"protocol": "https", "ca_cert": "@dir"}, "'ca_cert'"),
    "ca-cert-not-pem": Case(
        {"protocol": "https", "ca_cert": "@garbage"}, "'ca_cert': cannot load CA certificates"
    ),
    "ca-cert-empty-file": Case(
        {"protocol": "https", "ca_cert": "@empty"}, "'ca_cert': cannot load CA certificates"
    ),
    "ssl-cert-missing-file": Case(
        {"protocol": "https", "ssl_cert": "@missing"}, "'ssl_cert': file '/nope.pem'"
    ),
    "ssl-cert-key-alone": Case(
        {"protocol": "https", "ssl_cert_key": "@server_key"}, "'ssl_cert' is not"
    ),
    "ssl-cert-wrong-key": Case(
        {"protocol": "https", "ssl_cert": "@client_cert", "ssl_cert_key": "@server_key"},
        "cannot load client certificate",
    ),
    "ssl-cert-without-key": Case(
        {"protocol": "https", "ssl_cert": "@client_cert"}, "cannot load client certificate"
    ),
}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    openssl = find_openssl()
    assert openssl is not None, "the openssl CLI is needed to make test certificates"
    return generate(tmp_path_factory.mktemp("certs"), openssl)


@pytest.mark.parametrize("case", list(OPTION_CASES.values()), ids=list(OPTION_CASES))
def test_bad_option_is_a_value_error_before_any_network_call(
    case: Case, seeded: Seeded, certs: CertFiles, tmp_path: Path
) -> None:
    files = _files(tmp_path, certs)
    changes = {
        k: files[v[1:]] if isinstance(v, str) and v.startswith("@") else v
        for k, v in case.changes.items()
    }
    bad = _with(seeded.params, backend="etcd-rdzv", **changes)
    factories: list[Callable[[RendezvousParameters], Any]] = [
        lambda p: etcd_rdzv.create_handler(p, use_torch=False)
    ]
    if case.scope in (CLIENT, RUN):
        factories.append(etcd_rdzv.create_backend)
    if case.scope == CLIENT:
        factories.append(etcd_rdzv.create_client)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"network call before option validation: {args[1:]!r}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(urllib3.PoolManager, "urlopen", refuse)
        mp.setattr(urllib3.HTTPConnectionPool, "urlopen", refuse)
        mp.setattr(socket, "create_connection", refuse)  # the v3 client's own transport
        for factory in factories:
            with pytest.raises(ValueError, match=case.match) as info:
                factory(bad)
            assert not isinstance(info.value, RendezvousError), info.value
    assert _tree(seeded.params) == seeded.tree


@pytest.mark.parametrize(
    ("min_nodes", "max_nodes", "match"),
    [(0, 1, "min_nodes must be at least 1"), (3, 2, "must be at least min_nodes")],
    ids=["min-nodes-zero", "max-below-min"],
)
def test_bad_node_counts_fail_in_the_parameters(min_nodes: int, max_nodes: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RendezvousParameters("etcd-rdzv", "127.0.0.1:2379", "run", min_nodes, max_nodes)


def test_empty_endpoint_means_localhost_as_in_torch() -> None:
    # Not an error: torch's rendezvous parameters treat an empty endpoint the same way.
    params = RendezvousParameters("etcd-rdzv", "  ", "run", 1, 1)
    config = etcd_rdzv.config.params.ClientConfig.from_params(params)
    assert [e.netloc() for e in config.endpoints] == ["localhost:2379"]


# -- refused TLS and credentials ---------------------------------------------------------


class _Servers:
    """Members with TLS or auth, started on first use (per API) and kept for the module."""

    def __init__(self, certs: CertFiles) -> None:
        self.certs = certs
        self._started: dict[tuple[str, str], EtcdServer] = {}

    def get(self, kind: str, api: str) -> EtcdServer:
        if (kind, api) not in self._started:
            self._started[kind, api] = self._start(kind, api)
        return self._started[kind, api]

    def _start(self, kind: str, api: str) -> EtcdServer:
        c = self.certs
        tls = {
            "tls": TLSFiles(c.server_cert, c.server_key, c.ca),
            "mtls": TLSFiles(c.server_cert, c.server_key, c.ca, client_ca=c.ca),
            # client certs required only so that the readiness probe is a port check
            "expired": TLSFiles(c.expired_cert, c.expired_key, c.ca, client_ca=c.ca),
            "auth": None,
        }[kind]
        server = EtcdServer(f"{kind}-{api}", enable_v2=api == "v2", tls=tls)
        try:
            server.start()
            if tls is not None and tls.client_ca:
                _wait_served(server, self._context(verify=kind != "expired"))
            if kind == "auth":
                _enable_auth(server, api)
        except BaseException:
            server.close()
            raise
        return server

    def _context(self, verify: bool) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.certs.ca)
        ctx.load_cert_chain(self.certs.client_cert, self.certs.client_key)
        if not verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def close(self) -> None:
        for server in self._started.values():
            server.close()


def _wait_served(server: EtcdServer, ctx: ssl.SSLContext, timeout: float = 30.0) -> None:
    """Poll ``/health`` with a client certificate until etcd has a leader."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        try:
            with urllib.request.urlopen(
                f"{server.client_url}/health", timeout=1, context=ctx
            ) as resp:
                if json.loads(resp.read()).get("health") == "true":
                    return
        except (OSError, ValueError):
            pass
        assert time.monotonic() < deadline, f"{server} not healthy:\n{server.log_tail()}"
        time.sleep(delay)  # back-off between polls
        delay = min(delay * 1.5, 0.25)


def _call(url: str, method: str, body: Any, auth: str | None = None) -> Any:
    request = urllib.request.Request(url, method=method, data=json.dumps(body).encode(), headers={})
    request.add_header("Content-Type", "application/json")
    if auth:
        request.add_header("Authorization", auth)
    with urllib.request.urlopen(request, timeout=5) as resp:
        data = resp.read()
    return json.loads(data) if data.strip() else None


def _enable_auth(server: EtcdServer, api: str) -> None:
    """User ``root`` with :data:`PASSWORD`; anonymous access refused."""
    base = server.client_url
    if api == "v3":
        _call(f"{base}/v3/auth/user/add", "POST", {"name": "root", "password": PASSWORD})
        _call(f"{base}/v3/auth/user/grant", "POST", {"user": "root", "role": "root"})
        _call(f"{base}/v3/auth/enable", "POST", {})
        return
    _call(f"{base}/v2/auth/users/root", "PUT", {"user": "root", "password": PASSWORD})
    _call(f"{base}/v2/auth/enable", "PUT", {})
    basic = "Basic " + base64.b64encode(f"root:{PASSWORD}".encode()).decode()
    # etcd's v2 auth gives the guest role read/write on everything: take it away.
    _call(
        f"{base}/v2/auth/roles/guest",
        "PUT",
        {"role": "guest", "revoke": {"kv": {"read": ["/*"], "write": ["/*"]}}},
        basic,
    )


@pytest.fixture(scope="module")
def servers(certs: CertFiles) -> Iterator[_Servers]:
    group = _Servers(certs)
    try:
        yield group
    finally:
        group.close()


REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {
    # case: (server kind, options, what the message must say)
    "wrong-ca": ("tls", {"ca_cert": "wrong_ca"}, "certificate verify failed"),
    "no-ca-system-trust": ("tls", {"ca_cert": None}, "certificate verify failed"),
    "expired-server-certificate": (
        "expired",
        {"ca_cert": "ca", "ssl_cert": "client_cert", "ssl_cert_key": "client_key"},
        "certificate has expired",
    ),
    "client-certificate-missing": ("mtls", {"ca_cert": "ca"}, "certificate"),
    "wrong-password": ("auth", {"username": "root", "password": "not-the-password"}, "refused"),
    "no-credentials": ("auth", {}, "refused"),
}


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_refused_tls_or_credentials_fail_fast_and_write_nothing(
    case: str, servers: _Servers, certs: CertFiles, etcd_api: str, etcd_key_prefix: str
) -> None:
    kind, options, says = REFUSED[case]
    server = servers.get(kind, etcd_api)
    base: dict[str, Any] = {"key_prefix": etcd_key_prefix, "read_timeout": READ_TIMEOUT}
    base["api"] = etcd_api
    if kind != "auth":
        base["protocol"] = "https"
    good = server.params("run", **base)
    if kind == "auth":
        good = _with(good, username="root", password=PASSWORD)
    else:
        good = _with(
            good, ca_cert=certs.ca, ssl_cert=certs.client_cert, ssl_cert_key=certs.client_key
        )
        if kind == "expired":  # nothing verifies that certificate: look without
            good = _with(good, tls_insecure="true")
    # etcd's own v3 gateway reaches its gRPC server over TLS with the same expired
    # certificate and fails: no v3 request is served at all there, so no look either.
    look = not (kind == "expired" and etcd_api == "v3")
    before = _tree(good) if look else {}

    resolved = {
        k: getattr(certs, v) if k in ("ca_cert", "ssl_cert", "ssl_cert_key") and v else v
        for k, v in options.items()
    }
    bad = server.params("run", **base)
    bad = _with(bad, **resolved)
    if importlib.util.find_spec("torch") is not None:
        # create_backend imports it, which takes seconds the first time: not timed here
        importlib.import_module("etcd_rdzv.torch")
    for factory in (etcd_rdzv.create_client, etcd_rdzv.create_backend):
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError) as info:
            factory(bad)
        elapsed = time.monotonic() - started
        message = str(info.value)
        assert says in message, message
        assert server.client_url in message, message
        assert "not-the-password" not in message
        assert elapsed < READ_TIMEOUT + SLACK, f"{factory.__name__} took {elapsed:.2f} s"
    if look:
        assert _tree(good) == before


# -- corrupt and foreign values ----------------------------------------------------------

GARBAGE = bytes(range(256))[::-7] * 3

FOREIGN_STATES = {
    "not-base64": "not base64 ###",
    "plain-string": "hello world",
    "foreign-json": json.dumps({"version": 1, "members": ["a", "b"]}),
    "short-base64-like": "abcde",
}


@pytest.mark.parametrize("value", list(FOREIGN_STATES.values()), ids=list(FOREIGN_STATES))
def test_foreign_state_is_a_state_error_and_stays(etcd_api_params: Params, value: str) -> None:
    params = etcd_api_params("run", read_timeout=READ_TIMEOUT)
    backend, _store = etcd_rdzv.create_backend(params)
    _plant(params, backend.key, value)
    before = _tree(params)

    with pytest.raises(RendezvousStateError, match="not valid base64") as info:
        backend.get_state()
    assert backend.key in str(info.value)
    # A create finds the key taken and reports what is there: the same error.
    with pytest.raises(RendezvousStateError):
        backend.set_state(b"mine")
    # A made-up token is a failed compare-and-set, never an overwrite.
    with pytest.raises(RendezvousStateError):
        backend.set_state(b"mine", 1)
    assert _tree(params) == before


def test_valid_base64_of_garbage_is_opaque_bytes(etcd_api_params: Params) -> None:
    # The backend stores bytes it does not interpret: garbage comes back as it is, for
    # the handler above to reject; it is never overwritten without its token.
    params = etcd_api_params("run", read_timeout=READ_TIMEOUT)
    backend, _store = etcd_rdzv.create_backend(params)
    _plant(params, backend.key, base64.b64encode(GARBAGE).decode())
    state, token = backend.get_state()  # type: ignore[misc]
    assert state == GARBAGE
    assert backend.set_state(b"mine") == (GARBAGE, token, False)
    assert backend.set_state(b"mine", token)[2]  # type: ignore[index]


HANDLER_GARBAGE = {
    "result-not-json": ("result", "garbage {"),
    "result-foreign-json": ("result", json.dumps({"ranks": {"a": 0}})),
    "result-members-not-strings": ("result", json.dumps({"members": [1, 2]})),
    "result-base64-garbage": ("result", base64.b64encode(GARBAGE).decode()),
    "join-key-not-json": ("node", "garbage {"),
    "join-key-foreign-json": ("node", json.dumps(["not", "a", "node"])),
    "incarnation-not-hex": ("incarnation", "not an incarnation"),
}


@pytest.mark.parametrize("case", list(HANDLER_GARBAGE), ids=list(HANDLER_GARBAGE))
def test_corrupt_handler_keys_are_a_state_error(
    etcd_api_params: Params, etcd_api: str, case: str
) -> None:
    where, value = HANDLER_GARBAGE[case]
    params = etcd_api_params("run", backend="etcd-rdzv", read_timeout=READ_TIMEOUT, min_nodes=2)
    prefix = str(params.get("key_prefix"))
    key = {
        "result": _keys.result_key(prefix, "run", 1),
        "node": _keys.node_key(prefix, "run", 1, "intruder"),
        "incarnation": _keys.incarnation_key(prefix, "run"),
    }[where]
    _plant(params, key, value)
    before = _tree(params)
    handler = etcd_rdzv.create_handler(_with(params, join_timeout=20), use_torch=False)
    started = time.monotonic()
    try:
        with pytest.raises(RendezvousStateError) as info:
            handler.next_rendezvous()
        assert key in str(info.value), info.value
        assert time.monotonic() - started < READ_TIMEOUT + SLACK  # at once, not at a timeout
    finally:
        handler.shutdown()
    # The planted key is as it was; the node's own join key is gone again. A round
    # that can still complete (a broken join key of another node) keeps the node's
    # withdrawal, so no result counts it; one that cannot (a broken result) does not.
    # A broken incarnation: on v2 the read before the join finds it (nothing written);
    # on v3 the first join's own transaction reads it, so its key is withdrawn.
    after = _tree(params)
    if where != "incarnation":
        after.pop(_keys.incarnation_key(prefix, "run"), None)  # the run's first join wrote it
    gone = _keys.gone_key(prefix, "run", 1, handler.node_id)
    withdrawn = after.pop(gone, None)
    assert after == before
    expected = where == "node" or (where == "incarnation" and etcd_api == "v3")
    assert (withdrawn is not None) == expected, withdrawn


def test_foreign_store_value_is_a_value_error_and_stays(etcd_api_params: Params) -> None:
    params = etcd_api_params("run", read_timeout=READ_TIMEOUT)
    _backend, store = etcd_rdzv.create_backend(params)
    _plant(params, store._path("k"), "written by something else")
    before = _tree(params)
    for call in (lambda: store.get("k"), lambda: store.add("k", 1), lambda: store.append("k", "x")):
        with pytest.raises(ValueError, match="not one this store wrote"):
            call()
    assert _tree(params) == before


# -- values larger than etcd accepts --------------------------------------------------


def _oversized(api: str) -> int:
    # v3: etcd's --max-request-bytes (1.5 MiB by default) bounds every request; ~2 MiB
    # is beyond it. v2 has no such limit: its form parser stops at 10 MiB of body, which
    # 8 MiB of state exceeds once base64-encoded (x 4/3).
    return 2 * 1024 * 1024 if api == "v3" else 8 * 1024 * 1024


def test_oversized_state_is_a_clear_error_and_keeps_the_previous(
    seeded: Seeded, etcd_api: str
) -> None:
    backend, _store = etcd_rdzv.create_backend(seeded.params)
    current = backend.get_state()
    assert current is not None
    size = _oversized(etcd_api)
    for token in (current[1], None):
        with pytest.raises(RendezvousStateError, match="too large") as info:
            backend.set_state(b"x" * size, token)
        assert f"{size} bytes" in str(info.value), info.value
    assert backend.get_state() == current
    assert _tree(seeded.params) == seeded.tree


def test_oversized_store_value_is_a_clear_error_and_keeps_the_previous(
    seeded: Seeded, etcd_api: str
) -> None:
    _backend, store = etcd_rdzv.create_backend(seeded.params)
    big = b"x" * _oversized(etcd_api)
    # A plain write, and a compare-and-set (append and compare_set write that way).
    calls: list[Callable[[], None]] = [lambda: store.set("k", big), lambda: store.append("k", big)]
    for call in calls:
        with pytest.raises(ValueError, match="too large") as info:
            call()
        assert "bytes for key 'k'" in str(info.value), info.value
    assert store.get("k") == b"v"
    assert _tree(seeded.params) == seeded.tree


# -- run ids and store keys with odd characters ------------------------------------------

ODD_RUN_IDS = [
    "a",
    "a/b",
    "a/b/",
    "/a/b",
    "a b",
    " spaced ",
    "é",
    "日本",
    ".",
    "..",
    "a/../b",
    "~YS9i",  # what "a/b" becomes: as a run id of its own it must not collide
    "x" * 250,
    "tab\there",
]

ODD_STORE_KEYS = ["x/y", "/", "é", " spaced ", "../..", "b/state", "k", "a\x00b"]


def test_odd_run_ids_work_and_stay_apart(etcd_api_params: Params) -> None:
    pairs = {run: etcd_rdzv.create_backend(etcd_api_params(run)) for run in ODD_RUN_IDS}
    for run, (backend, store) in pairs.items():
        backend.set_state(run.encode())
        for key in ODD_STORE_KEYS:
            store.set(key, f"{run}|{key}")
    for run, (backend, store) in pairs.items():
        assert backend.get_state()[0] == run.encode(), run  # type: ignore[index]
        assert store.multi_get(ODD_STORE_KEYS) == [f"{run}|{k}".encode() for k in ODD_STORE_KEYS]
        assert store.num_keys() == len(ODD_STORE_KEYS), run

    # No id adds directory levels: each run is one segment under the prefix, holding
    # "state" and "store/<one segment per key>".
    params = etcd_api_params("a")
    prefix = str(params.get("key_prefix"))
    tree = _tree(params)
    segments = {_keys.run_dir(prefix, run)[len(prefix) + 1 :] for run in ODD_RUN_IDS}
    assert len(segments) == len(ODD_RUN_IDS)
    assert all("/" not in s for s in segments), segments
    for key in tree:
        parts = key[len(prefix) + 1 :].split("/")
        assert parts[0] in segments, key
        assert parts[1:] == ["state"] or (len(parts) == 3 and parts[1] == "store"), key
    assert len(tree) == len(ODD_RUN_IDS) * (1 + len(ODD_STORE_KEYS))


def test_run_a_slash_b_and_run_a_key_b_do_not_collide(etcd_api_params: Params) -> None:
    backend_ab, store_ab = etcd_rdzv.create_backend(etcd_api_params("a/b"))
    backend_a, store_a = etcd_rdzv.create_backend(etcd_api_params("a"))
    backend_ab.set_state(b"state of a/b")
    store_a.set("b/state", "key b/state of a")
    store_a.set("b", "key b of a")
    store_ab.set("state", "key state of a/b")
    assert backend_ab.get_state()[0] == b"state of a/b"  # type: ignore[index]
    assert backend_a.get_state() is None
    assert store_a.num_keys() == 2
    assert store_ab.num_keys() == 1
    assert store_ab.get("state") == b"key state of a/b"


def test_handler_with_an_odd_run_id(etcd_api_params: Params) -> None:
    run = "job/1 é"
    params = etcd_api_params(run, backend="etcd-rdzv", read_timeout=READ_TIMEOUT)
    handler = etcd_rdzv.create_handler(params, use_torch=False)
    try:
        result = handler.next_rendezvous()
        assert (result.rank, result.world_size, result.members) == (0, 1, (handler.node_id,))
        result.store.set("x/y", "1")
        assert result.store.get("x/y") == b"1"
    finally:
        handler.shutdown()
    prefix = str(params.get("key_prefix"))
    run_dir = _keys.run_dir(prefix, run)
    assert run_dir.count("/") == prefix.count("/") + 1
    assert all(key.startswith(run_dir + "/") for key in _tree(params)), _tree(params)
