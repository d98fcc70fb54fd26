"""The typed transaction seam: compares and operations, and what a transaction gives.

A caller that needs several key operations at once (a node's join: write its key,
read the coordinator key, drop its previous round's key, on the condition that the
round hint names this round) says so with these values and :meth:`KV.txn
<etcd_rdzv._kv.KV.txn>`; each API sends them as it can (v3: one etcd transaction; v2:
one request after the other, the compares read first).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._lease import Lease
from ._records import Record

__all__ = ["Compare", "Delete", "Get", "Op", "Put", "Reset", "TxnResult"]


@dataclass(frozen=True)
class Compare:
    """``key`` holds exactly ``value`` (``None``: ``key`` is absent)."""

    key: str
    value: str | None


@dataclass(frozen=True)
class Put:
    """Write ``key`` as a liveness key on the node's ``lease`` (as :meth:`KV.put_owned
    <etcd_rdzv._kv.KV.put_owned>`)."""

    key: str
    value: str
    lease: Lease


@dataclass(frozen=True)
class Get:
    """Read ``key``."""

    key: str


@dataclass(frozen=True)
class Delete:
    """Delete ``key`` (absent is fine)."""

    key: str


Op = Put | Get | Delete


@dataclass(frozen=True)
class TxnResult:
    """What a transaction did.

    ``succeeded``: every compare held and the operations ran; ``records`` then has one
    item per operation (a Put: the record written; a Get: the record read, ``None``
    when absent; a Delete: ``None``). Refused, nothing was written and ``compared``
    holds each compared key as it was (``None``: absent). ``revision``: a store
    revision the reads saw; a watch of a key read from ``revision + 1`` misses none
    of its later changes (0 when the API does not say).
    """

    succeeded: bool
    records: tuple[Record | None, ...] = ()
    compared: tuple[Record | None, ...] = ()
    revision: int = 0


@dataclass(frozen=True)
class Reset:
    """What :meth:`KV.reset <etcd_rdzv._kv.KV.reset>` replaces, and on which conditions.

    ``guard`` (a key as read) is deleted, with every key whose name starts with
    ``quiet`` and every directory in ``drop`` (each with everything under it), and
    ``key`` is written to ``value`` for ``ttl`` seconds: if ``guard`` is unchanged
    since it was read and no key whose name starts with ``quiet`` was written after
    revision ``as_of``. ``drop`` must name every directory under ``quiet`` that
    exists (APIs without prefix ranges delete those); ``key`` must be outside them.
    """

    guard: Record
    quiet: str
    as_of: int
    drop: tuple[str, ...]
    key: str
    value: str
    ttl: int
