"""The records the native handler reads from etcd are untrusted: one parser, strict."""

from __future__ import annotations

import base64
import json
import zlib

import pytest

from etcd_rdzv import _keys
from etcd_rdzv._kv import Record
from etcd_rdzv.errors import RendezvousStateError
from etcd_rdzv.rendezvous import records

RDZV = _keys.rdzv_dir("/p", "job")


def _node(node: str, value: object, under: str | None = None) -> Record:
    key = _keys.node_key("/p", "job", 1, under or node)
    return Record(key, json.dumps(value), 7, 7)


def test_a_join_record_parses() -> None:
    p = records.parse_node(_node("a", {"id": "a", "addr": "h", "prev_rank": 2}))
    assert (p.node_id, p.addr, p.joined, p.prev_rank, p.host) == ("a", "h", 7, 2, None)
    written = records.node_record("a", "h", None, host="gpu-07")
    assert records.parse_node(_node("a", json.loads(written))).host == "gpu-07"


@pytest.mark.parametrize(
    "value",
    [
        "not json",
        {"addr": "h"},  # no id
        {"id": 5},
        {"id": ""},
        {"id": "a", "addr": 3},
        {"id": "a", "prev_rank": "0"},
        {"id": "a", "prev_rank": True},
        {"id": "a", "host": ""},
        {"id": "a", "host": "two words"},
        {"id": "a", "host": "a/b"},
        {"id": "a", "host": "x" * 254},
        {"id": "a", "host": 7},
        ["a"],
    ],
)
def test_foreign_join_records_name_their_key(value: object) -> None:
    record = _node("a", value)
    with pytest.raises(RendezvousStateError, match="does not hold a node record") as info:
        records.parse_node(record)
    assert record.key in str(info.value)


def test_a_join_record_under_another_nodes_key_is_refused() -> None:
    record = _node("b", {"id": "b", "addr": "h"}, under="a")
    with pytest.raises(RendezvousStateError, match="another node") as info:
        records.parse_node(record)
    assert record.key in str(info.value)


def _result(value: object, revision: int = 10) -> Record:
    return Record(_keys.result_key("/p", "job", 1), json.dumps(value), revision, revision)


def test_a_result_parses() -> None:
    out = records.parse_result(_result({"members": ["b", "a"], "addrs": ["x", "y"], "as_of": 9}))
    assert (out.members, out.addrs, out.as_of) == (("b", "a"), ("x", "y"), 9)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ({"members": ["N0", "N1", "N0"]}, "twice"),  # world size 3, a rank nobody takes
        ({"members": []}, "empty"),
        ({"members": ["a", ""]}, "empty"),
        ({"members": ["a"], "addrs": ["x", "y"]}, "length"),
        ({"members": ["a"], "as_of": 10}, "not before"),  # decided "at" its own write
        ({"members": ["a"], "as_of": 99}, "not before"),  # a revision in the future
        ({"members": ["a"], "as_of": -1}, "not before"),
        ({"members": ["a"], "as_of": "9"}, "revision"),
        ({"members": "a"}, "list"),
        ({"members": ["a", 3]}, "not a list of strings"),
        ({"members": ["a", ["b"]]}, "not a list of strings"),
        ({"members": ["a"], "addrs": [None]}, "not a list of strings"),
        ({"members": ["a" * 1025]}, "over 1024 characters"),
        ({"members": ["a", "b"], "addrs": ["x", "y" * 1025]}, "over 1024 characters"),
    ],
)
def test_forged_results_are_refused(value: object, why: str) -> None:
    record = _result(value)
    with pytest.raises(RendezvousStateError, match=why) as info:
        records.parse_result(record)
    assert record.key in str(info.value)


COORD = _keys.coord_key("/p", "job", 1)


def _packed(raw: bytes) -> Record:
    return Record(COORD, json.dumps({"id": "a", "packed": base64.b64encode(raw).decode()}), 5)


def test_an_announcement_carries_the_result_packed() -> None:
    members = [f"gpu-node-{i:04d}.cluster_{i * 7919:012x}" for i in range(1024)]
    addrs = [f"gpu-node-{i:04d}.cluster" for i in range(1024)]
    text = records.result_record(tuple(members), tuple(addrs), 3, 1024)
    record = Record(COORD, records.announcement("a", result=text), 5)
    closed, outcome = records.parse_announcement(record)
    assert not closed and outcome == records.parse_result(Record("/r", text, 5))
    assert "packed" in json.loads(record.value) and "result" not in json.loads(record.value)
    # What every waiting node's watch receives: a fraction of the result.
    assert len(record.value) < len(text) / 3, (len(record.value), len(text))


def test_an_unpacked_announcement_is_read_too() -> None:
    value = json.dumps({"id": "a", "result": {"members": ["b", "a"], "as_of": 3}})
    outcome = records.parse_announcement(Record(COORD, value, 5))[1]
    assert outcome is not None and outcome.members == ("b", "a")


def test_an_announcement_is_checked_like_a_result() -> None:
    good = Record(COORD, records.announcement("a", result='{"members": ["a"], "as_of": 3}'), 5)
    assert records.parse_announcement(good)[1] is not None
    for forged in (
        Record(COORD, json.dumps({"id": "a", "result": {"members": ["a", "a"]}}), 5),
        _packed(zlib.compress(b'{"members": ["a", "a"]}')),
    ):
        with pytest.raises(RendezvousStateError, match="twice") as info:
            records.parse_announcement(forged)
        assert COORD in str(info.value)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ({"id": "a", "packed": 7}, "not a string"),
        ({"id": "a", "packed": "%%%"}, "not base64"),
        ({"id": "a", "packed": base64.b64encode(b"not zlib").decode()}, "corrupt"),
        ({"id": "a", "packed": base64.b64encode(zlib.compress(b"[1]")[:-3]).decode()}, "whole"),
        ({"id": "a", "packed": base64.b64encode(zlib.compress(b"[1]") + b"x").decode()}, "whole"),
        ({"id": "a", "packed": base64.b64encode(zlib.compress(b"{nope")).decode()}, "corrupt"),
    ],
)
def test_forged_packed_announcements_are_refused(value: object, why: str) -> None:
    record = Record(COORD, json.dumps(value), 5)
    with pytest.raises(RendezvousStateError, match=why) as info:
        records.parse_announcement(record)
    assert COORD in str(info.value)


def test_a_packed_announcement_may_not_unpack_without_bound() -> None:
    # 40 MB of spaces packs into 40 KB: refused after 32 MiB, not unpacked whole.
    bomb = zlib.compress(b"[" + b" " * (40 * 2**20) + b"]", 9)
    assert len(bomb) < 64 * 1024
    with pytest.raises(RendezvousStateError, match="more than") as info:
        records.parse_announcement(_packed(bomb))
    assert COORD in str(info.value)


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (RDZV + "/r12/nodes/x", (12, "nodes/x")),
        (RDZV + "/r\u00b2/nodes/x", None),  # isdigit() says yes, int() says no
        (RDZV + "/r" + "9" * 5000 + "/nodes/x", None),
        (RDZV + "/r01/nodes/x", None),
        (RDZV + "/r0/nodes/x", None),
        (RDZV + "/r-1/nodes/x", None),
        (RDZV + "/round", None),
    ],
)
def test_round_numbers_are_ascii_and_bounded(key: str, expected: object) -> None:
    assert _keys.round_of(RDZV, key) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [("3", 3), (" 4\n", 4), ("\u00b2", None), ("9" * 5000, None), ("x", None)],
)
def test_the_round_hint_is_read_strictly(value: str, expected: int | None) -> None:
    assert records.hint_of(Record(RDZV + "/round", value, 1)) == expected
