"""The key operations of the v3 client: reads, transactions, writes on leases."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import RendezvousConnectionError
from .._base import Event, Landed, Record, Watcher
from .._http import Transport
from .._lease import Lease
from .._txn import Compare, Delete, Get, Op, Put, Reset, TxnResult
from ._lease import Leases
from ._watch import Watches
from ._wire import GatewayKV, dec, enc, header_revision, prefix_range, record, under

__all__ = ["V3KV"]

log = logging.getLogger(__name__)


def _created(key: str, value: str, written_at: int, response_put: dict[str, Any]) -> Record:
    """The record a put wrote, from its answer (``prev_kv`` says when the key was
    created, if it existed)."""
    prev = response_put.get("prev_kv") or {}
    return Record(key, value, written_at, int(prev.get("create_revision") or written_at))


def _compare(c: Compare) -> dict[str, str]:
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
    return {"request_delete_range": {"key": enc(op.key)}}


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

    # -- writes -----------------------------------------------------------------------

    def _txn_put(
        self,
        what: str,
        key: str,
        value: str,
        compare: dict[str, str],
        ttl: int | None,
        still_possible: Callable[[Record | None], bool],
        lease: Lease | None = None,
        refused_at: list[int] | None = None,
        landed: Landed | None = None,
    ) -> Record | None:
        def send(lease: int) -> Record | None:
            put: dict[str, Any] = {"key": enc(key), "value": enc(value), "prev_kv": True}
            if lease:
                put["lease"] = str(lease)
            body = {"compare": [compare], "success": [{"request_put": put}]}

            def fn(index: int, timeout: float) -> Record | None:
                data = self._post(index, "/v3/kv/txn", body, timeout)
                if not data.get("succeeded"):
                    if refused_at is not None:
                        refused_at.append(header_revision(data))
                    return None
                responses = data.get("responses") or [{}]
                return _created(
                    key, value, header_revision(data), responses[0].get("response_put") or {}
                )

            return self._resolve(what, key, value, fn, still_possible, landed)

        if lease is not None:
            return self._leases.on_lease(lease, send, key)
        return self._leases.leased(ttl, send)

    def create(
        self, key: str, value: str, ttl: int | None, landed: Landed | None = None
    ) -> Record | None:
        return self._txn_put(
            "create",
            key,
            value,
            _compare(Compare(key, None)),
            ttl,
            lambda c: c is None,
            landed=landed,
        )

    def claim(self, key: str, value: str, lease: Lease) -> tuple[Record | None, int]:
        """Create ``key`` if absent, on the node's ``lease``. A refusal reports the
        revision the key existed at."""
        refused: list[int] = []
        created = self._txn_put(
            "create",
            key,
            value,
            _compare(Compare(key, None)),
            lease.ttl,
            lambda current: current is None,
            lease=lease,
            refused_at=refused,
        )
        return created, 0 if created is not None or not refused else refused[-1]

    def compare_and_set(
        self, key: str, value: str, revision: int, ttl: int | None, landed: Landed | None = None
    ) -> Record | None:
        compare = {
            "key": enc(key),
            "target": "MOD",
            "result": "EQUAL",
            "mod_revision": str(revision),
        }
        return self._txn_put(
            "compare-and-set",
            key,
            value,
            compare,
            ttl,
            lambda current: current is not None and current.revision == revision,
            landed=landed,
        )

    def _put(self, key: str, value: str, ttl: int | None, lease: Lease | None) -> Record:
        def send(lease_id: int) -> Record:
            body: dict[str, Any] = {"key": enc(key), "value": enc(value), "prev_kv": True}
            if lease_id:
                body["lease"] = str(lease_id)
            # An unconditional write may simply be sent again.
            data = self._request("write", key, "/v3/kv/put", body)
            return _created(key, value, header_revision(data), data)

        if lease is not None:
            return self._leases.on_lease(lease, send, key)
        return self._leases.leased(ttl, send)

    def put(self, key: str, value: str, ttl: int | None) -> Record:
        return self._put(key, value, ttl, None)

    def put_owned(self, key: str, value: str, lease: Lease) -> Record:
        """Write ``key`` on the node's ``lease``: it lives while :meth:`keep_alive`
        renews the lease, and goes when it is revoked."""
        return self._put(key, value, lease.ttl, lease)

    # -- the node's lease --------------------------------------------------------------

    def grant(self, ttl: int, reuse: Lease | None = None) -> Lease:
        return self._leases.grant(ttl, reuse)

    def keep_alive(self, lease: Lease) -> list[str]:
        return self._leases.keep_alive(lease)

    def revoke(self, lease: Lease, deadline: float) -> list[str]:
        return self._leases.revoke(lease, deadline)

    def txn(self, compares: Sequence[Compare], ops: Sequence[Op]) -> TxnResult:
        """One etcd transaction: ``compares`` (a value equal, or the key absent), then
        ``ops``; its Put (at most one) on the node's lease it names.

        Refused, the transaction reads the compared keys, and also the Put's key and
        the keys of the Gets: if this is a resend whose first try landed (its answer
        was lost) before a compare stopped holding, the Put's key holds exactly its
        value on its lease, and the transaction is reported as succeeded."""
        puts = [op for op in ops if isinstance(op, Put)]
        if len(puts) > 1:
            raise ValueError(f"a transaction takes at most one Put, not {len(puts)}")
        put = puts[0] if puts else None
        gets = [op.key for op in ops if isinstance(op, Get)]
        subject = put.key if put is not None else (ops or compares or [Get("")])[0].key
        refused: list[TxnResult] = []

        def send(lease: int) -> TxnResult | None:
            body: dict[str, Any] = {"success": [_request_op(op, lease) for op in ops]}
            if compares:
                body["compare"] = [_compare(c) for c in compares]
                reads = [c.key for c in compares] + ([put.key] if put else []) + gets
                body["failure"] = [{"request_range": {"key": enc(k)}} for k in reads]
            # Sent again after a lost answer it writes the same, or (with compares)
            # finds that its first try landed: it may simply be resent.
            data = self._request("write", subject, "/v3/kv/txn", body)
            at = header_revision(data)
            responses = data.get("responses") or []
            if not compares or data.get("succeeded"):
                return TxnResult(True, _records(ops, responses, at), revision=at)
            found = [_first_kv(r) for r in responses]
            found += [None] * (len(compares) + len(gets) + 1 - len(found))
            n = len(compares)
            mine = found[n] if put is not None else None
            if mine is not None and put is not None and _landed(mine, put.value, lease):
                read = iter(found[n + 1 :])
                records = tuple(
                    record(mine)
                    if isinstance(op, Put)
                    else (_record_or_none(next(read)) if isinstance(op, Get) else None)
                    for op in ops
                )
                return TxnResult(True, records, revision=at)
            compared = tuple(_record_or_none(kv) for kv in found[:n])
            refused.append(TxnResult(False, compared=compared, revision=at))
            return None

        result = send(0) if put is None else self._leases.on_lease(put.lease, send, put.key)
        if result is None:
            return refused[-1] if refused else TxnResult(False)
        if put is not None:
            for op in ops:
                if isinstance(op, Delete):
                    put.lease.forget(op.key)
        return result

    # -- a round's completion and a node's withdrawal, ordered --------------------------

    def withdraw(
        self, key: str, result_key: str, gone_key: str, gone_value: str, ttl: int, wait: float
    ) -> tuple[bool, Record | None]:
        """One transaction: if ``result_key`` is absent, write ``gone_key`` (on the
        clean-up lease of ``ttl``) and delete ``key``; else read the result. Sent again
        after a lost answer it does the same, or finds the result a coordinator wrote
        from a picture without ``key``."""

        def send(lease: int) -> tuple[bool, Record | None]:
            put: dict[str, Any] = {"key": enc(gone_key), "value": enc(gone_value)}
            if lease:
                put["lease"] = str(lease)
            body = {
                "compare": [_compare(Compare(result_key, None))],
                "success": [
                    {"request_put": put},
                    {"request_delete_range": {"key": enc(key)}},
                ],
                "failure": [{"request_range": {"key": enc(result_key)}}],
            }
            data = self._request("write", key, "/v3/kv/txn", body)
            if data.get("succeeded"):
                return True, None
            responses = data.get("responses") or [{}]
            return False, _record_or_none(_first_kv(responses[0]))

        return self._leases.leased(ttl, send)

    def create_unless_gone(
        self, key: str, value: str, ttl: int, gone_dir: str, as_of: int, seal_ttl: int
    ) -> tuple[Record | None, Record | None]:
        """One transaction: create ``key`` if it is absent and no key under
        ``gone_dir`` was written after revision ``as_of`` (a compare over the range);
        refused, read ``key``. A resend whose first try landed finds ``value``."""

        def send(lease: int) -> tuple[Record | None, Record | None]:
            put: dict[str, Any] = {"key": enc(key), "value": enc(value)}
            if lease:
                put["lease"] = str(lease)
            quiet = {**under(gone_dir), "target": "MOD", "result": "LESS"}
            quiet["mod_revision"] = str(as_of + 1)
            body = {
                "compare": [_compare(Compare(key, None)), quiet],
                "success": [{"request_put": put}],
                "failure": [{"request_range": {"key": enc(key)}}],
            }
            data = self._request("write", key, "/v3/kv/txn", body)
            at = header_revision(data)
            if data.get("succeeded"):
                return Record(key, value, at, at), None
            responses = data.get("responses") or [{}]
            found = _record_or_none(_first_kv(responses[0]))
            if found is not None and found.value == value:  # our first try landed
                return found, None
            return None, found

        return self._leases.leased(ttl, send)

    def reset(
        self, reset: Reset, hold: str, hold_ttl: int, still_quiet: Callable[[], bool]
    ) -> bool:
        """One transaction: the guard's ``mod_revision`` unchanged and no key under
        ``quiet`` newer than ``as_of`` (a compare over the range), then the deletes
        and the write. A resend whose first try landed is refused (the guard is gone):
        the caller reads the key it wrote."""
        del hold, hold_ttl, still_quiet  # the transaction holds nothing in between
        guard = reset.guard

        def send(lease: int) -> bool:
            put: dict[str, Any] = {"key": enc(reset.key), "value": enc(reset.value)}
            if lease:
                put["lease"] = str(lease)
            same = {
                "key": enc(guard.key),
                "target": "MOD",
                "result": "EQUAL",
                "mod_revision": str(guard.revision),
            }
            quiet = {
                **prefix_range(reset.quiet),
                "target": "MOD",
                "result": "LESS",
                "mod_revision": str(reset.as_of + 1),
            }
            deletes: list[dict[str, Any]] = [
                {"request_delete_range": {"key": enc(guard.key)}},
                {"request_delete_range": prefix_range(reset.quiet)},
            ]
            for directory in reset.drop:
                if not directory.startswith(reset.quiet):  # gone with the range above
                    deletes.append({"request_delete_range": {"key": enc(directory)}})
                    deletes.append({"request_delete_range": under(directory)})
            body = {"compare": [same, quiet], "success": [*deletes, {"request_put": put}]}
            data = self._request("write", guard.key, "/v3/kv/txn", body)
            return bool(data.get("succeeded"))

        return self._leases.leased(reset.ttl, send)

    def delete(self, key: str) -> bool:
        data = self._request("delete", key, "/v3/kv/deleterange", {"key": enc(key)})
        return int(data.get("deleted") or 0) > 0

    def delete_prefix(self, prefix: str) -> None:
        body = {
            "success": [
                {"request_delete_range": {"key": enc(prefix)}},
                {"request_delete_range": under(prefix)},
            ]
        }
        self._request("delete", prefix, "/v3/kv/txn", body)

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
        mod_revision = str(kvs[0].get("mod_revision"))

        def send(lease: int) -> bool:
            compare = {
                "key": enc(key),
                "target": "MOD",
                "result": "EQUAL",
                "mod_revision": mod_revision,
            }
            put = {"key": enc(key), "ignore_value": True, "lease": str(lease)}
            body = {"compare": [compare], "success": [{"request_put": put}]}
            # Repeatable: the compare fails if the first try landed, and the key then
            # exists with the lease, which is what was asked.
            return bool(self._request("refresh", key, "/v3/kv/txn", body).get("succeeded"))

        if self._leases.leased(ttl, send):
            return True
        current, _ = self.get(key)
        return current is not None

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
