"""The abstract key-value layer: records, events and the operations every API provides."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Literal

__all__ = ["KV", "Event", "Record", "WatchCompacted"]


@dataclass(frozen=True)
class Record:
    """One key as read or written.

    ``revision`` is what compare-and-set compares: the v2 ``modifiedIndex`` or the v3
    ``mod_revision``. ``created`` is when the key was created (v2 ``createdIndex``,
    v3 ``create_revision``): it orders keys by arrival. Values are text (callers
    base64-encode binary data).
    """

    key: str
    value: str
    revision: int
    created: int = 0


@dataclass(frozen=True)
class Event:
    """A change to a watched key. ``record.value`` is empty for deletes and expiries.

    ``current`` is the store revision when etcd answered, where the API reports it
    (v2: the ``X-Etcd-Index`` of the watch response), else 0. When it is well above
    ``record.revision`` the watcher is behind: more changes are already waiting, and
    one listing may be cheaper than fetching them one by one.
    """

    kind: Literal["put", "delete"]
    record: Record
    current: int = 0


class WatchCompacted(Exception):
    """The history a watch wanted to start from is gone; read again and watch anew."""


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
    def create(self, key: str, value: str, ttl: int | None) -> Record | None:
        """Create ``key`` if absent. Returns the new record, or ``None`` if it existed."""

    @abc.abstractmethod
    def compare_and_set(
        self, key: str, value: str, revision: int, ttl: int | None
    ) -> Record | None:
        """Write ``key`` if its revision is ``revision``; ``None`` if it was not."""

    @abc.abstractmethod
    def put(self, key: str, value: str, ttl: int | None) -> Record:
        """Write ``key`` unconditionally."""

    def put_owned(self, key: str, value: str, ttl: int) -> Record:
        """Write a liveness key owned by this client.

        The key lives while :meth:`refresh` keeps it, disappears ``ttl`` seconds after
        the last refresh, and at once when the client is closed (where the API can do
        that: v3 revokes the client's lease; on v2 it is a key TTL).
        """
        return self.put(key, value, ttl)

    def claim(self, key: str, value: str, ttl: int) -> tuple[Record | None, int]:
        """Create a liveness key owned by this client if ``key`` is absent.

        Like :meth:`create`, with the lifetime of :meth:`put_owned`: the key lives while
        :meth:`refresh` keeps it and disappears ``ttl`` seconds after the last refresh
        (and, where the API can do that, at once when the client is closed).

        Returns:
            ``(record, 0)`` when this call created the key; ``(None, revision)`` when
            it existed, where ``revision`` is a store revision at which it still
            existed (0 if the API does not say): a watch of the key from
            ``revision + 1`` misses none of its later changes.
        """
        return self.create(key, value, ttl), 0

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

    @abc.abstractmethod
    def probe(self, key: str) -> None:
        """Read ``key`` to check that etcd answers, serves this API and accepts our
        credentials, all within ``read_timeout`` in total."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections. The client must not be used afterwards."""
