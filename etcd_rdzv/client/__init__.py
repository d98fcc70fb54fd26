"""The client: building one from configuration, its first requests, and what a failed
connect means.

* :mod:`.connect`: ``create_client``, ``connect`` (build, probe, diagnose on failure),
  ``connect_handler``, ``build_kv``, ``other_keyspace_keys``;
* :mod:`._build`: building without I/O (the TLS context, the one transport, the KV);
* :mod:`._probe`: the first requests (the probe read, the one-API check, ``RunChecks``);
* :mod:`._diagnose`: hints after a failed connect.

The only part that chooses a KV implementation; it imports :mod:`etcd_rdzv._kv` and
:mod:`etcd_rdzv.config`, and is imported by the factories, the handler's build and
the CLI.
"""

from ._connect import (
    OtherKeys,
    build_kv,
    connect,
    connect_handler,
    create_client,
    other_keyspace_keys,
    ssl_context,
)

__all__ = [
    "OtherKeys",
    "build_kv",
    "connect",
    "connect_handler",
    "create_client",
    "other_keyspace_keys",
    "ssl_context",
]
