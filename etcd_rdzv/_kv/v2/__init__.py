"""The KV layer on etcd's v2 API, through python-etcd over this package's transport.

Modules, each importing only those above it:

* :mod:`._pool`: the part of urllib3's pool python-etcd uses, over the transport;
* :mod:`._requests`: one v2 request through python-etcd;
* :mod:`.kv`: the key operations (:class:`~.kv.V2KV`).
"""

from .kv import V2KV

__all__ = ["V2KV"]
