"""A node's lease: the one lifetime that every liveness key of a node shares.

Made by :meth:`KV.grant <etcd_rdzv._kv.KV.grant>` and owned by the rendezvous
:class:`~etcd_rdzv.rendezvous.session.Session` (as etcd's ``concurrency.Session`` owns
its lease). The node writes its keys on it (:meth:`KV.put_owned`, :meth:`KV.create`
with ``lease``, a :class:`~etcd_rdzv._kv.Put` in a transaction), its heart renews it
(:meth:`KV.keep_alive`), and leaving ends it (:meth:`KV.revoke`).

* **v3**: an etcd lease. One keep-alive request renews every key on it, whatever their
  number, and a revoke deletes them all in one request. If the lease expired (the node
  was paused past its TTL), its keys are gone with it; the next write grants a new one.
* **v2**, which has no leases: the TTL each key is written with; a keep-alive renews
  the keys one by one.
"""

from __future__ import annotations

import threading
import time

__all__ = ["Lease"]


class Lease:
    """A node's lease (see the module docstring). Thread-safe.

    Attributes:
        ttl: seconds a key on it outlives the last renewal.
        id: the etcd lease id (v3; 0: none granted yet, or it expired); always 0 on v2.
        renewed: ``time.monotonic()`` when its last grant or keep-alive was sent.
    """

    def __init__(self, ttl: int, id: int = 0, renewed: float | None = None) -> None:
        self.ttl = ttl
        self.id = id
        self.renewed = time.monotonic() if renewed is None else renewed
        self._keys: dict[str, int] = {}  # key -> the lease id it was written on
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Lease(ttl={self.ttl}, id={self.id:x}, keys={len(self._keys)})"

    def wrote(self, key: str, lease_id: int) -> None:
        """``key`` was written on this lease, whose id was then ``lease_id``."""
        with self._lock:
            if not lease_id and not self._keys:
                # v2: a key's TTL starts at its write, and the lease is as old as its
                # oldest key (a keep-alive refreshes them all).
                self.renewed = time.monotonic()
            self._keys[key] = lease_id

    def forget(self, key: str) -> None:
        """``key`` is no longer on this lease (deleted, or written without it)."""
        with self._lock:
            self._keys.pop(key, None)

    def keys(self) -> dict[str, int]:
        """The keys written on it: key -> the lease id each was written on."""
        with self._lock:
            return dict(self._keys)

    def lost(self, lease_id: int) -> list[str]:
        """The lease ``lease_id`` was revoked: forget the keys that were on
        it (they are gone with it) and return them."""
        with self._lock:
            gone = [k for k, i in self._keys.items() if i == lease_id]
            for key in gone:
                del self._keys[key]
            if self.id == lease_id:
                self.id = 0
            return gone

    def expired(self, lease_id: int) -> None:
        """The lease ``lease_id`` is gone: the next write needs a new one. Its keys
        stay listed until :meth:`stale` reports them (the heart's next beat)."""
        with self._lock:
            if self.id == lease_id:
                self.id = 0

    def stale(self) -> list[str]:
        """Forget and return the keys written on an earlier lease id than the current
        one (it expired meanwhile, and they with it)."""
        with self._lock:
            gone = [k for k, i in self._keys.items() if i != self.id]
            for key in gone:
                del self._keys[key]
            return gone
