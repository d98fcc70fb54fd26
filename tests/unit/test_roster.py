"""The slim announcement of large rounds without a server: rank buckets and the
announcement are untrusted input, each with one strict parser that names the key."""

from __future__ import annotations

import json

import pytest

from etcd_rdzv._kv import Record
from etcd_rdzv.errors import RendezvousStateError
from etcd_rdzv.rendezvous import records, roster
from etcd_rdzv.rendezvous.records import Outcome


def test_small_rounds_are_announced_whole_and_large_ones_in_buckets() -> None:
    assert roster.bucket_count(roster.SLIM_FROM - 1) == 0
    assert roster.bucket_count(roster.SLIM_FROM) == 1
    assert roster.bucket_count(4096) == 4096 // roster.BUCKET


def test_buckets_hold_every_member_once_with_its_rank() -> None:
    members = tuple(f"host{i}_abc" for i in range(1000))
    values = roster.bucket_values(members)
    count = len(values)
    assert count == roster.bucket_count(1000)
    seen: dict[str, int] = {}
    for b, value in enumerate(values):
        ranks = roster.parse_bucket(Record(f"/r/ranks/{b}", value, 5, 5), b, count, 1000)
        assert not seen.keys() & ranks.keys()
        seen.update(ranks)
    assert seen == {m: r for r, m in enumerate(members)}
    sizes = [len(json.loads(v)["ranks"]) for v in values]
    assert max(sizes) < 2 * roster.BUCKET  # spread about evenly


@pytest.mark.parametrize(
    "value",
    [
        "not json",
        "[]",
        '{"ranks": []}',
        '{"ranks": {"a": -1}}',
        '{"ranks": {"a": 300}}',  # beyond the world
        '{"ranks": {"a": true}}',
        '{"ranks": {"a": "1"}}',
        '{"ranks": {"": 1}}',
    ],
)
def test_foreign_buckets_name_their_key(value: str) -> None:
    record = Record("/r/ranks/0", value, 5, 5)
    with pytest.raises(RendezvousStateError, match="/r/ranks/0"):
        roster.parse_bucket(record, 0, 1, 300)


def test_a_member_in_the_wrong_bucket_is_refused() -> None:
    node = next(f"n{i}" for i in range(100) if roster.bucket_of(f"n{i}", 2) == 1)
    with pytest.raises(RendezvousStateError, match="does not belong"):
        roster.parse_bucket(Record("/r/ranks/0", json.dumps({"ranks": {node: 1}}), 5, 5), 0, 2, 9)


def _slim(value: object, revision: int = 50) -> Record:
    text = records.announcement("c", result=json.dumps({"slim": value}))
    return Record("/r/coord", text, revision, revision)


def test_a_slim_result_round_trips_in_an_announcement() -> None:
    whole = Outcome(("a", "b", "c"), ("h0", "h1", "h2"), 40, 8, node_unit=1)
    text = records.slim_record(whole, 2, "c")
    assert "members" not in text
    got = records.parse_result(Record("/r/result", text, 45, 45))
    assert (got.members, got.world, got.buckets, got.master, got.as_of, got.size, got.by) == (
        (),
        3,
        2,
        "h0",
        40,
        3,
        "c",
    )
    closed, announced = records.parse_announcement(_slim(json.loads(text)["slim"]))
    assert not closed and announced == got


@pytest.mark.parametrize(
    "value",
    [
        [],
        {"world": 0, "buckets": 1, "by": "c"},
        {"world": 5, "buckets": 0, "by": "c"},
        {"world": 5, "buckets": 6, "by": "c"},
        {"world": True, "buckets": 1, "by": "c"},
        {"world": 5, "buckets": 1, "master": 7, "by": "c"},
        {"world": 5, "buckets": 1, "by": ""},
        {"world": 5, "buckets": 1},
        {"world": 5, "buckets": 1, "by": "c", "as_of": 60},  # decided after it was written
        {"buckets": 1, "by": "c"},
    ],
)
def test_foreign_slim_results_name_their_key(value: object) -> None:
    with pytest.raises(RendezvousStateError, match="/r/coord"):
        records.parse_announcement(_slim(value))


def test_a_roster_reads_its_list_once_when_first_asked() -> None:
    reads: list[int] = []

    def read() -> Outcome:
        reads.append(1)
        return Outcome(("a", "b"), ("h0", "h1"), 1)

    lazy = roster.Roster(read=read)
    assert reads == []
    assert lazy.members == ("a", "b") and lazy.addrs == ("h0", "h1") and reads == [1]
    assert roster.Roster(("a",), ("h",)).members == ("a",)
