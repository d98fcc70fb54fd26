"""Building the KV client from a validated configuration, without any network I/O.

One :class:`~._kv._http.Transport` per client carries every HTTP request this package
sends to etcd: the KV requests of either API (python-etcd's through
:mod:`etcd_rdzv._kv.v2._pool`), the check of the other API's keyspace and the diagnosis of a
failed connect. Its TLS context is built here, verifying etcd's certificate unless
the operator switched that off (``tls_insecure``, with a warning).
"""

from __future__ import annotations

import logging
import ssl
from typing import TYPE_CHECKING

from .._kv import KV
from .._kv._http import Transport
from ..config._values import check_api_installed
from ..config.params import ClientConfig

if TYPE_CHECKING:
    from .._kv.v3 import V3KV

__all__ = ["build", "build_v3", "ssl_context", "transport"]

log = logging.getLogger(__name__)


def ssl_context(config: ClientConfig, *, warn: bool = True) -> ssl.SSLContext:
    """The TLS context for ``config``: verifies the server unless ``tls_insecure``
    (said at WARNING if ``warn``).

    Raises:
        ValueError: a CA or client certificate file cannot be loaded (names the option).
    """
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
        if warn:
            log.warning(
                "TLS verification of etcd at %s is OFF (tls_insecure=true): anyone on the "
                "path can impersonate etcd.",
                ", ".join(config.urls()),
            )
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def transport(config: ClientConfig) -> Transport:
    """The HTTP transport of one client for ``config`` (TLS contexts for ``https``:
    one for HTTP/1.1, one offering HTTP/2 for the v3 keep-alive stream)."""
    if config.protocol != "https":
        return Transport(max_response_bytes=config.max_response_bytes)
    h2 = ssl_context(config, warn=False)
    h2.set_alpn_protocols(["h2"])
    return Transport(ssl_context(config), config.max_response_bytes, h2)


def build(config: ClientConfig, http: Transport) -> KV:
    """The KV client for ``config`` (``config.api`` picks v2 or v3) over ``http``."""
    if config.api == "v3":
        return build_v3(config, http)
    # python-etcd and urllib3 come with the v2 extra, imported only here (and in the
    # v2 layer): `import etcd_rdzv` and v3 need neither. A config built without
    # from_params gets the same error as one parsed.
    check_api_installed(config.api)
    import etcd

    from .._kv.v2._pool import Pool
    from .._kv.v2.kv import V2KV

    # python-etcd's requests go over our transport (see _kv.v2._pool): python-etcd's own
    # urllib3 pool would skip verification without a CA, and reads answers unbounded.
    pool = Pool(http, config.urls())
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
            allow_redirect=False,  # the pool follows none: etcd's client URLs answer
        )
        client.http.clear()
        client.http = pool
        clients.append(client)
    return V2KV(
        clients,
        config.urls(),
        config.read_timeout,
        pool,
        config.username,
        dir_root=config.key_prefix,
    )


def build_v3(config: ClientConfig, http: Transport, urls: list[str] | None = None) -> V3KV:
    """The v3 KV client for ``config`` over ``http`` (whatever ``config.api`` says),
    trying ``urls`` in that order (default: ``config``'s endpoints, as given)."""
    from .._kv.v3 import V3KV

    return V3KV(
        config.urls() if urls is None else urls,
        config.read_timeout,
        config.username,
        config.password,
        http,
        key_prefix=config.key_prefix,
    )
