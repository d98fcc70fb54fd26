"""The three common connection mistakes get an error that says what to do.

* ``protocol=https`` against an etcd that serves plain HTTP: use ``protocol=http``;
* etcd's peer port (2380) given as the endpoint: use the client port, and the members'
  advertised client URLs are listed;
* nothing listening on a loopback endpoint: ``etcd-rdzv serve`` starts a development
  etcd there.

Each is a :class:`~etcd_rdzv.RendezvousConnectionError` naming the endpoint, as before;
the hint comes first. An etcd that serves TLS gets no "plain HTTP" hint but one about
its TLS settings. The hints come from the diagnosis only: the probe's error has none.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousConnectionError, RendezvousParameters
from etcd_rdzv.testing import EtcdServer, TLSFiles

from ._certs import CertFiles, find_openssl, generate

Params = Callable[..., RendezvousParameters]
READ_TIMEOUT = 5
MAX_ELAPSED = 15.0  # a generous bound that only catches hangs (read_timeout is 5)


def _connect_error(params: RendezvousParameters) -> str:
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as failed:
        etcd_rdzv.create_client(params).close()
    assert time.monotonic() - started < MAX_ELAPSED
    return str(failed.value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_https_against_plain_http_says_use_protocol_http(
    etcd_api_params: Params, etcd_api_server: EtcdServer
) -> None:
    params = etcd_api_params(protocol="https", read_timeout=READ_TIMEOUT)
    message = _connect_error(params)
    https = etcd_api_server.client_url.replace("http://", "https://")
    assert message.startswith(f"etcd at {https} answered plain HTTP: use protocol=http"), message
    assert "give etcd TLS certificates" in message
    assert "peer port" not in message
    params.config["protocol"] = "http"  # the advice works
    etcd_rdzv.create_client(params).close()


def test_the_peer_port_says_use_the_client_port(
    etcd_api_params: Params, etcd_api_server: EtcdServer
) -> None:
    params = etcd_api_params(read_timeout=READ_TIMEOUT)
    params.endpoint = etcd_api_server.peer_url.removeprefix("http://")
    message = _connect_error(params)
    assert message.startswith(f"{etcd_api_server.peer_url} looks like etcd's peer port"), message
    assert "use etcd's client port (2379 by default)" in message
    # The members' advertised client URLs: where to point the job instead.
    assert f"advertise-client-urls its members list: {etcd_api_server.client_url}" in message
    assert "plain HTTP" not in message


def test_nothing_listening_on_loopback_mentions_etcd_rdzv_serve(
    etcd_api_params: Params,
) -> None:
    port = _free_port()
    for endpoint in (f"127.0.0.1:{port}", f"localhost:{port}"):
        params = etcd_api_params(read_timeout=READ_TIMEOUT)
        params.endpoint = endpoint
        message = _connect_error(params)
        assert message.startswith(f"Nothing listens at {endpoint} (connection refused)"), message
        assert f"`etcd-rdzv serve --port {port}` starts one there" in message
        assert f"http://{endpoint}" in message  # the original error, endpoint named


def test_the_default_port_on_localhost(
    etcd_api_params: Params, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``localhost`` alone means port 2379: the hint names it. Whatever listens on this
    machine's 2379, the connections to it go to a free port here (refused there)."""
    nowhere = _free_port()
    real = socket.create_connection

    def to_a_free_port(address: tuple[str, int], *args: Any, **kwargs: Any) -> socket.socket:
        host, port = address
        if port == 2379 and host in ("localhost", "127.0.0.1"):
            address = ("127.0.0.1", nowhere)
        return real(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", to_a_free_port)
    params = etcd_api_params(read_timeout=READ_TIMEOUT)
    params.endpoint = "localhost"
    message = _connect_error(params)
    assert message.startswith("Nothing listens at localhost:2379 (connection refused)"), message
    assert "`etcd-rdzv serve --port 2379` starts one there" in message


def test_each_endpoint_gets_its_own_hint(
    etcd_api_params: Params, etcd_api_server: EtcdServer
) -> None:
    port = _free_port()
    params = etcd_api_params(read_timeout=READ_TIMEOUT)
    peer = etcd_api_server.peer_url.removeprefix("http://")
    params.endpoint = f"127.0.0.1:{port},{peer}"
    message = _connect_error(params)
    assert message.startswith(f"Nothing listens at 127.0.0.1:{port}"), message
    assert f"{etcd_api_server.peer_url} looks like etcd's peer port" in message


# -- no wrong hint for an etcd that does serve TLS ----------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    openssl = find_openssl()
    if openssl is None:
        pytest.fail("the openssl CLI is needed to make test certificates")
    return generate(tmp_path_factory.mktemp("hint-certs"), openssl)


@pytest.fixture(scope="module")
def mtls_server(certs: CertFiles) -> Iterator[EtcdServer]:
    """https only, client certificates required: a handshake without one fails the way
    a plain-HTTP server's does (the connection closes), but this one serves TLS."""
    tls = TLSFiles(certs.server_cert, certs.server_key, certs.ca, client_ca=certs.ca)
    with EtcdServer("hint-mtls", enable_v2=False, tls=tls) as server:
        yield server


def test_a_tls_etcd_gets_no_plain_http_hint(mtls_server: EtcdServer, certs: CertFiles) -> None:
    """The diagnosis finds that the endpoint serves TLS (its plain-HTTP answer is a TLS
    listener's), so the hint is about the TLS settings, not about protocol=http."""
    params = mtls_server.params(
        protocol="https", ca_cert=certs.ca, read_timeout=READ_TIMEOUT, api="v3"
    )
    message = _connect_error(params)
    assert message.startswith(
        f"etcd at {mtls_server.client_url} serves TLS (it does not answer plain HTTP), so "
        "protocol=https is right, but the TLS session failed: check 'ca_cert'"
    ), message
    assert "'ssl_cert'/'ssl_cert_key'" in message
    assert "plain HTTP: use protocol=http" not in message, message
    assert "peer port" not in message
    assert "Nothing listens" not in message
    assert "certificate" in message  # the real cause is still named
