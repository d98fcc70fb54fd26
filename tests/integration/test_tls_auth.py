"""TLS and authentication of ``create_client``/``create_backend`` against real etcd.

Every TLS configuration gets its own etcd member (module-scoped), once per etcd
variant: v2 (etcd 3.5 with --enable-v2, v2 auth), v3 on etcd 3.5 and v3 on Debian's
etcd 3.4 (both without the v2 API, v3 auth). The certificates are made with the
openssl CLI at test time (see :mod:`tests.integration._certs`). Each failure must be a
:class:`~etcd_rdzv.RendezvousConnectionError` that says what went wrong, raised well
within ``read_timeout``; a bad option must be a ``ValueError`` raised before any
network call.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3

import etcd_rdzv
from etcd_rdzv import RendezvousConnectionError, RendezvousParameters
from etcd_rdzv.testing import EtcdRdzvCli, EtcdServer, TLSFiles, cli_env
from etcd_rdzv.testing.pytest_plugin import (
    ETCD_VARIANTS,
    skip_or_fail,
    variant_api,
    variant_server_options,
)

from ._certs import CertFiles, find_openssl, generate
from ._rawkv import v3_post

READ_TIMEOUT = 5
MAX_ELAPSED = 10.0  # seconds a failure may take (read_timeout is 5)
ROOT_PASSWORD = "rootpw"


# -- fixtures ---------------------------------------------------------------------------


class _Member(EtcdServer):
    """An ``EtcdServer`` whose ``params()`` carry the ``api`` option of its variant."""

    def __init__(self, name: str, *, api: str, **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.api = api

    def params(self, run_id: str = "test-run", **config: Any) -> RendezvousParameters:
        config.setdefault("api", self.api)
        return super().params(run_id, **config)


@pytest.fixture(scope="module", params=ETCD_VARIANTS)
def variant(request: pytest.FixtureRequest) -> str:
    """The etcd variant of every server below; each test runs once per variant."""
    return str(request.param)


@pytest.fixture(scope="module")
def api(variant: str) -> str:
    return variant_api(variant)


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    """CA, server/client certs, a wrong CA and an expired server cert, as file paths."""
    openssl = find_openssl()
    if openssl is None:
        skip_or_fail("the openssl CLI is needed to make test certificates")
    return generate(tmp_path_factory.mktemp("certs"), openssl)


def _client_context(certs: CertFiles, *, verify: bool = True) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=certs.ca)
    ctx.load_cert_chain(certs.client_cert, certs.client_key)
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _wait_healthy(server: EtcdServer, ctx: ssl.SSLContext, timeout: float = 30.0) -> None:
    """Poll ``/health`` with a client certificate until etcd serves requests.

    With ``--client-cert-auth`` EtcdServer's own readiness probe only checks that the
    port is open, which etcd binds before it has elected itself leader.
    """
    deadline = time.monotonic() + timeout
    delay = 0.02
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(
                f"{server.client_url}/health", timeout=1, context=ctx
            ) as resp:
                if json.loads(resp.read()).get("health") == "true":
                    return
        except (OSError, ValueError) as exc:
            last = exc
        time.sleep(delay)  # back-off between polls, not a fixed wait for readiness
        delay = min(delay * 1.5, 0.25)
    raise RuntimeError(f"{server} not healthy within {timeout}s ({last}):\n{server.log_tail()}")


@pytest.fixture(scope="module")
def mtls_server(certs: CertFiles, variant: str, api: str) -> Iterator[EtcdServer]:
    """https, server cert from our CA, client certificates required (--client-cert-auth)."""
    tls = TLSFiles(certs.server_cert, certs.server_key, certs.ca, client_ca=certs.ca)
    with _Member("mtls", api=api, tls=tls, **variant_server_options(variant)) as server:
        _wait_healthy(server, _client_context(certs))
        yield server


@pytest.fixture(scope="module")
def tls_server(certs: CertFiles, variant: str, api: str) -> Iterator[EtcdServer]:
    """https, server cert from our CA, no client certificate needed."""
    tls = TLSFiles(certs.server_cert, certs.server_key, certs.ca)
    with _Member("tls", api=api, tls=tls, **variant_server_options(variant)) as server:
        yield server


@pytest.fixture(scope="module")
def expired_server(certs: CertFiles, variant: str, api: str) -> Iterator[EtcdServer]:
    """https with an expired server certificate (issued by our CA).

    Client certs are required only so that EtcdServer's readiness probe is a port check
    (its /health probe would itself fail on the expired certificate).
    """
    tls = TLSFiles(certs.expired_cert, certs.expired_key, certs.ca, client_ca=certs.ca)
    with _Member("expired", api=api, tls=tls, **variant_server_options(variant)) as server:
        _wait_healthy(server, _client_context(certs, verify=False))
        yield server


def _auth_request(
    server: EtcdServer, method: str, path: str, body: Any = None, *, basic: bool = False
) -> Any:
    request = urllib.request.Request(
        f"{server.client_url}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    if basic:
        token = base64.b64encode(f"root:{ROOT_PASSWORD}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    with urllib.request.urlopen(request, timeout=5) as resp:
        data = resp.read()
    return json.loads(data) if data.strip() else None


@pytest.fixture(scope="module")
def auth_server(variant: str, api: str) -> Iterator[EtcdServer]:
    """Plain http, auth on for the variant's API: user root/rootpw, nothing anonymous.

    v2: etcd 3.5 creates the guest role (with read/write on everything) only when auth
    is enabled, so its permissions are revoked afterwards, as root. v3: there is no
    guest; a request without a token is refused.
    """
    with _Member("auth", api=api, **variant_server_options(variant)) as server:
        if api == "v3":
            v3_post(
                server.client_url, "/v3/auth/user/add", {"name": "root", "password": ROOT_PASSWORD}
            )
            v3_post(server.client_url, "/v3/auth/user/grant", {"user": "root", "role": "root"})
            v3_post(server.client_url, "/v3/auth/enable", {})
            with pytest.raises(urllib.error.HTTPError) as anonymous:
                v3_post(server.client_url, "/v3/kv/range", {"key": "Lw=="})
            assert anonymous.value.code in (400, 401), anonymous.value
            yield server
            return
        _auth_request(
            server, "PUT", "/v2/auth/users/root", {"user": "root", "password": ROOT_PASSWORD}
        )
        _auth_request(server, "PUT", "/v2/auth/enable")
        guest = _auth_request(
            server,
            "PUT",
            "/v2/auth/roles/guest",
            {"role": "guest", "revoke": {"kv": {"read": ["/*"], "write": ["/*"]}}},
            basic=True,
        )
        assert guest["permissions"]["kv"] == {"read": [], "write": []}, guest
        assert _auth_request(server, "GET", "/v2/auth/enable") == {"enabled": True}
        with pytest.raises(urllib.error.HTTPError) as anonymous:
            _auth_request(server, "GET", "/v2/keys/")
        assert anonymous.value.code == 401
        yield server


def _assert_put_get(params: RendezvousParameters, key: str, value: str) -> None:
    """A client from ``params`` writes ``value`` at ``key`` and reads it back."""
    kv = etcd_rdzv.create_client(params)
    try:
        kv.put(key, value, None)
        record, _ = kv.get(key)
        assert record is not None
        assert record.value == value
    finally:
        kv.close()


def _connect_error(
    factory: Callable[[RendezvousParameters], Any], params: RendezvousParameters
) -> tuple[str, float]:
    """Call ``factory(params)``, expect RendezvousConnectionError: (message, seconds)."""
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as info:
        factory(params)
    return str(info.value), time.monotonic() - start


# -- mutual TLS -------------------------------------------------------------------------


def test_https_with_client_certificate_connects(
    mtls_server: EtcdServer, certs: CertFiles, etcd_key_prefix: str
) -> None:
    params = mtls_server.params(
        protocol="https",
        ca_cert=certs.ca,
        ssl_cert=certs.client_cert,
        ssl_cert_key=certs.client_key,
        read_timeout=READ_TIMEOUT,
        key_prefix=etcd_key_prefix,
    )
    kv = etcd_rdzv.create_client(params)
    try:
        assert kv.endpoints == [mtls_server.client_url]
        key = f"{etcd_key_prefix}/hello"
        kv.put(key, "world", None)
        record, _ = kv.get(key)
        assert record is not None
        assert record.value == "world"
    finally:
        kv.close()


def test_https_with_client_certificate_backend_round_trip(
    mtls_server: EtcdServer, certs: CertFiles, etcd_key_prefix: str
) -> None:
    params = mtls_server.params(
        "tls-run",
        protocol="https",
        ca_cert=certs.ca,
        ssl_cert=certs.client_cert,
        ssl_cert_key=certs.client_key,
        read_timeout=READ_TIMEOUT,
        key_prefix=etcd_key_prefix,
    )
    backend, store = etcd_rdzv.create_backend(params)
    assert backend.get_state() is None
    result = backend.set_state(b"state-1")
    assert result is not None
    state, token, has_set = result
    assert (state, has_set) == (b"state-1", True)
    assert backend.get_state() == (b"state-1", token)

    store.set("key", b"value")
    assert store.get("key") == b"value"


def test_https_without_client_certificate_is_refused(
    mtls_server: EtcdServer, certs: CertFiles
) -> None:
    params = mtls_server.params(protocol="https", ca_cert=certs.ca, read_timeout=READ_TIMEOUT)
    message, elapsed = _connect_error(etcd_rdzv.create_client, params)
    assert elapsed < MAX_ELAPSED
    assert mtls_server.client_url in message
    assert "TLS" in message
    assert "certificate" in message.lower()


# -- server verification ----------------------------------------------------------------


@pytest.mark.parametrize("server_fixture", ["tls_server", "mtls_server"])
def test_wrong_ca_fails_verification(
    server_fixture: str, certs: CertFiles, variant: str, request: pytest.FixtureRequest
) -> None:
    # `variant` is named so the test is parametrised by it: the server comes dynamically.
    server: EtcdServer = request.getfixturevalue(server_fixture)
    params = server.params(
        protocol="https",
        ca_cert=certs.wrong_ca,
        ssl_cert=certs.client_cert,
        ssl_cert_key=certs.client_key,
        read_timeout=READ_TIMEOUT,
    )
    message, elapsed = _connect_error(etcd_rdzv.create_client, params)
    assert elapsed < MAX_ELAPSED
    assert server.client_url in message
    assert "TLS" in message
    assert "certificate verify failed" in message


def test_verification_is_on_without_ca_cert(tls_server: EtcdServer, api: str) -> None:
    # No ca_cert: the system trust store is used, and it does not know our test CA.
    params = RendezvousParameters(
        "etcd-rdzv-dynamic",
        tls_server.endpoint,
        "run",
        1,
        1,
        protocol="https",
        read_timeout=READ_TIMEOUT,
        api=api,
    )
    message, elapsed = _connect_error(etcd_rdzv.create_client, params)
    assert elapsed < MAX_ELAPSED
    assert "certificate verify failed" in message


@pytest.mark.parametrize("create", [etcd_rdzv.create_client, etcd_rdzv.create_backend])
def test_expired_server_certificate_is_rejected(
    expired_server: EtcdServer, certs: CertFiles, create: Callable[..., object]
) -> None:
    params = expired_server.params(
        protocol="https",
        ca_cert=certs.ca,
        ssl_cert=certs.client_cert,
        ssl_cert_key=certs.client_key,
        read_timeout=READ_TIMEOUT,
    )
    message, elapsed = _connect_error(create, params)
    assert elapsed < MAX_ELAPSED
    assert expired_server.client_url in message
    assert "certificate verify failed" in message
    assert "certificate has expired" in message


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_tls_insecure_connects_despite_wrong_ca_and_warns(
    tls_server: EtcdServer,
    certs: CertFiles,
    etcd_key_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="etcd_rdzv")
    params = tls_server.params(
        protocol="https",
        ca_cert=certs.wrong_ca,
        tls_insecure="true",
        read_timeout=READ_TIMEOUT,
        key_prefix=etcd_key_prefix,
    )
    _assert_put_get(params, f"{etcd_key_prefix}/insecure", "ok")
    warnings = [
        r for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("etcd_rdzv")
    ]
    assert warnings, caplog.text
    assert any(
        "tls_insecure" in r.getMessage() and tls_server.client_url in r.getMessage()
        for r in warnings
    ), caplog.text


# -- username/password ------------------------------------------------------------------


def test_auth_with_right_password_connects_and_round_trips(
    auth_server: EtcdServer, etcd_key_prefix: str
) -> None:
    params = auth_server.params(
        "auth-run",
        username="root",
        password=ROOT_PASSWORD,
        read_timeout=READ_TIMEOUT,
        key_prefix=etcd_key_prefix,
    )
    _assert_put_get(params, f"{etcd_key_prefix}/authed", "yes")

    _backend, store = etcd_rdzv.create_backend(params)
    store.set("k", b"v")
    assert store.get("k") == b"v"


def test_the_password_from_a_file_or_the_environment_authenticates(
    auth_server: EtcdServer,
    etcd_key_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What keeps the password out of torch's logged rdzv_configs: password_file and
    $ETCD_RDZV_PASSWORD, on an etcd with auth enabled."""
    caplog.set_level(logging.DEBUG, logger="etcd_rdzv")
    secret = tmp_path / "etcd.pw"
    secret.write_text(ROOT_PASSWORD + "\n")
    by_file = auth_server.params(
        "pw-file", username="root", password_file=str(secret), read_timeout=READ_TIMEOUT,
        key_prefix=etcd_key_prefix,
    )  # fmt: skip
    _assert_put_get(by_file, f"{etcd_key_prefix}/by-file", "yes")
    monkeypatch.setenv("ETCD_RDZV_PASSWORD", ROOT_PASSWORD)
    by_env = auth_server.params(
        "pw-env", username="root", read_timeout=READ_TIMEOUT, key_prefix=etcd_key_prefix
    )
    _assert_put_get(by_env, f"{etcd_key_prefix}/by-env", "yes")
    _backend, store = etcd_rdzv.create_backend(by_env)
    store.set("k", b"v")
    assert store.get("k") == b"v"
    assert ROOT_PASSWORD not in caplog.text
    # a wrong password in the file is refused like a wrong option
    secret.write_text("not-the-password\n")
    message, _ = _connect_error(etcd_rdzv.create_client, by_file)
    assert "wrong username or password" in message


def test_auth_with_wrong_password_is_refused(auth_server: EtcdServer) -> None:
    params = auth_server.params(
        username="root", password="s3cret-but-wrong", read_timeout=READ_TIMEOUT
    )
    message, elapsed = _connect_error(etcd_rdzv.create_client, params)
    assert elapsed < MAX_ELAPSED
    assert auth_server.client_url in message
    assert "user 'root'" in message
    assert "refused" in message
    assert "wrong username or password" in message
    assert "s3cret-but-wrong" not in message


def test_auth_without_credentials_is_refused(auth_server: EtcdServer) -> None:
    params = auth_server.params(read_timeout=READ_TIMEOUT)
    message, elapsed = _connect_error(etcd_rdzv.create_client, params)
    assert elapsed < MAX_ELAPSED
    assert "refused" in message
    assert "anonymous" in message


def test_auth_without_credentials_is_refused_by_create_backend(
    auth_server: EtcdServer,
) -> None:
    params = auth_server.params(read_timeout=READ_TIMEOUT)
    message, _elapsed = _connect_error(etcd_rdzv.create_backend, params)
    assert "refused" in message


# -- bad files: ValueError before any network call --------------------------------------


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.mark.parametrize("factory", [etcd_rdzv.create_client, etcd_rdzv.create_backend])
@pytest.mark.parametrize("option", ["ca_cert", "ssl_cert"])
def test_missing_cert_file_is_value_error_before_network(
    option: str,
    factory: Callable[[RendezvousParameters], Any],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    def no_network(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"network call before option validation: {args!r}")

    monkeypatch.setattr(urllib3.PoolManager, "urlopen", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    missing = str(tmp_path / "nonexistent.pem") if option == "ssl_cert" else "/nonexistent"
    params = RendezvousParameters(
        "etcd-rdzv-dynamic",
        f"127.0.0.1:{_closed_port()}",
        "run",
        1,
        1,
        protocol="https",
        read_timeout=READ_TIMEOUT,
        **{option: missing},
    )
    with pytest.raises(ValueError, match=f"'{option}'") as info:
        factory(params)
    assert not isinstance(info.value, RendezvousConnectionError)
    assert missing in str(info.value)


@pytest.mark.parametrize("case", ["garbage_ca", "mismatched_key", "cert_without_key"])
def test_unloadable_tls_file_is_value_error_before_network(
    case: str, certs: CertFiles, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def no_network(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"network call before option validation: {args!r}")

    monkeypatch.setattr(urllib3.PoolManager, "urlopen", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    options = {
        "garbage_ca": {"ca_cert": str(garbage)},
        "mismatched_key": {
            "ca_cert": certs.ca,
            "ssl_cert": certs.client_cert,
            "ssl_cert_key": certs.server_key,
        },
        "cert_without_key": {"ca_cert": certs.ca, "ssl_cert": certs.client_cert},
    }[case]
    params = RendezvousParameters(
        "etcd-rdzv-dynamic",
        f"127.0.0.1:{_closed_port()}",
        "run",
        1,
        1,
        protocol="https",
        read_timeout=READ_TIMEOUT,
        **options,
    )
    with pytest.raises(ValueError, match="ca_cert" if case == "garbage_ca" else "ssl_cert"):
        etcd_rdzv.create_client(params)


def test_a_password_file_that_is_a_directory_or_unreadable_says_so(
    etcd_server_v3: EtcdServer, etcd_rdzv_cli: EtcdRdzvCli, tmp_path: Path
) -> None:
    """``etcd-rdzv`` says what is wrong with the file (not "does not exist" for all),
    naming the flag and the path; a usage error (2), before any request."""
    base = ["status", "--run-id", "pw", "--endpoint", etcd_server_v3.endpoint]
    base += ["--username", "root", "--password-file"]
    directory = tmp_path / "secrets"
    directory.mkdir()
    done = etcd_rdzv_cli.run(*base, str(directory))
    assert done.returncode == 2, done.stderr
    assert f"error: Option --password-file: {str(directory)!r} is a directory, not a file." in (
        done.stderr
    )
    assert "does not exist" not in done.stderr

    missing = tmp_path / "nope.pw"
    done = etcd_rdzv_cli.run(*base, str(missing))
    assert done.returncode == 2, done.stderr
    assert f"error: Option --password-file: file {str(missing)!r} does not exist." in done.stderr

    unreadable = tmp_path / "job1.pw"
    unreadable.write_text("pw\n")
    unreadable.chmod(0)
    argv = [*EtcdRdzvCli.ARGV, *base, str(unreadable)]
    if os.geteuid() == 0:  # root reads any file, unless without the capabilities for it
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            skip_or_fail("setpriv (util-linux) runs the command as root that cannot read all")
        argv = [str(setpriv), "--bounding-set", "-dac_override,-dac_read_search", *argv]
    done = subprocess.run(
        argv, env=cli_env(), capture_output=True, text=True, timeout=60,
        stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert (
        f"error: Option --password-file: file {str(unreadable)!r} is not readable by this "
        "process (Permission denied)."
    ) in done.stderr, done.stderr


def _as_root_v3(server: EtcdServer, path: str, body: dict[str, Any]) -> None:
    """A v3 request with root's token (auth is on)."""
    token = v3_post(
        server.client_url, "/v3/auth/authenticate", {"name": "root", "password": ROOT_PASSWORD}
    )["token"]
    request = urllib.request.Request(
        f"{server.client_url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": token},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=5) as resp:
        resp.read()


@pytest.fixture(scope="module")
def job_user(auth_server: EtcdServer, api: str) -> str:
    """A user ``job1`` (password ``job1pw``) whose role may read and write the keys
    under ``/etcd_rdzv/job1/`` only, as the operator guide sets one up."""
    if api == "v2":
        _auth_request(
            auth_server, "PUT", "/v2/auth/roles/job1",
            {"role": "job1", "permissions": {"kv": {
                "read": ["/etcd_rdzv/job1", "/etcd_rdzv/job1/*"],
                "write": ["/etcd_rdzv/job1", "/etcd_rdzv/job1/*"],
            }}}, basic=True,
        )  # fmt: skip
        _auth_request(
            auth_server, "PUT", "/v2/auth/users/job1",
            {"user": "job1", "password": "job1pw", "roles": ["job1"]}, basic=True,
        )  # fmt: skip
        return "job1"
    b64 = base64.b64encode
    _as_root_v3(auth_server, "/v3/auth/role/add", {"name": "job1"})
    perm = {
        "key": b64(b"/etcd_rdzv/job1/").decode(),
        "range_end": b64(b"/etcd_rdzv/job10").decode(),
        "permType": "READWRITE",
    }
    _as_root_v3(auth_server, "/v3/auth/role/grant", {"name": "job1", "perm": perm})
    _as_root_v3(auth_server, "/v3/auth/user/add", {"name": "job1", "password": "job1pw"})
    _as_root_v3(auth_server, "/v3/auth/user/grant", {"user": "job1", "role": "job1"})
    return "job1"


def test_a_missing_key_prefix_under_auth_says_no_permission_not_wrong_password(
    auth_server: EtcdServer, job_user: str, api: str, etcd_rdzv_cli: EtcdRdzvCli
) -> None:
    """``etcd-rdzv`` with the job's user but the default key prefix: on v3, whose
    token says the password was right, the error names the missing permission and
    'key_prefix' (v2 answers a wrong password and a missing permission alike)."""
    where = ["--endpoint", auth_server.endpoint, "--api", api, "--username", job_user]
    env = {"ETCD_RDZV_PASSWORD": "job1pw"}
    done = etcd_rdzv_cli.run("status", "--run-id", "r", *where, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    if api == "v2":
        assert "wrong username or password, or no permission on that key" in done.stderr
        return
    assert (
        f"etcd at {auth_server.client_url} refused probe read of '/etcd_rdzv' for user "
        "'job1': its password is right, but the user has no permission on the keys under "
        "/etcd_rdzv/ (etcdserver: permission denied). Set 'key_prefix' (--key-prefix) to "
        "the prefix its role may read and write"
    ) in done.stderr, done.stderr
    assert "wrong username or password" not in done.stderr, done.stderr
    # A wrong password is still called one; the right prefix works.
    wrong = etcd_rdzv_cli.run("status", "--run-id", "r", *where, env={"ETCD_RDZV_PASSWORD": "x"})
    assert "for user 'job1': wrong username or password (" in wrong.stderr, wrong.stderr
    right = etcd_rdzv_cli.run(
        "status", "--run-id", "r", *where, "--key-prefix", "/etcd_rdzv/job1", env=env
    )
    # Past the probe with the right prefix: the run 'r' does not exist (exit 3).
    assert right.returncode == 3, right.stderr
    assert "run 'r' does not exist" in right.stderr, right.stderr
