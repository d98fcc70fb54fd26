"""The native handler (``etcd_rdzv.create_handler``) on a real etcd, every node a process.

Each node is a process of :class:`fleet.Fleet` (kind ``ours`` or
``ours-torch``): it builds its handler, then obeys commands (``join``, ``close``,
``status``, ``shutdown``) and reports events (``ready``, ``key-written``, ``round``,
``waiting``, ``error``, ...). Nodes are started first and told to ``join`` together
once all of them are ready, so the slow part (imports) never staggers the joins.
Every wait here has a deadline; a failed wait shows every node's output; every node
is killed when its test ends, and kills itself after ``max_life`` seconds should the
test process die.

With torch installed, ``ours-torch`` nodes build torch's flavour of the handler
(``create_handler(params, use_torch=True)``: ``next_rendezvous()`` returns torch's
``RendezvousInfo``, errors are also torch's).
The tests where that matters (return type, error types, round 2 with rank 0's
bootstrap store) run it; the others hide torch from their nodes (kind ``ours``),
which covers the torch-free path and saves the 2 s torch import of each process.

Every test runs twice, on the etcd v2 API and on the v3 API (the ``etcd_api_params``
fixture; v3 runs on a member without the v2 API). Timings are small (last call 2 s,
heartbeat every 1 s, a node counts as dead after 2 missed beats) so each API's run
takes well under a minute. Event times (``t``) are the
nodes' ``time.monotonic()``, one machine-wide clock on Linux and macOS, so they are
compared with the test's own.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from etcd_rdzv import RendezvousParameters, RendezvousResult
from etcd_rdzv.testing import EtcdServer
from etcd_rdzv.testing.pytest_plugin import variant_server_options
from fleet import Event, Fleet, Node

KEEP_ALIVE_INTERVAL = 1
KEEP_ALIVE_MAX_ATTEMPT = 2
READY_TIMEOUT = 45.0  # importing torch in several processes at once on 2 cores
NODE_MAX_LIFE = 120.0  # a node exits on its own after this long
POLL = 0.05  # seconds between a node's num_nodes_waiting() calls ("waiting" events)

OURS = "etcd_rdzv.errors."
TORCH_API = "torch.distributed.elastic.rendezvous.api."
TORCH_INFO = TORCH_API + "RendezvousInfo"
PLAIN_INFO = f"{RendezvousResult.__module__}.{RendezvousResult.__qualname__}"
TORCH_INSTALLED = importlib.util.find_spec("torch") is not None


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with Fleet(tmp_path, max_life=NODE_MAX_LIFE) as nodes:
        yield nodes


def _start(fleet: Fleet, name: str, params: RendezvousParameters, use_torch: bool = True) -> Node:
    """Start a node; ``use_torch=False`` hides torch from it (the torch-free path)."""
    return fleet.start(name, params, kind="ours-torch" if use_torch else "ours", poll=POLL)


def _ready(fleet: Fleet) -> None:
    """Wait until every node built its handler; check it has the flavour it should."""
    fleet.ready(timeout=READY_TIMEOUT)
    for node in fleet.nodes:
        active = _torch_active(node)
        use_torch = node.kind == "ours-torch"
        fleet.check(
            active == (use_torch and TORCH_INSTALLED),
            f"node {node.name}: torch integration active={active}, "
            f"use_torch={use_torch}, torch installed={TORCH_INSTALLED}",
        )


def _join(nodes: list[Node]) -> None:
    for node in nodes:
        node.join()


def _rendezvous(fleet: Fleet, nodes: list[Node], timeout: float, round_no: int = 1) -> list[Event]:
    """Each node's ``round`` event of ``round_no``, within one deadline."""
    return fleet.wait_each(nodes, "round", timeout, match=lambda e: e["round"] == round_no)


@pytest.fixture
def rdzv_params(
    etcd_api_params: Callable[..., RendezvousParameters],
) -> Callable[..., RendezvousParameters]:
    """``rdzv_params(run_id, min_nodes=..., max_nodes=..., **options)`` with fast timings,
    for the etcd API the test runs on (every test here runs on v2 and on v3)."""

    def make(run_id: str = "run", **config: Any) -> RendezvousParameters:
        config.setdefault("backend", "etcd-rdzv")
        config.setdefault("last_call_timeout", 2)
        config.setdefault("keep_alive_interval", KEEP_ALIVE_INTERVAL)
        config.setdefault("keep_alive_max_attempt", KEEP_ALIVE_MAX_ATTEMPT)
        config.setdefault("join_timeout", 30)
        config.setdefault("read_timeout", 10)
        return etcd_api_params(run_id, **config)

    return make


def _completed(nodes: list[Node], count: int) -> list[Node] | None:
    """The nodes that completed a round, once there are ``count`` of them."""
    done = [n for n in nodes if n.events("round")]
    return done if len(done) >= count else None


def _torch_active(node: Node) -> bool:
    return bool(node.events("ready")[0]["torch"])


def _assert_consistent(fleet: Fleet, results: list[Event], world_size: int) -> tuple[str, ...]:
    """Every result agrees on the members; ranks are 0..world_size-1; each rank is its own."""
    members = {tuple(r["members"]) for r in results}
    fleet.check(len(members) == 1, f"members differ between nodes: {members}")
    (agreed,) = members
    fleet.check(
        all(r["world_size"] == world_size for r in results)
        and sorted(r["rank"] for r in results) == list(range(world_size))
        and len(agreed) == world_size,
        f"expected world size {world_size} and ranks 0..{world_size - 1}: {results}",
    )
    fleet.check(
        all(agreed[r["rank"]] == r["node_id"] for r in results),
        f"a node's rank is not its index in the member list: {results}",
    )
    for r in results:
        expected = TORCH_INFO if r["torch"] else PLAIN_INFO
        fleet.check(r["info_type"] == expected, f"next_rendezvous() returned {r['info_type']}")
    return agreed


def test_three_nodes_complete_after_the_last_call(
    fleet: Fleet, rdzv_params: Callable[..., RendezvousParameters]
) -> None:
    params = rdzv_params(min_nodes=2, max_nodes=4, last_call_timeout=2)
    group = [_start(fleet, f"n{i}", params) for i in range(3)]
    _ready(fleet)
    _join(group)
    results = _rendezvous(fleet, group, timeout=20)

    members = _assert_consistent(fleet, results, world_size=3)
    fleet.check(set(members) == {n.node_id for n in group}, f"wrong members {members}")
    fleet.check({r["round"] for r in results} == {1}, f"not round 1: {results}")
    elapsed = [round(r["elapsed"], 2) for r in results]
    print(f"completion times (s) with last_call_timeout=2: {elapsed}")
    # Below max_nodes the round waits for the last call (not complete at min_nodes) ...
    fleet.check(max(elapsed) >= 1.8, f"completed before the last call ended: {elapsed}")
    # ... and not much longer: the coordinator completes the round as soon as the last
    # call ends (no grace period follows it), so the rest is slack for the joins, the
    # result reaching the other nodes and a busy machine.
    fleet.check(max(elapsed) <= 2 + 5, f"completed too late: {elapsed}")


def test_max_nodes_completes_at_once_and_the_extra_node_waits(
    fleet: Fleet, rdzv_params: Callable[..., RendezvousParameters]
) -> None:
    # min_nodes=1: the fifth node alone would be enough for a round of its own.
    last_call = 2
    params = rdzv_params(min_nodes=1, max_nodes=4, last_call_timeout=last_call)
    group = [_start(fleet, f"n{i}", params, use_torch=False) for i in range(5)]
    _ready(fleet)
    _join(group)

    done = fleet.wait_until("four nodes completing", lambda: _completed(group, 4), 10, alive=group)
    results = [n.events("round")[0] for n in done]
    members = _assert_consistent(fleet, results, world_size=4)
    (extra,) = (n for n in group if n not in done)
    fleet.check(extra.node_id not in members, f"the fifth node is a member: {members}")
    elapsed = [round(r["elapsed"], 2) for r in results]
    print(f"completion times (s) at max_nodes=4: {elapsed}")
    # At once when max_nodes joined: no last call.
    fleet.check(max(elapsed) < last_call - 0.5, f"max_nodes waited for the last call: {elapsed}")

    # The fifth waits in the next round as a spare: the group is at max_nodes, so no
    # member counts it (a restart could not take it in).
    waits_from = fleet.wait(extra, "key-written", 10, lambda e: e["round"] == 2)["t"]
    # Exclusivity: while round 1 runs the fifth never completes a round of its own,
    # though it alone meets min_nodes. Watch it for longer than such a round would take
    # to form (its last call, which no grace period follows) plus 2.5 s slack: a
    # bounded look for something that must not happen.
    window_end = waits_from + last_call + 2.5
    while time.monotonic() < window_end:
        fleet.check(
            extra.alive and not extra.events("round") and not extra.events("error"),
            "the fifth node should still be waiting",
        )
        time.sleep(0.05)
    for node in done:
        waiting = fleet.request(node, "status")["waiting"]
        fleet.check(waiting == 0, f"a member counts the spare: num_nodes_waiting()={waiting}")


def test_node_killed_before_completion_is_dropped(
    fleet: Fleet, rdzv_params: Callable[..., RendezvousParameters]
) -> None:
    # The last call (5 s) outlasts the victim's key (2 s TTL after its last beat).
    params = rdzv_params(min_nodes=2, max_nodes=4, last_call_timeout=5)
    group = [_start(fleet, f"n{i}", params, use_torch=False) for i in range(3)]
    _ready(fleet)
    _join(group)
    for node in group:
        fleet.wait(node, "key-written", 10, lambda e: e["round"] == 1)
    victim, survivors = group[2], group[:2]
    fleet.check(not victim.events("round"), "the victim completed before it was killed")
    killed_at = victim.kill()

    results = _rendezvous(fleet, survivors, timeout=20)
    members = _assert_consistent(fleet, results, world_size=2)
    fleet.check(victim.node_id not in members, f"the killed node is a member: {members}")
    print(
        "survivors completed without the killed node "
        f"{[round(r['t'] - killed_at, 2) for r in results]} s after the kill"
    )


def test_member_killed_after_completion_is_detected(
    fleet: Fleet, rdzv_params: Callable[..., RendezvousParameters]
) -> None:
    params = rdzv_params(min_nodes=3, max_nodes=3)
    group = [_start(fleet, f"n{i}", params, use_torch=False) for i in range(3)]
    _ready(fleet)
    _join(group)
    _assert_consistent(fleet, _rendezvous(fleet, group, timeout=15), world_size=3)
    victim, survivors = group[0], group[1:]
    for node in survivors:  # nothing waiting yet
        fleet.check(
            fleet.request(node, "status")["waiting"] == 0, "num_nodes_waiting() > 0 before the kill"
        )

    killed_at = victim.kill()
    bound = KEEP_ALIVE_INTERVAL * KEEP_ALIVE_MAX_ATTEMPT + 3
    detected = [
        fleet.wait(node, "waiting", bound + 10, lambda e: e["n"] >= 1 and e["t"] > killed_at)
        for node in survivors
    ]
    times = [round(e["t"] - killed_at, 2) for e in detected]
    print(f"dead member detected after {times} s (bound {bound} s, node TTL 2 s)")
    fleet.check(max(times) <= bound, f"detection took {times} s, more than {bound} s")


def test_set_closed_is_seen_by_all_and_refuses_new_nodes(
    fleet: Fleet, rdzv_params: Callable[..., RendezvousParameters]
) -> None:
    params = rdzv_params(min_nodes=2, max_nodes=2)
    a, b, late = (_start(fleet, name, params) for name in ("a", "b", "late"))
    _ready(fleet)
    _join([a, b])
    _assert_consistent(fleet, _rendezvous(fleet, [a, b], timeout=15), world_size=2)
    fleet.check(not fleet.request(b, "status")["is_closed"], "closed before set_closed()")

    fleet.request(a, "close", "closed")
    fleet.check(fleet.request(b, "status")["is_closed"], "b does not see the run closed")
    fleet.check(
        fleet.request(late, "status")["is_closed"], "a new node does not see the run closed"
    )

    _join([late])
    error = fleet.wait(late, "error", 10)
    fleet.check(
        OURS + "RendezvousClosedError" in error["kinds"], f"not RendezvousClosedError: {error}"
    )
    if _torch_active(late):
        fleet.check(TORCH_API + "RendezvousClosedError" in error["kinds"], f"not torch's: {error}")
    print(f"closed error after {error['elapsed']:.2f} s")


def test_join_timeout(fleet: Fleet, rdzv_params: Callable[..., RendezvousParameters]) -> None:
    params = rdzv_params(min_nodes=2, max_nodes=2, join_timeout=2)
    (alone,) = [_start(fleet, "alone", params)]
    _ready(fleet)
    _join([alone])
    error = fleet.wait(alone, "error", 2 + 10)
    fleet.check(
        OURS + "RendezvousTimeoutError" in error["kinds"], f"not RendezvousTimeoutError: {error}"
    )
    if _torch_active(alone):
        fleet.check(TORCH_API + "RendezvousTimeoutError" in error["kinds"], f"not torch's: {error}")
    print(f"join timeout (2 s) raised after {error['elapsed']:.2f} s")
    fleet.check(1.9 <= error["elapsed"] <= 2 + 3, f"timed out after {error['elapsed']:.2f} s")


def test_second_round_with_changed_membership_keeps_ranks(
    fleet: Fleet, rdzv_params: Callable[..., RendezvousParameters]
) -> None:
    params = rdzv_params(min_nodes=3, max_nodes=3)
    first = [_start(fleet, f"n{i}", params) for i in range(3)]
    newcomer = _start(fleet, "new", params)
    _ready(fleet)
    _join(first)
    round1 = {r["node_id"]: r for r in _rendezvous(fleet, first, timeout=15)}
    _assert_consistent(fleet, list(round1.values()), world_size=3)

    # The rank 1 member leaves; the others (ranks 0 and 2) see it gone.
    leaver = next(n for n in first if round1[n.node_id]["rank"] == 1)
    # Highest rank first: ranks by arrival alone would then differ from the old ones.
    survivors = sorted(
        (n for n in first if n is not leaver), key=lambda n: -round1[n.node_id]["rank"]
    )
    fleet.check(fleet.request(leaver, "shutdown")["ok"], "shutdown() of the leaver failed")
    for node in survivors:
        fleet.wait(node, "waiting", 10, lambda e: e["n"] >= 1)

    # A new node joins and waits for round 2 while round 1 still runs.
    _join([newcomer])
    fleet.wait(newcomer, "key-written", 10, lambda e: e["round"] == 2)
    fleet.check(not newcomer.events("round"), "round 2 formed while round 1 still ran")

    # The survivors re-rendezvous: round 2 is the survivors and the new node.
    for node in survivors:
        node.join()
        fleet.wait(node, "key-written", 10, lambda e: e["round"] == 2)
    group = [*survivors, newcomer]
    round2 = {r["node_id"]: r for r in _rendezvous(fleet, group, timeout=15, round_no=2)}
    members = _assert_consistent(fleet, list(round2.values()), world_size=3)
    fleet.check(set(members) == {n.node_id for n in group}, f"wrong members {members}")
    for node in survivors:
        old, new = round1[node.node_id]["rank"], round2[node.node_id]["rank"]
        fleet.check(old == new, f"survivor {node.node_id} changed rank {old} -> {new}")
    fleet.check(round2[newcomer.node_id]["rank"] == 1, "the new node did not get the free rank")
    print(
        "round 2 completed in "
        f"{[round(round2[n.node_id]['elapsed'], 2) for n in group]} s (survivors, new node)"
    )


def test_other_run_id_never_sees_old_state(
    fleet: Fleet, rdzv_params: Callable[..., RendezvousParameters]
) -> None:
    # Run A: two complete (room for a third), then a third waits for A's next round.
    params_a = rdzv_params("job", min_nodes=2, max_nodes=3, last_call_timeout=1)
    # Run B, same key prefix, an id that A's is a prefix of.
    params_b = rdzv_params("job-b", min_nodes=1, max_nodes=1)
    group_a = [_start(fleet, f"a{i}", params_a, use_torch=False) for i in range(3)]
    b = _start(fleet, "b", params_b, use_torch=False)
    _ready(fleet)
    _join(group_a[:2])

    members_a = fleet.wait_until("run A completing", lambda: _completed(group_a[:2], 2), 15)
    waiter = group_a[2]
    _join([waiter])
    fleet.wait(waiter, "key-written", 10, lambda e: e["round"] == 2)
    for node in members_a:
        fleet.wait(node, "waiting", 10, lambda e: e["n"] >= 1)

    _join([b])
    (result,) = _rendezvous(fleet, [b], timeout=10)
    fleet.check(
        (result["rank"], result["world_size"], result["round"], result["members"])
        == (0, 1, 1, [b.node_id]),
        f"run B did not complete alone in its round 1: {result}",
    )
    fleet.check(result["elapsed"] < 3, f"run B took {result['elapsed']:.2f} s alone")
    print(f"run B completed alone in {result['elapsed']:.2f} s")

    # Run A is untouched by B: still exactly one node waiting, which did not complete.
    for node in members_a:
        fleet.check(fleet.request(node, "status")["waiting"] == 1, "run A counts run B's node")
    fleet.check(not waiter.events("round"), "run A's waiting node completed")
    fleet.check(fleet.request(b, "status")["waiting"] == 0, "run B counts run A's nodes")


def test_join_rides_out_an_etcd_outage(
    fleet: Fleet, etcd_variant: str, etcd_api: str, etcd_key_prefix: str
) -> None:
    """etcd is down for a while (every request refused) while a node waits in a round:
    the join tries again until etcd is back, within join_timeout, instead of failing
    on the first refused request."""
    outage = 4.0
    with EtcdServer("outage", **variant_server_options(etcd_variant)) as server:
        params = server.params(
            "run",
            backend="etcd-rdzv",
            key_prefix=etcd_key_prefix,
            api=etcd_api,
            min_nodes=2,
            max_nodes=2,
            join_timeout=60,
            read_timeout=2,
            keep_alive_interval=KEEP_ALIVE_INTERVAL,
            keep_alive_max_attempt=KEEP_ALIVE_MAX_ATTEMPT,
        )
        first = _start(fleet, "first", params, use_torch=False)
        second = _start(fleet, "second", params, use_torch=False)
        _ready(fleet)
        _join([first])
        # The premise: the first node has settled into waiting for the second, as the
        # coordinator of round 1.
        fleet.wait_until(
            "the first node coordinating round 1",
            lambda: True if "coordinates round 1" in first.stderr() else None,
            10,
            alive=[first],
        )
        server.kill()
        time.sleep(outage)
        fleet.check(not first.events("error"), "the waiting node failed during the outage")
        server.start()  # same ports and data
        _join([second])
        results = _rendezvous(fleet, [first, second], timeout=40)
    _assert_consistent(fleet, results, world_size=2)
    log = first.stderr()
    fleet.check("trying again" in log, "the waiting node never saw a failed request")
    print(f"completion after an outage of {outage:.0f} s: {[r['elapsed'] for r in results]}")
