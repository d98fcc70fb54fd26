"""The leases of one v3 client: how a TTL becomes a lease.

* A write with ``ttl=T`` attaches the key to this client's *clean-up* lease of TTL
  ``T`` (one per distinct ``T``, granted on first use), which the write first keeps
  alive when its last grant or keep-alive is older than ``T/10``. Those leases are
  never revoked: they hold state other nodes still use, and expire ``T`` after this
  client stops writing.
* A liveness key (``put_owned``, ``claim``) gets an *owned* lease of its own, so it
  expires ``T`` after its own last refresh, like a v2 key TTL (a lease shared by all
  of them would keep a key the handler dropped alive for as long as the node lives),
  or the lease of the owned key it is claimed beside. Closing the client revokes the
  owned leases, so liveness keys vanish at once on shutdown.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ...errors import RendezvousConnectionError
from .._failover import hold
from ._wire import GatewayKV, LeaseGone

__all__ = ["Leases"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class _Lease:
    """A lease this client granted. ``renewed``: monotonic time its last grant or
    keep-alive was sent (so it lives at least ``ttl`` seconds from then)."""

    id: int
    ttl: int
    renewed: float


class Leases:
    """The clean-up and owned leases of the client ``kv``. Thread-safe.

    The lock is held over the keep-alive or grant of a clean-up lease (so that
    threads writing with one TTL share one lease); inside a bounded scope a thread
    waits for it only until the scope's deadline.
    """

    def __init__(self, kv: GatewayKV) -> None:
        self._kv = kv
        # ttl -> this client's clean-up lease of that TTL.
        self._cleanup: dict[int, _Lease] = {}
        # key -> the lease of each liveness key this client owns (one lease per key).
        self._owned: dict[str, int] = {}
        # A lease granted ahead of the owned key it is for (see prepare).
        self._spare: _Lease | None = None
        self._lock = threading.Lock()

    def _locked(self, what: str, key: str) -> contextlib.AbstractContextManager[None]:
        return hold(self._lock, lambda: self._kv._deadline_passed(what, key))

    # -- requests ---------------------------------------------------------------------

    def _grant(self, ttl: int) -> int:
        # A grant whose answer was lost leaves a lease nobody uses; it expires after
        # ttl, so sending the grant again is harmless.
        data = self._kv._request("lease grant", f"ttl={ttl}", "/v3/lease/grant", {"TTL": str(ttl)})
        lease = int(data.get("ID") or 0)
        if not lease:
            raise RendezvousConnectionError(f"etcd granted no lease for TTL {ttl}: {data}")
        log.debug("granted lease %x (TTL %s s)", lease, data.get("TTL"))
        return lease

    def keepalive(self, lease: int) -> int:
        """Keep ``lease`` alive once; its TTL now, 0 if it is gone. A clean-up lease
        counts as renewed from when the request was sent."""
        sent = time.monotonic()
        data = self._kv._request(
            "lease keep-alive", f"lease {lease:x}", "/v3/lease/keepalive", {"ID": str(lease)}
        )
        ttl = int(data.get("TTL") or 0)
        if ttl > 0:
            for held in list(self._cleanup.values()):
                if held.id == lease:
                    held.renewed = sent
        return ttl

    def _cleanup_lease(self, ttl: int) -> int:
        """This client's clean-up lease for ``ttl``, kept alive if its last renewal
        is older than ``ttl / 10``, granted if there is none (or it is gone)."""
        with self._locked("lease grant", f"ttl={ttl}"):
            lease = self._cleanup.get(ttl)
            stale = lease is not None and time.monotonic() - lease.renewed > ttl / 10
            if lease is not None and stale and self.keepalive(lease.id) <= 0:
                log.info("lease %x (TTL %d s) expired; granting a new one", lease.id, ttl)
                lease = None
            if lease is None:
                sent = time.monotonic()
                lease = _Lease(self._grant(ttl), ttl, sent)
                self._cleanup[ttl] = lease
            return lease.id

    def prepare(self, ttl: int) -> None:
        """Grant the lease of the next owned key of TTL ``ttl`` now, so that its write
        is the only request then. Unused, it expires by itself after ``ttl``."""
        sent = time.monotonic()
        lease = _Lease(self._grant(ttl), ttl, sent)
        with self._locked("lease grant", f"ttl={ttl}"):
            self._spare = lease

    def _take_spare(self, ttl: int) -> _Lease | None:
        """The prepared lease for ``ttl`` if it still has at least half its TTL left;
        it is handed out once (or given back, unused: :meth:`_give_back`)."""
        with self._locked("lease grant", f"ttl={ttl}"):
            spare, self._spare = self._spare, None
        if spare is None or spare.ttl != ttl or time.monotonic() - spare.renewed > ttl / 2:
            return None
        return spare

    def _give_back(self, spare: _Lease) -> None:
        """A prepared lease that a refused write did not use: the next owned key may."""
        with self._locked("lease grant", f"lease {spare.id:x}"):
            if self._spare is None:
                self._spare = spare

    def _drop(self, lease_id: int) -> None:
        with self._locked("lease grant", f"lease {lease_id:x}"):
            for ttl, lease in list(self._cleanup.items()):
                if lease.id == lease_id:
                    del self._cleanup[ttl]

    # -- writes on leases -------------------------------------------------------------

    def leased(
        self,
        ttl: int | None,
        owned: bool,
        send: Callable[[int], T],
        key: str = "",
        beside: str | None = None,
    ) -> T:
        """``send(lease id)`` (0: no lease); once more with a new lease if etcd says
        the lease is gone (it expired while this client was idle or paused).

        An owned key (``owned``: ``key``) gets a lease of its own, granted for this
        write, or the lease of the owned key ``beside``, when the caller drops the
        two together. Other keys go on the clean-up lease of ``ttl``.
        """
        if not ttl:
            return send(0)
        if owned:
            with self._locked("write", key):
                previous = self._owned.get(key)
                shared = self._owned.get(beside) if beside else None
            for _ in range(2):
                spare = None if shared else self._take_spare(ttl)
                lease = shared or (spare.id if spare is not None else self._grant(ttl))
                shared = None
                self.own(key, lease)
                try:
                    result = send(lease)
                except LeaseGone:  # just granted: a cluster that lost it; once more
                    log.info("lease %x is gone; writing again with a new one", lease)
                    continue
                if result is None:  # a refused write: the key is not on this lease
                    self.own(key, previous)
                    if spare is not None:
                        self._give_back(spare)
                return result
            raise RendezvousConnectionError(f"etcd dropped every lease granted for {key!r}")
        lease = self._cleanup_lease(ttl)
        try:
            return send(lease)
        except LeaseGone:
            log.info("lease %x is gone; writing again with a new one", lease)
            self._drop(lease)
            return send(self._cleanup_lease(ttl))

    def own(self, key: str, lease: int | None) -> None:
        """Record ``lease`` as the owned lease of ``key`` (None: it has none now). A
        lease replaced here holds no key any more and simply expires."""
        with self._locked("write", key):
            if lease is None:
                self._owned.pop(key, None)
            else:
                self._owned[key] = lease

    def revoke_owned(self, deadline: float) -> None:
        """Revoke every owned lease (their keys vanish now) by ``deadline``, and
        forget the clean-up leases, which are left to expire: they hold state other
        nodes still use. A lease that cannot be revoked is logged: it expires."""
        try:
            with self._locked("lease revoke", "the owned leases"):
                owned = sorted(set(self._owned.values()))
                self._owned.clear()
                self._cleanup.clear()
                self._spare = None  # holds no key: it expires
        except RendezvousConnectionError as exc:  # a bounded scope ended first
            log.warning("could not revoke the owned leases (they expire by themselves): %s", exc)
            return
        for lease_id in owned:
            try:
                self._kv._request(
                    "lease revoke",
                    f"lease {lease_id:x}",
                    "/v3/lease/revoke",
                    {"ID": str(lease_id)},
                    deadline=deadline,
                )
            except LeaseGone:
                pass
            except RendezvousConnectionError as exc:
                log.warning("could not revoke lease %x (it expires by itself): %s", lease_id, exc)
