"""How :class:`~etcd_rdzv.EtcdStore` keys and values look in etcd, and the one place
that reads them back.

* A store key ``k`` lives at ``<prefix>/<urlsafe-base64(k), unpadded>``; a queue
  ``k`` at ``<prefix>/q/<same>/<item>``, one etcd key per item (``q`` is never the
  encoding of a key: one base64 character encodes nothing).
* A value is ``base64(bytes)|tag,tag,...``: the writer's tag (writer id and sequence
  number) first, then, for a read-modify-write, the tags of the writes it replaced, so
  a writer whose answer was lost can tell whether its write landed.
* A queue item claimed by a pop holds ``taken|<writer>-<seq>``.

Values are parsed strictly: what this store did not write is a ``ValueError`` naming
the key, never a bare decoding error.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import uuid
from datetime import timedelta
from typing import Any

from ._kv import Landed, Record

__all__ = ["Codec", "seconds", "to_bytes"]

TAG_SEP = "|"  # never in standard base64, so it splits value from writer tag
QUEUES = "q"  # <prefix>/q/<key>/<item>: a directory, never a store key's name
TAKEN = "taken|"  # a queue item claimed by a pop (never a value's encoding)
CHAIN = 32  # writer tags a read-modify-write value carries (its own and earlier ones)


def to_bytes(value: Any, what: str) -> bytes:
    """A key or value as bytes (str as UTF-8); ``TypeError`` for anything else."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, list) and all(isinstance(b, int) for b in value):
        return bytes(value)
    raise TypeError(f"Store {what} must be str or bytes, got {type(value).__name__}.")


def seconds(timeout: timedelta | float | int | None, what: str) -> float | None:
    """A timeout as seconds: ``None`` forever, ``0`` no wait; negatives are errors."""
    if timeout is None:
        return None
    value = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if value < 0:
        raise ValueError(f"{what} must not be negative, got {timeout!r}.")
    return value


def _tags(record: Record) -> list[str]:
    """The writer tags of a stored value, the latest write's first."""
    _, _, tags = record.value.partition(TAG_SEP)
    return tags.split(",") if tags else []


class Codec:
    """The keys and values of one store object under ``prefix``, with its own writer
    id (so its writes are recognisable among everyone's)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._writer = uuid.uuid4().hex[:16]
        self._seq = itertools.count(1)

    # -- keys ---------------------------------------------------------------------

    def path(self, key: Any) -> str:
        """The etcd key of store key ``key``."""
        raw = to_bytes(key, "keys")
        if not raw:
            raise ValueError("Store keys must not be empty.")
        return f"{self.prefix}/{base64.urlsafe_b64encode(raw).decode('ascii').rstrip('=')}"

    def queue(self, key: Any) -> str:
        """The etcd directory of queue ``key``."""
        return f"{self.prefix}/{QUEUES}{self.path(key)[len(self.prefix) :]}"

    def item(self, key: Any) -> str:
        """A new etcd key for an item of queue ``key`` (unique to this writer)."""
        return f"{self.queue(key)}/{self._writer}-{next(self._seq)}"

    def key_of(self, etcd_key: str) -> str | None:
        """The store key whose etcd key is ``etcd_key``; ``None`` for anything else
        under the prefix (queue items, keys this store did not write)."""
        name = etcd_key[len(self.prefix) + 1 :]
        if not etcd_key.startswith(self.prefix + "/") or not name or "/" in name:
            return None
        try:
            raw = base64.urlsafe_b64decode(name + "=" * (-len(name) % 4))
            if self.path(raw) != etcd_key:
                return None  # not the canonical encoding of a key: not ours
            return raw.decode("utf-8")
        except (binascii.Error, ValueError):
            return None

    # -- values -------------------------------------------------------------------

    def encode(self, value: bytes, replacing: Record | None = None) -> str:
        """``base64(value)|tag,...``: this write's tag, then, for a read-modify-write
        of ``replacing``, the tags of the writes before it (up to ``CHAIN`` in all)."""
        tags = [f"{self._writer}:{next(self._seq)}"]
        if replacing is not None:
            tags += _tags(replacing)[: CHAIN - 1]
        return base64.b64encode(value).decode("ascii") + TAG_SEP + ",".join(tags)

    @staticmethod
    def landed(encoded: str) -> Landed:
        """Whether the write of ``encoded``, whose answer was lost, was applied: its
        tag is in the key's value as read back, as the latest write or one of those
        it was followed by (an ``add`` is then not applied twice)."""
        tag = encoded.rsplit(TAG_SEP, 1)[1].split(",", 1)[0]

        def landed(current: Record | None) -> bool:
            return current is not None and tag in _tags(current)

        return landed

    def decode(self, record: Record) -> bytes:
        """The bytes a record holds; ``ValueError`` naming the key if this store did
        not write it."""
        data = record.value.split(TAG_SEP, 1)[0]
        try:
            return base64.b64decode(data.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError, ValueError) as exc:
            raise ValueError(
                f"The store value under {record.key!r} is not one this store wrote."
            ) from exc

    def claim(self) -> str:
        """The value that marks a queue item as taken by this writer."""
        return f"{TAKEN}{self._writer}-{next(self._seq)}"

    @staticmethod
    def taken(record: Record) -> bool:
        """Whether a queue item was claimed by a pop."""
        return record.value.startswith(TAKEN)
