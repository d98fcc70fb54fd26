"""A round's members as each member learns them: the whole list, or its own rank.

A small round's result holds its members and their addresses in rank order, and the
coordinator announces that result in its key, which every follower watches. That is
N entries sent to N followers: at N=4096, 96 KB to each, 394 MB in all, and 5 ms of
parsing per follower (``python3 -m benchmarks.announce``). So a round of
:data:`SLIM_FROM` members or more is **slim**: before it creates the result, its
coordinator writes the lists under its own *roster directory*
(:func:`etcd_rdzv._keys.roster_dir`, outside the ``rdzv`` directory that every
member watches): ``members`` (the whole result) and the *rank buckets* ``0``, ``1``,
..., each mapping the ids of about :data:`BUCKET` members, those whose CRC-32 modulo
the bucket count is ``b`` (:func:`bucket_of`), to their ranks. The result (and so the
announcement) then holds only the world size, the decision's revision, the bounds,
rank 0's address, the bucket count and whose roster directory it is
(:func:`.records.slim_record`). A follower reads its own bucket, one request of about
:data:`BUCKET` entries whatever N is, and finds its rank there or is not a member.
What each node receives is then bounded, and etcd's bytes grow as N.

A member of a slim round does not hold the member list: :class:`Roster` reads it
when first asked (``RendezvousResult.members``), and the member watcher asks
:class:`Membership` whether a key that went was a member's (reading the bucket it
would be in, once). Buckets are untrusted input: :func:`parse_bucket` is strict and
names the key; a bucket that is gone or unreadable sends the reader to the list.
"""

from __future__ import annotations

import json
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from .. import _keys
from .._kv import KV, Record
from ..errors import RendezvousStateError
from .records import META_TTL, Outcome, parse_result, result_record

__all__ = [
    "BUCKET",
    "SLIM_FROM",
    "Membership",
    "Roster",
    "bucket_count",
    "bucket_of",
    "bucket_values",
    "parse_bucket",
    "read_rank",
    "read_whole",
    "write_roster",
]

#: Rounds of at least this many members are announced slim (below it the whole
#: announcement is no larger than one bucket and a read).
SLIM_FROM = 256
#: Members per rank bucket, about.
BUCKET = 256
_MAX_ID = 1024  # characters in a node id (as records.py)


def bucket_count(world: int) -> int:
    """How many rank buckets a round of ``world`` members has (0: announced whole)."""
    return 0 if world < SLIM_FROM else -(-world // BUCKET)


def bucket_of(node_id: str, count: int) -> int:
    """The bucket of ``node_id`` among ``count``: the same on every node and version."""
    return zlib.crc32(node_id.encode("utf-8")) % count


def bucket_values(members: Sequence[str]) -> list[str]:
    """The values of the rank buckets of ``members`` (in rank order), bucket 0 first."""
    count = bucket_count(len(members))
    buckets: list[dict[str, int]] = [{} for _ in range(count)]
    for rank, node in enumerate(members):
        buckets[bucket_of(node, count)][node] = rank
    return [json.dumps({"ranks": b}, separators=(",", ":")) for b in buckets]


def write_roster(
    kv: KV, key_prefix: str, run_id: str, round_no: int, whole: Outcome, by: str
) -> int:
    """Write a large round's lists into ``by``'s roster directory: ``members`` (the
    whole result, as :func:`.records.result_record` writes it) and the rank buckets
    (TTL as the result's). Before the result exists: whoever reads the result finds
    them. Returns the bucket count.

    Raises:
        RendezvousConnectionError: a write failed (the round's result is then whole).
    """
    directory = _keys.roster_dir(key_prefix, run_id, round_no, by)
    assert whole.as_of is not None and whole.max_nodes is not None
    text = result_record(whole.members, whole.addrs, whole.as_of, whole.max_nodes, whole.node_unit)
    kv.put(f"{directory}/members", text, META_TTL)
    values = bucket_values(whole.members)
    for bucket, value in enumerate(values):
        kv.put(f"{directory}/{bucket}", value, META_TTL)
    return len(values)


def parse_bucket(record: Record, bucket: int, count: int, world: int) -> dict[str, int]:
    """Bucket ``bucket`` of ``count``: node id -> rank; RendezvousStateError naming the
    key if it is not one this package wrote for a world of ``world``."""
    try:
        data: Any = json.loads(record.value)
        ranks = data["ranks"]
        if not isinstance(ranks, dict):
            raise TypeError("ranks is not an object")
        for node, rank in ranks.items():
            if not node or len(node) > _MAX_ID or bucket_of(node, count) != bucket:
                raise TypeError(f"node {node[:80]!r} does not belong in this bucket")
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
                raise TypeError(f"rank {rank!r} is not a rank of a world of {world}")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RendezvousStateError(
            f"The rank bucket {record.key!r} is corrupt or foreign: {exc}"
        ) from exc
    return ranks


def _read(kv: KV, key: str, at: int | None) -> Record | None:
    """A roster key: as of revision ``at`` (the announcement's, which came after the
    roster was written: any member that has it answers, through an election too),
    or as it is now when that is not known."""
    record, _ = kv.get(key) if at is None else kv.get_at(key, at)
    return record


def _read_bucket(
    kv: KV,
    key_prefix: str,
    run_id: str,
    round_no: int,
    bucket: int,
    outcome: Outcome,
    at: int | None,
) -> dict[str, int] | None:
    """A bucket of a slim ``outcome``, or ``None`` when it is gone."""
    directory = _keys.roster_dir(key_prefix, run_id, round_no, outcome.by)
    record = _read(kv, f"{directory}/{bucket}", at)
    if record is None:
        return None
    return parse_bucket(record, bucket, outcome.buckets, outcome.world)


def read_whole(
    kv: KV, key_prefix: str, run_id: str, round_no: int, outcome: Outcome, at: int | None = None
) -> Outcome:
    """The whole result of a slim ``outcome`` (its lists), from its roster directory
    (as of revision ``at``, the announcement's, when known).

    Raises:
        RendezvousConnectionError: etcd did not answer.
        RendezvousStateError: the list is gone, unreadable, or not of that round.
    """
    key = f"{_keys.roster_dir(key_prefix, run_id, round_no, outcome.by)}/members"
    record = _read(kv, key, at)
    if record is None:
        raise RendezvousStateError(f"The member list {key!r} of round {round_no} is gone.")
    whole = parse_result(record)
    if whole.buckets or len(whole.members) != outcome.world or whole.as_of != outcome.as_of:
        raise RendezvousStateError(f"The member list {key!r} is not that of round {round_no}.")
    return whole


def read_rank(
    kv: KV,
    key_prefix: str,
    run_id: str,
    round_no: int,
    outcome: Outcome,
    node_id: str,
    at: int | None = None,
) -> tuple[int | None, Outcome]:
    """This node's rank in a slim ``outcome`` (``None``: not a member), read from its
    bucket (as of revision ``at``, the announcement's, when known); and the outcome
    to keep (the whole result, read instead, when the bucket is gone or unreadable).

    Raises:
        RendezvousConnectionError: etcd did not answer.
        RendezvousStateError: neither the bucket nor the list could be read.
    """
    bucket = bucket_of(node_id, outcome.buckets)
    try:
        ranks = _read_bucket(kv, key_prefix, run_id, round_no, bucket, outcome, at)
    except RendezvousStateError:
        ranks = None
    if ranks is not None:
        return ranks.get(node_id), outcome
    whole = read_whole(kv, key_prefix, run_id, round_no, outcome, at)
    return (whole.members.index(node_id) if node_id in whole.members else None), whole


class Roster:
    """A round's members and their addresses, in rank order: given, or read from the
    round's result key when first asked (a member of a slim round)."""

    def __init__(
        self,
        members: tuple[str, ...] | None = None,
        addrs: tuple[str, ...] | None = None,
        read: Callable[[], Outcome] | None = None,
    ) -> None:
        assert (members is None) != (read is None)
        self._members, self._addrs, self._read = members, addrs, read
        self._lock = threading.Lock()

    @classmethod
    def of(
        cls,
        kv: KV,
        key_prefix: str,
        run_id: str,
        round_no: int,
        outcome: Outcome,
        at: int | None = None,
    ) -> Roster:
        """The roster of ``outcome``: its lists, or (slim) a read of them (as of
        revision ``at``, the announcement's, when known)."""
        if not outcome.buckets:
            return cls(outcome.members, outcome.addrs)
        return cls(read=lambda: read_whole(kv, key_prefix, run_id, round_no, outcome, at))

    def _load(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        with self._lock:
            if self._members is None:
                assert self._read is not None
                outcome = self._read()
                self._members, self._addrs = outcome.members, outcome.addrs
            return self._members, self._addrs or ("",) * len(self._members)

    @property
    def members(self) -> tuple[str, ...]:
        """Node ids in rank order (a slim round's: read from etcd on first use, which
        may raise RendezvousConnectionError or RendezvousStateError)."""
        return self._load()[0]

    @property
    def addrs(self) -> tuple[str, ...]:
        """Their addresses, in rank order (read as :attr:`members`)."""
        return self._load()[1]


class Membership:
    """Whether a join key of the round (by its name, ``base64(node id)``) is a
    member's: from the member list, or (slim) from the bucket the node would be in,
    each bucket read once. Used by the member watcher's thread only."""

    def __init__(
        self,
        world: int,
        members: tuple[str, ...] | None,
        read_bucket: Callable[[int], dict[str, int] | None] | None = None,
        buckets: int = 0,
        read_all: Callable[[], Outcome] | None = None,
    ) -> None:
        self.world = world
        self._names = None if members is None else frozenset(_keys.b64_key(m) for m in members)
        self._read_bucket, self._buckets, self._read_all = read_bucket, buckets, read_all
        self._known: dict[int, dict[str, int]] = {}

    @classmethod
    def of(
        cls,
        kv: KV,
        key_prefix: str,
        run_id: str,
        round_no: int,
        outcome: Outcome,
        at: int | None = None,
    ) -> Membership:
        if not outcome.buckets:
            return cls(len(outcome.members), outcome.members)

        def bucket(b: int) -> dict[str, int] | None:
            return _read_bucket(kv, key_prefix, run_id, round_no, b, outcome, at)

        def whole() -> Outcome:
            return read_whole(kv, key_prefix, run_id, round_no, outcome, at)

        return cls(outcome.world, None, bucket, outcome.buckets, whole)

    @property
    def names(self) -> frozenset[str] | None:
        """The members' key names, when the whole list is known here."""
        return self._names

    def contains(self, name: str) -> bool:
        """Whether the join key named ``name`` is a member's.

        Raises:
            RendezvousConnectionError: etcd did not answer (ask again).
            RendezvousStateError: neither the bucket nor the result could be read.
        """
        if self._names is not None:
            return name in self._names
        node = _keys.b64_text(name)
        if node is None:
            return False
        bucket = bucket_of(node, self._buckets)
        ranks = self._known.get(bucket)
        if ranks is None:
            assert self._read_bucket is not None and self._read_all is not None
            try:
                found = self._read_bucket(bucket)
            except RendezvousStateError:
                found = None
            if found is None:  # gone or unreadable: the whole list, once
                self._names = frozenset(_keys.b64_key(m) for m in self._read_all().members)
                return name in self._names
            ranks = self._known[bucket] = found
        return node in ranks
