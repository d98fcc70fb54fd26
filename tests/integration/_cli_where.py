"""The ``etcd-rdzv`` options that point at a test's etcd."""

from __future__ import annotations

from etcd_rdzv import RendezvousParameters


def cli_where(params: RendezvousParameters) -> list[str]:
    """The options that point ``etcd-rdzv`` at the etcd, key prefix and API of
    ``params``."""
    config = params.config
    return [
        "--endpoint",
        params.endpoint,
        "--key-prefix",
        str(config["key_prefix"]),
        "--api",
        str(config["api"]),
    ]
