"""The key-value primitives the rest of etcd_rdzv needs, one implementation per etcd API.

Modules above this package (backend, store, handler) talk to :class:`KV` only, so an
implementation for another API slots in beside :mod:`.v2` and :mod:`.v3` without
touching them. :mod:`._failover` holds what both implementations share: endpoint
rotation, back-off, lost-answer read-back and the :meth:`KV.bounded` time bound.
"""

from ._base import KV, Event, Landed, Record, WatchCompacted, Watcher
from ._lease import Lease
from ._txn import (
    Compare,
    Condition,
    Delete,
    DeletePrefix,
    Get,
    Op,
    Present,
    Put,
    Quiet,
    Revision,
    TxnResult,
)

__all__ = [
    "KV",
    "Compare",
    "Condition",
    "Delete",
    "DeletePrefix",
    "Event",
    "Get",
    "Landed",
    "Lease",
    "Op",
    "Present",
    "Put",
    "Quiet",
    "Record",
    "Revision",
    "TxnResult",
    "WatchCompacted",
    "Watcher",
]
