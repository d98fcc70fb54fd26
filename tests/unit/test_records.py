"""The records the native handler reads from etcd are untrusted: one parser, strict."""

from __future__ import annotations

import json

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
    assert (p.node_id, p.addr, p.joined, p.prev_rank) == ("a", "h", 7, 2)


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
    ],
)
def test_forged_results_are_refused(value: object, why: str) -> None:
    record = _result(value)
    with pytest.raises(RendezvousStateError, match=why) as info:
        records.parse_result(record)
    assert record.key in str(info.value)


def test_an_announcement_is_checked_like_a_result() -> None:
    key = _keys.coord_key("/p", "job", 1)
    good = Record(key, records.announcement("a", result='{"members": ["a"], "as_of": 3}'), 5)
    assert records.parse_announcement(good)[1] is not None
    forged = Record(key, json.dumps({"id": "a", "result": {"members": ["a", "a"]}}), 5)
    with pytest.raises(RendezvousStateError, match=key):
        records.parse_announcement(forged)


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
