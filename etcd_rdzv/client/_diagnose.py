"""Hints for the common connection mistakes, found after a connect failed.

Endpoint by endpoint: nothing listens there, ``protocol=https`` against an etcd that
serves plain HTTP, ``protocol=http`` against one that serves TLS, a TLS listener that
hangs up in the handshake (etcd 3.4 wanting a client certificate: the TLS error alone
does not say that the listener speaks TLS), or etcd's peer port given instead of its
client port. At most a TCP connect and two small requests (or a TLS handshake) per
endpoint, over the client's own transport, all within :data:`HINT_BUDGET` seconds,
and only on the failure path. Endpoints with the same mistake share one hint. A hint
is a courtesy: it never hides the real error, and nothing is guessed.
"""

from __future__ import annotations

import http.client
import ipaddress
import logging
import socket
import ssl
import time

from .._kv._failover import ConnectFailed, TLSFailed
from .._kv._http import Transport
from .._kv._json import loads
from ..config.params import ClientConfig, Endpoint

__all__ = ["HINT_BUDGET", "diagnose"]

log = logging.getLogger(__name__)

HINT_BUDGET = 3.0  # seconds the diagnosis of a failed connect may take in all
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
_MAX_MEMBERS_LISTED = 8
_AT = "\x00"  # where a hint names its endpoints (no printable text holds it)


def diagnose(config: ClientConfig, transport: Transport) -> list[str]:
    """What a failed connect most likely got wrong: a hint per mistake found, naming
    the endpoints that made it; ``[]`` when nothing is clear."""
    deadline = time.monotonic() + min(float(config.read_timeout), HINT_BUDGET)
    found: dict[str, list[str]] = {}  # hint (with _AT for its endpoints) -> endpoints
    for endpoint in config.endpoints:
        if deadline - time.monotonic() <= 0:
            break
        try:
            hint = _diagnose_one(config, transport, endpoint, deadline)
        except Exception as exc:  # a hint is a courtesy: never hide the real error
            log.debug("no hint for %s: %s", endpoint.netloc(), exc)
            hint = None
        if hint:
            found.setdefault(hint[0], []).append(hint[1])
    return [hint.replace(_AT, ", ".join(where)) for hint, where in found.items()]


def _is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _diagnose_one(
    config: ClientConfig, transport: Transport, endpoint: Endpoint, deadline: float
) -> tuple[str, str] | None:
    """The hint for ``endpoint``, with :data:`_AT` where it names it, and its name."""
    url = endpoint.url(config.protocol)

    def left() -> float:
        return max(deadline - time.monotonic(), 0.05)

    try:
        socket.create_connection((endpoint.host, endpoint.port), timeout=left()).close()
    except ConnectionRefusedError:
        return _nothing_listens(endpoint), endpoint.netloc()
    except OSError:
        return None  # unreachable, unresolvable, slow: the error says so already
    plain = _plain_http(transport, endpoint, left()) if config.protocol == "https" else None
    if plain == "etcd":
        return (
            f"etcd at {_AT} answered plain HTTP: use protocol=http (or give etcd TLS "
            "certificates: --cert-file/--key-file and https:// client URLs)"
        ), url
    try:
        resp, data = transport.request(url, "/members", b"", {}, left(), method="GET")
    except (OSError, http.client.HTTPException) as exc:
        if config.protocol == "https" and _hung_up_in_tls(exc, plain):
            log.debug("TLS handshake with %s failed: %s", url, exc)
            return _TLS_FAILED, url
        if config.protocol == "http" and _serves_tls(endpoint, left()):
            log.debug("plain HTTP to %s failed (%s), but it answers TLS", url, exc)
            return _SERVES_TLS, url
        return None
    clients = _peer_members(resp.status, data or b"", url)
    if clients is not None:
        advertised = ", ".join(clients) if clients else "(none listed)"
        return (
            f"{_AT} looks like etcd's peer port (2380 by default; it serves /members, not "
            f"the client API): use etcd's client port (2379 by default), one of the "
            f"advertise-client-urls its members list: {advertised}"
        ), url
    return None


def _nothing_listens(endpoint: Endpoint) -> str:
    if endpoint.host.lower() == "localhost" or endpoint.host == "127.0.0.1":
        serve = f"`etcd-rdzv serve --port {endpoint.port}` starts one there"
    elif _is_loopback(endpoint.host):
        serve = "`etcd-rdzv serve` starts one (on 127.0.0.1; it prints its endpoint)"
    else:
        return (
            f"Nothing listens at {_AT} (connection refused): check the host and port "
            "(etcd's client port is 2379 unless its --listen-client-urls say otherwise)"
        )
    return (
        f"Nothing listens at {_AT} (connection refused): is etcd running there? For a "
        f"development etcd on this machine, {serve}"
    )


_TLS_FAILED = (
    f"etcd at {_AT} serves TLS (it does not answer plain HTTP), so protocol=https is "
    "right, but the TLS session failed: check 'ca_cert' (the CA that signed etcd's "
    "certificate) and, if etcd requires client certificates, 'ssl_cert'/'ssl_cert_key'"
)
_SERVES_TLS = (
    f"{_AT} answered a TLS handshake but not plain HTTP: the endpoint may serve TLS: use "
    "protocol=https (--protocol https)"
)


def _hung_up_in_tls(exc: BaseException, plain: str | None) -> bool:
    """Whether a request over TLS failed in its handshake, without a reason, with a
    server that speaks TLS (its plain-HTTP answer said so): etcd 3.4 hangs up in the
    middle of a handshake it does not like. A TLS alert or a certificate not
    accepted says what went wrong by itself (the error's own hint)."""
    if plain != "tls" or not isinstance(exc, (TLSFailed, ssl.SSLError, ConnectFailed)):
        return False
    text = str(exc)
    if "ALERT" in text or "CERTIFICATE_VERIFY_FAILED" in text:
        return False
    return isinstance(exc, (TLSFailed, ssl.SSLError)) or "TLS handshake" in text


def _serves_tls(endpoint: Endpoint, timeout: float) -> bool:
    """Whether ``endpoint`` answers a TLS handshake: it completes, or the server ends
    it with a TLS alert (it wants a client certificate). Nothing is sent after the
    handshake, so the server's certificate is not verified: this only asks whether
    the listener speaks TLS. (A plain-HTTP server answers a handshake with an HTTP
    error: "wrong version number".)"""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((endpoint.host, endpoint.port), timeout=timeout) as sock,
            context.wrap_socket(sock, server_hostname=endpoint.host),
        ):
            return True
    except ssl.SSLError as exc:
        return "ALERT" in str(exc)
    except OSError:
        return False


def _plain_http(transport: Transport, endpoint: Endpoint, timeout: float) -> str | None:
    """How ``endpoint`` answers ``GET /version`` over plain HTTP: ``"etcd"`` (etcd's
    answer), ``"tls"`` (a TLS listener's 400 "Client sent an HTTP request to an HTTPS
    server"), or ``None`` (anything else, or nothing)."""
    try:
        resp, data = transport.request(
            endpoint.url("http"), "/version", b"", {}, timeout, method="GET"
        )
    except (OSError, http.client.HTTPException):
        return None
    head = (data or b"")[:4096]
    if resp.status == 200 and b"etcdserver" in head:
        return "etcd"
    if resp.status == 400 and b"HTTPS server" in head:
        return "tls"
    return None


def _peer_members(status: int, data: bytes, url: str) -> list[str] | None:
    """The members' client URLs if the answer to ``GET /members`` is an etcd peer
    listener's (it lists the cluster's members; a client port answers 404), else
    ``None``. Untrusted answer: only printable URLs are kept, a few of them."""
    if status != 200:
        return None
    try:
        members = loads(data, url)
    except http.client.HTTPException:
        return None
    if not isinstance(members, list) or not all(
        isinstance(m, dict) and "peerURLs" in m for m in members
    ):
        return None
    found: list[str] = []
    for member in members:
        urls = member.get("clientURLs")
        for item in urls if isinstance(urls, list) else []:
            printable = isinstance(item, str) and item.isprintable() and len(item) <= 200
            if printable and item not in found:
                found.append(item)
    return found[:_MAX_MEMBERS_LISTED]
