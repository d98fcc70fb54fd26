"""The key-value primitives the rest of etcd_rdzv needs, one implementation per etcd API.

Modules above this package (backend, store, handler) talk to :class:`KV` only, so an
implementation for another API slots in beside :mod:`._v2` without touching them.
"""

from ._base import KV, Event, Landed, Record, WatchCompacted, Watcher

__all__ = ["KV", "Event", "Landed", "Record", "WatchCompacted", "Watcher"]
