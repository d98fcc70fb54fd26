"""The exclusion records are untrusted input: one strict parser, names the key."""

from __future__ import annotations

import json

import pytest

from etcd_rdzv import _keys
from etcd_rdzv._kv import Record
from etcd_rdzv.admission.hosts import exclusion_record, host_of_key, parse_exclusion
from etcd_rdzv.errors import RendezvousStateError

DIR = _keys.excluded_dir("/p", "job")


def _record(host: str, value: object) -> Record:
    text = value if isinstance(value, str) else json.dumps(value)
    return Record(_keys.excluded_key("/p", "job", host), text, 5, 5)


def test_an_exclusion_round_trips() -> None:
    record = _record("gpu-07", json.loads(exclusion_record("gpu-07", "Xid 79", "operator", 600)))
    got = parse_exclusion(record, DIR)
    assert (got.host, got.reason, got.by, got.seconds) == ("gpu-07", "Xid 79", "operator", 600)
    assert host_of_key(DIR, record.key) == "gpu-07"


@pytest.mark.parametrize(
    "value",
    [
        "not json",
        {"reason": "no host"},
        {"host": "gpu-07", "by": "someone"},
        {"host": "gpu-07", "reason": 5},
        {"host": "gpu-07", "reason": "x" * 513},
        {"host": "gpu-07", "for": 0},
        {"host": "gpu-07", "for": True},
        {"host": "gpu-07", "at": ["t"]},
        {"host": "gpu-08"},  # another host's record under this key
    ],
)
def test_foreign_exclusion_records_name_their_key(value: object) -> None:
    record = _record("gpu-07", value)
    with pytest.raises(RendezvousStateError) as info:
        parse_exclusion(record, DIR)
    assert record.key in str(info.value)


@pytest.mark.parametrize("name", ["", "not base64!", "YSBi", DIR + "/x"])
def test_keys_that_name_no_host_are_not_exclusions(name: str) -> None:
    # "YSBi" is "a b": not a host id. Nor is anything below an exclusion key.
    assert host_of_key(DIR, f"{DIR}/{name}") is None
    assert host_of_key(DIR, "/p/job/rdzv/round") is None
