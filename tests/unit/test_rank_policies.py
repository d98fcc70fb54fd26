"""Rank policies with plain data: ``node_group`` (ranks contiguous per group) and
``node_unit`` (the world size a multiple of it), in the settings, the records, the
decision table and the status."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import pytest

from etcd_rdzv import RendezvousParameters, _keys
from etcd_rdzv._kv import Record
from etcd_rdzv.config.params import ENV_NODE_GROUP, HandlerSettings, Settings
from etcd_rdzv.errors import RendezvousStateError
from etcd_rdzv.rendezvous import decisions as D
from etcd_rdzv.rendezvous import records
from etcd_rdzv.runs.status import RunStatus, read_status

from ._views import join_view, told

P = D.Participant
PREFIX, RUN = "/p", "run"


def _params(
    min_nodes: int = 4, max_nodes: int = 12, backend: str = "etcd-rdzv", **config: Any
) -> RendezvousParameters:
    return RendezvousParameters(backend, "127.0.0.1:2379", RUN, min_nodes, max_nodes, **config)


def _settings(params: RendezvousParameters, static: bool = False) -> HandlerSettings:
    return Settings.from_params(params, static=static).handler


# -- settings ---------------------------------------------------------------------------


def test_defaults_are_no_group_and_a_unit_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_NODE_GROUP, raising=False)
    s = _settings(_params())
    assert (s.node_group, s.node_unit) == (None, 1)


def test_the_group_comes_from_the_option_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_NODE_GROUP, "rack-7")
    assert _settings(_params()).node_group == "rack-7"
    assert _settings(_params(node_group="sw.2")).node_group == "sw.2"
    monkeypatch.setenv(ENV_NODE_GROUP, "   ")
    assert _settings(_params()).node_group is None


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"node_group": "rack 7"}, r"Option 'node_group' must be printable ASCII.*'rack 7'"),
        ({"node_group": "r\x1b[2J"}, r"'node_group' must be printable ASCII"),
        ({"node_group": "é"}, r"'node_group' must be printable ASCII.*'é'"),
        ({"node_group": "x" * 129}, r"'node_group' must be 1 to 128 characters"),
        ({"node_group": 7}, r"'node_group' must be a string, not int, got 7"),
        ({"node_unit": 0}, r"Option 'node_unit' must be a positive integer, got 0"),
        ({"node_unit": "four"}, r"'node_unit' must be an integer, got 'four'"),
        ({"node_unit": 13}, r"node_unit=13 with min_nodes=4, max_nodes=12"),
    ],
)
def test_bad_values_name_the_option_and_the_value(config: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _settings(_params(**config))


def test_a_unit_with_no_multiple_between_min_and_max_is_refused() -> None:
    # min 5 rounds up to 8, above max 7: no world could ever form.
    with pytest.raises(ValueError, match=r"node_unit=4 with min_nodes=5, max_nodes=7"):
        _settings(_params(5, 7, node_unit=4))
    assert _settings(_params(5, 8, node_unit=4)).node_unit == 4


def test_a_bad_group_in_the_environment_names_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_NODE_GROUP, "rack 7")
    with pytest.raises(ValueError, match=r"\$ETCD_RDZV_NODE_GROUP must be printable.*'rack 7'"):
        _settings(_params())


def test_the_static_handler_ignores_both_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ENV_NODE_GROUP, "rack-7")
    static = _params(3, 3, "etcd-rdzv-static", rank=1, node_group="a", node_unit=3)
    with caplog.at_level(logging.WARNING, logger="etcd_rdzv.config.params"):
        s = _settings(static, static=True)
    assert (s.rank, s.node_group, s.node_unit) == (1, None, 1)
    assert "'node_group', 'node_unit' are ignored by the static handler" in caplog.text
    # The environment alone (a cluster-wide default) is ignored quietly.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="etcd_rdzv.config.params"):
        s = _settings(_params(3, 3, "etcd-rdzv-static", rank=1), static=True)
    assert s.node_group is None and "ignored" not in caplog.text


def test_torchs_dynamic_handler_warns_that_it_reads_neither(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="etcd_rdzv.config.params"):
        Settings.from_params(_params(backend="etcd-rdzv-dynamic", node_unit=4))
    assert "'node_unit' are read by the native handler (etcd-rdzv) only" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="etcd_rdzv.config.params"):
        Settings.from_params(_params(node_unit=4))
    assert "native handler" not in caplog.text


# -- records ----------------------------------------------------------------------------


def _node_key(node: str, round_no: int = 1) -> str:
    return f"{_keys.rdzv_dir(PREFIX, RUN)}/r{round_no}/nodes/{_keys.b64_key(node)}"


def test_join_records_carry_the_group_strictly() -> None:
    key = _node_key("a")
    node = records.parse_node(Record(key, records.node_record("a", "ha", 3, group="rack-1"), 5))
    assert (node.group, node.prev_rank) == ("rack-1", 3)
    assert records.parse_node(Record(key, records.node_record("a", "ha", None), 5)).group is None
    for group in ("", "a b", 7, ["a"], "x" * 129, "\x1b]0;"):
        value = json.dumps({"id": "a", "addr": "ha", "group": group})
        with pytest.raises(RendezvousStateError, match=f"join key '{key}'.*group"):
            records.parse_node(Record(key, value, 5))


def test_results_carry_the_unit_strictly() -> None:
    key = f"{_keys.rdzv_dir(PREFIX, RUN)}/r1/result"
    text = records.result_record(("a", "b", "c", "d"), ("", "", "", ""), 3, 12, 4)
    assert records.parse_result(Record(key, text, 9)).node_unit == 4
    plain = records.result_record(("a",), ("",), 3, 12)
    assert "node_unit" not in json.loads(plain)
    assert records.parse_result(Record(key, plain, 9)).node_unit == 1
    for unit in (0, -1, True, "4", 10**12):
        bad = json.dumps({"members": ["a"], "max_nodes": 2, "node_unit": unit})
        with pytest.raises(RendezvousStateError, match="r1/result"):
            records.parse_result(Record(key, bad, 9))


# -- ranks by group ----------------------------------------------------------------------


def test_ranks_are_contiguous_per_group_whatever_the_arrival_order() -> None:
    # b arrives first and the groups interleave: a's block still comes first (by name).
    people = [P(f"{g}{i}", "h", 2 * i + (g == "a"), group=g) for i in range(4) for g in "ba"]
    ranks = D.assign_ranks(people, 8)
    assert ranks == ("a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3")


def test_nodes_without_a_group_come_after_the_groups() -> None:
    people = [P("x", "h", 1), P("b0", "h", 2, group="b"), P("a0", "h", 3, group="a")]
    assert D.assign_ranks(people, 3) == ("a0", "b0", "x")


def test_members_keep_their_ranks_while_their_group_keeps_its_place() -> None:
    first = D.assign_ranks(
        [P(f"{g}{i}", "h", 10 * i + ord(g), group=g) for g in "ab" for i in range(3)], 6
    )
    assert first == ("a0", "a1", "a2", "b0", "b1", "b2")
    # b1 died; a spare of group b (the oldest key of all) takes its place and its rank.
    members = [P(n, "h", 100 + r, prev_rank=r, group=n[0]) for r, n in enumerate(first)]
    spare = P("b9", "h", 1, group="b")
    again = D.assign_ranks([spare, *[m for m in members if m.node_id != "b1"]], 6)
    assert again == ("a0", "a1", "a2", "b0", "b9", "b2")
    # a1 died and the spare is of group b: a's block shrinks to ranks 0-1 (a2 moves
    # down), b's grows to 2-5: its members keep ranks 3-5, the spare takes rank 2.
    again = D.assign_ranks([spare, *[m for m in members if m.node_id != "a1"]], 6)
    assert again == ("a0", "a2", "b9", "b0", "b1", "b2")


def test_previous_members_come_first_with_groups_too() -> None:
    # The spare of group a arrived first, but the members (all of group b) get in.
    people = [P("a-spare", "h", 1, group="a")] + [
        P(f"b{i}", "h", 10 + i, prev_rank=i, group="b") for i in range(2)
    ]
    assert D.assign_ranks(people, 2) == ("b0", "b1")


def test_without_groups_ranks_are_as_before() -> None:
    # A member keeps its rank when it still exists; others fill free ranks by arrival.
    people = [P("new", "h", 1), P("m0", "h", 5, prev_rank=0), P("m2", "h", 6, prev_rank=2)]
    assert D.assign_ranks(people, 3) == ("m0", "new", "m2")


# -- world size by unit --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("min_nodes", "max_nodes", "unit", "bounds"),
    [(4, 12, 1, (4, 12)), (4, 12, 4, (4, 12)), (5, 14, 4, (8, 12)), (1, 3, 2, (2, 2))],
)
def test_unit_bounds(min_nodes: int, max_nodes: int, unit: int, bounds: tuple[int, int]) -> None:
    assert D.unit_bounds(min_nodes, max_nodes, unit) == bounds


def _view(count: int, **kw: Any) -> D.JoinView:
    """``count`` nodes n0.. in arrival order, n0 coordinating; min 4, max 12, unit 4."""
    nodes = tuple(P(f"n{i}", "h", i + 1) for i in range(count))
    kw = {"me": "n0", "min_nodes": 4, "max_nodes": 12, "node_unit": 4, **kw}
    return join_view(*nodes, **kw)


def test_after_the_last_call_the_world_is_rounded_down_to_a_unit() -> None:
    # 10 nodes, unit 4: a world of 8, the first 8 by arrival; 2 wait as spares.
    assert D.decide(_view(10, min_reached=95.0)) == D.Wait(125.0, D.Why.LAST_CALL)
    assert D.decide(_view(10, min_reached=60.0)) == D.Complete(tuple(f"n{i}" for i in range(8)))
    assert D.decide(_view(7, min_reached=60.0)) == D.Complete(tuple(f"n{i}" for i in range(4)))


def test_max_rounded_down_to_a_unit_completes_at_once() -> None:
    # max 14 with unit 4: 12 is the largest world, complete as soon as 12 are there.
    done = D.decide(_view(12, max_nodes=14))
    assert done == D.Complete(tuple(f"n{i}" for i in range(12)))
    assert D.decide(_view(11, max_nodes=14)) == D.Wait(700.0, D.Why.JOINED)
    assert D.decide(_view(13, max_nodes=14)) == done


def test_min_is_rounded_up_to_a_unit() -> None:
    # min 5 with unit 4 means 8: 7 nodes wait for more, even after a last call.
    assert D.decide(_view(7, min_nodes=5, min_reached=0.0)) == D.Wait(700.0, D.Why.JOINED)
    assert D.decide(_view(9, min_nodes=5, min_reached=0.0)) == D.Complete(
        tuple(f"n{i}" for i in range(8))
    )


def test_the_unit_keeps_previous_members_before_new_nodes() -> None:
    members = tuple(P(f"m{i}", "h", 100 + i, prev_rank=i) for i in range(4))
    new = tuple(P(f"n{i}", "h", i + 1) for i in range(3))
    v = _view(0, me="m0", participants=new + members, min_reached=0.0)
    assert D.decide(v) == D.Complete(("m0", "m1", "m2", "m3"))


@pytest.mark.parametrize(
    ("world_size", "max_nodes", "waiting", "missing", "unit", "expected"),
    [
        (8, 12, 2, 0, 4, 0),  # 10 would round down to 8 again: spares
        (8, 12, 3, 0, 4, 0),
        (8, 12, 4, 0, 4, 4),  # a whole unit more: a new round would have 12
        (8, 12, 9, 0, 4, 9),
        (12, 12, 4, 0, 4, 0),  # at max_nodes: spares
        (8, 11, 4, 0, 4, 0),  # 12 is above max 11: the world cannot grow
        (8, 12, 2, 1, 4, 3),  # a member is gone: everybody counts
        (8, 12, 0, 1, 4, 1),
        (2, 4, 1, 0, 1, 1),  # the unit of 1 is the rule as before
        (2, 2, 1, 0, 1, 0),
    ],
)
def test_waiting_nodes_count_only_when_a_unit_more_fits(
    world_size: int, max_nodes: int, waiting: int, missing: int, unit: int, expected: int
) -> None:
    assert D.nodes_waiting(world_size, max_nodes, waiting, missing, unit) == expected


def test_progress_speaks_of_the_unit() -> None:
    text = told(_view(3, min_nodes=5)).text
    assert text.startswith("3 of 8 node(s) joined (min 5, max 12, in units of 4)")
    spares = told(_view(2, prev_round_live=8)).text
    assert spares.startswith("2 spare node(s) wait") and "node_unit=4" in spares
    restart = told(_view(4, prev_round_live=8)).text
    assert "waiting for 8 member(s) of the previous round" in restart


# -- status ---------------------------------------------------------------------------------


def _round(
    members: Sequence[tuple[str, str | None]], waiting: Sequence[tuple[str, str | None]], unit: int
) -> RunStatus:
    rdzv = _keys.rdzv_dir(PREFIX, RUN)
    found = [
        Record(
            f"{rdzv}/r1/result",
            records.result_record(tuple(n for n, _ in members), ("",) * len(members), 1, 12, unit),
            50,
        )
    ]
    found += [
        Record(_node_key(n, 1), records.node_record(n, "h", None, group=g), 10 + i)
        for i, (n, g) in enumerate(members)
    ]
    found += [
        Record(_node_key(n, 2), records.node_record(n, "h", None, group=g), 60 + i)
        for i, (n, g) in enumerate(waiting)
    ]
    return read_status(found, PREFIX, RUN)


def test_status_marks_spares_by_the_unit_and_shows_groups() -> None:
    members = [(f"m{i}", "ab"[i // 4]) for i in range(8)]
    status = _round(members, [("s0", "b"), ("s1", None)], unit=4)
    assert [w.spare for w in status.waiting] == [True, True]
    assert [m.group for m in status.members] == ["a"] * 4 + ["b"] * 4
    assert [w.group for w in status.waiting] == ["b", None]
    data = status.to_json()
    assert data["members"][0]["group"] == "a" and data["waiting"][1]["group"] is None
    # Four waiting nodes would make a world of 12: not spares.
    more = _round(members, [(f"s{i}", None) for i in range(4)], unit=4)
    assert [w.spare for w in more.waiting] == [False] * 4
    # The same two with a unit of 1 would enlarge the world: not spares either.
    assert [w.spare for w in _round(members, [("s0", "b"), ("s1", None)], 1).waiting] == [
        False,
        False,
    ]
