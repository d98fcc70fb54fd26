"""The abstract key-value layer: records, events and the operations every API provides."""

from __future__ import annotations

import abc
import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from ._lease import Lease
from ._records import Event, Landed, Record
from ._txn import Compare, Condition, Delete, Get, Op, Present, Put, Revision, TxnResult

__all__ = ["KV", "Event", "Landed", "Record", "WatchCompacted", "Watcher", "current_bound"]

T = TypeVar("T")

# The deadline of the innermost KV.bounded() scope. A ContextVar, so each thread has its
# own: a thread started inside a scope (a watch stream's reader) is not bound by it.
_BOUND: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "etcd_rdzv_kv_bound", default=None
)


def current_bound() -> float | None:
    """The ``time.monotonic()`` deadline that :meth:`KV.bounded` set for this thread,
    or ``None`` outside any scope."""
    return _BOUND.get()


class WatchCompacted(Exception):
    """The history a watch wanted to start from is gone; read again and watch anew.

    ``current`` is the revision etcd was at when it said so, where its answer told
    (v2: the index of its error), else ``None``.
    """

    def __init__(self, message: str, current: int | None = None) -> None:
        super().__init__(message)
        self.current = current

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.current))


class Watcher:
    """The changes to one key (or under a prefix) after a read, batch by batch.

    Made by :meth:`KV.watcher`. :meth:`reread` reads the state (a get or a listing
    that reports its revision) and positions the watcher just after it; each
    :meth:`next` returns the following changes, so the caller's picture (the read,
    then every batch applied in order) misses nothing and sees nothing twice. Used by
    one thread at a time; :meth:`close` releases what it holds.

    This implementation sends one watch request per :meth:`next` (v2's long polls);
    the v3 one keeps a stream open.
    """

    #: Whether each :meth:`next` is a request of its own: then a caller far behind
    #: the event stream (``Event.current``) does better to :meth:`reread`.
    polls = True

    def __init__(self, kv: KV, key: str, prefix: bool) -> None:
        self._kv = kv
        self.key = key
        self.prefix = prefix
        #: The revision up to which changes were read or returned.
        self.after = 0

    def start(self) -> None:
        """Start watching now, ahead of the :meth:`reread` that positions the watcher:
        that reread then costs only its read. Here (a request per :meth:`next`) there
        is nothing to start.

        Raises:
            RendezvousConnectionError: no endpoint answered.
        """

    def reread(self, read: Callable[[], tuple[T, int]]) -> tuple[T, int]:
        """``read()`` (returns a result and the revision it was read at), then watch
        from just after it. Also the way on after :class:`WatchCompacted`."""
        result, revision = read()
        self.after = revision
        return result, revision

    def next(self, timeout: float | None) -> list[Event]:
        """The next changes, in revision order; ``[]`` when ``timeout`` passed.

        Raises:
            WatchCompacted: the history to continue from is gone: :meth:`reread`.
            RendezvousConnectionError: no endpoint answered.
        """
        events = self._kv.watch_events(self.key, self.after + 1, timeout, prefix=self.prefix)
        events = [e for e in events if e.record.revision > self.after]
        if events:
            self.after = max(e.record.revision for e in events)
        return events

    def close(self) -> None:
        """Release the watcher (nothing to release here)."""

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KV(abc.ABC):
    """The primitives of one etcd API.

    Every method takes its time from the client's ``read_timeout`` unless it has a
    ``timeout`` argument. Failures to reach etcd raise
    :class:`~etcd_rdzv.errors.RendezvousConnectionError` naming the endpoints.

    Writes that lost their response are resolved by reading back: a create or
    compare-and-set is reported as having happened only if the key now holds exactly
    the value written. Callers that need to tell their write from an identical one by
    another writer make their values unique (the store tags them with a writer id).
    """

    #: The API this implementation speaks ("v2" or "v3").
    api: str
    #: Whether :meth:`txn` is atomic (v3); else its compares are read before its
    #: writes, and a caller that must know re-reads after them.
    atomic_txn: bool = False

    @contextlib.contextmanager
    def bounded(self, deadline: float | None) -> Iterator[None]:
        """Bound every KV call this thread makes inside the ``with`` by ``deadline``.

        ``deadline`` is a ``time.monotonic()`` instant; ``None`` adds no bound. Inside
        the scope each request waits at most until the deadline (and never longer than
        it would without the scope), back-off pauses and failover stop at it, and a
        call still unfinished then raises
        :class:`~etcd_rdzv.errors.RendezvousConnectionError` saying that the deadline
        passed, with the key and the endpoints. A write cut short that way may or may
        not have been applied. A watch whose ``timeout`` ends after the deadline also
        raises then (it does not return empty early). Nested scopes keep the earlier
        deadline. The bound is per thread (a ``contextvars.ContextVar``) and holds for
        the calls of every KV client in the scope, not only this one.
        """
        outer = _BOUND.get()
        if deadline is None or (outer is not None and outer <= deadline):
            yield
            return
        token = _BOUND.set(deadline)
        try:
            yield
        finally:
            _BOUND.reset(token)

    @property
    @abc.abstractmethod
    def answer_time(self) -> float:
        """Seconds this client's answers from etcd lately took: the slowest of its
        latest few (0.0 before any came). A caller that lets other clients' writes land
        before its own (see :func:`etcd_rdzv.rendezvous.decisions.succession_delay`)
        waits in multiples of it: a loaded etcd answers everyone late."""

    @property
    @abc.abstractmethod
    def endpoints(self) -> list[str]:
        """The base URLs this client talks to, the preferred one first."""

    @abc.abstractmethod
    def get(self, key: str) -> tuple[Record | None, int]:
        """Read ``key``.

        Returns:
            The record (``None`` if absent) and the store revision the read saw; a watch
            from ``revision + 1`` misses no later change.
        """

    @abc.abstractmethod
    def list_prefix(self, prefix: str) -> tuple[list[Record], int]:
        """All keys directly under the directory ``prefix`` and the revision read at."""

    @abc.abstractmethod
    def list_tree(self, prefix: str) -> tuple[list[Record], int]:
        """Every key anywhere under ``prefix`` (recursively) and the revision read at."""

    @abc.abstractmethod
    def create(
        self,
        key: str,
        value: str,
        ttl: int | None,
        landed: Landed | None = None,
        *,
        lease: Lease | None = None,
    ) -> Record | None:
        """Create ``key`` if absent. Returns the new record, or ``None`` if it existed.

        ``landed(current)`` decides, from the key as read back, whether a write whose
        answer was lost was applied; by default, if the key holds exactly ``value``.
        Writers whose value may be replaced at once by others (counters) pass one that
        recognises their write in its successors (the store chains writer tags).
        With ``lease`` (``ttl`` is then not used) the key is a liveness key on the
        node's lease, as :meth:`put_owned` writes them.
        """

    @abc.abstractmethod
    def compare_and_set(
        self, key: str, value: str, revision: int, ttl: int | None, landed: Landed | None = None
    ) -> Record | None:
        """Write ``key`` if its revision is ``revision``; ``None`` if it was not.
        ``landed`` as for :meth:`create`."""

    @abc.abstractmethod
    def put(self, key: str, value: str, ttl: int | None) -> Record:
        """Write ``key`` unconditionally."""

    # -- the node's lease (see ._lease) ---------------------------------------------

    def grant(self, ttl: int, reuse: Lease | None = None) -> Lease:
        """A lease of TTL ``ttl`` for a node's liveness keys: ``reuse`` while it can
        carry a new key for a whole TTL (v3: renewed within ``ttl / 2``, or renewed now
        by one keep-alive), else a new one (v3: one grant request). Here (v2) a lease
        is the TTL each key carries: no request."""
        if reuse is not None and reuse.ttl == ttl:
            return reuse
        return Lease(ttl)

    def keep_alive(self, lease: Lease) -> list[str]:
        """Renew ``lease``, so every key on it lives ``lease.ttl`` seconds more; the
        keys found gone (forgotten by the lease). Here (v2) one refresh per key."""
        gone = []
        sent = time.monotonic()
        for key in list(lease.keys()):
            if not self.refresh(key, lease.ttl):
                lease.forget(key)
                gone.append(key)
        lease.renewed = max(lease.renewed, sent)
        return gone

    def revoke(self, lease: Lease, deadline: float) -> list[str]:
        """End ``lease`` now, by ``deadline``, where the API can (v3: its keys vanish
        with it); the keys that went. Here (v2) nothing: delete the keys instead."""
        del lease, deadline
        return []

    def put_owned(self, key: str, value: str, lease: Lease) -> Record:
        """Write a liveness key on the node's ``lease``: it lives while
        :meth:`keep_alive` renews the lease, and goes when it is revoked (v3)."""
        done = self.put(key, value, lease.ttl)
        lease.wrote(key, 0)
        return done

    def txn(self, compares: Sequence[Condition], ops: Sequence[Op]) -> TxnResult:
        """If every compare holds, run ``ops`` in order (at most one :class:`Put`).

        Atomic where the API allows (v3: one transaction). Here, the default for
        APIs without transactions (v2): the compares are read first, then each
        operation is one request, so another writer may come in between; a refused
        transaction wrote nothing. :class:`~._txn.Quiet` and
        :class:`~._txn.DeletePrefix` need ranges, which v2 has not.
        A resent v3 transaction whose first try landed (its answer was lost) is
        reported as succeeded: the Put's key then holds exactly its value.

        Returns:
            The :class:`TxnResult`; its ``revision`` is the last read's.

        Raises:
            ValueError: a compare or an operation this API cannot do.
        """
        revision = 0
        compared: list[Record | None] = []
        # The keys read before the first write, in one listing per directory that
        # holds two of them or more (a v2 join reads its run's markers so: one request
        # instead of one each).
        keyed: list[Compare | Present | Revision] = []
        for compare in compares:
            if not isinstance(compare, (Compare, Present, Revision)):
                raise ValueError(f"the {self.api} API has no range compare: {compare}")
            keyed.append(compare)
        early = [c.key for c in keyed]
        for op in ops:
            if not isinstance(op, Get):
                break
            early.append(op.key)
        prefetched = self._read_many(early)
        for compare in keyed:
            current, revision = prefetched.get(compare.key) or self.get(compare.key)
            compared.append(current)
            if isinstance(compare, Revision):
                held = current is not None and current.revision == compare.revision
            elif isinstance(compare, Present):
                held = current is not None
            else:
                held = (None if current is None else current.value) == compare.value
            if not held:
                return TxnResult(False, compared=tuple(compared), revision=revision)
        done: list[Record | None] = []
        deleted = 0
        wrote = False
        for op in ops:
            if isinstance(op, Get) and not wrote and op.key in prefetched:
                found, revision = prefetched[op.key]
                done.append(found)
                continue
            wrote = wrote or not isinstance(op, Get)
            if isinstance(op, Put):
                if op.lease is not None:
                    done.append(self.put_owned(op.key, op.value, op.lease))
                else:
                    done.append(self.put(op.key, op.value, op.ttl))
            elif isinstance(op, Get):
                read, revision = self.get(op.key)
                done.append(read)
            elif isinstance(op, Delete):
                deleted += self.delete(op.key)
                done.append(None)
            else:
                raise ValueError(f"the {self.api} API has no range delete: {op}")
        _forget_deleted(ops)
        return TxnResult(True, tuple(done), revision=revision, deleted=deleted)

    def _read_many(self, keys: Sequence[str]) -> dict[str, tuple[Record | None, int]]:
        """Those of ``keys`` that share a directory with another of them, read in one
        listing of it (its direct children, at one revision): key -> (record or
        ``None``, the revision read at). The rest are not read here."""
        by_dir: dict[str, set[str]] = {}
        for key in keys:
            by_dir.setdefault(key.rsplit("/", 1)[0], set()).add(key)
        out: dict[str, tuple[Record | None, int]] = {}
        for directory, mine in by_dir.items():
            if len(mine) < 2 or not directory:
                continue
            records, revision = self.list_prefix(directory)
            found = {r.key: r for r in records}
            for key in mine:
                out[key] = (found.get(key), revision)
        return out

    def get_at(self, key: str, revision: int) -> tuple[Record | None, int]:
        """``key`` as it was at ``revision``, a revision this client saw applied (an
        event's, say): any member that has applied it can answer, without the leader,
        so the read goes on through an election (v3: a serializable read at that
        revision; a member behind it, or a revision compacted away, is read again as
        :meth:`get` does). v2 reads are a member's own already: :meth:`get`.

        A key written once and never changed after that revision (a round's roster)
        reads the same either way.
        """
        return self.get(key)

    def get_latest(self, key: str) -> tuple[Record | None, int]:
        """:meth:`get`, as the cluster's leader has the key (v2: a quorum read; v3
        reads are so already)."""
        return self.get(key)

    def list_latest(self, prefix: str) -> tuple[list[Record], int]:
        """:meth:`list_prefix`, as the cluster's leader has it (see :meth:`get_latest`)."""
        return self.list_prefix(prefix)

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Delete ``key``; ``True`` if it existed."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Delete the directory ``prefix`` and everything under it (absent is fine)."""

    @abc.abstractmethod
    def refresh(self, key: str, ttl: int) -> bool:
        """Restart the TTL of ``key`` without changing it; ``False`` if it is gone."""

    @abc.abstractmethod
    def watch(
        self, key: str, from_revision: int, timeout: float | None, *, prefix: bool = False
    ) -> Event | None:
        """Wait for the first change to ``key`` (or under it, with ``prefix``) at or after
        ``from_revision``.

        Args:
            timeout: seconds to wait; ``None`` waits forever.

        Returns:
            The event, or ``None`` when ``timeout`` passed without one.

        Raises:
            WatchCompacted: the history from ``from_revision`` is gone.
        """

    def watch_events(
        self, key: str, from_revision: int, timeout: float | None, *, prefix: bool = False
    ) -> list[Event]:
        """Like :meth:`watch`, but returns every event that is already available, in
        revision order, not just the first.

        An API that delivers several events per response (v3) returns them all at once;
        the default returns the one event :meth:`watch` gives. Callers continue from the
        last event's revision + 1.

        Returns:
            The events (at least one), or an empty list when ``timeout`` passed.

        Raises:
            WatchCompacted: the history from ``from_revision`` is gone.
        """
        event = self.watch(key, from_revision, timeout, prefix=prefix)
        return [] if event is None else [event]

    def watcher(self, key: str, *, prefix: bool = False) -> Watcher:
        """A :class:`Watcher` of ``key`` (or everything under it, with ``prefix``);
        position it with :meth:`Watcher.reread` before the first :meth:`Watcher.next`."""
        return Watcher(self, key, prefix)

    def time_left(self, key: str) -> int | None:
        """Seconds until ``key`` expires by its TTL, as etcd counts them now (v3: its
        lease's time to live); ``None`` when it has no TTL or is gone. For display:
        no clock of another host is compared."""
        return None

    @abc.abstractmethod
    def probe(self, key: str) -> None:
        """Read ``key`` to check that etcd answers, serves this API and accepts our
        credentials, all within ``read_timeout`` in total."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections. The client must not be used afterwards."""


def _forget_deleted(ops: Sequence[Op]) -> None:
    """A transaction's Deletes take their keys off the lease of its Put."""
    lease = next((op.lease for op in ops if isinstance(op, Put)), None)
    if lease is not None:
        for op in ops:
            if isinstance(op, Delete):
                lease.forget(op.key)
