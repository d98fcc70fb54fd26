"""Test PKI made with the ``openssl`` CLI: a CA, server/client certs, a wrong CA, an expired cert.

Everything is EC (prime256v1) so that generation takes a fraction of a second. The
expired server certificate is issued with ``openssl ca -startdate/-enddate`` because
``openssl x509 -req -not_before/-not_after`` needs OpenSSL 3.4 or later.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CertFiles", "find_openssl", "generate"]

_CURVE = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

_CA_EXT = [
    "-addext",
    "basicConstraints=critical,CA:TRUE",
    "-addext",
    "keyUsage=critical,keyCertSign,cRLSign",
    "-addext",
    "subjectKeyIdentifier=hash",
]

_EXTENSIONS = """\
[server]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth,clientAuth
subjectAltName = IP:127.0.0.1,DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid

[client]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""

# A minimal `openssl ca` configuration: it is the one OpenSSL < 3.4 command that can
# issue a certificate with an arbitrary validity window (here: entirely in the past).
_CA_CONFIG = """\
[ca]
default_ca = expired_ca

[expired_ca]
database = {dir}/index.txt
new_certs_dir = {dir}/newcerts
serial = {dir}/serial
certificate = {ca_cert}
private_key = {ca_key}
default_md = sha256
policy = policy_any
unique_subject = no
email_in_dn = no
copy_extensions = none
x509_extensions = server

[policy_any]
commonName = supplied

{extensions}
"""


@dataclass(frozen=True)
class CertFiles:
    """Paths (as strings) of the generated PEM files."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    wrong_ca: str
    expired_cert: str
    expired_key: str


def find_openssl() -> str | None:
    """The ``openssl`` executable, or ``None``."""
    return shutil.which("openssl") or (
        "/usr/bin/openssl" if Path("/usr/bin/openssl").is_file() else None
    )


def _run(openssl: str, *args: str, cwd: Path) -> None:
    proc = subprocess.run([openssl, *args], cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"openssl {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}"
        )


def _make_ca(openssl: str, d: Path, name: str) -> tuple[Path, Path]:
    cert, key = d / f"{name}.pem", d / f"{name}-key.pem"
    _run(
        openssl,
        "req",
        "-x509",
        *_CURVE,
        "-keyout",
        str(key),
        "-out",
        str(cert),
        "-days",
        "2",
        "-subj",
        f"/CN=etcd-rdzv test {name}",
        *_CA_EXT,
        cwd=d,
    )
    return cert, key


def _make_csr(openssl: str, d: Path, name: str, cn: str) -> tuple[Path, Path]:
    csr, key = d / f"{name}.csr", d / f"{name}-key.pem"
    _run(
        openssl,
        "req",
        "-new",
        *_CURVE,
        "-keyout",
        str(key),
        "-out",
        str(csr),
        "-subj",
        f"/CN={cn}",
        cwd=d,
    )
    return csr, key


def _sign(
    openssl: str, d: Path, csr: Path, ca: tuple[Path, Path], *, section: str, name: str
) -> Path:
    cert = d / f"{name}.pem"
    _run(
        openssl,
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca[0]),
        "-CAkey",
        str(ca[1]),
        "-CAcreateserial",
        "-days",
        "2",
        "-sha256",
        "-extfile",
        str(d / "ext.cnf"),
        "-extensions",
        section,
        "-out",
        str(cert),
        cwd=d,
    )
    return cert


def _sign_expired(openssl: str, d: Path, csr: Path, ca: tuple[Path, Path], name: str) -> Path:
    cadir = d / "expired-ca"
    (cadir / "newcerts").mkdir(parents=True)
    (cadir / "index.txt").write_text("")
    config = cadir / "ca.cnf"
    config.write_text(
        _CA_CONFIG.format(dir=cadir, ca_cert=ca[0], ca_key=ca[1], extensions=_EXTENSIONS)
    )
    cert = d / f"{name}.pem"
    _run(
        openssl,
        "ca",
        "-batch",
        "-notext",
        "-config",
        str(config),
        "-rand_serial",
        "-startdate",
        "20200101000000Z",
        "-enddate",
        "20200102000000Z",
        "-extensions",
        "server",
        "-in",
        str(csr),
        "-out",
        str(cert),
        cwd=d,
    )
    return cert


def generate(directory: Path, openssl: str | None = None) -> CertFiles:
    """Write a CA, a server cert (127.0.0.1, localhost), a client cert, a second
    unrelated CA and an expired server cert (good CA) into ``directory``.

    Raises:
        RuntimeError: an openssl command failed (its output is in the message).
    """
    openssl = openssl or find_openssl()
    if openssl is None:
        raise RuntimeError("No openssl executable found.")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "ext.cnf").write_text(_EXTENSIONS)

    ca = _make_ca(openssl, d, "ca")
    wrong_ca, _ = _make_ca(openssl, d, "wrong-ca")

    csr, server_key = _make_csr(openssl, d, "server", "localhost")
    server_cert = _sign(openssl, d, csr, ca, section="server", name="server")

    csr, client_key = _make_csr(openssl, d, "client", "etcd-rdzv-client")
    client_cert = _sign(openssl, d, csr, ca, section="client", name="client")

    csr, expired_key = _make_csr(openssl, d, "expired", "localhost")
    expired_cert = _sign_expired(openssl, d, csr, ca, "expired")

    return CertFiles(
        ca=str(ca[0]),
        server_cert=str(server_cert),
        server_key=str(server_key),
        client_cert=str(client_cert),
        client_key=str(client_key),
        wrong_ca=str(wrong_ca),
        expired_cert=str(expired_cert),
        expired_key=str(expired_key),
    )
