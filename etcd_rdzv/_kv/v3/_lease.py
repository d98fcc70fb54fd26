"""The leases of one v3 client: how a TTL becomes a lease.

* A write with ``ttl=T`` attaches the key to this client's *clean-up* lease of TTL
  ``T`` (one per distinct ``T``, granted on first use), which the write first keeps
  alive when its last grant or keep-alive is older than ``T/10``. Those leases are
  never revoked: they hold state other nodes still use, and expire ``T`` after this
  client stops writing.
* A node's liveness keys go on its *node lease* (:class:`~etcd_rdzv._kv.Lease`, owned
  by its session): one keep-alive renews them all, a revoke deletes them all. Closing
  the client revokes the node leases it granted that are still in use, so liveness
  keys vanish at once on shutdown.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ...errors import RendezvousConnectionError
from .._failover import hold
from .._lease import Lease
from ._keepalive_stream import KeepAliveStream
from ._wire import EtcdError, GatewayKV, LeaseGone

__all__ = ["Leases"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def _new_lease_id() -> int:
    """A random positive 63-bit lease id (etcd's own ids are positive too)."""
    return secrets.randbits(63) or 1


@dataclass
class _Lease:
    """A lease this client granted. ``renewed``: monotonic time its last grant or
    keep-alive was sent (so it lives at least ``ttl`` seconds from then)."""

    id: int
    ttl: int
    renewed: float


class Leases:
    """The clean-up leases and the node leases of the client ``kv``. Thread-safe.

    The lock is held over the keep-alive or grant of a clean-up lease (so that
    threads writing with one TTL share one lease); inside a bounded scope a thread
    waits for it only until the scope's deadline.
    """

    def __init__(self, kv: GatewayKV) -> None:
        self._kv = kv
        # ttl -> this client's clean-up lease of that TTL.
        self._cleanup: dict[int, _Lease] = {}
        # The node leases this client granted, while their owner holds them.
        self._nodes: weakref.WeakSet[Lease] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._stream = KeepAliveStream(kv)

    def _locked(self, what: str, key: str) -> contextlib.AbstractContextManager[None]:
        return hold(self._lock, lambda: self._kv._deadline_passed(what, key))

    # -- requests ---------------------------------------------------------------------

    def _grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; its id.

        The id is chosen here, not by etcd, so that a grant sent again cannot make a
        second lease: one whose answer was lost, or that etcd's own request timeout
        ended while its proposal waited in raft (and may still be applied), finds the
        lease its first send made ("lease already exists"). A lease made twice is one
        that nobody renews, and whose expiry etcd pays for with a revoke through raft:
        under load, thousands at once (measured: 0.5 grants sent again per node at
        4,096 nodes, each of which could leave such a lease).
        """
        for _ in range(2):
            lease = _new_lease_id()
            if self._grant_as(ttl, lease):
                log.debug("granted lease %x (TTL %s s)", lease, ttl)
                return lease
            log.info("lease id %x is taken in etcd; granting another", lease)
        raise RendezvousConnectionError(f"etcd refused two new lease ids for TTL {ttl} as taken")

    def _grant_as(self, ttl: int, lease: int) -> bool:
        """Grant the lease ``lease`` of ``ttl`` seconds (see :meth:`_grant`); whether
        it is ours (``False``: the id was taken before this grant)."""
        body = {"TTL": str(ttl), "ID": str(lease)}
        sends = 0

        def fn(index: int, timeout: float) -> bool:
            nonlocal sends
            sends += 1
            if sends > 1 and self._exists(index, lease, timeout):
                return True  # made by an earlier send: no second proposal
            try:
                data = self._kv._post(index, "/v3/lease/grant", body, timeout)
            except EtcdError as exc:
                if exc.lease_exists:  # made by an earlier send of this grant, or taken
                    return sends > 1
                raise
            if int(data.get("ID") or 0) != lease:
                raise RendezvousConnectionError(
                    f"etcd granted lease {data.get('ID')!r} for TTL {ttl}, not the id "
                    f"{lease} asked for: {data}"
                )
            return True

        return self._kv._call("lease grant", f"ttl={ttl}", fn, idempotent=True)

    def _exists(self, index: int, lease: int, timeout: float) -> bool:
        """Whether etcd holds the lease ``lease`` (asked of endpoint ``index``).

        A grant sent again after its answer was lost (or etcd's own request timeout,
        or an election that stalled it) asks this first: a grant is a raft proposal,
        refused or not, while this is a read of the leader's lease table. (At 4,096
        nodes the grants per node varied from 1.06 to 2.61 between runs of one code;
        a copy that logged each grant found the extra ones were build leases that ran
        out before their first join, and no grant sent again in its run.)"""
        data = self._kv._post(index, "/v3/lease/timetolive", {"ID": str(lease)}, timeout)
        return int(data.get("TTL") or 0) > 0  # -1: none; etcd 3.7 leaves a zero out

    def keepalive(self, lease: int) -> int:
        """Keep ``lease`` alive once: over the client's keep-alive stream (see
        :mod:`._keepalive_stream`), or through the gateway where the endpoint has no
        stream. Its TTL now, 0 if it is gone. A clean-up lease counts as renewed from
        when the request was sent."""
        sent = time.monotonic()

        def fn(index: int, timeout: float) -> int:
            ttl = self._stream.renew(lease, index, timeout)
            if ttl is None:
                body = {"ID": str(lease)}
                data = self._kv._post(index, "/v3/lease/keepalive", body, timeout)
                ttl = int(data.get("TTL") or 0)
            return ttl

        ttl = self._kv._call("lease keep-alive", f"lease {lease:x}", fn, idempotent=True)
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

    def _drop(self, lease_id: int) -> None:
        with self._locked("lease grant", f"lease {lease_id:x}"):
            for ttl, lease in list(self._cleanup.items()):
                if lease.id == lease_id:
                    del self._cleanup[ttl]

    # -- the node's lease --------------------------------------------------------------

    def grant(self, ttl: int, reuse: Lease | None) -> Lease:
        """``reuse`` if it can carry a new key for a whole TTL (renewed within
        ``ttl / 2``, or renewed now), else a new lease (see :meth:`KV.grant`)."""
        if reuse is not None and reuse.ttl == ttl:
            lease_id = reuse.id
            if lease_id and time.monotonic() - reuse.renewed <= ttl / 2:
                return reuse
            if lease_id:
                sent = time.monotonic()
                if self.keepalive(lease_id) > 0:
                    reuse.renewed = max(reuse.renewed, sent)
                    return reuse
                reuse.expired(lease_id)  # its keys: reported by the heart's next beat
            self._new_id(reuse)
            return reuse
        sent = time.monotonic()
        lease = Lease(ttl, self._grant(ttl), sent)
        self._nodes.add(lease)
        return lease

    def _new_id(self, lease: Lease) -> int:
        sent = time.monotonic()
        lease.id, lease.renewed = self._grant(lease.ttl), sent
        self._nodes.add(lease)
        return lease.id

    def keep_alive(self, lease: Lease) -> list[str]:
        """Renew ``lease``: one keep-alive for every key on it. The keys found gone:
        all of them if the lease expired, else those written on an earlier lease."""
        lease_id = lease.id
        if lease_id:
            sent = time.monotonic()
            if self.keepalive(lease_id) > 0:
                lease.renewed = max(lease.renewed, sent)
            else:
                log.warning("lease %x expired: its keys are gone", lease_id)
                lease.expired(lease_id)
        return lease.stale()

    def on_lease(self, lease: Lease, send: Callable[[int], T], key: str) -> T:
        """``send(lease id)`` of a write of ``key`` on the node ``lease`` (granted now
        if it has no id); once more on a new lease if etcd says it is gone (it
        expired while this node was paused). A write that ``send`` reports refused
        (``None``) puts no key on the lease."""
        for _ in range(2):
            lease_id = lease.id or self._new_id(lease)
            try:
                result = send(lease_id)
            except LeaseGone:
                log.info("lease %x is gone; writing %s again with a new one", lease_id, key)
                lease.expired(lease_id)
                continue
            if result is not None:
                lease.wrote(key, lease_id)
            return result
        raise RendezvousConnectionError(f"etcd dropped every lease granted for {key!r}")

    def revoke(self, lease: Lease, deadline: float) -> list[str]:
        """Revoke ``lease`` by ``deadline``: the keys that went with it. A lease that
        cannot be revoked is logged: it expires by itself."""
        lease_id = lease.id
        self._nodes.discard(lease)
        if not lease_id:
            return []
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
            return []
        return lease.lost(lease_id)

    def close(self) -> None:
        """Close the keep-alive stream (after :meth:`revoke_all`)."""
        self._stream.close()

    def revoke_all(self, deadline: float) -> None:
        """Revoke the node leases still in use (their keys vanish now), and forget the
        clean-up leases, which are left to expire: they hold state other nodes use."""
        with (
            contextlib.suppress(RendezvousConnectionError),  # a bounded scope ended
            self._locked("lease revoke", "the node leases"),
        ):
            self._cleanup.clear()
        for lease in list(self._nodes):
            self.revoke(lease, deadline)

    # -- writes on clean-up leases ------------------------------------------------------

    def leased(self, ttl: int | None, send: Callable[[int], T]) -> T:
        """``send(lease id)`` on the clean-up lease of ``ttl`` (0: no lease); once
        more with a new lease if etcd says the lease is gone (it expired while this
        client was idle or paused)."""
        if not ttl:
            return send(0)
        lease = self._cleanup_lease(ttl)
        try:
            return send(lease)
        except LeaseGone:
            log.info("lease %x is gone; writing again with a new one", lease)
            self._drop(lease)
            return send(self._cleanup_lease(ttl))
