"""The values the key-value layer hands out: records, watch events, write checks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["Event", "Landed", "Record"]


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
    (v2: the ``X-Etcd-Index`` of the watch response, which etcd sends when the long
    poll reaches it), else 0. At or above ``record.revision``, the change was already
    waiting when the poll came: several such in a row, and the watcher is behind (one
    listing may then be cheaper than fetching the changes one by one). The distance
    alone says little: on v2 writes elsewhere, such as heartbeats, move the index too.
    """

    kind: Literal["put", "delete"]
    record: Record
    current: int = 0


#: Whether a write whose answer was lost was applied, given the key as read back.
Landed = Callable[["Record | None"], bool]
