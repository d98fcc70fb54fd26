"""The client factory: builds the KV client for an etcd cluster from rendezvous parameters.

``create_client`` validates every option first (``ValueError`` naming the option, no
network I/O), then builds the connection pool (TLS verifies by default), then probes
etcd once so that an unreachable cluster, a wrong CA or wrong credentials fail here,
within ``read_timeout``, with a :class:`~etcd_rdzv.errors.RendezvousConnectionError`.

The ``api`` option picks the KV implementation: ``v2`` (python-etcd, imported only
then) or ``v3`` (etcd's JSON gateway over urllib3). There is no automatic switching:
etcd keeps the two keyspaces apart, so nodes of one run on different APIs would never
see each other. At connect, a client built for a run checks once that the run has no
keys in the other API's keyspace, and refuses to start if it does.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import logging
import shlex
import socket
import ssl
import time
from typing import TYPE_CHECKING, Any

import urllib3

from . import _keys
from ._kv import KV
from .errors import RendezvousConnectionError, RendezvousStateError
from .params import DEFAULT_KEY_PREFIX, ClientConfig, Endpoint, ParamsLike

if TYPE_CHECKING:
    from ._kv._http import Transport
    from ._kv.v3 import V3KV

__all__ = ["build_kv", "connect", "create_client", "ssl_context"]

log = logging.getLogger(__name__)


def ssl_context(config: ClientConfig) -> ssl.SSLContext:
    """The TLS context for ``config``: verifies the server unless ``tls_insecure``."""
    try:
        ctx = ssl.create_default_context(cafile=config.ca_cert)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(
            f"Option 'ca_cert': cannot load CA certificates from {config.ca_cert!r}: {exc}"
        ) from exc
    if config.ssl_cert:
        try:
            ctx.load_cert_chain(config.ssl_cert, config.ssl_cert_key)
        except (OSError, ssl.SSLError) as exc:
            key = config.ssl_cert_key or "(none: expected inside the certificate file)"
            raise ValueError(
                f"Options 'ssl_cert'/'ssl_cert_key': cannot load client certificate "
                f"{config.ssl_cert!r} with key {key!r}: {exc}"
            ) from exc
    if config.tls_insecure:
        log.warning(
            "TLS verification of etcd at %s is OFF (tls_insecure=true): anyone on the path "
            "can impersonate etcd.",
            ", ".join(config.urls()),
        )
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _pool(config: ClientConfig) -> urllib3.PoolManager:
    # For the diagnostics and the other-keyspace check (the KV requests of both APIs go
    # over the transport, see _transport). No retries: failover lives in the KV layer.
    retries = urllib3.Retry(total=3, connect=0, read=0, status=0, other=0, redirect=3)
    kwargs: dict[str, Any] = {
        "num_pools": max(4, len(config.endpoints)),
        "maxsize": 16,
        "retries": retries,
        "timeout": urllib3.Timeout(total=config.read_timeout),
    }
    if config.protocol == "https":
        kwargs["ssl_context"] = ssl_context(config)
        kwargs["cert_reqs"] = "CERT_NONE" if config.tls_insecure else "CERT_REQUIRED"
        if config.tls_insecure:
            kwargs["assert_hostname"] = False
    return urllib3.PoolManager(**kwargs)


def _transport(pool: urllib3.PoolManager) -> Transport:
    """The HTTP transport of both APIs' KV requests, with the pool's TLS settings."""
    from ._kv._http import Transport

    return Transport(pool.connection_pool_kw.get("ssl_context"))


def build_kv(config: ClientConfig) -> KV:
    """Build the KV client for ``config`` (``config.api`` picks v2 or v3) without any
    network I/O."""
    return _build(config, _pool(config))


def _build(config: ClientConfig, pool: urllib3.PoolManager) -> KV:
    if config.api == "v3":
        return _build_v3(config, pool)
    import etcd  # the v2 client library; imported here so `import etcd_rdzv` stays light

    from ._kv._v2http import Pool
    from ._kv.v2 import V2KV

    # python-etcd's requests go over our transport (see _kv._v2http); python-etcd's
    # own pool would skip verification without a CA.
    http = Pool(_transport(pool))
    clients = []
    for endpoint in config.endpoints:
        host = f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host
        client = etcd.Client(
            host=host,
            port=endpoint.port,
            protocol=config.protocol,
            read_timeout=config.read_timeout,
            username=config.username,
            password=config.password,
            allow_reconnect=False,
            allow_redirect=True,
        )
        client.http.clear()
        client.http = http
        clients.append(client)
    return V2KV(
        clients,
        config.urls(),
        config.read_timeout,
        http,
        config.username,
        dir_root=config.key_prefix,
    )


def _build_v3(config: ClientConfig, pool: urllib3.PoolManager) -> V3KV:
    from ._kv.v3 import V3KV

    return V3KV(
        config.urls(),
        config.read_timeout,
        pool,
        config.username,
        config.password,
        _transport(pool),
    )


def create_client(params: ParamsLike) -> KV:
    """Build and probe an etcd client from rendezvous parameters.

    Args:
        params: ours or torch's ``RendezvousParameters``; options as in
            ``docs/configuration.md``.

    Returns:
        The KV client; one per process is plenty (it is thread-safe and pools
        connections).

    Raises:
        ValueError: a bad option, before any network call.
        RendezvousConnectionError: etcd did not answer within ``read_timeout``, TLS
            verification failed, or the credentials were refused.
    """
    return connect(ClientConfig.from_params(params))


def connect(config: ClientConfig) -> KV:
    """Build the KV client for a validated ``config`` and probe etcd once.

    Raises:
        RendezvousConnectionError: as :func:`create_client`; when a common mistake
            explains it (a plain-HTTP etcd with ``protocol=https``, etcd's peer port
            as the endpoint, nothing listening), the message starts with what to do.
    """
    pool = _pool(config)
    kv = _build(config, pool)
    try:
        kv.probe(config.key_prefix)
        _check_one_api(kv, config, pool)
    except RendezvousConnectionError as exc:
        kv.close()
        hints = _diagnose(config, pool)
        if not hints:
            raise
        raise RendezvousConnectionError(" ".join(f"{h}." for h in hints) + f" {exc}") from exc
    except BaseException:
        kv.close()
        raise
    _sweep(kv)
    log.debug("etcd client ready: %r", config)
    return kv


# -- hints for the common connection mistakes ------------------------------------------

_HINT_BUDGET = 3.0  # seconds the diagnosis of a failed connect may take in all
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def _is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _diagnose(config: ClientConfig, pool: urllib3.PoolManager) -> list[str]:
    """What a failed connect most likely got wrong, endpoint by endpoint: nothing
    listens there, ``protocol=https`` against an etcd that serves plain HTTP, or etcd's
    peer port given instead of its client port. At most a TCP connect and two small
    requests per endpoint, all within :data:`_HINT_BUDGET` (the failure path only).
    Finds nothing (``[]``) rather than guessing."""
    deadline = time.monotonic() + min(float(config.read_timeout), _HINT_BUDGET)
    hints = []
    for endpoint in config.endpoints:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            hint = _diagnose_one(config, pool, endpoint, deadline)
        except Exception as exc:  # a hint is a courtesy: never hide the real error
            log.debug("no hint for %s: %s", endpoint.netloc(), exc)
            hint = None
        if hint:
            hints.append(hint)
    return hints


def _diagnose_one(
    config: ClientConfig, pool: urllib3.PoolManager, endpoint: Endpoint, deadline: float
) -> str | None:
    url = endpoint.url(config.protocol)

    def left() -> float:
        return max(deadline - time.monotonic(), 0.05)

    try:
        socket.create_connection((endpoint.host, endpoint.port), timeout=left()).close()
    except ConnectionRefusedError:
        where = endpoint.netloc()
        if endpoint.host.lower() == "localhost" or endpoint.host == "127.0.0.1":
            serve = f"`etcd-rdzv serve --port {endpoint.port}` starts one there"
        elif _is_loopback(endpoint.host):
            serve = "`etcd-rdzv serve` starts one (on 127.0.0.1; it prints its endpoint)"
        else:
            return (
                f"Nothing listens at {where} (connection refused): check the host and port "
                "(etcd's client port is 2379 unless its --listen-client-urls say otherwise)"
            )
        return (
            f"Nothing listens at {where} (connection refused): is etcd running there? For a "
            f"development etcd on this machine, {serve}"
        )
    except OSError:
        return None  # unreachable, unresolvable, slow: the error says so already
    if config.protocol == "https" and _answers_plain_http(endpoint, left()):
        return (
            f"etcd at {url} answered plain HTTP: use protocol=http (or give etcd TLS "
            "certificates: --cert-file/--key-file and https:// client URLs)"
        )
    clients = _peer_members(pool, url, left())
    if clients is not None:
        advertised = ", ".join(clients) if clients else "(none listed)"
        return (
            f"{url} looks like etcd's peer port (2380 by default; it serves /members, not "
            f"the client API): use etcd's client port (2379 by default), one of the "
            f"advertise-client-urls its members list: {advertised}"
        )
    return None


def _answers_plain_http(endpoint: Endpoint, timeout: float) -> bool:
    """Whether ``endpoint`` answers ``GET /version`` over plain HTTP with etcd's answer
    (a TLS listener answers 400 "Client sent an HTTP request to an HTTPS server")."""
    conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=timeout)
    try:
        conn.request("GET", "/version")
        resp = conn.getresponse()
        body = resp.read(4096)
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()
    return resp.status == 200 and b"etcdserver" in body


def _peer_members(pool: urllib3.PoolManager, url: str, timeout: float) -> list[str] | None:
    """The members' client URLs if ``url`` is an etcd peer listener (its ``/members``
    lists the cluster's members; a client port answers 404), else ``None``. Untrusted
    answer: only printable URLs are kept, a few of them."""
    try:
        resp = pool.request("GET", f"{url}/members", timeout=timeout, retries=False)
    except (urllib3.exceptions.HTTPError, OSError):
        return None
    if resp.status != 200:
        return None
    try:
        members = json.loads(resp.data[:65536].decode("utf-8"))
    except (ValueError, UnicodeError):
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
    return found[:8]


def _sweep(kv: KV) -> None:
    """On v2, remove the directories under the key prefix that keys leaving by their
    TTL left empty (at most once an hour per prefix, whichever client comes first;
    never raises). v3 has no directories."""
    if kv.api != "v2":
        return  # and python-etcd stays unimported
    from ._kv.v2 import V2KV

    if isinstance(kv, V2KV):
        kv.sweep_empty_dirs()


def _check_one_api(kv: KV, config: ClientConfig, pool: urllib3.PoolManager) -> None:
    """Refuse a run that already has keys in the other API's keyspace.

    etcd's v2 and v3 keyspaces are separate: a node on ``api=v3`` never sees the keys of
    a node on ``api=v2``, so a job whose nodes disagree would split into groups that
    wait for each other forever. One read at connect; when the other keyspace cannot be
    read (no v2 API, no permission), there is nothing to compare with.

    Raises:
        RendezvousStateError: the run has keys in the other keyspace.
    """
    if config.run_id is None:
        return
    run_dir = _keys.run_dir(config.key_prefix, config.run_id)
    found: bool | None
    from ._kv.v3 import V3KV

    if isinstance(kv, V3KV):
        other = "v2"
        found = kv.v2_has_keys_under(run_dir)
    else:
        other = "v3"
        # The same endpoints, TLS settings, credentials and pool, on the v3 gateway. It
        # holds no lease and shares kv's pool, so it is dropped, not closed.
        try:
            found = _build_v3(config, pool).has_keys_under(run_dir)
        except RendezvousConnectionError as exc:
            log.debug("could not check the v3 keyspace for run %s: %s", config.run_id, exc)
            found = None
    if found:
        delete = f"etcd-rdzv delete --run-id {shlex.quote(config.run_id)} --api {other}"
        if config.key_prefix != DEFAULT_KEY_PREFIX:
            delete += f" --key-prefix {shlex.quote(config.key_prefix)}"
        raise RendezvousStateError(
            f"Run {config.run_id!r} has keys under {run_dir}/ in etcd's {other} keyspace, but "
            f"this node uses api={config.api}. Nodes on different APIs never see each other: "
            f"every node of a job must use the same 'api' option (or pick a new run id, or "
            f"delete the run's {other} keys: {delete}). See docs/api.md."
        )
