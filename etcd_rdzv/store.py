"""``EtcdStore``: the ``torch.distributed.Store`` surface over etcd.

Keys live under one directory per run (``<key_prefix>/<run>/store/``), so runs never
see each other's keys. Every key carries a TTL (default 2 h, ``store_ttl``) that each
write to it restarts, so the keys of a dead run disappear by themselves;
:meth:`EtcdStore.clear` deletes them at once. ``store_ttl=0`` keeps keys until
``clear()``.

Blocking calls (``get``, ``wait``, ``multi_get``) wait on etcd watches, never on
sleep-polling. Read-modify-write calls (``add``, ``append``, ``compare_set``) are
compare-and-set loops on the key's revision. Each value written is tagged with a
writer id and sequence number, and a read-modify-write value also carries the tags of
the writes before it, so a write whose response was lost (a member died mid-request)
is resolved by reading the key back, even if others have written over it since: it
is never applied twice (``add`` totals stay exact).

Without torch this is a plain Python class. With torch installed,
:func:`etcd_rdzv.create_backend` returns :class:`etcd_rdzv.torch.TorchEtcdStore`, the
same class that is also a real ``torch.distributed.Store``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

from ._kv import KV, Landed, Record, WatchCompacted
from ._store_codec import Codec, seconds, to_bytes
from .config.params import DEFAULT_STORE_TTL
from .errors import RendezvousConnectionError, StoreQueueEmptyError, StoreTimeoutError

__all__ = ["DEFAULT_STORE_TIMEOUT", "DEFAULT_STORE_TTL", "EtcdStore"]

log = logging.getLogger(__name__)

DEFAULT_STORE_TIMEOUT = timedelta(seconds=300)  # as c10d's stores
_LATE = 1.0  # seconds a request may run past a blocking call's timeout (a read at 0 s)


class EtcdStore:
    """A key-value store shared by the members of one run.

    Args:
        client: the KV client from :func:`etcd_rdzv.create_client`.
        prefix: the etcd directory of this store (one per run).
        timeout: default timeout of blocking calls (default 300 s); ``None`` waits
            forever, ``0`` does not wait.
        ttl: seconds a key lives after its last write (default 7200); ``0`` disables.

    Raises:
        ValueError: a bad prefix, timeout or ttl. No network I/O happens.
    """

    def __init__(
        self,
        client: KV,
        prefix: str,
        timeout: timedelta | float | None = DEFAULT_STORE_TIMEOUT,
        ttl: int = DEFAULT_STORE_TTL,
    ) -> None:
        super().__init__()  # torch's Store is a pybind class that must be initialised
        if not isinstance(prefix, str) or not prefix.startswith("/"):
            raise ValueError(f"The store prefix must be an absolute etcd path, got {prefix!r}.")
        if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 0:
            raise ValueError(f"Option 'store_ttl' must be a non-negative integer, got {ttl!r}.")
        self._kv = client
        self._prefix = prefix.rstrip("/")
        self._ttl: int | None = ttl or None
        self._timeout_s = seconds(timeout, "The store timeout")
        self._codec = Codec(self._prefix)

    # -- configuration ----------------------------------------------------------------

    @property
    def prefix(self) -> str:
        """The etcd directory holding this store's keys."""
        return self._prefix

    @property
    def timeout(self) -> timedelta:
        """The default timeout of blocking calls (``timedelta.max`` for no limit)."""
        if self._timeout_s is None:
            return timedelta.max
        return timedelta(seconds=self._timeout_s)

    def set_timeout(self, timeout: timedelta | float | None) -> None:
        """Set the default timeout of blocking calls (``None``: forever, ``0``: no wait)."""
        self._timeout_s = seconds(timeout, "The store timeout")

    # -- encoding ---------------------------------------------------------------------

    def _path(self, key: Any) -> str:
        return self._codec.path(key)

    @contextlib.contextmanager
    def _writing(self, key: Any, size: int) -> Iterator[None]:
        """Names the key and the size when the KV layer refuses a write as too large
        (it raises ValueError for that)."""
        try:
            yield
        except ValueError as exc:
            raise ValueError(
                f"Store value of {size} bytes for key {key!r} under {self._prefix!r} is too "
                f"large for etcd; nothing was written: {exc}"
            ) from exc

    def _deadline(self, timeout: timedelta | float | None, use_default: bool) -> float | None:
        wait = self._timeout_s if use_default else seconds(timeout, "timeout")
        return None if wait is None else time.monotonic() + wait

    def _await(self, path: str, deadline: float | None) -> Record | None:
        """The record at ``path`` once it exists, or ``None`` after ``deadline``."""
        while True:
            record, revision = self._kv.get(path)
            if record is not None:
                return record
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            try:
                event = self._kv.watch(path, revision + 1, remaining)
            except WatchCompacted:
                continue
            if event is not None and event.kind == "put":
                return event.record

    def _present(self, key: Any) -> tuple[Record | None, int]:
        """``key``'s record, else the oldest item of the queue ``key`` (a queue is
        set while it holds items, as on torch's stores), else ``None``; and the
        revision of the key's read (the earlier of the two)."""
        record, revision = self._kv.get(self._path(key))
        if record is None:
            items, _ = self._items(key)
            record = items[0] if items else None
        return record, revision

    def _await_present(self, key: Any, deadline: float | None) -> Record | None:
        """What :meth:`_present` finds once it finds something, or ``None`` after
        ``deadline``. One watch of the store's directory serves both the key and its
        queue (they share no narrower directory); other keys' changes are skipped."""
        path, queue = self._path(key), self._codec.queue(key) + "/"
        while True:
            record, revision = self._present(key)
            if record is not None:
                return record
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                try:
                    events = self._kv.watch_events(
                        self._prefix, revision + 1, remaining, prefix=True
                    )
                except WatchCompacted:
                    break
                if not events:
                    return None
                if any(e.record.key == path or e.record.key.startswith(queue) for e in events):
                    break  # read both again
                revision = max(revision, *(e.record.revision for e in events))

    def _await_all(
        self,
        keys: Sequence[Any],
        timeout: timedelta | float | None,
        use_default: bool,
        *,
        queues: bool = False,
    ) -> list[Record]:
        deadline = self._deadline(timeout, use_default)
        records: list[Record] = []
        for key in keys:
            try:
                # The timeout bounds the whole call, whatever etcd does: no request
                # may outlive it (a frozen etcd would otherwise hold it read_timeout).
                with self._kv.bounded(None if deadline is None else deadline + _LATE):
                    if queues:
                        record = self._await_present(key, deadline)
                    else:
                        record = self._await(self._path(key), deadline)
            except RendezvousConnectionError:
                if deadline is None or time.monotonic() < deadline:
                    raise
                record = None
            if record is None:
                missing = self._missing(keys[len(records) :])
                waited = self.timeout if use_default else timeout
                # "timeout" in the message, as every torch store says it.
                raise StoreTimeoutError(
                    f"Wait timeout after {waited} waiting for store keys {missing!r} under "
                    f"{self._prefix!r}."
                )
            records.append(record)
        return records

    def _missing(self, keys: Sequence[Any]) -> list[Any]:
        """Which of ``keys`` are absent, as far as a short look can tell (all of them
        when etcd does not answer in time: the caller's timeout has passed already)."""
        try:
            with self._kv.bounded(time.monotonic() + 1.0):
                return [k for k in keys if self._kv.get(self._path(k))[0] is None]
        except RendezvousConnectionError:
            return list(keys)

    def _backoff(self, attempt: int) -> None:
        # Contention on one key: a short, growing, jittered pause so writers spread out.
        if attempt > 1:
            time.sleep(min(0.001 * (2 ** min(attempt, 8)), 0.2) * random.random())

    # -- the Store API ----------------------------------------------------------------

    def set(self, key: str | bytes, value: str | bytes) -> None:
        """Write ``value`` under ``key``.

        Raises:
            ValueError: etcd refused the value as too large.
        """
        data = to_bytes(value, "values")
        path = self._path(key)
        with self._writing(key, len(data)):
            self._kv.put(path, self._codec.encode(data), self._ttl)

    def get(self, key: str | bytes) -> bytes:
        """The value of ``key``, waiting up to :attr:`timeout` for it to be set.

        Raises:
            StoreTimeoutError: the key did not appear in time.
        """
        return self._codec.decode(self._await_all([key], None, use_default=True)[0])

    def add(self, key: str | bytes, amount: int) -> int:
        """Add ``amount`` to the integer under ``key`` (absent counts as 0); the new value.

        Raises:
            ValueError: the key holds something that is not an integer.
        """
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise TypeError(f"add() needs an int amount, got {amount!r}.")
        path = self._path(key)
        # This call's earlier writes and their totals: a write that etcd applied
        # although it answered otherwise (its answer lost, a stale read-back, a proposal
        # applied after it timed out) is found by its tag in the value read next, and
        # its total returned, so the amount is never added twice.
        tried: list[tuple[Landed, int]] = []
        for attempt in itertools.count():
            self._backoff(attempt)
            record, _ = self._kv.get(path)
            for landed, earlier in tried:
                if landed(record):
                    return earlier
            if record is None:
                first = self._codec.encode(str(amount).encode())
                tried.append((self._codec.landed(first), amount))
                if self._kv.create(path, first, self._ttl, tried[-1][0]):
                    return amount
                continue
            current = self._codec.decode(record)
            try:
                total = int(current) + amount
            except ValueError:
                raise ValueError(
                    f"add(): store key {key!r} holds {current[:40]!r}, not an integer."
                ) from None
            value = self._codec.encode(str(total).encode(), record)
            tried.append((self._codec.landed(value), total))
            if self._kv.compare_and_set(path, value, record.revision, self._ttl, tried[-1][0]):
                return total
        raise AssertionError("unreachable")

    def compare_set(
        self, key: str | bytes, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``.

        An absent key counts as holding the empty value. Returns the value now stored,
        or ``expected_value`` when the key is absent and ``expected_value`` is not empty
        (torch's contract).
        """
        expected = to_bytes(expected_value, "values")
        desired = to_bytes(desired_value, "values")
        path = self._path(key)
        for attempt in itertools.count():
            self._backoff(attempt)
            record, _ = self._kv.get(path)
            if record is None:
                if expected:
                    return expected
                first = self._codec.encode(desired)
                with self._writing(key, len(desired)):
                    created = self._kv.create(path, first, self._ttl, self._codec.landed(first))
                if created:
                    return desired
                continue
            current = self._codec.decode(record)
            if current != expected:
                return current
            value = self._codec.encode(desired, record)
            with self._writing(key, len(desired)):
                swapped = self._kv.compare_and_set(
                    path, value, record.revision, self._ttl, self._codec.landed(value)
                )
            if swapped:
                return desired
        raise AssertionError("unreachable")

    def append(self, key: str | bytes, value: str | bytes) -> None:
        """Append ``value`` to the bytes under ``key`` (absent: set it).

        Raises:
            ValueError: etcd refused the grown value as too large (the key is unchanged).
        """
        suffix = to_bytes(value, "values")
        path = self._path(key)
        tried: list[Landed] = []  # this call's earlier writes (see add)
        for attempt in itertools.count():
            self._backoff(attempt)
            record, _ = self._kv.get(path)
            if any(landed(record) for landed in tried):
                return
            if record is None:
                first = self._codec.encode(suffix)
                tried.append(self._codec.landed(first))
                with self._writing(key, len(suffix)):
                    created = self._kv.create(path, first, self._ttl, tried[-1])
                if created:
                    return
                continue
            data = self._codec.decode(record) + suffix
            value = self._codec.encode(data, record)
            tried.append(self._codec.landed(value))
            with self._writing(key, len(data)):
                swapped = self._kv.compare_and_set(
                    path, value, record.revision, self._ttl, tried[-1]
                )
            if swapped:
                return

    def wait(self, keys: Sequence[str | bytes], timeout: timedelta | None = None) -> None:
        """Wait until every key in ``keys`` is set (a queue counts while it holds items).

        Args:
            timeout: overrides :attr:`timeout` for this call when given.

        Raises:
            StoreTimeoutError: naming the keys still missing.
        """
        self._await_all(list(keys), timeout, use_default=timeout is None, queues=True)

    def check(self, keys: Sequence[str | bytes]) -> bool:
        """Whether every key in ``keys`` is set now (no waiting); a queue counts while
        it holds items."""
        return all(self._present(k)[0] is not None for k in keys)

    def delete_key(self, key: str | bytes) -> bool:
        """Delete ``key``; ``True`` if it existed. A queue of that name stays (as on
        torch's stores)."""
        return self._kv.delete(self._path(key))

    def num_keys(self) -> int:
        """How many keys this store holds (queues do not count, as on torch's stores;
        neither do keys under its directory that it did not write)."""
        return len(self.list_keys())

    def multi_get(self, keys: Sequence[str | bytes]) -> list[bytes]:
        """The values of ``keys``, waiting up to :attr:`timeout` for all of them."""
        return [self._codec.decode(r) for r in self._await_all(list(keys), None, use_default=True)]

    def multi_set(self, keys: Sequence[str | bytes], values: Sequence[str | bytes]) -> None:
        """Set each key to its value (one write per key; not atomic as a whole).

        Raises:
            ValueError: ``keys`` and ``values`` differ in length (nothing is written), or
                etcd refused a value as too large (the keys before it are written).
        """
        keys, values = list(keys), list(values)
        if len(keys) != len(values):
            raise ValueError(f"multi_set() got {len(keys)} keys but {len(values)} values.")
        encoded = [
            (k, self._path(k), to_bytes(v, "values")) for k, v in zip(keys, values, strict=True)
        ]
        for key, path, value in encoded:
            with self._writing(key, len(value)):
                self._kv.put(path, self._codec.encode(value), self._ttl)

    def list_keys(self) -> list[str]:
        """Every key this store holds, sorted (torch's ``Store.list_keys``).

        Keys under the store's directory that this store did not write (their name is
        not a store key's encoding) are left out.
        """
        records, _ = self._kv.list_prefix(self._prefix)
        keys = [self._codec.key_of(record.key) for record in records]
        return sorted(k for k in keys if k is not None)

    def clone(self) -> EtcdStore:
        """A new store object on the same keys (torch's ``Store.clone``): same prefix,
        timeout and TTL, the same thread-safe etcd client, its own writer tag. Meant
        for use from another thread, one clone per thread."""
        twin = type(self)(self._kv, self._prefix, timeout=self._timeout_s, ttl=self._ttl or 0)
        return twin

    # -- queues -----------------------------------------------------------------------

    def _items(self, key: Any) -> tuple[list[Record], int]:
        """The queue's items not yet taken, oldest first (etcd's creation order)."""
        records, revision = self._kv.list_prefix(self._codec.queue(key))
        items = [r for r in records if not self._codec.taken(r)]
        return sorted(items, key=lambda r: (r.created or r.revision, r.key)), revision

    def queue_push(self, key: str | bytes, value: str | bytes) -> None:
        """Append ``value`` to the queue ``key`` (each item is a key of its own, created
        once: a retried push never adds it twice)."""
        data = to_bytes(value, "values")
        item = self._codec.item(key)
        with self._writing(key, len(data)):
            self._kv.create(item, self._codec.encode(data), self._ttl)

    def queue_pop(self, key: str | bytes, block: bool = True) -> bytes:
        """Take the oldest item of the queue ``key``; with ``block``, wait for one up to
        :attr:`timeout` (on a watch, not by polling).

        Each item goes to exactly one caller: a pop claims it with a compare-and-set
        (tagged, so a claim whose answer was lost is recognised) before deleting it.

        Raises:
            StoreQueueEmptyError: ``block=False`` and the queue is empty.
            StoreTimeoutError: no item within the timeout (the message says "timeout").
        """
        deadline = self._deadline(None, use_default=True) if block else time.monotonic()
        queue = self._codec.queue(key)
        try:
            with self._kv.bounded(None if deadline is None else deadline + _LATE):
                while True:
                    items, revision = self._items(key)
                    for item in items:
                        taken = self._take(item)
                        if taken is not None:
                            return taken
                    if not block:
                        raise StoreQueueEmptyError(f"The store queue {key!r} is empty.")
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        break
                    with contextlib.suppress(WatchCompacted):
                        self._kv.watch(queue, revision + 1, remaining, prefix=True)
        except RendezvousConnectionError:
            if deadline is None or time.monotonic() < deadline:
                raise
        raise StoreTimeoutError(
            f"Wait timeout after {self.timeout} popping from store queue {key!r} under "
            f"{self._prefix!r}."
        )

    def _take(self, item: Record) -> bytes | None:
        """Claim ``item`` for this caller; its value, or ``None`` if another took it."""
        claim = self._codec.claim()
        if self._kv.compare_and_set(item.key, claim, item.revision, self._ttl) is None:
            return None
        value = self._codec.decode(item)
        with contextlib.suppress(RendezvousConnectionError):  # it expires by itself
            self._kv.delete(item.key)
        return value

    def queue_len(self, key: str | bytes) -> int:
        """How many items the queue ``key`` holds (0 if it does not exist)."""
        return len(self._items(key)[0])

    def clear(self) -> None:
        """Delete every key of this store now (the TTL would do it later)."""
        self._kv.delete_prefix(self._prefix)
        log.info("store %s cleared", self._prefix)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(prefix={self._prefix!r}, endpoints={self._kv.endpoints!r})"
