"""The static handler's decisions (each node brings its rank), with plain data."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from etcd_rdzv._kv import Record
from etcd_rdzv.errors import RendezvousStateError
from etcd_rdzv.rendezvous import decisions as D
from etcd_rdzv.rendezvous import records

from ._views import join_view

P = D.Participant
TTL = 3.0


def static(*participants: P, **kw: Any) -> D.JoinView:
    """A static round of 3 (ranks 0..2) that ``participants`` joined, a coordinating."""
    kw = {"min_nodes": 3, "max_nodes": 3, "static": True, "node_ttl": TTL, **kw}
    return join_view(participants=participants, **kw)


A, B, C = P("a", "ha", 1, rank=2), P("b", "hb", 2, rank=0), P("c", "hc", 3, rank=1)


def test_complete_when_every_rank_is_there_in_rank_order() -> None:
    assert D.decide(static(A, B, C)) == D.Complete(("b", "c", "a"))


def test_no_last_call_below_max_nodes() -> None:
    # min_nodes does not shrink a static world: two of three ranks wait, however long
    view = static(A, B, min_nodes=1, min_reached=0.0, last_call_timeout=0.0)
    assert D.decide(view) == D.Wait(700.0, D.Why.RANKS)


def test_waits_for_the_previous_group_to_leave() -> None:
    assert D.decide(static(A, B, C, prev_round_live=1)) == D.Wait(700.0, D.Why.PREVIOUS)


def test_a_rank_claimed_twice_waits_one_ttl_then_fails_naming_rank_and_nodes() -> None:
    twin = P("z", "hz", 4, rank=2)
    first = D.decide(static(A, B, C, twin, conflict_since=None))
    assert first == D.Wait(100.0 + TTL + D.CONFLICT_SLACK, D.Why.CONFLICT)
    # still there (not yet a TTL): wait on
    assert isinstance(D.decide(static(A, B, C, twin, conflict_since=99.0)), D.Wait)
    failed = D.decide(static(A, B, C, twin, conflict_since=100.0 - TTL - D.CONFLICT_SLACK))
    assert isinstance(failed, D.Fail)
    assert "Rank 2" in failed.reason and "'a' at ha" in failed.reason
    assert "'z' at hz" in failed.reason
    assert set(failed.nodes) == {"a", "b", "c", "z"}


def test_a_rank_held_by_a_live_member_of_the_previous_round_is_a_conflict() -> None:
    # z runs round N with rank 2 and stays; a (rank 2 as well) waits in round N+1
    view = static(A, prev=(P("z", "hz", 0, rank=2),), prev_round_live=1)
    assert isinstance(D.decide(view), D.Wait)
    view = replace(view, conflict_since=view.now - TTL - D.CONFLICT_SLACK)
    failed = D.decide(view)
    assert isinstance(failed, D.Fail) and "Rank 2" in failed.reason
    # the same node in both rounds (it moved on, its old key not yet deleted) is no conflict
    assert D.rank_conflicts([A], [replace(A, joined=0)]) == {}


def test_rank_outside_the_world_or_missing_fails_at_once() -> None:
    out = D.decide(static(A, P("q", "hq", 5, rank=3)))
    assert isinstance(out, D.Fail) and "rank 3, outside 0..2" in out.reason
    native = D.decide(static(A, P("n", "hn", 5)))
    assert isinstance(native, D.Fail) and "without a rank" in native.reason


def test_a_fault_result_fails_its_nodes_and_sends_later_ones_on() -> None:
    assert D.decide(static(A, result=("a", "z"), failed="why")) == D.Failed("why")
    assert D.decide(static(A, me="a", result=("z",), failed="why")) == D.NextRound()
    follower = D.FollowView(
        me="a", closed=False, result=("a",), coordinated=True, now=1.0, deadline=9.0, failed="x"
    )
    assert D.follow(follower) == D.Failed("x")


def test_describe_ranks() -> None:
    text = D.describe_ranks([A, B], 3)
    assert text == "rank(s) present: 0 (node 'b' at hb), 2 (node 'a' at ha); missing: 1"


def _record(value: object, key: str = "/p/run/rdzv/r1/result", revision: int = 9) -> Record:
    return Record(key, json.dumps(value), revision)


def test_fault_records_round_trip_and_are_parsed_strictly() -> None:
    outcome = records.parse_result(_record(json.loads(records.fault_record("why", ("a", "b")))))
    assert (outcome.error, outcome.members) == ("why", ("a", "b"))
    for bad in ({"error": "", "members": ["a"]}, {"error": 3, "members": []}, {"error": "x"}):
        with pytest.raises(RendezvousStateError, match="r1/result"):
            records.parse_result(_record(bad))


def test_join_records_carry_the_static_rank_strictly() -> None:
    from etcd_rdzv import _keys

    key = "/p/run/rdzv/r1/nodes/" + _keys.b64_key("a")
    node = records.parse_node(Record(key, records.node_record("a", "ha", None, 2), 5))
    assert node.rank == 2
    for rank in (-1, True, "2", 10**12):
        with pytest.raises(RendezvousStateError, match="nodes"):
            records.parse_node(Record(key, json.dumps({"id": "a", "rank": rank}), 5))


def _p(backend: str = "etcd-rdzv-static", max_nodes: int = 4, **config: object) -> object:
    from etcd_rdzv import RendezvousParameters

    return RendezvousParameters(backend, "127.0.0.1:2379", "run", max_nodes, max_nodes, **config)


def test_static_rank_comes_from_the_option_first_then_the_schedulers_variables() -> None:
    from etcd_rdzv.config.params import static_rank

    env = {"SLURM_NODEID": "1", "JOB_COMPLETION_INDEX": "2", "GROUP_RANK": "3", "NODE_RANK": "0"}
    assert static_rank(_p(rank="0"), env) == (0, "option rank")  # type: ignore[arg-type]
    assert static_rank(_p(), env) == (1, "$SLURM_NODEID")  # type: ignore[arg-type]
    del env["SLURM_NODEID"]
    assert static_rank(_p(), env) == (2, "$JOB_COMPLETION_INDEX")  # type: ignore[arg-type]
    del env["JOB_COMPLETION_INDEX"]
    assert static_rank(_p(), env) == (3, "$GROUP_RANK")  # type: ignore[arg-type]
    del env["GROUP_RANK"]
    assert static_rank(_p(), env) == (0, "$NODE_RANK")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("config", "env", "message"),
    [
        ({}, {}, "needs this node's rank"),
        ({"rank": "4"}, {}, r"option rank must be an integer in 0\.\.3.*got '4'"),
        ({"rank": "-1"}, {}, "got '-1'"),
        ({"rank": "one"}, {}, "got 'one'"),
        ({}, {"SLURM_NODEID": "7"}, r"\$SLURM_NODEID must be .* got '7'"),
    ],
)
def test_a_missing_or_bad_static_rank_is_a_clear_error(
    config: dict[str, object], env: dict[str, str], message: str
) -> None:
    from etcd_rdzv.config.params import static_rank

    with pytest.raises(ValueError, match=message):
        static_rank(_p(**config), env)  # type: ignore[arg-type]


def test_create_handler_builds_the_static_handler_for_its_backend_name() -> None:
    from etcd_rdzv.config.params import Settings

    static = Settings.from_params(_p(rank=2))  # type: ignore[arg-type]
    assert static.handler.rank == 2
    native = Settings.from_params(_p(backend="etcd-rdzv"))  # type: ignore[arg-type]
    assert native.handler.rank is None
    with pytest.raises(ValueError, match="rank"):
        Settings.from_params(_p(rank=9))  # type: ignore[arg-type]
