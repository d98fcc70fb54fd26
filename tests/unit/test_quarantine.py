"""Quarantine without a server: its options, its records (untrusted input: one strict
parser that names the key) and that, off, it makes no request."""

from __future__ import annotations

import json
from typing import Any

import pytest

from etcd_rdzv import RendezvousParameters, _keys
from etcd_rdzv._kv import Record
from etcd_rdzv.admission.quarantine import (
    check_in,
    death_record,
    deaths_in,
    life_record,
    parse_death,
)
from etcd_rdzv.config.params import Settings
from etcd_rdzv.errors import RendezvousStateError

DIR = _keys.deaths_dir("/p", "job")


def P(**config: Any) -> RendezvousParameters:
    return RendezvousParameters("etcd-rdzv", "127.0.0.1:2379", "job", 1, 2, **config)


def _record(host: str, node: str, value: object) -> Record:
    text = value if isinstance(value, str) else json.dumps(value)
    return Record(f"{_keys.deaths_dir('/p', 'job', host)}/{_keys.b64_key(node)}", text, 5, 5)


def test_options_default_to_off_and_are_read() -> None:
    s = Settings.from_params(P()).handler
    assert (s.quarantine_deaths, s.quarantine_window, s.quarantine_time) == (None, 3600, 3600)
    s = Settings.from_params(
        P(quarantine_deaths="3", quarantine_window="600", quarantine_time="7200")
    ).handler
    assert (s.quarantine_deaths, s.quarantine_window, s.quarantine_time) == (3, 600, 7200)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("quarantine_deaths", "0"),
        ("quarantine_deaths", "two"),
        ("quarantine_window", "0"),
        ("quarantine_time", "-5"),
        ("quarantine_time", "1h"),
    ],
)
def test_bad_values_name_the_option_and_value(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=name) as info:
        Settings.from_params(P(**{name: value}))
    assert value in str(info.value)


def test_a_death_round_trips_and_keeps_when_its_agent_started() -> None:
    life = json.loads(life_record("gpu-07", "node-a"))
    value = json.loads(death_record("gpu-07", "node-a", life["started"]))
    got = parse_death(_record("gpu-07", "node-a", value), DIR)
    assert (got.host, got.node, got.started) == ("gpu-07", "node-a", life["started"])
    assert got.found and got.to_json()["found"] == got.found


@pytest.mark.parametrize(
    "value",
    [
        "not json",
        [1, 2],
        {"node": "node-a"},
        {"host": "gpu-07"},
        {"host": "gpu 07", "node": "node-a"},
        {"host": "gpu-07", "node": ""},
        {"host": "gpu-07", "node": "n" * 1025},
        {"host": "gpu-07", "node": "node-a", "started": 5},
        {"host": "gpu-07", "node": "node-a", "found": "t" * 65},
        {"host": "gpu-08", "node": "node-a"},  # another host's record under this key
    ],
)
def test_foreign_death_records_name_their_key(value: object) -> None:
    record = _record("gpu-07", "node-a", value)
    with pytest.raises(RendezvousStateError) as info:
        parse_death(record, DIR)
    assert record.key in str(info.value)


def test_status_lists_deaths_by_host_and_reports_bad_records() -> None:
    good = _record("b", "n1", json.loads(death_record("b", "n1", "")))
    other = _record("a", "n2", json.loads(death_record("a", "n2", "")))
    bad = _record("c", "n3", "{")
    elsewhere = Record("/p/job/rdzv/r1/nodes/x", "{}", 5, 5)
    problems: list[str] = []
    got = deaths_in([good, bad, other, elsewhere], "/p", "job", problems)
    assert [(d.host, d.node) for d in got] == [("a", "n2"), ("b", "n1")]
    assert len(problems) == 1 and bad.key in problems[0]


class _NoRequests:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"quarantine off made a request: {name}")


def test_off_it_makes_no_request() -> None:
    s = Settings.from_params(P(host_id="gpu-07")).handler
    assert check_in(_NoRequests(), s, "node-a") is None  # type: ignore[arg-type]
