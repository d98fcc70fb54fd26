"""The key operations of the v3 client: reads, and every write as one typed transaction.

Each write this client makes (a put, a create, a compare-and-set, a delete, a
refresh, :meth:`V3KV.txn` itself) is a :mod:`.._txn` transaction, turned into the
gateway's ``/v3/kv/txn`` body by :func:`_body` and read back from its answer by
:func:`_answer`: the one place that builds transaction bodies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ...errors import RendezvousConnectionError
from .._base import Event, Landed, Record, Watcher
from .._http import Transport
from .._lease import Lease
from .._txn import (
    Compare,
    Condition,
    Delete,
    DeletePrefix,
    Get,
    Op,
    Present,
    Put,
    Quiet,
    Revision,
    TxnResult,
)
from ._lease import Leases
from ._watch import Watches
from ._wire import EtcdError, GatewayKV, dec, enc, header_revision, prefix_range, record, under

__all__ = ["V3KV"]

log = logging.getLogger(__name__)

_OUT_OF_RANGE = 11  # gRPC: mvcc's future or compacted revision

T = TypeVar("T")


def _created(key: str, value: str, written_at: int, response_put: dict[str, Any]) -> Record:
    """The record a put wrote, from its answer (``prev_kv`` says when the key was
    created, if it existed)."""
    prev = response_put.get("prev_kv") or {}
    return Record(key, value, written_at, int(prev.get("create_revision") or written_at))


def _condition(c: Condition) -> dict[str, str]:
    if isinstance(c, Quiet):  # every key of the range last written at or before as_of
        return {
            **prefix_range(c.prefix),
            "target": "MOD",
            "result": "LESS",
            "mod_revision": str(c.as_of + 1),
        }
    if isinstance(c, Revision):
        return {
            "key": enc(c.key),
            "target": "MOD",
            "result": "EQUAL",
            "mod_revision": str(c.revision),
        }
    if isinstance(c, Present):
        return {"key": enc(c.key), "target": "CREATE", "result": "GREATER", "create_revision": "0"}
    if c.value is None:  # never created (or deleted)
        return {"key": enc(c.key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
    return {"key": enc(c.key), "target": "VALUE", "result": "EQUAL", "value": enc(c.value)}


def _request_op(op: Op, lease: int) -> dict[str, Any]:
    if isinstance(op, Put):
        put = {"key": enc(op.key), "value": enc(op.value), "prev_kv": True}
        if lease:
            put["lease"] = str(lease)
        return {"request_put": put}
    if isinstance(op, Get):
        return {"request_range": {"key": enc(op.key)}}
    if isinstance(op, DeletePrefix):
        return {"request_delete_range": prefix_range(op.prefix)}
    return {"request_delete_range": {"key": enc(op.key)}}


def _put_of(ops: Sequence[Op]) -> Put | None:
    """The transaction's Put (at most one)."""
    puts = [op for op in ops if isinstance(op, Put)]
    if len(puts) > 1:
        raise ValueError(f"a transaction takes at most one Put, not {len(puts)}")
    return puts[0] if puts else None


def _reads(compares: Sequence[Condition], ops: Sequence[Op]) -> list[str]:
    """The keys a refused transaction reads, in this order: each compared key (a
    :class:`Quiet` compare has none), the Put's, the Gets'."""
    put = _put_of(ops)
    return (
        [c.key for c in compares if not isinstance(c, Quiet)]
        + ([put.key] if put is not None else [])
        + [op.key for op in ops if isinstance(op, Get)]
    )


def _body(
    compares: Sequence[Condition], ops: Sequence[Op], lease: int, *, reads: bool
) -> dict[str, Any]:
    """The gateway's body of the transaction (its Put on ``lease``, 0: none); refused,
    it reads :func:`_reads` if ``reads``."""
    body: dict[str, Any] = {"success": [_request_op(op, lease) for op in ops]}
    if compares:
        body["compare"] = [_condition(c) for c in compares]
        if reads:
            keys = _reads(compares, ops)
            body["failure"] = [{"request_range": {"key": enc(k)}} for k in keys]
    return body


def _first_kv(response: Any) -> dict[str, Any] | None:
    """The first key of a range response of a transaction (``None``: none)."""
    kvs = (response.get("response_range") or {}).get("kvs") or []
    return kvs[0] if kvs else None


def _record_or_none(kv: dict[str, Any] | None) -> Record | None:
    return None if kv is None else record(kv)


def _landed(kv: dict[str, Any], value: str, lease: int) -> bool:
    """Whether the key read back is this client's write: its value, its lease."""
    return record(kv).value == value and int(kv.get("lease") or 0) == lease


def _records(ops: Sequence[Op], responses: list[Any], at: int) -> tuple[Record | None, ...]:
    """The records of a transaction that ran: per operation, as TxnResult says."""
    padded = list(responses) + [{}] * (len(ops) - len(responses))
    found: list[Record | None] = []
    for op, response in zip(ops, padded, strict=False):
        if isinstance(op, Put):
            found.append(_created(op.key, op.value, at, response.get("response_put") or {}))
        elif isinstance(op, Get):
            found.append(_record_or_none(_first_kv(response)))
        else:
            found.append(None)
    return tuple(found)


def _deleted(responses: list[Any]) -> int:
    """How many keys the deletes of a transaction that ran removed."""
    counts = (_count((r.get("response_delete_range") or {}).get("deleted")) for r in responses)
    return sum(n or 0 for n in counts)


def _answer(
    compares: Sequence[Condition], ops: Sequence[Op], data: dict[str, Any], lease: int
) -> TxnResult:
    """The :class:`TxnResult` of the answer ``data`` to :func:`_body` (sent with
    ``reads``). A refusal whose reads find the Put's key holding exactly its value on
    ``lease`` is a resend whose first try landed: reported as succeeded."""
    at = header_revision(data)
    responses = data.get("responses") or []
    if not compares or data.get("succeeded"):
        return TxnResult(
            True, _records(ops, responses, at), revision=at, deleted=_deleted(responses)
        )
    found = [_first_kv(r) for r in responses]
    found += [None] * (len(_reads(compares, ops)) - len(found))
    read = iter(found)
    compared = tuple(
        None if isinstance(c, Quiet) else _record_or_none(next(read)) for c in compares
    )
    put = _put_of(ops)
    mine = next(read) if put is not None else None
    if mine is not None and put is not None and _landed(mine, put.value, lease):
        records = tuple(
            record(mine)
            if isinstance(op, Put)
            else (_record_or_none(next(read)) if isinstance(op, Get) else None)
            for op in ops
        )
        return TxnResult(True, records, revision=at)
    return TxnResult(False, compared=compared, revision=at)


def _subject(ops: Sequence[Op], compares: Sequence[Condition]) -> str:
    """The key a transaction's messages name: its first operation's (or compare's)."""
    first = (*ops, *compares)[0] if ops or compares else Get("")
    return first.prefix if isinstance(first, (DeletePrefix, Quiet)) else first.key


def _count(value: Any) -> int | None:
    """An integer of an answer (int64 values come as JSON strings); ``None`` if not one."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None
    try:
        return int(value)
    except ValueError:
        return None


class V3KV(GatewayKV):
    """:class:`~etcd_rdzv._kv.KV` on the etcd v3 API (JSON gateway).

    compare-and-set is a transaction comparing the key's ``mod_revision``; create is
    a transaction comparing its ``create_revision`` with 0. TTLs are leases (see
    :mod:`._lease`), watches streamed requests (see :mod:`._watch`).

    Args:
        urls: the base URL of each endpoint, preferred first.
        read_timeout: seconds one request may take.
        username, password: etcd credentials (v3 auth), both or neither.
        transport: the connections of the gateway requests (see :mod:`._http`).
        key_prefix: the prefix of the keys it touches, named when etcd refuses one
            for want of a permission.
    """

    api = "v3"
    atomic_txn = True

    def __init__(
        self,
        urls: list[str],
        read_timeout: float,
        username: str | None = None,
        password: str | None = None,
        transport: Transport | None = None,
        key_prefix: str | None = None,
    ) -> None:
        super().__init__(urls, read_timeout, username, password, transport, key_prefix)
        self._leases = Leases(self)
        self._watches = Watches(self)

    # -- reads ------------------------------------------------------------------------

    def get(self, key: str) -> tuple[Record | None, int]:
        return self._get(key, None)

    def _get(self, key: str, deadline: float | None) -> tuple[Record | None, int]:
        data = self._request("read", key, "/v3/kv/range", {"key": enc(key)}, deadline=deadline)
        kvs = data.get("kvs") or []
        return (record(kvs[0]) if kvs else None), header_revision(data)

    def get_at(self, key: str, revision: int) -> tuple[Record | None, int]:
        if revision <= 0:
            return self.get(key)
        body = {"key": enc(key), "revision": str(revision), "serializable": True}

        def fn(index: int, timeout: float) -> dict[str, Any] | None:
            try:
                return self._post(index, "/v3/kv/range", body, timeout)
            except EtcdError as exc:
                text = exc.message.lower()
                if exc.code == _OUT_OF_RANGE or "future revision" in text or "compacted" in text:
                    # This member has not applied it yet, or it is compacted away.
                    log.debug("read of %s at revision %d: %s; reading it anew", key, revision, exc)
                    return None
                raise

        data = self._call("read", key, fn, idempotent=True)
        if data is None:
            return self.get(key)
        kvs = data.get("kvs") or []
        return (record(kvs[0]) if kvs else None), header_revision(data)

    def _range(self, what: str, prefix: str) -> tuple[list[Record], int]:
        data = self._request(what, prefix, "/v3/kv/range", under(prefix))
        return [record(kv) for kv in data.get("kvs") or []], header_revision(data)

    def time_left(self, key: str) -> int | None:
        data = self._request("read", key, "/v3/kv/range", {"key": enc(key)})
        kvs = data.get("kvs") or []
        lease = _count(kvs[0].get("lease")) if kvs and isinstance(kvs[0], dict) else None
        if not lease:
            return None
        body = {"ID": str(lease)}
        ttl = self._request("lease time-to-live", key, "/v3/lease/timetolive", body)
        left = _count(ttl.get("TTL", 0))  # etcd 3.7 leaves a zero out; -1: gone
        return left if left is not None and left >= 0 else None

    def list_prefix(self, prefix: str) -> tuple[list[Record], int]:
        records, at = self._range("list", prefix)
        start = len(prefix) + 1
        return [r for r in records if "/" not in r.key[start:]], at

    def list_tree(self, prefix: str) -> tuple[list[Record], int]:
        return self._range("list", prefix)

    # -- writes: each one typed transaction ---------------------------------------------

    def _leased(self, ops: Sequence[Op], send: Callable[[int], T]) -> T:
        """``send(lease id)`` for the Put of ``ops``: on its node lease, or on the
        clean-up lease of its TTL (0: none, and when there is no Put)."""
        put = _put_of(ops)
        if put is None:
            return send(0)
        if put.lease is not None:
            return self._leases.on_lease(put.lease, send, put.key)
        return self._leases.leased(put.ttl, send)

    def _txn(self, what: str, compares: Sequence[Condition], ops: Sequence[Op]) -> TxnResult:
        """:meth:`txn`, named ``what`` in messages."""
        put = _put_of(ops)
        subject = put.key if put is not None else _subject(ops, compares)
        refused: list[TxnResult] = []

        def send(lease: int) -> TxnResult | None:
            body = _body(compares, ops, lease, reads=True)
            # Sent again after a lost answer it writes the same, or (with compares)
            # finds that its first try landed: it may simply be resent.
            result = _answer(compares, ops, self._request(what, subject, "/v3/kv/txn", body), lease)
            if result.succeeded:
                return result
            refused.append(result)
            return None

        result = self._leased(ops, send)
        if result is None:
            return refused[-1] if refused else TxnResult(False)
        if put is not None and put.lease is not None:
            for op in ops:
                if isinstance(op, Delete):
                    put.lease.forget(op.key)
        return result

    def txn(self, compares: Sequence[Condition], ops: Sequence[Op]) -> TxnResult:
        """One etcd transaction: ``compares`` (a value equal, the key absent, its
        revision, nothing under a prefix newer than a revision), then ``ops``; its Put
        (at most one) on the node's lease it names, or on the clean-up lease of its TTL.

        Refused, the transaction reads the compared keys, and also the Put's key and
        the keys of the Gets: if this is a resend whose first try landed (its answer
        was lost) before a compare stopped holding, the Put's key holds exactly its
        value on its lease, and the transaction is reported as succeeded."""
        return self._txn("write", compares, ops)

    def _conditional(
        self,
        what: str,
        compare: Condition,
        put: Put,
        still_possible: Callable[[Record | None], bool],
        landed: Landed | None,
    ) -> Record | None:
        """The transaction ``compare``, then ``put``; a lost answer resolved by
        reading the key back (see :meth:`_resolve`): ``landed`` decides."""
        compares, ops = (compare,), (put,)

        def send(lease: int) -> Record | None:
            body = _body(compares, ops, lease, reads=False)

            def fn(index: int, timeout: float) -> Record | None:
                data = self._post(index, "/v3/kv/txn", body, timeout)
                if not data.get("succeeded"):
                    return None
                return _answer(compares, ops, data, lease).records[0]

            return self._resolve(what, put.key, put.value, fn, still_possible, landed)

        return self._leased(ops, send)

    def create(
        self,
        key: str,
        value: str,
        ttl: int | None,
        landed: Landed | None = None,
        *,
        lease: Lease | None = None,
    ) -> Record | None:
        return self._conditional(
            "create",
            Compare(key, None),
            Put(key, value, lease, None if lease is not None else ttl),
            lambda current: current is None,
            landed,
        )

    def compare_and_set(
        self, key: str, value: str, revision: int, ttl: int | None, landed: Landed | None = None
    ) -> Record | None:
        return self._conditional(
            "compare-and-set",
            Revision(key, revision),
            Put(key, value, ttl=ttl),
            lambda current: current is not None and current.revision == revision,
            landed,
        )

    def _written(self, put: Put) -> Record:
        # An unconditional write may simply be sent again.
        (written,) = self._txn("write", (), (put,)).records
        if written is None:  # never: a Put's record is made from its answer
            raise RendezvousConnectionError(f"etcd did not confirm the write of {put.key!r}")
        return written

    def put(self, key: str, value: str, ttl: int | None) -> Record:
        return self._written(Put(key, value, ttl=ttl))

    def put_owned(self, key: str, value: str, lease: Lease) -> Record:
        """Write ``key`` on the node's ``lease``: it lives while :meth:`keep_alive`
        renews the lease, and goes when it is revoked."""
        return self._written(Put(key, value, lease))

    # -- the node's lease --------------------------------------------------------------

    def grant(self, ttl: int, reuse: Lease | None = None) -> Lease:
        return self._leases.grant(ttl, reuse)

    def keep_alive(self, lease: Lease) -> list[str]:
        return self._leases.keep_alive(lease)

    def revoke(self, lease: Lease, deadline: float) -> list[str]:
        return self._leases.revoke(lease, deadline)

    def delete(self, key: str) -> bool:
        return self._txn("delete", (), (Delete(key),)).deleted > 0

    def delete_prefix(self, prefix: str) -> None:
        self._txn("delete", (), (Delete(prefix), DeletePrefix(prefix + "/")))

    def refresh(self, key: str, ttl: int) -> bool:
        """Keep the lease of ``key`` alive (whatever TTL it was granted with).

        A key without a lease is attached to the clean-up lease of ``ttl`` (that write
        is a new revision of the key, unlike a keep-alive). ``False`` if the key or its
        lease is gone.
        """
        data = self._request("refresh", key, "/v3/kv/range", {"key": enc(key)})
        kvs = data.get("kvs") or []
        if not kvs:
            return False
        lease_id = int(kvs[0].get("lease") or 0)
        if lease_id:
            return self._leases.keepalive(lease_id) > 0
        current = record(kvs[0])
        # Repeatable: if the first try landed, the resend finds the key on the lease.
        same = Revision(key, current.revision)
        if self._txn("refresh", (same,), (Put(key, current.value, ttl=ttl),)).succeeded:
            return True
        now, _ = self.get(key)
        return now is not None

    # -- watches ----------------------------------------------------------------------

    def watch(
        self, key: str, from_revision: int, timeout: float | None, *, prefix: bool = False
    ) -> Event | None:
        events = self.watch_events(key, from_revision, timeout, prefix=prefix)
        return events[0] if events else None

    def watch_events(
        self, key: str, from_revision: int, timeout: float | None, *, prefix: bool = False
    ) -> list[Event]:
        """Every event of the first answer that has any (etcd sends the changes of a
        revision range together), each with ``current`` set to the store revision of
        that answer; ``[]`` when ``timeout`` passed."""
        return self._watches.events(key, from_revision, timeout, prefix)

    def watcher(self, key: str, *, prefix: bool = False) -> Watcher:
        """A watcher that keeps one watch stream open (see :mod:`._watch`)."""
        return self._watches.watcher(key, prefix)

    # -- the client -------------------------------------------------------------------

    def probe(self, key: str = "/") -> None:
        deadline = time.monotonic() + self._read_timeout
        # Below the key, not the key itself: etcd users are usually granted a prefix
        # ("/etcd_rdzv/"), which is all the other operations touch.
        body = {**under(key), "count_only": True, "limit": "1"}
        self._request("probe read", key, "/v3/kv/range", body, deadline=deadline)

    def close(self) -> None:
        """Revoke the node leases in use (their keys vanish now), then drop connections.

        Clean-up leases are left to expire: they hold state other nodes still use.
        """
        if self._closed:
            return
        self._leases.revoke_all(time.monotonic() + self._read_timeout)
        self._leases.close()
        self._watches.stop()
        self._closed = True
        self._transport.close()

    # -- the other keyspace -----------------------------------------------------------

    def keys_under(self, directory: str, limit: int) -> tuple[tuple[str, ...], int]:
        """The names of the first ``limit`` keys below ``directory`` (in key order) and
        how many there are in all: one keys-only read.

        Raises:
            RendezvousConnectionError: etcd did not answer, or answered nonsense.
        """
        body = {**under(directory), "keys_only": True, "limit": str(max(limit, 1))}
        data = self._request("list", directory, "/v3/kv/range", body)
        try:
            found = data.get("kvs") or []
            names = tuple(dec(kv.get("key")) for kv in found[: max(limit, 0)])
            count = int(data.get("count") or 0)
        except (AttributeError, TypeError, ValueError) as exc:  # not etcd's answer
            raise RendezvousConnectionError(
                f"etcd's listing of {directory!r} is not a v3 range answer: {exc}"
            ) from exc
        return names, max(count, len(names))
