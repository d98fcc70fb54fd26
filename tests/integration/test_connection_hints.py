"""The three common connection mistakes get an error that says what to do.

* ``protocol=https`` against an etcd that serves plain HTTP: use ``protocol=http``;
* etcd's peer port (2380) given as the endpoint: use the client port, and the members'
  advertised client URLs are listed;
* nothing listening on a loopback endpoint: ``etcd-rdzv serve`` starts a development
  etcd there;
* ``protocol=http`` against an etcd that serves TLS: use ``protocol=https``.

Each is a :class:`~etcd_rdzv.RendezvousConnectionError` naming the endpoint, as before;
the hint comes first, once for all the endpoints it is about. An etcd that serves TLS
gets no "plain HTTP" hint: its TLS error says what is wrong. The hints come from the
diagnosis only: the probe's error has none. The last tests run ``etcd-rdzv`` and read
what it prints.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousConnectionError, RendezvousParameters
from etcd_rdzv.testing import EtcdRdzvCli, EtcdServer, TLSFiles

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
    assert "api=v2" not in message  # what is wrong is the port, not the API


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
    """An etcd that serves TLS and refuses a client without a certificate: the TLS
    error says so by itself (etcd's alert), and no hint sends the user to plain HTTP."""
    params = mtls_server.params(
        protocol="https", ca_cert=certs.ca, read_timeout=READ_TIMEOUT, api="v3"
    )
    message = _connect_error(params)
    assert message.startswith("No etcd endpoint completed probe read"), message
    assert f"{mtls_server.client_url}: TLS error: " in message, message
    assert "etcd rejected our client certificate or requires one" in message, message
    assert "'ssl_cert'/'ssl_cert_key'" in message
    assert "use protocol=http" not in message, message
    assert "peer port" not in message
    assert "Nothing listens" not in message


# -- the command line: what an operator reads ----------------------------------------------


@pytest.fixture(scope="module")
def tls_server(certs: CertFiles) -> Iterator[EtcdServer]:
    """https, no client certificate needed."""
    tls = TLSFiles(certs.server_cert, certs.server_key, certs.ca)
    with EtcdServer("hint-tls", enable_v2=False, tls=tls) as server:
        yield server


def _cli_error(cli: EtcdRdzvCli, *args: str, command: tuple[str, ...] = ("status",)) -> str:
    """``etcd-rdzv status`` (or ``command``) with ``args``: it must fail, within
    MAX_ELAPSED; all it printed (stderr), which must be its one error line."""
    started = time.monotonic()
    done = cli.run(*command, "--run-id", "hints", "--read-timeout", str(READ_TIMEOUT), *args)
    assert time.monotonic() - started < MAX_ELAPSED
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("etcd-rdzv: error: ") and done.stderr.count("\n") == 1, (
        done.stderr
    )
    return done.stderr


def _three_tls_endpoints(tls_server: EtcdServer, mtls_server: EtcdServer) -> list[str]:
    """Three endpoints that serve TLS (two names of one member, and another member)."""
    port = tls_server.endpoint.rsplit(":", 1)[1]
    return [tls_server.endpoint, f"localhost:{port}", mtls_server.endpoint]


def test_plain_http_against_tls_says_use_https_once(
    etcd_rdzv_cli: EtcdRdzvCli, tls_server: EtcdServer, mtls_server: EtcdServer, certs: CertFiles
) -> None:
    """protocol=http (the default) against members that serve TLS: they close the
    request unanswered, and the error says once, for all of them, to use https."""
    endpoints = _three_tls_endpoints(tls_server, mtls_server)
    error = _cli_error(etcd_rdzv_cli, "--endpoint", ",".join(endpoints))
    hint = "the endpoint may serve TLS: use protocol=https (--protocol https)"
    assert error.count(hint) == 1, error
    urls = ", ".join(f"http://{e}" for e in endpoints)
    assert error.startswith(f"etcd-rdzv: error: {urls} answered a TLS handshake"), error
    assert f"tried {urls}: RemoteDisconnected: the connection closed unanswered" in error, error
    assert "use protocol=http " not in error and "peer port" not in error

    # The advice works.
    done = etcd_rdzv_cli.run(
        "status", "--run-id", "hints", "--endpoint", tls_server.endpoint,
        "--protocol", "https", "--ca-cert", certs.ca,
    )  # fmt: skip
    # Connected: the run 'hints' does not exist there (exit 3), which status says.
    assert done.returncode == 3 and "run 'hints' does not exist" in done.stderr, done.stderr


@pytest.mark.parametrize("command", [("status",), ("join", "--min-nodes", "1")])
def test_tls_failures_of_three_endpoints_are_short_and_say_the_hint_once(
    etcd_rdzv_cli: EtcdRdzvCli,
    tls_server: EtcdServer,
    mtls_server: EtcdServer,
    command: tuple[str, ...],
) -> None:
    """https without 'ca_cert': each endpoint fails alike. The error names each
    endpoint once, the reason and the hint once, and no WARNING precedes it (a
    handler's first request is a watch, a client's the probe)."""
    endpoints = _three_tls_endpoints(tls_server, mtls_server)
    where = ["--endpoint", ",".join(endpoints), "--protocol", "https"]
    error = _cli_error(etcd_rdzv_cli, *where, command=command)
    assert len(error.encode()) < 500, f"{len(error.encode())} bytes: {error}"
    for endpoint in endpoints:
        assert error.count(f"https://{endpoint}") == 1, error
    assert error.count("certificate verify failed") == 1, error
    assert error.count("check 'ca_cert'") == 1, error
    assert "_ssl.c" not in error and "[SSL:" not in error, error


def test_the_peer_port_on_the_command_line_says_use_the_client_port(
    etcd_rdzv_cli: EtcdRdzvCli, etcd_server_v3: EtcdServer
) -> None:
    """No word of api=v2 (v3 is the default, and the endpoint is what is wrong)."""
    peer = etcd_server_v3.peer_url.removeprefix("http://")
    error = _cli_error(etcd_rdzv_cli, "--endpoint", peer)
    assert f"{etcd_server_v3.peer_url} looks like etcd's peer port" in error, error
    assert "use etcd's client port (2379 by default)" in error, error
    assert etcd_server_v3.client_url in error, error
    assert "api=v2" not in error and "--api" not in error, error


def test_a_failed_endpoint_before_one_that_answers_is_still_logged(
    etcd_rdzv_cli: EtcdRdzvCli, tls_server: EtcdServer, mtls_server: EtcdServer, certs: CertFiles
) -> None:
    """The moves of a client's first request are held back only until an endpoint
    answers: then the endpoint that failed is named in a WARNING."""
    where = f"{mtls_server.endpoint},{tls_server.endpoint}"
    done = etcd_rdzv_cli.run(
        "status", "--run-id", "hints", "--endpoint", where, "--protocol", "https",
        "--ca-cert", certs.ca,
    )  # fmt: skip
    # Connected: the run 'hints' does not exist there (exit 3), which status says.
    assert done.returncode == 3 and "run 'hints' does not exist" in done.stderr, done.stderr
    assert (
        f"WARNING: etcd endpoint {mtls_server.client_url} failed (TLS error: "
    ) in done.stderr, done.stderr
    assert f"moving on to {tls_server.client_url}" in done.stderr, done.stderr
