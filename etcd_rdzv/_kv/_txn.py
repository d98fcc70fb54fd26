"""The typed transaction seam: compares and operations, and what a transaction gives.

A caller that needs several key operations at once (a node's join: write its key,
read the coordinator key, drop its previous round's key, on the condition that the
round hint names this round) says so with these values and :meth:`KV.txn
<etcd_rdzv._kv.KV.txn>`; each API sends them as it can (v3: one etcd transaction; v2:
one request after the other, the compares read first). On v3 every write of this
package is one of these transactions, built in one place (:mod:`.v3.kv`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._lease import Lease
from ._records import Record

__all__ = [
    "Compare",
    "Condition",
    "Delete",
    "DeletePrefix",
    "Get",
    "Op",
    "Present",
    "Put",
    "Quiet",
    "Revision",
    "TxnResult",
]


@dataclass(frozen=True)
class Compare:
    """``key`` holds exactly ``value`` (``None``: ``key`` is absent)."""

    key: str
    value: str | None


@dataclass(frozen=True)
class Present:
    """``key`` exists, whatever it holds."""

    key: str


@dataclass(frozen=True)
class Revision:
    """``key`` was last written at store revision ``revision`` (its record's
    ``revision``): nobody wrote it since it was read."""

    key: str
    revision: int


@dataclass(frozen=True)
class Quiet:
    """No key whose name starts with ``prefix`` was written after revision ``as_of``
    (a compare over the range: v3 only)."""

    prefix: str
    as_of: int


Condition = Compare | Present | Revision | Quiet


@dataclass(frozen=True)
class Put:
    """Write ``key``: as a liveness key on the node's ``lease`` (as :meth:`KV.put_owned
    <etcd_rdzv._kv.KV.put_owned>`), or without one for ``ttl`` seconds (``None``: no
    expiry; as :meth:`KV.put <etcd_rdzv._kv.KV.put>`)."""

    key: str
    value: str
    lease: Lease | None = None
    ttl: int | None = None


@dataclass(frozen=True)
class Get:
    """Read ``key``."""

    key: str


@dataclass(frozen=True)
class Delete:
    """Delete ``key`` (absent is fine)."""

    key: str


@dataclass(frozen=True)
class DeletePrefix:
    """Delete every key whose name starts with ``prefix`` (v3 only: v2 deletes a
    directory with :meth:`KV.delete_prefix <etcd_rdzv._kv.KV.delete_prefix>`)."""

    prefix: str


Op = Put | Get | Delete | DeletePrefix


@dataclass(frozen=True)
class TxnResult:
    """What a transaction did.

    ``succeeded``: every compare held and the operations ran; ``records`` then has one
    item per operation (a Put: the record written; a Get: the record read, ``None``
    when absent; a delete: ``None``) and ``deleted`` counts the keys the deletes
    removed. Refused, nothing was written and ``compared`` holds each compared key as
    it was (``None``: absent; a :class:`Quiet` compare: ``None``). ``revision``: a
    store revision the reads saw; a watch of a key read from ``revision + 1`` misses
    none of its later changes (0 when the API does not say).
    """

    succeeded: bool
    records: tuple[Record | None, ...] = ()
    compared: tuple[Record | None, ...] = ()
    revision: int = 0
    deleted: int = 0
